"""The quant ops: NVFP4's ``scaled_fp4_quant.out`` (and its allocating wrapper :func:`scaled_fp4_quant`), and FP8's
``static_scaled_fp8_quant`` (per tensor) and ``per_token_group_fp8_quant`` (128-column groups), with vLLM's
schemas and bytes (docs/formats.md); the pass refuses attention feeding the FP8 ones (not fused yet)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fusion_pass import fp8, nvfp4
from fusion_pass.fp8.checks import check_group_x, check_scale
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
def _static_scaled_fp8_quant(result: Tensor, input: Tensor, scale: Tensor, group_shape=None) -> None:
    """Per-tensor FP8 (e4m3), vLLM's ``_C::static_scaled_fp8_quant`` bytes: ``result = fp8(clamp(input * (1 /
    scale), -448, 448))``, a NaN +448 (docs/formats.md). ``group_shape``: None or ``[-1, -1]`` (per tensor)."""
    op = "static_scaled_fp8_quant"
    if group_shape is not None and list(group_shape) != [-1, -1]:
        raise ArgumentError(f"{op}: group_shape must be None or [-1, -1] (per tensor), got {list(group_shape)}")
    if result.dtype != torch.float8_e4m3fn or result.shape != input.shape:
        raise ArgumentError(
            f"{op}: result must be float8_e4m3fn of the input's shape {list(input.shape)}, "
            f"got {result.dtype} {list(result.shape)}"
        )
    check_scale(op, scale, input.device)
    result.copy_(fp8.quantize_static(input, fp8.reciprocal(scale)))


@fake("static_scaled_fp8_quant")
def _static_scaled_fp8_quant_fake(result, input, scale, group_shape=None) -> None:
    return None


@impl("per_token_group_fp8_quant")
def _per_token_group_fp8_quant(input: Tensor, output_q: Tensor, output_s: Tensor, group_size: int, eps: float,
                               fp8_min: float, fp8_max: float, scale_ue8m0: bool, dummy_is_scale_transposed: bool,
                               dummy_is_tma_aligned: bool) -> None:
    """Dynamic per-token-group FP8, vLLM 0.33/0.34's ``_C::per_token_group_fp8_quant`` bytes: ``output_q`` the
    e4m3 codes of ``input [M, N]``, ``output_s`` float32 ``[M, N / group_size]`` in any of vLLM's layouts (its
    strides say which; the two ``dummy`` flags are ignored, as vLLM's kernel ignores them). ``fp8_min`` /
    ``fp8_max`` must be -448 / 448."""
    op = "per_token_group_fp8_quant"
    if (fp8_min, fp8_max) != (-fp8.E4M3_MAX, fp8.E4M3_MAX):
        raise ArgumentError(f"{op}: fp8_min / fp8_max must be -448 / 448 (e4m3), got {fp8_min} / {fp8_max}")
    check_group_x(op, input, group_size)
    if input.dim() != 2:
        raise ArgumentError(f"{op}: input must be 2-D [M, N], got shape {list(input.shape)}")
    if output_q.dtype != torch.float8_e4m3fn or output_q.shape != input.shape:
        raise ArgumentError(f"{op}: output_q must be float8_e4m3fn of the input's shape {list(input.shape)}, "
                            f"got {output_q.dtype} {list(output_q.shape)}")
    want = [input.shape[0], input.shape[1] // group_size]
    if output_s.dtype != torch.float32 or list(output_s.shape) != want:
        raise ArgumentError(f"{op}: output_s must be float32 {want}, got {output_s.dtype} {list(output_s.shape)}")
    q, scales = fp8.quantize_group(input, group_size=group_size, ue8m0=scale_ue8m0, eps=eps)
    output_q.copy_(q)
    output_s.copy_(scales)


@fake("per_token_group_fp8_quant")
def _per_token_group_fp8_quant_fake(input, output_q, output_s, group_size, eps, fp8_min, fp8_max, scale_ue8m0,
                                    dummy_is_scale_transposed, dummy_is_tma_aligned) -> None:
    return None
