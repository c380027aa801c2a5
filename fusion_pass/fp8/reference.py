"""The reference FP8 quantizers: plain PyTorch, any device, the bytes vLLM's kernels write (docs/formats.md).

Static per-tensor (vLLM's ``_C::static_scaled_fp8_quant`` and the ``QuantFP8`` native form Inductor compiles)::

    q = fp8(clamp(x * inv_scale, -448, 448))

with ``inv_scale = 1 / scale`` rounded once to float32 (the CUDA kernel divides in the kernel, IEEE; the native
form's ``reciprocal`` node is the graph's own, whatever Inductor compiles it to: the fused call is handed that
node's value). Dynamic per-token groups (``_C::per_token_group_fp8_quant``, 128 columns a group)::

    s = max(1e-10, max |x_g|) / 448            (IEEE float32 division; NaN elements do not count)
    s = 2 ** ceil(log2(s))                      (UE8M0 scales only)
    q = fp8(clamp(x / s, -448, 448))            (vLLM 0.32; 0.33 and 0.34: x * (1 / s))

``fp8`` rounds to nearest, ties to even (the hardware ``cvt`` with ``satfinite`` and c10's constructor agree on
values within ``[-448, 448]``). A NaN is where the writers differ (:class:`NaNRule`).
"""

from __future__ import annotations

import enum

import torch

from fusion_pass.fp8.checks import check_group_x, check_scale, check_scales_for, check_x
from fusion_pass.fp8.layout import E4M3_MAX, FP8, GROUP_SIZE, SCALE_EPS


class NaNRule(enum.Enum):
    """What a NaN quotient becomes: the clamp's argument order decides it in CUDA (``fminf`` / ``fmaxf`` return
    the other operand of a NaN), torch's ``clamp`` keeps it.

    * ``POSITIVE_MAX``: +448 (byte ``0x7E``): ``static_scaled_fp8_quant``'s ``fmaxf(-448, fminf(q, 448))``;
    * ``NEGATIVE_MAX``: -448 (byte ``0xFE``): ``per_token_group_fp8_quant``'s ``fminf(fmaxf(q, -448), 448)``;
    * ``NAN``: NaN (byte ``0x7F``): the native form's ``clamp`` then ``.to(float8_e4m3fn)`` on the GPU, whose
      arithmetic returns the canonical (positive) NaN whatever the operands' NaN sign.
    """

    POSITIVE_MAX = "positive_max"
    NEGATIVE_MAX = "negative_max"
    NAN = "nan"


def _clamp(q: torch.Tensor, nan: NaNRule) -> torch.Tensor:
    q = q.clamp(-E4M3_MAX, E4M3_MAX)
    value = {NaNRule.POSITIVE_MAX: E4M3_MAX, NaNRule.NEGATIVE_MAX: -E4M3_MAX, NaNRule.NAN: float("nan")}[nan]
    return torch.where(q.isnan(), q.new_tensor(value), q)  # a positive NaN: the GPU's canonical one


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` in float32, correctly rounded (the CUDA kernel's in-kernel IEEE division; 0 gives +Inf)."""
    return torch.ones_like(scale, dtype=torch.float32) / scale.float()


def quantize_static(x: torch.Tensor, inv_scale: torch.Tensor, *, nan: NaNRule = NaNRule.POSITIVE_MAX) -> torch.Tensor:
    """Static per-tensor FP8 of ``x`` (float16 / bfloat16 / float32, any shape): ``float8_e4m3fn`` of ``x``'s
    shape, ``fp8(clamp(float32(x) * inv_scale, -448, 448))``; ``inv_scale`` a one-element float32 tensor
    (:func:`reciprocal` of the checkpoint's scale, or the graph's own reciprocal). A NaN product becomes what
    ``nan`` says (the CUDA kernel's +448 by default)."""
    check_x("quantize_static", x)
    check_scale("quantize_static", inv_scale, x.device, name="inv_scale")
    return _clamp(x.float() * inv_scale.float().reshape(()), nan).to(FP8)


def dequantize_static(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale``."""
    return q.float() * scale.float().reshape(())


def _groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)


def _round_up_power_of_two(s: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= ``s`` (positive, normal or Inf): the UE8M0 scale (the kernel's ``exp2(ceil(
    log2(s)))``, bit for bit: the exponent plus one unless the mantissa is zero)."""
    mantissa, exponent = torch.frexp(s)  # s = mantissa * 2**exponent, mantissa in [0.5, 1)
    exact = (mantissa == 0.5) | s.isinf()
    return torch.where(exact, s, torch.ldexp(torch.ones_like(s), exponent))


def group_scales(x: torch.Tensor, *, group_size: int = GROUP_SIZE, ue8m0: bool = False,
                 eps: float = SCALE_EPS) -> torch.Tensor:
    """float32 ``[..., N / group_size]``: each group's scale, ``max(eps, max |x_g|) / 448`` (NaN elements left
    out of the max, as ``fmaxf`` leaves them), rounded up to a power of two when ``ue8m0``."""
    check_group_x("group_scales", x, group_size)
    g = _groups(x, group_size).abs()
    absmax = torch.where(g.isnan(), torch.zeros_like(g), g).amax(dim=-1).clamp(min=eps)
    s = absmax / torch.full_like(absmax, E4M3_MAX)
    return _round_up_power_of_two(s) if ue8m0 else s


def quantize_group(x: torch.Tensor, *, group_size: int = GROUP_SIZE, ue8m0: bool = False, divide: bool = False,
                   eps: float = SCALE_EPS, nan: NaNRule = NaNRule.NEGATIVE_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token-group FP8 of ``x [..., N]`` (``N % group_size == 0``): ``(q float8_e4m3fn [..., N],
    scales float32 [..., N / group_size])`` (row-major; :class:`~fusion_pass.fp8.layout.ScaleLayout` places them
    elsewhere). ``divide``: ``x / s`` (vLLM 0.32's kernel) instead of ``x * (1 / s)`` (0.33, 0.34); the two are
    equal when ``ue8m0``. A NaN quotient becomes what ``nan`` says (the kernel's -448 by default)."""
    scales = group_scales(x, group_size=group_size, ue8m0=ue8m0, eps=eps)
    g, s = _groups(x, group_size), scales.unsqueeze(-1)
    q = g / s if divide else g * reciprocal(s)
    return _clamp(q, nan).to(FP8).reshape(x.shape), scales


def dequantize_group(q: torch.Tensor, scales: torch.Tensor, *, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """float32 ``q * s`` per group (``scales`` ``[..., N / group_size]``, any strides)."""
    check_scales_for("dequantize_group", q, scales, group_size)
    return (_groups(q, group_size) * scales.float().unsqueeze(-1)).reshape(q.shape)
