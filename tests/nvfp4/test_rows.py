"""The row-range NVFP4 quantizer: ``quantize_rows_into`` and ``zero_scale_padding``.

A producer that owns rows ``[row_start, row_start + M)`` of a ``T``-row NVFP4
buffer pair writes exactly the bytes the whole-buffer quantizer writes for those
rows, and no other byte. Checked on buffers poisoned with 0xAB, for the reference
(:func:`fusion_pass.nvfp4.quantize_rows_into`) and for the Triton kernel
(:func:`fusion_pass.kernels.quantize_rows_into`, ``backend="triton"``): compiled on
a CUDA device, in Triton's interpreter on CPU tensors otherwise (conftest.py sets
``TRITON_INTERPRET=1``), where the cases are fewer and smaller.

The cases are generated from fixed seeds (shown in the test ids and messages).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest
import torch

from fusion_pass import kernels, nvfp4
from fusion_pass.kernels.triton import quantize as nvfp4_quant


from row_buffers import POISON, expected, poisoned, row_of_scale_byte, scale_bytes  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TRITON = CUDA or kernels.interpreter_enabled()
FP8 = torch.float8_e4m3fn
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SCALE_DTYPES = [torch.int32, torch.uint8, FP8]
KS = [16, 32, 48, 64, 256]

# NaN * 0 and Inf * 0 inside NaN blocks, and NaN -> int casts, warn in Triton's interpreter (numpy).
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]
needs_triton = pytest.mark.skipif(
    not TRITON, reason="no CUDA device and TRITON_INTERPRET is not set (conftest.py sets it on CPU-only machines)"
)


# ---------------------------------------------------------------------------
# producers under test
# ---------------------------------------------------------------------------


def _reference(x, gs, packed, scales, row_start):
    nvfp4.quantize_rows_into(x, gs, packed, scales, row_start)


def _triton(x, gs, packed, scales, row_start):
    kernels.quantize_rows_into(x, gs, packed, scales, row_start, backend="triton")


PRODUCERS = {
    "reference": _reference,
    "triton": pytest.param(_triton, marks=needs_triton, id="triton"),
}


# ---------------------------------------------------------------------------
# generated cases
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    seed: int
    t: int
    k: int
    dtype: torch.dtype
    scale_dtype: torch.dtype
    ranges: tuple[tuple[int, int], ...]  # [a, b) row ranges covering 0..t, in row order

    def __str__(self) -> str:
        names = {torch.int32: "i32", torch.uint8: "u8", FP8: "fp8"}
        return f"T{self.t}-K{self.k}-{str(self.dtype)[6:]}-{names[self.scale_dtype]}-seed{self.seed}"


def crosses_tile(a: int, b: int) -> bool:
    return a // 128 != (b - 1) // 128


def split_rows(rng: random.Random, t: int) -> tuple[tuple[int, int], ...]:
    """Ranges covering rows ``0..t``: random cuts, a single row, and (``t > 128``) either a
    range across a 128-row tile boundary or one starting exactly on it."""
    cuts = {0, t}
    if t > 1:
        cuts.update(rng.randint(1, t - 1) for _ in range(rng.randint(1, 5)))
    if t > 2:
        r = rng.randrange(1, t - 1)
        cuts.update((r, r + 1))
    if t > 128:
        boundary = 128 * rng.randint(1, (t - 1) // 128)
        if rng.random() < 0.7:  # no cut near the boundary: the range around it crosses it
            lo, hi = max(boundary - rng.randint(1, 40), 0), min(boundary + rng.randint(1, 40), t)
            cuts = {c for c in cuts if not lo < c < hi} | {lo, hi}
        else:
            cuts.add(boundary)
    bounds = sorted(cuts)
    return tuple(zip(bounds[:-1], bounds[1:]))


def make_cases(n: int, seed0: int, fixed_t: list[int], max_t: int) -> list[Case]:
    combos = list(itertools.product(DTYPES, SCALE_DTYPES))
    cases = []
    for i in range(n):
        seed = seed0 + i
        rng = random.Random(seed)
        dtype, scale_dtype = combos[i % len(combos)]
        t = fixed_t[i] if i < len(fixed_t) else rng.randint(1, max_t)
        cases.append(Case(seed, t, KS[i % len(KS)], dtype, scale_dtype, split_rows(rng, t)))
    return cases


# The reference (and compiled Triton) get every (dtype, scale dtype) x K combination;
# the interpreter a smaller set that still covers every dtype, scale dtype and K.
FULL_CASES = make_cases(45, 1000, [128, 256, 384, 1, 2, 127, 129, 255, 257, 400, 300], 400)
SMALL_CASES = make_cases(10, 2000, [128, 1, 129, 256, 200, 3], 260)
TRITON_CASES = FULL_CASES if CUDA else SMALL_CASES


def test_generated_cases_cover_the_interesting_splits():
    for cases in (FULL_CASES, SMALL_CASES):
        ranges = [r for c in cases for r in c.ranges]
        assert {c.k for c in cases} == set(KS)
        assert {(c.dtype, c.scale_dtype) for c in cases} == set(itertools.product(DTYPES, SCALE_DTYPES))
        assert any(c.t % 128 == 0 for c in cases) and any(c.t % 128 != 0 for c in cases)
        assert any(b - a == 1 for a, b in ranges), "no single-row range"
        assert any(crosses_tile(a, b) for a, b in ranges), "no range across a 128-row tile boundary"
        assert any(a % 128 == 0 and a > 0 for a, b in ranges), "no range starting on a tile boundary"
        assert any(len(c.ranges) >= 4 for c in cases)
        for c in cases:
            assert c.ranges[0][0] == 0 and c.ranges[-1][1] == c.t
            assert all(a < b and b == a2 for (a, b), (a2, _) in zip(c.ranges, c.ranges[1:] + ((c.t, 0),)))
    assert max(c.t for c in FULL_CASES) == 400


def make_input(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` (rows of very different magnitudes, a zero and a -0.0 block) and a global scale."""
    gen = torch.Generator().manual_seed(case.seed)
    x = torch.randn(case.t, case.k, generator=gen) * torch.exp(2 * torch.randn(case.t, 1, generator=gen))
    x[0, :16] = 0.0
    x[-1, -16:] = -0.0
    gs = 448 * 6 / (float(x.abs().amax()) or 1.0) * 2.0 ** float(torch.empty(()).uniform_(-2, 2, generator=gen))
    return x.to(device=DEVICE, dtype=case.dtype), torch.tensor([gs], device=DEVICE)


