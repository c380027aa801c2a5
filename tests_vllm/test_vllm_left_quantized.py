"""Beside vLLM's own attention + NVFP4 quant fusion: where the fused call cannot run for a layer (a quantized KV
cache above all: vLLM registers its standard-attention fusion for FlashInfer's trtllm-gen with one), the pass
leaves vLLM's rewrite as it is; elsewhere it retargets it to the fused op (fusion_pass/vllm/compile/layer_check.py).

At graph level on vLLM's CPU build: the unfused graph (vLLM's attention op -> the quant op -> the NVFP4 GEMM) goes
through ``emulated_vllm_fusion.PASS`` (vLLM's fusion, CUDA-only, stood in for by the pass's own rewrite with vLLM's
attention op as the NVFP4 writer; then this pass, as vLLM runs it after its own), with the layers vLLM would have
built in its static forward context (stand-ins carrying what the guard reads: ``kv_cache_dtype``, the attention
backend, the head dims). An engine cannot show it here: on CPU vLLM's attention op given the quant's buffers would
quantize with ``_C::scaled_fp4_quant``, which vLLM's CPU build lacks.
"""

import logging
from types import SimpleNamespace

import pytest
import torch
import vllm.model_executor.layers.attention  # noqa: F401  (registers vLLM's attention ops)
from vllm.config import VllmConfig, set_current_vllm_config

from emulated_vllm_fusion import EmulatedVllmFusionThenOurs
from fusion_pass.vllm.compile import layer_check

H, DV, T = 4, 64, 40
LAYER = "model.layers.0.self_attn.attn"
bf = torch.bfloat16


def standard_layer(kv_cache_dtype: str, backend: str, sliding_window=None):
    impl = SimpleNamespace(sliding_window=sliding_window, alibi_slopes=None, sinks=None, logits_soft_cap=None,
                           scale=DV ** -0.5, head_size=DV, num_heads=H, num_kv_heads=2)
    return SimpleNamespace(num_heads=H, num_kv_heads=2, head_size=DV, kv_cache_dtype=kv_cache_dtype,
                           attn_type="decoder", layer_name=LAYER, kv_sharing_target_layer_name=None, impl=impl,
                           attn_backend=SimpleNamespace(get_name=lambda: backend))


def mla_layer(kv_cache_dtype: str):
    return SimpleNamespace(kv_b_proj=SimpleNamespace(weight=torch.zeros(4, 4)), qk_nope_head_dim=64,
                           qk_rope_head_dim=64, v_head_dim=DV, num_heads=H, kv_lora_rank=512,
                           kv_cache_dtype=kv_cache_dtype, impl=SimpleNamespace(is_sparse=False), hisparse_cache=None,
                           use_pcp=False, layer_name=LAYER)


