"""vLLM's op vocabulary: the ops of vLLM's graphs for each role of the pattern table, the NVFP4 GEMM
forms of vLLM's NVFP4 linear kernels (:data:`VLLM_GEMM_FORMS`) and the static FP8 GEMM forms of its per-tensor FP8
linear kernels (:data:`VLLM_FP8_STATIC_GEMM_FORMS`) and the group FP8 GEMM forms of its block-FP8 linear kernels
(:data:`VLLM_FP8_GROUP_GEMM_FORMS`)."""

from __future__ import annotations

import torch

from fusion_pass import formats
from fusion_pass.patterns.vocabulary import GemmForm, OpVocabulary
from fusion_pass.vllm.runtime.fp8_group_rows import group_quant_op
from fusion_pass.vllm.runtime.fp8_static_rows import static_quant_op

__all__ = ["VLLM_FP8_GROUP_GEMM_FORMS", "VLLM_FP8_STATIC_GEMM_FORMS", "VLLM_GEMM_FORMS", "vllm_fp8_group_gemm_forms",
           "vllm_fp8_static_gemm_forms", "vllm_gemm_forms", "vllm_vocabulary"]

_NVFP4 = (("use_nvfp4", True), ("block_size", 16))  # flashinfer_mm_fp4's NVFP4 mode (else MXFP4)
_SCALES_8X4 = (("use_8x4_sf_layout", True, "gemm_scale_layout_8x4"),)
_FLASHINFER = ("vllm", "flashinfer_mm_fp4", "default", "A", "A_scale")

VLLM_GEMM_FORMS = (
    # (form name, (namespace, op, overload, activation argument, block-scale argument), expects, refuses,
    #  the kernel class of vllm/model_executor/kernels/linear/nvfp4/ that emits it), in vLLM's CUDA priority
    # order (_POSSIBLE_NVFP4_KERNELS). Every one quantizes with _C::scaled_fp4_quant.out into 128x4 swizzled
    # scales, except TRT-LLM at m <= 32 (8x4 scales: refused).
    ("flashinfer_cute_dsl", _FLASHINFER, (("backend", "cute-dsl"), *_NVFP4), _SCALES_8X4,
     "flashinfer.FlashInferCuteDslNvFp4LinearKernel"),
    ("flashinfer_cutlass", _FLASHINFER, (("backend", "cutlass"), *_NVFP4), _SCALES_8X4,
     "flashinfer.FlashInferCutlassNvFp4LinearKernel"),
    ("flashinfer_b12x", _FLASHINFER, (("backend", "b12x"), *_NVFP4), _SCALES_8X4,
     "flashinfer.FlashInferB12xNvFp4LinearKernel"),
    ("cutlass", ("_C", "cutlass_scaled_fp4_mm", "default", "a", "block_scale_a"), (), (),
     "cutlass.CutlassNvFp4LinearKernel"),
    ("flashinfer_trtllm", _FLASHINFER, (("backend", "trtllm"), *_NVFP4), _SCALES_8X4,
     "flashinfer.FlashInferTrtllmNvFp4LinearKernel"),
    ("flashinfer_cudnn", _FLASHINFER, (("backend", "cudnn"), *_NVFP4), _SCALES_8X4,
     "flashinfer.FlashInferCudnnNvFp4LinearKernel"),
    ("fbgemm", ("fbgemm", "f4f4bf16", "default", "XQ", "x_scale"), (("use_mx", False),), (),
     "fbgemm.FbgemmNvFp4LinearKernel"),
    ("b12x", ("b12x", "blockscaled_nvfp4", "default", "lhs_values", "lhs_scale_storage"), (), (),
     "b12x.B12xNvFp4LinearKernel"),
    ("torch_scaled_mm", ("aten", "_scaled_mm", "default", "self", "scale_a"), (), (),
     "pytorch.TorchNvFp4LinearKernel"),
)
"""The GEMM of every NVFP4 linear kernel of vLLM 0.32-0.34 that consumes ``scaled_fp4_quant``'s swizzled output
(docs/vllm.md, "NVFP4 GEMM forms"; each checked in the releases' wheels by tests_vllm_conformance). The weight-only kernels (Marlin, Humming, the W4A16 ones) and the
emulation kernel quantize no activation with it and have no form."""

