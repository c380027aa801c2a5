"""Serving trace: how many prefill tokens run on the fused attention -> NVFP4 path.

A scripted continuous-batching schedule shaped like vLLM V1's scheduler is run
step by step through a demo model ("mla" or "gqa") compiled with the fusion
pass, and the fraction of prefill tokens written by the fused kernel is
reported under two guards:

  pure_prefill_gate  the old gate, computed from the schedule: a step's prefill
                     tokens count as fused only when the step has no decode
                     token and no prefill with cached context;
  this               the project's guard, measured: the per-token counters of
                     fusion_pass.runtime.counters.counters()["tokens"] summed over the
                     steps, prefill_fused / prefill.

The schedule (pure Python, seeded, deterministic): requests arrive as a
Poisson process (--rate per step on average) with log-normal prompt and decode
lengths (clipped). Each step has a token budget (--budget): first one token
for each running request whose prompt is done (decodes), then chunks of the
partially prefilled requests, then new requests from the waiting queue
(at most --max-seqs running), each chunk as large as the remaining budget
allows (chunked prefill: a later chunk's context_len is the tokens already
computed). With --prefix-hit-rate, a new request may find a block-aligned part
of its prompt already cached: its first chunk then has context_len > 0 (those
tokens are put into the KV cache by an uncounted eager call before the step).
As in vLLM, a request with one new token (query_len 1) is a decode to the
runtime and to both guards, even when that token is the last of a prompt.

The steps run in order through one compiled model, so every request's context
really is in the KV caches; finished requests are dropped from them.

With --device cuda each step is also timed, the model compiled without vs
with the pass (CUDA events, warm-up calls, median of --repeats calls on fresh
random inputs, KV caches restored outside the timed region). On the CPU timing
is skipped.

    python bench/serving_trace.py --tiny --json trace.json            # a CPU smoke run (under a minute)
    python bench/serving_trace.py --device cuda --budget 8192 --max-seqs 512 --rate 2 --json trace.json

Exit code 2 when the installed fusion_pass has no per-token counters or
--device cuda has no CUDA device.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random
import statistics
import sys
import warnings
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("fusion_pass") is None:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

from fusion_pass import runtime  # noqa: E402
from fusion_pass.demo import workload as demo
from fusion_pass.runtime import counters, guard, row_plan, settings
from fusion_pass.compile.graph_pass import FusionPass  # noqa: E402
from fusion_pass.demo.models import release_layers  # noqa: E402
from fusion_pass.demo.models.common import MAX_POSITION  # noqa: E402
from fusion_pass.runtime import BatchSpec, RequestSpec  # noqa: E402

# --------------------------------------------------------------------------
# The schedule
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Lengths:
    """A log-normal length distribution with the given mean, clipped to ``[low, high]``."""

    mean: float
    sigma: float
    low: int
    high: int

    def sample(self, rng: random.Random) -> int:
        mu = math.log(self.mean) - self.sigma**2 / 2  # so that the unclipped mean is `mean`
        return min(self.high, max(self.low, round(rng.lognormvariate(mu, self.sigma))))


@dataclass(frozen=True)
class TraceConfig:
    """Everything the schedule depends on."""

    steps: int
    budget: int  # tokens per step
    max_seqs: int  # running requests at most
    rate: float  # mean arrivals per step
    prompt: Lengths
    decode: Lengths  # decode steps after the prompt (one token each), >= 1
    prefix_hit_rate: float = 0.0  # probability that a new request finds part of its prompt cached
    block_size: int = 16  # prefix-cache hits are whole blocks
    seed: int = 0


FULL = {"prompt": Lengths(1200, 1.0, 16, 16384), "decode": Lengths(250, 0.8, 1, 4096),
        "budget": 2048, "max_seqs": 256, "steps": 300, "block_size": 16}
TINY = {"prompt": Lengths(40, 0.8, 2, 256), "decode": Lengths(6, 0.6, 1, 24),
        "budget": 64, "max_seqs": 8, "steps": 40, "block_size": 4}
"""Defaults of the full run and of --tiny (tiny model dims, short prompts: a CPU run)."""


@dataclass
class Request:
    """A request's lengths and progress; ``computed`` = tokens in the KV cache."""

    request_id: str
    arrival: int  # the step it arrived at
    prompt_len: int
    decode_len: int
    cached: int  # prompt tokens found in the prefix cache when admitted (0: no hit)
    computed: int = 0
    decoded: int = 0

    @property
    def prefilled(self) -> bool:
        return self.computed >= self.prompt_len

    @property
    def done(self) -> bool:
        return self.decoded >= self.decode_len


@dataclass(frozen=True)
class Chunk:
    """One request's share of a step: ``query_len`` new tokens after ``context_len`` cached ones.

    ``prompt`` says whether the tokens are prompt tokens (a prefill chunk) or one decode token.
    """

    request_id: str
    query_len: int
    context_len: int
    prompt: bool


