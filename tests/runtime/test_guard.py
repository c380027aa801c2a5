"""The run-time guard of the fused attention -> NVFP4 call and the ops' NVFP4 path through it (the backends:
test_backends.py)."""

import logging

import pytest
import torch

import fusion_pass  # noqa: F401  (registers the ops)
from fusion_pass import nvfp4, runtime
from fusion_pass.runtime import backends, counters, guard, row_plan, settings
from fusion_pass.ops import scaled_fp4_quant
from layer_cases import (CPU, GS, OPS, SPECS, cuda_backend_reason, decide, dense_causal, mla_layer,  # noqa: F401
                         nvfp4_buffers, padding_mask)

@pytest.fixture(autouse=True)
def _clean_state(clean_backend_state):
    yield


# ---------------------------------------------------------------- layers and op helpers


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
    decision = decide(spec)
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
    decision = decide(spec)
    assert (decision.path, decision.reason) == ("fallback", "chunked_prefill")
    assert decision.post_quantized == {"chunked_prefill": spec.num_tokens} and decision.fused_tokens == 0
    assert "backend stub runs prefills without cached context only" in decision.detail
    # a new prefill (5 rows) beside a chunked one (4 rows): the new one is fused, the chunked one post-quantized
    partial = decide(SPECS["chunked"])
    assert (partial.path, partial.backend, partial.fused) == ("partial", "stub", True)
    assert (partial.prefill_tokens, partial.fused_tokens) == (9, 5)
    assert partial.post_quantized == {"chunked_prefill": 4}
    mixed = decide(SPECS["mixed"])  # no context: the same backend fuses every prefill row of a mixed batch
    assert (mixed.path, mixed.backend, mixed.post_quantized) == ("fused", "stub", {"decode_tokens": 1})


# ---------------------------------------------------------------- through the real ops


@pytest.mark.parametrize("lens", [[5, 3], [70, 65]])
def test_fused_path_writes_quantized_float32_attention(layer, lens):
    spec = runtime.BatchSpec.from_lens(lens)
    inputs = layer.inputs(spec.num_tokens)
    output, scales = layer.call(spec, inputs, GS)
    counts = counters.counters()
    assert (counts["fused"], counts["fused_by_backend"], counts["fallback"]) == (1, {"reference": 1}, {})
    assert counts["tokens"] == {"prefill": spec.num_tokens, "prefill_fused": spec.num_tokens, "decode_fused": 0, "post_quantized": {}}

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
                "tokens": {"prefill": 12, "prefill_fused": 12, "decode_fused": 0, "post_quantized": {"decode_tokens": 2}}}
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
def test_prefill_rows_of_every_batch_are_fused_and_decode_rows_are_split_or_in_the_one_call(layer, kind):
    """Prefill rows (with or without cached context): the reference backend's criterion, exactly
    quantize(float32 attention). Decode rows beside them: MLA's split, byte-equal to the unfused graph; a standard
    layer's one call over its paged cache, the same criterion as the prefill rows (``decode_fused``). Every byte
    is written (poisoned buffers), and scale padding is zero."""
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
    one_call = isinstance(layer.impl, runtime.AttentionImpl) and d > 0
    attn32 = layer.attention32(steps)
    expected = attn32 if one_call else torch.cat([attn32[:d].to(torch.bfloat16).float(), attn32[d:]])
    packed, ref_scales = nvfp4.quantize(expected, GS)
    assert torch.equal(out, packed) and torch.equal(scales, ref_scales.view(torch.uint8))

    layer.impl.clear_cache()
    for s, inputs in steps:
        unfused_packed, unfused_scales = layer.call_unfused(s, inputs, GS)
    from fusion_pass.demo.workload import rows_equal

    if not one_call:  # the one call's decode rows: quantize(float32 attention), checked above
        assert rows_equal([(out, scales)], [(unfused_packed, unfused_scales)], d)
    counts = counters.counters()["tokens"]
    prefill = first.num_tokens + spec.num_tokens - d
    assert counts["prefill"] == counts["prefill_fused"] == 2 * prefill
    assert counts["decode_fused"] == (2 * d if one_call else 0)
    assert counts["post_quantized"] == ({"decode_tokens": 2 * d} if d and not one_call else {})


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
    padding = padding_mask(spec.num_tokens, layer.width)
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
    # the fused backend writes the prefill rows; the runtime computes only the mixed batch's decode rows (MLA's
    # split), or none of them (a standard layer's one call over its paged cache)
    assert calls == ([] if isinstance(layer.impl, runtime.AttentionImpl) else ["decode"])


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
        "tokens": {"prefill": 19, "prefill_fused": 12, "decode_fused": 0,
                   "post_quantized": {"decode_tokens": 4, "dcp_world_size>1": 7}},
    }
    messages = [r.getMessage() for r in caplog.records if r.name == "fusion_pass" and r.levelno == logging.INFO]
    assert len(messages) == 2
    assert "reason: decode_tokens" in messages[0] and "reason: dcp_world_size>1" in messages[1]
    counters.reset_counters()
    assert counters.counters() == {"fused": 0, "fused_by_backend": {}, "fallback": {},
                                "tokens": {"prefill": 0, "prefill_fused": 0, "decode_fused": 0, "post_quantized": {}}}


