"""The attention ops' static per-tensor FP8 output at run time (docs/formats.md, docs/design.md), through the real ops.

``torch.ops.fusion_pass.attention_with_output`` / ``mla_attention_with_output`` handed ``output`` float8_e4m3fn
``[T, H*Dv]`` and ``output_scale`` (the checkpoint's scale), on generated serving schedules (decode-only,
prefill-only, mixed, prefills with cached context on both sides of the context workspace bound), bf16 and fp16,
MLA and standard layers, the ``reference`` backend and the Triton kernels (Triton's interpreter on the CPU).

Every byte of every row is checked:

* fused rows (prefills the guard fuses) are :func:`fusion_pass.fp8.quantize_static` of the backend's own float32
  attention of the inputs its kernel was handed (recorded), and within the format's error bound of the layer's
  float32 attention (an independent check of which keys the row plan gave the kernel);
* every other row is ``quantize_static`` of the query-dtype attention (the unfused graph's bytes);
* the counters say which rows were fused, in which format, and why the others were not.
"""

from __future__ import annotations

import random

import pytest
import torch

import fusion_pass  # noqa: F401  (registers the ops)
from fusion_pass import fp8, formats, kernels, runtime
from fusion_pass.kernels import reference
from fusion_pass.runtime import backends, counters, fp8_rows, guard, settings
from layer_cases import CPU, MLA_DIMS, OPS

FP8 = torch.float8_e4m3fn
POISON = 0x55


@pytest.fixture(autouse=True)
def _clean_state(clean_backend_state):
    yield


def _layers(kind: str, dtype: torch.dtype):
    """``(impl registered and driven through its op, its twin, op, make_inputs)``: the twin is an identical layer
    with its own cache, whose float32 ``forward`` is the oracle of the layer's attention."""
    gen = torch.Generator().manual_seed(7)
    if kind == "mla":
        d = MLA_DIMS
        h, nope, rope, v, lora = (d["num_heads"], d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"],
                                  d["kv_lora_rank"])
        weight = torch.randn(h * (nope + v), lora, generator=gen) * lora ** -0.5
        impls = [runtime.MLAAttentionImpl(**d, kv_b_proj_weight=weight, softmax_scale=(nope + rope) ** -0.5)
                 for _ in range(2)]

        def make(t, g):
            return (torch.randn(t, h, nope + rope, generator=g).to(dtype), torch.randn(t, lora, generator=g).to(dtype),
                    torch.randn(t, 1, rope, generator=g).to(dtype))

        return impls[0], impls[1], OPS.mla_attention_with_output, make
    dims = dict(num_heads=4, num_kv_heads=2, head_dim=16, v_head_dim=16)
    impls = [runtime.AttentionImpl(**dims, softmax_scale=0.25) for _ in range(2)]

    def make(t, g):
        return (torch.randn(t, 4, 16, generator=g).to(dtype), torch.randn(t, 2, 16, generator=g).to(dtype),
                torch.randn(t, 2, 16, generator=g).to(dtype))

    return impls[0], impls[1], OPS.attention_with_output, make


def _schedule(rng: random.Random, steps: int):
    """``(query_lens, context_lens, ids)`` per step, decodes first: a prefill-only step, a decode-only one, a mixed
    one, prefills with cached context beside new prompts, decodes beside chunks, then random steps."""
    cached: dict[str, int] = {}
    fresh = iter(f"n{i}" for i in range(1000))
    kinds = ["prefill", "decode", "mixed", "chunked", "decodes+chunked"]
    plans = []
    for step in range(steps):
        kind = kinds[step] if step < len(kinds) else rng.choice(kinds)
        running = list(cached)
        rng.shuffle(running)
        n_dec = {"prefill": 0, "chunked": 0}.get(kind, rng.randint(1, max(1, len(running) - 1)))
        decodes, rest = running[:n_dec], running[n_dec:]
        chunks = rest[:rng.randint(1, 2)] if kind in ("chunked", "decodes+chunked") else []
        news = [] if kind == "decode" else [next(fresh) for _ in range(rng.randint(1 if kind != "decodes+chunked"
                                                                                   else 0, 2))]
        reqs = [(i, 1, cached[i]) for i in decodes] + [(i, rng.randint(2, 6), cached[i]) for i in chunks] \
            + [(i, rng.randint(2, 9), 0) for i in news]
        for i, q, c in reqs:
            cached[i] = c + q
        plans.append(([q for _, q, _ in reqs], [c for _, _, c in reqs], [i for i, _, _ in reqs]))
    return plans


