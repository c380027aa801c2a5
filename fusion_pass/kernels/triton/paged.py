"""The Triton flash-attention kernel over a paged KV cache: the host entry points of
:mod:`fusion_pass.kernels.triton.flash_attention`'s kernel with its ``PAGED`` constexpr (the keys' rows read through
a page table, everything else shared with the varlen path).
"""

from __future__ import annotations

from fusion_pass import fp8
from fusion_pass.kernels.triton.epilogues import EPILOGUE_FP8_GROUP, EPILOGUE_FP8_STATIC, EPILOGUE_HALF, NAN_BYTES
from fusion_pass.kernels.triton.flash_attention import _fp8_launch, _launch, _nvfp4_launch

__all__ = ["flash_attention_fp8_group_paged", "flash_attention_fp8_static_paged", "flash_attention_nvfp4_paged",
           "flash_attention_paged"]


def flash_attention_paged(
    q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k, *, causal=True,
    softmax_scale=None, out=None, lse=None, config=None,
):
    """Flash attention over a paged KV cache, half-precision (or float32) output (arguments not validated).

    FlashAttention's / vLLM's paged varlen forward: one launch serves decode rows (``Lq = 1``), prefills
    without context (``Lk = Lq``), prefills after cached context (``Lk > Lq``) and any mix of them.

    Args:
        q: ``[T, H, Dqk]``, float16 or bfloat16, unit stride along ``Dqk``.
        k_cache: ``[num_pages, page_size, Hkv, Dqk]``; v_cache: ``[num_pages, page_size, Hkv, Dv]``; q's
            dtype, unit stride along the last dim, any other strides (vLLM's FLASH_ATTN cache split into keys
            and values along its last dim, an HND cache ``[num_pages, Hkv, page_size, D]`` seen through
            ``.transpose(1, 2)``), ``H % Hkv == 0``.
        cu_seqlens: int32 ``[B + 1]`` on the device, contiguous, non-decreasing, ``cB <= T``: sequence
            ``b``'s queries (and output rows) are rows ``[c[b], c[b+1])``. Rows outside ``[c0, cB)`` are
            not written.
        max_seqlen: longest query sequence (sizes the grid).
        seqused_k: int32 ``[B]`` on the device, contiguous: sequence ``b`` has ``Lk = seqused_k[b]`` keys
            (``Lk >= Lq`` when causal), the new tokens' own keys included (already in the cache).
        page_table: int32 ``[B, max_pages_per_seq]`` on the device, unit stride along its last dim: key
            ``j`` of sequence ``b`` is ``k_cache[page_table[b, j // page_size], j % page_size]`` (values
            likewise). Entries past ``ceil(Lk / page_size)`` and the slots past ``Lk`` of the last page are
            never read, nor are pages the table does not list: garbage or NaN there reaches no output.
        max_seqlen_k: longest key sequence; accepted for FlashAttention's signature, not used (the kernel
            reads the key lengths from ``seqused_k``).
        causal: query ``i`` of a sequence sees keys ``j <= i + (Lk - Lq)`` (bottom-right aligned); rows
            seeing no key get 0.
        softmax_scale: default ``1 / sqrt(Dqk)``.
        out, lse, config: as :func:`~fusion_pass.kernels.triton.flash_attention.flash_attention` (``out`` float32 and ``lse`` for partial results).

    Non-finite values as :func:`~fusion_pass.kernels.triton.flash_attention.flash_attention`: a NaN / Inf in a key or value a row does not see (causally
    hidden, or past ``Lk``) does not reach it; those of the keys it sees combine as IEEE ``P @ V`` does.
    Whatever the page size and page order, the output is that of :func:`~fusion_pass.kernels.triton.flash_attention.flash_attention` with
    ``cu_seqlens_k`` over the same keys laid out contiguously: the key blocks are cut by position in the
    sequence, not by page, and only the addresses the keys are read from differ (the interpreter gives the
    same bytes; tests/kernels/test_paged.py).

    Returns:
        ``out [T, H, Dv]`` (q's dtype unless given).
    """
    if out is None:
        out = q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))
    _launch(q, k_cache, v_cache, cu_seqlens, seqused_k, max_seqlen, causal, softmax_scale, EPILOGUE_HALF, out, lse,
            None, None, None, config, page_table)
    return out