def test_counters_snapshot_is_a_copy_and_record_rejects_bad_paths():
    counters.record(guard.Decision("fallback", "no_backend", None, "x"))
    snapshot = counters.counters()
    snapshot["fallback"]["no_backend"] = 99
    assert counters.counters()["fallback"] == {"no_backend": 1}
    with pytest.raises(ValueError, match="decision.path"):
        counters.record(guard.Decision("maybe", None, None))


# ---------------------------------------------------------------- buffer validation


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
    impl, op, make = mla_layer()
    runtime.register_layer("test_guard.bad", impl)
    try:
        t, width = 4, 32
        inputs = make(t, torch.Generator().manual_seed(0), torch.bfloat16)
        output, block_scale = nvfp4_buffers(t, width)
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


def test_prefill_qkv_feeds_the_same_attention_and_refuses_other_batches(layer):
    spec = runtime.BatchSpec.from_lens([6, 3])
    inputs = layer.inputs(spec.num_tokens, seed=2, dtype=torch.float32)
    layer.impl.clear_cache()
    q, k, v, _ = layer.impl.prefill_qkv(*inputs, spec)
    cu = torch.tensor(spec.query_start_loc())
    attn = dense_causal(q, k, v, cu, layer.impl.softmax_scale).reshape(spec.num_tokens, -1)
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


# ---------------------------------------------------------------- CUDA backends on every batch kind


@pytest.mark.parametrize("name", ["fa4", "triton"])
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_cuda_backends_fuse_prefill_rows_beside_decode_rows_at_their_global_rows(name, kind):
    """On the GPU: a mixed batch (decode rows first, then new prefills crossing 128-row tiles): prefill rows
    written by the backend's fused kernel at rows [D, T) within the requantization bound of the unfused
    bytes (plus the kernel's own rounding, below), decode rows byte-equal to the unfused graph's (MLA's split) or,
    for the standard layer, written by the same one launch over its paged cache within the same bound
    (``decode_fused``), every byte written (two poisons). Chunked prefills (cached context) are fused too: MLA's
    within the context workspace bound by one kernel call over context + new keys, beyond it (the last two steps
    run with a 64-token bound) by context chunks merged into NVFP4 by log-sum-exp; the standard layer's mixed calls
    read their context from the pages.

    Off the first step the unfused rows are the float32 runtime's, while the kernels round P and V (and for MLA
    the expanded K/V) to bf16 and accumulate in float32: each output is then within a few 2^-9 * max|v| of
    float32 attention; 2^-6 * max|v| is the margin added to the requantization bound."""
    reason = cuda_backend_reason(name)
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
                one_call = kind == "gqa" and d > 0  # every row in one launch over the layer's pages
                pair, ref = [(packed, scales.view(torch.float8_e4m3fn))], [unfused]
                if not one_call:
                    assert rows_equal(pair, ref, d), f"{spec.kind}: decode rows differ from the unfused graph's"
                prefill_fused = after["tokens"]["prefill_fused"] - before["tokens"]["prefill_fused"]
                assert prefill_fused == (t - d if want == "fused" else 0), f"{spec.kind}: {after['tokens']}"
                decode_fused = after["tokens"]["decode_fused"] - before["tokens"]["decode_fused"]
                assert decode_fused == (d if one_call else 0), f"{spec.kind}: {after['tokens']}"
                if want in ("fused", "partial"):
                    got_hat = nvfp4.dequantize(packed, scales.view(torch.float8_e4m3fn), gs, m=t)
                    want_hat = nvfp4.dequantize(*unfused, gs, m=t)
                    if kind == "gqa":
                        vmax = max(vmax, float(inputs[2].float().abs().max()))
                    else:
                        vmax = max(vmax, float(torch.einsum("sl,hvl->shv", inputs[1].float(),
                                                            impl.weights()[1]).abs().max()))
                    bound = requantization_bound(want_hat, gs) + 2.0**-6 * vmax
                    assert bool(((got_hat - want_hat).abs() <= bound).all()), f"{spec.kind}: fused rows off"
                    padding = padding_mask(t, width).to("cuda")
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
def test_fused_kernel_rows_and_post_quantized_rows_share_thenvfp4_buffers(layer, monkeypatch, lens):
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
    assert bool((scales[padding_mask(t, layer.width)] == 0).all())
    counts = counters.counters()
    assert counts["fused_by_backend"] == {"clobbering": 4}
    fused_rows = sum(r.query_len for r in spec.requests if not r.is_decode and backends.base.fuses(fake, r.context_len))
    assert counts["tokens"]["prefill_fused"] == 2 * (first.num_tokens + fused_rows)
    assert (want == "partial") == (fused_rows < spec.num_tokens - spec.num_decode_tokens)


