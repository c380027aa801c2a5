"""Counters of the guard's decisions, process-wide: calls by path and reason, tokens by fate.

Each decision the attention ops take is counted (:func:`record`, :func:`counters`); the first fallback of each
reason is logged at INFO on the ``"fusion_pass"`` logger, so a fallback is never silent.
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import Any

from fusion_pass.runtime.guard import Decision

__all__ = ["counters", "record", "reset_counters"]

logger = logging.getLogger("fusion_pass")


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
            "further fallbacks for this reason are only counted (fusion_pass.runtime.counters.counters())",
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
