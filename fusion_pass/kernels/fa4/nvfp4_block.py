"""The device code both FA4 NVFP4 epilogues share (CuTe DSL; imports ``cutlass``).

One NVFP4 block is 16 consecutive elements of one output row held by one thread. :func:`quantize_block`
turns them into 8 packed bytes and a scale byte following docs/nvfp4.md exactly (``amax`` by a NaN-propagating
maximum, so a NaN is detected in the same reduction; ``sf = e4m3(min(gs * amax / 6, 448))`` rounded to nearest
even by the hardware's conversion; ``inv = gs / sf``; codes rounded to nearest even and saturated at 6; a NaN
block becomes 8 zero bytes and the scale byte ``0x7F``), and :func:`store_block` writes them: the packed
codes as one 8-byte store into ``[T, H*Dv/2]``, the scale byte at its 128x4-swizzled offset.

The e2m1 rounding has two implementations with the same results: :func:`e2m1_magnitude`, one magic float add
per element (the arithmetic of the Triton quantizer's ``nvfp4_math.e2m1_nibble``, whose bytes are tested at every e2m1
tie on the H200) that runs on every generation (SM90 has no FP4 conversion), and :func:`e2m1x8_native`, the
``cvt.rn.satfinite.e2m1x2.f32`` instruction of SM100 and later. ``native`` selects one at compile time.
The SM90 kernel (``sm90_kernel.py``) and the SM100 kernel (``sm100_kernel.py``) both call
:func:`quantize_block` and :func:`store_block`; the software path's bytes are tested on an SM90 GPU
(``tests/kernels/test_fa4_block.py``), the native instruction only on SM100 hardware (the run-time
self-check covers it there).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Uint8, Uint32, Uint64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

__all__ = ["BLOCK", "e2m1_magnitude", "e2m1x8_native", "e4m3_scale", "quantize_block", "scale_offset",
           "store_block"]

BLOCK = 16
"""Elements per NVFP4 block."""


@dsl_user_op
def _f32_bits(x, *, loc=None, ip=None):
    return Uint32(llvm.bitcast(T.i32(), Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def _bits_f32(x, *, loc=None, ip=None):
    return Float32(llvm.bitcast(T.f32(), Uint32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def _abs(x, *, loc=None, ip=None) -> Float32:
    """``|x|`` as a float operation (``abs.f32``), which ptxas folds into the instruction that reads it."""
    return Float32(llvm.inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "abs.f32 $0, $1;", "=f,f",
                                   loc=loc, ip=ip))


@dsl_user_op
def _max_abs_nan(acc, x, *, loc=None, ip=None) -> Float32:
    """``max(acc, |x|)`` that is NaN when either is (``max.NaN.f32``, SM80 and later): a block's amax and its NaN
    test in one reduction, one instruction per element."""
    return Float32(llvm.inline_asm(
        T.f32(),
        [Float32(acc).ir_value(loc=loc, ip=ip), Float32(x).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .f32 a;\n\tabs.f32 a, $2;\n\tmax.NaN.f32 $0, $1, a;\n\t}",
        "=f,f,f",
        loc=loc,
        ip=ip,
    ))


@dsl_user_op
def e4m3_scale(v, *, loc=None, ip=None):
    """``v`` in ``[0, 448]`` -> ``(sf, byte)``: the nearest float8_e4m3fn value (ties to even) as float32, and its
    byte. One ``cvt.rn.satfinite.e4m3x2.f32`` (SM89 and later: SM90 and SM100 both have it; the Triton quantizer
    rounds its block scales with the same instruction), then the byte widened back to float32 exactly."""
    word = Uint32(llvm.inline_asm(
        T.i32(),
        [Float32(v).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b16 h;\n\tcvt.rn.satfinite.e4m3x2.f32 h, $1, $1;\n\tcvt.u32.u16 $0, h;\n\t}",
        "=r,f",
        loc=loc,
        ip=ip,
    ))
    sf = Float32(llvm.inline_asm(
        T.f32(),
        [word.ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b16 l, a, b;\n\t.reg .b32 hh;\n\tcvt.u16.u32 l, $1;\n\t"
        "cvt.rn.f16x2.e4m3x2 hh, l;\n\tmov.b32 {a, b}, hh;\n\tcvt.f32.f16 $0, a;\n\t}",
        "=f,r",
        loc=loc,
        ip=ip,
    ))
    return sf, word & Uint32(0xFF)


@cute.jit
def e2m1_magnitude(q: Float32) -> Uint32:
    """float32 -> the e2m1 code of ``|q|`` (0..7: round to nearest even, saturating at 6) in bits 0-3, bit 3
    clear; bits 4-7 are zero, bits 8 and up are not part of the result; the sign is the caller's (any generation).

    One magic float add, ``a + M`` with ``a = min(|q|, 6)`` and ``M`` chosen by the range of ``a`` from the
    exponent of ``a * a + 11.75``: the arithmetic of the Triton quantizer's ``nvfp4_math.e2m1_nibble`` (derived
    there and in docs/nvfp4.md, "One magic add per element"), without its sign term: :func:`quantize_block`
    merges the sign at packing."""
    a = min(_abs(q), Float32(6.0))
    band = (_f32_bits(a * a + Float32(11.75)) >> Uint32(23)) - Uint32(130)
    return _f32_bits(a + _bits_f32(Uint32(0x4A800000) + band * Uint32(0x800002)))


@dsl_user_op
def e2m1x8_native(x0, x1, x2, x3, x4, x5, x6, x7, *, loc=None, ip=None) -> Uint32:
    """Eight float32 values -> eight e2m1 codes packed in a 32-bit word (``x0`` in bits 0-3), with SM100's
    ``cvt.rn.satfinite.e2m1x2.f32`` (round to nearest even, saturating at 6, sign kept on zero).
    ``cvt d, a, b`` puts ``a``'s code in the high nibble, so each pair is passed high element first."""
    values = [Float32(x).ir_value(loc=loc, ip=ip) for x in (x0, x1, x2, x3, x4, x5, x6, x7)]
    word = llvm.inline_asm(
        T.i32(),
        values,
        "{\n\t.reg .b8 b0, b1, b2, b3;\n\t"
        "cvt.rn.satfinite.e2m1x2.f32 b0, $2, $1;\n\t"
        "cvt.rn.satfinite.e2m1x2.f32 b1, $4, $3;\n\t"
        "cvt.rn.satfinite.e2m1x2.f32 b2, $6, $5;\n\t"
        "cvt.rn.satfinite.e2m1x2.f32 b3, $8, $7;\n\t"
        "mov.b32 $0, {b0, b1, b2, b3};\n\t}",
        "=r,f,f,f,f,f,f,f,f",
        loc=loc,
        ip=ip,
    )
    return Uint32(word)


