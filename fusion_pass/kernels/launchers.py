"""The kernels' unvalidated calls, for the run-time backends' hot path.

The backends build every argument themselves (the attention op checked the user's), so nothing here
checks values or reads a device tensor back on the host: no synchronization on ``triton`` and ``fa4``.
Users call the validated entry points of :mod:`fusion_pass.kernels.api` instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusion_pass import nvfp4
from fusion_pass.kernels import reference
from fusion_pass.kernels.checks import check_cu_seqlens_k, check_max_seqlen_k, check_qkv, describe
from fusion_pass.kernels.choice import triton_importable
from fusion_pass.kernels.fa4.forward import fa4_attention_nvfp4_varlen, fa4_attention_varlen
from fusion_pass.nvfp4 import ArgumentError
from fusion_pass.nvfp4.reference import write_rows

__all__ = [
    "attention_half_varlen",
    "attention_with_lse_varlen",
    "fa4_attention_nvfp4_varlen",
    "flash_attention_nvfp4_varlen",
    "merge_nvfp4_rows",
    "quantize_into",
    "quantize_rows",
]


def attention_half_varlen(backend: str, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                          softmax_scale: float) -> Tensor:
    """Causal varlen attention in the query dtype ``[T, H, Dv]`` by ``backend`` (``fa4`` or ``triton``): the
    unfused graph's attention of a pure-prefill batch on CUDA, with the main loop the fused kernel shares."""
    if backend == "fa4":
        return fa4_attention_varlen(q, k, v, cu_seqlens, max_seqlen, causal=True, softmax_scale=softmax_scale)
    from fusion_pass.kernels.triton.flash_attention import flash_attention

    return flash_attention(q, k, v, cu_seqlens, max_seqlen, causal=True, softmax_scale=softmax_scale)


def attention_with_lse_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens: Tensor,
    max_seqlen: int,
    cu_seqlens_k: Tensor | None,
    max_seqlen_k: int | None,
    softmax_scale: float,
    causal: bool,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """:func:`fusion_pass.kernels.attention_with_lse`'s body for the fused backends' chunked-context path: arguments trusted
    (the backend built them), ``backend`` one of ``triton``, ``fa4``, ``reference``; no host
    synchronization on ``triton`` and ``fa4``."""
    if backend == "triton":
        from fusion_pass.kernels.triton.flash_attention import flash_attention

        out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]), dtype=torch.float32)
        lse = q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)
        flash_attention(q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=softmax_scale, out=out,
                        cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k, lse=lse)
        return out, lse
    if backend == "fa4":
        out, lse = fa4_attention_varlen(q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=softmax_scale,
                                        cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k, return_lse=True)
        return out.float(), lse
    return reference.varlen_attention(q, k, v, cu_seqlens, causal, softmax_scale, cu_seqlens_k)


def merge_nvfp4_rows(backend: str, out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor,
                     global_scale: Tensor, packed: Tensor, scales: Tensor, row_start: int) -> None:
    """:func:`fusion_pass.kernels.merge_attention_nvfp4` unvalidated: the Triton launcher (``backend="triton"``,
    no host synchronization) or the reference (``"reference"``)."""
    if backend == "triton":
        from fusion_pass.kernels.triton.merge import merge_attention_nvfp4_launch

        merge_attention_nvfp4_launch(out_a, lse_a, out_b, lse_b, global_scale, packed, scales, row_start)
    else:
        reference.merge_nvfp4(out_a, lse_a, out_b, lse_b, global_scale, packed, scales, row_start)


