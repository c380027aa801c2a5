"""Constants and buffer layouts of the FP8 output formats (docs/formats.md, "FP8").

Plain tensor ops: any device, ``FakeTensorMode`` and torch.compile.
"""

from __future__ import annotations

import enum

import torch

from fusion_pass.nvfp4.layout import round_up

FP8 = torch.float8_e4m3fn
"""The element type of every FP8 format here (vLLM's ``current_platform.fp8_dtype()`` on CUDA)."""

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn magnitude: quantized values are clamped to ``[-448, 448]``."""

GROUP_SIZE = 128
"""Output columns per scale of the group format (DeepSeek-style ``GroupShape(1, 128)``)."""

SCALE_EPS = 1e-10
"""The group quantizer's floor on a group's max magnitude (vLLM's ``per_token_group_quant_fp8`` default)."""

X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class ScaleLayout(enum.Enum):
    """How a ``[T, N / 128]`` float32 group-scale matrix lies in memory (vLLM's three forms).

    * ``ROW_MAJOR``: contiguous ``[T, N/128]``;
    * ``COLUMN_MAJOR``: strides ``(1, T)``: an ``[N/128, T]`` buffer seen transposed;
    * ``COLUMN_MAJOR_TMA``: strides ``(1, round_up(T, 4))``: an ``[N/128, round_up(T, 4)]`` buffer seen
      transposed and cut to ``T`` rows (DeepGEMM's TMA-aligned scales).
    """

    ROW_MAJOR = "row_major"
    COLUMN_MAJOR = "column_major"
    COLUMN_MAJOR_TMA = "column_major_tma"

    def leading(self, tokens: int) -> int:
        """Elements between one group column's scales and the next's (column-major forms)."""
        return round_up(tokens, 4) if self is ScaleLayout.COLUMN_MAJOR_TMA else tokens

    def strides(self, tokens: int, groups: int) -> tuple[int, int]:
        """The ``[T, N/128]`` view's strides in this layout."""
        return (groups, 1) if self is ScaleLayout.ROW_MAJOR else (1, self.leading(tokens))

    @classmethod
    def of(cls, scales: torch.Tensor) -> ScaleLayout | None:
        """The layout a ``[T, G]`` tensor's strides say, or None when they say none of the three. A tensor with
        one row or one group column matches more than one: row-major is preferred there."""
        t, g = scales.shape
        for layout in cls:
            want = layout.strides(t, g)
            if all(size == 1 or stride == w for size, stride, w in zip(scales.shape, scales.stride(), want)):
                return layout
        return None


def group_scale_shape(tokens: int, width: int, group_size: int = GROUP_SIZE) -> tuple[int, int]:
    """The logical shape of a ``[T, N]`` output's group scales: ``(T, N / group_size)``."""
    return tokens, width // group_size


def group_scale_buffer(tokens: int, width: int, layout: ScaleLayout = ScaleLayout.ROW_MAJOR, *,
                       group_size: int = GROUP_SIZE, device=None) -> torch.Tensor:
    """A float32 ``[T, N / group_size]`` scale tensor in ``layout`` (uninitialized), as vLLM allocates it."""
    t, g = group_scale_shape(tokens, width, group_size)
    if layout is ScaleLayout.ROW_MAJOR:
        return torch.empty(t, g, dtype=torch.float32, device=device)
    return torch.empty(g, layout.leading(t), dtype=torch.float32, device=device)[:, :t].t()


def writable_scales(scales: torch.Tensor) -> bool:
    """Whether the writers take a ``[T, G]`` scale tensor's strides: one of the three :class:`ScaleLayout`, or the
    first ``T`` rows of a column-major one (strides ``(1, L)``, ``L >= T``: a batch's rows of a buffer allocated for
    more, as vLLM's padded batches are)."""
    if ScaleLayout.of(scales) is not None:
        return True
    t = scales.shape[0]
    return scales.stride(0) == 1 and scales.stride(1) >= t

