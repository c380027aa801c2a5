"""The static per-tensor FP8 pattern on real post-grad graphs: attention -> ``static_scaled_fp8_quant`` ->
``aten._scaled_mm`` becomes one attention call writing FP8 (the ``attention_fp8_static_quant`` entries), or is
refused with its reason; NVFP4 graphs beside it are untouched.

Every graph comes out of a real ``torch.compile``; both functionalized forms. The inspection reads the graph
(targets, kwargs), not the matcher.
"""

from __future__ import annotations

import operator
import random

import pytest
import torch
from torch import nn

from fusion_pass import fp8, runtime
from fusion_pass.compile.graph_pass import FusionPass
from fusion_pass.demo import layers, models
from fusion_pass.runtime import BatchSpec, RequestSpec

from test_graph_pass import Recorder, compile_with, run_compiled, unique, wrapped
from test_graph_pass import _clean_compile_state, form  # noqa: F401  (the same fixtures: autouse state, both forms)

OPS = torch.ops.fusion_pass
aten = torch.ops.aten
ATTENTION_OPS = (OPS.mla_attention_with_output.default, OPS.attention_with_output.default)
FP8_QUANT = OPS.static_scaled_fp8_quant.default


class FP8Block(nn.Module):
    """A registered attention layer (MLA or GQA) and a static-FP8 o_proj: weight ``[out, H*Dv]`` in e4m3 with its
    per-tensor scale, the activation's static scale."""

    def __init__(self, kind: str, seed: int, *, heads=2, v=32, out=24):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.kind, self.heads, self.v = kind, heads, v
        name = unique(f"fp8_{kind}")
        if kind == "mla":
            self.nope, self.rope, self.lora = 16, 8, 32
            kv_b_proj = nn.Linear(self.lora, heads * (self.nope + v), bias=False)
            with torch.no_grad():
                kv_b_proj.weight.copy_(torch.randn(heads * (self.nope + v), self.lora, generator=g) * self.lora ** -0.5)
            self.attn = layers.MLAAttention(num_heads=heads, qk_nope_head_dim=self.nope, qk_rope_head_dim=self.rope,
                                            v_head_dim=v, kv_lora_rank=self.lora, kv_b_proj=kv_b_proj,
                                            layer_name=name)
        else:
            self.kv_heads, self.d = 1, 16
            self.attn = layers.Attention(num_heads=heads, num_kv_heads=self.kv_heads, head_dim=self.d,
                                         layer_name=name, v_head_dim=v)
        w = torch.randn(out, heads * v, generator=g) * (heads * v) ** -0.5
        self.w_scale = (w.abs().amax() / 448.0).reshape(())
        self.w = (w / self.w_scale).to(torch.float8_e4m3fn)
        self.x_scale = torch.tensor(2.0 / 448.0)

    def inputs(self, spec: BatchSpec, seed: int):
        g = torch.Generator().manual_seed(seed)
        t = spec.num_tokens
        if self.kind == "mla":
            xs = (torch.randn(t, self.heads, self.nope + self.rope, generator=g),
                  torch.randn(t, self.lora, generator=g), torch.randn(t, 1, self.rope, generator=g))
        else:
            xs = (torch.randn(t, self.heads * self.d, generator=g), torch.randn(t, self.kv_heads * self.d, generator=g),
                  torch.randn(t, self.kv_heads * self.v, generator=g))
        xs = tuple(x.to(torch.bfloat16) for x in xs)
        for x in xs:
            torch._dynamo.mark_dynamic(x, 0)
        return xs


def _quantized_o_proj(block: FP8Block, *, grouped=False, gemm_scale=None, gemm=True):
    """attention -> static_scaled_fp8_quant -> aten._scaled_mm, as vLLM's per-tensor FP8 linear calls them."""

    def f(a, b, c, x_scale):
        out = block.attn(a, b, c)
        result = torch.empty(out.shape, dtype=torch.float8_e4m3fn, device=out.device)
        OPS.static_scaled_fp8_quant(result, out, x_scale, [1, 128] if grouped else None)
        if not gemm:
            return result
        return aten._scaled_mm(result, block.w.t(), x_scale if gemm_scale is None else gemm_scale, block.w_scale,
                               out_dtype=torch.bfloat16)

    return f


def built_blocks(cls):
    """A fixture body: ``make(kind, seed=0, **kwargs)`` builds ``cls`` blocks, whose layers are released after the
    test."""
    built = []

    def make(kind, seed=0, **kwargs):
        block = cls(kind, seed, **kwargs)
        built.append(block)
        return block

    yield make
    for block in built:
        models.release_layers(block)


@pytest.fixture
def make_block():
    yield from built_blocks(FP8Block)


def _batches(seed: int):
    rng = random.Random(seed)
    return [BatchSpec.from_lens([rng.randint(2, 12) for _ in range(rng.randint(1, 3))]) for _ in range(2)]


