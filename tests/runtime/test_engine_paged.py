"""The stand-in engine's standard layers over their paged KV cache, and a mixed call in one paged fused launch.

Generated schedules (seeded, the seed in every message) of steps with decode rows, new prefills, prefills after
cached context and requests started afresh under a used id, over page sizes 16, 1, 3, 5 and 7 (requests cross page
boundaries; pools grow and freed pages are taken again), run through the attention op:

* the reference backend (named, and under ``auto`` on the CPU): a mixed call is one launch over the pages
  (``decode_fused``), every byte of it ``nvfp4.quantize`` of float32 attention over the tokens appended so far (the
  reference contract), on two poisons; the other calls as before;
* the Triton backend (its interpreter on the CPU, compiled on CUDA): the one call writes the bytes of the Triton
  varlen kernel over the same keys laid out contiguously (the paged kernel's contract, tests/kernels/test_paged.py);
* after every step the cache holds exactly the tokens appended per request, on distinct pages.

Also: the cache's transaction (a failed call, nested and concurrent transactions put back lengths and pages and
give pages back), the context rows read from pages, copies, the refusals that keep the split (float32 queries,
keys in another dtype, a backend without a paged launch, the measured policy under ``auto`` on SM90).
"""

from __future__ import annotations

import copy
import pickle
import random
import threading

import pytest
import torch

from fusion_pass import kernels, nvfp4, runtime
from fusion_pass.kernels import launchers
from fusion_pass.kernels.reference import dense_attention
from fusion_pass.nvfp4 import ArgumentError
from fusion_pass.runtime import backends, counters, policy, settings
from fusion_pass.runtime.engine.paged_cache import PagedCache
from layer_cases import GQA_DIMS, GS, OPS, Layer, cuda_backend_reason

PAGE_SIZES = [16, 1, 3, 5, 7]


@pytest.fixture(autouse=True)
def _clean_state(clean_backend_state):
    yield


@pytest.fixture
def make_layer():
    names = []

    def make(page_size, device="cpu"):
        d = GQA_DIMS
        impl = runtime.AttentionImpl(**d, softmax_scale=d["head_dim"] ** -0.5, page_size=page_size)

        def inputs(t, gen, dtype):
            return tuple(torch.randn(t, h, d["head_dim"], generator=gen).to(device, dtype)
                         for h in (d["num_heads"], d["num_kv_heads"], d["num_kv_heads"]))

        name = f"test_engine_paged.{len(names)}"
        runtime.register_layer(name, impl)
        names.append(name)
        return Layer(name, impl, OPS.attention_with_output, inputs)

    yield make
    for name in names:
        runtime.unregister_layer(name)


def schedule(seed: int, page_size: int, steps: int, *, mixed_only: bool = False) -> list[runtime.BatchSpec]:
    """A serving schedule: decodes of cached requests first, then new prefills, chunks after cached context and now
    and then a used id started afresh (its old pages given back). Without ``mixed_only`` the first step is
    prefills only and a later one decodes only; with it every step has decode and prefill rows."""
    rng = random.Random(seed)
    held: dict[str, int] = {}
    specs, fresh = [], 0
    for step in range(steps):
        decode_only = not mixed_only and step == steps - 2
        decodes = rng.sample(sorted(held), min(len(held), rng.randint(1, 3))) if held and step else []
        if mixed_only and not decodes:  # a decode with nothing cached yet: one new token
            decodes, fresh = [f"n{fresh}"], fresh + 1
        requests = [runtime.RequestSpec(r, 1, held.get(r, 0)) for r in decodes]
        if not decode_only:
            for _ in range(rng.randint(1, 3)):
                q = rng.randint(2, 2 * page_size + 3)
                others = sorted(set(held) - {r.request_id for r in requests})
                kind = rng.choice(["new", "chunk", "again"]) if others else "new"
                if kind == "new":
                    rid, fresh = f"n{fresh}", fresh + 1
                    requests.append(runtime.RequestSpec(rid, q, 0))
                else:
                    rid = rng.choice(others)
                    requests.append(runtime.RequestSpec(rid, q, held[rid] if kind == "chunk" else 0))
        for r in requests:
            held[r.request_id] = r.context_len + r.query_len
        specs.append(runtime.BatchSpec(tuple(requests)))
    return specs