# ---------------------------------------------------------------------------
# buffers and the bytes expected in them
# ---------------------------------------------------------------------------


def assert_bytes(case, packed, scales, want_packed, want_scales, what: str) -> None:
    got_packed, got_scales = packed.cpu(), scale_bytes(scales)
    if not torch.equal(got_packed, want_packed):
        row = (got_packed != want_packed).any(1).nonzero()[0].item()
        raise AssertionError(
            f"{what}: packed row {row} {got_packed[row].tolist()} != {want_packed[row].tolist()} ({case})"
        )
    if not torch.equal(got_scales, want_scales):
        at = (got_scales != want_scales).nonzero()[0].item()
        row = row_of_scale_byte(case.t, case.k)[at].item()
        raise AssertionError(
            f"{what}: scale byte {at} (row {row}) is 0x{got_scales[at].item():02x}, expected "
            f"0x{want_scales[at].item():02x} ({case})"
        )


# ---------------------------------------------------------------------------
# the rows in range hold the whole-buffer bytes; nothing else is written
# ---------------------------------------------------------------------------


def _check_each_range_alone(case: Case, produce) -> None:
    x, gs = make_input(case)
    want_packed, want_scales = nvfp4.quantize(x, gs)
    padded_rows = nvfp4.round_up(case.t, 128)
    for a, b in case.ranges:
        packed, scales = poisoned(case.t, case.k, case.scale_dtype)
        produce(x[a:b], gs, packed, scales, a)
        owned = torch.zeros(padded_rows, dtype=torch.bool)
        owned[a:b] = True
        want = expected(case.t, case.k, want_packed, want_scales, owned)
        assert_bytes(case, packed, scales, *want, f"rows [{a}, {b})")


