"""One attention call at run time: the guard's decision, then the row plan and the backend, or the exact
unfused computation; counted once it has completed.

The walk goes down only: :func:`run` -> :func:`fusion_pass.runtime.guard.decide` ->
:func:`fusion_pass.runtime.row_plan.run_on_prefill` (or, for a standard layer's mixed call, one paged launch:
:func:`_run_one_call`) -> the backend's kernels (:mod:`fusion_pass.kernels`).
The op (:mod:`fusion_pass.ops.attention`) has checked every argument before calling :func:`run`.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from fusion_pass import formats, nvfp4
from fusion_pass.runtime import backends, counters, fp8_group_rows, fp8_rows, guard, row_plan, self_check, settings

__all__ = ["layer_shape", "run"]


def layer_shape(impl, q: Tensor, inputs: tuple = ()) -> guard.LayerShape:
    """What a backend must support for ``impl`` (an MLA or standard runtime) called with ``q`` (and the call's
    ``inputs``: the dtype of its key/value inputs when it is not q's). One object per layer and (device, dtype,
    key/value dtype), made on the layer's first such call (the layer's dims never change)."""
    kv_dtype = None
    for x in inputs[1:]:
        if x.dtype != q.dtype:
            kv_dtype = x.dtype
            break
    key = (q.device, q.dtype, kv_dtype)
    shapes = impl.__dict__.setdefault("_layer_shapes", {})
    shape = shapes.get(key)
    if shape is None:
        qk = impl.qk_nope_head_dim + impl.qk_rope_head_dim if hasattr(impl, "qk_nope_head_dim") else impl.head_dim
        shape = shapes[key] = guard.LayerShape(q.device, q.dtype, impl.num_heads, qk, impl.v_head_dim, kv_dtype,
                                               getattr(impl, "num_kv_heads", None))
    return shape


def _writer(output_format: formats.OutputFormat, output: Tensor, output_scale: Tensor, output_block_scale,
            t: int, fp8_quant: fp8_rows.StaticQuant | fp8_group_rows.GroupQuant) -> row_plan.RowWriter:
    """The call's buffers as its format's :class:`~fusion_pass.runtime.row_plan.RowWriter` (``T`` rows)."""
    if output_format is formats.FP8_STATIC:
        return fp8_rows.FP8StaticRows(output, output_scale, t, fp8_quant)
    if output_format in (formats.FP8_GROUP128, formats.FP8_GROUP128_UE8M0):
        return fp8_group_rows.FP8GroupRows(output, output_block_scale, t, fp8_quant)
    return row_plan.NVFP4Rows(output, output_scale, output_block_scale, t)


def _half_prefill_kernel(impl, q: Tensor, spec, inputs: tuple) -> Callable[..., Tensor] | None:
    """The kernel that computes a pure-prefill batch's attention in the query dtype on CUDA: the
    ``half_attention`` of the backend the guard would pick for the fused call, so that the unfused path and the
    fused one share their main loop. None: the layer's PyTorch runtime computes it (a backend without one, or a
    key/value input in another dtype than q: the kernels would round it, the runtime does not)."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and spec.num_decode_tokens == 0 and not spec.has_chunked_prefill):
        return None
    shape = layer_shape(impl, q, inputs)
    if shape.kv_dtype is not None:
        return None
    backend, _ = backends.select_backend(q.device, q.dtype, shape.num_heads, shape.qk_head_dim, shape.v_head_dim,
                                         fast_only=False)
    kernel = None if backend is None else getattr(backend, "half_attention", None)
    if kernel is None or self_check.failed_check(backend.name):
        return None  # a backend whose self-check failed computes nothing, not even the unfused attention
    return kernel


def _attention(impl, inputs: tuple, spec, q: Tensor) -> Tensor:
    """The batch's attention ``[T, H, Dv]``, appending the new tokens to the layer's cache.

    Pure-prefill batches on CUDA run the flash-attention kernel of the backend the guard selects (FA4's SM90
    forward or the Triton kernel; output in the query dtype, as a serving attention backend returns it);
    everything else runs the layer's PyTorch runtime (float32).
    """
    kernel = _half_prefill_kernel(impl, q, spec, inputs)
    if kernel is None:
        return impl.forward(*inputs, spec)
    q, k, v, _ = impl.prefill_qkv(*inputs, spec)
    cu_seqlens, max_seqlen = row_plan.varlen_meta(spec, q.device)
    return kernel(q, k, v, cu_seqlens, max_seqlen, impl.softmax_scale)


