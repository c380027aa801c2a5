"""``fusion-pass``: the command-line entry point."""

from __future__ import annotations

import argparse
import json
import sys

DESCRIPTION = """\
attn-nvfp4-fusion: fuse attention -> NVFP4 quant -> o_proj under torch.compile.

commands:
  demo      run the demo workload (prefill, decode, mixed, chunked prefill)
            through a DeepSeek-V3-style MLA stack and a GQA stack, compiled
            with and without the fusion pass; print per batch whether the fused
            kernel ran (or the fallback, and why), how far the fused NVFP4
            output is from the unfused one against its bound, byte equality on
            fallback batches, then the pass's report; with --time (the
            default with --device cuda) also the time of the compiled stack
            without vs with the pass on the prefill batches, and the speedup.
            Progress lines (one per model and phase) go to stderr (--quiet:
            none); the results go to stdout.
  dump      the same run with graph dumps on: per compiled graph the post-grad
            graph before/after the pass, the match report, and depyf's dump.
  backends  list the fused-attention backends and why each is (un)available.
"""


def _device(value: str) -> str:
    if value not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"--device must be 'cpu' or 'cuda', got {value!r}")
    return value


def _integer_at_least(minimum: int, what: str):
    """An argparse type: an integer >= ``minimum``, described as ``what`` in errors."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {value!r}") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {number}")
        return number

    return parse


_positive = _integer_at_least(1, "positive")
_non_negative = _integer_at_least(0, "non-negative")


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=("mla", "gqa", "all"), default="all", help="which demo model (default: all)")
    parser.add_argument("--device", type=_device, default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--layers", type=_positive, default=2, help="attention layers per model (default: 2)")
    parser.add_argument("--tiny", action="store_true", help="small dimensions instead of the real ones (fast)")
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="no progress lines (one per model and phase, on stderr)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fusion-pass", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="run the demo workload with and without the pass; print a table (and, with --time, the prefill speedup)",
        description="Run the demo workload through the demo models (DeepSeek-V3 attention dimensions at "
        "TP=8, and a Llama-3-8B-style GQA stack), compiled with and without the fusion pass.",
    )
    _add_run_arguments(demo)
    demo.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    demo.add_argument(
        "--time", action=argparse.BooleanOptionalAction, default=None,
        help="time the whole compiled attention stack without vs with the pass on each prefill batch and print "
        "the speedup (CUDA events on cuda, time.perf_counter on cpu); default: on with --device cuda, off on cpu",
    )
    demo.add_argument("--repeats", type=_positive, default=20, metavar="N",
                      help="with --time: timed calls per variant and batch, the median is shown (default: 20)")
    demo.add_argument("--warmup", type=_non_negative, default=3, metavar="N",
                      help="with --time: untimed calls first, per variant and batch (default: 3)")
    dump = commands.add_parser(
        "dump",
        help="run the demo with graph dumps written to a directory",
        description="Run the demo with fusion_pass.compile.debug.dump(DIR): per compiled graph graph_NNN_before.py, "
        "graph_NNN_after.py, graph_NNN_report.json, and depyf's artifacts under DIR/depyf.",
    )
    dump.add_argument("--out", metavar="DIR", required=True, help="directory for the dumps (created if missing)")
    _add_run_arguments(dump)
    commands.add_parser("backends", help="list the fused-attention backends and their availability")
    report = commands.add_parser(
        "report",
        help="add up the pass reports that vLLM's processes wrote under FUSION_PASS_DUMP",
        description="Read DIR/vllm_report_<pid>.json (one per vLLM process that ran the pass, written when "
        "FUSION_PASS_DUMP=DIR) and print one line per process and the totals: layers rewritten, refusals by "
        "reason, fused and fallback calls.",
    )
    report.add_argument("dir", metavar="DIR", help="the FUSION_PASS_DUMP directory")
    report.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    return parser


def _progress(line: str) -> None:
    """The demo's progress lines: on stderr, so that stdout holds the results only."""
    print(line, file=sys.stderr, flush=True)


def _run_demo(args: argparse.Namespace) -> int:
    import torch

    from fusion_pass.demo import workload as demo

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"fusion-pass {args.command}: --device cuda was asked for but torch sees no CUDA device",
              file=sys.stderr)
        return 2
    models = demo.MODELS if args.model == "all" else (args.model,)
    # --time exists on `demo` only; None there means the device's default
    timing = getattr(args, "time", False)
    if timing is None:
        timing = args.device == "cuda"
    warmup, repeats = getattr(args, "warmup", 3), getattr(args, "repeats", 20)
    progress = None if getattr(args, "quiet", False) else _progress
    run = demo.run_demo(models, tiny=args.tiny, device=args.device, layers=args.layers,
                        timing=timing, warmup=warmup, repeats=repeats, progress=progress)
    print(demo.format_table(run.results))
    print()
    print(demo.format_report(run.report))
    if timing:
        print()
        print(demo.format_timing(run.timings, device=args.device, layers=args.layers, warmup=warmup,
                                 repeats=repeats))
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(demo.results_json(run.results, run.report, run.timings), f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _run_dump(args: argparse.Namespace) -> int:
    from fusion_pass.compile import debug

    with debug.dump(args.out) as path:
        status = _run_demo(args)
    print(f"dumps in {path}")
    return status


def _run_backends() -> int:
    from fusion_pass.runtime.backends import list_backends
    from fusion_pass.runtime.settings import (BACKEND_ENV, CONTEXT_WORKSPACE_ENV, configured_backend,
                                              context_workspace_tokens)

    from fusion_pass.runtime.backends.selection import default_device

    entries = list_backends()
    for entry in entries:
        state = "available" if entry["available"] else "unavailable"
        print(f"{entry['name']:<10} {state:<12} {entry['reason']}")
    picked = [e for e in entries if e["auto"]]
    print(f"\nauto on {default_device()}: " + (
        f"picks {picked[0]['name']} where it supports the layer ({picked[0]['auto_reason']})" if picked else
        "picks no backend: fused calls take the exact fallback (no_fast_backend; name a backend to run it anyway)"))
    for entry in entries:
        if entry["available"] and not entry["auto"]:
            print(f"  {entry['name']}: not picked by auto: {entry['auto_reason']}")
    try:
        print(f"\nchoice: {configured_backend()} ({BACKEND_ENV}); context workspace bound: "
              f"{context_workspace_tokens()} tokens ({CONTEXT_WORKSPACE_ENV})")
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


def _run_report(args: argparse.Namespace) -> int:
    from fusion_pass.compile import process_reports

    try:
        summary = process_reports.summarize(args.dir)
    except (FileNotFoundError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2) if args.json else process_reports.format_summary(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _run_demo(args)
    if args.command == "dump":
        return _run_dump(args)
    if args.command == "backends":
        return _run_backends()
    if args.command == "report":
        return _run_report(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
