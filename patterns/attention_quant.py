"""attention -> scaled_fp4_quant (-> o_proj NVFP4 GEMM) patterns, written once over an op vocabulary.

Each pattern is a pair of small plain functions with the semantics of the
subgraph as a model writes it (mutating ops, eager calls) and of its
replacement: the attention op writes NVFP4 into the quant's buffers itself.
``ops`` is an :class:`~fusion_pass.patterns.vocabulary.OpVocabulary`; the pass
binds it and traces both functions once per process. The traced pattern drives
the match (:mod:`fusion_pass.compile.matcher`): its wrapped ops are the anchors the
matcher looks for, in order, and the optional arguments its attention call
sets (``output_scale``...) say which graph form a candidate node must be in.

Two graph forms, each written for MLA and for standard attention:

* ``*_nvfp4_quant``: attention writes the query dtype, a quant op reads it.
  The rewrite inlines the traced replacement in place of attention + quant.
* ``*_nvfp4_prequantized``: another pass (vLLM's attention+quant fusion)
  already gave the attention op the quant's buffers (``output_scale`` /
  ``output_block_scale``). The rewrite retargets that call to the
  vocabulary's fused op (same arguments), so the fused kernel runs there; in a
  vocabulary whose attention op is its own fused op it is refused as
  ``attention_already_quantized`` (never rewritten twice).
* ``*_fp8_static_native``: no quant op; the quant is aten ops (vLLM's ``QuantFP8`` under the default
  ``custom_ops="none"``). The replacement hands the attention op the graph's reciprocal of the scale as
  ``output_inv_scale`` (:mod:`fusion_pass.compile.native_match`).

The ``*_fp8_static_quant`` entries are the op form for static per-tensor FP8 (``static_scaled_fp8_quant``); the
``*_fp8_group_quant`` entries FP8 with 128-column groups (``per_token_group_fp8_quant``, plain or UE8M0 scales in
any of vLLM's three scale layouts): the fused call writes the codes and the scales into the quant's buffers.

Shapes (T tokens, H heads, Dv = v_head_dim):
``output`` [T, H*Dv] (MLA) or [T, H, Dv] (standard) in the query dtype;
``quant_out`` uint8 [T, H*Dv/2]; ``quant_scale`` int32
[round_up(T,128), round_up(H*Dv/16,4)/4]; ``global_scale`` float32 [1].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fusion_pass.fp8 import E4M3_MAX as FP8_MAX
from fusion_pass.fp8 import GROUP_SIZE as FP8_GROUP
from fusion_pass.fp8 import SCALE_EPS as FP8_EPS
from fusion_pass.nvfp4 import BLOCK_SIZE

# The bridge between the two ops' names: the quant op's ``output`` / ``output_scale`` are the packed codes and
# the block scales (``quant_out`` / ``quant_scale`` here); the attention op takes them as ``output`` /
# ``output_block_scale``, and its own ``output_scale`` is the global scale (the quant's ``input_scale``).

# ---------------------------------------------------------------- MLA


def mla_pattern(ops, q, kv_c_normed, k_pe, output, quant_out, quant_scale, global_scale, layer_name):
    ops.mla_attention(q, kv_c_normed, k_pe, output, layer_name)
    ops.nvfp4_quant(output, global_scale, True, output=quant_out, output_scale=quant_scale)
    return quant_out, quant_scale


def mla_replacement(ops, q, kv_c_normed, k_pe, output, quant_out, quant_scale, global_scale, layer_name):
    ops.writing_quantized("mla_attention")(q, kv_c_normed, k_pe, quant_out, layer_name, global_scale, quant_scale)
    return quant_out, quant_scale


# ---------------------------------------------------------------- standard attention (MHA / GQA)


def attention_pattern(ops, q, k, v, output, quant_out, quant_scale, global_scale, layer_name):
    ops.attention(q, k, v, output, layer_name)
    flat = output.reshape(output.shape[0], -1)  # the view between attention and quant in real graphs
    ops.nvfp4_quant(flat, global_scale, True, output=quant_out, output_scale=quant_scale)
    return quant_out, quant_scale


def attention_replacement(ops, q, k, v, output, quant_out, quant_scale, global_scale, layer_name):
    ops.writing_quantized("attention")(q, k, v, quant_out, layer_name, global_scale, quant_scale)
    return quant_out, quant_scale


# ---------------------------------------------------------------- static per-tensor FP8 (``static_scaled_fp8_quant``)


def mla_fp8_static_pattern(ops, q, kv_c_normed, k_pe, output, quant_out, scale, layer_name):
    ops.mla_attention(q, kv_c_normed, k_pe, output, layer_name)
    ops.fp8_static_quant(quant_out, output, scale)
    return (quant_out,)


def mla_fp8_static_replacement(ops, q, kv_c_normed, k_pe, output, quant_out, scale, layer_name):
    ops.writing_quantized("mla_attention")(q, kv_c_normed, k_pe, quant_out, layer_name, scale)
    return (quant_out,)


def attention_fp8_static_pattern(ops, q, k, v, output, quant_out, scale, layer_name):
    ops.attention(q, k, v, output, layer_name)
    ops.fp8_static_quant(quant_out, output.reshape(output.shape[0], -1), scale)
    return (quant_out,)


def attention_fp8_static_replacement(ops, q, k, v, output, quant_out, scale, layer_name):
    ops.writing_quantized("attention")(q, k, v, quant_out, layer_name, scale)
    return (quant_out,)


# ---------------------------------------------------------------- static per-tensor FP8, native form (no quant op)


def native_fp8_static(x, scale):
    """vLLM's ``QuantFP8`` for a static per-tensor scale as the default compile builds it (``custom_ops="none"``):
    aten ops, no quant op (docs/formats.md)."""
    return (x.to(torch.float32) * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def mla_fp8_native_pattern(ops, q, kv_c_normed, k_pe, output, quant_out, scale, layer_name):
    ops.mla_attention(q, kv_c_normed, k_pe, output, layer_name)
    return (native_fp8_static(output, scale),)


def mla_fp8_native_replacement(ops, q, kv_c_normed, k_pe, output, quant_out, scale, layer_name):
    ops.writing_quantized("mla_attention")(q, kv_c_normed, k_pe, quant_out, layer_name,
                                           output_inv_scale=scale.reciprocal())
    return (quant_out,)


def attention_fp8_native_pattern(ops, q, k, v, output, quant_out, scale, layer_name):
    ops.attention(q, k, v, output, layer_name)
    return (native_fp8_static(output.reshape(output.shape[0], -1), scale),)


def attention_fp8_native_replacement(ops, q, k, v, output, quant_out, scale, layer_name):
    ops.writing_quantized("attention")(q, k, v, quant_out, layer_name, output_inv_scale=scale.reciprocal())
    return (quant_out,)


# ---------------------------------------------------------------- FP8 128-column groups (``per_token_group_fp8_quant``)
# The quant's flags (UE8M0, the scale layout) are constants of each call; the traced replacement is written with
# the defaults and the rewrite gives the fused call the matched call's values (``QuantForm.forwards``).


def _fp8_group_quant(ops, x, quant_out, quant_scales):
    ops.fp8_group_quant(x, quant_out, quant_scales, FP8_GROUP, FP8_EPS, -FP8_MAX, FP8_MAX, False, False, False)


def mla_fp8_group_pattern(ops, q, kv_c_normed, k_pe, output, quant_out, quant_scales, layer_name):
    ops.mla_attention(q, kv_c_normed, k_pe, output, layer_name)
    _fp8_group_quant(ops, output, quant_out, quant_scales)
    return quant_out, quant_scales


def mla_fp8_group_replacement(ops, q, kv_c_normed, k_pe, output, quant_out, quant_scales, layer_name):
    ops.writing_quantized("mla_attention")(q, kv_c_normed, k_pe, quant_out, layer_name,
                                           output_block_scale=quant_scales, quant_group_size=FP8_GROUP)
    return quant_out, quant_scales


def attention_fp8_group_pattern(ops, q, k, v, output, quant_out, quant_scales, layer_name):
    ops.attention(q, k, v, output, layer_name)
    _fp8_group_quant(ops, output.reshape(output.shape[0], -1), quant_out, quant_scales)
    return quant_out, quant_scales


def attention_fp8_group_replacement(ops, q, k, v, output, quant_out, quant_scales, layer_name):
    ops.writing_quantized("attention")(q, k, v, quant_out, layer_name, output_block_scale=quant_scales,
                                       quant_group_size=FP8_GROUP)
    return quant_out, quant_scales


# ---------------------------------------------------------------- already quantized by another pass


def mla_prequantized_pattern(ops, q, kv_c_normed, k_pe, output, quant_out, quant_scale, global_scale, layer_name):
    ops.mla_attention(q, kv_c_normed, k_pe, quant_out, layer_name, global_scale, quant_scale)
    return quant_out, quant_scale


def attention_prequantized_pattern(ops, q, k, v, output, quant_out, quant_scale, global_scale, layer_name):
    ops.attention(q, k, v, quant_out, layer_name, global_scale, quant_scale)
    return quant_out, quant_scale


# ---------------------------------------------------------------- example inputs and checks

_T, _H, _DV = 8, 2, 16


def _nvfp4_buffers(width: int):
    quant_scale_cols = ((width // BLOCK_SIZE + 3) // 4 * 4) // 4
    return (torch.empty(_T, width // 2, dtype=torch.uint8), torch.empty(128, quant_scale_cols, dtype=torch.int32),
            torch.ones(1, dtype=torch.float32))


def _fp8_static_buffers(width: int):
    return torch.empty(_T, width, dtype=torch.float8_e4m3fn), torch.ones(1, dtype=torch.float32)


def _mla_inputs(dv: int):
    """MLA's attention inputs and its query-dtype output buffer, ``v_head_dim = dv``."""
    nope, rope, lora = 16, 8, 32
    return (torch.randn(_T, _H, nope + rope, dtype=torch.bfloat16), torch.randn(_T, lora, dtype=torch.bfloat16),
            torch.randn(_T, 1, rope, dtype=torch.bfloat16), torch.empty(_T, _H * dv, dtype=torch.bfloat16))


