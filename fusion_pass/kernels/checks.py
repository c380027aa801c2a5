"""Argument checks shared by the kernels' entry points (no device work, no sync), and the
padding fill both NVFP4 attention launchers do before their kernel runs."""

from __future__ import annotations

import torch
from torch import Tensor

from fusion_pass import nvfp4

HALF_DTYPES = (torch.float16, torch.bfloat16)


def describe(t) -> str:
    return f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, Tensor) else repr(t)


def check_qkv(fn: str, q, k, v, *, separate_kv: bool = False) -> None:
    """``q [T, H, Dqk]``, ``k [Tk, Hkv, Dqk]``, ``v [Tk, Hkv, Dv]``: one half dtype, one device,
    unit stride along the head dim, ``H % Hkv == 0``. ``Tk == T`` unless ``separate_kv`` (keys
    delimited by their own ``cu_seqlens_k``)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            layout = {"q": "[T, H, Dqk]", "k": "[Tk, Hkv, Dqk]", "v": "[Tk, Hkv, Dv]"}[name]
            raise ValueError(f"{fn}: {name} must be a 3-D tensor {layout}, got {describe(t)}")
        if t.dtype not in HALF_DTYPES:
            raise TypeError(f"{fn}: {name} must be float16 or bfloat16, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{fn}: {name} must have unit stride along its last (head) dim, got strides {t.stride()}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{fn}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{fn}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    t, h, dqk = q.shape
    if separate_kv:
        if v.shape[0] != k.shape[0]:
            raise ValueError(
                f"{fn}: k and v must have the same number of tokens Tk, got k {list(k.shape)}, v {list(v.shape)}"
            )
    elif k.shape[0] != t or v.shape[0] != t:
        raise ValueError(
            f"{fn}: q, k, v must have the same number of tokens T (or pass cu_seqlens_k), got q {list(q.shape)}, "
            f"k {list(k.shape)}, v {list(v.shape)}"
        )
    if k.shape[2] != dqk:
        raise ValueError(f"{fn}: k must be [T, Hkv, Dqk] with q's Dqk={dqk}, got {list(k.shape)}")
    hkv = k.shape[1]
    if v.shape[1] != hkv:
        raise ValueError(f"{fn}: v must be [T, Hkv, Dv] with k's Hkv={hkv}, got {list(v.shape)}")
    if hkv == 0 or h % hkv != 0:
        raise ValueError(f"{fn}: q's heads H={h} must be a multiple of k/v's heads Hkv={hkv}")


def check_cu_seqlens_k(fn: str, cu_seqlens_k, cu_seqlens: Tensor, device: torch.device) -> None:
    """``cu_seqlens_k`` is a contiguous 1-D int32 tensor on ``device`` with as many entries as
    ``cu_seqlens`` (checked first). Shapes only: its values are not read."""
    if not isinstance(cu_seqlens_k, Tensor) or cu_seqlens_k.dtype != torch.int32 or cu_seqlens_k.dim() != 1:
        raise ValueError(f"{fn}: cu_seqlens_k must be a 1-D int32 tensor [B + 1], got {describe(cu_seqlens_k)}")
    if cu_seqlens_k.numel() != cu_seqlens.numel():
        raise ValueError(
            f"{fn}: cu_seqlens_k must have B + 1 = {cu_seqlens.numel()} entries like cu_seqlens, "
            f"got {cu_seqlens_k.numel()}"
        )
    if cu_seqlens_k.device != device:
        raise ValueError(f"{fn}: cu_seqlens_k must be on q's device {device}, got {cu_seqlens_k.device}")
    if not cu_seqlens_k.is_contiguous():
        raise ValueError(f"{fn}: cu_seqlens_k must be contiguous, got strides {cu_seqlens_k.stride()}")


def check_max_seqlen_k(fn: str, max_seqlen_k, cu_seqlens_k) -> None:
    """``max_seqlen_k``: ``None`` or a non-negative int, and only together with ``cu_seqlens_k``."""
    if max_seqlen_k is None:
        return
    if cu_seqlens_k is None:
        raise ValueError(f"{fn}: max_seqlen_k={max_seqlen_k!r} is given without cu_seqlens_k")
    if isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, int) or max_seqlen_k < 0:
        raise ValueError(f"{fn}: max_seqlen_k must be None or a non-negative int, got {max_seqlen_k!r}")


def zero_nvfp4_scale_padding(scale_bytes: Tensor, t: int, width: int) -> None:
    """Zero the padding entries of the swizzled scale buffer of a ``[t, width]`` NVFP4 matrix.

    ``scale_bytes``: the contiguous buffer as flat uint8, ``round_up(t, 128) *
    round_up(width/16, 4)`` bytes. Padding entries are those of rows ``t ..
    round_up(t, 128) - 1`` (every column) and of columns ``width/16 .. round_up(width/16,
    4) - 1`` (every row); no other byte is touched, so rows a kernel does not own keep
    their bytes. Strided slice fills only: no index tensors, no sync.
    """
    blocks = width // nvfp4.BLOCK_SIZE
    col_tiles = -(-blocks // 4)
    if t == 0 or col_tiles == 0:
        return
    nvfp4.zero_scale_padding(scale_bytes.view(-1, col_tiles * 4), t, width)
    if blocks % 4:
        # tiles as [row tile, column tile, row % 32, (row % 128) // 32, column % 4]
        scale_bytes.view(-1, col_tiles, 32, 4, 4)[:, -1, :, :, blocks % 4 :].zero_()
