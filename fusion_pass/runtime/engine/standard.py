"""Standard multi-head / grouped-query attention runtime.

Each request's keys and values are cached in pages (:class:`~fusion_pass.runtime.engine.paged_cache.PagedCache`):
``k_pages [num_pages, page_size, Hkv, D]`` and ``v_pages [num_pages, page_size, Hkv, Dv]`` in the input dtype,
with a page table per request, the layout one fused launch over every row of a call reads (:meth:`AttentionImpl.
paged_inputs`). Every request, whatever its kind, is one softmax over its cached context followed by its new
tokens, with the causal mask offset by ``context_len``: a decode token sees everything, a prefill token sees the
context and the new tokens up to itself.  (Unlike the MLA runtime there is no context/new split, so no LSE merge:
with one key/value form for both, a single softmax is the simplest exact formulation.)

All math is float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fusion_pass.kernels.host_copy import to_device
from fusion_pass.kernels.reference import dense_attention
from fusion_pass.nvfp4.checks import ArgumentError
from fusion_pass.runtime.backends.base import HALF_DTYPES
from fusion_pass.runtime.engine.batch import BatchSpec
from fusion_pass.runtime.engine.cache import CachedLayer, positive_int, positive_softmax_scale
from fusion_pass.runtime.engine.paged_cache import DEFAULT_PAGE_SIZE, PagedCache
from fusion_pass.runtime.row_plan import ContextRows

__all__ = ["AttentionImpl", "PagedInputs"]


class PagedInputs(NamedTuple):
    """What one paged launch over a call reads (``Backend.run_paged``): the layer's pages ``k_pages [num_pages,
    page_size, Hkv, D]`` and ``v_pages [num_pages, page_size, Hkv, Dv]`` (in place), ``cu_seqlens`` int32 ``[B+1]``
    (the call's rows of each request), ``seq_lens`` int32 ``[B]`` (each request's keys, new tokens included),
    ``block_table`` int32 ``[B, max_pages]`` (each request's pages), on the call's device, and host bounds
    ``max_query_len`` / ``max_seq_len``."""

    k_pages: torch.Tensor
    v_pages: torch.Tensor
    cu_seqlens: torch.Tensor
    max_query_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_seq_len: int


class AttentionImpl(CachedLayer):
    """MHA/GQA attention for one layer, with its paged KV cache.

    Args:
        num_heads: query heads ``H``.
        num_kv_heads: key/value heads ``Hkv`` (``H % Hkv == 0``).
        head_dim: ``D`` of q and k.
        v_head_dim: ``Dv`` of v (default ``head_dim``).
        softmax_scale: scale of ``q . k``.
        page_size: slots per page of the KV cache (default 16, vLLM's block size).
    """

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int | None = None,
        softmax_scale: float,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> None:
        owner = "AttentionImpl"
        self.num_heads = positive_int(owner, "num_heads", num_heads)
        self.num_kv_heads = positive_int(owner, "num_kv_heads", num_kv_heads)
        if self.num_heads % self.num_kv_heads != 0:
            raise ArgumentError(f"{owner}: num_heads={self.num_heads} must be a multiple of "
                                f"num_kv_heads={self.num_kv_heads}")
        self.head_dim = positive_int(owner, "head_dim", head_dim)
        self.v_head_dim = self.head_dim if v_head_dim is None else positive_int(owner, "v_head_dim", v_head_dim)
        self.softmax_scale = positive_softmax_scale(owner, softmax_scale)
        self.cache = PagedCache(positive_int(owner, "page_size", page_size))

    @property
    def page_size(self) -> int:
        """Slots per page of the layer's KV cache."""
        return self.cache.page_size

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: BatchSpec) -> torch.Tensor:
        """Attention for the batch ``spec``; appends the new keys/values to the cache.

        Args:
            q: ``[T, H, D]`` (``T = spec.num_tokens``, tokens in the spec's order).
            k: ``[T, Hkv, D]``.
            v: ``[T, Hkv, Dv]``.

        Returns:
            float32 ``[T, H, Dv]``.
        """
        self.check_inputs(q, k, v, spec)  # before any entry changes
        t = spec.num_tokens
        out = torch.empty(t, self.num_heads, self.v_head_dim, dtype=torch.float32, device=q.device)
        locs = spec.query_start_loc()
        entries = self.cache.extend_many(spec.requests, (k, v))
        for req, entry, start, end in zip(spec.requests, entries, locs[:-1], locs[1:]):
            k_all, v_all = self.cache.read(entry)
            out[start:end], _ = dense_attention(
                q[start:end], k_all, v_all, scale=self.softmax_scale, causal=True, q_offset=req.context_len
            )
        return out

    __call__ = forward

    def prefill_qkv(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: BatchSpec, kv_dtype: torch.dtype | None = None,
        *, check: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ContextRows]:
        """Dense inputs of a varlen flash-attention kernel for a batch of prefills (no decode rows), appending
        the new keys and values to the cache as :meth:`forward` does.

        Returns ``q`` and ``k``, ``v`` in ``kv_dtype`` (default q's dtype: the kernels take one dtype; the
        reference backend asks for float32) with unit stride along the head dim (the kernels' layout; the
        runtime accepts any float inputs), and the prefills' cached context as
        :data:`~fusion_pass.runtime.row_plan.ContextRows` read from the pages (the tokens below each
        ``context_len``, which appending never writes).
        """
        if spec.num_decode_tokens != 0:
            raise ValueError(f"prefill_qkv takes prefills only; got a {spec.kind!r} batch")
        if check:  # ``check=False``: the caller checked these very inputs against ``spec`` (the attention op)
            self.check_inputs(q, k, v, spec)  # side-effect free: before the cache changes
        entries = self.cache.extend_many(spec.requests, (k, v))
        parts = [(entry, req.context_len) for entry, req in zip(entries, spec.requests)]
        dtype = q.dtype if kv_dtype is None else kv_dtype
        q = q if q.stride(-1) == 1 else q.contiguous()
        k, v = (x.to(dtype).contiguous() if x.dtype != dtype or x.stride(-1) != 1 else x for x in (k, v))

        def context(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
            k_rows, v_rows = self.cache.gather(parts, lo, hi)
            return k_rows.to(dtype), v_rows.to(dtype)

        return q, k, v, context

    def paged_refusal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: BatchSpec) -> str | None:
        """Why the call's rows cannot be one launch over the layer's pages (:meth:`paged_inputs`), or None: the
        launch reads queries and pages of one half dtype (float16 / bfloat16), so the queries, the new keys and
        values and every cached context the call reads must be in it. Reads only."""
        if q.dtype not in HALF_DTYPES:
            return f"the paged launch takes float16 or bfloat16 queries, got {q.dtype}"
        if k.dtype != q.dtype or v.dtype != q.dtype:
            return (f"keys / values in {k.dtype} / {v.dtype} beside {q.dtype} queries: the pages hold them as given "
                    f"and the paged launch reads one dtype")
        for r in spec.requests:
            entry = self.cache.entry(r.request_id) if r.context_len else None
            if entry is not None and entry.dtypes != (q.dtype, q.dtype):
                return (f"request {r.request_id}'s cached keys / values are {entry.dtypes[0]} / {entry.dtypes[1]}, "
                        f"the queries {q.dtype}: the paged launch reads one dtype")
        return None

    def paged_inputs(self, k: torch.Tensor, v: torch.Tensor, spec: BatchSpec) -> PagedInputs:
        """Append the call's new keys ``k [T, Hkv, D]`` and values ``v [T, Hkv, Dv]`` to the pages, then what one
        launch over every row of the call reads (:class:`PagedInputs`: request ``b``'s queries are rows
        ``query_start_loc[b] .. [b+1]``, its keys its ``context_len + query_len`` cached tokens). The offsets and
        the page table go to the device without blocking the host. Checked by the caller (:meth:`check_inputs`,
        :meth:`paged_refusal` None)."""
        entries = self.cache.extend_many(spec.requests, (k, v))
        (k_pages, v_pages), table = self.cache.view(entries)
        lens = [e.length for e in entries]
        device = k.device
        return PagedInputs(k_pages, v_pages, to_device(spec.query_start_loc(), torch.int32, device),
                           max(r.query_len for r in spec.requests), to_device(lens, torch.int32, device),
                           to_device(table, torch.int32, device), max(lens))

    def _check_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: BatchSpec) -> None:
        """q/k/v shapes against the layer config and ``spec.num_tokens`` (ValueError naming the argument)."""
        t = spec.num_tokens
        for name, x, shape in (
            ("q", q, (t, self.num_heads, self.head_dim)),
            ("k", k, (t, self.num_kv_heads, self.head_dim)),
            ("v", v, (t, self.num_kv_heads, self.v_head_dim)),
        ):
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"{name} must be a tensor of shape {list(shape)}, got {type(x).__name__}")
            if tuple(x.shape) != shape:
                raise ValueError(f"{name} must have shape {list(shape)}, got {tuple(x.shape)}")
            if not x.is_floating_point():
                raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
            if x.device != q.device:
                raise ValueError(f"{name} must be on q's device {q.device}, got {x.device}")

    def check_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: BatchSpec) -> None:
        """Everything :meth:`forward` checks, without side effects (ValueError naming the argument).

        q/k/v shapes against the layer and ``spec.num_tokens``, dtypes and
        devices, and the cache against the batch (each request's cached length
        equals its ``context_len``). A call that passes does not fail on its
        arguments in :meth:`forward`; one that fails has changed nothing.
        """
        self._check_inputs(q, k, v, spec)
        self.cache.check(spec, device=q.device)
