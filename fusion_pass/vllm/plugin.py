"""The ``vllm.general_plugins`` entry point: runs in every vLLM process (main, EngineCore, workers).

It registers ``torch.ops.fusion_pass.*`` (the quant / GEMM ops an NVFP4 linear method built on this
project emits) and the run-time ops the rewritten graph calls, so that a graph compiled, cached or
unpickled in any process finds them. It never adds the pass: vLLM has no plugin hook for that; the
pass comes from the compilation config (``"fusion_pass_vllm.PASS"``).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.fusion_pass")


def register() -> None:
    import os

    import fusion_pass.ops  # noqa: F401  (registers torch.ops.fusion_pass.*)

    if os.environ.get("FUSION_PASS_VLLM_TEST_QUANT") == "1":  # tests only (fusion_pass/vllm/testing.py)
        from fusion_pass.vllm import testing  # noqa: F401  (registers quant_method "fusion_pass_test_nvfp4")

    try:
        from fusion_pass.vllm import attention

        attention.register()
    except Exception as exc:  # never break vLLM's start-up; the pass reports it again when it runs
        logger.warning("fusion_pass: could not register the vLLM run-time ops (%s: %s); "
                       "the fusion pass will not rewrite in this process", type(exc).__name__, exc)
