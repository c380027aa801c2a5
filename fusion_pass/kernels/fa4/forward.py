"""The FA4 entry points, for whichever GPU generation the tensors are on.

:func:`fa4_attention_varlen` (attention in the query dtype, optionally with its log-sum-exp) and
:func:`fa4_attention_nvfp4_varlen` (the fused NVFP4 forward) run :mod:`.sm90`'s kernels on Hopper and
:mod:`.sm100`'s on SM100/SM110 Blackwell, with one contract: for the same arguments,
``nvfp4.quantize(fa4_attention_varlen(...))`` and the fused call write the same bytes. :func:`fa4_usable`
says whether a layer of given dims runs here. The generation is the device's compute capability, or FA4's
``FLASH_ATTENTION_ARCH`` under ``FakeTensorMode`` (compile-only checks).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusion_pass.kernels.fa4 import common, sm90, sm100

__all__ = ["fa4_attention_nvfp4_varlen", "fa4_attention_varlen", "fa4_generation", "fa4_usable",
           "supported_head_dims"]

_GENERATIONS = {9: sm90, 10: sm100, 11: sm100}


def fa4_generation(device) -> str | None:
    """``"sm90"`` or ``"sm100"``: the kernels that run on ``device``; ``None`` where none does."""
    module = _module(device)
    return None if module is None else module.__name__.rsplit(".", 1)[1]


def _module(device):
    if torch.device(device).type != "cuda" and not common.is_fake_mode():
        return None
    arch = common.device_arch(device)
    return None if arch is None else _GENERATIONS.get(arch // 10)


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
    module = _GENERATIONS.get(arch // 10)
    if module is None:
        return False, (f"fa4 has kernels for SM90 (H100/H200) and SM100/SM110 (B200, GB200); {device} is sm_{arch}"
                       + (" (consumer Blackwell: no kernel of this project yet)" if arch // 10 == 12 else ""))
    usable = sm90.fa4_sm90_usable if module is sm90 else sm100.fa4_sm100_usable
    return usable(device, dtype, num_heads, head_dim, head_dim_v)


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
        raise ValueError(f"{fn}: q must be a CUDA tensor on an SM90 or SM100/SM110 GPU, got {where}")
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
