"""The adapter for vLLM's FlashInfer backend (``FLASHINFER``, ``vllm/v1/attention/backends/flashinfer.py``): vLLM's
default standard-attention backend on Blackwell (SM100).

Written against the source of vLLM 0.32.0, 0.33.0 and 0.34.0 (CUDA wheels); **not run on CUDA** and not with
FlashInfer installed: tested with stand-ins of FlashInfer's metadata, wrappers and ``FlashInferImpl.forward``
(``tests_vllm/test_vllm_flashinfer.py``).

What the three releases share, and this adapter reads:

* Order: FlashInfer's metadata builder asks for decode requests first (``reorder_batch_threshold = 1``, more with
  speculative decoding). vLLM's model runner reorders the persistent batch before it builds any metadata
  (``GPUModelRunner._may_reorder_batch`` -> ``reorder_batch_to_split_decodes_and_prefills``: decode, short extend,
  long extend, fresh prefill), so ``CommonAttentionMetadata.query_start_loc_cpu``, which the host-rows hook keeps,
  is already in that order, and ``FlashInferMetadataBuilder.build`` cuts it with ``split_decodes_and_prefills``:
  rows ``[0, num_decode_tokens)`` are the ``num_decodes`` decode requests, the rest the ``num_prefills``
  prefills.
* Metadata (``FlashInferMetadata``, a dataclass): ``kv_cache_layout``, ``num_actual_tokens``, ``slot_mapping``,
  ``q_data_type_prefill`` / ``q_data_type_decode``, ``num_decodes``, ``num_decode_tokens``, ``num_prefills``,
  ``num_prefill_tokens``, ``causal``, and per phase ``prefill`` (``FIPrefill``: a planned
  ``BatchPrefillWithPagedKVCacheWrapper`` or DCP wrapper; ``TRTLLMPrefill``: block tables and lengths of the
  prefills) and ``decode`` (``FIDecode``: a ``BatchDecodeWithPagedKVCacheWrapper`` planned for the decode requests
  alone; ``FlashInferTrtllmAPIDecode``: kernel ``trtllm-gen`` (SM100) or ``xqa`` (SM90/SM12x), the decode
  requests' block tables and sequence lengths). No cascade attention in these releases (older vLLMs had
  ``use_cascade``: refused if present). No block table of the whole batch: the host-rows hook keeps
  ``CommonAttentionMetadata.block_table_tensor`` (:func:`fusion_pass.vllm.adapters.host_rows.block_table`).
* ``FlashInferImpl.forward`` computes the two phases in separate launches: prefill rows ``query[num_decode_tokens:]``
  by the prefill wrapper (or ``trtllm_batch_context_with_kv_cache``) into ``output[num_decode_tokens:]``, then decode
  rows ``query_padded[:num_decode_tokens]`` by the decode wrapper's ``run`` (or ``trtllm_batch_decode_with_kv_cache``
  / XQA) into ``output[:num_decode_tokens]``. So ``SPLITS_MIXED = True``: fusing the prefill rows of a mixed call
  replaces FlashInfer's prefill launch by the fused kernel and adds no attention launch (as for MLA); the decode
  rows' quantizer launch takes the place of the unfused graph's quant of every row.
* Cache: the layer's cache is logically ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (vLLM's per-layer
  view ``[B, H, N, C]``, any physical order: ``forward`` reads it as ``kv_cache.permute(*kv_cache_layout
  .layer_view_order).split(head_size, -1)``, HND or NHD pages); vLLM's cache write
  (``FlashInferImpl.do_kv_cache_update``) writes it as ``kv_cache.transpose(1, 2).split(head_size, -1)``: keys and
  values ``[num_blocks, block_size, num_kv_heads, head_size]``, and so does :meth:`FlashInferAdapter.gather` read
  it (logical indexing: whatever the physical layout). Unquantized dtypes only (an FP8 or NVFP4 cache is
  ``uint8`` / FP8 storage: refused; the layer check refuses a quantized ``kv_cache_dtype`` before).

Decode rows (:meth:`FlashInferAdapter.run_decode`): vLLM's own ``impl.forward`` on rows ``[0, D)`` with a shallow
copy of the call's metadata whose prefill part is removed (``prefill = None``, ``num_prefills =
num_prefill_tokens = 0``, ``num_actual_tokens = D``); its ``decode`` part, ``num_decodes`` and
``num_decode_tokens`` are the call's own. ``forward`` then skips its prefill branch and runs its decode branch
exactly as on the whole batch: the same planned decode wrapper (not re-planned) or the same trtllm-gen / XQA
call, on the same query rows ``[0, D)``, the same cache view (``permute(*layer_view_order)``, strides
canonicalized), the same ``q_scale`` / ``k_scale`` / ``v_scale``, ``window_left``, ``sinks``, the 0.33+
``multi_ctas_kv_counter_buffer``, into rows ``[0, D)`` of an output of the query dtype. The decode rows are thus
computed by the very launch vLLM makes for them in the unfused call, with the same arguments: byte-equal by
construction (as far as that kernel is deterministic run to run, which the unfused path itself relies on), in
every release, with no copy of its arguments kept here. This relies on the structure of ``FlashInferImpl.forward``
(:data:`FORWARD_DECODE_SPLIT`: the statements that gate and slice the two phases), checked in the source of the
layer's own ``forward`` at run time (:func:`forward_refusal`; identical in 0.32.0, 0.33.0 and 0.34.0) and refused
(``decode_tokens``) where missing.

What is refused (``decode_refusal``, reason ``decode_tokens``): a decode part the adapter does not know (not
``FIDecode`` / ``FlashInferTrtllmAPIDecode`` with kernel ``trtllm-gen`` / ``xqa``); decode rows that are not the
step's one-token requests first (``num_decodes``, ``num_decode_tokens`` and the host rows disagree: speculative
decode requests, a one-token fresh prefill placed after the prefills); DCP (``dcp_query_start_loc``; the guard
refuses DCP before); cascade; FP8 queries (``q_data_type_*`` not fp16/bf16: vLLM would quantize the query);
a ``forward`` without the split. Cached context (``context_refusal``, ``chunked_prefill``): a cache not of the
shape above or not fp16/bf16.

Not verified here (no CUDA, no FlashInfer): the launches themselves; that a FlashInfer decode launch is
deterministic run to run (byte-equality on a GPU is to be checked on one: the decode rows of a fused mixed call
against vLLM's op on the whole batch, as ``tests_vllm/test_vllm_engine.py`` does on the CPU build).
"""

