"""The rows of one vLLM step, read from host-side metadata only: no device read, no synchronization.

vLLM builds one attention metadata object per step and KV-cache group, shared by every layer of the group, so
what is read here is read once per step and kept on that object (:func:`standard_rows`, :func:`mla_rows`); the
other layers' calls find it there.

Where the counts come from, per metadata kind (vLLM 0.32-0.34):

* MLA (``MLACommonMetadata``): ``num_decode_tokens`` (an int; vLLM's MLA builder orders decode rows first),
  the prefills' ``query_lens_cpu`` (a host tensor) and ``chunked_context.context_lens_list`` (a list);
* standard backends: vLLM's host copies of the batch in ``CommonAttentionMetadata`` (``query_start_loc_cpu``,
  ``seq_lens_cpu_upper_bound``, exact for every request with more than one new token), which a backend's
  metadata does not keep: :func:`install_build_hook` wraps the backend builder's ``build`` to keep them on the
  metadata it returns (:func:`attach`). Without them, metadata whose ``query_start_loc`` and ``seq_lens`` are
  host tensors (the CPU backend's) is read directly; device tensors are never read (:func:`standard_rows`
  returns None, and the caller decides from the host ints the metadata holds, ``max_query_len``).

A request with one new token is a decode row (as vLLM's ``split_decodes_and_prefills`` with threshold 1 and the
project's runtime count it), every other request with new tokens a prefill, with ``context = seq_len -
query_len`` cached tokens. Standard backends keep vLLM's request order, so decode and prefill rows may
interleave; MLA's are decode rows first.
"""

from __future__ import annotations

import functools

import torch

from fusion_pass.kernels.host_copy import to_device
from fusion_pass.runtime import guard

__all__ = ["StepRows", "attach", "block_table", "seq_lens", "decode_only_tokens", "device_index", "install_build_hook", "mla_rows", "request_rows", "requests_index",
           "standard_rows"]

_ROWS = "_fusion_pass_rows"   # the StepRows kept on a metadata object
_HOST = "_fusion_pass_host"   # (query_start_loc, seq_lens) host lists kept by the build hook
_BLOCK_TABLE = "_fusion_pass_block_table"  # the batch's block table, kept by the build hook where md has none
_SEQ_LENS = "_fusion_pass_seq_lens"  # the batch's device sequence lengths, kept by the build hook where md has none


class StepRows:
    """One step's rows, host ints. Per request (vLLM's order): ``query_lens``, ``context_lens`` and ``starts``
    (its first row). ``decode`` / ``prefill``: the indices of the decode requests (one new token) and of the
    prefill requests (more); requests without a new token (vLLM's padding) are in neither. ``rows``: the
    :class:`~fusion_pass.runtime.guard.BatchRows` the guard core reads (decode tokens, then per prefill its
    new and cached tokens, in order); ``num_tokens`` / ``prefill_tokens`` its rows / prefill rows. ``memo``:
    per-step values a backend adapter derives from the metadata (its sub-batch of decode rows, index tensors) and the
    guard's decisions, computed by the first layer that needs them."""

    __slots__ = ("query_lens", "context_lens", "starts", "decode", "prefill", "num_tokens", "prefill_tokens", "rows",
                 "memo")

    def __init__(self, query_lens, context_lens, dcp_world_size: int = 1):
        self.query_lens = query_lens = tuple(query_lens)
        self.context_lens = context_lens = tuple(context_lens)
        starts, decode, prefill, row = [], [], [], 0
        for i, n in enumerate(query_lens):
            starts.append(row)
            row += n
            if n == 1:
                decode.append(i)
            elif n > 1:
                prefill.append(i)
        self.starts, self.num_tokens, self.decode, self.prefill = tuple(starts), row, tuple(decode), tuple(prefill)
        self.rows = guard.BatchRows(len(decode), tuple(query_lens[i] for i in prefill),
                                    tuple(context_lens[i] for i in prefill), dcp_world_size)
        self.prefill_tokens = row - len(decode)
        self.memo: dict = {}

    @property
    def decode_rows(self) -> list[int]:
        """The row of each decode request, in order."""
        return [self.starts[i] for i in self.decode]

    def prefill_rows(self) -> list[int]:
        """Every row of the prefill requests, in order."""
        return [r for i in self.prefill for r in range(self.starts[i], self.starts[i] + self.query_lens[i])]

    def prefill_run(self) -> tuple[int, int] | None:
        """``(first row, rows)`` when the prefill rows are one run of adjacent rows (no decode row between
        them), else None."""
        if not self.prefill:
            return None
        first, last = self.prefill[0], self.prefill[-1]
        if any(self.query_lens[i] == 1 for i in range(first, last + 1)):
            return None
        return self.starts[first], self.starts[last] + self.query_lens[last] - self.starts[first]

    @classmethod
    def decode_first(cls, decode_tokens: int, query_lens, context_lens, dcp_world_size: int = 1) -> "StepRows":
        """Rows ``[0, D)`` decode rows, then the prefills (MLA's order)."""
        return cls([1] * decode_tokens + list(query_lens), [0] * decode_tokens + list(context_lens), dcp_world_size)


