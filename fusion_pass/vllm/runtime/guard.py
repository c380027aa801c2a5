"""The run-time guard of the vLLM ops: vLLM's attention metadata and layer read into the shared guard core
(:func:`fusion_pass.runtime.guard.decide`), so a vLLM call and a call of the project's own runtime are decided
by the same rules with the same reasons. A standard layer and an MLA layer differ in how their rows are read
and computed (:mod:`fusion_pass.vllm.adapters.host_rows`, :mod:`fusion_pass.vllm.adapters`), not in how they are decided.

Capture-safe and cheap: the decision reads host-side values only (vLLM's host copies of the batch, the ints the
metadata holds; :mod:`fusion_pass.vllm.adapters.host_rows`), never a device tensor: no synchronization, nothing a CUDA
graph capture refuses. What does not change between calls is read once: per layer (:func:`layer_info`: MLA or
not, dims, what the layer computes beyond causal attention, its backend adapter), per step (the rows, kept on
vLLM's metadata object), per process (the DCP world size). A call being captured into a CUDA graph takes the
exact fallback, which needs no decision: a graph replays for batches the capture never saw
(``cuda_graph_capture``; a decode-only batch keeps ``decode_tokens``).

What vLLM adds to the core's checks: no metadata (vLLM's profile and dummy runs, ``no_attention_metadata``), no
host copy of the batch (``no_host_metadata``), capture (``cuda_graph_capture``), what the layer computes beyond
plain causal attention (``layer_not_supported``), a standard layer's backend without an adapter
(``no_decode_adapter:<BACKEND>``), a standard layer's call with decode and prefill rows that can be neither one
fused launch over the paged cache (the adapter's ``paged_refusal``, or a backend without such a launch) nor split
while splitting is off (``mixed_not_split``: :data:`fusion_pass.runtime.settings.SPLIT_MIXED_MODES`), and what an adapter
cannot compute apart: decode rows (``decode_tokens``: an MLA ``forward_impl`` without the decode/prefill split, a
standard backend's metadata the adapter cannot cut to its decode requests) and cached context
(``chunked_prefill``: a cache the adapter cannot read).
"""

import dataclasses
import functools

import torch

from fusion_pass.formats import NVFP4, OutputFormat
from fusion_pass.runtime import guard, settings
from fusion_pass.vllm.adapters import registry
from fusion_pass.vllm.adapters.host_rows import decode_only_tokens, standard_rows
from fusion_pass.vllm.adapters.layer import LayerInfo, is_mla, layer_info

__all__ = ["NO_METADATA", "decide", "decide_rows", "decode_only_decision", "is_mla", "layer_info", "layer_name_of",
           "step_rows"]

NO_METADATA = "no_attention_metadata"


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


def step_rows(md, layer):
    """The call's rows (:class:`fusion_pass.vllm.adapters.host_rows.StepRows`), host-side only; None without host copies."""
    info, dcp = layer_info(layer), (_dcp if _dcp is not None else dcp_world_size())
    return info.adapter.rows(md, dcp) if info.adapter is not None else standard_rows(md, dcp)


@functools.lru_cache(maxsize=4096)
def _decode_only(tokens: int, output_format: str = NVFP4.name) -> guard.Decision:
    return guard.Decision.fallback("decode_tokens", f"{tokens} decode token(s), no prefill", 0, tokens, output_format)


_DECISIONS = "decisions"  # the StepRows.memo entry: {LayerInfo.call_key: the step's decision}

@functools.lru_cache(maxsize=None)
def _no_metadata(output_format: str) -> guard.Decision:
    return guard.Decision.fallback(NO_METADATA, "no attention metadata (vLLM profile/dummy run)",
                                   output_format=output_format)


def _without_host_rows(info: LayerInfo, md, dcp: int, output_format: OutputFormat) -> guard.Decision:
    """The metadata holds no host copy of the batch: decode-only batches are known from its ints, any other
    call falls back."""
    n = int(getattr(md, "num_actual_tokens", 0))
    if dcp != 1:
        return guard.Decision.fallback("dcp_world_size>1", f"dcp_world_size={dcp}", 0, n, output_format.name)
    decode_only = (not getattr(md, "num_prefills", 0) or getattr(md, "prefill", None) is None) if info.mla \
        else getattr(md, "max_query_len", 2) <= 1
    if decode_only:
        return _decode_only(n, output_format.name)
    return guard.Decision.fallback("no_host_metadata", "the attention metadata holds no host copy of the batch's "
                                   "query and sequence lengths (the fused path never reads device metadata)", 0, n,
                                   output_format.name)


def decode_only_decision(md, output_format: OutputFormat = NVFP4) -> guard.Decision | None:
    """The decision of every call of a decode-only step writing ``output_format``, from the metadata's host ints
    alone (no layer needed: :func:`fusion_pass.vllm.adapters.host_rows.decode_only_tokens`), or None when the step may
    have prefill rows (or runs with DCP: decided per call)."""
    if (_dcp if _dcp is not None else dcp_world_size()) != 1:
        return None
    tokens = decode_only_tokens(md)
    return None if tokens is None else _decode_only(tokens, output_format.name)


