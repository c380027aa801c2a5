"""The buffers of one fused vLLM call, by output format: what the fused row paths (:mod:`.fused_rows`,
:mod:`.fused_standard`) and the exact fallback (:mod:`.attention_op`) do with them, written once over the format.

:func:`call_buffers` gives the buffers of the call's format (:func:`fusion_pass.formats.call_format`):

* :class:`Nvfp4Buffers`: packed uint8 ``[T, K/2]`` and the swizzled block scales (vLLM's int32 view), under the
  global scale (:mod:`.nvfp4_rows`);
* :class:`Fp8StaticBuffers`: float8_e4m3fn ``[T, K]`` under the static scale (:mod:`.fp8_static_rows`);
* :class:`Fp8GroupBuffers`: float8_e4m3fn ``[T, K]`` and float32 group scales ``[T, K/128]`` in any of vLLM's
  layouts (:mod:`.fp8_group_rows`).

Each has ``n`` (the batch's rows; rows past it are vLLM's padding), ``width`` (``K = H * Dv``), and:
``run_prefills(backend, q, k, v, first_row=..., query_lens=..., context_lens=..., context=..., softmax_scale=...)``
(the fused backend on a run of prefills at their rows), ``part(m, device)`` (empty buffers of ``m`` rows of the same
format), ``copy_from(part, rows)`` (a part's bytes into ``rows``), ``write(values, rows)`` (query-dtype rows quantized
by the unfused graph's quant op into ``rows``: a slice, or an int64 index tensor) and ``zero_padding()`` (rows
past ``n``). A write into ``rows`` never touches a byte of another row.
"""

from __future__ import annotations

import torch

from fusion_pass import fp8, nvfp4
from fusion_pass.formats import FP8_GROUP128, FP8_GROUP128_UE8M0, FP8_STATIC, NVFP4, OutputFormat
from fusion_pass.runtime import fp8_group_rows as group_rows, fp8_rows, row_plan
from fusion_pass.vllm.runtime import fp8_group_rows, fp8_static_rows, nvfp4_rows

__all__ = ["Fp8GroupBuffers", "Fp8StaticBuffers", "Nvfp4Buffers", "call_buffers", "unfused_width"]


