"""FlashAttention-4's SM100 forward with an NVFP4 output stage (CuTe DSL; needs FA4).

Imported only by :mod:`fusion_pass.kernels.fa4.sm100` when a kernel is compiled. It imports
``flash_attn.cute`` and ``cutlass`` at its top: the CuTe DSL rewrites ``@cute.jit`` functions from their
source, so they must be module-level definitions.

:class:`FlashAttentionForwardSm100Nvfp4` subclasses ``flash_attn.cute.flash_fwd_sm100.FlashAttentionForwardSm100``
(flash-attn-4 4.0.0b36, nvidia-cutlass-dsl 4.8.0; pinned in ``pyproject.toml``). Everything that computes
attention is FA4's, unchanged: the TMA loads, the tcgen05 QK^T and PV products into tensor memory, the softmax
warps, the correction warps' rescaling, the varlen tile scheduler. With ``cu_seqlens_q`` FA4 writes O through
its correction warps (``use_correction_warps_for_epi``): ``correction_epilogue`` loads each thread's row of the
accumulator from tensor memory, multiplies it by ``1 / row_sum``, rounds it to the output dtype into shared
memory, and ``_store_O_to_gmem`` copies shared memory to global memory. The subclass overrides:

``__call__`` (host, ``@cute.jit``)
    Our signature ``(mQ, mK, mV, mO, mOq, mSF, mGS, softmax_scale, mCuSeqlensQ, mCuSeqlensK, max_seqlen_q,
    mSeqUsedK, mPageTable, stream)``. It calls FA4's ``__call__`` with the NVFP4 tensors in FA4's ``AuxData``
    argument, the one argument FA4 hands unchanged from the host function into the kernel. ``mSeqUsedK`` and
    ``mPageTable`` (None but for a paged KV cache, ``mK``/``mV`` then ``[num_pages, page_size, Hkv, D|Dv]`` and
    ``mCuSeqlensK`` None) go to FA4's ``__call__`` unchanged: FA4's own paged forward (TMA loads for 128-token
    pages, cp.async with ``paged_kv_non_tma`` otherwise). The output stage is unchanged: ``mO_cur`` still
    follows ``mCuSeqlensQ``.
``softmax_loop`` (trace time only)
    Receives ``aux_data`` inside the kernel region and keeps its tensors on ``self`` for the epilogue
    (kernel parameters, valid anywhere in the kernel). The softmax warps' branch is traced before the
    correction warps'; if a later FA4 reorders them, compilation fails with a message saying so.
``correction_epilogue`` (device, ``@cute.jit``)
    Replaces the output stage. The tensor-memory load and the ``1 / row_sum`` scaling are FA4's (same copy
    atom, same packed multiply); each thread then holds 16 consecutive columns of its row, one NVFP4 block,
    in registers. They are rounded to the output dtype and back (the values FA4 would have stored),
    quantized by :func:`fusion_pass.kernels.fa4.nvfp4_block.quantize_block` with SM100's native
    ``cvt.rn.satfinite.e2m1x2.f32``, and written straight to global memory. Nothing goes through shared
    memory and no barrier is taken; ``_store_O_to_gmem`` is therefore never called.

The epilogue finds the tile's global row and head from the address FA4 hands it: ``mO_cur`` is ``mO`` offset
to the sequence's first row and sliced at the tile's head, so ``mO_cur - mO`` (in elements) is
``offset_q * stride_t + head * stride_h``; ``mO`` is passed in ``AuxData`` too.

Tensors: as :mod:`fusion_pass.kernels.fa4.sm90_kernel` (``mO`` a ``[T, H, Dv]`` view of the query dtype that is
never written), plus ``max_seqlen_q`` (Int32, the longest query sequence: sizes the grid).

Requirements checked before compiling: ``pack_gqa``, ``is_split_kv`` and ``use_2cta_instrs`` are False (one
head per tile, one CTA per tile, no partial outputs), ``Dv`` is a multiple of 16 and equals
``head_dim_v_padded``, and FA4 picks the 32-lane x 32-bit tensor-memory load (thread = row).
"""

from __future__ import annotations

import inspect
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.tcgen05 as tcgen05
import cutlass.utils.blackwell_helpers as sm100_utils_basic
from cutlass import Float32, Int32
from flash_attn.cute.flash_fwd_sm100 import FlashAttentionForwardSm100
from flash_attn.cute.utils import AuxData

from fusion_pass.kernels.fa4.nvfp4_block import BLOCK, quantize_block, store_block

__all__ = ["FlashAttentionForwardSm100Nvfp4"]


