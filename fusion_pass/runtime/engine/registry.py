"""The attention-layer registry: ``layer_name`` -> the runtime object holding that layer's weights and KV cache.

The attention ops only receive tensors and a ``layer_name``; they find the layer here
(:class:`~fusion_pass.runtime.MLAAttentionImpl` or :class:`~fusion_pass.runtime.AttentionImpl`, registered by
the demo layers when they are built). Names are global to the process: building a second model with the
same layer names needs :func:`unregister_layer` (or the demo models' ``release_layers``) first.
"""

from __future__ import annotations

import threading
from typing import Any

from fusion_pass.nvfp4 import ArgumentError
from fusion_pass.runtime import counters

__all__ = [
    "UnknownLayerError",
    "register_layer",
    "get_layer",
    "unregister_layer",
    "registered_layers",
    "clear_kv_caches",
    "snapshot_kv_caches",
    "restore_kv_caches",
]


class UnknownLayerError(KeyError, ArgumentError):
    """No layer is registered under the name given: a ``KeyError`` (what :func:`get_layer` always raised) and a
    ``ValueError`` (an :class:`~fusion_pass.nvfp4.ArgumentError`, the project's bad-argument error, also a
    ``TypeError``). Its message reads as written (a plain ``KeyError`` would quote it)."""

    __str__ = BaseException.__str__


_layers: dict[str, Any] = {}
_layers_lock = threading.Lock()


def register_layer(name: str, impl: Any) -> None:
    """Register ``impl`` under ``name``; re-registering the same object is a no-op. A new layer under a name
    starts the name's run-time counts afresh (:func:`fusion_pass.runtime.counters.forget_layer`)."""
    if not isinstance(name, str) or not name:
        raise ArgumentError(f"register_layer: name (the layer name) must be a non-empty str, got "
                            f"{type(name).__name__} {name!r}")
    with _layers_lock:
        existing = _layers.get(name)
        if existing is not None and existing is not impl:
            raise ValueError(
                f"layer name {name!r} is already registered to a different "
                f"{type(existing).__name__}; unregister_layer({name!r}) first"
            )
        _layers[name] = impl
    if existing is None:
        counters.forget_layer(name)


def get_layer(name: str) -> Any:
    """The impl registered under ``name`` (:class:`UnknownLayerError`, a KeyError and a ValueError, listing some
    known names)."""
    with _layers_lock:
        impl = _layers.get(name)
        if impl is not None:
            return impl
        names = sorted(_layers)
    shown = ", ".join(repr(n) for n in names[:8]) or "none"
    more = f" and {len(names) - 8} more" if len(names) > 8 else ""
    raise UnknownLayerError(f"no attention layer registered as {name!r}; registered: {shown}{more}")


def unregister_layer(name: str) -> None:
    """Remove ``name`` from the registry (:class:`UnknownLayerError`, a KeyError and a ValueError, if it is
    not registered)."""
    with _layers_lock:
        if name not in _layers:
            raise UnknownLayerError(f"no attention layer registered as {name!r}")
        del _layers[name]


def registered_layers() -> dict[str, Any]:
    """A copy of the registry: ``{layer_name: impl}``."""
    with _layers_lock:
        return dict(_layers)


def clear_kv_caches() -> None:
    """Call ``clear_cache()`` on every registered impl."""
    for impl in registered_layers().values():
        impl.clear_cache()


def snapshot_kv_caches() -> dict[str, dict]:
    """The KV caches of every registered layer, to :func:`restore_kv_caches` later.

    MLA's entries are never modified in place (a step replaces them), so the
    snapshot shares their tensors; a standard layer's paged cache is written in
    place, so its tokens are copied out of the pages.
    """
    return {name: impl.cache.entries() for name, impl in registered_layers().items()}


def restore_kv_caches(snapshot: dict[str, dict]) -> None:
    """Put the caches back as :func:`snapshot_kv_caches` saw them."""
    for name, entries in snapshot.items():
        get_layer(name).cache.restore(entries)

