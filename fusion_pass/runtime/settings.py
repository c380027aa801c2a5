"""The run time's settings: which fused backend serves a layer, the context workspace bound, which fused
kernels are self-checked before their first use, whether a vLLM standard layer splits a mixed call, and whether
``auto`` follows the measured policy (:mod:`fusion_pass.runtime.policy`).

Each setting is read, in order of precedence, from:

1. ``use_*(value)`` (``with use_backend("reference"):``): scoped to the ``with`` block *and* to the thread /
   asyncio task that entered it (a :class:`contextvars.ContextVar`: compiled graphs run their ops on the
   calling thread); other threads never see it and threads started inside the block do not inherit it.
   ``use_*(None)`` lets the environment decide inside the block, ignoring ``set_*``;
2. ``set_*(value)``: the process-wide value, seen by every thread without a ``use_*`` block of its own;
   ``set_*(None)`` goes back to the environment;
3. the environment variable (:data:`BACKEND_ENV`, :data:`CONTEXT_WORKSPACE_ENV`, :data:`SELF_CHECK_ENV`,
   :data:`SPLIT_MIXED_ENV`, :data:`POLICY_ENV`);
4. the default.

A bad value raises :class:`~fusion_pass.nvfp4.ArgumentError` (a ValueError) naming its source before anything
else happens: ``set_*`` / ``use_*`` when
called, an environment variable when first read (:func:`check_environment` reads them all at once; the attention
ops, the project's and vLLM's, call it before they touch a cache, so a bad value of any of them, the vLLM-only split
mode included, stops either op).
"""

from __future__ import annotations

import contextvars
import os
import threading
from contextlib import contextmanager
from typing import Any, Callable, Generic, Iterator, TypeVar

from fusion_pass.nvfp4.checks import ArgumentError, is_int
from fusion_pass.runtime.backends import registry

__all__ = [
    "BACKEND_CHOICES",
    "BACKEND_ENV",
    "CONTEXT_WORKSPACE_ENV",
    "DEFAULT_CONTEXT_WORKSPACE_TOKENS",
    "POLICY_ENV",
    "POLICY_MODES",
    "SELF_CHECK_ENV",
    "SELF_CHECK_MODES",
    "SPLIT_MIXED_ENV",
    "SPLIT_MIXED_MODES",
    "check_environment",
    "configured_backend",
    "environment_variables",
    "context_workspace_tokens",
    "policy_mode",
    "set_backend",
    "self_check_mode",
    "set_context_workspace_tokens",
    "set_policy",
    "set_self_check",
    "set_split_mixed",
    "split_mixed",
    "use_backend",
    "use_context_workspace_tokens",
    "use_policy",
    "use_self_check",
    "use_split_mixed",
]

T = TypeVar("T")

BACKEND_ENV = "FUSION_PASS_BACKEND"
"""Environment variable pinning the backend choice (one of :data:`BACKEND_CHOICES`)."""

BACKEND_CHOICES = ("auto",) + registry.names()
"""Valid backend choices: ``auto`` (the first backend of the selection order that runs the layer) and the name of
each backend of :data:`fusion_pass.runtime.backends.registry.BACKENDS`."""

CONTEXT_WORKSPACE_ENV = "FUSION_PASS_CONTEXT_WORKSPACE_TOKENS"
"""Environment variable setting the context workspace bound (:func:`context_workspace_tokens`)."""

DEFAULT_CONTEXT_WORKSPACE_TOKENS = 65536
"""Default context workspace bound: vLLM's cap on its MLA chunked-prefill workspace (64k tokens)."""

SELF_CHECK_ENV = "FUSION_PASS_SELF_CHECK"
"""Environment variable choosing which fused kernels are self-checked (one of :data:`SELF_CHECK_MODES`)."""

SELF_CHECK_MODES = ("auto", "all", "off")
"""``auto``: kernels this project never ran on hardware (SM100); ``all``: every fused kernel that offers a
self-check; ``off``: none (docs/blackwell.md)."""

SPLIT_MIXED_ENV = "FUSION_PASS_VLLM_SPLIT_MIXED"
"""Environment variable choosing whether a vLLM standard layer splits a mixed call (one of
:data:`SPLIT_MIXED_MODES`)."""

