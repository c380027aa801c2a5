"""Merge two partial attention results and write the union directly as NVFP4 (an NVFP4 ``merge_attn_states``).

Chunked prefill over a long cached context computes attention in parts over
disjoint key sets, each giving a normalised partial output and its log-sum-exp;
the final merge writes the o_proj GEMM's NVFP4 input directly.

Shapes, dtypes and layouts:

* ``out_a``, ``out_b``: ``[M, H, Dv]`` float32, bfloat16 or float16 (the two may
  differ), unit stride along ``Dv``, any other strides.
* ``lse_a``, ``lse_b``: float32 ``[M, H]``, natural-log LSE, any strides (a
  transposed ``[H, M]`` buffer, FlashAttention's layout, is read in place).
  ``-inf`` marks a part that saw no key: its output is not read (0 or garbage,
  NaN included, is ignored).
* ``global_scale``: float32, one element, on the outputs' device.
* ``packed``: contiguous uint8 ``[T, H*Dv/2]``; ``scales``: the contiguous 128x4
  swizzled scale buffer of ``T`` rows (int32 ``[round_up(T, 128), round_up(H*Dv/16, 4) / 4]``
  or uint8 / float8_e4m3fn ``[round_up(T, 128), round_up(H*Dv/16, 4)]``).
  Row ``i`` of the merge lands in row ``row_start + i``; element ``(h, d)`` is
  column ``h*Dv + d`` (``NVFP4.md``).

Per row and head, in float32 (the formula of :func:`fusion_pass.dense.merge_attention`)::

    m = max(lse_a, lse_b)                   (0 where both are -inf)
    w_a = exp(lse_a - m),  w_b = exp(lse_b - m)
    merged = (w_a * out_a + w_b * out_b) / (w_a + w_b)

then NVFP4 quantization of ``merged`` with ``global_scale`` (``NVFP4.md``). A part
with ``lse = -inf`` contributes ``+0``, so a row-head where both are ``-inf`` is
``+0``: packed bytes ``0x00`` and scale ``0`` when its whole block is such. NaN and
infinity in the outputs as the quantizer's (docs/nvfp4.md "NaN and infinity"); an
LSE of NaN or ``+inf`` makes that row-head NaN.

Only the packed bytes and the scale bytes of rows ``[row_start, row_start + M)``
are written (their padding scale columns as zero); the padding rows
``T .. round_up(T, 128)`` are left to :func:`fusion_pass.nvfp4.zero_scale_padding`.

Backends (``backend=``):

``reference``
    float32 PyTorch on any device: :func:`fusion_pass.dense.merge_attention` (the
    outputs of ``-inf`` parts ignored), then
    :func:`fusion_pass.nvfp4.quantize_rows_into`; the contract's bytes. (torch's
    ``exp`` itself differs in the last bit between CPU and CUDA, so the reference's
    bytes on the two devices can differ in the same rare places as ``triton``'s.)
``triton``
    one Triton launch (CUDA tensors, or CPU tensors under Triton's interpreter);
    needs ``Dv % 16 == 0``. It computes ``exp`` with its own implementation and
    multiplies by ``1 / (w_a + w_b)`` computed once per row-head, so ``merged``
    may differ from the reference's by a few ulps when both parts carry weight;
    bytes then differ only where a value lies that close to a rounding threshold
    of the format. A merge where one part is empty or the two LSEs are equal is
    exact (weights 1 and 0, or 1 and 1), and so are its bytes.
``auto``
    ``triton`` for CUDA tensors when Triton imports and ``Dv % 16 == 0``, else
    ``reference``.

:func:`merge_attention_nvfp4` checks every argument before writing;
:func:`merge_attention_nvfp4_launch` is the unchecked Triton launcher for the hot
path (no host synchronization). This module imports without Triton (the
``reference`` backend needs only torch).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusion_pass import nvfp4
from fusion_pass.dense import merge_attention
from fusion_pass.kernels.checks import describe

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

__all__ = ["MERGE_BACKENDS", "MERGE_CONFIG", "merge_attention_nvfp4", "merge_attention_nvfp4_launch"]

MERGE_BACKENDS = ("auto", "triton", "reference")
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

MERGE_CONFIG = {"BLOCK_M": 8, "BLOCK_K": 512, "num_warps": 4}
"""Tile of one program (rows x columns of ``[M, H*Dv]``) and its warps. On the H200 (bf16
``[16384, 128, 128]`` parts, 11 tiles tried) it merged in 0.375 ms, 3.31 TB/s of its bytes
(outputs and LSEs read, packed and scales written) against a 4.14 TB/s copy; the
quantizer's 16x512 tile took 0.400 ms."""


# ---------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------

