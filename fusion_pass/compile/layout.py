"""Layout proofs over post-grad FX nodes: does a chain of view ops keep the row-major element order? And which
ops read a buffer's bytes as they are (:func:`byte_readers`: from the quant's buffers to the GEMM)?

The fused call writes NVFP4 of the attention output read as a row-major
``[T, H*Dv]`` matrix. That equals what the unfused graph quantizes only when
the quant's input holds the attention output's elements in that same order,
with ``T`` rows of ``H*Dv`` elements. Everything here decides such facts from
the nodes' ``meta["val"]`` (fake tensors with symbolic sizes) and proves them
with :func:`statically_known_true`, so a fact holds for every token count,
not for the one seen while tracing. A step that cannot be proven is reported
with a refusal reason; nothing is assumed.
"""

from __future__ import annotations

import math
import operator

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten

# The value is the input's elements in row-major order under another shape (or a copy of them).
ORDER_PRESERVING = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default,
    aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default,
    aten.flatten.using_ints, aten.unflatten.int, aten.clone.default,
}
# Order-preserving only for some arguments, which :func:`step_reason` proves or refuses.
REORDERING = {aten.permute.default, aten.transpose.int, aten.t.default, aten.as_strided.default}
SELECTING = {aten.slice.Tensor, aten.narrow.default, aten.select.int, aten.split.Tensor,
             aten.split_with_sizes.default, aten.unbind.int, aten.expand.default, operator.getitem}
VIEW_CHAIN_OPS = ORDER_PRESERVING | REORDERING | SELECTING


def value(x):
    """A node's traced value (``meta["val"]``), or ``x`` itself when it is not a node."""
    return x.meta.get("val") if isinstance(x, Node) else x


def known_equal(a, b) -> bool:
    """``a == b`` for every value of the symbols in them (False when unknown)."""
    if a is None or b is None:
        return False
    return bool(statically_known_true(a == b))


def known_at_least(a, b) -> bool:
    if a is None or b is None:
        return False
    return bool(statically_known_true(a >= b))


def is_row_major(size, stride) -> bool:
    """Whether ``stride`` is the row-major (contiguous) stride of ``size``; size-1 dims may have any stride."""
    expected = 1
    for n, s in zip(reversed(list(size)), reversed(list(stride))):
        if known_equal(n, 1):
            continue
        if not known_equal(s, expected):
            return False
        expected = expected * n
    return True


def tensor_is_row_major(t) -> bool:
    return isinstance(t, torch.Tensor) and is_row_major(t.shape, t.stride())


def _permutation_keeps_order(sizes, dims) -> bool:
    """A permutation keeps row-major order iff it keeps the dims of size != 1 in their order."""
    moved = [d for d in dims if not known_equal(sizes[d], 1)]
    return moved == sorted(moved)


def _permutation(node: Node, ndim: int) -> list[int] | None:
    if node.target is aten.t.default:
        return list(range(ndim))[::-1]
    if node.target is aten.transpose.int:
        d0, d1 = (d % ndim for d in node.args[1:3])
        dims = list(range(ndim))
        dims[d0], dims[d1] = dims[d1], dims[d0]
        return dims
    return [d % ndim for d in node.args[1]]


def _as_strided_keeps_order(node: Node, src) -> bool:
    """``as_strided(x, size, stride, offset)`` reads x's storage: order-preserving iff x is row-major,
    the view is row-major over as many elements, and it starts where x starts."""
    size = [value(s) for s in node.args[1]]
    stride = [value(s) for s in node.args[2]]
    offset = value(node.args[3]) if len(node.args) > 3 else node.kwargs.get("storage_offset")
    offset = src.storage_offset() if offset is None else value(offset)
    return (tensor_is_row_major(src) and is_row_major(size, stride)
            and known_equal(math.prod(size), src.numel()) and known_equal(offset, src.storage_offset()))


def _slice_is_whole(node: Node, src) -> bool:
    if node.target is aten.slice.Tensor:
        args = list(node.args) + [None] * (5 - len(node.args))
        dim, start, end, step = args[1] or 0, value(args[2]), value(args[3]), args[4] or 1
        dim = dim % src.dim()
        return step == 1 and (start is None or known_equal(start, 0)) and (
            end is None or known_at_least(end, src.shape[dim]))
    if node.target is aten.narrow.default:
        dim, start, length = node.args[1] % src.dim(), value(node.args[2]), value(node.args[3])
        return known_equal(start, 0) and known_equal(length, src.shape[dim])
    return False


def step_reason(node: Node) -> str | None:
    """None when ``node`` (an op of :data:`VIEW_CHAIN_OPS` applied to its first argument) provably
    presents its input's elements in the same row-major order, all of them; else a refusal reason."""
    if node.target in ORDER_PRESERVING:
        return None
    src, out = value(node.args[0]), value(node)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return "unknown_view_shape"
    if node.target is aten.as_strided.default:
        return None if _as_strided_keeps_order(node, src) else "quant_reads_as_strided_view"
    if node.target in REORDERING:
        dims = _permutation(node, src.dim())
        return None if _permutation_keeps_order(src.shape, dims) else "quant_reads_permuted_view"
    if node.target is aten.expand.default:
        same = out.dim() == src.dim() and all(known_equal(a, b) for a, b in zip(out.shape, src.shape))
        return None if same else "quant_reads_broadcast_view"
    return None if _slice_is_whole(node, src) else "quant_reads_slice"