def flash_attention_nvfp4_paged(
    q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k, output_scale, *, causal=True,
    softmax_scale=None, packed=None, scales=None, config=None,
):
    """Flash attention over a paged KV cache written as NVFP4 (arguments not validated).

    Arguments as :func:`flash_attention_paged` (no ``out`` / ``lse``); ``output_scale`` is the global scale
    (:func:`~fusion_pass.kernels.triton.flash_attention.flash_attention_nvfp4`'s ``global_scale``, vLLM's name). The output (``packed``, ``scales``) and
    the result as :func:`~fusion_pass.kernels.triton.flash_attention.flash_attention_nvfp4`: the same epilogue, so the bytes are
    the reference quantization of this kernel's own float32 output (:func:`flash_attention_paged` with a
    float32 ``out``), and rows outside ``[cu_seqlens[0], cu_seqlens[B])`` keep their bytes while the scale
    padding (rows ``>= T``, columns ``>= H*Dv/16``) is zeroed.
    """
    return _nvfp4_launch(q, k_cache, v_cache, cu_seqlens, seqused_k, max_seqlen, output_scale, causal, softmax_scale,
                         packed, scales, config, page_table)


def flash_attention_fp8_static_paged(
    q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k, scale, *,
    scale_is_inverse=False, nan=fp8.NaNRule.POSITIVE_MAX, causal=True, softmax_scale=None, output=None, config=None,
):
    """Flash attention over a paged KV cache written as static per-tensor FP8 (arguments not validated).

    Arguments as :func:`flash_attention_paged` (no ``out`` / ``lse``); ``scale``, ``scale_is_inverse``, ``nan``,
    ``output`` and the result as :func:`~fusion_pass.kernels.triton.flash_attention.flash_attention_fp8_static`:
    the same epilogue, so rows ``[cu_seqlens[0], cu_seqlens[B])`` hold :func:`fusion_pass.fp8.quantize_static` of
    this kernel's own float32 output (:func:`flash_attention_paged` with a float32 ``out``); other rows keep
    their bytes.
    """
    flags = {"SCALE_IS_INVERSE": bool(scale_is_inverse), "NAN_BYTE": NAN_BYTES[fp8.NaNRule(nan)]}
    return _fp8_launch(q, k_cache, v_cache, cu_seqlens, seqused_k, max_seqlen, causal, softmax_scale, output, config,
                       page_table, EPILOGUE_FP8_STATIC, scale, None, flags)


def flash_attention_fp8_group_paged(
    q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k, *, ue8m0=False, divide=False,
    causal=True, softmax_scale=None, output=None, scales=None, config=None,
):
    """Flash attention over a paged KV cache written as FP8 with one dynamic scale per row and 128 columns
    (arguments not validated; ``Dv % 128 == 0``).

    Arguments as :func:`flash_attention_paged` (no ``out`` / ``lse``); ``ue8m0``, ``divide``, ``output``,
    ``scales`` (float32 ``[T, H*Dv/128]``, any :class:`fusion_pass.fp8.ScaleLayout`) and the result ``(output,
    scales)`` as :func:`~fusion_pass.kernels.triton.flash_attention.flash_attention_fp8_group`: rows
    ``[cu_seqlens[0], cu_seqlens[B])`` hold :func:`fusion_pass.fp8.quantize_group` of this kernel's own float32
    output; other rows and their scales keep their bytes.
    """
    if scales is None:
        scales = fp8.group_scale_buffer(q.shape[0], q.shape[1] * v_cache.shape[-1], device=q.device)
    flags = {"UE8M0": bool(ue8m0), "DIVIDE": bool(divide)}
    return _fp8_launch(q, k_cache, v_cache, cu_seqlens, seqused_k, max_seqlen, causal, softmax_scale, output, config,
                       page_table, EPILOGUE_FP8_GROUP, None, scales, flags), scales
