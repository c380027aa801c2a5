"""Op vocabularies: the ops a pattern is written over.

A pattern names roles ("the MLA attention op", "the NVFP4 quant op", ...), never
concrete ops; a vocabulary binds the roles to one library's ops. The same
patterns then match graphs built from ``torch.ops.fusion_pass`` and from any other
library given a vocabulary (vLLM's lives with the vLLM integration,
:func:`fusion_pass.vllm.vocabulary.vllm_vocabulary`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch._ops import OpOverload


@dataclass(frozen=True)
class OpVocabulary:
    """One library's ops for each role the patterns use.

    ``attention`` / ``mla_attention`` have the schema of vLLM's
    ``unified_attention_with_output`` / ``unified_mla_attention_with_output``
    (mutable ``output``, optional ``output_scale`` and mutable
    ``output_block_scale``); ``nvfp4_quant`` that of ``scaled_fp4_quant.out``;
    ``nvfp4_gemm`` consumes the quant's outputs as its ``a`` / ``block_scale_a``.
    ``other_quants`` are quant ops of other formats (a match ending in one is
    refused with a reason, not silently skipped).
    """

    name: str
    attention: OpOverload | None
    mla_attention: OpOverload | None
    nvfp4_quant: OpOverload
    nvfp4_gemm: OpOverload
    other_quants: tuple[OpOverload, ...] = field(default=())
    fused_attention: OpOverload | None = None
    fused_mla_attention: OpOverload | None = None

    def writing_nvfp4(self, role: str) -> OpOverload:
        """The op a replacement calls to have ``role``'s attention write NVFP4: ``fused_<role>``
        when the vocabulary has one (vLLM: an op of this project that applies the run-time guard
        and otherwise calls vLLM's op), else the attention op itself with ``output_scale``."""
        return getattr(self, f"fused_{role}") or getattr(self, role)

    def attention_ops(self) -> dict[OpOverload, str]:
        """Attention op -> role name, for the roles this vocabulary has."""
        ops = {self.attention: "attention", self.mla_attention: "mla_attention"}
        return {op: role for op, role in ops.items() if op is not None}


def fusion_pass_vocabulary() -> OpVocabulary:
    """The project's own ``torch.ops.fusion_pass`` library."""
    import fusion_pass.ops  # noqa: F401  (registers the ops)

    ops = torch.ops.fusion_pass
    return OpVocabulary(
        name="fusion_pass",
        attention=ops.attention_with_output.default,
        mla_attention=ops.mla_attention_with_output.default,
        nvfp4_quant=ops.scaled_fp4_quant.out,
        nvfp4_gemm=ops.nvfp4_gemm.default,
        other_quants=(ops.static_scaled_fp8_quant.default,),
    )
