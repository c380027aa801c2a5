"""The ops the rewritten vLLM graph calls: ``fusion_pass::vllm_attention_nvfp4`` and
``fusion_pass::vllm_mla_attention_nvfp4`` (named for their first format; they write every format the pass fuses).

Their schemas mirror vLLM's ``unified_attention_with_output`` / ``unified_mla_attention_with_output``
(every argument, ``kv_cache_dummy_dep`` and ``layer_name`` of vLLM's ``LayerNameType`` included), so the
pass only retargets the call. The buffers say the format (:func:`fusion_pass.formats.call_format`, read once per
call), as for vLLM's own quantized attention calls:

* NVFP4: ``output`` the quant's packed uint8 ``[T, H*Dv/2]`` buffer, ``output_scale`` the global scale
  (float32 ``[1]``), ``output_block_scale`` the quant's int32 swizzled scale buffer;
* static per-tensor FP8: ``output`` the quant's float8_e4m3fn ``[T, H*Dv]`` buffer (``result``), ``output_scale``
  its static scale (float32 ``[1]``), no ``output_block_scale`` (checked: :func:`fusion_pass.vllm.runtime
  .fp8_static_rows.check_call`);
* FP8 with 128-column groups (vLLM's MLA op's convention, which the standard op takes too as this project's
  arguments): ``output`` the quant's float8_e4m3fn ``[T, H*Dv]`` codes, ``output_block_scale`` its float32 group
  scales (any of vLLM's three layouts), ``quant_group_size=128`` and ``quant_scale_ue8m0``, no ``output_scale``
  (checked: :func:`fusion_pass.vllm.runtime.fp8_group_rows.check_call`). vLLM's op is called without them for the
  query-dtype attention of the fallback, quantized by the unfused graph's group quant op.

A call without ``output_scale`` (the query-dtype form) is refused with ``ValueError``: the pass never emits one.

Per call, the op reads the layer, its attention metadata and its KV cache from vLLM's forward context, and the
guard (:mod:`fusion_pass.vllm.runtime.guard`) decides row by row with the shared core,
:func:`fusion_pass.runtime.guard.decide`, from host-side values only (no device read: the decision and the fallback
can be captured in a CUDA graph). ``docs/vllm.md`` ("What runs, per call") lists what is fused and every reason for
the exact fallback.

Cheap per call (the op runs once per layer per step): what the calls of one step share is kept on vLLM's metadata
object (:class:`_Step`): the environment check, the decision of a decode-only step (the steps of steady decoding:
their calls take the exact fallback without asking the guard), the fallback's temporary. A step with prefill rows
asks the guard per call, which keeps its decision per step for layers that read alike. The count is one append
(:func:`fusion_pass.runtime.counters.record`); the first call of each path is logged once.

Fused (path ``"fused"``): every prefill row is written by the fused backend
:func:`fusion_pass.runtime.backends.select_backend` picks (:func:`fusion_pass.vllm.runtime.fused_rows.run_fused`); decode
rows beside them are computed by vLLM (MLA: its ``forward_impl`` on rows ``[0, D)``; standard layers: the
backend's adapter on the decode requests alone, :mod:`fusion_pass.vllm.adapters`) and quantized by the unfused
graph's quant op into their rows (counted under ``decode_tokens`` in ``post_quantized``): byte-equal to the
unfused graph. Static FP8 takes the same paths through the backend's ``run_varlen_fp8_static``, except the one
fused launch over a standard layer's paged cache, which writes NVFP4 only (the guard refuses it for FP8 with its
reason; a mixed call is then split, or falls back as ``mixed_not_split``). Counted with the decision's format
(:mod:`fusion_pass.runtime.counters`: ``"reference (fp8_static)"``...).

Rows past ``num_actual_tokens`` (vLLM's padding) are zeroed. The new tokens reach the KV cache through
vLLM's own cache-update op, which the graph keeps (``kv_cache_dummy_dep``). The fused path runs inside
vLLM's KV-connector hooks (``maybe_transfer_kv_layer``: a connector's layer load is waited for before the
cached context is read, the layer saved after), as vLLM's attention ops run.

The exact fallback calls vLLM's own attention op into a temporary buffer of the query dtype, then the
same quant op the unfused graph calls (NVFP4: ``_C::scaled_fp4_quant.out`` where vLLM has it, else
``fusion_pass::scaled_fp4_quant.out``; static FP8: ``_C::static_scaled_fp8_quant`` where vLLM has it, else
``fusion_pass::static_scaled_fp8_quant``): the bytes equal vLLM's unfused graph.
"""


