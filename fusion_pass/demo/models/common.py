"""Pieces shared by the demo models: rotary embedding, seeded init, calibration."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fusion_pass import runtime
from fusion_pass.demo.layers import NVFP4Linear


MAX_POSITION = 32768
"""Positions the demo models' rotary tables cover (a request's prompt + decode tokens must fit)."""


class RotaryEmbedding(nn.Module):
    """GPT-NeoX-style rotary embedding (rotate halves) over the last dim of ``x``.

    ``forward(positions int64 [T], x [T, heads, rotary_dim]) -> same shape and dtype``; positions
    must lie in ``[0, max_position)`` (the table is indexed by them).
    """

    def __init__(self, rotary_dim: int, max_position: int = MAX_POSITION, base: float = 10000.0):
        super().__init__()
        if rotary_dim % 2:
            raise ValueError(f"RotaryEmbedding: rotary_dim must be even, got {rotary_dim}")
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_sin", torch.cat([angles.cos(), angles.sin()], dim=-1), persistent=False)

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        x1, x2 = x.float().chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return rotated.to(x.dtype)


class AttentionStack(nn.Module):
    """Pre-norm residual stack of attention layers: ``forward(positions [T], hidden [T, D])``."""

    def __init__(self, layers: list[nn.Module], hidden_size: int, eps: float):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norms = nn.ModuleList(nn.RMSNorm(hidden_size, eps=eps) for _ in layers)

    def forward(self, positions: Tensor, hidden: Tensor) -> Tensor:
        for norm, layer in zip(self.norms, self.layers):
            hidden = hidden + layer(positions, norm(hidden))
        return hidden


def linear(in_features: int, out_features: int, generator: torch.Generator) -> nn.Linear:
    """A bias-free linear layer with seeded N(0, 1/in_features) weights."""
    layer = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        layer.weight.normal_(0.0, in_features**-0.5, generator=generator)
    return layer


def release_layers(model: nn.Module) -> None:
    """Unregister the model's attention layers from the runtime (their names become free again)."""
    for module in model.modules():
        name = getattr(module, "layer_name", None)
        if name is not None and runtime.registered_layers().get(name) is getattr(module, "impl", None):
            runtime.unregister_layer(name)


@torch.no_grad()
def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast the parameters (not the buffers) to ``dtype`` in place.

    ``Module.to(dtype)`` would also cast the NVFP4 scales (float8 counts as
    floating point) and the float32 global scales; those must stay as they are.
    """
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


@torch.no_grad()
def calibrate_nvfp4_inputs(model: nn.Module, batches) -> None:
    """Set every :class:`NVFP4Linear`'s input global scale from the amax its input
    reaches over ``batches`` (an iterable of ``(spec, forward args)`` pairs run
    eagerly), as an offline NVFP4 calibration would. Clears the KV caches after.
    """
    amax: dict[NVFP4Linear, Tensor] = {}

    def observe(module, args):
        seen = args[0].detach().abs().amax().float()
        amax[module] = torch.maximum(amax.get(module, seen), seen)

    handles = [m.register_forward_pre_hook(observe) for m in model.modules() if isinstance(m, NVFP4Linear)]
    try:
        for spec, args in batches:
            with runtime.batch(spec):
                model(*args)
    finally:
        for handle in handles:
            handle.remove()
        runtime.clear_kv_caches()
    for module, value in amax.items():
        module.set_input_amax(value.cpu())
