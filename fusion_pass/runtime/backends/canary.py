"""The canary of the ``fa4`` backend's first-use self-check (:mod:`fusion_pass.runtime.self_check`).

A few fixed batches, each run through the fused NVFP4 kernel and through FA4's forward in the query dtype (the
same main loop: :func:`fusion_pass.kernels.launchers.fa4_attention_varlen`, on SM100 the twin of the fused
kernel) + the reference quantizer; every byte of the codes and of the swizzled scales, padding included, must be
equal. FA4's forward must also be near float32 attention (:data:`REFERENCE_TOLERANCE`), which catches a broken
main loop that the byte comparison cannot see because both kernels share it.

The data covers (:func:`canary_batches`): one and two 128-row Q tiles per CTA (both SM100 configurations), a
prefix-cache hit read through ``cu_seqlens_k`` (bottom-right causal), heads past the first on two KV heads with the
layer's query heads per KV head, saturated block scales and codes (the global scale maps 0.5 to 448), e4m3
subnormal block scales (a sequence with values scaled by 5e-6), negative zero codes, a NaN block (a NaN value seen
by a one-token sequence) and infinite elements (``+inf`` in a value every query of a sequence sees).

The paged launch (``run_paged``: every row of a call, decode rows included, over a paged KV cache) has a case of its
own (:data:`PAGED_BATCH`, :func:`paged_canary_case`): decode rows over long and short contexts beside a fresh prefill
and a prefill after cached context, in one launch over 16-slot pages (vLLM's default block size, FA4's cp.async path)
taken out of order from a larger pool whose unused slots hold large stale values; the fused paged kernel against FA4's paged
forward + the reference quantizer, every byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
from torch import Tensor

from fusion_pass import nvfp4
from fusion_pass.kernels import launchers, reference

__all__ = ["GLOBAL_SCALE", "KV_HEADS", "PAGED_BATCH", "REFERENCE_TOLERANCE", "CanaryCase", "canary_batches",
           "canary_case", "paged_canary_case", "run_canary"]

GLOBAL_SCALE = 448.0 * 6.0 / 0.5
"""The canary's global scale: blocks whose largest magnitude exceeds 0.5 saturate their scale at 448."""

KV_HEADS = 2
"""Key/value heads of the canary; query heads are ``KV_HEADS * group``."""

REFERENCE_TOLERANCE = 1e-2
"""Largest relative Frobenius distance between FA4's forward and float32 attention, over the finite entries, that
the canary accepts (the forward rounds to bf16/fp16: about 2^-9 relative)."""


def canary_batches() -> list[dict[str, Any]]:
    """The fixed batches: per sequence its new tokens, cached context and a value scale; ``nan_key`` /
    ``inf_key``: (sequence, KV head, column) of a value set to NaN / ``+inf`` at that sequence's first key."""
    return [{"query_lens": [1, 37, 128], "context_lens": [0, 0, 0], "value_scales": [1.0, 5e-6, 1.0],
             "nan_key": (0, 0, 5)},
            {"query_lens": [200, 9], "context_lens": [0, 75], "value_scales": [1.0, 1.0],
             "inf_key": (1, 1, 20)}]


@dataclass
class CanaryCase:
    """One batch's inputs: ``q [T, H, D]``, ``k [Tk, KV_HEADS, D]``, ``v [Tk, KV_HEADS, Dv]`` and the call's
    keyword arguments (``cu_seqlens``, ``max_seqlen``, ``cu_seqlens_k``, ``max_seqlen_k``, ``softmax_scale``,
    ``causal``)."""

    q: Tensor
    k: Tensor
    v: Tensor
    args: dict[str, Any]


