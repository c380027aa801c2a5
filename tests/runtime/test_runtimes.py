"""Tests of fusion_pass.runtime: batch metadata, forward context, registry,
the dense primitives and the MLA / GQA runtimes against dense float64 oracles
computed from each request's full sequence."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from fusion_pass.runtime import (
    AttentionImpl,
    BatchSpec,
    MLAAttentionImpl,
    RequestSpec,
    dense_attention,
    batch,
    clear_kv_caches,
    current_batch,
    get_layer,
    merge_attention,
    register_layer,
    registered_layers,
    unregister_layer,
)

# MLA dims
H, NOPE, ROPE, V, L = 4, 16, 8, 16, 32
# GQA dims
GH, GKV, GD, GDV = 4, 2, 16, 12

TOL = dict(rtol=1e-5, atol=1e-5)
BF16_TOL = dict(rtol=3e-2, atol=3e-2)


# ---------------------------------------------------------------------------
# Dense float64 oracles over a request's full sequence (one causal softmax)
# ---------------------------------------------------------------------------


def _causal_softmax_attention(q, k, v, scale):
    """q [N,H,D], k [N,H,D], v [N,H,Dv] float64 -> [N,H,Dv]; causal over all N."""
    n = q.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    visible = torch.ones(n, n, dtype=torch.bool).tril()
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def mla_oracle(q, kv_c, k_pe, weight, scale):
    """Expand every token's latent through kv_b_proj, then causal attention."""
    w = weight.double().view(H, NOPE + V, L)
    kv = torch.einsum("sl,hdl->shd", kv_c.double(), w)
    k = torch.cat([kv[..., :NOPE], k_pe.double()[:, None, :].expand(-1, H, -1)], dim=-1)
    return _causal_softmax_attention(q.double(), k, kv[..., NOPE:], scale)


def gqa_oracle(q, k, v, scale):
    rep = GH // GKV
    return _causal_softmax_attention(
        q.double(), k.double().repeat_interleave(rep, dim=1), v.double().repeat_interleave(rep, dim=1), scale
    )


# ---------------------------------------------------------------------------
# Scenarios: full per-request sequences fed to one impl batch by batch
# ---------------------------------------------------------------------------


class Scenario:
    """Holds each request's full float32 sequence; feeds slices to the impl."""

    MAX_LEN = 16

    def __init__(self, seed: int, dtype: torch.dtype = torch.float32):
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.seqs: dict[str, list[torch.Tensor]] = {}

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen)

    def inputs(self, spec: BatchSpec) -> list[torch.Tensor]:
        """The batch's input tensors: each request's new tokens, in spec order."""
        slices = []
        for r in spec.requests:
            if r.request_id not in self.seqs:
                self.seqs[r.request_id] = self.new_sequence(self.MAX_LEN)
            end = r.context_len + r.query_len
            assert end <= self.MAX_LEN
            slices.append([t[r.context_len : end] for t in self.seqs[r.request_id]])
        return [torch.cat(parts).to(self.dtype) for parts in zip(*slices)]

    def run(self, spec: BatchSpec) -> torch.Tensor:
        return self.forward(*self.inputs(spec), spec)

    def expected(self, request: RequestSpec, rounded: bool = False) -> torch.Tensor:
        """Oracle rows for the request's new tokens (from the full sequence)."""
        seq = self.seqs[request.request_id]
        if rounded:  # the values the impl actually saw
            seq = [t.to(self.dtype) for t in seq]
        full = self.oracle(*seq, rounded=rounded)
        return full[request.context_len : request.context_len + request.query_len]


class MLAScenario(Scenario):
    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__(seed, dtype)
        self.weight_fp32 = self.randn(H * (NOPE + V), L) / L**0.5
        self.weight = self.weight_fp32.to(dtype)
        self.scale = (NOPE + ROPE) ** -0.5
        self.impl = MLAAttentionImpl(
            num_heads=H,
            qk_nope_head_dim=NOPE,
            qk_rope_head_dim=ROPE,
            v_head_dim=V,
            kv_lora_rank=L,
            kv_b_proj_weight=self.weight,
            softmax_scale=self.scale,
        )
        self.out_shape = (H, V)

    def new_sequence(self, n):
        return [self.randn(n, H, NOPE + ROPE), self.randn(n, L), self.randn(n, ROPE)]

    def forward(self, q, kv_c, k_pe, spec):
        return self.impl.forward(q, kv_c, k_pe.unsqueeze(1), spec)  # vLLM's [T, 1, rope]

    def oracle(self, q, kv_c, k_pe, rounded=False):
        return mla_oracle(q, kv_c, k_pe, self.weight if rounded else self.weight_fp32, self.scale)