SPLIT_MIXED_MODES = ("off", "on")
"""What a vLLM standard (non-MLA) layer does with a call holding decode rows and prefill rows. ``off`` (the
default): the whole call takes the exact fallback, reason ``mixed_not_split``. ``on``: the call is split, vLLM's
backend computing the decode rows on their sub-batch beside one fused call for the prefill rows. vLLM's standard
backends compute every row in one launch; the split adds an attention launch and a quantizer launch, which on
the H200 cost more GPU time than fusing the prefill rows saves (docs/benchmarks.md, "GPU time per step"). An MLA
layer is not affected: vLLM's MLA layer computes its decode and prefill rows apart itself."""

POLICY_ENV = "FUSION_PASS_POLICY"
"""Environment variable choosing how ``auto`` decides per call (one of :data:`POLICY_MODES`)."""

POLICY_MODES = ("measured", "always")
"""``measured`` (the default): ``auto`` fuses a call only where :data:`fusion_pass.runtime.policy.POLICY_TABLE`
says fusing its class is not slower on the device's GPU generation, else the call falls back (``slower_here``);
``always``: wherever a backend runs the call."""

_UNSET: Any = object()
_ENVIRONMENT: Any = object()  # use_*(None): the environment decides, ignoring set_*


def _one_of(choices: tuple[str, ...], what: str) -> Callable[[Any, str], str]:
    """The parser of a setting that takes one of ``choices`` (a string; case and surrounding blanks ignored): a
    bad value raises ArgumentError naming its source, ``what`` the setting takes and the choices."""

    def parse(value: Any, source: str) -> str:
        choice = value.strip().lower() if isinstance(value, str) else None
        if choice not in choices:
            raise ArgumentError(f"{source}={value!r} is not {what}; choose one of {', '.join(choices)}")
        return choice

    return parse


def _token_count(value: Any, source: str) -> int:
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            pass
    if not is_int(value) or value < 1:
        raise ArgumentError(f"{source}={value!r} must be a positive number of tokens (an int, numpy's too; the "
                            "context workspace bound)")
    return int(value)


class _Setting(Generic[T]):
    """One setting, declared once: its ``name`` (``set_<name>`` / ``use_<name>`` take ``argument``), environment
    variable, default and parser. Read: the scoped value (context variable), the process-wide value, the
    environment variable, the default."""

    def __init__(self, name: str, argument: str, env: str, default: T, parse: Callable[[Any, str], T]) -> None:
        self.name, self.argument, self.env, self.default, self.parse = name, argument, env, default, parse
        self._process: T | None = None
        self._lock = threading.Lock()
        self._scoped: contextvars.ContextVar[Any] = contextvars.ContextVar(f"fusion_pass_{name}", default=_UNSET)
        self._parsed: tuple[str, T] | None = None  # (raw environment value, its parse): parsed once per value

    def get(self) -> T:
        scoped = self._scoped.get()
        if scoped is not _UNSET and scoped is not _ENVIRONMENT:
            return scoped
        if scoped is _UNSET and self._process is not None:
            return self._process
        return self.from_environment()

    def from_environment(self) -> T:
        """The environment variable's value, parsed (once per distinct raw value: the attention ops read it on
        every call); a bad value raises every time it is read."""
        raw = os.environ.get(self.env, "")
        parsed = self._parsed
        if parsed is not None and parsed[0] == raw:
            return parsed[1]
        value = self.default if not raw.strip() else self.parse(raw, self.env)
        self._parsed = (raw, value)
        return value

    def set(self, value: Any) -> T | None:
        parsed = None if value is None else self.parse(value, f"set_{self.name}({self.argument})")
        with self._lock:
            previous, self._process = self._process, parsed
        return previous

    @contextmanager
    def use(self, value: Any) -> Iterator[Any]:
        scoped = _ENVIRONMENT if value is None else self.parse(value, f"use_{self.name}({self.argument})")
        token = self._scoped.set(scoped)
        try:
            yield value
        finally:
            self._scoped.reset(token)


_backend = _Setting("backend", "name", BACKEND_ENV, "auto", _one_of(BACKEND_CHOICES, "a backend"))
_workspace = _Setting("context_workspace_tokens", "tokens", CONTEXT_WORKSPACE_ENV, DEFAULT_CONTEXT_WORKSPACE_TOKENS,
                      _token_count)
