"""Cached context read from a standard backend's paged KV cache through the block table: what every standard
adapter's ``block_size`` and ``gather`` are for."""

from __future__ import annotations

import torch

from fusion_pass.vllm.adapters import host_rows

__all__ = ["context_source"]


def context_source(adapter, layer, md, rows, kv_cache):
    """The prefills' cached context as :data:`fusion_pass.runtime.cache.ContextRows`: rows ``[lo, hi)`` of the
    keys and values of positions ``0 .. context_len`` of each prefill (in order) with context, read from the
    paged cache through the prefill's row of the block table (``md.block_table[request, p // block_size]``, or the
    one the build hook kept: :func:`fusion_pass.vllm.adapters.host_rows.block_table`; offset ``p % block_size``) in
    the backend's layout (``adapter.gather``). Indices are computed on the host and moved without
    synchronization."""
    table = host_rows.block_table(md)
    requests = [i for i in rows.prefill if rows.context_lens[i]]
    lens = torch.tensor([rows.context_lens[i] for i in requests], dtype=torch.long)
    ends = torch.cumsum(lens, 0)
    request_of = torch.tensor(requests, dtype=torch.long)
    block_size = adapter.block_size(kv_cache)

    def context(lo: int, hi: int):
        packed = torch.arange(lo, hi)
        which = torch.searchsorted(ends, packed, right=True)
        position = packed - (ends - lens)[which]
        table_rows = host_rows.device_index(request_of[which], table.device)
        columns = host_rows.device_index(position // block_size, table.device)
        blocks = table[table_rows, columns].long().to(kv_cache.device)
        offsets = host_rows.device_index(position % block_size, kv_cache.device)
        return adapter.gather(layer, kv_cache, blocks, offsets)

    return context
