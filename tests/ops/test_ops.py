"""The torch.ops.fusion_pass op library: eager semantics, buffers, errors, and tracing with fake impls."""

import pytest
import torch

import fusion_pass  # noqa: F401  (registers the ops)
from fusion_pass import nvfp4, runtime
from fusion_pass.ops import scaled_fp4_quant

OPS = torch.ops.fusion_pass


def _gs(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor([448.0 * 6.0 / x.float().abs().max().item()])


# ---------------------------------------------------------------- scaled_fp4_quant


@pytest.mark.parametrize("m", [1, 5, 128, 130, 257])
@pytest.mark.parametrize("k", [16, 64, 80])
def test_quant_wrapper_allocates_like_vllm_and_matches_reference(m, k):
    x = torch.randn(m, k, dtype=torch.bfloat16)
    gs = _gs(x)
    packed, scales = scaled_fp4_quant(x, gs)
    rows = (m + 127) // 128 * 128
    cols = ((k // 16 + 3) // 4) * 4
    assert packed.dtype == torch.uint8 and packed.shape == (m, k // 2)
    assert scales.dtype == torch.float8_e4m3fn and scales.shape == (rows, cols)
    assert scales.untyped_storage().nbytes() == rows * cols  # an int32 [rows, cols/4] allocation viewed
    ref_packed, ref_scales = nvfp4.quantize(x, gs)
    assert torch.equal(packed, ref_packed)
    assert torch.equal(scales.view(torch.uint8), ref_scales.view(torch.uint8))


def test_quant_wrapper_linear_layout():
    x = torch.randn(3, 2, 48, dtype=torch.float16)
    gs = _gs(x)
    packed, scales = scaled_fp4_quant(x, gs, is_sf_swizzled_layout=False)
    assert packed.shape == (6, 24) and scales.shape == (6, 3)
    ref_packed, ref_scales = nvfp4.quantize(x, gs, swizzled=False)
    assert torch.equal(packed, ref_packed)
    assert torch.equal(scales.view(torch.uint8), ref_scales.view(torch.uint8))


def test_quant_out_overwrites_every_byte_including_padding():
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    output = torch.full((5, 16), 0xAB, dtype=torch.uint8)
    output_scale = torch.full((128, 1), -1, dtype=torch.int32)  # 0xFF bytes: NaN in e4m3
    OPS.scaled_fp4_quant.out(x, _gs(x), True, output=output, output_scale=output_scale)
    packed, scales = nvfp4.quantize(x, _gs(x))
    assert torch.equal(output, packed)
    # the 0xFF poison is gone everywhere: real scales where they belong, zeros in the padding
    assert torch.equal(output_scale.view(torch.uint8).view(128, 4), scales.view(torch.uint8))
    assert int((scales.view(torch.uint8) != 0).sum()) == 5 * 2


@pytest.mark.parametrize(
    "output, output_scale, match",
    [
        (torch.empty(4, 16, dtype=torch.int8), torch.empty(128, 1, dtype=torch.int32), "output must be uint8"),
        (torch.empty(4, 8, dtype=torch.uint8), torch.empty(128, 1, dtype=torch.int32), "output must be uint8"),
        (torch.empty(4, 16, dtype=torch.uint8), torch.empty(4, 2, dtype=torch.uint8), "output_scale must hold 128x4"),
    ],
)
def test_quant_out_rejects_bad_buffers(output, output_scale, match):
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        OPS.scaled_fp4_quant.out(x, _gs(x), True, output=output, output_scale=output_scale)


def test_quant_rejects_bad_input():
    with pytest.raises(ValueError, match="divisible by 16"):
        scaled_fp4_quant(torch.randn(4, 24), torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"input_global_scale \(the global scale\)"):
        scaled_fp4_quant(torch.randn(4, 32), torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.randn(4, 32), 100.0), "scaled_fp4_quant: input_global_scale (the global scale) must be a one-element "
                                      "float32 tensor, got float 100.0"),
        ((torch.randn(4, 32), torch.tensor([1.0], dtype=torch.float64)),
         "scaled_fp4_quant: input_global_scale (the global scale) must be a one-element float32 tensor, "
         "got torch.float64 [1]"),
        (([[1.0] * 32], torch.tensor([1.0])), "scaled_fp4_quant: input must be a tensor, got list"),
        ((torch.randn(4, 32).to(torch.int32), torch.tensor([1.0])),
         "scaled_fp4_quant: input must be float16, bfloat16 or float32, got torch.int32"),
        ((torch.randn(4, 32), torch.tensor([1.0]), 1), "scaled_fp4_quant: is_sf_swizzled_layout must be True or False"),
    ],
)
def test_quant_wrapper_names_a_bad_argument_in_one_line(args, message):
    """The Python wrapper checks what the dispatcher would otherwise reject with its schema dump."""
    with pytest.raises(nvfp4.ArgumentError) as info:
        scaled_fp4_quant(*args)
    text = str(info.value)
    assert text.startswith(message), text
    assert "\n" not in text and "schema" not in text.lower()
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)


