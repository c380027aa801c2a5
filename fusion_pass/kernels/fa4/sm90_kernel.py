"""FlashAttention-4's SM90 forward with an NVFP4 epilogue (CuTe DSL; needs FA4).

Imported only by :mod:`fusion_pass.kernels.fa4.sm90` when the ``fa4`` backend
runs or compiles: this module imports ``flash_attn.cute`` and ``cutlass`` at
its top (the CuTe DSL rewrites ``@cute.jit`` functions from their source, so
they must be module-level definitions; keeping them here lets ``fa4_sm90``
import without FA4).

:class:`FlashAttentionForwardSm90Nvfp4` subclasses
:class:`~fusion_pass.kernels.fa4.sm90_exact.FlashAttentionForwardSm90Exact`, itself
``flash_attn.cute.flash_fwd_sm90.FlashAttentionForwardSm90`` (flash-attn-4
4.0.0b36, nvidia-cutlass-dsl 4.8.0; pinned in ``pyproject.toml``). The main loop
(TMA loads of Q/K/V, the wgmma QK^T and PV products, online softmax, causal
masking, the varlen tile scheduler) is FA4's, unchanged; the base's ``mma``
stashes FA4's ``AuxData`` tensors on ``self`` at trace time (``AuxData`` is the
one argument FA4 forwards unchanged from the host function into ``mma``, which
calls ``epilogue``; a tensor stored on ``self`` in the host function cannot be
used inside the kernel) and its put-back of masked values runs first in the
epilogue. It overrides two methods:

``__call__`` (host, ``@cute.jit``)
    A signature of our own: ``(mQ, mK, mV, mO, mOq, mSF, mGS, softmax_scale,
    mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mPageTable, stream)`` (the last two
    None but for a paged KV cache; they go to FA4's ``__call__`` unchanged,
    as FA4's own interface passes them). It calls FA4's ``__call__`` with the
    inputs and the three NVFP4 tensors packed into ``AuxData``
    (:meth:`~fusion_pass.kernels.fa4.sm90_exact.FlashAttentionForwardSm90Exact.aux_data`),
    so no restating of ``kernel``'s 36-parameter signature.
``epilogue`` (device, ``@cute.jit``)
    Replaces FA4's bf16/fp16 store. It puts back the masked values first
    (``put_back_masked_values``). Its first half is FA4's own: the fp32
    accumulator (already divided by the softmax row sum) is rounded to the
    query dtype and written to shared memory ``sO`` through FA4's stmatrix
    tiled copy. FA4's TMA store of ``sO`` to ``mO`` is *not* issued; instead
    each epilogue thread reads 16 consecutive elements of one row of ``sO``
    (one NVFP4 block of one head), quantizes them and writes 8 packed bytes
    and one scale byte to global memory (the block code shared with the SM100
    kernel, :mod:`fusion_pass.kernels.fa4.nvfp4_block`). Because the values quantized are
    exactly the bf16/fp16 values FA4 would have stored, the output bytes equal
    ``nvfp4.quantize`` of the twin's output (FA4's forward with the same put-back) bit for bit.

Tensors (T = total tokens of the varlen batch, H query heads, Dv = v head dim):

* ``mQ`` ``[T, H, D]``, ``mK`` ``[T, Hkv, D]``, ``mV`` ``[T, Hkv, Dv]``: bf16 or fp16, unit stride along the head dim.
* ``mO``: any ``[T, H, Dv]`` tensor of the query dtype with 16-byte aligned strides. FA4's host code builds
  a TMA descriptor over it; nothing reads or writes it (the caller passes a view of ``q``).
* ``mOq``: uint8 ``[T, H*Dv/2]``, row-major; token ``t``, element ``h*Dv + d``; two e2m1 codes per byte,
  the even element in the low nibble. Written as one 8-byte store per block (needs ``H*Dv/2 % 8 == 0``).
* ``mSF``: uint8, flat, the ``[round_up(T,128), round_up(H*Dv/16,4)]`` e4m3 block scales in the 128x4
  swizzled layout (docs/nvfp4.md). Only entries of rows ``< T`` are written.
* ``mGS``: float32 ``[1]``, the global scale, read on the device.
* ``mCuSeqlensQ``, ``mCuSeqlensK``: int32 ``[B+1]`` (the same tensor when keys are the queries' own tokens; keys of context + new tokens otherwise, causal aligned to the end).
* Paged KV cache (FA4's own paged forward): ``mK`` ``[num_pages, page_size, Hkv, D]``, ``mV``
  ``[num_pages, page_size, Hkv, Dv]``, ``mCuSeqlensK`` None, ``mSeqUsedK`` int32 ``[B]`` (keys per sequence),
  ``mPageTable`` int32 ``[B, max_pages_per_seq]``. FA4 loads K/V by TMA when the page size is ``tile_n``
  (built with ``paged_kv_non_tma=False``) and by cp.async otherwise; the queries and the output rows still follow
  ``mCuSeqlensQ``, so the epilogue's ``seqlen.offset_q + row`` is unchanged.

Requirements checked by the entry point before compiling: ``pack_gqa`` is False
(with it a tile's rows are (token, head) pairs), ``Dv`` equals the kernel's
``tile_hdimv`` and ``num_epilogue_threads % (Dv/16) == 0`` (every thread owns
whole blocks of one row per pass).
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32
from flash_attn.cute import utils as fa_utils
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
from flash_attn.cute.named_barrier import NamedBarrierFwd

from fusion_pass.kernels.fa4.sm90_exact import FlashAttentionForwardSm90Exact
from fusion_pass.kernels.fa4.nvfp4_block import BLOCK, quantize_block, store_block

__all__ = ["FlashAttentionForwardSm90Nvfp4"]


# ---------------------------------------------------------------------------
# the subclass
# ---------------------------------------------------------------------------


class FlashAttentionForwardSm90Nvfp4(FlashAttentionForwardSm90Exact):
    """FA4's SM90 forward whose epilogue writes NVFP4 (module docstring)."""

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
        mCuSeqlensQ: Optional[cute.Tensor] = None,
        mCuSeqlensK: Optional[cute.Tensor] = None,
        mSeqUsedK: Optional[cute.Tensor] = None,  # paged KV: keys per sequence (FA4's own paged arguments)
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
            aux_data=self.aux_data(mQ, mK, mV, mPageTable, (mOq, mSF, mGS)),
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
        assert mLSE is None, "the NVFP4 epilogue writes no LSE"
        assert not self.pack_gqa, "the NVFP4 epilogue needs pack_gqa=False (one head per tile)"
        mOq, mSF, mGS = self._outputs
        self.put_back_masked_values(acc_O, lse, seqlen, tiled_mma, tidx, m_block, head_idx, batch_idx)

        # 1) FA4's own first half: fp32 acc -> query dtype -> sO (stmatrix). The first barrier
        #    makes sure every warpgroup has finished reading sQ/V (sO aliases sQ).
        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        cute.arch.barrier(barrier_id=int(NamedBarrierFwd.Epilogue), number_of_threads=self.num_epilogue_threads)
        smem_atom = fa_utils.get_smem_store_atom(self.arch.major * 10 + self.arch.minor, self.dtype)
        smem_thr = cute.make_tiled_copy_C(smem_atom, tiled_mma).get_slice(tidx)
        cute.copy(smem_atom, smem_thr.retile(rO), smem_thr.partition_D(sO))
        # 2) every epilogue thread may now read any element of sO
        cute.arch.barrier(barrier_id=int(NamedBarrierFwd.Epilogue), number_of_threads=self.num_epilogue_threads)

        # 3) thread t reads 16 consecutive elements (block t % bpr) of rows t // bpr + k * rows_per_pass:
        #    two 128-bit shared loads through sO's swizzle.
        blocks_per_row = self.tile_hdimv // BLOCK
        thr_layout = cute.make_ordered_layout(
            (self.num_epilogue_threads // blocks_per_row, blocks_per_row), order=(1, 0)
        )
        load_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        tiled_load = cute.make_tiled_copy_tv(load_atom, thr_layout, cute.make_layout((1, BLOCK)))
        thr_load = tiled_load.get_slice(tidx)
        tOsO = thr_load.partition_S(sO)
        tOcO = thr_load.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_hdimv)))
        tOrO = cute.make_fragment_like(tOsO, self.dtype)
        cute.autovec_copy(tOsO, tOrO)

        gs = mGS[0]
        rows_left = seqlen.seqlen_q - m_block * self.tile_m
        for i in cutlass.range_constexpr(cute.size(tOrO, mode=[1])):
            r_loc = tOcO[0, i, 0][0]
            c_loc = tOcO[0, i, 0][1]
            # rows past this sequence's end belong to the next sequence's CTA (or are padding)
            if r_loc < rows_left:
                x = cute.make_fragment_like(tOrO[None, i, None], Float32)
                x.store(tOrO[None, i, None].load().to(Float32))
                packed, sf_byte = quantize_block(x, gs, False)  # SM90 has no FP4 conversion instruction
                row = seqlen.offset_q + m_block * self.tile_m + r_loc
                store_block(mOq, mSF, row, head_idx * blocks_per_row + c_loc // BLOCK, packed, sf_byte)
