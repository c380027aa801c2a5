"""The FA4 kernels' per-call path (fusion_pass/kernels/fa4/launch.py) and the SM90 configurations (sm90_configs.py).

CPU (no GPU; FA4 needed only where marked): the scale padding's one-launch fill equals the strided fills on
generated sizes; the launcher checks every argument on the first call of a kind, and on later calls takes its plan
only where the checked path would have accepted the call (generated changes of every argument); the plan hands
the kernel the caller's tensors in the compiled form; the configuration class picks the configuration; FA4's
default restated equals FA4's own; every table entry and sweep candidate is valid, agrees with FA4's config
search arithmetic, and compiles, fused kernel and twin, for ``sm_90a`` under ``FakeTensorMode``.

GPU (an SM90 device with FA4): the twin equals FA4's ``flash_attn_varlen_func`` (output and log-sum-exp) at FA4's
configuration; the fused bytes equal ``quantize`` of the twin at other configurations; later calls (the plan)
give the same bytes as the first and do not synchronize.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from fusion_pass import nvfp4
from fusion_pass.kernels.checks import zero_nvfp4_scale_padding
from fusion_pass.kernels.fa4 import launch, sm90, sm90_configs
from fusion_pass.kernels.fa4.sm90_configs import Sm90Config

needs_fa4 = pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None,
                               reason="flash_attn.cute is not installed (the fa4 extra)")


def fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


# ---------------------------------------------------------------------------
# CPU: the scale padding
# ---------------------------------------------------------------------------


def test_scale_padding_in_one_fill_equals_the_strided_fills():
    """Generated T and widths (with and without column padding): the same bytes as zero_nvfp4_scale_padding,
    every other byte kept."""
    seed = fresh_seed()
    gen = random.Random(seed)
    padding = launch.ScalePadding()
    for _ in range(200):
        t = gen.choice([1, 127, 128, 129, 255, 256, 257]) if gen.random() < 0.3 else gen.randrange(1, 700)
        blocks = gen.choice([4, 8, 12, 64, 6, 10, 3])
        rows, cols = nvfp4.scale_shape(t, blocks * 16)
        buf = torch.randint(1, 256, (rows * cols,), dtype=torch.uint8, generator=torch.Generator().manual_seed(gen.randrange(2**31)))
        want = buf.clone()
        zero_nvfp4_scale_padding(want, t, blocks * 16)
        padding(buf, t, blocks * 16)
        assert torch.equal(buf, want), f"T={t}, blocks={blocks} (seed {seed})"


# ---------------------------------------------------------------------------
# CPU: the launcher's two paths, with a stand-in for the compiled kernel
# ---------------------------------------------------------------------------


class Recorder:
    """Stands in for the compile functions: counts compilations and records each launch's arguments."""

    def __init__(self):
        self.compiled, self.launches = [], []

    def fused(self, q, k, v, o, packed, output_scale, scale_bytes, cu, cu_k, config, causal):
        self.compiled.append(config)
        return lambda *args: self.launches.append(args)

    def twin(self, q, k, v, out, lse, cu, cu_k, config, causal):
        self.compiled.append(("twin", config, lse is not None))
        return lambda *args: self.launches.append(args)


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(sm90, "compile_nvfp4_kernel", rec.fused)
    monkeypatch.setattr(sm90, "compile_twin_kernel", rec.twin)
    return rec


