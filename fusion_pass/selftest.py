"""``fusion-pass selftest``: the first thing to run on a new GPU.

:func:`run_selftest` returns one report (a JSON-ready dict); :func:`format_report` prints it; ``report["exit_code"]``
is the command's exit code. On a CUDA device it

1. runs the canary of every backend that is available and offers one (``self_check_needed`` + ``canary``,
   today :class:`fusion_pass.runtime.backends.fa4.FA4Backend`) through
   :func:`fusion_pass.runtime.self_check.run_self_check`, for each head-dim pair of its kernels on the device
   (its ``canary_head_dims``; fa4: :func:`fusion_pass.kernels.fa4.forward.supported_head_dims`) and each dtype asked
   for;
2. times a few prefill shapes (:data:`SHAPES`): each fused backend of :data:`TIMED_BACKENDS` against FA4's bf16
   forward + :func:`fusion_pass.kernels.quantize` and cuDNN SDPA + the same quantizer (:func:`measure_shape`);
3. gives one verdict per backend: ``correct`` / ``FAILED (...)`` / ``no canary``, and ``faster`` / ``slower``
   than the best unfused path on the measured shapes (:func:`verdicts`).

Without a CUDA device it runs nothing and reports what it would check (``would_check``) and why not: exit code 0
when no device was asked for (or the CPU was), 3 when the device asked for (``cuda``, ``cuda:N``) is not on this
machine (``"passed": false``, ``"device_missing": true``), so that a CI gate asking for a GPU never reads success.
The device, the backends, the canary runner and the timing are parameters, so that the logic runs on the CPU
with stand-ins (tests).
"""

from __future__ import annotations

import math
import statistics
import textwrap
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch

from fusion_pass.kernels.fa4 import forward as fa4_forward
from fusion_pass.runtime import self_check
from fusion_pass.runtime.backends import registry, selection

__all__ = ["CANARY_HEADS", "DTYPES", "canary_kv_heads", "PATHS", "SHAPES", "TIMED_BACKENDS", "Shape", "canary_head_dims",
           "canary_generations", "format_report", "gpu_time_ms", "has_canary", "measure_shape", "run_canaries", "run_selftest",
           "run_timings", "verdicts", "would_check"]

CANARY_HEADS = 16
"""Query heads of the layer each canary stands for; its key/value heads: :func:`canary_kv_heads`."""


def canary_kv_heads(head_dims) -> int:
    """Key/value heads of the layer a canary stands for: MLA's (192, 128) attends per query head (16 on 16),
    the standard head dims stand for GQA with 4 query heads per KV head (16 on 4). The canary itself runs that
    many query heads per KV head (the kernels compile per group size) on 2 KV heads."""
    return CANARY_HEADS if tuple(head_dims) == (192, 128) else CANARY_HEADS // 4

"""Query heads of a canary configuration (the fa4 canary itself runs 3 heads on 1 KV head)."""
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
TIMED_BACKENDS = registry.timed_names()
"""The fused backends the timing measures: those of the registry with ``timed`` (``reference`` is the float32
oracle, not a fast path)."""
STANDARD_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 128))
"""The pairs tried for a backend with a canary but no list of its own kernels (filtered by its ``supports``)."""
REPEATS = 20
WARMUP = 3
L2_FLUSH_BYTES = 256 * 2**20
GLOBAL_SCALE = 448.0 * 6.0 / 4.0
"""The timing's NVFP4 global scale (448 * 6 / amax for an amax of 4; the value does not change the time)."""
BASELINES = {"fa4+quant": "FA4 + quant", "cudnn+quant": "cuDNN + quant"}
PATHS = {**{f"fused:{name}": f"fused {name}" for name in TIMED_BACKENDS}, **BASELINES}
"""Timed paths: JSON key -> column title."""
TIMING_METHOD = ("GPU time per call: median of N replays of a CUDA graph holding one call (host launch overhead "
                 "excluded; a path that cannot be captured is timed eagerly and noted), each between CUDA events "
                 "after an L2 flush, after a first call (compiles) and {warmup} warm-up calls; fixed-seed randn "
                 "inputs, causal. "
                 "FA4 + quant: FA4's varlen forward in the query dtype + fusion_pass.kernels.quantize (auto). "
                 "cuDNN + quant: torch SDPA under sdpa_kernel(CUDNN_ATTENTION) on the padded batch [B, H, S, D] of "
                 "the equal-length sequences, its output transposed to [T, H*Dv] + the same quantizer. "
                 "speedup = best unfused path / fused (above 1: the fused kernel is faster).").format(warmup=WARMUP)