class _Spy:
    """Wraps a backend's ``run_varlen_fp8_static`` and records the inputs of every launch."""

    def __init__(self, backend):
        self.backend, self.inner, self.calls = backend, backend.run_varlen_fp8_static, []

    def __call__(self, q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, scale, **kw):
        self.calls.append((q.clone(), k.clone(), v.clone(), cu_seqlens.clone(), max_seqlen, softmax_scale,
                           kw.get("cu_seqlens_k"), kw.get("max_seqlen_k")))
        self.inner(q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, scale, **kw)

    def own_attention(self, kernel: str) -> tuple[torch.Tensor, slice]:
        """The float32 attention ``[rows, H*Dv]`` the last launch's kernel computes, and its rows."""
        q, k, v, cu, max_q, sm, cu_k, max_k = self.calls[-1]
        a, b = int(cu[0]), int(cu[-1])
        if kernel == "triton":
            from fusion_pass.kernels.triton import flash_attention as fa

            out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"))
            fa.flash_attention(q, k, v, cu, max_q, out=out, causal=True, softmax_scale=sm, cu_seqlens_k=cu_k,
                               max_seqlen_k=max_k)
            return out[a:b].reshape(b - a, -1), slice(a, b)
        kk, vv = (k, v) if cu_k is not None else (k[a:b], v[a:b])
        out = reference.varlen_attention(q[a:b], kk, vv, cu - a, True, sm, cu_k)[0]
        return out.reshape(b - a, -1), slice(a, b)


def _expected_fused(query_lens, context_lens, bound):
    """Per request, whether the guard fuses it for FP8 static: every prefill (with context beyond the bound through
    the merge); and whether the call merges (the prefills' context beyond the bound)."""
    total = sum(c for q, c in zip(query_lens, context_lens) if q > 1 and c)
    return [q > 1 for q in query_lens], total > bound


