"""The ops the rewritten vLLM graph calls: ``fusion_pass::vllm_attention_nvfp4`` and
``fusion_pass::vllm_mla_attention_nvfp4``.

Their schemas mirror vLLM's ``unified_attention_with_output`` / ``unified_mla_attention_with_output``
(every argument, ``kv_cache_dummy_dep`` and ``layer_name`` of vLLM's ``LayerNameType`` included), so the
pass only retargets the call. ``output`` is the quant's packed uint8 ``[T, H*Dv/2]`` buffer,
``output_scale`` the global scale, ``output_block_scale`` the quant's int32 swizzled scale buffer.

Per call, the guard (:func:`fusion_pass.vllm.guard.decide`) reads the layer, its attention metadata, its KV
cache and settings from vLLM's forward context (``get_attention_context``) and decides row by row with the
shared core, :func:`fusion_pass.runtime.guard.decide`. The exact fallback (every row),
counted with its reason, is taken when (checked in this order):

* there is no metadata (vLLM's profile / dummy runs): ``no_attention_metadata``;
* DCP world size > 1: ``dcp_world_size>1``;
* the batch has no prefill row (decode only): ``decode_tokens``;
* the layer uses something the fused kernels do not compute (sliding window, ALiBi, logit soft-cap,
  attention sinks, a quantized KV cache, KV sharing, non-causal or encoder attention; MLA: sparse MLA,
  a HiSparse cache, prefill context parallelism, a ``kv_b_proj`` whose weight vLLM's AMX MLA backend
  released): ``layer_not_supported``;
* the batch has decode tokens beside its prefills: standard (non-MLA) layers always (vLLM's standard
  backends compute decode and prefill rows in one kernel call with backend-specific metadata: computing
  some rows apart would need per-backend sub-metadata); MLA when the installed vLLM's
  ``MLAAttention.forward_impl`` does not have the structure the decode rows rely on
  (:data:`fusion_pass.vllm.guard.FORWARD_IMPL_STRUCTURE`): ``decode_tokens``;
* a prefill has cached context (chunked prefill, a prefix-cache hit): standard layers always; MLA when the
  KV cache is not the unquantized latent cache ``[num_blocks, block_size, kv_lora_rank + rope]``:
  ``chunked_prefill``;
* no fused backend supports the layer on this device: ``no_backend``;
* MLA with cached context, when the backend does not run prefills with context: ``chunked_prefill``.

Otherwise the fused path runs (path ``"fused"``: every prefill row is written by the fused backend
:func:`fusion_pass.runtime.backends.select_backend` picks):

* standard layers (pure-prefill batches): causal varlen attention of the ``num_actual_tokens`` rows;
* MLA (vLLM orders a batch's ``D = num_decode_tokens`` decode rows first, then the prefills): the
  prefill rows ``[D, num_actual_tokens)`` through :func:`fusion_pass.runtime.row_plan.run_prefills`, keys and
  values expanded from ``kv_c_normed`` through the layer's ``kv_b_proj`` with ``k_pe`` broadcast to
  every head, as vLLM's MLA prefill does; prefills with cached context also attend to their context,
  read from the paged latent cache (the prefills' block table and context lengths) and expanded the
  same way. Then the decode rows, computed as vLLM computes them (``forward_impl`` on rows ``[0, D)``)
  and quantized with the unfused graph's quant op into their rows of the buffers (counted under
  ``decode_tokens`` in ``post_quantized``): byte-equal to the unfused graph by construction.

Rows past ``num_actual_tokens`` (vLLM's padding) are zeroed. The new tokens reach the KV cache through
vLLM's own cache-update op, which the graph keeps (``kv_cache_dummy_dep``). The fused path runs inside
vLLM's KV-connector hooks (``maybe_transfer_kv_layer``: a connector's layer load is waited for before the
cached context is read, the layer saved after), as vLLM's attention ops run.

The exact fallback calls vLLM's own attention op into a temporary buffer of the query dtype, then the
same quant op the unfused graph calls (``_C::scaled_fp4_quant.out`` where vLLM has it, else
``fusion_pass::scaled_fp4_quant.out``): the bytes equal vLLM's unfused graph.
"""


import functools
import logging

import torch

from fusion_pass.runtime import counters, settings
from fusion_pass.vllm.fused_rows import quant_op, run_fused
from fusion_pass.vllm.guard import decide, layer_name_of

__all__ = ["register"]

logger = logging.getLogger("vllm.fusion_pass")

# (no ``from __future__ import annotations`` here: the op signatures are read by infer_schema)
_lib = None  # the torch.library.Library holding the ops (their lifetime is the library's)


def _context(layer_name):
    """``(attention metadata, layer, KV cache)`` of ``layer_name`` from vLLM's forward context."""
    from vllm.model_executor.layers.attention.attention import get_attention_context

    return get_attention_context(layer_name_of(layer_name))[:3]


