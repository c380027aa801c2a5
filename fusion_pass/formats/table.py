"""The table of output formats: the one place a new format is listed."""

from __future__ import annotations

from fusion_pass.formats.base import OutputFormat
from fusion_pass.formats.fp8 import FP8_GROUP128, FP8_GROUP128_UE8M0, FP8_STATIC
from fusion_pass.formats.nvfp4 import NVFP4
from fusion_pass.nvfp4.checks import ArgumentError

FORMATS: tuple[OutputFormat, ...] = (NVFP4, FP8_STATIC, FP8_GROUP128, FP8_GROUP128_UE8M0)


def by_name(name: str) -> OutputFormat:
    """The format called ``name``; :class:`~fusion_pass.nvfp4.ArgumentError` naming the known ones otherwise."""
    for fmt in FORMATS:
        if fmt.name == name:
            return fmt
    raise ArgumentError(f"output format must be one of {[f.name for f in FORMATS]}, got {name!r}")
