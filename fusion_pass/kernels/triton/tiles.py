"""Tile sizes and launch options of the Triton flash-attention kernel (:mod:`.flash_attention`), and how it
splits a query/key head dim into power-of-two dot widths."""

from __future__ import annotations

import torch
import triton

__all__ = ["LONG_SEQUENCE", "attention_config", "split_head_dim"]


def split_head_dim(head_dim: int) -> tuple[int, int]:
    """``(main, tail)`` power-of-two dot widths covering ``head_dim`` (tail 0 when none).

    ``main`` is the largest power of two <= ``head_dim`` (at least 16); the tail
    covers the rest, at least 16 wide (a dot's minimum), masked past ``head_dim``.
    192 -> (128, 64); 128 -> (128, 0); 72 -> (64, 16).
    """
    main = max(16, 1 << (head_dim.bit_length() - 1))
    rest = head_dim - main
    tail = 0 if rest <= 0 else max(16, triton.next_power_of_2(rest))
    return main, tail


LONG_SEQUENCE = 1024
"""From this ``max_seqlen`` on, the CUDA configs use 128 x 128 tiles."""


def attention_config(head_dim_qk: int, head_dim_v: int, device: torch.device, max_seqlen: int = 0) -> dict:
    """Tile sizes and launch options for these head dims and sequence length on ``device``.

    ``BLOCK_M`` must be a multiple of ``BLOCK_N`` (the causal loop splits at a
    query tile's first row). Chosen with ``bench/tune.py`` on the H200, by the
    NVFP4-epilogue time (docs/benchmarks.md): 64-row tiles win at 512 tokens per
    sequence (more programs to fill 132 SMs), 128 x 128 tiles at 8192. The
    interpreter (CPU tensors) gets small tiles so tests stay fast.
    """
    if device.type != "cuda":
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
    mla = head_dim_qk + head_dim_v > 256  # MLA prefill 192/128
    if max_seqlen >= LONG_SEQUENCE:
        return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2 if mla else 3}
    if mla:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3}
