"""The attention ops ``attention_with_output`` and ``mla_attention_with_output``: their argument contracts and
their registration. A call is checked here (every argument, before anything runs), then handed down to the run
time (:func:`fusion_pass.runtime.engine.attention_call.run`: guard decision, row plan, backend, kernel).

Without ``output_scale`` the op writes attention in the query dtype; with it, a quantized format, read from the
buffers (:func:`fusion_pass.formats.call_format`):

* NVFP4: ``output`` uint8 ``[T, H*Dv/2]``, ``output_scale`` the global scale (float32, one element) and
  ``output_block_scale`` the swizzled block-scale buffer (what ``scaled_fp4_quant.out`` calls ``output`` and
  ``output_scale``);
* static per-tensor FP8 (vLLM's convention for a static-FP8 fused attention call): ``output`` float8_e4m3fn
  ``[T, H*Dv]`` (or ``[T, H, Dv]``) contiguous, ``output_scale`` the checkpoint's scale (float32, one element; not
  its inverse), no ``output_block_scale``;
* static per-tensor FP8 in the native form (what vLLM's ``QuantFP8`` compiles to without its custom op: ``x *
  reciprocal(scale)``, clamped to ±448, a NaN kept as NaN): ``output`` as above, ``output_inv_scale`` the graph's own
  reciprocal of the scale (float32, one element; multiplied as it is), no ``output_scale`` or ``output_block_scale``;
* FP8 with one dynamic scale per row and 128 columns (vLLM's MLA op's convention, ``quant_group_size=128``):
  ``output`` float8_e4m3fn as above, ``output_block_scale`` float32 ``[T, H*Dv/128]``, as vLLM allocates it in one of
  the three group-scale layouts (:class:`fusion_pass.fp8.ScaleLayout`; its strides say which, ``quant_col_major`` /
  ``quant_tma_aligned`` are not read, as vLLM's quant kernel does not read them; other non-overlapping strides are
  written through a row-major temporary), ``quant_scale_ue8m0`` for power-of-two scales, no
  ``output_scale``; the bytes of vLLM 0.33/0.34's ``per_token_group_fp8_quant`` (``x * (1 / s)``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusion_pass import formats, fp8, nvfp4, runtime
from fusion_pass.fp8.checks import check_scale
from fusion_pass.nvfp4 import ArgumentError
from fusion_pass.nvfp4.checks import check_global_scale
from fusion_pass.ops.library import dense, fake, impl
from fusion_pass.ops.quant import QUANT_INPUT_DTYPES
from fusion_pass.runtime import counters, fp8_group_rows, fp8_rows
from fusion_pass.runtime.engine import attention_call
from fusion_pass.runtime.engine.registry import UnknownLayerError

__all__ = ["check_attention_call", "runtime_counters"]


def _check_query_dtype_output(op: str, t: int, num_heads: int, v_head_dim: int, q: Tensor, output) -> None:
    """The query-dtype output contract of the attention ops (no ``output_scale``)."""
    numel = t * num_heads * v_head_dim
    viewable = output.dtype == q.dtype and output.numel() == numel
    if viewable:
        try:
            output.view(t, num_heads, v_head_dim)
        except RuntimeError:
            viewable = False
    if not viewable:
        raise ArgumentError(
            f"{op}: output must be {q.dtype} with {numel} elements ([T, H*Dv] = "
            f"[{t}, {num_heads * v_head_dim}]) viewable as [T, H, Dv], got {output.dtype} {list(output.shape)}"
            + ("" if output.is_contiguous() else " (not contiguous)")
        )
    if output.device != q.device:
        raise ArgumentError(f"{op}: output must be on the query's device {q.device}, got {output.device}")


SCALE_BUFFER_DTYPES = (torch.int32, torch.float8_e4m3fn, torch.uint8)


def _check_nvfp4_buffers(
    op: str, t: int, num_heads: int, v_head_dim: int, device: torch.device, output, output_scale, output_block_scale
) -> None:
    """The NVFP4 output contract of the attention ops, checked before any attention is computed."""
    if output_block_scale is None:
        got = getattr(output, "dtype", type(output).__name__)
        raise ArgumentError(f"{op}: NVFP4 output needs output_block_scale (the swizzled scale buffer); with "
                            f"output_scale alone, output must be float8_e4m3fn (static FP8), got {got}")
    width = num_heads * v_head_dim
    if width % nvfp4.BLOCK_SIZE != 0:
        raise ArgumentError(
            f"{op}: NVFP4 output needs num_heads * v_head_dim divisible by 16, got "
            f"{num_heads} * {v_head_dim} = {width}"
        )
    check_global_scale(op, output_scale, device, name="output_scale", check_value=device.type == "cpu")
    if output.dtype != torch.uint8 or output.numel() != t * width // 2 or not output.is_contiguous():
        raise ArgumentError(
            f"{op}: NVFP4 output must be a contiguous uint8 tensor of {t * width // 2} elements "
            f"([T, H*Dv/2] = [{t}, {width // 2}]), got {output.dtype} {list(output.shape)}"
            + ("" if output.is_contiguous() else " (not contiguous)")
        )
    rows, cols = nvfp4.scale_shape(t, width, swizzled=True)
    nbytes = output_block_scale.element_size() * output_block_scale.numel()
    if (
        output_block_scale.dtype not in SCALE_BUFFER_DTYPES
        or nbytes != rows * cols
        or not dense(output_block_scale)
    ):
        raise ArgumentError(
            f"{op}: output_block_scale must be a contiguous buffer of {rows}x{cols} one-byte scales "
            f"(float8_e4m3fn [{rows}, {cols}], or int32 [{rows}, {cols // 4}] as vLLM allocates it; "
            f"round_up(T, 128) x round_up(H*Dv/16, 4) for T={t}), got {output_block_scale.dtype} "
            f"{list(output_block_scale.shape)}"
            + ("" if dense(output_block_scale) else f" (not contiguous: strides {list(output_block_scale.stride())})")
        )
    for name, tensor in (("output", output), ("output_block_scale", output_block_scale)):
        if tensor.device != device:
            raise ArgumentError(f"{op}: {name} must be on the query's device {device}, got {tensor.device}")


def _check_fp8_static_buffers(op: str, t: int, num_heads: int, v_head_dim: int, device: torch.device, output,
                              output_scale, output_block_scale, *,
                              scale_name: str = "output_scale (the static FP8 scale, not its inverse)") -> None:
    """The static FP8 output contract of the attention ops (:data:`fusion_pass.formats.FP8_STATIC`), checked before
    any attention is computed. The scale's value is not read (a scale of 0 has the format's meaning)."""
    if output_block_scale is not None:
        got = (f"{output_block_scale.dtype} {list(output_block_scale.shape)}" if isinstance(output_block_scale, Tensor)
               else type(output_block_scale).__name__)
        raise ArgumentError(
            f"{op}: output_block_scale must be None with a float8_e4m3fn output (static per-tensor FP8: one scale, "
            f"output_scale); FP8 with group scales takes quant_group_size and no output_scale, got {got}")
    _check_fp8_output(op, t, num_heads, v_head_dim, device, output)
    check_scale(op, output_scale, device, name=scale_name)


def _check_fp8_output(op: str, t: int, num_heads: int, v_head_dim: int, device: torch.device, output) -> None:
    """An FP8 ``output``: contiguous, ``[T, H*Dv]`` or ``[T, H, Dv]``, on the query's device."""
    width = num_heads * v_head_dim
    shapes = ((t, width), (t, num_heads, v_head_dim))
    if tuple(output.shape) not in shapes or not output.is_contiguous():
        raise ArgumentError(
            f"{op}: FP8 output must be a contiguous float8_e4m3fn tensor of {t * width} elements ([T, H*Dv] = "
            f"[{t}, {width}], or [T, H, Dv]), got {output.dtype} {list(output.shape)}"
            + ("" if output.is_contiguous() else f" (not contiguous: strides {list(output.stride())})"))
    if output.device != device:
        raise ArgumentError(f"{op}: output must be on the query's device {device}, got {output.device}")


