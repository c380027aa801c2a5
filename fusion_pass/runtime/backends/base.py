"""What a fused backend is: the kernels a layer's fused NVFP4 call runs on, and how to ask whether it can.

A backend supplies kernels; it never calls back up into the run time. The row plan
(:mod:`fusion_pass.runtime.row_plan`) decides which rows it writes and calls its three kernels: the fused
attention of a run of prefills (:meth:`Backend.run_varlen`), and for a context beyond the workspace bound a
partial attention with its log-sum-exp (:meth:`Backend.attention_lse`) and the NVFP4 merge
(:meth:`Backend.merge_nvfp4`). A backend with ``handles_paged`` also runs a whole call, decode rows included, in
one launch over a paged KV cache (:meth:`Backend.run_paged`).

Which output formats a backend writes, and by which launches, is its ``formats`` attribute (:func:`writes`): every
backend writes NVFP4 (:meth:`Backend.run_varlen`, the merge, the paged launch); ``reference`` and ``triton`` (and
``fa4`` where its GPU generation lists them) also write static per-tensor FP8 (:meth:`run_varlen_fp8_static`) and the
two FP8 128-column group formats (:meth:`run_varlen_fp8_group`), by the varlen launch and the merge (the context
beyond the workspace bound by :meth:`attention_lse` in chunks, merged in float32 and quantized by the format's row
writer), no paged launch yet: :data:`FP8_WRITER`.

What the rest of the run time needs to know of a backend is an attribute or a method of it (never a comparison of
its name): the table of backends is :mod:`.registry`.
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch
from torch import Tensor

from fusion_pass.formats import FP8_GROUP128, FP8_GROUP128_UE8M0, FP8_STATIC, NVFP4, OutputFormat

__all__ = ["Backend", "FP8_GROUP_FORMATS", "FP8_STATIC_WRITER", "FP8_WRITER", "HALF_DTYPES", "KernelBackend",
           "LAUNCHES", "NVFP4_ONLY", "check_device_dtype", "format_refusal", "fp8_group_refusal", "fused_prefills",
           "fuses", "writes"]

HALF_DTYPES = (torch.float16, torch.bfloat16)

LAUNCHES = ("varlen", "merge", "paged")
"""A backend's launches that write a format: ``varlen`` (the fused attention of a run of prefills, with cached context
within the workspace bound), ``merge`` (context beyond the bound: partial attentions merged into the format),
``paged`` (a whole call over a paged KV cache)."""

NVFP4_ONLY = {NVFP4.name: frozenset(LAUNCHES)}
"""The ``formats`` of a backend that says nothing: NVFP4 by every launch it has (the paged one only with
``handles_paged``)."""

FP8_STATIC_WRITER = {**NVFP4_ONLY, FP8_STATIC.name: frozenset({"varlen", "merge"})}
"""NVFP4 by every launch, and static per-tensor FP8 by the varlen launch (:meth:`Backend.run_varlen_fp8_static`) and
the merge (:meth:`Backend.attention_lse`'s chunks merged and quantized by the row writer)."""

FP8_GROUP_FORMATS = (FP8_GROUP128, FP8_GROUP128_UE8M0)
"""The FP8 128-column group formats (float32 scales, plain or UE8M0), both written by ``run_varlen_fp8_group``."""

FP8_WRITER = {**FP8_STATIC_WRITER, **{f.name: frozenset({"varlen", "merge"}) for f in FP8_GROUP_FORMATS}}
""":data:`FP8_STATIC_WRITER` and both FP8 group formats by the varlen launch (``run_varlen_fp8_group``, its arguments
in :class:`Backend`'s list of optional members) and the merge."""


@runtime_checkable
class Backend(Protocol):
    """What the guard and the row plan need from a fused backend.

    ``name`` is its name in the selection order (and a value of the backend setting); ``handles_context`` says
    whether :meth:`run_varlen` takes keys of cached context + new tokens (``cu_seqlens_k``), i.e. whether it runs
    chunked prefills and prefix-cache hits. ``handles_paged`` (optional, default False) says whether it has
    :meth:`run_paged`. ``timed``: whether ``fusion-pass selftest`` times it against the unfused path (a fast
    path, not an oracle)."""

    name: str
    handles_context: bool
    timed: bool
    # optional ``half_attention(q, k, v, cu_seqlens, max_seqlen, softmax_scale) -> [T, H, Dv]``: causal attention
    # in the query dtype with the main loop of its fused kernel, which computes the unfused path of a pure-prefill
    # call on CUDA (None or absent: the layer's PyTorch runtime computes it)
    # optional ``kv_dtype``: the dtype the row plan gives keys and values in (default: the query's)
    # optional ``formats``: ``{format name: launches}`` it writes (:func:`writes`; default :data:`NVFP4_ONLY`), with
    # a varlen launch for each format but NVFP4 it lists, both writing rows ``[cu_seqlens[0], cu_seqlens[-1])`` of
    # ``output`` (float8_e4m3fn ``[T, H*Dv]``) and no other byte, sequences and keys as :meth:`run_varlen`'s:
    # ``run_varlen_fp8_static(q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, scale, *, cu_seqlens_k=None,
    # max_seqlen_k=None, scale_is_inverse=False, nan=NaNRule.POSITIVE_MAX)`` (``scale`` float32 ``[1]``) and, for
    # both group formats, ``run_varlen_fp8_group(q, k, v, cu_seqlens, max_seqlen, softmax_scale, output, scales, *,
    # cu_seqlens_k=None, max_seqlen_k=None, ue8m0=False, divide=False)`` (``scales`` float32 ``[T, H*Dv/128]`` in
    # any :class:`fusion_pass.fp8.ScaleLayout`, the same rows written, a TMA layout's padding not)
    # optional self-check (:mod:`fusion_pass.runtime.self_check`): ``self_check_needed(device) -> (bool, why)``
    # and ``canary(device, dtype, num_heads, qk_head_dim, v_head_dim) -> (passed, detail)``

    def available(self) -> tuple[bool, str]:
        """``(True, short description)`` or ``(False, why not)``; cached per process."""
        ...

    def refresh(self) -> None:
        """Forget what :meth:`available` (and the device detection behind it) cached; the next query detects
        again."""
        ...

    def fast_on(self, device: torch.device) -> tuple[bool, str]:
        """Whether ``auto`` may pick this backend on ``device``: ``(True, why)`` where this project measured it
        faster than the unfused path a user has on that GPU generation (or it is the kernel built for it),
        else ``(False, why not)``. A backend named explicitly runs regardless."""
        ...

    def supports(
        self, device: torch.device, dtype: torch.dtype, num_heads: int, qk_head_dim: int, v_head_dim: int
    ) -> tuple[bool, str]:
        """Whether this backend can run a layer of these dims on ``device`` with query ``dtype`` writing NVFP4. A
        backend that writes other formats (``formats``) also takes ``output_format=`` (a
        :class:`fusion_pass.formats.OutputFormat`) and answers for that format's kernel."""
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

    # optional, with ``handles_paged = True``:
    # def run_paged(self, q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k,
    #               softmax_scale, output, output_scale, output_block_scale) -> None
    #     Every row of a call in one fused launch over a paged KV cache: ``q [T, H, D]``; ``k_cache
    #     [num_pages, page_size, Hk, D]``, ``v_cache [num_pages, page_size, Hk, Dv]`` (unit stride on the last dim);
    #     ``cu_seqlens`` int32 ``[B+1]`` the rows of each sequence (decode rows are sequences of one row);
    #     ``seqused_k`` int32 ``[B]`` its keys, ``page_table`` int32 ``[B, max_pages]`` where they are (key ``j`` of
    #     sequence ``b`` at ``k_cache[page_table[b, j // page_size], j % page_size]``); causal, aligned to the end.
    #     Output buffers as :meth:`run_varlen`'s.

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


def check_device_dtype(name: str, device: torch.device, dtype: torch.dtype, dtypes) -> tuple[bool, str]:
    if torch.device(device).type != "cuda":
        return False, f"{name} runs on CUDA devices only, got {torch.device(device)}"
    if dtype not in dtypes:
        return False, f"{name} supports {', '.join(str(d) for d in dtypes)} queries, got {dtype}"
    return True, "ok"


def writes(backend: Backend, output_format: OutputFormat, launch: str = "varlen") -> bool:
    """Whether ``backend`` writes ``output_format`` by ``launch`` (one of :data:`LAUNCHES`): its ``formats``
    attribute, :data:`NVFP4_ONLY` when it has none."""
    return launch in getattr(backend, "formats", NVFP4_ONLY).get(output_format.name, ())


def format_refusal(backend: Backend, output_format: OutputFormat) -> str | None:
    """Why ``backend`` cannot write ``output_format`` (naming the format and what it writes), or None."""
    if writes(backend, output_format):
        return None
    written = ", ".join(sorted(getattr(backend, "formats", NVFP4_ONLY)))
    return f"{backend.name} has no {output_format.name} kernel (it writes {written})"


def fp8_group_refusal(output_format: OutputFormat, num_heads: int, v_head_dim: int) -> str | None:
    """Why a fused kernel cannot write ``output_format`` for ``num_heads`` heads of ``v_head_dim`` values when it is
    one of :data:`FP8_GROUP_FORMATS` (its :meth:`~fusion_pass.formats.OutputFormat.refusal`: a head's tile holds
    whole 128-column groups, ``v_head_dim % 128 == 0``), else None (each backend checks NVFP4 its own way; static FP8
    takes any width)."""
    return output_format.refusal(num_heads, v_head_dim) if output_format in FP8_GROUP_FORMATS else None


def fuses(backend: Backend, context_len: int) -> bool:
    """Whether ``backend``'s fused kernel writes a prefill with ``context_len`` cached tokens: always without
    context, with context when the backend runs prefills with context (``handles_context``)."""
    return context_len == 0 or getattr(backend, "handles_context", False)


def fused_prefills(backend: Backend, output_format: OutputFormat, context_lens,
                   bound: Callable[[], int]) -> list[bool]:
    """Per prefill (``context_lens``: its cached tokens, in row order), whether ``backend`` writes its rows in
    ``output_format``: those :func:`fuses` says, except that for a format the backend has no ``merge`` launch of
    (:func:`writes`) the prefills with cached context are fused only while their context adds up to at most
    ``bound()`` tokens (one key/value workspace; the context workspace bound, asked only then), and none of them
    beyond it."""
    mask = [fuses(backend, c) for c in context_lens]
    if not writes(backend, output_format, "merge") and any(c and f for c, f in zip(context_lens, mask)) \
            and sum(c for c, f in zip(context_lens, mask) if f) > bound():
        mask = [c == 0 for c in context_lens]
    return mask


class KernelBackend:
    """What the built-in backends share: no cached detection (:meth:`refresh`), not timed, no half-precision
    attention; and the chunked-context kernels by kernel family (:mod:`fusion_pass.kernels.launchers`):
    :meth:`attention_lse` runs ``lse_kernel`` (attention with its log-sum-exp), :meth:`merge_nvfp4`
    ``merge_kernel`` (the NVFP4 merge). Subclasses set the two callables (as ``staticmethod``) and supply
    ``run_varlen``."""

    timed = False
    formats = NVFP4_ONLY
    half_attention: Callable[..., Tensor] | None = None
    lse_kernel: Callable[..., tuple[Tensor, Tensor]]
    merge_kernel: Callable[..., None]

    def refresh(self) -> None:
        """Nothing cached."""

    def attention_lse(self, q, k, v, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k, softmax_scale, causal):
        return self.lse_kernel(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, cu_seqlens_k=cu_seqlens_k,
                               max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal)

    def merge_nvfp4(self, out_a, lse_a, out_b, lse_b, output_scale, packed, scales, row_start) -> None:
        self.merge_kernel(out_a, lse_a, out_b, lse_b, output_scale, packed, scales, row_start)
