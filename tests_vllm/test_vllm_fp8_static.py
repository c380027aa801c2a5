"""Static per-tensor FP8 in the vLLM integration without an engine: the vocabulary's binding, the pass on vLLM graphs
(vLLM's attention ops -> ``static_scaled_fp8_quant`` -> ``torch._scaled_mm``, the GEMM form present on vLLM's CPU
build) and its refusals, and the run-time op's FP8 paths (the stand-in MLA layer of test_vllm_attention_op.py): the
guard's decision for the format, decode rows byte-equal to the unfused graph, fused prefill rows within the bound,
the exact fallback, the checks on the buffers. (The engine test: test_vllm_fp8_engine.py.)"""

import pytest
import torch

import fusion_pass_vllm
from fusion_pass import fp8, formats
from fusion_pass.runtime import backends
from fusion_pass.runtime.fp8_rows import NATIVE_FORM, OP_FORM
from fusion_pass.vllm import FusionPassForVllm
from fusion_pass.vllm.runtime import attention_op, fp8_static_rows, fused_rows, guard
from test_vllm_attention_op import DV, H, K, StandInMLA, VllmStructure, batch, expected_prefill
from test_vllm_pass import _attention_nodes, _trace

FP8 = torch.float8_e4m3fn
LAYER = "model.layers.0.self_attn.attn"
T, N = 8, 32
SCALE = torch.tensor([0.01])
INV = torch.nextafter(fp8.reciprocal(SCALE), torch.tensor([float("inf")]))  # not the IEEE quotient: the graph's own


def test_the_vocabulary_binds_static_fp8_with_this_builds_quant_op():
    from fusion_pass.vllm.compile.vocabulary import VLLM_FP8_STATIC_GEMM_FORMS, vllm_vocabulary

    fusion_pass_vllm.PASS.fusion()
    vocab = vllm_vocabulary()
    c_op = getattr(getattr(torch.ops, "_C", None), "static_scaled_fp8_quant", None)
    if c_op is not None and fp8_static_rows.fits(c_op.default):  # a CUDA build
        assert vocab.fp8_static_quant is c_op.default
    else:  # vLLM's CPU build: its _C::static_scaled_fp8_quant takes no argument (a placeholder), not bound
        assert vocab.fp8_static_quant is torch.ops.fusion_pass.static_scaled_fp8_quant.default
    assert vocab.fp8_static_quant is fp8_static_rows.quant_op() is fused_rows.fp8_static_quant_op()
    assert vocab.fp8_static_quant not in vocab.other_quants  # bound as a format, no longer "another format"
    present = [name for name, (ns, op, _, _, _), _ in VLLM_FP8_STATIC_GEMM_FORMS if hasattr(getattr(torch.ops, ns), op)]
    assert [g.name for g in vocab.fp8_static_gemms] == ["aten::_scaled_mm"] + [f"vllm:{n}" for n in present]
    assert all(g.format == "fp8_static" for g in vocab.fp8_static_gemms)
    assert vocab.quant_form("fp8_static").op is vocab.fp8_static_quant


def _vllm_attention(kind: str, q, k, v):
    """vLLM's attention op of ``kind`` into a new bf16 output (``[T, H*Dv]`` for MLA, ``[T, H, Dv]`` otherwise)."""
    if kind == "mla":
        out = torch.empty(q.shape[0], H * DV, dtype=torch.bfloat16)
        torch.ops.vllm.unified_mla_attention_with_output(q, k, v, out, LAYER)
    else:
        out = torch.empty(q.shape[0], H, DV, dtype=torch.bfloat16)
        torch.ops.vllm.unified_attention_with_output(q, k, v, out, LAYER)
    return out


def _graph(kind: str, gemm_scale_is_the_quants: bool = True, group_shape=None, other_reader: bool = False):
    """vLLM's attention op -> view -> static FP8 quant -> torch._scaled_mm (the o_proj of
    ``PerTensorTorchFP8ScaledMMLinearKernel``), traced as vLLM's graphs are (functionalized)."""
    quant = fp8_static_rows.quant_op()

    def fn(q, k, v, scale, w, w_scale, other_scale):
        out = _vllm_attention(kind, q, k, v)
        flat = out.reshape(q.shape[0], H * DV)
        a = torch.empty(q.shape[0], H * DV, dtype=FP8)
        quant(a, flat, scale, group_shape)
        y = torch._scaled_mm(a, w, scale_a=scale if gemm_scale_is_the_quants else other_scale, scale_b=w_scale,
                             out_dtype=torch.bfloat16)
        return (y, flat.float().sum()) if other_reader else y

    return _traced(fn, kind)


