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
    """Register what the rewritten graph needs in this vLLM process, on a supported release only
    (:func:`fusion_pass.vllm.releases.refusal`): on any other, one warning line and nothing registered (no op, no
    metadata hook), but the modules named in ``FUSION_PASS_VLLM_IMPORT``, which are the user's."""
    import importlib
    import os

    from fusion_pass.vllm import releases
    from fusion_pass.vllm import notices

    refused = releases.refusal()
    if refused is None:
        import fusion_pass.ops  # noqa: F401  (registers torch.ops.fusion_pass.*)

    extra = os.environ.get(EXTRA_MODULES_ENV, "")
    for name in filter(None, (n.strip() for n in extra.split(","))):  # e.g. the tests' NVFP4 quant method
        importlib.import_module(name)

    if refused is not None:
        notices.notice("release", refused)
        return
    try:
        from fusion_pass.vllm.runtime import attention_op

        attention_op.register()
        _install_config_check()
    except Exception as exc:  # never break vLLM's start-up; the pass reports it again when it runs
        logger.warning("fusion_pass: could not register the vLLM run-time ops (%s: %s); "
                       "the fusion pass will not rewrite in this process", type(exc).__name__, exc)


def _install_config_check() -> None:
    """Have vLLM's attention metadata builders check, at the first one built in this process, whether the worker's
    final config keeps the pass from acting (:func:`fusion_pass.vllm.compile.notices.check_config`): a model vLLM
    does not compile never reaches the pass, so the pass itself cannot say it. Wraps
    ``AttentionMetadataBuilder.__init__``, which every builder calls; once per process."""
    import functools

    from vllm.v1.attention.backend import AttentionMetadataBuilder

    from fusion_pass.vllm import notices

    init = AttentionMetadataBuilder.__init__
    if getattr(init, "__fusion_pass_hook__", False):
        return
    checked: list[bool] = []

    @functools.wraps(init)
    def init_checking_config(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if not checked:
            checked.append(True)
            try:
                notices.check_config(getattr(self, "vllm_config", None))
            except Exception as exc:  # a check must never break vLLM's start-up
                logger.debug("fusion_pass: config check failed (%s: %s)", type(exc).__name__, exc)

    init_checking_config.__fusion_pass_hook__ = True
    AttentionMetadataBuilder.__init__ = init_checking_config
