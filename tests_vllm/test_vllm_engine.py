"""A real vllm.LLM (vLLM's CPU build) on tiny DeepSeek-V3-style (MLA) and Qwen2-style (GQA, qkv bias) configs,
with the documented one-liner vs without it: the report, the o_proj's NVFP4 input, the guard's decisions, greedy
tokens, multiprocessing.

Batch kinds on vLLM's CPU build: the MLA model ("dsv3") runs vLLM's reference CPU_MLA backend (pinned: ``CPU_MLA``),
for which vLLM's CPU platform turns chunked prefill and prefix caching off (``CpuPlatform.check_and_update_config``):
with vLLM's settings it produces pure prefill, decode-only and mixed (decode + prefill) batches, but never a
prefill with cached context. "dsv3_chunked" keeps chunked prefill and prefix caching on after that check
(``keep_chunked_prefill``, tests_vllm/_engine.py): vLLM's own MLA code then computes chunked prefills and
prefix-cache hits on the CPU (its context gather ``gather_mla_context_cache_cpu`` and the CPU SDPA prefill
backend's ``run_prefill_context_chunk``), in the run without the pass as in the run with it. The Qwen2 model
("qwen2") runs vLLM's CPU_ATTN backend with chunked prefill (a 32-token budget), prefix caching and 32-token KV
blocks: pure prefills, chunks with cached context beside decodes, a prefix-cache hit; vLLM keeps its requests in
their batch order, so decode rows may sit between prefill rows.

Greedy tokens are compared with the run without the pass token by token; they may part at an exact tie only: a
position where the run without the pass had its two most likely tokens at the same logprob (vLLM's sampler
returns the top 2 with each token: ``logprobs=2``; bf16 logits make equal values common), and the run with the
pass took the other tied token. From there on that sequence is not compared, nor are that step's o_proj inputs
with the other run's (their inputs differ); every fused call is still compared with vLLM's op on its own inputs
(the shadows).
"""

import json

import pytest
import torch

from conftest import DSV3, run_engine, write_model
from fusion_pass import nvfp4
from nvfp4_test_quant import ACT_GLOBAL_SCALE
from tiny_models import QWEN2

SHARED = list(range(100, 148))  # three 16-token KV blocks (MLA): a prefix-cache hit of 48 tokens
SHARED_QWEN2 = list(range(100, 164))  # two 32-token KV blocks (CPU_ATTN): a prefix-cache hit of 64 tokens
CHUNKED = {"max_num_batched_tokens": 32, "enable_chunked_prefill": True}
# vLLM's reference CPU_MLA backend for the MLA model, also on x86 CPUs with AMX, where vLLM would pick its AMX_MLA
# backend: that one keeps chunked prefill and prefix caching on and releases kv_b_proj's weight after packing it
# for its own kernels (MLAAttention.process_weights_after_loading), so the guard refuses its layers
# (layer_not_supported) and no MLA call would be fused.
CPU_MLA = {"attention_config": {"backend": "CPU_MLA"}}

CONFIGS = {
    # vLLM's CPU MLA settings (no chunked prefill, no prefix caching): pure prefill; then 5 requests for 4
    # sequence slots, the 5th prefilled beside the others' decodes once the first finishes (mixed batches).
    "dsv3": {"model": "dsv3", "llm": {**CPU_MLA}, "workload": [
        {"kind": "prefill", "prompts": [list(range(3, 10)), list(range(10, 40))], "max_tokens": 1},
        {"kind": "mixed", "prompts": [list(range(50, 56)), list(range(60, 70)), list(range(70, 75)),
                                      list(range(80, 88)), list(range(90, 102))], "max_tokens": [2, 5, 5, 5, 3]}]},
    # chunked prefill and prefix caching kept on: a 32-token budget splits the 70-token prompt beside decodes
    # (chunks with cached context in mixed batches); then a prompt sharing a cached 48-token prefix.
    "dsv3_chunked": {"model": "dsv3", "keep_chunked_prefill": True,
                     "llm": {**CPU_MLA, **CHUNKED, "enable_prefix_caching": True}, "workload": [
        {"kind": "chunked", "prompts": [list(range(3, 10)), list(range(10, 80)), list(range(200, 205)),
                                        SHARED + [5, 6, 7]], "max_tokens": [6, 2, 8, 3]},
        {"kind": "prefix_hit", "prompts": [SHARED + [9, 9, 9, 9]], "max_tokens": 2}]},
    # Qwen2 (CPU_ATTN): pure prefill; a 32-token budget splitting the 70-token prompt beside decodes and new
    # prompts (chunks with cached context in mixed batches); then a prompt sharing a cached 64-token prefix.
    "qwen2": {"model": "qwen2", "llm": {**CHUNKED, "enable_prefix_caching": True, "block_size": 32}, "workload": [
        {"kind": "prefill", "prompts": [list(range(3, 10)), list(range(10, 30))], "max_tokens": 1},
        {"kind": "chunked", "prompts": [list(range(3, 10)), list(range(10, 80)), list(range(200, 205)),
                                        SHARED_QWEN2 + [5, 6, 7]], "max_tokens": [6, 2, 8, 3]},
        {"kind": "prefix_hit", "prompts": [SHARED_QWEN2 + [9, 9, 9, 9]], "max_tokens": 2}],
        "hit": len(SHARED_QWEN2)},
}
CONFIGS["dsv3_chunked"]["hit"] = len(SHARED)
LAYERS = DSV3["num_hidden_layers"]
assert QWEN2["num_hidden_layers"] == LAYERS
STANDARD = {"qwen2"}  # configurations of standard-attention models
GS = torch.tensor([ACT_GLOBAL_SCALE])


