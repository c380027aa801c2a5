"""The SM90 kernel's NVFP4 epilogue (fusion_pass/kernels/fa4/sm90_kernel.py) on generated batches.

GPU (an SM90 device with FA4): on generated batches (random sequence lengths with partial tiles and random head
counts, MHA in bf16 and GQA 4:1 in fp16, every supported head-dim pair, NaN and infinity in one case of three, two
global scales, one calibrated, one random from 1e-3 to 1e5) every packed and scale byte equals ``nvfp4.quantize``
of FA4's own output, padding zero, under two poisons. 16 compilations (fused kernel and twin per test). A failure
names its seed; ``FUSION_PASS_TEST_SEED`` replays it.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from fusion_pass import nvfp4
from fusion_pass.kernels.fa4 import sm90


def fresh_seed() -> int:
    seed = os.environ.get("FUSION_PASS_TEST_SEED")
    return int(seed) if seed else random.SystemRandom().randrange(2**31)


# ---------------------------------------------------------------------------
# GPU: generated batches, every byte
# ---------------------------------------------------------------------------


from sm90_gpu import gpu  # noqa: E402


def _lengths(gen: random.Random, tile_m: int) -> list[int]:
    """1-6 sequences: tile boundaries and their neighbours, single tokens, and random lengths (partial tiles)."""
    pick = [1, 2, tile_m - 1, tile_m, tile_m + 1, 2 * tile_m + 3]
    return [gen.choice(pick) if gen.random() < 0.4 else gen.randrange(1, 4 * tile_m) for _ in range(gen.randint(1, 6))]


@gpu
@pytest.mark.parametrize("dims", sm90.SUPPORTED_HEAD_DIMS, ids=[f"{d}-{dv}" for d, dv in sm90.SUPPORTED_HEAD_DIMS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_bytes_equal_quantize_of_fa4_output_on_generated_batches(dims, dtype):
    d, dv = dims
    seed = fresh_seed()
    gen = random.Random(seed)
    tile_m = sm90.kernel_config(d, dv, True).tile_m
    ratio = 1 if dtype == torch.bfloat16 else 4  # query heads per KV head: a compile key, one per test
    for case in range(3):
        hkv = gen.choice([1, 2, 3, 4])
        h = hkv * ratio
        lengths = _lengths(gen, tile_m)
        causal = True  # non-causal: test_fa4.py; the epilogue does not see the mask
        special = case == 2
        where = f"seed {seed} case {case}: H={h} Hkv={hkv} lengths={lengths} causal={causal} {dtype}"
        tg = torch.Generator().manual_seed(gen.randrange(2**31))
        t = sum(lengths)
        q = torch.randn(t, h, d, generator=tg).to("cuda", dtype)
        k = torch.randn(t, hkv, d, generator=tg).to("cuda", dtype)
        v = torch.randn(t, hkv, dv, generator=tg) * torch.exp(2 * torch.randn(t, hkv, 1, generator=tg))
        if special:  # reach the output through the probabilities: an infinity and a NaN in v
            v[gen.randrange(t), gen.randrange(hkv), gen.randrange(dv)] = float("inf")
            v[gen.randrange(t), gen.randrange(hkv), gen.randrange(dv)] = float("nan")
        v = v.to("cuda", dtype)
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        scale = d ** -0.5
        ref = sm90.fa4_attention_varlen(q, k, v, cu, max(lengths), causal=causal, softmax_scale=scale)
        ref = ref.reshape(t, h * dv)
        finite = ref.float()[ref.float().isfinite()]
        amax = max(finite.abs().max().item(), 1e-6) if finite.numel() else 1.0
        rows, cols = nvfp4.scale_shape(t, h * dv)
        for gs_value in (448 * 6 / amax, 10 ** gen.uniform(-3, 5)):
            gs = torch.tensor([gs_value], dtype=torch.float32, device="cuda")
            want_packed, want_scales = nvfp4.quantize(ref.cpu(), gs.cpu(), swizzled=True)
            for poison in (0xA5, 0x00):
                packed = torch.full((t, h * dv // 2), poison, dtype=torch.uint8, device="cuda")
                scales = torch.full((rows, cols), poison ^ 0xFF, dtype=torch.uint8, device="cuda")
                sm90.fa4_attention_nvfp4_varlen(
                    q, k, v, cu_seqlens=cu, max_seqlen=max(lengths), softmax_scale=scale, causal=causal,
                    output=packed, output_scale=gs, output_block_scale=scales.view(torch.float8_e4m3fn))
                bad = (packed.cpu() != want_packed).nonzero()
                assert len(bad) == 0, f"{len(bad)} packed bytes differ, first (row, byte) {bad[:8].tolist()} ({where})"
                diff = (scales.cpu().view(-1) != want_scales.view(torch.uint8).view(-1)).nonzero()
                assert len(diff) == 0, (f"{len(diff)} scale bytes differ (padding included), "
                                        f"first {diff[:8].tolist()} (gs {gs_value}, {where})")
        if special:
            assert bool((want_scales.view(torch.uint8) == 0x7F).any()), f"no NaN block reached the output ({where})"
