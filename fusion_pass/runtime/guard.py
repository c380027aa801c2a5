"""The run-time guard: which rows of one attention call the fused backend writes. One core for every caller.

After the fusion pass, one attention op call receives the NVFP4 buffers of the o_proj GEMM. One compiled graph
serves every batch, so whether the fused kernel may run is decided here, per call, row by row, from a neutral
description of the batch (:class:`BatchRows`) and of the layer (:class:`LayerShape`). The project's runtime
builds them from its :class:`~fusion_pass.runtime.BatchSpec`, the vLLM adapter from vLLM's attention metadata;
both get the same reasons (:data:`FALLBACK_REASONS`). The prefill rows run the fused backend
(:func:`fusion_pass.runtime.backends.select_backend`) whenever one exists for the layer, also beside decode
rows (a mixed batch; a caller with a paged cache, vLLM's and the stand-in engine's standard layers, hands the
whole call, decode rows included, to one paged launch instead: ``Decision.one_call``) and, where the backend
handles cached context, for
chunked prefills; under ``auto`` only where the measured policy fuses the call's class (:mod:`.policy`). Decode rows, and
every row of a call that cannot be fused, are computed as the unfused graph computes them and post-quantized
into their rows of the same buffers: byte-identical to the unfused graph.

The decisions are counted by :mod:`fusion_pass.runtime.counters`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from fusion_pass.formats import NVFP4, OutputFormat
from fusion_pass.runtime import backends, policy, self_check, settings
from fusion_pass.runtime.backends.base import fused_prefills, fuses, writes

__all__ = ["BatchRows", "Decision", "FALLBACK_REASONS", "LayerShape", "decide"]

FALLBACK_REASONS = (
    "no_attention_metadata",
    "no_host_metadata",
    "dcp_world_size>1",
    "decode_tokens",
    "cuda_graph_capture",
    "layer_not_supported",
    "no_decode_adapter",
    "mixed_not_split",
    "no_backend",
    "no_fast_backend",
    "slower_here",
    "self_check_failed",
    "self_check_pending",
    "kv_dtype",
    "chunked_prefill",
)
"""Why rows are post-quantized, in the order the guard checks them. ``decode_tokens`` also names the decode
rows of a mixed batch whose prefill rows are fused; ``no_attention_metadata`` (vLLM's profile and dummy runs),
``no_host_metadata`` (vLLM metadata without a host copy of the batch: the adapter never reads device metadata),
``cuda_graph_capture`` (a call being captured into a CUDA graph takes the fallback, which needs no decision),
``layer_not_supported`` (what vLLM's layer computes beyond plain causal attention), ``no_decode_adapter``
(a standard layer on a vLLM attention backend without an adapter; counted as ``no_decode_adapter:<BACKEND>``)
and ``mixed_not_split`` (a standard layer's call with decode and prefill rows, not split into two calls:
:data:`fusion_pass.runtime.settings.SPLIT_MIXED_MODES`) come from the vLLM adapter; ``no_fast_backend``: a
backend could run the layer, but ``auto`` takes only one this project measured faster than the unfused path on
the device's GPU generation (name one to run it anyway); ``slower_here``: ``auto``'s backend runs the call, but
the measured policy says fusing a call of its class is slower on this GPU generation than the unfused path
(:mod:`fusion_pass.runtime.policy`; ``FUSION_PASS_POLICY=always`` or a named backend fuses it anyway);
``self_check_failed``: the backend's kernel differed
from its unfused twin on the first-use canary and is disabled for the process; ``self_check_pending``: the
canary has not run yet and cannot run now (a CUDA graph is being captured) (:mod:`fusion_pass.runtime.self_check`);
``kv_dtype``: keys / values in another dtype than the query, which the selected backend would round to the query
dtype (its ``kv_dtype`` is not float32)."""


@dataclass(frozen=True)
class BatchRows:
    """The rows of one attention call: ``decode_tokens`` decode rows first, then one prefill per entry of
    ``query_lens`` (its new tokens) and ``context_lens`` (its cached context tokens), in row order."""

    decode_tokens: int
    query_lens: tuple[int, ...] = ()
    context_lens: tuple[int, ...] = ()
    dcp_world_size: int = 1

    @classmethod
    def from_spec(cls, spec: Any) -> "BatchRows":
        """The rows of a :class:`~fusion_pass.runtime.BatchSpec`: made once per spec (a spec is immutable, and
        one step's spec is read by every attention layer), kept in the spec's ``__dict__`` beside its own
        cached facts."""
        rows = spec.__dict__.get("_batch_rows")
        if rows is None:
            prefills = spec.requests[spec.num_decodes:]
            rows = spec.__dict__["_batch_rows"] = cls(spec.num_decode_tokens, tuple(r.query_len for r in prefills),
                                                      tuple(r.context_len for r in prefills), spec.dcp_world_size)
        return rows

    @property
    def prefill_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.decode_tokens + self.prefill_tokens


@dataclass(frozen=True)
class LayerShape:
    """What a backend must support: the query's device and dtype and the layer's head dims; ``kv_dtype`` the
    dtype of the key/value inputs (MLA: the latents) when it is not the query's (None: the query's);
    ``num_kv_heads`` the key/value heads the fused kernel attends over (None: ``num_heads``, as MLA's
    up-projected keys)."""

    device: torch.device | str
    dtype: torch.dtype
    num_heads: int
    qk_head_dim: int
    v_head_dim: int
    kv_dtype: torch.dtype | None = None
    num_kv_heads: int | None = None


@dataclass(frozen=True)
class Decision:
    """The guard's verdict for one attention call.

    ``path`` is ``"fused"`` (every prefill row is written by the fused backend
    ``backend``; ``reason`` is None), ``"partial"`` (some prefill rows are:
    those of prefills with cached context the backend does not run are not) or
    ``"fallback"`` (no row is; ``reason`` is one of :data:`FALLBACK_REASONS`,
    ``backend`` is None); ``one_call``: the fused backend writes every row of the call, decode rows included, in
    one launch over the caller's paged KV cache. ``detail`` says
    more: the batch composition for the batch reasons, every backend's refusal
    for ``"no_backend"``, the chosen backend's description when fused.

    Per token: ``prefill_tokens`` of the batch, ``fused_tokens`` of them written by the
    fused backend, ``decode_fused`` decode rows written by it (a one-call decision), ``post_quantized``
    ``{reason: tokens}`` for the rest (a split mixed batch's decode rows under ``"decode_tokens"``).
    ``format``: the name of the output format the call writes (:mod:`fusion_pass.formats`; ``"nvfp4"``,
    ``"fp8_static"``), which the counters keep apart.
    """

    path: Literal["fused", "partial", "fallback"]
    reason: str | None
    backend: str | None
    detail: str | None = None
    prefill_tokens: int = 0
    fused_tokens: int = 0
    post_quantized: dict = field(default_factory=dict)
    decode_fused: int = 0
    format: str = NVFP4.name

    @property
    def one_call(self) -> bool:
        """Every row, decode rows included, written by one fused launch over the paged cache."""
        return self.decode_fused > 0

    @classmethod
    def fallback(cls, reason: str, detail: str, prefill_tokens: int = 0, tokens: int = 0,
                 output_format: str = NVFP4.name) -> "Decision":
        """Every row post-quantized for ``reason`` (one of :data:`FALLBACK_REASONS`), in ``output_format``."""
        return cls("fallback", reason, None, detail, prefill_tokens, 0, {reason: tokens} if tokens else {},
                   format=output_format)

    @property
    def fused(self) -> bool:
        """The fused backend runs (on every prefill row, or on some: ``"partial"``)."""
        return self.path in ("fused", "partial")


def decide(rows: BatchRows, layer: LayerShape, *, unsupported: str | None = None, decode_refusal: str | None = None,
           context_refusal: str | None = None, allow_partial: bool = True,
           one_call_refusal: str | None = "the caller offers no paged cache", split_free: bool = False,
           output_format: OutputFormat = NVFP4) -> Decision:
    """Which rows of the call the fused backend writes, in ``output_format`` (:mod:`fusion_pass.formats`; the
    decision's ``format``).

    Checked in this order; the first that holds post-quantizes every row:

    1. ``rows.dcp_world_size != 1``: ``"dcp_world_size>1"``;
    2. no prefill row (a decode-only batch): ``"decode_tokens"``;
    3. ``unsupported`` (what the layer computes that the fused kernels do not): ``"layer_not_supported"``;
    4. decode rows and ``decode_refusal`` (the caller cannot compute them apart): ``"decode_tokens"``;
    5. cached context and ``context_refusal`` (the caller cannot read it): ``"chunked_prefill"``;
    6. no backend is selected for ``layer`` and ``output_format`` (a backend without a kernel of the format is
       refused with a reason naming it): ``"no_backend"`` with each backend's reason in ``detail``, or
       ``"no_fast_backend"`` when one could run it but ``auto`` takes none that is not measured fast here;
    6a. under ``auto``, the measured policy refuses the call's row plan on this GPU generation
       (:func:`fusion_pass.runtime.policy.verdict`): ``"slower_here"``;
    6b. ``layer.kv_dtype`` is set, not the query dtype, and the backend's ``kv_dtype`` is not float32 (it would
       round the keys and values the unfused computation attends over as given): ``"kv_dtype"``;
    7. no prefill the backend runs (every prefill has cached context and the backend does not run such
       prefills, or, for a format it has no merge launch of, their context exceeds the context workspace bound:
       :func:`~fusion_pass.runtime.backends.base.fused_prefills`; with ``allow_partial=False``, any prefill with
       context it does not run): ``"chunked_prefill"``;
    8. the backend's kernel failed its first-use self-check, or it has not run and a CUDA graph is being
       captured (:func:`fusion_pass.runtime.self_check.verify`; runs the canary on first need):
       ``"self_check_failed"`` / ``"self_check_pending"``.

    Otherwise the prefill rows the backend runs (:func:`fuses`) are fused and the rest post-quantized: decode
    rows counted under ``"decode_tokens"``, rows of prefills with cached context the backend does not run under
    ``"chunked_prefill"``. ``path`` is ``"fused"`` when every prefill row is fused, ``"partial"`` when some are.

    One call: a call with decode rows whose caller can hand the whole call to one launch over its paged KV cache
    (``one_call_refusal`` None) and whose backend runs such a launch (``handles_paged``) is fused whole, decode
    rows included (``Decision.one_call``); checks 4 and 5 then do not apply (they are about computing decode rows
    apart and reading context into a workspace), and are made after 6 instead when the backend has no paged
    launch. The row plan the policy is asked about: ``prefill`` without decode rows, else ``mixed_one_call``,
    ``mixed_split_free`` (``split_free``: the caller's unfused path computes decode rows apart anyway) or
    ``mixed_split``.
    """
    t, d, prefill = rows.num_tokens, rows.decode_tokens, rows.prefill_tokens
    with_context = sum(1 for c in rows.context_lens if c)

    def fallback(reason: str, detail: str) -> Decision:
        return Decision.fallback(reason, detail, prefill, t, output_format.name)

    if rows.dcp_world_size != 1:
        return fallback("dcp_world_size>1", f"dcp_world_size={rows.dcp_world_size}")
    if prefill == 0:
        return fallback("decode_tokens", f"{d} decode token(s), no prefill")
    if unsupported:
        return fallback("layer_not_supported", unsupported)
    offered = bool(d) and one_call_refusal is None

    def apart() -> Decision | None:  # checks 4 and 5: decode rows computed apart, context read into a workspace
        if d and decode_refusal:
            return fallback("decode_tokens", f"{d} decode token(s) beside {prefill} prefill token(s): {decode_refusal}")
        if with_context and context_refusal:
            return fallback("chunked_prefill",
                            f"{with_context} prefill request(s) with cached context: {context_refusal}")
        return None

    refused = None if offered else apart()
    if refused is not None:
        return refused
    backend, why = backends.select_backend(layer.device, layer.dtype, layer.num_heads, layer.qk_head_dim,
                                           layer.v_head_dim, output_format=output_format)
    if backend is None:
        usable, _ = backends.select_backend(layer.device, layer.dtype, layer.num_heads, layer.qk_head_dim,
                                            layer.v_head_dim, fast_only=False, output_format=output_format)
        return fallback("no_backend" if usable is None else "no_fast_backend", why)
    if layer.kv_dtype not in (None, layer.dtype) and getattr(backend, "kv_dtype", None) != torch.float32:
        return fallback("kv_dtype", f"keys / values in {layer.kv_dtype} beside {layer.dtype} queries: backend "
                                    f"{backend.name} computes attention with them in the query dtype")
    one_call = offered and getattr(backend, "handles_paged", False) and writes(backend, output_format, "paged")
    auto, one_call_evidence = settings.configured_backend() == "auto", ""
    if one_call and auto:
        one_call, one_call_evidence = policy.verdict(layer.device, "mixed_one_call")
    if offered and not one_call:  # the rows are written apart after all: checks 4 and 5
        refused = apart()
        if refused is not None:
            return refused
    if auto and not one_call:
        plan = "prefill" if not d else "mixed_split_free" if split_free else "mixed_split"
        fast, evidence = policy.verdict(layer.device, plan)
        if not fast:
            also = f"; one fused call over the paged cache neither: {one_call_evidence}" if one_call_evidence else ""
            return fallback("slower_here", f"backend {backend.name} runs this call, but fusing a {plan} call is not "
                                           f"faster on {policy.generation(layer.device)}: {evidence}{also}")
    if one_call:
        refused, checked = self_check.verify(backend, layer.device, layer.dtype, layer.num_heads, layer.qk_head_dim,
                                             layer.v_head_dim, layer.num_kv_heads)
        if refused:
            return fallback(refused, checked)
        detail = why + (f"; {checked}" if checked.startswith("self-check passed") else "") \
            + f"; every row in one launch over the paged KV cache ({d} decode row(s) fused)"
        return Decision("fused", None, backend.name, detail, prefill, prefill, {}, d, output_format.name)
    mask = fused_prefills(backend, output_format, rows.context_lens, settings.context_workspace_tokens)
    fused = sum(q for q, f in zip(rows.query_lens, mask) if f)
    context = ""
    if fused != prefill:
        context = (f"; {prefill - fused} row(s) of prefills with cached context post-quantized: " + (
            f"backend {backend.name} runs prefills without cached context only" if not fuses(backend, 1) else
            f"their {sum(rows.context_lens)} cached token(s) exceed the context workspace bound "
            f"({settings.context_workspace_tokens()} tokens) and backend {backend.name} has no "
            f"{output_format.name} merge of context chunks"))
    if fused == 0 or (fused != prefill and not allow_partial):
        return fallback("chunked_prefill", context[2:])
    refused, checked = self_check.verify(backend, layer.device, layer.dtype, layer.num_heads, layer.qk_head_dim,
                                         layer.v_head_dim, layer.num_kv_heads)
    if refused:
        return fallback(refused, checked)
    unfused = {"decode_tokens": d, "chunked_prefill": prefill - fused}
    rest = {k: v for k, v in unfused.items() if v}
    detail = why + (f"; {checked}" if checked.startswith("self-check passed") else "") \
        + (f"; {d} decode row(s) post-quantized" if d else "") + context
    return Decision("fused" if fused == prefill else "partial", None, backend.name, detail, prefill, fused, rest,
                    format=output_format.name)
