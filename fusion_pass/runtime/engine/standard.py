"""Standard multi-head / grouped-query attention runtime.

Each request's keys and values are cached as ``k [S, Hkv, D]`` and
``v [S, Hkv, Dv]`` in the input dtype.  Every request, whatever its kind, is
one softmax over its cached context followed by its new tokens, with the causal
mask offset by ``context_len``: a decode token sees everything, a prefill token
sees the context and the new tokens up to itself.  (Unlike the MLA runtime
there is no context/new split, so no LSE merge: with one key/value form for
both, a single softmax is the simplest exact formulation.)

All math is float32.
"""

from __future__ import annotations

import torch

from fusion_pass.nvfp4.checks import ArgumentError
from fusion_pass.runtime.engine.batch import BatchSpec
from fusion_pass.runtime.engine.cache import (CachedLayer, RequestCache, packed_rows, positive_int,
                                              positive_softmax_scale)
from fusion_pass.runtime.row_plan import ContextRows
from fusion_pass.kernels.reference import dense_attention

__all__ = ["AttentionImpl"]



class AttentionImpl(CachedLayer):
    """MHA/GQA attention for one layer, with its per-request KV cache.

    Args:
        num_heads: query heads ``H``.
        num_kv_heads: key/value heads ``Hkv`` (``H % Hkv == 0``).
        head_dim: ``D`` of q and k.
        v_head_dim: ``Dv`` of v (default ``head_dim``).
        softmax_scale: scale of ``q . k``.
    """

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int | None = None,
        softmax_scale: float,
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
        self.cache = RequestCache()

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
        for req, start, end in zip(spec.requests, locs[:-1], locs[1:]):
            k_all, v_all = self.cache.extend(req, (k[start:end], v[start:end]))
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
        :data:`~fusion_pass.runtime.row_plan.ContextRows` (read as it was before this call).
        """
        if spec.num_decode_tokens != 0:
            raise ValueError(f"prefill_qkv takes prefills only; got a {spec.kind!r} batch")
        if check:  # ``check=False``: the caller checked these very inputs against ``spec`` (the attention op)
            self.check_inputs(q, k, v, spec)  # side-effect free: before the cache changes
        locs = spec.query_start_loc()
        k_ctx, v_ctx = [], []
        for req, start, end in zip(spec.requests, locs[:-1], locs[1:]):
            k_all, v_all = self.cache.extend(req, (k[start:end], v[start:end]))
            k_ctx.append(k_all[: req.context_len])
            v_ctx.append(v_all[: req.context_len])
        dtype = q.dtype if kv_dtype is None else kv_dtype
        q = q if q.stride(-1) == 1 else q.contiguous()
        k, v = (x.to(dtype).contiguous() if x.dtype != dtype or x.stride(-1) != 1 else x for x in (k, v))
        return q, k, v, lambda lo, hi: (packed_rows(k_ctx, lo, hi).to(dtype), packed_rows(v_ctx, lo, hi).to(dtype))

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
