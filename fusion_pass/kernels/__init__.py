"""Attention with half-precision or NVFP4 output, and NVFP4 quantization, on the GPU.

Public entry points (every argument checked up front):

* :func:`attention` -> ``[T, H, Dv]`` in the query dtype;
* :func:`attention_nvfp4` -> ``(packed uint8 [T, H*Dv/2], scales float8_e4m3fn
  [round_up(T, 128), round_up(H*Dv/16, 4)])`` in the layout of ``NVFP4.md``;
* :func:`quantize` -> the Triton NVFP4 quantizer, same bytes as
  :func:`fusion_pass.nvfp4.quantize_reference`;
* :func:`flash_attention_nvfp4_varlen`: the ``triton`` fused backend's call,
  writing into the attention op's buffers.

Shapes: ``q [T, H, Dqk]``, ``k [T, Hkv, Dqk]``, ``v [T, Hkv, Dv]`` (token-major,
sequences packed along ``T``), ``cu_seqlens`` int32 ``[B + 1]`` with
``0 = c0 <= c1 <= ... <= cB = T``, ``max_seqlen >= max(c[i+1] - c[i])``.

Backends of the attention entry points (``backend=``):

``triton``
    :mod:`fusion_pass.kernels.flash_attention`: CUDA tensors, or CPU tensors
    under Triton's interpreter (``TRITON_INTERPRET=1``, tests only).
``fa4``
    ``flash_attn.cute.flash_attn_varlen_func`` (NVFP4 output on SM100/SM110
    with an FA4 that has the NVFP4 arguments); never run in this project's
    environments, see :mod:`fusion_pass.backends`.
``reference``
    float32 PyTorch attention per sequence, then (NVFP4) the reference
    quantizer. Any device.
``auto``
    ``fa4`` when available for the device, else ``triton`` for CUDA tensors,
    else ``reference``.
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from fusion_pass import nvfp4

__all__ = [
    "ATTENTION_BACKENDS",
    "attention",
    "attention_nvfp4",
    "quantize",
    "flash_attention_nvfp4_varlen",
    "interpreter_enabled",
]

ATTENTION_BACKENDS = ("auto", "triton", "fa4", "reference")
_HALF = (torch.float16, torch.bfloat16)


def interpreter_enabled() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ---------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------


def _describe(t) -> str:
    return f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, Tensor) else repr(t)


def _check_qkv(fn: str, q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            layout = {"q": "[T, H, Dqk]", "k": "[T, Hkv, Dqk]", "v": "[T, Hkv, Dv]"}[name]
            raise ValueError(f"{fn}: {name} must be a 3-D tensor {layout}, got {_describe(t)}")
        if t.dtype not in _HALF:
            raise TypeError(f"{fn}: {name} must be float16 or bfloat16, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{fn}: {name} must have unit stride along its last (head) dim, got strides {t.stride()}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{fn}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{fn}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    t, h, dqk = q.shape
    if k.shape[0] != t or v.shape[0] != t:
        raise ValueError(
            f"{fn}: q, k, v must have the same number of tokens T, got q {list(q.shape)}, "
            f"k {list(k.shape)}, v {list(v.shape)}"
        )
    if k.shape[2] != dqk:
        raise ValueError(f"{fn}: k must be [T, Hkv, Dqk] with q's Dqk={dqk}, got {list(k.shape)}")
    hkv = k.shape[1]
    if v.shape[1] != hkv:
        raise ValueError(f"{fn}: v must be [T, Hkv, Dv] with k's Hkv={hkv}, got {list(v.shape)}")
    if hkv == 0 or h % hkv != 0:
        raise ValueError(f"{fn}: q's heads H={h} must be a multiple of k/v's heads Hkv={hkv}")


def _check_varlen(fn: str, q: Tensor, cu_seqlens, max_seqlen) -> None:
    """Checks ``cu_seqlens``'s values too: one small device-to-host copy."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ValueError(f"{fn}: cu_seqlens must be a 1-D int32 tensor [B + 1], got {_describe(cu_seqlens)}")
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
        raise ValueError(f"{fn}: global_scale must be a one-element float32 tensor, got {_describe(global_scale)}")
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
    from fusion_pass import backends

    fa4 = backends.get_backend("fa4")
    ok, why = fa4.available()
    if not ok:
        return ok, why
    return fa4.supports(q.device, q.dtype, q.shape[1], q.shape[2], v.shape[2])


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


def _reference_attention(q, k, v, cu_seqlens, causal, softmax_scale) -> Tensor:
    """float32 ``[T, H, Dv]``: dense attention per sequence."""
    from fusion_pass.runtime.dense import attention_with_lse

    starts = cu_seqlens.tolist()
    out = q.new_zeros((q.shape[0], q.shape[1], v.shape[2]), dtype=torch.float32)
    for a, b in zip(starts[:-1], starts[1:]):
        if b > a:
            out[a:b] = attention_with_lse(q[a:b], k[a:b], v[a:b], scale=softmax_scale, causal=causal)[0]
    return out


def _fa4_call(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, **nvfp4_outputs):
    from fusion_pass import backends

    module, error = backends._import_fa4()
    if module is None:
        raise RuntimeError(f"fa4: {error}")
    if nvfp4_outputs:
        kwargs = backends.fa4_call_kwargs(
            q=q, k=k, v=v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, softmax_scale=softmax_scale,
            num_heads=q.shape[1], v_head_dim=v.shape[2], **nvfp4_outputs,
        )
        kwargs["causal"] = causal
        module.flash_attn_varlen_func(**kwargs)
        return None
    result = module.flash_attn_varlen_func(
        q=q, k=k, v=v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen, softmax_scale=softmax_scale, causal=causal,
    )
    return result[0] if isinstance(result, tuple) else result


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
    _check_qkv(fn, q, k, v)
    _check_varlen(fn, q, cu_seqlens, max_seqlen)
    _check_softmax_scale(fn, softmax_scale)
    chosen = _choose(fn, backend, q, v)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    if chosen == "triton":
        from fusion_pass.kernels.flash_attention import flash_attention

        return flash_attention(q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=scale)
    if chosen == "fa4":
        return _fa4_call(q, k, v, cu_seqlens, max_seqlen, causal, scale)
    return _reference_attention(q, k, v, cu_seqlens, causal, scale).to(q.dtype)


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
    _check_qkv(fn, q, k, v)
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
        scales = torch.zeros((rows, cols), dtype=torch.float8_e4m3fn, device=q.device)
        _fa4_call(q, k, v, cu_seqlens, max_seqlen, causal, scale,
                  output=packed, output_scale=global_scale, output_block_scale=scales)
        return packed, scales
    out = _reference_attention(q, k, v, cu_seqlens, causal, scale)
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
    _check_qkv(fn, q, k, v)
    if v.shape[2] % nvfp4.BLOCK_SIZE != 0:
        raise ValueError(f"{fn}: v's head dim must be divisible by 16, got {v.shape[2]}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.device != q.device:
        raise ValueError(f"{fn}: cu_seqlens must be int32 [B + 1] on {q.device}, got {_describe(cu_seqlens)}")
    flash_attention_nvfp4(
        q, k, v, cu_seqlens, max_seqlen, output_scale, causal=causal, softmax_scale=softmax_scale,
        packed=output.view(torch.uint8), scales=output_block_scale,
    )