def _kept(md):
    """The StepRows kept on ``md`` itself (a shallow copy of ``md``, e.g. vLLM's ``update_block_table`` for
    another KV-cache group, carries the attribute along but not the identity: its rows are read afresh, so that
    a per-step memo never serves another block table)."""
    kept = getattr(md, _ROWS, None)
    return kept[1] if kept is not None and kept[0] == id(md) else None


def _keep(md, rows):
    try:
        setattr(md, _ROWS, (id(md), rows))
    except AttributeError:  # slotted or frozen metadata: read again next call
        pass
    return rows


def _lists(md):
    """(query_start_loc, seq_lens) host lists of a standard backend's metadata, or None (only device tensors)."""
    host = getattr(md, _HOST, None)
    if host is not None:
        return host
    qsl, seq_lens = getattr(md, "query_start_loc", None), getattr(md, "seq_lens", None)
    if not isinstance(qsl, torch.Tensor) or not isinstance(seq_lens, torch.Tensor):
        return None
    if qsl.device.type != "cpu" or seq_lens.device.type != "cpu":
        return None  # never read a device tensor here
    n = seq_lens.shape[0]
    return qsl[: n + 1].tolist(), seq_lens.tolist()


def decode_only_tokens(md) -> int | None:
    """The token count of a decode-only batch read from the metadata's host ints alone (no rows built), or None
    when the batch may have a prefill row: MLA metadata without prefills (``num_decode_tokens``), standard
    metadata with ``max_query_len <= 1`` (the real tokens from the build hook's host copy of ``query_start_loc``
    where kept, else ``num_actual_tokens``)."""
    if hasattr(md, "num_decode_tokens") and hasattr(md, "num_prefills") and hasattr(md, "prefill"):  # MLA, FlashInfer
        return int(md.num_decode_tokens) if not md.num_prefills or md.prefill is None else None
    if getattr(md, "max_query_len", 2) > 1:
        return None
    host = getattr(md, _HOST, None)
    return host[0][-1] if host is not None else int(md.num_actual_tokens)


def standard_rows(md, dcp_world_size: int = 1) -> StepRows | None:
    """The rows of a standard backend's metadata (host-side only), kept on ``md``; None when the metadata holds
    no host copy of ``query_start_loc`` and ``seq_lens`` (module docstring)."""
    rows = _kept(md)
    if rows is not None:
        return rows
    lists = _lists(md)
    if lists is None:
        return None
    qsl, seq_lens = lists
    query_lens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
    context = [max(s - q, 0) for s, q in zip(seq_lens, query_lens)]
    return _keep(md, StepRows(query_lens, context, dcp_world_size))


def mla_rows(md, dcp_world_size: int = 1) -> StepRows | None:
    """The rows of vLLM's MLA metadata (``MLACommonMetadata``), kept on ``md``: decode rows ``[0, D)``, then per
    prefill its query length (``prefill.query_lens_cpu``) and cached context (``prefill.chunked_context
    .context_lens_list``; 0 without). None when a prefill part lacks its host query lengths."""
    rows = _kept(md)
    if rows is not None:
        return rows
    decode = int(md.num_decode_tokens)
    prefill = getattr(md, "prefill", None)  # absent from some platforms' sparse MLA metadata
    if prefill is None or not getattr(md, "num_prefills", 0):
        return _keep(md, StepRows.decode_first(decode, [], [], dcp_world_size))
    lens = getattr(prefill, "query_lens_cpu", None)
    if not isinstance(lens, torch.Tensor) or lens.device.type != "cpu":
        return None
    query_lens = lens.tolist()
    chunked = prefill.chunked_context
    context_lens = list(chunked.context_lens_list) if chunked is not None else [0] * len(query_lens)
    return _keep(md, StepRows.decode_first(decode, query_lens, context_lens, dcp_world_size))


