"""The run-time guard of the fused attention -> NVFP4 call, and its counters.

After the fusion pass, one attention op call receives the NVFP4 buffers of
the o_proj GEMM. One compiled graph serves every batch, so whether the fused
kernel may run is decided here, per call, from the batch metadata
(:class:`~fusion_pass.runtime.BatchSpec`), row by row: the prefill rows of a
batch run the fused backend (:func:`fusion_pass.backends.select_backend`)
whenever one exists for the layer, also beside decode rows (a mixed batch)
and, where the backend handles cached context, for chunked prefills. Decode
rows, and every row of a call that cannot be fused, are computed as the
unfused graph computes them and post-quantized into their rows of the same
buffers (the row-range quantizer): byte-identical to the unfused graph.

Each decision taken by the ops is counted (:func:`record`, :func:`counters`);
the first occurrence of each fallback reason is logged at INFO on the
``"fusion_pass"`` logger, so a fallback is never silent.
"""

from __future__ import annotations

import copy
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from fusion_pass import backends as _backends
from fusion_pass import prefill as _prefill

__all__ = [
    "Decision",
    "FALLBACK_REASONS",
    "decide",
    "record",
    "counters",
    "reset_counters",
]

logger = logging.getLogger("fusion_pass")

FALLBACK_REASONS = ("dcp_world_size>1", "decode_tokens", "no_backend", "chunked_prefill")
"""Why rows are post-quantized, in the order the guard checks them: ``decode_tokens`` also names the
decode rows of a mixed batch whose prefill rows are fused."""


@dataclass(frozen=True)
class Decision:
    """The guard's verdict for one attention call.

    ``path`` is ``"fused"`` (every prefill row is written by the fused backend
    ``backend``; ``reason`` is None), ``"partial"`` (some prefill rows are:
    those of prefills with cached context the backend does not run are not) or
    ``"fallback"`` (no row is; ``reason`` is one of :data:`FALLBACK_REASONS`,
    ``backend`` is None). ``detail`` says
    more: the batch composition for the batch reasons, every backend's refusal
    for ``"no_backend"``, the chosen backend's description when fused.

    Per token: ``prefill_tokens`` of the batch, ``fused_tokens`` written by the
    fused backend, ``post_quantized`` ``{reason: tokens}`` for the rest (a
    mixed batch's decode rows under ``"decode_tokens"``).
    """

    path: Literal["fused", "partial", "fallback"]
    reason: str | None
    backend: str | None
    detail: str | None = None
    prefill_tokens: int = 0
    fused_tokens: int = 0
    post_quantized: dict = field(default_factory=dict)

    @property
    def fused(self) -> bool:
        """The fused backend runs (on every prefill row, or on some: ``"partial"``)."""
        return self.path in ("fused", "partial")


def decide(
    spec: Any,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    num_heads: int,
    qk_head_dim: int,
    v_head_dim: int,
) -> Decision:
    """Which rows of the batch ``spec`` the fused backend writes, for a layer of these dims.

    Checked in this order; the first that holds post-quantizes every row:

    1. ``spec.dcp_world_size != 1``: ``"dcp_world_size>1"``;
    2. no prefill row (a decode-only batch): ``"decode_tokens"``;
    3. no backend is selected (:func:`fusion_pass.backends.select_backend`):
       ``"no_backend"`` with each backend's reason in ``detail``;
    4. every prefill has cached context (chunked prefill, prefix-cache hit) and
       the backend does not run such prefills: ``"chunked_prefill"``.

    Otherwise the prefill rows the backend runs (:func:`fusion_pass.prefill.fuses`) are fused and the
    rest post-quantized: decode rows counted under ``"decode_tokens"``, rows of prefills with cached
    context the backend does not run under ``"chunked_prefill"``. ``path`` is ``"fused"`` when every
    prefill row is fused, ``"partial"`` when some are.
    """
    t, d = spec.num_tokens, spec.num_decode_tokens
    prefill = t - d

    def fallback(reason: str, detail: str) -> Decision:
        return Decision("fallback", reason, None, detail, prefill, 0, {reason: t})

    if spec.dcp_world_size != 1:
        return fallback("dcp_world_size>1", f"dcp_world_size={spec.dcp_world_size}")
    if prefill == 0:
        return fallback("decode_tokens", f"{d} decode token(s) in a {spec.kind!r} batch")
    backend, why = _backends.select_backend(device, dtype, num_heads, qk_head_dim, v_head_dim)
    if backend is None:
        return fallback("no_backend", why)
    fused = sum(r.query_len for r in spec.requests if _prefill.fuses(backend, r))
    unfused = {"decode_tokens": d, "chunked_prefill": prefill - fused}
    rest = {k: v for k, v in unfused.items() if v}
    context = ("" if fused == prefill else f"; {prefill - fused} row(s) of prefills with cached context "
               f"post-quantized: backend {backend.name} runs prefills without cached context only")
    if fused == 0:
        return fallback("chunked_prefill", context[2:])
    detail = why + (f"; {d} decode row(s) post-quantized" if d else "") + context
    return Decision("fused" if fused == prefill else "partial", None, backend.name, detail, prefill, fused, rest)


# ---------------------------------------------------------------------------
# counters
# ---------------------------------------------------------------------------

_lock = threading.Lock()
_fused_by_backend: dict[str, int] = {}
_fallback: dict[str, int] = {}
_tokens = {"prefill": 0, "prefill_fused": 0}
_post_quantized: dict[str, int] = {}
_logged_reasons: set[str] = set()


def record(decision: Decision) -> None:
    """Count ``decision``; log the first fallback of each reason at INFO."""
    log = False
    with _lock:
        if decision.fused:
            _fused_by_backend[decision.backend] = _fused_by_backend.get(decision.backend, 0) + 1
        elif decision.path == "fallback":
            _fallback[decision.reason] = _fallback.get(decision.reason, 0) + 1
            if decision.reason not in _logged_reasons:
                _logged_reasons.add(decision.reason)
                log = True
        else:
            raise ValueError(f"decision.path must be 'fused', 'partial' or 'fallback', got {decision.path!r}")
        _tokens["prefill"] += decision.prefill_tokens
        _tokens["prefill_fused"] += decision.fused_tokens
        for reason, n in decision.post_quantized.items():
            _post_quantized[reason] = _post_quantized.get(reason, 0) + n
    if log:
        logger.info(
            "fusion_pass: fused attention+NVFP4 quant fell back to the unfused path (reason: %s; %s); "
            "further fallbacks for this reason are only counted (fusion_pass.guard.counters())",
            decision.reason,
            decision.detail or "no detail",
        )


def counters() -> dict[str, Any]:
    """A snapshot: calls ``{"fused": int, "fused_by_backend": {name: int}, "fallback": {reason: int}}``
    and tokens ``"tokens": {"prefill": int, "prefill_fused": int, "post_quantized": {reason: int}}``
    (summed over the calls, i.e. over layers: a fraction ``prefill_fused / prefill`` is per token)."""
    with _lock:
        return {
            "fused": sum(_fused_by_backend.values()),
            "fused_by_backend": copy.copy(_fused_by_backend),
            "fallback": copy.copy(_fallback),
            "tokens": {**_tokens, "post_quantized": copy.copy(_post_quantized)},
        }


def reset_counters() -> None:
    """Zero the counters; the next fallback of each reason is logged again."""
    with _lock:
        _fused_by_backend.clear()
        _fallback.clear()
        _tokens.update(prefill=0, prefill_fused=0)
        _post_quantized.clear()
        _logged_reasons.clear()
