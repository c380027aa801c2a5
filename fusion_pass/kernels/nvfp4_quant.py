"""Triton NVFP4 quantizer: ``[M, K]`` float16/bfloat16 -> packed e2m1 + e4m3 block scales.

The CUDA path of :func:`fusion_pass.nvfp4.quantize` and of the
``scaled_fp4_quant`` op. Bytes are those of the reference quantizer
(``NVFP4.md``): packed uint8 ``[M, K/2]`` and the block scales either 128x4
swizzled (``[round_up(M, 128), round_up(K/16, 4)]``) or linear (``[M, K/16]``),
padding entries written as zero.

:func:`quantize` is the unvalidated launcher (callers have checked the
arguments: the public entry points are in :mod:`fusion_pass.kernels`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusion_pass import nvfp4
from fusion_pass.kernels.nvfp4_tl import quantize_tile, swizzled_scale_offset

__all__ = ["quantize", "QUANT_CONFIG"]

QUANT_CONFIG = {"BLOCK_M": 32, "BLOCK_K": 256, "num_warps": 8}
"""Tile of one program (rows x columns) and its warps; chosen on the H200 (docs/benchmarks.md)."""


@triton.jit
def _nvfp4_quant_kernel(
    x_ptr,
    stride_xm,
    global_scale_ptr,
    packed_ptr,
    scales_ptr,
    M,
    K,
    scale_rows,  # rows of the scale buffer: round_up(M, 128) swizzled, M linear
    scale_cols,  # block columns of the scale buffer: round_up(K/16, 4) swizzled, K/16 linear
    SWIZZLED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program quantizes rows ``[pid_m * BLOCK_M, +BLOCK_M)`` x columns
    ``[pid_k * BLOCK_K, +BLOCK_K)`` of the (scale-padded) matrix; rows and
    columns past ``M``/``K`` read as zero, so their scales are written as zero."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    in_x = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=in_x, other=0.0)
    global_scale = tl.load(global_scale_ptr)

    packed, sf = quantize_tile(x.to(tl.float32), global_scale, BLOCK_M, BLOCK_K)

    byte_cols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    tl.store(
        packed_ptr + rows[:, None].to(tl.int64) * (K // 2) + byte_cols[None, :],
        packed,
        mask=(rows[:, None] < M) & (byte_cols[None, :] < K // 2),
    )

    block_cols = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    if SWIZZLED:
        offsets = swizzled_scale_offset(rows[:, None].to(tl.int64), block_cols[None, :], scale_cols // 4)
    else:
        offsets = rows[:, None].to(tl.int64) * scale_cols + block_cols[None, :]
    in_scales = (rows[:, None] < scale_rows) & (block_cols[None, :] < scale_cols)
    tl.store(scales_ptr + offsets, sf, mask=in_scales)


def quantize(
    x: torch.Tensor,
    global_scale: torch.Tensor,
    *,
    swizzled: bool = True,
    packed: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to NVFP4 with one Triton launch (arguments not validated).

    Args:
        x: float16 / bfloat16 / float32 ``[M, K]``, ``K % 16 == 0``, unit stride along K.
        global_scale: float32, one element, on ``x``'s device.
        swizzled: 128x4 swizzled scales (default) or linear ``[M, K/16]``.
        packed: optional uint8 buffer of ``M * K/2`` elements to write into.
        scales: optional buffer of the scale layout's byte count (float8_e4m3fn,
            uint8, or int32 as vLLM allocates it) to write into.
        config: overrides :data:`QUANT_CONFIG` (tuning).

    Returns:
        ``(packed uint8 [M, K/2], scales float8_e4m3fn [rows, cols])``; every byte
        written, padding scales zero.
    """
    m, k = x.shape
    rows, cols = nvfp4.scale_shape(m, k, swizzled=swizzled)
    if packed is None:
        packed = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    if scales is None:
        scales = torch.empty((rows, cols), dtype=torch.uint8, device=x.device)
    scale_bytes = scales.view(torch.uint8)
    if m == 0 and rows == 0:
        return packed, scale_bytes.view(rows, cols).view(torch.float8_e4m3fn)
    config = config or QUANT_CONFIG
    block_m, block_k = config["BLOCK_M"], config["BLOCK_K"]
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols * 16, block_k))
    _nvfp4_quant_kernel[grid](
        x,
        x.stride(0),
        global_scale,
        packed.view(torch.uint8),
        scale_bytes,
        m,
        k,
        rows,
        cols,
        SWIZZLED=swizzled,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        num_warps=config["num_warps"],
    )
    return packed.view(m, k // 2), scale_bytes.view(rows, cols).view(torch.float8_e4m3fn)
