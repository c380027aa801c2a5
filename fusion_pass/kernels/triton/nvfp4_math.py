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
def e2m1_nibble(q):
    """float32 -> e2m1 code in bits 0-3 of a uint32 (nearest, ties to the even code, saturating
    at 6; bit 3 the sign of ``q``); bits 4-7 are zero, bits 8 and up are not part of the result.

    One rounding add does the work: ``t = a + M`` with ``a = min(|q|, 6)`` and a magic ``M``
    whose float32 ulp is the e2m1 step of ``a``'s range (0.5 below 2, 1 up to 4, 2 above),
    ``M = 2^22``, ``2^23 + 2`` or ``2^24 + 8``, plus 8 ulps when ``q`` is negative. The add
    rounds ``a`` to that step (IEEE round to nearest even: the parity of the integer in
    ``t``'s mantissa is the parity of the rounded step count, since the offsets are even),
    and the low mantissa bits of ``t`` are then the code: ``2a`` below 2, ``a + 2`` up to 4,
    ``a / 2 + 4`` above, and ``+8`` for the sign. The range comes from the exponent of
    ``a * a + 11.75`` (130 below about 2.06, 131 below 4.5, 132 up to 6) rather than of
    ``a``: one fused multiply-add instead of a clamp of the exponent. Both steps are valid
    near the range edges (``a`` in ``[1.75, 2.25]`` rounds the same with the steps 0.5 and 1,
    ``a`` in ``[3.5, 4.5]`` with the steps 1 and 2), so the rounding of that product does
    not matter. Integer and float adds only: no comparison, select or conversion per element.
    """
    a = tl.minimum(tl.abs(q), E2M1_MAX)
    # The shifts as high halves of products (bits >> 23, bits >> 31): integer multiply-adds, which
    # run beside the comparisons, shifts and logic of the rest. (band + 0x253FFF7E) * 0x800002 is
    # 0x4A800000 + (band - 130) * 0x800002 modulo 2^32, so the constant rides in the multiply-add.
    band = tl.umulhi((a * a + 11.75).to(tl.uint32, bitcast=True), 512) + 0x253FFF7E
    negative = tl.umulhi(q.to(tl.uint32, bitcast=True), 2)
    magic = band * 0x800002 + negative * 8
    return (a + magic.to(tl.float32, bitcast=True)).to(tl.uint32, bitcast=True)


@triton.jit
def e2m1_codes(q):
    """float32 -> e2m1 codes (uint32, 0..15): nearest, ties to the even code, saturating at 6.

    The sign bit comes from the float's bits, so ``-0.0`` and negatives that
    round to zero give code 8. See :func:`e2m1_nibble` for how.
    """
    return e2m1_nibble(q) & 0xF


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
def _max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _split4(x):
    """``[..., 4]`` -> its 4 slices along the last axis, in order (each ``[...]``); no data movement
    when the axis lies in one thread."""
    lo, hi = tl.split(tl.reshape(x, x.shape[:-1] + [2, 2]))  # elements 2i, 2i + 1
    x0, x2 = tl.split(lo)
    x1, x3 = tl.split(hi)
    return x0, x1, x2, x3