import functools
import logging

import torch

from fusion_pass.formats import FP8_STATIC, NVFP4, call_format
from fusion_pass.runtime import counters, settings
from fusion_pass.runtime.fp8_rows import NATIVE_FORM, OP_FORM
from fusion_pass.vllm import notices, releases
from fusion_pass.vllm.runtime import fp8_group_rows, fp8_static_rows, fused_rows
from fusion_pass.vllm.runtime.call_buffers import unfused_width
from fusion_pass.vllm.adapters.registry import install_host_hooks
from fusion_pass.vllm.runtime.guard import decide, decide_rows, decode_only_decision, layer_name_of

__all__ = ["register"]

logger = logging.getLogger("vllm.fusion_pass")

# (no ``from __future__ import annotations`` here: the op signatures are read by infer_schema)
_lib = None  # the torch.library.Library holding the ops (their lifetime is the library's)

_forward_context_module = None  # vllm.forward_context, imported at the first call


def _context(layer_name):
    """``(attention metadata, layer, KV cache)`` of ``layer_name`` from vLLM's forward context: what vLLM's
    ``get_attention_context`` (vllm/model_executor/layers/attention/attention.py) returns, read from the
    ``ForwardContext`` fields directly (``attn_metadata``: one metadata per layer name, or a list of such dicts of
    which the first is the model's; ``no_compile_layers``: the layers by name), without the slot mapping."""
    global _forward_context_module
    if _forward_context_module is None:
        from vllm import forward_context

        _forward_context_module = forward_context
    context = _forward_context_module.get_forward_context()  # vLLM's own error when no context is set
    md = context.attn_metadata
    if isinstance(md, dict):
        md = md[layer_name]
    elif isinstance(md, list):
        md = md[0][layer_name]
    layer = context.no_compile_layers[layer_name]
    return md, layer, layer.kv_cache


@functools.lru_cache(maxsize=None)
def _kv_transfer_utils():
    from vllm.model_executor.layers.attention import kv_transfer_utils

    return kv_transfer_utils


@functools.lru_cache(maxsize=None)
def _with_kv_transfer():
    """``call(layer_name, fn)``: ``fn()`` inside vLLM's KV-connector hooks, as vLLM's attention ops run
    (``maybe_transfer_kv_layer``, vllm/model_executor/layers/attention/kv_transfer_utils.py: with a KV
    connector, wait for the layer's KV to load before, save the layer's KV after; else nothing)."""
    from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer

    def call(layer_name, fn):
        fn()

    return maybe_transfer_kv_layer(call)


_STEP = "_fusion_pass_step"  # the _Step kept on a metadata object


class _Step:
    """What the calls of one step share, kept on vLLM's metadata object (one per step and KV-cache group, shared
    by the layers of the group): ``decision``, the decision of every NVFP4 call of a decode-only step (None: decided
    per call), ``decisions``, the same for the other formats by name (filled at their first call), and ``buffer``,
    the fallback's temporary (:func:`_run_unfused`). ``md_id``: the object it was made for (a shallow copy of the
    metadata carries the attribute, not the identity)."""

    __slots__ = ("md_id", "decision", "decisions", "buffer")

    def __init__(self, md, name):
        settings.check_environment()  # at the first call of each step (and at every call without metadata)
        self.md_id = id(md)
        self.buffer = None
        self.decisions = None
        self.decision = decision = decode_only_decision(md)
        if decision is not None:
            _log_path(name, decision)
        try:
            setattr(md, _STEP, self)
        except AttributeError:  # slotted or frozen metadata: a step per call
            pass

    def decision_for(self, md, name, output_format):
        """:attr:`decision` for a call writing ``output_format`` (another format's decode-only decision, made at its
        first call of the step)."""
        if output_format is NVFP4:
            return self.decision
        if self.decisions is None:
            self.decisions = {}
        key = output_format.name
        if key not in self.decisions:
            decision = self.decisions[key] = decode_only_decision(md, output_format)
            if decision is not None:
                _log_path(name, decision)
        return self.decisions[key]