class GQAScenario(Scenario):
    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__(seed, dtype)
        self.scale = GD**-0.5
        self.impl = AttentionImpl(
            num_heads=GH, num_kv_heads=GKV, head_dim=GD, v_head_dim=GDV, softmax_scale=self.scale
        )
        self.out_shape = (GH, GDV)

    def new_sequence(self, n):
        return [self.randn(n, GH, GD), self.randn(n, GKV, GD), self.randn(n, GKV, GDV)]

    def forward(self, q, k, v, spec):
        return self.impl.forward(q, k, v, spec)

    def oracle(self, q, k, v, rounded=False):
        return gqa_oracle(q, k, v, self.scale)


SCENARIOS = {"mla": MLAScenario, "gqa": GQAScenario}

# (step name, spec, expected kind): one impl runs them in order.
STEPS = [
    ("prefill x3", BatchSpec.from_lens([5, 3, 7], request_ids=["a", "b", "c"]), "prefill"),
    ("decode x3", BatchSpec.from_lens([1, 1, 1], [5, 3, 7], ["a", "b", "c"]), "decode"),
    ("2 decodes + new prefill", BatchSpec.from_lens([1, 1, 4], [6, 4, 0], ["a", "b", "d"]), "mixed"),
    ("first chunks", BatchSpec.from_lens([7, 4], [0, 0], ["e", "f"]), "prefill"),
    ("second chunk + new prefill", BatchSpec.from_lens([5, 3], [7, 0], ["e", "g"]), "chunked"),
    ("decodes + chunked prefill", BatchSpec.from_lens([1, 1, 6], [12, 7, 4], ["e", "a", "f"]), "mixed"),
]


def _check_batch(scen: Scenario, spec: BatchSpec, out: torch.Tensor, *, rounded=False, tol=TOL, what=""):
    assert out.dtype == torch.float32
    assert tuple(out.shape) == (spec.num_tokens, *scen.out_shape)
    locs = spec.query_start_loc()
    for r, start, end in zip(spec.requests, locs[:-1], locs[1:]):
        torch.testing.assert_close(
            out[start:end].double(),
            scen.expected(r, rounded=rounded),
            **tol,
            msg=lambda m: f"{what}: request {r.request_id} ({r}): {m}",
        )


@pytest.mark.parametrize("kind", SCENARIOS)
def test_batch_sequence_matches_full_sequence_oracle(kind):
    scen = SCENARIOS[kind](seed=1)
    for name, spec, expected_kind in STEPS:
        assert spec.kind == expected_kind, name
        out = scen.run(spec)
        _check_batch(scen, spec, out, what=name)
        for r in spec.requests:
            assert scen.impl.cache_len(r.request_id) == r.context_len + r.query_len, name


@pytest.mark.parametrize("kind", SCENARIOS)
def test_bf16_inputs_stay_close_to_oracle(kind):
    scen = SCENARIOS[kind](seed=2, dtype=torch.bfloat16)
    for name, spec, _ in STEPS:
        out = scen.run(spec)
        # Loose against the float32 sequences, tight against the bf16-rounded
        # values the runtime saw (its math is float32, its cache bf16-exact).
        _check_batch(scen, spec, out, tol=BF16_TOL, what=f"{name} (vs fp32)")
        _check_batch(scen, spec, out, rounded=True, what=f"{name} (vs rounded)")


def test_mla_decode_equals_expanded_prefill():
    a, b = MLAScenario(seed=3), MLAScenario(seed=3)
    a.run(BatchSpec.from_lens([6]))
    dec = a.run(BatchSpec.from_lens([1], [6]))
    b.seqs = a.seqs  # same sequence
    full = b.run(BatchSpec.from_lens([7]))  # token 6 via the expanded causal path
    torch.testing.assert_close(dec[0], full[6], **TOL)