def spec(name: str, models: dict, with_pass: bool, **extra) -> dict:
    config = CONFIGS[name]
    return {"model": models[config["model"]], "pass": with_pass, "workload": config["workload"],
            "llm": config["llm"], "keep_chunked_prefill": config.get("keep_chunked_prefill", False), **extra}


@pytest.fixture(scope="module")
def engine_models(models, tmp_path_factory) -> dict:
    return {**models, "qwen2": write_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", QWEN2)}


@pytest.fixture(scope="module", params=list(CONFIGS))
def runs(request, engine_models, tmp_path_factory):
    """(name, run with the pass, run without it); standard-attention models also with multiprocessing on (the
    pass's run-time counters from its worker's report file: ``mp``). Default settings: a standard layer's mixed
    call is one fused launch over the paged cache (the split path, for backends without one, is tested on vLLM's
    CPU backend without an engine: test_vllm_standard_op.py)."""
    name = request.param
    split = {}
    out = {}
    for with_pass in (True, False):
        tmp = tmp_path_factory.mktemp(f"{name}_{'pass' if with_pass else 'plain'}")
        out[with_pass] = run_engine(tmp, spec(name, engine_models, with_pass), **split)
    if name in STANDARD:
        tmp = tmp_path_factory.mktemp(f"{name}_pass_mp")
        out[True]["mp"] = run_engine(tmp / "run", spec(name, engine_models, True), multiprocessing=True, **split,
                                     FUSION_PASS_DUMP=str(tmp / "dump"),
                                     FUSION_PASS_VLLM_IMPORT="nvfp4_test_quant,unit_norm_dummy")
        out[True]["mp"]["reports"] = [json.loads(p.read_text())
                                      for p in sorted((tmp / "dump" / "reports").glob("vllm_report_*.json"))]
    return name, out[True], out[False]


def test_every_attention_layer_rewritten(runs):
    name, fused, plain = runs
    report = fused["report"]
    assert fused["config"]["pass_type"] == "FusionPassForVllm"
    assert report["disabled_reason"] is None and report["vllm_version"].startswith("0.32.")
    assert report["graphs"] == 1 and report["candidates"] == report["rewritten"] == 2, report
    pattern = "mla_attention_nvfp4_quant" if name.startswith("dsv3") else "attention_nvfp4_quant"
    layers = report["per_graph"][0]["layers"]
    assert [(l["layer"], l["pattern"], l["outcome"]) for l in layers] == [
        (f"model.layers.{i}.self_attn.attn", pattern, "rewritten") for i in range(2)]
    assert "fusion_pass: graph 0: 2 candidates, 2 rewritten" in fused["log"]
    assert fused["unit_norm_weights"] > 0 and plain["unit_norm_weights"] == fused["unit_norm_weights"]
    chunked = name != "dsv3"
    assert fused["config"]["enable_chunked_prefill"] is chunked and plain["config"]["enable_chunked_prefill"] is chunked


def _bound(plain_hat, gs):
    """The fused bound of tests/test_fusion_pass.py with the float32 attention (not observable inside
    vLLM) replaced by the unfused dequantized value: NVFP4 error of both sides plus bf16 rounding."""
    return 2 * nvfp4.error_bound(plain_hat, gs) + 2 * plain_hat.abs() * 2.0 ** -8


def _scale_bytes(scales, rows, k: int):
    """The swizzled scale bytes of ``rows`` (every block column, padding columns included)."""
    cols = nvfp4.scale_shape(1, k)[1]
    rows = torch.as_tensor(rows, dtype=torch.long)
    offsets = nvfp4.swizzled_offset(rows[:, None], torch.arange(cols)[None, :], k // nvfp4.BLOCK_SIZE)
    return scales.contiguous().view(torch.uint8).view(-1)[offsets]


def check_rows(fa, fs, pa, ps, decode_rows: list | None, what: str) -> None:
    """``decode_rows=None``: every byte equal (an exact fallback). Else the decode rows byte-equal (their packed
    bytes and swizzled scales) and every other row (a fused prefill row) within the fused bound."""
    assert fa.shape == pa.shape and fa.dtype == torch.uint8, what
    if decode_rows is None:
        assert torch.equal(fa, pa) and torch.equal(fs.view(torch.uint8), ps.view(torch.uint8)), what
        return
    m, k = fa.shape[0], fa.shape[1] * 2
    decode = torch.tensor(decode_rows, dtype=torch.long)
    assert torch.equal(fa[decode], pa[decode]), what
    assert torch.equal(_scale_bytes(fs, decode, k), _scale_bytes(ps, decode, k)), what
    prefill = torch.ones(m, dtype=torch.bool)
    prefill[decode] = False
    f_hat, p_hat = nvfp4.dequantize(fa, fs, GS, m=m)[prefill], nvfp4.dequantize(pa, ps, GS, m=m)[prefill]
    assert p_hat.abs().max() > 0, f"{what}: the prefill rows quantize to zero (a vacuous comparison)"
    assert ((f_hat - p_hat).abs() <= _bound(p_hat, GS)).all(), what


def _decode_rows(call) -> list | None:
    """The rows byte-equal to the unfused graph: every row of a fallback (None), the decode rows computed by vLLM
    beside fused prefill rows, none of a call fused whole over the paged cache (every row within the bound)."""
    if call["path"] == "fallback":
        return None
    return [] if call["one_call"] else call["decode_rows"]


def check_tokens(f_step, p_step, what: str) -> bool:
    """Greedy tokens equal to the run without the pass, except from an exact tie on (module docstring). Returns
    whether every sequence of the step is equal."""
    equal = True
    for f, p, top in zip(f_step["tokens"], p_step["tokens"], p_step["logprobs"], strict=True):
        assert len(f) == len(p), what
        if f == p:
            continue
        j = next(i for i, (a, b) in enumerate(zip(f, p)) if a != b)
        tied = {t for t, lp in top[j] if lp == top[j][0][1]}
        assert len(tied) > 1 and f[j] in tied, f"{what}: tokens part at {j} without an exact tie: {f} vs {p}, {top[j]}"
        equal = False
    return equal


def check_against_plain_run(fused, plain) -> set:
    """The o_proj's NVFP4 input of the first attention layer, run with vs without the pass: its input (the
    token embeddings) is the same in both runs, later layers' inputs differ once a fused prefill ran upstream
    (those are checked against the unfused op on their own inputs: the shadows); steps whose tokens parted at a
    tie are not compared (module docstring). Returns the decisions seen."""
    kinds = set()
    for f_step, p_step in zip(fused["steps"], plain["steps"], strict=True):
        same = check_tokens(f_step, p_step, f_step["kind"])
        assert len(f_step["taps"]) == len(p_step["taps"]) == len(f_step["calls"]) > 0
        for i, ((fa, fs), (pa, ps), call) in enumerate(zip(f_step["taps"], p_step["taps"], f_step["calls"])):
            kinds.add(call["reason"] or call["path"])
            if same and i % LAYERS == 0:
                check_rows(fa, fs, pa, ps, _decode_rows(call), f"{f_step['kind']} call {i}: {call}")
    return kinds


def check_shadows(fused) -> int:
    """Every fused call (every layer) against the exact fallback of the same call on the same inputs."""
    count = 0
    for step in fused["steps"]:
        calls = [c for c in step["calls"] if c["path"] != "fallback"]
        assert len(calls) == len(step["shadows"])
        for call, (fa, fs, pa, ps) in zip(calls, step["shadows"]):
            check_rows(fa, fs, pa, ps, _decode_rows(call), f"{step['kind']}: {call}")
            count += 1
    return count


def test_o_proj_nvfp4_input_bytes_equal_on_decode_rows_within_bound_on_fused_prefill_rows(runs):
    name, fused, plain = runs
    kinds = check_against_plain_run(fused, plain)
    assert check_shadows(fused) == fused["counters"]["fused"] > 0
    calls = [c for step in fused["steps"] for c in step["calls"]]
    mixed = [c for c in calls if c["path"] == "fused" and c["decode"]]
    with_context = [c for c in calls if c["path"] == "fused" and sum(c.get("context_lens", [])) > 0]
    assert {"fused", "decode_tokens"} <= kinds, kinds
    assert set(kinds) <= {"fused", "decode_tokens", "no_attention_metadata"}, kinds  # every prefill row fused
    assert mixed, "no mixed (decode + prefill) batch was fused"
    if name in STANDARD:  # every row of a standard layer's mixed call in one launch over vLLM's paged cache
        assert all(c["one_call"] and c["decode_fused"] == c["decode"] and c["post_quantized"] == {} for c in mixed)
    else:  # MLA: vLLM computes the decode rows, post-quantized
        assert all(c["post_quantized"] == {"decode_tokens": c["decode"]} and not c["one_call"] for c in mixed)
    assert all(len(c["decode_rows"]) == c["decode"] for c in calls)
    if name in STANDARD:  # rows read from vLLM's host copies, kept by the hook on CPU_ATTN's metadata builder
        assert all(c["host_copies"] for c in calls if c["reason"] != "no_attention_metadata")
    if name == "dsv3":
        assert not with_context  # vLLM's CPU platform turned chunked prefill and prefix caching off
        return
    assert [c for c in with_context if c["decode"]], "no mixed batch with a chunked prefill was fused"
    hits = [c for c in fused["steps"][-1]["calls"] if c["path"] == "fused"]
    hit = CONFIGS[name]["hit"]
    assert hits and all(c["context_lens"] == [hit] and c["query_lens"] == [4] for c in hits), hits


def test_guard_counts_every_call_and_names_each_path_once_in_vllms_log(runs):
    name, fused, plain = runs
    counters = fused["counters"]
    assert counters == fused["report"]["runtime_process"]
    calls = sum(len(s["decisions"]) for s in fused["steps"])
    assert counters["fused"] + sum(counters["fallback"].values()) == calls
    # every call with a prefill row runs the fused path: on vLLM's CPU build the reference backend (float32
    # attention); decode-only calls and vLLM's dummy runs take the exact fallback
    assert counters["fused"] > 0 and counters["fused_by_backend"] == {"reference": counters["fused"]}
    assert set(counters["fallback"]) <= {"decode_tokens", "no_attention_metadata"}
    assert "attention + NVFP4 quant fused with backend reference" in fused["log"]
    assert "attention + NVFP4 quant fell back (decode_tokens)" in fused["log"]
    tokens = counters["tokens"]
    assert tokens["prefill"] > 0 and tokens["post_quantized"]["decode_tokens"] > 0
    assert tokens["prefill_fused"] == tokens["prefill"]  # every prefill token of every batch kind
    assert (tokens["decode_fused"] > 0) is (name in STANDARD)  # a standard layer's mixed calls: one paged launch


@pytest.mark.parametrize("runs", sorted(STANDARD), indirect=True)  # the standard configurations' runs only
def test_multiprocessing_on_standard_layers_fuse_every_prefill_token(runs):
    """The Qwen2 configuration with V1 multiprocessing on (the other runs of the configuration have it off): the
    engine core runs the model in another process, whose report file (FUSION_PASS_DUMP) holds the pass's run-time
    counters. (MLA with multiprocessing on: the test below.)"""
    name, fused, plain = runs
    mp = fused["mp"]
    compiled = [r for r in mp["reports"] if r["graphs"]]
    assert len(compiled) == 1 and compiled[0]["pid"] != mp["pid"], mp["reports"]
    runtime = compiled[0]["runtime"]
    tokens = runtime["tokens"]
    assert runtime["fused"] > 0 and set(runtime["fallback"]) <= {"decode_tokens", "no_attention_metadata"}, runtime
    assert tokens["prefill"] > 0 and tokens["prefill_fused"] == tokens["prefill"], runtime
    assert tokens["post_quantized"]["decode_tokens"] > 0, runtime
    for f_step, p_step in zip(mp["steps"], plain["steps"], strict=True):
        check_tokens(f_step, p_step, f"multiprocessing on, {f_step['kind']}")


def test_multiprocessing_on_one_liner_pickles_and_reports_per_process(models, tmp_path):
    dump = tmp_path / "dump"
    workload = [{"kind": "prefill", "prompts": [list(range(3, 20))], "max_tokens": 3}]
    result = run_engine(tmp_path / "run", {"model": models["dsv3"], "pass": True, "workload": workload,
                                           "llm": CPU_MLA}, multiprocessing=True, FUSION_PASS_DUMP=str(dump))
    assert not list(dump.glob("vllm_report_*.json")), "process reports belong in reports/, apart from graph dumps"
    reports = [json.loads(p.read_text()) for p in sorted((dump / "reports").glob("vllm_report_*.json"))]
    assert reports, "no process wrote a report"
    compiled = [r for r in reports if r["graphs"]]
    assert compiled and all(r["pid"] != result["pid"] for r in compiled), "the pass ran outside vLLM's worker"
    assert all(r["candidates"] == r["rewritten"] == 2 for r in compiled)
    # the user's process never compiles: its (deep-copied) pass saw no graph
    assert result["report"]["graphs"] == 0
    # graph dumps of every compiling process, one run folder per process, each naming its process
    paths = sorted(dump.glob("run_*/graph_*_report.json"))
    dumps = [json.loads(p.read_text()) for p in paths]
    assert len(dumps) == sum(r["graphs"] for r in compiled)
    assert {d["pid"] for d in dumps} == {r["pid"] for r in compiled}
    assert all(f"pid{d['pid']}" in p.parent.name for d, p in zip(dumps, paths))
    assert all(p.with_name(p.name.replace("_report.json", "_after.py")).exists() for p in paths)
    assert "2 candidates, 2 rewritten" in result["log"]


@pytest.mark.parametrize("name", ["dsv3", "qwen2"])
def test_graphs_vllms_own_fusion_rewrote_are_retargeted_to_the_fused_call(engine_models, tmp_path, name):
    """vLLM's attention+quant fusion (CUDA-only; emulated here, tests_vllm/emulated_vllm_fusion.py) runs
    first; the pass retargets its output to the fused call, which then runs like a fused rewrite."""
    result = run_engine(tmp_path, spec(name, engine_models, True, pass_name="emulated_vllm_fusion.PASS"))
    report = result["report"]
    assert report["emulated"]["rewritten"] == 2  # vLLM's form: its attention op given the quant's buffers
    pattern = ("mla_" if name == "dsv3" else "") + "attention_nvfp4_prequantized"
    assert report["candidates"] == report["rewritten"] == report["retargeted"] == 2, report
    assert [(l["pattern"], l["outcome"]) for l in report["per_graph"][0]["layers"]] == [(pattern, "retargeted")] * 2
    assert "2 rewritten (2 retargeted)" in result["log"]
    # the layers vLLM built, read while compiling (fusion_pass/vllm/compile/layer_check.py): the fused call can run for them
    backend = "MLA" if name == "dsv3" else "vLLM attention backend CPU_ATTN"
    for i in range(LAYERS):
        line = (f"model.layers.{i}.self_attn.attn ({pattern}): vLLM's fuse_attn_quant rewrite retargeted to the fused "
                f"op (KV cache dtype 'auto', {backend}: the fused call can run)")
        assert line in result["log"], result["log"][-3000:]
    counters = result["counters"]
    assert counters["fused"] > 0 and counters["fallback"].get("decode_tokens", 0) > 0
    plain = run_engine(tmp_path / "plain", spec(name, engine_models, False))
    kinds = check_against_plain_run(result, plain)
    calls = [c for step in result["steps"] for c in step["calls"]]
    mixed = [c for c in calls if c["decode"] and c.get("query_lens")]
    assert mixed, "the workload has no mixed step"
    tokens = counters["tokens"]
    assert tokens["prefill_fused"] == tokens["prefill"] > 0  # default settings: every prefill token fused
    if name in STANDARD:  # the default: a standard layer's mixed call is one fused launch over the paged cache
        assert all(c["path"] == "fused" and c["one_call"] and c["decode_fused"] == c["decode"] for c in mixed), mixed
        assert tokens["decode_fused"] == sum(c["decode"] for c in mixed)
        assert "mixed_not_split" not in kinds and "mixed_not_split" not in tokens["post_quantized"]
    assert check_shadows(result) == counters["fused"]