@triton.jit
def _unpack16(words, DTYPE: tl.constexpr):
    """Words of two 16-bit floats (``DTYPE``) -> (low halves, high halves) as float32."""
    if DTYPE == tl.bfloat16:
        even = (words << 16).to(tl.float32, bitcast=True)
        odd = (words & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        even = (words & 0xFFFF).to(tl.uint16).to(DTYPE, bitcast=True).to(tl.float32)
        odd = (words >> 16).to(tl.uint16).to(DTYPE, bitcast=True).to(tl.float32)
    return even, odd


@triton.jit
def _pack_half(words, inv, DTYPE: tl.constexpr):
    """Packed codes of 8 elements given as 4 words of element pairs (``[..., 4]``): a uint32 with
    element ``i`` in bits ``4i .. 4i + 3``, built by funnel shifts (``(acc >> 4) | (code << 28)``)."""
    w0, w1, w2, w3 = _split4(words)
    acc = tl.zeros_like(w0)
    for word in tl.static_range(4):
        w = w0 if word == 0 else (w1 if word == 1 else (w2 if word == 2 else w3))
        even, odd = _unpack16(w, DTYPE)
        acc = (acc >> 4) | (e2m1_nibble(even * inv) << 28)
        acc = (acc >> 4) | (e2m1_nibble(odd * inv) << 28)
    return acc


@triton.jit
def quantize_words(words_lo, words_hi, global_scale, DTYPE: tl.constexpr, HW_E4M3: tl.constexpr):
    """Quantize 16-element blocks of a 16-bit float type given as words of element pairs.

    ``words_lo`` / ``words_hi``: uint32 ``[..., 4]``, words 0-3 and 4-7 of each block, word
    ``j`` holding the block's elements ``2j`` (low half) and ``2j + 1`` (high half) as float16 /
    bfloat16 bits (``DTYPE``). Returns ``(lo, hi, sf)``: uint32 ``[...]`` packed words (bytes
    0-3 and 4-7 of the block's 8 packed bytes, little-endian) and the uint8 block-scale bytes:
    the bytes of :func:`quantize_pairs` (the reference's), NaN and infinity included.

    ``HW_E4M3``: round the block scale with the hardware's float -> e4m3 conversion
    (``cvt.rn.satfinite``, compiled code) instead of :func:`round_to_e4m3` (the
    interpreter's cast does not round to nearest even); the bytes are the same.
    The block's amax is a NaN-propagating float max of magnitudes (one instruction per
    element), so a NaN anywhere in the block makes it NaN.
    """
    even_lo, odd_lo = _unpack16(words_lo, DTYPE)
    even_hi, odd_hi = _unpack16(words_hi, DTYPE)
    mag = tl.maximum(tl.maximum(tl.abs(even_lo), tl.abs(odd_lo), propagate_nan=tl.PropagateNan.ALL),
                     tl.maximum(tl.abs(even_hi), tl.abs(odd_hi), propagate_nan=tl.PropagateNan.ALL),
                     propagate_nan=tl.PropagateNan.ALL)
    amax = tl.reduce(mag, len(mag.shape) - 1, _max_keep_nan)
    nan_block = amax != amax
    amax = tl.where(nan_block, 0.0, amax)
    scaled = tl.math.div_rn(global_scale * amax, tl.full(amax.shape, E2M1_MAX, tl.float32))
    if HW_E4M3:
        sf8 = scaled.to(tl.float8e4nv)  # round to nearest even, saturating at 448 (cvt.rn.satfinite)
        sf = sf8.to(tl.float32)
    else:
        sf = round_to_e4m3(tl.minimum(scaled, E4M3_MAX))
        sf8 = sf.to(tl.float8e4nv)
    safe = tl.where(sf == 0.0, 1.0, sf)
    inv = tl.where(sf == 0.0, 0.0, tl.math.div_rn(global_scale + tl.zeros_like(safe), safe))
    lo = tl.where(nan_block, 0, _pack_half(words_lo, inv, DTYPE))
    hi = tl.where(nan_block, 0, _pack_half(words_hi, inv, DTYPE))
    sf_bytes = tl.where(nan_block, 0x7F, sf8.to(tl.uint8, bitcast=True))
    return lo, hi, sf_bytes.to(tl.uint8)


@triton.jit
def swizzled_scale_offset(row, col, scale_col_tiles):
    """Byte offset of the scale of (``row``, block column ``col``) in the 128x4 swizzled
    layout (NVFP4.md); ``scale_col_tiles = round_up(K/16, 4) / 4``."""
    tile = (row // 128) * scale_col_tiles + col // 4
    return tile * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4 + col % 4
