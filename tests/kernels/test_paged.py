"""Attention over a paged KV cache: the float32 reference and the Triton kernels (half and fused NVFP4 output).

FlashAttention's / vLLM's paged varlen semantics: sequence ``b``'s queries are rows ``[cu[b], cu[b+1])`` of q, its
``Lk = seqused_k[b]`` keys the slots of the pages row ``b`` of the page table lists (key ``j`` is
``k_cache[page_table[b, j // page_size], j % page_size]``), causal aligned bottom-right, GQA; decode rows, prefills
without and after cached context, in one launch.

The batches are generated (:func:`paged_case`, a fresh seed per run, named in every failure) over a covering table
of row kinds x page sizes (1, 16 and 5) with every GQA group (1/2/4), head-dim pair (Dqk 48 = 32 + a 16-wide tail
dot with Dv 32, MLA's 192/128 scaled down for the interpreter; 32/32; 64/16), cache view (vLLM's FLASH_ATTN cache
split along its last dim, an HND cache seen through ``.transpose(1, 2)``, separate contiguous caches) and dtype
meeting every kind and page size. Page tables are shuffled over a pool larger than needed, their unused entries
garbage; unused slots of the last pages and unreferenced pages hold NaN; queries start past row 0.

Checked: the reference equals dense attention over the keys gathered here (exact); the Triton half / float32 /
log-sum-exp outputs lie within bounds derived from the half format of the reference's float32 attention; a paged
call writes the bytes of the varlen kernel over the same keys laid out contiguously (same blocks, same
arithmetic); the fused NVFP4 bytes are the reference quantization of the kernel's own float32 output (the varlen
kernel's contract, tests/nvfp4/test_nan_inf.py); rows outside the sequences keep their bytes; a NaN / Inf in a
key or value reaches only the rows that see it; the launchers' argument errors. On the CPU in Triton's
interpreter (tiny shapes), compiled on CUDA.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

import pytest
import torch

from fusion_pass import kernels, nvfp4
from fusion_pass.kernels import launchers, reference
from fusion_pass.kernels.triton import flash_attention as fa
from fusion_pass.kernels.triton import paged as pg

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
FP8 = torch.float8_e4m3fn
POISON = 0xAB

pytestmark = pytest.mark.skipif(
    not CUDA and not kernels.interpreter_enabled(),
    reason="no CUDA device and TRITON_INTERPRET is not set (conftest.py sets it on CPU-only machines)",
)

KINDS = ["decode", "prefill", "context", "mixed"]
PAGE_SIZES = [1, 16, 5]
GROUPS = [1, 2, 4]  # query heads per kv head
DIMS = [(48, 32), (32, 32), (64, 16)]  # (Dqk, Dv)
LAYOUTS = ["nhd_split", "hnd", "nhd"]
DTYPES = [torch.bfloat16, torch.float16]
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
LSE_ATOL = 1e-3  # tests/kernels/test_api.py's bound on the kernel's log-sum-exp


@dataclass(frozen=True)
class Shape:
    """One entry of the covering table: a row kind and page size with the other axes assigned so that each
    value of each axis meets every kind and every page size."""

    kind: str
    page_size: int
    group: int
    dims: tuple[int, int]
    layout: str
    causal: bool
    dtype: torch.dtype

    @property
    def id(self) -> str:
        d, dv = self.dims
        return (f"{self.kind}-p{self.page_size}-g{self.group}-d{d}v{dv}-{self.layout}-"
                f"{'causal' if self.causal else 'full'}-{str(self.dtype)[6:]}")


def covering_table() -> list[Shape]:
    shapes = []
    for k, kind in enumerate(KINDS):
        for p, page_size in enumerate(PAGE_SIZES):
            i = 3 * k + p
            shapes.append(Shape(kind, page_size, GROUPS[(p + k) % 3], DIMS[(p + 2 * k) % 3], LAYOUTS[(k + 2 * p) % 3],
                                causal=i % 4 != 3, dtype=DTYPES[i % 2]))
    return shapes


SHAPES = covering_table()


def test_the_covering_table_covers_every_axis_per_kind_and_page_size():
    for axis, values in (("group", GROUPS), ("dims", DIMS), ("layout", LAYOUTS)):
        for kind in KINDS:
            assert {getattr(s, axis) for s in SHAPES if s.kind == kind} == set(values), (axis, kind)
        for page_size in PAGE_SIZES:
            assert {getattr(s, axis) for s in SHAPES if s.page_size == page_size} == set(values), (axis, page_size)
    assert {s.dtype for s in SHAPES} == set(DTYPES) and {s.causal for s in SHAPES} == {True, False}


@dataclass
class PagedCase:
    """A generated batch and its tensors: ``q [row0 + sum(Lq) + tail, H, D]``, the caches (views of
    ``layout``), ``cu_seqlens`` (from ``row0``), ``seqused_k``, ``page_table``; the keys and values also laid
    out contiguously (``k``, ``v``, ``cu_seqlens_k``) as the varlen kernel takes them."""

    shape: Shape
    seed: int
    query_lens: list[int]
    key_lens: list[int]
    row0: int
    tail: int
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens: torch.Tensor
    seqused_k: torch.Tensor
    page_table: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_k: torch.Tensor

    def __str__(self) -> str:
        return (f"{self.shape.id} seed {self.seed}: Lq {self.query_lens}, Lk {self.key_lens}, row0 {self.row0}, "
                f"tail {self.tail}, {self.k_cache.shape[0]} pages")

    @property
    def rows(self) -> slice:
        return slice(self.row0, self.row0 + sum(self.query_lens))

    @property
    def scale(self) -> float:
        return 1 / math.sqrt(self.q.shape[2])

    def paged_args(self) -> dict:
        return dict(cu_seqlens=self.cu_seqlens, max_seqlen=max(self.query_lens), seqused_k=self.seqused_k,
                    page_table=self.page_table, max_seqlen_k=max(self.key_lens))


def lengths(kind: str, rng: random.Random) -> tuple[list[int], list[int]]:
    """Per sequence ``(Lq, Lk)`` of a batch of ``kind``; each kind has a sequence crossing a 16-key block."""
    if kind == "decode":
        key_lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 3))] + [rng.randint(17, 40)]
        query_lens = [1] * len(key_lens)
    elif kind == "prefill":
        query_lens = [rng.randint(1, 20) for _ in range(rng.randint(0, 2))] + [rng.randint(17, 24)]
        key_lens = list(query_lens)
    elif kind == "context":
        query_lens = [rng.randint(1, 20) for _ in range(rng.randint(0, 2))]
        key_lens = [lq + rng.randint(1, 24) for lq in query_lens]
        lq = rng.randint(2, 20)
        query_lens.append(lq)
        key_lens.append(lq + rng.randint(max(1, 17 - lq), 28))
    else:  # mixed: decode rows, a prefill, a prefill after context, a sequence without queries
        pairs = [(1, rng.randint(1, 40)), (1, rng.randint(17, 40))]
        lq = rng.randint(2, 20)
        pairs.append((lq, lq))
        lq = rng.randint(1, 16)
        pairs.append((lq, lq + rng.randint(1, 24)))
        pairs.append((0, rng.randint(1, 8)))
        rng.shuffle(pairs)
        query_lens, key_lens = [a for a, _ in pairs], [b for _, b in pairs]
    rng.shuffle(order := list(range(len(query_lens))))
    return [query_lens[i] for i in order], [key_lens[i] for i in order]


def make_caches(layout: str, num_pages: int, page_size: int, hkv: int, d: int, dv: int, dtype):
    """``(k_cache [P, S, Hkv, D], v_cache [P, S, Hkv, Dv])`` as views of the cache layout ``layout``, every
    element NaN."""
    nan = float("nan")
    if layout == "nhd_split":  # vLLM's FLASH_ATTN: [blocks, block_size, Hkv, D + Dv], keys then values
        kv = torch.full((num_pages, page_size, hkv, d + dv), nan, dtype=dtype, device=DEVICE)
        return kv.split([d, dv], dim=-1)
    if layout == "hnd":  # [blocks, Hkv, block_size, D + Dv] seen through .transpose(1, 2)
        kv = torch.full((num_pages, hkv, page_size, d + dv), nan, dtype=dtype, device=DEVICE)
        return kv.transpose(1, 2).split([d, dv], dim=-1)
    return (torch.full((num_pages, page_size, hkv, d), nan, dtype=dtype, device=DEVICE),
            torch.full((num_pages, page_size, hkv, dv), nan, dtype=dtype, device=DEVICE))


def paged_case(shape: Shape, seed: int) -> PagedCase:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    query_lens, key_lens = lengths(shape.kind, rng)
    hkv = 1 if shape.group == 4 else rng.choice([1, 2])
    h = hkv * shape.group
    d, dv = shape.dims
    page_size = shape.page_size
    pages_per_seq = [-(-lk // page_size) for lk in key_lens]
    num_pages = sum(pages_per_seq) + rng.randint(2, 6)  # a shared pool larger than needed
    pool = list(range(num_pages))
    rng.shuffle(pool)
    width = max(pages_per_seq) + rng.randint(0, 2)
    # unused entries: garbage the kernels must not read (out of range, negative, or some other sequence's page)
    table = [[rng.choice([-1, num_pages + 7, 2**30, rng.randrange(num_pages)]) for _ in range(width)]
             for _ in key_lens]
    for b, n in enumerate(pages_per_seq):
        table[b][:n] = [pool.pop() for _ in range(n)]
    k_cache, v_cache = make_caches(shape.layout, num_pages, page_size, hkv, d, dv, shape.dtype)
    k = torch.randn(sum(key_lens), hkv, d, generator=gen).to(DEVICE, shape.dtype)
    v = torch.randn(sum(key_lens), hkv, dv, generator=gen).to(DEVICE, shape.dtype)
    page_of, slot_of = [], []
    for b, lk in enumerate(key_lens):
        page_of += [table[b][j // page_size] for j in range(lk)]
        slot_of += [j % page_size for j in range(lk)]
    page_of = torch.tensor(page_of, dtype=torch.long, device=DEVICE)
    slot_of = torch.tensor(slot_of, dtype=torch.long, device=DEVICE)
    k_cache[page_of, slot_of] = k  # through the view: the layout's buffer; every other slot stays NaN
    v_cache[page_of, slot_of] = v
    row0, tail = rng.randint(1, 5), rng.randint(1, 3)
    t = row0 + sum(query_lens) + tail
    q = torch.randn(t, h, d, generator=gen).to(DEVICE, shape.dtype)

    def int32(values):
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    return PagedCase(
        shape, seed, query_lens, key_lens, row0, tail, q, k_cache, v_cache,
        cu_seqlens=int32(list(itertools.accumulate(query_lens, initial=row0))),
        seqused_k=int32(key_lens), page_table=int32(table), k=k, v=v,
        cu_seqlens_k=int32(list(itertools.accumulate(key_lens, initial=0))),
    )


def fresh_case(shape: Shape) -> PagedCase:
    return paged_case(shape, random.SystemRandom().randrange(2**31))


def test_generated_cases_are_what_they_say():
    for shape in SHAPES:
        for seed in range(20):
            case = paged_case(shape, seed)
            pairs = list(zip(case.query_lens, case.key_lens))
            assert all(lk >= lq for lq, lk in pairs) and max(case.key_lens) > 16, str(case)
            assert case.cu_seqlens[0].item() == case.row0 > 0 and case.tail > 0
            needed = [-(-lk // shape.page_size) for lk in case.key_lens]
            used = {p for row, n in zip(case.page_table.tolist(), needed) for p in row[:n]}
            assert len(used) == sum(needed) < case.k_cache.shape[0], "distinct pages from a larger pool"
            kinds = {"decode": lambda lq, lk: lq == 1, "prefill": lambda lq, lk: lq == lk,
                     "context": lambda lq, lk: lk > lq}
            if shape.kind in kinds:
                assert all(kinds[shape.kind](lq, lk) for lq, lk in pairs), str(case)
            else:
                assert all(any(test(lq, lk) for lq, lk in pairs) for test in kinds.values()), str(case)
                assert any(lq == 0 for lq, _ in pairs), str(case)
            if shape.kind in ("context", "mixed"):
                assert any(lq > 1 for lq, _ in pairs), "the non-finite test needs a query before a key"
    hnd = paged_case(next(s for s in SHAPES if s.layout == "hnd" and s.page_size > 1), 0)
    assert hnd.k_cache.stride(1) < hnd.k_cache.stride(2), "the HND view has heads outside the slots"
    split = paged_case(next(s for s in SHAPES if s.layout == "nhd_split"), 0)
    assert split.k_cache.data_ptr() + split.k_cache.shape[-1] * split.k_cache.element_size() == \
        split.v_cache.data_ptr(), "keys then values in one buffer's last dim"


# ---------------------------------------------------------------------------
# the reference
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.id)
def test_reference_is_dense_attention_over_the_gathered_keys(shape):
    """Exactly :func:`reference.dense_attention` per sequence over the keys gathered here (``q_offset = Lk -
    Lq``), zeros / -inf outside the sequences, finite (the NaN in unused slots and pages is never read)."""
    case = fresh_case(shape)
    for causal in (True, False):
        out, lse = reference.paged_attention(case.q, case.k_cache, case.v_cache, case.cu_seqlens, case.seqused_k,
                                             case.page_table, causal, case.scale)
        want_out = torch.zeros(out.shape, device=DEVICE)
        want_lse = torch.full(lse.shape, float("-inf"), device=DEVICE)
        bounds = list(itertools.accumulate(case.query_lens, initial=case.row0))
        bounds_k = list(itertools.accumulate(case.key_lens, initial=0))
        for (a, b), (ka, kb) in zip(itertools.pairwise(bounds), itertools.pairwise(bounds_k)):
            if b > a:
                want_out[a:b], want_lse[a:b] = reference.dense_attention(
                    case.q[a:b], case.k[ka:kb], case.v[ka:kb], scale=case.scale, causal=causal,
                    q_offset=(kb - ka) - (b - a))
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse), f"causal={causal} ({case})"
        assert out.isfinite().all(), str(case)
    gathered, cu_k = reference.gather_paged(case.v_cache, case.seqused_k, case.page_table)
    assert torch.equal(gathered, case.v) and torch.equal(cu_k, case.cu_seqlens_k)


def test_reference_refuses_a_page_table_row_too_short():
    case = paged_case(SHAPES[1], 0)
    short = case.page_table[:, :1].contiguous()
    with pytest.raises(ValueError, match=r"sequence \d+: \d+ keys need \d+ pages of 16 slots; its page_table row "
                                         r"lists 1"):
        reference.paged_attention(case.q, case.k_cache, case.v_cache, case.cu_seqlens, case.seqused_k, short,
                                  True, 0.1)
    with pytest.raises(ValueError, match=r"cu_seqlens has \d+ entries for \d+ sequences"):
        reference.paged_attention(case.q, case.k_cache, case.v_cache, case.cu_seqlens[:-1], case.seqused_k,
                                  case.page_table, True, 0.1)


# ---------------------------------------------------------------------------
# the Triton kernels
# ---------------------------------------------------------------------------


def assert_within_half_bound(got, ref, pv_abs, dtype, what):
    """``|got - ref| <= 2u * (P|V| + |ref|) + 3e-5`` per element, ``u`` the unit roundoff of ``dtype`` (``2u``
    its relative ulp): the kernel feeds ``P`` to ``P @ V`` in the half dtype (each weight off by at most one ulp
    relative, so the output by ``2u * sum_j p_j |v_j| / l = 2u * P|V|``), then converts the output to it (one
    ulp, ``2u * |out|``; float32 output: 0). One ulp, not half of one: Triton's interpreter converts float32 to
    bfloat16 by truncation; compiled code rounds to nearest and has half of each term. 3e-5 covers half
    subnormal weights and the float32 arithmetic (scores, exp2, sums)."""
    u = UNIT_ROUNDOFF[dtype]
    rounding = ref.abs() if got.dtype != torch.float32 else 0.0
    bound = 2 * u * (pv_abs + rounding) + 3e-5
    err = (got.float() - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{what}: error {err.max().item():.3e}, {worst:.2f} x the bound"


def nvfp4_bytes(packed, scales, case):
    """``(packed [T, K/2], linear scale bytes [T, K/16])`` on the CPU."""
    t, width = case.q.shape[0], case.q.shape[1] * case.v_cache.shape[-1]
    linear = nvfp4.unswizzle_scales(scales.view(torch.uint8).view(FP8).reshape(-1, nvfp4.round_up(width // 16, 4))
                                    .cpu(), t, width // 16)
    return packed.view(torch.uint8).cpu(), linear.view(torch.uint8)


def poisoned_nvfp4(case, poison, int32_scales):
    t, width = case.q.shape[0], case.q.shape[1] * case.v_cache.shape[-1]
    rows, cols = nvfp4.scale_shape(t, width)
    packed = torch.full((t, width // 2), poison, dtype=torch.uint8, device=DEVICE)
    scales = torch.full((rows, cols), poison, dtype=torch.uint8, device=DEVICE)
    return packed, scales.view(torch.int32) if int32_scales else scales


def assert_rows_kept(packed, scales, case, poison, what):
    """Rows outside the sequences keep ``poison``, the scale padding (rows ``>= T``, columns ``>= K/16``) is 0."""
    t, width = case.q.shape[0], case.q.shape[1] * case.v_cache.shape[-1]
    rows, cols = nvfp4.scale_shape(t, width)
    full = nvfp4.unswizzle_scales(scales.view(torch.uint8).view(FP8).reshape(rows, cols).cpu(), rows, cols)
    full = full.view(torch.uint8)
    a, e = case.rows.start, case.rows.stop
    outside = torch.cat([packed.view(torch.uint8)[:a].cpu(), packed.view(torch.uint8)[e:].cpu()])
    assert (outside == poison).all(), f"{what}: packed bytes outside rows [{a}, {e}) written ({case})"
    blocks = width // 16
    assert (full[:a, :blocks] == poison).all() and (full[e:t, :blocks] == poison).all(), (
        f"{what}: scales outside rows [{a}, {e}) written ({case})")
    assert not full[t:].any() and not full[:, blocks:].any(), f"{what}: scale padding not zero ({case})"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.id)
def test_triton_paged_kernels(shape):
    """One generated batch, every kernel output:

    - half (q's dtype), float32 and log-sum-exp outputs into NaN-poisoned buffers: rows outside the sequences
      stay NaN, the others are within :func:`assert_within_half_bound` of the reference (LSE within
      :data:`LSE_ATOL`), finite (the NaN in unused slots / pages and the garbage table entries are not read);
    - the varlen kernel over the same keys laid out contiguously (``cu_seqlens_k``) writes the same bytes
      (float32, LSE, NVFP4);
    - the fused NVFP4 bytes (:func:`launchers.flash_attention_nvfp4_paged` into vLLM's int32 scale buffer) are
      the reference quantization of the kernel's own float32 output, in every block in the interpreter, in the
      NaN / Inf blocks on CUDA (as the varlen kernel's, tests/nvfp4/test_nan_inf.py); rows outside keep their
      poison, the scale padding is 0; the varlen kernel's bytes, written into buffers of another poison, are
      the same in every row of the sequences (so every byte is written);
    - :func:`launchers.reference_nvfp4_paged` writes the reference quantization of the float32 reference into
      the same rows, nothing else but the padding.
    """
    case = fresh_case(shape)
    causal, dtype = shape.causal, shape.dtype
    q, t, h, dv = case.q, case.q.shape[0], case.q.shape[1], case.v_cache.shape[-1]
    rows = case.rows
    args = case.paged_args()
    ref, ref_lse = reference.paged_attention(q, case.k_cache, case.v_cache, case.cu_seqlens, case.seqused_k,
                                             case.page_table, causal, case.scale)
    pv_abs, _ = reference.paged_attention(q, case.k_cache, case.v_cache.abs(), case.cu_seqlens, case.seqused_k,
                                          case.page_table, causal, case.scale)

    half = pg.flash_attention_paged(q, case.k_cache, case.v_cache, causal=causal, softmax_scale=case.scale,
                                    out=torch.full((t, h, dv), float("nan"), dtype=dtype, device=DEVICE), **args)
    out32 = torch.full((t, h, dv), float("nan"), device=DEVICE)
    lse = torch.full((h, t), float("nan"), device=DEVICE).t()  # a transposed [H, T] buffer, as FA4 returns it
    pg.flash_attention_paged(q, case.k_cache, case.v_cache, causal=causal, softmax_scale=case.scale, out=out32,
                             lse=lse, **args)
    for name, got in (("half", half), ("float32", out32), ("lse", lse)):
        outside = torch.cat([got[: rows.start], got[rows.stop :]])
        assert outside.isnan().all(), f"{name}: rows outside the sequences were written ({case})"
        assert got[rows].isfinite().all(), f"{name}: non-finite or unwritten elements ({case})"
    assert_within_half_bound(half[rows].cpu(), ref[rows].cpu(), pv_abs[rows].cpu(), dtype, f"half ({case})")
    assert_within_half_bound(out32[rows].cpu(), ref[rows].cpu(), pv_abs[rows].cpu(), dtype, f"float32 ({case})")
    lse_err = (lse[rows] - ref_lse[rows]).abs().max().item()
    assert lse_err <= LSE_ATOL, f"log-sum-exp off by {lse_err:.2e} ({case})"
    # the half output is the float32 one converted (rounded to nearest compiled, truncated by the interpreter)
    ulp = 2 * UNIT_ROUNDOFF[dtype] * out32[rows].abs() + 2.0**-24  # + float16's subnormal step
    assert torch.equal(half[rows], out32[rows].to(dtype)) if CUDA else \
        ((half[rows].float() - out32[rows]).abs() <= ulp).all(), f"half output != float32 output converted ({case})"

    dense = dict(cu_seqlens_k=case.cu_seqlens_k, max_seqlen_k=max(case.key_lens), causal=causal,
                 softmax_scale=case.scale)
    out32_dense = torch.full_like(out32, float("nan"))
    lse_dense = torch.full((t, h), float("nan"), device=DEVICE)
    fa.flash_attention(q, case.k, case.v, case.cu_seqlens, max(case.query_lens), out=out32_dense, lse=lse_dense,
                       **dense)
    assert torch.equal(out32[rows], out32_dense[rows]) and torch.equal(lse[rows], lse_dense[rows]), (
        f"paged and contiguous keys: float32 / LSE bytes differ ({case})")

    if not causal:
        return  # the fused path is causal (the NVFP4 epilogue itself is the one checked above)
    gs = torch.tensor([448 * 6 / ref[rows].abs().max().item()], dtype=torch.float32, device=DEVICE)
    fused = dict(args, softmax_scale=case.scale, causal=True, output_scale=gs)
    packed, scales = poisoned_nvfp4(case, POISON, int32_scales=True)  # vLLM's allocation
    launchers.flash_attention_nvfp4_paged(q, case.k_cache, case.v_cache, output=packed, output_block_scale=scales,
                                          **fused)
    assert_rows_kept(packed, scales, case, POISON, "fused")
    packed, sf = nvfp4_bytes(packed, scales, case)

    own_packed, own_sf = nvfp4.quantize(out32[rows].reshape(-1, h * dv), gs, swizzled=False)
    same = (sf[rows] == own_sf.view(torch.uint8).cpu()) & (
        nvfp4.unpack_codes(packed[rows]) == nvfp4.unpack_codes(own_packed.cpu())).reshape(sf[rows].shape + (16,)).all(-1)
    assert same.all() if not CUDA else same[own_sf.view(torch.uint8).cpu() >= 0x7E].all(), (
        f"fused bytes differ from quantize(own float32 output) in {int((~same).sum())} blocks ({case})")

    # the varlen kernel into buffers of another poison: equal rows are every byte written by both
    dense_packed, dense_scales = poisoned_nvfp4(case, 0x00, int32_scales=False)
    got = fa.flash_attention_nvfp4(q, case.k, case.v, case.cu_seqlens, max(case.query_lens), gs, packed=dense_packed,
                                   scales=dense_scales, **dense)
    assert got[0].data_ptr() == dense_packed.data_ptr() and got[1].data_ptr() == dense_scales.data_ptr()
    dense_packed, dense_sf = nvfp4_bytes(dense_packed, dense_scales, case)
    assert torch.equal(packed[rows], dense_packed[rows]) and torch.equal(sf[rows], dense_sf[rows]), (
        f"paged and contiguous keys: NVFP4 bytes differ ({case})")

    ref_packed, ref_scales = poisoned_nvfp4(case, POISON, True)
    launchers.reference_nvfp4_paged(q, case.k_cache, case.v_cache, output=ref_packed, output_block_scale=ref_scales,
                                    **fused)
    assert_rows_kept(ref_packed, ref_scales, case, POISON, "reference")
    want_packed, want_sf = nvfp4.quantize(ref[rows].reshape(-1, h * dv), gs, swizzled=False)
    ref_packed, ref_sf = nvfp4_bytes(ref_packed, ref_scales, case)
    assert torch.equal(ref_packed[rows], want_packed.cpu()) and torch.equal(ref_sf[rows],
                                                                            want_sf.view(torch.uint8).cpu()), str(case)


# ---------------------------------------------------------------------------
# non-finite values: they reach exactly the rows that see them
# ---------------------------------------------------------------------------

NON_FINITE_SHAPES = [s for s in SHAPES if s.causal and s.kind in ("context", "mixed")]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's 0 * Inf
@pytest.mark.parametrize("shape", NON_FINITE_SHAPES, ids=lambda s: s.id)
def test_non_finite_key_or_value_reaches_only_the_rows_that_see_it(shape):
    """A NaN / +Inf / -Inf in the value of one key (and, in a second run, a NaN in the key itself) of a
    sequence with queries: the rows that do not see that key (causally hidden: queries before it; other
    sequences) get the bytes they get without it (half and NVFP4 output; the key: half); the rows that see it are NaN / Inf
    where the reference's are (value poisoning; NVFP4: NaN blocks 0x7F and saturated blocks 0x7E where the
    reference's are); NaN in unused slots and unreferenced pages (always there) reaches none."""
    case = fresh_case(shape)
    rng = random.Random(case.seed)
    candidates = [b for b, (lq, lk) in enumerate(zip(case.query_lens, case.key_lens)) if lq > 1]
    b = rng.choice(candidates)
    lq, lk = case.query_lens[b], case.key_lens[b]
    key = rng.randrange(lk - lq + 1, lk)  # seen by the sequence's queries from (key - (lk - lq)) on
    page, slot = case.page_table[b, key // shape.page_size].item(), key % shape.page_size
    first = case.row0 + sum(case.query_lens[:b])
    sees = torch.zeros(case.q.shape[0], dtype=torch.bool)
    sees[first + key - (lk - lq): first + lq] = True
    hidden = ~sees
    hidden[: case.row0] = hidden[case.rows.stop:] = False
    t, h, dv = case.q.shape[0], case.q.shape[1], case.v_cache.shape[-1]
    gs = torch.tensor([448 * 6 / 4.0], dtype=torch.float32, device=DEVICE)
    common = dict(causal=True, softmax_scale=case.scale, **case.paged_args())

    def run(k_cache, v_cache, fused=True):
        half = pg.flash_attention_paged(case.q, k_cache, v_cache, **common).cpu()
        if not fused:
            return (half,)
        args = case.paged_args()
        packed, scales = pg.flash_attention_nvfp4_paged(case.q, k_cache, v_cache, args["cu_seqlens"],
                                                        args["max_seqlen"], args["seqused_k"], args["page_table"],
                                                        args["max_seqlen_k"], gs, causal=True,
                                                        softmax_scale=case.scale)
        return half, *nvfp4_bytes(packed, scales, case)

    clean = run(case.k_cache, case.v_cache)
    hkv = case.v_cache.shape[2]
    saved_v, saved_k = case.v_cache[page, slot].clone(), case.k_cache[page, slot].clone()
    case.v_cache[page, slot, hkv - 1, 3] = float("nan")
    case.v_cache[page, slot, 0, dv - 2] = float("inf")
    case.v_cache[page, slot, 0, 5] = float("-inf")
    got = run(case.k_cache, case.v_cache)
    want, _ = reference.paged_attention(case.q, case.k_cache, case.v_cache, case.cu_seqlens, case.seqused_k,
                                        case.page_table, True, case.scale)
    want = want.cpu()
    for name, a, c in zip(("half", "packed", "scales"), got, clean):
        assert torch.equal(a[hidden], c[hidden]), f"value poison: {name} of rows that cannot see it changed ({case})"
    for kind in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(kind(got[0][case.rows]), kind(want[case.rows])), (
            f"{kind.__name__} differs from the reference ({case})")
    assert got[0][sees].isnan().any(), f"the NaN did not reach the rows that see it ({case})"
    want_sf = nvfp4.quantize(want[case.rows].reshape(-1, h * dv), gs.cpu(), swizzled=False)[1].view(torch.uint8)
    for special in (0x7F, 0x7E):
        assert torch.equal(got[2][case.rows] == special, want_sf == special), (
            f"scale byte {special:#x} blocks differ from the reference ({case})")

    case.v_cache[page, slot] = saved_v
    case.k_cache[page, slot, hkv - 1, 1] = float("nan")
    got = run(case.k_cache, case.v_cache, fused=False)
    for name, a, c in zip(("half", "packed", "scales"), got, clean):
        assert torch.equal(a[hidden], c[hidden]), f"key poison: {name} of rows that cannot see it changed ({case})"
    assert got[0][sees].isnan().any(), f"the key's NaN did not reach the rows that see it ({case})"
    case.k_cache[page, slot] = saved_k


def test_garbage_outside_the_sequences_keys_changes_no_byte():
    """The same batch with the unused slots, unreferenced pages and unused page-table entries holding zeros /
    valid page ids instead of NaN / garbage, in contiguous caches instead of the HND view: every byte of the
    sequences' rows the same (float32 output with LSE, NVFP4)."""
    case = fresh_case(next(s for s in SHAPES if s.kind == "mixed" and s.page_size == 5))
    gs = torch.tensor([448 * 6 / 4.0], dtype=torch.float32, device=DEVICE)
    t, h, dv = case.q.shape[0], case.q.shape[1], case.v_cache.shape[-1]

    def run(k_cache, v_cache, page_table):
        args = dict(case.paged_args(), page_table=page_table)
        out = torch.zeros(t, h, dv, device=DEVICE)
        lse = torch.zeros(t, h, device=DEVICE)
        pg.flash_attention_paged(case.q, k_cache, v_cache, causal=True, out=out, lse=lse, **args)
        packed, scales = pg.flash_attention_nvfp4_paged(case.q, k_cache, v_cache, args["cu_seqlens"],
                                                        args["max_seqlen"], args["seqused_k"], page_table,
                                                        args["max_seqlen_k"], gs, causal=True)
        return tuple(x[case.rows] for x in (out.cpu(), lse.cpu(), *nvfp4_bytes(packed, scales, case)))

    dirty = run(case.k_cache, case.v_cache, case.page_table)
    table = case.page_table.clone()
    used = [-(-lk // 5) for lk in case.key_lens]
    for b, n in enumerate(used):
        table[b, n:] = 0
    k_cache, v_cache = (torch.nan_to_num(c, nan=0.0) for c in (case.k_cache, case.v_cache))
    clean = run(k_cache, v_cache, table)
    for name, a, c in zip(("out", "lse", "packed", "scales"), dirty, clean):
        assert torch.equal(a, c), f"{name} changed with the garbage ({case})"
    assert dirty[0].isfinite().all()


def test_decode_row_over_many_pages_sees_its_last_key_only_once():
    """One decode row over 3 blocks of 16 keys on pages of 1 key, in reverse order in the cache, and the varlen
    kernel on the same keys: the same bytes; the reference within the half bound."""
    gen = torch.Generator().manual_seed(1)
    lk = 45
    q = torch.randn(1, 2, 32, generator=gen).to(DEVICE, torch.bfloat16)
    k = torch.randn(lk, 1, 32, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(lk, 1, 32, generator=gen).to(DEVICE, torch.bfloat16)
    k_cache, v_cache = k.flip(0)[:, None], v.flip(0)[:, None]  # [45 pages, 1 slot, 1, 32]
    table = torch.arange(lk - 1, -1, -1, dtype=torch.int32, device=DEVICE)[None]
    cu = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    used = torch.tensor([lk], dtype=torch.int32, device=DEVICE)
    out = torch.empty(1, 2, 32, device=DEVICE)
    pg.flash_attention_paged(q, k_cache, v_cache, cu, 1, used, table, lk, out=out)
    want = torch.empty_like(out)
    fa.flash_attention(q, k, v, cu, 1, out=want, cu_seqlens_k=torch.tensor([0, lk], dtype=torch.int32,
                                                                              device=DEVICE), max_seqlen_k=lk)
    assert torch.equal(out, want)
    ref, _ = reference.paged_attention(q, k_cache, v_cache, cu, used, table, True, 32**-0.5)
    pv_abs, _ = reference.paged_attention(q, k_cache, v_cache.abs(), cu, used, table, True, 32**-0.5)
    assert_within_half_bound(out.cpu(), ref.cpu(), pv_abs.cpu(), torch.bfloat16, "decode row")


# ---------------------------------------------------------------------------
# argument checks of the launchers (shapes only: nothing read back)
# ---------------------------------------------------------------------------


def _bad_args():
    q = torch.zeros(10, 4, 32, dtype=torch.bfloat16, device=DEVICE)
    kv = torch.zeros(6, 16, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    k_cache, v_cache = kv.split(32, dim=-1)
    rows, cols = nvfp4.scale_shape(10, 4 * 32)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache,
                cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE), max_seqlen=6,
                seqused_k=torch.tensor([20, 6], dtype=torch.int32, device=DEVICE),
                page_table=torch.tensor([[3, 1], [0, 5]], dtype=torch.int32, device=DEVICE), max_seqlen_k=20,
                softmax_scale=0.1, causal=True, output=torch.zeros(10, 64, dtype=torch.uint8, device=DEVICE),
                output_scale=torch.ones(1, device=DEVICE),
                output_block_scale=torch.zeros(rows, cols // 4, dtype=torch.int32, device=DEVICE))


_BAD = [
    (lambda a: {"q": a["q"][0]}, r"q must be a 3-D tensor \[T, H, D\]"),
    (lambda a: {"k_cache": a["k_cache"][0]}, r"k_cache must be a 4-D tensor \[num_pages, page_size, Hkv, D\]"),
    (lambda a: {"v_cache": a["v_cache"].float()}, r"v_cache must be float16 or bfloat16, got torch.float32"),
    (lambda a: {"k_cache": a["k_cache"].half()}, r"q, k_cache, v_cache must share one dtype"),
    (lambda a: {"k_cache": a["k_cache"].transpose(2, 3)}, r"k_cache must have unit stride along its last"),
    (lambda a: {"k_cache": a["k_cache"][..., :16]}, r"k_cache must be \[num_pages, page_size, Hkv, D\] with q's "
                                                    r"D=32"),
    (lambda a: {"v_cache": a["v_cache"][:5]}, r"v_cache must be \[num_pages, page_size, Hkv, Dv\] = \[6, 16, 2, "
                                              r"Dv\] like k_cache"),
    (lambda a: {"q": torch.zeros(10, 3, 32, dtype=torch.bfloat16, device=DEVICE)},
     r"q's heads H=3 must be a multiple of the caches' heads Hkv=2"),
    (lambda a: {"v_cache": a["v_cache"][..., :8]}, r"v_cache's head dim must be divisible by 16, got 8"),
    (lambda a: {"cu_seqlens": a["cu_seqlens"].long()}, r"cu_seqlens must be contiguous int32 \[B \+ 1 >= 2\]"),
    (lambda a: {"seqused_k": a["seqused_k"][:1]}, r"seqused_k must be contiguous int32 \[B = 2\]"),
    (lambda a: {"seqused_k": a["seqused_k"].long()}, r"seqused_k must be contiguous int32"),
    (lambda a: {"page_table": a["page_table"][:1]}, r"page_table must be int32 \[B = 2, max_pages_per_seq\]"),
    (lambda a: {"page_table": a["page_table"].t()}, r"page_table must be int32 .* unit stride along its last dim"),
    (lambda a: {"page_table": a["page_table"][0]}, r"page_table must be int32 \[B = 2, max_pages_per_seq\]"),
    (lambda a: {"max_seqlen_k": -1}, r"max_seqlen_k must be a non-negative int"),
]


@pytest.mark.parametrize("launcher", ["flash_attention_nvfp4_paged", "reference_nvfp4_paged"])
@pytest.mark.parametrize("change,match", _BAD)
def test_launchers_reject_bad_shapes_before_writing(launcher, change, match):
    args = _bad_args()
    args.update(change(args))
    before = args["output"].clone(), args["output_block_scale"].clone()
    with pytest.raises(ValueError, match=f"{launcher}: {match}"):
        getattr(launchers, launcher)(**args)
    assert torch.equal(args["output"], before[0]) and torch.equal(args["output_block_scale"], before[1])


def test_launchers_accept_the_bad_args_base_case():
    """The base of :data:`_BAD` is valid: both launchers run it, each within twice the format's error bound (plus
    the half bound's share) of the float32 reference."""
    args = _bad_args()
    gen = torch.Generator().manual_seed(0)
    args["q"] = torch.randn(args["q"].shape, generator=gen).to(DEVICE, torch.bfloat16)
    kv = torch.randn(6, 16, 2, 64, generator=gen).to(DEVICE, torch.bfloat16)
    args["k_cache"], args["v_cache"] = kv.split(32, dim=-1)
    args["output_scale"] = torch.tensor([448 * 6 / 2.0], device=DEVICE)
    ref, _ = reference.paged_attention(args["q"], args["k_cache"], args["v_cache"], args["cu_seqlens"],
                                       args["seqused_k"], args["page_table"], True, 0.1)
    ref = ref.reshape(10, -1).cpu()
    gs = args["output_scale"].cpu()
    bound = 2 * nvfp4.error_bound(ref, gs).double() + 2.0**-6
    ref = ref.double()
    for launcher in (launchers.flash_attention_nvfp4_paged, launchers.reference_nvfp4_paged):
        args["output"].zero_(), args["output_block_scale"].zero_()
        launcher(**args)
        deq = nvfp4.dequantize(args["output"].cpu(), args["output_block_scale"].view(FP8).cpu(), gs).double()
        assert ((deq - ref).abs() <= bound).all(), launcher.__name__


def test_no_key_anywhere():
    """Non-causal rows over an empty cache (no page, ``seqused_k`` 0, an empty page table): output 0, LSE -inf,
    as the reference; NVFP4 zero codes and scales in the sequences' rows."""
    q = torch.ones(5, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    k_cache = torch.empty(0, 16, 1, 32, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.empty(0, 16, 1, 16, dtype=torch.bfloat16, device=DEVICE)
    cu = torch.tensor([1, 3, 4], dtype=torch.int32, device=DEVICE)
    used = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    table = torch.empty(2, 0, dtype=torch.int32, device=DEVICE)
    out = torch.full((5, 2, 16), float("nan"), device=DEVICE)
    lse = torch.full((5, 2), float("nan"), device=DEVICE)
    pg.flash_attention_paged(q, k_cache, v_cache, cu, 2, used, table, 0, causal=False, out=out, lse=lse)
    ref, ref_lse = reference.paged_attention(q, k_cache, v_cache, cu, used, table, False, 0.1)
    assert not out[1:4].any() and lse[1:4].isneginf().all()
    assert torch.equal(ref[1:4], out[1:4]) and torch.equal(ref_lse[1:4], lse[1:4])
    assert out[0].isnan().all() and out[4].isnan().all()
    packed, scales = pg.flash_attention_nvfp4_paged(q, k_cache, v_cache, cu, 2, used, table, 0,
                                                    torch.ones(1, device=DEVICE), causal=False)
    assert not packed[1:4].any() and not nvfp4.unswizzle_scales(scales.cpu(), 5, 2)[1:4].view(torch.uint8).any()
