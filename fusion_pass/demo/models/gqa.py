"""A standard grouped-query attention stack (Llama-3-8B's attention dimensions) with an NVFP4 o_proj."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fusion_pass.demo.layers import Attention, NVFP4Linear
from fusion_pass.demo.models.common import AttentionStack, RotaryEmbedding, cast_parameters, linear


@dataclass(frozen=True)
class GQAConfig:
    hidden_size: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    num_layers: int = 2
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5

    @classmethod
    def tiny(cls, **overrides) -> "GQAConfig":
        """Small dimensions with the same structure, for fast tests."""
        base = dict(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=32)
        return cls(**{**base, **overrides})


class GQAAttention(nn.Module):
    """``forward(positions [T], hidden [T, hidden]) -> [T, hidden]``: qkv_proj -> rotary -> attention -> NVFP4 o_proj."""

    def __init__(self, cfg: GQAConfig, layer_name: str, generator: torch.Generator):
        super().__init__()
        self.cfg = cfg
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, generator)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, base=cfg.rope_theta)
        self.attn = Attention(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                              layer_name=layer_name)
        o_proj = linear(self.q_size, cfg.hidden_size, generator)
        self.o_proj = NVFP4Linear(o_proj.weight)

    def forward(self, positions: Tensor, hidden: Tensor) -> Tensor:
        cfg = self.cfg
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.rotary_emb(positions, q.view(-1, cfg.num_heads, cfg.head_dim)).reshape(-1, self.q_size)
        k = self.rotary_emb(positions, k.view(-1, cfg.num_kv_heads, cfg.head_dim)).reshape(-1, self.kv_size)
        return self.o_proj(self.attn(q, k, v))


def build_gqa_model(cfg: GQAConfig = GQAConfig(), *, prefix: str = "gqa", seed: int = 0,
                    dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> AttentionStack:
    """Fixed-seed GQA stack; attention layers are named ``{prefix}.layers.{i}.self_attn.attn``."""
    generator = torch.Generator().manual_seed(seed)
    layers = [GQAAttention(cfg, f"{prefix}.layers.{i}.self_attn.attn", generator) for i in range(cfg.num_layers)]
    return cast_parameters(AttentionStack(layers, cfg.hidden_size, cfg.rms_norm_eps), dtype).to(device)
