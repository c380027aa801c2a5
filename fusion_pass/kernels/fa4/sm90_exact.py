"""FA4's SM90 forward whose output rows see no masked value (CuTe DSL; needs FA4): the base of every project SM90 kernel.

Imported only by the SM90 kernel modules (:mod:`.sm90_twin`, :mod:`.sm90_kernel` and the FP8 ones), which import
``flash_attn.cute`` and ``cutlass`` at their top.

Why. FA4's main loop masks a key a row does not see by its probability ``P = 0``, then multiplies ``P`` by every
value row it loaded into the tile: ``0 * NaN`` and ``0 * Inf`` are NaN, so a NaN or an infinity in a loaded but
masked value (a later token of the same query tile, the next request's first rows in a varlen call, a stale slot
of a 128-row page) turns elements of rows that cannot see it into NaN (docs/design.md, "A NaN or an infinity in the
inputs"). Such an element is always NaN (never ``±Inf``, never finite), and every other element of the row is exact:
a masked finite value adds ``0 * v = 0``.

What. :class:`FlashAttentionForwardSm90Exact` puts those elements back before any epilogue writes the tile
(:meth:`~FlashAttentionForwardSm90Exact.put_back_masked_values`): an element of the normalised fp32 accumulator that
is NaN, in a row whose log-sum-exp is finite (so its scores are), is recomputed from the keys the row sees, in
float32 IEEE arithmetic: ``sum_j exp(s_ij - lse_i) * V[j, c]`` over ``j`` visible (causal: ``j <= i + Lk - Lq``;
``j < Lk``), ``s_ij = softmax_scale * q_i . k_j``, reading ``q``, ``k`` and ``v`` (paged: through the page table)
from global memory. A NaN that a seen value causes stays NaN (the recomputed sum holds it); a leaked one becomes the
row's value without the masked key, within float32 rounding of FA4's (which rounds ``P`` to the query dtype): so a
hidden row's bytes may differ from the clean run's in the elements the leak reached, by rounding, not by NaN.
Elsewhere nothing changes: the common path is one sum of the thread's accumulator elements and one comparison per
tile; the recompute runs only where a NaN is, on a local-memory copy in loops that are not unrolled (little code:
the kernel's main loop keeps its registers), and is slow by design (one thread walks every visible key, for inputs
that hold NaN or Inf). Its cost on finite inputs: ``bench/masked_values.py``.

How it gets the inputs. FA4's ``epilogue`` receives neither the tensors nor the softmax scale; its ``mma`` receives
``aux_data`` (the one argument FA4 forwards from the host function into the kernel unchanged) and the scale.
:meth:`~FlashAttentionForwardSm90Exact.aux_data` packs ``(mQ, mK, mV[, mPageTable], *outputs)``; the ``mma``
override stashes them on ``self`` while the kernel body is traced, so they are kernel parameters where ``epilogue``
is traced.

Tensors: ``mQ`` ``[T, H, D]``; ``mK`` ``[T, Hkv, D]`` / ``mV`` ``[T, Hkv, Dv]`` (rows ``cu_seqlens_k``'s), or the
paged caches ``[num_pages, page_size, Hkv, D|Dv]`` with ``mPageTable`` int32 ``[B, max_pages]``; query dtype.
Requires ``pack_gqa=False`` and no local window (the project builds neither).
"""

from __future__ import annotations

import inspect
import math
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
from flash_attn.cute.utils import AuxData
from quack import layout_utils

__all__ = ["FlashAttentionForwardSm90Exact"]

LOG2_E = math.log2(math.e)


def _sum_of_elements(acc: cute.Tensor):
    """Trace time: the sum of every element of the register fragment ``acc``, as a tree of adds (they overlap)."""
    terms = [acc[i] for i in range(cute.size(acc))]
    while len(terms) > 1:
        pairs = [terms[i] + terms[i + 1] for i in range(0, len(terms) - 1, 2)]
        terms = pairs + terms[len(terms) - len(terms) % 2:]
    return terms[0]


