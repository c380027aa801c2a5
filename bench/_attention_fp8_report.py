"""bench/attention.py's FP8 numbers into ratios, issue 28's targets, tables and markdown sections (pure Python).

An FP8 shape record (one per format and shape) holds per path (``fused``, ``triton_fused``, ``fa4``, ``fa4_quant``,
``cudnn_quant``) one median per pass: ``ms[path]`` (CUDA: GPU ms per call by CUDA-graph replay; CPU: wall ms of a
synchronous call) and ``host_us[path]`` (host us per call, CUDA only); None where the path did not run
(``errors[path]`` says why).
"""

from __future__ import annotations

from _attention_report import STATUS, _mid, _min_or_none, _target, fmt, fmt_range, markdown_table, per_pass_ratio

__all__ = ["FP8_TARGETS", "HEADER", "RATIOS", "add_derived", "check_lines", "error_lines", "markdown_section", "rows",
           "targets", "title"]

PATHS = ("fused", "triton_fused", "fa4", "fa4_quant", "cudnn_quant")
RATIOS = {
    "fused_over_fa4": ("fused", "fa4"),
    "fused_over_best_unfused": ("fused", "best_unfused"),
    "best_unfused_over_fused": ("best_unfused", "fused"),
    "triton_fused_over_fa4": ("triton_fused", "fa4"),
    "fused_over_triton_fused": ("fused", "triton_fused"),
}
"""Ratio name -> (numerator path, denominator path), per pass, of ``ms``; ``best_unfused``: the faster of
``fa4_quant`` and ``cudnn_quant`` in that pass."""

FP8_TARGETS = {
    "fp8_static": (
        ("S1", "FP8 static fused <= 1.02x FA4 bf16 alone at every shape (GPU time, every pass)",
         "fused_over_fa4", lambda x: x <= 1.02, max, None),
        ("S2", "FP8 static fused >= 1.05x faster than the better of FA4+quant and cuDNN+quant at every shape whose "
               "sequences (context + new tokens) are <= 2048 (GPU time, every pass)",
         "best_unfused_over_fused", lambda x: x >= 1.05, min, 2048),
    ),
    "fp8_group128": (
        ("G1", "128-group FP8 fused <= 1.05x FA4 bf16 alone at every shape (GPU time, every pass)",
         "fused_over_fa4", lambda x: x <= 1.05, max, None),
    ),
}
"""Issue 28's kernel targets per format: (id, text, ratio, test, worst of the values, longest sequence or None)."""

TITLES = {"fp8_static": "FP8 static per tensor", "fp8_group128": "FP8 dynamic, one scale per row and 128 columns"}


def title(fmt_name: str, key: str) -> str:
    """The section title of a format (``key``: its ``OutputFormat.key``)."""
    return f"{TITLES.get(fmt_name, fmt_name)} (`{key}`)"


def add_derived(record: dict, passes: int) -> dict:
    """Fill ``record``'s ``best_unfused`` (the faster of ``fa4_quant`` and ``cudnn_quant`` per pass), its
    ``ratios`` and TFLOP/s of the fused path; in place, returns it."""
    for table in ("ms", "host_us"):
        values = record[table]
        for path in PATHS:
            values.setdefault(path, [None] * passes)
        values["best_unfused"] = [_min_or_none(a, b) for a, b in zip(values["fa4_quant"], values["cudnn_quant"])]
    gpu = record["ms"]
    record["best_unfused_path"] = [None if m is None else ("fa4_quant" if m == a else "cudnn_quant")
                                   for m, a in zip(gpu["best_unfused"], gpu["fa4_quant"])]
    record["ratios"] = {name: per_pass_ratio(gpu[a], gpu[b]) for name, (a, b) in RATIOS.items()}
    record["tflops_fused"] = [None if ms is None else record["flops"] / (ms * 1e-3) / 1e12 for ms in gpu["fused"]]
    return record


HEADER = ("shape", "fused ms", "Triton fused ms", "FA4 bf16 ms", "FA4+quant ms", "cuDNN+quant ms", "fused / FA4 bf16",
          "fused / best unfused", "Triton fused / FA4 bf16", "fused TFLOP/s", "host us fused", "host us Triton fused",
          "host us FA4", "host us FA4+quant", "host us cuDNN+quant")


