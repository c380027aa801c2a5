"""How the prefill rows of one attention call reach a fused backend.

A call's rows are its decode rows ``[0, D)`` then its prefills, each ``query_len`` new tokens after
``context_len`` cached ones (vLLM's order, :class:`~fusion_pass.runtime.BatchSpec`). This module turns them
into what a fused backend's kernel takes and writes them back:

* the layer's runtime gives dense ``q``/``k``/``v`` of the prefills (``impl.prefill_qkv``; MLA: keys and values
  up-projected through ``kv_b_proj``), appending the new tokens to its cache, and the prefills' cached context
  as a source of rows (:data:`ContextRows`);
* :func:`run_prefills`: the fused NVFP4 attention of a run of prefills at their rows: one kernel call over a
  key/value workspace of context + new tokens (``seqlen_k > seqlen_q``, causal aligned to the end) while the
  call's cached context fits the workspace bound (:func:`context_workspace_tokens`), else context chunks of
  at most that many keys, each with its log-sum-exp, merged into NVFP4 by the backend's merge kernel;
* :func:`run_on_prefill`: a whole call: the prefill rows through :func:`run_prefills` first, then every row
  the backend does not write (decode rows; prefills with context when the backend's ``handles_context``
  is False) computed as the unfused graph computes it and written by the row-range quantizer
  (:func:`post_quantize_rows`), which touches no other row.

The output format is one seam, :class:`RowWriter`: how a backend's fused kernel writes the format, how two partial
attentions are merged into it (if the format has a merge), how the other rows are quantized. :class:`NVFP4Rows` is
NVFP4's; static FP8's is :class:`fusion_pass.runtime.fp8_rows.FP8StaticRows`, the FP8 group formats'
:class:`fusion_pass.runtime.fp8_group_rows.FP8GroupRows`. :func:`run_rows` and
:func:`write_prefills` are the plan for any writer; :func:`run_on_prefill` and :func:`run_prefills` are NVFP4's.

A backend is what it is given (:class:`fusion_pass.runtime.backends.Backend`: ``run_varlen``,
``attention_lse``, ``merge_nvfp4``, ``run_varlen_fp8_static``, ``run_varlen_fp8_group``): the plan calls down into
it, it never calls back.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
from torch import Tensor

from fusion_pass import nvfp4
from fusion_pass.kernels import launchers
from fusion_pass.kernels.host_copy import to_device
from fusion_pass.kernels.reference import merge_attention
from fusion_pass.nvfp4.checks import is_int
from fusion_pass.runtime.backends.base import fuses
from fusion_pass.runtime.settings import check_token_count, context_workspace_tokens

__all__ = [
    "ContextRows",
    "NVFP4Rows",
    "RowWriter",
    "check_prefills",
    "post_quantize_rows",
    "run_on_prefill",
    "run_prefills",
    "run_rows",
    "varlen_meta",
    "write_prefills",
]

ContextRows = Callable[[int, int], "tuple[Tensor, Tensor]"]
"""``rows(lo, hi) -> (k, v)``: rows ``[lo, hi)`` of the prefills' packed cached context as keys ``[hi - lo, Hk,
Dqk]`` and values ``[hi - lo, Hk, Dv]`` in the query dtype, made on demand (MLA: the cached latents of those rows
up-projected), so that at most one workspace's worth is ever materialized. Each host gives its own: the stand-in
engine's runtimes (``impl.prefill_qkv``), vLLM's paged caches (:mod:`fusion_pass.vllm.adapters.paged`)."""


def varlen_meta(spec: Any, device: torch.device, first_row: int = 0) -> tuple[Tensor, int]:
    """``cu_seqlens`` int32 ``[B + 1]`` on ``device`` (starting at ``first_row``) and the longest query length,
    from the spec's host lengths: no device read, and to CUDA through pinned memory (no synchronization)."""
    return _cu([r.query_len for r in spec.requests], device, first_row), max(r.query_len for r in spec.requests)


def post_quantize_rows(rows: Tensor, output_scale: Tensor, output: Tensor, output_block_scale: Tensor,
                       row_start: int, t: int) -> None:
    """Quantize ``rows [M, H*Dv]`` (any float dtype) into rows ``[row_start, row_start + M)`` of the
    ``T``-row NVFP4 buffers, touching no other row. The op checked the buffers and the global scale
    already: :func:`fusion_pass.kernels.launchers.quantize_rows` (on CUDA the Triton launcher, no read-back of the
    scale, no sync; elsewhere the reference)."""
    packed, scales = nvfp4.byte_views(output, output_block_scale, t)
    launchers.quantize_rows(rows.reshape(rows.shape[0], -1), output_scale, packed, scales, row_start)


