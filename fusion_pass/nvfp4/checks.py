"""Argument checks of the format's functions, shared by every producer of NVFP4 bytes.

Every check raises :class:`ArgumentError` (a ``ValueError`` and a ``TypeError``), naming the function and
the argument, before anything is written: one mistake gets one exception type wherever it is made.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch._subclasses.fake_tensor import is_fake

from fusion_pass.nvfp4.layout import BLOCK_SIZE, FP8, GLOBAL_SCALE_MAX, X_DTYPES, scale_shape


class ArgumentError(ValueError, TypeError):
    """A bad argument: wrong type, dtype, shape, layout, device or value. Both a ``ValueError`` and a
    ``TypeError``, so that code catching either keeps working wherever the check moves."""


def is_concrete(t: torch.Tensor) -> bool:
    """True when ``t`` holds real data that ``.item()`` can read."""
    # is_compiling() first: dynamo refuses to trace into is_fake.
    if torch.compiler.is_compiling():
        return False
    return not (is_fake(t) or t.device.type == "meta")


def check_global_scale(fn: str, global_scale, device: torch.device, *, name: str = "global_scale",
                       check_value: bool = True) -> None:
    """``global_scale`` (called ``name`` by ``fn``) is a float32 tensor of one element on ``device`` and, when
    ``check_value`` and the tensor holds readable data, its value is positive, finite and at most
    :data:`~fusion_pass.nvfp4.layout.GLOBAL_SCALE_MAX` (above it ``gs / sf`` overflows for the smallest block
    scales). Reading the value of a CUDA tensor synchronizes the device: callers on a hot path pass
    ``check_value=False`` there."""
    what = name if name == "global_scale" else f"{name} (the global scale)"
    if not isinstance(global_scale, torch.Tensor):
        raise ArgumentError(f"{fn}: {what} must be a one-element float32 tensor, got {type(global_scale).__name__} "
                            f"{global_scale!r}")
    got = f"{global_scale.dtype} {list(global_scale.shape)}"
    if global_scale.dtype != torch.float32:
        raise ArgumentError(f"{fn}: {what} must be a one-element float32 tensor, got {got}")
    if global_scale.numel() != 1:
        raise ArgumentError(f"{fn}: {what} must be a one-element float32 tensor (it has {global_scale.numel()} "
                            f"elements), got {got}")
    if global_scale.device != device:
        raise ArgumentError(f"{fn}: {what} must be on the same device as the data, {device} (got {global_scale.device})")
    if check_value and is_concrete(global_scale):
        value = global_scale.item()
        if not (math.isfinite(value) and value > 0):
            raise ArgumentError(f"{fn}: {what} must be positive and finite, got {value}")
        if value > GLOBAL_SCALE_MAX:
            raise ArgumentError(
                f"{fn}: {what} must be at most {GLOBAL_SCALE_MAX!r} (float32 max * 2**-9, the largest global "
                f"scale for which gs / sf is finite for every nonzero e4m3 block scale), got {value!r}")


def check_x(fn: str, x: torch.Tensor, global_scale: torch.Tensor, *, check_value: bool = True) -> None:
    """``x`` float16 / bfloat16 / float32 ``[..., K]`` with ``K % 16 == 0``, and its global scale."""
    check_tensor(fn, "x", x)
    if x.dtype not in X_DTYPES:
        raise ArgumentError(f"{fn}: x must be float16, bfloat16 or float32 (got {x.dtype})")
    if x.dim() == 0:
        raise ArgumentError(f"{fn}: x must have at least one dimension (got a 0-d tensor)")
    if x.shape[-1] % BLOCK_SIZE != 0:
        raise ArgumentError(
            f"{fn}: x must have a last dimension divisible by {BLOCK_SIZE} "
            f"(got shape {list(x.shape)})"
        )
    check_global_scale(fn, global_scale, x.device, check_value=check_value)


def is_int(v) -> bool:
    """An integer (numpy integers included), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_int(where: str, value, *, minimum: int | None = None, expected: str | None = None) -> int:
    """``value`` as a Python int when it is an integer (numpy integers included, a bool refused) of at least
    ``minimum``; else :class:`ArgumentError` ``"{where} must be {expected}, got {type} {value!r}"`` (``where``
    names the function and the argument; ``expected`` defaults to ``an int`` / ``>= minimum``). The integer check
    of the public API: numpy integers work wherever ints do (docs/usage.md, "Argument checks")."""
    if is_int(value) and (minimum is None or value >= minimum):
        return int(value)
    if expected is None:
        expected = f">= {minimum}" if is_int(value) else "an int"
    raise ArgumentError(f"{where} must be {expected}, got {type(value).__name__} {value!r}")