_self_check = _Setting("self_check", "mode", SELF_CHECK_ENV, "auto", _one_of(SELF_CHECK_MODES, "a self-check mode"))
_split_mixed = _Setting("split_mixed", "mode", SPLIT_MIXED_ENV, "off", _one_of(SPLIT_MIXED_MODES, "a split mode"))
_policy = _Setting("policy", "mode", POLICY_ENV, "measured", _one_of(POLICY_MODES, "a policy mode"))

_SETTINGS = (_backend, _workspace, _self_check, _split_mixed, _policy)
"""Every setting, each declared once above; :func:`check_environment` reads them all."""


def configured_backend() -> str:
    """The backend choice of the calling thread / task (module docstring: use, set, environment, ``auto``)."""
    return _backend.get()


def set_backend(name: str | None) -> str | None:
    """Pin the process-wide backend choice (``None``: back to the environment / ``auto``); returns the previous
    pinned choice (``None`` if there was none)."""
    return _backend.set(name)


def use_backend(name: str | None):
    """Pin the backend choice inside the ``with`` block, for the calling thread / task only (``None``: the
    environment decides inside, ignoring :func:`set_backend`). Nestable."""
    return _backend.use(name)


def context_workspace_tokens() -> int:
    """The context workspace bound, in tokens (module docstring: use, set, environment, default 65536).

    A call whose fused prefills have at most this many cached context tokens in all runs one attention over a
    workspace of context + new keys; beyond it the context is attended in chunks of at most this many tokens
    and the parts are merged by log-sum-exp (:func:`fusion_pass.runtime.row_plan.run_prefills`)."""
    return _workspace.get()


def set_context_workspace_tokens(tokens: int | None) -> int | None:
    """Set the process-wide context workspace bound (``None``: back to the environment / default); returns the
    previous setting."""
    return _workspace.set(tokens)


def use_context_workspace_tokens(tokens: int | None):
    """The context workspace bound inside the ``with`` block, for the calling thread / task only (``None``: the
    environment decides inside, ignoring :func:`set_context_workspace_tokens`). Nestable."""
    return _workspace.use(tokens)


def self_check_mode() -> str:
    """Which fused kernels run their canary before serving (:data:`SELF_CHECK_MODES`; default ``auto``)."""
    return _self_check.get()


def set_self_check(mode: str | None) -> str | None:
    """Set the process-wide self-check mode (``None``: back to the environment / ``auto``); returns the
    previous setting."""
    return _self_check.set(mode)


def use_self_check(mode: str | None):
    """The self-check mode inside the ``with`` block, for the calling thread / task only. Nestable."""
    return _self_check.use(mode)


def split_mixed() -> str:
    """Whether a vLLM standard layer splits a call with decode and prefill rows (:data:`SPLIT_MIXED_MODES`;
    default ``off``)."""
    return _split_mixed.get()


def set_split_mixed(mode: str | None) -> str | None:
    """Set the process-wide split mode (``None``: back to the environment / ``off``); returns the previous
    setting."""
    return _split_mixed.set(mode)


def use_split_mixed(mode: str | None):
    """The split mode inside the ``with`` block, for the calling thread / task only. Nestable."""
    return _split_mixed.use(mode)


def policy_mode() -> str:
    """How ``auto`` decides per call (:data:`POLICY_MODES`; default ``measured``)."""
    return _policy.get()


def set_policy(mode: str | None) -> str | None:
    """Set the process-wide policy mode (``None``: back to the environment / ``measured``); returns the previous
    setting."""
    return _policy.set(mode)


def use_policy(mode: str | None):
    """The policy mode inside the ``with`` block, for the calling thread / task only. Nestable."""
    return _policy.use(mode)


def check_token_count(source: str, tokens: Any) -> int:
    """``tokens`` as a positive int (numpy integers accepted), else ArgumentError naming ``source``."""
    return _token_count(tokens, source)


def environment_variables() -> tuple[str, ...]:
    """Every setting's environment variable, in declaration order."""
    return tuple(setting.env for setting in _SETTINGS)


def check_environment() -> None:
    """Read every setting's environment variable now: a bad value raises ValueError naming the variable."""
    for setting in _SETTINGS:
        setting.from_environment()
