"""Runs one vLLM engine on a tiny model in a fresh process and saves what the tests check.

    python _engine.py SPEC_JSON OUT_PT

SPEC: {"model": dir, "pass": bool, "pass_name": str (default: the one-liner), "workload": [{"kind": ..., "prompts": [[ids]], "max_tokens": n}], "llm": {...}}
OUT: torch.save({"steps": [{"kind", "taps": [(a, block_scale_a)], ...}], "report", "counters", "config"}).
Taps (the o_proj's NVFP4 inputs) are only available with VLLM_ENABLE_V1_MULTIPROCESSING=0.
"""

import json
import os
import sys
import time

PASS_NAME = "fusion_pass_vllm.PASS"  # the documented one-liner (docs/vllm.md)


def main(spec_path: str, out_path: str) -> None:
    spec = json.load(open(spec_path))
    import torch
    from vllm import LLM, SamplingParams

    from fusion_pass import guard, ops

    cc = {"inductor_passes": {"post_grad_custom_post_pass": spec.get("pass_name", PASS_NAME)}} if spec["pass"] else {}
    start = time.time()
    llm = LLM(model=spec["model"], load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=512, max_num_seqs=4, gpu_memory_utilization=0.1, seed=0,
              compilation_config=cc, **spec.get("llm", {}))
    engine_s = time.time() - start
    guard.reset_counters()
    decisions: list = []  # one per call of our vLLM attention op, in call order (pass runs only)
    record = guard.record

    def record_and_keep(decision):
        decisions.append(decision.reason or "fused")
        record(decision)

    guard.record = record_and_keep  # fusion_pass.vllm.attention calls guard.record
    steps = []
    for step in spec["workload"]:
        params = SamplingParams(max_tokens=step["max_tokens"], temperature=0.0, detokenize=False,
                                ignore_eos=True)
        decisions.clear()
        with ops.tap_gemm_inputs() as tap:
            outs = llm.generate([{"prompt_token_ids": p} for p in step["prompts"]], params, use_tqdm=False)
        steps.append({"kind": step["kind"], "taps": [(a, s) for a, s in tap],
                      "tokens": [list(o.outputs[0].token_ids) for o in outs],
                      "decisions": list(decisions)})
    result = {"steps": steps, "counters": guard.counters(), "engine_s": engine_s, "pid": os.getpid()}
    cfg = llm.llm_engine.vllm_config.compilation_config
    the_pass = cfg.inductor_compile_config.get("post_grad_custom_post_pass")
    result["config"] = {"mode": int(cfg.mode), "backend": cfg.backend, "splitting_ops": cfg.splitting_ops,
                        "pass_type": type(the_pass).__name__}
    if spec["pass"] and hasattr(the_pass, "report"):
        report = the_pass.report()
        result["report"] = json.loads(json.dumps(report, default=str))
    torch.save(result, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
