"""A pass's report (:meth:`fusion_pass.FusionPass.report`) in a few readable lines: :func:`summarize`."""

from __future__ import annotations

__all__ = ["summarize"]


def _counts(counts: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"


def summarize(report: dict) -> str:
    """Three lines (four when the FX graph cache served every compile): what the pass matched, what ran at run time,
    and the tokens fused. A compile Inductor's FX graph cache served ran no pass (its graph keeps the rewrite made when
    it was first compiled), so a report of only such compiles shows no match counts: the summary says so and how to
    see them."""
    runtime_counts = report["runtime"]
    tokens = runtime_counts["tokens"]
    share = f" ({tokens['prefill_fused'] / tokens['prefill']:.1%})" if tokens["prefill"] else ""
    cached = report.get("graphs_from_cache", 0)
    layers = len(report.get("rewritten_layers", ())) or report["rewritten"]
    lines = [
        f"pass: {report['graphs']} graphs" + (f" (+{cached} served by the FX graph cache, the pass not run)" if cached
                                              else "")
        + f", {report['candidates']} attention layers seen, {report['rewritten']} rewritten, refused: "
          f"{_counts(report['refused'])}, {report['seconds'] * 1e3:.1f} ms in the pass",
        f"run time: {runtime_counts['fused']} fused calls, fallback calls: {_counts(runtime_counts['fallback'])} (the "
        f"calls of the {layers} rewritten layer{'s' if layers != 1 else ''})",
        f"tokens, summed over every call of those layers (each prefill token once per layer): "
        f"{tokens['prefill_fused']} of {tokens['prefill']} prefill tokens fused{share}"
        + (f", {tokens['decode_fused']} decode tokens fused with them" if tokens.get("decode_fused") else "")
        + ", post-quantized: "
        f"{_counts(tokens['post_quantized'])}",
    ]
    if cached and not report["graphs"]:
        lines.append(f"note: every compile was served by Inductor's FX graph cache ({cached}): the pass did not run, "
                     f"so nothing above counts its matches, and run-time counts cover only layers it rewrote in this "
                     f"process; compile with torch._inductor.config.fx_graph_cache=False (or "
                     f"TORCHINDUCTOR_FX_GRAPH_CACHE=0) to see them")
    return "\n".join(lines)
