"""A NaN or Inf in one token's value reaches exactly the rows that see that token (issue 29, item 6a).

The Triton flash attention masks the keys a query does not see (causally) to probability 0, and ``0 * NaN``
is NaN in ``P @ V``: before the fix, a non-finite value of token ``j`` turned the earlier rows of ``j``'s query
tile into NaN. Now the rows that cannot see ``j`` get exactly the bytes they get when ``j``'s value is finite
(so the reference backend's rows, within the kernels' usual bounds), and the rows that see it are NaN / Inf
where the reference backend's are. Both epilogues (the query dtype, NVFP4), with and without cached context
(``cu_seqlens_k``). On the CPU in Triton's interpreter (tiny shapes), compiled on CUDA.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from fusion_pass import kernels, nvfp4
from fusion_pass.kernels import reference
from fusion_pass.kernels.triton import flash_attention as fa

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

pytestmark = pytest.mark.skipif(
    not CUDA and not kernels.interpreter_enabled(),
    reason="no CUDA device and TRITON_INTERPRET is not set (conftest.py sets it on CPU-only machines)",
)

# (heads, kv heads, Dqk, Dv, new tokens per sequence, cached context per sequence, (sequence, new token) poisoned)
CASES = [
    (2, 1, 32, 32, [5, 21], [0, 0], (1, 9)),  # rows 0-8 of the poisoned token's 16-row tile must stay finite
    (2, 2, 72, 32, [30], [0], (0, 20)),  # a head dim with a tail dot; the poisoned token in the second tile
    (4, 2, 32, 32, [13, 20], [7, 19], (1, 3)),  # cached context read through cu_seqlens_k (Lk > Lq)
]
CASE_IDS = ["mha-gqa", "tail-dim", "context"]


def _inputs(case, dtype, seed):
    heads, kv_heads, dqk, dv, new, context, (seq, token) = case
    gen = torch.Generator().manual_seed(seed)
    keys = [n + c for n, c in zip(new, context)]
    q = torch.randn(sum(new), heads, dqk, generator=gen).to(DEVICE, dtype)
    k = torch.randn(sum(keys), kv_heads, dqk, generator=gen).to(DEVICE, dtype)
    v = torch.randn(sum(keys), kv_heads, dv, generator=gen).to(DEVICE, dtype)
    cu = torch.tensor([0, *itertools.accumulate(new)], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *itertools.accumulate(keys)], dtype=torch.int32, device=DEVICE)
    key_row = sum(keys[:seq]) + context[seq] + token
    poisoned = v.clone()
    poisoned[key_row, kv_heads - 1, 3] = float("nan")
    poisoned[key_row, 0, dv - 2] = float("inf")
    poisoned[key_row, 0, 5] = float("-inf")
    # query rows that see the poisoned key: sequence `seq`'s new tokens from `token` on
    sees = torch.zeros(sum(new), dtype=torch.bool)
    first = sum(new[:seq])
    sees[first + token : first + new[seq]] = True
    args = dict(cu_seqlens=cu, max_seqlen=max(new), cu_seqlens_k=cu_k, max_seqlen_k=max(keys))
    return q, k, v, poisoned, args, sees


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_output_non_finite_value_reaches_only_the_rows_that_see_it(case, dtype):
    seed = random.SystemRandom().randrange(2**31)
    q, k, v, poisoned, args, sees = _inputs(case, dtype, seed)
    clean = kernels.attention(q, k, v, backend="triton", **args).cpu()
    got = kernels.attention(q, k, poisoned, backend="triton", **args).cpu()
    want = kernels.attention(q, k, poisoned, backend="reference", **args).cpu()

    hidden = ~sees
    assert torch.isfinite(got[hidden]).all(), f"rows that cannot see the poisoned token are not finite (seed {seed})"
    assert torch.equal(got[hidden], clean[hidden]), f"rows that cannot see it changed (seed {seed})"
    ref = want[hidden].double()
    rel = ((got[hidden].double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, f"relative error {rel:.2e} against the reference backend (seed {seed})"
    for kind in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(kind(got), kind(want)), f"{kind.__name__} differs from the reference backend (seed {seed})"
    assert got[sees].isnan().any(), f"the NaN did not reach the rows that see it (seed {seed})"


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_nvfp4_output_non_finite_value_reaches_only_the_rows_that_see_it(case):
    seed = random.SystemRandom().randrange(2**31)
    q, k, v, poisoned, args, sees = _inputs(case, torch.bfloat16, seed)
    t, width = q.shape[0], q.shape[1] * v.shape[2]
    gs = torch.tensor([448 * 6 / 8.0], dtype=torch.float32, device=DEVICE)

    def run(values, backend):
        packed, scales = kernels.attention_nvfp4(q, k, values, global_scale=gs, backend=backend, **args)
        return packed.cpu(), scales.cpu()

    clean_packed, clean_scales = run(v, "triton")
    packed, scales = run(poisoned, "triton")
    _, want_scales = run(poisoned, "reference")
    sf = nvfp4.unswizzle_scales(scales, t, width // 16).view(torch.uint8)
    clean_sf = nvfp4.unswizzle_scales(clean_scales, t, width // 16).view(torch.uint8)
    want_sf = nvfp4.unswizzle_scales(want_scales, t, width // 16).view(torch.uint8)

    hidden = ~sees
    assert torch.equal(packed[hidden], clean_packed[hidden]), f"codes of rows that cannot see it changed (seed {seed})"
    assert torch.equal(sf[hidden], clean_sf[hidden]), f"scales of rows that cannot see it changed (seed {seed})"
    assert not (sf[hidden] == 0x7F).any(), f"a NaN block in rows that cannot see it (seed {seed})"
    # against the reference backend: NaN blocks (scale 0x7F) and saturated infinite blocks (0x7E) where its are
    for special in (0x7F, 0x7E):
        assert torch.equal(sf == special, want_sf == special), f"scale byte {special:#x} blocks differ (seed {seed})"
    assert (sf[sees] == 0x7F).any(), f"the NaN did not reach the rows that see it (seed {seed})"
    # the rows that cannot see it are within the format's bound of the reference's float32 attention
    deq = nvfp4.dequantize(packed[hidden], sf[hidden].view(torch.float8_e4m3fn), gs.cpu(), swizzled=False).double()
    ref = reference.varlen_attention(q, k, poisoned, args["cu_seqlens"], True, 1 / math.sqrt(q.shape[2]),
                                     args["cu_seqlens_k"])[0].cpu()  # float32
    ref = ref.reshape(t, width)[hidden]
    bound = 2 * nvfp4.error_bound(ref, gs.cpu()).double() + 1e-3 * ref.abs().double()
    assert ((deq - ref.double()).abs() <= bound).all(), f"rows that cannot see it: beyond the bound (seed {seed})"


def test_launcher_rows_of_the_tile_before_the_poisoned_token_stay_finite():
    """The unchecked launcher the fused backend calls: one sequence, a NaN in the value of its last token."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(20, 1, 16, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(3))
    v[19, 0, 0] = float("nan")
    cu = torch.tensor([0, 20], dtype=torch.int32, device=DEVICE)
    out = fa.flash_attention(q, k, v, cu, 20).cpu()
    assert not out[:19].isnan().any(), f"rows {sorted(set(out[:19].isnan().nonzero()[:, 0].tolist()))} are NaN"
    assert out[19].isnan().any()
