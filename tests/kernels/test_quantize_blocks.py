"""The Triton quantizer's block kernel (``kernel: "words"``, float16 / bfloat16 inputs) against the reference.

The kernel reads each 16-element block as 8 words of element pairs in one thread and
rounds to e2m1 with one magic add per element (``nvfp4_math.e2m1_nibble``); on CUDA it
rounds block scales with the hardware's e4m3 conversion, in Triton's CPU interpreter
(conftest.py sets ``TRITON_INTERPRET=1`` without a GPU) with the software rounding.
Both must give the reference's bytes (``fusion_pass.nvfp4``): packed codes, swizzled or
linear scales with their zero padding, NaN / infinity blocks, for every tile
configuration of the size table, for widths whose block count is not a multiple of 4,
row counts that are not multiples of 128, the row-range variant, misaligned inputs and
subnormal data. The cases are generated from seeds shown in the failure messages; on
CPU they are fewer and smaller.
"""

from __future__ import annotations

import random

import pytest
import torch

from fusion_pass import kernels, nvfp4
from fusion_pass.kernels.triton import quantize as nvfp4_quant

from row_buffers import POISON, expected, poisoned, scale_bytes  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TRITON = CUDA or kernels.interpreter_enabled()
FP8 = torch.float8_e4m3fn
HALF = [torch.float16, torch.bfloat16]

