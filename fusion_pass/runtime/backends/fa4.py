"""The ``fa4`` backend: FlashAttention-4 with this project's NVFP4 output stage.

On SM90 (H100, H200) FA4's SM90 kernel with an NVFP4 epilogue, run and byte-checked on an H200; on SM100/SM110
(B200, GB200) FA4's SM100 kernel quantizing in its correction warps' registers, compiled in the CPU suite but
never run by this project (no Blackwell GPU is lent to it), so the run time self-checks it before its first
use (:meth:`FA4Backend.self_check_needed`, :meth:`FA4Backend.canary`, :mod:`fusion_pass.runtime.self_check`).
Both through :mod:`fusion_pass.kernels.fa4.forward` (``docs/fa4.md``, ``docs/blackwell.md``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from fusion_pass import nvfp4
from fusion_pass.kernels import launchers, reference
from fusion_pass.kernels.fa4 import common as fa4_common
from fusion_pass.kernels.fa4 import forward
from fusion_pass.runtime import settings
from fusion_pass.runtime.backends.base import HALF_DTYPES, KernelBackend, check_device_dtype

__all__ = ["CANARY_REFERENCE_TOLERANCE", "FA4Backend", "canary_batches", "fa4_status"]


@functools.lru_cache(maxsize=None)
def device_arch(index: int | None) -> int | None:
    """``major * 10 + minor`` of CUDA device ``index`` (the current one for ``None``); ``None`` without CUDA."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor


