"""Static per-tensor FP8 in the native form on real post-grad graphs: attention -> float32 -> ``* reciprocal(scale)``
-> clamp to ±448 -> float8_e4m3fn -> ``aten._scaled_mm`` (vLLM's ``QuantFP8`` under ``custom_ops="none"``) becomes one
attention call writing FP8 with the graph's reciprocal as ``output_inv_scale`` (the ``*_fp8_static_native`` entries),
or is refused with its reason.

Every graph comes out of a real ``torch.compile``, in both functionalized forms; the inspection reads the rewritten
graph node by node. Bytes: a decode-only step (the unfused path) equals the uncompiled model's codes byte for byte
(NaN kept); a prefill's fused rows are the native quantizer of the reference attention, within the FP8 bound.
"""

from __future__ import annotations

import operator
import random

import pytest
import torch

from fusion_pass import fp8, runtime
from fusion_pass.compile.graph_pass import FusionPass
from fusion_pass.patterns import PATTERNS
from fusion_pass.runtime import BatchSpec

from test_fp8_static_pattern import FP8Block, make_block  # noqa: F401  (the fixture)
from test_graph_pass import Recorder, compile_with, run_compiled, wrapped
from test_graph_pass import _clean_compile_state, form  # noqa: F401  (the same fixtures: autouse state, both forms)

OPS = torch.ops.fusion_pass
aten, prims = torch.ops.aten, torch.ops.prims
ATTENTION_OPS = (OPS.mla_attention_with_output.default, OPS.attention_with_output.default)


def _native_o_proj(block: FP8Block, *, bound=448.0, scale_steps=False, gemm_scale=None, to_fp8=True,
                   return_codes=True):
    """vLLM's QuantFP8.forward_native of a static scale, then ``aten._scaled_mm``; also returns the codes."""

    def f(a, b, c, x_scale):
        out = block.attn(a, b, c)
        x = out.reshape(out.shape[0], -1).to(torch.float32)
        s = x_scale.to(torch.float32).reshape(1, 1).expand(x.shape[-2:]) if scale_steps else x_scale
        x = (x * s.reciprocal()).clamp(-bound, bound)
        if not to_fp8:
            return x.to(torch.bfloat16)
        codes = x.to(torch.float8_e4m3fn)
        mm = aten._scaled_mm(codes, block.w.t(), x_scale if gemm_scale is None else gemm_scale, block.w_scale,
                             out_dtype=torch.bfloat16)
        return (codes, mm) if return_codes else mm

    return f


def _attention_nodes(graph):
    return [n for n in graph.nodes if wrapped(n) in ATTENTION_OPS]


@pytest.mark.parametrize("kind", ["mla", "gqa"])
@pytest.mark.parametrize("scale_steps", [False, True], ids=["scale", "scale_expanded"])
def test_the_native_form_becomes_one_fp8_attention_call(make_block, kind, form, scale_steps):
    seed = random.SystemRandom().randrange(2**31)
    block = make_block(kind, seed)
    fp = FusionPass()
    rec = Recorder(fp)
    fn = compile_with(_native_o_proj(block, scale_steps=scale_steps), rec)
    specs = [BatchSpec.from_lens([5, 3]), BatchSpec.from_lens([4])]
    for i, spec in enumerate(specs):
        run_compiled(fn, spec, *block.inputs(spec, seed + i), block.x_scale)
    assert fp.report()["rewritten"] == 1, (seed, fp.report())
    after = rec.after[0]
    (attention,) = _attention_nodes(after)
    kwargs = attention.kwargs
    assert kwargs.get("output_scale") is None and kwargs.get("output_block_scale") is None
    inv = kwargs["output_inv_scale"]
    assert inv.target is aten.reciprocal.default and inv.args[0].op == "placeholder", "the graph's reciprocal of s"
    assert inv.meta["val"].shape == inv.args[0].meta["val"].shape and inv.meta["val"].dtype == torch.float32
    out_buf = kwargs["output"] if form == "v1" else kwargs["_all_bases"][kwargs["_output_base_index"]]
    assert out_buf.target is aten.empty.memory_format
    assert out_buf.meta["val"].dtype == torch.float8_e4m3fn and out_buf.meta["val"].shape[-1] == block.heads * block.v
    assert not [n for n in after.nodes if n.target in (aten.clamp_min.default, aten.clamp_max.default, aten.clamp.default)]
    assert not [n for n in after.nodes if n.target is prims.convert_element_type.default
                and n.args[1] == torch.float8_e4m3fn], "the native quant is gone"
    (mm,) = [n for n in after.nodes if n.target is aten._scaled_mm.default]
    src = mm.args[0]
    assert src.target is operator.getitem and src.args[0] is attention, "the GEMM reads the attention call's bytes"
    assert mm.args[2] is inv.args[0], "and the same scale"
    counts = fp.report()["runtime"]
    assert counts["fused_by_backend"] == {"reference (fp8_static)": 2}, counts
    assert fp.report()["per_graph"][0]["layers"][0]["pattern"] == \
        f"{'mla_' if kind == 'mla' else ''}attention_fp8_static_native"


