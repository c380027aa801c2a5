"""A standard layer's call fused whole: every row, decode rows included, in one launch over vLLM's paged KV cache
(vLLM's real CPU attention backend on a stand-in layer, tests_vllm/standard_batches.py; the reference backend's
``run_paged``).

The contract (docs/design.md, "Rows computed by another kernel than the unfused graph's"): the fused rows are not
vLLM's kernel's bf16 output quantized, so they are compared with it within the NVFP4 bound, and byte for byte with
the project's reference paged attention quantized; rows past the batch's are zeroed."""

import pytest
import torch

import fusion_pass.ops  # noqa: F401  (the unfused graph's quant op on CPU)
from fusion_pass import nvfp4
from fusion_pass.kernels import reference
from fusion_pass.runtime import backends, counters, settings
from fusion_pass.vllm.adapters import host_rows
from fusion_pass.vllm.adapters.registry import ADAPTERS
from fusion_pass.vllm.runtime import fused_standard, guard
from standard_batches import GS, HK, D, H, K, StandInLayer, batch, buffers, row_scale_bytes, vllm_attention

CPU = ADAPTERS["CPU_ATTN"]


def _requests(gen, count: int):
    """``count`` requests in vLLM's order: decode rows (one new token over a context), fresh prefills, prefills
    after cached context (a prefix hit or an earlier chunk)."""
    out = []
    for _ in range(count):
        kind = int(torch.randint(0, 3, (1,), generator=gen))
        context = int(torch.randint(1, 90, (1,), generator=gen))
        if kind == 0:
            out.append((1, context))
        else:
            out.append((int(torch.randint(2, 14, (1,), generator=gen)), 0 if kind == 1 else context))
    return out


def _generated(seed: int, block_size: int):
    gen = torch.Generator().manual_seed(seed)
    requests = _requests(gen, int(torch.randint(2, 8, (1,), generator=gen)))
    if not any(q == 1 for q, _ in requests):
        requests.append((1, 33))
    if not any(q > 1 for q, _ in requests):
        requests.insert(0, (5, 12))
    return requests


CASES = [(seed, block) for seed in range(8) for block in (16, 32)]


@pytest.mark.parametrize("seed,block_size", CASES)
def test_one_call_rows_within_the_bound_of_vllms_and_bytes_of_the_reference(seed, block_size):
    requests = _generated(seed, block_size)
    layer, inputs, md, kv_cache, _ = batch(requests, block_size, seed=seed, layer=StandInLayer(block_size))
    decision = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache)
    decode = sum(1 for q, _ in requests if q == 1)
    prefill = sum(q for q, _ in requests if q > 1)
    assert (decision.path, decision.backend, decision.one_call) == ("fused", "reference", True), decision
    assert (decision.prefill_tokens, decision.fused_tokens, decision.decode_fused, decision.post_quantized) == (
        prefill, prefill, decode, {})
    rows = host_rows.standard_rows(md)
    n = rows.num_tokens
    packed, scales = buffers(n + 3)  # 3 padding rows
    fused_standard.run_fused_standard(backends.get_backend("reference"), md, layer, kv_cache, inputs, packed, GS,
                                      scales, rows, one_call=True)
    # byte for byte: the reference paged attention of the whole call, quantized
    seq_lens = torch.tensor([q + c for q, c in requests], dtype=torch.int32)
    cu = torch.tensor([0] + [q for q, _ in requests]).cumsum(0).to(torch.int32)
    k_pages, v_pages, table = CPU.page_views(layer, kv_cache, md.block_table, rows)  # checked below
    out32, _ = reference.paged_attention(inputs[0], k_pages, v_pages, cu, seq_lens, table, True, layer.impl.scale)
    want_packed, want_scales = nvfp4.quantize(out32.reshape(n, K), GS)
    assert torch.equal(packed[:n], want_packed)
    assert torch.equal(row_scale_bytes(scales, range(n)), row_scale_bytes(want_scales, range(n)))
    # within the NVFP4 bound of vLLM's own unfused output, every row
    unfused = vllm_attention(layer, inputs, md, kv_cache).reshape(n, K).float()
    got = nvfp4.dequantize(packed[:n], scales, GS, m=n)
    bound = 2 * nvfp4.error_bound(unfused, GS) + unfused.abs() * 2.0 ** -7
    assert ((got - unfused).abs() <= bound).all()
    assert unfused.abs().max() > 0.05
    assert not packed[n:].any()
    assert not row_scale_bytes(scales, range(n, nvfp4.round_up(n, 128))).any()