@functools.lru_cache(maxsize=None)
def _with_kv_transfer():
    """``call(layer_name, fn)``: ``fn()`` inside vLLM's KV-connector hooks, as vLLM's attention ops run
    (``maybe_transfer_kv_layer``, vllm/model_executor/layers/attention/kv_transfer_utils.py: with a KV
    connector, wait for the layer's KV to load before, save the layer's KV after; else nothing)."""
    from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer

    def call(layer_name, fn):
        fn()

    return maybe_transfer_kv_layer(call)


def _run(vllm_op, inputs, output, layer_name, output_scale, output_block_scale, rest, heads) -> None:
    settings.check_environment()
    md, layer, kv_cache = _context(layer_name)
    decision = decide(layer_name, inputs[0], md, layer, kv_cache)
    if decision.fused:  # the exact fallback calls vLLM's op, which runs the KV-connector hooks itself
        _with_kv_transfer()(layer_name, lambda: run_fused(decision.backend, md, layer, kv_cache, inputs, output,
                                                           output_scale, output_block_scale))
    else:
        _run_unfused(vllm_op, inputs, output, layer_name, output_scale, output_block_scale, rest, heads)
    counters.record(decision, layer_name=layer_name_of(layer_name))
    key = decision.reason or f"fused:{decision.backend}"
    if key not in _logged:  # vLLM shows its own loggers; each path is named once per process
        _logged.add(key)
        what = f"fused with backend {decision.backend}" if decision.fused else f"fell back ({decision.reason})"
        logger.info("fusion_pass: %s: attention + NVFP4 quant %s: %s; further calls are only counted",
                    layer_name_of(layer_name), what, decision.detail or "no detail")


def _run_unfused(vllm_op, inputs, output, layer_name, output_scale, output_block_scale, rest, heads) -> None:
    """vLLM's attention into a temporary of the query dtype, then the unfused graph's quant op."""
    q = inputs[0]
    tokens = output.shape[0]
    width = output.numel() // tokens * 2
    tmp = torch.empty(tokens, width, dtype=q.dtype, device=q.device)
    target = tmp if heads is None else tmp.view(tokens, heads, width // heads)
    vllm_op(*inputs, target, layer_name, **rest)
    # the attention op's output_scale is the global scale (the quant's input_scale); its output_block_scale is
    # the quant's output_scale (the block scales)
    quant_op()(tmp, output_scale, True, output=output.view(tokens, -1), output_scale=output_block_scale)


_logged: set = set()


def register() -> None:
    """Define the two ops (idempotent). Needs vLLM (its ``LayerNameType`` and op registration helper)."""
    global _lib
    if _lib is not None:
        return
    from vllm.utils.torch_utils import LayerNameType, direct_register_custom_op

    import fusion_pass.ops  # noqa: F401  (the fusion_pass library and its quant op)

    def vllm_attention_nvfp4(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        layer_name: LayerNameType,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
        kv_cache_dummy_dep: torch.Tensor | None = None,
    ) -> None:
        _run(torch.ops.vllm.unified_attention_with_output, (query, key, value), output, layer_name,
             output_scale, output_block_scale, {"kv_cache_dummy_dep": kv_cache_dummy_dep}, heads=query.shape[1])

    def vllm_mla_attention_nvfp4(
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        output: torch.Tensor,
        layer_name: LayerNameType,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
        kv_cache_dummy_dep: torch.Tensor | None = None,
        quant_group_size: int | None = None,
        quant_scale_ue8m0: bool | None = None,
        quant_col_major: bool | None = None,
        quant_tma_aligned: bool | None = None,
        q_dcp_replicated: torch.Tensor | None = None,
    ) -> None:
        rest = dict(kv_cache_dummy_dep=kv_cache_dummy_dep, quant_group_size=quant_group_size,
                    quant_scale_ue8m0=quant_scale_ue8m0, quant_col_major=quant_col_major,
                    quant_tma_aligned=quant_tma_aligned, q_dcp_replicated=q_dcp_replicated)
        _run(torch.ops.vllm.unified_mla_attention_with_output, (q, kv_c_normed, k_pe), output, layer_name,
             output_scale, output_block_scale, rest, heads=None)

    def _fake(*args, **kwargs) -> None:
        return None

    lib = torch.library.Library("fusion_pass", "FRAGMENT")
    for fn in (vllm_attention_nvfp4, vllm_mla_attention_nvfp4):
        if hasattr(torch.ops.fusion_pass, fn.__name__):  # defined by an earlier copy of this module
            continue
        direct_register_custom_op(fn.__name__, fn, mutates_args=["output", "output_block_scale"],
                                  fake_impl=_fake, target_lib=lib, dispatch_key="CompositeExplicitAutograd")
    _lib = lib
