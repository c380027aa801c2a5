"""The kernels' unvalidated calls, for the run-time backends' hot path.

The backends build every argument themselves (the attention op checked the user's), so nothing here
checks values or reads a device tensor back on the host: no synchronization on ``triton`` and ``fa4``.
Users call the validated entry points of :mod:`fusion_pass.kernels.api` instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusion_pass import nvfp4
from fusion_pass.kernels import reference
from fusion_pass.kernels.checks import check_cu_seqlens_k, check_max_seqlen_k, check_qkv, describe
from fusion_pass.kernels.choice import triton_importable
from fusion_pass.kernels.fa4.forward import (fa4_attention_nvfp4_paged, fa4_attention_nvfp4_varlen, fa4_attention_paged,
                                             fa4_attention_varlen)
from fusion_pass.fp8 import GROUP_SIZE, NaNRule
from fusion_pass.nvfp4 import ArgumentError
from fusion_pass.nvfp4.reference import write_rows

__all__ = [
    "fa4_attention_nvfp4_paged",
    "fa4_attention_paged",
    "ATTENTION_WITH_LSE",
    "MERGE_NVFP4_ROWS",
    "QUANTIZE_ROWS",
    "attention_with_lse_varlen",
    "fa4_attention_half_varlen",
    "fa4_attention_nvfp4_varlen",
    "fa4_attention_with_lse_varlen",
    "flash_attention_fp8_group_varlen",
    "flash_attention_fp8_static_varlen",
    "flash_attention_nvfp4_varlen",
    "merge_nvfp4_rows",
    "quantize_into",
    "quantize_rows",
    "reference_attention_with_lse_varlen",
    "reference_merge_nvfp4_rows",
    "reference_quantize_rows",
    "triton_attention_half_varlen",
    "triton_attention_with_lse_varlen",
    "triton_merge_nvfp4_rows",
    "triton_quantize_rows",
]

# One function per kernel family below; a fused backend (fusion_pass.runtime.backends) holds the ones it runs as
# callables. The tables map the kernel entry points' ``backend=`` names (fusion_pass.kernels.choice) to them.


def fa4_attention_half_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                              softmax_scale: float) -> Tensor:
    """Causal varlen attention in the query dtype ``[T, H, Dv]`` by FA4's forward: the unfused graph's attention
    of a pure-prefill batch on CUDA, with the main loop the fused FA4 kernel shares."""
    return fa4_attention_varlen(q, k, v, cu_seqlens, max_seqlen, causal=True, softmax_scale=softmax_scale)


def triton_attention_half_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                                 softmax_scale: float) -> Tensor:
    """:func:`fa4_attention_half_varlen` by the Triton flash attention (the fused Triton kernel's main loop)."""
    from fusion_pass.kernels.triton.flash_attention import flash_attention

    return flash_attention(q, k, v, cu_seqlens, max_seqlen, causal=True, softmax_scale=softmax_scale)


def triton_attention_with_lse_varlen(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Tensor, max_seqlen: int,
                                     cu_seqlens_k: Tensor | None, max_seqlen_k: int | None, softmax_scale: float,
                                     causal: bool) -> tuple[Tensor, Tensor]:
    """Partial attention for the chunked-context path by the Triton kernel: float32 ``out [T, H, Dv]`` and
    ``lse [T, H]``, arguments trusted (the backend built them), no host synchronization."""
    from fusion_pass.kernels.triton.flash_attention import flash_attention

    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]), dtype=torch.float32)
    lse = q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)
    flash_attention(q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=softmax_scale, out=out,
                    cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k, lse=lse)
    return out, lse


def fa4_attention_with_lse_varlen(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Tensor, max_seqlen: int,
                                  cu_seqlens_k: Tensor | None, max_seqlen_k: int | None, softmax_scale: float,
                                  causal: bool) -> tuple[Tensor, Tensor]:
    """:func:`triton_attention_with_lse_varlen` by FA4's forward (its output in q's dtype, returned as float32;
    its LSE a transposed view of its ``[H, T]`` buffer)."""
    out, lse = fa4_attention_varlen(q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=softmax_scale,
                                    cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k, return_lse=True)
    return out.float(), lse


