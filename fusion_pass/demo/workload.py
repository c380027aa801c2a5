"""The demo: a scripted serving workload through the demo models, compiled with and without the pass.

The workload has every batch kind the run-time guard distinguishes, in the
order a server would produce them (each step continues the KV caches of the
previous ones):

1. ``prefill``: three new prompts of different lengths;
2. ``decode``: one token for each of them;
3. ``mixed``: two decodes and a new prompt in one batch;
4. ``prefill``: the first chunk of a long prompt;
5. ``chunked``: its second chunk, attending to the first from the cache.

:func:`run_demo` checks the pass batch by batch (:func:`run_lockstep`);
with ``timing=True`` it then times the compiled stack with and without the
pass on the prefill batches (:func:`time_prefill`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from fusion_pass import nvfp4, runtime
from fusion_pass.nvfp4 import ArgumentError
from fusion_pass.nvfp4.checks import is_int
from fusion_pass.runtime import counters
from fusion_pass.compile.graph_pass import FusionPass
from fusion_pass.compile.summary import summarize as format_report  # noqa: F401  (handed on: demo.format_report)
from fusion_pass.demo.models import (
    GQAConfig,
    MLAConfig,
    build_gqa_model,
    build_mla_model,
    calibrate_nvfp4_inputs,
    release_layers,
)
from fusion_pass.ops import tap_gemm_inputs
from fusion_pass.runtime import BatchSpec, RequestSpec

MODELS = ("mla", "gqa")


def workload() -> list[BatchSpec]:
    """The scripted batches; decode requests come first in each, as vLLM orders them."""
    return [
        BatchSpec((RequestSpec("a", 37), RequestSpec("b", 101), RequestSpec("c", 64))),
        BatchSpec((RequestSpec("a", 1, 37), RequestSpec("b", 1, 101), RequestSpec("c", 1, 64))),
        BatchSpec((RequestSpec("a", 1, 38), RequestSpec("b", 1, 102), RequestSpec("d", 50))),
        BatchSpec((RequestSpec("e", 96),)),
        BatchSpec((RequestSpec("e", 80, 96),)),
    ]


@dataclass
class BatchResult:
    """One batch of the workload, compiled with the pass vs compiled without it."""

    model: str
    step: int
    kind: str
    tokens: int
    prefill_tokens: int  # the batch's prefill rows (tokens of requests with more than one new token)
    fused_tokens: int  # of which the fused backend wrote, in every layer
    path: str  # "fused" (every prefill row fused), "partial" (some) or "fallback", as the run-time guard decided
    reason: str | None  # the fallback reason
    backend: str | None  # the fused backend(s) that ran, e.g. "fa4" (None on fallback)
    bytes_equal_unfused: bool  # the o_proj's NVFP4 input, byte for byte, vs the unfused graph's (required on
    # fallback batches only: fused rows quantize float32 attention and are checked against err_bound instead)
    decode_bytes_equal_unfused: bool  # the decode rows of it, byte for byte (True when there are none; required
    # where they are post-quantized, not where the fused backend wrote them: decode_fused)
    decode_fused: int  # decode rows the fused backend wrote (a standard layer's one call over its paged cache)
    max_abs_err: float  # max |dequant(with pass) - dequant(unfused)| of the o_proj input
    err_bound: float  # the largest per-element bound that difference is checked against
    within_bound: bool  # every element within its bound
    max_abs_diff_eager: float  # max |compiled without pass - eager| of the stack's output


def _count(fn: str, name: str, value, minimum: int) -> int:
    """``value`` as an int (numpy integers accepted), at least ``minimum``; else a ValueError naming it."""
    if not is_int(value) or value < minimum:
        raise ArgumentError(f"{fn}: {name} must be an int >= {minimum}, got {type(value).__name__} {value!r}")
    return int(value)


def build_model(name: str, *, tiny: bool = False, device: str = "cpu", layers: int = 2, prefix: str | None = None):
    """The demo model ``name`` (``mla`` or ``gqa``), NVFP4 inputs calibrated on a fixed batch."""
    layers = _count("build_model", "layers", layers, 1)
    if name == "mla":
        cfg = MLAConfig.tiny(num_layers=layers) if tiny else MLAConfig(num_layers=layers)
        model = build_mla_model(cfg, prefix=prefix or name, device=device)
    elif name == "gqa":
        cfg = GQAConfig.tiny(num_layers=layers) if tiny else GQAConfig(num_layers=layers)
        model = build_gqa_model(cfg, prefix=prefix or name, device=device)
    else:
        raise ArgumentError(f"build_model: name must be one of {MODELS}, got {name!r}")
    spec = BatchSpec((RequestSpec("calibration", 64),))
    calibrate_nvfp4_inputs(model, [(spec, make_inputs(spec, cfg.hidden_size, device, seed=1234))])
    return model


def make_inputs(spec: BatchSpec, hidden_size: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions int64 [T], hidden bf16 [T, hidden_size])`` for a batch, seeded."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(spec.num_tokens, hidden_size, generator=generator).to(device=device, dtype=torch.bfloat16)
    return spec.positions(device=device), hidden


@dataclass
class StepOutput:
    output: torch.Tensor
    o_proj_inputs: list  # per layer: (packed uint8 [T, K/2], scales) as the o_proj GEMM read them
    decisions: dict  # guard counter deltas: {"fused": n, "fallback": {reason: n}}


@torch.no_grad()
def run_step(model, spec: BatchSpec, step: int, hidden_size: int, device: str) -> StepOutput:
    """Run one batch, recording its output, the o_proj GEMMs' NVFP4 inputs and the guard's decisions."""
    positions, hidden = make_inputs(spec, hidden_size, device, seed=step)
    torch._dynamo.mark_dynamic(positions, 0)
    torch._dynamo.mark_dynamic(hidden, 0)
    before = counters.counters()
    with runtime.batch(spec), tap_gemm_inputs() as taps:
        output = model(positions, hidden)
    return StepOutput(output, list(taps), _counter_delta(before, counters.counters()))


def run_lockstep(variants: dict, steps: list[BatchSpec], hidden_size: int, device: str, *,
                 progress: Callable[[str], None] | None = None, label: str = "") -> list[dict]:
    """Run every variant (name -> callable model) on each step from the same KV caches.

    Each step starts from the caches the previous step left behind in the last
    variant; the others run on a snapshot of them. So every variant sees the
    same inputs at every step and differences are the variants' own.
    ``progress`` (optional) is called with one line per step, prefixed with ``label``.
    """
    runtime.clear_kv_caches()
    per_step = []
    for i, spec in enumerate(steps):
        if progress is not None:
            progress(f"demo: {label + ': ' if label else ''}batch {i + 1}/{len(steps)}: {spec.kind}, "
                     f"{spec.num_tokens} tokens")
        start = runtime.snapshot_kv_caches()
        outputs = {}
        for name, model in variants.items():
            runtime.restore_kv_caches(start)
            outputs[name] = run_step(model, spec, i, hidden_size, device)
        per_step.append(outputs)
    runtime.clear_kv_caches()
    return per_step


def _counter_delta(before: dict, after: dict) -> dict:
    fallback = {k: v - before["fallback"].get(k, 0) for k, v in after["fallback"].items()}
    by_backend = {k: v - before["fused_by_backend"].get(k, 0) for k, v in after["fused_by_backend"].items()}
    t0, t1 = before["tokens"], after["tokens"]
    post = {k: v - t0["post_quantized"].get(k, 0) for k, v in t1["post_quantized"].items()}
    tokens = {"prefill": t1["prefill"] - t0["prefill"], "prefill_fused": t1["prefill_fused"] - t0["prefill_fused"],
              "decode_fused": t1["decode_fused"] - t0["decode_fused"],
              "post_quantized": {k: v for k, v in post.items() if v}}
    return {"fused": after["fused"] - before["fused"], "fallback": {k: v for k, v in fallback.items() if v},
            "fused_by_backend": {k: v for k, v in by_backend.items() if v}, "tokens": tokens}


def requantization_bound(unfused: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Bound on |dequant(fused) - dequant(unfused)| per element, from the unfused values alone.

    Fused quantizes float32 attention ``a``; unfused quantizes ``bf16(a)``.
    With ``s = amax_block / 6`` each quantization is within
    ``s (1 + 2^-4) + 6 * 2^-10 / gs`` of its input (``nvfp4.error_bound``) and
    ``|a - bf16(a)| <= 2^-9 |a|``. The block amax of ``a`` is recovered from the
    unfused dequantized block amax ``A`` as ``amax <= (A + c) / (1 - 1.0625 / 6)``
    (the dequantized values are within one bound of the inputs), ``c = 6 * 2^-10 / gs``.
    """
    gs = global_scale.float().reshape(())
    blocks = unfused.float().reshape(unfused.shape[0], -1, nvfp4.BLOCK_SIZE)
    c = 6 * 2.0**-10 / gs
    amax = (blocks.abs().amax(dim=-1, keepdim=True) + c) / (1 - 1.0625 / 6)
    per_block = 2 * (amax / 6 * 1.0625 + c) + 2.0**-9 * amax
    return per_block.expand_as(blocks).reshape(unfused.shape)


