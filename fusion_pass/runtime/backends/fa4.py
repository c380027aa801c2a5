"""The ``fa4`` backend: FlashAttention-4 with NVFP4 output.

On SM90 (H100, H200): FA4's own SM90 kernel with this project's NVFP4 epilogue
(:func:`fusion_pass.kernels.launchers.fa4_attention_nvfp4_varlen`, ``docs/fa4.md``); available when
``flash_attn.cute`` and the subclass import (:func:`fa4_sm90_availability`); run and byte-checked on an H200.
On SM100/SM110: FA4's varlen forward with native NVFP4 output arguments (``out`` viewed as
``float4_e2m1fn_x2``, ``output_scale`` the global scale, ``output_scales`` the swizzled scale buffer viewed as
``float8_e4m3fn``), available only when the installed FA4 has them (:func:`fa4_availability`); no FA4 release
has them and no Blackwell GPU is in this project's environments, so that path was **never run**; its argument
building (:func:`fa4_call_kwargs`) is tested on the CPU.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Callable

import torch
from torch import Tensor

from fusion_pass import nvfp4
from fusion_pass.kernels import launchers
from fusion_pass.kernels.fa4.sm90 import FA4_INSTALL_HINT, fa4_import_status, fa4_sm90_usable
from fusion_pass.runtime.backends.base import HALF_DTYPES, KernelBackend, check_device_dtype

__all__ = ["FA4Backend", "FA4_NVFP4_ARGS", "fa4_availability", "fa4_call_kwargs", "fa4_sm90_availability"]

FA4_NVFP4_ARGS = ("out", "output_scale", "output_scales")
"""Parameters ``flash_attn.cute.flash_attn_varlen_func`` needs for NVFP4 output."""


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
            (:func:`fusion_pass.kernels.fa4.sm90.fa4_import_status`); default: ask it.
    """
    if module is None:
        return False, import_error or f"flash_attn.cute is not installed ({FA4_INSTALL_HINT})"
    major, minor = capability
    if major != 9:
        return False, f"the SM90 kernel needs an SM90 GPU, found sm_{major}{minor}"
    if kernel_status is None:
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
def device_capability(index: int | None) -> tuple[int, int] | None:
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(index))


@functools.lru_cache(maxsize=None)
def fa4_status() -> tuple[bool, str]:
    module, error = _import_fa4()
    capability = device_capability(None)
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


class FA4Backend(KernelBackend):
    """FlashAttention-4 with NVFP4 output: our SM90 kernel on SM90, FA4's native
    NVFP4 output arguments on SM100/SM110 (module docstring).

    ``varlen_func`` replaces ``flash_attn.cute.flash_attn_varlen_func`` in the
    SM100/SM110 path of :meth:`run_varlen` (tests inject a PyTorch stand-in; nothing else should).
    """

    name = "fa4"
    lse_kernel, merge_kernel = "fa4", "triton"  # FA4's own forward for partial attentions, the Triton NVFP4 merge
    handles_context = True  # keys context + new tokens (cu_seqlens_k), see run_prefills

    def __init__(self, varlen_func: Callable[..., Any] | None = None) -> None:
        self._varlen_func = varlen_func

    def available(self) -> tuple[bool, str]:
        return fa4_status()

    def fast_on(self, device) -> tuple[bool, str]:
        capability = device_capability(torch.device(device).index) if torch.device(device).type == "cuda" else None
        if capability is not None and capability[0] == 9:
            return True, "measured faster than cuDNN attention + quant at 7 of 9 shapes on the H200 (docs/benchmarks.md)"
        if capability is not None and capability[0] in (10, 11):
            return True, "FA4's own kernel for this GPU generation"
        found = "no CUDA device" if capability is None else f"sm_{capability[0]}{capability[1]}"
        return False, f"no measurement or kernel of this project for {found}"

    def supports(self, device, dtype, num_heads, qk_head_dim, v_head_dim) -> tuple[bool, str]:
        ok, why = check_device_dtype(self.name, device, dtype, HALF_DTYPES)
        if not ok:
            return ok, why
        device = torch.device(device)
        capability = device_capability(device.index)
        if capability is not None and capability[0] == 9:
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


    def run_varlen(self, q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, output_scale,
                   output_block_scale, *, cu_seqlens_k=None, max_seqlen_k=None) -> None:
        """SM90: :func:`fusion_pass.kernels.launchers.fa4_attention_nvfp4_varlen` (it zeroes the scale
        buffer's padding rows itself). SM100/SM110, untested here (no SM100 GPU and no FA4
        release with NVFP4 output exist in this project's environments): the scale buffer is
        zeroed first so its padding entries are zero whatever the kernel writes."""
        capability = device_capability(torch.device(output.device).index) if output.is_cuda else None
        if self._varlen_func is None and capability is not None and capability[0] == 9:
            launchers.fa4_attention_nvfp4_varlen(
                q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, softmax_scale=softmax_scale, causal=True,
                output=output.view(torch.uint8), output_scale=output_scale, output_block_scale=output_block_scale,
                cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
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