def test_unfused_rows_are_the_native_forms_bytes_and_fused_rows_within_the_bound(make_block, form):
    """A prefill then a step with a decode row (not fused: the unfused path) beside a new prefill: the decode row's
    codes equal the uncompiled model's byte for byte, a NaN in its query kept as NaN (0x7F); the prefill rows are the
    native quantizer (the graph's reciprocal, NaN kept) of the reference attention, within the FP8 bound."""
    block = make_block("gqa", 3)
    width = block.heads * block.v
    fn = _native_o_proj(block)
    first = BatchSpec.from_lens([6])
    step = BatchSpec.from_lens([1, 5], [6, 0], ["r0", "r1"])
    x0, x1 = block.inputs(first, 1), block.inputs(step, 2)
    x1[0][0, :16] = float("nan")  # the decode row's query, head 0
    eager = []
    with torch.no_grad():
        for spec, x in ((first, x0), (step, x1)):
            with runtime.batch(spec):
                start = runtime.snapshot_kv_caches()
                attn = block.attn(*x).float()
                runtime.restore_kv_caches(start)
                eager.append((attn, fn(*x, block.x_scale)[0]))
    runtime.clear_kv_caches()
    fp = FusionPass()
    compiled = compile_with(fn, Recorder(fp))
    got = [run_compiled(compiled, spec, *x, block.x_scale)[0] for spec, x in ((first, x0), (step, x1))]
    assert fp.report()["rewritten"] == 1
    codes, unfused = got[1].view(torch.uint8), eager[1][1].view(torch.uint8)
    nan = (unfused[0] & 0x7F) == 0x7F  # a NaN's sign is the CPU's arithmetic's (the GPU's canonical NaN is 0x7F)
    assert bool(nan[:block.v].all()) and not bool(nan[block.v:].any()), "the NaN head, and only it, is NaN"
    assert bool(((codes[0] & 0x7F) == 0x7F)[:block.v].all()), "a NaN stays NaN in the native form"
    assert torch.equal(codes[0][~nan], unfused[0][~nan]), "the decode row: the unfused graph's bytes"
    inv = fp8.reciprocal(block.x_scale.reshape(1))
    for (attn, _), out in zip(eager, got):
        rows = slice(1, None) if out is got[1] else slice(None)
        want = fp8.quantize_static(attn[rows].reshape(-1, width), inv, nan=fp8.NaNRule.NAN)
        err = (fp8.dequantize_static(out[rows], block.x_scale) - attn[rows].reshape(-1, width)).abs()
        x = attn[rows].reshape(-1, width)
        bound = fp8.static_error_bound(x, block.x_scale) + 2.0**-8 * x.abs()
        assert bool((err <= bound).all())
        assert (want.view(torch.uint8) != out[rows].view(torch.uint8)).float().mean() < 0.05


