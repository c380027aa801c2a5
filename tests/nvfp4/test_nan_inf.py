"""NaN and infinity in NVFP4 quantization (docs/nvfp4.md, "NaN and infinity").

The contract, restated here and computed independently of the library:

* a 16-element block holding a NaN: scale byte ``0x7F``, 16 codes 0 (packed bytes 0);
* otherwise, a block holding ``±Inf``: scale byte ``0x7E`` (448), ``±Inf`` -> code
  ``0x7`` / ``0xF``, finite elements -> e2m1 code of ``x * (gs / 448)`` in float32;
* every other block is quantized as if the special blocks were not there.

Checked for the reference (against this restatement), the Triton quantizer
(bytes equal to the reference's), the Triton attention kernel's NVFP4 epilogue
(bytes equal to the quantization of the same kernel's float32 output) and the
attention op's fallback path. Without CUDA the Triton kernels run in Triton's
interpreter (conftest.py), on tiny shapes; with CUDA the same tests run on the
device. Every run draws fresh random cases; the seed is in each failure message.
"""

from __future__ import annotations

import random

import pytest
import torch

from fusion_pass.kernels.fa4 import sm90 as fa4_sm90
from fusion_pass import kernels, nvfp4

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
FP8 = torch.float8_e4m3fn
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
TRITON = CUDA or kernels.interpreter_enabled()
needs_triton = pytest.mark.skipif(
    not TRITON, reason="no CUDA device and TRITON_INTERPRET is not set (conftest.py sets it on CPU-only machines)"
)

# NaN * 0 and Inf * 0 inside NaN blocks, and NaN -> int casts, warn in Triton's interpreter (numpy).
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

NAN_BYTE, SAT_BYTE = 0x7F, 0x7E  # float8_e4m3fn NaN, 448
MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


# ---------------------------------------------------------------------------
# the contract, computed independently of fusion_pass.nvfp4's quantizer
# ---------------------------------------------------------------------------


def e2m1(q: torch.Tensor) -> torch.Tensor:
    """float32 values -> codes: nearest magnitude, ties to the even index, saturating at 6 (NaN-free)."""
    a = q.abs().double().clamp(max=6.0)
    dist = (a[..., None] - MAGNITUDES).abs()
    nearest = dist == dist.min(dim=-1, keepdim=True).values
    even = nearest & (torch.arange(8) % 2 == 0)
    index = torch.where(even.any(-1), even.int().argmax(-1), nearest.int().argmax(-1))
    return index.to(torch.uint8) | (torch.signbit(q).to(torch.uint8) << 3)


def special_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(nan_block, inf_block)`` bool ``[M, K/16]``; ``inf_block`` excludes NaN blocks."""
    blocks = x.float().cpu().reshape(x.shape[0], -1, 16)
    nan_block = blocks.isnan().any(-1)
    return nan_block, blocks.isinf().any(-1) & ~nan_block


def contract_bytes(x: torch.Tensor, gs: float):
    """The contract's bytes of the NaN / Inf blocks of ``x [M, K]``.

    Returns ``(nan_block, inf_block, scale [M, K/16] uint8, codes [M, K/16, 16] uint8)``;
    ``scale`` / ``codes`` are defined on the special blocks only (0 elsewhere).
    """
    blocks = x.float().cpu().reshape(x.shape[0], -1, 16)
    nan_block, inf_block = special_blocks(x)
    inv = torch.tensor(gs, dtype=torch.float32) / torch.tensor(448.0, dtype=torch.float32)
    codes = e2m1(torch.where(inf_block[..., None], blocks, 0.0) * inv)
    codes[~inf_block] = 0
    scale = torch.zeros(nan_block.shape, dtype=torch.uint8)
    scale[nan_block] = NAN_BYTE
    scale[inf_block] = SAT_BYTE
    return nan_block, inf_block, scale, codes


def linear_scale_bytes(scales: torch.Tensor, m: int, n_blocks: int, swizzled: bool) -> torch.Tensor:
    """uint8 ``[m, n_blocks]`` read at the offsets of NVFP4.md (own formula)."""
    flat = scales.view(torch.uint8).cpu().flatten()
    rows = torch.arange(m)[:, None]
    cols = torch.arange(n_blocks)[None, :]
    if not swizzled:
        return flat[rows * n_blocks + cols]
    kt = (n_blocks + 3) // 4
    offsets = ((rows // 128) * kt + cols // 4) * 512 + (rows % 32) * 16 + ((rows % 128) // 32) * 4 + cols % 4
    return flat[offsets]


def codes_of(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[M, K/2]`` -> codes ``[M, K/16, 16]`` (low nibble is the even element; own unpacking)."""
    p = packed.cpu()
    codes = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(p.shape[0], -1)
    return codes.reshape(p.shape[0], -1, 16)


