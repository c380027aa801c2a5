"""bench/attention.py's numbers into ratios, targets, a text table and a markdown section (pure Python).

A shape record holds, per path, one median per pass (``ms[path]``: on CUDA GPU ms per call by CUDA-graph
replay, on the CPU the wall ms of a synchronous call; ``host_us[path]``: host us per call, CUDA only); None
where the path did not run (``errors[path]`` says why).
"""

from __future__ import annotations

__all__ = ["HOST_TARGET_US", "RATIOS", "add_derived", "header_lines", "markdown", "nvfp4_lines", "per_pass_ratio",
           "shape_targets", "text_table"]

FUSED_OVER_FA4_MAX = 1.02  # issue 19: fused <= 1.02x FA4 bf16 alone
OVER_BEST_UNFUSED_MIN = 1.05  # fused >= 1.05x faster than the better of cuDNN + quant and FA4 + quant
HOST_TARGET_US = 40.0  # host time per fused call

RATIOS = {
    "cudnn_quant_over_fused": ("cudnn_quant", "fused"),
    "fa4_quant_over_fused": ("fa4_quant", "fused"),
    "fused_over_fa4": ("fused", "fa4"),
    "best_unfused_over_fused": ("best_unfused", "fused"),
}
"""Ratio name -> (numerator path, denominator path), per pass, of ``ms`` (GPU times on CUDA)."""


def per_pass_ratio(num: list, den: list) -> list:
    """``num[i] / den[i]`` per pass (None where either is missing)."""
    return [None if a is None or b is None else a / b for a, b in zip(num, den)]


def _min_or_none(*xs):
    known = [x for x in xs if x is not None]
    return min(known) if known else None


def add_derived(record: dict, passes: int) -> dict:
    """Fill ``record``'s derived paths (``cudnn_quant``: the faster cuDNN layout, ``best_unfused``: the faster of
    it and ``fa4_quant``, per pass), its ``ratios`` and TFLOP/s of the fused path; in place, returns it."""
    for table in ("ms", "host_us"):
        values = record[table]
        for path in ("fused", "fa4", "fa4_quant", "cudnn_quant_bshd", "cudnn_quant_bhsd"):
            values.setdefault(path, [None] * passes)
        values["cudnn_quant"] = [_min_or_none(a, b) for a, b in zip(values["cudnn_quant_bshd"], values["cudnn_quant_bhsd"])]
        values["best_unfused"] = [_min_or_none(a, b) for a, b in zip(values["cudnn_quant"], values["fa4_quant"])]
    gpu = record["ms"]
    record["cudnn_layout"] = [None if c is None else ("bshd" if c == a else "bhsd")
                              for c, a in zip(gpu["cudnn_quant"], gpu["cudnn_quant_bshd"])]
    record["ratios"] = {name: per_pass_ratio(gpu[a], gpu[b]) for name, (a, b) in RATIOS.items()}
    record["tflops_fused"] = [None if ms is None else record["flops"] / (ms * 1e-3) / 1e12 for ms in gpu["fused"]]
    return record


