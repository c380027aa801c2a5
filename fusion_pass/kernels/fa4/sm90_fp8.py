"""FlashAttention-4 on Hopper (SM90) with FP8 epilogues: host side.

Entry points (tensors in, caller's buffers out; no knowledge of backends or batches):

* :func:`fa4_attention_fp8_static_varlen` — FA4's SM90 main loop with a static per-tensor FP8 epilogue
  (:class:`~fusion_pass.kernels.fa4.sm90_fp8_kernel.FlashAttentionForwardSm90Fp8Static`);
* :func:`fa4_attention_fp8_group_varlen` — the same main loop with a dynamic 128-column group FP8 epilogue
  (:class:`~fusion_pass.kernels.fa4.sm90_fp8_group_kernel.FlashAttentionForwardSm90Fp8Group`).

The kernels are built by :func:`fusion_pass.kernels.fa4.sm90._compile` with the configuration, constructor
arguments and compile options of the NVFP4 kernel and its twin (:func:`fusion_pass.kernels.fa4.sm90.
fa4_attention_varlen`), so the bytes are those of the :mod:`fusion_pass.fp8` reference quantizers applied to the
twin's output. Arguments are checked on every call (no launcher plan yet); this module imports without FA4
(``flash_attn.cute`` / ``cutlass`` are imported on the first compile, after the checks).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusion_pass.fp8.checks import check_scale
from fusion_pass.kernels.checks import check_bool, check_fp8_output
from fusion_pass.kernels.fa4 import common
from fusion_pass.kernels.fa4.sm90 import KERNEL_VERSION, _compile, check_fa4_args
from fusion_pass.kernels.fa4.sm90_configs import Sm90Config, config_for, seqlen_class

__all__ = ["FP8_KERNEL_VERSION", "FP8_GROUP_KERNEL_VERSION", "compile_fp8_static_kernel", "compile_fp8_group_kernel",
           "fa4_attention_fp8_static_varlen", "fa4_attention_fp8_group_varlen"]

FP8_KERNEL_VERSION = "fusion_pass.fa4_sm90_fp8_static/3"
"""The FP8 kernel's key starts with it and :data:`KERNEL_VERSION`; bump it whenever ``sm90_fp8_kernel.py`` changes."""

FP8_GROUP_KERNEL_VERSION = "fusion_pass.fa4_sm90_fp8_group/4"
"""The group kernel's key starts with it and :data:`KERNEL_VERSION`; bump it whenever ``sm90_fp8_group_kernel.py``
or its base class's ``sm90_fp8_kernel.py`` changes."""


def compile_fp8_static_kernel(q, k, v, o, output_bytes, inv_scale, cu_seqlens, cu_seqlens_k, config: Sm90Config,
                              causal, *, nan_to_max: bool = True):
    """The compiled static FP8 kernel (``sm90_fp8_kernel.py``; NaN -> ``0x7E`` or ``0x7F``, part of the key) for
    these tensors and ``config`` (:func:`_compile`); ``output_bytes`` uint8 ``[T, H*Dv]``, ``inv_scale`` float32
    ``[1]``. Called as ``kernel(q, k, v, o, output_bytes, inv_scale, softmax_scale, cu_seqlens, cu_seqlens_k)``."""
    from fusion_pass.kernels.fa4.sm90_fp8_kernel import FlashAttentionForwardSm90Fp8Static

    nan_byte = 0x7E if nan_to_max else 0x7F
    return _compile("fusion_pass_fa4_sm90_fp8_static", (FP8_KERNEL_VERSION, KERNEL_VERSION, nan_byte),
                    lambda *a, **kw: FlashAttentionForwardSm90Fp8Static(*a, nan_byte=nan_byte, **kw), True, q, k, v,
                    lambda cute_tensor: (cute_tensor(o), cute_tensor(output_bytes),
                                         cute_tensor(inv_scale, assumed_align=4, leading_dim=0)),
                    cu_seqlens, cu_seqlens_k, config, causal, f"the SM90 FP8 static attention kernel (NaN -> "
                    f"{nan_byte:#04x})")


def fa4_attention_fp8_static_varlen(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Tensor, max_seqlen: int,
                                    softmax_scale: float, causal: bool, output: Tensor, inv_scale: Tensor,
                                    nan_to_max: bool = True, cu_seqlens_k: Tensor | None = None,
                                    max_seqlen_k: int | None = None) -> None:
    """Attention written as static per-tensor FP8 into ``output`` (contiguous, 16-byte aligned float8_e4m3fn
    ``[T, H*Dv]`` on q's device): on the rows of ``[cu_seqlens[0], cu_seqlens[B])`` the bytes of
    ``fp8.quantize_static(fa4_attention_varlen(...), inv_scale, nan=...)``, no other byte touched. ``inv_scale``:
    float32, one element, on q's device (never read on the host); ``nan_to_max``: NaN -> +448 (``0x7E``, vLLM's
    CUDA op), else ``0x7F``. Other arguments as :func:`fa4_attention_varlen`. No launcher yet (checks every call)."""
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
    cfg = config_for(q.shape[2], v.shape[2], causal, seqlen_class(max_seqlen, max_seqlen_k))
    kernel = compile_fp8_static_kernel(q, k, v, o, out, inv, cu_seqlens, cu_k, cfg, causal, nan_to_max=nan_to_max)
    if not common.is_fake_mode():  # fake tensors: compile-only checks
        kernel(q, k, v, o, out, inv, float(softmax_scale), cu_seqlens, cu_k)


