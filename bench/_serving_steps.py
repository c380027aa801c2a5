"""The serving trace's timed steps: every row of a step through the same attention kernels, with and without fusion.

Per layer and step, seven variants over the same inputs (all rows causal, keys = each request's cached
context then its new tokens). Four read the keys as one packed varlen buffer (through ``cu_seqlens_k``):

* ``unfused``: FA4's bf16 forward over every row (decode and prefill rows in one varlen call), then the
  project's quantizer over every row: the fewest launches an unfused path can have, two;
* ``unfused_split``: the rows split as the runtime (and vLLM's MLA layer) splits them: the decode rows by the
  same FA4 bf16 call on the decode sub-batch as ``fused`` and the row-range quantizer into rows ``[0, D)``
  (the very calls of ``fused``); the prefill rows by FA4 bf16 on the prefill sub-batch (the offsets of
  ``fused``'s fused call) and the row-range quantizer into rows ``[D, T)``. A step without decode rows is
  ``unfused``'s work (one attention call, one quantizer call); one without prefill rows is ``fused``'s;
* ``fused``: what the project's runtime does: the decode rows as in ``unfused_split``; the prefill rows by
  the fused kernel straight into rows ``[D, T)`` (one launch when the step has no decode row);
* ``fused_all``: every row by the fused kernel in one call (decode rows are one-query sequences to it).

Three read the KV slab in place through a page table (FlashAttention's / vLLM's paged varlen semantics: the
slab seen as pages of ``page_size`` rows, ``seqused_k`` keys per sequence):

* ``unfused_paged``: FA4's bf16 paged forward over every row in one call, then the quantizer over every row:
  what vLLM's FLASH_ATTN backend launches (one varlen launch over every row of the step, on the paged cache),
  plus the quant;
* ``fused_paged``: every row by the fused paged kernel in one call;
* ``pass_on``: what the pass does with the default policy (:func:`fusion_pass.runtime.policy.verdict` on the
  runner's device, :meth:`StepRunner.pass_on_choice`): a step without decode rows is a ``prefill`` call, fused
  as ``fused_all`` does it (one fused varlen call over the packed workspace); a step with decode and prefill
  rows is a ``mixed_one_call`` call: ``fused_paged``'s call when the policy fuses that class, else
  ``unfused_paged``'s; a decode-only step is never fused by the pass: ``unfused_paged``'s calls. Its calls are
  the chosen variant's, into its own buffers, timed on their own.

``unfused_split`` quantizes its two parts by two row-range quantizer calls. vLLM's MLA layer instead has its
decode and prefill paths fill one ``[T, H * Dv]`` buffer and the compiled graph quantizes it in one call; but
FA4's bf16 call returns a new tensor (no ``out=``), so one quantizer call here would first need one part
copied next to the other (or a ``torch.cat``): a copy launch for the quantizer launch saved, and a pass over
the copied rows on top. Two row-range calls launch no more and move the fewest bytes, leave the decode rows'
calls identical to ``fused``'s, and make ``unfused_split - fused`` exactly what fusing the prefill rows
removes (their bf16 pass and one launch).

Bytes, compared pairwise by construction (:data:`CHECKED_PAIRS`): ``fused_all`` against ``unfused`` (the same
one call), ``fused`` against ``unfused_split`` (the same sub-batch calls) and ``fused_paged`` against
``unfused_paged`` (the same one paged call): equal by the kernels' contract (fused bytes = quantize(FA4 bf16)
for the same call). A row's bytes may depend on which sub-batch computes it (a per-call tile configuration
chosen from the batch's longest sequence) and on whether the keys come packed or paged (different kernels'
configurations), so ``fused`` against ``unfused`` and ``unfused_paged`` against ``unfused`` are recorded
(:data:`INFO_PAIRS`) but not required.

The KV cache: per layer one preallocated slab (filled with randn once, so a prefix hit's cached context holds
values); each request owns a region of it sized to its whole life (prompt + decode tokens) rounded up to whole
pages, planned from the schedule by :func:`plan_regions` (first fit, page-aligned, freed when the request
finishes), and a step's new keys/values are written in place at ``region + context_len`` (no per-step
``torch.cat`` of the history). The paged variants read the slab in place: a request's pages are its region's
pages in order, so its page-table row is ``region_start // page_size + arange(ceil(keys / page_size))``
(:func:`page_table_rows`, padded with page 0 to the step's widest row, as vLLM's block table is). The varlen
variants take a step's keys as one packed buffer, so the step's rows are gathered from the slab into a
preallocated per-layer workspace before timing; that gather is outside the timed region and the same for every
varlen variant (``pass_on``'s prefill steps included: the runtime's own context gather, for a prefill with
cached context, is not timed here).

The ceiling on paper (:func:`ceiling_ms`): per layer the fusion removes one memory-bound pass over the
attention output rows it fuses (FA4 writes ``rows * H * Dv`` bf16 elements and the quantizer reads them back:
``4 * rows * H * Dv`` bytes, at the H200's ~4.8 TB/s) and one launch (``launch_us``, an assumption, stated in
the output). Against ``unfused`` the rows are all ``T`` rows (:func:`ceiling_ms` of ``T``: what fusing every
row can save); against ``unfused_split`` the ``P`` prefill rows (:func:`split_ceiling_ms`: the decode rows are
quantized after attention on both sides; nothing is saved on a step without prefill rows); against
``unfused_paged``, ``T`` for ``fused_paged`` and for ``pass_on`` on the steps it fuses, 0 on the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fusion_pass import nvfp4
from fusion_pass.runtime import policy

import _timing
from _kernels import Kernels

__all__ = ["CHECKED_PAIRS", "DEFAULT_PAGE_SIZE", "INFO_PAIRS", "AttnDims", "H200_TBPS", "StepLayout", "StepRunner",
           "attn_dims", "ceiling_ms", "page_table_rows", "pair_key", "plan_regions", "ratio_summary",
           "split_ceiling_ms", "step_layout"]

H200_TBPS = 4.8
GLOBAL_SCALE = 448.0 * 6.0 / 8.0  # attention outputs are convex combinations of randn values: |out| < 8

DEFAULT_PAGE_SIZE = 16  # vLLM's default block size

# the same calls: bytes must be equal
CHECKED_PAIRS = (("fused_all", "unfused"), ("fused", "unfused_split"), ("fused_paged", "unfused_paged"))
INFO_PAIRS = (("fused", "unfused"), ("unfused_paged", "unfused"))  # other calls: recorded, not required


def pair_key(pair: tuple[str, str]) -> str:
    """A pair's name in the results: ``"fused_all==unfused"``."""
    return "==".join(pair)


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