pytestmark = [
    pytest.mark.skipif(not TRITON, reason="no CUDA device and TRITON_INTERPRET is not set (conftest.py sets it)"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

TABLE_CONFIGS = [dict(c) for c in sorted({tuple(sorted(c.items())) for _, c in nvfp4_quant.QUANT_CONFIGS})]
# the interpreter runs a program in ~0.1 s: on the CPU one table tile and one narrow tile (4 programs per
# 128-row band of scales), on CUDA every table tile and two more shapes of tile
CONFIGS = TABLE_CONFIGS + [
    {"kernel": "words", "BLOCK_M": 1, "BLOCK_C": 16, "num_warps": 1},
    {"kernel": "words", "BLOCK_M": 2, "BLOCK_C": 128, "num_warps": 4},
] if CUDA else [TABLE_CONFIGS[-1], {"kernel": "words", "BLOCK_M": 32, "BLOCK_C": 16, "num_warps": 4}]


def config_id(config: dict) -> str:
    return f"{config['BLOCK_M']}x{config['BLOCK_C']}w{config['num_warps']}"


def seeded(seed: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def special_data(gen: torch.Generator, m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Random blocks over many magnitudes, with NaN, ±Inf, ±0, subnormal, saturating and
    all-zero blocks sprinkled in (on the CPU, in float32, then cast)."""
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-12, 12, (m, k // 16), generator=gen).float()
                                                      ).repeat_interleave(16, dim=1)
    tiny = torch.finfo(dtype).smallest_normal
    kinds = torch.randint(0, 10, (m, k // 16), generator=gen)
    for (r, c), kind in zip(torch.nonzero(kinds < 7).tolist(), kinds[kinds < 7].tolist()):
        block = x[r, 16 * c: 16 * c + 16]
        j = int(torch.randint(0, 16, (1,), generator=gen))
        if kind == 0:
            block[j] = float("nan")
        elif kind == 1:
            block[j] = float("inf") if j % 2 else float("-inf")
        elif kind == 2:
            block[:] = torch.randn(16, generator=gen) * tiny / 4  # subnormal inputs
        elif kind == 3:
            block[:] = -0.0 if j % 2 else 0.0
        elif kind == 4:
            block[j] = 6e4  # a saturating block scale
        elif kind == 5:
            block[:] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * (-1) ** j  # e2m1 ties
        elif kind == 6:
            block[j] = float("nan")
            block[(j + 1) % 16] = float("inf")
    return x.to(dtype)


def global_scale(x: torch.Tensor) -> torch.Tensor:
    finite = x.float()[torch.isfinite(x.float())]
    amax = float(finite.abs().max()) if finite.numel() else 1.0
    return torch.tensor([448 * 6 / max(amax, 1e-30)], device=DEVICE)


M_K = [(1, 16), (37, 48), (130, 80)] + ([(129, 272), (300, 1040), (1000, 2064), (4099, 4096)] if CUDA else [])


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
@pytest.mark.parametrize("m,k", M_K)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("swizzled", [True, False], ids=["swz", "linear"])
def test_block_kernel_bytes_equal_reference_into_poisoned_buffers(config, m, k, dtype, swizzled):
    seed = random.SystemRandom().randrange(2**31)
    x = special_data(seeded(seed), m, k, dtype).to(DEVICE)
    gs = global_scale(x)
    want_packed, want_scales = nvfp4.quantize(x, gs, swizzled=swizzled)
    rows, cols = nvfp4.scale_shape(m, k, swizzled=swizzled)
    for poison in (0x00, 0xFF) if CUDA else (0xFF,):
        packed = torch.full((m, k // 2), poison, dtype=torch.uint8, device=DEVICE)
        scales = torch.full((rows, cols), poison, dtype=torch.uint8, device=DEVICE)
        nvfp4_quant.quantize_launch(x, gs, swizzled=swizzled, packed=packed, scales=scales, config=config)
        assert torch.equal(scales.cpu(), want_scales.view(torch.uint8).cpu()), f"scales differ (seed {seed})"
        assert torch.equal(packed.cpu(), want_packed.cpu()), f"packed codes differ (seed {seed})"


@pytest.mark.parametrize("config", CONFIGS if CUDA else CONFIGS[:1], ids=config_id)
@pytest.mark.parametrize("dtype", HALF)
def test_block_kernel_rounds_block_scales_at_every_e4m3_tie(config, dtype):
    """Every e4m3 value and every midpoint between neighbours as ``gs * amax / 6`` (``gs = 1``: the
    amax is 6x the target, exact in 16 bits), and with global scales one float32 ulp either side
    of 1, which moves the quotient just off each tie."""
    values = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()
    mids = (values[1:] + values[:-1]) / 2
    targets = torch.cat([values, mids])
    targets = targets[(targets <= 448) & (targets * 6 <= torch.finfo(dtype).max)]
    x = torch.zeros(targets.numel(), 32)
    x[:, 3] = targets * 6
    x[:, 5] = -targets * 3
    x[:, 16:] = x[:, :16].flip(1)
    x = x.to(dtype).to(DEVICE)
    assert torch.equal(x.float()[:, 3].cpu(), targets * 6)
    for gs_value in (1.0, float(torch.nextafter(torch.ones(()), torch.zeros(()))),
                     float(torch.nextafter(torch.ones(()), torch.full((), 2.0)))):
        gs = torch.tensor([gs_value], device=DEVICE)
        packed, scales = nvfp4_quant.quantize_launch(x, gs, swizzled=False, config=config)
        want_packed, want_scales = nvfp4.quantize(x, gs, swizzled=False)
        assert torch.equal(scales.view(torch.uint8).cpu(), want_scales.view(torch.uint8).cpu()), gs_value
        assert torch.equal(packed.cpu(), want_packed.cpu()), gs_value


@pytest.mark.parametrize("dtype", HALF)
def test_block_kernel_codes_at_every_e2m1_tie_and_its_neighbours(dtype):
    """With ``gs = 448 * 6 / 6``-style scaling removed (a block whose scale is exactly 1), the
    elements are the e2m1 inputs themselves: every tie, its 16-bit neighbours, and values above 6."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    info = torch.finfo(dtype)
    values = torch.cat([ties, torch.nextafter(ties.to(dtype), torch.zeros((), dtype=dtype)).float(),
                        torch.nextafter(ties.to(dtype), torch.full((), 8.0, dtype=dtype)).float(),
                        torch.tensor([0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.5, 6.25, 6.5, 6.99, 7.0, 100.0,
                                      info.smallest_normal, info.smallest_normal / 8, info.max])])
    n = values.numel()
    x = torch.zeros(n, 32)
    x[:, 0] = 6.0  # block amax 6: scale e4m3(gs * 6 / 6) = 1 with gs = 1 (the largest finite value
    x[:, 16] = -6.0  # saturates the scale instead; both are compared with the reference)
    x[:, 1] = values
    x[:, 17] = -values
    x[:, 2:16] = values[:, None] * torch.linspace(-1, 1, 14)
    x = x.to(dtype).to(DEVICE)
    gs = torch.ones(1, device=DEVICE)
    for config in CONFIGS if CUDA else CONFIGS[:1]:
        packed, scales = nvfp4_quant.quantize_launch(x, gs, swizzled=False, config=config)
        want_packed, want_scales = nvfp4.quantize(x, gs, swizzled=False)
        assert torch.equal(packed.cpu(), want_packed.cpu()), config_id(config)
        assert torch.equal(scales.view(torch.uint8).cpu(), want_scales.view(torch.uint8).cpu()), config_id(config)


ROW_CASES = [(130, 48, 1, 129), (77, 16, 0, 77)] + ([(300, 80, 5, 200), (5000, 2064, 131, 4700)] if CUDA else [])


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
@pytest.mark.parametrize("t,k,start,stop", ROW_CASES)
@pytest.mark.parametrize("dtype", HALF)
def test_block_kernel_row_range_writes_only_its_rows(config, t, k, start, stop, dtype):
    seed = random.SystemRandom().randrange(2**31)
    x = special_data(seeded(seed), t, k, dtype).to(DEVICE)
    gs = global_scale(x)
    want_packed, want_scales = nvfp4.quantize(x, gs)
    packed, scales = poisoned(t, k, torch.int32)
    nvfp4_quant.quantize_rows_launch(x[start:stop], gs, packed, scales, start, config=config)
    owned = torch.zeros(nvfp4.round_up(t, 128), dtype=torch.bool)
    owned[start:stop] = True
    want_p, want_s = expected(t, k, want_packed, want_scales, owned)
    assert torch.equal(packed.cpu(), want_p), f"packed bytes (seed {seed})"
    assert torch.equal(scale_bytes(scales), want_s), f"scale bytes (seed {seed})"
    assert POISON in packed.cpu() or stop - start == t


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("column_offset", [0, 2, 8, 16])
def test_block_kernel_reads_strided_and_misaligned_inputs(dtype, column_offset):
    """A column slice of a wider matrix: a row stride that is not the width, and a base 4, 16 or 32
    bytes past an aligned allocation (the 128-bit-load path and the word-load path)."""
    seed = random.SystemRandom().randrange(2**31)
    wide = special_data(seeded(seed), 70, 176, dtype).to(DEVICE)
    x = wide[:, column_offset: column_offset + 144]
    gs = global_scale(x)
    got_packed, got_scales = nvfp4_quant.quantize_launch(x, gs)
    want_packed, want_scales = nvfp4.quantize(x, gs)
    assert torch.equal(got_packed.cpu(), want_packed.cpu()), f"seed {seed}"
    assert torch.equal(got_scales.view(torch.uint8).cpu(), want_scales.view(torch.uint8).cpu()), f"seed {seed}"


def test_block_kernel_misaligned_packed_buffer_falls_back_to_the_pair_kernel():
    """A packed buffer that cannot take 32-bit stores gets the element-pair kernel: same bytes."""
    x = special_data(seeded(3), 40, 64, torch.bfloat16).to(DEVICE)
    gs = global_scale(x)
    storage = torch.full((40 * 32 + 1,), POISON, dtype=torch.uint8, device=DEVICE)
    packed = storage[1:]
    scales = torch.empty(nvfp4.scale_shape(40, 64), dtype=torch.uint8, device=DEVICE)
    nvfp4_quant.quantize_launch(x, gs, packed=packed, scales=scales)
    want_packed, want_scales = nvfp4.quantize(x, gs)
    assert storage[0] == POISON
    assert torch.equal(packed.view(40, 32).cpu(), want_packed.cpu())
    assert torch.equal(scales.cpu(), want_scales.view(torch.uint8).cpu())


def test_size_table_is_well_formed():
    """Largest size class first, a class for every size, tiles Triton can build (powers of two),
    the block kernel for 16-bit inputs, the pair kernel for float32."""
    bounds = [bound for bound, _ in nvfp4_quant.QUANT_CONFIGS]
    assert bounds == sorted(bounds, reverse=True) and bounds[-1] == 0
    for _, config in nvfp4_quant.QUANT_CONFIGS:
        assert config["kernel"] == "words"
        for key in ("BLOCK_M", "BLOCK_C", "num_warps"):
            assert config[key] > 0 and config[key] & (config[key] - 1) == 0, config
    for numel, dtype in ((16, torch.bfloat16), (1 << 30, torch.float16)):
        x = torch.empty(numel // 16, 16, dtype=dtype, device="meta")
        chosen = nvfp4_quant.select_config(x)
        assert chosen in [c for _, c in nvfp4_quant.QUANT_CONFIGS]
        assert chosen is next(c for b, c in nvfp4_quant.QUANT_CONFIGS if numel * 2 >= b)
    assert nvfp4_quant.select_config(torch.empty(4, 16, device="meta")) is nvfp4_quant.LEGACY_CONFIG
