"""Host time per call of the run time's attention op, on the fused and on the unfused path.

For each layer (MLA and GQA) and batch shape, one call of each path, on the same inputs and KV caches:

  fused     ``torch.ops.fusion_pass.{mla_,}attention_with_output`` with the NVFP4 buffers, the guard taking the
            fused path (the graph with the pass)
  unfused   the same op writing the query dtype, then ``torch.ops.fusion_pass.scaled_fp4_quant.out`` (the graph
            without the pass: its attention op and its quant op)

Host time: ``time.perf_counter`` around the call(s) of one path, no synchronization inside; the median over
``--repeats`` calls after ``--warmup``, each call on fresh random inputs (drawn before timing, cycled), starting
from the KV caches as they were before the first call (restored outside the timed region); on CUDA the device
is synchronized between calls, outside the timed region, so that every call finds an empty queue (host time
only, never waiting for the GPU). ``calls`` is the number of Python function calls one call makes (a
``sys.setprofile`` count of one call after the timing: deterministic, independent of the machine's load).
On the CPU the host time includes the computation itself (the ``reference`` backend), so use small shapes
there; on CUDA it is what the launch path costs (``--backend`` auto: ``fa4`` where it runs, else
``triton``; both are run with ``--backend all``).

  python bench/op_host_time.py [--device cpu|cuda] [--backend auto|fa4|triton|reference|all]
                               [--repeats N] [--warmup N] [--tiny] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# (name, query lengths, context lengths): decodes are query length 1 with context
CPU_BATCHES = [
    ("prefill 2x16", [16, 16], [0, 0]),
    ("prefill 8x12", [12] * 8, [0] * 8),
    ("mixed 4 decodes + 2x16", [1, 1, 1, 1, 16, 16], [20, 9, 33, 5, 0, 0]),
    ("chunked 2x8 after 24", [8, 8], [24, 24]),
]
CUDA_BATCHES = [
    ("prefill 2x48", [48, 48], [0, 0]),
    ("prefill 4x128", [128] * 4, [0] * 4),
    ("prefill 32x512", [512] * 32, [0] * 32),
    ("mixed 8 decodes + 2x128", [1] * 8 + [128, 128], [300] * 8 + [0, 0]),
    ("chunked 2x256 after 1024", [256, 256], [1024, 1024]),
]
TINY_BATCHES = [CPU_BATCHES[0], CPU_BATCHES[2]]

PATHS = ("fused", "unfused")


@dataclass
class Layer:
    """One registered attention layer and how to make its op's inputs."""

    name: str
    kind: str  # "mla" or "gqa"
    impl: object
    heads: int
    width: int  # H * Dv

    def inputs(self, gen: torch.Generator, t: int, device, dtype) -> tuple:
        impl = self.impl
        if self.kind == "mla":
            q = torch.randn(t, impl.num_heads, impl.qk_nope_head_dim + impl.qk_rope_head_dim, generator=gen)
            kv = torch.randn(t, impl.kv_lora_rank, generator=gen)
            pe = torch.randn(t, 1, impl.qk_rope_head_dim, generator=gen)
            return tuple(x.to(device=device, dtype=dtype) for x in (q, kv, pe))
        q = torch.randn(t, impl.num_heads, impl.head_dim, generator=gen)
        k = torch.randn(t, impl.num_kv_heads, impl.head_dim, generator=gen)
        v = torch.randn(t, impl.num_kv_heads, impl.v_head_dim, generator=gen)
        return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))