# ---------------------------------------------------------------- settings read before any side effect


def _cache_state(impl):
    """Each request's cached tokens, as (dtype, shape, values) per form."""
    return {rid: [(t.dtype, tuple(t.shape), t.float().tolist()) for t in entry]
            for rid, entry in impl.cache.entries().items()}


@pytest.mark.parametrize("env, value", [
    (settings.CONTEXT_WORKSPACE_ENV, "0"),
    (settings.CONTEXT_WORKSPACE_ENV, "many"),
    (settings.CONTEXT_WORKSPACE_ENV, "-3"),
    (settings.BACKEND_ENV, "bogus"),
])
@pytest.mark.parametrize("kind, lens", [
    ("fused", ([6, 3], [4, 0])),  # a chunked prefill and a new one: the reference backend fuses both
    ("mixed", ([1, 5], [4, 0])),  # a decode beside a new prefill: fused prefill rows, post-quantized decode row
    ("fallback", ([1, 1], [4, 2])),  # decodes only: every row post-quantized
    ("query dtype", ([1, 5], [4, 0])),  # the op's unguarded form
])
def test_a_bad_setting_in_the_environment_raises_before_the_cache_or_the_counters_change(layer, monkeypatch, env,
                                                                                         value, kind, lens):
    """The context workspace bound (and the backend choice) from the environment are read at the start of every
    call, whichever path it would take: a bad value raises ValueError naming the variable, and the layer's
    cache, the counters and the output buffers are as before the call."""
    first = runtime.BatchSpec.from_lens([4, 2], request_ids=["r0", "r1"])
    layer.call(first, layer.inputs(first.num_tokens, seed=1), GS)
    spec = runtime.BatchSpec.from_lens(*lens, request_ids=["r0", "r2"] if lens[1][1] == 0 else ["r0", "r1"])
    assert decide(spec).path == ("fallback" if kind == "fallback" else "fused")
    counters.reset_counters()
    before = _cache_state(layer.impl)
    inputs = layer.inputs(spec.num_tokens, seed=2)
    extended = []  # a rolled-back cache would look unchanged: no entry may be touched at all
    many = hasattr(layer.impl.cache, "extend_many")  # the paged cache appends a batch's requests at once
    extend = getattr(layer.impl.cache, "extend_many" if many else "extend")
    monkeypatch.setattr(layer.impl.cache, "extend_many" if many else "extend",
                        lambda *a, **k: extended.extend(a[0] if many else [a[0]]) or extend(*a, **k))
    monkeypatch.setenv(env, value)
    t = spec.num_tokens
    if kind == "query dtype":
        output = torch.full((t, layer.width), 7.0, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=env), runtime.batch(spec):
            layer.op(*inputs, output, layer.name)
        assert bool((output == 7.0).all())
    else:
        output, block_scale = nvfp4_buffers(t, layer.width)
        output.fill_(0xAB)
        block_scale.view(torch.uint8).fill_(0xCD)
        with pytest.raises(ValueError, match=env), runtime.batch(spec):
            layer.op(*inputs, output, layer.name, GS, block_scale)
        assert bool((output == 0xAB).all()) and bool((block_scale.view(torch.uint8) == 0xCD).all())
    assert _cache_state(layer.impl) == before and extended == []
    assert counters.counters() == {"fused": 0, "fused_by_backend": {}, "fallback": {},
                                   "tokens": {"prefill": 0, "prefill_fused": 0, "decode_fused": 0, "post_quantized": {}}}
    monkeypatch.delenv(env)  # the same call runs once the variable is fixed
    if kind != "query dtype":
        layer.call(spec, inputs, GS)
        assert counters.counters()["fused" if kind != "fallback" else "fallback"]
        assert len(extended) == len(spec.requests)


