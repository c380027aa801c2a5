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

Two kernels, same bytes: the block kernel (float16 / bfloat16: a thread per 16-element block,
one magic add per element; docs/nvfp4.md, "The Triton quantizer's design"), tiles by input size
(:data:`QUANT_CONFIGS`, :func:`select_config`); and the element-pair kernel (float32 inputs, packed
buffers not 8-byte aligned; :data:`LEGACY_CONFIG`).

:func:`quantize_launch` and :func:`quantize_rows_launch` are the unvalidated launchers
(callers have checked the arguments: the public entry points are :func:`fusion_pass.kernels.quantize`
and :func:`fusion_pass.kernels.quantize_rows_into`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusion_pass import nvfp4
from fusion_pass.kernels.triton.nvfp4_math import load_pairs, quantize_pairs, quantize_words, swizzled_scale_offset

__all__ = ["LEGACY_CONFIG", "QUANT_CONFIGS", "quantize_launch", "quantize_rows_launch", "select_config"]

LEGACY_CONFIG = {"kernel": "pairs", "BLOCK_M": 16, "BLOCK_K": 512, "num_warps": 4}
"""The element-pair kernel (float32 inputs, and the sweep's "before" line): tile of one program
(rows x columns) and its warps."""

QUANT_CONFIGS = (  # (input bytes at least, config): the first entry whose bound the input reaches
    (40 << 20, {"kernel": "words", "BLOCK_M": 8, "BLOCK_C": 64, "num_warps": 4}),
    (0, {"kernel": "words", "BLOCK_M": 8, "BLOCK_C": 32, "num_warps": 4}),
)
"""Tiles of the block kernel for float16 / bfloat16 inputs by input size (bytes), largest first;
``BLOCK_M`` rows x ``BLOCK_C`` 16-element blocks per program, one block per thread at a time.
Chosen statically (no autotuning at the first call of a server) from ``bench/quantize_sweep.py --quick`` on
an H200, 2026-12-01: 8x64 fastest at 64, 256 and 512 MiB, 8x32 at 16 MiB (docs/benchmarks.md)."""

_INT32_LIMIT = 2**31


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


@triton.jit
def _nvfp4_quant_words_kernel(
    x_ptr,  # float16 / bfloat16 [M, K]
    stride_x,  # between rows: in 16-byte units when ROW_ALIGNED, else in 32-bit words
    global_scale_ptr,
    packed_ptr,  # uint8 [T, K/2], 8-byte aligned, written as uint32 pairs
    scales_ptr,
    row_start,  # row of the output buffers that row 0 of x goes to
    M,
    n_blocks,  # K / 16
    scale_rows,  # rows (of x) whose scales are written: round_up(M, 128) swizzled, M linear or to skip padding
    scale_cols,  # block columns of the scale buffer: round_up(K/16, 4) swizzled, K/16 linear
    SWIZZLED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HW_E4M3: tl.constexpr,
    ROW_ALIGNED: tl.constexpr,  # rows start 16-byte aligned: 128-bit loads
):
    """One program quantizes rows ``[pid_m * BLOCK_M, +BLOCK_M)`` x block columns
    ``[pid_c * BLOCK_C, +BLOCK_C)`` of the (scale-padded) matrix; each thread holds whole
    16-element blocks (two 16-byte loads, one 8-byte store of packed codes, one scale byte),
    neighbouring threads neighbouring blocks of a row. Rows and columns past ``M`` / ``K/16``
    read as zero, so their scales are written as zero. Row ``r`` of ``x`` lands in row
    ``row_start + r`` of the output buffers. Tiles are indexed (column, row), so that Triton
    lays the threads of a warp along a row. Offsets inside a tile are int32; each program's
    first row is added to the pointers in int64."""
    stride_w = stride_x * 4 if ROW_ALIGNED else stride_x  # the product tells Triton rows are 16-byte aligned
    row0 = tl.program_id(0) * BLOCK_M
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_x = (cols < n_blocks)[:, None] & ((row0 + rows) < M)[None, :]  # [BLOCK_C, BLOCK_M]
    x_words = x_ptr.to(tl.pointer_type(tl.uint32)) + row0.to(tl.int64) * stride_w
    offsets = (cols[:, None] * 8 + rows[None, :] * stride_w)[:, :, None] + tl.arange(0, 4)[None, None, :]
    words_lo = tl.load(x_words + offsets, mask=in_x[:, :, None], other=0)
    words_hi = tl.load(x_words + offsets + 4, mask=in_x[:, :, None], other=0)

    lo, hi, sf = quantize_words(words_lo, words_hi, tl.load(global_scale_ptr), x_ptr.dtype.element_ty, HW_E4M3)

    out_row0 = row_start + row0
    out_words = packed_ptr.to(tl.pointer_type(tl.uint32)) + out_row0.to(tl.int64) * (n_blocks * 2)
    out_offsets = (cols[:, None] * 2 + rows[None, :] * (n_blocks * 2))[:, :, None] + tl.arange(0, 2)[None, None, :]
    tl.store(out_words + out_offsets, tl.join(lo, hi), mask=in_x[:, :, None])
    in_scales = (cols < scale_cols)[:, None] & ((row0 + rows) < scale_rows)[None, :]
    if SWIZZLED:
        # the tile's rows from the start of the 128-row band holding its first row
        band_base = scales_ptr + (out_row0 // 128).to(tl.int64) * scale_cols * 128
        offsets = swizzled_scale_offset((out_row0 % 128 + rows)[None, :], cols[:, None], scale_cols // 4)
        tl.store(band_base + offsets, sf, mask=in_scales)
    else:
        base = scales_ptr + out_row0.to(tl.int64) * scale_cols
        tl.store(base + cols[:, None] + rows[None, :] * scale_cols, sf, mask=in_scales)


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself, or a fresh copy when the kernel cannot read it in element pairs (unit
    stride along K, an even row stride and a base aligned to two elements needed)."""
    if x.stride(1) != 1 or x.stride(0) % 2 != 0 or x.data_ptr() % (2 * x.element_size()) != 0:
        return x.clone(memory_format=torch.contiguous_format)  # contiguous() keeps a misaligned base
    return x


def select_config(x: torch.Tensor) -> dict:
    """The tile configuration for quantizing ``x``: :data:`LEGACY_CONFIG` for float32, else the
    :data:`QUANT_CONFIGS` entry of its size class."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        return LEGACY_CONFIG
    nbytes = x.numel() * x.element_size()
    return next(config for bound, config in QUANT_CONFIGS if nbytes >= bound)


def _words_usable(x: torch.Tensor, packed: torch.Tensor, config: dict) -> bool:
    """Whether the block kernel can run: 16-bit input, packed codes written as aligned 32-bit words,
    and a tile's offsets within int32."""
    return (
        x.dtype in (torch.float16, torch.bfloat16)
        and packed.data_ptr() % 8 == 0
        and config["BLOCK_M"] * (x.stride(0) // 2) + (x.shape[1] // 16 + 3 + config["BLOCK_C"]) * 8 < _INT32_LIMIT
    )


def _launch(x, global_scale, packed, scale_bytes, row_start, scale_rows, scale_cols, swizzled, config) -> None:
    """One launch over rows ``[0, scale_rows)`` of ``x`` (rows ``>= M`` only write zero scales)."""
    m, k = x.shape
    config = config or select_config(x)
    if config.get("kernel", "pairs") == "words" and not _words_usable(x, packed, config):
        config = LEGACY_CONFIG
    if config.get("kernel", "pairs") == "words":
        stride_w = x.stride(0) // 2
        row_aligned = stride_w % 4 == 0 and x.data_ptr() % 16 == 0
        block_m, block_c = config["BLOCK_M"], config["BLOCK_C"]
        grid = (triton.cdiv(scale_rows, block_m), triton.cdiv(scale_cols, block_c))
        _nvfp4_quant_words_kernel[grid](
            x, stride_w // 4 if row_aligned else stride_w, global_scale, packed, scale_bytes, row_start, m, k // 16,
            scale_rows, scale_cols,
            SWIZZLED=swizzled, BLOCK_M=block_m, BLOCK_C=block_c,
            HW_E4M3=x.is_cuda,  # the interpreter's (CPU tensors) float -> e4m3 cast does not round to nearest even
            ROW_ALIGNED=row_aligned,
            num_warps=config["num_warps"], num_stages=config.get("num_stages", 1),
        )
        return
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
        config: overrides :func:`select_config`'s choice (tuning; ``{"kernel": "pairs", ...}`` is
            the element-pair kernel, :data:`LEGACY_CONFIG`).

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