def _format(output, output_scale, output_block_scale, output_inv_scale=None, group=None):
    """The call's output format (:func:`fusion_pass.formats.call_format`) and, for FP8, its arithmetic and scale
    (:class:`fusion_pass.runtime.fp8_rows.StaticQuant`: the op form and ``output_scale``, or the native form
    and ``output_inv_scale``; for a group call, ``group`` = ``(quant_group_size, quant_scale_ue8m0)``, a
    :class:`fusion_pass.runtime.fp8_group_rows.GroupQuant` and no scale), its buffers checked where the format needs
    it (FP8: :func:`fusion_pass.vllm.runtime.fp8_static_rows.check_call`, :func:`.fp8_group_rows.check_call`);
    ``ValueError`` naming the argument for a call the fused op does not write."""
    if group is not None and group[0] is not None:
        if output_inv_scale is not None:
            raise ValueError("fusion_pass vLLM attention op: output_inv_scale must be None with quant_group_size")
        fp8_group_rows.check_call("fusion_pass vLLM attention op", output, output_scale, output_block_scale, group[0])
        quant = fp8_group_rows.group_quant(group[1])
        return quant.format, quant, None
    if output_inv_scale is not None:
        for name, value in (("output_scale", output_scale), ("output_block_scale", output_block_scale)):
            if value is not None:
                raise ValueError(f"fusion_pass vLLM attention op: {name} must be None with output_inv_scale (static "
                                 f"FP8 in the native form)")
        fp8_static_rows.check_call("fusion_pass vLLM attention op", output, output_inv_scale, None,
                                   scale_name="output_inv_scale")
        return FP8_STATIC, NATIVE_FORM, output_inv_scale
    return _op_format(output, output_scale, output_block_scale), OP_FORM, output_scale


def _op_format(output, output_scale, output_block_scale):
    fmt = call_format(output, output_scale, output_block_scale)
    if fmt is NVFP4:
        return fmt
    if fmt is None:
        raise ValueError("fusion_pass vLLM attention op: output_scale is None: the fused op writes a quantized output "
                         "(NVFP4, static FP8 or FP8 groups), never the query dtype")
    fp8_static_rows.check_call("fusion_pass vLLM attention op", output, output_scale, output_block_scale)
    return FP8_STATIC


def _run(vllm_op, inputs, output, layer_name, output_scale, output_block_scale, rest, heads, extra=None,
         output_inv_scale=None, group=None) -> None:
    """One call. Per call, beyond vLLM's op and the quant op (the exact fallback) or the fused rows: the output
    format read from the buffers (:func:`_format`), the forward context's entry for the layer, the step kept on its
    metadata (a decode-only step's decision, taken once per step and format; otherwise the guard, whose decision is
    kept per step for layers that read alike), the count. ``rest``: the arguments of vLLM's op after
    ``output_block_scale``, in its schema's order; ``extra``: those of them the fused MLA rows pass on to vLLM's
    ``forward_impl`` for the decode rows (by name). ``output_inv_scale``: the native form of static FP8 (this
    project's argument, not vLLM's): the rows written with it in ``output_scale``'s place (:func:`_format`);
    ``group``: ``(quant_group_size, quant_scale_ue8m0)`` of a group FP8 call (``rest`` then carries None in their
    places: vLLM's op computes the query-dtype attention of the fallback)."""
    fmt, fp8_quant, output_scale = _format(output, output_scale, output_block_scale, output_inv_scale, group)
    name = layer_name if type(layer_name) is str else layer_name_of(layer_name)
    md, layer, kv_cache = _context(name)
    if md is None:  # vLLM's profile and dummy runs
        settings.check_environment()
        step = None
        decision = decide(name, inputs[0], md, layer, kv_cache, fmt)
        _log_path(name, decision)
    else:
        step = getattr(md, _STEP, None)
        if step is None or step.md_id != id(md):
            step = _Step(md, name)
        decision = step.decision if fmt is NVFP4 else step.decision_for(md, name, fmt)
        if decision is not None:  # a decode-only step: the exact fallback, decided once for the step
            _run_unfused(vllm_op, inputs, output, layer_name, output_scale, output_block_scale, rest, heads, step,
                         fmt, fp8_quant)
            counters.record(decision, name)
            return
        decision = decide_rows(name, inputs[0], md, layer, kv_cache, fmt)
        if (decision.reason or decision.backend, decision.format) not in _logged:
            _log_path(name, decision)
    if decision.fused:  # the exact fallback calls vLLM's op, which runs the KV-connector hooks itself
        if _kv_transfer_utils().has_kv_transfer_group():
            _with_kv_transfer()(name, lambda: fused_rows.run_fused(decision, md, layer, kv_cache, inputs, output,
                                                                    output_scale, output_block_scale, extra,
                                                                    fp8_quant))
        else:  # what vLLM's hooks do without a KV connector: nothing
            fused_rows.run_fused(decision, md, layer, kv_cache, inputs, output, output_scale, output_block_scale,
                                 extra, fp8_quant)
    else:
        _run_unfused(vllm_op, inputs, output, layer_name, output_scale, output_block_scale, rest, heads, step, fmt,
                     fp8_quant)
    counters.record(decision, name)