@dataclass(frozen=True)
class Shape:
    """One timed prefill: ``batch`` causal sequences of ``seqlen`` tokens, ``heads`` query / ``kv_heads`` KV heads."""

    kind: str
    heads: int
    kv_heads: int
    dqk: int
    dv: int
    batch: int
    seqlen: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seqlen

    @property
    def label(self) -> str:
        return f"{self.kind} H={self.heads}/{self.kv_heads} D={self.dqk}/{self.dv} {self.batch}x{self.seqlen}"


SHAPES = tuple(Shape(kind, h, hk, d, dv, b, s)
               for kind, h, hk, d, dv in (("MLA", 16, 16, 192, 128), ("GQA", 32, 8, 128, 128))
               for b, s in ((4, 512), (2, 2048)))
"""DeepSeek-V3's MLA head dims at TP=8 and a Llama-3-8B-style GQA layer; 4 x 512 and 2 x 2048 tokens."""


def has_canary(backend) -> bool:
    """Whether ``backend`` offers a self-check (:mod:`fusion_pass.runtime.self_check`)."""
    return callable(getattr(backend, "self_check_needed", None)) and callable(getattr(backend, "canary", None))


def canary_head_dims(backend, device) -> tuple[tuple[int, int], ...]:
    """The ``(D, Dv)`` pairs whose canary runs for ``backend`` on ``device``: its own ``canary_head_dims(device)``
    where it has one (fa4: its kernels of the device's generation), else the :data:`STANDARD_HEAD_DIMS` its
    ``supports`` accepts."""
    own = getattr(backend, "canary_head_dims", None)
    if callable(own):
        return tuple(own(device))
    return tuple(p for p in STANDARD_HEAD_DIMS if backend.supports(device, torch.bfloat16, CANARY_HEADS, *p)[0])


def canary_generations(backend) -> dict[str, tuple[tuple[int, int], ...]]:
    """The head-dim pairs of ``backend``'s canaries per GPU generation, as a CUDA run would check them: its own
    ``canary_generations`` where it has them, else :data:`STANDARD_HEAD_DIMS` on ``any``."""
    return dict(getattr(backend, "canary_generations", None) or {"any": STANDARD_HEAD_DIMS})


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def run_canaries(device, dtypes: Sequence[torch.dtype], backends, *, head_dims=canary_head_dims,
                 run_check=self_check.run_self_check, progress=None) -> list[dict[str, Any]]:
    """One entry per (backend with a canary and available, dtype, head dims): ``status`` ``passed``,
    ``FAILED`` or ``skipped`` (the backend does not support it), ``detail`` and ``seconds``."""
    results = []
    for backend in backends:
        if not has_canary(backend) or not backend.available()[0]:
            continue
        for dtype in dtypes:
            for d, dv in head_dims(backend, device):
                entry = {"backend": backend.name, "dtype": _dtype_name(dtype), "head_dims": [d, dv],
                         "num_heads": CANARY_HEADS, "num_kv_heads": canary_kv_heads((d, dv))}
                ok, why = backend.supports(device, dtype, CANARY_HEADS, d, dv)
                if not ok:
                    entry.update(status="skipped", detail=why, seconds=0.0)
                else:
                    with warnings.catch_warnings():  # the report says it; run_self_check also logs it
                        warnings.simplefilter("ignore", RuntimeWarning)
                        result = run_check(backend, device, dtype, CANARY_HEADS, d, dv, canary_kv_heads((d, dv)))
                    entry.update(status="passed" if result.passed else "FAILED", detail=result.detail,
                                 seconds=round(result.seconds, 3))
                if progress is not None:
                    progress(f"canary {backend.name} {entry['dtype']} {(d, dv)}: {entry['status']} "
                             f"in {entry['seconds']:.2f} s")
                results.append(entry)
    return results


