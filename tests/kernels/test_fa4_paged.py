"""FA4 on a paged KV cache: ``fa4_attention_nvfp4_paged`` and its twin ``fa4_attention_paged`` (SM90 and SM100).

Keys and values are read from ``k_cache [num_pages, page_size, Hkv, D]`` / ``v_cache [num_pages, page_size, Hkv,
Dv]`` through ``page_table [B, max_pages_per_seq]`` and ``seqused_k [B]`` (FA4's own paged forward: TMA loads when
the page size is the key tile, cp.async loads otherwise); queries and output rows follow ``cu_seqlens``.

CPU (no GPU): every bad argument of a generated list raises an ``ArgumentError`` naming the argument before FA4 is
imported, for both generations and both entry points; the launchers' plans (first call checked and compiled, later
calls a dict lookup, each refused change back to the checked path) with a stand-in kernel; the constructor
arguments both generations build are FA4's own interface's for the same paged call (recorded under
``FakeTensorMode``); and, with FA4 installed, the fused kernel and the twin compile for ``sm_90a`` and ``sm_100a``
under ``FakeTensorMode`` for every supported head-dim pair, MHA and GQA, page sizes 16, 64 and the key tile (TMA),
keys and values split from one cache (vLLM's FLASH_ATTN layout), causal (the exhaustive sweeps are ``slow``).

GPU (an SM90 device with FA4; skipped otherwise, not yet run): the fused bytes equal ``nvfp4.quantize`` of the twin's
output (both poisons, scale padding zero) for decode-only, prefill-only, with-context and mixed batches over shuffled
pages of a shared pool, page sizes 16 and 128; the twin equals FA4's public ``flash_attn_varlen_func`` with
``page_table`` / ``seqused_k`` bit for bit (output and LSE) and a float32 reference gathered through the page table
within bf16 tolerance; NaN/Inf in the cache as the varlen tests treat them; split caches; no host sync on later calls.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import random
import re
import subprocess
import sys
import textwrap
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from fusion_pass import nvfp4
from fusion_pass.kernels.fa4 import common, forward, launch, sm90, sm90_configs, sm100
from fusion_pass.nvfp4 import ArgumentError

from sm90_gpu import gpu  # noqa: E402

needs_fa4 = pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None,
                               reason="flash_attn.cute is not installed (the fa4 extra)")

SM90_ENV = dict(CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_ARCH="sm_90", FLASH_ATTENTION_NUM_SMS="132")
SM100_ENV = dict(CUTE_DSL_ARCH="sm_100a", FLASH_ATTENTION_ARCH="sm_100", FLASH_ATTENTION_NUM_SMS="148")
GENERATIONS = {"sm90": (sm90, SM90_ENV), "sm100": (sm100, SM100_ENV)}


def fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


# ---------------------------------------------------------------------------
# CPU: argument checks, before FA4 is imported
# ---------------------------------------------------------------------------


def _cpu_args(h=4, hkv=2, d=128, dv=128, page_size=16, pages=6, t=10):
    """Valid arguments of a paged call on the CPU (two sequences, three pages each) and the NVFP4 buffers."""
    args = dict(q=torch.zeros(t, h, d, dtype=torch.bfloat16),
                k_cache=torch.zeros(pages, page_size, hkv, d, dtype=torch.bfloat16),
                v_cache=torch.zeros(pages, page_size, hkv, dv, dtype=torch.bfloat16),
                cu_seqlens=torch.tensor([0, 4, t], dtype=torch.int32), max_seqlen=6,
                seqused_k=torch.tensor([20, 30], dtype=torch.int32),
                page_table=torch.tensor([[5, 0, 3], [1, 4, 2]], dtype=torch.int32), max_seqlen_k=30,
                softmax_scale=0.1, causal=True)
    rows, cols = nvfp4.scale_shape(t, h * dv)
    buffers = dict(output=torch.zeros(t, h * dv // 2, dtype=torch.uint8), output_scale=torch.ones(1),
                   output_block_scale=torch.zeros(rows * cols, dtype=torch.uint8))
    return args, buffers


def _misaligned_cache(pages, page_size, hkv, d):
    """A ``[pages, page_size, Hkv, D]`` view whose head stride (D + 4 elements: 8 bytes past 16) TMA cannot take."""
    return torch.zeros(pages, page_size, hkv, d + 4, dtype=torch.bfloat16)[..., :d]


# (name, change, expected message, where: "both" entry points / "fused" / "twin", generations)
BAD = [
    ("q dtype", lambda a, b: a.update(q=a["q"].float()), r"q must be float16 or bfloat16", "both"),
    ("q 2-D", lambda a, b: a.update(q=a["q"][:, 0]), r"q must be a 3-D tensor \[T, H, D\]", "both"),
    ("q not unit stride", lambda a, b: a.update(q=torch.zeros(10, 4, 256, dtype=torch.bfloat16)[..., ::2]),
     r"q must have unit stride along its last \(head\) dim", "both"),
    ("k_cache 3-D", lambda a, b: a.update(k_cache=a["k_cache"][0]),
     r"k_cache must be a 4-D tensor \[num_pages, page_size, Hkv, D\]", "both"),
    ("v_cache 3-D", lambda a, b: a.update(v_cache=a["v_cache"].flatten(0, 1)),
     r"v_cache must be a 4-D tensor \[num_pages, page_size, Hkv, Dv\]", "both"),
    ("k_cache dtype", lambda a, b: a.update(k_cache=a["k_cache"].half()), r"q, k_cache, v_cache must share one dtype",
     "both"),
    ("v_cache float32", lambda a, b: a.update(v_cache=a["v_cache"].float()), r"v_cache must be float16 or bfloat16",
     "both"),
    ("k_cache on meta", lambda a, b: a.update(k_cache=a["k_cache"].to("meta")),
     r"q, k_cache, v_cache must be on one device", "both"),
    ("k_cache head dim", lambda a, b: a.update(k_cache=torch.zeros(6, 16, 2, 64, dtype=torch.bfloat16)),
     r"k_cache must be \[num_pages, page_size, Hkv, D\] with q's D=128, got \[6, 16, 2, 64\]", "both"),
    ("v_cache pages", lambda a, b: a.update(v_cache=a["v_cache"][:5]),
     r"v_cache must be \[num_pages, page_size, Hkv, Dv\] with k_cache's num_pages=6, page_size=16, Hkv=2", "both"),
    ("v_cache page size", lambda a, b: a.update(v_cache=torch.zeros(6, 32, 2, 128, dtype=torch.bfloat16)),
     r"v_cache must be \[num_pages, page_size, Hkv, Dv\] with k_cache's num_pages=6, page_size=16", "both"),
    ("v_cache heads", lambda a, b: a.update(v_cache=torch.zeros(6, 16, 1, 128, dtype=torch.bfloat16)),
     r"v_cache must be \[num_pages, page_size, Hkv, Dv\] with k_cache's .*Hkv=2", "both"),
    ("no pages", lambda a, b: a.update(k_cache=a["k_cache"][:0], v_cache=a["v_cache"][:0]),
     r"k_cache must hold at least one page", "both"),
    ("heads not a multiple", lambda a, b: a.update(k_cache=torch.zeros(6, 16, 3, 128, dtype=torch.bfloat16),
                                                   v_cache=torch.zeros(6, 16, 3, 128, dtype=torch.bfloat16)),
     r"q's heads H=4 must be a multiple of the caches' heads Hkv=3", "both"),
    ("k_cache unit stride", lambda a, b: a.update(k_cache=torch.zeros(6, 16, 2, 256, dtype=torch.bfloat16)[..., ::2]),
     r"k_cache must have unit stride along its last \(head\) dim", "both"),
    ("k_cache misaligned", lambda a, b: a.update(k_cache=_misaligned_cache(6, 16, 2, 128)),
     r"k_cache must be 16-byte aligned with 16-byte aligned strides", "both"),
    ("v_cache misaligned", lambda a, b: a.update(v_cache=_misaligned_cache(6, 16, 2, 128)),
     r"v_cache must be 16-byte aligned with 16-byte aligned strides", "both"),
    ("head dims mismatch", lambda a, b: a.update(v_cache=torch.zeros(6, 16, 2, 64, dtype=torch.bfloat16)),
     r"head dims \(q/k D=128, v Dv=64\) are not supported", "both"),
    ("head dims unsupported", lambda a, b: a.update(q=torch.zeros(10, 4, 256, dtype=torch.bfloat16),
                                                    k_cache=torch.zeros(6, 16, 2, 256, dtype=torch.bfloat16),
                                                    v_cache=torch.zeros(6, 16, 2, 256, dtype=torch.bfloat16)),
     r"head dims \(q/k D=256, v Dv=256\) are not supported", "both"),
    ("cu_seqlens int64", lambda a, b: a.update(cu_seqlens=a["cu_seqlens"].long()), r"cu_seqlens must be a 1-D int32",
     "both"),
    ("cu_seqlens one entry", lambda a, b: a.update(cu_seqlens=a["cu_seqlens"][:1]),
     r"cu_seqlens must be contiguous int32 \[B \+ 1 >= 2\]", "both"),
    ("max_seqlen negative", lambda a, b: a.update(max_seqlen=-1), r"max_seqlen must be a non-negative int", "both"),
    ("max_seqlen float", lambda a, b: a.update(max_seqlen=6.0), r"max_seqlen must be a non-negative int", "both"),
    ("seqused_k int64", lambda a, b: a.update(seqused_k=a["seqused_k"].long()),
     r"seqused_k must be a contiguous 1-D int32 tensor \[B\] = \[2\]", "both"),
    ("seqused_k shape", lambda a, b: a.update(seqused_k=torch.tensor([1, 2, 3], dtype=torch.int32)),
     r"seqused_k must be a contiguous 1-D int32 tensor \[B\] = \[2\] \(B from cu_seqlens\)", "both"),
    ("seqused_k 2-D", lambda a, b: a.update(seqused_k=a["seqused_k"][None]),
     r"seqused_k must be a contiguous 1-D int32 tensor \[B\]", "both"),
    ("seqused_k strided", lambda a, b: a.update(seqused_k=torch.tensor([20, 0, 30, 0], dtype=torch.int32)[::2]),
     r"seqused_k must be a contiguous 1-D int32 tensor \[B\]", "both"),
    ("seqused_k None", lambda a, b: a.update(seqused_k=None), r"seqused_k must be a contiguous 1-D int32 tensor",
     "both"),
    ("seqused_k on meta", lambda a, b: a.update(seqused_k=a["seqused_k"].to("meta")),
     r"seqused_k must be a contiguous 1-D int32 tensor \[B\] = \[2\] \(B from cu_seqlens\) on cpu", "both"),
    ("page_table int64", lambda a, b: a.update(page_table=a["page_table"].long()),
     r"page_table must be a 2-D int32 tensor \[B, max_pages_per_seq\]", "both"),
    ("page_table 1-D", lambda a, b: a.update(page_table=a["page_table"].flatten()),
     r"page_table must be a 2-D int32 tensor \[B, max_pages_per_seq\]", "both"),
    ("page_table rows", lambda a, b: a.update(page_table=torch.zeros(3, 3, dtype=torch.int32)),
     r"page_table must be int32 \[B, max_pages_per_seq >= 1\] = \[2, \.\.\.\] \(B from cu_seqlens\)", "both"),
    ("page_table empty", lambda a, b: a.update(page_table=torch.zeros(2, 0, dtype=torch.int32)),
     r"page_table must be int32 \[B, max_pages_per_seq >= 1\]", "both"),
    ("page_table on meta", lambda a, b: a.update(page_table=a["page_table"].to("meta")),
     r"page_table must be int32 \[B, max_pages_per_seq >= 1\] = \[2, \.\.\.\] \(B from cu_seqlens\) on cpu", "both"),
    ("page_table column-major", lambda a, b: a.update(page_table=torch.zeros(3, 2, dtype=torch.int32).t()),
     r"page_table must have unit stride along its last dim", "both"),
    ("page_table None", lambda a, b: a.update(page_table=None), r"page_table must be a 2-D int32 tensor", "both"),
    ("max_seqlen_k over the table", lambda a, b: a.update(max_seqlen_k=49),
     r"max_seqlen_k must be an int in 0 \.\. max_pages_per_seq \* page_size = 3 \* 16 = 48, got 49", "both"),
    ("max_seqlen_k None", lambda a, b: a.update(max_seqlen_k=None), r"max_seqlen_k must be an int in 0 \.\. ",
     "both"),
    ("max_seqlen_k negative", lambda a, b: a.update(max_seqlen_k=-1), r"max_seqlen_k must be an int", "both"),
    ("max_seqlen_k bool", lambda a, b: a.update(max_seqlen_k=True), r"max_seqlen_k must be an int", "both"),
    ("softmax_scale nan", lambda a, b: a.update(softmax_scale=float("nan")),
     r"softmax_scale must be a positive finite float", "both"),
    ("softmax_scale zero", lambda a, b: a.update(softmax_scale=0.0), r"softmax_scale must be a positive finite float",
     "both"),
    ("causal int", lambda a, b: a.update(causal=1), r"causal must be a bool", "both"),
    ("output short", lambda a, b: b.update(output=b["output"][:5]),
     r"output must be contiguous with T \* H \* Dv / 2 = 2560 bytes", "fused"),
    ("output strided", lambda a, b: b.update(output=torch.zeros(10, 512, dtype=torch.uint8)[:, ::2]),
     r"output must be contiguous", "fused"),
    ("output float", lambda a, b: b.update(output=b["output"].float()), r"output must be a one-byte tensor", "fused"),
    ("output_scale float64", lambda a, b: b.update(output_scale=torch.ones(1, dtype=torch.float64)),
     r"output_scale must be a one-element float32 tensor", "fused"),
    ("output_block_scale short", lambda a, b: b.update(output_block_scale=b["output_block_scale"][:-1]),
     r"output_block_scale must be a contiguous buffer of round_up\(T,128\) \* round_up\(H\*Dv/16,4\) = 128 \* 32",
     "fused"),
    ("return_lse int", lambda a, b: b.update(return_lse=1), r"return_lse must be a bool", "twin"),
    ("q heads not token-major", lambda a, b: a.update(q=torch.zeros(4, 10, 128, dtype=torch.bfloat16).transpose(0, 1)),
     r"q must be token-major with its heads inside a token's row for the SM100 kernel", "sm100"),
]

BAD_CASES = [
    pytest.param(generation, entry, change, match, id=f"{generation}-{entry}-{name}")
    for (name, change, match, where), generation, entry in itertools.product(BAD, ("sm90", "sm100"), ("fused", "twin"))
    if where in ("both", entry) or (where == "sm100" and generation == "sm100")
]


def _entry(module, entry, args, buffers):
    args = dict(args)
    q, k, v = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    if entry == "fused":
        return module.fa4_attention_nvfp4_paged(q, k, v, **args, **buffers)
    return module.fa4_attention_paged(q, k, v, **args, **{n: x for n, x in buffers.items() if n == "return_lse"})


@pytest.fixture
def no_fa4(monkeypatch):
    """FA4 must not be imported: any attempt fails the test."""
    for module in (sm90, sm100):
        monkeypatch.setattr(module, "fa4_interface", lambda: pytest.fail("FA4 imported before the checks"))


@pytest.mark.parametrize("generation, entry, change, match", BAD_CASES)
def test_paged_entry_rejects_bad_arguments_before_importing_fa4(no_fa4, generation, entry, change, match):
    module, _ = GENERATIONS[generation]
    args, buffers = _cpu_args()
    if entry == "twin":
        buffers = dict(return_lse=False)
    change(args, buffers)
    with pytest.raises(ArgumentError, match=match):
        _entry(module, entry, args, buffers)


@pytest.mark.parametrize("generation", ["sm90", "sm100"])
@pytest.mark.parametrize("layout", ["contiguous", "split", "wide_table", "decode"])
def test_paged_checks_accept_valid_layouts(generation, layout):
    """Views of one cache split along the last dim (vLLM's FLASH_ATTN layout), a page table that is a slice of a
    wider one, decode batches: the checks pass, reading no value."""
    module, _ = GENERATIONS[generation]
    args, buffers = _cpu_args()
    if layout == "split":
        kv = torch.zeros(6, 16, 2, 256, dtype=torch.bfloat16)
        args.update(k_cache=kv[..., :128], v_cache=kv[..., 128:])
    elif layout == "wide_table":
        args["page_table"] = torch.zeros(5, 9, dtype=torch.int32)[1:3, 2:5]
    elif layout == "decode":
        args.update(q=torch.zeros(2, 4, 128, dtype=torch.bfloat16), cu_seqlens=torch.tensor([0, 1, 2],
                                                                                           dtype=torch.int32),
                    max_seqlen=1, max_seqlen_k=48)
        rows, cols = nvfp4.scale_shape(2, 512)
        buffers = dict(output=torch.zeros(2, 256, dtype=torch.uint8), output_scale=torch.ones(1),
                       output_block_scale=torch.zeros(rows * cols, dtype=torch.uint8))
    a = dict(args)
    module.check_fa4_paged_args("f", a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), **a)
    common.check_nvfp4_buffers("f", args["q"], args["v_cache"], **buffers)


# ---------------------------------------------------------------------------
# CPU: the paged launchers' two paths, with a stand-in for the compiled kernel
# ---------------------------------------------------------------------------


class Recorder:
    """Stands in for the compile functions: counts compilations and records each launch's arguments."""

    def __init__(self):
        self.compiled, self.launches = [], []

    def kernel(self, *args):
        self.launches.append(args)

    def sm90_fused(self, q, k, v, o, packed, output_scale, scale_bytes, cu, cu_k, config, causal, *, seqused_k=None,
                   page_table=None):
        assert cu_k is None and seqused_k is not None and page_table is not None
        self.compiled.append(("fused", config, k.shape[1]))
        return self.kernel

    def sm90_twin(self, q, k, v, out, lse, cu, cu_k, config, causal, *, seqused_k=None, page_table=None):
        assert cu_k is None and seqused_k is not None and page_table is not None
        self.compiled.append(("twin", config, k.shape[1], lse is not None))
        return self.kernel

    def sm100_compile(self, fused, q, k, v, o, cu, cu_k, cls, causal, **kwargs):
        assert cu_k is None and kwargs["seqused_k"] is not None and kwargs["page_table"] is not None
        self.compiled.append(("fused" if fused else "twin", cls, k.shape[1], kwargs.get("lse") is not None))
        return self.kernel


def _paged_launchers(generation, rec, monkeypatch):
    if generation == "sm90":
        monkeypatch.setattr(sm90, "compile_nvfp4_kernel", rec.sm90_fused)
        monkeypatch.setattr(sm90, "compile_twin_kernel", rec.sm90_twin)
        return sm90.paged_launchers()
    monkeypatch.setattr(sm100, "_compile", rec.sm100_compile)
    return (launch.PagedFusedLauncher("fa4_attention_nvfp4_paged", check_args=sm100.check_fa4_paged_args,
                                      check_buffers=common.check_nvfp4_buffers, config_class=sm100.config_class,
                                      compile_kernel=sm100._compile_paged_fused, max_seqlen_arg=True),
            launch.PagedTwinLauncher("fa4_attention_paged", check_args=sm100.check_fa4_paged_args,
                                     config_class=sm100.config_class, compile_kernel=sm100._compile_paged_twin,
                                     max_seqlen_arg=True))


def _launcher_args(t, batch, pages, width, page_size=16, h=4, hkv=2, d=192, dv=128, sf_view="int32", split=False):
    gen = torch.Generator().manual_seed(t * 1000 + batch)
    q = torch.randn(t, h, d, generator=gen).to(torch.bfloat16)
    if split:
        kv = torch.randn(pages, page_size, hkv, d + dv, generator=gen).to(torch.bfloat16)
        k, v = kv[..., :d], kv[..., d:]
    else:
        k = torch.randn(pages, page_size, hkv, d, generator=gen).to(torch.bfloat16)
        v = torch.randn(pages, page_size, hkv, dv, generator=gen).to(torch.bfloat16)
    bounds = sorted(random.Random(t).sample(range(1, t), batch - 1)) if batch > 1 else []
    cu = torch.tensor([0] + bounds + [t], dtype=torch.int32)
    rows, cols = nvfp4.scale_shape(t, h * dv)
    sf = {"int32": lambda: torch.full((rows, cols // 4), 0x5A5A5A5A, dtype=torch.int32),
          "fp8": lambda: torch.full((rows, cols), 0x5A, dtype=torch.uint8).view(torch.float8_e4m3fn),
          "flat": lambda: torch.full((rows * cols,), 0x5A, dtype=torch.uint8)}[sf_view]()
    return dict(q=q, k_cache=k, v_cache=v, cu_seqlens=cu, max_seqlen=300,
                seqused_k=torch.full((batch,), 5, dtype=torch.int32),
                page_table=torch.randint(0, pages, (batch, width), dtype=torch.int32, generator=gen),
                max_seqlen_k=width * page_size, softmax_scale=0.125, causal=True,
                output=torch.zeros(t, h * dv // 2, dtype=torch.uint8), output_scale=torch.ones(1),
                output_block_scale=sf)


def _fused_call(launcher, a):
    return launcher(a["q"], a["k_cache"], a["v_cache"], a["cu_seqlens"], a["max_seqlen"], a["seqused_k"],
                    a["page_table"], a["max_seqlen_k"], a["softmax_scale"], a["causal"], a["output"],
                    a["output_scale"], a["output_block_scale"])


def _twin_call(launcher, a, return_lse=False):
    return launcher(a["q"], a["k_cache"], a["v_cache"], a["cu_seqlens"], a["max_seqlen"], a["seqused_k"],
                    a["page_table"], a["max_seqlen_k"], a["softmax_scale"], a["causal"], return_lse)


@pytest.mark.parametrize("generation", ["sm90", "sm100"])
@pytest.mark.parametrize("sf_view", ["int32", "fp8", "flat"])
@pytest.mark.parametrize("split", [False, True], ids=["separate", "split"])
def test_later_paged_calls_take_the_plan_and_hand_the_kernel_the_compiled_forms(generation, sf_view, split,
                                                                                monkeypatch):
    """Token counts, batch sizes, page counts and page-table widths are run-time values: one check, one
    compilation, one plan; the kernel gets the caller's tensors, no ``cu_seqlens_k``, then ``seqused_k`` and
    ``page_table`` (after ``max(max_seqlen, 1)`` on SM100); the scale padding is zeroed, no other byte touched."""
    rec = Recorder()
    fused, _ = _paged_launchers(generation, rec, monkeypatch)
    checks = []
    real_check = fused._check_args
    monkeypatch.setattr(fused, "_check_args", lambda *a: (checks.append(1), real_check(*a)))
    for t, batch, pages, width in ((300, 3, 40, 7), (301, 5, 90, 3), (128, 1, 7, 12), (1000, 17, 200, 30)):
        a = _launcher_args(t, batch, pages, width, sf_view=sf_view, split=split)
        _fused_call(fused, a)
        args = rec.launches[-1]
        q, k, v, o, packed, scale_bytes, gs, scale, cu, cu_k = args[:10]
        tail = args[10:]
        assert q is a["q"] and k is a["k_cache"] and v is a["v_cache"] and gs is a["output_scale"]
        assert cu is a["cu_seqlens"] and cu_k is None
        if generation == "sm100":
            assert tail[0] == 300 and tail[1] is a["seqused_k"] and tail[2] is a["page_table"] and len(tail) == 3
        else:
            assert tail[0] is a["seqused_k"] and tail[1] is a["page_table"] and len(tail) == 2
        assert o.shape == (t, 4, 128) and o.data_ptr() == q.data_ptr() and o.stride() == q.stride()
        assert packed.dtype == torch.uint8 and packed.shape == (t, 256) and packed.data_ptr() == a["output"].data_ptr()
        assert scale_bytes.dtype == torch.uint8 and scale_bytes.dim() == 1
        assert scale_bytes.data_ptr() == a["output_block_scale"].data_ptr()
        assert type(scale) is float and scale == 0.125
        rows, cols = nvfp4.scale_shape(t, 512)
        m = torch.arange(rows).unsqueeze(1).expand(rows, cols)
        c = torch.arange(cols).unsqueeze(0).expand(rows, cols)
        where = nvfp4.swizzled_offset(m, c, 32).reshape(-1)
        assert not scale_bytes[where[(m >= t).reshape(-1)]].any(), "padding rows zeroed"
        assert (scale_bytes[where[(m < t).reshape(-1)]] == 0x5A).all(), "no other byte touched"
    assert len(checks) == 1 and len(rec.compiled) == 1 and len(rec.launches) == 4


@pytest.mark.parametrize("generation", ["sm90", "sm100"])
def test_the_paged_twin_takes_the_plan_on_later_calls(generation, monkeypatch):
    rec = Recorder()
    _, twin = _paged_launchers(generation, rec, monkeypatch)
    for t, batch, lse in ((300, 3, False), (301, 4, False), (302, 2, True), (40, 40, True)):
        a = _launcher_args(t, batch, 50, 6)
        got = _twin_call(twin, a, lse)
        args = rec.launches[-1]
        q, k, v, out, lse_buf, scale, cu, cu_k = args[:8]
        assert q is a["q"] and k is a["k_cache"] and cu is a["cu_seqlens"] and cu_k is None and scale == 0.125
        assert args[-2] is a["seqused_k"] and args[-1] is a["page_table"]
        assert out.shape == (t, 4, 128) and out.dtype == torch.bfloat16 and (got[0] if lse else got) is out
        if lse:
            assert lse_buf.shape == (4, t) and lse_buf.dtype == torch.float32
            assert got[1].shape == (t, 4) and got[1].stride() == (1, t)
        else:
            assert lse_buf is None
    assert len(rec.compiled) == 2 and [c[-1] for c in rec.compiled] == [False, True]  # with and without LSE


@pytest.mark.parametrize("generation", ["sm90", "sm100"])
def test_the_page_size_and_the_cache_layout_are_part_of_the_plan(generation, monkeypatch):
    """Another page size, a split cache (other strides), another dtype: another plan (the compile functions decide
    whether that is another compilation); the same ones again: the plans."""
    rec = Recorder()
    fused, _ = _paged_launchers(generation, rec, monkeypatch)
    kinds = [dict(page_size=16), dict(page_size=64), dict(page_size=128), dict(page_size=16, split=True)]
    for kind in kinds + kinds:
        _fused_call(fused, _launcher_args(300, 3, 40, 7, **kind))
    assert [c[2] for c in rec.compiled] == [16, 64, 128, 16] and len(rec.launches) == 8


BAD_LATER = [(name, change, match) for name, change, match, where in BAD if where in ("both", "fused")]


@pytest.mark.parametrize("generation", ["sm90", "sm100"])
@pytest.mark.parametrize("name, change, match", BAD_LATER, ids=[b[0] for b in BAD_LATER])
def test_a_later_paged_call_the_checks_refuse_raises_the_same_error(generation, name, change, match, monkeypatch):
    """After a plan exists, a call with one bad argument does not take it: the checked path raises, nothing runs."""
    rec = Recorder()
    fused, _ = _paged_launchers(generation, rec, monkeypatch)
    good, good_buffers = _cpu_args()
    _fused_call(fused, {**good, **good_buffers})
    assert len(rec.launches) == 1
    args, buffers = _cpu_args()
    change(args, buffers)
    with pytest.raises(ArgumentError, match=match):
        _fused_call(fused, {**args, **buffers})
    assert len(rec.launches) == 1, "nothing launched for a refused call"


@pytest.mark.parametrize("generation", ["sm90", "sm100"])
def test_paged_calls_without_tokens_launch_nothing(generation, monkeypatch):
    rec = Recorder()
    fused, twin = _paged_launchers(generation, rec, monkeypatch)
    args, buffers = _cpu_args(t=0)
    args.update(cu_seqlens=torch.tensor([0, 0, 0], dtype=torch.int32), max_seqlen=0)
    _fused_call(fused, {**args, **buffers})
    out, lse = _twin_call(twin, args, True)
    assert out.shape == (0, 4, 128) and lse.shape == (0, 4) and not rec.launches and not rec.compiled


def test_sm100_configuration_on_paged_caches():
    """FA4 runs the S ping-pong only when pages are one key tile (TMA loads); q_stage as without pages."""
    for d, dv in sm100.SUPPORTED_HEAD_DIMS:
        for m in (1, 128, 129, 700):
            plain = sm100.kernel_config(d, dv, m)
            assert sm100.kernel_config(d, dv, m, sm100.TILE_N) == plain
            for page_size in (1, 16, 64, 256):
                assert sm100.kernel_config(d, dv, m, page_size) == sm100.KernelConfig(plain.q_stage, False)


# ---------------------------------------------------------------------------
# CPU: the constructor arguments are FA4's own interface's for the same paged call
# ---------------------------------------------------------------------------

CHOICE = textwrap.dedent("""
    import json, torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from flash_attn.cute import interface
    from fusion_pass.kernels.fa4 import forward, {modules}

    class Recorded(Exception):
        pass

    seen = []

    def recorder(who):
        class Recorder:  # stands in for the kernel class: records the constructor call, then stops
            def __init__(self, *args, **kwargs):
                seen.append(dict(who=who, args=[str(a) for a in args],
                                 kwargs={{k: v for k, v in kwargs.items() if isinstance(v, (bool, int, type(None)))}}))
                raise Recorded
        return Recorder

    {patch}
    with FakeTensorMode(allow_non_fake_inputs=True):
        for (d, dv), group, page_size, m, causal in {cases}:
            h, t, b, width = 8, 1000, 4, 40
            q = torch.empty(t, h, d, dtype=torch.bfloat16, device="cuda")
            k = torch.empty(64, page_size, h // group, d, dtype=torch.bfloat16, device="cuda")
            v = torch.empty(64, page_size, h // group, dv, dtype=torch.bfloat16, device="cuda")
            cu = torch.empty(b + 1, dtype=torch.int32, device="cuda")
            su = torch.empty(b, dtype=torch.int32, device="cuda")
            pt = torch.empty(b, width, dtype=torch.int32, device="cuda")
            case = dict(d=d, dv=dv, group=group, page_size=page_size, max_seqlen=m, causal=causal)
            for who, call in [
                ("fa4", lambda: interface.flash_attn_varlen_func(
                    q, k, v, cu_seqlens_q=cu, max_seqlen_q=m, seqused_k=su, page_table=pt, causal=causal,
                    num_splits=1, pack_gqa=False)),
                ("fused", lambda: forward.fa4_attention_nvfp4_paged(
                    q, k, v, cu_seqlens=cu, max_seqlen=m, seqused_k=su, page_table=pt, max_seqlen_k=width * page_size,
                    softmax_scale=0.1, causal=causal, output=torch.empty(t, h * dv // 2, dtype=torch.uint8,
                                                                         device="cuda"),
                    output_scale=torch.empty(1, device="cuda"),
                    output_block_scale=torch.empty(1024 * (h * dv // 16), dtype=torch.uint8, device="cuda"))),
                ("twin", lambda: forward.fa4_attention_paged(
                    q, k, v, cu_seqlens=cu, max_seqlen=m, seqused_k=su, page_table=pt, max_seqlen_k=width * page_size,
                    softmax_scale=0.1, causal=causal)),
            ]:
                try:
                    call()
                except Recorded:
                    seen[-1].update(case)
                else:
                    raise AssertionError(f"{{who}} built no kernel for {{case}}")
    print(json.dumps(seen))
""")

SM90_PATCH = """
from fusion_pass.kernels.fa4 import sm90_kernel, sm90_twin
interface.FlashAttentionForwardSm90 = recorder("fa4")
sm90_kernel.FlashAttentionForwardSm90Nvfp4 = recorder("fused")
sm90_twin.FlashAttentionForwardSm90Twin = recorder("twin")
"""

SM100_PATCH = """
from fusion_pass.kernels.fa4 import sm100_kernel, sm100_twin
interface.FlashAttentionForwardSm100 = recorder("fa4")
sm100_kernel.FlashAttentionForwardSm100Nvfp4 = recorder("fused")
sm100_twin.FlashAttentionForwardSm100Twin = recorder("twin")
"""


def _record_choices(generation: str, cases) -> list[dict]:
    module, env = GENERATIONS[generation]
    code = CHOICE.format(modules=generation, patch=textwrap.indent(
        (SM90_PATCH if generation == "sm90" else SM100_PATCH).strip(), ""), cases=repr(cases))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=dict(os.environ, **env), timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(seen) == 3 * len(cases)
    return seen


def _grouped(seen):
    by_case = {}
    for entry in seen:
        key = (entry["d"], entry["dv"], entry["group"], entry["page_size"], entry["max_seqlen"], entry["causal"])
        by_case.setdefault(key, {})[entry["who"]] = entry
    return by_case


@needs_fa4
def test_sm90_paged_kernels_are_built_as_fa4_builds_its_paged_forward():
    """For every supported head-dim pair, MHA and GQA, page sizes 16, 64, 128 (the key tile: TMA) and 256, causal
    and not: the fused kernel and the twin get FA4's own interface's constructor arguments for the same paged call
    (``pack_gqa=False``), ``paged_kv_non_tma`` included."""
    cases = [(dims, group, page_size, m, causal) for dims in sm90.SUPPORTED_HEAD_DIMS for group in (1, 4)
             for page_size in (16, 64, 128, 256) for m, causal in ((1, True), (700, True), (300, False))]
    by_case = _grouped(_record_choices("sm90", cases))
    assert len(by_case) == len(cases)
    tma = 0
    for (d, dv, group, page_size, m, causal), got in by_case.items():
        fa4, fused, twin = got["fa4"], got["fused"], got["twin"]
        assert fa4["args"] == fused["args"] == twin["args"] and fa4["args"][1:] == [str(d), str(dv), str(group)]
        for name, value in fused["kwargs"].items():
            assert fa4["kwargs"][name] == value == twin["kwargs"][name], (name, fa4, fused)
        assert set(fused["kwargs"]) >= {"tile_m", "tile_n", "num_stages", "intra_wg_overlap", "mma_pv_is_rs",
                                        "pack_gqa", "paged_kv_non_tma", "is_causal"}
        for name, value in fa4["kwargs"].items():  # FA4's other arguments: their defaults, which ours keep
            if name not in fused["kwargs"]:
                assert value is None or value is False or (type(value) is int and value == 1), (name, value)
        assert fused["kwargs"]["paged_kv_non_tma"] == (page_size != fused["kwargs"]["tile_n"])
        tma += not fused["kwargs"]["paged_kv_non_tma"]
    assert tma > 0, "no case took the TMA loads"


@needs_fa4
def test_sm100_paged_kernels_are_built_as_fa4_builds_its_paged_forward():
    """As for SM90: FA4's SM100 interface's constructor arguments for the same paged call, but for the one
    scheduling choice the project makes differently everywhere (``is_static_persistent``, ``sm100.py``)."""
    cases = [(dims, group, page_size, m, True) for dims in sm100.SUPPORTED_HEAD_DIMS for group in (1, 4)
             for page_size in (16, 64, 128) for m in (1, 128, 129, 700)]
    by_case = _grouped(_record_choices("sm100", cases))
    assert len(by_case) == len(cases)
    for (d, dv, group, page_size, m, causal), got in by_case.items():
        fa4, fused, twin = got["fa4"], got["fused"], got["twin"]
        assert fa4["args"] == fused["args"] == twin["args"] == [str(d), str(dv)]
        for name, value in fused["kwargs"].items():
            if name == "is_static_persistent":
                assert value is False and twin["kwargs"][name] is False
                assert fa4["kwargs"][name] == (m <= fa4["kwargs"]["q_stage"] * sm100.TILE_M), fa4
                continue
            assert fa4["kwargs"][name] == value == twin["kwargs"][name], (name, fa4, fused)
        assert fused["kwargs"]["paged_kv_non_tma"] == (page_size != sm100.TILE_N)
        assert fused["kwargs"]["pack_gqa"] is False and fused["kwargs"]["qhead_per_kvhead"] == group
        cfg = sm100.kernel_config(d, dv, m, page_size)
        assert (fused["kwargs"]["q_stage"], fused["kwargs"]["use_s_ping_pong"]) == tuple(cfg)


# ---------------------------------------------------------------------------
# CPU: compile-only, for sm_90a and sm_100a under FakeTensorMode
# ---------------------------------------------------------------------------

COMPILE = textwrap.dedent("""
    import logging, sys
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="LOG %(levelname)s %(message)s")
    logging.getLogger("fusion_pass").setLevel(logging.INFO)
    from fusion_pass.kernels.fa4 import forward
    generation, dims, groups, page_sizes, max_seqlens, dtype = {args}
    dtype = getattr(torch, dtype)
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert forward.fa4_generation("cuda") == generation
        for (d, dv), group, page_size, max_seqlen in [(x, g, p, m) for x in dims for g in groups for p in page_sizes
                                                      for m in max_seqlens]:
            t, h, b, pages, width = 1000, 8, 5, 64, 24
            hkv = h // group
            q = torch.empty(t, h, d, dtype=dtype, device="cuda")
            # keys and values split along the last dim of one cache [pages, page_size, Hkv, D + Dv] (vLLM's
            # FLASH_ATTN layout); slicing a fake CUDA tensor fails on a CPU-only torch, so the views are built
            row = hkv * (d + dv)
            k = torch.empty_strided((pages, page_size, hkv, d), (page_size * row, row, d + dv, 1), dtype=dtype,
                                    device="cuda")
            v = torch.empty_strided((pages, page_size, hkv, dv), (page_size * row, row, d + dv, 1), dtype=dtype,
                                    device="cuda")
            cu = torch.empty(b + 1, dtype=torch.int32, device="cuda")
            seqused = torch.empty(b, dtype=torch.int32, device="cuda")
            table = torch.empty(b, width, dtype=torch.int32, device="cuda")
            paged = dict(cu_seqlens=cu, max_seqlen=max_seqlen, seqused_k=seqused, page_table=table,
                         max_seqlen_k=width * page_size, softmax_scale=0.1, causal=True)
            gs = torch.empty(1, dtype=torch.float32, device="cuda")
            out = torch.empty(t, h * dv // 2, dtype=torch.uint8, device="cuda")
            sf = torch.empty(1024 * ((h * dv // 16 + 3) // 4 * 4), dtype=torch.uint8, device="cuda")
            forward.fa4_attention_nvfp4_paged(q, k, v, **paged, output=out, output_scale=gs, output_block_scale=sf)
            print("fused", d, dv, group, page_size, max_seqlen, flush=True)
            o = forward.fa4_attention_paged(q, k, v, **paged)
            assert o.shape == (t, h, dv) and o.dtype == dtype
            print("twin", d, dv, group, page_size, max_seqlen, flush=True)
        o, lse = forward.fa4_attention_paged(q, k, v, **paged, return_lse=True)  # the LSE variant once
        assert o.shape == (t, h, dv) and lse.shape == (t, h)
        print("twin+lse", flush=True)
""")

COMPILED = re.compile(r"LOG INFO fusion_pass: fa4: compiled the (SM90|SM100) (NVFP4|twin \(FA4 (?:epilogue|output "
                      r"stage)(, LSE)?\)) attention kernel \((\w+), head dims \((\d+), (\d+)\), (\d+) query heads per "
                      r"KV head, causal=True, (.*), paged KV \((TMA|cp\.async) loads\)\)")


def _compile_paged(generation, dims, groups, page_sizes, max_seqlens, dtype="bfloat16"):
    """Run the compile script for ``sm_90a`` / ``sm_100a``: every combination compiles once per configuration (one
    cp.async compilation serves every page size but the key tile's). Returns the compile log's matches."""
    _, env = GENERATIONS[generation]
    env = dict(os.environ, **env)
    env.pop("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", None)
    args = (generation, list(dims), list(groups), list(page_sizes), list(max_seqlens), dtype)
    result = subprocess.run([sys.executable, "-c", COMPILE.format(args=repr(args))], capture_output=True, text=True,
                            env=env, timeout=1800)
    assert result.returncode == 0, result.stderr[-4000:]
    n = len(dims) * len(groups) * len(page_sizes) * len(max_seqlens)
    assert result.stdout.count("fused") == n and result.stdout.count("twin ") == n, result.stdout
    assert "twin+lse" in result.stdout
    compiled = COMPILED.findall(result.stderr)
    assert all(g == generation.upper() and dt == dtype for g, _, _, dt, *_ in compiled), result.stderr[-4000:]
    # one compilation per (kind, dims, group, configuration, load path): nothing compiled twice, but for the LSE
    # variant of the twin, which the SM100 log does not tell from the twin without it
    keys = [(kind, d, dv, heads, cfg, loads) for _, kind, _, _, d, dv, heads, cfg, loads in compiled]
    counts = Counter(keys)
    twice = [key for key, n in counts.items() if n > 1]
    if generation == "sm90":
        assert not twice and sum("LSE" in key[0] for key in keys) == 1, result.stderr[-4000:]
    else:
        assert len(twice) == 1 and counts[twice[0]] == 2 and twice[0][0].startswith("twin"), result.stderr[-4000:]
    return sorted(set(keys)), result.stderr


def _tile_n(generation, d, dv):
    return sm90.kernel_config(d, dv, True).tile_n if generation == "sm90" else sm100.TILE_N


def _check_sweep(generation, keys, stderr, dims, groups, page_sizes, max_seqlens):
    loads = lambda d, dv: {"TMA" if p == _tile_n(generation, d, dv) else "cp.async" for p in page_sizes}  # noqa
    classes = {sm100.config_class(m) for m in max_seqlens} if generation == "sm100" else {0}
    for d, dv in dims:
        for kind in ("NVFP4", "twin (FA4 epilogue)" if generation == "sm90" else "twin (FA4 output stage)"):
            got = {(int(heads), how, cfg) for k, a, b, heads, cfg, how in keys if k == kind and (a, b) == (str(d),
                                                                                                     str(dv))}
            assert {(h, how) for h, how, _ in got} == {(g, how) for g in groups for how in loads(d, dv)}, stderr
            assert len(got) == len(groups) * len(loads(d, dv)) * len(classes), stderr[-4000:]
        for _, a, b, heads, cfg, how in keys:
            if generation == "sm100" and (int(a), int(b)) == (d, dv):
                ping = "use_s_ping_pong=True" in cfg
                assert not ping or (how == "TMA" and "q_stage=1" in cfg and d == dv), cfg


@needs_fa4
@pytest.mark.parametrize("generation", ["sm90", "sm100"])
def test_paged_kernel_compiles_for_one_head_dim_pair(generation):
    """A quick check that ``make test`` runs: MHA (the sweep below compiles GQA), fp16, pages of 16 and of the key
    tile (TMA), decode-only (``max_seqlen`` 1): fused and twin."""
    dims = [(192, 128)] if generation == "sm90" else [(128, 128)]
    tile = _tile_n(generation, *dims[0])
    pages = (16, tile) if generation == "sm90" else (16,)
    keys, stderr = _compile_paged(generation, dims, (1,), pages, (1,), "float16")
    _check_sweep(generation, keys, stderr, dims, (1,), pages, (1,))


SWEEP = [pytest.param(generation, dims, id=f"{generation}-{dims[0]}x{dims[1]}")
         for generation, module in (("sm90", sm90), ("sm100", sm100)) for dims in module.SUPPORTED_HEAD_DIMS]


@pytest.mark.slow  # an exhaustive sweep: make test-slow
@needs_fa4
@pytest.mark.parametrize("generation, dims", SWEEP)
def test_paged_kernel_compiles_for_every_head_dim_pair_page_size_and_head_grouping(generation, dims):
    """Fused and twin, GQA (4 query heads per KV head; MHA: the quick test above, and every varlen sweep), pages of
    16, 64 and the key tile, and on SM100 both Q-tile configurations (``max_seqlen`` 1: a decode batch; 700): each
    compiles once, the page sizes that are not the key tile sharing one cp.async compilation; S ping-pong only with
    TMA loads. (GQA only to keep CI's make test-slow short: the grouping is a compile constant FA4 handles alike.)"""
    tile = _tile_n(generation, *dims)
    pages, max_seqlens = (16, 64, tile), ((1, 700) if generation == "sm100" else (700,))
    keys, stderr = _compile_paged(generation, [dims], (4,), pages, max_seqlens)
    _check_sweep(generation, keys, stderr, [dims], (4,), pages, max_seqlens)


# ---------------------------------------------------------------------------
# GPU (SM90): batches over a paged cache
# ---------------------------------------------------------------------------

# (name, H, Hkv, D, Dv)
HEADS = [("mla16", 16, 16, 192, 128), ("gqa", 32, 8, 128, 128), ("gqa_d64", 8, 2, 64, 64)]
KINDS = ["decode", "prefill", "context", "mixed"]
EDGE_KEYS = [1, 15, 16, 17, 127, 128, 129, 1000]

LSE_ATOL = 1e-3
"""As test_fa4.py's: the float32 score dots bound the log-sum-exp's error."""


def batch_lengths(kind: str, rng: random.Random) -> tuple[list[int], list[int]]:
    """``(query_lens, key_lens)`` of a batch of ``kind``: decode rows (``Lq = 1``, some key counts at page and tile
    edges), prefills without context (``Lk = Lq``), prefills after cached context (``Lk > Lq``), or a shuffled mix
    of the three."""
    def decode():
        return 1, rng.choice(EDGE_KEYS) if rng.random() < 0.3 else rng.randint(1, 2000)

    def prefill():
        n = rng.randint(1, 300)
        return n, n

    def context():
        n = rng.randint(2, 300)
        return n, n + rng.randint(1, 1500)

    makers = {"decode": [decode] * rng.randint(8, 40),
              "prefill": [prefill] * rng.randint(2, 6),
              "context": [context] * rng.randint(2, 6),
              "mixed": [decode] * rng.randint(4, 20) + [prefill] * rng.randint(1, 3) + [context] * rng.randint(1, 3)}
    chosen = makers[kind]
    rng.shuffle(chosen)
    lengths = [make() for make in chosen]
    return [lq for lq, _ in lengths], [lk for _, lk in lengths]


@dataclass
class PagedCase:
    seed: int
    query_lens: list[int]
    key_lens: list[int]
    page_size: int
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu: torch.Tensor
    seqused_k: torch.Tensor
    page_table: torch.Tensor
    k_packed: torch.Tensor  # the sequences' keys and values packed ([sum Lk, Hkv, D|Dv], float32 on the CPU)
    v_packed: torch.Tensor

    def __str__(self) -> str:
        return (f"seed {self.seed}: page size {self.page_size}, {self.k_cache.shape[0]} pages, "
                f"Lq {self.query_lens}, Lk {self.key_lens}")

    def kwargs(self, causal: bool = True, scale: float | None = None) -> dict:
        return dict(cu_seqlens=self.cu, max_seqlen=max(self.query_lens), seqused_k=self.seqused_k,
                    page_table=self.page_table, max_seqlen_k=self.page_table.shape[1] * self.page_size,
                    softmax_scale=self.q.shape[2] ** -0.5 if scale is None else scale, causal=causal)


def paged_case(seed: int, kind: str, heads, page_size: int, dtype, *, split: bool = False,
               device: str = "cuda") -> PagedCase:
    """A batch of ``kind`` over a shared pool of pages: each sequence's pages drawn from a shuffled pool (not in
    order, interleaved with the other sequences' and with spare pages), the page table wider than any sequence
    needs and its unused entries pointing at random pages, every slot that holds no key of a sequence filled with
    other (finite) data, values spread over a few orders of magnitude. ``split``: keys and values views of one
    ``[num_pages, page_size, Hkv, D + Dv]`` cache."""
    h, hkv, d, dv = heads
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    query_lens, key_lens = batch_lengths(kind, rng)
    b = len(query_lens)
    pages_needed = [-(-lk // page_size) for lk in key_lens]
    width = max(pages_needed) + rng.randint(0, 3)
    num_pages = sum(pages_needed) + rng.randint(1, 16)
    pool = list(range(num_pages))
    rng.shuffle(pool)
    k_cache = torch.randn(num_pages, page_size, hkv, d, generator=gen) * 2
    v_cache = torch.randn(num_pages, page_size, hkv, dv, generator=gen) * 2
    table = torch.empty(b, width, dtype=torch.int64)
    keys, values = [], []
    for i, (lk, n) in enumerate(zip(key_lens, pages_needed)):
        mine = [pool.pop() for _ in range(n)]
        table[i] = torch.tensor(mine + [rng.randrange(num_pages) for _ in range(width - n)])
        j = torch.arange(lk)
        pages, slots = table[i, j // page_size], j % page_size
        keys.append(torch.randn(lk, hkv, d, generator=gen))
        values.append(torch.randn(lk, hkv, dv, generator=gen) * torch.exp(torch.randn(lk, hkv, 1, generator=gen)))
        k_cache[pages, slots] = keys[-1]
        v_cache[pages, slots] = values[-1]
    q = torch.randn(sum(query_lens), h, d, generator=gen)
    if split:
        kv = torch.cat([k_cache, v_cache], dim=-1).to(device, dtype)
        k_dev, v_dev = kv[..., :d], kv[..., d:]
    else:
        k_dev, v_dev = k_cache.to(device, dtype), v_cache.to(device, dtype)
    cu = torch.tensor([0] + list(itertools.accumulate(query_lens)), dtype=torch.int32, device=device)
    return PagedCase(seed, query_lens, key_lens, page_size, q.to(device, dtype), k_dev, v_dev, cu,
                     torch.tensor(key_lens, dtype=torch.int32, device=device), table.to(device, torch.int32),
                     torch.cat(keys), torch.cat(values))


def gather_reference(case: PagedCase, causal: bool, scale: float):
    """float32 attention with keys and values gathered through the page table (key ``j`` of sequence ``b`` at
    ``cache[page_table[b, j // page_size], j % page_size]``), causal bottom-right: ``(out [T, H, Dv], lse [T, H])``."""
    q, k_cache, v_cache = case.q, case.k_cache, case.v_cache
    t, h, _ = q.shape
    group = h // k_cache.shape[2]
    out = torch.zeros(t, h, v_cache.shape[3], dtype=torch.float32, device=q.device)
    lse = torch.full((t, h), float("-inf"), dtype=torch.float32, device=q.device)
    bounds = case.cu.tolist()
    table = case.page_table.long()
    for i, lk in enumerate(case.seqused_k.tolist()):
        a, e = bounds[i], bounds[i + 1]
        j = torch.arange(lk, device=q.device)
        pages, slots = table[i, j // case.page_size], j % case.page_size
        ks = k_cache[pages, slots].float().repeat_interleave(group, 1)
        vs = v_cache[pages, slots].float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[a:e].float(), ks) * scale
        if causal:
            visible = torch.ones(e - a, lk, dtype=torch.bool, device=q.device).tril(lk - (e - a))
            scores = scores.masked_fill(~visible, float("-inf"))
        row_lse = torch.logsumexp(scores, -1)
        p = torch.exp(scores - torch.where(row_lse.isneginf(), 0.0, row_lse)[..., None])
        out[a:e] = torch.einsum("hqk,khd->qhd", p, vs)
        lse[a:e] = row_lse.t()
    return out, lse


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page_size", [16, 64, 128])
def test_the_gpu_cases_hold_each_sequences_keys_where_the_page_table_says(kind, page_size):
    """CPU check of the GPU tests' own helpers: a generated batch's pages are disjoint between sequences and in
    range, its rows are of its kind, and the float32 reference gathered through the page table (of separate or
    split caches, by the seed) equals float64 attention over each sequence's packed keys
    (``context_cases.reference_context_attention``)."""
    from context_cases import cumulative, reference_context_attention

    seed = fresh_seed()
    case = paged_case(seed, kind, (4, 2, 64, 32), page_size, torch.float32, split=bool(seed % 2), device="cpu")
    lq, lk = case.query_lens, case.key_lens
    assert all(k >= q >= 1 for q, k in zip(lq, lk)), case
    rows = list(zip(lq, lk))
    decode, prefill, context = ([q == 1 for q, _ in rows], [q == k for q, k in rows], [k > q for q, k in rows])
    assert {"decode": all(decode), "prefill": all(prefill), "context": all(context),
            "mixed": any(decode) and any(prefill) and any(context)}[kind], case
    owned = [case.page_table[i, : -(-k // page_size)].tolist() for i, k in enumerate(lk)]
    flat = [page for pages in owned for page in pages]
    assert len(flat) == len(set(flat)) and 0 <= min(flat) and max(case.page_table.flatten().tolist()) < \
        case.k_cache.shape[0], case
    assert case.page_table.shape[1] * page_size >= max(lk)
    for causal in (True, False):
        out, lse = gather_reference(case, causal, 0.125)
        ref, ref_lse = reference_context_attention(case.q, case.k_packed, case.v_packed, case.cu,
                                                   cumulative(lk, device="cpu"), causal, 0.125)
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4, msg=str(case))
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-4, msg=str(case))


def _fused_paged(case: PagedCase, gs, poison_out: int, poison_scale: int, causal: bool = True):
    t, h, dv = case.q.shape[0], case.q.shape[1], case.v_cache.shape[3]
    rows, cols = nvfp4.scale_shape(t, h * dv)
    packed = torch.full((t, h * dv // 2), poison_out, dtype=torch.uint8, device="cuda")
    scales = torch.full((rows, cols), poison_scale, dtype=torch.uint8, device="cuda")
    forward.fa4_attention_nvfp4_paged(case.q, case.k_cache, case.v_cache, **case.kwargs(causal), output=packed,
                                      output_scale=gs, output_block_scale=scales.view(torch.float8_e4m3fn))
    torch.cuda.synchronize()
    return packed.cpu(), scales.cpu().view(-1)


def _check_paged_bytes(case: PagedCase, causal: bool = True, special: bool = False):
    """Both poisons: every packed byte and every scale byte (padding zero included) equal ``nvfp4.quantize`` of the
    twin's output on the same arguments."""
    where = str(case)
    ref = sm90.fa4_attention_paged(case.q, case.k_cache, case.v_cache, **case.kwargs(causal))
    t, h, dv = ref.shape
    assert ref.dtype == case.q.dtype and (t, h, dv) == (case.q.shape[0], case.q.shape[1], case.v_cache.shape[3])
    finite = ref.float()[ref.float().isfinite()]
    gs = torch.tensor([448 * 6 / max(finite.abs().max().item(), 1e-6)], dtype=torch.float32, device="cuda")
    want_packed, want_scales = nvfp4.quantize(ref.reshape(t, h * dv).cpu(), gs.cpu(), swizzled=True)
    want_scales = want_scales.view(torch.uint8).reshape(-1)
    runs = [_fused_paged(case, gs, *poison, causal=causal) for poison in ((0xA5, 0x5A), (0x00, 0xFF))]
    for i, (packed, scales) in enumerate(runs):
        bad = (packed != want_packed).nonzero()
        assert len(bad) == 0, (f"{len(bad)} packed bytes differ from quantize(twin) (run {i}), first (row, byte) "
                               f"{bad[:8].tolist()}, rows {bad[:, 0].unique()[:20].tolist()} ({where})")
        diff = (scales != want_scales).sum().item()
        assert diff == 0, f"{diff} scale bytes differ from quantize(twin), padding included (run {i}) ({where})"
    if special:
        assert bool((runs[0][1] == 0x7F).any()) or bool((runs[0][1] == 0x7E).any()), where


@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("heads", HEADS, ids=[h[0] for h in HEADS])
def test_paged_fused_bytes_equal_quantize_of_the_twin(kind, page_size, heads):
    seed = fresh_seed()
    dtype = (torch.bfloat16, torch.float16)[seed % 2]
    case = paged_case(seed, kind, heads[1:], page_size, dtype)
    _check_paged_bytes(case)


@gpu
@pytest.mark.parametrize("kind", ["mixed", "context"])
def test_paged_fused_bytes_non_causal(kind):
    seed = fresh_seed()
    case = paged_case(seed, kind, (32, 8, 128, 128), 16, torch.bfloat16)
    _check_paged_bytes(case, causal=False)


@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page_size", [16, 64, 128])
def test_the_paged_twin_equals_fa4s_own_paged_forward(kind, page_size):
    """The twin and FA4's public ``flash_attn_varlen_func(..., seqused_k, page_table, pack_gqa=False,
    num_splits=1)``: the same configuration (FA4's own) and the same output and log-sum-exp, bit for bit."""
    from flash_attn.cute import interface

    seed = fresh_seed()
    _, h, hkv, d, dv = HEADS[seed % len(HEADS)]
    dtype = (torch.bfloat16, torch.float16)[(seed // 3) % 2]
    case = paged_case(seed, kind, (h, hkv, d, dv), page_size, dtype)
    assert len(case.query_lens) <= 256, "FA4 adds a batch-lookup aid above 256 sequences (it only places tiles)"
    kwargs = case.kwargs()
    assert sm90.kernel_config(d, dv, True, kwargs["max_seqlen"], kwargs["max_seqlen_k"]) == \
        sm90_configs.fa4_default(d, dv, True)
    out, lse = sm90.fa4_attention_paged(case.q, case.k_cache, case.v_cache, **kwargs, return_lse=True)
    ref, ref_lse = interface.flash_attn_varlen_func(
        case.q, case.k_cache, case.v_cache, cu_seqlens_q=case.cu, max_seqlen_q=kwargs["max_seqlen"],
        seqused_k=case.seqused_k, page_table=case.page_table, softmax_scale=kwargs["softmax_scale"], causal=True,
        num_splits=1, pack_gqa=False, return_lse=True)
    assert torch.equal(out, ref), f"output differs from FA4's paged forward ({case}, heads {h}/{hkv} {d}/{dv})"
    assert torch.equal(lse, ref_lse.t()), f"log-sum-exp differs from FA4's ({case}, heads {h}/{hkv} {d}/{dv})"


@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_the_paged_twin_against_a_gathered_float32_reference(kind, page_size, causal):
    """The twin's output within bf16/fp16 tolerance of float32 attention over keys gathered through the page table
    (every element within 2**-7 of its magnitude plus 2**-7 of its (row, head)'s largest, the whole within 1%
    in norm), its log-sum-exp within :data:`LSE_ATOL`."""
    seed = fresh_seed()
    name, h, hkv, d, dv = HEADS[seed % len(HEADS)]
    dtype = (torch.bfloat16, torch.float16)[(seed // 3) % 2]
    case = paged_case(seed, kind, (h, hkv, d, dv), page_size, dtype)
    where = f"{name}, {dtype}: {case}"
    kwargs = case.kwargs(causal)
    out, lse = sm90.fa4_attention_paged(case.q, case.k_cache, case.v_cache, **kwargs, return_lse=True)
    ref, ref_lse = gather_reference(case, causal, kwargs["softmax_scale"])
    got = out.float()
    assert bool(got.isfinite().all()), where
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, f"relative error {rel:.2e} ({where})"
    bound = 2**-7 * ref.abs() + 2**-7 * ref.abs().amax(-1, keepdim=True)
    bad = ((got - ref).abs() > bound).nonzero()
    assert len(bad) == 0, f"{len(bad)} elements off, first (row, head, dim) {bad[:8].tolist()} ({where})"
    err = (lse - ref_lse).abs().max().item()
    assert err <= LSE_ATOL, f"log-sum-exp off by {err:.2e} ({where})"


@gpu
@pytest.mark.parametrize("page_size", [16, 128])
def test_paged_fused_bytes_with_inf_and_nan_in_the_cache(page_size):
    """An infinity and a NaN in keys' values that rows see: the epilogue writes the bytes of the NaN/Inf contract,
    equal to quantize(twin) (docs/design.md, "A NaN or an infinity in the inputs")."""
    seed = fresh_seed()
    case = paged_case(seed, "mixed", (16, 16, 192, 128), page_size, torch.bfloat16)
    table = case.page_table.cpu()
    for i, (value, head, dim) in zip(range(2), ((float("inf"), 3, 5), (float("nan"), 7, 40))):
        lk = case.key_lens[i]
        j = lk - 1  # the last key: visible to every query of the sequence (causal bottom-right)
        case.v_cache[int(table[i, j // page_size]), j % page_size, head, dim] = value
    _check_paged_bytes(case, special=True)


@gpu
@pytest.mark.parametrize("page_size", [16, 128])
def test_a_split_cache_gives_the_bytes_of_separate_caches(page_size):
    """Keys and values as views of one ``[num_pages, page_size, Hkv, D + Dv]`` cache (vLLM's FLASH_ATTN layout): the
    twin's output equals that on separate contiguous caches bit for bit, and the fused bytes equal quantize(twin)."""
    seed = fresh_seed()
    split = paged_case(seed, "mixed", (32, 8, 128, 128), page_size, torch.bfloat16, split=True)
    separate = paged_case(seed, "mixed", (32, 8, 128, 128), page_size, torch.bfloat16)
    assert not split.k_cache.is_contiguous() and split.k_cache.stride(1) == 8 * 256
    a = sm90.fa4_attention_paged(split.q, split.k_cache, split.v_cache, **split.kwargs())
    b = sm90.fa4_attention_paged(separate.q, separate.k_cache, separate.v_cache, **separate.kwargs())
    assert torch.equal(a, b), str(split)
    _check_paged_bytes(split)


@gpu
def test_later_paged_calls_do_not_synchronize():
    """The fused call and the twin read no value back (``torch.cuda.set_sync_debug_mode("error")``), once compiled;
    another batch over the same cache takes the same plan."""
    from context_cases import call_without_host_sync

    case = paged_case(fresh_seed(), "mixed", (16, 16, 192, 128), 16, torch.bfloat16)
    t = case.q.shape[0]
    rows, cols = nvfp4.scale_shape(t, 16 * 128)
    bufs = dict(output=torch.empty(t, 16 * 64, dtype=torch.uint8, device="cuda"),
                output_scale=torch.ones(1, device="cuda"),
                output_block_scale=torch.empty(rows, cols // 4, dtype=torch.int32, device="cuda"))
    call_without_host_sync(lambda: sm90.fa4_attention_nvfp4_paged(case.q, case.k_cache, case.v_cache,
                                                                  **case.kwargs(), **bufs))
    call_without_host_sync(lambda: sm90.fa4_attention_paged(case.q, case.k_cache, case.v_cache, **case.kwargs(),
                                                            return_lse=True))
