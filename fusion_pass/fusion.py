"""The fusion pass: an Inductor post-grad custom pass, its match report, and ``enable()``.

Three ways to register it:

* ``fusion_pass.enable()`` (a function and a context manager) installs a
  :class:`FusionPass` as ``torch._inductor.config.post_grad_custom_post_pass``,
  chained after a pass already installed there;
* ``torch.compile(model, options={"post_grad_custom_post_pass": FusionPass()})``;
* vLLM's compilation config (the vLLM adapter).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from fusion_pass import debug, matcher
from fusion_pass.patterns import PATTERNS, AttentionQuantPattern, OpVocabulary, fusion_pass_vocabulary

logger = logging.getLogger("fusion_pass")


@dataclass
class GraphReport:
    """What the pass did to one graph."""

    graph: int
    candidates: int = 0
    rewritten: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    layers: list[dict] = field(default_factory=list)  # one entry per candidate: layer, pattern, outcome

    def line(self) -> str:
        refused = ", ".join(f"{k}={v}" for k, v in sorted(self.refused.items())) or "none"
        return (f"fusion_pass: graph {self.graph}: {self.candidates} candidates, {self.rewritten} rewritten, "
                f"refused: {refused} ({self.seconds * 1e3:.1f} ms)")


class FusionPass(CustomGraphPass):
    """Rewrites attention -> scaled_fp4_quant -> NVFP4 GEMM into one NVFP4-output attention call.

    ``patterns``: entries of :data:`fusion_pass.patterns.PATTERNS` (default: all);
    ``vocabularies``: op vocabularies to match (default: ``torch.ops.fusion_pass``).
    """

    def __init__(self, patterns: tuple[AttentionQuantPattern, ...] | None = None,
                 vocabularies: tuple[OpVocabulary, ...] | None = None):
        self.patterns = tuple(PATTERNS if patterns is None else patterns)
        if not self.patterns:
            raise ValueError("FusionPass: patterns must name at least one pattern")
        self.vocabularies = tuple(vocabularies) if vocabularies is not None else (fusion_pass_vocabulary(),)
        self.graphs: list[GraphReport] = []
        for vocab in self.vocabularies:  # trace once per process (cached), here rather than per graph
            for pattern in self._patterns_for(vocab):
                matcher.anchor_ops(pattern, vocab)
                for form in ("v1", "v2"):
                    matcher.traced_replacement(pattern, vocab, form)

    def _patterns_for(self, vocab: OpVocabulary):
        roles = vocab.attention_ops().values()
        return [p for p in self.patterns if p.role in roles]

    # -- CustomGraphPass -------------------------------------------------------------------

    def uuid(self) -> str:
        """Changes with the pattern set, the pattern code, the vocabularies and the matcher."""
        h = hashlib.sha256()
        for pattern in self.patterns:
            h.update(pattern.name.encode())
            for fn in (pattern.pattern, pattern.replacement, pattern.extra_check):
                h.update(inspect.getsource(fn).encode())
        for vocab in self.vocabularies:
            h.update(repr(vocab).encode())
        h.update(inspect.getsource(matcher).encode())
        return h.hexdigest()

    def __call__(self, graph: torch.fx.Graph) -> None:
        start = time.perf_counter()
        report = GraphReport(graph=len(self.graphs))
        before = debug.graph_source(graph) if debug.active() else None
        for vocab in self.vocabularies:
            self._run(graph, vocab, report)
        if report.rewritten:
            graph.lint()
        report.seconds = time.perf_counter() - start
        self.graphs.append(report)
        if report.candidates:
            logger.info(report.line())
        if before is not None:
            debug.record_graph(report.graph, before, debug.graph_source(graph), asdict(report))

    def _run(self, graph: torch.fx.Graph, vocab: OpVocabulary, report: GraphReport) -> None:
        by_role = {p.role: p for p in self._patterns_for(vocab)}
        attention_ops = vocab.attention_ops()
        candidates = [n for n in graph.nodes if matcher.wrapped_op(n)[0] in attention_ops]
        refused: Counter = Counter(report.refused)
        for node in candidates:
            role = attention_ops[matcher.wrapped_op(node)[0]]
            pattern = by_role.get(role)
            layer = node.kwargs.get("layer_name")
            report.candidates += 1
            if pattern is None:
                outcome = "pattern_not_enabled"
            else:
                found = matcher.examine(node, pattern, vocab)
                if isinstance(found, matcher.Match):
                    matcher.rewrite(graph, found, vocab)
                    report.rewritten += 1
                    report.layers.append({"layer": layer, "pattern": pattern.name, "outcome": "rewritten"})
                    continue
                outcome = found
            refused[outcome] += 1
            report.layers.append({"layer": layer, "pattern": pattern.name if pattern else None,
                                  "outcome": "refused", "reason": outcome})
        report.refused = dict(refused)

    # -- report ----------------------------------------------------------------------------

    def report(self) -> dict:
        """Totals over every graph this pass ran on, the per-graph reports, and the run-time counters."""
        from fusion_pass import guard

        refused: Counter = Counter()
        for g in self.graphs:
            refused.update(g.refused)
        return {
            "graphs": len(self.graphs),
            "candidates": sum(g.candidates for g in self.graphs),
            "rewritten": sum(g.rewritten for g in self.graphs),
            "refused": dict(refused),
            "seconds": sum(g.seconds for g in self.graphs),
            "per_graph": [asdict(g) for g in self.graphs],
            "runtime": guard.counters(),
        }


class ChainedPass(CustomGraphPass):
    """Runs the passes installed before ours (one pass or a list of them, in order), then ``second``."""

    def __init__(self, first, second: CustomGraphPass):
        self.firsts = list(first) if isinstance(first, (list, tuple)) else [first]
        self.second = second

    def __call__(self, graph: torch.fx.Graph) -> None:
        for other in self.firsts:
            other(graph)
        self.second(graph)

    def uuid(self):
        uuids = [other.uuid() if hasattr(other, "uuid") else None for other in self.firsts]
        if any(u is None for u in uuids):
            return None  # a plain callable cannot be hashed: Inductor then skips its FX graph cache
        return hashlib.sha256(":".join([*map(str, uuids), self.second.uuid()]).encode()).hexdigest()


class enable:
    """Install a :class:`FusionPass` as Inductor's post-grad custom post pass.

    ``fusion_pass.enable()`` installs it for the rest of the process and returns
    the handle; ``with fusion_pass.enable() as fp:`` installs it for the block
    and restores the previous setting after. A pass already installed there
    keeps running, before ours.
    """

    def __init__(self, fusion: FusionPass | None = None):
        from torch._inductor import config

        self.fusion = fusion or FusionPass()
        self._previous = config.post_grad_custom_post_pass
        installed = self.fusion if self._previous is None else ChainedPass(self._previous, self.fusion)
        config.post_grad_custom_post_pass = installed

    def report(self) -> dict:
        return self.fusion.report()

    def __enter__(self) -> FusionPass:
        return self.fusion

    def __exit__(self, *exc) -> None:
        self.disable()

    def disable(self) -> None:
        """Restore what was installed before."""
        from torch._inductor import config

        config.post_grad_custom_post_pass = self._previous