VLLM_FP8_STATIC_GEMM_FORMS = (
    # (form name, (namespace, op, overload, activation argument, scale argument), the kernel class of
    #  vllm/model_executor/kernels/linear/scaled_mm/ that emits it). Each reads the codes static_scaled_fp8_quant
    # wrote ([M, K] float8_e4m3fn, as they are: the CUTLASS kernel's K padding for a weight whose K is not a multiple
    # of 16 copies them into a wider buffer, which is not matched) and the quant's scale as the activation scale.
    ("cutlass", ("_C", "cutlass_scaled_mm", "default", "a", "a_scales"), "cutlass.CutlassFP8ScaledMMLinearKernel"),
    ("flashinfer_bmm_fp8", ("vllm", "bmm_fp8", "default", "A", "A_scale"),
     "flashinfer.FlashInferFP8ScaledMMLinearKernel"),
)
"""The GEMM of vLLM's static per-tensor FP8 linear kernels of 0.32-0.34 besides ``torch._scaled_mm`` (the project's
own form, which ``PerTensorTorchFP8ScaledMMLinearKernel`` emits; docs/vllm.md, "FP8 forms"; each checked in the
releases' wheels by tests_vllm_conformance): SM90's CUTLASS ``_C::cutlass_scaled_mm(out, a, b, a_scales, b_scales,
bias)``, SM100's FlashInfer ``vllm::bmm_fp8(A, B, A_scale, B_scale, dtype, backend)`` (``A`` the codes unsqueezed to
``[1, M, K]``, a view of the same bytes)."""

VLLM_FP8_GROUP_GEMM_FORMS = (
    # (form name, (namespace, op, overload, activation argument, scale argument), the kernel class of
    #  vllm/model_executor/kernels/linear/scaled_mm/ that emits it). Each reads per_token_group_fp8_quant's codes
    # ([M, K] float8_e4m3fn) and its float32 group scales ([M, K/128], column-major: the view the quant wrote).
    ("deep_gemm", ("vllm", "fp8_gemm_nt_op", "default", "q_input", "input_scale"),
     "deep_gemm.DeepGemmFp8BlockScaledMMKernel"),
    ("cutlass_block", ("_C", "cutlass_scaled_mm", "default", "a", "a_scales"),
     "cutlass.CutlassFp8BlockScaledMMKernel"),
)
"""The GEMM of vLLM's block-FP8 linear kernels of 0.32-0.34 that read ``per_token_group_fp8_quant``'s output as it
is (docs/vllm.md, "FP8 forms"): SM90's DeepGEMM ``vllm::fp8_gemm_nt_op(q_input, input_scale, weight, weight_scale,
output, use_deep_gemm_e8m0)`` (TMA-aligned column-major UE8M0 scales) and the CUTLASS fallback
``_C::cutlass_scaled_mm(out, a, b, a_scales, b_scales, bias)`` (column-major scales), besides the project's own
``fusion_pass::fp8_group_gemm``."""

_REFUSED_QUANTS = (("vllm", "flashinfer_nvfp4_quantize", "default", "gemm_scale_layout_8x4"),)
"""NVFP4 quant ops writing a layout the fused call does not: FlashInfer's 8x4-scale quant, which
``scaled_fp4_quant`` calls for the TRT-LLM GEMM at m <= 32. The FP8 forms refused (dynamic per-token and
per-tensor scales, packed UE8M0 group scales) come from :data:`fusion_pass.formats.REFUSED`, each under its name."""


def _maybe(namespace: str, name: str, overload: str):
    """``torch.ops.<namespace>.<name>.<overload>``, or None where this build (or process) lacks it."""
    try:
        return getattr(getattr(getattr(torch.ops, namespace), name), overload)
    except (AttributeError, RuntimeError):
        return None


def vllm_gemm_forms() -> tuple[GemmForm, ...]:
    """The :data:`VLLM_GEMM_FORMS` whose op this process has (with the arguments the form names): a form
    whose op is absent (most ``_C`` and FlashInfer ops on vLLM's CPU build) cannot appear in a graph."""
    forms = []
    for name, (namespace, op_name, overload, activation, block_scale), expects, refuses, kernel in VLLM_GEMM_FORMS:
        form = GemmForm(f"vllm:{name}", _maybe(namespace, op_name, overload), activation, block_scale,
                        expects, refuses, (f"vllm.model_executor.kernels.linear.nvfp4.{kernel}",))
        if form.fits(form.op):
            forms.append(form)
    return tuple(forms)


def vllm_fp8_static_gemm_forms() -> tuple[GemmForm, ...]:
    """The :data:`VLLM_FP8_STATIC_GEMM_FORMS` whose op this process has with the arguments the form names (vLLM's
    CPU build has neither)."""
    forms = []
    for name, (namespace, op_name, overload, activation, scale), kernel in VLLM_FP8_STATIC_GEMM_FORMS:
        form = GemmForm(f"vllm:{name}", _maybe(namespace, op_name, overload), activation, scale,
                        emitted_by=(f"vllm.model_executor.kernels.linear.scaled_mm.{kernel}",), format="fp8_static")
        if form.fits(form.op):
            forms.append(form)
    return tuple(forms)


def vllm_fp8_group_gemm_forms() -> tuple[GemmForm, ...]:
    """The :data:`VLLM_FP8_GROUP_GEMM_FORMS` whose op this process has with the arguments the form names."""
    forms = []
    for name, (namespace, op_name, overload, activation, scale), kernel in VLLM_FP8_GROUP_GEMM_FORMS:
        form = GemmForm(f"vllm:{name}", _maybe(namespace, op_name, overload), activation, scale,
                        emitted_by=(f"vllm.model_executor.kernels.linear.scaled_mm.{kernel}",),
                        format="fp8_group128")
        if form.fits(form.op):
            forms.append(form)
    return tuple(forms)


