"""bench/serving_trace.py: the schedule generator, the pure-prefill gate's fraction, the command line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusion_pass import nvfp4


BENCH = Path(__file__).resolve().parents[2] / "bench" / "serving_trace.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_serving_trace", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


st = _load()
sched = sys.modules["_schedule"]  # bench/ is on sys.path once the script is loaded
steps_mod = sys.modules["_serving_steps"]
REFERENCE_KERNELS = st.reference_kernels  # tests monkeypatch st.reference_kernels
Chunk, Step, Lengths, TraceConfig = sched.Chunk, sched.Step, sched.Lengths, sched.TraceConfig

SEEDS = range(25)


def small_config(seed: int, **overrides) -> TraceConfig:
    """Short prompts against a small budget and few slots: chunking, mixed batches and queueing all happen."""
    base = dict(steps=60, budget=24, max_seqs=5, rate=1.5, prompt=Lengths(30, 1.0, 2, 120),
                decode=Lengths(4, 0.5, 1, 10), prefix_hit_rate=0.3, block_size=4, seed=seed)
    return TraceConfig(**{**base, **overrides})


# --------------------------------------------------------------------------
# The schedule
# --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_schedule_invariants(seed):
    cfg = small_config(seed)
    steps = st.generate_schedule(cfg)
    assert [s.index for s in steps] == list(range(cfg.steps))
    state = {}  # request_id -> {"prompt_len", "decode_len", "computed", "decoded", "finished"}
    for step in steps:
        assert step.tokens <= cfg.budget
        kinds = [c.prompt for c in step.chunks]
        assert kinds == sorted(kinds), "decodes come first"
        ids = [c.request_id for c in step.chunks]
        assert len(ids) == len(set(ids)), "one chunk per request and step"
        for a in step.admitted:
            assert a.request_id not in state, "request ids are unique"
            state[a.request_id] = {"prompt_len": a.prompt_len, "decode_len": a.decode_len, "computed": a.cached,
                                   "decoded": 0, "finished": False}
        running = [r for r in state.values() if not r["finished"]]
        assert len(running) <= cfg.max_seqs
        for c in step.chunks:
            r = state[c.request_id]
            assert not r["finished"]
            assert c.context_len == r["computed"], "chunk context lengths add up"
            if c.prompt:
                assert 1 <= c.query_len and r["computed"] + c.query_len <= r["prompt_len"]
            else:  # a decode: only once the whole prompt is in the cache
                assert c.query_len == 1 and r["computed"] == r["prompt_len"] + r["decoded"]
                r["decoded"] += 1
            r["computed"] += c.query_len
        for rid in step.finished:
            r = state[rid]
            assert r["decoded"] == r["decode_len"] and r["computed"] == r["prompt_len"] + r["decode_len"]
            r["finished"] = True
        spec = step.batch_spec()  # BatchSpec itself refuses decodes after prefills and duplicate ids
        assert (spec is None) == (not step.chunks)
        if spec is not None:
            assert spec.num_tokens == step.tokens
            assert sum(r.query_len for r in spec.requests if r.query_len > 1) == step.prefill_tokens
    assert sum(s.arrived for s in steps) >= len(state)
    # admitted first come, first served
    order = [int(a.request_id.removeprefix("req")) for s in steps for a in s.admitted]
    assert order == list(range(len(order)))


def test_schedules_have_chunked_prefills_mixed_batches_and_finished_requests():
    seen = set()
    for seed in SEEDS:
        steps = st.generate_schedule(small_config(seed, prefix_hit_rate=0.0))
        seen |= {s.kind for s in steps}
        assert any(c.prompt and c.context_len for s in steps for c in s.chunks), "a prompt chunked over steps"
        assert any(s.finished for s in steps)
        assert any(s.tokens == 24 for s in steps), "the budget is filled"
    assert {"prefill", "decode", "mixed"} <= seen


@pytest.mark.parametrize("seed", SEEDS)
def test_schedule_is_deterministic_per_seed(seed):
    cfg = small_config(seed)
    assert st.generate_schedule(cfg) == st.generate_schedule(cfg)
    assert st.generate_schedule(cfg) != st.generate_schedule(small_config(seed + 1000))


@pytest.mark.parametrize("seed", SEEDS)
def test_prefix_hits_give_first_chunks_context(seed):
    block = 4
    steps = st.generate_schedule(small_config(seed, prefix_hit_rate=1.0, block_size=block))
    first_chunk = {}
    for s in steps:
        for c in s.chunks:
            first_chunk.setdefault(c.request_id, c)
    admitted = [a for s in steps for a in s.admitted]
    assert sum(1 for a in admitted if a.cached) > 0
    for a in admitted:
        assert a.cached % block == 0 and 0 <= a.cached <= a.prompt_len - 1
        if a.prompt_len >= 4 * block + 1:  # a quarter of the prompt at least holds a whole block
            assert a.cached > 0
        assert first_chunk[a.request_id].context_len == a.cached
        assert first_chunk[a.request_id].prompt
    no_hits = st.generate_schedule(small_config(seed, prefix_hit_rate=0.0))
    assert all(a.cached == 0 for s in no_hits for a in s.admitted)


def test_no_arrivals_gives_idle_steps():
    steps = st.generate_schedule(small_config(0, rate=0.0, steps=5))
    assert all(s.kind == "idle" and s.batch_spec() is None for s in steps)
    assert st.pure_prefill_gate_fraction(steps) is None


# --------------------------------------------------------------------------
# The pure-prefill gate, by hand
# --------------------------------------------------------------------------


def test_pure_prefill_gate_fraction_by_hand():
    steps = [
        Step(0, (Chunk("a", 10, 0, True), Chunk("b", 6, 0, True))),   # pure prefill: 16 fused
        Step(1, (Chunk("a", 1, 10, False), Chunk("c", 8, 0, True))),  # mixed: 8 not
        Step(2, (Chunk("d", 5, 4, True),)),                           # a prefill with context: 5 not
        Step(3, (Chunk("a", 1, 11, False), Chunk("b", 1, 6, False))),  # decode only: no prefill token
        Step(4, ()),                                                  # idle
        Step(5, (Chunk("e", 1, 0, True), Chunk("f", 4, 0, True))),    # a one-token prompt is a decode: 4 not
    ]
    assert [s.kind for s in steps] == ["prefill", "mixed", "chunked", "decode", "idle", "mixed"]
    assert [s.prefill_tokens for s in steps] == [16, 8, 5, 0, 0, 4]
    assert [s.gate_fused for s in steps] == [True, False, False, False, False, False]
    assert st.pure_prefill_gate_fraction(steps) == pytest.approx(16 / 33)
    assert st.pure_prefill_gate_fraction(steps[:1]) == 1.0
    assert st.pure_prefill_gate_fraction(steps[1:]) == 0.0
    assert st.pure_prefill_gate_fraction(steps[3:5]) is None
    # the one-token prompt goes first in the runtime's batch, as a decode
    assert [r.request_id for r in steps[5].batch_spec().requests] == ["e", "f"]
    assert [r.request_id for r in Step(6, (Chunk("f", 4, 0, True), Chunk("e", 1, 0, True))).batch_spec().requests] \
        == ["e", "f"]


def test_pure_prefill_gate_on_a_generated_schedule_counts_only_prefill_steps():
    steps = st.generate_schedule(small_config(3))
    total = sum(s.prefill_tokens for s in steps)
    fused = sum(s.prefill_tokens for s in steps if s.kind == "prefill")
    assert st.pure_prefill_gate_fraction(steps) == pytest.approx(fused / total)
    stats = st.schedule_stats(steps)
    assert stats["prefill_tokens"] == total == sum(stats["prefill_tokens_by_kind"].values())


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def test_help_describes_the_options(capsys):
    with pytest.raises(SystemExit) as exc:
        st.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for option in ("--budget", "--steps", "--seed", "--model", "--tiny", "--device", "--json", "--rate",
                   "--max-seqs", "--prefix-hit-rate", "--workspace-tokens", "pure_prefill_gate", "--markdown",
                   "--timing-only", "--cpu-timing", "--launch-us", "--repeats", "--warmup", "cu_seqlens_k",
                   "4.8 TB/s", "--page-size", "unfused_paged", "fused_paged", "pass_on", "mixed_one_call"):
        assert option in out


def test_workspace_bound_is_checked_and_recorded(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("FUSION_PASS_CONTEXT_WORKSPACE_TOKENS", raising=False)
    with pytest.raises(SystemExit):
        st.main(["--tiny", "--schedule-only", "--workspace-tokens", "0"])
    assert "--workspace-tokens must be >= 1" in capsys.readouterr().err
    path = tmp_path / "trace.json"
    assert st.main(["--tiny", "--schedule-only", "--workspace-tokens", "64", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["config"]["context_workspace_tokens"] == 64
    assert st.main(["--tiny", "--schedule-only", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["config"]["context_workspace_tokens"] == 65536


def test_schedule_only_writes_the_json_without_the_model(tmp_path, capsys):
    path = tmp_path / "trace.json"
    assert st.main(["--tiny", "--schedule-only", "--budget", "32", "--steps", "20", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["budget"] == 32 and doc["steps"] == 20 and isinstance(doc["prefill_tokens"], int)
    assert isinstance(doc["fused_fraction"]["pure_prefill_gate"], float) and doc["fused_fraction"]["this"] is None
    assert doc["counters"] is None and doc["timing"]["skipped"]
    assert len(doc["per_step"]) == 20
    assert "pure-prefill gate" in capsys.readouterr().out


def test_missing_token_counters_fail_with_a_clear_message(monkeypatch, capsys):
    monkeypatch.setattr(st.counters, "counters", lambda: {"fused": 0, "fused_by_backend": {}, "fallback": {}})
    assert st.main(["--tiny", "--steps", "3"]) == 2
    assert "has no per-token counters" in capsys.readouterr().err


def test_tiny_run_end_to_end(tmp_path):
    path = tmp_path / "trace.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--tiny", "--prefix-hit-rate", "0.3", "--json", str(path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(path.read_text())
    assert isinstance(doc["budget"], int) and isinstance(doc["steps"], int) and doc["prefill_tokens"] > 0
    gate, this = doc["fused_fraction"]["pure_prefill_gate"], doc["fused_fraction"]["this"]
    assert isinstance(gate, float) and isinstance(this, float)
    assert 0.0 <= gate <= this <= 1.0
    assert this == 1.0, "on the CPU the reference backend fuses every prefill row (decode rows post-quantized)"
    assert gate < 0.5, "the schedule mixes decodes into most steps"
    counters = doc["counters"]
    assert counters["prefill"] == counters["layers"] * doc["prefill_tokens"] and counters["mismatched_steps"] == []
    assert doc["pass"]["rewritten"] > 0 and doc["timing"]["skipped"]
    assert len(doc["per_step"]) == doc["steps"]
    assert "this guard" in proc.stdout


def test_requests_longer_than_the_models_positions_are_refused(capsys):
    assert st.FULL["prompt"].high + st.FULL["decode"].high <= st.MAX_POSITION, "the default schedule must fit"
    assert st.main(["--schedule-only", "--prompt-mean", "5000"]) == 2
    assert "the demo models' positions stop at 32768" in capsys.readouterr().err


# --------------------------------------------------------------------------
# The timed steps (bench/_serving_steps.py)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(10))
def test_kv_regions_never_overlap_while_live_and_are_reused(seed):
    steps = st.generate_schedule(small_config(seed, steps=120))
    starts, rows = steps_mod.plan_regions(steps)
    sizes = {a.request_id: a.prompt_len + a.decode_len for s in steps for a in s.admitted}
    assert set(starts) == set(sizes)
    live = {}
    for step in steps:
        for a in step.admitted:
            lo, hi = starts[a.request_id], starts[a.request_id] + sizes[a.request_id]
            assert 0 <= lo and hi <= rows
            for other, (olo, ohi) in live.items():
                assert hi <= olo or ohi <= lo, f"{a.request_id} overlaps {other}"
            live[a.request_id] = (lo, hi)
        for c in step.chunks:  # every token a step writes lies in its request's region
            assert c.context_len + c.query_len <= sizes[c.request_id]
        for rid in step.finished:
            del live[rid]
    if sum(len(s.finished) for s in steps) > 2:
        assert rows < sum(sizes.values()), "freed regions are reused"


def test_step_layout_by_hand():
    spec = Step(0, (Chunk("a", 1, 5, False), Chunk("b", 3, 2, True), Chunk("c", 2, 0, True))).batch_spec()
    layout = steps_mod.step_layout(spec, {"a": 100, "b": 10, "c": 50})
    assert (layout.tokens, layout.decodes, layout.prefill_tokens) == (6, 1, 5)
    assert layout.cu_q == (0, 1, 4, 6) and layout.cu_k == (0, 6, 11, 13)
    assert layout.new_rows == (105, 12, 13, 14, 50, 51)
    assert layout.key_rows == (100, 101, 102, 103, 104, 105, 10, 11, 12, 13, 14, 50, 51)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("page", [4, 16])
def test_page_aligned_regions_hold_every_requests_pages(seed, page):
    """``plan_regions(steps, align=page)``: regions start on a page and are whole pages, never overlap while
    live, are reused; every key a step reads lies in a page of its request's region, and the step's page table
    lists exactly those pages, in order."""
    steps = st.generate_schedule(small_config(seed, steps=80))
    starts, rows = steps_mod.plan_regions(steps, align=page)
    sizes = {a.request_id: -(-(a.prompt_len + a.decode_len) // page) * page for s in steps for a in s.admitted}
    assert set(starts) == set(sizes) and rows % page == 0
    assert steps_mod.plan_regions(steps, align=1) == steps_mod.plan_regions(steps)
    live = {}
    for step in steps:
        for a in step.admitted:
            lo, hi = starts[a.request_id], starts[a.request_id] + sizes[a.request_id]
            assert lo % page == 0 and 0 <= lo and hi <= rows
            for other, (olo, ohi) in live.items():
                assert hi <= olo or ohi <= lo, f"{a.request_id} overlaps {other}"
            live[a.request_id] = (lo, hi)
        spec = step.batch_spec()
        if spec is not None:
            layout = steps_mod.step_layout(spec, starts)
            table = steps_mod.page_table_rows(layout, page)
            assert len({len(r) for r in table}) == 1, "one width"
            for r, row, keys in zip(spec.requests, table, layout.seqused_k):
                lo, hi = live[r.request_id]
                used = -(-keys // page)
                assert keys == r.context_len + r.query_len and used * page <= hi - lo
                assert list(row[:used]) == list(range(lo // page, lo // page + used))
                assert all(p == 0 for p in row[used:])
        for rid in step.finished:
            del live[rid]
    if sum(len(s.finished) for s in steps) > 2:
        assert rows < sum(sizes.values()), "freed regions are reused"


def test_page_table_rows_by_hand():
    spec = Step(0, (Chunk("a", 1, 5, False), Chunk("b", 3, 2, True), Chunk("c", 2, 0, True))).batch_spec()
    layout = steps_mod.step_layout(spec, {"a": 96, "b": 8, "c": 48})
    assert layout.starts == (96, 8, 48) and layout.seqused_k == (6, 5, 2)
    assert steps_mod.page_table_rows(layout, 4) == ((24, 25), (2, 3), (12, 0))
    assert steps_mod.page_table_rows(layout, 8) == ((12,), (1,), (6,))
    assert steps_mod.page_table_rows(layout, 1)[2] == (48, 49, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="not aligned to pages of 16 rows"):
        steps_mod.page_table_rows(layout, 16)
    with pytest.raises(ValueError, match="align must be >= 1"):
        steps_mod.plan_regions([], align=0)


@pytest.mark.parametrize("page", [1, 4, 16])
def test_page_tables_read_back_the_workspace_keys(page):
    """Through the page table (FlashAttention's paged semantics, ``reference.gather_paged``) every busy step of a
    tiny trace reads from the slab's pages exactly the keys and values the packed workspace gathers."""
    from fusion_pass.kernels import reference

    steps = st.generate_schedule(st.config_from_args(st.parse_args(["--tiny", "--steps", "12",
                                                                    "--prefix-hit-rate", "0.5"])))
    regions, rows = steps_mod.plan_regions(steps, align=page)
    dims = steps_mod.AttnDims(2, 1, 16, 8)
    runner = steps_mod.StepRunner(REFERENCE_KERNELS(), dims, 2, rows, "cpu", page_size=page)
    assert runner.k_pages[0].shape == (rows // page, page, 1, 16) and runner.v_pages[1].shape[-1] == 8
    busy = 0
    for step in steps:
        if not step.chunks:
            continue
        busy += 1
        layout = steps_mod.step_layout(step.batch_spec(), regions)
        runner.prepare(layout)  # appends the step's keys, gathers the workspace
        seqused = torch.tensor(layout.seqused_k, dtype=torch.int32)
        table = torch.tensor(steps_mod.page_table_rows(layout, page), dtype=torch.int32)
        tk = layout.cu_k[-1]
        for pages, ws in zip(runner.k_pages + runner.v_pages, runner.k_ws + runner.v_ws):
            keys, cu_k = reference.gather_paged(pages, seqused, table)
            assert cu_k.tolist() == list(layout.cu_k)
            assert torch.equal(keys, ws[:tk])
    assert busy > 5


def test_page_size_option():
    assert st.parse_args([]).page_size == 16 == steps_mod.DEFAULT_PAGE_SIZE
    assert st.parse_args(["--page-size", "128"]).page_size == 128
    for bad in ("0", "-16"):
        with pytest.raises(SystemExit):
            st.parse_args(["--page-size", bad])


def test_fa4_paged_entry_points_fail_only_when_used():
    """A tree whose FA4 module lacks the paged entry points still builds the FA4 kernels; calling a missing one
    raises a clear error."""
    import types

    kernels_mod = sys.modules["_kernels"]
    forward = types.SimpleNamespace(fa4_attention_paged=len)
    assert kernels_mod._fa4_entry(forward, "fa4_attention_paged") is len
    missing = kernels_mod._fa4_entry(forward, "fa4_attention_nvfp4_paged")
    with pytest.raises(RuntimeError, match="has no fa4_attention_nvfp4_paged"):
        missing(None, None, None, cu_seqlens=None)


def test_ceiling_and_ratio_summary_by_hand():
    dims = steps_mod.AttnDims(16, 16, 192, 128)
    # 1000 tokens, 2 layers: 2 * 4 * 1000 * 16 * 128 bytes at 4.8 TB/s = 3.4133 us, plus 2 launches of 5 us
    assert steps_mod.ceiling_ms(1000, dims, 2) == pytest.approx(2 * 4 * 1000 * 2048 / 4.8e12 * 1e3)
    assert steps_mod.ceiling_ms(1000, dims, 2, launch_us=5) == pytest.approx(0.0034133 + 0.010, rel=1e-4)
    s = steps_mod.ratio_summary([1.0, 2.0, 4.0], [1.0, 1.0, 5.0], [0.5, 1.0, 0.0])
    assert s["ratio"]["min"] == 0.8 and s["ratio"]["median"] == 1.0 and s["ratio"]["max"] == 2.0
    assert s["overall"] == pytest.approx(7 / 7) and s["steps_below_0.99"] == 1
    assert s["ceiling_overall"] == pytest.approx(7 / 5.5)
    assert s["saving_taken"] == pytest.approx(0.0)
    assert s["ceiling"]["max"] == pytest.approx(2.0)


def test_split_ceiling_by_hand():
    dims = steps_mod.AttnDims(16, 16, 192, 128)
    mixed = steps_mod.step_layout(Step(0, (Chunk("a", 1, 5, False), Chunk("b", 3, 2, True))).batch_spec(),
                                  {"a": 0, "b": 10})
    decodes = steps_mod.step_layout(Step(0, (Chunk("a", 1, 5, False), Chunk("b", 1, 2, False))).batch_spec(),
                                    {"a": 0, "b": 10})
    prefill = steps_mod.step_layout(Step(0, (Chunk("b", 3, 2, True),)).batch_spec(), {"b": 10})
    # the decode rows are quantized after attention on both sides: only the prefill rows' pass and a launch
    assert steps_mod.split_ceiling_ms(mixed, dims, 2, launch_us=5) == steps_mod.ceiling_ms(3, dims, 2, launch_us=5)
    assert steps_mod.split_ceiling_ms(mixed, dims, 2, launch_us=5) < steps_mod.ceiling_ms(4, dims, 2, launch_us=5)
    assert steps_mod.split_ceiling_ms(decodes, dims, 2, launch_us=5) == 0.0
    assert steps_mod.split_ceiling_ms(prefill, dims, 2, launch_us=5) == steps_mod.ceiling_ms(3, dims, 2, launch_us=5)


def _varlen_args(name, q, k, cu_seqlens, max_seqlen, kw):
    """A logged varlen call: ``(kernel, arguments that pick the rows)``."""
    return (name, q.shape[0], tuple(cu_seqlens.tolist()), max_seqlen, tuple(kw["cu_seqlens_k"].tolist()),
            kw["max_seqlen_k"], k.shape[0])


def _paged_args(name, q, k_cache, kw):
    """A logged paged call: ``(kernel, arguments that pick the rows)``."""
    return (name, q.shape[0], tuple(kw["cu_seqlens"].tolist()), kw["max_seqlen"], tuple(kw["seqused_k"].tolist()),
            tuple(map(tuple, kw["page_table"].tolist())), kw["max_seqlen_k"], k_cache.shape[1])


def _logging_kernels(log: list):
    """The reference kernels, each call logged as ``(kernel, arguments that pick the rows)``."""
    ref = REFERENCE_KERNELS()

    def attention(q, k, v, cu_seqlens, max_seqlen, **kw):
        log.append(_varlen_args("attention", q, k, cu_seqlens, max_seqlen, kw))
        return ref.attention(q, k, v, cu_seqlens, max_seqlen, **kw)

    def fused(q, k, v, **kw):
        log.append(_varlen_args("fused", q, k, kw["cu_seqlens"], kw["max_seqlen"], kw))
        ref.fused(q, k, v, **kw)

    def quantize_into(x, gs, packed, scales):
        log.append(("quantize_into", x.shape[0]))
        ref.quantize_into(x, gs, packed, scales)

    def quantize_rows(x, gs, packed, scales, row_start):
        log.append(("quantize_rows", x.shape[0], row_start))
        ref.quantize_rows(x, gs, packed, scales, row_start)

    def attention_paged(q, k_cache, v_cache, **kw):
        log.append(_paged_args("attention_paged", q, k_cache, kw))
        return ref.attention_paged(q, k_cache, v_cache, **kw)

    def fused_paged(q, k_cache, v_cache, **kw):
        log.append(_paged_args("fused_paged", q, k_cache, kw))
        ref.fused_paged(q, k_cache, v_cache, **kw)

    return ref._replace(attention=attention, fused=fused, quantize_into=quantize_into, quantize_rows=quantize_rows,
                        attention_paged=attention_paged, fused_paged=fused_paged)


STEP_SHAPES = {  # (query_len, context_len) per request, decodes first
    "mixed": ((1, 5), (1, 9), (3, 2), (4, 0)),
    "prefill": ((3, 2), (4, 0)),
    "decode": ((1, 5), (1, 9)),
}


PAGE = 4  # rows per page in the hand-made steps


def _hand_step(shape: str, log: list, *, layers: int = 3, dims=None):
    """A runner over page-aligned regions (whole pages of :data:`PAGE` rows, in request order) for one of
    :data:`STEP_SHAPES`, its layout, and its prepared variants (the cached context filled with randn)."""
    chunks = tuple(Chunk(f"r{i}", q, c, q > 1) for i, (q, c) in enumerate(STEP_SHAPES[shape]))
    spec = Step(0, chunks).batch_spec()
    regions, top = {}, 0
    for i, (q, c) in enumerate(STEP_SHAPES[shape]):
        regions[f"r{i}"], top = top, top + -(-(q + c) // PAGE) * PAGE
    layout = steps_mod.step_layout(spec, regions)
    runner = steps_mod.StepRunner(_logging_kernels(log), dims or steps_mod.AttnDims(4, 4, 48, 32), layers, top,
                                  "cpu", page_size=PAGE)
    gen = torch.Generator().manual_seed(0)
    for slab in runner.k_slab + runner.v_slab:  # the cached context, as earlier steps would have left it
        slab.normal_(generator=gen)
    return runner, layout


def _calls(variants: dict, log: list) -> dict:
    calls = {}
    for name, call in variants.items():
        log.clear()
        call()
        calls[name] = list(log)
    return calls


@pytest.mark.parametrize("shape", sorted(STEP_SHAPES))
def test_unfused_split_makes_the_runtimes_calls_with_bf16_prefill_rows(shape):
    """Each variant's kernel calls, layer by layer: ``unfused_split``'s decode calls are ``fused``'s, its prefill
    attention has the offsets of ``fused``'s fused call; a step without decode rows is ``unfused``'s work, one
    without prefill rows ``fused``'s; the paged variants make one paged call over every row with the regions'
    pages. Checked pairs agree byte for byte, on every layer (and, on the reference kernels, the paged and packed
    unfused paths too)."""
    log, layers = [], 3
    runner, layout = _hand_step(shape, log, layers=layers)
    dims = runner.dims
    variants, fresh, outs = runner.prepare(layout)
    fresh()
    calls = _calls(variants, log)
    d, t, cu_q, cu_k = layout.decodes, layout.tokens, layout.cu_q, layout.cu_k
    tk = cu_k[-1]
    qlens = [b - a for a, b in zip(cu_q[:-1], cu_q[1:])]
    klens = [b - a for a, b in zip(cu_k[:-1], cu_k[1:])]
    decode = [("attention", d, cu_q[:d + 1], 1, cu_k[:d + 1], max(klens[:d]), cu_k[d]),
              ("quantize_rows", d, 0)] if d else []
    prefill_args = (t, cu_q[d:], max(qlens[d:]), cu_k[d:], max(klens[d:]), tk) if d < len(qlens) else None
    assert calls["unfused"] == layers * [("attention", t, cu_q, max(qlens), cu_k, max(klens), tk), ("quantize_into", t)]
    assert calls["fused_all"] == layers * [("fused", t, cu_q, max(qlens), cu_k, max(klens), tk)]
    if shape == "mixed":
        assert calls["fused"] == layers * [*decode, ("fused", *prefill_args)]
        assert calls["unfused_split"] == layers * [*decode, ("attention", *prefill_args), ("quantize_rows", t - d, d)]
    elif shape == "prefill":
        assert calls["unfused_split"] == calls["unfused"]
        assert calls["fused"] == calls["fused_all"]
    else:
        assert calls["unfused_split"] == calls["fused"] == layers * decode
    seqused = tuple(b - a for a, b in zip(cu_k[:-1], cu_k[1:]))
    starts = [layout.starts[i] // PAGE for i in range(len(seqused))]
    width = max(-(-n // PAGE) for n in seqused)
    table = tuple(tuple(range(s, s + -(-n // PAGE))) + (0,) * (width - -(-n // PAGE)) for s, n in zip(starts, seqused))
    paged = (t, cu_q, max(qlens), seqused, table, max(klens), PAGE)
    assert calls["unfused_paged"] == layers * [("attention_paged", *paged), ("quantize_into", t)]
    assert calls["fused_paged"] == layers * [("fused_paged", *paged)]
    for x, y in steps_mod.CHECKED_PAIRS + (("unfused_paged", "unfused"),):
        for bufs_x, bufs_y in zip(outs[x], outs[y], strict=True):
            for a, b in zip(bufs_x, bufs_y, strict=True):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (x, y)
    for p, sc in outs["unfused_split"]:  # every row written, its packed values and its block scales
        scales = nvfp4.unswizzle_scales(sc, t, dims.heads * dims.dv // 16).view(torch.uint8)
        assert p.ne(0).any(dim=1).all() and scales.ne(0).all()


def _policy_step(shape: str, gen: str, monkeypatch, mode: str = "measured"):
    from fusion_pass.runtime import policy, settings

    monkeypatch.setattr(policy, "generation", lambda device: gen)
    monkeypatch.delenv(settings.POLICY_ENV, raising=False)
    log = []
    runner, layout = _hand_step(shape, log, layers=1, dims=steps_mod.AttnDims(2, 2, 16, 16))
    with settings.use_policy(mode):
        choice = runner.pass_on_choice(layout)
        variants, fresh, outs = runner.prepare(layout)
    fresh()
    return choice, _calls(variants, log), outs


# per generation: the variant pass_on runs for a step of each kind (the policy table's verdicts)
PASS_ON = {"sm90": {"prefill": "fused_all", "mixed": "unfused_paged", "decode": "unfused_paged"},
           "cpu": {"prefill": "fused_all", "mixed": "fused_paged", "decode": "unfused_paged"},
           "sm100": {"prefill": "fused_all", "mixed": "unfused_paged", "decode": "unfused_paged"}}


@pytest.mark.parametrize("gen", sorted(PASS_ON))
@pytest.mark.parametrize("shape", sorted(STEP_SHAPES))
def test_pass_on_makes_the_calls_the_policy_table_picks(gen, shape, monkeypatch):
    """``pass_on`` under the default policy: a step without decode rows is a ``prefill`` call (fused as
    ``fused_all``), one with decode and prefill rows a ``mixed_one_call`` call (``fused_paged`` where the table
    fuses it, else ``unfused_paged``), a decode-only step never fused; its calls are the chosen variant's, its
    bytes too."""
    from fusion_pass.runtime import policy

    choice, calls, outs = _policy_step(shape, gen, monkeypatch)
    want = PASS_ON[gen][shape]
    plan = {"prefill": "prefill", "mixed": "mixed_one_call", "decode": "decode"}[shape]
    assert (choice["plan"], choice["variant"], choice["fused"]) == (plan, want, want != "unfused_paged")
    if plan != "decode":
        assert (choice["fused"], choice["why"]) == policy.verdict("cpu", plan)
        assert choice["fused"] == {r.rows: r.fuse for r in policy.POLICY_TABLE if r.generation == gen}[plan]
    assert calls["pass_on"] == calls[want]
    for a, b in zip(outs["pass_on"][0], outs[want][0]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_pass_on_fuses_mixed_steps_when_the_policy_says_always(monkeypatch):
    choice, calls, _ = _policy_step("mixed", "sm90", monkeypatch, mode="always")
    assert choice["variant"] == "fused_paged" and calls["pass_on"] == calls["fused_paged"]
    choice, calls, _ = _policy_step("decode", "sm90", monkeypatch, mode="always")
    assert choice["variant"] == "unfused_paged", "decode-only steps are never fused by the pass"


def test_pass_on_under_the_sm90_policy_in_a_trace(trace_steps, monkeypatch):
    """The trace's ``pass_on_policy`` entry under the SM90 table: mixed steps unfused, the fused share of rows is
    the rows of the steps without decode rows."""
    from fusion_pass.runtime import policy, settings

    steps, layouts = trace_steps
    few = [s for s in steps if s.index <= sorted(layouts)[4]]
    monkeypatch.setattr(policy, "generation", lambda device: "sm90")
    monkeypatch.delenv(settings.POLICY_ENV, raising=False)
    with settings.use_policy("measured"):
        t = st.time_trace(few, model="mla", tiny=True, device="cpu", layers=1, warmup=0, repeats=1, launch_us=5.0,
                          seed=0, progress=False, page_size=4)
    p = t["pass_on_policy"]
    assert p["generation"] == "sm90" and t["page_size"] == 4
    fused = [s for s in t["per_step"] if not s["decode_rows"]]
    assert p["fused_rows"] == sum(s["tokens"] for s in fused) and p["rows"] == sum(s["tokens"] for s in t["per_step"])
    assert [s["pass_on"]["variant"] for s in t["per_step"]] == [
        "fused_all" if not s["decode_rows"] else "unfused_paged" for s in t["per_step"]]
    assert p["steps_by_variant"].get("fused_paged") is None
    if any(s["decode_rows"] and s["prefill_rows"] for s in t["per_step"]):
        assert p["verdicts"]["mixed_one_call"]["fused"] is False
        assert p["verdicts"]["mixed_one_call"]["why"] == policy.verdict("cuda", "mixed_one_call")[1]
    assert any(line.startswith("  pass_on (policy for sm90): ") for line in st.timing_lines(t))
    assert not t["mismatched_steps"]


def test_timed_steps_on_the_cpu_agree_byte_for_byte(tmp_path, capsys):
    """The four variants (unfused in one call, unfused split like the runtime, fused as the runtime splits it,
    fused in one call) on the reference kernels: every busy step is timed and the checked pairs write the same
    bytes; the three ratios reach the summary, the markdown and the JSON."""
    path, md = tmp_path / "trace.json", tmp_path / "trace.md"
    assert st.main(["--tiny", "--timing-only", "--cpu-timing", "--steps", "14", "--prefix-hit-rate", "0.5",
                    "--warmup", "0", "--repeats", "1", "--json", str(path), "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    t = doc["timing"]
    busy = [s for s in doc["per_step"] if s["tokens"]]
    assert t["skipped"] is None and t["mismatched_steps"] == []
    assert [p["step"] for p in t["per_step"]] == [s["step"] for s in busy]
    assert set(t["bytes"]) == {"fused_all==unfused", "fused==unfused_split", "fused_paged==unfused_paged",
                               "fused==unfused", "unfused_paged==unfused"}
    assert [k for k, v in t["bytes"].items() if v["checked"]] == ["fused_all==unfused", "fused==unfused_split",
                                                                 "fused_paged==unfused_paged"]
    assert all(v["differ_at"] == [] for v in t["bytes"].values())
    assert all(all(p["bytes_equal"].values()) and len(p["bytes_equal"]) == 5 for p in t["per_step"])
    assert any(p["decode_rows"] and p["prefill_rows"] for p in t["per_step"]), "a mixed step"
    for p in t["per_step"]:
        assert p["unfused_split_ms"] > 0 and p["speedup_split"] == pytest.approx(p["unfused_split_ms"] / p["fused_ms"])
        assert p["ceiling_saving_split_ms"] <= p["ceiling_saving_ms"]
        assert (p["ceiling_saving_split_ms"] == 0) == (p["prefill_rows"] == 0)
    labels = {"fused": "unfused (one call) / fused (runtime)", "fused_all": "unfused (one call) / fused_all (one call)",
              "split": "unfused (split like the runtime) / fused (runtime)",
              "paged": "unfused (one paged call) / fused_paged", "pass_on": "unfused (one paged call) / pass_on"}
    for key, label in labels.items():
        assert set(t[key]["ratio"]) == {"n", "min", "p10", "median", "p90", "max"}
        assert t[key]["ratio"]["n"] == len(busy) and t[key]["label"] == label
        assert f"  {label}" in out and f"| {label} |" in md.read_text()
    assert (t["split"]["baseline"], t["split"]["variant"]) == ("unfused_split", "fused")
    ratios = [p["speedup_split"] for p in t["per_step"]]
    assert t["split"]["ratio"]["min"] == min(ratios) and t["split"]["ratio"]["max"] == max(ratios)
    assert t["split"]["overall"] == pytest.approx(t["total_unfused_split_ms"] / t["total_fused_ms"])
    assert t["total_unfused_split_ms"] == pytest.approx(sum(p["unfused_split_ms"] for p in t["per_step"]))
    # the paged variants and the pass with the CPU's policy: every step with prefill rows fused
    assert (t["paged"]["baseline"], t["paged"]["variant"]) == ("unfused_paged", "fused_paged")
    assert (t["pass_on"]["baseline"], t["pass_on"]["variant"]) == ("unfused_paged", "pass_on")
    assert t["pass_on"]["overall"] == pytest.approx(t["total_unfused_paged_ms"] / t["total_pass_on_ms"])
    assert t["page_size"] == 16 and doc["config"]["page_size"] == 16 and t["kv_slab_rows"] == 16 * t["kv_pages"]
    policy = t["pass_on_policy"]
    assert policy["generation"] == "cpu"
    for p in t["per_step"]:
        assert p["speedup_pass_on"] == pytest.approx(p["unfused_paged_ms"] / p["pass_on_ms"])
        assert -(-p["keys"] // 16) <= p["pages"] <= p["keys"]
        want = ("fused_all" if not p["decode_rows"] else "fused_paged" if p["prefill_rows"] else "unfused_paged")
        assert p["pass_on"]["variant"] == want and p["pass_on"]["fused"] == (want != "unfused_paged")
        assert p["pass_on_fused_rows"] == (p["tokens"] if p["pass_on"]["fused"] else 0)
    assert policy["rows"] == sum(p["tokens"] for p in t["per_step"])
    assert policy["fused_share"] == pytest.approx(sum(p["pass_on_fused_rows"] for p in t["per_step"]) / policy["rows"])
    decode_only = [p["tokens"] for p in t["per_step"] if not p["prefill_rows"]]
    assert policy["fused_rows"] == policy["rows"] - sum(decode_only), "only decode-only steps are not fused"
    assert policy["steps_by_variant"].get("unfused_paged", 0) == len(decode_only)
    assert f"pass_on fused share of rows: {policy['fused_share']:.3f}" in out
    assert f"pass_on fused share of rows: {policy['fused_share']:.3f}" in md.read_text()
    assert "pass_on target against unfused (one paged call)" in out
    assert "bytes fused_paged==unfused_paged (the same one paged call): equal at every step" in out
    assert doc["counters"] is None and doc["fused_fraction"]["this"] is None
    text = md.read_text()
    assert "4.8 TB/s" in text and "--timing-only" in text and "unfused (split)" in text
    assert "bytes fused==unfused_split (the same sub-batch calls): equal at every step" in out
    assert "ERROR" not in out
    floor = t["noise_floor"]
    same = [p["speedup_split"] for p in t["per_step"] if not p["prefill_rows"]]
    assert floor["n"] == len(same)
    if same:
        assert (floor["min"], floor["max"]) == (min(same), max(same))
        assert f"noise floor: on the {len(same)} steps without prefill rows" in out
        assert f"Noise floor: on the {len(same)} steps without prefill rows" in text


def test_noise_floor_by_hand():
    steps = [{"prefill_rows": 0, "unfused_split_ms": 1.0, "fused_ms": 1.25},
             {"prefill_rows": 3, "unfused_split_ms": 9.0, "fused_ms": 1.0},
             {"prefill_rows": 0, "unfused_split_ms": 1.1, "fused_ms": 1.0}]
    assert st.noise_floor(steps) == {"n": 2, "min": 0.8, "max": pytest.approx(1.1)}
    assert st.noise_floor(steps[1:2]) == {"n": 0, "min": None, "max": None}
    assert "not measured" in st._noise_line({"noise_floor": st.noise_floor(steps[1:2])})
    assert "0.800x .. 1.100x" in st._noise_line({"noise_floor": st.noise_floor(steps)})


def _flip(buf, row):
    b = buf.view(torch.uint8)
    b[row, 0] = b[row, 0] ^ 0xFF


def _corrupting(which: str):
    """Reference kernels with one byte flipped (in the first row the call writes) of the calls ``which`` names:
    ``rows_past_0``: row-range quantizer calls from a row past 0 (``unfused_split``'s prefill rows);
    ``fused_sub_batch`` / ``fused_from_row_0``: fused calls whose rows start past row 0 / at row 0;
    ``same_in_both``: both ``rows_past_0`` and ``fused_sub_batch`` (the same byte on both sides of a pair);
    ``fused_paged``: every fused paged call."""
    ref = REFERENCE_KERNELS()

    def fused_paged(q, k_cache, v_cache, **kw):
        ref.fused_paged(q, k_cache, v_cache, **kw)
        if which == "fused_paged":
            _flip(kw["output"], int(kw["cu_seqlens"][0]))

    def fused(q, k, v, **kw):
        ref.fused(q, k, v, **kw)
        first = int(kw["cu_seqlens"][0])
        if (which in ("fused_sub_batch", "same_in_both") and first > 0) or (which == "fused_from_row_0" and not first):
            _flip(kw["output"], first)

    def quantize_rows(x, gs, packed, scales, row_start):
        ref.quantize_rows(x, gs, packed, scales, row_start)
        if which in ("rows_past_0", "same_in_both") and row_start > 0:
            _flip(packed, row_start)

    return ref._replace(fused=fused, quantize_rows=quantize_rows, fused_paged=fused_paged)


@pytest.fixture(scope="module")
def trace_steps():
    args = st.parse_args(["--tiny", "--steps", "16", "--prefix-hit-rate", "0.5"])
    steps = st.generate_schedule(st.config_from_args(args))
    layouts = {s.index: (s.decode_tokens, s.prefill_tokens) for s in steps if s.chunks}
    assert any(d and p for d, p in layouts.values()), "a mixed step"
    assert any(not d and p for d, p in layouts.values()), "a step without decode rows"
    return steps, layouts


def _time(steps, monkeypatch, which):
    monkeypatch.setattr(st, "reference_kernels", lambda: _corrupting(which))
    return st.time_trace(steps, model="mla", tiny=True, device="cpu", layers=1, warmup=0, repeats=1,
                         launch_us=5.0, seed=0, progress=False)


def test_a_corrupted_byte_is_reported_for_its_pair(trace_steps, monkeypatch):
    steps, layouts = trace_steps
    mixed = sorted(i for i, (d, p) in layouts.items() if d and p)
    no_decode = sorted(i for i, (d, p) in layouts.items() if not d)

    def differ(t):
        return {k: v["differ_at"] for k, v in t["bytes"].items()}

    paged_equal = {"fused_paged==unfused_paged": [], "unfused_paged==unfused": []}
    # unfused_split's prefill quantizer (rows from D > 0): only the split pair, at the mixed steps
    t = _time(steps, monkeypatch, "rows_past_0")
    assert differ(t) == {"fused_all==unfused": [], "fused==unfused_split": mixed, "fused==unfused": [], **paged_equal}
    assert t["mismatched_steps"] == mixed
    assert any(line.startswith("  ERROR: bytes fused==unfused_split") for line in st.timing_lines(t))
    # fused's prefill call beside decode rows: the split pair fails; fused != unfused is only recorded
    t = _time(steps, monkeypatch, "fused_sub_batch")
    assert differ(t) == {"fused_all==unfused": [], "fused==unfused_split": mixed, "fused==unfused": mixed,
                         **paged_equal}
    # a fused call over rows from 0: fused_all at every step, fused (one call then) at the steps without decodes
    t = _time(steps, monkeypatch, "fused_from_row_0")
    assert differ(t) == {"fused_all==unfused": sorted(layouts), "fused==unfused_split": no_decode,
                         "fused==unfused": no_decode, **paged_equal}
    assert t["mismatched_steps"] == sorted(layouts)
    # the same flip on both sides of the split pair: it holds; fused != unfused is not an error
    t = _time(steps, monkeypatch, "same_in_both")
    assert differ(t) == {"fused_all==unfused": [], "fused==unfused_split": [], "fused==unfused": mixed,
                         **paged_equal}
    assert t["mismatched_steps"] == []
    lines = st.timing_lines(t)
    assert not any("ERROR" in line for line in lines)
    assert f"  bytes fused==unfused (other calls: informational): differ at {len(mixed)} steps {mixed[:10]}" in lines


def test_a_corrupted_fused_paged_byte_is_reported_for_the_paged_pair(trace_steps, monkeypatch):
    steps, layouts = trace_steps
    few = [s for s in steps if s.index <= sorted(layouts)[3]]  # the first four busy steps (and what led to them)
    t = _time(few, monkeypatch, "fused_paged")
    busy = sorted(i for i in layouts if i <= sorted(layouts)[3])
    assert {k: v["differ_at"] for k, v in t["bytes"].items()} == {
        "fused_all==unfused": [], "fused==unfused_split": [], "fused_paged==unfused_paged": busy, "fused==unfused": [],
        "unfused_paged==unfused": []}
    assert t["mismatched_steps"] == busy
    assert any(line.startswith("  ERROR: bytes fused_paged==unfused_paged (the same one paged call)")
               for line in st.timing_lines(t))


def test_a_mismatch_of_a_checked_pair_exits_1(monkeypatch, capsys):
    monkeypatch.setattr(st, "reference_kernels", lambda: _corrupting("rows_past_0"))
    assert st.main(["--tiny", "--timing-only", "--cpu-timing", "--steps", "8", "--warmup", "0", "--repeats", "1",
                    "--layers", "1"]) == 1
    assert "ERROR: bytes fused==unfused_split (the same sub-batch calls): differ at" in capsys.readouterr().out
    monkeypatch.setattr(st, "reference_kernels", lambda: _corrupting("same_in_both"))
    assert st.main(["--tiny", "--timing-only", "--cpu-timing", "--steps", "8", "--warmup", "0", "--repeats", "1",
                    "--layers", "1"]) == 0


def test_cuda_without_a_gpu_is_refused(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert st.main(["--device", "cuda", "--timing-only", "--steps", "2"]) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_graph_clock_needs_cuda(capsys):
    with pytest.raises(SystemExit) as exit_info:
        st.parse_args(["--clock", "graph"])
    assert exit_info.value.code == 2
    assert "--clock graph needs --device cuda" in capsys.readouterr().err
    assert st.parse_args(["--clock", "graph", "--device", "cuda"]).clock == "graph"
    assert st.parse_args([]).clock == "eager"


@pytest.mark.parametrize("capturable", [True, False])
def test_graph_clock_replays_each_variant_or_times_the_step_eagerly_and_says_why(trace_steps, monkeypatch, capturable):
    """The clock's dispatch, on the CPU with the CUDA timers stood in: ``graph`` times every variant by the
    interleaved graph replay; when one variant's capture fails (here unfused_split, the second of every step), every variant of
    that step is timed by eager CUDA events instead (one clock per ratio), and the step is reported with the
    variant and its reason (JSON, summary and markdown)."""
    steps, _ = trace_steps
    timed = {"graph": 0, "eager": 0, "attempts": 0}
    variants = steps_mod.StepRunner.VARIANTS

    def graph_replay_interleaved_ms(fns, *, replays, warmup):
        assert replays == 3 and list(fns) == list(variants)
        samples = {}
        for name, fn in fns.items():
            timed["attempts"] += 1
            if not capturable and name == variants[1]:  # unfused_split
                raise steps_mod._timing.GraphCaptureError(
                    name, RuntimeError("operation not permitted when stream is capturing"))
            timed["graph"] += 1
            fn()
            samples[name] = [2.0, 1.0, 3.0]
        return samples

    def event_ms(fn, *, repeats, warmup, before):
        timed["eager"] += 1
        before(0)
        fn()
        return [5.0] * repeats

    monkeypatch.setattr(steps_mod._timing, "graph_replay_interleaved_ms", graph_replay_interleaved_ms)
    monkeypatch.setattr(steps_mod._timing, "event_ms", event_ms)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    original_init = steps_mod.StepRunner.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.cuda = True  # the CPU tensors stay; only the timers' dispatch is under test

    monkeypatch.setattr(steps_mod.StepRunner, "__init__", init)
    t = st.time_trace(steps, model="mla", tiny=True, device="cpu", layers=1, warmup=0, repeats=3, launch_us=5.0,
                      seed=0, progress=False, clock="graph")
    busy = len(t["per_step"])
    times = [v for p in t["per_step"] for k, v in p.items() if k.endswith("_ms") and "saving" not in k]
    if capturable:
        assert timed["graph"] == busy * len(variants) and timed["eager"] == 0
        assert times and all(v == 2.0 for v in times)
        assert t["eager_instead"] == [] and not any("warning" in line for line in st.timing_lines(t))
    else:
        assert timed["graph"] == busy and timed["eager"] == busy * len(variants)
        assert times and all(v == 5.0 for v in times), "one clock per step"
        assert [e["variant"] for e in t["eager_instead"]] == [variants[1]] * busy
        assert [e["step"] for e in t["eager_instead"]] == [p["step"] for p in t["per_step"]]
        assert all("operation not permitted" in e["why"] for e in t["eager_instead"])
        assert any(line.startswith(f"  warning: {busy} variant-step(s) could not be captured")
                   for line in st.timing_lines(t))
        doc = {"timing": t, "config": {"device": "cpu", "model": "mla", "layers": 2, "max_seqs": 1, "rate": 1,
                                       "prefix_hit_rate": 0, "seed": 0},
               "budget": 1, "steps": 1, "fused_fraction": {"pure_prefill_gate": None, "this": None}}
        text = st.markdown(doc, "cmd")
        assert "Warning: " in text and "pure-prefill gate n/a" in text


@pytest.mark.parametrize("option", ["--launch-us", "--rate", "--prefix-hit-rate", "--prompt-mean", "--decode-mean"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_numbers_are_refused(option, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        st.parse_args([option, value])
    assert exit_info.value.code == 2
    assert f"{option} must be a finite number, got {value}" in capsys.readouterr().err


def test_edges_of_the_summary_say_what_was_not_measured():
    pair = {"what": "the same one call", "differ_at": []}
    assert st._bytes_line("a==b", pair, 0) == "a==b (the same one call): not compared (no busy step)"
    assert st._bytes_line("a==b", pair, 3) == "a==b (the same one call): equal at every step"
    one = st._noise_line({"noise_floor": {"n": 1, "min": 0.97, "max": 0.97}})
    assert "on the one step without prefill rows" in one and "0.970x (one step: no band)" in one


# --------------------------------------------------------------------------
# --format fp8_static (bench/_serving_steps_fp8.py)
# --------------------------------------------------------------------------

fp8_steps = sys.modules["_serving_steps_fp8"]
FP8_REFERENCE_KERNELS = fp8_steps.reference_fp8_static_kernels


def test_format_option_parses_and_defaults_to_nvfp4(capsys):
    assert st.parse_args([]).format == "nvfp4"
    assert st.parse_args(["--format", "fp8_static"]).format == "fp8_static"
    with pytest.raises(SystemExit) as exit_info:
        st.parse_args(["--format", "fp8_group128"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'fp8_group128'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        st.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in ("--format {nvfp4,fp8_static}", "fp8_static", "native form", "fused_paged variant, reported absent",
                 "fusion_pass/demo has no FP8 layer", "overall >= 1.02x", "FUSION_PASS_VLLM_SPLIT_MIXED=off"):
        assert text in out, text


def test_schedule_only_records_the_format(tmp_path, capsys):
    path = tmp_path / "trace.json"
    assert st.main(["--tiny", "--schedule-only", "--format", "fp8_static", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["config"]["format"] == "fp8_static" and "no FP8 layer" in doc["config"]["format_scope"]
    assert doc["timing"]["skipped"]
    assert "output format fp8_static: the timed steps only" in capsys.readouterr().out
    assert st.main(["--tiny", "--schedule-only", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["config"]["format"] == "nvfp4" and doc["config"]["format_scope"] is None
    assert "output format" not in capsys.readouterr().out


def test_cuda_without_fa4s_fp8_epilogue_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(st, "fa4_status", lambda *a: (True, ""))
    monkeypatch.setattr(st, "fp8_static_status", lambda device: (False, "FA4's FP8 epilogues are SM90 kernels"))
    assert st.main(["--device", "cuda", "--timing-only", "--steps", "2", "--format", "fp8_static"]) == 2
    err = capsys.readouterr().err
    assert "need FA4 with its SM90 static FP8 epilogue" in err and "SM90 kernels" in err


def _fp8_logging_kernels(log: list):
    """The FP8 reference kernels, each call logged as ``(kernel, arguments that pick the rows)``."""
    ref = FP8_REFERENCE_KERNELS()

    def attention(q, k, v, cu_seqlens, max_seqlen, **kw):
        log.append(_varlen_args("attention", q, k, cu_seqlens, max_seqlen, kw))
        return ref.attention(q, k, v, cu_seqlens, max_seqlen, **kw)

    def fused(q, k, v, **kw):
        assert kw["nan_to_max"] is False, "the native form's NaN rule"
        log.append(_varlen_args("fused", q, k, kw["cu_seqlens"], kw["max_seqlen"], kw))
        ref.fused(q, k, v, **kw)

    def attention_paged(q, k_cache, v_cache, **kw):
        log.append(_paged_args("attention_paged", q, k_cache, kw))
        return ref.attention_paged(q, k_cache, v_cache, **kw)

    def quant(x, inv_scale):
        log.append(("quant", x.shape[0], x.storage_offset() // x.shape[1]))
        return ref.quant(x, inv_scale)

    return ref._replace(attention=attention, fused=fused, attention_paged=attention_paged, quant=quant)


def _fp8_hand_step(shape: str, log: list, *, layers: int = 3, dims=None, split_free: bool = True, kernels=None):
    """:func:`_hand_step` with the FP8 runner."""
    chunks = tuple(Chunk(f"r{i}", q, c, q > 1) for i, (q, c) in enumerate(STEP_SHAPES[shape]))
    spec = Step(0, chunks).batch_spec()
    regions, top = {}, 0
    for i, (q, c) in enumerate(STEP_SHAPES[shape]):
        regions[f"r{i}"], top = top, top + -(-(q + c) // PAGE) * PAGE
    layout = steps_mod.step_layout(spec, regions)
    runner = fp8_steps.Fp8StepRunner(kernels or _fp8_logging_kernels(log), dims or steps_mod.AttnDims(4, 4, 48, 32),
                                     layers, top, "cpu", page_size=PAGE, split_free=split_free)
    gen = torch.Generator().manual_seed(0)
    for slab in runner.k_slab + runner.v_slab:
        slab.normal_(generator=gen)
    return runner, layout


@pytest.mark.parametrize("shape", sorted(STEP_SHAPES))
def test_fp8_variants_make_the_calls_the_brief_names(shape):
    """The FP8 variant table, layer by layer: unfused = FA4 bf16 over every row in one call + the quant of the whole
    output; unfused_paged = FA4 bf16 paged over every row + the quant; fused_all = the fused FP8 kernel over every
    row in one call; fused = decode rows FA4 bf16 + quant, prefill rows the fused kernel (the offsets of the
    prefill sub-batch); unfused_split = the same decode calls, prefill rows FA4 bf16 + quant of rows [D, T);
    varlen_bf16 = FA4 bf16 alone; no fused_paged. The required pairs agree byte for byte, every layer; every row
    of every variant is written."""
    log, layers = [], 3
    runner, layout = _fp8_hand_step(shape, log, layers=layers)
    assert "fused_paged" not in runner.VARIANTS and "fused_paged" in runner.ABSENT
    variants, fresh, outs = runner.prepare(layout)
    assert list(variants) == list(runner.VARIANTS)
    fresh()
    calls = _calls(variants, log)
    d, t, cu_q, cu_k = layout.decodes, layout.tokens, layout.cu_q, layout.cu_k
    tk = cu_k[-1]
    qlens = [b - a for a, b in zip(cu_q[:-1], cu_q[1:])]
    klens = [b - a for a, b in zip(cu_k[:-1], cu_k[1:])]
    every = ("attention", t, cu_q, max(qlens), cu_k, max(klens), tk)
    decode = [("attention", d, cu_q[:d + 1], 1, cu_k[:d + 1], max(klens[:d]), cu_k[d]), ("quant", d, 0)] if d else []
    prefill_args = (t, cu_q[d:], max(qlens[d:]), cu_k[d:], max(klens[d:]), tk) if d < len(qlens) else None
    assert calls["unfused"] == layers * [every, ("quant", t, 0)]
    assert calls["varlen_bf16"] == layers * [every]
    assert calls["fused_all"] == layers * [("fused", t, cu_q, max(qlens), cu_k, max(klens), tk)]
    if prefill_args:
        assert calls["fused"] == layers * [*decode, ("fused", *prefill_args)]
        assert calls["unfused_split"] == layers * [*decode, ("attention", *prefill_args), ("quant", t - d, d)]
    else:
        assert calls["unfused_split"] == calls["fused"] == layers * decode
    if shape == "prefill":
        assert calls["unfused_split"] == calls["unfused"] and calls["fused"] == calls["fused_all"]
    seqused = tuple(b - a for a, b in zip(cu_k[:-1], cu_k[1:]))
    width = max(-(-n // PAGE) for n in seqused)
    table = tuple(tuple(range(s // PAGE, s // PAGE + -(-n // PAGE))) + (0,) * (width - -(-n // PAGE))
                  for s, n in zip(layout.starts, seqused))
    assert calls["unfused_paged"] == layers * [("attention_paged", t, cu_q, max(qlens), seqused, table, max(klens),
                                                PAGE), ("quant", t, 0)]
    equal = runner.bytes_equal(outs)
    assert set(equal) == {"fused_all==unfused", "fused==unfused_split", "fused==unfused", "unfused_paged==unfused"}
    assert all(equal.values()), equal
    n = runner.dims.heads * runner.dims.dv
    for name in ("unfused", "unfused_split", "fused", "fused_all", "unfused_paged", "pass_on"):
        for o in outs[name]:
            got = o.bytes()
            assert got.shape == (t, n) and got.ne(0).any(dim=1).all(), name
    # the bytes are the native form's: quantize_static of the bf16 attention under the IEEE inverse, NaN kept
    q8 = outs["unfused"][0].parts[0]
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == (t, n)
    assert runner.inv_scale.item() == pytest.approx(448.0 / fp8_steps.AMAX)


def _fp8_policy_step(shape: str, gen: str, monkeypatch, *, split_free: bool, split_mixed: str = "off",
                     mode: str = "measured"):
    from fusion_pass.runtime import policy, settings

    monkeypatch.setattr(policy, "generation", lambda device: gen)
    monkeypatch.delenv(settings.POLICY_ENV, raising=False)
    monkeypatch.delenv(settings.SPLIT_MIXED_ENV, raising=False)
    log = []
    runner, layout = _fp8_hand_step(shape, log, layers=1, dims=steps_mod.AttnDims(2, 2, 16, 16),
                                    split_free=split_free)
    with settings.use_policy(mode), settings.use_split_mixed(split_mixed):
        choice = runner.pass_on_choice(layout)
        variants, fresh, outs = runner.prepare(layout)
    fresh()
    return choice, _calls(variants, log), outs


# (generation, layer, FUSION_PASS_VLLM_SPLIT_MIXED) -> the variant pass_on runs for a prefill / mixed / decode step
FP8_PASS_ON = {
    ("sm90", "mla", "off"): {"prefill": "fused_all", "mixed": "unfused_paged", "decode": "unfused_paged"},
    ("sm90", "gqa", "off"): {"prefill": "fused_all", "mixed": "unfused_paged", "decode": "unfused_paged"},
    ("sm90", "gqa", "on"): {"prefill": "fused_all", "mixed": "unfused_paged", "decode": "unfused_paged"},
    ("cpu", "mla", "off"): {"prefill": "fused_all", "mixed": "fused", "decode": "unfused_paged"},
    ("cpu", "gqa", "off"): {"prefill": "fused_all", "mixed": "unfused_paged", "decode": "unfused_paged"},
    ("cpu", "gqa", "on"): {"prefill": "fused_all", "mixed": "fused", "decode": "unfused_paged"},
}


@pytest.mark.parametrize("case", sorted(FP8_PASS_ON))
@pytest.mark.parametrize("shape", sorted(STEP_SHAPES))
def test_fp8_pass_on_is_what_the_pass_does_with_a_static_fp8_call(case, shape, monkeypatch):
    """No FP8 paged launch, so a mixed step is never one fused call: the split (``fused``'s calls) where the pass
    splits (MLA; a standard layer under FUSION_PASS_VLLM_SPLIT_MIXED=on) and the policy fuses the split class, else
    ``unfused_paged``; on SM90 that is always ``unfused_paged``. A step without decode rows is fused as
    ``fused_all``; a decode-only step never."""
    from fusion_pass.runtime import policy

    gen, model, split_mixed = case
    choice, calls, outs = _fp8_policy_step(shape, gen, monkeypatch, split_free=model == "mla",
                                           split_mixed=split_mixed)
    want = FP8_PASS_ON[case][shape]
    assert choice["variant"] == want and choice["fused"] == (want != "unfused_paged")
    if shape == "mixed":
        plan = "mixed_split_free" if model == "mla" else "mixed_split"
        assert choice["plan"] == plan and "no FP8 paged launch" in choice["why"]
        if model == "gqa" and split_mixed == "off":
            assert "FUSION_PASS_VLLM_SPLIT_MIXED=off" in choice["why"]
        else:
            assert choice["why"].endswith(policy.verdict("cpu", plan)[1])
    else:
        assert choice["plan"] == shape
    assert calls["pass_on"] == calls[want]
    assert torch.equal(outs["pass_on"][0].bytes(), outs[want][0].bytes())


def test_fp8_pass_on_splits_mixed_steps_when_the_policy_says_always(monkeypatch):
    choice, calls, _ = _fp8_policy_step("mixed", "sm90", monkeypatch, split_free=True, mode="always")
    assert choice["variant"] == "fused" and calls["pass_on"] == calls["fused"]
    choice, _, _ = _fp8_policy_step("mixed", "sm90", monkeypatch, split_free=False, mode="always")
    assert choice["variant"] == "unfused_paged", "a standard layer's mixed call is not split by default"


def test_fp8_warm_quant_compiles_at_the_trace_sizes_before_the_steps():
    log = []
    runner, _ = _fp8_hand_step("mixed", log, layers=1)
    runner.warm_quant(40)
    assert [c[:2] for c in log] == [("quant", 2), ("quant", 40), ("quant", 1)]
    log.clear()
    runner.warm_quant(1)
    assert [c[:2] for c in log] == [("quant", 2), ("quant", 1)]


def test_the_compiled_native_quant_writes_quantize_static_and_compiles_once_per_size_class():
    """The quant as compiled for CUDA, here by Inductor for the CPU: bytes of ``fp8.quantize_static`` (NaN kept, as
    the native form), the token dimension dynamic after the warm-up (no compile for other token counts or row
    offsets, as the timed steps call it)."""
    from torch._dynamo.utils import counters as dynamo_counters

    from fusion_pass import fp8

    formats = sys.modules["_attention_formats"]
    torch._dynamo.reset()
    quant = torch.compile(formats.native_static, fullgraph=True)
    _, inv = formats.static_scale(fp8_steps.AMAX, "cpu")
    n = 64
    for rows in (2, 40, 1):  # Fp8StepRunner.warm_quant's sizes
        quant(torch.zeros(rows, n, dtype=torch.bfloat16), inv)
    graphs = dynamo_counters["stats"]["unique_graphs"]
    x = torch.randn(50, n, dtype=torch.bfloat16) * 3
    x[3, 5] = float("nan")
    x[4, 6] = float("inf")
    for rows, offset in ((33, 0), (50, 0), (17, 33), (7, 3)):
        got = quant(x[offset:offset + rows], inv)
        want = fp8.quantize_static(x[offset:offset + rows], inv, nan=fp8.NaNRule.NAN)
        nan = want.float().isnan()  # kept NaN (its sign is the CPU arithmetic's: docs/formats.md)
        assert torch.equal(got.float().isnan(), nan), (rows, offset)
        assert torch.equal(got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan]), (rows, offset)
    assert dynamo_counters["stats"]["unique_graphs"] == graphs, "a recompile inside the steps"
    torch._dynamo.reset()


def test_fp8_timed_steps_on_the_cpu_agree_byte_for_byte(tmp_path, capsys):
    """--format fp8_static --cpu-timing: every busy step timed, the required pairs equal, fused_paged reported
    absent (never zero), the FP8 ratios and pass_on's 1.02x target in the summary, the markdown and the JSON."""
    path, md = tmp_path / "trace.json", tmp_path / "trace.md"
    assert st.main(["--tiny", "--timing-only", "--cpu-timing", "--steps", "12", "--prefix-hit-rate", "0.5",
                    "--warmup", "0", "--repeats", "1", "--format", "fp8_static", "--json", str(path),
                    "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    t, text = doc["timing"], md.read_text()
    busy = [s for s in doc["per_step"] if s["tokens"]]
    assert t["format"] == "fp8_static" and doc["config"]["format"] == "fp8_static"
    assert t["skipped"] is None and t["mismatched_steps"] == [] and t["kernels"] == "reference"
    assert [p["step"] for p in t["per_step"]] == [s["step"] for s in busy]
    assert t["variants"] == list(fp8_steps.Fp8StepRunner.VARIANTS)
    assert set(t["absent"]) == {"fused_paged"} and t["total_fused_paged_ms"] is None
    assert all("fused_paged_ms" not in p and "speedup_paged" not in p for p in t["per_step"])
    assert t["paged"]["absent"] and "ratio" not in t["paged"]
    assert "paged_alone" not in t and t["alone"]["baseline"] == "varlen_bf16"
    assert set(t["bytes"]) == {"fused_all==unfused", "fused==unfused_split", "fused==unfused", "unfused_paged==unfused"}
    assert [k for k, v in t["bytes"].items() if v["checked"]] == ["fused_all==unfused", "fused==unfused_split"]
    assert all(v["differ_at"] == [] for v in t["bytes"].values())
    assert any(p["decode_rows"] and p["prefill_rows"] for p in t["per_step"]), "a mixed step"
    for key, label in (("fused", "unfused (one call) / fused (runtime)"),
                       ("fused_all", "unfused (one call) / fused_all (one call)"),
                       ("split", "unfused (split like the runtime) / fused (runtime)"),
                       ("pass_on", "unfused (one paged call) / pass_on"),
                       ("alone", "FA4 bf16 alone (one call, no quant) / fused_all")):
        assert t[key]["label"] == label and t[key]["ratio"]["n"] == len(busy)
        assert f"  {label}" in out and f"| {label} |" in text
    assert "| unfused (one paged call) / fused_paged | absent |" in text
    assert "unfused (one paged call) / fused_paged" in out and "absent: no FP8 paged launch exists" in out
    assert "fused_paged absent" in out and "- Absent: fused_paged (no FP8 paged launch exists" in text
    for p in t["per_step"]:
        assert p["speedup_pass_on"] == pytest.approx(p["unfused_paged_ms"] / p["pass_on_ms"])
        assert p["speedup_alone"] == pytest.approx(p["varlen_bf16_ms"] / p["fused_all_ms"])
        # the CPU's policy, MLA: a mixed step is split (no one fused call); decode-only steps never fused
        want = ("fused_all" if not p["decode_rows"] else "fused" if p["prefill_rows"] else "unfused_paged")
        assert p["pass_on"]["variant"] == want
        assert p["pass_on_fused_rows"] == {"fused_all": p["tokens"], "fused": p["prefill_rows"]}.get(want, 0)
    target = t["pass_on_policy"]["target"]
    assert (target["min_step_ratio"], target["min_overall"]) == (0.99, 1.02)
    assert "no step below 0.99x and overall >= 1.02x" in out and "no step below 0.99x and overall >= 1.02x" in text
    assert t["quant_graphs"] == {"before_the_steps": 0, "during_the_steps": 0}, "the CPU's quant is eager"
    assert "- Output format: fp8_static, the timed steps only" in text
    assert "native form" in t["what"] and "ERROR" not in out


def _fp8_corrupting():
    """FP8 reference kernels whose fused calls flip one byte of the first row they write."""
    ref = FP8_REFERENCE_KERNELS()

    def fused(q, k, v, **kw):
        ref.fused(q, k, v, **kw)
        b = kw["output"].view(torch.uint8)
        row = int(kw["cu_seqlens"][0])
        b[row, 0] = b[row, 0] ^ 0xFF

    return ref._replace(fused=fused)


def test_a_corrupted_fp8_byte_fails_its_pairs_and_exits_1(monkeypatch, capsys):
    monkeypatch.setattr(st, "reference_fp8_static_kernels", _fp8_corrupting)
    assert st.main(["--tiny", "--timing-only", "--cpu-timing", "--steps", "6", "--warmup", "0", "--repeats", "1",
                    "--layers", "1", "--format", "fp8_static"]) == 1
    out = capsys.readouterr().out
    assert "ERROR: bytes fused_all==unfused (the same one call): differ at" in out
    assert "ERROR: bytes fused==unfused_split (the same sub-batch calls): differ at" in out


def test_fp8_model_run_on_the_cpu_keeps_the_nvfp4_token_counts(tmp_path):
    """The CPU model run with --format fp8_static: the demo model (NVFP4 o_proj) runs for the counters as without
    it, and the timed steps on the reference kernels write the FP8 output."""
    path = tmp_path / "trace.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--tiny", "--steps", "6", "--format", "fp8_static",
                           "--cpu-timing", "--warmup", "0", "--repeats", "1", "--json", str(path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(path.read_text())
    assert doc["config"]["format"] == "fp8_static" and doc["fused_fraction"]["this"] == 1.0
    assert doc["counters"]["mismatched_steps"] == [] and doc["pass"]["rewritten"] > 0
    assert doc["timing"]["format"] == "fp8_static" and doc["timing"]["mismatched_steps"] == []
    assert "output format fp8_static: the timed steps only" in proc.stdout


def test_fp8_graph_clock_replays_every_fp8_variant(trace_steps, monkeypatch):
    """--clock graph with --format fp8_static: the FP8 variants (no fused_paged) go through the same interleaved
    replay (the CUDA timers stood in, as above)."""
    steps, layouts = trace_steps
    few = [s for s in steps if s.index <= sorted(layouts)[2]]
    seen = []

    def graph_replay_interleaved_ms(fns, *, replays, warmup):
        seen.append(list(fns))
        for fn in fns.values():
            fn()
        return {name: [1.0, 2.0] for name in fns}

    monkeypatch.setattr(steps_mod._timing, "graph_replay_interleaved_ms", graph_replay_interleaved_ms)
    original_init = steps_mod.StepRunner.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.cuda = True

    monkeypatch.setattr(steps_mod.StepRunner, "__init__", init)
    t = st.time_trace(few, model="gqa", tiny=True, device="cpu", layers=1, warmup=0, repeats=2, launch_us=5.0,
                      seed=0, progress=False, clock="graph", fmt="fp8_static")
    assert seen and all(names == list(fp8_steps.Fp8StepRunner.VARIANTS) for names in seen)
    assert len(seen) == len(t["per_step"]) and t["eager_instead"] == [] and t["mismatched_steps"] == []
    assert all(p["unfused_ms"] == 1.5 and p["speedup_pass_on"] == 1.0 for p in t["per_step"])
