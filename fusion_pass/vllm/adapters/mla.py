"""MLA layers (every vLLM MLA backend: FlashMLA, FlashInfer MLA, CUTLASS MLA, Triton MLA, CPU MLA, ...) in the
adapter's terms (:class:`fusion_pass.vllm.adapters.base.BackendAdapter`).

vLLM's MLA layer computes a call's decode rows and prefill rows apart itself: its builder orders the ``D`` decode
rows first, and ``MLAAttention.forward_impl`` runs the MQA (decode) part on rows ``[0, D)`` and the MHA (prefill)
part on the rest. So:

* rows: :func:`fusion_pass.vllm.adapters.host_rows.mla_rows` (``num_decode_tokens``, the prefills' host query
  lengths and context lengths);
* decode rows: vLLM's own ``forward_impl`` on rows ``[0, D)`` with the call's metadata. The statements of
  ``forward_impl`` that make it compute exactly those rows are recorded per release
  (:attr:`fusion_pass.vllm.releases.Release.mla_decode_split`) and checked against each release's wheel by the
  conformance suite; at run time the adapter checks that the layer's ``forward_impl`` *is* vLLM's (a model class
  that overrides it is refused: ``decode_tokens``). The op's extra arguments (0.34's ``mqa_q_prepared``, the
  decode query a model prepared itself) are cut to the decode rows and passed on;
* cached context: the paged latent cache ``[num_blocks, block_size, L + R]``, unquantized
  (:func:`latent_cache_refusal`), read through the prefills' block table by the fused rows.
"""

from __future__ import annotations

import functools

import torch

from fusion_pass.vllm import releases
from fusion_pass.vllm.adapters.host_rows import mla_rows

__all__ = ["MlaAdapter", "forward_impl_refusal", "is_mla", "latent_cache_refusal"]


def is_mla(layer) -> bool:
    """Whether ``layer`` is vLLM's ``MLAAttention`` (or reads like it: ``kv_b_proj`` and ``qk_nope_head_dim``)."""
    return hasattr(layer, "kv_b_proj") and hasattr(layer, "qk_nope_head_dim")


@functools.lru_cache(maxsize=None)
def forward_impl_refusal(forward_impl) -> str | None:
    """Why ``forward_impl`` (a layer class's ``forward_impl``) cannot be trusted to compute a call's decode rows
    alone, or None: it must be the installed, supported release's own ``MLAAttention.forward_impl``."""
    where = getattr(forward_impl, "__qualname__", repr(forward_impl))
    release = releases.current()
    if release is None:
        return f"{where}: {releases.refusal() or 'no supported vLLM'}"
    try:
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    except ImportError as exc:
        return f"vLLM's MLAAttention cannot be imported ({exc}) to check {where}"
    if forward_impl is not MLAAttention.forward_impl:
        return (f"{where} is not vLLM {release.line}.x's MLAAttention.forward_impl, so it may not split decode and "
                f"prefill rows as the fused path relies on (the split is checked per release: "
                f"fusion_pass.vllm.releases)")
    return None


def latent_cache_refusal(layer, kv_cache) -> str | None:
    """Why ``kv_cache`` is not an unquantized MLA latent cache ``[num_blocks, block_size, L + R]``, or None."""
    width = layer.kv_lora_rank + layer.qk_rope_head_dim
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 3 or kv_cache.shape[-1] != width:
        shape = list(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else type(kv_cache).__name__
        return f"KV cache {shape} is not the MLA latent cache [num_blocks, block_size, {width}]"
    if kv_cache.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"KV cache dtype {kv_cache.dtype} (the fused path reads unquantized latents)"
    return None


class MlaAdapter:
    """Every vLLM MLA backend (module docstring)."""

    NAME = "MLA"
    BUILDER = None  # MLA metadata holds its host values itself
    SPLITS_MIXED = True

    @staticmethod
    def rows(md, dcp_world_size: int):
        return mla_rows(md, dcp_world_size)

    @staticmethod
    def decode_refusal(layer, md) -> str | None:
        return forward_impl_refusal(type(layer).forward_impl)

    @staticmethod
    def context_refusal(layer, kv_cache) -> str | None:
        return latent_cache_refusal(layer, kv_cache)

    @staticmethod
    def run_decode(layer, md, rows, inputs, kv_cache, out) -> str:
        """vLLM's ``forward_impl`` on rows ``[0, D)`` into ``out [D, H * Dv]``. ``inputs``: ``(q, kv_c_normed, k_pe,
        extra)`` with ``extra`` the op's keyword arguments for ``forward_impl`` beyond the defaults (0.34's
        ``mqa_q_prepared``), cut to the decode rows here."""
        decode = out.shape[0]
        q, kv_c_normed, k_pe, extra = inputs
        kwargs = {name: value[:decode] for name, value in extra.items() if value is not None}
        layer.forward_impl(q[:decode], kv_c_normed[:decode], k_pe[:decode], kv_cache, md, output=out, **kwargs)
        return "forward_impl"
