"""The per-request cache's transaction: a failing call undoes its own changes and nobody else's (other threads',
other requests'), nested transactions included."""

import threading

import pytest
import torch

import fusion_pass  # noqa: F401  (registers the ops)
from fusion_pass import runtime
from fusion_pass.runtime import counters
from fusion_pass.runtime.backends.reference import ReferenceBackend
from fusion_pass.runtime.engine.cache import RequestCache
from layer_cases import GS


@pytest.fixture(autouse=True)
def _clean_state(clean_backend_state):
    yield


def _entry(n, value):
    return (torch.full((n, 2), float(value)),)


def _ids(cache):
    return {rid: tuple(id(t) for t in entry) for rid, entry in cache.entries().items()}


def test_a_failing_call_on_one_thread_keeps_another_threads_finished_cache_writes(layer, monkeypatch):
    """Thread A's call appends its tokens, then waits while thread B runs a whole call on the same layer, then
    fails: A's tokens are gone, B's stay, and so does what was cached before either."""
    base = runtime.BatchSpec.from_lens([4], request_ids=["old"])
    layer.call(base, layer.inputs(base.num_tokens, seed=1), GS)
    before = _ids(layer.impl.cache)

    spec_a = runtime.BatchSpec.from_lens([5, 3], request_ids=["a0", "a1"])
    spec_b = runtime.BatchSpec.from_lens([1, 6], [4, 0], request_ids=["old", "b1"])
    inputs_a = layer.inputs(spec_a.num_tokens, seed=2)
    inputs_b = layer.inputs(spec_b.num_tokens, seed=3)
    a_extended, b_done = threading.Event(), threading.Event()
    run_varlen = ReferenceBackend.run_varlen

    def run_varlen_failing_on_a(self, *args, **kwargs):
        if threading.current_thread().name == "call-a":  # A's tokens are in the cache by now
            a_extended.set()
            assert b_done.wait(30)
            raise RuntimeError("kernel failed part-way")
        return run_varlen(self, *args, **kwargs)

    monkeypatch.setattr(ReferenceBackend, "run_varlen", run_varlen_failing_on_a)
    errors = {}

    def call_a():
        try:
            layer.call(spec_a, inputs_a, GS)
        except RuntimeError as exc:
            errors["a"] = exc

    thread_a = threading.Thread(target=call_a, name="call-a")
    thread_a.start()
    assert a_extended.wait(30)
    assert layer.impl.cache_len("a0") == 5 and layer.impl.cache_len("a1") == 3
    counters.reset_counters()

    def call_b():
        try:
            layer.call(spec_b, inputs_b, GS)
        finally:
            b_done.set()

    thread_b = threading.Thread(target=call_b, name="call-b")
    thread_b.start()
    thread_b.join(30)
    thread_a.join(30)
    assert "kernel failed part-way" in str(errors["a"])
    assert counters.counters()["fused"] == 1  # B's call only

    after = _ids(layer.impl.cache)
    assert set(after) == {"old", "b1"}, "A's requests are rolled back, B's survive"
    assert layer.impl.cache_len("old") == 5 and layer.impl.cache_len("b1") == 6
    assert after["old"] != before["old"]  # B's decode extended it: A's failure did not put the old entry back


def test_transactions_undo_only_their_own_requests_and_nest():
    cache = RequestCache()
    keep = runtime.RequestSpec("keep", 2, 0)
    cache.extend(keep, _entry(2, 1))
    kept = cache.entries()["keep"]
    outer_req, inner_req = runtime.RequestSpec("outer", 3, 0), runtime.RequestSpec("inner", 4, 0)

    # a failing inner transaction undoes its own change only; the outer one finishes and keeps everything else
    with cache.transaction():
        cache.extend(outer_req, _entry(3, 2))
        with pytest.raises(RuntimeError):
            with cache.transaction():
                cache.extend(inner_req, _entry(4, 3))
                cache.extend(runtime.RequestSpec("keep", 1, 2), _entry(1, 4))
                assert cache.length("keep") == 3
                raise RuntimeError("inner")
        assert cache.length("inner") == 0 and "inner" not in cache.entries()
        assert cache.entries()["keep"] is kept
    assert cache.length("outer") == 3

    # a finished inner transaction's changes become the outer one's: the outer failure undoes both
    outer_entry = cache.entries()["outer"]
    with pytest.raises(RuntimeError):
        with cache.transaction():
            cache.extend(runtime.RequestSpec("outer", 2, 3), _entry(2, 5))
            with cache.transaction():
                cache.extend(inner_req, _entry(4, 6))
                cache.extend(runtime.RequestSpec("outer", 1, 5), _entry(1, 7))
            assert cache.length("outer") == 6
            raise RuntimeError("outer")
    assert set(cache.entries()) == {"keep", "outer"}
    assert cache.entries()["outer"] is outer_entry and cache.entries()["keep"] is kept


def test_a_transaction_leaves_entries_another_thread_wrote_during_it():
    cache = RequestCache()
    cache.extend(runtime.RequestSpec("x", 2, 0), _entry(2, 1))
    started, wrote = threading.Event(), threading.Event()

    def other():
        started.wait(30)
        cache.extend(runtime.RequestSpec("y", 3, 0), _entry(3, 2))  # another request
        cache.extend(runtime.RequestSpec("x", 1, 2), _entry(1, 3))  # and one this thread's transaction did not touch
        wrote.set()

    thread = threading.Thread(target=other)
    thread.start()
    with pytest.raises(RuntimeError):
        with cache.transaction():
            cache.extend(runtime.RequestSpec("z", 4, 0), _entry(4, 4))
            started.set()
            assert wrote.wait(30)
            raise RuntimeError("fails after the other thread wrote")
    thread.join(30)
    assert {rid: cache.length(rid) for rid in cache.entries()} == {"x": 3, "y": 3}


def test_a_cache_copies_with_its_entries_only():
    import copy
    import pickle

    cache = RequestCache()
    cache.extend(runtime.RequestSpec("x", 2, 0), _entry(2, 1))
    for clone in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert torch.equal(clone.entries()["x"][0], cache.entries()["x"][0])
        clone.extend(runtime.RequestSpec("x", 1, 2), _entry(1, 2))
        assert (clone.length("x"), cache.length("x")) == (3, 2)
        with pytest.raises(RuntimeError), clone.transaction():
            clone.extend(runtime.RequestSpec("y", 1, 0), _entry(1, 3))
            raise RuntimeError("rolled back")
        assert set(clone.entries()) == {"x"}
