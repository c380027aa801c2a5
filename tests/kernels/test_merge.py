"""The NVFP4-writing attention-state merge: ``fusion_pass.kernels.triton.merge``.

Oracle: the ``reference`` backend's bytes are those of the reference quantizer
(:func:`fusion_pass.nvfp4.quantize` of the whole ``T``-row matrix) applied to
:func:`fusion_pass.kernels.reference.merge_attention`'s float32 result, in the merged rows, with
the outputs of empty parts (``lse = -inf``) taken as 0. Every generated input puts NaN
in those outputs, so an empty part that was read would show.

The ``triton`` backend computes ``exp`` with its own implementation and multiplies by
a per row-head ``1 / (w_a + w_b)``, so its float32 merge may be a few ulps off the
reference's where both parts carry weight. The bound, from the format (``NVFP4.md``):

* a block scale may differ on at most ``RATE`` of the blocks, and only to the
  neighbouring e4m3 value (a few ulps of ``amax`` move ``gs * amax / 6`` across at
  most one rounding tie); such a block's elements stay within twice
  :func:`fusion_pass.nvfp4.error_bound` of each other (each is within one bound of
  the merged value);
* in blocks with equal scales, every code is within one e2m1 step of the reference's
  (a value a few ulps from a rounding midpoint lands on one of its two neighbours),
  and codes differ on at most ``RATE`` of the elements.

``RATE = 1e-4`` is NVFP4.md's allowance for element codes of producers whose last-ulp
arithmetic differs from the reference's (vLLM's reciprocals); a few-ulp perturbation
of the quantizer's input is the same kind of effect. Measured in a float32 emulation
of the GPU arithmetic (``ex2.approx`` of a rounded ``x * log2(e)``, the reciprocal)
on 16.8M merged bf16 elements: 1e-6 of the blocks with a different scale, 7e-7 of
the elements with a different code, two orders below ``RATE``; compiled on an H200,
``test_rate_of_differing_bytes_on_a_large_merge`` measured 9.5e-7 and 1.2e-7. Each
case allows at least one difference (``ceil``): a rate cannot be checked below
``1 / RATE`` samples.
Merges with one empty part or equal LSEs are exact and are checked byte for byte.

Triton runs compiled on a CUDA device, in Triton's interpreter on CPU tensors otherwise
(conftest.py sets ``TRITON_INTERPRET=1``), where the cases are fewer and smaller. Each
test draws a fresh seed, shown in its failure messages (``MERGE_NVFP4_SEED=<seed>``
replays it).
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
from dataclasses import dataclass

import pytest
import torch

from fusion_pass import kernels, nvfp4
from fusion_pass.kernels.reference import merge_attention
from fusion_pass.kernels.triton import merge as merge_nvfp4
from fusion_pass.kernels import merge_attention_nvfp4


from row_buffers import POISON, expected, poisoned, row_of_scale_byte, scale_bytes  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TRITON = CUDA or kernels.interpreter_enabled()
FP8 = torch.float8_e4m3fn
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
RATE = 1e-4
NEG_INF = float("-inf")

# NaN garbage times 0 and NaN -> int casts warn in Triton's interpreter (numpy).
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]
needs_triton = pytest.mark.skipif(
    not TRITON, reason="no CUDA device and TRITON_INTERPRET is not set (conftest.py sets it on CPU-only machines)"
)
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (large shapes, compiled kernel)")
BACKENDS = ["reference", pytest.param("triton", marks=needs_triton)]


def fresh_seed() -> int:
    replay = os.environ.get("MERGE_NVFP4_SEED")
    return int(replay) if replay else random.SystemRandom().randrange(2**31)


# ---------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    m: int
    h: int
    dv: int
    row_start: int
    extra: int  # rows of the buffers after the merged ones
    dtype_a: torch.dtype
    dtype_b: torch.dtype
    scale_dtype: torch.dtype
    head_major_b: bool = False  # out_b a [M, H, Dv] view of an [H, M, Dv] buffer

    @property
    def t(self) -> int:
        return self.row_start + self.m + self.extra

    @property
    def k(self) -> int:
        return self.h * self.dv

    def __str__(self) -> str:
        names = {F32: "f32", BF16: "bf16", F16: "f16", torch.int32: "i32", torch.uint8: "u8", FP8: "fp8"}
        layout = "-bHMD" if self.head_major_b else ""
        return (f"M{self.m}-H{self.h}-Dv{self.dv}-rows{self.row_start}of{self.t}-{names[self.dtype_a]}"
                f"-{names[self.dtype_b]}-{names[self.scale_dtype]}{layout}")


CPU_CASES = [
    Case(1, 2, 16, 0, 0, F32, F32, torch.uint8),
    Case(3, 3, 16, 130, 5, BF16, BF16, torch.int32),
    Case(77, 2, 64, 60, 10, F16, F32, FP8, head_major_b=True),
    Case(130, 5, 48, 1, 0, BF16, F32, torch.uint8),
    Case(128, 2, 128, 128, 3, F32, BF16, torch.int32),
    Case(257, 1, 80, 40, 7, F16, F16, FP8),
    Case(300, 4, 32, 17, 100, BF16, F16, torch.uint8, head_major_b=True),
]
CUDA_CASES = CPU_CASES + [
    Case(1, 32, 128, 4095, 1, BF16, BF16, torch.int32),
    Case(129, 8, 64, 1, 200, F16, F16, FP8, head_major_b=True),
    Case(513, 5, 48, 128, 3, BF16, BF16, torch.uint8),
    Case(1000, 128, 128, 33, 7, BF16, F32, torch.int32),
    Case(2048, 16, 80, 5, 0, F16, BF16, FP8),
    Case(4099, 32, 128, 64, 5, BF16, BF16, torch.int32, head_major_b=True),
]
CASES = CUDA_CASES if CUDA else CPU_CASES


def test_cases_cover_the_brief():
    for cases in (CPU_CASES, CUDA_CASES):
        assert min(c.m for c in cases) == 1 and any(c.m % 128 for c in cases if c.m > 128)
        assert any(c.m % 128 == 0 for c in cases)
        assert any(c.row_start % 128 == 0 and c.row_start > 0 for c in cases)
        assert any(c.row_start // 128 != (c.row_start + c.m - 1) // 128 for c in cases), "no range across a tile"
        assert any((c.k // 16) % 4 for c in cases) and any((c.k // 16) % 4 == 0 for c in cases)
        assert {c.dtype_a for c in cases} | {c.dtype_b for c in cases} == {F32, BF16, F16}
        assert any(c.dtype_a != c.dtype_b for c in cases) and any(c.head_major_b for c in cases)
        assert {c.scale_dtype for c in cases} == {torch.int32, torch.uint8, FP8}


# ---------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------


@dataclass
class Inputs:
    out_a: torch.Tensor  # what the backends get: NaN in the outputs of empty parts
    lse_a: torch.Tensor  # [M, H] transposed views of [H, M] buffers
    out_b: torch.Tensor
    lse_b: torch.Tensor
    global_scale: torch.Tensor
    merged: torch.Tensor  # the oracle's float32 merge [M, H*Dv] (computed on DEVICE), on the CPU

    def args(self):
        return self.out_a, self.lse_a, self.out_b, self.lse_b, self.global_scale


def lse_pairs(gen: torch.Generator, h: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[H, M]`` LSE buffers: mostly a few units apart, some equal, some 30..120 apart,
    some with one or both parts empty (each kind present when ``H * M >= 5``)."""
    lse_a = torch.empty(h, m).uniform_(-5, 15, generator=gen)
    delta = torch.randn(h, m, generator=gen) * 3
    far = torch.empty(h, m).uniform_(30, 120, generator=gen) * torch.randint(0, 2, (h, m), generator=gen).mul(2).sub(1)
    kind = torch.randint(0, 16, (h, m), generator=gen).flatten()
    kind[torch.randperm(h * m, generator=gen)[:5]] = torch.arange(min(5, h * m))
    kind = kind.view(h, m)
    lse_b = lse_a + torch.where(kind == 0, 0.0, torch.where(kind == 1, far, delta))
    lse_a[(kind == 2) | (kind == 4)] = NEG_INF
    lse_b[(kind == 3) | (kind == 4)] = NEG_INF
    return lse_a, lse_b