class Record:
    """The tokens appended per request, as the test sees them: ``k``, ``v`` ``[length, Hkv, D]``."""

    def __init__(self):
        self.tokens: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def append(self, spec, k, v) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each request's keys and values after this step, in the spec's order."""
        locs, out = spec.query_start_loc(), []
        for r, a, b in zip(spec.requests, locs[:-1], locs[1:]):
            old = self.tokens.get(r.request_id) if r.context_len else None
            new = (k[a:b], v[a:b]) if old is None else (torch.cat([old[0], k[a:b]]), torch.cat([old[1], v[a:b]]))
            self.tokens[r.request_id] = new
            out.append(new)
        return out


def attention32(spec, q, kv, scale) -> torch.Tensor:
    """float32 attention ``[T, H*Dv]`` of every request over its keys so far, the causal mask offset by its
    context."""
    locs, rows = spec.query_start_loc(), []
    for r, a, b, (k, v) in zip(spec.requests, locs[:-1], locs[1:], kv):
        rows.append(dense_attention(q[a:b], k, v, scale=scale, causal=True, q_offset=r.context_len)[0])
    out = torch.cat(rows)
    return out.reshape(out.shape[0], -1)


def assert_cache_holds(impl, record, what):
    """The cache's entries are the appended tokens; each request's pages are its own; pages in use as needed."""
    entries = impl.cache.entries()
    assert set(entries) == set(record.tokens), what
    for rid, (k, v) in record.tokens.items():
        assert torch.equal(entries[rid][0], k) and torch.equal(entries[rid][1], v), f"{what}: request {rid}"
    pages = [p for rid in entries for p in impl.cache.entry(rid).pages]
    assert len(pages) == len(set(pages)) == sum(-(-k.shape[0] // impl.page_size) for k, _ in record.tokens.values())
    counts = impl.cache.page_counts()
    assert counts["allocated"] - counts["free"] == len(pages), what


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("choice", ["reference", "auto"])
def test_mixed_calls_are_one_paged_launch_with_the_reference_bytes(make_layer, page_size, choice):
    seed = random.SystemRandom().randrange(2**31)
    specs = schedule(seed, page_size, steps=7)
    layer = make_layer(page_size)
    steps = [(spec, layer.inputs(spec.num_tokens, seed=seed + i)) for i, spec in enumerate(specs)]
    runs = []
    with settings.use_backend(None if choice == "auto" else choice):
        for poison in ((0xAB, 0xFF), (0x00, 0x00)):
            layer.impl.clear_cache()
            record, run = Record(), []
            for i, (spec, inputs) in enumerate(steps):
                what = f"seed {seed}, page size {page_size}, step {i} ({spec.kind}: {spec.requests})"
                counters.reset_counters()
                run.append(layer.call(spec, inputs, GS, poison=poison))
                kv = record.append(spec, *inputs[1:])
                assert_cache_holds(layer.impl, record, what)
                d, prefill = spec.num_decode_tokens, spec.num_tokens - spec.num_decode_tokens
                want = attention32(spec, inputs[0], kv, layer.impl.softmax_scale)
                if not prefill:  # decode only: the exact fallback, the unfused graph's bytes
                    want = want.to(torch.bfloat16)
                packed, scales = nvfp4.quantize(want, GS)
                assert torch.equal(run[-1][0], packed) and torch.equal(run[-1][1], scales.view(torch.uint8)), what
                tokens = counters.counters()["tokens"]
                if prefill:
                    assert counters.counters()["fused_by_backend"] == {"reference": 1}, what
                    assert tokens == {"prefill": prefill, "prefill_fused": prefill, "decode_fused": d,
                                      "post_quantized": {}}, what
                else:
                    assert counters.counters()["fallback"] == {"decode_tokens": 1}, what
            runs.append(run)
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), f"seed {seed}: step {i}'s bytes depend on poison"
    assert any(s.kind == "mixed" for s in specs)


@pytest.mark.parametrize("page_size", [16, 1, 5])
def test_triton_one_call_writes_the_varlen_kernels_bytes_over_the_same_keys(make_layer, monkeypatch, page_size):
    if torch.cuda.is_available():
        reason = cuda_backend_reason("triton")
        if reason:
            pytest.skip(reason)
        device = "cuda"
    else:
        assert kernels.interpreter_enabled(), "conftest.py sets TRITON_INTERPRET on a machine without CUDA"
        device = "cpu"  # the Triton kernels in the interpreter: the backend taken as available on the CPU
        monkeypatch.setattr(backends.TritonBackend, "available", lambda self: (True, "Triton's interpreter"))
        monkeypatch.setattr(backends.TritonBackend, "supports", lambda self, *args: (True, "ok"))
    seed = random.SystemRandom().randrange(2**31)
    layer = make_layer(page_size, device)
    record = Record()
    width = layer.width
    for i, spec in enumerate(schedule(seed, page_size, steps=3, mixed_only=True)):
        what = f"seed {seed}, page size {page_size}, step {i}: {spec.requests}"
        q, k, v = layer.inputs(spec.num_tokens, seed=seed + i)
        t = spec.num_tokens
        got_packed = torch.full((t, width // 2), 0xAB, dtype=torch.uint8, device=device)
        rows, cols = nvfp4.scale_shape(t, width)
        got_scales = torch.full((rows, cols), 0xAB, dtype=torch.uint8, device=device)
        counters.reset_counters()
        with settings.use_backend("triton"), runtime.batch(spec):
            layer.op(q, k, v, got_packed, layer.name, GS.to(device), got_scales)
        assert counters.counters()["tokens"]["decode_fused"] == spec.num_decode_tokens, what
        assert counters.counters()["fused_by_backend"] == {"triton": 1}, what
        kv = record.append(spec, k, v)
        assert_cache_holds(layer.impl, record, what)
        lens = [kk.shape[0] for kk, _ in kv]
        cu_k = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        want_packed = torch.full_like(got_packed, 0x00)
        want_scales = torch.full_like(got_scales, 0x00)
        launchers.flash_attention_nvfp4_varlen(
            q, torch.cat([kk for kk, _ in kv]), torch.cat([vv for _, vv in kv]),
            cu_seqlens=torch.tensor(spec.query_start_loc(), dtype=torch.int32, device=device),
            max_seqlen=max(r.query_len for r in spec.requests), softmax_scale=layer.impl.softmax_scale, causal=True,
            output=want_packed, output_scale=GS.to(device), output_block_scale=want_scales, cu_seqlens_k=cu_k,
            max_seqlen_k=max(lens))
        assert torch.equal(got_packed, want_packed) and torch.equal(got_scales, want_scales), what


# ---------------------------------------------------------------- rollback


def _state(impl):
    counts = impl.cache.page_counts()
    return ({rid: [t.float().tolist() for t in e] for rid, e in impl.cache.entries().items()},
            {rid: impl.cache.entry(rid).pages for rid in impl.cache.entries()}, counts["allocated"] - counts["free"])


@pytest.mark.parametrize("page_size", [16, 3])
def test_a_one_call_failing_after_the_append_rolls_the_pages_back(make_layer, monkeypatch, page_size):
    seed = random.SystemRandom().randrange(2**31)
    layer = make_layer(page_size)
    specs = schedule(seed, page_size, steps=4, mixed_only=True)
    history = [(s, layer.inputs(s.num_tokens, seed=seed + i)) for i, s in enumerate(specs)]
    for spec, inputs in history[:-1]:
        layer.call(spec, inputs, GS)
    before, calls = _state(layer.impl), counters.counters()
    spec, inputs = history[-1]
    seen = []

    def failing(self, q, k_cache, *args):
        seen.append(layer.impl.cache.page_counts())  # the new tokens are in the pages by now
        raise RuntimeError("kernel failed part-way")

    with monkeypatch.context() as m, pytest.raises(RuntimeError, match="part-way"):
        m.setattr(backends.ReferenceBackend, "run_paged", failing)
        layer.call(spec, inputs, GS)
    assert seen and _state(layer.impl) == before, f"seed {seed}: the failed call's tokens and pages are gone"
    assert counters.counters() == calls, f"seed {seed}: a failed call is not counted"
    retry = layer.call(spec, inputs, GS)
    layer.impl.clear_cache()
    for s, i in history:
        fresh = layer.call(s, i, GS)
    assert torch.equal(retry[0], fresh[0]) and torch.equal(retry[1], fresh[1]), f"seed {seed}"


def _rows(n, value, width=2):
    return (torch.full((n, width), float(value)),)


def test_transactions_put_back_pages_and_nest():
    cache = PagedCache(page_size=2)
    cache.extend(runtime.RequestSpec("keep", 3, 0), _rows(3, 1))
    kept = cache.entry("keep")
    assert cache.page_counts() == {"allocated": 4, "free": 2}
    with pytest.raises(RuntimeError):
        with cache.transaction():
            cache.extend(runtime.RequestSpec("keep", 2, 3), _rows(2, 2))  # appends into its last page, then a new one
            cache.extend(runtime.RequestSpec("new", 5, 0), _rows(5, 3))  # grows the pool
            with cache.transaction():  # a finished inner transaction's changes are the outer one's
                cache.extend(runtime.RequestSpec("new", 1, 5), _rows(1, 4))
            raise RuntimeError("outer")
    assert cache.entry("keep") is kept and cache.entry("new") is None
    assert torch.equal(cache.entries()["keep"][0], _rows(3, 1)[0])
    counts = cache.page_counts()
    assert counts["allocated"] - counts["free"] == 2
    # a request started afresh inside a transaction: its old pages come back when the outermost one finishes
    with cache.transaction():
        cache.extend(runtime.RequestSpec("keep", 4, 0), _rows(4, 5))
        with pytest.raises(RuntimeError), cache.transaction():
            cache.extend(runtime.RequestSpec("keep", 1, 4), _rows(1, 6))
            raise RuntimeError("inner")
        assert cache.length("keep") == 4
        assert cache.page_counts()["free"] == counts["free"] - 2, "the replaced pages are held until the end"
    assert set(cache.entry("keep").pages).isdisjoint(kept.pages)
    assert cache.page_counts()["allocated"] - cache.page_counts()["free"] == 2
    cache.extend(runtime.RequestSpec("other", 4, 0), _rows(4, 7))
    assert set(cache.entry("other").pages) & set(kept.pages), "given-back pages are taken again"


def test_a_transaction_leaves_what_another_thread_wrote_meanwhile():
    cache = PagedCache(page_size=3)
    cache.extend(runtime.RequestSpec("x", 2, 0), _rows(2, 1))
    started, wrote = threading.Event(), threading.Event()

    def other():
        started.wait(30)
        cache.extend(runtime.RequestSpec("y", 7, 0), _rows(7, 2))
        cache.extend(runtime.RequestSpec("x", 4, 2), _rows(4, 3))
        wrote.set()

    thread = threading.Thread(target=other)
    thread.start()
    with pytest.raises(RuntimeError):
        with cache.transaction():
            cache.extend(runtime.RequestSpec("z", 5, 0), _rows(5, 4))
            started.set()
            assert wrote.wait(30)
            raise RuntimeError("fails after the other thread wrote")
    thread.join(30)
    entries = cache.entries()
    assert {rid: e[0].shape[0] for rid, e in entries.items()} == {"x": 6, "y": 7}
    assert torch.equal(entries["x"][0], torch.cat([_rows(2, 1)[0], _rows(4, 3)[0]]))
    assert torch.equal(entries["y"][0], _rows(7, 2)[0])
    counts = cache.page_counts()
    assert counts["allocated"] - counts["free"] == 2 + 3


# ---------------------------------------------------------------- the cache itself


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_context_rows_are_read_from_the_pages(make_layer, page_size):
    """``prefill_qkv``'s context rows: any range of the packed context of the prefills, as appended."""
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    layer = make_layer(page_size)
    first = runtime.BatchSpec.from_lens([rng.randint(2, 40) for _ in range(3)], request_ids=["a", "b", "c"])
    layer.impl.forward(*layer.inputs(first.num_tokens, seed=seed), first)
    held = layer.impl.cache.entries()
    spec = runtime.BatchSpec.from_lens([3, 2, 4], [held["a"][0].shape[0], 0, held["c"][0].shape[0]],
                                       request_ids=["a", "b", "c"])
    _, _, _, context = layer.impl.prefill_qkv(*layer.inputs(spec.num_tokens, seed=seed + 1), spec)
    packed = [torch.cat([held[r][f] for r in ("a", "c")]) for f in (0, 1)]
    for _ in range(20):
        lo = rng.randint(0, packed[0].shape[0])
        hi = rng.randint(lo, packed[0].shape[0])
        k, v = context(lo, hi)
        assert torch.equal(k, packed[0][lo:hi]) and torch.equal(v, packed[1][lo:hi]), f"seed {seed}: [{lo}, {hi})"


