"""Attention -> NVFP4 / FP8: the fused kernels against FA4 bf16 alone, FA4 + quant and cuDNN + quant, in one run.

For each shape (causal, bf16; layouts MLA 16 and 128 heads with head dims (192, 128), MHA 32 heads and
GQA 64/8 with (128, 128); batches 4x128, 32x512, 8x2048, 2x8192, and two chunked prefills, 8x512 after
4096 cached tokens each and 1x2048 after 30000, whose keys come through cu_seqlens_k) it times, for NVFP4

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

and with --formats fp8_static / fp8_group128 / all (float8_e4m3fn [T, H*Dv] under one static scale, or with
float32 scales [T, H*Dv/128]; bench/_attention_formats.py): fused (FA4's SM90 FP8 epilogue from
fusion_pass.kernels.fa4.sm90_fp8; "n/a: <reason>" where this tree or GPU has none), triton_fused (the Triton
FP8 epilogue), FA4 bf16 (timed once per shape for every format), FA4 + quant and cuDNN + quant ([B, H, L, D]
views) with the quant a vLLM user runs: QuantFP8's native form compiled by torch.compile (fullgraph,
dynamic=False, per shape). The bytes are checked on the first call: the compiled quant and fused == the
reference quantizers, Triton and cuDNN within a bound. Lighter timing defaults when an FP8 format runs.

Two numbers per path: GPU time per call by CUDA-graph replay (calls captured in one graph, the graph
replayed, CUDA events, median) and host time per call (time.perf_counter around the launch, no
synchronization, median). Every shape is measured in --passes interleaved passes (each pass times every
path; the order reverses between passes); a ratio is given per pass. Inputs: seeded randn, never zeros;
L2 not flushed, inputs rotate among 3 sets when a set is smaller than 3x the L2. With the quantizer
alone (effective TB/s at 16, 64 and 512 MiB, beside a 1 GiB copy), issue 19's targets and issue 28's.

--device cpu runs the same logic on PyTorch reference kernels with FA4's contract, on shapes scaled down
by --scale (CPU wall time per call; numbers meaningless, the bytes checked): what the CPU tests use.

Examples:
    python bench/attention.py --out "$OUT/attention.json" --markdown "$OUT/attention.md"
    python bench/attention.py --layouts mla128 --shapes 32x512,1x2048+30000 --passes 1
    python bench/attention.py --formats all --out "$OUT/attention_fp8.json" --markdown "$OUT/attention_fp8.md"
    python bench/attention.py --formats fp8_static,fp8_group128 --layouts mla128,gqa64 --shapes 32x512,8x2048,8x512+4096
    python bench/attention.py --device cpu --shapes 32x512 --out /tmp/a.json
    python bench/attention.py --device cpu --formats all --shapes 4x128 --layouts gqa64

Exit code 2: no CUDA device for --device cuda, or an unknown --shapes / --layouts / --formats name; 1: a fused
path, Triton fused, FA4 or FA4 + quant failed at a shape where FA4 is usable and the kernel exists (the reason
is in the JSON and the table says n/a), or a byte check that must hold did not.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
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

import _attention_formats as formats  # noqa: E402
import _attention_fp8_report as fp8_report  # noqa: E402
import _attention_report as report  # noqa: E402
import _timing  # noqa: E402
from _attention_paths import PATHS, build_paths, check_outputs, input_sets_needed, make_inputs  # noqa: E402
from _attention_shapes import Shape, select_shapes  # noqa: E402
from _kernels import Kernels, cudnn_status, fa4_kernels, fa4_status, reference_kernels  # noqa: E402
from _quant_bandwidth import measure_quant_bandwidth, quant_targets  # noqa: E402

FA4_PATHS = ("fused", "fa4", "fa4_quant")
CUDNN_PATHS = ("cudnn_quant_bshd", "cudnn_quant_bhsd")
FP8_FAILING = ("fused", "triton_fused", "fa4", "fa4_quant")
TIMING_DEFAULTS = {"nvfp4": {"replays": 10, "graph_ms": 20.0, "host_calls": 100, "host_ms": 300.0},
                   "fp8": {"replays": 5, "graph_ms": 10.0, "host_calls": 50, "host_ms": 60.0}}
"""Timing defaults: NVFP4 alone as before; a run with an FP8 format (2.6x the paths with --formats all) lighter, so
that the 24 shapes stay within minutes (CUDA-graph replays of >= 10 ms still; every value in the method line)."""
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
    """Run a path once (compiles, autotunes, surfaces refusals; what it returns kept in ``path.result``); the
    reason when it raises."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with path.context():
                path.result = path.call()
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


