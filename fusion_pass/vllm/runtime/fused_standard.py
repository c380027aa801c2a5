"""The fused call of a standard (non-MLA) vLLM attention layer: every row in one fused launch over the paged KV cache
(:func:`run_one_call`, where the guard decided so: ``Decision.one_call``; NVFP4 only), or every prefill row by the
fused backend and every decode row by vLLM's own backend on the decode requests alone, quantized by the unfused
graph's quant op (the split, below). The buffers are the call's format's
(:mod:`fusion_pass.vllm.runtime.call_buffers`: NVFP4, static FP8 or FP8 groups); the plan is the same for all.

Rows are the batch's in vLLM's request order (:class:`fusion_pass.vllm.adapters.host_rows.StepRows`; FLASH_ATTN and
CPU_ATTN do not reorder decode requests first, so decode and prefill rows may interleave; FLASHINFER does):

1. Prefill rows through the fused backend (:func:`fusion_pass.runtime.row_plan.run_prefills` for NVFP4,
   :func:`fusion_pass.runtime.fp8_rows.run_prefills_fp8_static` for static FP8, as the project's runtime): queries,
   keys and values of the new tokens from the op's inputs, and for prefills with cached context their
   context read from vLLM's paged KV cache through the block table in the backend's layout
   (:func:`fusion_pass.vllm.adapters.registry.context_source`): within the context workspace bound one call over context +
   new keys, beyond it (NVFP4 only) context chunks merged into NVFP4. When the prefill rows are one run of adjacent
   rows they are written in place (``first_row`` = the run's first row); otherwise they are gathered, written into
   temporaries and their bytes copied into their rows.
2. Decode rows: the backend adapter runs vLLM's attention on the decode requests (``adapter.run_decode``) into a
   temporary of the query dtype, quantized by the unfused graph's quant op; their bytes go into their rows and no
   other (``write`` of :mod:`~fusion_pass.vllm.runtime.call_buffers`), after step 1, whose NVFP4 entry point may zero
   scale bytes of a 128-row tile that decode rows share.
3. Rows past the batch's (vLLM's padding) are zeroed.
"""

from __future__ import annotations

import torch

from fusion_pass.formats import NVFP4, OutputFormat
from fusion_pass.runtime.fp8_rows import OP_FORM, StaticQuant
from fusion_pass.vllm.adapters.paged import context_source
from fusion_pass.vllm.adapters.registry import adapter_for
from fusion_pass.vllm.adapters.host_rows import device_index, request_rows
from fusion_pass.vllm.runtime.call_buffers import call_buffers
from fusion_pass.vllm.runtime.nvfp4_rows import nvfp4_rows, zero_padding

__all__ = ["run_fused_standard", "run_one_call"]


def run_fused_standard(backend, md, layer, kv_cache, inputs, output, output_scale, output_block_scale, rows, *,
                       one_call: bool = False, output_format: OutputFormat = NVFP4,
                       fp8_quant: StaticQuant = OP_FORM) -> None:
    """A standard layer's call with at least one prefill row (module docstring); ``rows`` its
    :class:`~fusion_pass.vllm.adapters.host_rows.StepRows`; ``output_format`` the call's
    (:func:`fusion_pass.formats.call_format`: its buffers, :func:`~fusion_pass.vllm.runtime.call_buffers.call_buffers`);
    ``one_call``: every row in one launch of ``backend.run_paged`` over the layer's paged cache (:func:`run_one_call`;
    NVFP4 only, the guard never decides it for another format)."""
    adapter, name = adapter_for(layer)
    if adapter is None:  # the guard refuses such layers (no_decode_adapter)
        raise RuntimeError(f"run_fused_standard: vLLM attention backend {name} has no adapter")
    if one_call:
        if output_format is not NVFP4:
            raise ValueError(f"run_fused_standard: one_call writes {NVFP4.name} only, not {output_format.name}")
        run_one_call(backend, adapter, md, layer, kv_cache, inputs[0], output, output_scale, output_block_scale, rows)
        return
    n = rows.num_tokens
    heads, kv_heads, d = layer.num_heads, layer.num_kv_heads, layer.head_size
    q = inputs[0][:n].reshape(n, heads, d)
    k = inputs[1][:n].reshape(n, kv_heads, d)
    v = inputs[2][:n].reshape(n, kv_heads, d)
    buffers = call_buffers(output_format, output, output_scale, output_block_scale, n, fp8_quant)
    query_lens = [rows.query_lens[i] for i in rows.prefill]
    context_lens = [rows.context_lens[i] for i in rows.prefill]
    context = context_source(adapter, layer, md, rows, kv_cache) if any(context_lens) else None
    common = dict(query_lens=query_lens, context_lens=context_lens, context=context,
                  softmax_scale=float(layer.impl.scale))
    run = rows.prefill_run()
    if run is not None:
        first, count = run
        buffers.run_prefills(backend, q, k[first:first + count], v[first:first + count], first_row=first, **common)
    else:
        index = device_index(rows.prefill_rows(), q.device)
        part = buffers.part(index.shape[0], q.device)
        part.run_prefills(backend, q[index], k[index], v[index], first_row=0, **common)
        buffers.copy_from(part, index)
    if rows.decode:
        out = torch.empty(len(rows.decode), heads * d, dtype=q.dtype, device=q.device)
        adapter.run_decode(layer, md, rows, (q, k, v), kv_cache, out)
        buffers.write(out, request_rows(rows, rows.decode, q.device))
    buffers.zero_padding()


def run_one_call(backend, adapter, md, layer, kv_cache, query, output, output_scale, output_block_scale, rows) -> None:
    """Every row of the call, decode rows included, in one launch of ``backend.run_paged`` reading the keys and
    values of every request from the layer's paged cache (vLLM's cache-update op wrote the call's new tokens into
    it before the attention op, as for vLLM's own kernels): the call's query rows in vLLM's order, sequences
    delimited by the step's ``query_start_loc``, each attending to its ``seq_len`` keys through its row of the block
    table (``adapter.paged_inputs``). Rows past the batch's are zeroed."""
    n = rows.num_tokens
    heads, d = layer.num_heads, layer.head_size
    q = query[:n].reshape(n, heads, d)
    paged = adapter.paged_inputs(layer, md, rows, kv_cache, q.device)
    packed, scale_bytes, scales = nvfp4_rows(output, output_block_scale, n)
    backend.run_paged(q, paged.k_pages, paged.v_pages, paged.cu_seqlens, paged.max_query_len, paged.seq_lens,
                      paged.block_table, paged.max_seq_len, float(layer.impl.scale), packed[:n], output_scale, scales)
    zero_padding(packed, scale_bytes, n)
