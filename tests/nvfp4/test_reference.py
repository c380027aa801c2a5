"""Tests of the reference NVFP4 format (fusion_pass.nvfp4) against NVFP4.md."""

from __future__ import annotations

import math
import random

import pytest
import torch

from fusion_pass import nvfp4
from fusion_pass.nvfp4 import (
    dequantize,
    error_bound,
    half_step,
    quantize,
    scale_shape,
    swizzle_scales,
    swizzled_offset,
    unpack_codes,
    unswizzle_scales,
)

FP8 = torch.float8_e4m3fn
ONE = torch.tensor([1.0])
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# Midpoints between neighbouring e2m1 magnitudes: (tie, index below, index above,
# index the tie itself goes to under round-to-nearest-even on the code index).
TIES = [
    (0.25, 0, 1, 0),
    (0.75, 1, 2, 2),
    (1.25, 2, 3, 2),
    (1.75, 3, 4, 4),
    (2.5, 4, 5, 4),
    (3.5, 5, 6, 6),
    (5.0, 6, 7, 6),
]


def f32(v: float) -> float:
    """Round a python float to float32."""
    return torch.tensor(v, dtype=torch.float32).item()


def next_f32(v: float, direction: float) -> float:
    return torch.nextafter(torch.tensor(v), torch.tensor(direction)).item()


def codes_with_unit_scale(values) -> list[int]:
    """e2m1 codes of ``values`` quantized with sf == 1 exactly (so q == x).

    Each value gets its own 16-element block ``[6, value, 0, ...]`` and gs = 1,
    so amax = 6 and sf = e4m3(1 * 6 / 6) = 1.0 (checked).
    """
    x = torch.zeros(len(values), 16)
    x[:, 0] = 6.0
    x[:, 1] = torch.tensor(values, dtype=torch.float32)
    packed, scales = quantize(x, ONE, swizzled=False)
    assert torch.all(scales.float() == 1.0)
    return unpack_codes(packed)[:, 1].tolist()


def scale_of_block(amax: float, gs: float, device: str = "cpu") -> float:
    """The fp8 scale chosen for one block whose max magnitude is ``amax``."""
    x = torch.zeros(1, 16, device=device)
    x[0, 3] = amax
    _, scales = quantize(x, torch.tensor([gs], device=device), swizzled=False)
    return scales.float().item()


# --------------------------------------------------------------------------
# Element codes
# --------------------------------------------------------------------------


def test_constants():
    assert nvfp4.BLOCK_SIZE == 16
    assert nvfp4.E2M1_MAX == 6.0
    assert nvfp4.E4M3_MAX == 448.0
    assert nvfp4.E2M1_VALUES == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert torch.tensor(nvfp4.E4M3_MAX).to(FP8).float().item() == 448.0


def test_every_code_for_exact_values():
    values = list(nvfp4.E2M1_VALUES) + [-v for v in nvfp4.E2M1_VALUES]
    assert codes_with_unit_scale(values) == list(range(16))


def test_codes_to_values_table():
    values = nvfp4.codes_to_values(torch.arange(16, dtype=torch.uint8))
    expected = list(nvfp4.E2M1_VALUES) + [-v for v in nvfp4.E2M1_VALUES]
    assert values.dtype == torch.float32
    assert values.tolist() == expected
    assert math.copysign(1.0, values[8].item()) == -1.0  # code 8 is -0.0


@pytest.mark.parametrize("tie, below, above, at", TIES)
def test_ties_round_to_even_code(tie, below, above, at):
    assert at % 2 == 0
    assert codes_with_unit_scale([tie, -tie]) == [at, at | 0x8]


@pytest.mark.parametrize("tie, below, above, at", TIES)
def test_values_next_to_ties(tie, below, above, at):
    lo, hi = next_f32(tie, 0.0), next_f32(tie, 10.0)
    assert lo < tie < hi
    assert codes_with_unit_scale([lo, hi, -lo, -hi]) == [below, above, below | 8, above | 8]


def test_sign_of_zero():
    tiny = torch.finfo(torch.float32).tiny
    codes = codes_with_unit_scale([0.0, -0.0, -0.1, 0.1, -tiny, 0.25, -0.25])
    assert codes == [0x0, 0x8, 0x8, 0x0, 0x8, 0x0, 0x8]


def test_packing_nibble_order():
    # element 2j -> low nibble of byte j, element 2j+1 -> high nibble
    row = [1.0, 6.0, -0.5, 3.0, -6.0, 0.0, 1.5, -4.0] + [0.0] * 8
    packed, _ = quantize(torch.tensor([row]), ONE)
    assert packed.dtype == torch.uint8
    assert packed.shape == (1, 8)
    assert packed[0, :4].tolist() == [0x72, 0x59, 0x0F, 0xE3]
    assert packed[0, 4:].tolist() == [0, 0, 0, 0]
    assert unpack_codes(packed)[0, :8].tolist() == [2, 7, 9, 5, 15, 0, 3, 14]


