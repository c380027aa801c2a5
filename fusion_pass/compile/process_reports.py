"""Reports that processes wrote under ``FUSION_PASS_DUMP``, read back and added up.

Inside vLLM the pass runs in the engine's worker processes, not in the one that
built the configuration. Each process that ran the pass writes its report to
``<dir>/vllm_report_<pid>.json`` (:mod:`fusion_pass.vllm`);
:func:`summarize` adds them up and ``fusion-pass report DIR`` prints the result.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

PATTERN = "vllm_report_*.json"


def summarize(directory: str | Path) -> dict:
    """Totals over every ``vllm_report_<pid>.json`` in ``directory``, and one line per process.

    Returns ``{"processes": [...], "graphs", "candidates", "rewritten", "refused": {reason: n},
    "fused": n, "fused_by_backend": {name: n}, "fallback": {reason: n}}``; the run-time counts are each
    process's whole (a report's ``runtime_process``, else its ``runtime``). Raises
    ``FileNotFoundError`` naming the directory when it holds no report.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"fusion-pass report: {directory} is not a directory")
    paths = sorted(directory.glob(PATTERN))
    if not paths:
        raise FileNotFoundError(
            f"fusion-pass report: no {PATTERN} in {directory} (set FUSION_PASS_DUMP={directory} for the vLLM "
            f"processes; an FX-graph-cache hit skips the pass, see docs/vllm.md)")
    refused, fused_by, fallback = Counter(), Counter(), Counter()
    totals = {"graphs": 0, "candidates": 0, "rewritten": 0, "fused": 0}
    processes = []
    for path in paths:
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"fusion-pass report: cannot read {path}: {exc}") from exc
        # the process's run-time counters: one vLLM process runs one model, and a graph its pass did not see
        # (served by a cache) still runs fused calls; older reports only have "runtime"
        runtime = report.get("runtime_process") or report.get("runtime") or {}
        for key in ("graphs", "candidates", "rewritten"):
            totals[key] += int(report.get(key, 0))
        totals["fused"] += int(runtime.get("fused", 0))
        refused.update(report.get("refused") or {})
        fused_by.update(runtime.get("fused_by_backend") or {})
        fallback.update(runtime.get("fallback") or {})
        processes.append({"file": path.name, "pid": report.get("pid"), "graphs": report.get("graphs", 0),
                          "candidates": report.get("candidates", 0), "rewritten": report.get("rewritten", 0),
                          "refused": report.get("refused") or {}, "disabled_reason": report.get("disabled_reason")})
    return {"processes": processes, **totals, "refused": dict(refused), "fused_by_backend": dict(fused_by),
            "fallback": dict(fallback)}


def format_summary(summary: dict) -> str:
    def reasons(counts: dict) -> str:
        return ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"

    lines = [f"{'pid':>8} {'graphs':>6} {'candidates':>10} {'rewritten':>9}  refused"]
    for p in summary["processes"]:
        note = f"  (pass disabled: {p['disabled_reason']})" if p["disabled_reason"] else ""
        lines.append(f"{str(p['pid']):>8} {p['graphs']:>6} {p['candidates']:>10} {p['rewritten']:>9}  "
                     f"{reasons(p['refused'])}{note}")
    lines += [
        "",
        f"total: {len(summary['processes'])} processes, {summary['graphs']} graphs, {summary['candidates']} "
        f"attention layers seen, {summary['rewritten']} rewritten, refused: {reasons(summary['refused'])}",
        f"run time: {summary['fused']} fused calls ({reasons(summary['fused_by_backend'])}), "
        f"fallback calls: {reasons(summary['fallback'])}",
    ]
    return "\n".join(lines)
