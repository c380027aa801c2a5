"""The fused backends: detection, availability, selection and configuration, and their kernels' arguments."""


import importlib.util
import types

import pytest
import torch

import fusion_pass  # noqa: F401  (registers the ops)
from fusion_pass import nvfp4, runtime
from fusion_pass.runtime import backends, guard, row_plan, settings

from layer_cases import (CPU, GS, OPS, SPECS, cuda_backend_reason, decide, dense_causal,  # noqa: F401
                         nvfp4_buffers, padding_mask)

@pytest.fixture(autouse=True)
def _clean_state(clean_backend_state):
    yield


def test_backends_lists_all_three_in_order_with_reasons():
    listing = backends.list_backends()
    assert [b["name"] for b in listing] == ["fa4", "triton", "reference"]
    assert all(isinstance(b["available"], bool) and b["reason"] for b in listing)
    fa4, triton, reference = listing
    assert reference["available"] is True
    if importlib.util.find_spec("flash_attn") is None:
        assert fa4 == {"name": "fa4", "available": False,
                       "reason": "flash_attn.cute is not installed (pip install 'attn-nvfp4-fusion[fa4]')"}
    if not torch.cuda.is_available():
        assert fa4["available"] is False and triton["available"] is False
        if importlib.util.find_spec("fusion_pass.kernels") is None:
            assert triton["reason"] == "fusion_pass.kernels (the Triton kernels) is not part of this build"
        elif importlib.util.find_spec("triton") is None:
            assert triton["reason"] == "triton is not installed"
        else:
            assert triton["reason"] == "no CUDA device"


def test_availability_is_cached(monkeypatch):
    backends.refresh()
    backends.list_backends()
    calls = []
    try:
        with monkeypatch.context() as m:
            m.setattr(backends.fa4, "_import_fa4", lambda: calls.append("fa4") or (None, "x"))
            m.setattr(backends.triton, "triton_availability", lambda: calls.append("triton") or (False, "x"))
            for _ in range(3):
                backends.list_backends()
                decide(SPECS["prefill"])
            assert calls == []
            backends.refresh()
            assert backends.get_backend("fa4").available() == (False, "x")
            assert backends.get_backend("triton").available() == (False, "x")
            assert calls == ["fa4", "triton"]
    finally:
        backends.refresh()  # drop the fakes' cached results


def _fake_fa4_module(with_args=("out", "output_scale", "output_scales")):
    params = ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal"]
    src = "def flash_attn_varlen_func({}):\n    pass\n".format(", ".join(f"{p}=None" for p in params + list(with_args)))
    module = types.ModuleType("flash_attn.cute")
    exec(src, module.__dict__)
    return module


def test_fa4_detection_branches():
    assert backends.fa4_availability(None, (10, 0)) == (False, "flash_attn.cute is not installed")
    assert backends.fa4_availability(None, (10, 0), import_error="flash_attn.cute failed to import: boom") == (
        False, "flash_attn.cute failed to import: boom")
    ok, why = backends.fa4_availability(types.ModuleType("flash_attn.cute"), (10, 0))
    assert not ok and why == "installed flash_attn.cute has no flash_attn_varlen_func"

    # a released FA4 (FP8 output only): out and output_scale, no output_scales
    ok, why = backends.fa4_availability(_fake_fa4_module(("out", "output_scale")), (10, 0))
    assert not ok
    assert why.startswith("installed flash_attn.cute.flash_attn_varlen_func has no NVFP4 output arguments "
                          "(out/output_scale/output_scales)")
    assert why.endswith("missing: output_scales")
    ok, why = backends.fa4_availability(_fake_fa4_module(()), (10, 0))
    assert not ok and why.endswith("missing: out, output_scale, output_scales")

    nvfp4_fa4 = _fake_fa4_module()
    assert backends.fa4_availability(nvfp4_fa4, (9, 0)) == (False, "needs an SM100/SM110 GPU, found sm_90")
    assert backends.fa4_availability(nvfp4_fa4, (12, 0)) == (False, "needs an SM100/SM110 GPU, found sm_120")
    assert backends.fa4_availability(nvfp4_fa4, None) == (False, "no CUDA device")
    ok, why = backends.fa4_availability(nvfp4_fa4, (10, 0), has_fp4_dtype=False)
    assert not ok and "float4_e2m1fn_x2" in why
    for capability in ((10, 0), (11, 0)):
        ok, why = backends.fa4_availability(nvfp4_fa4, capability, has_fp4_dtype=True)
        assert ok and f"sm_{capability[0]}0" in why
    # the function itself may be passed instead of the module
    assert backends.fa4_availability(nvfp4_fa4.flash_attn_varlen_func, (10, 0), has_fp4_dtype=True)[0]


