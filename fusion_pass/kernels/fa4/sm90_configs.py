"""Tile configurations of the FA4 SM90 kernels: which one runs a call, and which ones are valid (data; no FA4).

A configuration is what FA4's ``FlashAttentionForwardSm90`` takes beyond the head dims and the mask: the query
tile ``tile_m`` (64 rows per math warpgroup: 128 or 192), the key tile ``tile_n``, the K/V pipeline depth
``num_stages``, ``intra_wg_overlap`` (a warpgroup issues the next QK^T before the current PV) and
``mma_pv_is_rs`` (P from registers rather than shared memory). The fused NVFP4 kernel and its twin (FA4's own
output stage) are built with the same one, so ``quantize(twin) == fused`` holds for every configuration.

:func:`config_for` picks one per (head dims, causal, sequence-length class): :data:`TABLE` where it has an entry,
else FA4's own choice (:func:`fa4_default`). The class is :func:`seqlen_class` of the longest query (or key)
sequence. The configuration is part of the compile key, so a layer compiles once per distinct configuration its
calls pick, at most once per class.

:func:`why_invalid` says why a configuration cannot be built: what FA4's SM90 class accepts (its warpgroup
count, its tile steps, the shared-memory budget; the arithmetic of FA4's own ``sm90_config_search.py``,
restated with the pipeline depth as a parameter) and what the NVFP4 epilogue needs (``Dv`` fills
``tile_hdimv``; every epilogue thread owns whole 16-element blocks of a row). FA4's register budget
(:func:`accumulator_registers`) bounds the sweep's :func:`candidates` only (a test checks them against it): FA4's
own default for D=96 is over it.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

__all__ = [
    "SEQLEN_BOUNDS",
    "SEQLEN_CLASSES",
    "TABLE",
    "Sm90Config",
    "accumulator_registers",
    "candidates",
    "config_for",
    "fa4_default",
    "seqlen_class",
    "smem_bytes",
    "why_invalid",
]


class Sm90Config(NamedTuple):
    """The constructor arguments of FA4's SM90 forward that the configuration chooses."""

    tile_m: int
    tile_n: int
    num_stages: int
    intra_wg_overlap: bool
    mma_pv_is_rs: bool

    def describe(self) -> str:
        return (f"tile {self.tile_m}x{self.tile_n}, {self.num_stages} stages, "
                f"overlap={self.intra_wg_overlap}, PV from {'registers' if self.mma_pv_is_rs else 'shared memory'}")


SEQLEN_BOUNDS = (128, 512, 2048)
"""Upper bounds (inclusive) of the sequence-length classes; a longer sequence is in the last class."""

SEQLEN_CLASSES = ("<=128", "<=512", "<=2048", ">2048")
"""Names of the classes, indexed by :func:`seqlen_class`."""


def seqlen_class(max_seqlen: int, max_seqlen_k: int | None = None) -> int:
    """Index into :data:`SEQLEN_CLASSES` of a call whose longest query sequence is ``max_seqlen`` and longest key
    sequence ``max_seqlen_k`` (``None``: the queries' own): the longer of the two decides."""
    n = max_seqlen if max_seqlen_k is None or max_seqlen_k < max_seqlen else max_seqlen_k
    return bisect.bisect_left(SEQLEN_BOUNDS, n)


def fa4_default(head_dim: int, head_dim_v: int, causal: bool) -> Sm90Config:
    """FA4 4.0.0b36's own SM90 choice (``interface._tile_size_fwd_sm90`` without locality or block sparsity,
    two K/V stages), restated so the checks need no FA4; a CPU test compares the two."""
    if head_dim <= 64:
        return Sm90Config(192, 128, 2, True, True)
    if head_dim <= 96:
        return Sm90Config(192, 128 if causal else 144, 2, True, False)
    if head_dim <= 128:
        return Sm90Config(128, 128, 2, True, True)
    if head_dim <= 192:
        return Sm90Config(128, 128 if head_dim_v <= 128 else 112, 2, True, True)
    return Sm90Config(128, 80, 2, True, True)


TABLE: dict[tuple[int, int, bool, int], Sm90Config] = {}
"""``(D, Dv, causal, seqlen class) -> configuration`` where it differs from :func:`fa4_default`. Empty by the H200
sweep's choice (``bench/tune.py --fa4``, 2026-12-02: FA4's own configuration was the fastest or within 2.3% of it at
every shape up to 512 tokens; the longer classes were not swept): every call runs FA4's own configuration."""


def config_for(head_dim: int, head_dim_v: int, causal: bool, seq_class: int) -> Sm90Config:
    """The configuration of a call (:data:`TABLE`, else FA4's own)."""
    return TABLE.get((head_dim, head_dim_v, causal, seq_class)) or fa4_default(head_dim, head_dim_v, causal)


SMEM_BYTES = 224 * 1024
"""Shared memory for the tiles: an H100/H200 SM's 228 KiB less what FA4 reserves for barriers and row state."""

REGISTERS = {2: 216, 3: 128}
"""Accumulator registers per thread FA4's SM90 forward leaves to the math warpgroups, by their count."""

_BLOCK = 16  # NVFP4 elements per scale


