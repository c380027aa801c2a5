"""nn.Modules whose compiled graphs look like vLLM's: attention layers and the NVFP4 o_proj.

* :class:`NVFP4Linear`: ``scaled_fp4_quant`` -> ``nvfp4_gemm``, a weight-and-activation
  NVFP4 linear layer (vLLM's ModelOpt NVFP4 path).
* :class:`Attention`: standard MHA/GQA, calls ``fusion_pass.attention_with_output``.
* :class:`MLAAttention`: DeepSeek multi-head latent attention, calls
  ``fusion_pass.mla_attention_with_output``.

Attention layers register their runtime implementation under ``layer_name`` in
:mod:`fusion_pass.runtime`; the op finds it there at run time, as vLLM's ops find
their layer in the forward context.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fusion_pass import nvfp4, runtime
from fusion_pass.nvfp4 import ArgumentError
from fusion_pass.ops import scaled_fp4_quant

FP4_AMAX_SCALE = nvfp4.E2M1_MAX * nvfp4.E4M3_MAX  # global scale = 448 * 6 / amax


def global_scale_for(amax: float | Tensor) -> Tensor:
    """The NVFP4 global scale ``448 * 6 / amax`` as a one-element float32 tensor."""
    amax = torch.as_tensor(amax, dtype=torch.float32).reshape(1)
    if not bool(torch.isfinite(amax).all()) or float(amax) <= 0:
        raise ArgumentError(f"global_scale_for: amax must be positive and finite, got {float(amax)}")
    return FP4_AMAX_SCALE / amax


class NVFP4Linear(nn.Module):
    """``y = x @ W.T`` with W and x quantized to NVFP4 (no bias).

    Buffers: ``weight`` uint8 ``[N, K/2]``, ``weight_scale`` float8_e4m3fn
    ``[round_up(N,128), round_up(K/16,4)]`` (swizzled), ``weight_global_scale``,
    ``input_global_scale`` and ``alpha = 1 / (input_gs * weight_gs)``, all
    float32 ``[1]``. The input global scale is calibrated offline
    (:meth:`set_input_amax`); it defaults to the scale for ``amax = 1``.
    """

    def __init__(self, weight: Tensor, input_amax: float = 1.0):
        super().__init__()
        if weight.dim() != 2 or weight.shape[1] % nvfp4.BLOCK_SIZE != 0:
            raise ArgumentError(
                f"NVFP4Linear: weight must be [out_features, in_features] with in_features divisible "
                f"by 16, got {list(weight.shape)}"
            )
        if not weight.is_floating_point():
            raise ArgumentError(f"NVFP4Linear: weight must be a float tensor, got {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        w_gs = global_scale_for(weight.detach().abs().amax().float().cpu()).to(weight.device)
        packed, scales = nvfp4.quantize(weight.detach(), w_gs, swizzled=True)
        self.register_buffer("weight", packed)
        self.register_buffer("weight_scale", scales)
        self.register_buffer("weight_global_scale", w_gs)
        self.register_buffer("input_global_scale", torch.empty(1, device=weight.device))
        self.register_buffer("alpha", torch.empty(1, device=weight.device))
        self.set_input_amax(input_amax)

    @classmethod
    def from_linear(cls, linear: nn.Linear, input_amax: float = 1.0) -> "NVFP4Linear":
        if linear.bias is not None:
            raise ArgumentError("NVFP4Linear.from_linear: bias is not supported (o_proj has none)")
        return cls(linear.weight, input_amax)

    @torch.no_grad()
    def set_input_amax(self, amax: float | Tensor) -> None:
        """Calibrate the activation global scale to ``448 * 6 / amax``."""
        self.input_global_scale.copy_(global_scale_for(amax).to(self.input_global_scale.device))
        self.alpha.copy_(1.0 / (self.input_global_scale * self.weight_global_scale))

    def dequantized_weight(self) -> Tensor:
        """The weight as the GEMM sees it: float32 ``[N, K]``."""
        return nvfp4.dequantize(self.weight, self.weight_scale, self.weight_global_scale)

    def forward(self, x: Tensor) -> Tensor:
        """``x [..., K]`` (bf16/fp16) -> ``[..., N]`` in x's dtype."""
        x_2d = x.reshape(-1, self.in_features)
        x_fp4, x_scale = scaled_fp4_quant(x_2d, self.input_global_scale)
        out = torch.ops.fusion_pass.nvfp4_gemm(
            x_fp4, self.weight, x_scale, self.weight_scale, self.alpha, x.dtype
        )
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format=nvfp4"


class Attention(nn.Module):
    """Standard multi-head / grouped-query attention over the runtime's KV cache.

    ``forward(q [T, H*D], k [T, Hkv*D], v [T, Hkv*Dv]) -> [T, H*Dv]``, with the
    views vLLM's ``Attention.forward`` has around ``unified_attention_with_output``.
    """

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int, layer_name: str,
                 v_head_dim: int | None = None, softmax_scale: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.layer_name = layer_name
        self.impl = runtime.AttentionImpl(
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            v_head_dim=self.v_head_dim, softmax_scale=softmax_scale or head_dim**-0.5,
        )
        runtime.register_layer(layer_name, self.impl)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        hidden = self.num_heads * self.v_head_dim
        output = torch.empty((q.shape[0], hidden), dtype=q.dtype, device=q.device)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.v_head_dim)
        output = output.view(-1, self.num_heads, self.v_head_dim)
        torch.ops.fusion_pass.attention_with_output(q, k, v, output, self.layer_name)
        return output.view(-1, hidden)


class MLAAttention(nn.Module):
    """DeepSeek multi-head latent attention over the runtime's latent cache.

    ``forward(q [T, H, nope+rope], kv_c_normed [T, kv_lora_rank], k_pe [T, 1, rope])
    -> [T, H*v_head_dim]``. ``kv_b_proj`` (``[H*(nope+v), kv_lora_rank]``) is owned
    here and shared with the runtime, which uses it to expand k/v for prefill
    and to absorb W_UK / W_UV for decode.
    """

    def __init__(self, *, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 kv_lora_rank: int, kv_b_proj: nn.Linear, layer_name: str, softmax_scale: float | None = None):
        super().__init__()
        self.num_heads, self.v_head_dim = num_heads, v_head_dim
        self.layer_name = layer_name
        self.kv_b_proj = kv_b_proj
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.impl = runtime.MLAAttentionImpl(
            num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim, kv_lora_rank=kv_lora_rank, kv_b_proj_weight=kv_b_proj.weight,
            softmax_scale=softmax_scale or qk_head_dim**-0.5,
        )
        runtime.register_layer(layer_name, self.impl)

    def forward(self, q: Tensor, kv_c_normed: Tensor, k_pe: Tensor) -> Tensor:
        output = torch.empty((q.shape[0], self.num_heads * self.v_head_dim), dtype=q.dtype, device=q.device)
        torch.ops.fusion_pass.mla_attention_with_output(q, kv_c_normed, k_pe, output, self.layer_name)
        return output