def assert_contract(x, gs: float, packed, scales, swizzled: bool, what: str, only=None) -> None:
    """The special blocks of ``x`` (restricted to ``only`` when given) hold the contract's bytes."""
    m, k = x.shape
    nan_block, inf_block, want_scale, want_codes = contract_bytes(x, gs)
    check = nan_block | inf_block
    if only is not None:
        check &= only
    got_scale = linear_scale_bytes(scales, m, k // 16, swizzled)
    got_codes = codes_of(packed)
    bad = check & ((got_scale != want_scale) | (got_codes != want_codes).any(-1))
    if bad.any():
        r, c = bad.nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: block (row {r}, column {c}) {'NaN' if nan_block[r, c] else 'Inf'}: scale "
            f"0x{int(got_scale[r, c]):02x} codes {got_codes[r, c].tolist()}, contract 0x{int(want_scale[r, c]):02x} "
            f"{want_codes[r, c].tolist()}; block {x[r, 16 * c:16 * c + 16].float().tolist()}, gs {gs}"
        )


# ---------------------------------------------------------------------------
# generated inputs
# ---------------------------------------------------------------------------

_NAN_BITS = {  # (exponent-all-ones pattern, mantissa bits, sign bit, int view dtype)
    torch.float32: (0x7F800000, 23, 1 << 31, torch.int32),
    torch.float16: (0x7C00, 10, 1 << 15, torch.int16),
    torch.bfloat16: (0x7F80, 7, 1 << 15, torch.int16),
}
KINDS = ("nan", "+inf", "-inf", "both_inf", "nan_inf", "all_nan", "all_inf")


def _nan_pattern(rng: random.Random, dtype) -> int:
    """A NaN's bit pattern of ``dtype``, random sign and payload, as a signed int of the view dtype."""
    exp_bits, mant, sign, view = _NAN_BITS[dtype]
    bits = exp_bits | rng.randrange(1, 1 << mant) | (sign if rng.random() < 0.5 else 0)
    width = 32 if view == torch.int32 else 16
    return bits - (1 << width) if bits >= 1 << (width - 1) else bits


