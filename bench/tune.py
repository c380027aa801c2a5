"""Sweep the kernels' tile configurations on the GPU (how the defaults were chosen).

    python bench/tune.py [--out DIR] [--quick]
    python bench/tune.py --fa4 [--out DIR] [--budget-s 400] [--quick] [--seqlens 128,512] [--dims 192x128] [--no-host-times]

``--fa4`` (an SM90 GPU with the ``fa4`` extra): the FA4 SM90 configurations. For each head-dim pair of the issue's
layouts (MLA 192/128 at 16 and 128 heads, MHA 128/128 at 32 heads, GQA 64/8) and each of
``sm90_configs.candidates`` (FA4's default first), at 4x128, 32x512, 8x2048 and 2x8192 tokens (causal, bf16, fresh
randn inputs, three input sets where one fits in L2): the fused kernel's bytes against ``kernels.quantize`` of the
twin's output (every byte, padding included), then GPU time per call by CUDA-graph replay of the fused kernel and of
the twin (median of 5 replays). Once per shape, host time per call without a sync (each call alone, median of 60):
the fused launcher and entry point, the compiled kernel called alone, the scale-padding fill, the twin, FA4's
``flash_attn_varlen_func``. Writes ``DIR/tune_fa4.json`` after every configuration (a timeout keeps what was done)
with a suggested ``sm90_configs.TABLE`` (per head dims and sequence-length class, the configuration with the
smallest geometric-mean fused time relative to FA4's default), printed at the end; exit code 1 if any
configuration's bytes differ. ``--budget-s`` stops starting new configurations (what is left is listed as skipped);
``--seqlens`` keeps the shapes of those tokens per sequence (e.g. ``128,512``: the short classes), ``--dims`` the layouts of one head-dim pair; ``--no-host-times``
skips the host timings (each compiles FA4's ``flash_attn_varlen_func`` too).

Without ``--fa4``, the Triton kernels:

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
import importlib.util
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if importlib.util.find_spec("fusion_pass") is None:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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


# --------------------------------------------------------------------------
# FA4 SM90 configurations (--fa4)
# --------------------------------------------------------------------------

FA4_HEADS = [  # (name, H, Hkv, D, Dv): the layouts
    ("MLA 16h", 16, 16, 192, 128),
    ("MLA 128h", 128, 128, 192, 128),
    ("MHA 32h", 32, 32, 128, 128),
    ("GQA 64/8", 64, 8, 128, 128),
]
FA4_BATCHES = [(4, 128, 20), (32, 512, 10), (8, 2048, 5), (2, 8192, 3)]  # (sequences, tokens each, calls per graph)
L2_BYTES = 60 * 2**20
HOST_CALLS = 60


def graph_ms(fns, calls: int, replays: int = 5) -> float:
    """GPU time per call by CUDA-graph replay (``_timing.graph_replay_ms``): ``calls`` calls cycling over ``fns``
    (one per input set) captured once; the median over ``replays`` replays, per call."""
    from _timing import cycling, graph_replay_ms, median

    for fn in fns:
        fn()
    torch.cuda.synchronize()
    return median(graph_replay_ms(cycling(fns), calls=calls, replays=replays))



def host_us(fn, calls: int = HOST_CALLS) -> float:
    """Host time per call without a sync inside the call: each call timed alone with an empty launch queue (the
    device is synchronized after each, outside the timed region); the median, in microseconds."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6


