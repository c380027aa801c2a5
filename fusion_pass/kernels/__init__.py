"""Attention with half-precision or NVFP4 output, and NVFP4 quantization, on the GPU.

Public entry points (every argument checked up front):

* :func:`attention` -> ``[T, H, Dv]`` in the query dtype;
* :func:`attention_nvfp4` -> ``(packed uint8 [T, H*Dv/2], scales float8_e4m3fn
  [round_up(T, 128), round_up(H*Dv/16, 4)])`` in the layout of ``NVFP4.md``;
* :func:`quantize` -> the Triton NVFP4 quantizer, same bytes as
  :func:`fusion_pass.nvfp4.quantize_reference`;
* :func:`quantize_rows_into`: the same quantizer writing ``M`` rows at a row
  offset into the buffers of a ``T``-row matrix, touching no other byte
  (:func:`zero_scale_padding`, re-exported from :mod:`fusion_pass.nvfp4`, clears
  the padding rows' scales once all rows are written);
* :func:`flash_attention_nvfp4_varlen`: the ``triton`` fused backend's call,
  writing into the attention op's buffers;
* :func:`fa4_attention_varlen` / :func:`fa4_attention_nvfp4_varlen`
  (:mod:`fusion_pass.kernels.fa4_sm90`): FlashAttention-4's SM90 forward, bf16/fp16
  output or NVFP4 output through our epilogue (the ``fa4`` fused backend's call).

This package takes tensors and returns tensors: it imports neither
:mod:`fusion_pass.backends` nor :mod:`fusion_pass.runtime` (who picks a kernel for a
batch lives above it).

Shapes: ``q [T, H, Dqk]``, ``k [T, Hkv, Dqk]``, ``v [T, Hkv, Dv]`` (token-major,
sequences packed along ``T``), ``cu_seqlens`` int32 ``[B + 1]`` with
``0 = c0 <= c1 <= ... <= cB = T``, ``max_seqlen >= max(c[i+1] - c[i])``.

Backends of the attention entry points (``backend=``):

``triton``
    :mod:`fusion_pass.kernels.flash_attention`: CUDA tensors, or CPU tensors
    under Triton's interpreter (``TRITON_INTERPRET=1``, tests only).
``fa4``
    FlashAttention-4 on SM90 (H100/H200; needs the ``fa4`` extra): ``attention``
    is FA4's own varlen forward, ``attention_nvfp4`` FA4's SM90 kernel with our
    NVFP4 epilogue (bytes equal to :func:`quantize` of FA4's bf16/fp16 output).
    Head dims ``(D, Dv)`` in :data:`fusion_pass.kernels.fa4_sm90.SUPPORTED_HEAD_DIMS`.
``reference``
    float32 PyTorch attention per sequence, then (NVFP4) the reference
    quantizer. Any device.
``auto``
    ``fa4`` when available for the tensors (SM90, FA4 importable, supported
    head dims), else ``triton`` for CUDA tensors, else ``reference``.
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from fusion_pass import nvfp4
from fusion_pass.dense import attention_with_lse
from fusion_pass.kernels.checks import check_qkv, describe
from fusion_pass.kernels.fa4_sm90 import fa4_attention_nvfp4_varlen, fa4_attention_varlen, fa4_sm90_usable
from fusion_pass.nvfp4 import zero_scale_padding

__all__ = [
    "ATTENTION_BACKENDS",
    "attention",
    "attention_nvfp4",
    "quantize",
    "QUANT_BACKENDS",
    "quantize_rows_into",
    "zero_scale_padding",
    "flash_attention_nvfp4_varlen",
    "fa4_attention_varlen",
    "fa4_attention_nvfp4_varlen",
    "fa4_sm90_usable",
    "interpreter_enabled",
]

ATTENTION_BACKENDS = ("auto", "triton", "fa4", "reference")
QUANT_BACKENDS = ("auto", "triton", "reference")


def interpreter_enabled() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ---------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------


def _check_varlen(fn: str, q: Tensor, cu_seqlens, max_seqlen) -> None:
    """Checks ``cu_seqlens``'s values too: one small device-to-host copy."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ValueError(f"{fn}: cu_seqlens must be a 1-D int32 tensor [B + 1], got {describe(cu_seqlens)}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"{fn}: cu_seqlens must have B + 1 >= 2 entries, got {cu_seqlens.numel()}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"{fn}: cu_seqlens must be on q's device {q.device}, got {cu_seqlens.device}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"{fn}: max_seqlen must be a non-negative int, got {max_seqlen!r}")
    starts = cu_seqlens.tolist()
    t = q.shape[0]
    lengths = [b - a for a, b in zip(starts[:-1], starts[1:])]
    if starts[0] != 0 or starts[-1] != t or min(lengths) < 0:
        raise ValueError(
            f"{fn}: cu_seqlens must rise from 0 to T={t} without decreasing, got {starts[:8]}"
            + (" ..." if len(starts) > 8 else "")
        )
    if max(lengths) > max_seqlen:
        raise ValueError(f"{fn}: max_seqlen={max_seqlen} is smaller than the longest sequence ({max(lengths)})")