def test_copies_snapshots_and_argument_errors():
    cache = PagedCache(page_size=4)
    cache.extend(runtime.RequestSpec("x", 6, 0), (torch.arange(12.0).view(6, 2), torch.ones(6, 1)))
    for clone in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert clone.page_size == 4 and torch.equal(clone.entries()["x"][0], cache.entries()["x"][0])
        clone.extend(runtime.RequestSpec("x", 1, 6), (torch.zeros(1, 2), torch.zeros(1, 1)))
        assert (clone.length("x"), cache.length("x")) == (7, 6)
    snapshot = cache.entries()
    cache.extend(runtime.RequestSpec("x", 3, 6), (torch.zeros(3, 2), torch.zeros(3, 1)))
    cache.restore(snapshot)
    assert torch.equal(cache.entries()["x"][0], torch.arange(12.0).view(6, 2)) and cache.length("x") == 6
    with pytest.raises(ValueError, match="batch says context_len=5 but the cache holds 6 tokens"):
        cache.extend(runtime.RequestSpec("x", 1, 5), (torch.zeros(1, 2), torch.zeros(1, 1)))
    assert cache.length("x") == 6
    with pytest.raises(ArgumentError, match="new must hold sum"):
        cache.extend(runtime.RequestSpec("x", 2, 6), (torch.zeros(1, 2), torch.zeros(1, 1)))
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ArgumentError, match="page_size must be a positive int"):
            PagedCache(page_size=bad)
        with pytest.raises(ArgumentError, match="AttentionImpl: page_size must be a positive int"):
            runtime.AttentionImpl(num_heads=2, num_kv_heads=1, head_dim=16, softmax_scale=0.25, page_size=bad)


