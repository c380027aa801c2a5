"""What the guard and the compile-time layer check read of a vLLM attention layer, once per layer: MLA or standard,
its head dims, what it computes beyond plain causal attention (sliding window, ALiBi, soft-cap, sinks, a quantized KV
cache, sparse MLA, ...), and its backend adapter. Compile time (:mod:`fusion_pass.vllm.compile.layer_check`) and
run time (:mod:`fusion_pass.vllm.runtime.guard`) read a layer through this one module, so they cannot disagree.
"""

from __future__ import annotations

import weakref

import torch

from fusion_pass.runtime.guard import LayerShape
from fusion_pass.vllm import releases
from fusion_pass.vllm.adapters import registry
from fusion_pass.vllm.adapters.mla import is_mla

__all__ = ["LayerInfo", "dims", "is_mla", "layer_info", "quantized_kv_cache", "unsupported_reason"]


def dims(layer) -> tuple[int, int, int]:
    """(query heads of this rank, q/k head dim, v head dim)."""
    if is_mla(layer):
        return layer.num_heads, layer.qk_nope_head_dim + layer.qk_rope_head_dim, layer.v_head_dim
    return layer.num_heads, layer.head_size, layer.head_size


def quantized_kv_cache(kv_dtype) -> bool:
    """Whether vLLM stores this layer's KV cache quantized (FP8 and the like): vLLM's own
    ``is_quantized_kv_cache`` (from the module the installed release holds it in: :mod:`fusion_pass.vllm.releases`);
    ``"auto"`` and explicit half/float dtypes are not."""
    if kv_dtype in (None, "auto"):
        return False
    if releases.current() is None:  # no supported vLLM here (tests of the op without vLLM): by name
        return str(kv_dtype) not in ("bfloat16", "float16", "half", "float", "float32")
    return bool(releases.resolve("is_quantized_kv_cache")(kv_dtype))


def unsupported_reason(layer) -> str | None:
    """What the layer computes that the fused kernels (plain causal softmax attention) do not, or None."""
    impl = getattr(layer, "impl", None)
    kv_dtype = getattr(layer, "kv_cache_dtype", "auto")
    if quantized_kv_cache(kv_dtype):
        return f"KV cache dtype {kv_dtype!r} (the fused kernels read unquantized keys and values)"
    window = getattr(impl, "sliding_window", None)
    if window in (None, -1, (-1, -1)):
        window = getattr(layer, "sliding_window", None)
    if window not in (None, -1, (-1, -1)):
        return f"sliding window {window}"
    if is_mla(layer):
        if getattr(impl, "is_sparse", False):
            return "sparse MLA"
        if getattr(layer, "hisparse_cache", None) is not None:
            return "HiSparse KV cache"
        if getattr(layer, "use_pcp", False):
            return "prefill context parallelism"
        weight = getattr(layer.kv_b_proj, "weight", None)
        if getattr(layer, "is_amx_bmm_enabled", False) or (isinstance(weight, torch.Tensor) and weight.numel() == 0):
            # vLLM's AMX MLA backend (x86 CPUs with AMX) packs W_UK / W_UV for its own kernels and releases
            # kv_b_proj's weight (MLAAttention.process_weights_after_loading): the fused path expands keys and
            # values through kv_b_proj
            return "kv_b_proj's weight released by vLLM's MLA backend (AMX MLA)"
        return None
    attn_type = str(getattr(layer, "attn_type", "decoder"))
    if "decoder" not in attn_type.lower():
        return f"attention type {attn_type} (the fused kernels are causal decoder attention)"
    if getattr(layer, "kv_sharing_target_layer_name", None):
        return "KV sharing with another layer"
    for name in ("alibi_slopes", "sinks"):
        if getattr(impl, name, None) is not None:
            return name.replace("_", " ")
    if getattr(impl, "logits_soft_cap", None):
        return f"logit soft-cap {impl.logits_soft_cap}"
    return None


class LayerInfo:
    """What the guard reads of a layer once: MLA or not, its head dims, what it computes beyond plain causal
    attention (``unsupported``, prefixed with its name), its backend's name and adapter
    (:class:`fusion_pass.vllm.adapters.base.BackendAdapter`; ``"MLA"`` for every MLA layer, None where no adapter
    exists)."""

    __slots__ = ("mla", "dims", "kv_heads", "unsupported", "adapter", "backend", "shapes", "key", "_cache", "_call_key")

    def __init__(self, layer):
        self.mla = is_mla(layer)
        self.dims = dims(layer)
        self.kv_heads = None if self.mla else getattr(layer, "num_kv_heads", None)
        why = unsupported_reason(layer)
        self.unsupported = f"{getattr(layer, 'layer_name', type(layer).__name__)}: {why}" if why else None
        self.adapter, self.backend = registry.adapter_for(layer)
        self.shapes: dict = {}
        # layers with equal keys (and the same metadata, device, dtype, cache shape) get equal decisions;
        # an MLA layer's decode rows also depend on its class's forward_impl
        self.key = (self.mla, self.dims, self.kv_heads, self.unsupported, self.backend,
                    getattr(type(layer), "forward_impl", None) if self.mla else None)
        self._cache = None  # (weak reference to the KV cache, query dtype) of _call_key
        self._call_key = None

    def call_key(self, q, kv_cache) -> int:
        """A number equal for the calls that decide alike: of layers with equal :attr:`key`, queries of one device
        and dtype, caches of one dtype, shape and strides. Kept while the layer's cache object and the query
        dtype stay the same (vLLM binds a layer's cache once)."""
        cache = self._cache
        if cache is not None and cache[0]() is kv_cache and cache[1] is q.dtype:
            return self._call_key
        if isinstance(kv_cache, torch.Tensor):
            described = (kv_cache.dtype, tuple(kv_cache.shape), kv_cache.stride())
            self._cache = (weakref.ref(kv_cache), q.dtype)
        else:
            described = type(kv_cache)
            self._cache = None
        self._call_key = _CALL_KEYS.setdefault((self.key, q.device, q.dtype, described), len(_CALL_KEYS))
        return self._call_key

    def shape(self, q) -> LayerShape:
        key = (q.device, q.dtype)
        shape = self.shapes.get(key)
        if shape is None:
            shape = self.shapes[key] = LayerShape(q.device, q.dtype, *self.dims, num_kv_heads=self.kv_heads)
        return shape


_infos: dict = {}
_CALL_KEYS: dict = {}  # what LayerInfo.call_key distinguishes -> its number


def layer_info(layer) -> LayerInfo:
    """The layer's :class:`LayerInfo`, read on its first call with metadata (after vLLM loaded its weights)."""
    entry = _infos.get(id(layer))
    if entry is None or entry[0] is not layer:
        entry = _infos[id(layer)] = (layer, LayerInfo(layer))
    return entry[1]