def rows(records: list[dict]) -> list[list[str]]:
    """One row per shape: times the median over passes, ratios the range over passes (best unfused: which won)."""
    out = []
    for r in records:
        gpu, host, ratios = r["ms"], r["host_us"], r["ratios"]
        won = sorted({x.replace("_quant", "") for x in r["best_unfused_path"] if x})
        best = fmt_range(ratios["fused_over_best_unfused"], 3) + (f" ({'/'.join(won)})" if won else "")
        out.append([r["label"], *(fmt(_mid(gpu[p])) for p in PATHS), fmt_range(ratios["fused_over_fa4"], 3), best,
                    fmt_range(ratios["triton_fused_over_fa4"], 3), fmt(_mid(r["tflops_fused"]), 0),
                    *(fmt(_mid(host[p]), 1) for p in PATHS)])
    return out


def targets(fmt_name: str, records: list[dict], device_type: str) -> list[dict]:
    """Issue 28's targets of ``fmt_name`` over its records and every pass: met / not met / not measured."""
    specs = FP8_TARGETS.get(fmt_name, ())
    if device_type != "cuda":
        return [_target(tid, text, "not measured", "not a GPU run") for tid, text, *_ in specs]
    out = []
    for tid, text, key, ok, worst, longest in specs:
        shapes = [r for r in records if longest is None or r["context"] + r["q_len"] <= longest]
        values = [(x, r["label"]) for r in shapes for x in r["ratios"][key] if x is not None]
        if not values:
            why = "no shape with both numbers" if shapes else f"no shape with sequences <= {longest} in this run"
            out.append(_target(tid, text, "not measured", why))
            continue
        failing = sorted({label for x, label in values if not ok(x)})
        w = worst(values)
        measured = f"worst {w[0]:.3f}x at {w[1]}" + (f"; missed at {len(failing)} shape(s): {', '.join(failing)}"
                                                     if failing else "")
        missing = [r["label"] for r in shapes if all(x is None for x in r["ratios"][key])]
        if missing:
            measured += f"; not measured at {', '.join(missing)}"
        out.append(_target(tid, text, "not met" if failing else "met", measured))
    return out


def check_lines(records: list[dict]) -> list[str]:
    """One line per check over the shapes: how many shapes passed it, the worst value, and every failure."""
    counts: dict[str, list] = {}
    for r in records:
        for name, c in r["check"].items():
            entry = counts.setdefault(name, [0, 0, None])
            values = [v for k, v in c.items() if k.endswith("_equal") and v is not None]
            ok = (c["within_bound"] == 1.0) if "within_bound" in c else all(v == 1.0 for v in values)
            entry[0] += ok
            entry[1] += 1
            if "worst_over_bound" in c:
                entry[2] = max(entry[2] or 0.0, c["worst_over_bound"])
    what = {"fused": "fused bytes == the reference quantizer of FA4's bf16 output",
            "fa4_quant_vs_reference": "compiled quant of FA4's output == the reference quantizer's bytes",
            "cudnn_quant_vs_reference": "compiled quant of cuDNN's output == the reference quantizer's bytes",
            "triton_fused": "Triton fused within the bound of FA4's bf16 output",
            "cudnn_quant": "cuDNN + quant within the bound of FA4's bf16 output"}
    lines = []
    for name, (ok, n, worst) in counts.items():
        extra = "" if worst is None else f" (worst error / bound {worst:.3f})"
        lines.append(f"{what.get(name, name)}: {ok} of {n} shapes{extra}")
    lines += [f"FAILED at {r['label']}: {f}" for r in records for f in r["check_failures"]]
    return lines


def error_lines(records: list[dict], limit: int = 300) -> list[str]:
    """``label, path: reason`` for every path that did not run, each on one shortened line."""
    out = []
    for r in records:
        for path, reason in r["errors"].items():
            text = " ".join(f"{r['label']}, {path}: {reason}".replace("`", "'").split())
            out.append(text if len(text) <= limit else text[: limit - 3] + "...")
    return out


def markdown_section(fmt_name: str, block: dict) -> str:
    """The markdown of one FP8 format: title, table, targets, checks, paths that did not run."""
    lines = [f"### {title(fmt_name, block['format'])}", "", markdown_table(HEADER, rows(block["shapes"])), "",
             "Targets (issue 28, this run):", ""]
    lines += [f"- **{STATUS[t['status']]}.** ({t['id']}) {t['text']}: {t['measured']}." for t in block["targets"]]
    checks = check_lines(block["shapes"])
    if checks:
        lines += ["", "Checks (first call of each path, input set 0):", ""] + [f"- {c}" for c in checks]
    errors = error_lines(block["shapes"])
    if errors:
        lines += ["", "Paths that did not run:", ""] + [f"- `{e}`" for e in errors]
    return "\n".join(lines) + "\n"
