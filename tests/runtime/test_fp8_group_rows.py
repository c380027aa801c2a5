"""The run-time writer of the FP8 128-column group formats (:mod:`fusion_pass.runtime.fp8_group_rows`) and the
backends' group launch (``run_varlen_fp8_group``), docs/formats.md "FP8 dynamic per-token groups".

Generated prefills (a fresh seed per run, named in every failure): with and without cached context (one key/value
workspace of context + new tokens), starting past row 0 with rows after them, head dims of one and two groups a
head; each of the three scale layouts, UE8M0 on and off, multiply and divide. Checked:

* ``run_prefills_fp8_group`` with the ``reference`` backend: the prefills' rows of ``output`` and ``scales`` are
  exactly :func:`fusion_pass.fp8.quantize_group` of the float32 reference attention of those rows (computed here
  per request from its own context and new keys); with the ``triton`` backend (Triton's interpreter on the CPU,
  compiled on CUDA; skipped where neither runs): exactly ``quantize_group`` of the kernel's own float32 output of
  the inputs it was handed, and within the format's error bound of the reference attention. Every other row of both
  buffers, and the TMA layout's padding, keeps its sentinel;
* a whole call through :func:`fusion_pass.runtime.row_plan.run_rows` (decode rows, chunks with context on both
  sides of the workspace bound): fused rows as above, every other row ``quantize_group`` of the query-dtype
  attention (the unfused graph's bytes);
* :func:`post_quantize_rows_fp8_group`: ``quantize_group`` of the rows, into their rows only;
* a NaN (-448, ``0xFE``; the group's scale computed without it) in fused and post-quantized rows;
* arguments that do not add up and a context beyond the workspace bound: ValueError before any kernel runs;
* ``supports(..., output_format=)`` refuses ``Dv % 128 != 0`` with the format's reason; ``formats`` lists both
  group formats by the varlen launch (``fa4``: where the generation table lists them, SM90); the ``fa4`` launch's
  arguments (a stand-in for FA4's SM90 kernel: its bytes are ``tests/kernels/test_fa4_fp8_group.py``'s, on a GPU).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from fusion_pass import fp8, formats, kernels, runtime
from fusion_pass.fp8 import ScaleLayout
from fusion_pass.kernels import reference
from fusion_pass.kernels.fa4 import generations, sm90_fp8
from fusion_pass.runtime import backends, guard, row_plan, settings
from fusion_pass.runtime.backends import base, fa4 as fa4_backend
from fusion_pass.runtime.fp8_group_rows import (FP8GroupRows, GroupQuant, post_quantize_rows_fp8_group,
                                                run_prefills_fp8_group)

from sm90_gpu import gpu  # noqa: E402

POISON = 0x55
SCALE_POISON = -3.0
FORMS = [GroupQuant(ue8m0, divide) for ue8m0 in (False, True) for divide in (False, True)]
FORM_IDS = [f"ue8m0={f.ue8m0}-divide={f.divide}" for f in FORMS]
LAYOUTS = list(ScaleLayout)
HEADS = [(2, 1, 32, 128), (4, 2, 16, 128), (1, 1, 24, 256)]  # (H, Hkv, Dqk, Dv): 2, 4 and 2 groups a row
TRITON = torch.cuda.is_available() or kernels.interpreter_enabled()
needs_triton = pytest.mark.skipif(not TRITON, reason="no CUDA device and TRITON_INTERPRET is not set (conftest.py "
                                                     "sets it on CPU-only machines)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _clean_state(clean_backend_state):
    yield


@dataclass
class Prefills:
    """A run of prefills at rows ``[first_row, first_row + sum(query_lens))`` of ``q [T, H, Dqk]``: new keys and
    values ``k``/``v`` (one row per new token), cached context ``k_ctx``/``v_ctx`` packed in request order."""

    seed: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_ctx: torch.Tensor
    v_ctx: torch.Tensor
    first_row: int
    query_lens: list[int]
    context_lens: list[int]
    softmax_scale: float

    @property
    def t(self) -> int:
        return self.q.shape[0]

    @property
    def width(self) -> int:
        return self.q.shape[1] * self.v.shape[2]

    @property
    def rows(self) -> slice:
        return slice(self.first_row, self.first_row + sum(self.query_lens))

    def context(self, lo: int, hi: int):
        return self.k_ctx[lo:hi], self.v_ctx[lo:hi]

    def args(self) -> dict:
        return dict(q=self.q, k=self.k, v=self.v, first_row=self.first_row, query_lens=self.query_lens,
                    context_lens=self.context_lens, context=self.context, softmax_scale=self.softmax_scale)

    def __str__(self) -> str:
        return (f"seed {self.seed}: heads {list(self.q.shape[1:])}/{list(self.v.shape[1:])}, Lq {self.query_lens}, "
                f"context {self.context_lens}, first_row {self.first_row}, T {self.t}")


def make_prefills(seed: int, heads=None, *, context: bool | None = None) -> Prefills:
    """Prefills from ``seed``: 1-3 of 1-7 new tokens, each with 0-9 cached tokens (none without ``context``; some
    when None), after 0-4 rows and before 0-4 (``T % 4 != 0``); each kv head's values scaled by 10^-3 .. 10^2 so
    that groups differ."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    h, hkv, d, dv = heads or rng.choice(HEADS)
    n = rng.randint(1, 3)
    query_lens = [rng.randint(1, 7) for _ in range(n)]
    with_context = rng.random() < 0.6 if context is None else context
    context_lens = [rng.choice([0, rng.randint(1, 9)]) if with_context else 0 for _ in range(n)]
    if with_context and not any(context_lens):
        context_lens[rng.randrange(n)] = rng.randint(1, 9)
    first_row, tail = rng.randint(0, 4), rng.randint(0, 3)
    tail += (first_row + sum(query_lens) + tail) % 4 == 0  # T not a multiple of 4: the TMA layout has padding
    t, new, cached = first_row + sum(query_lens) + tail, sum(query_lens), sum(context_lens)
    magnitude = torch.tensor([10 ** rng.uniform(-3, 2) for _ in range(hkv)]).reshape(1, hkv, 1)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(DEVICE)

    return Prefills(seed, rand(t, h, d), rand(new, hkv, d), rand(new, hkv, dv, scale=magnitude),
                    rand(cached, hkv, d), rand(cached, hkv, dv, scale=magnitude), first_row, query_lens,
                    context_lens, d ** -0.5)


