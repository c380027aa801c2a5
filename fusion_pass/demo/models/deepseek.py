"""A DeepSeek-V3-style attention stack: MLA attention with an NVFP4 o_proj.

The default :class:`MLAConfig` has DeepSeek-V3's attention dimensions at tensor
parallel size 8 (128 heads / 8 = 16 heads per rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fusion_pass.demo.layers import MLAAttention, NVFP4Linear
from fusion_pass.demo.models.common import AttentionStack, RotaryEmbedding, cast_parameters, linear


@dataclass(frozen=True)
class MLAConfig:
    hidden_size: int = 7168
    num_heads: int = 16
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    num_layers: int = 2
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def tiny(cls, **overrides) -> "MLAConfig":
        """Small dimensions with the same structure, for fast tests."""
        base = dict(hidden_size=256, num_heads=4, q_lora_rank=64, kv_lora_rank=64,
                    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
        return cls(**{**base, **overrides})


class DeepseekV3Attention(nn.Module):
    """One MLA attention layer: ``forward(positions [T], hidden [T, hidden]) -> [T, hidden]``.

    fused q/kv down-projection -> q_a / kv_a RMSNorm -> q up-projection ->
    rotary on the rope dims -> ``MLAAttention`` -> NVFP4 ``o_proj``.
    """

    def __init__(self, cfg: MLAConfig, layer_name: str, generator: torch.Generator):
        super().__init__()
        self.cfg = cfg
        self.fused_qkv_a_proj = linear(cfg.hidden_size, cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator)
        self.q_a_layernorm = nn.RMSNorm(cfg.q_lora_rank, eps=cfg.rms_norm_eps)
        self.q_b_proj = linear(cfg.q_lora_rank, cfg.num_heads * cfg.qk_head_dim, generator)
        self.kv_a_layernorm = nn.RMSNorm(cfg.kv_lora_rank, eps=cfg.rms_norm_eps)
        kv_b_proj = linear(cfg.kv_lora_rank, cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), generator)
        self.rotary_emb = RotaryEmbedding(cfg.qk_rope_head_dim, base=cfg.rope_theta)
        self.attn = MLAAttention(
            num_heads=cfg.num_heads, qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim, kv_lora_rank=cfg.kv_lora_rank, kv_b_proj=kv_b_proj, layer_name=layer_name,
        )
        o_proj = linear(cfg.num_heads * cfg.v_head_dim, cfg.hidden_size, generator)
        self.o_proj = NVFP4Linear(o_proj.weight)

    def forward(self, positions: Tensor, hidden: Tensor) -> Tensor:
        cfg = self.cfg
        q_c, kv_c, k_pe = self.fused_qkv_a_proj(hidden).split(
            [cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1
        )
        q = self.q_b_proj(self.q_a_layernorm(q_c)).view(-1, cfg.num_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, self.rotary_emb(positions, q_pe)], dim=-1)
        k_pe = self.rotary_emb(positions, k_pe.unsqueeze(1))
        attn_out = self.attn(q, self.kv_a_layernorm(kv_c), k_pe)
        return self.o_proj(attn_out)


def build_mla_model(cfg: MLAConfig = MLAConfig(), *, prefix: str = "mla", seed: int = 0,
                    dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> AttentionStack:
    """Fixed-seed DeepSeek-V3-style stack; attention layers are named ``{prefix}.layers.{i}.self_attn.attn``."""
    generator = torch.Generator().manual_seed(seed)
    layers = [DeepseekV3Attention(cfg, f"{prefix}.layers.{i}.self_attn.attn", generator) for i in range(cfg.num_layers)]
    return cast_parameters(AttentionStack(layers, cfg.hidden_size, cfg.rms_norm_eps), dtype).to(device)
