"""The fused backends: one table, in ``auto``'s order of preference. Every list of backends derives from it.

* the backend setting's choices: ``auto`` + :func:`names` (:data:`fusion_pass.runtime.settings.BACKEND_CHOICES`);
* ``auto``'s order and the choice of one for a layer: :mod:`.selection` (``BACKEND_ORDER``, ``select_backend``,
  ``list_backends``, ``get_backend``);
* what :func:`refresh` forgets: each backend's own ``refresh()``;
* what ``fusion-pass selftest`` times: the backends with ``timed`` (:func:`timed_names`).

What the run time needs to know of a backend is an attribute or a method of the backend object
(:class:`.base.Backend`): its kernels (``run_varlen``, ``attention_lse``, ``merge_nvfp4``, ``run_paged``, the
half-precision ``half_attention`` of the unfused path) as callables, ``timed``, ``refresh()``, its self-check.
Nothing compares a backend's name to pick code.

A new backend is one module beside :mod:`.fa4`, :mod:`.triton` and :mod:`.reference` (a class with the
attributes of :class:`.base.Backend`; :class:`.base.KernelBackend` supplies the defaults) plus one line of
:data:`BACKENDS`, where its position is its place in ``auto``'s order.
"""

from __future__ import annotations

from fusion_pass.runtime.backends.base import Backend
from fusion_pass.runtime.backends.fa4 import FA4Backend
from fusion_pass.runtime.backends.reference import ReferenceBackend
from fusion_pass.runtime.backends.triton import TritonBackend

__all__ = ["BACKENDS", "get", "names", "refresh", "timed_names"]

BACKENDS: tuple[Backend, ...] = (
    FA4Backend(),        # FA4 + the NVFP4 output stage: auto's pick where this project built a kernel (SM90, SM100)
    TritonBackend(),     # the Triton flash attention + NVFP4 epilogue: any CUDA GPU it supports, when named
    ReferenceBackend(),  # PyTorch float32 + the reference quantizer: any device, the CPU path and the oracle
)
"""Every fused backend, in ``auto``'s order of preference."""

_BY_NAME: dict[str, Backend] = {backend.name: backend for backend in BACKENDS}
assert len(_BY_NAME) == len(BACKENDS), "two backends of one name"


def names() -> tuple[str, ...]:
    """The backends' names, in ``auto``'s order."""
    return tuple(backend.name for backend in BACKENDS)


def get(name: str) -> Backend:
    """The backend named ``name``; ValueError naming the backends for another name."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown backend {name!r}; backends: {', '.join(names())}") from None


def timed_names() -> tuple[str, ...]:
    """The backends ``fusion-pass selftest`` times against the unfused path (``timed``), in order."""
    return tuple(backend.name for backend in BACKENDS if backend.timed)


def refresh() -> None:
    """Every backend forgets its cached availability (its ``refresh()``); the next query detects again."""
    for backend in BACKENDS:
        backend.refresh()