# ---------------------------------------------------------------- nvfp4_gemm


def _quantized(rows, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    gs = _gs(x)
    packed, scales = nvfp4.quantize(x, gs)
    return x, gs, packed, scales


def test_gemm_is_the_product_of_the_dequantized_operands():
    _, gs_a, a, sa = _quantized(37, 96, 0)
    _, gs_b, b, sb = _quantized(20, 96, 1)
    alpha = 1.0 / (gs_a * gs_b)
    out = OPS.nvfp4_gemm(a, b, sa, sb, alpha, torch.float32)
    expected = nvfp4.dequantize(a, sa, gs_a).double() @ nvfp4.dequantize(b, sb, gs_b).double().t()
    assert out.shape == (37, 20) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert OPS.nvfp4_gemm(a, b, sa, sb, alpha, torch.bfloat16).dtype == torch.bfloat16


def test_gemm_accepts_vllm_int32_scale_allocation():
    _, gs_a, a, sa = _quantized(9, 64, 2)
    _, gs_b, b, sb = _quantized(130, 64, 3)
    alpha = 1.0 / (gs_a * gs_b)
    as_int32 = OPS.nvfp4_gemm(a, b, sa.view(torch.int32), sb.view(torch.int32), alpha, torch.float32)
    assert torch.equal(as_int32, OPS.nvfp4_gemm(a, b, sa, sb, alpha, torch.float32))


def test_gemm_rejects_bad_arguments():
    _, gs_a, a, sa = _quantized(9, 64, 2)
    _, gs_b, b, sb = _quantized(8, 64, 3)
    alpha = 1.0 / (gs_a * gs_b)
    with pytest.raises(ValueError, match="a must be packed NVFP4"):
        OPS.nvfp4_gemm(a.float(), b, sa, sb, alpha, torch.float32)
    with pytest.raises(ValueError, match="must share K/2"):
        OPS.nvfp4_gemm(a, b[:, :16], sa, sb, alpha, torch.float32)
    with pytest.raises(ValueError, match="block_scale_b must be the swizzled scales"):
        OPS.nvfp4_gemm(a, b, sa, sb[:64], alpha, torch.float32)
    with pytest.raises(ValueError, match="alpha must be a one-element float32"):
        OPS.nvfp4_gemm(a, b, sa, sb, alpha.double(), torch.float32)


# ---------------------------------------------------------------- attention ops


@pytest.fixture
def mla_layer():
    torch.manual_seed(0)
    h, nope, rope, v, lora = 2, 16, 8, 16, 32
    weight = torch.randn(h * (nope + v), lora) * lora**-0.5
    impl = runtime.MLAAttentionImpl(num_heads=h, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v,
                                    kv_lora_rank=lora, kv_b_proj_weight=weight, softmax_scale=(nope + rope) ** -0.5)
    runtime.register_layer("test_ops.mla", impl)
    yield impl, (h, nope, rope, v, lora)
    runtime.unregister_layer("test_ops.mla")


def _mla_inputs(t, dims, dtype=torch.bfloat16):
    h, nope, rope, v, lora = dims
    return (torch.randn(t, h, nope + rope, dtype=dtype), torch.randn(t, lora, dtype=dtype),
            torch.randn(t, 1, rope, dtype=dtype))


def test_mla_op_writes_runtime_attention_in_query_dtype(mla_layer):
    impl, dims = mla_layer
    spec = runtime.BatchSpec.from_lens([5, 3])
    q, kv_c, k_pe = _mla_inputs(8, dims)
    output = torch.full((8, dims[0] * dims[3]), float("nan"), dtype=torch.bfloat16)
    with runtime.batch(spec):
        OPS.mla_attention_with_output(q, kv_c, k_pe, output, "test_ops.mla")
    impl.clear_cache()
    expected = impl.forward(q, kv_c, k_pe, spec).to(torch.bfloat16).view(8, -1)
    assert torch.equal(output, expected)


def test_mla_op_nvfp4_output_equals_attention_then_quant(mla_layer):
    """A batch the guard does not fuse (a dcp world size > 1) takes the fallback: the unfused bytes
    (batches with prefill rows take the fused path: tests/test_guard.py)."""
    impl, dims = mla_layer
    spec = runtime.BatchSpec.from_lens([1, 5, 3], dcp_world_size=2)
    q, kv_c, k_pe = _mla_inputs(9, dims)
    gs = torch.tensor([30.0])
    width = dims[0] * dims[3]
    output = torch.full((9, width // 2), 0xAB, dtype=torch.uint8)
    block_scale = torch.full((128, 1), -1, dtype=torch.int32)
    with runtime.batch(spec):
        OPS.mla_attention_with_output(q, kv_c, k_pe, output, "test_ops.mla", gs, block_scale)
    impl.clear_cache()
    attn = impl.forward(q, kv_c, k_pe, spec).to(torch.bfloat16).view(9, -1)
    packed, scales = nvfp4.quantize(attn, gs)
    assert torch.equal(output, packed)
    assert torch.equal(block_scale.view(torch.uint8).view(scales.shape), scales.view(torch.uint8))


def test_attention_ops_report_missing_context_layer_and_buffers(mla_layer):
    impl, dims = mla_layer
    q, kv_c, k_pe = _mla_inputs(4, dims)
    output = torch.empty(4, dims[0] * dims[3], dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="no batch is set"):
        OPS.mla_attention_with_output(q, kv_c, k_pe, output, "test_ops.mla")
    with runtime.batch(runtime.BatchSpec.from_lens([4])):
        with pytest.raises(KeyError, match="no_such_layer") as info:
            OPS.mla_attention_with_output(q, kv_c, k_pe, output, "no_such_layer")
        assert isinstance(info.value, nvfp4.ArgumentError)  # a ValueError like the op's other argument errors
        assert str(info.value).startswith("mla_attention_with_output: layer_name: no attention layer registered "
                                          "as 'no_such_layer'")
        with pytest.raises(ValueError, match="output must be torch.bfloat16"):
            OPS.mla_attention_with_output(q, kv_c, k_pe, output.float(), "test_ops.mla")
        impl.clear_cache()
        with pytest.raises(ValueError, match="needs output_block_scale"):
            OPS.mla_attention_with_output(q, kv_c, k_pe, output.view(torch.uint8), "test_ops.mla",
                                          torch.tensor([1.0]))


def test_standard_attention_op_matches_runtime():
    impl = runtime.AttentionImpl(num_heads=4, num_kv_heads=2, head_dim=16, softmax_scale=0.25)
    runtime.register_layer("test_ops.gqa", impl)
    try:
        spec = runtime.BatchSpec.from_lens([6, 2])
        q = torch.randn(8, 4, 16, dtype=torch.bfloat16)
        k, v = torch.randn(2, 8, 2, 16, dtype=torch.bfloat16)
        output = torch.empty(8, 4, 16, dtype=torch.bfloat16)
        with runtime.batch(spec):
            OPS.attention_with_output(q, k, v, output, "test_ops.gqa")
        impl.clear_cache()
        assert torch.equal(output, impl.forward(q, k, v, spec).to(torch.bfloat16))
    finally:
        runtime.unregister_layer("test_ops.gqa")


# ---------------------------------------------------------------- tracing with fake impls


def _post_grad_recorder(graphs):
    def record(graph):
        graphs.append(str(graph))

    return record


def test_ops_compile_with_dynamic_token_count_without_recompiling():
    """Fake impls let Inductor trace quant -> gemm with a symbolic M; results equal eager bytes."""
    _, gs_w, w, sw = _quantized(48, 64, 7)

    def quant_gemm(x, gs, alpha):
        x_fp4, x_sf = scaled_fp4_quant(x, gs)
        return x_fp4, x_sf, OPS.nvfp4_gemm(x_fp4, w, x_sf, sw, alpha, torch.bfloat16)

    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(quant_gemm, fullgraph=True)
    with torch._inductor.config.patch(post_grad_custom_post_pass=_post_grad_recorder(graphs)):
        for m in (5, 130, 257):
            x = torch.randn(m, 64, dtype=torch.bfloat16)
            torch._dynamo.mark_dynamic(x, 0)
            gs = _gs(x)
            alpha = 1.0 / (gs * gs_w)
            got = compiled(x, gs, alpha)
            want = quant_gemm(x, gs, alpha)
            for g, e in zip(got, want):
                assert g.shape == e.shape
                assert torch.equal(g.view(torch.uint8), e.view(torch.uint8))
    assert len(graphs) == 1, "a new token count must not recompile"
    assert "fusion_pass.scaled_fp4_quant.out" in graphs[0]
    assert "fusion_pass.nvfp4_gemm" in graphs[0]


def test_fake_impls_give_shapes_under_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(300, 32, dtype=torch.uint8)
        b = torch.empty(64, 32, dtype=torch.uint8)
        out = OPS.nvfp4_gemm(a, b, torch.empty(384, 1, dtype=torch.int32), torch.empty(128, 1, dtype=torch.int32),
                             torch.empty(1), torch.bfloat16)
        assert out.shape == (300, 64) and out.dtype == torch.bfloat16
        x = torch.empty(300, 64, dtype=torch.bfloat16)
        packed, scales = scaled_fp4_quant(x, torch.empty(1))
        assert packed.shape == (300, 32) and scales.shape == (384, 4)


# ---------------------------------------------------------------- the layer registry's errors


def test_an_unknown_layer_name_is_a_value_error_and_still_a_key_error():
    from fusion_pass.runtime import UnknownLayerError

    for call in (runtime.get_layer, runtime.unregister_layer):
        with pytest.raises(ValueError) as info:
            call("test_ops.no_such_layer")
        error = info.value
        assert type(error) is UnknownLayerError
        assert isinstance(error, KeyError) and isinstance(error, nvfp4.ArgumentError)
        # read as written: a plain KeyError would print the message quoted
        assert str(error).startswith("no attention layer registered as 'test_ops.no_such_layer'"), str(error)
        try:
            call("test_ops.no_such_layer")
        except KeyError:  # what existing callers catch
            pass


# ---------------------------------------------------------------- run-time counters by layer


def _decision(path="fused", reason=None, backend="reference", prefill=10, fused=10, post=None):
    from fusion_pass.runtime import guard

    return guard.Decision(path, reason, backend, None, prefill, fused, post or {})


def test_runtime_counters_count_per_layer_and_filter_by_layer(clean_backend_state):
    from fusion_pass import ops
    from fusion_pass.runtime import counters

    counters.record(_decision(), layer_name="a")
    counters.record(_decision(), layer_name="a")
    counters.record(_decision("fallback", "decode_tokens", None, 0, 0, {"decode_tokens": 3}), layer_name="b")
    counters.record(_decision(prefill=4, fused=4), layer_name="c")
    counters.record(_decision(prefill=5, fused=5), layer_name="a")
    counters.record(_decision(prefill=1, fused=1))  # no layer: the process total only

    everything = ops.runtime_counters()
    assert everything == counters.counters() == {
        "fused": 5, "fused_by_backend": {"reference": 5}, "fallback": {"decode_tokens": 1},
        "tokens": {"prefill": 30, "prefill_fused": 30, "decode_fused": 0, "post_quantized": {"decode_tokens": 3}}}
    assert ops.runtime_counters(layers=["a"]) == {
        "fused": 3, "fused_by_backend": {"reference": 3}, "fallback": {},
        "tokens": {"prefill": 25, "prefill_fused": 25, "decode_fused": 0, "post_quantized": {}}}
    assert ops.runtime_counters(layers="b") == {
        "fused": 0, "fused_by_backend": {}, "fallback": {"decode_tokens": 1},
        "tokens": {"prefill": 0, "prefill_fused": 0, "decode_fused": 0, "post_quantized": {"decode_tokens": 3}}}
    both = ops.runtime_counters(layers=("a", "c", "a"))  # a name given twice counts once
    assert both["fused"] == 4 and both["tokens"]["prefill_fused"] == 29
    zero = {"fused": 0, "fused_by_backend": {}, "fallback": {},
            "tokens": {"prefill": 0, "prefill_fused": 0, "decode_fused": 0, "post_quantized": {}}}
    assert ops.runtime_counters(layers=[]) == ops.runtime_counters(layers=["never_counted"]) == zero
    with pytest.raises(ValueError, match="layers must hold layer names"):
        ops.runtime_counters(layers=[3])
    counters.reset_counters()
    assert ops.runtime_counters() == ops.runtime_counters(layers=["a"]) == zero


def test_a_layer_registered_under_a_reused_name_starts_its_counts_afresh(clean_backend_state):
    from fusion_pass import ops
    from fusion_pass.runtime import counters

    name = "test_ops.reused"
    counters.record(_decision(), layer_name=name)  # the calls of an earlier layer of that name
    impl = object()
    runtime.register_layer(name, impl)
    try:
        assert ops.runtime_counters(layers=[name])["fused"] == 0
        counters.record(_decision(), layer_name=name)
        runtime.register_layer(name, impl)  # the same layer again: a no-op, its counts stay
        assert ops.runtime_counters(layers=[name])["fused"] == 1
    finally:
        runtime.unregister_layer(name)
    assert ops.runtime_counters(layers=[name])["fused"] == 1  # kept once released, for a report read later
    assert ops.runtime_counters()["fused"] == 2  # the process total keeps every call


def test_the_attention_op_counts_its_call_under_its_layer_name(mla_layer, clean_backend_state):
    from fusion_pass import ops

    impl, dims = mla_layer
    spec = runtime.BatchSpec.from_lens([5, 3])
    q, kv_c, k_pe = _mla_inputs(8, dims)
    width = dims[0] * dims[3]
    output = torch.empty(8, width // 2, dtype=torch.uint8)
    block_scale = torch.empty(128, 1, dtype=torch.int32)
    with runtime.batch(spec):
        OPS.mla_attention_with_output(q, kv_c, k_pe, output, "test_ops.mla", torch.tensor([30.0]), block_scale)
    impl.clear_cache()
    mine = ops.runtime_counters(layers=["test_ops.mla"])
    assert mine["fused"] == 1 and mine["tokens"]["prefill_fused"] == 8
    assert ops.runtime_counters(layers=["test_ops.other"])["fused"] == 0
    assert ops.runtime_counters() == mine


# ---------------------------------------------------------------- numpy integers


def test_batch_spec_accepts_numpy_integers():
    import numpy as np

    spec = runtime.BatchSpec.from_lens(np.array([1, 5]), np.array([7, 0]), dcp_world_size=np.int64(1))
    assert [(r.query_len, r.context_len) for r in spec.requests] == [(1, 7), (5, 0)]
    assert all(type(r.query_len) is int and type(r.context_len) is int for r in spec.requests)
    assert type(spec.dcp_world_size) is int and spec.num_tokens == 6
    assert runtime.RequestSpec("x", np.int32(3), np.uint8(2)) == runtime.RequestSpec("x", 3, 2)
    with pytest.raises(ValueError, match="query_len must be an int"):
        runtime.RequestSpec("x", np.float64(3.0))
    with pytest.raises(ValueError, match="query_len must be an int"):
        runtime.RequestSpec("x", np.bool_(True))
