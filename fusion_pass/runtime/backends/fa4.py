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
import torch

from fusion_pass import fp8
from fusion_pass.kernels import launchers
from fusion_pass.kernels.fa4 import common as fa4_common
from fusion_pass.kernels.fa4 import forward, generations
from fusion_pass.runtime.backends import canary
from fusion_pass.runtime.backends.base import (FP8_WRITER, HALF_DTYPES, NVFP4_ONLY, KernelBackend,
                                               check_device_dtype, fp8_group_refusal)

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
    generation = generations.for_arch(arch)
    if generation is None:
        known = ", ".join(g.label for g in generations.GENERATIONS)
        return False, f"no kernel of this project for sm_{arch} (FA4 NVFP4 kernels: {known})"
    ok, why = fa4_common.fa4_import_status(generation.kernel_module)
    if not ok:
        return False, why
    return True, f"FA4 {generation.label} forward with the fusion_pass NVFP4 output stage on sm_{arch} ({why})"


class FA4Backend(KernelBackend):
    """FlashAttention-4 with NVFP4 output (module docstring)."""

    name = "fa4"
    timed = True  # fusion-pass selftest times it against the unfused paths
    lse_kernel = staticmethod(launchers.fa4_attention_with_lse_varlen)  # FA4's own forward for partial attentions
    merge_kernel = staticmethod(launchers.triton_merge_nvfp4_rows)  # the Triton NVFP4 merge
    half_attention = staticmethod(launchers.fa4_attention_half_varlen)  # FA4's forward in the query dtype
    handles_context = True  # keys context + new tokens (cu_seqlens_k), see run_prefills
    handles_paged = True  # run_paged: FA4's paged forward with the NVFP4 output stage (page_table, seqused_k)

    canary_generations = {f"{g.label} ({g.gpus})": forward.generation_head_dims(g.name)
                          for g in generations.GENERATIONS}
    """The ``(D, Dv)`` pairs whose canary ``fusion-pass selftest`` runs, per GPU generation (its plan)."""

    def available(self) -> tuple[bool, str]:
        return fa4_status()

    def refresh(self) -> None:
        """Forget the cached availability and device generations."""
        fa4_status.cache_clear()
        device_arch.cache_clear()

    def fast_on(self, device) -> tuple[bool, str]:
        arch = device_arch(torch.device(device).index) if torch.device(device).type == "cuda" else None
        generation = generations.for_arch(arch)
        if generation is not None and generation.run_on_hardware:
            return True, (f"the kernel built for {generation.label}, for the calls the measured policy fuses there "
                          f"(others fall back as slower_here: fusion_pass.runtime.policy)")
        if generation is not None:
            return True, ("FA4's own kernel for this GPU generation (self-checked before its first use), for the calls "
                          "the policy fuses there (not measured: fusion_pass.runtime.policy)")
        found = "no CUDA device" if arch is None else f"sm_{arch}"
        return False, f"no measurement or kernel of this project for {found}"

    @property
    def formats(self) -> dict:
        """NVFP4 by every launch; static FP8 and the FP8 group formats by the varlen launch where the current
        device's generation lists them (:data:`fusion_pass.kernels.fa4.generations.GENERATIONS`' ``formats``: SM90),
        as :data:`~fusion_pass.runtime.backends.base.FP8_WRITER` says."""
        generation = generations.for_arch(device_arch(None))
        if generation is None:
            return NVFP4_ONLY
        return {name: launches for name, launches in FP8_WRITER.items() if name in generation.formats}

    def supports(self, device, dtype, num_heads, qk_head_dim, v_head_dim, output_format=None) -> tuple[bool, str]:
        """FA4's head dims for every format it writes, and for the FP8 group formats ``v_head_dim % 128 == 0`` (a
        head's tile holds whole 128-column groups)."""
        ok, why = check_device_dtype(self.name, device, dtype, HALF_DTYPES)
        if not ok:
            return ok, why
        why = None if output_format is None else fp8_group_refusal(output_format, num_heads, v_head_dim)
        if why:
            return False, why
        return forward.fa4_usable(device, dtype, num_heads, qk_head_dim, v_head_dim)

    def run_varlen(self, q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, output_scale,
                   output_block_scale, *, cu_seqlens_k=None, max_seqlen_k=None) -> None:
        """:func:`fusion_pass.kernels.launchers.fa4_attention_nvfp4_varlen` (the kernel of the device's
        generation; it zeroes the scale buffer's padding itself)."""
        launchers.fa4_attention_nvfp4_varlen(
            q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, softmax_scale=softmax_scale, causal=True,
            output=output.view(torch.uint8), output_scale=output_scale, output_block_scale=output_block_scale,
            cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)

    def run_varlen_fp8_static(self, q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, scale, *,
                              cu_seqlens_k=None, max_seqlen_k=None, scale_is_inverse=False,
                              nan=fp8.NaNRule.POSITIVE_MAX) -> None:
        """FA4's SM90 forward with the static FP8 epilogue
        (:func:`fusion_pass.kernels.fa4.sm90_fp8.fa4_attention_fp8_static_varlen`) into rows ``[cu_seqlens[0],
        cu_seqlens[-1])`` of ``output`` (contiguous float8_e4m3fn, ``T * H*Dv`` elements): the bytes of
        ``fp8.quantize_static`` of FA4's own query-dtype output, ``1 / scale`` computed on the device (or
        ``scale`` itself with ``scale_is_inverse``); no other byte is touched."""
        from fusion_pass.kernels.fa4 import sm90_fp8

        rule = fp8.NaNRule(nan)
        if rule is fp8.NaNRule.NEGATIVE_MAX:
            raise ValueError(f"fa4 run_varlen_fp8_static: nan must be {fp8.NaNRule.POSITIVE_MAX.value!r} or "
                             f"{fp8.NaNRule.NAN.value!r} (the static epilogue's rules), got {rule.value!r}")
        inv = scale if scale_is_inverse else fp8.reciprocal(scale)
        sm90_fp8.fa4_attention_fp8_static_varlen(
            q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, softmax_scale=softmax_scale, causal=True,
            output=output.view(output.shape[0], -1), inv_scale=inv.reshape(1),
            nan_to_max=rule is fp8.NaNRule.POSITIVE_MAX, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_k=max_seqlen_k)

    def run_varlen_fp8_group(self, q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, scales, *,
                             cu_seqlens_k=None, max_seqlen_k=None, ue8m0=False, divide=False) -> None:
        """FA4's SM90 forward with the 128-column group FP8 epilogue
        (:func:`fusion_pass.kernels.fa4.sm90_fp8.fa4_attention_fp8_group_varlen`) into rows ``[cu_seqlens[0],
        cu_seqlens[-1])`` of ``output`` (contiguous float8_e4m3fn, ``T * H*Dv`` elements) and of ``scales`` (float32
        ``[T, H*Dv/128]``, any :class:`fusion_pass.fp8.ScaleLayout`): the bytes and scales of ``fp8.quantize_group``
        of FA4's own query-dtype output; no other byte or scale is touched, nor a TMA layout's padding."""
        from fusion_pass.kernels.fa4 import sm90_fp8

        sm90_fp8.fa4_attention_fp8_group_varlen(
            q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, softmax_scale=softmax_scale, causal=True,
            output=output.view(output.shape[0], -1), scales=scales, ue8m0=ue8m0, divide=divide,
            cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)

    def run_paged(self, q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k,
                  softmax_scale, output, output_scale, output_block_scale) -> None:
        """:func:`fusion_pass.kernels.fa4.forward.fa4_attention_nvfp4_paged` (the device's generation)."""
        forward.fa4_attention_nvfp4_paged(
            q, k_cache, v_cache, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, seqused_k=seqused_k,
            page_table=page_table, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=True,
            output=output.view(torch.uint8), output_scale=output_scale, output_block_scale=output_block_scale)

    def self_check_needed(self, device) -> tuple[bool, str]:
        """Whether the fused kernel must pass :meth:`canary` before it serves ``device`` by its own account: a
        kernel this project never ran on hardware (SM100/SM110) must, the SM90 kernel need not. The self-check mode
        (``off``, ``all``) applies on top (:func:`fusion_pass.runtime.self_check.required`)."""
        device = torch.device(device)
        generation = generations.for_arch(device_arch(device.index) if device.type == "cuda" else None)
        if generation is not None and not generation.run_on_hardware:
            return True, f"the {generation.label} kernel was compiled but never run on hardware by this project"
        label = generation.label if generation is not None else "SM90"
        return False, f"the {label} kernel is byte-checked on an H200 by this project's tests"

    def canary_head_dims(self, device) -> tuple[tuple[int, int], ...]:
        """The ``(D, Dv)`` pairs of the kernels for ``device``'s generation (their canaries)."""
        return tuple(forward.supported_head_dims(device))

    def canary(self, device, dtype, num_heads, qk_head_dim, v_head_dim, group: int = 1) -> tuple[bool, str]:
        """:func:`fusion_pass.runtime.backends.canary.run_canary` with the layer's dtype, head dims and query heads
        per KV head (``group``): the fused kernel against FA4's forward + ``nvfp4.quantize``, every byte."""
        return canary.run_canary(device, dtype, qk_head_dim, v_head_dim, group)
