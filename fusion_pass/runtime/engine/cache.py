"""KV cache bookkeeping shared by the stand-in engine's runtimes (their context source is a
:data:`fusion_pass.runtime.row_plan.ContextRows`): the check and transaction both caches share (:class:`KVCache`)
and MLA's per-request cache (:class:`RequestCache`; the standard layers' paged one: :mod:`.paged_cache`)."""

from __future__ import annotations

import math
import numbers
import threading
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor

from fusion_pass.nvfp4.checks import ArgumentError, check_int
from fusion_pass.runtime.engine.batch import BatchSpec, RequestSpec

__all__ = ["CachedLayer", "KVCache", "RequestCache", "packed_rows", "positive_int", "positive_softmax_scale"]


def positive_int(owner: str, name: str, value: int) -> int:
    """``value`` as an int when it is a positive integer (a layer dimension; numpy integers accepted), else
    ArgumentError naming ``owner`` and ``name``."""
    return check_int(f"{owner}: {name}", value, minimum=1, expected="a positive int")


def positive_softmax_scale(owner: str, value) -> float:
    """``value`` as a float when it is a positive finite number (a layer's ``softmax_scale``), else ArgumentError
    naming ``owner``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ArgumentError(f"{owner}: softmax_scale must be a positive finite number, got {type(value).__name__} "
                            f"{value!r}")
    return float(value)


class _Log:
    """What one transaction changed: per request id, the entry before the transaction's first change of it
    (None: the id did not exist) and the entry the transaction last wrote."""

    __slots__ = ("previous", "written")

    def __init__(self) -> None:
        self.previous: dict[str, tuple[torch.Tensor, ...] | None] = {}
        self.written: dict[str, tuple[torch.Tensor, ...]] = {}

    def note(self, request_id: str, previous, full) -> None:
        self.previous.setdefault(request_id, previous)
        self.written[request_id] = full

    def absorb(self, inner: "_Log") -> None:
        """Take over a finished nested transaction's changes (keeping this one's earlier previous entries)."""
        for request_id, previous in inner.previous.items():
            self.previous.setdefault(request_id, previous)
        self.written.update(inner.written)


class KVCache:
    """What both caches share: the check of a batch against the cached lengths, and a :meth:`transaction` that
    undoes a failed ``with`` body's changes, per thread (a thread-local stack of transaction logs).

    Subclasses hold ``_lock`` and ``_local`` (a ``threading.local``) and say how long an entry is and where it
    lives (``_held``), what a log is (``_new_log``: an object with ``absorb``), how a failed body's log is undone
    (``_undo``, called without the lock held) and what the outermost finished transaction settles (``_settle``)."""

    _local: threading.local

    def _logs(self) -> list:
        """The calling thread's open transactions, innermost last."""
        logs = getattr(self._local, "logs", None)
        if logs is None:
            logs = self._local.logs = []
        return logs

    def _held(self, request_id: str) -> tuple[int, torch.device | None]:
        raise NotImplementedError

    def length(self, request_id: str) -> int:
        """Tokens cached for ``request_id`` (0 if unknown)."""
        return self._held(request_id)[0]

    def check(self, spec: BatchSpec, *, device: torch.device | None = None) -> None:
        """Every request's cached length must equal its ``context_len``.

        Requests with ``context_len == 0`` start fresh, so are not checked.
        With ``device``, the cached context the batch reads must live there
        (the new tokens are appended to it). Called before any entry is
        touched, so a failing batch changes nothing; reads only.
        """
        for r in spec.requests:
            held, cached = self._held(r.request_id)
            if r.context_len > 0 and held != r.context_len:
                raise ValueError(
                    f"request {r.request_id}: batch says context_len={r.context_len} "
                    f"but the cache holds {held} tokens"
                )
            if device is not None and r.context_len > 0 and cached != torch.device(device):
                raise ValueError(
                    f"request {r.request_id}: its cached context is on {cached}, "
                    f"the new tokens are on {torch.device(device)}"
                )

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Undo the changes this thread's ``with`` body made to the cache if the body raises.

        Only the body's own changes: each change inside it records the entry it replaces (per request id, the
        first time), and a failure puts back exactly those entries (removing ids the body created), leaving
        every other id alone, whatever other threads wrote meanwhile. An entry another thread has replaced
        since the body last wrote it is left as that thread wrote it. Transactions nest: a failing inner one
        undoes its own changes only; a finished inner one's changes become the outer one's.
        """
        logs = self._logs()
        log = self._new_log()
        logs.append(log)
        try:
            yield
        except BaseException:
            logs.pop()
            self._undo(log)
            raise
        logs.pop()
        if logs:
            logs[-1].absorb(log)
        else:
            self._settle(log)

    def _new_log(self):
        raise NotImplementedError

    def _undo(self, log) -> None:
        raise NotImplementedError

    def _settle(self, log) -> None:
        """Nothing to settle."""


class RequestCache(KVCache):
    """``request_id -> tuple of tensors`` whose dim 0 is the token axis.

    Safe to share between threads that run batches of different requests: each :meth:`transaction` undoes
    only its own thread's changes. Cheap: entries are never modified in place (a step replaces them), so a
    transaction's log shares the tensors."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[torch.Tensor, ...]] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def __getstate__(self) -> dict:
        """Copies and pickles hold the entries only (no lock, no open transaction)."""
        return {"_entries": self.entries()}

    def __setstate__(self, state: dict) -> None:
        self.__init__()
        self._entries = dict(state["_entries"])

    def _held(self, request_id: str) -> tuple[int, torch.device | None]:
        entry = self._entries.get(request_id)
        return (0, None) if entry is None else (entry[0].shape[0], entry[0].device)

    def _new_log(self) -> _Log:
        return _Log()

    def _undo(self, log: _Log) -> None:
        with self._lock:
            for request_id, previous in log.previous.items():
                if self._entries.get(request_id) is not log.written[request_id]:
                    continue  # replaced since (clear, restore, another thread): not this body's to undo
                if previous is None:
                    del self._entries[request_id]
                else:
                    self._entries[request_id] = previous

    def extend(
        self, request: RequestSpec, new: tuple[torch.Tensor, ...], *, owned: bool = False
    ) -> tuple[torch.Tensor, ...]:
        """Append ``new`` rows (replacing the entry when ``context_len == 0``);
        return the full entry (context followed by the new rows).

        ``owned=True`` says ``new`` are fresh tensors nobody else holds, so a
        fresh entry may keep them instead of a copy. Inside a :meth:`transaction`
        the replaced entry is logged, to be put back should the transaction fail.
        """
        request_id = request.request_id
        if request.context_len == 0:
            full = tuple(new) if owned else tuple(t.clone() for t in new)
        else:
            old = self._entries[request_id]
            full = tuple(torch.cat([o, n]) for o, n in zip(old, new))
        logs = self._logs()
        with self._lock:
            previous = self._entries.get(request_id)
            self._entries[request_id] = full
        if logs:
            logs[-1].note(request_id, previous, full)
        return full

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def entries(self) -> dict[str, tuple[torch.Tensor, ...]]:
        """A copy of the mapping (sharing the tensors: entries are never modified in place)."""
        with self._lock:
            return dict(self._entries)

    def restore(self, entries: dict[str, tuple[torch.Tensor, ...]]) -> None:
        """Put back a mapping :meth:`entries` returned."""
        with self._lock:
            self._entries = dict(entries)


def packed_rows(pieces: list[Tensor], lo: int, hi: int) -> Tensor:
    """Rows ``[lo, hi)`` of the concatenation of ``pieces`` (each ``[n_i, ...]``), without building it."""
    out, start = [], 0
    for piece in pieces:
        end = start + piece.shape[0]
        if end > lo and start < hi:
            out.append(piece[max(lo, start) - start: min(hi, end) - start])
        start = end
    if not out:
        return pieces[0][:0]
    return out[0] if len(out) == 1 else torch.cat(out)


class CachedLayer:
    """What both runtimes share: a KV cache per layer (``cache``, a :class:`KVCache`: MLA's
    :class:`RequestCache`, the standard layer's :class:`~fusion_pass.runtime.engine.paged_cache.PagedCache`; the
    op's rollback uses its transaction) and its two user-facing queries."""

    cache: KVCache

    def clear_cache(self) -> None:
        """Drop every request's cached tokens."""
        self.cache.clear()

    def cache_len(self, request_id: str) -> int:
        """Number of tokens cached for ``request_id`` (0 if unknown)."""
        return self.cache.length(request_id)
