"""The MLA run-time op's row-wise paths without an engine: a stand-in MLA layer (its ``forward_impl``
records the rows it is given), vLLM-shaped metadata, a paged latent cache.

The engine tests (test_vllm_engine.py) run the same code inside vLLM; these pin what an engine on vLLM's CPU
build cannot show: decode rows sharing a 128-row scale tile with prefill rows that the backend's entry
point clobbers, more than 128 decode rows, the guard's refusals, vLLM's KV-connector hooks around fused
calls."""

from types import SimpleNamespace

import pytest
import torch

import fusion_pass.ops  # noqa: F401  (torch.ops.fusion_pass.scaled_fp4_quant, the unfused graph's quant op on CPU)
from fusion_pass import nvfp4
from fusion_pass.runtime import backends, settings
from fusion_pass.vllm.runtime import attention_op, fused_rows, guard

H, NOPE, ROPE, DV, LORA, BLOCK = 4, 32, 16, 32, 64, 16
K = H * DV
GS = torch.tensor([448.0 * 6.0 / 2.0])


class StandInMLA:
    """What the op reads of vLLM's ``MLAAttention``; ``forward_impl`` writes a function of its query rows."""

    num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank = H, NOPE, ROPE, DV, LORA
    kv_cache_dtype, hisparse_cache, use_pcp, layer_name = "auto", None, False, "stand_in.attn"
    impl = SimpleNamespace(is_sparse=False)

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.weight = (torch.randn(LORA, H * (NOPE + DV), generator=g) / LORA ** 0.5).to(torch.bfloat16)
        self.scale = (NOPE + ROPE) ** -0.5
        self.kv_b_proj = lambda x: (x @ self.weight,)
        self.forward_impl_rows: list[int] = []

    def forward_impl(self, q, kv_c_normed, k_pe, kv_cache, attn_metadata, output, **kwargs):
        self.forward_impl_rows.append(q.shape[0])
        output.copy_(self.decode_output(q))

    @staticmethod
    def decode_output(q):
        return (q[..., :DV] * 1.5).reshape(q.shape[0], K)


class VllmStructure(StandInMLA):
    """Has the source of vLLM's ``MLAAttention.forward_impl`` (only read by the guard)."""

    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    forward_impl = MLAAttention.forward_impl


def metadata(decode: int, query_lens: list[int], context_lens: list[int], block_table=None):
    prefill = SimpleNamespace(
        query_lens_cpu=torch.tensor(query_lens), block_table=block_table,
        query_start_loc=torch.tensor([0] + query_lens).cumsum(0),
        chunked_context=SimpleNamespace(context_lens_list=list(context_lens)) if any(context_lens) else None)
    return SimpleNamespace(num_actual_tokens=decode + sum(query_lens), num_decode_tokens=decode,
                           num_prefills=len(query_lens), prefill=prefill if query_lens else None, causal=True)