def _sub_batch(spec: Any, requests) -> Any:
    """A batch of some of ``spec``'s requests (in their order)."""
    return type(spec)(tuple(requests), spec.dcp_world_size)


def _runs(spec: Any, requests: list) -> list[tuple[int, int]]:
    """``(first row, rows)`` of each run of adjacent rows that ``requests`` (in ``spec``'s order) cover."""
    locs = spec.query_start_loc()
    index = {r.request_id: i for i, r in enumerate(spec.requests)}
    runs: list[list[int]] = []
    for r in requests:
        start = locs[index[r.request_id]]
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1][1] += r.query_len
        else:
            runs.append([start, r.query_len])
    return [(a, n) for a, n in runs]


def _rows(spec: Any, requests: list, device) -> Tensor:
    """The global row indices of ``requests`` (members of ``spec``, in its order)."""
    return torch.cat([torch.arange(a, a + n, device=device) for a, n in _runs(spec, requests)])


def _cu(lengths: list[int], device, first: int = 0) -> Tensor:
    """Offsets ``[first, first + l0, ...]`` int32 on ``device``, without blocking the host
    (:func:`fusion_pass.kernels.host_copy.to_device`)."""
    out, total = [first], first
    for n in lengths:
        total += n
        out.append(total)
    return to_device(out, torch.int32, device)


def _interleave(context: Tensor, new: Tensor, context_lens: list[int], query_lens: list[int]) -> Tensor:
    """Per request its context rows then its new rows: ``[sum(context_lens) + sum(query_lens), ...]``."""
    pieces, c, n = [], 0, 0
    for lc, lq in zip(context_lens, query_lens):
        pieces += [context[c:c + lc], new[n:n + lq]]
        c, n = c + lc, n + lq
    return torch.cat(pieces)


def _context_chunks(context_lens: list[int], width: int):
    """``(lo, hi, lengths)`` per chunk of the packed context rows: chunk ``j`` is rows ``[j*width, (j+1)*width)``
    of the packed context, ``lengths`` how many of them each request has (0 for most requests of a
    chunk). ``ceil(sum(context_lens) / width)`` chunks, each at most ``width`` keys."""
    starts = [0]
    for n in context_lens:
        starts.append(starts[-1] + n)
    for lo in range(0, starts[-1], width):
        hi = min(lo + width, starts[-1])
        yield lo, hi, [max(0, min(b, hi) - max(a, lo)) for a, b in zip(starts[:-1], starts[1:])]


def _lengths(name: str, values: Any) -> list[int]:
    """``values`` as a list of host ints, else ValueError naming ``name``."""
    if isinstance(values, (str, bytes)) or isinstance(values, Tensor) or not hasattr(values, "__len__"):
        raise ValueError(f"run_prefills: {name} must be a list of ints (host ints, one per prefill), "
                         f"got {type(values).__name__}")
    bad = [x for x in values if not is_int(x)]
    if bad:
        raise ValueError(f"run_prefills: {name} must hold ints (host ints, one per prefill), got {bad[0]!r} "
                         f"({type(bad[0]).__name__})")
    return [int(x) for x in values]


