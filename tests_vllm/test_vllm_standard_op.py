"""The standard-layer run-time op without an engine: vLLM's real CPU attention backend on a stand-in layer
(tests_vllm/standard_batches.py), the CPU adapter's cache reads and decode sub-batches, the fused rows of mixed
batches whose decode and prefill rows interleave, the guard's host-side decisions, the FlashAttention adapter
against a stand-in that records the sub-batch it is given (the FlashAttention adapter is not run on CUDA)."""

from types import SimpleNamespace

import pytest
import torch

import fusion_pass.ops  # noqa: F401  (torch.ops.fusion_pass.scaled_fp4_quant, the unfused graph's quant op on CPU)
from fusion_pass import nvfp4
from fusion_pass.runtime import backends, settings
from fusion_pass.vllm.adapters import cpu_attn as cpu_attn_adapter, host_rows
from fusion_pass.vllm.runtime import fused_standard, guard
from fusion_pass.vllm.adapters.paged import context_source
from fusion_pass.vllm.adapters.registry import ADAPTERS
from standard_batches import (GS, HK, D, H, K, StandInLayer, batch, buffers, reference_prefill, row_scale_bytes,
                              vllm_attention)

CPU = ADAPTERS["CPU_ATTN"]


@pytest.fixture(autouse=True)
def _split_mixed_calls(monkeypatch):
    """The tests below exercise the split of a mixed call (decode rows by vLLM's backend on a sub-batch beside the
    fused prefill rows): the path of a backend without a launch over the paged cache (the reference backend's is
    hidden here), split on. The default (one fused call over the paged cache) is tested by
    ``test_guard_does_not_split_a_mixed_call_by_default`` and ``test_vllm_one_call.py``."""
    monkeypatch.setattr(backends.get_backend("reference"), "handles_paged", False)
    with settings.use_split_mixed("on"):
        yield


