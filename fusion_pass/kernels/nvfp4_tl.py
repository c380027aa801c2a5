"""NVFP4 building blocks in Triton, shared by the quantizer and the attention epilogue.

Hopper has no FP4 instructions: the e4m3 block scale, the e2m1 rounding and the
packing are ordinary float/integer operations here. The arithmetic is the
reference's (:func:`fusion_pass.nvfp4.quantize`) step for step, with IEEE
round-to-nearest divisions (``div_rn``), so the bytes are the same.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Globals a @triton.jit function reads must be tl.constexpr instances.
BLOCK_SIZE = tl.constexpr(16)  # elements along K sharing one block scale
E4M3_MAX = tl.constexpr(448.0)  # largest float8_e4m3fn value: block scales saturate here
E2M1_MAX = tl.constexpr(6.0)  # largest e2m1 magnitude


@triton.jit
def round_to_e4m3(v):
    """Round float32 ``v`` in ``[0, 448]`` to the nearest float8_e4m3fn value (ties to even),
    as float32.

    Done in float32/integer arithmetic rather than by the cast, whose rounding
    Triton's interpreter gets wrong when the mantissa carries into the exponent
    (124 -> 64). Normal range (``v >= 2^-6``): keep 3 mantissa bits of the float32
    with round-to-nearest-even on the bit pattern (a carry moves the exponent,
    as it should). Subnormal range: multiples of 2^-9, via ``(v + 2^14) - 2^14``
    (float32 adds round to nearest even; ``ulp(2^14) = 2^-9``).
    """
    bits = v.to(tl.uint32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & 0xFFF00000).to(tl.float32, bitcast=True)
    subnormal = (v + 16384.0) - 16384.0
    return tl.where(v < 0.015625, subnormal, normal)


@triton.jit
def block_scales(amax, global_scale):
    """Block scale from each block's float32 ``amax``, and its inverse.

    Returns ``(sf, inv)``, both float32: ``sf = e4m3(min(gs * amax / 6, 448))``
    (an exact float8_e4m3fn value) and ``inv = gs / sf``, 0 where ``sf`` is 0.
    """
    scaled = tl.math.div_rn(global_scale * amax, tl.full(amax.shape, E2M1_MAX, tl.float32))
    sf = round_to_e4m3(tl.minimum(scaled, E4M3_MAX))
    safe = tl.where(sf == 0.0, 1.0, sf)
    inv = tl.where(sf == 0.0, 0.0, tl.math.div_rn(global_scale + tl.zeros_like(safe), safe))
    return sf, inv


@triton.jit
def e2m1_codes(q):
    """float32 -> e2m1 codes (uint8, 0..15): nearest, ties to the even code, saturating at 6.

    The thresholds are the midpoints between magnitudes; ``>`` sends a tie down,
    ``>=`` up, so each tie lands on the even code. The sign bit is taken from the
    float's bits, so ``-0.0`` and negatives that round to zero give code 8.
    """
    a = tl.abs(q)
    index = (
        (a > 0.25).to(tl.uint8)
        + (a >= 0.75).to(tl.uint8)
        + (a > 1.25).to(tl.uint8)
        + (a >= 1.75).to(tl.uint8)
        + (a > 2.5).to(tl.uint8)
        + (a >= 3.5).to(tl.uint8)
        + (a > 5.0).to(tl.uint8)
    )
    sign = (q.to(tl.int32, bitcast=True) < 0).to(tl.uint8)
    return index | (sign << 3)


@triton.jit
def quantize_tile(x, global_scale, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Quantize a float32 tile ``x [ROWS, COLS]`` (``COLS % 16 == 0``) to NVFP4.

    Returns ``(packed uint8 [ROWS, COLS/2], sf uint8 [ROWS, COLS/16])``: ``sf``
    holds the float8_e4m3fn bytes of the block scales; byte ``j`` of a ``packed``
    row holds element ``2j`` in its low nibble.
    """
    blocks = tl.reshape(x, (ROWS, COLS // BLOCK_SIZE, BLOCK_SIZE))
    amax = tl.max(tl.abs(blocks), axis=2)
    sf, inv = block_scales(amax, global_scale)
    codes = e2m1_codes(blocks * inv[:, :, None])
    pairs = tl.reshape(codes, (ROWS, COLS // 2, 2))
    low, high = tl.split(pairs)
    return low | (high << 4), sf.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def swizzled_scale_offset(row, col, scale_col_tiles):
    """Byte offset of the scale of (``row``, block column ``col``) in the 128x4 swizzled
    layout (NVFP4.md); ``scale_col_tiles = round_up(K/16, 4) / 4``."""
    tile = (row // 128) * scale_col_tiles + col // 4
    return tile * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4 + col % 4
