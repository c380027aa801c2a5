"""One-line registration of the fusion pass in vLLM.

vLLM resolves ``inductor_passes`` entries as ``<module>.<attribute>`` through
``__import__(module).__dict__[attribute]``, i.e. in the *top-level* package's namespace, hence this
top-level module (shipped by the ``attn-nvfp4-fusion`` distribution)::

    LLM(..., compilation_config={"inductor_passes": {"post_grad_custom_post_pass": "fusion_pass_vllm.PASS"}})

``"fusion_pass.vllm.PASS"`` names the same object (:mod:`fusion_pass.vllm` sets ``fusion_pass.PASS`` when it
is imported). ``PASS`` is a :class:`fusion_pass.vllm.FusionPassForVllm` (docs/vllm.md).
"""

from fusion_pass.vllm import PASS, FusionPassForVllm

__all__ = ["PASS", "FusionPassForVllm"]
