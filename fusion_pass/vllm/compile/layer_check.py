"""Compile time: which calls vLLM's own attention + NVFP4 quant fusion rewrote the pass leaves as they are.

vLLM's ``fuse_attn_quant`` (``AttnQuantFusionPass`` / ``MLAAttnQuantFusionPass``, CUDA builds) gives a layer's
attention op the quant's buffers, so that the attention implementation writes NVFP4 itself (FlashInfer's trtllm-gen
kernel for standard attention on SM100 with a quantized KV cache) or quantizes its own output (MLA). The pass
retargets such a call to its fused op only where the fused call can run for the layer: for a layer the run-time
guard always refuses, the retargeted call would take the exact fallback (vLLM's attention into a temporary, then a
separate quant) on every call, slower than what vLLM's fusion left. :func:`leave_quantized` says which, from the
layer as vLLM built it (vLLM's static forward context: the layer objects by name, set before any graph is
compiled), read with the run-time guard's own checks (:class:`fusion_pass.vllm.adapters.layer.LayerInfo`):

* ``quantized_kv_cache``: the layer's KV cache is quantized (``kv_cache_dtype`` fp8 and the like; the fused
  kernels read unquantized keys and values): the case vLLM's standard-attention fusion is registered for;
* ``layer_not_supported``: anything else the fused kernels do not compute (sliding window, ALiBi, soft-cap, sparse
  MLA, ...);
* ``no_decode_adapter:<BACKEND>``: a standard layer on a vLLM attention backend without an adapter (TRITON_ATTN,
  FLEX_ATTENTION, ...), whose calls with prefill rows all fall back.

A call whose layer cannot be found is retargeted, and the run-time guard decides as for any other.
"""

from __future__ import annotations

from fusion_pass.vllm.adapters.layer import LayerInfo, quantized_kv_cache

__all__ = ["compile_time_layer", "describe", "leave_quantized", "why_left"]


def compile_time_layer(layer_name):
    """vLLM's layer named ``layer_name`` while a graph is compiled (the current vLLM config's static forward
    context, else the forward context's layers), or None."""
    if not isinstance(layer_name, str):
        return None
    try:
        from vllm.config import get_current_vllm_config_or_none
        from vllm.forward_context import get_forward_context, is_forward_context_available
    except ImportError:
        return None
    config = get_current_vllm_config_or_none()
    layers = getattr(getattr(config, "compilation_config", None), "static_forward_context", None) or {}
    if layer_name not in layers and is_forward_context_available():
        layers = get_forward_context().no_compile_layers or {}
    return layers.get(layer_name)


def why_left(layer) -> tuple[str, str] | None:
    """``(reason, detail)`` when the fused call cannot run for ``layer`` (module docstring), else None."""
    if quantized_kv_cache(getattr(layer, "kv_cache_dtype", "auto")):
        return "quantized_kv_cache", f"KV cache dtype {layer.kv_cache_dtype!r}"
    info = LayerInfo(layer)
    if info.unsupported:
        return "layer_not_supported", info.unsupported
    if not info.mla and info.adapter is None:
        return f"no_decode_adapter:{info.backend}", f"vLLM attention backend {info.backend} has no adapter"
    return None


def describe(layer_name) -> str:
    """What the check read of ``layer_name``'s layer, for the log line of a retargeted call."""
    layer = compile_time_layer(layer_name)
    if layer is None:
        return "layer not found while compiling: the run-time guard decides"
    info = LayerInfo(layer)
    kind = "MLA" if info.mla else f"vLLM attention backend {info.backend}"
    return f"KV cache dtype {getattr(layer, 'kv_cache_dtype', 'auto')!r}, {kind}: the fused call can run"


def leave_quantized(layer_name) -> str | None:
    """The reason to leave the already quantized attention call of ``layer_name`` as vLLM's fusion wrote it, or
    None to retarget it (:class:`fusion_pass.FusionPass`'s ``leave_quantized``)."""
    layer = compile_time_layer(layer_name)
    left = why_left(layer) if layer is not None else None
    return left[0] if left else None