def _check_fp8_native_buffers(op: str, t: int, num_heads: int, v_head_dim: int, q: Tensor, output, output_scale,
                              output_block_scale, output_inv_scale) -> None:
    """The native-form static FP8 contract (``output_inv_scale`` given): no ``output_scale`` or
    ``output_block_scale`` beside it, then the static FP8 buffers with the inverse scale in the scale's place."""
    for name, value in (("output_scale", output_scale), ("output_block_scale", output_block_scale)):
        if value is not None:
            raise ArgumentError(f"{op}: {name} must be None with output_inv_scale (static FP8 in the native form: "
                                f"the inverse scale alone), got {type(value).__name__}")
    if not isinstance(output, Tensor) or output.dtype != formats.FP8_STATIC.element:
        got = getattr(output, "dtype", type(output).__name__)
        raise ArgumentError(f"{op}: output must be float8_e4m3fn with output_inv_scale (static FP8 in the native "
                            f"form), got {got}")
    if q.dtype not in QUANT_INPUT_DTYPES:
        raise ArgumentError(f"{op}: FP8_STATIC output needs q of float16, bfloat16 or float32, got {q.dtype}")
    _check_fp8_static_buffers(op, t, num_heads, v_head_dim, q.device, output, output_inv_scale, None,
                              scale_name="output_inv_scale (the graph's reciprocal of the static FP8 scale)")


