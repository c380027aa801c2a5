"""The format table (fusion_pass.formats): each format's buffers are what its reference quantizer writes, its
refusals follow from its block / group width, its bound holds on its own round trip, and NVFP4 on the axis is
the NVFP4 package unchanged."""

from __future__ import annotations

import random

import pytest
import torch

from fusion_pass import formats, fp8, nvfp4
from fusion_pass.nvfp4 import ArgumentError


def fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


def scale_inputs(fmt, x):
    """The quantizer's scale arguments for ``x``: NVFP4's global scale, FP8's static scale, none for groups."""
    amax = x.abs().max().item()
    if fmt is formats.NVFP4:
        return (torch.tensor([448 * 6 / amax], dtype=torch.float32),)
    if fmt is formats.FP8_STATIC:
        return (torch.tensor([amax / 448], dtype=torch.float32),)
    return ()


def test_names_are_unique_and_found():
    names = [f.name for f in formats.FORMATS]
    assert len(names) == len(set(names)) and names[0] == "nvfp4"
    assert all(formats.by_name(n) is f for n, f in zip(names, formats.FORMATS))
    with pytest.raises(ArgumentError, match=r"output format must be one of \['nvfp4', 'fp8_static'"):
        formats.by_name("fp8")
    assert not {r.name for r in formats.REFUSED} & set(names)


@pytest.mark.parametrize("fmt", formats.FORMATS, ids=lambda f: f.name)
def test_buffers_are_what_the_reference_writes(fmt):
    seed = fresh_seed()
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(4):
        heads, dv = rng.choice([(16, 128), (8, 128), (2, 256), (4, 64), (3, 32)])
        tokens = rng.randint(1, 300)
        width = heads * dv
        refusal = fmt.refusal(heads, dv)
        if refusal is not None:
            assert fmt.head_multiple is not None and dv % fmt.head_multiple, refusal
            continue
        x = torch.randn(tokens, width, generator=gen).to(torch.bfloat16)
        written = fmt.quantize(x, *scale_inputs(fmt, x))
        empty = fmt.allocate(tokens, width)
        assert len(written) == len(fmt.buffers) == len(empty), seed
        for spec, got in zip(fmt.buffers, written):
            want = empty[spec.name]
            assert got.numel() * got.element_size() == want.numel() * want.element_size(), (seed, spec.name)
            assert got.dtype == want.dtype or (got.element_size() != want.element_size() and spec.name ==
                                               "block_scales"), (seed, spec.name, got.dtype)


@pytest.mark.parametrize("fmt", formats.FORMATS, ids=lambda f: f.name)
def test_refusals_follow_the_width(fmt):
    for heads, dv in [(16, 128), (8, 64), (1, 16), (3, 8), (5, 192)]:
        reason = fmt.refusal(heads, dv)
        ok_width = (heads * dv) % fmt.columns == 0
        ok_head = fmt.head_multiple is None or dv % fmt.head_multiple == 0
        assert (reason is None) == (ok_width and ok_head), (fmt.name, heads, dv, reason)
        if reason is not None:
            assert fmt.name in reason and str(heads * dv if not ok_width else dv) in reason


def test_nvfp4_on_the_axis_is_the_nvfp4_package():
    seed = fresh_seed()
    x = torch.randn(77, 2048, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    gs = torch.tensor([448 * 6 / x.abs().max().item()], dtype=torch.float32)
    packed, scales = formats.NVFP4.quantize(x, gs)
    want_packed, want_scales = nvfp4.quantize(x, gs, swizzled=True)
    assert torch.equal(packed, want_packed) and torch.equal(scales.view(torch.uint8), want_scales.view(torch.uint8))
    assert torch.equal(formats.NVFP4.error_bound(x, gs), nvfp4.error_bound(x, gs))


def test_fp8_static_on_the_axis_multiplies_by_the_correctly_rounded_reciprocal():
    seed = fresh_seed()
    x = torch.randn(33, 512, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    scale = torch.tensor([x.abs().max().item() / 300], dtype=torch.float32)
    (q,) = formats.FP8_STATIC.quantize(x, scale)
    assert torch.equal(q.view(torch.uint8), fp8.quantize_static(x, 1 / scale).view(torch.uint8))
    err = (fp8.dequantize_static(q, scale) - x.float()).abs()
    assert bool((err <= formats.FP8_STATIC.error_bound(x, scale)).all()), seed


@pytest.mark.parametrize("fmt", [formats.FP8_GROUP128, formats.FP8_GROUP128_UE8M0], ids=lambda f: f.name)
def test_fp8_groups_on_the_axis_round_trip_within_their_bound(fmt):
    seed = fresh_seed()
    x = torch.randn(40, 1024, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    q, scales = fmt.quantize(x)
    assert scales.shape == (40, 8) and fmt.scales.power_of_two == (fmt is formats.FP8_GROUP128_UE8M0)
    err = (fp8.dequantize_group(q, scales) - x.float()).abs()
    assert bool((err <= fmt.error_bound(x, scales)).all()), seed
