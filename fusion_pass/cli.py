"""``fusion-pass``: the command-line entry point."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

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
  dump      the same run with graph dumps on, in a new folder per run
            (DIR/run_NNN_pid<PID>/): per compiled graph the post-grad graph
            before/after the pass, the match report, and depyf's dump.
  backends  list the fused-attention backends and why each is (un)available.
  report    add up the pass reports that vLLM's processes wrote (FUSION_PASS_DUMP).
  selftest  the first thing to run on a new GPU: run each fused backend's canary
            (its NVFP4 bytes against its unfused twin's) for every head-dim
            pair of its kernels on this GPU, in bf16 and fp16; time a few
            prefill shapes fused vs FA4 + quant and cuDNN + quant; one verdict
            per backend (correct / FAILED, faster / slower). Exit code 1 when a
            canary fails, 3 when none could run on the GPU or the --device asked
            for is not here. Without CUDA (and no --device cuda) it says what it
            would check (--json).

Every command checks its options and the FUSION_PASS_* environment variables
before any work: a bad one is one line on stderr naming it, and exit code 2.
"""

SELFTEST_DESCRIPTION = """\
The first thing to run on a new GPU: are the fused kernels correct here, and faster than the unfused path?

What it checks:
  canaries  every backend available on the device that offers a canary (today fa4) runs it through
            fusion_pass.runtime.self_check for each dtype (bfloat16, float16; --dtype) and each
            head-dim pair (D, Dv) of its kernels on this GPU generation, for a layer of {heads} query
            heads on 16 KV heads for (192, 128) (MLA) and on 4 for the others (GQA; the kernels compile
            per query heads per KV head; the canary runs that ratio on 2 KV heads):
{head_dims}
            the fused NVFP4 kernel against the same attention forward in the query dtype + the
            reference quantizer on fixed small batches, every byte of the codes and of the swizzled
            scales compared. Other backends: "no canary".
  timing    GPU time per call (median of --repeats replays of a CUDA graph of one call, CUDA events,
            L2 flushed before each) of the fused backends ({timed}) against FA4's forward +
            fusion_pass.kernels.quantize and cuDNN SDPA (on the padded batch [B, H, S, D] of equal-length
            sequences) + the same quantizer; the ratio is best unfused / fused (above 1: fused is
            faster). Shapes (H = query/KV heads, D = qk/v head dims, sequences x tokens, causal, in
            the first dtype asked for):
{shapes}
  verdicts  per backend: correct, or FAILED with the configuration and the first differing byte; and
            faster / slower than the best unfused path (geometric mean of the ratios, and at how many shapes).

What it costs:
  each canary configuration compiles the fused kernel and its twin the first time it runs in a process
  (seconds: 7-11 s each on an H200, about 75 s for fa4's 8 SM90 configurations), then runs in well
  under a second; the timing compiles each path once per shape, then takes well under a second per
  path. Progress lines go to stderr. Without a CUDA device nothing runs: it prints what it would
  check and why it cannot.

Exit codes:
  0  every canary passed (no --device given and no CUDA device, or --device cpu: nothing ran, it says what it
     would check; timings never fail the run)
  1  a canary FAILED: that backend's fused kernel is wrong on this GPU (the run time disables it)
  2  bad arguments or a bad FUSION_PASS_* environment variable (one line naming it)
  3  a CUDA device, but no canary could run on it (no available backend has one: e.g. the fa4 extra is
     missing, or no kernel of this project for the GPU): nothing was checked; or --device cuda / cuda:N asked
     for a device this machine does not have (no CUDA, or N >= the device count): one line saying so (--json:
     "passed": false and the reason), nothing was checked
"""


def _device(value: str) -> str:
    """An argparse type, the one ``--device`` grammar of every command: ``cpu``, ``cuda`` or ``cuda:N``. Whether
    the machine has that device is each command's check (:func:`_missing_device`), not a usage error here."""
    kind, colon, index = value.partition(":")
    if value == "cpu" or (kind == "cuda" and (not colon or index.isdigit())):
        return value
    raise argparse.ArgumentTypeError(f"--device must be cpu, cuda or cuda:N, got {value!r}")


