"""The serving trace's schedule: a continuous-batching scheduler shaped like vLLM V1's, in pure Python.

Requests arrive as a Poisson process with log-normal prompt and decode lengths (clipped); each step has a
token budget: one decode token per running request whose prompt is done, then the next chunk of each
partially prefilled request, then new requests first come first served (at most ``max_seqs`` running); a
prompt longer than what is left of the budget is chunked. A new request may find a block-aligned part of its
prompt in the prefix cache. Deterministic per seed.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import Counter, deque
from dataclasses import dataclass

from fusion_pass.runtime import BatchSpec, RequestSpec

__all__ = ["FULL", "TINY", "Admission", "Chunk", "Lengths", "Request", "Step", "TraceConfig", "generate_schedule",
           "pure_prefill_gate_fraction", "schedule_stats"]


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
