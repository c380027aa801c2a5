"""The ``torch.ops.fusion_pass`` op library.

Schemas mirror vLLM's so that compiled graphs of our models look like vLLM's:

* ``scaled_fp4_quant.out`` <-> ``_C::scaled_fp4_quant.out``
* ``nvfp4_gemm`` <-> ``_C::cutlass_scaled_fp4_mm`` (functional form)
* ``attention_with_output`` <-> ``vllm::unified_attention_with_output``
* ``mla_attention_with_output`` <-> ``vllm::unified_mla_attention_with_output``

Every op has a fake (meta) implementation, so torch.compile traces them with a
symbolic token count. The real implementations run the PyTorch reference on
any device; the attention ops read their layer and the batch metadata from
:mod:`fusion_pass.runtime`, as vLLM's read the forward context.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from fusion_pass import backends, guard, nvfp4, runtime

NAMESPACE = "fusion_pass"

SCHEMAS = {
    "scaled_fp4_quant.out": (
        "scaled_fp4_quant.out(Tensor input, Tensor input_scale, bool is_sf_swizzled_layout, *, "
        "Tensor(a!) output, Tensor(b!) output_scale) -> ()"
    ),
    "nvfp4_gemm": (
        "nvfp4_gemm(Tensor a, Tensor b, Tensor block_scale_a, Tensor block_scale_b, Tensor alpha, "
        "ScalarType out_dtype) -> Tensor"
    ),
    "static_scaled_fp8_quant": (
        "static_scaled_fp8_quant(Tensor(a!) result, Tensor input, Tensor scale) -> ()"
    ),
    "attention_with_output": (
        "attention_with_output(Tensor q, Tensor k, Tensor v, Tensor(a!) output, str layer_name, "
        "Tensor? output_scale=None, Tensor(b!)? output_block_scale=None) -> ()"
    ),
    "mla_attention_with_output": (
        "mla_attention_with_output(Tensor q, Tensor kv_c_normed, Tensor k_pe, Tensor(a!) output, "
        "str layer_name, Tensor? output_scale=None, Tensor(b!)? output_block_scale=None) -> ()"
    ),
}

_lib = torch.library.Library(NAMESPACE, "DEF")
for _schema in SCHEMAS.values():
    _lib.define(_schema)


def _qualname(name: str) -> str:
    return f"{NAMESPACE}::{name}"


def _impl(name: str):
    """Register the eager implementation of ``name`` for every backend."""

    def register(fn):
        _lib.impl(name, fn, "CompositeExplicitAutograd")
        return fn

    return register


def _fake(name: str):
    def register(fn):
        torch.library.register_fake(_qualname(name), fn, lib=_lib)
        return fn

    return register


# ---------------------------------------------------------------------------
# scaled_fp4_quant
# ---------------------------------------------------------------------------


def _check_quant_buffers(input: Tensor, swizzled: bool, output: Tensor, output_scale: Tensor) -> None:
    """Shape/dtype contract of ``scaled_fp4_quant.out``'s buffers (see NVFP4.md)."""
    if input.dim() < 1 or input.shape[-1] % nvfp4.BLOCK_SIZE != 0:
        raise ValueError(
            f"scaled_fp4_quant: input must be [..., K] with K divisible by 16, got shape {list(input.shape)}"
        )
    k = input.shape[-1]
    m = input.numel() // k if k else 0
    if output.dtype != torch.uint8 or output.numel() != m * (k // 2):
        raise ValueError(
            f"scaled_fp4_quant: output must be uint8 with {m}x{k // 2} elements ([M, K/2] for input "
            f"{list(input.shape)}), got {output.dtype} {list(output.shape)}"
        )
    rows, cols = nvfp4.scale_shape(m, k, swizzled=swizzled)
    if output_scale.element_size() * output_scale.numel() != rows * cols:
        layout = "swizzled" if swizzled else "linear"
        raise ValueError(
            f"scaled_fp4_quant: output_scale must hold {rows}x{cols} one-byte scales ({layout} layout "
            f"for M={m}, K={k}; vLLM allocates int32 [{rows}, {cols // 4}] when swizzled), got "
            f"{output_scale.dtype} {list(output_scale.shape)}"
        )


@_impl("scaled_fp4_quant.out")
def _scaled_fp4_quant_out(
    input: Tensor, input_scale: Tensor, is_sf_swizzled_layout: bool, *, output: Tensor, output_scale: Tensor
) -> None:
    _check_quant_buffers(input, is_sf_swizzled_layout, output, output_scale)
    if input.is_cuda and nvfp4._triton_importable() and output.is_contiguous() and output_scale.is_contiguous():
        from fusion_pass.kernels.nvfp4_quant import quantize as triton_quantize

        nvfp4._check_x("scaled_fp4_quant", input, input_scale, check_value=False)
        triton_quantize(input.reshape(-1, input.shape[-1]), input_scale,
                        swizzled=is_sf_swizzled_layout, packed=output, scales=output_scale)
        return
    packed, scales = nvfp4.quantize(input, input_scale, swizzled=is_sf_swizzled_layout)
    output.view(packed.shape).copy_(packed)
    output_scale.view(torch.uint8).view(scales.shape).copy_(scales.view(torch.uint8))


@_fake("scaled_fp4_quant.out")
def _scaled_fp4_quant_out_fake(input, input_scale, is_sf_swizzled_layout, *, output, output_scale) -> None:
    return None


def scaled_fp4_quant(input: Tensor, input_global_scale: Tensor, is_sf_swizzled_layout: bool = True):
    """Quantize ``input [..., K]`` to NVFP4 through ``torch.ops.fusion_pass.scaled_fp4_quant.out``.

    Allocates the buffers exactly as vLLM's ``scaled_fp4_quant`` does:
    ``output`` uint8 ``[M, K/2]``; ``output_scale`` int32
    ``[round_up(M, 128), round_up(K/16, 4) / 4]`` when swizzled (uint8 ``[M, K/16]``
    when linear), returned viewed as ``float8_e4m3fn``.
    """
    k = input.shape[-1]
    if k % nvfp4.BLOCK_SIZE != 0:
        raise ValueError(f"scaled_fp4_quant: input must be [..., K] with K divisible by 16, got {list(input.shape)}")
    m = input.numel() // k
    output = torch.empty((m, k // 2), dtype=torch.uint8, device=input.device)
    if is_sf_swizzled_layout:
        rows, cols = nvfp4.scale_shape(m, k, swizzled=True)
        output_scale = torch.empty((rows, cols // 4), dtype=torch.int32, device=input.device)
    else:
        output_scale = torch.empty((m, k // nvfp4.BLOCK_SIZE), dtype=torch.uint8, device=input.device)
    torch.ops.fusion_pass.scaled_fp4_quant.out(
        input, input_global_scale, is_sf_swizzled_layout, output=output, output_scale=output_scale
    )
    return output, output_scale.view(torch.float8_e4m3fn)


@_impl("static_scaled_fp8_quant")
def _static_scaled_fp8_quant(result: Tensor, input: Tensor, scale: Tensor) -> None:
    """Per-tensor FP8 (e4m3) quant, as vLLM's ``_C::static_scaled_fp8_quant``: ``result = fp8(input / scale)``.

    Another output format: the pass refuses attention whose output feeds it.
    """
    if result.dtype != torch.float8_e4m3fn or result.shape != input.shape:
        raise ValueError(
            f"static_scaled_fp8_quant: result must be float8_e4m3fn of the input's shape {list(input.shape)}, "
            f"got {result.dtype} {list(result.shape)}"
        )
    q = (input.float() / scale.float()).clamp(-nvfp4.E4M3_MAX, nvfp4.E4M3_MAX)
    result.copy_(q.to(torch.float8_e4m3fn))


@_fake("static_scaled_fp8_quant")
def _static_scaled_fp8_quant_fake(result, input, scale) -> None:
    return None


# ---------------------------------------------------------------------------
# nvfp4_gemm
# ---------------------------------------------------------------------------


def _check_gemm_args(a, b, block_scale_a, block_scale_b, alpha) -> None:
    for name, t in (("a", a), ("b", b)):
        if t.dtype != torch.uint8 or t.dim() != 2:
            raise ValueError(
                f"nvfp4_gemm: {name} must be packed NVFP4, uint8 [rows, K/2], got {t.dtype} {list(t.shape)}"
            )
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"nvfp4_gemm: a [M, K/2] and b [N, K/2] must share K/2, got {list(a.shape)} and {list(b.shape)}"
        )
    k = a.shape[1] * 2
    for name, rows, scale in (("block_scale_a", a.shape[0], block_scale_a), ("block_scale_b", b.shape[0], block_scale_b)):
        exp_rows, exp_cols = nvfp4.scale_shape(rows, k, swizzled=True)
        if scale.element_size() * scale.numel() != exp_rows * exp_cols:
            raise ValueError(
                f"nvfp4_gemm: {name} must be the swizzled scales of a {rows}x{k} operand, "
                f"float8_e4m3fn [{exp_rows}, {exp_cols}] (or int32 [{exp_rows}, {exp_cols // 4}]), "
                f"got {scale.dtype} {list(scale.shape)}"
            )
    if alpha.dtype != torch.float32 or alpha.numel() != 1:
        raise ValueError(
            f"nvfp4_gemm: alpha must be a one-element float32 tensor (1 / (gs_a * gs_b)), "
            f"got {alpha.dtype} {list(alpha.shape)}"
        )


_gemm_taps: list[list] = []


@contextlib.contextmanager
def tap_gemm_inputs():
    """Record ``(a, block_scale_a)`` of every ``nvfp4_gemm`` call in the block, in call order.

    The NVFP4 activations the o_proj reads, whoever produced them (the quant op
    or a fused attention op): what the demo compares between compiled graphs.
    """
    _gemm_taps.append([])
    try:
        yield _gemm_taps[-1]
    finally:
        _gemm_taps.pop()


@_impl("nvfp4_gemm")
def _nvfp4_gemm(a, b, block_scale_a, block_scale_b, alpha, out_dtype):
    """``out [M, N] = alpha * dequant(a) @ dequant(b).T``, as ``cutlass_scaled_fp4_mm``.

    No FP4 tensor cores are assumed: both operands are dequantized (exactly, since
    code * scale fits in bf16) and multiplied in bf16 on CUDA, float32 elsewhere.
    """
    _check_gemm_args(a, b, block_scale_a, block_scale_b, alpha)
    if _gemm_taps:
        _gemm_taps[-1].append((a.clone(), block_scale_a.clone()))
    compute = torch.bfloat16 if a.is_cuda else torch.float32
    one = torch.ones(1, dtype=torch.float32, device=a.device)
    a_hat = nvfp4.dequantize(a, block_scale_a, one, dtype=compute)
    b_hat = nvfp4.dequantize(b, block_scale_b, one, dtype=compute)
    out = torch.matmul(a_hat, b_hat.t()).float() * alpha
    return out.to(out_dtype)


@_fake("nvfp4_gemm")
def _nvfp4_gemm_fake(a, b, block_scale_a, block_scale_b, alpha, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


# ---------------------------------------------------------------------------
# attention ops
# ---------------------------------------------------------------------------


def _write_attention_output(
    op: str, out: Tensor, dtype: torch.dtype, output: Tensor, output_scale, output_block_scale
) -> None:
    """Write float32 attention ``out [T, H, Dv]`` into the op's output buffer(s).

    Without ``output_scale``: ``output`` holds ``T * H * Dv`` elements of the
    query dtype. With it (the guard's fallback path): NVFP4, ``output`` uint8
    ``[T, H*Dv/2]`` and ``output_block_scale`` the swizzled scales, produced
    exactly as the unfused graph would: attention rounded to the query dtype,
    then ``scaled_fp4_quant``.
    """
    t = out.shape[0]
    if output_scale is None:
        if output_block_scale is not None:
            raise ValueError(f"{op}: output_block_scale was given without output_scale (the global scale)")
        if output.dtype != dtype or output.numel() != out.numel():
            raise ValueError(
                f"{op}: output must be {dtype} with {out.numel()} elements ([T, H*Dv] = "
                f"[{t}, {out[0].numel()}]), got {output.dtype} {list(output.shape)}"
            )
        output.view(out.shape).copy_(out)
        return
    if output_block_scale is None:
        raise ValueError(f"{op}: NVFP4 output needs output_block_scale (the swizzled scale buffer)")
    flat = out.to(dtype).reshape(t, -1)
    torch.ops.fusion_pass.scaled_fp4_quant.out(
        flat, output_scale, True, output=output, output_scale=output_block_scale
    )


_SCALE_BUFFER_DTYPES = (torch.int32, torch.float8_e4m3fn, torch.uint8)


def _check_nvfp4_buffers(
    op: str, t: int, num_heads: int, v_head_dim: int, device: torch.device, output, output_scale, output_block_scale
) -> None:
    """The NVFP4 output contract of the attention ops, checked before any attention is computed."""
    if output_block_scale is None:
        raise ValueError(f"{op}: NVFP4 output needs output_block_scale (the swizzled scale buffer)")
    width = num_heads * v_head_dim
    if width % nvfp4.BLOCK_SIZE != 0:
        raise ValueError(
            f"{op}: NVFP4 output needs num_heads * v_head_dim divisible by 16, got "
            f"{num_heads} * {v_head_dim} = {width}"
        )
    if not isinstance(output_scale, Tensor) or output_scale.dtype != torch.float32 or output_scale.numel() != 1:
        got = f"{output_scale.dtype} {list(output_scale.shape)}" if isinstance(output_scale, Tensor) else output_scale
        raise ValueError(f"{op}: output_scale (the global scale) must be a one-element float32 tensor, got {got}")
    if output.dtype != torch.uint8 or output.numel() != t * width // 2 or not output.is_contiguous():
        raise ValueError(
            f"{op}: NVFP4 output must be a contiguous uint8 tensor of {t * width // 2} elements "
            f"([T, H*Dv/2] = [{t}, {width // 2}]), got {output.dtype} {list(output.shape)}"
            + ("" if output.is_contiguous() else " (not contiguous)")
        )
    rows, cols = nvfp4.scale_shape(t, width, swizzled=True)
    nbytes = output_block_scale.element_size() * output_block_scale.numel()
    if (
        output_block_scale.dtype not in _SCALE_BUFFER_DTYPES
        or nbytes != rows * cols
        or not output_block_scale.is_contiguous()
    ):
        raise ValueError(
            f"{op}: output_block_scale must be a contiguous buffer of {rows}x{cols} one-byte scales "
            f"(float8_e4m3fn [{rows}, {cols}], or int32 [{rows}, {cols // 4}] as vLLM allocates it; "
            f"round_up(T, 128) x round_up(H*Dv/16, 4) for T={t}), got {output_block_scale.dtype} "
            f"{list(output_block_scale.shape)}"
            + ("" if output_block_scale.is_contiguous() else " (not contiguous)")
        )
    for name, tensor in (("output", output), ("output_scale", output_scale), ("output_block_scale", output_block_scale)):
        if tensor.device != device:
            raise ValueError(f"{op}: {name} must be on the query's device {device}, got {tensor.device}")


def _qk_head_dim(impl) -> int:
    if hasattr(impl, "qk_nope_head_dim"):  # MLA
        return impl.qk_nope_head_dim + impl.qk_rope_head_dim
    return impl.head_dim


def _half_prefill_available(q: Tensor, spec) -> bool:
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and spec.num_decode_tokens == 0
        and not spec.has_chunked_prefill
        and backends.get_backend("triton").available()[0]
    )


def _attention(impl, inputs: tuple, spec, q: Tensor) -> Tensor:
    """The batch's attention ``[T, H, Dv]``, appending the new tokens to the layer's cache.

    Pure-prefill batches on CUDA run the Triton flash-attention kernel (output in
    the query dtype, as a serving attention backend returns it); everything else
    runs the layer's PyTorch runtime (float32).
    """
    if _half_prefill_available(q, spec):
        from fusion_pass.kernels.flash_attention import flash_attention

        q, k, v = backends.prefill_qkv(impl, inputs, spec)
        cu_seqlens, max_seqlen = backends.varlen_meta(spec, q.device)
        return flash_attention(q, k, v, cu_seqlens, max_seqlen, causal=True, softmax_scale=impl.softmax_scale)
    return impl.forward(*inputs, spec)


def _run_attention(op: str, q: Tensor, inputs: tuple, output, layer_name, output_scale, output_block_scale) -> None:
    """Shared body of the attention ops: one attention computation per call.

    Without ``output_scale``: attention in the query dtype, not guarded
    (:func:`_attention`: the Triton kernel on CUDA prefill batches). With
    it: the NVFP4 buffers are validated, :func:`fusion_pass.guard.decide`
    picks the path and :func:`fusion_pass.guard.record` counts it; ``fused``
    runs the selected backend (attention quantized from float32), ``fallback``
    runs exactly the unfused computation (attention rounded to the query
    dtype, then ``scaled_fp4_quant.out``).
    """
    impl = runtime.get_layer(layer_name)
    spec = runtime.current_batch()
    if output_scale is None:
        out = _attention(impl, inputs, spec, q)
        _write_attention_output(op, out, q.dtype, output, output_scale, output_block_scale)
        return
    _check_nvfp4_buffers(
        op, q.shape[0], impl.num_heads, impl.v_head_dim, q.device, output, output_scale, output_block_scale
    )
    decision = guard.decide(
        spec,
        device=q.device,
        dtype=q.dtype,
        num_heads=impl.num_heads,
        qk_head_dim=_qk_head_dim(impl),
        v_head_dim=impl.v_head_dim,
    )
    guard.record(decision)
    if decision.path == "fused":
        backends.get_backend(decision.backend).run(impl, inputs, spec, output, output_scale, output_block_scale)
        return
    out = _attention(impl, inputs, spec, q)
    _write_attention_output(op, out, q.dtype, output, output_scale, output_block_scale)


@_impl("attention_with_output")
def _attention_with_output(q, k, v, output, layer_name, output_scale=None, output_block_scale=None):
    _run_attention("attention_with_output", q, (q, k, v), output, layer_name, output_scale, output_block_scale)


@_impl("mla_attention_with_output")
def _mla_attention_with_output(q, kv_c_normed, k_pe, output, layer_name, output_scale=None, output_block_scale=None):
    _run_attention(
        "mla_attention_with_output", q, (q, kv_c_normed, k_pe), output, layer_name, output_scale, output_block_scale
    )


@_fake("attention_with_output")
def _attention_with_output_fake(q, k, v, output, layer_name, output_scale=None, output_block_scale=None) -> None:
    return None


@_fake("mla_attention_with_output")
def _mla_attention_with_output_fake(
    q, kv_c_normed, k_pe, output, layer_name, output_scale=None, output_block_scale=None
) -> None:
    return None