@pytest.mark.parametrize("bad, message", [
    ({"zz": (torch.zeros(3, 2), torch.zeros(5, 1))}, "request 'zz': its tensors must share the token count"),
    ({"zz": (torch.zeros(3, 4), torch.zeros(3, 1))}, r"request '(zz|a)' has rows \[\((4|2),\), \(1,\)\], the others"),
    ({"zz": [torch.zeros(3, 2), torch.zeros(3, 1)]}, "request 'zz' must be a tuple of tensors"),
])
@pytest.mark.parametrize("bad_first", [True, False])
def test_a_bad_snapshot_is_refused_before_the_cache_changes(bad, message, bad_first):
    cache = PagedCache(page_size=2)
    for rid, n in (("a", 5), ("b", 3)):
        cache.extend(runtime.RequestSpec(rid, n, 0), (torch.randn(n, 2), torch.randn(n, 1)))
    before, pages = cache.entries(), cache.page_counts()
    good = cache.entries()
    snapshot = {**bad, **good} if bad_first else {**good, **bad}
    with pytest.raises(ArgumentError, match=message):
        cache.restore(snapshot)
    after = cache.entries()
    assert after.keys() == before.keys() and cache.page_counts() == pages
    assert all(torch.equal(x, y) for rid in before for x, y in zip(after[rid], before[rid]))


