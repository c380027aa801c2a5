"""The run-time guard of the fused attention -> NVFP4 call, and its counters.

After the fusion pass, one attention op call receives the NVFP4 buffers of
the o_proj GEMM. One compiled graph serves every batch, so whether the fused
kernel may run is decided here, per call, from the batch metadata
(:class:`~fusion_pass.runtime.BatchSpec`): fused only on pure-prefill batches
for which a backend exists (:func:`fusion_pass.backends.select_backend`).
Every other call takes the unfused path, byte-identical to the unfused graph.

Each decision taken by the ops is counted (:func:`record`, :func:`counters`);
the first occurrence of each fallback reason is logged at INFO on the
``"fusion_pass"`` logger, so a fallback is never silent.
"""

from __future__ import annotations

import copy
import logging
import threading
from dataclasses import dataclass
from typing import Any, Literal

import torch

from fusion_pass import backends as _backends

__all__ = [
    "Decision",
    "FALLBACK_REASONS",
    "decide",
    "record",
    "counters",
    "reset_counters",
]

logger = logging.getLogger("fusion_pass")

FALLBACK_REASONS = ("decode_tokens", "chunked_prefill", "dcp_world_size>1", "no_backend")
"""Why a call falls back, in the order the guard checks them."""


@dataclass(frozen=True)
class Decision:
    """The guard's verdict for one attention call.

    ``path`` is ``"fused"`` (``backend`` names the backend, ``reason`` is None)
    or ``"fallback"`` (``reason`` is one of :data:`FALLBACK_REASONS`,
    ``backend`` is None). ``detail`` says more: the batch composition for the
    batch reasons, every backend's refusal for ``"no_backend"``, the chosen
    backend's description when fused.
    """

    path: Literal["fused", "fallback"]
    reason: str | None
    backend: str | None
    detail: str | None = None

    @property
    def fused(self) -> bool:
        return self.path == "fused"


def decide(
    spec: Any,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    num_heads: int,
    qk_head_dim: int,
    v_head_dim: int,
) -> Decision:
    """Fused or fallback for the batch ``spec`` and a layer of these dims.

    Checked in this order (so a mixed batch reports ``"decode_tokens"``):

    1. ``spec.num_decode_tokens == 0``, else ``"decode_tokens"``;
    2. no prefill with cached context, else ``"chunked_prefill"``;
    3. ``spec.dcp_world_size == 1``, else ``"dcp_world_size>1"``;
    4. a backend is selected (:func:`fusion_pass.backends.select_backend`),
       else ``"no_backend"`` with each backend's reason in ``detail``.
    """
    if spec.num_decode_tokens != 0:
        return Decision(
            "fallback", "decode_tokens", None,
            f"{spec.num_decode_tokens} decode token(s) in a {spec.kind!r} batch",
        )
    if spec.has_chunked_prefill:
        chunked = sum(1 for r in spec.requests if r.is_chunked_prefill)
        return Decision("fallback", "chunked_prefill", None, f"{chunked} prefill request(s) with cached context")
    if spec.dcp_world_size != 1:
        return Decision("fallback", "dcp_world_size>1", None, f"dcp_world_size={spec.dcp_world_size}")
    backend, why = _backends.select_backend(device, dtype, num_heads, qk_head_dim, v_head_dim)
    if backend is None:
        return Decision("fallback", "no_backend", None, why)
    return Decision("fused", None, backend.name, why)


# ---------------------------------------------------------------------------
# counters
# ---------------------------------------------------------------------------

_lock = threading.Lock()
_fused_by_backend: dict[str, int] = {}
_fallback: dict[str, int] = {}
_logged_reasons: set[str] = set()


def record(decision: Decision) -> None:
    """Count ``decision``; log the first fallback of each reason at INFO."""
    log = False
    with _lock:
        if decision.path == "fused":
            _fused_by_backend[decision.backend] = _fused_by_backend.get(decision.backend, 0) + 1
        elif decision.path == "fallback":
            _fallback[decision.reason] = _fallback.get(decision.reason, 0) + 1
            if decision.reason not in _logged_reasons:
                _logged_reasons.add(decision.reason)
                log = True
        else:
            raise ValueError(f"decision.path must be 'fused' or 'fallback', got {decision.path!r}")
    if log:
        logger.info(
            "fusion_pass: fused attention+NVFP4 quant fell back to the unfused path (reason: %s; %s); "
            "further fallbacks for this reason are only counted (fusion_pass.guard.counters())",
            decision.reason,
            decision.detail or "no detail",
        )


def counters() -> dict[str, Any]:
    """A snapshot: ``{"fused": int, "fused_by_backend": {name: int}, "fallback": {reason: int}}``."""
    with _lock:
        return {
            "fused": sum(_fused_by_backend.values()),
            "fused_by_backend": copy.copy(_fused_by_backend),
            "fallback": copy.copy(_fallback),
        }


def reset_counters() -> None:
    """Zero the counters; the next fallback of each reason is logged again."""
    with _lock:
        _fused_by_backend.clear()
        _fallback.clear()
        _logged_reasons.clear()