@pytest.mark.parametrize("block_size,isa", [(32, None), (16, "vec16"), (32, "vec")])
def test_cpu_page_views_read_every_request_in_the_backends_layout(block_size, isa):
    """CPU_ATTN orders a block's keys and values by ISA: its pages are the used blocks read through the learned
    layout, the block table renumbered; every position of every request reads back what was written."""
    requests = [(3, 40), (1, 70), (5, 0), (1, 9)]
    layer, _, md, kv_cache, full = batch(requests, block_size, layer=StandInLayer(block_size, isa=isa))
    rows = host_rows.standard_rows(md)
    k_pages, v_pages, table = CPU.page_views(layer, kv_cache, md.block_table, rows)
    assert k_pages.shape[1:] == (block_size, HK, D) and table.dtype == torch.int32
    for i, (keys, values) in enumerate(full):
        positions = torch.arange(keys.shape[0])
        pages = table[i, positions // block_size].long()
        assert torch.equal(k_pages[pages, positions % block_size], keys)
        assert torch.equal(v_pages[pages, positions % block_size], values)


def test_one_call_is_counted_with_its_decode_rows():
    counters.reset_counters()
    layer, inputs, md, kv_cache, _ = batch([(1, 40), (6, 0), (1, 70), (9, 25)])
    decision = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache)
    counters.record(decision, "stand_in.attn")
    tokens = counters.counters(layers=["stand_in.attn"])["tokens"]
    assert tokens == {"prefill": 15, "prefill_fused": 15, "decode_fused": 2, "post_quantized": {}}
    counters.reset_counters()


def test_one_call_refused_where_the_metadata_asks_for_more_than_causal_attention(monkeypatch):
    """Per-request causal masks: no one-call launch; with the split off the call falls back whole, naming why."""
    monkeypatch.delenv(settings.SPLIT_MIXED_ENV, raising=False)
    layer, inputs, md, kv_cache, _ = batch([(1, 40), (6, 3)])
    md.dynamic_causal = torch.ones(2, dtype=torch.int32)
    decision = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache)
    assert (decision.reason, decision.post_quantized) == ("mixed_not_split", {"mixed_not_split": 7})
    assert "dynamic_causal" in decision.detail


def test_a_backend_without_a_paged_launch_is_not_split_by_default(monkeypatch):
    monkeypatch.delenv(settings.SPLIT_MIXED_ENV, raising=False)
    monkeypatch.setattr(backends.get_backend("reference"), "handles_paged", False)
    layer, inputs, md, kv_cache, _ = batch([(1, 40), (6, 3)])
    decision = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache)
    assert (decision.reason, decision.post_quantized) == ("mixed_not_split", {"mixed_not_split": 7})
    assert "no launch over the paged cache" in decision.detail


def test_the_policy_refuses_a_class_measured_slower(monkeypatch):
    """With the device's generation read as SM90 (the H200's measurements), a mixed call is not fused, under its
    own reason, and ``FUSION_PASS_POLICY=always`` fuses it; a named backend runs regardless."""
    from fusion_pass.runtime import policy

    monkeypatch.setattr(policy, "generation", lambda device: "sm90")
    layer, inputs, md, kv_cache, _ = batch([(1, 40), (6, 3)])
    decision = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache)
    assert (decision.reason, decision.post_quantized) == ("slower_here", {"slower_here": 7})
    assert "mixed_split" in decision.detail and "no measurable gain" in decision.detail
    for setting in (settings.use_policy("always"), settings.use_backend("reference")):
        with setting:
            _, inputs, md, kv_cache, _ = batch([(1, 40), (6, 3)])
            assert guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache).one_call
    _, inputs, md, kv_cache, _ = batch([(6, 3), (4, 0)])  # prefill rows alone: measured faster
    assert guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache).path == "fused"


def test_the_key_bound_never_exceeds_what_the_block_table_holds():
    """vLLM's host sequence lengths are an upper bound for decode requests (async scheduling): the bound handed to
    the paged launch is cut to the block table's capacity (the kernels read each length from ``seq_lens``)."""
    layer, inputs, md, kv_cache, _ = batch([(1, 31), (6, 0)], 32)
    rows = host_rows.standard_rows(md)
    capacity = md.block_table.shape[1] * 32
    paged = CPU.paged_inputs(layer, md, rows, kv_cache, torch.device("cpu"))
    assert paged.max_seq_len == 32 <= capacity
    stale = host_rows.StepRows([1, 6], [capacity + 40, 0])  # a decode request's host bound past its pages
    assert CPU.paged_inputs(layer, md, stale, kv_cache, torch.device("cpu")).max_seq_len == capacity
