"""Serving trace: how many prefill tokens run on the fused attention -> NVFP4 path, and what fusion saves per step.

A scripted continuous-batching schedule shaped like vLLM V1's scheduler (bench/_schedule.py) is run
step by step through a demo model ("mla" or "gqa") compiled with the fusion pass, and the fraction of
prefill tokens written by the fused kernel is reported under two guards:

  pure_prefill_gate  the old gate, computed from the schedule: a step's prefill tokens count as fused
                     only when the step has no decode token and no prefill with cached context;
  this               the project's guard, measured: the per-token counters of
                     fusion_pass.runtime.counters.counters()["tokens"] summed over the steps,
                     prefill_fused / prefill.

With --device cuda every busy step is also timed at the kernel level (bench/_serving_steps.py): per
layer, the step's attention and its NVFP4 output with every row through the same FA4 kernels on all
sides, keys of context + new tokens from a preallocated per-request KV cache appended in place (one slab
per layer, also seen as pages of --page-size rows: every request's region is whole pages, and its
page-table row lists its region's pages in order); seven variants. Four take the step's keys packed
(gathered from the slab outside the timed region, through cu_seqlens_k):

  unfused        FA4 bf16 over every row (decode and prefill rows in one call), then the quantizer;
  unfused_split  the rows split as the runtime splits an MLA layer's call (a standard layer's too where the
                 one paged launch is refused): decode rows by FA4 bf16 on the decode
                 sub-batch and the row-range quantizer (the same calls as fused), prefill rows by FA4
                 bf16 on the prefill sub-batch and the row-range quantizer (two quantizer calls, not a
                 copy of both parts into one buffer and one call: see bench/_serving_steps.py);
  fused          the runtime's split way: decode rows as in unfused_split, prefill rows by the fused kernel
                 (FA4 with the NVFP4 epilogue);
  fused_all      every row by the fused kernel in one call.

Three read the slab in place through the page table (seqused_k, page_table: FA4's paged forward):

  unfused_paged  FA4 bf16 paged over every row in one call, then the quantizer: what vLLM's
                 FLASH_ATTN backend launches (one varlen launch on the paged cache), plus the quant;
  fused_paged    every row by the fused paged kernel in one call;
  pass_on        what the pass does with the default policy (fusion_pass.runtime.policy.verdict on
                 this device): a step without decode rows is a "prefill" call, fused as fused_all
                 does it; a step with decode and prefill rows a "mixed_one_call" call: fused_paged's
                 call if the policy fuses that class, else unfused_paged's; a decode-only step is
                 never fused by the pass (unfused_paged's calls).

Per step: CUDA events around the layers' calls (eager, as vLLM runs its attention op between CUDA-graph
pieces), median of --repeats after --warmup, fresh random queries before every call; or with --clock
graph the layers' calls of each variant captured in one CUDA graph and replayed (GPU time alone: no host
cost, no launch gaps; a variant that cannot be captured is timed eagerly and reported). Bytes are compared
by pairs that make the same attention calls: fused_all == unfused (one call over every row),
fused == unfused_split (the same sub-batch calls) and fused_paged == unfused_paged (the same one paged
call), required at every step; fused == unfused and unfused_paged == unfused are recorded but not
required (a row's bytes may depend on the sub-batch computing it, through the tile configuration its
longest sequence picks, and on the kernel reading packed or paged keys). Reported, per-step ratio
distributions (min, p10, median, p90, max, overall = total / total):

  unfused (one call) / fused (runtime)                 the runtime against the fewest-launch unfused path;
  unfused (one call) / fused_all (one call)            fusing every row, one call on each side;
  unfused (split like the runtime) / fused (runtime)   what fusing the prefill rows saves, the rest equal;
  unfused (one paged call) / fused_paged               fusing every row, one paged call on each side;
  unfused (one paged call) / pass_on                   the pass with its default policy against what vLLM's
                                                       FLASH_ATTN + quant launch (the target: no step below
                                                       0.99x, overall >= 1.00x);

each beside the ceiling on paper: per layer fusion removes one memory-bound pass over the attention
output rows it fuses (4 * R * H * Dv bytes: the bf16 output written and read back, at the H200's
~4.8 TB/s; R = every row against unfused and unfused_paged, the prefill rows against unfused_split,
for pass_on every row of the steps it fuses) and one launch (--launch-us, an assumption), and the
share of that saving taken; and pass_on's policy verdicts and its fused share of rows (rows written
fused / all rows). On the CPU the model runs for the
counters; --cpu-timing runs the timed steps on the reference kernels (wall time, meaningless as
performance; the bytes are checked).

--format fp8_static (issue 28; bench/_serving_steps_fp8.py) times the steps with a static per-tensor FP8 output
instead: float8_e4m3fn [T, H*Dv] under one float32 scale, in the arithmetic of vLLM QuantFP8's native form (what
vLLM builds by default, custom_ops="none": x.float() * inv_scale, clamp +-448, to float8_e4m3fn, a NaN kept). The
fused kernel is FA4's SM90 static FP8 epilogue (fa4_attention_fp8_static_varlen, nan_to_max=False); the unfused
quant is the native form (bench/_attention_formats.native_static, the function bench/attention.py compiles) compiled
by torch.compile with the token dimension dynamic, as vLLM compiles it, before the first step. The variants:
unfused, unfused_split, fused, fused_all and unfused_paged as above with that kernel and quant; fused_paged absent
(no FP8 paged launch exists: reported absent, not as zero); pass_on what the pass does with a static FP8 call: a
step without decode rows fused as fused_all; a step with decode rows has no one fused call, so it is split
(fused's calls) where the pass splits (an MLA layer; a standard layer under FUSION_PASS_VLLM_SPLIT_MIXED=on) and
the policy fuses that split class (mixed_split_free / mixed_split), else unfused_paged's calls: on SM90 always
(the default FUSION_PASS_VLLM_SPLIT_MIXED=off leaves a standard layer's mixed call unfused, and the policy fuses
neither split class there); and varlen_bf16 (FA4 bf16 over every row alone, no quant: the fused call's floor).
Bytes: fused_all == unfused and fused == unfused_split required (FA4's FP8 kernel writes quantize_static of its
own bf16 output, which the native form computes too); ratios as for NVFP4, the paged one absent, plus FA4 bf16
alone / fused_all; pass_on's target: overall >= 1.02x of one unfused paged call, no step below 0.99x. --format
changes the timed steps only: the demo models' o_proj is NVFP4 and fusion_pass/demo has no FP8 layer, so the
model run (the token counts of the guard) is the NVFP4 pass's whatever --format says.

    python bench/serving_trace.py --tiny --json trace.json            # a CPU run (under a minute)
    python bench/serving_trace.py --tiny --timing-only --cpu-timing --steps 6        # the timed steps' logic
    python bench/serving_trace.py --device cuda --timing-only --budget 2048 --json t2048.json --markdown t2048.md
    python bench/serving_trace.py --tiny --timing-only --cpu-timing --steps 6 --format fp8_static  # FP8's logic

Exit code 2 when the installed fusion_pass has no per-token counters, --device cuda has no CUDA
device, or FA4 does not run the model's attention there (with fp8_static: or its SM90 static FP8 epilogue
does not); 1 when the bytes of a required pair (fused_all == unfused, fused == unfused_split,
fused_paged == unfused_paged) differ at a step.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import warnings
from collections import Counter
from dataclasses import dataclass
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

from fusion_pass import runtime  # noqa: E402
from fusion_pass.compile.graph_pass import FusionPass  # noqa: E402
from fusion_pass.demo import workload as demo  # noqa: E402
from fusion_pass.demo.models import release_layers  # noqa: E402
from fusion_pass.demo.models.common import MAX_POSITION  # noqa: E402
from fusion_pass.runtime import BatchSpec, RequestSpec, counters, policy, settings  # noqa: E402

import _serving_steps as steps_mod  # noqa: E402
import _serving_steps_fp8 as fp8_steps  # noqa: E402
from _kernels import fa4_kernels, fa4_status, reference_kernels  # noqa: E402
from _serving_steps_fp8 import fa4_fp8_static_kernels, fp8_static_status, reference_fp8_static_kernels  # noqa: E402
from _schedule import (FULL, TINY, Lengths, Step, TraceConfig, generate_schedule,  # noqa: E402
                       pure_prefill_gate_fraction, schedule_stats)

# --------------------------------------------------------------------------
# Running the schedule through the model
# --------------------------------------------------------------------------

NO_TOKEN_COUNTERS = (
    "the installed fusion_pass has no per-token counters: fusion_pass.runtime.counters.counters() has no 'tokens' key "
    "(expected {'prefill': int, 'prefill_fused': int, 'post_quantized': {reason: int}}), so the guard's fused "
    "fraction cannot be measured. --schedule-only reports the schedule and the pure-prefill gate without it."
)


class MissingTokenCounters(RuntimeError):
    """``fusion_pass.runtime.counters.counters()`` has no ``"tokens"`` entry."""


def token_counters() -> dict:
    """``counters.counters()["tokens"]``: ``{"prefill", "prefill_fused", "post_quantized": {reason: n}}``."""
    tokens = counters.counters().get("tokens")
    if tokens is None:
        raise MissingTokenCounters(NO_TOKEN_COUNTERS)
    return tokens


def token_delta(before: dict, after: dict) -> dict:
    """``after - before`` of two :func:`token_counters` snapshots (zero reasons left out)."""
    post = {k: v - before["post_quantized"].get(k, 0) for k, v in after["post_quantized"].items()}
    return {"prefill": after["prefill"] - before["prefill"],
            "prefill_fused": after["prefill_fused"] - before["prefill_fused"],
            "post_quantized": {k: v for k, v in post.items() if v}}


def sum_deltas(deltas) -> dict:
    """The sum of :func:`token_delta` results (None entries, idle steps, skipped)."""
    total = {"prefill": 0, "prefill_fused": 0, "post_quantized": Counter()}
    for d in filter(None, deltas):
        total["prefill"] += d["prefill"]
        total["prefill_fused"] += d["prefill_fused"]
        total["post_quantized"].update(d["post_quantized"])
    return {**total, "post_quantized": dict(total["post_quantized"])}


def drop_requests(request_ids) -> None:
    """Remove these requests from every layer's KV cache.

    The runtime has no per-request eviction, so this goes through
    :func:`runtime.snapshot_kv_caches` / :func:`runtime.restore_kv_caches`,
    whose per-layer entries are keyed by request id.
    """
    gone = set(request_ids)
    if gone:
        snapshot = runtime.snapshot_kv_caches()
        runtime.restore_kv_caches({layer: {rid: e for rid, e in entries.items() if rid not in gone}
                                   for layer, entries in snapshot.items()})


@torch.no_grad()
def fill_prefix_hits(model, step: Step, hidden_size: int, device: str) -> None:
    """Put the cached prefixes of this step's prefix hits into the KV caches (eager model: not counted)."""
    hits = sorted((a for a in step.admitted if a.cached), key=lambda a: a.cached != 1)  # one-token ones first
    if hits:
        spec = BatchSpec(tuple(RequestSpec(a.request_id, a.cached) for a in hits))
        with runtime.batch(spec):
            model(*demo.dynamic_inputs(spec, hidden_size, device, seed=-1 - step.index))


