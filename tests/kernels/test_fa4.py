"""FlashAttention-4 on Hopper: the fused SM90 kernel with our NVFP4 epilogue.

GPU tests (need a CUDA SM90 device and the ``fa4`` extra; they skip with the reason
otherwise): the fused kernel's bytes equal, exactly, ``nvfp4.quantize`` of FA4's
own bf16/fp16 output on the same inputs (:func:`fa4_attention_varlen`, the same main loop);
every output byte is written (two different poisons give the same bytes); the scale
buffer's padding rows are zero. With keys in their own workspace (``cu_seqlens_k``: cached
context then the new tokens, causal bottom-right) and queries from a row past 0, the same
equality holds on the sequences' rows and the rows around them keep their poison; FA4's
output and log-sum-exp are checked against float64 attention. CPU tests (no FA4 needed):
detection reasons and argument checks, raised before FA4 is imported. One CPU test compiles
(never runs) the SM90 kernel when FA4 is installed (`make test` installs the fa4 extra;
without it, it skips).
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from fusion_pass import kernels, nvfp4
from fusion_pass.runtime import backends, settings
from fusion_pass.kernels import choice
from fusion_pass.kernels.fa4 import sm90 as fa4_sm90


from context_cases import (ContextCase, ContextLimits, call_without_host_sync, context_case,  # noqa: E402
                           context_inputs, reference_context_attention)


from sm90_gpu import gpu  # noqa: E402


def fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


# (name, H, Hkv, D, Dv, lengths): T = 1257 (not a multiple of 128) for the first four
CASES = [
    ("mla16", 16, 16, 192, 128, [1, 127, 129, 1000]),
    ("mla128", 128, 128, 192, 128, [1000, 1, 129, 127]),
    ("mha", 32, 32, 128, 128, [127, 1000, 1, 129]),
    ("gqa", 32, 8, 128, 128, [129, 1, 127, 1000]),
    ("mha_t384", 32, 32, 128, 128, [128, 256]),  # T a multiple of 128: no padding rows
    ("gqa_d64", 8, 2, 64, 64, [300, 1, 77]),
]


def _inputs(seed, h, hkv, d, dv, lengths, dtype):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, h, d, generator=gen).to("cuda", dtype)
    k = torch.randn(t, hkv, d, generator=gen).to("cuda", dtype)
    v = (torch.randn(t, hkv, dv, generator=gen) * torch.exp(torch.randn(t, hkv, 1, generator=gen))).to("cuda", dtype)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    return q, k, v, cu


def _fused(q, k, v, cu, max_seqlen, gs, causal, scale, poison_out, poison_scale):
    t, h, dv = q.shape[0], q.shape[1], v.shape[2]
    rows, cols = nvfp4.scale_shape(t, h * dv)
    packed = torch.full((t, h * dv // 2), poison_out, dtype=torch.uint8, device="cuda")
    scales = torch.full((rows, cols), poison_scale, dtype=torch.uint8, device="cuda")
    fa4_sm90.fa4_attention_nvfp4_varlen(
        q, k, v, cu_seqlens=cu, max_seqlen=max_seqlen, softmax_scale=scale, causal=causal,
        output=packed, output_scale=gs, output_block_scale=scales.view(torch.float8_e4m3fn),
    )
    torch.cuda.synchronize()
    return packed, scales


def _check_bytes(name, q, k, v, cu, lengths, causal, seed, special=False):
    scale = q.shape[2] ** -0.5
    ref = fa4_sm90.fa4_attention_varlen(q, k, v, cu, max(lengths), causal=causal, softmax_scale=scale)
    t, h, dv = ref.shape
    assert ref.dtype == q.dtype and (t, h, dv) == (q.shape[0], q.shape[1], v.shape[2])
    finite = ref.float()[ref.float().isfinite()]
    gs = torch.tensor([448 * 6 / max(finite.abs().max().item(), 1e-6)], dtype=torch.float32, device="cuda")
    want_packed, want_scales = nvfp4.quantize(ref.reshape(t, h * dv).cpu(), gs.cpu(), swizzled=True)
    runs = [_fused(q, k, v, cu, max(lengths), gs, causal, scale, *poison) for poison in ((0xA5, 0x5A), (0x00, 0xFF))]
    for i, (packed, scales) in enumerate(runs):
        bad = (packed.cpu() != want_packed).nonzero()
        assert len(bad) == 0, (f"{name}: {len(bad)} packed bytes differ from quantize(FA4 output) (run {i}, seed {seed}); "
                               f"first (row, byte): {bad[:8].tolist()}, rows {bad[:, 0].unique()[:20].tolist()}")
        got_scales = scales.cpu().view(-1)
        want = want_scales.view(torch.uint8).reshape(-1)
        diff = (got_scales != want).sum().item()
        assert diff == 0, f"{name}: {diff} scale bytes differ from quantize(FA4 output) (run {i}, seed {seed})"
    # padding rows of the swizzled scale buffer are zero (both poisons overwritten)
    rows, cols = nvfp4.scale_shape(t, h * dv)
    m = torch.arange(rows).unsqueeze(1).expand(rows, cols)
    c = torch.arange(cols).unsqueeze(0).expand(rows, cols)
    offsets = nvfp4.swizzled_offset(m, c, h * dv // 16).reshape(-1)
    padding = offsets[(m >= t).reshape(-1)]
    assert bool((runs[0][1].cpu().view(-1)[padding] == 0).all()), f"{name}: padding scale rows not zero (seed {seed})"
    if special:
        assert bool((runs[0][1].cpu().view(-1) == 0x7F).any()) or bool((runs[0][1].cpu().view(-1) == 0x7E).any())


@gpu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_bytes_equal_quantize_of_fa4_output(case, dtype):
    name, h, hkv, d, dv, lengths = case
    seed = fresh_seed()
    q, k, v, cu = _inputs(seed, h, hkv, d, dv, lengths, dtype)
    _check_bytes(name, q, k, v, cu, lengths, True, seed)


@gpu
def test_fused_bytes_non_causal():
    seed = fresh_seed()
    lengths = [1, 127, 129, 300]
    q, k, v, cu = _inputs(seed, 32, 8, 128, 128, lengths, torch.bfloat16)
    _check_bytes("non-causal", q, k, v, cu, lengths, False, seed)


@gpu
def test_fused_bytes_with_inf_and_nan_in_v():
    """Infinities and NaNs in v reach the output: the epilogue writes the bytes of the
    NaN/Inf contract (docs/nvfp4.md), equal to quantize(FA4 output)."""
    seed = fresh_seed()
    lengths = [200, 57]
    q, k, v, cu = _inputs(seed, 16, 16, 192, 128, lengths, torch.bfloat16)
    v[10, 3, 5] = float("inf")
    v[220, 7, 40] = float("nan")
    _check_bytes("inf/nan", q, k, v, cu, lengths, True, seed, special=True)


@gpu
def test_public_entry_points_take_fa4_and_auto_prefers_it():
    seed = fresh_seed()
    lengths = [129, 1]
    q, k, v, cu = _inputs(seed, 16, 16, 192, 128, lengths, torch.bfloat16)
    out = kernels.attention(q, k, v, cu, 129, backend="fa4")
    assert torch.equal(out, fa4_sm90.fa4_attention_varlen(q, k, v, cu, 129, causal=True, softmax_scale=192**-0.5))
    assert choice.choose("attention", "auto", q, v) == "fa4"
    gs = torch.tensor([100.0], device="cuda")
    packed, scales = kernels.attention_nvfp4(q, k, v, cu, 129, gs, backend="fa4")
    want = nvfp4.quantize(out.reshape(130, -1).cpu(), gs.cpu())
    assert torch.equal(packed.cpu(), want[0]) and torch.equal(scales.cpu().view(torch.uint8), want[1].view(torch.uint8))
    backend, why = backends.select_backend("cuda", torch.bfloat16, 16, 192, 128)
    assert backend is not None and backend.name == "fa4", why


@gpu
def test_attention_op_with_fa4_fused_on_prefill_and_byte_equal_fallback_on_decode():
    """The attention op with backend ``fa4``: a prefill batch takes the fused FA4 path
    (within the requantization bound of the unfused bytes); a decode batch falls back and
    its bytes equal the unfused path's."""
    from fusion_pass import ops, runtime
    from fusion_pass.runtime import counters
    from fusion_pass.demo.workload import compare_nvfp4
    from fusion_pass.runtime import BatchSpec, RequestSpec

    heads, kv_heads, dim = 8, 2, 128
    impl = runtime.AttentionImpl(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, softmax_scale=dim**-0.5)
    runtime.register_layer("test_fa4.attn", impl)
    gen = torch.Generator().manual_seed(fresh_seed())
    try:
        runtime.clear_kv_caches()
        steps = [
            BatchSpec((RequestSpec("a", 300), RequestSpec("b", 77))),
            BatchSpec((RequestSpec("a", 1, 300), RequestSpec("b", 1, 77))),
        ]
        with settings.use_backend("fa4"):
            for spec, want_path in zip(steps, ("fused", "fallback")):
                t = spec.num_tokens
                q, k, v = (torch.randn(t, h, dim, generator=gen).to("cuda", torch.bfloat16)
                           for h in (heads, kv_heads, kv_heads))
                start = runtime.snapshot_kv_caches()
                with runtime.batch(spec):
                    half = torch.empty(t, heads * dim, dtype=torch.bfloat16, device="cuda")
                    torch.ops.fusion_pass.attention_with_output(q, k, v, half, "test_fa4.attn")
                    gs = torch.tensor([448 * 6 / half.float().abs().max().item()], device="cuda")
                    unfused = ops.scaled_fp4_quant(half, gs)
                    runtime.restore_kv_caches(start)
                    rows, cols = nvfp4.scale_shape(t, heads * dim)
                    packed = torch.full((t, heads * dim // 2), 0xAB, dtype=torch.uint8, device="cuda")
                    scales = torch.full((rows, cols // 4), -1, dtype=torch.int32, device="cuda")
                    before = counters.counters()
                    torch.ops.fusion_pass.attention_with_output(q, k, v, packed, "test_fa4.attn", gs, scales)
                    after = counters.counters()
                fused = after["fused_by_backend"].get("fa4", 0) - before["fused_by_backend"].get("fa4", 0)
                assert (fused == 1) == (want_path == "fused"), f"{spec.kind}: guard took the wrong path"
                equal, err, bound, within = compare_nvfp4([(packed, scales.view(torch.float8_e4m3fn))], [unfused], [gs])
                if want_path == "fused":
                    assert within, f"fused FA4 NVFP4 off the unfused bytes by {err:.3e} > {bound:.3e}"
                else:
                    assert equal, "fallback bytes differ from the unfused path's"
    finally:
        runtime.unregister_layer("test_fa4.attn")
        runtime.clear_kv_caches()


# ---------------------------------------------------------------------------
# GPU: chunked prefill, keys in their own workspace (cu_seqlens_k)
# ---------------------------------------------------------------------------

# (name, H, Hkv, D, Dv)
CONTEXT_HEADS = [("mla16", 16, 16, 192, 128), ("gqa", 32, 8, 128, 128), ("gqa_d64", 8, 2, 64, 64)]

LSE_ATOL = 1e-3
"""As tests/test_kernels.py's: float32 score dots (accumulation error ~1e-4 at D=192 for unit-normal
inputs) bound the log-sum-exp's error; exp2/log2 approximations add a few 1e-7 relative."""


CONTEXT_LIMITS = ContextLimits(max_queries=300, max_context=1000, max_long_context=3000, max_row0=300, max_tail=5)


def _context_inputs(case: ContextCase, heads, dtype):
    """``heads = (H, Hkv, D, Dv)``; values spread over a few orders of magnitude."""
    return context_inputs(case, heads, dtype, "cuda", spread_v=True)


@gpu
@pytest.mark.parametrize("heads", CONTEXT_HEADS, ids=[c[0] for c in CONTEXT_HEADS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_bytes_with_context_equal_quantize_of_fa4_output(heads, dtype):
    """With ``cu_seqlens_k`` and queries from row ``cu_seqlens[0] > 0``: the rows of the sequences
    hold exactly ``quantize_reference`` of FA4's own output on the same inputs (both poisons), the
    rows before and after keep their poison, the scale padding is zero."""
    name, h, hkv, d, dv = heads
    seed = fresh_seed()
    case = context_case(seed, True, CONTEXT_LIMITS)
    q, k, v, cu, cu_k = _context_inputs(case, heads[1:], dtype)
    where = f"{name}: {case}"
    scale = d ** -0.5
    t, a, e = q.shape[0], case.row0, q.shape[0] - case.tail
    ctx = dict(cu_seqlens_k=cu_k, max_seqlen_k=max(case.key_lens))
    ref = fa4_sm90.fa4_attention_varlen(q, k, v, cu, max(case.query_lens), causal=True, softmax_scale=scale, **ctx)
    ref = ref[a:e].reshape(e - a, h * dv)
    gs = torch.tensor([448 * 6 / max(ref.float().abs().max().item(), 1e-6)], dtype=torch.float32, device="cuda")
    want_packed, want_scales = nvfp4.quantize(ref.cpu(), gs.cpu(), swizzled=False)
    rows, cols = nvfp4.scale_shape(t, h * dv)
    blocks = h * dv // 16
    for poison_out, poison_scale in ((0xA5, 0x5A), (0x00, 0xFF)):
        packed = torch.full((t, h * dv // 2), poison_out, dtype=torch.uint8, device="cuda")
        scales = torch.full((rows, cols), poison_scale, dtype=torch.uint8, device="cuda")
        fa4_sm90.fa4_attention_nvfp4_varlen(
            q, k, v, cu_seqlens=cu, max_seqlen=max(case.query_lens), softmax_scale=scale, causal=True,
            output=packed, output_scale=gs, output_block_scale=scales.view(torch.float8_e4m3fn), **ctx,
        )
        torch.cuda.synchronize()
        packed = packed.cpu()
        linear = nvfp4.unswizzle_scales(scales.cpu().view(torch.float8_e4m3fn), rows, cols).view(torch.uint8)
        bad = (packed[a:e] != want_packed).nonzero()
        assert len(bad) == 0, (
            f"{len(bad)} packed bytes differ from quantize(FA4 output), first {bad[:8].tolist()} ({where})")
        diff = (linear[a:e, :blocks] != want_scales.view(torch.uint8)).sum().item()
        assert diff == 0, f"{diff} scale bytes differ from quantize(FA4 output) ({where})"
        assert (packed[:a] == poison_out).all() and (packed[e:] == poison_out).all(), f"rows outside written ({where})"
        assert (linear[:a, :blocks] == poison_scale).all() and (linear[e:t, :blocks] == poison_scale).all(), (
            f"scales of rows outside written ({where})")
        assert not linear[t:].any() and not linear[:, blocks:].any(), f"scale padding not zero ({where})"


@gpu
@pytest.mark.parametrize("heads", CONTEXT_HEADS, ids=[c[0] for c in CONTEXT_HEADS])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_fa4_output_and_lse_with_context_against_float64(heads, causal):
    """``fa4_attention_varlen(..., cu_seqlens_k, return_lse=True)``: the output within the half-output
    criterion of float64 attention over the full sequences (causal bottom-right), the LSE a
    ``[T, H]`` view of FA4's ``[H, T]`` buffer within :data:`LSE_ATOL`, ``-inf`` (output 0) where a
    row sees no key (non-causal sequences without keys)."""
    name, h, hkv, d, dv = heads
    seed = fresh_seed()
    case = context_case(seed, causal, CONTEXT_LIMITS)
    dtype = (torch.bfloat16, torch.float16)[seed % 2]
    q, k, v, cu, cu_k = _context_inputs(case, heads[1:], dtype)
    where = f"{name}: {case}"
    scale = d ** -0.5
    rows = slice(case.row0, q.shape[0] - case.tail)
    out, lse = fa4_sm90.fa4_attention_varlen(q, k, v, cu, max(case.query_lens), causal=causal, softmax_scale=scale,
                                            cu_seqlens_k=cu_k, max_seqlen_k=max(case.key_lens), return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert lse.shape == (q.shape[0], h) and lse.stride() == (1, q.shape[0]), "lse must be the [T, H] view of [H, T]"
    ref, ref_lse = reference_context_attention(q, k, v, cu, cu_k, causal, scale)
    rel = ((out[rows].double() - ref[rows]).norm() / ref[rows].norm()).item()
    assert rel < 1e-2, f"relative error {rel:.2e} ({where})"
    got, want = lse[rows].double(), ref_lse[rows]
    empty = want.isneginf()
    assert torch.equal(got.isneginf(), empty), f"-inf exactly where a row sees no key ({where})"
    assert not out[rows][empty].any(), f"rows without keys must be 0 ({where})"
    err = (got[~empty] - want[~empty]).abs().max().item()
    assert err <= LSE_ATOL, f"log-sum-exp off by {err:.2e} ({where})"


@gpu
def test_public_entry_points_take_fa4_with_context():
    """``attention`` / ``attention_with_lse`` / ``attention_nvfp4`` with ``cu_seqlens_k`` and
    ``backend="fa4"``: FA4's forward (float32 copy, LSE view) and the fused kernel's bytes equal to
    ``quantize_reference`` of FA4's output."""
    seed = fresh_seed()
    case = context_case(seed, True, CONTEXT_LIMITS, row0=False)
    q, k, v, cu, cu_k = _context_inputs(case, (32, 8, 128, 128), torch.bfloat16)
    where = str(case)
    max_q, t = max(case.query_lens), q.shape[0]
    want, want_lse = fa4_sm90.fa4_attention_varlen(q, k, v, cu, max_q, causal=True, softmax_scale=128**-0.5,
                                                  cu_seqlens_k=cu_k, return_lse=True)
    assert torch.equal(kernels.attention(q, k, v, cu, max_q, backend="fa4", cu_seqlens_k=cu_k), want), where
    out, lse = kernels.attention_with_lse(q, k, v, cu, max_q, backend="fa4", cu_seqlens_k=cu_k,
                                          max_seqlen_k=max(case.key_lens))
    assert out.dtype == torch.float32 and torch.equal(out, want.float()) and torch.equal(lse, want_lse), where
    gs = torch.tensor([100.0], device="cuda")
    packed, scales = kernels.attention_nvfp4(q, k, v, cu, max_q, gs, backend="fa4", cu_seqlens_k=cu_k)
    ref = nvfp4.quantize(want.reshape(t, -1).cpu(), gs.cpu())
    assert torch.equal(packed.cpu(), ref[0]), where
    assert torch.equal(scales.cpu().view(torch.uint8), ref[1].view(torch.uint8)), where


@gpu
def test_fused_call_with_context_does_not_synchronize():
    """The fused call reads no value back (``torch.cuda.set_sync_debug_mode("error")``), once compiled."""
    seed = fresh_seed()
    case = context_case(seed, True, CONTEXT_LIMITS)
    q, k, v, cu, cu_k = _context_inputs(case, (16, 16, 192, 128), torch.bfloat16)
    t = q.shape[0]
    rows, cols = nvfp4.scale_shape(t, 16 * 128)
    bufs = dict(output=torch.empty(t, 16 * 64, dtype=torch.uint8, device="cuda"),
                output_scale=torch.ones(1, device="cuda"),
                output_block_scale=torch.empty(rows, cols // 4, dtype=torch.int32, device="cuda"))

    def call():
        fa4_sm90.fa4_attention_nvfp4_varlen(q, k, v, cu_seqlens=cu, max_seqlen=max(case.query_lens), softmax_scale=0.1,
                                           causal=True, cu_seqlens_k=cu_k, max_seqlen_k=max(case.key_lens), **bufs)

    call_without_host_sync(call)


# ---------------------------------------------------------------------------
# CPU: detection and argument checks, without FA4
# ---------------------------------------------------------------------------


def _cpu_args(t=10, h=4, hkv=4, d=128, dv=128, dtype=torch.bfloat16):
    q = torch.zeros(t, h, d, dtype=dtype)
    k = torch.zeros(t, hkv, d, dtype=dtype)
    v = torch.zeros(t, hkv, dv, dtype=dtype)
    cu = torch.tensor([0, 4, t], dtype=torch.int32)
    rows, cols = nvfp4.scale_shape(t, h * dv)
    out = torch.zeros(t, h * dv // 2, dtype=torch.uint8)
    return q, k, v, cu, out, torch.ones(1), torch.zeros(rows * cols, dtype=torch.uint8)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda a: {**a, "q": a["q"].float()}, TypeError, r"q must be float16 or bfloat16"),
        (lambda a: {**a, "q": a["q"][:, :, :64]}, ValueError, r"head dims \(q/k D=64, v Dv=128\)|k must be \[T, Hkv, Dqk\] with q's Dqk=64"),
        (lambda a: {**a, "k": torch.zeros(10, 3, 128, dtype=torch.bfloat16),
                    "v": torch.zeros(10, 3, 128, dtype=torch.bfloat16)}, ValueError, r"multiple of k/v's heads"),
        (lambda a: {**a, "q": torch.zeros(10, 4, 256, dtype=torch.bfloat16),
                    "k": torch.zeros(10, 4, 256, dtype=torch.bfloat16)}, ValueError, r"D=256, v Dv=128\) are not supported"),
        (lambda a: {**a, "cu_seqlens": a["cu_seqlens"].long()}, ValueError, r"cu_seqlens must be a 1-D int32"),
        (lambda a: {**a, "max_seqlen": -1}, ValueError, r"max_seqlen must be a non-negative int"),
        (lambda a: {**a, "softmax_scale": float("nan")}, ValueError, r"softmax_scale must be a positive finite"),
        (lambda a: {**a, "causal": 1}, ValueError, r"causal must be a bool"),
        (lambda a: {**a, "output": a["output"][:5]}, ValueError, r"output must be contiguous with T \* H \* Dv / 2"),
        (lambda a: {**a, "output_scale": torch.ones(2)}, ValueError, r"output_scale must be a one-element float32"),
        (lambda a: {**a, "output_block_scale": a["output_block_scale"][:-1]}, ValueError,
         r"output_block_scale must be a contiguous buffer of round_up\(T,128\)"),
        (lambda a: {**a, "cu_seqlens_k": a["cu_seqlens"].long()}, ValueError, r"cu_seqlens_k must be a 1-D int32"),
        (lambda a: {**a, "cu_seqlens_k": torch.tensor([0, 4, 8, 10], dtype=torch.int32)}, ValueError,
         r"cu_seqlens_k must have B \+ 1 = 3 entries like cu_seqlens, got 4"),
        (lambda a: {**a, "cu_seqlens_k": a["cu_seqlens"].to("meta")}, ValueError,
         r"cu_seqlens_k must be on q's device"),
        (lambda a: {**a, "cu_seqlens_k": torch.tensor([0, 0, 4, 0, 10, 0], dtype=torch.int32)[::2]}, ValueError,
         r"cu_seqlens_k must be contiguous"),
        (lambda a: {**a, "max_seqlen_k": 6}, ValueError, r"max_seqlen_k=6 is given without cu_seqlens_k"),
        (lambda a: {**a, "cu_seqlens_k": a["cu_seqlens"], "max_seqlen_k": 6.0}, ValueError,
         r"max_seqlen_k must be None or a non-negative int"),
        (lambda a: {**a, "cu_seqlens_k": a["cu_seqlens"], "k": torch.zeros(7, 4, 128, dtype=torch.bfloat16)},
         ValueError, r"k and v must have the same number of tokens Tk"),
        (lambda a: {**a, "k": torch.zeros(7, 4, 128, dtype=torch.bfloat16),
                    "v": torch.zeros(7, 4, 128, dtype=torch.bfloat16)}, ValueError,
         r"same number of tokens T \(or pass cu_seqlens_k\)"),
    ],
)
def test_nvfp4_entry_rejects_bad_arguments_before_importing_fa4(change, error, match, monkeypatch):
    q, k, v, cu, out, gs, sf = _cpu_args()
    args = dict(q=q, k=k, v=v, cu_seqlens=cu, max_seqlen=6, softmax_scale=0.1, causal=True,
                output=out, output_scale=gs, output_block_scale=sf)
    monkeypatch.setattr(fa4_sm90, "fa4_interface", lambda: pytest.fail("FA4 imported before the checks"))
    args = change(args)
    with pytest.raises(error, match=match):
        fa4_sm90.fa4_attention_nvfp4_varlen(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_nvfp4_entry_needs_whole_8_byte_words_per_row(monkeypatch):
    monkeypatch.setattr(fa4_sm90, "fa4_interface", lambda: pytest.fail("FA4 imported before the checks"))
    q, k, v, cu, _, gs, _ = _cpu_args(h=1, hkv=1, d=64, dv=64)  # H*Dv/2 = 32: fine
    fa4_sm90.check_nvfp4_buffers("f", q, v, torch.zeros(10, 32, dtype=torch.uint8), gs,
                                 torch.zeros(128 * 4, dtype=torch.uint8))
    q, k, v = (torch.zeros(10, 1, 96, dtype=torch.bfloat16) for _ in range(3))  # H*Dv/2 = 48: fine
    fa4_sm90.check_nvfp4_buffers("f", q, v, torch.zeros(10, 48, dtype=torch.uint8), gs,
                                 torch.zeros(128 * 8, dtype=torch.uint8))


def test_bf16_entry_rejects_bad_arguments_before_importing_fa4(monkeypatch):
    monkeypatch.setattr(fa4_sm90, "fa4_interface", lambda: pytest.fail("FA4 imported before the checks"))
    q, k, v, cu, *_ = _cpu_args()
    with pytest.raises(ValueError, match=r"q must be a 3-D tensor"):
        fa4_sm90.fa4_attention_varlen(q[0], k, v, cu, 6, causal=True, softmax_scale=0.1)
    with pytest.raises(ValueError, match=r"same number of tokens"):
        fa4_sm90.fa4_attention_varlen(q[:5], k, v, cu, 6, causal=True, softmax_scale=0.1)
    with pytest.raises(ValueError, match=r"cu_seqlens_k must have B \+ 1 = 3 entries"):
        fa4_sm90.fa4_attention_varlen(q, k, v, cu, 6, causal=True, softmax_scale=0.1, cu_seqlens_k=cu[:2])
    with pytest.raises(ValueError, match=r"return_lse must be a bool"):
        fa4_sm90.fa4_attention_varlen(q, k, v, cu, 6, causal=True, softmax_scale=0.1, return_lse=1)


def test_fa4_checks_take_keys_from_their_own_workspace():
    """With ``cu_seqlens_k``, k/v may hold another number of tokens than q (values not read: no sync)."""
    q, _, _, cu, *_ = _cpu_args()
    k = torch.zeros(23, 4, 128, dtype=torch.bfloat16)
    v = torch.zeros(23, 4, 128, dtype=torch.bfloat16)
    cu_k = torch.tensor([0, 9, 23], dtype=torch.int32)
    fa4_sm90.check_fa4_args("f", q, k, v, cu, 6, 0.1, True, cu_k, 14)
    fa4_sm90.check_fa4_args("f", q, k, v, cu, 6, 0.1, True, cu_k, None)
    with pytest.raises(ValueError, match=r"same number of tokens T \(or pass cu_seqlens_k\)"):
        fa4_sm90.check_fa4_args("f", q, k, v, cu, 6, 0.1, True)


def test_kernel_config_is_fa4s_sm90_choice_until_the_table_says_otherwise():
    """(tile_m, tile_n, num_stages, intra_wg_overlap, mma_pv_is_rs); the table and its validity:
    tests/kernels/test_fa4_launch.py."""
    assert tuple(fa4_sm90.kernel_config(192, 128, True, 512)) == (128, 128, 2, True, True)
    assert tuple(fa4_sm90.kernel_config(128, 128, True, 8192)) == (128, 128, 2, True, True)
    assert tuple(fa4_sm90.kernel_config(64, 64, True)) == (192, 128, 2, True, True)
    assert tuple(fa4_sm90.kernel_config(96, 96, False)) == (192, 144, 2, True, False)
    for d, dv in fa4_sm90.SUPPORTED_HEAD_DIMS:
        tile_m = fa4_sm90.kernel_config(d, dv, True).tile_m
        assert (128 * tile_m // 64) % (dv // 16) == 0


def test_module_imports_without_fa4_and_detection_says_why():
    code = "import sys, fusion_pass.kernels.fa4.sm90, fusion_pass.kernels; " \
           "print(any(m.startswith(('flash_attn', 'cutlass')) for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", "importing the kernels imported FA4"
    if importlib.util.find_spec("flash_attn") is None:
        ok, why = fa4_sm90.fa4_import_status()
        assert not ok and why == "flash_attn.cute is not installed (pip install 'attn-nvfp4-fusion[fa4]')"
        assert fa4_sm90.fa4_sm90_usable("cuda", torch.bfloat16, 16, 192, 128) == (False, why)
        assert backends.get_backend("fa4").available()[1].endswith("(pip install 'attn-nvfp4-fusion[fa4]')")


def test_kernels_do_not_import_backends_or_runtime():
    """Layering (ARCHITECTURE.md): the kernels take tensors and return tensors."""
    import ast
    import pathlib

    forbidden = ("fusion_pass.runtime.backends", "fusion_pass.runtime", "fusion_pass.ops", "fusion_pass.runtime.guard")
    for path in pathlib.Path(kernels.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            bad = [n for n in names if n.startswith(forbidden)]
            assert not bad, f"{path.name} imports {bad}"


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None,
                    reason="flash_attn.cute is not installed (the fa4 extra)")
def test_sm90_kernel_compiles_on_the_cpu():
    """Compile (never run) the fused SM90 kernel for MLA 192/128 and GQA 128 with fake CUDA
    tensors; no GPU or driver needed (FA4 targets sm_90a from the environment variables)."""
    code = textwrap.dedent("""
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from fusion_pass.kernels.fa4 import sm90 as fa4_sm90
        with FakeTensorMode(allow_non_fake_inputs=True):
            for h, hkv, d, dv, dtype, tk in ((16, 16, 192, 128, torch.bfloat16, None),
                                             (32, 8, 128, 128, torch.float16, None),
                                             (16, 16, 192, 128, torch.float16, 3000)):  # keys in their own workspace
                t = 1000
                q = torch.empty(t, h, d, dtype=dtype, device="cuda")
                k = torch.empty(tk or t, hkv, d, dtype=dtype, device="cuda")
                v = torch.empty(tk or t, hkv, dv, dtype=dtype, device="cuda")
                cu = torch.empty(4, dtype=torch.int32, device="cuda")
                ctx = {} if tk is None else dict(cu_seqlens_k=torch.empty(4, dtype=torch.int32, device="cuda"),
                                                 max_seqlen_k=2000)
                gs = torch.empty(1, dtype=torch.float32, device="cuda")
                out = torch.empty(t, h * dv // 2, dtype=torch.uint8, device="cuda")
                sf = torch.empty(1024 * ((h * dv // 16 + 3) // 4 * 4), dtype=torch.uint8, device="cuda")
                fa4_sm90.fa4_attention_nvfp4_varlen(q, k, v, cu_seqlens=cu, max_seqlen=700, softmax_scale=0.1,
                                                    causal=True, output=out, output_scale=gs, output_block_scale=sf,
                                                    **ctx)
        print("compiled")
    """)
    env = dict(os.environ, FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]
