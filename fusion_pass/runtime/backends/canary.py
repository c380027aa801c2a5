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
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
from torch import Tensor

from fusion_pass import nvfp4
from fusion_pass.kernels import launchers, reference

__all__ = ["GLOBAL_SCALE", "KV_HEADS", "REFERENCE_TOLERANCE", "CanaryCase", "canary_batches", "canary_case",
           "run_canary"]

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
        rows, cols = nvfp4.scale_shape(t, width)
        packed = torch.full((t, width // 2), 0xAB, dtype=torch.uint8, device=device)
        scales = torch.full((rows * cols,), 0xCD, dtype=torch.uint8, device=device)
        launchers.fa4_attention_nvfp4_varlen(case.q, case.k, case.v, output=packed, output_scale=gs,
                                             output_block_scale=scales, **case.args)
        a = case.args
        twin = launchers.fa4_attention_varlen(case.q, case.k, case.v, a["cu_seqlens"], a["max_seqlen"], causal=True,
                                              softmax_scale=a["softmax_scale"], cu_seqlens_k=a["cu_seqlens_k"],
                                              max_seqlen_k=a["max_seqlen_k"])
        exact, _ = reference.varlen_attention(case.q, case.k, case.v, a["cu_seqlens"], True, a["softmax_scale"],
                                              a["cu_seqlens_k"])
        finite = twin.isfinite() & exact.isfinite()
        if float(finite.float().mean()) < 0.9:
            return False, f"FA4's forward is not finite at {int((~finite).sum())} entries ({where})"
        distance = float((twin.float() - exact)[finite].norm() / exact[finite].norm().clamp_min(1e-30))
        if not distance <= REFERENCE_TOLERANCE:
            return False, (f"FA4's forward is {distance:.3g} (relative Frobenius) from float32 attention, above "
                           f"{REFERENCE_TOLERANCE} ({where})")
        want_packed, want_scales = nvfp4.quantize(twin.reshape(t, width), gs)
        for name, got, want in (("codes", packed, want_packed),
                                ("scales", scales.view(rows, cols), want_scales.view(torch.uint8))):
            diff = (got != want).nonzero()
            if len(diff):
                row, col = diff[0].tolist()
                return False, (f"{name} differ at {len(diff)} byte(s), first at row {row}, byte {col} ({where}; "
                               f"fused {int(got[row, col]):#04x}, FA4 + quantize {int(want[row, col]):#04x})")
    return True, (f"canary bytes equal ({len(canary_batches())} batches, {heads} heads on {KV_HEADS} KV heads, head "
                  f"dims ({qk_head_dim}, {v_head_dim}), {str(dtype).replace('torch.', '')})")
