"""What a fused backend is: the kernels a layer's fused NVFP4 call runs on, and how to ask whether it can.

A backend supplies kernels; it never calls back up into the run time. The row plan
(:mod:`fusion_pass.runtime.row_plan`) decides which rows it writes and calls its three kernels: the fused
attention of a run of prefills (:meth:`Backend.run_varlen`), and for a context beyond the workspace bound a
partial attention with its log-sum-exp (:meth:`Backend.attention_lse`) and the NVFP4 merge
(:meth:`Backend.merge_nvfp4`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from fusion_pass.kernels import launchers

__all__ = ["Backend", "HALF_DTYPES", "KernelBackend", "check_device_dtype", "fuses"]

HALF_DTYPES = (torch.float16, torch.bfloat16)


@runtime_checkable
class Backend(Protocol):
    """What the guard and the row plan need from a fused backend.

    ``name`` is its name in the selection order; ``handles_context`` says whether :meth:`run_varlen` takes
    keys of cached context + new tokens (``cu_seqlens_k``), i.e. whether it runs chunked prefills and
    prefix-cache hits."""

    name: str
    handles_context: bool
    # optional ``kv_dtype``: the dtype the row plan gives keys and values in (default: the query's)
    # optional self-check (:mod:`fusion_pass.runtime.self_check`): ``self_check_needed(device) -> (bool, why)``
    # and ``canary(device, dtype, num_heads, qk_head_dim, v_head_dim) -> (passed, detail)``

    def available(self) -> tuple[bool, str]:
        """``(True, short description)`` or ``(False, why not)``; cached per process."""
        ...

    def fast_on(self, device: torch.device) -> tuple[bool, str]:
        """Whether ``auto`` may pick this backend on ``device``: ``(True, why)`` where this project measured it
        faster than the unfused path a user has on that GPU generation (or it is the kernel built for it),
        else ``(False, why not)``. A backend named explicitly runs regardless."""
        ...

    def supports(
        self, device: torch.device, dtype: torch.dtype, num_heads: int, qk_head_dim: int, v_head_dim: int
    ) -> tuple[bool, str]:
        """Whether this backend can run a layer of these dims on ``device`` with query ``dtype``."""
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


def check_device_dtype(name: str, device: torch.device, dtype: torch.dtype, dtypes) -> tuple[bool, str]:
    if torch.device(device).type != "cuda":
        return False, f"{name} runs on CUDA devices only, got {torch.device(device)}"
    if dtype not in dtypes:
        return False, f"{name} supports {', '.join(str(d) for d in dtypes)} queries, got {dtype}"
    return True, "ok"


def fuses(backend: Backend, context_len: int) -> bool:
    """Whether ``backend``'s fused kernel writes a prefill with ``context_len`` cached tokens: always without
    context, with context when the backend runs prefills with context (``handles_context``)."""
    return context_len == 0 or getattr(backend, "handles_context", False)


class KernelBackend:
    """The chunked-context kernels of a backend, by kernel family (:mod:`fusion_pass.kernels.launchers`):
    :meth:`attention_lse` runs ``lse_kernel``'s attention with its log-sum-exp, :meth:`merge_nvfp4`
    ``merge_kernel``'s NVFP4 merge. Subclasses set the two names and supply ``run_varlen``."""

    lse_kernel: str
    merge_kernel: str

    def attention_lse(self, q, k, v, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k, softmax_scale, causal):
        return launchers.attention_with_lse_varlen(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                                   cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k,
                                                   softmax_scale=softmax_scale, causal=causal, backend=self.lse_kernel)

    def merge_nvfp4(self, out_a, lse_a, out_b, lse_b, output_scale, packed, scales, row_start) -> None:
        launchers.merge_nvfp4_rows(self.merge_kernel, out_a, lse_a, out_b, lse_b, output_scale, packed, scales,
                                   row_start)