def make_case(seed: int, dtype, m: int, k: int):
    """``x [m, k]`` of ``dtype`` with random NaN / ±Inf blocks, and a global scale."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.exp(1.5 * torch.randn(m, 1, generator=gen)).clamp(max=100)
    if rng.random() < 0.3:
        x[rng.randrange(m), rng.randrange(k)] = -0.0
    finite_amax = float(x.abs().max()) or 1.0
    gs = rng.choice([448 * 6 / finite_amax * 2.0 ** rng.uniform(-4, 4), 1e30, 1e-30, 1.0])
    x = x.to(dtype)
    n_blocks = m * k // 16
    chosen = rng.sample(range(n_blocks), rng.randint(1, max(1, n_blocks // 2)))
    nan_at = []
    flat = x.view(-1)
    for b in chosen:
        kind = rng.choice(KINDS)
        n = 16 if kind.startswith("all") else rng.randint(1, 15)
        pos = [16 * b + i for i in rng.sample(range(16), n)]
        if kind in ("nan", "all_nan"):
            nan_at += pos
        elif kind == "nan_inf" and n >= 2:
            nan_at += pos[: n // 2]
            for p in pos[n // 2 :]:
                flat[p] = rng.choice((1, -1)) * float("inf")
        else:
            for p in pos:
                sign = {"+inf": 1, "-inf": -1}.get(kind, rng.choice((1, -1)))
                flat[p] = sign * float("inf")
    if nan_at:
        view = x.view(_NAN_BITS[dtype][3]).view(-1)
        view[torch.tensor(nan_at)] = torch.tensor([_nan_pattern(rng, dtype) for _ in nan_at], dtype=view.dtype)
    assert x.isnan().sum() == len(set(nan_at))
    return x.to(DEVICE), torch.tensor([gs], dtype=torch.float32, device=DEVICE)


SHAPES = [(1, 16), (5, 48), (33, 64), (130, 32)]
CASES = [(i, dtype, m, k, swizzled) for i, (dtype, (m, k), swizzled) in enumerate(
    (d, s, sw) for d in DTYPES for s in SHAPES for sw in (True, False)
)]


def case_id(c):
    return f"{str(c[1]).split('.')[-1]}-{c[2]}x{c[3]}-{'swz' if c[4] else 'lin'}"


# ---------------------------------------------------------------------------
# reference and Triton quantizer
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_reference_writes_the_contract_bytes(case):
    _, dtype, m, k, swizzled = case
    seed = fresh_seed()
    x, gs = make_case(seed, dtype, m, k)
    packed, scales = nvfp4.quantize(x, gs, swizzled=swizzled)
    assert_contract(x, gs.item(), packed, scales, swizzled, f"reference (seed {seed})")

    # the other blocks: as if the special ones were zero
    nan_block, inf_block = special_blocks(x)
    special = nan_block | inf_block
    clean = x.clone().reshape(m, -1, 16)
    clean[special.to(x.device)] = 0
    clean_packed, clean_scales = nvfp4.quantize(clean.reshape(m, k), gs, swizzled=swizzled)
    same_scale = linear_scale_bytes(scales, m, k // 16, swizzled) == linear_scale_bytes(clean_scales, m, k // 16, swizzled)
    same_codes = (codes_of(packed) == codes_of(clean_packed)).all(-1)
    assert (same_scale & same_codes)[~special].all(), f"special blocks changed other blocks (seed {seed})"

    # dequantized: NaN blocks are all NaN, infinities become ±6 * 448 / gs
    x_hat = nvfp4.dequantize(packed, scales, gs, swizzled=swizzled).cpu().reshape(m, -1, 16)
    assert x_hat[nan_block].isnan().all(), f"a NaN block dequantizes to numbers (seed {seed})"
    assert not x_hat[~nan_block].isnan().any(), f"NaN outside NaN blocks (seed {seed})"
    xf = x.float().cpu().reshape(m, -1, 16)
    inf_el = inf_block[..., None] & xf.isinf()
    want = torch.sign(xf[inf_el]) * (torch.tensor(6.0 * 448.0) / gs.cpu())  # x / tensor: IEEE division
    assert torch.equal(x_hat[inf_el], want.float()), f"an infinity does not dequantize to ±6*448/gs (seed {seed})"


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_triton_quantizer_matches_reference_bytes(case):
    from fusion_pass.kernels.triton import quantize as nvfp4_quant

    _, dtype, m, k, swizzled = case
    seed = fresh_seed()
    x, gs = make_case(seed, dtype, m, k)
    want_packed, want_scales = nvfp4.quantize(x, gs, swizzled=swizzled)
    rows, cols = nvfp4.scale_shape(m, k, swizzled=swizzled)
    packed = torch.full((m, k // 2), 0xAB, dtype=torch.uint8, device=DEVICE)
    scales = torch.full((rows, cols), 0xAB, dtype=torch.uint8, device=DEVICE)
    got_packed, got_scales = nvfp4_quant.quantize_launch(x, gs, swizzled=swizzled, packed=packed, scales=scales)
    assert torch.equal(got_scales.view(torch.uint8), want_scales.view(torch.uint8)), f"scales differ (seed {seed})"
    assert torch.equal(got_packed, want_packed), f"packed codes differ (seed {seed})"
    assert_contract(x, gs.item(), got_packed, got_scales, swizzled, f"triton quantizer (seed {seed})")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fixed_blocks(dtype):
    """The contract's examples, spelled out as bytes."""
    nan, inf = float("nan"), float("inf")
    x = torch.zeros(6, 16)
    x[:] = torch.linspace(-1, 1, 16)
    x[0, 3] = nan  # one NaN
    x[1, 3] = inf  # +Inf
    x[2, 3] = -inf  # -Inf
    x[3, 3], x[3, 5] = nan, inf  # both
    x[4] = nan  # all NaN
    x[5, 3] = inf  # + a large global scale below
    x = x.to(dtype).to(DEVICE)
    for gs_value in (1.0, 1e30):
        gs = torch.tensor([gs_value], device=DEVICE)
        results = [nvfp4.quantize(x, gs, swizzled=False)]
        if TRITON:
            from fusion_pass.kernels.triton import quantize as nvfp4_quant

            results.append(nvfp4_quant.quantize_launch(x, gs, swizzled=False))
        for packed, scales in results:
            sf = scales.view(torch.uint8).cpu().flatten().tolist()
            codes = codes_of(packed).reshape(6, 16)
            assert sf[0] == sf[3] == sf[4] == NAN_BYTE and sf[1] == sf[2] == sf[5] == SAT_BYTE
            assert not packed.cpu()[[0, 3, 4]].any()
            assert codes[1, 3] == codes[5, 3] == 0x7 and codes[2, 3] == 0xF
            if gs_value == 1.0:  # finite elements of magnitude <= 1 against 448: |q| <= 1/448 -> ±0
                assert codes[1].tolist() == [8] * 3 + [7] + [8] * 4 + [0] * 8
            else:  # gs / 448 ~ 2e27: every non-zero finite element saturates
                assert codes[5].tolist() == [0xF] * 3 + [0x7] + [0xF] * 4 + [0x7] * 8


