"""The output stages of the Triton flash-attention kernel (:mod:`.flash_attention`), one per value of its
``EPILOGUE`` constexpr, each taking the tile's float32 normalized output ``out [BLOCK_M, BLOCK_DV]`` (rows
``tokens``, head ``head``):

* :data:`EPILOGUE_HALF`: :func:`store_half`, ``Out[token, head, :]`` in the query dtype or float32 (partial
  results, optionally with the log-sum-exp, :func:`store_lse`);
* :data:`EPILOGUE_NVFP4`: :func:`store_nvfp4`, packed e2m1 codes and swizzled e4m3 block scales (docs/nvfp4.md);
* :data:`EPILOGUE_FP8_STATIC`: :func:`fp8_static_bytes`, ``float8_e4m3fn [T, H*Dv]`` under one static scale;
* :data:`EPILOGUE_FP8_GROUP`: :func:`store_fp8_group`, ``float8_e4m3fn [T, H*Dv]`` and one float32 scale per row
  and 128 columns, at any strides (the three :class:`~fusion_pass.fp8.ScaleLayout`).

The FP8 bytes are those of :mod:`fusion_pass.fp8.reference` applied to ``out`` (docs/formats.md): they are
computed with float and integer operations (:func:`e4m3_bytes`), never by Triton's float8 cast, whose rounding
and NaN handling differ between the interpreter and compiled code; clamps and NaN rules are explicit selects for
the same reason (``tl.minimum`` / ``tl.maximum`` treat NaN differently there too).
"""

from __future__ import annotations

import triton
import triton.language as tl

from fusion_pass.fp8 import NaNRule
from fusion_pass.kernels.triton.nvfp4_math import quantize_pairs, round_to_e4m3, swizzled_scale_offset

EPILOGUE_HALF = 0
EPILOGUE_NVFP4 = 1
EPILOGUE_FP8_STATIC = 2
EPILOGUE_FP8_GROUP = 3

NAN_BYTES = {NaNRule.POSITIVE_MAX: 0x7E, NaNRule.NAN: 0x7F, NaNRule.NEGATIVE_MAX: 0xFE}
"""The byte a NaN quotient becomes under each rule (+448, the canonical positive NaN, -448)."""

FP8_DEFAULTS = {"SCALE_IS_INVERSE": False, "NAN_BYTE": NAN_BYTES[NaNRule.POSITIVE_MAX], "UE8M0": False,
                "DIVIDE": False}
"""The FP8 constexprs of the kernel, as the other epilogues pass them (unused there)."""

LN2 = tl.constexpr(0.6931471805599453)  # the kernel's log-sum-exp is base 2; its output is natural
E4M3_MAX = tl.constexpr(448.0)
GROUP = tl.constexpr(128)  # columns per scale of the group format
SCALE_EPS = tl.constexpr(1e-10)  # the group quantizer's floor on a group's max magnitude


@triton.jit
def store_half(out, out_ptr, stride_ot, stride_oh, tokens, rows_valid, head, HEAD_DIM_V: tl.constexpr,
               BLOCK_DV: tl.constexpr):
    """Half-precision epilogue: ``out [BLOCK_M, BLOCK_DV]`` -> ``Out[token, head, :]`` (converted to ``Out``'s
    dtype: the query dtype, or float32; the FP8 epilogues' bytes through a uint8 ``Out``)."""
    d_v = tl.arange(0, BLOCK_DV)
    offsets = tokens[:, None].to(tl.int64) * stride_ot + head * stride_oh + d_v[None, :]
    mask = rows_valid[:, None] & (d_v[None, :] < HEAD_DIM_V)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_lse(row_max, row_sum, lse_ptr, stride_lt, stride_lh, tokens, rows_valid, head):
    """``Lse[token, head] = ln(sum_j exp(scale * q.k_j))`` from the log2-domain running max and
    sum (``-inf`` where no key was visible)."""
    empty = row_sum == 0.0
    lse = tl.where(empty, float("-inf"), (row_max + tl.math.log2(tl.where(empty, 1.0, row_sum))) * LN2)
    tl.store(lse_ptr + tokens.to(tl.int64) * stride_lt + head * stride_lh, lse, mask=rows_valid)


