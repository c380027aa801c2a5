"""Op vocabularies: the ops a pattern is written over.

A pattern names roles ("the MLA attention op", "the NVFP4 quant op", ...), never
concrete ops; a vocabulary binds the roles to one library's ops. The same
patterns then match graphs built from ``torch.ops.fusion_pass`` and, where it
is installed, from vLLM's ops.
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


VLLM_VERSIONS = ("0.32.",)
"""vLLM releases the vLLM vocabulary and its run-time op were written against (prefixes)."""


def vllm_vocabulary() -> OpVocabulary | None:
    """vLLM's ops, or None when vLLM is not installed.

    Attention: ``vllm::unified_attention_with_output`` / ``unified_mla_attention_with_output``;
    quant and GEMM: ``_C::scaled_fp4_quant.out`` / ``cutlass_scaled_fp4_mm`` where vLLM's build has
    them (CUDA), else this project's ``fusion_pass::scaled_fp4_quant.out`` / ``nvfp4_gemm`` (what an
    NVFP4 linear method built on this project's ops emits, e.g. on vLLM's CPU build). The
    replacements call ``fusion_pass::vllm_attention_nvfp4`` / ``vllm_mla_attention_nvfp4``
    (registered by :mod:`fusion_pass.vllm`), never vLLM's op with ``output_scale``.

    Raises ``RuntimeError`` naming what is missing when vLLM is installed but its ops (or ours)
    are not registered in this process.
    """
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    import fusion_pass.ops  # noqa: F401  (registers the ops)

    def lookup(namespace: str, name: str, overload: str, hint: str):
        packet = getattr(getattr(torch.ops, namespace), name, None) if hasattr(torch.ops, namespace) else None
        op = getattr(packet, overload, None) if packet is not None else None
        if op is None:
            raise RuntimeError(f"vllm_vocabulary: torch.ops.{namespace}.{name}.{overload} is not registered in "
                               f"this process ({hint})")
        return op

    def maybe(namespace: str, name: str, overload: str):
        try:
            return getattr(getattr(getattr(torch.ops, namespace), name), overload)
        except (AttributeError, RuntimeError):
            return None

    hint_vllm = "import vllm.model_executor.layers.attention first; is this a vLLM release with these ops?"
    hint_ours = "import fusion_pass.vllm.attention first (fusion_pass.vllm registers it)"
    own = torch.ops.fusion_pass
    c_quant, c_gemm = maybe("_C", "scaled_fp4_quant", "out"), maybe("_C", "cutlass_scaled_fp4_mm", "default")
    on_c = c_quant is not None and c_gemm is not None
    return OpVocabulary(
        name="vllm" + ("" if on_c else "+fusion_pass_quant"),
        attention=lookup("vllm", "unified_attention_with_output", "default", hint_vllm),
        mla_attention=lookup("vllm", "unified_mla_attention_with_output", "default", hint_vllm),
        nvfp4_quant=c_quant if on_c else own.scaled_fp4_quant.out,
        nvfp4_gemm=c_gemm if on_c else own.nvfp4_gemm.default,
        other_quants=tuple(op for op in (maybe("_C", "static_scaled_fp8_quant", "default"),
                                         own.static_scaled_fp8_quant.default) if op is not None),
        fused_attention=lookup("fusion_pass", "vllm_attention_nvfp4", "default", hint_ours),
        fused_mla_attention=lookup("fusion_pass", "vllm_mla_attention_nvfp4", "default", hint_ours),
    )