def rows_equal(with_pass, unfused, rows: int) -> bool:
    """Whether rows ``[0, rows)`` of every layer's o_proj input (packed bytes and their scale bytes) are equal."""
    if rows == 0:
        return True
    for (a_f, s_f), (a_u, s_u) in zip(with_pass, unfused):
        n_blocks = a_f.shape[1] * 2 // nvfp4.BLOCK_SIZE
        offsets = nvfp4.swizzled_offset(torch.arange(rows).unsqueeze(1), torch.arange(n_blocks).unsqueeze(0), n_blocks)
        offsets = offsets.reshape(-1).to(a_f.device)
        if not (torch.equal(a_f[:rows], a_u[:rows]) and torch.equal(s_f.view(torch.uint8).reshape(-1)[offsets],
                                                                      s_u.view(torch.uint8).reshape(-1)[offsets])):
            return False
    return True


def compare_nvfp4(with_pass, unfused, global_scales) -> tuple[bool, float, float, bool]:
    """``(bytes_equal, max_abs_err, err_bound, within_bound)`` over every layer's o_proj input."""
    equal, max_err, max_bound, within = True, 0.0, 0.0, True
    for (a_f, s_f), (a_u, s_u), gs in zip(with_pass, unfused, global_scales):
        equal &= torch.equal(a_f, a_u) and torch.equal(s_f.view(torch.uint8), s_u.view(torch.uint8))
        deq_f = nvfp4.dequantize(a_f, s_f, gs)
        deq_u = nvfp4.dequantize(a_u, s_u, gs)
        err = (deq_f - deq_u).abs()
        bound = requantization_bound(deq_u, gs)
        max_err, max_bound = max(max_err, err.max().item()), max(max_bound, bound.max().item())
        within &= bool((err <= bound).all())
    return equal, max_err, max_bound, within