def outputs(gen: torch.Generator, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[M, H, Dv]`` partial outputs, magnitudes varying per row and head."""
    shape = (case.m, case.h, case.dv)
    out_a = torch.randn(shape, generator=gen) * torch.exp(2 * torch.randn(case.m, case.h, 1, generator=gen))
    out_b = torch.randn(shape, generator=gen) * torch.exp(2 * torch.randn(case.m, case.h, 1, generator=gen))
    return out_a.to(case.dtype_a).float(), out_b.to(case.dtype_b).float()


def make_inputs(case: Case, seed: int) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    lse_a, lse_b = lse_pairs(gen, case.h, case.m)
    out_a, out_b = outputs(gen, case)
    empty_a, empty_b = torch.isneginf(lse_a.t())[..., None], torch.isneginf(lse_b.t())[..., None]
    clean_a, clean_b = out_a.masked_fill(empty_a, 0).to(DEVICE), out_b.masked_fill(empty_b, 0).to(DEVICE)
    # on the backends' device: torch's exp differs in the last bit between CPU and CUDA
    merged = merge_attention(clean_a, lse_a.to(DEVICE).t(), clean_b, lse_b.to(DEVICE).t())[0]
    merged = merged.reshape(case.m, case.k).cpu()
    amax = float(merged.abs().amax()) or 1.0
    gs = 448 * 6 / amax * 2.0 ** float(torch.empty(()).uniform_(-2, 2, generator=gen))
    garbage_a = out_a.masked_fill(empty_a, float("nan")).to(device=DEVICE, dtype=case.dtype_a)
    garbage_b = out_b.masked_fill(empty_b, float("nan")).to(device=DEVICE, dtype=case.dtype_b)
    if case.head_major_b:
        garbage_b = garbage_b.transpose(0, 1).contiguous().transpose(0, 1)
    return Inputs(garbage_a, lse_a.to(DEVICE).t(), garbage_b, lse_b.to(DEVICE).t(),
                  torch.tensor([gs], device=DEVICE), merged)


# ---------------------------------------------------------------------------
# buffers and the bytes expected in them
# ---------------------------------------------------------------------------


def whole_buffer_bytes(case: Case, merged: torch.Tensor, gs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Expected buffers: the reference quantizer's bytes of a ``[T, K]`` matrix holding ``merged``
    in the merged rows, poison in every byte of the other rows (padding rows included)."""
    x = torch.zeros(case.t, case.k)
    owned = torch.zeros(nvfp4.round_up(case.t, 128), dtype=torch.bool)
    x[case.row_start : case.row_start + case.m] = merged
    owned[case.row_start : case.row_start + case.m] = True
    return expected(case.t, case.k, *nvfp4.quantize(x, gs.cpu()), owned)


def assert_others_poisoned(case: Case, packed: torch.Tensor, scales: torch.Tensor, what: str) -> None:
    rows = torch.arange(case.t)
    other = (rows < case.row_start) | (rows >= case.row_start + case.m)
    assert (packed.cpu()[other] == POISON).all(), f"{what}: packed bytes of other rows written"
    scale_rows = row_of_scale_byte(case.t, case.k)
    other_scales = (scale_rows < case.row_start) | (scale_rows >= case.row_start + case.m)
    assert (scale_bytes(scales)[other_scales] == POISON).all(), f"{what}: scale bytes of other or padding rows written"


def merged_rows(case: Case, packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged rows' packed bytes ``[M, K/2]`` and linear scale bytes ``[M, round_up(K/16, 4)]``."""
    rows, cols = nvfp4.scale_shape(case.t, case.k)
    linear = nvfp4.unswizzle_scales(scales.view(torch.uint8).view(rows, cols).view(FP8).cpu(), rows, cols)
    span = slice(case.row_start, case.row_start + case.m)
    return packed.cpu()[span], linear.view(torch.uint8)[span]


SIGNED_RANK = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 0, -1, -2, -3, -4, -5, -6, -7])


