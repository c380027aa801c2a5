"""The reference NVFP4 quantizer and dequantizer: the project's numeric oracle (docs/nvfp4.md).

Plain PyTorch on any device (also under ``FakeTensorMode``, on the meta device and under torch.compile,
where value checks of the global scale are skipped). Kernels that write NVFP4 (``fusion_pass.kernels``)
are compared to these bytes.

* :func:`quantize`: ``x [..., K]`` -> packed e2m1 codes and e4m3 block scales;
* :func:`quantize_rows_into`: the same bytes for ``M`` rows, written at a row offset of a ``T``-row buffer
  pair, touching no other byte; :func:`zero_scale_padding` clears the padding rows once all rows are written;
* :func:`dequantize`: the inverse, ``code value * scale / global scale``.
"""

from __future__ import annotations

import math
import numbers

import torch

from fusion_pass.nvfp4.checks import (
    ArgumentError,
    check_global_scale,
    check_rows_into,
    check_swizzled_buffer,
    check_x,
    is_int,
)
from fusion_pass.nvfp4.codes import codes_to_values, e2m1_encode, unpack_codes
from fusion_pass.nvfp4.layout import (
    BLOCK_SIZE,
    E4M3_MAX,
    E4M3_NAN_BYTE,
    FP8,
    SWIZZLE_COLS,
    SWIZZLE_ROWS,
    round_up,
    row_scale_offsets,
    swizzle_scales,
    unswizzle_scales,
)


def const(like: torch.Tensor, value: float) -> torch.Tensor:
    """``value`` as a 0-d float32 tensor on ``like``'s device.

    Dividing by a Python number is not IEEE division on every backend: eager
    CUDA multiplies by its reciprocal instead, which moves the last bit. Dividing
    by a same-device tensor keeps the reference identical on all devices.
    """
    return like.new_full((), value, dtype=torch.float32)