TIMED_VARIANTS = ("unfused", "fused")
"""The variants :func:`time_prefill` times (the compiled stack without and with the pass)."""


@torch.no_grad()
def time_prefill(
    variants: dict, steps: list[BatchSpec], hidden_size: int, device: str, *, warmup: int = 3, repeats: int = 20,
    model: str | None = None,
) -> list[dict]:
    """Time the ``"unfused"`` and ``"fused"`` variants on every prefill step of ``steps``.

    The steps are replayed in order from empty caches, as :func:`run_lockstep`
    does (each step is run once by the last variant of ``variants``, with the
    lockstep's inputs), so every step starts from the caches the previous ones
    left. On a step whose ``kind`` is ``"prefill"``, each timed variant is
    first called ``warmup`` times, then ``repeats`` times; before every call the
    KV caches are restored to the step's start snapshot (outside the timed
    region), and every call gets its own seeded inputs, generated before any
    timing. A call is timed with CUDA events around it on a CUDA device, with
    ``time.perf_counter`` otherwise; the median is kept. Other variants (the
    eager model) are not timed.

    The timed calls go through the run-time guard, so they count in
    :func:`fusion_pass.runtime.counters.counters`. Returns, per prefill step in order,
    ``{"model", "step", "tokens", "unfused_ms", "fused_ms", "speedup"}`` with
    ``speedup = unfused_ms / fused_ms`` and ``model`` the name given (a label).
    """
    missing = [name for name in TIMED_VARIANTS if name not in variants]
    if missing:
        raise ArgumentError(f"time_prefill: variants must include {TIMED_VARIANTS}, missing {missing}")
    repeats = _count("time_prefill", "repeats", repeats, 1)
    warmup = _count("time_prefill", "warmup", warmup, 0)
    advance = list(variants.values())[-1]
    timings = []
    runtime.clear_kv_caches()
    try:
        for i, spec in enumerate(steps):
            start = runtime.snapshot_kv_caches()
            if spec.kind == "prefill":
                inputs = [dynamic_inputs(spec, hidden_size, device, seed=100_000 * (i + 1) + n)
                          for n in range(warmup + repeats)]
                ms = {name: median_call_ms(variants[name], spec, inputs, warmup, start, device)
                      for name in TIMED_VARIANTS}
                timings.append({"model": model, "step": i, "tokens": spec.num_tokens,
                                "unfused_ms": ms["unfused"], "fused_ms": ms["fused"],
                                "speedup": ms["unfused"] / ms["fused"]})
                runtime.restore_kv_caches(start)
            run_step(advance, spec, i, hidden_size, device)  # the caches the next step starts from
    finally:
        runtime.clear_kv_caches()
    return timings


