"""The vLLM op's decision and exact fallback: host-side only, and captured in a CUDA graph (issue 18, item 7).

vLLM runs the attention op once per layer per step, eagerly between compiled pieces and inside a full CUDA graph for
decode-only batches; the op decides from host-side metadata (fusion_pass/vllm/adapters/host_rows.py) and under capture takes
the path that needs no decision. These tests need no vLLM: the op's run-time modules import without it, and vLLM's
forward context, its attention op and its metadata are stood in for (what vLLM's FlashAttention builder hands the op,
plus the host copies the build hook keeps). On the CPU: the decision on metadata whose device tensors are meta
tensors (which cannot be read), the fallback through the op. On a CUDA device (skipped without one): no host
synchronization (``torch.cuda.set_sync_debug_mode("error")``) and the capture of the op in a CUDA graph.

    pytest tests/vllm_op/test_capture.py    # on a CUDA machine, vLLM not needed
"""

import copy
import importlib.util
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from fusion_pass import nvfp4
from fusion_pass.runtime import counters, settings
from fusion_pass.vllm.runtime import attention_op, guard
from fusion_pass.vllm.adapters import host_rows

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (run on the H200: no vLLM needed)")

H, HK, D, BLOCK = 4, 2, 64, 16
K = H * D


def standard_layer(name: str = "capture.attn"):
    """What the op reads of vLLM's Attention layer on the FLASH_ATTN backend."""
    impl = SimpleNamespace(sliding_window=None, alibi_slopes=None, sinks=None, logits_soft_cap=None,
                           scale=D ** -0.5, head_size=D, num_heads=H, num_kv_heads=HK)
    return SimpleNamespace(num_heads=H, num_kv_heads=HK, head_size=D, kv_cache_dtype="auto", attn_type="decoder",
                           layer_name=name, kv_sharing_target_layer_name=None, impl=impl,
                           attn_backend=SimpleNamespace(get_name=lambda: "FLASH_ATTN"))


