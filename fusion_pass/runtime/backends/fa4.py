"""The ``fa4`` backend: FlashAttention-4 with this project's NVFP4 output stage.

On SM90 (H100, H200) FA4's SM90 kernel with an NVFP4 epilogue, run and byte-checked on an H200; on SM100/SM110
(B200, GB200) FA4's SM100 kernel quantizing in its correction warps' registers, compiled in the CPU suite but
never run by this project (no Blackwell GPU is lent to it), so the run time self-checks it before its first
use (:meth:`FA4Backend.self_check_needed`, :mod:`.canary`, :mod:`fusion_pass.runtime.self_check`).
Both through :mod:`fusion_pass.kernels.fa4.forward` (``docs/fa4.md``, ``docs/blackwell.md``).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Callable

import torch

from fusion_pass.kernels import launchers
from fusion_pass.kernels.fa4 import common as fa4_common
from fusion_pass.kernels.fa4 import forward
from fusion_pass.runtime import settings
from fusion_pass.runtime.backends import canary
from fusion_pass.runtime.backends.base import HALF_DTYPES, KernelBackend, check_device_dtype

__all__ = ["FA4Backend", "fa4_status"]


@functools.lru_cache(maxsize=None)
def device_arch(index: int | None) -> int | None:
    """``major * 10 + minor`` of CUDA device ``index`` (the current one for ``None``); ``None`` without CUDA."""
    if not torch.cuda.is_available():
        return None
    return fa4_common.device_arch(torch.device("cuda", torch.cuda.current_device() if index is None else index))


@functools.lru_cache(maxsize=None)
def fa4_status() -> tuple[bool, str]:
    """Whether FA4 and the subclass for this machine's GPU generation import: ``(ok, description or why)``. Without
    a CUDA device nothing of FA4 is imported."""
    arch = device_arch(None)
    if arch is None:  # FA4 is not imported without a GPU (about a second and several warnings on a CPU machine)
        installed = importlib.util.find_spec("flash_attn") is not None
        return False, (f"no CUDA device (flash-attn-4 {'installed' if installed else 'not installed'}; not imported "
                       f"without one)")
    module = "sm100_kernel" if arch // 10 in (10, 11) else "sm90_kernel"
    ok, why = fa4_common.fa4_import_status(module)
    if not ok:
        return False, why
    generation = {9: "SM90", 10: "SM100", 11: "SM100"}.get(arch // 10)
    if generation is None:
        return False, f"no kernel of this project for sm_{arch} (FA4 NVFP4 kernels: SM90, SM100/SM110; {why})"
    return True, f"FA4 {generation} forward with the fusion_pass NVFP4 output stage on sm_{arch} ({why})"


class FA4Backend(KernelBackend):
    """FlashAttention-4 with NVFP4 output (module docstring).

    ``fused_kernel`` replaces :func:`fusion_pass.kernels.launchers.fa4_attention_nvfp4_varlen` (same
    arguments) in :meth:`run_varlen`; tests inject a PyTorch stand-in, nothing else should."""

    name = "fa4"
    lse_kernel, merge_kernel = "fa4", "triton"  # FA4's own forward for partial attentions, the Triton NVFP4 merge
    handles_context = True  # keys context + new tokens (cu_seqlens_k), see run_prefills

    def __init__(self, fused_kernel: Callable[..., None] | None = None) -> None:
        self._fused_kernel = fused_kernel

    def available(self) -> tuple[bool, str]:
        return fa4_status()

    def fast_on(self, device) -> tuple[bool, str]:
        arch = device_arch(torch.device(device).index) if torch.device(device).type == "cuda" else None
        if arch is not None and arch // 10 == 9:
            return True, "measured faster than cuDNN attention + quant at 7 of 9 shapes on the H200 (docs/benchmarks.md)"
        if arch is not None and arch // 10 in (10, 11):
            return True, "FA4's own kernel for this GPU generation (self-checked before its first use)"
        found = "no CUDA device" if arch is None else f"sm_{arch}"
        return False, f"no measurement or kernel of this project for {found}"

    def supports(self, device, dtype, num_heads, qk_head_dim, v_head_dim) -> tuple[bool, str]:
        ok, why = check_device_dtype(self.name, device, dtype, HALF_DTYPES)
        if not ok:
            return ok, why
        return forward.fa4_usable(device, dtype, num_heads, qk_head_dim, v_head_dim)

    def run_varlen(self, q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, output_scale,
                   output_block_scale, *, cu_seqlens_k=None, max_seqlen_k=None) -> None:
        """:func:`fusion_pass.kernels.launchers.fa4_attention_nvfp4_varlen` (the kernel of the device's
        generation; it zeroes the scale buffer's padding itself)."""
        kernel = self._fused_kernel or launchers.fa4_attention_nvfp4_varlen
        kernel(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, softmax_scale=softmax_scale, causal=True,
               output=output.view(torch.uint8), output_scale=output_scale, output_block_scale=output_block_scale,
               cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)

    def self_check_needed(self, device) -> tuple[bool, str]:
        """Whether the fused kernel must pass :meth:`canary` before it serves ``device``: always for a kernel
        this project never ran on hardware (SM100/SM110), for SM90 only with the self-check setting ``all``;
        never with ``off`` (:func:`fusion_pass.runtime.settings.self_check_mode`)."""
        mode = settings.self_check_mode()
        if mode == "off":
            return False, "self-check off (FUSION_PASS_SELF_CHECK=off)"
        device = torch.device(device)
        arch = device_arch(device.index) if device.type == "cuda" else None
        if arch is not None and arch // 10 in (10, 11):
            return True, "the SM100 kernel was compiled but never run on hardware by this project"
        if mode == "all":
            return True, "self-check of every fused kernel requested (FUSION_PASS_SELF_CHECK=all)"
        return False, "the SM90 kernel is byte-checked on an H200 by this project's tests"

    def canary(self, device, dtype, num_heads, qk_head_dim, v_head_dim, group: int = 1) -> tuple[bool, str]:
        """:func:`fusion_pass.runtime.backends.canary.run_canary` with the layer's dtype, head dims and query heads
        per KV head (``group``): the fused kernel against FA4's forward + ``nvfp4.quantize``, every byte."""
        return canary.run_canary(device, dtype, qk_head_dim, v_head_dim, group)