def _check_fill_in_random_order(case: Case, produce, whole_buffer) -> None:
    x, gs = make_input(case)
    want_packed, want_scales = nvfp4.quantize(x, gs)
    packed, scales = poisoned(case.t, case.k, case.scale_dtype)
    owned = torch.zeros(nvfp4.round_up(case.t, 128), dtype=torch.bool)
    order = list(case.ranges)
    random.Random(case.seed).shuffle(order)
    for a, b in order:
        produce(x[a:b], gs, packed, scales, a)
        owned[a:b] = True
        want = expected(case.t, case.k, want_packed, want_scales, owned)
        assert_bytes(case, packed, scales, *want, f"after rows [{a}, {b}) in the order {order}")
    nvfp4.zero_scale_padding(scales, case.t, case.k)
    for name, (p, s) in (("quantize_reference", (want_packed, want_scales)), ("quantize", whole_buffer(x, gs))):
        assert_bytes(case, packed, scales, p.cpu(), scale_bytes(s), f"all ranges + zero_scale_padding vs {name}")


@pytest.mark.parametrize("case", FULL_CASES, ids=str)
def test_reference_writes_only_its_rows_with_whole_buffer_bytes(case):
    _check_each_range_alone(case, _reference)


@pytest.mark.parametrize("case", FULL_CASES, ids=str)
def test_reference_ranges_in_any_order_plus_padding_give_the_whole_buffer(case):
    _check_fill_in_random_order(case, _reference, nvfp4.quantize)


@needs_triton
@pytest.mark.parametrize("case", TRITON_CASES, ids=str)
def test_triton_writes_only_its_rows_with_whole_buffer_bytes(case):
    _check_each_range_alone(case, _triton)


@needs_triton
@pytest.mark.parametrize("case", TRITON_CASES, ids=str)
def test_triton_ranges_in_any_order_plus_padding_give_the_whole_buffer(case):
    _check_fill_in_random_order(case, _triton, kernels.quantize)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device: large shapes are too slow for Triton's interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_large_shapes_on_cuda(dtype):
    t, k = 4099, 4096
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(t, k, generator=gen) * torch.exp(torch.randn(t, 1, generator=gen))).to(DEVICE, dtype)
    gs = torch.tensor([448 * 6 / float(x.abs().amax())], device=DEVICE)
    want_packed, want_scales = nvfp4_quant.quantize_launch(x, gs)
    ranges = [(0, 1), (1, 100), (100, 1000), (1000, 1001), (1001, 4000), (4000, 4099)]
    packed, scales = poisoned(t, k, torch.int32)
    for a, b in reversed(ranges):
        kernels.quantize_rows_into(x[a:b], gs, packed, scales, a)
    assert (scale_bytes(scales)[row_of_scale_byte(t, k) >= t] == POISON).all()
    nvfp4.zero_scale_padding(scales, t, k)
    for p, s in ((want_packed, want_scales), nvfp4.quantize(x, gs)):
        assert torch.equal(packed, p)
        assert torch.equal(scales.view(torch.uint8).flatten(), s.view(torch.uint8).flatten())