class FlashAttentionForwardSm100Nvfp4(FlashAttentionForwardSm100):
    """FA4's SM100 forward whose output stage writes NVFP4 (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.pack_gqa or self.is_split_kv or self.use_2cta_instrs:
            raise ValueError("the NVFP4 output stage needs pack_gqa, is_split_kv and use_2cta_instrs all False")
        if self.head_dim_v_padded % BLOCK or self.check_hdim_v_oob:
            raise ValueError(f"the NVFP4 output stage needs Dv a multiple of {BLOCK}, got {self.head_dim_v_padded}")
        if not self.use_correction_warps_for_epi:
            raise ValueError("the NVFP4 output stage replaces the correction warps' epilogue: needs is_varlen_q=True")

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mOq: cute.Tensor,
        mSF: cute.Tensor,
        mGS: cute.Tensor,
        softmax_scale: Float32,
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: Optional[cute.Tensor],
        max_seqlen_q: Int32,
        mSeqUsedK: Optional[cute.Tensor] = None,  # paged KV: keys per sequence (FA4's own paged arguments)
        mPageTable: Optional[cute.Tensor] = None,
        stream: cuda.CUstream = None,  # last: TVM-FFI fills it with the caller's current stream
    ):
        super().__call__(
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
            aux_data=AuxData((mOq, mSF, mGS, mO), None),
            max_seqlen_q=max_seqlen_q,
            stream=stream,
        )

    def softmax_loop(self, *args, **kwargs):
        # Trace time, inside the kernel region: aux_data's tensors are kernel parameters here.
        bound = inspect.signature(FlashAttentionForwardSm100.softmax_loop).bind(self, *args, **kwargs)
        self._nvfp4_out = bound.arguments["aux_data"].tensors
        return super().softmax_loop(*args, **kwargs)

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
        nvfp4_out = getattr(self, "_nvfp4_out", None)
        if cutlass.const_expr(nvfp4_out is None):
            raise RuntimeError(
                "fusion_pass: FA4's SM100 kernel traced its correction warps before its softmax warps; the NVFP4 "
                "output stage was written against flash-attn-4 4.0.0b36 (docs/fa4.md)"
            )
        mOq, mSF, mGS, mO = nvfp4_out

        # FA4's own tensor-memory load of the accumulator, 16 columns (one NVFP4 block) per copy.
        tOcO = thr_mma.partition_C(cute.make_identity_tensor(self.mma_tiler_pv[:2]))
        tOtO_i = cute.logical_divide(tOtO, cute.make_layout((self.m_block_size, BLOCK)))
        tOcO_i = cute.logical_divide(tOcO, cute.make_layout((self.m_block_size, BLOCK)))
        tmem_copy_atom = sm100_utils_basic.get_tmem_load_op(
            self.mma_tiler_pv,
            self.o_layout,
            self.o_dtype,
            self.pv_acc_dtype,
            (self.epi_tile[0], BLOCK),
            use_2cta_instrs=self.use_2cta_instrs,
        )
        if cutlass.const_expr(not isinstance(tmem_copy_atom.op, tcgen05.copy.Ld32x32bOp)):
            raise RuntimeError(
                f"fusion_pass: FA4's SM100 output stage loads the accumulator with {tmem_copy_atom.op}, not the "
                "32-lane x 32-bit load (one row per thread) the NVFP4 output stage needs (docs/fa4.md)"
            )
        tiled_tmem_load = tcgen05.make_tmem_copy(tmem_copy_atom, tOtO_i[(None, None), 0])
        thr_tmem_load = tiled_tmem_load.get_slice(tidx)
        tOtO_t2r = thr_tmem_load.partition_S(tOtO_i[(None, None), None])
        tOcO_t2r = thr_tmem_load.partition_D(tOcO_i[(None, None), None])

        # The tile's global row 0 and head, from mO_cur's offset in mO (module docstring).
        offset = (mO_cur.iterator.toint() - mO.iterator.toint()) // (self.o_dtype.width // 8)
        row_stride = mO.stride[0]
        first_row = Int32(offset // row_stride)
        head = Int32((offset - first_row * row_stride) // mO.stride[1])
        m_tile_idx = (m_block * self.q_stage + stage) * self.cta_group_size + thr_mma.thr_idx
        rows_left = seqlen_q - m_tile_idx * self.m_block_size
        blocks_per_row = self.head_dim_v_padded // BLOCK
        gs = mGS[0]

        # Each copy must give a thread 16 consecutive columns of its row, in order: one NVFP4 block.
        for i in cutlass.range_constexpr(blocks_per_row):
            columns = [tOcO_t2r[None, 0, 0, i][j][1] for j in range(cute.size(tOcO_t2r[None, 0, 0, i]))]
            if cutlass.const_expr(columns != list(range(BLOCK * i, BLOCK * (i + 1)))):
                raise RuntimeError(f"fusion_pass: FA4's tensor-memory copy {i} gives a thread the columns {columns}, "
                                   f"not the one NVFP4 block {BLOCK * i}..{BLOCK * (i + 1) - 1} the output stage needs")
        for i in cutlass.range_constexpr(blocks_per_row):
            tOrO_frg = cute.make_rmem_tensor(tOcO_t2r[None, 0, 0, i].shape, self.pv_acc_dtype)
            if cutlass.const_expr(zero_fill is True):
                tOrO_frg.fill(0.0)
            elif zero_fill:  # FA4: seqlen_k == 0 with TMA loads; P = 0 times a NaN V row would be NaN
                tOrO_frg.fill(0.0)
            else:
                cute.copy(tiled_tmem_load, tOtO_t2r[None, 0, 0, i], tOrO_frg)
                cute.arch.fence_view_async_tmem_load()  # the registers are read next; the caller then frees O
                for j in cutlass.range(0, cute.size(tOrO_frg), 2, unroll_full=True):
                    tOrO_frg[j], tOrO_frg[j + 1] = cute.arch.mul_packed_f32x2(
                        (tOrO_frg[j], tOrO_frg[j + 1]), (scale, scale)
                    )
            # the values FA4 would have stored: rounded to the output dtype
            x = cute.make_rmem_tensor(tOrO_frg.shape, Float32)
            x.store(tOrO_frg.load().to(self.o_dtype).to(Float32))
            packed, sf_byte = quantize_block(x, gs, True)
            r_loc = tOcO_t2r[None, 0, 0, i][0][0]
            if r_loc < rows_left:
                row = first_row + m_tile_idx * self.m_block_size + r_loc
                store_block(mOq, mSF, row, head * blocks_per_row + i, packed, sf_byte)
