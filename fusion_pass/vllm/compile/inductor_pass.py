"""The fusion pass as a vLLM ``InductorPass``.

vLLM resolves ``compilation_config.inductor_passes["post_grad_custom_post_pass"]`` (a dotted name
``<top-level module>.<attribute>``) in the user's process, deep-copies the config, pickles it to the
EngineCore and worker processes (V1 multiprocessing), and in ``VLLM_COMPILE`` mode asserts the pass
is an ``InductorPass`` before appending it to its ``PostGradPassManager``. Hence this class:

* an ``InductorPass`` instance holding only plain data (pattern names): ``__reduce__`` rebuilds it
  in the receiving process, ``__deepcopy__`` builds a fresh one; the :class:`~fusion_pass.FusionPass`
  (which holds ``OpOverload`` objects and traced templates) is built lazily, on the first graph;
* ``uuid()`` is stable across processes and runs and includes the vLLM version (vLLM's AOT cache key
  and Inductor's FX graph cache key include it);
* every process that compiles logs its report (logger ``vllm.fusion_pass``, so vLLM's handler shows
  it) and, under ``FUSION_PASS_DUMP=dir``, writes it to ``dir/reports/vllm_report_<pid>.json``, kept current
  with the run-time counters while the process serves (:mod:`fusion_pass.vllm.compile.report_file`).
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import threading
from pathlib import Path

import vllm
from vllm.compilation.passes.inductor_pass import InductorPass

from fusion_pass.vllm import notices, releases
from fusion_pass.compile import code_hash
from fusion_pass.vllm.compile import layer_check, report_file, vocabulary

logger = logging.getLogger("vllm.fusion_pass")

VLLM_COMPILE_TIME = ("fusion_pass.vllm.compile", "fusion_pass.vllm.releases", "fusion_pass.vllm.adapters",
                     "fusion_pass.vllm.runtime.attention_op", "fusion_pass.vllm.runtime.fp8_static_rows")
"""What the rewrite of a vLLM graph depends on beyond every pass's code: the vocabulary and the pass, the layer check
and what it reads of a layer (the adapters), the release table, the schemas of the ops the rewrite calls, the static FP8
quant op the vocabulary binds (:mod:`fusion_pass.vllm.runtime.fp8_static_rows`)."""

SUPPORTED_VLLM_VERSIONS = tuple(f"{r.line}." for r in releases.RELEASES)
"""Prefixes of the supported vLLM releases (:data:`fusion_pass.vllm.releases.RELEASES`)."""


def version_supported(version: str | None = None) -> bool:
    return releases.refusal(vllm.__version__ if version is None else version) is None


class FusionPassForVllm(InductorPass):
    """attention -> NVFP4 quant -> NVFP4 GEMM fusion over vLLM's ops, as a vLLM ``InductorPass``.

    ``patterns``: names of entries of :data:`fusion_pass.patterns.PATTERNS` (default: all).
    """

    notices_key = notices.NOTICES_KEY  # how fusion_pass.vllm.compile.notices finds this pass in a vLLM config

    def __init__(self, patterns: tuple[str, ...] | None = None):
        self.patterns = None if patterns is None else tuple(patterns)
        self._fusion = None
        self._lock = threading.Lock()
        self._checked_config = False
        self.disabled_reason: str | None = None
        self._report_file: report_file.ReportFile | None = None
        self._graph_report: dict | None = None  # report() when the last graph was compiled

    # -- pickling / copying: only the pattern names travel ------------------------------------

    def __reduce__(self):
        return (type(self), (self.patterns,))

    def __deepcopy__(self, memo):
        return type(self)(self.patterns)

    # -- the lazily built FusionPass ----------------------------------------------------------

    def fusion(self):
        """The :class:`~fusion_pass.FusionPass` over vLLM's vocabulary (built once per instance), or
        None when this process cannot rewrite (reason in :attr:`disabled_reason`, logged once)."""
        with self._lock:
            if self._fusion is None and self.disabled_reason is None:
                self._fusion = self._build()
            return self._fusion

    def _build(self):
        refused = releases.refusal(vllm.__version__)
        if refused is not None:
            return self._disable(refused, key="release")
        try:
            importlib.import_module("vllm.model_executor.layers.attention")  # registers vllm::*attention* ops

            from fusion_pass.vllm.runtime import attention_op

            attention_op.register()
            vocab = vocabulary.vllm_vocabulary()
        except Exception as exc:
            return self._disable(f"vLLM vocabulary unavailable ({type(exc).__name__}: {exc})")
        from fusion_pass.compile.graph_pass import FusionPass
        from fusion_pass.vllm.compile.layer_check import leave_quantized

        return FusionPass(self.patterns, vocabularies=(vocab,), leave_quantized=leave_quantized)

    def _disable(self, reason: str, key: str = "disabled"):
        self.disabled_reason = reason
        notices.notice(key, f"the fusion pass does not rewrite in this process: {reason}")
        return None

    # -- InductorPass ---------------------------------------------------------------------------

    def uuid(self) -> str:
        """Stable across processes: the pattern names, the code every pass's rewrite depends on plus this
        integration's (:data:`VLLM_COMPILE_TIME`; :func:`fusion_pass.compile.code_hash.code_digest`, with the
        package version), and the vLLM version."""
        h = hashlib.sha256()
        h.update(repr(self.patterns).encode())
        h.update(code_hash.code_digest(VLLM_COMPILE_TIME).encode())
        h.update(f"vllm={vllm.__version__}".encode())
        return h.hexdigest()

    def __call__(self, graph) -> None:
        self._check_config()
        fusion = self.fusion()
        if fusion is None:
            self.write_report()
            return
        fusion(graph)
        last = fusion.graphs[-1]
        logger.info("%s [pid %d]", last.line(), os.getpid())
        for layer in last.layers:
            if layer["outcome"] == "refused":
                logger.info("fusion_pass: %s (%s): refused: %s", layer["layer"], layer["pattern"], layer.get("reason"))
            elif layer["outcome"] == "retargeted":
                logger.info("fusion_pass: %s (%s): vLLM's fuse_attn_quant rewrite retargeted to the fused op (%s)",
                            layer["layer"], layer["pattern"], layer_check.describe(layer["layer"]))
            elif layer["outcome"] == "left":
                found = layer_check.compile_time_layer(layer["layer"])
                detail = layer_check.why_left(found) if found is not None else None
                logger.info("fusion_pass: %s (%s): left as vLLM's fuse_attn_quant rewrote it (%s: %s): the fused call "
                            "would fall back on every call", layer["layer"], layer["pattern"], layer["reason"],
                            detail[1] if detail else "no detail")
        self.write_report()

    def _check_config(self) -> None:
        """Say why vLLM's current config keeps the pass from matching (attention as a splitting op:
        :func:`fusion_pass.vllm.notices.check_config`), once a config is current. vLLM does not always set one
        while Inductor compiles; the plugin's metadata-builder hook checks the worker's config too."""
        if self._checked_config:
            return
        try:
            from vllm.config import get_current_vllm_config_or_none

            config = get_current_vllm_config_or_none()
        except ImportError:
            return
        if config is not None:
            self._checked_config = True
            notices.check_config(config, fusion=self)

    # -- report -----------------------------------------------------------------------------------

    def report(self) -> dict:
        """This process's report: :meth:`fusion_pass.FusionPass.report` plus pid, vLLM version, disabled reason."""
        from fusion_pass import ops

        fusion = self._fusion
        base = fusion.report() if fusion is not None else {
            "graphs": 0, "candidates": 0, "rewritten": 0, "refused": {}, "seconds": 0.0, "per_graph": [],
            "runtime": ops.runtime_counters()}
        return {**base, "pid": os.getpid(), "vllm_version": vllm.__version__, "disabled_reason": self.disabled_reason,
                "notices": notices.notices()}

    def report_with_current_counters(self) -> dict:
        """The report of the last compiled graph with the run-time counters of now: what the report file holds
        after a counter change. Safe in any thread (unlike :meth:`report`, which settles the FX-graph-cache
        bookkeeping of a compile that may be under way)."""
        from fusion_pass import ops

        base = self._graph_report if self._graph_report is not None else self.report()
        base = {**base, "notices": notices.notices()}
        runtime = ops.runtime_counters(layers=list(base.get("rewritten_layers", [])))
        prefill = runtime["tokens"]["prefill"]
        return {**base, "runtime": runtime, "runtime_process": ops.runtime_counters(),
                "prefill_fused_fraction": runtime["tokens"]["prefill_fused"] / prefill if prefill else None}

    def write_report(self) -> Path | None:
        """Under ``FUSION_PASS_DUMP=dir``: write :meth:`report` to ``dir/reports/vllm_report_<pid>.json`` and keep
        that file current with the run-time counters (rewritten within a quarter second after they change, and
        at a normal exit: :class:`fusion_pass.vllm.compile.report_file.ReportFile`). Called after each graph."""
        directory = os.environ.get("FUSION_PASS_DUMP")
        if not directory:
            return None
        self._graph_report = self.report()
        if self._report_file is None or self._report_file.pid != os.getpid():
            self._report_file = report_file.ReportFile(directory, self.report_with_current_counters).start()
        return self._report_file.write(self._graph_report, on="graph")
