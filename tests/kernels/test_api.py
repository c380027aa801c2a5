"""The Triton kernels: NVFP4 quantizer and flash attention with half / NVFP4 epilogues.

On a CUDA device they run compiled; without one, in Triton's interpreter
(``TRITON_INTERPRET=1``, set by conftest.py) on tiny shapes, so a kernel
regression is caught on the CPU too. Every run draws fresh random inputs; the
seed is in each failure message. Chunked prefill (keys in their own workspace,
``cu_seqlens_k``; causal bottom-right) is checked against float64 attention over
the full sequences, output, log-sum-exp and NVFP4 bytes.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
import torch.nn.functional as F

from fusion_pass import kernels, nvfp4
from fusion_pass.kernels import choice
from fusion_pass.kernels import launchers, reference
from fusion_pass.kernels.api import check_attention
from fusion_pass.kernels.fa4 import sm90 as fa4_sm90
from fusion_pass.kernels.triton import flash_attention as fa
from fusion_pass.kernels.triton import quantize as nvfp4_quant


import context_cases  # noqa: E402
from context_cases import ContextCase, ContextLimits, spans  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
FP8 = torch.float8_e4m3fn
HALF = [torch.bfloat16, torch.float16]

pytestmark = pytest.mark.skipif(
    not CUDA and not kernels.interpreter_enabled(),
    reason="no CUDA device and TRITON_INTERPRET is not set (conftest.py sets it on CPU-only machines)",
)


def fresh_generator() -> tuple[torch.Generator, int]:
    seed = random.SystemRandom().randrange(2**31)
    return torch.Generator().manual_seed(seed), seed


def randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


def scale_bytes(scales: torch.Tensor) -> torch.Tensor:
    return scales.view(torch.uint8)


# ---------------------------------------------------------------------------
# NVFP4 quantizer: the reference's bytes exactly
# ---------------------------------------------------------------------------

QUANT_SHAPES = [(1, 16), (37, 64), (130, 48), (128, 256), (300, 272)] + ([(4099, 4096)] if CUDA else [])


@pytest.mark.parametrize("m,k", QUANT_SHAPES)
@pytest.mark.parametrize("dtype", HALF + [torch.float32])
@pytest.mark.parametrize("swizzled", [True, False])
def test_quant_matches_reference_bytes_into_poisoned_buffers(m, k, dtype, swizzled):
    gen, seed = fresh_generator()
    x = randn(gen, m, k) * torch.exp(2 * randn(gen, m, 1))
    gs = torch.tensor([448 * 6 / float(x.abs().amax()) * 4], device=DEVICE)
    x[0, :16] = 0.0  # all-zero block: scale 0, codes 0
    if m > 2:
        x[1, :16] = -0.0  # sign kept: code 8
        x[2, 16 % k : 16 % k + 16] = 6e4  # saturating scale
    x = x.to(dtype)
    want_packed, want_scales = nvfp4.quantize(x, gs, swizzled=swizzled)
    rows, cols = nvfp4.scale_shape(m, k, swizzled=swizzled)
    results = []
    for poison in (0x00, 0xFF):
        packed = torch.full((m, k // 2), poison, dtype=torch.uint8, device=DEVICE)
        scales = torch.full((rows, cols), poison, dtype=torch.uint8, device=DEVICE)
        got_packed, got_scales = nvfp4_quant.quantize_launch(x, gs, swizzled=swizzled, packed=packed, scales=scales)
        assert got_packed.data_ptr() == packed.data_ptr() and got_scales.data_ptr() == scales.data_ptr()
        results.append((packed.clone(), scales.clone()))
    for packed, scales in results:
        assert torch.equal(scales, scale_bytes(want_scales)), f"block scales differ (seed {seed})"
        assert torch.equal(packed, want_packed), f"packed codes differ (seed {seed})"


def test_quant_rounds_block_scales_like_the_e4m3_cast():
    """Every e4m3 value, every midpoint between neighbours (ties to even, carries into the
    exponent such as 124 -> 128), and their float32 neighbours, as ``gs * amax / 6``."""
    values = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()  # all finite non-negative e4m3
    mids = (values[1:] + values[:-1]) / 2
    targets = torch.cat([values, mids, torch.nextafter(mids, torch.zeros(())), torch.nextafter(mids, torch.full((), 1e9))])
    targets = targets[targets <= 448]
    x = torch.zeros(targets.numel(), 16)
    x[:, 3] = targets * 6  # exact in float32: e4m3 midpoints have few significant bits
    x[:, 5] = -targets * 3
    x = x.to(DEVICE)
    one = torch.ones(1, device=DEVICE)
    _, got = nvfp4_quant.quantize_launch(x, one, swizzled=False)
    _, want = nvfp4.quantize(x, one, swizzled=False)
    assert torch.equal(scale_bytes(got), scale_bytes(want))
    assert torch.equal(scale_bytes(want).cpu(), targets.to(FP8).view(torch.uint8).view(-1, 1))


@pytest.mark.parametrize("gs_value", [nvfp4.GLOBAL_SCALE_MAX, 2.0**100, 1e-20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_matches_reference_bytes_up_to_the_largest_global_scale(gs_value, dtype):
    """Block scales from the smallest nonzero e4m3 (2**-9) to saturation, zero, NaN and Inf blocks, under
    global scales up to :data:`nvfp4.GLOBAL_SCALE_MAX` (where ``gs / 2**-9`` is float32 max): the Triton
    quantizer writes the reference's bytes; above it the entry points refuse the global scale."""
    gen, seed = fresh_generator()
    m, k = 24, 64
    gs = torch.tensor([gs_value], device=DEVICE)
    # per block the unrounded scale t = gs * amax / 6, log-uniform over [2**-11, 2**10]: subnormal to saturated
    t = torch.exp2(torch.rand(m, k // 16, 1, generator=gen) * 21 - 11)
    amax = (t * 6 / gs_value).to(torch.float32)
    x = (torch.rand(m, k // 16, 16, generator=gen) * 2 - 1) * amax
    # no subnormal input (Triton's interpreter converts bfloat16 subnormals inexactly; not the point here)
    x = torch.where(x.abs() < 2.0**-126, 0.0, x).reshape(m, k)
    x[0, :16] = 0.0
    x[1, 16:32] = -0.0
    x[2, 3], x[3, 40] = float("nan"), float("inf")
    x[4, :16] = amax[4, 0, 0]
    x[4, 5] = 0.0
    # t = 2**-9, the smallest nonzero scale, whatever the draw (a normal float at the largest gs)
    x[5, 16:32] = 2.0**-9 * 6 / gs_value
    x = x.to(dtype)  # bfloat16 keeps float32's exponent range: the tiny blocks survive the cast
    x = torch.where(x.float().abs() < 2.0**-126, 0.0, x.float()).to(dtype).to(DEVICE)
    want_packed, want_scales = nvfp4.quantize(x, gs)
    got_packed, got_scales = nvfp4_quant.quantize_launch(x, gs)
    assert torch.equal(scale_bytes(got_scales), scale_bytes(want_scales)), f"block scales differ (seed {seed})"
    assert torch.equal(got_packed, want_packed), f"packed codes differ (seed {seed})"
    assert torch.equal(scale_bytes(kernels.quantize(x, gs)[1]), scale_bytes(want_scales))
    if gs_value == nvfp4.GLOBAL_SCALE_MAX:
        assert bool((scale_bytes(want_scales) == 0x01).any()), "some block has the smallest nonzero scale"
        above = torch.nextafter(gs, torch.tensor([math.inf], device=DEVICE))
        # read back (validate_values=True): the value named; on the device (the default; at once on the CPU)
        matches = {True: r"global_scale must be at most", "device": r"global_scale must be positive and finite "
                                                                    r"and at most .*checked on the device"}
        for mode in matches if not x.is_cuda else [True]:  # a device-side assertion would end the CUDA context
            calls = [lambda: kernels.quantize_rows_into(x, above, torch.empty_like(want_packed),
                                                        torch.empty_like(scale_bytes(want_scales)), 0,
                                                        validate_values=mode),
                     lambda: kernels.quantize(x, above, validate_values=mode)]
            for call in calls:
                with pytest.raises(ValueError, match=matches[mode]):
                    call()


def test_quant_entry_point_flattens_and_checks():
    gen, seed = fresh_generator()
    x = randn(gen, 3, 5, 32, dtype=torch.bfloat16)
    gs = torch.tensor([100.0], device=DEVICE)
    got = kernels.quantize(x, gs)
    want = nvfp4.quantize(x, gs)
    assert torch.equal(got[0], want[0]) and torch.equal(scale_bytes(got[1]), scale_bytes(want[1])), seed
    with pytest.raises(ValueError, match=r"divisible by 16"):
        kernels.quantize(torch.ones(4, 20, device=DEVICE), gs)
    with pytest.raises(TypeError, match=r"global_scale must be a one-element float32 tensor"):
        kernels.quantize(x, 2.0)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device: the scaled_fp4_quant op takes the Triton path on CUDA only")
def test_scaled_fp4_quant_op_on_cuda_is_the_triton_kernel_with_reference_bytes():
    from fusion_pass import ops

    gen, seed = fresh_generator()
    x = randn(gen, 333, 1024, dtype=torch.bfloat16)
    gs = torch.tensor([448 * 6 / float(x.float().abs().amax())], device=DEVICE)
    packed, scales = ops.scaled_fp4_quant(x, gs)
    want_packed, want_scales = nvfp4.quantize(x, gs)
    assert torch.equal(packed, want_packed), seed
    assert torch.equal(scale_bytes(scales), scale_bytes(want_scales)), seed


# ---------------------------------------------------------------------------
# flash attention
# ---------------------------------------------------------------------------

# (num_heads, num_kv_heads, Dqk, Dv, sequence lengths)
CPU_CASES = [
    (2, 2, 192, 128, [37, 5, 20, 1]),  # MLA prefill dims, lengths off the 16-row tile
    (4, 2, 128, 128, [33, 17]),  # GQA
    (2, 1, 72, 32, [40]),  # head dim with a masked tail dot
]
GPU_CASES = [  # both tile configurations of each head-dim pair (max_seqlen below / from 1024)
    (16, 16, 192, 128, [1100, 1, 129, 511, 64]),  # MLA, lengths off the 128-row tile
    (16, 16, 192, 128, [500, 129, 3]),
    (8, 2, 128, 128, [700, 300, 1]),  # GQA
    (4, 4, 128, 128, [2048, 3]),
    (4, 4, 64, 64, [77, 5]),
]
CASES = GPU_CASES if CUDA else CPU_CASES


def make_qkv(gen, heads, kv_heads, dqk, dv, lengths, dtype):
    t = sum(lengths)
    q = randn(gen, t, heads, dqk, dtype=dtype)
    k = randn(gen, t, kv_heads, dqk, dtype=dtype)
    v = randn(gen, t, kv_heads, dv, dtype=dtype)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=DEVICE)
    return q, k, v, cu


def reference_attention(q, k, v, cu, causal, dtype=torch.float64):
    """Per sequence, in ``dtype`` on the CPU (float64: the oracle)."""
    from fusion_pass.kernels.reference import dense_attention

    out = []
    bounds = cu.tolist()
    scale = 1 / math.sqrt(q.shape[2])
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[a:b].cpu().to(dtype) for t in (q, k, v))
        if dtype == torch.float64:
            scores = torch.einsum("qhd,khd->hqk", qs, ks.repeat_interleave(q.shape[1] // k.shape[1], 1)) * scale
            if causal:
                scores = scores.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
            p = scores.softmax(-1)
            out.append(torch.einsum("hqk,khd->qhd", p, vs.repeat_interleave(q.shape[1] // v.shape[1], 1)))
        else:
            out.append(dense_attention(qs, ks, vs, scale=scale, causal=causal)[0])
    return torch.cat(out)


def eager_half_attention(q, k, v, cu, causal):
    """What an eager model computes: SDPA in the input dtype, per sequence."""
    out = []
    bounds = cu.tolist()
    group = q.shape[1] // k.shape[1]
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs = q[a:b].transpose(0, 1)
        ks = k[a:b].repeat_interleave(group, 1).transpose(0, 1)
        vs = v[a:b].repeat_interleave(group, 1).transpose(0, 1)
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c[0]}kv{c[1]}d{c[2]}-{c[3]}")
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("causal", [True, False])
def test_attention_half_output_against_float64(case, dtype, causal):
    heads, kv_heads, dqk, dv, lengths = case
    gen, seed = fresh_generator()
    q, k, v, cu = make_qkv(gen, heads, kv_heads, dqk, dv, lengths, dtype)
    poisoned = torch.full((q.shape[0], heads, dv), float("nan"), dtype=dtype, device=DEVICE)
    out = fa.flash_attention(q, k, v, cu, max(lengths), causal=causal, out=poisoned)
    assert out.data_ptr() == poisoned.data_ptr()
    assert not out.isnan().any(), f"unwritten output elements (seed {seed})"
    ref = reference_attention(q, k, v, cu, causal)
    rel = ((out.cpu().double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, f"relative error {rel:.2e} (seed {seed})"
    public = kernels.attention(q, k, v, cu, max(lengths), causal=causal, backend="triton")
    assert torch.equal(public, out), "the public entry point must run the same kernel"


def code_step(packed, scales, gs):
    """Per element: the gap between the e2m1 values around its code, in output units."""
    codes = nvfp4.unpack_codes(packed.cpu())
    sf = nvfp4.unswizzle_scales(scales.cpu(), packed.shape[0], codes.shape[1] // 16).float()
    return 2 * nvfp4.half_step(codes) * sf.repeat_interleave(16, dim=1) / gs.cpu()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c[0]}kv{c[1]}d{c[2]}-{c[3]}")
@pytest.mark.parametrize("dtype", HALF)
def test_attention_nvfp4_output_within_fa4s_criterion(case, dtype):
    """kernel error <= 2 x (error of eager half attention then quant) + one code step,
    errors measured against float64 attention; every byte written (two poisons agree);
    padding scales zero."""
    heads, kv_heads, dqk, dv, lengths = case
    gen, seed = fresh_generator()
    q, k, v, cu = make_qkv(gen, heads, kv_heads, dqk, dv, lengths, dtype)
    t = q.shape[0]
    ref = reference_attention(q, k, v, cu, True).reshape(t, -1)
    gs = torch.tensor([448 * 6 / ref.abs().max().item()], dtype=torch.float32, device=DEVICE)
    rows, cols = nvfp4.scale_shape(t, heads * dv)

    runs = []
    for poison in (0x00, 0xFF):
        packed = torch.full((t, heads * dv // 2), poison, dtype=torch.uint8, device=DEVICE)
        scales = torch.full((rows, cols), poison, dtype=torch.uint8, device=DEVICE)
        fa.flash_attention_nvfp4(q, k, v, cu, max(lengths), gs, causal=True, packed=packed, scales=scales)
        runs.append((packed.clone(), scales.clone()))
    (packed, scales), (packed2, scales2) = runs
    assert torch.equal(packed, packed2) and torch.equal(scales, scales2), f"unwritten bytes (seed {seed})"
    linear = nvfp4.unswizzle_scales(scales.cpu().view(FP8), rows, cols)
    assert not linear[t:].view(torch.uint8).any(), "padding rows of the scale buffer must be zero"

    kernel = nvfp4.dequantize(packed.cpu(), scales.cpu().view(FP8), gs.cpu()).double()
    eager_packed, eager_scales = nvfp4.quantize(eager_half_attention(q, k, v, cu, True).reshape(t, -1), gs)
    eager = nvfp4.dequantize(eager_packed.cpu(), eager_scales.cpu(), gs.cpu()).double()
    ref_packed, ref_scales = nvfp4.quantize(ref.float(), gs.cpu())
    step = code_step(ref_packed, ref_scales, gs).double()
    kernel_err = (kernel - ref).abs().max().item()
    eager_err = (eager - ref).abs().max().item()
    allowed = 2 * eager_err + step.max().item()
    assert kernel_err <= allowed, f"kernel error {kernel_err:.3e} > {allowed:.3e} (eager {eager_err:.3e}, seed {seed})"

    public = kernels.attention_nvfp4(q, k, v, cu, max(lengths), gs, backend="triton")
    assert torch.equal(public[0], packed) and torch.equal(scale_bytes(public[1]), scales)


def test_reference_backend_is_float32_attention_then_reference_quant():
    gen, seed = fresh_generator()
    q, k, v, cu = make_qkv(gen, 2, 1, 32, 16, [9, 4], torch.bfloat16)
    gs = torch.tensor([50.0], device=DEVICE)
    packed, scales = kernels.attention_nvfp4(q, k, v, cu, 9, gs, backend="reference")
    ref = reference_attention(q, k, v, cu, True, dtype=torch.float32).reshape(13, -1)
    want = nvfp4.quantize(ref.to(DEVICE), gs)
    assert torch.equal(packed, want[0]) and torch.equal(scale_bytes(scales), scale_bytes(want[1])), seed
    out = kernels.attention(q, k, v, cu, 9, backend="reference")
    assert torch.equal(out.cpu(), ref.reshape(13, 2, 16).to(torch.bfloat16))


def test_split_head_dim():
    assert fa.split_head_dim(192) == (128, 64)
    assert fa.split_head_dim(128) == (128, 0)
    assert fa.split_head_dim(72) == (64, 16)
    assert fa.split_head_dim(16) == (16, 0)


# ---------------------------------------------------------------------------
# argument checks of the public entry points
# ---------------------------------------------------------------------------


_ON_DEVICE = r"(?=.*checked on the device, not read back).*"
"""A value error found on the device (``validate_values="device"``) says so."""

VALUE_MODES = [True, "device"]


def _match(match, mode):
    """``match`` (one regex for both modes, or ``(read back, on the device)``) for ``validate_values=mode``.
    A value error on the device ends the CUDA context (a device-side assertion): tested on the CPU only."""
    if isinstance(match, str):
        return match
    if mode == "device" and CUDA:
        pytest.skip("a device-side assertion is fatal to the CUDA context; the device check runs on the CPU")
    return match[0] if mode is True else match[1]


def _args():
    q = torch.zeros(10, 4, 32, dtype=torch.bfloat16, device=DEVICE)
    k = torch.zeros(10, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    v = torch.zeros(10, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE)
    return q, k, v, cu


@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda a: {"q": a["q"][0]}, ValueError, r"q must be a 3-D tensor \[T, H, Dqk\]"),
        (lambda a: {"k": a["k"].float()}, TypeError, r"k must be float16 or bfloat16, got torch.float32"),
        (lambda a: {"v": a["v"].half()}, TypeError, r"share one dtype"),
        (lambda a: {"k": a["k"][:9]}, ValueError, r"same number of tokens"),
        (lambda a: {"k": a["k"][..., :16]}, ValueError, r"k must be \[T, Hkv, Dqk\] with q's Dqk=32"),
        (lambda a: {"v": a["v"][:, :1]}, ValueError, r"v must be \[T, Hkv, Dv\] with k's Hkv=2"),
        (lambda a: {"k": a["k"][:, :1].expand(10, 3, 32), "v": a["v"][:, :1].expand(10, 3, 16)}, ValueError,
         r"H=4 must be a multiple of k/v's heads Hkv=3"),
        (lambda a: {"cu": a["cu"].long()}, ValueError, r"cu_seqlens must be a 1-D int32 tensor"),
        (lambda a: {"cu": a["cu"][:1]}, ValueError, r"B \+ 1 >= 2"),
        (lambda a: {"cu": torch.tensor([0, 4, 9], dtype=torch.int32, device=DEVICE)}, ValueError,
         (r"rise from 0 to T=10 without decreasing, got \[0, 4, 9\]", _ON_DEVICE + r"rise from 0 to T=10")),
        (lambda a: {"cu": torch.tensor([0, 6, 4, 10], dtype=torch.int32, device=DEVICE)}, ValueError,
         (r"without decreasing, got \[0, 6, 4, 10\]", _ON_DEVICE + r"without decreasing")),
        (lambda a: {"cu": torch.tensor([1, 4, 10], dtype=torch.int32, device=DEVICE)}, ValueError,
         (r"rise from 0 to T=10 without decreasing, got \[1, 4, 10\]", _ON_DEVICE + r"rise from 0 to T=10")),
        (lambda a: {"max_seqlen": 5}, ValueError,
         (r"max_seqlen=5 is smaller than the longest sequence \(6\)", _ON_DEVICE + r"no sequence longer than "
                                                                          r"max_seqlen=5")),
        (lambda a: {"max_seqlen": 6.0}, ValueError, r"max_seqlen must be a non-negative int"),
        (lambda a: {"softmax_scale": float("nan")}, ValueError, r"softmax_scale must be None or a positive"),
        (lambda a: {"backend": "cudnn"}, ValueError, r"backend must be one of auto, triton, fa4, reference"),
    ],
)
@pytest.mark.parametrize("mode", VALUE_MODES)
def test_attention_rejects_bad_arguments(change, error, match, mode):
    q, k, v, cu = _args()
    args = {"q": q, "k": k, "v": v, "cu": cu, "max_seqlen": 6, "softmax_scale": None, "backend": "reference"}
    args.update(change(args))
    with pytest.raises(error, match=_match(match, mode)):
        kernels.attention(args["q"], args["k"], args["v"], args["cu"], args["max_seqlen"],
                          softmax_scale=args["softmax_scale"], backend=args["backend"], validate_values=mode)


def test_attention_nvfp4_rejects_bad_global_scale_and_head_dims():
    q, k, v, cu = _args()
    for gs, match, mode in [
        (torch.tensor([1.0, 2.0], device=DEVICE), r"global_scale must be a one-element float32 tensor", "device"),
        (torch.tensor([0.0], device=DEVICE), r"global_scale must be positive and finite, got 0.0", True),
        *[(torch.tensor([value], device=DEVICE), r"global_scale must be positive and finite and at most .*"
           r"checked on the device", "device") for value in ([0.0, -1.0, math.inf, math.nan] if not CUDA else [])],
        (torch.tensor([1.0], dtype=torch.float64, device=DEVICE), r"one-element float32", "device"),
    ]:
        with pytest.raises(ValueError, match=match):
            kernels.attention_nvfp4(q, k, v, cu, 6, gs, backend="reference", validate_values=mode)
    odd_v = torch.zeros(10, 2, 8, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=r"backend 'triton' needs v's head dim Dv divisible by 16, got 8"):
        kernels.attention_nvfp4(q, k, odd_v, cu, 6, torch.ones(1, device=DEVICE), backend="triton")


def test_unavailable_backends_say_why(monkeypatch):
    q, k, v, cu = _args()
    # without FA4: "flash_attn.cute is not installed"; with it: CPU tensors, or (SM90) head dims not FA4's
    with pytest.raises(RuntimeError, match=r"backend 'fa4' is unavailable: .*(flash_attn|head dims|CUDA devices only)"):
        kernels.attention(q, k, v, cu, 6, backend="fa4")
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match=r"backend 'triton' is unavailable: triton runs on CUDA tensors"):
            kernels.attention(q, k, v, cu, 6, backend="triton")
        # auto never picks the interpreter: CPU tensors get the reference
        assert choice.choose("attention", "auto", q, v) == "reference"
    else:
        fa4_ok = fa4_sm90.fa4_sm90_usable(q.device, q.dtype, q.shape[1], q.shape[2], v.shape[2])[0]
        assert choice.choose("attention", "auto", q, v) == ("fa4" if fa4_ok else "triton")


@pytest.mark.parametrize("validate_values", [True, "device"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
@pytest.mark.parametrize("entry", ["quantize", "quantize_rows_into", "attention_nvfp4"])
def test_a_bad_global_scale_is_named_before_an_unavailable_backend(entry, bad, validate_values, monkeypatch):
    """CPU tensors where Triton cannot run them (a machine with CUDA, or TRITON_INTERPRET=0) and a bad global
    scale are two errors: the caller's value is named first, with nothing written, though ``triton`` was asked
    for (``merge_attention_nvfp4``: tests/kernels/test_merge.py, where the H200 found the other order)."""
    from row_buffers import POISON, poisoned, scale_bytes

    monkeypatch.setattr(choice, "triton_usable", lambda device: (False, "stub: Triton cannot run here"))
    gs = torch.tensor([bad])
    x = torch.randn(4, 32)
    packed, scales = poisoned(10, 32, torch.uint8, device="cpu")
    q, k, v, cu = (t.cpu() for t in _args())
    kw = {"backend": "triton", "validate_values": validate_values}
    calls = {
        "quantize": lambda: kernels.quantize(x, gs, **kw),
        "quantize_rows_into": lambda: kernels.quantize_rows_into(x, gs, packed, scales, 2, **kw),
        "attention_nvfp4": lambda: kernels.attention_nvfp4(q, k, v, cu, 6, gs, **kw),
    }
    with pytest.raises((ValueError, RuntimeError), match=f"^{entry}: global_scale must be positive and finite"):
        calls[entry]()
    assert (packed == POISON).all() and (scale_bytes(scales) == POISON).all(), "written before the error"
    with pytest.raises(RuntimeError, match=f"{entry}: backend 'triton' is unavailable: stub"):
        gs.fill_(2.0)
        calls[entry]()


# ---------------------------------------------------------------------------
# the attention op on this device: fused on prefill, fallback byte-equal to unfused
# ---------------------------------------------------------------------------


def test_attention_op_fuses_prefill_and_falls_back_byte_equal_on_decode(monkeypatch):
    """Through ``torch.ops.fusion_pass.attention_with_output`` on this device: a prefill
    batch takes the fused path (the ``triton`` backend on CUDA, ``reference`` on the CPU)
    within the requantization bound of the unfused bytes; a decode batch falls back and
    its bytes equal the unfused path's (attention in bf16, then ``scaled_fp4_quant``)."""
    from fusion_pass import ops, runtime
    from fusion_pass.runtime import counters, guard
    from fusion_pass.demo.workload import compare_nvfp4
    from fusion_pass.runtime import BatchSpec, RequestSpec

    heads, kv_heads, dim = (8, 2, 128) if CUDA else (2, 1, 32)
    lengths = (300, 77) if CUDA else (20, 7)
    fa4_ok = fa4_sm90.fa4_sm90_usable(DEVICE, torch.bfloat16, heads, dim, dim)[0]
    if CUDA and not fa4_ok:  # auto takes only a backend measured fast here: name the Triton one
        monkeypatch.setenv("FUSION_PASS_BACKEND", "triton")
    impl = runtime.AttentionImpl(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, softmax_scale=dim**-0.5)
    runtime.register_layer("test_kernels.attn", impl)
    gen, seed = fresh_generator()
    try:
        runtime.clear_kv_caches()
        steps = [
            BatchSpec((RequestSpec("a", lengths[0]), RequestSpec("b", lengths[1]))),
            BatchSpec((RequestSpec("a", 1, lengths[0]), RequestSpec("b", 1, lengths[1]))),
        ]
        for spec, want_path in zip(steps, ("fused", "fallback")):
            t = spec.num_tokens
            q = randn(gen, t, heads, dim, dtype=torch.bfloat16)
            k = randn(gen, t, kv_heads, dim, dtype=torch.bfloat16)
            v = randn(gen, t, kv_heads, dim, dtype=torch.bfloat16)
            start = runtime.snapshot_kv_caches()
            with runtime.batch(spec):
                half = torch.empty(t, heads * dim, dtype=torch.bfloat16, device=DEVICE)
                torch.ops.fusion_pass.attention_with_output(q, k, v, half, "test_kernels.attn")
                gs = torch.tensor([448 * 6 / half.float().abs().max().item()], device=DEVICE)
                unfused = ops.scaled_fp4_quant(half, gs)
                runtime.restore_kv_caches(start)
                rows, cols = nvfp4.scale_shape(t, heads * dim)
                packed = torch.full((t, heads * dim // 2), 0xAB, dtype=torch.uint8, device=DEVICE)
                scales = torch.full((rows, cols // 4), -1, dtype=torch.int32, device=DEVICE)  # vLLM's allocation
                before = counters.counters()
                torch.ops.fusion_pass.attention_with_output(q, k, v, packed, "test_kernels.attn", gs, scales)
                after = counters.counters()
            fused = after["fused"] - before["fused"]
            assert (fused == 1) == (want_path == "fused"), f"{spec.kind}: guard took the wrong path"
            equal, err, bound, within = compare_nvfp4([(packed, scales.view(FP8))], [unfused], [gs])
            if want_path == "fused":
                decision = guard.decide(guard.BatchRows.from_spec(spec),
                                        guard.LayerShape(q.device, q.dtype, heads, dim, dim))
                assert decision.backend == (("fa4" if fa4_ok else "triton") if CUDA else "reference")
                assert within, f"fused NVFP4 off the unfused bytes by {err:.3e} > {bound:.3e} (seed {seed})"
            else:
                assert equal, f"fallback bytes differ from the unfused path's (seed {seed})"
    finally:
        runtime.unregister_layer("test_kernels.attn")
        runtime.clear_kv_caches()


# ---------------------------------------------------------------------------
# chunked prefill: keys/values in their own workspace (cu_seqlens_k), causal bottom-right
# ---------------------------------------------------------------------------

# (num_heads, num_kv_heads, Dqk, Dv)
CONTEXT_HEADS = (
    [(16, 16, 192, 128), (8, 2, 128, 128)] if CUDA else [(2, 2, 192, 128), (4, 2, 128, 128)]
)  # MLA prefill dims; GQA
CONTEXT_LIMITS = (
    ContextLimits(max_queries=300, max_context=1000, max_long_context=2000, max_row0=300, max_tail=3)
    if CUDA
    else ContextLimits(max_queries=20, max_context=30, max_long_context=60, max_row0=9, max_tail=3)
)

LSE_ATOL = 1e-3
"""Log-sum-exp against float64 (same half inputs): the kernel's scores are float32 dots whose
accumulation error is at most ``Dqk * 2^-24 * scale * sum_d |q_d k_d|`` (~1.3e-4 for Dqk=192 and
unit-normal inputs, where ``scale * sum_d |q_d k_d|`` is about 11), and ``|d lse| <= max_j |d s_j|``
plus the exp2/log2 rounding (a few 1e-7 relative, lse ~ 10). 1e-3 leaves a ~8x margin."""


def context_case(seed: int, causal: bool, *, row0: bool = True) -> ContextCase:
    return context_cases.context_case(seed, causal, CONTEXT_LIMITS, row0=row0)


def cumulative(lengths, start: int = 0) -> torch.Tensor:
    return context_cases.cumulative(lengths, start, device=DEVICE)


def context_inputs(case: ContextCase, heads, dtype):
    return context_cases.context_inputs(case, heads, dtype, DEVICE)


def reference_context_attention(q, k, v, cu, cu_k, causal):
    """float64 attention over the full sequences (:func:`context_cases.reference_context_attention`,
    computed on q's device): ``(out, lse)`` on the CPU."""
    out, lse = context_cases.reference_context_attention(q, k, v, cu, cu_k, causal, 1 / math.sqrt(q.shape[2]))
    return out.cpu(), lse.cpu()


def eager_half_context_attention(q, k, v, cu, cu_k):
    """What an eager model computes: causal (bottom-right) SDPA in the input dtype, per sequence."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    group = q.shape[1] // k.shape[1]
    for (a, b), (ka, kb) in zip(spans(cu), spans(cu_k)):
        if b > a:
            visible = torch.ones(b - a, kb - ka, dtype=torch.bool, device=q.device).tril((kb - ka) - (b - a))
            qs = q[a:b].transpose(0, 1)
            ks = k[ka:kb].repeat_interleave(group, 1).transpose(0, 1)
            vs = v[ka:kb].repeat_interleave(group, 1).transpose(0, 1)
            out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=visible).transpose(0, 1)
    return out


def assert_lse_close(lse, ref_lse, rows: slice, what: str) -> None:
    got, want = lse[rows].cpu().double(), ref_lse[rows]
    empty = want.isneginf()
    assert torch.equal(got.isneginf(), empty), f"{what}: -inf exactly where a row sees no key"
    assert got[~empty].isfinite().all(), f"{what}: non-finite log-sum-exp"
    err = (got[~empty] - want[~empty]).abs().max().item() if (~empty).any() else 0.0
    assert err <= LSE_ATOL, f"{what}: log-sum-exp off by {err:.2e} > {LSE_ATOL}"


def test_generated_context_cases_cover_the_interesting_batches():
    for seed in range(200):
        for causal in (True, False):
            case = context_case(seed, causal)
            pairs = list(zip(case.query_lens, case.key_lens))
            assert any(lq == 1 for lq, _ in pairs) and any(lq == 0 for lq, _ in pairs)
            assert any(lk == lq > 0 for lq, lk in pairs), "no sequence without context"
            assert any(lk >= 10 * lq > 0 for lq, lk in pairs), "no long context"
            assert case.row0 > 0 and case.tail > 0
            if causal:
                assert all(lk >= lq for lq, lk in pairs)
            else:
                assert any(lk == 0 < lq for lq, lk in pairs) and any(0 < lk < lq for lq, lk in pairs)


@pytest.mark.parametrize("heads", CONTEXT_HEADS, ids=lambda c: f"H{c[0]}kv{c[1]}d{c[2]}-{c[3]}")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_context_attention_half_and_lse_against_float64(heads, causal):
    """The launcher with ``cu_seqlens_k``: q's sequences start past row 0 and the rows around
    them stay untouched (NaN poison); half and float32 outputs within the half-output criterion
    of float64 attention over the full sequences; the LSE (written through a transposed
    ``[H, T]`` buffer) within :data:`LSE_ATOL`, ``-inf`` where no key is visible."""
    seed = random.SystemRandom().randrange(2**31)
    case = context_case(seed, causal)
    dtype = HALF[seed % 2]
    q, k, v, cu, cu_k = context_inputs(case, heads, dtype)
    t, h, dv = q.shape[0], q.shape[1], v.shape[2]
    rows = slice(case.row0, t - case.tail)
    ref, ref_lse = reference_context_attention(q, k, v, cu, cu_k, causal)
    args = dict(causal=causal, cu_seqlens_k=cu_k, max_seqlen_k=max(case.key_lens))
    half = fa.flash_attention(q, k, v, cu, max(case.query_lens), out=torch.full((t, h, dv), float("nan"), dtype=dtype,
                                                                                 device=DEVICE), **args)
    out32 = torch.full((t, h, dv), float("nan"), device=DEVICE)
    lse = torch.full((h, t), float("nan"), device=DEVICE).t()
    fa.flash_attention(q, k, v, cu, max(case.query_lens), out=out32, lse=lse, **args)
    for name, got in (("half", half), ("float32", out32), ("lse", lse)):
        outside = torch.cat([got[: case.row0], got[t - case.tail :]])
        assert outside.isnan().all(), f"{name}: rows outside the sequences were written ({case})"
        assert not got[rows].isnan().any(), f"{name}: unwritten rows ({case})"
    for name, got in (("half", half), ("float32", out32)):
        rel = ((got[rows].cpu().double() - ref[rows]).norm() / ref[rows].norm()).item()
        assert rel < 1e-2, f"{name} output: relative error {rel:.2e} ({case})"
    assert not out32[rows].cpu()[ref_lse[rows].isneginf()].any(), f"rows without keys must be 0 ({case})"
    assert_lse_close(lse, ref_lse, rows, str(case))


@pytest.mark.parametrize("heads", CONTEXT_HEADS, ids=lambda c: f"H{c[0]}kv{c[1]}d{c[2]}-{c[3]}")
def test_context_attention_nvfp4_within_fa4s_criterion_at_global_rows(heads):
    """The fused backend's call (:func:`launchers.flash_attention_nvfp4_varlen`) with ``cu_seqlens_k``
    and ``cu_seqlens[0] > 0``: the rows of the sequences within the criterion of
    :func:`test_attention_nvfp4_output_within_fa4s_criterion` (errors against float64 over the
    full sequences), every byte of them written (two poisons agree), the rows before and after
    keep their poison, the scale padding is zero."""
    seed = random.SystemRandom().randrange(2**31)
    case = context_case(seed, True)
    dtype = HALF[seed % 2]
    q, k, v, cu, cu_k = context_inputs(case, heads, dtype)
    t, h, dv = q.shape[0], q.shape[1], v.shape[2]
    a, e = case.row0, t - case.tail
    ref = reference_context_attention(q, k, v, cu, cu_k, True)[0].reshape(t, -1)
    gs = torch.tensor([448 * 6 / ref[a:e].abs().max().item()], dtype=torch.float32, device=DEVICE)
    rows, cols = nvfp4.scale_shape(t, h * dv)
    blocks = h * dv // 16
    runs = []
    for poison in (0xAB, 0x00):
        packed = torch.full((t, h * dv // 2), poison, dtype=torch.uint8, device=DEVICE)
        scales = torch.full((rows, cols // 4), int.from_bytes(bytes([poison] * 4), "little", signed=True),
                            dtype=torch.int32, device=DEVICE)  # vLLM's allocation
        launchers.flash_attention_nvfp4_varlen(
            q, k, v, cu_seqlens=cu, max_seqlen=max(case.query_lens), softmax_scale=1 / math.sqrt(q.shape[2]),
            causal=True, output=packed, output_scale=gs, output_block_scale=scales, cu_seqlens_k=cu_k,
            max_seqlen_k=max(case.key_lens),
        )
        linear = nvfp4.unswizzle_scales(scales.cpu().view(FP8), rows, cols).view(torch.uint8)
        outside = torch.cat([packed[:a].cpu(), packed[e:].cpu()])
        assert (outside == poison).all(), f"packed bytes outside rows [{a}, {e}) were written ({case})"
        assert (linear[:a, :blocks] == poison).all() and (linear[e:t, :blocks] == poison).all(), (
            f"scales outside rows [{a}, {e}) were written ({case})")
        assert not linear[t:].any() and not linear[:, blocks:].any(), f"scale padding not zero ({case})"
        runs.append((packed.cpu(), linear, scales.cpu().view(FP8)))
    (packed, linear, scales), (packed2, linear2, _) = runs
    assert torch.equal(packed[a:e], packed2[a:e]) and torch.equal(linear[a:e], linear2[a:e]), (
        f"unwritten bytes in rows [{a}, {e}) ({case})")

    kernel = nvfp4.dequantize(packed, scales, gs.cpu()).double()[a:e]
    eager = eager_half_context_attention(q, k, v, cu, cu_k).reshape(t, -1)[a:e]
    eager = nvfp4.dequantize(*nvfp4.quantize(eager, gs), gs).cpu().double()
    ref_packed, ref_scales = nvfp4.quantize(ref[a:e].float(), gs.cpu())
    step = code_step(ref_packed, ref_scales, gs).double()
    kernel_err = (kernel - ref[a:e]).abs().max().item()
    eager_err = (eager - ref[a:e]).abs().max().item()
    allowed = 2 * eager_err + step.max().item()
    assert kernel_err <= allowed, f"kernel error {kernel_err:.3e} > {allowed:.3e} (eager {eager_err:.3e}, {case})"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_context_public_entry_points(causal):
    """``attention`` / ``attention_with_lse`` / ``attention_nvfp4`` with ``cu_seqlens_k``: the
    ``triton`` backend runs the launchers (same bytes), ``reference`` is dense float32 attention
    with ``q_offset = Lk - Lq`` (float64-close), ``max_seqlen_k`` defaults from ``cu_seqlens_k``."""
    seed = random.SystemRandom().randrange(2**31)
    case = context_case(seed, causal, row0=False)
    heads = CONTEXT_HEADS[seed % len(CONTEXT_HEADS)]
    dtype = HALF[seed % 2]
    q, k, v, cu, cu_k = context_inputs(case, heads, dtype)
    t, h, dv = q.shape[0], q.shape[1], v.shape[2]
    max_q, max_k = max(case.query_lens), max(case.key_lens)
    ref, ref_lse = reference_context_attention(q, k, v, cu, cu_k, causal)
    gs = torch.tensor([448 * 6 / ref.abs().max().item()], dtype=torch.float32, device=DEVICE)
    ctx = dict(causal=causal, cu_seqlens_k=cu_k)

    out32 = torch.empty(t, h, dv, device=DEVICE)
    lse = torch.empty(t, h, device=DEVICE)
    fa.flash_attention(q, k, v, cu, max_q, out=out32, lse=lse, **ctx)
    got_out, got_lse = kernels.attention_with_lse(q, k, v, cu, max_q, backend="triton", **ctx)
    assert got_out.dtype == got_lse.dtype == torch.float32 and got_lse.shape == (t, h)
    assert torch.equal(got_out, out32) and torch.equal(got_lse, lse), f"attention_with_lse(triton) ({case})"
    half = kernels.attention(q, k, v, cu, max_q, backend="triton", max_seqlen_k=max_k, **ctx)
    assert torch.equal(half, fa.flash_attention(q, k, v, cu, max_q, **ctx)), f"attention(triton) ({case})"
    if causal:
        packed, scales = kernels.attention_nvfp4(q, k, v, cu, max_q, gs, backend="triton", **ctx)
        want = fa.flash_attention_nvfp4(q, k, v, cu, max_q, gs, **ctx)
        assert torch.equal(packed, want[0]) and torch.equal(scale_bytes(scales), scale_bytes(want[1])), str(case)

    ref_out, ref_lse32 = kernels.attention_with_lse(q, k, v, cu, max_q, backend="reference", **ctx)
    assert ((ref_out.cpu().double() - ref).abs().max() <= 1e-4 * (1 + ref.abs().max())).item(), str(case)
    assert_lse_close(ref_lse32, ref_lse, slice(0, t), f"reference ({case})")
    dense_out = reference.varlen_attention(q, k, v, cu, causal, 1 / math.sqrt(q.shape[2]), cu_k)[0]
    assert torch.equal(dense_out, ref_out)
    assert torch.equal(kernels.attention(q, k, v, cu, max_q, backend="reference", **ctx), ref_out.to(dtype))
    packed, scales = kernels.attention_nvfp4(q, k, v, cu, max_q, gs, backend="reference", **ctx)
    want = nvfp4.quantize(ref_out.reshape(t, -1), gs)
    assert torch.equal(packed, want[0]) and torch.equal(scale_bytes(scales), scale_bytes(want[1])), str(case)


def test_context_attention_without_any_key():
    """Non-causal sequences over an empty key workspace (``Tk = 0``): output 0, LSE -inf."""
    q = torch.ones(7, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    k = torch.empty(0, 1, 32, dtype=torch.bfloat16, device=DEVICE)
    v = torch.empty(0, 1, 16, dtype=torch.bfloat16, device=DEVICE)
    cu, cu_k = cumulative([3, 4]), cumulative([0, 0])
    out, lse = kernels.attention_with_lse(q, k, v, cu, 4, cu_seqlens_k=cu_k, causal=False, backend="triton")
    assert not out.any() and lse.isneginf().all()
    ref_out, ref_lse = kernels.attention_with_lse(q, k, v, cu, 4, cu_seqlens_k=cu_k, causal=False, backend="reference")
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_cu_seqlens_k_equal_to_cu_seqlens_is_todays_kernel():
    """Keys delimited by the queries' own ``cu_seqlens`` (``Lk = Lq``): the bytes of the call without it."""
    gen, seed = fresh_generator()
    q, k, v, cu = make_qkv(gen, 4, 2, 72, 32, [23, 1, 17], torch.bfloat16)
    for causal in (True, False):
        want = fa.flash_attention(q, k, v, cu, 23, causal=causal)
        got = fa.flash_attention(q, k, v, cu, 23, causal=causal, cu_seqlens_k=cu.clone(), max_seqlen_k=23)
        assert torch.equal(got, want), f"causal={causal} (seed {seed})"


@pytest.mark.parametrize("t,width", [(5, 64), (150, 32), (128, 48), (300, 96), (1, 16), (256, 256)])
def test_nvfp4_scale_padding_fill_touches_only_padding(t, width):
    """The launchers' padding fill: rows ``>= t`` and block columns ``>= width/16`` zero, every other byte kept."""
    from fusion_pass.kernels.checks import zero_nvfp4_scale_padding

    rows, cols = nvfp4.scale_shape(t, width)
    buf = torch.full((rows * cols,), 0xAB, dtype=torch.uint8, device=DEVICE)
    zero_nvfp4_scale_padding(buf, t, width)
    linear = nvfp4.unswizzle_scales(buf.view(rows, cols).cpu().view(FP8), rows, cols).view(torch.uint8)
    padding = torch.zeros(rows, cols, dtype=torch.bool)
    padding[t:] = True
    padding[:, width // 16 :] = True
    assert not linear[padding].any() and (linear[~padding] == 0xAB).all()


# (entry point, change, error, match): q 10 tokens in [4, 6]; k/v 14 tokens in [6, 8]
_CONTEXT_BAD = [
    (lambda a: {"cu_k": a["cu_k"].long()}, ValueError, r"cu_seqlens_k must be a 1-D int32 tensor"),
    (lambda a: {"cu_k": a["cu_k"][None]}, ValueError, r"cu_seqlens_k must be a 1-D int32 tensor"),
    (lambda a: {"cu_k": torch.tensor([0, 6, 10, 14], dtype=torch.int32, device=DEVICE)}, ValueError,
     r"cu_seqlens_k must have B \+ 1 = 3 entries like cu_seqlens, got 4"),
    (lambda a: {"cu_k": a["cu_k"].to("meta")}, ValueError, r"cu_seqlens_k must be on q's device"),
    (lambda a: {"cu_k": torch.tensor([0, 9, 6, 9, 14, 9], dtype=torch.int32, device=DEVICE)[::2]}, ValueError,
     r"cu_seqlens_k must be contiguous"),
    (lambda a: {"cu_k": torch.tensor([0, 6, 13], dtype=torch.int32, device=DEVICE)}, ValueError,
     (r"cu_seqlens_k must rise from 0 to Tk=14 \(k's tokens\) without decreasing, got \[0, 6, 13\]",
      _ON_DEVICE + r"cu_seqlens_k must rise from 0 to Tk=14")),
    (lambda a: {"cu_k": torch.tensor([0, 15, 14], dtype=torch.int32, device=DEVICE)}, ValueError,
     (r"cu_seqlens_k must rise from 0 to Tk=14 \(k's tokens\) without decreasing, got \[0, 15, 14\]",
      _ON_DEVICE + r"cu_seqlens_k must rise from 0 to Tk=14 \(k's tokens\) without decreasing")),
    (lambda a: {"cu_k": torch.tensor([0, 3, 14], dtype=torch.int32, device=DEVICE), "max_seqlen_k": None}, ValueError,
     (r"cu_seqlens_k gives sequence 0 3 keys for its 4 queries; .*needs Lk >= Lq",
      _ON_DEVICE + r"causal attention needs Lk >= Lq for every sequence")),
    (lambda a: {"max_seqlen_k": 7}, ValueError,
     (r"max_seqlen_k=7 is smaller than the longest key sequence \(8\)",
      _ON_DEVICE + r"no key sequence longer than max_seqlen_k=7")),
    (lambda a: {"max_seqlen_k": -1}, ValueError, r"max_seqlen_k must be None or a non-negative int"),
    (lambda a: {"cu_k": None, "k": a["k"][:10], "v": a["v"][:10]}, ValueError,
     r"max_seqlen_k=8 is given without cu_seqlens_k"),
    (lambda a: {"cu_k": None, "max_seqlen_k": None}, ValueError,
     r"same number of tokens T \(or pass cu_seqlens_k\)"),
    (lambda a: {"v": a["v"][:13]}, ValueError, r"k and v must have the same number of tokens Tk"),
    (lambda a: {"causal": 1}, ValueError, r"causal must be a bool"),
]


def _context_args():
    q, _, _, cu = _args()
    k = torch.zeros(14, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    v = torch.zeros(14, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    cu_k = torch.tensor([0, 6, 14], dtype=torch.int32, device=DEVICE)
    return {"q": q, "k": k, "v": v, "cu": cu, "cu_k": cu_k, "max_seqlen_k": 8, "causal": True}


_ENTRIES = {
    "attention": lambda a, **kw: kernels.attention(a["q"], a["k"], a["v"], a["cu"], 6, **kw),
    "attention_with_lse": lambda a, **kw: kernels.attention_with_lse(a["q"], a["k"], a["v"], a["cu"], 6, **kw),
    "attention_nvfp4": lambda a, **kw: kernels.attention_nvfp4(a["q"], a["k"], a["v"], a["cu"], 6,
                                                               torch.ones(1, device=DEVICE), **kw),
}


@pytest.mark.parametrize("mode", VALUE_MODES)
@pytest.mark.parametrize("entry", list(_ENTRIES))
@pytest.mark.parametrize("change,error,match", _CONTEXT_BAD)
def test_context_entries_reject_bad_cu_seqlens_k(entry, change, error, match, mode):
    args = _context_args()
    args.update(change(args))
    with pytest.raises(error, match=_match(match, mode)):
        _ENTRIES[entry](args, cu_seqlens_k=args["cu_k"], max_seqlen_k=args["max_seqlen_k"], causal=args["causal"],
                        backend="reference", validate_values=mode)


@pytest.mark.parametrize("mode", VALUE_MODES)
@pytest.mark.parametrize("entry", list(_ENTRIES))
def test_context_entries_accept_fewer_keys_than_queries_when_not_causal(entry, mode):
    args = _context_args()
    cu_k = torch.tensor([0, 3, 14], dtype=torch.int32, device=DEVICE)  # sequence 0: 3 keys, 4 queries
    _ENTRIES[entry](args, cu_seqlens_k=cu_k, causal=False, backend="reference", validate_values=mode)


@pytest.mark.parametrize(
    "cu_k,match",
    [
        (lambda: torch.tensor([0, 6, 14], dtype=torch.int64, device=DEVICE), r"cu_seqlens_k must be a 1-D int32 tensor"),
        (lambda: torch.tensor([0, 14], dtype=torch.int32, device=DEVICE), r"cu_seqlens_k must have B \+ 1 = 3 entries"),
        (lambda: torch.tensor([0, 6, 14], dtype=torch.int32, device="meta"), r"cu_seqlens_k must be on q's device"),
        (lambda: torch.tensor([0, 0, 6, 0, 14, 0], dtype=torch.int32, device=DEVICE)[::2],
         r"cu_seqlens_k must be contiguous"),
    ],
    ids=["int64", "length", "device", "strided"],
)
def test_fused_call_rejects_bad_cu_seqlens_k_without_reading_it(cu_k, match):
    a = _context_args()
    cu_k = cu_k()  # built on the device: moving a strided tensor there would make it contiguous
    rows, cols = nvfp4.scale_shape(10, 4 * 16)
    with pytest.raises(ValueError, match=match):
        launchers.flash_attention_nvfp4_varlen(
            a["q"], a["k"], a["v"], cu_seqlens=a["cu"], max_seqlen=6, softmax_scale=0.1, causal=True,
            output=torch.zeros(10, 32, dtype=torch.uint8, device=DEVICE), output_scale=torch.ones(1, device=DEVICE),
            output_block_scale=torch.zeros(rows, cols, dtype=torch.uint8, device=DEVICE), cu_seqlens_k=cu_k,
        )


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device: device synchronizations are detected on CUDA only")
def test_fused_call_with_cu_seqlens_k_does_not_synchronize():
    """The fused backend's call reads no value back (``torch.cuda.set_sync_debug_mode("error")``)."""
    seed = random.SystemRandom().randrange(2**31)
    case = context_case(seed, True)
    q, k, v, cu, cu_k = context_inputs(case, CONTEXT_HEADS[1], torch.bfloat16)
    t, h, dv = q.shape[0], q.shape[1], v.shape[2]
    rows, cols = nvfp4.scale_shape(t, h * dv)
    bufs = dict(output=torch.empty(t, h * dv // 2, dtype=torch.uint8, device=DEVICE),
                output_scale=torch.ones(1, device=DEVICE),
                output_block_scale=torch.empty(rows, cols // 4, dtype=torch.int32, device=DEVICE))

    def call():
        launchers.flash_attention_nvfp4_varlen(
            q, k, v, cu_seqlens=cu, max_seqlen=max(case.query_lens), softmax_scale=0.1, causal=True,
            cu_seqlens_k=cu_k, max_seqlen_k=max(case.key_lens), **bufs,
        )

    context_cases.call_without_host_sync(call)  # the first call compiles


# ---------------------------------------------------------------------------
# validate_values: the default reads no value back (no synchronization on CUDA)
# ---------------------------------------------------------------------------

_HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


class HostRead(AssertionError):
    pass


def _no_host_reads(monkeypatch) -> list[str]:
    """Make every Python-level read of a tensor's values on the host raise :class:`HostRead` (a synchronization on
    CUDA); returns the list the reads would have been recorded in, and counts the device assertions instead."""
    for name in _HOST_READS:
        def refuse(self, *args, _name=name, **kwargs):
            raise HostRead(f"Tensor.{_name} called on {self.dtype} {list(self.shape)}")
        monkeypatch.setattr(torch.Tensor, name, refuse)
    asserted: list[str] = []
    real = torch._assert_async

    def counted(ok, *message):
        asserted.append(message[0] if message else "")
        return real(ok, *message)

    monkeypatch.setattr(torch, "_assert_async", counted)
    return asserted


def _stub_kernels(monkeypatch) -> list[str]:
    """Replace the entry points' kernels (which may read values for their own work: the reference slices
    sequences by ``cu_seqlens``) by stand-ins that record the call and write nothing."""
    from fusion_pass.kernels import api

    ran: list[str] = []

    def stub(name, result=None):
        def run(*args, **kwargs):
            ran.append(name)
            return result(*args, **kwargs) if result else None
        return run

    monkeypatch.setattr(api.reference, "varlen_attention",
                        stub("varlen_attention", lambda q, k, v, *a: (q.new_zeros(q.shape[0], q.shape[1], v.shape[2],
                                                                                   dtype=torch.float32),
                                                                       q.new_zeros(q.shape[:2], dtype=torch.float32))))
    monkeypatch.setattr(api.launchers, "attention_with_lse_varlen",
                        stub("attention_with_lse_varlen", lambda q, k, v, **kw: (q, q)))
    monkeypatch.setattr(api.nvfp4, "quantize", stub("quantize", lambda x, gs, swizzled=True: (x, gs)))
    monkeypatch.setattr(api.launchers, "quantize_rows", stub("quantize_rows"))
    monkeypatch.setattr(api.reference, "merge_nvfp4", stub("merge_nvfp4"))
    monkeypatch.setattr(api.launchers, "merge_nvfp4_rows", stub("merge_nvfp4_rows"))
    return ran


def _entry_calls(gen, seed, backend="reference"):
    """Every validated entry point with valid random arguments on this device (``backend``'s kernels):
    ``{name: call(validate_values)}``, each checking at least one device tensor's values."""
    rnd = random.Random(seed)
    lens = [rnd.randint(1, 9) for _ in range(rnd.randint(1, 4))]
    ctx = [rnd.randint(0, 7) for _ in lens]
    t, tk = sum(lens), sum(lens) + sum(ctx)
    hkv = rnd.choice([1, 2])
    h, d, dv = hkv * rnd.choice([1, 2]), 32, 16
    q = randn(gen, t, h, d, dtype=torch.bfloat16)
    k, v = randn(gen, tk, hkv, d, dtype=torch.bfloat16), randn(gen, tk, hkv, dv, dtype=torch.bfloat16)
    cu = cumulative(lens)
    cu_k = cumulative([a + b for a, b in zip(lens, ctx)])
    gs = torch.tensor([rnd.uniform(1.0, 500.0)], device=DEVICE)
    rows, cols = nvfp4.scale_shape(t, h * dv)
    packed = torch.zeros(t, h * dv // 2, dtype=torch.uint8, device=DEVICE)
    scales = torch.zeros(rows, cols, dtype=torch.uint8, device=DEVICE)
    x = randn(gen, t, h * dv)
    out = randn(gen, t, h, dv)
    lse = randn(gen, t, h)
    ref = dict(backend=backend)
    return {
        "attention": lambda m: kernels.attention(q, k[:t], v[:t], cu, max(lens), validate_values=m, **ref),
        "attention+cu_seqlens_k": lambda m: kernels.attention(q, k, v, cu, max(lens), cu_seqlens_k=cu_k,
                                                              max_seqlen_k=max(lens) + max(ctx), validate_values=m,
                                                              **ref),
        "attention_with_lse": lambda m: kernels.attention_with_lse(q, k, v, cu, max(lens), cu_seqlens_k=cu_k,
                                                                   causal=rnd.choice([True, False]),
                                                                   validate_values=m, **ref),
        "attention_nvfp4": lambda m: kernels.attention_nvfp4(q, k, v, cu, max(lens), gs, cu_seqlens_k=cu_k,
                                                             validate_values=m, **ref),
        "quantize": lambda m: kernels.quantize(x, gs, validate_values=m, **ref),
        "quantize_rows_into": lambda m: kernels.quantize_rows_into(x, gs, packed, scales, 0, validate_values=m,
                                                                   **ref),
        "merge_attention_nvfp4": lambda m: kernels.merge_attention_nvfp4(out, lse, out, lse, gs, packed, scales, 0,
                                                                         validate_values=m, **ref),
    }


ENTRY_NAMES = ["attention", "attention+cu_seqlens_k", "attention_with_lse", "attention_nvfp4", "quantize",
               "quantize_rows_into", "merge_attention_nvfp4"]


@pytest.mark.parametrize("entry", ENTRY_NAMES)
def test_default_validation_reads_no_value_back(entry, monkeypatch):
    """By default (``validate_values="device"``) no entry point reads a tensor's values on the host: every
    ``Tensor.tolist`` / ``item`` / ``bool`` / ... raises here, and the values are asserted on the device instead
    (``torch._assert_async``, counted); ``validate_values=False`` asserts nothing; ``True`` reads them back (the
    detector catches it: it can fail). Random shapes and lengths per run."""
    gen, seed = fresh_generator()
    calls = _entry_calls(gen, seed)
    ran = _stub_kernels(monkeypatch)
    asserted = _no_host_reads(monkeypatch)
    calls[entry]("device")
    assert ran, f"{entry}: the kernel did not run (seed {seed})"
    assert asserted, f"{entry}: no value was checked on the device (seed {seed})"
    ran.clear(), asserted.clear()
    calls[entry](False)
    assert ran and not asserted, f"{entry}: validate_values=False checked values (seed {seed})"
    with pytest.raises(HostRead):
        calls[entry](True)


@pytest.mark.parametrize("entry", ENTRY_NAMES)
def test_validate_values_must_be_a_mode(entry):
    gen, seed = fresh_generator()
    for bad in ("host", 1, None):
        with pytest.raises(ValueError, match=r"validate_values must be True, \"device\" or False, got"):
            _entry_calls(gen, seed)[entry](bad)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device: device synchronizations are detected on CUDA only")
@pytest.mark.parametrize("entry", ENTRY_NAMES)
def test_default_validation_does_not_synchronize(entry):
    """The default path on CUDA with the CUDA kernels (``auto``): ``torch.cuda.set_sync_debug_mode("error")``
    sees no synchronization, and valid values pass the device assertion."""
    gen, seed = fresh_generator()
    call = _entry_calls(gen, seed, backend="auto")[entry]
    context_cases.call_without_host_sync(lambda: call("device"))  # the first call compiles
    torch.cuda.synchronize()


def test_device_value_checks_agree_with_the_host_checks():
    """Generated ``cu_seqlens`` / ``cu_seqlens_k`` / ``max_seqlen(_k)`` / global scales, valid and broken (a
    shifted start or end, a decreasing step, a sequence longer than its bound, fewer keys than queries): the
    check on the device (``"device"``, at once on the CPU) refuses exactly what the read-back check refuses."""
    if CUDA:
        pytest.skip("a device-side assertion is fatal to the CUDA context; the device check runs on the CPU")
    rnd = random.Random(random.SystemRandom().randrange(2**31))
    seed = rnd.random()
    refused = {True: 0, "device": 0}
    for case in range(300):
        b = rnd.randint(1, 5)
        lens = [rnd.randint(0, 6) for _ in range(b)]
        keys = [n + rnd.randint(-2, 4) if rnd.random() < 0.1 else n + rnd.randint(0, 4) for n in lens]
        keys = [max(0, n) for n in keys]
        t, tk = sum(lens), sum(keys)
        starts = [0, *itertools.accumulate(lens)]
        starts_k = [0, *itertools.accumulate(keys)]
        for offsets in (starts, starts_k):
            kind = rnd.randrange(12)
            i = rnd.randrange(len(offsets))
            if kind == 1:
                offsets[i] += rnd.choice([-2, -1, 1, 2])
            elif kind == 2 and len(offsets) > 2:
                offsets[1], offsets[2] = offsets[2], offsets[1]
        max_q = max(lens) + rnd.choice([0, 0, 0, 1, 1, -1])
        max_k = rnd.choice([None, None, max(keys), max(keys), max(keys) - 1])
        causal = rnd.random() < 0.7
        gs = rnd.choice([0.0, -1.0, math.inf, math.nan, 1e36]) if rnd.random() < 0.1 else \
            rnd.choice([1.0, 300.0, nvfp4.GLOBAL_SCALE_MAX, 2.0**-140])
        q = torch.zeros(t, 2, 32, dtype=torch.bfloat16)
        k, v = torch.zeros(tk, 1, 32, dtype=torch.bfloat16), torch.zeros(tk, 1, 16, dtype=torch.bfloat16)
        outcome = {}
        for mode in (True, "device"):
            try:
                check_attention(
                    "attention_nvfp4", q, k, v, torch.tensor(starts, dtype=torch.int32), max(max_q, 0), causal, None,
                    "reference", torch.tensor(starts_k, dtype=torch.int32), max_k,
                    global_scale=torch.tensor([gs]), validate_values=mode)
                outcome[mode] = None
            except ValueError as exc:
                outcome[mode] = str(exc)
                refused[mode] += 1
        where = f"case {case} (seed {seed}): starts {starts}, keys {starts_k}, max {max_q}/{max_k}, gs {gs}"
        assert (outcome[True] is None) == (outcome["device"] is None), f"{where}: {outcome}"
    assert 30 < refused[True] < 270, f"the generator should give valid and invalid cases, got {refused}"