def canary_case(batch: dict[str, Any], generator: torch.Generator, device, dtype: torch.dtype, qk_head_dim: int,
                v_head_dim: int, group: int) -> CanaryCase:
    lens, ctx = batch["query_lens"], batch["context_lens"]
    keys = [a + b for a, b in zip(lens, ctx)]
    starts_k = [0, *accumulate(keys)]
    t, tk, heads = sum(lens), sum(keys), KV_HEADS * group
    q = torch.randn(t, heads, qk_head_dim, generator=generator, device=device).to(dtype)
    k = torch.randn(tk, KV_HEADS, qk_head_dim, generator=generator, device=device).to(dtype)
    v = torch.randn(tk, KV_HEADS, v_head_dim, generator=generator, device=device)
    for i, value_scale in enumerate(batch["value_scales"]):
        v[starts_k[i]:starts_k[i + 1]] *= value_scale
    for name, value in (("nan_key", float("nan")), ("inf_key", float("inf"))):
        if name in batch:
            sequence, head, column = batch[name]
            v[starts_k[sequence], head, column % v_head_dim] = value
    cu = torch.tensor([0, *accumulate(lens)], dtype=torch.int32, device=device)
    cu_k = torch.tensor(starts_k, dtype=torch.int32, device=device)
    args = dict(cu_seqlens=cu, max_seqlen=max(lens), cu_seqlens_k=cu_k, max_seqlen_k=max(keys),
                softmax_scale=qk_head_dim ** -0.5, causal=True)
    return CanaryCase(q, k, v.to(dtype), args)


PAGED_BATCH = {"query_lens": [1, 1, 9, 40], "context_lens": [70, 3, 0, 25], "page_size": 16}
"""The paged case: per request its new tokens and cached context, in vLLM's order (decode rows first)."""


