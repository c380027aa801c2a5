"""The run-time guard of the vLLM ops: vLLM's attention metadata and layer read into the shared guard core
(:func:`fusion_pass.runtime.guard.decide`), so a vLLM call and a call of the project's own runtime are decided
by the same rules with the same reasons. A standard layer and an MLA layer differ in how their rows are read
and computed (:mod:`fusion_pass.vllm.host_rows`, :mod:`fusion_pass.vllm.adapters`), not in how they are decided.

Capture-safe and cheap: the decision reads host-side values only (vLLM's host copies of the batch, the ints the
metadata holds; :mod:`fusion_pass.vllm.host_rows`), never a device tensor: no synchronization, nothing a CUDA
graph capture refuses. What does not change between calls is read once: per layer (:func:`layer_info`: MLA or
not, dims, what the layer computes beyond causal attention, its backend adapter), per step (the rows, kept on
vLLM's metadata object), per process (the DCP world size). A call being captured into a CUDA graph takes the
exact fallback, which needs no decision: a graph replays for batches the capture never saw
(``cuda_graph_capture``; a decode-only batch keeps ``decode_tokens``).

What vLLM adds to the core's checks: no metadata (vLLM's profile and dummy runs, ``no_attention_metadata``), no
host copy of the batch (``no_host_metadata``), capture (``cuda_graph_capture``), what the layer computes beyond
plain causal attention (``layer_not_supported``), a standard layer's backend without an adapter
(``no_decode_adapter:<BACKEND>``), a standard layer's call with decode and prefill rows while splitting is off
(``mixed_not_split``, the default: :data:`fusion_pass.runtime.settings.SPLIT_MIXED_MODES`), and what an adapter
cannot compute apart: decode rows (``decode_tokens``: an MLA ``forward_impl`` without the decode/prefill split, a
standard backend's metadata the adapter cannot cut to its decode requests) and cached context
(``chunked_prefill``: a cache the adapter cannot read).
"""

import functools
import inspect
import weakref

import torch

from fusion_pass.runtime import guard, settings
from fusion_pass.vllm import adapters
from fusion_pass.vllm.host_rows import decode_only_tokens, mla_rows, standard_rows

__all__ = ["FORWARD_IMPL_STRUCTURE", "NO_METADATA", "decide", "decide_rows", "decode_only_decision", "dims", "is_mla",
           "layer_info", "layer_name_of", "step_rows"]

NO_METADATA = "no_attention_metadata"

FORWARD_IMPL_STRUCTURE = (
    "q = q[:num_actual_toks, ...]",
    "num_mqa_tokens = attn_metadata.num_decode_tokens",
    "num_mha_tokens = q.size(0) - num_mqa_tokens",
    "if num_mha_tokens > 0:",
    "mqa_q = q[:num_mqa_tokens]",
    "mqa_output_slice = output[:num_mqa_tokens]",
)
"""Statements of vLLM's ``MLAAttention.forward_impl`` (``vllm/model_executor/layers/attention/mla_attention.py``,
whitespace-normalised) that make ``forward_impl(q[:D], kv_c_normed[:D], k_pe[:D], kv_cache, metadata,
output=[D, H*Dv])`` compute exactly the decode rows of the whole call: the inputs are cut to
``num_actual_tokens`` rows (``D`` stay ``D``), the MQA (decode) part takes the first ``num_decode_tokens``
rows, the MHA (prefill) part the rest of ``q``, which is empty."""


def layer_name_of(layer_name):
    return getattr(layer_name, "value", layer_name)


_dcp = None


def dcp_world_size() -> int:
    """vLLM's decode-context-parallel world size, read once per process (vLLM initialises its groups before any
    forward with metadata; a process without them, e.g. a test, has no DCP: 1)."""
    global _dcp
    if _dcp is None:
        try:
            from vllm.distributed.parallel_state import get_dcp_group

            _dcp = get_dcp_group().world_size
        except Exception:  # not initialised: a single process without DCP
            _dcp = 1
    return _dcp


def is_mla(layer) -> bool:
    return hasattr(layer, "kv_b_proj") and hasattr(layer, "qk_nope_head_dim")


def dims(layer) -> tuple[int, int, int]:
    """(query heads of this rank, q/k head dim, v head dim)."""
    if is_mla(layer):
        return layer.num_heads, layer.qk_nope_head_dim + layer.qk_rope_head_dim, layer.v_head_dim
    return layer.num_heads, layer.head_size, layer.head_size


def quantized_kv_cache(kv_dtype) -> bool:
    """Whether vLLM stores this layer's KV cache quantized (FP8 and the like): vLLM's own
    ``is_quantized_kv_cache``; ``"auto"`` and explicit half/float dtypes are not."""
    if kv_dtype in (None, "auto"):
        return False
    try:
        from vllm.utils.torch_utils import is_quantized_kv_cache
    except ImportError:
        return str(kv_dtype) not in ("bfloat16", "float16", "half", "float", "float32")
    return bool(is_quantized_kv_cache(kv_dtype))


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


