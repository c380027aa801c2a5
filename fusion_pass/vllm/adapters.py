"""Per-backend adapters for vLLM's standard (non-MLA) attention layers, and what they share.

A standard layer's fused call needs three things its backend defines: the batch's rows on the host (vLLM's
host copies, kept by a hook on the backend's metadata builder: :func:`fusion_pass.vllm.host_rows.install_build_hook`),
the cached keys and values of prefills with context (the backend's paged KV cache layout), and the decode rows
computed by the backend itself on the decode requests alone (a sub-batch of its metadata), so that their bytes
are the unfused graph's. An adapter supplies the last two:

* ``decode_refusal(layer, md)``: why the adapter cannot compute this batch's decode rows apart, or None;
* ``context_refusal(layer, kv_cache)``: why it cannot read this layer's cache, or None;
* ``gather(layer, kv_cache, blocks, offsets)``: keys and values ``[S, Hk, D]`` of cache slots ``(block, offset)``;
* ``run_decode(layer, md, rows, q, k, v, kv_cache, out)``: vLLM's attention of the decode rows into ``out``.

Adapters exist for ``CPU_ATTN`` (:mod:`.cpu_attn_adapter`, tested end to end) and ``FLASH_ATTN``
(:mod:`.flash_attn_adapter`, written against vLLM 0.32's source, not run on CUDA). A layer on any other backend
takes the exact fallback for every batch with a prefill row, reason ``no_decode_adapter:<BACKEND>``.
"""

from __future__ import annotations

import importlib
import logging

import torch

from fusion_pass.vllm import cpu_attn_adapter, flash_attn_adapter, host_rows

__all__ = ["ADAPTERS", "adapter_for", "backend_name", "context_source", "install_host_hooks"]

logger = logging.getLogger("vllm.fusion_pass")

ADAPTERS = {a.NAME: a for a in (cpu_attn_adapter.CpuAttnAdapter(), flash_attn_adapter.FlashAttnAdapter())}
"""vLLM attention backend name (``AttentionBackend.get_name()``) -> its adapter."""


def backend_name(layer) -> str:
    """The name of the layer's vLLM attention backend (``layer.attn_backend.get_name()``), else its impl's class."""
    backend = getattr(layer, "attn_backend", None)
    if backend is not None and hasattr(backend, "get_name"):
        return str(backend.get_name())
    return type(getattr(layer, "impl", None)).__name__


def adapter_for(layer):
    """``(adapter or None, backend name)`` of a standard layer."""
    name = backend_name(layer)
    return ADAPTERS.get(name), name


def install_host_hooks() -> list[str]:
    """Install the host-rows hook on the metadata builder of every adapted backend whose module imports in this
    process (vLLM's CPU build has no FlashAttention). Returns the backends hooked."""
    hooked = []
    for name, adapter in ADAPTERS.items():
        module, cls = adapter.BUILDER
        try:
            builder = getattr(importlib.import_module(module), cls)
        except Exception as exc:  # backend not built into this vLLM
            logger.debug("fusion_pass: no %s metadata builder to hook (%s: %s)", name, type(exc).__name__, exc)
            continue
        host_rows.install_build_hook(builder)
        hooked.append(name)
    return hooked


def context_source(adapter, layer, md, rows, kv_cache):
    """The prefills' cached context as :data:`fusion_pass.runtime.cache.ContextRows`: rows ``[lo, hi)`` of the
    keys and values of positions ``0 .. context_len`` of each prefill (in order) with context, read from the
    paged cache through the prefill's row of the block table (``md.block_table[request, p // block_size]``,
    offset ``p % block_size``) in the backend's layout (``adapter.gather``). Indices are computed on the host and
    moved without synchronization."""
    requests = [i for i in rows.prefill if rows.context_lens[i]]
    lens = torch.tensor([rows.context_lens[i] for i in requests], dtype=torch.long)
    ends = torch.cumsum(lens, 0)
    request_of = torch.tensor(requests, dtype=torch.long)
    block_size = adapter.block_size(kv_cache)

    def context(lo: int, hi: int):
        packed = torch.arange(lo, hi)
        which = torch.searchsorted(ends, packed, right=True)
        position = packed - (ends - lens)[which]
        table_rows = host_rows.device_index(request_of[which], md.block_table.device)
        columns = host_rows.device_index(position // block_size, md.block_table.device)
        blocks = md.block_table[table_rows, columns].long().to(kv_cache.device)
        offsets = host_rows.device_index(position % block_size, kv_cache.device)
        return adapter.gather(layer, kv_cache, blocks, offsets)

    return context
