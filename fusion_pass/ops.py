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
import contextvars
import math

import torch
from torch import Tensor

from fusion_pass import backends, guard, nvfp4, prefill, runtime

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


_QUANT_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _dense(t: Tensor) -> bool:
    """Contiguous, and viewable as another element size: ``is_contiguous()`` ignores the
    strides of size-1 dims, torch's dtype-changing ``view`` needs ``stride(-1) == 1``."""
    return t.is_contiguous() and (t.dim() == 0 or t.stride(-1) == 1)

_ONE_BYTE_SCALE_DTYPES = (torch.uint8, torch.float8_e4m3fn)


def _check_scale_value(op: str, arg: str, scale: Tensor) -> None:
    """``scale`` (a one-element float32 global scale) must be positive and finite.

    Read back only for concrete CPU tensors, where it is free. On CUDA it would
    cost a device synchronization per call, so the value is not read there
    (``docs/usage.md``, "Argument checks").
    """
    if scale.device.type != "cpu" or not nvfp4._is_concrete(scale):
        return
    value = scale.item()
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{op}: {arg} (the global scale) must be positive and finite, got {value}")


def _check_quant_buffers(
    input: Tensor, input_scale: Tensor, swizzled: bool, output: Tensor, output_scale: Tensor
) -> None:
    """Every argument of ``scaled_fp4_quant.out`` (see NVFP4.md), checked before anything is written.

    ``input`` float16/bfloat16/float32 ``[..., K]`` (``K % 16 == 0``, ``M`` the
    product of the leading dims); ``input_scale`` float32, one element, on
    ``input``'s device; ``output`` contiguous uint8 exactly ``[M, K/2]``;
    ``output_scale`` contiguous, swizzled: int32 ``[round_up(M,128),
    round_up(K/16,4)/4]`` (vLLM's allocation) or uint8/float8_e4m3fn
    ``[round_up(M,128), round_up(K/16,4)]``; linear: uint8/float8_e4m3fn ``[M, K/16]``.
    """
    op = "scaled_fp4_quant"
    if input.dtype not in _QUANT_INPUT_DTYPES:
        raise ValueError(f"{op}: input must be float16, bfloat16 or float32, got {input.dtype}")
    if input.dim() < 1 or input.shape[-1] % nvfp4.BLOCK_SIZE != 0:
        raise ValueError(
            f"{op}: input must be [..., K] with K divisible by 16, got shape {list(input.shape)}"
        )
    device = input.device
    if (
        not isinstance(input_scale, Tensor)
        or input_scale.dtype != torch.float32
        or input_scale.numel() != 1
        or input_scale.device != device
    ):
        got = (
            f"{input_scale.dtype} {list(input_scale.shape)} on {input_scale.device}"
            if isinstance(input_scale, Tensor) else repr(input_scale)
        )
        raise ValueError(
            f"{op}: input_scale (the global scale; input_global_scale of the scaled_fp4_quant wrapper) must be "
            f"a float32 tensor with one element on the input's device {device}, got {got}"
        )
    k = input.shape[-1]
    m = math.prod(input.shape[:-1])
    want = (m, k // 2)
    if (
        output.dtype != torch.uint8
        or tuple(output.shape) != want
        or not output.is_contiguous()
        or output.device != device
    ):
        raise ValueError(
            f"{op}: output must be uint8 [M, K/2] = {list(want)} for input {list(input.shape)}, contiguous, "
            f"on {device}; got {output.dtype} {list(output.shape)}"
            + ("" if output.is_contiguous() else " (not contiguous)")
            + ("" if output.device == device else f" on {output.device}")
        )
    rows, cols = nvfp4.scale_shape(m, k, swizzled=swizzled)
    if swizzled:
        allowed = {torch.int32: (rows, cols // 4), **{d: (rows, cols) for d in _ONE_BYTE_SCALE_DTYPES}}
        expected = (
            f"int32 [{rows}, {cols // 4}] (as vLLM allocates it) or uint8 / float8_e4m3fn [{rows}, {cols}] "
            f"(swizzled layout, round_up(M, 128) x round_up(K/16, 4) for M={m}, K={k})"
        )
    else:
        allowed = {d: (rows, cols) for d in _ONE_BYTE_SCALE_DTYPES}
        expected = f"uint8 / float8_e4m3fn [{rows}, {cols}] (linear layout, [M, K/16] for M={m}, K={k})"
    if (
        allowed.get(output_scale.dtype) != tuple(output_scale.shape)
        or not _dense(output_scale)
        or output_scale.device != device
    ):
        raise ValueError(
            f"{op}: output_scale must hold {rows}x{cols} one-byte scales: {expected}, contiguous, on {device}; "
            f"got {output_scale.dtype} {list(output_scale.shape)}"
            + ("" if _dense(output_scale) else f" (not contiguous: strides {list(output_scale.stride())})")
            + ("" if output_scale.device == device else f" on {output_scale.device}")
        )
    _check_scale_value(op, "input_scale", input_scale)


@_impl("scaled_fp4_quant.out")
def _scaled_fp4_quant_out(
    input: Tensor, input_scale: Tensor, is_sf_swizzled_layout: bool, *, output: Tensor, output_scale: Tensor
) -> None:
    _check_quant_buffers(input, input_scale, is_sf_swizzled_layout, output, output_scale)
    if input.is_cuda and nvfp4._triton_importable():
        from fusion_pass.kernels.nvfp4_quant import quantize as triton_quantize

        triton_quantize(input.reshape(-1, input.shape[-1]), input_scale,
                        swizzled=is_sf_swizzled_layout, packed=output, scales=output_scale)
        return
    packed, scales = nvfp4.quantize(input, input_scale, swizzled=is_sf_swizzled_layout)
    output.copy_(packed)
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


_gemm_taps: contextvars.ContextVar[tuple[list, ...]] = contextvars.ContextVar("fusion_pass_gemm_taps", default=())
"""The open taps of this thread / task, innermost last."""


@contextlib.contextmanager
def tap_gemm_inputs():
    """Record ``(a, block_scale_a)`` of every ``nvfp4_gemm`` call in the block, in call order.

    The NVFP4 activations the o_proj reads, whoever produced them (the quant op
    or a fused attention op): what the demo compares between compiled graphs.
    Only calls made by the thread / asyncio task that opened the tap are
    recorded (a :class:`contextvars.ContextVar`; compiled graphs run their ops
    on the calling thread); when taps are nested, the innermost one records.
    """
    tap: list = []
    token = _gemm_taps.set(_gemm_taps.get() + (tap,))
    try:
        yield tap
    finally:
        _gemm_taps.reset(token)


@_impl("nvfp4_gemm")
def _nvfp4_gemm(a, b, block_scale_a, block_scale_b, alpha, out_dtype):
    """``out [M, N] = alpha * dequant(a) @ dequant(b).T``, as ``cutlass_scaled_fp4_mm``.

    No FP4 tensor cores are assumed: both operands are dequantized (exactly, since
    code * scale fits in bf16) and multiplied in bf16 on CUDA, float32 elsewhere.
    """
    _check_gemm_args(a, b, block_scale_a, block_scale_b, alpha)
    taps = _gemm_taps.get()
    if taps:
        taps[-1].append((a.clone(), block_scale_a.clone()))
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


def _write_attention_output(out: Tensor, dtype: torch.dtype, output: Tensor, output_scale, output_block_scale) -> None:
    """Write float32 attention ``out [T, H, Dv]`` into the op's output buffer(s).

    The buffers were checked by :func:`_check_attention_call`. Without
    ``output_scale``: ``output`` holds ``T * H * Dv`` elements of the query
    dtype. With it (the guard's fallback path): NVFP4, ``output`` uint8
    ``[T, H*Dv/2]`` and ``output_block_scale`` the swizzled scales, produced
    exactly as the unfused graph would: attention rounded to the query dtype,
    then ``scaled_fp4_quant``.
    """
    t = out.shape[0]
    if output_scale is None:
        output.view(out.shape).copy_(out)
        return
    flat = out.to(dtype).reshape(t, -1)
    rows, cols = nvfp4.scale_shape(t, flat.shape[1], swizzled=True)
    torch.ops.fusion_pass.scaled_fp4_quant.out(
        flat,
        output_scale,
        True,
        output=output.view(t, flat.shape[1] // 2),
        output_scale=output_block_scale.view(torch.uint8).view(rows, cols),
    )


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
        raise ValueError(
            f"{op}: output must be {q.dtype} with {numel} elements ([T, H*Dv] = "
            f"[{t}, {num_heads * v_head_dim}]) viewable as [T, H, Dv], got {output.dtype} {list(output.shape)}"
            + ("" if output.is_contiguous() else " (not contiguous)")
        )
    if output.device != q.device:
        raise ValueError(f"{op}: output must be on the query's device {q.device}, got {output.device}")


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
        or not _dense(output_block_scale)
    ):
        raise ValueError(
            f"{op}: output_block_scale must be a contiguous buffer of {rows}x{cols} one-byte scales "
            f"(float8_e4m3fn [{rows}, {cols}], or int32 [{rows}, {cols // 4}] as vLLM allocates it; "
            f"round_up(T, 128) x round_up(H*Dv/16, 4) for T={t}), got {output_block_scale.dtype} "
            f"{list(output_block_scale.shape)}"
            + ("" if _dense(output_block_scale) else f" (not contiguous: strides {list(output_block_scale.stride())})")
        )
    for name, tensor in (("output", output), ("output_scale", output_scale), ("output_block_scale", output_block_scale)):
        if tensor.device != device:
            raise ValueError(f"{op}: {name} must be on the query's device {device}, got {tensor.device}")
    _check_scale_value(op, "output_scale", output_scale)


def _check_attention_call(op: str, impl, spec, q: Tensor, inputs: tuple, output, output_scale, output_block_scale):
    """Every argument of an attention op call, before attention runs or any cache is touched.

    The inputs against the layer and the batch (shapes, dtypes, devices, each
    request's cached length: ``impl.check_inputs``, side-effect free), then the
    output buffer(s) and, in the NVFP4 form, the global scale (its value on
    CPU). Errors are ValueErrors starting with the op's name and naming the
    op's argument.
    """
    try:
        impl.check_inputs(*inputs, spec)
    except ValueError as exc:
        raise ValueError(f"{op}: {exc}") from None
    t = spec.num_tokens
    if output_scale is None:
        if output_block_scale is not None:
            raise ValueError(f"{op}: output_block_scale was given without output_scale (the global scale)")
        _check_query_dtype_output(op, t, impl.num_heads, impl.v_head_dim, q, output)
        return
    if q.dtype not in _QUANT_INPUT_DTYPES:
        raise ValueError(
            f"{op}: NVFP4 output needs q of float16, bfloat16 or float32 (the unfused path quantizes "
            f"attention in the query dtype), got {q.dtype}"
        )
    _check_nvfp4_buffers(op, t, impl.num_heads, impl.v_head_dim, q.device, output, output_scale, output_block_scale)


def _qk_head_dim(impl) -> int:
    if hasattr(impl, "qk_nope_head_dim"):  # MLA
        return impl.qk_nope_head_dim + impl.qk_rope_head_dim
    return impl.head_dim


def _half_prefill_kernel(impl, q: Tensor, spec) -> str | None:
    """The kernel backend (``"fa4"`` or ``"triton"``) that computes a pure-prefill batch's attention in
    the query dtype on CUDA: the one the guard would pick for the fused call, so that the unfused path
    and the fused one share their main loop. None: the layer's PyTorch runtime computes it."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and spec.num_decode_tokens == 0 and not spec.has_chunked_prefill):
        return None
    backend, _ = backends.select_backend(q.device, q.dtype, impl.num_heads, _qk_head_dim(impl), impl.v_head_dim)
    return backend.name if backend is not None and backend.name in ("fa4", "triton") else None


def _attention(impl, inputs: tuple, spec, q: Tensor) -> Tensor:
    """The batch's attention ``[T, H, Dv]``, appending the new tokens to the layer's cache.

    Pure-prefill batches on CUDA run the flash-attention kernel of the backend the
    guard selects (FA4's SM90 forward or the Triton kernel; output in the query
    dtype, as a serving attention backend returns it); everything else runs the
    layer's PyTorch runtime (float32).
    """
    name = _half_prefill_kernel(impl, q, spec)
    if name is None:
        return impl.forward(*inputs, spec)
    if name == "fa4":
        from fusion_pass.kernels.fa4_sm90 import fa4_attention_varlen as flash
    else:
        from fusion_pass.kernels.flash_attention import flash_attention as flash
    q, k, v = prefill.prefill_qkv(impl, inputs, spec)
    cu_seqlens, max_seqlen = prefill.varlen_meta(spec, q.device)
    return flash(q, k, v, cu_seqlens, max_seqlen, causal=True, softmax_scale=impl.softmax_scale)


def _cache_rollback(impl):
    """Undo the cache changes of a call that raises part-way (the impl's cache transaction)."""
    cache = getattr(impl, "_cache", None)
    transaction = getattr(cache, "transaction", None)
    return transaction() if transaction is not None else contextlib.nullcontext()


def _run_attention(op: str, q: Tensor, inputs: tuple, output, layer_name, output_scale, output_block_scale) -> None:
    """Shared body of the attention ops: one attention computation per call.

    Every argument is checked first (:func:`_check_attention_call`), before
    attention runs, any cache is touched or the guard counts anything: a
    rejected call changes nothing and a retry with valid arguments succeeds.
    Without ``output_scale``: attention in the query dtype, not guarded
    (:func:`_attention`: the Triton kernel on CUDA prefill batches). With
    it: :func:`fusion_pass.guard.decide` picks the path; ``fused`` runs the
    selected backend (attention quantized from float32), ``fallback`` runs
    exactly the unfused computation (attention rounded to the query dtype,
    then ``scaled_fp4_quant.out``); :func:`fusion_pass.guard.record` counts
    the call once it has completed. Should the computation still fail part-way,
    the layer's cache is rolled back.
    """
    impl = runtime.get_layer(layer_name)
    spec = runtime.current_batch()
    _check_attention_call(op, impl, spec, q, inputs, output, output_scale, output_block_scale)
    if output_scale is None:
        with _cache_rollback(impl):
            out = _attention(impl, inputs, spec, q)
            _write_attention_output(out, q.dtype, output, output_scale, output_block_scale)
        return
    decision = guard.decide(
        spec,
        device=q.device,
        dtype=q.dtype,
        num_heads=impl.num_heads,
        qk_head_dim=_qk_head_dim(impl),
        v_head_dim=impl.v_head_dim,
    )
    with _cache_rollback(impl):
        if decision.fused:
            backends.get_backend(decision.backend).run(impl, inputs, spec, output, output_scale, output_block_scale)
        else:
            out = _attention(impl, inputs, spec, q)
            _write_attention_output(out, q.dtype, output, output_scale, output_block_scale)
    guard.record(decision)


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