def quantize_into(x: Tensor, global_scale: Tensor, packed: Tensor, scales: Tensor, *, swizzled: bool = True) -> None:
    """:func:`fusion_pass.kernels.quantize` of ``x [M, K]`` into given buffers (every byte written, padding
    zero): the Triton launcher for CUDA tensors when Triton imports (no synchronization), the reference
    elsewhere. ``packed``: ``M * K/2`` bytes; ``scales``: the scale layout's bytes (any one-byte or int32 view).
    The body of the ``scaled_fp4_quant.out`` op and of the attention ops' unfused fallback."""
    if x.is_cuda and triton_importable():
        from fusion_pass.kernels.triton.quantize import quantize_launch

        quantize_launch(x, global_scale, swizzled=swizzled, packed=packed, scales=scales)
        return
    ref_packed, ref_scales = nvfp4.quantize(x, global_scale, swizzled=swizzled)
    packed.view(torch.uint8).view(ref_packed.shape).copy_(ref_packed)
    scales.view(torch.uint8).view(ref_scales.shape).copy_(ref_scales.view(torch.uint8))


def quantize_rows(x: Tensor, global_scale: Tensor, packed: Tensor, scales: Tensor, row_start: int,
                  backend: str | None = None) -> None:
    """:func:`fusion_pass.kernels.quantize_rows_into` unvalidated: the Triton launcher (``backend="triton"``, or
    ``None`` and a CUDA tensor; the global scale is not read back: no synchronization), else the reference."""
    if backend == "triton" or (backend is None and x.is_cuda):
        from fusion_pass.kernels.triton.quantize import quantize_rows_launch

        quantize_rows_launch(x, global_scale, packed, scales, row_start)
    else:
        write_rows(x, global_scale, packed, scales, row_start)


def flash_attention_nvfp4_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens: Tensor,
    max_seqlen: int,
    softmax_scale: float,
    causal: bool,
    output: Tensor,
    output_scale: Tensor,
    output_block_scale: Tensor,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_k: int | None = None,
) -> None:
    """The ``triton`` fused backend's call (:class:`fusion_pass.runtime.backends.triton.TritonBackend`).

    Writes the NVFP4 attention output into the attention op's buffers (already
    validated by the op): ``output`` uint8 ``[T, H*Dv/2]``, ``output_scale`` the
    global scale, ``output_block_scale`` the swizzled scale buffer (any one-byte
    or int32 view). q/k/v/``cu_seqlens``/``cu_seqlens_k`` come from the backend,
    not the user; only their shapes are checked here (no device synchronization).
    Sequence ``b``'s outputs go to rows ``[cu_seqlens[b], cu_seqlens[b+1])``, which
    may start past row 0 (other rows keep their bytes; the scale padding is zeroed);
    its keys are rows ``[cu_seqlens_k[b], cu_seqlens_k[b+1])`` of k/v (default
    ``cu_seqlens``), causal bottom-right aligned as in :func:`attention`.
    """
    from fusion_pass.kernels.triton.flash_attention import flash_attention_nvfp4

    fn = "flash_attention_nvfp4_varlen"
    check_qkv(fn, q, k, v, separate_kv=cu_seqlens_k is not None)
    if v.shape[2] % nvfp4.BLOCK_SIZE != 0:
        raise ArgumentError(f"{fn}: v's head dim must be divisible by 16, got {v.shape[2]}")
    if (
        not isinstance(cu_seqlens, Tensor)
        or cu_seqlens.dtype != torch.int32
        or cu_seqlens.dim() != 1
        or cu_seqlens.numel() < 2
        or cu_seqlens.device != q.device
        or not cu_seqlens.is_contiguous()
    ):
        raise ArgumentError(
            f"{fn}: cu_seqlens must be contiguous int32 [B + 1 >= 2] on {q.device}, got {describe(cu_seqlens)}"
        )
    if cu_seqlens_k is not None:
        check_cu_seqlens_k(fn, cu_seqlens_k, cu_seqlens, q.device)
    check_max_seqlen_k(fn, max_seqlen_k, cu_seqlens_k)
    flash_attention_nvfp4(
        q, k, v, cu_seqlens, max_seqlen, output_scale, causal=causal, softmax_scale=softmax_scale,
        packed=output.view(torch.uint8), scales=output_block_scale, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_k=max_seqlen_k,
    )
