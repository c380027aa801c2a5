"""FlashAttention-4's SM90 forward with a dynamic 128-column group FP8 epilogue (CuTe DSL; needs FA4).

Imported only by :mod:`fusion_pass.kernels.fa4.sm90_fp8` when the kernel is compiled (it imports
``flash_attn.cute`` and ``cutlass`` at its top, as :mod:`.sm90_kernel` does).

:class:`FlashAttentionForwardSm90Fp8Group` subclasses the static FP8 kernel
(:class:`~fusion_pass.kernels.fa4.sm90_fp8_kernel.FlashAttentionForwardSm90Fp8Static`): FA4's main loop, its
``__call__`` (``(mQ, mK, mV, mO, mOut, mScales, softmax_scale, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mPageTable,
stream)``, ``(mOut, mScales)`` packed into ``AuxData``) and its epilogue's first half (fp32 accumulator -> query
dtype -> ``sO`` through FA4's stmatrix copy; every epilogue thread then reads 16 consecutive elements of one row
of ``sO``, 8 threads per 128 columns, chunk index fastest, so the 8 threads of a group are 8 consecutive lanes of
one warp) inherited. It overrides:

``__init__``
    FA4's constructor arguments plus the compile-time keywords ``ue8m0`` (scales rounded up to powers of two) and
    ``divide`` (``x / s``, vLLM 0.32's kernel, instead of ``x * (1 / s)``, 0.33 and 0.34).
``write_chunk`` (device, ``@cute.jit``; the epilogue's per-chunk hook)
    Per group (:func:`group_scale`): the 16 values' ``max |x|`` from ``eps`` with ``max.f32`` (which drops
    a NaN operand: NaN elements do not count), three butterfly shuffles over the 8 lanes (executed by every lane,
    whatever row it holds), ``s = amax / 448`` with ``div.rn.f32`` and, with ``ue8m0``, ``s`` rounded up to a
    power of two on its bits (exponent plus one unless the mantissa is zero; Inf stays Inf). Then per element
    (:func:`e4m3x4_group`) ``q = x * rcp.rn(s)`` (``mul.rn.f32``) or ``x / s`` (``div.rn.f32``), clamped by
    ``max.f32`` with -448 then ``min.f32`` with 448 (vLLM's ``fminf(fmaxf(q, -448), 448)``: NaN -> -448, byte
    ``0xFE``; ±Inf -> ±448) and converted with ``cvt.rn.satfinite.e4m3x2.f32``. The 16 bytes go out as two
    8-byte stores; the group's first lane stores the float32 scale. Because the values quantized are exactly the
    bf16/fp16 values FA4 would have stored, bytes and scales equal ``fp8.quantize_group(FA4's own output, ...)``
    bit for bit.

Tensors: ``mQ``, ``mK``, ``mV``, ``mO``, the offsets and the paged pair as :mod:`.sm90_kernel`; ``mOut`` uint8
``[T, H*Dv]`` row-major (the float8_e4m3fn bytes; token ``t``, column ``h*Dv + d``), 16-byte aligned; ``mScales``
float32 ``[T, H*Dv/128]``, one unit stride (row-major, or a column-major view with any leading stride: vLLM's three
layouts, :class:`fusion_pass.fp8.ScaleLayout`). Needs ``Dv % 128 == 0`` and ``Dv == tile_hdimv``. Rows outside the
sequences are not written.
"""

from __future__ import annotations

import struct

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Uint32, Uint64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from flash_attn.cute import utils as fa_utils

from fusion_pass.fp8.layout import E4M3_MAX, GROUP_SIZE, SCALE_EPS
from fusion_pass.kernels.fa4.sm90_fp8_kernel import ELEMS, FlashAttentionForwardSm90Fp8Static

__all__ = ["FlashAttentionForwardSm90Fp8Group", "abs_max16", "e4m3x4_group", "group_scale", "reciprocal",
           "scale_of"]

LANES = GROUP_SIZE // ELEMS
"""Threads (consecutive lanes) per 128-column group."""


def _f32(value: float) -> str:
    """A float32 constant as PTX writes it (``0f`` and its bits), rounded to nearest as torch rounds a scalar."""
    return "0f" + struct.pack(">f", value).hex().upper()


@dsl_user_op
def abs_max16(xs, *, loc=None, ip=None) -> Float32:
    """``max(eps, max_j |x_j|)`` of 16 float32 values with ``max.f32`` (a NaN operand is dropped). Shared with
    the SM100 group output stage (``sm100_fp8_group_kernel.py``), as are :func:`scale_of`, :func:`reciprocal` and
    :func:`e4m3x4_group`."""
    values = [Float32(x).ir_value(loc=loc, ip=ip) for x in xs]
    lines = ["{", ".reg .f32 a, m;", f"mov.f32 m, {_f32(SCALE_EPS)};"]
    for j in range(len(values)):
        lines += [f"abs.f32 a, ${j + 1};", "max.f32 m, m, a;"]
    lines += ["mov.f32 $0, m;", "}"]
    return Float32(llvm.inline_asm(T.f32(), values, "\n\t".join(lines), "=f" + ",f" * len(values), loc=loc, ip=ip))


