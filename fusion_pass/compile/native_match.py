"""Static per-tensor FP8 in the native form: matched from the graph's elementwise ops, and rewritten.

vLLM's default compilation (``custom_ops="none"``) builds ``QuantFP8`` from aten ops (docs/formats.md). After the
attention op, each node the single reader of the one before (``s`` a one-element float32 tensor, the checkpoint's
activation scale):

* views that keep the row-major ``[T, H*Dv]`` order (:mod:`fusion_pass.compile.layout`);
* ``convert_element_type(x, float32)`` (absent when the attention writes float32);
* ``mul(x32, reciprocal(s))`` (either operand order; ``s`` through expands, views or float32 conversions);
* ``clamp_min(-448)`` and ``clamp_max(448)`` in either order, or ``clamp(-448, 448)``;
* ``convert_element_type(..., float8_e4m3fn)``: the quant's result ``[T, H*Dv]``, read by a GEMM form of the format
  as its activation, with ``s`` as its activation scale.

The rewrite allocates the result's float8_e4m3fn buffer and inlines the pattern's replacement, which takes the
reciprocal of ``s`` itself: the graph's own reciprocal, compiled by Inductor as the unfused graph's was (on CUDA an
approximate division), handed to the attention op as ``output_inv_scale``; the op multiplies by it and keeps a NaN
(:data:`fusion_pass.runtime.fp8_rows.NATIVE_FORM`), so its bytes are the unfused graph's.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from fusion_pass import formats
from fusion_pass.fp8 import E4M3_MAX
from fusion_pass.compile import layout, native_forms
from fusion_pass.compile.matcher import (Match, _match, attention_output_width, buffer_arg, gemm_reason,
                                         input_names, mutated_result, query_value)
from fusion_pass.compile.rewrite import inline_replacement
from fusion_pass.patterns import AttentionQuantPattern, OpVocabulary

__all__ = ["NativeMatch", "examine", "rewrite"]

aten, prims = torch.ops.aten, torch.ops.prims
_SCALE_STEPS = frozenset({aten.expand.default, aten.view.default, aten.reshape.default, aten.unsqueeze.default,
                          aten.squeeze.dim, aten.squeeze.default, prims.convert_element_type.default,
                          aten._to_copy.default, aten.clone.default})


class NativeMatch(Match):
    """A :class:`~fusion_pass.compile.matcher.Match` of the native form: ``quant`` is the final float8 conversion,
    ``chain`` every node from the attention's output to it, ``scale`` the one-element scale ``s``."""

    def __init__(self, match: Match, scale: Node):
        super().__init__(match.pattern, match.attention, match.quant, match.chain, match.form)
        self.scale = scale


def _single_reader(node: Node) -> Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _float32(node) -> bool:
    val = layout.value(node)
    return isinstance(val, torch.Tensor) and val.dtype == torch.float32


def _scale_source(node) -> Node | None:
    """``s`` behind the reciprocal's operand: through expands, views and float32 conversions of one float32
    element; None when it is not that."""
    while isinstance(node, Node) and node.target in _SCALE_STEPS and node.args and isinstance(node.args[0], Node):
        if node.target in native_forms.CONVERTS and native_forms.converts_to(node) != torch.float32:
            return None
        node = node.args[0]
    val = layout.value(node)
    if not (isinstance(node, Node) and isinstance(val, torch.Tensor) and val.dtype == torch.float32
            and layout.known_equal(val.numel(), 1)):
        return None
    return node


def _reciprocal_of(node) -> Node | None:
    """``s`` when ``node`` is ``reciprocal(s)`` (``s`` as :func:`_scale_source` finds it), else None."""
    if isinstance(node, Node) and node.target is aten.reciprocal.default:
        return _scale_source(node.args[0])
    return None


def _clamps(node: Node) -> tuple[list[Node], Node | str]:
    """The clamp nodes from ``node`` (the product's single reader) on, and the node after them; or a reason."""
    bounds, seen = set(), []
    while node is not None:
        if node.target is aten.clamp.default:
            lo, hi = (list(node.args[1:]) + [node.kwargs.get("min"), node.kwargs.get("max")])[:2]
            bounds |= {("min", lo), ("max", hi)}
        elif node.target is aten.clamp_min.default:
            bounds.add(("min", node.args[1]))
        elif node.target is aten.clamp_max.default:
            bounds.add(("max", node.args[1]))
        else:
            break
        seen.append(node)
        node = _single_reader(node)
    if bounds != {("min", -E4M3_MAX), ("max", E4M3_MAX)}:
        return seen, "fp8_native_quant_not_clamped_to_448"
    return seen, node


