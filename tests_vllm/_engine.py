"""Runs one vLLM engine on a tiny model in a fresh process and saves what the tests check.

    python _engine.py SPEC_JSON OUT_PT

SPEC: {"model": dir, "pass": bool, "pass_name": str (default: the one-liner), "compilation_config": {...} (more
       of vLLM's compilation config),
       "workload": [{"kind": ..., "prompts": [[ids]], "max_tokens": n or [n per prompt]}], "llm": {...},
       "keep_chunked_prefill": bool (see below), "logprobs": n (default 2)}
OUT: torch.save({"steps": [{"kind", "taps": [(a, block_scale_a)], "tokens", "logprobs", "decisions", "calls",
"shadows", ...}], "report", "counters", "config", "unit_norm_weights"}). ``logprobs``: per prompt, per generated
token, the ``(token id, logprob)`` of the top ``n`` (vLLM's sampler, greedy), to tell exact ties. Per call of our
vLLM attention op (pass runs only), in call order: ``decisions`` its path ("fused") or fallback reason; ``calls``
the decision's rows and the batch it was taken for (``one_call`` / ``decode_fused``: every row in one paged launch;
``decode``: decode tokens, ``decode_rows`` their rows;
``query_lens`` / ``context_lens`` per prefill; ``host_copies``: the metadata kept vLLM's host copies of the batch
through the build hook); per fused call, ``shadows`` its bytes and the exact fallback's on
the same inputs (:func:`shadow_unfused`).
Taps (the o_proj's NVFP4 inputs), shadows and unit norm weights (:func:`unit_norm_weights`) only with
VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine in this process).

``keep_chunked_prefill``: vLLM's CPU platform turns chunked prefill and prefix caching off for MLA models
on its reference CPU_MLA backend (``CpuPlatform.check_and_update_config``, vllm/platforms/cpu.py), though
the MLA code it runs has a CPU path for cached context (``MLACommonBaseImpl._compute_prefill_context``:
``ops.gather_mla_context_cache_cpu``, ``CPUSDPAMLAPrefillBackend.run_prefill_context_chunk``). With this
flag the engine keeps the ``llm`` settings ``enable_chunked_prefill``, ``enable_prefix_caching`` and
``max_num_batched_tokens`` after that check, so that vLLM itself computes MLA batches with cached context.
"""

import json
import os
import sys
import time

PASS_NAME = "fusion_pass_vllm.PASS"  # the documented one-liner (docs/vllm.md)


def keep_chunked_prefill() -> None:
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__

    def check_keeping_chunked_prefill(cls, vllm_config):
        scheduler, cache = vllm_config.scheduler_config, vllm_config.cache_config
        kept = scheduler.enable_chunked_prefill, cache.enable_prefix_caching, scheduler.max_num_batched_tokens
        check(cls, vllm_config)
        scheduler.enable_chunked_prefill, cache.enable_prefix_caching, scheduler.max_num_batched_tokens = kept

    CpuPlatform.check_and_update_config = classmethod(check_keeping_chunked_prefill)


def unit_norm_weights(model) -> int:
    """Set every RMSNorm weight to 1 (what real checkpoints hold at initialisation): vLLM's dummy weights
    (uniform in [-1e-3, 1e-3]) make the norms' outputs so small that the attention output (about 1e-7)
    quantizes to zero scales at the test method's global scale, and every NVFP4 comparison would hold
    trivially. Returns the number of weights set."""
    import torch

    count = 0
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            with torch.no_grad():
                param.fill_(1.0)
            count += 1
    return count


def batch_of_current_call(layer_name) -> dict:
    """The batch of the attention call being recorded (its layer's metadata in vLLM's forward context), as the
    guard reads it (host-side rows: fusion_pass.vllm.adapters.host_rows)."""
    from fusion_pass.vllm.runtime import attention_op, guard

    md, layer, _ = attention_op._context(layer_name)
    rows = None if md is None else guard.step_rows(md, layer)
    if rows is None:
        return {"decode": 0, "decode_rows": [], "host_copies": False}
    return {"decode": rows.rows.decode_tokens, "decode_rows": rows.decode_rows,
            "query_lens": list(rows.rows.query_lens), "context_lens": list(rows.rows.context_lens),
            # vLLM's host copies kept by the metadata builder's hook (fusion_pass.vllm.adapters.host_rows.install_build_hook)
            "host_copies": hasattr(md, "_fusion_pass_host")}