def _one_call_refusal(impl, inputs: tuple, spec) -> str | None:
    """Why the call cannot be offered to the guard as one launch over the layer's paged cache (None: it can): an
    MLA layer computes its decode rows in the absorbed form over its latent cache; a standard layer's
    ``paged_refusal`` (dtypes); a call without both decode and prefill rows is never one (the guard's rule)."""
    if not (spec.num_decode_tokens and spec.num_prefills):
        return "not a mixed call"
    refusal = getattr(impl, "paged_refusal", None)
    if refusal is None:
        return "an MLA layer's decode rows are the absorbed form over its latent cache"
    return refusal(*inputs, spec)


def _run_one_call(backend, impl, inputs: tuple, spec, output: Tensor, output_scale: Tensor,
                  output_block_scale: Tensor) -> None:
    """Every row of the call, decode rows included, in one launch of ``backend.run_paged`` over the layer's pages,
    after appending the call's new keys and values to them (``impl.paged_inputs``): ``output`` uint8 ``[T,
    H*Dv/2]`` and the swizzled ``output_block_scale`` written whole, scale padding zeroed."""
    q = inputs[0] if inputs[0].stride(-1) == 1 else inputs[0].contiguous()  # the kernels' layout
    paged = impl.paged_inputs(*inputs[1:], spec)
    packed, scales = nvfp4.byte_views(output, output_block_scale, spec.num_tokens)
    backend.run_paged(q, paged.k_pages, paged.v_pages, paged.cu_seqlens, paged.max_query_len, paged.seq_lens,
                      paged.block_table, paged.max_seq_len, impl.softmax_scale, packed, output_scale, scales)


def run(impl, inputs: tuple, spec, output, output_scale, output_block_scale, *, layer_name: str | None = None,
        output_format: formats.OutputFormat | None = None,
        fp8_quant: fp8_rows.StaticQuant | fp8_group_rows.GroupQuant = fp8_rows.OP_FORM) -> None:
    """One attention call of ``impl`` (an MLA or standard runtime) on ``inputs`` for the batch ``spec``.

    Without a format (no ``output_scale``, not a group call): attention in the query dtype, not guarded
    (:func:`_attention`). With one (a quantized output: NVFP4, static FP8, or FP8 groups): :func:`fusion_pass.runtime.guard.decide` picks the rows; the fused rows run
    the selected backend through the row plan (attention quantized from float32), the others exactly the
    unfused computation (attention rounded to the query dtype, then quantized); a standard layer's call with
    decode and prefill rows is offered as one launch over the layer's paged cache (``Decision.one_call``: every
    row, decode rows included, written by ``backend.run_paged``; :func:`_one_call_refusal` says when it is not);
    a call whose key/value inputs are not in the query dtype is not fused by a backend that would round them (the
    guard's ``kv_dtype``); :func:`fusion_pass.runtime.counters.record` counts the call once it has completed (under
    ``layer_name`` too). Should the computation fail part-way, the layer's cache is rolled back
    (``impl.cache.transaction()``). ``output_format``: the format the buffers say
    (:func:`fusion_pass.formats.call_format`, read here when not given): the guard decides for it and its
    :class:`~fusion_pass.runtime.row_plan.RowWriter` (:func:`_writer`) writes the rows, fused or not.
    ``fp8_quant``: a static FP8 call's arithmetic (:class:`fusion_pass.runtime.fp8_rows.StaticQuant`: the op form,
    ``output_scale`` the scale; the native form, ``output_scale`` the graph's inverse); a group FP8 call's
    (:class:`fusion_pass.runtime.fp8_group_rows.GroupQuant`; ``output_block_scale`` its scales, ``output_scale`` None).
    """
    q = inputs[0]
    settings.check_environment()
    output_format = output_format or formats.call_format(output, output_scale, output_block_scale)
    if output_format is None:
        with impl.cache.transaction():
            out = _attention(impl, inputs, spec, q)
            output.view(out.shape).copy_(out)
        return
    writer = _writer(output_format, output, output_scale, output_block_scale, spec.num_tokens, fp8_quant)
    decision = guard.decide(guard.BatchRows.from_spec(spec), layer_shape(impl, q, inputs),
                            one_call_refusal=_one_call_refusal(impl, inputs, spec), output_format=output_format)
    with impl.cache.transaction():
        if decision.one_call:  # the guard offers it only for a format the backend's paged launch writes (NVFP4)
            _run_one_call(backends.get_backend(decision.backend), impl, inputs, spec, output, output_scale,
                          output_block_scale)
        elif decision.fused:
            row_plan.run_rows(backends.get_backend(decision.backend), impl, inputs, spec, writer)
        else:
            out = _attention(impl, inputs, spec, q)
            writer.everything(out.to(q.dtype).reshape(spec.num_tokens, -1))
    counters.record(decision, layer_name)
