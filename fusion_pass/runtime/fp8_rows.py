"""How the rows of one attention call reach a fused backend when the call writes static per-tensor FP8.

The static FP8 :class:`~fusion_pass.runtime.row_plan.RowWriter` (:class:`FP8StaticRows`) and its entry points into
:mod:`fusion_pass.runtime.row_plan`'s plan, for the format
:data:`fusion_pass.formats.FP8_STATIC`: ``output`` float8_e4m3fn ``[T, H*Dv]`` (row = token, column ``h*Dv + d``)
under one float32 scale ``scale`` (the checkpoint's, ``[1]``). Every row is written by exactly one writer, and
FP8 rows share no byte (no scale tile), so the writers need no order beyond "fused kernel first, post-quantized
rows after":

* :func:`run_prefills_fp8_static`: the backend's FP8 kernel (``run_varlen_fp8_static``) on a run of prefills at
  their rows, prefills with cached context through one key/value workspace of context + new tokens
  (``cu_seqlens_k``), as :func:`~fusion_pass.runtime.row_plan.run_prefills` does within the workspace bound;
  beyond it the context's chunks are attended with their log-sum-exps (``attention_lse``) and merged
  (:meth:`FP8StaticRows.merge`: the float32 merge of the backend's partial attentions, quantized);
* :class:`FP8StaticRows`: the writer :func:`fusion_pass.runtime.row_plan.run_rows` takes for a whole call: the
  fused prefills first, then every other row (decode rows, prefills the backend does not fuse) computed as the
  unfused graph computes it, rounded to the query dtype and quantized into its own rows
  (:func:`post_quantize_rows_fp8_static`);

The unfused bytes are those of the graph's quant, in one of two forms (:class:`StaticQuant`): the op form
(:data:`OP_FORM`, vLLM's ``static_scaled_fp8_quant`` of the query-dtype attention: :func:`fusion_pass.fp8.quantize_static`
under :func:`fusion_pass.fp8.reciprocal` of the scale, a NaN +448, ``0x7E``) or the native form (:data:`NATIVE_FORM`,
vLLM's ``QuantFP8`` compiled from aten ops: the graph's own reciprocal multiplied as it is, a NaN kept, ``0x7F``); the
fused rows are the same quantizer applied to the kernel's own float32 output, in the same form.

The FP8 group formats' writer is :mod:`fusion_pass.runtime.fp8_group_rows`'s; both read the workspace bound by
:func:`workspace_bound` and merge beyond it by :func:`merged_rows`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fusion_pass import fp8
from fusion_pass.formats import FP8_STATIC
from fusion_pass.kernels.reference import merge_attention
from fusion_pass.runtime.backends.base import fused_prefills
from fusion_pass.runtime.row_plan import ContextRows, check_prefills, write_prefills
from fusion_pass.runtime.settings import check_token_count, context_workspace_tokens

__all__ = ["FP8StaticRows", "NAN_RULE", "NATIVE_FORM", "OP_FORM", "StaticQuant", "post_quantize_rows_fp8_static",
           "merged_rows", "run_prefills_fp8_static", "workspace_bound"]

NAN_RULE = fp8.NaNRule.POSITIVE_MAX
"""What a NaN becomes in the op form's bytes: +448 (``0x7E``), vLLM's ``static_scaled_fp8_quant``."""


@dataclass(frozen=True)
class StaticQuant:
    """How a static FP8 call turns float values into codes: ``scale_is_inverse`` (the call's scale tensor is the
    inverse to multiply by, else the scale, whose IEEE reciprocal is taken on the device) and ``nan`` (what a NaN
    becomes)."""

    name: str
    scale_is_inverse: bool
    nan: fp8.NaNRule

    def inverse(self, scale: Tensor) -> Tensor:
        """The float32 ``[1]`` factor the codes are ``clamp(x * factor)`` of."""
        return scale if self.scale_is_inverse else fp8.reciprocal(scale)


OP_FORM = StaticQuant("op", False, NAN_RULE)
"""vLLM's ``static_scaled_fp8_quant``: the checkpoint's scale, its IEEE reciprocal, a NaN +448."""

NATIVE_FORM = StaticQuant("native", True, fp8.NaNRule.NAN)
"""vLLM's ``QuantFP8`` compiled from aten ops (``custom_ops="none"``): the graph's reciprocal of the scale (Inductor
computes it; on CUDA its division is Triton's approximate one, so the fused call multiplies by that value rather than
computing its own), a NaN kept (``0x7F``)."""


def _rows2d(output: Tensor, t: int) -> Tensor:
    """``output`` (contiguous float8_e4m3fn, ``T * H*Dv`` elements: ``[T, H*Dv]`` or ``[T, H, Dv]``) as uint8 ``[T,
    H*Dv]`` bytes, a view."""
    return output.view(torch.uint8).view(t, -1)


def post_quantize_rows_fp8_static(rows: Tensor, scale: Tensor, output: Tensor, row_start: int, t: int,
                                  quant: StaticQuant = OP_FORM) -> None:
    """Quantize ``rows [M, ...]`` (the query-dtype attention of ``M`` tokens; ``H*Dv`` elements per row) into rows
    ``[row_start, row_start + M)`` of the ``T``-row FP8 ``output``, touching no other row: the bytes of vLLM's
    ``static_scaled_fp8_quant(result, rows, scale)`` (``quant`` the op form) or of its native form (``scale`` then the
    graph's inverse). No device value is read back."""
    q8 = fp8.quantize_static(rows.reshape(rows.shape[0], -1), quant.inverse(scale), nan=quant.nan)
    _rows2d(output, t)[row_start:row_start + rows.shape[0]] = q8.view(torch.uint8)


class FP8StaticRows:
    """:class:`~fusion_pass.runtime.row_plan.RowWriter` of static per-tensor FP8: ``output`` float8_e4m3fn (``T *
    H*Dv`` elements, contiguous), ``scale`` float32 ``[1]`` (the checkpoint's, or the graph's inverse under
    :data:`NATIVE_FORM`); a backend writes the prefills
    :func:`~fusion_pass.runtime.backends.base.fused_prefills` says by ``run_varlen_fp8_static`` (a context beyond
    the workspace bound: :meth:`merge`); other rows :func:`post_quantize_rows_fp8_static`; all in the arithmetic of
    ``quant``."""

    def __init__(self, output: Tensor, scale: Tensor, t: int, quant: StaticQuant = OP_FORM) -> None:
        self.output, self.scale, self.t, self.quant = output, scale, t, quant

    def fused(self, backend: Any, context_lens: list[int]) -> list[bool]:
        return fused_prefills(backend, FP8_STATIC, context_lens, context_workspace_tokens)

    def varlen(self, backend, q, k, v, cu_q, max_q, softmax_scale, cu_k, max_k) -> None:
        backend.run_varlen_fp8_static(q, k, v, cu_q, max_q, softmax_scale,
                                      self.output.view(fp8.FP8).view(self.t, -1), self.scale, cu_seqlens_k=cu_k,
                                      max_seqlen_k=max_k, scale_is_inverse=self.quant.scale_is_inverse,
                                      nan=self.quant.nan)

    def merge(self, backend, out_a, lse_a, out_b, lse_b, first_row: int) -> None:
        """The prefills' rows from two partial attentions (float32 ``[M, H, Dv]`` and their ``[M, H]`` log-sum-exps,
        :func:`merged_rows`), quantized by ``quant`` into rows ``[first_row, first_row + M)``."""
        x = merged_rows(out_a, lse_a, out_b, lse_b)
        q8 = fp8.quantize_static(x, self.quant.inverse(self.scale), nan=self.quant.nan)
        _rows2d(self.output, self.t)[first_row:first_row + x.shape[0]] = q8.view(torch.uint8)

    def rows(self, x: Tensor, row_start: int) -> None:
        post_quantize_rows_fp8_static(x, self.scale, self.output, row_start, self.t, self.quant)

    def everything(self, x: Tensor) -> None:
        post_quantize_rows_fp8_static(x, self.scale, self.output, 0, self.t, self.quant)


def run_prefills_fp8_static(backend: Any, q: Tensor, k: Tensor, v: Tensor, *, first_row: int, query_lens: list[int],
                            context_lens: list[int], context: ContextRows | None, softmax_scale: float,
                            output: Tensor, scale: Tensor, workspace_tokens: int | None = None,
                            quant: StaticQuant = OP_FORM) -> None:
    """The backend's fused static-FP8 attention of a run of prefills, some with cached context, at their rows.

    Args as :func:`fusion_pass.runtime.row_plan.run_prefills`, with ``output`` float8_e4m3fn (``T * H*Dv``
    elements, contiguous) and ``scale`` float32 ``[1]`` (the checkpoint's; the graph's inverse under ``quant`` =
    :data:`NATIVE_FORM`) in place of the NVFP4 buffers. Within the workspace bound (``workspace_tokens``, default
    :func:`context_workspace_tokens`) one ``backend.run_varlen_fp8_static`` call over keys that are, per request,
    its context then its new tokens; beyond it the context in chunks of at most the bound, each attended with its
    log-sum-exp, merged in float32 and quantized (:meth:`FP8StaticRows.merge`). Every mismatch
    :func:`~fusion_pass.runtime.row_plan.check_prefills` finds raises ValueError before any kernel runs.

    Rows outside ``[first_row, first_row + sum(query_lens))`` are not written.
    """
    query_lens, context_lens = check_prefills(q, k, v, first_row, query_lens, context_lens, context)
    bound = workspace_bound("run_prefills_fp8_static", workspace_tokens)
    write_prefills(backend, q, k, v, int(first_row), query_lens, context_lens, context, softmax_scale,
                  FP8StaticRows(output, scale, q.shape[0], quant), bound)


def workspace_bound(fn: str, workspace_tokens: int | None) -> int:
    """The context workspace bound of an FP8 run of prefills: ``workspace_tokens`` (checked: a token count, named
    after ``fn``), default :func:`context_workspace_tokens`."""
    if workspace_tokens is not None:
        check_token_count(f"{fn}(workspace_tokens)", workspace_tokens)
    return context_workspace_tokens() if workspace_tokens is None else workspace_tokens


def merged_rows(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tensor:
    """Two partial attentions of ``M`` rows over disjoint keys (float32 ``[M, H, Dv]``, log-sum-exps ``[M, H]``)
    merged into the attention over all their keys (:func:`fusion_pass.kernels.reference.merge_attention`, float32),
    as ``[M, H*Dv]``: what an FP8 format's merge quantizes."""
    out = merge_attention(out_a, lse_a, out_b, lse_b)[0]
    return out.reshape(out.shape[0], -1)
