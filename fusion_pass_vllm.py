"""One-line registration of the fusion pass in vLLM.

vLLM resolves ``inductor_passes`` entries as ``<top-level module>.<attribute>``, hence this top-level
module (shipped by the ``attn-nvfp4-fusion`` distribution)::

    LLM(..., compilation_config={"inductor_passes": {"post_grad_custom_post_pass": "fusion_pass_vllm.PASS"}})
    vllm serve MODEL -cc '{"inductor_passes": {"post_grad_custom_post_pass": "fusion_pass_vllm.PASS"}}'

``PASS`` is a :class:`fusion_pass.vllm.FusionPassForVllm` (docs/vllm.md).
"""

from fusion_pass.vllm import FusionPassForVllm

PASS = FusionPassForVllm()

__all__ = ["PASS", "FusionPassForVllm"]
