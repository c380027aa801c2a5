"""Never a silent no-op: why the fusion pass cannot act in this process, said once per process and kept for the
report (``notices`` in :meth:`fusion_pass.vllm.FusionPassForVllm.report`, printed by ``fusion-pass report``).

What is said (each with what to set):

* ``release``: the installed vLLM is not a supported release (:func:`fusion_pass.vllm.releases.refusal`): nothing is
  registered and nothing rewritten;
* ``not_compiled``: vLLM does not compile the model (compilation mode ``NONE``: ``enforce_eager``, or breakable CUDA
  graphs, which vLLM 0.33+ turns on by default for some model families), so no post-grad pass runs;
* ``attention_split``: attention is one of vLLM's splitting ops and Inductor's graph partition is off, so
  attention and the o_proj quant are compiled in different graphs and never match;
* ``no_adapter``: a layer's attention backend has no adapter (said by the compile-time layer check).

:func:`check_config` reads a vLLM config for the two configuration cases. It runs when the pass compiles a graph
and, because a model vLLM does not compile never reaches the pass, also when vLLM builds an attention metadata
builder (the plugin's hook: :func:`fusion_pass.vllm.plugin.register`), where the worker's final config is at hand.
"""

from __future__ import annotations

import logging
import os
import threading

__all__ = ["ATTENTION_OPS", "check_config", "configured_pass", "notice", "notices", "splitting_attention_ops"]

logger = logging.getLogger("vllm.fusion_pass")

ATTENTION_OPS = ("vllm::unified_attention_with_output", "vllm::unified_mla_attention_with_output",
                 "vllm::unified_attention", "vllm::unified_mla_attention")

NOTICES_KEY = "fusion_pass.vllm"
"""The ``notices_key`` class attribute of :class:`~fusion_pass.vllm.compile.inductor_pass.FusionPassForVllm`."""

_notices: dict[str, str] = {}
_lock = threading.Lock()


def notice(key: str, message: str) -> bool:
    """Say ``message`` (a WARNING on ``vllm.fusion_pass``) the first time ``key`` is noticed in this process and keep
    it for the report. Returns whether it was new."""
    with _lock:
        if key in _notices:
            return False
        _notices[key] = message
    logger.warning("fusion_pass: %s", message)
    return True


def notices() -> list[dict]:
    """The notices of this process, in order: ``[{"key": ..., "message": ...}]``."""
    with _lock:
        return [{"key": k, "message": m} for k, m in _notices.items()]


def splitting_attention_ops(compilation_config) -> list[str]:
    """Attention ops among the config's splitting ops (when the graph is really split on them)."""
    if compilation_config is None or getattr(compilation_config, "use_inductor_graph_partition", False):
        return []
    return [op for op in (getattr(compilation_config, "splitting_ops", None) or []) if op in ATTENTION_OPS]


def configured_pass(compilation_config):
    """The :class:`~fusion_pass.vllm.compile.inductor_pass.FusionPassForVllm` the config runs after Inductor's
    post-grad passes (directly, or inside vLLM's pass manager), or None. Recognised by its ``notices_key`` class
    attribute (this module is below the pass's and does not import it)."""
    post = (getattr(compilation_config, "inductor_compile_config", None) or {}).get("post_grad_custom_post_pass")
    for candidate in (post, *(getattr(post, "passes", None) or ())):
        if getattr(type(candidate), "notices_key", None) == NOTICES_KEY:
            return candidate
    return None


def _breakable_cudagraphs(compilation) -> bool:
    """Whether vLLM runs breakable CUDA graphs: 0.34 records it on the compilation config
    (``use_breakable_cudagraph``); 0.32 / 0.33 read the environment variable, which vLLM sets itself
    (``VllmConfig._maybe_enable_breakable_cudagraph``) in the process that builds the config, before it starts the
    engine's processes."""
    recorded = getattr(compilation, "use_breakable_cudagraph", None)
    if recorded is not None:
        return bool(recorded)
    return os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH", "").strip().lower() in ("1", "true")


def check_config(vllm_config, fusion=None) -> list[str]:
    """Notice (once per process) why a vLLM config keeps the fusion pass from acting: the model is not compiled, or
    attention is a splitting op. ``fusion``: the pass (default: the one the config names; nothing is said of a
    config that names none). Returns the keys that hold for this config; when any does, the pass's report file is
    written (under ``FUSION_PASS_DUMP``)."""
    compilation = getattr(vllm_config, "compilation_config", None)
    fusion = configured_pass(compilation) if fusion is None else fusion
    if fusion is None:
        return []
    found = []
    mode = getattr(compilation, "mode", None)
    if mode is not None and int(getattr(mode, "value", mode)) == 0:
        if _breakable_cudagraphs(compilation):
            why, fix = ("breakable CUDA graphs are on (vLLM turns them on by default for some model families)",
                        "set VLLM_USE_BREAKABLE_CUDAGRAPH=0 in the environment of vLLM's processes")
        elif getattr(getattr(vllm_config, "model_config", None), "enforce_eager", False):
            why, fix = "enforce_eager is set", "drop enforce_eager (--enforce-eager)"
        else:
            why, fix = "its compilation mode is NONE", "set compilation_config mode=3 (VLLM_COMPILE)"
        found.append("not_compiled")
        notice("not_compiled", f"vLLM does not compile this model ({why}): no post-grad pass runs, so the fusion pass "
                               f"rewrites nothing and every attention call runs unfused; {fix}")
    split = splitting_attention_ops(compilation)
    if split and "not_compiled" not in found:
        found.append("attention_split")
        notice("attention_split", f"attention is a splitting op ({', '.join(split)}) and Inductor's graph partition is "
                                  f"off: vLLM compiles attention and the o_proj quant in different graphs, so the fusion "
                                  f"pass cannot match them; set compilation_config use_inductor_graph_partition=True "
                                  f"(keeps piecewise CUDA graphs) or splitting_ops=[]")
    if found:
        fusion.write_report()
    return found
