"""Error bounds of FP8 round trips (docs/formats.md, "Error bounds").

For ``y = x / s`` (the quotient before rounding) an e4m3 rounding to nearest errs by at most half a step: ``2**-4
|y|`` where ``y`` is normal (3 mantissa bits), ``2**-10`` among the subnormals (step ``2**-9``); beyond 448 the
clamp loses ``|y| - 448``. So, in ``x``'s units::

    bound = s * (max(2**-4 * min(|y|, 448), 2**-10) + max(|y| - 448, 0)) + 2**-20 * |x|

the last term covering the float32 roundings of ``1 / s`` and ``x * (1 / s)`` (relative ``2**-24`` each) and of
the decode. NaN elements get NaN bounds (no bound holds for them).
"""

from __future__ import annotations

import torch

from fusion_pass.fp8.checks import check_group_x, check_scale, check_x
from fusion_pass.fp8.layout import E4M3_MAX, GROUP_SIZE


def _bound(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    y = (x / s).abs()
    step = torch.maximum(y.clamp(max=E4M3_MAX) * 2**-4, torch.full_like(y, 2**-10))
    return s * (step + (y - E4M3_MAX).clamp(min=0)) + 2**-20 * x.abs()


def static_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 per-element bound on ``|x - dequantize_static(quantize_static(x, 1 / scale), scale)|``."""
    check_x("static_error_bound", x)
    check_scale("static_error_bound", scale, x.device)
    return _bound(x.float(), scale.float().reshape(()))


def group_error_bound(x: torch.Tensor, scales: torch.Tensor, *, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """float32 per-element bound on ``|x - dequantize_group(*quantize_group(x))|`` given the group ``scales``
    (``[..., N / group_size]``) the quantizer chose."""
    check_group_x("group_error_bound", x, group_size)
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    return _bound(g, scales.float().unsqueeze(-1)).reshape(x.shape)