from __future__ import annotations

import copy
import functools
import inspect

import torch

from fusion_pass.vllm.adapters.paged import PagedKVCache
from fusion_pass.vllm.adapters.host_rows import block_table, standard_rows

__all__ = ["DECODE_KINDS", "FORWARD_DECODE_SPLIT", "FlashInferAdapter", "forward_refusal"]

FORWARD_DECODE_SPLIT = (
    "num_actual_tokens = attn_metadata.num_actual_tokens",
    "query = query[:num_actual_tokens]",
    "output = output[:num_actual_tokens]",
    "num_decode_tokens = attn_metadata.num_decode_tokens",
    "num_prefill_tokens = attn_metadata.num_prefill_tokens",
    "if num_prefill_tokens > 0:",
    "prefill_query = query[num_decode_tokens:]",
    "if num_decode_tokens > 0:",
    "decode_query = query_padded[:decode_query_tokens]",
)
"""Statements of ``FlashInferImpl.forward`` (whitespace-normalised, each a whole line) that make ``forward`` on
metadata without a prefill part (``num_prefill_tokens = 0``, ``num_actual_tokens = D``) compute exactly the
call's decode rows ``[0, D)``: inputs cut to ``num_actual_tokens``, the prefill branch gated by
``num_prefill_tokens``, the decode branch by ``num_decode_tokens`` on the first rows of the query. Present in
vLLM 0.32.0, 0.33.0 and 0.34.0."""

DECODE_KINDS = {"FIDecode": None, "FlashInferTrtllmAPIDecode": ("trtllm-gen", "xqa")}
"""The decode parts of FlashInfer's metadata the adapter knows (class name -> accepted ``kernel`` values)."""

_HALF = (torch.float16, torch.bfloat16)


def _normalised(line: str) -> str:
    return " ".join(line.split())


@functools.lru_cache(maxsize=None)
def forward_refusal(forward) -> str | None:
    """Why ``forward`` (an impl class's ``forward``) cannot be trusted to compute a call's decode rows alone on
    metadata without its prefill part, or None: its source must hold every statement of
    :data:`FORWARD_DECODE_SPLIT`."""
    where = getattr(forward, "__qualname__", repr(forward))
    try:
        lines = {_normalised(line) for line in inspect.getsource(forward).splitlines()}
    except (OSError, TypeError) as exc:
        return f"the source of {where} cannot be read ({type(exc).__name__}) to check its decode/prefill split"
    missing = [s for s in FORWARD_DECODE_SPLIT if s not in lines]
    if missing:
        return (f"{where} does not split decode and prefill rows as the adapter relies on (missing: "
                f"{missing[0]!r}{f' and {len(missing) - 1} more' if len(missing) > 1 else ''})")
    return None


