"""FA4 on Hopper, every entry point: a NaN / +Inf in one token's value or key must not reach the rows that cannot
see that token (the Triton kernel's fix and its tests: ``test_flash_nonfinite.py``; docs/design.md, "A NaN or an
infinity in the inputs").

The hazard: a key a row does not see is masked to probability ``P = 0``, and ``0 * NaN`` (or ``0 * Inf``) is NaN in
the ``P @ V`` product, so any value row the kernel *loads* into a tile can poison every row of that tile.

Cases (generated: lengths and the poisoned spot drawn from a fresh seed per test, printed in every message and
replayable with ``FUSION_PASS_TEST_SEED``): causal varlen batches of 1-3 sequences whose lengths cover FA4's tile
edges (1, 7, 63, 64, 65, 130, 200); one element of token ``j`` of one sequence set to NaN, or separately to +Inf, in
V, or separately in K. Entry points, all ``backend="fa4"`` / FA4's SM90 kernels:

* ``half``: :func:`fusion_pass.kernels.attention` (FA4's forward, the twin; bf16 out);
* ``nvfp4``: :func:`fusion_pass.kernels.attention_nvfp4` (packed codes and the unswizzled block scales);
* ``fp8_static``: :func:`fusion_pass.kernels.attention_fp8_static`; ``fp8_group``:
  :func:`fusion_pass.kernels.attention_fp8_group` (bytes and float32 scales; ``Dv % 128 == 0`` head dims only);
* ``paged_half`` / ``paged_nvfp4``: :func:`fusion_pass.kernels.fa4.forward.fa4_attention_paged` /
  ``fa4_attention_nvfp4_paged`` over a paged cache of 16-row pages (FA4's predicated cp.async loads) and of
  ``tile_n``-row pages (128: whole-page TMA loads), prefills with and without cached context and decode rows mixed;
  the poison in a key of one sequence (``token``) or in the stale slot just past a sequence's last key on its last
  page (``slot``: no row sees it).

What each case checks, for the *hidden* rows (rows ``i < j`` of the poisoned sequence, ``i + Lk - Lq < j`` with
cached context; and every row of every other sequence; every row for ``slot``):

1. their bytes (bf16 output, NVFP4 codes and scale bytes, FP8 bytes and group scales) equal, byte for byte, those
   of the same entry point run on the same inputs with the poisoned element replaced by a finite value;
2. they are finite (bf16: ``isfinite``; NVFP4: no NaN / saturated block scale ``0x7F`` / ``0x7E``; FP8 static:
   no ``±448`` / NaN byte; FP8 group: finite scales; the scales are chosen so a finite row never saturates);
3. bf16 entries: they are within bf16 rounding of the float32 ``reference`` backend on the poisoned inputs (which
   masks exactly, ``kernels.reference.dense_attention``), i.e. the reference computed without the bad token.

What is expected of the rows that see token ``j`` (``i >= j``): non-finite where the poison enters the products.
Checked only as "the poison arrived": a V poison makes column ``c`` of the query heads of the poisoned KV head
non-finite in every such row (NaN for NaN; +Inf, or NaN where ``P`` underflowed, for +Inf), a NaN key makes
those heads' rows non-finite; a +Inf key gives ``±Inf`` scores (``+Inf`` -> NaN rows, ``-Inf`` -> the key drops
out), so for it only some seeing row must change. Their exact bytes are not compared (the reference differs there
in documented ways: docs/design.md "A NaN or an infinity in the inputs").

The leak and its fix. FA4 4.0.0b36's SM90 main loop multiplies masked ``P = 0`` by every value row it loaded:
:func:`_varlen_leak_model` / :func:`_paged_leak_model` predict exactly which rows compute with the poisoned value
row (every row of each query tile that loads it; a varlen sequence's last key tile also loads the next sequence's
first rows; a 128-row page is loaded whole, a 16-row page only up to the sequence's end; their docstrings say where
in FA4). Every project SM90 kernel (the twin and the fused ones) puts back, before its epilogue, the elements that
product turned into NaN (:mod:`fusion_pass.kernels.fa4.sm90_exact`): recomputed in float32 over the keys the row
sees. So, while :data:`FA4_MULTIPLIES_MASKED_VALUES` says the kernels put back:

* every hidden row is finite (item 2 above);
* a hidden row outside the model keeps its bytes exactly (item 1); one inside it may differ from the clean run by
  the put-back's rounding (float32 probabilities where FA4 rounds them to the query dtype), nowhere else;
* bf16 entries: the hidden rows within bf16 rounding of the reference (item 3);
* quantized entries: the fused bytes equal the format's reference quantizer of the twin's output on the same
  poisoned inputs, every row (the kernels' contract, poison and put-back included).

With the flag False for a kind (the put-back removed), a changed hidden row of the model xfails (strict) as FA4's
known leak, any other fails (:class:`HiddenRowsChanged`). K poison is expected never to leak (FA4 overwrites masked
scores with ``-inf``, a select, NaN included).

GPU only: an SM90 device (H100/H200) with FA4 (the ``fa4`` extra); skipped otherwise, with the reason.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from fusion_pass import fp8, kernels, nvfp4
from fusion_pass.kernels import reference
from fusion_pass.kernels.fa4 import forward as fa4_forward, sm90

from sm90_gpu import gpu  # noqa: E402

pytestmark = gpu

FA4_MULTIPLIES_MASKED_VALUES = {"varlen": True, "paged": True}
"""Per kind of call: FA4's SM90 ``P @ V`` multiplies the masked probabilities 0 by every value row loaded into the
tile (the rows :func:`_varlen_leak_model` / :func:`_paged_leak_model` predict)."""

KERNELS_PUT_BACK = {"varlen": True, "paged": True}
"""Per kind of call: the project's SM90 kernels put back what that product turned into NaN
(:mod:`fusion_pass.kernels.fa4.sm90_exact`). False: the model's rows are expected to leak (strict xfail)."""

