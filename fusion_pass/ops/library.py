"""The ``torch.ops.fusion_pass`` library: its schemas and how an op's implementations are registered.

Schemas mirror vLLM's so that compiled graphs of the demo models look like vLLM's:

* ``scaled_fp4_quant.out`` <-> ``_C::scaled_fp4_quant.out``
* ``nvfp4_gemm`` <-> ``_C::cutlass_scaled_fp4_mm`` (functional form)
* ``attention_with_output`` <-> ``vllm::unified_attention_with_output``
* ``mla_attention_with_output`` <-> ``vllm::unified_mla_attention_with_output`` (its group-FP8 arguments
  ``quant_group_size`` ... ``quant_tma_aligned`` too, given to the standard op alike, after this project's
  ``output_inv_scale``; the quant kernel does not read the two layout flags: the scale buffer's strides say it)
* ``fp8_group_gemm`` <-> a block-FP8 linear's GEMM (``_C::cutlass_scaled_mm`` with group scales, functional form)

Every op has a fake (meta) implementation, so torch.compile traces them with a symbolic token count.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["NAMESPACE", "SCHEMAS", "dense", "fake", "impl", "qualname"]

NAMESPACE = "fusion_pass"


SCHEMAS = {
    "scaled_fp4_quant.out": (
        "scaled_fp4_quant.out(Tensor input, Tensor input_scale, bool is_sf_swizzled_layout, *, "
        "Tensor(a!) output, Tensor(b!) output_scale) -> ()"
    ),
    "nvfp4_gemm": (
        "nvfp4_gemm(Tensor a, Tensor b, Tensor block_scale_a, Tensor block_scale_b, Tensor alpha, "
        "ScalarType out_dtype) -> Tensor"
    ),
    "static_scaled_fp8_quant": (
        "static_scaled_fp8_quant(Tensor! result, Tensor input, Tensor scale, int[]? group_shape=None) -> ()"
    ),
    "per_token_group_fp8_quant": (
        "per_token_group_fp8_quant(Tensor input, Tensor(a!) output_q, Tensor(b!) output_s, int group_size, "
        "float eps, float fp8_min, float fp8_max, bool scale_ue8m0, bool dummy_is_scale_transposed, "
        "bool dummy_is_tma_aligned) -> ()"
    ),
    "fp8_group_gemm": (
        "fp8_group_gemm(Tensor a, Tensor b, Tensor a_scales, Tensor b_scales, ScalarType out_dtype) -> Tensor"
    ),
    "attention_with_output": (
        "attention_with_output(Tensor q, Tensor k, Tensor v, Tensor(a!) output, str layer_name, "
        "Tensor? output_scale=None, Tensor(b!)? output_block_scale=None, Tensor? output_inv_scale=None, "
        "int? quant_group_size=None, bool? quant_scale_ue8m0=None, bool? quant_col_major=None, "
        "bool? quant_tma_aligned=None) -> ()"
    ),
    "mla_attention_with_output": (
        "mla_attention_with_output(Tensor q, Tensor kv_c_normed, Tensor k_pe, Tensor(a!) output, "
        "str layer_name, Tensor? output_scale=None, Tensor(b!)? output_block_scale=None, "
        "Tensor? output_inv_scale=None, int? quant_group_size=None, bool? quant_scale_ue8m0=None, "
        "bool? quant_col_major=None, bool? quant_tma_aligned=None) -> ()"
    ),
}

_lib = torch.library.Library(NAMESPACE, "DEF")
for _schema in SCHEMAS.values():
    _lib.define(_schema)


def qualname(name: str) -> str:
    return f"{NAMESPACE}::{name}"


def impl(name: str):
    """Register the eager implementation of ``name`` for every backend."""

    def register(fn):
        _lib.impl(name, fn, "CompositeExplicitAutograd")
        return fn

    return register


def fake(name: str):
    def register(fn):
        torch.library.register_fake(qualname(name), fn, lib=_lib)
        return fn

    return register



def dense(t: Tensor) -> bool:
    """Contiguous, and viewable as another element size: ``is_contiguous()`` ignores the
    strides of size-1 dims, torch's dtype-changing ``view`` needs ``stride(-1) == 1``."""
    return t.is_contiguous() and (t.dim() == 0 or t.stride(-1) == 1)
