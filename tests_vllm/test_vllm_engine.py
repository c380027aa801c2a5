"""A real vllm.LLM (vLLM's CPU build) on tiny DeepSeek-V3-style and Llama configs, with the documented
one-liner vs without it: the report, the o_proj's NVFP4 input, the guard's decisions, multiprocessing.

Batch kinds on vLLM's CPU build: the MLA model ("dsv3") runs vLLM's reference CPU_MLA backend (pinned: ``CPU_MLA``),
for which vLLM's CPU platform turns chunked prefill and prefix caching off (``CpuPlatform.check_and_update_config``):
with vLLM's settings it produces pure prefill, decode-only and mixed (decode + prefill) batches, but never a
prefill with cached context. "dsv3_chunked" keeps chunked prefill and prefix caching on after that check
(``keep_chunked_prefill``, tests_vllm/_engine.py): vLLM's own MLA code then computes chunked prefills and
prefix-cache hits on the CPU (its context gather ``gather_mla_context_cache_cpu`` and the CPU SDPA prefill
backend's ``run_prefill_context_chunk``), in the run without the pass as in the run with it.
"""

import json

import pytest
import torch

from conftest import DSV3, LLAMA, run_engine
from fusion_pass import nvfp4
from nvfp4_test_quant import ACT_GLOBAL_SCALE

SHARED = list(range(100, 148))  # three 16-token KV blocks: a prefix-cache hit of 48 tokens
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
    # Llama: a 32-token budget splits the 40-token prompt (chunked prefill) and mixes decode with prefill.
    "llama": {"model": "llama", "llm": {**CHUNKED, "enable_prefix_caching": False}, "workload": [
        {"kind": "prefill", "prompts": [list(range(3, 10)), list(range(10, 30))], "max_tokens": 1},
        {"kind": "mixed", "prompts": [list(range(100, 140)), list(range(200, 220))], "max_tokens": 4}]},
}
LAYERS = DSV3["num_hidden_layers"]
assert LLAMA["num_hidden_layers"] == LAYERS
GS = torch.tensor([ACT_GLOBAL_SCALE])


def spec(name: str, models: dict, with_pass: bool, **extra) -> dict:
    config = CONFIGS[name]
    return {"model": models[config["model"]], "pass": with_pass, "workload": config["workload"],
            "llm": config["llm"], "keep_chunked_prefill": config.get("keep_chunked_prefill", False), **extra}


@pytest.fixture(scope="module", params=list(CONFIGS))
def runs(request, models, tmp_path_factory):
    name = request.param
    out = {}
    for with_pass in (True, False):
        tmp = tmp_path_factory.mktemp(f"{name}_{'pass' if with_pass else 'plain'}")
        out[with_pass] = run_engine(tmp, spec(name, models, with_pass))
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