# ---------------------------------------------------------------------------
# the Triton attention kernel's NVFP4 epilogue
# ---------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_nvfp4_epilogue_follows_the_contract(dtype, causal):
    """NaN / ±Inf in ``v`` reach the attention output. The NVFP4 epilogue's bytes equal
    the reference quantization of the same kernel's float32 output (the half epilogue
    writing float32): on every block in the interpreter, on the NaN / Inf blocks on CUDA."""
    from fusion_pass.kernels.triton import flash_attention as fa

    seed = fresh_seed()
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 2, 1, 32
    lengths = [13, 9] if not CUDA else [300, 77]
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    # sequence 0: a NaN in value dims 0-15; sequence 1: +Inf and -Inf in dims 16-31 (distinct dims)
    v[rng.randrange(lengths[0]), 0, rng.randrange(16)] = float("nan")
    d_pos, d_neg = rng.sample(range(16, 32), 2)
    v[lengths[0] + rng.randrange(lengths[1]), 0, d_pos] = float("inf")
    v[lengths[0] + rng.randrange(lengths[1]), 0, d_neg] = float("-inf")
    q, k, v = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    cu = torch.tensor([0, lengths[0], t], dtype=torch.int32, device=DEVICE)
    gs = torch.tensor([448 * 6 / 4.0 * 2.0 ** rng.uniform(-2, 2)], device=DEVICE)

    out32 = torch.empty(t, heads, dim, dtype=torch.float32, device=DEVICE)
    fa.flash_attention(q, k, v, cu, max(lengths), causal=causal, out=out32)
    out32 = out32.reshape(t, -1)
    nan_block, inf_block = special_blocks(out32)
    assert nan_block.any() and inf_block.any(), f"the case should produce NaN and Inf blocks (seed {seed})"

    packed, scales = fa.flash_attention_nvfp4(q, k, v, cu, max(lengths), gs, causal=causal)
    assert_contract(out32, gs.item(), packed, scales, True, f"NVFP4 epilogue (seed {seed})")
    want_packed, want_scales = nvfp4.quantize(out32, gs)
    n_blocks = heads * dim // 16
    same = (linear_scale_bytes(scales, t, n_blocks, True) == linear_scale_bytes(want_scales, t, n_blocks, True)) & (
        codes_of(packed) == codes_of(want_packed)
    ).all(-1)
    check = torch.ones_like(same) if not CUDA else nan_block | inf_block
    assert same[check].all(), f"epilogue bytes differ from quantize(own float32 output) (seed {seed})"


# ---------------------------------------------------------------------------
# the attention op: fused (prefill) and fallback (decode) paths
# ---------------------------------------------------------------------------