def test_mla_decode_uses_absorbed_form(monkeypatch):
    scen = MLAScenario(seed=4)
    scen.run(BatchSpec.from_lens([4, 5]))

    def no_expand(*args, **kwargs):
        raise AssertionError("decode expanded the latent cache through kv_b_proj")

    monkeypatch.setattr(scen.impl, "expand", no_expand)
    spec = BatchSpec.from_lens([1, 1], [4, 5])
    _check_batch(scen, spec, scen.run(spec), what="decode")
    with pytest.raises(AssertionError, match="expanded"):
        scen.run(BatchSpec.from_lens([2], [6], ["r1"]))  # a chunked prefill does expand


def test_mla_k_pe_2d_and_3d_agree():
    scen = MLAScenario(seed=5)
    spec = BatchSpec.from_lens([3, 2])
    q, kv_c, k_pe = scen.inputs(spec)
    out3 = scen.impl.forward(q, kv_c, k_pe.unsqueeze(1), spec)
    out2 = scen.impl.forward(q, kv_c, k_pe, spec)  # context_len 0: fresh entries
    torch.testing.assert_close(out2, out3, rtol=0, atol=0)


def test_mla_shares_kv_b_proj_parameter():
    scen = MLAScenario(seed=6)
    lin = torch.nn.Linear(L, H * (NOPE + V), bias=False)
    impl = MLAAttentionImpl(
        num_heads=H, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
        kv_lora_rank=L, kv_b_proj_weight=lin.weight, softmax_scale=scen.scale,
    )
    assert impl.kv_b_proj_weight is lin.weight
    with torch.no_grad():
        lin.weight.copy_(scen.weight_fp32)  # the module updates its parameter in place
    scen.impl = impl
    spec = BatchSpec.from_lens([4])
    _check_batch(scen, spec, scen.run(spec))


def test_mla_config_and_shape_validation():
    scen = MLAScenario(seed=7)
    with pytest.raises(ValueError, match="kv_b_proj_weight"):
        MLAAttentionImpl(
            num_heads=H, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
            kv_lora_rank=L, kv_b_proj_weight=torch.zeros(H * NOPE, L), softmax_scale=1.0,
        )
    spec = BatchSpec.from_lens([3])
    q, kv_c, k_pe = scen.inputs(spec)
    with pytest.raises(ValueError, match=r"q must have shape .*\[3, 4, 24\]"):
        scen.impl.forward(q[:, :, :NOPE], kv_c, k_pe, spec)
    with pytest.raises(ValueError, match="kv_c_normed"):
        scen.impl.forward(q, kv_c[:2], k_pe, spec)
    with pytest.raises(ValueError, match="k_pe"):
        scen.impl.forward(q, kv_c, k_pe[:, :4], spec)
    with pytest.raises(ValueError, match="q must have shape"):  # spec says 4 tokens
        scen.impl.forward(q, kv_c, k_pe, BatchSpec.from_lens([4]))


def test_gqa_config_and_shape_validation():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        AttentionImpl(num_heads=4, num_kv_heads=3, head_dim=8, softmax_scale=1.0)
    impl = AttentionImpl(num_heads=4, num_kv_heads=2, head_dim=8, softmax_scale=1.0)
    assert impl.v_head_dim == 8
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    spec = BatchSpec.from_lens([3])
    with pytest.raises(ValueError, match=r"k must have shape \[3, 2, 8\]"):
        impl.forward(q, k[:, :1], v, spec)
    with pytest.raises(ValueError, match="v must have shape"):
        impl.forward(q, k, v[:2], spec)
    assert impl.forward(q, k, v, spec).shape == (3, 4, 8)


@pytest.mark.parametrize("kind", SCENARIOS)
def test_cache_does_not_alias_inputs(kind):
    scen = SCENARIOS[kind](seed=13)
    spec = BatchSpec.from_lens([4, 3])
    inputs = scen.inputs(spec)
    scen.forward(*inputs, spec)
    for t in inputs:  # the caller reuses its buffers, as vLLM does
        t.fill_(1e4)
    spec = BatchSpec.from_lens([1, 1], [4, 3])
    _check_batch(scen, spec, scen.run(spec))


