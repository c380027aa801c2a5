"""FlashAttention-4's SM90 forward with a dynamic 128-column group FP8 epilogue (CuTe DSL; needs FA4).

Imported only by :mod:`fusion_pass.kernels.fa4.sm90_fp8` when the kernel is compiled (it imports
``flash_attn.cute`` and ``cutlass`` at its top, as :mod:`.sm90_kernel` does).

:class:`FlashAttentionForwardSm90Fp8Group` subclasses the NVFP4 kernel
(:class:`~fusion_pass.kernels.fa4.sm90_kernel.FlashAttentionForwardSm90Nvfp4`) as the static FP8 kernel
(:mod:`.sm90_fp8_kernel`) does: FA4's main loop unchanged, the NVFP4 class's ``mma`` (which stashes
``aux_data.tensors`` on ``self`` while the kernel body is traced) inherited. It overrides:

``__init__``
    FA4's constructor arguments plus the compile-time keywords ``ue8m0`` (scales rounded up to powers of two) and
    ``divide`` (``x / s``, vLLM 0.32's kernel, instead of ``x * (1 / s)``, 0.33 and 0.34).
``__call__`` (host, ``@cute.jit``)
    ``(mQ, mK, mV, mO, mOut, mScales, softmax_scale, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mPageTable, stream)``:
    FA4's ``__call__`` with ``(mOut, mScales)`` packed into ``AuxData``.
``epilogue`` (device, ``@cute.jit``)
    The static FP8 epilogue's first half unchanged (fp32 accumulator -> query dtype -> ``sO`` through FA4's
    stmatrix copy, no TMA store; every epilogue thread then reads 16 consecutive elements of one row of ``sO``,
    8 threads per 128 columns, chunk index fastest, so the 8 threads of a group are 8 consecutive lanes of one
    warp). Per group (:func:`group_scale`): the 16 values' ``max |x|`` from ``eps`` with ``max.f32`` (which drops
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
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Uint32, Uint64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from flash_attn.cute import utils as fa_utils
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
from flash_attn.cute.named_barrier import NamedBarrierFwd
from flash_attn.cute.utils import AuxData

from fusion_pass.fp8.layout import E4M3_MAX, GROUP_SIZE, SCALE_EPS
from fusion_pass.kernels.fa4.sm90_kernel import FlashAttentionForwardSm90Nvfp4

__all__ = ["FlashAttentionForwardSm90Fp8Group", "group_scale", "e4m3x4_group"]

ELEMS = 16
"""Elements (and output bytes) per thread and pass: one row, 16 consecutive columns."""

LANES = GROUP_SIZE // ELEMS
"""Threads (consecutive lanes) per 128-column group."""


def _f32(value: float) -> str:
    """A float32 constant as PTX writes it (``0f`` and its bits), rounded to nearest as torch rounds a scalar."""
    return "0f" + struct.pack(">f", value).hex().upper()


@dsl_user_op
def _abs_max16(xs, *, loc=None, ip=None) -> Float32:
    """``max(eps, max_j |x_j|)`` of 16 float32 values with ``max.f32`` (a NaN operand is dropped)."""
    values = [Float32(x).ir_value(loc=loc, ip=ip) for x in xs]
    lines = ["{", ".reg .f32 a, m;", f"mov.f32 m, {_f32(SCALE_EPS)};"]
    for j in range(len(values)):
        lines += [f"abs.f32 a, ${j + 1};", "max.f32 m, m, a;"]
    lines += ["mov.f32 $0, m;", "}"]
    return Float32(llvm.inline_asm(T.f32(), values, "\n\t".join(lines), "=f" + ",f" * len(values), loc=loc, ip=ip))


@dsl_user_op
def _scale_of(amax, ue8m0: bool, *, loc=None, ip=None) -> Float32:
    """``amax / 448`` (``div.rn.f32``), rounded up to a power of two when ``ue8m0`` (``amax`` >= eps, not NaN)."""
    lines = ["{", ".reg .f32 s;", ".reg .b32 b, e;", ".reg .pred p;", f"div.rn.f32 s, $1, {_f32(E4M3_MAX)};"]
    if ue8m0:
        lines += ["mov.b32 b, s;", "and.b32 e, b, 8388607;", "setp.ne.u32 p, e, 0;", "and.b32 e, b, 2139095040;",
                  "add.u32 e, e, 8388608;", "@p mov.b32 b, e;", "mov.b32 s, b;"]
    lines += ["mov.f32 $0, s;", "}"]
    return Float32(llvm.inline_asm(T.f32(), [Float32(amax).ir_value(loc=loc, ip=ip)], "\n\t".join(lines), "=f,f",
                                   loc=loc, ip=ip))


@dsl_user_op
def _reciprocal(s, *, loc=None, ip=None) -> Float32:
    """``1 / s`` correctly rounded (``rcp.rn.f32``, IEEE; Inf -> 0)."""
    return Float32(llvm.inline_asm(T.f32(), [Float32(s).ir_value(loc=loc, ip=ip)], "rcp.rn.f32 $0, $1;", "=f,f",
                                   loc=loc, ip=ip))


def group_scale(x: cute.Tensor, ue8m0: bool) -> Float32:
    """The scale of the 128-column group whose 16-element chunk ``x`` (float32 fragment) this lane holds: the
    8 lanes of the group reduce ``max |x|`` by butterfly shuffles (every lane of the warp must call this). Called
    while the epilogue is traced (emits IR; not jitted itself)."""
    amax = _abs_max16([x[j] for j in range(ELEMS)])
    for k in range(LANES.bit_length() - 1):
        amax = fa_utils.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << k))
    return _scale_of(amax, ue8m0)


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


class FlashAttentionForwardSm90Fp8Group(FlashAttentionForwardSm90Nvfp4):
    """FA4's SM90 forward whose epilogue writes FP8 with one dynamic scale per row and 128 columns (module
    docstring)."""

    def __init__(self, *args, ue8m0: bool = False, divide: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        if self.tile_hdimv % GROUP_SIZE:
            raise ValueError(f"the group epilogue needs Dv % {GROUP_SIZE} == 0, got tile_hdimv={self.tile_hdimv}")
        self.ue8m0, self.divide = bool(ue8m0), bool(divide)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mOut: cute.Tensor,
        mScales: cute.Tensor,
        softmax_scale: Float32,
        mCuSeqlensQ: Optional[cute.Tensor] = None,
        mCuSeqlensK: Optional[cute.Tensor] = None,
        mSeqUsedK: Optional[cute.Tensor] = None,
        mPageTable: Optional[cute.Tensor] = None,
        stream: cuda.CUstream = None,  # last: TVM-FFI fills it with the caller's current stream
    ):
        FlashAttentionForwardSm90.__call__(
            self,
            mQ,
            mK,
            mV,
            mO,
            None,  # mLSE
            softmax_scale,
            mCuSeqlensQ,
            mCuSeqlensK,
            mSeqUsedK=mSeqUsedK,
            mPageTable=mPageTable,
            aux_data=AuxData((mOut, mScales), None),
            stream=stream,
        )

    @cute.jit
    def epilogue(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        sO: cute.Tensor,
        seqlen,
        gmem_tiled_copy_O: cute.TiledCopy,
        tma_atom_O: Optional[cute.CopyAtom],
        tiled_mma: cute.TiledMma,
        tidx: cutlass.Int32,
        m_block: cutlass.Int32,
        head_idx: cutlass.Int32,
        batch_idx: cutlass.Int32,
    ):
        assert mLSE is None, "the FP8 epilogue writes no LSE"
        assert not self.pack_gqa, "the FP8 epilogue needs pack_gqa=False (one head per tile)"
        mOut, mScales = self._nvfp4_out  # stashed by the inherited mma

        # 1) FA4's own first half (as the NVFP4 epilogue): fp32 acc -> query dtype -> sO (stmatrix)
        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        cute.arch.barrier(barrier_id=int(NamedBarrierFwd.Epilogue), number_of_threads=self.num_epilogue_threads)
        smem_atom = fa_utils.get_smem_store_atom(self.arch.major * 10 + self.arch.minor, self.dtype)
        smem_thr = cute.make_tiled_copy_C(smem_atom, tiled_mma).get_slice(tidx)
        cute.copy(smem_atom, smem_thr.retile(rO), smem_thr.partition_D(sO))
        # 2) every epilogue thread may now read any element of sO
        cute.arch.barrier(barrier_id=int(NamedBarrierFwd.Epilogue), number_of_threads=self.num_epilogue_threads)

        # 3) thread t reads 16 consecutive elements (chunk t % cpr) of rows t // cpr + k * rows_per_pass
        chunks_per_row = self.tile_hdimv // ELEMS
        thr_layout = cute.make_ordered_layout(
            (self.num_epilogue_threads // chunks_per_row, chunks_per_row), order=(1, 0)
        )
        load_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        tiled_load = cute.make_tiled_copy_tv(load_atom, thr_layout, cute.make_layout((1, ELEMS)))
        thr_load = tiled_load.get_slice(tidx)
        tOsO = thr_load.partition_S(sO)
        tOcO = thr_load.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_hdimv)))
        tOrO = cute.make_fragment_like(tOsO, self.dtype)
        cute.autovec_copy(tOsO, tOrO)

        mOut64 = cute.recast_tensor(mOut, Uint64)  # [T, H*Dv/8]: 8 bytes a word
        rows_left = seqlen.seqlen_q - m_block * self.tile_m
        for i in cutlass.range_constexpr(cute.size(tOrO, mode=[1])):
            r_loc = tOcO[0, i, 0][0]
            c_loc = tOcO[0, i, 0][1]
            x = cute.make_fragment_like(tOrO[None, i, None], Float32)
            x.store(tOrO[None, i, None].load().to(Float32))
            s = group_scale(x, self.ue8m0)  # every lane: the shuffles need the whole warp
            factor = s if cutlass.const_expr(self.divide) else _reciprocal(s)
            # rows past this sequence's end belong to the next sequence's CTA (or are padding)
            if r_loc < rows_left:
                w0 = e4m3x4_group(x[0], x[1], x[2], x[3], factor, self.divide)
                w1 = e4m3x4_group(x[4], x[5], x[6], x[7], factor, self.divide)
                w2 = e4m3x4_group(x[8], x[9], x[10], x[11], factor, self.divide)
                w3 = e4m3x4_group(x[12], x[13], x[14], x[15], factor, self.divide)
                row = seqlen.offset_q + m_block * self.tile_m + r_loc
                col = head_idx * self.tile_hdimv + c_loc
                mOut64[row, col // 8] = Uint64(w0) | (Uint64(w1) << 32)
                mOut64[row, col // 8 + 1] = Uint64(w2) | (Uint64(w3) << 32)
                if c_loc % GROUP_SIZE == 0:
                    mScales[row, col // GROUP_SIZE] = s
