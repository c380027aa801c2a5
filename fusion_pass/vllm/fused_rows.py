"""The fused rows of a vLLM call: standard layers' pure-prefill batches, and MLA calls with prefill rows (their
decode rows computed by vLLM's own ``forward_impl`` and quantized by the unfused graph's quant op).

MLA: vLLM orders a batch's ``D = num_decode_tokens`` decode rows first, then the prefills. The prefill rows
``[D, num_actual_tokens)`` go through :func:`fusion_pass.runtime.row_plan.run_prefills`, keys and values
expanded from ``kv_c_normed`` through the layer's ``kv_b_proj`` with ``k_pe`` broadcast to every head, as vLLM's
MLA prefill does; prefills with cached context also attend to their context, read from the paged latent cache
(the prefills' block table and context lengths) and expanded the same way. Rows past ``num_actual_tokens``
(vLLM's padding) are zeroed.
"""

import torch

from fusion_pass import nvfp4
from fusion_pass.runtime import backends, row_plan
from fusion_pass.vllm.guard import is_mla, mla_batch

__all__ = ["quant_op", "run_fused"]


def quant_op():
    """The quant op the unfused graph calls (the one :func:`fusion_pass.vllm.vocabulary.vllm_vocabulary` matches)."""
    c = getattr(torch.ops, "_C", None)
    if c is not None and hasattr(c, "scaled_fp4_quant") and hasattr(c, "cutlass_scaled_fp4_mm"):
        return c.scaled_fp4_quant.out
    return torch.ops.fusion_pass.scaled_fp4_quant.out


def _prefill_inputs(layer, md, inputs):
    """``(q, k, v, cu_seqlens, max_seqlen, softmax_scale)`` of a standard layer's pure-prefill batch's
    ``num_actual_tokens`` rows: dense ``[n, H, D]`` / ``[n, Hk, D]`` / ``[n, Hk, D]`` in the query dtype."""
    n = md.num_actual_tokens
    q, k, v = (t[:n] for t in inputs)
    heads, kv_heads, d = layer.num_heads, layer.num_kv_heads, layer.head_size
    q, k, v = q.reshape(n, heads, d), k.reshape(n, kv_heads, d), v.reshape(n, kv_heads, d)
    return q, k, v, md.query_start_loc, md.max_query_len, layer.impl.scale


def _nvfp4_rows(output, output_block_scale, n: int):
    """``(packed uint8 [T, H*Dv/2], every scale byte (flat), the scale bytes of n rows [round_up(n, 128), cols])``."""
    tokens = output.shape[0]
    packed = output.view(tokens, -1)
    rows, cols = nvfp4.scale_shape(n, packed.shape[1] * 2)
    scale_bytes = output_block_scale.view(torch.uint8).view(-1)
    return packed, scale_bytes, scale_bytes[: rows * cols].view(rows, cols)


def _zero_padding(packed, scale_bytes, n: int) -> None:
    """Zero rows past ``n`` (vLLM pads batches for CUDA graphs) and the scale tiles past ``n``'s."""
    rows, cols = nvfp4.scale_shape(n, packed.shape[1] * 2)
    packed[n:].zero_()
    scale_bytes[rows * cols:].zero_()


def run_fused(backend_name: str, md, layer, kv_cache, inputs, output, output_scale, output_block_scale) -> None:
    """The fused backend on the batch's prefill rows (MLA: :func:`_run_fused_mla`); padding rows zeroed."""
    if is_mla(layer):
        _run_fused_mla(backends.get_backend(backend_name), md, layer, kv_cache, inputs, output, output_scale,
                       output_block_scale)
        return
    q, k, v, cu_seqlens, max_seqlen, softmax_scale = _prefill_inputs(layer, md, inputs)
    n = q.shape[0]
    packed, scale_bytes, scales = _nvfp4_rows(output, output_block_scale, n)
    backends.get_backend(backend_name).run_varlen(
        q, k, v, cu_seqlens.to(torch.int32), int(max_seqlen), float(softmax_scale),
        packed[:n], output_scale, scales)
    _zero_padding(packed, scale_bytes, n)