def examine(attention: Node, pattern: AttentionQuantPattern, vocab: OpVocabulary) -> NativeMatch | str:
    """A :class:`NativeMatch` of ``pattern`` (an entry whose ``quant`` is ``"native"``) at ``attention``, or why it
    is refused (module docstring for the chain; the layout proofs and the GEMM as for the op form)."""
    result = mutated_result(attention, "output")
    if result is None:
        return "attention_output_unused"
    chain, node = [], result
    while True:
        user = _single_reader(node)
        if user is None:
            return "bf16_output_has_other_users" if len(node.users) > 1 else "attention_output_unused"
        if user.target in layout.VIEW_CHAIN_OPS and user.args and user.args[0] is node:
            broken = layout.step_reason(user)
            if broken:
                return broken
            chain.append(user)
            node = user
            continue
        break
    viewed = feed = node
    if native_forms.native_quant_reason(user) is None:
        return "no_fp8_static_quant_consumer"
    if user.target in native_forms.CONVERTS and native_forms.converts_to(user) == torch.float32:
        chain.append(user)
        feed, user = user, _single_reader(user)
        if user is None:
            return "fp8_native_quant_has_other_readers"
    if user.target is not aten.mul.Tensor or len(user.args) != 2 or feed not in user.args:
        return "fp8_native_quant_is_not_a_scale_multiplication"
    scale = _reciprocal_of(user.args[1] if user.args[0] is feed else user.args[0])
    if scale is None or not _float32(user):
        return "fp8_native_quant_is_not_a_scale_multiplication"
    chain.append(user)
    product = _single_reader(user)
    if product is None:
        return "fp8_native_quant_has_other_readers"
    clamps, quant = _clamps(product)
    if isinstance(quant, str):
        return quant
    chain += clamps
    if quant is None or quant.target not in native_forms.CONVERTS \
            or native_forms.converts_to(quant) != formats.FP8_STATIC.element:
        return "fp8_native_quant_has_other_readers"
    q_val = query_value(attention)
    if not isinstance(q_val, torch.Tensor) or q_val.dim() < 1:
        return "unknown_attention_shape"
    width = attention_output_width(attention, q_val)
    if isinstance(width, str):
        return width
    tokens = q_val.shape[0]
    codes = layout.value(quant)
    if not layout.reads_token_rows(layout.value(viewed), tokens, width) or not (
            isinstance(codes, torch.Tensor) and codes.dim() == 2 and layout.tensor_is_row_major(codes)):
        return "quant_rows_are_not_tokens"
    reads_scale = lambda reader, arg: _scale_source(arg) is scale  # noqa: E731  (through views of s)
    return (gemm_reason(quant, reads_scale, vocab, pattern.format)
            or _native(_match(pattern, attention, width, quant, chain), scale))


def _native(found: Match | str, scale: Node) -> NativeMatch | str:
    return NativeMatch(found, scale) if isinstance(found, Match) else found


def rewrite(graph: Graph, match: NativeMatch, vocab: OpVocabulary) -> Node:
    """Apply ``match``: a float8_e4m3fn ``[T, H*Dv]`` buffer allocated where the quant's result was computed, the
    pattern's replacement inlined (it writes that buffer, handed ``s``), the quant's readers reading its result;
    the elementwise chain and the attention erased. Returns the new attention node."""
    quant, codes = match.quant, layout.value(match.quant)
    rows = _rows(graph, match, codes)
    with graph.inserting_before(quant):
        buffer = graph.call_function(aten.empty.memory_format, ([rows, codes.shape[1]],),
                                     {"dtype": codes.dtype, "device": codes.device, "pin_memory": False})
    buffer.meta["val"] = codes
    new_attention = inline_replacement(graph, match, vocab, [buffer, match.scale], [quant])
    for node in match.scale.users:  # the replacement's reciprocal of s: the shape and dtype of s
        if node.target is aten.reciprocal.default and "val" not in node.meta:
            node.meta["val"] = layout.value(match.scale)
    return new_attention


def _rows(graph: Graph, match: Match, codes: torch.Tensor):
    """The token count as the graph has it: the first size of the attention's query-dtype output buffer where it is
    allocated in the graph with the query's token count, else a ``sym_size`` of the query."""
    base = buffer_arg(match.attention, "output")
    if isinstance(base, Node) and base.target is aten.empty.memory_format:
        size = base.args[0]
        if size and layout.known_equal(layout.value(size[0]), codes.shape[0]):
            return size[0]
    if isinstance(codes.shape[0], int):
        return codes.shape[0]
    with graph.inserting_before(match.quant):
        query = match.attention.kwargs[input_names(match.attention, 1)[0]]
        node = graph.call_function(aten.sym_size.int, (query, 0))
    node.meta["val"] = codes.shape[0]
    return node