def check_tensor(fn: str, name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise ArgumentError(f"{fn}: {name} must be a tensor (got {type(t).__name__})")


def check_swizzled_buffer(fn: str, scales, rows: int, k: int) -> None:
    """``scales`` is the 128x4 swizzled scale buffer of a ``[rows, k]`` matrix, in one of
    the forms ``scaled_fp4_quant.out`` accepts, and can be viewed as contiguous bytes."""
    check_tensor(fn, "scales", scales)
    r, cols = scale_shape(rows, k, swizzled=True)
    forms = {torch.int32: (r, cols // 4), torch.uint8: (r, cols), FP8: (r, cols)}
    if forms.get(scales.dtype) != tuple(scales.shape):
        raise ArgumentError(
            f"{fn}: scales must be the swizzled scale buffer of T={rows} rows, K={k}: int32 "
            f"[{r}, {cols // 4}] (vLLM's allocation) or uint8 / float8_e4m3fn [{r}, {cols}] "
            f"(round_up(T, 128) x round_up(K/16, 4)) (got {scales.dtype} {list(scales.shape)})"
        )
    if not (scales.is_contiguous() and scales.stride(-1) == 1):
        raise ArgumentError(f"{fn}: scales must be contiguous (got strides {list(scales.stride())})")


def check_rows_into(fn: str, x, global_scale, packed, scales, row_start, *, check_value: bool = True) -> None:
    """Every argument of :func:`quantize_rows_into`; raises before anything is written. ``check_value=False``
    leaves the global scale's value to the caller (its type, dtype, shape and device are checked)."""
    for name, t in (("x", x), ("packed", packed)):
        check_tensor(fn, name, t)
    if x.dim() != 2:
        raise ArgumentError(f"{fn}: x must be a 2-D tensor [M, K] (got shape {list(x.shape)})")
    check_x(fn, x, global_scale, check_value=check_value)
    m, k = x.shape
    check_row_range(fn, packed, scales, row_start, m, k, x.device)


def check_row_range(
    fn: str, packed, scales, row_start, m: int, k: int, device: torch.device, *, source: str = "x", width: str = "K"
) -> None:
    """``packed`` / ``scales`` are a ``T``-row NVFP4 buffer pair of ``k``-wide rows on ``device``
    and rows ``[row_start, row_start + m)`` lie in it. The messages name the source tensor
    (``source``, e.g. ``x``) and its row width (``width``, e.g. ``K``)."""
    check_tensor(fn, "packed", packed)
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != k // 2:
        raise ArgumentError(
            f"{fn}: packed must be a uint8 tensor [T, {width}/2] = [T, {k // 2}] for {source}'s {width}={k} "
            f"(got {packed.dtype} {list(packed.shape)})"
        )
    if not packed.is_contiguous():
        raise ArgumentError(f"{fn}: packed must be contiguous (got strides {list(packed.stride())})")
    if packed.device != device:
        raise ArgumentError(f"{fn}: packed must be on {source}'s device {device} (got {packed.device})")
    t = packed.shape[0]
    check_swizzled_buffer(fn, scales, t, k)
    if scales.device != device:
        raise ArgumentError(f"{fn}: scales must be on {source}'s device {device} (got {scales.device})")
    if not is_int(row_start):
        raise ArgumentError(f"{fn}: row_start must be an int (got {type(row_start).__name__} {row_start!r})")
    if row_start < 0:
        raise ArgumentError(f"{fn}: row_start must be >= 0 (got {row_start})")
    if row_start + m > t:
        raise ArgumentError(
            f"{fn}: row_start + M = {row_start} + {m} = {row_start + m} exceeds T = {t}, "
            "the rows of packed"
        )