def _check_softmax_scale(fn: str, softmax_scale) -> None:
    if softmax_scale is not None and (
        isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, (int, float))
        or not math.isfinite(softmax_scale)
        or softmax_scale <= 0
    ):
        raise ValueError(f"{fn}: softmax_scale must be None or a positive finite float, got {softmax_scale!r}")


def _check_global_scale(fn: str, global_scale, device: torch.device) -> None:
    if not isinstance(global_scale, Tensor) or global_scale.dtype != torch.float32 or global_scale.numel() != 1:
        raise ValueError(f"{fn}: global_scale must be a one-element float32 tensor, got {describe(global_scale)}")
    if global_scale.device != device:
        raise ValueError(f"{fn}: global_scale must be on q's device {device}, got {global_scale.device}")
    value = global_scale.item()
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{fn}: global_scale must be positive and finite, got {value}")


def _check_backend_name(fn: str, backend) -> None:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}")


# ---------------------------------------------------------------------------
# backend choice
# ---------------------------------------------------------------------------


def _triton_usable(device: torch.device) -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False, "triton is not installed"
    if device.type == "cuda" or interpreter_enabled():
        return True, "ok"
    return False, f"triton runs on CUDA tensors (or on the CPU with TRITON_INTERPRET=1), got {device} tensors"


def _fa4_usable(q: Tensor, v: Tensor) -> tuple[bool, str]:
    return fa4_sm90_usable(q.device, q.dtype, q.shape[1], q.shape[2], v.shape[2])


def _choose(fn: str, backend: str, q: Tensor, v: Tensor) -> str:
    """The backend that runs this call; raises with the reason when a named one cannot."""
    _check_backend_name(fn, backend)
    if backend == "auto":
        if _fa4_usable(q, v)[0]:
            return "fa4"
        return "triton" if q.device.type == "cuda" and _triton_usable(q.device)[0] else "reference"
    if backend == "triton":
        ok, why = _triton_usable(q.device)
    elif backend == "fa4":
        ok, why = _fa4_usable(q, v)
    else:
        ok, why = True, "ok"
    if not ok:
        raise RuntimeError(f"{fn}: backend {backend!r} is unavailable: {why}")
    return backend


# ---------------------------------------------------------------------------
# backends' bodies
# ---------------------------------------------------------------------------


def reference_attention(q, k, v, cu_seqlens, causal, softmax_scale) -> Tensor:
    """float32 ``[T, H, Dv]``: dense attention per sequence of ``cu_seqlens`` (the ``reference`` backend's)."""
    starts = cu_seqlens.tolist()
    out = q.new_zeros((q.shape[0], q.shape[1], v.shape[2]), dtype=torch.float32)
    for a, b in zip(starts[:-1], starts[1:]):
        if b > a:
            out[a:b] = attention_with_lse(q[a:b], k[a:b], v[a:b], scale=softmax_scale, causal=causal)[0]
    return out


