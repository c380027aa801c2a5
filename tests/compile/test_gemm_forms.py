"""The GEMM end of a match: a vocabulary's NVFP4 GEMM forms (:class:`fusion_pass.patterns.GemmForm`).

A match needs the quant's packed codes and its block scales to reach one call of a form, as the form's
activation and block-scale arguments, through steps that keep their bytes (views, dtype views, copies; the
codes may also be zero-padded per row, as vLLM pads them for a weight whose K it padded). A form may expect
argument values (else the call is another format) and refuse some (another scale layout, with its reason).
vLLM's forms are tested against vLLM's kernel classes in ``tests_vllm/test_vllm_gemm_forms.py``; here the
project's own ops and GEMM ops defined by this test (namespace ``fusion_pass_test_gemm``).

Graphs come out of a real ``torch.compile`` (Dynamo, AOT autograd, Inductor's post-grad passes); the compile
stops right after the pass, nothing runs, and the graph is read without the matcher.
"""

from __future__ import annotations

import dataclasses
import operator

import pytest
import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from torch.library import Library

from fusion_pass.compile.graph_pass import FusionPass
from fusion_pass.ops import scaled_fp4_quant
from fusion_pass.patterns import GemmForm, fusion_pass_vocabulary

OPS = torch.ops.fusion_pass
HOPS = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)
H, DV, LORA, ROPE, T, N = 2, 32, 32, 8, 12, 32
K = H * DV  # 64 elements, 32 packed bytes, 4 scale bytes per row
LAYER = "test_gemm_forms.attn"

_lib = Library("fusion_pass_test_gemm", "DEF")
_lib.define("mm(Tensor x, Tensor w, Tensor x_scale, Tensor w_scale, bool small, str mode) -> Tensor")
_lib.define("mm_out(Tensor! out, Tensor x, Tensor w, Tensor x_scale, Tensor w_scale) -> ()")
_lib.define("quant_8x4(Tensor x, Tensor gs) -> (Tensor, Tensor)")
torch.library.register_fake("fusion_pass_test_gemm::mm",
                            lambda x, w, x_scale, w_scale, small, mode: x.new_empty(x.shape[0], w.shape[0],
                                                                                    dtype=torch.bfloat16), lib=_lib)
