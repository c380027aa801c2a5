"""Attention -> NVFP4 on the GPU: the fused kernel against the unfused path and cuDNN + quant.

One command, one run: for each shape (MLA with qk/v head dims 192/128 at 16
and at 128 heads, MHA 128/128 at 32 heads; Hkv = H; batches of 32 x 512,
8 x 2048 and 2 x 8192 tokens; causal; bf16) it times

  fused         flash_attention_nvfp4: attention with the NVFP4 output written
                by the kernel epilogue (packed uint8 + swizzled fp8 scales);
  unfused       flash_attention (bf16 output) + nvfp4_quant.quantize_launch of it;
  cuDNN + quant torch SDPA with the cuDNN backend on [B, H, S, D] views,
                transpose/reshape of its output to [T, H*Dv], then the same
                quantize (the transpose/reshape is inside the timed region);

  FA4 fused     fusion_pass.kernels.fa4_attention_nvfp4_varlen: FlashAttention-4's
                SM90 kernel with our NVFP4 epilogue (needs the fa4 extra and an SM90 GPU);
  FA4 + quant   FA4's own varlen forward (bf16, fa4_attention_varlen) + the same quantize;
  FA4 attn      FA4's bf16 forward alone;

and the attention alone (flash_attention, cuDNN SDPA) with its TFLOP/s, the
peak memory of one fused and one unfused call, the quantizer alone on a
[16384, 16384] bf16 tensor (TB/s, next to a device-to-device copy as the
memory-bandwidth ceiling), and evaluates the targets of the issue.

Times are medians of triton.testing.do_bench (CUDA events, L2 flushed before
each repetition) after warm-up, on fixed-seed randn inputs. Causal attention
FLOPs per sequence of length S: 2 * H * S*(S+1)/2 * (Dqk + Dv).

Outputs: a table on stdout (printed last), DIR/attention_bench.json (every
number, raw timing samples included), DIR/attention_bench.png (needs
matplotlib; skipped with a message if it is missing), and the section between
<!-- attention-bench:begin --> and <!-- attention-bench:end --> in
docs/benchmarks.md (text outside the markers is kept).

    python bench/attention.py [--out DIR] [--quick] [--docs docs/benchmarks.md | --no-docs]

Needs a CUDA GPU (exit code 2 without one) and fusion_pass.kernels. Exit code
1 if one of our kernels raised (the error is in the JSON and the table says
"error"); targets that are not met do not change the exit code.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import shlex
import statistics
import sys
import traceback
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, NamedTuple

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("fusion_pass") is None:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

from fusion_pass import nvfp4  # noqa: E402
from fusion_pass.nvfp4 import round_up  # noqa: E402

# --------------------------------------------------------------------------
# What is measured (data)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadConfig:
    """Attention head layout; Hkv = heads in every configuration."""

    kind: str  # "MLA" or "MHA"
    heads: int
    dqk: int
    dv: int


@dataclass(frozen=True)
class Shape:
    """One benchmarked problem: a head layout and ``batch`` sequences of ``seqlen`` tokens."""

    config: HeadConfig
    batch: int
    seqlen: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seqlen

    @property
    def label(self) -> str:
        c = self.config
        return f"{c.kind} H={c.heads} {c.dqk}/{c.dv}, {self.batch}x{self.seqlen}"


HEAD_CONFIGS = (
    HeadConfig("MLA", 16, 192, 128),
    HeadConfig("MLA", 128, 192, 128),
    HeadConfig("MHA", 32, 128, 128),
)
BATCHES = ((32, 512), (8, 2048), (2, 8192))  # (sequences, tokens per sequence)
QUICK_BATCHES = ((32, 512),)

QUANT_M = QUANT_K = 16384  # the quantizer alone: 268M elements
COPY_BYTES = 2**30  # device-to-device copy: 1 GiB read + 1 GiB written
L2_BYTES = 60 * 2**20  # rotate input sets when one set is smaller than 3x this
INPUT_SETS_SMALL = 3
DTYPE = torch.bfloat16
FP8 = torch.float8_e4m3fn

# Targets of the issue.
QUANT_TARGET_TBPS = 3.0
MLA128_TARGET_SPEEDUP = 1.25  # unfused / fused at MLA, 128 heads, 32 x 512
LONG_TARGET_SPEEDUP = 1.05  # unfused / fused at 2 x 8192, every head config

# Targets of issue 9 (FA4 on Hopper).
FA4_MLA128_TARGET_SPEEDUP = 1.15  # (FA4 bf16 + quant) / FA4 fused at MLA, 128 heads, 32 x 512
FA4_EPILOGUE_MAX_OVERHEAD = 1.05  # FA4 fused / FA4 bf16 alone at 2 x 8192

# Timed paths of one shape, in table order.
PATHS = ("fused", "unfused", "flash_attention", "cudnn_quant", "cudnn_attention", "fa4_fused", "fa4_quant",
         "fa4_attention")
FA4_PATHS = ("fa4_fused", "fa4_quant", "fa4_attention")
OUR_PATHS = ("fused", "unfused", "flash_attention")  # an error here makes the exit code 1

BEGIN_MARKER = "<!-- attention-bench:begin -->"
END_MARKER = "<!-- attention-bench:end -->"
DOCS_HEADING = "## GPU kernels"


def benchmark_shapes(quick: bool = False) -> list[Shape]:
    """The shape table: every head config x every batch (only 32 x 512 with ``quick``)."""
    batches = QUICK_BATCHES if quick else BATCHES
    return [Shape(c, b, s) for c in HEAD_CONFIGS for b, s in batches]


def attention_flops(batch: int, seqlen: int, heads: int, dqk: int, dv: int) -> int:
    """Causal attention FLOPs: per sequence 2 * H * S*(S+1)/2 * (Dqk + Dv) (QK^T and PV, diagonal included)."""
    return batch * 2 * heads * (seqlen * (seqlen + 1) // 2) * (dqk + dv)


def quant_bytes(m: int, k: int) -> int:
    """Effective bytes of quantizing bf16 [m, k]: read 2*m*k, write m*k/2 packed + the swizzled fp8 scales."""
    return 2 * m * k + m * k // 2 + round_up(m, 128) * round_up(k // 16, 4)


def tera_per_s(amount: float, ms: float | None) -> float | None:
    """``amount`` (FLOPs or bytes) per ``ms`` milliseconds, in units of 1e12 per second."""
    return None if ms is None else amount / (ms * 1e-3) / 1e12


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, or None when either is missing."""
    return None if num is None or den is None else num / den