def _run_schedule(monkeypatch, kind, dtype, kernel, bound, steps, seed, form="op"):
    impl, twin, op, make = _layers(kind, dtype)
    name = f"test_fp8_static_call.{kind}"
    runtime.register_layer(name, impl)
    backend = backends.get_backend(kernel) if kernel == "reference" else backends.TritonBackend()
    if kernel == "triton":  # Triton's kernels on the CPU (interpreter): the backend picked by hand
        monkeypatch.setattr(backends, "select_backend", lambda *a, **k: (backend, "triton (interpreter)"))
        monkeypatch.setattr(backends, "get_backend", lambda n: backend)
    spy = _Spy(backend)
    monkeypatch.setattr(backend, "run_varlen_fp8_static", spy)
    merges, merge = [], fp8_rows.FP8StaticRows.merge

    def recorded_merge(self, backend_, out_a, lse_a, out_b, lse_b, first_row):
        merges.append((out_a, lse_a, out_b, lse_b, first_row))
        merge(self, backend_, out_a, lse_a, out_b, lse_b, first_row)

    monkeypatch.setattr(fp8_rows.FP8StaticRows, "merge", recorded_merge)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    scale = torch.tensor([rng.choice([0.002, 0.0011, 0.01])])
    inv = fp8.reciprocal(scale)
    nan = fp8.NaNRule.POSITIVE_MAX
    if form == "native":  # the graph's reciprocal, one unit off the IEEE quotient: a writer computing its own fails
        inv, nan = torch.nextafter(inv, torch.tensor([float("inf")])), fp8.NaNRule.NAN
    fused_steps = 0
    try:
        with settings.use_context_workspace_tokens(bound):
            for step, (query_lens, context_lens, ids) in enumerate(_schedule(rng, steps)):
                where = f"seed {seed}, step {step}, lens {query_lens}, context {context_lens}, bound {bound}"
                spec = runtime.BatchSpec.from_lens(query_lens, context_lens, ids)
                inputs = make(spec.num_tokens, gen)
                t, width = spec.num_tokens, impl.num_heads * impl.v_head_dim
                attn32 = twin.forward(*inputs, spec).reshape(t, width)
                output = torch.full((t, width), POISON, dtype=torch.uint8).view(FP8)
                before = counters.counters(output_format="fp8_static")
                calls = len(spy.calls)
                with runtime.batch(spec):
                    if form == "native":
                        op(*inputs, output, name, output_inv_scale=inv)
                    else:
                        op(*inputs, output, name, scale)
                got = output.view(torch.uint8)
                fused, merged = _expected_fused(query_lens, context_lens, bound)
                rows = [f for f, q in zip(fused, query_lens) for _ in range(q)]
                want = fp8.quantize_static(attn32.to(dtype), inv, nan=nan).view(torch.uint8)
                if any(fused):
                    fused_steps += 1
                    mask = torch.tensor(rows)
                    if merged:  # the prefills' rows from the float32 merge of the partial attentions
                        assert len(spy.calls) == calls and len(merges) == 1, f"one merge, no varlen launch ({where})"
                        out_a, lse_a, out_b, lse_b, first = merges.pop()
                        own = reference.merge_attention(out_a, lse_a, out_b, lse_b)[0].reshape(out_a.shape[0], -1)
                        span = slice(first, first + own.shape[0])
                        assert span == slice(spec.num_decode_tokens, t), where
                    else:
                        assert len(spy.calls) == calls + 1 and not merges, f"one fused launch per call ({where})"
                        own, span = spy.own_attention(kernel)  # over every prefill row: the unfused ones rewritten
                    own_bytes = fp8.quantize_static(own, inv, nan=nan).view(torch.uint8)
                    want[span][mask[span]] = own_bytes[mask[span]]
                    bound32 = fp8.static_error_bound(attn32, scale) + (
                        2 ** -12 * attn32.abs() if kernel == "reference" else 0.03 * attn32.abs().amax())
                    err = (fp8.dequantize_static(got.view(FP8), scale) - attn32).abs()
                    assert bool((err[mask] <= bound32[mask]).all()), f"fused rows off the float32 attention ({where})"
                else:
                    assert len(spy.calls) == calls, f"no fused launch ({where})"
                unfused_rows = [r for r, f in enumerate(rows) if not f]
                fused_rows = [r for r, f in enumerate(rows) if f]
                # fused rows: the kernel's own attention; the rest: the query-dtype attention (the unfused graph)
                assert torch.equal(got, want), f"rows {[r for r in range(t) if not torch.equal(got[r], want[r])]} " \
                                               f"differ (fused {fused_rows}, unfused {unfused_rows}; {where})"
                after = counters.counters(output_format="fp8_static")
                d = spec.num_decode_tokens
                n_fused = len(fused_rows)
                ctx_rows = t - d - n_fused
                assert after["tokens"]["prefill_fused"] - before["tokens"]["prefill_fused"] == n_fused, where
                post = {r: after["tokens"]["post_quantized"].get(r, 0) - before["tokens"]["post_quantized"].get(r, 0)
                        for r in ("decode_tokens", "chunked_prefill")}
                if n_fused:
                    assert after["fused"] - before["fused"] == 1, where
                    assert post == {"decode_tokens": d, "chunked_prefill": ctx_rows}, where
                else:
                    reason = "decode_tokens" if t == d else "chunked_prefill"
                    assert after["fallback"].get(reason, 0) - before["fallback"].get(reason, 0) == 1, where
                    assert post[reason] == t, where
    finally:
        runtime.unregister_layer(name)
    totals = counters.counters()
    assert all(key.endswith(" (fp8_static)") for key in (*totals["fused_by_backend"], *totals["fallback"]))
    assert counters.counters(output_format="nvfp4")["fused"] == 0
    return fused_steps


