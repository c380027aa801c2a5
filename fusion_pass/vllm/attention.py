"""The ops the rewritten vLLM graph calls: ``fusion_pass::vllm_attention_nvfp4`` and
``fusion_pass::vllm_mla_attention_nvfp4``.

Their schemas mirror vLLM's ``unified_attention_with_output`` / ``unified_mla_attention_with_output``
(every argument, ``kv_cache_dummy_dep`` and ``layer_name`` of vLLM's ``LayerNameType`` included), so the
pass only retargets the call. ``output`` is the quant's packed uint8 ``[T, H*Dv/2]`` buffer,
``output_scale`` the global scale, ``output_block_scale`` the quant's int32 swizzled scale buffer.

Per call, the guard (:func:`decide`) reads the layer, its attention metadata, its KV cache and settings
from vLLM's forward context (``get_attention_context``) and decides row by row, as
:func:`fusion_pass.guard.decide` does. The exact fallback (every row), counted with its reason, is taken when:

* there is no metadata (vLLM's profile / dummy runs): ``no_attention_metadata``;
* DCP world size > 1: ``dcp_world_size>1``;
* the batch has no prefill row (decode only): ``decode_tokens``;
* standard (non-MLA) layers only: the batch has decode tokens, ``decode_tokens``; a prefill has cached
  context (chunked prefill, a prefix-cache hit), ``chunked_prefill`` (vLLM's standard backends compute
  decode and prefill rows in one kernel call with backend-specific metadata: computing some rows apart
  would need per-backend sub-metadata);
* the layer uses something the fused kernels do not compute (sliding window, ALiBi, logit soft-cap,
  attention sinks, a quantized KV cache, KV sharing, non-causal or encoder attention; MLA: sparse MLA,
  a HiSparse cache, prefill context parallelism): ``layer_not_supported``;
* no fused backend supports the layer on this device: ``no_backend``;
* MLA with decode rows beside prefills, when the installed vLLM's ``MLAAttention.forward_impl`` does not
  have the structure the decode rows rely on (:data:`FORWARD_IMPL_STRUCTURE`): ``decode_tokens``;
* MLA with cached context, when the backend does not run prefills with context or the KV cache is not
  the unquantized latent cache ``[num_blocks, block_size, kv_lora_rank + rope]``: ``chunked_prefill``.

Otherwise the fused path runs (path ``"fused"``: every prefill row is written by the fused backend
:func:`fusion_pass.backends.select_backend` picks):

* standard layers (pure-prefill batches): causal varlen attention of the ``num_actual_tokens`` rows;
* MLA (vLLM orders a batch's ``D = num_decode_tokens`` decode rows first, then the prefills): the
  prefill rows ``[D, num_actual_tokens)`` through :func:`fusion_pass.prefill.run_prefills`, keys and
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
import inspect
import logging

import torch

from fusion_pass import backends, guard, nvfp4, prefill

logger = logging.getLogger("vllm.fusion_pass")

NO_METADATA = "no_attention_metadata"
LAYER_NOT_SUPPORTED = "layer_not_supported"
DECODE_TOKENS = "decode_tokens"
CHUNKED_PREFILL = "chunked_prefill"

FORWARD_IMPL_STRUCTURE = (
    "q = q[:num_actual_toks, ...]",
    "num_mqa_tokens = attn_metadata.num_decode_tokens",
    "num_mha_tokens = q.size(0) - num_mqa_tokens",
    "if num_mha_tokens > 0:",
    "mqa_q = q[:num_mqa_tokens]",
    "mqa_output_slice = output[:num_mqa_tokens]",
)
"""Statements of vLLM's ``MLAAttention.forward_impl`` (``vllm/model_executor/layers/attention/mla_attention.py``,
whitespace-normalised) that make ``forward_impl(q[:D], kv_c_normed[:D], k_pe[:D], kv_cache, metadata,
output=[D, H*Dv])`` compute exactly the decode rows of the whole call: the inputs are cut to
``num_actual_tokens`` rows (``D`` stay ``D``), the MQA (decode) part takes the first ``num_decode_tokens``
rows, the MHA (prefill) part the rest of ``q``, which is empty."""

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
    """``(attention metadata, layer, KV cache)`` of ``layer_name`` from vLLM's forward context."""
    from vllm.model_executor.layers.attention.attention import get_attention_context

    return get_attention_context(_name(layer_name))[:3]


