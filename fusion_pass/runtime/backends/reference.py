"""The ``reference`` backend: PyTorch on any device, float32 attention quantized straight from float32. Slow,
always available, the oracle of the other two."""

from __future__ import annotations

import torch

from fusion_pass import fp8, nvfp4
from fusion_pass.formats import NVFP4
from fusion_pass.kernels import launchers, reference
from fusion_pass.runtime.backends.base import FP8_WRITER, KernelBackend, fp8_group_refusal

__all__ = ["ReferenceBackend"]


class ReferenceBackend(KernelBackend):
    """PyTorch, any device: float32 attention per sequence, quantized directly from float32.

    Handles cached context (chunked prefill, prefix-cache hits) like the GPU backends: the row plan gives it
    the same keys, workspace and chunks.
    """

    name = "reference"
    lse_kernel = staticmethod(launchers.reference_attention_with_lse_varlen)  # float32 attention per sequence
    merge_kernel = staticmethod(launchers.reference_merge_nvfp4_rows)  # the reference merge
    handles_context = True
    handles_paged = True  # run_paged: the keys gathered through the page table, then as run_varlen
    kv_dtype = torch.float32  # keys and values as the layer's runtime computes them: no rounding to q's dtype
    formats = FP8_WRITER  # NVFP4 by every launch; static FP8 and FP8 groups by run_varlen_fp8_static / _group

    def available(self) -> tuple[bool, str]:
        return True, "PyTorch float32 attention + nvfp4.quantize, any device"

    def fast_on(self, device) -> tuple[bool, str]:
        if torch.device(device).type == "cpu":
            return True, "the CPU path: no faster fused kernel exists there"
        return False, f"PyTorch float32 attention is far slower on {device} than the unfused path's attention kernel"

    def supports(self, device, dtype, num_heads, qk_head_dim, v_head_dim, output_format=NVFP4) -> tuple[bool, str]:
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return False, f"reference supports float16, bfloat16 and float32 queries, got {dtype}"
        if output_format is NVFP4 and (num_heads * v_head_dim) % nvfp4.BLOCK_SIZE != 0:
            return False, f"num_heads * v_head_dim = {num_heads * v_head_dim} is not divisible by 16"
        why = fp8_group_refusal(output_format, num_heads, v_head_dim)
        return (False, why) if why else (True, "ok")

    def run_varlen(self, q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, output_scale,
                   output_block_scale, *, cu_seqlens_k=None, max_seqlen_k=None) -> None:
        """float32 attention per sequence (:func:`fusion_pass.kernels.reference.varlen_attention`), quantized
        into the sequences' rows; scale padding zeroed. Reads ``cu_seqlens`` back (CPU-speed path)."""
        t = q.shape[0]
        a, b = int(cu_seqlens[0]), int(cu_seqlens[-1])
        if cu_seqlens_k is None:  # keys at the queries' rows
            k, v = k[a:b], v[a:b]
        out32 = reference.varlen_attention(q[a:b], k, v, cu_seqlens - a, True, softmax_scale, cu_seqlens_k)[0]
        packed, scales = nvfp4.byte_views(output, output_block_scale, t)
        launchers.quantize_rows(out32.reshape(b - a, -1), output_scale, packed, scales, a)
        nvfp4.zero_scale_padding(scales, t, packed.shape[1] * 2)

    def run_varlen_fp8_static(self, q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, scale, *,
                              cu_seqlens_k=None, max_seqlen_k=None, scale_is_inverse=False,
                              nan=fp8.NaNRule.POSITIVE_MAX) -> None:
        """float32 attention per sequence, written as static per-tensor FP8 into rows ``[cu_seqlens[0],
        cu_seqlens[-1])`` of ``output`` (float8_e4m3fn ``[T, H*Dv]``): :func:`fusion_pass.fp8.quantize_static` of it
        under ``1 / scale`` (``scale`` float32 ``[1]``, the checkpoint's; with ``scale_is_inverse`` the inverse
        itself), a NaN as ``nan`` says. No other row is touched. Reads ``cu_seqlens`` back (CPU-speed path)."""
        a, b, out32 = _attention_rows(q, k, v, cu_seqlens, softmax_scale, cu_seqlens_k)
        inv = scale if scale_is_inverse else fp8.reciprocal(scale)
        output.view(torch.uint8)[a:b] = fp8.quantize_static(out32, inv, nan=nan).view(torch.uint8)

    def run_varlen_fp8_group(self, q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, scales, *,
                             cu_seqlens_k=None, max_seqlen_k=None, ue8m0=False, divide=False) -> None:
        """float32 attention per sequence, written as FP8 with one dynamic scale per row and 128 columns into rows
        ``[cu_seqlens[0], cu_seqlens[-1])`` of ``output`` (float8_e4m3fn ``[T, H*Dv]``) and of ``scales`` (float32
        ``[T, H*Dv/128]``, any :class:`fusion_pass.fp8.ScaleLayout`): :func:`fusion_pass.fp8.quantize_group` of it
        (``ue8m0``, ``divide`` as there; a NaN -448). No other row is touched, nor a TMA layout's padding. Reads
        ``cu_seqlens`` back (CPU-speed path)."""
        a, b, out32 = _attention_rows(q, k, v, cu_seqlens, softmax_scale, cu_seqlens_k)
        codes, group_scales = fp8.quantize_group(out32, ue8m0=ue8m0, divide=divide)
        output.view(torch.uint8)[a:b] = codes.view(torch.uint8)
        scales[a:b] = group_scales

    def run_paged(self, q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k,
                  softmax_scale, output, output_scale, output_block_scale) -> None:
        """float32 attention over the keys gathered through the page table
        (:func:`fusion_pass.kernels.launchers.reference_nvfp4_paged`), quantized into the sequences' rows."""
        launchers.reference_nvfp4_paged(
            q, k_cache, v_cache, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, seqused_k=seqused_k,
            page_table=page_table, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=True,
            output=output.view(torch.uint8), output_scale=output_scale, output_block_scale=output_block_scale)


def _attention_rows(q, k, v, cu_seqlens, softmax_scale, cu_seqlens_k) -> tuple[int, int, torch.Tensor]:
    """``(a, b, out)``: the rows ``[a, b) = [cu_seqlens[0], cu_seqlens[-1])`` of the sequences and their float32
    causal attention ``out [b - a, H*Dv]`` (keys: ``cu_seqlens_k``'s rows of ``k``/``v``, else the queries' own
    rows). Reads ``cu_seqlens`` back."""
    a, b = int(cu_seqlens[0]), int(cu_seqlens[-1])
    if cu_seqlens_k is None:  # keys at the queries' rows
        k, v = k[a:b], v[a:b]
    out32 = reference.varlen_attention(q[a:b], k, v, cu_seqlens - a, True, softmax_scale, cu_seqlens_k)[0]
    return a, b, out32.reshape(b - a, -1)
