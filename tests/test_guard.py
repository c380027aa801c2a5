"""The run-time guard of the fused attention -> NVFP4 call, the backends, and the ops' NVFP4 path."""

import importlib.util
import logging
import types

import pytest
import torch

import fusion_pass  # noqa: F401  (registers the ops)
from fusion_pass import nvfp4, runtime
from fusion_pass.runtime import backends, counters, guard, row_plan, settings
from fusion_pass.ops import scaled_fp4_quant

OPS = torch.ops.fusion_pass
CPU = torch.device("cpu")
MLA_DIMS = dict(num_heads=2, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=32)
GQA_DIMS = dict(num_heads=4, num_kv_heads=2, head_dim=16, v_head_dim=16)


@pytest.fixture(autouse=True)
def _clean_state(clean_backend_state):
    yield


# ---------------------------------------------------------------- layers and op helpers


class Layer:
    """A registered runtime impl plus the op that drives it."""

    def __init__(self, name, impl, op, make_inputs):
        self.name, self.impl, self.op, self._make_inputs = name, impl, op, make_inputs

    @property
    def width(self):
        return self.impl.num_heads * self.impl.v_head_dim

    def inputs(self, t, seed=0, dtype=torch.bfloat16):
        return self._make_inputs(t, torch.Generator().manual_seed(seed), dtype)

    def attention32(self, specs_and_inputs):
        """float32 attention of the last batch, replaying every batch on a fresh cache."""
        self.impl.clear_cache()
        out = None
        for spec, inputs in specs_and_inputs:
            out = self.impl.forward(*inputs, spec)
        return out.reshape(out.shape[0], -1)

    def call(self, spec, inputs, gs, *, poison=(0xAB, 0xFF)):
        """Run the NVFP4 form of the op on poisoned buffers; return (output, block scale bytes)."""
        t = spec.num_tokens
        output = torch.full((t, self.width // 2), poison[0], dtype=torch.uint8)
        rows, cols = nvfp4.scale_shape(t, self.width)
        block_scale = torch.full((rows, cols // 4), 0, dtype=torch.int32)
        block_scale.view(torch.uint8).fill_(poison[1])
        with runtime.batch(spec):
            self.op(*inputs, output, self.name, gs, block_scale)
        return output, block_scale.view(torch.uint8).view(rows, cols)

    def call_unfused(self, spec, inputs, gs):
        """The unfused graph: attention op with query-dtype output, then the scaled_fp4_quant wrapper."""
        t = spec.num_tokens
        out = torch.empty(t, self.width, dtype=inputs[0].dtype)
        with runtime.batch(spec):
            self.op(*inputs, out, self.name)
        packed, scales = scaled_fp4_quant(out, gs)
        return packed, scales.view(torch.uint8)


def _mla_layer():
    d = MLA_DIMS
    g = torch.Generator().manual_seed(123)
    h, nope, v, lora = d["num_heads"], d["qk_nope_head_dim"], d["v_head_dim"], d["kv_lora_rank"]
    weight = torch.randn(h * (nope + v), lora, generator=g) * lora**-0.5
    impl = runtime.MLAAttentionImpl(**d, kv_b_proj_weight=weight, softmax_scale=(nope + d["qk_rope_head_dim"]) ** -0.5)

    def make(t, gen, dtype):
        rope = d["qk_rope_head_dim"]
        return (
            torch.randn(t, h, nope + rope, generator=gen).to(dtype),
            torch.randn(t, lora, generator=gen).to(dtype),
            torch.randn(t, 1, rope, generator=gen).to(dtype),
        )

    return impl, OPS.mla_attention_with_output, make


def _gqa_layer():
    d = GQA_DIMS
    impl = runtime.AttentionImpl(**d, softmax_scale=d["head_dim"] ** -0.5)

    def make(t, gen, dtype):
        return (
            torch.randn(t, d["num_heads"], d["head_dim"], generator=gen).to(dtype),
            torch.randn(t, d["num_kv_heads"], d["head_dim"], generator=gen).to(dtype),
            torch.randn(t, d["num_kv_heads"], d["v_head_dim"], generator=gen).to(dtype),
        )

    return impl, OPS.attention_with_output, make


@pytest.fixture(params=["mla", "gqa"])
def layer(request):
    impl, op, make = _mla_layer() if request.param == "mla" else _gqa_layer()
    name = f"test_guard.{request.param}"
    runtime.register_layer(name, impl)
    yield Layer(name, impl, op, make)
    runtime.unregister_layer(name)


def _padding_mask(t, width):
    """bool [rows, cols] over the swizzled scale buffer: True where (row, column) is padding."""
    rows, cols = nvfp4.scale_shape(t, width)
    n_blocks = width // nvfp4.BLOCK_SIZE
    m = torch.arange(t).unsqueeze(1)
    c = torch.arange(n_blocks).unsqueeze(0)
    real = torch.zeros(rows * cols, dtype=torch.bool)
    real[nvfp4.swizzled_offset(m, c, n_blocks).reshape(-1)] = True
    return (~real).view(rows, cols)


GS = torch.tensor([40.0])


# ---------------------------------------------------------------- guard decisions per batch kind

SPECS = {
    "prefill": runtime.BatchSpec.from_lens([5, 3]),
    "decode": runtime.BatchSpec.from_lens([1, 1], [4, 7]),
    "mixed": runtime.BatchSpec.from_lens([1, 6], [3, 0]),
    "chunked": runtime.BatchSpec.from_lens([5, 4], [0, 6]),
    "decodes+chunked": runtime.BatchSpec.from_lens([1, 5], [2, 4]),
    "dcp2": runtime.BatchSpec.from_lens([5, 3], dcp_world_size=2),
    "chunked+dcp2": runtime.BatchSpec.from_lens([5], [4], dcp_world_size=2),
}


def _decide(spec, **overrides):
    kwargs = dict(device=CPU, dtype=torch.bfloat16, num_heads=2, qk_head_dim=24, v_head_dim=16)
    kwargs.update(overrides)
    return guard.decide(guard.BatchRows.from_spec(spec), guard.LayerShape(**kwargs))


@pytest.mark.parametrize(
    "kind, path, reason, backend, post_quantized",
    [
        ("prefill", "fused", None, "reference", {}),
        ("decode", "fallback", "decode_tokens", None, {"decode_tokens": 2}),
        ("mixed", "fused", None, "reference", {"decode_tokens": 1}),
        ("chunked", "fused", None, "reference", {}),
        ("decodes+chunked", "fused", None, "reference", {"decode_tokens": 1}),
        ("dcp2", "fallback", "dcp_world_size>1", None, {"dcp_world_size>1": 8}),
        ("chunked+dcp2", "fallback", "dcp_world_size>1", None, {"dcp_world_size>1": 5}),
    ],
)
def test_decision_per_batch_kind(kind, path, reason, backend, post_quantized):
    spec = SPECS[kind]
    decision = _decide(spec)
    assert (decision.path, decision.reason, decision.backend) == (path, reason, backend)
    assert decision.fused == (path == "fused")
    assert decision.detail
    prefill = spec.num_tokens - spec.num_decode_tokens
    assert decision.prefill_tokens == prefill
    assert decision.fused_tokens == (prefill if path == "fused" else 0)
    assert decision.post_quantized == post_quantized
    assert decision.fused_tokens + sum(decision.post_quantized.values()) == spec.num_tokens


class _NoContextBackend:
    name, handles_context = "stub", False


def test_a_backend_without_cached_context_fuses_the_other_prefills_only(monkeypatch):
    monkeypatch.setattr(backends, "select_backend", lambda *a, **k: (_NoContextBackend(), "stub backend"))
    # decode + one chunked prefill: no prefill row to fuse
    spec = SPECS["decodes+chunked"]
    decision = _decide(spec)
    assert (decision.path, decision.reason) == ("fallback", "chunked_prefill")
    assert decision.post_quantized == {"chunked_prefill": spec.num_tokens} and decision.fused_tokens == 0
    assert "backend stub runs prefills without cached context only" in decision.detail
    # a new prefill (5 rows) beside a chunked one (4 rows): the new one is fused, the chunked one post-quantized
    partial = _decide(SPECS["chunked"])
    assert (partial.path, partial.backend, partial.fused) == ("partial", "stub", True)
    assert (partial.prefill_tokens, partial.fused_tokens) == (9, 5)
    assert partial.post_quantized == {"chunked_prefill": 4}
    mixed = _decide(SPECS["mixed"])  # no context: the same backend fuses every prefill row of a mixed batch
    assert (mixed.path, mixed.backend, mixed.post_quantized) == ("fused", "stub", {"decode_tokens": 1})


# ---------------------------------------------------------------- through the real ops


@pytest.mark.parametrize("lens", [[5, 3], [70, 65]])
def test_fused_path_writes_quantized_float32_attention(layer, lens):
    spec = runtime.BatchSpec.from_lens(lens)
    inputs = layer.inputs(spec.num_tokens)
    output, scales = layer.call(spec, inputs, GS)
    counts = counters.counters()
    assert (counts["fused"], counts["fused_by_backend"], counts["fallback"]) == (1, {"reference": 1}, {})
    assert counts["tokens"] == {"prefill": spec.num_tokens, "prefill_fused": spec.num_tokens, "post_quantized": {}}

    attn32 = layer.attention32([(spec, inputs)])
    packed, ref_scales = nvfp4.quantize(attn32, GS)
    assert torch.equal(output, packed)
    assert torch.equal(scales, ref_scales.view(torch.uint8))
    # the data is such that rounding to bf16 first would have changed bytes: the test can tell the paths apart
    bf16_packed, _ = nvfp4.quantize(attn32.to(torch.bfloat16), GS)
    assert not torch.equal(packed, bf16_packed)


def test_fallback_path_equals_the_unfused_graph(layer):
    history = [(runtime.BatchSpec.from_lens([7, 5]), 1), (runtime.BatchSpec.from_lens([1, 1], [7, 5]), 2)]
    expected = {"fused": 1, "fused_by_backend": {"reference": 1}, "fallback": {"decode_tokens": 1},
                "tokens": {"prefill": 12, "prefill_fused": 12, "post_quantized": {"decode_tokens": 2}}}
    steps = [(spec, layer.inputs(spec.num_tokens, seed)) for spec, seed in history]

    layer.impl.clear_cache()
    for spec, inputs in steps:
        output, scales = layer.call(spec, inputs, GS)
    assert counters.counters() == expected

    attn_bf16 = layer.attention32(steps).to(torch.bfloat16)
    packed, ref_scales = nvfp4.quantize(attn_bf16, GS)
    assert torch.equal(output, packed)
    assert torch.equal(scales, ref_scales.view(torch.uint8))

    layer.impl.clear_cache()
    for spec, inputs in steps:
        unfused_packed, unfused_scales = layer.call_unfused(spec, inputs, GS)
    assert torch.equal(output, unfused_packed)
    assert torch.equal(scales, unfused_scales)
    assert counters.counters() == expected, "the query-dtype form of the op is not guarded nor counted"


# Batches after a first prefill of requests r0 (9 tokens) and r1 (6 tokens): decode rows first, then prefill rows
# (new requests, chunks of r0/r1 with cached context, long and short).
ROW_CASES = {
    "mixed": ([1, 1, 6, 130], [9, 6, 0, 0]),
    "chunked": ([4, 3], [9, 6]),
    "decodes+chunked": ([1, 5, 129], [9, 6, 0]),
    "many decodes+prefill": ([1] * 2 + [127], [9, 6, 0]),
}


@pytest.mark.parametrize("kind", list(ROW_CASES))
def test_prefill_rows_of_every_batch_are_fused_and_decode_rows_equal_the_unfused_graph(layer, kind):
    """Decode rows: byte-equal to the unfused graph. Prefill rows (with or without cached context): the
    reference backend's criterion, exactly quantize(float32 attention). Every byte is written (poisoned
    buffers), and scale padding is zero."""
    first = runtime.BatchSpec.from_lens([9, 6])
    query_lens, context_lens = ROW_CASES[kind]
    ids = ["r0", "r1"][: sum(1 for c in context_lens if c)] + [f"n{i}" for i in range(sum(1 for c in context_lens if not c))]
    decode_ids = [i for i, q in zip(ids, query_lens) if q == 1]
    ids = decode_ids + [i for i, q in zip(ids, query_lens) if q != 1]
    order = sorted(range(len(query_lens)), key=lambda i: query_lens[i] != 1)
    spec = runtime.BatchSpec.from_lens([query_lens[i] for i in order], [context_lens[i] for i in order], ids)
    steps = [(first, layer.inputs(first.num_tokens, 1)), (spec, layer.inputs(spec.num_tokens, 2))]
    results = []
    for poison in ((0xAB, 0xFF), (0x00, 0x00)):
        layer.impl.clear_cache()
        for s, inputs in steps:
            results.append(layer.call(s, inputs, GS, poison=poison))
    (out, scales), (out2, scales2) = results[1], results[3]
    assert torch.equal(out, out2) and torch.equal(scales, scales2), "some byte depends on the poison"

    d = spec.num_decode_tokens
    attn32 = layer.attention32(steps)
    expected = torch.cat([attn32[:d].to(torch.bfloat16).float(), attn32[d:]])
    packed, ref_scales = nvfp4.quantize(expected, GS)
    assert torch.equal(out, packed) and torch.equal(scales, ref_scales.view(torch.uint8))

    layer.impl.clear_cache()
    for s, inputs in steps:
        unfused_packed, unfused_scales = layer.call_unfused(s, inputs, GS)
    from fusion_pass.demo.workload import rows_equal

    assert rows_equal([(out, scales)], [(unfused_packed, unfused_scales)], d)
    counts = counters.counters()["tokens"]
    prefill = first.num_tokens + spec.num_tokens - d
    assert counts["prefill"] == counts["prefill_fused"] == 2 * prefill
    assert counts["post_quantized"] == ({"decode_tokens": 2 * d} if d else {})


def test_fused_and_fallback_differ_only_within_the_nvfp4_error_bounds(layer):
    spec = runtime.BatchSpec.from_lens([70, 65])
    inputs = layer.inputs(spec.num_tokens, seed=3)
    fused = layer.call(spec, inputs, GS)
    layer.impl.clear_cache()
    with settings.use_backend("triton"):  # unavailable here: forces the fallback on the same batch
        fallback = layer.call(spec, inputs, GS)
    counts = counters.counters()
    assert counts["fused_by_backend"] == {"reference": 1} and counts["fallback"] == {"no_backend": 1}

    attn32 = layer.attention32([(spec, inputs)])
    attn_bf16 = attn32.to(torch.bfloat16)
    deq_fused = nvfp4.dequantize(fused[0], fused[1].view(torch.float8_e4m3fn), GS)
    deq_fallback = nvfp4.dequantize(fallback[0], fallback[1].view(torch.float8_e4m3fn), GS)
    bound = nvfp4.error_bound(attn32, GS) + nvfp4.error_bound(attn_bf16, GS) + (attn32 - attn_bf16.float()).abs()
    diff = (deq_fused - deq_fallback).abs()
    assert bool((diff <= bound).all())
    assert bool((diff > 0).any()), "the two paths should not be byte-identical on this data"


@pytest.mark.parametrize("kind", ["prefill", "mixed", "fallback"])
def test_every_output_byte_is_written_and_scale_padding_is_zero(layer, kind):
    spec = runtime.BatchSpec.from_lens([9, 4] if kind == "prefill" else [1, 9, 4])
    inputs = layer.inputs(spec.num_tokens, seed=5)
    results = []
    for poison in ((0xAB, 0xFF), (0x00, 0x00), (0xFF, 0xAB)):
        layer.impl.clear_cache()
        with settings.use_backend("triton" if kind == "fallback" else None):  # triton: no backend on CPU
            results.append(layer.call(spec, inputs, GS, poison=poison))
    for output, scales in results[1:]:
        assert torch.equal(output, results[0][0]) and torch.equal(scales, results[0][1])
    scales = results[0][1]
    padding = _padding_mask(spec.num_tokens, layer.width)
    assert bool((scales[padding] == 0).all())
    assert bool((scales[~padding] != 0).all())  # real blocks of random data have non-zero scales
    counts = counters.counters()
    if kind == "fallback" and not torch.cuda.is_available():
        assert (counts["fallback"], counts["fused"]) == ({"no_backend": 3}, 0)
    elif kind != "fallback":
        assert (counts["fallback"], counts["fused"]) == ({}, 3)


def test_attention_is_computed_once_per_call(layer, monkeypatch):
    calls = []
    forward = layer.impl.forward

    def counting_forward(*args):
        calls.append(args[-1].kind)
        return forward(*args)

    monkeypatch.setattr(layer.impl, "forward", counting_forward)
    for lens in ([6, 2], [1, 5]):
        spec = runtime.BatchSpec.from_lens(lens)
        layer.impl.clear_cache()
        layer.call(spec, layer.inputs(spec.num_tokens), GS)
    # the fused backend writes the prefill rows; the runtime computes only the mixed batch's decode rows
    assert calls == ["decode"]


def test_counters_count_each_decision_and_log_each_reason_once(layer, caplog):
    caplog.set_level(logging.INFO, logger="fusion_pass")
    runs = [
        runtime.BatchSpec.from_lens([4, 3]),  # fused
        runtime.BatchSpec.from_lens([1, 1], [4, 3]),  # decode_tokens
        runtime.BatchSpec.from_lens([1, 1], [5, 4]),  # decode_tokens again: counted, not logged
        runtime.BatchSpec.from_lens([5], [6]),  # chunked prefill (r0 holds 6 tokens): fused by reference
        runtime.BatchSpec.from_lens([4, 3], dcp_world_size=2),  # dcp_world_size>1
    ]
    for i, spec in enumerate(runs):
        layer.call(spec, layer.inputs(spec.num_tokens, seed=i), GS)
    assert counters.counters() == {
        "fused": 2,
        "fused_by_backend": {"reference": 2},
        "fallback": {"decode_tokens": 2, "dcp_world_size>1": 1},
        "tokens": {"prefill": 19, "prefill_fused": 12,
                   "post_quantized": {"decode_tokens": 4, "dcp_world_size>1": 7}},
    }
    messages = [r.getMessage() for r in caplog.records if r.name == "fusion_pass" and r.levelno == logging.INFO]
    assert len(messages) == 2
    assert "reason: decode_tokens" in messages[0] and "reason: dcp_world_size>1" in messages[1]
    counters.reset_counters()
    assert counters.counters() == {"fused": 0, "fused_by_backend": {}, "fallback": {},
                                "tokens": {"prefill": 0, "prefill_fused": 0, "post_quantized": {}}}


def test_counters_snapshot_is_a_copy_and_record_rejects_bad_paths():
    counters.record(guard.Decision("fallback", "no_backend", None, "x"))
    snapshot = counters.counters()
    snapshot["fallback"]["no_backend"] = 99
    assert counters.counters()["fallback"] == {"no_backend": 1}
    with pytest.raises(ValueError, match="decision.path"):
        counters.record(guard.Decision("maybe", None, None))


# ---------------------------------------------------------------- buffer validation


def _buffers(t, width):
    rows, cols = nvfp4.scale_shape(t, width)
    return torch.empty(t, width // 2, dtype=torch.uint8), torch.empty(rows, cols // 4, dtype=torch.int32)


@pytest.mark.parametrize(
    "bad, match",
    [
        ("output_dtype", r"NVFP4 output must be a contiguous uint8 tensor of 64 elements \(\[T, H\*Dv/2\] = \[4, 16\]\)"),
        ("output_size", r"NVFP4 output must be a contiguous uint8 tensor of 64 elements"),
        ("output_noncontig", r"NVFP4 output must be .*\(not contiguous\)"),
        ("scale_rows", r"output_block_scale must be a contiguous buffer of 128x4 one-byte scales"),
        ("scale_dtype", r"output_block_scale must be .* got torch.float32"),
        ("gs_shape", r"output_scale \(the global scale\) must be a one-element float32 tensor"),
        ("gs_dtype", r"output_scale \(the global scale\) must be a one-element float32 tensor"),
        ("no_block_scale", r"NVFP4 output needs output_block_scale"),
    ],
)
def test_bad_nvfp4_buffers_are_rejected_before_any_attention(bad, match):
    impl, op, make = _mla_layer()
    runtime.register_layer("test_guard.bad", impl)
    try:
        t, width = 4, 32
        inputs = make(t, torch.Generator().manual_seed(0), torch.bfloat16)
        output, block_scale = _buffers(t, width)
        gs = GS
        if bad == "output_dtype":
            output = output.view(torch.int8)
        elif bad == "output_size":
            output = output[:, :8].contiguous()
        elif bad == "output_noncontig":
            output = torch.empty(width // 2, t, dtype=torch.uint8).t()
        elif bad == "scale_rows":
            block_scale = block_scale[:64].contiguous()
        elif bad == "scale_dtype":
            block_scale = block_scale.view(torch.float32)
        elif bad == "gs_shape":
            gs = torch.tensor([40.0, 1.0])
        elif bad == "gs_dtype":
            gs = torch.tensor([40.0], dtype=torch.float64)
        elif bad == "no_block_scale":
            block_scale = None
        with runtime.batch(runtime.BatchSpec.from_lens([4], request_ids=["req"])):
            with pytest.raises(ValueError, match=match):
                op(*inputs, output, "test_guard.bad", gs, block_scale)
        assert impl.cache_len("req") == 0, "validation must happen before attention runs"
        assert counters.counters()["fused"] == 0 and counters.counters()["fallback"] == {}
    finally:
        runtime.unregister_layer("test_guard.bad")


def test_width_not_divisible_by_16_is_rejected():
    impl = runtime.AttentionImpl(num_heads=1, num_kv_heads=1, head_dim=8, softmax_scale=0.3)
    runtime.register_layer("test_guard.narrow", impl)
    try:
        q = k = v = torch.randn(3, 1, 8, dtype=torch.bfloat16)
        output = torch.empty(3, 4, dtype=torch.uint8)
        block_scale = torch.empty(128, 1, dtype=torch.int32)
        with runtime.batch(runtime.BatchSpec.from_lens([3])):
            with pytest.raises(ValueError, match=r"num_heads \* v_head_dim divisible by 16, got 1 \* 8 = 8"):
                OPS.attention_with_output(q, k, v, output, "test_guard.narrow", GS, block_scale)
    finally:
        runtime.unregister_layer("test_guard.narrow")


# ---------------------------------------------------------------- backends: listing, detection, configuration


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
                _decide(SPECS["prefill"])
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


def test_fa4_call_kwargs_builds_views_of_the_op_buffers():
    t, h, dv = 130, 4, 32
    output, block_scale = _buffers(t, h * dv)
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


def _dense_causal(q, k, v, cu, scale):
    """float32 causal attention per sequence of a varlen batch (GQA by head grouping)."""
    out = []
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        o, _ = runtime.dense_attention(q[s:e].float(), k[s:e].float(), v[s:e].float(), scale=scale, causal=True)
        out.append(o)
    return torch.cat(out)


def test_fa4_run_path_with_an_injected_kernel(layer):
    """FA4Backend.run end to end on the CPU with a PyTorch stand-in for the FA4 kernel.

    The stand-in writes only the scales of real rows/columns, so the zero padding
    must come from the backend."""
    seen = {}

    def fake_varlen(**kw):
        seen.update(kw)
        o = _dense_causal(kw["q"], kw["k"], kw["v"], kw["cu_seqlens_q"], kw["softmax_scale"])
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
    padding = _padding_mask(t, layer.width)
    assert bool((scales[padding] == 0).all()) and bool((scales[~padding] != 0).all())


def test_prefill_qkv_feeds_the_same_attention_and_refuses_other_batches(layer):
    spec = runtime.BatchSpec.from_lens([6, 3])
    inputs = layer.inputs(spec.num_tokens, seed=2, dtype=torch.float32)
    layer.impl.clear_cache()
    q, k, v, _ = layer.impl.prefill_qkv(*inputs, spec)
    cu = torch.tensor(spec.query_start_loc())
    attn = _dense_causal(q, k, v, cu, layer.impl.softmax_scale).reshape(spec.num_tokens, -1)
    # a follow-up batch sees the cache prefill_qkv wrote
    follow = runtime.BatchSpec.from_lens([1, 1], [6, 3])
    follow_inputs = layer.inputs(2, seed=4, dtype=torch.float32)
    after_qkv = layer.impl.forward(*follow_inputs, follow)
    expected = layer.attention32([(spec, inputs)])
    torch.testing.assert_close(attn, expected, atol=1e-5, rtol=1e-5)
    replay = layer.attention32([(spec, inputs), (follow, follow_inputs)])
    torch.testing.assert_close(after_qkv.reshape(2, -1), replay, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="prefills only"):  # prefills with cached context are taken
        layer.impl.prefill_qkv(*inputs, SPECS["mixed"])


def test_backend_env_variable(monkeypatch):
    monkeypatch.setenv(settings.BACKEND_ENV, "reference")
    assert settings.configured_backend() == "reference"
    monkeypatch.setenv(settings.BACKEND_ENV, "Triton")
    assert settings.configured_backend() == "triton"
    assert _decide(SPECS["prefill"]).reason == "no_backend"
    monkeypatch.setenv(settings.BACKEND_ENV, "cutlass")
    with pytest.raises(ValueError, match=r"FUSION_PASS_BACKEND='cutlass' .* auto, fa4, triton, reference"):
        settings.configured_backend()
    with pytest.raises(ValueError, match="FUSION_PASS_BACKEND"):
        _decide(SPECS["prefill"])
    # set_backend takes precedence over the environment
    with settings.use_backend("reference"):
        assert _decide(SPECS["prefill"]).backend == "reference"
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


# ---------------------------------------------------------------- CUDA backends on every batch kind


def _cuda_backend_reason(name):
    if not torch.cuda.is_available():
        return "needs a CUDA device (the fa4 / triton fused backends)"
    ok, why = backends.get_backend(name).available()
    return None if ok else f"backend {name} unavailable: {why}"


@pytest.mark.parametrize("name", ["fa4", "triton"])
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_cuda_backends_fuse_prefill_rows_beside_decode_rows_at_their_global_rows(name, kind):
    """On the GPU: a mixed batch (decode rows first, then new prefills crossing 128-row tiles): prefill rows
    written by the backend's fused kernel at rows [D, T) within the requantization bound of the unfused
    bytes (plus the kernel's own rounding, below), decode rows byte-equal to the unfused graph's, every byte
    written (two poisons). Chunked prefills (cached context) are fused too: within the context workspace bound
    by one kernel call over context + new keys, beyond it (the last two steps run with a 64-token bound) by
    context chunks merged into NVFP4 by log-sum-exp.

    Off the first step the unfused rows are the float32 runtime's, while the kernels round P and V (and for MLA
    the expanded K/V) to bf16 and accumulate in float32: each output is then within a few 2^-9 * max|v| of
    float32 attention; 2^-6 * max|v| is the margin added to the requantization bound."""
    reason = _cuda_backend_reason(name)
    if reason:
        pytest.skip(reason)
    from fusion_pass.demo.workload import requantization_bound, rows_equal
    from fusion_pass.runtime import BatchSpec, RequestSpec

    if kind == "gqa":
        heads, dv = 8, 128
        impl = runtime.AttentionImpl(num_heads=heads, num_kv_heads=2, head_dim=128, softmax_scale=128**-0.5)
        op = torch.ops.fusion_pass.attention_with_output

        def make(t, gen):
            return tuple(torch.randn(t, h, 128, generator=gen).to("cuda", torch.bfloat16) for h in (heads, 2, 2))
    else:
        heads, dv, lora, rope, nope = 16, 128, 512, 64, 128
        w = (torch.randn(heads * (nope + dv), lora) * lora**-0.5).to("cuda", torch.bfloat16)
        impl = runtime.MLAAttentionImpl(num_heads=heads, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                                        v_head_dim=dv, kv_lora_rank=lora, kv_b_proj_weight=w,
                                        softmax_scale=(nope + rope) ** -0.5)
        op = torch.ops.fusion_pass.mla_attention_with_output

        def make(t, gen):
            return (torch.randn(t, heads, nope + rope, generator=gen).to("cuda", torch.bfloat16),
                    torch.randn(t, lora, generator=gen).to("cuda", torch.bfloat16),
                    torch.randn(t, 1, rope, generator=gen).to("cuda", torch.bfloat16))
    layer_name = f"test_guard.cuda.{name}.{kind}"
    runtime.register_layer(layer_name, impl)
    gen = torch.Generator().manual_seed(11)
    width = heads * dv
    steps = [
        (BatchSpec((RequestSpec("a", 300), RequestSpec("b", 77))), "fused"),
        (BatchSpec((RequestSpec("a", 1, 300), RequestSpec("b", 1, 77), RequestSpec("c", 200),
                    RequestSpec("d", 130))), "fused"),
        (BatchSpec((RequestSpec("c", 40, 200),)), "fused"),
        # decodes beside a short prefill: one 128-row tile holds both producers' rows
        (BatchSpec((RequestSpec("a", 1, 301), RequestSpec("b", 1, 78), RequestSpec("e", 50))), "fused"),
        # a chunk with cached context beside a new prefill
        (BatchSpec((RequestSpec("a", 1, 302), RequestSpec("d", 30, 130), RequestSpec("f", 60))), "fused"),
        # beyond the workspace bound (64 tokens, set below): context chunks merged by log-sum-exp
        (BatchSpec((RequestSpec("b", 1, 79), RequestSpec("c", 90, 240), RequestSpec("g", 33))), "fused"),
        (BatchSpec((RequestSpec("a", 1, 303), RequestSpec("d", 150, 160), RequestSpec("e", 20, 50))), "fused"),
    ]
    bounded = {len(steps) - 2, len(steps) - 1}
    vmax = 0.0  # over every step: cached context values count too
    try:
        runtime.clear_kv_caches()
        for step, (spec, want) in enumerate(steps):
            with settings.use_backend(name), settings.use_context_workspace_tokens(64 if step in bounded else None):
                t, d = spec.num_tokens, spec.num_decode_tokens
                inputs = make(t, gen)
                start = runtime.snapshot_kv_caches()
                with runtime.batch(spec):
                    half = torch.empty(t, width, dtype=torch.bfloat16, device="cuda")
                    op(*inputs, half, layer_name)
                    gs = torch.tensor([448 * 6 / half.float().abs().max().item()], device="cuda")
                    unfused = scaled_fp4_quant(half, gs)
                    got = []
                    for poison in (0xAB, 0x00):
                        runtime.restore_kv_caches(start)
                        rows, cols = nvfp4.scale_shape(t, width)
                        packed = torch.full((t, width // 2), poison, dtype=torch.uint8, device="cuda")
                        scales = torch.full((rows, cols), poison, dtype=torch.uint8, device="cuda")
                        before = counters.counters()
                        op(*inputs, packed, layer_name, gs, scales)
                        after = counters.counters()
                        got.append((packed, scales))
                assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1]), "unwritten bytes"
                packed, scales = got[0]
                fused = after["fused_by_backend"].get(name, 0) - before["fused_by_backend"].get(name, 0)
                assert fused == (want in ("fused", "partial")), f"{spec.kind}: {after}"
                pair, ref = [(packed, scales.view(torch.float8_e4m3fn))], [unfused]
                assert rows_equal(pair, ref, d), f"{spec.kind}: decode rows differ from the unfused graph's"
                prefill_fused = after["tokens"]["prefill_fused"] - before["tokens"]["prefill_fused"]
                assert prefill_fused == (t - d if want == "fused" else 0), f"{spec.kind}: {after['tokens']}"
                if want in ("fused", "partial"):
                    got_hat = nvfp4.dequantize(packed, scales.view(torch.float8_e4m3fn), gs, m=t)
                    want_hat = nvfp4.dequantize(*unfused, gs, m=t)
                    if kind == "gqa":
                        vmax = max(vmax, float(inputs[2].float().abs().max()))
                    else:
                        vmax = max(vmax, float(torch.einsum("sl,hvl->shv", inputs[1].float(),
                                                            impl.weights()[1]).abs().max()))
                    bound = requantization_bound(want_hat, gs) + 2.0**-6 * vmax
                    assert bool(((got_hat - want_hat).abs() <= bound).all()), f"{spec.kind}: prefill rows off"
                    padding = _padding_mask(t, width).to("cuda")
                    assert bool((scales[padding] == 0).all())
                else:
                    assert after["fallback"].get(want, 0) - before["fallback"].get(want, 0) == 1
                    assert torch.equal(packed, unfused[0]) and torch.equal(scales, unfused[1].view(torch.uint8))
    finally:
        runtime.unregister_layer(layer_name)
        runtime.clear_kv_caches()


# ---------------------------------------------------------------- the shared-buffer protocol of the GPU backends


class _ClobberingKernelBackend:
    """Stands in for the fa4 / triton backends on the CPU, with their entry points' worst write pattern:
    the whole scale buffer is zeroed before the launch (what the Triton entry does when the block columns
    are padded; FA4's zeroes the last 128-row tile), then the kernel writes the rows of its sequences
    (float32 attention of each sequence over its own tokens). No cached context (like both)."""

    name, handles_context = "clobbering", False

    def run_varlen(self, q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, output_scale, output_block_scale,
                   cu_seqlens_k=None, max_seqlen_k=None):
        from fusion_pass.kernels.reference import varlen_attention

        output_block_scale.view(torch.uint8).zero_()
        a, b = int(cu_seqlens[0]), int(cu_seqlens[-1])
        if cu_seqlens_k is None:
            k, v = k[a:b], v[a:b]
        out = varlen_attention(q[a:b], k, v, cu_seqlens - a, True, softmax_scale, cu_seqlens_k)[0]
        t = q.shape[0]
        row_plan.post_quantize_rows(out, output_scale, output, output_block_scale, a, t)


@pytest.mark.parametrize("lens", [
    ([1, 1, 4, 70, 3], [9, 6, 0, 0, 0], "fused"),  # decodes + new prefills, one 128-row tile
    ([1, 4, 70, 3], [9, 6, 0, 0], "partial"),  # a decode, a chunk with context, new prefills
    ([1, 1, 2, 200], [9, 6, 0, 0], "fused"),  # rows cross into a second tile
])
def test_fused_kernel_rows_and_post_quantized_rows_share_the_buffers(layer, monkeypatch, lens):
    """Decode rows and rows of prefills with context the backend does not run are written after the
    kernel (whose entry may clobber scale bytes of rows it does not own): byte-equal to the unfused
    graph; the kernel's rows within the requantization bound; every byte written; padding zero."""
    from fusion_pass.demo.workload import requantization_bound

    query_lens, context_lens, want = lens
    fake = _ClobberingKernelBackend()
    monkeypatch.setattr(backends, "select_backend", lambda *a, **k: (fake, "clobbering stand-in"))
    monkeypatch.setattr(backends, "get_backend", lambda name: fake)
    first = runtime.BatchSpec.from_lens([9, 6])
    ids = ["r0", "r1"][: sum(1 for c in context_lens if c)] + [f"n{i}" for i in range(sum(1 for c in context_lens if not c))]
    spec = runtime.BatchSpec.from_lens(query_lens, context_lens, ids)
    steps = [(first, layer.inputs(first.num_tokens, 1)), (spec, layer.inputs(spec.num_tokens, 2))]
    got = []
    for poison in ((0xAB, 0xFF), (0x00, 0x00)):
        layer.impl.clear_cache()
        for s, inputs in steps:
            got.append(layer.call(s, inputs, GS, poison=poison))
    (out, scales), (out2, scales2) = got[1], got[3]
    assert torch.equal(out, out2) and torch.equal(scales, scales2), "some byte depends on the poison"
    layer.impl.clear_cache()
    for s, inputs in steps:
        ref = layer.call_unfused(s, inputs, GS)
    t, locs = spec.num_tokens, spec.query_start_loc()
    exact = [i for i, r in enumerate(spec.requests) if r.is_decode or not backends.base.fuses(fake, r.context_len)]
    for i in exact:  # decode rows and prefills with context: the unfused graph's bytes
        a, b = locs[i], locs[i + 1]
        n_blocks = layer.width // nvfp4.BLOCK_SIZE
        offsets = nvfp4.swizzled_offset(torch.arange(a, b).unsqueeze(1), torch.arange(n_blocks).unsqueeze(0), n_blocks)
        assert torch.equal(out[a:b], ref[0][a:b]) and torch.equal(scales.reshape(-1)[offsets],
                                                                   ref[1].reshape(-1)[offsets]), spec.requests[i]
    got_hat = nvfp4.dequantize(out, scales.view(torch.float8_e4m3fn), GS, m=t)
    want_hat = nvfp4.dequantize(ref[0], ref[1].view(torch.float8_e4m3fn), GS, m=t)
    assert bool(((got_hat - want_hat).abs() <= requantization_bound(want_hat, GS)).all())
    assert bool((scales[_padding_mask(t, layer.width)] == 0).all())
    counts = counters.counters()
    assert counts["fused_by_backend"] == {"clobbering": 4}
    fused_rows = sum(r.query_len for r in spec.requests if not r.is_decode and backends.base.fuses(fake, r.context_len))
    assert counts["tokens"]["prefill_fused"] == 2 * (first.num_tokens + fused_rows)
    assert (want == "partial") == (fused_rows < spec.num_tokens - spec.num_decode_tokens)