@pytest.mark.parametrize("block_size,isa", [(32, None), (64, None), (32, "vec"), (16, "vec16")])
def test_cpu_cache_read_back_in_the_backends_layout(block_size, isa):
    """Every cached position of every request, read through the learned layout, equals what was written."""
    layer, _, md, kv_cache, full = batch([(3, 40), (1, 70), (5, 0)], block_size, layer=StandInLayer(block_size, isa=isa))
    assert CPU.context_refusal(layer, kv_cache) is None
    for i, (keys, values) in enumerate(full):
        positions = torch.arange(keys.shape[0])
        blocks = md.block_table[i, positions // block_size].long()
        k, v = CPU.gather(layer, kv_cache, blocks, positions % block_size)
        assert torch.equal(k, keys) and torch.equal(v, values), (i, layer.isa)


def test_cpu_context_source_packs_each_prefills_context_in_order():
    layer, _, md, kv_cache, full = batch([(1, 30), (4, 37), (6, 0), (1, 9), (5, 50)])
    rows = host_rows.standard_rows(md)
    context = context_source(CPU, layer, md, rows, kv_cache)
    want_k = torch.cat([full[1][0][:37], full[4][0][:50]])
    want_v = torch.cat([full[1][1][:37], full[4][1][:50]])
    for lo, hi in ((0, 87), (0, 7), (30, 45), (80, 87)):
        k, v = context(lo, hi)
        assert torch.equal(k, want_k[lo:hi]) and torch.equal(v, want_v[lo:hi]), (lo, hi)


@pytest.mark.parametrize("requests,split", [
    ([(20, 0), (1, 300), (1, 1000)], True),      # long decodes beside a short prefill: vLLM splits their keys
    ([(1, 1500), (1, 1600), (1, 1700), (100, 0)], True),
    ([(1, 40), (5, 0), (1, 70)], False),         # short: no split
    ([(1, 40), (5, 0), (1, 70)], "off"),         # VLLM_CPU_ATTN_SPLIT_KV=0
    ([(7, 30), (1, 12), (1, 33), (4, 0), (1, 5)], False),
])
def test_cpu_decode_rows_byte_equal_to_vllms_attention_of_the_whole_batch(requests, split):
    """Sub-batch (vLLM's schedule split no request's keys) and whole batch (it did) alike."""
    layer, inputs, md, kv_cache, _ = batch(requests, split_kv=split != "off")
    rows = host_rows.standard_rows(md)
    splits = cpu_attn_adapter.schedule_split(md)
    if split is not True or torch.get_num_threads() > 1:  # one thread: vLLM never splits
        assert splits is (split is True)
    before = dict(cpu_attn_adapter.DECODE_METHODS)
    out = torch.empty(len(rows.decode), H, D, dtype=torch.bfloat16)
    method = CPU.run_decode(layer, md, rows, inputs, kv_cache, out.view(out.shape[0], -1))
    assert method == ("whole_batch" if splits else "sub_batch")
    assert cpu_attn_adapter.DECODE_METHODS[method] == before[method] + 1
    assert torch.equal(out, vllm_attention(layer, inputs, md, kv_cache)[rows.decode_rows])


@pytest.mark.parametrize("requests", [
    [(1, 40), (6, 0), (1, 70), (9, 25)],           # decode rows between prefill rows: gathered prefills
    [(1, 40), (1, 70), (6, 0), (9, 25)],           # decodes first: the prefills written in place
    [(5, 48)],                                     # a prefix-cache hit alone
    [(12, 0), (3, 0)],                             # pure prefill
    [(1, 20)] * 130 + [(6, 17), (3, 33)],          # decode rows over two 128-row tiles, the second shared
])
@pytest.mark.parametrize("workspace", [None, 7])  # one call over context + new keys, and context chunks of 7 rows
def test_standard_rows_decode_exact_prefill_fused_with_context(requests, workspace):
    layer, inputs, md, kv_cache, full = batch(requests)
    rows = host_rows.standard_rows(md)
    n = rows.num_tokens
    packed, scales = buffers(n + 5)  # 5 padding rows
    with settings.use_context_workspace_tokens(workspace):
        fused_standard.run_fused_standard(backends.get_backend("reference"), md, layer, kv_cache, inputs, packed, GS,
                                          scales, rows)
    unfused = vllm_attention(layer, inputs, md, kv_cache).reshape(n, K)
    want_packed, want_scales = nvfp4.quantize(unfused, GS)
    dec = rows.decode_rows
    assert torch.equal(packed[dec], want_packed[dec])
    assert torch.equal(row_scale_bytes(scales, dec), row_scale_bytes(want_scales, dec))
    got = nvfp4.dequantize(packed[:n], scales, GS, m=n)
    for i in rows.prefill:
        lq, lc = rows.query_lens[i], rows.context_lens[i]
        a = rows.starts[i]
        ref = reference_prefill(layer, inputs[0][a:a + lq], *full[i], lc)
        assert ((got[a:a + lq] - ref).abs() <= 2 * nvfp4.error_bound(ref, GS) + ref.abs() * 2.0 ** -7).all(), i
        assert ref.abs().max() > 0.05  # not a vacuous comparison
    assert not packed[n:].any()
    assert not row_scale_bytes(scales, range(n, nvfp4.round_up(n, 128))).any()


def _standard_guard_layer(backend="CPU_ATTN"):
    return StandInLayer(32, backend=backend)


def test_guard_fuses_every_prefill_row_of_standard_layers_beside_decodes_and_context():
    layer, inputs, md, kv_cache, _ = batch([(1, 40), (6, 0), (1, 70), (9, 25)])
    decision = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache)
    assert (decision.path, decision.reason, decision.backend) == ("fused", None, "reference")
    assert (decision.prefill_tokens, decision.fused_tokens, decision.post_quantized) == (15, 15, {"decode_tokens": 2})
    assert "25 cached context token(s) read from the paged cache" in decision.detail
    _, decode_inputs, decode_md, decode_cache, _ = batch([(1, 40), (1, 7)])
    decision = guard.decide("stand_in.attn", decode_inputs[0], decode_md, layer, decode_cache)
    assert (decision.reason, decision.prefill_tokens, decision.post_quantized) == ("decode_tokens", 0, {"decode_tokens": 2})


