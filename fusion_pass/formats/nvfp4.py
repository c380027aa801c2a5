"""NVFP4 as an :class:`~fusion_pass.formats.base.OutputFormat` (the bytes: :mod:`fusion_pass.nvfp4`)."""

from __future__ import annotations

import torch

from fusion_pass import nvfp4
from fusion_pass.formats.base import BufferSpec, OutputFormat, ScaleKind


def _scale_shape(t: int, n: int) -> tuple[int, int]:
    rows, cols = nvfp4.scale_shape(t, n, swizzled=True)
    return rows, cols // 4


NVFP4 = OutputFormat(
    name="nvfp4",
    element=torch.uint8,
    scales=ScaleKind(static=False, group=nvfp4.BLOCK_SIZE),
    columns=nvfp4.BLOCK_SIZE,
    head_multiple=nvfp4.BLOCK_SIZE,
    buffers=(BufferSpec("packed", torch.uint8, lambda t, n: (t, n // 2)),
             BufferSpec("block_scales", torch.int32, _scale_shape)),
    quantize=lambda x, global_scale: nvfp4.quantize(x, global_scale, swizzled=True),
    error_bound=nvfp4.error_bound,
    replaces=("scaled_fp4_quant (.out and the allocating form) with 128x4 swizzled scales, read by an NVFP4 GEMM",),
)
"""Packed e2m1 codes ``uint8 [T, N/2]`` and e4m3 block scales (one per 16 columns, 128x4 swizzled, vLLM's int32
allocation ``[round_up(T, 128), round_up(N/16, 4) / 4]``), under a float32 global scale."""
