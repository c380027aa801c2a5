"""The kernels the benches time, behind one interface, and what is available here.

:class:`Kernels` holds six callables with the signatures of :mod:`fusion_pass.kernels.fa4.forward` and
:mod:`fusion_pass.kernels.launchers`:

* ``fused(q, k, v, *, cu_seqlens, max_seqlen, softmax_scale, causal, output, output_scale, output_block_scale,
  cu_seqlens_k=None, max_seqlen_k=None)``: attention written as NVFP4 into the caller's buffers, rows
  ``[cu_seqlens[0], cu_seqlens[B])`` only;
* ``attention(q, k, v, cu_seqlens, max_seqlen, *, causal, softmax_scale, cu_seqlens_k=None, max_seqlen_k=None)``:
  the same attention in q's dtype ``[T, H, Dv]``;
* ``quantize_into(x [M, K], global_scale, packed, scales)``: the project's quantizer into preallocated buffers;
* ``quantize_rows(x [M, K], global_scale, packed, scales, row_start)``: the row-range quantizer;
* ``fused_paged(q, k_cache, v_cache, *, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k,
  softmax_scale, causal, output, output_scale, output_block_scale)``: ``fused`` reading keys and values from a
  paged KV cache (``k_cache [num_pages, page_size, Hkv, D]``, ``v_cache [num_pages, page_size, Hkv, Dv]``,
  ``seqused_k`` int32 ``[B]`` keys per sequence, ``page_table`` int32 ``[B, max_pages]``: key ``j`` of sequence
  ``b`` is ``k_cache[page_table[b, j // page_size], j % page_size]``; causal aligned bottom-right);
* ``attention_paged(q, k_cache, v_cache, *, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k,
  softmax_scale, causal, return_lse=False)``: the same paged attention in q's dtype ``[T, H, Dv]``.

:func:`fa4_kernels` gives FlashAttention-4 with the project's NVFP4 epilogue (``fa4_attention_nvfp4_varlen``,
``fa4_attention_nvfp4_paged``), FA4's bf16 forwards (``fa4_attention_varlen``, ``fa4_attention_paged``) and the
Triton quantizer: the public names of ``fusion_pass.kernels.fa4`` and ``fusion_pass.kernels.launchers``,
whatever launcher or configuration sits behind them (an installed tree without the paged entry points gives
stand-ins that raise a clear error when called, so the varlen benches still run). :func:`reference_kernels`
gives PyTorch stand-ins with the same contract (the fused bytes are ``quantize(bf16 attention)``), so the
benches' logic runs on the CPU.
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
    fused_paged: Callable
    attention_paged: Callable


def fa4_status(device, dtype, heads: int, dqk: int, dv: int) -> tuple[bool, str]:
    """Whether FA4 with the NVFP4 epilogue runs a layer of these dims on ``device``: ``(ok, why)``."""
    try:
        from fusion_pass.kernels.fa4 import forward
    except ImportError as exc:  # pragma: no cover - the package itself imports without FA4
        return False, f"fusion_pass.kernels.fa4 does not import: {exc}"
    return forward.fa4_usable(torch.device(device), dtype, heads, dqk, dv)


def fa4_kernels() -> Kernels:
    """FA4 fused / FA4 bf16 / the project's quantizers (check :func:`fa4_status` per layout first)."""
    from fusion_pass.kernels.fa4 import forward
    from fusion_pass.kernels.fa4.forward import fa4_attention_nvfp4_varlen, fa4_attention_varlen

    def quantize_into(x, global_scale, packed, scales):
        launchers.quantize_into(x, global_scale, packed, scales, swizzled=True)

    return Kernels("fa4", fa4_attention_nvfp4_varlen, fa4_attention_varlen, quantize_into, launchers.quantize_rows,
                   _fa4_entry(forward, "fa4_attention_nvfp4_paged"), _fa4_entry(forward, "fa4_attention_paged"))


def _fa4_entry(forward, name: str) -> Callable:
    """``forward.<name>``, or a stand-in that raises when called (a tree without FA4's paged entry points)."""
    fn = getattr(forward, name, None)
    if fn is not None:
        return fn

    def missing(*args, **kwargs):
        raise RuntimeError(f"fusion_pass.kernels.fa4.forward has no {name} (the paged FA4 entry points are not in "
                           f"this tree): the paged variants cannot run on FA4 here")

    missing.__name__ = name
    return missing


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
    _write_fused(out, q.shape[0], q.shape[1] * v.shape[2], cu_seqlens, output, output_scale, output_block_scale)


def _ref_attention_paged(q, k_cache, v_cache, *, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k,
                         softmax_scale, causal, return_lse=False):
    """Float32 reference paged attention rounded to q's dtype, ``[T, H, Dv]`` (and float32 ``lse [T, H]`` with
    ``return_lse``)."""
    out, lse = reference.paged_attention(q, k_cache, v_cache, cu_seqlens, seqused_k, page_table, causal, softmax_scale)
    return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)


def _ref_fused_paged(q, k_cache, v_cache, *, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k,
                     softmax_scale, causal, output, output_scale, output_block_scale):
    """``quantize(_ref_attention_paged(...))`` into rows ``[cu_seqlens[0], cu_seqlens[B])`` of the buffers, as
    :func:`_ref_fused` (other rows untouched, scale padding zeroed)."""
    out = _ref_attention_paged(q, k_cache, v_cache, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, seqused_k=seqused_k,
                               page_table=page_table, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
                               causal=causal)
    _write_fused(out, q.shape[0], q.shape[1] * v_cache.shape[-1], cu_seqlens, output, output_scale,
                 output_block_scale)


def _write_fused(out, t, n, cu_seqlens, output, output_scale, output_block_scale):
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
    """PyTorch stand-ins on any device: float32 attention (varlen and paged) rounded to bf16, and the reference
    quantizer."""
    return Kernels("reference", _ref_fused, _ref_attention, _ref_quantize_into, _ref_quantize_rows, _ref_fused_paged,
                   _ref_attention_paged)
