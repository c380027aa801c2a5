"""Per-call cost of the fusion pass's vLLM attention op inside a real vLLM engine (vLLM's CPU build).

The op the rewritten graph calls (``fusion_pass::vllm_attention_nvfp4`` / ``vllm_mla_attention_nvfp4``,
``fusion_pass/vllm/runtime/attention_op.py``) runs once per attention layer per step. Beyond what the unfused graph
runs (vLLM's attention op, then the quant op) it adds its own work: reading vLLM's metadata, the guard's
decision, counting. This script runs tiny models (the vLLM suite's DeepSeek-V3-style MLA model and a
Qwen2-style GQA model with qkv bias, NVFP4 o_proj through ``tests_vllm/nvfp4_test_quant.py``) in a
``vllm.LLM`` with the pass, multiprocessing off, and times every call of the op:

  fallback   the op's own work: the whole call minus the time inside vLLM's attention op and the quant op
             it calls (the exact fallback), per reason (``decode_tokens`` for decode-only steps);
  decision   on the fused path, the op's work before the fused rows begin (the forward context, the step, the
             guard's decision);
  vllm_op    vLLM's own attention op on the fallback calls (what the overhead compares with).

Each also apart for the first layer of a step (which meets a new metadata object: the step's rows, its decision
and temporary are made there) and the other layers (which find them kept): in a model of L layers the first-layer
cost comes once per step, the other-layer cost L - 1 times. The timing wrappers add a few microseconds of their
own to what they measure.

Medians and 90th percentiles in microseconds, over the calls of every step after a warm-up workload.
Targets (issue 18, item 7): fallback <= 25 us, decision on the fused path <= 60 us. The numbers are wall-clock
times of Python work inside a running engine: on a machine shared with other work they grow with its load (vLLM's
own op time, printed beside them, shows how loaded it was).

    .venv-vllm/bin/python bench/vllm_op_overhead.py [--model mla|qwen2|all] [--rounds N] [--json PATH]

Exit code 2 when vLLM is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS_VLLM = ROOT / "tests_vllm"
TARGET_US = {"fallback": 25.0, "decision_fused": 60.0}

# prefill steps, decode-only steps, and (qwen2: chunked prefill with a 32-token budget, prefix caching) mixed steps
WORKLOAD = [
    {"prompts": [list(range(3, 30)), list(range(30, 70))], "max_tokens": [1, 1]},
    {"prompts": [list(range(100, 140)), list(range(200, 224)), list(range(300, 310)), list(range(400, 420))],
     "max_tokens": [12, 16, 12, 16]},
]
MODELS = {
    "mla": {"config": "DSV3", "llm": {"attention_config": {"backend": "CPU_MLA"}}},
    "qwen2": {"config": "QWEN2", "llm": {"max_num_batched_tokens": 32, "enable_chunked_prefill": True,
                                         "enable_prefix_caching": True}},
}


def _stats(values: list[float]) -> dict:
    if not values:
        return {"calls": 0}
    ordered = sorted(values)
    return {"calls": len(values), "median_us": round(statistics.median(ordered), 1),
            "p90_us": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 1)}


def _instrument(calls: list) -> None:
    """Wrap the op's entry (``attention_op._run``), the fused rows (``fused_rows.run_fused``, which ``_run`` calls
    through its module) and the two ops the fallback calls (vLLM's, and ``fused_rows.quant_op()``'s); each wrapper only reads the clock and notes it (a few microseconds of its own, counted in)."""
    from vllm.model_executor.layers.attention.attention import get_attention_context

    from fusion_pass.runtime import counters
    from fusion_pass.vllm.runtime import attention_op, fused_rows

    run, run_fused, quant_op = attention_op._run, fused_rows.run_fused, fused_rows.quant_op
    clock = time.perf_counter_ns
    # time in vLLM's op, time in the quant op, clock when the fused rows began, their metadata, the decision counted
    current = [0, 0, 0, None, None]

    def timed_vllm_op(vllm_op):
        def call(*args, **kwargs):
            start = clock()
            vllm_op(*args, **kwargs)
            current[0] += clock() - start
        return call

    def timed_quant(*args, **kwargs):
        start = clock()
        quant_op()(*args, **kwargs)
        current[1] += clock() - start

    def timed_run_fused(decision, md, *args):
        current[2] = clock()
        run_fused(decision, md, *args)

    last_metadata = [None]

    def timed_run(vllm_op, *args, **kwargs):
        current[0] = current[1] = current[2] = 0
        start = clock()
        run(timed_vllm_op(vllm_op), *args, **kwargs)
        total = clock() - start
        # after the clock: the call's metadata (the first layer of a step meets a new object)
        md = get_attention_context(getattr(args[2], "value", args[2]))[0]
        first, last_metadata[0] = md is not last_metadata[0], md
        if current[2]:  # fused: the op's work before the fused rows began (context, step, decision)
            calls.append({"path": "fused", "first_of_step": first, "total_us": total / 1e3,
                          "decision_us": (current[2] - start) / 1e3})
        else:
            calls.append({"path": "fallback", "first_of_step": first, "reason": current[4].reason,
                          "total_us": total / 1e3, "vllm_op_us": current[0] / 1e3, "quant_us": current[1] / 1e3})

    def record(decision, layer_name=None):  # the op's own count: the call's decision noted
        current[4] = decision
        counted(decision, layer_name)

    counted = counters.record
    attention_op._run = timed_run
    fused_rows.run_fused = timed_run_fused
    fused_rows.quant_op = lambda: timed_quant
    counters.record = record


def measure(model: str, rounds: int) -> dict:
    """One engine, in this process (the caller set the environment): per-call timings by path."""
    sys.path.insert(0, str(TESTS_VLLM))
    import conftest
    import tiny_models
    from vllm import LLM, SamplingParams

    config = getattr(conftest, MODELS[model]["config"], None) or getattr(tiny_models, MODELS[model]["config"])
    root = Path(tempfile.mkdtemp(prefix=f"vllm_op_overhead_{model}_"))
    path = conftest.write_model(root, config)
    llm = LLM(model=path, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512,
              max_num_seqs=4, gpu_memory_utilization=0.1, seed=0,
              compilation_config={"inductor_passes": {"post_grad_custom_post_pass": "fusion_pass_vllm.PASS"}},
              **MODELS[model]["llm"])
    calls: list = []
    _instrument(calls)
    for round_ in range(rounds + 1):  # round 0 warms up (first calls log, caches fill)
        calls.clear() if round_ == 1 else None
        for step in WORKLOAD:
            params = [SamplingParams(max_tokens=n, temperature=0.0, detokenize=False, ignore_eos=True)
                      for n in step["max_tokens"]]
            prompts = [[(t + round_) % 1000 + 3 for t in p] for p in step["prompts"]]  # no prefix hits across rounds
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    out: dict = {"model": model, "calls": len(calls)}
    fallback = [c for c in calls if c["path"] == "fallback"]
    for reason in sorted({c["reason"] for c in fallback}):
        mine = [c for c in fallback if c["reason"] == reason]
        own = [(c["total_us"] - c["vllm_op_us"] - c["quant_us"], c["first_of_step"]) for c in mine]
        out[f"fallback:{reason}"] = {
            "overhead": _stats([o for o, _ in own]),
            "overhead_first_layer": _stats([o for o, first in own if first]),
            "overhead_other_layers": _stats([o for o, first in own if not first]),
            "vllm_op": _stats([c["vllm_op_us"] for c in mine]),
            "quant": _stats([c["quant_us"] for c in mine])}
    fused = [c for c in calls if c["path"] == "fused"]
    out["fused"] = {"decision": _stats([c["decision_us"] for c in fused]),
                    "decision_first_layer": _stats([c["decision_us"] for c in fused if c["first_of_step"]]),
                    "decision_other_layers": _stats([c["decision_us"] for c in fused if not c["first_of_step"]]),
                    "total": _stats([c["total_us"] for c in fused])}
    return out


def _environment() -> dict:
    env = dict(os.environ)
    env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_DISABLE_COMPILE_CACHE": "1",
                "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "FUSION_PASS_VLLM_IMPORT": "nvfp4_test_quant",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                # Qwen2's mixed steps split and fused, as in the 2026-12-01 measurement (the default does not split
                # them: mixed_not_split)
                "FUSION_PASS_VLLM_SPLIT_MIXED": "on",
                "PYTHONPATH": os.pathsep.join(filter(None, (str(TESTS_VLLM), os.environ.get("PYTHONPATH", ""))))})
    return env


def _print(result: dict) -> None:
    print(f"{result['model']}: {result['calls']} calls")
    for key, value in result.items():
        if key.startswith("fallback:"):
            o, v = value["overhead"], value["vllm_op"]
            first, other = value["overhead_first_layer"], value["overhead_other_layers"]
            print(f"  {key:<28} own work median {o['median_us']:>7} us  p90 {o['p90_us']:>7} us  n={o['calls']}  "
                  f"target <= {TARGET_US['fallback']:.0f} us  (first layer of a step {first.get('median_us')} us, "
                  f"other layers {other.get('median_us')} us; vLLM's op {v['median_us']} us)")
    d = result["fused"]["decision"]
    if d["calls"]:
        first, other = result["fused"]["decision_first_layer"], result["fused"]["decision_other_layers"]
        print(f"  {'fused':<28} decision median {d['median_us']:>7} us  p90 {d['p90_us']:>7} us  n={d['calls']}  "
              f"target <= {TARGET_US['decision_fused']:.0f} us  (first layer of a step {first.get('median_us')} us, "
              f"other layers {other.get('median_us')} us)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--rounds", type=int, default=2, help="timed repetitions of the workload (after one warm-up)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # one model in this process, results there
    args = parser.parse_args(argv)
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vllm_op_overhead: needs vLLM (make test-vllm creates .venv-vllm)", file=sys.stderr)
        return 2
    if args.child is not None:
        args.child.write_text(json.dumps(measure(args.model, args.rounds)))
        return 0
    results = []
    for model in (MODELS if args.model == "all" else [args.model]):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            proc = subprocess.run([sys.executable, __file__, "--model", model, "--rounds", str(args.rounds),
                                   "--child", str(out)], env=_environment(), capture_output=True, text=True)
            if proc.returncode != 0:
                print((proc.stdout + proc.stderr)[-4000:], file=sys.stderr)
                return proc.returncode
            results.append(json.loads(out.read_text()))
        _print(results[-1])
    if args.json:
        args.json.write_text(json.dumps({"targets_us": TARGET_US, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