def unfused(kind: str):
    """vLLM's attention op into a query-dtype output, the quant op of vLLM's CPU vocabulary, the NVFP4 GEMM."""
    def fn(q, k, v, gs, dep, w, w_scale, alpha):
        if kind == "mla":
            out = torch.empty(q.shape[0], H * DV, dtype=q.dtype)
            torch.ops.vllm.unified_mla_attention_with_output(q, k, v, out, LAYER, kv_cache_dummy_dep=dep)
        else:
            out = torch.empty(q.shape[0], H, DV, dtype=q.dtype)
            torch.ops.vllm.unified_attention_with_output(q, k, v, out, LAYER, kv_cache_dummy_dep=dep)
        packed = torch.empty(q.shape[0], H * DV // 2, dtype=torch.uint8)
        scales = torch.empty(128, 4, dtype=torch.int32)
        torch.ops.fusion_pass.scaled_fp4_quant.out(out.reshape(-1, H * DV), gs, True, output=packed,
                                                   output_scale=scales)
        return torch.ops.fusion_pass.nvfp4_gemm(packed, w, scales.view(torch.float8_e4m3fn), w_scale, alpha, bf)

    if kind == "mla":
        qkv = (torch.randn(T, H, 128, dtype=bf), torch.randn(T, 512, dtype=bf), torch.randn(T, 1, 64, dtype=bf))
    else:
        qkv = (torch.randn(T, H, DV, dtype=bf), torch.randn(T, 2, DV, dtype=bf), torch.randn(T, 2, DV, dtype=bf))
    return fn, (*qkv, torch.ones(1), torch.empty(0, dtype=bf), torch.zeros(32, H * DV // 2, dtype=torch.uint8),
                torch.zeros(128, 16, dtype=torch.float8_e4m3fn), torch.ones(1))


class Stop(Exception):
    """Ends the compile right after the passes: the graph is all the test needs."""


class Recorder:
    """A post-grad pass: runs ``passes`` on Inductor's post-grad graph, keeps a copy, stops the compile."""

    def __init__(self, passes):
        self.passes, self.graph = passes, None

    def __call__(self, graph):
        self.passes(graph)
        graph.lint()
        self.graph = torch.fx.Graph()
        self.graph.output(self.graph.graph_copy(graph, {}))
        raise Stop()

    def uuid(self):
        return None


def compiled(kind: str, layer, passes):
    """Inductor's post-grad graph of the unfused block after ``passes``, compiled with ``layer`` (None: none) in
    vLLM's static forward context."""
    fn, args = unfused(kind)
    config = VllmConfig()
    config.compilation_config.splitting_ops = []
    if layer is not None:
        config.compilation_config.static_forward_context[LAYER] = layer
    rec = Recorder(passes)
    torch._dynamo.reset()
    with set_current_vllm_config(config), torch._inductor.config.patch(fx_graph_cache=False):
        with pytest.raises(Exception) as caught:
            torch.compile(fn, options={"post_grad_custom_post_pass": rec})(*args)
    assert rec.graph is not None, f"the compile did not reach the passes: {caught.value!r}"
    return rec.graph


def attention_calls(graph):
    """(op, output_scale given) of every attention call of the graph."""
    from fusion_pass.compile import matcher

    return [(matcher.wrapped_op(n)[0], n.kwargs.get("output_scale") is not None) for n in graph.nodes
            if "attention" in str(matcher.wrapped_op(n)[0])]


def run_passes(kind: str, layer):
    """The unfused graph through vLLM's (emulated) fusion and this pass. Returns (graph, the pass's report, vLLM's
    fusion's report)."""
    passes = EmulatedVllmFusionThenOurs()
    graph = compiled(kind, layer, passes)
    report = passes.report()
    return graph, report, report["emulated"]


CASES = [  # kind, layer, outcome, reason
    ("standard", lambda: standard_layer("fp8", "FLASHINFER"), "left", "quantized_kv_cache"),
    ("standard", lambda: standard_layer("fp8_e4m3", "FLASH_ATTN"), "left", "quantized_kv_cache"),
    ("mla", lambda: mla_layer("fp8"), "left", "quantized_kv_cache"),
    ("standard", lambda: standard_layer("auto", "TRITON_ATTN"), "left", "no_decode_adapter:TRITON_ATTN"),
    ("standard", lambda: standard_layer("auto", "FLASHINFER"), "retargeted", None),  # FLASHINFER has an adapter
    ("standard", lambda: standard_layer("auto", "FLASH_ATTN", sliding_window=(127, 0)), "left",
     "layer_not_supported"),
    ("standard", lambda: standard_layer("auto", "FLASH_ATTN"), "retargeted", None),
    ("standard", lambda: standard_layer("bfloat16", "CPU_ATTN"), "retargeted", None),
    ("mla", lambda: mla_layer("auto"), "retargeted", None),
    ("standard", lambda: None, "retargeted", None),  # no such layer in the static forward context: the guard decides
]


@pytest.mark.parametrize("kind,layer,outcome,reason", CASES)
def test_vllms_rewrite_is_left_where_the_fused_call_cannot_run_and_retargeted_elsewhere(kind, layer, outcome, reason,
                                                                                       caplog):
    caplog.set_level(logging.INFO, logger="vllm.fusion_pass")
    graph_after, report, emulated = run_passes(kind, layer())
    assert emulated["rewritten"] == 1  # vLLM's form: its attention op given the quant's buffers, no quant
    pattern = ("mla_" if kind == "mla" else "") + "attention_nvfp4_prequantized"
    vllm_op = torch.ops.vllm.unified_mla_attention_with_output if kind == "mla" else \
        torch.ops.vllm.unified_attention_with_output
    fused_op = torch.ops.fusion_pass.vllm_mla_attention_nvfp4 if kind == "mla" else \
        torch.ops.fusion_pass.vllm_attention_nvfp4
    (graph,) = report["per_graph"]
    log = "\n".join(r.getMessage() for r in caplog.records)
    if outcome == "left":
        assert graph["layers"] == [{"layer": LAYER, "pattern": pattern, "outcome": "left", "reason": reason}]
        assert (report["candidates"], report["rewritten"], report["retargeted"]) == (1, 0, 0)
        assert report["left"] == {reason: 1} and report["refused"] == {}
        assert attention_calls(graph_after) == [(vllm_op.default, True)]  # vLLM's call as its fusion wrote it
        assert f"1 candidates, 0 rewritten, left quantized: {reason}=1, refused: none" in log
        assert f"{LAYER} ({pattern}): left as vLLM's fuse_attn_quant rewrote it ({reason}: " in log
        if reason == "quantized_kv_cache":
            assert f"KV cache dtype {layer().kv_cache_dtype!r}" in log
    else:
        assert graph["layers"] == [{"layer": LAYER, "pattern": pattern, "outcome": "retargeted"}]
        assert (report["candidates"], report["rewritten"], report["retargeted"], report["left"]) == (1, 1, 1, {})
        assert attention_calls(graph_after) == [(fused_op.default, True)]
        assert "1 rewritten (1 retargeted), refused: none" in log
        found = "KV cache dtype" if layer() is not None else "layer not found while compiling"
        assert f"{LAYER} ({pattern}): vLLM's fuse_attn_quant rewrite retargeted to the fused op ({found}" in log


def test_an_unfused_graph_is_rewritten_whatever_the_kv_cache():
    """Without vLLM's fusion the pass rewrites attention + quant as always (a layer the guard refuses falls back
    at run time, byte-equal to the unfused graph): what is left is only a rewrite vLLM made."""
    from fusion_pass.vllm import FusionPassForVllm

    ours = FusionPassForVllm()
    graph = compiled("standard", standard_layer("fp8", "FLASHINFER"), ours)
    assert ours.report()["per_graph"][0]["layers"] == [
        {"layer": LAYER, "pattern": "attention_nvfp4_quant", "outcome": "rewritten"}]
    assert attention_calls(graph) == [(torch.ops.fusion_pass.vllm_attention_nvfp4.default, True)]


def test_the_layer_is_found_through_the_forward_context_too(monkeypatch):
    """While vLLM runs a forward (where its compiles happen) the forward context holds the layers by name."""
    import vllm.config
    import vllm.forward_context as fc

    layer = standard_layer("fp8", "FLASHINFER")
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: None)
    assert layer_check.leave_quantized(LAYER) is None  # nothing to read: retargeted
    monkeypatch.setattr(fc, "_forward_context", SimpleNamespace(no_compile_layers={LAYER: layer}))
    assert layer_check.compile_time_layer(LAYER) is layer
    assert layer_check.leave_quantized(LAYER) == "quantized_kv_cache"
    assert layer_check.leave_quantized(object()) is None  # a call without a layer name