def _attention_nodes(graph):
    return [n for n in graph.nodes if wrapped(n) in ATTENTION_OPS]


@pytest.mark.parametrize("kind", ["mla", "gqa"])
def test_attention_fp8_quant_becomes_one_fp8_attention_call(make_block, kind, form):
    seed = random.SystemRandom().randrange(2**31)
    block = make_block(kind, seed)
    fp = FusionPass()
    rec = Recorder(fp)
    fn = compile_with(_quantized_o_proj(block), rec)
    for i, spec in enumerate(_batches(seed)):
        run_compiled(fn, spec, *block.inputs(spec, seed + i), block.x_scale)
    assert fp.report()["rewritten"] == 1, (seed, fp.report())
    after = rec.after[0]
    assert not [n for n in after.nodes if wrapped(n) is FP8_QUANT], "the quant op is gone"
    (attention,) = _attention_nodes(after)
    kwargs = attention.kwargs
    scale = kwargs["output_scale"]
    assert scale is not None and scale.op == "placeholder", "the quant's static scale is passed on"
    assert kwargs.get("output_block_scale") is None
    out_buf = kwargs["output"] if form == "v1" else kwargs["_all_bases"][kwargs["_output_base_index"]]
    assert out_buf.meta["val"].dtype == torch.float8_e4m3fn
    assert out_buf.meta["val"].shape[-1] == block.heads * block.v
    (mm,) = [n for n in after.nodes if n.target is aten._scaled_mm.default]
    src = mm.args[0]
    while src.target is not operator.getitem:
        src = src.args[0]
    assert src.args[0] is attention, "the GEMM reads the FP8 bytes the attention call writes"
    assert mm.args[2] is scale
    runtime_counts = fp.report()["runtime"]
    assert runtime_counts["fused_by_backend"] == {"reference (fp8_static)": 2}, runtime_counts
    assert runtime_counts["tokens"]["prefill_fused"] == sum(s.num_tokens for s in _batches(seed))
    assert fp.report()["per_graph"][0]["layers"][0]["pattern"] == f"{'mla_' if kind == 'mla' else ''}attention_fp8_static_quant"


def test_fused_graph_output_is_within_the_fp8_bound(make_block, form):
    """The rewritten graph's o_proj output, and the unfused graph's, against the float o_proj of the unfused
    attention: within the GEMM of the FP8 error bound (plus the attention's and the output's bf16 roundings)."""
    seed = random.SystemRandom().randrange(2**31)
    block = make_block("gqa", seed)
    fn = _quantized_o_proj(block)
    spec = BatchSpec.from_lens([7, 3])
    inputs = block.inputs(spec, seed)
    with runtime.batch(spec), torch.no_grad():
        attn = block.attn(*inputs).float()
        unfused = fn(*inputs, block.x_scale).float()
    runtime.clear_kv_caches()
    fp = FusionPass()
    fused = run_compiled(compile_with(fn, Recorder(fp)), spec, *inputs, block.x_scale).float()
    assert fp.report()["rewritten"] == 1
    w = block.w.float() * block.w_scale
    want = attn @ w.t()
    x_err = fp8.static_error_bound(attn, block.x_scale) + attn.abs() * 2.0**-8
    bound = x_err @ w.abs().t() + want.abs() * 2.0**-7 + 1e-6
    for name, got in (("fused", fused), ("unfused", unfused)):
        excess = ((got - want).abs() - bound).max().item()
        assert excess <= 0, f"{name} exceeds the bound by {excess} (seed {seed})"


@pytest.mark.parametrize("case, reason", [
    ("grouped", "fp8_static_quant_is_grouped"),
    ("other_gemm_scale", "no_fp8_static_gemm_consumer"),
    ("no_gemm", "no_fp8_static_gemm_consumer"),
])
def test_refusals(make_block, form, case, reason):
    block = make_block("mla")
    kwargs = {"grouped": dict(grouped=True), "other_gemm_scale": dict(gemm_scale=torch.tensor(0.5 / 448.0)),
              "no_gemm": dict(gemm=False)}[case]
    fp = FusionPass()
    rec = Recorder(fp)
    spec = BatchSpec((RequestSpec("a", 5), RequestSpec("b", 2)))
    try:
        run_compiled(compile_with(_quantized_o_proj(block, **kwargs), rec), spec, *block.inputs(spec, 0),
                     block.x_scale)
    except Exception as exc:  # the grouped quant is refused by the op itself at run time (not vLLM per-tensor)
        assert case == "grouped", exc
    assert fp.report()["rewritten"] == 0
    assert fp.report()["refused"] == {reason: 1}
    assert [n for n in rec.after[0].nodes if wrapped(n) is FP8_QUANT], "the quant stays"
