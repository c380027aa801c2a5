"""Fused attention -> NVFP4 backends: explicit, queryable, selectable.

A *fused* backend computes attention for a pure-prefill batch and writes the
NVFP4 bytes the o_proj GEMM reads (packed e2m1 ``output`` uint8
``[T, H*Dv/2]`` and the 128x4-swizzled block scales, see ``NVFP4.md``) in the
same call, without a bf16 round trip. The run-time guard
(:mod:`fusion_pass.guard`) asks :func:`select_backend` for one; the attention
ops (:mod:`fusion_pass.ops`) call its :meth:`~Backend.run`.

Three backends, in preference order:

``fa4``
    FlashAttention-4 (``flash_attn.cute``, the ``fa4`` extra). On SM90 (H100,
    H200): FA4's own SM90 kernel with our NVFP4 epilogue,
    :func:`fusion_pass.kernels.fa4_attention_nvfp4_varlen` (``docs/fa4.md``);
    available when ``flash_attn.cute`` and our subclass import
    (:func:`fa4_sm90_availability`), run and byte-checked on an H200. On
    SM100/SM110: FA4's varlen forward with native NVFP4 output (``out`` viewed
    as ``float4_e2m1fn_x2``, ``output_scale`` the global scale,
    ``output_scales`` the swizzled scale buffer viewed as ``float8_e4m3fn``),
    available only when the installed FA4 has those arguments
    (:func:`fa4_availability`); no FA4 release has them and no Blackwell GPU
    is in this project's environments, so that path was **never run**; its
    argument building (:func:`fa4_call_kwargs`) is tested on the CPU.
``triton``
    The project's Triton flash-attention with an NVFP4 epilogue, called through
    ``fusion_pass.kernels.<TRITON_ENTRY_POINT>`` (contract in
    :class:`TritonBackend`). Needs triton and a CUDA device (Hopper has no FP4
    instructions: the epilogue rounds and packs with ordinary ones).
``reference``
    PyTorch on any device: the layer's runtime attention in float32, quantized
    straight from float32 by :func:`fusion_pass.nvfp4.quantize`. Slow, always
    available, the oracle of the other two.

Selection: the first backend, in the order above, that is available and
supports the layer's device/dtype/head dims. The choice can be pinned, in
order of precedence:

1. :func:`use_backend` (``with use_backend("reference"):``): scoped to the
   ``with`` block *and* to the thread / asyncio task that entered it (a
   :class:`contextvars.ContextVar`); other threads do not see it, and a new
   thread starts without it;
2. :func:`set_backend`: the process-wide default, seen by every thread that
   has no :func:`use_backend` in effect;
3. the environment variable ``FUSION_PASS_BACKEND`` (``auto``, ``fa4``,
   ``triton``, ``reference``);
4. ``auto``.

Availability is detected once per process and cached (:func:`refresh` re-detects).
:func:`list_backends` lists every backend with its availability and reason (the
``fusion-pass backends`` command prints it).
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import importlib.util
import inspect
import os
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Protocol, runtime_checkable

import torch
from torch import Tensor

from fusion_pass import nvfp4
from fusion_pass.prefill import _nvfp4_views, post_quantize_rows, run_on_prefill

__all__ = [
    "BACKEND_ENV",
    "BACKEND_CHOICES",
    "BACKEND_ORDER",
    "FA4_NVFP4_ARGS",
    "TRITON_ENTRY_POINT",
    "Backend",
    "FA4Backend",
    "TritonBackend",
    "ReferenceBackend",
    "list_backends",
    "get_backend",
    "select_backend",
    "configured_backend",
    "set_backend",
    "use_backend",
    "refresh",
    "fa4_availability",
    "fa4_sm90_availability",
    "fa4_call_kwargs",
    "triton_availability",
]

BACKEND_ENV = "FUSION_PASS_BACKEND"
"""Environment variable pinning the backend choice (see :data:`BACKEND_CHOICES`)."""

BACKEND_CHOICES = ("auto", "fa4", "triton", "reference")
"""Valid values of :data:`BACKEND_ENV` / :func:`set_backend`."""

BACKEND_ORDER = ("fa4", "triton", "reference")
"""Preference order used by ``auto``."""

FA4_NVFP4_ARGS = ("out", "output_scale", "output_scales")
"""Parameters ``flash_attn.cute.flash_attn_varlen_func`` needs for NVFP4 output."""

TRITON_ENTRY_POINT = "flash_attention_nvfp4_varlen"
"""Function of ``fusion_pass.kernels`` the ``triton`` backend calls."""

_HALF_DTYPES = (torch.float16, torch.bfloat16)


@runtime_checkable
class Backend(Protocol):
    """What the guard and the attention ops need from a fused backend."""

    name: str

    def available(self) -> tuple[bool, str]:
        """``(True, short description)`` or ``(False, why not)``; cached per process."""
        ...

    def supports(
        self, device: torch.device, dtype: torch.dtype, num_heads: int, qk_head_dim: int, v_head_dim: int
    ) -> tuple[bool, str]:
        """Whether this backend can run a layer of these dims on ``device`` with query ``dtype``."""
        ...

    def run(
        self, impl: Any, inputs: tuple, spec: Any, output: Tensor, output_scale: Tensor, output_block_scale: Tensor
    ) -> None:
        """Compute attention of ``impl`` on ``inputs`` for the pure-prefill batch ``spec``
        (appending the new tokens to the layer's cache, as ``impl.forward`` does) and write
        the NVFP4 bytes into ``output`` and ``output_block_scale`` (every byte, padding zero)."""
        ...

    def run_varlen(
        self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, softmax_scale: float,
        output: Tensor, output_scale: Tensor, output_block_scale: Tensor,
        *, cu_seqlens_k: Tensor | None = None, max_seqlen_k: int | None = None,
    ) -> None:
        """The fused kernel on dense prefill inputs: ``q [T, H, Dqk]``, ``k [Tk, Hk, Dqk]``, ``v [Tk, Hk, Dv]``,
        causal within each sequence of ``cu_seqlens`` (int32 ``[B+1]``, the rows of ``q`` and of the
        output; may start past row 0). Keys: the rows of ``cu_seqlens_k`` when given (context followed by
        the new tokens, ``Lk >= Lq``, the causal mask aligned to the end), else those of ``cu_seqlens``.
        ``output`` uint8 ``[T, H*Dv/2]``, ``output_block_scale`` the swizzled scales of ``T`` rows: the
        sequences' rows are written, the scale padding zeroed."""
        ...

    def attention_lse(
        self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, cu_seqlens_k: Tensor,
        max_seqlen_k: int, softmax_scale: float, causal: bool,
    ) -> tuple[Tensor, Tensor]:
        """Partial attention for the chunked-context path: float32 ``out [T, H, Dv]`` and its log-sum-exp
        ``lse [T, H]`` (``-inf`` where a row sees no key), sequences as in :meth:`run_varlen`."""
        ...

    def merge_nvfp4(
        self, out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, output_scale: Tensor,
        packed: Tensor, scales: Tensor, row_start: int,
    ) -> None:
        """Merge two partial attentions by log-sum-exp and write the result as NVFP4 into rows
        ``[row_start, row_start + M)`` of ``packed`` uint8 ``[T, H*Dv/2]`` / swizzled ``scales``."""
        ...


# ---------------------------------------------------------------------------
# helpers shared by the backends
# ---------------------------------------------------------------------------


def _check_device_dtype(name: str, device: torch.device, dtype: torch.dtype, dtypes) -> tuple[bool, str]:
    if torch.device(device).type != "cuda":
        return False, f"{name} runs on CUDA devices only, got {torch.device(device)}"
    if dtype not in dtypes:
        return False, f"{name} supports {', '.join(str(d) for d in dtypes)} queries, got {dtype}"
    return True, "ok"


def _write_nvfp4(output: Tensor, output_block_scale: Tensor, packed: Tensor, scales: Tensor) -> None:
    """Copy reference-layout ``packed``/``scales`` into the op's buffers, byte for byte."""
    out_bytes = output.view(torch.uint8)
    scale_bytes = output_block_scale.view(torch.uint8)
    if out_bytes.numel() != packed.numel() or scale_bytes.numel() != scales.numel():
        raise ValueError(
            f"NVFP4 buffers do not match the quantized data: output holds {out_bytes.numel()} bytes "
            f"(need {packed.numel()}), output_block_scale holds {scale_bytes.numel()} bytes "
            f"(need {scales.numel()})"
        )
    out_bytes.view(packed.shape).copy_(packed)
    scale_bytes.view(-1).copy_(scales.view(torch.uint8).view(-1))


def run_fused_kernel(kernel: Callable[..., None], q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor,
                     max_seqlen: int, softmax_scale: float,
                     output: Tensor, output_scale: Tensor, output_block_scale: Tensor,
                     cu_seqlens_k: Tensor | None = None, max_seqlen_k: int | None = None) -> None:
    """Call a fused NVFP4 entry point of :mod:`fusion_pass.kernels` (``kernel(q, k, v, *, cu_seqlens,
    max_seqlen, softmax_scale, causal, output, output_scale, output_block_scale, cu_seqlens_k,
    max_seqlen_k)``), causal."""
    kernel(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, softmax_scale=softmax_scale, causal=True,
           output=output.view(torch.uint8), output_scale=output_scale, output_block_scale=output_block_scale,
           cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)


def _attention_lse(kernel_backend: str, q, k, v, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k,
                   softmax_scale, causal) -> tuple[Tensor, Tensor]:
    """The chunked-context path's partial attention: the kernels' unvalidated call (no host sync on the GPU)."""
    from fusion_pass.kernels import attention_with_lse_varlen

    return attention_with_lse_varlen(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, cu_seqlens_k=cu_seqlens_k,
                                     max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                                     backend=kernel_backend)


def _merge_nvfp4(kernel_backend: str, out_a, lse_a, out_b, lse_b, output_scale, packed, scales, row_start) -> None:
    """The chunked-context path's last merge: the Triton launcher (unvalidated, no host sync) or the
    reference entry point."""
    from fusion_pass.kernels import merge_nvfp4

    if kernel_backend == "triton":
        merge_nvfp4.merge_attention_nvfp4_launch(out_a, lse_a, out_b, lse_b, output_scale, packed, scales, row_start)
    else:
        merge_nvfp4.merge_attention_nvfp4(out_a, lse_a, out_b, lse_b, output_scale, packed, scales, row_start,
                                          backend=kernel_backend)


# ---------------------------------------------------------------------------
# fa4
# ---------------------------------------------------------------------------


def fa4_availability(
    module_or_func: Any,
    capability: tuple[int, int] | None,
    *,
    import_error: str | None = None,
    has_fp4_dtype: bool | None = None,
) -> tuple[bool, str]:
    """Decide whether the FA4 backend can run, from injected facts (pure).

    Args:
        module_or_func: the imported ``flash_attn.cute`` module, or its
            ``flash_attn_varlen_func``, or ``None`` when the import failed.
        capability: ``(major, minor)`` of the CUDA device, ``None`` without CUDA.
        import_error: why the import failed (used when ``module_or_func`` is None).
        has_fp4_dtype: whether torch has ``float4_e2m1fn_x2`` (default: ask torch).

    Checks, in order: the module imports; its varlen forward has the
    parameters :data:`FA4_NVFP4_ARGS`; torch has ``float4_e2m1fn_x2``; a CUDA
    device exists; its capability major is 10 or 11 (SM100/SM110).
    """
    if module_or_func is None:
        return False, import_error or "flash_attn.cute is not installed"
    if inspect.ismodule(module_or_func):
        func = getattr(module_or_func, "flash_attn_varlen_func", None)
        if func is None:
            return False, "installed flash_attn.cute has no flash_attn_varlen_func"
    else:
        func = module_or_func
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError) as exc:
        return False, f"cannot read the signature of flash_attn.cute.flash_attn_varlen_func: {exc}"
    missing = [p for p in FA4_NVFP4_ARGS if p not in params]
    if missing:
        return False, (
            "installed flash_attn.cute.flash_attn_varlen_func has no NVFP4 output arguments "
            f"(out/output_scale/output_scales); missing: {', '.join(missing)}"
        )
    if has_fp4_dtype is None:
        has_fp4_dtype = hasattr(torch, "float4_e2m1fn_x2")
    if not has_fp4_dtype:
        return False, f"torch {torch.__version__} has no float4_e2m1fn_x2 dtype"
    if capability is None:
        return False, "no CUDA device"
    major, minor = capability
    if major not in (10, 11):
        return False, f"needs an SM100/SM110 GPU, found sm_{major}{minor}"
    return True, f"flash_attn.cute varlen forward with NVFP4 output on sm_{major}{minor}"