def _round16(n: int) -> int:
    return -(-n // 16) * 16


def accumulator_registers(cfg: Sm90Config, head_dim: int, head_dim_v: int) -> int:
    """FA4's estimate of the accumulator registers per math thread: S, O and, with overlap, P beside the next S
    (``sm90_config_search.py``). A budget, not a rule: FA4's own default for D=96 is over it (it spills)."""
    wgs = cfg.tile_m // 64
    s_regs = cfg.tile_m * cfg.tile_n // (wgs * 128)
    o_regs = cfg.tile_m * _round16(head_dim_v) // (wgs * 128)
    return s_regs + o_regs + (s_regs // 2 if cfg.intra_wg_overlap else 0)


def smem_bytes(cfg: Sm90Config, head_dim: int, head_dim_v: int) -> int:
    """Shared memory of the tiles (16-bit): Q (O is staged where Q was), ``num_stages`` K and V tiles, P unless
    it stays in registers."""
    hdim, hdimv = _round16(head_dim), _round16(head_dim_v)
    q_o = cfg.tile_m * max(hdim, hdimv) * 2
    kv = cfg.num_stages * cfg.tile_n * (hdim + hdimv) * 2
    return q_o + kv + (0 if cfg.mma_pv_is_rs else cfg.tile_m * cfg.tile_n * 2)


def why_invalid(cfg: Sm90Config, head_dim: int, head_dim_v: int, *, fused: bool = True) -> str | None:
    """Why ``cfg`` cannot run head dims ``(head_dim, head_dim_v)`` in 16-bit (None: it can): FA4's SM90 class's
    warpgroups and tile steps, the shared-memory budget, and with ``fused`` what the NVFP4 epilogue needs."""
    if not isinstance(cfg, Sm90Config):
        return f"a configuration is an Sm90Config, got {cfg!r}"
    tile_m, tile_n, stages, overlap, rs = cfg
    if tile_m not in (128, 192):
        return f"tile_m={tile_m}: FA4's SM90 forward runs 2 or 3 math warpgroups of 64 rows (128 or 192)"
    if tile_n % 16 or not 64 <= tile_n <= 192:
        return f"tile_n={tile_n}: a multiple of 16 in 64..192 (the wgmma K step of PV, FA4's search range)"
    if stages not in (2, 3):
        return f"num_stages={stages}: 2 (FA4's) or 3 K/V stages"
    if not isinstance(overlap, bool) or not isinstance(rs, bool):
        return "intra_wg_overlap and mma_pv_is_rs are bools"
    smem = smem_bytes(cfg, head_dim, head_dim_v)
    if smem > SMEM_BYTES:
        return f"{smem // 1024} KiB of shared memory, over {SMEM_BYTES // 1024} KiB"
    if fused:
        if head_dim_v % _BLOCK or _round16(head_dim_v) != head_dim_v:
            return f"Dv={head_dim_v}: the NVFP4 epilogue needs Dv a multiple of {_BLOCK} filling tile_hdimv"
        threads = 128 * (tile_m // 64)
        if threads % (head_dim_v // _BLOCK):
            return (f"Dv={head_dim_v} splits into {head_dim_v // _BLOCK} blocks of 16, which does not divide the "
                    f"{threads} epilogue threads of a {tile_m}-row tile")
    return None


_T, _F = True, False
_SWEEP = {
    # (D, Dv): (tile_m, tile_n, num_stages, intra_wg_overlap, mma_pv_is_rs), FA4's default first
    (192, 128): [(128, 128, 2, _T, _T), (128, 128, 2, _F, _T), (128, 112, 2, _T, _T), (128, 112, 2, _T, _F),
                 (128, 96, 2, _T, _T), (128, 96, 2, _F, _T), (128, 80, 2, _T, _T), (128, 64, 2, _T, _T),
                 (128, 80, 3, _T, _T), (128, 64, 3, _T, _T), (192, 96, 2, _F, _T), (192, 80, 2, _T, _T)],
    (128, 128): [(128, 128, 2, _T, _T), (128, 128, 2, _F, _T), (128, 128, 2, _T, _F), (128, 176, 2, _T, _T),
                 (128, 160, 2, _T, _T), (128, 144, 2, _T, _T), (128, 112, 2, _T, _T), (128, 96, 2, _T, _T),
                 (128, 80, 2, _T, _T), (128, 96, 3, _T, _T), (128, 128, 3, _T, _T), (192, 128, 2, _F, _T),
                 (192, 96, 2, _F, _T)],
}


def candidates(head_dim: int, head_dim_v: int, causal: bool = True) -> list[Sm90Config]:
    """The configurations ``bench/tune.py`` times for these head dims (causal): FA4's default first, then key
    tiles around it, a third K/V stage, three math warpgroups, each of FA4's flags turned off. All valid
    (:func:`why_invalid`; a test checks) and, but for FA4's default, within FA4's register budget
    (:func:`accumulator_registers`). Head dims the sweep does not cover get FA4's default alone."""
    out = [fa4_default(head_dim, head_dim_v, causal)]
    for cfg in map(Sm90Config._make, _SWEEP.get((head_dim, head_dim_v), []) if causal else []):
        if cfg not in out:
            out.append(cfg)
    return out