def _attention_inputs(dv: int):
    """Standard attention's inputs and its query-dtype output buffer, ``v_head_dim = dv``."""
    d, hkv = 16, 1
    return (torch.randn(_T, _H, d, dtype=torch.bfloat16), torch.randn(_T, hkv, d, dtype=torch.bfloat16),
            torch.randn(_T, hkv, dv, dtype=torch.bfloat16), torch.empty(_T, _H, dv, dtype=torch.bfloat16))


def mla_example_inputs():
    return (*_mla_inputs(_DV), *_nvfp4_buffers(_H * _DV))


def attention_example_inputs():
    return (*_attention_inputs(_DV), *_nvfp4_buffers(_H * _DV))


def mla_fp8_static_example_inputs():
    return (*_mla_inputs(_DV), *_fp8_static_buffers(_H * _DV))


def attention_fp8_static_example_inputs():
    return (*_attention_inputs(_DV), *_fp8_static_buffers(_H * _DV))


_GROUP_DV = 64  # two heads of 64: one 128-column group


def _fp8_group_buffers():
    width = _H * _GROUP_DV
    return (torch.empty(_T, width, dtype=torch.float8_e4m3fn),
            torch.empty(_T, width // FP8_GROUP, dtype=torch.float32))


def mla_fp8_group_example_inputs():
    return (*_mla_inputs(_GROUP_DV), *_fp8_group_buffers())


def attention_fp8_group_example_inputs():
    return (*_attention_inputs(_GROUP_DV), *_fp8_group_buffers())


def v_head_dim_fits_fp8_groups(shape) -> str | None:
    """The fused epilogue computes a group's scale inside one head's tile: a head must span whole 128-column
    groups."""
    if shape.v_head_dim % FP8_GROUP:
        return "v_head_dim_not_multiple_of_128"
    return None


def any_head_dim(shape) -> str | None:
    """Per-tensor FP8 writes each element on its own: any head width."""
    return None


def v_head_dim_fits_nvfp4_blocks(shape) -> str | None:
    """The fused epilogue quantizes one head's tile: a head must span whole 16-element blocks."""
    if shape.v_head_dim % BLOCK_SIZE:
        return "v_head_dim_not_multiple_of_16"
    return None


@dataclass(frozen=True)
class AttentionQuantPattern:
    """One entry of the pattern table.

    ``pattern`` / ``replacement(ops, *example_inputs(), layer_name)`` are the
    plain functions; ``role`` names the vocabulary's attention op; ``inputs``
    are that op's tensor inputs (the first ``len(inputs)`` arguments);
    ``extra_check(shape)`` (``shape`` a :class:`fusion_pass.compile.matcher.AttentionShape`: ``num_heads``,
    ``v_head_dim``) returns a refusal reason or None; ``format`` names the output format
    (:data:`fusion_pass.formats.FORMATS`) whose quant form (:meth:`OpVocabulary.quant_form`) and GEMM forms
    the match follows; ``quant``: ``"op"`` (the graph calls a quant op: the anchors of the traced ``pattern``
    say the graph form, module docstring) or ``"native"`` (the quant is the pattern's elementwise aten ops:
    :mod:`fusion_pass.compile.native_match`).
    """

    name: str
    role: str
    inputs: tuple[str, ...]
    pattern: Callable
    replacement: Callable
    example_inputs: Callable[[], tuple]
    extra_check: Callable = v_head_dim_fits_nvfp4_blocks
    format: str = "nvfp4"
    quant: str = "op"


PATTERNS: tuple[AttentionQuantPattern, ...] = (
    AttentionQuantPattern("mla_attention_nvfp4_quant", "mla_attention", ("q", "kv_c_normed", "k_pe"),
                          mla_pattern, mla_replacement, mla_example_inputs),
    AttentionQuantPattern("attention_nvfp4_quant", "attention", ("q", "k", "v"),
                          attention_pattern, attention_replacement, attention_example_inputs),
    AttentionQuantPattern("mla_attention_nvfp4_prequantized", "mla_attention", ("q", "kv_c_normed", "k_pe"),
                          mla_prequantized_pattern, mla_replacement, mla_example_inputs),
    AttentionQuantPattern("attention_nvfp4_prequantized", "attention", ("q", "k", "v"),
                          attention_prequantized_pattern, attention_replacement, attention_example_inputs),
    AttentionQuantPattern("mla_attention_fp8_static_quant", "mla_attention", ("q", "kv_c_normed", "k_pe"),
                          mla_fp8_static_pattern, mla_fp8_static_replacement, mla_fp8_static_example_inputs,
                          any_head_dim, "fp8_static"),
    AttentionQuantPattern("attention_fp8_static_quant", "attention", ("q", "k", "v"),
                          attention_fp8_static_pattern, attention_fp8_static_replacement,
                          attention_fp8_static_example_inputs, any_head_dim, "fp8_static"),
    AttentionQuantPattern("mla_attention_fp8_static_native", "mla_attention", ("q", "kv_c_normed", "k_pe"),
                          mla_fp8_native_pattern, mla_fp8_native_replacement, mla_fp8_static_example_inputs,
                          any_head_dim, "fp8_static", "native"),
    AttentionQuantPattern("attention_fp8_static_native", "attention", ("q", "k", "v"),
                          attention_fp8_native_pattern, attention_fp8_native_replacement,
                          attention_fp8_static_example_inputs, any_head_dim, "fp8_static", "native"),
    AttentionQuantPattern("mla_attention_fp8_group_quant", "mla_attention", ("q", "kv_c_normed", "k_pe"),
                          mla_fp8_group_pattern, mla_fp8_group_replacement, mla_fp8_group_example_inputs,
                          v_head_dim_fits_fp8_groups, "fp8_group128"),
    AttentionQuantPattern("attention_fp8_group_quant", "attention", ("q", "k", "v"),
                          attention_fp8_group_pattern, attention_fp8_group_replacement,
                          attention_fp8_group_example_inputs, v_head_dim_fits_fp8_groups, "fp8_group128"),
)