def _scale_bytes(scales, rows: int, k: int):
    """The swizzled scale bytes of rows ``[0, rows)`` (every block column, padding columns included)."""
    cols = nvfp4.scale_shape(rows, k)[1]
    offsets = nvfp4.swizzled_offset(torch.arange(rows)[:, None], torch.arange(cols)[None, :], k // nvfp4.BLOCK_SIZE)
    return scales.contiguous().view(torch.uint8).view(-1)[offsets]


def check_rows(fa, fs, pa, ps, decode: int | None, what: str) -> None:
    """``decode=None``: every byte equal (an exact fallback). Else rows ``[0, decode)`` byte-equal (their
    packed bytes and swizzled scales) and rows ``[decode, M)`` within the fused bound."""
    assert fa.shape == pa.shape and fa.dtype == torch.uint8, what
    if decode is None:
        assert torch.equal(fa, pa) and torch.equal(fs.view(torch.uint8), ps.view(torch.uint8)), what
        return
    m, k = fa.shape[0], fa.shape[1] * 2
    assert torch.equal(fa[:decode], pa[:decode]), what
    assert torch.equal(_scale_bytes(fs, decode, k), _scale_bytes(ps, decode, k)), what
    f_hat, p_hat = nvfp4.dequantize(fa, fs, GS, m=m), nvfp4.dequantize(pa, ps, GS, m=m)
    assert p_hat[decode:].abs().max() > 0, f"{what}: the prefill rows quantize to zero (a vacuous comparison)"
    assert ((f_hat[decode:] - p_hat[decode:]).abs() <= _bound(p_hat[decode:], GS)).all(), what


def _decode_rows(call) -> int | None:
    return None if call["path"] == "fallback" else call["post_quantized"].get("decode_tokens", 0)


def check_against_plain_run(fused, plain) -> set:
    """The o_proj's NVFP4 input of the first attention layer, run with vs without the pass: its input (the
    token embeddings) is the same in both runs, later layers' inputs differ once a fused prefill ran upstream
    (those are checked against the unfused op on their own inputs: the shadows). Returns the decisions seen."""
    kinds = set()
    for f_step, p_step in zip(fused["steps"], plain["steps"], strict=True):
        assert f_step["tokens"] == p_step["tokens"]
        assert len(f_step["taps"]) == len(p_step["taps"]) == len(f_step["calls"]) > 0
        for i, ((fa, fs), (pa, ps), call) in enumerate(zip(f_step["taps"], p_step["taps"], f_step["calls"])):
            kinds.add(call["reason"] or call["path"])
            if i % LAYERS == 0:
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
    if name == "llama":  # standard layers: decode tokens or cached context take the exact fallback
        assert {"fused", "decode_tokens", "chunked_prefill"} <= kinds, kinds
        assert not mixed and not with_context
        return
    assert {"fused", "decode_tokens"} <= kinds, kinds
    assert set(kinds) <= {"fused", "decode_tokens", "no_attention_metadata"}, kinds  # every prefill row fused
    assert mixed, "no mixed (decode + prefill) batch was fused"
    assert all(c["post_quantized"] == {"decode_tokens": c["decode"]} for c in mixed)
    if name == "dsv3":
        assert not with_context  # vLLM's CPU platform turned chunked prefill and prefix caching off
        return
    assert [c for c in with_context if c["decode"]], "no mixed batch with a chunked prefill was fused"
    hits = [c for c in fused["steps"][1]["calls"] if c["path"] == "fused"]
    assert hits and all(c["context_lens"] == [len(SHARED)] and c["query_lens"] == [4] for c in hits), hits


def test_guard_counts_every_call_and_names_each_path_once_in_vllms_log(runs):
    name, fused, plain = runs
    counters = fused["counters"]
    assert counters == fused["report"]["runtime_process"]
    calls = sum(len(s["decisions"]) for s in fused["steps"])
    assert counters["fused"] + sum(counters["fallback"].values()) == calls
    # pure-prefill calls run the fused path: on vLLM's CPU build the reference backend (float32 attention)
    assert counters["fused"] > 0 and counters["fused_by_backend"] == {"reference": counters["fused"]}
    assert set(counters["fallback"]) <= {"decode_tokens", "chunked_prefill", "no_attention_metadata"}
    assert "attention + NVFP4 quant fused with backend reference" in fused["log"]
    assert "attention + NVFP4 quant fell back (decode_tokens)" in fused["log"]
    tokens = counters["tokens"]
    assert tokens["prefill"] > 0 and tokens["post_quantized"]["decode_tokens"] > 0
    if name.startswith("dsv3"):  # MLA: every prefill row fused, mixed batches' decode rows post-quantized
        assert tokens["prefill_fused"] == tokens["prefill"]
    else:
        assert 0 < tokens["prefill_fused"] < tokens["prefill"] and tokens["post_quantized"]["chunked_prefill"] > 0


def test_multiprocessing_on_one_liner_pickles_and_reports_per_process(models, tmp_path):
    dump = tmp_path / "dump"
    workload = [{"kind": "prefill", "prompts": [list(range(3, 20))], "max_tokens": 3}]
    result = run_engine(tmp_path / "run", {"model": models["dsv3"], "pass": True, "workload": workload,
                                           "llm": CPU_MLA}, multiprocessing=True, FUSION_PASS_DUMP=str(dump))
    reports = [json.loads(p.read_text()) for p in sorted(dump.glob("vllm_report_*.json"))]
    assert reports, "no process wrote a report"
    compiled = [r for r in reports if r["graphs"]]
    assert compiled and all(r["pid"] != result["pid"] for r in compiled), "the pass ran outside vLLM's worker"
    assert all(r["candidates"] == r["rewritten"] == 2 for r in compiled)
    # the user's process never compiles: its (deep-copied) pass saw no graph
    assert result["report"]["graphs"] == 0
    # graph dumps of every compiling process, numbered without collisions, each naming its process
    dumps = [json.loads(p.read_text()) for p in sorted(dump.glob("graph_*_report.json"))]
    assert len(dumps) == sum(r["graphs"] for r in compiled)
    assert {d["pid"] for d in dumps} == {r["pid"] for r in compiled}
    assert all((dump / f"graph_{i:03d}_after.py").exists() for i in range(len(dumps)))
    assert "2 candidates, 2 rewritten" in result["log"]


@pytest.mark.parametrize("name", ["dsv3", "llama"])
def test_graphs_vllms_own_fusion_rewrote_are_retargeted_to_the_fused_call(models, tmp_path, name):
    """vLLM's attention+quant fusion (CUDA-only; emulated here, tests_vllm/emulated_vllm_fusion.py) runs
    first; the pass retargets its output to the fused call, which then runs like a fused rewrite."""
    result = run_engine(tmp_path, spec(name, models, True, pass_name="emulated_vllm_fusion.PASS"))
    report = result["report"]
    assert report["emulated"]["rewritten"] == 2  # vLLM's form: its attention op given the quant's buffers
    pattern = ("mla_" if name == "dsv3" else "") + "attention_nvfp4_prequantized"
    assert report["candidates"] == report["rewritten"] == report["retargeted"] == 2, report
    assert [(l["pattern"], l["outcome"]) for l in report["per_graph"][0]["layers"]] == [(pattern, "retargeted")] * 2
    assert "2 rewritten (2 retargeted)" in result["log"]
    counters = result["counters"]
    assert counters["fused"] > 0 and counters["fallback"].get("decode_tokens", 0) > 0
    plain = run_engine(tmp_path / "plain", spec(name, models, False))
    check_against_plain_run(result, plain)
    assert check_shadows(result) == counters["fused"]
