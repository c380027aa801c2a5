"""The attention-backend adapters by name: one line per adapter (:data:`ADAPTERS`), how a layer finds its
adapter (:func:`adapter_for`), and the host-rows hooks their metadata builders get (:func:`install_host_hooks`).

Adding a backend = one module implementing :class:`fusion_pass.vllm.adapters.base.BackendAdapter` + one line in
:data:`ADAPTERS`. Adapters: ``MLA`` (every MLA backend, :mod:`.mla`), ``CPU_ATTN`` (:mod:`.cpu_attn`, tested end to end
on vLLM's CPU build), ``FLASH_ATTN`` (:mod:`.flash_attn`) and ``FLASHINFER`` (:mod:`.flashinfer`), the last two
tested with stand-in metadata (no CUDA vLLM here). A standard layer on any other backend takes the exact fallback
for every call with a prefill row, reason ``no_decode_adapter:<BACKEND>``.
"""

from __future__ import annotations

import importlib
import logging

from fusion_pass.vllm.adapters import cpu_attn, flash_attn, flashinfer, host_rows, mla

__all__ = ["ADAPTERS", "MLA", "adapter_for", "backend_name", "install_host_hooks"]

logger = logging.getLogger("vllm.fusion_pass")

MLA = mla.MlaAdapter()
"""The adapter of every MLA layer, whatever its MLA backend."""

ADAPTERS = {a.NAME: a for a in (
    cpu_attn.CpuAttnAdapter(),
    flash_attn.FlashAttnAdapter(),
    flashinfer.FlashInferAdapter(),
)}
"""vLLM attention backend name (``AttentionBackend.get_name()``) -> the adapter of its standard layers."""


def backend_name(layer) -> str:
    """The name of the layer's vLLM attention backend (``layer.attn_backend.get_name()``), else its impl's class."""
    backend = getattr(layer, "attn_backend", None)
    if backend is not None and hasattr(backend, "get_name"):
        return str(backend.get_name())
    return type(getattr(layer, "impl", None)).__name__


def adapter_for(layer):
    """``(adapter or None, backend name)`` of a layer: :data:`MLA` for an MLA layer."""
    if mla.is_mla(layer):
        return MLA, MLA.NAME
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
