"""Triton flash-attention forward (varlen, causal) with four epilogues: half precision, NVFP4, FP8 static, FP8
groups. One kernel source serves every output; the ``EPILOGUE`` constexpr picks the output stage
(:mod:`.epilogues`): ``out [T, H, Dv]`` in the query dtype (the unfused path and the guard's fallback; float32
for partial results, optionally with the log-sum-exp), NVFP4 (packed e2m1 codes ``[T, H*Dv/2]`` and e4m3 block
scales at the tokens' global rows in the 128x4 swizzled layout, quantized from the float32 accumulator with the
global scale as input: the fused path, no half-precision round trip), or FP8 (``float8_e4m3fn [T, H*Dv]``,
static per-tensor or one dynamic scale per row and 128 columns: the bytes of :mod:`fusion_pass.fp8`'s reference
quantizers applied to the kernel's own float32 output).

Layouts: ``q [T, H, Dqk]``, ``k [Tk, Hkv, Dqk]``, ``v [Tk, Hkv, Dv]`` (token-major, unit stride along the head
dim). Query sequences are packed along ``T`` and delimited by ``cu_seqlens`` int32 ``[B + 1]``; their outputs go
to the same global rows. Key/value sequences are delimited by ``cu_seqlens_k`` (default ``cu_seqlens``: a
sequence's keys are its own tokens). Query head ``h`` reads kv head ``h // (H / Hkv)``. A sequence with ``Lq``
queries and ``Lk`` keys is causal aligned to the end of the keys (bottom-right, FlashAttention's convention):
query ``i`` sees keys ``j <= i + (Lk - Lq)``, i.e. a chunk of new tokens after ``Lk - Lq`` cached context tokens.

The query/key head dim need not be a power of two: it is split into a power-of-two part and a tail (MLA
prefill's 192 = 128 + 64), each its own dot.

Paged KV cache (:mod:`.paged`: ``flash_attention_paged``, ``flash_attention_nvfp4_paged``, the FP8 two): the
same kernel with the ``PAGED`` constexpr reads sequence ``b``'s ``seqused_k[b]`` keys through row ``b`` of a
page table from ``k_cache [num_pages, page_size, Hkv, Dqk]`` / ``v_cache [num_pages, page_size, Hkv, Dv]`` (any
strides but the last), FlashAttention's and vLLM's paged layout; only the addresses of the key rows differ
(:func:`_key_rows`), the blocks, masks, online softmax and epilogues are shared.

:func:`flash_attention`, :func:`flash_attention_nvfp4`, :func:`flash_attention_fp8_static`,
:func:`flash_attention_fp8_group` and :mod:`.paged`'s four are unvalidated launchers; the checked entry points
are in :mod:`fusion_pass.kernels` (the fused backends' paged call is
:func:`fusion_pass.kernels.launchers.flash_attention_nvfp4_paged`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fusion_pass import fp8, nvfp4
from fusion_pass.kernels.checks import zero_nvfp4_scale_padding
from fusion_pass.kernels.triton.epilogues import (EPILOGUE_FP8_GROUP, EPILOGUE_FP8_STATIC, EPILOGUE_HALF,
                                                   EPILOGUE_NVFP4, FP8_DEFAULTS, NAN_BYTES, fp8_static_bytes,
                                                   store_fp8_group, store_half, store_lse, store_nvfp4)
from fusion_pass.kernels.triton.tiles import attention_config, split_head_dim

__all__ = ["attention_config", "flash_attention", "flash_attention_fp8_group", "flash_attention_fp8_static",
           "flash_attention_nvfp4", "split_head_dim"]

LOG2E = 1.4426950408889634


@triton.jit
def _load_rows(ptr, row_offsets, tokens, dims, token_limit, dim_limit, MASK_TOKENS: tl.constexpr,
               MASK_DIMS: tl.constexpr):
    """Tile ``[len(tokens), len(dims)]``: token ``tokens[i]``'s row starts at ``ptr + row_offsets[i]`` (int64;
    unit stride along the dims); masked reads (tokens from ``token_limit`` on, dims from ``dim_limit`` on)
    give 0 and read nothing."""
    offsets = row_offsets[:, None] + dims[None, :]
    if MASK_TOKENS or MASK_DIMS:
        mask = (tokens[:, None] < token_limit) & (dims[None, :] < dim_limit)
        return tl.load(ptr + offsets, mask=mask, other=0.0)
    return tl.load(ptr + offsets)


@triton.jit
def _key_rows(keys, seqlen_k, page_row_ptr, page_size, stride_kp, stride_kt, stride_vp, stride_vt,
              MASKED: tl.constexpr, PAGED: tl.constexpr):
    """int64 offsets of the rows of ``keys`` in ``k`` and ``v`` (from the kv head's base).

    Contiguous keys (``PAGED`` false): key ``j`` is row ``j`` (strides ``stride_kt`` / ``stride_vt``).
    Paged: key ``j`` is slot ``j % page_size`` (strides ``stride_kt`` / ``stride_vt``) of page
    ``page_row_ptr[j // page_size]`` (strides ``stride_kp`` / ``stride_vp``); ``MASKED`` blocks read no
    page-table entry for keys from ``seqlen_k`` on (their rows are never loaded either).
    """
    if PAGED:
        page_index = keys // page_size
        if MASKED:
            pages = tl.load(page_row_ptr + page_index, mask=keys < seqlen_k, other=0)
        else:
            pages = tl.load(page_row_ptr + page_index)
        pages = pages.to(tl.int64)
        slots = (keys - page_index * page_size).to(tl.int64)
        return pages * stride_kp + slots * stride_kt, pages * stride_vp + slots * stride_vt
    return keys.to(tl.int64) * stride_kt, keys.to(tl.int64) * stride_vt


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` (float32 ``acc``). ``UPCAST`` feeds the operands as float32: only for
    Triton's interpreter, whose dot multiplies bfloat16 tensors' raw bits (Triton 3.6)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _attend_block(
    acc, row_max, row_sum, q_main, q_tail,
    k_ptr, v_ptr, stride_kt, stride_vt, page_row_ptr, page_size, stride_kp, stride_vp,
    start_n, rows, seqlen_k, diag, qk_scale,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D_MAIN: tl.constexpr, BLOCK_D_TAIL: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PAGED: tl.constexpr,
):
    """Fold keys ``[start_n, start_n + BLOCK_N)`` into the online softmax.

    ``rows`` are query positions within the sequence, key positions run
    ``0 .. seqlen_k - 1`` and ``diag = Lk - Lq``. ``MASKED`` blocks (those on the
    diagonal and the sequence's last block) mask keys past the sequence and,
    causally, keys ``j > row + diag``; unmasked ones are wholly visible to every
    query row of the tile. Keys are rows of ``k`` / ``v`` (``PAGED`` false) or
    slots of the pages ``page_row_ptr`` lists (:func:`_key_rows`).
    """
    keys = start_n + tl.arange(0, BLOCK_N)
    k_rows, v_rows = _key_rows(keys, seqlen_k, page_row_ptr, page_size, stride_kp, stride_kt, stride_vp, stride_vt,
                               MASKED, PAGED)
    d_main = tl.arange(0, BLOCK_D_MAIN)
    k_main = _load_rows(k_ptr, k_rows, keys, d_main, seqlen_k, HEAD_DIM_QK, MASKED, BLOCK_D_MAIN > HEAD_DIM_QK)
    scores = _dot(q_main, tl.trans(k_main), tl.zeros((q_main.shape[0], BLOCK_N), tl.float32), UPCAST)
    if BLOCK_D_TAIL > 0:
        d_tail = BLOCK_D_MAIN + tl.arange(0, BLOCK_D_TAIL)
        k_tail = _load_rows(
            k_ptr, k_rows, keys, d_tail, seqlen_k, HEAD_DIM_QK, MASKED, BLOCK_D_MAIN + BLOCK_D_TAIL > HEAD_DIM_QK
        )
        scores = _dot(q_tail, tl.trans(k_tail), scores, UPCAST)
    scores = scores * qk_scale  # log2 domain
    if MASKED:
        visible = keys[None, :] < seqlen_k
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None] + diag)
        scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    # Rows with no visible key yet keep max -inf; shift by 0 there instead of -inf.
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    p = tl.math.exp2(scores - shift[:, None])
    alpha = tl.math.exp2(row_max - shift)
    row_sum = row_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    d_v = tl.arange(0, BLOCK_DV)
    v = _load_rows(v_ptr, v_rows, keys, d_v, seqlen_k, HEAD_DIM_V, MASKED, BLOCK_DV > HEAD_DIM_V)
    p = p.to(v.dtype)
    non_finite = 0
    if MASKED and CAUSAL:
        # A hidden key has p = 0, and 0 * NaN (or Inf) in P @ V would let a later token's non-finite value reach
        # the earlier rows of the tile: the dot takes the values with their non-finite elements as 0, and the
        # kernel puts back, after its last block, those of the keys each row sees (_put_back_non_finite).
        vc = v.to(tl.float32) if UPCAST else v  # the interpreter compares bfloat16's raw bits, not its values
        finite = (vc == vc) & (tl.abs(vc) != float("inf"))
        non_finite = 1 - tl.min(finite.to(tl.int32))
        v = tl.where(finite, vc, 0.0).to(v.dtype)
    acc = _dot(p, v, acc, UPCAST)
    return acc, new_max, row_sum, non_finite


@triton.jit
def _put_back_non_finite(
    acc, v_ptr, stride_vt, page_row_ptr, page_size, stride_vp, key_start, key_end, seqlen_k, last_key,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, PAGED: tl.constexpr,
):
    """``acc`` with the non-finite values of keys ``[key_start, key_end)`` that each row sees (keys
    ``<= last_key[row]``) put back, after the masked blocks took them as 0.

    Per element: NaN if a key the row sees holds NaN there, or +Inf and -Inf both; else ``±Inf`` if one holds
    ``±Inf`` (IEEE's ``P @ V``, up to an infinite value whose weight underflowed to 0, which ``0 * Inf`` would
    make NaN). From the first key of each kind per column, the values read again 16 keys at a time: run only for
    a tile whose masked blocks held a non-finite value, after the key loop.
    """
    never = 2147483647
    d_v = tl.arange(0, BLOCK_DV)
    first_nan = tl.full((BLOCK_DV,), never, tl.int32)
    first_pos = first_nan
    first_neg = first_nan
    for start_n in range(key_start, key_end, 16):
        keys = start_n + tl.arange(0, 16)
        _, v_rows = _key_rows(keys, seqlen_k, page_row_ptr, page_size, 0, 0, stride_vp, stride_vt, True, PAGED)
        v = _load_rows(v_ptr, v_rows, keys, d_v, seqlen_k, HEAD_DIM_V, True, BLOCK_DV > HEAD_DIM_V)
        v = v.to(tl.float32)
        k = keys[:, None]
        first_nan = tl.minimum(first_nan, tl.min(tl.where(v != v, k, never), axis=0))
        first_pos = tl.minimum(first_pos, tl.min(tl.where(v == float("inf"), k, never), axis=0))
        first_neg = tl.minimum(first_neg, tl.min(tl.where(v == float("-inf"), k, never), axis=0))
    last = last_key[:, None]
    nan = first_nan[None, :] <= last
    pos = first_pos[None, :] <= last
    neg = first_neg[None, :] <= last
    extra = tl.where(nan | (pos & neg), float("nan"), tl.where(pos, float("inf"), float("-inf")))
    return tl.where(nan | pos | neg, acc + extra, acc)


@triton.jit
def _flash_attention_kernel(
    q_ptr, k_ptr, v_ptr, cu_seqlens_ptr, cu_seqlens_k_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    page_table_ptr, stride_pb, page_size, stride_kp, stride_vp,  # PAGED
    out_ptr, stride_ot, stride_oh,  # half epilogue; FP8: the output's bytes (stride_oh = Dv)
    lse_ptr, stride_lt, stride_lh,  # half epilogue, STORE_LSE
    packed_ptr, scales_ptr, global_scale_ptr, packed_row_bytes, scale_col_tiles,  # NVFP4 epilogue
    stride_st, stride_sg,  # FP8 groups: scales_ptr's row and group-column strides; FP8 static: global_scale_ptr
    qk_scale, kv_group,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D_MAIN: tl.constexpr, BLOCK_D_TAIL: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EPILOGUE: tl.constexpr, STORE_LSE: tl.constexpr, UPCAST: tl.constexpr,
    PAGED: tl.constexpr,
    SCALE_IS_INVERSE: tl.constexpr, NAN_BYTE: tl.constexpr, UE8M0: tl.constexpr, DIVIDE: tl.constexpr,  # FP8
):
    """Program ``(m, h, b)``: query rows ``[m*BLOCK_M, +BLOCK_M)`` of sequence ``b``, head ``h``.

    Causal grids run the query tiles last-first (the longest key ranges start
    first, which balances the tail of the launch).

    Keys: rows ``[ck[b], ck[b+1])`` of ``k`` / ``v`` (``cu_seqlens_k_ptr`` = ``ck``; strides
    ``stride_kt`` / ``stride_vt`` per token), or with ``PAGED`` the first ``seqused_k[b]``
    (``cu_seqlens_k_ptr`` = ``seqused_k``) slots of the pages listed in row ``b`` of the page
    table (``page_table_ptr``, row stride ``stride_pb``): key ``j`` is slot ``j % page_size``
    (stride ``stride_kt`` / ``stride_vt``) of page ``page_table[b, j // page_size]`` (stride
    ``stride_kp`` / ``stride_vp``). One body for both: only the key rows' addresses differ.
    """
    m_block = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    if CAUSAL:
        m_block = tl.num_programs(0) - 1 - m_block
    seq_start = tl.load(cu_seqlens_ptr + seq)
    seqlen = tl.load(cu_seqlens_ptr + seq + 1) - seq_start
    start_m = m_block * BLOCK_M
    if start_m >= seqlen:
        return
    kv_head = head // kv_group
    if PAGED:
        seqlen_k = tl.load(cu_seqlens_k_ptr + seq)  # seqused_k
        k_base = k_ptr + kv_head * stride_kh
        v_base = v_ptr + kv_head * stride_vh
        page_row = page_table_ptr + seq.to(tl.int64) * stride_pb
    else:
        key_start = tl.load(cu_seqlens_k_ptr + seq)
        seqlen_k = tl.load(cu_seqlens_k_ptr + seq + 1) - key_start
        k_base = k_ptr + key_start.to(tl.int64) * stride_kt + kv_head * stride_kh
        v_base = v_ptr + key_start.to(tl.int64) * stride_vt + kv_head * stride_vh
        page_row = page_table_ptr  # not read
    diag = seqlen_k - seqlen  # query i sees keys j <= i + diag (causal)

    rows = start_m + tl.arange(0, BLOCK_M)  # positions within the sequence
    rows_valid = rows < seqlen
    tokens = seq_start + rows
    q_base = q_ptr + seq_start.to(tl.int64) * stride_qt + head * stride_qh

    d_main = tl.arange(0, BLOCK_D_MAIN)
    q_main = tl.load(
        q_base + rows[:, None].to(tl.int64) * stride_qt + d_main[None, :],
        mask=rows_valid[:, None] & (d_main[None, :] < HEAD_DIM_QK), other=0.0,
    )
    q_tail = q_main  # unused unless the head dim has a tail
    if BLOCK_D_TAIL > 0:
        d_tail = BLOCK_D_MAIN + tl.arange(0, BLOCK_D_TAIL)
        q_tail = tl.load(
            q_base + rows[:, None].to(tl.int64) * stride_qt + d_tail[None, :],
            mask=rows_valid[:, None] & (d_tail[None, :] < HEAD_DIM_QK), other=0.0,
        )

    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    row_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)

    # Keys [0, unmasked_end) are visible to every row of the tile; [unmasked_end, key_end)
    # need masks; keys from key_end on are visible to no row of the tile.
    if CAUSAL:
        key_end = tl.minimum(start_m + BLOCK_M, seqlen) + diag
        unmasked_end = ((start_m + diag + 1) // BLOCK_N) * BLOCK_N
        unmasked_end = tl.maximum(unmasked_end, 0)
    else:
        key_end = seqlen_k
        unmasked_end = (seqlen_k // BLOCK_N) * BLOCK_N
    for start_n in range(0, unmasked_end, BLOCK_N):
        acc, row_max, row_sum, _ = _attend_block(
            acc, row_max, row_sum, q_main, q_tail, k_base, v_base, stride_kt, stride_vt,
            page_row, page_size, stride_kp, stride_vp, start_n, rows, seqlen_k, diag, qk_scale,
            HEAD_DIM_QK, HEAD_DIM_V, BLOCK_D_MAIN, BLOCK_D_TAIL, BLOCK_DV, BLOCK_N, MASKED=False, CAUSAL=CAUSAL,
            UPCAST=UPCAST, PAGED=PAGED,
        )
    non_finite = 0  # a masked block's values held a non-finite element (causal only: _attend_block)
    for start_n in range(unmasked_end, key_end, BLOCK_N):
        acc, row_max, row_sum, block_non_finite = _attend_block(
            acc, row_max, row_sum, q_main, q_tail, k_base, v_base, stride_kt, stride_vt,
            page_row, page_size, stride_kp, stride_vp, start_n, rows, seqlen_k, diag, qk_scale,
            HEAD_DIM_QK, HEAD_DIM_V, BLOCK_D_MAIN, BLOCK_D_TAIL, BLOCK_DV, BLOCK_N, MASKED=True, CAUSAL=CAUSAL,
            UPCAST=UPCAST, PAGED=PAGED,
        )
        non_finite = non_finite | block_non_finite
    if CAUSAL:
        if non_finite != 0:
            acc = _put_back_non_finite(acc, v_base, stride_vt, page_row, page_size, stride_vp, unmasked_end,
                                       key_end, seqlen_k, rows + diag, HEAD_DIM_V, BLOCK_DV, PAGED)

    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    # EPILOGUE: 0 half, 1 NVFP4, 2 FP8 static, 3 FP8 groups (.epilogues' constants are plain ints for the launcher)
    if EPILOGUE == 0:
        store_half(out, out_ptr, stride_ot, stride_oh, tokens, rows_valid, head, HEAD_DIM_V, BLOCK_DV)
        if STORE_LSE:
            store_lse(row_max, row_sum, lse_ptr, stride_lt, stride_lh, tokens, rows_valid, head)
    elif EPILOGUE == 1:
        store_nvfp4(
            out, packed_ptr, scales_ptr, global_scale_ptr, tokens, rows_valid, head, packed_row_bytes,
            scale_col_tiles, HEAD_DIM_V, BLOCK_M, BLOCK_DV,
        )
    elif EPILOGUE == 2:
        codes = fp8_static_bytes(out, global_scale_ptr, SCALE_IS_INVERSE, NAN_BYTE)
        store_half(codes, out_ptr, stride_ot, stride_oh, tokens, rows_valid, head, HEAD_DIM_V, BLOCK_DV)
    else:
        store_fp8_group(out, out_ptr, stride_ot, stride_oh, scales_ptr, stride_st, stride_sg, tokens, rows_valid,
                        head, HEAD_DIM_V, BLOCK_M, BLOCK_DV, UE8M0, DIVIDE)


def _launch(q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen, causal, softmax_scale, epilogue, out, lse, packed, scales,
            global_scale, config=None, page_table=None, scale_strides=(0, 0), fp8_flags=None):
    """One launch of :func:`_flash_attention_kernel`. Contiguous keys: ``k [Tk, Hkv, Dqk]``, ``v [Tk, Hkv, Dv]``,
    ``cu_seqlens_k`` (None: ``cu_seqlens``). Paged (``page_table`` given): ``k [P, S, Hkv, Dqk]``,
    ``v [P, S, Hkv, Dv]`` caches and ``cu_seqlens_k`` holding ``seqused_k``. FP8: ``out`` the output's bytes as
    a uint8 ``[T, H, Dv]`` view, ``global_scale`` the static scale, ``scales`` the group scales (their
    ``scale_strides``), ``fp8_flags`` the FP8 constexprs (:data:`.epilogues.FP8_DEFAULTS`)."""
    t, num_heads, head_dim_qk = q.shape
    paged = page_table is not None
    num_kv_heads, head_dim_v = v.shape[-2], v.shape[-1]
    batch = cu_seqlens.shape[0] - 1
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim_qk)
    d_main, d_tail = split_head_dim(head_dim_qk)
    cfg = config or attention_config(head_dim_qk, head_dim_v, q.device, max_seqlen)
    block_m = cfg["BLOCK_M"]
    if block_m % cfg["BLOCK_N"] != 0:
        raise ValueError(f"attention config: BLOCK_M={block_m} must be a multiple of BLOCK_N={cfg['BLOCK_N']}")
    grid = (triton.cdiv(max_seqlen, block_m), num_heads, batch)
    if t == 0 or batch == 0 or max_seqlen == 0:
        return
    if paged:
        # [P, S, Hkv, D]: page, slot (the per-token stride), head
        stride_kp, stride_kt, stride_kh = k.stride(0), k.stride(1), k.stride(2)
        stride_vp, stride_vt, stride_vh = v.stride(0), v.stride(1), v.stride(2)
        page_size = k.shape[1]
        stride_pb = page_table.stride(0)
        if k.numel() == 0 or v.numel() == 0 or page_table.numel() == 0:  # no key anywhere (seqused_k all 0)
            k = v = q
            page_table = cu_seqlens
    else:
        stride_kt, stride_kh, stride_vt, stride_vh = k.stride(0), k.stride(1), v.stride(0), v.stride(1)
        stride_kp = stride_vp = stride_pb = 0
        page_size = 1
        page_table = cu_seqlens  # not read
        if k.shape[0] == 0:  # no key anywhere: nothing is loaded, but an empty tensor is no pointer to pass
            k = v = q
    half = out if out is not None else q  # placeholders keep the signature fixed
    lse_buf = lse if lse is not None else q
    _flash_attention_kernel[grid](
        q, k, v, cu_seqlens, cu_seqlens if cu_seqlens_k is None else cu_seqlens_k,
        q.stride(0), q.stride(1), stride_kt, stride_kh, stride_vt, stride_vh,
        page_table, stride_pb, page_size, stride_kp, stride_vp,
        half, half.stride(0), half.stride(1),
        lse_buf, lse_buf.stride(0), lse_buf.stride(1),
        *(x if x is not None else q for x in (packed, scales, global_scale)),
        num_heads * head_dim_v // 2, nvfp4.round_up(num_heads * head_dim_v // 16, 4) // 4, *scale_strides,
        softmax_scale * LOG2E, num_heads // num_kv_heads,
        HEAD_DIM_QK=head_dim_qk, HEAD_DIM_V=head_dim_v,
        BLOCK_D_MAIN=d_main, BLOCK_D_TAIL=d_tail, BLOCK_DV=triton.next_power_of_2(head_dim_v),
        BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"],
        CAUSAL=causal, EPILOGUE=epilogue, STORE_LSE=lse is not None, UPCAST=q.device.type != "cuda",
        PAGED=paged, **{**FP8_DEFAULTS, **(fp8_flags or {})},
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def flash_attention(
    q, k, v, cu_seqlens, max_seqlen, *, causal=True, softmax_scale=None, out=None, config=None, cu_seqlens_k=None,
    max_seqlen_k=None, lse=None,
):
    """Varlen flash attention, half-precision (or float32) output (arguments not validated).

    Args:
        q: ``[T, H, Dqk]``; k: ``[Tk, Hkv, Dqk]``; v: ``[Tk, Hkv, Dv]``; float16 or
            bfloat16, unit stride along the last dim, ``H % Hkv == 0``.
        cu_seqlens: int32 ``[B + 1]`` on the device, contiguous, non-decreasing, ``cB <= T``:
            sequence ``b``'s queries (and output rows) are rows ``[c[b], c[b+1])``. Rows
            outside ``[c0, cB)`` are not written.
        max_seqlen: longest query sequence (sizes the grid).
        causal: query ``i`` of a sequence of ``Lq`` queries and ``Lk`` keys sees keys
            ``j <= i + (Lk - Lq)`` (bottom-right aligned); rows seeing no key get 0.
        softmax_scale: default ``1 / sqrt(Dqk)``.
        out: optional ``[T, H, Dv]`` buffer of q's dtype, or float32 (partial results
            merged later); any strides with unit stride along ``Dv``.
        config: tile/launch options overriding :func:`attention_config` (tuning).
        cu_seqlens_k: int32 ``[B + 1]`` on the device, contiguous, non-decreasing,
            ``ck[B] <= Tk``: sequence ``b``'s keys/values are rows ``[ck[b], ck[b+1])``
            of ``k``/``v``. Default ``cu_seqlens`` (a sequence's keys are its own tokens).
        max_seqlen_k: longest key sequence; accepted for FA4's signature, the kernel
            reads key lengths from ``cu_seqlens_k`` and does not use it.
        lse: optional float32 ``[T, H]`` buffer (any strides): element ``(t, h)``
            receives ``ln sum_j exp(softmax_scale * q_t . k_j)`` over the visible
            keys, ``-inf`` where there is none.

    Returns:
        ``out [T, H, Dv]`` (q's dtype unless given).
    """
    if out is None:
        out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    _launch(q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen, causal, softmax_scale, EPILOGUE_HALF, out, lse, None, None,
            None, config)
    return out


def flash_attention_nvfp4(
    q, k, v, cu_seqlens, max_seqlen, global_scale, *, causal=True, softmax_scale=None, packed=None, scales=None,
    config=None, cu_seqlens_k=None, max_seqlen_k=None,
):
    """Varlen flash attention written as NVFP4 (arguments not validated).

    Arguments as :func:`flash_attention` (``cu_seqlens_k`` / ``max_seqlen_k``
    included, no ``out`` / ``lse``), plus ``global_scale`` (float32, one
    element, on the device) and optional output buffers: ``packed`` uint8
    ``T * H*Dv/2`` bytes, ``scales`` ``round_up(T,128) * round_up(H*Dv/16,4)``
    bytes (float8_e4m3fn, uint8 or int32 as vLLM allocates it).

    Returns:
        ``(packed uint8 [T, H*Dv/2], scales float8_e4m3fn [round_up(T,128),
        round_up(H*Dv/16,4)])``. The kernel writes the packed bytes and the
        scales of rows ``[cu_seqlens[0], cu_seqlens[B])`` (every row when they
        span ``0 .. T``); the padding scale entries (rows ``>= T``, columns
        ``>= H*Dv/16``) are zeroed here. No other byte is touched.
    """
    return _nvfp4_launch(q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen, global_scale, causal, softmax_scale, packed,
                         scales, config, None)


def _nvfp4_launch(q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen, global_scale, causal, softmax_scale, packed, scales,
                  config, page_table):
    """The NVFP4 launchers' body: buffers allocated where not given, the scale padding zeroed, one launch."""
    t, num_heads = q.shape[0], q.shape[1]
    width = num_heads * v.shape[-1]
    rows, cols = nvfp4.scale_shape(t, width, swizzled=True)
    if packed is None:
        packed = torch.empty((t, width // 2), dtype=torch.uint8, device=q.device)
    if scales is None:
        scales = torch.empty((rows, cols), dtype=torch.uint8, device=q.device)
    scale_bytes = scales.view(torch.uint8).view(-1)
    zero_nvfp4_scale_padding(scale_bytes, t, width)
    _launch(q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen, causal, softmax_scale, EPILOGUE_NVFP4, None, None,
            packed.view(torch.uint8), scale_bytes, global_scale, config, page_table)
    return packed.view(t, width // 2), scale_bytes.view(rows, cols).view(torch.float8_e4m3fn)


def flash_attention_fp8_static(
    q, k, v, cu_seqlens, max_seqlen, scale, *, scale_is_inverse=False, nan=fp8.NaNRule.POSITIVE_MAX, causal=True,
    softmax_scale=None, output=None, config=None, cu_seqlens_k=None, max_seqlen_k=None,
):
    """Varlen flash attention written as static per-tensor FP8 (arguments not validated).

    Arguments as :func:`flash_attention_nvfp4`, with ``scale`` (float32, one element, on the device: the
    checkpoint's scale, inverted here by an IEEE division, or with ``scale_is_inverse`` its inverse, the graph's
    own reciprocal), ``nan`` (a :class:`fusion_pass.fp8.NaNRule` or its value: ``POSITIVE_MAX``, vLLM's CUDA op,
    or ``NAN``, the native form) and an optional ``output`` (float8_e4m3fn ``[T, H*Dv]``, unit column stride).

    Returns:
        ``output``: rows ``[cu_seqlens[0], cu_seqlens[B])`` hold :func:`fusion_pass.fp8.quantize_static` of the
        kernel's own float32 output (:func:`flash_attention` with a float32 ``out``); no other byte is touched.
    """
    flags = {"SCALE_IS_INVERSE": bool(scale_is_inverse), "NAN_BYTE": NAN_BYTES[fp8.NaNRule(nan)]}
    return _fp8_launch(q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen, causal, softmax_scale, output, config, None,
                       EPILOGUE_FP8_STATIC, scale, None, flags)


def flash_attention_fp8_group(
    q, k, v, cu_seqlens, max_seqlen, *, ue8m0=False, divide=False, causal=True, softmax_scale=None, output=None,
    scales=None, config=None, cu_seqlens_k=None, max_seqlen_k=None,
):
    """Varlen flash attention written as FP8 with one dynamic scale per row and 128 columns (arguments not
    validated; ``Dv % 128 == 0``). ``ue8m0``: scales rounded up to powers of two; ``divide``: ``x / s`` (vLLM
    0.32) instead of ``x * (1 / s)``; ``output`` as :func:`flash_attention_fp8_static`; ``scales``: float32
    ``[T, H*Dv/128]``, any strides (a :class:`fusion_pass.fp8.ScaleLayout`; default a row-major new one).

    Returns:
        ``(output, scales)``: rows ``[cu_seqlens[0], cu_seqlens[B])`` hold :func:`fusion_pass.fp8.quantize_group`
        of the kernel's own float32 output; no other byte or scale is touched.
    """
    if scales is None:
        scales = fp8.group_scale_buffer(q.shape[0], q.shape[1] * v.shape[-1], device=q.device)
    flags = {"UE8M0": bool(ue8m0), "DIVIDE": bool(divide)}
    return _fp8_launch(q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen, causal, softmax_scale, output, config, None,
                       EPILOGUE_FP8_GROUP, None, scales, flags), scales


def _fp8_launch(q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen, causal, softmax_scale, output, config, page_table,
                epilogue, static_scale, group_scales, flags):
    """The FP8 launchers' body: the output allocated where not given, one launch writing its bytes."""
    t, h, dv = q.shape[0], q.shape[1], v.shape[-1]
    if output is None:
        output = torch.empty((t, h * dv), dtype=fp8.FP8, device=q.device)
    strides = (0, 0) if group_scales is None else tuple(group_scales.stride())
    _launch(q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen, causal, softmax_scale, epilogue,
            output.view(torch.uint8).unflatten(1, (h, dv)), None, None, group_scales, static_scale, config,
            page_table, strides, flags)
    return output
