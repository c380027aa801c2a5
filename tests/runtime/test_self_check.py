"""The first-use self-check: when it runs, what a failure does to every later call, capture, and the modes.

The backend under test is the reference backend (what ``auto`` picks on the CPU) given a canary by
monkeypatching, so the whole op path runs: guard -> self-check -> fused or exact fallback. The FA4 canary's own
comparison runs with PyTorch stand-ins for the two FA4 launchers."""

import warnings

import pytest
import torch

from fusion_pass import nvfp4, runtime
from fusion_pass.kernels import launchers, reference
from fusion_pass.runtime import backends, counters, guard, self_check, settings

from layer_cases import GS, SPECS, decide


@pytest.fixture(autouse=True)
def _clean_state(clean_backend_state):
    yield


class Canary:
    """A canary for the reference backend that passes or fails as told and counts its runs."""

    def __init__(self, passes=True):
        self.passes, self.calls = passes, []

    def install(self, monkeypatch, needed=True):
        monkeypatch.setattr(backends.ReferenceBackend, "self_check_needed",
                            lambda backend, device: (needed, "test kernel"), raising=False)
        monkeypatch.setattr(backends.ReferenceBackend, "canary", lambda backend, *a: self.run(*a), raising=False)
        return self

    def run(self, device, dtype, heads, d, dv, group):
        self.calls.append((str(device), dtype, heads, d, dv, group))
        return (True, "bytes equal") if self.passes else (False, "codes differ at 3 byte(s), first at row 1, byte 2")


def test_a_passing_canary_runs_once_per_configuration_and_the_call_is_fused(monkeypatch, layer):
    canary = Canary().install(monkeypatch)
    spec = SPECS["prefill"]
    for seed in (1, 2, 3):
        inputs = layer.inputs(spec.num_tokens, seed=seed)
        output, scales = layer.call(spec, inputs, GS)
    assert len(canary.calls) == 1
    device, dtype, heads, d, dv, group = canary.calls[0]
    assert (device, dtype, heads, dv) == ("cpu", torch.bfloat16, layer.impl.num_heads, layer.impl.v_head_dim)
    # the layer's query heads per KV head: what its kernel is compiled for (MLA: keys up-projected per head)
    assert group == layer.impl.num_heads // getattr(layer.impl, "num_kv_heads", layer.impl.num_heads)
    c = counters.counters()
    assert c["fused_by_backend"] == {"reference": 3} and not c["fallback"]
    (result,) = self_check.self_check_results()
    assert result.passed and result.backend == "reference" and result.seconds >= 0
    assert "passed" in result.describe()
    assert "self-check passed (test kernel)" in decide(spec).detail


def test_a_failing_canary_disables_the_backend_with_one_warning_and_exact_fallbacks(monkeypatch, layer):
    canary = Canary(passes=False).install(monkeypatch)
    spec = SPECS["prefill"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in (4, 5, 6):
            inputs = layer.inputs(spec.num_tokens, seed=seed)
            output, scales = layer.call(spec, inputs, GS)
            want_packed, want_scales = layer.call_unfused(spec, inputs, GS)
            # the exact fallback: the unfused graph's bytes, padding included
            assert torch.equal(output, want_packed) and torch.equal(scales, want_scales.view(scales.shape))
    assert len(canary.calls) == 1
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "self-check" in str(w.message)]
    assert len(messages) == 1
    assert "reference fused kernel failed its self-check" in messages[0] and "row 1, byte 2" in messages[0]
    assert "head dims" in messages[0] and "bfloat16" in messages[0]
    c = counters.counters()
    assert c["fallback"] == {"self_check_failed": 3} and not c["fused_by_backend"]
    assert c["tokens"]["post_quantized"] == {"self_check_failed": 3 * spec.num_tokens}
    assert c["tokens"]["prefill_fused"] == 0
    # disabled for every configuration of the process, without running another canary
    decision = guard.decide(guard.BatchRows.from_spec(spec), guard.LayerShape(torch.device("cpu"), torch.float16,
                                                                              8, 64, 64))
    assert (decision.path, decision.reason) == ("fallback", "self_check_failed") and len(canary.calls) == 1
    assert "FAILED" in decision.detail
    # forgetting the results runs the check again
    self_check.forget_self_checks()
    canary.passes = True
    assert decide(spec).path == "fused" and len(canary.calls) == 2


