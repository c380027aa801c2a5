"""The per-call path of the FA4 kernels of either generation: host checks, one dict lookup, the launch.

A call's *plan* (the compiled kernel and how to hand it the caller's tensors) depends only on properties that
do not change from batch to batch: the tensors' types, dtypes, devices, strides and non-token dims, ``causal``,
whether keys have their own ``cu_seqlens_k``, and the configuration class of the sequence lengths. The first
call with a given set of them takes the *checked path*: every argument check of the generation (errors naming
the argument), the configuration, compilation on a miss, then the launch; its plan is kept under that key.
Every later call builds the key from plain attribute reads, checks what the key does not fix (token counts,
buffer sizes, contiguity, 16-byte addresses, the scalars' types and ranges; no torch op, no sync) and launches
the plan's kernel. A call that fails one of those checks goes the checked path, which raises the error or runs
the call. Fake tensors (compile-only checks) always go the checked path and launch nothing.

The scale buffer's padding (rows ``T .. round_up(T, 128) - 1`` of the swizzled layout) is zeroed with one
``index_fill_`` of the last 128-row band through a cached index of its byte offsets (:class:`ScalePadding`);
nothing when ``T % 128 == 0``.

:class:`PagedFusedLauncher` and :class:`PagedTwinLauncher` are the same two paths for keys and values read from a
paged cache (``k_cache [num_pages, page_size, Hkv, D]``, ``seqused_k``, ``page_table``): their key adds the
cache's page size and strides and the types of ``seqused_k`` / ``page_table``; the page count, the batch size and
the page table's width are run-time values checked on every call.
"""

from __future__ import annotations

import math
import threading
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from fusion_pass import nvfp4
from fusion_pass.kernels.checks import zero_nvfp4_scale_padding
from fusion_pass.kernels.fa4 import common
from fusion_pass.nvfp4 import ArgumentError

__all__ = ["FusedLauncher", "PagedFusedLauncher", "PagedTwinLauncher", "ScalePadding", "TwinLauncher"]

_INF = math.inf


class ScalePadding:
    """Zeroes the padding entries of a 128x4-swizzled scale buffer (``docs/nvfp4.md``) in one launch.

    Rows ``T .. round_up(T, 128) - 1`` all lie in the last 128-row band, interleaved with real rows. Per device
    and number of 4-column tiles ``Kt`` an index of the band's ``Kt * 512`` byte offsets ordered by row is built
    once on the device (no copy, no sync); rows ``r0 = T % 128 ..`` are a suffix of it. Column padding (``H*Dv/16``
    not a multiple of 4) goes through :func:`zero_nvfp4_scale_padding`'s strided fills, as does a miss during
    CUDA-graph capture (an index built inside a capture holds nothing until the graph replays)."""

    def __init__(self) -> None:
        self._suffixes: dict[tuple, list[Tensor]] = {}

    def _build(self, device: torch.device, col_tiles: int) -> list[Tensor] | None:
        key = (device, col_tiles)
        found = self._suffixes.get(key)
        if found is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            index = nvfp4.row_scale_offsets(0, 128, col_tiles * 4, device)  # the first band's bytes, row by row
            found = self._suffixes[key] = [index[r0 * col_tiles * 4:] for r0 in range(128)]
        return found

    def __call__(self, scale_bytes: Tensor, t: int, width: int) -> None:
        """Zero the padding of the flat uint8 scale buffer of a ``[t, width]`` NVFP4 matrix (``t > 0``)."""
        blocks = width // 16
        r0 = t % 128
        if blocks % 4:
            zero_nvfp4_scale_padding(scale_bytes, t, width)
            return
        if r0 == 0:
            return
        col_tiles = blocks // 4
        suffixes = self._suffixes.get((scale_bytes.device, col_tiles)) or self._build(scale_bytes.device, col_tiles)
        if suffixes is None:
            zero_nvfp4_scale_padding(scale_bytes, t, width)
            return
        scale_bytes[(t - r0) * col_tiles * 4:].index_fill_(0, suffixes[r0], 0)


_padding = ScalePadding()


class _FusedPlan(NamedTuple):
    kernel: Callable
    row_bytes: int  # H*Dv/2: packed bytes per token
    sf_cols: int  # round_up(H*Dv/16, 4): scale bytes per row of the swizzled buffer
    sf_itemsize: int
    width: int  # H*Dv
    output_as_is: bool  # uint8 [T, H*Dv/2] already
    sf_as_is: bool  # flat uint8 already
    dv_slice: int | None  # Dv where mO is q[..., :Dv]; None: q itself
    max_seqlen_arg: bool  # the kernel takes max(max_seqlen, 1) last (SM100)


