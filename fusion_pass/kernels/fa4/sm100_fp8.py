"""FlashAttention-4 on Blackwell (SM100/SM110) with FP8 output stages: host side.

* :func:`fa4_attention_fp8_static_varlen` — FA4's SM100 forward whose correction warps quantize the output to
  static per-tensor FP8 in registers (:class:`~fusion_pass.kernels.fa4.sm100_fp8_kernel.
  FlashAttentionForwardSm100Fp8Static`), the contract of :func:`fusion_pass.kernels.fa4.sm90_fp8.
  fa4_attention_fp8_static_varlen`: the bytes of ``fp8.quantize_static`` applied to FA4's own SM100 output of the
  same call (:func:`fusion_pass.kernels.fa4.sm100.fa4_attention_varlen`);
* :func:`fa4_attention_fp8_group_varlen` — the same with one dynamic scale per row and 128 columns
  (:class:`~fusion_pass.kernels.fa4.sm100_fp8_group_kernel.FlashAttentionForwardSm100Fp8Group`), the contract of
  :func:`fusion_pass.kernels.fa4.sm90_fp8.fa4_attention_fp8_group_varlen`: ``fp8.quantize_group`` of FA4's own
  SM100 output.

Built by :func:`fusion_pass.kernels.fa4.sm100._compile` with the NVFP4 kernel's configuration, constructor
arguments and compile options. Compiled for ``sm_100a`` on the CPU (fake tensors), never run: no Blackwell GPU is
lent to this project, and no entry point or backend calls them yet. Arguments are checked on every call; this
module imports without FA4.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusion_pass.fp8.checks import check_scale
from fusion_pass.kernels.checks import check_bool, check_fp8_output
from fusion_pass.kernels.fa4 import common
from fusion_pass.kernels.fa4.sm100 import _compile, check_fa4_args, config_class

__all__ = ["FP8_KERNEL_VERSION", "FP8_GROUP_KERNEL_VERSION", "compile_fp8_static_kernel", "compile_fp8_group_kernel",
           "fa4_attention_fp8_static_varlen", "fa4_attention_fp8_group_varlen"]

FP8_KERNEL_VERSION = "fusion_pass.fa4_sm100_fp8_static/2"
"""Part of the kernel's compile key (with the SM100 ``KERNEL_VERSION``); bump it whenever ``sm100_fp8_kernel.py``
changes."""

FP8_GROUP_KERNEL_VERSION = "fusion_pass.fa4_sm100_fp8_group/1"
"""Part of the group kernel's compile key (with the SM100 ``KERNEL_VERSION``); bump it whenever
``sm100_fp8_group_kernel.py``, its base class's ``sm100_fp8_kernel.py`` or the arithmetic it imports from
``sm90_fp8_group_kernel.py`` changes."""


def compile_fp8_static_kernel(q, k, v, o, output_bytes, inv_scale, cu_seqlens, cu_seqlens_k, cls: int, causal,
                              *, nan_to_max: bool = True):
    """The compiled SM100 static FP8 kernel (NaN -> ``0x7E`` or ``0x7F``, part of the key) for these tensors and
    configuration class ``cls`` (:func:`fusion_pass.kernels.fa4.sm100.config_class`); ``output_bytes`` uint8
    ``[T, H*Dv]``, ``inv_scale`` float32 ``[1]``. Called as ``kernel(q, k, v, o, output_bytes, inv_scale,
    softmax_scale, cu_seqlens, cu_seqlens_k, max(max_seqlen, 1))``."""
    from fusion_pass.kernels.fa4.sm100_fp8_kernel import FlashAttentionForwardSm100Fp8Static

    nan_byte = 0x7E if nan_to_max else 0x7F
    variant = (("fp8_static", FP8_KERNEL_VERSION, nan_byte),
               lambda *a, **kw: FlashAttentionForwardSm100Fp8Static(*a, nan_byte=nan_byte, **kw),
               lambda cute_tensor: (cute_tensor(output_bytes), cute_tensor(inv_scale, assumed_align=4, leading_dim=0)),
               f"FP8 static (NaN -> {nan_byte:#04x})")
    return _compile(True, q, k, v, o, cu_seqlens, cu_seqlens_k, cls, causal, variant=variant)


def fa4_attention_fp8_static_varlen(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Tensor, max_seqlen: int,
                                    softmax_scale: float, causal: bool, output: Tensor, inv_scale: Tensor,
                                    nan_to_max: bool = True, cu_seqlens_k: Tensor | None = None,
                                    max_seqlen_k: int | None = None) -> None:
    """Attention written as static per-tensor FP8 by FA4's SM100 forward into ``output`` (contiguous, 16-byte
    aligned float8_e4m3fn ``[T, H*Dv]`` on q's device): on the rows of ``[cu_seqlens[0], cu_seqlens[B])`` the bytes
    of ``fp8.quantize_static(sm100.fa4_attention_varlen(...), inv_scale, nan=...)``, no other byte touched.
    ``inv_scale``: float32, one element, on q's device (never read on the host); ``nan_to_max``: NaN -> +448
    (``0x7E``), else ``0x7F``. Other arguments as :func:`fusion_pass.kernels.fa4.sm100.fa4_attention_varlen`
    (SM100 head dims; ``q`` token-major)."""
    fn = "fa4_attention_fp8_static_varlen"
    check_fa4_args(fn, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, cu_seqlens_k, max_seqlen_k)
    check_fp8_output(fn, output, q.shape[0], q.shape[1] * v.shape[2], q.device)  # None passes this one
    common.check_fp8_bytes(fn, output)
    check_scale(fn, inv_scale, q.device, name="inv_scale")
    check_bool(fn, "nan_to_max", nan_to_max)
    if q.shape[0] == 0:
        return
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    o, out, inv = common.unused_o(q, v.shape[2]), output.view(torch.uint8), inv_scale.as_strided((1,), (1,))
    kernel = compile_fp8_static_kernel(q, k, v, o, out, inv, cu_seqlens, cu_k, config_class(max_seqlen, max_seqlen_k),
                                       causal, nan_to_max=nan_to_max)
    if not common.is_fake_mode():  # fake tensors: compile-only checks
        kernel(q, k, v, o, out, inv, float(softmax_scale), cu_seqlens, cu_k, max(int(max_seqlen), 1))


def compile_fp8_group_kernel(q, k, v, o, output_bytes, scales, cu_seqlens, cu_seqlens_k, cls: int, causal, *,
                             ue8m0: bool, divide: bool):
    """The compiled SM100 group FP8 kernel for these tensors and configuration class ``cls``
    (:func:`fusion_pass.kernels.fa4.sm100.config_class`); ``output_bytes`` uint8 ``[T, H*Dv]``, ``scales`` float32
    ``[T, H*Dv/128]`` with canonical row-major ``(G, 1)`` or column-major ``(1, L)`` strides
    (:func:`fusion_pass.kernels.fa4.common.canonical_scales`). ``ue8m0``, ``divide`` and whether the scales are
    column-major are part of the key (the column stride ``L`` is a run-time value). Called as ``kernel(q, k, v, o,
    output_bytes, scales, softmax_scale, cu_seqlens, cu_seqlens_k, max(max_seqlen, 1))``."""
    from fusion_pass.kernels.fa4.sm100_fp8_group_kernel import FlashAttentionForwardSm100Fp8Group

    column_major = scales.stride(0) == 1 and scales.stride(1) != 1
    leading = 0 if column_major else 1
    variant = (("fp8_group", FP8_GROUP_KERNEL_VERSION, ue8m0, divide, column_major),
               lambda *a, **kw: FlashAttentionForwardSm100Fp8Group(*a, ue8m0=ue8m0, divide=divide, **kw),
               lambda cute_tensor: (cute_tensor(output_bytes),
                                    cute_tensor(scales, assumed_align=4, leading_dim=leading)),
               f"FP8 group (ue8m0={ue8m0}, divide={divide}, {'column' if column_major else 'row'}-major scales)")
    return _compile(True, q, k, v, o, cu_seqlens, cu_seqlens_k, cls, causal, variant=variant)


def fa4_attention_fp8_group_varlen(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Tensor, max_seqlen: int,
                                   softmax_scale: float, causal: bool, output: Tensor, scales: Tensor,
                                   ue8m0: bool = False, divide: bool = False, cu_seqlens_k: Tensor | None = None,
                                   max_seqlen_k: int | None = None) -> None:
    """Attention written as FP8 with one dynamic scale per row and 128 columns by FA4's SM100 forward into
    ``output`` (contiguous, 16-byte aligned float8_e4m3fn ``[T, H*Dv]`` on q's device) and ``scales`` (float32
    ``[T, H*Dv/128]`` on q's device in one of the :class:`fusion_pass.fp8.ScaleLayout`, or the first rows of a
    column-major buffer). ``Dv % 128 == 0`` (the SM100 head dims ``(128, 128)`` and ``(192, 128)``). On the rows of
    ``[cu_seqlens[0], cu_seqlens[B])``: the bytes and scales of ``fp8.quantize_group(sm100.fa4_attention_varlen(
    ...).reshape(T, H*Dv), ue8m0=ue8m0, divide=divide)`` (NaN -> -448); no other byte or scale is touched.
    Arguments as :func:`fusion_pass.kernels.fa4.sm90_fp8.fa4_attention_fp8_group_varlen` (SM100 head dims; ``q``
    token-major)."""
    fn = "fa4_attention_fp8_group_varlen"
    check_fa4_args(fn, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, cu_seqlens_k, max_seqlen_k)
    common.check_fp8_group_buffers(fn, q, v, ue8m0, divide, output, scales)
    if scales.shape[0] == 0:
        return
    canonical = common.canonical_scales(scales)
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    o, out = common.unused_o(q, v.shape[2]), output.view(torch.uint8)
    kernel = compile_fp8_group_kernel(q, k, v, o, out, canonical, cu_seqlens, cu_k,
                                      config_class(max_seqlen, max_seqlen_k), causal, ue8m0=ue8m0, divide=divide)
    if not common.is_fake_mode():  # fake tensors: compile-only checks
        kernel(q, k, v, o, out, canonical, float(softmax_scale), cu_seqlens, cu_k, max(int(max_seqlen), 1))
