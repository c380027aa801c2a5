"""The fused rows of a vLLM call: :func:`run_fused` takes a call the guard fused to the standard layers' path
(:func:`fusion_pass.vllm.runtime.fused_standard.run_fused_standard`) or to MLA's (here: decode rows computed by vLLM's own
``forward_impl`` and quantized by the unfused graph's quant op).

MLA (:mod:`fusion_pass.vllm.adapters.mla`): vLLM orders a batch's ``D = num_decode_tokens`` decode rows first, then
the prefills. The prefill rows
``[D, num_actual_tokens)`` go through :func:`fusion_pass.runtime.row_plan.run_prefills` (NVFP4) or
:func:`fusion_pass.runtime.fp8_rows.run_prefills_fp8_static` (static FP8), keys and values
expanded from ``kv_c_normed`` through the layer's ``kv_b_proj`` with ``k_pe`` broadcast to every head, as vLLM's
MLA prefill does; prefills with cached context also attend to their context, read from the paged latent cache
(the prefills' block table and context lengths) and expanded the same way. Rows past ``num_actual_tokens``
(vLLM's padding) are zeroed.
"""

import torch

from fusion_pass import formats
from fusion_pass.formats import NVFP4
from fusion_pass.runtime import backends
from fusion_pass.runtime.fp8_rows import OP_FORM, StaticQuant
from fusion_pass.vllm.adapters import registry
from fusion_pass.vllm.adapters.host_rows import device_index, mla_rows
from fusion_pass.vllm.runtime.fused_standard import run_fused_standard
from fusion_pass.vllm.runtime.guard import is_mla, step_rows
from fusion_pass.vllm.runtime.call_buffers import call_buffers
from fusion_pass.vllm.runtime.fp8_static_rows import quant_op as fp8_static_quant_op
from fusion_pass.vllm.runtime.nvfp4_rows import quant_op

__all__ = ["fp8_static_quant_op", "quant_op", "run_fused"]


def run_fused(decision, md, layer, kv_cache, inputs, output, output_scale, output_block_scale,
              extra: dict | None = None, fp8_quant: StaticQuant = OP_FORM) -> None:
    """The guard's fused ``decision`` (:class:`fusion_pass.runtime.guard.Decision`): its backend on the call's
    prefill rows (on every row for a one-call decision), the other rows as the unfused graph writes them, rows past
    the batch's zeroed (MLA: :func:`_run_fused_mla`; standard layers: :func:`run_fused_standard`), in the decision's
    output format (NVFP4 or static FP8: the buffers, :mod:`fusion_pass.vllm.runtime.call_buffers`). ``extra``: the MLA
    op's arguments its decode rows pass on to vLLM's ``forward_impl`` (0.34's ``mqa_q_prepared``). ``fp8_quant``: a
    static FP8 call's arithmetic (:class:`fusion_pass.runtime.fp8_rows.StaticQuant`)."""
    backend = backends.get_backend(decision.backend)
    output_format = formats.by_name(decision.format)
    if is_mla(layer):
        _run_fused_mla(backend, md, layer, kv_cache, inputs, output, output_scale, output_block_scale, extra,
                       output_format, fp8_quant)
    else:
        run_fused_standard(backend, md, layer, kv_cache, inputs, output, output_scale, output_block_scale,
                           step_rows(md, layer), one_call=decision.one_call, output_format=output_format,
                           fp8_quant=fp8_quant)


def _cached_latents(block_table, kv_cache, context_lens: list[int], lo: int, hi: int):
    """Rows ``[lo, hi)`` of the prefills' cached latents packed in request order (position ``0 ..
    context_lens[i]`` of each prefill's paged cache, one after the other): ``[hi - lo, L + R]`` in the cache
    dtype.

    ``block_table``: int ``[num_prefills, max_blocks]`` (``MLACommonPrefillMetadata.block_table``, the
    prefills' rows); ``kv_cache``: ``[num_blocks, block_size, L + R]``, position ``p`` of request ``i`` at
    ``kv_cache[block_table[i, p // block_size], p % block_size]`` (as vLLM's context gathers read it). The
    indices are computed on the host and moved without synchronization.
    """
    lens = torch.tensor(context_lens, dtype=torch.long)
    ends = torch.cumsum(lens, 0)
    rows = torch.arange(lo, hi)
    request = torch.searchsorted(ends, rows, right=True)
    position = rows - (ends - lens)[request]
    block_size = kv_cache.shape[1]
    table = block_table.device
    blocks = block_table[device_index(request, table), device_index(position // block_size, table)].long()
    return kv_cache[blocks.to(kv_cache.device), device_index(position % block_size, kv_cache.device)]


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
    context as :data:`fusion_pass.runtime.row_plan.ContextRows` (the paged latents of the rows asked for, expanded
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


def _run_fused_mla(backend, md, layer, kv_cache, inputs, output, output_scale, output_block_scale,
                   extra=None, output_format=NVFP4, fp8_quant: StaticQuant = OP_FORM) -> None:
    """An MLA call with at least one prefill row: the prefills (rows ``[D, n)``, ``n = num_actual_tokens``)
    through the fused backend first (:func:`fusion_pass.runtime.row_plan.run_prefills`, or
    :func:`fusion_pass.runtime.fp8_rows.run_prefills_fp8_static` for static FP8; NVFP4's entry point may zero scale
    bytes of the last 128-row tile, which decode rows may share), then the decode rows ``[0, D)``
    (:func:`_run_decode_rows`); rows past ``n`` zeroed."""
    n = int(md.num_actual_tokens)
    batch = mla_rows(md).rows
    decode, query_lens, context_lens = batch.decode_tokens, list(batch.query_lens), list(batch.context_lens)
    q, kv_c_normed, k_pe = (t[:n] for t in inputs)
    buffers = call_buffers(output_format, output, output_scale, output_block_scale, n, fp8_quant)
    k, v, context = _mla_keys(layer, md, kv_cache, kv_c_normed, k_pe, decode, context_lens)
    buffers.run_prefills(backend, q, k, v, first_row=decode, query_lens=query_lens, context_lens=context_lens,
                         context=context, softmax_scale=float(layer.scale))
    if decode:
        _run_decode_rows(layer, md, kv_cache, (*inputs, extra or {}), decode, buffers)
    buffers.zero_padding()


def _run_decode_rows(layer, md, kv_cache, inputs, decode: int, buffers) -> None:
    """Rows ``[0, D)`` of an MLA call exactly as the unfused graph writes them.

    vLLM's ``forward_impl`` on the decode rows only (its MQA part: :meth:`fusion_pass.vllm.adapters.mla.MlaAdapter
    .run_decode`) into a ``[D, H*Dv]`` temporary of the query dtype, quantized by the unfused graph's quant op into
    rows ``[0, D)`` of the call's ``buffers`` (:mod:`fusion_pass.vllm.runtime.call_buffers`: no byte of another row,
    for NVFP4 of a shared 128-row tile, is written). Quantization is per row, so the bytes equal the unfused graph's
    rows ``[0, D)``.
    """
    q = inputs[0]
    tmp = torch.empty(decode, buffers.width, dtype=q.dtype, device=q.device)
    registry.MLA.run_decode(layer, md, None, inputs, kv_cache, tmp)
    buffers.write(tmp, slice(0, decode))
