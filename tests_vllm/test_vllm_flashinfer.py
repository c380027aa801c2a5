"""The FLASHINFER adapter (fusion_pass/vllm/adapters/flashinfer.py) without CUDA or FlashInfer: stand-ins of vLLM's
FlashInfer metadata (``FlashInferMetadata`` with its ``FIPrefill`` / ``FIDecode`` / ``FlashInferTrtllmAPIDecode``
parts, vLLM 0.32-0.34 field names), of its metadata builder (decode requests first, cut by vLLM's own
``split_decodes_and_prefills``; ``build`` wrapped by the host-rows hook), of FlashInfer's planned wrappers and
trtllm-gen decode call (reference attention over the paged cache), and of ``FlashInferImpl.forward`` (the prefill
launch on rows ``[D, n)``, then the decode launch on rows ``[0, D)``, with the statements of vLLM's own ``forward``
that the adapter relies on). The unfused path the tests compare against is that ``forward`` on the whole batch
(prefill wrapper + decode wrapper) followed by the quant op, as vLLM's unfused graph runs them.

Not run: FlashInfer's kernels, vLLM's CUDA build (only the installed wheel's source is read)."""

import ast
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

import fusion_pass.ops  # noqa: F401  (torch.ops.fusion_pass.scaled_fp4_quant, the unfused graph's quant op on CPU)
from fusion_pass import nvfp4
from fusion_pass.runtime import backends, settings
from fusion_pass.vllm.adapters import flashinfer, host_rows, registry
from fusion_pass.vllm.compile import layer_check
from fusion_pass.vllm.runtime import fused_standard, guard
from standard_batches import GS, HK, D, H, K, StandInLayer, buffers, reference_prefill, row_scale_bytes

BLOCK = 16
FI = registry.ADAPTERS["FLASHINFER"]
LAYOUTS = {"HND": (0, 1, 2, 3), "NHD": (0, 2, 1, 3)}  # KVCacheLayout.LBHNC / LBNHC .layer_view_order


# --- stand-ins of vLLM's FlashInfer metadata (class names as vLLM's: the adapter reads them by name) -------------

@dataclass
class FIPrefill:
    wrapper: object


@dataclass
class FIDecode:
    wrapper: object


@dataclass
class FlashInferTrtllmAPIDecode:
    kernel: object
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int
    q_len_per_req: int = 1
    q_cu_seq_lens: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    dcp_query_start_loc: torch.Tensor | None = None


@dataclass
class FlashInferMetadata:
    kv_cache_layout: object
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    q_data_type_prefill: torch.dtype
    q_data_type_decode: torch.dtype
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    causal: bool
    prefill: object = None
    decode: object = None


TRTLLM_GEN = SimpleNamespace(value="trtllm-gen")  # FlashInferDecodeKernel.TRTLLM_GEN


def paged_attention(q, keys, values, scale):
    """float32 attention of ``q [lq, H, D]`` over ``keys``/``values [S, Hk, D]`` (causal, aligned to the end),
    in the query dtype: what the stand-in FlashInfer launches compute."""
    lq, s = q.shape[0], keys.shape[0]
    kk = keys.float().repeat_interleave(H // HK, dim=1)
    vv = values.float().repeat_interleave(H // HK, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale
    mask = torch.ones(lq, s, dtype=torch.bool).tril(s - lq)
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), vv).to(q.dtype)