def test_a_canary_that_raises_is_a_failed_check_not_a_crash(monkeypatch):
    def boom(backend, *a):
        raise RuntimeError("ptxas died")

    monkeypatch.setattr(backends.ReferenceBackend, "self_check_needed", lambda b, d: (True, "x"), raising=False)
    monkeypatch.setattr(backends.ReferenceBackend, "canary", boom, raising=False)
    with pytest.warns(RuntimeWarning, match="the canary raised RuntimeError: ptxas died"):
        decision = decide(SPECS["prefill"])
    assert decision.reason == "self_check_failed"


def test_no_canary_runs_inside_a_cuda_graph_capture(monkeypatch):
    canary = Canary().install(monkeypatch)
    monkeypatch.setattr(self_check, "_capturing", lambda device: True)
    decision = decide(SPECS["prefill"])
    assert (decision.path, decision.reason) == ("fallback", "self_check_pending") and canary.calls == []
    assert "CUDA graph is being captured" in decision.detail
    monkeypatch.setattr(self_check, "_capturing", lambda device: False)
    assert decide(SPECS["prefill"]).path == "fused" and len(canary.calls) == 1
    # once checked, a capture does not matter
    monkeypatch.setattr(self_check, "_capturing", lambda device: True)
    assert decide(SPECS["prefill"]).path == "fused" and len(canary.calls) == 1


def test_the_check_runs_only_when_a_call_would_fuse(monkeypatch):
    canary = Canary().install(monkeypatch)
    assert decide(SPECS["decode"]).reason == "decode_tokens"
    assert canary.calls == []


def test_a_backend_that_needs_no_check_runs_none(monkeypatch):
    canary = Canary().install(monkeypatch, needed=False)
    assert decide(SPECS["prefill"]).path == "fused" and canary.calls == []
    assert self_check.self_check_results() == []


@pytest.mark.parametrize("arch, mode, needed", [
    (100, "auto", True), (110, "auto", True), (90, "auto", False), (90, "all", True), (100, "off", False),
    (90, "off", False), (None, "auto", False),
])
def test_fa4_needs_its_check_where_this_project_never_ran_its_kernel(monkeypatch, arch, mode, needed):
    monkeypatch.setattr(backends.fa4, "device_arch", lambda index: arch)
    with settings.use_self_check(mode):
        got, why = self_check.required(backends.get_backend("fa4"), torch.device("cuda", 0))
    assert got is needed and why
    if arch == 100 and needed:
        assert "never run on hardware" in why


SETTING_CASES = [  # (getter, setter, scoped, variable, default, a raw value and its parse, another value, bad value)
    (settings.self_check_mode, settings.set_self_check, settings.use_self_check, settings.SELF_CHECK_ENV, "auto",
     (" ALL ", "all"), "off", r"'sometimes' .* auto, all, off"),
    (settings.split_mixed, settings.set_split_mixed, settings.use_split_mixed, settings.SPLIT_MIXED_ENV, "off",
     (" On ", "on"), "off", r"'sometimes' .* off, on"),
]


@pytest.mark.parametrize("get,set_,use,env,default,raw,other,bad", SETTING_CASES, ids=["self_check", "split_mixed"])
def test_mode_setting_and_environment(monkeypatch, get, set_, use, env, default, raw, other, bad):
    assert get() == default
    monkeypatch.setenv(env, raw[0])
    assert get() == raw[1]
    with use(other):
        assert get() == other
        with use(None):  # the environment decides inside
            assert get() == raw[1]
    set_(other)
    assert get() == other
    set_(None)
    monkeypatch.setenv(env, "sometimes")
    with pytest.raises(ValueError, match=env + "=" + bad):
        settings.check_environment()
    with pytest.raises(ValueError, match=rf"{set_.__name__}\(mode\)=1"):
        set_(1)
    with pytest.raises(ValueError, match=rf"{use.__name__}\(mode\)=True"):
        with use(True):
            pass


def test_check_environment_reads_every_setting_declared(monkeypatch):
    """Each setting is declared once (name, variable, default, parser); check_environment reads them all."""
    variables = settings.environment_variables()
    assert variables == (settings.BACKEND_ENV, settings.CONTEXT_WORKSPACE_ENV, settings.SELF_CHECK_ENV,
                         settings.SPLIT_MIXED_ENV, settings.POLICY_ENV)
    for variable in variables:
        monkeypatch.setenv(variable, "sometimes")
        with pytest.raises(ValueError, match=f"{variable}='sometimes'"):
            settings.check_environment()
        monkeypatch.delenv(variable)
    settings.check_environment()


# ------------------------------------------------------------------ the FA4 canary's comparison (CPU stand-ins)