def attach(md, common) -> None:
    """Keep the host copies of ``common`` (vLLM's ``CommonAttentionMetadata``: ``query_start_loc_cpu``,
    ``seq_lens_cpu_upper_bound``, ``num_reqs``) on the backend metadata ``md`` built from it, and for metadata
    without a ``block_table`` of its own (FlashInfer's) a reference to the batch's block table
    (``block_table_tensor``, a device tensor; not read here: :func:`block_table`). Nothing is kept when ``common``
    has no host copy of the sequence lengths."""
    qsl, seq_lens = getattr(common, "query_start_loc_cpu", None), getattr(common, "seq_lens_cpu_upper_bound", None)
    if not isinstance(qsl, torch.Tensor) or not isinstance(seq_lens, torch.Tensor):
        return
    n = int(common.num_reqs)
    try:
        setattr(md, _HOST, (qsl[: n + 1].tolist(), seq_lens[:n].tolist()))
        table = getattr(common, "block_table_tensor", None)
        if getattr(md, "block_table", None) is None and isinstance(table, torch.Tensor):
            setattr(md, _BLOCK_TABLE, table)
        lens = getattr(common, "seq_lens", None)
        if getattr(md, "seq_lens", None) is None and isinstance(lens, torch.Tensor):
            setattr(md, _SEQ_LENS, lens)
    except AttributeError:
        pass


def block_table(md):
    """The batch's block table ``[num_reqs, max_blocks]`` (request ``i``'s ``j``-th block): the metadata's own
    ``block_table`` (FLASH_ATTN, CPU_ATTN), else the one the build hook kept (:func:`attach`; FlashInfer's
    metadata holds only per-phase slices or planned page lists), else None."""
    table = getattr(md, "block_table", None)
    return table if table is not None else getattr(md, _BLOCK_TABLE, None)


def seq_lens(md):
    """The batch's sequence lengths ``[num_reqs(+padding)]`` (int32, on the device: exact for every request, decode
    requests included): the metadata's own ``seq_lens`` (FLASH_ATTN, CPU_ATTN), else the one the build hook kept
    (``CommonAttentionMetadata.seq_lens``, :func:`attach`; FlashInfer), else None. Never read on the host."""
    lens = getattr(md, "seq_lens", None)
    return lens if lens is not None else getattr(md, _SEQ_LENS, None)


@functools.lru_cache(maxsize=None)
def install_build_hook(builder_cls) -> bool:
    """Wrap ``builder_cls.build`` (a vLLM ``AttentionMetadataBuilder``; once per class) so that the metadata it
    builds keeps its batch's host copies (:func:`attach`). Returns True once installed."""
    build = builder_cls.build

    @functools.wraps(build)
    def build_keeping_host_rows(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        md = build(self, common_prefix_len, common_attn_metadata, *args, **kwargs)
        attach(md, common_attn_metadata)
        return md

    build_keeping_host_rows.__fusion_pass_hook__ = True
    builder_cls.build = build_keeping_host_rows
    return True


def device_index(values, device) -> torch.Tensor:
    """``values`` (host ints, or a CPU tensor) as an int64 index tensor on ``device``; to a CUDA device through
    pinned memory, without blocking the host (no synchronization)."""
    return to_device(values, torch.long, device)


def request_rows(rows, requests, device):
    """The rows of ``requests`` (one new token each: decode requests) as a slice when they are adjacent, else as
    an index tensor on ``device``."""
    first = rows.starts[requests[0]]
    if all(rows.starts[r] == first + i for i, r in enumerate(requests)):
        return slice(first, first + len(requests))
    return device_index([rows.starts[r] for r in requests], device)


def requests_index(requests, device):
    """Request indices (e.g. rows of a block table) as a slice when adjacent, else an index tensor."""
    if requests == tuple(range(requests[0], requests[0] + len(requests))):
        return slice(requests[0], requests[0] + len(requests))
    return device_index(list(requests), device)
