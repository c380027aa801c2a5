"""The error bound of NVFP4 round trips (docs/nvfp4.md, "Error bound")."""

from __future__ import annotations

import torch

from fusion_pass.nvfp4.checks import check_x
from fusion_pass.nvfp4.layout import BLOCK_SIZE, E4M3_MAX
from fusion_pass.nvfp4.reference import const, split_blocks


def error_bound(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Per-element upper bound on ``|x - dequantize(quantize(x, gs))|``.

    Returns float32 ``[M, K]`` (leading dims of ``x`` flattened), constant over
    each 16-element block::

        bound = s * (1 + 2**-4) + 6 * 2**-10 / gs + max(amax - 6 * 448 / gs, 0)

    with ``amax`` the block's max magnitude and ``s = amax / 6``.

    Derivation. Let ``t = gs * s`` (the unrounded scale), ``sf`` its e4m3
    rounding and ``d = sf / gs`` the step that multiplies codes on decode. An
    element decodes to ``v * d`` with ``v`` the e2m1 value of ``q = x / d``.

    * If ``|q| <= 6``, ``|q - v|`` is at most half the gap between neighbouring
      magnitudes, at most 1 (the 4..6 gap), so the error is ``<= d``.
    * If ``|q| > 6`` the code saturates at 6 and the error is
      ``|x| - 6 d <= amax - 6 d``.

    Hence error ``<= max(d, amax - 6 d)``. Bounding ``d`` by the e4m3 rounding:

    * normal range (``2**-6 <= t <= 448``): ``|sf - t| <= t / 17`` (3 mantissa
      bits, worst case just above ``1.0625 * 2**e``), so ``d <= s * 18/17`` and
      ``amax - 6 d <= 6 s / 17 < d``: error ``<= s * (1 + 2**-4)``;
    * subnormal range (``t < 2**-6``): ``|sf - t| <= 2**-10`` (half the spacing
      ``2**-9``), so ``d <= s + 2**-10 / gs`` and
      ``amax - 6 d <= 6 * 2**-10 / gs``. When ``sf`` rounds to 0 the block
      decodes to 0 and the error is ``|x| <= amax = 6 t / gs <= 6 * 2**-10 / gs``;
    * saturated range (``t > 448``): ``sf = 448``, ``d = 448 / gs < s``, and
      elements beyond ``6 d`` lose ``amax - 6 * 448 / gs``.

    The sum of the three terms covers every case. The margin of the first
    term over ``18/17`` (a relative ``1/272``) absorbs the float32 roundings of
    ``gs * amax / 6``, ``gs / sf``, ``x * inv`` and of the decode, which are of
    relative size ``2**-23`` each.
    """
    check_x("error_bound", x, global_scale)
    blocks = split_blocks(x)
    gs = global_scale.reshape(())
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    s = amax / const(amax, 6.0)
    saturation = (amax - const(amax, 6.0 * E4M3_MAX) / gs).clamp(min=0)
    bound = s * (1 + 2**-4) + const(amax, 6 * 2**-10) / gs + saturation
    m, n_blocks, _ = blocks.shape
    return bound.expand(blocks.shape).reshape(m, n_blocks * BLOCK_SIZE)