def vllm_vocabulary() -> OpVocabulary | None:
    """vLLM's ops, or None when vLLM is not installed.

    Attention: ``vllm::unified_attention_with_output`` / ``unified_mla_attention_with_output``;
    quant: ``_C::scaled_fp4_quant.out`` where vLLM's build has it and ``_C::cutlass_scaled_fp4_mm`` (CUDA
    NVFP4 builds have both; the run-time fallback quantizes with the same op), else this project's
    ``fusion_pass::scaled_fp4_quant.out`` (what an NVFP4 linear method built on this project's ops emits,
    e.g. on vLLM's CPU build); GEMM forms: this project's ``fusion_pass::nvfp4_gemm`` (first: it is the
    vocabulary's ``nvfp4_gemm``), then :func:`vllm_gemm_forms`. Static per-tensor FP8: quant
    ``_C::static_scaled_fp8_quant`` where vLLM's build has it with its schema (vLLM's QuantFP8 op form, ``+quant_fp8``;
    vLLM's CPU build registers the name without arguments), else this project's ``fusion_pass::static_scaled_fp8_quant``
    (:func:`fusion_pass.vllm.runtime.fp8_static_rows.static_quant_op`: the run-time fallback quantizes with the same
    op); GEMM forms: ``aten::_scaled_mm`` (the project's form), then :func:`vllm_fp8_static_gemm_forms`. FP8
    128-column groups: quant ``_C::per_token_group_fp8_quant`` where vLLM's build has it with its schema, else the
    project's (:func:`fusion_pass.vllm.runtime.fp8_group_rows.group_quant_op`); GEMM forms:
    ``fusion_pass::fp8_group_gemm``, then :func:`vllm_fp8_group_gemm_forms`. The other FP8 quants are refused under
    their names. The replacements call ``fusion_pass::vllm_attention_nvfp4`` /
    ``vllm_mla_attention_nvfp4`` (registered by :mod:`fusion_pass.vllm`; every format), never vLLM's op with
    ``output_scale``.

    Raises ``RuntimeError`` naming what is missing when vLLM is installed but its ops (or ours)
    are not registered in this process.
    """
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    from fusion_pass.patterns.vocabulary import fusion_pass_vocabulary

    own_vocab = fusion_pass_vocabulary()  # registers the project's ops

    def lookup(namespace: str, name: str, overload: str, hint: str):
        op = _maybe(namespace, name, overload)
        if op is None:
            raise RuntimeError(f"vllm_vocabulary: torch.ops.{namespace}.{name}.{overload} is not registered in "
                               f"this process ({hint})")
        return op

    hint_vllm = "import vllm.model_executor.layers.attention first; is this a vLLM release with these ops?"
    hint_ours = "call fusion_pass.vllm.runtime.attention_op.register() first (the vLLM plugin does)"
    fp8_static = static_quant_op()
    fp8_group = group_quant_op()
    c_quant = _maybe("_C", "scaled_fp4_quant", "out")
    if _maybe("_C", "cutlass_scaled_fp4_mm", "default") is None:  # the rule of the run-time fallback's quant_op
        c_quant = None                                              # (fusion_pass.vllm): the same quant, same bytes
    return OpVocabulary(
        name="vllm" + ("" if c_quant is not None else "+fusion_pass_quant"),
        attention=lookup("vllm", "unified_attention_with_output", "default", hint_vllm),
        mla_attention=lookup("vllm", "unified_mla_attention_with_output", "default", hint_vllm),
        nvfp4_quant=c_quant if c_quant is not None else own_vocab.nvfp4_quant,
        nvfp4_gemms=own_vocab.nvfp4_gemms + vllm_gemm_forms(),
        other_quants=tuple(op for op in (_maybe("_C", "per_token_group_fp8_quant", "default"),
                                         *own_vocab.other_quants) if op is not None and op not in (fp8_static,
                                                                                                  fp8_group)),
        refused_quants=tuple((op, reason) for op, reason in (
            *((_maybe(*q[:3]), q[3]) for q in _REFUSED_QUANTS), *((_maybe(*f.op), f.name) for f in formats.REFUSED))
            if op is not None),
        fused_attention=lookup("fusion_pass", "vllm_attention_nvfp4", "default", hint_ours),
        fused_mla_attention=lookup("fusion_pass", "vllm_mla_attention_nvfp4", "default", hint_ours),
        fp8_static_quant=fp8_static,
        fp8_static_gemms=own_vocab.fp8_static_gemms + vllm_fp8_static_gemm_forms(),
        fp8_group_quant=fp8_group,
        fp8_group_gemms=own_vocab.fp8_group_gemms + vllm_fp8_group_gemm_forms(),
    )