def check_prefills(q: Tensor, k: Tensor, v: Tensor, first_row: Any, query_lens: Any, context_lens: Any,
                   context: ContextRows | None) -> tuple[list[int], list[int]]:
    """:func:`run_prefills`' rows, checked before anything runs; returns ``(query_lens, context_lens)`` as lists
    of Python ints. Host values only (shapes and ints): no device read.

    ``query_lens`` and ``context_lens`` describe the same prefills (one entry each, at least one prefill), hold
    ints (numpy integers accepted), ``query_lens >= 1`` and ``context_lens >= 0``; ``first_row`` is an int
    ``>= 0``; ``k`` and ``v`` have ``sum(query_lens)`` rows; the prefills' rows ``[first_row, first_row +
    sum(query_lens))`` lie in ``q``; ``context`` is given when ``sum(context_lens) > 0``. ValueError naming the
    argument otherwise."""
    query_lens = _lengths("query_lens", query_lens)
    context_lens = _lengths("context_lens", context_lens)
    if len(query_lens) != len(context_lens):
        raise ValueError(f"run_prefills: query_lens and context_lens must describe the same prefills, got "
                         f"{len(query_lens)} query_lens and {len(context_lens)} context_lens")
    if not query_lens:
        raise ValueError("run_prefills: query_lens must list at least one prefill, got none")
    if min(query_lens) < 1:
        raise ValueError(f"run_prefills: query_lens must be >= 1 (a prefill has new tokens), got {query_lens}")
    if min(context_lens) < 0:
        raise ValueError(f"run_prefills: context_lens must be >= 0, got {context_lens}")
    if not is_int(first_row) or first_row < 0:
        raise ValueError(f"run_prefills: first_row must be an int >= 0, got {first_row!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dim() != 3:
            got = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"run_prefills: {name} must be a 3-D tensor [rows, heads, head_dim], got {got}")
    rows = sum(query_lens)
    for name, x in (("k", k), ("v", v)):
        if x.shape[0] != rows:
            raise ValueError(f"run_prefills: {name} must have sum(query_lens) = {rows} rows (the prefills' new "
                             f"tokens), got {x.shape[0]}")
    if first_row + rows > q.shape[0]:
        raise ValueError(f"run_prefills: first_row + sum(query_lens) = {first_row} + {rows} = {first_row + rows} "
                         f"exceeds the {q.shape[0]} rows of q")
    total_context = sum(context_lens)
    if total_context and context is None:
        raise ValueError(f"run_prefills: context_lens sum to {total_context} cached tokens but context is None")
    return query_lens, context_lens


def run_prefills(backend: Any, q: Tensor, k: Tensor, v: Tensor, *, first_row: int, query_lens: list[int],
                 context_lens: list[int], context: ContextRows | None, softmax_scale: float,
                 output: Tensor, output_scale: Tensor, output_block_scale: Tensor,
                 workspace_tokens: int | None = None) -> None:
    """Fused NVFP4 attention of a run of prefills, some with cached context, written at their rows.

    Args:
        q: ``[T, H, Dqk]``, the call's rows; the prefills are rows ``[first_row, first_row + sum(query_lens))``
            in order.
        k, v: ``[sum(query_lens), Hk, Dqk]`` / ``[sum(query_lens), Hk, Dv]``: the prefills' new keys and values,
            row ``i`` belonging to query row ``first_row + i``.
        query_lens, context_lens: per prefill (host ints), its new tokens and cached context tokens.
        context: the prefills' cached context, packed in request order (:data:`ContextRows`; None when no
            prefill has context). Asked for all ``C = sum(context_lens)`` rows at once within the bound, for
            at most ``bound`` rows at a time beyond it.
        output, output_scale, output_block_scale: the call's NVFP4 buffers (``T`` rows).
        workspace_tokens: the bound (default :func:`context_workspace_tokens`).

    Within the bound: one fused call whose keys are, per request, its context then its new tokens (a
    ``[C + sum(query_lens), Hk, D]`` workspace). Beyond it: ``ceil(C / bound)`` context chunks of at most
    ``bound`` rows, each attended (non-causally) with its log-sum-exp and merged in float32, then the new
    tokens (causally), merged into NVFP4 by the backend's merge kernel.

    Every argument describing the rows is checked first (:func:`check_prefills`: host ints, no device read):
    a mismatch raises ValueError naming the argument before any kernel runs.

    Rows ``< first_row`` are not written; the scale padding (rows ``>= T``, padded columns) is zeroed. Rows
    written by anyone else go in after this call all the same (a backend's entry point may zero more).
    """
    query_lens, context_lens = check_prefills(q, k, v, first_row, query_lens, context_lens, context)
    if workspace_tokens is not None:
        check_token_count("run_prefills(workspace_tokens)", workspace_tokens)
    write_prefills(backend, q, k, v, int(first_row), query_lens, context_lens, context, softmax_scale,
                  NVFP4Rows(output, output_scale, output_block_scale, q.shape[0]), workspace_tokens)