@pytest.mark.parametrize("kind", SCENARIOS)
def test_cache_length_checks(kind):
    scen = SCENARIOS[kind](seed=8)
    scen.run(BatchSpec.from_lens([3, 2], request_ids=["r0", "r1"]))
    with pytest.raises(ValueError, match="request r0: batch says context_len=5 but the cache holds 3 tokens"):
        scen.run(BatchSpec.from_lens([1], [5], ["r0"]))
    # r0 is valid but r9 has no cache: nothing may change.
    with pytest.raises(ValueError, match="request r9: batch says context_len=2 but the cache holds 0 tokens"):
        scen.run(BatchSpec.from_lens([1, 1], [3, 2], ["r0", "r9"]))
    assert scen.impl.cache_len("r0") == 3 and scen.impl.cache_len("r9") == 0
    # context_len 0 starts over.
    scen.seqs.pop("r0")
    spec = BatchSpec.from_lens([2], request_ids=["r0"])
    _check_batch(scen, spec, scen.run(spec))
    assert scen.impl.cache_len("r0") == 2
    scen.impl.clear_cache()
    assert scen.impl.cache_len("r0") == 0 and scen.impl.cache_len("r1") == 0
    with pytest.raises(ValueError, match="cache holds 0 tokens"):
        scen.run(BatchSpec.from_lens([1], [2], ["r1"]))


# ---------------------------------------------------------------------------
# Batch metadata
# ---------------------------------------------------------------------------


def test_spec_values():
    spec = BatchSpec.from_lens([1, 1, 3, 2], [4, 0, 0, 5])
    assert [r.request_id for r in spec.requests] == ["r0", "r1", "r2", "r3"]
    assert spec.num_tokens == 7
    assert (spec.num_decodes, spec.num_decode_tokens, spec.num_prefills) == (2, 2, 2)
    assert spec.has_chunked_prefill
    assert spec.query_start_loc() == [0, 1, 2, 5, 7]
    pos = spec.positions()
    assert pos.dtype == torch.int64
    assert pos.tolist() == [4, 0, 0, 1, 2, 5, 6]
    assert spec.dcp_world_size == 1
    assert BatchSpec.from_lens([2], dcp_world_size=2).dcp_world_size == 2
    r = RequestSpec("x", 1, 9)
    assert r.is_decode and not r.is_chunked_prefill
    r = RequestSpec("x", 2, 9)
    assert not r.is_decode and r.is_chunked_prefill
    assert not RequestSpec("x", 2).is_chunked_prefill


@pytest.mark.parametrize(
    "query_lens, context_lens, kind",
    [
        ([3, 2], [0, 0], "prefill"),
        ([1, 1], [3, 0], "decode"),
        ([1, 4], [3, 0], "mixed"),
        ([1, 4], [3, 2], "mixed"),
        ([4, 2], [0, 6], "chunked"),
        ([4], [6], "chunked"),
    ],
)
def test_spec_kind(query_lens, context_lens, kind):
    assert BatchSpec.from_lens(query_lens, context_lens).kind == kind


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: BatchSpec.from_lens([3, 1]), "decode request 'r1' comes after prefill request 'r0'"),
        (lambda: BatchSpec.from_lens([1, 2], request_ids=["x", "x"]), "duplicate request_id 'x'"),
        (lambda: BatchSpec(()), "must not be empty"),
        (lambda: RequestSpec("r", 0), "query_len must be >= 1"),
        (lambda: RequestSpec("r", 2, -1), "context_len must be >= 0"),
        (lambda: RequestSpec("r", 2.0), "query_len must be an int"),
        (lambda: RequestSpec("r", True), "query_len must be an int"),
        (lambda: RequestSpec("r", 2, "3"), "context_len must be an int"),
        (lambda: RequestSpec("", 2), "request_id"),
        (lambda: BatchSpec.from_lens([2, 3], [0]), "context_lens"),
        (lambda: BatchSpec.from_lens([2], dcp_world_size=0), "dcp_world_size"),
    ],
)
def test_spec_validation(build, match):
    with pytest.raises(ValueError, match=match):
        build()


# ---------------------------------------------------------------------------
# Forward context
# ---------------------------------------------------------------------------


def test_current_batch_without_batch_raises():
    with pytest.raises(RuntimeError, match=r"no batch is set.*fusion_pass\.runtime\.batch\(spec\)"):
        current_batch()


def test_batch_nests_and_restores():
    outer, inner = BatchSpec.from_lens([2]), BatchSpec.from_lens([1])
    with batch(outer) as got:
        assert got is outer and current_batch() is outer
        with batch(inner):
            assert current_batch() is inner
        assert current_batch() is outer
        with pytest.raises(KeyError):
            with batch(inner):
                raise KeyError("boom")
        assert current_batch() is outer
    with pytest.raises(RuntimeError):
        current_batch()


