"""Static per-tensor FP8 attention output in a real vllm.LLM (vLLM's CPU build): the tiny MLA (DeepSeek-V3-style) and
GQA (Qwen2-style) models with the o_proj quantized by the test-only static FP8 method (tests_vllm/fp8_test_quant.py:
``static_scaled_fp8_quant`` then ``torch._scaled_mm``), with the documented one-liner vs without it.

What is checked: the pass's report (every attention layer's attention -> quant -> GEMM chain rewritten by the
``*_fp8_static_quant`` entries), the run-time counters under the format's keys (``"reference (fp8_static)"``, every
prefill token fused; decode-only calls post-quantized, ``"decode_tokens (fp8_static)"``), every fused call's codes
against the exact fallback on the same inputs (the shadows: decode rows byte-equal, fused prefill rows within the
FP8 bound), and greedy tokens equal to the run without the pass (up to an exact tie, as test_vllm_engine.py). The
``*_native`` configurations quantize with vLLM's own ``QuantFP8`` (its native form: no quant op in the graph),
rewritten by the ``*_fp8_static_native`` entries; their fused calls carry the graph's reciprocal (``output_inv_scale``).

The GQA model runs with ``FUSION_PASS_VLLM_SPLIT_MIXED=on``: the one fused launch over the paged cache writes NVFP4
only, so a mixed (decode + prefill) FP8 call is split: its prefill rows fused, its decode rows computed by vLLM's
backend on the decode requests and post-quantized (without the setting it would fall back, ``mixed_not_split``:
tested without an engine in test_vllm_fp8_static.py).
"""

import pytest
import torch

from conftest import DSV3, run_engine, write_model
from fp8_test_quant import ACT_SCALE, NAME
from fusion_pass import fp8
from test_vllm_engine import CHUNKED, CPU_MLA, check_tokens
from tiny_models import QWEN2

FP8_QUANT = {"quant_method": NAME}
NATIVE = {"quant_method": NAME, "native": True}  # vLLM's QuantFP8: the native form in the graph
IMPORTS = "nvfp4_test_quant,fp8_test_quant"
SCALE = torch.tensor([ACT_SCALE])

CONFIGS = {
    "dsv3": ({**DSV3, "quantization_config": FP8_QUANT}, {**CPU_MLA}, {}, [
        {"kind": "prefill", "prompts": [list(range(3, 10)), list(range(10, 40))], "max_tokens": 1},
        {"kind": "mixed", "prompts": [list(range(50, 56)), list(range(60, 70)), list(range(70, 75)),
                                      list(range(80, 88)), list(range(90, 102))], "max_tokens": [2, 5, 5, 5, 3]}]),
    "qwen2": ({**QWEN2, "quantization_config": FP8_QUANT}, {**CHUNKED, "block_size": 32},
              {"FUSION_PASS_VLLM_SPLIT_MIXED": "on"}, [
        {"kind": "prefill", "prompts": [list(range(3, 10)), list(range(10, 30))], "max_tokens": 1},
        {"kind": "chunked", "prompts": [list(range(3, 10)), list(range(10, 80)), list(range(200, 205))],
         "max_tokens": [6, 2, 8]}]),
}
CONFIGS["dsv3_native"] = ({**CONFIGS["dsv3"][0], "quantization_config": NATIVE}, *CONFIGS["dsv3"][1:])
CONFIGS["qwen2_native"] = ({**CONFIGS["qwen2"][0], "quantization_config": NATIVE}, *CONFIGS["qwen2"][1:])
PATTERN = {"dsv3": "mla_attention_fp8_static_quant", "qwen2": "attention_fp8_static_quant",
           "dsv3_native": "mla_attention_fp8_static_native", "qwen2_native": "attention_fp8_static_native"}


def run_with_and_without_the_pass(tmp_path_factory, name: str, case: tuple) -> tuple:
    """``(name, the run with the pass, the run without)`` of one configuration ``(model config, LLM arguments,
    environment, workload)``, the model written once."""
    config, llm, env, workload = case
    model = write_model(tmp_path_factory.mktemp("models") / f"tiny-{name}", config)
    out = {}
    for with_pass in (True, False):
        tmp = tmp_path_factory.mktemp(f"{name}_{'pass' if with_pass else 'plain'}")
        out[with_pass] = run_engine(tmp, {"model": model, "pass": with_pass, "workload": workload, "llm": llm},
                                    FUSION_PASS_VLLM_IMPORT=IMPORTS, **env)
    return name, out[True], out[False]


