"""The ``fa4`` backend's static FP8 launch (``FA4Backend.run_varlen_fp8_static``): which devices it is offered on,
what it hands FA4's SM90 FP8 kernel, and (on an SM90 GPU with FA4) the bytes through the attention op.

CPU: only SM90 lists FP8 static and the FP8 group formats (their kernels' GPU byte tests passed on an H100; the
self-check's canary is NVFP4's); ``formats`` says them only where the current device's generation lists them
(stand-in table and detection); the launch hands
:func:`fusion_pass.kernels.fa4.sm90_fp8.fa4_attention_fp8_static_varlen` the output as ``[T, H*Dv]`` (a view of the
same bytes), ``1 / scale`` (or the inverse given) and the NaN rule, and refuses a rule the static
epilogue does not write. GPU: generated prefill batches through ``torch.ops.fusion_pass.attention_with_output``
with ``FUSION_PASS_BACKEND=fa4`` and SM90 listing the format: every byte equals ``fp8.quantize_static`` of FA4's
own bf16 output (the run after which the table lists it: H100, 2026-12-05).
"""

from __future__ import annotations

import random

import pytest
import torch

import fusion_pass  # noqa: F401  (registers the ops)
from fusion_pass import fp8, formats
from fusion_pass.kernels.fa4 import generations, sm90_fp8
from fusion_pass.runtime import backends
from fusion_pass.runtime.backends import base, fa4 as fa4_backend

from sm90_gpu import gpu  # noqa: E402


def test_sm90_alone_lists_fp8_static_its_gpu_byte_tests_passed_there():
    """SM90's static and group FP8 epilogues passed their GPU byte tests (H100, 2026-12-05); SM100's static FP8
    output stage is compiled only."""
    listed = {g.name: g.formats for g in generations.GENERATIONS}
    assert listed == {"sm90": ("nvfp4", "fp8_static", "fp8_group128", "fp8_group128_ue8m0"), "sm100": ("nvfp4",)}


@pytest.mark.parametrize("arch, writes_fp8", [(None, False), (90, True), (100, False), (120, False)])
def test_fp8_static_is_offered_where_the_generation_lists_it(monkeypatch, arch, writes_fp8):
    monkeypatch.setattr(fa4_backend, "device_arch", lambda index=None: arch)
    backend = backends.get_backend("fa4")
    assert base.writes(backend, formats.NVFP4)
    assert base.writes(backend, formats.FP8_STATIC) is writes_fp8
    assert base.writes(backend, formats.FP8_GROUP128) is writes_fp8
    assert base.writes(backend, formats.FP8_GROUP128_UE8M0) is writes_fp8
    assert base.writes(backend, formats.FP8_STATIC, "merge") is writes_fp8  # the row writer merges attention_lse's
    assert not base.writes(backend, formats.FP8_STATIC, "paged")


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("nan", [fp8.NaNRule.POSITIVE_MAX, fp8.NaNRule.NAN, "positive_max"])
def test_the_launch_hands_the_kernel_its_arguments(monkeypatch, inverse, nan):
    seen = {}
    monkeypatch.setattr(sm90_fp8, "fa4_attention_fp8_static_varlen", lambda *a, **kw: seen.update(args=a, **kw))
    t, h, dv = 7, 3, 16
    q, k, v = torch.randn(t, h, 24), torch.randn(t, 1, 24), torch.randn(t, 1, dv)
    output = torch.empty(t, h, dv, dtype=torch.float8_e4m3fn)
    scale = torch.tensor([0.37])
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    backends.get_backend("fa4").run_varlen_fp8_static(q, k, v, cu, 4, 0.5, output, scale, scale_is_inverse=inverse,
                                                      nan=nan)
    assert seen["args"] == (q, k, v)
    assert seen["output"].shape == (t, h * dv) and seen["output"].data_ptr() == output.data_ptr()
    want_inv = scale if inverse else fp8.reciprocal(scale)
    assert torch.equal(seen["inv_scale"], want_inv.reshape(1))
    assert seen["nan_to_max"] is (fp8.NaNRule(nan) is fp8.NaNRule.POSITIVE_MAX)
    assert (seen["cu_seqlens"], seen["max_seqlen"], seen["softmax_scale"], seen["causal"]) == (cu, 4, 0.5, True)


def test_a_nan_rule_the_static_epilogue_does_not_write_is_refused(monkeypatch):
    monkeypatch.setattr(sm90_fp8, "fa4_attention_fp8_static_varlen", lambda *a, **kw: pytest.fail("launched"))
    x = torch.zeros(2, 1, 16)
    with pytest.raises(ValueError, match="nan must be 'positive_max' or 'nan'.*got 'negative_max'"):
        backends.get_backend("fa4").run_varlen_fp8_static(
            x, x, x, torch.tensor([0, 2], dtype=torch.int32), 2, 1.0, torch.empty(2, 16, dtype=torch.float8_e4m3fn),
            torch.ones(1), nan=fp8.NaNRule.NEGATIVE_MAX)


@gpu
@pytest.mark.parametrize("heads", [(16, 16, 192, 128), (32, 8, 128, 128)], ids=["mla16", "gqa"])
def test_the_op_writes_fa4s_fp8_bytes_on_sm90(monkeypatch, heads):
    from fusion_pass import runtime
    from fusion_pass.kernels.fa4 import sm90 as fa4_sm90
    from fusion_pass.runtime import BatchSpec, counters

    h, hkv, d, dv = heads
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    lens = [rng.randint(2, 300) for _ in range(rng.randint(1, 4))]
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = sum(lens)
    q = torch.randn(t, h, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(t, hkv, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(t, hkv, dv, device="cuda", generator=g).bfloat16()
    scale = torch.tensor([0.01 + rng.random() / 100], device="cuda")
    name = f"test_fa4_backend_fp8.{seed}"
    impl = runtime.AttentionImpl(num_heads=h, num_kv_heads=hkv, head_dim=d, v_head_dim=dv, softmax_scale=d ** -0.5)
    runtime.register_layer(name, impl)
    monkeypatch.setenv("FUSION_PASS_BACKEND", "fa4")
    counters.reset_counters()
    try:
        out = torch.full((t, h * dv), 0x55, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        with runtime.batch(BatchSpec.from_lens(lens)):
            torch.ops.fusion_pass.attention_with_output(q, k, v, out, name, scale)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        twin = fa4_sm90.fa4_attention_varlen(q, k, v, cu, max(lens), causal=True, softmax_scale=d ** -0.5)
        want = fp8.quantize_static(twin.reshape(t, -1), fp8.reciprocal(scale))
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), f"seed {seed}, lens {lens}"
        assert counters.counters()["fused_by_backend"] == {"fa4 (fp8_static)": 1}
    finally:
        runtime.unregister_layer(name)
