"""The FP8 reference quantizers against an independent oracle (docs/formats.md, "FP8").

The oracle rounds in float64 to the nearest of the 127 finite non-negative e4m3 values (ties to the even code),
clamping at 448; the float32 steps the kernels take (``x * inv``, ``absmax / 448``, ``1 / s``) are taken in float64
and rounded to float32 once, which is what IEEE float32 arithmetic returns. Static: every finite bfloat16 value
against scales drawn from a wide range; groups: generated rows with magnitudes from subnormal to saturated, NaN
and infinities placed at random.
"""

from __future__ import annotations

import random

import pytest
import torch

from fusion_pass import fp8
from fusion_pass.nvfp4 import ArgumentError

E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
POSITIVE = E4M3[:127]  # codes 0x00 .. 0x7E: 0 .. 448, increasing


def fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


def oracle_e4m3(y: torch.Tensor) -> torch.Tensor:
    """float64 ``y`` (finite) to e4m3 bytes: clamp to [-448, 448], nearest value, ties to the even code."""
    a = y.abs().clamp(max=448.0)
    hi = torch.searchsorted(POSITIVE, a).clamp(max=126)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - POSITIVE[lo], POSITIVE[hi] - a
    code = torch.where(d_lo < d_hi, lo, torch.where(d_hi < d_lo, hi, torch.where(lo % 2 == 0, lo, hi)))
    code = torch.where(POSITIVE[hi] == a, hi, code)
    return (code | torch.where(torch.signbit(y), 128, 0)).to(torch.uint8)


def f32(x: torch.Tensor) -> torch.Tensor:
    """float64 rounded once to float32 (what one IEEE float32 operation returns), back in float64."""
    return x.float().double()


def all_finite_bf16() -> torch.Tensor:
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return x[x.isfinite()]


def random_scales(rng: random.Random, n: int) -> list[float]:
    return [float(torch.tensor(2.0 ** rng.uniform(-30, 30) * rng.choice([1, rng.uniform(0.5, 1)])).float())
            for _ in range(n)]


def test_static_every_finite_bf16_value_against_the_oracle():
    seed = fresh_seed()
    rng = random.Random(seed)
    x = all_finite_bf16()
    for s in random_scales(rng, 12) + [1.0, 2.0**-9, 3.0]:
        scale = torch.tensor([s], dtype=torch.float32)
        inv = fp8.reciprocal(scale)
        assert inv.double().item() == f32(torch.tensor(1.0, dtype=torch.float64) / s).item(), (seed, s)
        got = fp8.quantize_static(x, inv).view(torch.uint8)
        y = f32(x.double() * inv.double())
        want = oracle_e4m3(torch.where(y.isfinite(), y, y.sign() * 448))
        bad = (got != want).nonzero()[:, 0]
        assert len(bad) == 0, f"seed {seed}, scale {s!r}: x {x[bad[:5]].tolist()} got {got[bad[:5]].tolist()} " \
                              f"want {want[bad[:5]].tolist()}"


@pytest.mark.parametrize("rule, nan_byte", [(fp8.NaNRule.POSITIVE_MAX, 0x7E), (fp8.NaNRule.NAN, 0x7F),
                                            (fp8.NaNRule.NEGATIVE_MAX, 0xFE)])
def test_static_special_values(rule, nan_byte):
    """The CUDA kernel's bytes (vLLM 0.32-0.34 on SM90): NaN +448, ±Inf ±448, beyond 448 saturated; the native
    form keeps NaN; a zero scale's infinite reciprocal saturates every nonzero value (and 0 * Inf is NaN)."""
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), 500.0, -1e-9, 0.0, -0.0, 1.0], dtype=torch.bfloat16)
    got = fp8.quantize_static(x, fp8.reciprocal(torch.ones(1)), nan=rule).view(torch.uint8).tolist()
    assert got == [nan_byte, 0x7E, 0xFE, 0x7E, 0x80, 0x00, 0x80, 0x38]
    zero = fp8.quantize_static(torch.tensor([1.0, 0.0, -1.0]), fp8.reciprocal(torch.zeros(1)), nan=rule)
    assert zero.view(torch.uint8).tolist() == [0x7E, nan_byte, 0xFE]


