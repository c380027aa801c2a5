"""Which implementation runs a kernel entry point's call (``backend=`` of :mod:`fusion_pass.kernels.api`).

Tensors decide: ``auto`` is FA4's SM90 kernel where it runs for these tensors, else Triton for CUDA
tensors, else the PyTorch reference. This is the kernels' own choice for one call; which fused backend
serves a layer is the run time's (:mod:`fusion_pass.runtime.backends`).
"""

from __future__ import annotations

import functools
import os

from torch import Tensor
import torch

from fusion_pass import fp8, nvfp4
from fusion_pass.kernels.fa4.forward import fa4_usable as fa4_layer_usable
from fusion_pass.kernels.fa4.sm90 import fa4_sm90_usable
from fusion_pass.nvfp4 import ArgumentError

ATTENTION_BACKENDS = ("auto", "triton", "fa4", "reference")
QUANT_BACKENDS = ("auto", "triton", "reference")
MERGE_BACKENDS = QUANT_BACKENDS


def interpreter_enabled() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ---------------------------------------------------------------------------


def check_backend_name(fn: str, backend, names: tuple[str, ...] = ATTENTION_BACKENDS) -> None:
    if backend not in names:
        raise ArgumentError(f"{fn}: backend must be one of {', '.join(names)}, got {backend!r}")


# ---------------------------------------------------------------------------
# backend choice
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    """Whether triton imports (checked once per process)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def triton_usable(device: torch.device) -> tuple[bool, str]:
    if not triton_importable():
        return False, "triton is not installed"
    if device.type == "cuda" or interpreter_enabled():
        return True, "ok"
    return False, f"triton runs on CUDA tensors (or on the CPU with TRITON_INTERPRET=1), got {device} tensors"


def triton_or_reference(fn: str, backend: str, device: torch.device, *, fits: bool = True) -> str:
    """The backend of a ``triton``/``reference`` call: ``auto`` is ``triton`` for CUDA tensors when
    Triton imports and the call ``fits`` its kernel, else ``reference``; a named ``triton`` raises
    (RuntimeError) when Triton cannot run on ``device``. Whether a named ``triton`` fits is the
    caller's to check."""
    if backend == "auto":
        return "triton" if device.type == "cuda" and fits and triton_usable(device)[0] else "reference"
    if backend == "triton":
        ok, why = triton_usable(device)
        if not ok:
            raise RuntimeError(f"{fn}: backend 'triton' is unavailable: {why}")
    return backend


def fa4_usable(q: Tensor, v: Tensor) -> tuple[bool, str]:
    return fa4_layer_usable(q.device, q.dtype, q.shape[1], q.shape[2], v.shape[2])


def choose(fn: str, backend: str, q: Tensor, v: Tensor) -> str:
    """The backend that runs this call; raises with the reason when a named one cannot."""
    check_backend_name(fn, backend)
    if backend == "auto":
        if fa4_usable(q, v)[0]:
            return "fa4"
        return "triton" if q.device.type == "cuda" and triton_usable(q.device)[0] else "reference"
    if backend == "triton":
        ok, why = triton_usable(q.device)
    elif backend == "fa4":
        ok, why = fa4_usable(q, v)
    else:
        ok, why = True, "ok"
    if not ok:
        raise RuntimeError(f"{fn}: backend {backend!r} is unavailable: {why}")
    return backend


# ---------------------------------------------------------------------------
# backends' bodies


def choose_merge(fn: str, backend, out_a: Tensor) -> str:
    """The backend that runs this call; raises with the reason when the named one cannot."""
    dv_ok = out_a.shape[2] % nvfp4.BLOCK_SIZE == 0
    chosen = triton_or_reference(fn, backend, out_a.device, fits=dv_ok)
    if chosen == "triton" and not dv_ok:
        raise ArgumentError(f"{fn}: backend 'triton' needs Dv divisible by 16, got out_a {list(out_a.shape)}")
    return chosen


FP8_FA4_GENERATIONS = "FA4's FP8 epilogues are SM90's (H100/H200) only"


def fa4_fp8_usable(q: Tensor, v: Tensor, *, group: bool) -> tuple[bool, str]:
    """Whether FA4's SM90 FP8 kernels (:mod:`fusion_pass.kernels.fa4.sm90_fp8`) run this call: ``(ok, why)``.
    :func:`fusion_pass.kernels.fa4.sm90.fa4_sm90_usable` (an SM90 device, FA4 importable, supported head dims),
    and for the group format ``Dv % 128 == 0``."""
    ok, why = fa4_sm90_usable(q.device, q.dtype, q.shape[1], q.shape[2], v.shape[2])
    if not ok:
        return False, f"{why} ({FP8_FA4_GENERATIONS})"
    if group and v.shape[2] % fp8.GROUP_SIZE:
        return False, (f"FA4's group epilogue needs v's head dim Dv divisible by {fp8.GROUP_SIZE} (a head's tile "
                       f"holds whole 128-column groups), got {v.shape[2]}")
    return True, "ok"


def choose_fp8(fn: str, backend, q: Tensor, v: Tensor, *, group: bool) -> str:
    """The backend of an FP8-output attention call (``group``: the 128-column group format, whose fused kernels
    need ``Dv % 128 == 0``): ``auto`` is ``fa4`` where FA4's SM90 FP8 kernels run the call
    (:func:`fa4_fp8_usable`), else ``triton`` for CUDA tensors when Triton imports and the call fits its kernel,
    else ``reference``; a named ``fa4`` or ``triton`` raises (RuntimeError, with the reason) where it cannot run,
    and a named ``triton`` (:class:`ArgumentError`) where ``Dv`` does not fit."""
    check_backend_name(fn, backend)
    if backend in ("auto", "fa4"):
        ok, why = fa4_fp8_usable(q, v, group=group)
        if ok:
            return "fa4"
        if backend == "fa4":
            raise RuntimeError(f"{fn}: backend 'fa4' is unavailable: {why}")
    dv = v.shape[2]
    fits = not group or dv % fp8.GROUP_SIZE == 0
    chosen = triton_or_reference(fn, backend, q.device, fits=fits)
    if chosen == "triton" and not fits:
        raise ArgumentError(f"{fn}: backend 'triton' needs v's head dim Dv divisible by {fp8.GROUP_SIZE} (a head's "
                            f"tile holds whole 128-column groups), got {dv}")
    return chosen