# ---------------------------------------------------------------------------
# special inputs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("produce", PRODUCERS.values(), ids=PRODUCERS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_nan_and_inf_blocks(produce, dtype):
    """docs/nvfp4.md "NaN and infinity", in rows written by different calls."""
    t, k = 150, 48
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(t, k, generator=gen)
    x[3, 5] = float("nan")  # NaN block: scale 0x7F, codes 0
    x[127, 20] = float("inf")  # Inf block: scale 448 (0x7E), +Inf -> code 0x7
    x[128, 33], x[128, 40] = float("-inf"), float("nan")  # NaN wins over -Inf
    x[149, 0], x[149, 15] = float("inf"), float("-inf")
    x = x.to(DEVICE, dtype)
    gs = torch.tensor([100.0], device=DEVICE)
    packed, scales = poisoned(t, k, torch.uint8)
    for a, b in [(130, 150), (0, 5), (5, 130)]:
        produce(x[a:b], gs, packed, scales, a)
    nvfp4.zero_scale_padding(scales, t, k)
    want_packed, want_scales = nvfp4.quantize(x, gs)
    assert torch.equal(packed, want_packed) and torch.equal(scales, want_scales.view(torch.uint8))

    flat = scale_bytes(scales)
    codes = nvfp4.unpack_codes(packed.cpu())

    def sf(r, c):
        return flat[nvfp4.swizzled_offset(r, c, k // 16)].item()

    assert sf(3, 0) == 0x7F and (codes[3, :16] == 0).all()
    assert sf(128, 2) == 0x7F and (codes[128, 32:48] == 0).all()
    assert sf(127, 1) == 0x7E and codes[127, 20] == 0x7
    assert sf(149, 0) == 0x7E and codes[149, 0] == 0x7 and codes[149, 15] == 0xF
    assert sf(3, 1) not in (0x7E, 0x7F)  # the neighbouring blocks are ordinary


@pytest.mark.parametrize("produce", PRODUCERS.values(), ids=PRODUCERS.keys())
def test_strided_and_misaligned_x(produce):
    """A column slice of a wider tensor, and a contiguous view at an odd element offset."""
    t, k = 40, 32
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(t, 3 * k, generator=gen).to(DEVICE, torch.bfloat16)
    x = wide[:, k : 2 * k]
    flat = torch.randn(t * k + 1, generator=gen).to(DEVICE, torch.float16)
    odd = flat[1:].view(t, k)
    for data in (x, odd):
        gs = torch.tensor([448 * 6 / float(data.abs().amax())], device=DEVICE)
        packed, scales = poisoned(t, k, FP8)
        produce(data[:17], gs, packed, scales, 0)
        produce(data[17:], gs, packed, scales, 17)
        nvfp4.zero_scale_padding(scales, t, k)
        want_packed, want_scales = nvfp4.quantize(data, gs)
        assert torch.equal(packed, want_packed)
        assert torch.equal(scales.view(torch.uint8), want_scales.view(torch.uint8))


@pytest.mark.parametrize("produce", PRODUCERS.values(), ids=PRODUCERS.keys())
@pytest.mark.parametrize("row_start", [0, 7, 10])
def test_empty_range_writes_nothing(produce, row_start):
    packed, scales = poisoned(10, 32, torch.int32)
    produce(torch.zeros(0, 32, device=DEVICE), torch.ones(1, device=DEVICE), packed, scales, row_start)
    assert (packed == POISON).all() and (scale_bytes(scales) == POISON).all()


# ---------------------------------------------------------------------------
# zero_scale_padding
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=str)
@pytest.mark.parametrize("t", [0, 1, 31, 32, 33, 100, 127, 128, 129, 200, 256, 300])
@pytest.mark.parametrize("k", [16, 48, 256])
def test_zero_scale_padding_zeroes_exactly_the_padding_rows(t, k, scale_dtype):
    _, scales = poisoned(t, k, scale_dtype)
    nvfp4.zero_scale_padding(scales, t, k)
    padding = row_of_scale_byte(t, k) >= t
    got = scale_bytes(scales)
    assert (got[padding] == 0).all() and (got[~padding] == POISON).all()
    assert padding.sum() == (nvfp4.round_up(t, 128) - t) * nvfp4.round_up(k // 16, 4)
    assert nvfp4.zero_scale_padding is nvfp4.zero_scale_padding


# ---------------------------------------------------------------------------
# argument checks: raised before anything is written, naming the argument
# ---------------------------------------------------------------------------

T, K, M, START = 10, 32, 4, 2


def _args():
    packed, scales = poisoned(T, K, torch.int32, device="cpu")
    x = torch.randn(M, K, dtype=torch.bfloat16)
    return {"x": x, "global_scale": torch.tensor([2.0]), "packed": packed, "scales": scales, "row_start": START}


def _strided(shape, strides, dtype):
    return torch.empty_strided(shape, strides, dtype=dtype).fill_(0)


BAD_ARGS = [
    # (argument, replacement, error, message)
    ("row_start", -1, ValueError, r"row_start must be >= 0 \(got -1\)"),
    ("row_start", 7, ValueError, r"row_start \+ M = 7 \+ 4 = 11 exceeds T = 10"),
    ("row_start", 2.0, TypeError, r"row_start must be an int"),
    ("row_start", True, TypeError, r"row_start must be an int"),
    ("x", torch.randn(M, 48), ValueError, r"packed must be a uint8 tensor \[T, K/2\] = \[T, 24\] for x's K=48"),
    ("x", torch.randn(M, 20), ValueError, r"x must have a last dimension divisible by 16"),
    ("x", torch.randn(2, M, K), ValueError, r"x must be a 2-D tensor \[M, K\]"),
    ("x", torch.ones(M, K, dtype=torch.int32), TypeError, r"x must be float16, bfloat16 or float32"),
    ("x", [[0.0] * K], TypeError, r"x must be a tensor"),
    ("global_scale", torch.tensor([2.0], dtype=torch.float64), TypeError, r"global_scale must be a one-element float32 tensor"),
    ("global_scale", torch.tensor([2.0, 3.0]), ValueError, r"global_scale must be a one-element float32 tensor \(it has"),
    ("global_scale", torch.tensor([-1.0]), ValueError, r"global_scale must be positive and finite"),
    ("global_scale", torch.tensor([float("nan")]), ValueError, r"global_scale must be positive and finite"),
    ("global_scale", torch.ones(1, device="meta"), ValueError, r"global_scale must be on the same device"),
    ("packed", torch.zeros(T, K // 2, dtype=torch.int8), ValueError, r"packed must be a uint8 tensor \[T, K/2\]"),
    ("packed", torch.zeros(T, K, dtype=torch.uint8), ValueError, r"packed must be a uint8 tensor \[T, K/2\] = \[T, 16\]"),
    ("packed", torch.zeros(T, K, dtype=torch.uint8)[:, ::2], ValueError, r"packed must be contiguous"),
    ("packed", torch.zeros(T, K // 2, dtype=torch.uint8, device="meta"), ValueError, r"packed must be on x's device cpu"),
    ("packed", None, TypeError, r"packed must be a tensor"),
    ("scales", torch.zeros(256, 1, dtype=torch.int32), ValueError, r"scales must be the swizzled scale buffer of T=10"),
    ("scales", torch.zeros(128, 4, dtype=torch.int32), ValueError, r"scales must be .* int32 \[128, 1\]"),
    ("scales", torch.zeros(128, 8, dtype=torch.uint8), ValueError, r"scales must be .* uint8 / float8_e4m3fn \[128, 4\]"),
    ("scales", torch.zeros(T, 2, dtype=torch.uint8), ValueError, r"scales must be the swizzled scale buffer"),  # linear
    ("scales", torch.zeros(128, 4, dtype=torch.float16), ValueError, r"scales must be the swizzled scale buffer"),
    ("scales", torch.zeros(128, 8, dtype=torch.uint8)[:, :4], ValueError, r"scales must be contiguous"),
    ("scales", _strided((128, 1), (1, 2), torch.int32), ValueError, r"scales must be contiguous"),
    ("scales", torch.zeros(128, 4, dtype=FP8, device="meta"), ValueError, r"scales must be on x's device cpu"),
    ("scales", "buffer", TypeError, r"scales must be a tensor"),
]


@pytest.mark.parametrize("entry", [nvfp4.quantize_rows_into, kernels.quantize_rows_into],
                         ids=["nvfp4.quantize_rows_into", "kernels.quantize_rows_into"])
@pytest.mark.parametrize("arg,value,error,match", BAD_ARGS, ids=[f"{a[0]}-{i}" for i, a in enumerate(BAD_ARGS)])
def test_bad_arguments_raise_before_writing(entry, arg, value, error, match):
    args = _args()
    packed, scales = args["packed"], args["scales"]
    args[arg] = value
    with pytest.raises(error, match="quantize_rows_into: " + match):
        entry(**args)
    assert (packed == POISON).all() and (scale_bytes(scales) == POISON).all(), "written before the error"


def test_entry_point_backends(monkeypatch):
    """auto: Triton for CUDA tensors, the reference otherwise; triton: CUDA or the interpreter."""
    calls = []
    launcher = nvfp4_quant.quantize_rows_launch
    monkeypatch.setattr(nvfp4_quant, "quantize_rows_launch", lambda *a, **kw: calls.append(a[4]) or launcher(*a, **kw))
    args = _args()
    args.update(x=args["x"].to(DEVICE), global_scale=args["global_scale"].to(DEVICE))
    args.update(packed=args["packed"].to(DEVICE), scales=args["scales"].to(DEVICE))
    kernels.quantize_rows_into(**args)
    assert calls == ([START] if CUDA else [])
    kernels.quantize_rows_into(**args, backend="reference")
    assert calls == ([START] if CUDA else [])
    with pytest.raises(ValueError, match=r"quantize_rows_into: backend must be one of auto, triton, reference, got 'fa4'"):
        kernels.quantize_rows_into(**args, backend="fa4")
    if TRITON:
        kernels.quantize_rows_into(**args, backend="triton")
        assert calls[-1] == START
    cpu = _args()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"quantize_rows_into: backend 'triton' is unavailable: triton runs on CUDA"):
        kernels.quantize_rows_into(**cpu, backend="triton")
    assert (cpu["packed"] == POISON).all() and (scale_bytes(cpu["scales"]) == POISON).all()


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"rows": -1}, ValueError, r"rows must be >= 0 \(got -1\)"),
        ({"rows": 10.0}, TypeError, r"rows must be an int"),
        ({"k": 20}, ValueError, r"k must be divisible by 16 \(got 20\)"),
        ({"k": -32}, ValueError, r"k must be >= 0"),
        ({"k": "32"}, TypeError, r"k must be an int"),
        ({"k": 80}, ValueError, r"scales must be the swizzled scale buffer of T=10 rows, K=80"),
        ({"rows": 129}, ValueError, r"scales must be the swizzled scale buffer of T=129 rows"),
        ({"scales": torch.zeros(128, 8, dtype=torch.uint8)[:, :4]}, ValueError, r"scales must be contiguous"),
        ({"scales": torch.zeros(128, 2, dtype=torch.int16)}, ValueError, r"scales must be the swizzled scale buffer"),
        ({"scales": None}, TypeError, r"scales must be a tensor"),
    ],
)
def test_zero_scale_padding_bad_arguments(change, error, match):
    _, scales = poisoned(T, K, torch.int32, device="cpu")
    args = {"scales": scales, "rows": T, "k": K, **change}
    with pytest.raises(error, match="zero_scale_padding: " + match):
        nvfp4.zero_scale_padding(**args)
    assert (scale_bytes(scales) == POISON).all(), "written before the error"