# --------------------------------------------------------------------------
# Timing and memory
# --------------------------------------------------------------------------


class Kernels(NamedTuple):
    """The launchers under test (fusion_pass.kernels), passed in so a check can substitute them."""

    flash_attention: Callable
    flash_attention_nvfp4: Callable
    quantize: Callable
    fa4_attention: Callable | None = None  # fa4_attention_varlen; None: FA4 unavailable (fa4_reason says why)
    fa4_attention_nvfp4: Callable | None = None  # fa4_attention_nvfp4_varlen
    fa4_reason: str = "not loaded"
    quantize_rows_into: Callable | None = None  # the row-range launcher (nvfp4_quant.quantize_rows_launch)


def load_kernels() -> Kernels:
    """Import the launchers from fusion_pass.kernels (the FA4 ones when FA4 runs on this GPU)."""
    from fusion_pass.kernels.fa4 import sm90 as fa4_sm90
    from fusion_pass.kernels.triton.flash_attention import flash_attention, flash_attention_nvfp4
    from fusion_pass.kernels.triton.quantize import quantize_launch as quantize, quantize_rows_launch as quantize_rows_into

    ok, why = fa4_sm90.fa4_sm90_usable("cuda", DTYPE, 16, 192, 128)
    if not ok:
        return Kernels(flash_attention, flash_attention_nvfp4, quantize, fa4_reason=why,
                       quantize_rows_into=quantize_rows_into)
    return Kernels(flash_attention, flash_attention_nvfp4, quantize, fa4_sm90.fa4_attention_varlen,
                   fa4_sm90.fa4_attention_nvfp4_varlen, fa4_reason=fa4_sm90.fa4_import_status()[1],
                   quantize_rows_into=quantize_rows_into)


