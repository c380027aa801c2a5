"""The vLLM op's decision and exact fallback on CUDA: no host synchronization, and captured in a CUDA graph
(issue 18, item 7). vLLM runs the attention op once per layer per step, eagerly between compiled pieces and inside a
full CUDA graph for decode-only batches; the op decides from host-side metadata (fusion_pass/vllm/host_rows.py) and
under capture takes the path that needs no decision.

Stand-in metadata holding CUDA tensors (what vLLM's FlashAttention builder hands the op, plus the host copies the
build hook keeps), a stand-in for vLLM's attention op, the unfused graph's quant op. Needs a CUDA device: skipped
without one (written on a CPU machine, to be run on an H200).
"""

from types import SimpleNamespace

import pytest
import torch

from fusion_pass import nvfp4
from fusion_pass.runtime import counters, settings
from fusion_pass.vllm import attention_op, guard, host_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (to be run on an H200)")

H, HK, D, BLOCK = 4, 2, 64, 16
K = H * D


def standard_layer():
    """What the op reads of vLLM's Attention layer on the FLASH_ATTN backend."""
    impl = SimpleNamespace(sliding_window=None, alibi_slopes=None, sinks=None, logits_soft_cap=None,
                           scale=D ** -0.5, head_size=D, num_heads=H, num_kv_heads=HK)
    return SimpleNamespace(num_heads=H, num_kv_heads=HK, head_size=D, kv_cache_dtype="auto", attn_type="decoder",
                           layer_name="capture.attn", kv_sharing_target_layer_name=None, impl=impl,
                           attn_backend=SimpleNamespace(get_name=lambda: "FLASH_ATTN"))


