"""The validated attention entry points with FP8 output (docs/formats.md), beside :mod:`.api`'s half-precision
and NVFP4 ones, with their arguments, checks and ``validate_values`` (every argument checked before anything
runs, errors :class:`~fusion_pass.nvfp4.ArgumentError` naming the argument):

* :func:`attention_fp8_static` -> ``float8_e4m3fn [T, H*Dv]`` under one static per-tensor scale;
* :func:`attention_fp8_group` -> ``(float8_e4m3fn [T, H*Dv], float32 scales [T, H*Dv/128])``, one dynamic scale
  per row and 128 columns, in any of the three :class:`fusion_pass.fp8.ScaleLayout`.

Backends (``backend=``): ``fa4`` (FA4's SM90 forward with FP8 epilogues, :mod:`fusion_pass.kernels.fa4.sm90_fp8`:
the bytes of :mod:`fusion_pass.fp8`'s reference quantizers applied to FA4's own bf16/fp16 output; H100/H200, FA4's
SM90 head dims, ``Dv % 128 == 0`` for the group format), ``triton``
(:mod:`fusion_pass.kernels.triton.flash_attention`'s FP8 epilogues: those quantizers applied to the kernel's own
float32 output), ``reference`` (float32 PyTorch attention per sequence, then those quantizers; any device),
``auto`` (``fa4`` where it runs the call, else ``triton`` for CUDA tensors when Triton imports and the call fits its
kernel, else ``reference``; :func:`fusion_pass.kernels.choice.choose_fp8`).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from fusion_pass import fp8
from fusion_pass.kernels import reference
from fusion_pass.kernels.api import check_attention
from fusion_pass.kernels.checks import check_fp8_group, check_fp8_static, check_static_nan
from fusion_pass.kernels.choice import choose_fp8
from fusion_pass.kernels.fa4.common import address

__all__ = ["attention_fp8_group", "attention_fp8_static"]


def attention_fp8_static(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    *,
    scale: Tensor,
    scale_is_inverse: bool = False,
    nan: str | fp8.NaNRule = "positive_max",
    causal: bool = True,
    softmax_scale: float | None = None,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_k: int | None = None,
    output: Tensor | None = None,
    backend: str = "auto",
    validate_values: bool | str = "device",
) -> Tensor:
    """Varlen attention written directly as static per-tensor FP8: ``fp8(clamp(o * inv, -448, 448))`` of the
    float32 attention output ``o``.

    Arguments as :func:`fusion_pass.kernels.attention` (``cu_seqlens_k`` / ``max_seqlen_k`` / ``validate_values``
    included), plus:

    * ``scale``: float32, one element, on q's device: the checkpoint's scale, ``inv = 1 / scale`` computed as
      one IEEE division (vLLM's ``static_scaled_fp8_quant``), or with ``scale_is_inverse`` the inverse itself
      (the graph's own ``reciprocal`` node, which a fused call replacing vLLM's native form reads). Its value is
      not read: a scale of 0 gives the format's bytes (docs/formats.md);
    * ``nan``: what a NaN product becomes: ``"positive_max"`` (+448, ``0x7E``: vLLM's CUDA op) or ``"nan"``
      (``0x7F``: the native form Inductor compiles), or the :class:`fusion_pass.fp8.NaNRule`; ``±Inf`` -> ``±448``;
    * ``output``: optional float8_e4m3fn ``[T, H*Dv]`` buffer (unit column stride) written and returned.

    Returns:
        float8_e4m3fn ``[T, H*Dv]`` (row = token, column ``h*Dv + d``): :func:`fusion_pass.fp8.quantize_static`
        of the backend's attention output (float32; ``fa4``: FA4's own bf16/fp16 output).
    """
    fn = "attention_fp8_static"
    rule = check_static_nan(fn, nan)
    chosen, sm_scale, max_seqlen_k = check_attention(
        fn, q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, backend, cu_seqlens_k, max_seqlen_k,
        validate_values=validate_values, chooser=functools.partial(choose_fp8, group=False),
        format_checks=lambda: check_fp8_static(fn, q, v, scale, scale_is_inverse, output),
    )
    max_seqlen = int(max_seqlen)  # checked: an int, numpy's too
    if chosen == "triton":
        from fusion_pass.kernels.triton.flash_attention import flash_attention_fp8_static

        return flash_attention_fp8_static(q, k, v, cu_seqlens, max_seqlen, scale, scale_is_inverse=scale_is_inverse,
                                          nan=rule, causal=causal, softmax_scale=sm_scale, output=output,
                                          cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
    t, h, dv = q.shape[0], q.shape[1], v.shape[2]
    if chosen == "fa4":
        from fusion_pass.kernels.fa4.sm90_fp8 import fa4_attention_fp8_static_varlen

        inv = scale if scale_is_inverse else fp8.reciprocal(scale)
        dest = _fa4_output(output, t, h * dv, q.device)
        fa4_attention_fp8_static_varlen(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, softmax_scale=sm_scale,
                                        causal=causal, output=dest, inv_scale=inv,
                                        nan_to_max=rule is fp8.NaNRule.POSITIVE_MAX, cu_seqlens_k=cu_seqlens_k,
                                        max_seqlen_k=max_seqlen_k)
        return _into(dest, output)
    out = reference.varlen_attention(q, k, v, cu_seqlens, causal, sm_scale, cu_seqlens_k)[0]
    inv = scale if scale_is_inverse else fp8.reciprocal(scale)
    return _into(fp8.quantize_static(out.reshape(t, h * dv), inv, nan=rule), output)


def attention_fp8_group(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    *,
    ue8m0: bool = False,
    divide: bool = False,
    causal: bool = True,
    softmax_scale: float | None = None,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_k: int | None = None,
    output: Tensor | None = None,
    scales: Tensor | None = None,
    backend: str = "auto",
    validate_values: bool | str = "device",
) -> tuple[Tensor, Tensor]:
    """Varlen attention written directly as FP8 with one dynamic scale per row and 128 columns (vLLM's
    ``per_token_group_fp8_quant``, group 128, DeepSeek-style block-FP8 models).

    Arguments as :func:`fusion_pass.kernels.attention`, plus:

    * ``ue8m0``: scales rounded up to powers of two (DeepGEMM's UE8M0 scales, as float32);
    * ``divide``: ``q = o / s`` (vLLM 0.32's kernel) instead of ``o * (1 / s)`` (0.33, 0.34);
    * ``output``: optional float8_e4m3fn ``[T, H*Dv]`` buffer (unit column stride);
    * ``scales``: optional float32 ``[T, H*Dv/128]`` buffer, row-major, column-major (strides ``(1, T)``) or
      TMA-aligned column-major (strides ``(1, round_up(T, 4))``; the padding rows are not written):
      :func:`fusion_pass.fp8.group_scale_buffer` makes one. Default: a new row-major one.

    ``H * Dv`` must be divisible by 128 (``Dv`` itself for ``triton`` and ``fa4``, whose epilogues quantize one
    head at a time). Per row and group: ``s = max(1e-10, max |o_g|) / 448`` (NaN elements left out), a NaN
    quotient -> -448.

    Returns:
        ``(output, scales)``: :func:`fusion_pass.fp8.quantize_group` of the backend's attention output (float32;
        ``fa4``: FA4's own bf16/fp16 output), the scales in the given buffer's layout.
    """
    fn = "attention_fp8_group"
    chosen, sm_scale, max_seqlen_k = check_attention(
        fn, q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, backend, cu_seqlens_k, max_seqlen_k,
        validate_values=validate_values, chooser=functools.partial(choose_fp8, group=True),
        format_checks=lambda: check_fp8_group(fn, q, v, ue8m0, divide, output, scales),
    )
    max_seqlen = int(max_seqlen)  # checked: an int, numpy's too
    if chosen == "triton":
        from fusion_pass.kernels.triton.flash_attention import flash_attention_fp8_group

        return flash_attention_fp8_group(q, k, v, cu_seqlens, max_seqlen, ue8m0=ue8m0, divide=divide, causal=causal,
                                         softmax_scale=sm_scale, output=output, scales=scales,
                                         cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
    t, h, dv = q.shape[0], q.shape[1], v.shape[2]
    if chosen == "fa4":
        from fusion_pass.kernels.fa4.sm90_fp8 import fa4_attention_fp8_group_varlen

        dest = _fa4_output(output, t, h * dv, q.device)
        if scales is None:
            scales = fp8.group_scale_buffer(t, h * dv, device=q.device)
        fa4_attention_fp8_group_varlen(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, softmax_scale=sm_scale,
                                       causal=causal, output=dest, scales=scales, ue8m0=ue8m0, divide=divide,
                                       cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
        return _into(dest, output), scales
    out = reference.varlen_attention(q, k, v, cu_seqlens, causal, sm_scale, cu_seqlens_k)[0]
    got, got_scales = fp8.quantize_group(out.reshape(t, h * dv), ue8m0=ue8m0, divide=divide)
    if scales is None:
        return _into(got, output), got_scales
    scales.copy_(got_scales)
    return _into(got, output), scales


def _fa4_output(output: Tensor | None, t: int, width: int, device) -> Tensor:
    """Where FA4's epilogue writes: ``output`` when it is contiguous and 16-byte aligned (its 8-byte stores), else a
    new ``[T, H*Dv]`` buffer (copied into ``output`` afterwards by :func:`_into`)."""
    if output is not None and output.is_contiguous() and address(output) % 16 == 0:
        return output
    return torch.empty(t, width, dtype=fp8.FP8, device=device)


def _into(q8: Tensor, output: Tensor | None) -> Tensor:
    """``q8``, or ``output`` holding its bytes."""
    if output is None or output is q8:
        return q8
    output.view(torch.uint8).copy_(q8.view(torch.uint8))
    return output
