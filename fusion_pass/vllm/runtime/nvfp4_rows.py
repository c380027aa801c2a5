"""Rows of the NVFP4 buffers a fused vLLM call writes: the unfused graph's quant op, and byte copies of whole rows.

The call's buffers are the quant's: packed uint8 ``[T, K/2]`` and its swizzled scale buffer (vLLM's int32 view).
A row's bytes are its ``K/2`` packed bytes and its ``round_up(K/16, 4)`` scale bytes, wherever the swizzle puts
them (:func:`fusion_pass.nvfp4.swizzled_offset`); rows written here touch no byte of another row of a shared
128-row tile (``docs/design.md``, "Why a 128-row tile can hold decode and prefill rows").
"""

from __future__ import annotations

import functools

import torch

from fusion_pass import nvfp4

__all__ = ["copy_rows", "nvfp4_rows", "quant_op", "write_rows", "zero_padding"]


@functools.lru_cache(maxsize=None)
def quant_op():
    """The quant op the unfused graph calls (the one :func:`fusion_pass.vllm.compile.vocabulary.vllm_vocabulary` matches),
    looked up once per process (vLLM's ``_C`` ops are registered when vLLM is imported, before any graph runs)."""
    c = getattr(torch.ops, "_C", None)
    if c is not None and hasattr(c, "scaled_fp4_quant") and hasattr(c, "cutlass_scaled_fp4_mm"):
        return c.scaled_fp4_quant.out
    return torch.ops.fusion_pass.scaled_fp4_quant.out


def nvfp4_rows(output, output_block_scale, n: int):
    """``(packed uint8 [T, K/2], every scale byte (flat), the scale bytes of n rows [round_up(n, 128), cols])``."""
    tokens = output.shape[0]
    packed = output.view(tokens, -1)
    rows, cols = nvfp4.scale_shape(n, packed.shape[1] * 2)
    scale_bytes = output_block_scale.view(torch.uint8).view(-1)
    return packed, scale_bytes, scale_bytes[: rows * cols].view(rows, cols)


def zero_padding(packed, scale_bytes, n: int) -> None:
    """Zero rows past ``n`` (vLLM pads batches for CUDA graphs): their packed bytes, their scale bytes in ``n``'s
    last 128-row tile and every scale tile past it."""
    width = packed.shape[1] * 2
    rows, cols = nvfp4.scale_shape(n, width)
    packed[n:].zero_()
    scale_bytes[rows * cols:].zero_()
    if n < rows:
        scale_bytes[nvfp4.row_scale_offsets(n, rows, width // nvfp4.BLOCK_SIZE, packed.device)] = 0


def _row_tensor(rows, device) -> torch.Tensor:
    return torch.arange(rows.start, rows.stop, device=device) if isinstance(rows, slice) else rows


def copy_rows(src_packed, src_scale_bytes, packed, scale_bytes, rows) -> None:
    """Rows ``[0, M)`` of an ``M``-row NVFP4 pair (``src_packed [M, K/2]``, ``src_scale_bytes`` flat) into ``rows``
    (a slice, or an int64 index tensor of ``M`` rows) of a ``T``-row pair: the packed bytes and every scale byte
    of those rows, no other."""
    m, half = src_packed.shape
    blocks = half * 2 // nvfp4.BLOCK_SIZE
    if isinstance(rows, slice):
        packed[rows].copy_(src_packed)
    else:
        packed.index_copy_(0, rows, src_packed)
    device = packed.device
    cols = torch.arange(nvfp4.round_up(blocks, 4), device=device)
    source = nvfp4.row_scale_offsets(0, m, blocks, device)
    target = nvfp4.swizzled_offset(_row_tensor(rows, device)[:, None], cols[None, :], blocks).reshape(-1)
    scale_bytes[target] = src_scale_bytes[source]


def write_rows(values, output_scale, packed, scale_bytes, rows, scale_dtype) -> None:
    """``values [M, K]`` (the query dtype: attention as the unfused graph computed it) quantized by the unfused
    graph's quant op (:func:`quant_op`) into ``M``-row temporaries, whose bytes go into ``rows`` of the call's
    buffers (:func:`copy_rows`). Quantization is per row, so each row's bytes are the unfused graph's."""
    m, width = values.shape
    scale_rows, cols = nvfp4.scale_shape(m, width)
    rows_packed = torch.empty(m, width // 2, dtype=torch.uint8, device=values.device)
    rows_scales = torch.empty(scale_rows, cols, dtype=torch.uint8, device=values.device)
    quant_op()(values, output_scale, True, output=rows_packed, output_scale=rows_scales.view(scale_dtype))
    copy_rows(rows_packed, rows_scales.view(-1), packed, scale_bytes, rows)