def random_rows(seed: int, rows: int, groups: int, *, specials: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, groups, 128, generator=gen)
    x = x * torch.exp2(torch.randint(-40, 20, (rows, groups, 1), generator=gen).float())  # per-group magnitudes
    x = x * torch.exp2(torch.randint(-12, 1, x.shape, generator=gen).float())  # subnormals inside a group
    if specials:
        for value in (float("nan"), float("inf"), float("-inf"), 0.0):
            x.view(-1)[torch.randint(0, x.numel(), (3,), generator=gen)] = value
    return x.reshape(rows, groups * 128).to(torch.bfloat16)


@pytest.mark.parametrize("ue8m0", [False, True], ids=["float_scales", "ue8m0"])
@pytest.mark.parametrize("divide", [False, True], ids=["times_reciprocal", "divide"])
def test_group_against_the_oracle(ue8m0, divide):
    seed = fresh_seed()
    x = random_rows(seed, 37, 6, specials=bool(seed % 2))
    q, scales = fp8.quantize_group(x, ue8m0=ue8m0, divide=divide)
    g = x.double().reshape(37, 6, 128)
    finite_abs = torch.where(g.isnan(), torch.zeros_like(g), g.abs())
    s = f32(finite_abs.amax(-1).clamp(min=fp8.SCALE_EPS) / 448.0)
    if ue8m0:
        s = torch.where(s.isinf(), s, torch.exp2(torch.ceil(torch.log2(s))))
    assert torch.equal(scales.double(), s), f"seed {seed}"
    s = s.unsqueeze(-1)
    y = f32(g / s) if divide else f32(g * f32(1.0 / s))
    nan = y.isnan()
    want = oracle_e4m3(torch.where(nan, torch.zeros_like(y), torch.where(y.isinf(), y.sign() * 448, y)))
    want = torch.where(nan, torch.full_like(want, 0xFE), want).reshape(37, 768)
    bad = (q.view(torch.uint8) != want).nonzero()
    assert len(bad) == 0, f"seed {seed}: {len(bad)} bytes differ, first {bad[:5].tolist()}"


def test_ue8m0_scales_are_the_smallest_power_of_two_not_below_the_float_scale():
    seed = fresh_seed()
    x = random_rows(seed, 64, 4, specials=False)
    plain = fp8.group_scales(x)
    pow2 = fp8.group_scales(x, ue8m0=True)
    m, _ = torch.frexp(pow2)
    assert bool((m == 0.5).all()) and bool((pow2 >= plain).all()) and bool((pow2 < 2 * plain).all()), seed


def test_dividing_and_multiplying_by_the_reciprocal_differ_on_float_scales_only():
    """vLLM 0.32's kernel divides, 0.33's multiplies by ``1 / s``: some bytes differ (about 5e-4 of random
    elements); with power-of-two scales both are exact and equal."""
    seed = fresh_seed()
    x = (torch.randn(512, 2048, generator=torch.Generator().manual_seed(seed)) * 3).to(torch.bfloat16)
    a, _ = fp8.quantize_group(x, divide=True)
    b, _ = fp8.quantize_group(x, divide=False)
    assert (a.view(torch.uint8) != b.view(torch.uint8)).any(), f"no byte differs (seed {seed})"
    a, _ = fp8.quantize_group(x, divide=True, ue8m0=True)
    b, _ = fp8.quantize_group(x, divide=False, ue8m0=True)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"seed {seed}"


def test_group_special_values():
    """NaN elements leave the max and become -448 (0xFE, the kernel's ``fminf(fmaxf(q, -448), 448)``); an infinite
    element makes the scale infinite: finite elements 0, the infinite ones NaN quotients, -448; an all-zero group
    has the floor scale ``1e-10 / 448``."""
    x = torch.zeros(3, 128)
    x[0, 0], x[0, 1], x[0, 2] = float("nan"), 448.0, -224.0
    x[1, 0], x[1, 1], x[1, 2] = float("inf"), 1.0, -1.0
    q, s = fp8.quantize_group(x)
    b = q.view(torch.uint8)
    assert b[0, :3].tolist() == [0xFE, 0x7E, 0xF6] and s[0, 0].item() == 1.0
    assert b[1, :3].tolist() == [0xFE, 0x00, 0x80] and s[1, 0].item() == float("inf")
    assert s[2, 0].item() == torch.tensor(1e-10 / 448, dtype=torch.float32).item() and not b[2].any()


