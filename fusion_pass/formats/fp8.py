"""The FP8 output formats as :class:`~fusion_pass.formats.base.OutputFormat` (the bytes: :mod:`fusion_pass.fp8`).

Refused: dynamic per-token (one scale per row over every head: no per-head tile can compute it before the
others are done) and dynamic per-tensor (one scale over the whole output), :data:`REFUSED`.
"""

from __future__ import annotations

import torch

from fusion_pass import fp8
from fusion_pass.formats.base import BufferSpec, OutputFormat, RefusedFormat, ScaleKind

FP8_STATIC = OutputFormat(
    name="fp8_static",
    element=fp8.FP8,
    scales=ScaleKind(static=True, group=None),
    columns=1,
    head_multiple=None,
    buffers=(BufferSpec("output", fp8.FP8, lambda t, n: (t, n)),),
    quantize=lambda x, scale: (fp8.quantize_static(x, fp8.reciprocal(scale)),),
    error_bound=fp8.static_error_bound,
    replaces=("_C::static_scaled_fp8_quant(result, input, scale, group_shape=[-1, -1]) (QuantFP8 enabled)",
              "QuantFP8's native form: float32 -> * reciprocal(scale) -> clamp(-448, 448) -> float8_e4m3fn"),
)
"""``float8_e4m3fn [T, N]``: ``fp8(clamp(x * (1 / scale), -448, 448))`` under a float32 per-tensor scale."""


def _group_format(name: str, ue8m0: bool) -> OutputFormat:
    def quantize(x, *, divide: bool = False):
        return fp8.quantize_group(x, ue8m0=ue8m0, divide=divide)

    return OutputFormat(
        name=name,
        element=fp8.FP8,
        scales=ScaleKind(static=False, group=fp8.GROUP_SIZE, power_of_two=ue8m0),
        columns=fp8.GROUP_SIZE,
        head_multiple=fp8.GROUP_SIZE,
        buffers=(BufferSpec("output", fp8.FP8, lambda t, n: (t, n)),
                 BufferSpec("scales", torch.float32, fp8.group_scale_shape, strided=True)),
        quantize=quantize,
        error_bound=fp8.group_error_bound,
        replaces=(f"_C::per_token_group_fp8_quant(input, output_q, output_s, 128, 1e-10, -448, 448, "
                  f"scale_ue8m0={ue8m0}, ...) (row-major, column-major or TMA-aligned column-major scales)",),
    )


FP8_GROUP128 = _group_format("fp8_group128", ue8m0=False)
"""``float8_e4m3fn [T, N]`` and float32 scales ``[T, N/128]``: each row's 128-column groups quantized against
``max(1e-10, max |x_g|) / 448``."""

FP8_GROUP128_UE8M0 = _group_format("fp8_group128_ue8m0", ue8m0=True)
"""As :data:`FP8_GROUP128` with each scale rounded up to a power of two (DeepGEMM's UE8M0 scales, as float32)."""

REFUSED = (
    RefusedFormat("fp8_dynamic_per_token", ("_C", "dynamic_per_token_scaled_fp8_quant", "default"), "_C::dynamic_per_token_scaled_fp8_quant(result, input, scale, scale_ub)",
                  "fp8 per-token dynamic scales take the max over every head of a row; a per-head attention tile "
                  "cannot know it before the row's other heads are done"),
    RefusedFormat("fp8_dynamic_per_tensor", ("_C", "dynamic_scaled_fp8_quant", "default"), "_C::dynamic_scaled_fp8_quant(result, input, scale)",
                  "fp8 dynamic per-tensor scales take the max over the whole output, known only after every tile"),
    RefusedFormat("fp8_group_scales_packed", ("_C", "per_token_group_fp8_quant_packed", "default"), "_C::per_token_group_fp8_quant_packed(input, output_q, output_s_packed, ...)",
                  "fp8 groups with int32-packed UE8M0 scales (DeepGEMM on SM100) are not written by the fused call"),
)