def _stand_ins(monkeypatch, corrupt=None, main_loop_error=1.0, seen=None):
    """FA4's two launchers replaced by float32 reference attention: the twin returns it in the query dtype, the
    fused call writes quantize(twin) into the buffers and then ``corrupt(packed, scale_bytes)``."""
    calls = []

    def twin(q, k, v, cu_seqlens, max_seqlen, *, causal, softmax_scale, cu_seqlens_k=None, max_seqlen_k=None,
             return_lse=False):
        out, _ = reference.varlen_attention(q, k, v, cu_seqlens, causal, softmax_scale, cu_seqlens_k)
        calls.append(("twin", q.shape[0], int(cu_seqlens_k[-1])))
        return (out * main_loop_error).to(q.dtype)

    def fused(q, k, v, *, cu_seqlens, max_seqlen, softmax_scale, causal, output, output_scale, output_block_scale,
              cu_seqlens_k=None, max_seqlen_k=None):
        o = twin(q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=softmax_scale, cu_seqlens_k=cu_seqlens_k)
        packed, scales = nvfp4.quantize(o.reshape(o.shape[0], -1), output_scale)
        output.copy_(packed)
        output_block_scale.view(-1).copy_(scales.view(torch.uint8).view(-1))
        if seen is not None:
            seen.append((q.shape[1], k.shape[1], packed, nvfp4.quantize(o.reshape(o.shape[0], -1), output_scale,
                                                                        swizzled=False)[1].view(torch.uint8)))
        if corrupt:
            corrupt(output, output_block_scale.view(-1))

    def paged_twin(q, k_cache, v_cache, *, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k,
                   softmax_scale, causal, return_lse=False):
        k, cu_k = reference.gather_paged(k_cache, seqused_k, page_table)
        v, _ = reference.gather_paged(v_cache, seqused_k, page_table)
        calls.append(("paged_twin", q.shape[0], int(cu_k[-1])))
        return twin(q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=softmax_scale, cu_seqlens_k=cu_k)

    def paged_fused(q, k_cache, v_cache, *, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k,
                    softmax_scale, causal, output, output_scale, output_block_scale):
        k, cu_k = reference.gather_paged(k_cache, seqused_k, page_table)
        v, _ = reference.gather_paged(v_cache, seqused_k, page_table)
        fused(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, softmax_scale=softmax_scale, causal=causal,
              output=output, output_scale=output_scale, output_block_scale=output_block_scale, cu_seqlens_k=cu_k)

    monkeypatch.setattr(launchers, "fa4_attention_varlen", twin)
    monkeypatch.setattr(launchers, "fa4_attention_nvfp4_varlen", fused)
    monkeypatch.setattr(launchers, "fa4_attention_paged", paged_twin)
    monkeypatch.setattr(launchers, "fa4_attention_nvfp4_paged", paged_fused)
    return calls


@pytest.mark.parametrize("dims", [(192, 128), (128, 128), (64, 64)])
def test_fa4_canary_passes_when_the_fused_bytes_equal_the_twin_plus_quantize(monkeypatch, dims):
    calls = _stand_ins(monkeypatch)
    ok, detail = backends.FA4Backend().canary(torch.device("cpu"), torch.bfloat16, 16, *dims)
    assert ok and "canary bytes equal" in detail and f"head dims {dims}" in detail
    # both batches, once through each kernel; the second reads keys through cu_seqlens_k (cached context)
    twins = [c for c in calls if c[0] == "twin"][:4]  # the varlen batches' (the paged case's follow)
    assert len([c for c in calls if c[0] == "twin"]) == 6
    from fusion_pass.runtime.backends import canary

    paged = canary.PAGED_BATCH  # one paged launch: decode rows beside prefills with and without context
    want = (sum(paged["query_lens"]), sum(paged["query_lens"]) + sum(paged["context_lens"]))
    assert [c[1:] for c in calls if c[0] == "paged_twin"] == [want]
    assert 1 in paged["query_lens"] and max(paged["query_lens"]) > 1 and paged["page_size"] == 16
    queries = [sum(b["query_lens"]) for b in backends.canary_batches()]
    keys = [sum(b["query_lens"]) + sum(b["context_lens"]) for b in backends.canary_batches()]
    assert sorted({(t, tk) for _, t, tk in twins}) == sorted(zip(queries, keys)) and keys[1] > queries[1]
    lens = [max(b["query_lens"]) for b in backends.canary_batches()]
    assert lens[0] <= 128 < lens[1]  # both SM100 q_stage configurations