def decide(layer_name, q, md, layer, kv_cache=None, output_format: OutputFormat = NVFP4) -> guard.Decision:
    """The guard for one vLLM call, from the layer, its metadata and KV cache (module docstring).

    Per token, as the runtime's: ``prefill_tokens`` and ``fused_tokens`` of the call's rows, ``post_quantized``
    ``{reason: rows}`` for the rest. No metadata (a profile or dummy run) counts no tokens. A call with prefill
    rows is decided once per step for layers that read alike (:meth:`LayerInfo.call_key`) and write the same
    ``output_format`` (:mod:`fusion_pass.formats`; the decision's ``format``), with the backend choice
    (:func:`fusion_pass.runtime.settings.configured_backend`) and the split mode
    (:func:`fusion_pass.runtime.settings.split_mixed`) of that first call: the decision is kept with the step's
    rows. The one fused launch over the paged cache writes NVFP4 only: a mixed call of another format is refused it
    (``one_call_refusal``), so its decode rows are vLLM's, post-quantized, where the call is split.
    """
    if md is None:
        return _no_metadata(output_format.name)
    decision = decode_only_decision(md, output_format)  # the call of most steps, decided from the metadata's ints
    return decision if decision is not None else decide_rows(layer_name, q, md, layer, kv_cache, output_format)


def decide_rows(layer_name, q, md, layer, kv_cache=None, output_format: OutputFormat = NVFP4) -> guard.Decision:
    """:func:`decide` for a call whose step is not decode-only (:func:`decode_only_decision` gave None for its
    metadata): from the step's rows."""
    dcp = _dcp if _dcp is not None else dcp_world_size()
    info = layer_info(layer)
    rows = info.adapter.rows(md, dcp) if info.adapter is not None else standard_rows(md, dcp)
    if rows is None:
        return _without_host_rows(info, md, dcp, output_format)
    if not rows.prefill_tokens and dcp == 1:
        return _decode_only(rows.num_tokens, output_format.name)
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return guard.Decision.fallback("cuda_graph_capture", "the call is being captured into a CUDA graph, which "
                                       "replays for batches the capture did not see: the exact fallback",
                                       rows.prefill_tokens, rows.num_tokens, output_format.name)
    decisions = rows.memo.get(_DECISIONS)
    if decisions is None:
        decisions = rows.memo[_DECISIONS] = {}
    key = info.call_key(q, kv_cache)
    if output_format is not NVFP4:
        key = (key, output_format.name)
    decision = decisions.get(key)
    if decision is None:
        decision = decisions[key] = _decide(layer_name, q, md, layer, kv_cache, info, rows.rows, output_format)
    return decision


def _decide(layer_name, q, md, layer, kv_cache, info: LayerInfo, batch: guard.BatchRows,
            output_format: OutputFormat = NVFP4) -> guard.Decision:
    """:func:`decide` for a call with prefill rows (or DCP), not captured."""
    prefill, tokens = batch.prefill_tokens, batch.num_tokens
    if batch.dcp_world_size != 1:
        return guard.decide(batch, info.shape(q), output_format=output_format)
    unsupported = info.unsupported
    if unsupported is None and not info.mla and getattr(md, "causal", True) is False:
        unsupported = "non-causal attention metadata (the fused kernels are causal decoder attention)"
    if unsupported:
        return guard.decide(batch, info.shape(q), unsupported=unsupported, output_format=output_format)
    with_context = sum(1 for c in batch.context_lens if c)
    adapter = info.adapter
    if adapter is None:
        return guard.Decision.fallback(
            f"no_decode_adapter:{info.backend}", f"vLLM attention backend {info.backend} has no adapter (its decode "
            f"rows and paged KV cache): adapters exist for {', '.join(registry.ADAPTERS)}", prefill, tokens,
            output_format.name)
    paged_refusal = getattr(adapter, "paged_refusal", None)
    if not batch.decode_tokens:
        one_call_refusal = "no decode row"
    elif output_format is not NVFP4:
        one_call_refusal = (f"the one fused launch over the paged cache writes {NVFP4.name} only, not "
                            f"{output_format.name}")
    else:
        one_call_refusal = (paged_refusal(layer, md, kv_cache) if paged_refusal is not None
                            else f"the {adapter.NAME} adapter reads no paged cache")
    split_off = bool(batch.decode_tokens) and not adapter.SPLITS_MIXED and settings.split_mixed() == "off"
    if split_off and one_call_refusal is not None:
        return _mixed_not_split(batch, one_call_refusal, output_format)
    decode_refusal = adapter.decode_refusal(layer, md) if batch.decode_tokens else None
    context_refusal = adapter.context_refusal(layer, kv_cache) if with_context else None
    decision = guard.decide(batch, info.shape(q), decode_refusal=decode_refusal, context_refusal=context_refusal,
                            allow_partial=False, one_call_refusal=one_call_refusal, split_free=adapter.SPLITS_MIXED,
                            output_format=output_format)
    if split_off and decision.fused and not decision.one_call:  # the backend has no paged launch: a split
        return _mixed_not_split(batch, f"backend {decision.backend} has no launch over the paged cache", output_format)
    if decision.fused and with_context and not decision.one_call:  # the fused rows read context from the cache
        detail = (f"{decision.detail}; {with_context} prefill(s) attend to {sum(batch.context_lens)} cached context "
                  f"token(s) read from the paged {'latent ' if info.mla else ''}cache")
        decision = dataclasses.replace(decision, detail=detail)
    return decision


def _mixed_not_split(batch, why_not_one_call: str, output_format: OutputFormat = NVFP4) -> guard.Decision:
    prefill = batch.prefill_tokens
    return guard.Decision.fallback(
        "mixed_not_split", f"{batch.decode_tokens} decode token(s) beside {prefill} prefill token(s): fusing the "
        f"prefill rows would split the call in two, which costs more than fusion saves ({settings.SPLIT_MIXED_ENV}"
        f"=on splits it); not one fused call: {why_not_one_call}", prefill, batch.num_tokens, output_format.name)