def allowance(n: int) -> int:
    return math.ceil(RATE * n)


def assert_within_format_bound(got, want, merged, gs, what: str) -> tuple[int, int]:
    """The module docstring's bound; returns (codes differing in equal-scale blocks, scales differing)."""
    (got_packed, got_sf), (want_packed, want_sf) = got, want
    k = merged.shape[1]
    nb = k // 16
    assert torch.equal(got_sf[:, nb:], want_sf[:, nb:]), f"{what}: padding scale columns differ"
    got_sf, want_sf = got_sf[:, :nb], want_sf[:, :nb]
    scale_diff = got_sf != want_sf
    n_scales = int(scale_diff.sum())
    assert n_scales <= allowance(scale_diff.numel()), f"{what}: {n_scales} of {scale_diff.numel()} block scales differ"
    neighbours = ((got_sf.int() - want_sf.int()).abs() == 1) & (torch.maximum(got_sf, want_sf) < 0x7F)
    assert neighbours[scale_diff].all(), f"{what}: a block scale differs by more than one e4m3 step (or is NaN)"

    got_codes, want_codes = nvfp4.unpack_codes(got_packed), nvfp4.unpack_codes(want_packed)
    moved = scale_diff.repeat_interleave(16, dim=1)
    gap = (SIGNED_RANK[got_codes.long()] - SIGNED_RANK[want_codes.long()]).abs()
    assert (gap[~moved] <= 1).all(), f"{what}: a code is more than one e2m1 step from the reference's"
    n_codes = int((got_codes != want_codes)[~moved].sum())
    assert n_codes <= allowance(got_codes.numel()), f"{what}: {n_codes} of {got_codes.numel()} codes differ"
    if n_scales:
        gs = gs.cpu()

        def decode(codes, sf):
            return nvfp4.codes_to_values(codes) * sf.view(FP8).float().repeat_interleave(16, dim=1) / gs

        error = (decode(got_codes, got_sf) - decode(want_codes, want_sf)).abs()
        bound = 2 * nvfp4.error_bound(merged, gs)
        assert (error[moved] <= bound[moved]).all(), f"{what}: a block with a moved scale is off by more than 2 bounds"
    return n_codes, n_scales


