"""The kernels the benches time, behind one interface, and what is available here.

:class:`Kernels` holds four callables with the signatures of :mod:`fusion_pass.kernels.fa4.forward` and
:mod:`fusion_pass.kernels.launchers`:

* ``fused(q, k, v, *, cu_seqlens, max_seqlen, softmax_scale, causal, output, output_scale, output_block_scale,
  cu_seqlens_k=None, max_seqlen_k=None)``: attention written as NVFP4 into the caller's buffers, rows
  ``[cu_seqlens[0], cu_seqlens[B])`` only;
* ``attention(q, k, v, cu_seqlens, max_seqlen, *, causal, softmax_scale, cu_seqlens_k=None, max_seqlen_k=None)``:
  the same attention in q's dtype ``[T, H, Dv]``;
* ``quantize_into(x [M, K], global_scale, packed, scales)``: the project's quantizer into preallocated buffers;
* ``quantize_rows(x [M, K], global_scale, packed, scales, row_start)``: the row-range quantizer.

:func:`fa4_kernels` gives FlashAttention-4 with the project's NVFP4 epilogue (``fa4_attention_nvfp4_varlen``),
FA4's bf16 forward (``fa4_attention_varlen``) and the Triton quantizer: the public names of
``fusion_pass.kernels.fa4`` and ``fusion_pass.kernels.launchers``, whatever launcher or configuration sits
behind them. :func:`reference_kernels` gives PyTorch stand-ins with the same contract (the fused bytes are
``quantize(bf16 attention)``), so the benches' logic runs on the CPU.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from fusion_pass import nvfp4
from fusion_pass.kernels import launchers, reference
from fusion_pass.nvfp4.reference import write_rows

__all__ = ["Kernels", "cudnn_status", "fa4_kernels", "fa4_status", "reference_kernels"]


class Kernels(NamedTuple):
    """What a bench times; ``name`` says which implementation (for the output)."""

    name: str
    fused: Callable
    attention: Callable
    quantize_into: Callable
    quantize_rows: Callable


def fa4_status(device, dtype, heads: int, dqk: int, dv: int) -> tuple[bool, str]:
    """Whether FA4 with the NVFP4 epilogue runs a layer of these dims on ``device``: ``(ok, why)``."""
    try:
        from fusion_pass.kernels.fa4 import forward
    except ImportError as exc:  # pragma: no cover - the package itself imports without FA4
        return False, f"fusion_pass.kernels.fa4 does not import: {exc}"
    return forward.fa4_usable(torch.device(device), dtype, heads, dqk, dv)


def fa4_kernels() -> Kernels:
    """FA4 fused / FA4 bf16 / the project's quantizers (check :func:`fa4_status` per layout first)."""
    from fusion_pass.kernels.fa4.forward import fa4_attention_nvfp4_varlen, fa4_attention_varlen

    def quantize_into(x, global_scale, packed, scales):
        launchers.quantize_into(x, global_scale, packed, scales, swizzled=True)

    return Kernels("fa4", fa4_attention_nvfp4_varlen, fa4_attention_varlen, quantize_into, launchers.quantize_rows)


def cudnn_status() -> tuple[bool, str]:
    """Whether torch's SDPA can be asked for its cuDNN backend here: ``(ok, why)`` (a shape may still be refused)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if not torch.backends.cudnn.is_available():
        return False, f"this torch build ({torch.__version__}) has no cuDNN"
    return True, f"cuDNN {torch.backends.cudnn.version()}"


def _ref_attention(q, k, v, cu_seqlens, max_seqlen, *, causal, softmax_scale, cu_seqlens_k=None, max_seqlen_k=None):
    """Float32 reference attention rounded to q's dtype (FA4's output contract), ``[T, H, Dv]``."""
    return reference.varlen_attention(q, k, v, cu_seqlens, causal, softmax_scale, cu_seqlens_k)[0].to(q.dtype)


def _ref_fused(q, k, v, *, cu_seqlens, max_seqlen, softmax_scale, causal, output, output_scale, output_block_scale,
               cu_seqlens_k=None, max_seqlen_k=None):
    """``quantize(_ref_attention(...))`` into rows ``[cu_seqlens[0], cu_seqlens[B])`` of the buffers, as the
    fused kernel writes them (other rows untouched, scale padding zeroed)."""
    out = _ref_attention(q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=softmax_scale,
                         cu_seqlens_k=cu_seqlens_k)
    t, n = q.shape[0], q.shape[1] * v.shape[2]
    first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
    packed, scales = nvfp4.byte_views(output, output_block_scale, t)
    nvfp4.zero_scale_padding(scales, t, n)
    if last > first:
        write_rows(out[first:last].reshape(last - first, n), output_scale, packed, scales, first)


def _ref_quantize_into(x, global_scale, packed, scales):
    launchers.quantize_into(x, global_scale, packed, scales, swizzled=True)


def _ref_quantize_rows(x, global_scale, packed, scales, row_start):
    launchers.quantize_rows(x, global_scale, packed, scales, row_start, backend="reference")


def reference_kernels() -> Kernels:
    """PyTorch stand-ins on any device: float32 attention rounded to bf16, and the reference quantizer."""
    return Kernels("reference", _ref_fused, _ref_attention, _ref_quantize_into, _ref_quantize_rows)
