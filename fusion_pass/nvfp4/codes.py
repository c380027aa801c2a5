"""The 4-bit e2m1 codes of NVFP4: encoding, unpacking, values and rounding steps (docs/nvfp4.md)."""

from __future__ import annotations

import torch

from fusion_pass.nvfp4.checks import ArgumentError
from fusion_pass.nvfp4.layout import E2M1_VALUES, HALF_STEPS


def e2m1_encode(q: torch.Tensor) -> torch.Tensor:
    """float32 values -> uint8 e2m1 codes (nearest, ties to even code, saturating).

    The thresholds are the midpoints between neighbouring magnitudes; ``>`` at a
    midpoint sends the tie down, ``>=`` sends it up, chosen so that the tie lands
    on the even code index (0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2,
    3.5->4, 5->4). The sign bit comes from ``signbit`` so -0.0 gives 0x8.
    ``±Inf`` saturates to 0x7 / 0xF. A NaN gives magnitude 0 with the NaN's sign
    bit, which depends on the device; :func:`quantize` does not rely on
    it (a block holding a NaN is written as codes 0 explicitly).
    """
    a = q.abs()
    index = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    return index | (torch.signbit(q).to(torch.uint8) << 3)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K/2]`` -> uint8 codes ``[..., K]`` (low nibble is the even element)."""
    if packed.dtype != torch.uint8:
        raise ArgumentError(f"unpack_codes: packed must be uint8 (got {packed.dtype})")
    pairs = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def codes_to_values(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (any integer dtype, values 0..15) -> float32 values (code 8 is -0.0)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    table = torch.cat((table, -table))
    return table[codes.long()]


def half_step(codes: torch.Tensor) -> torch.Tensor:
    """Largest rounding distance, in code units, of values that round to ``codes``.

    float32, same shape as ``codes``: 0.25 for magnitudes 0..1.5, 0.5 for 2 and 3,
    1.0 for 4 and 6. For code 6.0 only inputs up to 6 are covered (saturation of
    larger inputs is not a rounding step). Multiply by ``float(sf) / gs`` to get
    the element's error in input units.
    """
    table = torch.tensor(HALF_STEPS, dtype=torch.float32, device=codes.device)
    return table[(codes & 0x7).long()]