def batch(decode: int, query_lens: list[int], context_lens: list[int], seed: int = 1):
    """Inputs, metadata and a paged latent cache whose blocks are shuffled per request."""
    g = torch.Generator().manual_seed(seed)
    n = decode + sum(query_lens)
    q = torch.randn(n, H, NOPE + ROPE, generator=g).to(torch.bfloat16)
    kv_c = torch.randn(n, LORA, generator=g).to(torch.bfloat16)
    k_pe = torch.randn(n, 1, ROPE, generator=g).to(torch.bfloat16)
    per_request = max([-(-c // BLOCK) for c in context_lens] + [1])
    num_blocks = per_request * max(len(context_lens), 1) + 3
    kv_cache = torch.randn(num_blocks, BLOCK, LORA + ROPE, generator=g).to(torch.bfloat16)
    block_table = torch.randperm(num_blocks, generator=g)[: per_request * max(len(context_lens), 1)]
    block_table = block_table.view(max(len(context_lens), 1), per_request).to(torch.int32)
    return (q, kv_c, k_pe), metadata(decode, query_lens, context_lens, block_table), kv_cache


def buffers(n: int, fill: int = 0x77):
    rows, cols = nvfp4.scale_shape(n, K)
    """uint8 ``[n, K/2]`` and vLLM's int32 swizzled scale buffer, every byte ``fill``."""
    return (torch.full((n, K // 2), fill, dtype=torch.uint8),
            torch.full((rows, cols), fill, dtype=torch.uint8).view(torch.int32))


def row_scale_bytes(scales, rows, k=K):
    cols = nvfp4.scale_shape(1, k)[1]
    rows = torch.tensor(list(rows), dtype=torch.long)
    offsets = nvfp4.swizzled_offset(rows[:, None], torch.arange(cols)[None, :], k // nvfp4.BLOCK_SIZE)
    return scales.view(torch.uint8).view(-1)[offsets]


def expected_prefill(layer, inputs, md, kv_cache):
    """float32 attention of each prefill over its cached context (gathered position by position) and its new
    tokens, causal aligned to the end: ``[P, H*Dv]``."""
    q, kv_c, k_pe = inputs
    d = md.num_decode_tokens
    out, row = [], d
    for i, (lq, lc) in enumerate(zip(md.prefill.query_lens_cpu.tolist(), md.prefill.chunked_context.context_lens_list
                                      if md.prefill.chunked_context else [0] * md.num_prefills)):
        cached = torch.stack([kv_cache[md.prefill.block_table[i, p // BLOCK], p % BLOCK] for p in range(lc)]) \
            if lc else kv_cache.new_zeros(0, LORA + ROPE)
        latent = torch.cat([cached[:, :LORA], kv_c[row:row + lq]])
        pe = torch.cat([cached[:, LORA:], k_pe[row:row + lq, 0]])
        kv = layer.kv_b_proj(latent)[0].view(-1, H, NOPE + DV)
        k = torch.cat([kv[..., :NOPE], pe[:, None, :].expand(-1, H, ROPE)], -1).float()
        v = kv[..., NOPE:].float()
        s = torch.einsum("qhd,khd->hqk", q[row:row + lq].float(), k) * layer.scale
        mask = torch.ones(lq, lc + lq, dtype=torch.bool).tril(lc)
        p = s.masked_fill(~mask, float("-inf")).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", p, v).reshape(lq, K))
        row += lq
    return torch.cat(out)


@pytest.mark.parametrize("decode,query_lens,context_lens", [
    (3, [5, 9], [0, 0]),          # mixed, no context: one 128-row tile shared by decode and prefill rows
    (2, [7, 4], [40, 0]),         # mixed with a chunked prefill beside a fresh one
    (0, [4], [48]),               # a prefix-cache hit
    (130, [6, 3], [17, 33]),      # decode rows spanning two tiles, the second shared with prefill rows
])
@pytest.mark.parametrize("workspace", [None, 7])  # the default bound (one call), and context chunks of 7 rows
def test_mla_rows_decode_exact_prefill_fused_with_context(decode, query_lens, context_lens, workspace):
    layer = StandInMLA()
    inputs, md, kv_cache = batch(decode, query_lens, context_lens)
    n = md.num_actual_tokens
    packed, scales = buffers(n + 5)  # 5 padding rows past num_actual_tokens
    with settings.use_context_workspace_tokens(workspace):
        fused_rows._run_fused_mla(backends.get_backend("reference"), md, layer, kv_cache, inputs, packed, GS,
                                  scales)
    assert layer.forward_impl_rows == ([decode] if decode else [])
    decode_out = layer.decode_output(inputs[0][:decode])
    full = torch.cat([decode_out.float(), expected_prefill(layer, inputs, md, kv_cache)])
    want_packed, want_scales = nvfp4.quantize(full, GS)
    # decode rows: the unfused graph's bytes (per-row quantization of forward_impl's query-dtype output)
    assert torch.equal(packed[:decode], want_packed[:decode])
    assert torch.equal(row_scale_bytes(scales, range(decode)), row_scale_bytes(want_scales, range(decode)))
    # prefill rows: float32 attention over context + new keys, quantized
    got = nvfp4.dequantize(packed[:n], scales, GS, m=n)[decode:]
    ref = full[decode:]
    assert ((got - ref).abs() <= 2 * nvfp4.error_bound(ref, GS) + ref.abs() * 2.0 ** -7).all()
    # padding rows zeroed, scale bytes past the real rows of the last tile zeroed
    assert not packed[n:].any()
    assert not row_scale_bytes(scales, range(n, nvfp4.round_up(n, 128))).any()


class ClobberingBackend:
    """The reference backend whose entry point then sets every scale byte of the last 128-row tile and every
    packed byte outside its rows to 0xEE: rows written by anyone else must go in after it."""

    name, handles_context = "clobbering", True

    def run_varlen(self, q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, output_scale, output_block_scale,
                   **kwargs):
        backends.get_backend("reference").run_varlen(q, k, v, cu_seqlens, max_seqlen, softmax_scale, output,
                                                     output_scale, output_block_scale, **kwargs)
        a, b = int(cu_seqlens[0]), int(cu_seqlens[-1])
        output[:a] = 0xEE
        flat = output_block_scale.view(torch.uint8).view(-1)
        flat[flat.numel() - 128 * (flat.numel() // output_block_scale.shape[0]):] = 0xEE
        self.prefill_scales = row_scale_bytes(output_block_scale, range(a, b)).clone()


def test_decode_rows_go_in_after_the_backend_and_touch_no_prefill_row_of_their_tile():
    layer, backend = StandInMLA(), ClobberingBackend()
    inputs, md, kv_cache = batch(5, [6, 7], [0, 20])
    n = md.num_actual_tokens
    packed, scales = buffers(n)
    fused_rows._run_fused_mla(backend, md, layer, kv_cache, inputs, packed, GS, scales)
    want_packed, want_scales = nvfp4.quantize(layer.decode_output(inputs[0][:5]), GS)
    assert torch.equal(packed[:5], want_packed)
    assert torch.equal(row_scale_bytes(scales, range(5)), row_scale_bytes(want_scales, range(5)))
    # the prefill rows keep what the backend left there, clobbered scale bytes included
    assert torch.equal(row_scale_bytes(scales, range(5, n)), backend.prefill_scales)
    assert (backend.prefill_scales == 0xEE).all()


def test_guard_fuses_mla_prefill_rows_beside_decode_rows_and_context():
    layer = VllmStructure()
    inputs, md, kv_cache = batch(3, [5, 9], [0, 40])
    decision = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache)
    assert (decision.path, decision.reason, decision.backend) == ("fused", None, "reference")
    assert (decision.prefill_tokens, decision.fused_tokens, decision.post_quantized) == (14, 14, {"decode_tokens": 3})
    assert "3 decode row(s)" in decision.detail and "40 cached context token(s)" in decision.detail


def test_guard_falls_back_where_rows_cannot_be_computed_apart():
    inputs, md, kv_cache = batch(3, [5, 9], [0, 40])
    # a forward_impl without vLLM's decode/prefill split: decode rows cannot be computed alone
    decision = guard.decide("stand_in.attn", inputs[0], md, StandInMLA(), kv_cache)
    assert (decision.path, decision.reason) == ("fallback", "decode_tokens")
    assert "is not vLLM 0.32.x's MLAAttention.forward_impl" in decision.detail
    assert "may not split decode and prefill rows" in decision.detail
    assert decision.post_quantized == {"decode_tokens": 17} and decision.prefill_tokens == 14
    # a cache that is not the unquantized latent cache [num_blocks, block_size, L + R]
    decision = guard.decide("stand_in.attn", inputs[0], md, VllmStructure(), kv_cache.view(-1, LORA + ROPE))
    assert (decision.path, decision.reason) == ("fallback", "chunked_prefill")
    assert "is not the MLA latent cache" in decision.detail
    decision = guard.decide("stand_in.attn", inputs[0], md, VllmStructure(), kv_cache.to(torch.float8_e4m3fn))
    assert (decision.path, decision.reason) == ("fallback", "chunked_prefill")
    # decode-only batches, quantized-cache layers and no metadata, as before
    _, decode_only, _ = batch(4, [], [])
    decision = guard.decide("stand_in.attn", inputs[0], decode_only, VllmStructure(), kv_cache)
    assert (decision.reason, decision.prefill_tokens) == ("decode_tokens", 0)
    assert decision.post_quantized == {"decode_tokens": 4}
    quantized = VllmStructure()
    quantized.kv_cache_dtype = "fp8"
    assert guard.decide("stand_in.attn", inputs[0], md, quantized, kv_cache).reason == "layer_not_supported"
    assert guard.decide("stand_in.attn", inputs[0], None, VllmStructure(), kv_cache).reason == \
        "no_attention_metadata"


def test_guard_reads_the_layer_as_vllm_configures_it():
    """An explicit unquantized KV cache dtype (vLLM's way to override a checkpoint's FP8 KV scheme) is fused; an
    MLA layer with a sliding window is refused (the kernels attend to every earlier key); metadata without a
    prefill part (some platforms' sparse MLA) is read without error."""
    inputs, md, kv_cache = batch(3, [5, 9], [0, 40])
    for dtype in ("bfloat16", "float16", "auto"):
        layer = VllmStructure()
        layer.kv_cache_dtype = dtype
        assert guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache).path == "fused", dtype
    for dtype in ("fp8", "fp8_e4m3", "fp8_ds_mla"):
        layer = VllmStructure()
        layer.kv_cache_dtype = dtype
        assert guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache).reason == "layer_not_supported"
    windowed = VllmStructure()
    windowed.sliding_window = 4
    decision = guard.decide("stand_in.attn", inputs[0], md, windowed, kv_cache)
    assert (decision.reason, decision.detail) == ("layer_not_supported", "stand_in.attn: sliding window 4")
    no_prefill = SimpleNamespace(num_actual_tokens=8, num_decode_tokens=8)
    decision = guard.decide("stand_in.attn", inputs[0], no_prefill, VllmStructure(), kv_cache)
    assert (decision.path, decision.reason) == ("fallback", "decode_tokens")


def test_guard_refuses_mla_layers_whose_kv_b_proj_weight_vllm_released():
    """vLLM's AMX MLA backend (x86 CPUs with AMX) packs kv_b_proj's weight for its own kernels and releases the
    layer's: the fused path, which expands keys and values through kv_b_proj, must refuse the layer, not crash."""
    inputs, md, kv_cache = batch(3, [5, 9], [0, 40])
    amx = VllmStructure()
    amx.is_amx_bmm_enabled = True
    released = VllmStructure()
    released.kv_b_proj = SimpleNamespace(weight=torch.nn.Parameter(torch.empty(0), requires_grad=False))
    for layer in (amx, released):
        decision = guard.decide("stand_in.attn", inputs[0], md, layer, kv_cache)
        assert (decision.path, decision.reason) == ("fallback", "layer_not_supported")
        assert decision.detail == "stand_in.attn: kv_b_proj's weight released by vLLM's MLA backend (AMX MLA)"
        assert decision.post_quantized == {"layer_not_supported": 17}


def test_fused_calls_run_inside_vllms_kv_connector_hooks(monkeypatch):
    """With a KV connector (disaggregated prefill, external prefix caches), the layer's KV is loaded before the
    fused path reads cached context and saved after, as around vLLM's own attention op."""
    from vllm.model_executor.layers.attention import attention as vllm_attention
    from vllm.model_executor.layers.attention import kv_transfer_utils

    events = []
    layer = VllmStructure()
    expand = layer.kv_b_proj
    layer.kv_b_proj = lambda x: (events.append("fused path reads the cache"), expand(x))[1]
    inputs, md, kv_cache = batch(0, [4], [48])

    class Connector:
        def has_connector_metadata(self):
            return True

        def wait_for_layer_load(self, name):
            events.append(f"wait {name}")

        def save_kv_layer(self, name, cache, metadata):
            events.append(f"save {name}")

    monkeypatch.setattr(kv_transfer_utils, "has_kv_transfer_group", lambda: True)
    monkeypatch.setattr(kv_transfer_utils, "is_v1_kv_transfer_group", lambda: True)
    monkeypatch.setattr(kv_transfer_utils, "get_kv_transfer_group", lambda: Connector())
    monkeypatch.setattr(vllm_attention, "get_attention_context", lambda name: (md, layer, kv_cache, None))  # the hooks'
    monkeypatch.setattr(attention_op, "_context", lambda name: (md, layer, kv_cache))  # the op's
    attention_op._with_kv_transfer.cache_clear()  # decorated again with the patched context lookup
    try:
        packed, scales = buffers(md.num_actual_tokens)
        attention_op._run(None, inputs, packed, "stand_in.attn", GS, scales, (), None)
    finally:
        attention_op._with_kv_transfer.cache_clear()
    # kv_b_proj runs for the new tokens and for the cached context: every such call between the two hooks
    assert events[0] == "wait stand_in.attn" and events[-1] == "save stand_in.attn", events
    assert len(events) > 2 and set(events[1:-1]) == {"fused path reads the cache"}, events


def test_the_op_finds_the_fused_rows_and_the_quant_op_in_their_module_at_each_call(monkeypatch):
    """The seam tests_vllm/_engine.py and bench/vllm_op_overhead.py wrap: attention_op calls
    ``fused_rows.run_fused`` and ``fused_rows.quant_op()`` through the module, no alias of its own."""
    assert not hasattr(attention_op, "run_fused") and not hasattr(attention_op, "quant_op")
    layer = VllmStructure()
    inputs, md, kv_cache = batch(0, [4], [48])
    monkeypatch.setattr(attention_op, "_context", lambda name: (md, layer, kv_cache))
    seen = []
    run_fused, quant_op = fused_rows.run_fused, fused_rows.quant_op
    monkeypatch.setattr(fused_rows, "run_fused", lambda *a: (seen.append("fused rows"), run_fused(*a))[1])
    monkeypatch.setattr(fused_rows, "quant_op", lambda: (seen.append("quant op"), quant_op())[1])
    packed, scales = buffers(md.num_actual_tokens)
    attention_op._run(None, inputs, packed, "stand_in.attn", GS, scales, (), None)
    assert seen == ["fused rows"]
    attention_op._run_unfused(lambda *args: None, inputs, packed, "stand_in.attn", GS, scales)
    assert seen == ["fused rows", "quant op"]


class RecordingMLA(VllmStructure):
    """vLLM's forward_impl for the guard, a recorder for the decode rows."""

    def __init__(self):
        super().__init__()
        self.kwargs = []

    def forward_impl(self, q, kv_c_normed, k_pe, kv_cache, attn_metadata, output, **kwargs):
        self.kwargs.append(kwargs)
        output.copy_(self.decode_output(q))


def test_the_decode_rows_get_the_ops_prepared_decode_query_cut_to_them():
    """0.34's mqa_q_prepared (a decode query the model prepared itself) reaches vLLM's forward_impl for the decode
    rows, cut to them; absent (None) it is not passed (0.32 / 0.33's forward_impl has no such argument)."""
    from fusion_pass.vllm.adapters.registry import MLA

    layer, decode = RecordingMLA(), 3
    inputs, md, kv_cache = batch(decode, [5], [0])
    prepared = torch.randn(inputs[0].shape[0], H, 8)
    out = torch.empty(decode, K, dtype=torch.bfloat16)
    assert MLA.run_decode(layer, md, None, (*inputs, {"mqa_q_prepared": prepared}), kv_cache, out) == "forward_impl"
    assert torch.equal(layer.kwargs[-1]["mqa_q_prepared"], prepared[:decode])
    MLA.run_decode(layer, md, None, (*inputs, {"mqa_q_prepared": None}), kv_cache, out)
    assert layer.kwargs[-1] == {}


MLA_034_SCHEMA_PROBE = """
import torch
from fusion_pass.vllm import releases
release = next(r for r in releases.RELEASES if r.line == "0.34")
releases.current = lambda: release
import vllm.model_executor.layers.attention  # noqa: F401
from fusion_pass.vllm.runtime import attention_op
attention_op.register()
print("ARGS", [a.name for a in torch.ops.fusion_pass.vllm_mla_attention_nvfp4.default._schema.arguments])
print("TYPE", str(torch.ops.fusion_pass.vllm_mla_attention_nvfp4.default._schema.arguments[-2].type))
"""


def test_on_0_34_the_fused_mla_op_takes_mqa_q_prepared_as_vllms_op_does():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", MLA_034_SCHEMA_PROBE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    args = eval(proc.stdout.split("ARGS ", 1)[1].splitlines()[0])
    assert args[-3:] == ["q_dcp_replicated", "mqa_q_prepared", "output_inv_scale"] and len(args) == 15
    assert "TYPE Optional[Tensor]" in proc.stdout  # mqa_q_prepared; output_inv_scale is the project's own, last