def measure_shape(kernels: Kernels, shape: Shape, *, device, opts: argparse.Namespace,
                  fp8_kernels: formats.Fp8Kernels | None = None) -> tuple[dict | None, dict[str, dict]]:
    """Every path of one shape and every format of ``opts.formats``, ``opts.passes`` interleaved passes (FA4 bf16
    alone timed once, shared): ``(the NVFP4 record or None, {FP8 format: its record})``."""
    cuda = torch.device(device).type == "cuda"
    names = getattr(opts, "formats", ("nvfp4",))
    record = new_record(shape, opts.passes)
    lay = shape.layout
    first = make_inputs(shape, opts.seed, device)
    n_sets = input_sets_needed(first.nbytes) if cuda else 1
    sets = [first] + [make_inputs(shape, opts.seed + i, device) for i in range(1, n_sets)]
    record["input_sets"] = n_sets
    fp8_names = [f for f in names if f != "nvfp4"]
    fp8_records = {f: formats.new_fp8_record(record, f, opts.passes) for f in fp8_names}
    skip = {}
    if cuda:
        ok, why = fa4_status(device, torch.bfloat16, lay.heads, lay.dqk, lay.dv)
        if not ok:
            skip.update({p: f"FA4 unavailable: {why}" for p in FA4_PATHS})
            skip.update({f"{f}/{p}": f"FA4 unavailable: {why}" for f in fp8_names for p in ("fused", "fa4_quant")})
        ok, why = cudnn_status()
        if not ok:
            skip.update({p: f"cuDNN unavailable: {why}" for p in CUDNN_PATHS})
            skip.update({f"{f}/cudnn_quant": f"cuDNN unavailable: {why}" for f in fp8_names})
    # Global scale: 448 * 6 / amax of the bf16 attention output (of |v| when FA4 does not run here).
    amax = x_ref = None
    if "fa4" not in skip:
        try:
            x_ref = kernels.attention(first.q, first.k, first.v, first.cu_seqlens, first.max_seqlen, causal=True,
                                      softmax_scale=lay.dqk**-0.5, cu_seqlens_k=first.cu_seqlens_k,
                                      max_seqlen_k=first.max_seqlen_k).view(shape.tokens, -1)
            amax = x_ref.abs().amax().float().item()
        except Exception as exc:  # noqa: BLE001
            skip.update({p: f"FA4 bf16 failed: {describe_error(exc)}" for p in FA4_PATHS})
            skip.update({f"{f}/{p}": f"FA4 bf16 failed: {describe_error(exc)}" for f in fp8_names
                         for p in ("fused", "fa4_quant")})
    if not amax:
        amax = first.v.abs().amax().float().item()
    gs = torch.full((1,), 448.0 * 6.0 / amax, dtype=torch.float32, device=device)
    record["global_scale"] = gs.item()
    paths = build_paths(kernels, shape, sets, gs, device)
    if "nvfp4" not in names:
        paths = {"fa4": paths["fa4"]}
    if fp8_names:
        scale, inv = formats.static_scale(amax, device)
        formats.reset_compiled()
    for f in fp8_names:
        fp8_records[f]["scale"] = scale.item() if f == "fp8_static" else None
        for p, path in formats.build_fp8_paths(fp8_kernels, kernels.attention, f, shape, sets, inv, device).items():
            if isinstance(path, str):
                skip.setdefault(f"{f}/{p}", path)
            else:
                paths[f"{f}/{p}"] = path
    ran, first_s = set(), {}
    for name, path in paths.items():
        if name in skip:
            continue
        t0 = time.perf_counter()
        error = first_call(path)
        first_s[name] = time.perf_counter() - t0  # compiles included
        if error is None:
            ran.add(name)
        else:
            skip[name] = error
    record["errors"].update({p: e for p, e in skip.items() if "/" not in p})
    record["check"] = check_outputs(paths, ran) if "nvfp4" in names else {}
    for f, r in fp8_records.items():
        r["errors"].update({p.split("/", 1)[1]: e for p, e in skip.items() if p.startswith(f + "/")})
        r["errors"].update({"fa4": e for p, e in skip.items() if p == "fa4"})
        r["first_call_s"] = {p.rpartition("/")[2]: t for p, t in first_s.items() if p.startswith(f + "/") or p == "fa4"}
        results = {p.split("/", 1)[1]: paths[p].result for p in ran if p.startswith(f + "/")}
        r["check"], r["check_failures"] = formats.check_fp8(f, results, x_ref, scale, inv)
    for path in paths.values():
        path.result = None  # the first calls' outputs: no longer needed
    order = [p for p in list(PATHS) + [k for k in paths if "/" in k] if p in ran]
    for n in range(opts.passes):
        for name in order if n % 2 == 0 else order[::-1]:
            f, _, p = name.rpartition("/")
            targets = [record] if not f else [fp8_records[f]]
            if name == "fa4":
                targets += list(fp8_records.values())
            try:
                t = time_path(paths[name], cuda=cuda, opts=opts)
            except Exception as exc:  # noqa: BLE001
                for r in targets:
                    r["errors"][f"{p} (pass {n + 1})"] = describe_error(exc)
                continue
            for r in targets:
                r["ms"][p][n], r["host_us"][p][n] = t["ms"], t["host_us"]
                r["samples_ms"][p].append(t["samples_ms"])
                r["calls_per_graph"][p] = t["calls"]
                if t["note"]:
                    r["timing_notes"][p] = t["note"]
    fp8_out = {f: fp8_report.add_derived(r, opts.passes) for f, r in fp8_records.items()}
    return (report.add_derived(record, opts.passes) if "nvfp4" in names else None), fp8_out


