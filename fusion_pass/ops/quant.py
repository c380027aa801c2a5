"""The NVFP4 quant ops: ``scaled_fp4_quant.out`` (and its allocating wrapper :func:`scaled_fp4_quant`) and the
per-tensor FP8 ``static_scaled_fp8_quant`` (another output format: the pass refuses attention feeding it)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fusion_pass import nvfp4
from fusion_pass.kernels import launchers
from fusion_pass.nvfp4 import ArgumentError
from fusion_pass.nvfp4.checks import check_global_scale
from fusion_pass.ops.library import dense, fake, impl

__all__ = ["QUANT_INPUT_DTYPES", "check_quant_buffers", "scaled_fp4_quant"]

QUANT_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ONE_BYTE_SCALE_DTYPES = (torch.uint8, torch.float8_e4m3fn)


def check_quant_buffers(
    input: Tensor, input_scale: Tensor, swizzled: bool, output: Tensor, output_scale: Tensor
) -> None:
    """Every argument of ``scaled_fp4_quant.out`` (see NVFP4.md), checked before anything is written.

    ``input`` float16/bfloat16/float32 ``[..., K]`` (``K % 16 == 0``, ``M`` the
    product of the leading dims); ``input_scale`` float32, one element, on
    ``input``'s device; ``output`` contiguous uint8 exactly ``[M, K/2]``;
    ``output_scale`` contiguous, swizzled: int32 ``[round_up(M,128),
    round_up(K/16,4)/4]`` (vLLM's allocation) or uint8/float8_e4m3fn
    ``[round_up(M,128), round_up(K/16,4)]``; linear: uint8/float8_e4m3fn ``[M, K/16]``.
    """
    op = "scaled_fp4_quant"
    if input.dtype not in QUANT_INPUT_DTYPES:
        raise ArgumentError(f"{op}: input must be float16, bfloat16 or float32, got {input.dtype}")
    if input.dim() < 1 or input.shape[-1] % nvfp4.BLOCK_SIZE != 0:
        raise ArgumentError(
            f"{op}: input must be [..., K] with K divisible by 16, got shape {list(input.shape)}"
        )
    device = input.device
    check_global_scale(op, input_scale, device, name="input_scale", check_value=False)
    k = input.shape[-1]
    m = math.prod(input.shape[:-1])
    want = (m, k // 2)
    if (
        output.dtype != torch.uint8
        or tuple(output.shape) != want
        or not output.is_contiguous()
        or output.device != device
    ):
        raise ArgumentError(
            f"{op}: output must be uint8 [M, K/2] = {list(want)} for input {list(input.shape)}, contiguous, "
            f"on {device}; got {output.dtype} {list(output.shape)}"
            + ("" if output.is_contiguous() else " (not contiguous)")
            + ("" if output.device == device else f" on {output.device}")
        )
    rows, cols = nvfp4.scale_shape(m, k, swizzled=swizzled)
    if swizzled:
        allowed = {torch.int32: (rows, cols // 4), **{d: (rows, cols) for d in ONE_BYTE_SCALE_DTYPES}}
        expected = (
            f"int32 [{rows}, {cols // 4}] (as vLLM allocates it) or uint8 / float8_e4m3fn [{rows}, {cols}] "
            f"(swizzled layout, round_up(M, 128) x round_up(K/16, 4) for M={m}, K={k})"
        )
    else:
        allowed = {d: (rows, cols) for d in ONE_BYTE_SCALE_DTYPES}
        expected = f"uint8 / float8_e4m3fn [{rows}, {cols}] (linear layout, [M, K/16] for M={m}, K={k})"
    if (
        allowed.get(output_scale.dtype) != tuple(output_scale.shape)
        or not dense(output_scale)
        or output_scale.device != device
    ):
        raise ArgumentError(
            f"{op}: output_scale must hold {rows}x{cols} one-byte scales: {expected}, contiguous, on {device}; "
            f"got {output_scale.dtype} {list(output_scale.shape)}"
            + ("" if dense(output_scale) else f" (not contiguous: strides {list(output_scale.stride())})")
            + ("" if output_scale.device == device else f" on {output_scale.device}")
        )
    check_global_scale(op, input_scale, device, name="input_scale", check_value=device.type == "cpu")



@impl("scaled_fp4_quant.out")
def _scaled_fp4_quant_out(
    input: Tensor, input_scale: Tensor, is_sf_swizzled_layout: bool, *, output: Tensor, output_scale: Tensor
) -> None:
    check_quant_buffers(input, input_scale, is_sf_swizzled_layout, output, output_scale)
    launchers.quantize_into(input.reshape(-1, input.shape[-1]), input_scale, output, output_scale,
                            swizzled=is_sf_swizzled_layout)


@fake("scaled_fp4_quant.out")
def _scaled_fp4_quant_out_fake(input, input_scale, is_sf_swizzled_layout, *, output, output_scale) -> None:
    return None


def scaled_fp4_quant(input: Tensor, input_global_scale: Tensor, is_sf_swizzled_layout: bool = True):
    """Quantize ``input [..., K]`` to NVFP4 through ``torch.ops.fusion_pass.scaled_fp4_quant.out``.

    Allocates the buffers exactly as vLLM's ``scaled_fp4_quant`` does:
    ``output`` uint8 ``[M, K/2]``; ``output_scale`` int32
    ``[round_up(M, 128), round_up(K/16, 4) / 4]`` when swizzled (uint8 ``[M, K/16]``
    when linear), returned viewed as ``float8_e4m3fn``.

    The arguments are checked here, by the names this function gives them, before the op is called (an
    :class:`~fusion_pass.nvfp4.ArgumentError` of one line, not the dispatcher's schema mismatch).
    """
    op = "scaled_fp4_quant"
    if not isinstance(input, Tensor):
        raise ArgumentError(f"{op}: input must be a tensor, got {type(input).__name__} {input!r}")
    if input.dtype not in QUANT_INPUT_DTYPES:
        raise ArgumentError(f"{op}: input must be float16, bfloat16 or float32, got {input.dtype}")
    if not isinstance(is_sf_swizzled_layout, bool):
        raise ArgumentError(f"{op}: is_sf_swizzled_layout must be True or False, got "
                            f"{type(is_sf_swizzled_layout).__name__} {is_sf_swizzled_layout!r}")
    if input.dim() < 1 or input.shape[-1] % nvfp4.BLOCK_SIZE != 0:
        raise ArgumentError(f"{op}: input must be [..., K] with K divisible by 16, got {list(input.shape)}")
    # type, dtype, element count, device; the value is checked by the op (on CPU, where reading it is free)
    check_global_scale(op, input_global_scale, input.device, name="input_global_scale", check_value=False)
    k = input.shape[-1]
    m = input.numel() // k
    output = torch.empty((m, k // 2), dtype=torch.uint8, device=input.device)
    if is_sf_swizzled_layout:
        rows, cols = nvfp4.scale_shape(m, k, swizzled=True)
        output_scale = torch.empty((rows, cols // 4), dtype=torch.int32, device=input.device)
    else:
        output_scale = torch.empty((m, k // nvfp4.BLOCK_SIZE), dtype=torch.uint8, device=input.device)
    torch.ops.fusion_pass.scaled_fp4_quant.out(
        input, input_global_scale, is_sf_swizzled_layout, output=output, output_scale=output_scale
    )
    return output, output_scale.view(torch.float8_e4m3fn)


@impl("static_scaled_fp8_quant")
def _static_scaled_fp8_quant(result: Tensor, input: Tensor, scale: Tensor) -> None:
    """Per-tensor FP8 (e4m3) quant, as vLLM's ``_C::static_scaled_fp8_quant``: ``result = fp8(input / scale)``.

    Another output format: the pass refuses attention whose output feeds it.
    """
    if result.dtype != torch.float8_e4m3fn or result.shape != input.shape:
        raise ArgumentError(
            f"static_scaled_fp8_quant: result must be float8_e4m3fn of the input's shape {list(input.shape)}, "
            f"got {result.dtype} {list(result.shape)}"
        )
    q = (input.float() / scale.float()).clamp(-nvfp4.E4M3_MAX, nvfp4.E4M3_MAX)
    result.copy_(q.to(torch.float8_e4m3fn))


@fake("static_scaled_fp8_quant")
def _static_scaled_fp8_quant_fake(result, input, scale) -> None:
    return None

