"""vLLM integration (needs vLLM; nothing here is imported by ``import fusion_pass``).

* :class:`FusionPassForVllm` — the pass as a vLLM ``InductorPass`` (picklable, deep-copyable,
  building its :class:`~fusion_pass.FusionPass` lazily over :func:`fusion_pass.patterns.vllm_vocabulary`);
  registered in one line through the top-level module ``fusion_pass_vllm`` (``"fusion_pass_vllm.PASS"``);
* :mod:`.attention` — ``fusion_pass::vllm_attention_nvfp4`` / ``vllm_mla_attention_nvfp4``, the ops the
  rewritten graph calls (run-time guard read from vLLM's forward context; exact unfused fallback);
* :mod:`.plugin` — the ``vllm.general_plugins`` entry point.

This module only hands names on.
"""

from fusion_pass.vllm.pass_ import SUPPORTED_VLLM_VERSIONS, FusionPassForVllm

__all__ = ["FusionPassForVllm", "SUPPORTED_VLLM_VERSIONS"]