def reference_attention_with_lse_varlen(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Tensor, max_seqlen: int,
                                        cu_seqlens_k: Tensor | None, max_seqlen_k: int | None,
                                        softmax_scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """:func:`triton_attention_with_lse_varlen` by the reference: float32 attention per sequence (reads
    ``cu_seqlens`` back)."""
    return reference.varlen_attention(q, k, v, cu_seqlens, causal, softmax_scale, cu_seqlens_k)


ATTENTION_WITH_LSE = {"triton": triton_attention_with_lse_varlen, "fa4": fa4_attention_with_lse_varlen,
                      "reference": reference_attention_with_lse_varlen}
"""The partial-attention kernels by the name of :func:`fusion_pass.kernels.attention_with_lse`'s ``backend``."""


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
    """:func:`fusion_pass.kernels.attention_with_lse`'s body: the kernel of :data:`ATTENTION_WITH_LSE` named
    ``backend`` (``triton``, ``fa4``, ``reference``, as the entry point chose it), arguments trusted."""
    return ATTENTION_WITH_LSE[backend](q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                       cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k,
                                       softmax_scale=softmax_scale, causal=causal)


def triton_merge_nvfp4_rows(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, global_scale: Tensor,
                            packed: Tensor, scales: Tensor, row_start: int) -> None:
    """:func:`fusion_pass.kernels.merge_attention_nvfp4` unvalidated, by the Triton launcher (no host
    synchronization)."""
    from fusion_pass.kernels.triton.merge import merge_attention_nvfp4_launch

    merge_attention_nvfp4_launch(out_a, lse_a, out_b, lse_b, global_scale, packed, scales, row_start)


def reference_merge_nvfp4_rows(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, global_scale: Tensor,
                               packed: Tensor, scales: Tensor, row_start: int) -> None:
    """:func:`triton_merge_nvfp4_rows` by the reference (any device)."""
    reference.merge_nvfp4(out_a, lse_a, out_b, lse_b, global_scale, packed, scales, row_start)


MERGE_NVFP4_ROWS = {"triton": triton_merge_nvfp4_rows, "reference": reference_merge_nvfp4_rows}
"""The NVFP4 merges by the name of :func:`fusion_pass.kernels.merge_attention_nvfp4`'s ``backend``."""


def merge_nvfp4_rows(backend: str, out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor,
                     global_scale: Tensor, packed: Tensor, scales: Tensor, row_start: int) -> None:
    """The merge of :data:`MERGE_NVFP4_ROWS` named ``backend`` (``triton`` or ``reference``), unvalidated."""
    MERGE_NVFP4_ROWS[backend](out_a, lse_a, out_b, lse_b, global_scale, packed, scales, row_start)


def quantize_into(x: Tensor, global_scale: Tensor, packed: Tensor, scales: Tensor, *, swizzled: bool = True) -> None:
    """:func:`fusion_pass.kernels.quantize` of ``x [M, K]`` into given buffers (every byte written, padding
    zero): the Triton launcher for CUDA tensors when Triton imports (no synchronization), the reference
    elsewhere. ``packed``: ``M * K/2`` bytes; ``scales``: the scale layout's bytes (any one-byte or int32 view).
    The body of the ``scaled_fp4_quant.out`` op and of the attention ops' unfused fallback."""
    if x.is_cuda and triton_importable():
        from fusion_pass.kernels.triton.quantize import quantize_launch

        quantize_launch(x, global_scale, swizzled=swizzled, packed=packed, scales=scales)
        return
    ref_packed, ref_scales = nvfp4.quantize(x, global_scale, swizzled=swizzled)
    packed.view(torch.uint8).view(ref_packed.shape).copy_(ref_packed)
    scales.view(torch.uint8).view(ref_scales.shape).copy_(ref_scales.view(torch.uint8))


def triton_quantize_rows(x: Tensor, global_scale: Tensor, packed: Tensor, scales: Tensor, row_start: int) -> None:
    """:func:`fusion_pass.kernels.quantize_rows_into` unvalidated, by the Triton launcher (the global scale is
    not read back: no synchronization)."""
    from fusion_pass.kernels.triton.quantize import quantize_rows_launch

    quantize_rows_launch(x, global_scale, packed, scales, row_start)


def reference_quantize_rows(x: Tensor, global_scale: Tensor, packed: Tensor, scales: Tensor,
                            row_start: int) -> None:
    """:func:`triton_quantize_rows` by the reference (any device)."""
    write_rows(x, global_scale, packed, scales, row_start)


QUANTIZE_ROWS = {"triton": triton_quantize_rows, "reference": reference_quantize_rows}
"""The row-range quantizers by the name of :func:`fusion_pass.kernels.quantize_rows_into`'s ``backend``."""


def quantize_rows(x: Tensor, global_scale: Tensor, packed: Tensor, scales: Tensor, row_start: int,
                  backend: str | None = None) -> None:
    """The row-range quantizer of :data:`QUANTIZE_ROWS` named ``backend``; ``None``: the Triton launcher for a
    CUDA tensor, else the reference."""
    if backend is None:
        kernel = triton_quantize_rows if x.is_cuda else reference_quantize_rows
    else:
        kernel = QUANTIZE_ROWS[backend]
    kernel(x, global_scale, packed, scales, row_start)


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
    """The ``triton`` fused backend's call (:class:`fusion_pass.runtime.backends.triton.TritonBackend`).

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
    from fusion_pass.kernels.triton.flash_attention import flash_attention_nvfp4

    _check_varlen("flash_attention_nvfp4_varlen", q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen_k, nvfp4.BLOCK_SIZE)
    flash_attention_nvfp4(
        q, k, v, cu_seqlens, max_seqlen, output_scale, causal=causal, softmax_scale=softmax_scale,
        packed=output.view(torch.uint8), scales=output_block_scale, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_k=max_seqlen_k,
    )


def _check_cu_seqlens(fn: str, q: Tensor, cu_seqlens) -> None:
    if (
        not isinstance(cu_seqlens, Tensor)
        or cu_seqlens.dtype != torch.int32
        or cu_seqlens.dim() != 1
        or cu_seqlens.numel() < 2
        or cu_seqlens.device != q.device
        or not cu_seqlens.is_contiguous()
    ):
        raise ArgumentError(
            f"{fn}: cu_seqlens must be contiguous int32 [B + 1 >= 2] on {q.device}, got {describe(cu_seqlens)}"
        )


def _check_varlen(fn: str, q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen_k, dv_multiple: int) -> None:
    """Shapes, dtypes and devices of a fused varlen call (values are not read: no synchronization), ``Dv`` a
    multiple of ``dv_multiple`` (the output format's per-head tile)."""
    check_qkv(fn, q, k, v, separate_kv=cu_seqlens_k is not None)
    if v.shape[2] % dv_multiple != 0:
        raise ArgumentError(f"{fn}: v's head dim must be divisible by {dv_multiple}, got {v.shape[2]}")
    _check_cu_seqlens(fn, q, cu_seqlens)
    if cu_seqlens_k is not None:
        check_cu_seqlens_k(fn, cu_seqlens_k, cu_seqlens, q.device)
    check_max_seqlen_k(fn, max_seqlen_k, cu_seqlens_k)


def flash_attention_fp8_static_varlen(
    q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Tensor, max_seqlen: int, softmax_scale: float, causal: bool,
    output: Tensor, scale: Tensor, scale_is_inverse: bool = False, nan=NaNRule.POSITIVE_MAX,
    cu_seqlens_k: Tensor | None = None, max_seqlen_k: int | None = None,
) -> None:
    """:func:`flash_attention_nvfp4_varlen` written as static per-tensor FP8 into ``output`` (float8_e4m3fn
    ``[T, H*Dv]``): :func:`fusion_pass.kernels.triton.flash_attention.flash_attention_fp8_static` (``scale`` the
    checkpoint's scale, or with ``scale_is_inverse`` the graph's reciprocal; ``nan`` a
    :class:`fusion_pass.fp8.NaNRule`). Only shapes are checked (no device synchronization)."""
    from fusion_pass.kernels.triton.flash_attention import flash_attention_fp8_static

    _check_varlen("flash_attention_fp8_static_varlen", q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen_k, 1)
    flash_attention_fp8_static(q, k, v, cu_seqlens, max_seqlen, scale, scale_is_inverse=scale_is_inverse, nan=nan,
                               causal=causal, softmax_scale=softmax_scale, output=output, cu_seqlens_k=cu_seqlens_k,
                               max_seqlen_k=max_seqlen_k)


def flash_attention_fp8_group_varlen(
    q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Tensor, max_seqlen: int, softmax_scale: float, causal: bool,
    output: Tensor, output_scales: Tensor, ue8m0: bool = False, divide: bool = False,
    cu_seqlens_k: Tensor | None = None, max_seqlen_k: int | None = None,
) -> None:
    """:func:`flash_attention_fp8_static_varlen` with one dynamic scale per row and 128 columns (``Dv % 128 ==
    0``): :func:`fusion_pass.kernels.triton.flash_attention.flash_attention_fp8_group` into ``output`` and
    ``output_scales`` (float32 ``[T, H*Dv/128]`` in any :class:`fusion_pass.fp8.ScaleLayout`)."""
    from fusion_pass.kernels.triton.flash_attention import flash_attention_fp8_group

    _check_varlen("flash_attention_fp8_group_varlen", q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen_k, GROUP_SIZE)
    flash_attention_fp8_group(q, k, v, cu_seqlens, max_seqlen, ue8m0=ue8m0, divide=divide, causal=causal,
                              softmax_scale=softmax_scale, output=output, scales=output_scales,
                              cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)


# ---------------------------------------------------------------------------
# attention over a paged KV cache: the fused backends' calls (unvalidated values, shapes checked)
# ---------------------------------------------------------------------------

from fusion_pass.kernels.checks import zero_nvfp4_scale_padding  # noqa: E402
from fusion_pass.nvfp4.checks import check_int  # noqa: E402

__all__ += ["flash_attention_fp8_group_paged", "flash_attention_fp8_static_paged", "flash_attention_nvfp4_paged",
            "reference_nvfp4_paged"]


def _check_paged(fn: str, q, k_cache, v_cache, cu_seqlens, seqused_k, page_table, max_seqlen_k,
                 dv_multiple: int = nvfp4.BLOCK_SIZE) -> None:
    """Shapes, dtypes, devices and layouts of a paged call (values are not read: no synchronization):
    ``q [T, H, D]``, ``k_cache [P, S, Hkv, D]``, ``v_cache [P, S, Hkv, Dv]`` (one half dtype, one device, unit
    stride along the last dim, ``H % Hkv == 0``, ``Dv % dv_multiple == 0``), ``cu_seqlens`` contiguous int32
    ``[B + 1 >= 2]``, ``seqused_k`` contiguous int32 ``[B]``, ``page_table`` int32 ``[B, max_pages]`` with unit
    stride along its last dim, ``max_seqlen_k`` a non-negative int."""
    layouts = {"q": "[T, H, D]", "k_cache": "[num_pages, page_size, Hkv, D]",
               "v_cache": "[num_pages, page_size, Hkv, Dv]"}
    for name, t, dims in (("q", q, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4)):
        if not isinstance(t, Tensor) or t.dim() != dims:
            raise ArgumentError(f"{fn}: {name} must be a {dims}-D tensor {layouts[name]}, got {describe(t)}")
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise ArgumentError(f"{fn}: {name} must be float16 or bfloat16, got {t.dtype}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ArgumentError(f"{fn}: {name} must have unit stride along its last (head) dim, got strides "
                                f"{t.stride()}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ArgumentError(f"{fn}: q, k_cache, v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, "
                            f"{v_cache.dtype}")
    if not (q.device == k_cache.device == v_cache.device):
        raise ArgumentError(f"{fn}: q, k_cache, v_cache must be on one device, got {q.device}, {k_cache.device}, "
                            f"{v_cache.device}")
    t, h, d = q.shape
    num_pages, page_size, hkv, dk = k_cache.shape
    if dk != d:
        raise ArgumentError(f"{fn}: k_cache must be {layouts['k_cache']} with q's D={d}, got {list(k_cache.shape)}")
    if tuple(v_cache.shape[:3]) != (num_pages, page_size, hkv):
        raise ArgumentError(f"{fn}: v_cache must be [num_pages, page_size, Hkv, Dv] = [{num_pages}, {page_size}, "
                            f"{hkv}, Dv] like k_cache, got {list(v_cache.shape)}")
    if page_size < 1:
        raise ArgumentError(f"{fn}: the caches' page_size must be at least 1, got {list(k_cache.shape)}")
    if hkv == 0 or h % hkv != 0:
        raise ArgumentError(f"{fn}: q's heads H={h} must be a multiple of the caches' heads Hkv={hkv}")
    if v_cache.shape[3] % dv_multiple != 0:
        raise ArgumentError(f"{fn}: v_cache's head dim must be divisible by {dv_multiple}, got {v_cache.shape[3]}")
    _check_cu_seqlens(fn, q, cu_seqlens)
    b = cu_seqlens.numel() - 1
    if (
        not isinstance(seqused_k, Tensor)
        or seqused_k.dtype != torch.int32
        or tuple(seqused_k.shape) != (b,)
        or seqused_k.device != q.device
        or not seqused_k.is_contiguous()
    ):
        raise ArgumentError(f"{fn}: seqused_k must be contiguous int32 [B = {b}] on {q.device}, got "
                            f"{describe(seqused_k)}")
    if (
        not isinstance(page_table, Tensor)
        or page_table.dtype != torch.int32
        or page_table.dim() != 2
        or page_table.shape[0] != b
        or page_table.device != q.device
        or (page_table.shape[1] > 1 and page_table.stride(1) != 1)
    ):
        raise ArgumentError(f"{fn}: page_table must be int32 [B = {b}, max_pages_per_seq] on {q.device} with unit "
                            f"stride along its last dim, got {describe(page_table)}")
    check_int(f"{fn}: max_seqlen_k", max_seqlen_k, minimum=0, expected="a non-negative int")


def flash_attention_nvfp4_paged(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    cu_seqlens: Tensor,
    max_seqlen: int,
    seqused_k: Tensor,
    page_table: Tensor,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    output: Tensor,
    output_scale: Tensor,
    output_block_scale: Tensor,
) -> None:
    """The ``triton`` fused backend's call over a paged KV cache (decode rows, prefills with or without cached
    context, mixed, in one launch): :func:`fusion_pass.kernels.triton.paged.flash_attention_nvfp4_paged`.

    Buffers as :func:`flash_attention_nvfp4_varlen` (``output`` uint8 ``[T, H*Dv/2]``, ``output_scale`` the
    global scale, ``output_block_scale`` the swizzled scale buffer in any one-byte or int32 view). Sequence
    ``b``'s queries are rows ``[cu_seqlens[b], cu_seqlens[b+1])`` of ``q`` and of the output (other rows keep
    their bytes; the scale padding is zeroed); its ``seqused_k[b]`` keys are read through row ``b`` of
    ``page_table`` from ``k_cache [num_pages, page_size, Hkv, D]`` / ``v_cache [num_pages, page_size, Hkv, Dv]``
    (any strides but the last), causal bottom-right aligned. Only shapes are checked (no device
    synchronization): the values come from the backend.
    """
    from fusion_pass.kernels.triton.paged import flash_attention_nvfp4_paged as launch

    _check_paged("flash_attention_nvfp4_paged", q, k_cache, v_cache, cu_seqlens, seqused_k, page_table,
                 max_seqlen_k)
    launch(q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k, output_scale,
           causal=causal, softmax_scale=softmax_scale, packed=output.view(torch.uint8), scales=output_block_scale)


def reference_nvfp4_paged(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    cu_seqlens: Tensor,
    max_seqlen: int,
    seqused_k: Tensor,
    page_table: Tensor,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    output: Tensor,
    output_scale: Tensor,
    output_block_scale: Tensor,
) -> None:
    """:func:`flash_attention_nvfp4_paged` by the reference (any device): float32
    :func:`fusion_pass.kernels.reference.paged_attention`, quantized by the reference quantizer into rows
    ``[cu_seqlens[0], cu_seqlens[B])`` (:func:`quantize_rows`); other rows keep their bytes, the scale padding is
    zeroed. Reads ``cu_seqlens``, ``seqused_k`` and ``page_table`` back (a synchronization on CUDA)."""
    _check_paged("reference_nvfp4_paged", q, k_cache, v_cache, cu_seqlens, seqused_k, page_table, max_seqlen_k)
    out, _ = reference.paged_attention(q, k_cache, v_cache, cu_seqlens, seqused_k, page_table, causal,
                                       softmax_scale)
    t, h, dv = out.shape
    zero_nvfp4_scale_padding(output_block_scale.view(torch.uint8).view(-1), t, h * dv)
    first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
    quantize_rows(out[first:last].reshape(last - first, h * dv), output_scale,
                  output.view(torch.uint8).view(t, h * dv // 2), output_block_scale, first, backend="reference")


def flash_attention_fp8_static_paged(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, *, cu_seqlens: Tensor, max_seqlen: int, seqused_k: Tensor,
    page_table: Tensor, max_seqlen_k: int, softmax_scale: float, causal: bool, output: Tensor, scale: Tensor,
    scale_is_inverse: bool = False, nan=NaNRule.POSITIVE_MAX,
) -> None:
    """:func:`flash_attention_nvfp4_paged` written as static per-tensor FP8 into ``output`` (float8_e4m3fn
    ``[T, H*Dv]``; ``scale``, ``scale_is_inverse``, ``nan`` as :func:`flash_attention_fp8_static_varlen`):
    :func:`fusion_pass.kernels.triton.paged.flash_attention_fp8_static_paged`. Only shapes are checked."""
    from fusion_pass.kernels.triton.paged import flash_attention_fp8_static_paged as launch

    _check_paged("flash_attention_fp8_static_paged", q, k_cache, v_cache, cu_seqlens, seqused_k, page_table,
                 max_seqlen_k, dv_multiple=1)
    launch(q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k, scale,
           scale_is_inverse=scale_is_inverse, nan=nan, causal=causal, softmax_scale=softmax_scale, output=output)


def flash_attention_fp8_group_paged(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, *, cu_seqlens: Tensor, max_seqlen: int, seqused_k: Tensor,
    page_table: Tensor, max_seqlen_k: int, softmax_scale: float, causal: bool, output: Tensor,
    output_scales: Tensor, ue8m0: bool = False, divide: bool = False,
) -> None:
    """:func:`flash_attention_fp8_static_paged` with one dynamic scale per row and 128 columns (``Dv % 128 ==
    0``; ``output_scales`` float32 ``[T, H*Dv/128]`` in any :class:`fusion_pass.fp8.ScaleLayout`):
    :func:`fusion_pass.kernels.triton.paged.flash_attention_fp8_group_paged`. Only shapes are checked."""
    from fusion_pass.kernels.triton.paged import flash_attention_fp8_group_paged as launch

    _check_paged("flash_attention_fp8_group_paged", q, k_cache, v_cache, cu_seqlens, seqused_k, page_table,
                 max_seqlen_k, dv_multiple=GROUP_SIZE)
    launch(q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k, ue8m0=ue8m0,
           divide=divide, causal=causal, softmax_scale=softmax_scale, output=output, scales=output_scales)
