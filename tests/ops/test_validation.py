"""Argument validation of the ops, and the per-thread scoping of use_backend / tap_gemm_inputs.

A rejected call must change nothing: no guard counter, no KV cache entry, no
output byte. That is proven by retrying with valid arguments and comparing,
byte for byte, with a fresh run (cleared caches, the same history replayed).
"""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
import torch

import fusion_pass  # noqa: F401  (registers the ops)
from fusion_pass import nvfp4, ops, runtime
from fusion_pass.runtime import counters, guard, settings

OPS = torch.ops.fusion_pass
MLA_DIMS = dict(num_heads=2, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=32)
GQA_DIMS = dict(num_heads=4, num_kv_heads=2, head_dim=16, v_head_dim=16)
GS = torch.tensor([40.0])
ZERO_COUNTERS = {"fused": 0, "fused_by_backend": {}, "fallback": {},
                 "tokens": {"prefill": 0, "prefill_fused": 0, "decode_fused": 0, "post_quantized": {}}}


@pytest.fixture(autouse=True)
def _clean_state(clean_backend_state):
    yield


# ---------------------------------------------------------------- layers


class Layer:
    """A registered runtime impl, the op that drives it, its argument names."""

    def __init__(self, kind, name, impl, op, op_name, arg_names, make_inputs):
        self.kind, self.name, self.impl, self.op, self.op_name = kind, name, impl, op, op_name
        self.arg_names, self._make_inputs = arg_names, make_inputs

    @property
    def width(self):
        return self.impl.num_heads * self.impl.v_head_dim

    def inputs(self, t, seed=0, dtype=torch.bfloat16):
        return self._make_inputs(t, torch.Generator().manual_seed(seed), dtype)

    def nvfp4_buffers(self, t, poison=(0xAB, 0xFF)):
        output = torch.full((t, self.width // 2), poison[0], dtype=torch.uint8)
        rows, cols = nvfp4.scale_shape(t, self.width)
        block_scale = torch.zeros(rows, cols // 4, dtype=torch.int32)
        block_scale.view(torch.uint8).fill_(poison[1])
        return output, block_scale

    def call(self, spec, inputs, gs=GS, output=None, block_scale=None):
        """The NVFP4 form of the op; returns (output bytes, scale bytes) as fresh tensors."""
        if output is None:
            output, block_scale = self.nvfp4_buffers(spec.num_tokens)
        with runtime.batch(spec):
            self.op(*inputs, output, self.name, gs, block_scale)
        return output.clone(), block_scale.view(torch.uint8).clone()

    def call_plain(self, spec, inputs, output=None):
        """The query-dtype form of the op; returns the output."""
        if output is None:
            output = torch.full((spec.num_tokens, self.width), 7, dtype=inputs[0].dtype)
        with runtime.batch(spec):
            self.op(*inputs, output, self.name)
        return output.clone()

    def fresh(self, history, spec, inputs, gs=GS, plain=False):
        """The result of ``spec`` on caches rebuilt from scratch by replaying ``history``."""
        self.impl.clear_cache()
        for s, i in history:
            self.call(s, i)
        return self.call_plain(spec, inputs) if plain else self.call(spec, inputs, gs)


def _mla_layer(name):
    d = MLA_DIMS
    g = torch.Generator().manual_seed(123)
    h, nope, v, lora, rope = d["num_heads"], d["qk_nope_head_dim"], d["v_head_dim"], d["kv_lora_rank"], d["qk_rope_head_dim"]
    weight = torch.randn(h * (nope + v), lora, generator=g) * lora**-0.5
    impl = runtime.MLAAttentionImpl(**d, kv_b_proj_weight=weight, softmax_scale=(nope + rope) ** -0.5)

    def make(t, gen, dtype):
        return (
            torch.randn(t, h, nope + rope, generator=gen).to(dtype),
            torch.randn(t, lora, generator=gen).to(dtype),
            torch.randn(t, 1, rope, generator=gen).to(dtype),
        )

    runtime.register_layer(name, impl)
    return Layer("mla", name, impl, OPS.mla_attention_with_output, "mla_attention_with_output",
                 ("q", "kv_c_normed", "k_pe"), make)


def _gqa_layer(name):
    d = GQA_DIMS
    impl = runtime.AttentionImpl(**d, softmax_scale=d["head_dim"] ** -0.5)

    def make(t, gen, dtype):
        return (
            torch.randn(t, d["num_heads"], d["head_dim"], generator=gen).to(dtype),
            torch.randn(t, d["num_kv_heads"], d["head_dim"], generator=gen).to(dtype),
            torch.randn(t, d["num_kv_heads"], d["v_head_dim"], generator=gen).to(dtype),
        )

    runtime.register_layer(name, impl)
    return Layer("gqa", name, impl, OPS.attention_with_output, "attention_with_output", ("q", "k", "v"), make)


def _make_layer(kind, name):
    return (_mla_layer if kind == "mla" else _gqa_layer)(name)


@pytest.fixture(params=["mla", "gqa"])
def layer(request):
    name = f"test_validation.{request.param}"
    made = _make_layer(request.param, name)
    yield made
    runtime.unregister_layer(name)


# Scenarios: the history that fills the caches, then the batch under test.
# "prefill", "mixed" (decode rows post-quantized for MLA, in the one paged call for GQA) and "chunked" take the fused
# path, "decode" the fallback.
SCENARIOS = {
    "prefill": ([], runtime.BatchSpec.from_lens([5, 3])),
    "mixed": ([runtime.BatchSpec.from_lens([4, 6])], runtime.BatchSpec.from_lens([1, 6], [4, 0], ["r0", "r2"])),
    "chunked": ([runtime.BatchSpec.from_lens([7])], runtime.BatchSpec.from_lens([5], [7])),
    "decode": ([runtime.BatchSpec.from_lens([4, 6])], runtime.BatchSpec.from_lens([1, 1], [4, 6])),
}
EXPECTED_PATH = {"prefill": "fused", "mixed": "fused", "chunked": "fused", "decode": "fallback"}


def _setup(layer, scenario):
    history_specs, spec = SCENARIOS[scenario]
    history = [(s, layer.inputs(s.num_tokens, seed=10 + i)) for i, s in enumerate(history_specs)]
    layer.impl.clear_cache()
    for s, i in history:
        layer.call(s, i)
    counters.reset_counters()
    return history, spec, layer.inputs(spec.num_tokens, seed=99)


def _cache_state(impl):
    """The cache's entries: MLA's by identity (entries are replaced, never modified in place); the standard layer's
    paged ones by content, pages and the number of pages in use (pages are written in place; a pool may have grown)."""
    if not hasattr(impl.cache, "page_counts"):
        return {rid: tuple(id(t) for t in entry) for rid, entry in impl.cache.entries().items()}
    tokens = {rid: [(t.dtype, t.float().tolist()) for t in entry] for rid, entry in impl.cache.entries().items()}
    counts = impl.cache.page_counts()
    return tokens, {rid: impl.cache.entry(rid).pages for rid in tokens}, counts["allocated"] - counts["free"]


def _assert_rejected_without_trace(layer, history, spec, inputs, call, match, *, exc=ValueError, plain=False):
    """``call()`` raises; counters, cache unchanged; a valid retry equals a fresh run byte for byte."""
    before, cache = counters.counters(), _cache_state(layer.impl)
    with pytest.raises(exc, match=match):
        call()
    assert counters.counters() == before, "a rejected call must not be counted"
    assert _cache_state(layer.impl) == cache, "a rejected call must not touch the KV cache"
    if plain:
        retry = layer.call_plain(spec, inputs)
        assert counters.counters() == before
    else:
        retry = layer.call(spec, inputs)
    after_retry = counters.counters()
    if not plain:
        assert after_retry["fused"] + sum(after_retry["fallback"].values()) == 1, "the retry is counted once"
    fresh = layer.fresh(history, spec, inputs, plain=plain)
    if plain:
        assert torch.equal(retry.view(torch.uint8), fresh.view(torch.uint8))
    else:
        assert torch.equal(retry[0], fresh[0]) and torch.equal(retry[1], fresh[1])
    return after_retry


# ---------------------------------------------------------------- the global scale's value


BAD_SCALE_VALUES = [0.0, -0.0, -1.0, -1e-30, float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("value", BAD_SCALE_VALUES, ids=str)
def test_bad_global_scale_value_is_rejected_before_anything(layer, scenario, value):
    history, spec, inputs = _setup(layer, scenario)
    gs = torch.tensor([value])
    message = f"{layer.op_name}: output_scale (the global scale) must be positive and finite, got {gs.item()}"
    counts = _assert_rejected_without_trace(
        layer, history, spec, inputs, lambda: layer.call(spec, inputs, gs), "^" + re.escape(message) + "$"
    )
    # the retry took the path the batch calls for
    assert (counts["fused"] == 1) == (EXPECTED_PATH[scenario] == "fused")


def test_the_issue_scenario_zero_scale_then_retry():
    """The issue as filed: global scale 0 on a prefill, then a retry, then a decode step on top."""
    layer = _mla_layer("test_validation.issue")
    try:
        spec = runtime.BatchSpec.from_lens([6, 2])
        inputs = layer.inputs(8, seed=1)
        with pytest.raises(ValueError, match=r"^mla_attention_with_output: output_scale \(the global scale\) "
                                             r"must be positive and finite, got 0\.0$"):
            layer.call(spec, inputs, torch.tensor([0.0]))
        assert counters.counters() == ZERO_COUNTERS
        assert layer.impl.cache_len("r0") == 0 and layer.impl.cache_len("r1") == 0
        first = layer.call(spec, inputs)
        decode = runtime.BatchSpec.from_lens([1, 1], [6, 2])
        decode_inputs = layer.inputs(2, seed=2)
        second = layer.call(decode, decode_inputs)
        assert counters.counters() == {"fused": 1, "fused_by_backend": {"reference": 1},
                                    "fallback": {"decode_tokens": 1},
                                    "tokens": {"prefill": 8, "prefill_fused": 8, "decode_fused": 0, "post_quantized": {"decode_tokens": 2}}}
        layer.impl.clear_cache()
        assert torch.equal(layer.call(spec, inputs)[0], first[0])
        again = layer.call(decode, decode_inputs)
        assert torch.equal(again[0], second[0]) and torch.equal(again[1], second[1])
    finally:
        runtime.unregister_layer("test_validation.issue")


# ---------------------------------------------------------------- every argument of the attention ops

# Several bad values per argument, generated from the good one.
INPUT_MUTATIONS = {
    "one token fewer": lambda x: x[:-1],
    "one token more": lambda x: torch.cat([x, x[:1]]),
    "last dim one short": lambda x: x[..., :-1],
    "last dim one long": lambda x: torch.cat([x, x[..., :1]], dim=-1),
    "extra leading dim": lambda x: x.unsqueeze(0),
    "integer dtype": lambda x: x.to(torch.int16),
}

NVFP4_MUTATIONS = {
    "output": {
        "int8": lambda o, s, g: (o.view(torch.int8), s, g),
        "float32 same numel": lambda o, s, g: (torch.zeros(o.numel(), dtype=torch.float32), s, g),
        "one row fewer": lambda o, s, g: (o[:-1].clone(), s, g),
        "one row more": lambda o, s, g: (torch.cat([o, o[:1]]), s, g),
        "one byte short": lambda o, s, g: (o.reshape(-1)[:-1].clone(), s, g),
        "not contiguous": lambda o, s, g: (o.t().contiguous().t(), s, g),
    },
    "output_scale": {
        "two elements": lambda o, s, g: (o, s, torch.tensor([40.0, 40.0])),
        "empty": lambda o, s, g: (o, s, torch.empty(0)),
        "float64": lambda o, s, g: (o, s, g.double()),
        "float16": lambda o, s, g: (o, s, g.half()),
        "int64": lambda o, s, g: (o, s, torch.tensor([40])),
        "zero": lambda o, s, g: (o, s, torch.tensor([0.0])),
        "nan": lambda o, s, g: (o, s, torch.tensor([float("nan")])),
        "negative": lambda o, s, g: (o, s, torch.tensor([-40.0])),
    },
    "output_block_scale": {
        "missing": lambda o, s, g: (o, None, g),
        "half the rows": lambda o, s, g: (o, s[:64].clone(), g),
        "twice the rows": lambda o, s, g: (o, torch.cat([s, s]), g),
        "float32": lambda o, s, g: (o, s.view(torch.float32), g),
        "int16": lambda o, s, g: (o, s.view(torch.int16), g),
        "not contiguous": lambda o, s, g: (o, s.view(torch.uint8).t().contiguous().t(), g),
        "int32 with a strided last dim of size 1": lambda o, s, g: (o, torch.zeros(s.shape[::-1], dtype=s.dtype).t(), g),
    },
}


@pytest.mark.parametrize("scenario", ["prefill", "mixed"])
@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("mutation", list(INPUT_MUTATIONS))
def test_bad_attention_inputs_are_rejected_before_anything(layer, scenario, position, mutation):
    history, spec, inputs = _setup(layer, scenario)
    bad_inputs = list(inputs)
    bad_inputs[position] = INPUT_MUTATIONS[mutation](inputs[position])
    arg = layer.arg_names[position]
    match = rf"^{layer.op_name}: {arg} must "
    output, block_scale = layer.nvfp4_buffers(spec.num_tokens)
    _assert_rejected_without_trace(
        layer, history, spec, inputs, lambda: layer.call(spec, tuple(bad_inputs), GS, output, block_scale), match
    )
    # nothing was written either
    assert bool((output == 0xAB).all()) and bool((block_scale.view(torch.uint8) == 0xFF).all())
    # the query-dtype form checks the same way
    history, spec, inputs = _setup(layer, scenario)
    _assert_rejected_without_trace(
        layer, history, spec, inputs, lambda: layer.call_plain(spec, tuple(bad_inputs)), match, plain=True
    )


def test_mla_k_pe_dtype_must_match_kv_c_normed():
    layer = _mla_layer("test_validation.kpe")
    try:
        for dtype in (torch.float32, torch.float16):
            history, spec, inputs = _setup(layer, "mixed")
            q, kv_c, k_pe = inputs
            _assert_rejected_without_trace(
                layer, history, spec, inputs, lambda: layer.call(spec, (q, kv_c, k_pe.to(dtype))),
                r"^mla_attention_with_output: k_pe dtype .* != kv_c_normed dtype",
            )
    finally:
        runtime.unregister_layer("test_validation.kpe")


def test_nvfp4_output_needs_a_quantizable_query_dtype(layer):
    history, spec, inputs = _setup(layer, "prefill")
    bad = tuple(x.double() for x in inputs)
    _assert_rejected_without_trace(
        layer, history, spec, inputs, lambda: layer.call(spec, bad),
        rf"^{layer.op_name}: NVFP4 output needs q of float16, bfloat16 or float32 .* got torch.float64",
    )


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize(
    "arg, mutation",
    [(arg, m) for arg, table in NVFP4_MUTATIONS.items() for m in table],
)
def test_bad_nvfp4_buffers_are_rejected_before_anything(layer, scenario, arg, mutation):
    history, spec, inputs = _setup(layer, scenario)
    output, block_scale = layer.nvfp4_buffers(spec.num_tokens)
    bad_output, bad_scale, bad_gs = NVFP4_MUTATIONS[arg][mutation](output, block_scale, GS)
    match = rf"^{layer.op_name}: .*\b{arg}\b"
    if arg == "output":
        match = rf"^{layer.op_name}: NVFP4 output must be a contiguous uint8 tensor"
    _assert_rejected_without_trace(
        layer, history, spec, inputs, lambda: layer.call(spec, inputs, bad_gs, bad_output, bad_scale), match
    )
    assert bool((output == 0xAB).all()) and bool((block_scale.view(torch.uint8) == 0xFF).all())


@pytest.mark.parametrize(
    "mutation",
    ["wrong dtype", "one row fewer", "one element short", "not viewable as [T, H, Dv]", "block scale without scale"],
)
def test_bad_query_dtype_output_is_rejected_before_anything(layer, mutation):
    history, spec, inputs = _setup(layer, "mixed")
    t = spec.num_tokens
    output = torch.full((t, layer.width), 7.0, dtype=torch.bfloat16)
    kwargs = {}
    if mutation == "wrong dtype":
        bad = output.float()
    elif mutation == "one row fewer":
        bad = output[:-1]
    elif mutation == "one element short":
        bad = output.reshape(-1)[:-1]
    elif mutation == "not viewable as [T, H, Dv]":
        bad = torch.full((2, t, layer.width // 2), 7.0, dtype=torch.bfloat16).permute(1, 2, 0)
    else:
        bad = output
        kwargs = {"output_block_scale": layer.nvfp4_buffers(t)[1]}

    def call():
        with runtime.batch(spec):
            layer.op(*inputs, bad, layer.name, **kwargs)

    match = (rf"^{layer.op_name}: output_block_scale was given without output_scale" if kwargs
             else rf"^{layer.op_name}: output must be torch.bfloat16 with {t * layer.width} elements")
    _assert_rejected_without_trace(layer, history, spec, inputs, call, match, plain=True)
    assert bool((output == 7.0).all())


@pytest.mark.parametrize("context_len", [3, 6, 8, 20])
def test_batch_disagreeing_with_the_cache_is_rejected_before_anything(layer, context_len):
    history, spec, inputs = _setup(layer, "chunked")  # r0 holds 7 tokens
    bad_spec = runtime.BatchSpec.from_lens([5], [context_len])
    match = rf"^{layer.op_name}: request r0: batch says context_len={context_len} but the cache holds 7 tokens"
    _assert_rejected_without_trace(layer, history, spec, inputs, lambda: layer.call(bad_spec, inputs), match)


def test_other_valid_buffer_layouts_give_the_same_bytes(layer):
    """The NVFP4 buffers may come as [T, H, Dv/2] uint8 and fp8 / uint8 [rows, cols] scales."""
    for scenario in ("prefill", "mixed"):
        history, spec, inputs = _setup(layer, scenario)
        t = spec.num_tokens
        rows, cols = nvfp4.scale_shape(t, layer.width)
        reference = layer.fresh(history, spec, inputs)
        for scale_dtype in (torch.float8_e4m3fn, torch.uint8):
            layer.impl.clear_cache()  # rebuild the caches
            for s, i in history:
                layer.call(s, i)
            output = torch.full((t, layer.impl.num_heads, layer.impl.v_head_dim // 2), 0xAB, dtype=torch.uint8)
            block_scale = torch.full((rows, cols), 0xFF, dtype=torch.uint8).view(scale_dtype)
            got = layer.call(spec, inputs, GS, output, block_scale)
            assert torch.equal(got[0].view(t, -1), reference[0])
            assert torch.equal(got[1].view(rows, cols), reference[1].view(rows, cols))


def test_a_failure_part_way_rolls_the_cache_back_and_is_not_counted(layer, monkeypatch):
    """Past validation, a backend or the fallback failing after the cache grew leaves nothing behind."""
    def boom(*args, **kwargs):
        raise RuntimeError("injected failure")

    reference = "fusion_pass.runtime.backends.reference.ReferenceBackend"
    mixed = f"{reference}.run_paged" if layer.kind == "gqa" else "fusion_pass.runtime.row_plan.post_quantize_rows"
    for scenario, target in (("prefill", f"{reference}.run_varlen"),
                             ("mixed", mixed),  # the standard layer's one call over its pages, MLA's split
                             ("decode", "fusion_pass.runtime.row_plan.NVFP4Rows.everything")):
        history, spec, inputs = _setup(layer, scenario)
        before, cache = counters.counters(), _cache_state(layer.impl)
        with monkeypatch.context() as m:
            m.setattr(target, boom)
            with pytest.raises(RuntimeError, match="injected failure"):
                layer.call(spec, inputs)
            # the attention did run and grow the cache before the failure
            assert _cache_state(layer.impl) == cache and counters.counters() == before
        retry = layer.call(spec, inputs)
        assert counters.counters()["fused"] == (0 if scenario == "decode" else 1)
        fresh = layer.fresh(history, spec, inputs)
        assert torch.equal(retry[0], fresh[0]) and torch.equal(retry[1], fresh[1])


def test_check_inputs_is_side_effect_free_and_forward_still_works(layer):
    spec = runtime.BatchSpec.from_lens([4, 2])
    inputs = layer.inputs(6, seed=4)
    layer.impl.clear_cache()
    assert layer.impl.check_inputs(*inputs, spec) is None
    assert layer.impl.cache_len("r0") == 0 and layer.impl.cache_len("r1") == 0
    out = layer.impl.forward(*inputs, spec)
    assert out.shape == (6, layer.impl.num_heads, layer.impl.v_head_dim)
    assert layer.impl.cache_len("r0") == 4 and layer.impl.cache_len("r1") == 2
    with pytest.raises(ValueError, match="batch says context_len=4 but the cache holds 0 tokens"):
        layer.impl.check_inputs(*layer.inputs(1), runtime.BatchSpec.from_lens([1], [4], ["r9"]))
    # the fused backends' input preparation still validates first and extends the cache once
    layer.impl.clear_cache()
    with pytest.raises(ValueError, match=rf"{layer.arg_names[0]} must have shape"):
        layer.impl.prefill_qkv(inputs[0][:-1], *inputs[1:], spec)
    assert layer.impl.cache_len("r0") == 0
    layer.impl.prefill_qkv(*inputs, spec)
    assert layer.impl.cache_len("r0") == 4 and layer.impl.cache_len("r1") == 2


# ---------------------------------------------------------------- scaled_fp4_quant.out


QUANT_X_SHAPE = (5, 48)  # M = 5, K = 48: 3 block columns, swizzled [128, 4] (int32 [128, 1])


def _quant_buffers(swizzled=True):
    m, k = QUANT_X_SHAPE
    output = torch.full((m, k // 2), 0xAB, dtype=torch.uint8)
    if swizzled:
        scale = torch.zeros(128, 1, dtype=torch.int32)
    else:
        scale = torch.zeros(m, k // 16, dtype=torch.uint8)
    scale.view(torch.uint8).fill_(0xFF)
    return output, scale


def _quant_x():
    return torch.randn(*QUANT_X_SHAPE, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


def _t(rows, cols, dtype):
    return torch.zeros(rows, cols, dtype=dtype)


QUANT_BAD = {
    "input": [
        (lambda x: x.to(torch.float64), r"input must be float16, bfloat16 or float32, got torch.float64"),
        (lambda x: x.to(torch.int32), r"input must be float16, bfloat16 or float32, got torch.int32"),
        (lambda x: x.to(torch.int8), r"input must be float16, bfloat16 or float32"),
        (lambda x: x[:, :40], r"input must be \[\.\.\., K\] with K divisible by 16, got shape \[5, 40\]"),
        (lambda x: x[:, :8], r"input must be \[\.\.\., K\] with K divisible by 16"),
        (lambda x: x[0, 0], r"input must be \[\.\.\., K\] with K divisible by 16, got shape \[\]"),
    ],
    "input_scale": [
        (lambda g: g.double(), r"input_scale \(the global scale\) must be a one-element float32 tensor, "
                               r"got torch.float64 \[1\]"),
        (lambda g: g.half(), r"input_scale .* got torch.float16"),
        (lambda g: torch.tensor([40.0, 1.0]), r"input_scale .* got torch.float32 \[2\]"),
        (lambda g: torch.empty(0), r"input_scale .* got torch.float32 \[0\]"),
        (lambda g: torch.tensor([40]), r"input_scale .* got torch.int64"),
        (lambda g: torch.tensor([0.0]), r"input_scale \(the global scale\) must be positive and finite, got 0\.0$"),
        (lambda g: torch.tensor([-2.0]), r"input_scale \(the global scale\) must be positive and finite, got -2\.0$"),
        (lambda g: torch.tensor([float("inf")]), r"input_scale .* positive and finite, got inf$"),
        (lambda g: torch.tensor([float("nan")]), r"input_scale .* positive and finite, got nan$"),
    ],
    "output": [
        (lambda o: o.view(torch.int8), r"output must be uint8 \[M, K/2\] = \[5, 24\] for input \[5, 48\]"),
        (lambda o: _t(5, 24, torch.float32), r"output must be uint8 \[M, K/2\] = \[5, 24\]"),
        (lambda o: o.reshape(-1), r"output must be uint8 \[M, K/2\] = \[5, 24\] .* got torch.uint8 \[120\]$"),
        (lambda o: o.reshape(1, 5, 24), r"output must be uint8 \[M, K/2\].* got torch.uint8 \[1, 5, 24\]"),
        (lambda o: o.reshape(10, 12), r"output must be uint8 \[M, K/2\].* got torch.uint8 \[10, 12\]"),
        (lambda o: _t(5, 25, torch.uint8), r"output must be uint8 \[M, K/2\].* got torch.uint8 \[5, 25\]"),
        (lambda o: _t(6, 24, torch.uint8), r"output must be uint8 \[M, K/2\].* got torch.uint8 \[6, 24\]"),
        (lambda o: _t(24, 5, torch.uint8).t(), r"output must be uint8 .* \(not contiguous\)"),
    ],
    "output_scale": [
        (lambda s: _t(128, 4, torch.float32), r"output_scale must hold 128x4 one-byte scales: int32 \[128, 1\] "
                                               r"\(as vLLM allocates it\) or uint8 / float8_e4m3fn \[128, 4\]"),
        (lambda s: _t(128, 4, torch.int32), r"output_scale must hold 128x4 .* got torch.int32 \[128, 4\]"),
        (lambda s: _t(128, 1, torch.uint8), r"output_scale must hold 128x4 .* got torch.uint8 \[128, 1\]"),
        (lambda s: _t(128, 2, torch.int16), r"output_scale must hold 128x4 .* got torch.int16 \[128, 2\]"),
        (lambda s: _t(64, 4, torch.uint8), r"output_scale must hold 128x4 .* got torch.uint8 \[64, 4\]"),
        (lambda s: _t(256, 4, torch.uint8), r"output_scale must hold 128x4 .* got torch.uint8 \[256, 4\]"),
        (lambda s: s.view(torch.uint8).reshape(-1), r"output_scale must hold 128x4 .* got torch.uint8 \[512\]"),
        (lambda s: s.reshape(1, 128), r"output_scale must hold 128x4 .* got torch.int32 \[1, 128\]"),
        (lambda s: _t(5, 3, torch.uint8), r"output_scale must hold 128x4 .* got torch.uint8 \[5, 3\]"),
        (lambda s: _t(4, 128, torch.uint8).t(), r"output_scale must hold 128x4 .* \(not contiguous"),
        (lambda s: _t(1, 128, torch.int32).t(), r"output_scale must hold 128x4 .* got torch.int32 \[128, 1\] "
                                                 r"\(not contiguous: strides \[1, 128\]\)"),
    ],
}


@pytest.mark.parametrize(
    "arg, index", [(arg, i) for arg, cases in QUANT_BAD.items() for i in range(len(cases))]
)
def test_quant_out_rejects_every_bad_argument_before_writing(arg, index):
    mutate, message = QUANT_BAD[arg][index]
    x, gs = _quant_x(), GS.clone()
    output, scale = _quant_buffers()
    args = {"input": x, "input_scale": gs, "output": output, "output_scale": scale}
    args[arg] = mutate(args[arg])
    with pytest.raises(ValueError, match=r"^scaled_fp4_quant: " + message):
        OPS.scaled_fp4_quant.out(args["input"], args["input_scale"], True,
                                 output=args["output"], output_scale=args["output_scale"])
    # nothing written to any buffer (a bad buffer of another size is a fresh tensor, also untouched)
    assert bool((output == 0xAB).all()) and bool((scale.view(torch.uint8) == 0xFF).all())


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda: torch.zeros(128, 1, dtype=torch.int32), r"linear layout, \[M, K/16\] for M=5, K=48"),
        (lambda: torch.zeros(128, 4, dtype=torch.uint8), r"uint8 / float8_e4m3fn \[5, 3\] .* got torch.uint8 \[128, 4\]"),
        (lambda: torch.zeros(5, 4, dtype=torch.uint8), r"got torch.uint8 \[5, 4\]"),
        (lambda: torch.zeros(15, dtype=torch.uint8), r"got torch.uint8 \[15\]"),
        (lambda: torch.zeros(5, 3, dtype=torch.float32), r"got torch.float32 \[5, 3\]"),
        (lambda: torch.zeros(3, 5, dtype=torch.uint8).t(), r"\(not contiguous"),
    ],
)
def test_quant_out_linear_layout_scale_buffer(bad, message):
    x = _quant_x()
    output, _ = _quant_buffers(swizzled=False)
    with pytest.raises(ValueError, match=r"^scaled_fp4_quant: output_scale must hold 5x3 one-byte scales: .*" + message):
        OPS.scaled_fp4_quant.out(x, GS, False, output=output, output_scale=bad())
    assert bool((output == 0xAB).all())


@pytest.mark.parametrize("swizzled", [True, False])
def test_quant_out_accepts_every_documented_buffer_form(swizzled):
    x = _quant_x().reshape(5, 1, 48)  # leading dims flatten into M
    packed, scales = nvfp4.quantize(x, GS, swizzled=swizzled)
    rows, cols = scales.shape
    forms = [torch.uint8, torch.float8_e4m3fn] + ([torch.int32] if swizzled else [])
    for dtype in forms:
        output = torch.full((5, 24), 0xAB, dtype=torch.uint8)
        shape = (rows, cols // 4) if dtype == torch.int32 else (rows, cols)
        scale = torch.zeros(shape, dtype=torch.uint8 if dtype != torch.int32 else torch.int32)
        scale.view(torch.uint8).fill_(0xFF)
        scale = scale.view(dtype) if dtype == torch.float8_e4m3fn else scale
        OPS.scaled_fp4_quant.out(x, GS, swizzled, output=output, output_scale=scale)
        assert torch.equal(output, packed)
        assert torch.equal(scale.view(torch.uint8).view(rows, cols), scales.view(torch.uint8))


# ---------------------------------------------------------------- dequantize


def _dequant_args(k=32):
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(1))
    packed, scales = nvfp4.quantize(x, GS)
    return packed, scales


@pytest.mark.parametrize("m", [True, False, 2.5, 3.0, "3", torch.tensor(3), [3]], ids=repr)
def test_dequantize_rejects_non_int_m(m):
    packed, scales = _dequant_args()
    with pytest.raises(TypeError, match=r"^dequantize: m must be an int \(the number of rows to decode\) or None, got "):
        nvfp4.dequantize(packed, scales, GS, m=m)


def test_dequantize_accepts_ints_of_any_integer_kind():
    packed, scales = _dequant_args()
    full = nvfp4.dequantize(packed, scales, GS)
    for m in (3, np.int64(3), np.int32(3)):
        assert torch.equal(nvfp4.dequantize(packed, scales, GS, m=m), full[:3])
    assert nvfp4.dequantize(packed, scales, GS, m=0).shape == (0, 32)


@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, "float32", float, None], ids=str
)
def test_dequantize_rejects_a_non_floating_dtype(dtype):
    packed, scales = _dequant_args()
    with pytest.raises(TypeError, match=r"^dequantize: dtype must be a floating-point torch.dtype .* got "):
        nvfp4.dequantize(packed, scales, GS, dtype=dtype)


def test_dequantize_floating_dtypes_still_work():
    packed, scales = _dequant_args()
    full = nvfp4.dequantize(packed, scales, GS)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        got = nvfp4.dequantize(packed, scales, GS, dtype=dtype)
        assert got.dtype == dtype and torch.equal(got, full.to(dtype))


def test_dequantize_rejects_a_strided_int32_scale_buffer():
    for k in (32, 128):  # int32 [128, 1] and [128, 2]
        packed, scales = _dequant_args(k)
        as_int32 = scales.view(torch.int32)
        strided = torch.zeros(as_int32.shape[1], 128, dtype=torch.int32).t()
        strided.copy_(as_int32)
        with pytest.raises(ValueError, match=r"^dequantize: int32-allocated scales must be 2-D with a unit stride"):
            nvfp4.dequantize(packed, strided, GS)
        assert torch.equal(nvfp4.dequantize(packed, as_int32, GS), nvfp4.dequantize(packed, scales, GS))


# ---------------------------------------------------------------- use_backend is per thread


def _run_threads(targets, timeout=60):
    errors = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # reported on the main thread
                errors.append(exc)
        return run

    threads = [threading.Thread(target=wrap(fn)) for fn in targets]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    if errors:
        raise errors[0]


def test_use_backend_is_scoped_to_the_thread_that_entered_it():
    """Three threads overlap: two inside their own use_backend block, one with the process default."""
    settings.set_backend("triton")  # the process-wide default (unavailable here: falls back)
    barrier = threading.Barrier(3, timeout=30)
    spec = runtime.BatchSpec.from_lens([9, 4])
    layers = {who: _make_layer("mla", f"test_validation.thread.{who}") for who in ("a", "b", "c")}
    inputs = layers["a"].inputs(spec.num_tokens, seed=7)
    seen = {who: [] for who in layers}
    results = {}

    def observe(who):
        decision = guard.decide(guard.BatchRows.from_spec(spec), guard.LayerShape("cpu", torch.bfloat16, 2, 24, 16))
        seen[who].append((settings.configured_backend(), decision.path, decision.backend,
                          (decision.detail or "").split(":")[0]))

    def thread_a():
        with settings.use_backend("reference"):
            barrier.wait()  # 1: every thread is inside its block (or has none)
            observe("a")
            results["a"] = layers["a"].call(spec, inputs)
            barrier.wait()  # 2: all three ran the op while the blocks overlapped
        barrier.wait()  # 3: a has left its block
        observe("a")
        barrier.wait()  # 4

    def thread_b():
        with settings.use_backend("fa4"):
            barrier.wait()  # 1
            observe("b")
            results["b"] = layers["b"].call(spec, inputs)
            barrier.wait()  # 2
            barrier.wait()  # 3: a has left its block, b has not
            observe("b")
            barrier.wait()  # 4

    def thread_c():
        barrier.wait()  # 1
        observe("c")
        results["c"] = layers["c"].call(spec, inputs)
        barrier.wait()  # 2
        barrier.wait()  # 3
        observe("c")
        barrier.wait()  # 4

    try:
        _run_threads([thread_a, thread_b, thread_c])
        assert seen["a"] == [("reference", "fused", "reference", "PyTorch float32 attention + nvfp4.quantize, any device"),
                             ("triton", "fallback", None, "triton")]
        assert seen["b"] == [("fa4", "fallback", None, "fa4")] * 2
        assert seen["c"] == [("triton", "fallback", None, "triton")] * 2
        counts = counters.counters()
        assert (counts["fused"], counts["fused_by_backend"], counts["fallback"]) == (1, {"reference": 1},
                                                                                     {"no_backend": 2})
        # the bytes each thread got are those of its own choice
        with settings.use_backend("reference"):
            fused = layers["a"].fresh([], spec, inputs)
        fallback = layers["b"].fresh([], spec, inputs)
        assert torch.equal(results["a"][0], fused[0]) and torch.equal(results["a"][1], fused[1])
        for who in ("b", "c"):
            assert torch.equal(results[who][0], fallback[0]) and torch.equal(results[who][1], fallback[1])
        assert not torch.equal(fused[0], fallback[0])
        assert settings.configured_backend() == "triton"  # the main thread never saw a block
    finally:
        for layer in layers.values():
            runtime.unregister_layer(layer.name)


def test_a_thread_started_inside_a_block_does_not_inherit_it():
    got = []
    with settings.use_backend("reference"):
        _run_threads([lambda: got.append(settings.configured_backend())])
        assert settings.configured_backend() == "reference"
    assert got == ["auto"]


def test_precedence_use_backend_over_set_backend_over_environment(monkeypatch):
    monkeypatch.setenv(settings.BACKEND_ENV, "fa4")
    assert settings.configured_backend() == "fa4"
    settings.set_backend("triton")
    assert settings.configured_backend() == "triton"
    with settings.use_backend("reference"):
        assert settings.configured_backend() == "reference"
        settings.set_backend("auto")  # changes the default, not this block's choice
        assert settings.configured_backend() == "reference"
        with settings.use_backend(None):  # the environment decides inside
            assert settings.configured_backend() == "fa4"
        assert settings.configured_backend() == "reference"
    assert settings.configured_backend() == "auto"
    with pytest.raises(ValueError, match=r"use_backend\(name\)='cudnn' .* auto, fa4, triton, reference"):
        with settings.use_backend("cudnn"):
            pass
    assert settings.configured_backend() == "auto"


# ---------------------------------------------------------------- tap_gemm_inputs is per thread


def _gemm_operands(rows, seed):
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return nvfp4.quantize(x, GS)


def test_taps_record_only_their_own_threads_gemm_calls():
    w, sw = _gemm_operands(16, 0)
    alpha = torch.tensor([1.0 / (40.0 * 40.0)])
    operands = {who: _gemm_operands(rows, seed) for who, rows, seed in (("a", 3, 1), ("b", 5, 2), ("c", 7, 3))}
    barrier = threading.Barrier(3, timeout=30)
    taps = {}

    def gemm(who):
        a, sa = operands[who]
        OPS.nvfp4_gemm(a, w, sa, sw, alpha, torch.float32)

    def thread_a():
        with ops.tap_gemm_inputs() as tap:
            taps["a"] = tap
            barrier.wait()  # 1: a's and b's taps are open
            gemm("a")
            barrier.wait()  # 2
            barrier.wait()  # 3: b and c have run theirs

    def thread_b():
        with ops.tap_gemm_inputs() as tap:
            taps["b"] = tap
            barrier.wait()  # 1
            barrier.wait()  # 2: a has run its gemm
            gemm("b")
            gemm("b")
            barrier.wait()  # 3

    def thread_c():  # no tap: its calls go nowhere
        barrier.wait()  # 1
        barrier.wait()  # 2
        gemm("c")
        barrier.wait()  # 3

    _run_threads([thread_a, thread_b, thread_c])
    assert len(taps["a"]) == 1 and len(taps["b"]) == 2
    a, sa = operands["a"]
    assert torch.equal(taps["a"][0][0], a) and torch.equal(taps["a"][0][1].view(torch.uint8), sa.view(torch.uint8))
    b, sb = operands["b"]
    assert all(torch.equal(rec[0], b) and torch.equal(rec[1].view(torch.uint8), sb.view(torch.uint8))
               for rec in taps["b"])


def test_nested_taps_record_into_the_innermost_and_restore():
    w, sw = _gemm_operands(16, 0)
    alpha = torch.tensor([1.0 / (40.0 * 40.0)])
    a1, s1 = _gemm_operands(3, 1)
    a2, s2 = _gemm_operands(4, 2)
    with ops.tap_gemm_inputs() as outer:
        OPS.nvfp4_gemm(a1, w, s1, sw, alpha, torch.float32)
        with ops.tap_gemm_inputs() as inner:
            OPS.nvfp4_gemm(a2, w, s2, sw, alpha, torch.float32)
        OPS.nvfp4_gemm(a1, w, s1, sw, alpha, torch.float32)
    OPS.nvfp4_gemm(a2, w, s2, sw, alpha, torch.float32)  # no tap open: not recorded anywhere
    assert [rec[0].shape[0] for rec in outer] == [3, 3]
    assert [rec[0].shape[0] for rec in inner] == [4]
