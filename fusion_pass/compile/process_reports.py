"""Reports that processes wrote under ``FUSION_PASS_DUMP``, read back and added up.

Inside vLLM the pass runs in the engine's worker processes, not in the one that
built the configuration. Each process that ran the pass writes its report to
``<dir>/reports/vllm_report_<pid>.json`` (:mod:`fusion_pass.vllm.compile.report_file`; kept
current with the run-time counters while it serves), apart from the graph dumps
in ``<dir>/run_NNN_pid<PID>/`` (:mod:`fusion_pass.compile.debug`); releases before that wrote ``<dir>/vllm_report_<pid>.json``, which is
read too. :func:`summarize` adds them up and ``fusion-pass report DIR`` prints the result.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

PATTERN = "vllm_report_*.json"
REPORTS_DIR = "reports"  # the same folder as fusion_pass.vllm.compile.report_file.REPORTS_DIR (which needs vLLM)


def report_files(directory: str | Path) -> list[Path]:
    """The process reports under ``directory``: ``reports/vllm_report_*.json``, then the older place,
    ``vllm_report_*.json`` in ``directory`` itself (given the ``reports`` folder itself, its files)."""
    directory = Path(directory)
    return sorted((directory / REPORTS_DIR).glob(PATTERN)) + sorted(directory.glob(PATTERN))


def _tokens(runtime: dict) -> dict:
    tokens = runtime.get("tokens") or {}
    return {"prefill": int(tokens.get("prefill", 0)), "prefill_fused": int(tokens.get("prefill_fused", 0)),
            "decode_fused": int(tokens.get("decode_fused", 0)), "post_quantized": dict(tokens.get("post_quantized") or {})}


def summarize(directory: str | Path) -> dict:
    """Totals over every process report under ``directory`` (:func:`report_files`), and one entry per process.

    Returns ``{"processes": [...], "graphs", "candidates", "rewritten", "refused": {reason: n}, "left": {reason: n},
    "fused": n, "fused_by_backend": {name: n}, "fallback": {reason: n},
    "tokens": {"prefill": n, "prefill_fused": n, "decode_fused": n, "post_quantized": {reason: n}}}``; each process entry has the
    same run-time keys (its own counts) and ``file`` (relative to ``directory``), ``pid``, ``written_on``
    (``"graph"``, ``"counters"``, ``"exit"``; None for older reports), ``notices`` (why the pass could not act in
    that process: ``[{"key", "message"}]``, :mod:`fusion_pass.vllm.notices`). The run-time counts are each process's
    whole (a report's ``runtime_process``, else its ``runtime``). Raises ``FileNotFoundError`` naming the
    directory when it is not one or holds no report, ``ValueError`` naming the file that cannot be read.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"fusion-pass report: {directory} is not a directory")
    paths = report_files(directory)
    if not paths:
        raise FileNotFoundError(
            f"fusion-pass report: no {PATTERN} in {directory / REPORTS_DIR} or {directory} (set "
            f"FUSION_PASS_DUMP={directory} for the vLLM processes; an FX-graph-cache hit skips the pass, see "
            f"docs/vllm.md)")
    refused, left, fused_by, fallback, post = Counter(), Counter(), Counter(), Counter(), Counter()
    totals = {"graphs": 0, "candidates": 0, "rewritten": 0, "fused": 0}
    prefill = prefill_fused = decode_fused = 0
    processes = []
    for path in paths:
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"fusion-pass report: cannot read {path}: {exc}") from exc
        if not isinstance(report, dict):
            raise ValueError(f"fusion-pass report: {path} holds a {type(report).__name__}, not a report object")
        # the process's run-time counters: one vLLM process runs one model, and a graph its pass did not see
        # (served by a cache) still runs fused calls; older reports only have "runtime"
        runtime = report.get("runtime_process") or report.get("runtime") or {}
        tokens = _tokens(runtime)
        for key in ("graphs", "candidates", "rewritten"):
            totals[key] += int(report.get(key, 0))
        totals["fused"] += int(runtime.get("fused", 0))
        refused.update(report.get("refused") or {})
        left.update(report.get("left") or {})
        fused_by.update(runtime.get("fused_by_backend") or {})
        fallback.update(runtime.get("fallback") or {})
        prefill += tokens["prefill"]
        prefill_fused += tokens["prefill_fused"]
        decode_fused += tokens["decode_fused"]
        post.update(tokens["post_quantized"])
        processes.append({"file": str(path.relative_to(directory)), "pid": report.get("pid"),
                          "graphs": report.get("graphs", 0), "candidates": report.get("candidates", 0),
                          "rewritten": report.get("rewritten", 0), "refused": report.get("refused") or {},
                          "disabled_reason": report.get("disabled_reason"), "written_on": report.get("written_on"),
                          "notices": [n for n in report.get("notices") or () if isinstance(n, dict)],
                          "fused": int(runtime.get("fused", 0)),
                          "fused_by_backend": dict(runtime.get("fused_by_backend") or {}),
                          "fallback": dict(runtime.get("fallback") or {}), "tokens": tokens})
    return {"processes": processes, **totals, "refused": dict(refused), "left": dict(left),
            "fused_by_backend": dict(fused_by),
            "fallback": dict(fallback),
            "tokens": {"prefill": prefill, "prefill_fused": prefill_fused, "decode_fused": decode_fused,
                       "post_quantized": dict(post)}}


def format_summary(summary: dict) -> str:
    def reasons(counts: dict) -> str:
        return ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"

    def tokens(t: dict) -> str:
        return f"{t['prefill_fused']}/{t['prefill']}"

    lines = [f"{'pid':>8} {'graphs':>6} {'candidates':>10} {'rewritten':>9} {'fused':>7} {'prefill fused':>13}  "
             f"refused"]
    for p in summary["processes"]:
        note = f"  (pass disabled: {p['disabled_reason']})" if p["disabled_reason"] else ""
        lines.append(f"{str(p['pid']):>8} {p['graphs']:>6} {p['candidates']:>10} {p['rewritten']:>9} "
                     f"{p['fused']:>7} {tokens(p['tokens']):>13}  {reasons(p['refused'])}{note}")
    said = [(p["pid"], n) for p in summary["processes"] for n in p.get("notices") or ()]
    if said:
        lines += ["", "notices (why the pass could not act):"]
        lines += [f"  pid {pid}: {n.get('key')}: {n.get('message')}" for pid, n in said]
    t = summary["tokens"]
    lines += [
        "",
        f"total: {len(summary['processes'])} processes, {summary['graphs']} graphs, {summary['candidates']} "
        f"attention layers seen, {summary['rewritten']} rewritten, "
        + (f"left quantized: {reasons(summary['left'])}, " if summary.get("left") else "")
        + f"refused: {reasons(summary['refused'])}",
        f"run time: {summary['fused']} fused calls ({reasons(summary['fused_by_backend'])}), "
        f"fallback calls: {reasons(summary['fallback'])}",
        f"tokens: {t['prefill_fused']} of {t['prefill']} prefill tokens fused"
        + (f", {t['decode_fused']} decode tokens fused with them" if t.get("decode_fused") else "")
        + ", post-quantized: "
        f"{reasons(t['post_quantized'])}",
    ]
    return "\n".join(lines)
