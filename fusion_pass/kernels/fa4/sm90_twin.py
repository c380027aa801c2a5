"""FA4's SM90 forward with the fused kernel's argument order: the twin of the NVFP4 kernel (CuTe DSL; needs FA4).

Imported only by :mod:`fusion_pass.kernels.fa4.sm90` when the twin is compiled; it imports ``flash_attn.cute``
and ``cutlass`` at its top (the CuTe DSL rewrites ``@cute.jit`` functions from their source).

:class:`FlashAttentionForwardSm90Twin` is ``flash_attn.cute.flash_fwd_sm90.FlashAttentionForwardSm90``
unchanged, called with the arguments of :class:`~fusion_pass.kernels.fa4.sm90_kernel.FlashAttentionForwardSm90Nvfp4`
less the NVFP4 buffers: ``(mQ, mK, mV, mO, mLSE, softmax_scale, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mPageTable,
stream)`` (the paged pair None but for a paged KV cache, ``mCuSeqlensK`` None then). Built by
:mod:`.sm90` with the fused kernel's configuration and compile options, it writes O (``[T, H, Dv]`` in the query
dtype) with FA4's own epilogue, and the log-sum-exp when ``mLSE`` (float32 ``[H, T]``) is given. The two kernels
share the main loop, so ``nvfp4.quantize`` of the twin's output and the fused kernel's bytes are equal by
construction; they differ only in the epilogue (and in FA4's divisors for mask functions, derived from the fused
kernel's ``AuxData`` and unused without one).
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Float32
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

__all__ = ["FlashAttentionForwardSm90Twin"]


class FlashAttentionForwardSm90Twin(FlashAttentionForwardSm90):
    """FA4's SM90 forward unchanged, with the fused kernel's argument order (module docstring)."""

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
        super().__call__(mQ, mK, mV, mO, mLSE, softmax_scale, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK=mSeqUsedK,
                         mPageTable=mPageTable, stream=stream)
