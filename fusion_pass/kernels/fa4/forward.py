"""The FA4 entry points, for whichever GPU generation the tensors are on.

:func:`fa4_attention_varlen` (attention in the query dtype, optionally with its log-sum-exp) and
:func:`fa4_attention_nvfp4_varlen` (the fused NVFP4 forward) run :mod:`.sm90`'s kernels on Hopper and
:mod:`.sm100`'s on SM100/SM110 Blackwell, with one contract: for the same arguments,
``nvfp4.quantize(fa4_attention_varlen(...))`` and the fused call write the same bytes. :func:`fa4_usable`
says whether a layer of given dims runs here. The generation is the device's compute capability, or FA4's
``FLASH_ATTENTION_ARCH`` under ``FakeTensorMode`` (compile-only checks).

:func:`fa4_attention_paged` and :func:`fa4_attention_nvfp4_paged` are the same pair, with the same contract,
reading keys and values from a paged KV cache (``seqused_k``, ``page_table``; FA4's own paged forward).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusion_pass.kernels.fa4 import common, sm90, sm100
from fusion_pass.kernels.fa4.generations import GENERATIONS, for_arch

__all__ = ["fa4_attention_nvfp4_paged", "fa4_attention_nvfp4_varlen", "fa4_attention_paged", "fa4_attention_varlen",
           "fa4_generation", "fa4_usable", "generation_head_dims", "supported_head_dims"]

_MODULES = {"sm90": sm90, "sm100": sm100}  # the kernels of each generation of the table


def fa4_generation(device) -> str | None:
    """``"sm90"`` or ``"sm100"``: the kernels that run on ``device``; ``None`` where none does."""
    module = _module(device)
    return None if module is None else module.__name__.rsplit(".", 1)[1]


def _module(device):
    if torch.device(device).type != "cuda" and not common.is_fake_mode():
        return None
    arch = common.device_arch(device)
    generation = for_arch(arch)
    return None if generation is None else _MODULES[generation.name]


def generation_head_dims(name: str) -> tuple[tuple[int, int], ...]:
    """``(D, Dv)`` pairs of the kernels of generation ``name`` (:data:`.generations.GENERATIONS`)."""
    return _MODULES[name].SUPPORTED_HEAD_DIMS


def supported_head_dims(device) -> tuple[tuple[int, int], ...]:
    """``(D, Dv)`` pairs of the kernels for ``device`` (empty where none runs)."""
    module = _module(device)
    return () if module is None else module.SUPPORTED_HEAD_DIMS


def fa4_usable(device, dtype, num_heads: int, head_dim: int, head_dim_v: int) -> tuple[bool, str]:
    """Whether the fused FA4 kernel runs a layer of these dims on ``device``: ``(ok, why)``."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"fa4 runs on CUDA devices only, got {device}"
    arch = common.device_arch(device)
    if arch is None:
        return False, "fa4: no CUDA device"
    generation = for_arch(arch)
    if generation is None:
        known = " and ".join(f"{g.label} ({g.gpus})" for g in GENERATIONS)
        return False, (f"fa4 has kernels for {known}; {device} is sm_{arch}"
                       + (" (consumer Blackwell: no kernel of this project yet)" if arch // 10 == 12 else ""))
    return _MODULES[generation.name].usable(device, dtype, num_heads, head_dim, head_dim_v)


_by_device: dict[torch.device, object] = {}


def _for(fn: str, q: Tensor):
    if type(q) is Tensor:  # real tensors: the device's generation, looked up once
        module = _by_device.get(q.device)
        if module is not None:
            return module
    module = _module(q.device) if isinstance(q, Tensor) else None
    if module is not None and type(q) is Tensor and not common.is_fake_mode():
        _by_device[q.device] = module
    if module is None:
        where = q.device if isinstance(q, Tensor) else "no tensor"
        known = " or ".join(g.label for g in GENERATIONS)
        raise ValueError(f"{fn}: q must be a CUDA tensor on an {known} GPU, got {where}")
    return module


def fa4_attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, *, causal: bool,
                         softmax_scale: float, cu_seqlens_k: Tensor | None = None, max_seqlen_k: int | None = None,
                         return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """FA4's varlen forward in the query dtype ``[T, H, Dv]`` (and float32 ``lse [T, H]`` with ``return_lse``):
    the twin of the fused kernel, :func:`.sm90.fa4_attention_varlen` on Hopper, :func:`.sm100.fa4_attention_varlen`
    on Blackwell (their launchers, called directly)."""
    return _for("fa4_attention_varlen", q).TWIN(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, cu_seqlens_k,
                                                max_seqlen_k, return_lse)


def fa4_attention_nvfp4_varlen(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Tensor, max_seqlen: int,
                               softmax_scale: float, causal: bool, output: Tensor, output_scale: Tensor,
                               output_block_scale: Tensor, cu_seqlens_k: Tensor | None = None,
                               max_seqlen_k: int | None = None) -> None:
    """The fused NVFP4 forward into the caller's buffers: :func:`.sm90.fa4_attention_nvfp4_varlen` on Hopper,
    :func:`.sm100.fa4_attention_nvfp4_varlen` on Blackwell (same arguments, same bytes)."""
    _for("fa4_attention_nvfp4_varlen", q).FUSED(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, output,
                                                output_scale, output_block_scale, cu_seqlens_k, max_seqlen_k)


def fa4_attention_paged(q: Tensor, k_cache: Tensor, v_cache: Tensor, *, cu_seqlens: Tensor, max_seqlen: int,
                        seqused_k: Tensor, page_table: Tensor, max_seqlen_k: int, softmax_scale: float, causal: bool,
                        return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """FA4's paged forward in the query dtype ``[T, H, Dv]`` (and float32 ``lse [T, H]`` with ``return_lse``): the
    twin of :func:`fa4_attention_nvfp4_paged`, :func:`.sm90.fa4_attention_paged` on Hopper,
    :func:`.sm100.fa4_attention_paged` on Blackwell (arguments there)."""
    return _for("fa4_attention_paged", q).PAGED_TWIN(q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k,
                                                     page_table, max_seqlen_k, softmax_scale, causal, return_lse)


def fa4_attention_nvfp4_paged(q: Tensor, k_cache: Tensor, v_cache: Tensor, *, cu_seqlens: Tensor, max_seqlen: int,
                              seqused_k: Tensor, page_table: Tensor, max_seqlen_k: int, softmax_scale: float,
                              causal: bool, output: Tensor, output_scale: Tensor, output_block_scale: Tensor) -> None:
    """The fused NVFP4 forward on a paged KV cache into the caller's buffers: :func:`.sm90.fa4_attention_nvfp4_paged`
    on Hopper, :func:`.sm100.fa4_attention_nvfp4_paged` on Blackwell (same arguments, same bytes as
    ``nvfp4.quantize(fa4_attention_paged(...))``)."""
    _for("fa4_attention_nvfp4_paged", q).PAGED_FUSED(q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k,
                                                     page_table, max_seqlen_k, softmax_scale, causal, output,
                                                     output_scale, output_block_scale)
