"""The standard layers' KV cache in pages: the layout one fused launch over every row of a call reads in place
(:meth:`fusion_pass.runtime.backends.base.Backend.run_paged`), as it reads vLLM's paged cache.

A :class:`PagedCache` holds per request id a :class:`PagedEntry`: ``length`` tokens in pages of ``page_size``
slots, token ``j`` at slot ``j % page_size`` of page ``pages[j // page_size]`` (a request's page table). The pages
live in a pool: one tensor per cached form (a standard layer caches two, keys and values), each
``[num_pages, page_size, *row]`` and contiguous (keys ``[num_pages, page_size, Hkv, D]``, values
``[num_pages, page_size, Hkv, Dv]``: the layout ``run_paged`` takes), in the dtype the tokens came in. A cache has one
pool per device and per dtypes and row shapes of its forms, made on first use; a pool grows when its free pages run
out (doubling, new pages zeroed, the old ones copied), and pages given up (an entry replaced, a failed transaction's,
a cleared cache's) are taken again, lowest id first.

Appending writes the new tokens into the slots past an entry's length and nowhere else, so whatever was read of an
entry below its length stays valid while the entry is the request's. Tokens in another dtype than the request's
cached ones move the request to the pool of the promoted dtypes (``torch.promote_types``: what concatenating them
gives), its cached tokens converted exactly.
"""

from __future__ import annotations

import threading
from typing import Iterable, NamedTuple, Sequence

import torch
from torch import Tensor

from fusion_pass.kernels.host_copy import to_device
from fusion_pass.nvfp4.checks import ArgumentError
from fusion_pass.runtime.engine.batch import RequestSpec
from fusion_pass.runtime.engine.cache import KVCache, positive_int

__all__ = ["DEFAULT_PAGE_SIZE", "PagedCache", "PagedEntry", "PagedView"]

DEFAULT_PAGE_SIZE = 16
"""Slots per page unless a layer says otherwise: vLLM's default block size."""

_FIRST_PAGES = 4  # a new pool's size in pages, at least


class _Pool:
    """Pages of one device, dtypes and row shapes: ``tensors`` one ``[num_pages, page_size, *row]`` per cached
    form; ``free`` the page ids not in use, taken from the end (lowest id there)."""

    __slots__ = ("key", "page_size", "tensors", "free")

    def __init__(self, key: tuple, page_size: int, like: Sequence[Tensor], dtypes: Sequence[torch.dtype]) -> None:
        self.key, self.page_size = key, page_size
        self.tensors = tuple(x.new_zeros((0, page_size, *x.shape[1:]), dtype=d) for x, d in zip(like, dtypes))
        self.free: list[int] = []

    def take(self, n: int) -> list[int]:
        """``n`` free page ids, lowest first; grows the pool when fewer are free."""
        if n > len(self.free):
            self._grow(n - len(self.free))
        if n == 0:
            return []
        taken = self.free[-n:][::-1]
        del self.free[-n:]
        return taken

    def give_back(self, pages: Iterable[int]) -> None:
        self.free.extend(pages)
        self.free.sort(reverse=True)

    def _grow(self, missing: int) -> None:
        old = self.tensors[0].shape[0]
        new = max(2 * old, old + missing, _FIRST_PAGES)
        grown = []
        for t in self.tensors:
            g = t.new_zeros((new, *t.shape[1:]))
            g[:old] = t
            grown.append(g)
        self.tensors = tuple(grown)
        self.free[:0] = range(new - 1, old - 1, -1)

    def write(self, pages: Sequence[int], start: int, rows: Sequence[Tensor]) -> None:
        """``rows`` (one ``[n, *row]`` per form) into tokens ``[start, start + n)`` of the entry on ``pages``."""
        n = rows[0].shape[0]
        if n == 0:
            return
        index = to_device(_slots(pages, self.page_size, start, start + n), torch.long, self.tensors[0].device)
        for t, x in zip(self.tensors, rows):
            t.view(-1, *t.shape[2:]).index_copy_(0, index, x.to(t.dtype))

    def read(self, pages: Sequence[int], lo: int, hi: int) -> tuple[Tensor, ...]:
        """Tokens ``[lo, hi)`` of the entry on ``pages``: one new ``[hi - lo, *row]`` tensor per form."""
        index = to_device(_slots(pages, self.page_size, lo, hi), torch.long, self.tensors[0].device)
        return tuple(t.view(-1, *t.shape[2:])[index] for t in self.tensors)