def decide(layer_name, q, md, layer, kv_cache=None) -> "guard.Decision":
    """The guard for one call (module docstring), from the layer, its metadata and KV cache (:func:`_context`).

    Per token, as :func:`fusion_pass.guard.decide`: ``prefill_tokens`` and ``fused_tokens`` of the
    ``num_actual_tokens`` rows, ``post_quantized`` ``{reason: rows}`` for the rest (a fallback: every
    row under its reason; an MLA batch with decode rows fused: the decode rows under ``decode_tokens``).
    No metadata (a profile or dummy run) counts no tokens.
    """
    if md is None:
        return guard.Decision("fallback", NO_METADATA, None, "no attention metadata (vLLM profile/dummy run)")
    mla = _is_mla(layer)
    n = int(getattr(md, "num_actual_tokens", q.shape[0]))
    if mla:
        decode, _, context_lens = _mla_batch(md)
        with_context = sum(1 for c in context_lens if c)
    else:
        decode, with_context = _batch_kind(md)
    prefill = n - decode

    def fallback(reason: str, detail: str) -> guard.Decision:
        return guard.Decision("fallback", reason, None, detail, prefill, 0, {reason: n})

    if prefill == 0:
        return fallback(DECODE_TOKENS, f"{decode} decode token(s), no prefill")
    if not mla and decode:
        return fallback(DECODE_TOKENS, f"{decode} decode token(s)")
    if not mla and with_context:
        return fallback(CHUNKED_PREFILL, f"{with_context} prefill request(s) with cached context")
    dcp = _dcp_world_size()
    if dcp != 1:
        return fallback("dcp_world_size>1", f"dcp_world_size={dcp}")
    unsupported = _unsupported(layer, md)
    if unsupported:
        return fallback(LAYER_NOT_SUPPORTED, f"{_name(layer_name)}: {unsupported}")
    heads, qk_dim, v_dim = _dims(layer)
    backend, why = backends.select_backend(q.device, q.dtype, heads, qk_dim, v_dim)
    if backend is None:
        return fallback("no_backend", why)
    if not mla:
        return guard.Decision("fused", None, backend.name, why, prefill, prefill, {})
    if decode:
        mismatch = _forward_impl_mismatch(type(layer).forward_impl)
        if mismatch:
            return fallback(DECODE_TOKENS, f"{decode} decode token(s) beside {prefill} prefill token(s): {mismatch}")
        why += f"; {decode} decode row(s) computed by vLLM's MLA decode and post-quantized"
    if with_context:
        if not getattr(backend, "handles_context", False):
            return fallback(CHUNKED_PREFILL, f"{with_context} prefill request(s) with cached context: backend "
                                             f"{backend.name} runs prefills without cached context only")
        unreadable = _latent_cache_unreadable(layer, kv_cache)
        if unreadable:
            return fallback(CHUNKED_PREFILL, f"{with_context} prefill request(s) with cached context: {unreadable}")
        why += (f"; {with_context} prefill(s) attend to {sum(context_lens)} cached context token(s) "
                f"read from the paged latent cache")
    return guard.Decision("fused", None, backend.name, why, prefill, prefill,
                          {DECODE_TOKENS: decode} if decode else {})


def _is_mla(layer) -> bool:
    return hasattr(layer, "kv_b_proj") and hasattr(layer, "qk_nope_head_dim")


def _dims(layer) -> tuple[int, int, int]:
    """(query heads of this rank, q/k head dim, v head dim)."""
    if _is_mla(layer):
        return layer.num_heads, layer.qk_nope_head_dim + layer.qk_rope_head_dim, layer.v_head_dim
    return layer.num_heads, layer.head_size, layer.head_size