def test_triton_detection_branches():
    def find_spec(found):
        return lambda name: object() if found else None

    def importer(triton_ok=True, kernels=None):
        def import_module(name):
            if name == "triton":
                if not triton_ok:
                    raise ImportError("No module named 'triton'")
                return types.SimpleNamespace(__version__="3.6.0")
            return kernels

        return import_module

    avail = backends.triton_availability
    assert avail(find_spec=find_spec(False), import_module=importer(), cuda_available=lambda: True) == (
        False, f"{backends.triton.TRITON_KERNEL_MODULE} (the Triton kernels) is not part of this build")
    assert avail(find_spec=find_spec(True), import_module=importer(False), cuda_available=lambda: True) == (
        False, "triton is not installed")
    assert avail(find_spec=find_spec(True), import_module=importer(), cuda_available=lambda: False) == (
        False, "no CUDA device")
    def broken(name):
        if name == "triton":
            return types.SimpleNamespace(__version__="3.6.0")
        raise ImportError("boom")

    ok, why = avail(find_spec=find_spec(True), import_module=broken, cuda_available=lambda: True)
    assert not ok and backends.triton.TRITON_KERNEL_MODULE in why and "boom" in why
    ok, why = avail(find_spec=find_spec(True), import_module=importer(kernels=types.SimpleNamespace()),
                    cuda_available=lambda: True)
    assert ok and "3.6.0" in why


def test_supports():
    ref, fa4, triton = (backends.get_backend(n) for n in ("reference", "fa4", "triton"))
    assert ref.supports(CPU, torch.float32, 2, 24, 16) == (True, "ok")
    assert not ref.supports(CPU, torch.float64, 2, 24, 16)[0]
    assert not ref.supports(CPU, torch.bfloat16, 1, 8, 8)[0]
    for backend in (fa4, triton):
        ok, why = backend.supports(CPU, torch.bfloat16, 128, 192, 128)
        assert not ok and "CUDA devices only" in why
        ok, why = backend.supports(torch.device("cuda", 0), torch.float32, 128, 192, 128)
        assert not ok and "float32" in why


