"""The adapter for vLLM's CPU attention backend (``CPU_ATTN``, ``vllm/v1/attention/backends/cpu_attn.py``).

Metadata (``CPUAttentionMetadata``): ``query_start_loc``, ``seq_lens``, ``block_table`` (host tensors on the CPU),
``scheduler_metadata`` (the work split over threads that ``cpu_attn_get_scheduler_metadata`` computed for the whole
batch), ``causal``, ``dynamic_causal``. The layer's cache is ``[num_blocks, num_kv_heads, block_size, 2 *
head_size]``; inside one block and head, vLLM's CPU kernels store keys and values in an ISA-specific order (the
layer's ``isa``: ``amx``, ``vec``, ``vec16``, ...).

* Cache layout: learned once per (ISA, dtype, kv heads, block size, head size) from the backend itself: position
  codes written through the layer's own ``impl.do_kv_cache_update`` into a one-block scratch cache and read back
  (:func:`probe_layout`), then checked on random keys and values. A layout that does not read back is refused
  (``context_refusal``).
* Decode rows: vLLM's ``impl.forward`` on a sub-batch of the decode requests (their ``query_start_loc``,
  ``seq_lens`` and ``block_table`` rows, a schedule computed for them). vLLM's scheduler may split one request's
  keys over threads (``VLLM_CPU_ATTN_SPLIT_KV``, on by default), depending on the whole batch's work, and a split
  request's row is summed in another order. So the sub-batch is scheduled without splits, and it is used only when
  the whole batch's schedule split no request (its header's reduction count is 0: :func:`schedule_split`); then
  each decode row is computed as in the whole batch. Otherwise, or when the header does not read as expected,
  the decode rows are taken from ``impl.forward`` on the whole batch (its prefill rows computed and discarded),
  exact by construction; that method is counted in :data:`DECODE_METHODS` and logged once.
"""

from __future__ import annotations

import copy
import logging

import torch

from fusion_pass.vllm import releases
from fusion_pass.vllm.adapters.paged import PagedKVCache
from fusion_pass.vllm.adapters.host_rows import request_rows, requests_index, standard_rows

__all__ = ["DECODE_METHODS", "CpuAttnAdapter", "probe_layout", "schedule_split"]

logger = logging.getLogger("vllm.fusion_pass")

DECODE_METHODS = {"sub_batch": 0, "whole_batch": 0}
"""How the decode rows of fused calls were computed in this process (calls)."""

_HEADER = slice(64, 92)
"""Bytes of the CPU scheduler's metadata header read by :func:`schedule_split`: after an 8-byte counter and 56 bytes
of padding, int32 ``isa, workitem_group_num, reduction_item_num, reduction_split_num, thread_num,
effective_thread_num, split_kv_q_token_num_threshold`` (vLLM's ``csrc/cpu/cpu_attn_impl.hpp``, ``AttentionMetadata``)."""

_layouts: dict = {}


def schedule_split(md) -> bool:
    """Whether vLLM's schedule of the whole batch splits a request's keys over threads, or cannot be read (True:
    the decode rows must come from the whole batch)."""
    sm = getattr(md, "scheduler_metadata", None)
    if not isinstance(sm, torch.Tensor) or sm.dtype != torch.int8 or sm.device.type != "cpu" or sm.numel() < 92:
        return True
    isa, groups, reductions, _, threads, effective, threshold = sm[_HEADER].view(torch.int32).tolist()
    plausible = (0 <= isa < 32 and 1 <= threads <= 1024 and 0 <= effective <= threads and 0 <= reductions <= groups
                 and threshold in (0, 1))
    return not plausible or reductions > 0


