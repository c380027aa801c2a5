"""``fusion-pass``: the command-line entry point."""

from __future__ import annotations

import argparse
import json
import sys
import warnings

# torch warns at import when NumPy is absent; nothing here uses NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

DESCRIPTION = """\
attn-nvfp4-fusion: fuse attention -> NVFP4 quant -> o_proj under torch.compile.

commands:
  demo   run the demo workload (prefill, decode, mixed, chunked prefill) through
         a DeepSeek-V3-style MLA stack and a GQA stack, eagerly and compiled,
         and print per batch the kind, the token count and the largest
         difference between the compiled and the eager output.
"""


def _device(value: str) -> str:
    if value not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"--device must be 'cpu' or 'cuda', got {value!r}")
    return value


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {number}")
    return number


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fusion-pass", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="run the demo workload eagerly and compiled and print a table",
        description="Run the demo workload through the demo models (DeepSeek-V3 attention dimensions at "
        "TP=8, and a Llama-3-8B-style GQA stack), eagerly and under torch.compile.",
    )
    demo.add_argument("--model", choices=("mla", "gqa", "all"), default="all", help="which demo model (default: all)")
    demo.add_argument("--device", type=_device, default="cpu", help="cpu or cuda (default: cpu)")
    demo.add_argument("--layers", type=_positive, default=2, help="attention layers per model (default: 2)")
    demo.add_argument("--tiny", action="store_true", help="small dimensions instead of the real ones (fast)")
    demo.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    return parser


def _run_demo(args: argparse.Namespace) -> int:
    import torch

    from fusion_pass import demo

    if args.device == "cuda" and not torch.cuda.is_available():
        print("fusion-pass demo: --device cuda was asked for but torch sees no CUDA device", file=sys.stderr)
        return 2
    models = demo.MODELS if args.model == "all" else (args.model,)
    results = demo.run_demo(models, tiny=args.tiny, device=args.device, layers=args.layers)
    print(demo.format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(demo.results_json(results), f, indent=2)
        print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _run_demo(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
