"""Counters of the guard's decisions: calls by path and reason, tokens by fate; process-wide and per layer.

Each decision the attention ops take is counted (:func:`record`, :func:`counters`): in the process-wide total
and, when the call names its layer, under that layer's name too, so that a report can count the calls of its
own layers only (``counters(layers=[...])``; :meth:`fusion_pass.FusionPass.report` does); the attention ops
pass their ``layer_name`` down to :func:`record`. Layer names are global to the process and can be reused
once a layer is unregistered: registering a layer under a name starts that name's counts afresh
(:func:`forget_layer`), so a name's counts are those of the layer registered under it now (or last). The first
fallback of each reason is logged at INFO on the ``"fusion_pass"`` logger, so a fallback is never silent.

Cheap per call: :func:`record` runs once per attention layer per step (inside a serving engine, between the
layers' kernels), so it only validates the decision, appends ``(decision, layer name)`` to a list and checks two
flags; the sums are built when something reads them (:func:`counters`, :func:`forget_layer`) or when
:data:`FOLD_AT` calls wait, grouped by decision object (the guard hands the same object to every layer of a step
and to every decode-only step of a size). What a reader sees is exactly what a per-call sum would give.

Output formats (:mod:`fusion_pass.formats`): each call is counted under its decision's ``format``. The snapshot of
every format keeps NVFP4's keys as they are and names another format's calls beside them: ``fused_by_backend``
``"reference (fp8_static)"``, ``fallback`` ``"decode_tokens (fp8_static)"`` (tokens are summed over the formats);
``counters(output_format="fp8_static")`` is the snapshot of that format's calls alone, with plain keys.

Listeners (:func:`add_listener`) learn that the counters changed: a listener is called on the first change after
it was added or after the counters were last read (so a listener that reads the counters, or wakes a thread
that does, is called again after the next change; one that never reads them is called once), outside the
counters' lock, in the thread that recorded. The per-call cost is one flag test; the vLLM integration's report
file only wakes its writer thread, which reads the counters when it writes.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterable

from fusion_pass import formats
from fusion_pass.formats import NVFP4
from fusion_pass.nvfp4.checks import ArgumentError
from fusion_pass.runtime.guard import Decision

__all__ = ["FOLD_AT", "add_listener", "counters", "forget_layer", "record", "remove_listener", "reset_counters"]

logger = logging.getLogger("fusion_pass")

FOLD_AT = 4096
"""Recorded calls waiting at most before :func:`record` adds them up (bounds the memory they hold)."""

_PATHS = frozenset(("fused", "partial", "fallback"))


class _Counts:
    """One set of counters: the process total, or one layer's; keyed by output format (a format name, or
    ``(format, backend)`` / ``(format, reason)``)."""

    __slots__ = ("fused_by_backend", "fallback", "prefill", "prefill_fused", "decode_fused", "post_quantized")

    def __init__(self) -> None:
        self.fused_by_backend: dict[tuple[str, str], int] = {}
        self.fallback: dict[tuple[str, str], int] = {}
        self.prefill: dict[str, int] = {}
        self.prefill_fused: dict[str, int] = {}
        self.decode_fused: dict[str, int] = {}
        self.post_quantized: dict[tuple[str, str], int] = {}

    def add(self, decision: Decision, calls: int = 1) -> None:
        """Count ``calls`` calls that took ``decision``."""
        fmt = decision.format
        if decision.fused:
            key = (fmt, decision.backend)
            self.fused_by_backend[key] = self.fused_by_backend.get(key, 0) + calls
        else:
            key = (fmt, decision.reason)
            self.fallback[key] = self.fallback.get(key, 0) + calls
        for target, n in ((self.prefill, decision.prefill_tokens), (self.prefill_fused, decision.fused_tokens),
                          (self.decode_fused, decision.decode_fused)):
            target[fmt] = target.get(fmt, 0) + n * calls
        for reason, n in decision.post_quantized.items():
            key = (fmt, reason)
            self.post_quantized[key] = self.post_quantized.get(key, 0) + n * calls


def _named(fmt: str, name: str, plain: bool) -> str:
    """A backend or reason as a snapshot key: as it is for NVFP4 or in one format's snapshot (``plain``), else
    ``"<name> (<format>)"``."""
    return name if plain or fmt == NVFP4.name else f"{name} ({fmt})"


_lock = threading.Lock()
_total = _Counts()
_by_layer: dict[str, _Counts] = {}
_pending: list = []  # (decision, layer name or None) per recorded call not yet added up; appended without the lock
_logged_reasons: set = {None}  # (reason, format) logged (None: fused decisions, never logged)
_listeners: list[Callable[[], None]] = []
_armed = False  # call the listeners at the next record (set when they may not know of the last change)


def record(decision: Decision, layer_name: str | None = None) -> None:
    """Count ``decision`` in the process total and, given ``layer_name``, under that layer; log the first
    fallback of each reason at INFO."""
    if decision.path not in _PATHS:
        raise ValueError(f"decision.path must be 'fused', 'partial' or 'fallback', got {decision.path!r}")
    if layer_name is not None and not isinstance(layer_name, str):
        raise ValueError(f"record: layer_name must be a str or None, got {type(layer_name).__name__} "
                         f"{layer_name!r}")
    _pending.append((decision, layer_name))
    if len(_pending) >= FOLD_AT:
        with _lock:
            _fold()
    if decision.reason is not None and (decision.reason, decision.format) not in _logged_reasons:
        _log_first(decision)
    if _armed:
        _notify()


def _fold() -> None:
    """Add the waiting calls to the sums (with ``_lock`` held). Calls appended meanwhile (by a thread that does
    not hold the lock) stay for the next fold: only the ones read are removed, from the front."""
    n = len(_pending)
    if not n:
        return
    batch = _pending[:n]
    del _pending[:n]
    groups: dict = {}
    for decision, name in batch:  # the batch holds every decision, so ids are unique here
        key = (id(decision), name)
        group = groups.get(key)
        if group is None:
            groups[key] = [decision, name, 1]
        else:
            group[2] += 1
    for decision, name, calls in groups.values():
        _total.add(decision, calls)
        if name is not None:
            counts = _by_layer.get(name)
            if counts is None:
                counts = _by_layer[name] = _Counts()
            counts.add(decision, calls)


def _log_first(decision: Decision) -> None:
    key = (decision.reason, decision.format)
    with _lock:
        if key in _logged_reasons:
            return
        _logged_reasons.add(key)
    if decision.fused:
        return
    logger.info(
        "fusion_pass: fused attention+%s quant fell back to the unfused path (reason: %s; %s); "
        "further fallbacks for this reason are only counted (fusion_pass.runtime.counters.counters())",
        "NVFP4" if decision.format == NVFP4.name else decision.format,
        decision.reason,
        decision.detail or "no detail",
    )


def add_listener(listener: Callable[[], None]) -> None:
    """Call ``listener()`` (no arguments) on the first change of the counters (:func:`record`,
    :func:`reset_counters`) after it was added or after the counters were last read (module docstring), outside
    the counters' lock. A listener that raises is removed, with a warning naming it and the exception. Adding
    the same listener twice adds it once."""
    global _armed
    if not callable(listener):
        raise ValueError(f"add_listener: listener must be callable, got {type(listener).__name__} {listener!r}")
    with _lock:
        if listener not in _listeners:
            _listeners.append(listener)
        _armed = True


def remove_listener(listener: Callable[[], None]) -> None:
    """Stop calling ``listener``; raises ``ValueError`` naming it when it was not added."""
    with _lock:
        if listener not in _listeners:
            raise ValueError(f"remove_listener: listener {listener!r} was not added (add_listener)")
        _listeners.remove(listener)


def _notify() -> None:
    global _armed
    _armed = False
    for listener in tuple(_listeners):
        try:
            listener()
        except Exception as exc:
            with _lock:
                if listener in _listeners:
                    _listeners.remove(listener)
            logger.warning("fusion_pass: counters listener %r raised %s: %s; it is removed and no longer called",
                           listener, type(exc).__name__, exc)


def _layer_names(layers) -> list[str]:
    if isinstance(layers, str):
        return [layers]
    if isinstance(layers, bytes) or not hasattr(layers, "__iter__"):
        raise ArgumentError(f"counters: layers must be None, a layer name (str) or an iterable of layer names, got "
                            f"{type(layers).__name__} {layers!r}")
    names = list(layers)
    for name in names:
        if not isinstance(name, str):
            raise ArgumentError(f"counters: layers must hold layer names (str), got {type(name).__name__} {name!r}")
    return names


def counters(layers: Iterable[str] | str | None = None, *, output_format: str | None = None) -> dict[str, Any]:
    """A snapshot: calls ``{"fused": int, "fused_by_backend": {name: int}, "fallback": {reason: int}}``
    and tokens ``"tokens": {"prefill": int, "prefill_fused": int, "decode_fused": int, "post_quantized":
    {reason: int}}`` (summed over the calls, i.e. over layers: a fraction ``prefill_fused / prefill`` is per
    token; ``decode_fused``: decode rows written by one fused launch with the rest of their call).

    ``layers``: None (the default) for the whole process; else layer names (one name, or an iterable of
    them): the sum over the calls counted under those layers (a name never counted adds nothing, so an
    empty list gives zeros). ``output_format``: None (the default) for the calls of every format, those of a
    format other than NVFP4 under ``"<backend> (<format>)"`` / ``"<reason> (<format>)"`` (module docstring); a
    format's name (``"nvfp4"``, ``"fp8_static"``): that format's calls alone, keys as they are.
    """
    global _armed
    names = None if layers is None else _layer_names(layers)
    if output_format is not None and not isinstance(output_format, str):
        shown = getattr(output_format, "name", None) or repr(output_format)[:60]
        raise ArgumentError(f"counters: output_format must be None or a format's name (str), got "
                            f"{type(output_format).__name__} {shown}")
    if output_format is not None and output_format not in {f.name for f in formats.FORMATS}:
        raise ArgumentError(f"counters: output_format must be one of {[f.name for f in formats.FORMATS]}, got "
                            f"{output_format!r}")
    plain = output_format is not None
    fused_by_backend: dict[str, int] = {}
    fallback: dict[str, int] = {}
    post: dict[str, int] = {}
    prefill = prefill_fused = decode_fused = 0
    with _lock:
        _armed = bool(_listeners)  # before the read: a call recorded from here on reaches the listeners
        _fold()
        sources = [_total] if names is None else [_by_layer[n] for n in dict.fromkeys(names) if n in _by_layer]
        for c in sources:
            for target, source, by_format in ((fused_by_backend, c.fused_by_backend, True),
                                              (fallback, c.fallback, True), (post, c.post_quantized, False)):
                for (fmt, name), n in source.items():
                    if output_format is None or fmt == output_format:
                        key = _named(fmt, name, plain or not by_format)
                        target[key] = target.get(key, 0) + n
            prefill += sum(n for fmt, n in c.prefill.items() if output_format is None or fmt == output_format)
            prefill_fused += sum(n for fmt, n in c.prefill_fused.items()
                                 if output_format is None or fmt == output_format)
            decode_fused += sum(n for fmt, n in c.decode_fused.items() if output_format is None or fmt == output_format)
    return {
        "fused": sum(fused_by_backend.values()),
        "fused_by_backend": fused_by_backend,
        "fallback": fallback,
        "tokens": {"prefill": prefill, "prefill_fused": prefill_fused, "decode_fused": decode_fused,
                   "post_quantized": post},
    }


def forget_layer(layer_name: str) -> None:
    """Drop ``layer_name``'s own counts (the process total keeps them): a new layer registered under the name
    (:func:`fusion_pass.runtime.register_layer` calls this) starts from zero."""
    with _lock:
        _fold()  # calls recorded so far belong to the layer registered under the name until now
        _by_layer.pop(layer_name, None)


def reset_counters() -> None:
    """Zero the counters (the total and every layer's); the next fallback of each reason is logged again."""
    global _total
    with _lock:
        del _pending[:]
        _total = _Counts()
        _by_layer.clear()
        _logged_reasons.clear()
        _logged_reasons.add(None)
    _notify()