def _traced(fn, kind: str):
    """``fn(q, k, v, scale, w, w_scale, other_scale)`` traced as vLLM's graphs are (functionalized, v2) on inputs of
    the ``kind`` of attention."""
    bf = torch.bfloat16
    if kind == "mla":
        qkv = (torch.randn(T, H, 128, dtype=bf), torch.randn(T, 512, dtype=bf), torch.randn(T, 1, 64, dtype=bf))
    else:
        qkv = (torch.randn(T, H, DV, dtype=bf), torch.randn(T, 2, DV, dtype=bf), torch.randn(T, 2, DV, dtype=bf))
    w = torch.randn(N, H * DV).to(FP8).t()
    gm = _trace(fn, (*qkv, SCALE, w, torch.ones(1), torch.ones(1)), "v2")
    gm.graph.eliminate_dead_code()  # make_fx keeps dead views; Inductor's post-grad graphs have none
    return gm


@pytest.mark.parametrize("kind", ["mla", "standard"])
def test_attention_static_fp8_quant_scaled_mm_is_rewritten_to_the_fused_op(kind):
    gm = _graph(kind)
    fusion = FusionPassForVllm().fusion()
    fusion(gm.graph)
    report = fusion.graphs[-1]
    pattern = ("mla_" if kind == "mla" else "") + "attention_fp8_static_quant"
    assert (report.candidates, report.rewritten) == (1, 1), report.line()
    assert report.layers == [{"layer": LAYER, "pattern": pattern, "outcome": "rewritten"}]
    ((node, op),) = _attention_nodes(gm)
    ours = torch.ops.fusion_pass.vllm_mla_attention_nvfp4 if kind == "mla" else torch.ops.fusion_pass.vllm_attention_nvfp4
    assert op is ours.default
    kwargs = node.kwargs
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert kwargs["output_scale"] is placeholders[3]  # the quant's static scale
    assert kwargs.get("output_block_scale") is None
    targets = [n.target for n in gm.graph.nodes]
    assert fp8_static_rows.quant_op() not in targets  # the quant is gone: the GEMM reads the fused op's FP8 output
    (gemm,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten._scaled_mm.default]
    assert gemm.args[0].args[0] is node and gemm.args[0].meta["val"].dtype == FP8
    assert gemm.args[2] is placeholders[3]
    gm.graph.lint()


@pytest.mark.parametrize("graph, reason", [
    (dict(gemm_scale_is_the_quants=False), "no_fp8_static_gemm_consumer"),  # the GEMM reads another scale
    (dict(group_shape=[1, 128]), "fp8_static_quant_is_grouped"),
    (dict(other_reader=True), "bf16_output_has_other_users"),  # the query-dtype output is read beside the quant
])
def test_static_fp8_chains_the_fused_call_would_not_write_are_refused(graph, reason):
    gm = _graph("standard", **graph)
    before = [n.target for n in gm.graph.nodes]
    fusion = FusionPassForVllm().fusion()
    fusion(gm.graph)
    report = fusion.graphs[-1]
    assert report.rewritten == 0 and sum(report.refused.values()) == 1, report.line()
    if reason is not None:
        assert report.refused == {reason: 1}, report.refused
    assert [n.target for n in gm.graph.nodes] == before  # untouched


# ---------------------------------------------------------------- the run-time op, static FP8


def _fp8_buffer(n: int, fill: int = 0x77):
    return torch.full((n, K), fill, dtype=torch.uint8).view(FP8)


def _quantized(x):
    """The unfused graph's bytes: vLLM's static_scaled_fp8_quant of ``x`` (query dtype) under :data:`SCALE`."""
    return fp8.quantize_static(x, fp8.reciprocal(SCALE))


@pytest.mark.parametrize("form", ["op", "native"])
@pytest.mark.parametrize("decode,query_lens,context_lens", [(3, [5, 9], [0, 0]), (2, [7, 4], [40, 0]), (0, [4], [48])])
def test_mla_fp8_rows_decode_exact_prefill_fused_padding_zeroed(decode, query_lens, context_lens, form):
    """Both forms: the op form under the scale; the native form under the graph's inverse, multiplied as it is."""
    quant, scale = (OP_FORM, SCALE) if form == "op" else (NATIVE_FORM, INV)
    layer = StandInMLA()
    inputs, md, kv_cache = batch(decode, query_lens, context_lens)
    n = md.num_actual_tokens
    out = _fp8_buffer(n + 5)
    fused_rows._run_fused_mla(backends.get_backend("reference"), md, layer, kv_cache, inputs, out, scale, None,
                              None, formats.FP8_STATIC, quant)
    assert layer.forward_impl_rows == ([decode] if decode else [])
    codes = out.view(torch.uint8)
    want_decode = fp8.quantize_static(layer.decode_output(inputs[0][:decode]), quant.inverse(scale), nan=quant.nan)
    assert torch.equal(codes[:decode], want_decode.view(torch.uint8))
    exact = expected_prefill(layer, inputs, md, kv_cache)
    got = fp8.dequantize_static(out[decode:n], SCALE)
    assert exact.abs().max() > 0
    assert ((got - exact).abs() <= fp8.static_error_bound(exact, SCALE)).all()
    assert torch.equal(codes[n:], torch.zeros_like(codes[n:]))


