"""The quantizer alone: effective TB/s of ``Kernels.quantize_into`` on bf16 inputs of a few sizes, beside a
device-to-device copy (the memory-bandwidth ceiling), GPU time by CUDA-graph replay (bench/_timing.py)."""

from __future__ import annotations

import torch

from fusion_pass.nvfp4 import round_up

import _timing
from _kernels import Kernels

__all__ = ["QUANT_SIZES_MIB", "QUANT_TARGETS", "measure_quant_bandwidth", "quant_bytes", "quant_targets"]

QUANT_K = 4096
QUANT_SIZES_MIB = (16, 64, 512)
"""bf16 input sizes, MiB ([size * 2**20 / (2 * 4096), 4096])."""
QUANT_TARGETS = ((64, 3.4), (16, 2.5))
"""(smallest input MiB, TB/s): issue 19's quantizer targets (>= 3.4 TB/s from 64 MiB up, >= 2.5 TB/s at 16 MiB)."""
COPY_BYTES = 2**30


def quant_bytes(m: int, k: int) -> int:
    """Bytes a quantization of bf16 ``[m, k]`` moves: read ``2mk``, write ``mk/2`` packed + the swizzled scales."""
    return 2 * m * k + m * k // 2 + round_up(m, 128) * round_up(k // 16, 4)


def measure_quant_bandwidth(kernels: Kernels, *, device, seed: int, replays: int, target_ms: float) -> dict:
    """``{"quant": [{"mib", "m", "k", "bytes", "ms", "tbps", "samples_ms"}], "copy": {...}}``; an entry's
    ``error`` says why it has no number."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    rows = []
    for mib in QUANT_SIZES_MIB:
        m = mib * 2**20 // (2 * QUANT_K)
        entry = {"mib": mib, "m": m, "k": QUANT_K, "bytes": quant_bytes(m, QUANT_K), "ms": None, "tbps": None,
                 "samples_ms": [], "error": None}
        try:
            x = torch.randn(m, QUANT_K, generator=gen, device=device, dtype=torch.bfloat16)
            gs = torch.full((1,), 448.0 * 6.0 / x.abs().amax().float().item(), device=device)
            packed = torch.empty(m, QUANT_K // 2, dtype=torch.uint8, device=device)
            scales = torch.empty(round_up(m, 128), QUANT_K // 16, dtype=torch.float8_e4m3fn, device=device)
            call = lambda: kernels.quantize_into(x, gs, packed, scales)  # noqa: E731
            call()
            est = _timing.median(_timing.event_ms(call, repeats=3))
            samples = _timing.graph_replay_ms(call, calls=_timing.calls_for(est, target_ms), replays=replays)
            entry.update(samples_ms=samples, ms=_timing.median(samples))
            entry["tbps"] = entry["bytes"] / (entry["ms"] * 1e-3) / 1e12
        except Exception as exc:  # noqa: BLE001 - a failure is a result here
            entry["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(entry)
    copy = {"bytes": COPY_BYTES, "bytes_moved": 2 * COPY_BYTES, "ms": None, "tbps": None, "error": None}
    try:
        src = torch.randn(COPY_BYTES // 2, generator=gen, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        samples = _timing.graph_replay_ms(lambda: dst.copy_(src), calls=4, replays=replays)
        copy.update(ms=_timing.median(samples), samples_ms=samples)
        copy["tbps"] = 2 * COPY_BYTES / (copy["ms"] * 1e-3) / 1e12
    except Exception as exc:  # noqa: BLE001
        copy["error"] = f"{type(exc).__name__}: {exc}"
    return {"quant": rows, "copy": copy}


def quant_targets(bandwidth: dict | None) -> list[dict]:
    """Issue 19's quantizer targets, each ``{"id", "text", "status", "measured"}``."""
    out = []
    for i, (mib, tbps) in enumerate(QUANT_TARGETS, 1):
        text = f"quantizer >= {tbps} TB/s at {'>= ' if mib >= 64 else ''}{mib} MiB bf16 inputs"
        rows = [r for r in (bandwidth or {}).get("quant", []) if (r["mib"] >= mib if mib >= 64 else r["mib"] == mib)]
        if not rows:
            out.append({"id": f"Q{i}", "text": text, "status": "not measured", "measured": "not run"})
            continue
        measured = ", ".join(f"{r['mib']} MiB: " + ("error" if r["tbps"] is None else f"{r['tbps']:.2f} TB/s")
                             for r in rows)
        met = all(r["tbps"] is not None and r["tbps"] >= tbps for r in rows)
        out.append({"id": f"Q{i}", "text": text, "status": "met" if met else "not met", "measured": measured})
    return out