def paged_canary_case(generator: torch.Generator, device, dtype: torch.dtype, qk_head_dim: int, v_head_dim: int,
                      group: int) -> CanaryCase:
    """:data:`PAGED_BATCH` as a paged call: ``k`` / ``v`` are the caches ``[num_pages, page_size, KV_HEADS, D]``,
    ``args`` hold ``cu_seqlens``, ``max_seqlen``, ``seqused_k``, ``page_table``, ``max_seqlen_k``,
    ``softmax_scale``, ``causal``."""
    lens, ctx, size = PAGED_BATCH["query_lens"], PAGED_BATCH["context_lens"], PAGED_BATCH["page_size"]
    keys = [a + b for a, b in zip(lens, ctx)]
    pages = [-(-n // size) for n in keys]
    pool = sum(pages) + 3
    order = torch.randperm(pool, generator=generator, device=device).cpu()
    # slots no request uses hold large finite values (stale keys of a finished request): they must not be seen
    k_cache = 100 * torch.randn(pool, size, KV_HEADS, qk_head_dim, generator=generator, device=device)
    v_cache = 100 * torch.randn(pool, size, KV_HEADS, v_head_dim, generator=generator, device=device)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    used = 0
    for i, n in enumerate(keys):
        table[i, :pages[i]] = order[used:used + pages[i]]
        used += pages[i]
        where = table[i, torch.arange(n) // size].long().to(device), (torch.arange(n) % size).to(device)
        k_cache[where] = torch.randn(n, KV_HEADS, qk_head_dim, generator=generator, device=device)
        v_cache[where] = torch.randn(n, KV_HEADS, v_head_dim, generator=generator, device=device)
    q = torch.randn(sum(lens), KV_HEADS * group, qk_head_dim, generator=generator, device=device).to(dtype)
    args = dict(cu_seqlens=torch.tensor([0, *accumulate(lens)], dtype=torch.int32, device=device),
                max_seqlen=max(lens), seqused_k=torch.tensor(keys, dtype=torch.int32, device=device),
                page_table=table.to(device), max_seqlen_k=max(keys), softmax_scale=qk_head_dim ** -0.5, causal=True)
    return CanaryCase(q, k_cache.to(dtype), v_cache.to(dtype), args)


def _compare(packed, scales, twin, exact, gs, t, width, where) -> str | None:
    """The first difference between the fused bytes and ``quantize(twin)``, or FA4's forward too far from float32
    attention ``exact``; None when they agree."""
    rows, cols = nvfp4.scale_shape(t, width)
    finite = twin.isfinite() & exact.isfinite()
    if float(finite.float().mean()) < 0.9:
        return f"FA4's forward is not finite at {int((~finite).sum())} entries ({where})"
    distance = float((twin.float() - exact)[finite].norm() / exact[finite].norm().clamp_min(1e-30))
    if not distance <= REFERENCE_TOLERANCE:
        return (f"FA4's forward is {distance:.3g} (relative Frobenius) from float32 attention, above "
                f"{REFERENCE_TOLERANCE} ({where})")
    want_packed, want_scales = nvfp4.quantize(twin.reshape(t, width), gs)
    for name, got, want in (("codes", packed, want_packed),
                            ("scales", scales.view(rows, cols), want_scales.view(torch.uint8))):
        diff = (got != want).nonzero()
        if len(diff):
            row, col = diff[0].tolist()
            return (f"{name} differ at {len(diff)} byte(s), first at row {row}, byte {col} ({where}; fused "
                    f"{int(got[row, col]):#04x}, FA4 + quantize {int(want[row, col]):#04x})")
    return None


def _buffers(t: int, width: int, device):
    rows, cols = nvfp4.scale_shape(t, width)
    return (torch.full((t, width // 2), 0xAB, dtype=torch.uint8, device=device),
            torch.full((rows * cols,), 0xCD, dtype=torch.uint8, device=device))


def _run_paged(generator, device, dtype, qk_head_dim, v_head_dim, group, gs) -> str | None:
    case = paged_canary_case(generator, device, dtype, qk_head_dim, v_head_dim, group)
    a = case.args
    t, width = case.q.shape[0], case.q.shape[1] * v_head_dim
    packed, scales = _buffers(t, width, device)
    launchers.fa4_attention_nvfp4_paged(case.q, case.k, case.v, output=packed, output_scale=gs,
                                        output_block_scale=scales, **a)
    twin = launchers.fa4_attention_paged(case.q, case.k, case.v, **a)
    exact, _ = reference.paged_attention(case.q, case.k, case.v, a["cu_seqlens"], a["seqused_k"], a["page_table"],
                                         True, a["softmax_scale"])
    where = (f"paged: query lengths {PAGED_BATCH['query_lens']}, context {PAGED_BATCH['context_lens']}, pages of "
             f"{PAGED_BATCH['page_size']}")
    return _compare(packed, scales, twin, exact, gs, t, width, where)


def run_canary(device, dtype: torch.dtype, qk_head_dim: int, v_head_dim: int, group: int = 1) -> tuple[bool, str]:
    """Run every canary batch (module docstring) on ``device``: ``(True, summary)`` or ``(False, the first
    difference)``."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(20261201)
    gs = torch.tensor([GLOBAL_SCALE], dtype=torch.float32, device=device)
    heads = KV_HEADS * group
    for batch in canary_batches():
        case = canary_case(batch, generator, device, dtype, qk_head_dim, v_head_dim, group)
        where = f"query lengths {batch['query_lens']}, context {batch['context_lens']}"
        t, width = case.q.shape[0], heads * v_head_dim
        packed, scales = _buffers(t, width, device)
        launchers.fa4_attention_nvfp4_varlen(case.q, case.k, case.v, output=packed, output_scale=gs,
                                             output_block_scale=scales, **case.args)
        a = case.args
        twin = launchers.fa4_attention_varlen(case.q, case.k, case.v, a["cu_seqlens"], a["max_seqlen"], causal=True,
                                              softmax_scale=a["softmax_scale"], cu_seqlens_k=a["cu_seqlens_k"],
                                              max_seqlen_k=a["max_seqlen_k"])
        exact, _ = reference.varlen_attention(case.q, case.k, case.v, a["cu_seqlens"], True, a["softmax_scale"],
                                              a["cu_seqlens_k"])
        found = _compare(packed, scales, twin, exact, gs, t, width, where)
        if found is not None:
            return False, found
    found = _run_paged(generator, device, dtype, qk_head_dim, v_head_dim, group, gs)
    if found is not None:
        return False, found
    return True, (f"canary bytes equal ({len(canary_batches())} batches and a paged one, {heads} heads on {KV_HEADS} "
                  f"KV heads, head dims ({qk_head_dim}, {v_head_dim}), {str(dtype).replace('torch.', '')})")