def dynamic_inputs(spec: BatchSpec, hidden_size: int, device: str, seed: int):
    """:func:`make_inputs` with the token dimension marked dynamic (one compiled graph for every batch)."""
    positions, hidden = make_inputs(spec, hidden_size, device, seed=seed)
    torch._dynamo.mark_dynamic(positions, 0)
    torch._dynamo.mark_dynamic(hidden, 0)
    return positions, hidden


def median_call_ms(model, spec: BatchSpec, inputs: list, warmup: int, start: dict, device: str) -> float:
    """Median milliseconds of ``model(*inputs[n])`` for ``n >= warmup``, each call from the ``start`` caches."""
    cuda = torch.device(device).type == "cuda"
    times = []
    with runtime.batch(spec):
        for n, (positions, hidden) in enumerate(inputs):
            runtime.restore_kv_caches(start)
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                begin.record()
                model(positions, hidden)
                end.record()
                torch.cuda.synchronize()
                elapsed = begin.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                model(positions, hidden)
                elapsed = (time.perf_counter() - t0) * 1e3
            if n >= warmup:
                times.append(elapsed)
    return statistics.median(times)


@dataclass
class DemoRun:
    """What :func:`run_demo` returns.

    Unpacks as ``results, fusion = run_demo(...)`` (its return value before
    timings existed). ``report`` is ``fusion.report()`` taken after the
    correctness runs and before any timed call (the timed calls also go
    through the guard, and would add to its run-time counters); ``timings`` is
    :func:`time_prefill`'s list over the models, in order (empty unless
    ``timing=True``).
    """

    results: list[BatchResult]
    fusion: FusionPass
    report: dict
    timings: list[dict] = field(default_factory=list)

    def __iter__(self):
        return iter((self.results, self.fusion))


