"""Rows of the static per-tensor FP8 buffer a fused vLLM call writes (:data:`fusion_pass.formats.FP8_STATIC`): the
unfused graph's quant op, and its bytes written into chosen rows.

The call's buffer is the quant's ``result``: float8_e4m3fn ``[T, K]`` (``K = H * Dv``; row = token, column ``h*Dv +
d``), contiguous, under the float32 scale ``[1]`` the quant reads (``output_scale``; the checkpoint's). A row's bytes
are its ``K`` codes and nothing else: FP8 rows share no byte (no scale tile), so writers of different rows need no
order between them.

The quant op is the one the unfused graph calls (:func:`quant_op`): vLLM's ``_C::static_scaled_fp8_quant`` where this
build defines it with its schema (``result, input, scale, group_shape``), else this project's
``fusion_pass::static_scaled_fp8_quant`` (same schema, same bytes: ``fp8(clamp(x * (1 / scale), -448, 448))``, a NaN
+448). vLLM's CPU build registers a ``_C::static_scaled_fp8_quant`` without arguments (a placeholder): it is not
taken.
"""

from __future__ import annotations

import functools

import torch

from fusion_pass import fp8
from fusion_pass.formats import FP8_STATIC
from fusion_pass.runtime.fp8_rows import OP_FORM, StaticQuant

__all__ = ["QUANT_ARGUMENTS", "check_call", "codes", "fits", "quant_op", "quantize", "static_quant_op", "write_rows"]

QUANT_ARGUMENTS = ("result", "input", "scale")
"""The arguments of ``static_scaled_fp8_quant`` the pass and the fallback use (vLLM's schema)."""


def fits(op) -> bool:
    """Whether ``op`` (an ``OpOverload``, or None where absent) takes :data:`QUANT_ARGUMENTS`."""
    schema = getattr(op, "_schema", None)
    return schema is not None and set(QUANT_ARGUMENTS) <= {a.name for a in schema.arguments}


def static_quant_op():
    """The static FP8 quant op of this process (module docstring), looked up now: vLLM's ``_C`` op where it fits,
    else the project's. :func:`fusion_pass.vllm.compile.vocabulary.vllm_vocabulary` binds the same op."""
    try:
        c_op = torch.ops._C.static_scaled_fp8_quant.default
    except (AttributeError, RuntimeError):
        c_op = None
    if fits(c_op):
        return c_op
    import fusion_pass.ops  # noqa: F401  (registers torch.ops.fusion_pass.*)

    return torch.ops.fusion_pass.static_scaled_fp8_quant.default


@functools.lru_cache(maxsize=None)
def quant_op():
    """:func:`static_quant_op`, looked up once per process (vLLM's ``_C`` ops are registered when vLLM is imported,
    before any graph runs)."""
    return static_quant_op()


def check_call(name: str, output, output_scale, output_block_scale, scale_name: str = "output_scale") -> None:
    """The buffers of a static FP8 call, checked before anything is written (``ValueError`` naming the argument):
    ``output`` contiguous float8_e4m3fn, ``output_scale`` (or the native form's ``output_inv_scale``, named by
    ``scale_name``) one float32 value, no ``output_block_scale`` (an FP8 output with block scales is a group format,
    which the fused op does not write)."""
    if output.dtype != FP8_STATIC.element:
        raise ValueError(f"{name}: output must be float8_e4m3fn with {scale_name} (static FP8), got {output.dtype}")
    if output_block_scale is not None:
        raise ValueError(f"{name}: output_block_scale must be None for a float8_e4m3fn output (static per-tensor "
                         f"FP8); FP8 group scales are not written by the fused call")
    if output_scale.dtype != torch.float32 or output_scale.numel() != 1:
        raise ValueError(f"{name}: {scale_name} of a static FP8 output must be one float32 value, got "
                         f"{output_scale.dtype} with {output_scale.numel()} elements")
    if not output.is_contiguous():
        raise ValueError(f"{name}: output (float8_e4m3fn) must be contiguous, got strides {tuple(output.stride())}")


def codes(output: torch.Tensor) -> torch.Tensor:
    """``output`` (``[T, K]`` or ``[T, H, Dv]``, contiguous float8_e4m3fn) as ``[T, K]``, a view."""
    return output.view(output.shape[0], -1)


def quantize(result: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, quant: StaticQuant = OP_FORM) -> None:
    """``values`` quantized into ``result`` (float8_e4m3fn, its shape) as the unfused graph does: the op form by its
    quant op (:func:`quant_op`), the native form (``scale`` the graph's inverse) by the same aten arithmetic
    (:func:`fusion_pass.fp8.quantize_static`, a NaN kept)."""
    if quant.scale_is_inverse:
        result.copy_(fp8.quantize_static(values, scale, nan=quant.nan).view(result.shape))
        return
    quant_op()(result, values, scale)


def write_rows(values: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, rows,
               quant: StaticQuant = OP_FORM) -> None:
    """``values [M, K]`` (the query dtype: attention as the unfused graph computed it) quantized as the unfused graph
    does (:func:`quantize`) into ``rows`` of ``out`` (``[T, K]`` float8_e4m3fn): a slice of ``M`` rows is written
    in place; an int64 index tensor of ``M`` rows through an ``[M, K]`` temporary whose bytes are copied into those
    rows. Quantization is per element, so each row's bytes are the unfused graph's; no other row is touched."""
    if isinstance(rows, slice):
        quantize(out[rows], values, scale, quant)
        return
    tmp = torch.empty(values.shape, dtype=FP8_STATIC.element, device=values.device)
    quantize(tmp, values, scale, quant)
    out.view(torch.uint8).index_copy_(0, rows, tmp.view(torch.uint8))

