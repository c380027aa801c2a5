"""Cached context read from a standard backend's paged KV cache through the block table: what every standard
adapter's ``block_size`` and ``gather`` are for (:func:`context_source`), and the cache those adapters share
(:class:`PagedKVCache`)."""

from __future__ import annotations

import torch

from fusion_pass.vllm.adapters import host_rows

__all__ = ["PagedKVCache", "context_source"]


class PagedKVCache:
    """A standard backend's per-layer cache: logically ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` in
    any physical stride order, unquantized (fp16 / bf16), keys then values in the last dim, as vLLM's FLASH_ATTN and
    FLASHINFER backends write it (``kv_cache.transpose(1, 2).split(head_size, -1)``: keys and values ``[num_blocks,
    block_size, num_kv_heads, head_size]``). A backend with another order inside a block overrides :meth:`gather`
    (CPU_ATTN). ``NAME``: the backend's name, for the refusals; ``CACHE_DTYPES``: the cache dtypes read (None:
    any, where the adapter checks its cache otherwise)."""

    NAME = "a standard backend"
    CACHE_DTYPES: tuple | None = (torch.float16, torch.bfloat16)

    @staticmethod
    def block_size(kv_cache) -> int:
        return kv_cache.shape[2]

    def context_refusal(self, layer, kv_cache) -> str | None:
        """Why ``kv_cache`` is not such a cache, or None."""
        d = layer.impl.head_size
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 4 or kv_cache.shape[3] != 2 * d:
            shape = list(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else type(kv_cache).__name__
            return f"KV cache {shape} is not {self.NAME}'s [num_blocks, num_kv_heads, block_size, {2 * d}]"
        if self.CACHE_DTYPES is not None and kv_cache.dtype not in self.CACHE_DTYPES:
            return f"KV cache dtype {kv_cache.dtype} (the fused path reads unquantized keys and values)"
        return None

    @staticmethod
    def gather(layer, kv_cache, blocks, offsets):
        """Keys and values ``[S, num_kv_heads, head_size]`` of the cache slots ``(blocks[i], offsets[i])``."""
        keys, values = kv_cache.transpose(1, 2).split(layer.impl.head_size, dim=-1)
        return keys[blocks, offsets], values[blocks, offsets]


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