def test_round_trips_are_within_the_bounds():
    seed = fresh_seed()
    x = random_rows(seed, 50, 3, specials=False).float()
    q, scales = fp8.quantize_group(x)
    err = (fp8.dequantize_group(q, scales) - x).abs()
    bound = fp8.group_error_bound(x, scales)
    assert bool((err <= bound).all()), f"seed {seed}: worst {(err - bound).max().item()}"
    assert bool((err > bound / 4).any()), f"the bound is far from every error (seed {seed})"
    scale = torch.tensor([x.abs().max().item() / 448 / 4], dtype=torch.float32)  # a quarter saturates
    q = fp8.quantize_static(x, fp8.reciprocal(scale))
    err = (fp8.dequantize_static(q, scale) - x).abs()
    bound = fp8.static_error_bound(x, scale)
    assert bool((err <= bound).all()), f"seed {seed}: worst {(err - bound).max().item()}"


@pytest.mark.parametrize("layout", list(fp8.ScaleLayout))
@pytest.mark.parametrize("tokens", [1, 5, 128, 130])
def test_scale_layouts_are_recognised_from_their_strides(layout, tokens):
    t = fp8.group_scale_buffer(tokens, 512, layout)
    assert tuple(t.shape) == (tokens, 4)

    def agrees(other):
        return all(n == 1 or a == b for n, a, b in zip(t.shape, t.stride(), other.strides(tokens, 4)))

    assert agrees(layout)
    assert fp8.ScaleLayout.of(t) is next(other for other in fp8.ScaleLayout if agrees(other))
    assert fp8.ScaleLayout.of(torch.empty(8, 4, 2)[:, :, 0]) is None


@pytest.mark.parametrize("call, match", [
    (lambda: fp8.quantize_static(torch.ones(4, dtype=torch.int32), torch.ones(1)), "x must be float16"),
    (lambda: fp8.quantize_static(torch.ones(4), torch.ones(2)), "inv_scale must be a one-element float32"),
    (lambda: fp8.quantize_static(torch.ones(4), torch.ones(1, dtype=torch.float64)), "inv_scale must be"),
    (lambda: fp8.quantize_static(torch.ones(4), 2.0), "inv_scale must be a one-element float32 tensor, got float"),
    (lambda: fp8.quantize_group(torch.ones(4, 100)), "divisible by the group size 128"),
    (lambda: fp8.dequantize_group(torch.ones(2, 128), torch.ones(2, 1)), "q must be float8_e4m3fn"),
    (lambda: fp8.dequantize_group(torch.ones(2, 128).to(fp8.FP8), torch.ones(2, 2)), r"scales must be float32 \[2, 1\]"),
])
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ArgumentError, match=match):
        call()


@pytest.mark.parametrize("layout", list(fp8.ScaleLayout))
def test_writable_scales_are_the_layouts_and_the_first_rows_of_a_column_major_one(layout):
    full = fp8.group_scale_buffer(13, 512, layout)
    assert fp8.writable_scales(full)
    rows = full[:5]  # a padded batch's rows: column-major keeps its leading stride
    assert fp8.writable_scales(rows)
    assert (fp8.ScaleLayout.of(rows) is None) == (layout is not fp8.ScaleLayout.ROW_MAJOR)
    assert not fp8.writable_scales(torch.empty(8, 8)[:, ::2]), "a column stride of 2: no layout"
    assert not fp8.writable_scales(torch.empty(4, 8).t()[:, :3][:, ::1].as_strided((8, 3), (1, 2))), \
        "column-major with a leading stride below the rows: columns overlap"