# ---------------------------------------------------------------- key/value inputs in another dtype than q


def _mixed_dtype_inputs(layer, t, seed, kv_dtype=torch.float32):
    """bf16 queries; keys / values (MLA: the latents) in ``kv_dtype``, drawn from the same numbers."""
    q = layer.inputs(t, seed, torch.bfloat16)[0]
    return (q, *layer.inputs(t, seed, kv_dtype)[1:])


@pytest.mark.parametrize("lens", [([7, 5], None), ([1, 6, 4], [7, 0, 5], ["r0", "new", "r1"])])
def test_float32_keys_beside_bf16_queries_are_fused_in_float32_within_the_bound_of_the_unfused_bytes(layer, lens):
    """The reference backend takes the keys and values in float32 (its ``kv_dtype``), as the unfused computation
    does: its bytes are the quantization of the float32 attention of the inputs as given, within the documented
    bound (two NVFP4 error bounds plus the bf16 rounding of the output) of the unfused graph's bytes."""
    first = runtime.BatchSpec.from_lens([7, 5])
    spec = runtime.BatchSpec.from_lens(*lens) if lens[1] else first
    steps = [(first, _mixed_dtype_inputs(layer, first.num_tokens, 1))]
    if spec is not first:
        steps.append((spec, _mixed_dtype_inputs(layer, spec.num_tokens, 2)))
    for step, inputs in steps:
        fused = layer.call(step, inputs, GS)
    counts = counters.counters()
    assert counts["fused_by_backend"] == {"reference": len(steps)} and counts["fallback"] == {}

    attn32 = layer.attention32(steps)
    layer.impl.clear_cache()
    for step, inputs in steps:
        unfused = layer.call_unfused(step, inputs, GS)
    d = spec.num_decode_tokens
    want_packed, want_scales = nvfp4.quantize(attn32, GS)
    assert torch.equal(fused[0][d:], want_packed[d:]), "prefill rows: float32 attention of the float32 keys"
    assert torch.equal(fused[0][:d], unfused[0][:d]), "decode rows: the unfused graph's bytes"
    attn_bf16 = attn32.to(torch.bfloat16)
    deq_fused = nvfp4.dequantize(fused[0], fused[1].view(torch.float8_e4m3fn), GS)
    deq_unfused = nvfp4.dequantize(unfused[0], unfused[1].view(torch.float8_e4m3fn), GS)
    bound = nvfp4.error_bound(attn32, GS) + nvfp4.error_bound(attn_bf16, GS) + (attn32 - attn_bf16.float()).abs()
    assert bool(((deq_fused - deq_unfused).abs() <= bound).all())
    # the keys were not rounded to bf16 on the way: that would have given other bytes
    rounded = [(s, (x[0], *(t.to(torch.bfloat16) for t in x[1:]))) for s, x in steps]
    assert not torch.equal(nvfp4.quantize(layer.attention32(rounded), GS)[0][d:], want_packed[d:])


class _QueryDtypeKernels(backends.ReferenceBackend):
    """A backend like fa4 / triton: no float32 keys (``kv_dtype`` unset: the row plan rounds keys and values
    to the query dtype); the reference kernels otherwise."""

    name = "qdtype"
    kv_dtype = None