@pytest.mark.parametrize("where, words", [
    ("code", "codes differ at 1 byte(s), first at row"),
    ("scale", "scales differ at 1 byte(s), first at row"),
    ("padding", "scales differ at 1 byte(s), first at row"),
])
def test_fa4_canary_fails_on_any_differing_byte(monkeypatch, where, words):
    def corrupt(packed, scale_bytes):
        if where == "code":
            packed[40, 7] ^= 0x10
        elif where == "scale":
            scale_bytes[5] ^= 0x01
        else:  # a padding entry (row >= T) that must stay zero
            scale_bytes[-1] = 0x33

    _stand_ins(monkeypatch, corrupt)
    ok, detail = backends.FA4Backend().canary(torch.device("cpu"), torch.float16, 16, 128, 128)
    assert not ok and detail.startswith(words) and "query lengths [1, 37, 128]" in detail


@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (192, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_canary_data_hits_every_rule_of_the_format(monkeypatch, dims, dtype):
    """Saturated and e4m3-subnormal block scales, saturated and negative-zero codes, a NaN block and infinite
    elements: each occurs in the bytes the canary compares (the reference quantizer of float32 attention here)."""
    seen = []
    _stand_ins(monkeypatch, seen=seen)
    ok, detail = backends.FA4Backend().canary(torch.device("cpu"), dtype, 16, *dims, 3)
    assert ok, detail
    heads = [(h, hkv) for h, hkv, _, _ in seen]
    assert set(heads) == {(6, 2)}  # 3 query heads per KV head on 2 KV heads
    codes = torch.cat([p.flatten() for _, _, p, _ in seen])
    scale_bytes = torch.cat([s.flatten() for _, _, _, s in seen])
    nibbles = torch.cat([codes & 0xF, codes >> 4])
    assert int(((scale_bytes >= 0x01) & (scale_bytes <= 0x07)).sum()) > 0, "no e4m3-subnormal scale"
    assert int((scale_bytes == 0x7E).sum()) > 0, "no saturated scale (448)"
    assert int((scale_bytes == 0x7F).sum()) > 0, "no NaN block"
    assert int((nibbles == 0x7).sum()) > 0 and int((nibbles == 0x8).sum()) > 0  # +6 and negative zero
    infinite_blocks = 0
    for _, _, packed, scales in seen:  # an infinite element: scale 448 (saturated) beside codes +/-6
        infinite_blocks += int((scales == 0x7E).sum())
    assert infinite_blocks


def test_a_failed_check_refuses_the_backend_even_where_no_check_is_required(monkeypatch):
    """On SM90 in mode auto no check is required; one that ran (fusion-pass selftest in-process, or
    run_self_check at start-up) and failed still takes the backend out of every later call."""
    monkeypatch.setattr(backends.FA4Backend, "canary", lambda self, *a: (False, "codes differ at 1 byte(s)"))
    monkeypatch.setattr(backends.fa4, "device_arch", lambda index: 90)
    monkeypatch.setattr(backends.FA4Backend, "available", lambda self: (True, "here"))
    monkeypatch.setattr(backends.FA4Backend, "supports", lambda self, *a: (True, "ok"))
    device = torch.device("cuda", 0)
    with pytest.warns(RuntimeWarning, match="disabled for this process"):
        result = self_check.run_self_check(backends.get_backend("fa4"), device, torch.bfloat16, 16, 192, 128)
    assert not result.passed and self_check.failed_check("fa4") is result
    shape = guard.LayerShape(device, torch.bfloat16, 16, 192, 128)
    decision = guard.decide(guard.BatchRows.from_spec(SPECS["prefill"]), shape)
    assert (decision.path, decision.reason) == ("fallback", "self_check_failed")


def test_each_gqa_group_size_is_checked_on_its_own(monkeypatch):
    """The kernels compile per query heads per KV head: a layer of another group size runs its own canary."""
    canary = Canary().install(monkeypatch)
    cpu = torch.device("cpu")
    for kv_heads, group in ((8, 1), (2, 4), (None, 1), (4, 2), (2, 4)):
        shape = guard.LayerShape(cpu, torch.bfloat16, 8, 64, 64, None, kv_heads)
        assert guard.decide(guard.BatchRows.from_spec(SPECS["prefill"]), shape).path == "fused"
    assert [c[-1] for c in canary.calls] == [1, 4, 2]
    assert sorted(r.group for r in self_check.self_check_results()) == [1, 2, 4]


# ------------------------------------------------------------------ the real FA4 canary on this GPU


def _fa4_here():
    if not torch.cuda.is_available():
        return False, "needs a CUDA GPU"
    return backends.get_backend("fa4").available()


@pytest.mark.skipif(not _fa4_here()[0], reason=f"the fa4 backend is not available here: {_fa4_here()[1]}")
def test_the_fa4_canary_passes_on_this_gpu_and_the_guard_then_fuses():
    from fusion_pass.kernels.fa4 import forward

    device = torch.device("cuda", torch.cuda.current_device())
    fa4 = backends.get_backend("fa4")
    for dims in forward.supported_head_dims(device):
        for dtype in (torch.bfloat16, torch.float16):
            result = self_check.run_self_check(fa4, device, dtype, 16, *dims)
            assert result.passed, result.describe()
    with settings.use_self_check("all"), settings.use_backend("fa4"):
        shape = guard.LayerShape(device, torch.bfloat16, 16, 192, 128)
        decision = guard.decide(guard.BatchRows.from_spec(SPECS["prefill"]), shape)
    assert decision.path == "fused" and "self-check passed" in decision.detail


def test_fa4_canary_fails_when_the_shared_main_loop_is_wrong(monkeypatch):
    """Fused and twin agree byte for byte (both from one wrong main loop); the float32 reference catches it."""
    _stand_ins(monkeypatch, main_loop_error=1.05)
    ok, detail = backends.FA4Backend().canary(torch.device("cpu"), torch.bfloat16, 16, 192, 128)
    assert not ok and "from float32 attention, above 0.01" in detail
    _stand_ins(monkeypatch, main_loop_error=1.001)  # within the bf16 rounding's reach: accepted
    assert backends.FA4Backend().canary(torch.device("cpu"), torch.bfloat16, 16, 192, 128)[0]


def test_a_failed_check_keeps_the_backend_out_of_the_unfused_path_too(monkeypatch):
    from fusion_pass.runtime.engine import attention_call

    assert self_check.failed_check("fa4") is None
    monkeypatch.setattr(backends.FA4Backend, "canary", lambda self, *a: (False, "codes differ"))
    monkeypatch.setattr(backends.fa4, "device_arch", lambda index: 100)
    monkeypatch.setattr(backends.FA4Backend, "available", lambda self: (True, "here"))
    monkeypatch.setattr(backends.FA4Backend, "supports", lambda self, *a: (True, "ok"))
    with pytest.warns(RuntimeWarning):
        shape = guard.LayerShape(torch.device("cuda", 0), torch.bfloat16, 16, 192, 128)
        assert guard.decide(guard.BatchRows.from_spec(SPECS["prefill"]), shape).reason == "self_check_failed"
    assert self_check.failed_check("fa4").detail == "codes differ"
    # the pure-prefill unfused path would run the backend's bf16 kernel on CUDA; after the failure it does not
    q = torch.zeros(4, 16, 192, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))

    class Impl:
        num_heads, v_head_dim = 16, 128

    monkeypatch.setattr(attention_call, "layer_shape", lambda impl, q, inputs: shape)
    assert attention_call._half_prefill_kernel(Impl(), q, SPECS["prefill"], (q,)) is None
    monkeypatch.setattr(backends.FA4Backend, "canary", lambda self, *a: (True, "ok"))  # a GPU checks again
    self_check.forget_self_checks()
    assert attention_call._half_prefill_kernel(Impl(), q, SPECS["prefill"], (q,)) is backends.get_backend(
        "fa4").half_attention


