"""vLLM integration (needs vLLM; nothing here is imported by ``import fusion_pass``).

* :class:`FusionPassForVllm` — the pass as a vLLM ``InductorPass`` (picklable, deep-copyable,
  building its :class:`~fusion_pass.FusionPass` lazily over :func:`fusion_pass.vllm.vocabulary.vllm_vocabulary`);
  registered in one line through the top-level module ``fusion_pass_vllm`` (``"fusion_pass_vllm.PASS"``);
* :mod:`.attention_op` — ``fusion_pass::vllm_attention_nvfp4`` / ``vllm_mla_attention_nvfp4``, the ops the
  rewritten graph calls; :mod:`.guard` reads vLLM's forward context into the shared guard core;
  :mod:`.fused_rows` writes the fused rows (MLA: with the decode rows by vLLM's own forward);
* :mod:`.vocabulary` — vLLM's ops for the pattern table's roles;
* :mod:`.plugin` — the ``vllm.general_plugins`` entry point.

This module only hands names on.
"""

from fusion_pass.vllm.inductor_pass import SUPPORTED_VLLM_VERSIONS, FusionPassForVllm

__all__ = ["FusionPassForVllm", "SUPPORTED_VLLM_VERSIONS"]