# ---------------------------------------------------------------------------
# public entry points
# ---------------------------------------------------------------------------


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """Varlen (flash) attention with output in the query dtype.

    Args:
        q: float16/bfloat16 ``[T, H, Dqk]``; k: ``[T, Hkv, Dqk]``; v: ``[T, Hkv, Dv]``
            (same dtype and device, ``H % Hkv == 0``, unit stride along the head dim).
        cu_seqlens: int32 ``[B + 1]`` on q's device: sequence ``b`` is tokens
            ``[cu_seqlens[b], cu_seqlens[b+1])``; its keys are its own tokens.
        max_seqlen: at least the longest sequence.
        causal: token ``i`` of a sequence sees keys ``j <= i`` of that sequence.
        softmax_scale: default ``1 / sqrt(Dqk)``.
        backend: ``auto``, ``triton``, ``fa4`` or ``reference`` (module docstring).

    Returns:
        ``[T, H, Dv]`` in q's dtype.
    """
    fn = "attention"
    check_qkv(fn, q, k, v)
    _check_varlen(fn, q, cu_seqlens, max_seqlen)
    _check_softmax_scale(fn, softmax_scale)
    chosen = _choose(fn, backend, q, v)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    if chosen == "triton":
        from fusion_pass.kernels.flash_attention import flash_attention

        return flash_attention(q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=scale)
    if chosen == "fa4":
        return fa4_attention_varlen(q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=scale)
    return reference_attention(q, k, v, cu_seqlens, causal, scale).to(q.dtype)