_logged: set = set()


def _log_path(name, decision) -> None:
    """The first call of each path (a backend, or a fallback reason) in this process, at INFO (vLLM shows its own
    loggers)."""
    key = (decision.reason or decision.backend, decision.format)
    if key in _logged:
        return
    _logged.add(key)
    key, quant = key[0], "NVFP4" if decision.format == NVFP4.name else decision.format
    if key.startswith("no_decode_adapter:") or key in ("no_host_metadata", "no_backend"):  # every such call falls back
        notices.notice(key, f"{name}: every call with prefill rows takes the exact fallback ({key}): "
                            f"{decision.detail or 'no detail'}")
        return
    what = f"fused with backend {decision.backend}" if decision.fused else f"fell back ({decision.reason})"
    logger.info("fusion_pass: %s: attention + %s quant %s: %s; further calls are only counted",
                name, quant, what, decision.detail or "no detail")


def _run_unfused(vllm_op, inputs, output, layer_name, output_scale, output_block_scale, rest=(), heads=None,
                 step=None, output_format=NVFP4, fp8_quant=OP_FORM) -> None:
    """vLLM's attention into a temporary of the query dtype, then the unfused graph's quant op of ``output_format``
    (:func:`fusion_pass.vllm.runtime.fused_rows.quant_op` for NVFP4, ``fused_rows.fp8_static_quant_op`` for static
    FP8: ``static_scaled_fp8_quant(result, input, scale)``). ``rest``: vLLM's op's arguments after
    ``output_block_scale`` (a tuple, in its schema's order).

    The temporary ``[T, H*Dv]`` (and the view vLLM's op writes, ``[T, H, Dv]`` for standard layers) is kept on the
    ``step`` and reused by every layer of the step with the same output shape (their calls run one after the other
    on one stream, each quantizing the temporary before the next writes it); without a step, or while a CUDA graph
    is captured (its temporaries stay the capture's), a fresh one."""
    q = inputs[0]
    shape = output.shape
    key = (shape, heads, q.dtype, output_format.name)
    kept = step.buffer if step is not None else None
    if kept is not None and kept[0] == key and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        tmp, target = kept[1], kept[2]
    else:
        tokens = shape[0]
        width = unfused_width(output_format, output)
        tmp = torch.empty(tokens, width, dtype=q.dtype, device=q.device)
        target = tmp if heads is None else tmp.view(tokens, heads, width // heads)
        if step is not None and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            step.buffer = (key, tmp, target)
    vllm_op(*inputs, target, layer_name, None, None, *rest)
    if output_format is FP8_STATIC:  # the quant's result is the op's output, its scale the op's output_scale
        fp8_static_rows.quantize(fp8_static_rows.codes(output), tmp, output_scale, fp8_quant)
        return
    if output_format is not NVFP4:  # a group format: the codes, the group scales the op's output_block_scale
        fp8_group_rows.quantize(fp8_static_rows.codes(output), output_block_scale, tmp, fp8_quant)
        return
    # the attention op's output_scale is the global scale (the quant's input_scale); its output_block_scale is
    # the quant's output_scale (the block scales)
    packed = output if len(shape) == 2 else output.view(shape[0], -1)
    fused_rows.quant_op()(tmp, output_scale, True, output=packed, output_scale=output_block_scale)


def register() -> None:
    """Define the two ops (idempotent), with the schemas of the installed vLLM release's ops (0.34's MLA op has
    ``mqa_q_prepared``). Needs a supported vLLM (:mod:`fusion_pass.vllm.releases`; raises ``RuntimeError`` with the
    gate's reason otherwise)."""
    global _lib
    if _lib is not None:
        return
    release = releases.current()
    if release is None:
        raise RuntimeError(f"fusion_pass.vllm: {releases.refusal()}")
    from vllm.utils.torch_utils import LayerNameType, direct_register_custom_op

    import fusion_pass.ops  # noqa: F401  (the fusion_pass library and its quant op)

    install_host_hooks()  # standard backends' metadata keeps its batch's host copies (fusion_pass.vllm.adapters.host_rows)
    standard_op = torch.ops.vllm.unified_attention_with_output.default
    mla_op = torch.ops.vllm.unified_mla_attention_with_output.default

    def vllm_attention_nvfp4(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        layer_name: LayerNameType,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
        kv_cache_dummy_dep: torch.Tensor | None = None,
        quant_group_size: int | None = None,
        quant_scale_ue8m0: bool | None = None,
        quant_col_major: bool | None = None,
        quant_tma_aligned: bool | None = None,
        output_inv_scale: torch.Tensor | None = None,
    ) -> None:
        _run(standard_op, (query, key, value), output, layer_name, output_scale, output_block_scale,
             (kv_cache_dummy_dep,), query.shape[1], output_inv_scale=output_inv_scale,
             group=(quant_group_size, quant_scale_ue8m0))

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
        output_inv_scale: torch.Tensor | None = None,
    ) -> None:
        _run(mla_op, (q, kv_c_normed, k_pe), output, layer_name, output_scale, output_block_scale,
             (kv_cache_dummy_dep, None, None, None, None, q_dcp_replicated), None, output_inv_scale=output_inv_scale,
             group=(quant_group_size, quant_scale_ue8m0))

    def vllm_mla_attention_nvfp4_with_mqa_q_prepared(  # 0.34's schema: mqa_q_prepared, a decode query made by the model
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
        mqa_q_prepared: torch.Tensor | None = None,
        output_inv_scale: torch.Tensor | None = None,
    ) -> None:
        _run(mla_op, (q, kv_c_normed, k_pe), output, layer_name, output_scale, output_block_scale,
             (kv_cache_dummy_dep, None, None, None, None, q_dcp_replicated, mqa_q_prepared), None,
             {"mqa_q_prepared": mqa_q_prepared}, output_inv_scale=output_inv_scale,
             group=(quant_group_size, quant_scale_ue8m0))

    mla_forms = {(): vllm_mla_attention_nvfp4, ("mqa_q_prepared",): vllm_mla_attention_nvfp4_with_mqa_q_prepared}
    extra_args = release.mla_op_extra_args
    if extra_args not in mla_forms:
        raise RuntimeError(f"fusion_pass.vllm: no fused MLA op for vLLM {release.line}.x's extra arguments {extra_args}")
    mla_fn = mla_forms[extra_args]

    def _fake(*args, **kwargs) -> None:
        return None

    lib = torch.library.Library("fusion_pass", "FRAGMENT")
    for name, fn in (("vllm_attention_nvfp4", vllm_attention_nvfp4), ("vllm_mla_attention_nvfp4", mla_fn)):
        if hasattr(torch.ops.fusion_pass, name):  # defined by an earlier copy of this module
            continue
        direct_register_custom_op(name, fn, mutates_args=["output", "output_block_scale"],
                                  fake_impl=_fake, target_lib=lib, dispatch_key="CompositeExplicitAutograd")
    _lib = lib
