"""Shapes and the 128x4 swizzled scale layout of NVFP4 (docs/nvfp4.md, "Scale layout").

Constants of the format, buffer shapes, the swizzled offset of a scale, and the swizzle itself.
Plain tensor ops: runs on any device, under ``FakeTensorMode`` and under torch.compile.
"""

from __future__ import annotations

import numbers

import torch

BLOCK_SIZE = 16
"""Number of consecutive elements along K that share one scale."""

E2M1_MAX = 6.0
"""Largest magnitude representable by an e2m1 code."""

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value; block scales saturate here."""

E4M3_MIN_SUBNORMAL = 2.0**-9
"""Smallest nonzero float8_e4m3fn magnitude: the smallest nonzero block scale."""

GLOBAL_SCALE_MAX = torch.finfo(torch.float32).max * E4M3_MIN_SUBNORMAL
"""Largest global scale (about 6.6e35, exactly ``(2 - 2**-23) * 2**118``) for which ``inv = gs / sf`` is a
finite float32 for every nonzero block scale ``sf >= 2**-9``. Above it ``inv`` overflows to ``+Inf`` for blocks
with the smallest scales and their codes are those of ``x * Inf`` (NaN for zeros): the checks refuse such a
global scale where they read its value (docs/nvfp4.md, "Inputs")."""

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitudes of e2m1 codes 0..7 (codes 8..15 are the same values, negated)."""

# Largest |q - value| over all q that round to a code, per magnitude index.
# For code 7 (6.0) only the non-saturating side (5, 6] is counted.
HALF_STEPS = (0.25, 0.25, 0.25, 0.25, 0.5, 0.5, 1.0, 1.0)

FP8 = torch.float8_e4m3fn
E4M3_NAN_BYTE = 0x7F  # float8_e4m3fn NaN (S.1111.111), the scale byte of a block holding a NaN
X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SWIZZLE_ROWS = 128  # rows per swizzle tile
SWIZZLE_COLS = 4  # block columns per swizzle tile

def round_up(x: int, m: int) -> int:
    """Smallest multiple of ``m`` that is >= ``x``. Works for ints and SymInts."""
    return (x + m - 1) // m * m


def scale_shape(m: int, k: int, *, swizzled: bool = True) -> tuple[int, int]:
    """Shape of the float8_e4m3fn scale buffer for an ``[m, k]`` input.

    Swizzled: ``(round_up(m, 128), round_up(k // 16, 4))``; linear: ``(m, k // 16)``.
    ``k`` must be a multiple of 16.
    """
    if isinstance(k, numbers.Integral) and k % BLOCK_SIZE != 0:  # numpy integers too; a SymInt is not checked
        raise ValueError(f"scale_shape: k must be divisible by {BLOCK_SIZE} (got {k})")
    n_blocks = k // BLOCK_SIZE
    if not swizzled:
        return (m, n_blocks)
    return (round_up(m, SWIZZLE_ROWS), round_up(n_blocks, SWIZZLE_COLS))


def swizzled_offset(m, c, n_blocks: int):
    """Flat byte offset of the scale of (row ``m``, block column ``c``).

    Implements the formula of NVFP4.md for a swizzled buffer whose rows hold
    ``round_up(n_blocks, 4)`` scales. ``m`` and ``c`` may be ints or integer
    tensors (broadcast together).
    """
    kt = round_up(n_blocks, SWIZZLE_COLS) // SWIZZLE_COLS
    tile = (m // 128) * kt + c // 4
    return tile * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + c % 4


def row_scale_offsets(start: int, stop: int, n_blocks: int, device=None) -> torch.Tensor:
    """Flat byte offsets (int64 ``[(stop - start) * round_up(n_blocks, 4)]``, row by row) of every scale of
    rows ``[start, stop)`` in a swizzled buffer whose rows hold ``n_blocks`` block scales, the padding
    columns included: the bytes that belong to those rows and to no other."""
    rows = torch.arange(start, stop, device=device)
    cols = torch.arange(round_up(n_blocks, SWIZZLE_COLS), device=device)
    return swizzled_offset(rows[:, None], cols[None, :], n_blocks).reshape(-1)


def swizzle_scales(scales_linear: torch.Tensor) -> torch.Tensor:
    """Linear ``[M, K/16]`` fp8 scales -> swizzled ``[round_up(M,128), round_up(K/16,4)]``.

    The input is zero-padded to the buffer shape, viewed as
    ``[Mp/128, 4, 32, Kt, 4]`` (tile row, row group, row in group, tile column,
    column in tile) and permuted to ``[Mp/128, Kt, 32, 4, 4]``; the bytes of that
    array, read in order, are the swizzled buffer. Padding entries are zero.
    """
    if scales_linear.dtype != FP8 or scales_linear.dim() != 2:
        raise ValueError(
            "swizzle_scales: scales_linear must be a 2-D float8_e4m3fn tensor "
            f"(got dtype {scales_linear.dtype}, shape {list(scales_linear.shape)})"
        )
    m, n_blocks = scales_linear.shape
    mp, np_ = scale_shape(m, n_blocks * BLOCK_SIZE, swizzled=True)
    # Byte-level work on a uint8 view: float8 support for pad/copy varies by device.
    padded = scales_linear.new_zeros((mp, np_), dtype=torch.uint8)
    padded[:m, :n_blocks] = scales_linear.view(torch.uint8)
    tiles = padded.reshape(mp // 128, 4, 32, np_ // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().reshape(mp, np_).view(FP8)


def unswizzle_scales(swizzled: torch.Tensor, m: int, n_blocks: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`: swizzled buffer -> linear ``[m, n_blocks]``.

    ``swizzled`` is float8_e4m3fn ``[R, round_up(n_blocks, 4)]`` with ``R`` a
    multiple of 128 and ``R >= m``.
    """
    if swizzled.dtype != FP8 or swizzled.dim() != 2:
        raise ValueError(
            "unswizzle_scales: swizzled must be a 2-D float8_e4m3fn tensor "
            f"(got dtype {swizzled.dtype}, shape {list(swizzled.shape)})"
        )
    rows, cols = swizzled.shape
    if cols != round_up(n_blocks, 4) or rows % 128 != 0 or rows < m:
        raise ValueError(
            f"unswizzle_scales: swizzled must have shape [R, {round_up(n_blocks, 4)}] with R "
            f"a multiple of 128 and R >= m={m} (got shape {list(swizzled.shape)})"
        )
    tiles = swizzled.view(torch.uint8).reshape(rows // 128, cols // 4, 32, 4, 4)
    linear = tiles.permute(0, 3, 2, 1, 4).reshape(rows, cols)
    return linear[:m, :n_blocks].contiguous().view(FP8)


def byte_views(packed: torch.Tensor, scales: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An NVFP4 buffer pair of ``rows`` rows as bytes: ``packed`` as uint8 ``[rows, K/2]`` and the swizzled
    ``scales`` (int32, uint8 or float8_e4m3fn) as uint8 ``[round_up(rows, 128), round_up(K/16, 4)]``.
    Views: writes through them land in the given buffers."""
    packed_bytes = packed.view(torch.uint8).view(rows, -1)
    return packed_bytes, scales.view(torch.uint8).view(round_up(rows, SWIZZLE_ROWS), -1)
