"""The NVFP4 format, byte-exact (docs/nvfp4.md): the bytes every producer in this project must write.

* :mod:`.layout`: constants, buffer shapes, the 128x4 swizzled scale layout;
* :mod:`.codes`: the e2m1 codes;
* :mod:`.reference`: the reference quantizer and dequantizer (plain PyTorch, any device);
* :mod:`.bounds`: the error bound of a round trip;
* :mod:`.checks`: the argument checks, raising :class:`ArgumentError`.

Imports no kernel: the Triton quantizer for CUDA tensors is :func:`fusion_pass.kernels.quantize`.
"""

from fusion_pass.nvfp4.bounds import error_bound
from fusion_pass.nvfp4.checks import ArgumentError
from fusion_pass.nvfp4.codes import codes_to_values, half_step, unpack_codes
from fusion_pass.nvfp4.layout import (
    BLOCK_SIZE,
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    GLOBAL_SCALE_MAX,
    byte_views,
    round_up,
    row_scale_offsets,
    scale_shape,
    swizzle_scales,
    swizzled_offset,
    unswizzle_scales,
)
from fusion_pass.nvfp4.reference import dequantize, quantize, quantize_rows_into, zero_scale_padding

__all__ = [
    "ArgumentError",
    "BLOCK_SIZE",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "GLOBAL_SCALE_MAX",
    "byte_views",
    "codes_to_values",
    "dequantize",
    "error_bound",
    "half_step",
    "quantize",
    "quantize_rows_into",
    "round_up",
    "row_scale_offsets",
    "scale_shape",
    "swizzle_scales",
    "swizzled_offset",
    "unpack_codes",
    "unswizzle_scales",
    "zero_scale_padding",
]
