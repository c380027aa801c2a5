"""NVFP4 building blocks in Triton, shared by the quantizer, the attention epilogue and the merge.

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
    """float32 -> e2m1 codes (int32, 0..15): nearest, ties to the even code, saturating at 6.

    Magnitudes below 1 are multiples of 0.5: ``(a + 2^22) - 2^22`` rounds to
    them (float32 adds round to nearest even; ``ulp(2^22) = 0.5``). From 1 up the
    e2m1 values are floats with one mantissa bit: round the float32 bit pattern
    to nearest even at bit 22; ``bits >> 22`` is then ``exponent * 2 + mantissa``,
    which is the code plus 252 (1.0 -> 254 -> code 2, ..., 6.0 -> 259 -> code 7).
    The sign bit comes from the float's bits, so ``-0.0`` and negatives that
    round to zero give code 8.
    """
    bits = q.to(tl.uint32, bitcast=True)
    a = tl.minimum(tl.abs(q), E2M1_MAX)
    small = ((a + 4194304.0) - 4194304.0) * 2.0
    a_bits = a.to(tl.uint32, bitcast=True)
    large = ((a_bits + 0x1FFFFF + ((a_bits >> 22) & 1)) >> 22) - 252
    index = tl.where(a < 1.0, small.to(tl.uint32), large)
    return index | ((bits >> 31) << 3)


@triton.jit
def load_pairs(x_ptr, pair_offsets, mask):
    """Elements ``2p`` and ``2p + 1`` of ``x`` for pair offsets ``p``, as float32.

    Each pair is read as one word (4 bytes for 16-bit inputs, 8 for float32), so a
    thread holds both elements of a packed byte without reshaping the tile.
    """
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    if dtype == tl.float32:
        words = tl.load(x_ptr.to(tl.pointer_type(tl.uint64)) + pair_offsets, mask=mask, other=0)
        even = (words & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
        odd = (words >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
    else:
        words = tl.load(x_ptr.to(tl.pointer_type(tl.uint32)) + pair_offsets, mask=mask, other=0)
        even = (words & 0xFFFF).to(tl.uint16).to(dtype, bitcast=True).to(tl.float32)
        odd = (words >> 16).to(tl.uint16).to(dtype, bitcast=True).to(tl.float32)
    return even, odd


@triton.jit
def quantize_pairs(even, odd, global_scale):
    """Quantize 16-element blocks given as their even and odd elements.

    ``even``/``odd``: float32 ``[N, 8]``: block ``n`` holds elements
    ``even[n, j]`` (element ``2j`` of the block) and ``odd[n, j]`` (element
    ``2j + 1``). Returns ``(packed uint8 [N, 8], sf uint8 [N])``:
    byte ``j`` of a block holds element ``2j`` in its low nibble, ``sf`` the
    float8_e4m3fn bytes of the block scales.

    Taking the elements as pairs keeps the two codes of a byte in one thread:
    no reshape or split of the tile is needed.

    NaN and infinity (docs/nvfp4.md): a block holding a NaN is written as scale
    byte ``0x7F`` and packed bytes 0. ``amax`` is the integer maximum of the
    magnitudes' bit patterns, which orders non-negative floats like their values
    and puts every NaN (``> 0x7F800000``) above ``+Inf``: one reduction finds
    both, independent of the NaN semantics of float max/min (Triton's
    interpreter propagates NaN through ``tl.maximum`` and ignores it in
    ``tl.max``; compiled, both ignore it). ``±Inf`` needs nothing special: the
    scale saturates at 448 and ``±Inf * inv`` saturates to code 0x7 / 0xF.
    """
    magnitude = tl.maximum(even.to(tl.uint32, bitcast=True) & 0x7FFFFFFF, odd.to(tl.uint32, bitcast=True) & 0x7FFFFFFF)
    amax_bits = tl.max(magnitude, axis=1)
    nan_block = amax_bits > 0x7F800000
    amax = tl.where(nan_block, 0, amax_bits).to(tl.float32, bitcast=True)  # NaN blocks: finite arithmetic
    sf, inv = block_scales(amax, global_scale)
    inv = inv[:, None]
    packed = e2m1_codes(even * inv) | (e2m1_codes(odd * inv) << 4)
    packed = tl.where(nan_block[:, None], 0, packed)
    sf_bytes = tl.where(nan_block, 0x7F, sf.to(tl.float8e4nv).to(tl.uint8, bitcast=True))
    return packed.to(tl.uint8), sf_bytes.to(tl.uint8)


@triton.jit
def swizzled_scale_offset(row, col, scale_col_tiles):
    """Byte offset of the scale of (``row``, block column ``col``) in the 128x4 swizzled
    layout (NVFP4.md); ``scale_col_tiles = round_up(K/16, 4) / 4``."""
    tile = (row // 128) * scale_col_tiles + col // 4
    return tile * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4 + col % 4
