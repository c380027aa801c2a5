"""The ops the rewritten vLLM graph calls: ``fusion_pass::vllm_attention_nvfp4`` and
``fusion_pass::vllm_mla_attention_nvfp4``.

Their schemas mirror vLLM's ``unified_attention_with_output`` / ``unified_mla_attention_with_output``
(every argument, ``kv_cache_dummy_dep`` and ``layer_name`` of vLLM's ``LayerNameType`` included), so the
pass only retargets the call. ``output`` is the quant's packed uint8 ``[T, H*Dv/2]`` buffer,
``output_scale`` the global scale, ``output_block_scale`` the quant's int32 swizzled scale buffer.

Per call, the guard (:func:`fusion_pass.vllm.guard.decide`) reads the layer, its attention metadata, its KV
cache and settings from vLLM's forward context (``get_attention_context``) and decides row by row with the
shared core, :func:`fusion_pass.runtime.guard.decide`, from host-side values only (no device read: the decision
and the fallback can be captured in a CUDA graph). ``docs/vllm.md`` ("What runs, per call") lists what is fused and
every reason for the exact fallback. Fused (path ``"fused"``): every prefill row is written by the fused backend
:func:`fusion_pass.runtime.backends.select_backend` picks (:func:`fusion_pass.vllm.fused_rows.run_fused`); decode
rows beside them are computed by vLLM (MLA: its ``forward_impl`` on rows ``[0, D)``; standard layers: the
backend's adapter on the decode requests alone, :mod:`fusion_pass.vllm.adapters`) and quantized by the unfused
graph's quant op into their rows (counted under ``decode_tokens`` in ``post_quantized``): byte-equal to the
unfused graph.

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
import os

import torch

from fusion_pass.runtime import counters, settings
from fusion_pass.vllm import fused_rows
from fusion_pass.vllm.adapters import install_host_hooks
from fusion_pass.vllm.guard import decide, layer_name_of

__all__ = ["register"]

logger = logging.getLogger("vllm.fusion_pass")

# (no ``from __future__ import annotations`` here: the op signatures are read by infer_schema)
_lib = None  # the torch.library.Library holding the ops (their lifetime is the library's)
run_fused = fused_rows.run_fused  # module attributes, so that tests and benchmarks can wrap them
quant_op = fused_rows.quant_op

_ENVIRONMENT = (settings.BACKEND_ENV, settings.CONTEXT_WORKSPACE_ENV, settings.SELF_CHECK_ENV)
_checked_environment = None
# os.environ's own dict (encoded keys): three lookups in it cost a fraction of three os.environ.get
_environ_data = getattr(os.environ, "_data", None)
_environ_keys = tuple(os.environ.encodekey(name) for name in _ENVIRONMENT) if _environ_data is not None else None


def _check_environment() -> None:
    """:func:`fusion_pass.runtime.settings.check_environment` whenever the variables differ from the last values
    checked (a bad value raises on every call, as the runtime's ops do; a good one is parsed once)."""
    global _checked_environment
    if _environ_data is not None:
        a, b, c = _environ_keys
        raw = (_environ_data.get(a), _environ_data.get(b), _environ_data.get(c))
    else:
        raw = tuple(os.environ.get(name) for name in _ENVIRONMENT)
    if raw != _checked_environment:
        settings.check_environment()
        _checked_environment = raw


@functools.lru_cache(maxsize=None)
def _attention_module():
    from vllm.model_executor.layers.attention import attention

    return attention


def _context(layer_name):
    """``(attention metadata, layer, KV cache)`` of ``layer_name`` from vLLM's forward context."""
    return _attention_module().get_attention_context(layer_name)[:3]


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
    _check_environment()
    name = layer_name_of(layer_name)
    md, layer, kv_cache = _context(name)
    decision = decide(name, inputs[0], md, layer, kv_cache)
    if decision.fused:  # the exact fallback calls vLLM's op, which runs the KV-connector hooks itself
        _with_kv_transfer()(name, lambda: run_fused(decision.backend, md, layer, kv_cache, inputs, output,
                                                     output_scale, output_block_scale))
    else:
        _run_unfused(vllm_op, inputs, output, layer_name, output_scale, output_block_scale, rest, heads, md)
    counters.record(decision, layer_name=name)
    key = decision.reason or decision.backend
    if key not in _logged:  # vLLM shows its own loggers; each path is named once per process
        _logged.add(key)
        what = f"fused with backend {decision.backend}" if decision.fused else f"fell back ({decision.reason})"
        logger.info("fusion_pass: %s: attention + NVFP4 quant %s: %s; further calls are only counted",
                    name, what, decision.detail or "no detail")


_STEP_BUFFER = "_fusion_pass_unfused_buffer"


def _buffer(md, tokens: int, width: int, heads, dtype, device):
    """``(tmp [T, H*Dv], the view vLLM's op writes)`` of the query dtype: one per step, kept on vLLM's metadata
    object and reused by every layer of the step (their calls run one after the other on one stream, each
    quantizing the buffer before the next writes it); without metadata, or while a CUDA graph is captured (its
    temporaries stay the capture's), a fresh one."""
    if md is not None and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        md = None
    key = (tokens, width, heads, dtype, device)
    kept = getattr(md, _STEP_BUFFER, None) if md is not None else None
    if kept is not None and kept[0] == key:
        return kept[1], kept[2]
    tmp = torch.empty(tokens, width, dtype=dtype, device=device)
    target = tmp if heads is None else tmp.view(tokens, heads, width // heads)
    if md is not None:
        try:
            setattr(md, _STEP_BUFFER, (key, tmp, target))
        except AttributeError:  # slotted or frozen metadata
            pass
    return tmp, target


def _run_unfused(vllm_op, inputs, output, layer_name, output_scale, output_block_scale, rest, heads, md=None) -> None:
    """vLLM's attention into a temporary of the query dtype, then the unfused graph's quant op."""
    q = inputs[0]
    tokens = output.shape[0]
    tmp, target = _buffer(md, tokens, output.numel() // tokens * 2, heads, q.dtype, q.device)
    vllm_op(*inputs, target, layer_name, **rest)
    # the attention op's output_scale is the global scale (the quant's input_scale); its output_block_scale is
    # the quant's output_scale (the block scales)
    quant_op()(tmp, output_scale, True, output=output if output.dim() == 2 else output.view(tokens, -1),
               output_scale=output_block_scale)


_logged: set = set()


def register() -> None:
    """Define the two ops (idempotent). Needs vLLM (its ``LayerNameType`` and op registration helper)."""
    global _lib
    if _lib is not None:
        return
    from vllm.utils.torch_utils import LayerNameType, direct_register_custom_op

    import fusion_pass.ops  # noqa: F401  (the fusion_pass library and its quant op)

    install_host_hooks()  # standard backends' metadata keeps its batch's host copies (fusion_pass.vllm.host_rows)

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
