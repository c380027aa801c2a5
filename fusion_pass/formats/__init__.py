"""The output format as an axis: one :class:`OutputFormat` per format the fused attention call can write.

* :mod:`.base`: :class:`OutputFormat`, :class:`ScaleKind`, :class:`BufferSpec`, :class:`RefusedFormat`;
* :mod:`.nvfp4`: :data:`NVFP4`;
* :mod:`.fp8`: :data:`FP8_STATIC`, :data:`FP8_GROUP128`, :data:`FP8_GROUP128_UE8M0` and the forms refused;
* :mod:`.call`: :func:`call_format`, the format one attention call writes, read from its buffers.
"""

from fusion_pass.formats.base import BufferSpec, OutputFormat, RefusedFormat, ScaleKind
from fusion_pass.formats.call import call_format
from fusion_pass.formats.fp8 import FP8_GROUP128, FP8_GROUP128_UE8M0, FP8_STATIC, REFUSED
from fusion_pass.formats.nvfp4 import NVFP4
from fusion_pass.formats.table import FORMATS, by_name

__all__ = [
    "BufferSpec",
    "FORMATS",
    "FP8_GROUP128",
    "FP8_GROUP128_UE8M0",
    "FP8_STATIC",
    "NVFP4",
    "OutputFormat",
    "REFUSED",
    "RefusedFormat",
    "ScaleKind",
    "by_name",
    "call_format",
]
