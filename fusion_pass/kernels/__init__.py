"""Attention with half-precision or NVFP4 output, and NVFP4 quantization, on the GPU.

Public entry points (every argument checked up front):

* :func:`attention` -> ``[T, H, Dv]`` in the query dtype;
* :func:`attention_nvfp4` -> ``(packed uint8 [T, H*Dv/2], scales float8_e4m3fn
  [round_up(T, 128), round_up(H*Dv/16, 4)])`` in the layout of ``NVFP4.md``;
* :func:`attention_with_lse` -> ``(out float32 [T, H, Dv], lse float32 [T, H])``:
  partial results (e.g. over a chunk of cached context) to merge by their
  log-sum-exps;
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

Shapes: ``q [T, H, Dqk]``, ``k [Tk, Hkv, Dqk]``, ``v [Tk, Hkv, Dv]`` (token-major,
sequences packed along ``T``), ``cu_seqlens`` int32 ``[B + 1]`` with
``0 = c0 <= c1 <= ... <= cB = T``, ``max_seqlen >= max(c[i+1] - c[i])``.
Keys/values are the queries' own tokens (``Tk = T``) unless ``cu_seqlens_k``
int32 ``[B + 1]`` (``0 = ck0 <= ... <= ckB = Tk``) delimits them in a separate
packed workspace: sequence ``b``'s ``Lq`` queries attend to its ``Lk`` keys, e.g.
cached context followed by the new tokens (chunked prefill). Causal attention is
then aligned to the end of the keys (bottom-right, FlashAttention's convention):
query ``i`` sees keys ``j <= i + (Lk - Lq)``, which needs ``Lk >= Lq``.

Backends of the attention entry points (``backend=``):

``triton``
    :mod:`fusion_pass.kernels.flash_attention`: CUDA tensors, or CPU tensors
    under Triton's interpreter (``TRITON_INTERPRET=1``, tests only).
``fa4``
    FlashAttention-4 on SM90 (H100/H200; needs the ``fa4`` extra): ``attention``
    and ``attention_with_lse`` are FA4's own varlen forward, ``attention_nvfp4``
    FA4's SM90 kernel with our NVFP4 epilogue (bytes equal to :func:`quantize` of
    FA4's bf16/fp16 output).
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

from fusion_pass import dense, nvfp4
from fusion_pass.kernels.checks import check_cu_seqlens_k, check_max_seqlen_k, check_qkv, describe
from fusion_pass.kernels.fa4_sm90 import fa4_attention_nvfp4_varlen, fa4_attention_varlen, fa4_sm90_usable
from fusion_pass.nvfp4 import zero_scale_padding

__all__ = [
    "ATTENTION_BACKENDS",
    "attention",
    "attention_nvfp4",
    "attention_with_lse_varlen",
    "attention_with_lse",
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


def _check_varlen(fn: str, q: Tensor, cu_seqlens, max_seqlen) -> list[int]:
    """Checks ``cu_seqlens``'s values too: one small device-to-host copy. Returns the sequence lengths."""
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
    return lengths


def _check_varlen_k(fn: str, q: Tensor, k: Tensor, cu_seqlens, cu_seqlens_k, max_seqlen_k, causal,
                    lengths_q: list[int]) -> int | None:
    """``cu_seqlens_k``'s shape and values (one more small copy): rises from 0 to ``Tk``, covered by
    ``max_seqlen_k``, and with ``causal`` no sequence has fewer keys than queries. Returns
    ``max_seqlen_k`` (the longest key sequence when ``None`` was given)."""
    check_max_seqlen_k(fn, max_seqlen_k, cu_seqlens_k)
    if cu_seqlens_k is None:
        return None
    check_cu_seqlens_k(fn, cu_seqlens_k, cu_seqlens, q.device)
    starts = cu_seqlens_k.tolist()
    tk = k.shape[0]
    lengths = [b - a for a, b in zip(starts[:-1], starts[1:])]
    if starts[0] != 0 or starts[-1] != tk or min(lengths) < 0:
        raise ValueError(
            f"{fn}: cu_seqlens_k must rise from 0 to Tk={tk} (k's tokens) without decreasing, got {starts[:8]}"
            + (" ..." if len(starts) > 8 else "")
        )
    if max_seqlen_k is not None and max(lengths) > max_seqlen_k:
        raise ValueError(f"{fn}: max_seqlen_k={max_seqlen_k} is smaller than the longest key sequence ({max(lengths)})")
    if causal:
        for b, (lq, lk) in enumerate(zip(lengths_q, lengths)):
            if lk < lq:
                raise ValueError(
                    f"{fn}: cu_seqlens_k gives sequence {b} {lk} keys for its {lq} queries; causal attention "
                    f"aligns the queries to the end of the keys and needs Lk >= Lq"
                )
    return max(lengths) if max_seqlen_k is None else max_seqlen_k


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