@dataclass
class TraceRun:
    """What :func:`run_trace` measured: per-step token counter deltas, totals, the pass report."""

    layers: int
    per_step: list  # per step: token_delta(...), or None for an idle step
    totals: dict  # sum_deltas(per_step): the counted calls only (not the prefix fills)
    report: dict


def run_trace(steps: list[Step], *, model_name: str, tiny: bool, device: str, layers: int) -> TraceRun:
    """Run the steps in order through ``model_name`` compiled with the pass, counting tokens per step.

    Before each step the prefix hits' cached prefixes are filled (eagerly); then the step runs once
    through the model with the pass, and only that call is counted. Finished requests are dropped from
    the KV caches after their last step.
    """
    token_counters()  # fails early, before any compile, without the counters
    model = demo.build_model(model_name, tiny=tiny, device=device, layers=layers)
    try:
        hidden_size = model.norms[0].normalized_shape[0]
        fusion = FusionPass()
        # No FX graph cache: a cache hit would reuse a graph without running the pass (no report).
        fused = torch.compile(model, options={"post_grad_custom_post_pass": fusion, "fx_graph_cache": False})
        run = TraceRun(len(model.layers), [], {}, {})
        runtime.clear_kv_caches()
        for step in steps:
            spec = step.batch_spec()
            if spec is None:
                run.per_step.append(None)
                continue
            fill_prefix_hits(model, step, hidden_size, device)
            before = token_counters()
            with torch.no_grad(), runtime.batch(spec):
                fused(*demo.dynamic_inputs(spec, hidden_size, device, seed=step.index))
            run.per_step.append(token_delta(before, token_counters()))
            drop_requests(step.finished)
        run.totals = sum_deltas(run.per_step)
        run.report = fusion.report()
        return run
    finally:
        runtime.clear_kv_caches()
        release_layers(model)


# --------------------------------------------------------------------------
# Timing: every row through the same kernels (bench/_serving_steps.py)
# --------------------------------------------------------------------------