def _missing_device(device: str | None) -> str | None:
    """Why ``device`` (a :func:`_device` value) is not on this machine, or None when it is (or is the CPU)."""
    if device is None or not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return f"--device {device} was asked for but torch sees no CUDA device"
    index = torch.device(device).index
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        return (f"--device {device} was asked for but this machine has {count} CUDA device(s) "
                f"(cuda:0 to cuda:{count - 1})")
    return None


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
    parser.add_argument("--device", type=_device, default="cpu",
                        help="cpu, cuda (the current CUDA device) or cuda:N (default: cpu)")
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
    demo.add_argument("--json", metavar="PATH",
                      help="also write the results as JSON to PATH (its directory must exist and be writable; checked "
                      "before the run)")
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
        description="Run the demo with fusion_pass.compile.debug.dump(DIR), in a new folder for this run, "
        "DIR/run_NNN_pid<PID>/ (a reused DIR never mixes runs): per compiled graph graph_NNN_before.py, "
        "graph_NNN_after.py, graph_NNN_report.json, and depyf's artifacts under depyf/.",
    )
    dump.add_argument("--out", metavar="DIR", required=True,
                      help="directory for the dumps (created if missing; must be writable; each run writes a new "
                      "run_NNN_pid<PID>/ in it)")
    _add_run_arguments(dump)
    commands.add_parser("backends", help="list the fused-attention backends and their availability")
    report = commands.add_parser(
        "report",
        help="add up the pass reports that vLLM's processes wrote under FUSION_PASS_DUMP",
        description="Read DIR/reports/vllm_report_<pid>.json (one per vLLM process that ran the pass, written when "
        "FUSION_PASS_DUMP=DIR and kept current while it serves; DIR/vllm_report_<pid>.json, where earlier releases "
        "wrote them, is read too) and print one line per process and the totals: layers rewritten, refusals by "
        "reason, fused and fallback calls, prefill tokens fused and tokens post-quantized by reason.",
    )
    report.add_argument("dir", metavar="DIR", help="the FUSION_PASS_DUMP directory")
    report.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    _add_selftest(commands)
    return parser


def _add_selftest(commands) -> None:
    from fusion_pass import selftest
    from fusion_pass.runtime.backends import registry

    indent = " " * 14
    head_dims = "\n".join(f"{indent}{backend.name} on {generation}: " + " ".join(f"({d},{dv})" for d, dv in pairs)
                          for backend in registry.BACKENDS if selftest.has_canary(backend)
                          for generation, pairs in selftest.canary_generations(backend).items())
    description = SELFTEST_DESCRIPTION.format(
        head_dims=head_dims, heads=selftest.CANARY_HEADS, timed=", ".join(selftest.TIMED_BACKENDS),
        shapes="\n".join(indent + s.label for s in selftest.SHAPES))
    parser = commands.add_parser(
        "selftest", help="check the fused kernels on this GPU (canaries, timing, verdicts); exit 1 if one is wrong",
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    parser.add_argument("--device", type=_device, default=None,
                        help="cpu, cuda or cuda:N (default: the current CUDA device, else cpu); a CUDA device this "
                        "machine does not have: exit code 3")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "all"), default="all",
                        help="the canaries' query dtype (default: all); the timing runs the first one")
    parser.add_argument("--no-timing", action="store_true", help="canaries and verdicts on correctness only")
    parser.add_argument("--repeats", type=_positive, default=selftest.REPEATS, metavar="N",
                        help=f"timed calls per path and shape, the median is shown (default: {selftest.REPEATS})")


def _progress(line: str) -> None:
    """The demo's progress lines: on stderr, so that stdout holds the results only."""
    print(line, file=sys.stderr, flush=True)


class UsageError(Exception):
    """A bad option or environment variable found before any work: one line on stderr, exit code 2."""