FA4_INSTALL_HINT = "pip install 'attn-nvfp4-fusion[fa4]'"


def fa4_sm90_availability(
    module: Any,
    capability: tuple[int, int],
    *,
    import_error: str | None = None,
    kernel_status: tuple[bool, str] | None = None,
) -> tuple[bool, str]:
    """Decide whether the FA4 backend can run on an SM90 GPU, from injected facts (pure).

    Args:
        module: the imported ``flash_attn.cute`` module, or ``None`` when the import failed.
        capability: ``(major, minor)`` of the CUDA device; major must be 9.
        import_error: why the import failed (used when ``module`` is None).
        kernel_status: ``(ok, why)`` of importing our subclass
            (:func:`fusion_pass.kernels.fa4_sm90.fa4_import_status`); default: ask it.
    """
    if module is None:
        return False, import_error or f"flash_attn.cute is not installed ({FA4_INSTALL_HINT})"
    major, minor = capability
    if major != 9:
        return False, f"the SM90 kernel needs an SM90 GPU, found sm_{major}{minor}"
    if kernel_status is None:
        from fusion_pass.kernels.fa4_sm90 import fa4_import_status

        kernel_status = fa4_import_status()
    ok, why = kernel_status
    if not ok:
        return False, why
    return True, f"FA4 SM90 forward with the fusion_pass NVFP4 epilogue on sm_{major}{minor} ({why})"


