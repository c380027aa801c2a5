"""Chunked-prefill test batches shared by test_kernels.py (Triton) and test_fa4.py (FA4 on Hopper).

Queries of each sequence attend to its keys in their own workspace (``cu_seqlens_k``: cached
context, then the new tokens; causal aligned to the end). :func:`context_case` generates a batch
from a seed, :func:`context_inputs` its tensors, :func:`reference_context_attention` float64
attention over the full sequences with its log-sum-exp. Imported by the test modules with this
folder on ``sys.path`` (as ``graph_cases``).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ContextLimits:
    """Sizes of generated batches: a random sequence has ``2..max_queries`` queries and
    ``0..max_context`` context tokens, a long context ``max_context..max_long_context``; queries
    start at a row in ``1..max_row0`` and ``1..max_tail`` rows follow them."""

    max_queries: int
    max_context: int
    max_long_context: int
    max_row0: int
    max_tail: int


@dataclass(frozen=True)
class ContextCase:
    """Per sequence ``Lq`` new tokens attending to ``Lk`` keys (``Lk - Lq`` context tokens when
    causal); queries at rows ``row0 + ...`` of a ``row0 + sum(Lq) + tail``-row q."""

    seed: int
    query_lens: tuple[int, ...]
    key_lens: tuple[int, ...]
    row0: int
    tail: int

    def __str__(self) -> str:
        lengths = f"Lq {list(self.query_lens)}, Lk {list(self.key_lens)}"
        return f"seed {self.seed}: {lengths}, row0 {self.row0}, tail {self.tail}"


def context_case(seed: int, causal: bool, limits: ContextLimits, *, row0: bool = True) -> ContextCase:
    """A batch holding, in random order: one query, no context (``Lk = Lq``), a long context
    (``Lk >> Lq``), no queries (``Lq = 0``), random ones; non-causal also no keys (``Lk = 0``)
    and fewer keys than queries. Without ``row0``, queries start at row 0 and no rows follow."""
    rng = random.Random(seed)
    kinds = ["single", "no_context", "long_context", "no_queries"] + ["random"] * rng.randint(0, 2)
    if not causal:
        kinds += ["no_keys", "short_keys"]
    rng.shuffle(kinds)
    query_lens, key_lens = [], []
    for kind in kinds:
        lq = rng.randint(2, limits.max_queries)
        lk = lq + rng.randint(0, limits.max_context)
        if kind == "single":
            lq, lk = 1, 1 + rng.randint(0, limits.max_context)
        elif kind == "no_context":
            lk = lq
        elif kind == "long_context":
            lq = rng.randint(1, 3)
            lk = lq + rng.randint(limits.max_context, limits.max_long_context)
        elif kind == "no_queries":
            lq = 0
        elif kind == "no_keys":
            lk = 0
        elif kind == "short_keys":
            lk = rng.randint(1, lq - 1)
        query_lens.append(lq)
        key_lens.append(lk)
    first_row = rng.randint(1, limits.max_row0) if row0 else 0
    tail = rng.randint(1, limits.max_tail) if row0 else 0
    return ContextCase(seed, tuple(query_lens), tuple(key_lens), first_row, tail)


def cumulative(lengths, start: int = 0, *, device) -> torch.Tensor:
    """int32 ``[start, start + l0, start + l0 + l1, ...]`` on ``device``."""
    return torch.tensor([start] + [start + s for s in itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def context_inputs(case: ContextCase, heads, dtype, device, *, spread_v: bool = False):
    """``(q, k, v, cu_seqlens, cu_seqlens_k)`` for ``heads = (H, Hkv, Dqk, Dv)``: unit-normal
    ``dtype`` tensors on ``device`` drawn from the case's seed; ``spread_v`` scales each value
    row by ``exp`` of a normal draw (magnitudes over a few orders)."""
    num_heads, num_kv_heads, dqk, dv = heads
    gen = torch.Generator().manual_seed(case.seed)
    t = case.row0 + sum(case.query_lens) + case.tail
    tk = sum(case.key_lens)
    q = torch.randn(t, num_heads, dqk, generator=gen)
    k = torch.randn(tk, num_kv_heads, dqk, generator=gen)
    v = torch.randn(tk, num_kv_heads, dv, generator=gen)
    if spread_v:
        v = v * torch.exp(torch.randn(tk, num_kv_heads, 1, generator=gen))
    q, k, v = (x.to(device, dtype) for x in (q, k, v))
    return q, k, v, cumulative(case.query_lens, case.row0, device=device), cumulative(case.key_lens, device=device)


def spans(cu: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def reference_context_attention(q, k, v, cu, cu_k, causal: bool, scale: float):
    """float64 attention (on q's device) over each sequence's full keys, causal bottom-right (key
    ``j`` visible to query ``i`` iff ``j <= i + Lk - Lq``), scores times ``scale``:
    ``(out [T, H, Dv], lse [T, H])`` on q's device, rows outside the sequences 0 / -inf."""
    t, h, _ = q.shape
    group = h // k.shape[1]
    out = torch.zeros(t, h, v.shape[2], dtype=torch.float64, device=q.device)
    lse = torch.full((t, h), float("-inf"), dtype=torch.float64, device=q.device)
    for (a, b), (ka, kb) in zip(spans(cu), spans(cu_k)):
        ks = k[ka:kb].double().repeat_interleave(group, 1)
        vs = v[ka:kb].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].double(), ks) * scale
        if causal:
            visible = torch.ones(b - a, kb - ka, dtype=torch.bool, device=q.device).tril((kb - ka) - (b - a))
            scores = scores.masked_fill(~visible, float("-inf"))
        row_lse = torch.logsumexp(scores, -1)
        p = torch.exp(scores - torch.where(row_lse.isneginf(), 0.0, row_lse)[..., None])
        out[a:b] = torch.einsum("hqk,khd->qhd", p, vs)
        lse[a:b] = row_lse.t()
    return out, lse


def call_without_host_sync(call) -> None:
    """``call()`` once (it may compile and synchronize), then again under
    ``torch.cuda.set_sync_debug_mode("error")``: a device synchronization in the second call raises."""
    call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