LENGTHS = (1, 7, 63, 64, 65, 130, 200)
CASES = range(3)  # generated cases (a fresh seed each) per parameter combination

HEADS = {  # (H, Hkv, D, Dv); the tiles FA4 picks: 128x128 for D=128 and D=192, 192x128 for D=64
    "gqa128": (8, 2, 128, 128),
    "mla": (16, 16, 192, 128),
    "gqa64": (8, 2, 64, 64),
}
VARLEN_ENTRIES = ("half", "nvfp4", "fp8_static", "fp8_group")
VARLEN_PAIRS = [(e, n) for e in VARLEN_ENTRIES for n, (_, _, _, dv) in HEADS.items()
                if e != "fp8_group" or dv % 128 == 0]  # the group FP8 entry needs Dv % 128 == 0
PAGED_ENTRIES = ("paged_half", "paged_nvfp4")
POISONS = {"nan": float("nan"), "inf": float("inf")}

GLOBAL_SCALE = 448 * 6 / 16.0  # NVFP4: |o| <= max |v| (about 5) keeps every finite block scale far below 448
FP8_SCALE = 1 / 16.0  # static FP8: |o| * 16 stays far below 448, so no finite row saturates


class HiddenRowsChanged(AssertionError):
    """Rows that cannot see the poisoned token changed (or are not finite): the masked ``0 * NaN``."""


def fresh_seed() -> int:
    seed = os.environ.get("FUSION_PASS_TEST_SEED")
    return int(seed) if seed else random.SystemRandom().randrange(2**31)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tiles(h, hkv, d, dv, max_seqlen, max_seqlen_k=None) -> tuple[int, int]:
    cfg = sm90.kernel_config(d, dv, True, max_seqlen, max_seqlen_k)
    return cfg.tile_m, cfg.tile_n


# ---------------------------------------------------------------------------
# the model of FA4's leak (which rows a poisoned value row reaches)
# ---------------------------------------------------------------------------