@functools.lru_cache(maxsize=None)
def forward_impl_mismatch(forward_impl) -> str | None:
    """Why ``forward_impl`` (vLLM's ``MLAAttention.forward_impl``) cannot compute the decode rows alone
    (a statement of :data:`FORWARD_IMPL_STRUCTURE` missing from its source), or None."""
    where = getattr(forward_impl, "__qualname__", repr(forward_impl))
    try:
        source = " ".join(inspect.getsource(forward_impl).split())
    except (OSError, TypeError) as exc:
        return f"cannot read the source of vLLM's {where} to check its decode/prefill split ({exc})"
    missing = [s for s in FORWARD_IMPL_STRUCTURE if s not in source]
    if missing:
        return (f"the installed vLLM's {where} does not split decode and prefill rows as the fused path "
                f"relies on (missing: {'; '.join(missing)})")
    return None


def latent_cache_unreadable(layer, kv_cache) -> str | None:
    """Why ``kv_cache`` is not an unquantized MLA latent cache ``[num_blocks, block_size, L + R]``, or None."""
    width = layer.kv_lora_rank + layer.qk_rope_head_dim
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 3 or kv_cache.shape[-1] != width:
        shape = list(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else type(kv_cache).__name__
        return f"KV cache {shape} is not the MLA latent cache [num_blocks, block_size, {width}]"
    if kv_cache.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"KV cache dtype {kv_cache.dtype} (the fused path reads unquantized latents)"
    return None


class LayerInfo:
    """What the guard reads of a layer once: MLA or not, its head dims, what it computes beyond plain causal
    attention (``unsupported``, prefixed with its name), and for a standard layer its backend and adapter."""

    __slots__ = ("mla", "dims", "kv_heads", "unsupported", "adapter", "backend", "shapes", "key", "_cache", "_call_key")

    def __init__(self, layer):
        self.mla = is_mla(layer)
        self.dims = dims(layer)
        self.kv_heads = None if self.mla else getattr(layer, "num_kv_heads", None)
        why = unsupported_reason(layer)
        self.unsupported = f"{getattr(layer, 'layer_name', type(layer).__name__)}: {why}" if why else None
        self.adapter, self.backend = (None, None) if self.mla else adapters.adapter_for(layer)
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

    def shape(self, q) -> guard.LayerShape:
        key = (q.device, q.dtype)
        shape = self.shapes.get(key)
        if shape is None:
            shape = self.shapes[key] = guard.LayerShape(q.device, q.dtype, *self.dims, num_kv_heads=self.kv_heads)
        return shape


_infos: dict = {}
_CALL_KEYS: dict = {}  # what LayerInfo.call_key distinguishes -> its number


def layer_info(layer) -> LayerInfo:
    """The layer's :class:`LayerInfo`, read on its first call with metadata (after vLLM loaded its weights)."""
    entry = _infos.get(id(layer))
    if entry is None or entry[0] is not layer:
        entry = _infos[id(layer)] = (layer, LayerInfo(layer))
    return entry[1]


def step_rows(md, layer):
    """The call's rows (:class:`fusion_pass.vllm.host_rows.StepRows`), host-side only; None without host copies."""
    dcp = _dcp if _dcp is not None else dcp_world_size()
    return mla_rows(md, dcp) if layer_info(layer).mla else standard_rows(md, dcp)


@functools.lru_cache(maxsize=4096)
def _decode_only(tokens: int) -> guard.Decision:
    return guard.Decision.fallback("decode_tokens", f"{tokens} decode token(s), no prefill", 0, tokens)


_DECISIONS = "decisions"  # the StepRows.memo entry: {LayerInfo.call_key: the step's decision}

_NO_METADATA = guard.Decision.fallback(NO_METADATA, "no attention metadata (vLLM profile/dummy run)")


def _without_host_rows(info: LayerInfo, md, dcp: int) -> guard.Decision:
    """The metadata holds no host copy of the batch: decode-only batches are known from its ints, any other
    call falls back."""
    n = int(getattr(md, "num_actual_tokens", 0))
    if dcp != 1:
        return guard.Decision.fallback("dcp_world_size>1", f"dcp_world_size={dcp}", 0, n)
    decode_only = (not getattr(md, "num_prefills", 0) or getattr(md, "prefill", None) is None) if info.mla \
        else getattr(md, "max_query_len", 2) <= 1
    if decode_only:
        return _decode_only(n)
    return guard.Decision.fallback("no_host_metadata", "the attention metadata holds no host copy of the batch's "
                                   "query and sequence lengths (the fused path never reads device metadata)", 0, n)


def decode_only_decision(md) -> guard.Decision | None:
    """The decision of every call of a decode-only step, from the metadata's host ints alone (no layer needed:
    :func:`fusion_pass.vllm.host_rows.decode_only_tokens`), or None when the step may have prefill rows (or runs
    with DCP: decided per call)."""
    if (_dcp if _dcp is not None else dcp_world_size()) != 1:
        return None
    tokens = decode_only_tokens(md)
    return None if tokens is None else _decode_only(tokens)


def decide(layer_name, q, md, layer, kv_cache=None) -> guard.Decision:
    """The guard for one vLLM call, from the layer, its metadata and KV cache (module docstring).

    Per token, as the runtime's: ``prefill_tokens`` and ``fused_tokens`` of the call's rows, ``post_quantized``
    ``{reason: rows}`` for the rest. No metadata (a profile or dummy run) counts no tokens. A call with prefill
    rows is decided once per step for layers that read alike (:meth:`LayerInfo.call_key`), with the backend choice
    (:func:`fusion_pass.runtime.settings.configured_backend`) and the split mode
    (:func:`fusion_pass.runtime.settings.split_mixed`) of that first call: the decision is kept with the step's
    rows.
    """
    if md is None:
        return _NO_METADATA
    decision = decode_only_decision(md)  # the call of most steps, decided from the metadata's ints
    return decision if decision is not None else decide_rows(layer_name, q, md, layer, kv_cache)


def decide_rows(layer_name, q, md, layer, kv_cache=None) -> guard.Decision:
    """:func:`decide` for a call whose step is not decode-only (:func:`decode_only_decision` gave None for its
    metadata): from the step's rows."""
    dcp = _dcp if _dcp is not None else dcp_world_size()
    info = layer_info(layer)
    rows = mla_rows(md, dcp) if info.mla else standard_rows(md, dcp)
    if rows is None:
        return _without_host_rows(info, md, dcp)
    if not rows.prefill_tokens and dcp == 1:
        return _decode_only(rows.num_tokens)
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return guard.Decision.fallback("cuda_graph_capture", "the call is being captured into a CUDA graph, which "
                                       "replays for batches the capture did not see: the exact fallback",
                                       rows.prefill_tokens, rows.num_tokens)
    decisions = rows.memo.get(_DECISIONS)
    if decisions is None:
        decisions = rows.memo[_DECISIONS] = {}
    key = info.call_key(q, kv_cache)
    decision = decisions.get(key)
    if decision is None:
        decision = decisions[key] = _decide(layer_name, q, md, layer, kv_cache, info, rows.rows)
    return decision


def _decide(layer_name, q, md, layer, kv_cache, info: LayerInfo, batch: guard.BatchRows) -> guard.Decision:
    """:func:`decide` for a call with prefill rows (or DCP), not captured."""
    prefill, tokens = batch.prefill_tokens, batch.num_tokens
    if batch.dcp_world_size != 1:
        return guard.decide(batch, info.shape(q))
    unsupported = info.unsupported
    if unsupported is None and not info.mla and getattr(md, "causal", True) is False:
        unsupported = "non-causal attention metadata (the fused kernels are causal decoder attention)"
    if unsupported:
        return guard.decide(batch, info.shape(q), unsupported=unsupported)
    with_context = sum(1 for c in batch.context_lens if c)
    if info.mla:
        decode_refusal = forward_impl_mismatch(type(layer).forward_impl) if batch.decode_tokens else None
        context_refusal = latent_cache_unreadable(layer, kv_cache) if with_context else None
    elif info.adapter is None:
        return guard.Decision.fallback(
            f"no_decode_adapter:{info.backend}", f"vLLM attention backend {info.backend} has no adapter (its decode "
            f"sub-batch and paged KV cache): adapters exist for {', '.join(adapters.ADAPTERS)}", prefill, tokens)
    elif batch.decode_tokens and settings.split_mixed() == "off":
        return guard.Decision.fallback(
            "mixed_not_split", f"{batch.decode_tokens} decode token(s) beside {prefill} prefill token(s): fusing the "
            f"prefill rows would split the call in two, which costs more than fusion saves ({settings.SPLIT_MIXED_ENV}"
            f"=on splits it)", prefill, tokens)
    else:
        decode_refusal = info.adapter.decode_refusal(layer, md) if batch.decode_tokens else None
        context_refusal = info.adapter.context_refusal(layer, kv_cache) if with_context else None
    decision = guard.decide(batch, info.shape(q), decode_refusal=decode_refusal, context_refusal=context_refusal,
                            allow_partial=False)
    if decision.fused and with_context:  # the fused rows read the cached context from the paged cache
        detail = (f"{decision.detail}; {with_context} prefill(s) attend to {sum(batch.context_lens)} cached context "
                  f"token(s) read from the paged {'latent ' if info.mla else ''}cache")
        decision = guard.Decision(decision.path, decision.reason, decision.backend, detail, decision.prefill_tokens,
                                  decision.fused_tokens, decision.post_quantized)
    return decision