def _slots(pages: Sequence[int], page_size: int, lo: int, hi: int) -> Tensor:
    """int64 ``[hi - lo]`` (host): the slot of each token ``lo .. hi - 1`` in the pool's ``[num_pages * page_size]``
    rows."""
    j = torch.arange(lo, hi)
    return torch.tensor(pages, dtype=torch.long)[j // page_size] * page_size + j % page_size


class PagedEntry:
    """One request's tokens: ``length`` of them on ``pages`` (a tuple of page ids, ``ceil(length / page_size)``)
    of ``pool``. Immutable: a step makes a new entry (sharing the pages it appends to)."""

    __slots__ = ("pool", "pages", "length")

    def __init__(self, pool: _Pool, pages: tuple[int, ...], length: int) -> None:
        self.pool, self.pages, self.length = pool, pages, length

    @property
    def device(self) -> torch.device:
        return self.pool.tensors[0].device

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtype of each cached form."""
        return tuple(t.dtype for t in self.pool.tensors)

    def __repr__(self) -> str:
        return f"PagedEntry(length={self.length}, pages={self.pages}, dtypes={self.dtypes}, device={self.device})"


class PagedView(NamedTuple):
    """What one paged launch reads of some entries: the pool's ``tensors`` (one ``[num_pages, page_size, *row]``
    per form) and ``page_table`` (host int32 ``[B, max_pages]``: row ``b`` the pages of entry ``b``, then zeros)."""

    tensors: tuple[Tensor, ...]
    page_table: Tensor


class _Log:
    """What one transaction changed, per request id: the entry before its first change (None: the id did not
    exist), the entry it last wrote and the entries in between (replaced within the transaction)."""

    __slots__ = ("previous", "written", "between")

    def __init__(self) -> None:
        self.previous: dict[str, PagedEntry | None] = {}
        self.written: dict[str, PagedEntry] = {}
        self.between: dict[str, list[PagedEntry]] = {}

    def note(self, request_id: str, previous: PagedEntry | None, full: PagedEntry) -> None:
        if request_id in self.previous:
            if previous is not None:
                self.between.setdefault(request_id, []).append(previous)
        else:
            self.previous[request_id] = previous
        self.written[request_id] = full

    def absorb(self, inner: "_Log") -> None:
        """Take over a finished nested transaction's changes (keeping this one's earlier previous entries)."""
        for request_id, previous in inner.previous.items():
            if request_id in self.previous:
                if previous is not None:
                    self.between.setdefault(request_id, []).append(previous)
            else:
                self.previous[request_id] = previous
            self.between.setdefault(request_id, []).extend(inner.between.get(request_id, ()))
        self.written.update(inner.written)


class PagedCache(KVCache):
    """``request_id -> tokens`` in pages (module docstring), one tensor per cached form, token axis first.

    ``page_size``: slots per page (default :data:`DEFAULT_PAGE_SIZE`). Safe to share between threads that run
    batches of different requests (one lock around every change and every pool growth; each :meth:`transaction`
    undoes only its own thread's changes, :class:`~fusion_pass.runtime.engine.cache.KVCache`): a failed one puts
    each request it changed back at its previous entry (length and pages) and gives back the pages it took; pages
    an entry gave up inside a transaction are given back when the outermost one finishes. Copies and pickles hold
    the page size and the tokens (:meth:`entries`)."""

    def __init__(self, page_size: int = DEFAULT_PAGE_SIZE) -> None:
        self.page_size = positive_int("PagedCache", "page_size", page_size)
        self._entries: dict[str, PagedEntry] = {}
        self._pools: dict[tuple, _Pool] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def __getstate__(self) -> dict:
        return {"page_size": self.page_size, "entries": self.entries()}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["page_size"])
        self.restore(state["entries"])

    def _held(self, request_id: str) -> tuple[int, torch.device | None]:
        entry = self._entries.get(request_id)
        return (0, None) if entry is None else (entry.length, entry.device)

    def entry(self, request_id: str) -> PagedEntry | None:
        """The request's entry (None if unknown)."""
        return self._entries.get(request_id)

    def page_counts(self) -> dict[str, int]:
        """``{"allocated": pages of every pool, "free": of which no entry uses}``."""
        with self._lock:
            return {"allocated": sum(p.tensors[0].shape[0] for p in self._pools.values()),
                    "free": sum(len(p.free) for p in self._pools.values())}

    def _pool(self, device: torch.device, like: Sequence[Tensor], dtypes: Sequence[torch.dtype]) -> _Pool:
        key = (device, tuple(dtypes), tuple(tuple(x.shape[1:]) for x in like))
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _Pool(key, self.page_size, like, dtypes)
        return pool

    def _give_back(self, drop: Iterable[PagedEntry | None], keep: PagedEntry | None) -> None:
        """Give back the pages of the ``drop`` entries that ``keep`` does not use, each once (pools dropped by
        :meth:`clear` or :meth:`restore` are left alone). With the lock held."""
        kept = set() if keep is None else {(id(keep.pool), p) for p in keep.pages}
        freed: dict[int, tuple[_Pool, set]] = {}
        for entry in drop:
            if entry is None or self._pools.get(entry.pool.key) is not entry.pool:
                continue
            pages = freed.setdefault(id(entry.pool), (entry.pool, set()))[1]
            pages.update(p for p in entry.pages if (id(entry.pool), p) not in kept)
        for pool, pages in freed.values():
            pool.give_back(pages)

    def extend_many(self, requests: Sequence[RequestSpec], new: tuple[Tensor, ...]) -> list[PagedEntry]:
        """Append each request's new tokens (a request with ``context_len == 0`` starts a new entry, replacing
        any); return the requests' entries, in order.

        ``new``: one tensor per cached form, ``[sum(query_len), *row]``, the requests' tokens one request after
        another (a batch's row order), on one device. One write per form and pool. Inside a :meth:`transaction`
        the replaced entries are logged, to be put back should it fail; outside one, the pages a replaced entry
        no longer needs are given back at once. Every request's ``context_len`` must equal its cached length
        (:meth:`check`; ValueError here, before anything changes).
        """
        if not new or any(not isinstance(x, Tensor) or x.dim() < 1 for x in new):
            raise ArgumentError("PagedCache.extend_many: new must be a non-empty tuple of tensors [tokens, ...]")
        total = sum(r.query_len for r in requests)
        if any(x.shape[0] != total for x in new) or any(x.device != new[0].device for x in new):
            raise ArgumentError(f"PagedCache.extend_many: new must hold sum(query_len) = {total} rows per form on "
                                f"one device, got {[(tuple(x.shape), str(x.device)) for x in new]}")
        named = [r.request_id for r in requests]
        if len(set(named)) != len(named):
            raise ArgumentError(f"PagedCache.extend_many: requests must name each request once, got {named}")
        device, rows = new[0].device, [tuple(x.shape[1:]) for x in new]
        starts = [0]
        for r in requests:
            starts.append(starts[-1] + r.query_len)
        with self._lock:
            plans = [self._plan(r, new, device, rows) for r in requests]  # checks; no entry or page changed yet
            taken: list[tuple[_Pool, list[int]]] = []
            try:
                pages = []
                for (base, pool, start), r in zip(plans, requests):
                    kept = base.pages if base is not None and base.pool is pool else ()
                    need = -(-(start + r.query_len) // self.page_size) - len(kept)
                    taken.append((pool, pool.take(need)))
                    pages.append(kept + tuple(taken[-1][1]))
                self._write(plans, pages, requests, new, starts)
            except BaseException:
                for pool, got in taken:
                    pool.give_back(got)
                raise
            logs = self._logs()
            entries = []
            for (_, pool, start), r, table in zip(plans, requests, pages):
                full = PagedEntry(pool, table, start + r.query_len)
                previous = self._entries.get(r.request_id)
                self._entries[r.request_id] = full
                if logs:
                    logs[-1].note(r.request_id, previous, full)
                else:
                    self._give_back([previous], full)
                entries.append(full)
        return entries

    def _plan(self, r: RequestSpec, new: tuple[Tensor, ...], device, rows) -> tuple[PagedEntry | None, _Pool, int]:
        """``(the entry appended to or None, the pool of the new entry, its first new token)`` for request ``r``;
        ValueError when its cached context does not fit (a length or device mismatch, other row shapes)."""
        previous = self._entries.get(r.request_id)
        if r.context_len == 0:
            return None, self._pool(device, new, [x.dtype for x in new]), 0
        if previous is None or previous.length != r.context_len:
            raise ValueError(f"request {r.request_id}: batch says context_len={r.context_len} but the cache holds "
                             f"{0 if previous is None else previous.length} tokens")
        if previous.device != device:
            raise ValueError(f"request {r.request_id}: its cached context is on {previous.device}, the new tokens "
                             f"are on {device}")
        cached = [tuple(t.shape[2:]) for t in previous.pool.tensors]
        if cached != rows:
            raise ValueError(f"request {r.request_id}: its cached tokens have rows {cached}, the new ones {rows}")
        dtypes = [torch.promote_types(a, x.dtype) for a, x in zip(previous.dtypes, new)]
        return previous, self._pool(device, new, dtypes), r.context_len

    def _write(self, plans, pages, requests, new, starts) -> None:
        """The new tokens into their slots: per pool one write per form of the appended requests' tokens, and a
        request moved to another pool (promoted dtypes) rewritten there whole. With the lock held."""
        groups: dict[int, tuple[_Pool, list[int], list[int]]] = {}
        for i, ((base, pool, start), ids) in enumerate(zip(plans, pages)):
            if base is not None and base.pool is not pool:
                context = base.pool.read(base.pages, 0, start)
                pool.write(ids, 0, [torch.cat([c.to(t.dtype), x[starts[i]:starts[i + 1]].to(t.dtype)])
                                    for t, c, x in zip(pool.tensors, context, new)])
                continue
            slots, tokens = groups.setdefault(id(pool), (pool, [], []))[1:]
            slots.append(_slots(ids, pool.page_size, start, start + requests[i].query_len))
            tokens.extend(range(starts[i], starts[i + 1]))
        for pool, slots, tokens in groups.values():
            index = to_device(torch.cat(slots), torch.long, pool.tensors[0].device)
            whole = len(tokens) == new[0].shape[0]
            rows = new if whole else [x[to_device(tokens, torch.long, x.device)] for x in new]
            for t, x in zip(pool.tensors, rows):
                t.view(-1, *t.shape[2:]).index_copy_(0, index, x.to(t.dtype))

    def extend(self, request: RequestSpec, new: tuple[Tensor, ...]) -> PagedEntry:
        """:meth:`extend_many` of one request."""
        return self.extend_many([request], new)[0]

    def read(self, entry: PagedEntry, lo: int = 0, hi: int | None = None) -> tuple[Tensor, ...]:
        """Tokens ``[lo, hi)`` of ``entry`` (default all): one new ``[hi - lo, *row]`` tensor per form."""
        return entry.pool.read(entry.pages, lo, entry.length if hi is None else hi)

    def gather(self, parts: Sequence[tuple[PagedEntry, int]], lo: int, hi: int) -> tuple[Tensor, ...]:
        """Rows ``[lo, hi)`` of the concatenation of the first ``n`` tokens of each ``(entry, n)`` of ``parts``
        (the packed cached context of a batch's prefills), one new tensor per form, without building the whole;
        entries of one pool in one read."""
        pieces: list[tuple[_Pool, list[Tensor]]] = []
        start = 0
        for entry, n in parts:
            a, b = max(lo, start) - start, min(hi, start + n) - start
            if b > a:
                slots = _slots(entry.pages, entry.pool.page_size, a, b)
                if pieces and pieces[-1][0] is entry.pool:
                    pieces[-1][1].append(slots)
                else:
                    pieces.append((entry.pool, [slots]))
            start += n
        if not pieces:
            entry = parts[0][0]
            return tuple(t.new_empty((0, *t.shape[2:])) for t in entry.pool.tensors)
        reads = []
        for pool, slots in pieces:
            index = to_device(torch.cat(slots), torch.long, pool.tensors[0].device)
            reads.append(tuple(t.view(-1, *t.shape[2:])[index] for t in pool.tensors))
        return reads[0] if len(reads) == 1 else tuple(torch.cat(forms) for forms in zip(*reads))

    def view(self, entries: Sequence[PagedEntry]) -> PagedView:
        """The pool ``entries`` share and their page table (:class:`PagedView`), to read in place; ValueError
        when they are not in one pool."""
        pool = entries[0].pool
        if any(e.pool is not pool for e in entries):
            raise ValueError(f"PagedCache.view: the entries are in several pools (dtypes "
                             f"{sorted({str(e.dtypes) for e in entries})}): one launch reads one")
        width = max(len(e.pages) for e in entries)
        table = torch.zeros(len(entries), width, dtype=torch.int32)
        for b, e in enumerate(entries):
            table[b, :len(e.pages)] = torch.tensor(e.pages, dtype=torch.int32)
        return PagedView(pool.tensors, table)

    def _new_log(self) -> _Log:
        return _Log()

    def _undo(self, log: _Log) -> None:
        with self._lock:
            for request_id, previous in log.previous.items():
                written, between = log.written[request_id], log.between.get(request_id, [])
                if self._entries.get(request_id) is written:
                    if previous is None:
                        del self._entries[request_id]
                    else:
                        self._entries[request_id] = previous
                    self._give_back([written, *between], previous)
                else:  # replaced since (clear, restore, another thread), which gave back the written pages
                    self._give_back([previous, *between], written)

    def _settle(self, log: _Log) -> None:
        with self._lock:
            for request_id, previous in log.previous.items():
                self._give_back([previous, *log.between.get(request_id, [])], log.written[request_id])

    def clear(self) -> None:
        """Drop every entry and pool."""
        with self._lock:
            self._entries.clear()
            self._pools.clear()

    def entries(self) -> dict[str, tuple[Tensor, ...]]:
        """Every request's tokens, copied out of the pages (which later steps write in place): ``{request_id:
        one [length, *row] tensor per form}``."""
        with self._lock:
            return {rid: e.pool.read(e.pages, 0, e.length) for rid, e in self._entries.items()}

    def restore(self, entries: dict[str, tuple[Tensor, ...]]) -> None:
        """Put back the tokens :meth:`entries` returned, into fresh pools (every entry and pool before is
        dropped). Checked first (ArgumentError naming the request; nothing changed): each entry a tuple of tensors
        of one device with equal token counts, and every entry with the first one's number of forms and row
        shapes. Built aside, then swapped in."""
        _check_snapshot(entries)
        with self._lock:
            kept_entries, kept_pools = self._entries, self._pools
            self._entries, self._pools = {}, {}
            try:
                for rid, forms in entries.items():
                    pool = self._pool(forms[0].device, forms, [x.dtype for x in forms])
                    pages = tuple(pool.take(-(-forms[0].shape[0] // self.page_size)))
                    pool.write(pages, 0, forms)
                    self._entries[rid] = PagedEntry(pool, pages, forms[0].shape[0])
            except BaseException:
                self._entries, self._pools = kept_entries, kept_pools
                raise


def _check_snapshot(entries) -> None:
    """What :meth:`PagedCache.restore` takes: ``{request id: (k [S, ...], v [S, ...])}`` of one layout."""
    if not isinstance(entries, dict):
        raise ArgumentError(f"PagedCache.restore: entries must be a dict of request id -> tensors, got "
                            f"{type(entries).__name__}")
    rows = None
    for rid, forms in entries.items():
        if not (isinstance(forms, tuple) and forms and all(isinstance(x, Tensor) for x in forms)):
            raise ArgumentError(f"PagedCache.restore: request {rid!r} must be a tuple of tensors, got {forms!r:.80}")
        if len({x.shape[0] for x in forms}) != 1 or len({x.device for x in forms}) != 1:
            raise ArgumentError(f"PagedCache.restore: request {rid!r}: its tensors must share the token count and "
                                f"the device, got shapes {[list(x.shape) for x in forms]} on "
                                f"{[str(x.device) for x in forms]}")
        shapes = [tuple(x.shape[1:]) for x in forms]
        if rows is not None and shapes != rows:
            raise ArgumentError(f"PagedCache.restore: request {rid!r} has rows {shapes}, the others {rows}")
        rows = shapes