def _check_causal(fn: str, causal) -> None:
    if not isinstance(causal, bool):
        raise ValueError(f"{fn}: causal must be a bool, got {causal!r}")


def _check_backend_name(fn: str, backend, names: tuple[str, ...] = ATTENTION_BACKENDS) -> None:
    if backend not in names:
        raise ValueError(f"{fn}: backend must be one of {', '.join(names)}, got {backend!r}")


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


def _triton_or_reference(fn: str, backend: str, device: torch.device, *, fits: bool = True) -> str:
    """The backend of a ``triton``/``reference`` call: ``auto`` is ``triton`` for CUDA tensors when
    Triton imports and the call ``fits`` its kernel, else ``reference``; a named ``triton`` raises
    (RuntimeError) when Triton cannot run on ``device``. Whether a named ``triton`` fits is the
    caller's to check."""
    if backend == "auto":
        return "triton" if device.type == "cuda" and fits and _triton_usable(device)[0] else "reference"
    if backend == "triton":
        ok, why = _triton_usable(device)
        if not ok:
            raise RuntimeError(f"{fn}: backend 'triton' is unavailable: {why}")
    return backend


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


def _reference(q, k, v, cu_seqlens, causal, softmax_scale, cu_seqlens_k) -> tuple[Tensor, Tensor]:
    starts = cu_seqlens.tolist()
    starts_k = starts if cu_seqlens_k is None else cu_seqlens_k.tolist()
    out = q.new_zeros((q.shape[0], q.shape[1], v.shape[2]), dtype=torch.float32)
    lse = q.new_full((q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float32)
    for a, b, ka, kb in zip(starts[:-1], starts[1:], starts_k[:-1], starts_k[1:]):
        if b > a:
            out[a:b], lse[a:b] = dense.attention_with_lse(
                q[a:b], k[ka:kb], v[ka:kb], scale=softmax_scale, causal=causal, q_offset=(kb - ka) - (b - a)
            )
    return out, lse


def reference_attention(
    q, k, v, cu_seqlens, causal, softmax_scale, *, cu_seqlens_k=None, max_seqlen_k=None
) -> Tensor:
    """float32 ``[T, H, Dv]``: dense attention per sequence of ``cu_seqlens`` (the ``reference`` backend's).

    Sequence ``b``'s queries are rows ``[c[b], c[b+1])`` of ``q`` (and of the output; rows
    outside the sequences are 0), its keys/values rows ``[ck[b], ck[b+1])`` of ``k``/``v``
    with ``ck = cu_seqlens_k`` (default ``cu_seqlens``); causal attention is bottom-right
    aligned (:func:`fusion_pass.dense.attention_with_lse` with ``q_offset = Lk - Lq``).
    ``max_seqlen_k`` is accepted for the other backends' signature and not used.
    """
    return _reference(q, k, v, cu_seqlens, causal, softmax_scale, cu_seqlens_k)[0]


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
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_k: int | None = None,
) -> Tensor:
    """Varlen (flash) attention with output in the query dtype.

    Args:
        q: float16/bfloat16 ``[T, H, Dqk]``; k: ``[Tk, Hkv, Dqk]``; v: ``[Tk, Hkv, Dv]``
            (same dtype and device, ``H % Hkv == 0``, unit stride along the head dim;
            ``Tk = T`` without ``cu_seqlens_k``).
        cu_seqlens: int32 ``[B + 1]`` on q's device: sequence ``b``'s queries are tokens
            ``[cu_seqlens[b], cu_seqlens[b+1])``.
        max_seqlen: at least the longest query sequence.
        causal: query ``i`` of a sequence of ``Lq`` queries and ``Lk`` keys sees keys
            ``j <= i + (Lk - Lq)`` of that sequence (``j <= i`` without ``cu_seqlens_k``).
        softmax_scale: default ``1 / sqrt(Dqk)``.
        backend: ``auto``, ``triton``, ``fa4`` or ``reference`` (module docstring).
        cu_seqlens_k: int32 ``[B + 1]`` on q's device, contiguous, rising from 0 to
            ``Tk``: sequence ``b``'s keys/values are rows ``[ck[b], ck[b+1])`` of k/v.
            Default: the queries' own tokens. With ``causal``, ``Lk >= Lq`` per sequence.
        max_seqlen_k: at least the longest key sequence (only with ``cu_seqlens_k``;
            default: computed from it).

    Returns:
        ``[T, H, Dv]`` in q's dtype.
    """
    fn = "attention"
    chosen, scale, max_seqlen_k = _check_attention(
        fn, q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, backend, cu_seqlens_k, max_seqlen_k
    )
    if chosen == "triton":
        from fusion_pass.kernels.flash_attention import flash_attention

        return flash_attention(q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=scale,
                               cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
    if chosen == "fa4":
        return fa4_attention_varlen(q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=scale,
                                    cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
    return reference_attention(q, k, v, cu_seqlens, causal, scale, cu_seqlens_k=cu_seqlens_k).to(q.dtype)


def attention_with_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    *,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Varlen attention in float32 with its log-sum-exp: a partial result to merge.

    Arguments and checks as :func:`attention`. Attention over disjoint key sets (context
    chunks, then the new tokens) combines exactly by the log-sum-exps
    (:func:`fusion_pass.dense.merge_attention`).

    Returns:
        ``(out, lse)``: ``out`` float32 ``[T, H, Dv]``; ``lse`` float32 ``[T, H]``,
        ``ln sum_j exp(scale * q.k_j)`` over the visible keys (``-inf``, with ``out`` 0,
        for a row that sees none). ``triton`` accumulates and writes float32; ``fa4``
        returns its output in q's dtype (converted here) and its LSE as a transposed view
        of its ``[H, T]`` buffer (strides ``(1, T)``: ``lse`` may be non-contiguous);
        ``reference`` is dense float32 attention per sequence.
    """
    fn = "attention_with_lse"
    chosen, scale, max_seqlen_k = _check_attention(
        fn, q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, backend, cu_seqlens_k, max_seqlen_k
    )
    return attention_with_lse_varlen(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                     cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k, softmax_scale=scale,
                                     causal=causal, backend=chosen)


def attention_with_lse_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens: Tensor,
    max_seqlen: int,
    cu_seqlens_k: Tensor | None,
    max_seqlen_k: int | None,
    softmax_scale: float,
    causal: bool,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """:func:`attention_with_lse`'s body for the fused backends' chunked-context path: arguments trusted
    (the backend built them), ``backend`` one of ``triton``, ``fa4``, ``reference``; no host
    synchronization on ``triton`` and ``fa4``."""
    if backend == "triton":
        from fusion_pass.kernels.flash_attention import flash_attention

        out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]), dtype=torch.float32)
        lse = q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)
        flash_attention(q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=softmax_scale, out=out,
                        cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k, lse=lse)
        return out, lse
    if backend == "fa4":
        out, lse = fa4_attention_varlen(q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=softmax_scale,
                                        cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k, return_lse=True)
        return out.float(), lse
    return _reference(q, k, v, cu_seqlens, causal, softmax_scale, cu_seqlens_k)


def _check_attention(fn, q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, backend, cu_seqlens_k,
                     max_seqlen_k, *, global_scale=None) -> tuple[str, float, int | None]:
    """Every check of the attention entry points (``global_scale`` too when given); returns
    ``(backend, softmax scale, max_seqlen_k)``."""
    check_qkv(fn, q, k, v, separate_kv=cu_seqlens_k is not None)
    _check_causal(fn, causal)
    lengths = _check_varlen(fn, q, cu_seqlens, max_seqlen)
    max_seqlen_k = _check_varlen_k(fn, q, k, cu_seqlens, cu_seqlens_k, max_seqlen_k, causal, lengths)
    _check_softmax_scale(fn, softmax_scale)
    if global_scale is not None:
        _check_global_scale(fn, global_scale, q.device)
    chosen = _choose(fn, backend, q, v)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    return chosen, scale, max_seqlen_k


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
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_k: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Varlen attention written directly as NVFP4, quantized from the float32 result.

    Arguments as :func:`attention` (``cu_seqlens_k`` / ``max_seqlen_k`` included), plus
    ``global_scale``: float32, one positive finite element, on q's device (``448 * 6 /
    amax`` of the output, calibrated).
    ``H * Dv`` must be divisible by 16 (``Dv`` itself for ``triton``/``fa4``,
    whose epilogues quantize one head at a time).

    Returns:
        ``(packed, scales)``: uint8 ``[T, H*Dv/2]`` (row = token, element
        ``h*Dv + d``; two e2m1 codes per byte, the even element in the low
        nibble) and float8_e4m3fn ``[round_up(T, 128), round_up(H*Dv/16, 4)]``
        in the 128x4 swizzled layout, padding zero.
    """
    fn = "attention_nvfp4"
    chosen, scale, max_seqlen_k = _check_attention(
        fn, q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, backend, cu_seqlens_k, max_seqlen_k,
        global_scale=global_scale,
    )
    t, h, _ = q.shape
    dv = v.shape[2]
    if chosen != "reference" and dv % nvfp4.BLOCK_SIZE != 0:
        raise ValueError(f"{fn}: backend {chosen!r} needs v's head dim Dv divisible by 16, got {dv}")
    if (h * dv) % nvfp4.BLOCK_SIZE != 0:
        raise ValueError(f"{fn}: H * Dv must be divisible by 16, got {h} * {dv} = {h * dv}")
    if chosen == "triton":
        from fusion_pass.kernels.flash_attention import flash_attention_nvfp4

        return flash_attention_nvfp4(q, k, v, cu_seqlens, max_seqlen, global_scale, causal=causal, softmax_scale=scale,
                                     cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
    if chosen == "fa4":
        rows, cols = nvfp4.scale_shape(t, h * dv)
        packed = torch.empty((t, h * dv // 2), dtype=torch.uint8, device=q.device)
        scales = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=q.device)
        fa4_attention_nvfp4_varlen(
            q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, softmax_scale=scale, causal=causal,
            output=packed, output_scale=global_scale, output_block_scale=scales,
            cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k,
        )
        return packed, scales
    out = reference_attention(q, k, v, cu_seqlens, causal, scale, cu_seqlens_k=cu_seqlens_k)
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
    _check_backend_name(fn, backend, QUANT_BACKENDS)
    nvfp4._check_rows_into(fn, x, global_scale, packed, scales, row_start)
    if _triton_or_reference(fn, backend, x.device) == "triton":
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
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_k: int | None = None,
) -> None:
    """The ``triton`` fused backend's call (:class:`fusion_pass.backends.TritonBackend`).

    Writes the NVFP4 attention output into the attention op's buffers (already
    validated by the op): ``output`` uint8 ``[T, H*Dv/2]``, ``output_scale`` the
    global scale, ``output_block_scale`` the swizzled scale buffer (any one-byte
    or int32 view). q/k/v/``cu_seqlens``/``cu_seqlens_k`` come from the backend,
    not the user; only their shapes are checked here (no device synchronization).
    Sequence ``b``'s outputs go to rows ``[cu_seqlens[b], cu_seqlens[b+1])``, which
    may start past row 0 (other rows keep their bytes; the scale padding is zeroed);
    its keys are rows ``[cu_seqlens_k[b], cu_seqlens_k[b+1])`` of k/v (default
    ``cu_seqlens``), causal bottom-right aligned as in :func:`attention`.
    """
    from fusion_pass.kernels.flash_attention import flash_attention_nvfp4

    fn = "flash_attention_nvfp4_varlen"
    check_qkv(fn, q, k, v, separate_kv=cu_seqlens_k is not None)
    if v.shape[2] % nvfp4.BLOCK_SIZE != 0:
        raise ValueError(f"{fn}: v's head dim must be divisible by 16, got {v.shape[2]}")
    if (
        not isinstance(cu_seqlens, Tensor)
        or cu_seqlens.dtype != torch.int32
        or cu_seqlens.dim() != 1
        or cu_seqlens.numel() < 2
        or cu_seqlens.device != q.device
        or not cu_seqlens.is_contiguous()
    ):
        raise ValueError(
            f"{fn}: cu_seqlens must be contiguous int32 [B + 1 >= 2] on {q.device}, got {describe(cu_seqlens)}"
        )
    if cu_seqlens_k is not None:
        check_cu_seqlens_k(fn, cu_seqlens_k, cu_seqlens, q.device)
    check_max_seqlen_k(fn, max_seqlen_k, cu_seqlens_k)
    flash_attention_nvfp4(
        q, k, v, cu_seqlens, max_seqlen, output_scale, causal=causal, softmax_scale=softmax_scale,
        packed=output.view(torch.uint8), scales=output_block_scale, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_k=max_seqlen_k,
    )