def _check_fp8_group_buffers(op: str, t: int, num_heads: int, v_head_dim: int, q: Tensor, output, output_scale,
                             output_block_scale, output_inv_scale, group) -> None:
    """The group FP8 contract (``quant_group_size`` given; ``group``: the call's ``(quant_group_size,
    quant_scale_ue8m0)``), checked before any attention is computed."""
    size, ue8m0 = group
    if size != fp8.GROUP_SIZE or isinstance(size, bool):
        raise ArgumentError(f"{op}: quant_group_size must be {fp8.GROUP_SIZE} (the group formats' width), got {size!r}")
    if ue8m0 is not None and not isinstance(ue8m0, bool):
        raise ArgumentError(f"{op}: quant_scale_ue8m0 must be a bool or None, got {type(ue8m0).__name__}")
    for name, value in (("output_scale", output_scale), ("output_inv_scale", output_inv_scale)):
        if value is not None:
            raise ArgumentError(f"{op}: {name} must be None with quant_group_size (FP8 group scales are dynamic: "
                                f"output_block_scale receives them), got {type(value).__name__}")
    if q.dtype not in QUANT_INPUT_DTYPES:
        raise ArgumentError(f"{op}: FP8 group output needs q of float16, bfloat16 or float32, got {q.dtype}")
    width = num_heads * v_head_dim
    if width % fp8.GROUP_SIZE:
        raise ArgumentError(f"{op}: FP8 group output needs num_heads * v_head_dim divisible by {fp8.GROUP_SIZE}, "
                            f"got {num_heads} * {v_head_dim} = {width}")
    if not isinstance(output, Tensor) or output.dtype != fp8.FP8:
        got = getattr(output, "dtype", type(output).__name__)
        raise ArgumentError(f"{op}: output must be float8_e4m3fn with quant_group_size, got {got}")
    _check_fp8_output(op, t, num_heads, v_head_dim, q.device, output)
    want = [t, width // fp8.GROUP_SIZE]
    if not isinstance(output_block_scale, Tensor) or output_block_scale.dtype != torch.float32 or list(
            output_block_scale.shape) != want or torch._debug_has_internal_overlap(output_block_scale) == 1:
        got = (f"{output_block_scale.dtype} {list(output_block_scale.shape)} strides "
               f"{list(output_block_scale.stride())}" if isinstance(output_block_scale, Tensor)
               else type(output_block_scale).__name__)
        raise ArgumentError(
            f"{op}: output_block_scale must be the float32 group scales {want} ([T, H*Dv/128]) with no two "
            f"elements at one address (row-major, column-major or TMA-aligned column-major as vLLM allocates them; "
            f"other strides are written through a temporary), got {got}")
    if output_block_scale.device != q.device:
        raise ArgumentError(f"{op}: output_block_scale must be on the query's device {q.device}, got "
                            f"{output_block_scale.device}")


def check_attention_call(op: str, impl, spec, q: Tensor, inputs: tuple, output, output_scale, output_block_scale,
                         output_format: formats.OutputFormat | None = None, output_inv_scale=None, group=None):
    """Every argument of an attention op call, before attention runs or any cache is touched.

    The inputs against the layer and the batch (shapes, dtypes, devices, each
    request's cached length: ``impl.check_inputs``, side-effect free), then the
    output buffer(s) of the call's format (``output_format``, read from the buffers when not given:
    :func:`fusion_pass.formats.call_format`) and its scale (NVFP4's global scale: its value on CPU); ``group``:
    the call's ``(quant_group_size, quant_scale_ue8m0)`` when it gives a group size. Errors are
    ValueErrors starting with the op's name and naming the op's argument.
    """
    try:
        impl.check_inputs(*inputs, spec)
    except ValueError as exc:
        raise ArgumentError(f"{op}: {exc}") from None
    t = spec.num_tokens
    if group is not None:
        _check_fp8_group_buffers(op, t, impl.num_heads, impl.v_head_dim, q, output, output_scale, output_block_scale,
                                 output_inv_scale, group)
        return
    if output_inv_scale is not None:
        _check_fp8_native_buffers(op, t, impl.num_heads, impl.v_head_dim, q, output, output_scale,
                                  output_block_scale, output_inv_scale)
        return
    if output_scale is None:
        if output_block_scale is not None:
            raise ArgumentError(f"{op}: output_block_scale was given without output_scale (the global scale)")
        _check_query_dtype_output(op, t, impl.num_heads, impl.v_head_dim, q, output)
        return
    if not isinstance(output, Tensor):
        raise ArgumentError(f"{op}: output must be a tensor, got {type(output).__name__}")
    if output_format is None:
        output_format = formats.call_format(output, output_scale, output_block_scale)
    if q.dtype not in QUANT_INPUT_DTYPES:
        raise ArgumentError(
            f"{op}: {output_format.name.upper()} output needs q of float16, bfloat16 or float32 (the unfused path "
            f"quantizes attention in the query dtype), got {q.dtype}"
        )
    if output_format is formats.FP8_STATIC:
        _check_fp8_static_buffers(op, t, impl.num_heads, impl.v_head_dim, q.device, output, output_scale,
                                  output_block_scale)
        return
    _check_nvfp4_buffers(op, t, impl.num_heads, impl.v_head_dim, q.device, output, output_scale, output_block_scale)


def runtime_counters(layers=None) -> dict:
    """What the attention ops' run-time guard decided so far (:func:`fusion_pass.runtime.counters.counters`):
    the report API of compile time and integrations. ``layers=None``: the whole process; else layer names
    (one, or an iterable): the calls of those layers only (what :meth:`fusion_pass.FusionPass.report` reads
    for the layers its pass rewrote)."""
    return counters.counters(layers)


def _layer(op: str, layer_name):
    """The layer's runtime; an unknown name is an :class:`~fusion_pass.runtime.UnknownLayerError`
    (a KeyError and an ArgumentError) starting with the op's name."""
    if not isinstance(layer_name, str):
        raise ArgumentError(f"{op}: layer_name must be a str, got {type(layer_name).__name__} {layer_name!r}")
    try:
        return runtime.get_layer(layer_name)
    except UnknownLayerError as exc:
        raise UnknownLayerError(f"{op}: layer_name: {exc}") from None


def _run(op: str, q: Tensor, inputs: tuple, output, layer_name, output_scale, output_block_scale,
         output_inv_scale, quant_group_size=None, quant_scale_ue8m0=None) -> None:
    """One attention op call: the layer and the batch from the run time, every argument checked
    (:func:`check_attention_call`) before anything runs or any cache is touched, then the run time's call,
    whose guard decision is counted under ``layer_name``. A native-form static FP8 call runs as a static FP8 call
    whose scale is the given inverse, quantized by the native form's rule (:data:`fusion_pass.runtime.fp8_rows.NATIVE_FORM`);
    a group FP8 call writes ``output_block_scale`` as its scales (:class:`fusion_pass.runtime.fp8_group_rows.GroupQuant`)."""
    impl_ = _layer(op, layer_name)
    spec = runtime.current_batch()
    group = None if quant_group_size is None else (quant_group_size, quant_scale_ue8m0)
    output_format = formats.call_format(output, output_scale, output_block_scale, output_inv_scale, quant_group_size,
                                        quant_scale_ue8m0)
    check_attention_call(op, impl_, spec, q, inputs, output, output_scale, output_block_scale, output_format,
                         output_inv_scale, group)
    if group is not None:  # scales in strides no writer takes: written row-major, then copied into them
        scales = (output_block_scale if fp8.writable_scales(output_block_scale)
                  else torch.empty(output_block_scale.shape, dtype=torch.float32, device=q.device))
        attention_call.run(impl_, inputs, spec, output, None, scales, layer_name=layer_name,
                           output_format=output_format,
                           fp8_quant=fp8_group_rows.GroupQuant(ue8m0=bool(quant_scale_ue8m0), divide=False))
        if scales is not output_block_scale:
            output_block_scale.copy_(scales)
        return
    if output_inv_scale is not None:
        attention_call.run(impl_, inputs, spec, output, output_inv_scale, None, layer_name=layer_name,
                           output_format=output_format, fp8_quant=fp8_rows.NATIVE_FORM)
        return
    attention_call.run(impl_, inputs, spec, output, output_scale, output_block_scale, layer_name=layer_name,
                       output_format=output_format)


@impl("attention_with_output")
def _attention_with_output(q, k, v, output, layer_name, output_scale=None, output_block_scale=None,
                           output_inv_scale=None, quant_group_size=None, quant_scale_ue8m0=None, quant_col_major=None,
                           quant_tma_aligned=None):
    _run("attention_with_output", q, (q, k, v), output, layer_name, output_scale, output_block_scale,
         output_inv_scale, quant_group_size, quant_scale_ue8m0)


@impl("mla_attention_with_output")
def _mla_attention_with_output(q, kv_c_normed, k_pe, output, layer_name, output_scale=None, output_block_scale=None,
                               output_inv_scale=None, quant_group_size=None, quant_scale_ue8m0=None,
                               quant_col_major=None, quant_tma_aligned=None):
    _run("mla_attention_with_output", q, (q, kv_c_normed, k_pe), output, layer_name, output_scale,
         output_block_scale, output_inv_scale, quant_group_size, quant_scale_ue8m0)


@fake("attention_with_output")
def _attention_with_output_fake(q, k, v, output, layer_name, output_scale=None, output_block_scale=None,
                                output_inv_scale=None, quant_group_size=None, quant_scale_ue8m0=None,
                                quant_col_major=None, quant_tma_aligned=None) -> None:
    return None


@fake("mla_attention_with_output")
def _mla_attention_with_output_fake(
    q, kv_c_normed, k_pe, output, layer_name, output_scale=None, output_block_scale=None, output_inv_scale=None,
    quant_group_size=None, quant_scale_ue8m0=None, quant_col_major=None, quant_tma_aligned=None
) -> None:
    return None
