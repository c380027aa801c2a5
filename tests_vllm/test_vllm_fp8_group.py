"""FP8 128-column groups in the vLLM integration without an engine: the vocabulary's binding (the group quant op this
build has, the group GEMM forms present), the run-time rows' quant (the bound op's bytes in each of vLLM's three scale
layouts, into chosen rows only) and the fused op's checks of a group call's buffers. (The engine test:
test_vllm_fp8_group_engine.py.)"""

import pytest
import torch

import fusion_pass_vllm
from fusion_pass import fp8, formats
from fusion_pass.vllm.runtime import attention_op, fp8_group_rows
from fusion_pass.runtime.fp8_group_rows import GroupQuant

FP8 = torch.float8_e4m3fn
LAYOUTS = list(fp8.ScaleLayout)


def test_the_vocabulary_binds_the_group_quant_and_its_gemm_forms():
    from fusion_pass.vllm.compile.vocabulary import VLLM_FP8_GROUP_GEMM_FORMS, vllm_vocabulary

    fusion_pass_vllm.PASS.fusion()
    vocab = vllm_vocabulary()
    assert vocab.fp8_group_quant is fp8_group_rows.group_quant_op() is fp8_group_rows.quant_op()
    assert vocab.fp8_group_quant not in vocab.other_quants  # bound as a format, no longer "another format"
    c_op = getattr(getattr(torch.ops, "_C", None), "per_token_group_fp8_quant", None)
    if c_op is None or not {"output_q", "output_s"} <= {a.name for a in c_op.default._schema.arguments}:
        assert vocab.fp8_group_quant is torch.ops.fusion_pass.per_token_group_fp8_quant.default
        assert not fp8_group_rows.divides(), "the project's op multiplies by the reciprocal"
    present = [name for name, (ns, op, _, act, scale), _ in VLLM_FP8_GROUP_GEMM_FORMS
               if hasattr(getattr(torch.ops, ns), op)
               and {act, scale} <= {a.name for a in getattr(getattr(torch.ops, ns), op).default._schema.arguments}]
    assert [g.name for g in vocab.fp8_group_gemms] == ["fusion_pass::fp8_group_gemm"] + [f"vllm:{n}" for n in present]
    assert all(g.format == "fp8_group128" for g in vocab.fp8_group_gemms)
    form = vocab.quant_form("fp8_group128")
    assert form.op is vocab.fp8_group_quant and form.scale_input is None and form.buffers == ("output_q", "output_s")
    fused = vocab.fused_attention._schema.arguments
    assert [a.name for a in fused][-5:] == ["quant_group_size", "quant_scale_ue8m0", "quant_col_major",
                                            "quant_tma_aligned", "output_inv_scale"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
@pytest.mark.parametrize("ue8m0", [False, True])
def test_write_rows_are_the_bound_ops_bytes_in_those_rows_only(layout, ue8m0):
    g = torch.Generator().manual_seed(7)
    t, width = 9, 256
    codes = torch.full((t, width), 0x55, dtype=torch.uint8).view(FP8)
    scales = fp8.group_scale_buffer(t, width, layout)
    scales.fill_(-1.0)
    values = (torch.randn(4, width, generator=g) * 3).to(torch.bfloat16)
    values[1, 5] = float("nan")
    quant = GroupQuant(ue8m0=ue8m0, divide=False)
    rows = torch.tensor([7, 0, 3, 5])
    fp8_group_rows.write_rows(values[:4], codes, scales, rows, quant)
    fp8_group_rows.write_rows(values[:2], codes, scales, slice(1, 3), quant)
    want_q, want_s = fp8.quantize_group(values.float(), ue8m0=ue8m0)
    for got_row, i in [*zip(rows.tolist(), range(4)), (1, 0), (2, 1)]:
        assert torch.equal(codes[got_row].view(torch.uint8), want_q[i].view(torch.uint8)), (got_row, i)
        assert torch.equal(scales[got_row], want_s[i]), (got_row, i)
    untouched = [r for r in range(t) if r not in (0, 1, 2, 3, 5, 7)]
    assert bool((codes[untouched].view(torch.uint8) == 0x55).all()) and bool((scales[untouched] == -1).all())


@pytest.mark.parametrize("case, message", [
    ("group_64", "quant_group_size must be 128"),
    ("output_scale", "output_scale must be None with quant_group_size"),
    ("bf16_output", "output must be contiguous float8_e4m3fn"),
    ("scales_shape", r"output_block_scale must be the float32 group scales \[8, 2\]"),
    ("scales_strides", "output_block_scale must be the float32 group scales"),
    ("inv_scale", "output_inv_scale must be None with quant_group_size"),
])
def test_group_calls_are_checked_before_anything_is_written(case, message):
    t, width = 8, 256
    output = torch.empty(t, width, dtype=FP8)
    scales = torch.empty(t, 2)
    args = dict(output=output, output_scale=None, output_block_scale=scales, output_inv_scale=None, group=(128, False))
    if case == "group_64":
        args["group"] = (64, False)
    elif case == "output_scale":
        args["output_scale"] = torch.ones(1)
    elif case == "bf16_output":
        args["output"] = torch.empty(t, width, dtype=torch.bfloat16)
    elif case == "scales_shape":
        args["output_block_scale"] = torch.empty(t, 4)
    elif case == "scales_strides":
        args["output_block_scale"] = torch.empty(t, 4)[:, ::2]
    elif case == "inv_scale":
        args["output_inv_scale"] = torch.ones(1)
    with pytest.raises(ValueError, match=message):
        attention_op._format(args["output"], args["output_scale"], args["output_block_scale"],
                             args["output_inv_scale"], args["group"])


def test_a_group_call_reads_its_format_and_arithmetic():
    output, scales = torch.empty(4, 128, dtype=FP8), fp8.group_scale_buffer(4, 128, fp8.ScaleLayout.COLUMN_MAJOR_TMA)
    for ue8m0, fmt in ((False, formats.FP8_GROUP128), (True, formats.FP8_GROUP128_UE8M0)):
        got, quant, scale = attention_op._format(output, None, scales, None, (128, ue8m0))
        assert got is fmt and quant == GroupQuant(ue8m0, fp8_group_rows.divides()) and scale is None