@functools.lru_cache(maxsize=None)
def fa4_status() -> tuple[bool, str]:
    """Whether FA4 and the subclass for this machine's GPU generation import: ``(ok, description or why)``."""
    arch = device_arch(None)
    module = "sm100_kernel" if arch is not None and arch // 10 in (10, 11) else "sm90_kernel"
    ok, why = fa4_common.fa4_import_status(module)
    if not ok:
        return False, why
    if arch is None:
        return False, "no CUDA device"
    generation = {9: "SM90", 10: "SM100", 11: "SM100"}.get(arch // 10)
    if generation is None:
        return False, f"no kernel of this project for sm_{arch} (FA4 NVFP4 kernels: SM90, SM100/SM110; {why})"
    return True, f"FA4 {generation} forward with the fusion_pass NVFP4 output stage on sm_{arch} ({why})"


def canary_batches() -> list[dict[str, Any]]:
    """The self-check's fixed batches: query lengths, cached context and a value scale per sequence. The first
    fits one 128-row tile per sequence (FA4's ``q_stage=1`` configuration on SM100), its 37-token sequence has
    values scaled by 1e-4 (block scales in the e4m3 subnormal range); the second has a sequence of two tiles
    and a prefix-cache hit read through ``cu_seqlens_k`` (``q_stage=2``, bottom-right causal). The global scale
    saturates the block scale of blocks above 0.5 (codes saturate at 6 too)."""
    return [{"query_lens": [1, 37, 128], "context_lens": [0, 0, 0], "value_scales": [1.0, 1e-4, 1.0]},
            {"query_lens": [200, 9], "context_lens": [0, 75], "value_scales": [1.0, 1.0]}]


CANARY_REFERENCE_TOLERANCE = 1e-2
"""Largest relative Frobenius distance between the twin's output and float32 attention that the canary accepts
(the twin rounds to bf16/fp16: about 2^-9 relative; the bound only catches a broken main loop, which the byte
comparison of fused vs twin cannot see because both share it)."""


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

    def canary(self, device, dtype, num_heads, qk_head_dim, v_head_dim) -> tuple[bool, str]:
        """Run :func:`canary_batches` through the fused kernel and through FA4's forward in ``dtype`` +
        ``nvfp4.quantize`` (the same FA4 main loop: :func:`fusion_pass.kernels.fa4.forward.fa4_attention_varlen`)
        with the layer's dtype and head dims, 3 query heads on 1 KV head (heads past the first, and GQA; the
        output stage does not depend on the head count), and compare every byte of the codes and of the
        swizzled scales, padding included. The twin itself must also be within
        :data:`CANARY_REFERENCE_TOLERANCE` of float32 attention (:func:`fusion_pass.kernels.reference.varlen_attention`).
        ``(True, summary)`` or ``(False, where the first difference is)``."""
        device = torch.device(device)
        generator = torch.Generator(device=device).manual_seed(20261201)
        heads, kv_heads = 3, 1
        gs = torch.tensor([448.0 * 6.0 / 0.5], dtype=torch.float32, device=device)
        for batch in canary_batches():
            lens, ctx = batch["query_lens"], batch["context_lens"]
            t, tk = sum(lens), sum(lens) + sum(ctx)
            q = torch.randn(t, heads, qk_head_dim, generator=generator, device=device).to(dtype)
            k = torch.randn(tk, kv_heads, qk_head_dim, generator=generator, device=device).to(dtype)
            v = torch.randn(tk, kv_heads, v_head_dim, generator=generator, device=device)
            starts_k = [0] + list(_cumsum([a + b for a, b in zip(lens, ctx)]))
            for i, value_scale in enumerate(batch["value_scales"]):
                v[starts_k[i]:starts_k[i + 1]] *= value_scale
            v = v.to(dtype)
            cu = torch.tensor([0] + list(_cumsum(lens)), dtype=torch.int32, device=device)
            cu_k = torch.tensor([0] + list(_cumsum([a + b for a, b in zip(lens, ctx)])), dtype=torch.int32,
                                device=device)
            args = dict(cu_seqlens=cu, max_seqlen=max(lens), softmax_scale=qk_head_dim ** -0.5, causal=True,
                        cu_seqlens_k=cu_k, max_seqlen_k=max(a + b for a, b in zip(lens, ctx)))
            width = heads * v_head_dim
            rows, cols = nvfp4.scale_shape(t, width)
            packed = torch.full((t, width // 2), 0xAB, dtype=torch.uint8, device=device)
            scales = torch.full((rows * cols,), 0xCD, dtype=torch.uint8, device=device)
            launchers.fa4_attention_nvfp4_varlen(q, k, v, output=packed, output_scale=gs, output_block_scale=scales,
                                                 **args)
            twin = launchers.fa4_attention_varlen(q, k, v, args["cu_seqlens"], args["max_seqlen"], causal=True,
                                                  softmax_scale=args["softmax_scale"], cu_seqlens_k=cu_k,
                                                  max_seqlen_k=args["max_seqlen_k"])
            want_packed, want_scales = nvfp4.quantize(twin.reshape(t, width), gs)
            exact, _ = reference.varlen_attention(q, k, v, cu, True, args["softmax_scale"], cu_k)
            distance = float((twin.float() - exact).norm() / exact.norm().clamp_min(1e-30))
            if not distance <= CANARY_REFERENCE_TOLERANCE:
                return False, (f"FA4's forward is {distance:.3g} (relative Frobenius) from float32 attention, above "
                               f"{CANARY_REFERENCE_TOLERANCE} (query lengths {lens}, context {ctx})")
            got = (packed, scales.view(rows, cols))
            for name, a, b in (("codes", got[0], want_packed), ("scales", got[1], want_scales.view(torch.uint8))):
                diff = (a != b).nonzero()
                if len(diff):
                    row, col = diff[0].tolist()
                    return False, (f"{name} differ at {len(diff)} byte(s), first at row {row}, byte {col} "
                                   f"(query lengths {lens}, context {ctx}; fused {int(a[row, col]):#04x}, "
                                   f"FA4 + quantize {int(b[row, col]):#04x})")
        return True, (f"canary bytes equal ({len(canary_batches())} batches, {heads} heads / {kv_heads} KV heads, "
                      f"head dims ({qk_head_dim}, {v_head_dim}), {str(dtype).replace('torch.', '')})")


def _cumsum(values):
    total = 0
    for value in values:
        total += value
        yield total