def run(kernels: Kernels, shapes: list[Shape], *, device, opts: argparse.Namespace, on_shape=None,
        fp8_kernels: formats.Fp8Kernels | None = None) -> dict:
    """Every shape (and the quantizer alone on CUDA unless --no-quant, with nvfp4): the results document without
    meta. ``on_shape(records, fp8_records)`` runs after each shape (the partial JSON, should the run be cut short)."""
    cuda = torch.device(device).type == "cuda"
    names = getattr(opts, "formats", ("nvfp4",))
    records, fp8 = [], {f: [] for f in names if f != "nvfp4"}
    for i, shape in enumerate(shapes, 1):
        t0 = time.perf_counter()
        r, fp8_records = measure_shape(kernels, shape, device=device, opts=opts, fp8_kernels=fp8_kernels)
        if r is not None:
            records.append(r)
            ms = r["ms"]
            print(f"[{i}/{len(shapes)}] {shape.label}: fused {report.fmt(report._mid(ms['fused']))} ms, "
                  f"FA4 {report.fmt(report._mid(ms['fa4']))}, FA4+quant {report.fmt(report._mid(ms['fa4_quant']))}, "
                  f"cuDNN+quant {report.fmt(report._mid(ms['cudnn_quant']))}", flush=True)
        for f, x in fp8_records.items():
            x["seconds"] = time.perf_counter() - t0  # the shape's whole measurement, every format
            fp8[f].append(x)
            print(f"[{i}/{len(shapes)}] {shape.label} {f}: " + ", ".join(
                f"{p} {report.fmt(report._mid(x['ms'][p]))}" for p in formats.FP8_PATHS)
                + f" ms ({x['seconds']:.0f} s)", flush=True)
        if on_shape is not None:
            on_shape(records, fp8)
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
    if cuda and not opts.no_quant and "nvfp4" in names:
        results["bandwidth"] = measure_quant_bandwidth(kernels, device=device, seed=opts.seed, replays=opts.replays,
                                                       target_ms=opts.graph_ms)
    results["targets"] = report.shape_targets(results) + (quant_targets(results["bandwidth"]) if cuda else [])
    if fp8:
        results["formats"] = list(names)
        if "nvfp4" not in names:
            results["targets"] = []
        results["fp8_note"] = formats.fp8_note(cuda)
        results["fp8"] = {f: {"format": formats.by_name(f).key, "shapes": rs,
                              "targets": fp8_report.targets(f, rs, results["device_type"])} for f, rs in fp8.items()}
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
    parser.add_argument("--formats", metavar="LIST", default="nvfp4",
                        help="comma list of output formats: nvfp4, fp8_static, fp8_group128, or all (default nvfp4); "
                             "FA4 bf16 alone is timed once per shape for all of them")
    parser.add_argument("--passes", type=int, default=2, help="interleaved passes per shape (default 2)")
    parser.add_argument("--replays", type=int, help="timed graph replays per path and pass (default 10; 5 when an "
                                                     "FP8 format runs)")
    parser.add_argument("--graph-ms", type=float,
                        help="capture about this many ms of calls in one graph (default 20; 10 when an FP8 format "
                             "runs)")
    parser.add_argument("--host-calls", type=int, help="host-timed calls per path and pass, at most (default 100; 50 "
                        "when an FP8 format runs; fewer when a call's GPU time is long, see --host-ms)")
    parser.add_argument("--host-ms", type=float, help="GPU time the host-timed calls of one path may take, ms "
                        "(default 300; 60 when an FP8 format runs)")
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
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if (args.graph_ms is not None and args.graph_ms <= 0) or (args.host_ms is not None and args.host_ms <= 0) or (
            args.scale is not None and args.scale < 1):
        parser.error("--graph-ms and --host-ms must be > 0, --scale >= 1")
    for name, value in TIMING_DEFAULTS["nvfp4"].items():  # main() takes the FP8 ones where an FP8 format runs
        setattr(args, f"{name}_given", getattr(args, name) is not None)
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.scale is None:
        args.scale = CPU_SCALE if args.device == "cpu" else 1
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    args = parse_args(argv[1:])
    try:
        args.formats = formats.parse_formats(args.formats)
        shapes = select_shapes(args.shapes, args.layouts, scale=args.scale)
    except ValueError as exc:
        print(f"bench/attention.py: {exc}", file=sys.stderr)
        return 2
    fp8_names = [f for f in args.formats if f != "nvfp4"]
    for name, value in TIMING_DEFAULTS["fp8" if fp8_names else "nvfp4"].items():
        if not getattr(args, f"{name}_given"):
            setattr(args, name, value)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print(f"bench/attention.py --device cuda needs a CUDA GPU; torch.cuda.is_available() is False here "
                  f"(torch {torch.__version__}). --device cpu runs the logic on the reference kernels.",
                  file=sys.stderr)
            return 2
        kernels = fa4_kernels()
        device = torch.device("cuda")
        fp8_kernels = formats.fa4_fp8_kernels(device) if fp8_names else None
    else:
        kernels, device = reference_kernels(), torch.device("cpu")
        fp8_kernels = formats.reference_fp8_kernels()
    meta = collect_meta(argv, device)
    def partial(records, fp8_records):
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            doc = {"meta": meta, "partial": True, "shapes": records}
            if fp8_records:
                doc["fp8"] = {f: {"shapes": rs} for f, rs in fp8_records.items()}
            args.out.write_text(json.dumps(doc, indent=1))

    results = run(kernels, shapes, device=device, opts=args, on_shape=partial, fp8_kernels=fp8_kernels)
    doc = {"meta": meta, "partial": False, **results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.out}")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(results, meta))
        print(f"wrote {args.markdown}")
    print()
    what = "/".join(f.upper() if f == "nvfp4" else f for f in args.formats)
    print(f"attention -> {what} on {meta['device']} ({kernels.name} kernels), {meta['date']} UTC; {results['method']}")
    print(f"L2: {results['l2_policy']}")
    if "nvfp4" in args.formats:
        print(report.text_table(report.HEADER, report.rows(results)))
        for line in report.error_lines(results):
            print(f"did not run: {line}")
        for t in results["targets"]:
            print(f"[{report.STATUS[t['status']]}] ({t['id']}) {t['text']}: {t['measured']}")
    for f, block in results.get("fp8", {}).items():
        print(f"\n{block['format']}")
        print(report.text_table(fp8_report.HEADER, fp8_report.rows(block["shapes"])))
        for line in fp8_report.error_lines(block["shapes"]):
            print(f"did not run: {line}")
        for t in block["targets"]:
            print(f"[{report.STATUS[t['status']]}] ({t['id']}) {t['text']}: {t['measured']}")
        for line in fp8_report.check_lines(block["shapes"]):
            print(f"check: {line}")
    failed = failures(results)
    if "fp8" in results:
        for line in failed:
            print(f"FAILED: {line}", file=sys.stderr)
    return 1 if failed else 0


