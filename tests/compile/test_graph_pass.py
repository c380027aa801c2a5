"""The fusion pass on real post-grad graphs: compile with torch.compile, run the pass, inspect the nodes.

Every graph here comes out of a real ``torch.compile`` (Dynamo -> AOT autograd
-> Inductor's post-grad passes); the pass is installed as Inductor's
``post_grad_custom_post_pass`` wrapped in :class:`Recorder`, which snapshots
the graph right before and right after the pass. Both functionalized forms of
the mutating ops are covered (``enable_auto_functionalized_v2`` False: vLLM's
``auto_functionalized``; True: torch.compile's default ``auto_functionalized_v2``).

The graph inspection below is written against the graph itself (targets,
kwargs, placeholders), not through :mod:`fusion_pass.compile.matcher`, so that the
matcher is checked, not reused.
"""

from __future__ import annotations

import itertools
import json
import logging
import operator
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import fusion_pass
from fusion_pass import nvfp4, runtime
from fusion_pass.runtime import counters, settings
from fusion_pass.demo import layers, models, workload as demo
from fusion_pass.compile.graph_pass import FusionPass
from fusion_pass.ops import scaled_fp4_quant
from fusion_pass.patterns import PATTERNS
from fusion_pass.runtime import BatchSpec, RequestSpec

OPS = torch.ops.fusion_pass
aten = torch.ops.aten
HOPS = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)
ATTENTION_OPS = (OPS.mla_attention_with_output.default, OPS.attention_with_output.default)
QUANT = OPS.scaled_fp4_quant.out
GEMM = OPS.nvfp4_gemm.default
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default)
REPO = Path(__file__).resolve().parents[2]

_names = itertools.count()


def unique(prefix: str) -> str:
    """A layer-name prefix no other test (or earlier parametrization) uses."""
    return f"test_fusion_pass.{prefix}{next(_names)}"


# ---------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def _clean_compile_state(monkeypatch):
    """Fresh Dynamo caches, no FX graph cache (a cache hit skips the post-grad passes), the reference
    backend pinned, zeroed guard counters."""
    monkeypatch.delenv(settings.BACKEND_ENV, raising=False)
    monkeypatch.delenv("FUSION_PASS_DUMP", raising=False)
    torch._dynamo.reset()
    counters.reset_counters()
    with inductor_config.patch(fx_graph_cache=False), settings.use_backend("reference"):
        yield
    runtime.clear_kv_caches()
    counters.reset_counters()
    torch._dynamo.reset()


@pytest.fixture(params=["v1", "v2"])
def form(request):
    """Both functionalized forms: ``auto_functionalized`` (v1, vLLM's) and ``auto_functionalized_v2``."""
    with inductor_config.patch(enable_auto_functionalized_v2=request.param == "v2"):
        yield request.param


# ---------------------------------------------------------------- recording the post-grad graph