def _kind(decode) -> str:
    return type(decode).__name__


class FlashInferAdapter(PagedKVCache):
    """vLLM's ``FLASHINFER`` backend (module docstring)."""

    NAME = "FLASHINFER"
    BUILDER = ("vllm.v1.attention.backends.flashinfer", "FlashInferMetadataBuilder")
    SPLITS_MIXED = True  # FlashInferImpl.forward runs the decode rows and the prefill rows in separate launches

    @staticmethod
    def rows(md, dcp_world_size: int):
        if block_table(md) is None:  # the build hook keeps the batch's block table with its host rows
            return None
        return standard_rows(md, dcp_world_size)

    @staticmethod
    def decode_refusal(layer, md) -> str | None:
        if getattr(md, "use_cascade", False) or getattr(md, "cascade_wrapper", None) is not None:
            return "FLASHINFER cascade attention (a shared prefix attended once for every request)"
        rows = standard_rows(md)
        d = len(rows.decode) if rows is not None else -1
        counts = (getattr(md, "num_decodes", None), getattr(md, "num_decode_tokens", None))
        if rows is None or counts != (d, d) or rows.decode != tuple(range(d)) \
                or int(md.num_actual_tokens) != rows.num_tokens:
            return (f"FLASHINFER's decode part ({counts[0]} request(s), {counts[1]} token(s)) is not the step's {d} "
                    f"one-token request(s) first")
        decode = getattr(md, "decode", None)
        kind = _kind(decode)
        if decode is None or kind not in DECODE_KINDS:
            return f"FLASHINFER decode metadata of type {kind} (the adapter knows {', '.join(DECODE_KINDS)})"
        kernels = DECODE_KINDS[kind]
        if kernels is not None:
            kernel = getattr(getattr(decode, "kernel", None), "value", None)
            if kernel not in kernels:
                return f"FLASHINFER {kind} with kernel {kernel!r} (the adapter knows {', '.join(kernels)})"
        if getattr(decode, "dcp_query_start_loc", None) is not None:
            return "FLASHINFER decode metadata with decode context parallelism (dcp_query_start_loc)"
        for name in ("q_data_type_decode", "q_data_type_prefill", "q_data_type"):
            dtype = getattr(md, name, None)
            if dtype is not None and dtype not in _HALF:
                return f"FLASHINFER {name}={dtype}: vLLM quantizes the query, the fused path reads it unquantized"
        return forward_refusal(type(layer.impl).forward)

    @staticmethod
    def one_call_refusal(layer, md) -> str | None:
        if getattr(md, "use_cascade", False) or getattr(md, "cascade_wrapper", None) is not None:
            return "FLASHINFER cascade attention (a shared prefix attended once for every request)"
        if getattr(md, "causal", True) is not True:
            return "FLASHINFER non-causal metadata"
        decode = getattr(md, "decode", None)
        if getattr(decode, "dcp_query_start_loc", None) is not None:
            return "FLASHINFER decode metadata with decode context parallelism (dcp_query_start_loc)"
        for name in ("q_data_type_decode", "q_data_type_prefill", "q_data_type"):
            dtype = getattr(md, name, None)
            if dtype is not None and dtype not in _HALF:
                return f"FLASHINFER {name}={dtype}: vLLM quantizes the query, the fused path reads it unquantized"
        return None

    def _decode_metadata(self, md, rows):
        """The call's metadata without its prefill part, once per step."""
        sub = rows.memo.get(self.NAME)
        if sub is None:
            sub = copy.copy(md)
            sub.prefill = None
            sub.num_prefills = sub.num_prefill_tokens = 0
            sub.num_actual_tokens = md.num_decode_tokens
            rows.memo[self.NAME] = sub
        return sub

    def run_decode(self, layer, md, rows, inputs, kv_cache, out) -> str:
        """vLLM's ``impl.forward`` on the decode rows ``[0, D)`` into ``out [D, H * Dh]`` (query dtype), with the
        call's own decode part (module docstring); ``inputs``: the call's ``q [n, H, Dh]``, ``k``, ``v [n, Hk,
        Dh]``."""
        q, k, v = inputs
        d = out.shape[0]
        out = out.view(d, layer.num_heads, -1)
        layer.impl.forward(layer, q[:d], k[:d], v[:d], kv_cache, self._decode_metadata(md, rows), output=out)
        return "decode_phase"