class _TwinPlan(NamedTuple):
    kernel: Callable
    dv: int
    max_seqlen_arg: bool


def _qkv_key(q, k, v, cu, cu_k, causal, cls):
    _, h, d = q.shape
    _, hkv, dk = k.shape
    _, hv, dv = v.shape
    return (type(q), type(k), type(v), q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, h, d, hkv, dk, hv,
            dv, q.stride(), k.stride(), v.stride(), type(cu), cu.dtype, cu.device, cu.stride(),
            None if cu_k is None else (type(cu_k), cu_k.dtype, cu_k.device, cu_k.stride()), causal, cls)


def _fused_key(q, k, v, cu, cu_k, causal, cls, output, output_scale, sf):
    return _qkv_key(q, k, v, cu, cu_k, causal, cls) + (
        type(output), output.dtype, output.device, output.stride(), type(output_scale), output_scale.dtype,
        output_scale.device, output_scale.shape, type(sf), sf.dtype, sf.device, sf.stride())


def _scalars_ok(t, q, k, v, cu, max_seqlen, softmax_scale, causal, cu_k, max_seqlen_k) -> bool:
    """What the key does not fix about q/k/v and the scalars (the checked path checks all of it again)."""
    tk = k.shape[0]
    if cu_k is None:
        if tk != t or max_seqlen_k is not None:
            return False
    elif cu_k.numel() != cu.numel() or not (max_seqlen_k is None or (type(max_seqlen_k) is int and max_seqlen_k >= 0)):
        return False
    return (t > 0 and v.shape[0] == tk and cu.numel() >= 2 and type(max_seqlen) is int and max_seqlen >= 0
            and type(softmax_scale) is float and 0.0 < softmax_scale < _INF and type(causal) is bool)


