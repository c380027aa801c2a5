"""A compile pass for the vLLM suite (never for serving): ``emulated_vllm_fusion.PASS``.

vLLM's own attention + NVFP4 quant fusion (``AttnQuantFusionPass`` / ``MLAAttnQuantFusionPass``) runs
on CUDA only. This pass stands in for it on vLLM's CPU build, then runs the fusion pass as vLLM would
after its own passes: the first step gives vLLM's attention op the quant's buffers (``output_scale`` /
``output_block_scale``, what vLLM's fusion leaves behind), the second must recognise that and retarget
the call to the fused op.
"""

import dataclasses

from vllm.compilation.passes.inductor_pass import InductorPass

from fusion_pass import FusionPass
from fusion_pass.vllm.compile.vocabulary import vllm_vocabulary
from fusion_pass.vllm import FusionPassForVllm


class EmulatedVllmFusionThenOurs(InductorPass):
    def __init__(self):
        self.ours = FusionPassForVllm()
        self.emulated = None

    def __reduce__(self):
        return (type(self), ())

    def __deepcopy__(self, memo):
        return type(self)()

    def uuid(self):
        return "emulated-vllm-fusion:" + self.ours.uuid()

    def __call__(self, graph):
        if self.emulated is None:
            self.ours.fusion()  # registers our run-time ops
            # vLLM's vocabulary without our fused ops: the "replacement" is vLLM's attention op with output_scale
            vocab = dataclasses.replace(vllm_vocabulary(), fused_attention=None, fused_mla_attention=None)
            self.emulated = FusionPass(("mla_attention_nvfp4_quant", "attention_nvfp4_quant"), vocabularies=(vocab,))
        self.emulated(graph)
        self.ours(graph)

    def report(self):
        return {**self.ours.report(), "emulated": self.emulated.report() if self.emulated else None}


PASS = EmulatedVllmFusionThenOurs()
