"""Triton NVFP4 quantizer: ``[M, K]`` float16/bfloat16 -> packed e2m1 + e4m3 block scales.

The CUDA path of :func:`fusion_pass.kernels.quantize` and of the
``scaled_fp4_quant`` op. Bytes are those of the reference quantizer
(``NVFP4.md``): packed uint8 ``[M, K/2]`` and the block scales either 128x4
swizzled (``[round_up(M, 128), round_up(K/16, 4)]``) or linear (``[M, K/16]``),
padding entries written as zero. Blocks holding NaN or ±Inf follow
docs/nvfp4.md "NaN and infinity" (scale byte 0x7F and codes 0 for a NaN block;
a saturated scale and codes 0x7 / 0xF for infinities).

The same kernel also writes ``M`` rows at a row offset into the buffers of a
larger ``T``-row matrix, leaving every other row and the padding rows alone
(:func:`quantize_rows_launch`; ``docs/nvfp4.md``, "Writing a range of rows").

:func:`quantize_launch` and :func:`quantize_rows_launch` are the unvalidated launchers
(callers have checked the arguments: the public entry points are :func:`fusion_pass.kernels.quantize`
and :func:`fusion_pass.kernels.quantize_rows_into`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusion_pass import nvfp4
from fusion_pass.kernels.triton.nvfp4_math import load_pairs, quantize_pairs, swizzled_scale_offset

__all__ = ["QUANT_CONFIG", "quantize_launch", "quantize_rows_launch"]

QUANT_CONFIG = {"BLOCK_M": 16, "BLOCK_K": 512, "num_warps": 4}
"""Tile of one program (rows x columns) and its warps; chosen on the H200 (docs/benchmarks.md)."""


@triton.jit
def _nvfp4_quant_kernel(
    x_ptr,
    stride_xm,  # elements between rows; even, like K
    global_scale_ptr,
    packed_ptr,
    scales_ptr,
    row_start,  # row of the output buffers that row 0 of x goes to
    M,
    K,
    scale_rows,  # rows (of x) whose scales are written: round_up(M, 128) swizzled, M linear or to skip padding
    scale_cols,  # block columns of the scale buffer: round_up(K/16, 4) swizzled, K/16 linear
    SWIZZLED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program quantizes rows ``[pid_m * BLOCK_M, +BLOCK_M)`` x columns
    ``[pid_k * BLOCK_K, +BLOCK_K)`` of the (scale-padded) matrix, as
    ``BLOCK_M * BLOCK_K / 16`` blocks of 8 element pairs (block columns fastest,
    so neighbouring threads read neighbouring memory); rows and columns past
    ``M``/``K`` read as zero, so their scales are written as zero. Row ``r`` of
    ``x`` lands in row ``row_start + r`` of the output buffers (an added base)."""
    BLOCKS: tl.constexpr = BLOCK_K // 16
    blocks = tl.arange(0, BLOCK_M * BLOCKS)
    rows = tl.program_id(0) * BLOCK_M + blocks // BLOCKS
    block_cols = tl.program_id(1) * BLOCKS + blocks % BLOCKS
    pair_cols = block_cols[:, None] * 8 + tl.arange(0, 8)[None, :]
    in_x = (rows < M) & (block_cols < K // 16)
    rows64 = rows.to(tl.int64)
    even, odd = load_pairs(x_ptr, rows64[:, None] * (stride_xm // 2) + pair_cols, in_x[:, None])

    packed, sf = quantize_pairs(even, odd, tl.load(global_scale_ptr))

    out_rows = rows64 + row_start
    tl.store(packed_ptr + out_rows[:, None] * (K // 2) + pair_cols, packed, mask=in_x[:, None])
    if SWIZZLED:
        offsets = swizzled_scale_offset(out_rows, block_cols, scale_cols // 4)
    else:
        offsets = out_rows * scale_cols + block_cols
    tl.store(scales_ptr + offsets, sf, mask=(rows < scale_rows) & (block_cols < scale_cols))


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself, or a fresh copy when the kernel cannot read it in element pairs (unit
    stride along K, an even row stride and a base aligned to two elements needed)."""
    if x.stride(1) != 1 or x.stride(0) % 2 != 0 or x.data_ptr() % (2 * x.element_size()) != 0:
        return x.clone(memory_format=torch.contiguous_format)  # contiguous() keeps a misaligned base
    return x


def _launch(x, global_scale, packed, scale_bytes, row_start, scale_rows, scale_cols, swizzled, config) -> None:
    """One launch over rows ``[0, scale_rows)`` of ``x`` (rows ``>= M`` only write zero scales)."""
    m, k = x.shape
    config = config or QUANT_CONFIG
    block_m, block_k = config["BLOCK_M"], config["BLOCK_K"]
    grid = (triton.cdiv(scale_rows, block_m), triton.cdiv(scale_cols * 16, block_k))
    _nvfp4_quant_kernel[grid](
        x,
        x.stride(0),
        global_scale,
        packed,
        scale_bytes,
        row_start,
        m,
        k,
        scale_rows,
        scale_cols,
        SWIZZLED=swizzled,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        num_warps=config["num_warps"],
    )


def quantize_launch(
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
        x: float16 / bfloat16 / float32 ``[M, K]``, ``K % 16 == 0``, unit stride along K,
            an even row stride and a base aligned to two elements (copied otherwise).
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
    x = _aligned(x)
    rows, cols = nvfp4.scale_shape(m, k, swizzled=swizzled)
    if packed is None:
        packed = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    if scales is None:
        scales = torch.empty((rows, cols), dtype=torch.uint8, device=x.device)
    scale_bytes = scales.view(torch.uint8)
    if m == 0 and rows == 0:
        return packed, scale_bytes.view(rows, cols).view(torch.float8_e4m3fn)
    _launch(x, global_scale, packed.view(torch.uint8), scale_bytes, 0, rows, cols, swizzled, config)
    return packed.view(m, k // 2), scale_bytes.view(rows, cols).view(torch.float8_e4m3fn)


def quantize_rows_launch(
    x: torch.Tensor,
    global_scale: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    row_start: int,
    *,
    config: dict | None = None,
) -> None:
    """Quantize ``x [M, K]`` into rows ``[row_start, row_start + M)`` of a ``T``-row buffer pair
    (one Triton launch, arguments not validated: see
    :func:`fusion_pass.kernels.quantize_rows_into`).

    ``packed`` is contiguous uint8 ``[T, K/2]``, ``scales`` the contiguous 128x4 swizzled
    buffer of ``T`` rows (int32, uint8 or float8_e4m3fn); ``0 <= row_start <= T - M``.
    Writes the packed bytes and the scale bytes (padding columns included) of those
    rows only: no other row, no padding row. Bytes as :func:`fusion_pass.nvfp4.quantize_rows_into`.
    """
    m, k = x.shape
    if m == 0 or k == 0:
        return
    cols = nvfp4.scale_shape(packed.shape[0], k)[1]
    _launch(_aligned(x), global_scale, packed, scales.view(torch.uint8), int(row_start), m, cols, True, config)
