"""The ops the rewritten vLLM graph calls: ``fusion_pass::vllm_attention_nvfp4`` and
``fusion_pass::vllm_mla_attention_nvfp4``.

Their schemas mirror vLLM's ``unified_attention_with_output`` / ``unified_mla_attention_with_output``
(every argument, ``kv_cache_dummy_dep`` and ``layer_name`` of vLLM's ``LayerNameType`` included), so the
pass only retargets the call. ``output`` is the quant's packed uint8 ``[T, H*Dv/2]`` buffer,
``output_scale`` the global scale, ``output_block_scale`` the quant's int32 swizzled scale buffer.

Per call, the guard reads the layer, its attention metadata and settings from vLLM's forward context
(``get_attention_context``) and takes the exact fallback, counted with its reason, when:

* there is no metadata (vLLM's profile / dummy runs): ``no_attention_metadata``;
* the batch has decode tokens: ``decode_tokens``; a prefill has cached context (chunked prefill, a
  prefix-cache hit): ``chunked_prefill``; DCP world size > 1: ``dcp_world_size>1``;
* the layer uses something the fused kernels do not compute (sliding window, ALiBi, logit soft-cap,
  attention sinks, a quantized KV cache, KV sharing, non-causal or encoder attention):
  ``layer_not_supported``;
* no fused backend supports the layer on this device: ``no_backend``.

Otherwise the fused path runs: the backend :func:`fusion_pass.backends.select_backend` picks computes
causal varlen attention of the batch's ``num_actual_tokens`` rows from the query, key and value the op
receives (MLA: keys and values expanded from ``kv_c_normed`` through the layer's ``kv_b_proj``, with
``k_pe`` broadcast to every head, as vLLM's MLA prefill does) and writes NVFP4 into the buffers; rows
past ``num_actual_tokens`` (vLLM's padding) are zeroed. The new tokens reach the KV cache through vLLM's
own cache-update op, which the graph keeps (``kv_cache_dummy_dep``).

The exact fallback calls vLLM's own attention op into a temporary buffer of the query dtype, then the
same quant op the unfused graph calls (``_C::scaled_fp4_quant.out`` where vLLM has it, else
``fusion_pass::scaled_fp4_quant.out``): the bytes equal vLLM's unfused graph.
"""


import logging

import torch

from fusion_pass import backends, guard, nvfp4

logger = logging.getLogger("vllm.fusion_pass")

NO_METADATA = "no_attention_metadata"
LAYER_NOT_SUPPORTED = "layer_not_supported"

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


def _context(layer_name):
    """``(attention metadata, layer)`` of ``layer_name`` from vLLM's forward context."""
    from vllm.model_executor.layers.attention.attention import get_attention_context

    return get_attention_context(_name(layer_name))[:2]


def decide(layer_name, q, md, layer) -> "guard.Decision":
    """The guard for one call (module docstring), from the layer and its metadata (:func:`_context`)."""
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
    unsupported = _unsupported(layer, md)
    if unsupported:
        return guard.Decision("fallback", LAYER_NOT_SUPPORTED, None, f"{_name(layer_name)}: {unsupported}")
    heads, qk_dim, v_dim = _dims(layer)
    backend, why = backends.select_backend(q.device, q.dtype, heads, qk_dim, v_dim)
    if backend is None:
        return guard.Decision("fallback", "no_backend", None, why)
    return guard.Decision("fused", None, backend.name, why)


def _is_mla(layer) -> bool:
    return hasattr(layer, "kv_b_proj") and hasattr(layer, "qk_nope_head_dim")


def _dims(layer) -> tuple[int, int, int]:
    """(query heads of this rank, q/k head dim, v head dim)."""
    if _is_mla(layer):
        return layer.num_heads, layer.qk_nope_head_dim + layer.qk_rope_head_dim, layer.v_head_dim
    return layer.num_heads, layer.head_size, layer.head_size