def run_demo(models=MODELS, *, tiny: bool = False, device: str = "cpu", layers: int = 2,
             timing: bool = False, warmup: int = 3, repeats: int = 20,
             progress: Callable[[str], None] | None = None) -> DemoRun:
    """Per model, the workload eagerly, compiled without the pass and compiled with it.

    With ``timing``, once every model's correctness run is done, each
    model's two compiled variants are timed on the prefill batches
    (:func:`time_prefill` with ``warmup`` and ``repeats``). ``progress``, when
    given, is called with one line per model and phase as the run goes (building,
    each batch, timing): ``fusion-pass demo`` prints them to stderr. Returns a
    :class:`DemoRun`, which unpacks as ``(results, fusion_pass)``.
    """
    layers = _count("run_demo", "layers", layers, 1)
    warmup = _count("run_demo", "warmup", warmup, 0)
    repeats = _count("run_demo", "repeats", repeats, 1)
    say = progress or (lambda line: None)
    results = []
    steps = workload()
    fusion = FusionPass()
    built = []  # (name, model, variants, hidden_size): kept for the timing pass
    try:
        for name in models:
            say(f"demo: {name}: building the model ({layers} layer{'s' if layers != 1 else ''}"
                f"{', tiny' if tiny else ''}, {device}) and calibrating its NVFP4 inputs")
            model = build_model(name, tiny=tiny, device=device, layers=layers)
            hidden_size = model.norms[0].normalized_shape[0]
            global_scales = [layer.o_proj.input_global_scale for layer in model.layers]
            # Fresh compiles (no FX graph cache): a cache hit reuses the rewritten graph
            # without running the pass, and the report would miss it.
            variants = {
                "eager": model,
                "unfused": torch.compile(model, options={"fx_graph_cache": False}),
                "fused": torch.compile(model, options={"post_grad_custom_post_pass": fusion,
                                                       "fx_graph_cache": False}),
            }
            built.append((name, model, variants, hidden_size))
            say(f"demo: {name}: running the {len(steps)} batches eager, compiled without and with the pass "
                f"(the first batch compiles both)")
            per_step = run_lockstep(variants, steps, hidden_size, device, progress=say, label=name)
            for i, (spec, out) in enumerate(zip(steps, per_step)):
                fused, unfused = out["fused"], out["unfused"]
                equal, err, bound, within = compare_nvfp4(fused.o_proj_inputs, unfused.o_proj_inputs, global_scales)
                decode = spec.num_decode_tokens
                decode_equal = rows_equal(fused.o_proj_inputs, unfused.o_proj_inputs, decode)
                prefill = spec.num_tokens - decode
                calls = fused.decisions["fused"] + sum(fused.decisions["fallback"].values())
                fused_tokens = fused.decisions["tokens"]["prefill_fused"] // max(calls, 1)
                decode_fused = fused.decisions["tokens"]["decode_fused"] // max(calls, 1)
                reasons = sorted(fused.decisions["fallback"])
                path = ("fused" if prefill and fused_tokens == prefill and not reasons
                        else "partial" if fused_tokens else "fallback" if calls else "unfused")
                diff = (unfused.output.float() - out["eager"].output.float()).abs().max().item()
                fused_by = ",".join(sorted(fused.decisions["fused_by_backend"])) or None
                results.append(BatchResult(name, i, spec.kind, spec.num_tokens, prefill, fused_tokens, path,
                                           ",".join(reasons) or None, fused_by, equal, decode_equal, decode_fused,
                                           err, bound, within, diff))
        run = DemoRun(results, fusion, fusion.report())
        if timing:
            for name, _, variants, hidden_size in built:
                say(f"demo: {name}: timing the prefill batches ({warmup} warm-up + {repeats} timed calls per "
                    f"variant and batch)")
                run.timings += time_prefill(variants, steps, hidden_size, device,
                                            warmup=warmup, repeats=repeats, model=name)
        say("demo: done")
    finally:
        for _, model, _, _ in built:
            release_layers(model)
    return run


NOT_COMPARED = "n/a (fused)"
"""What the table shows under ``bytes==unfused`` for a batch whose prefill rows the fused backend wrote, and under
``decode==`` for one whose decode rows it wrote too (a standard layer's one call over its paged cache): those bytes
are not expected to equal the unfused graph's (they quantize float32 attention, not its bf16 rounding); the batch
is checked against ``bound`` instead, and post-quantized decode rows byte for byte (``decode==``)."""


def _bytes_column(r: BatchResult) -> str:
    if r.path in ("fused", "partial"):
        return NOT_COMPARED
    return str(r.bytes_equal_unfused)


def _decode_column(r: BatchResult) -> str:
    return NOT_COMPARED if r.decode_fused else str(r.decode_bytes_equal_unfused)


