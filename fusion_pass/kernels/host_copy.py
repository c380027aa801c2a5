"""Host integers to a device tensor without blocking the host.

To a CUDA device the values go through pinned memory and a non-blocking copy: a copy from pageable host memory
synchronizes with the stream before it starts, which would make the host wait for every kernel queued before.
"""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """``values`` (ints, nested lists of ints, or a CPU tensor) as a ``dtype`` tensor on ``device``."""
    cuda = torch.device(device).type == "cuda"
    if isinstance(values, torch.Tensor):
        host = values.to(dtype)
        return host.pin_memory().to(device, non_blocking=True) if cuda else host.to(device)
    if cuda:
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)
