"""The fused backends: detection, availability, selection and configuration, and their kernels' arguments."""


import functools
import importlib.util
import types

import pytest
import torch

import fusion_pass  # noqa: F401  (registers the ops)
from fusion_pass import nvfp4, runtime
from fusion_pass.kernels import launchers
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
            # a GPU, so that FA4's import is what is checked (refresh() clears device_arch's cache: keep one)
            m.setattr(backends.fa4, "device_arch", functools.lru_cache(maxsize=None)(lambda index: 90))
            m.setattr(backends.fa4.fa4_common, "fa4_import_status", lambda module: calls.append("fa4") or (False, "x"))
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


@pytest.mark.parametrize("arch, module, available, words", [
    (None, None, False, "no CUDA device (flash-attn-4 "),
    (90, "sm90_kernel", True, "FA4 SM90 forward with the fusion_pass NVFP4 output stage on sm_90 (flash-attn-4"),
    (100, "sm100_kernel", True, "FA4 SM100/SM110 forward with the fusion_pass NVFP4 output stage on sm_100 (flash-"),
    (110, "sm100_kernel", True, "FA4 SM100/SM110 forward with the fusion_pass NVFP4 output stage on sm_110 (flash-"),
    (120, None, False, "no kernel of this project for sm_120"),  # no kernel module of any generation imported
    (80, None, False, "no kernel of this project for sm_80"),
])
def test_fa4_status_names_the_generation_and_imports_its_kernel(monkeypatch, arch, module, available, words):
    asked = []
    monkeypatch.setattr(backends.fa4, "device_arch", lambda index: arch)
    monkeypatch.setattr(backends.fa4.fa4_common, "fa4_import_status",
                        lambda name: asked.append(name) or (True, "flash-attn-4 4.0.0b36"))
    backends.fa4.fa4_status.cache_clear()
    try:
        ok, why = backends.fa4.fa4_status()
        assert ok is available and why.startswith(words) and asked == ([module] if module else [])
        monkeypatch.setattr(backends.fa4.fa4_common, "fa4_import_status", lambda name: (False, "broken install"))
        backends.fa4.fa4_status.cache_clear()
        if module:
            assert backends.fa4.fa4_status() == (False, "broken install")
        else:  # without a GPU of a listed generation FA4 is not imported, so a broken install is not seen
            assert backends.fa4.fa4_status()[1].startswith(words) and asked == []
    finally:
        backends.fa4.fa4_status.cache_clear()