@pytest.mark.parametrize("kind", ["mla", "gqa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bound", [1 << 16, 4])
def test_reference_backend_writes_every_row_of_generated_schedules(monkeypatch, kind, dtype, bound):
    """Bound 65536: prefills with context fused through the workspace; 4: their context exceeds it, so their rows are
    the float32 merge of the context's chunks and the new tokens' attention, quantized (every prefill fused)."""
    seed = random.randrange(1 << 30)
    assert _run_schedule(monkeypatch, kind, dtype, "reference", bound, steps=8, seed=seed) > 0, f"seed {seed}"


@pytest.mark.parametrize("kind", ["mla", "gqa"])
@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_the_native_form_multiplies_by_the_given_inverse_in_every_row(monkeypatch, kind, kernel):
    """``output_inv_scale`` (vLLM's QuantFP8 compiled from aten ops): fused and unfused rows multiply by the given
    inverse as it is (one unit off the IEEE reciprocal here) and keep the native form's NaN rule."""
    if kernel == "triton" and not (torch.cuda.is_available() or kernels.interpreter_enabled()):
        pytest.skip("no CUDA device and TRITON_INTERPRET is not set (conftest.py sets it on CPU-only machines)")
    if kernel == "triton" and torch.cuda.is_available():
        pytest.skip("the runtime's CPU layers (a CUDA run is tests/kernels')")
    seed = random.randrange(1 << 30)
    assert _run_schedule(monkeypatch, kind, torch.bfloat16, kernel, 1 << 16, steps=4, seed=seed, form="native") > 0, \
        f"seed {seed}"


@pytest.mark.skipif(not torch.cuda.is_available() and not kernels.interpreter_enabled(),
                    reason="no CUDA device and TRITON_INTERPRET is not set (conftest.py sets it on CPU-only machines)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the runtime's CPU layers (a CUDA run is tests/kernels')")
@pytest.mark.parametrize("kind", ["mla", "gqa"])
@pytest.mark.parametrize("bound", [1 << 16, 4])
def test_triton_kernels_write_every_row_of_generated_schedules(monkeypatch, kind, bound):
    seed = random.randrange(1 << 30)
    assert _run_schedule(monkeypatch, kind, torch.bfloat16, "triton", bound, steps=5, seed=seed) > 0, f"seed {seed}"


def _unfused_graph(op, name, inputs, spec, width, scale):
    """The unfused graph's bytes: the op with a query-dtype output, then vLLM's static_scaled_fp8_quant."""
    half = torch.empty(spec.num_tokens, width, dtype=inputs[0].dtype)
    with runtime.batch(spec):
        op(*inputs, half, name)
    result = torch.empty(spec.num_tokens, width, dtype=FP8)
    OPS.static_scaled_fp8_quant(result, half, scale)
    return result.view(torch.uint8)


@pytest.mark.parametrize("kind", ["mla", "gqa"])
def test_a_refused_call_is_byte_equal_to_the_unfused_graph(kind):
    """A call no backend writes FP8 static for (``triton`` pinned: no CUDA device here) and a decode-only call: every
    row is the unfused graph's, counted with the reason and the format."""
    impl, _, op, make = _layers(kind, torch.bfloat16)
    name = f"test_fp8_static_call.refused.{kind}"
    runtime.register_layer(name, impl)
    gen = torch.Generator().manual_seed(11)
    width = impl.num_heads * impl.v_head_dim
    scale = torch.tensor([0.003])
    steps = [runtime.BatchSpec.from_lens([7, 5]), runtime.BatchSpec.from_lens([1, 1], [7, 5])]
    inputs = [make(s.num_tokens, gen) for s in steps]
    try:
        got = []
        with settings.use_backend("triton"):
            for spec, x in zip(steps, inputs):
                output = torch.full((spec.num_tokens, width), POISON, dtype=torch.uint8).view(FP8)
                with runtime.batch(spec):
                    op(*x, output, name, scale)
                got.append(output.view(torch.uint8))
        impl.clear_cache()
        want = [_unfused_graph(op, name, x, spec, width, scale) for spec, x in zip(steps, inputs)]
    finally:
        runtime.unregister_layer(name)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert counters.counters() == {
        "fused": 0, "fused_by_backend": {}, "fallback": {"no_backend (fp8_static)": 1, "decode_tokens (fp8_static)": 1},
        "tokens": {"prefill": 12, "prefill_fused": 0, "decode_fused": 0,
                   "post_quantized": {"no_backend": 12, "decode_tokens": 2}}}


def test_nan_and_saturation_follow_vllms_rule_in_fused_and_unfused_rows():
    """A NaN in a prefill's value and in a decode row's query: +448 (0x7E) in every row that sees it, fused or not;
    elements beyond 448 x scale saturate to +-448 (0x7E / 0xFE); rows before the NaN key keep their bytes."""
    impl, twin, op, make = _layers("gqa", torch.bfloat16)
    name = "test_fp8_static_call.nan"
    runtime.register_layer(name, impl)
    gen = torch.Generator().manual_seed(5)
    width = impl.num_heads * impl.v_head_dim
    scale = torch.tensor([0.0009])  # |attention| up to ~1: beyond 448 * 0.0009 = 0.4 saturates
    first = runtime.BatchSpec.from_lens([6])
    spec = runtime.BatchSpec.from_lens([1, 8], [6, 0], ["r0", "n1"])
    x0, x1 = make(first.num_tokens, gen), make(spec.num_tokens, gen)
    x1[2][1 + 4, 0, 3] = float("nan")  # the new prompt's 5th value: its rows 4.. see it
    x1[0][0, 1, 2] = float("nan")  # the decode row's query, head 1
    outs = []
    try:
        for s, x in ((first, x0), (spec, x1)):
            out = torch.empty(s.num_tokens, width, dtype=FP8)
            with runtime.batch(s):
                op(*x, out, name, scale)
            outs.append(out.view(torch.uint8))
    finally:
        runtime.unregister_layer(name)
    twin.forward(*x0, first)
    attn = twin.forward(*x1, spec).reshape(spec.num_tokens, width)
    got = outs[1]
    inv = fp8.reciprocal(scale)
    assert torch.equal(got[0], fp8.quantize_static(attn[0].bfloat16(), inv).view(torch.uint8))
    assert torch.equal(got[1:], fp8.quantize_static(attn[1:], inv).view(torch.uint8))
    assert bool(attn[0, 16:32].isnan().all()) and bool((got[0, 16:32] == 0x7E).all()), "decode row's NaN head: +448"
    # value 4 of the prompt (kv head 0, element 3): query heads 0 and 1, rows 5.. of the call; rows 1-4 do not see it
    assert bool(attn[5:, [3, 19]].isnan().all()) and bool((got[5:, [3, 19]] == 0x7E).all())
    assert not bool(attn[1:5].isnan().any())
    finite = attn[1:].isfinite()
    assert bool((got[1:][finite & (attn[1:] >= 448 * 0.0009)] == 0x7E).all())
    assert bool((got[1:][finite & (attn[1:] <= -448 * 0.0009)] == 0xFE).all())
    assert bool((attn[1:][finite].abs() > 448 * 0.0009).any()), "the data saturates somewhere"
    assert counters.counters(output_format="fp8_static")["fused_by_backend"] == {"reference": 2}


def test_the_guard_refuses_a_backend_without_an_fp8_static_kernel_naming_the_format(monkeypatch):
    """A backend that writes NVFP4 only here (``fa4`` without an SM90 device: its FP8 kernel is SM90's) is refused
    for an FP8 call with a reason naming the format; ``auto`` passes over it to one that writes FP8."""
    fa4 = backends.get_backend("fa4")
    monkeypatch.setattr(fa4, "available", lambda: (True, "stand-in"))
    monkeypatch.setattr(fa4, "supports", lambda *a: (True, "ok"))
    monkeypatch.setattr(fa4, "fast_on", lambda device: (True, "stand-in"))
    rows, layer = guard.BatchRows(0, (5, 3), (0, 0)), guard.LayerShape(CPU, torch.bfloat16, 2, 24, 16)
    assert guard.decide(rows, layer).backend == "fa4"  # NVFP4: the stand-in is picked
    auto = guard.decide(rows, layer, output_format=formats.FP8_STATIC)
    assert (auto.path, auto.backend, auto.format) == ("fused", "reference", "fp8_static")
    with settings.use_backend("fa4"):
        refused = guard.decide(rows, layer, output_format=formats.FP8_STATIC)
    assert (refused.path, refused.reason, refused.format) == ("fallback", "no_backend", "fp8_static")
    assert "fa4 has no fp8_static kernel" in refused.detail, refused.detail


def decide_rows(query_lens, context_lens, bound):
    with settings.use_context_workspace_tokens(bound):
        return guard.decide(guard.BatchRows(0, tuple(query_lens), tuple(context_lens)),
                            guard.LayerShape(CPU, torch.bfloat16, 2, 24, 16), output_format=formats.FP8_STATIC)


def test_context_beyond_the_workspace_bound_is_fused_by_the_merge_and_refused_without_one(monkeypatch):
    within = decide_rows([3, 4, 2], [0, 5, 6], 11)
    assert (within.path, within.fused_tokens, within.post_quantized) == ("fused", 9, {})
    beyond = decide_rows([3, 4, 2], [0, 5, 6], 10)
    assert (beyond.path, beyond.fused_tokens, beyond.post_quantized) == ("fused", 9, {}), "merged beyond the bound"
    reference_backend = backends.get_backend("reference")
    monkeypatch.setattr(reference_backend, "formats", {**reference_backend.formats, "fp8_static": frozenset({"varlen"})})
    beyond = decide_rows([3, 4, 2], [0, 5, 6], 10)  # a backend without the FP8 merge launch
    assert (beyond.path, beyond.fused_tokens, beyond.post_quantized) == ("partial", 3, {"chunked_prefill": 6})
    assert "exceed the context workspace bound (10 tokens)" in beyond.detail
    assert "no fp8_static merge" in beyond.detail
    refused = decide_rows([4, 2], [5, 6], 10)
    assert (refused.path, refused.reason, refused.post_quantized) == ("fallback", "chunked_prefill",
                                                                     {"chunked_prefill": 6})
    nvfp4 = guard.decide(guard.BatchRows(0, (4, 2), (5, 6)), guard.LayerShape(CPU, torch.bfloat16, 2, 24, 16))
    assert (nvfp4.path, nvfp4.format) == ("fused", "nvfp4"), "NVFP4 merges context chunks: fused"


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_width_nvfp4_cannot_write_is_fused_in_fp8_static(monkeypatch, backend):
    """H*Dv = 24 (no 16-element NVFP4 blocks; Dv = 8): an NVFP4 call falls back, a static FP8 call, which writes
    each element on its own, is fused by a backend whose FP8 kernel takes the width (the decision only: the
    backend's availability stood in, as a CPU machine has no Triton device)."""
    monkeypatch.setattr(backends.get_backend(backend), "available", lambda: (True, "stand-in"))
    device = CPU if backend == "reference" else torch.device("cuda")  # triton's device, never touched here
    layer = guard.LayerShape(device, torch.bfloat16, 3, 16, 8)
    rows = guard.BatchRows(0, (5, 3), (0, 0))
    with settings.use_backend(backend):
        nvfp4_call = guard.decide(rows, layer)
        fp8_call = guard.decide(rows, layer, output_format=formats.FP8_STATIC)
    assert (nvfp4_call.path, nvfp4_call.reason) == ("fallback", "no_backend"), nvfp4_call
    assert (fp8_call.path, fp8_call.backend, fp8_call.format) == ("fused", backend, "fp8_static"), fp8_call


@pytest.mark.parametrize("bad, message", [
    ("bogus", r"output_format must be one of \['nvfp4', 'fp8_static', .*got 'bogus'"),
    (formats.FP8_STATIC, r"output_format must be None or a format's name \(str\), got OutputFormat fp8_static$"),
])
def test_counters_refuse_an_unknown_format_naming_the_known_ones(bad, message):
    with pytest.raises(ValueError, match=message):
        counters.counters(output_format=bad)


def test_the_native_form_keeps_a_nan_in_fused_and_unfused_rows():
    """A NaN in a prefill's value and in a decode row's query, native form: NaN (0x7F) in every row that sees it,
    fused (the prefill) or not (the decode row), as Inductor's compiled clamp and cast give it."""
    impl, twin, op, make = _layers("gqa", torch.bfloat16)
    name = "test_fp8_static_call.native_nan"
    runtime.register_layer(name, impl)
    gen = torch.Generator().manual_seed(7)
    width = impl.num_heads * impl.v_head_dim
    inv = torch.tensor([1 / 0.0009])
    first, spec = runtime.BatchSpec.from_lens([6]), runtime.BatchSpec.from_lens([1, 8], [6, 0], ["r0", "n1"])
    x0, x1 = make(first.num_tokens, gen), make(spec.num_tokens, gen)
    x1[2][1 + 4, 0, 3] = float("nan")
    x1[0][0, 1, 2] = float("nan")
    try:
        for s, x in ((first, x0), (spec, x1)):
            out = torch.empty(s.num_tokens, width, dtype=FP8)
            with runtime.batch(s):
                op(*x, out, name, output_inv_scale=inv)
    finally:
        runtime.unregister_layer(name)
    got = out.view(torch.uint8)
    twin.forward(*x0, first)
    attn = twin.forward(*x1, spec).reshape(spec.num_tokens, width)
    nan = fp8.NaNRule.NAN
    assert torch.equal(got[0], fp8.quantize_static(attn[0].bfloat16(), inv, nan=nan).view(torch.uint8))
    assert torch.equal(got[1:], fp8.quantize_static(attn[1:], inv, nan=nan).view(torch.uint8))
    assert bool((got[0, 16:32] == 0x7F).all()) and bool((got[5:, [3, 19]] == 0x7F).all())
    assert counters.counters(output_format="fp8_static")["fused_by_backend"] == {"reference": 2}


@pytest.mark.parametrize("change, message", [
    (dict(output_scale=torch.tensor([0.01])), "output_scale must be None with output_inv_scale"),
    (dict(output_block_scale=torch.zeros(128, 4, dtype=torch.int32)), "output_block_scale must be None"),
    (dict(output=torch.empty(5, 16, dtype=torch.uint8)), "output must be float8_e4m3fn with output_inv_scale"),
    (dict(output_inv_scale=torch.tensor([1.0, 2.0])), "output_inv_scale"),
    (dict(output_inv_scale=torch.tensor([3], dtype=torch.int32)), "output_inv_scale"),
])
def test_a_native_form_call_with_wrong_buffers_is_refused_before_anything_runs(change, message):
    impl, _, op, make = _layers("gqa", torch.bfloat16)
    name = "test_fp8_static_call.native_args"
    runtime.register_layer(name, impl)
    spec = runtime.BatchSpec.from_lens([5])
    args = dict(output=torch.full((5, impl.num_heads * impl.v_head_dim), POISON, dtype=torch.uint8).view(FP8),
                output_inv_scale=torch.tensor([100.0]))
    args.update(change)
    try:
        with runtime.batch(spec), pytest.raises(ValueError, match=message):
            op(*make(5, torch.Generator().manual_seed(1)), args.pop("output"), name, **args)
    finally:
        runtime.unregister_layer(name)
    assert counters.counters()["fused"] == 0 and not counters.counters()["fallback"]
