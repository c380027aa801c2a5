"""A standard backend's paged KV cache as the fused path reads it: the whole call handed to one paged launch
(:meth:`PagedKVCache.paged_inputs`: the cache's key and value pages in place, the batch's block table and sequence
lengths), or the cached context of prefills gathered through the block table (:func:`context_source`, the split
path); and the cache those adapters share (:class:`PagedKVCache`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fusion_pass.kernels.host_copy import to_device
from fusion_pass.vllm.adapters import host_rows

__all__ = ["PagedInputs", "PagedKVCache", "context_source"]


class PagedInputs(NamedTuple):
    """What one paged launch over a call reads (``Backend.run_paged``): ``k_pages [num_pages, page_size, Hk, D]``
    and ``v_pages`` (the cache's own storage where the backend's layout allows), ``cu_seqlens`` int32 ``[B+1]``
    (the call's rows of each request), ``seq_lens`` int32 ``[B]`` (each request's keys, new tokens included),
    ``block_table`` int32 ``[B, max_pages]``, and host bounds ``max_query_len`` / ``max_seq_len``."""

    k_pages: torch.Tensor
    v_pages: torch.Tensor
    cu_seqlens: torch.Tensor
    max_query_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_seq_len: int


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

    def one_call_refusal(self, layer, md) -> str | None:
        """What the backend's metadata asks for beyond causal attention over each request's keys (masks,
        prefix ranges, DCP), which one paged launch would not compute; None when nothing."""
        return None

    def paged_refusal(self, layer, md, kv_cache) -> str | None:
        """Why this call cannot be handed to one paged launch (:meth:`paged_inputs`), or None."""
        why = self.context_refusal(layer, kv_cache) or self.one_call_refusal(layer, md)
        if why is not None:
            return why
        if host_rows.block_table(md) is None:
            return f"{self.NAME} metadata without the batch's block table"
        if host_rows.seq_lens(md) is None:
            return f"{self.NAME} metadata without the batch's sequence lengths"
        return None

    def page_views(self, layer, kv_cache, block_table, rows):
        """``(k_pages, v_pages, block_table)``: views of the cache's keys and values ``[num_blocks, block_size,
        num_kv_heads, head_size]`` (no copy) and the block table as given."""
        keys, values = kv_cache.transpose(1, 2).split(layer.impl.head_size, dim=-1)
        return keys, values, block_table

    def paged_inputs(self, layer, md, rows, kv_cache, device) -> PagedInputs:
        """The call as one paged launch reads it (:class:`PagedInputs`; :meth:`paged_refusal` said None): the
        offsets from the step's host rows (moved once per step, without synchronization), the sequence lengths and
        block table of the metadata (device tensors, sliced to the step's requests, never read here)."""
        key = (self.NAME, "paged", device)
        found = rows.memo.get(key)
        if found is None:
            b = len(rows.query_lens)
            offsets = [0]
            for n in rows.query_lens:
                offsets.append(offsets[-1] + n)
            cu = to_device(offsets, torch.int32, device)
            lens = host_rows.seq_lens(md)[:b]
            table = host_rows.block_table(md)[:b]
            max_seq = max((q + c for q, c in zip(rows.query_lens, rows.context_lens)), default=0)
            found = rows.memo[key] = (cu, max(rows.query_lens, default=0), lens, table, max_seq)
        cu, max_q, lens, table, max_seq = found
        k_pages, v_pages, table = self.page_views(layer, kv_cache, table, rows)
        # the host bound may exceed a decode request's real length (vLLM's seq_lens_cpu_upper_bound), never what
        # its block table row can hold: the kernels read the lengths from seq_lens and check the bound against it
        max_seq = min(max_seq, table.shape[1] * k_pages.shape[1])
        return PagedInputs(k_pages, v_pages, cu, max_q, lens, table, max_seq)

    @staticmethod
    def gather(layer, kv_cache, blocks, offsets):
        """Keys and values ``[S, num_kv_heads, head_size]`` of the cache slots ``(blocks[i], offsets[i])``."""
        keys, values = kv_cache.transpose(1, 2).split(layer.impl.head_size, dim=-1)
        return keys[blocks, offsets], values[blocks, offsets]


def context_source(adapter, layer, md, rows, kv_cache):
    """The prefills' cached context as :data:`fusion_pass.runtime.row_plan.ContextRows`: rows ``[lo, hi)`` of the
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
