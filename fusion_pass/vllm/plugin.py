"""The ``vllm.general_plugins`` entry point: runs in every vLLM process (main, EngineCore, workers).

It registers ``torch.ops.fusion_pass.*`` (the quant / GEMM ops an NVFP4 linear method built on this
project emits) and the run-time ops the rewritten graph calls, so that a graph compiled, cached or
unpickled in any process finds them. It never adds the pass: vLLM has no plugin hook for that; the
pass comes from the compilation config (``"fusion_pass_vllm.PASS"``).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.fusion_pass")

EXTRA_MODULES_ENV = "FUSION_PASS_VLLM_IMPORT"
"""Comma-separated modules the plugin imports in every vLLM process (e.g. a quant method registered by a test
suite: ``tests_vllm/nvfp4_test_quant.py``); they must be importable there (``PYTHONPATH``)."""


def register() -> None:
    import importlib
    import os

    import fusion_pass.ops  # noqa: F401  (registers torch.ops.fusion_pass.*)

    extra = os.environ.get(EXTRA_MODULES_ENV, "")
    for name in filter(None, (n.strip() for n in extra.split(","))):  # e.g. the tests' NVFP4 quant method
        importlib.import_module(name)

    try:
        from fusion_pass.vllm import attention_op

        attention_op.register()
    except Exception as exc:  # never break vLLM's start-up; the pass reports it again when it runs
        logger.warning("fusion_pass: could not register the vLLM run-time ops (%s: %s); "
                       "the fusion pass will not rewrite in this process", type(exc).__name__, exc)
