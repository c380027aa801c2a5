"""The serving trace's timed steps: every row of a step through the same attention kernels, with and without fusion.

Per layer and step, three variants over the same inputs (all rows causal, keys = each request's cached
context then its new tokens, through ``cu_seqlens_k``):

* ``unfused``: FA4's bf16 forward over every row (decode and prefill rows in one varlen call), then the
  project's quantizer over every row: the strongest unfused path, two launches;
* ``fused``: what the project's runtime does: the decode rows (one new token each) by the same FA4 bf16
  forward on the decode sub-batch, then the row-range quantizer into rows ``[0, D)``; the prefill rows by
  the fused kernel straight into rows ``[D, T)`` (one launch when the step has no decode row);
* ``fused_all``: every row by the fused kernel in one call (decode rows are one-query sequences to it).

All three write the same bytes (the kernels' contract: fused bytes = quantize(FA4 bf16)); checked per step.

The KV cache: per layer one preallocated slab; each request owns a region of it sized to its whole
life (prompt + decode tokens), planned from the schedule by :func:`plan_regions` (first fit, freed when the
request finishes), and a step's new keys/values are written in place at ``region + context_len`` (no
per-step ``torch.cat`` of the history). The kernels take a step's keys as one packed varlen buffer, so the
step's rows are gathered from the slab into a preallocated per-layer workspace before timing (a paged
kernel would read the slab in place); that gather is outside the timed region and the same for every variant.

The ceiling on paper (:func:`ceiling_ms`): per layer the fusion removes one memory-bound pass over the
attention output (FA4 writes ``T * H * Dv`` bf16 elements and the quantizer reads them back: ``4 * T * H * Dv``
bytes, at the H200's ~4.8 TB/s) and one launch (``launch_us``, an assumption, stated in the output).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusion_pass import nvfp4

import _timing
from _kernels import Kernels

__all__ = ["AttnDims", "H200_TBPS", "StepLayout", "StepRunner", "attn_dims", "ceiling_ms", "plan_regions",
           "ratio_summary", "step_layout"]

H200_TBPS = 4.8
GLOBAL_SCALE = 448.0 * 6.0 / 8.0  # attention outputs are convex combinations of randn values: |out| < 8


@dataclass(frozen=True)
class AttnDims:
    """The attention the demo model runs (MLA: keys/values up-projected, so ``kv_heads == heads``)."""

    heads: int
    kv_heads: int
    dqk: int
    dv: int


def attn_dims(model: str, tiny: bool) -> AttnDims:
    """The demo model's attention dims (``fusion_pass.demo.models``' configs)."""
    from fusion_pass.demo.models.deepseek import MLAConfig
    from fusion_pass.demo.models.gqa import GQAConfig

    if model == "mla":
        c = MLAConfig.tiny() if tiny else MLAConfig()
        return AttnDims(c.num_heads, c.num_heads, c.qk_head_dim, c.v_head_dim)
    c = GQAConfig.tiny() if tiny else GQAConfig()
    return AttnDims(c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim)


def plan_regions(steps) -> tuple[dict[str, int], int]:
    """``({request_id: first slab row}, slab rows)``: each admitted request gets ``prompt_len + decode_len``
    rows, first fit among the gaps left by finished requests (freed after their last step)."""
    free: list[tuple[int, int]] = []  # (start, size), sorted by start
    top = 0
    starts: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for step in steps:
        for a in step.admitted:
            size = a.prompt_len + a.decode_len
            for i, (start, room) in enumerate(free):
                if room >= size:
                    free[i:i + 1] = [(start + size, room - size)] if room > size else []
                    break
            else:
                start, top = top, top + size
            starts[a.request_id], sizes[a.request_id] = start, size
        for rid in step.finished:
            free.append((starts[rid], sizes[rid]))
            free.sort()
            merged: list[tuple[int, int]] = []
            for start, room in free:  # coalesce neighbours
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + room)
                else:
                    merged.append((start, room))
            free = merged
    return starts, top


@dataclass(frozen=True)
class StepLayout:
    """One step's rows: requests in the runtime's order (decodes first); ``decodes`` = D; query offsets
    ``cu_q`` and key offsets ``cu_k`` (``[B + 1]``, the packed workspace); ``new_rows`` / ``key_rows``: slab
    rows of the new tokens (token order) and of every key of the workspace (workspace order)."""

    tokens: int
    decodes: int
    prefill_tokens: int
    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    new_rows: tuple[int, ...]
    key_rows: tuple[int, ...]


def step_layout(spec, regions: dict[str, int]) -> StepLayout:
    """The :class:`StepLayout` of a ``BatchSpec`` whose requests own the slab ``regions``."""
    cu_q, cu_k, new_rows, key_rows = [0], [0], [], []
    for r in spec.requests:
        base = regions[r.request_id]
        cu_q.append(cu_q[-1] + r.query_len)
        cu_k.append(cu_k[-1] + r.context_len + r.query_len)
        new_rows += range(base + r.context_len, base + r.context_len + r.query_len)
        key_rows += range(base, base + r.context_len + r.query_len)
    decodes = sum(1 for r in spec.requests if r.query_len == 1)
    return StepLayout(cu_q[-1], decodes, cu_q[-1] - decodes, tuple(cu_q), tuple(cu_k), tuple(new_rows),
                      tuple(key_rows))


def ceiling_ms(tokens: int, dims: AttnDims, layers: int, *, tbps: float = H200_TBPS, launch_us: float = 0.0) -> float:
    """What fusing every row of a step can save at most, per step: per layer ``4 * T * H * Dv`` bytes (the bf16
    output written and read back) at ``tbps`` TB/s, plus ``launch_us`` for the launch it removes."""
    return layers * (4 * tokens * dims.heads * dims.dv / (tbps * 1e12) * 1e3 + launch_us * 1e-3)


def ratio_summary(unfused: list[float], fused: list[float], saving: list[float]) -> dict:
    """Per-step ratios ``unfused / fused``: their distribution, the overall ratio (sums), the ceiling on paper
    (``unfused / (unfused - saving)``, per step and overall) and the share of the possible saving taken."""
    ratios = [u / f for u, f in zip(unfused, fused)]
    ceilings = [u / (u - s) if u > s else None for u, s in zip(unfused, saving)]
    total_u, total_f, total_s = sum(unfused), sum(fused), sum(saving)
    return {"ratio": _timing.distribution(ratios), "overall": total_u / total_f if total_f else None,
            "ceiling": _timing.distribution([c for c in ceilings if c is not None]),
            "ceiling_overall": total_u / (total_u - total_s) if total_u > total_s else None,
            "saving_taken": (total_u - total_f) / total_s if total_s else None,
            "steps_below_0.99": sum(1 for r in ratios if r < 0.99)}


class StepRunner:
    """The KV slabs, workspaces and kernels of one trace; :meth:`run_step` measures one step."""

    VARIANTS = ("unfused", "fused", "fused_all")

    def __init__(self, kernels: Kernels, dims: AttnDims, layers: int, slab_rows: int, device, *, seed: int = 0):
        self.kernels, self.dims, self.layers, self.device = kernels, dims, layers, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(seed)
        kv = (slab_rows, dims.kv_heads)
        self.k_slab = [torch.empty(*kv, dims.dqk, dtype=torch.bfloat16, device=self.device) for _ in range(layers)]
        self.v_slab = [torch.empty(*kv, dims.dv, dtype=torch.bfloat16, device=self.device) for _ in range(layers)]
        self.k_ws = [torch.empty_like(x) for x in self.k_slab]  # a step's keys never exceed the slab
        self.v_ws = [torch.empty_like(x) for x in self.v_slab]
        self.gs = torch.full((1,), GLOBAL_SCALE, dtype=torch.float32, device=self.device)
        self.scale = dims.dqk**-0.5

    def append(self, layout: StepLayout) -> None:
        """Write the step's new keys/values (fresh randn) into the slab rows they own, in place."""
        rows = torch.tensor(layout.new_rows, dtype=torch.long, device=self.device)
        for k, v in zip(self.k_slab, self.v_slab):
            k.index_copy_(0, rows, torch.randn(len(rows), *k.shape[1:], generator=self.gen, device=self.device,
                                               dtype=k.dtype))
            v.index_copy_(0, rows, torch.randn(len(rows), *v.shape[1:], generator=self.gen, device=self.device,
                                               dtype=v.dtype))

    def _variants(self, layout: StepLayout, qs: list, outs: dict) -> dict:
        t, d, n = layout.tokens, layout.decodes, self.dims.heads * self.dims.dv
        i32 = dict(dtype=torch.int32, device=self.device)
        cu_q, cu_k = torch.tensor(layout.cu_q, **i32), torch.tensor(layout.cu_k, **i32)
        qlens = [b - a for a, b in zip(layout.cu_q[:-1], layout.cu_q[1:])]
        klens = [b - a for a, b in zip(layout.cu_k[:-1], layout.cu_k[1:])]
        tk = layout.cu_k[-1]
        attn, fused, quant, rows = (self.kernels.attention, self.kernels.fused, self.kernels.quantize_into,
                                    self.kernels.quantize_rows)
        sc = self.scale

        def unfused():
            for q, k, v, (p, s) in zip(qs, self.k_ws, self.v_ws, outs["unfused"]):
                out = attn(q, k[:tk], v[:tk], cu_q, max(qlens), causal=True, softmax_scale=sc, cu_seqlens_k=cu_k,
                           max_seqlen_k=max(klens))
                quant(out.view(t, n), self.gs, p, s)

        def fused_all():
            for q, k, v, (p, s) in zip(qs, self.k_ws, self.v_ws, outs["fused_all"]):
                fused(q, k[:tk], v[:tk], cu_seqlens=cu_q, max_seqlen=max(qlens), softmax_scale=sc, causal=True,
                      output=p, output_scale=self.gs, output_block_scale=s, cu_seqlens_k=cu_k,
                      max_seqlen_k=max(klens))

        cu_qd, cu_kd = cu_q[:d + 1], cu_k[:d + 1]
        cu_qp, cu_kp = cu_q[d:], cu_k[d:]
        kd = layout.cu_k[d]

        def split():
            for q, k, v, (p, s) in zip(qs, self.k_ws, self.v_ws, outs["fused"]):
                if d:
                    out = attn(q[:d], k[:kd], v[:kd], cu_qd, 1, causal=True, softmax_scale=sc, cu_seqlens_k=cu_kd,
                               max_seqlen_k=max(klens[:d]))
                    rows(out.view(d, n), self.gs, p, s, 0)
                if d < len(qlens):
                    fused(q, k[:tk], v[:tk], cu_seqlens=cu_qp, max_seqlen=max(qlens[d:]), softmax_scale=sc,
                          causal=True, output=p, output_scale=self.gs, output_block_scale=s, cu_seqlens_k=cu_kp,
                          max_seqlen_k=max(klens[d:]))

        return {"unfused": unfused, "fused": split, "fused_all": fused_all}

    def run_step(self, layout: StepLayout, *, warmup: int, repeats: int) -> dict:
        """Append the step's tokens, gather its keys, then time every variant (CUDA events around the layers'
        calls, median of ``repeats`` after ``warmup``, fresh randn queries before every call, outside the
        timed region; CPU: wall time) and compare their bytes. ``{"ms": {variant: median}, "equal": bool}``."""
        self.append(layout)
        idx = torch.tensor(layout.key_rows, dtype=torch.long, device=self.device)
        tk = len(layout.key_rows)
        for src, dst in ((self.k_slab, self.k_ws), (self.v_slab, self.v_ws)):
            for s, w in zip(src, dst):
                torch.index_select(s, 0, idx, out=w[:tk])
        t, n = layout.tokens, self.dims.heads * self.dims.dv
        qs = [torch.empty(t, self.dims.heads, self.dims.dqk, dtype=torch.bfloat16, device=self.device)
              for _ in range(self.layers)]
        rows, cols = nvfp4.scale_shape(t, n)
        outs = {name: [(torch.zeros(t, n // 2, dtype=torch.uint8, device=self.device),
                        torch.zeros(rows, cols, dtype=torch.float8_e4m3fn, device=self.device))
                       for _ in range(self.layers)] for name in self.VARIANTS}
        variants = self._variants(layout, qs, outs)

        def fresh(_i=0):
            for q in qs:
                q.normal_(generator=self.gen)

        fresh()
        for call in variants.values():  # one call each on the same queries: compile, then compare bytes
            call()
        equal = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                    for name in ("fused", "fused_all")
                    for pair_u, pair_f in zip(outs["unfused"], outs[name]) for a, b in zip(pair_u, pair_f))
        ms = {}
        for name, call in variants.items():
            if self.cuda:
                samples = _timing.event_ms(call, repeats=repeats, warmup=warmup, before=fresh)
            else:
                samples = []
                for _ in range(repeats):
                    fresh()
                    samples += _timing.cpu_ms(call, repeats=1, warmup=0)
            ms[name] = _timing.median(samples)
        return {"ms": ms, "equal": equal}
