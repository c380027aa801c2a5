"""The ops the rewritten vLLM graph calls: ``fusion_pass::vllm_attention_nvfp4`` and
``fusion_pass::vllm_mla_attention_nvfp4``.

Their schemas mirror vLLM's ``unified_attention_with_output`` / ``unified_mla_attention_with_output``
(every argument, ``kv_cache_dummy_dep`` and ``layer_name`` of vLLM's ``LayerNameType`` included), so the
pass only retargets the call. ``output`` is the quant's packed uint8 ``[T, H*Dv/2]`` buffer,
``output_scale`` the global scale, ``output_block_scale`` the quant's int32 swizzled scale buffer.

Per call, the guard reads the layer's attention metadata from vLLM's forward context:

* no metadata (vLLM's profile / dummy runs), decode tokens, prefill with cached context
  (chunked prefill, prefix-cache hits), DCP world size > 1: the exact fallback;
* pure prefill: the fused path. **Not implemented yet for vLLM** — such calls also take the exact
  fallback, counted and logged as ``vllm_fused_path_not_implemented`` (never silently).

The exact fallback calls vLLM's own attention op into a temporary buffer of the query dtype, then the
same quant op the unfused graph calls (``_C::scaled_fp4_quant.out`` where vLLM has it, else
``fusion_pass::scaled_fp4_quant.out``): the bytes equal vLLM's unfused graph.
"""


import logging

import torch

from fusion_pass import guard

logger = logging.getLogger("vllm.fusion_pass")

NOT_IMPLEMENTED = "vllm_fused_path_not_implemented"
NO_METADATA = "no_attention_metadata"

# (no ``from __future__ import annotations`` here: the op signatures are read by infer_schema)
_lib = None  # the torch.library.Library holding the ops (their lifetime is the library's)


def _quant_op():
    """The quant op the unfused graph calls (the one :func:`fusion_pass.patterns.vllm_vocabulary` matches)."""
    c = getattr(torch.ops, "_C", None)
    if c is not None and hasattr(c, "scaled_fp4_quant") and hasattr(c, "cutlass_scaled_fp4_mm"):
        return c.scaled_fp4_quant.out
    return torch.ops.fusion_pass.scaled_fp4_quant.out


def _name(layer_name):
    return getattr(layer_name, "value", layer_name)


def _dcp_world_size() -> int:
    try:
        from vllm.distributed.parallel_state import get_dcp_group

        return get_dcp_group().world_size
    except Exception:  # not initialised (single process without DCP)
        return 1


def decide(layer_name) -> "guard.Decision":
    """The guard for one call, from the layer's metadata in vLLM's forward context."""
    from vllm.model_executor.layers.attention.attention import get_attention_context

    md = get_attention_context(_name(layer_name))[0]
    if md is None:
        return guard.Decision("fallback", NO_METADATA, None, "no attention metadata (vLLM profile/dummy run)")
    decode, context = _batch_kind(md)
    if decode:
        return guard.Decision("fallback", "decode_tokens", None, f"{decode} decode token(s)")
    if context:
        return guard.Decision("fallback", "chunked_prefill", None, f"{context} prefill request(s) with cached context")
    dcp = _dcp_world_size()
    if dcp != 1:
        return guard.Decision("fallback", "dcp_world_size>1", None, f"dcp_world_size={dcp}")
    return guard.Decision("fallback", NOT_IMPLEMENTED, None,
                          "pure-prefill batch, but the fused path inside vLLM is not implemented yet: "
                          "the exact unfused path ran")


def _batch_kind(md):
    """(decode tokens, prefill requests with cached context) of vLLM's attention metadata."""
    if hasattr(md, "num_decode_tokens") and hasattr(md, "prefill") and hasattr(md, "num_prefills"):  # MLA common
        prefill = md.prefill
        chunked = getattr(prefill, "chunked_context", None) if prefill is not None else None
        context = 0
        if chunked is not None:
            context = int((chunked.context_lens > 0).sum().item()) if hasattr(chunked, "context_lens") else 1
        return int(md.num_decode_tokens), context
    # standard backends: per request, context = seq_len - query_len; a one-token query with context is a decode
    qsl, seq_lens = getattr(md, "query_start_loc", None), getattr(md, "seq_lens", None)
    if qsl is None or seq_lens is None:
        return 1, 0  # unknown metadata: never fused
    n = seq_lens.shape[0]
    q_lens = (qsl[1:n + 1] - qsl[:n]).to("cpu")
    ctx = seq_lens.to("cpu") - q_lens
    is_decode = (ctx > 0) & (q_lens == 1)
    return int(q_lens[is_decode].sum().item()), int(((ctx > 0) & ~is_decode).sum().item())


def _run(vllm_op, inputs, output, layer_name, output_scale, output_block_scale, rest, heads) -> None:
    decision = decide(layer_name)
    guard.record(decision)
    if decision.reason == NOT_IMPLEMENTED:
        _log_once(NOT_IMPLEMENTED, "fusion_pass: %s: %s", _name(layer_name), decision.detail)
    q = inputs[0]
    tokens, width = output.shape[0], output.shape[1] * 2
    tmp = torch.empty(tokens, width, dtype=q.dtype, device=q.device)
    target = tmp if heads is None else tmp.view(tokens, heads, width // heads)
    vllm_op(*inputs, target, layer_name, **rest)
    _quant_op()(tmp, output_scale, True, output=output, output_scale=output_block_scale)


_logged = set()


def _log_once(key: str, msg: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.warning(msg, *args)


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
