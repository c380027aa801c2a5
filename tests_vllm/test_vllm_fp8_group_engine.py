"""FP8 attention output with 128-column group scales in a real vllm.LLM (vLLM's CPU build): the tiny MLA
(DeepSeek-V3-style, ``v_head_dim`` 128) and GQA (Qwen2-style, head dim 128) models with the o_proj a block-FP8 linear
of the test-only method (tests_vllm/fp8_test_quant.py ``"group"``: ``per_token_group_fp8_quant`` then
``fusion_pass::fp8_group_gemm``), with the documented one-liner vs without it. The MLA model quantizes as vLLM's
DeepGEMM path does (UE8M0 scales, TMA-aligned column-major), the GQA model as its CUTLASS path (float scales,
column-major).

What is checked: the pass's report (every attention layer's chain rewritten by the ``*_fp8_group_quant`` entries),
the run-time counters under the format's keys, every fused call's codes and scales against the exact fallback on the
same inputs (decode rows byte-equal, codes and scales; fused prefill rows within the group format's bound), and greedy
tokens equal to the run without the pass (up to an exact tie, as test_vllm_engine.py).
"""

import pytest
import torch

from conftest import DSV3
from fp8_test_quant import NAME
from fusion_pass import fp8
from test_vllm_engine import CHUNKED, CPU_MLA, check_tokens
from test_vllm_fp8_engine import assert_every_layer_rewritten, run_with_and_without_the_pass
from tiny_models import QWEN2

DEEPGEMM = {"quant_method": NAME, "group": {"ue8m0": True, "layout": "column_major_tma"}}
CUTLASS = {"quant_method": NAME, "group": {"ue8m0": False, "layout": "column_major"}}

CONFIGS = {
    "dsv3": ({**DSV3, "v_head_dim": 128, "quantization_config": DEEPGEMM}, {**CPU_MLA}, {}, [
        {"kind": "prefill", "prompts": [list(range(3, 10)), list(range(10, 40))], "max_tokens": 1},
        {"kind": "mixed", "prompts": [list(range(50, 56)), list(range(60, 70)), list(range(70, 75)),
                                      list(range(80, 88)), list(range(90, 102))], "max_tokens": [2, 5, 5, 5, 3]}]),
    "qwen2": ({**QWEN2, "hidden_size": 512, "quantization_config": CUTLASS}, {**CHUNKED, "block_size": 32},
              {"FUSION_PASS_VLLM_SPLIT_MIXED": "on"}, [
        {"kind": "prefill", "prompts": [list(range(3, 10)), list(range(10, 30))], "max_tokens": 1},
        {"kind": "chunked", "prompts": [list(range(3, 10)), list(range(10, 80)), list(range(200, 205))],
         "max_tokens": [6, 2, 8]}]),
}
PATTERN = {"dsv3": "mla_attention_fp8_group_quant", "qwen2": "attention_fp8_group_quant"}
FORMAT = {"dsv3": "fp8_group128_ue8m0", "qwen2": "fp8_group128"}


@pytest.fixture(scope="module", params=list(CONFIGS))
def runs(request, tmp_path_factory):
    _, fused, plain = run_with_and_without_the_pass(tmp_path_factory, f"{request.param}-fp8-group",
                                                    CONFIGS[request.param])
    return request.param, fused, plain


def test_every_attention_layer_rewritten_to_write_fp8_groups(runs):
    name, fused, _ = runs
    assert_every_layer_rewritten(fused["report"], PATTERN[name])


def check_groups(fa, fs, pa, ps, decode_rows, ue8m0: bool, what: str) -> None:
    """Decode rows byte-equal (codes and scales); every other row (a fused prefill row) within both sides' group
    error plus the query dtype's rounding of the unfused bytes, which are not all zero (no vacuous comparison)."""
    assert fa.dtype == pa.dtype == torch.float8_e4m3fn and fa.shape == pa.shape, what
    fa, pa = fa.reshape(fa.shape[0], -1), pa.reshape(pa.shape[0], -1)
    assert fs.shape == ps.shape == (fa.shape[0], fa.shape[1] // 128), what
    decode = torch.tensor(decode_rows, dtype=torch.long)
    assert torch.equal(fa.view(torch.uint8)[decode], pa.view(torch.uint8)[decode]), what
    assert torch.equal(fs[decode], ps[decode]), what
    prefill = torch.ones(fa.shape[0], dtype=torch.bool)
    prefill[decode] = False
    f_hat, p_hat = fp8.dequantize_group(fa, fs)[prefill], fp8.dequantize_group(pa, ps)[prefill]
    assert p_hat.abs().max() > 0, f"{what}: the prefill rows quantize to zero"
    bound = (fp8.group_error_bound(p_hat, ps[prefill]) + fp8.group_error_bound(p_hat, fs[prefill])
             + 2 * p_hat.abs() * 2.0 ** -8)
    assert ((f_hat - p_hat).abs() <= bound).all(), what
    if ue8m0:
        assert torch.equal(torch.log2(fs), torch.log2(fs).round()), f"{what}: UE8M0 scales are powers of two"


def test_fused_calls_match_the_exact_fallback_and_tokens_the_plain_run(runs):
    name, fused, plain = runs
    count = 0
    for f_step, p_step in zip(fused["steps"], plain["steps"], strict=True):
        check_tokens(f_step, p_step, f"fp8 group {name} {f_step['kind']}")
        calls = [c for c in f_step["calls"] if c["path"] != "fallback"]
        assert len(calls) == len(f_step["shadows"])
        for call, (fa, fs, pa, ps) in zip(calls, f_step["shadows"]):
            assert call["format"] == FORMAT[name]
            assert not call["one_call"] and call["post_quantized"] == ({"decode_tokens": call["decode"]}
                                                                       if call["decode"] else {}), call
            check_groups(fa, fs, pa, ps, call["decode_rows"], FORMAT[name].endswith("ue8m0"),
                         f"{f_step['kind']}: {call}")
            count += 1
    assert count == fused["counters"]["fused"] > 0
    mixed = [c for s in fused["steps"] for c in s["calls"] if c["path"] == "fused" and c["decode"]]
    assert mixed, "no mixed (decode + prefill) FP8 group call was fused"


def test_counters_name_the_format_and_every_prefill_token_is_fused(runs):
    name, fused, _ = runs
    counters, fmt = fused["counters"], FORMAT[name]
    assert counters == fused["report"]["runtime_process"]
    assert counters["fused_by_backend"] == {f"reference ({fmt})": counters["fused"]} and counters["fused"] > 0
    assert set(counters["fallback"]) <= {f"decode_tokens ({fmt})", f"no_attention_metadata ({fmt})"}
    assert counters["fallback"].get(f"decode_tokens ({fmt})", 0) > 0
    tokens = counters["tokens"]
    assert tokens["prefill"] == tokens["prefill_fused"] > 0 and tokens["decode_fused"] == 0
    assert f"attention + {fmt} quant fused with backend reference" in fused["log"]