def _import_fa4() -> tuple[Any, str | None]:
    """``(flash_attn.cute module, None)`` or ``(None, why it did not import)``."""
    try:
        module = importlib.import_module("flash_attn.cute")
    except ModuleNotFoundError as exc:
        if exc.name in ("flash_attn", "flash_attn.cute"):
            return None, f"flash_attn.cute is not installed ({FA4_INSTALL_HINT})"
        return None, f"flash_attn.cute failed to import: {exc}"
    except Exception as exc:  # a broken install must not break the op: report it
        return None, f"flash_attn.cute failed to import: {type(exc).__name__}: {exc}"
    return module, None


@functools.lru_cache(maxsize=None)
def _device_capability(index: int | None) -> tuple[int, int] | None:
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(index))


@functools.lru_cache(maxsize=None)
def _fa4_status() -> tuple[bool, str]:
    module, error = _import_fa4()
    capability = _device_capability(None)
    if capability is not None and capability[0] == 9:
        return fa4_sm90_availability(module, capability, import_error=error)
    if module is None:
        return fa4_availability(None, None, import_error=error)
    return fa4_availability(module, capability)


def fa4_call_kwargs(
    output: Tensor,
    output_scale: Tensor,
    output_block_scale: Tensor,
    *,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    softmax_scale: float,
    num_heads: int,
    v_head_dim: int,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_k: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of the FA4 varlen forward call with NVFP4 output (pure).

    * ``out``: ``output`` viewed as ``float4_e2m1fn_x2`` ``[T, H, Dv/2]`` (uint8
      when torch lacks that dtype; the bytes are the same);
    * ``output_scale``: the global scale, as given (float32, one element);
    * ``output_scales``: ``output_block_scale`` viewed as ``float8_e4m3fn``
      ``[round_up(T, 128), round_up(H*Dv/16, 4)]`` (the swizzled layout);
    * causal attention: ``cu_seqlens``/``max_seqlen`` for q, and for k unless
      ``cu_seqlens_k``/``max_seqlen_k`` are given (keys context + new tokens,
      the mask aligned to the end).

    All views share storage with the op's buffers: the kernel writes them in place.
    """
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    out = output.view(torch.uint8)
    if fp4 is not None:
        out = out.view(fp4)
    out = out.view(-1, num_heads, v_head_dim // 2)
    scale_bytes = output_block_scale.view(torch.uint8)
    cols = nvfp4.round_up(num_heads * v_head_dim // nvfp4.BLOCK_SIZE, 4)
    output_scales = scale_bytes.view(-1, cols).view(torch.float8_e4m3fn)
    return {
        "q": q,
        "k": k,
        "v": v,
        "cu_seqlens_q": cu_seqlens,
        "cu_seqlens_k": cu_seqlens if cu_seqlens_k is None else cu_seqlens_k,
        "max_seqlen_q": max_seqlen,
        "max_seqlen_k": max_seqlen if max_seqlen_k is None else max_seqlen_k,
        "softmax_scale": softmax_scale,
        "causal": True,
        "out": out,
        "output_scale": output_scale,
        "output_scales": output_scales,
    }


class FA4Backend:
    """FlashAttention-4 with NVFP4 output: our SM90 kernel on SM90, FA4's native
    NVFP4 output arguments on SM100/SM110 (module docstring).

    ``varlen_func`` replaces ``flash_attn.cute.flash_attn_varlen_func`` in the
    SM100/SM110 path of :meth:`run` (tests inject a PyTorch stand-in; nothing else should).
    """

    name = "fa4"
    handles_context = True  # keys context + new tokens (cu_seqlens_k), see run_prefills

    def __init__(self, varlen_func: Callable[..., Any] | None = None) -> None:
        self._varlen_func = varlen_func

    def available(self) -> tuple[bool, str]:
        return _fa4_status()

    def supports(self, device, dtype, num_heads, qk_head_dim, v_head_dim) -> tuple[bool, str]:
        ok, why = _check_device_dtype(self.name, device, dtype, _HALF_DTYPES)
        if not ok:
            return ok, why
        device = torch.device(device)
        capability = _device_capability(device.index)
        if capability is not None and capability[0] == 9:
            from fusion_pass.kernels.fa4_sm90 import fa4_sm90_usable

            return fa4_sm90_usable(device, dtype, num_heads, qk_head_dim, v_head_dim)
        if capability is None or capability[0] not in (10, 11):
            found = "no CUDA device" if capability is None else f"sm_{capability[0]}{capability[1]}"
            return False, f"fa4 needs an SM90 or SM100/SM110 GPU, {device} is {found}"
        standard = 8 <= qk_head_dim <= 128 and 8 <= v_head_dim <= 128 and qk_head_dim % 8 == 0
        if not (standard or (qk_head_dim, v_head_dim) == (192, 128)):
            return False, (
                f"fa4 supports head dims 8..128 (multiples of 8) or (192, 128), "
                f"got (qk={qk_head_dim}, v={v_head_dim})"
            )
        if v_head_dim % nvfp4.BLOCK_SIZE != 0:
            return False, f"fa4's NVFP4 epilogue needs v_head_dim divisible by 16, got {v_head_dim}"
        return True, "ok"

    def run(self, impl, inputs, spec, output, output_scale, output_block_scale) -> None:
        run_on_prefill(self, impl, inputs, spec, output, output_scale, output_block_scale)

    def attention_lse(self, q, k, v, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k, softmax_scale, causal):
        """FA4's own forward with its log-sum-exp (output in the query dtype, returned as float32)."""
        return _attention_lse("fa4", q, k, v, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k, softmax_scale, causal)

    def merge_nvfp4(self, out_a, lse_a, out_b, lse_b, output_scale, packed, scales, row_start) -> None:
        """The Triton NVFP4 merge kernel."""
        _merge_nvfp4("triton", out_a, lse_a, out_b, lse_b, output_scale, packed, scales, row_start)

    def run_varlen(self, q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, output_scale,
                   output_block_scale, *, cu_seqlens_k=None, max_seqlen_k=None) -> None:
        """SM90: :func:`fusion_pass.kernels.fa4_attention_nvfp4_varlen` (it zeroes the scale
        buffer's padding rows itself). SM100/SM110, untested here (no SM100 GPU and no FA4
        release with NVFP4 output exist in this project's environments): the scale buffer is
        zeroed first so its padding entries are zero whatever the kernel writes."""
        capability = _device_capability(torch.device(output.device).index) if output.is_cuda else None
        if self._varlen_func is None and capability is not None and capability[0] == 9:
            from fusion_pass.kernels import fa4_attention_nvfp4_varlen

            run_fused_kernel(fa4_attention_nvfp4_varlen, q, k, v, cu_seqlens, max_seqlen, softmax_scale,
                             output, output_scale, output_block_scale, cu_seqlens_k, max_seqlen_k)
            return
        func = self._varlen_func
        if func is None:
            module, error = _import_fa4()
            if module is None:
                raise RuntimeError(f"fa4 backend: {error}")
            func = module.flash_attn_varlen_func
        output_block_scale.view(torch.uint8).zero_()
        func(
            **fa4_call_kwargs(
                output,
                output_scale,
                output_block_scale,
                q=q,
                k=k,
                v=v,
                cu_seqlens=cu_seqlens,
                max_seqlen=max_seqlen,
                softmax_scale=softmax_scale,
                num_heads=q.shape[1],
                v_head_dim=v.shape[2],
                cu_seqlens_k=cu_seqlens_k,
                max_seqlen_k=max_seqlen_k,
            )
        )


# ---------------------------------------------------------------------------
# triton
# ---------------------------------------------------------------------------


def triton_availability(
    *,
    find_spec: Callable[[str], Any] = importlib.util.find_spec,
    import_module: Callable[[str], Any] = importlib.import_module,
    cuda_available: Callable[[], bool] = torch.cuda.is_available,
) -> tuple[bool, str]:
    """Decide whether the Triton backend can run; the probes are injectable.

    Checks, in order: ``fusion_pass.kernels`` exists (``find_spec``); ``triton``
    imports; a CUDA device exists; ``fusion_pass.kernels`` imports and has
    :data:`TRITON_ENTRY_POINT`.
    """
    if find_spec("fusion_pass.kernels") is None:
        return False, "fusion_pass.kernels (the Triton kernels) is not part of this build"
    try:
        triton = import_module("triton")
    except ImportError:
        return False, "triton is not installed"
    except Exception as exc:
        return False, f"triton failed to import: {type(exc).__name__}: {exc}"
    if not cuda_available():
        return False, "no CUDA device"
    try:
        kernels = import_module("fusion_pass.kernels")
    except Exception as exc:
        return False, f"fusion_pass.kernels failed to import: {type(exc).__name__}: {exc}"
    if not callable(getattr(kernels, TRITON_ENTRY_POINT, None)):
        return False, f"fusion_pass.kernels has no {TRITON_ENTRY_POINT}(), the entry point this backend calls"
    version = getattr(triton, "__version__", "?")
    return True, f"Triton {version} flash attention with an NVFP4 epilogue"


@functools.lru_cache(maxsize=None)
def _triton_status() -> tuple[bool, str]:
    return triton_availability()


class TritonBackend:
    """The project's Triton flash attention with an NVFP4 epilogue.

    Calls ``fusion_pass.kernels.flash_attention_nvfp4_varlen(q, k, v, *,
    cu_seqlens, max_seqlen, softmax_scale, causal, output, output_scale,
    output_block_scale)`` with ``q``/``k``/``v`` from :func:`prefill_qkv`,
    ``output`` uint8 ``[T, H*Dv/2]`` and ``output_block_scale`` the swizzled
    scale buffer (the kernel writes every entry of rows ``< T``; the launcher
    zeroes the padding).
    """

    name = "triton"
    handles_context = True  # keys context + new tokens (cu_seqlens_k), see run_prefills

    def available(self) -> tuple[bool, str]:
        return _triton_status()

    def supports(self, device, dtype, num_heads, qk_head_dim, v_head_dim) -> tuple[bool, str]:
        ok, why = _check_device_dtype(self.name, device, dtype, _HALF_DTYPES)
        if not ok:
            return ok, why
        if v_head_dim % nvfp4.BLOCK_SIZE != 0:
            return False, f"triton's NVFP4 epilogue needs v_head_dim divisible by 16, got {v_head_dim}"
        return True, "ok"

    def run(self, impl, inputs, spec, output, output_scale, output_block_scale) -> None:
        run_on_prefill(self, impl, inputs, spec, output, output_scale, output_block_scale)

    def run_varlen(self, q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, output_scale,
                   output_block_scale, *, cu_seqlens_k=None, max_seqlen_k=None) -> None:
        kernels = importlib.import_module("fusion_pass.kernels")
        run_fused_kernel(getattr(kernels, TRITON_ENTRY_POINT), q, k, v, cu_seqlens, max_seqlen, softmax_scale,
                         output, output_scale, output_block_scale, cu_seqlens_k, max_seqlen_k)

    def attention_lse(self, q, k, v, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k, softmax_scale, causal):
        """The Triton kernel with a float32 output and its log-sum-exp."""
        return _attention_lse("triton", q, k, v, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k,
                              softmax_scale, causal)

    def merge_nvfp4(self, out_a, lse_a, out_b, lse_b, output_scale, packed, scales, row_start) -> None:
        """The Triton NVFP4 merge kernel."""
        _merge_nvfp4("triton", out_a, lse_a, out_b, lse_b, output_scale, packed, scales, row_start)


# ---------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------


class ReferenceBackend:
    """PyTorch, any device: float32 runtime attention quantized directly from float32.

    Runs every batch kind: the layer's runtime computes decode rows and prefills with cached context
    (chunked prefill, prefix-cache hits) exactly; decode rows are rounded to the query dtype before
    quantizing (the unfused graph's bytes), prefill rows are quantized from float32.
    """

    name = "reference"
    handles_context = True

    def available(self) -> tuple[bool, str]:
        return True, "PyTorch float32 attention + nvfp4.quantize, any device"

    def supports(self, device, dtype, num_heads, qk_head_dim, v_head_dim) -> tuple[bool, str]:
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return False, f"reference supports float16, bfloat16 and float32 queries, got {dtype}"
        if (num_heads * v_head_dim) % nvfp4.BLOCK_SIZE != 0:
            return False, f"num_heads * v_head_dim = {num_heads * v_head_dim} is not divisible by 16"
        return True, "ok"

    def run(self, impl, inputs, spec, output, output_scale, output_block_scale) -> None:
        out32 = impl.forward(*inputs, spec)  # float32 [T, H, Dv]
        t, d = out32.shape[0], spec.num_decode_tokens
        if d == 0:
            packed, scales = nvfp4.quantize(out32.reshape(t, -1), output_scale, swizzled=True)
            _write_nvfp4(output, output_block_scale, packed, scales)
            return
        post_quantize_rows(out32[:d].to(inputs[0].dtype), output_scale, output, output_block_scale, 0, t)
        post_quantize_rows(out32[d:], output_scale, output, output_block_scale, d, t)
        nvfp4.zero_scale_padding(_nvfp4_views(output, output_block_scale, t)[1], t, out32[0].numel())

    def run_varlen(self, q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, output_scale,
                   output_block_scale, *, cu_seqlens_k=None, max_seqlen_k=None) -> None:
        """float32 dense attention per sequence (:func:`fusion_pass.kernels.reference_attention`), quantized
        into the sequences' rows; scale padding zeroed."""
        from fusion_pass.kernels import reference_attention

        t = q.shape[0]
        a, b = int(cu_seqlens[0]), int(cu_seqlens[-1])
        if cu_seqlens_k is None:  # keys at the queries' rows
            k, v = k[a:b], v[a:b]
        out32 = reference_attention(q[a:b], k, v, cu_seqlens - a, True, softmax_scale, cu_seqlens_k=cu_seqlens_k)
        post_quantize_rows(out32, output_scale, output, output_block_scale, a, t)
        nvfp4.zero_scale_padding(_nvfp4_views(output, output_block_scale, t)[1], t, out32[0].numel())

    def attention_lse(self, q, k, v, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k, softmax_scale, causal):
        """float32 dense attention per sequence and its log-sum-exp."""
        return _attention_lse("reference", q, k, v, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k,
                              softmax_scale, causal)

    def merge_nvfp4(self, out_a, lse_a, out_b, lse_b, output_scale, packed, scales, row_start) -> None:
        """float32 merge, then the reference quantizer into the rows."""
        _merge_nvfp4("reference", out_a, lse_a, out_b, lse_b, output_scale, packed, scales, row_start)


# ---------------------------------------------------------------------------
# registry, configuration, selection
# ---------------------------------------------------------------------------

_BACKENDS: dict[str, Backend] = {
    "fa4": FA4Backend(),
    "triton": TritonBackend(),
    "reference": ReferenceBackend(),
}

_override: str | None = None  # set_backend (process-wide); None: the environment decides
_override_lock = threading.Lock()

_UNSET: Any = object()
_scoped: contextvars.ContextVar[Any] = contextvars.ContextVar("fusion_pass_backend", default=_UNSET)
"""use_backend's choice for this thread / task: a backend choice, None (the environment
decides, ignoring set_backend), or _UNSET (no use_backend in effect)."""


def _normalize_choice(name: str, source: str) -> str:
    value = name.strip().lower() if isinstance(name, str) else name
    if value not in BACKEND_CHOICES:
        raise ValueError(f"{source}={name!r} is not a backend; choose one of {', '.join(BACKEND_CHOICES)}")
    return value


def configured_backend() -> str:
    """The configured choice of the calling thread / task.

    :func:`use_backend`'s (innermost block of this thread / task), else
    :func:`set_backend`'s (process-wide), else ``$FUSION_PASS_BACKEND``, else
    ``auto``. Raises ValueError naming the variable and the choices when the
    variable is invalid.
    """
    scoped = _scoped.get()
    if scoped is None:  # use_backend(None): the environment decides
        override = None
    elif scoped is not _UNSET:
        return scoped
    else:
        override = _override
    if override is not None:
        return override
    raw = os.environ.get(BACKEND_ENV, "")
    if not raw.strip():
        return "auto"
    return _normalize_choice(raw, BACKEND_ENV)


def set_backend(name: str | None) -> str | None:
    """Pin the process-wide default backend choice (``None``: back to the environment/``auto``).

    Every thread sees it, except inside a :func:`use_backend` block of its own,
    which takes precedence. Returns the previous pinned choice (``None`` if
    there was none).
    """
    global _override
    value = None if name is None else _normalize_choice(name, "set_backend(name)")
    with _override_lock:
        previous, _override = _override, value
    return previous


@contextmanager
def use_backend(name: str | None) -> Iterator[str | None]:
    """Pin the backend choice inside the ``with`` block, for the calling thread / task only.

    Takes precedence over :func:`set_backend` and ``$FUSION_PASS_BACKEND``;
    ``None`` lets the environment decide (ignoring :func:`set_backend`) inside
    the block. Nestable; on exit the thread's previous choice is restored.
    Other threads never see it (it is a :class:`contextvars.ContextVar`: the
    attention ops read it on the thread that calls them, compiled graphs
    included), and threads started inside the block do not inherit it.
    """
    value = None if name is None else _normalize_choice(name, "use_backend(name)")
    token = _scoped.set(value)
    try:
        yield name
    finally:
        _scoped.reset(token)


def get_backend(name: str) -> Backend:
    """The backend object named ``name`` (one of :data:`BACKEND_ORDER`)."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; backends: {', '.join(BACKEND_ORDER)}") from None


def list_backends() -> list[dict[str, Any]]:
    """One entry per backend, in preference order: ``{"name", "available", "reason"}``."""
    result = []
    for name in BACKEND_ORDER:
        ok, reason = _BACKENDS[name].available()
        result.append({"name": name, "available": ok, "reason": reason})
    return result


def select_backend(
    device: torch.device | str,
    dtype: torch.dtype,
    num_heads: int,
    qk_head_dim: int,
    v_head_dim: int,
    *,
    preferred: str | None = None,
) -> tuple[Backend | None, str]:
    """The first available backend that supports the layer, and why.

    ``preferred`` (a backend name, or ``"auto"``) overrides the configured
    choice (:func:`configured_backend`); a named choice restricts the search to
    that backend. Returns ``(backend, its description)`` or ``(None, reasons)``
    with one ``"name: why"`` per backend tried, joined by ``"; "``.
    """
    choice = configured_backend() if preferred is None else _normalize_choice(preferred, "preferred")
    names = BACKEND_ORDER if choice == "auto" else (choice,)
    device = torch.device(device)
    reasons = []
    for name in names:
        backend = _BACKENDS[name]
        ok, why = backend.available()
        if ok:
            ok, unsupported = backend.supports(device, dtype, num_heads, qk_head_dim, v_head_dim)
            if ok:
                return backend, why
            why = unsupported
        reasons.append(f"{name}: {why}")
    return None, "; ".join(reasons)


def refresh() -> None:
    """Forget the cached availability results; the next query detects again."""
    _fa4_status.cache_clear()
    _triton_status.cache_clear()
    _device_capability.cache_clear()