class FlashAttentionForwardSm90Exact(FlashAttentionForwardSm90):
    """FA4's SM90 forward with masked values left out of every output element (module docstring). Its own
    ``__call__`` and ``epilogue`` are FA4's, the masked values put back first (the twin's entry point); the fused
    kernels override both and call :meth:`put_back_masked_values` first in their epilogues."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        softmax_scale: Float32,
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor] = None,  # paged KV cache: as FA4's own interface passes them
        mPageTable: Optional[cute.Tensor] = None,
        stream: cuda.CUstream = None,  # last: TVM-FFI fills it with the caller's current stream
    ):
        FlashAttentionForwardSm90.__call__(self, mQ, mK, mV, mO, mLSE, softmax_scale, mCuSeqlensQ, mCuSeqlensK,
                                           mSeqUsedK=mSeqUsedK, mPageTable=mPageTable,
                                           aux_data=self.aux_data(mQ, mK, mV, mPageTable, ()), stream=stream)

    def aux_data(self, mQ, mK, mV, mPageTable, outputs: tuple) -> AuxData:
        """Trace time (host): FA4's ``AuxData`` carrying the inputs the put-back reads, then the epilogue's
        ``outputs`` (read back as ``self._outputs`` in the kernel)."""
        assert not self.pack_gqa and not self.is_local, "the put-back needs pack_gqa=False and no local window"
        self._paged = mPageTable is not None
        inputs = (mQ, mK, mV) + ((mPageTable,) if self._paged else ())
        return AuxData(inputs + tuple(outputs), None)

    def mma(self, *args, **kwargs):
        # Trace time, inside the kernel region: aux_data's tensors are kernel parameters here.
        bound = inspect.signature(FlashAttentionForwardSm90.mma).bind(self, *args, **kwargs)
        tensors = tuple(bound.arguments["aux_data"].tensors)
        n_in = 4 if self._paged else 3
        self._inputs = tensors[:n_in] + ((None,) if not self._paged else ())
        self._outputs = tensors[n_in:]
        self._softmax_scale_log2 = bound.arguments["softmax_scale_log2"]
        return super().mma(*args, **kwargs)

    @cute.jit
    def epilogue(self, acc_O: cute.Tensor, lse: cute.Tensor, mO: cute.Tensor, mLSE: Optional[cute.Tensor],
                 sO: cute.Tensor, seqlen, gmem_tiled_copy_O: cute.TiledCopy, tma_atom_O: Optional[cute.CopyAtom],
                 tiled_mma: cute.TiledMma, tidx: Int32, m_block: Int32, head_idx: Int32, batch_idx: Int32):
        self.put_back_masked_values(acc_O, lse, seqlen, tiled_mma, tidx, m_block, head_idx, batch_idx)
        FlashAttentionForwardSm90.epilogue(self, acc_O, lse, mO, mLSE, sO, seqlen, gmem_tiled_copy_O, tma_atom_O,
                                           tiled_mma, tidx, m_block, head_idx, batch_idx)

    @cute.jit
    def put_back_masked_values(self, acc_O: cute.Tensor, lse: cute.Tensor, seqlen, tiled_mma: cute.TiledMma,
                               tidx: Int32, m_block: Int32, head_idx: Int32, batch_idx: Int32):
        """In place on ``acc_O`` (this thread's fp32 fragment of the ``tile_m x Dv`` output tile, divided by the row
        sums; ``lse``: its rows' natural log-sum-exp, ``-inf`` where FA4 found the row sum 0 or NaN): every NaN
        element of a row with a finite ``lse`` is recomputed over the keys the row sees (module docstring)."""
        acc = layout_utils.reshape_acc_to_mn(acc_O)
        # One test per thread on the common path: the sum of its elements is NaN when one of them is (or when
        # +Inf meets -Inf, which the rows' own test then clears).
        total = _sum_of_elements(acc)
        if total != total:
            self._put_back_rows(acc, lse, seqlen, tiled_mma, tidx, m_block, head_idx, batch_idx)

    @cute.jit
    def _put_back_rows(self, acc: cute.Tensor, lse: cute.Tensor, seqlen, tiled_mma: cute.TiledMma, tidx: Int32,
                       m_block: Int32, head_idx: Int32, batch_idx: Int32):
        """The rows of this thread's ``acc`` (the accumulator's ``(rows, columns)`` view) that hold a NaN and have a
        finite ``lse``: recomputed (:meth:`_recompute_row`). The work runs on a local-memory copy in loops that
        are not unrolled, so this rare path adds little code to the kernel; ``acc`` is read and written with
        static indices only (it stays in registers)."""
        thr_mma = tiled_mma.get_slice(tidx)
        coords = layout_utils.reshape_acc_to_mn(
            thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_hdimv))))
        n_rows, n_cols = cute.size(acc, mode=[0]), cute.size(acc, mode=[1])
        values = cute.make_rmem_tensor((n_rows, n_cols), Float32)
        rows = cute.make_rmem_tensor(n_rows, Int32)
        rows_lse = cute.make_rmem_tensor(n_rows, Float32)
        cols = cute.make_rmem_tensor(n_cols, Int32)
        for r in cutlass.range_constexpr(n_rows):
            rows[r] = m_block * self.tile_m + coords[r, 0][0]
            rows_lse[r] = lse[r]
            for c in cutlass.range_constexpr(n_cols):
                values[r, c] = acc[r, c]
        for c in cutlass.range_constexpr(n_cols):
            cols[c] = coords[0, c][1]
        for r in cutlass.range(n_rows, unroll=1):
            self._recompute_row(values, cols, r, rows[r], rows_lse[r], seqlen, head_idx, batch_idx)
        for r in cutlass.range_constexpr(n_rows):
            for c in cutlass.range_constexpr(n_cols):
                acc[r, c] = values[r, c]

    @cute.jit
    def _recompute_row(self, values: cute.Tensor, cols: cute.Tensor, r: Int32, row: Int32, lse_r: Float32, seqlen,
                       head_idx: Int32, batch_idx: Int32):
        """Row ``r`` of ``values`` (tile row ``row`` of its sequence; ``cols``: its elements' columns): when it holds
        a NaN, ``lse_r`` is finite and the row is the sequence's, its NaN elements replaced by the float32 sum over
        the visible keys."""
        n_cols = cute.size(values, mode=[1])
        nan_elements = Int32(0)
        for c in cutlass.range(n_cols, unroll=1):
            if values[r, c] != values[r, c]:
                nan_elements += 1
        finite_lse = lse_r == lse_r and lse_r != Float32.inf and lse_r != -Float32.inf
        if nan_elements > 0 and finite_lse and row < seqlen.seqlen_q:
            mQ, mK, mV, mPageTable = self._inputs
            kv_head = head_idx // self.qhead_per_kvhead
            q_row = seqlen.offset_q + row
            visible = seqlen.seqlen_k
            if cutlass.const_expr(self.is_causal):
                visible = cutlass.min(visible, row + 1 + seqlen.seqlen_k - seqlen.seqlen_q)
            total = cute.make_rmem_tensor(n_cols, Float32)
            for c in cutlass.range(n_cols, unroll=1):
                total[c] = Float32(0.0)
            shift = lse_r * LOG2_E
            head_dim = mQ.shape[2]
            for j in cutlass.range(visible, unroll=1):
                page = Int32(0)
                slot = seqlen.offset_k + j
                if cutlass.const_expr(mPageTable is not None):
                    page_size = mK.shape[1]
                    page = mPageTable[batch_idx, j // page_size]
                    slot = j % page_size
                score = Float32(0.0)
                for d in cutlass.range(head_dim, unroll=1):
                    if cutlass.const_expr(mPageTable is not None):
                        score += Float32(mQ[q_row, head_idx, d]) * Float32(mK[page, slot, kv_head, d])
                    else:
                        score += Float32(mQ[q_row, head_idx, d]) * Float32(mK[slot, kv_head, d])
                p = cute.math.exp2(score * self._softmax_scale_log2 - shift, fastmath=False)
                for c in cutlass.range(n_cols, unroll=1):
                    if cutlass.const_expr(mPageTable is not None):
                        total[c] += p * Float32(mV[page, slot, kv_head, cols[c]])
                    else:
                        total[c] += p * Float32(mV[slot, kv_head, cols[c]])
            for c in cutlass.range(n_cols, unroll=1):
                if values[r, c] != values[r, c]:
                    values[r, c] = total[c]