def attention_nvfp4(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    global_scale: Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Varlen attention written directly as NVFP4, quantized from the float32 result.

    Arguments as :func:`attention`, plus ``global_scale``: float32, one positive
    finite element, on q's device (``448 * 6 / amax`` of the output, calibrated).
    ``H * Dv`` must be divisible by 16 (``Dv`` itself for ``triton``/``fa4``,
    whose epilogues quantize one head at a time).

    Returns:
        ``(packed, scales)``: uint8 ``[T, H*Dv/2]`` (row = token, element
        ``h*Dv + d``; two e2m1 codes per byte, the even element in the low
        nibble) and float8_e4m3fn ``[round_up(T, 128), round_up(H*Dv/16, 4)]``
        in the 128x4 swizzled layout, padding zero.
    """
    fn = "attention_nvfp4"
    check_qkv(fn, q, k, v)
    _check_varlen(fn, q, cu_seqlens, max_seqlen)
    _check_softmax_scale(fn, softmax_scale)
    _check_global_scale(fn, global_scale, q.device)
    t, h, _ = q.shape
    dv = v.shape[2]
    chosen = _choose(fn, backend, q, v)
    if chosen != "reference" and dv % nvfp4.BLOCK_SIZE != 0:
        raise ValueError(f"{fn}: backend {chosen!r} needs v's head dim Dv divisible by 16, got {dv}")
    if (h * dv) % nvfp4.BLOCK_SIZE != 0:
        raise ValueError(f"{fn}: H * Dv must be divisible by 16, got {h} * {dv} = {h * dv}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    if chosen == "triton":
        from fusion_pass.kernels.flash_attention import flash_attention_nvfp4

        return flash_attention_nvfp4(q, k, v, cu_seqlens, max_seqlen, global_scale, causal=causal, softmax_scale=scale)
    if chosen == "fa4":
        rows, cols = nvfp4.scale_shape(t, h * dv)
        packed = torch.empty((t, h * dv // 2), dtype=torch.uint8, device=q.device)
        scales = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=q.device)
        fa4_attention_nvfp4_varlen(
            q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, softmax_scale=scale, causal=causal,
            output=packed, output_scale=global_scale, output_block_scale=scales,
        )
        return packed, scales
    out = reference_attention(q, k, v, cu_seqlens, causal, scale)
    return nvfp4.quantize_reference(out.reshape(t, h * dv), global_scale, swizzled=True)


def quantize(x: Tensor, global_scale: Tensor, *, swizzled: bool = True) -> tuple[Tensor, Tensor]:
    """NVFP4-quantize ``x [..., K]`` with the Triton kernel (CUDA, or the interpreter).

    Same contract and bytes as :func:`fusion_pass.nvfp4.quantize_reference`:
    returns ``(packed uint8 [M, K/2], scales float8_e4m3fn)``, scales swizzled
    ``[round_up(M,128), round_up(K/16,4)]`` or linear ``[M, K/16]``.
    """
    from fusion_pass.kernels.nvfp4_quant import quantize as triton_quantize

    nvfp4._check_x("quantize", x, global_scale)
    ok, why = _triton_usable(x.device)
    if not ok:
        raise RuntimeError(f"quantize: {why}")
    return triton_quantize(x.reshape(-1, x.shape[-1]), global_scale, swizzled=swizzled)


def quantize_rows_into(
    x: Tensor,
    global_scale: Tensor,
    packed: Tensor,
    scales: Tensor,
    row_start: int,
    *,
    backend: str = "auto",
) -> None:
    """Quantize ``x [M, K]`` into rows ``[row_start, row_start + M)`` of a ``T``-row NVFP4 buffer pair.

    Arguments, bytes and errors as :func:`fusion_pass.nvfp4.quantize_rows_into`
    (all checked before anything is written): ``packed`` contiguous uint8
    ``[T, K/2]``; ``scales`` the contiguous 128x4 swizzled buffer of ``T`` rows, int32
    ``[round_up(T, 128), round_up(K/16, 4) / 4]`` or uint8 / float8_e4m3fn
    ``[round_up(T, 128), round_up(K/16, 4)]``; ``0 <= row_start <= T - M``. Only the
    packed bytes and scale bytes of those rows are written; the padding rows are
    left to :func:`zero_scale_padding`.

    ``backend``: ``auto`` (the Triton kernel for CUDA tensors, the reference
    otherwise), ``triton`` (CUDA tensors, or CPU tensors under Triton's interpreter),
    ``reference`` (plain PyTorch, any device).
    """
    fn = "quantize_rows_into"
    if backend not in QUANT_BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {', '.join(QUANT_BACKENDS)}, got {backend!r}")
    nvfp4._check_rows_into(fn, x, global_scale, packed, scales, row_start)
    if backend == "auto":
        backend = "triton" if x.device.type == "cuda" and _triton_usable(x.device)[0] else "reference"
    elif backend == "triton":
        ok, why = _triton_usable(x.device)
        if not ok:
            raise RuntimeError(f"{fn}: backend 'triton' is unavailable: {why}")
    if backend == "triton":
        from fusion_pass.kernels.nvfp4_quant import quantize_rows_into as triton_quantize_rows_into

        triton_quantize_rows_into(x, global_scale, packed, scales, row_start)
    else:
        nvfp4._write_rows(x, global_scale, packed, scales, row_start)


def flash_attention_nvfp4_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens: Tensor,
    max_seqlen: int,
    softmax_scale: float,
    causal: bool,
    output: Tensor,
    output_scale: Tensor,
    output_block_scale: Tensor,
) -> None:
    """The ``triton`` fused backend's call (:class:`fusion_pass.backends.TritonBackend`).

    Writes the NVFP4 attention output into the attention op's buffers (already
    validated by the op): ``output`` uint8 ``[T, H*Dv/2]``, ``output_scale`` the
    global scale, ``output_block_scale`` the swizzled scale buffer (any one-byte
    or int32 view). q/k/v/``cu_seqlens`` come from the backend, not the user;
    only their shapes are checked here (no device synchronization).
    """
    from fusion_pass.kernels.flash_attention import flash_attention_nvfp4

    fn = "flash_attention_nvfp4_varlen"
    check_qkv(fn, q, k, v)
    if v.shape[2] % nvfp4.BLOCK_SIZE != 0:
        raise ValueError(f"{fn}: v's head dim must be divisible by 16, got {v.shape[2]}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.device != q.device:
        raise ValueError(f"{fn}: cu_seqlens must be int32 [B + 1] on {q.device}, got {describe(cu_seqlens)}")
    flash_attention_nvfp4(
        q, k, v, cu_seqlens, max_seqlen, output_scale, causal=causal, softmax_scale=softmax_scale,
        packed=output.view(torch.uint8), scales=output_block_scale,
    )