def test_the_guard_decides_fp8_calls_in_their_format():
    inputs, md, kv_cache = batch(3, [5, 9], [0, 40])
    decision = guard.decide("stand_in.attn", inputs[0], md, VllmStructure(), kv_cache, formats.FP8_STATIC)
    assert (decision.path, decision.backend, decision.format) == ("fused", "reference", "fp8_static")
    assert decision.post_quantized == {"decode_tokens": 3} and not decision.one_call
    _, decode_only, _ = batch(4, [], [])
    decision = guard.decide("stand_in.attn", inputs[0], decode_only, VllmStructure(), kv_cache, formats.FP8_STATIC)
    assert (decision.reason, decision.format) == ("decode_tokens", "fp8_static")
    assert guard.decide("stand_in.attn", inputs[0], None, VllmStructure(), kv_cache, formats.FP8_STATIC).format == \
        "fp8_static"
    # NVFP4 decisions of the same step are their own
    assert guard.decide("stand_in.attn", inputs[0], md, VllmStructure(), kv_cache).format == "nvfp4"


def test_the_op_counts_fp8_calls_under_the_format_and_falls_back_exactly(monkeypatch):
    from fusion_pass.runtime import counters

    layer = VllmStructure()
    inputs, md, kv_cache = batch(0, [6], [0])
    monkeypatch.setattr(attention_op, "_context", lambda name: (md, layer, kv_cache))
    counters.reset_counters()
    out = _fp8_buffer(6)
    attention_op._run(None, inputs, out, "stand_in.attn", SCALE, None, (), None)
    snap = counters.counters(output_format="fp8_static")
    assert snap["fused_by_backend"] == {"reference": 1} and snap["tokens"]["prefill_fused"] == 6
    assert counters.counters()["fused_by_backend"] == {"reference (fp8_static)": 1}
    # the exact fallback: vLLM's op into the query dtype, then the unfused graph's quant op
    values = torch.randn(6, K).to(torch.bfloat16)
    fallback = _fp8_buffer(6)
    attention_op._run_unfused(lambda q, k, v, target, *rest: target.copy_(values), inputs, fallback, "stand_in.attn",
                              SCALE, None, output_format=formats.FP8_STATIC)
    assert torch.equal(fallback.view(torch.uint8), _quantized(values).view(torch.uint8))


@pytest.mark.parametrize("change, says", [
    (dict(block_scale=torch.zeros(128, 4, dtype=torch.int32)), "output_block_scale must be None"),
    (dict(scale=torch.ones(2)), "output_scale of a static FP8 output must be one float32 value"),
    (dict(scale=torch.ones(1, dtype=torch.float16)), "output_scale of a static FP8 output must be one float32"),
    (dict(strided=True), r"output \(float8_e4m3fn\) must be contiguous"),
    (dict(scale=None), "output_scale is None"),
])
def test_bad_fp8_buffers_are_refused_before_anything_is_written(monkeypatch, change, says):
    inputs, md, kv_cache = batch(0, [6], [0])
    monkeypatch.setattr(attention_op, "_context", lambda name: pytest.fail("read the context before checking"))
    out = torch.full((6, 2 * K), 0x77, dtype=torch.uint8).view(FP8)
    out = out[:, ::2] if change.get("strided") else out[:, :K].contiguous()
    before = out.view(torch.uint8).clone() if out.is_contiguous() else out.float().clone()
    with pytest.raises(ValueError, match=says):
        attention_op._run(None, inputs, out, "stand_in.attn", change.get("scale", SCALE),
                          change.get("block_scale"), (), None)
    after = out.view(torch.uint8) if out.is_contiguous() else out.float()
    assert torch.equal(after, before)


# ---------------------------------------------------------------- the native form (vLLM's QuantFP8, no quant op)


