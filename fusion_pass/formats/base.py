"""What an output format is to the rest of the project: :class:`OutputFormat`, one instance per format.

A format says which buffers a fused attention call writes for a ``[T, N]`` output (``N = H * Dv``), how the
bytes of those buffers are computed from the float attention output (a reference quantizer, the writers'
contract), how far a dequantized element may be from the float one (its error bound), which outputs it can be
written for in per-head tiles, and which quant ops of a graph it replaces (their documented forms; the op
vocabularies bind them). vLLM's ``QuantKey`` keys the same choice; :attr:`OutputFormat.key` reads like one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass(frozen=True)
class ScaleKind:
    """How the format's scales are chosen: ``static`` (given, one per tensor) or dynamic (computed from the data)
    over groups of ``group`` consecutive output columns of a row (``None``: the whole tensor)."""

    static: bool
    group: int | None
    power_of_two: bool = False

    def __str__(self) -> str:
        where = "per tensor" if self.group is None else f"per token, {self.group}-column groups"
        return f"{'static' if self.static else 'dynamic'} {where}{', UE8M0' if self.power_of_two else ''}"


@dataclass(frozen=True)
class BufferSpec:
    """One buffer a fused call writes: ``name``, ``dtype`` and ``shape(T, N)`` (the allocation's shape; the
    layout the writers use is the format's to say). ``strided``: the buffer may be a strided view (FP8 group
    scales: column-major), which every writer writes through; otherwise it is row-major and whole."""

    name: str
    dtype: torch.dtype
    shape: Callable[[int, int], tuple[int, ...]]
    strided: bool = False


@dataclass(frozen=True)
class OutputFormat:
    """One output format of the fused attention call.

    * ``name``: the format's name in settings, reports and refusal reasons;
    * ``element``: the quantized element's dtype as stored (NVFP4: two e2m1 codes a uint8);
    * ``scales``: :class:`ScaleKind`;
    * ``columns``: the width ``N`` must be a multiple of it (NVFP4's 16-element blocks, FP8 groups' 128);
    * ``head_multiple``: ``Dv`` must be a multiple of it for a per-head tile to hold whole blocks / groups
      (``None``: any head width);
    * ``buffers``: the buffers a call writes, in the quant op's order;
    * ``quantize``: the reference quantizer ``(x [T, N] float, *scale inputs) -> buffers``: the bytes every writer
      must produce from the same float output;
    * ``error_bound``: ``(x, *scale inputs or the quantizer's own scales) -> float32 [T, N]``;
    * ``replaces``: the quant forms the pass replaces with this format (documentation; the vocabularies bind
      the ops), and ``emitted_by`` where they come from.
    """

    name: str
    element: torch.dtype
    scales: ScaleKind
    columns: int
    head_multiple: int | None
    buffers: tuple[BufferSpec, ...]
    quantize: Callable[..., tuple[torch.Tensor, ...]]
    error_bound: Callable[..., torch.Tensor]
    replaces: tuple[str, ...] = field(default=())

    @property
    def key(self) -> str:
        """``<element> <scales>``, as vLLM's ``QuantKey`` prints a format."""
        return f"{self.name}: {self.element} ({self.scales})"

    def refusal(self, num_heads: int, head_dim_v: int) -> str | None:
        """Why a ``[T, num_heads * head_dim_v]`` attention output cannot be written in this format by a per-head
        tile (the reason a match or a call is refused with), or None."""
        width = num_heads * head_dim_v
        if width % self.columns:
            return f"{self.name} needs an output width (heads x v_head_dim = {width}) divisible by {self.columns}"
        if self.head_multiple is not None and head_dim_v % self.head_multiple:
            return (f"{self.name} writes one scale per {self.head_multiple} columns, computed inside a head's tile: "
                    f"v_head_dim {head_dim_v} is not a multiple of {self.head_multiple}")
        return None

    def allocate(self, tokens: int, width: int, device=None) -> dict[str, torch.Tensor]:
        """Empty buffers of a ``[tokens, width]`` output, by name."""
        return {b.name: torch.empty(b.shape(tokens, width), dtype=b.dtype, device=device) for b in self.buffers}


@dataclass(frozen=True)
class RefusedFormat:
    """A quant form the pass sees in graphs but never fuses: ``name`` (the refusal reason a match reports),
    ``op`` (vLLM's ``(namespace, name, overload)``), its call ``form`` and why it is refused (``reason``)."""

    name: str
    op: tuple[str, str, str]
    form: str
    reason: str