def _varlen_leak_model(lengths, g: int, tile_m: int, tile_n: int) -> set[int]:
    """Rows whose output FA4 computes with value row ``g`` (global) in its ``P @ V``: per sequence (offset ``o``,
    length ``L``, keys = queries, causal), query tile ``m`` runs key tiles ``0 .. n_max - 1``, ``n_max =
    ceil(min((m + 1) * tile_m, L) / tile_n)`` (``block_info.get_n_block_min_max``), each a TMA load of rows
    ``o + n * tile_n ..`` of the whole ``[T, Hkv, Dv]`` tensor (``seqlen.offset_batch_K``: a domain offset, not a
    ragged tensor), so a partial last tile holds the next sequences' first rows; rows past ``T`` are zero-filled."""
    rows: set[int] = set()
    o = 0
    for length in lengths:
        for m in range(_cdiv(length, tile_m)):
            n_max = _cdiv(min((m + 1) * tile_m, length), tile_n)
            if o <= g < o + n_max * tile_n:
                rows.update(range(o + m * tile_m, o + min((m + 1) * tile_m, length)))
        o += length
    return rows


def _paged_leak_model(seqs, s: int, key: int, tile_m: int, tile_n: int, tma: bool) -> set[int]:
    """Rows whose output FA4 computes with key slot ``key`` of sequence ``s``'s pages (``seqs``: ``(Lq, Lk)`` per
    sequence; only ``s`` lists those pages). Query tile ``m`` runs key tiles ``0 .. n_max - 1``, ``n_max =
    ceil(min((m + 1) * tile_m + Lk - Lq, Lk) / tile_n)``; with TMA (page size ``tile_n``) tile ``n`` is page
    ``page_table[s, n]``, whole; with cp.async (other page sizes) only keys ``< Lk`` are copied, the rest zero-filled
    (``cp.async ... 16, src_size`` with ``src_size = 0`` past the end: ``paged_kv.PagedKVManager.load_KV``)."""
    rows: set[int] = set()
    q0 = sum(lq for lq, _ in seqs[:s])
    lq, lk = seqs[s]
    for m in range(_cdiv(lq, tile_m)):
        n_max = _cdiv(min((m + 1) * tile_m + lk - lq, lk), tile_n)
        end = n_max * tile_n if tma else min(n_max * tile_n, lk)
        if key < end:
            rows.update(range(q0 + m * tile_m, q0 + min((m + 1) * tile_m, lq)))
    return rows


# ---------------------------------------------------------------------------
# the entry points: every output byte of every row, and which rows are finite
# ---------------------------------------------------------------------------


class Rows:
    """One call's outputs as ``[T, bytes]`` uint8 (every output byte of each row, on the CPU), which rows are
    finite (as the format can say it) and, for bf16 entries, the output itself."""

    def __init__(self, parts, finite, out=None):
        self.bytes = torch.cat([p.reshape(p.shape[0], -1).contiguous().view(torch.uint8).cpu() for p in parts], 1)
        self.finite = finite.cpu()
        self.out = None if out is None else out.cpu()


def _half_rows(out) -> Rows:
    t = out.shape[0]
    return Rows([out], torch.isfinite(out).reshape(t, -1).all(-1), out)


