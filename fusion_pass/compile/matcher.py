"""Find attention -> NVFP4 quant -> GEMM chains in a post-grad graph, refuse with a reason, or rewrite.

Mutating ops appear in the post-grad graph wrapped in one of two higher-order
ops, and both are handled:

* ``auto_functionalized(op, **kwargs)`` (v1; vLLM forces it): mutable args are
  kwargs, result ``i`` of the wrapper is the ``i``-th mutable arg after the op's
  own return value;
* ``auto_functionalized_v2(op, **kwargs, _all_bases=[...])`` (torch.compile's
  default): mutable args are given as bases (``_<arg>_base_index``), and the
  wrapper returns the op's return value followed by the mutated bases.

Every attention node of the vocabulary is a candidate. The pattern table
drives the match: an entry's traced pattern gives its anchors (the wrapped ops
in order) and the optional output arguments its attention call sets;
:func:`applies` selects the entries whose first anchor and form a node has.
:func:`examine` then returns a :class:`Match` or the reason it is refused, and
:func:`fusion_pass.compile.rewrite.rewrite` applies it. Two forms follow from the anchors (the native form
of static FP8, with no quant op: :mod:`fusion_pass.compile.native_match`):

* attention -> quant (two anchors): the quant must read the attention output
  through order-keeping views; the pattern's traced replacement is inlined in
  place of attention + quant;
* attention alone, already given the quant's buffers by another pass (one
  anchor): the call is retargeted to the vocabulary's fused op, which has the
  same arguments.

A match is a proof, from the nodes' traced values, that the quant reads the
attention output's elements in row-major ``[T, H*Dv]`` order with ``T`` the
query's symbolic token count (:mod:`fusion_pass.compile.layout`); whatever cannot be
proven is refused with a reason naming what failed.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass

import torch
from torch.fx import Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.functional_tensor import dispatch_functionalize

from fusion_pass import formats
from fusion_pass.compile import layout, native_forms
from fusion_pass.patterns import AttentionQuantPattern, OpVocabulary, QuantForm

aten = torch.ops.aten
HOPS = {
    torch.ops.higher_order.auto_functionalized: "v1",
    torch.ops.higher_order.auto_functionalized_v2: "v2",
}


# ---------------------------------------------------------------- the two functionalized forms


def wrapped_op(node: Node):
    """``(op, form)`` when ``node`` is an auto_functionalized[_v2] call, else ``(None, None)``."""
    if node.op == "call_function" and node.target in HOPS:
        return node.args[0], HOPS[node.target]
    return None, None


def _mutable_args(op) -> list[str]:
    return [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def _result_index(node: Node, arg: str) -> int | None:
    op, form = wrapped_op(node)
    if form == "v1":
        return 1 + _mutable_args(op).index(arg)
    base = node.kwargs.get(f"_{arg}_base_index")
    return None if base is None else 1 + base


def mutated_result(node: Node, arg: str) -> Node | None:
    """The getitem node that carries ``arg`` after the mutation (None if nobody reads it)."""
    index = _result_index(node, arg)
    for user in node.users:
        if user.target is operator.getitem and user.args[1] == index:
            return user
    return None


def buffer_arg(node: Node, arg: str):
    """The node passed as mutable ``arg`` (its base, in the v2 form)."""
    if wrapped_op(node)[1] == "v1":
        return node.kwargs.get(arg)
    base = node.kwargs.get(f"_{arg}_base_index")
    return None if base is None else node.kwargs["_all_bases"][base]


def is_view_of_base(node: Node, arg: str) -> bool:
    """In the v2 form: the mutable arg was a view (with its own size/stride) of its base."""
    return wrapped_op(node)[1] == "v2" and f"_{arg}_size" in node.kwargs


def input_names(node: Node, count: int) -> list[str]:
    """The names of the first ``count`` arguments of the wrapped op: its tensor inputs.

    Vocabularies name them differently (``q``/``k``/``v`` here, ``query``/``key``/``value``
    in vLLM's standard attention op); the schema is the source of truth.
    """
    return [a.name for a in wrapped_op(node)[0]._schema.arguments[:count]]


def query_value(attention: Node):
    """The traced value of the attention op's first input (the query, ``[T, H, Dqk]``)."""
    return layout.value(attention.kwargs.get(input_names(attention, 1)[0]))


def layer_label(attention: Node) -> str | None:
    """The layer name as text: a string kwarg, or a graph input carrying an opaque object
    (vLLM's ``LayerName``) whose traced value holds the name."""
    name = attention.kwargs.get("layer_name")
    if name is None or isinstance(name, str):
        return name
    real = getattr(layout.value(name), "real_obj", None)
    value = getattr(real, "value", real)
    return value if isinstance(value, str) else f"<{getattr(name, 'name', name)}>"


# ---------------------------------------------------------------- candidates


@dataclass
class AttentionShape:
    """A candidate attention call's head count and value head dim, read from its traced shapes (static dims
    only); a pattern's ``extra_check(shape)`` decides on these."""

    num_heads: int
    v_head_dim: int


@dataclass
class Match:
    pattern: AttentionQuantPattern
    attention: Node
    quant: Node | None  # None: an already quantized attention call, retargeted
    chain: list[Node]  # the view nodes from the attention result to the quant input
    form: str

    @property
    def outcome(self) -> str:
        """How the report names the rewrite: ``"rewritten"`` (attention + quant fused) or ``"retargeted"``."""
        return "rewritten" if self.quant is not None else "retargeted"


def _reaches(node: Node, targets: set, depth: int = 8) -> bool:
    """Whether a quant op of ``targets`` reads ``node`` through at most ``depth`` view ops."""
    for user in node.users:
        if wrapped_op(user)[0] in targets:
            return True
        if depth and user.target in layout.VIEW_CHAIN_OPS and _reaches(user, targets, depth - 1):
            return True
    return False


def _view_kwargs(node: Node, arg: str) -> dict:
    """The v2 view description of mutable ``arg`` (``_<arg>_size`` ...), empty when it is the base itself."""
    prefix = f"_{arg}_"
    return {k[len(prefix):]: v for k, v in node.kwargs.items()
            if k.startswith(prefix) and k != f"{prefix}base_index"}


def attention_output_width(attention: Node, q_val: torch.Tensor, dtype: torch.dtype | None = None) -> int | str:
    """The elements per token (``H*Dv`` for the query dtype, ``H*Dv/2`` packed bytes for uint8) when the
    attention op writes its output as row-major ``[T, width]`` elements of ``dtype`` (default: the query's)
    of the value the graph carries on (v1: the mutated ``output``; v2: the mutated base), else a refusal
    reason.

    v1: ``output`` must be row-major. v2: ``output`` must be its base, or a row-major view of all of
    it starting where it starts (an alias, a whole slice, or an as_strided view proving that), and the
    base must be row-major. Either way the written view has ``T`` rows, ``T = q_val.shape[0]`` (the query).
    """
    if wrapped_op(attention)[1] == "v1":
        out = layout.value(attention.kwargs.get("output"))
        if not isinstance(out, torch.Tensor):
            return "unknown_attention_shape"
        if not layout.tensor_is_row_major(out):
            return "attention_output_not_contiguous"
        size = list(out.shape)
    else:
        base = layout.value(buffer_arg(attention, "output"))
        if not isinstance(base, torch.Tensor):
            return "unknown_attention_shape"
        view = _view_kwargs(attention, "output")
        size = list(base.shape)
        if "size" in view:  # as_strided view of the base
            size = [layout.value(n) for n in view["size"]]
            stride = [layout.value(n) for n in view["stride"]]
            offset = layout.value(view.get("storage_offset"))
            if not layout.is_row_major(size, stride):
                return "attention_output_not_contiguous"
            if not (layout.known_equal(math.prod(size), base.numel())
                    and layout.known_equal(offset, base.storage_offset())):
                return "attention_output_is_part_of_a_buffer"
        elif "slice_dim" in view:
            dim = view["slice_dim"] % base.dim()
            start, end = layout.value(view.get("slice_start")), layout.value(view.get("slice_end"))
            if not ((start is None or layout.known_equal(start, 0))
                    and (end is None or layout.known_at_least(end, base.shape[dim]))):
                return "attention_output_is_part_of_a_buffer"
        if not layout.tensor_is_row_major(base):
            return "attention_output_not_contiguous"
    tokens = q_val.shape[0]
    written = out if wrapped_op(attention)[1] == "v1" else base
    if written.dtype != (q_val.dtype if dtype is None else dtype):
        return ("attention_output_dtype_is_not_the_query_dtype" if dtype is None
                else "quantized_output_is_not_uint8")
    if not size or not layout.known_equal(size[0], tokens):
        return "attention_output_rows_are_not_tokens"
    per_token = size[1:]
    if not all(isinstance(d, int) for d in per_token):
        return "unknown_attention_shape"
    return math.prod(per_token)


def attention_shape(attention: Node, width: int) -> AttentionShape | None:
    """The :class:`AttentionShape` of ``attention`` writing ``width`` elements per token: heads from the
    query's static dims (never guards on the symbolic token count); None when they are not static."""
    q_val = query_value(attention)
    if not isinstance(q_val, torch.Tensor) or q_val.dim() != 3 or not isinstance(q_val.shape[1], int):
        return None
    heads = q_val.shape[1]
    if width % heads:
        return None
    return AttentionShape(num_heads=heads, v_head_dim=width // heads)


def _quant_buffers_reason(quant: Node, form: QuantForm, width: int) -> str | None:
    """The fused op writes the quant's buffers whole, row-major (a ``strided`` buffer of the format: through the
    strides of the very view the quant was given, in the v1 form), as wide as the format's for ``width``
    elements."""
    if any(is_view_of_base(quant, arg) for arg in form.buffers):
        return "quant_buffers_are_views"
    specs = formats.by_name(form.format).buffers
    buffers = [layout.value(buffer_arg(quant, arg)) for arg in form.buffers]
    if not all(spec.strided or layout.tensor_is_row_major(b) for b, spec in zip(buffers, specs)):
        return "quant_buffers_not_contiguous"
    fits = layout.rows_of_width(buffers, specs, width)  # e.g. not vLLM's padded_n
    return None if fits else "quant_buffers_padded"


def _gemm_reason(quant: Node, form: QuantForm, vocab: OpVocabulary) -> str | None:
    """None when the quant's codes and its scale (:attr:`QuantForm.gemm_scale`: NVFP4's block scales, FP8's static
    scale) reach a call of a GEMM form of the format (:meth:`OpVocabulary.gemm_forms`) as its activation and
    scale (:func:`layout.byte_readers`: the same bytes; NVFP4 codes may be zero-padded per row) and no such call
    is refused by its form; else the reason."""
    codes = mutated_result(quant, form.buffers[0])
    scale = (mutated_result(quant, form.gemm_scale) if form.gemm_scale in form.buffers
             else quant.kwargs.get(form.gemm_scale))
    if form.gemm_scale in form.buffers and formats.by_name(form.format).buffers[
            form.buffers.index(form.gemm_scale)].strided:  # a strided view: read back through the same view
        given = layout.value(buffer_arg(quant, form.gemm_scale))
        return gemm_reason(codes, lambda reader, arg: layout.seen_through_views(arg, scale) and layout.same_view(
            layout.value(arg), given), vocab, form.format)
    scale_reads = set(layout.byte_readers(scale)) if isinstance(scale, Node) else set()
    return gemm_reason(codes, lambda reader, arg: (reader, arg) in scale_reads, vocab, form.format)


def gemm_reason(codes: Node | None, reads_scale, vocab: OpVocabulary, fmt: str) -> str | None:
    """None when ``codes`` reach a call of a GEMM form of ``fmt`` as its activation (:func:`layout.byte_readers`: the
    same bytes; NVFP4 codes may be zero-padded per row) whose scale argument ``reads_scale(reader, arg)`` accepts,
    and no such call is refused by its form; else the reason. A GEMM that mutates its output is found through its
    ``auto_functionalized`` wrapper."""
    verdicts = []
    for reader, via in layout.byte_readers(codes, zero_padding=fmt == "nvfp4") if codes is not None else ():
        op = wrapped_op(reader)[0] or reader.target
        args = layout.call_arguments(reader, op)
        verdicts += [gemm.refusal(args) for gemm in vocab.gemm_forms(fmt)
                     if op is gemm.op and args.get(gemm.activation) is via and gemm.takes(args)
                     and reads_scale(reader, args.get(gemm.block_scale))]
    if not verdicts:
        return f"no_{fmt}_gemm_consumer"
    return next((v for v in verdicts if v), None)


OPTIONAL_OUTPUT_ARGS = ("output_scale", "output_block_scale", "output_inv_scale")
"""The attention ops' optional arguments that make them write a quantized output."""


@dataclass(frozen=True)
class Anchor:
    """One wrapped op of a traced pattern, and which optional output arguments its call sets."""

    op: object
    sets: frozenset


@functools.lru_cache(maxsize=None)
def anchors(pattern: AttentionQuantPattern, vocab: OpVocabulary) -> tuple[Anchor, ...]:
    """The traced pattern's wrapped ops, in order (attention first)."""
    gm = traced_pattern(pattern, vocab, "v1")
    return tuple(Anchor(wrapped_op(n)[0], _sets(n)) for n in gm.graph.nodes if wrapped_op(n)[0] is not None)


def _sets(node: Node) -> frozenset:
    """The optional output arguments given to a wrapped attention call (v2 passes mutable ones as bases)."""
    return frozenset(a for a in OPTIONAL_OUTPUT_ARGS
                     if node.kwargs.get(a) is not None or node.kwargs.get(f"_{a}_base_index") is not None)


def applies(attention: Node, pattern: AttentionQuantPattern, vocab: OpVocabulary) -> bool:
    """Whether ``attention`` is the first anchor of ``pattern`` in the same form (same optional outputs set)."""
    first = anchors(pattern, vocab)[0]
    return wrapped_op(attention)[0] is first.op and _sets(attention) == first.sets


def unmatched_reason(attention: Node) -> str:
    """The refusal of a candidate that no enabled entry applies to."""
    return "attention_already_quantized" if _sets(attention) else "pattern_not_enabled"


def examine(attention: Node, pattern: AttentionQuantPattern, vocab: OpVocabulary) -> Match | str:
    """A :class:`Match` of ``pattern`` at ``attention`` (a node it :func:`applies` to), or why it is refused."""
    following = anchors(pattern, vocab)[1:]
    if not following:
        return _examine_quantized(attention, pattern, vocab)
    return _examine_chain(attention, pattern, vocab, vocab.quant_form(pattern.format))


def _examine_chain(attention: Node, pattern: AttentionQuantPattern, vocab: OpVocabulary,
                   form: QuantForm) -> Match | str:
    """attention -> views -> quant (``quant_op``) -> GEMM, proven, not assumed: the quant reads the attention
    output's elements in row-major ``[T, H*Dv]`` order (``T`` the query's symbolic token count) through views
    that keep that order (:mod:`fusion_pass.compile.layout`), the attention writes its output whole and row-major,
    and a GEMM of one of the vocabulary's forms reads the quant's buffers as they are (:func:`_gemm_reason`).
    """
    result = mutated_result(attention, "output")
    if result is None:
        return "attention_output_unused"
    quant_op, no_quant = form.op, f"no_{form.format}_quant_consumer"
    chain, node, broken = [], result, None
    while True:
        users = list(node.users)
        if len(users) != 1:
            if _reaches(node, {quant_op}):
                return "bf16_output_has_other_users"
            return no_quant if users else "attention_output_unused"
        (user,) = users
        op = wrapped_op(user)[0]
        if op is quant_op:
            break
        other = {**dict.fromkeys(vocab.foreign_quants(form.format), "quant_is_another_format"),
                 **dict(vocab.refused_quants)}
        if (op or user.target) in other:  # another format, or NVFP4 in a layout the fused op does not write
            return other[op or user.target]
        if user.target in layout.VIEW_CHAIN_OPS and user.args and user.args[0] is node:
            broken = broken or layout.step_reason(user)
            chain.append(user)
            node = user
            continue
        return native_forms.native_quant_reason(user) or no_quant
    quant = user
    if quant.kwargs.get(form.input) is not node:
        return "bf16_output_is_not_the_quant_input"
    if broken:
        return broken
    q_val = query_value(attention)
    if not isinstance(q_val, torch.Tensor) or q_val.dim() < 1:
        return "unknown_attention_shape"
    tokens = q_val.shape[0]
    width = attention_output_width(attention, q_val)
    if isinstance(width, str):
        return width
    if not layout.reads_token_rows(layout.value(node), tokens, width):
        return "quant_rows_are_not_tokens"
    return (form.refusal(layout.call_arguments(quant, quant_op)) or _quant_buffers_reason(quant, form, width)
            or _gemm_reason(quant, form, vocab) or _match(pattern, attention, width, quant, chain))


def _match(pattern: AttentionQuantPattern, attention: Node, width: int, quant=None, chain=()) -> Match | str:
    """The :class:`Match`, once the pattern's ``extra_check`` accepts the attention's shape."""
    shape = attention_shape(attention, width)
    if shape is None:
        return "unknown_attention_shape"
    return pattern.extra_check(shape) or Match(pattern, attention, quant, list(chain), wrapped_op(attention)[1])


def _schema_signature(op) -> list[tuple]:
    return [(a.name, str(a.type), a.alias_info is not None and a.alias_info.is_write) for a in op._schema.arguments]


def _takes_the_call(target, op) -> bool:
    """Whether ``target`` takes ``op``'s arguments as they are: the same ones first, the rest optional."""
    theirs, ours = _schema_signature(op), _schema_signature(target)
    return ours[:len(theirs)] == theirs and all(a.has_default_value() for a in target._schema.arguments[len(theirs):])


def _examine_quantized(attention: Node, pattern: AttentionQuantPattern, vocab: OpVocabulary) -> Match | str:
    """An attention call another pass already gave the quant's buffers (``output`` packed uint8, ``output_scale``
    the global scale, ``output_block_scale`` the swizzled scales), retargetable to the vocabulary's fused op."""
    op = wrapped_op(attention)[0]
    target = vocab.writing_quantized(pattern.role)
    if target is op:
        return "attention_already_quantized"  # it already is this vocabulary's NVFP4-writing call
    if not _takes_the_call(target, op):
        return "fused_op_arguments_differ"
    if mutated_result(attention, "output") is None:
        return "attention_output_unused"
    q_val = query_value(attention)
    if not isinstance(q_val, torch.Tensor) or q_val.dim() < 1:
        return "unknown_attention_shape"
    packed = attention_output_width(attention, q_val, torch.uint8)
    if isinstance(packed, str):
        return packed
    if is_view_of_base(attention, "output_block_scale") or not layout.tensor_is_row_major(
            layout.value(buffer_arg(attention, "output_block_scale"))):
        return "quant_buffers_not_contiguous"
    return _match(pattern, attention, 2 * packed)


# ---------------------------------------------------------------- the traced templates (the rewrite: :mod:`.rewrite`)


@functools.lru_cache(maxsize=None)
def traced_replacement(pattern: AttentionQuantPattern, vocab: OpVocabulary, form: str) -> torch.fx.GraphModule:
    """The pattern's replacement traced through functionalization in ``form``, once per process.

    The trace sets Inductor's functionalization flag only while tracing this
    private template; the user's compile settings are never touched.
    """
    return _trace(pattern.replacement, pattern, vocab, form)


@functools.lru_cache(maxsize=None)
def traced_pattern(pattern: AttentionQuantPattern, vocab: OpVocabulary, form: str) -> torch.fx.GraphModule:
    """The pattern itself, traced the same way (used to derive anchors and in docs/tests)."""
    return _trace(pattern.pattern, pattern, vocab, form)


def _trace(fn, pattern: AttentionQuantPattern, vocab: OpVocabulary, form: str) -> torch.fx.GraphModule:
    with torch._inductor.config.patch(enable_auto_functionalized_v2=form == "v2"):
        return make_fx(dispatch_functionalize(functools.partial(fn, vocab, layer_name=_LAYER_NAME_SLOT)),
                       tracing_mode="fake")(*pattern.example_inputs())


def anchor_ops(pattern: AttentionQuantPattern, vocab: OpVocabulary) -> tuple:
    """The wrapped ops of the traced pattern in order: (attention op, quant op), or (attention op,)."""
    return tuple(a.op for a in anchors(pattern, vocab))


_LAYER_NAME_SLOT = "<layer_name>"
