"""The first-use self-check of a fused kernel: a fixed canary, compared byte for byte, before it serves.

A backend that offers one (``self_check_needed(device)`` and ``canary(device, dtype, num_heads, qk_head_dim,
v_head_dim, group)``, as :class:`fusion_pass.runtime.backends.fa4.FA4Backend` does) is checked once per process and
kernel configuration (backend, device, dtype, head dims, query heads per KV head), the first time the guard would
fuse with it (:func:`verify`) where the check is required (:func:`required`: the backend's own answer, overridden
by the self-check mode ``off`` or ``all``, :func:`fusion_pass.runtime.settings.self_check_mode`). The canary
compiles and runs the fused kernel and the same forward in the query dtype + the reference quantizer on a few
small batches; a difference disables the backend for the process: every
later call that would use it takes the exact fallback with the reason ``self_check_failed``, and one warning
names the configuration. The check never runs while a CUDA graph is being captured (a kernel launch there
would be recorded, not run): such a call takes the fallback with the reason ``self_check_pending`` and the
check runs at the next eager call. :func:`run_self_check` runs it on request (``fusion-pass selftest``); on a
backend that offers no check it records the check as not applicable (no warning; the backend serves as before).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from dataclasses import dataclass

import torch

from fusion_pass.runtime import settings

__all__ = ["SelfCheckResult", "failed_check", "forget_self_checks", "offers_check", "required", "run_self_check",
           "self_check_results", "verify"]

logger = logging.getLogger("fusion_pass")


@dataclass(frozen=True)
class SelfCheckResult:
    """One configuration's self-check: ``passed``, what was compared or where it differed (``detail``), the
    seconds it took (``seconds``; the first one in a process includes compiling both kernels), and the query
    heads per KV head it ran (``group``). ``applicable`` is False for a backend that offers no check (no canary
    ran: ``passed`` is False too, and the backend is not disabled); :attr:`status` says which of the three."""

    backend: str
    device: str
    dtype: str
    head_dims: tuple[int, int]
    passed: bool
    detail: str
    seconds: float
    group: int = 1
    applicable: bool = True

    @property
    def status(self) -> str:
        """``"passed"``, ``"FAILED"`` or ``"not applicable"`` (the backend offers no self-check)."""
        return "not applicable" if not self.applicable else "passed" if self.passed else "FAILED"

    def describe(self) -> str:
        state = self.status
        return (f"{self.backend} on {self.device} ({self.dtype}, head dims {self.head_dims}, {self.group} query "
                f"head(s) per KV head): {state} in {self.seconds:.2f} s: {self.detail}")


_lock = threading.RLock()
_results: dict[tuple, SelfCheckResult] = {}
_disabled: dict[str, SelfCheckResult] = {}


def _device(device) -> torch.device:
    """``device`` with its index: ``cuda`` and ``cuda:<current>`` are one device (one result)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _group(num_heads: int, num_kv_heads: int | None) -> int:
    """Query heads per key/value head (the kernels compile per group size)."""
    return 1 if not num_kv_heads else max(1, num_heads // num_kv_heads)


def _key(backend, device, dtype, qk_head_dim, v_head_dim, num_heads, num_kv_heads) -> tuple:
    return (backend.name, str(_device(device)), dtype, qk_head_dim, v_head_dim, _group(num_heads, num_kv_heads))


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def offers_check(backend) -> bool:
    """Whether ``backend`` offers a self-check: both ``self_check_needed`` and ``canary``."""
    return callable(getattr(backend, "self_check_needed", None)) and callable(getattr(backend, "canary", None))


def required(backend, device) -> tuple[bool, str]:
    """Whether ``backend`` (one that offers a check) must pass its canary before it serves ``device``, and why:
    never with the self-check mode ``off``; with ``all`` always; with ``auto`` where the backend says so
    (``self_check_needed``: e.g. a kernel this project never ran on hardware)."""
    mode = settings.self_check_mode()
    if mode == "off":
        return False, f"self-check off ({settings.SELF_CHECK_ENV}=off)"
    needed, why = backend.self_check_needed(device)
    if not needed and mode == "all":
        return True, f"self-check of every fused kernel requested ({settings.SELF_CHECK_ENV}=all)"
    return needed, why


def run_self_check(backend, device, dtype, num_heads, qk_head_dim, v_head_dim,
                   num_kv_heads: int | None = None) -> SelfCheckResult:
    """Run ``backend``'s canary for this configuration now (whether or not it is needed) and record it. A
    failure disables the backend for the process and warns once. The canary runs on ``device`` (made current
    for it) with the layer's query heads per KV head (``num_kv_heads``, default ``num_heads``). A backend that
    offers no check (:func:`offers_check`) gets a result that is not applicable (``applicable=False``), recorded,
    logged at INFO, with no warning: nothing ran, and the backend serves as it did (the guard checks only
    backends that offer a check)."""
    device = _device(device)
    group = _group(num_heads, num_kv_heads)
    key = _key(backend, device, dtype, qk_head_dim, v_head_dim, num_heads, num_kv_heads)
    if not offers_check(backend):
        result = SelfCheckResult(backend.name, str(device), str(dtype).replace("torch.", ""),
                                 (qk_head_dim, v_head_dim), False,
                                 "the backend offers no self-check (no canary); it serves without one", 0.0, group,
                                 applicable=False)
        with _lock:
            _results[key] = result
        logger.info("fusion_pass: self-check %s", result.describe())
        return result
    with _lock:
        started = time.perf_counter()
        try:
            cuda = device.type == "cuda" and torch.cuda.is_available()
            with torch.cuda.device(device) if cuda else contextlib.nullcontext():
                passed, detail = backend.canary(device, dtype, num_heads, qk_head_dim, v_head_dim, group)
                if cuda:
                    torch.cuda.synchronize(device)  # a fault of the canary's kernels is the check's, not the caller's
        except Exception as exc:  # a kernel that does not compile or launch fails its check; never the caller
            passed, detail = False, f"the canary raised {type(exc).__name__}: {exc}"
        result = SelfCheckResult(backend.name, str(device), str(dtype).replace("torch.", ""),
                                 (qk_head_dim, v_head_dim), passed, detail, time.perf_counter() - started, group)
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


def verify(backend, device, dtype, num_heads, qk_head_dim, v_head_dim,
           num_kv_heads: int | None = None) -> tuple[str | None, str]:
    """Whether ``backend`` may serve this configuration: ``(None, detail)`` if yes, else ``(reason, detail)``
    with the reason ``"self_check_failed"`` or ``"self_check_pending"`` (module docstring). A backend whose check
    failed in this process is refused whether or not a check is required for this configuration. Runs the
    canary the first time it is needed for the configuration (``num_kv_heads``: the layer's key/value heads,
    default ``num_heads``; the canary runs the layer's query heads per KV head, which the kernels compile for)."""
    if not offers_check(backend):
        return None, "no self-check"
    with _lock:
        failed = _disabled.get(backend.name)
    if failed is not None:
        return "self_check_failed", failed.describe()
    device = _device(device)
    needed, why = required(backend, device)
    if not needed:
        return None, why
    with _lock:
        result = _results.get(_key(backend, device, dtype, qk_head_dim, v_head_dim, num_heads, num_kv_heads))
        if result is None or not result.applicable:
            if _capturing(device):
                return "self_check_pending", ("a CUDA graph is being captured; the self-check of the fused kernel "
                                              f"runs at the next eager call ({why})")
            result = run_self_check(backend, device, dtype, num_heads, qk_head_dim, v_head_dim, num_kv_heads)
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
