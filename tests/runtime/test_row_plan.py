"""Prefills with cached context on the fused path (chunked prefill, prefix-cache hits), through the real ops.

Generated serving schedules (decodes, new prompts, chunks of prompts with cached context) run through the
NVFP4 attention ops with a backend whose fused call is :func:`fusion_pass.runtime.row_plan.run_on_prefill` (the
``fa4``/``triton`` backends' ``run``), on both sides of the context workspace bound: one attention over
context + new keys (``seqlen_k > seqlen_q``), or context chunks merged by log-sum-exp into NVFP4. Kernels:
the ``reference`` kernels (float32 PyTorch) and the Triton kernels (compiled on a CUDA device, Triton's interpreter on the CPU).

Checked per step against attention computed in float64 from the full sequences (every key each request has
seen, causal aligned to the end): prefill rows within the quantization bound of that attention plus the
kernels' own rounding; decode rows byte-equal to the unfused graph; every byte written; padding zero.
"""

from __future__ import annotations

import random

import pytest
import torch

import fusion_pass  # noqa: F401  (registers the ops)
from fusion_pass import kernels, nvfp4, runtime
from fusion_pass.runtime import backends, counters, row_plan, settings
from fusion_pass.kernels import launchers
from fusion_pass.demo.workload import requantization_bound
from fusion_pass.ops import scaled_fp4_quant

OPS = torch.ops.fusion_pass
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MLA = dict(num_heads=2, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, kv_lora_rank=32)
GQA = dict(num_heads=4, num_kv_heads=2, head_dim=32, v_head_dim=16)


@pytest.fixture(autouse=True)
def _clean_state(clean_backend_state):
    yield


