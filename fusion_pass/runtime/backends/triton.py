"""The ``triton`` backend: the project's Triton flash attention with an NVFP4 epilogue, any CUDA GPU it supports
(Hopper has no FP4 instructions: the epilogue rounds and packs with ordinary ones)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Any, Callable

import torch

from fusion_pass import fp8, nvfp4
from fusion_pass.formats import NVFP4
from fusion_pass.kernels import launchers
from fusion_pass.runtime.backends.base import (FP8_WRITER, HALF_DTYPES, KernelBackend, check_device_dtype,
                                               fp8_group_refusal)

__all__ = ["TRITON_KERNEL_MODULE", "TritonBackend", "triton_availability"]

TRITON_KERNEL_MODULE = "fusion_pass.kernels.triton.flash_attention"
"""The module of the Triton kernels this backend launches."""


def triton_availability(
    *,
    find_spec: Callable[[str], Any] = importlib.util.find_spec,
    import_module: Callable[[str], Any] = importlib.import_module,
    cuda_available: Callable[[], bool] = torch.cuda.is_available,
) -> tuple[bool, str]:
    """Decide whether the Triton backend can run; the probes are injectable.

    Checks, in order: :data:`TRITON_KERNEL_MODULE` is part of this build (``find_spec``); ``triton``
    imports; a CUDA device exists; the kernel module imports.
    """
    if find_spec("fusion_pass.kernels") is None:
        return False, f"{TRITON_KERNEL_MODULE} (the Triton kernels) is not part of this build"
    try:
        triton = import_module("triton")
    except ImportError:
        return False, "triton is not installed"
    except Exception as exc:
        return False, f"triton failed to import: {type(exc).__name__}: {exc}"
    if not cuda_available():
        return False, "no CUDA device"
    try:
        import_module(TRITON_KERNEL_MODULE)
    except Exception as exc:
        return False, f"{TRITON_KERNEL_MODULE} failed to import: {type(exc).__name__}: {exc}"
    version = getattr(triton, "__version__", "?")
    return True, f"Triton {version} flash attention with an NVFP4 epilogue"


@functools.lru_cache(maxsize=None)
def triton_status() -> tuple[bool, str]:
    return triton_availability()


class TritonBackend(KernelBackend):
    """The project's Triton flash attention with an NVFP4 epilogue.

    Calls :func:`fusion_pass.kernels.launchers.flash_attention_nvfp4_varlen` with the row plan's
    ``q``/``k``/``v``, ``output`` uint8 ``[T, H*Dv/2]`` and ``output_block_scale`` the swizzled
    scale buffer (the kernel writes every entry of its rows; the launcher zeroes the padding).
    """

    name = "triton"
    timed = True  # fusion-pass selftest times it against the unfused paths
    lse_kernel = staticmethod(launchers.triton_attention_with_lse_varlen)  # the Triton kernel's partial attentions
    merge_kernel = staticmethod(launchers.triton_merge_nvfp4_rows)  # the Triton NVFP4 merge
    half_attention = staticmethod(launchers.triton_attention_half_varlen)  # the Triton kernel in the query dtype
    handles_context = True  # keys context + new tokens (cu_seqlens_k), see run_prefills
    handles_paged = True  # run_paged: the Triton kernel reading keys and values through the page table
    formats = FP8_WRITER  # NVFP4 by every launch; static FP8 and FP8 groups by run_varlen_fp8_* (its FP8 epilogues)

    def available(self) -> tuple[bool, str]:
        return triton_status()

    def refresh(self) -> None:
        """Forget the cached availability."""
        triton_status.cache_clear()

    def fast_on(self, device) -> tuple[bool, str]:
        return False, ("measured at 0.67-0.82x of cuDNN attention + quant on the H200 (docs/benchmarks.md); "
                       "it runs when asked for by name")

    def supports(self, device, dtype, num_heads, qk_head_dim, v_head_dim, output_format=NVFP4) -> tuple[bool, str]:
        ok, why = check_device_dtype(self.name, device, dtype, HALF_DTYPES)
        if not ok:
            return ok, why
        if output_format is NVFP4 and v_head_dim % nvfp4.BLOCK_SIZE != 0:
            return False, f"triton's NVFP4 epilogue needs v_head_dim divisible by 16, got {v_head_dim}"
        why = fp8_group_refusal(output_format, num_heads, v_head_dim)
        return (False, why) if why else (True, "ok")

    def run_varlen(self, q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, output_scale,
                   output_block_scale, *, cu_seqlens_k=None, max_seqlen_k=None) -> None:
        launchers.flash_attention_nvfp4_varlen(
            q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, softmax_scale=softmax_scale, causal=True,
            output=output.view(torch.uint8), output_scale=output_scale, output_block_scale=output_block_scale,
            cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)

    def run_varlen_fp8_static(self, q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, scale, *,
                              cu_seqlens_k=None, max_seqlen_k=None, scale_is_inverse=False,
                              nan=fp8.NaNRule.POSITIVE_MAX) -> None:
        """The Triton kernel's static FP8 epilogue
        (:func:`fusion_pass.kernels.launchers.flash_attention_fp8_static_varlen`) into rows ``[cu_seqlens[0],
        cu_seqlens[-1])`` of ``output`` (float8_e4m3fn ``[T, H*Dv]``); no other byte is touched."""
        launchers.flash_attention_fp8_static_varlen(
            q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, softmax_scale=softmax_scale, causal=True,
            output=output, scale=scale, scale_is_inverse=scale_is_inverse, nan=nan, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_k=max_seqlen_k)

    def run_varlen_fp8_group(self, q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, scales, *,
                             cu_seqlens_k=None, max_seqlen_k=None, ue8m0=False, divide=False) -> None:
        """The Triton kernel's 128-column group FP8 epilogue
        (:func:`fusion_pass.kernels.launchers.flash_attention_fp8_group_varlen`) into rows ``[cu_seqlens[0],
        cu_seqlens[-1])`` of ``output`` (float8_e4m3fn ``[T, H*Dv]``) and of ``scales`` (float32 ``[T, H*Dv/128]``,
        any :class:`fusion_pass.fp8.ScaleLayout`): :func:`fusion_pass.fp8.quantize_group` of the kernel's own
        float32 output; no other byte or scale is touched, nor a TMA layout's padding."""
        launchers.flash_attention_fp8_group_varlen(
            q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, softmax_scale=softmax_scale, causal=True,
            output=output, output_scales=scales, ue8m0=ue8m0, divide=divide, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_k=max_seqlen_k)

    def run_paged(self, q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k,
                  softmax_scale, output, output_scale, output_block_scale) -> None:
        launchers.flash_attention_nvfp4_paged(
            q, k_cache, v_cache, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, seqused_k=seqused_k,
            page_table=page_table, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=True,
            output=output.view(torch.uint8), output_scale=output_scale, output_block_scale=output_block_scale)