@triton.jit
def store_nvfp4(
    out, packed_ptr, scales_ptr, global_scale_ptr, tokens, rows_valid, head, packed_row_bytes, scale_col_tiles,
    HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """NVFP4 epilogue: quantize ``out [BLOCK_M, BLOCK_DV]`` float32 per 16-element block.

    Row ``t`` (a global token index), head ``h``: packed bytes at
    ``packed[t, h*Dv/2 : (h+1)*Dv/2]``, block scales at the swizzled offsets of
    (row ``t``, block columns ``h*Dv/16 ...``). NaN / ±Inf in ``out`` (from NaN or
    infinite inputs) are written per docs/nvfp4.md "NaN and infinity" by the shared
    :func:`~fusion_pass.kernels.triton.nvfp4_math.quantize_pairs`: NaN blocks as scale byte
    0x7F and codes 0, ±Inf as code 0x7 / 0xF under a saturated (448) scale.
    """
    BLOCKS: tl.constexpr = BLOCK_DV // 16
    even, odd = tl.split(tl.reshape(out, (BLOCK_M, BLOCK_DV // 2, 2)))
    packed, sf = quantize_pairs(
        tl.reshape(even, (BLOCK_M * BLOCKS, 8)), tl.reshape(odd, (BLOCK_M * BLOCKS, 8)), tl.load(global_scale_ptr)
    )
    blocks = tl.arange(0, BLOCK_M * BLOCKS)
    block_tokens = tl.reshape(tl.broadcast_to(tokens[:, None], (BLOCK_M, BLOCKS)), (BLOCK_M * BLOCKS,)).to(tl.int64)
    block_valid = tl.reshape(tl.broadcast_to(rows_valid[:, None], (BLOCK_M, BLOCKS)), (BLOCK_M * BLOCKS,))
    block_valid = block_valid & (blocks % BLOCKS < HEAD_DIM_V // 16)
    head_blocks = blocks % BLOCKS
    block_bytes = block_tokens * packed_row_bytes + head * (HEAD_DIM_V // 2) + head_blocks * 8
    tl.store(packed_ptr + block_bytes[:, None] + tl.arange(0, 8)[None, :], packed, mask=block_valid[:, None])
    scale_offsets = swizzled_scale_offset(block_tokens, head * (HEAD_DIM_V // 16) + head_blocks, scale_col_tiles)
    tl.store(scales_ptr + scale_offsets, sf, mask=block_valid)


@triton.jit
def e4m3_bytes(q, NAN_BYTE: tl.constexpr):
    """float32 ``q`` -> the float8_e4m3fn bytes (uint8) of ``clamp(q, -448, 448)``: nearest, ties to even
    (:func:`~fusion_pass.kernels.triton.nvfp4_math.round_to_e4m3`, subnormals included), the sign bit kept
    (``-0`` and negatives rounding to zero give ``0x80``), ``±Inf`` -> ``±448``, NaN -> ``NAN_BYTE``.

    The magnitude's byte from the rounded float32 ``r``: ``r / 2^-9`` below ``2^-6`` (subnormal codes 0-7),
    else the float32 exponent and top 3 mantissa bits rebased (``(bits >> 20) - (120 << 3)``).
    """
    bits = q.to(tl.uint32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    nan = magnitude > 0x7F800000
    # the clamp on the bit patterns (they order non-negative floats like their values): Inf and NaN -> 448
    r = round_to_e4m3(tl.minimum(magnitude, 0x43E00000).to(tl.float32, bitcast=True))  # 0x43E00000 = 448.0
    normal = (r.to(tl.uint32, bitcast=True) >> 20).to(tl.int32) - 960
    code = tl.where(r < 0.015625, (r * 512.0).to(tl.int32), normal)
    code = code | ((bits >> 24) & 0x80).to(tl.int32)
    return tl.where(nan, NAN_BYTE, code).to(tl.uint8)


@triton.jit
def fp8_static_bytes(out, scale_ptr, SCALE_IS_INVERSE: tl.constexpr, NAN_BYTE: tl.constexpr):
    """Static per-tensor FP8 of ``out``: the bytes of ``fp8(clamp(out * inv, -448, 448))``, ``inv`` the float32
    at ``scale_ptr`` (``SCALE_IS_INVERSE``: the graph's own reciprocal) or the correctly rounded ``1 / scale``
    computed here (vLLM's CUDA kernel's IEEE division; 0 gives +Inf). NaN products -> ``NAN_BYTE``."""
    s = tl.load(scale_ptr + tl.zeros((1, 1), tl.int32))
    if SCALE_IS_INVERSE:
        inv = s
    else:
        inv = tl.math.div_rn(tl.full((1, 1), 1.0, tl.float32), s)
    return e4m3_bytes(out * inv, NAN_BYTE)


@triton.jit
def store_fp8_group(
    out, out_ptr, stride_ot, stride_oh, scales_ptr, stride_st, stride_sg, tokens, rows_valid, head,
    HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, UE8M0: tl.constexpr,
    DIVIDE: tl.constexpr,
):
    """Dynamic per-token-group FP8 epilogue (``HEAD_DIM_V % 128 == 0``: the head's tile holds whole groups).

    Per row and 128-column group ``g`` of the tile: ``s = max(1e-10, max |out_g|) / 448`` (IEEE division; NaN
    elements left out of the max: it is taken over the magnitudes' bit patterns with NaN as 0, Inf included),
    with ``UE8M0`` rounded up to a power of two (the exponent plus one unless the mantissa is zero; Inf stays);
    ``q = out * (1 / s)`` (vLLM 0.33 / 0.34) or ``out / s`` (``DIVIDE``, 0.32), clamped, NaN -> -448 (``0xFE``).
    The bytes go to ``Out[token, h*Dv + ...]`` (a uint8 view, strides ``stride_ot`` / ``stride_oh``), the float32
    scale of group column ``h*Dv/128 + g`` to ``scales_ptr + token * stride_st + column * stride_sg``.
    """
    GROUPS: tl.constexpr = BLOCK_DV // GROUP
    groups = tl.reshape(out, (BLOCK_M, GROUPS, GROUP))
    magnitude = groups.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    magnitude = tl.where(magnitude > 0x7F800000, 0, magnitude)
    amax = tl.max(magnitude, axis=2).to(tl.float32, bitcast=True)
    amax = tl.where(amax < SCALE_EPS, SCALE_EPS, amax)
    s = tl.math.div_rn(amax, tl.full((BLOCK_M, GROUPS), E4M3_MAX, tl.float32))
    if UE8M0:
        bits = s.to(tl.uint32, bitcast=True)
        up = ((bits & 0x7F800000) + 0x800000).to(tl.float32, bitcast=True)
        s = tl.where((bits & 0x7FFFFF) == 0, s, up)
    if DIVIDE:
        q = tl.math.div_rn(groups, tl.broadcast_to(s[:, :, None], (BLOCK_M, GROUPS, GROUP)))
    else:
        q = groups * tl.math.div_rn(tl.full((BLOCK_M, GROUPS), 1.0, tl.float32), s)[:, :, None]
    codes = tl.reshape(e4m3_bytes(q, 0xFE), (BLOCK_M, BLOCK_DV))
    store_half(codes, out_ptr, stride_ot, stride_oh, tokens, rows_valid, head, HEAD_DIM_V, BLOCK_DV)
    g = tl.arange(0, GROUPS)
    offsets = tokens[:, None].to(tl.int64) * stride_st + (head * (HEAD_DIM_V // GROUP) + g[None, :]) * stride_sg
    tl.store(scales_ptr + offsets, s, mask=rows_valid[:, None] & (g[None, :] < HEAD_DIM_V // GROUP))
