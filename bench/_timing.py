"""Timing shared by the benches: GPU time per call by CUDA-graph replay, host time per call, eager CUDA events.

* :func:`graph_replay_ms`: ``calls`` calls of ``fn`` captured in one CUDA graph, the graph replayed
  ``replays`` times, each replay timed by CUDA events; one sample per replay, in ms per call. What a
  server running the calls under CUDA graphs sees: no host cost, no launch gaps.
* :func:`graph_replay_interleaved_ms`: several functions, one graph each, replayed in rounds (one replay of
  each a round, the order rotated): clock and L2 drift shared by all of them, for ratios between them.
* :func:`host_us`: ``time.perf_counter`` around each call, no synchronization inside the timed
  region: the host's cost of launching (argument handling, checks, the launch itself), in us per call.
* :func:`event_ms`: CUDA events around eager calls (GPU time with the launch gaps a host-bound
  caller leaves).
* :func:`cpu_ms`: wall time of synchronous calls (CPU runs: the whole call).

Statistics (:func:`median`, :func:`percentile`, :func:`distribution`) are pure Python.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Sequence

import torch

__all__ = ["GraphCaptureError", "L2_POLICY", "calls_for", "cpu_ms", "distribution", "event_ms", "graph_replay_ms",
           "graph_replay_interleaved_ms", "host_us", "median",
           "percentile"]

L2_POLICY = ("L2 not flushed between calls or replays; inputs rotate among input sets (3 sets when one set is "
             "smaller than 3x the 50 MiB L2, else 1), so consecutive calls read different inputs")


def median(xs: Sequence[float]) -> float | None:
    """The median of ``xs`` (None when empty)."""
    return statistics.median(xs) if xs else None


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``xs`` by linear interpolation between order statistics (None when empty)."""
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q must be in [0, 100], got {q}")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def distribution(xs: Sequence[float]) -> dict:
    """``{"n", "min", "p10", "median", "p90", "max"}`` of ``xs`` (values None when empty)."""
    return {"n": len(xs), "min": min(xs) if xs else None, "p10": percentile(xs, 10), "median": median(xs),
            "p90": percentile(xs, 90), "max": max(xs) if xs else None}


def calls_for(estimate_ms: float, target_ms: float, most: int = 200) -> int:
    """How many calls of ``estimate_ms`` each fill about ``target_ms`` (at least 1, at most ``most``)."""
    if estimate_ms <= 0 or not math.isfinite(estimate_ms):
        return most
    return max(1, min(most, round(target_ms / estimate_ms)))


def event_ms(fn: Callable[[], object], *, repeats: int, warmup: int = 1,
             before: Callable[[int], object] | None = None) -> list[float]:
    """CUDA events around each of ``repeats`` eager calls of ``fn`` (after ``warmup`` untimed ones), in ms.

    ``before(i)``, when given, runs before call ``i`` (of ``warmup + repeats``) outside the timed region
    (e.g. to write fresh inputs)."""
    samples = []
    for i in range(warmup + repeats):
        if before is not None:
            before(i)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            samples.append(start.elapsed_time(end))
    return samples


def graph_replay_ms(fn: Callable[[], object], *, calls: int, replays: int, warmup: int = 2) -> list[float]:
    """GPU ms per call: ``calls`` calls of ``fn`` captured in one CUDA graph, replayed ``replays`` times.

    ``fn`` must already have run once eagerly (compiled, autotuned) and must not synchronize. It is run
    ``warmup`` times on the capture stream first (as torch.cuda.graphs asks), then captured. One sample
    per replay: the replay's CUDA-event time divided by ``calls``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()  # the first replay uploads the graph
    torch.cuda.synchronize()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    del graph
    torch.cuda.synchronize()
    return samples


class GraphCaptureError(RuntimeError):
    """A function of :func:`graph_replay_interleaved_ms` could not be captured: ``name`` and the ``cause``."""

    def __init__(self, name: str, cause: BaseException):
        super().__init__(f"{name}: {type(cause).__name__}: {cause}")
        self.name, self.cause = name, cause


def graph_replay_interleaved_ms(fns: dict[str, Callable[[], object]], *, replays: int,
                                warmup: int = 2) -> dict[str, list[float]]:
    """GPU ms per call of each of ``fns`` (name -> callable, each already run once eagerly, none synchronizing):
    each captured in its own CUDA graph (after ``warmup`` runs on the capture stream), then replayed in rounds,
    one replay of every graph per round, the order rotated each round, so that clock and L2 drift fall on every
    variant alike. ``{name: [replays samples]}``. A capture that fails raises :class:`GraphCaptureError` naming
    the function (the caller times eagerly)."""
    graphs = {}
    try:
        for name, fn in fns.items():
            try:
                graphs[name] = _captured(fn, warmup)
            except Exception as exc:
                raise GraphCaptureError(name, exc) from exc
        torch.cuda.synchronize()
        names = list(graphs)
        samples = {name: [] for name in names}
        for r in range(replays):
            for name in names[r % len(names):] + names[:r % len(names)]:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graphs[name].replay()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end))
        return samples
    finally:
        graphs.clear()
        torch.cuda.synchronize()


def _captured(fn: Callable[[], object], warmup: int):
    """``fn`` run ``warmup`` times on a side stream, then captured in a CUDA graph, uploaded by one replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()  # the first replay uploads the graph
    return graph


def host_us(fn: Callable[[], object], *, calls: int, sync_every: int = 25, cuda: bool = True) -> list[float]:
    """Host us per call: ``time.perf_counter`` around each of ``calls`` calls, no synchronization inside.

    The device is synchronized before the first call and every ``sync_every`` calls (outside the timed
    region), so the launch queue never fills and blocks a launch."""
    samples = []
    for i in range(calls):
        if cuda and i % sync_every == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    if cuda:
        torch.cuda.synchronize()
    return samples


def cpu_ms(fn: Callable[[], object], *, repeats: int, warmup: int = 1) -> list[float]:
    """Wall ms of each of ``repeats`` synchronous calls (after ``warmup``): CPU runs."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def cycling(fns):
    """One callable that calls ``fns`` in turn, one per call."""
    turn = [0]

    def call():
        fns[turn[0] % len(fns)]()
        turn[0] += 1

    return call
