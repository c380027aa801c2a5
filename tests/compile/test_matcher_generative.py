"""Generative test of the matcher: random view/copy chains between attention and the NVFP4 quant.

The fusion is correct only when the quant's input is the attention output's
elements in row-major ``[T, H*Dv]`` order with ``T = q.shape[0]`` rows. The
cases (``tests/graph_cases.py``) put a chain of view, reshape, flatten,
unflatten, transpose, permute, ``.t()``, squeeze/unsqueeze, slice/narrow,
as_strided, clone, contiguous, dtype steps and detours that come back, between
an attention layer (MLA, or standard attention with GQA) and its quant, with
the attention writing into a plain buffer, into a view of a bigger or permuted
base, or into a slice of a persistent buffer passed in as a graph input. Each
case has its own NVFP4 o_proj whose K is the chain result's last dim. Per case
and per functionalization form (v1 ``auto_functionalized``, v2
``auto_functionalized_v2``), compiled with and without the pass and run on the
batches of :data:`STEPS` (prefill, mixed, chunked prefill, decode, prefill):

(a) where the pass refused, the GEMM's operands (packed and scale bytes, from
    ``fusion_pass.ops.tap_gemm_inputs()``), the GEMM's output and the persistent
    buffer's contents are bitwise equal with and without the pass on every batch;
(b) where it rewrote, on batches with prefill rows the fused operands' prefill
    rows are within the bound of ``test_fusion_pass``'s numerics test (two NVFP4
    error bounds plus the bf16 rounding of the attention output; on mixed and
    chunked batches the same bound derived from the unfused values alone,
    ``demo.requantization_bound``) and their decode rows are bitwise equal (MLA's
    split; a standard layer's mixed call is one launch over its paged cache, its
    decode rows within the same bound), the persistent buffer is unchanged, and
    decode-only batches are bitwise equal;
(c) nothing raises with the pass that does not raise without it.

And the oracle side (``graph_cases.layout``: the chain applied eagerly to a
probe numbering the attention's elements, at several token counts, not the
matcher's view of it): a chain that is not layout-preserving must be refused,
whatever the numbers say; over a representative set of chains that are
(:data:`ANCHORS`), the pass must rewrite some (it cannot pass by refusing
everything). :data:`REPROS` are the issue's five wrong rewrites.

Discards. A generated chain that fails eagerly at one of :data:`ORACLE_TOKENS`,
has no fixed last dim that is a multiple of 16, or pins the token count when
traced symbolically is redrawn. Each case also runs eagerly: where the unfused
*compiled* graph does not reproduce eager's bytes, the case is skipped with
that reason, since the reference itself is wrong (torch 2.13 has such bugs, for
instance a custom op mutating ``base[T:]`` under ``auto_functionalized_v2``
with a dynamic T writes at offset 0).

Speed (the file is meant to run in CI on 2 CPU cores in about 3 minutes):
one compiled function holds a group of :data:`GROUP_SIZE` cases (each its own
registered layer, buffer, chain, quant and GEMM; cases with the same attention
shapes share the input tensors; the token dim is marked dynamic), so one
compile with and one without the pass cover the whole group per form. Every
batch has the same token count :data:`T_RUN`, so nothing can recompile. The
outcome of each case is read per layer from ``FusionPass.graphs[i].layers``;
each GEMM tap is tied to its case by recomputing the GEMM from the tapped
operands and the case's weights. When a group raises, it is split (suspects
first: cases rewritten although not layout-preserving, the layer whose
attention op raised) until every error is pinned on one case.
``FUSION_PASS_GENERATIVE_SEEDS`` sets the number of generated chains (default
:data:`DEFAULT_SEEDS`), ``FUSION_PASS_GENERATIVE_BASE_SEED`` draws another set,
``FUSION_PASS_GENERATIVE_GROUP_SIZE`` the cases per compiled function.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass


import graph_cases  # noqa: E402
from graph_cases import (CLONE, CONTIGUOUS, TO_FLOAT, VIEW_FP16, Case, finalize, op_as_strided,  # noqa: E402
                         op_named, op_view)

import fusion_pass.runtime as runtime_module  # noqa: E402
from fusion_pass import nvfp4, runtime  # noqa: E402
from fusion_pass.runtime import counters, settings
from fusion_pass.compile.graph_pass import FusionPass  # noqa: E402
from fusion_pass.ops import tap_gemm_inputs  # noqa: E402
from fusion_pass.runtime import BatchSpec, RequestSpec  # noqa: E402

# chains that read the bf16 output as fp16 make Inductor's C++ backend say so; harmless here
pytestmark = pytest.mark.filterwarnings("ignore:bf16 and fp16 are mixed in the scheduler node")

DEFAULT_SEEDS = 100
SEEDS = int(os.environ.get("FUSION_PASS_GENERATIVE_SEEDS", DEFAULT_SEEDS))
BASE_SEED = int(os.environ.get("FUSION_PASS_GENERATIVE_BASE_SEED", 0))
GROUP_SIZE = int(os.environ.get("FUSION_PASS_GENERATIVE_GROUP_SIZE", 24))
# v1 (vLLM's form) in `make test`; v2, a second compile of every group, in `make test-slow` (CI runs both)
FORMS = ("v1", pytest.param("v2", marks=pytest.mark.slow))

# Every batch kind at one token count T: the token dim is symbolic in the one compiled graph (marked
# dynamic, hint T), and no guard a chain makes Inductor add (its reshape indexing compares T with
# static sizes) can fail on a later batch and recompile the whole group. The oracle checks the
# layout at several token counts, as the pass's decision has to hold for all of them.
T_RUN = 5  # no case has a static dim of 5
STEPS = (  # decode requests first; each step continues the caches of the previous ones
    BatchSpec((RequestSpec("r0", 3), RequestSpec("r1", 2))),  # prefill: fused
    BatchSpec((RequestSpec("r0", 1, 3), RequestSpec("r2", 2), RequestSpec("r4", 2))),  # mixed: prefill rows fused
    BatchSpec((RequestSpec("r1", 3, 2), RequestSpec("r3", 2))),  # chunked prefill: fused (reference backend)
    BatchSpec(tuple(RequestSpec(r, 1, c) for r, c in (("r0", 4), ("r1", 5), ("r2", 2), ("r3", 2), ("r4", 2)))),
    BatchSpec((RequestSpec("r5", 2), RequestSpec("r6", 3))),  # prefill again: fused
)
assert {spec.num_tokens for spec in STEPS} == {T_RUN}
assert [spec.kind for spec in STEPS] == ["prefill", "mixed", "chunked", "decode", "prefill"]
ORACLE_TOKENS = (T_RUN, 3, 7, 11, 14)


# ---------------------------------------------------------------- explicit cases


def _case(id, kind, chain, *, heads=2, dv=32, buffer="plain", read_base=False, category, note="", **kw) -> Case:
    seed = 7_000_000 + sum(ord(ch) * 31**i for i, ch in enumerate(id)) % 1_000_000
    case = Case(id=id, kind=kind, heads=heads, v_head_dim=dv, buffer=buffer, read_base=read_base,
                chain=tuple(chain), k=0, n=32, seed=seed, category=category, note=note, **kw)
    return finalize(case, ORACLE_TOKENS, T_RUN)


def _to_tokens(w):  # view(T, -1) / the standard module's output.view(-1, H*Dv)
    return op_view([(1, 1), (w, 0)], 1, "view")


def _repros() -> list[Case]:
    """The five wrong rewrites of the issue, for MLA and for standard attention."""
    cases = []
    for kind in ("mla", "gqa"):
        h, dv = 2, 16
        w = h * dv
        # 1. per-head o_proj: NVFP4Linear(Dv in-features) on attn(...).view(-1, H, Dv): quant over [T*H, Dv]
        module_out = [] if kind == "mla" else [_to_tokens(w)]  # what the modules return: [T, W]
        cases.append(_case(f"repro-per_head_o_proj-{kind}", kind, module_out + [op_view([(1, 1), (h, 0), (dv, 0)], 0)],
                           heads=h, dv=dv, via_module=True, category="repro", note="issue: per-head o_proj"))
        # 2. scaled_fp4_quant(out.reshape(-1, W // 2), gs)
        h, dv = 2, 32
        w = h * dv
        chain = [] if kind == "mla" else [_to_tokens(w)]
        cases.append(_case(f"repro-half_rows-{kind}", kind, chain + [op_view([(2, 1), (w // 2, 0)], 0, "reshape")],
                           heads=h, dv=dv, category="repro", note="issue: out.reshape(-1, W // 2)"))
        # 3. scaled_fp4_quant(out.as_strided((T, W), (1, T)), gs)
        cases.append(_case(f"repro-as_strided_transposed-{kind}", kind,
                           chain + [op_as_strided([(1, 1), (w, 0)], [(1, 0), (1, 1)])], heads=h, dv=dv,
                           category="repro", note="issue: out.as_strided((T, W), (1, T))"))
        # 4. (v2) attention writes into base.transpose(1, 2) of base [T, Dv, H]; the quant reads base.view(T, -1)
        cases.append(_case(f"repro-permuted_base-{kind}", kind, [_to_tokens(w)], heads=h, dv=dv, buffer="permuted",
                           read_base=True, category="repro", note="issue (v2): base.transpose(1, 2) / base.view(T, -1)"))
        # 5. (v2) attention writes into buf[:T].view(-1, H, Dv) of a [2T, W] buffer; the quant reads all of buf
        cases.append(_case(f"repro-bigger_buffer-{kind}", kind, [], heads=h, dv=dv, buffer="rows_head",
                           read_base=True, category="repro", note="issue (v2): buf[:T] written, buf read"))
    return cases


def _anchors() -> list[Case]:
    """Layout-preserving chains a matcher can see through: pure views back to [T, W], copies, inverse pairs."""
    cases = []
    for kind in ("mla", "gqa"):
        h, dv = 2, 32
        w = h * dv
        start = [] if kind == "mla" else [_to_tokens(w)]  # what the modules return: [T, W]
        t3 = op_view([(1, 1), (h, 0), (dv, 0)], None, "view")
        chains = {
            "module": start,  # as the modules call it (MLA: out itself; GQA: out.view(-1, H*Dv))
            "reshape_-1_W": start + [op_view([(1, 1), (w, 0)], 0, "reshape")],
            "flatten": [t3, op_named("flatten(1)", lambda x, T: x.flatten(1))],
            "unsqueeze_squeeze": start + [op_named("unsqueeze(0)", lambda x, T: x.unsqueeze(0)),
                                          op_named("squeeze(0)", lambda x, T: x.squeeze(0))],
            "flat_and_back": start + [op_view([(w, 1)], 0), _to_tokens(w)],
            "clone": start + [CLONE],
            "contiguous_after_transposes": start + [op_named("t()", lambda x, T: x.t()), CONTIGUOUS,
                                                    op_named("t()", lambda x, T: x.t())],
            "transpose_pair": [t3, op_named("transpose(1, 2)", lambda x, T: x.transpose(1, 2)),
                               op_named("transpose(1, 2)", lambda x, T: x.transpose(1, 2)), _to_tokens(w)],
            "permute_inverse": [t3, op_named("permute(2, 0, 1)", lambda x, T: x.permute(2, 0, 1)),
                                op_named("permute(1, 2, 0)", lambda x, T: x.permute(1, 2, 0)),
                                op_view([(1, 1), (w, 0)], 1, "reshape")],
            "as_strided_identity": start + [op_as_strided([(1, 1), (w, 0)], [(w, 0), (1, 0)])],
            "slice_whole": start + [op_named("[:, :W]", lambda x, T, w=w: x[:, :w])],
        }
        # half of them for each attention kind: every chain once, the module's own chain for both
        names = list(chains)
        for i, name in enumerate(names):
            if name == "module" or i % 2 == (kind == "gqa"):
                cases.append(_case(f"anchor-{name}-{kind}", kind, chains[name], heads=h, dv=dv, category="anchor"))
        # preserving reads through a bigger or a permuted base (v1 scatters them back; v2 sees a view of a base)
        if kind == "mla":
            cases.append(_case(f"anchor-rows_head_out-{kind}", kind, start, heads=h, dv=dv, buffer="rows_head",
                               category="anchor"))
        else:
            cases.append(_case(f"anchor-permuted_reshape-{kind}", kind, [op_view([(1, 1), (w, 0)], 1, "reshape")],
                               heads=h, dv=dv, buffer="permuted", category="anchor"))
    return cases


def _attacks() -> list[Case]:
    """Beyond the issue: a side effect the rewrite must keep, and dtype steps between attention and quant."""
    cases = []
    for kind in ("mla", "gqa"):
        h, dv = 2, 32
        w = h * dv
        start = [] if kind == "mla" else [_to_tokens(w)]
        # vLLM-style persistent buffer (a graph input): attention writes input[:T], the quant reads that.
        # Layout-preserving, but the buffer's contents are visible after the call: a rewrite must keep them.
        cases.append(_case(f"attack-persistent_buffer-{kind}", kind, start, heads=h, dv=dv, buffer="input",
                           category="attack", note="attention writes a slice of a graph input"))
        # the bits of the bf16 output read as fp16: same shape, other values: must be refused
        cases.append(_case(f"attack-view_fp16-{kind}", kind, start + [VIEW_FP16], heads=h, dv=dv, category="attack"))
        # an exact upcast: the same values in fp32 (may be fused; the numbers must hold)
        cases.append(_case(f"attack-float-{kind}", kind, start + [TO_FLOAT], heads=h, dv=dv, category="attack"))
    return cases


REPROS = _repros()
ATTACKS = _attacks()
ANCHORS = _anchors()
GENERATED = [graph_cases.random_case(i, BASE_SEED, ORACLE_TOKENS, T_RUN) for i in range(SEEDS)]
ALL_CASES = REPROS + ATTACKS + ANCHORS + GENERATED
BY_ID = {c.id: c for c in ALL_CASES}
assert len(BY_ID) == len(ALL_CASES)


def _groups(cases, size):
    return [cases[i:i + size] for i in range(0, len(cases), size)]


GROUPS = _groups(ALL_CASES, GROUP_SIZE)
GROUP_OF = {c.id: i for i, group in enumerate(GROUPS) for c in group}


# ---------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def _clean_compile_state(monkeypatch, caplog):
    """Fresh Dynamo caches, no FX graph cache, the reference backend pinned, zeroed guard counters."""
    caplog.set_level(logging.WARNING, logger="torch.__trace")  # failure reports without Dynamo's trace records
    monkeypatch.delenv(settings.BACKEND_ENV, raising=False)
    monkeypatch.delenv("FUSION_PASS_DUMP", raising=False)
    torch._dynamo.reset()
    counters.reset_counters()
    # one intra-op thread: the tensors here are tiny, and on a shared 2-core machine OpenMP's spinning
    # second thread costs a third of the file's time
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with inductor_config.patch(fx_graph_cache=False), settings.use_backend("reference"):
            yield
    finally:
        torch.set_num_threads(threads)
    runtime.clear_kv_caches()
    counters.reset_counters()
    torch._dynamo.reset()


@pytest.fixture(scope="module", autouse=True)
def _release_layers():
    yield
    registered = runtime.registered_layers()
    for case in ALL_CASES:
        if case._built and registered.get(case.layer_name) is case._built["impl"]:
            runtime.unregister_layer(case.layer_name)


# ---------------------------------------------------------------- running a group


class _Counting(CustomGraphPass):
    """The post-grad custom pass: counts graphs, runs the FusionPass (None: an unfused compile)."""

    def __init__(self, fusion: FusionPass | None):
        self.fusion, self.graphs = fusion, 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs += 1
        if self.fusion is not None:
            self.fusion(graph)

    def uuid(self):
        return f"{self.fusion.uuid() if self.fusion is not None else 'unfused'}:test_matcher_generative"


class _LastLayer:
    """Remembers the last layer an attention op looked up (names the culprit when a group raises)."""

    def __enter__(self):
        self.name, self._get = None, runtime_module.get_layer

        def get_layer(name):
            self.name = name
            return self._get(name)

        runtime_module.get_layer = get_layer
        return self

    def __exit__(self, *exc):
        runtime_module.get_layer = self._get


@dataclass
class Run:
    """One case in one compiled run: per step (packed, scales as uint8, GEMM output) until an error."""

    steps: list = field(default_factory=list)
    error: str | None = None
    outcomes: list = field(default_factory=list)  # per graph the pass saw: "rewritten" / "refused (reason)"
    graphs: int = 0

    @property
    def rewritten(self) -> bool:
        return "rewritten" in self.outcomes


def _signatures(cases) -> list[tuple]:
    return list(dict.fromkeys(c.signature for c in cases))


def _group_function(cases):
    """fn(*inputs) -> one GEMM output per case. The inputs: each signature's attention inputs, in order,
    then the persistent buffer of each case that writes into one (the "input" buffer kind)."""
    signatures = _signatures(cases)
    buffered = [c for c in cases if c.buffer == "input"]

    def fn(*flat):
        by_signature = {sig: flat[3 * i:3 * i + 3] for i, sig in enumerate(signatures)}
        buffers = dict(zip([c.id for c in buffered], flat[3 * len(signatures):]))
        # T = q.shape[0] of the case's own inputs (each input has its own size symbol)
        return tuple(c.forward(by_signature[c.signature], by_signature[c.signature][0].shape[0], buffers.get(c.id))
                     for c in cases)

    return fn


def _group_inputs(cases, step: int):
    """(flat inputs of :func:`_group_function`'s fn, {case id: its persistent buffer})."""
    reps = {c.signature: c for c in reversed(cases)}
    flat = [x for sig in _signatures(cases) for x in reps[sig].inputs(step, STEPS[step].num_tokens)]
    for x in flat:
        torch._dynamo.mark_dynamic(x, 0)
    buffers = {c.id: c.input_buffer() for c in cases if c.buffer == "input"}
    return flat + list(buffers.values()), buffers


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (NaN-safe bitwise comparison)."""
    return t.contiguous().view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


class _TieError(AssertionError):
    def __init__(self, case_id: str):
        super().__init__(f"no tapped GEMM call reproduces the output of {case_id}")
        self.case_id = case_id


def _tie_taps(cases, taps, ys):
    """(packed, scales, y) per case: tap i belongs to case i if recomputing the GEMM from it gives y_i."""
    if len(taps) != len(cases):
        raise AssertionError(f"{len(taps)} GEMM calls tapped for {len(cases)} cases")
    free = list(range(len(taps)))
    tied = []
    for i, case in enumerate(cases):
        y = ys[i].reshape(-1, ys[i].shape[-1])
        order = ([i] if i in free else []) + [j for j in free if j != i]
        for j in order:
            a, sf = taps[j]
            if a.shape[1] * 2 == case.k and same_bytes(case.gemm(a, sf, y.dtype), y):
                free.remove(j)
                tied.append((a, sf.view(torch.uint8), ys[i]))
                break
        else:
            raise _TieError(case.id)
    return tied


def _run_eager(case: Case) -> Run:
    """The case run eagerly (no compile) over every step: the ground truth the unfused graph must equal."""
    run = Run()
    case.build()
    case.impl.clear_cache()
    try:
        for k, spec in enumerate(STEPS):
            buffer = case.input_buffer()
            with runtime.batch(spec), torch.no_grad(), tap_gemm_inputs() as taps:
                ys = (case.forward(case.inputs(k, spec.num_tokens), spec.num_tokens, buffer),)
            (record,) = _tie_taps([case], taps, ys)
            run.steps.append(record + (buffer,))
    except Exception as exc:  # noqa: BLE001 - the case is discarded
        run.error = f"step {len(run.steps)}: {type(exc).__name__}: {exc}"
    finally:
        case.impl.clear_cache()
    return run


def _run_group(cases, form: str, with_pass: bool):
    """Compile the group's function (with or without the pass) and run every step; stop at the first error."""
    torch._dynamo.reset()
    fusion = FusionPass() if with_pass else None
    counting = _Counting(fusion)
    runs = {c.id: Run() for c in cases}
    error = None
    for case in cases:
        case.build()
        case.impl.clear_cache()
    # one token count for every batch: no recompiles (should one happen anyway, the pass runs on every
    # graph and each layer's outcomes over all of them are kept)
    # scalar C++ kernels (no ISA has 1-lane vectors; unlike vec_isa_ok=False this leaves the process's cached ISA
    # list alone): about half the C++ compile time of the copies some chains need; the pass runs on the post-grad
    # graph, before any code is generated
    with inductor_config.patch({"enable_auto_functionalized_v2": form == "v2", "fx_graph_cache": False,
                                "cpp.simdlen": 1}), \
            settings.use_backend("reference"), _LastLayer() as last:
        compiled = torch.compile(_group_function(cases), fullgraph=True,
                                 options={"post_grad_custom_post_pass": counting, "fx_graph_cache": False})
        for k, spec in enumerate(STEPS):
            inputs, buffers = _group_inputs(cases, k)
            last.name = None
            try:
                with runtime.batch(spec), torch.no_grad(), tap_gemm_inputs() as taps:
                    ys = compiled(*inputs)
                tied = _tie_taps(cases, taps, ys)
            except Exception as exc:  # noqa: BLE001 - reported per case
                phase = "compile" if counting.graphs == 0 or k == 0 and "Inductor" in type(exc).__name__ else "run"
                msg = str(exc).strip().splitlines()
                if isinstance(exc, _TieError):
                    culprit = exc.case_id
                elif "_run_attention" in {f.name for f in traceback.extract_tb(exc.__traceback__)}:
                    culprit = next((c.id for c in cases if c.layer_name == last.name), None)
                else:
                    culprit = None
                error = (k, f"step {k} ({spec.kind}, T={spec.num_tokens}, {phase}): {type(exc).__name__}: "
                            f"{msg[0][:400] if msg else ''}", culprit)
                break
            for case, record in zip(cases, tied):
                runs[case.id].steps.append(record + (buffers.get(case.id),))
    for case in cases:
        case.impl.clear_cache()
    torch._dynamo.reset()
    by_layer = {c.layer_name: runs[c.id] for c in cases}
    for run in runs.values():
        run.graphs = counting.graphs
    for report in fusion.graphs if fusion is not None else ():
        for entry in report.layers:
            if entry["layer"] in by_layer:
                reason = entry.get("reason")
                by_layer[entry["layer"]].outcomes.append(entry["outcome"] + (f" ({reason})" if reason else ""))
    return runs, error


def _run_isolating(cases, form: str, with_pass: bool) -> dict[str, Run]:
    """:func:`_run_group`, split until each error is pinned on one case (the others' runs are complete)."""
    runs, error = _run_group(cases, form, with_pass)
    if error is None:
        return runs
    if len(cases) == 1:
        runs[cases[0].id].error = error[1]
        return runs
    suspects = [c for c in cases if runs[c.id].rewritten and not c.preserving]
    suspects += [c for c in cases if c.id == error[2] and c not in suspects]
    if not suspects or len(suspects) == len(cases):
        half = len(cases) // 2
        parts = [cases[:half], cases[half:]]
    else:
        parts = [[c for c in cases if c not in suspects], suspects]
    result = {}
    for part in parts:
        result.update(_run_isolating(part, form, with_pass))
    return result


# ---------------------------------------------------------------- judging a case


@dataclass
class Verdict:
    case: Case
    form: str
    outcomes: list = field(default_factory=list)
    graphs: int = 0
    discarded: str | None = None
    failures: list = field(default_factory=list)

    @property
    def rewritten(self) -> bool:
        return "rewritten" in self.outcomes

    def text(self) -> str:
        outcome = ", ".join(self.outcomes) or "none reported"
        graphs = f" ({self.graphs} graphs: Inductor recompiled)" if self.graphs > 1 else ""
        head = f"{self.case.describe()}\n  form {self.form}: pass outcome {outcome}{graphs}"
        return "\n".join([head] + [f"  - {f}" for f in self.failures])


STEP_PARTS = ("packed bytes", "scale bytes", "GEMM output", "persistent buffer after the call")


def _bitwise(ref, got, parts=STEP_PARTS) -> list[str]:
    """Differences between two step records (packed, scales, GEMM output, buffer or None)."""
    diffs = []
    for name, r, g in zip(STEP_PARTS, ref, got):
        if name not in parts or r is None and g is None:
            continue
        if r is None or g is None or r.shape != g.shape:
            diffs.append(f"{name} shape {None if g is None else list(g.shape)} != {None if r is None else list(r.shape)}")
        elif not same_bytes(r, g):
            n = int((_bits(r) != _bits(g)).sum())
            diffs.append(f"{name} differ ({n} of {r.numel() * r.element_size()} bytes)")
    return diffs


def _within_bound(case: Case, k: int, ref, got) -> str | None:
    """None if the fused operands of step k are within the numerics test's bound of the unfused ones."""
    spec, t, w = STEPS[k], STEPS[k].num_tokens, case.width
    (a_ref, sf_ref, *_), (a_got, sf_got, *_) = ref, got
    if a_got.shape != (t, w // 2) or a_ref.shape != (t, w // 2):
        return f"fused operand {list(a_got.shape)} / unfused {list(a_ref.shape)}, expected [{t}, {w // 2}]"
    gs = case.o_proj.input_global_scale
    attn32 = case.attention32(case.inputs(k, t), spec)
    attn16 = attn32.to(torch.bfloat16).float()
    fused = nvfp4.dequantize(a_got, sf_got.view(torch.float8_e4m3fn), gs, m=t)
    plain = nvfp4.dequantize(a_ref, sf_ref.view(torch.float8_e4m3fn), gs, m=t)
    bound = nvfp4.error_bound(attn32, gs) + nvfp4.error_bound(attn16, gs) + (attn32 - attn16).abs()
    excess = (fused - plain).abs() - bound
    if (excess > 0).any():
        return (f"{int((excess > 0).sum())} of {excess.numel()} elements beyond the bound "
                f"(max excess {float(excess.max()):.4g})")
    return None


def _rows_within_bound(case: Case, k: int, ref, got) -> str | None:
    """A mixed / chunked step: decode rows bitwise equal (MLA's split; a standard layer's decode rows are written by
    the one launch over its paged cache, within the bound like the prefill rows), prefill rows within the
    requantization bound."""
    from fusion_pass.demo.workload import requantization_bound, rows_equal

    spec, t, w = STEPS[k], STEPS[k].num_tokens, case.width
    (a_ref, sf_ref, *_), (a_got, sf_got, *_) = ref, got
    if a_got.shape != (t, w // 2) or a_ref.shape != (t, w // 2):
        return f"fused operand {list(a_got.shape)} / unfused {list(a_ref.shape)}, expected [{t}, {w // 2}]"
    d = spec.num_decode_tokens
    if case.kind != "gqa" and not rows_equal([(a_got, sf_got)], [(a_ref, sf_ref)], d):
        return f"decode rows [0, {d}) differ from the unfused graph's"
    gs = case.o_proj.input_global_scale
    fused = nvfp4.dequantize(a_got, sf_got.view(torch.float8_e4m3fn), gs, m=t)
    plain = nvfp4.dequantize(a_ref, sf_ref.view(torch.float8_e4m3fn), gs, m=t)
    excess = (fused - plain).abs() - requantization_bound(plain, gs)
    if (excess > 0).any():
        return (f"{int((excess > 0).sum())} of {excess.numel()} elements beyond the requantization bound "
                f"(max excess {float(excess.max()):.4g})")
    return None


def _judge(case: Case, form: str, eager: Run, ref: Run, got: Run | None) -> Verdict:
    verdict = Verdict(case, form)
    if eager.error is not None:
        verdict.discarded = f"raises eagerly: {eager.error}"
        return verdict
    if ref.error is not None:
        verdict.discarded = f"raises compiled without the pass: {ref.error}"
        return verdict
    wrong = [k for k, (e, r) in enumerate(zip(eager.steps, ref.steps)) if _bitwise(e, r)]
    if wrong:
        # torch.compile's own graph (no pass) does not compute what eager does, e.g. it reads a buffer's
        # unwritten rows: with vs without the pass then compares garbage, so the case cannot be judged.
        verdict.discarded = (f"compiled without the pass, the results differ from eager at steps {wrong}: the "
                             f"unfused graph does not compute what eager does (torch.compile, not the pass)")
        UNFUSED_DIFFERS_FROM_EAGER.append(f"{case.id} ({form})")
        return verdict
    verdict.outcomes, verdict.graphs = got.outcomes, got.graphs
    fail = verdict.failures
    if got.error is not None:
        fail.append(f"(c) raises with the pass, not without: {got.error}")
    if not got.outcomes and got.error is None:
        fail.append("the pass reported no outcome for this layer")
    rewritten = got.rewritten  # in some graph (a prefill step is then judged by the bound, which equal bytes meet)
    if rewritten and not case.preserving:
        fail.append(f"rewrote a chain that is not layout-preserving ({case.oracle_detail}): the pass must refuse")
    for k, (r, g) in enumerate(zip(ref.steps, got.steps)):
        spec = STEPS[k]
        where = f"step {k} ({spec.kind}, T={spec.num_tokens})"
        if rewritten and spec.num_tokens > spec.num_decode_tokens:  # prefill rows: fused
            judge = _within_bound if spec.kind == "prefill" else _rows_within_bound
            problem = judge(case, k, r, g)
            if problem:
                fail.append(f"(b) {where}, fused: {problem}")
            lost = _bitwise(r, g, parts=STEP_PARTS[3:])  # the bf16 side effect stays, fused or not
            if lost:
                fail.append(f"(b) {where}, fused: " + "; ".join(lost))
        else:
            diffs = _bitwise(r, g)
            if diffs:
                fail.append(f"({'b' if rewritten else 'a'}) {where}, {'fallback' if rewritten else 'refused'}: "
                            + "; ".join(diffs))
    return verdict


_VERDICTS: dict[tuple[int, str], dict[str, Verdict]] = {}
# Cases whose graph compiled without the pass already differs from eager (torch.compile's doing, not the
# pass's): discarded, and listed in the summary.
UNFUSED_DIFFERS_FROM_EAGER: list[str] = []
_EAGER: dict[str, Run] = {}


def _group_verdicts(index: int, form: str) -> dict[str, Verdict]:
    key = (index, form)
    if key not in _VERDICTS:
        cases = [c for c in GROUPS[index] if form in c.forms]
        for case in cases:
            if case.id not in _EAGER:
                _EAGER[case.id] = _run_eager(case)
        cases = [c for c in cases if _EAGER[c.id].error is None]
        ref = _run_isolating(cases, form, with_pass=False)
        live = [c for c in cases if ref[c.id].error is None]
        got = _run_isolating(live, form, with_pass=True) if live else {}
        _VERDICTS[key] = {c.id: _judge(c, form, _EAGER[c.id], ref.get(c.id, Run()), got.get(c.id))
                          for c in GROUPS[index] if form in c.forms}
    return _VERDICTS[key]


def verdict(case: Case, form: str) -> Verdict:
    return _group_verdicts(GROUP_OF[case.id], form)[case.id]


def _check(case: Case, form: str) -> Verdict:
    v = verdict(case, form)
    if v.discarded:
        pytest.skip(f"{case.id}: {v.discarded}")
    assert not v.failures, v.text()
    return v


# ---------------------------------------------------------------- the oracle, checked on its own


def test_oracle_classifies_the_known_chains():
    """The oracle says the issue's chains are not layout-preserving and the anchors are."""
    for case in REPROS:
        assert case.preserving is False, case.describe()
    for case in ANCHORS:
        assert case.preserving is True, case.describe()
    expected = {"persistent_buffer": True, "view_fp16": False, "float": True}
    for case in ATTACKS:
        assert case.preserving is expected[case.id.split("-")[1]], case.describe()
    extra = {
        "broadcast rows": ([op_as_strided([(1, 1), (64, 0)], [(0, 0), (1, 0)])], False),
        "per-token head/dim swap": ([op_view([(1, 1), (2, 0), (32, 0)], None),
                                     op_named("transpose(1, 2)", lambda x, T: x.transpose(1, 2)),
                                     op_view([(1, 1), (64, 0)], 1, "reshape")], False),
        "view(T, Dv, H) is still row-major": ([op_view([(1, 1), (32, 0), (2, 0)], None),
                                               op_view([(1, 1), (64, 0)], 1)], True),
        "all but the first token": ([op_named("narrow(0, 1, T-1)", lambda x, T: x.narrow(0, 1, T - 1))], False),
        "a row's second half, as rows": ([op_as_strided([(1, 1), (32, 0)], [(64, 0), (1, 0)], (32, 0))], False),
    }
    for name, (chain, expected) in extra.items():
        case = _case(f"oracle-{name}", "mla", chain, category="oracle")
        assert case.preserving is expected, case.describe()
    # the generator draws both kinds, in useful proportions
    if len(GENERATED) >= 40:
        share = sum(c.preserving for c in GENERATED) / len(GENERATED)
        assert 0.15 <= share <= 0.85, f"{share:.0%} of the generated chains are layout-preserving"


# ---------------------------------------------------------------- the issue's reproductions


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case_id", [c.id for c in REPROS])
def test_issue_reproduction(case_id, form):
    _check(BY_ID[case_id], form)


# ---------------------------------------------------------------- beyond the issue


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case_id", [c.id for c in ATTACKS])
def test_attack(case_id, form):
    _check(BY_ID[case_id], form)


# ---------------------------------------------------------------- anchors and generated chains


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case_id", [c.id for c in ANCHORS])
def test_layout_preserving_anchor(case_id, form):
    _check(BY_ID[case_id], form)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case_id", [c.id for c in GENERATED])
def test_generated_chain(case_id, form):
    _check(BY_ID[case_id], form)


# ---------------------------------------------------------------- the pass does not refuse everything


@pytest.mark.parametrize("form", FORMS)
def test_rewrite_rate_on_layout_preserving_chains_is_not_zero(capsys, form):
    """Over the anchors (and the generated chains that are layout-preserving), some are rewritten, in each form."""
    rates: dict[str, Counter] = defaultdict(Counter)
    for case in ALL_CASES:
        if not case.preserving or form not in case.forms:
            continue
        v = verdict(case, form)
        if v.discarded:
            continue
        key = f"{case.category:9s} {case.kind} {form}"
        rates[key]["cases"] += 1
        rates[key]["rewritten"] += v.rewritten
    with capsys.disabled():
        print("\nrewrite rate on layout-preserving chains:")
        for key in sorted(rates):
            print(f"  {key}: {rates[key]['rewritten']}/{rates[key]['cases']}")
        if UNFUSED_DIFFERS_FROM_EAGER:
            print("discarded, compiled without the pass differs from eager: "
                  + ", ".join(UNFUSED_DIFFERS_FROM_EAGER))
    anchors = [verdict(c, form) for c in ANCHORS if form in c.forms]
    rewritten = [v for v in anchors if v.rewritten]
    assert rewritten, "the pass rewrote none of the layout-preserving anchors:\n" + "\n".join(v.text() for v in anchors)
    # the chains the modules themselves produce are rewritten in both forms (as test_fusion_pass asserts)
    for kind in ("mla", "gqa"):
        v = verdict(BY_ID[f"anchor-module-{kind}"], form)
        assert v.rewritten, v.text()