RATIOS = (  # (key in the "timing" entry, baseline, fused variant, label): per-step ratios baseline / variant
    ("fused", "unfused", "fused", "unfused (one call) / fused (runtime)"),
    ("fused_all", "unfused", "fused_all", "unfused (one call) / fused_all (one call)"),
    ("split", "unfused_split", "fused", "unfused (split like the runtime) / fused (runtime)"),
    ("paged", "unfused_paged", "fused_paged", "unfused (one paged call) / fused_paged"),
    ("pass_on", "unfused_paged", "pass_on", "unfused (one paged call) / pass_on"),
    ("paged_alone", "paged_bf16", "fused_paged", "FA4 bf16 paged alone (no quant) / fused_paged"),
)
RATIOS_FP8 = RATIOS[:5] + (  # fp8_static: no fused_paged variant (its ratio reported absent); the fused call's floor
    ("alone", "varlen_bf16", "fused_all", "FA4 bf16 alone (one call, no quant) / fused_all"),
)
FORMATS = ("nvfp4", "fp8_static")
"""``--format``: the output the timed steps write (the demo model's run, for the token counts, is NVFP4's)."""
SPEEDUP_KEYS = {"fused": "speedup", "fused_all": "speedup_all", "split": "speedup_split", "paged": "speedup_paged",
                "pass_on": "speedup_pass_on", "paged_alone": "speedup_paged_alone",
                "alone": "speedup_alone"}  # per-step entry of each ratio
PAIR_WHAT = {"fused_all==unfused": "the same one call", "fused==unfused_split": "the same sub-batch calls",
             "fused_paged==unfused_paged": "the same one paged call",
             "fused==unfused": "other calls: informational",
             "unfused_paged==unfused": "paged vs packed keys, other calls: informational"}
PASS_ON_TARGET = {"min_step_ratio": 0.99, "min_overall": 1.0}
"""``pass_on``'s target against ``unfused_paged``: no step below 0.99x, overall at least 1.00x."""
PASS_ON_TARGETS = {"nvfp4": PASS_ON_TARGET, "fp8_static": {"min_step_ratio": 0.99, "min_overall": 1.02}}
"""Per format (issue 28 for FP8: overall >= 1.02x of one unfused (paged) call, no step below 0.99x)."""
FORMAT_SCOPE = ("the timed steps only: the demo models' o_proj is NVFP4 (fusion_pass/demo has no FP8 layer), so "
                "the model run and its token counts are the NVFP4 pass's whatever --format says")


def ratios_for(fmt: str) -> tuple:
    """The ratios reported for an output format (:data:`RATIOS` for NVFP4, :data:`RATIOS_FP8` for FP8)."""
    return RATIOS if fmt == "nvfp4" else RATIOS_FP8


def _runner(fmt: str, cuda: bool, dims, layers: int, slab_rows: int, device: str, *, seed: int, page_size: int,
            model: str):
    """The format's kernels and :class:`StepRunner` (FP8: its quant compiled before the first step)."""
    if fmt == "nvfp4":
        kernels = fa4_kernels() if cuda else reference_kernels()
        return steps_mod.StepRunner(kernels, dims, layers, slab_rows, device, seed=seed, page_size=page_size)
    kernels = fa4_fp8_static_kernels(device) if cuda else reference_fp8_static_kernels()
    return fp8_steps.Fp8StepRunner(kernels, dims, layers, slab_rows, device, seed=seed, page_size=page_size,
                                   split_free=model == "mla")