@pytest.mark.parametrize("seed", range(6))
def test_guard_does_not_split_a_mixed_call_by_default(monkeypatch, seed):
    """Generated batches of decode requests, prefills and prefills with context, in vLLM's request order: with the
    split off (the default: no setting, no environment variable) a call with decode and prefill rows takes the exact
    fallback whole (``mixed_not_split``, every row counted), a call of prefills alone is fused, a call of decodes
    alone falls back as before; with the split on the same mixed call is fused beside its decode rows. A backend with a
    launch over the paged cache fuses the mixed call whole by default (every row, decode rows counted as fused)."""
    monkeypatch.delenv(settings.SPLIT_MIXED_ENV, raising=False)
    gen = torch.Generator().manual_seed(seed)
    layer = _standard_guard_layer()
    for _ in range(4):
        n = int(torch.randint(1, 7, (1,), generator=gen))
        requests = []
        for _ in range(n):
            kind = int(torch.randint(0, 3, (1,), generator=gen))
            context = int(torch.randint(1, 60, (1,), generator=gen))
            requests.append((1, context) if kind == 0 else (int(torch.randint(2, 12, (1,), generator=gen)),
                                                            0 if kind == 1 else context))
        _, inputs, md, kv_cache, _ = batch(requests)
        decode = sum(q for q, _ in requests if q == 1)
        prefill = sum(q for q, _ in requests if q > 1)
        with settings.use_split_mixed(None):
            default = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache)
        if decode and prefill:
            assert (default.path, default.reason, default.fused_tokens) == ("fallback", "mixed_not_split", 0), requests
            assert default.post_quantized == {"mixed_not_split": decode + prefill} and default.prefill_tokens == prefill
            assert f"{decode} decode token(s) beside {prefill} prefill token(s)" in default.detail
            assert settings.SPLIT_MIXED_ENV in default.detail
        elif prefill:
            assert (default.path, default.fused_tokens, default.post_quantized) == ("fused", prefill, {}), requests
        else:
            assert (default.reason, default.post_quantized) == ("decode_tokens", {"decode_tokens": decode}), requests
        _, inputs, md, kv_cache, _ = batch(requests)  # a new step: a step's decision is kept for its later calls
        with settings.use_split_mixed("on"):
            split = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache)
        if prefill:
            assert (split.path, split.fused_tokens) == ("fused", prefill), requests
            assert split.post_quantized == ({"decode_tokens": decode} if decode else {}), requests
        else:
            assert split == default
        monkeypatch.setattr(backends.get_backend("reference"), "handles_paged", True)
        _, inputs, md, kv_cache, _ = batch(requests)
        with settings.use_split_mixed(None):
            whole = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache)
        if decode and prefill:
            assert (whole.path, whole.one_call, whole.fused_tokens, whole.decode_fused) == ("fused", True, prefill,
                                                                                          decode), requests
            assert whole.post_quantized == {} and "one launch over the paged KV cache" in whole.detail
        else:
            assert (whole.path, whole.reason, whole.one_call) == (default.path, default.reason, False), requests
        monkeypatch.setattr(backends.get_backend("reference"), "handles_paged", False)


def test_guard_names_a_backend_without_adapter():
    for name in ("TRITON_ATTN", "FLEX_ATTENTION"):  # FLASHINFER has an adapter (tests_vllm/test_vllm_flashinfer.py)
        layer, inputs, md, kv_cache, _ = batch([(1, 40), (6, 0)], layer=_standard_guard_layer(name))
        decision = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache)
        assert (decision.path, decision.reason) == ("fallback", f"no_decode_adapter:{name}")
        assert decision.post_quantized == {f"no_decode_adapter:{name}": 7} and decision.prefill_tokens == 6
    # a decode-only batch needs no adapter
    layer, inputs, md, kv_cache, _ = batch([(1, 40)], layer=_standard_guard_layer("TRITON_ATTN"))
    assert guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache).reason == "decode_tokens"


def test_guard_falls_back_where_the_adapter_cannot_compute_rows_apart():
    layer, inputs, md, kv_cache, _ = batch([(1, 40), (6, 3)])
    md.dynamic_causal = torch.ones(2, dtype=torch.int32)
    decision = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache)
    assert (decision.reason, decision.post_quantized) == ("decode_tokens", {"decode_tokens": 7})
    assert "dynamic_causal" in decision.detail
    layer, inputs, md, kv_cache, _ = batch([(6, 3)])
    decision = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache.view(-1, HK, 32, D))
    assert (decision.reason, decision.post_quantized) == ("chunked_prefill", {"chunked_prefill": 6})
    layer, inputs, md, kv_cache, _ = batch([(6, 0)])
    md.causal = False
    assert guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache).reason == "layer_not_supported"


def _device_metadata(query_lens, seq_lens):
    """Standard metadata whose tensors are on the meta device: any read of them raises."""
    meta = dict(device="meta", dtype=torch.int32)
    return SimpleNamespace(query_start_loc=torch.empty(len(query_lens) + 1, **meta),
                           seq_lens=torch.empty(len(seq_lens), **meta), block_table=torch.empty(len(seq_lens), 4, **meta),
                           num_actual_tokens=sum(query_lens), max_query_len=max(query_lens), causal=True)


def test_guard_decides_from_host_copies_and_never_reads_device_metadata():
    layer = _standard_guard_layer()
    q = torch.zeros(8, H, D, dtype=torch.bfloat16)
    # no host copy: a decode-only batch is known from max_query_len, any other falls back
    assert guard.decide("l", q, _device_metadata([1, 1], [9, 4]), layer).reason == "decode_tokens"
    decision = guard.decide("l", q, _device_metadata([1, 6], [9, 6]), layer)
    assert (decision.reason, decision.post_quantized) == ("no_host_metadata", {"no_host_metadata": 7})
    # the build hook's host copies (vLLM's CommonAttentionMetadata.query_start_loc_cpu / seq_lens_cpu_upper_bound)

    class Builder:
        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            return _device_metadata([1, 6], [9, 6])

    assert host_rows.install_build_hook(Builder)
    assert host_rows.install_build_hook(Builder) and Builder.build.__fusion_pass_hook__  # installed once
    common = SimpleNamespace(query_start_loc_cpu=torch.tensor([0, 1, 7, 7], dtype=torch.int32), num_reqs=2,
                             seq_lens_cpu_upper_bound=torch.tensor([9, 6, 0], dtype=torch.int32))
    md = Builder().build(0, common)
    decision = guard.decide("l", q, md, layer)
    assert (decision.path, decision.prefill_tokens, decision.post_quantized) == ("fused", 6, {"decode_tokens": 1})
    rows = host_rows.standard_rows(md)
    assert (rows.query_lens, rows.context_lens, rows.decode, rows.prefill) == ((1, 6), (8, 0), (0,), (1,))
    assert host_rows.standard_rows(md) is rows  # kept on the metadata: read once per step


