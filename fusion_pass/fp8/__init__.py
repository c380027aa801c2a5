"""The FP8 (e4m3) output formats, byte-exact as vLLM 0.32-0.34 write them (docs/formats.md).

* :mod:`.layout`: constants, the group-scale buffer shapes and layouts;
* :mod:`.reference`: the reference quantizers (static per-tensor, dynamic per-token groups) and the dequantizer;
* :mod:`.bounds`: the error bound of a round trip;
* :mod:`.checks`: the argument checks, raising :class:`~fusion_pass.nvfp4.ArgumentError`.

Imports no kernel.
"""

from fusion_pass.fp8.bounds import group_error_bound, static_error_bound
from fusion_pass.fp8.layout import (
    E4M3_MAX,
    FP8,
    GROUP_SIZE,
    SCALE_EPS,
    ScaleLayout,
    group_scale_buffer,
    group_scale_shape,
    writable_scales,
)
from fusion_pass.fp8.reference import (
    NaNRule,
    dequantize_group,
    dequantize_static,
    group_scales,
    quantize_group,
    quantize_static,
    reciprocal,
)

__all__ = [
    "E4M3_MAX",
    "FP8",
    "GROUP_SIZE",
    "NaNRule",
    "SCALE_EPS",
    "ScaleLayout",
    "dequantize_group",
    "dequantize_static",
    "group_error_bound",
    "group_scale_buffer",
    "group_scale_shape",
    "group_scales",
    "quantize_group",
    "quantize_static",
    "reciprocal",
    "static_error_bound",
    "writable_scales",
]