def cuda_metadata(query_lens, context_lens, host: bool = True):
    """FlashAttention-shaped metadata of CUDA tensors; with ``host``, the host copies the build hook keeps."""
    seq = [q + c for q, c in zip(query_lens, context_lens)]
    loc = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    blocks = max(-(-s // BLOCK) for s in seq)
    md = SimpleNamespace(
        num_actual_tokens=sum(query_lens), max_query_len=max(query_lens), max_seq_len=max(seq),
        query_start_loc=loc.cuda(), seq_lens=torch.tensor(seq, dtype=torch.int32).cuda(),
        block_table=torch.arange(len(seq) * blocks, dtype=torch.int32).view(len(seq), blocks).cuda(),
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.long).cuda(), scheduler_metadata=None,
        max_num_splits=0, causal=True, mm_prefix_query_range_tensor=None, rswa_prefix_lens=None,
        dcp_context_kv_lens=None)
    if host:
        host_rows.attach(md, SimpleNamespace(query_start_loc_cpu=loc, num_reqs=len(seq),
                                             seq_lens_cpu_upper_bound=torch.tensor(seq, dtype=torch.int32)))
    return md


def kv_cache(num_blocks: int = 64):
    return torch.zeros(num_blocks, HK, BLOCK, 2 * D, dtype=torch.bfloat16, device="cuda")


class SyncError(AssertionError):
    pass


def no_sync(fn, *args):
    """``fn(*args)`` with CUDA's sync debug mode at "error": any host synchronization raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn(*args)
    except RuntimeError as exc:
        raise SyncError(f"{fn.__name__} synchronized with the device: {exc}") from exc
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_the_decision_reads_no_device_tensor():
    with pytest.raises(SyncError):  # the detector works: reading a device value back is a synchronization
        no_sync(lambda: torch.ones(1, device="cuda").item())
    layer, cache = standard_layer(), kv_cache()
    q = torch.zeros(16, H, D, dtype=torch.bfloat16, device="cuda")
    guard.decide("capture.attn", q, cuda_metadata([6, 1], [0, 9]), layer, cache)  # backend detection, outside
    torch.cuda.synchronize()
    cases = [(cuda_metadata([1, 1, 1], [5, 9, 40]), "decode_tokens"),            # decode-only, host copies
             (cuda_metadata([1, 6, 1, 7], [5, 0, 40, 12]), None),                # mixed + context: fused or a reason
             (cuda_metadata([1, 1], [5, 9], host=False), "decode_tokens"),       # no host copies: max_query_len
             (cuda_metadata([1, 6], [5, 0], host=False), "no_host_metadata")]
    for md, reason in cases:
        decision = no_sync(guard.decide, "capture.attn", q, md, layer, cache)
        if reason is not None:
            assert decision.reason == reason, decision
        else:  # fused where a fused backend is picked here (fa4 on an H200 with FA4 installed), else its reason
            assert decision.fused or decision.reason in ("no_backend", "no_fast_backend"), decision
            print("mixed batch with context:", decision.path, decision.reason, decision.backend)
    with settings.use_backend("triton"):  # a backend named explicitly runs wherever it works: a fused decision
        guard.decide("capture.attn", q, cuda_metadata([6, 1], [0, 9]), layer, cache)
        torch.cuda.synchronize()
        decision = no_sync(guard.decide, "capture.attn", q, cuda_metadata([1, 6, 1, 7], [5, 0, 40, 12]), layer, cache)
    assert (decision.path, decision.backend, decision.post_quantized) == ("fused", "triton", {"decode_tokens": 2})
    mla = SimpleNamespace(num_actual_tokens=4, num_decode_tokens=4, num_prefills=0, prefill=None)
    mla_layer = SimpleNamespace(kv_b_proj=None, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_heads=H,
                                kv_lora_rank=64, kv_cache_dtype="auto", impl=SimpleNamespace(is_sparse=False),
                                hisparse_cache=None, use_pcp=False, layer_name="capture.mla")
    assert no_sync(guard.decide, "capture.mla", q, mla, mla_layer, cache).reason == "decode_tokens"


def vllm_op_stand_in(query, key, value, output, layer_name, **kwargs):
    """vLLM's attention op stood in for: a device computation of the query, capturable."""
    output.copy_(query * 0.5 + 0.25)


@pytest.mark.parametrize("query_lens,context_lens,reason", [
    ([1, 1, 1, 1], [5, 9, 40, 3], "decode_tokens"),       # vLLM's full CUDA graphs: decode-only batches
    ([1, 6, 1], [5, 0, 40], "cuda_graph_capture"),         # a batch with prefill rows captured (FULL mode)
])
def test_the_decision_and_the_fallback_are_captured_in_a_cuda_graph(monkeypatch, query_lens, context_lens, reason):
    layer, cache = standard_layer(), kv_cache()
    md = cuda_metadata(query_lens, context_lens)
    n = sum(query_lens)
    monkeypatch.setattr(attention_op, "_context", lambda name: (md, layer, cache))
    seen = []
    monkeypatch.setattr(counters, "record", lambda decision, layer_name=None: seen.append(decision.reason))
    q = torch.randn(n, H, D, device="cuda").to(torch.bfloat16)
    k = torch.randn(n, HK, D, device="cuda").to(torch.bfloat16)
    gs = torch.tensor([448.0 * 6.0 / 2.0], device="cuda")
    rows, cols = nvfp4.scale_shape(n, K)
    packed = torch.zeros(n, K // 2, dtype=torch.uint8, device="cuda")
    scales = torch.zeros(rows, cols // 4, dtype=torch.int32, device="cuda")

    def call():
        attention_op._run(vllm_op_stand_in, (q, k, k), packed, "capture.attn", gs, scales, {}, H)

    # warm-up of the fallback (the quant kernel compiles), as vLLM's warm-up runs precede its captures
    attention_op._run_unfused(vllm_op_stand_in, (q, k, k), packed, "capture.attn", gs, scales, {}, H)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        no_sync(call)
    assert seen[-1] == reason
    q.copy_(torch.randn(n, H, D, device="cuda").to(torch.bfloat16))  # a new step's queries, same buffers
    graph.replay()
    torch.cuda.synchronize()
    want_packed, want_scales = nvfp4.quantize((q * 0.5 + 0.25).reshape(n, K).cpu(), gs.cpu())
    assert torch.equal(packed.cpu(), want_packed)
    assert torch.equal(scales.cpu().view(torch.uint8), want_scales.view(torch.uint8))
