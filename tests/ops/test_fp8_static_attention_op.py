"""The attention ops' static per-tensor FP8 form (vLLM's convention for a static-FP8 fused attention call): ``output``
float8_e4m3fn ``[T, H*Dv]`` contiguous, ``output_scale`` the checkpoint's float32 scale (one element), no
``output_block_scale``. Bad arguments are refused naming the argument before the KV cache or the counters change;
the op runs eagerly and under torch.compile with the same bytes.
"""

from __future__ import annotations

import random

import pytest
import torch

import fusion_pass  # noqa: F401  (registers the ops)
from fusion_pass import runtime
from fusion_pass.nvfp4 import ArgumentError
from fusion_pass.runtime import counters

OPS = torch.ops.fusion_pass
FP8 = torch.float8_e4m3fn
MLA = dict(num_heads=2, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=32)
GQA = dict(num_heads=4, num_kv_heads=2, head_dim=16, v_head_dim=8)


@pytest.fixture(autouse=True)
def _clean_state(clean_backend_state):
    yield


@pytest.fixture(params=["mla", "gqa"])
def layer(request):
    """``(name, impl, op, make_inputs(t, generator, dtype), width)``, registered for the test."""
    gen = torch.Generator().manual_seed(3)
    if request.param == "mla":
        d = MLA
        weight = torch.randn(d["num_heads"] * (d["qk_nope_head_dim"] + d["v_head_dim"]), d["kv_lora_rank"],
                             generator=gen) * 0.2
        impl = runtime.MLAAttentionImpl(**d, kv_b_proj_weight=weight, softmax_scale=0.2)
        op = OPS.mla_attention_with_output

        def make(t, g, dtype):
            return (torch.randn(t, 2, 24, generator=g).to(dtype), torch.randn(t, 32, generator=g).to(dtype),
                    torch.randn(t, 1, 8, generator=g).to(dtype))
    else:
        impl = runtime.AttentionImpl(**GQA, softmax_scale=0.25)
        op = OPS.attention_with_output

        def make(t, g, dtype):
            return (torch.randn(t, 4, 16, generator=g).to(dtype), torch.randn(t, 2, 16, generator=g).to(dtype),
                    torch.randn(t, 2, 8, generator=g).to(dtype))
    name = f"test_fp8_static_attention_op.{request.param}"
    runtime.register_layer(name, impl)
    yield name, impl, op, make, impl.num_heads * impl.v_head_dim
    runtime.unregister_layer(name)