def time_trace(steps: list[Step], *, model: str, tiny: bool, device: str, layers: int, warmup: int, repeats: int,
               launch_us: float, seed: int, progress: bool = True, clock: str = "eager",
               page_size: int = steps_mod.DEFAULT_PAGE_SIZE, fmt: str = "nvfp4") -> dict:
    """Time every busy step (see the module docstring) writing output format ``fmt`` (:data:`FORMATS`); the
    ``timing`` entry of the JSON."""
    if fmt not in FORMATS:
        raise ValueError(f"time_trace: fmt must be one of {FORMATS}, got {fmt!r}")
    dims = steps_mod.attn_dims(model, tiny)
    cuda = device == "cuda"
    regions, slab_rows = steps_mod.plan_regions(steps, align=page_size)
    runner = _runner(fmt, cuda, dims, layers, max(slab_rows, 1), device, seed=seed, page_size=page_size, model=model)
    kernels = runner.kernels
    ratios_spec = ratios_for(fmt)
    variants = runner.VARIANTS
    per_step, verdicts = [], {}
    busy = [s for s in steps if s.chunks]
    graphs = [_dynamo_graphs()]
    if fmt != "nvfp4":
        runner.warm_quant(max((s.tokens for s in busy), default=1))
    graphs.append(_dynamo_graphs())
    for n, step in enumerate(busy, 1):
        spec = step.batch_spec()
        layout = steps_mod.step_layout(spec, regions)
        measured = runner.run_step(layout, warmup=warmup, repeats=repeats, clock=clock)
        ms, choice = measured["ms"], measured["pass_on"]
        every_row = steps_mod.ceiling_ms(layout.tokens, dims, layers, launch_us=launch_us)
        fused_rows, pass_on_saving = _pass_on_saving(choice, layout, dims, layers, launch_us)
        entry = {"step": step.index, "kind": step.kind, "tokens": layout.tokens, "decode_rows": layout.decodes,
                 "prefill_rows": layout.prefill_tokens, "keys": layout.cu_k[-1],
                 "pages": sum(-(-k // page_size) for k in layout.seqused_k),
                 **{f"{name}_ms": ms[name] for name in variants},
                 "pass_on": {k: choice[k] for k in ("plan", "fused", "variant")},
                 "pass_on_fused_rows": fused_rows,
                 "ceiling_saving_ms": every_row,
                 "ceiling_saving_split_ms": steps_mod.split_ceiling_ms(layout, dims, layers, launch_us=launch_us),
                 "ceiling_saving_pass_on_ms": pass_on_saving,
                 "no_saving_ms": 0.0,  # paged_alone / alone: the fused call against a baseline that writes no quant
                 "bytes_equal": measured["bytes_equal"], "eager_instead": measured["eager_instead"]}
        for key, base, variant, _ in ratios_spec:
            if base in variants and variant in variants:
                entry[SPEEDUP_KEYS[key]] = ms[base] / ms[variant]
        per_step.append(entry)
        verdicts.setdefault(choice["plan"], {"fused": choice["fused"], "variant": choice["variant"],
                                             "why": choice["why"]})
        if progress and (n % 25 == 0 or n == len(busy)):
            print(f"  timed {n}/{len(busy)} busy steps", flush=True)
    savings = {"fused": "ceiling_saving_ms", "fused_all": "ceiling_saving_ms", "split": "ceiling_saving_split_ms",
               "paged": "ceiling_saving_ms", "pass_on": "ceiling_saving_pass_on_ms", "paged_alone": "no_saving_ms",
               "alone": "no_saving_ms"}
    ratios = {}
    for key, base, variant, label in ratios_spec:
        missing = [runner.ABSENT[v] for v in (base, variant) if v in runner.ABSENT]
        if missing:  # no kernel for this variant in this format: absent, not zero
            ratios[key] = {"label": label, "baseline": base, "variant": variant, "absent": missing[0]}
            continue
        stats = steps_mod.ratio_summary([t[f"{base}_ms"] for t in per_step], [t[f"{variant}_ms"] for t in per_step],
                                        [t[savings[key]] for t in per_step])
        ratios[key] = {"label": label, "baseline": base, "variant": variant, **stats}

    def bytes_only_overall(base: str, rows: str) -> float | None:
        total, saved = (sum(t[f"{base}_ms"] for t in per_step),
                        sum(steps_mod.ceiling_ms(t[rows], dims, layers) for t in per_step))
        return total / (total - saved) if total > saved else None

    checked = [steps_mod.pair_key(p) for p in runner.CHECKED_PAIRS]
    bytes_pairs = {key: {"checked": key in checked, "what": PAIR_WHAT.get(key, ""),
                         "differ_at": [t["step"] for t in per_step if not t["bytes_equal"][key]]}
                   for key in (steps_mod.pair_key(p) for p in runner.CHECKED_PAIRS + runner.INFO_PAIRS)}
    what = (_what_fp8(cuda, page_size, runner) if fmt != "nvfp4" else
            "per busy step, all layers' attention + NVFP4 output, every row through the same "
            + ("FA4 kernels " if cuda else "kernels (here the reference's) ") +
            "(unfused: FA4 bf16 over every row in one call + the quantizer; unfused_split: decode rows FA4 "
            "bf16 + row-range quantizer, prefill rows FA4 bf16 + row-range quantizer, split as the runtime "
            "splits them; fused: decode rows as in unfused_split, prefill rows the fused kernel, as the "
            "runtime does; fused_all: every row fused in one call; unfused_paged: FA4 bf16 paged over every "
            "row in one call + the quantizer, as vLLM's FLASH_ATTN; fused_paged: every row fused in one paged "
            "call; pass_on: what the pass does under the default policy, per step: fused_all's call without "
            "decode rows, fused_paged's or unfused_paged's with them as the policy says for mixed_one_call, "
            "unfused_paged's on decode-only steps); keys context + new from a preallocated per-request KV "
            f"slab appended in place, read in place through a page table (pages of {page_size} rows) by the "
            "paged variants, gathered into a packed workspace outside the timed region (cu_seqlens_k) for "
            "the others; ")
    return {
        "skipped": None,
        "format": fmt,
        "device": torch.cuda.get_device_name() if cuda else "CPU",
        "kernels": kernels.name,
        "what": what + (CLOCK_WHAT[clock] if cuda else "CPU wall time on the reference kernels (meaningless as "
                                                       "performance)"),
        "variants": list(variants),
        "absent": dict(runner.ABSENT),
        "quant_graphs": None if fmt == "nvfp4" else {"before_the_steps": graphs[1] - graphs[0],
                                                     "during_the_steps": _dynamo_graphs() - graphs[1]},
        "clock": clock if cuda else "cpu",
        "eager_instead": [{"step": t["step"], "variant": v, "why": why}
                          for t in per_step for v, why in t["eager_instead"].items()],
        "dims": {"heads": dims.heads, "kv_heads": dims.kv_heads, "dqk": dims.dqk, "dv": dims.dv},
        "warmup": warmup, "repeats": repeats, "kv_slab_rows": runner.num_pages * page_size,
        "page_size": page_size, "kv_pages": runner.num_pages,
        "ceiling_note": (f"per layer and step, fusing R rows removes their bf16 output's write and read back, "
                         f"4 * R * H * Dv bytes, at the H200's ~{steps_mod.H200_TBPS} TB/s, plus one launch of "
                         f"{launch_us:g} us (an assumption, --launch-us); R = every row (T) against unfused, the "
                         f"prefill rows (P; nothing without them) against unfused_split, T against unfused_paged "
                         f"(for pass_on: T on the steps it fuses in one call, P's bytes less one launch on the steps "
                         f"it splits, nothing on the others); computed on paper, not measured"),
        "launch_us": launch_us,
        **ratios,
        "ceiling_bytes_only_overall": bytes_only_overall("unfused", "tokens"),
        "ceiling_bytes_only_overall_split": bytes_only_overall("unfused_split", "prefill_rows"),
        "ceiling_bytes_only_overall_paged": bytes_only_overall("unfused_paged", "tokens"),
        "pass_on_policy": pass_on_policy(per_step, ratios["pass_on"], verdicts, device,
                                         target=PASS_ON_TARGETS[fmt]),
        **{f"total_{name}_ms": sum(t[f"{name}_ms"] for t in per_step) for name in variants},
        **{f"total_{name}_ms": None for name in runner.ABSENT},
        "noise_floor": noise_floor(per_step),
        "bytes": bytes_pairs,
        "mismatched_steps": sorted({s for key in checked for s in bytes_pairs[key]["differ_at"]}),
        "per_step": per_step,
    }


def _dynamo_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (the FP8 quant's compiles are the difference)."""
    from torch._dynamo.utils import counters as dynamo_counters

    return int(dynamo_counters["stats"]["unique_graphs"])


def _pass_on_saving(choice: dict, layout, dims, layers: int, launch_us: float) -> tuple[int, float]:
    """``(rows pass_on writes fused, its ceiling saving against unfused_paged in ms)``: every row of a step it fuses
    in one call (``fused_all``, ``fused_paged``); the prefill rows of a split step (``fused``: their bf16 pass
    saved, one launch added: decode attention + decode quant + the fused call against one call + one quant); 0 on
    the steps it does not fuse."""
    variant = choice["variant"]
    if variant in ("fused_all", "fused_paged"):
        return layout.tokens, steps_mod.ceiling_ms(layout.tokens, dims, layers, launch_us=launch_us)
    if variant == "fused":
        return layout.prefill_tokens, steps_mod.ceiling_ms(layout.prefill_tokens, dims, layers, launch_us=-launch_us)
    return 0, 0.0


def _what_fp8(cuda: bool, page_size: int, runner) -> str:
    """The FP8 timing's method, in words (the ``what`` entry, before the clock's)."""
    kernels = "FA4 kernels " if cuda else "kernels (here the reference's) "
    epilogue = ("FA4's SM90 static FP8 epilogue (fa4_attention_fp8_static_varlen, nan_to_max=False)" if cuda else
                "the reference stand-in of FA4's SM90 static FP8 epilogue (quantize_static of the bf16-rounded "
                "attention, NaN kept)")
    quant = ("vLLM QuantFP8's native form (custom_ops='none', what vLLM builds by default: x.float() * inv_scale, "
             "clamp +-448, to float8_e4m3fn, a NaN kept) compiled by torch.compile(fullgraph=True) with the token "
             "dimension dynamic, as vLLM compiles it, before the first step; a new output tensor per call"
             if cuda and fp8_steps.COMPILE_QUANT else "the native form, eager")
    return (f"per busy step, all layers' attention + static per-tensor FP8 output (float8_e4m3fn [T, H*Dv], one "
            f"float32 scale amax / 448 with amax {fp8_steps.AMAX:g}, multiplied by its IEEE inverse; NaN kept, the "
            f"native form's rule), every row through the same {kernels}(unfused: FA4 bf16 over every row in one call "
            f"+ the quant; unfused_split: decode rows FA4 bf16 + the quant of those rows, prefill rows FA4 bf16 + the "
            f"quant of those rows, split as the runtime splits them; fused: decode rows as in unfused_split, prefill "
            f"rows {epilogue}, as the runtime does; fused_all: every row by that kernel in one call; unfused_paged: "
            f"FA4 bf16 paged over every row in one call + the quant, as vLLM's FLASH_ATTN + QuantFP8; fused_paged: "
            f"absent ({runner.ABSENT['fused_paged']}); "
            f"pass_on: what the pass does with a static FP8 call under the default policy: fused_all's call "
            f"without decode rows; with decode rows no one fused call exists, so the split (fused's calls) where the "
            f"pass splits and the policy fuses the split class, else unfused_paged's (on SM90 always: a standard "
            f"layer's mixed call is not split under FUSION_PASS_VLLM_SPLIT_MIXED=off, the default, and the policy "
            f"fuses neither split class); unfused_paged's on decode-only steps; varlen_bf16: FA4 bf16 over every row "
            f"alone, no quant); the quant: {quant}; keys context + new from a preallocated per-request KV slab "
            f"appended in place, read in place through a page table (pages of {page_size} rows) by unfused_paged, "
            f"gathered into a packed workspace outside the timed region (cu_seqlens_k) for the others; ")


def pass_on_policy(per_step: list[dict], ratio: dict, verdicts: dict, device: str,
                   target: dict = PASS_ON_TARGET) -> dict:
    """What ``pass_on`` did: the policy's generation and verdict per plan met, the steps per variant it ran, the
    fused share of rows (rows written fused / all rows), the ``target`` (:data:`PASS_ON_TARGETS` of the format)
    against ``unfused_paged``, and the noise band: on the steps where ``pass_on`` runs ``unfused_paged``'s calls
    their ratio differs from 1 by timing noise alone."""
    rows = sum(t["tokens"] for t in per_step)
    fused_rows = sum(t["pass_on_fused_rows"] for t in per_step)
    same = [t["unfused_paged_ms"] / t["pass_on_ms"] for t in per_step if t["pass_on"]["variant"] == "unfused_paged"]
    below, overall = ratio["steps_below_0.99"], ratio["overall"]
    return {"generation": policy.generation(device), "verdicts": verdicts,
            "steps_by_variant": dict(Counter(t["pass_on"]["variant"] for t in per_step)),
            "rows": rows, "fused_rows": fused_rows, "fused_share": fused_rows / rows if rows else None,
            "target": {**target, "steps_below": below, "overall": overall,
                       "met": bool(per_step) and below == 0 and overall is not None
                       and overall >= target["min_overall"]},
            "noise": {"n": len(same), "min": min(same, default=None), "max": max(same, default=None)}}


def _pass_on_lines(t: dict) -> list[str]:
    """``pass_on``'s policy, fused share of rows, target and noise band, in words (summary and markdown)."""
    p = t["pass_on_policy"]
    share = "n/a" if p["fused_share"] is None else f"{p['fused_share']:.3f}"
    verdicts = "; ".join(f"{plan}: {'fused' if v['fused'] else 'unfused'} as {v['variant']} ({v['why']})"
                         for plan, v in p["verdicts"].items())
    target = p["target"]
    noise = p["noise"]
    lines = [f"pass_on (policy for {p['generation']}): {verdicts or 'no busy step'}",
             f"pass_on fused share of rows: {share} ({p['fused_rows']} of {p['rows']} rows written fused); steps per "
             f"variant: " + ", ".join(f"{k} {n}" for k, n in sorted(p["steps_by_variant"].items())),
             f"pass_on target against unfused (one paged call): no step below {target['min_step_ratio']:.2f}x and "
             f"overall >= {target['min_overall']:.2f}x: " + ("met" if target["met"] else "NOT met")
             + f" ({target['steps_below']} steps below, overall {_x(target['overall'])})"]
    if noise["n"]:
        lines.append(f"pass_on noise band: on the {noise['n']} step(s) where pass_on makes unfused_paged's calls, "
                     f"unfused_paged / pass_on spans {_x(noise['min'])} .. {_x(noise['max'])}")
    return lines


CLOCK_WHAT = {
    "eager": "CUDA events around eager calls, median of repeats after warm-up, fresh randn queries per call, "
             "L2 not flushed",
    "graph": "CUDA-graph replay of the layers' calls (GPU time alone: no host cost, no launch gaps), one graph per "
             "variant replayed in rounds (one replay of each a round, the order rotated), median of repeats after "
             "warm-up, the step's randn queries drawn once, L2 not flushed",
}


def noise_floor(per_step: list[dict]) -> dict:
    """The measurement's own spread: on a step without prefill rows ``fused`` and ``unfused_split`` make the very
    same calls, so their per-step ratio differs from 1 by timing noise alone. ``{"n", "min", "max"}`` over those
    steps (``n == 0``, no bounds, when every busy step has prefill rows)."""
    same = [t["unfused_split_ms"] / t["fused_ms"] for t in per_step if not t["prefill_rows"]]
    return {"n": len(same), "min": min(same, default=None), "max": max(same, default=None)}


def _eager_line(fallbacks: list[dict]) -> str:
    first = fallbacks[0]
    return (f"{len(fallbacks)} variant-step(s) could not be captured in a CUDA graph and were timed eagerly "
            f"(first: step {first['step']}, {first['variant']}: {first['why']})")


def _noise_line(t: dict) -> str:
    floor = t.get("noise_floor") or {"n": 0}
    if not floor["n"]:
        return "noise floor: not measured (no step without prefill rows)"
    if floor["n"] == 1:
        return (f"noise floor: on the one step without prefill rows, where fused and unfused_split make the same "
                f"calls, unfused_split / fused is {_x(floor['min'])} (one step: no band)")
    return (f"noise floor: on the {floor['n']} steps without prefill rows, where fused and unfused_split make the same "
            f"calls, unfused_split / fused spans {_x(floor['min'])} .. {_x(floor['max'])}: a per-step ratio inside "
            f"that band is timing noise")


# --------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------


def results_json(cfg: TraceConfig, steps: list[Step], run: TraceRun | None, *, model: str, tiny: bool,
                 device: str, layers: int, timing: dict) -> dict:
    """The JSON document (see bench/README.md); ``run`` is None without the model run; ``timing`` is
    :func:`time_trace`'s entry or ``{"skipped": why}``."""
    stats = schedule_stats(steps)
    this = None
    if run is not None and run.totals["prefill"]:
        this = run.totals["prefill_fused"] / run.totals["prefill"]
    per_step = []
    for i, s in enumerate(steps):
        entry = {"step": s.index, "kind": s.kind, "tokens": s.tokens, "decode_tokens": s.decode_tokens,
                 "prefill_tokens": s.prefill_tokens,
                 "prompt_chunks_with_context": sum(1 for c in s.chunks if c.prompt and c.context_len),
                 "gate_fused": s.gate_fused, "fused_tokens": None, "post_quantized": None,
                 "counters_match": None}
        delta = run.per_step[i] if run is not None else None
        if delta is not None:
            entry["fused_tokens"] = delta["prefill_fused"] / run.layers
            entry["post_quantized"] = {k: v / run.layers for k, v in delta["post_quantized"].items()}
            entry["counters_match"] = delta["prefill"] == run.layers * s.prefill_tokens
        per_step.append(entry)
    return {
        "budget": cfg.budget,
        "steps": cfg.steps,
        "prefill_tokens": stats["prefill_tokens"],
        "fused_fraction": {"pure_prefill_gate": pure_prefill_gate_fraction(steps), "this": this},
        "config": {"model": model, "tiny": tiny, "device": device, "layers": layers, "seed": cfg.seed,
                   "rate": cfg.rate, "max_seqs": cfg.max_seqs, "prefix_hit_rate": cfg.prefix_hit_rate,
                   "block_size": cfg.block_size, "prompt_len": vars(cfg.prompt).copy(),
                   "decode_len": vars(cfg.decode).copy()},
        "schedule": stats,
        "counters": None if run is None else {
            "layers": run.layers, **run.totals,
            "mismatched_steps": [e["step"] for e in per_step if e["counters_match"] is False]},
        "pass": None if run is None else {k: run.report[k] for k in ("graphs", "candidates", "rewritten", "refused")},
        "timing": timing,
        "per_step": per_step,
    }


def summary(doc: dict) -> str:
    """The human-readable summary of :func:`results_json`'s document."""
    c, s, f = doc["config"], doc["schedule"], doc["fused_fraction"]
    busy = s["mean_tokens_per_busy_step"]

    def frac(x):
        return "n/a" if x is None else f"{x:.3f}"

    lines = [
        f"serving trace: model {c['model']}{' (tiny)' if c['tiny'] else ''} on {c['device']}, budget {doc['budget']} "
        f"tokens/step, max {c['max_seqs']} seqs, {doc['steps']} steps, rate {c['rate']}/step, "
        f"prefix-hit rate {c['prefix_hit_rate']}, seed {c['seed']}",
        f"requests: {s['requests_arrived']} arrived, {s['requests_admitted']} admitted, "
        f"{s['requests_finished']} finished; prompt len mean {s['mean_prompt_len'] or 0:.0f} "
        f"(max {s['max_prompt_len'] or 0}), decode len mean {s['mean_decode_len'] or 0:.0f}; "
        f"{s['prefix_hits']} prefix hits ({s['prefix_cached_tokens']} tokens)",
        "steps: " + ", ".join(f"{n} {k}" for k, n in s["steps_by_kind"].items())
        + f"; {busy:.0f} tokens per busy step ({busy / doc['budget']:.0%} of the budget)",
        f"prefill tokens: {doc['prefill_tokens']} ("
        + ", ".join(f"{n} in {k} batches" for k, n in s["prefill_tokens_by_kind"].items())
        + f"), decode tokens: {s['decode_tokens']}",
        "fused fraction of prefill tokens:",
        f"  pure-prefill gate  {frac(f['pure_prefill_gate'])}",
    ]
    counters = doc["counters"]
    if counters is None:
        lines.append("  this guard         not measured (the model was not run: --schedule-only or --timing-only)")
    else:
        post = ", ".join(f"{k}={v / counters['layers']:g}" for k, v in sorted(counters["post_quantized"].items()))
        lines.append(f"  this guard         {frac(f['this'])}   (tokens quantized after attention: {post or 'none'})")
        if counters["mismatched_steps"]:
            lines.append(f"  warning: the counters' prefill tokens differ from the schedule's at steps "
                         f"{counters['mismatched_steps'][:10]}")
        p = doc["pass"]
        lines.append(f"pass: {p['rewritten']} of {p['candidates']} attention nodes rewritten in {p['graphs']} graphs"
                     + (f", refused {p['refused']}" if p["refused"] else ""))
    if c.get("format", "nvfp4") != "nvfp4":
        lines.append(f"output format {c['format']}: {FORMAT_SCOPE}")
    t = doc["timing"]
    if t["skipped"]:
        lines.append(f"timing: skipped ({t['skipped']})")
    else:
        lines += timing_lines(t)
    return "\n".join(lines)


def _x(v) -> str:
    return "n/a" if v is None else f"{v:.3f}x"


def _bytes_line(key: str, pair: dict, steps: int | None = None) -> str:
    """One pair's byte comparison in words (``steps``: how many were compared, when known)."""
    differ = pair["differ_at"]
    if steps == 0:
        return f"{key} ({pair['what']}): not compared (no busy step)"
    return (f"{key} ({pair['what']}): " + ("equal at every step" if not differ else
                                             f"differ at {len(differ)} steps {differ[:10]}"))


def timing_lines(t: dict) -> list[str]:
    """The timing part of the summary: per-step ratio distributions beside the ceiling on paper, the bytes."""
    fmt = t.get("format", "nvfp4")
    lines = [f"timing on {t['device']} ({t['kernels']} kernels), {len(t['per_step'])} busy steps, output {fmt}: "
             f"{t['what']}", f"  ceiling: {t['ceiling_note']}"]
    lines += [f"  {v}: absent ({why})" for v, why in t.get("absent", {}).items()]
    if t.get("quant_graphs") is not None:
        g = t["quant_graphs"]
        lines.append(f"  the quant: {g['before_the_steps']} graph(s) compiled by Dynamo before the first step, "
                     f"{g['during_the_steps']} during the steps" + (" (recompiles inside the timed steps: their "
                                                                     "timings may include a compile in warm-up only, "
                                                                     "but check)" if g["during_the_steps"] else ""))
    width = max(len(label) for _, _, _, label in ratios_for(fmt))
    for key, _, _, label in ratios_for(fmt):
        r = t[key]
        if r.get("absent"):
            lines.append(f"  {label:{width}s} absent: {r['absent']}")
            continue
        d, c = r["ratio"], r["ceiling"]
        lines.append(f"  {label:{width}s} per step: min {_x(d['min'])}, p10 {_x(d['p10'])}, median "
                     f"{_x(d['median'])}, p90 {_x(d['p90'])}, max {_x(d['max'])}; overall {_x(r['overall'])} "
                     f"({r['steps_below_0.99']} steps below 0.99x)")
        lines.append(f"    ceiling on paper per step: min {_x(c['min'])}, median {_x(c['median'])}, max {_x(c['max'])}; "
                     f"overall {_x(r['ceiling_overall'])}; share of the possible saving taken: "
                     + ("n/a" if r["saving_taken"] is None else f"{r['saving_taken']:.0%}"))
    lines.append(f"  ceiling from bytes alone (no launch term): overall {_x(t['ceiling_bytes_only_overall'])} against "
                 f"unfused (one call), {_x(t['ceiling_bytes_only_overall_split'])} against unfused (split), "
                 f"{_x(t['ceiling_bytes_only_overall_paged'])} against unfused (one paged call)")
    lines += [f"  {line}" for line in _pass_on_lines(t)]
    lines.append(f"  totals: {_totals(t)}")
    lines.append(f"  {_noise_line(t)}")
    if t.get("eager_instead"):
        lines.append(f"  warning: {_eager_line(t['eager_instead'])}")
    for key, pair in t["bytes"].items():
        if pair["checked"] and pair["differ_at"]:
            lines.append(f"  ERROR: bytes {_bytes_line(key, pair, len(t['per_step']))}")
        else:
            lines.append(f"  bytes {_bytes_line(key, pair, len(t['per_step']))}")
    return lines


TOTAL_LABELS = (("unfused", "unfused (one call)"), ("unfused_split", "unfused (split)"), ("fused", "fused (runtime)"),
                ("fused_all", "fused_all"), ("unfused_paged", "unfused (one paged call)"),
                ("fused_paged", "fused_paged"), ("pass_on", "pass_on"), ("varlen_bf16", "FA4 bf16 alone (one call)"))


def _totals(t: dict) -> str:
    """The variants' total ms in words (a variant absent in this format: "absent")."""
    parts = []
    for name, label in TOTAL_LABELS:
        key = f"total_{name}_ms"
        if key in t:
            parts.append(f"{label} " + ("absent" if t[key] is None else f"{t[key]:.1f} ms"))
    return ", ".join(parts)


def markdown(doc: dict, command: str) -> str:
    """A docs/benchmarks.md block for one run: date, device, command, method, the ratio table."""
    t, c = doc["timing"], doc["config"]
    lines = [f"- Date: {datetime.now(timezone.utc):%Y-%m-%d} (UTC); device: "
             f"{t.get('device', c['device']) if not t['skipped'] else c['device']}; torch {torch.__version__}",
             f"- Command: `{command}`",
             f"- Schedule: model {c['model']}, {c['layers']} layers, budget {doc['budget']}, {doc['steps']} steps, "
             f"max {c['max_seqs']} seqs, rate {c['rate']}/step, prefix-hit rate {c['prefix_hit_rate']}, seed {c['seed']}",
             f"- Fused fraction of prefill tokens: pure-prefill gate "
             + ("n/a" if doc["fused_fraction"]["pure_prefill_gate"] is None
                else f"{doc['fused_fraction']['pure_prefill_gate']:.3f}") + ", this guard "
             + ("not measured" if doc["fused_fraction"]["this"] is None else f"{doc['fused_fraction']['this']:.3f}")]
    fmt = c.get("format", "nvfp4")
    if fmt != "nvfp4":
        lines.append(f"- Output format: {fmt}, {FORMAT_SCOPE}")
    if t["skipped"]:
        return "\n".join(lines + [f"- Timing skipped: {t['skipped']}"]) + "\n"
    lines += [f"- Method: {t['what']}", f"- KV cache: pages of {t['page_size']} rows ({t['kv_pages']} pages per layer)",
              f"- Ceiling: {t['ceiling_note']}"]
    lines += [f"- Absent: {v} ({why})" for v, why in t.get("absent", {}).items()]
    lines += ["",
              "| ratio | min | p10 | median | p90 | max | overall | ceiling overall | saving taken | steps < 0.99x |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key, _, _, label in ratios_for(t.get("format", "nvfp4")):
        r = t[key]
        if r.get("absent"):
            lines.append(f"| {label} | absent | | | | | | | | |")
            continue
        d = r["ratio"]
        taken = "n/a" if r["saving_taken"] is None else f"{r['saving_taken']:.0%}"
        lines.append(f"| {label} | {_x(d['min'])} | {_x(d['p10'])} | {_x(d['median'])} | {_x(d['p90'])} | "
                     f"{_x(d['max'])} | {_x(r['overall'])} | {_x(r['ceiling_overall'])} | {taken} | "
                     f"{r['steps_below_0.99']} of {d['n']} |")
    lines.append("")
    lines.append(f"Totals: {_totals(t)}; ceiling from bytes alone {_x(t['ceiling_bytes_only_overall'])} against "
                 f"unfused (one call), {_x(t['ceiling_bytes_only_overall_split'])} against unfused (split), "
                 f"{_x(t['ceiling_bytes_only_overall_paged'])} against unfused (one paged call).")
    lines += [line + "." for line in _pass_on_lines(t)]
    lines.append("Bytes: " + "; ".join(_bytes_line(key, pair, len(t["per_step"])) + ("" if pair["checked"] else " (not required)")
                                       for key, pair in t["bytes"].items()) + ".")
    noise = _noise_line(t)
    lines.append(noise[0].upper() + noise[1:] + ".")
    if t.get("eager_instead"):
        lines.append("Warning: " + _eager_line(t["eager_instead"]) + ".")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python bench/serving_trace.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=demo.MODELS, default="mla", help="demo model to run (default mla)")
    parser.add_argument("--tiny", action="store_true",
                        help=f"tiny model dims and short requests (prompt mean {TINY['prompt'].mean:g}, decode mean "
                             f"{TINY['decode'].mean:g}; budget {TINY['budget']}, max-seqs {TINY['max_seqs']}, "
                             f"{TINY['steps']} steps unless given): a CPU run. Without it: prompt mean "
                             f"{FULL['prompt'].mean:g}, decode mean {FULL['decode'].mean:g}, full model dims")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the model and the timed steps run (default cpu); cuda times every step on FA4")
    parser.add_argument("--budget", type=int, metavar="N",
                        help=f"token budget per step (default {FULL['budget']}, {TINY['budget']} with --tiny)")
    parser.add_argument("--steps", type=int, metavar="N",
                        help=f"scheduler steps to simulate (default {FULL['steps']}, {TINY['steps']} with --tiny)")
    parser.add_argument("--max-seqs", type=int, metavar="N",
                        help=f"running requests at most (default {FULL['max_seqs']}, {TINY['max_seqs']} with --tiny)")
    parser.add_argument("--rate", type=float, default=1.0, help="mean request arrivals per step, Poisson (default 1.0)")
    parser.add_argument("--prompt-mean", type=float, metavar="TOKENS", help="mean prompt length (log-normal, clipped)")
    parser.add_argument("--decode-mean", type=float, metavar="TOKENS",
                        help="mean decode length, in decode steps after the prompt (log-normal, clipped)")
    parser.add_argument("--prefix-hit-rate", type=float, default=0.0, metavar="P",
                        help="probability that a new request finds a block-aligned part of its prompt in the "
                             "prefix cache, so its first chunk has context (default 0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the schedule (default 0)")
    parser.add_argument("--layers", type=int, default=2, help="attention layers of the model (default 2)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="timing: untimed calls per step and variant (default 2)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timing: timed calls per step and variant, median (default 5)")
    parser.add_argument("--launch-us", type=float, default=5.0,
                        help="the ceiling's launch term: us one removed launch saves per layer (default 5, an "
                             "assumption; the bytes term is computed from the H200's ~4.8 TB/s)")
    parser.add_argument("--clock", choices=("eager", "graph"), default="eager",
                        help="--device cuda: how a step's variants are timed: eager (CUDA events around eager calls, "
                             "as vLLM runs its attention op between CUDA-graph pieces: host cost included) or graph "
                             "(CUDA-graph replay: GPU time alone, the server-under-CUDA-graphs view) (default eager)")
    parser.add_argument("--page-size", type=int, default=steps_mod.DEFAULT_PAGE_SIZE, metavar="ROWS",
                        help=f"timing: rows per page of the paged KV cache the paged variants read (default "
                             f"{steps_mod.DEFAULT_PAGE_SIZE}, vLLM's default block size); every request's region of "
                             f"the KV slab is whole pages")
    parser.add_argument("--format", choices=FORMATS, default="nvfp4",
                        help="the output the timed steps write (default nvfp4): fp8_static times a static per-tensor "
                             "FP8 output (float8_e4m3fn [T, H*Dv], one float32 scale, vLLM QuantFP8's native form: "
                             "FA4's SM90 FP8 epilogue fused, FA4 bf16 + the compiled native-form quant unfused; no "
                             "fused_paged variant, reported absent; pass_on's target overall >= 1.02x). It changes "
                             f"{FORMAT_SCOPE}")
    parser.add_argument("--timing-only", action="store_true",
                        help="time the steps but do not run the demo model (no counters: `this` is null)")
    parser.add_argument("--cpu-timing", action="store_true",
                        help="on the CPU, run the timed steps on the reference kernels (checks the bytes; "
                             "the times are meaningless)")
    parser.add_argument("--workspace-tokens", type=int, metavar="N",
                        help="context workspace bound of the fused path, in tokens (default: "
                             "$FUSION_PASS_CONTEXT_WORKSPACE_TOKENS or 65536); a small N sends chunked prefills "
                             "through the chunked log-sum-exp merge (fa4 / triton backends)")
    parser.add_argument("--schedule-only", action="store_true",
                        help="only generate the schedule and the pure-prefill gate's fraction (no model, no counters)")
    parser.add_argument("--json", metavar="PATH", type=Path, help="write the results as JSON to PATH")
    parser.add_argument("--markdown", metavar="PATH", type=Path, help="write a docs/benchmarks.md block to PATH")
    args = parser.parse_args(argv)
    for name in ("budget", "steps", "max_seqs", "layers", "repeats", "workspace_tokens", "page_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name in ("rate", "launch_us", "prefix_hit_rate", "prompt_mean", "decode_mean"):
        value = getattr(args, name)
        if value is not None and not math.isfinite(value):
            parser.error(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    if args.warmup < 0 or args.rate < 0 or args.launch_us < 0 or not 0 <= args.prefix_hit_rate <= 1:
        parser.error("--warmup, --rate and --launch-us must be >= 0, --prefix-hit-rate in [0, 1]")
    for name in ("prompt_mean", "decode_mean"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.clock == "graph" and args.device != "cuda":
        parser.error("--clock graph needs --device cuda (CUDA graphs); the CPU timing is wall time")
    return args


def config_from_args(args: argparse.Namespace) -> TraceConfig:
    """The :class:`TraceConfig` of the command line (--tiny picks the tiny defaults)."""
    preset = TINY if args.tiny else FULL
    prompt, decode = preset["prompt"], preset["decode"]
    if args.prompt_mean is not None:
        prompt = Lengths(args.prompt_mean, prompt.sigma, prompt.low, max(prompt.high, round(8 * args.prompt_mean)))
    if args.decode_mean is not None:
        decode = Lengths(args.decode_mean, decode.sigma, decode.low, max(decode.high, round(8 * args.decode_mean)))
    return TraceConfig(steps=args.steps or preset["steps"], budget=args.budget or preset["budget"],
                       max_seqs=args.max_seqs or preset["max_seqs"], rate=args.rate, prompt=prompt, decode=decode,
                       prefix_hit_rate=args.prefix_hit_rate, block_size=preset["block_size"], seed=args.seed)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = config_from_args(args)
    longest = cfg.prompt.high + cfg.decode.high
    if longest > MAX_POSITION:
        print(f"serving_trace.py: --prompt-mean / --decode-mean allow requests of up to {longest} tokens (prompt "
              f"<= {cfg.prompt.high}, decode <= {cfg.decode.high}); the demo models' positions stop at "
              f"{MAX_POSITION}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("serving_trace.py: --device cuda, but torch.cuda.is_available() is False here", file=sys.stderr)
        return 2
    if args.device == "cuda":
        dims = steps_mod.attn_dims(args.model, args.tiny)
        ok, why = fa4_status("cuda", torch.bfloat16, dims.heads, dims.dqk, dims.dv)
        if ok and args.format == "fp8_static":
            ok, why = fp8_static_status("cuda")
        if not ok:
            what = "the NVFP4 epilogue" if args.format == "nvfp4" else "its SM90 static FP8 epilogue"
            print(f"serving_trace.py: the timed steps need FA4 with {what} for the {args.model} model's "
                  f"attention {dims}, and it does not run here: {why}", file=sys.stderr)
            return 2
    steps = generate_schedule(cfg)
    run = None
    try:
        if not (args.schedule_only or args.timing_only):
            with settings.use_context_workspace_tokens(args.workspace_tokens):
                run = run_trace(steps, model_name=args.model, tiny=args.tiny, device=args.device, layers=args.layers)
    except MissingTokenCounters as exc:
        print(f"serving_trace.py: {exc}", file=sys.stderr)
        return 2
    if args.schedule_only:
        timing = {"skipped": "--schedule-only: nothing was run"}
    elif args.device == "cpu" and not args.cpu_timing:
        timing = {"skipped": "CPU run: timing needs --device cuda (or --cpu-timing for the logic on the reference kernels)"}
    else:
        timing = time_trace(steps, model=args.model, tiny=args.tiny, device=args.device, layers=args.layers,
                            warmup=args.warmup, repeats=args.repeats, launch_us=args.launch_us, seed=args.seed,
                            clock=args.clock, page_size=args.page_size, fmt=args.format)
    doc = results_json(cfg, steps, run, model=args.model, tiny=args.tiny, device=args.device, layers=args.layers,
                       timing=timing)
    with settings.use_context_workspace_tokens(args.workspace_tokens):
        doc["config"]["context_workspace_tokens"] = settings.context_workspace_tokens()
    doc["config"]["page_size"] = args.page_size
    doc["config"]["format"] = args.format
    doc["config"]["format_scope"] = FORMAT_SCOPE if args.format != "nvfp4" else None
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(doc, command_line(sys.argv if argv is None else ["bench/serving_trace.py", *argv])))
    print(summary(doc))
    for path in (args.json, args.markdown):
        if path:
            print(f"wrote {path}")
    return 1 if timing.get("mismatched_steps") else 0


def command_line(argv: list[str]) -> str:
    """The command as run (``_command.command_line``)."""
    from _command import command_line as as_run

    return as_run(argv, "bench/serving_trace.py")


if __name__ == "__main__":
    sys.exit(main())
