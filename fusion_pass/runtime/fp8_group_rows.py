"""How the rows of one attention call reach a fused backend when the call writes FP8 with 128-column group scales.

The :class:`~fusion_pass.runtime.row_plan.RowWriter` of the formats :data:`fusion_pass.formats.FP8_GROUP128` and
:data:`fusion_pass.formats.FP8_GROUP128_UE8M0` (:class:`FP8GroupRows`) and its entry points into
:mod:`fusion_pass.runtime.row_plan`'s plan, beside static FP8's (:mod:`fusion_pass.runtime.fp8_rows`):

* ``output``: float8_e4m3fn, ``T * H*Dv`` elements, contiguous (``[T, H*Dv]`` or ``[T, H, Dv]``; row = token,
  column ``h*Dv + d``);
* ``scales``: float32, logical ``[T, H*Dv/128]`` (one scale per row and 128 columns), in any of the three
  :class:`fusion_pass.fp8.ScaleLayout`: row-major, column-major (strides ``(1, T)``) or TMA-aligned column-major
  (strides ``(1, round_up(T, 4))``, a strided view whose padding rows nobody here writes).

A row's scales are its own (no scale is shared between rows), so, as for static FP8, every row is written by exactly
one writer, fused kernel first, post-quantized rows after:

* :func:`run_prefills_fp8_group`: the backend's group kernel (``run_varlen_fp8_group``) on a run of prefills at
  their rows, cached context within the workspace bound in one launch, beyond it in chunks merged in float32 and
  quantized (:meth:`FP8GroupRows.merge`);
* :class:`FP8GroupRows`: the writer :func:`fusion_pass.runtime.row_plan.run_rows` takes for a whole call; every
  row it does not fuse is the unfused graph's query-dtype attention quantized into its own rows
  (:func:`post_quantize_rows_fp8_group`).

The bytes are those of vLLM's ``per_token_group_fp8_quant`` (:func:`fusion_pass.fp8.quantize_group`, a NaN -448) in
the arithmetic :class:`GroupQuant` says; the fused rows are the same quantizer applied to the kernel's own attention
output (``reference`` and ``triton``: float32; ``fa4``: its query-dtype output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fusion_pass import fp8
from fusion_pass.formats import FP8_GROUP128, FP8_GROUP128_UE8M0, OutputFormat
from fusion_pass.runtime.backends.base import fused_prefills
from fusion_pass.runtime.fp8_rows import merged_rows, workspace_bound
from fusion_pass.runtime.row_plan import ContextRows, check_prefills, write_prefills
from fusion_pass.runtime.settings import context_workspace_tokens

__all__ = ["FP8GroupRows", "GroupQuant", "post_quantize_rows_fp8_group", "run_prefills_fp8_group"]


@dataclass(frozen=True)
class GroupQuant:
    """How a group FP8 call turns float values into codes: ``ue8m0`` (each scale rounded up to a power of two:
    DeepGEMM's scales) and ``divide`` (``x / s``, vLLM 0.32's kernel, instead of ``x * (1 / s)``, 0.33 and 0.34)."""

    ue8m0: bool
    divide: bool

    @property
    def format(self) -> OutputFormat:
        """The format written: :data:`fusion_pass.formats.FP8_GROUP128_UE8M0` with ``ue8m0``, else
        :data:`fusion_pass.formats.FP8_GROUP128`."""
        return FP8_GROUP128_UE8M0 if self.ue8m0 else FP8_GROUP128


def post_quantize_rows_fp8_group(rows: Tensor, output: Tensor, scales: Tensor, row_start: int, t: int,
                                 quant: GroupQuant) -> None:
    """Quantize ``rows [M, ...]`` (the query-dtype attention of ``M`` tokens; ``H*Dv`` elements per row) into rows
    ``[row_start, row_start + M)`` of the ``T``-row FP8 ``output`` and of ``scales`` (float32 logical ``[T,
    H*Dv/128]``, any :class:`fusion_pass.fp8.ScaleLayout`; written through its strides), touching no other row nor a
    TMA layout's padding: the bytes of vLLM's ``per_token_group_fp8_quant`` of ``rows``
    (:func:`fusion_pass.fp8.quantize_group` under ``quant``). No device value is read back."""
    m = rows.shape[0]
    codes, group_scales = fp8.quantize_group(rows.reshape(m, -1), ue8m0=quant.ue8m0, divide=quant.divide)
    output.view(torch.uint8).view(t, -1)[row_start:row_start + m] = codes.view(torch.uint8)
    scales[row_start:row_start + m] = group_scales


class FP8GroupRows:
    """:class:`~fusion_pass.runtime.row_plan.RowWriter` of the FP8 group formats: ``output`` float8_e4m3fn (``T *
    H*Dv`` elements, contiguous), ``scales`` float32 logical ``[T, H*Dv/128]`` in any layout; a backend writes the
    prefills :func:`~fusion_pass.runtime.backends.base.fused_prefills` says for ``quant.format`` by
    ``run_varlen_fp8_group`` (a context beyond the workspace bound: :meth:`merge`); other rows
    :func:`post_quantize_rows_fp8_group`; all in the arithmetic of ``quant``."""

    def __init__(self, output: Tensor, scales: Tensor, t: int, quant: GroupQuant) -> None:
        self.output, self.scales, self.t, self.quant = output, scales, t, quant

    def fused(self, backend: Any, context_lens: list[int]) -> list[bool]:
        return fused_prefills(backend, self.quant.format, context_lens, context_workspace_tokens)

    def varlen(self, backend, q, k, v, cu_q, max_q, softmax_scale, cu_k, max_k) -> None:
        backend.run_varlen_fp8_group(q, k, v, cu_q, max_q, softmax_scale,
                                     self.output.view(fp8.FP8).view(self.t, -1), self.scales, cu_seqlens_k=cu_k,
                                     max_seqlen_k=max_k, ue8m0=self.quant.ue8m0, divide=self.quant.divide)

    def merge(self, backend, out_a, lse_a, out_b, lse_b, first_row: int) -> None:
        """The prefills' rows from two partial attentions (:func:`fusion_pass.runtime.fp8_rows.merged_rows`),
        quantized by ``quant`` into rows ``[first_row, first_row + M)`` of the codes and the scales."""
        x = merged_rows(out_a, lse_a, out_b, lse_b)
        codes, scales = fp8.quantize_group(x, ue8m0=self.quant.ue8m0, divide=self.quant.divide)
        self.output.view(torch.uint8).view(self.t, -1)[first_row:first_row + x.shape[0]] = codes.view(torch.uint8)
        self.scales[first_row:first_row + x.shape[0]] = scales

    def rows(self, x: Tensor, row_start: int) -> None:
        post_quantize_rows_fp8_group(x, self.output, self.scales, row_start, self.t, self.quant)

    def everything(self, x: Tensor) -> None:
        post_quantize_rows_fp8_group(x, self.output, self.scales, 0, self.t, self.quant)


def run_prefills_fp8_group(backend: Any, q: Tensor, k: Tensor, v: Tensor, *, first_row: int, query_lens: list[int],
                           context_lens: list[int], context: ContextRows | None, softmax_scale: float,
                           output: Tensor, scales: Tensor, quant: GroupQuant,
                           workspace_tokens: int | None = None) -> None:
    """The backend's fused group-FP8 attention of a run of prefills, some with cached context, at their rows.

    Args as :func:`fusion_pass.runtime.row_plan.run_prefills`, with ``output`` float8_e4m3fn (``T * H*Dv``
    elements, contiguous), ``scales`` float32 logical ``[T, H*Dv/128]`` (any :class:`fusion_pass.fp8.ScaleLayout`)
    and ``quant`` (:class:`GroupQuant`) in place of the NVFP4 buffers. The prefills' cached context must fit the
    workspace bound (``workspace_tokens``, default :func:`context_workspace_tokens`): one
    ``backend.run_varlen_fp8_group`` call over keys that are, per request, its context then its new tokens. A
    context beyond the bound is attended in chunks of at most the bound, merged in float32 and quantized
    (:meth:`FP8GroupRows.merge`). Every mismatch :func:`~fusion_pass.runtime.row_plan.check_prefills` finds raises
    ValueError before any kernel runs.

    Rows outside ``[first_row, first_row + sum(query_lens))`` of ``output`` and ``scales`` are not written.
    """
    query_lens, context_lens = check_prefills(q, k, v, first_row, query_lens, context_lens, context)
    bound = workspace_bound("run_prefills_fp8_group", workspace_tokens)
    write_prefills(backend, q, k, v, int(first_row), query_lens, context_lens, context, softmax_scale,
                  FP8GroupRows(output, scales, q.shape[0], quant), bound)
