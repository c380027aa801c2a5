"""The adapter for vLLM's CUDA FlashAttention backend (``FLASH_ATTN``, ``vllm/v1/attention/backends/flash_attn.py``).

Written against vLLM 0.32.0's source (the names it reads are checked in the 0.32-0.34 wheels by
tests_vllm_conformance); **not run on CUDA** (tested with a stand-in backend that records the
sub-batch it is given: ``tests_vllm/test_vllm_standard_op.py``).

Metadata (``FlashAttentionMetadata``): ``num_actual_tokens``, ``max_query_len``, ``query_start_loc``,
``max_seq_len``, ``seq_lens``, ``block_table``, ``slot_mapping`` (device tensors), FA3's ahead-of-time schedule
``scheduler_metadata`` and ``max_num_splits``, ``causal``, and fields of features the adapter refuses (DCP,
PrefixLM ranges ``mm_prefix_query_range_tensor``, R-SWA ``rswa_prefix_lens``). The builder keeps no host copy of
the batch: the host rows come from the build hook (:func:`fusion_pass.vllm.adapters.host_rows.install_build_hook`).

* Cache: the layer's cache is logically ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (any physical
  stride order); ``FlashAttentionImpl.forward`` reads it as ``kv_cache.transpose(1, 2).split(head_size, -1)``:
  keys and values ``[num_blocks, block_size, num_kv_heads, head_size]``, and so does :meth:`FlashAttnAdapter.gather`.
* Decode rows: ``impl.forward`` on a shallow copy of the metadata holding the decode requests only:
  ``query_start_loc = arange(D + 1)``, their ``seq_lens`` and ``block_table`` rows, ``max_query_len = 1``,
  ``num_actual_tokens = D``, ``scheduler_metadata = None`` (FA3's schedule of the whole batch does not describe the
  sub-batch; FA computes its own), ``max_num_splits`` of the whole batch. Index tensors reach the device through
  pinned memory (no synchronization); adjacent requests are sliced.

To check on an H200: FlashAttention chooses the number of KV splits of a decode row from the launch's whole work
(``num_splits=0``: its heuristics; FA3's dynamic per-request splits), and a row summed in another number of splits
rounds differently. The decode rows of the sub-batch equal those of the whole batch when both launches split a
decode request's keys the same way; a batch where they do not would show in the byte comparison of the decode rows
against vLLM's op on the whole batch (what ``tests_vllm/test_vllm_engine.py`` checks on the CPU build).
"""

from __future__ import annotations

import copy

import torch

from fusion_pass.vllm.adapters.paged import PagedKVCache
from fusion_pass.vllm.adapters.host_rows import request_rows, requests_index, standard_rows

__all__ = ["FlashAttnAdapter"]


class FlashAttnAdapter(PagedKVCache):
    """vLLM's ``FLASH_ATTN`` backend (module docstring)."""

    NAME = "FLASH_ATTN"
    BUILDER = ("vllm.v1.attention.backends.flash_attn", "FlashAttentionMetadataBuilder")
    SPLITS_MIXED = False  # one launch attends every row of a call

    @staticmethod
    def rows(md, dcp_world_size: int):
        return standard_rows(md, dcp_world_size)

    @staticmethod
    def one_call_refusal(layer, md) -> str | None:
        return FlashAttnAdapter.decode_refusal(layer, md)

    @staticmethod
    def decode_refusal(layer, md) -> str | None:
        if getattr(md, "causal", True) is not True:
            return "FLASH_ATTN metadata with per-request causal masks"
        for name in ("mm_prefix_query_range_tensor", "rswa_prefix_lens", "dcp_context_kv_lens"):
            if getattr(md, name, None) is not None:
                return f"FLASH_ATTN metadata with {name} (the decode sub-batch would not carry it)"
        return None

    def _sub_batch(self, md, rows, q):
        """(metadata of the decode requests alone, their rows), once per step."""
        memo = rows.memo.get(self.NAME)
        if memo is None:
            requests = rows.decode
            device = md.seq_lens.device
            index = requests_index(requests, device)
            sub = copy.copy(md)
            sub.num_actual_tokens = len(requests)
            sub.max_query_len = 1
            sub.query_start_loc = torch.arange(len(requests) + 1, dtype=md.query_start_loc.dtype,
                                               device=md.query_start_loc.device)
            sub.seq_lens = md.seq_lens[index]
            sub.block_table = md.block_table[index]
            sub.slot_mapping = md.slot_mapping[request_rows(rows, requests, md.slot_mapping.device)]
            sub.scheduler_metadata = None
            memo = rows.memo[self.NAME] = (sub, request_rows(rows, requests, q.device))
        return memo

    def run_decode(self, layer, md, rows, inputs, kv_cache, out) -> str:
        """vLLM's attention of the decode rows into ``out [D, H * Dh]`` (query dtype); ``inputs``: the call's
        ``q [n, H, Dh]``, ``k``, ``v [n, Hk, Dh]``. Returns the method."""
        q, k, v = inputs
        out = out.view(out.shape[0], layer.num_heads, -1)
        sub, index = self._sub_batch(md, rows, q)
        layer.impl.forward(layer, q[index], k[index], v[index], kv_cache, sub, output=out)
        return "sub_batch"