def compile_fp8_group_kernel(q, k, v, o, output_bytes, scales, cu_seqlens, cu_seqlens_k, config: Sm90Config, causal,
                             *, ue8m0: bool, divide: bool):
    """The compiled group FP8 kernel (``sm90_fp8_group_kernel.py``) for these tensors and ``config``
    (:func:`_compile`); ``output_bytes`` uint8 ``[T, H*Dv]``, ``scales`` float32 ``[T, H*Dv/128]`` with canonical
    row-major ``(G, 1)`` or column-major ``(1, L)`` strides. ``ue8m0``, ``divide`` and whether the scales are
    column-major are part of the key (the column stride ``L`` is a run-time value). Called as
    ``kernel(q, k, v, o, output_bytes, scales, softmax_scale, cu_seqlens, cu_seqlens_k)``."""
    from fusion_pass.kernels.fa4.sm90_fp8_group_kernel import FlashAttentionForwardSm90Fp8Group

    column_major = scales.stride(0) == 1 and scales.stride(1) != 1
    leading = 0 if column_major else 1
    return _compile("fusion_pass_fa4_sm90_fp8_group",
                    (FP8_GROUP_KERNEL_VERSION, KERNEL_VERSION, ue8m0, divide, column_major),
                    lambda *a, **kw: FlashAttentionForwardSm90Fp8Group(*a, ue8m0=ue8m0, divide=divide, **kw), True,
                    q, k, v,
                    lambda cute_tensor: (cute_tensor(o), cute_tensor(output_bytes),
                                         cute_tensor(scales, assumed_align=4, leading_dim=leading)),
                    cu_seqlens, cu_seqlens_k, config, causal,
                    f"the SM90 FP8 group attention kernel (ue8m0={ue8m0}, divide={divide}, "
                    f"{'column' if column_major else 'row'}-major scales)")


def fa4_attention_fp8_group_varlen(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Tensor, max_seqlen: int,
                                   softmax_scale: float, causal: bool, output: Tensor, scales: Tensor,
                                   ue8m0: bool = False, divide: bool = False, cu_seqlens_k: Tensor | None = None,
                                   max_seqlen_k: int | None = None) -> None:
    """Attention written as FP8 with one dynamic scale per row and 128 columns into ``output`` (contiguous, 16-byte
    aligned float8_e4m3fn ``[T, H*Dv]`` on q's device) and ``scales`` (float32 ``[T, H*Dv/128]`` on q's device in one
    of the :class:`fusion_pass.fp8.ScaleLayout`: row-major, column-major ``(1, T)``, TMA-aligned column-major
    ``(1, round_up(T, 4))``; :func:`fusion_pass.fp8.group_scale_buffer` makes one). ``Dv % 128 == 0`` (the FA4 SM90
    head dims ``(128, 128)`` and ``(192, 128)``). On the rows of ``[cu_seqlens[0], cu_seqlens[B])``: the bytes and
    scales of ``fp8.quantize_group(fa4_attention_varlen(...).reshape(T, H*Dv), ue8m0=ue8m0, divide=divide)`` (NaN
    -> -448); no other byte or scale is touched (nor a TMA layout's padding rows). ``ue8m0``: scales rounded up to
    powers of two; ``divide``: ``x / s`` (vLLM 0.32) instead of ``x * (1 / s)`` (0.33, 0.34). Other arguments as
    :func:`fusion_pass.kernels.fa4.sm90.fa4_attention_varlen`. No launcher yet (checks every call)."""
    fn = "fa4_attention_fp8_group_varlen"
    check_fa4_args(fn, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, cu_seqlens_k, max_seqlen_k)
    common.check_fp8_group_buffers(fn, q, v, ue8m0, divide, output, scales)
    if scales.shape[0] == 0:
        return
    canonical = common.canonical_scales(scales)
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    o, out = common.unused_o(q, v.shape[2]), output.view(torch.uint8)
    cfg = config_for(q.shape[2], v.shape[2], causal, seqlen_class(max_seqlen, max_seqlen_k))
    kernel = compile_fp8_group_kernel(q, k, v, o, out, canonical, cu_seqlens, cu_k, cfg, causal, ue8m0=ue8m0,
                                      divide=divide)
    if not common.is_fake_mode():  # fake tensors: compile-only checks
        kernel(q, k, v, o, out, canonical, float(softmax_scale), cu_seqlens, cu_k)
