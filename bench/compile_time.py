"""How much the fusion pass adds to torch.compile time of the demo models.

For each demo model (full DeepSeek-V3 / Llama-3-8B attention dimensions, 2
layers) and each variant (without / with the pass), compile from scratch
(Dynamo reset, no FX graph cache; one discarded warm-up compile first, so both
variants find Inductor's kernel caches equally warm) and time the first call on a prefill batch;
the compile time is that minus the median of warm calls. Also reports the time
spent inside the pass itself. Medians over --repeats runs.

    python bench/compile_time.py [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402

from fusion_pass import FusionPass, runtime  # noqa: E402
from fusion_pass.demo import workload as demo
from fusion_pass.demo.models import release_layers  # noqa: E402


def time_compile(model, hidden_size: int, fusion) -> tuple[float, float]:
    """(first call seconds, median warm call seconds) of a fresh compile."""
    torch._dynamo.reset()
    options = {"fx_graph_cache": False}
    if fusion is not None:
        options["post_grad_custom_post_pass"] = fusion
    compiled = torch.compile(model, options=options)
    spec = demo.workload()[0]
    seconds = []
    for i in range(4):  # fresh random inputs each call; the first call compiles
        runtime.clear_kv_caches()
        positions, hidden = demo.make_inputs(spec, hidden_size, "cpu", seed=i)
        torch._dynamo.mark_dynamic(positions, 0)
        torch._dynamo.mark_dynamic(hidden, 0)
        start = time.perf_counter()
        with runtime.batch(spec), torch.no_grad():
            compiled(positions, hidden)
        seconds.append(time.perf_counter() - start)
    return seconds[0], statistics.median(seconds[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="fresh compiles per variant (default 3)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args()
    rows = []
    for name in demo.MODELS:
        model = demo.build_model(name)
        hidden_size = model.norms[0].normalized_shape[0]
        try:
            time_compile(model, hidden_size, FusionPass())  # warm-up: fills Inductor's on-disk kernel caches
            compile_s = {"without": [], "with": []}
            pass_s = []
            for _ in range(args.repeats):
                for variant in ("without", "with"):
                    fusion = FusionPass() if variant == "with" else None
                    first, warm = time_compile(model, hidden_size, fusion)
                    compile_s[variant].append(first - warm)
                    if fusion is not None:
                        report = fusion.report()
                        assert report["rewritten"] == model.layers.__len__(), report
                        pass_s.append(report["seconds"])
        finally:
            release_layers(model)
        without, with_ = statistics.median(compile_s["without"]), statistics.median(compile_s["with"])
        rows.append({"model": name, "compile_s_without": without, "compile_s_with": with_,
                     "overhead_pct": 100 * (with_ - without) / without,
                     "pass_ms": 1e3 * statistics.median(pass_s), "pass_pct": 100 * statistics.median(pass_s) / without})
    print(f"{'model':<6} {'compile w/o (s)':>16} {'compile with (s)':>17} {'overhead':>9} {'in pass (ms)':>13} {'pass share':>11}")
    for r in rows:
        print(f"{r['model']:<6} {r['compile_s_without']:>16.2f} {r['compile_s_with']:>17.2f} {r['overhead_pct']:>8.1f}% "
              f"{r['pass_ms']:>13.1f} {r['pass_pct']:>10.2f}%")
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
                "repeats": args.repeats}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
