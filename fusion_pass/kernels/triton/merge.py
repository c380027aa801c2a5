"""Triton NVFP4 attention-state merge: two partial attentions merged by log-sum-exp and written as NVFP4.

The kernel behind :func:`fusion_pass.kernels.merge_attention_nvfp4` (its docstring is the contract: shapes,
the merge formula, where the bytes may differ from the reference). :func:`merge_attention_nvfp4_launch` is
the unvalidated launcher for the hot path (no host synchronization).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusion_pass import nvfp4
from fusion_pass.kernels.triton.nvfp4_math import load_pairs, quantize_pairs, swizzled_scale_offset

__all__ = ["MERGE_CONFIG", "merge_attention_nvfp4_launch"]

MERGE_CONFIG = {"BLOCK_M": 8, "BLOCK_K": 512, "num_warps": 4}
"""Tile of one program (rows x columns of ``[M, H*Dv]``) and its warps. On the H200 (bf16
``[16384, 128, 128]`` parts, 11 tiles tried) it merged in 0.375 ms, 3.31 TB/s of its bytes
(outputs and LSEs read, packed and scales written) against a 4.14 TB/s copy; the
quantizer's 16x512 tile took 0.400 ms."""


@triton.jit
def _merge_weights(lse_a, lse_b):
    """Per-block weights ``(w_a, w_b, 1 / (w_a + w_b))`` from the two LSEs, float32 ``[N]``.

    Both ``-inf``: weights 0 and reciprocal 1 (the reference divides by 1 there).
    A NaN or ``+inf`` LSE makes its own weight ``exp(NaN)`` whatever ``tl.maximum``
    does with NaN, and the merged values NaN.
    """
    top = tl.maximum(lse_a, lse_b)
    top = tl.where(top == float("-inf"), 0.0, top)
    w_a = tl.exp(lse_a - top)
    w_b = tl.exp(lse_b - top)
    total = w_a + w_b
    ones = tl.full(total.shape, 1.0, tl.float32)
    return w_a, w_b, tl.math.div_rn(ones, tl.where(total > 0.0, total, ones))