def probe_layout(layer, dtype, kv_heads: int, block_size: int, head_size: int):
    """``(keys, values)`` int64 ``[block_size, kv_heads, head_size]``: where token ``t``'s element ``d`` of head
    ``h`` lies among the ``2 * block_size * head_size`` elements of one block and head, as the layer's own cache
    write (``layer.impl.do_kv_cache_update``) puts it; or a string saying why it could not be learned."""
    n = block_size * head_size
    code = torch.arange(n).view(block_size, 1, head_size).expand(block_size, kv_heads, head_size)
    slots = torch.arange(block_size)
    scratch = torch.zeros(1, kv_heads, block_size, 2 * head_size, dtype=dtype)
    decoded = torch.zeros(kv_heads, 2 * n, dtype=torch.long)
    is_value = None
    try:
        for j in range(max(1, -(-(n - 1).bit_length() // 4))):  # base-16 digits, 1..16 keys, 17..32 values
            digit = (code >> (4 * j)) & 15
            scratch.zero_()
            layer.impl.do_kv_cache_update(layer, (digit + 1).to(dtype), (digit + 17).to(dtype), scratch, slots)
            got = scratch.view(kv_heads, 2 * n).float().round().long()
            if ((got < 1) | (got > 32)).any():
                return "the CPU cache write left elements of a block unwritten or changed the values written"
            value = got > 16
            if is_value is None:
                is_value = value
            elif not torch.equal(is_value, value):
                return "the CPU cache write put keys and values in different places on different writes"
            decoded += ((got - 1) % 16) << (4 * j)
        perms = []
        for kind in (~is_value, is_value):
            perm = torch.full((kv_heads, n), -1, dtype=torch.long)
            for h in range(kv_heads):
                where = kind[h].nonzero().flatten()
                if where.numel() != n or not torch.equal(decoded[h, where].sort().values, torch.arange(n)):
                    return "the CPU cache write does not place every key and value element exactly once"
                perm[h, decoded[h, where]] = where
            perms.append(perm.view(kv_heads, block_size, head_size).permute(1, 0, 2).contiguous())
        keys = torch.randn(block_size, kv_heads, head_size).to(dtype)
        values = torch.randn(block_size, kv_heads, head_size).to(dtype)
        order = torch.randperm(block_size)
        layer.impl.do_kv_cache_update(layer, keys, values, scratch, order)
        flat = scratch.flatten(2)[0]
        heads = torch.arange(kv_heads)[None, :, None]
        if not (torch.equal(flat[heads, perms[0][order]], keys) and torch.equal(flat[heads, perms[1][order]], values)):
            return "keys and values read back through the learned CPU cache layout differ from those written"
    except Exception as exc:  # a backend that cannot be probed: its cache is not read
        return f"the CPU cache layout could not be learned ({type(exc).__name__}: {exc})"
    return perms[0], perms[1]


class CpuAttnAdapter(PagedKVCache):
    """vLLM's ``CPU_ATTN`` backend (module docstring)."""

    NAME = "CPU_ATTN"
    BUILDER = ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionMetadataBuilder")
    SPLITS_MIXED = False  # one launch attends every row of a call
    CACHE_DTYPES = None  # whatever the layout probe reads back (probe_layout)

    @staticmethod
    def rows(md, dcp_world_size: int):
        return standard_rows(md, dcp_world_size)

    def _layout(self, layer, kv_cache):
        key = (getattr(layer, "isa", None), kv_cache.dtype, kv_cache.shape[1], kv_cache.shape[2], kv_cache.shape[3] // 2)
        if key not in _layouts:
            _layouts[key] = probe_layout(layer, *key[1:])
        return _layouts[key]

    def context_refusal(self, layer, kv_cache) -> str | None:
        shape = super().context_refusal(layer, kv_cache)
        if shape is not None:
            return shape
        d = layer.impl.head_size
        if kv_cache.stride(3) != 1 or kv_cache.stride(2) != 2 * d:
            return f"KV cache strides {kv_cache.stride()}: a block's keys and values are not contiguous per head"
        layout = self._layout(layer, kv_cache)
        return layout if isinstance(layout, str) else None

    def gather(self, layer, kv_cache, blocks, offsets):
        keys, values = self._layout(layer, kv_cache)
        flat = kv_cache.flatten(2)
        heads = torch.arange(kv_cache.shape[1], device=kv_cache.device)[None, :, None]
        b = blocks[:, None, None]
        return flat[b, heads, keys[offsets]], flat[b, heads, values[offsets]]

    @staticmethod
    def one_call_refusal(layer, md) -> str | None:
        if getattr(md, "dynamic_causal", None) is not None:
            return "CPU_ATTN metadata with per-request causal masks (dynamic_causal)"
        if getattr(md, "causal", True) is not True:
            return "CPU_ATTN non-causal metadata"
        return None

    def page_views(self, layer, kv_cache, block_table, rows):
        """vLLM's CPU kernels order a block's keys and values by ISA (:func:`probe_layout`), which no strided view
        expresses: the blocks the step's requests use are read through the learned layout into pages ``[n, block_size,
        num_kv_heads, head_size]`` (a copy; the CPU stand-in of the in-place views of FLASH_ATTN and FLASHINFER), and
        the block table is renumbered to them (host tensors on the CPU)."""
        size = self.block_size(kv_cache)
        used = -(-torch.tensor([q + c for q, c in zip(rows.query_lens, rows.context_lens)], dtype=torch.long) // size)
        table = block_table.long()
        columns = torch.arange(table.shape[1])
        mask = columns[None, :] < used[:, None]
        blocks = torch.unique(table[mask]) if mask.any() else torch.zeros(1, dtype=torch.long)
        renumber = torch.zeros(int(table.max().item()) + 1 if table.numel() else 1, dtype=torch.long)
        renumber[blocks] = torch.arange(blocks.numel())
        renumbered = torch.where(mask, renumber[table.clamp(min=0)], 0).to(torch.int32)
        offsets = torch.arange(size)
        keys, values = self.gather(layer, kv_cache, blocks.repeat_interleave(size), offsets.repeat(blocks.numel()))
        shape = (blocks.numel(), size) + tuple(keys.shape[1:])
        return keys.reshape(shape), values.reshape(shape), renumbered.to(block_table.device)

    @staticmethod
    def decode_refusal(layer, md) -> str | None:
        if getattr(md, "dynamic_causal", None) is not None:
            return "CPU_ATTN metadata with per-request causal masks (dynamic_causal)"
        if getattr(layer, "isa", None) is None:
            return "the layer has no CPU attention ISA (set by vLLM's CPU_ATTN metadata builder)"
        return None

    def _sub_batch(self, layer, md, rows, q):
        """(metadata of the decode requests alone, their rows), once per step."""
        memo = rows.memo.get(self.NAME)
        if memo is None:
            scheduler_metadata = releases.resolve("cpu_attn_get_scheduler_metadata")  # moved in 0.34

            impl, requests = layer.impl, rows.decode
            index = requests_index(requests, md.seq_lens.device)
            sub = copy.copy(md)
            sub.num_actual_tokens = sub.num_decode_tokens = len(requests)
            sub.max_query_len = 1
            sub.query_start_loc = torch.arange(len(requests) + 1, dtype=md.query_start_loc.dtype)
            sub.seq_lens = md.seq_lens[index]
            sub.block_table = md.block_table[index]
            sub.max_seq_len = max(rows.context_lens[r] for r in requests) + 1
            sub.scheduler_metadata = scheduler_metadata(
                num_reqs=len(requests), num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
                head_dim=impl.head_size, seq_lens=sub.seq_lens, dtype=q.dtype, query_start_loc=sub.query_start_loc,
                causal=md.causal, sliding_window_size=-1, isa=layer.isa, enable_kv_split=False,
                kv_cache_dtype=impl.kv_cache_dtype)
            memo = rows.memo[self.NAME] = (sub, request_rows(rows, requests, q.device), schedule_split(md))
        return memo

    def run_decode(self, layer, md, rows, inputs, kv_cache, out) -> str:
        """vLLM's attention of the decode rows into ``out [D, H * Dh]`` (query dtype); ``inputs``: the call's
        ``q [n, H, Dh]``, ``k``, ``v [n, Hk, Dh]``. Returns the method."""
        q, k, v = inputs
        out = out.view(out.shape[0], layer.num_heads, -1)
        sub, index, split = self._sub_batch(layer, md, rows, q)
        if split:
            n = rows.num_tokens
            whole = q.new_empty(n, *out.shape[1:])
            layer.impl.forward(layer, q[:n], k[:n], v[:n], kv_cache, md, output=whole)
            out.copy_(whole[index])
            method = "whole_batch"
            if not DECODE_METHODS[method]:
                logger.info("fusion_pass: vLLM's CPU_ATTN schedule split a request's keys over threads: the decode "
                            "rows beside fused prefill rows are taken from vLLM's attention of the whole batch "
                            "(exact; its prefill rows are computed and discarded); further such calls are counted")
        else:
            layer.impl.forward(layer, q[index], k[index], v[index], kv_cache, sub, output=out)
            method = "sub_batch"
        DECODE_METHODS[method] += 1
        return method