def _args(t=300, h=4, hkv=2, d=192, dv=128, dtype=torch.bfloat16, sf_view="int32", context=False):
    gen = torch.Generator().manual_seed(0)
    tk = t + 50 if context else t
    q = torch.randn(t, h, d, generator=gen).to(dtype)
    k = torch.randn(tk, hkv, d, generator=gen).to(dtype)
    v = torch.randn(tk, hkv, dv, generator=gen).to(dtype)
    rows, cols = nvfp4.scale_shape(t, h * dv)
    sf = {"int32": lambda: torch.full((rows, cols // 4), 0x5A5A5A5A, dtype=torch.int32),
          "fp8": lambda: torch.full((rows, cols), 0x5A, dtype=torch.uint8).view(torch.float8_e4m3fn),
          "flat": lambda: torch.full((rows * cols,), 0x5A, dtype=torch.uint8)}[sf_view]()
    args = dict(q=q, k=k, v=v, cu_seqlens=torch.tensor([0, t // 3, t], dtype=torch.int32), max_seqlen=t - t // 3,
                softmax_scale=0.125, causal=True, output=torch.zeros(t, h * dv // 2, dtype=torch.uint8),
                output_scale=torch.ones(1), output_block_scale=sf, cu_seqlens_k=None, max_seqlen_k=None)
    if context:
        args.update(cu_seqlens_k=torch.tensor([0, 100, tk], dtype=torch.int32), max_seqlen_k=250)
    return args


def _call(launcher, a):
    return launcher(a["q"], a["k"], a["v"], a["cu_seqlens"], a["max_seqlen"], a["softmax_scale"], a["causal"],
                    a["output"], a["output_scale"], a["output_block_scale"], a["cu_seqlens_k"], a["max_seqlen_k"])


@pytest.mark.parametrize("sf_view", ["int32", "fp8", "flat"])
@pytest.mark.parametrize("context", [False, True], ids=["self", "context"])
def test_later_calls_take_the_plan_and_hand_the_kernel_the_compiled_forms(recorder, monkeypatch, sf_view, context):
    fused, _ = sm90.launchers()
    checks = []
    real_check = sm90.check_fa4_args
    monkeypatch.setattr(fused, "_check_args", lambda *a: (checks.append(1), real_check(*a)))
    for t in (300, 301, 128, 1000):  # token counts are run-time values: one plan
        a = _args(t=t, sf_view=sf_view, context=context)
        a["max_seqlen"] = 300  # one configuration class
        _call(fused, a)
        q, k, v, o, packed, scale_bytes, gs, scale, cu, cu_k = recorder.launches[-1]
        assert q is a["q"] and k is a["k"] and v is a["v"] and gs is a["output_scale"] and cu is a["cu_seqlens"]
        assert cu_k is (a["cu_seqlens"] if not context else a["cu_seqlens_k"])
        assert o.shape == (t, 4, 128) and o.data_ptr() == q.data_ptr() and o.stride() == q.stride()
        assert packed.dtype == torch.uint8 and packed.shape == (t, 256) and packed.data_ptr() == a["output"].data_ptr()
        assert scale_bytes.dtype == torch.uint8 and scale_bytes.dim() == 1
        assert scale_bytes.data_ptr() == a["output_block_scale"].data_ptr()
        assert scale_bytes.numel() == nvfp4.round_up(t, 128) * 32 and type(scale) is float and scale == 0.125
        rows, cols = nvfp4.scale_shape(t, 512)
        m = torch.arange(rows).unsqueeze(1).expand(rows, cols)
        c = torch.arange(cols).unsqueeze(0).expand(rows, cols)
        where = nvfp4.swizzled_offset(m, c, 32).reshape(-1)
        assert not scale_bytes[where[(m >= t).reshape(-1)]].any(), "padding rows zeroed"
        assert (scale_bytes[where[(m < t).reshape(-1)]] == 0x5A).all(), "no other byte touched"
    assert len(checks) == 1 and len(recorder.compiled) == 1 and len(recorder.launches) == 4


BAD = [  # (what, change, error): the fast path must not take any of these; the checked path raises
    ("q dtype", lambda a: a.update(q=a["q"].float()), r"q must be float16 or bfloat16"),
    ("q 2-D", lambda a: a.update(q=a["q"][:, 0]), r"q must be a 3-D tensor"),
    ("k tokens", lambda a: a.update(k=a["k"][:-1], v=a["v"][:-1]), r"same number of tokens"),
    ("v tokens", lambda a: a.update(v=a["v"][:-1]), r"same number of tokens"),
    ("q misaligned", lambda a: a.update(q=torch.zeros(a["q"].numel() + 1, dtype=a["q"].dtype)[1:].view(a["q"].shape)),
     r"q must be 16-byte aligned"),
    ("output short", lambda a: a.update(output=a["output"][:-1]), r"output must be contiguous with T \* H \* Dv / 2"),
    ("output strided", lambda a: a.update(output=torch.zeros(a["output"].shape[0], 512, dtype=torch.uint8)[:, ::2]),
     r"output must be contiguous"),
    ("output misaligned", lambda a: a.update(output=torch.zeros(a["output"].numel() + 8, dtype=torch.uint8)[8:].view(
        a["output"].shape)), r"output must be 16-byte aligned"),
    ("scales short", lambda a: a.update(output_block_scale=a["output_block_scale"][:-1]),
     r"output_block_scale must be a contiguous buffer"),
    ("scales strided", lambda a: a.update(output_block_scale=torch.zeros(
        a["output_block_scale"].shape[0], 2 * a["output_block_scale"].shape[1], dtype=torch.int32)[:, ::2]),
     r"output_block_scale must be a contiguous buffer"),
    ("cu one entry", lambda a: a.update(cu_seqlens=a["cu_seqlens"][:1]), r"cu_seqlens must be contiguous int32 \[B \+ 1 >= 2\]"),
    ("cu int64", lambda a: a.update(cu_seqlens=a["cu_seqlens"].long()), r"cu_seqlens must be a 1-D int32"),
    ("max_seqlen negative", lambda a: a.update(max_seqlen=-1), r"max_seqlen must be a non-negative int"),
    ("max_seqlen float", lambda a: a.update(max_seqlen=300.0), r"max_seqlen must be a non-negative int"),
    ("max_seqlen bool", lambda a: a.update(max_seqlen=True), r"max_seqlen must be a non-negative int"),
    ("scale nan", lambda a: a.update(softmax_scale=float("nan")), r"softmax_scale must be a positive finite"),
    ("scale inf", lambda a: a.update(softmax_scale=float("inf")), r"softmax_scale must be a positive finite"),
    ("scale zero", lambda a: a.update(softmax_scale=0.0), r"softmax_scale must be a positive finite"),
    ("causal int", lambda a: a.update(causal=1), r"causal must be a bool"),
    ("max_seqlen_k alone", lambda a: a.update(max_seqlen_k=5), r"max_seqlen_k=5 is given without cu_seqlens_k"),
    ("output_scale float64", lambda a: a.update(output_scale=torch.ones(1, dtype=torch.float64)),
     r"output_scale must be a one-element float32"),
    ("head dims", lambda a: a.update(q=torch.zeros(a["q"].shape[0], 4, 256, dtype=torch.bfloat16),
                                     k=torch.zeros(a["k"].shape[0], 2, 256, dtype=torch.bfloat16)),
     r"head dims \(q/k D=256, v Dv=128\) are not supported"),
]


@pytest.mark.parametrize("what, change, error", BAD, ids=[b[0] for b in BAD])
def test_a_later_call_the_checked_path_refuses_raises_the_same_error(recorder, what, change, error):
    fused, _ = sm90.launchers()
    _call(fused, _args())
    a = _args()
    change(a)
    with pytest.raises(ValueError, match=error):
        _call(fused, a)
    assert len(recorder.launches) == 1, "nothing launched for a refused call"


def test_a_later_call_with_another_kind_of_argument_goes_the_checked_path_and_runs(recorder):
    """Arguments the plan's key does not cover the same way (an int scale, an fp16 layer, no tokens, another
    class) run correctly through the checked path."""
    fused, _ = sm90.launchers()
    _call(fused, _args())
    a = _args()
    a["softmax_scale"] = 1  # an int: accepted by the checks, not by the fast path's float test
    _call(fused, a)
    assert recorder.launches[-1][7] == 1.0 and type(recorder.launches[-1][7]) is float
    _call(fused, _args(dtype=torch.float16))
    _call(fused, _args())  # the plan again
    assert len(recorder.compiled) == 3 and len(recorder.launches) == 4
    empty = _args(t=0)
    empty["cu_seqlens"] = torch.tensor([0, 0], dtype=torch.int32)
    _call(fused, empty)
    assert len(recorder.launches) == 4, "no launch for T = 0"


def test_the_sequence_length_class_picks_the_configuration(recorder, monkeypatch):
    other = Sm90Config(128, 96, 2, True, True)
    monkeypatch.setitem(sm90_configs.TABLE, (192, 128, True, 1), other)  # 129..512 tokens
    fused, twin = sm90.launchers()
    for max_seqlen in (100, 300, 5000, 512, 128):
        a = _args()
        a["max_seqlen"] = max_seqlen
        _call(fused, a)
    default = sm90_configs.fa4_default(192, 128, True)
    assert recorder.compiled == [default, other, default]  # 512 and 128 take the plans of 300 and 100
    assert len(fused._plans) == 3 and len(recorder.launches) == 5
    a = _args(context=True)
    a["max_seqlen"], a["max_seqlen_k"] = 100, 400  # the longer key sequences decide
    _call(fused, a)
    assert recorder.compiled[-1] == other
    out = twin(a["q"], a["k"], a["v"], a["cu_seqlens"], 100, 0.1, True, a["cu_seqlens_k"], 400, True)
    assert recorder.compiled[-1] == ("twin", other, True)
    assert out[0].shape == (300, 4, 128) and out[1].shape == (300, 4) and out[1].stride() == (1, 300)
    fixed, _ = sm90.launchers(default)
    _call(fixed, a)
    assert recorder.compiled[-1] == default


def test_the_twin_takes_the_plan_on_later_calls(recorder, monkeypatch):
    _, twin = sm90.launchers()
    checks = []
    real_check = sm90.check_fa4_args
    monkeypatch.setattr(twin, "_check_args", lambda *a: (checks.append(1), real_check(*a)))
    for t, lse in ((300, False), (301, False), (302, True), (303, True)):
        a = _args(t=t)
        got = twin(a["q"], a["k"], a["v"], a["cu_seqlens"], a["max_seqlen"], 0.1, True, None, None, lse)
        q, k, v, out, lse_buf, scale, cu, cu_k = recorder.launches[-1]
        assert q is a["q"] and cu is cu_k is a["cu_seqlens"] and scale == 0.1
        assert out.shape == (t, 4, 128) and out.dtype == torch.bfloat16 and (got[0] if lse else got) is out
        assert (lse_buf is None) == (not lse) and (not lse or (lse_buf.shape == (4, t) and lse_buf.dtype == torch.float32))
    assert len(checks) == 2 and len(recorder.compiled) == 2  # with and without LSE
    with pytest.raises(ValueError, match=r"return_lse must be a bool"):
        twin(a["q"], a["k"], a["v"], a["cu_seqlens"], a["max_seqlen"], 0.1, True, None, None, 1)


# ---------------------------------------------------------------------------
# CPU: the configurations
# ---------------------------------------------------------------------------


def test_seqlen_classes():
    assert [sm90_configs.seqlen_class(n) for n in (0, 1, 128, 129, 512, 513, 2048, 2049, 10**6)] == \
        [0, 0, 0, 1, 1, 2, 2, 3, 3]
    assert sm90_configs.seqlen_class(100, 3000) == 3 and sm90_configs.seqlen_class(600, 100) == 2


def test_table_entries_are_valid_for_the_fused_kernel():
    for (d, dv, causal, cls), cfg in sm90_configs.TABLE.items():
        assert (d, dv) in sm90.SUPPORTED_HEAD_DIMS and isinstance(causal, bool)
        assert 0 <= cls < len(sm90_configs.SEQLEN_CLASSES)
        assert sm90_configs.why_invalid(cfg, d, dv) is None, (d, dv, causal, cls, cfg)
    for d, dv in sm90.SUPPORTED_HEAD_DIMS:
        for causal in (True, False):
            assert sm90_configs.why_invalid(sm90_configs.fa4_default(d, dv, causal), d, dv) is None
            for cfg in sm90_configs.candidates(d, dv, causal):
                assert sm90_configs.why_invalid(cfg, d, dv) is None, (d, dv, cfg)


@pytest.mark.parametrize("cfg, dims, words", [
    (Sm90Config(64, 128, 2, True, True), (128, 128), "2 or 3 math warpgroups"),
    (Sm90Config(128, 72, 2, True, True), (128, 128), "multiple of 16"),
    (Sm90Config(128, 128, 1, True, True), (128, 128), "num_stages=1"),
    (Sm90Config(128, 192, 2, True, False), (192, 128), "KiB of shared memory"),
    (Sm90Config(128, 128, 2, True, True), (96, 96), "does not divide the 256 epilogue threads"),
    ((128, 128, 2, True, True), (128, 128), "an Sm90Config"),
])
def test_invalid_configurations_say_why(cfg, dims, words):
    assert words in sm90_configs.why_invalid(cfg, *dims)


@needs_fa4
def test_fa4_default_and_the_budget_arithmetic_are_fa4s():
    """fa4_default is FA4's _tile_size_fwd_sm90; smem_bytes and accumulator_registers are FA4's config search's
    numbers at two stages (where it reports them), and FA4's search refuses exactly where one is over budget."""
    from flash_attn.cute import interface
    from flash_attn.cute.sm90_config_search import REG_LIMITS, SMEM_LIMIT, _check_fwd_config

    assert SMEM_LIMIT == sm90_configs.SMEM_BYTES and REG_LIMITS == sm90_configs.REGISTERS
    for d, dv in sm90.SUPPORTED_HEAD_DIMS + ((256, 256),):
        for causal in (True, False):
            fa4 = interface._tile_size_fwd_sm90(d, dv, causal, False)
            mine = sm90_configs.fa4_default(d, dv, causal)
            assert (fa4.m_block_size, fa4.n_block_size, fa4.mma_pv_is_rs, fa4.intra_wg_overlap) == \
                (mine.tile_m, mine.tile_n, mine.mma_pv_is_rs, mine.intra_wg_overlap) and mine.num_stages == 2
    for d, dv in ((192, 128), (128, 128), (64, 64)):
        for tile_m in (128, 192):
            for tile_n in range(64, 193, 16):
                for rs in (True, False):
                    for overlap in (True, False):
                        cfg = Sm90Config(tile_m, tile_n, 2, overlap, rs)
                        fa4 = _check_fwd_config(d, dv, tile_n, tile_m // 64, rs, overlap)
                        smem = sm90_configs.smem_bytes(cfg, d, dv)
                        regs = sm90_configs.accumulator_registers(cfg, d, dv)
                        if fa4 is None:
                            assert smem > SMEM_LIMIT or regs > REG_LIMITS[tile_m // 64], cfg
                        else:
                            assert (fa4["smem_bytes"], fa4["total_regs"]) == (smem, regs), cfg


COMPILE = textwrap.dedent("""
    import logging, sys
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="LOG %(levelname)s %(message)s")
    logging.getLogger("fusion_pass").setLevel(logging.INFO)
    from fusion_pass.kernels.fa4 import sm90, sm90_configs
    d, dv = {d}, {dv}
    configs = set(sm90_configs.candidates(d, dv)) | {{c for (a, b, _, _), c in sm90_configs.TABLE.items() if (a, b) == (d, dv)}}
    with FakeTensorMode(allow_non_fake_inputs=True):
        t, h, hkv = 1000, 8, 2
        q = torch.empty(t, h, d, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(t, hkv, d, dtype=torch.bfloat16, device="cuda")
        v = torch.empty(t, hkv, dv, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(4, dtype=torch.int32, device="cuda")
        gs = torch.empty(1, dtype=torch.float32, device="cuda")
        out = torch.empty(t, h * dv // 2, dtype=torch.uint8, device="cuda")
        sf = torch.empty(1024 * (h * dv // 16), dtype=torch.uint8, device="cuda")
        for i, cfg in enumerate(sorted(configs)):
            fused, twin = sm90.launchers(cfg)
            fused(q, k, v, cu, 700, 0.1, True, out, gs, sf)
            twin(q, k, v, cu, 700, 0.1, True, None, None, False)
            if i == 0:
                twin(q, k, v, cu, 700, 0.1, True, None, None, True)  # the LSE variant once
            print("compiled", tuple(cfg), flush=True)
""")


@pytest.mark.slow  # an exhaustive sweep: make test-slow
@needs_fa4
def test_every_table_configuration_and_sweep_candidate_compiles_fused_and_twin_for_sm90():
    env = dict(os.environ, FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132")
    env.pop("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", None)
    dims = sorted({(d, dv) for d, dv, _, _ in sm90_configs.TABLE} | {(192, 128), (128, 128)})
    procs = {dv: subprocess.Popen([sys.executable, "-c", COMPILE.format(d=dv[0], dv=dv[1])], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for dv in dims}
    for (d, dv), proc in procs.items():
        stdout, stderr = proc.communicate(timeout=1800)
        assert proc.returncode == 0, f"head dims ({d}, {dv}):\n{stderr[-4000:]}"
        want = set(sm90_configs.candidates(d, dv)) | {c for (a, b, _, _), c in sm90_configs.TABLE.items()
                                                      if (a, b) == (d, dv)}
        done = {Sm90Config._make(eval(line.split(" ", 1)[1])) for line in stdout.splitlines()}
        assert done == want, stdout
        fused = re.findall(r"compiled the SM90 NVFP4 attention kernel \(bfloat16, head dims \((\d+), (\d+)\), 4 query "
                           r"heads per KV head, causal=True, tile (\d+)x(\d+), (\d) stages", stderr)
        twins = re.findall(r"compiled the SM90 twin \(FA4 epilogue(, LSE)?\) attention kernel", stderr)
        assert len(fused) == len(want) and len(twins) == len(want) + 1, stderr[-4000:]
        assert {(int(m), int(n), int(s)) for _, _, m, n, s in fused} == {c[:3] for c in want}


# ---------------------------------------------------------------------------
# GPU: the twin is FA4's forward; the fused bytes at other configurations
# ---------------------------------------------------------------------------


from sm90_gpu import gpu  # noqa: E402


def _gpu_inputs(seed, h, hkv, d, dv, lengths, dtype, extra_keys=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    tk = t + extra_keys * len(lengths)
    q = torch.randn(t, h, d, generator=gen).to("cuda", dtype)
    k = torch.randn(tk, hkv, d, generator=gen).to("cuda", dtype)
    v = (torch.randn(tk, hkv, dv, generator=gen) * torch.exp(torch.randn(tk, hkv, 1, generator=gen))).to("cuda", dtype)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + (torch.tensor(lengths) + extra_keys).cumsum(0).tolist(), dtype=torch.int32,
                        device="cuda")
    return q, k, v, cu, cu_k


@gpu
@pytest.mark.parametrize("heads, context", [((16, 16, 192, 128), False), ((32, 8, 128, 128), False),
                                            ((8, 2, 64, 64), False), ((16, 16, 192, 128), True)],
                         ids=["mla16", "gqa", "gqa_d64", "mla16_context"])
def test_the_twin_equals_fa4s_own_forward_at_fa4s_configuration(heads, context):
    """The twin (our launch of FA4's SM90 class with FA4's configuration) and FA4's ``flash_attn_varlen_func``:
    the same output and log-sum-exp, bit for bit, so the fused bytes equal quantize(FA4's own output)."""
    from flash_attn.cute import interface

    seed = fresh_seed()
    h, hkv, d, dv = heads
    lengths = [1, 127, 129, 600]
    dtype = (torch.bfloat16, torch.float16)[seed % 2]
    q, k, v, cu, cu_k = _gpu_inputs(seed, h, hkv, d, dv, lengths, dtype, extra_keys=300 if context else 0)
    keys = dict(cu_seqlens_k=cu_k, max_seqlen_k=900) if context else {}
    out, lse = sm90.fa4_attention_varlen(q, k, v, cu, 600, causal=True, softmax_scale=d**-0.5, return_lse=True,
                                         **keys)
    ref, ref_lse = interface.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu_k if context else cu, max_seqlen_q=600,
        max_seqlen_k=900 if context else 600, softmax_scale=d**-0.5, causal=True, num_splits=1, pack_gqa=False,
        return_lse=True)
    assert sm90.kernel_config(d, dv, True, 600, 900 if context else None) == sm90_configs.fa4_default(d, dv, True)
    assert torch.equal(out, ref), f"output differs from FA4's (seed {seed}, {dtype})"
    assert torch.equal(lse, ref_lse.t()), f"log-sum-exp differs from FA4's (seed {seed}, {dtype})"


GPU_CONFIGS = [
    ((16, 16, 192, 128), Sm90Config(128, 96, 2, False, True)),
    ((16, 16, 192, 128), Sm90Config(192, 80, 2, True, True)),
    ((16, 16, 192, 128), Sm90Config(128, 64, 3, True, True)),
    ((32, 8, 128, 128), Sm90Config(128, 176, 2, True, True)),
    ((32, 8, 128, 128), Sm90Config(128, 128, 2, True, False)),
    ((32, 8, 128, 128), Sm90Config(192, 96, 2, False, True)),
]


@gpu
@pytest.mark.parametrize("heads, cfg", GPU_CONFIGS, ids=[f"{h[2]}-{'x'.join(map(str, c))}" for h, c in GPU_CONFIGS])
def test_fused_bytes_equal_quantize_of_the_twin_at_other_configurations(heads, cfg):
    """At configurations other than FA4's (tile sizes, three stages, three warpgroups, each flag off): every
    byte of the fused output equals the reference quantize of the twin's output with the same configuration,
    padding zero, both poisons; the second and third calls (the plan) give the same bytes."""
    seed = fresh_seed()
    h, hkv, d, dv = heads
    lengths = [1, 127, 129, 700]  # T = 957: padding rows
    dtype = (torch.bfloat16, torch.float16)[seed % 2]
    q, k, v, cu, _ = _gpu_inputs(seed, h, hkv, d, dv, lengths, dtype)
    t = q.shape[0]
    fused, twin = sm90.launchers(cfg)
    out = twin(q, k, v, cu, 700, d**-0.5, True)
    gs = torch.tensor([448 * 6 / out.float().abs().max().item()], device="cuda")
    want_packed, want_scales = nvfp4.quantize(out.reshape(t, -1).cpu(), gs.cpu())
    rows, cols = nvfp4.scale_shape(t, h * dv)
    for poison in (0xA5, 0x00, 0x5A):
        packed = torch.full((t, h * dv // 2), poison, dtype=torch.uint8, device="cuda")
        scales = torch.full((rows, cols), poison ^ 0xFF, dtype=torch.uint8, device="cuda")
        fused(q, k, v, cu, 700, d**-0.5, True, packed, gs, scales.view(torch.float8_e4m3fn))
        bad = (packed.cpu() != want_packed).nonzero()
        assert len(bad) == 0, f"{cfg}: {len(bad)} packed bytes differ, first {bad[:8].tolist()} (seed {seed})"
        diff = (scales.cpu().view(-1) != want_scales.view(torch.uint8).view(-1)).sum().item()
        assert diff == 0, f"{cfg}: {diff} scale bytes differ (padding included) (seed {seed})"


@gpu
def test_later_twin_calls_do_not_synchronize():
    from context_cases import call_without_host_sync

    q, k, v, cu, cu_k = _gpu_inputs(fresh_seed(), 16, 16, 192, 128, [300, 77], torch.bfloat16, extra_keys=50)
    n = q.shape[0]
    call_without_host_sync(lambda: sm90.fa4_attention_varlen(q, k[:n], v[:n], cu, 300, causal=True, softmax_scale=0.1))
    call_without_host_sync(lambda: sm90.fa4_attention_varlen(q, k, v, cu, 300, causal=True, softmax_scale=0.1,
                                                             cu_seqlens_k=cu_k, max_seqlen_k=350, return_lse=True))