def test_batch_is_thread_local():
    seen = []

    def worker():
        try:
            current_batch()
            seen.append("visible")
        except RuntimeError:
            seen.append("not set")

    with batch(BatchSpec.from_lens([2])):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert seen == ["not set"]


# ---------------------------------------------------------------------------
# Layer registry
# ---------------------------------------------------------------------------


@pytest.fixture
def layer_names():
    names = ["test_runtime.layer0", "test_runtime.layer1"]
    yield names
    for n in names:
        if n in registered_layers():
            unregister_layer(n)


def test_registry(layer_names):
    n0, n1 = layer_names
    impl0 = MLAScenario(seed=9).impl
    impl1 = GQAScenario(seed=9).impl
    register_layer(n0, impl0)
    register_layer(n0, impl0)  # same object: fine
    with pytest.raises(ValueError, match=n0):
        register_layer(n0, impl1)
    register_layer(n1, impl1)
    assert get_layer(n0) is impl0 and get_layer(n1) is impl1
    with pytest.raises(KeyError, match=r"'missing'.*test_runtime\.layer0"):
        get_layer("missing")
    layers = registered_layers()
    layers.pop(n0)
    assert get_layer(n0) is impl0  # a copy was returned
    unregister_layer(n0)
    with pytest.raises(KeyError):
        get_layer(n0)
    with pytest.raises(KeyError):
        unregister_layer(n0)


def test_clear_kv_caches(layer_names):
    mla, gqa = MLAScenario(seed=10), GQAScenario(seed=10)
    spec = BatchSpec.from_lens([3])
    mla.run(spec)
    gqa.run(spec)
    register_layer(layer_names[0], mla.impl)
    register_layer(layer_names[1], gqa.impl)
    assert mla.impl.cache_len("r0") == 3 and gqa.impl.cache_len("r0") == 3
    clear_kv_caches()
    assert mla.impl.cache_len("r0") == 0 and gqa.impl.cache_len("r0") == 0


# ---------------------------------------------------------------------------
# Dense primitives
# ---------------------------------------------------------------------------


def _sdpa_reference(q, k, v, scale, causal, q_offset):
    """float64 SDPA with kv heads repeated; returns out [Tq,H,Dv], lse [Tq,H]."""
    h = q.shape[1]
    k = k.repeat_interleave(h // k.shape[1], dim=1)
    v = v.repeat_interleave(h // v.shape[1], dim=1)
    mask = None
    if causal:
        mask = torch.arange(k.shape[0])[None, :] <= torch.arange(q.shape[0])[:, None] + q_offset
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    ).transpose(0, 1)
    scores = torch.einsum("qhd,khd->qhk", q, k) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    return out, torch.logsumexp(scores, dim=-1)


@pytest.mark.parametrize(
    "tq, tk, h, hkv, causal, q_offset",
    [
        (6, 6, 4, 4, True, 0),
        (6, 6, 4, 2, False, 0),
        (3, 9, 4, 1, True, 6),
        (5, 7, 6, 3, True, 2),
    ],
)
def test_attention_with_lse_matches_sdpa(tq, tk, h, hkv, causal, q_offset):
    g = torch.Generator().manual_seed(11)
    q = torch.randn(tq, h, 8, generator=g, dtype=torch.float64)
    k = torch.randn(tk, hkv, 8, generator=g, dtype=torch.float64)
    v = torch.randn(tk, hkv, 5, generator=g, dtype=torch.float64)
    ref_out, ref_lse = _sdpa_reference(q, k, v, 0.4, causal, q_offset)
    out, lse = dense_attention(q.float(), k.float(), v.float(), scale=0.4, causal=causal, q_offset=q_offset)
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == (tq, h, 5) and lse.shape == (tq, h)
    torch.testing.assert_close(out.double(), ref_out, **TOL)
    torch.testing.assert_close(lse.double(), ref_lse, **TOL)


def test_attention_with_lse_rows_without_keys():
    q, k, v = torch.randn(4, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 5)
    out, lse = dense_attention(q, k, v, scale=1.0, causal=True, q_offset=-2)
    # rows 0, 1 (positions -2, -1) see nothing; rows 2, 3 see keys 0 and 0..1.
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[:2] == 0).all() and torch.isneginf(lse[:2]).all()
    assert torch.isfinite(lse[2:]).all()
    out, lse = dense_attention(q, k[:0], v[:0], scale=1.0, causal=False)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_attention_with_lse_head_validation():
    with pytest.raises(ValueError, match="does not divide"):
        dense_attention(torch.randn(2, 4, 8), torch.randn(2, 3, 8), torch.randn(2, 3, 8), scale=1.0, causal=False)


