"""The cost of putting back the masked values' NaN on Hopper: FA4's SM90 forward as FA4 ships it against the same
forward with the put-back (``fusion_pass.kernels.fa4.sm90_exact``), and the fused NVFP4 kernel.

FA4 multiplies a masked probability 0 by every value row it loaded, so a NaN or an infinity in a value that a row
does not see reaches it (docs/design.md, "A NaN or an infinity in the inputs"). Every project SM90 kernel puts those
elements back before its epilogue: one test per thread and tile on finite inputs, a recompute only where a NaN is.
This script times what that costs where nothing is non-finite. Per layout and shape (causal, bf16, equal-length
varlen batches, fresh seeded randn inputs, one input set: L2 not flushed, the same inputs every call):

  unchanged   FA4's class unchanged (``sm90.compile_unchanged_kernel``), the twin's configuration, no put-back
  twin        ``fa4_attention_varlen``: FA4's forward with the put-back (the fa4 backend's bf16 attention)
  fused       ``fa4_attention_nvfp4_varlen``: the put-back and the NVFP4 epilogue

GPU time per call by CUDA-graph replay (``--calls`` calls captured per graph, the graphs replayed in rotated
rounds, ``--replays`` replays each, CUDA events, median per pass), ``--passes`` passes; ratios to ``unchanged`` per
pass. The twin's output bytes are checked equal to the unchanged forward's first (finite inputs: the put-back
changes nothing). Exit code 2 without a CUDA device or the fa4 backend, 1 when the bytes differ.

  python bench/masked_values.py [--layouts mla16,mla128,gqa64] [--shapes 4x128,32x512,8x2048,2x8192]
                                [--passes 4] [--replays 10] [--calls 20] [--out PATH] [--markdown PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
for _path in (BENCH_DIR.parent, BENCH_DIR):  # the package without installing it, then the bench helpers
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
from _command import command_line  # noqa: E402
from _timing import graph_replay_interleaved_ms  # noqa: E402

LAYOUTS = {"mla16": ("MLA 16h (192,128)", 16, 16, 192, 128), "mla128": ("MLA 128h (192,128)", 128, 128, 192, 128),
           "gqa64": ("GQA 64/8h (128,128)", 64, 8, 128, 128)}
SHAPES = ("4x128", "32x512", "8x2048", "2x8192")


def _names(text: str, known, what: str, parser) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        parser.error(f"--{what}: unknown {unknown or text!r}; choose from {', '.join(known)}")
    return names


def _shape(text: str) -> tuple[int, int]:
    b, length = text.split("x")
    return int(b), int(length)


def measure(layout: str, shape: str, args) -> dict:
    from fusion_pass import nvfp4
    from fusion_pass.kernels.fa4 import sm90

    label, h, hkv, d, dv = LAYOUTS[layout]
    b, length = _shape(shape)
    t = b * length
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    q = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(t, hkv, dv, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.arange(0, t + 1, length, dtype=torch.int32, device="cuda")
    scale = d**-0.5
    out = torch.empty(t, h, dv, device="cuda", dtype=torch.bfloat16)
    unchanged = sm90.compile_unchanged_kernel(q, k, v, out, cu, cu, sm90.kernel_config(d, dv, True, length, None),
                                              True)
    packed = torch.empty(t, h * dv // 2, dtype=torch.uint8, device="cuda")
    rows, cols = nvfp4.scale_shape(t, h * dv)
    scales = torch.empty(rows * cols, dtype=torch.uint8, device="cuda")
    global_scale = torch.tensor([448 * 6 / 5.0], device="cuda")

    def run_unchanged():
        unchanged(q, k, v, out, None, scale, cu, cu)

    def run_twin():
        return sm90.fa4_attention_varlen(q, k, v, cu, length, causal=True, softmax_scale=scale)

    def run_fused():
        sm90.fa4_attention_nvfp4_varlen(q, k, v, cu_seqlens=cu, max_seqlen=length, softmax_scale=scale, causal=True,
                                        output=packed, output_scale=global_scale, output_block_scale=scales)

    run_unchanged()
    twin = run_twin()
    run_fused()
    torch.cuda.synchronize()
    same = bool(torch.equal(twin.view(torch.int16), out.view(torch.int16)))

    def repeated(fn):
        def calls():
            for _ in range(args.calls):
                fn()
        return calls

    fns = {"unchanged": repeated(run_unchanged), "twin": repeated(run_twin), "fused": repeated(run_fused)}
    passes = []
    for _ in range(args.passes):
        samples = graph_replay_interleaved_ms(fns, replays=args.replays)
        passes.append({name: statistics.median(ms) / args.calls for name, ms in samples.items()})
    return {"layout": label, "shape": shape, "twin_bytes_equal_unchanged": same,
            "ms": {name: statistics.median(p[name] for p in passes) for name in fns},
            "ratio_to_unchanged": {name: [p[name] / p["unchanged"] for p in passes] for name in ("twin", "fused")}}


def markdown(result: dict) -> str:
    lines = [f"- Date: {result['date']} (UTC)", f"- Device: {result['device']}; {result['versions']}",
             f"- Command: `{result['command']}`",
             f"- Method: GPU time per call by CUDA-graph replay ({result['calls']} calls per graph, graphs replayed "
             f"in rotated rounds, {result['replays']} replays each, CUDA events, median per pass), "
             f"{result['passes']} passes; ratios per pass, shown as their range; times the median over passes",
             "- L2: not flushed; one input set (the same inputs every call)", "",
             "| shape | unchanged ms | twin ms | fused ms | twin / unchanged | fused / unchanged | twin bytes == "
             "unchanged |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in result["rows"]:
        ms, ratio = row["ms"], row["ratio_to_unchanged"]
        span = {n: f"{min(r):.3f}-{max(r):.3f}x" for n, r in ratio.items()}
        lines.append(f"| {row['layout']} {row['shape']} | {ms['unchanged']:.4f} | {ms['twin']:.4f} | "
                     f"{ms['fused']:.4f} | {span['twin']} | {span['fused']} | "
                     f"{'yes' if row['twin_bytes_equal_unchanged'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), metavar="LIST", help="comma list of " +
                        ", ".join(LAYOUTS) + " (default: all)")
    parser.add_argument("--shapes", default=",".join(SHAPES), metavar="LIST",
                        help="comma list of BxL batches (default: " + ",".join(SHAPES) + ")")
    parser.add_argument("--passes", type=int, default=4, help="interleaved passes per shape (default: 4)")
    parser.add_argument("--replays", type=int, default=10, help="graph replays per path and pass (default: 10)")
    parser.add_argument("--calls", type=int, default=20, help="calls captured per graph (default: 20)")
    parser.add_argument("--seed", type=int, default=0, help="input seed (default: 0)")
    parser.add_argument("--out", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--markdown", metavar="PATH", help="write the docs/benchmarks.md table to PATH")
    args = parser.parse_args(argv)
    layouts = _names(args.layouts, LAYOUTS, "layouts", parser)
    for text in args.shapes.split(","):
        try:
            b, length = _shape(text)
            if b < 1 or length < 1:
                raise ValueError
        except ValueError:
            parser.error(f"--shapes: {text!r} is not BxL with positive integers (e.g. 32x512)")
    for name in ("passes", "replays", "calls"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be a positive integer, got {getattr(args, name)}")
    if not torch.cuda.is_available():
        print("bench/masked_values.py needs a CUDA device (FA4's SM90 kernels)", file=sys.stderr)
        return 2
    from fusion_pass.kernels.fa4 import sm90

    device = torch.device("cuda", torch.cuda.current_device())
    for layout in layouts:
        _, h, _, d, dv = LAYOUTS[layout]
        ok, why = sm90.fa4_sm90_usable(device, torch.bfloat16, h, d, dv)
        if not ok:
            print(f"FA4's SM90 kernels are unavailable for {layout} here: {why}", file=sys.stderr)
            return 2
    from importlib import metadata

    try:
        fa4_version = metadata.version("flash-attn-4")
    except metadata.PackageNotFoundError:
        fa4_version = "unknown"
    result = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
              "device": torch.cuda.get_device_name(),
              "versions": f"torch {torch.__version__}, cuda {torch.version.cuda}, flash-attn-4 "
                          f"{fa4_version}",
              "command": command_line(sys.argv if argv is None else ["bench/masked_values.py", *argv],
                                      "bench/masked_values.py"),
              "passes": args.passes, "replays": args.replays, "calls": args.calls, "rows": []}
    for layout in layouts:
        for shape in args.shapes.split(","):
            row = measure(layout, shape, args)
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    table = markdown(result)
    if args.markdown:
        Path(args.markdown).write_text(table)
    print(table)
    return 0 if all(r["twin_bytes_equal_unchanged"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