class Fa4Case:
    """Inputs and output buffers of one shape: ``sets`` input sets (several where one set fits in L2)."""

    def __init__(self, heads, batch: int, seqlen: int, seed: int):
        self.name, h, hkv, d, dv = heads
        self.batch, self.seqlen, self.d, self.dv, self.h = batch, seqlen, d, dv, h
        t = batch * seqlen
        gen = torch.Generator(device="cuda").manual_seed(seed)
        nbytes = t * (h * d + hkv * (d + dv)) * 2
        self.sets = []
        for _ in range(3 if nbytes < L2_BYTES else 1):
            q, k, v = (torch.randn(t, n, e, device="cuda", dtype=torch.bfloat16, generator=gen)
                       for n, e in ((h, d), (hkv, d), (hkv, dv)))
            self.sets.append((q, k, v))
        self.cu = torch.arange(0, t + 1, seqlen, device="cuda", dtype=torch.int32)
        rows = -(-t // 128) * 128
        cols = -(-(h * dv // 16) // 4) * 4
        self.packed = torch.empty(t, h * dv // 2, device="cuda", dtype=torch.uint8)
        self.scales = torch.empty(rows, cols, device="cuda", dtype=torch.uint8)
        self.gs = torch.ones(1, device="cuda")
        self.scale = d ** -0.5
        self.tokens = t

    @property
    def label(self) -> str:
        return f"{self.name} {self.batch}x{self.seqlen}"

    def fused(self, launcher, i: int = 0):
        q, k, v = self.sets[i]
        return lambda: launcher(q, k, v, self.cu, self.seqlen, self.scale, True, self.packed, self.gs, self.scales)

    def twin(self, launcher, i: int = 0):
        q, k, v = self.sets[i]
        return lambda: launcher(q, k, v, self.cu, self.seqlen, self.scale, True)


def bytes_equal(case: Fa4Case, fused, twin) -> bool:
    """The fused kernel's bytes against ``kernels.quantize`` of the twin's output (the global scale from it),
    every packed byte and every scale byte (padding included); the buffers poisoned first."""
    from fusion_pass import kernels

    out = case.twin(twin)()
    gs = (448 * 6 / out.float().abs().amax().clamp_min(1e-6)).reshape(1)
    case.gs.copy_(gs)
    case.packed.fill_(0xA5)
    case.scales.fill_(0x5A)
    case.fused(fused)()
    want_packed, want_scales = kernels.quantize(out.reshape(case.tokens, -1), case.gs)
    equal = torch.equal(case.packed, want_packed.view(torch.uint8)) and \
        torch.equal(case.scales.view(-1), want_scales.view(torch.uint8).reshape(-1))
    case.gs.fill_(1.0)
    return bool(equal)


def fa4_host_times(case: Fa4Case) -> dict:
    """Host time per call (us) of the table's fused launcher and twin, the public entry points, the compiled
    fused kernel called alone (the TVM-FFI floor), the scale-padding fill, and FA4's ``flash_attn_varlen_func``."""
    from flash_attn.cute import interface

    from fusion_pass.kernels.fa4 import forward, launch, sm90

    q, k, v = case.sets[0]
    cu, s, scale = case.cu, case.seqlen, case.scale
    cfg = sm90.kernel_config(case.d, case.dv, True, s)
    kernel = sm90.compile_nvfp4_kernel(q, k, v, q[..., :case.dv] if case.d != case.dv else q, case.packed, case.gs,
                                       case.scales.view(-1), cu, cu, cfg, True)
    o = q[..., :case.dv] if case.d != case.dv else q
    padding = launch.ScalePadding()
    sf = case.scales.view(-1)
    return {
        "fused launcher": host_us(case.fused(sm90.FUSED)),
        "fused entry point": host_us(lambda: forward.fa4_attention_nvfp4_varlen(
            q, k, v, cu_seqlens=cu, max_seqlen=s, softmax_scale=scale, causal=True, output=case.packed,
            output_scale=case.gs, output_block_scale=case.scales)),
        "compiled fused kernel alone": host_us(lambda: kernel(q, k, v, o, case.packed, sf, case.gs, scale, cu, cu)),
        "scale padding fill": host_us(lambda: padding(sf, case.tokens - 1, case.h * case.dv)),
        "twin launcher": host_us(case.twin(sm90.TWIN)),
        "twin entry point": host_us(lambda: forward.fa4_attention_varlen(q, k, v, cu, s, causal=True,
                                                                         softmax_scale=scale)),
        "FA4 flash_attn_varlen_func": host_us(lambda: interface.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s, softmax_scale=scale,
            causal=True, num_splits=1, pack_gqa=False)),
    }


def suggest_table(rows: list[dict]) -> dict:
    """Per (D, Dv, seqlen class): the configuration with the smallest geometric mean of fused time over FA4's
    default across the shapes of that class (byte-equal everywhere it ran; every shape of the class timed)."""
    from fusion_pass.kernels.fa4 import sm90_configs

    groups: dict = {}
    for r in rows:
        if r.get("fused_ms") and r.get("bytes_equal"):
            key = (r["d"], r["dv"], sm90_configs.seqlen_class(r["seqlen"]))
            groups.setdefault(key, {}).setdefault(tuple(r["config"]), {})[r["shape"]] = r["fused_ms"]
    table = {}
    for (d, dv, cls), by_cfg in groups.items():
        default = tuple(sm90_configs.fa4_default(d, dv, True))
        base = by_cfg.get(default)
        if not base:
            continue
        scored = []
        for cfg, times in by_cfg.items():
            if set(times) == set(base):
                scored.append((math.exp(statistics.fmean(math.log(times[s] / base[s]) for s in base)), cfg))
        ratio, best = min(scored)
        table[f"({d}, {dv}, True, {cls})"] = {"config": list(best), "fused_vs_default": round(ratio, 4),
                                              "class": sm90_configs.SEQLEN_CLASSES[cls], "shapes": sorted(base)}
    return table


def tune_fa4(out_dir: str, budget_s: float, quick: bool = False, seqlens: tuple[int, ...] | None = None,
             host_times: bool = True, dims: tuple[int, int] | None = None) -> int:
    """Time the fused kernel and its twin for every sweep candidate at the issue's shapes; JSON to
    ``out_dir/tune_fa4.json`` after each configuration (a timeout keeps what was done) and the suggested table."""
    from fusion_pass.kernels.fa4 import forward, sm90, sm90_configs

    if forward.fa4_generation("cuda") != "sm90":
        print("bench/tune.py --fa4 needs an SM90 GPU with flash-attn-4 installed", file=sys.stderr)
        return 2
    started = time.monotonic()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tune_fa4.json")
    results: dict = {"device": torch.cuda.get_device_name(), "rows": [], "host_us": {}, "skipped": [],
                     "errors": [], "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:])}
    batches = [b for b in FA4_BATCHES if (not quick or b[1] == 512) and (seqlens is None or b[1] in seqlens)]
    if not batches:
        print(f"bench/tune.py --fa4: no shape left (--seqlens {seqlens} among {[b[1] for b in FA4_BATCHES]})",
              file=sys.stderr)
        return 2

    def save():
        results["elapsed_s"] = round(time.monotonic() - started, 1)
        results["suggested_table"] = suggest_table(results["rows"])
        with open(path, "w") as f:
            json.dump(results, f, indent=1)

    only = dims
    for dims in sorted({(h[3], h[4]) for h in FA4_HEADS if only is None or (h[3], h[4]) == only}, reverse=True):
        cases = [Fa4Case(h, b, s, seed=i) for i, (h, (b, s, _)) in enumerate(
            (h, b) for h in FA4_HEADS if (h[3], h[4]) == dims for b in batches)]
        calls = {(b, s): c for b, s, c in batches}
        for case in cases if host_times else ():
            results["host_us"][case.label] = fa4_host_times(case)
            print(f"host us {case.label}: " + ", ".join(f"{k} {v:.1f}" for k, v in results["host_us"][case.label].items()),
                  flush=True)
        save()
        for cfg in sm90_configs.candidates(*dims):
            if time.monotonic() - started > budget_s:
                results["skipped"].append({"dims": dims, "config": list(cfg)})
                continue
            fused, twin = sm90.launchers(cfg)
            t0 = time.monotonic()
            for case in cases:
                row = {"shape": case.label, "d": case.d, "dv": case.dv, "seqlen": case.seqlen, "config": list(cfg)}
                try:
                    row["bytes_equal"] = bytes_equal(case, fused, twin)
                    n = calls[(case.batch, case.seqlen)]
                    row["fused_ms"] = graph_ms([case.fused(fused, i) for i in range(len(case.sets))], n)
                    row["twin_ms"] = graph_ms([case.twin(twin, i) for i in range(len(case.sets))], n)
                    row["fused_vs_twin"] = row["fused_ms"] / row["twin_ms"]
                except Exception as exc:  # a configuration that does not build or run here: recorded, not fatal
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    results["errors"].append(row)
                    if "CUDA" in str(exc) and "error" in str(exc).lower():
                        save()
                        raise
                results["rows"].append(row)
                print(f"{case.label} {cfg.describe()}: " + (row.get("error") or
                      f"fused {row['fused_ms']:.4f} ms, twin {row['twin_ms']:.4f} ms, bytes equal {row['bytes_equal']}"),
                      flush=True)
            print(f"config {tuple(cfg)} done in {time.monotonic() - t0:.1f} s", flush=True)
            save()
        del cases
        torch.cuda.empty_cache()
    save()
    table = results["suggested_table"]
    print("\nsuggested sm90_configs.TABLE (geometric-mean fused time vs FA4's default per class):")
    for key, entry in sorted(table.items()):
        if entry["config"] != list(sm90_configs.fa4_default(*map(int, key.strip("()").split(", ")[:2]), True)):
            print(f"    {key}: Sm90Config(*{tuple(entry['config'])}),  # {entry['fused_vs_default']:.3f}x, {entry['shapes']}")
        else:
            print(f"    # {key}: FA4's default is best")
    bad = [r for r in results["rows"] if r.get("bytes_equal") is False]
    print(f"\n{len(results['rows'])} rows, {len(bad)} not byte-equal, {len(results['errors'])} errors, "
          f"{len(results['skipped'])} configurations skipped (budget); {path}")
    return 1 if bad else 0


def _seqlens(text: str) -> tuple[int, ...]:
    known = {b[1] for b in FA4_BATCHES}
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints of {sorted(known)}, got {text!r}") from None
    bad = [v for v in values if v not in known]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad} not among the sweep's tokens per sequence {sorted(known)}")
    return values


def _dims(text: str) -> tuple[int, int]:
    known = sorted({(h[3], h[4]) for h in FA4_HEADS})
    try:
        d, dv = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected DxDv (e.g. 192x128), got {text!r}") from None
    if (d, dv) not in known:
        raise argparse.ArgumentTypeError(f"{d}x{dv} is not a swept head-dim pair; known: "
                                         + ", ".join(f"{a}x{b}" for a, b in known))
    return d, dv


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".", help="directory for tune.json / tune_fa4.json (default: .)")
    parser.add_argument("--quick", action="store_true", help="only the 32x512 shapes")
    parser.add_argument("--skip-quant", action="store_true", help="attention only")
    parser.add_argument("--long", action="store_true", help="only the 2x8192 shapes")
    parser.add_argument("--fa4", action="store_true", help="the FA4 SM90 configurations instead of the Triton kernels")
    parser.add_argument("--budget-s", type=float, default=400.0,
                        help="--fa4: stop starting new configurations after this many seconds (default 400)")
    parser.add_argument("--seqlens", type=_seqlens, default=None,
                        help=f"--fa4: only the shapes of these tokens per sequence, comma-separated "
                             f"(of {','.join(str(b[1]) for b in FA4_BATCHES)}; default all)")
    parser.add_argument("--dims", type=_dims, default=None,
                        help="--fa4: only the layouts of this head-dim pair DxDv (of "
                             + ", ".join(sorted({f"{h[3]}x{h[4]}" for h in FA4_HEADS})) + "; default all)")
    parser.add_argument("--no-host-times", action="store_true",
                        help="--fa4: skip the host time per call (each shape compiles flash_attn_varlen_func too)")
    args = parser.parse_args(argv)
    fa4_only = [f"--{n.replace('_', '-')}" for n in ("seqlens", "dims", "no_host_times") if getattr(args, n)]
    if fa4_only and not args.fa4:
        parser.error(f"{', '.join(fa4_only)}: options of the FA4 sweep, which needs --fa4")
    if args.fa4 and (args.long or args.skip_quant):
        parser.error("--long and --skip-quant are options of the Triton sweep; with --fa4 use --seqlens 8192")
    if args.fa4 and args.quick and args.seqlens is not None and 512 not in args.seqlens:
        parser.error(f"--quick keeps the 512-token shapes only, and --seqlens {','.join(map(str, args.seqlens))} "
                     f"leaves none of them: drop one of the two")
    if not math.isfinite(args.budget_s) or args.budget_s <= 0:
        parser.error(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    if not torch.cuda.is_available():
        print("bench/tune.py needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    if args.fa4:
        return tune_fa4(args.out, args.budget_s, quick=args.quick, seqlens=args.seqlens,
                        host_times=not args.no_host_times, dims=args.dims)
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