NO_FA4_IMPORT_PROBE = """
import sys, torch
from fusion_pass import runtime
from fusion_pass.runtime import backends
assert not torch.cuda.is_available()
listed = backends.list_backends()
spec = runtime.BatchSpec.from_lens([5, 3])
from fusion_pass.demo.models import MLAConfig, build_mla_model
model = build_mla_model(MLAConfig.tiny(), prefix="nofa4")
with runtime.batch(spec), torch.no_grad():
    model(spec.positions(), torch.randn(spec.num_tokens, 256, dtype=torch.bfloat16))
print("FA4", [b["reason"] for b in listed if b["name"] == "fa4"])
print("IMPORTED", sorted(m for m in sys.modules if m == "flash_attn" or m.startswith(("flash_attn.", "cutlass"))))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_without_cuda_nothing_of_fa4_is_imported():
    """list_backends() and a first attention call on a CPU-only machine import no flash_attn (about a second and
    several DeprecationWarnings in users' test runs), installed or not."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", NO_FA4_IMPORT_PROBE], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "IMPORTED []" in proc.stdout, proc.stdout
    assert "no CUDA device (flash-attn-4 " in proc.stdout


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


def test_fa4_run_path_with_an_injected_kernel(layer, monkeypatch):
    """FA4Backend.run_varlen end to end on the CPU through the row plan, with a PyTorch stand-in for the fused
    FA4 launcher (same arguments, patched into fusion_pass.kernels.launchers): the backend passes the prepared
    prefill inputs and the op's buffers."""
    seen = {}

    def fake_fused(q, k, v, *, cu_seqlens, max_seqlen, softmax_scale, causal, output, output_scale,
                   output_block_scale, cu_seqlens_k=None, max_seqlen_k=None):
        seen.update(q=q, k=k, v=v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, softmax_scale=softmax_scale,
                    causal=causal, cu_seqlens_k=cu_seqlens_k)
        o = dense_causal(q, k, v, cu_seqlens, softmax_scale)
        seen["attn"] = o
        t = o.shape[0]
        packed, scales = nvfp4.quantize(o.reshape(t, -1), output_scale)
        output.copy_(packed)
        output_block_scale.view(torch.uint8).view(-1).copy_(scales.view(torch.uint8).view(-1))

    spec = runtime.BatchSpec.from_lens([9, 4])
    inputs = layer.inputs(spec.num_tokens, seed=11)
    t = spec.num_tokens
    output = torch.full((t, layer.width // 2), 0xAB, dtype=torch.uint8)
    rows, cols = nvfp4.scale_shape(t, layer.width)
    block_scale = torch.full((rows, cols // 4), -1, dtype=torch.int32)
    layer.impl.clear_cache()
    monkeypatch.setattr(launchers, "fa4_attention_nvfp4_varlen", fake_fused)
    row_plan.run_on_prefill(backends.get_backend("fa4"), layer.impl, inputs, spec, output, GS, block_scale)

    assert seen["causal"] is True and seen["softmax_scale"] == layer.impl.softmax_scale
    assert seen["cu_seqlens"].tolist() == [0, 9, 13] and seen["max_seqlen"] == 9
    assert seen["q"].dtype == seen["k"].dtype == seen["v"].dtype == torch.bfloat16
    # the cache was extended as impl.forward would have
    assert layer.impl.cache_len("r0") == 9 and layer.impl.cache_len("r1") == 4
    # the kernel's inputs describe the same attention (k/v rounded to bf16 for MLA)
    attn32 = layer.attention32([(spec, inputs)])
    torch.testing.assert_close(seen["attn"].reshape(t, -1), attn32, atol=3e-2, rtol=3e-2)
    # bytes: what the kernel wrote landed in the op's buffers
    packed, scales = nvfp4.quantize(seen["attn"].reshape(t, -1), GS)
    assert torch.equal(output, packed)
    assert torch.equal(block_scale.view(torch.uint8).view(rows, cols), scales.view(torch.uint8))


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


def test_every_list_of_backends_derives_from_the_registry(monkeypatch):
    """One table (registry.BACKENDS): the setting's choices, auto's order, the listing, the selftest's timed
    backends and refresh() all follow it; refresh() is each backend's own hook."""
    from fusion_pass import selftest
    from fusion_pass.runtime.backends import registry

    names = tuple(b.name for b in registry.BACKENDS)
    assert names == registry.names() == backends.BACKEND_ORDER == ("fa4", "triton", "reference")
    assert settings.BACKEND_CHOICES == ("auto",) + names
    assert [e["name"] for e in backends.list_backends()] == list(names)
    assert selftest.TIMED_BACKENDS == registry.timed_names() == tuple(b.name for b in registry.BACKENDS if b.timed)
    assert selftest.TIMED_BACKENDS == ("fa4", "triton")
    assert all(backends.get_backend(n) is b for n, b in zip(names, registry.BACKENDS))
    refreshed = []
    for backend in registry.BACKENDS:
        monkeypatch.setattr(backend, "refresh", lambda b=backend: refreshed.append(b.name))
    backends.refresh()
    assert refreshed == list(names)


def test_a_backend_brings_its_kernels_as_callables():
    """The unfused path's half-precision attention and the chunked-context kernels are the backend's own
    callables (kernels.launchers), not names dispatched elsewhere."""
    fa4, triton, ref = (backends.get_backend(n) for n in ("fa4", "triton", "reference"))
    assert fa4.half_attention is launchers.fa4_attention_half_varlen
    assert triton.half_attention is launchers.triton_attention_half_varlen
    assert ref.half_attention is None
    assert (fa4.lse_kernel, fa4.merge_kernel) == (launchers.fa4_attention_with_lse_varlen,
                                                  launchers.triton_merge_nvfp4_rows)
    assert (triton.lse_kernel, triton.merge_kernel) == (launchers.triton_attention_with_lse_varlen,
                                                        launchers.triton_merge_nvfp4_rows)
    assert (ref.lse_kernel, ref.merge_kernel) == (launchers.reference_attention_with_lse_varlen,
                                                  launchers.reference_merge_nvfp4_rows)


# ---------------------------------------------------------------- auto picks only what is measured fast


def _usable_everywhere(monkeypatch, capability):
    """Every backend available and supporting every layer; the CUDA device of the given capability."""
    for cls in (backends.FA4Backend, backends.TritonBackend, backends.ReferenceBackend):
        monkeypatch.setattr(cls, "available", lambda self: (True, f"{self.name} here"))
        monkeypatch.setattr(cls, "supports", lambda self, *a: (True, "ok"))
    monkeypatch.setattr(backends.fa4, "device_arch", lambda index: capability[0] * 10 + capability[1])
    monkeypatch.setattr(backends.FA4Backend, "canary", lambda self, *a: (True, "stand-in canary"))


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
    monkeypatch.setattr(backends.fa4, "device_arch", lambda index: 90)
    entries = {e["name"]: e for e in backends.list_backends(CUDA0)}
    assert [entries[n]["auto"] for n in ("fa4", "triton", "reference")] == [True, False, False]
