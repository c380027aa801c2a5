"""NVFP4Linear against a bf16 linear within the NVFP4 error bound; the attention modules; the demo models."""

import pytest
import torch
from torch import nn

from fusion_pass import nvfp4, runtime
from fusion_pass.demo.layers import Attention, MLAAttention, NVFP4Linear, global_scale_for
from fusion_pass.demo.models import GQAConfig, MLAConfig, build_gqa_model, build_mla_model, release_layers


def _linear_error_bound(x, weight, layer: NVFP4Linear):
    """|x W^T - dq(x) dq(W)^T| <= |x| eW^T + eX |dq(W)|^T, plus the bf16 rounding of the result.

    eX, eW are the per-element NVFP4 error bounds of the two operands; the
    product rule gives the rest.
    """
    x2 = x.reshape(-1, x.shape[-1]).float()
    e_x = nvfp4.error_bound(x2, layer.input_global_scale)
    w_hat = layer.dequantized_weight()
    e_w = nvfp4.error_bound(weight.float(), layer.weight_global_scale)
    product_bound = x2.abs() @ e_w.t() + e_x @ w_hat.abs().t()
    return product_bound


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nvfp4_linear_against_bf16_linear_within_bound(dtype):
    g = torch.Generator().manual_seed(0)
    ref = nn.Linear(256, 96, bias=False)
    with torch.no_grad():
        ref.weight.normal_(0, 256**-0.5, generator=g)
    x = torch.randn(3, 50, 256, generator=g).to(dtype)
    layer = NVFP4Linear.from_linear(ref, input_amax=x.float().abs().max())
    out = layer(x)
    assert out.shape == (3, 50, 96) and out.dtype == dtype
    exact = x.float() @ ref.weight.float().t()
    err = (out.float() - exact).abs().reshape(-1, 96)
    eps = torch.finfo(dtype).eps
    bound = _linear_error_bound(x, ref.weight, layer) + eps * exact.abs().reshape(-1, 96) + 1e-6
    assert (err <= bound).all(), f"worst ratio {(err / bound).max():.3f}"
    # the bound is not vacuous: NVFP4 error is real and comes within an order of magnitude of it
    assert (err / bound).max() > 0.05


def test_nvfp4_linear_buffers_and_calibration():
    w = torch.randn(40, 64)
    layer = NVFP4Linear(w, input_amax=3.0)
    assert layer.weight.dtype == torch.uint8 and layer.weight.shape == (40, 32)
    assert layer.weight_scale.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (128, 4)
    assert torch.equal(layer.input_global_scale, torch.tensor([448.0 * 6.0 / 3.0]))
    torch.testing.assert_close(layer.alpha, 1.0 / (layer.input_global_scale * layer.weight_global_scale))
    layer.set_input_amax(6.0)
    torch.testing.assert_close(layer.alpha, 1.0 / (layer.input_global_scale * layer.weight_global_scale))


def test_nvfp4_linear_rejects_bad_weights():
    with pytest.raises(ValueError, match="in_features divisible by 16"):
        NVFP4Linear(torch.randn(8, 20))
    with pytest.raises(TypeError, match="float tensor"):
        NVFP4Linear(torch.ones(8, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="bias"):
        NVFP4Linear.from_linear(nn.Linear(32, 8))
    with pytest.raises(ValueError, match="amax must be positive"):
        global_scale_for(0.0)


def test_attention_module_views_match_vllm_layout():
    layer = Attention(num_heads=4, num_kv_heads=2, head_dim=16, layer_name="test_layers.gqa")
    try:
        spec = runtime.BatchSpec.from_lens([7])
        q = torch.randn(7, 64, dtype=torch.bfloat16)
        k, v = torch.randn(2, 7, 32, dtype=torch.bfloat16)
        with runtime.batch(spec):
            out = layer(q, k, v)
        layer.impl.clear_cache()
        expected = layer.impl.forward(q.view(7, 4, 16), k.view(7, 2, 16), v.view(7, 2, 16), spec)
        assert out.shape == (7, 64)
        assert torch.equal(out, expected.to(torch.bfloat16).view(7, 64))
    finally:
        runtime.unregister_layer("test_layers.gqa")


def test_mla_module_shares_kv_b_proj_with_runtime():
    kv_b = nn.Linear(32, 2 * (16 + 16), bias=False)
    layer = MLAAttention(num_heads=2, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=32,
                         kv_b_proj=kv_b, layer_name="test_layers.mla")
    try:
        assert runtime.get_layer("test_layers.mla") is layer.impl
        spec = runtime.BatchSpec.from_lens([5])
        args = (torch.randn(5, 2, 24), torch.randn(5, 32), torch.randn(5, 1, 8))
        with runtime.batch(spec):
            before = layer(*args)
        with torch.no_grad():
            kv_b.weight.mul_(2.0)  # the runtime must see the module's parameter, not a copy
        layer.impl.clear_cache()
        with runtime.batch(spec):
            after = layer(*args)
        assert before.shape == (5, 32) and not torch.allclose(before, after)
    finally:
        runtime.unregister_layer("test_layers.mla")


@pytest.mark.parametrize("build, cfg, prefix", [
    (build_mla_model, MLAConfig.tiny(), "test_layers_mla"),
    (build_gqa_model, GQAConfig.tiny(), "test_layers_gqa"),
])
def test_demo_models_keep_nvfp4_buffers_exact_and_run(build, cfg, prefix):
    model = build(cfg, prefix=prefix)
    o_proj = model.layers[0].o_proj
    assert o_proj.weight_scale.dtype == torch.float8_e4m3fn  # not cast with the parameters
    assert o_proj.input_global_scale.dtype == torch.float32
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    names = [f"{prefix}.layers.{i}.self_attn.attn" for i in range(cfg.num_layers)]
    assert all(name in runtime.registered_layers() for name in names)
    spec = runtime.BatchSpec.from_lens([9, 4])
    with runtime.batch(spec):
        out = model(spec.positions(), torch.randn(13, cfg.hidden_size, dtype=torch.bfloat16))
    assert out.shape == (13, cfg.hidden_size) and torch.isfinite(out.float()).all()
    runtime.clear_kv_caches()
    release_layers(model)
    assert not any(name in runtime.registered_layers() for name in names)
