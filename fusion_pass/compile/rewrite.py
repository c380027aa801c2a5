"""Apply a :class:`~fusion_pass.compile.matcher.Match` to the post-grad graph.

attention -> quant (a quant op, or the native form's elementwise chain): the pattern's traced replacement
(:func:`fusion_pass.compile.matcher.traced_replacement`, in the graph's functionalized form) is inlined in place of
attention + quant, given the buffers and the scale the fused call writes with; the quant's readers (the GEMM) read
the new call's results; the query-dtype output, its views and the quant are erased. An attention call another
pass already gave the quant's buffers is retargeted to the vocabulary's fused op, its arguments and users
unchanged.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

from fusion_pass.compile import layout
from fusion_pass.compile.matcher import (OPTIONAL_OUTPUT_ARGS, Match, buffer_arg, input_names, mutated_result,
                                         traced_replacement, wrapped_op)
from fusion_pass.patterns import OpVocabulary

__all__ = ["inline_replacement", "rewrite"]

aten = torch.ops.aten

_PROVENANCE_META = ("stack_trace", "nn_module_stack", "source_fn_stack")
_REWRITTEN_ARGS = ("output", *OPTIONAL_OUTPUT_ARGS)


def rewrite(graph: Graph, match: Match, vocab: OpVocabulary) -> Node:
    """Apply ``match`` (an op-form quant, or an already quantized call); returns the attention node that now writes
    the quantized output. The native form: :func:`fusion_pass.compile.native_match.rewrite`."""
    attention, quant = match.attention, match.quant
    if quant is None:
        attention.args = (vocab.writing_quantized(match.pattern.role), *attention.args[1:])
        return attention
    form = vocab.quant_form(match.pattern.format)
    scale = [] if form.scale_input is None else [quant.kwargs[form.scale_input]]
    args = layout.call_arguments(quant, form.op)
    return inline_replacement(graph, match, vocab, [*(buffer_arg(quant, b) for b in form.buffers), *scale],
                              [mutated_result(quant, b) for b in form.buffers],
                              {ours: args[theirs] for theirs, ours in form.forwards})


def inline_replacement(graph: Graph, match: Match, vocab: OpVocabulary, quant_values: list,
                       old_results: list, forwarded: dict | None = None) -> Node:
    """Inline the pattern's traced replacement before ``match.quant``: its placeholders take the attention's inputs,
    its query-dtype output buffer and ``quant_values`` (the buffers the fused call writes and its scale, in the
    replacement's order); the readers of ``old_results`` (one per buffer; None: unread) read the replacement's
    results instead; the quant, ``match.chain`` (backwards) and the attention are erased; ``forwarded``: the new
    call's arguments taken from the quant (:attr:`QuantForm.forwards`). Returns the new attention node."""
    attention, quant = match.attention, match.quant
    template = traced_replacement(match.pattern, vocab, match.form)
    n_inputs = len(match.pattern.inputs)
    inputs = [attention.kwargs[name] for name in input_names(attention, n_inputs)]
    placeholders = [n for n in template.graph.nodes if n.op == "placeholder"]
    values = inputs + [buffer_arg(attention, "output"), *quant_values]
    env = dict(zip(placeholders, values))
    assert len(placeholders) == len(values), "replacement signature: inputs, output, the quant's buffers, its scale"

    with graph.inserting_before(quant):
        new_results = tuple(graph.graph_copy(template.graph, env))
    new_attention = new_results[0].args[0]
    for template_node, node in env.items():  # drop the template's metadata (its own fake mode and shapes)
        if template_node.op != "placeholder":
            node.meta.clear()
            if node.target is operator.getitem and not node.users and node not in new_results:
                graph.erase_node(node)
    for name in _passthrough_args(attention, n_inputs):  # layer_name and whatever else the op takes
        new_attention.update_kwarg(name, attention.kwargs[name])
    for name, value in (forwarded or {}).items():
        new_attention.update_kwarg(name, value)
    for node in (new_attention, *new_results):  # keep where it came from, for dumps and errors
        node.meta.update({k: v for k, v in attention.meta.items() if k in _PROVENANCE_META})
    vals = [old.meta.get("val") if old is not None else None for old in old_results]
    for new, val in zip(new_results, vals):
        new.meta["val"] = val
    new_attention.meta["val"] = (None, *vals)
    for old, new in zip(old_results, new_results):
        if old is not None:
            old.replace_all_uses_with(new)
    _erase_dead(graph, [quant, *reversed(match.chain), attention])
    return new_attention


def _passthrough_args(attention: Node, n_inputs: int) -> list[str]:
    """Arguments the rewrite keeps as they are: every schema argument but the inputs and the outputs
    (``layer_name``; in vLLM's ops also ``kv_cache_dummy_dep``, which keeps the KV-cache update alive)."""
    skip = set(input_names(attention, n_inputs)) | set(_REWRITTEN_ARGS)
    return [a.name for a in wrapped_op(attention)[0]._schema.arguments
            if a.name not in skip and a.name in attention.kwargs]


def _erase_dead(graph: Graph, roots: list[Node]) -> None:
    """Erase ``roots`` (with their getitems) and the inputs they leave unused that only they fed."""
    for root in roots:
        if getattr(root, "_erased", False):
            continue
        for user in list(root.users):
            if user.target is operator.getitem and not user.users:
                graph.erase_node(user)
        if root.users:
            continue
        feeders = [n for n in root.all_input_nodes]
        graph.erase_node(root)
        for node in feeders:  # the bf16 output buffer and its view, now unused
            if (not node.users and node.op == "call_function"
                    and node.target in layout.VIEW_CHAIN_OPS | {aten.empty.memory_format}):
                _erase_dead(graph, [node])
