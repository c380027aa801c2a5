"""The project's FP8 quant ops (``torch.ops.fusion_pass.static_scaled_fp8_quant`` / ``per_token_group_fp8_quant``):
vLLM's schemas, the bytes of :mod:`fusion_pass.fp8`, every scale layout, their argument errors, and a trace under
torch.compile (fake implementations)."""

from __future__ import annotations

import random

import pytest
import torch

import fusion_pass.ops  # noqa: F401  (registers the ops)
from fusion_pass import fp8
from fusion_pass.nvfp4 import ArgumentError

ops = torch.ops.fusion_pass


def fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


def test_schemas_mirror_vllms():
    static = ops.static_scaled_fp8_quant.default._schema.arguments
    assert [(a.name, a.is_write) for a in static] == [("result", True), ("input", False), ("scale", False),
                                                      ("group_shape", False)]
    assert static[3].default_value is None
    args = [a.name for a in ops.per_token_group_fp8_quant.default._schema.arguments]
    assert args == ["input", "output_q", "output_s", "group_size", "eps", "fp8_min", "fp8_max", "scale_ue8m0",
                    "dummy_is_scale_transposed", "dummy_is_tma_aligned"]


@pytest.mark.parametrize("group_shape", [None, [-1, -1]])
def test_static_op_writes_the_reference_bytes(group_shape):
    seed = fresh_seed()
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    x[3, 7] = float("nan")
    scale = torch.tensor([x.float().nan_to_num().abs().max().item() / 400], dtype=torch.float32)
    result = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    ops.static_scaled_fp8_quant(result, x, scale, group_shape)
    want = fp8.quantize_static(x, fp8.reciprocal(scale))
    assert torch.equal(result.view(torch.uint8), want.view(torch.uint8)), seed
    assert result.view(torch.uint8)[3, 7].item() == 0x7E


@pytest.mark.parametrize("layout", list(fp8.ScaleLayout))
@pytest.mark.parametrize("ue8m0", [False, True])
def test_group_op_writes_the_reference_bytes_in_every_layout(layout, ue8m0):
    seed = fresh_seed()
    t = random.Random(seed).randint(1, 70)
    x = torch.randn(t, 512, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    s = fp8.group_scale_buffer(t, 512, layout)
    strides = s.stride()
    col = layout is not fp8.ScaleLayout.ROW_MAJOR
    ops.per_token_group_fp8_quant(x, q, s, 128, 1e-10, -448.0, 448.0, ue8m0, col,
                                  layout is fp8.ScaleLayout.COLUMN_MAJOR_TMA)
    want_q, want_s = fp8.quantize_group(x, ue8m0=ue8m0)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), seed
    assert torch.equal(s, want_s) and s.stride() == strides, seed


@pytest.mark.parametrize("call, match", [
    (lambda: ops.static_scaled_fp8_quant(torch.empty(2, 16, dtype=torch.float8_e4m3fn), torch.ones(2, 16),
                                         torch.ones(1), [1, 128]), r"group_shape must be None or \[-1, -1\]"),
    (lambda: ops.static_scaled_fp8_quant(torch.empty(2, 8, dtype=torch.float8_e4m3fn), torch.ones(2, 16),
                                         torch.ones(1)), "result must be float8_e4m3fn of the input's shape"),
    (lambda: ops.static_scaled_fp8_quant(torch.empty(2, 16, dtype=torch.float8_e4m3fn), torch.ones(2, 16),
                                         torch.ones(2)), "scale must be a one-element float32"),
    (lambda: ops.per_token_group_fp8_quant(torch.ones(2, 256), torch.empty(2, 256, dtype=torch.float8_e4m3fn),
                                           torch.empty(2, 3), 128, 1e-10, -448.0, 448.0, False, False, False),
     r"output_s must be float32 \[2, 2\]"),
    (lambda: ops.per_token_group_fp8_quant(torch.ones(2, 200), torch.empty(2, 200, dtype=torch.float8_e4m3fn),
                                           torch.empty(2, 1), 128, 1e-10, -448.0, 448.0, False, False, False),
     "divisible by the group size 128"),
    (lambda: ops.per_token_group_fp8_quant(torch.ones(2, 256), torch.empty(2, 256, dtype=torch.float8_e4m3fn),
                                           torch.empty(2, 2), 128, 1e-10, -240.0, 240.0, False, False, False),
     "fp8_min / fp8_max must be -448 / 448"),
])
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ArgumentError, match=match):
        call()


def test_the_ops_trace_under_torch_compile():
    def f(x, scale):
        a = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
        ops.static_scaled_fp8_quant(a, x, scale, [-1, -1])
        q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
        s = torch.empty(x.shape[0], x.shape[1] // 128, dtype=torch.float32)
        ops.per_token_group_fp8_quant(x, q, s, 128, 1e-10, -448.0, 448.0, True, False, False)
        return a.view(torch.uint8), q.view(torch.uint8), s

    x = torch.randn(9, 256).to(torch.bfloat16)
    scale = torch.tensor([0.01])
    got = torch.compile(f, fullgraph=True)(x, scale)
    want = f(x, scale)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