@dataclass(frozen=True)
class Admission:
    """A request as it was admitted: its lengths and the prompt tokens found in the prefix cache."""

    request_id: str
    prompt_len: int
    decode_len: int
    cached: int  # 0: no prefix-cache hit


@dataclass(frozen=True)
class Step:
    """One scheduler step: its chunks in scheduling order (decodes first) and its bookkeeping."""

    index: int
    chunks: tuple[Chunk, ...]
    arrived: int = 0  # requests that arrived for this step
    admitted: tuple[Admission, ...] = ()  # requests admitted in this step (their first chunk is in it)
    finished: tuple[str, ...] = ()  # requests whose last decode ran in this step

    def batch_spec(self) -> BatchSpec | None:
        """The step as the runtime's batch (one-token requests first, as vLLM orders them); None when idle."""
        if not self.chunks:
            return None
        ordered = sorted(self.chunks, key=lambda c: c.query_len != 1)  # stable: keeps the order otherwise
        return BatchSpec(tuple(RequestSpec(c.request_id, c.query_len, c.context_len) for c in ordered))

    @property
    def kind(self) -> str:
        """The batch kind (``prefill``, ``decode``, ``mixed``, ``chunked``) or ``idle``."""
        spec = self.batch_spec()
        return "idle" if spec is None else spec.kind

    @property
    def tokens(self) -> int:
        return sum(c.query_len for c in self.chunks)

    @property
    def prefill_tokens(self) -> int:
        """Tokens of requests with more than one new token (what the runtime treats as prefill)."""
        return sum(c.query_len for c in self.chunks if c.query_len > 1)

    @property
    def decode_tokens(self) -> int:
        return sum(1 for c in self.chunks if c.query_len == 1)

    @property
    def gate_fused(self) -> bool:
        """The old pure-prefill gate: prefill tokens, no decode token, no prefill with cached context."""
        return self.kind == "prefill"


def generate_schedule(cfg: TraceConfig) -> list[Step]:
    """The ``cfg.steps`` steps of a continuous-batching schedule; the same config gives the same steps."""
    rng = random.Random(cfg.seed)
    waiting: deque[Request] = deque()
    running: list[Request] = []
    next_arrival = rng.expovariate(cfg.rate) if cfg.rate > 0 else math.inf
    n_requests = 0
    steps = []
    for index in range(cfg.steps):
        arrived = 0
        while next_arrival < index + 1:  # Poisson process: exponential gaps between arrivals
            prompt_len = cfg.prompt.sample(rng)
            decode_len = cfg.decode.sample(rng)
            cached = 0
            if cfg.prefix_hit_rate > 0 and rng.random() < cfg.prefix_hit_rate:
                # whole blocks, at least one prompt token left to compute (as in vLLM)
                cached = cfg.block_size * int(rng.uniform(0.25, 1.0) * (prompt_len - 1) / cfg.block_size)
            waiting.append(Request(f"req{n_requests}", index, prompt_len, decode_len, cached))
            n_requests += 1
            arrived += 1
            next_arrival += rng.expovariate(cfg.rate)

        budget = cfg.budget
        chunks: list[Chunk] = []
        for r in running:  # decodes first, one token each
            if budget and r.prefilled:
                chunks.append(Chunk(r.request_id, 1, r.computed, prompt=False))
                budget -= 1
        for r in running:  # then the next chunks of partially prefilled requests, in admission order
            if budget and not r.prefilled:
                chunks.append(Chunk(r.request_id, min(r.prompt_len - r.computed, budget), r.computed, prompt=True))
                budget -= chunks[-1].query_len
        admitted = []
        while waiting and len(running) < cfg.max_seqs and budget:  # then new requests, first come first served
            r = waiting.popleft()
            r.computed = r.cached
            admitted.append(Admission(r.request_id, r.prompt_len, r.decode_len, r.cached))
            running.append(r)
            chunks.append(Chunk(r.request_id, min(r.prompt_len - r.computed, budget), r.computed, prompt=True))
            budget -= chunks[-1].query_len

        by_id = {r.request_id: r for r in running}
        for c in chunks:  # the step has run: advance every scheduled request
            by_id[c.request_id].computed += c.query_len
            by_id[c.request_id].decoded += 0 if c.prompt else 1
        finished = tuple(r.request_id for r in running if r.done)
        running = [r for r in running if not r.done]
        steps.append(Step(index, tuple(chunks), arrived, tuple(admitted), finished))
    return steps


def pure_prefill_gate_fraction(steps: list[Step]) -> float | None:
    """Fraction of prefill tokens in steps the old gate fuses (None without prefill tokens)."""
    total = sum(s.prefill_tokens for s in steps)
    return sum(s.prefill_tokens for s in steps if s.gate_fused) / total if total else None


