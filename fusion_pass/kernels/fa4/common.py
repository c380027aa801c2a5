"""What the FA4 NVFP4 kernels of every GPU generation share on the host (imports without FA4).

The pinned releases, the import status, argument checks of q/k/v and of the NVFP4 output buffers, and the
compile cache (one per process, keyed by kernel and configuration, logging each compilation at INFO on the
``fusion_pass`` logger). The per-call path is :mod:`.launch`.
:mod:`.sm90` and :mod:`.sm100` add what differs: the FA4 class, its tile configuration, the head dims.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import math
import threading
import time
import warnings
from typing import Callable

import torch
from torch import Tensor

from fusion_pass import fp8
from fusion_pass.kernels.checks import HALF_DTYPES, check_cu_seqlens_k, check_max_seqlen_k, check_qkv, describe
from fusion_pass.nvfp4.checks import ArgumentError

__all__ = [
    "CUTLASS_DSL_VERSION",
    "FA4_INSTALL_HINT",
    "FA4_VERSION",
    "address",
    "canonical_scales",
    "check_fa4_args",
    "check_fa4_paged_args",
    "check_nvfp4_buffers",
    "compiled",
    "device_arch",
    "fa4_import_status",
    "fa4_interface",
    "is_fake_mode",
    "kernel_usable",
    "layout_key",
    "scale_bytes_of",
    "unused_o",
]

FA4_VERSION = "4.0.0b36"
"""The flash-attn-4 release the subclasses override internals of (pinned in pyproject's ``fa4`` extra)."""

CUTLASS_DSL_VERSION = "4.8.0"
"""The nvidia-cutlass-dsl release pinned in the ``fa4`` extra: the one vLLM 0.32-0.34's CUDA wheels pin, so that
both install in one environment (``docs/fa4.md``, "The CuTe DSL pin")."""

FA4_INSTALL_HINT = "pip install 'attn-nvfp4-fusion[fa4]'"

BLOCK = 16

logger = logging.getLogger("fusion_pass")


def address(t: Tensor) -> int:
    from torch._subclasses.fake_tensor import FakeTensor

    return 0 if isinstance(t, FakeTensor) else t.data_ptr()  # fake tensors: compile-only checks


def is_fake_mode() -> bool:
    """Whether tensors are fake (compile-only checks under ``FakeTensorMode``): nothing is launched."""
    from torch._guards import active_fake_mode

    return active_fake_mode() is not None


def device_arch(device: torch.device) -> int | None:
    """``major * 10 + minor`` of ``device``; in fake mode FA4's own choice (``FLASH_ATTENTION_ARCH``),
    so compile-only checks target the generation they name. ``None`` without CUDA."""
    if is_fake_mode():
        return fa4_interface()._get_device_arch()
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    return _capability(torch.device(device))


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def kernel_usable(device, dtype, num_heads: int, head_dim: int, head_dim_v: int, *, import_status: tuple[bool, str],
                  families: tuple[int, ...], label: str, gpus: str,
                  head_dims: tuple[tuple[int, int], ...]) -> tuple[bool, str]:
    """Whether a generation's kernels run a layer of these dims on ``device``: ``(ok, why)``. Checks, in order:
    FA4 and the generation's subclass import (``import_status``); a CUDA device whose compute capability major
    is in ``families`` (``label`` names the generation, ``gpus`` its GPUs); a bf16/fp16 dtype; ``(D, Dv)`` in
    ``head_dims``; ``H*Dv/2 % 8 == 0``."""
    ok, why = import_status
    if not ok:
        return False, why
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"fa4 runs on CUDA devices only, got {device}"
    arch = device_arch(device)
    if arch is None:
        return False, "fa4: no CUDA device"
    if arch // 10 not in families:
        return False, f"fa4's {label} kernel needs an {label} GPU ({gpus}), {device} is sm_{arch}"
    if dtype not in (torch.float16, torch.bfloat16):
        return False, f"fa4 supports torch.float16 and torch.bfloat16 queries, got {dtype}"
    if (head_dim, head_dim_v) not in head_dims:
        return False, (f"fa4's {label} kernel supports head dims (D, Dv) in {', '.join(map(str, head_dims))}, "
                       f"got ({head_dim}, {head_dim_v})")
    if (num_heads * head_dim_v // 2) % 8:
        return False, f"fa4's NVFP4 output needs H*Dv/2 divisible by 8, got H={num_heads}, Dv={head_dim_v}"
    return True, "ok"


def layout_key(device, *tensors: Tensor) -> tuple:
    """What a compiled kernel specializes on besides dtypes and dims: the target architecture and, per tensor,
    which strides are 0 (the CuTe DSL keeps a stride-0 mode static when it marks a layout dynamic)."""
    return (device_arch(device),) + tuple(tuple(s == 0 for s in t.stride()) for t in tensors)


def check_fa4_args(fn: str, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, cu_seqlens_k=None,
                   max_seqlen_k=None, *, head_dims: tuple[tuple[int, int], ...], kernel: str) -> None:
    """Shapes, dtypes, devices and ``(D, Dv)`` in ``head_dims`` of ``kernel`` (no FA4 import, no sync).

    With ``cu_seqlens_k``, ``k``/``v`` may have another token count than ``q``; its values
    (and ``cu_seqlens``'s) are not read."""
    check_qkv(fn, q, k, v, separate_kv=cu_seqlens_k is not None)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tma_alignment(fn, name, t)
    _check_head_dims(fn, q.shape[2], v.shape[2], head_dims, kernel)
    _check_cu_seqlens(fn, q, cu_seqlens, max_seqlen)
    if cu_seqlens_k is not None:
        check_cu_seqlens_k(fn, cu_seqlens_k, cu_seqlens, q.device)
    check_max_seqlen_k(fn, max_seqlen_k, cu_seqlens_k)
    _check_scale_and_causal(fn, softmax_scale, causal)


def _check_head_dims(fn: str, d: int, dv: int, head_dims, kernel: str) -> None:
    if (d, dv) not in head_dims:
        raise ArgumentError(
            f"{fn}: head dims (q/k D={d}, v Dv={dv}) are not supported by the {kernel} kernels; "
            f"supported (D, Dv): {', '.join(map(str, head_dims))}"
        )


def _check_cu_seqlens(fn: str, q: Tensor, cu_seqlens, max_seqlen) -> None:
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ArgumentError(f"{fn}: cu_seqlens must be a 1-D int32 tensor [B + 1], got {describe(cu_seqlens)}")
    if cu_seqlens.numel() < 2 or cu_seqlens.device != q.device or not cu_seqlens.is_contiguous():
        raise ArgumentError(
            f"{fn}: cu_seqlens must be contiguous int32 [B + 1 >= 2] on {q.device}, got {describe(cu_seqlens)}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ArgumentError(f"{fn}: max_seqlen must be a non-negative int, got {max_seqlen!r}")


def _check_scale_and_causal(fn: str, softmax_scale, causal) -> None:
    if (
        isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, (int, float))
        or not math.isfinite(softmax_scale)
        or softmax_scale <= 0
    ):
        raise ArgumentError(f"{fn}: softmax_scale must be a positive finite float, got {softmax_scale!r}")
    if not isinstance(causal, bool):
        raise ArgumentError(f"{fn}: causal must be a bool, got {causal!r}")


def _check_tma_alignment(fn: str, name: str, t: Tensor) -> None:
    if any((s * t.element_size()) % 16 for s in t.stride()[:-1]) or address(t) % 16:
        raise ArgumentError(
            f"{fn}: {name} must be 16-byte aligned with 16-byte aligned strides (TMA), "
            f"got strides {t.stride()} and address {address(t):#x}"
        )


def check_fa4_paged_args(fn: str, q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k,
                         softmax_scale, causal, *, head_dims: tuple[tuple[int, int], ...], kernel: str) -> None:
    """The arguments of a paged call (no FA4 import, no sync; no value of a device tensor is read).

    ``q [T, H, D]``; ``k_cache [num_pages, page_size, Hkv, D]`` and ``v_cache [num_pages, page_size, Hkv, Dv]``
    with unit stride along the head dim and 16-byte aligned strides and addresses (any other strides: views of
    a larger cache such as keys and values split along the last dim are fine); ``cu_seqlens`` int32 ``[B+1]``;
    ``seqused_k`` contiguous int32 ``[B]``; ``page_table`` int32 ``[B, max_pages_per_seq]`` with unit stride along
    its last dim (any row stride); ``max_seqlen_k`` an int in ``0 .. max_pages_per_seq * page_size``."""
    if not isinstance(q, Tensor) or q.dim() != 3:
        raise ArgumentError(f"{fn}: q must be a 3-D tensor [T, H, D], got {describe(q)}")
    for name, t, layout in (("k_cache", k_cache, "[num_pages, page_size, Hkv, D]"),
                            ("v_cache", v_cache, "[num_pages, page_size, Hkv, Dv]")):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ArgumentError(f"{fn}: {name} must be a 4-D tensor {layout}, got {describe(t)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in HALF_DTYPES:
            raise ArgumentError(f"{fn}: {name} must be float16 or bfloat16, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ArgumentError(
                f"{fn}: {name} must have unit stride along its last (head) dim, got strides {t.stride()}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ArgumentError(
            f"{fn}: q, k_cache, v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if not (q.device == k_cache.device == v_cache.device):
        raise ArgumentError(
            f"{fn}: q, k_cache, v_cache must be on one device, got {q.device}, {k_cache.device}, {v_cache.device}")
    h, d = q.shape[1], q.shape[2]
    num_pages, page_size, hkv, dk = k_cache.shape
    if dk != d:
        raise ArgumentError(
            f"{fn}: k_cache must be [num_pages, page_size, Hkv, D] with q's D={d}, got {list(k_cache.shape)}")
    if tuple(v_cache.shape[:3]) != (num_pages, page_size, hkv):
        raise ArgumentError(
            f"{fn}: v_cache must be [num_pages, page_size, Hkv, Dv] with k_cache's num_pages={num_pages}, "
            f"page_size={page_size}, Hkv={hkv}, got {list(v_cache.shape)}")
    if num_pages == 0 or page_size == 0:
        raise ArgumentError(
            f"{fn}: k_cache must hold at least one page of at least one token, got {list(k_cache.shape)}")
    if hkv == 0 or h % hkv:
        raise ArgumentError(f"{fn}: q's heads H={h} must be a multiple of the caches' heads Hkv={hkv}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tma_alignment(fn, name, t)
    _check_head_dims(fn, d, v_cache.shape[3], head_dims, kernel)
    _check_cu_seqlens(fn, q, cu_seqlens, max_seqlen)
    b = cu_seqlens.numel() - 1
    if (not isinstance(seqused_k, Tensor) or seqused_k.dtype != torch.int32 or seqused_k.dim() != 1
            or seqused_k.numel() != b or seqused_k.device != q.device or seqused_k.stride(0) != 1):
        raise ArgumentError(
            f"{fn}: seqused_k must be a contiguous 1-D int32 tensor [B] = [{b}] (B from cu_seqlens) on {q.device}, "
            f"got {describe(seqused_k)}")
    if not isinstance(page_table, Tensor) or page_table.dtype != torch.int32 or page_table.dim() != 2:
        raise ArgumentError(
            f"{fn}: page_table must be a 2-D int32 tensor [B, max_pages_per_seq], got {describe(page_table)}")
    if page_table.shape[0] != b or page_table.shape[1] == 0 or page_table.device != q.device:
        raise ArgumentError(
            f"{fn}: page_table must be int32 [B, max_pages_per_seq >= 1] = [{b}, ...] (B from cu_seqlens) on "
            f"{q.device}, got {describe(page_table)}")
    if page_table.stride(1) != 1:
        raise ArgumentError(
            f"{fn}: page_table must have unit stride along its last dim, got strides {page_table.stride()}")
    if address(page_table) % 4:
        raise ArgumentError(f"{fn}: page_table must be 4-byte aligned, got address {address(page_table):#x}")
    bound = page_table.shape[1] * page_size
    if isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, int) or not 0 <= max_seqlen_k <= bound:
        raise ArgumentError(
            f"{fn}: max_seqlen_k must be an int in 0 .. max_pages_per_seq * page_size = "
            f"{page_table.shape[1]} * {page_size} = {bound}, got {max_seqlen_k!r}")
    _check_scale_and_causal(fn, softmax_scale, causal)


def check_nvfp4_buffers(fn: str, q, v, output, output_scale, output_block_scale) -> None:
    """The fused kernels' output buffers (no FA4 import, no sync). ``v``: the values (``[Tk, Hkv, Dv]``) or the
    value cache (``[num_pages, page_size, Hkv, Dv]``); only ``Dv`` is read."""
    t, h, _ = q.shape
    dv = v.shape[-1]
    row_bytes = h * dv // 2
    if row_bytes % 8:
        raise ArgumentError(
            f"{fn}: H * Dv / 2 must be divisible by 8 (one 8-byte store per 16-element block), "
            f"got H={h}, Dv={dv}: {row_bytes}"
        )
    if not isinstance(output, Tensor) or output.element_size() != 1 or output.device != q.device:
        raise ArgumentError(f"{fn}: output must be a one-byte tensor on {q.device}, got {describe(output)}")
    if output.numel() != t * row_bytes or not output.is_contiguous():
        raise ArgumentError(
            f"{fn}: output must be contiguous with T * H * Dv / 2 = {t * row_bytes} bytes ([T, H*Dv/2] uint8), "
            f"got {describe(output)}"
        )
    if address(output) % 16:
        raise ArgumentError(f"{fn}: output must be 16-byte aligned, got address {address(output):#x}")
    if (
        not isinstance(output_scale, Tensor)
        or output_scale.dtype != torch.float32
        or output_scale.numel() != 1
        or output_scale.device != q.device
    ):
        raise ArgumentError(
            f"{fn}: output_scale must be a one-element float32 tensor on {q.device} (the global scale), "
            f"got {describe(output_scale)}"
        )
    rows = -(-t // 128) * 128
    cols = -(-(h * dv // BLOCK) // 4) * 4
    if (
        not isinstance(output_block_scale, Tensor)
        or output_block_scale.device != q.device
        or not output_block_scale.is_contiguous()
        or output_block_scale.numel() * output_block_scale.element_size() != rows * cols
    ):
        raise ArgumentError(
            f"{fn}: output_block_scale must be a contiguous buffer of round_up(T,128) * round_up(H*Dv/16,4) = "
            f"{rows} * {cols} bytes on {q.device} (swizzled e4m3 scales), got {describe(output_block_scale)}"
        )


# ---------------------------------------------------------------------------
# FA4 (lazy)
# ---------------------------------------------------------------------------


def import_error_message(exc: BaseException) -> str:
    if isinstance(exc, ModuleNotFoundError) and exc.name in ("flash_attn", "flash_attn.cute", "cutlass"):
        return f"flash_attn.cute is not installed ({FA4_INSTALL_HINT})"
    return f"flash_attn.cute failed to import: {type(exc).__name__}: {exc}"


@functools.lru_cache(maxsize=None)
def fa4_import_status(kernel_module: str = "sm90_kernel") -> tuple[bool, str]:
    """``(True, "flash-attn-4 <version>")`` when ``flash_attn.cute`` and our subclass module
    ``fusion_pass.kernels.fa4.<kernel_module>`` import, else ``(False, why)``. Cached."""
    try:
        importlib.import_module("flash_attn.cute")
        importlib.import_module(f"fusion_pass.kernels.fa4.{kernel_module}")
    except Exception as exc:  # a broken install must not break the caller: report it
        return False, import_error_message(exc)
    try:
        version = importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown version"
    note = "" if version == FA4_VERSION else f", not the pinned {FA4_VERSION}: untested"
    return True, f"flash-attn-4 {version}{note}"


def fa4_interface():
    try:
        from flash_attn.cute import interface
    except Exception as exc:
        raise RuntimeError(f"fa4: {import_error_message(exc)}") from exc
    return interface


def check_fp8_bytes(fn: str, output) -> None:
    """An FP8 epilogue's ``output`` (its shape, dtype and device checked by the caller when not None) is there,
    contiguous and 16-byte aligned: the epilogues store 8 bytes at a time."""
    if output is None or not output.is_contiguous() or address(output) % 16:
        got = "None" if output is None else f"strides {output.stride()}, address {address(output):#x}"
        raise ArgumentError(f"{fn}: output must be a contiguous 16-byte aligned float8_e4m3fn [T, H*Dv], got {got}")


def check_fp8_group_buffers(fn: str, q: Tensor, v: Tensor, ue8m0, divide, output, scales) -> None:
    """A group FP8 entry point's format arguments (after its generation's ``check_fa4_args``): ``Dv % 128 == 0``,
    :func:`fusion_pass.kernels.checks.check_fp8_group`, the epilogue's output bytes, scales given."""
    from fusion_pass.kernels.checks import check_fp8_group

    if v.shape[2] % fp8.GROUP_SIZE:
        raise ArgumentError(f"{fn}: v's head dim Dv must be divisible by {fp8.GROUP_SIZE} (a head's tile holds whole "
                            f"128-column groups), got v {list(v.shape)}")
    check_fp8_group(fn, q, v, ue8m0, divide, output, scales)
    check_fp8_bytes(fn, output)
    if scales is None:
        raise ArgumentError(f"{fn}: scales must be a float32 [T, H*Dv/128] tensor (fusion_pass.fp8.group_scale_buffer)"
                            f", got None")


def unused_o(q: Tensor, dv: int) -> Tensor:
    """FA4's ``mO`` argument of a fused kernel: a ``[T, H, Dv]`` view of ``q`` (FA4 builds its output
    descriptors over it; the NVFP4 output stage never stores through it, so nothing is allocated or written)."""
    if q.shape[2] == dv:
        return q
    if is_fake_mode():  # compile-only: slicing a fake CUDA tensor fails on a CPU-only torch
        return torch.empty((q.shape[0], q.shape[1], dv), dtype=q.dtype, device=q.device)
    return q[..., :dv]


def canonical_scales(scales: Tensor) -> Tensor:
    """A group FP8 kernel's ``[T, G]`` scales (:func:`fusion_pass.fp8.writable_scales`) with their
    :class:`~fusion_pass.fp8.ScaleLayout`'s strides: the same addresses (only a size-1 dim's stride may change), so
    that ``stride(0) == 1 and stride(1) != 1`` says column-major. The first rows of a larger column-major buffer
    (no layout) keep their strides."""
    layout = fp8.ScaleLayout.of(scales)
    if layout is None:
        return scales
    strides = layout.strides(*scales.shape)
    if scales.stride() == strides:
        return scales
    if is_fake_mode():  # compile-only: a view of a fake CUDA tensor fails on a CPU-only torch
        return torch.empty_strided(scales.shape, strides, dtype=scales.dtype, device=scales.device)
    return scales.as_strided(scales.shape, strides)


def scale_bytes_of(output_block_scale: Tensor) -> Tensor:
    """The swizzled scale buffer as flat bytes, whatever one-byte or int32 view the caller holds."""
    if output_block_scale.element_size() == 1:
        return output_block_scale.view(torch.uint8).view(-1)
    return output_block_scale.view(-1).view(torch.uint8)


_lock = threading.Lock()
_caches: dict[str, object] = {}


def compiled(cache_name: str, key: tuple, build: Callable[[], object], what: str):
    """The compiled kernel of ``key`` in FA4 ``get_jit_cache(cache_name)``, built by ``build()`` on a miss
    (logged at INFO with ``what`` and the time it took). ``key[0]`` is the kernel's version string: FA4's
    persistent cache fingerprints only FA4's sources, so an edit to a subclass must change it."""
    from flash_attn.cute.cache_utils import get_jit_cache

    with _lock:
        cache = _caches.get(cache_name)
        if cache is None:
            cache = _caches[cache_name] = get_jit_cache(cache_name)
        if key not in cache:
            started = time.perf_counter()
            with warnings.catch_warnings():
                # FA4's __call__ is traced inside ours; the DSL warns that the AuxData holding our tensors
                # is not a JitArgument of that inner call. The tensors are arguments of ours.
                warnings.filterwarnings("ignore", message=r"Argument aux_data .* cannot be converted")
                cache[key] = build()
            logger.info("fusion_pass: fa4: compiled %s in %.1f s; once per configuration and process", what,
                        time.perf_counter() - started)
        return cache[key]