class FusedLauncher:
    """The fused NVFP4 call of one generation (module docstring).

    ``check_args(fn, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, cu_seqlens_k, max_seqlen_k)`` and
    ``check_buffers(fn, q, v, output, output_scale, output_block_scale)`` raise on bad input;
    ``config_class(max_seqlen, max_seqlen_k)`` is the (small int) class that picks the configuration;
    ``compile_kernel(q, k, v, o, packed, output_scale, scale_bytes, cu_seqlens, cu_seqlens_k, cls, causal)``
    returns the compiled kernel, called as ``kernel(q, k, v, o, packed, scale_bytes, output_scale, softmax_scale,
    cu_seqlens, cu_seqlens_k[, max(max_seqlen, 1)])`` (the last with ``max_seqlen_arg``)."""

    def __init__(self, fn: str, *, check_args: Callable, check_buffers: Callable, config_class: Callable,
                 compile_kernel: Callable, max_seqlen_arg: bool) -> None:
        self.fn = fn
        self._check_args, self._check_buffers = check_args, check_buffers
        self._config_class, self._compile = config_class, compile_kernel
        self._max_seqlen_arg = max_seqlen_arg
        self._plans: dict[tuple, _FusedPlan] = {}
        self._lock = threading.Lock()

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, softmax_scale: float,
                 causal: bool, output: Tensor, output_scale: Tensor, output_block_scale: Tensor,
                 cu_seqlens_k: Tensor | None = None, max_seqlen_k: int | None = None) -> None:
        plan = None
        try:
            t = q.shape[0]
            if _scalars_ok(t, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, cu_seqlens_k, max_seqlen_k):
                cls = self._config_class(max_seqlen, max_seqlen_k)
                plan = self._plans.get(_fused_key(q, k, v, cu_seqlens, cu_seqlens_k, causal, cls, output,
                                                  output_scale, output_block_scale))
                if plan is not None and not (
                    output.numel() == t * plan.row_bytes
                    and output_block_scale.numel() * plan.sf_itemsize == -(-t // 128) * 128 * plan.sf_cols
                    and output.is_contiguous() and output_block_scale.is_contiguous()
                    and not (q.data_ptr() | k.data_ptr() | v.data_ptr() | output.data_ptr()) & 15
                ):
                    plan = None
        except (AttributeError, TypeError, ValueError):  # not tensors / not 3-D: the checked path says what
            plan = None
        if plan is None:
            self._checked(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, output, output_scale,
                          output_block_scale, cu_seqlens_k, max_seqlen_k)
            return
        self._launch(plan, t, q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, output_scale,
                     output_block_scale, cu_seqlens if cu_seqlens_k is None else cu_seqlens_k)

    @staticmethod
    def _launch(plan, t, q, k, v, cu, max_seqlen, softmax_scale, output, output_scale, sf, cu_k):
        packed = output if plan.output_as_is else output.view(torch.uint8).view(t, -1)
        scale_bytes = sf if plan.sf_as_is else common.scale_bytes_of(sf)
        o = q if plan.dv_slice is None else q[..., :plan.dv_slice]
        if plan.max_seqlen_arg:
            plan.kernel(q, k, v, o, packed, scale_bytes, output_scale, softmax_scale, cu, cu_k, max(max_seqlen, 1))
        else:
            plan.kernel(q, k, v, o, packed, scale_bytes, output_scale, softmax_scale, cu, cu_k)
        _padding(scale_bytes, t, plan.width)

    def _checked(self, q, k, v, cu, max_seqlen, softmax_scale, causal, output, output_scale, sf, cu_seqlens_k,
                 max_seqlen_k) -> None:
        self._check_args(self.fn, q, k, v, cu, max_seqlen, softmax_scale, causal, cu_seqlens_k, max_seqlen_k)
        self._check_buffers(self.fn, q, v, output, output_scale, sf)
        t, h, d = q.shape
        if t == 0:
            return
        dv = v.shape[2]
        scale_bytes = common.scale_bytes_of(sf)
        packed = output.view(torch.uint8).view(t, -1)
        cu_k = cu if cu_seqlens_k is None else cu_seqlens_k
        o = common.unused_o(q, dv)
        cls = self._config_class(max_seqlen, max_seqlen_k)
        kernel = self._compile(q, k, v, o, packed, output_scale, scale_bytes, cu, cu_k, cls, causal)
        if common.is_fake_mode():  # compile-only checks
            return
        blocks = h * dv // 16
        plan = _FusedPlan(kernel, h * dv // 2, -(-blocks // 4) * 4, sf.element_size(), h * dv,
                          output.dtype == torch.uint8 and output.dim() == 2, sf.dtype == torch.uint8 and sf.dim() == 1,
                          None if d == dv else dv, self._max_seqlen_arg)
        self._launch(plan, t, q, k, v, cu, max_seqlen, float(softmax_scale), output, output_scale, sf, cu_k)
        if type(causal) is bool and type(max_seqlen) is int:
            key = _fused_key(q, k, v, cu, cu_seqlens_k, causal, cls, output, output_scale, sf)
            with self._lock:
                self._plans[key] = plan


class TwinLauncher:
    """FA4's forward in the query dtype with the fused kernel's configuration (the twin), same per-call path.

    ``compile_kernel(q, k, v, out, lse, cu_seqlens, cu_seqlens_k, cls, causal)`` returns the compiled kernel,
    called as ``kernel(q, k, v, out, lse, softmax_scale, cu_seqlens, cu_seqlens_k[, max(max_seqlen, 1)])``;
    ``lse`` is None or float32 ``[H, T]``."""

    def __init__(self, fn: str, *, check_args: Callable, config_class: Callable, compile_kernel: Callable,
                 max_seqlen_arg: bool) -> None:
        self.fn = fn
        self._check_args, self._config_class, self._compile = check_args, config_class, compile_kernel
        self._max_seqlen_arg = max_seqlen_arg
        self._plans: dict[tuple, _TwinPlan] = {}
        self._lock = threading.Lock()

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, softmax_scale: float,
                 causal: bool, cu_seqlens_k: Tensor | None = None, max_seqlen_k: int | None = None,
                 return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        plan = None
        try:
            t = q.shape[0]
            if (type(return_lse) is bool and
                    _scalars_ok(t, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, cu_seqlens_k, max_seqlen_k)):
                cls = self._config_class(max_seqlen, max_seqlen_k)
                plan = self._plans.get(_qkv_key(q, k, v, cu_seqlens, cu_seqlens_k, causal, cls) + (return_lse,))
                if plan is not None and (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
                    plan = None
        except (AttributeError, TypeError, ValueError):
            plan = None
        if plan is None:
            return self._checked(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, cu_seqlens_k, max_seqlen_k,
                                 return_lse)
        return self._launch(plan, t, q, k, v, cu_seqlens, max_seqlen, softmax_scale,
                            cu_seqlens if cu_seqlens_k is None else cu_seqlens_k, return_lse)

    @staticmethod
    def _launch(plan, t, q, k, v, cu, max_seqlen, softmax_scale, cu_k, return_lse):
        out = q.new_empty((t, q.shape[1], plan.dv))
        lse = q.new_empty((q.shape[1], t), dtype=torch.float32) if return_lse else None
        if plan.max_seqlen_arg:
            plan.kernel(q, k, v, out, lse, softmax_scale, cu, cu_k, max(max_seqlen, 1))
        else:
            plan.kernel(q, k, v, out, lse, softmax_scale, cu, cu_k)
        return (out, lse.t()) if return_lse else out

    def _checked(self, q, k, v, cu, max_seqlen, softmax_scale, causal, cu_seqlens_k, max_seqlen_k, return_lse):
        self._check_args(self.fn, q, k, v, cu, max_seqlen, softmax_scale, causal, cu_seqlens_k, max_seqlen_k)
        if not isinstance(return_lse, bool):
            raise ArgumentError(f"{self.fn}: return_lse must be a bool, got {return_lse!r}")
        t, h, _ = q.shape
        dv = v.shape[2]
        out = torch.empty((t, h, dv), dtype=q.dtype, device=q.device)
        lse = torch.empty((h, t), dtype=torch.float32, device=q.device) if return_lse else None
        if t == 0:
            return (out, lse.t()) if return_lse else out
        cu_k = cu if cu_seqlens_k is None else cu_seqlens_k
        cls = self._config_class(max_seqlen, max_seqlen_k)
        kernel = self._compile(q, k, v, out, lse, cu, cu_k, cls, causal)
        if common.is_fake_mode():
            return (out, lse.t()) if return_lse else out
        plan = _TwinPlan(kernel, dv, self._max_seqlen_arg)
        result = self._launch(plan, t, q, k, v, cu, max_seqlen, float(softmax_scale), cu_k, return_lse)
        if type(causal) is bool and type(max_seqlen) is int:
            key = _qkv_key(q, k, v, cu, cu_seqlens_k, causal, cls) + (return_lse,)
            with self._lock:
                self._plans[key] = plan
        return result


# ---------------------------------------------------------------------------
# paged KV cache
# ---------------------------------------------------------------------------


def _paged_key(q, k, v, cu, seqused_k, page_table, causal, cls):
    """What a paged plan depends on: as :func:`_qkv_key`, with the caches' page size, heads and head dims and
    strides (the page count is a run-time value), and the types of ``seqused_k`` and ``page_table``."""
    _, h, d = q.shape
    return (type(q), type(k), type(v), q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, h, d,
            tuple(k.shape[1:]), tuple(v.shape[1:]), q.stride(), k.stride(), v.stride(), type(cu), cu.dtype, cu.device,
            cu.stride(), type(seqused_k), seqused_k.dtype, seqused_k.device, type(page_table), page_table.dtype,
            page_table.device, causal, cls)


def _paged_fused_key(q, k, v, cu, seqused_k, page_table, causal, cls, output, output_scale, sf):
    return _paged_key(q, k, v, cu, seqused_k, page_table, causal, cls) + (
        type(output), output.dtype, output.device, output.stride(), type(output_scale), output_scale.dtype,
        output_scale.device, output_scale.shape, type(sf), sf.dtype, sf.device, sf.stride())


def _paged_scalars_ok(t, k, v, cu, max_seqlen, seqused_k, page_table, max_seqlen_k, softmax_scale, causal) -> bool:
    """What the paged key does not fix (the checked path checks all of it again)."""
    b = cu.numel() - 1
    return (t > 0 and b >= 1 and 0 < k.shape[0] == v.shape[0] and seqused_k.dim() == 1
            and seqused_k.numel() == b and seqused_k.stride(0) == 1 and page_table.dim() == 2
            and page_table.shape[0] == b and page_table.shape[1] > 0 and page_table.stride(1) == 1
            and type(max_seqlen) is int and max_seqlen >= 0 and type(max_seqlen_k) is int
            and 0 <= max_seqlen_k <= page_table.shape[1] * k.shape[1]
            and type(softmax_scale) is float and 0.0 < softmax_scale < _INF and type(causal) is bool)


def _paged_tail(plan, max_seqlen: int, seqused_k: Tensor, page_table: Tensor) -> tuple:
    """The kernel's arguments after ``cu_seqlens``: no ``cu_seqlens_k``, ``max(max_seqlen, 1)`` where the kernel
    takes it (SM100), then ``seqused_k`` and ``page_table``."""
    if plan.max_seqlen_arg:
        return None, max(max_seqlen, 1), seqused_k, page_table
    return None, seqused_k, page_table


class PagedFusedLauncher:
    """The fused NVFP4 call of one generation on a paged KV cache (module docstring).

    ``check_args(fn, q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k,
    softmax_scale, causal)`` and ``check_buffers(fn, q, v_cache, output, output_scale, output_block_scale)`` raise
    on bad input; ``config_class(max_seqlen, max_seqlen_k)`` picks the configuration;
    ``compile_kernel(q, k_cache, v_cache, o, packed, output_scale, scale_bytes, cu_seqlens, seqused_k, page_table,
    cls, causal)`` returns the compiled kernel, called as ``kernel(q, k_cache, v_cache, o, packed, scale_bytes,
    output_scale, softmax_scale, cu_seqlens, None[, max(max_seqlen, 1)], seqused_k, page_table)`` (the
    ``max_seqlen`` with ``max_seqlen_arg``)."""

    def __init__(self, fn: str, *, check_args: Callable, check_buffers: Callable, config_class: Callable,
                 compile_kernel: Callable, max_seqlen_arg: bool) -> None:
        self.fn = fn
        self._check_args, self._check_buffers = check_args, check_buffers
        self._config_class, self._compile = config_class, compile_kernel
        self._max_seqlen_arg = max_seqlen_arg
        self._plans: dict[tuple, _FusedPlan] = {}
        self._lock = threading.Lock()

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                 seqused_k: Tensor, page_table: Tensor, max_seqlen_k: int, softmax_scale: float, causal: bool,
                 output: Tensor, output_scale: Tensor, output_block_scale: Tensor) -> None:
        plan = None
        try:
            t = q.shape[0]
            if _paged_scalars_ok(t, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k,
                                 softmax_scale, causal):
                cls = self._config_class(max_seqlen, max_seqlen_k)
                plan = self._plans.get(_paged_fused_key(q, k_cache, v_cache, cu_seqlens, seqused_k, page_table,
                                                        causal, cls, output, output_scale, output_block_scale))
                if plan is not None and not (
                    output.numel() == t * plan.row_bytes
                    and output_block_scale.numel() * plan.sf_itemsize == -(-t // 128) * 128 * plan.sf_cols
                    and output.is_contiguous() and output_block_scale.is_contiguous()
                    and not (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr() | output.data_ptr()) & 15
                    and not page_table.data_ptr() & 3
                ):
                    plan = None
        except (AttributeError, TypeError, ValueError, IndexError):  # not tensors / wrong dims: the checked path
            plan = None
        if plan is None:
            self._checked(q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k,
                          softmax_scale, causal, output, output_scale, output_block_scale)
            return
        self._launch(plan, t, q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, softmax_scale,
                     output, output_scale, output_block_scale)

    @staticmethod
    def _launch(plan, t, q, k, v, cu, max_seqlen, seqused_k, page_table, softmax_scale, output, output_scale, sf):
        packed = output if plan.output_as_is else output.view(torch.uint8).view(t, -1)
        scale_bytes = sf if plan.sf_as_is else common.scale_bytes_of(sf)
        o = q if plan.dv_slice is None else q[..., :plan.dv_slice]
        plan.kernel(q, k, v, o, packed, scale_bytes, output_scale, softmax_scale, cu,
                    *_paged_tail(plan, max_seqlen, seqused_k, page_table))
        _padding(scale_bytes, t, plan.width)

    def _checked(self, q, k, v, cu, max_seqlen, seqused_k, page_table, max_seqlen_k, softmax_scale, causal, output,
                 output_scale, sf) -> None:
        self._check_args(self.fn, q, k, v, cu, max_seqlen, seqused_k, page_table, max_seqlen_k, softmax_scale,
                         causal)
        self._check_buffers(self.fn, q, v, output, output_scale, sf)
        t, h, d = q.shape
        if t == 0:
            return
        dv = v.shape[3]
        scale_bytes = common.scale_bytes_of(sf)
        packed = output.view(torch.uint8).view(t, -1)
        o = common.unused_o(q, dv)
        cls = self._config_class(max_seqlen, max_seqlen_k)
        kernel = self._compile(q, k, v, o, packed, output_scale, scale_bytes, cu, seqused_k, page_table, cls, causal)
        if common.is_fake_mode():  # compile-only checks
            return
        blocks = h * dv // 16
        plan = _FusedPlan(kernel, h * dv // 2, -(-blocks // 4) * 4, sf.element_size(), h * dv,
                          output.dtype == torch.uint8 and output.dim() == 2, sf.dtype == torch.uint8 and sf.dim() == 1,
                          None if d == dv else dv, self._max_seqlen_arg)
        self._launch(plan, t, q, k, v, cu, max_seqlen, seqused_k, page_table, float(softmax_scale), output,
                     output_scale, sf)
        key = _paged_fused_key(q, k, v, cu, seqused_k, page_table, causal, cls, output, output_scale, sf)
        with self._lock:
            self._plans[key] = plan


class PagedTwinLauncher:
    """FA4's forward in the query dtype on a paged KV cache, with the fused kernel's configuration (the twin of
    :class:`PagedFusedLauncher`), same per-call path.

    ``compile_kernel(q, k_cache, v_cache, out, lse, cu_seqlens, seqused_k, page_table, cls, causal)`` returns the
    compiled kernel, called as ``kernel(q, k_cache, v_cache, out, lse, softmax_scale, cu_seqlens, None[,
    max(max_seqlen, 1)], seqused_k, page_table)``; ``lse`` is None or float32 ``[H, T]``."""

    def __init__(self, fn: str, *, check_args: Callable, config_class: Callable, compile_kernel: Callable,
                 max_seqlen_arg: bool) -> None:
        self.fn = fn
        self._check_args, self._config_class, self._compile = check_args, config_class, compile_kernel
        self._max_seqlen_arg = max_seqlen_arg
        self._plans: dict[tuple, _TwinPlan] = {}
        self._lock = threading.Lock()

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                 seqused_k: Tensor, page_table: Tensor, max_seqlen_k: int, softmax_scale: float, causal: bool,
                 return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        plan = None
        try:
            t = q.shape[0]
            if type(return_lse) is bool and _paged_scalars_ok(t, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k,
                                                              page_table, max_seqlen_k, softmax_scale, causal):
                cls = self._config_class(max_seqlen, max_seqlen_k)
                plan = self._plans.get(_paged_key(q, k_cache, v_cache, cu_seqlens, seqused_k, page_table, causal, cls)
                                       + (return_lse,))
                if plan is not None and ((q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()) & 15
                                         or page_table.data_ptr() & 3):
                    plan = None
        except (AttributeError, TypeError, ValueError, IndexError):
            plan = None
        if plan is None:
            return self._checked(q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k,
                                 softmax_scale, causal, return_lse)
        return self._launch(plan, t, q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table,
                            softmax_scale, return_lse)

    @staticmethod
    def _launch(plan, t, q, k, v, cu, max_seqlen, seqused_k, page_table, softmax_scale, return_lse):
        out = q.new_empty((t, q.shape[1], plan.dv))
        lse = q.new_empty((q.shape[1], t), dtype=torch.float32) if return_lse else None
        plan.kernel(q, k, v, out, lse, softmax_scale, cu, *_paged_tail(plan, max_seqlen, seqused_k, page_table))
        return (out, lse.t()) if return_lse else out

    def _checked(self, q, k, v, cu, max_seqlen, seqused_k, page_table, max_seqlen_k, softmax_scale, causal,
                 return_lse):
        self._check_args(self.fn, q, k, v, cu, max_seqlen, seqused_k, page_table, max_seqlen_k, softmax_scale,
                         causal)
        if not isinstance(return_lse, bool):
            raise ArgumentError(f"{self.fn}: return_lse must be a bool, got {return_lse!r}")
        t, h, _ = q.shape
        dv = v.shape[3]
        out = torch.empty((t, h, dv), dtype=q.dtype, device=q.device)
        lse = torch.empty((h, t), dtype=torch.float32, device=q.device) if return_lse else None
        if t == 0:
            return (out, lse.t()) if return_lse else out
        cls = self._config_class(max_seqlen, max_seqlen_k)
        kernel = self._compile(q, k, v, out, lse, cu, seqused_k, page_table, cls, causal)
        if common.is_fake_mode():
            return (out, lse.t()) if return_lse else out
        plan = _TwinPlan(kernel, dv, self._max_seqlen_arg)
        result = self._launch(plan, t, q, k, v, cu, max_seqlen, seqused_k, page_table, float(softmax_scale),
                              return_lse)
        key = _paged_key(q, k, v, cu, seqused_k, page_table, causal, cls) + (return_lse,)
        with self._lock:
            self._plans[key] = plan
        return result