def test_a_backend_that_rounds_keys_to_the_query_dtype_does_not_fuse_keys_of_another_dtype(layer, monkeypatch):
    """fa4 / triton take keys and values in the query dtype: keys in another dtype are refused (counted as
    ``kv_dtype``, every row computed as the unfused graph computes it: the same bytes); keys in the
    query dtype are fused as before; a backend with float32 keys fuses them."""
    stand_in = _QueryDtypeKernels()
    monkeypatch.setattr(backends, "select_backend", lambda *a, **k: (stand_in, "stand-in"))
    monkeypatch.setattr(backends, "get_backend", lambda name: stand_in)
    spec = runtime.BatchSpec.from_lens([1, 6, 4], [0, 0, 0])  # a one-token prefill, then two more
    for kv_dtype in (torch.float32, torch.float16):
        inputs = _mixed_dtype_inputs(layer, spec.num_tokens, 3, kv_dtype)
        layer.impl.clear_cache()
        counters.reset_counters()
        refused = layer.call(spec, inputs, GS)
        counts = counters.counters()
        assert counts["fused"] == 0 and counts["fallback"] == {"kv_dtype": 1}, kv_dtype
        assert counts["tokens"]["post_quantized"] == {"kv_dtype": spec.num_tokens}
        layer.impl.clear_cache()
        unfused = layer.call_unfused(spec, inputs, GS)
        assert torch.equal(refused[0], unfused[0]) and torch.equal(refused[1], unfused[1])
    from fusion_pass.runtime.engine import attention_call
    decision = guard.decide(guard.BatchRows.from_spec(spec), attention_call.layer_shape(layer.impl, inputs[0], inputs))
    assert decision.reason == "kv_dtype" and "backend qdtype computes attention with them in the query dtype" in (
        decision.detail)

    counters.reset_counters()
    layer.impl.clear_cache()
    layer.call(spec, layer.inputs(spec.num_tokens, 3, torch.bfloat16), GS)  # one dtype: fused
    assert counters.counters()["fused_by_backend"] == {"qdtype": 1}

    monkeypatch.setattr(stand_in, "kv_dtype", torch.float32)  # float32 keys: fused
    counters.reset_counters()
    layer.impl.clear_cache()
    layer.call(spec, _mixed_dtype_inputs(layer, spec.num_tokens, 3), GS)
    assert counters.counters()["fused_by_backend"] == {"qdtype": 1}


@pytest.mark.parametrize("name", ["fa4", "triton"])
def test_cuda_backends_refuse_float32_keys_beside_bf16_queries(name):
    """On CUDA: float32 k/v beside bf16 q on a pure-prefill batch and a mixed one: the backend would round them,
    so the call falls back (``kv_dtype``) with the unfused graph's bytes, which are those of the
    float32 runtime (the pure-prefill half kernel is not used for such inputs either); bf16 k/v are fused."""
    reason = cuda_backend_reason(name)
    if reason:
        pytest.skip(reason)
    heads, kv_heads, dim = 8, 2, 128
    impl = runtime.AttentionImpl(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, softmax_scale=dim**-0.5)
    layer_name = f"test_guard.cuda_kv_dtype.{name}"
    runtime.register_layer(layer_name, impl)
    op, width = torch.ops.fusion_pass.attention_with_output, heads * dim
    gen = torch.Generator().manual_seed(5)
    try:
        for spec in (runtime.BatchSpec.from_lens([150, 40]), runtime.BatchSpec.from_lens([1, 70], [150, 0])):
            t = spec.num_tokens
            q = torch.randn(t, heads, dim, generator=gen).to("cuda", torch.bfloat16)
            k, v = (torch.randn(t, kv_heads, dim, generator=gen).to("cuda") for _ in range(2))
            for kv_dtype, fused in ((torch.float32, False), (torch.bfloat16, True)):
                inputs = (q, k.to(kv_dtype), v.to(kv_dtype))
                start = runtime.snapshot_kv_caches()
                with settings.use_backend(name), runtime.batch(spec):
                    half = torch.empty(t, width, dtype=torch.bfloat16, device="cuda")
                    op(*inputs, half, layer_name)
                    gs = torch.tensor([448 * 6 / half.float().abs().max().item()], device="cuda")
                    want = scaled_fp4_quant(half, gs)
                    runtime.restore_kv_caches(start)
                    packed, block_scale = nvfp4_buffers(t, width)
                    packed, block_scale = packed.cuda(), block_scale.cuda()
                    counters.reset_counters()
                    op(*inputs, packed, layer_name, gs, block_scale)
                counts = counters.counters()
                if fused:
                    assert counts["fused_by_backend"] == {name: 1}, counts
                else:
                    assert counts["fallback"] == {"kv_dtype": 1}, counts
                    assert torch.equal(packed, want[0]) and torch.equal(block_scale.view(torch.uint8),
                                                                        want[1].view(torch.uint8))
                    if spec.num_decode_tokens == 0:  # the float32 runtime, not the half kernel
                        impl_out = impl.forward(*inputs, runtime.BatchSpec.from_lens([150, 40], request_ids=["x",
                                                                                                             "y"]))
                        assert torch.equal(half, impl_out.to(torch.bfloat16).reshape(t, width))
                if kv_dtype == torch.float32:
                    runtime.restore_kv_caches(start)
    finally:
        runtime.unregister_layer(layer_name)
        runtime.clear_kv_caches()