@pytest.mark.parametrize("causal", [False, True])
def test_merge_attention_of_two_halves_equals_whole(causal):
    g = torch.Generator().manual_seed(12)
    q = torch.randn(4, 4, 8, generator=g)
    k = torch.randn(8, 2, 8, generator=g)
    v = torch.randn(8, 2, 5, generator=g)
    off, m = 4, 6  # queries at positions 4..7; the second half has rows with no visible key
    whole = dense_attention(q, k, v, scale=0.5, causal=causal, q_offset=off)
    a = dense_attention(q, k[:m], v[:m], scale=0.5, causal=causal, q_offset=off)
    b = dense_attention(q, k[m:], v[m:], scale=0.5, causal=causal, q_offset=off - m)
    if causal:
        assert torch.isneginf(b[1][:2]).all()
    out, lse = merge_attention(*a, *b)
    torch.testing.assert_close(out, whole[0], **TOL)
    torch.testing.assert_close(lse, whole[1], **TOL)
    out, lse = merge_attention(*b, *a)  # symmetric
    torch.testing.assert_close(out, whole[0], **TOL)


def test_merge_attention_both_empty():
    out = torch.zeros(2, 3, 4)
    lse = torch.full((2, 3), float("-inf"))
    m_out, m_lse = merge_attention(out, lse, out, lse)
    assert (m_out == 0).all() and torch.isneginf(m_lse).all()


# ---------------------------------------------------------------------------
# Non-finite values: masked keys contribute nothing, visible ones propagate
# ---------------------------------------------------------------------------