def _quantized_kv_cache(kv_dtype) -> bool:
    """Whether vLLM stores this layer's KV cache quantized (FP8 and the like): vLLM's own
    ``is_quantized_kv_cache``; ``"auto"`` and explicit half/float dtypes are not."""
    if kv_dtype in (None, "auto"):
        return False
    try:
        from vllm.utils.torch_utils import is_quantized_kv_cache
    except ImportError:
        return str(kv_dtype) not in ("bfloat16", "float16", "half", "float", "float32")
    return bool(is_quantized_kv_cache(kv_dtype))


def _unsupported(layer, md) -> str | None:
    """What the layer computes that the fused kernels (plain causal softmax attention) do not, or None."""
    impl = getattr(layer, "impl", None)
    kv_dtype = getattr(layer, "kv_cache_dtype", "auto")
    if _quantized_kv_cache(kv_dtype):
        return f"KV cache dtype {kv_dtype!r} (the fused kernels read unquantized keys and values)"
    window = getattr(impl, "sliding_window", None)
    if window in (None, -1, (-1, -1)):
        window = getattr(layer, "sliding_window", None)
    if window not in (None, -1, (-1, -1)):
        return f"sliding window {window}"
    if _is_mla(layer):
        if getattr(impl, "is_sparse", False):
            return "sparse MLA"
        if getattr(layer, "hisparse_cache", None) is not None:
            return "HiSparse KV cache"
        if getattr(layer, "use_pcp", False):
            return "prefill context parallelism"
        return None
    attn_type = str(getattr(layer, "attn_type", "decoder"))
    if "decoder" not in attn_type.lower() or not getattr(md, "causal", True):
        return f"attention type {attn_type} (the fused kernels are causal decoder attention)"
    if getattr(layer, "kv_sharing_target_layer_name", None):
        return "KV sharing with another layer"
    for name in ("alibi_slopes", "sinks"):
        if getattr(impl, name, None) is not None:
            return name.replace("_", " ")
    if getattr(impl, "logits_soft_cap", None):
        return f"logit soft-cap {impl.logits_soft_cap}"
    return None


@functools.lru_cache(maxsize=None)
def _forward_impl_mismatch(forward_impl) -> str | None:
    """Why ``forward_impl`` (vLLM's ``MLAAttention.forward_impl``) cannot compute the decode rows alone
    (a statement of :data:`FORWARD_IMPL_STRUCTURE` missing from its source), or None."""
    where = getattr(forward_impl, "__qualname__", repr(forward_impl))
    try:
        source = " ".join(inspect.getsource(forward_impl).split())
    except (OSError, TypeError) as exc:
        return f"cannot read the source of vLLM's {where} to check its decode/prefill split ({exc})"
    missing = [s for s in FORWARD_IMPL_STRUCTURE if s not in source]
    if missing:
        return (f"the installed vLLM's {where} does not split decode and prefill rows as the fused path "
                f"relies on (missing: {'; '.join(missing)})")
    return None


