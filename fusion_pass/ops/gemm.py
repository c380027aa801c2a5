"""The NVFP4 GEMM op ``nvfp4_gemm`` (the o_proj), with the contract of vLLM's ``cutlass_scaled_fp4_mm``, and a tap
recording what it reads (the demo compares the o_proj's NVFP4 input between compiled graphs); and the block-FP8
GEMM ``fp8_group_gemm`` (a DeepSeek-style o_proj reading 128-column group scales)."""

from __future__ import annotations

import contextlib
import contextvars

import torch

from fusion_pass import fp8, nvfp4
from fusion_pass.nvfp4 import ArgumentError
from fusion_pass.ops.library import fake, impl

__all__ = ["tap_gemm_inputs"]


def _check_gemm_args(a, b, block_scale_a, block_scale_b, alpha) -> None:
    for name, t in (("a", a), ("b", b)):
        if t.dtype != torch.uint8 or t.dim() != 2:
            raise ArgumentError(
                f"nvfp4_gemm: {name} must be packed NVFP4, uint8 [rows, K/2], got {t.dtype} {list(t.shape)}"
            )
    if a.shape[1] != b.shape[1]:
        raise ArgumentError(
            f"nvfp4_gemm: a [M, K/2] and b [N, K/2] must share K/2, got {list(a.shape)} and {list(b.shape)}"
        )
    k = a.shape[1] * 2
    for name, rows, scale in (("block_scale_a", a.shape[0], block_scale_a), ("block_scale_b", b.shape[0], block_scale_b)):
        exp_rows, exp_cols = nvfp4.scale_shape(rows, k, swizzled=True)
        if scale.element_size() * scale.numel() != exp_rows * exp_cols:
            raise ArgumentError(
                f"nvfp4_gemm: {name} must be the swizzled scales of a {rows}x{k} operand, "
                f"float8_e4m3fn [{exp_rows}, {exp_cols}] (or int32 [{exp_rows}, {exp_cols // 4}]), "
                f"got {scale.dtype} {list(scale.shape)}"
            )
    if alpha.dtype != torch.float32 or alpha.numel() != 1:
        raise ArgumentError(
            f"nvfp4_gemm: alpha must be a one-element float32 tensor (1 / (gs_a * gs_b)), "
            f"got {alpha.dtype} {list(alpha.shape)}"
        )


_gemm_taps: contextvars.ContextVar[tuple[list, ...]] = contextvars.ContextVar("fusion_pass_gemm_taps", default=())
"""The open taps of this thread / task, innermost last."""


@contextlib.contextmanager
def tap_gemm_inputs():
    """Record ``(a, block_scale_a)`` of every ``nvfp4_gemm`` call in the block, in call order.

    The NVFP4 activations the o_proj reads, whoever produced them (the quant op
    or a fused attention op): what the demo compares between compiled graphs.
    Only calls made by the thread / asyncio task that opened the tap are
    recorded (a :class:`contextvars.ContextVar`; compiled graphs run their ops
    on the calling thread); when taps are nested, the innermost one records.
    """
    tap: list = []
    token = _gemm_taps.set(_gemm_taps.get() + (tap,))
    try:
        yield tap
    finally:
        _gemm_taps.reset(token)


@impl("nvfp4_gemm")
def _nvfp4_gemm(a, b, block_scale_a, block_scale_b, alpha, out_dtype):
    """``out [M, N] = alpha * dequant(a) @ dequant(b).T``, as ``cutlass_scaled_fp4_mm``.

    No FP4 tensor cores are assumed: both operands are dequantized (exactly, since
    code * scale fits in bf16) and multiplied in bf16 on CUDA, float32 elsewhere.
    """
    _check_gemm_args(a, b, block_scale_a, block_scale_b, alpha)
    taps = _gemm_taps.get()
    if taps:
        taps[-1].append((a.clone(), block_scale_a.clone()))
    compute = torch.bfloat16 if a.is_cuda else torch.float32
    one = torch.ones(1, dtype=torch.float32, device=a.device)
    a_hat = nvfp4.dequantize(a, block_scale_a, one, dtype=compute)
    b_hat = nvfp4.dequantize(b, block_scale_b, one, dtype=compute)
    out = torch.matmul(a_hat, b_hat.t()).float() * alpha
    return out.to(out_dtype)


@fake("nvfp4_gemm")
def _nvfp4_gemm_fake(a, b, block_scale_a, block_scale_b, alpha, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)



def _check_fp8_group_gemm_args(a, b, a_scales, b_scales) -> None:
    op = "fp8_group_gemm"
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dtype != fp8.FP8 or t.dim() != 2:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ArgumentError(f"{op}: {name} must be float8_e4m3fn [rows, K], got {got}")
    (m, k), n = a.shape, b.shape[0]
    if b.shape[1] != k or k % fp8.GROUP_SIZE:
        raise ArgumentError(f"{op}: a [M, K] and b [N, K] must share K, a multiple of {fp8.GROUP_SIZE}, got "
                            f"{list(a.shape)} and {list(b.shape)}")
    groups = k // fp8.GROUP_SIZE
    for name, t, want in (("a_scales", a_scales, [m, groups]),
                          ("b_scales", b_scales, [-(-n // fp8.GROUP_SIZE), groups])):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or list(t.shape) != want:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ArgumentError(f"{op}: {name} must be float32 {want} (any strides), got {got}")


@impl("fp8_group_gemm")
def _fp8_group_gemm(a, b, a_scales, b_scales, out_dtype):
    """``out [M, N] = dequant(a) @ dequant(b).T``: ``a`` float8_e4m3fn ``[M, K]`` with one float32 scale per row and
    128 columns (``a_scales [M, K/128]``, any of the three group-scale layouts: the values are read, not the
    strides), ``b`` float8_e4m3fn ``[N, K]`` with one scale per 128x128 block (``b_scales [ceil(N/128), K/128]``):
    a block-FP8 linear's GEMM (DeepSeek-style checkpoints), computed in float32."""
    _check_fp8_group_gemm_args(a, b, a_scales, b_scales)
    a_hat = fp8.dequantize_group(a, a_scales.contiguous())
    rows = b_scales.repeat_interleave(fp8.GROUP_SIZE, 0)[: b.shape[0]]
    b_hat = b.float() * rows.repeat_interleave(fp8.GROUP_SIZE, 1)
    return torch.matmul(a_hat, b_hat.t()).to(out_dtype)


@fake("fp8_group_gemm")
def _fp8_group_gemm_fake(a, b, a_scales, b_scales, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