@cute.jit
def quantize_block(x: cute.Tensor, gs: Float32, native: cutlass.Constexpr[bool]):
    """``x``: 16 float32 register values, one block in column order; ``gs``: the global scale.

    Returns ``(packed, sf_byte)``: a Uint64 with element ``j``'s code in bits ``4j .. 4j+3`` (docs/nvfp4.md
    "Packing", little-endian bytes) and the Uint32 e4m3 scale byte."""
    amax = Float32(0.0)
    for j in cutlass.range_constexpr(BLOCK):
        amax = _max_abs_nan(amax, x[j])
    is_nan = amax != amax
    if is_nan:
        amax = Float32(0.0)
    sf, sf_byte = e4m3_scale(min(gs * amax / Float32(6.0), Float32(448.0)))
    inv = Float32(0.0)
    if sf != Float32(0.0):
        inv = gs / sf
    lo = Uint32(0)
    hi = Uint32(0)
    if cutlass.const_expr(native):
        lo = e2m1x8_native(*[x[j] * inv for j in range(8)])
        hi = e2m1x8_native(*[x[j + 8] * inv for j in range(8)])
    else:  # element j ends in bits 4j..4j+3: each code enters at the top of a funnel shift right by 4, where
        # bit 3 of the code is bit 31: the sign bit of x[j] * inv, taken as it is
        for j in cutlass.range_constexpr(8):
            q_lo, q_hi = x[j] * inv, x[j + 8] * inv
            lo = (lo >> Uint32(4)) | (e2m1_magnitude(q_lo) << Uint32(28)) | (_f32_bits(q_lo) & Uint32(0x80000000))
            hi = (hi >> Uint32(4)) | (e2m1_magnitude(q_hi) << Uint32(28)) | (_f32_bits(q_hi) & Uint32(0x80000000))
    if is_nan:  # docs/nvfp4.md "NaN and infinity": codes 0, scale byte 0x7F
        lo = Uint32(0)
        hi = Uint32(0)
        sf_byte = Uint32(0x7F)
    return Uint64(lo) | (Uint64(hi) << 32), sf_byte


@cute.jit
def scale_offset(row, col_block, k_tiles):
    """Byte offset of the scale of (``row``, block column ``col_block``) in the 128x4-swizzled buffer with
    ``k_tiles = round_up(H*Dv/16, 4) / 4`` column groups (docs/nvfp4.md "Scale layouts")."""
    return (
        ((row // 128) * k_tiles + col_block // 4) * 512
        + (row % 32) * 16
        + ((row % 128) // 32) * 4
        + col_block % 4
    )


@cute.jit
def store_block(mOq: cute.Tensor, mSF: cute.Tensor, row, col_block, packed: Uint64, sf_byte: Uint32):
    """Write one block: ``packed`` into row ``row``, block column ``col_block`` of the codes ``mOq``
    (uint8 ``[T, H*Dv/2]``, row-major) and ``sf_byte`` at its swizzled offset in ``mSF`` (flat uint8)."""
    mOq64 = cute.recast_tensor(mOq, Uint64)  # [T, H*Dv/16]: one 8-byte word per block
    k_tiles = (mOq.shape[1] // 8 + 3) // 4
    mOq64[row, col_block] = packed
    mSF[scale_offset(row, col_block, k_tiles)] = Uint8(sf_byte)