@pytest.fixture(scope="module", params=list(CONFIGS))
def runs(request, tmp_path_factory):
    name, fused, plain = run_with_and_without_the_pass(tmp_path_factory, f"{request.param}-fp8", CONFIGS[request.param])
    return request.param, fused, plain


def assert_every_layer_rewritten(report: dict, pattern: str) -> None:
    """One graph, both attention layers rewritten by the entry ``pattern``."""
    assert report["disabled_reason"] is None and report["graphs"] == 1, report
    assert report["candidates"] == report["rewritten"] == 2, report
    assert [(l["layer"], l["pattern"], l["outcome"]) for l in report["per_graph"][0]["layers"]] == [
        (f"model.layers.{i}.self_attn.attn", pattern, "rewritten") for i in range(2)]


def test_every_attention_layer_rewritten_to_write_fp8(runs):
    name, fused, _ = runs
    assert_every_layer_rewritten(fused["report"], PATTERN[name])


def _bound(p_hat):
    """Both sides' FP8 error plus the query dtype's rounding (the fused rows quantize float32 attention, the unfused
    rows bf16 attention)."""
    return 2 * fp8.static_error_bound(p_hat, SCALE) + 2 * p_hat.abs() * 2.0 ** -8


def check_codes(fa, pa, decode_rows, what: str) -> None:
    """Decode rows byte-equal; every other row (a fused prefill row) within :func:`_bound` of the unfused bytes, which
    are not all zero (no vacuous comparison)."""
    assert fa.dtype == pa.dtype == torch.float8_e4m3fn and fa.shape == pa.shape, what
    fa, pa = fa.reshape(fa.shape[0], -1), pa.reshape(pa.shape[0], -1)
    decode = torch.tensor(decode_rows, dtype=torch.long)
    assert torch.equal(fa.view(torch.uint8)[decode], pa.view(torch.uint8)[decode]), what
    prefill = torch.ones(fa.shape[0], dtype=torch.bool)
    prefill[decode] = False
    f_hat, p_hat = (fp8.dequantize_static(x, SCALE)[prefill] for x in (fa, pa))
    assert p_hat.abs().max() > 0, f"{what}: the prefill rows quantize to zero"
    assert ((f_hat - p_hat).abs() <= _bound(p_hat)).all(), what


def test_fused_calls_match_the_exact_fallback_and_tokens_the_plain_run(runs):
    name, fused, plain = runs
    count = 0
    for f_step, p_step in zip(fused["steps"], plain["steps"], strict=True):
        check_tokens(f_step, p_step, f"fp8 {name} {f_step['kind']}")
        calls = [c for c in f_step["calls"] if c["path"] != "fallback"]
        assert len(calls) == len(f_step["shadows"])
        for call, (fa, fs, pa, ps) in zip(calls, f_step["shadows"]):
            assert call["format"] == "fp8_static" and fs is None and ps is None
            assert not call["one_call"] and call["post_quantized"] == ({"decode_tokens": call["decode"]}
                                                                       if call["decode"] else {}), call
            check_codes(fa, pa, call["decode_rows"], f"{f_step['kind']}: {call}")
            count += 1
    assert count == fused["counters"]["fused"] > 0
    mixed = [c for s in fused["steps"] for c in s["calls"] if c["path"] == "fused" and c["decode"]]
    assert mixed, "no mixed (decode + prefill) FP8 call was fused"


def test_counters_name_the_format_and_every_prefill_token_is_fused(runs):
    name, fused, _ = runs
    counters = fused["counters"]
    assert counters == fused["report"]["runtime_process"]
    assert counters["fused_by_backend"] == {"reference (fp8_static)": counters["fused"]} and counters["fused"] > 0
    assert set(counters["fallback"]) <= {"decode_tokens (fp8_static)", "no_attention_metadata (fp8_static)"}
    assert counters["fallback"].get("decode_tokens (fp8_static)", 0) > 0
    tokens = counters["tokens"]
    assert tokens["prefill"] == tokens["prefill_fused"] > 0 and tokens["decode_fused"] == 0
    assert tokens["post_quantized"]["decode_tokens"] > 0
    assert "attention + fp8_static quant fused with backend reference" in fused["log"]