@pytest.mark.parametrize("case, reason", [
    ("other_bound", "fp8_native_quant_not_clamped_to_448"),
    ("other_gemm_scale", "no_fp8_static_gemm_consumer"),
    ("to_bf16", "no_nvfp4_quant_consumer"),
    ("entry_disabled", "fp8_native_quant_not_matched"),
])
def test_refusals(make_block, form, case, reason):
    block = make_block("mla")
    kwargs = {"other_bound": dict(bound=400.0), "other_gemm_scale": dict(gemm_scale=torch.tensor(0.5 / 448.0)),
              "to_bf16": dict(to_fp8=False), "entry_disabled": {}}[case]
    patterns = [p.name for p in PATTERNS if p.quant != "native"] if case == "entry_disabled" else None
    fp = FusionPass(patterns=patterns)
    rec = Recorder(fp)
    spec = BatchSpec.from_lens([5, 2])
    run_compiled(compile_with(_native_o_proj(block, **kwargs), rec), spec, *block.inputs(spec, 0), block.x_scale)
    assert fp.report()["rewritten"] == 0
    assert fp.report()["refused"] == {reason: 1}
    assert not [n for n in rec.after[0].nodes if wrapped(n) in ATTENTION_OPS and "output_inv_scale" in n.kwargs
                and n.kwargs["output_inv_scale"] is not None]


def native_o_proj_codes(out, x_scale):
    """QuantFP8's native form of ``out`` under the static ``x_scale``: the codes ``[T, H*Dv]``."""
    x = out.reshape(out.shape[0], -1).to(torch.float32) * x_scale.reciprocal()
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


_lib = torch.library.Library("fp8_native_test", "DEF")
_lib.define("cutlass_like_scaled_mm(Tensor(a!) out, Tensor a, Tensor b, Tensor a_scales, Tensor b_scales, "
            "Tensor? bias) -> ()")


@torch.library.impl(_lib, "cutlass_like_scaled_mm", "CompositeExplicitAutograd")
def _cutlass_like_scaled_mm(out, a, b, a_scales, b_scales, bias):
    out.copy_(aten._scaled_mm(a, b, a_scales, b_scales, out_dtype=out.dtype))


def test_a_gemm_that_writes_its_output_buffer_is_matched_through_its_wrapper(make_block, form):
    """SM90's default FP8 GEMM in vLLM, ``_C::cutlass_scaled_mm(out, a, b, a_scales, b_scales, bias)``, mutates its
    output: the graph calls it through ``auto_functionalized``. A stand-in with its schema, as a vocabulary's form."""
    import dataclasses

    from fusion_pass.patterns import GemmForm, fusion_pass_vocabulary

    op = torch.ops.fp8_native_test.cutlass_like_scaled_mm.default
    vocab = dataclasses.replace(fusion_pass_vocabulary(), name="cutlass_like", fp8_static_gemms=(
        GemmForm("cutlass_like", op, "a", "a_scales", format="fp8_static"),))
    block = make_block("gqa", 5)

    def f(a, b, c, x_scale):
        out = block.attn(a, b, c)
        codes = native_o_proj_codes(out, x_scale)
        y = torch.empty(codes.shape[0], block.w.shape[0], dtype=torch.bfloat16)
        torch.ops.fp8_native_test.cutlass_like_scaled_mm(y, codes, block.w.t(), x_scale, block.w_scale, None)
        return y

    fp = FusionPass(vocabularies=vocab)
    rec = Recorder(fp)
    spec = BatchSpec.from_lens([5, 2])
    run_compiled(compile_with(f, rec), spec, *block.inputs(spec, 0), block.x_scale)
    assert fp.report()["rewritten"] == 1, fp.report()
    (attention,) = _attention_nodes(rec.after[0])
    assert attention.kwargs["output_inv_scale"].target is aten.reciprocal.default
