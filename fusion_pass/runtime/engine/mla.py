"""Multi-head latent attention (DeepSeek-V2/V3) runtime.

Per token the cache holds one latent row ``[kv_lora_rank + qk_rope_head_dim]``:
the normalised compressed kv (``kv_c_normed``) followed by the rotary key part
shared by all heads (``k_pe``).  ``kv_b_proj`` expands the latent into the
per-head ``k_nope`` (rows ``W_UK``) and ``v`` (rows ``W_UV``).

Requests are computed the way vLLM's MLA backends compute them:

* decode (``query_len == 1``): the absorbed, MQA form.  ``q_nope`` is mapped
  through ``W_UK`` into latent space, attention runs over the cached latent
  rows directly (one shared "kv head"), and the latent output is mapped through
  ``W_UV``.  The cache is never expanded.
* prefill: ``k_nope``/``v`` are expanded from the new tokens' latents, causal
  attention over the new tokens.
* prefill with cached context (chunked prefill): as prefill, plus a
  non-causal attention over the expanded context rows; the two are merged by
  log-sum-exp.

All math is float32; the cache keeps the input dtype.
"""

from __future__ import annotations

import torch

from fusion_pass.nvfp4.checks import ArgumentError
from fusion_pass.runtime.engine.batch import BatchSpec
from fusion_pass.runtime.engine.cache import (CachedLayer, RequestCache, packed_rows, positive_int,
                                              positive_softmax_scale)
from fusion_pass.runtime.row_plan import ContextRows
from fusion_pass.kernels.reference import dense_attention, merge_attention

__all__ = ["MLAAttentionImpl"]