def make_layers(device, tiny: bool) -> list[Layer]:
    from fusion_pass import runtime

    cuda = torch.device(device).type == "cuda"
    if cuda:  # DeepSeek's MLA prefill dims (192, 128) with 16 heads; GQA 32/8 heads of 128
        mla = dict(num_heads=16, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512)
        gqa = dict(num_heads=32, num_kv_heads=8, head_dim=128)
    else:
        mla = dict(num_heads=2, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, kv_lora_rank=64)
        gqa = dict(num_heads=4, num_kv_heads=2, head_dim=32)
    gen = torch.Generator().manual_seed(7)
    rows = mla["num_heads"] * (mla["qk_nope_head_dim"] + mla["v_head_dim"])
    weight = (torch.randn(rows, mla["kv_lora_rank"], generator=gen) * mla["kv_lora_rank"] ** -0.5).to(device)
    layers = [
        Layer("op_host_time.mla", "mla",
              runtime.MLAAttentionImpl(**mla, kv_b_proj_weight=weight,
                                       softmax_scale=(mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]) ** -0.5),
              mla["num_heads"], mla["num_heads"] * mla["v_head_dim"]),
        Layer("op_host_time.gqa", "gqa", runtime.AttentionImpl(**gqa, softmax_scale=gqa["head_dim"] ** -0.5),
              gqa["num_heads"], gqa["num_heads"] * gqa["head_dim"]),
    ]
    for layer in layers[:1] if tiny else layers:
        runtime.register_layer(layer.name, layer.impl)
    return layers[:1] if tiny else layers


def _spec(query_lens, context_lens):
    from fusion_pass.runtime import BatchSpec

    return BatchSpec.from_lens(query_lens, context_lens, [f"req{i}" for i in range(len(query_lens))])


def _prime_caches(layer: Layer, spec, device, dtype, gen) -> None:
    """Fill the layer's cache with each request's context (a prefill of ``context_len`` tokens)."""
    from fusion_pass import runtime

    with_context = [r for r in spec.requests if r.context_len]
    if not with_context:
        return
    prime = _spec([r.context_len for r in with_context], [0] * len(with_context))
    prime = type(prime)(tuple(type(r)(c.request_id, r.query_len) for r, c in zip(prime.requests, with_context)))
    inputs = layer.inputs(gen, prime.num_tokens, device, dtype)
    out = torch.empty(prime.num_tokens, layer.width, dtype=dtype, device=device)
    op = torch.ops.fusion_pass.mla_attention_with_output if layer.kind == "mla" else \
        torch.ops.fusion_pass.attention_with_output
    with runtime.batch(prime):
        op(*inputs, out, layer.name)


