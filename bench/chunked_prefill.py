"""Chunked prefill on the fused path: a chunk of new tokens attending to its cached context, written as NVFP4.

For each shape (MLA or MHA heads; ``B`` requests, each ``Lq`` new tokens after ``Lc`` cached tokens) the
script times, on a CUDA device with the ``fa4`` backend available:

  fa4_fused        the fused call within the workspace bound: FA4's SM90 kernel with the NVFP4 epilogue over
                   keys context + new (``cu_seqlens_k``), from a ready key/value workspace
  fa4_quant        the strongest unfused baseline a Hopper user has: FA4's own bf16 forward over the same keys,
                   then the NVFP4 quantizer
  run_prefills     ``fusion_pass.runtime.row_plan.run_prefills`` within the bound: the workspace laid out from context
                   and new keys (a copy), then the fused call
  merge_path       ``run_prefills`` beyond the bound (the bound set to a quarter of the context): FA4 forwards
                   with their log-sum-exp per context chunk, float32 merges, and the NVFP4 merge kernel

Times are medians of ``triton.testing.do_bench`` (CUDA events, L2 flushed before each repetition), inputs
drawn at random once per shape (never zeros). Also checks, per shape, that ``fa4_fused`` bytes equal the
quantizer applied to FA4's own bf16 output (the fused kernel's contract, docs/fa4.md).

  python bench/chunked_prefill.py [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import torch

SHAPES = (  # label, heads, Dqk, Dv, B, Lq, Lc
    ("MLA-16h", 16, 192, 128, 4, 2048, 8192),
    ("MLA-128h", 128, 192, 128, 4, 2048, 8192),
    ("MLA-128h", 128, 192, 128, 1, 512, 16384),
    ("MHA-32h", 32, 128, 128, 4, 2048, 8192),
)


@dataclass
class Case:
    label: str
    heads: int
    dqk: int
    dv: int
    batch: int
    lq: int
    lc: int


def _bench(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def measure(case: Case, seed: int) -> dict:
    from fusion_pass import kernels, nvfp4
    from fusion_pass.runtime import backends, row_plan, settings
    from fusion_pass.kernels.triton.quantize import quantize_launch as quantize  # the unvalidated launcher, as the ops call it

    gen = torch.Generator(device="cuda").manual_seed(seed)
    h, b, lq, lc = case.heads, case.batch, case.lq, case.lc
    t, c = b * lq, b * lc

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    q, k, v = rand(t, h, case.dqk), rand(t, h, case.dqk), rand(t, h, case.dv)
    k_ctx, v_ctx = rand(c, h, case.dqk), rand(c, h, case.dv)
    query_lens, context_lens = [lq] * b, [lc] * b
    cu_q = torch.arange(0, t + 1, lq, dtype=torch.int32, device="cuda")
    cu_k = torch.arange(0, t + c + 1, lq + lc, dtype=torch.int32, device="cuda")
    k_ws = torch.cat([x for i in range(b) for x in (k_ctx[i * lc:(i + 1) * lc], k[i * lq:(i + 1) * lq])])
    v_ws = torch.cat([x for i in range(b) for x in (v_ctx[i * lc:(i + 1) * lc], v[i * lq:(i + 1) * lq])])
    scale = case.dqk ** -0.5
    width = h * case.dv
    ref = kernels.fa4_attention_varlen(q, k_ws, v_ws, cu_q, lq, causal=True, softmax_scale=scale,
                                       cu_seqlens_k=cu_k, max_seqlen_k=lq + lc)
    gs = torch.tensor([448 * 6 / float(ref.float().abs().max())], device="cuda")
    packed = torch.empty(t, width // 2, dtype=torch.uint8, device="cuda")
    rows, cols = nvfp4.scale_shape(t, width)
    scales = torch.empty(rows, cols, dtype=torch.uint8, device="cuda")

    def fused():
        kernels.fa4_attention_nvfp4_varlen(q, k_ws, v_ws, cu_seqlens=cu_q, max_seqlen=lq, softmax_scale=scale,
                                           causal=True, output=packed, output_scale=gs, output_block_scale=scales,
                                           cu_seqlens_k=cu_k, max_seqlen_k=lq + lc)

    out_packed = torch.empty_like(packed)
    out_scales = torch.empty_like(scales)

    def unfused():
        out = kernels.fa4_attention_varlen(q, k_ws, v_ws, cu_q, lq, causal=True, softmax_scale=scale,
                                           cu_seqlens_k=cu_k, max_seqlen_k=lq + lc)
        return quantize(out.reshape(t, width), gs, packed=out_packed, scales=out_scales)

    fa4 = backends.get_backend("fa4")

    def prefills(bound):
        return lambda: row_plan.run_prefills(
            fa4, q, k, v, first_row=0, query_lens=query_lens, context_lens=context_lens,
            context=lambda lo, hi: (k_ctx[lo:hi], v_ctx[lo:hi]), softmax_scale=scale, output=packed, output_scale=gs, output_block_scale=scales,
            workspace_tokens=bound)

    fused()
    want = unfused()
    bytes_equal = bool(torch.equal(packed, want[0]) and torch.equal(scales, want[1].view(torch.uint8)))
    ms = {"fa4_fused": _bench(fused), "fa4_quant": _bench(unfused),
          "run_prefills": _bench(prefills(c)), "merge_path": _bench(prefills(max(1, c // 4)))}
    return {**case.__dict__, "ms": ms, "fused_bytes_equal_fa4_then_quant": bytes_equal,
            "speedup_vs_fa4_quant": ms["fa4_quant"] / ms["fa4_fused"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--quick", action="store_true", help="the first shape only")
    parser.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("chunked_prefill: needs a CUDA device (the fa4 backend's SM90 kernel); nothing timed", file=sys.stderr)
        return 2
    from fusion_pass.runtime import backends, settings

    ok, why = backends.get_backend("fa4").available()
    if not ok:
        print(f"chunked_prefill: the fa4 backend is unavailable: {why}", file=sys.stderr)
        return 2
    results = []
    print("| shape | B x (Lq new + Lc context) | FA4 fused | FA4 + quant | speedup | run_prefills | beyond the bound "
          "(merge) | fused bytes == FA4 + quant |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for shape in SHAPES[:1] if args.quick else SHAPES:
        r = measure(Case(*shape), args.seed)
        results.append(r)
        ms = r["ms"]
        print(f"| {r['label']} | {r['batch']} x ({r['lq']} + {r['lc']}) | {ms['fa4_fused']:.3f} ms | "
              f"{ms['fa4_quant']:.3f} ms | {r['speedup_vs_fa4_quant']:.2f}x | {ms['run_prefills']:.3f} ms | "
              f"{ms['merge_path']:.3f} ms | {r['fused_bytes_equal_fa4_then_quant']} |", flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
    return 0 if all(r["fused_bytes_equal_fa4_then_quant"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
