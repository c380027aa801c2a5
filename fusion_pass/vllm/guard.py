"""The run-time guard of the vLLM ops: vLLM's attention metadata and layer read into the shared guard core
(:func:`fusion_pass.runtime.guard.decide`), so a vLLM call and a call of the project's own runtime are decided
by the same rules with the same reasons.

What vLLM adds to the core's checks: no metadata (vLLM's profile and dummy runs, ``no_attention_metadata``),
what the layer computes beyond plain causal attention (``layer_not_supported``), and what the adapter cannot
compute apart: decode rows of standard layers and, for MLA, when vLLM's ``forward_impl`` lacks the decode/prefill
split the decode rows rely on (``decode_tokens``); cached context of standard layers, and of MLA layers whose KV
cache is not the unquantized latent cache (``chunked_prefill``).
"""

import dataclasses
import functools
import inspect

import torch

from fusion_pass.runtime import guard

__all__ = ["FORWARD_IMPL_STRUCTURE", "NO_METADATA", "batch_kind", "batch_rows", "decide", "dims", "is_mla",
           "layer_name_of", "mla_batch", "standard_batch"]

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


def dcp_world_size() -> int:
    try:
        from vllm.distributed.parallel_state import get_dcp_group

        return get_dcp_group().world_size
    except Exception:  # not initialised (single process without DCP)
        return 1


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


def unsupported_reason(layer, md) -> str | None:
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
    if "decoder" not in attn_type.lower() or not getattr(md, "causal", True):
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


def mla_batch(md) -> tuple[int, list[int], list[int]]:
    """``(D, query_lens, context_lens)`` of vLLM's MLA metadata (``MLACommonMetadata``), host ints: the
    decode tokens (rows ``[0, D)``), then per prefill request (rows from ``D`` on, in order) its new
    tokens and its cached context tokens (``prefill.chunked_context.context_lens_list``; 0 without)."""
    decode = int(md.num_decode_tokens)
    prefill = getattr(md, "prefill", None)  # absent from some platforms' sparse MLA metadata
    if prefill is None or not getattr(md, "num_prefills", 0):
        return decode, [], []
    lens = getattr(prefill, "query_lens_cpu", None)
    if lens is None:  # vLLM's builder sets it; otherwise from the (device) offsets
        loc = prefill.query_start_loc[: md.num_prefills + 1].to("cpu")
        lens = loc[1:] - loc[:-1]
    query_lens = [int(x) for x in lens.tolist()]
    chunked = prefill.chunked_context
    context_lens = [int(c) for c in chunked.context_lens_list] if chunked is not None else [0] * len(query_lens)
    return decode, query_lens, context_lens


def standard_batch(md) -> tuple[int, list[int], list[int]] | None:
    """``(decode tokens, query_lens, context_lens)`` of a standard backend's metadata, host ints: per request,
    context = ``seq_len - query_len``, a one-token query with context is a decode; ``query_lens`` /
    ``context_lens`` per other (prefill) request, in order. None when the metadata lacks
    ``query_start_loc`` or ``seq_lens`` (unknown metadata)."""
    qsl, seq_lens = getattr(md, "query_start_loc", None), getattr(md, "seq_lens", None)
    if qsl is None or seq_lens is None:
        return None
    n = seq_lens.shape[0]
    q_lens = (qsl[1:n + 1] - qsl[:n]).to("cpu")
    ctx = seq_lens.to("cpu") - q_lens
    is_decode = (ctx > 0) & (q_lens == 1)
    return (int(q_lens[is_decode].sum().item()), [int(x) for x in q_lens[~is_decode].tolist()],
            [int(x) for x in ctx[~is_decode].tolist()])


def batch_kind(md):
    """(decode tokens, prefill requests with cached context) of vLLM's attention metadata."""
    if hasattr(md, "num_decode_tokens") and hasattr(md, "prefill") and hasattr(md, "num_prefills"):  # MLA common
        decode, _, context_lens = mla_batch(md)
        return decode, sum(1 for c in context_lens if c)
    standard = standard_batch(md)
    if standard is None:
        return 1, 0  # unknown metadata: never fused
    decode, _, context_lens = standard
    return decode, sum(1 for c in context_lens if c)


def batch_rows(md, layer, tokens: int) -> guard.BatchRows:
    """The rows of a vLLM call: MLA metadata gives its prefills' query and context lengths, a standard backend's
    metadata its decode tokens and per prefill request its query and context lengths (a standard layer's call
    is fused only without decode tokens and cached context: :func:`decide`). Unknown metadata reads as one
    decode token beside ``num_actual_tokens - 1`` prefill tokens: never fused."""
    n = int(getattr(md, "num_actual_tokens", tokens))
    if is_mla(layer):
        decode, query_lens, context_lens = mla_batch(md)
    else:
        standard = standard_batch(md)
        decode, query_lens, context_lens = standard if standard is not None else (1, [n - 1], [0])
    return guard.BatchRows(decode, tuple(query_lens), tuple(context_lens), dcp_world_size())


def decide(layer_name, q, md, layer, kv_cache=None) -> guard.Decision:
    """The guard for one vLLM call, from the layer, its metadata and KV cache.

    Per token, as the runtime's: ``prefill_tokens`` and ``fused_tokens`` of the ``num_actual_tokens`` rows,
    ``post_quantized`` ``{reason: rows}`` for the rest. No metadata (a profile or dummy run) counts no tokens.
    """
    if md is None:
        return guard.Decision.fallback(NO_METADATA, "no attention metadata (vLLM profile/dummy run)")
    rows = batch_rows(md, layer, q.shape[0])
    mla = is_mla(layer)
    heads, qk_dim, v_dim = dims(layer)
    unsupported = unsupported_reason(layer, md)
    decode_refusal = ("vLLM's standard attention backends compute decode and prefill rows in one kernel call"
                      if not mla else None)
    if mla and rows.decode_tokens and not unsupported:
        decode_refusal = forward_impl_mismatch(type(layer).forward_impl)
    context_refusal = ("vLLM's standard attention backends: the adapter does not read their paged KV cache"
                       if not mla else latent_cache_unreadable(layer, kv_cache) if any(rows.context_lens) else None)
    decision = guard.decide(rows, guard.LayerShape(q.device, q.dtype, heads, qk_dim, v_dim),
                            unsupported=f"{layer_name_of(layer_name)}: {unsupported}" if unsupported else None,
                            decode_refusal=decode_refusal, context_refusal=context_refusal, allow_partial=False)
    with_context = sum(1 for c in rows.context_lens if c)
    if decision.fused and with_context:  # MLA: the fused rows read the cached context from the paged latent cache
        decision = dataclasses.replace(decision, detail=(
            f"{decision.detail}; {with_context} prefill(s) attend to {sum(rows.context_lens)} cached context "
            f"token(s) read from the paged latent cache"))
    return decision