def device_metadata(query_lens, context_lens, device, host: bool = True):
    """FlashAttention-shaped metadata of ``device`` tensors; with ``host``, the host copies the build hook keeps."""
    seq = [q + c for q, c in zip(query_lens, context_lens)]
    loc = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    blocks = max(-(-s // BLOCK) for s in seq)
    md = SimpleNamespace(
        num_actual_tokens=sum(query_lens), max_query_len=max(query_lens), max_seq_len=max(seq),
        query_start_loc=loc.to(device), seq_lens=torch.tensor(seq, dtype=torch.int32).to(device),
        block_table=torch.arange(len(seq) * blocks, dtype=torch.int32).view(len(seq), blocks).to(device),
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.long).to(device), scheduler_metadata=None,
        max_num_splits=0, causal=True, mm_prefix_query_range_tensor=None, rswa_prefix_lens=None,
        dcp_context_kv_lens=None)
    if host:
        host_rows.attach(md, SimpleNamespace(query_start_loc_cpu=loc, num_reqs=len(seq),
                                             seq_lens_cpu_upper_bound=torch.tensor(seq, dtype=torch.int32)))
    return md


def kv_cache(device, num_blocks: int = 64):
    """A FLASH_ATTN-shaped cache of seeded random keys and values (nothing on the meta device)."""
    g = torch.Generator().manual_seed(7)
    if torch.device(device).type == "meta":
        return torch.empty(num_blocks, HK, BLOCK, 2 * D, dtype=torch.bfloat16, device=device)
    return torch.randn(num_blocks, HK, BLOCK, 2 * D, generator=g).to(torch.bfloat16).to(device)


def mla_stand_ins():
    md = SimpleNamespace(num_actual_tokens=4, num_decode_tokens=4, num_prefills=0, prefill=None)
    layer = SimpleNamespace(kv_b_proj=None, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_heads=H,
                            kv_lora_rank=64, kv_cache_dtype="auto", impl=SimpleNamespace(is_sparse=False),
                            hisparse_cache=None, use_pcp=False, layer_name="capture.mla")
    return md, layer


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                    reason="checks an environment without vLLM (this suite's and the H200's); vLLM is installed here")
def test_the_run_time_modules_import_without_vllm():
    code = ("import sys\nfrom fusion_pass.vllm.runtime import attention_op, guard, fused_rows, fused_standard\n"
            "from fusion_pass.vllm.adapters import cpu_attn, flash_attn, flashinfer, host_rows, layer, mla, registry\n"
            "from fusion_pass.vllm import notices, releases\n"
            "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if m.startswith('vllm'))\nprint('OK')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (proc.stdout + proc.stderr)[-3000:]


def test_the_decision_reads_no_device_tensor_of_the_metadata():
    """Every tensor of the metadata, the query and the cache on the meta device, which holds no values: reading
    one raises. The decision comes from the host copies and the metadata's ints."""
    with pytest.raises(NotImplementedError):  # the detector works: a meta tensor cannot be read
        torch.ones(1, device="meta").tolist()
    layer, cache = standard_layer("meta.attn"), kv_cache("meta")
    q = torch.empty(16, H, D, dtype=torch.bfloat16, device="meta")
    cases = [(device_metadata([1, 1, 1], [5, 9, 40], "meta"), "off", "decode_tokens", 0, 3),
             (device_metadata([1, 6, 1, 7], [5, 0, 40, 12], "meta"), "off", None, 13, 15),  # offered as one call
             (device_metadata([1, 6, 1, 7], [5, 0, 40, 12], "meta"), "on", None, 13, 15),
             (device_metadata([6, 7], [0, 12], "meta"), "off", None, 13, 13),
             (device_metadata([1, 1], [5, 9], "meta", host=False), "off", "decode_tokens", 0, 2),
             (device_metadata([1, 6], [5, 0], "meta", host=False), "off", "no_host_metadata", 0, 7)]
    for md, split, reason, prefill, tokens in cases:
        with settings.use_split_mixed(split):
            decision = guard.decide("meta.attn", q, md, layer, cache)
        if reason is not None:
            assert decision.reason == reason, decision
        else:  # no fused backend runs on the meta device: the guard core's reason, after every row was read
            assert decision.reason in ("no_backend", "no_fast_backend"), decision
        assert decision.prefill_tokens == prefill and sum(decision.post_quantized.values()) == tokens, decision
    md, mla_layer = mla_stand_ins()
    assert guard.decide("capture.mla", q, md, mla_layer, cache).reason == "decode_tokens"


def vllm_op_stand_in(query, key, value, output, layer_name, *rest):
    """vLLM's attention op stood in for (called as the op calls vLLM's: ``output_scale``, ``output_block_scale``
    None, then ``kv_cache_dummy_dep``): a device computation of the query, capturable."""
    assert rest == (None, None), rest
    output.copy_(query * 0.5 + 0.25)


def op_call(monkeypatch, device, query_lens, context_lens):
    """(call, its queries, packed, scales, global scale, decisions counted) of the standard op on a stand-in step."""
    layer, cache = standard_layer(), kv_cache(device)
    md = device_metadata(query_lens, context_lens, device)
    n = sum(query_lens)
    monkeypatch.setattr(attention_op, "_context", lambda name: (md, layer, cache))
    seen = []
    monkeypatch.setattr(counters, "record", lambda decision, layer_name=None: seen.append(decision.reason))
    q = torch.randn(n, H, D, device=device).to(torch.bfloat16)
    k = torch.randn(n, HK, D, device=device).to(torch.bfloat16)
    gs = torch.tensor([448.0 * 6.0 / 2.0], device=device)
    rows, cols = nvfp4.scale_shape(n, K)
    packed = torch.zeros(n, K // 2, dtype=torch.uint8, device=device)
    scales = torch.zeros(rows, cols // 4, dtype=torch.int32, device=device)

    def call():
        attention_op._run(vllm_op_stand_in, (q, k, k), packed, "capture.attn", gs, scales, (), H)

    return call, md, q, packed, scales, gs, seen


def expected(q, gs):
    n = q.shape[0]
    return nvfp4.quantize((q.float().cpu() * 0.5 + 0.25).to(torch.bfloat16).reshape(n, K), gs.cpu())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_the_fallback_through_the_op_is_the_unfused_quant_and_its_step_is_kept(monkeypatch, device):
    """A decode-only step through the op: vLLM's op into the step's temporary, then the quant op: the unfused
    bytes. The step (its decision and temporary) is kept on the metadata object for the step's other layers, not
    on a shallow copy of it (vLLM copies metadata per KV-cache group)."""
    call, md, q, packed, scales, gs, seen = op_call(monkeypatch, device, [1, 1, 1, 1], [5, 9, 40, 3])
    call()
    step = getattr(md, attention_op._STEP)
    assert seen == ["decode_tokens"] and step.decision.reason == "decode_tokens" and step.buffer is not None
    want_packed, want_scales = expected(q, gs)
    assert torch.equal(packed.cpu(), want_packed)
    assert torch.equal(scales.cpu().view(torch.uint8), want_scales.view(torch.uint8))
    buffer = step.buffer[1]
    q.copy_(torch.randn_like(q, dtype=torch.float32).to(torch.bfloat16))  # the next layer of the step
    call()
    assert getattr(md, attention_op._STEP) is step and step.buffer[1] is buffer and seen == ["decode_tokens"] * 2
    want_packed, want_scales = expected(q, gs)
    assert torch.equal(packed.cpu(), want_packed)
    assert torch.equal(scales.cpu().view(torch.uint8), want_scales.view(torch.uint8))
    copied = copy.copy(md)
    monkeypatch.setattr(attention_op, "_context", lambda name: (copied, standard_layer(), kv_cache(device)))
    call()
    assert getattr(copied, attention_op._STEP) is not step


def test_a_mixed_step_through_the_op_is_one_fused_call_by_default(monkeypatch):
    """A mixed step (decode rows beside prefill rows) through the op on the CPU: a bad value of the split variable
    raises naming it before vLLM's op runs or a buffer is written; by default every row in one fused launch over the
    paged cache (the reference backend: the reference paged attention quantized, every row); with a backend without
    such a launch the exact fallback, every row counted as ``mixed_not_split``, the unfused bytes on every row."""
    from fusion_pass.kernels import reference
    from fusion_pass.runtime import backends

    call, md, q, packed, scales, gs, seen = op_call(monkeypatch, "cpu", [1, 6, 1, 7], [5, 0, 40, 12])
    counted = []
    monkeypatch.setattr(counters, "record", lambda decision, layer_name=None: counted.append(
        (decision.post_quantized, decision.decode_fused)))
    # no vLLM here: its KV-connector hooks stood in for by what they do without a connector (nothing)
    monkeypatch.setattr(attention_op, "_kv_transfer_utils", lambda: SimpleNamespace(has_kv_transfer_group=lambda: False))
    monkeypatch.setenv(settings.SPLIT_MIXED_ENV, "maybe")
    with pytest.raises(ValueError, match="FUSION_PASS_VLLM_SPLIT_MIXED='maybe' is not a split mode"):
        call()
    assert not counted and not packed.any() and not scales.any()
    monkeypatch.delenv(settings.SPLIT_MIXED_ENV)
    call()
    assert counted == [({}, 2)]
    _, layer, cache = attention_op._context("capture.attn")
    keys, values = cache.transpose(1, 2).split(D, -1)
    out, _ = reference.paged_attention(q, keys, values, md.query_start_loc, md.seq_lens, md.block_table, True,
                                       layer.impl.scale)
    want_packed, want_scales = nvfp4.quantize(out.reshape(q.shape[0], K), gs)
    assert torch.equal(packed, want_packed) and out.abs().max() > 0.05
    assert torch.equal(scales.view(torch.uint8), want_scales.view(torch.uint8))
    monkeypatch.setattr(backends.get_backend("reference"), "handles_paged", False)
    call, md, q, packed, scales, gs, seen = op_call(monkeypatch, "cpu", [1, 6, 1, 7], [5, 0, 40, 12])
    monkeypatch.setattr(counters, "record", lambda decision, layer_name=None: counted.append(
        (decision.post_quantized, decision.decode_fused)))
    call()
    assert counted[-1] == ({"mixed_not_split": 15}, 0)
    want_packed, want_scales = expected(q, gs)
    assert torch.equal(packed, want_packed)
    assert torch.equal(scales.view(torch.uint8), want_scales.view(torch.uint8))


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


@needs_cuda
def test_the_decision_reads_no_device_tensor():
    with pytest.raises(SyncError):  # the detector works: reading a device value back is a synchronization
        no_sync(lambda: torch.ones(1, device="cuda").item())
    layer, cache = standard_layer(), kv_cache("cuda")
    q = torch.zeros(16, H, D, dtype=torch.bfloat16, device="cuda")
    guard.decide("capture.attn", q, device_metadata([6, 1], [0, 9], "cuda"), layer, cache)  # backend detection
    torch.cuda.synchronize()
    cases = [(device_metadata([1, 1, 1], [5, 9, 40], "cuda"), "off", "decode_tokens"),  # decode-only, host copies
             (device_metadata([1, 6, 1, 7], [5, 0, 40, 12], "cuda"), "off", None),  # mixed: one call, or policy
             (device_metadata([1, 6, 1, 7], [5, 0, 40, 12], "cuda"), "on", None),       # mixed + context, split
             (device_metadata([1, 1], [5, 9], "cuda", host=False), "off", "decode_tokens"),  # no host copies
             (device_metadata([1, 6], [5, 0], "cuda", host=False), "off", "no_host_metadata")]
    for md, split, reason in cases:
        with settings.use_split_mixed(split):
            decision = no_sync(guard.decide, "capture.attn", q, md, layer, cache)
        if reason is not None:
            assert decision.reason == reason, decision
        else:  # fused where a fused backend is picked and the policy fuses the class (not mixed calls on an H200)
            assert decision.fused or decision.reason in ("no_backend", "no_fast_backend", "slower_here"), decision
            print("mixed batch with context:", decision.path, decision.reason, decision.backend)
    with settings.use_backend("triton"), settings.use_split_mixed("on"):  # a backend named explicitly runs
        # wherever it works: a fused decision
        guard.decide("capture.attn", q, device_metadata([6, 1], [0, 9], "cuda"), layer, cache)
        torch.cuda.synchronize()
        decision = no_sync(guard.decide, "capture.attn", q, device_metadata([1, 6, 1, 7], [5, 0, 40, 12], "cuda"),
                           layer, cache)
    # one launch over the paged cache, decode rows included (a named backend: no policy)
    assert (decision.path, decision.backend, decision.one_call, decision.decode_fused) == ("fused", "triton", True, 2)
    assert decision.post_quantized == {}
    md, mla_layer = mla_stand_ins()
    assert no_sync(guard.decide, "capture.mla", q, md, mla_layer, cache).reason == "decode_tokens"


@needs_cuda
@pytest.mark.parametrize("query_lens,context_lens,reason", [
    ([1, 1, 1, 1], [5, 9, 40, 3], "decode_tokens"),       # vLLM's full CUDA graphs: decode-only batches
    ([1, 6, 1], [5, 0, 40], "cuda_graph_capture"),         # a batch with prefill rows captured (FULL mode)
])
def test_the_decision_and_the_fallback_are_captured_in_a_cuda_graph(monkeypatch, query_lens, context_lens, reason):
    call, md, q, packed, scales, gs, seen = op_call(monkeypatch, "cuda", query_lens, context_lens)
    n = q.shape[0]
    # warm-up of the fallback (the quant kernel compiles), as vLLM's warm-up runs precede its captures
    attention_op._run_unfused(vllm_op_stand_in, (q, q, q), packed, "capture.attn", gs, scales, (), H)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        no_sync(call)
    assert seen[-1] == reason
    q.copy_(torch.randn(n, H, D, device="cuda").to(torch.bfloat16))  # a new step's queries, same buffers
    graph.replay()
    torch.cuda.synchronize()
    want_packed, want_scales = expected(q, gs)
    assert torch.equal(packed.cpu(), want_packed)
    assert torch.equal(scales.cpu().view(torch.uint8), want_scales.view(torch.uint8))
