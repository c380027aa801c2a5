"""The fusion pass: an Inductor post-grad custom pass, its match report, and ``enable()``.

Three ways to register it:

* ``fusion_pass.enable()`` installs a :class:`FusionPass` as
  ``torch._inductor.config.post_grad_custom_post_pass``, chained after a pass
  already installed there, and returns an :class:`EnabledPass` (``disable()``,
  ``report()``; also a context manager: ``with fusion_pass.enable() as fp:``);
* ``torch.compile(model, options={"post_grad_custom_post_pass": FusionPass()})``;
* vLLM's compilation config (the vLLM adapter).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import threading
import time
import weakref
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from fusion_pass.compile import code_hash, debug, matcher, native_match, rewrite, summary
from fusion_pass.nvfp4 import ArgumentError
from fusion_pass.patterns import PATTERNS, AttentionQuantPattern, OpVocabulary, fusion_pass_vocabulary

logger = logging.getLogger("fusion_pass")


@dataclass
class GraphReport:
    """What the pass did to one graph."""

    graph: int
    candidates: int = 0
    rewritten: int = 0  # attention + quant fused, or an already quantized call retargeted
    retargeted: int = 0  # of which retargeted
    refused: dict[str, int] = field(default_factory=dict)
    left: dict[str, int] = field(default_factory=dict)  # already quantized calls left as they are, by reason
    seconds: float = 0.0
    layers: list[dict] = field(default_factory=list)  # one entry per candidate: layer, pattern, outcome

    def line(self) -> str:
        refused = ", ".join(f"{k}={v}" for k, v in sorted(self.refused.items())) or "none"
        retargeted = f" ({self.retargeted} retargeted)" if self.retargeted else ""
        left = ", left quantized: " + ", ".join(f"{k}={v}" for k, v in sorted(self.left.items())) if self.left else ""
        return (f"fusion_pass: graph {self.graph}: {self.candidates} candidates, {self.rewritten} rewritten"
                f"{retargeted}{left}, refused: {refused} ({self.seconds * 1e3:.1f} ms)")


def _resolve_patterns(patterns) -> tuple[AttentionQuantPattern, ...]:
    """Entries of the pattern table, given as entries or by name; errors name the argument."""
    if patterns is None:
        return tuple(PATTERNS)
    if isinstance(patterns, (str, AttentionQuantPattern)):
        patterns = (patterns,)
    by_name = {p.name: p for p in PATTERNS}
    resolved = []
    for entry in patterns:
        if isinstance(entry, AttentionQuantPattern):
            resolved.append(entry)
        elif isinstance(entry, str):
            if entry not in by_name:
                raise ArgumentError(f"FusionPass: patterns names an unknown pattern {entry!r}; "
                                 f"known patterns: {', '.join(by_name)}")
            resolved.append(by_name[entry])
        else:
            raise ArgumentError(f"FusionPass: patterns must hold pattern names or entries of "
                            f"fusion_pass.patterns.PATTERNS, got {type(entry).__name__} {entry!r}")
    if not resolved:
        raise ArgumentError("FusionPass: patterns must name at least one pattern")
    return tuple(resolved)


def _resolve_vocabularies(vocabularies) -> tuple[OpVocabulary, ...]:
    if vocabularies is None:
        return (fusion_pass_vocabulary(),)
    if isinstance(vocabularies, OpVocabulary):
        vocabularies = (vocabularies,)
    vocabularies = tuple(vocabularies)
    for vocab in vocabularies:
        if not isinstance(vocab, OpVocabulary):
            raise ArgumentError(f"FusionPass: vocabularies must hold OpVocabulary objects, "
                            f"got {type(vocab).__name__} {vocab!r}")
    if not vocabularies:
        raise ArgumentError("FusionPass: vocabularies must hold at least one OpVocabulary")
    return vocabularies


def _other_format(reason: str) -> bool:
    """Whether a refusal only says the attention output is not this entry's format (it feeds another format's
    quant op, or no quant op of this format)."""
    return (reason in ("quant_is_another_format", "fp8_native_quant_not_matched")
            or (reason.startswith("no_") and reason.endswith("_quant_consumer")))


class FusionPass(CustomGraphPass):
    """Rewrites attention -> scaled_fp4_quant -> NVFP4 GEMM into one NVFP4-output attention call.

    ``patterns``: entries of :data:`fusion_pass.patterns.PATTERNS` or their names
    (default: all); ``vocabularies``: op vocabularies to match (default:
    ``torch.ops.fusion_pass``). ``leave_quantized``: None, or a callable ``(layer) -> reason or None`` asked
    before an attention call another pass already gave the quant's buffers is retargeted (``layer``: its
    layer name, or the label the report gives a call without one): given a reason, the call is left as it is
    (outcome ``"left"`` with that reason, counted in ``left``).
    """

    def __init__(self, patterns: tuple[AttentionQuantPattern | str, ...] | None = None,
                 vocabularies: tuple[OpVocabulary, ...] | None = None, leave_quantized=None):
        if leave_quantized is not None and not callable(leave_quantized):
            raise ArgumentError(f"FusionPass: leave_quantized must be None or callable, "
                                f"got {type(leave_quantized).__name__} {leave_quantized!r}")
        self.leave_quantized = leave_quantized
        self.patterns = _resolve_patterns(patterns)
        self.vocabularies = _resolve_vocabularies(vocabularies)
        self.graphs: list[GraphReport] = []
        self.rewritten_layers: list[str] = []  # the layer names this pass rewrote, in order, each once
        self.graphs_from_cache = 0  # compiles served by the FX graph cache (the pass did not run on them)
        self._consulted: dict[str, int] = {}  # compile id -> cache hits then, for compiles not yet settled
        self._ran: set[str] = set()  # of those, the compiles the pass ran in
        for vocab in self.vocabularies:  # trace once per process (cached), here rather than per graph
            for pattern in self._patterns_for(vocab):
                matcher.anchor_ops(pattern, vocab)
                for form in ("v1", "v2"):
                    matcher.traced_replacement(pattern, vocab, form)

    def _patterns_for(self, vocab: OpVocabulary):
        """The enabled entries whose attention role and output format ``vocab`` binds."""
        roles = vocab.attention_ops().values()
        return [p for p in self.patterns if p.role in roles and vocab.quant_form(p.format) is not None
                and (p.quant != "native" or vocab.writes_native(p.role))]

    # -- CustomGraphPass -------------------------------------------------------------------

    def uuid(self) -> str:
        """Changes with the pattern set, the vocabularies, the package version and the code of every compile-time
        module (:func:`fusion_pass.compile.code_hash.code_digest`: the pass, matcher, layout proofs, pattern table,
        op schemas, NVFP4 layout).

        Inductor asks for it when it computes a graph's FX-graph-cache key; the pass notes the compile then,
        so that a compile served by the cache (the pass is not called) is counted and logged
        (:meth:`report`'s ``graphs_from_cache``)."""
        _note_cache_lookup(self)
        h = hashlib.sha256()
        for pattern in self.patterns:
            h.update(pattern.name.encode())
            for fn in (pattern.pattern, pattern.replacement, pattern.extra_check):
                h.update(inspect.getsource(fn).encode())
        for vocab in self.vocabularies:
            h.update(repr(vocab).encode())
        h.update(code_hash.code_digest().encode())
        return h.hexdigest()

    def __call__(self, graph: torch.fx.Graph) -> None:
        start = time.perf_counter()
        compile_id = debug.compile_id()
        if compile_id in self._consulted:  # the cache missed (or was bypassed): the pass runs
            self._ran.add(compile_id)
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
        """Each attention candidate: the enabled entries that apply to it (the table's order) are examined;
        the first match is applied, else the first entry's refusal is reported, preferring one that is about
        the entry's own format (the output reached its quant op) to one saying the output feeds another
        format's quant (:func:`_other_format`)."""
        entries = self._patterns_for(vocab)
        attention_ops = vocab.attention_ops()
        candidates = [n for n in graph.nodes if matcher.wrapped_op(n)[0] in attention_ops]
        refused: Counter = Counter(report.refused)
        for node in candidates:
            layer = matcher.layer_label(node)
            report.candidates += 1
            match, refusal = None, None
            for entry in (p for p in entries if matcher.applies(node, p, vocab)):
                found = (native_match.examine if entry.quant == "native" else matcher.examine)(node, entry, vocab)
                if isinstance(found, matcher.Match):
                    match = found
                    break
                if refusal is None or (_other_format(refusal[0]) and not _other_format(found)):
                    refusal = (found, entry.name)
            left = (self.leave_quantized(layer) if match is not None and match.outcome == "retargeted"
                    and self.leave_quantized is not None else None)
            if left:
                report.left[left] = report.left.get(left, 0) + 1
                report.layers.append({"layer": layer, "pattern": match.pattern.name, "outcome": "left", "reason": left})
                continue
            if match is not None:
                (native_match.rewrite if match.pattern.quant == "native" else rewrite.rewrite)(graph, match, vocab)
                if isinstance(layer, str) and layer not in self.rewritten_layers:
                    self.rewritten_layers.append(layer)
                report.rewritten += 1
                report.retargeted += match.outcome == "retargeted"
                report.layers.append({"layer": layer, "pattern": match.pattern.name, "outcome": match.outcome})
                continue
            reason, name = refusal or (matcher.unmatched_reason(node), None)
            refused[reason] += 1
            report.layers.append({"layer": layer, "pattern": name, "outcome": "refused", "reason": reason})
        report.refused = dict(refused)

    # -- report ----------------------------------------------------------------------------

    def _settle_cache_lookups(self) -> None:
        """Each compile that asked for :meth:`uuid` and is over: the pass ran in it, or the FX graph cache
        served it (counted in ``graphs_from_cache`` and logged once)."""
        hits = _cache_hits()
        for compile_id, hits_then in list(self._consulted.items()):
            del self._consulted[compile_id]
            if compile_id in self._ran:
                self._ran.discard(compile_id)  # compile ids restart after torch._dynamo.reset()
                continue
            if hits <= hits_then:
                continue
            self.graphs_from_cache += 1
            logger.info("fusion_pass: compile %s was served by Inductor's FX graph cache: the fusion pass did not "
                        "run on its graph (the cached graph keeps the rewrite made when it was compiled; "
                        "report()['graphs_from_cache'] counts it; compile with fx_graph_cache=False for a full "
                        "report)", compile_id)

    def summary(self) -> str:
        """:meth:`report` in a few readable lines (:func:`fusion_pass.compile.summary.summarize`), saying so when the
        FX graph cache served every compile and the pass did not run."""
        return summary.summarize(self.report())

    def report(self) -> dict:
        """Totals over every graph this pass ran on, the per-graph reports, the compiles the FX graph cache
        served (``graphs_from_cache``: the pass did not run on them), and the run-time counters of the layers
        this pass rewrote (``runtime``, through :func:`fusion_pass.ops.runtime_counters` with
        ``layers=rewritten_layers``) beside the whole process's (``runtime_process``), with the fraction of
        this pass's prefill tokens fused."""
        from fusion_pass import ops

        self._settle_cache_lookups()
        refused: Counter = Counter()
        left: Counter = Counter()
        for g in self.graphs:
            refused.update(g.refused)
            left.update(g.left)
        runtime = ops.runtime_counters(layers=list(self.rewritten_layers))
        tokens = runtime["tokens"]
        return {
            "graphs": len(self.graphs),
            "graphs_from_cache": self.graphs_from_cache,
            "candidates": sum(g.candidates for g in self.graphs),
            "rewritten": sum(g.rewritten for g in self.graphs),
            "retargeted": sum(g.retargeted for g in self.graphs),
            "refused": dict(refused),
            "left": dict(left),
            "seconds": sum(g.seconds for g in self.graphs),
            "per_graph": [asdict(g) for g in self.graphs],
            "rewritten_layers": list(self.rewritten_layers),
            # the calls of the layers this pass rewrote (by whichever graph ran them), and of every layer
            "runtime": runtime,
            "runtime_process": ops.runtime_counters(),
            # per token: the share of prefill rows the fused backend wrote (None before any NVFP4 attention call)
            "prefill_fused_fraction": tokens["prefill_fused"] / tokens["prefill"] if tokens["prefill"] else None,
        }


# ---------------------------------------------------------------- FX-graph-cache hits

_watched: "weakref.WeakSet[FusionPass]" = weakref.WeakSet()  # passes with compiles not yet settled
_watched_lock = threading.Lock()


def _cache_hits() -> int:
    """Inductor's FX-graph-cache hits so far in this process (AOT autograd's cache hits too: with a bundled
    AOT autograd cache those serve a graph without an FX-graph-cache lookup)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]


def _note_cache_lookup(fusion: "FusionPass") -> None:
    """Inside a compile (Inductor computing a cache key with ``fusion`` installed): remember the compile and
    the cache hits so far, and have the compile's end settle it (:meth:`FusionPass._settle_cache_lookups`)."""
    compile_id = debug.compile_id()
    if compile_id is None or compile_id in fusion._consulted:
        return
    fusion._consulted[compile_id] = _cache_hits()
    with _watched_lock:
        _watched.add(fusion)
    try:
        from torch._dynamo.callback import callback_handler

        if _settle_at_compile_end not in callback_handler.end_callbacks:  # torch._dynamo.reset() clears them
            callback_handler.register_end_callback(_settle_at_compile_end)
    except Exception:  # a torch without compile callbacks: report() settles instead
        pass


def _settle_at_compile_end(_args=None) -> None:
    with _watched_lock:
        passes = list(_watched)
        _watched.clear()
    for fusion in passes:
        try:
            fusion._settle_cache_lookups()
        except Exception:  # never fail a compile over a report
            logger.debug("fusion_pass: settling cache lookups failed", exc_info=True)


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


_lock = threading.Lock()  # guards the two lists below and the config value they describe
_active: list["EnabledPass"] = []  # enable() handles not yet disabled, oldest first
_before_first: list = []  # [what was installed before the oldest active handle], while any is active


def _compose():
    """The pass to install for the active handles: what was there before, then each handle's FusionPass."""
    previous = _before_first[0]
    firsts = [] if previous is None else list(previous) if isinstance(previous, (list, tuple)) else [previous]
    firsts += [h.fusion for h in _active[:-1]]
    return ChainedPass(firsts, _active[-1].fusion) if firsts else _active[-1].fusion


def _drop_compiled_code() -> None:
    """Make every torch.compile'd function recompile on its next call.

    Dynamo keeps compiled code per function and does not guard on Inductor's
    ``post_grad_custom_post_pass``; without this, a function compiled before a
    change keeps the graph it was compiled with.
    """
    torch._dynamo.reset_code_caches()


def _has_compiled_code() -> bool:
    from torch._dynamo import convert_frame

    return any(ref() is not None for ref in convert_frame.input_codes.seen)


def enable(fusion: FusionPass | None = None, *, recompile: bool = True) -> "EnabledPass":
    """Install a :class:`FusionPass` (``fusion``, default a new one) as Inductor's post-grad custom post pass
    and return its :class:`EnabledPass` handle.

    ``fusion_pass.enable()`` installs it for the rest of the process (until
    ``handle.disable()``); ``with fusion_pass.enable() as fp:`` installs it for the
    block (``fp`` is the :class:`FusionPass`). ``recompile``: see :class:`EnabledPass`.
    ``fusion`` not a FusionPass (or None) is a ``TypeError`` raised before anything is installed.
    """
    return EnabledPass(fusion, recompile=recompile)


class EnabledPass:
    """An installed :class:`FusionPass`: what :func:`enable` returns. ``disable()`` removes it; ``report()`` is
    its pass's report; as a context manager it yields the :class:`FusionPass` and disables on exit.

    A pass already installed there keeps running, before ours. Handles can be disabled in any order: once
    all are, what was installed before the first of them is back.

    ``recompile`` (default True): enabling and disabling make every function
    compiled with ``torch.compile`` recompile on its next call, so that
    functions compiled before ``enable()`` pick the pass up and functions
    compiled inside a ``with`` block drop it after the block (Dynamo does not
    notice Inductor's config changing). With ``recompile=False`` compiled
    functions keep the graphs they have, and ``enable()`` warns when some exist;
    to scope the pass to one function instead, compile it with
    ``options={"post_grad_custom_post_pass": FusionPass()}``.
    """

    def __init__(self, fusion: FusionPass | None = None, *, recompile: bool = True):
        from torch._inductor import config

        if fusion is not None and not isinstance(fusion, FusionPass):
            raise ArgumentError(f"enable(fusion): fusion must be a FusionPass or None (a default FusionPass()), "
                            f"got {type(fusion).__name__} {fusion!r}")
        if not isinstance(recompile, bool):
            raise ArgumentError(f"enable(recompile): must be True or False, got {recompile!r}")
        self.fusion = fusion or FusionPass()
        self.recompile = recompile
        self._enabled = True
        with _lock:
            if not _active:
                _before_first[:] = [config.post_grad_custom_post_pass]
            _active.append(self)
            self._install(config)

    def _install(self, config) -> None:
        """Install the composition of the active handles, or what was there before all of them."""
        config.post_grad_custom_post_pass = _compose() if _active else _before_first.pop()
        if self.recompile:
            _drop_compiled_code()
        elif _has_compiled_code():
            logger.warning("fusion_pass.enable(recompile=False): functions already compiled with torch.compile "
                           "keep the graphs they were compiled with; the change applies to new compiles only")

    @property
    def enabled(self) -> bool:
        return self._enabled

    def report(self) -> dict:
        """Its :class:`FusionPass`'s report (:meth:`FusionPass.report`)."""
        return self.fusion.report()

    def summary(self) -> str:
        """Its :class:`FusionPass`'s report in a few readable lines (:meth:`FusionPass.summary`)."""
        return self.fusion.summary()

    def __enter__(self) -> FusionPass:
        return self.fusion

    def __exit__(self, *exc) -> None:
        self.disable()

    def disable(self) -> None:
        """Remove this handle's pass; once every handle is disabled, restore what was installed before.

        Calling it again does nothing.
        """
        from torch._inductor import config

        with _lock:
            if not self._enabled:
                return
            self._enabled = False
            _active.remove(self)
            self._install(config)