def shadow_unfused(shadows: list) -> None:
    """After each fused call, the exact fallback (vLLM's op + the unfused graph's quant op) of the same call on
    the same inputs into copies of the buffers: ``shadows`` gets ``(fused packed, fused scales, unfused packed,
    unfused scales)`` per fused call (every layer; across two runs only the first layer's inputs are equal; the scales
are None for a static FP8 call, whose only buffer is its codes)."""
    import torch

    from fusion_pass import formats
    from fusion_pass.runtime import fp8_rows
    from fusion_pass.vllm.runtime import attention_op, fused_rows, guard

    run_fused = fused_rows.run_fused  # attention_op._run calls fused_rows.run_fused

    def run_fused_and_unfused(decision, md, layer, kv_cache, inputs, output, output_scale, output_block_scale,
                              extra=None, fp8_quant=fp8_rows.OP_FORM):
        run_fused(decision, md, layer, kv_cache, inputs, output, output_scale, output_block_scale, extra, fp8_quant)
        packed = output.clone()
        scales = output_block_scale.clone() if output_block_scale is not None else None  # None: static FP8
        if guard.is_mla(layer):
            op, heads = torch.ops.vllm.unified_mla_attention_with_output, None
        else:
            op, heads = torch.ops.vllm.unified_attention_with_output, inputs[0].shape[1]
        attention_op._run_unfused(op, inputs, packed, layer.layer_name, output_scale, scales, (), heads, None,
                                  formats.by_name(decision.format), fp8_quant)
        shadows.append((output.clone(), None if scales is None else output_block_scale.clone(), packed, scales))

    fused_rows.run_fused = run_fused_and_unfused


def main(spec_path: str, out_path: str) -> None:
    spec = json.load(open(spec_path))
    if spec.get("keep_chunked_prefill"):
        keep_chunked_prefill()
    import torch
    from vllm import LLM, SamplingParams

    from fusion_pass import ops
    from fusion_pass.runtime import counters

    cc = {"inductor_passes": {"post_grad_custom_post_pass": spec.get("pass_name", PASS_NAME)}} if spec["pass"] else {}
    cc.update(spec.get("compilation_config", {}))
    start = time.time()
    llm = LLM(model=spec["model"], load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=512, max_num_seqs=4, gpu_memory_utilization=0.1, seed=0,
              compilation_config=cc, **spec.get("llm", {}))
    engine_s = time.time() - start
    norms = sum(llm.apply_model(unit_norm_weights)) if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" else 0
    counters.reset_counters()
    decisions: list = []  # one per call of our vLLM attention op, in call order (pass runs only)
    calls: list = []
    record = counters.record

    def record_and_keep(decision, layer_name=None):
        decisions.append(decision.reason or "fused")
        calls.append({"path": decision.path, "reason": decision.reason, "prefill_tokens": decision.prefill_tokens,
                      "fused_tokens": decision.fused_tokens, "post_quantized": dict(decision.post_quantized),
                      "one_call": decision.one_call, "decode_fused": decision.decode_fused,
                      "format": decision.format,
                      **batch_of_current_call(layer_name)})
        record(decision, layer_name)

    counters.record = record_and_keep  # fusion_pass.vllm.runtime.attention_op calls counters.record
    shadows: list = []
    if spec["pass"]:
        shadow_unfused(shadows)
    steps = []
    for step in spec["workload"]:
        max_tokens = step["max_tokens"]
        if isinstance(max_tokens, int):
            max_tokens = [max_tokens] * len(step["prompts"])
        params = [SamplingParams(max_tokens=n, temperature=0.0, detokenize=False, ignore_eos=True,
                                 logprobs=spec.get("logprobs", 2)) for n in max_tokens]
        decisions.clear()
        calls.clear()
        shadows.clear()
        with ops.tap_gemm_inputs() as tap:
            outs = llm.generate([{"prompt_token_ids": p} for p in step["prompts"]], params, use_tqdm=False)
        steps.append({"kind": step["kind"], "taps": [(a, s) for a, s in tap],
                      "tokens": [list(o.outputs[0].token_ids) for o in outs],
                      "logprobs": [[sorted(((t, lp.logprob) for t, lp in pos.items()), key=lambda x: -x[1])
                                    for pos in (o.outputs[0].logprobs or [])] for o in outs],
                      "decisions": list(decisions), "calls": list(calls), "shadows": list(shadows)})
    result = {"steps": steps, "counters": counters.counters(), "engine_s": engine_s, "pid": os.getpid(),
              "unit_norm_weights": norms}
    cfg = llm.llm_engine.vllm_config.compilation_config
    the_pass = cfg.inductor_compile_config.get("post_grad_custom_post_pass")
    result["config"] = {"mode": int(cfg.mode), "backend": cfg.backend, "splitting_ops": cfg.splitting_ops,
                        "pass_type": type(the_pass).__name__,
                        "enable_chunked_prefill": llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill,
                        "enable_prefix_caching": llm.llm_engine.vllm_config.cache_config.enable_prefix_caching}
    if spec["pass"] and hasattr(the_pass, "report"):
        report = the_pass.report()
        result["report"] = json.loads(json.dumps(report, default=str))
    torch.save(result, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
