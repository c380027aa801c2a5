"""Argument checks of the kernels' entry points, and the padding fill both NVFP4 attention launchers do
before their kernel runs.

Shape, dtype and device checks do no device work. The values of device tensors (``cu_seqlens``,
``cu_seqlens_k``, the global scale) are checked as the entry point's ``validate_values`` says
(:data:`VALIDATE_VALUES`): ``True`` reads them back (one small copy each, a synchronization on CUDA) and names
them in the error; ``"device"`` computes the check on the tensors' device and asserts it there
(:func:`torch._assert_async`: at once on the CPU, at the next synchronization on CUDA), reading nothing back;
``False`` checks no value. Errors are :class:`fusion_pass.nvfp4.ArgumentError` (a ValueError and a TypeError)
naming the argument."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fusion_pass import fp8, nvfp4
from fusion_pass.fp8.checks import check_scale
from fusion_pass.kernels.host_copy import to_device
from fusion_pass.nvfp4.checks import (
    ArgumentError,
    check_global_scale,
    check_int,
    check_row_range,
    check_tensor,
    is_concrete,
)
from fusion_pass.nvfp4.layout import GLOBAL_SCALE_MAX

HALF_DTYPES = (torch.float16, torch.bfloat16)

VALIDATE_VALUES = (True, "device", False)
"""What ``validate_values=`` of the entry points takes: ``True`` (read the values back: a synchronization on
CUDA, an error naming them), ``"device"`` (the default: checked on the device, nothing read back), ``False``
(values not checked)."""

_INT32_MAX = 2**31 - 1
_DEVICE_NOTE = "(checked on the device, not read back; validate_values=True names the offending values)"


def describe(t) -> str:
    return f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, Tensor) else repr(t)


def check_qkv(fn: str, q, k, v, *, separate_kv: bool = False) -> None:
    """``q [T, H, Dqk]``, ``k [Tk, Hkv, Dqk]``, ``v [Tk, Hkv, Dv]``: one half dtype, one device,
    unit stride along the head dim, ``H % Hkv == 0``. ``Tk == T`` unless ``separate_kv`` (keys
    delimited by their own ``cu_seqlens_k``)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            layout = {"q": "[T, H, Dqk]", "k": "[Tk, Hkv, Dqk]", "v": "[Tk, Hkv, Dv]"}[name]
            raise ArgumentError(f"{fn}: {name} must be a 3-D tensor {layout}, got {describe(t)}")
        if t.dtype not in HALF_DTYPES:
            raise ArgumentError(f"{fn}: {name} must be float16 or bfloat16, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ArgumentError(f"{fn}: {name} must have unit stride along its last (head) dim, got strides {t.stride()}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ArgumentError(f"{fn}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ArgumentError(f"{fn}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    t, h, dqk = q.shape
    if separate_kv:
        if v.shape[0] != k.shape[0]:
            raise ArgumentError(
                f"{fn}: k and v must have the same number of tokens Tk, got k {list(k.shape)}, v {list(v.shape)}"
            )
    elif k.shape[0] != t or v.shape[0] != t:
        raise ArgumentError(
            f"{fn}: q, k, v must have the same number of tokens T (or pass cu_seqlens_k), got q {list(q.shape)}, "
            f"k {list(k.shape)}, v {list(v.shape)}"
        )
    if k.shape[2] != dqk:
        raise ArgumentError(f"{fn}: k must be [T, Hkv, Dqk] with q's Dqk={dqk}, got {list(k.shape)}")
    hkv = k.shape[1]
    if v.shape[1] != hkv:
        raise ArgumentError(f"{fn}: v must be [T, Hkv, Dv] with k's Hkv={hkv}, got {list(v.shape)}")
    if hkv == 0 or h % hkv != 0:
        raise ArgumentError(f"{fn}: q's heads H={h} must be a multiple of k/v's heads Hkv={hkv}")


def check_cu_seqlens_k(fn: str, cu_seqlens_k, cu_seqlens: Tensor, device: torch.device) -> None:
    """``cu_seqlens_k`` is a contiguous 1-D int32 tensor on ``device`` with as many entries as
    ``cu_seqlens`` (checked first). Shapes only: its values are not read."""
    if not isinstance(cu_seqlens_k, Tensor) or cu_seqlens_k.dtype != torch.int32 or cu_seqlens_k.dim() != 1:
        raise ArgumentError(f"{fn}: cu_seqlens_k must be a 1-D int32 tensor [B + 1], got {describe(cu_seqlens_k)}")
    if cu_seqlens_k.numel() != cu_seqlens.numel():
        raise ArgumentError(
            f"{fn}: cu_seqlens_k must have B + 1 = {cu_seqlens.numel()} entries like cu_seqlens, "
            f"got {cu_seqlens_k.numel()}"
        )
    if cu_seqlens_k.device != device:
        raise ArgumentError(f"{fn}: cu_seqlens_k must be on q's device {device}, got {cu_seqlens_k.device}")
    if not cu_seqlens_k.is_contiguous():
        raise ArgumentError(f"{fn}: cu_seqlens_k must be contiguous, got strides {cu_seqlens_k.stride()}")


def check_max_seqlen_k(fn: str, max_seqlen_k, cu_seqlens_k) -> None:
    """``max_seqlen_k``: ``None`` or a non-negative int, and only together with ``cu_seqlens_k``."""
    if max_seqlen_k is None:
        return
    if cu_seqlens_k is None:
        raise ArgumentError(f"{fn}: max_seqlen_k={max_seqlen_k!r} is given without cu_seqlens_k")
    check_int(f"{fn}: max_seqlen_k", max_seqlen_k, minimum=0, expected="None or a non-negative int")


def zero_nvfp4_scale_padding(scale_bytes: Tensor, t: int, width: int) -> None:
    """Zero the padding entries of the swizzled scale buffer of a ``[t, width]`` NVFP4 matrix.

    ``scale_bytes``: the contiguous buffer as flat uint8, ``round_up(t, 128) *
    round_up(width/16, 4)`` bytes. Padding entries are those of rows ``t ..
    round_up(t, 128) - 1`` (every column) and of columns ``width/16 .. round_up(width/16,
    4) - 1`` (every row); no other byte is touched, so rows a kernel does not own keep
    their bytes. Strided slice fills only: no index tensors, no sync.
    """
    blocks = width // nvfp4.BLOCK_SIZE
    col_tiles = -(-blocks // 4)
    if t == 0 or col_tiles == 0:
        return
    nvfp4.zero_scale_padding(scale_bytes.view(-1, col_tiles * 4), t, width)
    if blocks % 4:
        # tiles as [row tile, column tile, row % 32, (row % 128) // 32, column % 4]
        scale_bytes.view(-1, col_tiles, 32, 4, 4)[:, -1, :, :, blocks % 4 :].zero_()


def check_validate_values(fn: str, validate_values) -> None:
    """``validate_values`` is one of :data:`VALIDATE_VALUES`."""
    if not (validate_values is True or validate_values is False or validate_values == "device"):
        raise ArgumentError(f"{fn}: validate_values must be True, \"device\" or False, got {validate_values!r}")


def _short(message: str, limit: int = 254) -> str:
    return message if len(message) <= limit else message[: limit - 3] + "..."


def assert_on_device(ok: Tensor, message: str) -> None:
    """Assert the one-element bool tensor ``ok`` where it lives, reading nothing back: on the CPU at once (an
    :class:`ArgumentError` with ``message``), on CUDA when the stream next synchronizes (a device-side
    assertion, which CUDA makes fatal to the process's CUDA context)."""
    if ok.device.type != "cpu":
        torch._assert_async(ok, _short(message))  # CUDA's device-side assertion takes < 255 characters
        return
    try:
        torch._assert_async(ok, message)
    except RuntimeError:
        raise ArgumentError(message) from None


def _within(values: Tensor, lower: list[int], upper: list[int]) -> Tensor:
    """One-element bool tensor: every element of int32 ``values`` lies in ``[lower[i], upper[i]]`` (no read)."""
    bounds = to_device([lower, upper], torch.int32, values.device)
    return values.clamp(bounds[0], bounds[1]).eq(values).all()


def _offsets_bounds(total: int, n: int, max_len: int | None) -> tuple[list[int], list[int]]:
    """Bounds of ``offsets [n]`` followed by their ``n - 1`` steps: ``0 = o[0] <= o[i] <= o[n-1] = total``, steps
    in ``[0, max_len]``."""
    top = _INT32_MAX if max_len is None else min(max_len, _INT32_MAX)
    lower = [0] * (n - 1) + [total] + [0] * (n - 1)
    upper = [0] + [total] * (n - 1) + [top] * (n - 1)
    return lower, upper


def _lengths(fn: str, name: str, offsets: Tensor, what: str, total: int) -> list[int]:
    """The sequence lengths of ``offsets`` (read back: one small copy), which must rise from 0 to ``total``."""
    starts = offsets.tolist()
    lengths = [b - a for a, b in zip(starts[:-1], starts[1:])]
    if starts[0] != 0 or starts[-1] != total or min(lengths) < 0:
        raise ArgumentError(f"{fn}: {name} must rise from 0 to {what} without decreasing, got {starts[:8]}"
                            + (" ..." if len(starts) > 8 else ""))
    return lengths


def check_varlen(fn: str, q: Tensor, cu_seqlens, max_seqlen, validate_values=True) -> list[int] | None:
    """``cu_seqlens`` (a 1-D int32 ``[B + 1]`` on q's device) and ``max_seqlen`` (an int). Its values as
    ``validate_values`` says (module docstring): with ``True`` one small device-to-host copy, and the sequence
    lengths are returned; otherwise None."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ArgumentError(f"{fn}: cu_seqlens must be a 1-D int32 tensor [B + 1], got {describe(cu_seqlens)}")
    if cu_seqlens.numel() < 2:
        raise ArgumentError(f"{fn}: cu_seqlens must have B + 1 >= 2 entries, got {cu_seqlens.numel()}")
    if cu_seqlens.device != q.device:
        raise ArgumentError(f"{fn}: cu_seqlens must be on q's device {q.device}, got {cu_seqlens.device}")
    check_int(f"{fn}: max_seqlen", max_seqlen, minimum=0, expected="a non-negative int")
    t = q.shape[0]
    if validate_values is True:
        lengths = _lengths(fn, "cu_seqlens", cu_seqlens, f"T={t}", t)
        if max(lengths) > max_seqlen:
            raise ArgumentError(
                f"{fn}: max_seqlen={max_seqlen} is smaller than the longest sequence ({max(lengths)})")
        return lengths
    return None


def assert_varlen_on_device(fn: str, q: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> None:
    """:func:`check_varlen`'s value checks on ``cu_seqlens``'s device (``validate_values="device"``; its shape
    checked already): rises from 0 to ``T`` without decreasing, no step above ``max_seqlen``. A few small
    kernels and one pinned host-to-device copy; nothing read back."""
    if not is_concrete(cu_seqlens):
        return
    t = q.shape[0]
    ok = _within(torch.cat((cu_seqlens, cu_seqlens.diff())), *_offsets_bounds(t, cu_seqlens.numel(), max_seqlen))
    assert_on_device(ok, f"{fn}: cu_seqlens must rise from 0 to T={t} without decreasing, no sequence longer "
                         f"than max_seqlen={max_seqlen} {_DEVICE_NOTE}")


def check_varlen_k(fn: str, q: Tensor, k: Tensor, cu_seqlens, cu_seqlens_k, max_seqlen_k, causal,
                   lengths_q: list[int] | None, validate_values=True) -> int | None:
    """``cu_seqlens_k``'s shape, and its values as ``validate_values`` says: rises from 0 to ``Tk``, covered by
    ``max_seqlen_k``, and with ``causal`` no sequence has fewer keys than queries. Returns ``max_seqlen_k``:
    with ``True`` (one more small copy; ``lengths_q`` the query lengths :func:`check_varlen` returned) the
    longest key sequence when ``None`` was given; otherwise as given (``None``: the kernels bound the key
    lengths by ``Tk``)."""
    check_max_seqlen_k(fn, max_seqlen_k, cu_seqlens_k)
    if cu_seqlens_k is None:
        return None
    max_seqlen_k = None if max_seqlen_k is None else int(max_seqlen_k)  # a numpy integer as an int
    check_cu_seqlens_k(fn, cu_seqlens_k, cu_seqlens, q.device)
    tk = k.shape[0]
    if validate_values is True:
        lengths = _lengths(fn, "cu_seqlens_k", cu_seqlens_k, f"Tk={tk} (k's tokens)", tk)
        if max_seqlen_k is not None and max(lengths) > max_seqlen_k:
            raise ArgumentError(
                f"{fn}: max_seqlen_k={max_seqlen_k} is smaller than the longest key sequence ({max(lengths)})")
        if causal:
            for b, (lq, lk) in enumerate(zip(lengths_q, lengths)):
                if lk < lq:
                    raise ArgumentError(
                        f"{fn}: cu_seqlens_k gives sequence {b} {lk} keys for its {lq} queries; causal attention "
                        f"aligns the queries to the end of the keys and needs Lk >= Lq"
                    )
        return max(lengths) if max_seqlen_k is None else max_seqlen_k
    return max_seqlen_k


def assert_varlen_k_on_device(fn: str, k: Tensor, cu_seqlens: Tensor, cu_seqlens_k: Tensor | None,
                              max_seqlen_k: int | None, causal: bool) -> None:
    """:func:`check_varlen_k`'s value checks on the device (``validate_values="device"``; shapes checked
    already): ``cu_seqlens_k`` rises from 0 to ``Tk``, no step above ``max_seqlen_k``, and with ``causal`` no
    sequence has fewer keys than queries. Nothing read back."""
    if cu_seqlens_k is None or not is_concrete(cu_seqlens_k):
        return
    tk = k.shape[0]
    n = cu_seqlens_k.numel()
    steps = cu_seqlens_k.diff()
    lower, upper = _offsets_bounds(tk, n, max_seqlen_k)
    parts = [cu_seqlens_k, steps]
    if causal:  # Lk - Lq >= 0 per sequence
        parts.append(steps - cu_seqlens.diff())
        lower, upper = lower + [0] * (n - 1), upper + [_INT32_MAX] * (n - 1)
    bound = "" if max_seqlen_k is None else f", no key sequence longer than max_seqlen_k={max_seqlen_k}"
    assert_on_device(_within(torch.cat(parts), lower, upper),
                     f"{fn}: cu_seqlens_k must rise from 0 to Tk={tk} (k's tokens) without decreasing{bound}"
                     + ("; causal attention needs Lk >= Lq for every sequence" if causal else "")
                     + f" {_DEVICE_NOTE}")


def check_scale_value(fn: str, global_scale: Tensor, validate_values) -> None:
    """The global scale's value (its type, dtype, shape and device checked already) as ``validate_values``
    says: read back (``True``), asserted on its device (``"device"``) or not checked (``False``)."""
    if validate_values is True:
        check_global_scale(fn, global_scale, global_scale.device)
    elif validate_values == "device" and is_concrete(global_scale):
        # NaN fails the comparison, +-inf and 0 are clamped away from themselves
        ok = global_scale.clamp(min=torch.finfo(torch.float32).smallest_normal * 2**-23, max=GLOBAL_SCALE_MAX)
        assert_on_device(ok.eq(global_scale).reshape(()),
                         f"{fn}: global_scale must be positive and finite and at most {GLOBAL_SCALE_MAX!r} "
                         f"{_DEVICE_NOTE}")


def check_softmax_scale(fn: str, softmax_scale) -> None:
    if softmax_scale is not None and (
        isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, (int, float))
        or not math.isfinite(softmax_scale)
        or softmax_scale <= 0
    ):
        raise ArgumentError(f"{fn}: softmax_scale must be None or a positive finite float, got {softmax_scale!r}")


def check_causal(fn: str, causal) -> None:
    if not isinstance(causal, bool):
        raise ArgumentError(f"{fn}: causal must be a bool, got {causal!r}")


MERGE_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_outs(fn: str, out_a, out_b) -> None:
    for name, out in (("out_a", out_a), ("out_b", out_b)):
        check_tensor(fn, name, out)
        if out.dim() != 3:
            raise ArgumentError(f"{fn}: {name} must be a 3-D tensor [M, H, Dv], got {describe(out)}")
        if out.dtype not in MERGE_OUT_DTYPES:
            raise ArgumentError(f"{fn}: {name} must be float32, bfloat16 or float16, got {out.dtype}")
        if out.shape[2] > 1 and out.stride(2) != 1:
            raise ArgumentError(f"{fn}: {name} must have unit stride along Dv, got strides {list(out.stride())}")
    if out_b.shape != out_a.shape:
        raise ArgumentError(
            f"{fn}: out_b must have out_a's shape [M, H, Dv] = {list(out_a.shape)}, got {list(out_b.shape)}"
        )
    if out_b.device != out_a.device:
        raise ArgumentError(f"{fn}: out_b must be on out_a's device {out_a.device}, got {out_b.device}")
    m, h, dv = out_a.shape
    if (h * dv) % nvfp4.BLOCK_SIZE != 0:
        raise ArgumentError(f"{fn}: H * Dv must be divisible by 16, got out_a [M, H, Dv] = {list(out_a.shape)}")


def check_lses(fn: str, lse_a, lse_b, out_a: Tensor) -> None:
    m, h, _ = out_a.shape
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        check_tensor(fn, name, lse)
        if lse.dtype != torch.float32:
            raise ArgumentError(f"{fn}: {name} must be float32, got {lse.dtype}")
        if tuple(lse.shape) != (m, h):
            raise ArgumentError(
                f"{fn}: {name} must be [M, H] = [{m}, {h}] (any strides: a transposed [H, M] "
                f"view is fine), got {list(lse.shape)}"
            )
        if lse.device != out_a.device:
            raise ArgumentError(f"{fn}: {name} must be on out_a's device {out_a.device}, got {lse.device}")


def check_destination(fn: str, packed, scales, row_start, out_a: Tensor) -> None:
    m, h, dv = out_a.shape
    check_row_range(fn, packed, scales, row_start, m, h * dv, out_a.device, source="out_a", width="H*Dv")


# ---------------------------------------------------------------------------
# FP8 output (docs/formats.md): the attention entry points' output arguments
# ---------------------------------------------------------------------------

STATIC_NAN_RULES = (fp8.NaNRule.POSITIVE_MAX, fp8.NaNRule.NAN)


def check_bool(fn: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise ArgumentError(f"{fn}: {name} must be a bool, got {value!r}")


def check_static_nan(fn: str, nan) -> fp8.NaNRule:
    """``nan``: ``"positive_max"`` (vLLM's CUDA op: NaN -> +448) or ``"nan"`` (the native form: NaN stays NaN), or
    the :class:`fusion_pass.fp8.NaNRule` of that value; returns the rule."""
    rule = next((r for r in STATIC_NAN_RULES if nan is r or (isinstance(nan, str) and nan == r.value)), None)
    if rule is None:
        raise ArgumentError(f"{fn}: nan must be \"positive_max\" or \"nan\" (or fusion_pass.fp8.NaNRule.POSITIVE_MAX "
                            f"/ NAN), got {nan!r}")
    return rule


def check_fp8_output(fn: str, output, t: int, width: int, device: torch.device) -> None:
    """``output``: None or a float8_e4m3fn ``[T, H*Dv]`` tensor on ``device``, unit stride along its columns, rows
    not overlapping."""
    if output is None:
        return
    check_tensor(fn, "output", output)
    if output.dtype != fp8.FP8 or tuple(output.shape) != (t, width):
        raise ArgumentError(f"{fn}: output must be float8_e4m3fn [T, H*Dv] = [{t}, {width}], got {describe(output)}")
    if output.device != device:
        raise ArgumentError(f"{fn}: output must be on q's device {device}, got {output.device}")
    if (width > 1 and output.stride(1) != 1) or (t > 1 and output.stride(0) < width):
        raise ArgumentError(f"{fn}: output must have unit stride along its columns and rows at least H*Dv={width} "
                            f"apart, got strides {output.stride()}")


def check_fp8_static(fn: str, q: Tensor, v: Tensor, scale, scale_is_inverse, output) -> None:
    """The static FP8 call's own arguments: ``scale`` a one-element float32 tensor on q's device (its value not
    read: a scale of 0 has the format's meaning, docs/formats.md), ``scale_is_inverse`` a bool, ``output``."""
    check_scale(fn, scale, q.device, name="scale")
    check_bool(fn, "scale_is_inverse", scale_is_inverse)
    check_fp8_output(fn, output, q.shape[0], q.shape[1] * v.shape[2], q.device)


def check_fp8_group(fn: str, q: Tensor, v: Tensor, ue8m0, divide, output, scales) -> None:
    """The group FP8 call's own arguments: ``H*Dv`` divisible by 128 (whole groups; the fused kernel needs
    ``Dv % 128 == 0``, :func:`fusion_pass.kernels.choice.choose_fp8`), ``ue8m0`` / ``divide`` bools, ``output``,
    ``scales`` None or float32 ``[T, H*Dv/128]`` on q's device in one of the :class:`fusion_pass.fp8.ScaleLayout`
    (row-major, column-major, TMA-aligned column-major)."""
    t, h, dv = q.shape[0], q.shape[1], v.shape[2]
    if (h * dv) % fp8.GROUP_SIZE:
        raise ArgumentError(f"{fn}: H * Dv must be divisible by {fp8.GROUP_SIZE} (whole 128-column groups), got "
                            f"{h} * {dv} = {h * dv}")
    check_bool(fn, "ue8m0", ue8m0)
    check_bool(fn, "divide", divide)
    check_fp8_output(fn, output, t, h * dv, q.device)
    if scales is None:
        return
    check_tensor(fn, "scales", scales)
    want = list(fp8.group_scale_shape(t, h * dv))
    if scales.dtype != torch.float32 or list(scales.shape) != want:
        raise ArgumentError(f"{fn}: scales must be float32 [T, H*Dv/128] = {want}, got {describe(scales)}")
    if scales.device != q.device:
        raise ArgumentError(f"{fn}: scales must be on q's device {q.device}, got {scales.device}")
    if not fp8.writable_scales(scales):
        layouts = ", ".join(f"{layout.value} {layout.strides(*want)}" for layout in fp8.ScaleLayout)
        raise ArgumentError(f"{fn}: scales must be in one of the layouts (strides) {layouts} (or the first rows of a "
                            f"column-major one), got strides {scales.stride()}")
