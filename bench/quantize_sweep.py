"""Sweep the NVFP4 quantizer's tile configurations on the GPU; check every candidate's bytes; suggest the size table.

    python bench/quantize_sweep.py --out DIR [--quick] [--sizes 16,64,256,512]

For each input size (bf16 [M, K], MiB of input: 16 = [2048, 4096], 64 = [8192, 4096],
256 = [16384, 8192], 512 = [16384, 16384]) it times

  before      the element-pair kernel (``LEGACY_CONFIG``, what shipped before issue 19);
  candidates  the block kernel (``kernel: "words"``) over (BLOCK_M, BLOCK_C, num_warps);
  table       the configuration ``select_config`` picks today, also as the row-range variant
              (``quantize_rows_launch`` of rows [64, M) into the same buffers);
  copy        ``torch.clone`` of the same bf16 input (bytes read + written);

and writes ``DIR/quantize_sweep.json`` (every timing, every check) and ``DIR/quantize_sweep.md``
(a summary and the suggested ``QUANT_CONFIGS`` table: the fastest candidate per size class).

Bandwidth = (bytes read + bytes written) / time, as in ``bench/attention.py``: read ``2*M*K``,
written ``M*K/2`` packed codes plus the swizzled scale buffer ``round_up(M,128) * round_up(K/16,4)``;
the copy moves ``2 * 2*M*K``.

Timing: GPU time per call by CUDA-graph replay (``--calls`` calls captured in one graph, the graph
replayed ``--replays`` times, CUDA events, median over replays, divided by the calls). L2 policy: not
flushed; the calls of a graph rotate over input sets (fresh ``randn`` bf16 data each, never zeros,
their own output buffers) whose total size is at least 3x the L2, so every call streams from HBM.

Bytes: every candidate (and the before line, the table's choice and its row-range variant) is
compared with the reference quantizer (``fusion_pass.nvfp4.quantize`` on the GPU) on the first input
set of each size, and on a special-value input (NaN, +-Inf, +-0, subnormal, saturating and e2m1-tie
blocks) of [4099, 4112]; any difference is a failure (exit code 1) and is listed in the JSON.

Exit codes: 0 all bytes equal, 1 a byte mismatch or a kernel error, 2 no CUDA device.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("fusion_pass") is None:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))
if str(REPO_ROOT / "bench") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "bench"))

from _quant_bandwidth import quant_bytes  # noqa: E402

SIZES = {16: (2048, 4096), 64: (8192, 4096), 256: (16384, 8192), 512: (16384, 16384)}
ROWS_START = 64


def candidates(quick: bool) -> list[dict]:
    """Block-kernel tiles: blocks per thread 1..8, 2..8 warps, a warp along 32..128 block columns."""
    out = []
    for warps in ((4, 8) if quick else (2, 4, 8)):
        for per_thread in ((2, 4) if quick else (1, 2, 4, 8)):
            for block_c in ((32, 64) if quick else (32, 64, 128)):
                block_m = per_thread * 32 * warps // block_c
                if block_m >= 1 and block_m <= 64:
                    out.append({"kernel": "words", "BLOCK_M": block_m, "BLOCK_C": block_c, "num_warps": warps})
    return out


def name(config: dict) -> str:
    if config.get("kernel", "pairs") == "pairs":
        return f"pairs {config['BLOCK_M']}x{config['BLOCK_K']} w{config['num_warps']}"
    return f"words {config['BLOCK_M']}x{config['BLOCK_C']} w{config['num_warps']}"


def graph_ms(calls: list, replays: int) -> float:
    """Median ms per call of the ``calls`` (closures, one per input set) captured into one CUDA graph and replayed
    (``_timing.graph_replay_ms``)."""
    from _timing import cycling, graph_replay_ms, median

    for fn in calls[: min(len(calls), 8)]:  # warm-up outside capture (compiles)
        fn()
    torch.cuda.synchronize()
    return median(graph_replay_ms(cycling(calls), calls=len(calls), replays=replays))


def special_input(m: int, k: int, device) -> torch.Tensor:
    """Seeded blocks over many magnitudes with NaN, +-Inf, +-0, subnormal, saturating and tie blocks."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(19)
    x = torch.randn(m, k, generator=gen) * torch.exp2(
        torch.randint(-12, 12, (m, k // 16), generator=gen).float()).repeat_interleave(16, dim=1)
    blocks = x.view(m, k // 16, 16)
    kind = torch.randint(0, 12, (m, k // 16), generator=gen)
    j = torch.randint(0, 16, (m, k // 16), generator=gen)
    rows, cols = torch.nonzero(kind == 0, as_tuple=True)
    blocks[rows, cols, j[rows, cols]] = float("nan")
    rows, cols = torch.nonzero(kind == 1, as_tuple=True)
    blocks[rows, cols, j[rows, cols]] = float("-inf")
    rows, cols = torch.nonzero(kind == 2, as_tuple=True)
    blocks[rows, cols] = torch.randn(rows.numel(), 16, generator=gen) * 1e-39
    rows, cols = torch.nonzero(kind == 3, as_tuple=True)
    blocks[rows, cols] = -0.0
    rows, cols = torch.nonzero(kind == 4, as_tuple=True)
    blocks[rows, cols, j[rows, cols]] = 6e4
    rows, cols = torch.nonzero(kind == 5, as_tuple=True)
    blocks[rows, cols] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)
    return x.to(torch.bfloat16).to(device)


def check(launch, x, gs, want) -> dict:
    """Bytes of ``launch(x, gs, packed, scales)`` (into 0xAB-poisoned buffers) against ``want``."""
    m, k = x.shape
    packed = torch.full((m, k // 2), 0xAB, dtype=torch.uint8, device=x.device)
    scales = torch.full(tuple(want[1].shape), 0xAB, dtype=torch.uint8, device=x.device)
    launch(x, gs, packed, scales)
    torch.cuda.synchronize()
    packed_diff = int((packed != want[0]).sum())
    scales_diff = int((scales != want[1].view(torch.uint8)).sum())
    return {"equal": packed_diff == 0 and scales_diff == 0, "packed_bytes_differ": packed_diff,
            "scale_bytes_differ": scales_diff}


def check_rows(q, x, gs, want) -> dict:
    """``quantize_rows_launch`` of rows [ROWS_START, M) into poisoned buffers: those rows' bytes equal the
    reference's, every other byte keeps the poison."""
    from fusion_pass import nvfp4

    m, k = x.shape
    packed = torch.full((m, k // 2), 0xAB, dtype=torch.uint8, device=x.device)
    scales = torch.full(tuple(want[1].shape), 0xAB, dtype=torch.uint8, device=x.device)
    q.quantize_rows_launch(x[ROWS_START:], gs, packed, scales, ROWS_START)
    torch.cuda.synchronize()
    first = nvfp4.row_scale_offsets(0, ROWS_START, k // 16, x.device)
    later = nvfp4.row_scale_offsets(ROWS_START, m, k // 16, x.device)
    flat, ref = scales.view(-1), want[1].view(torch.uint8).view(-1)
    rows_equal = bool(torch.equal(packed[ROWS_START:], want[0][ROWS_START:]) and torch.equal(flat[later], ref[later]))
    untouched = bool((packed[:ROWS_START] == 0xAB).all() and (flat[first] == 0xAB).all())
    return {"equal": rows_equal and untouched, "rows_equal": rows_equal, "other_rows_untouched": untouched}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".", help="directory for quantize_sweep.json / .md (default: .)")
    parser.add_argument("--sizes", default="16,64,256,512", help="input sizes in MiB, of 16,64,256,512")
    parser.add_argument("--quick", action="store_true", help="fewer candidates")
    parser.add_argument("--calls", type=int, default=0, help="calls per graph (default: enough for ~2 ms)")
    parser.add_argument("--replays", type=int, default=7, help="graph replays per timing (default 7)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/quantize_sweep.py needs a CUDA device", file=sys.stderr)
        return 2
    from fusion_pass import nvfp4
    from fusion_pass.kernels.triton import quantize as q

    device = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    sizes = [int(s) for s in args.sizes.split(",")]
    configs = [q.LEGACY_CONFIG] + candidates(args.quick)
    failures: list[str] = []
    results = {"device": torch.cuda.get_device_name(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "command": " ".join(["python", "bench/quantize_sweep.py"] + (argv if argv is not None else sys.argv[1:])),
               "torch": torch.__version__, "l2_bytes": l2,
               "method": "CUDA-graph replay, median over replays, per call; L2 not flushed, inputs rotate over sets "
                         ">= 3x L2", "bandwidth": "(bytes read + bytes written) / time", "sizes": {}}
    started = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # special values, every candidate
    xs = special_input(4099, 4112, device)
    gs_s = torch.tensor([448 * 6 / float(xs.float()[torch.isfinite(xs.float())].abs().max())], device=device)
    want_s = nvfp4.quantize(xs, gs_s)
    results["special_values"] = {}
    for config in configs:
        try:
            result = check(lambda x, g, p, s, c=config: q.quantize_launch(x, g, packed=p, scales=s, config=c),
                           xs, gs_s, want_s)
        except Exception as exc:  # a tile that does not compile
            result = {"equal": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
        results["special_values"][name(config)] = result
        if not result["equal"]:
            failures.append(f"special values: {name(config)}: {result}")

    for size in sizes:
        m, k = SIZES[size]
        nbytes = quant_bytes(m, k)
        n_sets = max(1, min(16, math.ceil(3 * l2 / nbytes)))  # a set: its input and its outputs
        gen = torch.Generator(device=device)
        gen.manual_seed(size)
        sets = []
        for _ in range(n_sets):
            x = torch.randn(m, k, generator=gen, device=device, dtype=torch.float32).mul_(
                torch.exp(torch.randn(m, 1, generator=gen, device=device))).to(torch.bfloat16)
            packed = torch.empty(m, k // 2, dtype=torch.uint8, device=device)
            scales = torch.empty(nvfp4.scale_shape(m, k), dtype=torch.uint8, device=device)
            sets.append((x, packed, scales))
        gs = torch.tensor([448 * 6 / float(sets[0][0].float().abs().max())], device=device)
        want = nvfp4.quantize(sets[0][0], gs)
        calls_n = args.calls or n_sets * max(1, math.ceil(2e-3 / (nbytes / 3.5e12) / n_sets))  # ~2 ms per replay
        record = {"m": m, "k": k, "input_bytes": 2 * m * k, "bytes": nbytes, "input_sets": n_sets, "calls": calls_n,
                  "candidates": {}}

        def timed(fn_for_set) -> float:
            calls = [fn_for_set(sets[i % n_sets]) for i in range(calls_n)]
            return graph_ms(calls, args.replays)

        for config in configs:
            entry = {"config": config}
            try:
                entry["check"] = check(lambda x, g, p, s, c=config: q.quantize_launch(x, g, packed=p, scales=s, config=c),
                                       sets[0][0], gs, want)
                ms = timed(lambda st, c=config: (lambda: q.quantize_launch(st[0], gs, packed=st[1], scales=st[2], config=c)))
                entry.update(ms=ms, tbps=nbytes / (ms * 1e-3) / 1e12)
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
                traceback.print_exc()
            if not entry.get("check", {}).get("equal", False):
                failures.append(f"{size} MiB: {name(config)}: {entry.get('check') or entry.get('error')}")
            record["candidates"][name(config)] = entry
            print(f"{size:4d} MiB {name(config):24s} {entry.get('ms', float('nan')) * 1e3:8.1f} us "
                  f"{entry.get('tbps', float('nan')):5.2f} TB/s bytes {'ok' if entry.get('check', {}).get('equal') else 'DIFFER'}",
                  flush=True)

        table = q.select_config(sets[0][0])
        rows_ms = timed(lambda st: (lambda: q.quantize_rows_launch(st[0][ROWS_START:], gs, st[1], st[2], ROWS_START)))
        rows_check = check_rows(q, sets[0][0], gs, want)
        rows_bytes = quant_bytes(m - ROWS_START, k)
        record["table"] = {"config": table, "name": name(table)}
        record["rows"] = {"row_start": ROWS_START, "ms": rows_ms, "bytes": rows_bytes,
                          "tbps": rows_bytes / (rows_ms * 1e-3) / 1e12, "check_written_rows": rows_check}
        if not rows_check["equal"]:
            failures.append(f"{size} MiB: row-range: {rows_check}")
        copy_ms = timed(lambda st: (lambda: st[0].clone()))
        record["copy"] = {"ms": copy_ms, "bytes_moved": 4 * m * k, "tbps": 4 * m * k / (copy_ms * 1e-3) / 1e12}
        print(f"{size:4d} MiB table {name(table)}; rows [64, M) {rows_ms * 1e3:.1f} us "
              f"{record['rows']['tbps']:.2f} TB/s; copy {record['copy']['tbps']:.2f} TB/s", flush=True)
        ok = {n: e for n, e in record["candidates"].items() if "ms" in e and e["check"]["equal"]}
        best = min((n for n in ok if not n.startswith("pairs")), key=lambda n: ok[n]["ms"], default=None)
        record["best"] = best
        results["sizes"][str(size)] = record
        sets = want = None  # free the inputs before the next size
        torch.cuda.empty_cache()
        results["failures"], results["seconds"] = failures, time.time() - started
        (out / "quantize_sweep.json").write_text(json.dumps(results, indent=1))  # kept if a later size is cut short

    results["failures"] = failures
    results["seconds"] = time.time() - started
    (out / "quantize_sweep.json").write_text(json.dumps(results, indent=1))
    (out / "quantize_sweep.md").write_text(markdown(results))
    print(markdown(results))
    return 1 if failures else 0


def markdown(results: dict) -> str:
    lines = [f"Quantizer sweep, {results['date']}, {results['device']} (`{results['command']}`); {results['method']}.", "",
             "| input | before (pairs) | table's choice | best candidate | row-range (table) | copy |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    suggestion = []
    for size, record in results["sizes"].items():
        cands = record["candidates"]
        before = next(e for n, e in cands.items() if n.startswith("pairs"))
        table = cands.get(record["table"]["name"], {})
        best = cands.get(record["best"], {}) if record["best"] else {}

        def cell(entry, label=""):
            return f"{entry['tbps']:.2f} TB/s ({entry['ms'] * 1e3:.1f} us){label}" if "ms" in entry else "n/a"

        lines.append(f"| {size} MiB [{record['m']}, {record['k']}] | {cell(before)} | {cell(table)} "
                     f"| {cell(best, ', ' + str(record['best']))} | {cell(record['rows'])} | {cell(record['copy'])} |")
        if record["best"]:
            suggestion.append((int(size), best["config"]))
    lines += ["", "Suggested `QUANT_CONFIGS` (fastest candidate per measured size; a size class starts halfway "
              "between measured sizes):", "", "```python", "QUANT_CONFIGS = ("]
    ordered = sorted(suggestion, reverse=True)
    for i, (size, config) in enumerate(ordered):
        below = ordered[i + 1][0] if i + 1 < len(ordered) else None
        bound = 0 if below is None else (size + below) // 2
        lines.append(f"    ({bound} << 20, {config!r}),")
    lines += [")", "```", ""]
    if results["failures"]:
        lines += ["Byte mismatches or errors:", ""] + [f"- {f}" for f in results["failures"]]
    else:
        lines.append("Every candidate's bytes equal the reference's (random and special-value inputs).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
