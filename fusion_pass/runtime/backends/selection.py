"""The choice of a fused backend for a layer, over the table of :mod:`.registry`.

``auto`` takes the first backend of :data:`BACKEND_ORDER` (the registry's order) that is available (detected once
per process, :func:`refresh` detects again) and supports the layer's device, dtype and head dims; a configured
choice (:mod:`fusion_pass.runtime.settings`) restricts the search to that backend. :func:`list_backends` lists
every backend with its availability and reason (``fusion-pass backends`` prints it). A new backend is a new
module beside :mod:`.fa4`, :mod:`.triton`, :mod:`.reference` and one line of :data:`.registry.BACKENDS`.
"""

from __future__ import annotations

from typing import Any

import torch

from fusion_pass.nvfp4.checks import ArgumentError
from fusion_pass.runtime import settings
from fusion_pass.runtime.backends import registry
from fusion_pass.formats import NVFP4, OutputFormat
from fusion_pass.runtime.backends.base import Backend, format_refusal

__all__ = ["BACKEND_ORDER", "get_backend", "list_backends", "refresh", "select_backend"]

BACKEND_ORDER = registry.names()
"""Preference order used by ``auto``: the registry's (:data:`.registry.BACKENDS`)."""


def get_backend(name: str) -> Backend:
    """The backend object named ``name`` (one of :data:`BACKEND_ORDER`)."""
    return registry.get(name)


def _device_argument(fn: str, device: Any) -> torch.device:
    """``device`` (a ``torch.device`` or a device string such as ``"cuda"``, ``"cuda:1"``, ``"cpu"``) as a
    ``torch.device``; else ArgumentError naming ``fn``'s ``device``."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError:
            raise ArgumentError(f"{fn}: device must be a torch.device or a device string such as 'cuda', 'cuda:0' or "
                                f"'cpu', got str {device!r}") from None
    raise ArgumentError(f"{fn}: device must be a torch.device or a device string such as 'cuda', 'cuda:0' or 'cpu', "
                        f"got {type(device).__name__} {device!r}")


def default_device() -> torch.device:
    """The device a layer on this machine most likely runs on: the current CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def list_backends(device: torch.device | str | None = None) -> list[dict[str, Any]]:
    """One entry per backend, in preference order: ``{"name", "available", "reason", "auto", "auto_reason"}``:
    whether it runs here and why, and whether ``auto`` may pick it on ``device`` (default
    :func:`default_device`) and why (:meth:`~fusion_pass.runtime.backends.base.Backend.fast_on`)."""
    device = default_device() if device is None else _device_argument("list_backends", device)
    result = []
    for backend in registry.BACKENDS:
        ok, reason = backend.available()
        fast, why = backend.fast_on(device) if ok else (False, "unavailable")
        result.append({"name": backend.name, "available": ok, "reason": reason, "auto": fast, "auto_reason": why})
    return result


def select_backend(
    device: torch.device | str,
    dtype: torch.dtype,
    num_heads: int,
    qk_head_dim: int,
    v_head_dim: int,
    *,
    preferred: str | None = None,
    fast_only: bool = True,
    output_format: OutputFormat = NVFP4,
) -> tuple[Backend | None, str]:
    """The first available backend that supports the layer and writes ``output_format`` (a
    :class:`fusion_pass.formats.OutputFormat`; its ``formats``, :func:`.base.writes`), and why.

    ``preferred`` (a backend name, or ``"auto"``) overrides the configured
    choice (:func:`fusion_pass.runtime.settings.configured_backend`); a named choice restricts the search to
    that backend and runs it wherever it works. ``auto`` takes only a backend that is fast on the device
    (:meth:`~fusion_pass.runtime.backends.base.Backend.fast_on`: measured faster than the unfused path on
    that GPU generation, or the kernel built for it), unless ``fast_only`` is False. Returns
    ``(backend, its description)`` or ``(None, reasons)`` with one ``"name: why"`` per backend tried, joined
    by ``"; "``.
    """
    choice = settings.configured_backend() if preferred is None else _preferred(preferred)
    candidates = registry.BACKENDS if choice == "auto" else (registry.get(choice),)
    device = torch.device(device)
    reasons = []
    for backend in candidates:
        ok, why = backend.available()
        if ok:
            refusal = format_refusal(backend, output_format)
            ok, unsupported = (True, "") if refusal is None else (False, refusal)
            if ok:  # the format's own constraints on the layer are the backend's to say (NVFP4: the plain call)
                shape = (device, dtype, num_heads, qk_head_dim, v_head_dim)
                ok, unsupported = (backend.supports(*shape) if output_format is NVFP4
                                   else backend.supports(*shape, output_format=output_format))
            if ok and choice == "auto" and fast_only:
                ok, unsupported = backend.fast_on(device)
                unsupported = f"not picked by auto: {unsupported}"
            if ok:
                return backend, why
            why = unsupported
        reasons.append(f"{backend.name}: {why}")
    return None, "; ".join(reasons)


def refresh() -> None:
    """Forget the cached availability results; the next query detects again (:func:`.registry.refresh`)."""
    registry.refresh()


def _preferred(name: str) -> str:
    value = name.strip().lower() if isinstance(name, str) else name
    if value not in settings.BACKEND_CHOICES:
        raise ValueError(f"preferred={name!r} is not a backend; choose one of {', '.join(settings.BACKEND_CHOICES)}")
    return value