def test_a_backend_without_a_check_is_not_applicable_not_disabled(monkeypatch, layer):
    """run_self_check on a backend that offers no canary (issue 29, item 6c): the result says the check is not
    applicable, no "disabled" warning, nothing recorded as failed, and the backend keeps serving: the record and
    what the guard does agree."""
    reference_backend = backends.get_backend("reference")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = self_check.run_self_check(reference_backend, "cpu", torch.bfloat16, 2, 24, 16)
    assert [str(w.message) for w in caught if "self-check" in str(w.message)] == []
    assert (result.applicable, result.passed, result.status) == (False, False, "not applicable")
    assert "not applicable" in result.describe() and "FAILED" not in result.describe()
    assert "offers no self-check" in result.detail
    assert self_check.failed_check("reference") is None
    assert self_check.self_check_results() == [result]
    decision = decide(SPECS["prefill"])
    assert (decision.path, decision.backend) == ("fused", "reference") and decision.detail
    spec = SPECS["prefill"]
    layer.call(spec, layer.inputs(spec.num_tokens, seed=7), GS)
    c = counters.counters()
    assert c["fused_by_backend"] == {"reference": 1} and not c["fallback"]
    # a check offered later runs for real: the earlier "not applicable" record does not stand for a result
    canary = Canary().install(monkeypatch)
    assert decide(SPECS["prefill"]).path == "fused" and len(canary.calls) == 1
    assert [r.status for r in self_check.self_check_results()] == ["passed"]