@triton.jit
def _merge_kernel(
    out_a_ptr,
    out_b_ptr,
    lse_a_ptr,
    lse_b_ptr,
    global_scale_ptr,
    packed_ptr,
    scales_ptr,
    stride_am,  # strides of out_a / out_b in units of STRIDE_UNIT element pairs
    stride_ah,
    stride_bm,
    stride_bh,
    lse_stride_am,
    lse_stride_ah,
    lse_stride_bm,
    lse_stride_bh,
    row_start,
    M,
    K,  # H * Dv
    scale_col_tiles,  # round_up(K/16, 4) / 4
    HEAD_BLOCKS: tl.constexpr,  # Dv / 16
    STRIDE_UNIT: tl.constexpr,  # 8 (strides given in 16-element blocks) or 1 (in pairs)
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program merges rows ``[pid_m * BLOCK_M, +BLOCK_M)`` x columns
    ``[pid_k * BLOCK_K, +BLOCK_K)`` of ``[M, H*Dv]``, as ``BLOCK_M * BLOCK_K / 16``
    blocks of 8 element pairs (block columns fastest, so neighbouring blocks are
    neighbouring memory), and writes row ``r`` to row ``row_start + r``. Each block
    lies in one head (``Dv % 16 == 0``), so it reads one LSE of each part. Blocks
    past ``K/16`` (the scale buffer's padding columns) read nothing and write a zero
    scale; blocks past ``M`` write nothing. Strides in 16-element blocks
    (``STRIDE_UNIT = 8``) and the packed row length as ``K/16 * 8`` show the compiler
    that every block starts 8 pairs aligned, for wide loads and stores."""
    BLOCKS: tl.constexpr = BLOCK_K // 16
    blocks = tl.arange(0, BLOCK_M * BLOCKS)
    rows = tl.program_id(0) * BLOCK_M + blocks // BLOCKS
    block_cols = tl.program_id(1) * BLOCKS + blocks % BLOCKS
    in_rows = rows < M
    in_data = in_rows & (block_cols < K // 16)
    rows64 = rows.to(tl.int64)
    heads = (block_cols // HEAD_BLOCKS).to(tl.int64)
    pairs = (block_cols % HEAD_BLOCKS)[:, None] * 8 + tl.arange(0, 8)[None, :]

    lse_a = tl.load(lse_a_ptr + rows64 * lse_stride_am + heads * lse_stride_ah, mask=in_data, other=float("-inf"))
    lse_b = tl.load(lse_b_ptr + rows64 * lse_stride_bm + heads * lse_stride_bh, mask=in_data, other=float("-inf"))
    w_a, w_b, inv_total = _merge_weights(lse_a, lse_b)
    a_even, a_odd = load_pairs(
        out_a_ptr, ((rows64 * stride_am + heads * stride_ah) * STRIDE_UNIT)[:, None] + pairs,
        (in_data & (lse_a != float("-inf")))[:, None],
    )
    b_even, b_odd = load_pairs(
        out_b_ptr, ((rows64 * stride_bm + heads * stride_bh) * STRIDE_UNIT)[:, None] + pairs,
        (in_data & (lse_b != float("-inf")))[:, None],
    )
    w_a, w_b, inv_total = w_a[:, None], w_b[:, None], inv_total[:, None]
    even = (a_even * w_a + b_even * w_b) * inv_total
    odd = (a_odd * w_a + b_odd * w_b) * inv_total

    packed, sf = quantize_pairs(even, odd, tl.load(global_scale_ptr))

    out_rows = rows64 + row_start
    packed_offsets = (out_rows[:, None] * (K // 16) + block_cols[:, None]) * 8 + tl.arange(0, 8)[None, :]
    tl.store(packed_ptr + packed_offsets, packed, mask=in_data[:, None])
    scale_offsets = swizzled_scale_offset(out_rows, block_cols, scale_col_tiles)
    tl.store(scales_ptr + scale_offsets, sf, mask=in_rows & (block_cols < scale_col_tiles * 4))


def _pair_aligned(out: Tensor) -> Tensor:
    """``out`` itself, or a fresh contiguous copy when it cannot be read in element pairs
    (even strides and a base aligned to two elements needed)."""
    misaligned = out.stride(0) % 2 or out.stride(1) % 2 or out.data_ptr() % (2 * out.element_size())
    return out.clone(memory_format=torch.contiguous_format) if misaligned else out


def _strides(out_a: Tensor, out_b: Tensor) -> tuple[list[int], int]:
    """The outputs' row and head strides for the kernel, and their unit in element pairs:
    16-element blocks (unit 8) when every stride is a multiple of 16, else pairs (unit 1)."""
    strides = [out_a.stride(0), out_a.stride(1), out_b.stride(0), out_b.stride(1)]
    block = nvfp4.BLOCK_SIZE
    if all(s % block == 0 for s in strides):
        return [s // block for s in strides], block // 2
    return [s // 2 for s in strides], 1


def merge_attention_nvfp4_launch(
    out_a: Tensor,
    lse_a: Tensor,
    out_b: Tensor,
    lse_b: Tensor,
    global_scale: Tensor,
    packed: Tensor,
    scales: Tensor,
    row_start: int,
    *,
    config: dict | None = None,
) -> None:
    """The Triton merge, one launch, arguments not validated and no host synchronization.

    Arguments as :func:`merge_attention_nvfp4` (the caller has checked them), with
    ``Dv % 16 == 0``. Outputs whose strides are odd or whose base is not aligned to
    two elements are copied first. ``config`` overrides :data:`MERGE_CONFIG` (tuning).
    """
    m, h, dv = out_a.shape
    k = h * dv
    if m == 0 or k == 0:
        return
    out_a, out_b = _pair_aligned(out_a), _pair_aligned(out_b)
    config = config or MERGE_CONFIG
    block_m, block_k = config["BLOCK_M"], config["BLOCK_K"]
    cols = nvfp4.round_up(k // nvfp4.BLOCK_SIZE, 4)
    grid = (triton.cdiv(m, block_m), triton.cdiv(cols * nvfp4.BLOCK_SIZE, block_k))
    strides, unit = _strides(out_a, out_b)
    _merge_kernel[grid](
        out_a, out_b, lse_a, lse_b, global_scale, packed, scales.view(torch.uint8),
        *strides, lse_a.stride(0), lse_a.stride(1), lse_b.stride(0), lse_b.stride(1),
        int(row_start), m, k, cols // 4,
        HEAD_BLOCKS=dv // nvfp4.BLOCK_SIZE, STRIDE_UNIT=unit, BLOCK_M=block_m, BLOCK_K=block_k,
        num_warps=config["num_warps"],
        enable_fp_fusion=False,  # the reference's separately rounded products and sum
    )

