"""The o_proj GEMM of every NVFP4 linear kernel of vLLM 0.32, at graph level on vLLM's CPU build.

For each kernel class of ``vllm/model_executor/kernels/linear/nvfp4/`` that quantizes its input with
``scaled_fp4_quant`` (:data:`fusion_pass.vllm.compile.vocabulary.VLLM_GEMM_FORMS`), the real class's
``apply_weights`` is traced by ``torch.compile`` behind vLLM's real attention op (the graph an o_proj after
attention produces), Inductor's post-grad graph is handed to the pass, and the graph is read node by node
before and after (without :mod:`fusion_pass.compile.matcher`). The compile stops right after the pass
(:class:`Stop`): nothing runs.

The CUDA ops vLLM's CPU build lacks are registered here under their real names, with a fake implementation
only (``_C::scaled_fp4_quant.out``, ``_C::cutlass_scaled_fp4_mm``, ``vllm::flashinfer_mm_fp4``,
``vllm::flashinfer_nvfp4_quantize``, ``fbgemm::f4f4bf16``, ``b12x::blockscaled_nvfp4``; schemas as vLLM
0.32, FBGEMM and b12x define them), and removed again after the module. vLLM calls FlashInfer's through
module globals of ``vllm.utils.flashinfer`` that its CPU build never defines: they are set to the registered
ops. Not vLLM's own code, and therefore stand-ins too: the ``fbgemm_gpu`` module vLLM imports (an empty
module) and the b12x package's ``mm_nvfp4`` (a function calling ``b12x::blockscaled_nvfp4`` as the b12x
package does; the package pinned by vLLM's ``b12x`` extra, 1.5.1, was not available to read, so its
schema is the one of a b12x release that has the op).
"""

from __future__ import annotations

import operator
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from torch._inductor import config as inductor_config
from torch.library import Library

from vllm.model_executor.layers.attention.attention import _encode_layer_name
import vllm.utils.flashinfer as vllm_flashinfer
from vllm.model_executor.kernels.linear.nvfp4 import b12x as b12x_kernels
from vllm.model_executor.kernels.linear.nvfp4 import cutlass as cutlass_kernels
from vllm.model_executor.kernels.linear.nvfp4 import fbgemm as fbgemm_kernels
from vllm.model_executor.kernels.linear.nvfp4 import flashinfer as fi_kernels
from vllm.model_executor.kernels.linear.nvfp4 import pytorch as torch_kernels

from fusion_pass import formats
from fusion_pass.vllm import FusionPassForVllm
from fusion_pass.vllm.compile.vocabulary import vllm_gemm_forms

aten = torch.ops.aten
HOPS = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)
LAYER = "model.layers.0.self_attn.attn"
N = 96  # o_proj output features (a multiple of 32: no N padding, no output slice)

STAND_INS = {  # op -> schema (the real ones), for the ops vLLM's CPU build lacks
    "_C::scaled_fp4_quant.out": "scaled_fp4_quant.out(Tensor input, Tensor input_scale, bool is_sf_swizzled_layout, "
                                "*, Tensor(a!) output, Tensor(b!) output_scale) -> ()",
    "_C::cutlass_scaled_fp4_mm": "cutlass_scaled_fp4_mm(Tensor! out, Tensor a, Tensor b, Tensor block_scale_a, "
                                 "Tensor block_scale_b, Tensor alpha) -> ()",
    "vllm::flashinfer_mm_fp4": "flashinfer_mm_fp4(Tensor A, Tensor B, Tensor A_scale, Tensor B_scale, Tensor g_scale, "
                               "ScalarType dtype, bool use_8x4_sf_layout, str backend, int block_size=16, "
                               "bool use_nvfp4=True) -> Tensor",
    "vllm::flashinfer_nvfp4_quantize": "flashinfer_nvfp4_quantize(Tensor a, Tensor a_global_sf) -> (Tensor, Tensor)",
    "fbgemm::f4f4bf16": "f4f4bf16(Tensor XQ, Tensor WQ, Tensor x_scale, Tensor w_scale, Tensor? global_scale=None, "
                        "bool use_mx=True) -> Tensor",
    "b12x::blockscaled_nvfp4": "blockscaled_nvfp4(Tensor lhs_values, Tensor lhs_scale_storage, Tensor rhs_values, "
                               "Tensor rhs_scale_storage, Tensor alpha, ScalarType out_dtype, int expected_m, "
                               "int? stream_int) -> Tensor",
}