class RowWriter(Protocol):
    """How the rows of one call are written in its output format, its buffers bound (``T`` rows): the row plan's
    one seam per format (:class:`NVFP4Rows` here; static FP8: :class:`fusion_pass.runtime.fp8_rows.FP8StaticRows`;
    FP8 groups: :class:`fusion_pass.runtime.fp8_group_rows.FP8GroupRows`).

    * ``fused(backend, context_lens)``: per prefill (its cached tokens, row order), whether ``backend``'s kernel of
      this format writes it;
    * ``varlen(backend, q, k, v, cu_q, max_q, softmax_scale, cu_k, max_k)``: the backend's fused kernel of this
      format on a run of prefills (``cu_q`` rows of the buffers; keys ``cu_k``, None: the queries' own);
    * ``merge(backend, out_a, lse_a, out_b, lse_b, first_row)``: two partial attentions merged into the format at
      rows ``first_row`` on (context beyond the workspace bound), None where the format has no merge;
    * ``rows(x, row_start)``: query-dtype attention ``x [M, H*Dv]`` quantized into rows ``[row_start, row_start +
      M)`` as the unfused graph's quant op writes them, no other row touched;
    * ``everything(x)``: query-dtype attention ``x [T, H*Dv]`` of every row quantized as the unfused graph's quant
      op writes the whole buffers (padding included): a call no row of which is fused.
    """

    def fused(self, backend: Any, context_lens: list[int]) -> list[bool]: ...

    def varlen(self, backend: Any, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, max_q: int, softmax_scale: float,
               cu_k: Tensor | None, max_k: int | None) -> None: ...

    merge: Callable[..., None] | None

    def rows(self, x: Tensor, row_start: int) -> None: ...

    def everything(self, x: Tensor) -> None: ...


class NVFP4Rows:
    """:class:`RowWriter` of NVFP4: ``output`` uint8 ``[T, H*Dv/2]``, ``output_block_scale`` the swizzled scales of
    ``T`` rows, ``output_scale`` the global scale; a backend writes every prefill it :func:`fuses`, merges beyond the
    workspace bound by its NVFP4 merge kernel (scale padding zeroed after it)."""

    def __init__(self, output: Tensor, output_scale: Tensor, output_block_scale: Tensor, t: int) -> None:
        self.output, self.output_scale, self.output_block_scale, self.t = output, output_scale, output_block_scale, t

    def fused(self, backend: Any, context_lens: list[int]) -> list[bool]:
        return [fuses(backend, c) for c in context_lens]

    def varlen(self, backend, q, k, v, cu_q, max_q, softmax_scale, cu_k, max_k) -> None:
        backend.run_varlen(q, k, v, cu_q, max_q, softmax_scale, self.output, self.output_scale,
                           self.output_block_scale, cu_seqlens_k=cu_k, max_seqlen_k=max_k)

    def merge(self, backend, out_a, lse_a, out_b, lse_b, first_row: int) -> None:
        packed, scales = nvfp4.byte_views(self.output, self.output_block_scale, self.t)
        backend.merge_nvfp4(out_a, lse_a, out_b, lse_b, self.output_scale, packed, scales, first_row)
        nvfp4.zero_scale_padding(scales, self.t, packed.shape[1] * 2)

    def rows(self, x: Tensor, row_start: int) -> None:
        post_quantize_rows(x, self.output_scale, self.output, self.output_block_scale, row_start, self.t)

    def everything(self, x: Tensor) -> None:
        """The kernel the unfused graph's ``scaled_fp4_quant.out`` runs (:func:`launchers.quantize_into`): every
        byte of both buffers."""
        packed, scales = nvfp4.byte_views(self.output, self.output_block_scale, self.t)
        launchers.quantize_into(x, self.output_scale, packed, scales, swizzled=True)


def write_prefills(backend: Any, q: Tensor, k: Tensor, v: Tensor, first_row: int, query_lens: list[int],
                  context_lens: list[int], context: ContextRows | None, softmax_scale: float, writer: RowWriter,
                  workspace_tokens: int | None = None) -> None:
    """:func:`run_prefills` for any format's ``writer``, its arguments already checked (by
    :func:`check_prefills`, or built by :func:`run_rows` from a checked call: Python ints, one per prefill). A
    context beyond the bound needs the format's merge (ValueError without one, before any kernel runs)."""
    total_context = sum(context_lens)
    bound = context_workspace_tokens() if workspace_tokens is None else workspace_tokens
    cu_q = _cu(query_lens, q.device, first_row)
    max_q = max(query_lens)
    if total_context == 0:  # keys are the queries' own tokens; unless they are all of q's rows, indexed from 0
        cu_k = None if first_row == 0 and k.shape[0] == q.shape[0] else _cu(query_lens, q.device)
        writer.varlen(backend, q, k, v, cu_q, max_q, softmax_scale, cu_k, None if cu_k is None else max_q)
        return
    if total_context > bound and writer.merge is None:
        raise ValueError(f"run_prefills: context_lens sum to {total_context} cached tokens, beyond the context "
                         f"workspace bound of {bound} tokens, and this output format has no merge of context chunks")
    if total_context <= bound:
        k_context, v_context = context(0, total_context)
        k_ws = _interleave(k_context, k, context_lens, query_lens)
        v_ws = _interleave(v_context, v, context_lens, query_lens)
        key_lens = [a + b for a, b in zip(context_lens, query_lens)]
        writer.varlen(backend, q, k_ws, v_ws, cu_q, max_q, softmax_scale, _cu(key_lens, q.device), max(key_lens))
        return
    q_p = q[first_row:first_row + sum(query_lens)]
    cu_p = _cu(query_lens, q.device)
    acc = None
    for lo, hi, lengths in _context_chunks(context_lens, bound):
        k_chunk, v_chunk = context(lo, hi)
        part = backend.attention_lse(q_p, k_chunk, v_chunk, cu_p, max_q, _cu(lengths, q.device), max(lengths),
                                     softmax_scale, False)
        acc = part if acc is None else merge_attention(acc[0], acc[1], part[0], part[1])
    new = backend.attention_lse(q_p, k, v, cu_p, max_q, cu_p, max_q, softmax_scale, True)
    writer.merge(backend, acc[0], acc[1], new[0], new[1], first_row)


