"""Which output format one attention call writes, read once per call from the buffers it is handed.

The attention ops (``attention_with_output``, ``mla_attention_with_output``, vLLM's schema) take ``output``,
``output_scale`` and ``output_block_scale``; vLLM's own fused attention calls say the format by them:

* no ``output_scale``: the query dtype (no format: None);
* ``output`` float8_e4m3fn with ``output_scale`` (the checkpoint's float32 scale):
  :data:`~fusion_pass.formats.fp8.FP8_STATIC` (an ``output_block_scale`` beside it is refused by the format's
  checks);
* anything else with ``output_scale``: :data:`~fusion_pass.formats.nvfp4.NVFP4` (``output`` uint8 packed codes,
  ``output_block_scale`` the swizzled block scales);
* ``output_inv_scale`` (this project's argument, not vLLM's): :data:`FP8_STATIC` in the native form of vLLM's
  ``QuantFP8`` (the graph's reciprocal of the scale, a NaN kept);
* ``quant_group_size`` (vLLM's MLA op's convention for group FP8: ``output`` float8_e4m3fn, ``output_block_scale``
  the float32 group scales, no ``output_scale``): :data:`FP8_GROUP128`, or :data:`FP8_GROUP128_UE8M0` with
  ``quant_scale_ue8m0``.

Only the dtype of ``output`` and which arguments are given are read (no shape, no value): the op checks the
buffers against the format afterwards.
"""

from __future__ import annotations

import torch

from fusion_pass.formats.base import OutputFormat
from fusion_pass.formats.fp8 import FP8_GROUP128, FP8_GROUP128_UE8M0, FP8_STATIC
from fusion_pass.formats.nvfp4 import NVFP4

__all__ = ["call_format"]


def call_format(output: torch.Tensor, output_scale: torch.Tensor | None,
                output_block_scale: torch.Tensor | None,
                output_inv_scale: torch.Tensor | None = None, quant_group_size: int | None = None,
                quant_scale_ue8m0: bool | None = None) -> OutputFormat | None:
    """The format of a call handed these buffers (module docstring); None for the query-dtype form. Any FP8
    ``output`` with ``output_scale`` gives :data:`FP8_STATIC`, with an ``output_block_scale`` too: the ops' checks
    of that format then refuse the block scale (group scales come with ``quant_group_size``), naming it. An
    ``output_inv_scale`` (the native form's inverse scale) gives :data:`FP8_STATIC` whatever else is given (the ops'
    checks refuse the rest). A ``quant_group_size`` gives a group format whatever else is given (the group size
    and the buffers are the ops' checks)."""
    if quant_group_size is not None:
        return FP8_GROUP128_UE8M0 if quant_scale_ue8m0 else FP8_GROUP128
    if output_inv_scale is not None:
        return FP8_STATIC
    if output_scale is None:
        return None
    if getattr(output, "dtype", None) == FP8_STATIC.element:
        return FP8_STATIC
    return NVFP4
