"""FA4 as the ``fa4`` backend of the FP8 entry points (``kernels.attention_fp8_static`` /
``attention_fp8_group``) and of ``choice.choose_fp8``.

CPU: ``auto`` is ``fa4`` where FA4's SM90 FP8 kernels run the call (stand-in detection), a named ``fa4`` is refused
with the reason elsewhere (another generation, no CUDA, ``Dv % 128 != 0`` for groups); with ``fa4`` chosen the entry
points hand :mod:`fusion_pass.kernels.fa4.sm90_fp8` their arguments and buffers (stand-in kernels writing a seeded
pattern: the caller's output when FA4 can write it, else a copy; the caller's scales in every layout, else a new
row-major buffer; ``1 / scale``; the NaN rule).

GPU (an SM90 device with FA4; skipped otherwise): ``auto`` picks ``fa4`` and both entry points give the reference
quantizers' bytes of the twin's output.
"""

from __future__ import annotations

import random

import pytest
import torch

from fusion_pass import fp8, kernels
from fusion_pass.fp8 import ScaleLayout
from fusion_pass.kernels import choice
from fusion_pass.kernels.fa4 import sm90 as fa4_sm90, sm90_fp8 as fa4_fp8

from sm90_gpu import gpu  # noqa: E402

LAYOUTS = list(ScaleLayout)
FLAGS = [(False, False), (True, False), (False, True), (True, True)]  # (ue8m0, divide)
HEADS = [("mla16", 16, 16, 192, 128), ("gqa", 32, 8, 128, 128)]


def fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


def _api_tensors(dv=128, t=6):
    q = torch.randn(t, 2, 128 if dv == 128 else dv).bfloat16()
    k = torch.randn(t, 1, q.shape[2]).bfloat16()
    v = torch.randn(t, 1, dv).bfloat16()
    return q, k, v, torch.tensor([0, 2, t], dtype=torch.int32)


def test_choose_fp8_picks_fa4_where_its_sm90_kernels_run(monkeypatch):
    q, _, v, _ = _api_tensors()
    _, _, v64, _ = _api_tensors(dv=64)
    q64 = torch.zeros(6, 2, 64).bfloat16()
    monkeypatch.setattr(choice, "fa4_sm90_usable", lambda *a: (True, "ok"))
    for group in (False, True):
        assert choice.choose_fp8("f", "auto", q, v, group=group) == "fa4"
        assert choice.choose_fp8("f", "fa4", q, v, group=group) == "fa4"
    assert choice.choose_fp8("f", "fa4", q64, v64, group=False) == "fa4"
    assert choice.choose_fp8("f", "auto", q64, v64, group=True) == "reference"  # CPU tensors: not Triton
    with pytest.raises(RuntimeError, match=r"^f: backend 'fa4' is unavailable: FA4's group epilogue needs v's head "
                                           r"dim Dv divisible by 128 .*got 64"):
        choice.choose_fp8("f", "fa4", q64, v64, group=True)
    monkeypatch.setattr(choice, "fa4_sm90_usable", lambda *a: (False, "fa4 runs on CUDA devices only, got cpu"))
    for group in (False, True):
        assert choice.choose_fp8("f", "auto", q, v, group=group) == "reference"
        with pytest.raises(RuntimeError, match=r"^f: backend 'fa4' is unavailable: fa4 runs on CUDA devices only, got "
                                               r"cpu \(FA4's FP8 epilogues are SM90's \(H100/H200\) only\)"):
            choice.choose_fp8("f", "fa4", q, v, group=group)


def test_choose_fp8_refuses_fa4_on_the_cpu_with_the_reason():
    q, _, v, _ = _api_tensors()
    for group in (False, True):
        with pytest.raises(RuntimeError, match=r"backend 'fa4' is unavailable: .*CUDA devices only.*SM90"):
            choice.choose_fp8("f", "fa4", q, v, group=group)