def _cached_latents(block_table, kv_cache, context_lens: list[int], lo: int, hi: int):
    """Rows ``[lo, hi)`` of the prefills' cached latents packed in request order (position ``0 ..
    context_lens[i]`` of each prefill's paged cache, one after the other): ``[hi - lo, L + R]`` in the cache
    dtype.

    ``block_table``: int ``[num_prefills, max_blocks]`` (``MLACommonPrefillMetadata.block_table``, the
    prefills' rows); ``kv_cache``: ``[num_blocks, block_size, L + R]``, position ``p`` of request ``i`` at
    ``kv_cache[block_table[i, p // block_size], p % block_size]`` (as vLLM's context gathers read it).
    """
    device = kv_cache.device
    lens = torch.tensor(context_lens, dtype=torch.long, device=device)
    ends = torch.cumsum(lens, 0)
    rows = torch.arange(lo, hi, device=device)
    request = torch.searchsorted(ends, rows, right=True)
    position = rows - (ends - lens)[request]
    block_size = kv_cache.shape[1]
    blocks = block_table.to(device)[request, position // block_size].long()
    return kv_cache[blocks, position % block_size]


def _expand(layer, latent, pe):
    """``k [S, H, Dqk]`` (``[k_nope, k_pe broadcast to every head]``) and ``v [S, H, Dv]`` of latent rows
    ``[S, L]`` and rotary keys ``[S, R]`` through ``kv_b_proj``, as vLLM's MLA prefill expands them."""
    heads, nope, rope, dv = layer.num_heads, layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim
    kv = layer.kv_b_proj(latent)[0].view(-1, heads, nope + dv)
    k_nope, v = kv.split([nope, dv], dim=-1)
    k = torch.cat([k_nope, pe.reshape(-1, 1, rope).expand(-1, heads, rope)], dim=-1)
    return k, v.contiguous()


def _mla_keys(layer, md, kv_cache, kv_c_normed, k_pe, first_row: int, context_lens: list[int]):
    """Keys and values of the prefill rows ``[first_row, n)``, expanded through ``kv_b_proj``, and their cached
    context as :data:`fusion_pass.runtime.cache.ContextRows` (the paged latents of the rows asked for, expanded
    the same way: at most one context workspace is expanded at a time).

    Args:
        kv_c_normed: ``[n, L]``; k_pe: ``[n, 1, R]`` (the call's rows; decode rows first).

    Returns:
        ``k [n - first_row, H, Dqk]``, ``v [n - first_row, H, Dv]`` in ``kv_b_proj``'s output dtype, and
        the context source (None when no prefill has context).
    """
    lora = layer.kv_lora_rank
    latent = kv_c_normed[first_row:]
    k, v = _expand(layer, latent, k_pe[first_row:].reshape(latent.shape[0], -1))
    if not sum(context_lens):
        return k, v, None

    def context(lo: int, hi: int):
        cached = _cached_latents(md.prefill.block_table, kv_cache, context_lens, lo, hi).to(latent.dtype)
        return _expand(layer, cached[:, :lora], cached[:, lora:])

    return k, v, context


def _run_fused_mla(backend, md, layer, kv_cache, inputs, output, output_scale, output_block_scale) -> None:
    """An MLA call with at least one prefill row: the prefills (rows ``[D, n)``, ``n = num_actual_tokens``)
    through :func:`fusion_pass.runtime.row_plan.run_prefills` first (its entry point may zero scale bytes of the
    last 128-row tile, which decode rows may share), then the decode rows ``[0, D)``
    (:func:`_run_decode_rows`); rows past ``n`` zeroed."""
    n = int(md.num_actual_tokens)
    decode, query_lens, context_lens = mla_batch(md)
    q, kv_c_normed, k_pe = (t[:n] for t in inputs)
    packed, scale_bytes, scales = _nvfp4_rows(output, output_block_scale, n)
    k, v, context = _mla_keys(layer, md, kv_cache, kv_c_normed, k_pe, decode, context_lens)
    row_plan.run_prefills(backend, q, k, v, first_row=decode, query_lens=query_lens, context_lens=context_lens,
                          context=context, softmax_scale=float(layer.scale),
                          output=packed[:n], output_scale=output_scale, output_block_scale=scales)
    if decode:
        _run_decode_rows(layer, md, kv_cache, inputs, decode, output_scale, packed, scale_bytes, output_block_scale)
    _zero_padding(packed, scale_bytes, n)


def _run_decode_rows(layer, md, kv_cache, inputs, decode: int, output_scale, packed, scale_bytes,
                     output_block_scale) -> None:
    """Rows ``[0, D)`` of an MLA call exactly as the unfused graph writes them.

    vLLM's ``forward_impl`` on the decode rows only (its MQA part; :data:`FORWARD_IMPL_STRUCTURE`) into a
    ``[D, H*Dv]`` temporary of the query dtype, the unfused graph's quant op (:func:`quant_op`) into
    ``[D, H*Dv/2]`` / swizzled ``D``-row temporaries, whose bytes are copied into rows ``[0, D)`` of
    ``packed`` and of the swizzled scales: a scale's offset depends on its row and block column only
    (:func:`fusion_pass.nvfp4.swizzled_offset`), and no byte of another row of a shared 128-row tile is
    written. Quantization is per row, so the bytes equal the unfused graph's rows ``[0, D)``.
    """
    q, kv_c_normed, k_pe = (t[:decode] for t in inputs)
    width = packed.shape[1] * 2
    tmp = torch.empty(decode, width, dtype=q.dtype, device=q.device)
    layer.forward_impl(q, kv_c_normed, k_pe, kv_cache, md, output=tmp)
    rows, cols = nvfp4.scale_shape(decode, width)
    rows_packed = torch.empty(decode, width // 2, dtype=torch.uint8, device=q.device)
    rows_scales = torch.empty(rows, cols, dtype=torch.uint8, device=q.device).view(output_block_scale.dtype)
    quant_op()(tmp, output_scale, True, output=rows_packed, output_scale=rows_scales)
    packed[:decode].copy_(rows_packed)
    offsets = nvfp4.row_scale_offsets(0, decode, width // nvfp4.BLOCK_SIZE, q.device)
    scale_bytes[offsets] = rows_scales.view(torch.uint8).view(-1)[offsets]