def format_table(results: list[BatchResult]) -> str:
    header = (f"{'model':<5} {'step':>4} {'kind':<8} {'tokens':>6} {'prefill':>7} {'fused':>5}  {'path':<8} "
              f"{'backend':<9} {'reason':<16} {'bytes==unfused':>14} {'decode==':>11} {'max|err|':>10} {'bound':>10}  "
              f"{'|unfused-eager|':>15}")
    rows = [
        f"{r.model:<5} {r.step:>4} {r.kind:<8} {r.tokens:>6} {r.prefill_tokens:>7} {r.fused_tokens:>5}  {r.path:<8} "
        f"{r.backend or '-':<9} {r.reason or '-':<16} {_bytes_column(r):>14} "
        f"{_decode_column(r):>11} {r.max_abs_err:>10.3e} {r.err_bound:>10.3e}"
        f"{'' if r.within_bound else '!'} {r.max_abs_diff_eager:>15.3e}"
        for r in results
    ]
    prefill = sum(r.prefill_tokens for r in results)
    fused = sum(r.fused_tokens for r in results)
    share = f"{fused / prefill:.1%}" if prefill else "n/a"
    notes = [
        f"prefill tokens on the fused path, per batch (each token once, whatever the number of layers): "
        f"{fused} of {prefill} ({share})",
        f"bytes==unfused: required on fallback batches; {NOT_COMPARED}: fused rows quantize float32 attention, so "
        f"they are checked against the bound (max|err| <= bound; '!' marks a miss) and post-quantized decode rows "
        f"byte for byte (decode==; {NOT_COMPARED} where one launch over the paged cache wrote them too)",
        "|unfused-eager|: the largest difference of the stack's output compiled without the pass from the same stack "
        "run eagerly (Inductor's own rounding, the baseline the pass is compared with)",
    ]
    return "\n".join([header, "-" * len(header), *rows, *notes])


def format_timing(timings: list[dict], *, device: str, layers: int, warmup: int, repeats: int) -> str:
    """The timing table of :func:`time_prefill`'s entries, then a note on what was timed and how."""
    header = f"{'model':<5} {'step':>4} {'tokens':>6}  {'unfused ms':>10} {'fused ms':>10} {'speedup':>8}"
    rows = [
        f"{t['model'] or '-':<5} {t['step']:>4} {t['tokens']:>6}  {t['unfused_ms']:>10.3f} {t['fused_ms']:>10.3f} "
        f"{t['speedup']:>7.2f}x"
        for t in timings
    ]
    cuda = torch.device(device).type == "cuda"
    gemm = ("a dequantize + bf16 matmul emulation, since Hopper has no FP4 GEMM" if cuda
            else "a dequantize + float32 matmul emulation on the CPU")
    clock = "CUDA events around each call" if cuda else "time.perf_counter around each call"
    note = (f"timed: the whole compiled attention stack, without vs with the pass, on the prefill batches "
            f"({layers} layer{'s' if layers != 1 else ''}, each: norm, projections, attention, NVFP4 quant, "
            f"o_proj GEMM, the latter {gemm}); median of {repeats} repeats after {warmup} warm-up calls, "
            f"{clock}, fresh inputs per call, KV caches restored outside the timed region.")
    return "\n".join([header, "-" * len(header), *rows, note])


def results_json(results: list[BatchResult], report: dict, timings: list[dict] | None = None) -> dict:
    """The demo as JSON: the report's totals (``runtime``: the calls of the layers the pass rewrote;
    ``runtime_process``: every call of the process), ``batches`` and ``timing`` (empty when not timed)."""
    return {
        "layers": report["candidates"],
        "rewritten": report["rewritten"],
        "refused": report["refused"],
        "runtime": report["runtime"],  # the calls of the layers the pass rewrote
        "runtime_process": report.get("runtime_process", report["runtime"]),  # every call of the process
        "graphs_from_cache": report.get("graphs_from_cache", 0),
        "batches": [asdict(r) for r in results],
        "timing": list(timings or []),
    }