def split_blocks(x: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` -> float32 ``[M, K/16, 16]``; leading dims flattened into M."""
    k = x.shape[-1]
    m = math.prod(x.shape[:-1])
    return x.reshape(m, k // BLOCK_SIZE, BLOCK_SIZE).float()


def quantize(
    x: torch.Tensor, global_scale: torch.Tensor, *, swizzled: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to NVFP4 in plain PyTorch (any device): the project's oracle.

    Args:
        x: float16 / bfloat16 / float32 ``[..., K]`` with ``K % 16 == 0``; the
            leading dims are flattened into ``M`` rows.
        global_scale: float32 tensor with exactly one positive finite element, at
            most :data:`~fusion_pass.nvfp4.layout.GLOBAL_SCALE_MAX`, on ``x``'s device.
        swizzled: scale layout, 128x4 swizzled (default) or linear.

    Returns:
        ``(packed, scales)``: ``packed`` is uint8 ``[M, K/2]``, byte ``j`` of a
        row holding element ``2j`` in bits 0-3 and ``2j+1`` in bits 4-7.
        ``scales`` is float8_e4m3fn of shape ``scale_shape(M, K, swizzled=...)``,
        padding entries zero.

    Per 16-element block: ``amax`` in float32,
    ``sf = e4m3(min(gs * amax / 6, 448))`` (round to nearest even),
    ``inv = gs / float(sf)`` (0 if ``sf == 0``), codes = e2m1 of ``x * inv``.

    NaN and infinity (docs/nvfp4.md, "NaN and infinity"): a block holding a NaN
    gets the scale byte ``0x7F`` (e4m3fn NaN) and 16 codes 0 (packed bytes
    ``0x00``), so it dequantizes to NaN. Otherwise ``±Inf`` makes ``amax`` infinite:
    the scale saturates at 448 (byte ``0x7E``), ``±Inf`` encode as ``±6`` (codes
    ``0x7`` / ``0xF``) and the block's finite elements are quantized against 448.
    """
    check_x("quantize", x, global_scale)
    blocks = split_blocks(x)  # [M, nb, 16]
    m, n_blocks, _ = blocks.shape
    gs = global_scale.reshape(())

    # NaN blocks are written explicitly (scale byte 0x7F, codes 0) instead of
    # relying on how max, clamp, the fp8 cast and signbit treat NaN, which
    # differs between devices, compilers and NaN signs. Their amax is taken as 0
    # so that the arithmetic below stays finite.
    nan_block = blocks.isnan().any(dim=-1, keepdim=True)  # [M, nb, 1]
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    amax = torch.where(nan_block, torch.zeros_like(amax), amax)
    # torch's float -> e4m3fn cast does not saturate in every version (NaN above 448).
    # +Inf amax: gs * inf / 6 = inf, clamped to 448.
    sf = (gs * amax / const(amax, 6.0)).clamp(max=E4M3_MAX).to(FP8)
    sf32 = sf.float()
    inv = torch.where(sf32 == 0, torch.zeros_like(sf32), gs / sf32)
    codes = e2m1_encode(blocks * inv)  # ±Inf * inv = ±Inf saturates to code 0x7 / 0xF
    codes = torch.where(nan_block, torch.zeros_like(codes), codes).reshape(m, n_blocks * BLOCK_SIZE)

    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    sf_bytes = sf.view(torch.uint8)
    sf_bytes = torch.where(nan_block, torch.full_like(sf_bytes, E4M3_NAN_BYTE), sf_bytes)
    scales = sf_bytes.view(FP8).reshape(m, n_blocks)
    scales = swizzle_scales(scales) if swizzled else scales.contiguous()
    return packed, scales


# --------------------------------------------------------------------------
# Row ranges of a shared buffer
# --------------------------------------------------------------------------



def write_rows(x, global_scale, packed, scales, row_start: int) -> None:
    """:func:`quantize_rows_into` without the argument checks."""
    m, k = x.shape
    if m == 0 or k == 0:
        return
    n_blocks = k // BLOCK_SIZE
    cols = round_up(n_blocks, SWIZZLE_COLS)
    rows_packed, rows_scales = quantize(x, global_scale, swizzled=False)
    # the rows' scale bytes, padding columns (c >= K/16) included: they belong to the row
    row_bytes = torch.zeros((m, cols), dtype=torch.uint8, device=x.device)
    row_bytes[:, :n_blocks] = rows_scales.view(torch.uint8)
    offsets = row_scale_offsets(row_start, row_start + m, n_blocks, x.device)
    scales.view(torch.uint8).view(-1)[offsets] = row_bytes.flatten()
    packed[row_start : row_start + m] = rows_packed


def quantize_rows_into(
    x: torch.Tensor,
    global_scale: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    row_start: int,
) -> None:
    """Quantize ``x`` into rows ``[row_start, row_start + M)`` of a ``T``-row NVFP4 buffer pair.

    Plain PyTorch, any device (the reference; :func:`fusion_pass.kernels.quantize_rows_into`
    runs the Triton kernel on CUDA). Row ``row_start + i`` gets exactly the bytes that
    :func:`quantize` of the whole ``[T, K]`` matrix writes for that row,
    given ``x[i]`` as its data: quantization works per row and 16-element block, and
    each scale is written at its global row's swizzled offset. No other byte is
    touched: neither other rows' packed bytes or scales nor the padding rows
    ``T .. round_up(T, 128)`` (see :func:`zero_scale_padding`). The padding
    columns (``K/16 .. round_up(K/16, 4)``) of the rows in range are written as zero.

    Args:
        x: float16 / bfloat16 / float32 ``[M, K]``, ``K % 16 == 0``, any strides.
        global_scale: float32 tensor with one positive finite element (at most ``GLOBAL_SCALE_MAX``), on
            ``x``'s device.
        packed: contiguous uint8 ``[T, K/2]`` on ``x``'s device; row ``r`` holds the
            codes of row ``r`` (element ``2j`` in the low nibble of byte ``j``).
        scales: contiguous 128x4 swizzled scale buffer of ``T`` rows on ``x``'s
            device, as ``scaled_fp4_quant.out`` accepts it: int32
            ``[round_up(T, 128), round_up(K/16, 4) / 4]`` (vLLM's allocation) or
            uint8 / float8_e4m3fn ``[round_up(T, 128), round_up(K/16, 4)]``.
        row_start: an int with ``0 <= row_start`` and ``row_start + M <= T``.

    Raises (before anything is written):
        TypeError: a non-tensor ``x`` / ``packed`` / ``scales``, ``x`` not float16 /
            bfloat16 / float32, ``global_scale`` not float32, ``row_start`` not an int.
        ValueError: a wrong shape, dtype, layout or device of a buffer, ``K % 16 != 0``,
            a ``global_scale`` that is not one positive finite value up to ``GLOBAL_SCALE_MAX``, a row range
            outside ``[0, T)``.

    NaN and infinity as in :func:`quantize`.
    """
    check_rows_into("quantize_rows_into", x, global_scale, packed, scales, row_start)
    write_rows(x, global_scale, packed, scales, row_start)


def zero_scale_padding(scales: torch.Tensor, rows: int, k: int) -> None:
    """Zero the scale bytes of the padding rows ``rows .. round_up(rows, 128)``, nothing else.

    The complement of :func:`quantize_rows_into`: once every row ``0 .. T-1`` of a
    buffer pair has been written by some producer, this call (with ``rows = T``)
    makes the buffers byte-equal to :func:`quantize` of the whole
    matrix. The padding rows all sit in the last 128-row band, interleaved with
    the scales of real rows, so only the bytes of rows ``>= rows`` inside that
    band are cleared (two slice fills, any device, no index tensors).

    Args:
        scales: contiguous 128x4 swizzled scale buffer of ``rows`` rows and ``k``
            columns: int32 ``[round_up(rows, 128), round_up(k/16, 4) / 4]`` or
            uint8 / float8_e4m3fn ``[round_up(rows, 128), round_up(k/16, 4)]``.
        rows: ``T``, the number of real rows (an int >= 0).
        k: ``K``, the number of elements per row (an int >= 0, ``k % 16 == 0``).

    Raises (before anything is written):
        TypeError: ``rows`` or ``k`` not an int, ``scales`` not a tensor.
        ValueError: negative ``rows`` / ``k``, ``k % 16 != 0``, ``scales`` of the
            wrong dtype, shape or layout.
    """
    fn = "zero_scale_padding"
    for name, v in (("rows", rows), ("k", k)):
        if not is_int(v):
            raise ArgumentError(f"{fn}: {name} must be an int (got {type(v).__name__} {v!r})")
        if v < 0:
            raise ArgumentError(f"{fn}: {name} must be >= 0 (got {v})")
    if k % BLOCK_SIZE != 0:
        raise ArgumentError(f"{fn}: k must be divisible by {BLOCK_SIZE} (got {k})")
    check_swizzled_buffer(fn, scales, rows, k)
    col_tiles = round_up(k // BLOCK_SIZE, SWIZZLE_COLS) // SWIZZLE_COLS
    first = rows % SWIZZLE_ROWS  # first padding row of the last band
    if first == 0 or col_tiles == 0:
        return
    band_start = (rows // SWIZZLE_ROWS) * col_tiles * 512
    # the band's tiles as [column tile, row in group, row group, column]: row g*32 + i at [:, i, g]
    band = scales.view(torch.uint8).view(-1)[band_start:].view(col_tiles, 32, 4, 4)
    group, row = divmod(first, 32)
    band[:, row:, group].zero_()
    band[:, :, group + 1 :].zero_()


def _linear_scales(
    scales: torch.Tensor, m: int, n_blocks: int, swizzled: bool
) -> torch.Tensor:
    """Validate a dequantize ``scales`` argument; return linear fp8 ``[m, n_blocks]``."""
    if scales.dtype == torch.int32:  # vLLM allocation: 4 fp8 scales per int32
        if scales.dim() != 2 or scales.stride(-1) != 1:
            raise ArgumentError(
                "dequantize: int32-allocated scales must be 2-D with a unit stride along the last "
                f"dimension, to be viewed as float8_e4m3fn (got shape {list(scales.shape)}, "
                f"strides {list(scales.stride())})"
            )
        scales = scales.view(FP8)
    if scales.dtype != FP8 or scales.dim() != 2:
        raise ArgumentError(
            "dequantize: scales must be a 2-D float8_e4m3fn (or int32-allocated) tensor "
            f"(got dtype {scales.dtype}, shape {list(scales.shape)})"
        )
    rows, cols = scales.shape
    want_cols = round_up(n_blocks, 4) if swizzled else n_blocks
    if cols != want_cols or (swizzled and rows % 128 != 0):
        rows_rule = "R a multiple of 128" if swizzled else "R >= m"
        raise ArgumentError(
            f"dequantize: scales must have shape [R, {want_cols}] (fp8 view) with "
            f"{rows_rule} for K={n_blocks * BLOCK_SIZE} (got shape {list(scales.shape)})"
        )
    if m > rows:
        raise ArgumentError(f"dequantize: m={m} is larger than the number of scale rows ({rows})")
    if swizzled:
        return unswizzle_scales(scales, m, n_blocks)
    return scales[:m]


def dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    *,
    m: int | None = None,
    swizzled: bool = True,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode NVFP4 data: ``x_hat = e2m1_value(code) * float(sf) / gs``.

    Args:
        packed: uint8 ``[M, K/2]`` as returned by :func:`quantize`.
        scales: float8_e4m3fn scale buffer, swizzled ``[R, round_up(K/16, 4)]``
            (``R`` a multiple of 128) or linear ``[R, K/16]``; an int32 tensor
            (vLLM's allocation, 4 scales per element) is viewed as fp8.
        global_scale: float32 tensor with one positive finite element, at most ``GLOBAL_SCALE_MAX``.
        m: number of rows to decode (default ``packed.shape[0]``), an int
            (``bool`` is refused); must not exceed the rows of ``packed`` or of
            ``scales``.
        swizzled: layout of ``scales``.
        dtype: output dtype, a floating-point ``torch.dtype`` (computed in
            float32, then cast).

    Returns:
        ``[m, K]`` tensor of ``dtype``.

    Raises:
        TypeError: ``m`` is not an int (or is a bool), ``dtype`` is not a
            floating-point ``torch.dtype``, ``global_scale`` is not float32.
        ValueError: a shape, layout, device or value is wrong.
    """
    if m is not None and (isinstance(m, bool) or not isinstance(m, (numbers.Integral, torch.SymInt))):
        raise ArgumentError(
            f"dequantize: m must be an int (the number of rows to decode) or None, "
            f"got {type(m).__name__} {m!r}"
        )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ArgumentError(
            f"dequantize: dtype must be a floating-point torch.dtype (e.g. torch.float32, "
            f"torch.bfloat16), got {dtype!r}"
        )
    if not isinstance(packed, torch.Tensor) or not isinstance(scales, torch.Tensor):
        bad, value = ("packed", packed) if not isinstance(packed, torch.Tensor) else ("scales", scales)
        raise ArgumentError(f"dequantize: {bad} must be a tensor, got {type(value).__name__}")
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ArgumentError(
            "dequantize: packed must be a 2-D uint8 tensor [M, K/2] "
            f"(got dtype {packed.dtype}, shape {list(packed.shape)})"
        )
    k = packed.shape[1] * 2
    if k % BLOCK_SIZE != 0:
        raise ArgumentError(
            f"dequantize: packed must have K/2 divisible by {BLOCK_SIZE // 2} "
            f"(got shape {list(packed.shape)})"
        )
    m = packed.shape[0] if m is None else (int(m) if isinstance(m, numbers.Integral) else m)
    if not 0 <= m <= packed.shape[0]:
        raise ArgumentError(
            f"dequantize: m must be in [0, {packed.shape[0]}] (the rows of packed) (got {m})"
        )
    if scales.device != packed.device:
        raise ArgumentError(
            f"dequantize: scales must be on the same device as packed "
            f"(got {scales.device}, expected {packed.device})"
        )
    check_global_scale("dequantize", global_scale, packed.device)
    n_blocks = k // BLOCK_SIZE
    sf = _linear_scales(scales, m, n_blocks, swizzled).float()  # [m, nb]

    values = codes_to_values(unpack_codes(packed[:m])).reshape(m, n_blocks, BLOCK_SIZE)
    x_hat = values * sf.unsqueeze(-1) / global_scale.reshape(())
    return x_hat.reshape(m, k).to(dtype)