def count_python_calls(call) -> int:
    """Python function calls (``sys.setprofile`` ``call`` events) made by one ``call()``."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "call":
            count += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return count


def measure(layer: Layer, batch: tuple, device, dtype, backend: str, warmup: int, repeats: int) -> list[dict]:
    """Both paths of one layer and batch: ``[{"path", "median_us", "p10_us", "p90_us", "calls", "decision"}]``."""
    from fusion_pass import nvfp4, runtime
    from fusion_pass.runtime import counters, settings

    name, query_lens, context_lens = batch
    spec = _spec(query_lens, context_lens)
    t, width = spec.num_tokens, layer.width
    gen = torch.Generator().manual_seed(hash(name) % 2**31)
    runtime.clear_kv_caches()
    _prime_caches(layer, spec, device, dtype, gen)
    start = runtime.snapshot_kv_caches()
    sets = [layer.inputs(gen, t, device, dtype) for _ in range(min(4, warmup + repeats))]
    gs = torch.tensor([448 * 6 / 4.0], dtype=torch.float32, device=device)
    rows, cols = nvfp4.scale_shape(t, width)
    packed = torch.empty(t, width // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(rows, cols // 4, dtype=torch.int32, device=device)  # vLLM's allocation
    half = torch.empty(t, width, dtype=dtype, device=device)
    op = torch.ops.fusion_pass.mla_attention_with_output if layer.kind == "mla" else \
        torch.ops.fusion_pass.attention_with_output
    quant = torch.ops.fusion_pass.scaled_fp4_quant.out
    cuda = torch.device(device).type == "cuda"

    def fused(inputs):
        op(*inputs, packed, layer.name, gs, scales)

    def unfused(inputs):
        op(*inputs, half, layer.name)
        quant(half, gs, True, output=packed, output_scale=scales)

    results = []
    with settings.use_backend(backend), runtime.batch(spec):
        for path, call in (("fused", fused), ("unfused", unfused)):
            times = []
            before = counters.counters(layer.name)
            for i in range(warmup + repeats):
                runtime.restore_kv_caches(start)
                inputs = sets[i % len(sets)]
                if cuda:
                    torch.cuda.synchronize()
                began = time.perf_counter()
                call(inputs)
                elapsed = time.perf_counter() - began
                if i >= warmup:
                    times.append(elapsed * 1e6)
            after = counters.counters(layer.name)
            runtime.restore_kv_caches(start)
            calls = count_python_calls(lambda: call(sets[0]))
            if cuda:
                torch.cuda.synchronize()
            decided = {"fused": after["fused"] - before["fused"]}
            decided.update({f"fallback:{reason}": n - before["fallback"].get(reason, 0)
                            for reason, n in after["fallback"].items()})
            quantiles = statistics.quantiles(times, n=10) if len(times) > 1 else [times[0]] * 9
            results.append({"path": path, "median_us": statistics.median(times), "p10_us": quantiles[0],
                            "p90_us": quantiles[-1], "calls": calls, "decisions": decided})
    runtime.restore_kv_caches(start)
    return results


def run(device: str, backends: list[str], warmup: int, repeats: int, tiny: bool) -> dict:
    from fusion_pass import runtime

    if torch.device(device).type == "cpu":
        torch.set_num_threads(1)  # one thread: the CPU's computation without a thread pool's wake-ups
    dtype = torch.bfloat16
    layers = make_layers(device, tiny)
    batches = TINY_BATCHES if tiny else (CUDA_BATCHES if torch.device(device).type == "cuda" else CPU_BATCHES)
    rows = []
    try:
        for backend in backends:
            for layer in layers:
                for batch in batches:
                    for result in measure(layer, batch, device, dtype, backend, warmup, repeats):
                        rows.append({"backend": backend, "layer": layer.kind, "batch": batch[0],
                                     "tokens": sum(batch[1]), **result})
    finally:
        for layer in layers:
            runtime.unregister_layer(layer.name)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.device(device).type == "cuda" else platform.processor()
        or platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join(["python", "bench/op_host_time.py", *sys.argv[1:]]),
        "warmup": warmup,
        "repeats": repeats,
        "rows": rows,
    }


def table(report: dict) -> str:
    lines = [f"host time per attention call ({report['device']}, torch {report['torch']}, median of "
             f"{report['repeats']} after {report['warmup']} warm-up)",
             f"{'backend':10s} {'layer':5s} {'batch':26s} {'path':8s} {'median us':>10s} {'p10':>9s} {'p90':>9s} "
             f"{'calls':>6s}  decisions"]
    for r in report["rows"]:
        taken = ", ".join(f"{k} {v}" for k, v in r["decisions"].items() if v) or "not guarded"
        lines.append(f"{r['backend']:10s} {r['layer']:5s} {r['batch']:26s} {r['path']:8s} {r['median_us']:10.1f} "
                     f"{r['p10_us']:9.1f} {r['p90_us']:9.1f} {r['calls']:6d}  {taken}")
    pairs = {}
    for r in report["rows"]:
        pairs.setdefault((r["backend"], r["layer"], r["batch"]), {})[r["path"]] = r["median_us"]
    lines.append("fused / unfused host time: " + ", ".join(
        f"{layer} {batch} ({backend}) {p['fused'] / p['unfused']:.2f}x" for (backend, layer, batch), p in pairs.items()
        if "fused" in p and "unfused" in p))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", choices=("auto", "fa4", "triton", "reference", "all"), default=None,
                        help="the fused backend (default: reference on the CPU, auto on CUDA; all: fa4 and triton "
                             "on CUDA)")
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per path (default: 200)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls per path first (default: 20)")
    parser.add_argument("--tiny", action="store_true", help="one layer, two small batches (the CPU test)")
    parser.add_argument("--out", metavar="PATH", help="write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/op_host_time.py: --device cuda needs a CUDA device", file=sys.stderr)
        return 2
    if args.backend is None:
        backends = ["reference"] if args.device == "cpu" else ["auto"]
    elif args.backend == "all":
        backends = ["reference"] if args.device == "cpu" else ["fa4", "triton"]
    else:
        backends = [args.backend]
    import fusion_pass.ops  # noqa: F401  (registers torch.ops.fusion_pass)

    report = run(args.device, backends, args.warmup, args.repeats, args.tiny)
    print(table(report))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