torch.library.register_fake("fusion_pass_test_gemm::mm_out", lambda *args: None, lib=_lib)
torch.library.register_fake("fusion_pass_test_gemm::quant_8x4",
                            lambda x, gs: (x.new_empty(x.shape[0], x.shape[1] // 2, dtype=torch.uint8),
                                           x.new_empty((x.shape[0] + 7) // 8 * 8, 4, dtype=torch.uint8)), lib=_lib)
TEST = torch.ops.fusion_pass_test_gemm

TEST_FORMS = (
    GemmForm("test:mm", TEST.mm.default, "x", "x_scale", expects=(("mode", "nvfp4"),),
             refuses=(("small", True, "gemm_scale_layout_8x4"),)),
    GemmForm("test:mm_out", TEST.mm_out.default, "x", "x_scale"),
)


def vocabulary(with_test_forms: bool = False):
    vocab = fusion_pass_vocabulary()
    if not with_test_forms:
        return vocab
    return dataclasses.replace(vocab, nvfp4_gemms=vocab.nvfp4_gemms + TEST_FORMS,
                               refused_quants=((TEST.quant_8x4.default, "gemm_scale_layout_8x4"),))


@pytest.fixture(params=["v1", "v2"])
def form(request):
    return request.param


class Stop(Exception):
    pass


class Recorder:
    def __init__(self, fusion):
        self.fusion, self.before, self.after = fusion, None, None

    def __call__(self, graph):
        self.before = _snapshot(graph)
        self.fusion(graph)
        self.after = _snapshot(graph)
        raise Stop()

    def uuid(self):
        return None


def _snapshot(graph):
    copy = torch.fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    return copy


def compile_until_the_pass(o_proj, form: str = "v1", with_test_forms: bool = False):
    """MLA attention (the project's op: it needs no registered layer to trace) -> ``o_proj(out)``."""
    fusion = FusionPass(patterns=("mla_attention_nvfp4_quant",), vocabularies=(vocabulary(with_test_forms),))
    rec = Recorder(fusion)

    def block(q, kv_c, k_pe):
        out = torch.empty(q.shape[0], K, dtype=q.dtype)
        OPS.mla_attention_with_output(q, kv_c, k_pe, out, LAYER)
        return o_proj(out)

    bf = torch.bfloat16
    inputs = (torch.randn(T, H, 16 + ROPE, dtype=bf), torch.randn(T, LORA, dtype=bf), torch.randn(T, 1, ROPE, dtype=bf))
    for x in inputs:
        torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.reset()
    with inductor_config.patch(enable_auto_functionalized_v2=form == "v2", fx_graph_cache=False):
        with pytest.raises(Exception):
            torch.compile(block, options={"post_grad_custom_post_pass": rec})(*inputs)
    assert rec.after is not None, "the compile did not reach the pass"
    torch._dynamo.reset()
    return rec, fusion.graphs[-1]


GS, ALPHA = torch.ones(1), torch.ones(1)


def weights(packed_k: int = K // 2):
    return torch.zeros(N, packed_k, dtype=torch.uint8), torch.zeros(128, 4, dtype=torch.float8_e4m3fn)


def wrapped(node):
    return node.args[0] if node.op == "call_function" and node.target in HOPS else None


def called(graph, op):
    return [n for n in graph.nodes if (wrapped(n) or n.target) is op]


def result_of(node):
    """The call a GEMM argument comes from, back through views, dtype views and padding."""
    while node.target is not operator.getitem:
        node = node.args[0]
    return node.args[0]


def assert_rewritten(rec, report, gemm_op, activation_index: int, scale_index: int, *, wrapped_gemm=False):
    assert (report.candidates, report.rewritten, report.refused) == (1, 1, {}), report
    assert called(rec.after, OPS.scaled_fp4_quant.out) == []
    (attention,) = called(rec.after, OPS.mla_attention_with_output.default)
    (gemm,) = called(rec.after, gemm_op)
    args = list(gemm.kwargs.values()) if wrapped_gemm else gemm.args
    assert result_of(args[activation_index]) is attention, gemm.format_node()
    assert result_of(args[scale_index]) is attention, gemm.format_node()
    rec.after.lint()


def assert_refused(rec, report, reason: str):
    assert (report.candidates, report.rewritten, report.refused) == (1, 0, {reason: 1}), report
    assert rec.after.python_code("self").src == rec.before.python_code("self").src


# ---------------------------------------------------------------- the project's own form


def test_the_project_vocabulary_has_one_gemm_form():
    vocab = fusion_pass_vocabulary()
    (form,) = vocab.nvfp4_gemms
    assert (form.op, form.activation, form.block_scale) == (OPS.nvfp4_gemm.default, "a", "block_scale_a")
    assert vocab.nvfp4_gemm is OPS.nvfp4_gemm.default and vocab.refused_quants == ()


def test_codes_zero_padded_per_row_still_feed_the_gemm(form):
    """``constant_pad_nd(codes, [0, 8], 0)``: each row gains 8 zero bytes; the fused call writes the same codes."""
    w, w_sf = weights(K // 2 + 8)

    def o_proj(x):
        x_fp4, x_sf = scaled_fp4_quant(x, GS)
        return OPS.nvfp4_gemm(F.pad(x_fp4, (0, 8)).contiguous(), w, x_sf, w_sf, ALPHA, torch.bfloat16)

    rec, report = compile_until_the_pass(o_proj, form)
    (pad,) = called(rec.after, torch.ops.aten.constant_pad_nd.default)
    assert list(pad.args[1]) == [0, 8]
    assert_rewritten(rec, report, OPS.nvfp4_gemm.default, 0, 2)


@pytest.mark.parametrize("pad, value", [((8, 0), 0), ((0, 8), 1)], ids=["left", "nonzero"])
def test_other_padding_is_not_a_gemm_input(pad, value):
    """Codes padded on the left, or with non-zero bytes, are no longer the quant's rows as they were."""
    w, w_sf = weights(K // 2 + 8)

    def o_proj(x):
        x_fp4, x_sf = scaled_fp4_quant(x, GS)
        return OPS.nvfp4_gemm(F.pad(x_fp4, pad, value=value), w, x_sf, w_sf, ALPHA, torch.bfloat16)

    assert_refused(*compile_until_the_pass(o_proj), "no_nvfp4_gemm_consumer")


def test_a_gemm_reading_other_block_scales_is_not_a_form_call():
    w, w_sf = weights()
    other = torch.zeros(128, 4, dtype=torch.float8_e4m3fn)

    def o_proj(x):
        x_fp4, _ = scaled_fp4_quant(x, GS)
        return OPS.nvfp4_gemm(x_fp4, w, other, w_sf, ALPHA, torch.bfloat16)

    assert_refused(*compile_until_the_pass(o_proj), "no_nvfp4_gemm_consumer")


def test_a_quant_into_k_padded_buffers_is_refused():
    """vLLM's ``padded_n``: buffers for 80 elements per row, the attention writes 64."""
    w, w_sf = weights(K // 2 + 8)

    def o_proj(x):
        packed = torch.empty(x.shape[0], K // 2 + 8, dtype=torch.uint8)
        scales = torch.empty((x.shape[0] + 127) // 128 * 128, 2, dtype=torch.int32)
        OPS.scaled_fp4_quant.out(x, GS, True, output=packed, output_scale=scales)
        return OPS.nvfp4_gemm(packed, w, scales.view(torch.float8_e4m3fn), w_sf, ALPHA, torch.bfloat16)

    assert_refused(*compile_until_the_pass(o_proj), "quant_buffers_padded")


# ---------------------------------------------------------------- forms of other libraries (test ops)


@pytest.mark.parametrize("small, mode, outcome", [(False, "nvfp4", None), (True, "nvfp4", "gemm_scale_layout_8x4"),
                                                  (False, "mxfp4", "no_nvfp4_gemm_consumer")],
                         ids=["taken", "refused_by_its_form", "another_mode"])
def test_a_form_expects_and_refuses_argument_values(small, mode, outcome):
    w, w_sf = weights()

    def o_proj(x):
        x_fp4, x_sf = scaled_fp4_quant(x, GS)
        return TEST.mm(x_fp4, w, x_sf.view(torch.uint8).view(-1), w_sf, small, mode)

    rec, report = compile_until_the_pass(o_proj, with_test_forms=True)
    if outcome is None:
        assert_rewritten(rec, report, TEST.mm.default, 0, 2)
    else:
        assert_refused(rec, report, outcome)


def test_a_gemm_form_is_not_matched_by_a_vocabulary_without_it():
    w, w_sf = weights()

    def o_proj(x):
        x_fp4, x_sf = scaled_fp4_quant(x, GS)
        return TEST.mm(x_fp4, w, x_sf, w_sf, False, "nvfp4")

    assert_refused(*compile_until_the_pass(o_proj), "no_nvfp4_gemm_consumer")


def test_a_mutating_gemm_in_both_functionalized_forms(form):
    """A GEMM writing its output buffer (as vLLM's ``_C::cutlass_scaled_fp4_mm``) is wrapped in
    auto_functionalized[_v2]: its inputs are keyword arguments of the wrapper."""
    w, w_sf = weights()

    def o_proj(x):
        x_fp4, x_sf = scaled_fp4_quant(x, GS)
        out = torch.empty(x_fp4.shape[0], N, dtype=torch.bfloat16)
        TEST.mm_out(out, x_fp4, w, x_sf, w_sf)
        return out

    rec, report = compile_until_the_pass(o_proj, form, with_test_forms=True)
    assert report.rewritten == 1, report
    (gemm,) = called(rec.after, TEST.mm_out.default)
    (attention,) = called(rec.after, OPS.mla_attention_with_output.default)
    assert result_of(gemm.kwargs["x"]) is attention and result_of(gemm.kwargs["x_scale"]) is attention
    assert called(rec.after, OPS.scaled_fp4_quant.out) == []


def test_a_quant_writing_another_scale_layout_is_refused_with_its_reason():
    w, w_sf = weights()

    def o_proj(x):
        x_fp4, x_sf = TEST.quant_8x4(x, GS)
        return TEST.mm(x_fp4, w, x_sf, w_sf, True, "nvfp4")

    rec, report = compile_until_the_pass(o_proj, with_test_forms=True)
    assert (report.candidates, report.rewritten, report.refused) == (1, 0, {"gemm_scale_layout_8x4": 1}), report
    assert rec.after.python_code("self").src == rec.before.python_code("self").src


def test_form_checks():
    form = TEST_FORMS[0]
    assert form.takes({"mode": "nvfp4"}) and not form.takes({"mode": "mxfp4"}) and not form.takes({})
    assert form.refusal({"small": True}) == "gemm_scale_layout_8x4" and form.refusal({"small": False}) is None
    node = torch.fx.Graph().placeholder("small")
    assert form.refusal({"small": node}) == "gemm_scale_layout_8x4"  # known only at run time: refused
    assert not form.takes({"mode": node})
    assert form.fits(TEST.mm.default) and not form.fits(None) and not form.fits(TEST.mm_out.default)
