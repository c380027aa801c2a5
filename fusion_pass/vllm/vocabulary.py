"""vLLM's op vocabulary: the ops of vLLM's graphs for each role of the pattern table."""

from __future__ import annotations

import torch

from fusion_pass.patterns.vocabulary import OpVocabulary

__all__ = ["VLLM_VERSIONS", "vllm_vocabulary"]

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
    hint_ours = "call fusion_pass.vllm.attention_op.register() first (the vLLM plugin does)"
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