class MLAAttentionImpl(CachedLayer):
    """MLA attention for one layer, with its per-request latent cache.

    Args:
        num_heads: query heads ``H`` (of this rank).
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank: the MLA
            dims (``nope``, ``rope``, ``v``, ``L``).
        kv_b_proj_weight: ``kv_b_proj``'s ``nn.Linear`` weight,
            ``[H * (nope + v), L]``; per head the first ``nope`` rows are
            ``W_UK``, the next ``v`` rows ``W_UV``.  Held by reference (a module
            owning the parameter shares it), read in float32 at each forward.
        softmax_scale: scale of ``q . k`` (the same for every path).
    """

    def __init__(
        self,
        *,
        num_heads: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_lora_rank: int,
        kv_b_proj_weight: torch.Tensor,
        softmax_scale: float,
    ) -> None:
        owner = "MLAAttentionImpl"
        self.num_heads = positive_int(owner, "num_heads", num_heads)
        self.qk_nope_head_dim = positive_int(owner, "qk_nope_head_dim", qk_nope_head_dim)
        self.qk_rope_head_dim = positive_int(owner, "qk_rope_head_dim", qk_rope_head_dim)
        self.v_head_dim = positive_int(owner, "v_head_dim", v_head_dim)
        self.kv_lora_rank = positive_int(owner, "kv_lora_rank", kv_lora_rank)
        expected = (self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)
        if not isinstance(kv_b_proj_weight, torch.Tensor) or tuple(kv_b_proj_weight.shape) != expected:
            got = (tuple(kv_b_proj_weight.shape) if isinstance(kv_b_proj_weight, torch.Tensor)
                   else f"{type(kv_b_proj_weight).__name__} {kv_b_proj_weight!r}")
            raise ArgumentError(
                f"{owner}: kv_b_proj_weight must be a tensor of shape [num_heads * (qk_nope_head_dim + v_head_dim), "
                f"kv_lora_rank] = {list(expected)}, got {got}"
            )
        self.kv_b_proj_weight = kv_b_proj_weight
        self.softmax_scale = positive_softmax_scale(owner, softmax_scale)
        self.cache = RequestCache()

    # -- forward -------------------------------------------------------------

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``W_UK [H, nope, L]`` and ``W_UV [H, v, L]``."""
        w = self.kv_b_proj_weight.detach().float()
        w = w.reshape(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def _check_inputs(
        self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, spec: BatchSpec
    ) -> torch.Tensor:
        """Validate shapes; return ``k_pe`` as ``[T, rope]``."""
        t, h = spec.num_tokens, self.num_heads
        nope, rope, lora = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        for name, x in (("q", q), ("kv_c_normed", kv_c_normed), ("k_pe", k_pe)):
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
            if not x.is_floating_point():
                raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
            if x.device != q.device:
                raise ValueError(f"{name} must be on q's device {q.device}, got {x.device}")
        if tuple(q.shape) != (t, h, nope + rope):
            raise ValueError(f"q must have shape [T, H, nope + rope] = {[t, h, nope + rope]}, got {tuple(q.shape)}")
        if tuple(kv_c_normed.shape) != (t, lora):
            raise ValueError(
                f"kv_c_normed must have shape [T, kv_lora_rank] = {[t, lora]}, got {tuple(kv_c_normed.shape)}"
            )
        if tuple(k_pe.shape) not in ((t, 1, rope), (t, rope)):
            raise ValueError(
                f"k_pe must have shape [T, 1, rope] = {[t, 1, rope]} or [T, rope], got {tuple(k_pe.shape)}"
            )
        if k_pe.dtype != kv_c_normed.dtype:
            raise ValueError(f"k_pe dtype {k_pe.dtype} != kv_c_normed dtype {kv_c_normed.dtype} (one latent cache)")
        return k_pe.reshape(t, rope)

    def check_inputs(
        self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, spec: BatchSpec
    ) -> None:
        """Everything :meth:`forward` checks, without side effects (ValueError naming the argument).

        q/kv_c_normed/k_pe shapes against the layer and ``spec.num_tokens``,
        dtypes and devices (``kv_b_proj``'s weight included), and the cache
        against the batch (each request's cached length equals its
        ``context_len``). A call that passes does not fail on its arguments in
        :meth:`forward`; one that fails has changed nothing.
        """
        self._check_inputs(q, kv_c_normed, k_pe, spec)
        if self.kv_b_proj_weight.device != q.device:
            raise ValueError(
                f"q is on {q.device} but the layer's kv_b_proj weight is on {self.kv_b_proj_weight.device}"
            )
        self.cache.check(spec, device=q.device)

    def expand(self, latent: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor):
        """Latent rows ``[S, L + rope]`` -> float32 k ``[S, H, nope + rope]``, v ``[S, H, v]``."""
        kv_c = latent[:, : self.kv_lora_rank].float()
        k_pe = latent[:, self.kv_lora_rank :].float()
        k_nope = torch.einsum("sl,hnl->shn", kv_c, w_uk)
        v = torch.einsum("sl,hvl->shv", kv_c, w_uv)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, self.num_heads, -1)], dim=-1)
        return k, v

    def prefill_qkv(
        self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, spec: BatchSpec,
        kv_dtype: torch.dtype | None = None, *, check: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ContextRows]:
        """Dense inputs of a varlen flash-attention kernel for a batch of prefills (no decode rows), appending
        the new latents to the cache as :meth:`forward` does.

        Returns ``q [T, H, nope + rope]`` as given, ``k [T, H, nope + rope]`` and ``v [T, H, v]`` of the new
        tokens expanded through ``kv_b_proj`` (``k_pe`` broadcast to every head, as vLLM's MLA prefill does)
        in ``kv_dtype`` (default q's dtype: the kernels take one dtype; the reference backend asks for float32), and the prefills' cached context as :data:`~fusion_pass.runtime.row_plan.ContextRows`
        (the cached latents of the rows asked for, expanded the same way; read as they were before this call).
        """
        if spec.num_decode_tokens != 0:
            raise ValueError(f"prefill_qkv takes prefills only; got a {spec.kind!r} batch")
        if check:  # ``check=False``: the caller checked these very inputs against ``spec`` (the attention op)
            self.check_inputs(q, kv_c_normed, k_pe, spec)  # side-effect free: before the cache changes
        k_pe = k_pe.reshape(spec.num_tokens, self.qk_rope_head_dim)
        latent = torch.cat([kv_c_normed, k_pe], dim=-1)  # [T, L + rope], input dtype
        locs = spec.query_start_loc()
        cached = [self.cache.extend(req, (latent[start:end],))[0][: req.context_len]
                  for req, start, end in zip(spec.requests, locs[:-1], locs[1:])]
        w_uk, w_uv = self.weights()
        dtype = q.dtype if kv_dtype is None else kv_dtype

        def expand(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            k, v = self.expand(rows, w_uk, w_uv)  # float32
            return k.to(dtype), v.to(dtype)

        k, v = expand(latent)
        return q, k, v, lambda lo, hi: expand(packed_rows(cached, lo, hi))

    def forward(
        self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, spec: BatchSpec
    ) -> torch.Tensor:
        """Attention for the batch ``spec``; appends the new latents to the cache.

        Args:
            q: ``[T, H, nope + rope]`` (``T = spec.num_tokens``, tokens in the
                spec's request order).
            kv_c_normed: ``[T, kv_lora_rank]``.
            k_pe: ``[T, 1, rope]`` or ``[T, rope]``, same dtype as ``kv_c_normed``.

        Returns:
            float32 ``[T, H, v_head_dim]``.
        """
        self.check_inputs(q, kv_c_normed, k_pe, spec)  # before any entry changes
        k_pe = k_pe.reshape(spec.num_tokens, self.qk_rope_head_dim)
        w_uk, w_uv = self.weights()
        nope, lora = self.qk_nope_head_dim, self.kv_lora_rank
        out = torch.empty(spec.num_tokens, self.num_heads, self.v_head_dim, dtype=torch.float32, device=q.device)

        locs = spec.query_start_loc()
        for req, start, end in zip(spec.requests, locs[:-1], locs[1:]):
            new_rows = torch.cat([kv_c_normed[start:end], k_pe[start:end]], dim=-1)  # input dtype
            (latent,) = self.cache.extend(req, (new_rows,), owned=True)  # [ctx + len, L + rope]
            q_r = q[start:end].float()
            if req.is_decode:
                # Absorbed form: scores in latent space against the cached rows.
                q_lat = torch.einsum("thn,hnl->thl", q_r[..., :nope], w_uk)
                q_mqa = torch.cat([q_lat, q_r[..., nope:]], dim=-1)  # [1, H, L + rope]
                keys = latent.unsqueeze(1)  # [S, 1, L + rope], one shared head
                o_lat, _ = dense_attention(
                    q_mqa, keys, keys[..., :lora], scale=self.softmax_scale, causal=False
                )
                out[start:end] = torch.einsum("thl,hvl->thv", o_lat, w_uv)
                continue
            ctx = req.context_len
            k_new, v_new = self.expand(latent[ctx:], w_uk, w_uv)
            o, lse = dense_attention(q_r, k_new, v_new, scale=self.softmax_scale, causal=True)
            if ctx > 0:
                k_ctx, v_ctx = self.expand(latent[:ctx], w_uk, w_uv)
                o_ctx, lse_ctx = dense_attention(q_r, k_ctx, v_ctx, scale=self.softmax_scale, causal=False)
                o, lse = merge_attention(o_ctx, lse_ctx, o, lse)
            out[start:end] = o
        return out

    __call__ = forward
