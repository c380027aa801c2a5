"""FA4's SM90 forward with the fused kernel's argument order: the twin of the fused kernels (CuTe DSL; needs FA4).

Imported only by :mod:`fusion_pass.kernels.fa4.sm90` when the twin is compiled; it imports ``flash_attn.cute``
and ``cutlass`` at its top (the CuTe DSL rewrites ``@cute.jit`` functions from their source).

:class:`FlashAttentionForwardSm90Twin` is :class:`~fusion_pass.kernels.fa4.sm90_exact.FlashAttentionForwardSm90Exact`:
``flash_attn.cute.flash_fwd_sm90.FlashAttentionForwardSm90`` with FA4's own epilogue, the masked values put back
first (a NaN or an infinity in a value a row does not see reaches no element of it), called with the arguments of
:class:`~fusion_pass.kernels.fa4.sm90_kernel.FlashAttentionForwardSm90Nvfp4` less the fused kernel's buffers:
``(mQ, mK, mV, mO, mLSE, softmax_scale, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mPageTable, stream)`` (the paged pair
None but for a paged KV cache, ``mCuSeqlensK`` None then). Built by :mod:`.sm90` with the fused kernel's
configuration and compile options, it writes O (``[T, H, Dv]`` in the query dtype) with FA4's own epilogue, and the
log-sum-exp when ``mLSE`` (float32 ``[H, T]``) is given. The twin and the fused kernels share the main loop and the
put-back, so ``nvfp4.quantize`` of the twin's output and the fused kernel's bytes are equal by construction; they
differ only in the epilogue's stores.

:class:`FlashAttentionForwardSm90Unchanged` is FA4's class as FA4 ships it, with the same argument order: what
``bench/masked_values.py`` times the put-back against (no entry point uses it).
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Float32
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

from fusion_pass.kernels.fa4.sm90_exact import FlashAttentionForwardSm90Exact

__all__ = ["FlashAttentionForwardSm90Twin", "FlashAttentionForwardSm90Unchanged"]


class FlashAttentionForwardSm90Twin(FlashAttentionForwardSm90Exact):
    """FA4's SM90 forward with the masked values put back, in the fused kernel's argument order (module docstring)."""


class FlashAttentionForwardSm90Unchanged(FlashAttentionForwardSm90):
    """FA4's SM90 forward as FA4 ships it (no put-back), in the twin's argument order: the baseline
    ``bench/masked_values.py`` times the put-back against. Not used by any entry point."""

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: Optional[cute.Tensor], softmax_scale: Float32, mCuSeqlensQ: cute.Tensor,
                 mCuSeqlensK: Optional[cute.Tensor], mSeqUsedK: Optional[cute.Tensor] = None,
                 mPageTable: Optional[cute.Tensor] = None, stream: cuda.CUstream = None):
        FlashAttentionForwardSm90.__call__(self, mQ, mK, mV, mO, mLSE, softmax_scale, mCuSeqlensQ, mCuSeqlensK,
                                           mSeqUsedK=mSeqUsedK, mPageTable=mPageTable, stream=stream)