def _unsupported(layer, md) -> str | None:
    """What the layer computes that the fused kernels (plain causal softmax attention) do not, or None."""
    impl = getattr(layer, "impl", None)
    kv_dtype = getattr(layer, "kv_cache_dtype", "auto")
    if kv_dtype not in ("auto", None):
        return f"KV cache dtype {kv_dtype!r} (the fused kernels read unquantized keys and values)"
    if _is_mla(layer):
        if getattr(impl, "is_sparse", False):
            return "sparse MLA"
        return None
    attn_type = str(getattr(layer, "attn_type", "decoder"))
    if "decoder" not in attn_type.lower() or not getattr(md, "causal", True):
        return f"attention type {attn_type} (the fused kernels are causal decoder attention)"
    if getattr(layer, "kv_sharing_target_layer_name", None):
        return "KV sharing with another layer"
    window = getattr(impl, "sliding_window", None)
    if window not in (None, -1, (-1, -1)):
        return f"sliding window {window}"
    for name in ("alibi_slopes", "sinks"):
        if getattr(impl, name, None) is not None:
            return name.replace("_", " ")
    if getattr(impl, "logits_soft_cap", None):
        return f"logit soft-cap {impl.logits_soft_cap}"
    return None


def _prefill_inputs(layer, md, inputs):
    """``(q, k, v, cu_seqlens, max_seqlen, softmax_scale)`` of a pure-prefill batch's ``num_actual_tokens``
    rows: dense ``[n, H, Dqk]`` / ``[n, Hk, Dqk]`` / ``[n, Hk, Dv]`` in the query dtype."""
    n = md.num_actual_tokens
    if _is_mla(layer):
        q, kv_c_normed, k_pe = (t[:n] for t in inputs)
        heads, nope, rope, dv = layer.num_heads, layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim
        kv = layer.kv_b_proj(kv_c_normed)[0].view(n, heads, nope + dv)
        k_nope, v = kv.split([nope, dv], dim=-1)
        k = torch.cat([k_nope, k_pe.reshape(n, 1, rope).expand(n, heads, rope)], dim=-1)
        prefill = md.prefill
        return q, k, v.contiguous(), prefill.query_start_loc, prefill.max_query_len, layer.scale
    q, k, v = (t[:n] for t in inputs)
    heads, kv_heads, d = layer.num_heads, layer.num_kv_heads, layer.head_size
    q, k, v = q.reshape(n, heads, d), k.reshape(n, kv_heads, d), v.reshape(n, kv_heads, d)
    return q, k, v, md.query_start_loc, md.max_query_len, layer.impl.scale


def _run_fused(backend_name: str, md, layer, inputs, output, output_scale, output_block_scale) -> None:
    """The fused backend on the batch's real rows; padding rows (vLLM pads for CUDA graphs) zeroed."""
    q, k, v, cu_seqlens, max_seqlen, softmax_scale = _prefill_inputs(layer, md, inputs)
    n, tokens = q.shape[0], output.shape[0]
    packed = output.view(tokens, -1)
    width = packed.shape[1] * 2
    rows, cols = nvfp4.scale_shape(n, width)
    scale_bytes = output_block_scale.view(torch.uint8).view(-1)
    backends.get_backend(backend_name).run_varlen(
        q, k, v, cu_seqlens.to(torch.int32), int(max_seqlen), float(softmax_scale),
        packed[:n], output_scale, scale_bytes[: rows * cols].view(rows, cols))
    packed[n:].zero_()
    scale_bytes[rows * cols:].zero_()


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
    md, layer = _context(layer_name)
    decision = decide(layer_name, inputs[0], md, layer)
    if decision.fused:
        _run_fused(decision.backend, md, layer, inputs, output, output_scale, output_block_scale)
    else:
        _run_unfused(vllm_op, inputs, output, layer_name, output_scale, output_block_scale, rest, heads)
    guard.record(decision)
    key = decision.reason or f"fused:{decision.backend}"
    if key not in _logged:  # vLLM shows its own loggers; each path is named once per process
        _logged.add(key)
        what = f"fused with backend {decision.backend}" if decision.fused else f"fell back ({decision.reason})"
        logger.info("fusion_pass: %s: attention + NVFP4 quant %s: %s; further calls are only counted",
                    _name(layer_name), what, decision.detail or "no detail")


def _run_unfused(vllm_op, inputs, output, layer_name, output_scale, output_block_scale, rest, heads) -> None:
    """vLLM's attention into a temporary of the query dtype, then the unfused graph's quant op."""
    q = inputs[0]
    tokens = output.shape[0]
    width = output.numel() // tokens * 2
    tmp = torch.empty(tokens, width, dtype=q.dtype, device=q.device)
    target = tmp if heads is None else tmp.view(tokens, heads, width // heads)
    vllm_op(*inputs, target, layer_name, **rest)
    _quant_op()(tmp, output_scale, True, output=output.view(tokens, -1), output_scale=output_block_scale)


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