def _nvfp4_rows(packed, scales, t, width) -> Rows:
    sf = nvfp4.unswizzle_scales(scales.view(torch.float8_e4m3fn), t, width // 16).view(torch.uint8)
    return Rows([packed, sf], ((sf != 0x7F) & (sf != 0x7E)).all(-1))


def _run_varlen(entry, q, k, v, cu, max_seqlen) -> Rows:
    t, h, d = q.shape
    width = h * v.shape[2]
    scale = d**-0.5
    if entry == "half":
        return _half_rows(kernels.attention(q, k, v, cu, max_seqlen, softmax_scale=scale, backend="fa4"))
    if entry == "nvfp4":
        gs = torch.tensor([GLOBAL_SCALE], dtype=torch.float32, device=q.device)
        packed, scales = kernels.attention_nvfp4(q, k, v, cu, max_seqlen, gs, softmax_scale=scale, backend="fa4")
        return _nvfp4_rows(packed, scales, t, width)
    if entry == "fp8_static":
        s = torch.tensor([FP8_SCALE], dtype=torch.float32, device=q.device)
        out = kernels.attention_fp8_static(q, k, v, cu, max_seqlen, scale=s, softmax_scale=scale, backend="fa4")
        magnitude = out.view(torch.uint8) & 0x7F
        return Rows([out], ((magnitude != 0x7E) & (magnitude != 0x7F)).all(-1))  # +-448 or NaN: non-finite
    if entry == "fp8_group":
        out, scales = kernels.attention_fp8_group(q, k, v, cu, max_seqlen, softmax_scale=scale, backend="fa4")
        return Rows([out, scales.contiguous()], torch.isfinite(scales).all(-1))
    raise AssertionError(entry)


def _run_paged(entry, q, k_cache, v_cache, args) -> Rows:
    t, h, _ = q.shape
    width = h * v_cache.shape[-1]
    if entry == "paged_half":
        return _half_rows(fa4_forward.fa4_attention_paged(q, k_cache, v_cache, **args))
    if entry == "paged_nvfp4":
        rows, cols = nvfp4.scale_shape(t, width)
        packed = torch.zeros(t, width // 2, dtype=torch.uint8, device=q.device)
        scales = torch.zeros(rows, cols, dtype=torch.uint8, device=q.device)
        gs = torch.tensor([GLOBAL_SCALE], dtype=torch.float32, device=q.device)
        fa4_forward.fa4_attention_nvfp4_paged(q, k_cache, v_cache, **args, output=packed, output_scale=gs,
                                              output_block_scale=scales.view(torch.float8_e4m3fn))
        return _nvfp4_rows(packed, scales, t, width)
    raise AssertionError(entry)


# ---------------------------------------------------------------------------
# the verdict
# ---------------------------------------------------------------------------


def _ranges(rows) -> str:
    rows = sorted(rows)
    out, start = [], None
    for i, r in enumerate(rows):
        if start is None:
            start = r
        if i + 1 == len(rows) or rows[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


def _by_sequence(rows, query_lens) -> str:
    """``rows`` (global) as local row ranges per sequence: ``seq 1 (L=200, rows 37..236): 128-149 (22 rows)``."""
    if not rows:
        return "none"
    parts, start = [], 0
    for b, n in enumerate(query_lens):
        local = [r - start for r in rows if start <= r < start + n]
        if local:
            parts.append(f"seq {b} (Lq={n}, global rows {start}..{start + n - 1}): local rows {_ranges(local)} "
                         f"({len(local)} rows)")
        start += n
    return "; ".join(parts)


def _verdict(clean: Rows, dirty: Rows, hidden: torch.Tensor, sees: torch.Tensor, reached: set[int],
             query_lens, where: str, kind: str) -> None:
    """``reached``: the rows FA4 computes with the poisoned value row (the leak model; empty for a key)."""
    changed = (clean.bytes != dirty.bytes).any(-1)
    clean_bad = set((~clean.finite).nonzero()[:, 0].tolist())
    assert not clean_bad, f"the clean run has non-finite rows: {_by_sequence(clean_bad, query_lens)} ({where})"
    if sees.any():
        assert (changed & sees).any(), f"no row that sees the poisoned token changed: the poison was not read ({where})"
    hidden_rows = set(hidden.nonzero()[:, 0].tolist())
    reached = reached & hidden_rows if FA4_MULTIPLIES_MASKED_VALUES[kind] else set()
    not_finite = set((~dirty.finite & hidden).nonzero()[:, 0].tolist())
    if KERNELS_PUT_BACK[kind]:
        if not_finite:
            raise HiddenRowsChanged(f"rows that cannot see the poisoned token are not finite: "
                                    f"{_by_sequence(not_finite, query_lens)}; the leak model's rows: "
                                    f"{_by_sequence(reached, query_lens)} ({where})")
        outside = set((changed & hidden).nonzero()[:, 0].tolist()) - reached
        if outside:
            raise HiddenRowsChanged(f"rows the poisoned value row never reached changed: "
                                    f"{_by_sequence(outside, query_lens)} ({where})")
        return
    leaked = set(((changed | ~dirty.finite) & hidden).nonzero()[:, 0].tolist())
    if leaked:
        detail = (f"rows that cannot see the poisoned token changed: {_by_sequence(leaked, query_lens)}; "
                  f"of them not finite: {_by_sequence(not_finite, query_lens)} ({where})")
        if leaked == reached:
            pytest.xfail(f"FA4's masked 0 * NaN in P @ V, exactly the rows its model predicts: {detail}")
        raise HiddenRowsChanged(f"{detail}; the model of FA4's leak predicted: {_by_sequence(reached, query_lens)}")
    assert not reached, (f"the model of FA4's leak predicted {_by_sequence(reached, query_lens)} to change, and no "
                         f"hidden row changed: FA4 masks now (or the model is wrong) ({where})")


def _quantized_twin(entry: str, twin: torch.Tensor) -> Rows:
    """The format's reference quantizer of the twin's output ``[T, H, Dv]``: what the fused entry must write."""
    t = twin.shape[0]
    x = twin.reshape(t, -1)
    if entry in ("nvfp4", "paged_nvfp4"):
        gs = torch.tensor([GLOBAL_SCALE], dtype=torch.float32, device=x.device)
        packed, sf = nvfp4.quantize(x, gs, swizzled=False)
        sf = sf.view(torch.uint8)
        return Rows([packed, sf], ((sf != 0x7F) & (sf != 0x7E)).all(-1))
    if entry == "fp8_static":
        inv = fp8.reciprocal(torch.tensor([FP8_SCALE], dtype=torch.float32, device=x.device))
        out = fp8.quantize_static(x, inv)
        magnitude = out.view(torch.uint8) & 0x7F
        return Rows([out], ((magnitude != 0x7E) & (magnitude != 0x7F)).all(-1))
    if entry == "fp8_group":
        out, scales = fp8.quantize_group(x)
        return Rows([out, scales], torch.isfinite(scales).all(-1))
    raise AssertionError(entry)


def _fused_quantizes_twin(entry: str, dirty: Rows, twin: torch.Tensor, where: str) -> None:
    """Quantized entries: the fused bytes == the reference quantizer of the twin's output, every row."""
    want = _quantized_twin(entry, twin)
    differ = (want.bytes != dirty.bytes).any(-1).nonzero()[:, 0].tolist()
    assert not differ, (f"{len(differ)} rows of the fused bytes differ from quantize(twin) on the poisoned inputs: "
                        f"{_ranges(differ)[:200]} ({where})")


def _seeing_rows_poisoned(dirty: Rows, sees, h, hkv, kv_head, col, tensor, value, where) -> None:
    """bf16 entries: every row that sees the token is non-finite where the poison enters (module docstring)."""
    if dirty.out is None or (tensor == "k" and value == "inf"):
        return
    group = dirty.out[:, kv_head * (h // hkv):(kv_head + 1) * (h // hkv)]  # [T, H/Hkv, Dv]
    hit = group[..., col] if tensor == "v" else group.reshape(group.shape[0], -1)
    reached = (~torch.isfinite(hit)).reshape(hit.shape[0], -1).any(-1)
    missed = (sees & ~reached).nonzero()[:, 0].tolist()
    assert not missed, f"rows {missed[:16]} see the poisoned token but are finite there ({where})"


def _hidden_rows_near_reference(dirty: Rows, want: torch.Tensor, hidden, where) -> None:
    """bf16 entries: the hidden rows within bf16 rounding of the float32 reference (which masks exactly)."""
    if dirty.out is None or not hidden.any():
        return
    got, ref = dirty.out[hidden].double(), want[hidden].double()
    assert torch.isfinite(ref).all(), f"the reference's hidden rows are not finite ({where})"
    if torch.isfinite(got).all():
        rel = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        assert rel < 1e-2, f"hidden rows: relative error {rel:.2e} against the reference backend ({where})"


# ---------------------------------------------------------------------------
# varlen
# ---------------------------------------------------------------------------


def _varlen_case(gen: random.Random, tile_n: int):
    """1-3 lengths from :data:`LENGTHS` and the poisoned ``(sequence, token)``: the token a tile edge, a key
    tile's neighbour, the sequence's last or first token (the first: only other sequences can leak), or random."""
    while True:
        lengths = [gen.choice(LENGTHS) for _ in range(gen.randint(1, 3))]
        s = gen.randrange(len(lengths))
        n = lengths[s]
        picks = [0, n - 1, n // 2, gen.randrange(n)] + [x for x in (1, 63, 64, 65, tile_n - 1, tile_n, tile_n + 1)
                                                         if x < n]
        j = gen.choice(picks)
        if sum(lengths) - (n - j) > 0:  # some row cannot see the token
            return lengths, s, j


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"case{c}")
@pytest.mark.parametrize("value", list(POISONS))
@pytest.mark.parametrize("tensor", ["v", "k"])
@pytest.mark.parametrize("entry, heads", VARLEN_PAIRS)
def test_varlen_poison_reaches_no_hidden_row(entry, heads, tensor, value, case):
    h, hkv, d, dv = HEADS[heads]
    seed = fresh_seed()
    gen = random.Random(seed)
    lengths, s, j = _varlen_case(gen, _tiles(h, hkv, d, dv, max(LENGTHS))[1])
    t, max_seqlen = sum(lengths), max(lengths)
    tile_m, tile_n = _tiles(h, hkv, d, dv, max_seqlen)
    tg = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=tg).to("cuda", torch.bfloat16)
    k = torch.randn(t, hkv, d, generator=tg).to("cuda", torch.bfloat16)
    v = torch.randn(t, hkv, dv, generator=tg).to("cuda", torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    o = sum(lengths[:s])
    g = o + j  # the poisoned token's row of q / k / v
    kv_head, col = gen.randrange(hkv), gen.randrange(d if tensor == "k" else dv)
    poisoned = (k if tensor == "k" else v).clone()
    poisoned[g, kv_head, col] = POISONS[value]
    dirty_k, dirty_v = (poisoned, v) if tensor == "k" else (k, poisoned)

    sees = torch.zeros(t, dtype=torch.bool)
    sees[g : o + lengths[s]] = True
    hidden = ~sees
    predicted = _varlen_leak_model(lengths, g, tile_m, tile_n) if tensor == "v" else set()
    where = (f"{entry}, {heads}, {value} in {tensor.upper()}[{g}, {kv_head}, {col}] = token {j} of sequence {s}, "
             f"lengths {lengths}, tiles {tile_m}x{tile_n}, seed {seed}")

    clean = _run_varlen(entry, q, k, v, cu, max_seqlen)
    dirty = _run_varlen(entry, q, dirty_k, dirty_v, cu, max_seqlen)
    torch.cuda.synchronize()
    if entry == "half":
        want = kernels.attention(q, dirty_k, dirty_v, cu, max_seqlen, softmax_scale=d**-0.5, backend="reference")
        _hidden_rows_near_reference(dirty, want.cpu(), hidden, where)
        _seeing_rows_poisoned(dirty, sees, h, hkv, kv_head, col, tensor, value, where)
    else:
        twin = kernels.attention(q, dirty_k, dirty_v, cu, max_seqlen, softmax_scale=d**-0.5, backend="fa4")
        _fused_quantizes_twin(entry, dirty, twin, where)
    _verdict(clean, dirty, hidden, sees, predicted, lengths, where, "varlen")


# ---------------------------------------------------------------------------
# paged
# ---------------------------------------------------------------------------


def _paged_batch(gen: random.Random):
    """1-3 sequences ``(Lq, Lk)``: a prefill (``Lq = Lk``), a prefill after cached context, a decode row."""
    seqs = []
    for _ in range(gen.randint(1, 3)):
        kind = gen.choice(["prefill", "context", "decode"])
        n = gen.choice(LENGTHS)
        ctx = gen.choice([7, 64, 130])
        seqs.append({"prefill": (n, n), "context": (n, n + ctx), "decode": (1, n + ctx)}[kind])
    return seqs


def _paged_case(gen: random.Random, where_in: str):
    """A batch (:func:`_paged_batch`), the poisoned sequence ``s`` and key: for ``token`` a key some of its rows do
    not see, or any key, or its last; for ``slot`` the slot past its last key (on its last page unless the sequence
    fills that page). Drawn again until some row cannot see the poison."""
    while True:
        seqs = _paged_batch(gen)
        s = gen.randrange(len(seqs))
        lq, lk = seqs[s]
        if where_in == "slot":
            return seqs, s, lk
        key = gen.choice([lk - lq + gen.randrange(lq), gen.randrange(lk), lk - 1])
        if len(seqs) > 1 or key > lk - lq:  # rows of another sequence, or query rows before the key
            return seqs, s, key


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"case{c}")
@pytest.mark.parametrize("value", list(POISONS))
@pytest.mark.parametrize("tensor, where_in", [("v", "token"), ("k", "token"), ("v", "slot")])
@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("heads", ["gqa128", "gqa64"])
@pytest.mark.parametrize("entry", PAGED_ENTRIES)
def test_paged_poison_reaches_no_hidden_row(entry, heads, page_size, tensor, where_in, value, case):
    h, hkv, d, dv = HEADS[heads]
    seed = fresh_seed()
    gen = random.Random(seed)
    seqs, s, key = _paged_case(gen, where_in)
    query_lens = [lq for lq, _ in seqs]
    key_lens = [lk for _, lk in seqs]
    tile_m, tile_n = _tiles(h, hkv, d, dv, max(query_lens), max(key_lens))
    tma = page_size == tile_n
    b = len(seqs)
    need = [_cdiv(lk, page_size) for lk in key_lens]
    num_pages = sum(need) + 2
    order = list(range(num_pages))
    gen.shuffle(order)
    spare = order[sum(need):]
    width = max(need) + 1
    table = torch.empty(b, width, dtype=torch.int32)
    pos = 0
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(order[pos : pos + n], dtype=torch.int32)
        table[i, n:] = spare[0]  # past the sequence's pages: a page no sequence uses
        pos += n
    tg = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_pages, page_size, hkv, d, generator=tg).to("cuda", torch.bfloat16)
    v_cache = torch.randn(num_pages, page_size, hkv, dv, generator=tg).to("cuda", torch.bfloat16)
    t = sum(query_lens)
    q = torch.randn(t, h, d, generator=tg).to("cuda", torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    seqused = torch.tensor(key_lens, dtype=torch.int32, device="cuda")

    lq, lk = seqs[s]
    page = int(table[s, key // page_size]) if key // page_size < need[s] else spare[-1]
    spot = (page, key % page_size)
    kv_head, col = gen.randrange(hkv), gen.randrange(d if tensor == "k" else dv)
    poisoned = (k_cache if tensor == "k" else v_cache).clone()
    poisoned[spot[0], spot[1], kv_head, col] = POISONS[value]
    dirty_k, dirty_v = (poisoned, v_cache) if tensor == "k" else (k_cache, poisoned)

    q0 = sum(query_lens[:s])
    sees = torch.zeros(t, dtype=torch.bool)
    if where_in == "token":  # query i (local) sees keys <= i + lk - lq
        first = max(0, key - (lk - lq))
        sees[q0 + first : q0 + lq] = True
    hidden = ~sees
    predicted = _paged_leak_model(seqs, s, key, tile_m, tile_n, tma) if tensor == "v" else set()
    where = (f"{entry}, {heads}, pages of {page_size} ({'TMA' if tma else 'cp.async'}), {value} in "
             f"{tensor.upper()} of key {key} ({where_in}) of sequence {s} at page {spot[0]} slot {spot[1]}, KV head "
             f"{kv_head}, column {col}; sequences (Lq, Lk) {seqs}, tiles {tile_m}x{tile_n}, seed {seed}")
    args = dict(cu_seqlens=cu, max_seqlen=max(query_lens), seqused_k=seqused, page_table=table.to("cuda"),
                max_seqlen_k=max(key_lens), softmax_scale=d**-0.5, causal=True)

    clean = _run_paged(entry, q, k_cache, v_cache, args)
    dirty = _run_paged(entry, q, dirty_k, dirty_v, args)
    torch.cuda.synchronize()
    if entry == "paged_half":
        want, _ = reference.paged_attention(q, dirty_k, dirty_v, cu, seqused, args["page_table"], True, d**-0.5)
        _hidden_rows_near_reference(dirty, want.cpu(), hidden, where)
        _seeing_rows_poisoned(dirty, sees, h, hkv, kv_head, col, tensor, value, where)
    else:
        _fused_quantizes_twin(entry, dirty, fa4_forward.fa4_attention_paged(q, dirty_k, dirty_v, **args), where)
    _verdict(clean, dirty, hidden, sees, predicted, query_lens, where, "paged")
