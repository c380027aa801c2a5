"""Attention -> NVFP4: the fused kernel against FA4 bf16 alone, FA4 + quant and cuDNN + quant, in one run.

For each shape (causal, bf16; layouts MLA 16 and 128 heads with head dims (192, 128), MHA 32 heads and
GQA 64/8 with (128, 128); batches 4x128, 32x512, 8x2048, 2x8192, and two chunked prefills, 8x512 after
4096 cached tokens each and 1x2048 after 30000, whose keys come through cu_seqlens_k) it times

  fused              fusion_pass.kernels.fa4 fa4_attention_nvfp4_varlen: FA4's forward with the NVFP4
                     epilogue, into preallocated buffers;
  FA4 bf16           fa4_attention_varlen alone (no quantization);
  FA4 + quant        fa4_attention_varlen, then the project's quantizer (fusion_pass.kernels.launchers
                     quantize_into) into preallocated buffers;
  cuDNN + quant      torch SDPA with the cuDNN backend forced, then the same quantizer; two layouts, the
                     faster is the baseline: [B, H, L, D] views of the token-major tensors (the output's
                     token-major view is free) and contiguous padded [B, H, L, D] copies (the output's
                     transpose to [T, H*Dv] is a copy, timed). Equal-length batches run as dense batches;
                     chunked shapes get an additive bottom-right causal mask (torch's is_causal is top-left).

Two numbers per path: GPU time per call by CUDA-graph replay (calls captured in one graph, the graph
replayed, CUDA events, median) and host time per call (time.perf_counter around the launch, no
synchronization, median). Every shape is measured in --passes interleaved passes (each pass times every
path; the order reverses between passes); a ratio is given per pass. Inputs: seeded randn, never zeros;
L2 not flushed, inputs rotate among 3 sets when a set is smaller than 3x the L2. With the quantizer
alone (effective TB/s at 16, 64 and 512 MiB, beside a 1 GiB copy) and issue 19's targets.

--device cpu runs the same logic on PyTorch reference kernels with FA4's contract, on shapes scaled down
by --scale (CPU wall time per call; numbers meaningless, the bytes checked): what the CPU tests use.

Examples:
    python bench/attention.py --out "$OUT/attention.json" --markdown "$OUT/attention.md"
    python bench/attention.py --layouts mla128 --shapes 32x512,1x2048+30000 --passes 1
    python bench/attention.py --device cpu --shapes 32x512 --out /tmp/a.json

Exit code 2: no CUDA device for --device cuda, or an unknown --shapes / --layouts name; 1: the fused
path or FA4 failed at a shape where FA4 is usable (the reason is in the JSON and the table says n/a).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import traceback
import warnings
from datetime import datetime, timezone
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
if importlib.util.find_spec("fusion_pass") is None:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

import _attention_report as report  # noqa: E402
import _timing  # noqa: E402
from _attention_paths import PATHS, build_paths, check_outputs, input_sets_needed, make_inputs  # noqa: E402
from _attention_shapes import Shape, select_shapes  # noqa: E402
from _kernels import Kernels, cudnn_status, fa4_kernels, fa4_status, reference_kernels  # noqa: E402
from _quant_bandwidth import measure_quant_bandwidth, quant_targets  # noqa: E402

FA4_PATHS = ("fused", "fa4", "fa4_quant")
CUDNN_PATHS = ("cudnn_quant_bshd", "cudnn_quant_bhsd")
CPU_SCALE = 32

CUDNN_NOTE = ("torch SDPA with SDPBackend.CUDNN_ATTENTION forced; every batch has equal lengths, so it runs as a "
              "dense [B, H, L, D] batch with no padding (unequal lengths would need padding to the longest or "
              "cuDNN's ragged layout: not measured); two layouts, the faster per pass is the baseline: [B, H, L, D] "
              "views of the token-major tensors (output token-major, free view) and contiguous [B, H, L, D] copies "
              "(output transposed to [T, H*Dv] inside the timed region); chunked shapes: an additive bf16 "
              "bottom-right causal mask [1, 1, Lq, Lk], made outside the timed region (torch's is_causal is "
              "top-left); GQA with enable_gqa=True")


def describe_error(exc: BaseException, caught=()) -> str:
    """The exception, where it was raised, and the warnings raised with it (SDPA gives its reasons as warnings)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (raised at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    parts = [f"{type(exc).__name__}: {' '.join(str(exc).split())}{where}"]
    parts += [t for t in (" ".join(str(w.message).split()) for w in caught) if t and t not in parts]
    return " | ".join(parts)


def new_record(shape: Shape, passes: int) -> dict:
    """The JSON record of one shape before measurement."""
    lay, b = shape.layout, shape.batch
    return {"label": shape.label, "layout": lay.name, "kind": lay.kind, "heads": lay.heads, "kv_heads": lay.kv_heads,
            "dqk": lay.dqk, "dv": lay.dv, "batch": b.batch, "q_len": b.q_len, "context": b.context,
            "tokens": shape.tokens, "keys": shape.keys, "flops": shape.flops, "causal": True, "dtype": "bfloat16",
            "input_sets": None, "global_scale": None, "errors": {}, "check": {}, "timing_notes": {},
            "calls_per_graph": {}, "ms": {p: [None] * passes for p in PATHS},
            "host_us": {p: [None] * passes for p in PATHS}, "samples_ms": {p: [] for p in PATHS}}


def first_call(path) -> str | None:
    """Run a path once (compiles, autotunes, surfaces refusals); the reason when it raises."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with path.context():
                path.call()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - a refusal is a result here
        return describe_error(exc, caught)
    return None


def time_path(path, *, cuda: bool, opts: argparse.Namespace) -> dict:
    """``{"ms", "samples_ms", "host_us", "calls", "note"}`` of one path in one pass."""
    with path.context():
        if not cuda:
            samples = _timing.cpu_ms(path.call, repeats=opts.replays, warmup=0)
            return {"ms": _timing.median(samples), "samples_ms": samples, "host_us": None, "calls": 1, "note": None}
        est = _timing.median(_timing.event_ms(path.call, repeats=3))
        calls = _timing.calls_for(est, opts.graph_ms)
        note = None
        try:
            samples = _timing.graph_replay_ms(path.call, calls=calls, replays=opts.replays)
        except Exception as exc:  # noqa: BLE001 - eager timing, said so
            note = f"CUDA-graph capture failed, eager CUDA events instead: {describe_error(exc)}"
            torch.cuda.synchronize()
            samples, calls = _timing.event_ms(path.call, repeats=opts.replays), 1
        host = _timing.host_us(path.call, calls=max(10, min(opts.host_calls, round(opts.host_ms / max(est, 1e-3)))))
    return {"ms": _timing.median(samples), "samples_ms": samples, "host_us": _timing.median(host), "calls": calls,
            "note": note}


def measure_shape(kernels: Kernels, shape: Shape, *, device, opts: argparse.Namespace) -> dict:
    """Every path of one shape, ``opts.passes`` interleaved passes."""
    cuda = torch.device(device).type == "cuda"
    record = new_record(shape, opts.passes)
    lay = shape.layout
    first = make_inputs(shape, opts.seed, device)
    n_sets = input_sets_needed(first.nbytes) if cuda else 1
    sets = [first] + [make_inputs(shape, opts.seed + i, device) for i in range(1, n_sets)]
    record["input_sets"] = n_sets
    skip = {}
    if cuda:
        ok, why = fa4_status(device, torch.bfloat16, lay.heads, lay.dqk, lay.dv)
        if not ok:
            skip.update({p: f"FA4 unavailable: {why}" for p in FA4_PATHS})
        ok, why = cudnn_status()
        if not ok:
            skip.update({p: f"cuDNN unavailable: {why}" for p in CUDNN_PATHS})
    # Global scale: 448 * 6 / amax of the bf16 attention output (of |v| when FA4 does not run here).
    amax = None
    if "fa4" not in skip:
        try:
            amax = kernels.attention(first.q, first.k, first.v, first.cu_seqlens, first.max_seqlen, causal=True,
                                     softmax_scale=lay.dqk**-0.5, cu_seqlens_k=first.cu_seqlens_k,
                                     max_seqlen_k=first.max_seqlen_k).abs().amax().float().item()
        except Exception as exc:  # noqa: BLE001
            skip.update({p: f"FA4 bf16 failed: {describe_error(exc)}" for p in FA4_PATHS})
    if not amax:
        amax = first.v.abs().amax().float().item()
    gs = torch.full((1,), 448.0 * 6.0 / amax, dtype=torch.float32, device=device)
    record["global_scale"] = gs.item()
    paths = build_paths(kernels, shape, sets, gs, device)
    record["errors"].update(skip)
    ran = set()
    for name, path in paths.items():
        if name in skip:
            continue
        error = first_call(path)
        if error is None:
            ran.add(name)
        else:
            record["errors"][name] = error
    record["check"] = check_outputs(paths, ran)
    order = [p for p in PATHS if p in ran]
    for n in range(opts.passes):
        for name in order if n % 2 == 0 else order[::-1]:
            try:
                t = time_path(paths[name], cuda=cuda, opts=opts)
            except Exception as exc:  # noqa: BLE001
                record["errors"][f"{name} (pass {n + 1})"] = describe_error(exc)
                continue
            record["ms"][name][n], record["host_us"][name][n] = t["ms"], t["host_us"]
            record["samples_ms"][name].append(t["samples_ms"])
            record["calls_per_graph"][name] = t["calls"]
            if t["note"]:
                record["timing_notes"][name] = t["note"]
    return report.add_derived(record, opts.passes)


def run(kernels: Kernels, shapes: list[Shape], *, device, opts: argparse.Namespace, on_shape=None) -> dict:
    """Every shape (and the quantizer alone on CUDA unless --no-quant): the results document without meta.
    ``on_shape(records)`` runs after each shape (the partial JSON, should the run be cut short)."""
    cuda = torch.device(device).type == "cuda"
    records = []
    for i, shape in enumerate(shapes, 1):
        r = measure_shape(kernels, shape, device=device, opts=opts)
        records.append(r)
        ms = r["ms"]
        print(f"[{i}/{len(shapes)}] {shape.label}: fused {report.fmt(report._mid(ms['fused']))} ms, "
              f"FA4 {report.fmt(report._mid(ms['fa4']))}, FA4+quant {report.fmt(report._mid(ms['fa4_quant']))}, "
              f"cuDNN+quant {report.fmt(report._mid(ms['cudnn_quant']))}", flush=True)
        if on_shape is not None:
            on_shape(records)
        if cuda:
            torch.cuda.empty_cache()
    method = (f"GPU time per call by CUDA-graph replay (calls captured in one graph so that a replay lasts about "
              f"{opts.graph_ms:g} ms, {opts.replays} replays timed by CUDA events, median per pass); host time "
              f"per call by time.perf_counter around the launch without synchronization (median of up to "
              f"{opts.host_calls} calls, the device synchronized every 25 calls outside the timed region); "
              f"{opts.passes} interleaved passes per shape (every path once per pass, order reversed between "
              "passes); ratios per pass, shown as the range over passes; times the median over passes. "
              "Fresh seeded randn inputs (never zeros); global scale 448 * 6 / amax of the bf16 output"
              if cuda else
              f"CPU run on the reference kernels (float32 attention rounded to bf16, the reference quantizer; "
              f"cuDNN replaced by SDPA's math backend), shapes scaled down by {opts.scale}: wall ms of synchronous "
              f"calls, median of {opts.replays} per pass; meaningless as performance, the logic and bytes checked")
    results = {"device_type": "cuda" if cuda else "cpu", "kernels": kernels.name, "passes": opts.passes,
               "method": method, "l2_policy": _timing.L2_POLICY if cuda else "n/a (CPU)",
               "cudnn_note": CUDNN_NOTE if cuda else "CPU: torch SDPA's math backend stands in for cuDNN",
               "shapes": records, "bandwidth": None}
    if cuda and not opts.no_quant:
        results["bandwidth"] = measure_quant_bandwidth(kernels, device=device, seed=opts.seed, replays=opts.replays,
                                                       target_ms=opts.graph_ms)
    results["targets"] = report.shape_targets(results) + (quant_targets(results["bandwidth"]) if cuda else [])
    return results


def command_line(argv: list[str]) -> str:
    """The command as run (``_command.command_line``)."""
    from _command import command_line as as_run

    return as_run(argv, "bench/attention.py")


def collect_meta(argv: list[str], device) -> dict:
    """Date, device, versions and the command of this run."""
    from importlib import metadata

    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    cuda = torch.device(device).type == "cuda"
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            "device": torch.cuda.get_device_name() if cuda else "CPU", "torch": torch.__version__,
            "triton": version("triton"), "cuda": torch.version.cuda if cuda else None,
            "cudnn": torch.backends.cudnn.version() if cuda and torch.backends.cudnn.is_available() else None,
            "flash_attn": version("flash-attn-4"), "command": command_line(argv)}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python bench/attention.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default): FA4 / cuDNN on the GPU; cpu: the reference kernels on scaled-down shapes")
    parser.add_argument("--shapes", metavar="LIST",
                        help="comma list of batches: 4x128, 32x512, 8x2048, 2x8192, 8x512+4096, 1x2048+30000 "
                             "(BxQ[+context]; default all)")
    parser.add_argument("--layouts", metavar="LIST", help="comma list of mla16, mla128, mha32, gqa64 (default all)")
    parser.add_argument("--passes", type=int, default=2, help="interleaved passes per shape (default 2)")
    parser.add_argument("--replays", type=int, default=10, help="timed graph replays per path and pass (default 10)")
    parser.add_argument("--graph-ms", type=float, default=20.0,
                        help="capture about this many ms of calls in one graph (default 20)")
    parser.add_argument("--host-calls", type=int, default=100, help="host-timed calls per path and pass, at most "
                        "(default 100; fewer when a call's GPU time is long, see --host-ms)")
    parser.add_argument("--host-ms", type=float, default=300.0,
                        help="GPU time the host-timed calls of one path may take, ms (default 300)")
    parser.add_argument("--scale", type=int, help=f"divide lengths and heads by this (default 1 on cuda, "
                                                  f"{CPU_SCALE} on cpu)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument("--no-quant", action="store_true", help="skip the quantizer-alone bandwidth measurement")
    parser.add_argument("--out", metavar="PATH", type=Path, help="write every number as JSON to PATH")
    parser.add_argument("--markdown", metavar="PATH", type=Path,
                        help="write the docs/benchmarks.md section (date, device, command, method, L2 policy, "
                             "table, targets) to PATH")
    args = parser.parse_args(argv)
    for name in ("passes", "replays", "host_calls"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.graph_ms <= 0 or args.host_ms <= 0 or (args.scale is not None and args.scale < 1):
        parser.error("--graph-ms and --host-ms must be > 0, --scale >= 1")
    if args.scale is None:
        args.scale = CPU_SCALE if args.device == "cpu" else 1
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    args = parse_args(argv[1:])
    try:
        shapes = select_shapes(args.shapes, args.layouts, scale=args.scale)
    except ValueError as exc:
        print(f"bench/attention.py: {exc}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print(f"bench/attention.py --device cuda needs a CUDA GPU; torch.cuda.is_available() is False here "
                  f"(torch {torch.__version__}). --device cpu runs the logic on the reference kernels.",
                  file=sys.stderr)
            return 2
        kernels = fa4_kernels()
        device = torch.device("cuda")
    else:
        kernels, device = reference_kernels(), torch.device("cpu")
    meta = collect_meta(argv, device)
    def partial(records):
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"meta": meta, "partial": True, "shapes": records}, indent=1))

    results = run(kernels, shapes, device=device, opts=args, on_shape=partial)
    doc = {"meta": meta, "partial": False, **results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.out}")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(report.markdown(results, meta))
        print(f"wrote {args.markdown}")
    print()
    print(f"attention -> NVFP4 on {meta['device']} ({kernels.name} kernels), {meta['date']} UTC; {results['method']}")
    print(f"L2: {results['l2_policy']}")
    print(report.text_table(report.HEADER, report.rows(results)))
    for line in report.error_lines(results):
        print(f"did not run: {line}")
    for t in results["targets"]:
        print(f"[{report.STATUS[t['status']]}] ({t['id']}) {t['text']}: {t['measured']}")
    failed = [line for r in results["shapes"] for p, line in r["errors"].items()
              if p.split(" ")[0] in FA4_PATHS and not line.startswith("FA4 unavailable")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