@pytest.mark.parametrize("entry", ["attention_fp8_static", "attention_fp8_group"])
def test_entry_points_hand_fa4_their_buffers(entry, monkeypatch):
    """With ``fa4`` chosen, the entry point calls the SM90 FP8 function with its arguments: the caller's output
    when FA4 can write it (contiguous, 16-byte aligned), else a new buffer copied into the caller's; the caller's
    scales (or a new row-major buffer); ``inv = 1 / scale`` unless given as the inverse; the NaN rule as
    ``nan_to_max``. The stand-in writes a recognisable pattern, so what comes back is what it wrote."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    monkeypatch.setattr(choice, "fa4_sm90_usable", lambda *a: (True, "ok"))
    q, k, v, cu = _api_tensors()
    t, width = q.shape[0], q.shape[1] * v.shape[2]
    pattern = torch.randint(0, 256, (t, width), dtype=torch.uint8, generator=gen)
    pattern_scales = torch.rand(t, width // 128, generator=gen)
    calls = []

    def stand_in(q_, k_, v_, **kw):
        calls.append(kw)
        kw["output"].view(torch.uint8).copy_(pattern)
        if "scales" in kw:
            kw["scales"].copy_(pattern_scales)

    name = "fa4_attention_fp8_group_varlen" if entry == "attention_fp8_group" else "fa4_attention_fp8_static_varlen"
    monkeypatch.setattr(fa4_fp8, name, stand_in)
    scale = torch.tensor([0.37])
    extra = dict(scale=scale, scale_is_inverse=False, nan="nan") if entry == "attention_fp8_static" else \
        dict(ue8m0=True, divide=True)
    for output in (None, torch.empty(t, width, dtype=fp8.FP8),
                   torch.empty(t * width + 1, dtype=fp8.FP8)[1:].view(t, width),  # contiguous, not 16-byte aligned
                   torch.empty(t, 2 * width, dtype=fp8.FP8)[:, :width]):
        for layout in LAYOUTS if entry == "attention_fp8_group" else [None]:
            scales = None if layout is None else fp8.group_scale_buffer(t, width, layout)
            call = dict(extra, output=output, backend="fa4", softmax_scale=0.25, validate_values=True)
            if layout is not None:
                call["scales"] = scales
            got = getattr(kernels, entry)(q, k, v, cu, 4, **call)
            kw = calls.pop()
            what = f"{entry}, output {None if output is None else output.stride()}, {layout} (seed {seed})"
            data = got[0] if entry == "attention_fp8_group" else got
            assert torch.equal(data.view(torch.uint8), pattern), what
            if output is not None:
                assert data is output, what
                writable = output.is_contiguous() and output.data_ptr() % 16 == 0
                assert (kw["output"] is output) == writable, what
            assert kw["output"].is_contiguous() and kw["softmax_scale"] == 0.25 and kw["causal"] is True, what
            assert kw["cu_seqlens"] is cu and kw["max_seqlen"] == 4 and kw["cu_seqlens_k"] is None, what
            if entry == "attention_fp8_static":
                assert torch.equal(kw["inv_scale"], fp8.reciprocal(scale)) and kw["nan_to_max"] is False, what
            else:
                assert (kw["ue8m0"], kw["divide"]) == (True, True), what
                assert torch.equal(got[1], pattern_scales), what
                if scales is not None:
                    assert got[1] is scales and kw["scales"] is scales, what
                else:
                    assert ScaleLayout.of(got[1]) is ScaleLayout.ROW_MAJOR, what


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("heads", HEADS, ids=[c[0] for c in HEADS])
def test_entry_points_pick_fa4_on_sm90_and_give_the_twins_bytes(heads):
    """``backend="auto"`` is ``fa4`` here: ``kernels.attention_fp8_group`` / ``attention_fp8_static`` give
    ``quantize_group`` / ``quantize_static`` of the twin's output (a column-major scale buffer and a given,
    non-contiguous output among the calls)."""
    name, h, hkv, d, dv = heads
    seed = fresh_seed()
    rng = random.Random(seed)
    tile_m = fa4_sm90.kernel_config(d, dv, True).tile_m
    lengths = [max(1, tile_m * rng.randint(0, 3) + rng.randint(-2, 2)) for _ in range(rng.randint(1, 4))]
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v = (torch.randn(t, heads_, dim, generator=gen).to("cuda", torch.bfloat16)
               for heads_, dim in ((h, d), (hkv, d), (hkv, dv)))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    width = h * dv
    assert choice.choose_fp8("f", "auto", q, v, group=True) == "fa4"
    assert choice.choose_fp8("f", "auto", q, v, group=False) == "fa4"
    scale = d ** -0.5
    twin = fa4_sm90.fa4_attention_varlen(q, k, v, cu, max(lengths), causal=True, softmax_scale=scale)
    twin = twin.reshape(t, width)
    what = f"{name}, lengths {lengths}, seed {seed}"
    for layout in LAYOUTS:
        ue8m0, divide = rng.choice(FLAGS)
        scales = fp8.group_scale_buffer(t, width, layout, device="cuda")
        got, got_scales = kernels.attention_fp8_group(q, k, v, cu, max(lengths), ue8m0=ue8m0, divide=divide,
                                                      softmax_scale=scale, scales=scales)
        want, want_scales = fp8.quantize_group(twin, ue8m0=ue8m0, divide=divide)
        assert got_scales is scales, what
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"group bytes, {layout.value}: {what}"
        assert torch.equal(got_scales, want_scales), f"group scales, {layout.value}: {what}"
    finite = twin.float().abs().max().item()
    given = torch.tensor([max(finite, 1e-6) / 448 * rng.uniform(0.5, 2.0)], device="cuda")
    output = torch.full((t, 2 * width), 0xA5, dtype=torch.uint8, device="cuda")[:, :width].view(fp8.FP8)
    got = kernels.attention_fp8_static(q, k, v, cu, max(lengths), scale=given, softmax_scale=scale, output=output)
    want = fp8.quantize_static(twin, fp8.reciprocal(given))
    assert got is output and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"static bytes: {what}"