def _no_output(*args, **kwargs):
    return None


def _gemm_rows_by_n(a, b, *args, **kwargs):  # flashinfer_mm_fp4 gets b transposed: [K/2, N]
    dtype = next(x for x in (*args, *kwargs.values()) if isinstance(x, torch.dtype))
    return a.new_empty(a.shape[0], b.shape[1], dtype=dtype)


def _gemm_n_by_rows(a, b, *args, **kwargs):  # fbgemm gets b as [N, K/2]
    return a.new_empty(a.shape[0], b.shape[0], dtype=torch.bfloat16)


def _b12x_gemm(lhs_values, lhs_scale_storage, rhs_values, rhs_scale_storage, alpha, out_dtype, expected_m, stream):
    return lhs_values.new_empty(lhs_values.shape[0], rhs_values.shape[0], dtype=out_dtype)


def _quantize_8x4(a, a_global_sf):
    rows, cols = (a.shape[0] + 7) // 8 * 8, (a.shape[1] // 16 + 3) // 4 * 4
    return a.new_empty(a.shape[0], a.shape[1] // 2, dtype=torch.uint8), a.new_empty(rows, cols, dtype=torch.uint8)


FAKES = {"_C::scaled_fp4_quant.out": _no_output, "_C::cutlass_scaled_fp4_mm": _no_output,
         "vllm::flashinfer_mm_fp4": _gemm_rows_by_n, "vllm::flashinfer_nvfp4_quantize": _quantize_8x4,
         "fbgemm::f4f4bf16": _gemm_n_by_rows, "b12x::blockscaled_nvfp4": _b12x_gemm}


def _registered(qualname: str) -> bool:
    namespace, name = qualname.split("::")
    packet, _, overload = name.partition(".")
    try:
        getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")
        return True
    except (AttributeError, RuntimeError):
        return False


def _mm_nvfp4(lhs_values, lhs_scale_storage, rhs_values, rhs_scale_storage, alpha, *, out_dtype, **kwargs):
    return torch.ops.b12x.blockscaled_nvfp4(lhs_values, lhs_scale_storage, rhs_values, rhs_scale_storage, alpha,
                                            out_dtype, 0, None)


B12X_BLOCKSCALED = types.ModuleType("b12x.gemm.blockscaled")  # the b12x package's module (a stand-in: absent here)
B12X_BLOCKSCALED.mm_nvfp4 = _mm_nvfp4


@pytest.fixture(scope="module")
def fusion():
    """The vLLM pass over a vocabulary built with the stand-ins registered (removed again afterwards)."""
    libraries: dict[str, Library] = {}
    ours = [qualname for qualname in STAND_INS if not _registered(qualname)]
    with pytest.MonkeyPatch.context() as mp:
        for qualname, schema in STAND_INS.items():
            if qualname not in ours:
                continue
            namespace = qualname.split("::")[0]
            lib = libraries.setdefault(namespace, Library(namespace, "FRAGMENT"))
            lib.define(schema)
            torch.library.register_fake(qualname, FAKES[qualname], lib=lib)
        mp.setattr(vllm_flashinfer, "flashinfer_mm_fp4", torch.ops.vllm.flashinfer_mm_fp4, raising=False)
        mp.setattr(vllm_flashinfer, "flashinfer_nvfp4_quantize", torch.ops.vllm.flashinfer_nvfp4_quantize,
                   raising=False)
        mp.setitem(sys.modules, "fbgemm_gpu", types.ModuleType("fbgemm_gpu"))
        mp.setattr(b12x_kernels, "_import_b12x_blockscaled", lambda: B12X_BLOCKSCALED)
        try:
            yield FusionPassForVllm().fusion()
        finally:
            for lib in libraries.values():
                lib._destroy()
    torch._dynamo.reset()
    assert not [qualname for qualname in ours if _registered(qualname)], "a stand-in outlived the module"


# ---------------------------------------------------------------- tracing a kernel class behind attention


def kernel(cls):
    """An instance of a kernel class, without its platform checks (``is_supported`` is False on CPU)."""
    instance = cls.__new__(cls)
    instance.config = None
    return instance


def o_proj(k: int, *, padding_bytes: int = 0, fbgemm: bool = False, padding_attr: bool = False) -> torch.nn.Module:
    """The attributes ``apply_weights`` reads, shaped as the kernel's ``process_weights_after_loading`` leaves
    them (the weight's K padded by ``padding_bytes``, as ``pad_nvfp4_weight_for_cutlass`` pads it)."""
    layer = torch.nn.Module()
    layer.output_size_per_partition, layer.input_size_per_partition = N, k
    kp = k // 2 + padding_bytes
    param = lambda t: torch.nn.Parameter(t, requires_grad=False)  # noqa: E731
    layer.weight = param(torch.zeros(N, kp, dtype=torch.uint8))
    scales = torch.zeros(128, (kp * 2 // 16 + 3) // 4 * 4, dtype=torch.float8_e4m3fn)
    layer.weight_scale = param(scales.view(-1).view(torch.uint8) if fbgemm else scales)
    layer.input_global_scale_inv = param(torch.ones(1))
    layer.alpha = param(torch.ones(1))
    if padding_attr:
        layer.weights_padding_cols = padding_bytes
    return layer


class Stop(Exception):
    """Ends the compile right after the pass: the graph is all the test needs."""


class Recorder:
    def __init__(self, fusion):
        self.fusion, self.before, self.after = fusion, None, None

    def __call__(self, graph):
        self.before = snapshot(graph)
        self.fusion(graph)
        self.after = snapshot(graph)
        raise Stop()

    def uuid(self):
        return None


def snapshot(graph):
    copy = torch.fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    return copy


def trace(fusion, cls, layer, *, heads: int, v: int, tokens: int = 40, mla: bool = False, form: str = "v1"):
    """Compile attention -> ``cls.apply_weights(layer, ...)``; the recorder holds the graph before and after."""
    lin = kernel(cls)
    name = _encode_layer_name(LAYER)
    bf = torch.bfloat16
    if mla:
        inputs = (torch.randn(tokens, heads, 96, dtype=bf), torch.randn(tokens, 64, dtype=bf),
                  torch.randn(tokens, 1, 32, dtype=bf))

        def block(q, kv_c, k_pe):
            out = torch.empty(q.shape[0], heads * v, dtype=q.dtype)
            torch.ops.vllm.unified_mla_attention_with_output(q, kv_c, k_pe, out, name)
            return lin.apply_weights(layer, out)
    else:
        inputs = (torch.randn(tokens, heads, v, dtype=bf), torch.randn(tokens, 1, v, dtype=bf),
                  torch.randn(tokens, 1, v, dtype=bf))

        def block(q, k, v_):  # as vLLM's Attention.forward: [T, H, Dv] output, returned as [T, H*Dv]
            out = torch.empty(q.shape[0], heads * v, dtype=q.dtype).view(-1, heads, v)
            torch.ops.vllm.unified_attention_with_output(q, k, v_, out, name)
            return lin.apply_weights(layer, out.view(-1, heads * v))
    for x in inputs:
        torch._dynamo.mark_dynamic(x, 0)
    rec = Recorder(fusion)
    torch._dynamo.reset()
    with inductor_config.patch(enable_auto_functionalized_v2=form == "v2", fx_graph_cache=False):
        with pytest.raises(Exception) as caught:
            torch.compile(block, options={"post_grad_custom_post_pass": rec})(*inputs)
    assert rec.after is not None, f"the compile did not reach the pass: {caught.value!r}"
    assert "Stop" in repr(caught.value) or isinstance(caught.value, Stop), caught.value
    return rec


# ---------------------------------------------------------------- reading the graph


def wrapped(node):
    return node.args[0] if node.op == "call_function" and node.target in HOPS else None


def called(node):
    return wrapped(node) or node.target


def nodes_calling(graph, op):
    return [n for n in graph.nodes if called(n) is op]


def attention_nodes(graph):
    ops = {torch.ops.vllm.unified_attention_with_output.default, torch.ops.vllm.unified_mla_attention_with_output.default,
           torch.ops.fusion_pass.vllm_attention_nvfp4.default, torch.ops.fusion_pass.vllm_mla_attention_nvfp4.default}
    return [n for n in graph.nodes if wrapped(n) in ops]


def argument(node, name):
    """The value a call passes as schema argument ``name``, or its default (wrapped calls pass everything by
    keyword)."""
    schema = {a.name: a for a in called(node)._schema.arguments}
    default = schema[name].default_value if schema[name].has_default_value() else None
    if wrapped(node) is not None or name in node.kwargs:
        return node.kwargs.get(name, default)
    index = list(schema).index(name)
    return node.args[index] if index < len(node.args) else default


def mutable_index(node, arg):
    """The getitem index of mutable ``arg`` after an auto_functionalized[_v2] call."""
    if node.target is torch.ops.higher_order.auto_functionalized:
        mutable = [a.name for a in wrapped(node)._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        return 1 + mutable.index(arg)
    return 1 + node.kwargs[f"_{arg}_base_index"]


def origin(node):
    """Back from a GEMM argument through the steps between quant and GEMM (views, dtype views, zero padding):
    the getitem it starts from, and the steps' targets."""
    steps = []
    while node.target is not operator.getitem:
        assert node.target in (aten.view.dtype, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                               aten.constant_pad_nd.default), node.format_node()
        steps.append(node.target)
        node = node.args[0]
    return node, steps


def buffer(node, arg):
    if node.target is torch.ops.higher_order.auto_functionalized:
        return node.kwargs[arg]
    return node.kwargs["_all_bases"][node.kwargs[f"_{arg}_base_index"]]


QUANT = "_C::scaled_fp4_quant.out"


def assert_rewritten(rec, fusion, gemm_op, activation: str, block_scale: str, *, mla: bool = False, padded=False):
    """Before: attention (query dtype) -> _C quant -> GEMM. After: one NVFP4-writing attention call into the
    quant's buffers, no quant, the GEMM reading the new call's results where it read the quant's (the same
    steps in between), its other arguments unchanged."""
    quant_op = torch.ops._C.scaled_fp4_quant.out
    report = fusion.graphs[-1]
    assert (report.candidates, report.rewritten, report.refused) == (1, 1, {}), report
    pattern = "mla_attention_nvfp4_quant" if mla else "attention_nvfp4_quant"
    assert report.layers == [{"layer": LAYER, "pattern": pattern, "outcome": "rewritten"}]

    (attn_before,), (quant,), (gemm_before,) = (attention_nodes(rec.before), nodes_calling(rec.before, quant_op),
                                                nodes_calling(rec.before, gemm_op))
    assert argument(attn_before, "output_scale") is None
    packed_before, packed_steps = origin(argument(gemm_before, activation))
    scales_before, scale_steps = origin(argument(gemm_before, block_scale))
    assert (packed_before.args[0], scales_before.args[0]) == (quant, quant)
    assert (packed_before.args[1], scales_before.args[1]) == (mutable_index(quant, "output"),
                                                              mutable_index(quant, "output_scale"))
    assert (aten.constant_pad_nd.default in packed_steps) == padded

    after = rec.after
    assert nodes_calling(after, quant_op) == []
    (attn,) = attention_nodes(after)
    fused = torch.ops.fusion_pass.vllm_mla_attention_nvfp4 if mla else torch.ops.fusion_pass.vllm_attention_nvfp4
    assert wrapped(attn) is fused.default, attn.format_node()
    assert argument(attn, "output_scale").name == quant.kwargs["input_scale"].name
    assert buffer(attn, "output").name == buffer(quant, "output").name
    assert buffer(attn, "output_block_scale").name == buffer(quant, "output_scale").name
    assert argument(attn, "layer_name").name == argument(attn_before, "layer_name").name
    (gemm,) = nodes_calling(after, gemm_op)
    packed, steps = origin(argument(gemm, activation))
    scales, steps_s = origin(argument(gemm, block_scale))
    assert (packed.args[0], scales.args[0]) == (attn, attn), gemm.format_node()
    assert (packed.args[1], scales.args[1]) == (mutable_index(attn, "output"), mutable_index(attn, "output_block_scale"))
    assert (steps, steps_s) == (packed_steps, scale_steps)
    schema = [a.name for a in (wrapped(gemm) or gemm.target)._schema.arguments]
    for name in (n for n in schema if n not in (activation, block_scale)):
        before, now = argument(gemm_before, name), argument(gemm, name)
        assert (before.name if isinstance(before, torch.fx.Node) else before) == \
               (now.name if isinstance(now, torch.fx.Node) else now), name
    after.lint()


def assert_refused(rec, fusion, reason: str):
    """Refused with ``reason``, the graph unchanged."""
    report = fusion.graphs[-1]
    assert (report.candidates, report.rewritten, report.refused) == (1, 0, {reason: 1}), report
    assert rec.after.python_code("self").src == rec.before.python_code("self").src


# ---------------------------------------------------------------- the forms

FORMS = {  # kernel class -> (GEMM op, activation argument, block-scale argument, extra o_proj attributes)
    "flashinfer_cute_dsl": (fi_kernels.FlashInferCuteDslNvFp4LinearKernel, "vllm::flashinfer_mm_fp4", "A", "A_scale", {}),
    "flashinfer_cutlass": (fi_kernels.FlashInferCutlassNvFp4LinearKernel, "vllm::flashinfer_mm_fp4", "A", "A_scale", {}),
    "flashinfer_b12x": (fi_kernels.FlashInferB12xNvFp4LinearKernel, "vllm::flashinfer_mm_fp4", "A", "A_scale", {}),
    "cutlass": (cutlass_kernels.CutlassNvFp4LinearKernel, "_C::cutlass_scaled_fp4_mm", "a", "block_scale_a", {}),
    "flashinfer_trtllm": (fi_kernels.FlashInferTrtllmNvFp4LinearKernel, "vllm::flashinfer_mm_fp4", "A", "A_scale", {}),
    "flashinfer_cudnn": (fi_kernels.FlashInferCudnnNvFp4LinearKernel, "vllm::flashinfer_mm_fp4", "A", "A_scale", {}),
    "fbgemm": (fbgemm_kernels.FbgemmNvFp4LinearKernel, "fbgemm::f4f4bf16", "XQ", "x_scale", {"fbgemm": True}),
    "b12x": (b12x_kernels.B12xNvFp4LinearKernel, "b12x::blockscaled_nvfp4", "lhs_values", "lhs_scale_storage", {}),
    "torch_scaled_mm": (torch_kernels.TorchNvFp4LinearKernel, "aten::_scaled_mm", "self", "scale_a",
                        {"padding_attr": True}),
}


def op_of(qualname: str):
    namespace, name = qualname.split("::")
    return getattr(getattr(torch.ops, namespace), name).default


def test_the_vocabulary_has_a_form_for_every_kernel_class(fusion):
    (vocab,) = fusion.vocabularies
    assert vocab.nvfp4_quant is torch.ops._C.scaled_fp4_quant.out and vocab.name == "vllm"
    assert [f.name for f in vocab.nvfp4_gemms] == ["fusion_pass::nvfp4_gemm"] + [f"vllm:{name}" for name in FORMS]
    for form in vllm_gemm_forms():
        cls, gemm, activation, block_scale, _ = FORMS[form.name.removeprefix("vllm:")]
        assert (form.op, form.activation, form.block_scale) == (op_of(gemm), activation, block_scale)
        assert form.emitted_by == (f"{cls.__module__}.{cls.__name__}",)
    fp8_refused = []  # the FP8 forms fusion_pass.formats.REFUSED lists, where this build has the op
    for refused in formats.REFUSED:
        namespace, name, overload = refused.op
        op = getattr(getattr(getattr(torch.ops, namespace), name, None), overload, None)
        if op is not None:
            fp8_refused.append((op, refused.name))
    assert vocab.refused_quants == ((torch.ops.vllm.flashinfer_nvfp4_quantize.default, "gemm_scale_layout_8x4"),
                                    *fp8_refused)


@pytest.mark.parametrize("name", list(FORMS))
def test_each_kernel_class_gemm_reads_the_fused_attention_output(fusion, name):
    """K = 4 heads * 64 = 256: no kernel pads; the 128x4 quant feeds each kernel's GEMM."""
    cls, gemm, activation, block_scale, extra = FORMS[name]
    rec = trace(fusion, cls, o_proj(256, **extra), heads=4, v=64)
    (call,) = nodes_calling(rec.before, op_of(gemm))
    taken_by = [form.name for form in fusion.vocabularies[0].nvfp4_gemms if form.op is op_of(gemm)
                and form.takes({arg: argument(call, arg) for arg, _ in form.expects})]
    assert taken_by == [f"vllm:{name}"], call.format_node()  # e.g. flashinfer_mm_fp4's backend names the kernel
    assert_rewritten(rec, fusion, op_of(gemm), activation, block_scale)


@pytest.mark.parametrize("form", ["v1", "v2"])
def test_mla_attention_before_the_cute_dsl_gemm_in_both_functionalized_forms(fusion, form):
    rec = trace(fusion, fi_kernels.FlashInferCuteDslNvFp4LinearKernel, o_proj(256), heads=4, v=64, mla=True, form=form)
    assert_rewritten(rec, fusion, op_of("vllm::flashinfer_mm_fp4"), "A", "A_scale", mla=True)


# K = 3 heads * 48 = 144 elements = 72 bytes: the CUTLASS-family kernels pad the weight's K to 160 (8 bytes).


@pytest.mark.parametrize("name", ["flashinfer_cute_dsl", "flashinfer_b12x"])
def test_activation_padded_after_the_quant_is_accepted(fusion, name):
    """``pad_nvfp4_activation_for_cutlass`` appends 8 zero bytes (16 zero codes) to each row of the packed
    codes: ``constant_pad_nd(codes, [0, 8], 0)``. The fused call writes the same codes and the same scale
    bytes (the 10th block column is a padding column of the 128x4 layout: zero, as the quant writes it), so
    the padded rows and the scales the GEMM reads are those of the unfused graph."""
    cls, gemm, activation, block_scale, extra = FORMS[name]
    rec = trace(fusion, cls, o_proj(144, padding_bytes=8, **extra), heads=3, v=48)
    (pad,) = nodes_calling(rec.before, aten.constant_pad_nd.default)
    assert list(pad.args[1]) == [0, 8] and pad.args[2] == 0
    assert_rewritten(rec, fusion, op_of(gemm), activation, block_scale, padded=True)


@pytest.mark.parametrize("name", ["flashinfer_cutlass", "cutlass", "flashinfer_cudnn", "torch_scaled_mm"])
def test_quant_into_k_padded_buffers_is_refused(fusion, name):
    """These kernels quantize with ``padded_n``: the quant's buffers are 80 bytes (and 10 scale columns, of 12)
    wide, the attention output 72; the fused call writes ``H*Dv/2`` bytes per row."""
    cls, gemm, activation, block_scale, extra = FORMS[name]
    rec = trace(fusion, cls, o_proj(144, padding_bytes=8, **extra), heads=3, v=48)
    (quant,) = nodes_calling(rec.before, torch.ops._C.scaled_fp4_quant.out)
    assert list(buffer(quant, "output").args[0])[1] == 80
    assert_refused(rec, fusion, "quant_buffers_padded")


def test_trtllm_with_8x4_scales_is_refused_and_left_alone(fusion):
    """Traced at 16 tokens (m <= 32), ``scaled_fp4_quant`` takes FlashInfer's 8x4-scale quant and the GEMM
    ``use_8x4_sf_layout=True``: another scale layout, never rewritten."""
    rec = trace(fusion, fi_kernels.FlashInferTrtllmNvFp4LinearKernel, o_proj(256), heads=4, v=64, tokens=16)
    (quant,) = nodes_calling(rec.before, torch.ops.vllm.flashinfer_nvfp4_quantize.default)
    (gemm,) = nodes_calling(rec.before, torch.ops.vllm.flashinfer_mm_fp4.default)
    assert argument(gemm, "use_8x4_sf_layout") is True and argument(gemm, "backend") == "trtllm"
    assert nodes_calling(rec.before, torch.ops._C.scaled_fp4_quant.out) == []
    assert_refused(rec, fusion, "gemm_scale_layout_8x4")


def test_trtllm_gemm_told_to_read_8x4_scales_from_the_128x4_quant_is_refused(fusion, monkeypatch):
    """The GEMM form's own refusal: a ``flashinfer_mm_fp4`` call with ``use_8x4_sf_layout=True`` reading the
    128x4 quant's scales (vLLM's two ``m <= 32`` tests disagreeing; here forced) is refused too."""
    def forced(a, b, block_scale_a, block_scale_b, alpha, out_dtype, backend, **kwargs):
        return torch.ops.vllm.flashinfer_mm_fp4(a, b.t(), block_scale_a, block_scale_b.t(), alpha, out_dtype, True,
                                                backend)
    monkeypatch.setattr(fi_kernels, "flashinfer_scaled_fp4_mm", forced)
    rec = trace(fusion, fi_kernels.FlashInferTrtllmNvFp4LinearKernel, o_proj(256), heads=4, v=64)
    assert len(nodes_calling(rec.before, torch.ops._C.scaled_fp4_quant.out)) == 1
    assert_refused(rec, fusion, "gemm_scale_layout_8x4")


CPU_BUILD_PROBE = textwrap.dedent('''
    import torch
    import fusion_pass_vllm
    from fusion_pass.vllm.compile.vocabulary import vllm_gemm_forms, vllm_vocabulary
    fusion_pass_vllm.PASS.fusion()
    vocab = vllm_vocabulary()
    print("QUANT", vocab.nvfp4_quant)
    print("FORMS", [f.name for f in vocab.nvfp4_gemms])
    print("REFUSED", sorted(reason for _, reason in vocab.refused_quants))
''')


def test_on_the_cpu_build_the_vocabulary_builds_without_the_cuda_ops():
    """Without the stand-ins (a fresh process): forms whose op is absent are left out, not errors."""
    proc = subprocess.run([sys.executable, "-c", CPU_BUILD_PROBE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    if "QUANT _C." in proc.stdout:
        pytest.skip("this vLLM build has the CUDA ops")
    assert "QUANT fusion_pass.scaled_fp4_quant.out" in proc.stdout
    assert "FORMS ['fusion_pass::nvfp4_gemm', 'vllm:torch_scaled_mm']" in proc.stdout, proc.stdout
    refused = next(line for line in proc.stdout.splitlines() if line.startswith("REFUSED "))
    # no FlashInfer NVFP4 quant on the CPU build; its stubs of the FP8 quants are refused under their names
    assert set(eval(refused.removeprefix("REFUSED "))) <= {f.name for f in formats.REFUSED}, refused
