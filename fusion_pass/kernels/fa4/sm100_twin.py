"""FA4's SM100 forward with the fused kernel's argument order: the twin of the NVFP4 kernel (CuTe DSL; needs FA4).

Imported only by :mod:`fusion_pass.kernels.fa4.sm100` when the twin is compiled; it imports ``flash_attn.cute``
and ``cutlass`` at its top (the CuTe DSL rewrites ``@cute.jit`` functions from their source), as its SM90 sibling
:mod:`.sm90_twin` does.

:class:`FlashAttentionForwardSm100Twin` is ``flash_attn.cute.flash_fwd_sm100.FlashAttentionForwardSm100`` unchanged,
called with the arguments of :class:`~fusion_pass.kernels.fa4.sm100_kernel.FlashAttentionForwardSm100Nvfp4` less
the NVFP4 buffers (``mSeqUsedK`` / ``mPageTable`` for a paged KV cache, as the fused kernel takes them). Built by
:mod:`.sm100` with the fused kernel's configuration, it writes O (``[T, H, Dv]`` in the
query dtype) with FA4's own epilogue, and the log-sum-exp when ``mLSE`` (float32 ``[H, T]``) is given: the output
the fused kernel's bytes are compared with.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Float32, Int32
from flash_attn.cute.flash_fwd_sm100 import FlashAttentionForwardSm100

__all__ = ["FlashAttentionForwardSm100Twin"]


class FlashAttentionForwardSm100Twin(FlashAttentionForwardSm100):
    """FA4's SM100 forward unchanged, with the argument order of the fused kernel: the bf16/fp16 output the
    fused kernel's bytes are compared with (``mO`` written, ``mLSE`` optional ``[H, T]`` float32)."""

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
        max_seqlen_q: Int32,
        mSeqUsedK: Optional[cute.Tensor] = None,  # paged KV cache: as FA4's own interface passes them
        mPageTable: Optional[cute.Tensor] = None,
        stream: cuda.CUstream = None,
    ):
        super().__call__(mQ, mK, mV, mO, mLSE, softmax_scale, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK=mSeqUsedK,
                         mPageTable=mPageTable, max_seqlen_q=max_seqlen_q, stream=stream)