def read_pages(kv_tuple, kv_layout, pages, length):
    """Keys and values ``[length, Hk, D]`` of one request from FlashInfer's paged view (``kv_cache.permute(
    *layer_view_order).split(D, -1)``: HND pages ``[B, Hk, N, D]`` or NHD pages ``[B, N, Hk, D]``)."""
    positions = torch.arange(length)
    blocks, offsets = pages[positions // BLOCK].long(), positions % BLOCK
    out = []
    for part in kv_tuple:
        out.append(part[blocks, :, offsets] if kv_layout == "HND" else part[blocks, offsets])
    return out


class Wrapper:
    """A planned FlashInfer wrapper (``BatchDecodeWithPagedKVCacheWrapper`` / ``BatchPrefillWithPagedKVCacheWrapper``):
    pages and lengths of its requests from ``plan``; ``run`` writes each request's rows. Records the query rows of
    every ``run``."""

    def __init__(self, kv_layout, sm_scale):
        self.kv_layout, self._sm_scale, self._window_left, self._logits_soft_cap = kv_layout, sm_scale, -1, 0.0
        self.runs = []

    def plan(self, qo_indptr, pages, kv_lens):
        self.qo_indptr, self.pages, self.kv_lens = qo_indptr.tolist(), pages, kv_lens.tolist()

    def run(self, q, kv_cache, q_scale=1.0, k_scale=1.0, v_scale=1.0, out=None, kv_cache_sf=None, sinks=None):
        self.runs.append(q.shape[0])
        assert q.shape[0] == self.qo_indptr[-1] and (q_scale, k_scale, v_scale, kv_cache_sf, sinks) == (1.0,) * 3 + (
            None, None)
        for i, (a, b) in enumerate(zip(self.qo_indptr[:-1], self.qo_indptr[1:])):
            keys, values = read_pages(kv_cache, self.kv_layout, self.pages[i], self.kv_lens[i])
            out[a:b] = paged_attention(q[a:b], keys, values, self._sm_scale)
        return out


TRTLLM_CALLS = []


def trtllm_batch_decode_with_kv_cache(query, kv_cache, block_tables, seq_lens, max_seq_len, bmm1_scale, out,
                                      kv_layout, **kwargs):
    """FlashInfer's trtllm-gen decode, stood in for: one query row per request."""
    TRTLLM_CALLS.append(query.shape[0])
    assert query.is_contiguous() and query.shape[0] == block_tables.shape[0] == seq_lens.shape[0]
    for i in range(query.shape[0]):
        keys, values = read_pages(kv_cache, kv_layout, block_tables[i], int(seq_lens[i]))
        out[i:i + 1] = paged_attention(query[i:i + 1], keys, values, bmm1_scale)


class FlashInferImpl:
    """``FlashInferImpl.forward`` in miniature: the statements of vLLM's (0.32-0.34) that gate and slice the two
    phases (``flashinfer.FORWARD_DECODE_SPLIT``), the prefill wrapper on rows ``[D, n)``, then the decode wrapper or
    trtllm-gen decode on rows ``[0, D)``."""

    head_size, scale, num_heads, num_kv_heads = D, D ** -0.5, H, HK
    sliding_window, alibi_slopes, sinks, logits_soft_cap = None, None, None, None
    window_left = -1

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        num_actual_tokens = attn_metadata.num_actual_tokens
        kv_cache_layout = attn_metadata.kv_cache_layout
        query_padded = query
        query = query[:num_actual_tokens]
        output_padded = output
        output = output[:num_actual_tokens]
        num_decode_tokens = attn_metadata.num_decode_tokens
        num_prefill_tokens = attn_metadata.num_prefill_tokens
        stride_order = kv_cache_layout.layer_view_order
        kv_cache_tuple = kv_cache.permute(*stride_order).split(self.head_size, dim=-1)
        if num_prefill_tokens > 0:
            prefill_query = query[num_decode_tokens:]
            assert prefill_query.shape[0] == num_prefill_tokens
            attn_metadata.prefill.wrapper.run(prefill_query, kv_cache_tuple, q_scale=layer._q_scale_float,
                                              k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
                                              out=output[num_decode_tokens:], kv_cache_sf=None)
        if num_decode_tokens > 0:
            decode_query_tokens = num_decode_tokens
            decode_query = query_padded[:decode_query_tokens]
            if isinstance(attn_metadata.decode, FIDecode):
                attn_metadata.decode.wrapper.run(decode_query, kv_cache_tuple, q_scale=layer._q_scale_float,
                                                 k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
                                                 out=output[:num_decode_tokens], kv_cache_sf=None, sinks=self.sinks)
            else:
                trtllm_batch_decode_with_kv_cache(
                    query=decode_query.contiguous(), kv_cache=kv_cache_tuple,
                    block_tables=attn_metadata.decode.block_tables, seq_lens=attn_metadata.decode.seq_lens,
                    max_seq_len=attn_metadata.decode.max_seq_len, bmm1_scale=self.scale,
                    out=output[:num_decode_tokens], kv_layout=kv_cache_layout.name)
        return output_padded


class FlashInferMetadataBuilder:
    """``FlashInferMetadataBuilder.build`` in miniature: decode requests first (vLLM's ``split_decodes_and_prefills``,
    threshold 1, uniform decodes as with trtllm-gen), the decode part planned for the decode requests alone, the
    prefill part for the rest."""

    reorder_batch_threshold = 1

    def __init__(self, kv_layout: str, decode_kind: str):
        self.kv_layout, self.decode_kind = kv_layout, decode_kind

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        c = common_attn_metadata
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(
            c, decode_threshold=self.reorder_batch_threshold, require_uniform=True)
        layout = SimpleNamespace(name=self.kv_layout, layer_view_order=LAYOUTS[self.kv_layout])
        md = FlashInferMetadata(layout, c.num_actual_tokens, c.slot_mapping, torch.bfloat16, torch.bfloat16,
                                num_decodes, num_decode_tokens, num_prefills, num_prefill_tokens, c.causal)
        qo, seq_lens, table = c.query_start_loc_cpu, c.seq_lens_cpu_upper_bound, c.block_table_tensor
        if num_prefills:
            wrapper = Wrapper(self.kv_layout, D ** -0.5)
            wrapper.plan(qo[num_decodes:] - qo[num_decodes], table[num_decodes:], seq_lens[num_decodes:])
            md.prefill = FIPrefill(wrapper)
        if num_decodes:
            if self.decode_kind == "FIDecode":
                wrapper = Wrapper(self.kv_layout, D ** -0.5)
                wrapper.plan(torch.arange(num_decodes + 1), table[:num_decodes], seq_lens[:num_decodes])
                md.decode = FIDecode(wrapper)
            else:
                md.decode = FlashInferTrtllmAPIDecode(TRTLLM_GEN, table[:num_decodes], c.seq_lens[:num_decodes],
                                                      int(c.max_seq_len))
        return md


assert host_rows.install_build_hook(FlashInferMetadataBuilder)  # what install_host_hooks does to vLLM's builder


def flashinfer_layer():
    layer = StandInLayer(BLOCK, backend="FLASHINFER")
    layer.impl = FlashInferImpl()
    layer._q_scale_float = 1.0
    return layer


def fi_batch(requests, kv_layout="HND", decode_kind="FIDecode", seed=0, cache_dtype=torch.bfloat16):
    """``requests``: ``(query_len, context_len)`` per request, in vLLM's (reordered) request order. A paged cache of
    page size 16 in FlashInfer's per-layer view ``[num_blocks, Hk, 16, 2 * D]`` (physically HND or NHD), blocks
    shuffled, every position written as vLLM's cache write writes it (``kv_cache.transpose(1, 2).split(D, -1)``).
    Returns ``(layer, (q, k, v), md, kv_cache, full)``; ``md`` built by the hooked builder."""
    g = torch.Generator().manual_seed(seed)
    layer = flashinfer_layer()
    blocks_per = [-(-(q + c) // BLOCK) for q, c in requests]
    num_blocks = sum(blocks_per) + 3
    order = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(requests), max(blocks_per), dtype=torch.int32)
    physical = torch.zeros(num_blocks, *((HK, BLOCK) if kv_layout == "HND" else (BLOCK, HK)), 2 * D,
                           dtype=torch.bfloat16)
    kv_cache = physical if kv_layout == "HND" else physical.permute(0, 2, 1, 3)
    k_cache, v_cache = kv_cache.transpose(1, 2).split(D, dim=-1)
    used, full, qs, ks, vs, slots = 0, [], [], [], [], []
    for i, (lq, lc) in enumerate(requests):
        table[i, : blocks_per[i]] = order[used:used + blocks_per[i]]
        used += blocks_per[i]
        keys = torch.randn(lc + lq, HK, D, generator=g).to(torch.bfloat16)
        values = torch.randn(lc + lq, HK, D, generator=g).to(torch.bfloat16)
        positions = torch.arange(lc + lq)
        blocks = table[i, positions // BLOCK].long()
        k_cache[blocks, positions % BLOCK] = keys
        v_cache[blocks, positions % BLOCK] = values
        full.append((keys, values))
        qs.append(torch.randn(lq, H, D, generator=g).to(torch.bfloat16))
        ks.append(keys[lc:])
        vs.append(values[lc:])
        slots.append(blocks[lc:] * BLOCK + positions[lc:] % BLOCK)
    query_lens = [lq for lq, _ in requests]
    loc = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([lq + lc for lq, lc in requests], dtype=torch.int32)
    common = SimpleNamespace(num_reqs=len(requests), num_actual_tokens=int(loc[-1]), max_query_len=max(query_lens),
                             query_start_loc=loc.clone(), query_start_loc_cpu=loc, seq_lens=seq_lens.clone(),
                             seq_lens_cpu_upper_bound=seq_lens, max_seq_len=int(seq_lens.max()),
                             block_table_tensor=table, slot_mapping=torch.cat(slots), causal=True)
    md = FlashInferMetadataBuilder(kv_layout, decode_kind).build(0, common)
    if cache_dtype != torch.bfloat16:
        kv_cache = kv_cache.to(cache_dtype)
    return layer, (torch.cat(qs), torch.cat(ks), torch.cat(vs)), md, kv_cache, full


def unfused_attention(layer, inputs, md, kv_cache):
    """vLLM's op on the whole batch as the unfused graph runs it: ``FlashInferImpl.forward`` (prefill wrapper on the
    prefill rows, decode launch on the decode rows) into a query-dtype output ``[n, H * D]``."""
    q, k, v = inputs
    out = torch.empty_like(q)
    layer.impl.forward(layer, q, k, v, kv_cache, md, output=out)
    return out.reshape(q.shape[0], K)


# --- the fused call of a mixed batch -----------------------------------------------------------------------------

REQUESTS = [
    [(1, 40), (1, 70), (1, 3), (6, 0), (9, 25), (5, 48)],  # decodes, then prefills with and without cached context
    [(1, 20)] * 130 + [(6, 17), (3, 0)],                   # decode rows over two 128-row tiles, the second shared
    [(5, 48), (7, 0)],                                     # prefills alone: a prefix-cache hit and a fresh prefill
]


@pytest.mark.parametrize("requests", REQUESTS, ids=["mixed", "130_decodes", "prefills_only"])
@pytest.mark.parametrize("decode_kind", ["FIDecode", "trtllm-gen"])
@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
def test_flashinfer_mixed_call_fuses_prefill_rows_and_decode_rows_are_flashinfers_bytes(
        monkeypatch, requests, decode_kind, kv_layout):
    """The split: the path of a backend without a launch over the paged cache (the reference backend's hidden),
    or of a GPU generation whose policy fuses FlashInfer's mixed calls split but not as one call (SM100)."""
    monkeypatch.delenv(settings.SPLIT_MIXED_ENV, raising=False)
    monkeypatch.setattr(backends.get_backend("reference"), "handles_paged", False)
    layer, inputs, md, kv_cache, full = fi_batch(requests, kv_layout, decode_kind)
    rows = FI.rows(md, 1)
    decode = sum(1 for q, _ in requests if q == 1)
    prefill = sum(q for q, _ in requests if q > 1)
    context = sum(c for q, c in requests if q > 1)
    assert (md.num_decodes, md.num_decode_tokens, rows.decode) == (decode, decode, tuple(range(decode)))
    assert rows.prefill_run() == (decode, prefill)  # decode-first: the prefill rows are one run, written in place
    # FlashInfer runs decode and prefill rows in separate launches itself: fused with the split off (the default)
    with settings.use_split_mixed(None):
        decision = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache)
    assert (decision.path, decision.reason, decision.backend) == ("fused", None, "reference")
    assert (decision.prefill_tokens, decision.fused_tokens) == (prefill, prefill)
    assert decision.post_quantized == ({"decode_tokens": decode} if decode else {})
    if context:
        assert f"{context} cached context token(s) read from the paged cache" in decision.detail

    n = rows.num_tokens
    want_packed, want_scales = nvfp4.quantize(unfused_attention(layer, inputs, md, kv_cache), GS)
    decode_wrapper = md.decode.wrapper if decode_kind == "FIDecode" and decode else None
    prefill_wrapper = md.prefill.wrapper
    prefill_runs, trtllm_calls = len(prefill_wrapper.runs), len(TRTLLM_CALLS)
    packed, scales = buffers(n + 5)  # 5 padding rows
    fused_standard.run_fused_standard(backends.get_backend("reference"), md, layer, kv_cache, inputs, packed, GS,
                                      scales, rows)
    # the fused call: no FlashInfer prefill launch; one decode launch of the D decode rows (the planned one)
    assert len(prefill_wrapper.runs) == prefill_runs
    if decode_wrapper is not None:
        assert decode_wrapper.runs == [decode, decode]  # the unfused call's, then the fused call's
    elif decode:
        assert TRTLLM_CALLS[trtllm_calls:] == [decode]
    # decode rows: the bytes of the unfused path (FlashInfer's decode launch, then the quant op)
    dec = list(range(decode))
    assert torch.equal(packed[dec], want_packed[dec])
    assert torch.equal(row_scale_bytes(scales, dec), row_scale_bytes(want_scales, dec))
    # prefill rows: within the NVFP4 bound of float32 attention over the paged context and the new keys
    got = nvfp4.dequantize(packed[:n], scales, GS, m=n)
    for i in rows.prefill:
        lq, lc = rows.query_lens[i], rows.context_lens[i]
        a = rows.starts[i]
        ref = reference_prefill(layer, inputs[0][a:a + lq], *full[i], lc)
        assert ((got[a:a + lq] - ref).abs() <= 2 * nvfp4.error_bound(ref, GS) + ref.abs() * 2.0 ** -7).all(), i
        assert ref.abs().max() > 0.05  # not a vacuous comparison
    assert not packed[n:].any()
    assert not row_scale_bytes(scales, range(n, nvfp4.round_up(n, 128))).any()


@pytest.mark.parametrize("requests", REQUESTS[:2], ids=["mixed", "130_decodes"])
@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
def test_flashinfer_mixed_call_as_one_launch_over_the_paged_cache(monkeypatch, requests, kv_layout):
    """With a backend that has a paged launch (the default on the CPU), a mixed call is one fused launch: no
    FlashInfer launch at all, every row the reference paged attention quantized (through the cache in place, HND or
    NHD, the block table and sequence lengths the build hook kept), within the NVFP4 bound of FlashInfer's own."""
    from fusion_pass.kernels import reference

    monkeypatch.delenv(settings.SPLIT_MIXED_ENV, raising=False)
    layer, inputs, md, kv_cache, _ = fi_batch(requests, kv_layout, "FIDecode")
    rows = FI.rows(md, 1)
    decode = sum(1 for q, _ in requests if q == 1)
    prefill = sum(q for q, _ in requests if q > 1)
    decision = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache)
    assert (decision.path, decision.one_call, decision.decode_fused, decision.fused_tokens) == ("fused", True, decode,
                                                                                                prefill)
    n = rows.num_tokens
    unfused = unfused_attention(layer, inputs, md, kv_cache).float()
    prefill_runs, decode_runs = len(md.prefill.wrapper.runs), list(md.decode.wrapper.runs)
    packed, scales = buffers(n + 5)
    fused_standard.run_fused_standard(backends.get_backend("reference"), md, layer, kv_cache, inputs, packed, GS,
                                      scales, rows, one_call=True)
    assert len(md.prefill.wrapper.runs) == prefill_runs and md.decode.wrapper.runs == decode_runs
    keys, values = kv_cache.transpose(1, 2).split(D, -1)
    seq_lens = torch.tensor([q + c for q, c in requests], dtype=torch.int32)
    cu = torch.tensor([0] + [q for q, _ in requests]).cumsum(0).to(torch.int32)
    out, _ = reference.paged_attention(inputs[0], keys, values, cu, seq_lens, host_rows.block_table(md), True,
                                       layer.impl.scale)
    want_packed, want_scales = nvfp4.quantize(out.reshape(n, K), GS)
    assert torch.equal(packed[:n], want_packed)
    assert torch.equal(row_scale_bytes(scales, range(n)), row_scale_bytes(want_scales, range(n)))
    got = nvfp4.dequantize(packed[:n], scales, GS, m=n)
    assert ((got - unfused).abs() <= 2 * nvfp4.error_bound(unfused, GS) + unfused.abs() * 2.0 ** -7).all()
    assert unfused.abs().max() > 0.05
    assert not packed[n:].any()
    md.q_data_type_decode = torch.float8_e4m3fn  # vLLM would quantize the query: no one call
    assert "q_data_type_decode" in FI.paged_refusal(layer, md, kv_cache)


def test_flashinfer_context_is_read_as_vllms_cache_write_wrote_it():
    for kv_layout in LAYOUTS:
        layer, _, md, kv_cache, full = fi_batch([(1, 40), (3, 70), (5, 0)], kv_layout)
        assert FI.context_refusal(layer, kv_cache) is None and FI.block_size(kv_cache) == BLOCK
        table = host_rows.block_table(md)
        assert table is not None and not hasattr(md, "block_table")  # kept by the build hook
        for i, (keys, values) in enumerate(full):
            positions = torch.arange(keys.shape[0])
            k, v = FI.gather(layer, kv_cache, table[i, positions // BLOCK].long(), positions % BLOCK)
            assert torch.equal(k, keys) and torch.equal(v, values), (kv_layout, i)


# --- refusals ----------------------------------------------------------------------------------------------------

class OwnForward(FlashInferImpl):
    """An impl whose ``forward`` does not split the phases as vLLM's does."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, **kwargs):
        output.zero_()


def _set(name, value):
    def change(layer, md):
        setattr(md, name, value)
    return change


def _set_decode(name, value):
    def change(layer, md):
        setattr(md.decode, name, value)
    return change


def _own_forward(layer, md):
    layer.impl = OwnForward()


def _spec_decode(layer, md):  # FlashInfer counting two-token requests as decodes (speculative decoding)
    md.num_decode_tokens += 1


REFUSALS = [
    ("unknown_decode", _set("decode", SimpleNamespace(wrapper=None)), "decode metadata of type SimpleNamespace"),
    ("no_decode_part", _set("decode", None), "decode metadata of type NoneType"),
    ("unknown_kernel", lambda layer, md: setattr(md, "decode", FlashInferTrtllmAPIDecode(
        SimpleNamespace(value="cute-dsl"), None, None, 0)), "kernel 'cute-dsl'"),
    ("dcp", lambda layer, md: setattr(md, "decode", FlashInferTrtllmAPIDecode(
        TRTLLM_GEN, None, None, 0, dcp_query_start_loc=torch.zeros(4))), "dcp_query_start_loc"),
    ("fp8_query", _set("q_data_type_decode", torch.float8_e4m3fn), "q_data_type_decode=torch.float8_e4m3fn"),
    ("fp8_prefill_query", _set("q_data_type_prefill", torch.float8_e4m3fn), "q_data_type_prefill"),
    ("cascade", _set("use_cascade", True), "cascade"),
    ("spec_decode", _spec_decode, "is not the step's 3 one-token request(s) first"),
    ("own_forward", _own_forward, "OwnForward.forward does not split decode and prefill rows"),
]


ONE_CALL_REFUSED = {"dcp", "fp8_query", "fp8_prefill_query", "cascade"}  # what one paged launch cannot compute either


@pytest.mark.parametrize("name,change,detail", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_flashinfer_refuses_decode_rows_it_cannot_compute_apart(monkeypatch, name, change, detail):
    """The split refuses each; the one paged launch (which reads neither FlashInfer's decode part nor its forward)
    refuses only what it cannot compute either (DCP, FP8 queries, cascade)."""
    layer, inputs, md, kv_cache, _ = fi_batch([(1, 40), (1, 7), (1, 3), (6, 0), (9, 25)], seed=1)
    change(layer, md)
    whole = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache)
    if name in ONE_CALL_REFUSED:
        assert (whole.path, whole.reason) == ("fallback", "decode_tokens") and detail in whole.detail, whole
    else:
        assert (whole.path, whole.one_call, whole.decode_fused) == ("fused", True, 3), whole
    monkeypatch.setattr(backends.get_backend("reference"), "handles_paged", False)  # the split alone
    layer, inputs, md, kv_cache, _ = fi_batch([(1, 40), (1, 7), (1, 3), (6, 0), (9, 25)])
    assert guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache).path == "fused"
    layer, inputs, md, kv_cache, _ = fi_batch([(1, 40), (1, 7), (1, 3), (6, 0), (9, 25)], seed=1)  # a new step
    change(layer, md)
    decision = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache)
    assert (decision.path, decision.reason) == ("fallback", "decode_tokens"), decision
    assert decision.post_quantized == {"decode_tokens": 18} and decision.prefill_tokens == 15
    assert detail in decision.detail, decision.detail


def test_flashinfer_refuses_decode_rows_that_are_not_first(monkeypatch):
    """A batch FlashInfer did not order decode-first (here: a prefill before a decode request, as a one-token fresh
    prefill lands after the prefills in vLLM's reorder): its decode part is not the step's one-token requests, so
    the split is refused; one paged launch reads the rows in any order."""
    layer, inputs, md, kv_cache, _ = fi_batch([(6, 0), (1, 40)])
    assert (md.num_decodes, md.num_prefills) == (0, 2)
    assert guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache).one_call
    monkeypatch.setattr(backends.get_backend("reference"), "handles_paged", False)
    layer, inputs, md, kv_cache, _ = fi_batch([(6, 0), (1, 40)])
    decision = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache)
    assert (decision.reason, decision.post_quantized) == ("decode_tokens", {"decode_tokens": 7})
    assert "decode part (0 request(s), 0 token(s)) is not the step's 1 one-token request(s) first" in decision.detail


def test_flashinfer_refuses_a_cache_it_cannot_read():
    for cache_dtype in (torch.float8_e4m3fn, torch.uint8):  # FP8 / NVFP4 storage
        layer, inputs, md, kv_cache, _ = fi_batch([(1, 40), (6, 30)], cache_dtype=cache_dtype)
        decision = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache)
        assert (decision.reason, decision.post_quantized) == ("chunked_prefill", {"chunked_prefill": 7})
        assert f"KV cache dtype {cache_dtype}" in decision.detail
    layer, inputs, md, kv_cache, _ = fi_batch([(6, 30)])
    decision = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache.reshape(-1, HK, BLOCK // 2, 4 * D))
    assert decision.reason == "chunked_prefill" and "is not FLASHINFER's" in decision.detail
    # a prefill without context reads no cache: fused whatever the cache
    layer, inputs, md, kv_cache, _ = fi_batch([(6, 0)], cache_dtype=torch.uint8)
    assert guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache).path == "fused"


def test_flashinfer_metadata_without_host_rows_or_block_table_falls_back():
    layer, inputs, md, kv_cache, _ = fi_batch([(1, 40), (6, 0)])
    delattr(md, host_rows._BLOCK_TABLE)
    assert FI.rows(md, 1) is None
    decision = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache)
    assert (decision.reason, decision.post_quantized) == ("no_host_metadata", {"no_host_metadata": 7})
    # decode-only steps are known from the metadata's ints (num_prefills == 0), as before
    layer, inputs, md, kv_cache, _ = fi_batch([(1, 40), (1, 9)])
    assert guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache).reason == "decode_tokens"


def test_flashinfer_layers_have_an_adapter():
    """No ``no_decode_adapter:FLASHINFER`` any more: at run time, nor at compile time (vLLM's own attention + quant
    rewrite of an unquantized-cache FlashInfer layer is retargeted to the fused op)."""
    layer, inputs, md, kv_cache, _ = fi_batch([(1, 40), (6, 0)])
    assert registry.adapter_for(layer) == (FI, "FLASHINFER") and isinstance(FI, flashinfer.FlashInferAdapter)
    assert FI.BUILDER == ("vllm.v1.attention.backends.flashinfer", "FlashInferMetadataBuilder") and FI.SPLITS_MIXED
    decision = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache)
    assert decision.path == "fused" and not decision.reason
    assert layer_check.why_left(layer) is None
    triton = StandInLayer(BLOCK, backend="TRITON_ATTN")
    assert layer_check.why_left(triton)[0] == "no_decode_adapter:TRITON_ATTN"


# --- the installed vLLM's FlashInfer backend (its source: FlashInfer is not installed on the CPU build) ----------

def _installed_source():
    spec = importlib.util.find_spec("vllm")
    path = Path(list(spec.submodule_search_locations)[0]) / "v1" / "attention" / "backends" / "flashinfer.py"
    if not path.exists():
        pytest.skip(f"no {path}")
    return path.read_text()


def _members(tree, cls):
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls]
    return node


def test_installed_vllm_flashinfer_backend_is_what_the_adapter_reads():
    src = _installed_source()
    tree = ast.parse(src)
    forward = [f for f in _members(tree, "FlashInferImpl").body if isinstance(f, ast.FunctionDef) and f.name == "forward"]
    lines = {" ".join(line.split()) for line in ast.get_source_segment(src, forward[0]).splitlines()}
    assert [s for s in flashinfer.FORWARD_DECODE_SPLIT if s not in lines] == []
    fields = {n.target.id for n in _members(tree, "FlashInferMetadata").body if isinstance(n, ast.AnnAssign)}
    assert {"kv_cache_layout", "num_actual_tokens", "q_data_type_prefill", "q_data_type_decode", "num_decodes",
            "num_decode_tokens", "num_prefills", "num_prefill_tokens", "causal", "prefill", "decode"} <= fields
    assert "block_table" not in fields  # hence the build hook keeps the batch's block table
    for kind in flashinfer.DECODE_KINDS:
        _members(tree, kind)
    kernels = {n.value.value for n in _members(tree, "FlashInferDecodeKernel").body if isinstance(n, ast.Assign)}
    assert kernels == set(flashinfer.DECODE_KINDS["FlashInferTrtllmAPIDecode"])
    builder = _members(tree, "FlashInferMetadataBuilder")
    assert FI.BUILDER[1] == builder.name and any(isinstance(f, ast.FunctionDef) and f.name == "build"
                                                 for f in builder.body)
    assert 'return "FLASHINFER"' in src
    assert "reorder_batch_threshold: int = 1" in src
    # vLLM's cache write, which FlashInferAdapter.gather reads back
    assert "k_cache, v_cache = kv_cache.transpose(1, 2).split(" in src
    assert "self.head_size, dim=-1" in src
