"""Beyond one device on vLLM's CPU build: tensor parallelism (TP=2) and pipeline parallelism (PP=2), two worker
processes each, the pass rewriting and fusing in both (docs/vllm.md, "Beyond one device").

vLLM's CPU workers bind their OpenMP threads to one NUMA node each by default and refuse to start with more
ranks than NUMA nodes ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"); the tests bind
them by hand, each rank to half of this process's CPUs (``VLLM_CPU_OMP_THREADS_BIND="0-3|4-7"`` on 8 CPUs).
"""

import json
import os
import re

import pytest

from conftest import DSV3, run_engine

PROMPTS = [list(range(3, 10)), list(range(10, 27))]
MAX_TOKENS = 3
HEADS, V_HEAD_DIM, LAYERS = DSV3["num_attention_heads"], DSV3["v_head_dim"], DSV3["num_hidden_layers"]


def thread_binding() -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for two ranks: this process's CPUs split in two halves."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"two vLLM CPU workers need two CPUs, this process may use {cpus}")
    half = len(cpus) // 2
    return "|".join(",".join(map(str, part)) for part in (cpus[:half], cpus[half:2 * half]))


def fused_output_widths(graph_text: str) -> list[int]:
    """The byte width of the NVFP4 output of every fused call in a dumped graph (``graph_NNN_after.py``):
    ``H * Dv / 2`` with the heads this rank holds."""
    widths = []
    for output in re.findall(r"fusion_pass\.vllm_mla_attention_nvfp4\.default, .*?\boutput = (\w+)", graph_text):
        (width,) = re.findall(rf'^\s*{output}: "u8\[\w+, (\d+)\]"', graph_text, flags=re.M)
        widths.append(int(width))
    return widths


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"], ids=["TP2", "PP2"])
def test_two_ranks_each_rewrite_and_fuse_their_layers(models, tmp_path, parallel):
    dump = tmp_path / "dump"
    workload = [{"kind": "prefill", "prompts": PROMPTS, "max_tokens": MAX_TOKENS}]
    result = run_engine(tmp_path / "run", {"model": models["dsv3"], "pass": True, "workload": workload,
                                           "llm": {"attention_config": {"backend": "CPU_MLA"}, parallel: 2}},
                        multiprocessing=True, FUSION_PASS_DUMP=str(dump), VLLM_CPU_OMP_THREADS_BIND=thread_binding(),
                        FUSION_PASS_VLLM_IMPORT="nvfp4_test_quant,unit_norm_dummy")
    reports = [json.loads(p.read_text()) for p in sorted((dump / "reports").glob("vllm_report_*.json"))]
    ranks = [r for r in reports if r["graphs"]]
    assert len(ranks) == 2 and len({r["pid"] for r in ranks}) == 2, reports
    rank = "TP" if parallel == "tensor_parallel_size" else "PP"
    for r in ranks:  # the log line of each rank's worker
        assert re.search(rf"\(Worker_{rank}\d pid={r['pid']}\).*fusion_pass: graph 0: {r['candidates']} candidates, "
                         rf"{r['candidates']} rewritten, refused: none", result["log"]), result["log"][-4000:]
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    if parallel == "tensor_parallel_size":  # every rank: every layer, half of its heads
        assert [r["rewritten_layers"] for r in ranks] == [layers, layers]
        per_rank_layers = LAYERS
    else:  # a stage each: its own layers, every head
        assert sorted(l for r in ranks for l in r["rewritten_layers"]) == layers
        assert all(r["candidates"] == r["rewritten"] == 1 for r in ranks)
        per_rank_layers = 1
    # every rank runs every token of its layers: every prompt token fused, every decode token post-quantized
    prefill, decode = sum(map(len, PROMPTS)), len(PROMPTS) * (MAX_TOKENS - 1)
    for r in ranks:
        runtime = r["runtime_process"]
        assert runtime["fused"] > 0 and runtime["fused_by_backend"] == {"reference": runtime["fused"]}
        assert runtime["tokens"] == {"prefill": per_rank_layers * prefill, "prefill_fused": per_rank_layers * prefill, "decode_fused": 0,
                                     "post_quantized": {"decode_tokens": per_rank_layers * decode}}, r
    # the graph dumps: one per rank, the fused calls writing the NVFP4 bytes of the heads the rank holds
    paths = sorted(dump.glob("run_*/graph_*_report.json"))
    dumps = [json.loads(p.read_text()) for p in paths]
    assert sorted(d["pid"] for d in dumps) == sorted(r["pid"] for r in ranks)
    heads = HEADS // 2 if parallel == "tensor_parallel_size" else HEADS
    for d, path in zip(dumps, paths):
        text = path.with_name(path.name.replace("_report.json", "_after.py")).read_text()
        assert fused_output_widths(text) == [heads * V_HEAD_DIM // 2] * d["rewritten"], d