def test_tokens_in_another_dtype_move_the_request_to_the_promoted_pool():
    cache = PagedCache(page_size=3)
    bf16 = torch.randn(4, 2).to(torch.bfloat16)
    cache.extend(runtime.RequestSpec("x", 4, 0), (bf16,))
    f32 = torch.randn(2, 2)
    cache.extend(runtime.RequestSpec("x", 2, 4), (f32,))
    assert cache.entry("x").dtypes == (torch.float32,)
    assert torch.equal(cache.entries()["x"][0], torch.cat([bf16.float(), f32]))
    with pytest.raises(ValueError, match="one launch reads one"):
        cache.view([cache.entry("x"), cache.extend(runtime.RequestSpec("y", 1, 0), (bf16[:1],))])


# ---------------------------------------------------------------- what keeps the split


class _NoPagedLaunch(backends.ReferenceBackend):
    name = "nopaged"
    handles_paged = False


@pytest.mark.parametrize("case", ["float32 queries", "float32 keys", "float32 cache", "no paged launch", "sm90 auto"])
def test_what_keeps_the_split(make_layer, monkeypatch, case):
    """A mixed call that cannot be one launch over the pages keeps the split (decode rows post-quantized: the
    unfused graph's bytes) or, under ``auto`` where the policy fuses no mixed call, falls back; a named backend
    still runs the one call there."""
    layer = make_layer(16)
    q_dtype = torch.float32 if case == "float32 queries" else torch.bfloat16
    first = runtime.BatchSpec.from_lens([5, 3])
    kv_first = torch.float32 if case == "float32 cache" else q_dtype
    q0, k0, v0 = layer.inputs(first.num_tokens, seed=7, dtype=q_dtype)
    layer.call(first, (q0, k0.to(kv_first), v0.to(kv_first)), GS)
    spec = runtime.BatchSpec.from_lens([1, 1, 6], [5, 3, 0])
    q, k, v = layer.inputs(spec.num_tokens, seed=8, dtype=q_dtype)
    if case == "float32 keys":
        k, v = k.float(), v.float()
    if case == "no paged launch":
        stand_in = _NoPagedLaunch()
        monkeypatch.setattr(backends, "select_backend", lambda *a, **kw: (stand_in, "stand-in"))
        monkeypatch.setattr(backends, "get_backend", lambda name: stand_in)
    if case == "sm90 auto":
        monkeypatch.setattr(policy, "generation", lambda device: "sm90")
    refusal = layer.impl.paged_refusal(q, k, v, spec)
    assert (refusal is None) == (case in ("no paged launch", "sm90 auto")), refusal
    start = layer.impl.cache.entries()
    counters.reset_counters()
    got = layer.call(spec, (q, k, v), GS)
    counts = counters.counters()
    if case == "sm90 auto":  # neither the one call nor the split is measured faster there
        assert counts["fallback"] == {"slower_here": 1}, counts
        layer.impl.cache.restore(start)
        counters.reset_counters()
        with settings.use_backend("reference"):
            layer.call(spec, (q, k, v), GS)
        assert counters.counters()["tokens"]["decode_fused"] == 2
        return
    assert counts["tokens"]["decode_fused"] == 0 and counts["tokens"]["post_quantized"] == {"decode_tokens": 2}
    layer.impl.cache.restore(start)
    unfused = layer.call_unfused(spec, (q, k, v), GS)
    assert torch.equal(got[0][:2], unfused[0][:2]), "post-quantized decode rows: the unfused graph's bytes"
