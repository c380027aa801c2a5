"""Poisoned NVFP4 buffer pairs and the bytes expected in them, for the row-range writers' tests
(test_row_range_quant.py: ``quantize_rows_into``; test_merge_nvfp4.py: ``merge_attention_nvfp4``).

A writer owning rows ``[row_start, row_start + M)`` of a ``T``-row buffer pair (``packed`` uint8
``[T, K/2]``, the 128x4 swizzled scale buffer of ``T`` rows) writes exactly the whole-buffer
quantizer's bytes in those rows and leaves :data:`POISON` in every other byte. Imported by the
test modules with this folder on ``sys.path`` (as ``graph_cases``).
"""

from __future__ import annotations

import torch

from fusion_pass import nvfp4

POISON = 0xAB
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def poisoned(t: int, k: int, scale_dtype, device=DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """``packed`` uint8 ``[T, K/2]`` and the swizzled scale buffer of ``T`` rows as ``scale_dtype``
    (int32 ``[Rp, C/4]``, uint8 / fp8 ``[Rp, C]``), every byte 0xAB."""
    rows, cols = nvfp4.scale_shape(t, k)
    packed = torch.full((t, k // 2), POISON, dtype=torch.uint8, device=device)
    scales = torch.full((rows, cols), POISON, dtype=torch.uint8, device=device).view(scale_dtype)
    return packed, scales


def scale_bytes(scales: torch.Tensor) -> torch.Tensor:
    return scales.view(torch.uint8).flatten().cpu()


def row_of_scale_byte(t: int, k: int) -> torch.Tensor:
    """The row each byte of the swizzled buffer belongs to (own inversion of NVFP4.md's formula)."""
    rows, cols = nvfp4.scale_shape(t, k)
    offset = torch.arange(rows * cols)
    within = offset % 512
    band = offset // 512 // (cols // 4)
    return band * 128 + ((within % 16) // 4) * 32 + within // 16


def expected(t, k, want_packed, want_scales, owned) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole-buffer bytes in the rows marked in ``owned`` (bool ``[round_up(T, 128)]``), poison elsewhere."""
    packed = torch.where(owned[:t, None], want_packed.cpu(), POISON)
    scales = torch.where(owned[row_of_scale_byte(t, k)], scale_bytes(want_scales), POISON)
    return packed, scales