def snapshot(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph`` (nodes, kwargs, meta): Inductor keeps lowering the original after the pass."""
    copy = torch.fx.Graph()
    out = copy.graph_copy(graph, {})
    copy.output(out)
    return copy


class Recorder(CustomGraphPass):
    """Runs ``fusion`` (a FusionPass, or None for an unfused compile) and keeps each graph before and after."""

    def __init__(self, fusion: FusionPass | None):
        self.fusion = fusion
        self.before: list[torch.fx.Graph] = []
        self.after: list[torch.fx.Graph] = []
        self.code: list[str] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.before.append(snapshot(graph))
        if self.fusion is not None:
            self.fusion(graph)
        self.after.append(snapshot(graph))
        self.code.append(graph.python_code("self").src)

    def uuid(self):
        inner = self.fusion.uuid() if self.fusion is not None else "unfused"
        return f"{inner}:test-recorder"


def compile_with(fn, recorder: Recorder):
    return torch.compile(fn, options={"post_grad_custom_post_pass": recorder, "fx_graph_cache": False})


# ---------------------------------------------------------------- graph inspection


def wrapped(node):
    """The op inside an auto_functionalized[_v2] node, else None."""
    if node.op == "call_function" and node.target in HOPS:
        return node.args[0]
    return None


def is_v2(node) -> bool:
    return node.target is torch.ops.higher_order.auto_functionalized_v2


def attention_nodes(graph):
    return [n for n in graph.nodes if wrapped(n) in ATTENTION_OPS]


def quant_nodes(graph):
    return [n for n in graph.nodes if wrapped(n) is QUANT or n.target is QUANT]


def gemm_nodes(graph):
    return [n for n in graph.nodes if n.target is GEMM]


def buffer(node, arg):
    """The node passed as mutable ``arg`` of an auto_functionalized[_v2] node (its base in v2)."""
    if not is_v2(node):
        return node.kwargs.get(arg)
    index = node.kwargs.get(f"_{arg}_base_index")
    return None if index is None else node.kwargs["_all_bases"][index]


def result_index(node, arg):
    """Index of the getitem carrying ``arg`` after the mutation (both ops mutate two args)."""
    if not is_v2(node):
        mutable = [a.name for a in wrapped(node)._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        return 1 + mutable.index(arg)
    return 1 + node.kwargs[f"_{arg}_base_index"]


def is_empty(node, dtype) -> bool:
    return (isinstance(node, torch.fx.Node) and node.target is aten.empty.memory_format
            and node.kwargs.get("dtype") == dtype)


def feeds(node):
    """Users of ``node`` seen through view ops."""
    seen = []
    for user in node.users:
        if user.target in VIEWS:
            seen.extend(feeds(user))
        else:
            seen.append(user)
    return seen


def quant_scale_by_layer(graph) -> dict[str, str]:
    """layer_name -> name of the placeholder the layer's quant reads as its global scale (before the pass)."""
    scales = {}
    for node in attention_nodes(graph):
        for user in node.users:
            for consumer in feeds(user):
                if wrapped(consumer) is QUANT:
                    scales[node.kwargs["layer_name"]] = consumer.kwargs["input_scale"].name
    return scales


def bf16_buffers_of_attention(graph):
    """bf16 ``empty`` buffers passed (directly or through views) to an attention call."""
    return [n for n in graph.nodes if is_empty(n, torch.bfloat16)
            and any(wrapped(u) in ATTENTION_OPS for u in feeds(n))]


def assert_fused(rec: Recorder, n: int, form: str, graph_index: int = 0) -> None:
    """The graph after the pass has n NVFP4-output attention calls feeding the GEMMs, and no quant."""
    before, after = rec.before[graph_index], rec.after[graph_index]
    code = rec.code[graph_index]
    scales = quant_scale_by_layer(before)
    assert len(scales) == n, f"expected {n} attention -> quant chains before the pass, got {scales}"
    assert len(bf16_buffers_of_attention(before)) == n

    assert quant_nodes(after) == [], code
    attention = attention_nodes(after)
    assert len(attention) == n, code
    assert bf16_buffers_of_attention(after) == [], code
    placeholders = {p.name: p for p in after.nodes if p.op == "placeholder"}
    for node in attention:
        assert is_v2(node) == (form == "v2"), node.format_node()
        layer = node.kwargs["layer_name"]
        scale = node.kwargs["output_scale"]  # not mutable: a plain kwarg in both forms
        assert scale is not None and scale.op == "placeholder", node.format_node()
        assert scale.name == scales[layer] and placeholders[scale.name] is scale
        if form == "v1":
            assert "output_block_scale" in node.kwargs
        else:
            assert node.kwargs.get("_output_block_scale_base_index") is not None, node.format_node()
            assert node.kwargs.get("_output_size") is None  # the bases are the quant's own buffers
        assert is_empty(buffer(node, "output_block_scale"), torch.int32), node.format_node()
        assert is_empty(buffer(node, "output"), torch.uint8), node.format_node()

    gemms = gemm_nodes(after)
    assert len(gemms) == n, code
    for gemm in gemms:
        a, block_scale_a = gemm.args[0], gemm.args[2]
        assert a.target is operator.getitem and a.args[0] in attention, gemm.format_node()
        attn = a.args[0]
        assert a.args[1] == result_index(attn, "output")
        assert block_scale_a.target is aten.view.dtype and block_scale_a.args[1] == torch.float8_e4m3fn
        scale_item = block_scale_a.args[0]
        assert scale_item.target is operator.getitem and scale_item.args[0] is attn, gemm.format_node()
        assert scale_item.args[1] == result_index(attn, "output_block_scale")
    assert {g.args[0].args[0] for g in gemms} == set(attention)  # one GEMM per attention call


def assert_refused(rec: Recorder, fp: FusionPass, reason: str, *, candidates: int = 1, quants: int | None = None) -> None:
    """The pass left the graph alone (quant kept, attention unchanged) and counted ``reason``."""
    before, after, code = rec.before[0], rec.after[0], rec.code[0]
    assert len(attention_nodes(before)) == candidates
    assert len(quant_nodes(before)) == (candidates if quants is None else quants)
    assert len(fp.graphs) == 1
    report = fp.graphs[0]
    assert report.candidates == candidates and report.rewritten == 0, report
    assert report.refused == {reason: candidates}, report
    assert [entry["reason"] for entry in report.layers] == [reason] * candidates
    assert len(quant_nodes(after)) == len(quant_nodes(before)), code
    assert [n.format_node() for n in attention_nodes(after)] == [n.format_node() for n in attention_nodes(before)]
    assert [n.format_node() for n in gemm_nodes(after)] == [n.format_node() for n in gemm_nodes(before)]
    assert after.python_code("self").src == before.python_code("self").src


# ---------------------------------------------------------------- a small MLA layer + NVFP4 o_proj


class Block(nn.Module):
    """A registered MLA attention layer and an NVFP4 o_proj's weights, for hand-written functions."""

    def __init__(self, name: str, *, heads=2, nope=16, rope=8, v=32, lora=32, out=32, o_proj_in=None, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.heads, self.nope, self.rope, self.v, self.lora = heads, nope, rope, v, lora
        kv_b_proj = nn.Linear(lora, heads * (nope + v), bias=False)
        with torch.no_grad():
            kv_b_proj.weight.copy_(torch.randn(heads * (nope + v), lora, generator=g) * lora**-0.5)
        self.attn = layers.MLAAttention(num_heads=heads, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                                        v_head_dim=v, kv_lora_rank=lora, kv_b_proj=kv_b_proj, layer_name=name)
        width = o_proj_in or heads * v
        self.o_proj = layers.NVFP4Linear(torch.randn(out, width, generator=g) * width**-0.5, input_amax=2.0)

    @property
    def width(self) -> int:
        return self.heads * self.v

    def inputs(self, spec: BatchSpec, seed: int = 0):
        """bf16 ``q``, ``kv_c_normed``, ``k_pe`` for ``spec``, dynamic in the token count."""
        g = torch.Generator().manual_seed(seed)
        t = spec.num_tokens
        tensors = (torch.randn(t, self.heads, self.nope + self.rope, generator=g),
                   torch.randn(t, self.lora, generator=g), torch.randn(t, 1, self.rope, generator=g))
        tensors = tuple(x.to(torch.bfloat16) for x in tensors)
        for x in tensors:
            torch._dynamo.mark_dynamic(x, 0)
        return tensors

    def gemm(self, x_fp4, x_scale):
        p = self.o_proj
        return OPS.nvfp4_gemm(x_fp4, p.weight, x_scale, p.weight_scale, p.alpha, torch.bfloat16)


@pytest.fixture
def make_block():
    built = []

    def make(**kwargs):
        block = Block(unique("block"), **kwargs)
        built.append(block)
        return block

    yield make
    for block in built:
        models.release_layers(block)


def run_compiled(fn, spec: BatchSpec, *args):
    with runtime.batch(spec), torch.no_grad():
        return fn(*args)


PREFILL = BatchSpec.from_lens([9, 5])


def compile_and_run(fn, block: Block, fusion: FusionPass, spec: BatchSpec = PREFILL) -> Recorder:
    rec = Recorder(fusion)
    run_compiled(compile_with(fn, rec), spec, *block.inputs(spec))
    runtime.clear_kv_caches()
    return rec


# ---------------------------------------------------------------- positive: the demo models


def _model_batches():
    """A prefill batch, then another pure prefill with a different token count (no recompile expected)."""
    return [BatchSpec.from_lens([9, 4]), BatchSpec((RequestSpec("x", 6), RequestSpec("y", 11), RequestSpec("z", 3)))]


@pytest.mark.parametrize("model_name", ["mla", "gqa"])
def test_demo_model_attention_and_quant_become_one_nvfp4_attention_call(model_name, form):
    model = demo.build_model(model_name, tiny=True, layers=2, prefix=unique(model_name))
    hidden_size = model.norms[0].normalized_shape[0]
    try:
        fp = FusionPass()
        rec = Recorder(fp)
        compiled = compile_with(model, rec)
        for i, spec in enumerate(_model_batches()):
            positions, hidden = demo.make_inputs(spec, hidden_size, "cpu", seed=i)
            torch._dynamo.mark_dynamic(positions, 0)
            torch._dynamo.mark_dynamic(hidden, 0)
            out = run_compiled(compiled, spec, positions, hidden)
            assert out.shape == (spec.num_tokens, hidden_size) and torch.isfinite(out.float()).all()
            assert len(rec.after) == 1, "a second token count must not recompile (dynamic token count)"
    finally:
        models.release_layers(model)
    assert_fused(rec, 2, form)
    assert len(fp.graphs) == 1
    report = fp.graphs[0]
    assert (report.candidates, report.rewritten, report.refused) == (2, 2, {})
    assert [e["layer"] for e in report.layers] == [m.layer_name for m in model.modules()
                                                   if isinstance(m, (layers.Attention, layers.MLAAttention))]
    assert {e["outcome"] for e in report.layers} == {"rewritten"}
    # the rewritten calls ran the fused kernel on both pure-prefill batches, per layer
    assert counters.counters()["fused_by_backend"] == {"reference": 4}
    if model_name == "gqa" and form == "v1":
        # the standard-attention pattern crosses the [T, H, Dv] -> [T, H*Dv] view between attention and quant
        assert all(q.kwargs["input"].target in VIEWS for q in quant_nodes(rec.before[0]))


def test_pass_chained_after_another_installed_pass(form):
    class OtherPass(CustomGraphPass):
        def __init__(self):
            self.calls, self.saw_quant = 0, []

        def __call__(self, graph):
            self.calls += 1
            self.saw_quant.append(len(quant_nodes(graph)))

        def uuid(self):
            return "test_fusion_pass.OtherPass"

    other = OtherPass()
    model = demo.build_model("mla", tiny=True, layers=2, prefix=unique("chain"))
    spec = BatchSpec.from_lens([7, 5])
    positions, hidden = demo.make_inputs(spec, 256, "cpu", seed=0)
    torch._dynamo.mark_dynamic(positions, 0)
    torch._dynamo.mark_dynamic(hidden, 0)
    try:
        with inductor_config.patch(post_grad_custom_post_pass=other):
            with fusion_pass.enable() as fp:
                assert isinstance(fp, FusionPass)
                installed = inductor_config.post_grad_custom_post_pass
                assert installed is not other and installed is not fp  # chained, not replaced
                run_compiled(torch.compile(model), spec, positions, hidden)
            assert inductor_config.post_grad_custom_post_pass is other  # restored after the block
    finally:
        models.release_layers(model)
    assert other.calls == 1 and other.saw_quant == [2]  # it ran first, on the unfused graph
    assert len(fp.graphs) == 1 and fp.graphs[0].rewritten == 2
    assert counters.counters()["fused_by_backend"] == {"reference": 2}


@pytest.mark.parametrize("as_list", [False, True])
def test_enable_chains_after_a_plain_callable_or_a_list_of_passes(make_block, as_list):
    calls = []

    def other(graph):  # a plain callable: no uuid, so Inductor skips its FX graph cache
        calls.append(len(quant_nodes(graph)))

    block = make_block()

    def f(q, kv_c, k_pe):
        return block.o_proj(block.attn(q, kv_c, k_pe))

    with inductor_config.patch(post_grad_custom_post_pass=[other] if as_list else other):
        with fusion_pass.enable() as fp:
            run_compiled(torch.compile(f), PREFILL, *block.inputs(PREFILL))
    assert calls == [1]
    assert len(fp.graphs) == 1 and fp.graphs[0].rewritten == 1


def test_pattern_set_restricted_to_standard_attention_refuses_mla(form):
    model = demo.build_model("mla", tiny=True, layers=2, prefix=unique("restricted"))
    spec = BatchSpec.from_lens([6, 3])
    positions, hidden = demo.make_inputs(spec, 256, "cpu", seed=0)
    torch._dynamo.mark_dynamic(positions, 0)
    torch._dynamo.mark_dynamic(hidden, 0)
    fp = FusionPass(patterns=(PATTERNS[1],))
    rec = Recorder(fp)
    try:
        run_compiled(compile_with(model, rec), spec, positions, hidden)
    finally:
        models.release_layers(model)
    assert_refused(rec, fp, "pattern_not_enabled", candidates=2)
    assert all(entry["pattern"] is None for entry in fp.graphs[0].layers)


# ---------------------------------------------------------------- numerics through a compiled layer


def _attn_quant_gemm(block: Block):
    """MLA attention -> scaled_fp4_quant -> nvfp4_gemm, also returning the quant's outputs
    (which gives them a second user: the graph output; the GEMM still reads them)."""

    def f(q, kv_c, k_pe, gs, w, w_sf, alpha):
        out = block.attn(q, kv_c, k_pe)
        x_fp4, x_sf = scaled_fp4_quant(out, gs)
        y = OPS.nvfp4_gemm(x_fp4, w, x_sf, w_sf, alpha, torch.bfloat16)
        return y, x_fp4, x_sf

    return f


# decode requests first; each step continues the caches of the previous ones
NUMERICS_STEPS = [
    BatchSpec((RequestSpec("a", 9), RequestSpec("b", 5))),  # prefill: fused
    BatchSpec((RequestSpec("a", 1, 9), RequestSpec("c", 6))),  # mixed: prefill rows fused, decode row post-quantized
    BatchSpec((RequestSpec("b", 4, 5),)),  # chunked: fused (the reference backend handles cached context)
    BatchSpec((RequestSpec("a", 1, 10), RequestSpec("c", 1, 6))),  # decode: fallback (decode_tokens)
]


def _run_steps(fn, block: Block, gs):
    runtime.clear_kv_caches()
    p = block.o_proj
    results = [run_compiled(fn, spec, *block.inputs(spec, seed=i), gs, p.weight, p.weight_scale, p.alpha)
               for i, spec in enumerate(NUMERICS_STEPS)]
    runtime.clear_kv_caches()
    return results


def test_compiled_numerics_fused_within_bound_on_prefill_and_bytes_equal_otherwise(make_block, form):
    block = make_block()
    gs = layers.global_scale_for(1.5)

    fp = FusionPass()
    fused_rec = Recorder(fp)
    fused = _run_steps(compile_with(_attn_quant_gemm(block), fused_rec), block, gs)
    assert len(fused_rec.after) == 1, "one compiled graph serves every batch"
    assert_fused(fused_rec, 1, form)
    counts = counters.counters()
    assert (counts["fused"], counts["fused_by_backend"], counts["fallback"]) == (3, {"reference": 3},
                                                                                 {"decode_tokens": 1})
    assert counts["tokens"] == {"prefill": 24, "prefill_fused": 24, "decode_fused": 0, "post_quantized": {"decode_tokens": 3}}

    torch._dynamo.reset()
    plain_rec = Recorder(None)
    unfused = _run_steps(compile_with(_attn_quant_gemm(block), plain_rec), block, gs)
    assert len(quant_nodes(plain_rec.after[0])) == 1

    # prefill: attention quantized from float32 vs. rounded to bf16 then quantized
    spec = NUMERICS_STEPS[0]
    t = spec.num_tokens
    runtime.clear_kv_caches()
    attn32 = block.attn.impl.forward(*block.inputs(spec, seed=0), spec).reshape(t, -1)
    runtime.clear_kv_caches()
    attn16 = attn32.to(torch.bfloat16).float()
    (_, fused_fp4, fused_sf), (_, plain_fp4, plain_sf) = fused[0], unfused[0]
    assert fused_fp4.shape == plain_fp4.shape == (t, block.width // 2) and fused_fp4.dtype == torch.uint8
    assert fused_sf.dtype == plain_sf.dtype == torch.float8_e4m3fn
    fused_hat = nvfp4.dequantize(fused_fp4, fused_sf, gs, m=t)
    plain_hat = nvfp4.dequantize(plain_fp4, plain_sf, gs, m=t)
    bound = nvfp4.error_bound(attn32, gs) + nvfp4.error_bound(attn16, gs) + (attn32 - attn16).abs()
    assert ((fused_hat - plain_hat).abs() <= bound).all()
    # and each is NVFP4 of the attention it was given
    assert ((fused_hat - attn32).abs() <= nvfp4.error_bound(attn32, gs)).all()
    assert torch.equal(plain_fp4, nvfp4.quantize(attn16, gs)[0])

    # mixed / chunked: decode rows byte-equal to the unfused graph, prefill rows within the requantization
    # bound; decode: the guard falls back to the exact unfused computation
    from fusion_pass.demo.workload import requantization_bound, rows_equal

    for step, (spec, got, want) in enumerate(zip(NUMERICS_STEPS[1:], fused[1:], unfused[1:]), start=1):
        y, x_fp4, x_sf = got
        y_ref, x_fp4_ref, x_sf_ref = want
        d, t = spec.num_decode_tokens, spec.num_tokens
        assert rows_equal([(x_fp4, x_sf)], [(x_fp4_ref, x_sf_ref)], d), f"step {step} ({spec.kind}): decode rows"
        if d == t:
            assert torch.equal(x_fp4, x_fp4_ref), f"step {step} ({spec.kind}): packed bytes differ"
            assert torch.equal(x_sf.view(torch.uint8), x_sf_ref.view(torch.uint8)), f"step {step}: scales differ"
            assert torch.equal(y, y_ref), f"step {step}: GEMM output differs"
            continue
        got_hat = nvfp4.dequantize(x_fp4, x_sf, gs, m=t)
        want_hat = nvfp4.dequantize(x_fp4_ref, x_sf_ref, gs, m=t)
        assert ((got_hat - want_hat).abs() <= requantization_bound(want_hat, gs))[d:].all(), f"step {step}"
        assert not torch.equal(x_fp4[d:], x_fp4_ref[d:]), f"step {step}: prefill rows should be quantized from fp32"


# ---------------------------------------------------------------- negative: refusals on real graphs


def test_refused_when_bf16_output_has_another_user(make_block, form):
    block = make_block()

    def f(q, kv_c, k_pe):
        out = block.attn(q, kv_c, k_pe)
        x_fp4, x_sf = scaled_fp4_quant(out, block.o_proj.input_global_scale)
        return block.gemm(x_fp4, x_sf), out

    fp = FusionPass()
    rec = compile_and_run(f, block, fp)
    assert_refused(rec, fp, "bf16_output_has_other_users")


def test_refused_when_quant_reads_a_slice(make_block, form):
    block = make_block(o_proj_in=32)  # width 64, the quant reads the first 32 columns
    half = block.width // 2
    assert half % 16 == 0

    def f(q, kv_c, k_pe):
        out = block.attn(q, kv_c, k_pe)
        x_fp4, x_sf = scaled_fp4_quant(out[:, :half], block.o_proj.input_global_scale)
        return block.gemm(x_fp4, x_sf)

    fp = FusionPass()
    rec = compile_and_run(f, block, fp)
    assert_refused(rec, fp, "quant_reads_slice")


def test_refused_when_v_head_dim_is_not_a_multiple_of_16(make_block, form):
    block = make_block(heads=2, v=8)  # H * Dv = 16: the quant is fine, a head's tile is not
    assert block.width % 16 == 0

    def f(q, kv_c, k_pe):
        out = block.attn(q, kv_c, k_pe)
        x_fp4, x_sf = scaled_fp4_quant(out, block.o_proj.input_global_scale)
        return block.gemm(x_fp4, x_sf)

    fp = FusionPass()
    rec = compile_and_run(f, block, fp)
    assert_refused(rec, fp, "v_head_dim_not_multiple_of_16")


def test_refused_when_attention_is_already_quantized(make_block, form):
    block = make_block()
    _, cols = nvfp4.scale_shape(PREFILL.num_tokens, block.width)

    def f(q, kv_c, k_pe):
        t = q.shape[0]
        out = torch.empty(t, block.width // 2, dtype=torch.uint8)
        sf = torch.empty((t + 127) // 128 * 128, cols // 4, dtype=torch.int32)
        OPS.mla_attention_with_output(q, kv_c, k_pe, out, block.attn.layer_name,
                                      block.o_proj.input_global_scale, sf)
        return block.gemm(out, sf.view(torch.float8_e4m3fn))

    fp = FusionPass()
    rec = compile_and_run(f, block, fp)
    assert_refused(rec, fp, "attention_already_quantized", quants=0)
    assert counters.counters()["fused"] == 1  # the op's own NVFP4 path ran, guarded


def test_refused_when_quant_scales_are_not_swizzled(make_block, form):
    # 128 tokens and K/16 = 4: the linear scales [128, 4] have the swizzled buffer's size, so the
    # GEMM runs on them (their meaning is wrong, the point is that the pass must not fuse)
    block = make_block()
    assert block.width // 16 == 4
    spec = BatchSpec.from_lens([100, 28])

    def f(q, kv_c, k_pe):
        out = block.attn(q, kv_c, k_pe)
        x_fp4, x_sf = scaled_fp4_quant(out, block.o_proj.input_global_scale, is_sf_swizzled_layout=False)
        return block.gemm(x_fp4, x_sf)

    fp = FusionPass()
    rec = compile_and_run(f, block, fp, spec)
    assert_refused(rec, fp, "quant_scales_not_swizzled")


def test_refused_when_quant_is_another_format(make_block, form):
    block = make_block()

    def f(q, kv_c, k_pe):
        out = block.attn(q, kv_c, k_pe)
        result = torch.empty(out.shape, dtype=torch.float8_e4m3fn)
        torch.ops.fusion_pass.static_scaled_fp8_quant(result, out, torch.tensor(0.05))
        return result.float()

    nvfp4_only = FusionPass(patterns=[p for p in PATTERNS if p.format == "nvfp4"])
    compile_and_run(f, block, nvfp4_only)
    assert nvfp4_only.report()["rewritten"] == 0
    assert nvfp4_only.report()["refused"] == {"quant_is_another_format": 1}
    torch._dynamo.reset()
    every = FusionPass()  # the FP8 entry's own refusal says more than the NVFP4 entries'
    compile_and_run(f, block, every)
    assert every.report()["rewritten"] == 0
    assert every.report()["refused"] == {"no_fp8_static_gemm_consumer": 1}


# ---------------------------------------------------------------- construction, uuid, enable()


def test_empty_pattern_set_is_rejected():
    with pytest.raises(ValueError, match="at least one pattern"):
        FusionPass(patterns=())


def test_uuid_changes_with_the_pattern_set_and_is_stable():
    default, again = FusionPass().uuid(), FusionPass().uuid()
    mla_only = FusionPass(patterns=(PATTERNS[0],)).uuid()
    assert isinstance(default, str) and isinstance(mla_only, str)
    assert default == again
    assert mla_only == FusionPass(patterns=(PATTERNS[0],)).uuid()
    assert mla_only != default
    assert FusionPass(patterns=(PATTERNS[1],)).uuid() not in (default, mla_only)


@pytest.mark.parametrize("module", ["fusion_pass.compile.layout", "fusion_pass.compile.matcher",
                                    "fusion_pass.compile.graph_pass", "fusion_pass.patterns.attention_quant",
                                    "fusion_pass.patterns.vocabulary", "fusion_pass.ops.library",
                                    "fusion_pass.nvfp4.layout"])
def test_uuid_changes_with_the_code_of_every_compile_time_module(monkeypatch, module):
    """An upgrade that changes how graphs are matched, proved or rewritten gets a new FX-graph-cache key."""
    from fusion_pass.compile import code_hash

    assert module in dict(code_hash.source_files(code_hash.COMPILE_TIME))
    before = FusionPass().uuid()
    read = code_hash._read
    path = dict(code_hash.source_files(code_hash.COMPILE_TIME))[module]
    monkeypatch.setattr(code_hash, "_read", lambda p: read(p) + (b"\n# changed\n" if p == path else b""))
    code_hash.code_digest.cache_clear()
    try:
        assert FusionPass().uuid() != before
    finally:
        monkeypatch.undo()
        code_hash.code_digest.cache_clear()
    assert FusionPass().uuid() == before


def test_uuid_changes_with_the_package_version(monkeypatch):
    from fusion_pass.compile import code_hash

    before = FusionPass().uuid()
    monkeypatch.setattr(code_hash, "_version", lambda: "99.0")
    code_hash.code_digest.cache_clear()
    try:
        assert FusionPass().uuid() != before
    finally:
        monkeypatch.undo()
        code_hash.code_digest.cache_clear()


def test_enable_as_a_function_installs_and_disable_restores(make_block):
    with inductor_config.patch(post_grad_custom_post_pass=None):
        _enable_disable(make_block)
        assert inductor_config.post_grad_custom_post_pass is None


def _enable_disable(make_block):
    handle = fusion_pass.enable()
    try:
        assert isinstance(handle, fusion_pass.EnabledPass) and handle.enabled
        assert isinstance(handle.fusion, FusionPass)
        assert inductor_config.post_grad_custom_post_pass is handle.fusion
        block = make_block()

        def f(q, kv_c, k_pe):
            return block.o_proj(block.attn(q, kv_c, k_pe))

        run_compiled(torch.compile(f), PREFILL, *block.inputs(PREFILL))
        assert handle.report()["rewritten"] == 1
        assert handle.report()["runtime"]["fused"] == 1
    finally:
        handle.disable()


def test_enable_as_a_context_manager_restores_the_previous_pass():
    previous = FusionPass(patterns=(PATTERNS[1],))
    with inductor_config.patch(post_grad_custom_post_pass=previous):
        with fusion_pass.enable() as fp:
            assert isinstance(fp, FusionPass) and fp is not previous
            installed = inductor_config.post_grad_custom_post_pass
            assert installed is not previous and isinstance(installed.uuid(), str)
        assert inductor_config.post_grad_custom_post_pass is previous
    with inductor_config.patch(post_grad_custom_post_pass=None):
        with fusion_pass.enable() as fp:
            assert inductor_config.post_grad_custom_post_pass is fp  # nothing before: installed as is
        assert inductor_config.post_grad_custom_post_pass is None


def test_enable_takes_effect_on_functions_compiled_before_and_leaves_with_the_block(make_block, form):
    block = make_block()

    def f(q, kv_c, k_pe):
        return block.o_proj(block.attn(q, kv_c, k_pe))

    compiled = torch.compile(f, options={"fx_graph_cache": False})
    with inductor_config.patch(post_grad_custom_post_pass=None):
        run_compiled(compiled, PREFILL, *block.inputs(PREFILL))
        runtime.clear_kv_caches()
        assert counters.counters()["fused"] == 0  # compiled without the pass: the quant runs on its own
        with fusion_pass.enable() as fp:
            run_compiled(compiled, PREFILL, *block.inputs(PREFILL))  # recompiles, now with the pass
            runtime.clear_kv_caches()
            assert (len(fp.graphs), fp.graphs[0].rewritten) == (1, 1)
            assert counters.counters()["fused"] == 1
        run_compiled(compiled, PREFILL, *block.inputs(PREFILL))  # recompiles without it
        runtime.clear_kv_caches()
        assert counters.counters()["fused"] == 1, "the graph compiled inside the block kept the pass after it"
        assert len(fp.graphs) == 1
        assert inductor_config.post_grad_custom_post_pass is None


def test_enable_without_recompile_says_compiled_functions_keep_their_graphs(make_block, caplog):
    block = make_block()

    def f(q, kv_c, k_pe):
        return block.o_proj(block.attn(q, kv_c, k_pe))

    compiled = torch.compile(f, options={"fx_graph_cache": False})
    caplog.set_level(logging.WARNING, logger="fusion_pass")
    with inductor_config.patch(post_grad_custom_post_pass=None):
        run_compiled(compiled, PREFILL, *block.inputs(PREFILL))
        runtime.clear_kv_caches()
        with fusion_pass.enable(recompile=False) as fp:
            run_compiled(compiled, PREFILL, *block.inputs(PREFILL))
            runtime.clear_kv_caches()
    assert fp.graphs == [] and counters.counters()["fused"] == 0
    assert any("keep the graphs they were compiled with" in r.getMessage() for r in caplog.records)


def _installed_fusions(installed) -> list:
    """The passes ``installed`` runs, in order (a ChainedPass flattened)."""
    if installed is None:
        return []
    if isinstance(installed, fusion_pass.compile.graph_pass.ChainedPass):
        return [*installed.firsts, installed.second]
    return [installed]


@pytest.mark.parametrize("previous", [None, "pass"])
@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_enable_handles_disabled_in_any_order_restore_what_was_there(order, previous):
    before = FusionPass(patterns=("mla_attention_nvfp4_quant",)) if previous else None
    with inductor_config.patch(post_grad_custom_post_pass=before):
        handles = [fusion_pass.enable(recompile=False) for _ in range(3)]
        assert _installed_fusions(inductor_config.post_grad_custom_post_pass) == (
            ([before] if before else []) + [h.fusion for h in handles])
        remaining = list(handles)
        for i in order:
            handles[i].disable()
            handles[i].disable()  # twice: a no-op
            remaining.remove(handles[i])
            expected = ([before] if before else []) + [h.fusion for h in remaining]
            if remaining:
                assert _installed_fusions(inductor_config.post_grad_custom_post_pass) == expected
        assert inductor_config.post_grad_custom_post_pass is before
        assert not any(h.enabled for h in handles)


def test_enable_is_a_function_returning_an_enabled_pass():
    assert not isinstance(fusion_pass.enable, type) and callable(fusion_pass.enable)
    given = FusionPass()
    with inductor_config.patch(post_grad_custom_post_pass=None):
        handle = fusion_pass.enable(given, recompile=False)
        try:
            assert type(handle) is fusion_pass.EnabledPass and handle.fusion is given and handle.enabled
            assert inductor_config.post_grad_custom_post_pass is given
            assert handle.report()["graphs"] == 0
        finally:
            handle.disable()
        assert not handle.enabled and inductor_config.post_grad_custom_post_pass is None
        with fusion_pass.enable(recompile=False) as fp:
            assert type(fp) is FusionPass and inductor_config.post_grad_custom_post_pass is fp
        assert inductor_config.post_grad_custom_post_pass is None


@pytest.mark.parametrize("bad", ["x", 3, PATTERNS[0], FusionPass])
def test_enable_rejects_what_is_not_a_fusion_pass(bad):
    installed = inductor_config.post_grad_custom_post_pass
    with pytest.raises(TypeError, match=r"enable\(fusion\): fusion must be a FusionPass") as info:
        fusion_pass.enable(bad)
    assert isinstance(info.value, nvfp4.ArgumentError)  # the project's bad-argument error, also a ValueError
    assert inductor_config.post_grad_custom_post_pass is installed


def test_patterns_given_by_name_and_clear_errors_for_bad_entries():
    assert FusionPass(patterns=("attention_nvfp4_quant",)).patterns == (PATTERNS[1],)
    assert FusionPass(patterns="mla_attention_nvfp4_quant").patterns == (PATTERNS[0],)
    assert FusionPass(patterns=("attention_nvfp4_quant",)).uuid() == FusionPass(patterns=(PATTERNS[1],)).uuid()
    with pytest.raises(ValueError, match="unknown pattern 'attn'.*known patterns: mla_attention_nvfp4_quant"):
        FusionPass(patterns=("attn",))
    for bad in (3, None.__class__, ("attention_nvfp4_quant", 1.5)):
        with pytest.raises(TypeError, match="FusionPass: patterns must hold pattern names or entries"):
            FusionPass(patterns=bad if isinstance(bad, tuple) else (bad,))
    with pytest.raises(TypeError, match="FusionPass: vocabularies must hold OpVocabulary"):
        FusionPass(vocabularies=("fusion_pass",))


# ---------------------------------------------------------------- report and log line


def test_report_totals_are_sums_over_graphs_and_each_graph_is_logged(make_block, caplog):
    fp = FusionPass()
    caplog.set_level(logging.INFO, logger="fusion_pass")

    fused_block, refused_block = make_block(), make_block()

    def fused(q, kv_c, k_pe):
        return fused_block.o_proj(fused_block.attn(q, kv_c, k_pe))

    def refused(q, kv_c, k_pe):
        out = refused_block.attn(q, kv_c, k_pe)
        return refused_block.o_proj(out), out.sum()

    compile_and_run(fused, fused_block, fp)
    compile_and_run(refused, refused_block, fp)

    report = fp.report()
    assert report["graphs"] == len(fp.graphs) == 2
    assert report["candidates"] == sum(g.candidates for g in fp.graphs) == 2
    assert report["rewritten"] == sum(g.rewritten for g in fp.graphs) == 1
    assert report["refused"] == {"bf16_output_has_other_users": 1}
    assert report["seconds"] == pytest.approx(sum(g.seconds for g in fp.graphs))
    assert [g["graph"] for g in report["per_graph"]] == [0, 1]
    # only the fused block's layer was rewritten, and only its calls were guarded (the refused one's op wrote bf16)
    assert report["rewritten_layers"] == [fused_block.attn.layer_name]
    assert report["runtime"] == report["runtime_process"] == counters.counters()
    assert report["graphs_from_cache"] == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "fusion_pass"]
    assert any(re.match(r"fusion_pass: graph 0: 1 candidates, 1 rewritten, refused: none", m) for m in lines), lines
    assert any(re.match(r"fusion_pass: graph 1: 1 candidates, 0 rewritten, refused: bf16_output_has_other_users=1",
                        m) for m in lines), lines


# ---------------------------------------------------------------- dumps


def code_lines(source: str) -> str:
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("#"))


def _compile_tiny_mla(prefix: str, fusion: FusionPass):
    model = demo.build_model("mla", tiny=True, layers=1, prefix=prefix)
    spec = BatchSpec.from_lens([5, 3])
    positions, hidden = demo.make_inputs(spec, 256, "cpu", seed=0)
    torch._dynamo.mark_dynamic(positions, 0)
    torch._dynamo.mark_dynamic(hidden, 0)
    try:
        run_compiled(torch.compile(model, options={"post_grad_custom_post_pass": fusion}), spec, positions, hidden)
    finally:
        models.release_layers(model)
    return model


def test_dump_writes_before_after_report_and_depyf(tmp_path):
    prefix = unique("dump")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fusion_pass.compile.debug.dump(tmp_path) as path:  # this run's folder under tmp_path
            assert fusion_pass.compile.debug.active() and path.parent == tmp_path
            assert re.fullmatch(rf"run_000_pid{os.getpid()}", path.name), path
            _compile_tiny_mla(prefix, FusionPass())
    assert not fusion_pass.compile.debug.active()
    tmp_path = path  # the dumps, relative paths in the report included, are the run folder's
    assert not [w for w in caught if "You are trying to debug" in str(w.message)], "depyf's warning was shown"
    befores = sorted(tmp_path.glob("graph_*_before.py"))
    assert len(befores) == 1, befores
    stem = str(befores[0])[: -len("_before.py")]
    before = Path(f"{stem}_before.py").read_text()
    after = Path(f"{stem}_after.py").read_text()
    report = json.loads(Path(f"{stem}_report.json").read_text())
    # the dumps are verbose (provenance comments name the model's functions): look at the code lines
    assert "torch.ops.fusion_pass.scaled_fp4_quant.out" in code_lines(before)
    assert "scaled_fp4_quant" not in code_lines(after)
    assert "output_block_scale" in code_lines(after)
    assert report["rewritten"] == 1
    assert [e["layer"] for e in report["layers"]] == [f"{prefix}.layers.0.self_attn.attn"]
    depyf_dir = tmp_path / "depyf"
    assert depyf_dir.is_dir() and any(depyf_dir.iterdir())
    # the graph's depyf files: named after Dynamo's compiled function, listed in the report and the header
    fn = report["depyf"]["compiled_fn"]
    assert re.fullmatch(r"__compiled_fn_\d+", fn), report["depyf"]
    on_disk = sorted(str(p.relative_to(tmp_path)) for p in depyf_dir.glob(f"{fn}.*"))
    assert report["depyf"]["files"] == on_disk and on_disk
    assert any("AFTER_POST_GRAD" in f for f in on_disk) and any("kernel" in f for f in on_disk), on_disk
    assert report["depyf"]["transformed_code"], report["depyf"]  # the Dynamo bytecode that calls it
    assert all(fn in (tmp_path / f).read_text() for f in report["depyf"]["transformed_code"])
    assert report["compile_id"] == "0/0"
    for text in (before, after):
        assert f"# depyf files of this graph: depyf/{fn}.*" in text.splitlines()[1]
    assert "Dynamo compile 0/0" in before.splitlines()[0]


def test_dump_rejects_a_missing_directory_at_the_call():
    for bad in (None, 3, ""):
        with pytest.raises(ValueError, match=r"fusion_pass.debug.dump: directory must be a path") as info:
            fusion_pass.debug.dump(bad)
        assert isinstance(info.value, nvfp4.ArgumentError)
    assert not fusion_pass.compile.debug.active()


def test_each_dump_directory_numbers_graphs_from_zero(tmp_path):
    graph = torch.fx.Graph()
    graph.output(graph.placeholder("x"))
    for sub in ("first", "second"):
        with fusion_pass.compile.debug.dump(tmp_path / sub) as run:
            FusionPass()(graph)
        assert (run / "graph_000_before.py").exists() and run.parent == tmp_path / sub


def test_dump_from_environment_variable(tmp_path):
    out = tmp_path / "env_dump"
    code = (
        "import torch, fusion_pass\n"
        "from fusion_pass import runtime\nfrom fusion_pass.demo import workload as demo\n"
        "torch._inductor.config.fx_graph_cache = False\n"
        "assert fusion_pass.compile.debug.active()\n"
        "model = demo.build_model('mla', tiny=True, layers=1, prefix='env_dump')\n"
        "spec = runtime.BatchSpec.from_lens([5, 3])\n"
        "pos, hid = demo.make_inputs(spec, 256, 'cpu', seed=0)\n"
        "fp = fusion_pass.FusionPass()\n"
        "with runtime.batch(spec), torch.no_grad():\n"
        "    torch.compile(model, options={'post_grad_custom_post_pass': fp})(pos, hid)\n"
        "assert fp.report()['rewritten'] == 1, fp.report()\n"
    )
    env = {**os.environ, "FUSION_PASS_DUMP": str(out)}
    env.pop(settings.BACKEND_ENV, None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (out,) = out.glob("run_*_pid*")  # the process's run folder
    assert (out / "graph_000_before.py").exists() and (out / "graph_000_after.py").exists()
    assert "torch.ops.fusion_pass.scaled_fp4_quant.out" in code_lines((out / "graph_000_before.py").read_text())
    assert "scaled_fp4_quant" not in code_lines((out / "graph_000_after.py").read_text())
    report = json.loads((out / "graph_000_report.json").read_text())
    assert report["layers"][0]["layer"] == "env_dump.layers.0.self_attn.attn"
    assert (out / "depyf").is_dir() and any((out / "depyf").iterdir())


# ---------------------------------------------------------------- the report's run-time counters are its own


ZERO_RUNTIME = {"fused": 0, "fused_by_backend": {}, "fallback": {},
                "tokens": {"prefill": 0, "prefill_fused": 0, "decode_fused": 0, "post_quantized": {}}}


def _o_proj_of_attention(block: Block):
    def f(q, kv_c, k_pe):
        return block.o_proj(block.attn(q, kv_c, k_pe))

    return f


def test_a_pass_that_rewrote_nothing_reports_no_fused_call_after_another_pass_ran_fused_calls(make_block):
    idle_block, fused_block = make_block(), make_block()
    idle = FusionPass(patterns=("attention_nvfp4_quant",))  # no MLA entry: refuses the MLA layer
    compile_and_run(_o_proj_of_attention(idle_block), idle_block, idle)
    assert (idle.report()["candidates"], idle.report()["rewritten"]) == (1, 0)

    fused = FusionPass()
    compiled = compile_with(_o_proj_of_attention(fused_block), Recorder(fused))
    for _ in range(2):  # two fused calls of the other pass's layer
        run_compiled(compiled, PREFILL, *fused_block.inputs(PREFILL))
        runtime.clear_kv_caches()

    report = idle.report()
    assert report["rewritten_layers"] == [] and report["runtime"] == ZERO_RUNTIME
    assert report["prefill_fused_fraction"] is None
    assert report["runtime_process"]["fused"] == 2 == counters.counters()["fused"]  # the process did fuse
    mine = fused.report()
    assert mine["rewritten_layers"] == [fused_block.attn.layer_name]
    assert mine["runtime"]["fused_by_backend"] == {"reference": 2}
    assert mine["runtime"]["tokens"]["prefill_fused"] == 2 * PREFILL.num_tokens
    assert mine["prefill_fused_fraction"] == 1.0


def test_two_passes_each_count_the_calls_of_the_layers_they_rewrote(make_block):
    first_block, second_block = make_block(), make_block()
    first, second = FusionPass(), FusionPass()
    first_fn = compile_with(_o_proj_of_attention(first_block), Recorder(first))
    second_fn = compile_with(_o_proj_of_attention(second_block), Recorder(second))
    decode = BatchSpec((RequestSpec("r0", 1, 9), RequestSpec("r1", 1, 5)))  # continues PREFILL's requests
    for fn, block, runs in ((first_fn, first_block, 3), (second_fn, second_block, 1)):
        for i in range(runs):
            run_compiled(fn, PREFILL, *block.inputs(PREFILL, seed=i))
            run_compiled(fn, decode, *block.inputs(decode, seed=i))  # a decode batch: the fallback
            runtime.clear_kv_caches()
    assert first.report()["runtime"]["fused"] == 3 and first.report()["runtime"]["fallback"] == {"decode_tokens": 3}
    assert second.report()["runtime"]["fused"] == 1 and second.report()["runtime"]["fallback"] == {"decode_tokens": 1}
    process = first.report()["runtime_process"]
    assert process["fused"] == 4 and process["fallback"] == {"decode_tokens": 4}
    assert process == second.report()["runtime_process"] == counters.counters()


def test_the_pattern_extra_check_gets_the_attention_shape(make_block):
    import dataclasses

    from fusion_pass.compile import matcher

    seen = []

    def record_shape(shape):
        seen.append(shape)
        return None

    block = make_block(heads=2, v=32)
    entry = dataclasses.replace(PATTERNS[0], extra_check=record_shape)
    fp = FusionPass(patterns=(entry,))
    compile_and_run(_o_proj_of_attention(block), block, fp)
    assert fp.report()["rewritten"] == 1
    assert seen == [matcher.AttentionShape(num_heads=2, v_head_dim=32)]
    assert not hasattr(matcher, "Facts")


# ---------------------------------------------------------------- FX graph cache hits


def test_a_compile_served_by_the_fx_graph_cache_is_counted_and_logged(tmp_path):
    """The same model compiled twice with the FX graph cache on (a cache directory of its own): the second
    compile is served by the cache and the pass does not run; its report says so, and one line is logged."""
    code = textwrap.dedent("""
        import json, logging, sys
        import torch, fusion_pass
        from fusion_pass import runtime
        from fusion_pass.demo import models, workload as demo
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s %(message)s")
        logging.getLogger("fusion_pass").setLevel(logging.INFO)
        torch._inductor.config.fx_graph_cache = True
        spec = runtime.BatchSpec.from_lens([5, 3])
        for attempt in range(2):
            torch._dynamo.reset()  # a fresh Dynamo: the second compile looks the graph up in the cache
            model = demo.build_model("mla", tiny=True, layers=1, prefix="cached")
            positions, hidden = demo.make_inputs(spec, 256, "cpu", seed=0)
            fp = fusion_pass.FusionPass()
            with runtime.batch(spec), torch.no_grad():
                torch.compile(model, options={"post_grad_custom_post_pass": fp})(positions, hidden)
            runtime.clear_kv_caches()
            models.release_layers(model)
            report = fp.report()
            print("REPORT " + json.dumps({k: report[k] for k in ("graphs", "graphs_from_cache", "rewritten",
                                                                 "runtime", "runtime_process")}), flush=True)
            print("SUMMARY " + json.dumps(fp.summary()), flush=True)
    """)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env.pop(settings.BACKEND_ENV, None)
    env.pop("FUSION_PASS_DUMP", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first, second = [json.loads(line[len("REPORT "):]) for line in proc.stdout.splitlines()
                     if line.startswith("REPORT ")]
    assert (first["graphs"], first["graphs_from_cache"], first["rewritten"]) == (1, 0, 1)
    assert first["runtime"]["fused"] == 1
    assert (second["graphs"], second["graphs_from_cache"], second["rewritten"]) == (0, 1, 0)
    # the cached graph is the rewritten one: it ran a fused call, which this pass (it rewrote nothing) does not own
    assert second["runtime"]["fused"] == 0 and second["runtime_process"]["fused"] == 2
    served = [line for line in proc.stderr.splitlines() if "was served by Inductor's FX graph cache" in line]
    assert len(served) == 1, proc.stderr[-4000:]
    assert served[0].startswith("fusion_pass fusion_pass: compile 0/0 was served by Inductor's FX graph cache: "
                                "the fusion pass did not run on its graph")
    # the readable summary says it without INFO logging (the README's example prints it)
    first_summary, second_summary = [json.loads(line[len("SUMMARY "):]) for line in proc.stdout.splitlines()
                                     if line.startswith("SUMMARY ")]
    assert first_summary.startswith("pass: 1 graphs, 1 attention layers seen, 1 rewritten") and "note:" not in first_summary
    assert second_summary.startswith("pass: 0 graphs (+1 served by the FX graph cache, the pass not run)")
    assert second_summary.splitlines()[-1].startswith("note: every compile was served by Inductor's FX graph cache (1): "
                                                      "the pass did not run")
    assert "TORCHINDUCTOR_FX_GRAPH_CACHE=0" in second_summary
