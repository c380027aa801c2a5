"""Argument checks shared by the kernels' entry points (no device work, no sync)."""

from __future__ import annotations

import torch
from torch import Tensor

HALF_DTYPES = (torch.float16, torch.bfloat16)


def describe(t) -> str:
    return f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, Tensor) else repr(t)


def check_qkv(fn: str, q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            layout = {"q": "[T, H, Dqk]", "k": "[T, Hkv, Dqk]", "v": "[T, Hkv, Dv]"}[name]
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