def _plain_attention(q, k, v, scale, causal, q_offset=0):
    """dense_attention's formula with P @ V over every key (masked ones with probability 0): what it computed
    before masked non-finite values were left out."""
    tq, h, d = q.shape
    tk, hk, _ = k.shape
    hv = v.shape[1]
    scores = torch.einsum("qkgd,tkd->kgqt", q.float().reshape(tq, hk, h // hk, d), k.float()).reshape(h, tq, tk)
    scores = scores * scale
    if causal:
        hidden = torch.arange(tk).unsqueeze(0) > torch.arange(tq).unsqueeze(1) + q_offset
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("vgqt,tvd->qvgd", probs.reshape(hv, h // hv, tq, tk), v.float())
    return out.reshape(tq, h, v.shape[2])


def _same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _visible_only(q, k, v, scale, q_offset):
    """Causal attention row by row over the keys each row sees (no masked key at all): the plain product's
    IEEE combination of exactly the visible values."""
    rows = [_plain_attention(q[i:i + 1], k[:i + q_offset + 1], v[:i + q_offset + 1], scale, False)
            for i in range(q.shape[0])]
    return torch.cat(rows)


NONFINITE = {
    "nan": [(5, 0, 1, float("nan"))],
    "+inf": [(5, 1, 2, float("inf"))],
    "-inf": [(4, 0, 0, float("-inf"))],
    "+inf and -inf in one column": [(4, 1, 3, float("inf")), (6, 1, 3, float("-inf"))],
    "nan and inf": [(3, 0, 2, float("nan")), (6, 0, 2, float("inf")), (7, 1, 4, float("-inf"))],
}


@pytest.mark.parametrize("case", NONFINITE)
@pytest.mark.parametrize("q_offset", [0, 2])
def test_masked_non_finite_values_do_not_reach_earlier_rows(case, q_offset):
    """A NaN / Inf in a later token's value leaves the rows that do not see it exactly as with a finite value
    there; the rows that see it get exactly what the plain P @ V gives (NaN, +-Inf, NaN for +Inf beside -Inf)."""
    g = torch.Generator().manual_seed(21)
    tq, tk = 8 - q_offset, 8
    q, k, v = torch.randn(tq, 4, 8, generator=g), torch.randn(tk, 2, 8, generator=g), torch.randn(tk, 2, 5, generator=g)
    v_bad, v_fin = v.clone(), v.clone()
    for t, head, col, value in NONFINITE[case]:
        v_bad[t, head, col], v_fin[t, head, col] = value, 123.0
    first = min(t for t, *_ in NONFINITE[case])  # the first key holding one; query i sees keys <= i + q_offset
    blind = first - q_offset  # rows [0, blind) see none
    out, lse = dense_attention(q, k, v_bad, scale=0.4, causal=True, q_offset=q_offset)
    want, want_lse = dense_attention(q, k, v_fin, scale=0.4, causal=True, q_offset=q_offset)
    plain = _plain_attention(q, k, v_bad, 0.4, True, q_offset)
    assert bool(plain[:blind].isnan().any()), "the plain product lets the masked value in: the test tells them apart"
    assert torch.equal(out[:blind], want[:blind]) and torch.isfinite(out[:blind]).all()
    visible = _visible_only(q, k, v_bad, 0.4, q_offset)
    # finite where the visible values are, and then exactly the finite-value result; else their IEEE combination
    _same(out, torch.where(torch.isfinite(visible), want, visible))
    assert not torch.isfinite(out[blind:]).all()
    assert torch.equal(lse, want_lse)
    if case == "+inf and -inf in one column":  # rows seeing only +inf: +inf; both: NaN
        assert bool(torch.isposinf(out[4 - q_offset:6 - q_offset, 2:4, 3]).all())
        assert bool(out[6 - q_offset:, 2:4, 3].isnan().all())


def test_non_finite_values_of_visible_keys_propagate_as_before():
    """Without a masked key (non-causal, a decode row) nothing changes; an Inf whose probability underflows to 0
    still makes NaN (0 * Inf), as in the plain product."""
    g = torch.Generator().manual_seed(22)
    q, k, v = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 4, generator=g)
    v[2, 0, 1], v[3, 1, 0] = float("nan"), float("-inf")
    _same(dense_attention(q, k, v, scale=0.4, causal=False)[0], _plain_attention(q, k, v, 0.4, False))
    _same(dense_attention(q[4:], k, v, scale=0.4, causal=True, q_offset=4)[0],
          _plain_attention(q[4:], k, v, 0.4, True, 4))
    # key 1 scores far below key 0 for every query: its probability underflows to exactly 0
    k2 = torch.zeros(3, 1, 8)
    k2[0, 0, 0], k2[1, 0, 0] = 100.0, -100.0
    q2 = torch.zeros(3, 1, 8)
    q2[:, 0, 0] = 1.0
    v2 = torch.ones(3, 1, 2)
    v2[1, 0, 0], v2[2, 0, 1] = float("inf"), float("nan")
    out = dense_attention(q2, k2, v2, scale=1.0, causal=True)[0]
    _same(out, _visible_only(q2, k2, v2, 1.0, 0))
    assert out[0].tolist() == [[1.0, 1.0]]  # sees key 0 only
    assert out[1, 0, 0].isnan() and out[1, 0, 1] == 1.0  # 0 * inf
    assert out[2].isnan().all()


@pytest.mark.parametrize("kind", SCENARIOS)
def test_a_nan_in_a_later_tokens_value_leaves_earlier_rows_of_the_runtime_alone(kind):
    """Through the runtimes (a prefill, then a chunk after it): rows before the NaN token equal those of the same
    batch with a finite value there, byte for byte; the rows at and after it are NaN where they read it."""
    outs = []
    for poison in (float("nan"), 0.5):
        scen = SCENARIOS[kind](seed=7)
        first = BatchSpec.from_lens([6, 5], request_ids=["a", "b"])
        inputs = scen.inputs(first)
        value = inputs[2] if kind == "gqa" else inputs[1]  # v, or the latent kv_c (k and v of MLA)
        value[3] = poison  # request a, token 3
        outs.append([scen.forward(*inputs, first)])
        chunk = BatchSpec.from_lens([4], [6], request_ids=["a"])  # the NaN is in the cached context now
        outs[-1].append(scen.forward(*scen.inputs(chunk), chunk))
    (bad, bad_chunk), (good, good_chunk) = outs
    assert torch.equal(bad[:3], good[:3]), "rows before the NaN token"
    assert torch.equal(bad[6:], good[6:]), "another request"
    assert bool(bad[3:6].isnan().any()) and not bool(good.isnan().any())
    assert bool(bad_chunk.isnan().any()) and not bool(good_chunk.isnan().any())