def markdown(results: dict, meta: dict) -> str:
    """The docs section: the NVFP4 one unchanged (``--formats nvfp4``), then a section per FP8 format."""
    if "fp8" not in results:
        return report.markdown(results, meta)
    lines = report.header_lines(results, meta)
    if "nvfp4" in results["formats"]:
        lines += ["### NVFP4", ""] + report.nvfp4_lines(results) + [""]
    lines += [f"FP8 paths: {results['fp8_note']}.", ""]
    return "\n".join(lines) + "\n" + "\n".join(fp8_report.markdown_section(f, b) for f, b in results["fp8"].items())


def failures(results: dict) -> list[str]:
    """What makes the exit code 1: a project kernel (fused, Triton fused, FA4 bf16, FA4 + quant) that failed where
    FA4 is usable and its kernel exists (not ``FA4 unavailable`` / ``n/a``), or a byte check that must hold."""
    out = [line for r in results["shapes"] for p, line in r["errors"].items()
           if p.split(" ")[0] in FA4_PATHS and not line.startswith("FA4 unavailable")]
    for f, block in results.get("fp8", {}).items():
        for r in block["shapes"]:
            out += [f"{f} {r['label']}, {p}: {e}" for p, e in r["errors"].items()
                    if p.split(" ")[0] in FP8_FAILING and not e.startswith(("FA4 unavailable", "n/a"))]
            out += [f"{r['label']}: {x}" for x in r["check_failures"]]
    return out


if __name__ == "__main__":
    sys.exit(main())
