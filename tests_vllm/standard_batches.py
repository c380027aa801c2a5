"""Batches for the standard-layer tests without an engine: vLLM's real CPU attention backend (its impl's
``forward`` and ``do_kv_cache_update``, its metadata and scheduler) on a stand-in layer, a paged KV cache with
shuffled blocks holding every request's keys and values, requests in any order (decode and prefill rows
interleaved, as vLLM's standard backends keep them)."""

from types import SimpleNamespace

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadata, _get_attn_isa

from fusion_pass import nvfp4
from fusion_pass.vllm import releases

H, HK, D = 4, 2, 64
K = H * D
GS = torch.tensor([448.0 * 6.0 / 2.0])
torch._C._cpu._init_amx()  # what vLLM's CPU worker does before its AMX kernels run


def cpu_impl(scale: float = D ** -0.5):
    """vLLM's ``CPUAttentionBackendImpl`` without a vLLM config (its ``__init__`` reads the model's dtype)."""
    impl = CPUAttentionBackendImpl.__new__(CPUAttentionBackendImpl)
    impl.num_heads, impl.head_size, impl.scale, impl.num_kv_heads = H, D, scale, HK
    impl.num_queries_per_kv = H // HK
    impl.alibi_slopes, impl.sliding_window, impl.logits_soft_cap, impl.sinks = None, -1, 0, None
    impl.kv_cache_dtype, impl.is_fp8_kv_cache, impl.attn_type = "auto", False, "decoder"
    impl.kv_sharing_target_layer_name, impl.use_zentorch_sdpa = None, False
    return impl


class StandInLayer:
    """What the op reads of vLLM's ``Attention`` layer, with vLLM's CPU attention impl."""

    def __init__(self, block_size: int, backend: str = "CPU_ATTN", isa: str | None = None):
        self.num_heads, self.num_kv_heads, self.head_size = H, HK, D
        self.kv_cache_dtype, self.attn_type, self.layer_name = "auto", "decoder", "stand_in.attn"
        self.kv_sharing_target_layer_name = None
        self.impl = cpu_impl()
        self.isa = isa or _get_attn_isa(torch.bfloat16, block_size, D)
        self._k_scale_float = self._v_scale_float = 1.0
        self.attn_backend = SimpleNamespace(get_name=lambda: backend)


def batch(requests, block_size: int = 32, seed: int = 0, layer=None, split_kv: bool = True):
    """``requests``: ``(query_len, context_len)`` per request, in row order. Returns ``(layer, (q, k, v), md,
    kv_cache, full)``: ``full[i] = (keys, values)`` of request ``i``'s whole sequence (context, then new tokens),
    every position written into the paged cache through the layer's own cache write."""
    g = torch.Generator().manual_seed(seed)
    layer = layer or StandInLayer(block_size)
    blocks_per = [-(-(q + c) // block_size) for q, c in requests]
    num_blocks = sum(blocks_per) + 3
    order = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(requests), max(blocks_per), dtype=torch.int32)
    kv_cache = torch.zeros(num_blocks, HK, block_size, 2 * D, dtype=torch.bfloat16)
    used, full, qs, ks, vs, slots = 0, [], [], [], [], []
    for i, (lq, lc) in enumerate(requests):
        table[i, : blocks_per[i]] = order[used:used + blocks_per[i]]
        used += blocks_per[i]
        keys = torch.randn(lc + lq, HK, D, generator=g).to(torch.bfloat16)
        values = torch.randn(lc + lq, HK, D, generator=g).to(torch.bfloat16)
        positions = torch.arange(lc + lq)
        slot = table[i, positions // block_size].long() * block_size + positions % block_size
        layer.impl.do_kv_cache_update(layer, keys, values, kv_cache, slot)
        full.append((keys, values))
        qs.append(torch.randn(lq, H, D, generator=g).to(torch.bfloat16))
        ks.append(keys[lc:])
        vs.append(values[lc:])
        slots.append(slot[lc:])
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    query_lens = [lq for lq, _ in requests]
    loc = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([lq + lc for lq, lc in requests], dtype=torch.int32)
    schedule = releases.resolve("cpu_attn_get_scheduler_metadata")(
        num_reqs=len(requests), num_heads=H, num_kv_heads=HK, head_dim=D, seq_lens=seq_lens, dtype=torch.bfloat16,
        query_start_loc=loc, causal=True, sliding_window_size=-1, isa=layer.isa, enable_kv_split=split_kv)
    md = CPUAttentionMetadata(num_actual_tokens=int(loc[-1]), max_query_len=max(query_lens), query_start_loc=loc,
                              max_seq_len=int(seq_lens.max()), seq_lens=seq_lens, block_table=table,
                              slot_mapping=torch.cat(slots), scheduler_metadata=schedule, causal=True)
    return layer, (q, k, v), md, kv_cache, full


def vllm_attention(layer, inputs, md, kv_cache):
    """vLLM's attention of the whole batch, as the unfused graph computes it: ``[T, H, D]`` bf16."""
    q, k, v = inputs
    out = torch.empty_like(q)
    layer.impl.forward(layer, q, k, v, kv_cache, md, output=out)
    return out


def reference_prefill(layer, q_rows, keys, values, context: int):
    """float32 attention of one prefill's new tokens over its context and themselves, causal aligned to the end."""
    lq = q_rows.shape[0]
    kk = keys.float().repeat_interleave(H // HK, dim=1)
    vv = values.float().repeat_interleave(H // HK, dim=1)
    s = torch.einsum("qhd,khd->hqk", q_rows.float(), kk) * layer.impl.scale
    mask = torch.ones(lq, context + lq, dtype=torch.bool).tril(context)
    return torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), vv).reshape(lq, K)


def buffers(n: int, fill: int = 0x77):
    """uint8 ``[n, K/2]`` and vLLM's int32 swizzled scale buffer, every byte ``fill``."""
    rows, cols = nvfp4.scale_shape(n, K)
    return (torch.full((n, K // 2), fill, dtype=torch.uint8),
            torch.full((rows, cols), fill, dtype=torch.uint8).view(torch.int32))


def row_scale_bytes(scales, rows, k=K):
    cols = nvfp4.scale_shape(1, k)[1]
    rows = torch.tensor(list(rows), dtype=torch.long)
    offsets = nvfp4.swizzled_offset(rows[:, None], torch.arange(cols)[None, :], k // nvfp4.BLOCK_SIZE)
    return scales.view(torch.uint8).view(-1)[offsets]