def _mid(xs: list) -> float | None:
    known = sorted(x for x in xs if x is not None)
    if not known:
        return None
    n = len(known)
    return known[n // 2] if n % 2 else (known[n // 2 - 1] + known[n // 2]) / 2


def fmt(x, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def fmt_range(xs: list, digits: int = 2, suffix: str = "x") -> str:
    """``"1.10-1.14x"`` over the passes (one value when they agree to ``digits``), ``n/a`` when none ran."""
    known = [x for x in xs if x is not None]
    if not known:
        return "n/a"
    lo, hi = f"{min(known):.{digits}f}", f"{max(known):.{digits}f}"
    return f"{lo}{suffix}" if lo == hi else f"{lo}-{hi}{suffix}"


def fmt_pct_range(xs: list) -> str:
    """``fused / FA4`` as ``"+27..31%"`` over the passes."""
    known = [(x - 1) * 100 for x in xs if x is not None]
    if not known:
        return "n/a"
    lo, hi = f"{min(known):+.0f}", f"{max(known):+.0f}"
    return f"{lo}%" if lo == hi else f"{lo}..{hi.lstrip('+')}%"


HEADER = ("shape", "fused ms", "FA4 bf16 ms", "FA4+quant ms", "cuDNN+quant ms", "fused vs cuDNN+quant",
          "fused vs FA4+quant", "fused vs FA4 bf16", "fused TFLOP/s", "host us fused", "host us FA4",
          "host us FA4+quant", "host us cuDNN+quant")


def rows(results: dict) -> list[list[str]]:
    """One row per shape: times are the median over passes; ratios the range over passes."""
    out = []
    for r in results["shapes"]:
        gpu, host, ratios = r["ms"], r["host_us"], r["ratios"]
        layouts = sorted({x for x in r["cudnn_layout"] if x})
        cudnn = fmt(_mid(gpu["cudnn_quant"])) + (f" ({'/'.join(layouts)})" if layouts else "")
        out.append([r["label"], fmt(_mid(gpu["fused"])), fmt(_mid(gpu["fa4"])), fmt(_mid(gpu["fa4_quant"])), cudnn,
                    fmt_range(ratios["cudnn_quant_over_fused"]), fmt_range(ratios["fa4_quant_over_fused"]),
                    fmt_pct_range(ratios["fused_over_fa4"]), fmt(_mid(r["tflops_fused"]), 0),
                    fmt(_mid(host["fused"]), 1), fmt(_mid(host["fa4"]), 1), fmt(_mid(host["fa4_quant"]), 1),
                    fmt(_mid(host["cudnn_quant"]), 1)])
    return out


def text_table(header, body) -> str:
    """Fixed-width text: the first column left-aligned, the rest right-aligned."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in body])


def markdown_table(header, body) -> str:
    align = ["---"] + ["---:"] * (len(header) - 1)
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [list(header), align] + body)


def _target(tid: str, text: str, status: str, measured: str) -> dict:
    return {"id": tid, "text": text, "status": status, "measured": measured}


def shape_targets(results: dict) -> list[dict]:
    """Issue 19's kernel targets over every shape and every pass: met / not met / not measured."""
    shapes = results["shapes"]
    out = []
    if results.get("device_type") != "cuda":
        return [_target(t, "issue 19's kernel targets", "not measured", "not a GPU run") for t in ("T1", "T2", "T3")]
    specs = (
        ("T1", f"fused <= {FUSED_OVER_FA4_MAX:.2f}x FA4 bf16 alone at every shape (GPU time, every pass)",
         "fused_over_fa4", lambda x: x <= FUSED_OVER_FA4_MAX, max),
        ("T2", f"fused >= {OVER_BEST_UNFUSED_MIN:.2f}x faster than the better of cuDNN+quant and FA4+quant at every "
               "shape (GPU time, every pass)", "best_unfused_over_fused", lambda x: x >= OVER_BEST_UNFUSED_MIN, min),
    )
    for tid, text, key, ok, worst in specs:
        values = [(x, r["label"]) for r in shapes for x in r["ratios"][key] if x is not None]
        if not values:
            out.append(_target(tid, text, "not measured", "no shape with both numbers"))
            continue
        failing = sorted({label for x, label in values if not ok(x)})
        w = worst(values)
        measured = f"worst {w[0]:.3f}x at {w[1]}" + (f"; missed at {len(failing)} shape(s): {', '.join(failing)}"
                                                     if failing else "")
        missing = [r["label"] for r in shapes if all(x is None for x in r["ratios"][key])]
        if missing:
            measured += f"; not measured at {', '.join(missing)}"
        out.append(_target(tid, text, "not met" if failing else "met", measured))
    text = f"host time per fused call <= {HOST_TARGET_US:.0f} us at every shape (median per pass)"
    values = [(x, r["label"]) for r in shapes for x in r["host_us"]["fused"] if x is not None]
    if not values:
        out.append(_target("T3", text, "not measured", "no fused call timed on a GPU"))
    else:
        failing = sorted({label for x, label in values if x > HOST_TARGET_US})
        w = max(values)
        out.append(_target("T3", text, "not met" if failing else "met",
                           f"worst {w[0]:.1f} us at {w[1]}" + (f"; above at {', '.join(failing)}" if failing else "")))
    return out


STATUS = {"met": "Met", "not met": "Not met", "not measured": "Not measured"}


def markdown(results: dict, meta: dict) -> str:
    """The docs section: date, device, command, method, L2 policy, the table, bandwidth, targets, errors."""
    return "\n".join(header_lines(results, meta) + nvfp4_lines(results)) + "\n"


def header_lines(results: dict, meta: dict) -> list[str]:
    """The section's provenance: date, device, command, method, L2 policy, cuDNN note, then a blank line."""
    return [
        f"- Date: {meta['date']} (UTC)",
        f"- Device: {meta['device']}; torch {meta['torch']}" + "".join(
            f", {k} {meta[k]}" for k in ("triton", "cuda", "cudnn", "flash_attn") if meta.get(k)),
        f"- Command: `{meta['command']}`",
        f"- Method: {results['method']}",
        f"- L2: {results['l2_policy']}",
        f"- cuDNN and varlen: {results['cudnn_note']}",
        "",
    ]


def nvfp4_lines(results: dict) -> list[str]:
    """The NVFP4 part: the table, bandwidth, targets, paths that did not run."""
    lines = [markdown_table(HEADER, rows(results)), ""]
    bandwidth = results.get("bandwidth")
    if bandwidth:
        body = [[f"quantize bf16 [{r['m']}, {r['k']}] ({r['mib']} MiB)", fmt(r["ms"], 4), fmt(r["tbps"], 2)]
                for r in bandwidth["quant"]]
        c = bandwidth["copy"]
        body.append([f"device-to-device copy, {c['bytes'] / 2**30:g} GiB (read + write)", fmt(c["ms"], 4),
                     fmt(c["tbps"], 2)])
        lines += [markdown_table(("bandwidth (CUDA-graph replay)", "ms", "TB/s"), body), ""]
    lines.append("Targets (issue 19, this run):")
    lines.append("")
    lines += [f"- **{STATUS[t['status']]}.** ({t['id']}) {t['text']}: {t['measured']}." for t in results["targets"]]
    errors = error_lines(results)
    if errors:
        lines += ["", "Paths that did not run:", ""] + [f"- `{e}`" for e in errors]
    return lines


def error_lines(results: dict, limit: int = 300) -> list[str]:
    """``label, path: reason`` for every path that did not run, each on one shortened line."""
    out = []
    for r in results["shapes"]:
        for path, reason in r["errors"].items():
            text = " ".join(f"{r['label']}, {path}: {reason}".replace("`", "'").split())
            out.append(text if len(text) <= limit else text[: limit - 3] + "...")
    return out