def _check_json_path(path: str, option: str = "--json") -> None:
    """``path`` can be written as a file: not a directory, in an existing writable directory."""
    target = Path(path)
    expected = "expected a file path in an existing, writable directory"
    if not path or target.is_dir():
        raise UsageError(f"{option}={path!r} is a directory: {expected}")
    parent = target.parent
    if not parent.exists():
        raise UsageError(f"{option}={path!r}: the directory {str(parent)!r} does not exist: {expected}")
    if not parent.is_dir():
        raise UsageError(f"{option}={path!r}: {str(parent)!r} is not a directory: {expected}")
    if not os.access(parent, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise UsageError(f"{option}={path!r} is not writable: {expected}")


def _check_before_work(args: argparse.Namespace) -> None:
    """Everything a command needs, checked before it starts: the FUSION_PASS_* environment variables (every
    command), then its paths and its device. Raises :class:`UsageError` with the one line to print."""
    from fusion_pass.compile import debug
    from fusion_pass.runtime.settings import check_environment

    try:
        check_environment()
        debug.check_environment()
        if args.command == "dump":
            debug.check_directory(args.out, "--out")
    except ValueError as exc:  # ArgumentError is one
        raise UsageError(str(exc)) from None
    if getattr(args, "json", None) and args.command == "demo":
        _check_json_path(args.json)
    if args.command in ("demo", "dump"):
        missing = _missing_device(args.device)
        if missing:
            raise UsageError(missing)


def _run_demo(args: argparse.Namespace) -> int:
    import contextlib

    import torch

    from fusion_pass.demo import workload as demo

    models = demo.MODELS if args.model == "all" else (args.model,)
    cuda = torch.device(args.device).type == "cuda"
    # --time exists on `demo` only; None there means the device's default
    timing = getattr(args, "time", False)
    if timing is None:
        timing = cuda
    warmup, repeats = getattr(args, "warmup", 3), getattr(args, "repeats", 20)
    progress = None if getattr(args, "quiet", False) else _progress
    # cuda:N: the current device while the demo runs, so that the kernels launch on it and the timing's CUDA
    # events and synchronizes are its own (plain cuda: the current device already)
    index = torch.device(args.device).index
    on_device = torch.cuda.device(index) if cuda and index is not None else contextlib.nullcontext()
    with on_device:
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
        try:
            with open(args.json, "w") as f:
                json.dump(demo.results_json(run.results, run.report, run.timings), f, indent=2)
        except OSError as exc:  # checked before the run; the directory changed since
            print(f"fusion-pass {args.command}: --json={args.json!r}: cannot write it ({exc.strerror or exc})",
                  file=sys.stderr)
            return 1
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
    from fusion_pass.runtime.self_check import self_check_results
    from fusion_pass.runtime import policy
    from fusion_pass.runtime.settings import (BACKEND_ENV, CONTEXT_WORKSPACE_ENV, POLICY_ENV, SELF_CHECK_ENV,
                                              SPLIT_MIXED_ENV, configured_backend, context_workspace_tokens,
                                              policy_mode, self_check_mode, split_mixed)

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
              f"{context_workspace_tokens()} tokens ({CONTEXT_WORKSPACE_ENV}); self-check: {self_check_mode()} "
              f"({SELF_CHECK_ENV}; fusion-pass selftest runs the checks now); vLLM standard layers split mixed "
              f"calls: {split_mixed()} ({SPLIT_MIXED_ENV})")
        for result in self_check_results():
            print(f"  self-check {result.describe()}")
        here = policy.generation(default_device())
        print(f"\npolicy: {policy_mode()} ({POLICY_ENV}; 'always' fuses every call a backend runs): which calls auto "
              f"fuses, per GPU generation and row plan (this machine: {here}; slower_here counts the others)")
        for rule in policy.POLICY_TABLE:
            mark = "*" if rule.generation == here else " "
            print(f" {mark}{rule.generation:<6} {rule.rows:<17} {'fuse' if rule.fuse else 'unfused':<8} "
                  f"{'measured' if rule.measured else 'not measured'}: {rule.evidence}")
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


def _run_selftest(args: argparse.Namespace) -> int:
    from fusion_pass import selftest

    dtypes = tuple(selftest.DTYPES.values()) if args.dtype == "all" else (selftest.DTYPES[args.dtype],)
    report = selftest.run_selftest(args.device, dtypes=dtypes, timing=not args.no_timing, repeats=args.repeats,
                                   progress=_progress)
    if report.get("device_missing") and not args.json:  # asked for a device that is not here: one line
        print(f"fusion-pass selftest: {report['reason']}: nothing was checked (exit code {report['exit_code']})",
              file=sys.stderr)
    else:
        print(json.dumps(report, indent=2) if args.json else selftest.format_report(report))
    return report["exit_code"]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        _check_before_work(args)
    except UsageError as exc:
        print(f"fusion-pass {args.command}: {exc}", file=sys.stderr)
        return 2
    if args.command == "demo":
        return _run_demo(args)
    if args.command == "dump":
        return _run_dump(args)
    if args.command == "backends":
        return _run_backends()
    if args.command == "report":
        return _run_report(args)
    return _run_selftest(args)


if __name__ == "__main__":
    sys.exit(main())