def rows_of_width(buffers, specs, width: int) -> bool:
    """Whether the quant's ``buffers`` hold rows of a ``width``-element output as the format's buffer ``specs``
    (:class:`fusion_pass.formats.BufferSpec`) say: each 2-D with as many bytes per row as its spec (any dtype view
    of them: vLLM's int32 NVFP4 scales, their one-byte views), the first (the codes) in the spec's dtype's size."""
    if len(buffers) != len(specs):
        return False
    for i, (t, spec) in enumerate(zip(buffers, specs)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or (i == 0 and t.element_size() != spec.dtype.itemsize):
            return False
        if not known_equal(t.shape[1] * t.element_size(), spec.shape(1, width)[1] * spec.dtype.itemsize):
            return False
    return True


def reads_token_rows(t, tokens, width: int) -> bool:
    """Whether a quant reading ``t`` (as ``[-1, K]``) quantizes ``tokens`` rows of ``width`` elements."""
    if not isinstance(t, torch.Tensor) or t.dim() < 1:
        return False
    return known_equal(t.shape[-1], width) and known_equal(math.prod(t.shape[:-1]), tokens)


# ---------------------------------------------------------------- from the quant's buffers to their readers

# Steps that hand on a row-major buffer's bytes in memory order: another shape or element type of the same
# bytes (int32 scales viewed as fp8 / uint8, packed codes as float4_e2m1fn_x2, a flattening), or a copy.
BYTE_PRESERVING = ORDER_PRESERVING | {aten.view.dtype}


def zero_pads_rows(node: Node) -> bool:
    """``constant_pad_nd(x, [0, p], 0)``, ``p >= 0``: every row of ``x`` (its last dim) followed by ``p`` zero
    elements, nothing else changed. For packed NVFP4 codes: ``p`` zero bytes, ``2p`` zeros appended to each row
    (vLLM's ``pad_nvfp4_activation_for_cutlass`` for a weight whose K it padded)."""
    if node.target is not aten.constant_pad_nd.default or len(node.args) < 2:
        return False
    pad, fill = list(node.args[1]), node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    return len(pad) == 2 and known_equal(pad[0], 0) and known_at_least(pad[1], 0) and fill == 0


def byte_readers(node: Node, zero_padding: bool = False, depth: int = 8) -> list[tuple[Node, Node]]:
    """``(reader, what it reads)`` for each op reading ``node``'s bytes as they are: through at most ``depth``
    :data:`BYTE_PRESERVING` steps (and :func:`zero_pads_rows` steps when ``zero_padding``), the first op that
    is none of them. A step's other arguments are not ``node``'s bytes, so only steps on their first one count."""
    found = []
    for user in node.users:
        step = user.args[:1] == (node,) and (user.target in BYTE_PRESERVING or (zero_padding and zero_pads_rows(user)))
        if step and depth:
            found += byte_readers(user, zero_padding, depth - 1)
        elif not step:
            found.append((user, node))
    return found


SCATTERS = {aten.slice_scatter.default, aten.select_scatter.default, aten.as_strided_scatter.default}
"""Functionalization's write-back of a mutated view into its base: the value written is the second argument."""


def seen_through_views(node, source: Node, depth: int = 8) -> bool:
    """Whether ``node`` is ``source`` seen through at most ``depth`` view ops (their first argument) and
    functionalization's write-backs into a view's base (:data:`SCATTERS`: the value written). What a reader of a
    mutated view reads in the v1 form when the view is not its whole base (vLLM's TMA-aligned group scales: a
    slice of a padded buffer, transposed)."""
    for _ in range(depth + 1):
        if node is source:
            return True
        if not isinstance(node, Node) or node.op != "call_function" or not node.args:
            return False
        if node.target in VIEW_CHAIN_OPS:
            node = node.args[0]
        elif node.target in SCATTERS and len(node.args) > 1:
            node = node.args[1]
        else:
            return False
    return False


def same_view(a, b) -> bool:
    """Whether tensors ``a`` and ``b`` (traced values) have the same shape and strides for every symbol value."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim()
            and all(known_equal(x, y) for x, y in zip((*a.shape, *a.stride()), (*b.shape, *b.stride()))))


def call_arguments(node: Node, op) -> dict:
    """``node``'s call of ``op`` by argument name, defaults filled in. A wrapped (auto_functionalized) call
    passes the op first, then everything by keyword."""
    schema = getattr(op, "_schema", None)
    args = {a.name: a.default_value for a in schema.arguments if a.has_default_value()} if schema else {}
    positional = node.args[1:] if node.args[:1] == (op,) else node.args
    args.update(zip((a.name for a in schema.arguments), positional) if schema else ())
    args.update(node.kwargs)
    return args