def run_on_prefill(backend: Any, impl: Any, inputs: tuple, spec: Any,
                   output: Tensor, output_scale: Tensor, output_block_scale: Tensor) -> None:
    """The fused backend on the rows of the prefills it runs (:func:`~fusion_pass.runtime.backends.base.fuses`),
    at their global rows (:func:`run_prefills`:
    prefills with cached context attend to it); every other row computed as the unfused graph computes it and
    post-quantized into its rows.

    The fused kernel runs first, once, over every prefill request (``cu_seqlens`` from the first prefill row
    ``D``): its epilogue writes rows ``[D, T)`` and its entry point zeroes scale padding, which may reach into
    the last 128-row tile. The rows it must not own are then overwritten: decode rows and prefills with
    cached context the backend does not run (their key/value rows in the kernel's input are zeros, so the
    kernel's values for them are discarded), computed by the layer's float32 runtime, rounded to the query
    dtype and written by the row-range quantizer, which touches no other row.
    """
    run_rows(backend, impl, inputs, spec, NVFP4Rows(output, output_scale, output_block_scale, spec.num_tokens))


def run_rows(backend: Any, impl: Any, inputs: tuple, spec: Any, writer: RowWriter) -> None:
    """:func:`run_on_prefill` for any format's ``writer``: the prefills ``writer.fused`` says by the backend's
    kernel of the format, every other row by ``writer.rows`` after it."""
    q = inputs[0] if inputs[0].stride(-1) == 1 else inputs[0].contiguous()  # the kernels' layout
    t, d = spec.num_tokens, spec.num_decode_tokens
    prefills = spec.requests[spec.num_decodes:]
    mask = writer.fused(backend, [r.context_len for r in prefills])
    fused = [r for r, f in zip(prefills, mask) if f]
    exact = list(spec.requests[:spec.num_decodes]) + [r for r, f in zip(prefills, mask) if not f]  # in row order
    # the common case, every prefill fused: their rows are [D, T), a view; else gathered. Without decode rows the
    # fused requests are the call's own batch, whose inputs the op checked: not checked again.
    whole = len(fused) == len(spec.requests)
    fused_rows = slice(d, t) if len(fused) == len(prefills) else _rows(spec, fused, q.device)
    _, k, v, context = impl.prefill_qkv(*(x if whole else x[fused_rows] for x in inputs),
                                       spec if whole else _sub_batch(spec, fused),
                                       kv_dtype=getattr(backend, "kv_dtype", None), check=not whole)
    if len(fused) != len(prefills):  # keys of every prefill row in order; the unfused prefills' are zeros
        k_all, v_all = k.new_zeros((t - d, *k.shape[1:])), v.new_zeros((t - d, *v.shape[1:]))
        k_all[fused_rows - d], v_all[fused_rows - d] = k, v
        k, v = k_all, v_all
    if exact:
        out = impl.forward(*(x[_rows(spec, exact, q.device)] for x in inputs), _sub_batch(spec, exact)).to(q.dtype)
    write_prefills(backend, q, k, v, d, [r.query_len for r in prefills],
                  [r.context_len if f else 0 for r, f in zip(prefills, mask)], context, impl.softmax_scale, writer)
    offset = 0
    for start, length in _runs(spec, exact):  # one row-range launch per run of adjacent rows (all decodes: one)
        writer.rows(out[offset:offset + length].reshape(length, -1), start)
        offset += length
