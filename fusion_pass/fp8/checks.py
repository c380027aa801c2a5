"""Argument checks of the FP8 format's functions: :class:`~fusion_pass.nvfp4.ArgumentError` naming the function
and the argument, before anything is computed."""

from __future__ import annotations

import torch

from fusion_pass.fp8.layout import FP8, X_DTYPES
from fusion_pass.nvfp4.checks import ArgumentError, check_tensor


def check_x(fn: str, x) -> None:
    """``x`` a float16 / bfloat16 / float32 tensor of at least one dimension."""
    check_tensor(fn, "x", x)
    if x.dtype not in X_DTYPES:
        raise ArgumentError(f"{fn}: x must be float16, bfloat16 or float32 (got {x.dtype})")
    if x.dim() == 0:
        raise ArgumentError(f"{fn}: x must have at least one dimension (got a 0-d tensor)")


def check_group_x(fn: str, x, group_size: int) -> None:
    """``x`` as :func:`check_x`, its last dimension a multiple of ``group_size``."""
    check_x(fn, x)
    if x.shape[-1] % group_size:
        raise ArgumentError(f"{fn}: x must have a last dimension divisible by the group size {group_size} "
                            f"(got shape {list(x.shape)})")


def check_scale(fn: str, scale, device: torch.device, *, name: str = "scale") -> None:
    """``scale`` a one-element float32 tensor on ``device`` (its value is not read: no device sync)."""
    if not isinstance(scale, torch.Tensor):
        raise ArgumentError(f"{fn}: {name} must be a one-element float32 tensor, got {type(scale).__name__}")
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise ArgumentError(f"{fn}: {name} must be a one-element float32 tensor, got {scale.dtype} "
                            f"{list(scale.shape)}")
    if scale.device != device:
        raise ArgumentError(f"{fn}: {name} must be on the data's device {device} (got {scale.device})")


def check_scales_for(fn: str, q, scales, group_size: int) -> None:
    """``q`` float8_e4m3fn ``[..., N]`` and ``scales`` float32 ``[..., N / group_size]``."""
    for name, t in (("q", q), ("scales", scales)):
        check_tensor(fn, name, t)
    if q.dtype != FP8 or q.dim() == 0 or q.shape[-1] % group_size:
        raise ArgumentError(f"{fn}: q must be float8_e4m3fn [..., N] with N divisible by {group_size} (got "
                            f"{q.dtype} {list(q.shape)})")
    want = [*q.shape[:-1], q.shape[-1] // group_size]
    if scales.dtype != torch.float32 or list(scales.shape) != want:
        raise ArgumentError(f"{fn}: scales must be float32 {want} (got {scales.dtype} {list(scales.shape)})")
