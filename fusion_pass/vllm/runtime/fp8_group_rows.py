"""Rows of the FP8 128-column group buffers a fused vLLM call writes (:data:`fusion_pass.formats.FP8_GROUP128`, its
UE8M0 variant): the unfused graph's quant op, and its bytes written into chosen rows.

The call's buffers are the quant's: ``output`` (``output_q``) float8_e4m3fn ``[T, K]`` (``K = H * Dv``), contiguous,
and ``output_block_scale`` (``output_s``) float32 logical ``[T, K/128]`` in one of vLLM's three layouts
(:class:`fusion_pass.fp8.ScaleLayout`: a strided tensor, written through its strides). A row's bytes are its ``K``
codes and its ``K/128`` scales: rows share no byte, so writers of different rows need no order between them.

The quant op is the one the unfused graph calls (:func:`quant_op`): vLLM's ``_C::per_token_group_fp8_quant`` where this
build defines it with its schema, else this project's ``fusion_pass::per_token_group_fp8_quant`` (same schema; the
bytes of vLLM 0.33/0.34's kernel). vLLM 0.32's kernel divides by the scale where 0.33 and later multiply by its
reciprocal (docs/formats.md): :func:`divides` says which arithmetic the bound op has, which the fused rows follow.
"""

from __future__ import annotations

import functools

import torch

from fusion_pass import fp8
from fusion_pass.runtime.fp8_group_rows import GroupQuant

__all__ = ["check_call", "divides", "group_quant", "group_quant_op", "quant_op", "quantize", "write_rows"]

_ARGUMENTS = ("input", "output_q", "output_s", "group_size", "eps", "fp8_min", "fp8_max", "scale_ue8m0")


def _fits(op) -> bool:
    schema = getattr(op, "_schema", None)
    return schema is not None and set(_ARGUMENTS) <= {a.name for a in schema.arguments}


def _c_op():
    try:
        return torch.ops._C.per_token_group_fp8_quant.default
    except (AttributeError, RuntimeError):
        return None


def group_quant_op():
    """The group FP8 quant op of this process (module docstring), looked up now: vLLM's ``_C`` op where it fits, else
    the project's. :func:`fusion_pass.vllm.compile.vocabulary.vllm_vocabulary` binds the same op."""
    c_op = _c_op()
    if _fits(c_op):
        return c_op
    import fusion_pass.ops  # noqa: F401  (registers torch.ops.fusion_pass.*)

    return torch.ops.fusion_pass.per_token_group_fp8_quant.default


@functools.lru_cache(maxsize=None)
def quant_op():
    """:func:`group_quant_op`, looked up once per process."""
    return group_quant_op()


def divides(op=None) -> bool:
    """Whether the group quant ``op`` (default: :func:`quant_op`) computes ``x / s``: vLLM 0.32's ``_C`` kernel.
    The project's op and 0.33+'s kernel compute ``x * (1 / s)``."""
    from fusion_pass.vllm import releases

    op = quant_op() if op is None else op
    release = releases.current()
    return op is _c_op() and release is not None and release.line == "0.32"


def group_quant(quant_scale_ue8m0) -> GroupQuant:
    """The arithmetic of a call's group quant: UE8M0 scales as the call says, division as :func:`divides`."""
    return GroupQuant(ue8m0=bool(quant_scale_ue8m0), divide=divides())


def check_call(name: str, output, output_scale, output_block_scale, quant_group_size) -> None:
    """The buffers of a group FP8 call, checked before anything is written (``ValueError`` naming the argument):
    ``quant_group_size`` 128, no ``output_scale``, ``output`` contiguous float8_e4m3fn ``[T, K]`` (or ``[T, H, Dv]``)
    with ``K % 128 == 0``, ``output_block_scale`` float32 ``[T, K/128]`` in one of the three layouts."""
    if quant_group_size != fp8.GROUP_SIZE:
        raise ValueError(f"{name}: quant_group_size must be {fp8.GROUP_SIZE}, got {quant_group_size!r}")
    if output_scale is not None:
        raise ValueError(f"{name}: output_scale must be None with quant_group_size (dynamic group scales)")
    if output.dtype != fp8.FP8 or not output.is_contiguous() or output.dim() < 2:
        raise ValueError(f"{name}: output must be contiguous float8_e4m3fn [T, K] with quant_group_size, got "
                         f"{output.dtype} {list(output.shape)} strides {list(output.stride())}")
    t, width = output.shape[0], output.numel() // max(output.shape[0], 1)
    want = [t, width // fp8.GROUP_SIZE]
    if (width % fp8.GROUP_SIZE or not isinstance(output_block_scale, torch.Tensor)
            or output_block_scale.dtype != torch.float32 or list(output_block_scale.shape) != want
            or not fp8.writable_scales(output_block_scale)):
        got = (f"{output_block_scale.dtype} {list(output_block_scale.shape)} strides "
               f"{list(output_block_scale.stride())}" if isinstance(output_block_scale, torch.Tensor)
               else type(output_block_scale).__name__)
        raise ValueError(f"{name}: output_block_scale must be the float32 group scales {want} of a [T, K] output "
                         f"with K % 128 == 0, row-major or column-major (TMA-aligned or not), got {got}")


def quantize(codes: torch.Tensor, scales: torch.Tensor, values: torch.Tensor, quant: GroupQuant) -> None:
    """``values [M, K]`` quantized into ``codes [M, K]`` and ``scales [M, K/128]`` (any layout) by the unfused graph's
    quant op (:func:`quant_op`; ``quant.ue8m0`` its ``scale_ue8m0``)."""
    column_major = fp8.ScaleLayout.of(scales) is not fp8.ScaleLayout.ROW_MAJOR
    quant_op()(values, codes, scales, fp8.GROUP_SIZE, fp8.SCALE_EPS, -fp8.E4M3_MAX, fp8.E4M3_MAX, quant.ue8m0,
               column_major, fp8.ScaleLayout.of(scales) is fp8.ScaleLayout.COLUMN_MAJOR_TMA)


def write_rows(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, rows, quant: GroupQuant) -> None:
    """``values [M, K]`` (the query dtype) quantized as the unfused graph does (:func:`quantize`) into ``rows`` of
    ``codes [T, K]`` and ``scales [T, K/128]``: through ``[M, K]`` / ``[M, K/128]`` temporaries whose bytes are copied
    into those rows (a slice or an int64 index tensor). Quantization is per row, so each row's bytes are the unfused
    graph's; no other row is touched."""
    tmp_codes = torch.empty(values.shape, dtype=fp8.FP8, device=values.device)
    tmp_scales = torch.empty(values.shape[0], values.shape[1] // fp8.GROUP_SIZE, dtype=torch.float32,
                             device=values.device)
    quantize(tmp_codes, tmp_scales, values, quant)
    if isinstance(rows, slice):
        codes.view(torch.uint8)[rows] = tmp_codes.view(torch.uint8)
        scales[rows] = tmp_scales
        return
    codes.view(torch.uint8).index_copy_(0, rows, tmp_codes.view(torch.uint8))
    scales.index_copy_(0, rows, tmp_scales)
