"""Reference NVFP4 quantization (pure PyTorch, any device).

This module is the numeric oracle of the project: it produces exactly the bytes
described in the shared ``NVFP4.md`` contract (the semantics of vLLM's
``scaled_fp4_quant``), so GPU producers can be compared to it byte for byte.

Format summary (see ``docs/nvfp4.md`` for the full description):

* ``x`` ``[M, K]`` is cut into blocks of 16 consecutive elements along ``K``.
* Each block gets one ``float8_e4m3fn`` scale
  ``sf = e4m3(min(gs * amax / 6, 448))``, where ``gs`` is the global scale.
* Each element is stored as a 4-bit e2m1 code of ``x * gs / sf``; two codes per
  byte, element ``2j`` in the low nibble of byte ``j``.
* The scales are stored either linearly (``[M, K/16]``) or in the "128x4
  swizzled" layout that CUTLASS / FlashInfer NVFP4 GEMMs read.

Everything is written with plain tensor ops so that it also runs under
``FakeTensorMode``, on the meta device and under ``torch.compile`` (value checks
on ``global_scale`` are skipped there).
"""

from __future__ import annotations

import functools
import math

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = [
    "BLOCK_SIZE",
    "E2M1_MAX",
    "E4M3_MAX",
    "E2M1_VALUES",
    "round_up",
    "scale_shape",
    "swizzled_offset",
    "row_scale_offsets",
    "swizzle_scales",
    "unswizzle_scales",
    "quantize",
    "quantize_reference",
    "quantize_rows_into",
    "zero_scale_padding",
    "dequantize",
    "unpack_codes",
    "codes_to_values",
    "half_step",
    "error_bound",
]

BLOCK_SIZE = 16
"""Number of consecutive elements along K that share one scale."""

E2M1_MAX = 6.0
"""Largest magnitude representable by an e2m1 code."""

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value; block scales saturate here."""

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitudes of e2m1 codes 0..7 (codes 8..15 are the same values, negated)."""

# Largest |q - value| over all q that round to a code, per magnitude index.
# For code 7 (6.0) only the non-saturating side (5, 6] is counted.
_HALF_STEPS = (0.25, 0.25, 0.25, 0.25, 0.5, 0.5, 1.0, 1.0)

_FP8 = torch.float8_e4m3fn
_E4M3_NAN_BYTE = 0x7F  # float8_e4m3fn NaN (S.1111.111), the scale byte of a block holding a NaN
_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SWIZZLE_ROWS = 128  # rows per swizzle tile
_SWIZZLE_COLS = 4  # block columns per swizzle tile


# --------------------------------------------------------------------------
# Shapes and the swizzled scale layout
# --------------------------------------------------------------------------


def round_up(x: int, m: int) -> int:
    """Smallest multiple of ``m`` that is >= ``x``. Works for ints and SymInts."""
    return (x + m - 1) // m * m


def scale_shape(m: int, k: int, *, swizzled: bool = True) -> tuple[int, int]:
    """Shape of the float8_e4m3fn scale buffer for an ``[m, k]`` input.

    Swizzled: ``(round_up(m, 128), round_up(k // 16, 4))``; linear: ``(m, k // 16)``.
    ``k`` must be a multiple of 16.
    """
    if isinstance(k, int) and k % BLOCK_SIZE != 0:
        raise ValueError(f"scale_shape: k must be divisible by {BLOCK_SIZE} (got {k})")
    n_blocks = k // BLOCK_SIZE
    if not swizzled:
        return (m, n_blocks)
    return (round_up(m, _SWIZZLE_ROWS), round_up(n_blocks, _SWIZZLE_COLS))