def time_ms(fn: Callable[[], object], warmup_ms: float = 50, rep_ms: float = 200) -> tuple[float, list[float]]:
    """(median ms, every sample in ms) of ``fn`` by triton.testing.do_bench (CUDA events, L2 flushed per rep)."""
    from triton.testing import do_bench

    try:
        samples = list(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all"))
    except (AssertionError, ValueError):  # a Triton without return_mode="all"
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")), []
    return statistics.median(samples), samples


def peak_mib(fn: Callable[[], object]) -> tuple[object, float]:
    """(result of ``fn()``, its peak allocation in MiB above what was allocated before the call)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    return result, (torch.cuda.max_memory_allocated() - before) / 2**20


def describe_error(exc: BaseException, caught: list | None = None) -> str:
    """The exception, where it was raised, and the warnings raised with it (SDPA gives its reasons as warnings)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (raised at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    lines = [f"{type(exc).__name__}: {str(exc).strip()}{where}"]
    for w in caught or ():
        text = " ".join(str(w.message).split())
        if text and text not in lines:
            lines.append(text)
    return " | ".join(lines)


def timed(fn: Callable[[], object], timing: dict) -> tuple[float | None, list[float], str | None]:
    """(median ms, samples, None) of ``fn``, or (None, [], reason) if its first call raises."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()  # compiles / autotunes, and surfaces errors before timing
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - a refusal is a result here
        return None, [], describe_error(exc, caught)
    try:
        ms, samples = time_ms(fn, **timing)
    except Exception as exc:  # noqa: BLE001
        return None, [], describe_error(exc)
    return ms, samples, None


def rotating(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """A no-argument function that runs the next of ``calls`` each time (one per input set)."""
    if len(calls) == 1:
        return calls[0]
    cycle = itertools.cycle(calls)
    return lambda: next(cycle)()


# --------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------


def make_inputs(shape: Shape, seed: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fixed-seed randn q [T, H, Dqk], k [T, H, Dqk], v [T, H, Dv] in bf16 (randn q: softmax not degenerate)."""
    c, t = shape.config, shape.tokens
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    q = torch.randn(t, c.heads, c.dqk, generator=gen, device=device, dtype=DTYPE)
    k = torch.randn(t, c.heads, c.dqk, generator=gen, device=device, dtype=DTYPE)
    v = torch.randn(t, c.heads, c.dv, generator=gen, device=device, dtype=DTYPE)
    return q, k, v


def input_sets_needed(nbytes: int, l2_bytes: int = L2_BYTES) -> int:
    """How many input sets to rotate among: one if a set is at least 3x the L2 cache, else three."""
    return 1 if nbytes >= 3 * l2_bytes else INPUT_SETS_SMALL


def new_record(shape: Shape) -> dict:
    """The JSON record of one shape, before measurement."""
    c = shape.config
    return {
        "label": shape.label, "attention": c.kind, "heads": c.heads, "kv_heads": c.heads, "dqk": c.dqk, "dv": c.dv,
        "batch": shape.batch, "seqlen": shape.seqlen, "tokens": shape.tokens, "causal": True, "dtype": "bfloat16",
        "flops": attention_flops(shape.batch, shape.seqlen, c.heads, c.dqk, c.dv),
        "ms": {p: None for p in PATHS}, "samples_ms": {p: [] for p in PATHS}, "errors": {},
        "peak_mib": {"fused": None, "unfused": None}, "check": {},
    }


def add_derived(record: dict) -> dict:
    """Fill ``record``'s TFLOP/s and speedups from its median times (in place; returns it)."""
    ms = record["ms"]
    for path in PATHS:  # records written before the FA4 paths existed
        ms.setdefault(path, None)
    record["tflops"] = {p: tera_per_s(record["flops"], ms[p])
                        for p in ("fused", "flash_attention", "cudnn_attention", "fa4_fused", "fa4_attention")}
    record["speedup"] = {
        "unfused_over_fused": ratio(ms["unfused"], ms["fused"]),
        "cudnn_quant_over_fused": ratio(ms["cudnn_quant"], ms["fused"]),
        "fa4_quant_over_fa4_fused": ratio(ms["fa4_quant"], ms["fa4_fused"]),
        "cudnn_quant_over_fa4_fused": ratio(ms["cudnn_quant"], ms["fa4_fused"]),
        "cudnn_attention_over_fa4_fused": ratio(ms["cudnn_attention"], ms["fa4_fused"]),
        "fa4_fused_over_fa4_attention": ratio(ms["fa4_fused"], ms["fa4_attention"]),
    }
    return record


def measure_shape(kernels: Kernels, shape: Shape, *, device, seed: int, timing: dict) -> dict:
    """Time every path of one shape, measure fused / unfused peak memory, compare their bytes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    record = new_record(shape)
    c, b, s, t = shape.config, shape.batch, shape.seqlen, shape.tokens
    n = c.heads * c.dv
    scale = c.dqk**-0.5
    set_bytes = t * c.heads * (2 * c.dqk + c.dv) * torch.finfo(DTYPE).bits // 8
    sets = [make_inputs(shape, seed + i, device) for i in range(input_sets_needed(set_bytes))]
    record["input_sets"] = len(sets)
    cu_seqlens = torch.arange(b + 1, dtype=torch.int32, device=device) * s

    def attention(q, k, v, out=None):
        return kernels.flash_attention(q, k, v, cu_seqlens, s, causal=True, softmax_scale=scale, out=out)

    # Global scale from one unfused run: 448 * 6 / amax of the bf16 attention output.
    try:
        amax = attention(*sets[0]).abs().amax().float().item()
    except Exception as exc:  # noqa: BLE001
        record["errors"] = {p: f"reference flash_attention failed: {describe_error(exc)}" for p in PATHS}
        return add_derived(record)
    gs = torch.full((1,), 448.0 * 6.0 / amax, dtype=torch.float32, device=device)
    record["global_scale"] = gs.item()

    attn_out = torch.empty(t, c.heads, c.dv, dtype=DTYPE, device=device)
    packed = torch.empty(t, n // 2, dtype=torch.uint8, device=device)
    scales = torch.zeros(round_up(t, 128), round_up(n // 16, 4), dtype=FP8, device=device)

    def fused(q, k, v, preallocated=True):
        bufs = {"packed": packed, "scales": scales} if preallocated else {}
        return kernels.flash_attention_nvfp4(q, k, v, cu_seqlens, s, gs, causal=True, softmax_scale=scale, **bufs)

    def unfused(q, k, v, preallocated=True):
        if not preallocated:
            return kernels.quantize(attention(q, k, v).view(t, n), gs, swizzled=True)
        out = attention(q, k, v, out=attn_out)
        return kernels.quantize(out.view(t, n), gs, swizzled=True, packed=packed, scales=scales)

    def bhsd(x):  # [T, H, D] -> [B, H, S, D] view, no copy
        return x.view(b, s, x.shape[1], x.shape[2]).transpose(1, 2)

    bhsd_sets = [tuple(bhsd(x) for x in qkv) for qkv in sets]

    def cudnn_attention(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    def cudnn_quant(q, k, v):
        out = cudnn_attention(q, k, v).transpose(1, 2).reshape(t, n)
        return kernels.quantize(out, gs, swizzled=True, packed=packed, scales=scales)

    fa4_out = torch.empty(t, c.heads, c.dv, dtype=DTYPE, device=device)

    def fa4_fused(q, k, v):
        kernels.fa4_attention_nvfp4(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=s, softmax_scale=scale, causal=True,
                                    output=packed, output_scale=gs, output_block_scale=scales)
        return packed, scales

    def fa4_attention(q, k, v):
        return kernels.fa4_attention(q, k, v, cu_seqlens, s, causal=True, softmax_scale=scale)

    def fa4_quant(q, k, v):
        out = fa4_attention(q, k, v)
        return kernels.quantize(out.view(t, n), gs, swizzled=True, packed=packed, scales=scales)

    calls = {
        "fused": rotating([lambda qkv=qkv: fused(*qkv) for qkv in sets]),
        "unfused": rotating([lambda qkv=qkv: unfused(*qkv) for qkv in sets]),
        "flash_attention": rotating([lambda qkv=qkv: attention(*qkv, out=attn_out) for qkv in sets]),
        "cudnn_quant": rotating([lambda qkv=qkv: cudnn_quant(*qkv) for qkv in bhsd_sets]),
        "cudnn_attention": rotating([lambda qkv=qkv: cudnn_attention(*qkv) for qkv in bhsd_sets]),
    }
    if kernels.fa4_attention is not None:
        calls["fa4_fused"] = rotating([lambda qkv=qkv: fa4_fused(*qkv) for qkv in sets])
        calls["fa4_quant"] = rotating([lambda qkv=qkv: fa4_quant(*qkv) for qkv in sets])
        calls["fa4_attention"] = rotating([lambda qkv=qkv: fa4_attention(*qkv) for qkv in sets])
    else:
        for path in FA4_PATHS:
            record["errors"][path] = f"FA4 unavailable: {kernels.fa4_reason}"
    for path, call in calls.items():
        if path.startswith("cudnn"):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ms, samples, error = timed(call, timing)
        else:
            ms, samples, error = timed(call, timing)
        record["ms"][path], record["samples_ms"][path] = ms, samples
        if error is not None:
            record["errors"][path] = error

    # Peak memory of one call that allocates its own outputs (kernels already compiled above),
    # and how many output bytes the fused and the unfused path agree on.
    results = {}
    for path, call in (("fused", fused), ("unfused", unfused)):
        if record["ms"][path] is None:
            continue
        try:
            results[path], record["peak_mib"][path] = peak_mib(lambda: call(*sets[0], preallocated=False))
        except Exception as exc:  # noqa: BLE001
            record["errors"][f"{path}_peak_memory"] = describe_error(exc)
    if len(results) == 2:
        for i, name in enumerate(("packed_equal", "scales_equal")):
            a, b_ = (results[p][i].view(torch.uint8) for p in ("fused", "unfused"))
            record["check"][name] = (a == b_).sum().item() / a.numel() if a.shape == b_.shape else 0.0
    # FA4 fused against FA4 bf16 + quantize: the same bytes by construction (fraction equal)
    if record["ms"]["fa4_fused"] is not None and record["ms"]["fa4_quant"] is not None:
        try:
            want = [x.view(torch.uint8).clone() for x in fa4_quant(*sets[0])]
            got = [x.view(torch.uint8).clone() for x in fa4_fused(*sets[0])]
            for name, a, b_ in (("fa4_packed_equal", got[0], want[0]), ("fa4_scales_equal", got[1], want[1])):
                record["check"][name] = (a == b_).sum().item() / a.numel()
        except Exception as exc:  # noqa: BLE001
            record["errors"]["fa4_check"] = describe_error(exc)
    return add_derived(record)


def measure_quant(kernels: Kernels, *, device, seed: int, timing: dict, m: int = QUANT_M, k: int = QUANT_K) -> dict:
    """The quantizer alone on a randn bf16 [m, k]: median ms and effective TB/s."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=device, dtype=DTYPE)
    gs = torch.full((1,), 448.0 * 6.0 / x.abs().amax().float().item(), dtype=torch.float32, device=device)
    packed = torch.empty(m, k // 2, dtype=torch.uint8, device=device)
    scales = torch.zeros(round_up(m, 128), round_up(k // 16, 4), dtype=FP8, device=device)
    ms, samples, error = timed(lambda: kernels.quantize(x, gs, swizzled=True, packed=packed, scales=scales), timing)
    nbytes = quant_bytes(m, k)
    result = {"m": m, "k": k, "elements": m * k, "bytes": nbytes, "ms": ms, "tbps": tera_per_s(nbytes, ms),
              "samples_ms": samples, "error": error}
    if kernels.quantize_rows_into is not None and error is None:
        result["rows"] = measure_rows(kernels, x, gs, packed, scales, timing)
    return result


ROWS_START = 64
"""The row-range quantizer is measured writing rows [ROWS_START, M): a mixed batch's rows after its decode rows."""


def measure_rows(kernels: Kernels, x, gs, packed, scales, timing: dict) -> dict:
    """``quantize_rows_into`` of ``x[ROWS_START:]`` into rows ``[ROWS_START, M)`` of poisoned buffers: median
    ms, effective TB/s, and whether the rows written equal the whole-buffer quantizer's bytes (``packed`` /
    ``scales`` hold those) while rows ``< ROWS_START`` keep the poison."""
    m, k = x.shape
    rows_x = x[ROWS_START:]
    out = torch.full_like(packed, 0xAB)
    out_scales = torch.full_like(scales.view(torch.uint8), 0xAB)
    ms, samples, error = timed(lambda: kernels.quantize_rows_into(rows_x, gs, out, out_scales, ROWS_START), timing)
    nbytes = quant_bytes(m - ROWS_START, k)
    check = None
    if error is None:
        first = nvfp4.row_scale_offsets(0, ROWS_START, k // 16, x.device)
        later = nvfp4.row_scale_offsets(ROWS_START, m, k // 16, x.device)
        flat, ref = out_scales.view(-1), scales.view(torch.uint8).view(-1)
        check = {"rows_equal": bool(torch.equal(out[ROWS_START:], packed[ROWS_START:])
                                    and torch.equal(flat[later], ref[later])),
                 "other_rows_untouched": bool((out[:ROWS_START] == 0xAB).all() and (flat[first] == 0xAB).all())}
    return {"row_start": ROWS_START, "rows": m - ROWS_START, "bytes": nbytes, "ms": ms,
            "tbps": tera_per_s(nbytes, ms), "samples_ms": samples, "error": error, "check": check}


def measure_copy(*, device, seed: int, timing: dict, nbytes: int = COPY_BYTES) -> dict:
    """Device-to-device copy of ``nbytes`` (bytes read + written counted): the memory-bandwidth ceiling."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    src = torch.randn(nbytes // 2, generator=gen, device=device, dtype=DTYPE)
    dst = torch.empty_like(src)
    ms, samples, error = timed(lambda: dst.copy_(src), timing)
    return {"bytes": nbytes, "bytes_moved": 2 * nbytes, "ms": ms, "tbps": tera_per_s(2 * nbytes, ms),
            "samples_ms": samples, "error": error}


def run_benchmark(kernels: Kernels, shapes: list[Shape], *, device="cuda", seed: int = 0, timing: dict,
                  quant_shape: tuple[int, int] = (QUANT_M, QUANT_K), copy_bytes: int = COPY_BYTES) -> dict:
    """Every measurement of the run: {"shapes": [...], "quant": {...}, "copy": {...}}."""
    records = []
    for i, shape in enumerate(shapes, 1):
        record = measure_shape(kernels, shape, device=device, seed=seed, timing=timing)
        records.append(record)
        ms = record["ms"]
        print(f"[{i}/{len(shapes)}] {shape.label}: fused {fmt(ms['fused'], 3)} ms, unfused {fmt(ms['unfused'], 3)} ms, "
              f"cuDNN+quant {fmt(ms['cudnn_quant'], 3)} ms, FA4 fused {fmt(ms['fa4_fused'], 3)} ms, "
              f"FA4+quant {fmt(ms['fa4_quant'], 3)} ms, FA4 attn {fmt(ms['fa4_attention'], 3)} ms", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    quant = measure_quant(kernels, device=device, seed=seed, timing=timing, m=quant_shape[0], k=quant_shape[1])
    copy = measure_copy(device=device, seed=seed, timing=timing, nbytes=copy_bytes)
    return {"shapes": records, "quant": quant, "copy": copy}


# --------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------


def find_shapes(results: dict, **fields) -> list[dict]:
    """Shape records whose fields equal ``fields`` (e.g. heads=128, batch=32)."""
    return [r for r in results["shapes"] if all(r.get(k) == v for k, v in fields.items())]


def target(number: int, text: str, status: str, measured: str) -> dict:
    """One evaluated target; status is "met", "not met" or "not measured"."""
    return {"id": number, "text": text, "status": status, "measured": measured}


def target_quant(results: dict) -> dict:
    text = f"NVFP4 quant >= {QUANT_TARGET_TBPS:.1f} TB/s effective at {QUANT_M * QUANT_K / 1e6:.0f}M elements"
    quant, copy = results.get("quant"), results.get("copy") or {}
    if quant is None:
        return target(1, text, "not measured", "not run")
    if quant.get("tbps") is None:
        return target(1, text, "not met", f"quantize failed: {quant.get('error')}")
    measured = f"{quant['tbps']:.2f} TB/s ({quant['ms']:.3f} ms)"
    if copy.get("tbps") is not None:
        measured += f"; copy ceiling {copy['tbps']:.2f} TB/s"
    return target(1, text, "met" if quant["tbps"] >= QUANT_TARGET_TBPS else "not met", measured)


def target_mla128(results: dict) -> dict:
    text = f"fused >= {MLA128_TARGET_SPEEDUP:.2f}x faster than unfused at MLA, 128 heads, 32 x 512"
    found = find_shapes(results, attention="MLA", heads=128, batch=32, seqlen=512)
    if not found:
        return target(2, text, "not measured", "shape not in this run")
    r = found[0]
    speedup = r["speedup"]["unfused_over_fused"]
    if speedup is None:
        return target(2, text, "not met", "no number: the fused or the unfused path failed")
    measured = f"{speedup:.2f}x ({r['ms']['unfused']:.3f} ms unfused / {r['ms']['fused']:.3f} ms fused)"
    return target(2, text, "met" if speedup >= MLA128_TARGET_SPEEDUP else "not met", measured)


def target_long(results: dict) -> dict:
    text = f"fused >= {LONG_TARGET_SPEEDUP:.2f}x faster than unfused at 2 x 8192, every head config"
    found = find_shapes(results, batch=2, seqlen=8192)
    if not found:
        return target(3, text, "not measured", "no 2 x 8192 shape in this run (--quick)")
    speedups = [r["speedup"]["unfused_over_fused"] for r in found]
    met = all(x is not None and x >= LONG_TARGET_SPEEDUP for x in speedups)
    measured = "; ".join(f"{r['label']}: {fmt(x, 2)}x" for r, x in zip(found, speedups))
    return target(3, text, "met" if met else "not met", measured)


def target_cudnn(results: dict) -> dict:
    text = "fused faster than cuDNN attention + quant at every shape where cuDNN ran"
    ran = [r for r in results["shapes"] if r["ms"]["cudnn_quant"] is not None]
    skipped = [r["label"] for r in results["shapes"] if r["ms"]["cudnn_quant"] is None]
    note = f"; cuDNN could not run at {', '.join(skipped)}" if skipped else ""
    if not ran:
        return target(4, text, "not measured", "cuDNN ran at no shape" + note)
    speedups = [(r["speedup"]["cudnn_quant_over_fused"], r["label"]) for r in ran]
    slower = [label for x, label in speedups if x is None or x <= 1.0]
    known = [(x, label) for x, label in speedups if x is not None]
    measured = f"smallest cuDNN+quant / fused {min(known)[0]:.2f}x at {min(known)[1]}" if known else "no fused number"
    if slower:
        measured += f"; fused not faster at {', '.join(slower)}"
    return target(4, text, "not met" if slower else "met", measured + note)


def evaluate_fa4_targets(results: dict) -> list[dict]:
    """Issue 9's targets (FA4 on Hopper), numbered F1..F4: met / not met / not measured."""
    out = []
    text = "FA4 fused faster than cuDNN SDPA + quant at every shape where both ran"
    both = [r for r in results["shapes"] if r["ms"].get("fa4_fused") is not None and r["ms"]["cudnn_quant"] is not None]
    if not both:
        out.append(target("F1", text, "not measured", "FA4 fused or cuDNN + quant ran at no shape"))
    else:
        worst = min(both, key=lambda r: r["speedup"]["cudnn_quant_over_fa4_fused"])
        slower = [r["label"] for r in both if r["speedup"]["cudnn_quant_over_fa4_fused"] <= 1.0]
        measured = f"smallest cuDNN+quant / FA4 fused {worst['speedup']['cudnn_quant_over_fa4_fused']:.2f}x at {worst['label']}"
        if slower:
            measured += f"; not faster at {', '.join(slower)}"
        out.append(target("F1", text, "not met" if slower else "met", measured))
    text = "moonshot: FA4 fused faster than cuDNN attention alone at MLA 2 x 8192"
    found = [r for r in find_shapes(results, attention="MLA", batch=2, seqlen=8192)
             if r["speedup"].get("cudnn_attention_over_fa4_fused") is not None]
    if not found:
        out.append(target("F2", text, "not measured", "FA4 fused or cuDNN attention missing at MLA 2 x 8192"))
    else:
        xs = [r["speedup"]["cudnn_attention_over_fa4_fused"] for r in found]
        measured = "; ".join(f"{r['label']}: cuDNN attn / FA4 fused {x:.2f}x" for r, x in zip(found, xs))
        out.append(target("F2", text, "met" if all(x > 1.0 for x in xs) else "not met", measured))
    text = f"FA4 fused >= {FA4_MLA128_TARGET_SPEEDUP:.2f}x faster than FA4 bf16 + quant at MLA, 128 heads, 32 x 512"
    found = find_shapes(results, attention="MLA", heads=128, batch=32, seqlen=512)
    x = found[0]["speedup"].get("fa4_quant_over_fa4_fused") if found else None
    if x is None:
        out.append(target("F3", text, "not measured", "FA4 fused or FA4 + quant missing at that shape"))
    else:
        out.append(target("F3", text, "met" if x >= FA4_MLA128_TARGET_SPEEDUP else "not met", f"{x:.2f}x"))
    text = f"NVFP4 epilogue adds <= {(FA4_EPILOGUE_MAX_OVERHEAD - 1) * 100:.0f}% over FA4 bf16 alone at 2 x 8192"
    found = [r for r in find_shapes(results, batch=2, seqlen=8192)
             if r["speedup"].get("fa4_fused_over_fa4_attention") is not None]
    if not found:
        out.append(target("F4", text, "not measured", "FA4 fused or FA4 attn missing at 2 x 8192"))
    else:
        xs = [r["speedup"]["fa4_fused_over_fa4_attention"] for r in found]
        measured = "; ".join(f"{r['label']}: {(x - 1) * 100:+.1f}%" for r, x in zip(found, xs))
        out.append(target("F4", text, "met" if all(x <= FA4_EPILOGUE_MAX_OVERHEAD for x in xs) else "not met",
                          measured))
    return out


ROWS_TARGET_TBPS = 3.4  # issue 11: 80% of the copy bandwidth, row-range and whole-buffer


def evaluate_row_targets(results: dict) -> list[dict]:
    """Issue 11's quantizer target (Q1): both quantizers at >= ROWS_TARGET_TBPS, row-range bytes checked."""
    text = (f"NVFP4 quantizer, whole-buffer and row-range, >= {ROWS_TARGET_TBPS:.1f} TB/s effective at "
            f"{QUANT_M * QUANT_K / 1e6:.0f}M elements")
    quant = results.get("quant") or {}
    rows = quant.get("rows")
    if quant.get("tbps") is None or not rows or rows.get("tbps") is None:
        return [target("Q1", text, "not measured", "a quantizer did not run")]
    measured = f"whole-buffer {quant['tbps']:.2f} TB/s, row-range {rows['tbps']:.2f} TB/s"
    check = rows.get("check") or {}
    measured += (f"; row-range bytes equal the whole-buffer quantizer's: {check.get('rows_equal')}, "
                 f"other rows untouched: {check.get('other_rows_untouched')}")
    ok = min(quant["tbps"], rows["tbps"]) >= ROWS_TARGET_TBPS and all(check.values())
    return [target("Q1", text, "met" if ok else "not met", measured)]


def evaluate_targets(results: dict) -> list[dict]:
    """The four targets of the issue, each met / not met / not measured with the measured number."""
    return [target_quant(results), target_mla128(results), target_long(results), target_cudnn(results)]


# --------------------------------------------------------------------------
# Reporting: table, plot, JSON, docs
# --------------------------------------------------------------------------


def fmt(x: float | None, digits: int) -> str:
    """A number with ``digits`` decimals, or "n/a"."""
    return "n/a" if x is None else f"{x:.{digits}f}"


TABLE_HEADER = (
    "attention", "batch", "fused (ms)", "unfused (ms)", "cuDNN+quant (ms)", "unfused/fused", "cuDNN+quant/fused",
    "flash attn (ms)", "cuDNN attn (ms)", "TFLOP/s fused", "TFLOP/s flash", "TFLOP/s cuDNN",
    "peak fused (MiB)", "peak unfused (MiB)", "FA4 fused (ms)", "FA4+quant (ms)", "FA4 attn (ms)",
    "FA4+quant/FA4 fused", "cuDNN+quant/FA4 fused", "TFLOP/s FA4 fused",
)


def table_rows(results: dict) -> list[list[str]]:
    """One row of strings per shape, in TABLE_HEADER order ("error" where our kernel failed, "n/a" otherwise)."""
    rows = []
    for r in results["shapes"]:
        ms, tf, sp, peak = r["ms"], r["tflops"], r["speedup"], r["peak_mib"]

        def cell(path):
            return "error" if ms[path] is None and path in OUR_PATHS and path in r["errors"] else fmt(ms[path], 3)

        rows.append([
            f"{r['attention']} H={r['heads']} {r['dqk']}/{r['dv']}", f"{r['batch']}x{r['seqlen']}",
            cell("fused"), cell("unfused"), cell("cudnn_quant"),
            fmt(sp["unfused_over_fused"], 2), fmt(sp["cudnn_quant_over_fused"], 2),
            cell("flash_attention"), cell("cudnn_attention"),
            fmt(tf["fused"], 0), fmt(tf["flash_attention"], 0), fmt(tf["cudnn_attention"], 0),
            fmt(peak["fused"], 0), fmt(peak["unfused"], 0),
            fmt(ms.get("fa4_fused"), 3), fmt(ms.get("fa4_quant"), 3), fmt(ms.get("fa4_attention"), 3),
            fmt(sp.get("fa4_quant_over_fa4_fused"), 2), fmt(sp.get("cudnn_quant_over_fa4_fused"), 2),
            fmt(tf.get("fa4_fused"), 0),
        ])
    return rows


def bandwidth_rows(results: dict) -> list[list[str]]:
    """Rows for the quantizer alone and the copy ceiling: what, time (ms), TB/s."""
    rows = []
    quant, copy = results.get("quant"), results.get("copy")
    if quant:
        rows.append([f"NVFP4 quantize, bf16 [{quant['m']}, {quant['k']}] ({quant['elements'] / 1e6:.0f}M elements)",
                     fmt(quant["ms"], 3), fmt(quant["tbps"], 2)])
        r = quant.get("rows")
        if r:
            rows.append([f"NVFP4 quantize_rows_into, rows [{r['row_start']}, {quant['m']}) of the same buffers",
                         fmt(r["ms"], 3), fmt(r["tbps"], 2)])
    if copy:
        rows.append([f"device-to-device copy, {copy['bytes'] / 2**30:g} GiB (read + write)",
                     fmt(copy["ms"], 3), fmt(copy["tbps"], 2)])
    return rows


def format_table(header, rows) -> str:
    """A fixed-width text table (first column left-aligned, the rest right-aligned)."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def markdown_table(header, rows, left: int = 1) -> str:
    """A markdown table; the first ``left`` columns left-aligned, the rest right-aligned."""
    align = ["---" if i < left else "---:" for i in range(len(header))]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [list(header), align] + rows)


def cudnn_refusals(results: dict) -> dict[str, list[str]]:
    """cuDNN's error reason -> the shape labels where it gave it."""
    reasons: dict[str, list[str]] = {}
    for r in results["shapes"]:
        if r["ms"]["cudnn_quant"] is None and "cudnn_quant" in r["errors"]:
            reasons.setdefault(r["errors"]["cudnn_quant"], []).append(r["label"])
    return reasons


def our_errors(results: dict) -> list[str]:
    """'label, path: reason' for every failure of our kernels (not cuDNN's)."""
    lines = [f"{r['label']}, {p}: {e}" for r in results["shapes"] for p, e in r["errors"].items()
             if not p.startswith("cudnn") and not e.startswith("FA4 unavailable")]
    lines += [f"{name}: {results[name]['error']}" for name in ("quant", "copy")
              if results.get(name) and results[name].get("error")]
    return lines


def check_warnings(results: dict, threshold: float = 0.9) -> list[str]:
    """Shapes where under ``threshold`` of the fused packed bytes equal the unfused ones, or the fused peak is not lower."""
    lines = []
    for r in results["shapes"]:
        if r["check"].get("packed_equal", 1.0) < threshold:
            lines.append(f"{r['label']}: fused and unfused packed outputs agree on only "
                         f"{r['check']['packed_equal']:.1%} of bytes")
        fused, unfused = r["peak_mib"]["fused"], r["peak_mib"]["unfused"]
        if fused is not None and unfused is not None and fused >= unfused:
            lines.append(f"{r['label']}: fused peak memory {fused:.0f} MiB is not below unfused {unfused:.0f} MiB")
    return lines


def status_word(status: str) -> str:
    return {"met": "Met", "not met": "Not met", "not measured": "Not measured"}[status]


def report_text(results: dict, meta: dict) -> str:
    """What the run prints last: results table, quantizer / copy table, cuDNN refusals, errors, targets."""
    parts = [f"attention -> NVFP4 on {meta['device']} (torch {meta['torch']}, triton {meta['triton']}), "
             f"medians in ms, causal bf16, Hkv = H, {meta['date']} UTC",
             format_table(TABLE_HEADER, table_rows(results)), "",
             format_table(("bandwidth", "time (ms)", "TB/s"), bandwidth_rows(results))]
    for reason, labels in cudnn_refusals(results).items():
        parts.append(f"cuDNN could not run at {', '.join(labels)}: {one_line(reason)}")
    parts += [f"ERROR {one_line(line)}" for line in our_errors(results)]
    parts += [f"WARNING {line}" for line in check_warnings(results)]
    parts.append("\nTargets:")
    parts += [f"  [{status_word(t['status'])}] ({t['id']}) {t['text']}: {t['measured']}" for t in results.get("targets") or evaluate_targets(results)]
    if results.get("fa4_targets"):
        parts.append("FA4 targets (issue 9):")
        parts += [f"  [{status_word(t['status'])}] ({t['id']}) {t['text']}: {t['measured']}" for t in results["fa4_targets"]]
    if results.get("row_targets"):
        parts.append("Quantizer target (issue 11):")
        parts += [f"  [{status_word(t['status'])}] ({t['id']}) {t['text']}: {t['measured']}" for t in results["row_targets"]]
    return "\n".join(parts)


def one_line(text: str, limit: int = 400) -> str:
    """``text`` on one line, shortened to ``limit`` characters (the full text is in the JSON)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def code(text: str, limit: int = 300) -> str:
    """``text`` on one line, shortened, and safe inside a markdown code span."""
    return one_line(text.replace("`", "'"), limit)


def render_docs_section(results: dict, meta: dict) -> str:
    """The markdown between the markers in docs/benchmarks.md (markers not included)."""
    timing = meta.get("timing", {})
    lines = [
        "<!-- Written by bench/attention.py: edits between the markers are overwritten; notes go after the end marker. -->",
        "",
        f"- Date: {meta['date']} (UTC)",
        f"- Device: {meta['device']}; torch {meta['torch']}, triton {meta['triton']}"
        + (f", CUDA {meta['cuda']}" if meta.get("cuda") else "") + (f", cuDNN {meta['cudnn']}" if meta.get("cudnn") else ""),
        f"- Command: `{meta['command']}`",
        "- Method: causal attention, bf16, Hkv = H, equal-length sequences, fixed-seed randn inputs; "
        f"medians of `triton.testing.do_bench` (warm-up {timing.get('warmup_ms', '?')} ms, "
        f"{timing.get('rep_ms', '?')} ms of repetitions, L2 flushed before each). "
        "Fused = `flash_attention_nvfp4` (NVFP4 written by the kernel); unfused = `flash_attention` (bf16) + "
        "`nvfp4_quant.quantize_launch`; cuDNN + quant = SDPA with the cuDNN backend on [B, H, S, D] views, "
        "`.transpose(1, 2).reshape(T, H*Dv)` and the same quantize (all timed). Global scale = 448 * 6 / amax "
        "of the bf16 attention output. TFLOP/s count QK^T and PV over the causal half, diagonal included. "
        "FA4 fused = `fa4_attention_nvfp4_varlen` (FlashAttention-4's SM90 kernel with our NVFP4 epilogue); "
        "FA4 + quant = `fa4_attention_varlen` (FA4's own bf16 forward) + the same quantize; FA4 attn = FA4 bf16 alone; "
        "'n/a' in the FA4 columns: FA4 unavailable (reason below). "
        "Peak memory: above what was allocated before one call that allocates its own outputs.",
        "",
        markdown_table(TABLE_HEADER, table_rows(results), left=2),
        "",
        markdown_table(("bandwidth", "time (ms)", "TB/s"), bandwidth_rows(results)),
        "",
    ]
    refusals = cudnn_refusals(results)
    for reason, labels in refusals.items():
        lines.append(f"cuDNN could not run at {', '.join(labels)}: `{code(reason)}`")
    errors = our_errors(results)
    if errors:
        lines.append("Errors of our kernels in this run: " + "; ".join(f"`{code(e)}`" for e in errors))
    if refusals or errors:
        lines.append("")
    lines.append("Targets (medians from this run):")
    lines.append("")
    for t in results.get("targets") or evaluate_targets(results):
        lines.append(f"- **{status_word(t['status'])}.** ({t['id']}) {t['text']}: {t['measured']}.")
        if t["status"] == "not met":
            lines.append("  - Why not met: see the notes below.")
    fa4_targets = results.get("fa4_targets")
    if fa4_targets:
        fa4_errors = sorted({r["errors"][p] for r in results["shapes"] for p in FA4_PATHS if p in r["errors"]})
        lines += ["", "FA4 targets (issue 9; medians from this run):", ""]
        for t in fa4_targets:
            lines.append(f"- **{status_word(t['status'])}.** ({t['id']}) {t['text']}: {t['measured']}.")
        if fa4_errors:
            lines.append("- FA4 paths: " + "; ".join(f"`{code(e)}`" for e in fa4_errors[:3]))
        checks = [r["check"] for r in results["shapes"] if "fa4_packed_equal" in r["check"]]
        if checks:
            same = all(c["fa4_packed_equal"] == 1.0 and c["fa4_scales_equal"] == 1.0 for c in checks)
            lines.append(f"- FA4 fused bytes equal FA4 bf16 + quantize at {'every' if same else 'not every'} "
                         f"measured shape ({len(checks)} checked).")
    row_targets = results.get("row_targets")
    if row_targets:
        lines += ["", "Quantizer target (issue 11; medians from this run):", ""]
        lines += [f"- **{status_word(t['status'])}.** ({t['id']}) {t['text']}: {t['measured']}." for t in row_targets]
    return "\n".join(lines)


def replace_between_markers(text: str, new: str) -> str:
    """``text`` with what lies between the markers replaced by ``new``; everything else is kept.

    Without markers, they are inserted (around ``new``) at the end of the ``## GPU kernels``
    section, or at the end of the text when it has no such section.
    """
    block = f"{BEGIN_MARKER}\n{new.strip(chr(10))}\n{END_MARKER}"
    begin = text.find(BEGIN_MARKER)
    if begin >= 0:
        end = text.find(END_MARKER, begin)
        if end < 0:
            raise ValueError(f"{BEGIN_MARKER} without {END_MARKER} after it")
        return text[:begin] + block + text[end + len(END_MARKER):]
    if END_MARKER in text:
        raise ValueError(f"{END_MARKER} without {BEGIN_MARKER} before it")
    lines = text.splitlines(keepends=True)
    heading = next((i for i, line in enumerate(lines) if line.strip() == DOCS_HEADING), None)
    if heading is None:
        prefix = text.rstrip("\n") + "\n\n" if text.strip() else ""
        return f"{prefix}{DOCS_HEADING}\n\n{block}\n"
    nxt = next((i for i in range(heading + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    section = "".join(lines[:nxt]).rstrip("\n") + "\n\n" + block + "\n"
    rest = "".join(lines[nxt:])
    return section + ("\n" + rest if rest else "")


def write_docs(path: Path, results: dict, meta: dict) -> None:
    """Refresh the marked section of ``path`` (created if missing) with this run's results."""
    path = Path(path)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    path.write_text(replace_between_markers(text, render_docs_section(results, meta)))


def plot_results(results: dict, meta: dict, path: Path) -> bool:
    """Grouped bars of median time per shape (fused / unfused / cuDNN + quant); False if matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: skipping the plot (pip install matplotlib to get it)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import FormatStrFormatter

    series = (("fused", "fused NVFP4 attention", "tab:green"), ("unfused", "flash_attention + quantize", "tab:blue"),
              ("cudnn_quant", "cuDNN SDPA + quantize", "tab:orange"))
    shapes = results["shapes"]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.2 * len(shapes)), 5.0))
    for i, (path_name, name, color) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(shapes))]
        present = [(x, r["ms"][path_name]) for x, r in zip(xs, shapes) if r["ms"][path_name] is not None]
        bars = ax.bar([x for x, _ in present], [y for _, y in present], width, label=name, color=color)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, rotation=90, padding=2)
        for x, r in zip(xs, shapes):
            if r["ms"][path_name] is None:
                ax.annotate("n/a", (x, 0), xytext=(0, 2), textcoords="offset points", ha="center",
                            fontsize=6, rotation=90, xycoords=("data", "axes fraction"))
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels([f"{r['attention']} H={r['heads']}\n{r['batch']}x{r['seqlen']}" for r in shapes], fontsize=8)
    ax.set_yscale("log")
    bottom, top = ax.get_ylim()
    ax.set_ylim(bottom, top * 1.6)  # room for the value labels
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.tick_params(axis="y", which="minor", labelsize=6)
    ax.set_ylabel("median time (ms, log scale)")
    ax.set_title(f"attention -> NVFP4, causal bf16, {meta['device']} ({meta['date']})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def command_line(argv: list[str]) -> str:
    """The command as run, for the docs: ``python`` + the script path (relative to the repo when inside it) + args."""
    script = Path(argv[0]) if argv else Path("bench/attention.py")
    if script.is_absolute():
        try:
            script = script.relative_to(REPO_ROOT)
        except ValueError:
            pass
    return shlex.join(["python", str(script), *argv[1:]])


def collect_meta(args: argparse.Namespace, argv: list[str]) -> dict:
    """Date, device and versions of this run."""
    import triton

    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "command": command_line(argv),
        "argv": list(argv),
        "quick": args.quick,
        "seed": args.seed,
        "timing": {"warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms, "method": "triton.testing.do_bench, median"},
        "l2_bytes_assumed": L2_BYTES,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python bench/attention.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", metavar="DIR", type=Path, default=REPO_ROOT / "out",
                        help="directory for attention_bench.json and attention_bench.png (default: <repo>/out)")
    parser.add_argument("--quick", action="store_true",
                        help="only the 32 x 512 batch of each head config: a smoke run, target 3 not measured "
                             "(it still refreshes the docs unless --no-docs)")
    docs = parser.add_mutually_exclusive_group()
    docs.add_argument("--docs", metavar="PATH", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md",
                      help="markdown file whose attention-bench section is refreshed (default: <repo>/docs/benchmarks.md)")
    docs.add_argument("--no-docs", action="store_true", help="do not touch the docs")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument("--warmup-ms", type=float, default=50.0, help="do_bench warm-up per measurement, ms (default 50)")
    parser.add_argument("--rep-ms", type=float, default=200.0, help="do_bench repetitions per measurement, ms (default 200)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    args = parse_args(argv[1:])
    if not torch.cuda.is_available():
        print(f"bench/attention.py needs a CUDA GPU, and torch.cuda.is_available() is False here "
              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}). Nothing was run.", file=sys.stderr)
        return 2
    try:
        kernels = load_kernels()
    except ImportError as exc:
        print(f"cannot import the kernels from fusion_pass.kernels: {exc}", file=sys.stderr)
        return 2
    meta = collect_meta(args, argv)
    timing = {"warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms}
    results = run_benchmark(kernels, benchmark_shapes(args.quick), seed=args.seed, timing=timing)
    results["targets"] = evaluate_targets(results)
    results["fa4_targets"] = evaluate_fa4_targets(results)
    results["row_targets"] = evaluate_row_targets(results)

    args.out.mkdir(parents=True, exist_ok=True)
    png, json_path = args.out / "attention_bench.png", args.out / "attention_bench.json"
    try:
        plotted = plot_results(results, meta, png)
    except Exception:  # noqa: BLE001 - the numbers matter more than the picture
        print(f"the plot failed (numbers are unaffected):\n{traceback.format_exc()}")
        plotted = False
    meta["plot"] = str(png) if plotted else None
    json_path.write_text(json.dumps({"meta": meta, **results}, indent=1))
    print(f"wrote {json_path}" + (f" and {png}" if plotted else ""))
    if not args.no_docs:
        write_docs(args.docs, results, meta)
        print(f"refreshed the attention-bench section of {args.docs}")
    print()
    print(report_text(results, meta))
    return 1 if our_errors(results) else 0


if __name__ == "__main__":
    sys.exit(main())
