"""A real vllm.LLM (vLLM's CPU build) on tiny DeepSeek-V3-style and Llama configs, with the documented
one-liner vs without it: the report, the o_proj's NVFP4 input, the guard's decisions, multiprocessing."""

import json

import pytest
import torch

from conftest import run_engine
from fusion_pass import nvfp4
from fusion_pass.vllm.testing import ACT_GLOBAL_SCALE

P = list(range(3, 10)), list(range(10, 40))

WORKLOADS = {
    # CPU MLA forces chunked prefill and prefix caching off: pure prefill, then prefill + decode steps.
    "dsv3": ([{"kind": "prefill", "prompts": [list(range(3, 10)), list(range(10, 40))], "max_tokens": 1},
              {"kind": "decode", "prompts": [list(range(50, 60)), list(range(60, 65))], "max_tokens": 4}], {}),
    # Llama: a 32-token budget splits the 40-token prompt (chunked prefill) and mixes decode with prefill.
    "llama": ([{"kind": "prefill", "prompts": [list(range(3, 10)), list(range(10, 30))], "max_tokens": 1},
               {"kind": "mixed", "prompts": [list(range(100, 140)), list(range(200, 220))], "max_tokens": 4}],
              {"max_num_batched_tokens": 32, "enable_chunked_prefill": True, "enable_prefix_caching": False}),
}
PREFILL = {"fused"}  # the decision of pure-prefill calls (vLLM's CPU build: the reference backend)


@pytest.fixture(scope="module", params=["dsv3", "llama"])
def runs(request, models, tmp_path_factory):
    name = request.param
    workload, llm = WORKLOADS[name]
    out = {}
    for with_pass in (True, False):
        tmp = tmp_path_factory.mktemp(f"{name}_{'pass' if with_pass else 'plain'}")
        out[with_pass] = run_engine(tmp, {"model": models[name], "pass": with_pass, "workload": workload, "llm": llm})
    return name, out[True], out[False]


def test_every_attention_layer_rewritten(runs):
    name, fused, plain = runs
    report = fused["report"]
    assert fused["config"]["pass_type"] == "FusionPassForVllm"
    assert report["disabled_reason"] is None and report["vllm_version"].startswith("0.32.")
    assert report["graphs"] == 1 and report["candidates"] == report["rewritten"] == 2, report
    pattern = "mla_attention_nvfp4_quant" if name == "dsv3" else "attention_nvfp4_quant"
    layers = report["per_graph"][0]["layers"]
    assert [(l["layer"], l["pattern"], l["outcome"]) for l in layers] == [
        (f"model.layers.{i}.self_attn.attn", pattern, "rewritten") for i in range(2)]
    assert "fusion_pass: graph 0: 2 candidates, 2 rewritten" in fused["log"]


def _bound(plain_hat, gs):
    """The fused bound of tests/test_fusion_pass.py with the float32 attention (not observable inside
    vLLM) replaced by the unfused dequantized value: NVFP4 error of both sides plus bf16 rounding."""
    return 2 * nvfp4.error_bound(plain_hat, gs) + 2 * plain_hat.abs() * 2.0 ** -8


def test_o_proj_nvfp4_input_bytes_equal_off_prefill_within_bound_on_prefill(runs):
    name, fused, plain = runs
    gs = torch.tensor([ACT_GLOBAL_SCALE])
    kinds = set()
    for f_step, p_step in zip(fused["steps"], plain["steps"], strict=True):
        assert f_step["tokens"] == p_step["tokens"]
        assert len(f_step["taps"]) == len(p_step["taps"]) == len(f_step["decisions"]) > 0
        for (fa, fs), (pa, ps), decision in zip(f_step["taps"], p_step["taps"], f_step["decisions"]):
            kinds.add(decision)
            assert fa.shape == pa.shape and fa.dtype == torch.uint8
            if decision in PREFILL:
                m = fa.shape[0]
                f_hat = nvfp4.dequantize(fa, fs, gs, m=m)
                p_hat = nvfp4.dequantize(pa, ps, gs, m=m)
                assert ((f_hat - p_hat).abs() <= _bound(p_hat, gs)).all()
            else:
                assert torch.equal(fa, pa) and torch.equal(fs.view(torch.uint8), ps.view(torch.uint8)), decision
    expected = {"fused", "decode_tokens"}
    if name == "llama":
        expected.add("chunked_prefill")
    assert expected <= kinds, kinds


def test_guard_counts_every_call_and_names_each_path_once_in_vllms_log(runs):
    name, fused, plain = runs
    counters = fused["counters"]
    assert counters == fused["report"]["runtime"]
    calls = sum(len(s["decisions"]) for s in fused["steps"])
    assert counters["fused"] + sum(counters["fallback"].values()) == calls
    # pure-prefill calls run the fused path: on vLLM's CPU build the reference backend (float32 attention)
    assert counters["fused"] > 0 and counters["fused_by_backend"] == {"reference": counters["fused"]}
    assert set(counters["fallback"]) <= {"decode_tokens", "chunked_prefill", "no_attention_metadata"}
    assert "attention + NVFP4 quant fused with backend reference" in fused["log"]
    assert "attention + NVFP4 quant fell back (decode_tokens)" in fused["log"]


def test_multiprocessing_on_one_liner_pickles_and_reports_per_process(models, tmp_path):
    dump = tmp_path / "dump"
    workload = [{"kind": "prefill", "prompts": [list(range(3, 20))], "max_tokens": 3}]
    result = run_engine(tmp_path / "run", {"model": models["dsv3"], "pass": True, "workload": workload},
                        multiprocessing=True, FUSION_PASS_DUMP=str(dump))
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
    workload, llm = WORKLOADS[name]
    result = run_engine(tmp_path, {"model": models[name], "pass": True, "pass_name": "emulated_vllm_fusion.PASS",
                                   "workload": workload, "llm": llm})
    report = result["report"]
    assert report["emulated"]["rewritten"] == 2  # vLLM's form: its attention op given the quant's buffers
    pattern = ("mla_" if name == "dsv3" else "") + "attention_nvfp4_prequantized"
    assert report["candidates"] == report["rewritten"] == report["retargeted"] == 2, report
    assert [(l["pattern"], l["outcome"]) for l in report["per_graph"][0]["layers"]] == [(pattern, "retargeted")] * 2
    assert "2 rewritten (2 retargeted)" in result["log"]
    counters = result["counters"]
    assert counters["fused"] > 0 and counters["fallback"].get("decode_tokens", 0) > 0
    plain = run_engine(tmp_path / "plain", {"model": models[name], "pass": False, "workload": workload, "llm": llm})
    gs = torch.tensor([ACT_GLOBAL_SCALE])
    for f_step, p_step in zip(result["steps"], plain["steps"], strict=True):
        for (fa, fs), (pa, ps), decision in zip(f_step["taps"], p_step["taps"], f_step["decisions"], strict=True):
            if decision == "fused":
                m = fa.shape[0]
                p_hat = nvfp4.dequantize(pa, ps, gs, m=m)
                assert ((nvfp4.dequantize(fa, fs, gs, m=m) - p_hat).abs() <= _bound(p_hat, gs)).all()
            else:
                assert torch.equal(fa, pa) and torch.equal(fs.view(torch.uint8), ps.view(torch.uint8)), decision