def reference_attention(case: Prefills) -> torch.Tensor:
    """float32 ``[sum(query_lens), H*Dv]``: per request, its new queries over its context then its new keys, causal
    aligned to the end (:func:`fusion_pass.kernels.reference.dense_attention`)."""
    outs, c, n = [], 0, 0
    for lq, lc in zip(case.query_lens, case.context_lens):
        q = case.q[case.first_row + n:case.first_row + n + lq]
        k = torch.cat([case.k_ctx[c:c + lc], case.k[n:n + lq]])
        v = torch.cat([case.v_ctx[c:c + lc], case.v[n:n + lq]])
        outs.append(reference.dense_attention(q, k, v, scale=case.softmax_scale, causal=True, q_offset=lc)[0])
        c, n = c + lc, n + lq
    return torch.cat(outs).reshape(sum(case.query_lens), -1)


def sentinel_buffers(t: int, width: int, layout: ScaleLayout, extra: int = 0,
                     device=DEVICE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(output float8_e4m3fn [T, width], scales float32 [T, width/128] in layout, the scales' whole allocation)``,
    every byte and scale (the TMA layout's padding included) a sentinel. ``extra``: a column-major allocation
    ``extra`` rows longer, the scales its first ``T`` rows (a padded batch's rows, as vLLM hands them)."""
    output = torch.full((t, width), POISON, dtype=torch.uint8, device=device).view(fp8.FP8)
    groups = width // fp8.GROUP_SIZE
    if layout is ScaleLayout.ROW_MAJOR:
        allocation = torch.full((t, groups), SCALE_POISON, device=device)
        return output, allocation, allocation
    allocation = torch.full((groups, layout.leading(t) + extra), SCALE_POISON, device=device)
    scales = allocation[:, :t].t()
    assert scales.stride() == (1, layout.leading(t) + extra) and fp8.writable_scales(scales)
    return output, scales, allocation


def assert_others_kept(output, scales, allocation, rows: slice, where: str) -> None:
    """Rows outside ``rows`` of both buffers, and the padding of the scales' allocation, hold their sentinels."""
    t = output.shape[0]
    outside = torch.ones(t, dtype=torch.bool, device=output.device)
    outside[rows] = False
    assert bool((output.view(torch.uint8)[outside] == POISON).all()), f"output rows outside {rows} written ({where})"
    assert bool((scales[outside] == SCALE_POISON).all()), f"scale rows outside {rows} written ({where})"
    if allocation is not scales:
        assert bool((allocation[:, t:] == SCALE_POISON).all()), f"the TMA padding written ({where})"


class Spy:
    """Wraps a backend's ``run_varlen_fp8_group``, recording every launch's inputs."""

    def __init__(self, backend):
        self.inner, self.calls = backend.run_varlen_fp8_group, []

    def __call__(self, q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, scales, **kw):
        self.calls.append((q.clone(), k.clone(), v.clone(), cu_seqlens.clone(), max_seqlen, softmax_scale,
                           kw.get("cu_seqlens_k"), kw.get("max_seqlen_k")))
        self.inner(q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, scales, **kw)

    def triton_attention(self) -> tuple[torch.Tensor, slice]:
        """The Triton kernel's own float32 attention ``[rows, H*Dv]`` of the last launch's inputs, and its rows."""
        from fusion_pass.kernels.triton import flash_attention as fa

        q, k, v, cu, max_q, sm, cu_k, max_k = self.calls[-1]
        a, b = int(cu[0]), int(cu[-1])
        out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), device=q.device)
        fa.flash_attention(q, k, v, cu, max_q, out=out, causal=True, softmax_scale=sm, cu_seqlens_k=cu_k,
                           max_seqlen_k=max_k)
        return out[a:b].reshape(b - a, -1), slice(a, b)


def run_case(backend, case: Prefills, layout: ScaleLayout, quant: GroupQuant, extra: int = 0):
    output, scales, allocation = sentinel_buffers(case.t, case.width, layout, extra)
    run_prefills_fp8_group(backend, **case.args(), output=output, scales=scales, quant=quant)
    return output, scales, allocation


@pytest.mark.parametrize("layout", LAYOUTS, ids=[x.value for x in LAYOUTS])
@pytest.mark.parametrize("quant", FORMS, ids=FORM_IDS)
def test_reference_prefills_are_quantize_group_of_the_float32_attention_of_their_rows(layout, quant):
    backend = backends.ReferenceBackend()
    for extra in (0, 0, 3 if layout is not ScaleLayout.ROW_MAJOR else 0):  # the last: a longer allocation's rows
        case = make_prefills(random.randrange(1 << 30))
        output, scales, allocation = run_case(backend, case, layout, quant, extra)
        want, want_scales = fp8.quantize_group(reference_attention(case), ue8m0=quant.ue8m0, divide=quant.divide)
        assert torch.equal(output.view(torch.uint8)[case.rows], want.view(torch.uint8)), str(case)
        assert torch.equal(scales[case.rows], want_scales), str(case)
        assert_others_kept(output, scales, allocation, case.rows, str(case))


@needs_triton
@pytest.mark.parametrize("layout", LAYOUTS, ids=[x.value for x in LAYOUTS])
@pytest.mark.parametrize("quant", [FORMS[0], FORMS[3]], ids=[FORM_IDS[0], FORM_IDS[3]])
def test_triton_prefills_are_quantize_group_of_the_kernels_own_float32_attention(monkeypatch, layout, quant):
    """Exactly ``quantize_group`` of the kernel's float32 output (its contract), and within the format's error bound
    plus the kernel's own rounding of the float32 reference attention (which keys it was given)."""
    backend = backends.TritonBackend()
    spy = Spy(backend)
    monkeypatch.setattr(backend, "run_varlen_fp8_group", spy)
    for _ in range(2):
        case = make_prefills(random.randrange(1 << 30))
        output, scales, allocation = run_case(backend, case, layout, quant)
        assert len(spy.calls) == 1, f"one launch ({case})"
        own, span = spy.triton_attention()
        assert span == case.rows, str(case)
        want, want_scales = fp8.quantize_group(own, ue8m0=quant.ue8m0, divide=quant.divide)
        assert torch.equal(output.view(torch.uint8)[case.rows], want.view(torch.uint8)), str(case)
        assert torch.equal(scales[case.rows], want_scales), str(case)
        assert_others_kept(output, scales, allocation, case.rows, str(case))
        attn = reference_attention(case)
        got = fp8.dequantize_group(output[case.rows], scales[case.rows])
        group_max = attn.abs().reshape(attn.shape[0], -1, fp8.GROUP_SIZE).amax(-1, keepdim=True)
        slack = (0.02 * group_max).expand(-1, -1, fp8.GROUP_SIZE).reshape(attn.shape)
        bound = fp8.group_error_bound(attn, scales[case.rows]) + slack
        assert bool(((got - attn).abs() <= bound).all()), f"off the float32 attention ({case})"
        spy.calls.clear()


def _schedule(rng: random.Random, steps: int):
    """``(query_lens, context_lens, ids)`` per step, decodes first: a prompt, decodes beside a new prompt, a chunk
    with context beside a prompt, decodes beside a chunk, then random steps."""
    cached: dict[str, int] = {}
    fresh = iter(f"n{i}" for i in range(1000))
    kinds = ["prefill", "mixed", "chunked", "decodes+chunked"]
    plans = []
    for step in range(steps):
        kind = kinds[step] if step < len(kinds) else rng.choice(kinds)
        running = list(cached)
        rng.shuffle(running)
        n_dec = 0 if kind in ("prefill", "chunked") else rng.randint(1, max(1, len(running) - 1))
        decodes, rest = running[:n_dec], running[n_dec:]
        chunks = rest[:rng.randint(1, 2)] if kind in ("chunked", "decodes+chunked") else []
        news = [next(fresh) for _ in range(rng.randint(0 if kind == "decodes+chunked" else 1, 2))]
        reqs = [(i, 1, cached[i]) for i in decodes] + [(i, rng.randint(2, 6), cached[i]) for i in chunks] \
            + [(i, rng.randint(2, 7), 0) for i in news]
        for i, q, c in reqs:
            cached[i] = c + q
        plans.append(([q for _, q, _ in reqs], [c for _, _, c in reqs], [i for i, _, _ in reqs]))
    return plans


@pytest.mark.parametrize("kernel", ["reference", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("bound", [1 << 16, 4])
def test_a_whole_call_fuses_the_prefills_and_post_quantizes_every_other_row(monkeypatch, kernel, bound):
    """Through :func:`fusion_pass.runtime.row_plan.run_rows`, the plan the attention ops run: every prefill is fused;
    within the bound its rows are ``quantize_group`` of the kernel's own attention of the inputs it was handed,
    beyond it (4) ``quantize_group`` of the float32 merge of the partial attentions the merge was handed (and within
    the format's bound of the float32 attention); decode rows ``quantize_group`` of the query-dtype attention."""
    if kernel == "triton" and torch.cuda.is_available():
        pytest.skip("the runtime's CPU layers (a CUDA run is tests/kernels')")
    seed = random.randrange(1 << 30)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    dims = dict(num_heads=2, num_kv_heads=1, head_dim=32, v_head_dim=128, softmax_scale=32 ** -0.5)
    impl, twin = runtime.AttentionImpl(**dims), runtime.AttentionImpl(**dims)
    backend = backends.ReferenceBackend() if kernel == "reference" else backends.TritonBackend()
    spy = Spy(backend)
    monkeypatch.setattr(backend, "run_varlen_fp8_group", spy)
    merges, merge = [], FP8GroupRows.merge

    def recorded_merge(self, backend_, out_a, lse_a, out_b, lse_b, first_row):
        merges.append((out_a, lse_a, out_b, lse_b, first_row))
        merge(self, backend_, out_a, lse_a, out_b, lse_b, first_row)

    monkeypatch.setattr(FP8GroupRows, "merge", recorded_merge)
    layouts = iter(LAYOUTS * 3)
    fused_steps = merged_steps = beyond_steps = 0
    with settings.use_context_workspace_tokens(bound):
        for step, (query_lens, context_lens, ids) in enumerate(_schedule(rng, 5)):
            quant, layout = GroupQuant(rng.random() < 0.5, rng.random() < 0.5), next(layouts)
            where = f"seed {seed}, step {step}, lens {query_lens}, context {context_lens}, {layout.value}, {quant}"
            spec = runtime.BatchSpec.from_lens(query_lens, context_lens, ids)
            t = spec.num_tokens
            inputs = (torch.randn(t, 2, 32, generator=gen).bfloat16(), torch.randn(t, 1, 32, generator=gen).bfloat16(),
                      torch.randn(t, 1, 128, generator=gen).bfloat16())
            attn32 = twin.forward(*inputs, spec).reshape(t, -1)
            output, scales, allocation = sentinel_buffers(t, 256, layout, device="cpu")  # the CPU layers' rows
            writer = FP8GroupRows(output, scales, t, quant)
            prefills = spec.requests[spec.num_decodes:]
            mask = writer.fused(backend, [r.context_len for r in prefills])
            if any(mask):
                row_plan.run_rows(backend, impl, inputs, spec, writer)
            else:
                writer.everything(impl.forward(*inputs, spec).to(torch.bfloat16).reshape(t, -1))
            want, want_scales = fp8.quantize_group(attn32.bfloat16(), ue8m0=quant.ue8m0, divide=quant.divide)
            rows = [False] * spec.num_decode_tokens + [f for f, r in zip(mask, prefills) for _ in range(r.query_len)]
            if merges:  # beyond the bound: the prefills' rows from the merge
                merged_steps += 1
                out_a, lse_a, out_b, lse_b, first = merges.pop()
                x = reference.merge_attention(out_a, lse_a, out_b, lse_b)[0]
                x = x.reshape(x.shape[0], -1)
                own_bytes, own_scales = fp8.quantize_group(x, ue8m0=quant.ue8m0, divide=quant.divide)
                span = slice(first, first + x.shape[0])
                assert span == slice(spec.num_decode_tokens, t), where
                want.view(torch.uint8)[span] = own_bytes.view(torch.uint8)
                want_scales[span] = own_scales
                group_max = attn32[span].abs().reshape(x.shape[0], -1, fp8.GROUP_SIZE).amax(-1, keepdim=True)
                slack = (1e-5 if kernel == "reference" else 0.02) * group_max  # triton: its own bf16 roundings
                near = fp8.group_error_bound(attn32[span], own_scales) + slack.expand(
                    -1, -1, fp8.GROUP_SIZE).reshape(x.shape)
                assert bool(((fp8.dequantize_group(own_bytes, own_scales) - attn32[span]).abs() <= near).all()), where
            elif any(mask):
                fused_steps += 1
                q, k, v, cu, max_q, sm, cu_k, _ = spy.calls[-1]
                if kernel == "triton":
                    own, span = spy.triton_attention()
                else:
                    a, b = int(cu[0]), int(cu[-1])
                    kk, vv = (k, v) if cu_k is not None else (k[a:b], v[a:b])
                    own, span = reference.varlen_attention(q[a:b], kk, vv, cu - a, True, sm, cu_k)[0], slice(a, b)
                own_bytes, own_scales = fp8.quantize_group(own.reshape(own.shape[0], -1), ue8m0=quant.ue8m0,
                                                           divide=quant.divide)
                fused = torch.tensor(rows[span])
                want.view(torch.uint8)[span][fused] = own_bytes.view(torch.uint8)[fused]
                want_scales[span][fused] = own_scales[fused]
            got_bytes, want_bytes = output.view(torch.uint8), want.view(torch.uint8)
            assert torch.equal(got_bytes, want_bytes), \
                f"rows {[r for r in range(t) if not torch.equal(got_bytes[r], want_bytes[r])]} differ ({where})"
            assert torch.equal(scales, want_scales), where
            if allocation is not scales:
                assert bool((allocation[:, t:] == SCALE_POISON).all()), f"the TMA padding written ({where})"
            assert mask == [True] * len(prefills), where  # every prefill: within the bound or merged
            beyond_steps += sum(r.context_len for r in prefills) > bound
            assert not merges, where
    assert fused_steps > 0 and merged_steps == beyond_steps and (beyond_steps == 0 or bound == 4), f"seed {seed}"


@pytest.mark.parametrize("layout", LAYOUTS, ids=[x.value for x in LAYOUTS])
@pytest.mark.parametrize("quant", FORMS, ids=FORM_IDS)
def test_post_quantized_rows_are_quantize_group_of_the_rows_and_touch_no_other(layout, quant):
    seed = random.randrange(1 << 30)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    h, dv = rng.choice([(2, 128), (3, 128), (1, 256)])
    t = rng.randint(1, 9)
    row_start = rng.randrange(t)
    m = rng.randint(1, t - row_start)
    x = (torch.randn(m, h, dv, generator=gen) * 10 ** rng.uniform(-3, 2)).bfloat16().to(DEVICE)
    output, scales, allocation = sentinel_buffers(t, h * dv, layout)
    shaped = output.view(t, h, dv) if rng.random() < 0.5 else output  # [T, H, Dv] or [T, H*Dv], the same bytes
    rows = x if rng.random() < 0.5 else x.reshape(m, -1)
    post_quantize_rows_fp8_group(rows, shaped, scales, row_start, t, quant)
    want, want_scales = fp8.quantize_group(x.reshape(m, -1), ue8m0=quant.ue8m0, divide=quant.divide)
    span, where = slice(row_start, row_start + m), f"seed {seed}: T {t}, rows {row_start}..{row_start + m}, {h}x{dv}"
    assert torch.equal(output.view(torch.uint8)[span], want.view(torch.uint8)), where
    assert torch.equal(scales[span], want_scales), where
    assert_others_kept(output, scales, allocation, span, where)


def test_the_writer_writes_every_row_and_hands_the_backend_its_buffers(monkeypatch):
    """``everything`` is ``quantize_group`` of every row; ``varlen`` hands ``run_varlen_fp8_group`` the output as
    ``[T, H*Dv]`` (the same bytes), the scales as given and the arithmetic; ``fused``: every prefill where the
    backend lists the merge, else prefills with context only while their context fits the workspace bound."""
    t, width = 6, 256
    output, scales, allocation = sentinel_buffers(t, width, ScaleLayout.COLUMN_MAJOR_TMA)
    quant = GroupQuant(ue8m0=True, divide=True)
    writer = FP8GroupRows(output.view(t, 2, 128), scales, t, quant)
    assert callable(writer.merge) and quant.format is formats.FP8_GROUP128_UE8M0
    assert GroupQuant(False, True).format is formats.FP8_GROUP128
    x = torch.randn(t, width).bfloat16().to(DEVICE)
    writer.everything(x)
    want, want_scales = fp8.quantize_group(x, ue8m0=True, divide=True)
    assert torch.equal(output.view(torch.uint8), want.view(torch.uint8)) and torch.equal(scales, want_scales)
    assert bool((allocation[:, t:] == SCALE_POISON).all())
    seen = {}

    class StandIn:
        name, handles_context, formats = "stand-in", True, base.FP8_WRITER

        def run_varlen_fp8_group(self, *args, **kw):
            seen.update(args=args, **kw)

    q = torch.zeros(t, 2, 32)
    cu, cu_k = torch.tensor([1, 6], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
    writer.varlen(StandIn(), q, q, q, cu, 5, 0.5, cu_k, 5)
    out = seen["args"][6]
    assert seen["args"][:6] == (q, q, q, cu, 5, 0.5) and seen["args"][7] is scales
    assert out.shape == (t, width) and out.dtype == fp8.FP8 and out.data_ptr() == output.data_ptr()
    assert (seen["cu_seqlens_k"], seen["max_seqlen_k"], seen["ue8m0"], seen["divide"]) == (cu_k, 5, True, True)
    class NoMerge(StandIn):
        formats = {**base.FP8_WRITER, quant.format.name: frozenset({"varlen"})}

    with settings.use_context_workspace_tokens(5):
        assert writer.fused(StandIn(), [0, 3, 3]) == [True, True, True]
        assert writer.fused(NoMerge(), [0, 3, 2]) == [True, True, True]
        assert writer.fused(NoMerge(), [0, 3, 3]) == [True, False, False]


@pytest.mark.parametrize("kernel", ["reference", pytest.param("triton", marks=needs_triton)])
def test_a_nan_becomes_negative_max_in_fused_and_post_quantized_rows(kernel):
    """A NaN value of a prompt: every row that sees it has -448 (``0xFE``) in its column and its group's scale
    computed from the other elements (finite), in the fused rows and in a decode row written by the row writer."""
    backend = backends.ReferenceBackend() if kernel == "reference" else backends.TritonBackend()
    seed = next(s for s in range(100) if make_prefills(s, (2, 1, 32, 128), context=False).first_row)
    case = make_prefills(seed, (2, 1, 32, 128), context=False)
    case.query_lens, case.context_lens = [sum(case.query_lens)], [0]
    n = sum(case.query_lens)
    nan_key = n // 2
    case.v[nan_key, 0, 7] = float("nan")
    output, scales, allocation = run_case(backend, case, ScaleLayout.COLUMN_MAJOR, GroupQuant(False, False))
    got = output.view(torch.uint8)[case.rows]
    sees = slice(nan_key, n)
    assert bool((got[sees][:, [7, 128 + 7]] == 0xFE).all()), str(case)
    assert bool(scales[case.rows].isfinite().all()), str(case)
    if kernel == "reference":
        want, want_scales = fp8.quantize_group(reference_attention(case))
        assert torch.equal(got, want.view(torch.uint8)) and torch.equal(scales[case.rows], want_scales), str(case)
    row = torch.randn(1, 256).bfloat16().to(DEVICE)
    row[0, 200] = float("nan")
    FP8GroupRows(output, scales, case.t, GroupQuant(True, False)).rows(row, 0)
    assert int(output.view(torch.uint8)[0, 200]) == 0xFE and bool(scales[0].isfinite().all())
    want, want_scales = fp8.quantize_group(row, ue8m0=True)
    assert torch.equal(output.view(torch.uint8)[0], want.view(torch.uint8)[0])
    assert torch.equal(scales[0], want_scales[0])
    assert_others_kept(output, scales, allocation, slice(0, case.rows.stop), str(case))


class NeverCalled:
    name, handles_context, formats = "never", True, base.FP8_WRITER

    def __init__(self):
        self.calls = []

    def run_varlen_fp8_group(self, *args, **kw):
        self.calls.append(args)


@pytest.mark.parametrize("change, match", [
    (dict(query_lens=[6, 4], context_lens=[2]), "query_lens and context_lens must describe the same prefills"),
    (dict(query_lens=[6, 3], context_lens=[0, 0]), r"k must have sum\(query_lens\) = 9 rows"),
    (dict(first_row=3), r"first_row \+ sum\(query_lens\) = 3 \+ 10"),
    (dict(context=None), "context_lens sum to 9 cached tokens but context is None"),
    (dict(workspace_tokens=0), r"run_prefills_fp8_group\(workspace_tokens\)"),
])
def test_prefills_that_do_not_add_up_or_do_not_fit_are_refused_before_any_kernel_runs(change, match):
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(12, 2, 32, generator=gen), torch.randn(10, 1, 32, generator=gen), torch.randn(10, 1, 128)
    k_ctx, v_ctx = torch.randn(9, 1, 32), torch.randn(9, 1, 128)
    output, scales, allocation = sentinel_buffers(12, 256, ScaleLayout.COLUMN_MAJOR_TMA)
    args = dict(q=q, k=k, v=v, first_row=2, query_lens=[6, 4], context_lens=[4, 5], softmax_scale=0.2,
                context=lambda lo, hi: (k_ctx[lo:hi], v_ctx[lo:hi]), output=output, scales=scales,
                quant=GroupQuant(True, False))
    args.update(change)
    spy = NeverCalled()
    with pytest.raises(ValueError, match=match):
        run_prefills_fp8_group(spy, **args)
    assert spy.calls == []
    assert_others_kept(output, scales, allocation, slice(0, 0), "refused")


def test_a_context_within_the_bound_runs_one_launch_over_the_workspace():
    case = make_prefills(5, (2, 1, 32, 128), context=True)
    spy = NeverCalled()
    output, scales, _ = sentinel_buffers(case.t, case.width, ScaleLayout.ROW_MAJOR)
    run_prefills_fp8_group(spy, **case.args(), output=output, scales=scales, quant=GroupQuant(False, False),
                           workspace_tokens=sum(case.context_lens))
    (q, k, v, cu, max_q, sm, out, sc), = spy.calls
    key_lens = [a + b for a, b in zip(case.context_lens, case.query_lens)]
    assert k.shape[0] == sum(key_lens) and cu.tolist()[0] == case.first_row and max_q == max(case.query_lens)
    assert sc is scales and out.shape == (case.t, case.width)


@pytest.mark.parametrize("name", ["reference", "triton", "fa4"])
@pytest.mark.parametrize("output_format", [formats.FP8_GROUP128, formats.FP8_GROUP128_UE8M0], ids=lambda f: f.name)
def test_supports_refuses_a_v_head_dim_that_is_not_whole_groups(name, output_format):
    backend = backends.get_backend(name)
    device = torch.device("cpu") if name == "reference" else torch.device("cuda")  # never touched
    ok, why = backend.supports(device, torch.bfloat16, 4, 64, 64, output_format=output_format)
    assert not ok and why == output_format.refusal(4, 64) and "v_head_dim 64" in why, why
    if name != "fa4":  # fa4 needs its SM90 device for the rest
        assert backend.supports(device, torch.bfloat16, 4, 64, 128, output_format=output_format) == (True, "ok")
        assert backend.supports(device, torch.bfloat16, 4, 64, 64, output_format=formats.FP8_STATIC) == (True, "ok")


def test_the_guard_falls_back_for_a_v_head_dim_of_64_and_fuses_one_of_128():
    cpu = torch.device("cpu")
    rows = guard.BatchRows(0, (5, 3), (0, 0))
    refused = guard.decide(rows, guard.LayerShape(cpu, torch.bfloat16, 2, 32, 64), output_format=formats.FP8_GROUP128)
    assert (refused.path, refused.reason, refused.format) == ("fallback", "no_backend", "fp8_group128"), refused
    assert "v_head_dim 64 is not a multiple of 128" in refused.detail, refused.detail
    fused = guard.decide(rows, guard.LayerShape(cpu, torch.bfloat16, 2, 32, 128),
                         output_format=formats.FP8_GROUP128_UE8M0)
    assert (fused.path, fused.backend, fused.format) == ("fused", "reference", "fp8_group128_ue8m0"), fused


@pytest.mark.parametrize("arch, lists", [(None, False), (90, True), (100, False), (120, False)])
def test_the_backends_write_both_group_formats_by_the_varlen_launch_and_the_merge(monkeypatch, arch, lists):
    monkeypatch.setattr(fa4_backend, "device_arch", lambda index=None: arch)
    for output_format in (formats.FP8_GROUP128, formats.FP8_GROUP128_UE8M0):
        for name in ("reference", "triton", "fa4"):
            backend = backends.get_backend(name)
            assert base.writes(backend, output_format) is (name != "fa4" or lists), (name, arch)
            assert base.writes(backend, output_format, "merge") is (name != "fa4" or lists), (name, arch)
            assert not base.writes(backend, output_format, "paged")
        assert base.writes(backends.get_backend("fa4"), formats.NVFP4)
    assert [g.name for g in generations.GENERATIONS if "fp8_group128" in g.formats] == ["sm90"]


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("divide", [False, True])
def test_the_fa4_launch_hands_its_sm90_kernel_the_buffers(monkeypatch, ue8m0, divide):
    seen = {}
    monkeypatch.setattr(sm90_fp8, "fa4_attention_fp8_group_varlen", lambda *a, **kw: seen.update(args=a, **kw))
    t, h, dv = 7, 2, 128
    q, k, v = torch.randn(t, h, 128), torch.randn(5, 1, 128), torch.randn(5, 1, dv)
    output = torch.empty(t, h, dv, dtype=fp8.FP8)
    scales = fp8.group_scale_buffer(t, h * dv, ScaleLayout.COLUMN_MAJOR_TMA)
    cu, cu_k = torch.tensor([2, 4, 7], dtype=torch.int32), torch.tensor([0, 2, 5], dtype=torch.int32)
    backends.get_backend("fa4").run_varlen_fp8_group(q, k, v, cu, 3, 0.5, output, scales, cu_seqlens_k=cu_k,
                                                     max_seqlen_k=3, ue8m0=ue8m0, divide=divide)
    assert seen["args"] == (q, k, v) and seen["scales"] is scales
    assert seen["output"].shape == (t, h * dv) and seen["output"].data_ptr() == output.data_ptr()
    assert (seen["cu_seqlens"], seen["max_seqlen"], seen["softmax_scale"], seen["causal"]) == (cu, 3, 0.5, True)
    assert (seen["cu_seqlens_k"], seen["max_seqlen_k"], seen["ue8m0"], seen["divide"]) == (cu_k, 3, ue8m0, divide)


@gpu
@pytest.mark.parametrize("heads", [(16, 16, 192, 128), (32, 8, 128, 128)], ids=["mla16", "gqa"])
@pytest.mark.parametrize("layout, extra", [*((x, 0) for x in LAYOUTS), (ScaleLayout.COLUMN_MAJOR, 5)],
                         ids=[*(x.value for x in LAYOUTS), "column_major_rows_of_a_larger_buffer"])
def test_fa4_prefills_are_quantize_group_of_fa4s_own_output_on_sm90(monkeypatch, heads, layout, extra):
    """FA4's SM90 group epilogue through the row writer: the prefills' rows are ``quantize_group`` of FA4's own
    query-dtype output of the inputs it was handed (its twin,
    :func:`fusion_pass.kernels.fa4.sm90.fa4_attention_varlen`), every other row and the TMA padding kept; also into
    the first rows of a longer column-major buffer (``extra`` rows more: its column stride is not ``T``)."""
    from fusion_pass.kernels.fa4 import sm90 as fa4_sm90

    monkeypatch.setattr(fa4_backend, "device_arch", lambda index=None: 90)
    backend = backends.FA4Backend()
    spy = Spy(backend)
    monkeypatch.setattr(backend, "run_varlen_fp8_group", spy)
    for quant in FORMS:
        case = make_prefills(random.randrange(1 << 30), heads)
        output, scales, allocation = run_case(backend, case, layout, quant, extra)
        q, k, v, cu, max_q, sm, cu_k, max_k = spy.calls[-1]
        twin = fa4_sm90.fa4_attention_varlen(q, k, v, cu, max_q, causal=True, softmax_scale=sm, cu_seqlens_k=cu_k,
                                             max_seqlen_k=max_k)
        want, want_scales = fp8.quantize_group(twin[case.rows].reshape(sum(case.query_lens), -1),
                                               ue8m0=quant.ue8m0, divide=quant.divide)
        assert torch.equal(output.view(torch.uint8)[case.rows], want.view(torch.uint8)), f"{case}, {quant}"
        assert torch.equal(scales[case.rows], want_scales), f"{case}, {quant}"
        assert_others_kept(output, scales, allocation, case.rows, f"{case}, {quant}")
