"""The guard's counters (fusion_pass/runtime/counters.py): one append per recorded call, added up when read, exactly
what a per-call sum gives; listeners called at the first change after a read."""

import random
import threading

import pytest

from fusion_pass.runtime import counters
from fusion_pass.runtime.guard import Decision


@pytest.fixture(autouse=True)
def zeroed():
    counters.reset_counters()
    yield
    counters.reset_counters()


def decisions():
    """Decisions of every kind, some handed out many times (as the guard does: one object per step)."""
    return [Decision("fused", None, "reference", "d", 12, 12, {}),
            Decision("partial", None, "triton", "d", 20, 8, {"chunked_prefill": 12, "decode_tokens": 3}),
            Decision.fallback("decode_tokens", "d", 0, 4),
            Decision.fallback("no_backend", "d", 7, 9),
            Decision.fallback("no_attention_metadata", "d")]


def expected(calls):
    """The per-call sums, counted one by one (what counters() must equal)."""
    out = {"fused": 0, "fused_by_backend": {}, "fallback": {},
           "tokens": {"prefill": 0, "prefill_fused": 0, "decode_fused": 0, "post_quantized": {}}}
    for d, _ in calls:
        if d.fused:
            out["fused"] += 1
            out["fused_by_backend"][d.backend] = out["fused_by_backend"].get(d.backend, 0) + 1
        else:
            out["fallback"][d.reason] = out["fallback"].get(d.reason, 0) + 1
        out["tokens"]["prefill"] += d.prefill_tokens
        out["tokens"]["prefill_fused"] += d.fused_tokens
        for k, n in d.post_quantized.items():
            out["tokens"]["post_quantized"][k] = out["tokens"]["post_quantized"].get(k, 0) + n
    return out


@pytest.mark.parametrize("seed", range(4))
def test_sums_equal_per_call_counts_across_folds_reads_and_layers(seed):
    rng = random.Random(seed)
    kinds, names = decisions(), [None, "a.attn", "b.attn", "c.attn"]
    calls = []
    for _ in range(rng.randrange(1, 3) * counters.FOLD_AT + rng.randrange(counters.FOLD_AT)):  # past a fold
        call = (rng.choice(kinds), rng.choice(names))
        counters.record(*call)
        calls.append(call)
        if rng.random() < 0.001:  # reads in between
            assert counters.counters() == expected(calls)
    assert counters.counters() == expected(calls)
    for name in names[1:]:
        assert counters.counters(layers=name) == expected([c for c in calls if c[1] == name])
    assert counters.counters(layers=["a.attn", "b.attn", "a.attn"]) == \
        expected([c for c in calls if c[1] in ("a.attn", "b.attn")])
    assert counters.counters(layers=[]) == expected([])


def test_forget_layer_keeps_the_calls_recorded_before_it_under_the_total_only():
    fused, fallback = decisions()[0], decisions()[2]
    counters.record(fused, "x.attn")
    counters.record(fallback, "x.attn")
    counters.forget_layer("x.attn")  # a new layer registered under the name
    counters.record(fallback, "x.attn")
    assert counters.counters(layers="x.attn") == expected([(fallback, "x.attn")])
    assert counters.counters() == expected([(fused, None), (fallback, None), (fallback, None)])


def test_calls_recorded_from_several_threads_are_all_counted():
    kinds = decisions()
    per_thread, threads = 3 * counters.FOLD_AT // 2, 4
    stop = threading.Event()

    def record(i):
        for j in range(per_thread):
            counters.record(kinds[(i + j) % len(kinds)], f"t{i}.attn")

    def read():
        while not stop.is_set():
            counters.counters()

    reader = threading.Thread(target=read)
    reader.start()
    workers = [threading.Thread(target=record, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    reader.join()
    calls = [(kinds[(i + j) % len(kinds)], f"t{i}.attn") for i in range(threads) for j in range(per_thread)]
    assert counters.counters() == expected(calls)
    assert counters.counters(layers="t2.attn") == expected([c for c in calls if c[1] == "t2.attn"])


def test_a_listener_is_called_at_the_first_change_after_a_read():
    calls = []
    listener = lambda: calls.append(1)  # noqa: E731  (reads nothing)
    counters.add_listener(listener)
    try:
        fused = decisions()[0]
        counters.record(fused)
        counters.record(fused)
        assert calls == [1]  # nobody read the counters since: not called again
        counters.counters()
        counters.record(fused)
        assert calls == [1, 1]
        counters.reset_counters()  # a change: called
        assert calls == [1, 1, 1]
    finally:
        counters.remove_listener(listener)
    counters.counters()
    counters.record(decisions()[0])
    assert calls == [1, 1, 1]


def test_bad_decisions_and_layer_names_are_refused_before_anything_is_counted():
    with pytest.raises(ValueError, match="decision.path must be"):
        counters.record(Decision("maybe", None, None))
    with pytest.raises(ValueError, match="record: layer_name must be a str or None, got int 3"):
        counters.record(decisions()[0], 3)
    assert counters.counters() == expected([])