def _bad_calls(t, width):
    """``(what, output, output_scale, output_block_scale, q dtype, message)``: each refused naming the argument."""
    good_out, good_scale = torch.empty(t, width, dtype=FP8), torch.tensor([0.01])
    return [
        ("too few elements", torch.empty(t, width - 1, dtype=FP8), good_scale, None, None,
         rf"output must be a contiguous float8_e4m3fn tensor of {t * width} elements "
         rf"\(\[T, H\*Dv\] = \[{t}, {width}\], or \[T, H, Dv\]\)"),
        ("not contiguous", torch.empty(width, t, dtype=FP8).t(), good_scale, None, None, r"output .*not contiguous"),
        ("scale float16", good_out, torch.tensor([0.01], dtype=torch.float16), None, None,
         r"output_scale .*one-element float32 tensor"),
        ("scale of two elements", good_out, torch.tensor([0.01, 0.02]), None, None,
         r"output_scale .*one-element float32 tensor"),
        ("group scales", good_out, good_scale, torch.empty(t, width // 8 or 1), None,
         r"output_block_scale must be None with a float8_e4m3fn output .*group scales takes quant_group_size"),
        ("float64 queries", good_out, good_scale, None, torch.float64, r"FP8_STATIC output needs q of float16"),
        ("transposed shape", torch.empty(width, t, dtype=FP8), good_scale, None, None,
         rf"output must be a contiguous float8_e4m3fn tensor .*or \[T, H, Dv\]\), got torch.float8_e4m3fn "
         rf"\[{width}, {t}\]"),
        ("another fp8 dtype", torch.empty(t, width, dtype=torch.float8_e5m2), good_scale, None, None,
         r"output_scale alone, output must be float8_e4m3fn \(static FP8\), got torch.float8_e5m2"),
    ]


@pytest.mark.parametrize("case", range(8), ids=["numel", "contiguity", "scale_dtype", "scale_numel", "block_scale",
                                                "q_dtype", "shape", "e5m2"])
def test_bad_arguments_are_refused_before_the_cache_or_the_counters_change(layer, case):
    name, impl, op, make, width = layer
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    first, spec = runtime.BatchSpec.from_lens([5]), runtime.BatchSpec.from_lens([1, 4], [5, 0], ["r0", "n1"])
    x0, x1 = make(first.num_tokens, gen, torch.bfloat16), make(spec.num_tokens, gen, torch.bfloat16)
    scale = torch.tensor([0.01])
    with runtime.batch(first):
        op(*x0, torch.empty(first.num_tokens, width, dtype=FP8), name, scale)
    before = counters.counters()
    what, output, output_scale, block, q_dtype, message = _bad_calls(spec.num_tokens, width)[case]
    bad_inputs = x1 if q_dtype is None else (x1[0].to(q_dtype), *x1[1:])
    with runtime.batch(spec), pytest.raises(ArgumentError, match=message):
        op(*bad_inputs, output, name, output_scale, block)
    assert counters.counters() == before, f"{what}: a refused call is not counted (seed {seed})"
    # the cache is as before: the valid call finds r0 with its 5 cached tokens, and writes the bytes of a fresh run
    got = torch.empty(spec.num_tokens, width, dtype=FP8)
    with runtime.batch(spec):
        op(*x1, got, name, scale)
    impl.clear_cache()
    with runtime.batch(first):
        op(*x0, torch.empty(first.num_tokens, width, dtype=FP8), name, scale)
    want = torch.empty(spec.num_tokens, width, dtype=FP8)
    with runtime.batch(spec):
        op(*x1, want, name, scale)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{what} (seed {seed})"


def test_an_output_of_shape_t_h_dv_is_accepted_as_vllm_passes_it(layer):
    """vLLM's attention layer views its ``[T, H*Dv]`` output as ``[T, H, Dv]`` before the op: the same bytes."""
    name, impl, op, make, width = layer
    spec = runtime.BatchSpec.from_lens([6, 3])
    x = make(spec.num_tokens, torch.Generator().manual_seed(2), torch.float16)
    scale = torch.tensor([0.004])
    outs = []
    for shape in ((spec.num_tokens, width), (spec.num_tokens, impl.num_heads, impl.v_head_dim)):
        impl.clear_cache()
        out = torch.empty(shape, dtype=FP8)
        with runtime.batch(spec):
            op(*x, out, name, scale)
        outs.append(out.view(torch.uint8).reshape(spec.num_tokens, width))
    assert torch.equal(outs[0], outs[1])
    assert counters.counters(output_format="fp8_static")["fused_by_backend"] == {"reference": 2}


def test_the_op_under_torch_compile_writes_the_eager_bytes(layer):
    """A small module calling the op with FP8 buffers, compiled with a dynamic token count: the same bytes as
    eager, one graph for every batch size, the calls counted as FP8 static."""
    name, impl, op, make, width = layer

    class Block(torch.nn.Module):
        def forward(self, q, k, v, scale):
            out = torch.empty(q.shape[0], width, dtype=FP8, device=q.device)
            op(q, k, v, out, name, scale)
            return out  # (no FP8 arithmetic in the graph: Inductor's CPU code for float8 loads is not what is tested)

    block = Block()
    torch._dynamo.reset()
    frames = []
    from torch._inductor.compile_fx import compile_fx

    compiled = torch.compile(block, fullgraph=True, dynamic=True,
                             backend=lambda gm, example: frames.append(gm) or compile_fx(gm, example))
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.005])
    for lens in ([6, 5], [7, 2, 4]):  # token counts equal to no layer dim (duck sizing would tie them)
        spec = runtime.BatchSpec.from_lens(lens, request_ids=[f"{len(lens)}.{i}" for i in range(len(lens))])
        x = make(spec.num_tokens, gen, torch.bfloat16)
        results = []
        for fn in (compiled, block):
            impl.clear_cache()
            with runtime.batch(spec):
                results.append(fn(*x, scale).view(torch.uint8))
        assert torch.equal(results[0], results[1]), f"lens {lens} (seed {seed})"
        assert len({int(b) for b in results[0].reshape(-1)}) > 16, "real FP8 bytes, not a constant"
    assert len(frames) == 1, "one graph for every token count"
    assert counters.counters(output_format="fp8_static")["fused"] == 4