def test_fa4_call_kwargs_builds_views_of_the_opnvfp4_buffers():
    t, h, dv = 130, 4, 32
    output, block_scale = nvfp4_buffers(t, h * dv)
    q = torch.randn(t, h, 48, dtype=torch.bfloat16)
    k = torch.randn(t, h, 48, dtype=torch.bfloat16)
    v = torch.randn(t, h, dv, dtype=torch.bfloat16)
    cu = torch.tensor([0, 100, 130], dtype=torch.int32)
    kw = backends.fa4_call_kwargs(output, GS, block_scale, q=q, k=k, v=v, cu_seqlens=cu, max_seqlen=100,
                                  softmax_scale=0.125, num_heads=h, v_head_dim=dv)
    assert set(kw) == {"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                       "softmax_scale", "causal", "out", "output_scale", "output_scales"}
    assert kw["out"].dtype == torch.float4_e2m1fn_x2 and kw["out"].shape == (t, h, dv // 2)
    assert kw["out"].data_ptr() == output.data_ptr()
    assert kw["output_scale"] is GS
    assert kw["output_scales"].dtype == torch.float8_e4m3fn and kw["output_scales"].shape == (256, 8)
    assert kw["output_scales"].data_ptr() == block_scale.data_ptr()
    assert kw["q"] is q and kw["k"] is k and kw["v"] is v
    assert kw["cu_seqlens_q"] is cu and kw["cu_seqlens_k"] is cu
    assert kw["max_seqlen_q"] == kw["max_seqlen_k"] == 100
    assert kw["softmax_scale"] == 0.125 and kw["causal"] is True
    # writes through the views land in the op's buffers
    kw["output_scales"].view(torch.uint8)[1, 2] = 7
    assert block_scale.view(torch.uint8).view(256, 8)[1, 2] == 7


def test_fa4_run_path_with_an_injected_kernel(layer):
    """FA4Backend.run end to end on the CPU with a PyTorch stand-in for the FA4 kernel.

    The stand-in writes only the scales of real rows/columns, so the zero padding
    must come from the backend."""
    seen = {}

    def fake_varlen(**kw):
        seen.update(kw)
        o = dense_causal(kw["q"], kw["k"], kw["v"], kw["cu_seqlens_q"], kw["softmax_scale"])
        seen["attn"] = o
        t = o.shape[0]
        packed, scales = nvfp4.quantize(o.reshape(t, -1), kw["output_scale"], swizzled=False)
        kw["out"].view(torch.uint8).view(t, -1).copy_(packed)
        n_blocks = scales.shape[1]
        m, c = torch.arange(t).unsqueeze(1), torch.arange(n_blocks).unsqueeze(0)
        flat = kw["output_scales"].view(torch.uint8).view(-1)
        flat[nvfp4.swizzled_offset(m, c, n_blocks).reshape(-1)] = scales.view(torch.uint8).reshape(-1)

    spec = runtime.BatchSpec.from_lens([9, 4])
    inputs = layer.inputs(spec.num_tokens, seed=11)
    t = spec.num_tokens
    output = torch.full((t, layer.width // 2), 0xAB, dtype=torch.uint8)
    rows, cols = nvfp4.scale_shape(t, layer.width)
    block_scale = torch.full((rows, cols // 4), -1, dtype=torch.int32)
    layer.impl.clear_cache()
    row_plan.run_on_prefill(backends.FA4Backend(varlen_func=fake_varlen), layer.impl, inputs, spec, output, GS,
                            block_scale)

    assert seen["causal"] is True and seen["softmax_scale"] == layer.impl.softmax_scale
    assert seen["cu_seqlens_q"].tolist() == [0, 9, 13] and seen["max_seqlen_q"] == 9
    assert seen["q"].dtype == seen["k"].dtype == seen["v"].dtype == torch.bfloat16
    # the cache was extended as impl.forward would have
    assert layer.impl.cache_len("r0") == 9 and layer.impl.cache_len("r1") == 4
    # the kernel's inputs describe the same attention (k/v rounded to bf16 for MLA)
    attn32 = layer.attention32([(spec, inputs)])
    torch.testing.assert_close(seen["attn"].reshape(t, -1), attn32, atol=3e-2, rtol=3e-2)
    # bytes: what the kernel wrote, padding zero despite the 0xFF poison
    packed, _ = nvfp4.quantize(seen["attn"].reshape(t, -1), GS)
    assert torch.equal(output, packed)
    scales = block_scale.view(torch.uint8).view(rows, cols)
    padding = padding_mask(t, layer.width)
    assert bool((scales[padding] == 0).all()) and bool((scales[~padding] != 0).all())


def test_backend_env_variable(monkeypatch):
    monkeypatch.setenv(settings.BACKEND_ENV, "reference")
    assert settings.configured_backend() == "reference"
    monkeypatch.setenv(settings.BACKEND_ENV, "Triton")
    assert settings.configured_backend() == "triton"
    assert decide(SPECS["prefill"]).reason == "no_backend"
    monkeypatch.setenv(settings.BACKEND_ENV, "cutlass")
    with pytest.raises(ValueError, match=r"FUSION_PASS_BACKEND='cutlass' .* auto, fa4, triton, reference"):
        settings.configured_backend()
    with pytest.raises(ValueError, match="FUSION_PASS_BACKEND"):
        decide(SPECS["prefill"])
    # set_backend takes precedence over the environment
    with settings.use_backend("reference"):
        assert decide(SPECS["prefill"]).backend == "reference"
    monkeypatch.delenv(settings.BACKEND_ENV)
    assert settings.configured_backend() == "auto"


def test_set_and_use_backend_restore_the_previous_choice():
    assert settings.configured_backend() == "auto"
    settings.set_backend("reference")
    with settings.use_backend("triton"):
        assert settings.configured_backend() == "triton"
        with settings.use_backend("fa4"):
            assert settings.configured_backend() == "fa4"
        assert settings.configured_backend() == "triton"
    assert settings.configured_backend() == "reference"
    with pytest.raises(RuntimeError):
        with settings.use_backend("auto"):
            assert settings.configured_backend() == "auto"
            raise RuntimeError
    assert settings.configured_backend() == "reference"
    with pytest.raises(ValueError, match="auto, fa4, triton, reference"):
        settings.set_backend("flashinfer")
    assert settings.configured_backend() == "reference"
    settings.set_backend(None)
    assert settings.configured_backend() == "auto"


def test_select_backend_preferred_restricts_the_search():
    backend, why = backends.select_backend("cpu", torch.bfloat16, 2, 24, 16)
    assert backend.name == "reference" and why
    backend, why = backends.select_backend(CPU, torch.bfloat16, 2, 24, 16, preferred="fa4")
    assert backend is None and why.startswith("fa4: ") and "triton" not in why
    backend, _ = backends.select_backend(CPU, torch.bfloat16, 2, 24, 16, preferred="reference")
    assert backend is backends.get_backend("reference")
    with pytest.raises(ValueError, match="unknown backend"):
        backends.get_backend("cudnn")
    assert all(isinstance(backends.get_backend(n), backends.Backend) for n in backends.BACKEND_ORDER)


# ---------------------------------------------------------------- auto picks only what is measured fast


def _usable_everywhere(monkeypatch, capability):
    """Every backend available and supporting every layer; the CUDA device of the given capability."""
    for cls in (backends.FA4Backend, backends.TritonBackend, backends.ReferenceBackend):
        monkeypatch.setattr(cls, "available", lambda self: (True, f"{self.name} here"))
        monkeypatch.setattr(cls, "supports", lambda self, *a: (True, "ok"))
    monkeypatch.setattr(backends.fa4, "device_capability", lambda index: capability)


CUDA0 = torch.device("cuda", 0)


@pytest.mark.parametrize("capability, picked", [((9, 0), "fa4"), ((10, 0), "fa4"), ((11, 0), "fa4"),
                                                ((8, 0), None), ((8, 9), None), ((12, 0), None)])
def test_auto_picks_only_a_backend_measured_fast_on_the_gpu_generation(monkeypatch, capability, picked):
    _usable_everywhere(monkeypatch, capability)
    shape = guard.LayerShape(CUDA0, torch.bfloat16, 16, 192, 128)
    decision = guard.decide(guard.BatchRows.from_spec(SPECS["prefill"]), shape)
    if picked:
        assert (decision.path, decision.backend) == ("fused", picked)
        return
    # triton and reference could run it, fa4 has no kernel or measurement for this generation: the exact
    # fallback, with every backend's reason
    assert (decision.path, decision.reason) == ("fallback", "no_fast_backend")
    assert decision.post_quantized == {"no_fast_backend": SPECS["prefill"].num_tokens}
    assert f"sm_{capability[0]}{capability[1]}" in decision.detail
    assert "triton: not picked by auto: measured at 0.67-0.82x" in decision.detail
    assert "reference: not picked by auto: PyTorch float32 attention is far slower" in decision.detail
    # named, each still runs
    for name in ("triton", "reference", "fa4"):
        with settings.use_backend(name):
            named = guard.decide(guard.BatchRows.from_spec(SPECS["prefill"]), shape)
        assert (named.path, named.backend) == ("fused", name)


def test_no_backend_stays_the_reason_when_nothing_can_run(monkeypatch):
    for cls in (backends.FA4Backend, backends.TritonBackend, backends.ReferenceBackend):
        monkeypatch.setattr(cls, "supports", lambda self, *a: (False, "not these dims"))
    decision = decide(SPECS["prefill"])
    assert (decision.path, decision.reason) == ("fallback", "no_backend")


def test_the_cpu_path_is_the_reference_backend():
    decision = decide(SPECS["prefill"])
    assert (decision.path, decision.backend) == ("fused", "reference")
    assert backends.ReferenceBackend().fast_on(CPU)[0]
    assert not backends.ReferenceBackend().fast_on(CUDA0)[0]
    assert not backends.TritonBackend().fast_on(CUDA0)[0]


def test_list_backends_says_what_auto_would_pick(monkeypatch):
    _usable_everywhere(monkeypatch, (8, 0))
    entries = {e["name"]: e for e in backends.list_backends(CUDA0)}
    assert [entries[n]["auto"] for n in ("fa4", "triton", "reference")] == [False, False, False]
    assert "sm_80" in entries["fa4"]["auto_reason"]
    monkeypatch.setattr(backends.fa4, "device_capability", lambda index: (9, 0))
    entries = {e["name"]: e for e in backends.list_backends(CUDA0)}
    assert [entries[n]["auto"] for n in ("fa4", "triton", "reference")] == [True, False, False]