if triton is not None:
    from fusion_pass.kernels.nvfp4_tl import load_pairs, quantize_pairs, swizzled_scale_offset

    @triton.jit
    def _merge_weights(lse_a, lse_b):
        """Per-block weights ``(w_a, w_b, 1 / (w_a + w_b))`` from the two LSEs, float32 ``[N]``.

        Both ``-inf``: weights 0 and reciprocal 1 (the reference divides by 1 there).
        A NaN or ``+inf`` LSE makes its own weight ``exp(NaN)`` whatever ``tl.maximum``
        does with NaN, and the merged values NaN.
        """
        top = tl.maximum(lse_a, lse_b)
        top = tl.where(top == float("-inf"), 0.0, top)
        w_a = tl.exp(lse_a - top)
        w_b = tl.exp(lse_b - top)
        total = w_a + w_b
        ones = tl.full(total.shape, 1.0, tl.float32)
        return w_a, w_b, tl.math.div_rn(ones, tl.where(total > 0.0, total, ones))

    @triton.jit
    def _merge_kernel(
        out_a_ptr,
        out_b_ptr,
        lse_a_ptr,
        lse_b_ptr,
        global_scale_ptr,
        packed_ptr,
        scales_ptr,
        stride_am,  # strides of out_a / out_b in units of STRIDE_UNIT element pairs
        stride_ah,
        stride_bm,
        stride_bh,
        lse_stride_am,
        lse_stride_ah,
        lse_stride_bm,
        lse_stride_bh,
        row_start,
        M,
        K,  # H * Dv
        scale_col_tiles,  # round_up(K/16, 4) / 4
        HEAD_BLOCKS: tl.constexpr,  # Dv / 16
        STRIDE_UNIT: tl.constexpr,  # 8 (strides given in 16-element blocks) or 1 (in pairs)
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """One program merges rows ``[pid_m * BLOCK_M, +BLOCK_M)`` x columns
        ``[pid_k * BLOCK_K, +BLOCK_K)`` of ``[M, H*Dv]``, as ``BLOCK_M * BLOCK_K / 16``
        blocks of 8 element pairs (block columns fastest, so neighbouring blocks are
        neighbouring memory), and writes row ``r`` to row ``row_start + r``. Each block
        lies in one head (``Dv % 16 == 0``), so it reads one LSE of each part. Blocks
        past ``K/16`` (the scale buffer's padding columns) read nothing and write a zero
        scale; blocks past ``M`` write nothing. Strides in 16-element blocks
        (``STRIDE_UNIT = 8``) and the packed row length as ``K/16 * 8`` show the compiler
        that every block starts 8 pairs aligned, for wide loads and stores."""
        BLOCKS: tl.constexpr = BLOCK_K // 16
        blocks = tl.arange(0, BLOCK_M * BLOCKS)
        rows = tl.program_id(0) * BLOCK_M + blocks // BLOCKS
        block_cols = tl.program_id(1) * BLOCKS + blocks % BLOCKS
        in_rows = rows < M
        in_data = in_rows & (block_cols < K // 16)
        rows64 = rows.to(tl.int64)
        heads = (block_cols // HEAD_BLOCKS).to(tl.int64)
        pairs = (block_cols % HEAD_BLOCKS)[:, None] * 8 + tl.arange(0, 8)[None, :]

        lse_a = tl.load(lse_a_ptr + rows64 * lse_stride_am + heads * lse_stride_ah, mask=in_data, other=float("-inf"))
        lse_b = tl.load(lse_b_ptr + rows64 * lse_stride_bm + heads * lse_stride_bh, mask=in_data, other=float("-inf"))
        w_a, w_b, inv_total = _merge_weights(lse_a, lse_b)
        a_even, a_odd = load_pairs(
            out_a_ptr, ((rows64 * stride_am + heads * stride_ah) * STRIDE_UNIT)[:, None] + pairs,
            (in_data & (lse_a != float("-inf")))[:, None],
        )
        b_even, b_odd = load_pairs(
            out_b_ptr, ((rows64 * stride_bm + heads * stride_bh) * STRIDE_UNIT)[:, None] + pairs,
            (in_data & (lse_b != float("-inf")))[:, None],
        )
        w_a, w_b, inv_total = w_a[:, None], w_b[:, None], inv_total[:, None]
        even = (a_even * w_a + b_even * w_b) * inv_total
        odd = (a_odd * w_a + b_odd * w_b) * inv_total

        packed, sf = quantize_pairs(even, odd, tl.load(global_scale_ptr))

        out_rows = rows64 + row_start
        packed_offsets = (out_rows[:, None] * (K // 16) + block_cols[:, None]) * 8 + tl.arange(0, 8)[None, :]
        tl.store(packed_ptr + packed_offsets, packed, mask=in_data[:, None])
        scale_offsets = swizzled_scale_offset(out_rows, block_cols, scale_col_tiles)
        tl.store(scales_ptr + scale_offsets, sf, mask=in_rows & (block_cols < scale_col_tiles * 4))


def _pair_aligned(out: Tensor) -> Tensor:
    """``out`` itself, or a fresh contiguous copy when it cannot be read in element pairs
    (even strides and a base aligned to two elements needed)."""
    misaligned = out.stride(0) % 2 or out.stride(1) % 2 or out.data_ptr() % (2 * out.element_size())
    return out.clone(memory_format=torch.contiguous_format) if misaligned else out


def _strides(out_a: Tensor, out_b: Tensor) -> tuple[list[int], int]:
    """The outputs' row and head strides for the kernel, and their unit in element pairs:
    16-element blocks (unit 8) when every stride is a multiple of 16, else pairs (unit 1)."""
    strides = [out_a.stride(0), out_a.stride(1), out_b.stride(0), out_b.stride(1)]
    block = nvfp4.BLOCK_SIZE
    if all(s % block == 0 for s in strides):
        return [s // block for s in strides], block // 2
    return [s // 2 for s in strides], 1


def merge_attention_nvfp4_launch(
    out_a: Tensor,
    lse_a: Tensor,
    out_b: Tensor,
    lse_b: Tensor,
    global_scale: Tensor,
    packed: Tensor,
    scales: Tensor,
    row_start: int,
    *,
    config: dict | None = None,
) -> None:
    """The Triton merge, one launch, arguments not validated and no host synchronization.

    Arguments as :func:`merge_attention_nvfp4` (the caller has checked them), with
    ``Dv % 16 == 0``. Outputs whose strides are odd or whose base is not aligned to
    two elements are copied first. ``config`` overrides :data:`MERGE_CONFIG` (tuning).
    """
    m, h, dv = out_a.shape
    k = h * dv
    if m == 0 or k == 0:
        return
    out_a, out_b = _pair_aligned(out_a), _pair_aligned(out_b)
    config = config or MERGE_CONFIG
    block_m, block_k = config["BLOCK_M"], config["BLOCK_K"]
    cols = nvfp4.round_up(k // nvfp4.BLOCK_SIZE, 4)
    grid = (triton.cdiv(m, block_m), triton.cdiv(cols * nvfp4.BLOCK_SIZE, block_k))
    strides, unit = _strides(out_a, out_b)
    _merge_kernel[grid](
        out_a, out_b, lse_a, lse_b, global_scale, packed, scales.view(torch.uint8),
        *strides, lse_a.stride(0), lse_a.stride(1), lse_b.stride(0), lse_b.stride(1),
        int(row_start), m, k, cols // 4,
        HEAD_BLOCKS=dv // nvfp4.BLOCK_SIZE, STRIDE_UNIT=unit, BLOCK_M=block_m, BLOCK_K=block_k,
        num_warps=config["num_warps"],
        enable_fp_fusion=False,  # the reference's separately rounded products and sum
    )


# ---------------------------------------------------------------------------
# reference backend
# ---------------------------------------------------------------------------


def _merge_reference(out_a, lse_a, out_b, lse_b, global_scale, packed, scales, row_start) -> None:
    """float32 :func:`~fusion_pass.dense.merge_attention` (empty parts ignored),
    then :func:`~fusion_pass.nvfp4.quantize_rows_into`'s body."""
    m, h, dv = out_a.shape
    if m == 0 or h * dv == 0:
        return
    merged, _ = merge_attention(out_a, lse_a, out_b, lse_b)
    nvfp4._write_rows(merged.reshape(m, h * dv), global_scale, packed, scales, row_start)


# ---------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------


def _check_outs(fn: str, out_a, out_b) -> None:
    for name, out in (("out_a", out_a), ("out_b", out_b)):
        nvfp4._check_tensor(fn, name, out)
        if out.dim() != 3:
            raise ValueError(f"{fn}: {name} must be a 3-D tensor [M, H, Dv], got {describe(out)}")
        if out.dtype not in OUT_DTYPES:
            raise TypeError(f"{fn}: {name} must be float32, bfloat16 or float16, got {out.dtype}")
        if out.shape[2] > 1 and out.stride(2) != 1:
            raise ValueError(f"{fn}: {name} must have unit stride along Dv, got strides {list(out.stride())}")
    if out_b.shape != out_a.shape:
        raise ValueError(
            f"{fn}: out_b must have out_a's shape [M, H, Dv] = {list(out_a.shape)}, got {list(out_b.shape)}"
        )
    if out_b.device != out_a.device:
        raise ValueError(f"{fn}: out_b must be on out_a's device {out_a.device}, got {out_b.device}")
    m, h, dv = out_a.shape
    if (h * dv) % nvfp4.BLOCK_SIZE != 0:
        raise ValueError(f"{fn}: H * Dv must be divisible by 16, got out_a [M, H, Dv] = {list(out_a.shape)}")


def _check_lses(fn: str, lse_a, lse_b, out_a: Tensor) -> None:
    m, h, _ = out_a.shape
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        nvfp4._check_tensor(fn, name, lse)
        if lse.dtype != torch.float32:
            raise TypeError(f"{fn}: {name} must be float32, got {lse.dtype}")
        if tuple(lse.shape) != (m, h):
            raise ValueError(
                f"{fn}: {name} must be [M, H] = [{m}, {h}] (any strides: a transposed [H, M] "
                f"view is fine), got {list(lse.shape)}"
            )
        if lse.device != out_a.device:
            raise ValueError(f"{fn}: {name} must be on out_a's device {out_a.device}, got {lse.device}")


def _check_destination(fn: str, packed, scales, row_start, out_a: Tensor) -> None:
    m, h, dv = out_a.shape
    nvfp4._check_row_range(fn, packed, scales, row_start, m, h * dv, out_a.device, source="out_a", width="H*Dv")


def _choose(fn: str, backend, out_a: Tensor) -> str:
    """The backend that runs this call; raises with the reason when the named one cannot."""
    from fusion_pass.kernels import _triton_or_reference  # the package imports this module

    dv_ok = out_a.shape[2] % nvfp4.BLOCK_SIZE == 0
    chosen = _triton_or_reference(fn, backend, out_a.device, fits=dv_ok)
    if chosen == "triton" and not dv_ok:
        raise ValueError(f"{fn}: backend 'triton' needs Dv divisible by 16, got out_a {list(out_a.shape)}")
    return chosen


# ---------------------------------------------------------------------------
# public entry point
# ---------------------------------------------------------------------------


def merge_attention_nvfp4(
    out_a: Tensor,
    lse_a: Tensor,
    out_b: Tensor,
    lse_b: Tensor,
    global_scale: Tensor,
    packed: Tensor,
    scales: Tensor,
    row_start: int,
    *,
    backend: str = "auto",
) -> None:
    """Merge two partial attention results and write them as NVFP4 into rows
    ``[row_start, row_start + M)`` of a ``T``-row buffer pair.

    Args:
        out_a, out_b: ``[M, H, Dv]`` float32 / bfloat16 / float16 (may differ), unit
            stride along ``Dv``, ``H * Dv % 16 == 0``, one device.
        lse_a, lse_b: float32 ``[M, H]``, any strides, natural-log LSE of each part;
            ``-inf``: the part saw no key and its output is ignored.
        global_scale: float32 tensor with one positive finite element, on that device.
        packed: contiguous uint8 ``[T, H*Dv/2]``.
        scales: contiguous 128x4 swizzled scale buffer of ``T`` rows: int32
            ``[round_up(T, 128), round_up(H*Dv/16, 4) / 4]`` or uint8 / float8_e4m3fn
            ``[round_up(T, 128), round_up(H*Dv/16, 4)]``.
        row_start: an int with ``0 <= row_start`` and ``row_start + M <= T``.
        backend: ``auto``, ``triton`` or ``reference`` (module docstring).

    Writes the packed bytes and scale bytes of those rows only (padding scale
    columns as zero); no other byte, no padding row. Rows where both LSEs are
    ``-inf`` are written as ``+0``.

    Raises (before anything is written):
        TypeError: a non-tensor argument, an output dtype other than float32 /
            bfloat16 / float16, a non-float32 LSE or global scale, a non-int ``row_start``.
        ValueError: an unknown backend, a wrong shape, stride, layout or device,
            ``H * Dv % 16 != 0`` (or ``Dv % 16 != 0`` for ``triton``), a global scale
            that is not one positive finite value, a row range outside ``[0, T)``.
        RuntimeError: ``backend="triton"`` without Triton, or on CPU tensors outside
            Triton's interpreter.
    """
    from fusion_pass.kernels import _check_backend_name  # the package imports this module

    fn = "merge_attention_nvfp4"
    _check_backend_name(fn, backend, MERGE_BACKENDS)
    _check_outs(fn, out_a, out_b)
    _check_lses(fn, lse_a, lse_b, out_a)
    nvfp4._check_global_scale(fn, global_scale, out_a.device)
    _check_destination(fn, packed, scales, row_start, out_a)
    if _choose(fn, backend, out_a) == "triton":
        merge_attention_nvfp4_launch(out_a, lse_a, out_b, lse_b, global_scale, packed, scales, row_start)
    else:
        _merge_reference(out_a, lse_a, out_b, lse_b, global_scale, packed, scales, row_start)