def schedule_stats(steps: list[Step]) -> dict:
    """Counts and means of a schedule (requests, steps and prefill tokens by kind, budget use)."""
    admitted = [a for s in steps for a in s.admitted]
    hits = [a for a in admitted if a.cached]
    by_kind = Counter(s.kind for s in steps)
    prefill_by_kind = Counter()
    for s in steps:
        prefill_by_kind[s.kind] += s.prefill_tokens
    busy = [s for s in steps if s.chunks]
    return {
        "requests_arrived": sum(s.arrived for s in steps),
        "requests_admitted": len(admitted),
        "requests_finished": sum(len(s.finished) for s in steps),
        "mean_prompt_len": statistics.fmean(a.prompt_len for a in admitted) if admitted else None,
        "max_prompt_len": max((a.prompt_len for a in admitted), default=None),
        "mean_decode_len": statistics.fmean(a.decode_len for a in admitted) if admitted else None,
        "prefix_hits": len(hits),
        "prefix_cached_tokens": sum(a.cached for a in hits),
        "steps_by_kind": {k: by_kind.get(k, 0) for k in ("prefill", "decode", "mixed", "chunked", "idle")},
        "prefill_tokens_by_kind": {k: prefill_by_kind.get(k, 0) for k in ("prefill", "mixed", "chunked")},
        "prefill_tokens": sum(s.prefill_tokens for s in steps),
        "decode_tokens": sum(s.decode_tokens for s in steps),
        "prompt_chunks_with_context": sum(1 for s in steps for c in s.chunks if c.prompt and c.context_len),
        "mean_tokens_per_busy_step": statistics.fmean(s.tokens for s in busy) if busy else 0.0,
    }


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


@torch.no_grad()
def time_step(variants: dict, spec: BatchSpec, hidden_size: int, device: str, *, warmup: int, repeats: int,
              seed: int) -> dict:
    """CUDA only: median ms of one call of each variant (name -> compiled model) on ``spec``.

    Each variant gets ``warmup`` untimed then ``repeats`` timed calls, each
    on its own seeded inputs (made before timing) and from the KV caches as
    they were on entry (restored outside the timed region, and on return).
    """
    start = runtime.snapshot_kv_caches()
    inputs = [demo.dynamic_inputs(spec, hidden_size, device, seed + n) for n in range(warmup + repeats)]
    ms = {name: demo.median_call_ms(model, spec, inputs, warmup, start, device) for name, model in variants.items()}
    runtime.restore_kv_caches(start)
    return ms


@dataclass
class TraceRun:
    """What :func:`run_trace` measured: per-step token counter deltas, totals, the pass report, timings."""

    layers: int
    per_step: list  # per step: token_delta(...), or None for an idle step
    totals: dict  # sum_deltas(per_step): the counted calls only (not the prefix fills, not the timed calls)
    report: dict
    timings: list = field(default_factory=list)  # per busy step: {"step", "unfused_ms", "fused_ms"} (cuda)


def run_trace(steps: list[Step], *, model_name: str, tiny: bool, device: str, layers: int,
              timing: bool = False, warmup: int = 3, repeats: int = 10) -> TraceRun:
    """Run the steps in order through ``model_name`` compiled with the pass, counting tokens per step.

    Before each step the prefix hits' cached prefixes are filled (eagerly);
    with ``timing`` (CUDA) the step is timed with vs without the pass; then it
    runs once through the model with the pass, and only that call is counted.
    Finished requests are dropped from the KV caches after their last step.
    """
    token_counters()  # fails early, before any compile, without the counters
    model = demo.build_model(model_name, tiny=tiny, device=device, layers=layers)
    try:
        hidden_size = model.norms[0].normalized_shape[0]
        fusion = FusionPass()
        # No FX graph cache: a cache hit would reuse a graph without running the pass (no report).
        fused = torch.compile(model, options={"post_grad_custom_post_pass": fusion, "fx_graph_cache": False})
        variants = {}
        if timing:
            variants = {"unfused": torch.compile(model, options={"fx_graph_cache": False}), "fused": fused}
        run = TraceRun(len(model.layers), [], {}, {})
        runtime.clear_kv_caches()
        for step in steps:
            spec = step.batch_spec()
            if spec is None:
                run.per_step.append(None)
                continue
            fill_prefix_hits(model, step, hidden_size, device)
            if timing:
                ms = time_step(variants, spec, hidden_size, device, warmup=warmup, repeats=repeats,
                               seed=1_000_000 * (step.index + 1))
                run.timings.append({"step": step.index, "unfused_ms": ms["unfused"], "fused_ms": ms["fused"]})
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
# Results
# --------------------------------------------------------------------------


