"""Sweep the Triton kernels' tile configurations on the GPU (how the defaults were chosen).

    python bench/tune.py [--out DIR] [--quick]

Times (median, ``triton.testing.do_bench``) the NVFP4 quantizer over a few
``(BLOCK_M, BLOCK_K, num_warps)`` and the attention kernel, both epilogues, over
``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` on the benchmark's MLA 128-head
and MHA 32-head shapes; prints the best per shape and writes every timing to
``DIR/tune.json``. The chosen defaults live in
``fusion_pass.kernels.triton.quantize.QUANT_CONFIG`` and
``fusion_pass.kernels.triton.flash_attention.attention_config``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

QUANT_CONFIGS = [
    {"BLOCK_M": bm, "BLOCK_K": bk, "num_warps": w}
    for bm, bk, w in itertools.product((16, 32, 64), (128, 256, 512), (4, 8))
]
ATTENTION_CONFIGS = [
    {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s}
    for bm, bn, w, s in (
        (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2), (128, 128, 8, 2), (128, 64, 4, 2),
        (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (64, 128, 4, 2), (128, 128, 8, 3),
    )
]
SHAPES = [  # (name, heads, Dqk, Dv, batch, seqlen)
    ("mla128-32x512", 128, 192, 128, 32, 512),
    ("mla128-2x8192", 128, 192, 128, 2, 8192),
    ("mha32-32x512", 32, 128, 128, 32, 512),
    ("mha32-2x8192", 32, 128, 128, 2, 8192),
]


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def tune_quant(results: dict) -> None:
    from fusion_pass.kernels.triton import quantize as nvfp4_quant

    x = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
    gs = torch.tensor([448 * 6 / float(x.abs().amax())], device="cuda")
    nbytes = x.numel() * 2 + x.numel() // 2 + x.numel() // 16
    rows = []
    for cfg in QUANT_CONFIGS:
        ms = bench(lambda: nvfp4_quant.quantize_launch(x, gs, config=cfg))
        rows.append({**cfg, "ms": ms, "TB/s": nbytes / ms / 1e9})
    rows.sort(key=lambda r: r["ms"])
    results["quant"] = rows
    print("quant best:", rows[:3])


def tune_attention(results: dict, shapes) -> None:
    from fusion_pass.kernels.triton import flash_attention as fa

    for name, heads, dqk, dv, batch, seqlen in shapes:
        t = batch * seqlen
        q = torch.randn(t, heads, dqk, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(t, heads, dqk, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(t, heads, dv, device="cuda", dtype=torch.bfloat16)
        cu = torch.arange(0, t + 1, seqlen, device="cuda", dtype=torch.int32)
        gs = torch.tensor([448 * 6 / 4.0], device="cuda")
        flops = 2 * heads * batch * (seqlen * (seqlen + 1) / 2) * (dqk + dv)
        rows = []
        for cfg in ATTENTION_CONFIGS:
            try:
                half = bench(lambda: fa.flash_attention(q, k, v, cu, seqlen, config=cfg))
                fused = bench(lambda: fa.flash_attention_nvfp4(q, k, v, cu, seqlen, gs, config=cfg))
            except Exception as exc:  # out of shared memory / registers for this tile
                rows.append({**cfg, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                continue
            rows.append({**cfg, "half_ms": half, "nvfp4_ms": fused, "half_TFLOPs": flops / half / 1e9,
                         "nvfp4_TFLOPs": flops / fused / 1e9})
        ok = sorted((r for r in rows if "error" not in r), key=lambda r: r["nvfp4_ms"])
        results[name] = rows
        print(f"{name}: best nvfp4 {ok[:2]}")
        print(f"{name}: best half {sorted(ok, key=lambda r: r['half_ms'])[:1]}")
        del q, k, v


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".", help="directory for tune.json (default: .)")
    parser.add_argument("--quick", action="store_true", help="only the 32x512 shapes")
    parser.add_argument("--skip-quant", action="store_true", help="attention only")
    parser.add_argument("--long", action="store_true", help="only the 2x8192 shapes")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/tune.py needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    results: dict = {"device": torch.cuda.get_device_name()}
    if not args.skip_quant:
        tune_quant(results)
    shapes = [s for s in SHAPES if not args.quick or s[0].endswith("32x512")]
    if args.long:
        shapes = [s for s in SHAPES if s[0].endswith("2x8192")]
    tune_attention(results, shapes)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