class RecordingImpl:
    """A stand-in for vLLM's FlashAttentionImpl: records the metadata its ``forward`` is given and writes a
    function of its query rows."""

    head_size, scale, num_heads, num_kv_heads = D, D ** -0.5, H, HK
    sliding_window, alibi_slopes, sinks, logits_soft_cap = None, None, None, None

    def __init__(self):
        self.calls = []

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        self.calls.append(attn_metadata)
        output.copy_(query * 0.5)


def test_flash_attention_adapter_gives_vllm_a_sub_batch_of_the_decode_requests():
    """Not run on CUDA: the FLASH_ATTN adapter on CPU tensors, vLLM's FlashAttention impl stood in for."""
    block_size = 16
    requests = [(1, 40), (6, 0), (1, 70), (9, 25), (1, 3)]
    cpu_layer, inputs, cpu_md, cpu_cache, full = batch(requests, block_size)
    # the same cache in FlashAttention's logical layout [num_blocks, Hk, block_size, 2 * D]: keys then values per slot
    fa_cache = torch.zeros_like(cpu_cache)
    keys, values = fa_cache.transpose(1, 2).split(D, dim=-1)
    for i, (k_full, v_full) in enumerate(full):
        positions = torch.arange(k_full.shape[0])
        blocks = cpu_md.block_table[i, positions // block_size].long()
        keys[blocks, positions % block_size] = k_full
        values[blocks, positions % block_size] = v_full
    layer = StandInLayer(block_size, backend="FLASH_ATTN")
    layer.impl = RecordingImpl()
    md = SimpleNamespace(num_actual_tokens=cpu_md.num_actual_tokens + 3, max_query_len=9, max_seq_len=71,
                         query_start_loc=cpu_md.query_start_loc, seq_lens=cpu_md.seq_lens,
                         block_table=cpu_md.block_table, slot_mapping=cpu_md.slot_mapping,
                         scheduler_metadata=torch.ones(8, dtype=torch.int32), max_num_splits=0, causal=True,
                         mm_prefix_query_range_tensor=None, rswa_prefix_lens=None, dcp_context_kv_lens=None)
    n = cpu_md.num_actual_tokens
    decision = guard.decide("stand_in.attn", inputs[0], md, layer, fa_cache)
    assert (decision.path, decision.post_quantized) == ("fused", {"decode_tokens": 3})
    packed, scales = buffers(n + 3)
    fused_standard.run_fused_standard(backends.get_backend("reference"), md, layer, fa_cache, inputs, packed, GS,
                                      scales, host_rows.standard_rows(md))
    (sub,) = layer.impl.calls
    assert sub is not md and (sub.num_actual_tokens, sub.max_query_len, sub.scheduler_metadata) == (3, 1, None)
    assert sub.query_start_loc.tolist() == [0, 1, 2, 3]
    assert sub.seq_lens.tolist() == [41, 71, 4] and torch.equal(sub.block_table, md.block_table[[0, 2, 4]])
    assert torch.equal(sub.slot_mapping, md.slot_mapping[[0, 7, 17]])
    dec = [0, 7, 17]
    want_packed, want_scales = nvfp4.quantize((inputs[0][dec] * 0.5).reshape(3, K), GS)
    assert torch.equal(packed[dec], want_packed) and torch.equal(row_scale_bytes(scales, dec),
                                                                   row_scale_bytes(want_scales, range(3)))
    got = nvfp4.dequantize(packed[:n], scales, GS, m=n)
    for i, a in ((1, 1), (3, 8)):  # prefill rows: context read from FlashAttention's layout
        lq, lc = requests[i]
        ref = reference_prefill(cpu_layer, inputs[0][a:a + lq], *full[i], lc)
        assert ((got[a:a + lq] - ref).abs() <= 2 * nvfp4.error_bound(ref, GS) + ref.abs() * 2.0 ** -7).all(), i
    refused = SimpleNamespace(**{**vars(md), "mm_prefix_query_range_tensor": torch.zeros(1)})
    assert guard.decide("stand_in.attn", inputs[0], refused, layer, fa_cache).reason == "decode_tokens"