def test_elements_saturate_when_scale_rounds_down():
    # amax = 6.3 -> gs*amax/6 = 1.05 -> sf = 1.0, so q = x and 6.3 exceeds 6
    x = torch.tensor([[6.3, -6.3, 5.5, -5.01, 5.0, 1.0] + [0.0] * 10])
    packed, scales = quantize(x, ONE, swizzled=False)
    assert scales.float().item() == 1.0
    assert unpack_codes(packed)[0, :6].tolist() == [7, 15, 7, 15, 6, 2]
    x_hat = dequantize(packed, scales, ONE, swizzled=False)
    assert x_hat[0, :6].tolist() == [6.0, -6.0, 6.0, -6.0, 4.0, 1.0]


# --------------------------------------------------------------------------
# Block scales
# --------------------------------------------------------------------------


# (gs * amax / 6, expected e4m3 value): exact midpoints between two e4m3 values
SCALE_TIES = [
    (1.0625, 1.0),  # between 1.0 (mantissa 000) and 1.125 (001)
    (1.1875, 1.25),  # between 1.125 (001) and 1.25 (010)
    (432.0, 448.0),  # between 416 (101) and 448 (110)
    (3 * 2**-10, 2**-8),  # subnormals 1*2^-9 and 2*2^-9
    (5 * 2**-10, 2**-8),  # subnormals 2*2^-9 and 3*2^-9
    (2**-10, 0.0),  # between 0 and the smallest subnormal
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t, expected", SCALE_TIES)
def test_scale_rounds_ties_to_even(t, expected, device):
    # gs = t and amax = 6: gs * amax / 6 == t exactly in float32
    assert f32(f32(t * 6.0) / 6.0) == t
    assert scale_of_block(6.0, t, device) == expected


@pytest.mark.parametrize("t, expected", SCALE_TIES)
def test_scale_next_to_ties(t, expected):
    grid = [torch.tensor(b, dtype=torch.uint8).view(FP8).float().item() for b in range(0x7F)]
    lower = max(v for v in grid if v < t)
    upper = min(v for v in grid if v > t)
    for gs, want in ((next_f32(t, 0.0), lower), (next_f32(t, 1e9), upper)):
        computed_t = f32(f32(gs * 6.0) / 6.0)
        assert computed_t != t and (computed_t < t) == (want == lower)
        assert scale_of_block(6.0, gs) == want


@pytest.mark.parametrize("device", DEVICES)
def test_float32_evaluation_order(device):
    # Cases found by search where the formulas of NVFP4.md, evaluated in float32
    # in the order written, land exactly on a tie while a reordered evaluation
    # (gs * (amax / 6), or 1 / (sf / gs)) does not.
    t32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    # scale: (gs * amax) / 6 == 5.75, midway between e4m3 5.5 and 6.0 -> 6.0
    amax, gs = 4.875365257263184, 7.076392650604248
    assert (t32(gs) * t32(amax) / 6).item() == 5.75
    assert (t32(gs) * (t32(amax) / 6)).item() != 5.75
    assert scale_of_block(amax, gs, device) == 6.0
    # scale: (gs * amax) / 6 lies one ulp below the e4m3 tie 0.0185546875 -> 0.017578125,
    # while (gs * amax) * float32(1/6) (what eager CUDA does for `tensor / 6.0`)
    # hits the tie exactly and rounds to even, 0.01953125
    amax = 0.1113281175494194
    assert (t32(amax) / t32(6.0)).item() < 0.0185546875
    assert (t32(amax) * t32(1 / 6)).item() == 0.0185546875
    assert scale_of_block(amax, 1.0, device) == 0.017578125
    # element: x * (gs / sf) == 0.75, midway between 0.5 and 1.0 -> 1.0 (code 2)
    amax, x_value, gs = 53.19443130493164, 6.649303436279297, 8.121150970458984
    assert (t32(x_value) * (t32(gs) / 72.0)).item() == 0.75
    assert (t32(x_value) * (1 / (t32(72.0) / t32(gs)))).item() != 0.75
    x = torch.zeros(1, 16, device=device)
    x[0, 0], x[0, 1] = amax, x_value
    packed, scales = quantize(x, torch.tensor([gs], device=device), swizzled=False)
    assert scales.float().item() == 72.0
    assert unpack_codes(packed)[0, 1].item() == 2


def test_scale_saturates_at_448():
    # gs * amax / 6 = 1e4 / 6 > 448: sf = 448, elements scaled by 1/448
    x = torch.zeros(1, 16)
    x[0, :4] = torch.tensor([1e4, 448.0 * 6, 448.0 * 3, -448.0 * 5])
    packed, scales = quantize(x, ONE, swizzled=False)
    assert scales.float().item() == 448.0
    assert unpack_codes(packed)[0, :4].tolist() == [7, 7, 5, 8 | 6]


@pytest.mark.parametrize(
    "dtype, value, gs",
    [(torch.float32, 3e38, 1e3), (torch.float16, 65504.0, 1e6), (torch.bfloat16, 3e38, 1e30)],
)
def test_huge_values_give_no_nan(dtype, value, gs):
    x = torch.full((3, 32), value, dtype=dtype)
    x[1] = -x[1]
    x[2, ::2] = 1.0
    gs = torch.tensor([gs])
    packed, scales = quantize(x, gs, swizzled=False)
    assert scales.float().eq(448.0).all()
    codes = unpack_codes(packed)
    assert codes[0].eq(7).all() and codes[1].eq(15).all()
    x_hat = dequantize(packed, scales, gs, swizzled=False)
    assert x_hat.isfinite().all()


def test_zero_blocks():
    x = torch.zeros(1, 64)
    x[0, 16:32] = -0.0
    x[0, 32:48] = torch.linspace(-1, 1, 16) * 2**-12  # sf rounds to 0 with gs = 1
    x[0, 48] = 6.0
    packed, scales = quantize(x, ONE, swizzled=False)
    assert scales.float()[0].tolist() == [0.0, 0.0, 0.0, 1.0]
    codes = unpack_codes(packed)[0]
    assert codes[:16].eq(0).all()
    assert codes[16:32].eq(8).all()
    signs = torch.signbit(x[0, 32:48]).to(torch.uint8) << 3
    assert torch.equal(codes[32:48], signs)
    x_hat = dequantize(packed, scales, ONE, swizzled=False)
    assert x_hat[0, :48].eq(0).all()


# --------------------------------------------------------------------------
# Swizzled layout
# --------------------------------------------------------------------------


def expected_swizzle(linear_bytes: list[list[int]], m: int, n_blocks: int) -> list[int]:
    """Build the swizzled buffer byte by byte from the NVFP4.md offset formula."""
    rows = (m + 127) // 128 * 128
    cols = (n_blocks + 3) // 4 * 4
    kt = cols // 4
    flat = [0] * (rows * cols)
    for r in range(m):
        for c in range(n_blocks):
            off = ((r // 128) * kt + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
            flat[off] = linear_bytes[r][c]
    return flat


@pytest.mark.parametrize("m", [1, 128, 130, 257])
@pytest.mark.parametrize("n_blocks", [1, 3, 4, 8, 9])
def test_swizzle_against_offset_formula(m, n_blocks):
    gen = torch.Generator().manual_seed(m * 100 + n_blocks)
    linear = torch.randint(1, 256, (m, n_blocks), dtype=torch.uint8, generator=gen)
    swizzled = swizzle_scales(linear.view(FP8))
    assert swizzled.dtype == FP8
    assert swizzled.shape == scale_shape(m, n_blocks * 16)
    expected = expected_swizzle(linear.tolist(), m, n_blocks)
    assert swizzled.view(torch.uint8).flatten().tolist() == expected
    back = unswizzle_scales(swizzled, m, n_blocks)
    assert torch.equal(back.view(torch.uint8), linear)


def test_swizzled_offset_values():
    # first 512-byte tile: row r of group g at 16*r + 4*g, block column c at + c
    assert swizzled_offset(0, 0, 8) == 0
    assert swizzled_offset(0, 3, 8) == 3
    assert swizzled_offset(1, 0, 8) == 16
    assert swizzled_offset(31, 0, 8) == 496
    assert swizzled_offset(32, 0, 8) == 4
    assert swizzled_offset(127, 3, 8) == 511
    assert swizzled_offset(0, 4, 8) == 512  # next block-column tile
    assert swizzled_offset(128, 0, 8) == 1024  # next row tile (Kt = 2)
    assert swizzled_offset(128, 0, 9) == 1536  # Kt = 3
    rows = torch.arange(300).unsqueeze(1)
    cols = torch.arange(9).unsqueeze(0)
    table = swizzled_offset(rows, cols, 9)
    assert table[257, 5].item() == swizzled_offset(257, 5, 9)
    assert table.flatten().unique().numel() == 300 * 9  # one byte per scale


def test_swizzled_offset_matches_quantize_layout():
    m, n_blocks = 130, 5
    x = torch.randn(m, n_blocks * 16, generator=torch.Generator().manual_seed(0))
    _, linear = quantize(x, ONE, swizzled=False)
    _, swizzled = quantize(x, ONE)
    flat = swizzled.view(torch.uint8).flatten()
    rows = torch.arange(m).unsqueeze(1)
    cols = torch.arange(n_blocks).unsqueeze(0)
    assert torch.equal(flat[swizzled_offset(rows, cols, n_blocks)], linear.view(torch.uint8))


def test_swizzled_scale_padding_is_zero():
    m, n_blocks = 130, 5
    x = torch.randn(m, n_blocks * 16, generator=torch.Generator().manual_seed(1)) + 3.0
    _, scales = quantize(x, torch.tensor([2.0]))
    assert scales.shape == (256, 8)
    full = unswizzle_scales(scales, 256, 8).view(torch.uint8)
    assert full[:m, :n_blocks].ne(0).all()
    assert full[m:].eq(0).all()
    assert full[:, n_blocks:].eq(0).all()
    # and the same statement on raw bytes: only the m * n_blocks owned offsets are set
    owned = swizzled_offset(torch.arange(m).unsqueeze(1), torch.arange(n_blocks), n_blocks)
    mask = torch.ones(256 * 8, dtype=torch.bool)
    mask[owned.flatten()] = False
    assert scales.view(torch.uint8).flatten()[mask].eq(0).all()


def test_scale_shape():
    assert scale_shape(130, 80) == (256, 8)
    assert scale_shape(130, 80, swizzled=False) == (130, 5)
    assert scale_shape(0, 64) == (0, 4)
    assert scale_shape(128, 128) == (128, 8)
    assert nvfp4.round_up(0, 128) == 0 and nvfp4.round_up(129, 128) == 256


# --------------------------------------------------------------------------
# Round trip and error bound
# --------------------------------------------------------------------------


def make_data(kind: str, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(hash((kind, str(dtype))) % 2**31)
    x = torch.randn(2, 3, 256, generator=gen)
    if kind == "heavy":
        x = x * torch.exp(2.0 * torch.randn(2, 3, 256, generator=gen))
    elif kind == "tiny":
        x = x * 1e-4
    return x.to(dtype)


def block_t(x: torch.Tensor, gs: float) -> torch.Tensor:
    """gs * amax / 6 per element's block, float64 [M, K]."""
    blocks = x.reshape(-1, x.shape[-1] // 16, 16).double()
    t = gs * blocks.abs().amax(-1, keepdim=True) / 6
    return t.expand(blocks.shape).reshape(blocks.shape[0], -1)


# (data, gs choice): "cal" is the usual calibration 448 * 6 / amax(x)
ROUND_TRIP_CASES = [
    ("normal", "cal"),
    ("heavy", "cal"),
    ("tiny", "cal"),
    ("normal", 1e-2),  # block scales in the e4m3 subnormal range
    ("normal", 1e4),  # block scales saturate at 448
    ("heavy", 3e-3),  # mixture: subnormal and normal scales
    ("normal", 2e-3),  # many blocks whose scale rounds to 0
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind, gs_choice", ROUND_TRIP_CASES)
def test_round_trip_within_error_bound(kind, gs_choice, dtype):
    x = make_data(kind, dtype)
    gs_value = 448 * 6 / x.float().abs().max().item() if gs_choice == "cal" else gs_choice
    gs = torch.tensor([gs_value], dtype=torch.float32)
    packed, scales = quantize(x, gs)
    assert packed.shape == (6, 128) and scales.shape == (128, 16)
    x_hat = dequantize(packed, scales, gs)
    x2 = x.reshape(6, 256).double()
    err = (x2 - x_hat.double()).abs()
    bound = error_bound(x, gs).double()
    assert bound.shape == (6, 256)
    assert (err <= bound).all(), (err - bound).max()
    if gs_choice == "cal":
        # the bound is not vacuous: some element gets close to it ...
        assert (err / bound).max() > 0.3
        # ... and it stays close to amax / 6 for ordinary block scales
        t = block_t(x, gs_value)
        ordinary = (t >= 2**-4) & (t <= 448)
        assert ordinary.float().mean() > 0.5
        s = t / gs_value
        assert (bound[ordinary] < 1.2 * s[ordinary]).all()


def test_error_bound_saturation_term_is_needed():
    # with block scales clamped at 448 the error exceeds amax / 6 by far
    x = make_data("normal", torch.float32)
    gs = torch.tensor([1e4])
    packed, scales = quantize(x, gs)
    err = (x.reshape(6, 256) - dequantize(packed, scales, gs)).abs()
    s = block_t(x, 1e4) / 1e4
    assert (err > 2 * s).any()
    assert (err <= error_bound(x, gs)).all()


def test_error_bound_is_nearly_attained():
    # worst case in the normal range: sf rounds up by ~1/17 and an element sits
    # at q = 5, a tie that rounds down by a full code unit
    amax = next_f32(6.375, 10.0)  # gs * amax / 6 just above 1.0625 -> sf = 1.125
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = amax, 5 * 1.125
    packed, scales = quantize(x, ONE)
    assert scales.float()[0, 0].item() == 1.125
    err = (x - dequantize(packed, scales, ONE)).abs()[0, 1].item()
    assert err == 1.125
    bound = error_bound(x, ONE)[0, 1].item()
    assert err <= bound and err / bound > 0.99
    # block whose scale rounds to zero: it decodes to 0 and loses all of amax
    x = torch.zeros(1, 16)
    x[0, 0] = 6 * 2**-10  # gs * amax / 6 = 2^-10 ties to sf = 0
    packed, scales = quantize(x, ONE)
    assert scales.float()[0, 0].item() == 0.0
    err = (x - dequantize(packed, scales, ONE)).abs()[0, 0].item()
    assert err == 6 * 2**-10 <= error_bound(x, ONE)[0, 0].item()


def test_error_within_half_step_for_unsaturated_elements():
    x = make_data("heavy", torch.float32).reshape(6, 256)
    gs = torch.tensor([448 * 6 / x.abs().max().item()])
    packed, scales = quantize(x, gs, swizzled=False)
    sf = scales.float().repeat_interleave(16, dim=1)
    codes = unpack_codes(packed)
    err = (x - dequantize(packed, scales, gs, swizzled=False)).abs().double()
    step = half_step(codes).double() * sf.double() / gs.item()
    unsaturated = (x.double().abs() * gs.item() / sf.double() <= 6) & (sf > 0)
    assert (err[unsaturated] <= step[unsaturated] * (1 + 1e-6)).all()
    assert (err[unsaturated] / step[unsaturated]).max() > 0.9


def test_half_step_table():
    steps = half_step(torch.arange(16, dtype=torch.uint8)).tolist()
    assert steps[:8] == [0.25, 0.25, 0.25, 0.25, 0.5, 0.5, 1.0, 1.0]
    assert steps[8:] == steps[:8]


@pytest.mark.parametrize("m", [5, 130])
def test_linear_and_swizzled_layouts_agree(m):
    x = torch.randn(m, 144, generator=torch.Generator().manual_seed(m))  # 9 blocks
    gs = torch.tensor([448 * 6 / x.abs().max().item()])
    packed_s, scales_s = quantize(x, gs)
    packed_l, scales_l = quantize(x, gs, swizzled=False)
    assert torch.equal(packed_s, packed_l)
    assert scales_l.shape == (m, 9)
    assert torch.equal(unswizzle_scales(scales_s, m, 9).view(torch.uint8), scales_l.view(torch.uint8))
    out_s = dequantize(packed_s, scales_s, gs)
    out_l = dequantize(packed_l, scales_l, gs, swizzled=False)
    assert torch.equal(out_s, out_l)
    # vLLM allocates the swizzled buffer as int32 [round_up(M,128), round_up(K/16,4)/4]
    scales_i32 = scales_s.view(torch.int32)
    assert scales_i32.shape == (nvfp4.round_up(m, 128), 3)
    assert torch.equal(dequantize(packed_s, scales_i32, gs), out_s)
    assert torch.equal(dequantize(packed_s, scales_s, gs, dtype=torch.bfloat16), out_s.bfloat16())


def test_dequantize_first_m_rows():
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(3))
    packed, scales = quantize(x, ONE)
    full = dequantize(packed, scales, ONE)
    assert torch.equal(dequantize(packed, scales, ONE, m=7), full[:7])
    assert dequantize(packed, scales, ONE, m=0).shape == (0, 32)


def test_dequantize_rounds_once():
    # value * sf is exact in float32, so x_hat is value * sf / gs rounded once
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(5)) * 3
    gs = torch.tensor([0.3712])
    packed, scales = quantize(x, gs, swizzled=False)
    values = nvfp4.codes_to_values(unpack_codes(packed)).double()
    sf = scales.double().repeat_interleave(16, dim=1)
    expected = (values * sf / gs.double()).float()
    assert torch.equal(dequantize(packed, scales, gs, swizzled=False), expected)


def test_dequantize_formula():
    # x_hat = value(code) * float(sf) / gs on a hand-made buffer
    packed = torch.tensor([[0x7A] + [0] * 7], dtype=torch.uint8)  # codes 0xA (-1.0), 0x7 (6.0)
    scales = torch.tensor([[2.5]]).to(FP8)
    gs = torch.tensor([0.5])
    x_hat = dequantize(packed, scales, gs, swizzled=False)
    assert x_hat[0, :3].tolist() == [-5.0, 30.0, 0.0]


@pytest.mark.parametrize("shape", [(0, 32), (2, 0, 32)])
def test_zero_rows(shape):
    x = torch.empty(shape)
    packed, scales = quantize(x, ONE)
    assert packed.shape == (0, 16) and packed.dtype == torch.uint8
    assert scales.shape == (0, 4) and scales.dtype == FP8
    _, linear = quantize(x, ONE, swizzled=False)
    assert linear.shape == (0, 2)
    assert dequantize(packed, scales, ONE).shape == (0, 32)
    assert error_bound(x, ONE).shape == (0, 32)


# --------------------------------------------------------------------------
# Tracing: fake tensors, meta device, torch.compile
# --------------------------------------------------------------------------


def test_fake_and_meta_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        packed, scales = quantize(torch.empty(5, 48), torch.ones(1))
        assert packed.shape == (5, 24) and scales.shape == (128, 4)
    packed, scales = quantize(torch.empty(5, 48, device="meta"), torch.ones(1, device="meta"))
    assert packed.device.type == "meta" and scales.shape == (128, 4)


def test_torch_compile_dynamic_matches_eager():
    compiled = torch.compile(quantize, backend="aot_eager", dynamic=True, fullgraph=True)
    gs = torch.tensor([3.0])
    for m in (7, 130):
        x = torch.randn(m, 48, generator=torch.Generator().manual_seed(m))
        got, want = compiled(x, gs), quantize(x, gs)
        assert torch.equal(got[0], want[0])
        assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_cpu(dtype):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(300, 256, generator=gen) * torch.exp(3 * torch.randn(300, 1, generator=gen))
    x[0] = 0.0
    x[1, :16] = -0.0
    x[2] = 6e4  # gs * amax / 6 far above 448: the scale must saturate, not become NaN
    x = x.to(dtype)
    for gs_value in (448 * 6 / 30.0, 0.37, 1e-3):
        gs = torch.tensor([gs_value])
        for swizzled in (True, False):
            packed, scales = quantize(x, gs, swizzled=swizzled)
            packed_c, scales_c = quantize(x.cuda(), gs.cuda(), swizzled=swizzled)
            assert torch.equal(packed_c.cpu(), packed)
            assert torch.equal(scales_c.cpu().view(torch.uint8), scales.view(torch.uint8))
            out = dequantize(packed, scales, gs, swizzled=swizzled)
            out_c = dequantize(packed_c, scales_c, gs.cuda(), swizzled=swizzled)
            assert torch.equal(out_c.cpu(), out)
        assert torch.equal(error_bound(x.cuda(), gs.cuda()).cpu(), error_bound(x, gs))


# --------------------------------------------------------------------------
# The largest global scale
# --------------------------------------------------------------------------

GS_MAX = torch.tensor([nvfp4.GLOBAL_SCALE_MAX])
GS_ABOVE = torch.nextafter(GS_MAX, torch.tensor([math.inf]))


def test_global_scale_limit_is_float32_max_times_the_smallest_block_scale():
    f32_max = torch.finfo(torch.float32).max
    assert nvfp4.GLOBAL_SCALE_MAX == f32_max * 2.0**-9 == (2 - 2.0**-23) * 2.0**118
    assert GS_MAX.item() == nvfp4.GLOBAL_SCALE_MAX  # a float32 value
    smallest = torch.tensor(2.0**-9)  # the smallest nonzero e4m3 value
    assert smallest.to(FP8).float() == smallest and torch.tensor(2.0**-10).to(FP8).float() == 0
    assert torch.isfinite(GS_MAX / smallest).all() and torch.isinf(GS_ABOVE / smallest).all()


def test_the_largest_global_scale_gives_the_contract_codes():
    """At the limit a block whose scale is the smallest nonzero e4m3 (2**-9) gets the codes of
    ``x * (gs / 2**-9)``, finite in float32: zeros stay code 0 / 8, no NaN- or Inf-derived code."""
    tiny = 2.0**-126  # float32's smallest normal: gs * 1.5 * tiny / 6 = (1 - 2**-24) * 2**-9
    x = torch.zeros(1, 32)
    x[0, :6] = torch.tensor([0.0, 1.5 * tiny, -tiny, -0.0, 1.25 * tiny, -1.5 * tiny])
    x[0, 16:] = 1.0  # a saturating block beside it: gs * 1 / 6 > 448
    packed, scales = quantize(x, GS_MAX, swizzled=False)
    assert scales.view(torch.uint8).tolist() == [[0x01, 0x7E]]  # 2**-9 and 448
    # x * inv with inv = float32 max: 1.5 * tiny -> 6 (0x7), tiny -> 3.9999998 -> 4 (0x6), 1.25 * tiny -> 5 - ulp
    # -> 4 (0x6); zeros keep their sign (0x0, 0x8); the saturating block's elements -> 6 (0x7)
    assert unpack_codes(packed)[0].tolist() == [0x0, 0x7, 0xE, 0x8, 0x6, 0xF] + [0] * 10 + [0x7] * 16
    x_hat = dequantize(packed, scales, GS_MAX, swizzled=False)
    assert torch.isfinite(x_hat).all()
    assert bool(((x - x_hat).abs() <= error_bound(x, GS_MAX)).all())


@pytest.mark.parametrize("call", [
    lambda gs: quantize(X, gs),
    lambda gs: dequantize(PACKED, SCALES, gs),
    lambda gs: error_bound(X, gs),
], ids=["quantize", "dequantize", "error_bound"])
def test_a_global_scale_above_the_limit_is_refused(call):
    call(GS_MAX)
    for gs in (GS_ABOVE, torch.tensor([1e37]), torch.tensor([torch.finfo(torch.float32).max])):
        with pytest.raises(nvfp4.ArgumentError, match=r"global_scale must be at most 6\.646139582783767e\+35"):
            call(gs)


def test_rows_into_refuses_a_global_scale_above_the_limit_before_writing():
    packed = torch.full((6, 16), 0xAB, dtype=torch.uint8)
    scales = torch.full((128, 4), 0xAB, dtype=torch.uint8)
    with pytest.raises(nvfp4.ArgumentError, match=r"quantize_rows_into: global_scale must be at most"):
        nvfp4.quantize_rows_into(X[:2], GS_ABOVE, packed, scales, 1)
    assert bool((packed == 0xAB).all()) and bool((scales == 0xAB).all())
    nvfp4.quantize_rows_into(X[:2], GS_MAX, packed, scales, 1)
    assert not bool((packed[1:3] == 0xAB).any())


# --------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------

X = torch.ones(4, 32)
PACKED, SCALES = quantize(X, ONE)
_, SCALES_LINEAR = quantize(X, ONE, swizzled=False)

BAD_INPUTS = [
    # quantize
    (lambda: quantize(torch.ones(3, 20), ONE), ValueError, r"quantize: x .*divisible by 16.*\[3, 20\]"),
    (lambda: quantize(torch.tensor(1.0), ONE), ValueError, r"quantize: x must have at least one dim"),
    (lambda: quantize(X.int(), ONE), TypeError, r"quantize: x must be float16, bfloat16 or float32"),
    (lambda: quantize(X.double(), ONE), TypeError, r"quantize: x must be float16"),
    (lambda: quantize(X, torch.ones(2)), ValueError, r"quantize: global_scale must be a one-element float32 tensor \(it has"),
    (lambda: quantize(X, torch.ones(0)), ValueError, r"quantize: global_scale must be a one-element float32 tensor \(it has"),
    (lambda: quantize(X, ONE.half()), TypeError, r"quantize: global_scale must be a one-element float32"),
    (lambda: quantize(X, 1.0), TypeError, r"quantize: global_scale must be a one-element float32"),
    (lambda: quantize(X, torch.zeros(1)), ValueError, r"quantize: global_scale .*positive and finite"),
    (lambda: quantize(X, -ONE), ValueError, r"quantize: global_scale .*positive and finite"),
    (lambda: quantize(X, ONE * math.nan), ValueError, r"quantize: global_scale .*positive and finite"),
    (lambda: quantize(X, ONE * math.inf), ValueError, r"quantize: global_scale .*positive and finite"),
    (lambda: quantize(X, ONE.to("meta")), ValueError, r"quantize: global_scale .*same device"),
    # dequantize
    (lambda: dequantize(PACKED.to(torch.int8), SCALES, ONE), ValueError, r"dequantize: packed must be .*uint8"),
    (lambda: dequantize(PACKED[0], SCALES, ONE), ValueError, r"dequantize: packed must be a 2-D"),
    (lambda: dequantize(PACKED[:, :4], SCALES, ONE), ValueError, r"dequantize: packed .*divisible by 8"),
    (lambda: dequantize(PACKED, SCALES.view(torch.uint8), ONE), ValueError, r"dequantize: scales must be .*float8"),
    (lambda: dequantize(PACKED, SCALES.float(), ONE), ValueError, r"dequantize: scales must be .*float8"),
    (lambda: dequantize(PACKED, SCALES[:, :2], ONE), ValueError, r"dequantize: scales must have shape"),
    (lambda: dequantize(PACKED, SCALES[:100], ONE), ValueError, r"dequantize: scales must have shape"),
    (lambda: dequantize(PACKED, SCALES_LINEAR, ONE), ValueError, r"dequantize: scales must have shape"),
    (
        lambda: dequantize(PACKED, SCALES_LINEAR[:2], ONE, swizzled=False),
        ValueError,
        r"dequantize: m=4 is larger than the number of scale rows",
    ),
    (
        lambda: dequantize(torch.zeros(200, 16, dtype=torch.uint8), SCALES, ONE),
        ValueError,
        r"dequantize: m=200 is larger than the number of scale rows",
    ),
    (lambda: dequantize(PACKED, SCALES, ONE, m=5), ValueError, r"dequantize: m must be in \[0, 4\]"),
    (lambda: dequantize(PACKED, SCALES.to("meta"), ONE), ValueError, r"dequantize: scales .*same device"),
    (lambda: dequantize(PACKED, SCALES, ONE.to("meta")), ValueError, r"dequantize: global_scale .*same device"),
    (lambda: dequantize(PACKED, SCALES, ONE.double()), TypeError, r"dequantize: global_scale must be a one-element float32"),
    (lambda: dequantize(PACKED, SCALES, -ONE), ValueError, r"dequantize: global_scale .*positive"),
    # helpers
    (lambda: error_bound(torch.ones(2, 24), ONE), ValueError, r"error_bound: x .*divisible by 16"),
    (lambda: error_bound(X, torch.ones(3)), ValueError, r"error_bound: global_scale"),
    (lambda: swizzle_scales(torch.ones(4, 2)), ValueError, r"swizzle_scales: scales_linear must be"),
    (lambda: unswizzle_scales(SCALES, 4, 5), ValueError, r"unswizzle_scales: swizzled must have shape"),
    (lambda: unpack_codes(PACKED.int()), ValueError, r"unpack_codes: packed must be uint8"),
    (lambda: scale_shape(4, 20), ValueError, r"scale_shape: k must be divisible by 16"),
]


@pytest.mark.parametrize("call, exc, match", BAD_INPUTS)
def test_bad_inputs_raise(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# --------------------------------------------------------------------------
# Independent scalar reference, compared byte for byte
# --------------------------------------------------------------------------


def _e4m3_grid() -> list[tuple[float, int]]:
    """(value, bits) of every non-negative finite float8_e4m3fn, from the format."""
    grid = []
    for exponent in range(16):
        for mantissa in range(8):
            if exponent == 15 and mantissa == 7:
                continue  # NaN
            if exponent == 0:
                value = mantissa * 2.0**-9
            else:
                value = (1 + mantissa / 8) * 2.0 ** (exponent - 7)
            grid.append((value, exponent << 3 | mantissa))
    return grid


E4M3_GRID = _e4m3_grid()


def ref_e4m3(t: float) -> tuple[float, int]:
    """Nearest e4m3 value to t >= 0 (ties to even bits), saturating at 448."""
    t = min(t, 448.0)
    best = min(abs(v - t) for v, _ in E4M3_GRID)
    candidates = [(v, b) for v, b in E4M3_GRID if abs(v - t) == best]
    return next((v, b) for v, b in candidates if b % 2 == 0) if len(candidates) > 1 else candidates[0]


def ref_e2m1(q: float) -> int:
    """Nearest e2m1 code to q (ties to even index, saturating), sign from q's sign bit."""
    a = abs(q)
    best = min(abs(v - a) for v in nvfp4.E2M1_VALUES)
    indices = [i for i, v in enumerate(nvfp4.E2M1_VALUES) if abs(v - a) == best]
    index = next(i for i in indices if i % 2 == 0) if len(indices) > 1 else indices[0]
    return index | (8 if math.copysign(1.0, q) < 0 else 0)


def ref_quantize_block(xs: list[float], gs: float) -> tuple[int, list[int]]:
    """(scale bits, element codes) of one 16-element block, float32 arithmetic emulated."""
    amax = max(abs(v) for v in xs)
    t = f32(f32(gs * amax) / 6.0)
    sf, bits = ref_e4m3(t)
    inv = f32(gs / sf) if sf != 0 else 0.0
    return bits, [ref_e2m1(f32(v * inv)) for v in xs]


def reference_cases():
    rng = random.Random(1234)
    blocks = []
    for _ in range(6):
        blocks.append([rng.gauss(0, 1) for _ in range(16)])
        blocks.append([rng.gauss(0, 1) * math.exp(3 * rng.gauss(0, 1)) for _ in range(16)])
    # exact ties after scaling: multiples of 0.25 with amax 6 (sf = gs * 1)
    blocks.append([6.0] + [rng.choice([-1, 1]) * rng.randrange(0, 25) * 0.25 for _ in range(15)])
    blocks.append([0.0, -0.0] * 8)
    blocks.append([-1e-3 * rng.random() for _ in range(16)])
    x = torch.tensor(blocks, dtype=torch.float32)
    for gs in (1.0, 0.37, 123.4, 448 * 6 / x.abs().max().item(), 1e-3, 3e3):
        for dtype in (torch.float32, torch.bfloat16):
            yield x.to(dtype), gs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index", range(12))
def test_matches_scalar_reference(index, device):
    x, gs = list(reference_cases())[index]
    gs_t = torch.tensor([gs], dtype=torch.float32)
    packed, scales = quantize(x.to(device), gs_t.to(device), swizzled=False)
    packed, scales = packed.cpu(), scales.cpu()
    codes = unpack_codes(packed)
    gs32 = gs_t.item()
    rows = x.float().tolist()
    for r, row in enumerate(rows):
        bits, ref_codes = ref_quantize_block(row, gs32)
        assert scales.view(torch.uint8)[r, 0].item() == bits, (r, row)
        assert codes[r].tolist() == ref_codes, (r, row)