def test_attention_op_paths_follow_the_contract(monkeypatch):
    """Through ``torch.ops.fusion_pass.attention_with_output``, with a NaN and infinities in
    the values: the fallback (decode) bytes equal ``scaled_fp4_quant`` of the op's own
    half-precision output, and on both paths the NaN / Inf blocks hold the contract's
    scale byte, the NaN blocks zero codes and the infinite elements codes 0x7 / 0xF."""
    from fusion_pass import ops, runtime
    from fusion_pass.runtime import counters
    from fusion_pass.runtime import BatchSpec, RequestSpec

    heads, kv_heads, dim = (8, 2, 128) if CUDA else (2, 1, 32)
    lengths = (300, 77) if CUDA else (12, 7)
    if CUDA and not fa4_sm90.fa4_sm90_usable("cuda", torch.bfloat16, heads, dim, dim)[0]:
        monkeypatch.setenv("FUSION_PASS_BACKEND", "triton")  # auto takes only a backend measured fast here
    impl = runtime.AttentionImpl(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, softmax_scale=dim**-0.5)
    runtime.register_layer("test_nan_inf.attn", impl)
    seed = fresh_seed()
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    try:
        runtime.clear_kv_caches()
        steps = [
            BatchSpec((RequestSpec("a", lengths[0]), RequestSpec("b", lengths[1]))),
            BatchSpec((RequestSpec("a", 1, lengths[0]), RequestSpec("b", 1, lengths[1]))),
        ]
        for spec, want_path in zip(steps, ("fused", "fallback")):
            t = spec.num_tokens
            q, k, v = (torch.randn(t, h, dim, generator=gen).to(torch.bfloat16) for h in (heads, kv_heads, kv_heads))
            if want_path == "fused":  # request a: a NaN (dims 0-15); request b: ±Inf (dims 16-31)
                v[rng.randrange(lengths[0]), 0, rng.randrange(16)] = float("nan")
                d_pos, d_neg = rng.sample(range(16, 32), 2)
                v[lengths[0] + rng.randrange(lengths[1]), 0, d_pos] = float("inf")
                v[lengths[0] + rng.randrange(lengths[1]), 0, d_neg] = float("-inf")
            q, k, v = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
            start = runtime.snapshot_kv_caches()
            with runtime.batch(spec):
                half = torch.empty(t, heads * dim, dtype=torch.bfloat16, device=DEVICE)
                torch.ops.fusion_pass.attention_with_output(q, k, v, half, "test_nan_inf.attn")
                gs = torch.tensor([448 * 6 / 4.0], device=DEVICE)
                unfused = ops.scaled_fp4_quant(half, gs)
                runtime.restore_kv_caches(start)
                rows, cols = nvfp4.scale_shape(t, heads * dim)
                packed = torch.full((t, heads * dim // 2), 0xAB, dtype=torch.uint8, device=DEVICE)
                scales = torch.full((rows, cols // 4), -1, dtype=torch.int32, device=DEVICE)
                before = counters.counters()
                torch.ops.fusion_pass.attention_with_output(q, k, v, packed, "test_nan_inf.attn", gs, scales)
                after = counters.counters()
            assert (after["fused"] - before["fused"] == 1) == (want_path == "fused"), f"{spec.kind}: wrong path"
            nan_block, inf_block = special_blocks(half)
            assert nan_block.any() and inf_block.any(), f"{want_path}: no NaN / Inf blocks (seed {seed})"
            where = f"{want_path} path (seed {seed})"
            if want_path == "fallback":
                assert torch.equal(packed, unfused[0]), where
                assert torch.equal(scales.view(torch.uint8), unfused[1].view(torch.uint8)), where
                assert_contract(half, gs.item(), packed, scales.view(FP8), True, where)
            # fused: quantized from float32, so finite elements of Inf blocks may differ from the
            # half output's; the scale bytes, NaN blocks and infinite elements may not
            n_blocks = heads * dim // 16
            got_scale = linear_scale_bytes(scales, t, n_blocks, True)
            assert (got_scale[nan_block] == NAN_BYTE).all() and (got_scale[inf_block] == SAT_BYTE).all(), where
            codes = codes_of(packed)
            assert not codes[nan_block].any(), where
            hf = half.float().cpu().reshape(t, -1, 16)
            inf_el = inf_block[..., None] & hf.isinf()
            want = torch.where(hf[inf_el] > 0, 0x7, 0xF).to(torch.uint8)
            assert torch.equal(codes[inf_el], want), where
    finally:
        runtime.unregister_layer("test_nan_inf.attn")
        runtime.clear_kv_caches()