class Nvfp4Buffers:
    """An NVFP4 call's buffers (module docstring): ``output`` packed uint8 (``[T, K/2]`` or ``[T, H, Dv/2]``),
    ``global_scale`` float32 ``[1]``, ``block_scale`` the swizzled scales (any dtype view of their bytes)."""

    format = NVFP4

    def __init__(self, output, global_scale, block_scale, n: int):
        self.n, self.global_scale, self.scale_dtype = n, global_scale, block_scale.dtype
        self.packed, self.scale_bytes, self.scales = nvfp4_rows.nvfp4_rows(output, block_scale, n)
        self.width = self.packed.shape[1] * 2

    def run_prefills(self, backend, q, k, v, **rows) -> None:
        row_plan.run_prefills(backend, q, k, v, output=self.packed[:self.n], output_scale=self.global_scale,
                              output_block_scale=self.scales, **rows)

    def part(self, m: int, device) -> "Nvfp4Buffers":
        packed = torch.empty(m, self.width // 2, dtype=torch.uint8, device=device)
        scales = torch.zeros(nvfp4.scale_shape(m, self.width), dtype=torch.uint8, device=device)
        return Nvfp4Buffers(packed, self.global_scale, scales, m)

    def copy_from(self, part: "Nvfp4Buffers", rows) -> None:
        nvfp4_rows.copy_rows(part.packed, part.scale_bytes, self.packed, self.scale_bytes, rows)

    def write(self, values, rows) -> None:
        nvfp4_rows.write_rows(values, self.global_scale, self.packed, self.scale_bytes, rows, self.scale_dtype)

    def zero_padding(self) -> None:
        nvfp4_rows.zero_padding(self.packed, self.scale_bytes, self.n)


class Fp8StaticBuffers:
    """A static FP8 call's buffer (module docstring): ``output`` contiguous float8_e4m3fn (``[T, K]`` or ``[T, H,
    Dv]``), ``scale`` float32 ``[1]`` (the checkpoint's; the graph's inverse under ``quant`` =
    :data:`fusion_pass.runtime.fp8_rows.NATIVE_FORM`)."""

    format = FP8_STATIC

    def __init__(self, output, scale, n: int, quant: fp8_rows.StaticQuant = fp8_rows.OP_FORM):
        self.n, self.scale, self.quant = n, scale, quant
        self.codes = fp8_static_rows.codes(output)
        self.width = self.codes.shape[1]

    def run_prefills(self, backend, q, k, v, **rows) -> None:
        fp8_rows.run_prefills_fp8_static(backend, q, k, v, output=self.codes[:self.n], scale=self.scale,
                                         quant=self.quant, **rows)

    def part(self, m: int, device) -> "Fp8StaticBuffers":
        return Fp8StaticBuffers(torch.empty(m, self.width, dtype=FP8_STATIC.element, device=device), self.scale, m,
                                self.quant)

    def copy_from(self, part: "Fp8StaticBuffers", rows) -> None:
        self.codes.view(torch.uint8).index_copy_(0, rows, part.codes.view(torch.uint8))

    def write(self, values, rows) -> None:
        fp8_static_rows.write_rows(values, self.scale, self.codes, rows, self.quant)

    def zero_padding(self) -> None:
        self.codes.view(torch.uint8)[self.n:].zero_()


class Fp8GroupBuffers:
    """A group FP8 call's buffers (module docstring): ``output`` contiguous float8_e4m3fn (``[T, K]`` or ``[T, H,
    Dv]``), ``scales`` float32 ``[T, K/128]`` in any :class:`fusion_pass.fp8.ScaleLayout`, quantized as ``quant`` says
    (:class:`fusion_pass.runtime.fp8_group_rows.GroupQuant`)."""

    def __init__(self, output, scales, n: int, quant: group_rows.GroupQuant):
        self.n, self.scales, self.quant = n, scales, quant
        self.format = quant.format
        self.codes = fp8_static_rows.codes(output)
        self.width = self.codes.shape[1]

    def run_prefills(self, backend, q, k, v, **rows) -> None:
        group_rows.run_prefills_fp8_group(backend, q, k, v, output=self.codes[:self.n], scales=self.scales[:self.n],
                                          quant=self.quant, **rows)

    def part(self, m: int, device) -> "Fp8GroupBuffers":
        scales = torch.empty(m, self.width // fp8.GROUP_SIZE, dtype=torch.float32, device=device)
        return Fp8GroupBuffers(torch.empty(m, self.width, dtype=fp8.FP8, device=device), scales, m, self.quant)

    def copy_from(self, part: "Fp8GroupBuffers", rows) -> None:
        self.codes.view(torch.uint8).index_copy_(0, rows, part.codes.view(torch.uint8))
        self.scales.index_copy_(0, rows, part.scales)

    def write(self, values, rows) -> None:
        fp8_group_rows.write_rows(values, self.codes, self.scales, rows, self.quant)

    def zero_padding(self) -> None:
        self.codes.view(torch.uint8)[self.n:].zero_()
        self.scales[self.n:].zero_()


def call_buffers(output_format: OutputFormat, output, output_scale, output_block_scale, n: int,
                 fp8_quant: fp8_rows.StaticQuant | group_rows.GroupQuant = fp8_rows.OP_FORM):
    """The buffers of a call writing ``output_format`` (:data:`NVFP4`, :data:`FP8_STATIC` or a group format, in the
    arithmetic of ``fp8_quant``), of which the batch has ``n`` rows. Raises ``ValueError`` for another format."""
    if output_format is NVFP4:
        return Nvfp4Buffers(output, output_scale, output_block_scale, n)
    if output_format is FP8_STATIC:
        return Fp8StaticBuffers(output, output_scale, n, fp8_quant)
    if output_format in (FP8_GROUP128, FP8_GROUP128_UE8M0):
        return Fp8GroupBuffers(output, output_block_scale, n, fp8_quant)
    raise ValueError(f"call_buffers: the fused vLLM op writes {NVFP4.name}, {FP8_STATIC.name} or the FP8 group "
                     f"formats, not {output_format.name}")


def unfused_width(output_format: OutputFormat, output) -> int:
    """``K`` (the attention output's width) of a call's ``output`` buffer in ``output_format``: NVFP4 packs two
    codes a byte."""
    return output.numel() // output.shape[0] * (2 if output_format is NVFP4 else 1)