def results_json(cfg: TraceConfig, steps: list[Step], run: TraceRun | None, *, model: str, tiny: bool,
                 device: str, layers: int, timing_note: str | None) -> dict:
    """The JSON document (see bench/README.md); ``run`` is None with --schedule-only."""
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
    timing: dict = {"skipped": timing_note}
    if run is not None and run.timings:
        unfused = sum(t["unfused_ms"] for t in run.timings)
        fused = sum(t["fused_ms"] for t in run.timings)
        timing = {"skipped": None, "what": "one call of the compiled attention stack per step, "
                  "without vs with the pass; CUDA events, median of repeats after warm-up",
                  "total_unfused_ms": unfused, "total_fused_ms": fused, "speedup": unfused / fused,
                  "per_step": [{**t, "speedup": t["unfused_ms"] / t["fused_ms"]} for t in run.timings]}
    return {
        "budget": cfg.budget,
        "steps": cfg.steps,
        "prefill_tokens": stats["prefill_tokens"],
        "fused_fraction": {"pure_prefill_gate": pure_prefill_gate_fraction(steps), "this": this},
        "config": {"model": model, "tiny": tiny, "device": device, "layers": layers, "seed": cfg.seed,
                   "rate": cfg.rate, "max_seqs": cfg.max_seqs, "prefix_hit_rate": cfg.prefix_hit_rate,
                   "block_size": cfg.block_size, "prompt_len": asdict(cfg.prompt), "decode_len": asdict(cfg.decode)},
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
        lines.append("  this guard         not measured (--schedule-only)")
    else:
        post = ", ".join(f"{k}={v / counters['layers']:g}" for k, v in sorted(counters["post_quantized"].items()))
        lines.append(f"  this guard         {frac(f['this'])}   (tokens quantized after attention: {post or 'none'})")
        if counters["mismatched_steps"]:
            lines.append(f"  warning: the counters' prefill tokens differ from the schedule's at steps "
                         f"{counters['mismatched_steps'][:10]}")
        p = doc["pass"]
        lines.append(f"pass: {p['rewritten']} of {p['candidates']} attention nodes rewritten in {p['graphs']} graphs"
                     + (f", refused {p['refused']}" if p["refused"] else ""))
    t = doc["timing"]
    if t["skipped"]:
        lines.append(f"timing: skipped ({t['skipped']})")
    else:
        lines.append(f"timing: {t['total_unfused_ms']:.1f} ms without the pass, {t['total_fused_ms']:.1f} ms with it, "
                     f"over {len(t['per_step'])} steps: {t['speedup']:.3f}x ({t['what']})")
    return "\n".join(lines)


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
                        help="where the model runs (default cpu); cuda also times every step")
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
    parser.add_argument("--warmup", type=int, default=3,
                        help="cuda timing: untimed calls per step and variant (default 3)")
    parser.add_argument("--repeats", type=int, default=10,
                        help="cuda timing: timed calls per step and variant (default 10)")
    parser.add_argument("--workspace-tokens", type=int, metavar="N",
                        help="context workspace bound of the fused path, in tokens (default: "
                             "$FUSION_PASS_CONTEXT_WORKSPACE_TOKENS or 65536); a small N sends chunked prefills "
                             "through the chunked log-sum-exp merge (fa4 / triton backends)")
    parser.add_argument("--schedule-only", action="store_true",
                        help="only generate the schedule and the pure-prefill gate's fraction (no model, no counters)")
    parser.add_argument("--json", metavar="PATH", type=Path, help="write the results as JSON to PATH")
    args = parser.parse_args(argv)
    for name in ("budget", "steps", "max_seqs", "layers", "repeats", "workspace_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.warmup < 0 or args.rate < 0 or not 0 <= args.prefix_hit_rate <= 1:
        parser.error("--warmup and --rate must be >= 0, --prefix-hit-rate in [0, 1]")
    for name in ("prompt_mean", "decode_mean"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
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
    steps = generate_schedule(cfg)
    run = None
    if args.schedule_only:
        note = "--schedule-only: the model was not run"
    else:
        note = None if args.device == "cuda" else "CPU run: timing needs --device cuda (CUDA events)"
        try:
            with settings.use_context_workspace_tokens(args.workspace_tokens):
                run = run_trace(steps, model_name=args.model, tiny=args.tiny, device=args.device,
                                layers=args.layers, timing=args.device == "cuda", warmup=args.warmup,
                                repeats=args.repeats)
        except MissingTokenCounters as exc:
            print(f"serving_trace.py: {exc}", file=sys.stderr)
            return 2
    doc = results_json(cfg, steps, run, model=args.model, tiny=args.tiny, device=args.device, layers=args.layers,
                       timing_note=note)
    with settings.use_context_workspace_tokens(args.workspace_tokens):
        doc["config"]["context_workspace_tokens"] = settings.context_workspace_tokens()
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    print(summary(doc))
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