class KernelBackend:
    """A fused backend over one kernel family of :mod:`fusion_pass.kernels` (``reference`` or ``triton``),
    run by the row plan as the ``fa4``/``triton`` backends are (:func:`fusion_pass.runtime.row_plan.run_on_prefill`)."""

    handles_context = True

    def __init__(self, kernel: str) -> None:
        self.name, self.kernel = f"kernels.{kernel}", kernel

    def run_varlen(self, q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, output_scale, output_block_scale,
                   *, cu_seqlens_k=None, max_seqlen_k=None):
        if self.kernel == "triton":
            backends.TritonBackend().run_varlen(q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, output_scale,
                                                output_block_scale, cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
        else:
            backends.ReferenceBackend().run_varlen(q, k, v, cu_seqlens, max_seqlen, softmax_scale, output,
                                                   output_scale, output_block_scale, cu_seqlens_k=cu_seqlens_k,
                                                   max_seqlen_k=max_seqlen_k)

    def attention_lse(self, q, k, v, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k, softmax_scale, causal):
        return launchers.attention_with_lse_varlen(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                                   cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k,
                                                   softmax_scale=softmax_scale, causal=causal, backend=self.kernel)

    def merge_nvfp4(self, *args):
        launchers.merge_nvfp4_rows(self.kernel, *args)


def _layer(kind, gen):
    if kind == "mla":
        width = MLA["num_heads"] * (MLA["qk_nope_head_dim"] + MLA["v_head_dim"])
        w = (torch.randn(width, MLA["kv_lora_rank"], generator=gen) * MLA["kv_lora_rank"] ** -0.5).to(DEVICE, torch.bfloat16)
        impl = runtime.MLAAttentionImpl(**MLA, kv_b_proj_weight=w, softmax_scale=0.17)
        return impl, OPS.mla_attention_with_output

    impl = runtime.AttentionImpl(**GQA, softmax_scale=0.17)
    return impl, OPS.attention_with_output


def _inputs(kind, t, gen):
    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, torch.bfloat16)

    if kind == "mla":
        return rand(t, MLA["num_heads"], MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"]), \
            rand(t, MLA["kv_lora_rank"]), rand(t, 1, MLA["qk_rope_head_dim"])
    return rand(t, GQA["num_heads"], GQA["head_dim"]), rand(t, 2, GQA["head_dim"]), rand(t, 2, GQA["v_head_dim"])


def _keys64(kind, impl, inputs):
    """float64 keys ``[t, Hk, Dqk]`` and values ``[t, Hk, Dv]`` of the new tokens (MLA: up-projected)."""
    if kind == "mla":
        q, kv_c, k_pe = inputs
        w = impl.kv_b_proj_weight.double().reshape(MLA["num_heads"], -1, MLA["kv_lora_rank"])
        w_uk, w_uv = w[:, : MLA["qk_nope_head_dim"]], w[:, MLA["qk_nope_head_dim"]:]
        k_nope = torch.einsum("sl,hnl->shn", kv_c.double(), w_uk)
        v = torch.einsum("sl,hvl->shv", kv_c.double(), w_uv)
        k = torch.cat([k_nope, k_pe.double().reshape(len(q), 1, -1).expand(-1, MLA["num_heads"], -1)], -1)
        return k, v
    return inputs[1].double(), inputs[2].double()


def _dense64(q, keys, values, scale):
    """float64 attention ``[Lq, H, Dv]`` of the last ``Lq`` positions over all ``Lk`` keys, causal at the end."""
    lq, h, _ = q.shape
    lk, hk, _ = keys.shape
    keys, values = keys.repeat_interleave(h // hk, 1), values.repeat_interleave(h // hk, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    visible = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lq, device=q.device)[:, None] + (lk - lq)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, values)


def _schedule(rng, steps):
    """Batches like a continuous-batching scheduler's: decodes first, then chunks of prompts with cached context
    and new prompts; ``(query_lens, context_lens, ids)`` per step."""
    cached: dict[str, int] = {}
    plans = []
    for step in range(steps):
        running = list(cached)
        rng.shuffle(running)
        chunks = running[: rng.randint(1 if step % 2 else 0, 2)]  # every other step has a chunk with context
        decodes = running[len(chunks): len(chunks) + rng.randint(0, 3)]
        fresh = [f"s{step}n{i}" for i in range(rng.randint(0 if chunks or not decodes else 1, 2))]
        if not chunks and not fresh:
            fresh = [f"s{step}n0"]
        lens = [1] * len(decodes) + [rng.randint(2, 24) for _ in chunks] + [rng.randint(2, 40) for _ in fresh]
        ids = decodes + chunks + fresh
        ctx = [cached.get(i, 0) for i in ids]
        for i, n in zip(ids, lens):
            cached[i] = cached.get(i, 0) + n
        plans.append((lens, ctx, ids))
    return plans


def _run_schedule(monkeypatch, kind, kernel, workspace_tokens, steps):
    seed = random.SystemRandom().randrange(2**31)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    impl, op = _layer(kind, gen)
    name = f"test_chunked_prefill.{kind}.{kernel}"
    runtime.register_layer(name, impl)
    fake = KernelBackend(kernel)
    monkeypatch.setattr(backends, "select_backend", lambda *a, **k: (fake, f"{fake.name} stand-in"))
    monkeypatch.setattr(backends, "get_backend", lambda name: fake)
    counters.reset_counters()
    width = impl.num_heads * impl.v_head_dim
    history: dict[str, tuple] = {}
    with_context = 0
    try:
        for lens, ctx, ids in _schedule(rng, steps):
            spec = runtime.BatchSpec.from_lens(lens, ctx, ids)
            t, d = spec.num_tokens, spec.num_decode_tokens
            inputs = _inputs(kind, t, gen)
            start = runtime.snapshot_kv_caches()
            with runtime.batch(spec):
                half = torch.empty(t, width, dtype=torch.bfloat16, device=DEVICE)
                op(*inputs, half, name)
            gs = torch.tensor([448 * 6 / max(float(half.float().abs().max()), 1e-3)], device=DEVICE)
            unfused = scaled_fp4_quant(half, gs)
            got = []
            for poison in (0xAB, 0x00):
                runtime.restore_kv_caches(start)
                rows, cols = nvfp4.scale_shape(t, width)
                packed = torch.full((t, width // 2), poison, dtype=torch.uint8, device=DEVICE)
                scales = torch.full((rows, cols), poison, dtype=torch.uint8, device=DEVICE)
                with (runtime.batch(spec), settings.use_context_workspace_tokens(workspace_tokens),
                      settings.use_policy("always")):  # every row the kernel can take, whatever the GPU policy says
                    op(*inputs, packed, name, gs, scales)
                got.append((packed, scales))
            where = f"seed {seed}, kind {kind}, kernel {kernel}, workspace {workspace_tokens}, step {spec.requests}"
            assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1]), f"unwritten bytes: {where}"
            packed, scales = got[0]
            assert torch.equal(packed[:d], unfused[0][:d]), f"decode rows: {where}"
            n_blocks = width // nvfp4.BLOCK_SIZE
            offsets = nvfp4.swizzled_offset(torch.arange(d).unsqueeze(1), torch.arange(n_blocks).unsqueeze(0),
                                            n_blocks).reshape(-1).to(DEVICE)
            assert torch.equal(scales.reshape(-1)[offsets], unfused[1].view(torch.uint8).reshape(-1)[offsets]), where
            # float64 attention of each prefill over its whole sequence
            keys, values = _keys64(kind, impl, inputs)
            ref = torch.zeros(t, impl.num_heads, impl.v_head_dim, dtype=torch.float64, device=DEVICE)
            locs = spec.query_start_loc()
            vmax = 0.0
            for r, a, b in zip(spec.requests, locs[:-1], locs[1:]):
                old_k, old_v = history.get(r.request_id, (keys[:0], values[:0]))
                all_k, all_v = torch.cat([old_k, keys[a:b]]), torch.cat([old_v, values[a:b]])
                history[r.request_id] = (all_k, all_v)
                vmax = max(vmax, float(all_v.abs().max()))
                ref[a:b] = _dense64(inputs[0][a:b], all_k, all_v, impl.softmax_scale)
                with_context += int(r.is_chunked_prefill)
            ref_packed, ref_scales = nvfp4.quantize(ref.float().reshape(t, width), gs)
            want = nvfp4.dequantize(ref_packed, ref_scales, gs, m=t)[d:]
            have = nvfp4.dequantize(packed, scales.view(torch.float8_e4m3fn), gs, m=t)[d:]
            bound = requantization_bound(want, gs) + 2.0**-6 * vmax
            assert bool(((have - want).abs() <= bound).all()), f"prefill rows off: {where}"
            padding = torch.ones(rows * cols, dtype=torch.bool, device=DEVICE)
            padding[nvfp4.swizzled_offset(torch.arange(t).unsqueeze(1), torch.arange(n_blocks).unsqueeze(0),
                                          n_blocks).reshape(-1).to(DEVICE)] = False
            assert bool((scales.reshape(-1)[padding] == 0).all()), f"padding: {where}"
        counts = counters.counters()["tokens"]
        assert counts["prefill_fused"] == counts["prefill"], counts
    finally:
        runtime.unregister_layer(name)
    return with_context


@pytest.mark.parametrize("kind", ["mla", "gqa"])
@pytest.mark.parametrize("workspace_tokens", [1 << 16, 7, 1])
def test_reference_kernels_fuse_every_prefill_row_of_generated_schedules(monkeypatch, kind, workspace_tokens):
    """The workspace bound on both sides: 65536 (one attention over context + new keys), 7 and 1 (context
    attended in chunks, merged by log-sum-exp into NVFP4; 1: one key per chunk, many empty chunks)."""
    assert _run_schedule(monkeypatch, kind, "reference", workspace_tokens, steps=8) > 0


@pytest.mark.skipif(not torch.cuda.is_available() and not kernels.interpreter_enabled(),
                    reason="no CUDA device and TRITON_INTERPRET is not set (conftest.py sets it on CPU-only machines)")
@pytest.mark.parametrize("kind", ["mla", "gqa"])
@pytest.mark.parametrize("workspace_tokens", [1 << 16, 9])
def test_triton_kernels_fuse_every_prefill_row_of_generated_schedules(monkeypatch, kind, workspace_tokens):
    """The Triton kernels (the interpreter on the CPU): ``seqlen_k > seqlen_q`` in the fused kernel, and the
    LSE outputs plus the NVFP4 merge kernel beyond the bound."""
    assert _run_schedule(monkeypatch, kind, "triton", workspace_tokens, steps=5) > 0


def test_context_workspace_bound_is_configurable_and_checked(monkeypatch):
    monkeypatch.delenv(settings.CONTEXT_WORKSPACE_ENV, raising=False)
    assert settings.context_workspace_tokens() == settings.DEFAULT_CONTEXT_WORKSPACE_TOKENS
    monkeypatch.setenv(settings.CONTEXT_WORKSPACE_ENV, "4096")
    assert settings.context_workspace_tokens() == 4096
    with settings.use_context_workspace_tokens(12):
        assert settings.context_workspace_tokens() == 12
    assert settings.context_workspace_tokens() == 4096
    for bad in ("0", "-3", "many"):
        monkeypatch.setenv(settings.CONTEXT_WORKSPACE_ENV, bad)
        with pytest.raises(ValueError, match=settings.CONTEXT_WORKSPACE_ENV):
            settings.context_workspace_tokens()
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="tokens"):
            with settings.use_context_workspace_tokens(bad):
                pass


class _SpyBackend(KernelBackend):
    """The reference kernels, recording the keys of every attention_lse call (the chunks beyond the bound)."""

    def __init__(self):
        super().__init__("reference")
        self.chunk_keys = []

    def attention_lse(self, q, k, v, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k, softmax_scale, causal):
        if not causal:
            self.chunk_keys.append(k.shape[0])
        return super().attention_lse(q, k, v, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k, softmax_scale,
                                     causal)


@pytest.mark.parametrize("bound", [1, 2, 3, 7, 64])
def test_beyond_the_bound_every_chunk_holds_at_most_bound_keys_and_there_are_as_few_as_can_be(bound):
    """Chunks are slices of the packed context: ceil(total / bound) of them, each at most ``bound`` keys, also when
    the bound is below the number of requests with context, and the context source is asked for each chunk's
    rows only (at most one workspace is materialized); the result equals the one-call path's within the
    format's bound (both are float32 attention, quantized)."""
    seed = random.SystemRandom().randrange(2**31)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    query_lens = [rng.randint(1, 9) for _ in range(rng.randint(2, 6))]
    context_lens = [rng.choice([0, rng.randint(1, 40)]) for _ in query_lens]
    context_lens[0] = max(context_lens[0], 1)
    h, hk, d, dv = 4, 2, 32, 16
    t = sum(query_lens) + 3  # three decode-like rows first, not written
    q = torch.randn(t, h, d, generator=gen).to(DEVICE, torch.bfloat16)
    k = torch.randn(t, hk, d, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(t, hk, dv, generator=gen).to(DEVICE, torch.bfloat16)
    c = sum(context_lens)
    k_ctx = torch.randn(c, hk, d, generator=gen).to(DEVICE, torch.bfloat16)
    v_ctx = torch.randn(c, hk, dv, generator=gen).to(DEVICE, torch.bfloat16)
    gs = torch.tensor([448 * 6 / 4.0], device=DEVICE)
    rows, cols = nvfp4.scale_shape(t, h * dv)
    outs, asked = [], []

    def context(lo, hi):  # what the caller materializes: at most one workspace at a time
        asked.append(hi - lo)
        return k_ctx[lo:hi], v_ctx[lo:hi]

    for workspace in (bound, None):
        spy = _SpyBackend()
        packed = torch.full((t, h * dv // 2), 0xAB, dtype=torch.uint8, device=DEVICE)
        scales = torch.full((rows, cols), 0xAB, dtype=torch.uint8, device=DEVICE)
        row_plan.run_prefills(spy, q, k[3:], v[3:], first_row=3, query_lens=query_lens, context_lens=context_lens,
                              context=context, softmax_scale=0.2, output=packed, output_scale=gs,
                              output_block_scale=scales, workspace_tokens=workspace)
        outs.append((packed, scales, spy.chunk_keys, asked[:]))
        asked.clear()
    keys = outs[0][2]
    where = f"seed {seed}, bound {bound}, query_lens {query_lens}, context_lens {context_lens}"
    if c > bound:
        assert len(keys) == -(-c // bound) and max(keys) <= bound and sum(keys) == c, f"{keys}: {where}"
        assert outs[0][3] == keys, f"context rows asked for {outs[0][3]}: {where}"
    else:
        assert keys == [] and outs[0][3] == [c], where
    assert outs[1][3] == [c], "within the bound the context is asked for once, whole"
    assert outs[1][2] == [], "the default bound (65536) takes the one-call path"
    assert bool((outs[0][0][:3] == 0xAB).all()), f"rows before first_row written: {where}"
    got = nvfp4.dequantize(outs[0][0], outs[0][1].view(torch.float8_e4m3fn), gs, m=t)[3:]
    want = nvfp4.dequantize(outs[1][0], outs[1][1].view(torch.float8_e4m3fn), gs, m=t)[3:]
    assert bool(((got - want).abs() <= requantization_bound(want, gs)).all()), where


def test_a_bad_workspace_bound_argument_is_refused_before_anything_runs():
    q = torch.zeros(4, 2, 16, dtype=torch.bfloat16)
    for bad in (0, -5, 1.5):
        with pytest.raises(ValueError, match=r"run_prefills\(workspace_tokens\)"):
            row_plan.run_prefills(KernelBackend("reference"), q, q, q, first_row=0, query_lens=[4], context_lens=[0],
                                  context=None, softmax_scale=0.2, output=None, output_scale=None,
                                  output_block_scale=None, workspace_tokens=bad)


def test_an_empty_part_of_a_merge_is_ignored_whatever_its_output_holds():
    """A context chunk where a request has no key has lse -inf; a backend may leave anything in its output."""
    gen = torch.Generator().manual_seed(0)
    out_a, out_b = torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    lse_a, lse_b = torch.randn(5, 2, generator=gen), torch.full((5, 2), float("-inf"))
    garbage = torch.full_like(out_b, float("nan"))
    from fusion_pass.kernels.reference import merge_attention

    merged, lse = merge_attention(out_a, lse_a, garbage, lse_b)
    assert torch.equal(merged, out_a) and torch.equal(lse, lse_a)
    both, lse_both = merge_attention(garbage, lse_b, garbage, lse_b)
    assert torch.equal(both, torch.zeros_like(both)) and bool(torch.isneginf(lse_both).all())


@pytest.mark.parametrize("scale", [0, -0.2, float("nan"), float("inf"), True])
def test_layers_refuse_a_softmax_scale_that_is_not_positive_and_finite(scale):
    with pytest.raises(ValueError, match="softmax_scale must be a positive finite number"):
        runtime.AttentionImpl(**GQA, softmax_scale=scale)
    with pytest.raises(ValueError, match="softmax_scale must be a positive finite number"):
        runtime.MLAAttentionImpl(**MLA, kv_b_proj_weight=torch.zeros(64, 32), softmax_scale=scale)


@pytest.mark.skipif(not torch.cuda.is_available() and not kernels.interpreter_enabled(),
                    reason="no CUDA device and TRITON_INTERPRET is not set (conftest.py sets it on CPU-only machines)")
def test_inputs_the_runtime_accepts_are_fused_too(monkeypatch):
    """q without unit stride along its head dim (a transposed view): the unfused op computes it, so the fused path
    must as well (made contiguous for the kernels). k/v in another float dtype than q: a backend whose kernels
    take keys in q's dtype would round them (the unfused op does not), so the call is not fused
    (``kv_dtype``) and its bytes are the unfused graph's."""
    gen = torch.Generator().manual_seed(3)
    impl = runtime.AttentionImpl(**GQA, softmax_scale=0.17)
    name = "test_chunked_prefill.dtypes"
    runtime.register_layer(name, impl)
    fake = KernelBackend("triton")
    monkeypatch.setattr(backends, "select_backend", lambda *a, **k: (fake, "stand-in"))
    monkeypatch.setattr(backends, "get_backend", lambda name: fake)
    try:
        spec = runtime.BatchSpec.from_lens([6, 9])
        t, width = spec.num_tokens, GQA["num_heads"] * GQA["v_head_dim"]
        q = torch.randn(t, GQA["head_dim"], GQA["num_heads"], generator=gen).to(DEVICE, torch.bfloat16).transpose(1, 2)
        k = torch.randn(t, 2, GQA["head_dim"], generator=gen).to(DEVICE, torch.bfloat16)
        v = torch.randn(t, 2, GQA["v_head_dim"], generator=gen).to(DEVICE, torch.bfloat16)
        assert q.stride(-1) != 1
        rows, cols = nvfp4.scale_shape(t, width)
        for kv_dtype, fused in ((torch.bfloat16, True), (torch.float16, False)):
            counters.reset_counters()
            impl.clear_cache()
            k_in, v_in = k.to(kv_dtype), v.to(kv_dtype)
            half = torch.empty(t, width, dtype=torch.bfloat16, device=DEVICE)
            with runtime.batch(spec):
                OPS.attention_with_output(q, k_in, v_in, half, name)
            impl.clear_cache()
            gs = torch.tensor([448 * 6 / float(half.float().abs().max())], device=DEVICE)
            packed = torch.empty(t, width // 2, dtype=torch.uint8, device=DEVICE)
            scales = torch.empty(rows, cols, dtype=torch.uint8, device=DEVICE)
            with runtime.batch(spec):
                OPS.attention_with_output(q, k_in, v_in, packed, name, gs, scales)
            want_packed, want_scales = scaled_fp4_quant(half, gs)
            if fused:
                assert counters.counters()["fused_by_backend"] == {fake.name: 1}
                want = nvfp4.dequantize(want_packed, want_scales, gs, m=t)
                got = nvfp4.dequantize(packed, scales.view(torch.float8_e4m3fn), gs, m=t)
                assert bool(((got - want).abs() <= requantization_bound(want, gs)).all())
            else:
                assert counters.counters()["fallback"] == {"kv_dtype": 1}
                assert torch.equal(packed, want_packed) and torch.equal(scales, want_scales.view(torch.uint8))
    finally:
        runtime.unregister_layer(name)


class _NeverCalled:
    """A backend whose kernels must not run: every call is recorded and fails the test's expectations."""

    name, handles_context = "never", True

    def __init__(self):
        self.calls = []

    def run_varlen(self, *args, **kwargs):
        self.calls.append("run_varlen")

    def attention_lse(self, q, k, v, *args):
        self.calls.append("attention_lse")
        return (q.new_zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float32),
                q.new_zeros(q.shape[0], q.shape[1], dtype=torch.float32))

    def merge_nvfp4(self, *args):
        self.calls.append("merge_nvfp4")


def _prefill_case(t=12, first_row=2, h=2, d=16, dv=16, context_rows=6):
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(t, h, d, generator=gen).to(torch.bfloat16)
    k = torch.randn(t - first_row, h, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(t - first_row, h, dv, generator=gen).to(torch.bfloat16)
    k_ctx = torch.randn(context_rows, h, d, generator=gen).to(torch.bfloat16)
    v_ctx = torch.randn(context_rows, h, dv, generator=gen).to(torch.bfloat16)
    rows, cols = nvfp4.scale_shape(t, h * dv)
    packed = torch.full((t, h * dv // 2), 0xAB, dtype=torch.uint8)
    scales = torch.full((rows, cols), 0xAB, dtype=torch.uint8)
    return dict(q=q, k=k, v=v, first_row=first_row, context=lambda lo, hi: (k_ctx[lo:hi], v_ctx[lo:hi]),
                softmax_scale=0.25, output=packed, output_scale=torch.tensor([100.0]), output_block_scale=scales)


@pytest.mark.parametrize("change, match", [
    # the two lists describe different prefills
    (dict(query_lens=[6, 4], context_lens=[2]), "query_lens and context_lens must describe the same prefills"),
    (dict(query_lens=[10], context_lens=[2, 4]), "query_lens and context_lens must describe the same prefills"),
    (dict(query_lens=[], context_lens=[]), "query_lens must list at least one prefill"),
    # not ints
    (dict(query_lens=[6.0, 4], context_lens=[0, 0]), "query_lens must hold ints"),
    (dict(query_lens=[6, 4], context_lens=[0, 2.5]), "context_lens must hold ints"),
    (dict(query_lens=[6, True], context_lens=[0, 0]), "query_lens must hold ints"),
    (dict(query_lens=torch.tensor([6, 4]), context_lens=[0, 0]), "query_lens must be a list of ints"),
    (dict(query_lens=[6, 4], context_lens=None), "context_lens must be a list of ints"),
    # out of range
    (dict(query_lens=[10, 0], context_lens=[0, 0]), r"query_lens must be >= 1"),
    (dict(query_lens=[6, 4], context_lens=[3, -1]), r"context_lens must be >= 0"),
    # rows: k / v against query_lens, the prefills' rows against q
    (dict(query_lens=[6, 3], context_lens=[0, 0]), "k must have sum\\(query_lens\\) = 9 rows"),
    (dict(query_lens=[6, 5], context_lens=[0, 0]), "k must have sum\\(query_lens\\) = 11 rows"),
    (dict(query_lens=[6, 4], context_lens=[0, 0], v="short"), "v must have sum\\(query_lens\\) = 10 rows"),
    (dict(query_lens=[6, 4], context_lens=[0, 0], first_row=3), r"first_row \+ sum\(query_lens\) = 3 \+ 10"),
    (dict(query_lens=[6, 4], context_lens=[0, 0], first_row=-1), "first_row must be an int >= 0"),
    (dict(query_lens=[6, 4], context_lens=[0, 0], first_row=2.0), "first_row must be an int >= 0"),
    # context
    (dict(query_lens=[6, 4], context_lens=[0, 3], context=None), "context_lens sum to 3 cached tokens but context"),
])
@pytest.mark.parametrize("workspace_tokens", [None, 2])
def test_prefill_rows_that_do_not_add_up_are_refused_before_any_kernel_runs(change, match, workspace_tokens):
    """query_lens / context_lens / first_row / k / v / q that describe different rows: a ValueError naming the
    argument, from host ints only, before any kernel runs or any byte is written (both paths: one call within
    the workspace bound, chunks merged beyond it)."""
    args = _prefill_case()
    change = dict(change)
    if change.get("v") == "short":
        change["v"] = args["v"][:-1]
    args.update(change)
    before = (args["output"].clone(), args["output_block_scale"].clone())
    spy = _NeverCalled()
    with pytest.raises(ValueError, match=match):
        row_plan.run_prefills(spy, **args, workspace_tokens=workspace_tokens)
    assert spy.calls == []
    assert torch.equal(args["output"], before[0]) and torch.equal(args["output_block_scale"], before[1])


def test_prefill_lengths_may_be_numpy_ints():
    np = pytest.importorskip("numpy")
    outs = []
    for lens in (([6, 4], [2, 4]), (np.array([6, 4]), [np.int64(2), np.int32(4)])):
        args = _prefill_case()
        row_plan.run_prefills(KernelBackend("reference"), **args, query_lens=lens[0], context_lens=lens[1])
        outs.append((args["output"], args["output_block_scale"]))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert bool((outs[0][0][:2] == 0xAB).all()) and not bool((outs[0][0][2:] == 0xAB).all())