def swizzled_offset(m, c, n_blocks: int):
    """Flat byte offset of the scale of (row ``m``, block column ``c``).

    Implements the formula of NVFP4.md for a swizzled buffer whose rows hold
    ``round_up(n_blocks, 4)`` scales. ``m`` and ``c`` may be ints or integer
    tensors (broadcast together).
    """
    kt = round_up(n_blocks, _SWIZZLE_COLS) // _SWIZZLE_COLS
    tile = (m // 128) * kt + c // 4
    return tile * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + c % 4


def row_scale_offsets(start: int, stop: int, n_blocks: int, device=None) -> torch.Tensor:
    """Flat byte offsets (int64 ``[(stop - start) * round_up(n_blocks, 4)]``, row by row) of every scale of
    rows ``[start, stop)`` in a swizzled buffer whose rows hold ``n_blocks`` block scales, the padding
    columns included: the bytes that belong to those rows and to no other."""
    rows = torch.arange(start, stop, device=device)
    cols = torch.arange(round_up(n_blocks, _SWIZZLE_COLS), device=device)
    return swizzled_offset(rows[:, None], cols[None, :], n_blocks).reshape(-1)


def swizzle_scales(scales_linear: torch.Tensor) -> torch.Tensor:
    """Linear ``[M, K/16]`` fp8 scales -> swizzled ``[round_up(M,128), round_up(K/16,4)]``.

    The input is zero-padded to the buffer shape, viewed as
    ``[Mp/128, 4, 32, Kt, 4]`` (tile row, row group, row in group, tile column,
    column in tile) and permuted to ``[Mp/128, Kt, 32, 4, 4]``; the bytes of that
    array, read in order, are the swizzled buffer. Padding entries are zero.
    """
    if scales_linear.dtype != _FP8 or scales_linear.dim() != 2:
        raise ValueError(
            "swizzle_scales: scales_linear must be a 2-D float8_e4m3fn tensor "
            f"(got dtype {scales_linear.dtype}, shape {list(scales_linear.shape)})"
        )
    m, n_blocks = scales_linear.shape
    mp, np_ = scale_shape(m, n_blocks * BLOCK_SIZE, swizzled=True)
    # Byte-level work on a uint8 view: float8 support for pad/copy varies by device.
    padded = scales_linear.new_zeros((mp, np_), dtype=torch.uint8)
    padded[:m, :n_blocks] = scales_linear.view(torch.uint8)
    tiles = padded.reshape(mp // 128, 4, 32, np_ // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().reshape(mp, np_).view(_FP8)


def unswizzle_scales(swizzled: torch.Tensor, m: int, n_blocks: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`: swizzled buffer -> linear ``[m, n_blocks]``.

    ``swizzled`` is float8_e4m3fn ``[R, round_up(n_blocks, 4)]`` with ``R`` a
    multiple of 128 and ``R >= m``.
    """
    if swizzled.dtype != _FP8 or swizzled.dim() != 2:
        raise ValueError(
            "unswizzle_scales: swizzled must be a 2-D float8_e4m3fn tensor "
            f"(got dtype {swizzled.dtype}, shape {list(swizzled.shape)})"
        )
    rows, cols = swizzled.shape
    if cols != round_up(n_blocks, 4) or rows % 128 != 0 or rows < m:
        raise ValueError(
            f"unswizzle_scales: swizzled must have shape [R, {round_up(n_blocks, 4)}] with R "
            f"a multiple of 128 and R >= m={m} (got shape {list(swizzled.shape)})"
        )
    tiles = swizzled.view(torch.uint8).reshape(rows // 128, cols // 4, 32, 4, 4)
    linear = tiles.permute(0, 3, 2, 1, 4).reshape(rows, cols)
    return linear[:m, :n_blocks].contiguous().view(_FP8)


# --------------------------------------------------------------------------
# e2m1 codes
# --------------------------------------------------------------------------


def _e2m1_encode(q: torch.Tensor) -> torch.Tensor:
    """float32 values -> uint8 e2m1 codes (nearest, ties to even code, saturating).

    The thresholds are the midpoints between neighbouring magnitudes; ``>`` at a
    midpoint sends the tie down, ``>=`` sends it up, chosen so that the tie lands
    on the even code index (0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2,
    3.5->4, 5->4). The sign bit comes from ``signbit`` so -0.0 gives 0x8.
    ``±Inf`` saturates to 0x7 / 0xF. A NaN gives magnitude 0 with the NaN's sign
    bit, which depends on the device; :func:`quantize_reference` does not rely on
    it (a block holding a NaN is written as codes 0 explicitly).
    """
    a = q.abs()
    index = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    return index | (torch.signbit(q).to(torch.uint8) << 3)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K/2]`` -> uint8 codes ``[..., K]`` (low nibble is the even element)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_codes: packed must be uint8 (got {packed.dtype})")
    pairs = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def codes_to_values(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (any integer dtype, values 0..15) -> float32 values (code 8 is -0.0)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    table = torch.cat((table, -table))
    return table[codes.long()]


def half_step(codes: torch.Tensor) -> torch.Tensor:
    """Largest rounding distance, in code units, of values that round to ``codes``.

    float32, same shape as ``codes``: 0.25 for magnitudes 0..1.5, 0.5 for 2 and 3,
    1.0 for 4 and 6. For code 6.0 only inputs up to 6 are covered (saturation of
    larger inputs is not a rounding step). Multiply by ``float(sf) / gs`` to get
    the element's error in input units.
    """
    table = torch.tensor(_HALF_STEPS, dtype=torch.float32, device=codes.device)
    return table[(codes & 0x7).long()]


# --------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------


def _is_concrete(t: torch.Tensor) -> bool:
    """True when ``t`` holds real data that ``.item()`` can read."""
    # is_compiling() first: dynamo refuses to trace into is_fake.
    if torch.compiler.is_compiling():
        return False
    return not (is_fake(t) or t.device.type == "meta")


def _check_global_scale(fn: str, global_scale, device: torch.device, *, check_value: bool = True) -> None:
    if not isinstance(global_scale, torch.Tensor) or global_scale.dtype != torch.float32:
        got = global_scale.dtype if isinstance(global_scale, torch.Tensor) else type(global_scale)
        raise TypeError(f"{fn}: global_scale must be a float32 tensor (got {got})")
    if global_scale.numel() != 1:
        raise ValueError(
            f"{fn}: global_scale must have exactly one element "
            f"(got shape {list(global_scale.shape)})"
        )
    if global_scale.device != device:
        raise ValueError(
            f"{fn}: global_scale must be on the same device as the data "
            f"(got {global_scale.device}, expected {device})"
        )
    if check_value and _is_concrete(global_scale):
        value = global_scale.item()
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{fn}: global_scale must be positive and finite (got {value})")


def _check_x(fn: str, x: torch.Tensor, global_scale: torch.Tensor, *, check_value: bool = True) -> None:
    if x.dtype not in _X_DTYPES:
        raise TypeError(f"{fn}: x must be float16, bfloat16 or float32 (got {x.dtype})")
    if x.dim() == 0:
        raise ValueError(f"{fn}: x must have at least one dimension (got a 0-d tensor)")
    if x.shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"{fn}: x must have a last dimension divisible by {BLOCK_SIZE} "
            f"(got shape {list(x.shape)})"
        )
    _check_global_scale(fn, global_scale, x.device, check_value=check_value)


def _const(like: torch.Tensor, value: float) -> torch.Tensor:
    """``value`` as a 0-d float32 tensor on ``like``'s device.

    Dividing by a Python number is not IEEE division on every backend: eager
    CUDA multiplies by its reciprocal instead, which moves the last bit. Dividing
    by a same-device tensor keeps the reference identical on all devices.
    """
    return like.new_full((), value, dtype=torch.float32)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` -> float32 ``[M, K/16, 16]``; leading dims flattened into M."""
    k = x.shape[-1]
    m = math.prod(x.shape[:-1])
    return x.reshape(m, k // BLOCK_SIZE, BLOCK_SIZE).float()


# --------------------------------------------------------------------------
# Quantize / dequantize
# --------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    """Whether triton imports (checked once per process)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def quantize(
    x: torch.Tensor, global_scale: torch.Tensor, *, swizzled: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to NVFP4: the Triton kernel on CUDA, the reference elsewhere.

    Arguments and result as :func:`quantize_reference`, whose bytes the Triton
    kernel (:mod:`fusion_pass.kernels.nvfp4_quant`) reproduces. The kernel runs
    for concrete CUDA tensors when Triton is installed; CPU, meta and fake
    tensors, and tracing under torch.compile, use the reference. On the CUDA
    path the global scale's value is not read back (no synchronization).
    """
    if x.is_cuda and _is_concrete(x) and _triton_importable():
        from fusion_pass.kernels.nvfp4_quant import quantize as triton_quantize

        _check_x("quantize", x, global_scale, check_value=False)
        return triton_quantize(x.reshape(-1, x.shape[-1]), global_scale, swizzled=swizzled)
    return quantize_reference(x, global_scale, swizzled=swizzled)


def quantize_reference(
    x: torch.Tensor, global_scale: torch.Tensor, *, swizzled: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to NVFP4 in plain PyTorch (any device): the project's oracle.

    Args:
        x: float16 / bfloat16 / float32 ``[..., K]`` with ``K % 16 == 0``; the
            leading dims are flattened into ``M`` rows.
        global_scale: float32 tensor with exactly one positive finite element,
            on ``x``'s device.
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
    _check_x("quantize", x, global_scale)
    blocks = _blocks(x)  # [M, nb, 16]
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
    sf = (gs * amax / _const(amax, 6.0)).clamp(max=E4M3_MAX).to(_FP8)
    sf32 = sf.float()
    inv = torch.where(sf32 == 0, torch.zeros_like(sf32), gs / sf32)
    codes = _e2m1_encode(blocks * inv)  # ±Inf * inv = ±Inf saturates to code 0x7 / 0xF
    codes = torch.where(nan_block, torch.zeros_like(codes), codes).reshape(m, n_blocks * BLOCK_SIZE)

    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    sf_bytes = sf.view(torch.uint8)
    sf_bytes = torch.where(nan_block, torch.full_like(sf_bytes, _E4M3_NAN_BYTE), sf_bytes)
    scales = sf_bytes.view(_FP8).reshape(m, n_blocks)
    scales = swizzle_scales(scales) if swizzled else scales.contiguous()
    return packed, scales


# --------------------------------------------------------------------------
# Row ranges of a shared buffer
# --------------------------------------------------------------------------


def _is_int(v) -> bool:
    import numbers  # numpy integers count as ints

    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_tensor(fn: str, name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a tensor (got {type(t).__name__})")


def _check_swizzled_buffer(fn: str, scales, rows: int, k: int) -> None:
    """``scales`` is the 128x4 swizzled scale buffer of a ``[rows, k]`` matrix, in one of
    the forms ``scaled_fp4_quant.out`` accepts, and can be viewed as contiguous bytes."""
    _check_tensor(fn, "scales", scales)
    r, cols = scale_shape(rows, k, swizzled=True)
    forms = {torch.int32: (r, cols // 4), torch.uint8: (r, cols), _FP8: (r, cols)}
    if forms.get(scales.dtype) != tuple(scales.shape):
        raise ValueError(
            f"{fn}: scales must be the swizzled scale buffer of T={rows} rows, K={k}: int32 "
            f"[{r}, {cols // 4}] (vLLM's allocation) or uint8 / float8_e4m3fn [{r}, {cols}] "
            f"(round_up(T, 128) x round_up(K/16, 4)) (got {scales.dtype} {list(scales.shape)})"
        )
    if not (scales.is_contiguous() and scales.stride(-1) == 1):
        raise ValueError(f"{fn}: scales must be contiguous (got strides {list(scales.stride())})")


def _check_rows_into(fn: str, x, global_scale, packed, scales, row_start) -> None:
    """Every argument of :func:`quantize_rows_into`; raises before anything is written."""
    for name, t in (("x", x), ("packed", packed)):
        _check_tensor(fn, name, t)
    if x.dim() != 2:
        raise ValueError(f"{fn}: x must be a 2-D tensor [M, K] (got shape {list(x.shape)})")
    _check_x(fn, x, global_scale)
    m, k = x.shape
    _check_row_range(fn, packed, scales, row_start, m, k, x.device)


def _check_row_range(
    fn: str, packed, scales, row_start, m: int, k: int, device: torch.device, *, source: str = "x", width: str = "K"
) -> None:
    """``packed`` / ``scales`` are a ``T``-row NVFP4 buffer pair of ``k``-wide rows on ``device``
    and rows ``[row_start, row_start + m)`` lie in it. The messages name the source tensor
    (``source``, e.g. ``x``) and its row width (``width``, e.g. ``K``)."""
    _check_tensor(fn, "packed", packed)
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != k // 2:
        raise ValueError(
            f"{fn}: packed must be a uint8 tensor [T, {width}/2] = [T, {k // 2}] for {source}'s {width}={k} "
            f"(got {packed.dtype} {list(packed.shape)})"
        )
    if not packed.is_contiguous():
        raise ValueError(f"{fn}: packed must be contiguous (got strides {list(packed.stride())})")
    if packed.device != device:
        raise ValueError(f"{fn}: packed must be on {source}'s device {device} (got {packed.device})")
    t = packed.shape[0]
    _check_swizzled_buffer(fn, scales, t, k)
    if scales.device != device:
        raise ValueError(f"{fn}: scales must be on {source}'s device {device} (got {scales.device})")
    if not _is_int(row_start):
        raise TypeError(f"{fn}: row_start must be an int (got {type(row_start).__name__} {row_start!r})")
    if row_start < 0:
        raise ValueError(f"{fn}: row_start must be >= 0 (got {row_start})")
    if row_start + m > t:
        raise ValueError(
            f"{fn}: row_start + M = {row_start} + {m} = {row_start + m} exceeds T = {t}, "
            "the rows of packed"
        )


def _write_rows(x, global_scale, packed, scales, row_start: int) -> None:
    """:func:`quantize_rows_into` without the argument checks."""
    m, k = x.shape
    if m == 0 or k == 0:
        return
    n_blocks = k // BLOCK_SIZE
    cols = round_up(n_blocks, _SWIZZLE_COLS)
    rows_packed, rows_scales = quantize_reference(x, global_scale, swizzled=False)
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
    :func:`quantize_reference` of the whole ``[T, K]`` matrix writes for that row,
    given ``x[i]`` as its data: quantization works per row and 16-element block, and
    each scale is written at its global row's swizzled offset. No other byte is
    touched: neither other rows' packed bytes or scales nor the padding rows
    ``T .. round_up(T, 128)`` (see :func:`zero_scale_padding`). The padding
    columns (``K/16 .. round_up(K/16, 4)``) of the rows in range are written as zero.

    Args:
        x: float16 / bfloat16 / float32 ``[M, K]``, ``K % 16 == 0``, any strides.
        global_scale: float32 tensor with one positive finite element, on ``x``'s device.
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
            a ``global_scale`` that is not one positive finite value, a row range
            outside ``[0, T)``.

    NaN and infinity as in :func:`quantize_reference`.
    """
    _check_rows_into("quantize_rows_into", x, global_scale, packed, scales, row_start)
    _write_rows(x, global_scale, packed, scales, row_start)


def zero_scale_padding(scales: torch.Tensor, rows: int, k: int) -> None:
    """Zero the scale bytes of the padding rows ``rows .. round_up(rows, 128)``, nothing else.

    The complement of :func:`quantize_rows_into`: once every row ``0 .. T-1`` of a
    buffer pair has been written by some producer, this call (with ``rows = T``)
    makes the buffers byte-equal to :func:`quantize_reference` of the whole
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
        if not _is_int(v):
            raise TypeError(f"{fn}: {name} must be an int (got {type(v).__name__} {v!r})")
        if v < 0:
            raise ValueError(f"{fn}: {name} must be >= 0 (got {v})")
    if k % BLOCK_SIZE != 0:
        raise ValueError(f"{fn}: k must be divisible by {BLOCK_SIZE} (got {k})")
    _check_swizzled_buffer(fn, scales, rows, k)
    col_tiles = round_up(k // BLOCK_SIZE, _SWIZZLE_COLS) // _SWIZZLE_COLS
    first = rows % _SWIZZLE_ROWS  # first padding row of the last band
    if first == 0 or col_tiles == 0:
        return
    band_start = (rows // _SWIZZLE_ROWS) * col_tiles * 512
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
            raise ValueError(
                "dequantize: int32-allocated scales must be 2-D with a unit stride along the last "
                f"dimension, to be viewed as float8_e4m3fn (got shape {list(scales.shape)}, "
                f"strides {list(scales.stride())})"
            )
        scales = scales.view(_FP8)
    if scales.dtype != _FP8 or scales.dim() != 2:
        raise ValueError(
            "dequantize: scales must be a 2-D float8_e4m3fn (or int32-allocated) tensor "
            f"(got dtype {scales.dtype}, shape {list(scales.shape)})"
        )
    rows, cols = scales.shape
    want_cols = round_up(n_blocks, 4) if swizzled else n_blocks
    if cols != want_cols or (swizzled and rows % 128 != 0):
        rows_rule = "R a multiple of 128" if swizzled else "R >= m"
        raise ValueError(
            f"dequantize: scales must have shape [R, {want_cols}] (fp8 view) with "
            f"{rows_rule} for K={n_blocks * BLOCK_SIZE} (got shape {list(scales.shape)})"
        )
    if m > rows:
        raise ValueError(f"dequantize: m={m} is larger than the number of scale rows ({rows})")
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
        global_scale: float32 tensor with one positive finite element.
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
    import numbers  # numpy integers count as ints

    if m is not None and (isinstance(m, bool) or not isinstance(m, (numbers.Integral, torch.SymInt))):
        raise TypeError(
            f"dequantize: m must be an int (the number of rows to decode) or None, "
            f"got {type(m).__name__} {m!r}"
        )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"dequantize: dtype must be a floating-point torch.dtype (e.g. torch.float32, "
            f"torch.bfloat16), got {dtype!r}"
        )
    if not isinstance(packed, torch.Tensor) or not isinstance(scales, torch.Tensor):
        bad, value = ("packed", packed) if not isinstance(packed, torch.Tensor) else ("scales", scales)
        raise TypeError(f"dequantize: {bad} must be a tensor, got {type(value).__name__}")
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(
            "dequantize: packed must be a 2-D uint8 tensor [M, K/2] "
            f"(got dtype {packed.dtype}, shape {list(packed.shape)})"
        )
    k = packed.shape[1] * 2
    if k % BLOCK_SIZE != 0:
        raise ValueError(
            f"dequantize: packed must have K/2 divisible by {BLOCK_SIZE // 2} "
            f"(got shape {list(packed.shape)})"
        )
    m = packed.shape[0] if m is None else (int(m) if isinstance(m, numbers.Integral) else m)
    if not 0 <= m <= packed.shape[0]:
        raise ValueError(
            f"dequantize: m must be in [0, {packed.shape[0]}] (the rows of packed) (got {m})"
        )
    if scales.device != packed.device:
        raise ValueError(
            f"dequantize: scales must be on the same device as packed "
            f"(got {scales.device}, expected {packed.device})"
        )
    _check_global_scale("dequantize", global_scale, packed.device)
    n_blocks = k // BLOCK_SIZE
    sf = _linear_scales(scales, m, n_blocks, swizzled).float()  # [m, nb]

    values = codes_to_values(unpack_codes(packed[:m])).reshape(m, n_blocks, BLOCK_SIZE)
    x_hat = values * sf.unsqueeze(-1) / global_scale.reshape(())
    return x_hat.reshape(m, k).to(dtype)


# --------------------------------------------------------------------------
# Error bound
# --------------------------------------------------------------------------


def error_bound(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Per-element upper bound on ``|x - dequantize(quantize(x, gs))|``.

    Returns float32 ``[M, K]`` (leading dims of ``x`` flattened), constant over
    each 16-element block::

        bound = s * (1 + 2**-4) + 6 * 2**-10 / gs + max(amax - 6 * 448 / gs, 0)

    with ``amax`` the block's max magnitude and ``s = amax / 6``.

    Derivation. Let ``t = gs * s`` (the unrounded scale), ``sf`` its e4m3
    rounding and ``d = sf / gs`` the step that multiplies codes on decode. An
    element decodes to ``v * d`` with ``v`` the e2m1 value of ``q = x / d``.

    * If ``|q| <= 6``, ``|q - v|`` is at most half the gap between neighbouring
      magnitudes, at most 1 (the 4..6 gap), so the error is ``<= d``.
    * If ``|q| > 6`` the code saturates at 6 and the error is
      ``|x| - 6 d <= amax - 6 d``.

    Hence error ``<= max(d, amax - 6 d)``. Bounding ``d`` by the e4m3 rounding:

    * normal range (``2**-6 <= t <= 448``): ``|sf - t| <= t / 17`` (3 mantissa
      bits, worst case just above ``1.0625 * 2**e``), so ``d <= s * 18/17`` and
      ``amax - 6 d <= 6 s / 17 < d``: error ``<= s * (1 + 2**-4)``;
    * subnormal range (``t < 2**-6``): ``|sf - t| <= 2**-10`` (half the spacing
      ``2**-9``), so ``d <= s + 2**-10 / gs`` and
      ``amax - 6 d <= 6 * 2**-10 / gs``. When ``sf`` rounds to 0 the block
      decodes to 0 and the error is ``|x| <= amax = 6 t / gs <= 6 * 2**-10 / gs``;
    * saturated range (``t > 448``): ``sf = 448``, ``d = 448 / gs < s``, and
      elements beyond ``6 d`` lose ``amax - 6 * 448 / gs``.

    The sum of the three terms covers every case. The margin of the first
    term over ``18/17`` (a relative ``1/272``) absorbs the float32 roundings of
    ``gs * amax / 6``, ``gs / sf``, ``x * inv`` and of the decode, which are of
    relative size ``2**-23`` each.
    """
    _check_x("error_bound", x, global_scale)
    blocks = _blocks(x)
    gs = global_scale.reshape(())
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    s = amax / _const(amax, 6.0)
    saturation = (amax - _const(amax, 6.0 * E4M3_MAX) / gs).clamp(min=0)
    bound = s * (1 + 2**-4) + _const(amax, 6 * 2**-10) / gs + saturation
    m, n_blocks, _ = blocks.shape
    return bound.expand(blocks.shape).reshape(m, n_blocks * BLOCK_SIZE)