def gpu_time_ms(fn: Callable[[], object], repeats: int, warmup: int = WARMUP) -> tuple[float, str]:
    """``(median ms, how)``: the GPU time of one ``fn()`` over ``repeats`` replays of a CUDA graph that holds one
    call (``how`` ``"CUDA graph"``: host launch overhead excluded), each between two CUDA events after an L2 flush,
    following ``warmup`` untimed calls (the caller made the first, compiling call). A call that cannot be captured
    is timed eagerly instead, launch overhead included (``how`` says why)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    run, how = fn, "CUDA graph"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except Exception as exc:  # noqa: BLE001 - eager timing still measures it
        torch.cuda.synchronize()
        how = f"eager, launch overhead included (CUDA graph capture failed: {type(exc).__name__}: {exc})"[:300]
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        flush.zero_()
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events), how


def _timed(call: Callable[[], object], repeats: int) -> tuple[float | None, str | None, str | None]:
    """``(ms, None, how)``, or ``(None, why, None)`` when the path cannot run."""
    try:
        call()  # compiles; an error surfaces here, before timing
        torch.cuda.synchronize()
        ms, how = gpu_time_ms(call, repeats)
        return ms, None, how
    except Exception as exc:  # a path that cannot run is a result, not a crash
        return None, f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}", None


def measure_shape(shape: Shape, device, dtype: torch.dtype, fused, repeats: int) -> dict[str, Any]:
    """Time one shape on a CUDA ``device``: every backend of ``fused`` (its ``run_varlen``, the call the run time
    makes) and the unfused baselines. ``{"ms": {path: ms or None}, "errors": {path: why}, "notes": [...]}``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fusion_pass import kernels, nvfp4
    from fusion_pass.kernels import launchers

    device = torch.device(device)
    ms: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    notes: list[str] = []
    how: dict[str, str | None] = {}
    t, n, s = shape.tokens, shape.heads * shape.dv, shape.seqlen
    with torch.cuda.device(device):
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(t, shape.heads, shape.dqk, generator=gen, device=device, dtype=dtype)
        k = torch.randn(t, shape.kv_heads, shape.dqk, generator=gen, device=device, dtype=dtype)
        v = torch.randn(t, shape.kv_heads, shape.dv, generator=gen, device=device, dtype=dtype)
        cu = torch.arange(shape.batch + 1, dtype=torch.int32, device=device) * s
        scale = shape.dqk ** -0.5
        gs = torch.tensor([GLOBAL_SCALE], dtype=torch.float32, device=device)
        packed = torch.empty(t, n // 2, dtype=torch.uint8, device=device)
        scales = torch.empty(nvfp4.scale_shape(t, n), dtype=torch.uint8, device=device)
        calls: dict[str, Callable[[], object]] = {}
        for backend in fused:
            ok, why = backend.supports(device, dtype, shape.heads, shape.dqk, shape.dv)
            if ok:
                calls[f"fused:{backend.name}"] = lambda b=backend: b.run_varlen(q, k, v, cu, s, scale, packed, gs,
                                                                               scales)
            else:
                errors[f"fused:{backend.name}"] = why
        ok, why = fa4_forward.fa4_usable(device, dtype, shape.heads, shape.dqk, shape.dv)
        if ok:
            calls["fa4+quant"] = lambda: kernels.quantize(
                launchers.fa4_attention_varlen(q, k, v, cu, s, causal=True, softmax_scale=scale).view(t, n), gs,
                validate_values=False)
        else:
            errors["fa4+quant"] = why
        for path, call in calls.items():
            ms[path], error, how[path] = _timed(call, repeats)
            if error is not None:
                errors[path] = error
        if not torch.backends.cudnn.is_available():
            errors["cudnn+quant"] = "cuDNN is not available to torch"
        else:
            bq, bk, bv = (x.view(shape.batch, s, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))

            def cudnn(kk, vv, gqa):
                out = torch.nn.functional.scaled_dot_product_attention(bq, kk, vv, is_causal=True, scale=scale,
                                                                       enable_gqa=gqa)
                return kernels.quantize(out.transpose(1, 2).reshape(t, n), gs, validate_values=False)

            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                gqa = shape.kv_heads != shape.heads
                ms["cudnn+quant"], error, how["cudnn+quant"] = _timed(lambda: cudnn(bk, bv, gqa), repeats)
                if error is not None and gqa:  # cuDNN without GQA support: K/V repeated to H heads, untimed
                    group = shape.heads // shape.kv_heads
                    rk, rv = (x.repeat_interleave(group, dim=1) for x in (bk, bv))
                    ms["cudnn+quant"], error, how["cudnn+quant"] = _timed(lambda: cudnn(rk, rv, False), repeats)
                    if error is None:
                        notes.append(f"cuDNN refused enable_gqa at {shape.label}: K/V repeated to {shape.heads} "
                                     "heads before timing")
            if error is not None:
                errors["cudnn+quant"] = error
    notes += [f"{PATHS[path]} at {shape.label} timed {why}" for path, why in how.items()
              if why is not None and why != "CUDA graph"]
    return {"ms": ms, "errors": errors, "notes": notes}


def run_timings(device, dtype: torch.dtype, shapes: Sequence[Shape], fused, repeats: int, *,
                measure=measure_shape, progress=None) -> list[dict[str, Any]]:
    """One row per shape: the shape, ``ms`` per path of :data:`PATHS` (None: not run, ``errors`` says why),
    ``best_unfused`` (the faster baseline) and ``speedup`` per fused backend (best unfused / fused)."""
    rows = []
    for shape in shapes:
        if progress is not None:
            progress(f"timing {shape.label}")
        measured = measure(shape, device, dtype, fused, repeats)
        ms = {path: measured["ms"].get(path) for path in PATHS}
        errors = dict(measured.get("errors", {}))
        base = [(ms[p], p) for p in BASELINES if ms[p] is not None]
        best = min(base) if base else None
        speedup = {}
        for name in TIMED_BACKENDS:
            fused_ms = ms[f"fused:{name}"]
            speedup[name] = None if best is None or not fused_ms else round(best[0] / fused_ms, 4)
        rows.append({"shape": shape.label, **asdict(shape), "tokens": shape.tokens, "dtype": _dtype_name(dtype),
                     "ms": ms, "errors": errors, "notes": list(measured.get("notes", [])),
                     "best_unfused": None if best is None else best[1], "speedup": speedup})
    return rows


def _speed(name: str, timings: list[dict]) -> dict[str, Any]:
    ratios = [row["speedup"][name] for row in timings if row["speedup"].get(name) is not None]
    if not ratios:
        whys = {row["errors"].get(f"fused:{name}") for row in timings} - {None}
        why = "; ".join(sorted(whys)) if whys else ("timing off" if not timings else "no baseline ran")
        return {"speed": "not timed", "geomean": None, "faster_at": 0, "shapes": 0, "text": f"not timed ({why})"}
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    word = "faster" if geomean > 1 else "slower" if geomean < 1 else "as fast as"
    faster_at = sum(r > 1 for r in ratios)
    text = (f"{word} than the best unfused path: {geomean:.2f}x (geometric mean of best unfused / fused), "
            f"faster at {faster_at} of {len(ratios)} shapes")
    return {"speed": word if word != "as fast as" else "same", "geomean": round(geomean, 4), "faster_at": faster_at,
            "shapes": len(ratios), "text": text}


def verdicts(backends: list[dict], canaries: list[dict], timings: list[dict]) -> dict[str, dict[str, Any]]:
    """Per backend: ``correctness`` (``correct``, ``FAILED``, ``no canary``, ``not checked`` or ``unavailable``)
    with its ``detail``, the speed against the best unfused path (:func:`_speed`), and the ``line`` printed."""
    result = {}
    for info in backends:
        name = info["name"]
        ran = [c for c in canaries if c["backend"] == name and c["status"] != "skipped"]
        failed = [c for c in ran if c["status"] == "FAILED"]
        if not info["available"]:
            correctness, detail = "unavailable", info["reason"]
        elif not info["canary"]:
            correctness, detail = "no canary", "this backend offers no self-check"
        elif failed:
            correctness = "FAILED"
            detail = "; ".join(f"{c['dtype']} head dims {tuple(c['head_dims'])}: {c['detail']}" for c in failed)
        elif not ran:
            correctness, detail = "not checked", "no canary configuration runs on this device"
        else:
            correctness, detail = "correct", f"{len(ran)} of {len(ran)} canary configurations passed"
        speed = _speed(name, timings) if name in TIMED_BACKENDS and info["available"] else {
            "speed": "not timed", "geomean": None, "faster_at": 0, "shapes": 0,
            "text": "not timed (" + ("unavailable" if not info["available"] else
                                     f"the timing covers {' and '.join(TIMED_BACKENDS)}") + ")"}
        result[name] = {"correctness": correctness, "detail": detail, **speed,
                        "line": f"{correctness} ({detail}); {speed['text']}"}
    return result


def would_check(backends: list[dict], dtypes: Sequence[torch.dtype], shapes: Sequence[Shape],
                timing: bool, repeats: int, generations: dict[str, dict] | None = None) -> dict[str, Any]:
    """What a CUDA run would do: canary configurations per backend and GPU generation (``generations``: backend
    name -> :func:`canary_generations`; default :data:`STANDARD_HEAD_DIMS` on ``any``), the timed shapes."""
    canaries = []
    for info in backends:
        if not info["canary"]:
            continue
        for generation, dims in (generations or {}).get(info["name"], {"any": STANDARD_HEAD_DIMS}).items():
            canaries.append({"backend": info["name"], "generation": generation, "head_dims": [list(p) for p in dims],
                             "dtypes": [_dtype_name(d) for d in dtypes], "num_heads": CANARY_HEADS})
    timed = {"dtype": _dtype_name(dtypes[0]), "repeats": repeats, "paths": list(PATHS.values()),
             "shapes": [s.label for s in shapes]} if timing else None
    return {"canaries": canaries, "no_canary": [b["name"] for b in backends if not b["canary"]], "timing": timed}


def _missing_device(device: torch.device, cuda: bool) -> str | None:
    """Why the CUDA ``device`` asked for is not on this machine (no CUDA, or an index past the device count), or
    None."""
    if device.type != "cuda":
        return None
    if not cuda:
        return f"--device {device} was asked for but torch sees no CUDA device"
    if device.index is not None and torch.cuda.is_available() and device.index >= torch.cuda.device_count():
        return f"--device {device} was asked for but this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def _not_here(device: torch.device, cuda: bool) -> str | None:
    if not cuda:
        return "no CUDA device (torch.cuda.is_available() is False)"
    if device.type != "cuda":
        return f"--device {device}: the fused kernels run on CUDA devices only"
    return None


def run_selftest(device=None, *, dtypes: Sequence[torch.dtype] = tuple(DTYPES.values()), timing: bool = True,
                 repeats: int = REPEATS, shapes: Sequence[Shape] = SHAPES, backends=None, cuda: bool | None = None,
                 head_dims=canary_head_dims, run_check=self_check.run_self_check, measure=measure_shape,
                 progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The whole self-test (module docstring). ``backends``: backend objects (default: every backend of
    :data:`fusion_pass.runtime.backends.registry.BACKENDS`); ``cuda``: whether CUDA runs (default: torch's
    answer); ``head_dims``, ``run_check`` and ``measure`` replace :func:`canary_head_dims`,
    :func:`fusion_pass.runtime.self_check.run_self_check` and :func:`measure_shape`."""
    asked = device is not None
    device = selection.default_device() if device is None else torch.device(device)
    backends = list(registry.BACKENDS if backends is None else backends)
    cuda = torch.cuda.is_available() if cuda is None else cuda
    dtypes = tuple(dtypes)
    info = []
    for backend in backends:
        ok, why = backend.available()
        info.append({"name": backend.name, "available": ok, "reason": why, "canary": has_canary(backend)})
    generations = {backend.name: canary_generations(backend) for backend in backends}
    report: dict[str, Any] = {"device": str(device), "cuda": False, "gpu": None, "dtypes": [_dtype_name(d) for d in dtypes],
                              "backends": info, "canaries": [], "timings": [], "timing_method": None, "verdicts": {}}
    missing = _missing_device(device, cuda) if asked else None
    if missing is not None:  # a device asked for and not here: nothing checked, never a success
        report.update(reason=missing, device_missing=True,
                      would_check=would_check(info, dtypes, shapes, timing, repeats, generations), passed=False,
                      exit_code=3)
        return report
    reason = _not_here(device, cuda)
    if reason is not None:
        report.update(reason=reason, would_check=would_check(info, dtypes, shapes, timing, repeats, generations),
                      passed=True, exit_code=0)
        return report
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        report["gpu"] = f"{torch.cuda.get_device_name(device)}, sm_{major}{minor}"
    with warnings.catch_warnings():  # CuTe DSL warns at every FA4 forward call that its AuxData is no JitArgument
        warnings.filterwarnings("ignore", message=".*cannot be converted to a JitArgument", category=UserWarning)
        canaries = run_canaries(device, dtypes, backends, head_dims=head_dims, run_check=run_check,
                                progress=progress)
        failed = {c["backend"] for c in canaries if c["status"] == "FAILED"}
        timings = []
        if timing:
            fused = [b for b in backends if b.name in TIMED_BACKENDS and b.available()[0] and b.name not in failed]
            timings = run_timings(device, dtypes[0], shapes, fused, repeats, measure=measure, progress=progress)
    for row in timings:
        for name in failed & set(TIMED_BACKENDS):
            row["errors"][f"fused:{name}"] = "its canary failed"
    if timing:
        report["timing_method"] = TIMING_METHOD.replace("N replays", f"{repeats} replays")
    ran = any(c["status"] in ("passed", "FAILED") for c in canaries)
    passed = ran and not failed
    report.update(cuda=True, canaries=canaries, timings=timings, verdicts=verdicts(info, canaries, timings),
                  passed=passed, exit_code=0 if passed else (1 if failed else 3))
    return report


def _fmt_ms(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _dims(pairs) -> str:
    return ", ".join(f"({d}, {dv})" for d, dv in pairs)


def format_report(report: dict[str, Any]) -> str:
    """The report as the text ``fusion-pass selftest`` prints."""
    lines = []
    if not report["cuda"]:
        plan = report["would_check"]
        lines += [f"fusion-pass selftest on {report['device']}: cannot run here: {report['reason']}", "",
                  "On a CUDA device it would check:",
                  f"  canaries ({', '.join(report['dtypes'])}; a layer of {CANARY_HEADS} query heads on "
                  f"{canary_kv_heads((192, 128))} KV heads for (192, 128), on {canary_kv_heads((128, 128))} for the "
                  "other head dims): the fused kernel's NVFP4 bytes against its unfused twin's, every byte"]
        for c in plan["canaries"]:
            lines.append(f"    {c['backend']} on {c['generation']}: head dims {_dims(c['head_dims'])}")
        for name in plan["no_canary"]:
            lines.append(f"    {name}: no canary")
        if plan["timing"] is None:
            lines.append("  timing: off (--no-timing)")
        else:
            t = plan["timing"]
            lines.append(f"  timing ({t['dtype']}, GPU time per call, median of {t['repeats']} CUDA-graph replays): {', '.join(t['paths'])} on")
            lines += [f"    {label}" for label in t["shapes"]]
        lines += ["", "backends here:"]
        lines += [f"  {b['name']:<10} {'available' if b['available'] else 'unavailable':<12} {b['reason']}"
                  for b in report["backends"]]
        lines += ["", f"exit code {report['exit_code']}: nothing ran" + (
            ": the device asked for is not here" if report.get("device_missing") else "")]
        return "\n".join(lines)
    lines += [f"fusion-pass selftest on {report['device']}" + (f" ({report['gpu']})" if report["gpu"] else ""), "",
              "canaries (the fused kernel's NVFP4 bytes against its unfused twin's; the first run of a "
              "configuration compiles both kernels):"]
    for c in report["canaries"]:
        lines.append(f"  {c['backend']:<10} {c['dtype']:<9} {str(tuple(c['head_dims'])):<11} "
                     f"{c['num_heads']}/{c['num_kv_heads']:<3} {c['status']:<7} {c['seconds']:7.2f} s  {c['detail']}")
    for b in report["backends"]:
        if not b["canary"]:
            lines.append(f"  {b['name']:<10} no canary")
        elif not b["available"]:
            lines.append(f"  {b['name']:<10} not run: unavailable ({b['reason']})")
    if report["timings"]:
        titles = list(PATHS.values()) + [f"x {name}" for name in TIMED_BACKENDS]
        lines += ["", f"timing ({report['timings'][0]['dtype']}, ms per call; x NAME = best unfused / fused NAME):",
                  f"  {'shape':<30}" + "".join(f"{t:>15}" for t in titles)]
        missing: dict[tuple[str, str], list[str]] = {}
        for row in report["timings"]:
            cells = [_fmt_ms(row["ms"][p]) for p in PATHS] + [
                "-" if row["speedup"][n] is None else f"{row['speedup'][n]:.2f}x" for n in TIMED_BACKENDS]
            lines.append(f"  {row['shape']:<30}" + "".join(f"{c:>15}" for c in cells))
            for path, why in row["errors"].items():
                missing.setdefault((PATHS.get(path, path), why), []).append(row["shape"])
        lines += textwrap.wrap(f"method: {report['timing_method']}", 116, initial_indent="  ",
                               subsequent_indent="    ")
        every = len(report["timings"])
        lines += [f"  not run: {path} at " + ("every shape" if len(where) == every else ", ".join(where)) + f": {why}"
                  for (path, why), where in missing.items()]
        lines += [f"  note: {note}" for row in report["timings"] for note in row["notes"]]
    lines += ["", "verdicts:"]
    lines += [f"  {name:<10} {v['line']}" for name, v in report["verdicts"].items()]
    lines += ["", f"exit code {report['exit_code']}: " + {
        0: "every canary passed", 1: "a canary FAILED: that backend is not safe on this GPU",
        3: "no canary ran: no available backend has one on this GPU, nothing was checked"}[report["exit_code"]]]
    return "\n".join(lines)