def run(backend: str, case: Case, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    packed, scales = poisoned(case.t, case.k, case.scale_dtype)
    merge_attention_nvfp4(*inputs.args(), packed, scales, case.row_start, backend=backend)
    return packed, scales


# ---------------------------------------------------------------------------
# generated cases
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_writes_the_merge_bytes_into_its_rows_only(case):
    seed = fresh_seed()
    inputs = make_inputs(case, seed)
    packed, scales = run("reference", case, inputs)
    want_packed, want_scales = whole_buffer_bytes(case, inputs.merged, inputs.global_scale)
    assert torch.equal(packed.cpu(), want_packed), f"packed bytes differ (seed {seed})"
    assert torch.equal(scale_bytes(scales), want_scales), f"scale bytes differ (seed {seed})"


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_matches_the_reference_within_the_format_bound(case):
    seed = fresh_seed()
    inputs = make_inputs(case, seed)
    packed, scales = run("triton", case, inputs)
    what = f"{case} (seed {seed})"
    assert_others_poisoned(case, packed, scales, what)
    want = whole_buffer_bytes(case, inputs.merged, inputs.global_scale)
    got_rows = merged_rows(case, packed, scales)
    want_rows = merged_rows(case, want[0], want[1])
    n_codes, n_scales = assert_within_format_bound(got_rows, want_rows, inputs.merged, inputs.global_scale, what)
    print(f"{what}: {n_codes} of {case.m * case.k} codes, {n_scales} of {case.m * case.k // 16} scales differ")


# ---------------------------------------------------------------------------
# exact merges: one part empty, equal LSEs, both empty
# ---------------------------------------------------------------------------

EXACT_CASE = Case(140, 3, 32, 70, 9, BF16, F32, torch.int32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtypes", [(F32, F32), (BF16, F16), (F16, BF16)], ids=["f32", "bf16-f16", "f16-bf16"])
@pytest.mark.parametrize("merge", ["b_empty", "a_empty", "equal_lse", "both_empty"])
def test_exact_merges_give_the_quantizer_bytes(backend, dtypes, merge):
    """Weights 1 and 0 (one part empty, its output NaN garbage), 1 and 1 (equal LSEs), 0 and 0:
    the float32 merge is exact on every backend, so the bytes are the quantizer's of it."""
    seed = fresh_seed()
    case = dataclasses.replace(EXACT_CASE, dtype_a=dtypes[0], dtype_b=dtypes[1])
    gen = torch.Generator().manual_seed(seed)
    out_a, out_b = outputs(gen, case)
    lse = torch.empty(case.h, case.m).uniform_(-20, 20, generator=gen).t()
    empty = torch.full_like(lse, NEG_INF)
    lse_a, lse_b, want = {
        "b_empty": (lse, empty, out_a),
        "a_empty": (empty, lse, out_b),
        "equal_lse": (lse, lse.clone(), (out_a + out_b) / 2),
        "both_empty": (empty, empty, torch.zeros_like(out_a)),
    }[merge]
    out_a = out_a.masked_fill(torch.isneginf(lse_a)[..., None], float("nan")).to(DEVICE, case.dtype_a)
    out_b = out_b.masked_fill(torch.isneginf(lse_b)[..., None], float("nan")).to(DEVICE, case.dtype_b)
    gs = torch.tensor([448 * 6 / (float(want.abs().amax()) or 1.0)], device=DEVICE)

    packed, scales = poisoned(case.t, case.k, case.scale_dtype)
    merge_attention_nvfp4(out_a, lse_a.to(DEVICE), out_b, lse_b.to(DEVICE), gs, packed, scales, case.row_start,
                          backend=backend)
    want_packed, want_scales = poisoned(case.t, case.k, case.scale_dtype)
    nvfp4.quantize_rows_into(want.reshape(case.m, case.k).to(DEVICE), gs, want_packed, want_scales, case.row_start)
    assert torch.equal(packed, want_packed), f"packed bytes differ (seed {seed})"
    assert torch.equal(scale_bytes(scales), scale_bytes(want_scales)), f"scale bytes differ (seed {seed})"
    if merge == "both_empty":
        got_packed, got_sf = merged_rows(case, packed, scales)
        assert (got_packed == 0).all() and (got_sf == 0).all()


# ---------------------------------------------------------------------------
# NaN and infinity
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_and_inf(backend):
    """docs/nvfp4.md "NaN and infinity" for the merged values; a NaN or +inf LSE makes its
    row-head NaN; NaN in an empty part's output is never read. Equal LSEs keep the merge exact."""
    m, h, dv, row_start, t = 20, 2, 32, 3, 30
    k = h * dv
    gen = torch.Generator().manual_seed(3)
    out_a, out_b = torch.randn(m, h, dv, generator=gen), torch.randn(m, h, dv, generator=gen)
    lse_a = torch.zeros(h, m).t()
    lse_b = torch.zeros(h, m).t()
    out_a[5, 0, 3] = float("nan")  # NaN block (row 5, block column 0)
    out_b[6, 1, 17] = float("inf")  # row 6, block column 3: scale 448, codes 0x7 and (-Inf) 0xF
    out_a[6, 1, 20] = float("-inf")
    lse_a[7, 1] = float("nan")  # both blocks of head 1 NaN
    lse_b[8, 0] = float("inf")  # both blocks of head 0 NaN
    lse_a[9, :] = NEG_INF  # out_a of row 9 is garbage, ignored
    out_a[9] = float("nan")
    gs = torch.tensor([100.0], device=DEVICE)
    packed, scales = poisoned(t, k, torch.uint8)
    merge_attention_nvfp4(out_a.to(DEVICE), lse_a.to(DEVICE), out_b.to(DEVICE), lse_b.to(DEVICE), gs, packed, scales,
                          row_start, backend=backend)

    codes = nvfp4.unpack_codes(packed.cpu())
    flat = scale_bytes(scales)

    def sf(r, c):
        return flat[nvfp4.swizzled_offset(row_start + r, c, k // 16)].item()

    def block(r, c):
        return codes[row_start + r, 16 * c : 16 * c + 16]

    assert sf(5, 0) == 0x7F and (block(5, 0) == 0).all() and sf(5, 1) not in (0x7E, 0x7F)
    assert sf(6, 3) == 0x7E and block(6, 3)[1] == 0x7 and block(6, 3)[4] == 0xF
    assert all(sf(7, c) == 0x7F and (block(7, c) == 0).all() for c in (2, 3))
    assert all(sf(7, c) not in (0x7E, 0x7F) for c in (0, 1))
    assert all(sf(8, c) == 0x7F and (block(8, c) == 0).all() for c in (0, 1))
    want = (out_a + out_b) / 2
    want[9] = out_b[9]
    want[7, 1] = want[8, 0] = float("nan")
    want_packed, want_scales = poisoned(t, k, torch.uint8)
    nvfp4.quantize_rows_into(want.reshape(m, k).to(DEVICE), gs, want_packed, want_scales, row_start)
    assert torch.equal(packed, want_packed) and torch.equal(scales, want_scales)


# ---------------------------------------------------------------------------
# layouts: tiles, strides, alignment
# ---------------------------------------------------------------------------


@needs_triton
def test_launcher_tiles_give_the_same_bytes():
    """Heads of 3 blocks straddle every tile edge below; the element arithmetic does not
    depend on the tile, so every configuration writes the same bytes."""
    seed = fresh_seed()
    case = Case(21, 5, 48, 120, 2, BF16, F16, torch.uint8)
    inputs = make_inputs(case, seed)
    results = []
    for config in (None, {"BLOCK_M": 4, "BLOCK_K": 32, "num_warps": 1}, {"BLOCK_M": 2, "BLOCK_K": 128, "num_warps": 2},
                   {"BLOCK_M": 32, "BLOCK_K": 64, "num_warps": 4}):
        packed, scales = poisoned(case.t, case.k, case.scale_dtype)
        merge_nvfp4.merge_attention_nvfp4_launch(*inputs.args(), packed, scales, case.row_start, config=config)
        results.append((packed.cpu(), scale_bytes(scales)))
    for packed, scales in results[1:]:
        assert torch.equal(packed, results[0][0]) and torch.equal(scales, results[0][1]), f"seed {seed}"
    assert_others_poisoned(case, *results[0], f"seed {seed}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_misaligned_and_broadcast_inputs(backend):
    """out_a a slice of a wider buffer (strides not multiples of 16: read in pairs), out_b at an
    odd element offset (copied for the pair loads), lse_a broadcast along H (stride 0), lse_b
    contiguous [M, H]: the bytes of the same merge from contiguous inputs (strides in
    16-element blocks) and from a slice with strides in blocks. Equal LSEs keep the merge exact."""
    seed = fresh_seed()
    m, h, dv, row_start, t = 33, 2, 32, 1, 40
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(m, h, dv + 4, generator=gen).to(DEVICE, BF16)
    flat = torch.randn(m * h * dv + 1, generator=gen).to(DEVICE, F32)
    lse_rows = torch.randn(m, generator=gen).to(DEVICE)
    out_a, out_b = wide[:, :, 2 : 2 + dv], flat[1:].view(m, h, dv)
    wider = torch.zeros(m, h, 3 * dv, device=DEVICE, dtype=BF16)
    wider[:, :, dv : 2 * dv] = out_a
    lse_a, lse_b = lse_rows[:, None].expand(m, h), lse_rows[:, None].repeat(1, h)
    assert merge_nvfp4._strides(out_a, out_b.clone())[1] == 1
    assert merge_nvfp4._strides(wider[:, :, dv : 2 * dv], out_b.clone())[1] == 8
    gs = torch.tensor([50.0], device=DEVICE)
    results = []
    for args in ((out_a, lse_a, out_b, lse_b), (out_a.contiguous(), lse_a.contiguous(), out_b.clone(), lse_b),
                 (wider[:, :, dv : 2 * dv], lse_a, out_b.clone(), lse_b)):
        packed, scales = poisoned(t, h * dv, FP8)
        merge_attention_nvfp4(*args, gs, packed, scales, row_start, backend=backend)
        results.append((packed, scales.view(torch.uint8)))
    want_packed, want_scales = poisoned(t, h * dv, FP8)
    want = ((out_a.float() + out_b.float()) / 2).reshape(m, h * dv)
    nvfp4.quantize_rows_into(want, gs, want_packed, want_scales, row_start)
    for packed, scales in results:
        assert torch.equal(packed, want_packed) and torch.equal(scales, want_scales.view(torch.uint8)), f"seed {seed}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("row_start", [0, 7, 10])
def test_empty_merge_writes_nothing(backend, row_start):
    packed, scales = poisoned(10, 32, torch.int32)
    out = torch.zeros(0, 2, 16, device=DEVICE)
    lse = torch.zeros(0, 2, device=DEVICE)
    merge_attention_nvfp4(out, lse, out, lse, torch.ones(1, device=DEVICE), packed, scales, row_start, backend=backend)
    assert (packed == POISON).all() and (scale_bytes(scales) == POISON).all()


# ---------------------------------------------------------------------------
# argument checks: raised before anything is written, naming the argument
# ---------------------------------------------------------------------------

T, M, H, DV, START = 10, 4, 2, 16, 2


def _args():
    packed, scales = poisoned(T, H * DV, torch.int32, device="cpu")
    return {
        "out_a": torch.randn(M, H, DV, dtype=BF16), "lse_a": torch.randn(H, M).t(),
        "out_b": torch.randn(M, H, DV), "lse_b": torch.randn(H, M).t(),
        "global_scale": torch.tensor([2.0]), "packed": packed, "scales": scales, "row_start": START,
    }


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


BAD_ARGS = [
    # (replaced arguments, error, message)
    ({"out_a": torch.randn(M, H * DV)}, ValueError, r"out_a must be a 3-D tensor \[M, H, Dv\]"),
    ({"out_a": torch.ones(M, H, DV, dtype=torch.int32)}, TypeError, r"out_a must be float32, bfloat16 or float16"),
    ({"out_a": [[0.0]]}, TypeError, r"out_a must be a tensor"),
    ({"out_a": torch.randn(M, H, 2 * DV)[..., ::2]}, ValueError, r"out_a must have unit stride along Dv"),
    ({"out_b": torch.randn(M, H, DV, dtype=torch.float64)}, TypeError, r"out_b must be float32, bfloat16 or float16"),
    ({"out_b": torch.randn(M, H, 2 * DV)}, ValueError, r"out_b must have out_a's shape \[M, H, Dv\] = \[4, 2, 16\]"),
    ({"out_b": torch.randn(M + 1, H, DV)}, ValueError, r"out_b must have out_a's shape"),
    ({"out_b": _meta(M, H, DV)}, ValueError, r"out_b must be on out_a's device cpu"),
    ({"out_b": None}, TypeError, r"out_b must be a tensor"),
    ({"out_a": torch.randn(M, 3, 4), "out_b": torch.randn(M, 3, 4), "lse_a": torch.randn(M, 3),
      "lse_b": torch.randn(M, 3)}, ValueError, r"H \* Dv must be divisible by 16"),
    ({"lse_a": torch.randn(M, H, dtype=torch.float64)}, TypeError, r"lse_a must be float32, got torch.float64"),
    ({"lse_b": torch.randn(H, M)}, ValueError, r"lse_b must be \[M, H\] = \[4, 2\] \(any strides"),
    ({"lse_a": torch.randn(M, H, 1)}, ValueError, r"lse_a must be \[M, H\] = \[4, 2\]"),
    ({"lse_a": _meta(M, H)}, ValueError, r"lse_a must be on out_a's device cpu"),
    ({"lse_b": 0.0}, TypeError, r"lse_b must be a tensor"),
    ({"global_scale": torch.tensor([2.0], dtype=torch.float64)}, TypeError, r"global_scale must be a one-element float32 tensor"),
    ({"global_scale": torch.tensor([2.0, 3.0])}, ValueError, r"global_scale must be a one-element float32 tensor \(it has"),
    ({"global_scale": torch.tensor([-1.0])}, ValueError, r"global_scale must be positive and finite"),
    ({"global_scale": torch.tensor([float("inf")])}, ValueError, r"global_scale must be positive and finite"),
    ({"global_scale": _meta(1)}, ValueError, r"global_scale must be on the same device"),
    ({"global_scale": 2.0}, TypeError, r"global_scale must be a one-element float32 tensor"),
    ({"packed": torch.zeros(T, H * DV, dtype=torch.uint8)}, ValueError,
     r"packed must be a uint8 tensor \[T, H\*Dv/2\] = \[T, 16\] for out_a's H\*Dv=32"),
    ({"packed": torch.zeros(T, H * DV // 2, dtype=torch.int8)}, ValueError, r"packed must be a uint8 tensor"),
    ({"packed": torch.zeros(T, H * DV, dtype=torch.uint8)[:, ::2]}, ValueError, r"packed must be contiguous"),
    ({"packed": _meta(T, H * DV // 2, dtype=torch.uint8)}, ValueError, r"packed must be on out_a's device cpu"),
    ({"packed": None}, TypeError, r"packed must be a tensor"),
    ({"scales": torch.zeros(256, 1, dtype=torch.int32)}, ValueError, r"scales must be the swizzled .* of T=10 rows"),
    ({"scales": torch.zeros(128, 8, dtype=torch.uint8)}, ValueError, r"scales must be .* float8_e4m3fn \[128, 4\]"),
    ({"scales": torch.zeros(T, 2, dtype=torch.uint8)}, ValueError, r"scales must be the swizzled scale buffer"),
    ({"scales": torch.zeros(128, 8, dtype=torch.uint8)[:, :4]}, ValueError, r"scales must be contiguous"),
    ({"scales": _meta(128, 4, dtype=FP8)}, ValueError, r"scales must be on out_a's device cpu"),
    ({"scales": "buffer"}, TypeError, r"scales must be a tensor"),
    ({"row_start": -1}, ValueError, r"row_start must be >= 0 \(got -1\)"),
    ({"row_start": 7}, ValueError, r"row_start \+ M = 7 \+ 4 = 11 exceeds T = 10"),
    ({"row_start": 2.0}, TypeError, r"row_start must be an int"),
    ({"row_start": True}, TypeError, r"row_start must be an int"),
    ({"backend": "fa4"}, ValueError, r"backend must be one of auto, triton, reference, got 'fa4'"),
]
BAD_ARG_IDS = [f"{next(iter(change))}-{i}" for i, (change, _, _) in enumerate(BAD_ARGS)]


@pytest.mark.parametrize("backend", ["auto", "reference", "triton"])
@pytest.mark.parametrize("change,error,match", BAD_ARGS, ids=BAD_ARG_IDS)
def test_bad_arguments_raise_before_writing(backend, change, error, match):
    args = {**_args(), "backend": backend}
    packed, scales = args["packed"], args["scales"]
    args.update(change)
    with pytest.raises(error, match="merge_attention_nvfp4: " + match):
        merge_attention_nvfp4(**args)
    assert (packed == POISON).all() and (scale_bytes(scales) == POISON).all(), "written before the error"


def test_backend_choice(monkeypatch):
    """auto: Triton for CUDA tensors with Dv % 16 == 0, the reference otherwise; triton: CUDA or
    the interpreter, and Dv % 16 == 0."""
    calls = []
    launcher = merge_nvfp4.merge_attention_nvfp4_launch
    monkeypatch.setattr(merge_nvfp4, "merge_attention_nvfp4_launch",
                        lambda *a, **kw: calls.append(a[7]) or launcher(*a, **kw))
    args = {name: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for name, v in _args().items()}
    merge_attention_nvfp4(**args)
    assert calls == ([START] if CUDA else [])
    merge_attention_nvfp4(**args, backend="reference")
    assert calls == ([START] if CUDA else [])
    if TRITON:
        merge_attention_nvfp4(**args, backend="triton")
        assert calls[-1] == START

    narrow = {**args, "lse_a": torch.zeros(M, 2 * H, device=DEVICE), "lse_b": torch.zeros(M, 2 * H, device=DEVICE)}
    narrow.update({name: args[name].reshape(M, 2 * H, DV // 2) for name in ("out_a", "out_b")})
    n = len(calls)
    merge_attention_nvfp4(**narrow)
    assert len(calls) == n, "auto ran the Triton kernel with Dv % 16 != 0"
    if TRITON:
        with pytest.raises(ValueError, match=r"merge_attention_nvfp4: backend 'triton' needs Dv divisible by 16"):
            merge_attention_nvfp4(**narrow, backend="triton")

    cpu = _args()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"merge_attention_nvfp4: backend 'triton' is unavailable: triton runs on"):
        merge_attention_nvfp4(**cpu, backend="triton")
    assert (cpu["packed"] == POISON).all() and (scale_bytes(cpu["scales"]) == POISON).all()


# ---------------------------------------------------------------------------
# CUDA only
# ---------------------------------------------------------------------------


@needs_cuda
def test_launcher_does_not_synchronize():
    case = Case(1000, 16, 128, 64, 0, BF16, F32, torch.int32)
    inputs = make_inputs(case, fresh_seed())
    packed, scales = poisoned(case.t, case.k, case.scale_dtype)
    merge_nvfp4.merge_attention_nvfp4_launch(*inputs.args(), packed, scales, case.row_start)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        merge_nvfp4.merge_attention_nvfp4_launch(*inputs.args(), packed, scales, case.row_start)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@needs_cuda
def test_rate_of_differing_bytes_on_a_large_merge():
    """16.8M elements of realistic merges (LSEs a few units apart): the measured fractions,
    against RATE with no per-case floor."""
    seed = fresh_seed()
    case = Case(4096, 32, 128, 0, 0, BF16, BF16, torch.int32)
    gen = torch.Generator().manual_seed(seed)
    lse_a = torch.empty(case.h, case.m).uniform_(-2, 8, generator=gen)
    lse_b = lse_a + torch.randn(case.h, case.m, generator=gen) * 2
    out_a, out_b = (out.to(DEVICE) for out in outputs(gen, case))
    lse_a, lse_b = lse_a.to(DEVICE).t(), lse_b.to(DEVICE).t()
    merged = merge_attention(out_a, lse_a, out_b, lse_b)[0].reshape(case.m, case.k).cpu()
    gs = torch.tensor([448 * 6 / float(merged.abs().amax())], device=DEVICE)
    inputs = Inputs(out_a.to(BF16), lse_a, out_b.to(BF16), lse_b, gs, merged)
    got = merged_rows(case, *run("triton", case, inputs))
    want = merged_rows(case, *run("reference", case, inputs))
    n_codes, n_scales = assert_within_format_bound(got, want, merged, gs, f"seed {seed}")
    code_rate, scale_rate = n_codes / (case.m * case.k), n_scales / (case.m * case.k // 16)
    print(f"seed {seed}: codes differ on {code_rate:.2e} of the elements, scales on {scale_rate:.2e} of the blocks")
    assert code_rate < RATE and scale_rate < RATE