def _native_graph(kind: str, bound: float = 448.0):
    """vLLM's attention op -> view -> QuantFP8's native form (float32, ``* reciprocal(scale)``, clamp, float8) ->
    torch._scaled_mm, traced as vLLM's graphs are."""

    def fn(q, k, v, scale, w, w_scale, other_scale):
        out = _vllm_attention(kind, q, k, v)
        x = out.reshape(q.shape[0], H * DV).to(torch.float32) * scale.reciprocal()
        a = x.clamp(-bound, bound).to(FP8)
        return torch._scaled_mm(a, w, scale_a=scale, scale_b=w_scale, out_dtype=torch.bfloat16)

    return _traced(fn, kind)


@pytest.mark.parametrize("kind", ["mla", "standard"])
def test_the_native_form_is_rewritten_to_the_fused_op_with_the_graphs_reciprocal(kind):
    gm = _native_graph(kind)
    fusion = FusionPassForVllm().fusion()
    fusion(gm.graph)
    report = fusion.graphs[-1]
    pattern = ("mla_" if kind == "mla" else "") + "attention_fp8_static_native"
    assert report.layers == [{"layer": LAYER, "pattern": pattern, "outcome": "rewritten"}], report.line()
    ((node, op),) = _attention_nodes(gm)
    ours = torch.ops.fusion_pass.vllm_mla_attention_nvfp4 if kind == "mla" else torch.ops.fusion_pass.vllm_attention_nvfp4
    assert op is ours.default
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inv = node.kwargs["output_inv_scale"]
    assert inv.target is torch.ops.aten.reciprocal.default and inv.args[0] is placeholders[3]
    assert node.kwargs.get("output_scale") is None and node.kwargs.get("output_block_scale") is None
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.prims.convert_element_type.default
                and n.args[1] == FP8], "the native quant is gone"
    (gemm,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten._scaled_mm.default]
    assert gemm.args[0].args[0] is node and gemm.args[2] is placeholders[3]
    gm.graph.lint()


def test_a_native_form_with_other_clamp_bounds_is_refused():
    gm = _native_graph("standard", bound=400.0)
    fusion = FusionPassForVllm().fusion()
    fusion(gm.graph)
    assert fusion.graphs[-1].refused == {"fp8_native_quant_not_clamped_to_448": 1}


def test_the_op_takes_the_native_form_and_its_fallback_keeps_its_arithmetic(monkeypatch):
    from fusion_pass.runtime import counters

    layer = VllmStructure()
    inputs, md, kv_cache = batch(0, [6], [0])
    monkeypatch.setattr(attention_op, "_context", lambda name: (md, layer, kv_cache))
    counters.reset_counters()
    attention_op._run(None, inputs, _fp8_buffer(6), "stand_in.attn", None, None, (), None, output_inv_scale=INV)
    assert counters.counters()["fused_by_backend"] == {"reference (fp8_static)": 1}
    values = torch.randn(6, K).to(torch.bfloat16)
    values[2, 3] = float("nan")
    fallback = _fp8_buffer(6)
    attention_op._run_unfused(lambda q, k, v, target, *rest: target.copy_(values), inputs, fallback, "stand_in.attn",
                              INV, None, output_format=formats.FP8_STATIC, fp8_quant=NATIVE_FORM)
    want = fp8.quantize_static(values, INV, nan=fp8.NaNRule.NAN).view(torch.uint8)
    assert torch.equal(fallback.view(torch.uint8), want) and int(want[2, 3]) == 0x7F


@pytest.mark.parametrize("change, says", [
    (dict(scale=SCALE), "output_scale must be None with output_inv_scale"),
    (dict(block_scale=torch.zeros(128, 4, dtype=torch.int32)), "output_block_scale must be None with output_inv"),
    (dict(inv=torch.ones(2)), "output_inv_scale of a static FP8 output must be one float32 value"),
    (dict(out=torch.zeros(6, K // 2, dtype=torch.uint8)), "output must be float8_e4m3fn with output_inv_scale"),
])
def test_bad_native_form_buffers_are_refused_before_anything_is_written(monkeypatch, change, says):
    inputs, _, _ = batch(0, [6], [0])
    monkeypatch.setattr(attention_op, "_context", lambda name: pytest.fail("read the context before checking"))
    out = change.get("out", _fp8_buffer(6))
    before = out.view(torch.uint8).clone()
    with pytest.raises(ValueError, match=says):
        attention_op._run(None, inputs, out, "stand_in.attn", change.get("scale"), change.get("block_scale"), (),
                          None, output_inv_scale=change.get("inv", INV))
    assert torch.equal(out.view(torch.uint8), before)
