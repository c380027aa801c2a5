"""The shapes bench/attention.py measures, as data: head layouts x batches (causal, bf16).

A :class:`Batch` is ``batch`` sequences of ``q_len`` new tokens, each after ``context`` cached tokens
(``context > 0``: a chunked prefill; its keys/values are context + new tokens, given to the kernels
through ``cu_seqlens_k``, causal aligned bottom-right). A :class:`Layout` is the attention's heads
and head dims (MLA's keys/values up-projected: ``kv_heads == heads``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BATCHES", "LAYOUTS", "Batch", "Layout", "Shape", "select_shapes"]


@dataclass(frozen=True)
class Layout:
    """Heads and head dims of one attention layout; ``name`` is what ``--layouts`` takes."""

    name: str
    kind: str  # MLA, MHA or GQA
    heads: int
    kv_heads: int
    dqk: int
    dv: int

    @property
    def label(self) -> str:
        heads = f"{self.heads}/{self.kv_heads}" if self.kv_heads != self.heads else str(self.heads)
        return f"{self.kind} {heads}h ({self.dqk},{self.dv})"

    def scaled(self, factor: int) -> "Layout":
        """The layout with its KV heads divided by ``factor`` (at least 1), query heads per KV head kept."""
        kv = max(1, self.kv_heads // factor)
        return Layout(self.name, self.kind, kv * (self.heads // self.kv_heads), kv, self.dqk, self.dv)


@dataclass(frozen=True)
class Batch:
    """``batch`` sequences of ``q_len`` new tokens after ``context`` cached ones; ``name`` for ``--shapes``."""

    batch: int
    q_len: int
    context: int = 0

    @property
    def name(self) -> str:
        return f"{self.batch}x{self.q_len}" + (f"+{self.context}" if self.context else "")

    def scaled(self, factor: int) -> "Batch":
        """Lengths divided by ``factor`` (queries at least 2 tokens; a context stays non-zero)."""
        return Batch(self.batch, max(2, self.q_len // factor), max(1, self.context // factor) if self.context else 0)


LAYOUTS = (
    Layout("mla16", "MLA", 16, 16, 192, 128),
    Layout("mla128", "MLA", 128, 128, 192, 128),
    Layout("mha32", "MHA", 32, 32, 128, 128),
    Layout("gqa64", "GQA", 64, 8, 128, 128),
)
BATCHES = (
    Batch(4, 128),
    Batch(32, 512),
    Batch(8, 2048),
    Batch(2, 8192),
    Batch(8, 512, 4096),  # chunked prefill: 512 new tokens after 4096 cached, 8 sequences
    Batch(1, 2048, 30000),  # chunked prefill: a long prompt's later chunk
)


@dataclass(frozen=True)
class Shape:
    """One measured problem."""

    layout: Layout
    batch: Batch

    @property
    def tokens(self) -> int:
        """Query tokens (output rows)."""
        return self.batch.batch * self.batch.q_len

    @property
    def keys(self) -> int:
        """Key/value tokens."""
        return self.batch.batch * (self.batch.context + self.batch.q_len)

    @property
    def label(self) -> str:
        return f"{self.layout.label} {self.batch.name}"

    @property
    def flops(self) -> int:
        """QK^T and PV FLOPs over the visible (query, key) pairs: query ``i`` sees ``context + i + 1`` keys."""
        b = self.batch
        pairs = b.q_len * b.context + b.q_len * (b.q_len + 1) // 2
        return b.batch * 2 * self.layout.heads * pairs * (self.layout.dqk + self.layout.dv)


def _pick(kind: str, wanted: str | None, items: tuple, name) -> list:
    if not wanted:
        return list(items)
    names = [name(x) for x in items]
    picked = []
    for w in (w.strip() for w in wanted.split(",") if w.strip()):
        if w not in names:
            raise ValueError(f"--{kind}: unknown {kind[:-1]} {w!r}; choose from {', '.join(names)}")
        picked.append(items[names.index(w)])
    return picked


def select_shapes(shapes: str | None = None, layouts: str | None = None, *, scale: int = 1) -> list[Shape]:
    """Every layout x batch, filtered by comma lists of names (``--shapes 32x512,1x2048+30000``,
    ``--layouts mla16,gqa64``; ValueError naming the choices for an unknown name), ordered by layout then
    batch, each scaled down by ``scale`` (lengths and heads; 1: as listed)."""
    picked_layouts = _pick("layouts", layouts, LAYOUTS, lambda x: x.name)
    picked_batches = _pick("shapes", shapes, BATCHES, lambda x: x.name)
    if scale < 1:
        raise ValueError(f"scale must be >= 1, got {scale}")
    return [Shape(lay.scaled(scale) if scale > 1 else lay, b.scaled(scale) if scale > 1 else b)
            for lay in picked_layouts for b in picked_batches]
