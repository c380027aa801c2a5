"""The first-use self-check of a fused kernel: a fixed canary, compared byte for byte, before it serves.

A backend that offers one (``self_check_needed(device)`` and ``canary(device, dtype, num_heads, qk_head_dim,
v_head_dim)``, as :class:`fusion_pass.runtime.backends.fa4.FA4Backend` does) is checked once per process and
kernel configuration (backend, device, dtype, head dims), the first time the guard would fuse with it
(:func:`verify`). The canary compiles and runs the fused kernel and the same forward in the query dtype +
the reference quantizer on a few small batches; a difference disables the backend for the process: every
later call that would use it takes the exact fallback with the reason ``self_check_failed``, and one warning
names the configuration. The check never runs while a CUDA graph is being captured (a kernel launch there
would be recorded, not run): such a call takes the fallback with the reason ``self_check_pending`` and the
check runs at the next eager call. :func:`run_self_check` runs it on request (``fusion-pass selftest``).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from dataclasses import dataclass

import torch

__all__ = ["SelfCheckResult", "failed_check", "forget_self_checks", "run_self_check", "self_check_results", "verify"]

logger = logging.getLogger("fusion_pass")


@dataclass(frozen=True)
class SelfCheckResult:
    """One configuration's self-check: ``passed``, what was compared or where it differed (``detail``), and the
    seconds it took (``seconds``; the first one in a process includes compiling both kernels)."""

    backend: str
    device: str
    dtype: str
    head_dims: tuple[int, int]
    passed: bool
    detail: str
    seconds: float

    def describe(self) -> str:
        state = "passed" if self.passed else "FAILED"
        return (f"{self.backend} on {self.device} ({self.dtype}, head dims {self.head_dims}): {state} in "
                f"{self.seconds:.2f} s: {self.detail}")


_lock = threading.RLock()
_results: dict[tuple, SelfCheckResult] = {}
_disabled: dict[str, SelfCheckResult] = {}


def _device(device) -> torch.device:
    """``device`` with its index: ``cuda`` and ``cuda:<current>`` are one device (one result)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _key(backend, device, dtype, qk_head_dim, v_head_dim) -> tuple:
    return backend.name, str(_device(device)), dtype, qk_head_dim, v_head_dim


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def run_self_check(backend, device, dtype, num_heads, qk_head_dim, v_head_dim) -> SelfCheckResult:
    """Run ``backend``'s canary for this configuration now (whether or not it is needed) and record it. A
    failure disables the backend for the process and warns once."""
    device = _device(device)
    key = _key(backend, device, dtype, qk_head_dim, v_head_dim)
    with _lock:
        started = time.perf_counter()
        try:
            passed, detail = backend.canary(device, dtype, num_heads, qk_head_dim, v_head_dim)
            if device.type == "cuda" and torch.cuda.is_available():
                torch.cuda.synchronize(device)  # a fault of the canary's kernels is the check's, not the caller's
        except Exception as exc:  # a kernel that does not compile or launch fails its check; never the caller
            passed, detail = False, f"the canary raised {type(exc).__name__}: {exc}"
        result = SelfCheckResult(backend.name, str(device), str(dtype).replace("torch.", ""),
                                 (qk_head_dim, v_head_dim), passed, detail, time.perf_counter() - started)
        _results[key] = result
        if passed:
            logger.info("fusion_pass: self-check %s", result.describe())
        elif backend.name not in _disabled:
            _disabled[backend.name] = result
            message = (f"fusion_pass: the {backend.name} fused kernel failed its self-check and is disabled for this "
                       f"process; its layers take the exact unfused path (reason self_check_failed). "
                       f"{result.describe()}")
            logger.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        return result


def verify(backend, device, dtype, num_heads, qk_head_dim, v_head_dim) -> tuple[str | None, str]:
    """Whether ``backend`` may serve this configuration: ``(None, detail)`` if yes, else ``(reason, detail)``
    with the reason ``"self_check_failed"`` or ``"self_check_pending"`` (module docstring). Runs the canary
    the first time it is needed for the configuration."""
    needed = getattr(backend, "self_check_needed", None)
    if needed is None:
        return None, "no self-check"
    device = _device(device)
    required, why = needed(device)
    if not required:
        return None, why
    with _lock:
        failed = _disabled.get(backend.name)
        if failed is not None:
            return "self_check_failed", failed.describe()
        result = _results.get(_key(backend, device, dtype, qk_head_dim, v_head_dim))
        if result is None:
            if _capturing(device):
                return "self_check_pending", ("a CUDA graph is being captured; the self-check of the fused kernel "
                                              f"runs at the next eager call ({why})")
            result = run_self_check(backend, device, dtype, num_heads, qk_head_dim, v_head_dim)
        if not result.passed:
            return "self_check_failed", _disabled.get(backend.name, result).describe()
    return None, f"self-check passed ({why})"


def failed_check(backend_name: str) -> SelfCheckResult | None:
    """The failed self-check that disabled backend ``backend_name`` in this process, or None."""
    with _lock:
        return _disabled.get(backend_name)


def self_check_results() -> list[SelfCheckResult]:
    """Every self-check this process ran, in order."""
    with _lock:
        return list(_results.values())


def forget_self_checks() -> None:
    """Forget every result and re-enable every backend (tests; after a driver or library change)."""
    with _lock:
        _results.clear()
        _disabled.clear()
