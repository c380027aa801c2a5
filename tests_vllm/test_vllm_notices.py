"""Never a silent no-op, in a real vLLM engine: a model vLLM does not compile (compilation mode NONE) never reaches the
pass, and the pass says so anyway, once per process, in vLLM's log and in the report ``fusion-pass report`` reads.

Configurations that keep vLLM's piecewise CUDA graphs (``use_inductor_graph_partition=True`` in ``VLLM_COMPILE``)
cannot run on vLLM's CPU build, which compiles in ``DYNAMO_TRACE_ONCE`` whatever the mode asked (docs/vllm.md,
"When the pass cannot act"); here the setting is accepted and the pass rewrites and fuses as usual.
"""

import json
import subprocess
import sys

from conftest import run_engine, write_model
from tiny_models import QWEN2

WORKLOAD = [{"kind": "prefill", "prompts": [list(range(3, 20)), list(range(30, 40))], "max_tokens": 2}]


def _qwen2(tmp_path):
    return write_model(tmp_path / "tiny-qwen2", QWEN2)


def test_a_model_vllm_does_not_compile_is_said_in_the_log_and_the_worker_report(tmp_path):
    dump = tmp_path / "dump"
    result = run_engine(tmp_path / "run", {"model": _qwen2(tmp_path), "pass": True, "workload": WORKLOAD,
                                           "llm": {"enforce_eager": True}},
                        multiprocessing=True, FUSION_PASS_DUMP=str(dump))
    assert result["config"]["mode"] == 0  # CompilationMode.NONE: no post-grad pass runs
    said = [line for line in result["log"].splitlines() if "fusion_pass: vLLM does not compile this model" in line]
    assert len(said) == 1, said  # once, by the worker that built the model (its attention metadata builders)
    assert "enforce_eager is set" in said[0] and "drop enforce_eager" in said[0]
    reports = [json.loads(p.read_text()) for p in sorted((dump / "reports").glob("vllm_report_*.json"))]
    worker = [r for r in reports if any(n["key"] == "not_compiled" for n in r.get("notices", []))]
    assert len(worker) == 1 and worker[0]["pid"] != result["pid"] and worker[0]["graphs"] == 0, reports
    # every attention call ran vLLM's own op: nothing was rewritten, nothing counted
    assert result["counters"]["fused"] == 0 and not result["counters"]["fallback"]
    text = subprocess.run([sys.executable, "-m", "fusion_pass.cli", "report", str(dump)], capture_output=True,
                          text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    assert "notices (why the pass could not act):" in text.stdout and "not_compiled" in text.stdout


def test_inductor_graph_partition_accepted_on_the_cpu_build(tmp_path):
    result = run_engine(tmp_path / "run", {"model": _qwen2(tmp_path), "pass": True, "workload": WORKLOAD, "llm": {},
                                           "compilation_config": {"use_inductor_graph_partition": True}})
    assert result["config"]["mode"] == 2 and result["config"]["splitting_ops"] == []  # DYNAMO_TRACE_ONCE, one graph
    assert result["report"]["rewritten"] == 2 and result["report"]["notices"] == []
    assert result["counters"]["tokens"]["prefill_fused"] == 2 * (17 + 10)  # both layers, every prompt token
