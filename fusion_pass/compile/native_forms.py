"""A quant written as elementwise aten ops, no quant op in the graph, recognized.

vLLM's default compilation (``custom_ops="none"``) builds ``QuantFP8``'s native form: the attention output converted
to float32, multiplied by the scale's reciprocal, clamped to ±448 and converted to float8_e4m3fn, each an aten op of
the post-grad graph (docs/vllm.md, "FP8 forms"). The ``*_fp8_static_native`` entries match and rewrite it
(:mod:`fusion_pass.compile.native_match`); an entry of another form whose candidate flows into it is refused with
:data:`NATIVE_FP8_REASON`, which is what the report shows when the native entries are not enabled (or the
vocabulary's fused op cannot write it).
"""

from __future__ import annotations

import torch
from torch.fx import Node

__all__ = ["CONVERTS", "NATIVE_FP8_REASON", "converts_to", "native_quant_reason"]

NATIVE_FP8_REASON = "fp8_native_quant_not_matched"
"""The refusal of an attention output quantized to FP8 by elementwise ops (docs/debugging.md)."""

aten, prims = torch.ops.aten, torch.ops.prims
CONVERTS = (prims.convert_element_type.default, aten._to_copy.default)
_ELEMENTWISE = frozenset({*CONVERTS, aten.mul.Tensor, aten.div.Tensor, aten.reciprocal.default, aten.clamp.default,
                          aten.clamp_min.default, aten.clamp_max.default})


def converts_to(node: Node) -> torch.dtype | None:
    if node.target is prims.convert_element_type.default and len(node.args) > 1:
        return node.args[1]
    return node.kwargs.get("dtype") if node.target is aten._to_copy.default else None


def native_quant_reason(node: Node, depth: int = 6) -> str | None:
    """:data:`NATIVE_FP8_REASON` when ``node`` (a reader of the attention output) starts a chain of at most ``depth``
    single-reader elementwise ops (conversions, multiplications, divisions, reciprocals, clamps) that converts to
    float8_e4m3fn; else None."""
    for _ in range(depth):
        if node.target not in _ELEMENTWISE:
            return None
        if node.target in CONVERTS and converts_to(node) == torch.float8_e4m3fn:
            return NATIVE_FP8_REASON
        if len(node.users) != 1:
            return None
        (node,) = node.users
    return None