def plan_regions(steps, align: int = 1) -> tuple[dict[str, int], int]:
    """``({request_id: first slab row}, slab rows)``: each admitted request gets ``prompt_len + decode_len``
    rows rounded up to a multiple of ``align`` (a page: every region starts on a page and holds whole pages,
    and the slab is whole pages), first fit among the gaps left by finished requests (freed after their last
    step)."""
    if align < 1:
        raise ValueError(f"plan_regions: align must be >= 1, got {align}")
    free: list[tuple[int, int]] = []  # (start, size), sorted by start
    top = 0
    starts: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for step in steps:
        for a in step.admitted:
            size = -(-(a.prompt_len + a.decode_len) // align) * align
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
    rows of the new tokens (token order) and of every key of the workspace (workspace order); ``starts``: each
    request's first slab row (its region), in the layout's order."""

    tokens: int
    decodes: int
    prefill_tokens: int
    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    new_rows: tuple[int, ...]
    key_rows: tuple[int, ...]
    starts: tuple[int, ...] = ()

    @property
    def seqused_k(self) -> tuple[int, ...]:
        """Keys per request (context + new tokens), the paged kernels' ``seqused_k``."""
        return tuple(b - a for a, b in zip(self.cu_k[:-1], self.cu_k[1:]))


def step_layout(spec, regions: dict[str, int]) -> StepLayout:
    """The :class:`StepLayout` of a ``BatchSpec`` whose requests own the slab ``regions``."""
    cu_q, cu_k, new_rows, key_rows, starts = [0], [0], [], [], []
    for r in spec.requests:
        base = regions[r.request_id]
        starts.append(base)
        cu_q.append(cu_q[-1] + r.query_len)
        cu_k.append(cu_k[-1] + r.context_len + r.query_len)
        new_rows += range(base + r.context_len, base + r.context_len + r.query_len)
        key_rows += range(base, base + r.context_len + r.query_len)
    decodes = sum(1 for r in spec.requests if r.query_len == 1)
    return StepLayout(cu_q[-1], decodes, cu_q[-1] - decodes, tuple(cu_q), tuple(cu_k), tuple(new_rows),
                      tuple(key_rows), tuple(starts))


def page_table_rows(layout: StepLayout, page_size: int) -> tuple[tuple[int, ...], ...]:
    """The step's page table ``[B][max_pages]`` over the slab seen as pages of ``page_size`` rows: request ``b``'s
    row lists its region's pages in order, ``starts[b] // page_size + arange(ceil(seqused_k[b] / page_size))``,
    padded with page 0 to the widest row (entries past a row's keys are never read). The regions must start on
    a page (:func:`plan_regions` with ``align=page_size``)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    misaligned = [s for s in layout.starts if s % page_size]
    if misaligned:
        raise ValueError(f"regions starting at slab rows {misaligned[:5]} are not aligned to pages of {page_size} "
                         f"rows: plan them with plan_regions(steps, align={page_size})")
    used = [-(-n // page_size) for n in layout.seqused_k]
    width = max(used, default=0)
    return tuple(tuple(range(s // page_size, s // page_size + u)) + (0,) * (width - u)
                 for s, u in zip(layout.starts, used))


def ceiling_ms(tokens: int, dims: AttnDims, layers: int, *, tbps: float = H200_TBPS, launch_us: float = 0.0) -> float:
    """What fusing ``tokens`` rows of a step (``T``: every row) can save at most, per step: per layer
    ``4 * tokens * H * Dv`` bytes (the bf16 output written and read back) at ``tbps`` TB/s, plus ``launch_us``
    for the launch it removes."""
    return layers * (4 * tokens * dims.heads * dims.dv / (tbps * 1e12) * 1e3 + launch_us * 1e-3)


def split_ceiling_ms(layout: StepLayout, dims: AttnDims, layers: int, *, tbps: float = H200_TBPS,
                     launch_us: float = 0.0) -> float:
    """What ``fused`` can save at most against ``unfused_split``, per step: :func:`ceiling_ms` of the prefill
    rows only (the decode rows are quantized after attention on both sides); 0 without prefill rows."""
    if not layout.prefill_tokens:
        return 0.0
    return ceiling_ms(layout.prefill_tokens, dims, layers, tbps=tbps, launch_us=launch_us)


def ratio_summary(unfused: list[float], fused: list[float], saving: list[float]) -> dict:
    """Per-step ratios ``unfused / fused`` (``unfused``: the baseline's ms per step, ``unfused`` or
    ``unfused_split``; ``fused``: the fused variant's; ``saving``: the ceiling's ms per step against that
    baseline): their distribution, the overall ratio (sums), the ceiling on paper (``unfused / (unfused -
    saving)``, per step and overall) and the share of the possible saving taken."""
    ratios = [u / f for u, f in zip(unfused, fused)]
    ceilings = [u / (u - s) if u > s else None for u, s in zip(unfused, saving)]
    total_u, total_f, total_s = sum(unfused), sum(fused), sum(saving)
    return {"ratio": _timing.distribution(ratios), "overall": total_u / total_f if total_f else None,
            "ceiling": _timing.distribution([c for c in ceilings if c is not None]),
            "ceiling_overall": total_u / (total_u - total_s) if total_u > total_s else None,
            "saving_taken": (total_u - total_f) / total_s if total_s else None,
            "steps_below_0.99": sum(1 for r in ratios if r < 0.99)}


class StepRunner:
    """The KV slabs (also seen as pages), workspaces and kernels of one trace; :meth:`run_step` measures one step.

    ``slab_rows`` is rounded up to whole pages of ``page_size`` rows; the regions the steps' layouts name must
    start on a page (:func:`plan_regions` with ``align=page_size``) for the paged variants."""

    FORMAT = "nvfp4"
    VARIANTS = ("unfused", "unfused_split", "fused", "fused_all", "unfused_paged", "fused_paged", "pass_on",
                "paged_bf16")
    ABSENT: dict[str, str] = {}
    """Variants this format has no kernel for, with the reason (none for NVFP4; see ``_serving_steps_fp8.py``)."""
    CHECKED_PAIRS = CHECKED_PAIRS
    INFO_PAIRS = INFO_PAIRS

    def __init__(self, kernels: Kernels, dims: AttnDims, layers: int, slab_rows: int, device, *, seed: int = 0,
                 page_size: int = DEFAULT_PAGE_SIZE):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.kernels, self.dims, self.layers, self.device = kernels, dims, layers, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(seed)
        self.page_size = page_size
        self.num_pages = max(1, -(-slab_rows // page_size))
        kv = (self.num_pages * page_size, dims.kv_heads)
        # randn once: the rows a step reads but never wrote (a prefix hit's cached context) hold values, not
        # whatever the allocator left there (a NaN would spread through FA4's masked tiles)
        bf16 = dict(dtype=torch.bfloat16, device=self.device, generator=self.gen)
        self.k_slab = [torch.randn(*kv, dims.dqk, **bf16) for _ in range(layers)]
        self.v_slab = [torch.randn(*kv, dims.dv, **bf16) for _ in range(layers)]
        pages = (self.num_pages, page_size)
        self.k_pages = [x.view(*pages, *x.shape[1:]) for x in self.k_slab]  # the same memory, as pages
        self.v_pages = [x.view(*pages, *x.shape[1:]) for x in self.v_slab]
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

    def pass_on_choice(self, layout: StepLayout) -> dict:
        """What the pass does with this step under the default policy: ``{"plan", "fused", "variant", "why"}``.

        A step without decode rows is a ``prefill`` call (``fused_all``'s fused varlen call when the policy fuses
        it); one with decode and prefill rows a ``mixed_one_call`` call (``fused_paged`` when the policy fuses it);
        a call the policy refuses runs the unfused path, ``unfused_paged``. A decode-only step (plan ``"decode"``,
        not a row plan of the policy) is never fused by the pass: ``unfused_paged``."""
        if layout.decodes and not layout.prefill_tokens:
            return {"plan": "decode", "fused": False, "variant": "unfused_paged",
                    "why": "decode rows only: the pass never fuses them"}
        plan = "mixed_one_call" if layout.decodes else "prefill"
        fuse, why = policy.verdict(self.device, plan)
        variant = ("fused_paged" if layout.decodes else "fused_all") if fuse else "unfused_paged"
        return {"plan": plan, "fused": bool(fuse), "variant": variant, "why": why}

    def call_args(self, layout: StepLayout) -> tuple:
        """The step's offsets for the kernels: ``(cu_q, cu_k, qlens, klens, tk, paged)`` (int32 device tensors,
        per-request query and key lengths, the packed keys' count, the paged calls' keyword arguments)."""
        i32 = dict(dtype=torch.int32, device=self.device)
        cu_q, cu_k = torch.tensor(layout.cu_q, **i32), torch.tensor(layout.cu_k, **i32)
        seqused_k = torch.tensor(layout.seqused_k, **i32)
        page_table = torch.tensor(page_table_rows(layout, self.page_size), **i32)
        qlens = [b - a for a, b in zip(layout.cu_q[:-1], layout.cu_q[1:])]
        klens = [b - a for a, b in zip(layout.cu_k[:-1], layout.cu_k[1:])]
        paged = dict(cu_seqlens=cu_q, max_seqlen=max(qlens), seqused_k=seqused_k, page_table=page_table,
                     max_seqlen_k=max(klens), softmax_scale=self.scale, causal=True)
        return cu_q, cu_k, qlens, klens, layout.cu_k[-1], paged

    def gather(self, layout: StepLayout) -> None:
        """Append the step's tokens to the slab and gather its keys into the packed workspace (not timed)."""
        self.append(layout)
        idx = torch.tensor(layout.key_rows, dtype=torch.long, device=self.device)
        tk = len(layout.key_rows)
        for src, dst in ((self.k_slab, self.k_ws), (self.v_slab, self.v_ws)):
            for s, w in zip(src, dst):
                torch.index_select(s, 0, idx, out=w[:tk])

    def new_queries(self, layout: StepLayout) -> tuple[list, Callable[[], None]]:
        """Per layer an uninitialized bf16 ``q [T, H, Dqk]``, and ``fresh()`` refilling them with randn."""
        qs = [torch.empty(layout.tokens, self.dims.heads, self.dims.dqk, dtype=torch.bfloat16, device=self.device)
              for _ in range(self.layers)]

        def fresh(_i=0):
            for q in qs:
                q.normal_(generator=self.gen)

        return qs, fresh

    def _variants(self, layout: StepLayout, qs: list, outs: dict, choice: dict) -> dict:
        t, d, n = layout.tokens, layout.decodes, self.dims.heads * self.dims.dv
        cu_q, cu_k, qlens, klens, tk, paged = self.call_args(layout)
        attn, fused, quant, rows = (self.kernels.attention, self.kernels.fused, self.kernels.quantize_into,
                                    self.kernels.quantize_rows)
        attn_paged, fused_paged = self.kernels.attention_paged, self.kernels.fused_paged
        sc = self.scale

        def unfused(bufs):
            for q, k, v, (p, s) in zip(qs, self.k_ws, self.v_ws, bufs):
                out = attn(q, k[:tk], v[:tk], cu_q, max(qlens), causal=True, softmax_scale=sc, cu_seqlens_k=cu_k,
                           max_seqlen_k=max(klens))
                quant(out.view(t, n), self.gs, p, s)

        def unfused_paged(bufs):  # vLLM's FLASH_ATTN: one launch over every row, the cache read in place
            for q, k, v, (p, s) in zip(qs, self.k_pages, self.v_pages, bufs):
                out = attn_paged(q, k, v, **paged)
                quant(out.view(t, n), self.gs, p, s)

        def paged_bf16(bufs):  # FA4 bf16 paged alone: no quantizer (the fused paged kernel's floor); writes no bufs
            for q, k, v in zip(qs, self.k_pages, self.v_pages):
                attn_paged(q, k, v, **paged)

        def fused_paged_all(bufs):
            for q, k, v, (p, s) in zip(qs, self.k_pages, self.v_pages, bufs):
                fused_paged(q, k, v, **paged, output=p, output_scale=self.gs, output_block_scale=s)

        def fused_all(bufs):
            for q, k, v, (p, s) in zip(qs, self.k_ws, self.v_ws, bufs):
                fused(q, k[:tk], v[:tk], cu_seqlens=cu_q, max_seqlen=max(qlens), softmax_scale=sc, causal=True,
                      output=p, output_scale=self.gs, output_block_scale=s, cu_seqlens_k=cu_k,
                      max_seqlen_k=max(klens))

        cu_qd, cu_kd = cu_q[:d + 1], cu_k[:d + 1]
        cu_qp, cu_kp = cu_q[d:], cu_k[d:]
        kd = layout.cu_k[d]
        prefills = d < len(qlens)

        def decode_rows(q, k, v, p, s):  # the decode sub-batch, the same calls in `fused` and `unfused_split`
            out = attn(q[:d], k[:kd], v[:kd], cu_qd, 1, causal=True, softmax_scale=sc, cu_seqlens_k=cu_kd,
                       max_seqlen_k=max(klens[:d]))
            rows(out.view(d, n), self.gs, p, s, 0)

        def unfused_split(bufs):
            for q, k, v, (p, s) in zip(qs, self.k_ws, self.v_ws, bufs):
                if d:
                    decode_rows(q, k, v, p, s)
                if prefills:  # the offsets of `split`'s fused call; rows [D, T) of the output are written
                    out = attn(q, k[:tk], v[:tk], cu_qp, max(qlens[d:]), causal=True, softmax_scale=sc,
                               cu_seqlens_k=cu_kp, max_seqlen_k=max(klens[d:]))
                    if d:
                        rows(out.view(t, n)[d:], self.gs, p, s, d)
                    else:  # no decode row: `unfused`'s work
                        quant(out.view(t, n), self.gs, p, s)

        def split(bufs):
            for q, k, v, (p, s) in zip(qs, self.k_ws, self.v_ws, bufs):
                if d:
                    decode_rows(q, k, v, p, s)
                if prefills:
                    fused(q, k[:tk], v[:tk], cu_seqlens=cu_qp, max_seqlen=max(qlens[d:]), softmax_scale=sc,
                          causal=True, output=p, output_scale=self.gs, output_block_scale=s, cu_seqlens_k=cu_kp,
                          max_seqlen_k=max(klens[d:]))

        bodies = {"unfused": unfused, "unfused_split": unfused_split, "fused": split, "fused_all": fused_all,
                  "unfused_paged": unfused_paged, "fused_paged": fused_paged_all, "paged_bf16": paged_bf16}
        bodies["pass_on"] = bodies[choice["variant"]]  # the chosen variant's calls, into pass_on's own buffers
        return {name: _bound(name, bodies[name], outs[name]) for name in self.VARIANTS}

    def prepare(self, layout: StepLayout, choice: dict | None = None) -> tuple[dict, Callable[[], None], dict]:
        """Append the step's tokens, gather its keys, allocate its queries and outputs: ``(variants, fresh,
        outs)``. ``variants[name]()`` runs every layer of one variant (:data:`VARIANTS`; ``pass_on`` makes the
        calls of ``choice["variant"]``, :meth:`pass_on_choice` by default); ``fresh()`` refills the queries with
        randn; ``outs[name]`` holds per layer the ``(packed uint8 [T, H*Dv/2], scales float8_e4m3fn swizzled)``
        pair that variant writes (zeros until then)."""
        self.gather(layout)
        t, n = layout.tokens, self.dims.heads * self.dims.dv
        qs, fresh = self.new_queries(layout)
        rows, cols = nvfp4.scale_shape(t, n)
        outs = {name: [(torch.zeros(t, n // 2, dtype=torch.uint8, device=self.device),
                        torch.zeros(rows, cols, dtype=torch.float8_e4m3fn, device=self.device))
                       for _ in range(self.layers)] for name in self.VARIANTS}
        variants = self._variants(layout, qs, outs, self.pass_on_choice(layout) if choice is None else choice)
        return variants, fresh, outs

    def bytes_equal(self, outs: dict) -> dict:
        """``{pair_key(pair): bool}`` over :attr:`CHECKED_PAIRS` and :attr:`INFO_PAIRS`: whether the two variants
        wrote the same bytes, every layer's buffers."""
        return {pair_key((x, y)): all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                                      for bufs_x, bufs_y in zip(outs[x], outs[y]) for a, b in zip(bufs_x, bufs_y))
                for x, y in self.CHECKED_PAIRS + self.INFO_PAIRS}

    def run_step(self, layout: StepLayout, *, warmup: int, repeats: int, clock: str = "eager") -> dict:
        """:meth:`prepare` the step, then time every variant and compare their bytes pairwise (after one call
        each on the same queries).

        ``clock="eager"``: CUDA events around the layers' eager calls, median of ``repeats`` after ``warmup``,
        fresh randn queries before every call, outside the timed region. ``clock="graph"``: each variant's
        layer calls captured in one CUDA graph (after ``warmup`` runs on the capture stream), the graphs replayed
        in ``repeats`` rounds of one replay each, the order rotated every round, median of each variant's
        CUDA-event times: GPU time alone, no host cost or launch gaps, drift shared by every variant; the step's
        queries are drawn once. When a capture fails, every variant of the step is timed eagerly (one clock per
        ratio), the variant and its reason in ``eager_instead``. On the CPU: wall time
        (``warmup`` untimed calls first).

        Returns ``{"ms": {variant: median}, "bytes_equal": {pair_key(pair): bool}, "eager_instead":
        {variant: why}, "pass_on": pass_on_choice(layout)}`` over :attr:`CHECKED_PAIRS` and :attr:`INFO_PAIRS`."""
        choice = self.pass_on_choice(layout)
        variants, fresh, outs = self.prepare(layout, choice)
        fresh()
        for call in variants.values():  # one call each on the same queries: compile, then compare bytes
            call()
        equal = self.bytes_equal(outs)
        ms, eager_instead = {}, {}
        if self.cuda and clock == "graph":
            try:
                samples = _timing.graph_replay_interleaved_ms(variants, replays=repeats, warmup=warmup)
                ms = {name: _timing.median(x) for name, x in samples.items()}
            except _timing.GraphCaptureError as exc:  # not capturable here: the whole step is timed eagerly, and said so
                eager_instead[exc.name] = f"{type(exc.cause).__name__}: {str(exc.cause)[:200]}"
                torch.cuda.synchronize()
                ms = {}
        if not ms:
            for name, call in variants.items():
                if self.cuda:
                    samples = _timing.event_ms(call, repeats=repeats, warmup=warmup, before=fresh)
                else:
                    for _ in range(warmup):
                        fresh()
                        call()
                    samples = []
                    for _ in range(repeats):
                        fresh()
                        samples += _timing.cpu_ms(call, repeats=1, warmup=0)
                ms[name] = _timing.median(samples)
        return {"ms": ms, "bytes_equal": equal, "eager_instead": eager_instead, "pass_on": choice}


def _bound(name: str, body: Callable, bufs: list) -> Callable[[], None]:
    """``body(bufs)`` as a callable of no arguments named ``name`` (what the timers and their reports see)."""

    def call():
        body(bufs)

    call.__name__ = call.__qualname__ = name
    return call