@dsl_user_op
def scale_of(amax, ue8m0: bool, *, loc=None, ip=None) -> Float32:
    """``amax / 448`` (``div.rn.f32``), rounded up to a power of two when ``ue8m0`` (``amax`` >= eps, not NaN)."""
    lines = ["{", ".reg .f32 s;", ".reg .b32 b, e;", ".reg .pred p;", f"div.rn.f32 s, $1, {_f32(E4M3_MAX)};"]
    if ue8m0:
        lines += ["mov.b32 b, s;", "and.b32 e, b, 8388607;", "setp.ne.u32 p, e, 0;", "and.b32 e, b, 2139095040;",
                  "add.u32 e, e, 8388608;", "@p mov.b32 b, e;", "mov.b32 s, b;"]
    lines += ["mov.f32 $0, s;", "}"]
    return Float32(llvm.inline_asm(T.f32(), [Float32(amax).ir_value(loc=loc, ip=ip)], "\n\t".join(lines), "=f,f",
                                   loc=loc, ip=ip))


@dsl_user_op
def reciprocal(s, *, loc=None, ip=None) -> Float32:
    """``1 / s`` correctly rounded (``rcp.rn.f32``, IEEE; Inf -> 0)."""
    return Float32(llvm.inline_asm(T.f32(), [Float32(s).ir_value(loc=loc, ip=ip)], "rcp.rn.f32 $0, $1;", "=f,f",
                                   loc=loc, ip=ip))


def group_scale(x: cute.Tensor, ue8m0: bool) -> Float32:
    """The scale of the 128-column group whose 16-element chunk ``x`` (float32 fragment) this lane holds: the
    8 lanes of the group reduce ``max |x|`` by butterfly shuffles (every lane of the warp must call this). Called
    while the epilogue is traced (emits IR; not jitted itself)."""
    amax = abs_max16([x[j] for j in range(ELEMS)])
    for k in range(LANES.bit_length() - 1):
        amax = fa_utils.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << k))
    return scale_of(amax, ue8m0)


@dsl_user_op
def e4m3x4_group(x0, x1, x2, x3, factor, divide: bool, *, loc=None, ip=None) -> Uint32:
    """Four float32 values -> the four float8_e4m3fn bytes of ``min(max(q_j, -448), 448)`` in one 32-bit word
    (``x0`` in bits 0-7), ``q_j = x_j * factor`` (``mul.rn.f32``; ``factor = 1 / s``) or, with ``divide``,
    ``x_j / factor`` (``div.rn.f32``; ``factor = s``). ``max.f32`` first: NaN -> -448. ``cvt d, a, b`` puts
    ``a`` in the high byte: pairs go high element first."""
    values = [Float32(x).ir_value(loc=loc, ip=ip) for x in (x0, x1, x2, x3, factor)]
    op = "div.rn.f32" if divide else "mul.rn.f32"
    lines = ["{", ".reg .f32 q0, q1, q2, q3;", ".reg .b16 h0, h1;"]
    for j in range(4):
        lines += [f"{op} q{j}, ${j + 1}, $5;", f"max.f32 q{j}, q{j}, {_f32(-E4M3_MAX)};",
                  f"min.f32 q{j}, q{j}, {_f32(E4M3_MAX)};"]
    lines += ["cvt.rn.satfinite.e4m3x2.f32 h0, q1, q0;", "cvt.rn.satfinite.e4m3x2.f32 h1, q3, q2;",
              "mov.b32 $0, {h0, h1};", "}"]
    return Uint32(llvm.inline_asm(T.i32(), values, "\n\t".join(lines), "=r,f,f,f,f,f", loc=loc, ip=ip))


class FlashAttentionForwardSm90Fp8Group(FlashAttentionForwardSm90Fp8Static):
    """FA4's SM90 forward whose epilogue writes FP8 with one dynamic scale per row and 128 columns (module
    docstring): the static FP8 kernel with its per-chunk hook replaced."""

    def __init__(self, *args, ue8m0: bool = False, divide: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        if self.tile_hdimv % GROUP_SIZE:
            raise ValueError(f"the group epilogue needs Dv % {GROUP_SIZE} == 0, got tile_hdimv={self.tile_hdimv}")
        self.ue8m0, self.divide = bool(ue8m0), bool(divide)

    @cute.jit
    def write_chunk(self, x: cute.Tensor, r_loc, c_loc, rows_left, row0, head_idx, mOut64: cute.Tensor,
                    mScales: cute.Tensor):
        """The chunk's group scale (every lane: the shuffles need the whole warp), then, for the sequence's rows,
        its 16 FP8 bytes and, from the group's first lane, the float32 scale into ``mScales``."""
        s = group_scale(x, self.ue8m0)
        factor = s if cutlass.const_expr(self.divide) else reciprocal(s)
        if r_loc < rows_left:
            w0 = e4m3x4_group(x[0], x[1], x[2], x[3], factor, self.divide)
            w1 = e4m3x4_group(x[4], x[5], x[6], x[7], factor, self.divide)
            w2 = e4m3x4_group(x[8], x[9], x[10], x[11], factor, self.divide)
            w3 = e4m3x4_group(x[12], x[13], x[14], x[15], factor, self.divide)
            row, col = row0 + r_loc, head_idx * self.tile_hdimv + c_loc
            mOut64[row, col // 8] = Uint64(w0) | (Uint64(w1) << 32)
            mOut64[row, col // 8 + 1] = Uint64(w2) | (Uint64(w3) << 32)
            if c_loc % GROUP_SIZE == 0:
                mScales[row, col // GROUP_SIZE] = s
