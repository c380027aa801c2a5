"""FlashAttention-4's SM100 forward with a dynamic 128-column group FP8 output stage (CuTe DSL; needs FA4).

Imported only by :mod:`fusion_pass.kernels.fa4.sm100_fp8` when the kernel is compiled (it imports
``flash_attn.cute`` and ``cutlass`` at its top, as :mod:`.sm100_kernel` does). Compiled for ``sm_100a`` on the
CPU, never run (no Blackwell GPU is lent to this project).

:class:`FlashAttentionForwardSm100Fp8Group` subclasses the SM100 static FP8 kernel
(:class:`~fusion_pass.kernels.fa4.sm100_fp8_kernel.FlashAttentionForwardSm100Fp8Static`): FA4's main loop, the
NVFP4 kernel's constructor checks and ``softmax_loop``, the static kernel's ``__call__`` (``(mQ, mK, mV, mO, mOut,
mScales, softmax_scale, mCuSeqlensQ, mCuSeqlensK, max_seqlen_q, mSeqUsedK, mPageTable, stream)``, ``(mOut,
mScales, mO)`` packed into ``AuxData``) and its output-stage helpers (``tmem_row_copies``, ``tile_rows``,
``load_chunk``) inherited. It overrides:

``__init__``
    FA4's constructor arguments plus the compile-time keywords ``ue8m0`` (scales rounded up to powers of two) and
    ``divide`` (``x / s``, vLLM 0.32's kernel, instead of ``x * (1 / s)``, 0.33 and 0.34), as the SM90 group
    kernel; refuses ``Dv % 128 != 0``.
``correction_epilogue`` (device, ``@cute.jit``)
    Each correction-warp thread owns one row of the tile, and each tensor-memory copy gives it 16 consecutive
    columns of that row, so a row's 128-column group lies in one thread: no shuffle. Per group, two passes over
    tensor memory. Pass 1 loads the group's 8 copies (``load_chunk``: FA4's load, its ``1 / row_sum`` multiply,
    rounded to the output dtype and back) and reduces ``max |x|`` from ``eps`` with ``max.f32`` (a NaN operand
    dropped): :func:`~fusion_pass.kernels.fa4.sm90_fp8_group_kernel.abs_max16` per copy, ``fmax`` across copies;
    then ``s`` (:func:`~fusion_pass.kernels.fa4.sm90_fp8_group_kernel.scale_of`: ``div.rn.f32`` by 448, UE8M0 on
    the bits) and ``1 / s`` (``rcp.rn.f32``; not with ``divide``). Pass 2 loads the 8 copies again, computes the
    same values (same instructions on the same accumulator), and writes each copy's 16 bytes
    (:func:`~fusion_pass.kernels.fa4.sm90_fp8_group_kernel.e4m3x4_group`: ``mul.rn`` or ``div.rn``, ``max`` -448
    then ``min`` 448, so NaN -> -448, ``cvt.rn.satfinite.e4m3x2``) as two 8-byte stores, and the float32 scale at
    ``(row, h * Dv/128 + g)`` through ``mScales``' strides. The arithmetic is the SM90 group kernel's, its
    functions imported, not copied. So bytes and scales are ``fp8.quantize_group(FA4's own output, ...)``.

Why two passes rather than holding the group: the correction warps run with 64 to 80 registers per thread
(FA4's ``num_regs_correction``); 128 float32 values (64 registers even as bf16) would spill to local memory,
while the accumulator stays in tensor memory until the epilogue returns (the caller frees it afterwards) and a
second ``tcgen05.ld`` of 16 columns is cheap. Every load is executed by every thread of the warp (the load is
warp-wide); only the stores depend on the row being inside the sequence.

Tensors: as :mod:`.sm100_fp8_kernel`, with ``mScales`` float32 ``[T, H*Dv/128]``, one unit stride (row-major, or
column-major with a run-time column stride: :class:`fusion_pass.fp8.ScaleLayout`), in place of ``mInv``. Needs
``Dv % 128 == 0``. Rows outside the sequences are not written.
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint64
from flash_attn.cute import utils as fa_utils

from fusion_pass.fp8.layout import GROUP_SIZE, SCALE_EPS
from fusion_pass.kernels.fa4.sm100_fp8_kernel import FlashAttentionForwardSm100Fp8Static
from fusion_pass.kernels.fa4.sm90_fp8_group_kernel import abs_max16, e4m3x4_group, reciprocal, scale_of
from fusion_pass.kernels.fa4.sm90_fp8_kernel import ELEMS

__all__ = ["FlashAttentionForwardSm100Fp8Group"]

COPIES = GROUP_SIZE // ELEMS
"""Tensor-memory copies (16 columns each) per 128-column group."""


class FlashAttentionForwardSm100Fp8Group(FlashAttentionForwardSm100Fp8Static):
    """FA4's SM100 forward whose output stage writes FP8 with one dynamic scale per row and 128 columns (module
    docstring): the static FP8 kernel with its output stage replaced."""

    def __init__(self, *args, ue8m0: bool = False, divide: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        if self.head_dim_v_padded % GROUP_SIZE:
            raise ValueError(f"the group output stage needs Dv % {GROUP_SIZE} == 0, got head_dim_v_padded="
                             f"{self.head_dim_v_padded}")
        self.ue8m0, self.divide = bool(ue8m0), bool(divide)

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
        mOut, mScales, mO = self.fp8_outputs()
        tiled_tmem_load, tOtO_t2r, tOcO_t2r = self.tmem_row_copies(thr_mma, tOtO, tidx)
        tile_row0, head, rows_left = self.tile_rows(thr_mma, stage, m_block, seqlen_q, mO_cur, mO)
        groups_per_head = self.head_dim_v_padded // GROUP_SIZE
        mOut64 = cute.recast_tensor(mOut, Uint64)  # [T, H*Dv/8]: 8 bytes a word
        r_loc = tOcO_t2r[None, 0, 0, 0][0][0]  # this thread's row of the tile (the same in every copy)
        row = tile_row0 + r_loc

        for g in cutlass.range_constexpr(groups_per_head):
            # pass 1: the group's max |x| (NaN elements left out), its scale
            amax = Float32(SCALE_EPS)
            for c in cutlass.range_constexpr(COPIES):
                i = g * COPIES + c
                x = self.load_chunk(tiled_tmem_load, tOtO_t2r[None, 0, 0, i], tOcO_t2r[None, 0, 0, i], scale,
                                    zero_fill)
                amax = fa_utils.fmax(amax, abs_max16([x[j] for j in range(ELEMS)]))  # both >= eps, never NaN
            s = scale_of(amax, self.ue8m0)
            factor = s if cutlass.const_expr(self.divide) else reciprocal(s)
            # pass 2: the same values again from tensor memory, quantized and stored
            for c in cutlass.range_constexpr(COPIES):
                i = g * COPIES + c
                x = self.load_chunk(tiled_tmem_load, tOtO_t2r[None, 0, 0, i], tOcO_t2r[None, 0, 0, i], scale,
                                    zero_fill)
                if r_loc < rows_left:
                    w0 = e4m3x4_group(x[0], x[1], x[2], x[3], factor, self.divide)
                    w1 = e4m3x4_group(x[4], x[5], x[6], x[7], factor, self.divide)
                    w2 = e4m3x4_group(x[8], x[9], x[10], x[11], factor, self.divide)
                    w3 = e4m3x4_group(x[12], x[13], x[14], x[15], factor, self.divide)
                    col = (head * self.head_dim_v_padded + ELEMS * i) // 8
                    mOut64[row, col] = Uint64(w0) | (Uint64(w1) << 32)
                    mOut64[row, col + 1] = Uint64(w2) | (Uint64(w3) << 32)
            if r_loc < rows_left:
                mScales[row, head * groups_per_head + g] = s