def _latent_cache_unreadable(layer, kv_cache) -> str | None:
    """Why ``kv_cache`` is not an unquantized MLA latent cache ``[num_blocks, block_size, L + R]``, or None."""
    width = layer.kv_lora_rank + layer.qk_rope_head_dim
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 3 or kv_cache.shape[-1] != width:
        shape = list(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else type(kv_cache).__name__
        return f"KV cache {shape} is not the MLA latent cache [num_blocks, block_size, {width}]"
    if kv_cache.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"KV cache dtype {kv_cache.dtype} (the fused path reads unquantized latents)"
    return None


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


def _run_fused(backend_name: str, md, layer, kv_cache, inputs, output, output_scale, output_block_scale) -> None:
    """The fused backend on the batch's prefill rows (MLA: :func:`_run_fused_mla`); padding rows zeroed."""
    if _is_mla(layer):
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


def _mla_batch(md) -> tuple[int, list[int], list[int]]:
    """``(D, query_lens, context_lens)`` of vLLM's MLA metadata (``MLACommonMetadata``), host ints: the
    decode tokens (rows ``[0, D)``), then per prefill request (rows from ``D`` on, in order) its new
    tokens and its cached context tokens (``prefill.chunked_context.context_lens_list``; 0 without)."""
    decode = int(md.num_decode_tokens)
    prefill = getattr(md, "prefill", None)  # absent from some platforms' sparse MLA metadata
    if prefill is None or not getattr(md, "num_prefills", 0):
        return decode, [], []
    lens = getattr(prefill, "query_lens_cpu", None)
    if lens is None:  # vLLM's builder sets it; otherwise from the (device) offsets
        loc = prefill.query_start_loc[: md.num_prefills + 1].to("cpu")
        lens = loc[1:] - loc[:-1]
    query_lens = [int(x) for x in lens.tolist()]
    chunked = prefill.chunked_context
    context_lens = [int(c) for c in chunked.context_lens_list] if chunked is not None else [0] * len(query_lens)
    return decode, query_lens, context_lens


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
    context as :data:`fusion_pass.prefill.ContextRows` (the paged latents of the rows asked for, expanded
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
    through :func:`fusion_pass.prefill.run_prefills` first (its entry point may zero scale bytes of the
    last 128-row tile, which decode rows may share), then the decode rows ``[0, D)``
    (:func:`_run_decode_rows`); rows past ``n`` zeroed."""
    n = int(md.num_actual_tokens)
    decode, query_lens, context_lens = _mla_batch(md)
    q, kv_c_normed, k_pe = (t[:n] for t in inputs)
    packed, scale_bytes, scales = _nvfp4_rows(output, output_block_scale, n)
    k, v, context = _mla_keys(layer, md, kv_cache, kv_c_normed, k_pe, decode, context_lens)
    prefill.run_prefills(backend, q, k, v, first_row=decode, query_lens=query_lens, context_lens=context_lens,
                          context=context, softmax_scale=float(layer.scale),
                          output=packed[:n], output_scale=output_scale, output_block_scale=scales)
    if decode:
        _run_decode_rows(layer, md, kv_cache, inputs, decode, output_scale, packed, scale_bytes, output_block_scale)
    _zero_padding(packed, scale_bytes, n)


def _run_decode_rows(layer, md, kv_cache, inputs, decode: int, output_scale, packed, scale_bytes,
                     output_block_scale) -> None:
    """Rows ``[0, D)`` of an MLA call exactly as the unfused graph writes them.

    vLLM's ``forward_impl`` on the decode rows only (its MQA part; :data:`FORWARD_IMPL_STRUCTURE`) into a
    ``[D, H*Dv]`` temporary of the query dtype, the unfused graph's quant op (:func:`_quant_op`) into
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
    _quant_op()(tmp, output_scale, True, output=rows_packed, output_scale=rows_scales)
    packed[:decode].copy_(rows_packed)
    offsets = nvfp4.row_scale_offsets(0, decode, width // nvfp4.BLOCK_SIZE, q.device)
    scale_bytes[offsets] = rows_scales.view(torch.uint8).view(-1)[offsets]


def _batch_kind(md):
    """(decode tokens, prefill requests with cached context) of vLLM's attention metadata."""
    if hasattr(md, "num_decode_tokens") and hasattr(md, "prefill") and hasattr(md, "num_prefills"):  # MLA common
        decode, _, context_lens = _mla_batch(md)
        return decode, sum(1 for c in context_lens if c)
    # standard backends: per request, context = seq_len - query_len; a one-token query with context is a decode
    qsl, seq_lens = getattr(md, "query_start_loc", None), getattr(md, "seq_lens", None)
    if qsl is None or seq_lens is None:
        return 1, 0  # unknown metadata: never fused
    n = seq_lens.shape[0]
    q_lens = (qsl[1:n + 1] - qsl[:n]).to("cpu")
    ctx = seq_lens.to("cpu") - q_lens
    is_decode = (ctx > 0) & (q_lens == 1)
    return int(q_lens[is_decode].sum().item()), int(((ctx > 0) & ~is_decode).sum().item())


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
    md, layer, kv_cache = _context(layer_name)
    decision = decide(layer_name, inputs[0], md, layer, kv_cache)
    if decision.fused:  # the exact fallback calls vLLM's op, which runs the KV-connector hooks itself
        _with_kv_transfer()(layer_name, lambda: _run_fused(decision.backend, md, layer, kv_cache, inputs, output,
                                                           output_scale, output_block_scale))
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
