"""FlashAttention-4's SM100 forward with a static per-tensor FP8 output stage (CuTe DSL; needs FA4).

Imported only by :mod:`fusion_pass.kernels.fa4.sm100_fp8` when the kernel is compiled (it imports
``flash_attn.cute`` and ``cutlass`` at its top, as :mod:`.sm100_kernel` does). Compiled for ``sm_100a`` on the
CPU, never run (no Blackwell GPU is lent to this project).

:class:`FlashAttentionForwardSm100Fp8Static` subclasses the SM100 NVFP4 kernel
(:class:`~fusion_pass.kernels.fa4.sm100_kernel.FlashAttentionForwardSm100Nvfp4`): FA4's main loop unchanged, its
constructor checks (one head and one CTA per tile, ``Dv`` a multiple of 16, the correction warps' output stage)
and its ``softmax_loop`` (which stashes ``aux_data.tensors`` on ``self`` while the kernel body is traced)
inherited. It overrides:

``__init__``
    FA4's constructor arguments plus the keyword ``nan_byte`` (``0x7E``: NaN -> +448, vLLM's CUDA op; ``0x7F``:
    the canonical NaN, the native form), a compile-time constant, as the SM90 static kernel.
``__call__`` (host, ``@cute.jit``)
    ``(mQ, mK, mV, mO, mOut, mInv, softmax_scale, mCuSeqlensQ, mCuSeqlensK, max_seqlen_q, mSeqUsedK, mPageTable,
    stream)``: FA4's ``__call__`` with ``(mOut, mInv, mO)`` packed into ``AuxData``.
``correction_epilogue`` (device, ``@cute.jit``)
    The NVFP4 output stage's first half unchanged (FA4's 32-lane x 32-bit tensor-memory load, 16 consecutive
    columns of the thread's row per copy, times ``1 / row_sum`` with FA4's packed multiply, rounded to the output
    dtype and back: the values FA4 would have stored; the helpers ``tmem_row_copies``, ``tile_rows`` (trace time)
    and ``load_chunk`` (device), which the group stage of ``sm100_fp8_group_kernel.py`` reuses); then the SM90
    static kernel's arithmetic
    (:func:`fusion_pass.kernels.fa4.sm90_fp8_kernel.e4m3x4_static`: ``x * inv``, ``min`` / ``max`` to ±448,
    ``cvt.rn.satfinite.e4m3x2``, the NaN rule) and two 8-byte stores of the 16 bytes at the token's global row.
    So the bytes are ``fp8.quantize_static(FA4's own output, inv)``.

Tensors: as :mod:`.sm100_kernel`, with ``mOut`` uint8 ``[T, H*Dv]`` row-major (the float8_e4m3fn bytes; token
``t``, column ``h*Dv + d``), 16-byte aligned, and ``mInv`` float32 ``[1]`` (read on the device) in place of the
NVFP4 buffers. Rows outside the sequences are not written.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.tcgen05 as tcgen05
import cutlass.utils.blackwell_helpers as sm100_utils_basic
from cutlass import Float32, Int32, Uint64
from flash_attn.cute.flash_fwd_sm100 import FlashAttentionForwardSm100
from flash_attn.cute.utils import AuxData

from fusion_pass.kernels.fa4.sm100_kernel import FlashAttentionForwardSm100Nvfp4
from fusion_pass.kernels.fa4.sm90_fp8_kernel import ELEMS, NAN_BYTES, e4m3x4_static

__all__ = ["FlashAttentionForwardSm100Fp8Static"]


class FlashAttentionForwardSm100Fp8Static(FlashAttentionForwardSm100Nvfp4):
    """FA4's SM100 forward whose output stage writes static per-tensor FP8 (module docstring)."""

    def __init__(self, *args, nan_byte: int = 0x7E, **kwargs):
        if nan_byte not in NAN_BYTES:
            raise ValueError(f"nan_byte must be one of {[hex(b) for b in NAN_BYTES]}, got {nan_byte!r}")
        super().__init__(*args, **kwargs)
        self.nan_byte = nan_byte

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mOut: cute.Tensor,
        mInv: cute.Tensor,
        softmax_scale: Float32,
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: Optional[cute.Tensor],
        max_seqlen_q: Int32,
        mSeqUsedK: Optional[cute.Tensor] = None,
        mPageTable: Optional[cute.Tensor] = None,
        stream: cuda.CUstream = None,  # last: TVM-FFI fills it with the caller's current stream
    ):
        FlashAttentionForwardSm100.__call__(
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
            aux_data=AuxData((mOut, mInv, mO), None),
            max_seqlen_q=max_seqlen_q,
            stream=stream,
        )

    def fp8_outputs(self) -> tuple:
        """Trace time: the ``AuxData`` tensors the softmax warps' trace stashed on ``self`` (``(mOut, <the stage's
        scale tensor>, mO)``)."""
        fp8_out = getattr(self, "_nvfp4_out", None)
        if fp8_out is None:
            raise RuntimeError(
                "fusion_pass: FA4's SM100 kernel traced its correction warps before its softmax warps; the FP8 "
                "output stage was written against flash-attn-4 4.0.0b36 (docs/fa4.md)"
            )
        return fp8_out

    def tmem_row_copies(self, thr_mma: cute.ThrMma, tOtO: cute.Tensor, tidx: Int32) -> tuple:
        """Trace time: FA4's own tensor-memory load of the accumulator (as the NVFP4 output stage), checked to give
        this thread 16 consecutive columns of its row per copy, in order: ``(tiled_tmem_load, tOtO_t2r,
        tOcO_t2r)``, copy ``i`` being ``tOtO_t2r[None, 0, 0, i]`` (columns ``16 i .. 16 i + 15``)."""
        tOcO = thr_mma.partition_C(cute.make_identity_tensor(self.mma_tiler_pv[:2]))
        tOtO_i = cute.logical_divide(tOtO, cute.make_layout((self.m_block_size, ELEMS)))
        tOcO_i = cute.logical_divide(tOcO, cute.make_layout((self.m_block_size, ELEMS)))
        tmem_copy_atom = sm100_utils_basic.get_tmem_load_op(
            self.mma_tiler_pv,
            self.o_layout,
            self.o_dtype,
            self.pv_acc_dtype,
            (self.epi_tile[0], ELEMS),
            use_2cta_instrs=self.use_2cta_instrs,
        )
        if not isinstance(tmem_copy_atom.op, tcgen05.copy.Ld32x32bOp):
            raise RuntimeError(
                f"fusion_pass: FA4's SM100 output stage loads the accumulator with {tmem_copy_atom.op}, not the "
                "32-lane x 32-bit load (one row per thread) the FP8 output stage needs (docs/fa4.md)"
            )
        tiled_tmem_load = tcgen05.make_tmem_copy(tmem_copy_atom, tOtO_i[(None, None), 0])
        thr_tmem_load = tiled_tmem_load.get_slice(tidx)
        tOtO_t2r = thr_tmem_load.partition_S(tOtO_i[(None, None), None])
        tOcO_t2r = thr_tmem_load.partition_D(tOcO_i[(None, None), None])
        for i in range(self.head_dim_v_padded // ELEMS):
            columns = [tOcO_t2r[None, 0, 0, i][j][1] for j in range(cute.size(tOcO_t2r[None, 0, 0, i]))]
            if columns != list(range(ELEMS * i, ELEMS * (i + 1))):
                raise RuntimeError(f"fusion_pass: FA4's tensor-memory copy {i} gives a thread the columns {columns}, "
                                   f"not the 16 consecutive columns {ELEMS * i}..{ELEMS * (i + 1) - 1} the FP8 "
                                   f"output stage needs")
        return tiled_tmem_load, tOtO_t2r, tOcO_t2r

    def tile_rows(self, thr_mma: cute.ThrMma, stage: Int32, m_block: Int32, seqlen_q: Int32, mO_cur: cute.Tensor,
                  mO: cute.Tensor) -> tuple:
        """Trace time: ``(tile_row0, head, rows_left)``: the global row of the tile's row 0 and its head, from
        ``mO_cur``'s offset in ``mO`` (``sm100_kernel``'s docstring), and the tile's rows inside the sequence (a
        thread writes its row ``r_loc`` only when ``r_loc < rows_left``)."""
        offset = (mO_cur.iterator.toint() - mO.iterator.toint()) // (self.o_dtype.width // 8)
        row_stride = mO.stride[0]
        first_row = Int32(offset // row_stride)
        head = Int32((offset - first_row * row_stride) // mO.stride[1])
        m_tile_idx = (m_block * self.q_stage + stage) * self.cta_group_size + thr_mma.thr_idx
        return first_row + m_tile_idx * self.m_block_size, head, seqlen_q - m_tile_idx * self.m_block_size

    @cute.jit
    def load_chunk(self, tiled_tmem_load: cute.TiledCopy, tOtO_t2r_i: cute.Tensor, tOcO_t2r_i: cute.Tensor,
                   scale: Float32, zero_fill) -> cute.Tensor:
        """One tensor-memory copy of this thread's row (16 columns) as FA4's output stage computes it: loaded (all
        threads of the warp: the load is warp-wide), times ``1 / row_sum`` with FA4's packed multiply (or zeros,
        FA4's ``zero_fill``), rounded to the output dtype and back: the values FA4 would have stored, float32."""
        tOrO_frg = cute.make_rmem_tensor(tOcO_t2r_i.shape, self.pv_acc_dtype)
        if cutlass.const_expr(zero_fill is True):
            tOrO_frg.fill(0.0)
        elif zero_fill:  # FA4: seqlen_k == 0 with TMA loads; P = 0 times a NaN V row would be NaN
            tOrO_frg.fill(0.0)
        else:
            cute.copy(tiled_tmem_load, tOtO_t2r_i, tOrO_frg)
            cute.arch.fence_view_async_tmem_load()  # the registers are read next; the caller then frees O
            for j in cutlass.range(0, cute.size(tOrO_frg), 2, unroll_full=True):
                tOrO_frg[j], tOrO_frg[j + 1] = cute.arch.mul_packed_f32x2(
                    (tOrO_frg[j], tOrO_frg[j + 1]), (scale, scale)
                )
        x = cute.make_rmem_tensor(tOrO_frg.shape, Float32)
        x.store(tOrO_frg.load().to(self.o_dtype).to(Float32))
        return x

    @cute.jit
    def correction_epilogue(
        self,
        thr_mma: cute.ThrMma,
        tOtO: cute.Tensor,
        tidx: Int32,
        stage: Int32,
        m_block: Int32,
        seqlen_q: Int32,
        scale: Float32,
        sO: cute.Tensor,
        mO_cur: Optional[cute.Tensor] = None,
        gO: Optional[cute.Tensor] = None,
        gmem_tiled_copy_O: Optional[cute.TiledCopy] = None,
        zero_fill=False,
    ):
        mOut, mInv, mO = self.fp8_outputs()
        tiled_tmem_load, tOtO_t2r, tOcO_t2r = self.tmem_row_copies(thr_mma, tOtO, tidx)
        tile_row0, head, rows_left = self.tile_rows(thr_mma, stage, m_block, seqlen_q, mO_cur, mO)
        inv = mInv[0]
        mOut64 = cute.recast_tensor(mOut, Uint64)  # [T, H*Dv/8]: 8 bytes a word

        for i in cutlass.range_constexpr(self.head_dim_v_padded // ELEMS):
            x = self.load_chunk(tiled_tmem_load, tOtO_t2r[None, 0, 0, i], tOcO_t2r[None, 0, 0, i], scale, zero_fill)
            r_loc = tOcO_t2r[None, 0, 0, i][0][0]
            if r_loc < rows_left:
                w0 = e4m3x4_static(x[0], x[1], x[2], x[3], inv, self.nan_byte)
                w1 = e4m3x4_static(x[4], x[5], x[6], x[7], inv, self.nan_byte)
                w2 = e4m3x4_static(x[8], x[9], x[10], x[11], inv, self.nan_byte)
                w3 = e4m3x4_static(x[12], x[13], x[14], x[15], inv, self.nan_byte)
                col = (head * self.head_dim_v_padded + ELEMS * i) // 8
                mOut64[tile_row0 + r_loc, col] = Uint64(w0) | (Uint64(w1) << 32)
                mOut64[tile_row0 + r_loc, col + 1] = Uint64(w2) | (Uint64(w3) << 32)
