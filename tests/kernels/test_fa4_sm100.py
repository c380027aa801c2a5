"""The SM100 (Blackwell) FA4 NVFP4 kernel, compile-verified on the CPU: no Blackwell GPU is lent to this project.

Every supported head-dim pair, both half dtypes, both of FA4's SM100 configurations a varlen call can take
(one or two 128-row Q tiles per CTA), with and without ``cu_seqlens_k``, compiled for ``sm_100a`` under
``FakeTensorMode`` through the generation dispatch (:mod:`fusion_pass.kernels.fa4.forward`). The subclass
checks, while it is traced, what it relies on in FA4 (the softmax warps traced first, the 32-lane tensor-memory
load, one NVFP4 block of columns per copy): a moved internal fails here. ``pytest -k sm100`` selects these.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from fusion_pass.kernels.fa4 import common, forward, sm100

needs_fa4 = pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None,
                               reason="flash_attn.cute is not installed (the fa4 extra)")

SM100_ENV = dict(CUTE_DSL_ARCH="sm_100a", FLASH_ATTENTION_ARCH="sm_100", FLASH_ATTENTION_NUM_SMS="148")

COMPILE = textwrap.dedent("""
    import logging, sys
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="LOG %(levelname)s %(message)s")
    logging.getLogger("fusion_pass").setLevel(logging.INFO)
    from fusion_pass.kernels.fa4 import forward
    d, dv = {d}, {dv}
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert forward.fa4_generation("cuda") == "sm100"
        for dtype in (torch.bfloat16, torch.float16):
            for max_seqlen in (100, 700):           # q_stage 1 and 2
                for context in (False, True):       # keys of the queries' own rows / cached context + new rows
                    t, h, hkv = 1000, 6, 2
                    tk = 3000 if context else t
                    q = torch.empty(t, h, d, dtype=dtype, device="cuda")
                    k = torch.empty(tk, hkv, d, dtype=dtype, device="cuda")
                    v = torch.empty(tk, hkv, dv, dtype=dtype, device="cuda")
                    cu = torch.empty(4, dtype=torch.int32, device="cuda")
                    ctx = dict(cu_seqlens_k=torch.empty(4, dtype=torch.int32, device="cuda"),
                               max_seqlen_k=2000) if context else dict()
                    gs = torch.empty(1, dtype=torch.float32, device="cuda")
                    out = torch.empty(t, h * dv // 2, dtype=torch.uint8, device="cuda")
                    sf = torch.empty(1024 * ((h * dv // 16 + 3) // 4 * 4), dtype=torch.uint8, device="cuda")
                    forward.fa4_attention_nvfp4_varlen(q, k, v, cu_seqlens=cu, max_seqlen=max_seqlen,
                                                       softmax_scale=0.1, causal=True, output=out, output_scale=gs,
                                                       output_block_scale=sf, **ctx)
                    print("fused", dtype, max_seqlen, context, flush=True)
        # the twin the self-check compares with, with the log-sum-exp the chunked-context path needs
        out, lse = forward.fa4_attention_varlen(q, k, v, cu, 700, causal=True, softmax_scale=0.1, return_lse=True,
                                                **ctx)
        assert out.shape == (t, h, dv) and out.dtype == dtype and lse.shape == (t, h)
        print("twin", flush=True)
""")


@pytest.mark.slow  # an exhaustive sweep: make test-slow
@needs_fa4
def test_sm100_kernel_compiles_for_every_head_dim_pair_dtype_and_configuration():
    env = dict(os.environ, **SM100_ENV)
    env.pop("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", None)
    procs = {dims: subprocess.Popen([sys.executable, "-c", COMPILE.format(d=dims[0], dv=dims[1])], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for dims in sm100.SUPPORTED_HEAD_DIMS}
    for (d, dv), proc in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"head dims ({d}, {dv}):\n{stderr[-4000:]}"
        assert stdout.count("fused") == 8 and "twin" in stdout, stdout
        compiled = re.findall(r"LOG INFO fusion_pass: fa4: compiled the SM100 (NVFP4|twin \(FA4 output stage\)) "
                              r"attention kernel \((\w+), head dims \((\d+), (\d+)\), 3 query heads per KV head, "
                              r"causal=True, KernelConfig\(q_stage=(\d), use_s_ping_pong=(\w+)\)\)", stderr)
        fused = sorted((dtype, int(q_stage), ping) for kind, dtype, *_, q_stage, ping in compiled if kind == "NVFP4")
        ping = str((d, dv) != (192, 128))  # FA4's S ping-pong for one Q tile per CTA and D == Dv in (64, 128)
        # one compilation per dtype and configuration: cu_seqlens_k and the token counts are run-time values
        assert fused == [("bfloat16", 1, ping), ("bfloat16", 2, "False"), ("float16", 1, ping),
                         ("float16", 2, "False")], stderr[-4000:]
        assert all((int(a), int(b)) == (d, dv) for _, _, a, b, _, _ in compiled)
        assert sum(kind != "NVFP4" for kind, *_ in compiled) == 1


@needs_fa4
def test_sm100_subclass_overrides_stages_fa4_4_0_0b36_has():
    """The names and parameters the subclass relies on in FA4's SM100 forward (a moved internal fails here before
    it fails to compile)."""
    from flash_attn.cute.flash_fwd_sm100 import FlashAttentionForwardSm100

    epilogue = inspect.signature(FlashAttentionForwardSm100.correction_epilogue).parameters
    assert list(epilogue) == ["self", "thr_mma", "tOtO", "tidx", "stage", "m_block", "seqlen_q", "scale", "sO",
                              "mO_cur", "gO", "gmem_tiled_copy_O", "zero_fill"]
    assert "aux_data" in inspect.signature(FlashAttentionForwardSm100.softmax_loop).parameters
    call = inspect.signature(FlashAttentionForwardSm100.__call__).parameters
    assert {"aux_data", "max_seqlen_q", "stream"} <= set(call)
    # with cu_seqlens_q the correction warps store O: correction_epilogue is the only caller of _store_O_to_gmem
    # outside the epilogue warp's loop, which a varlen call does not run
    source = inspect.getsource(FlashAttentionForwardSm100)
    assert "self.use_correction_warps_for_epi = not self.use_tma_O" in source
    assert "and not is_varlen_q" in source
    assert "self._store_O_to_gmem(" in inspect.getsource(FlashAttentionForwardSm100.correction_epilogue)
    kernel = inspect.getsource(FlashAttentionForwardSm100.kernel)
    assert kernel.index("self.softmax_loop") < kernel.index("self.correction_loop(")


FA4_CHOICE = textwrap.dedent("""
    import json, torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from flash_attn.cute import interface

    class Recorded(Exception):
        pass

    seen = []

    class Recorder:  # stands in for FA4's SM100 class: records what FA4's interface builds, then stops
        def __init__(self, *args, **kwargs):
            seen.append({k: v for k, v in kwargs.items() if isinstance(v, (bool, int, type(None)))})
            raise Recorded

    interface.FlashAttentionForwardSm100 = Recorder
    with FakeTensorMode(allow_non_fake_inputs=True):
        for (d, dv), group, m in [(dims, g, m) for dims in ((64, 64), (128, 128), (192, 128))
                                  for g in (1, 4) for m in (1, 64, 128, 129, 256, 257, 4096)]:
            q = torch.empty(3000, 8, d, dtype=torch.bfloat16, device="cuda")
            k = torch.empty(3000, 8 // group, d, dtype=torch.bfloat16, device="cuda")
            v = torch.empty(3000, 8 // group, dv, dtype=torch.bfloat16, device="cuda")
            cu = torch.empty(4, dtype=torch.int32, device="cuda")
            try:
                interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m,
                                                 max_seqlen_k=m, causal=True, num_splits=1, pack_gqa=False)
            except Recorded:
                seen[-1].update(d=d, dv=dv, max_seqlen=m, group=group)
    print(json.dumps(seen))
""")


@needs_fa4
def test_sm100_kernel_config_is_fa4s_own_choice():
    """What FA4's own interface builds for the calls the twin stands for (recorded from its constructor call under
    FakeTensorMode) against :func:`sm100.kernel_config` and the constructor arguments ``sm100._compile`` passes."""
    env = dict(os.environ, **SM100_ENV)
    result = subprocess.run([sys.executable, "-c", FA4_CHOICE], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(seen) == 42
    for fa4 in seen:
        mine = sm100.kernel_config(fa4["d"], fa4["dv"], fa4["max_seqlen"])
        assert (fa4["q_stage"], fa4["use_s_ping_pong"]) == (mine.q_stage, mine.use_s_ping_pong), fa4
        assert (fa4["m_block_size"], fa4["n_block_size"]) == (sm100.TILE_M, sm100.TILE_N), fa4
        assert fa4["qhead_per_kvhead"] == fa4["group"] and fa4["pack_gqa"] is False, fa4
        for flag in ("use_2cta_instrs", "is_split_kv", "use_clc_scheduler", "has_tile_count_semaphore",
                     "paged_kv_non_tma", "is_local"):
            assert fa4[flag] is False, (flag, fa4)
        assert fa4["is_varlen_q"] is True and fa4["is_causal"] is True
        # the one scheduling choice the twin and the fused kernel make differently from FA4 (sm100.py docstring)
        assert fa4["is_static_persistent"] == (fa4["max_seqlen"] <= fa4["q_stage"] * sm100.TILE_M), fa4


@pytest.mark.parametrize("arch, dims, dtype, heads, ok, words", [
    (100, (192, 128), torch.bfloat16, 16, True, "ok"),
    (110, (64, 64), torch.float16, 1, True, "ok"),
    (90, (192, 128), torch.bfloat16, 16, False, "needs an SM100/SM110 GPU"),
    (100, (96, 96), torch.bfloat16, 16, False, "supports head dims (D, Dv) in (64, 64), (128, 128), (192, 128)"),
    (100, (128, 128), torch.float32, 16, False, "torch.float16 and torch.bfloat16"),
    (None, (128, 128), torch.bfloat16, 16, False, "no CUDA device"),
])
def test_sm100_usable_says_why_not(monkeypatch, arch, dims, dtype, heads, ok, words):
    monkeypatch.setattr(common, "device_arch", lambda device: arch)
    monkeypatch.setattr(sm100, "fa4_import_status", lambda: (True, "flash-attn-4 4.0.0b36"))
    got, why = sm100.fa4_sm100_usable("cuda", dtype, heads, *dims)
    assert got is ok and words in why


@pytest.mark.parametrize("arch, generation, words", [
    (90, "sm90", None), (100, "sm100", None), (103, "sm100", None), (110, "sm100", None),
    (120, None, "consumer Blackwell: no kernel of this project yet"), (80, None, "is sm_80"),
])
def test_the_generation_dispatch(monkeypatch, arch, generation, words):
    monkeypatch.setattr(common, "device_arch", lambda device: arch)
    assert forward.fa4_generation("cuda") == generation
    assert forward.fa4_generation("cpu") is None
    monkeypatch.setattr(forward.sm90, "usable", lambda *a: (True, "sm90 kernel"))
    monkeypatch.setattr(forward.sm100, "usable", lambda *a: (True, "sm100 kernel"))
    ok, why = forward.fa4_usable("cuda", torch.bfloat16, 16, 128, 128)
    if generation is None:
        assert not ok and words in why
        assert forward.supported_head_dims("cuda") == ()
    else:
        assert ok and why == f"{generation} kernel"
        assert forward.supported_head_dims("cuda") == {"sm90": forward.sm90, "sm100": sm100}[generation].SUPPORTED_HEAD_DIMS
    assert forward.fa4_usable("cpu", torch.bfloat16, 16, 128, 128) == (False, "fa4 runs on CUDA devices only, got cpu")


def test_sm100_config_class_decides_the_configuration():
    """The launcher keys SM100 plans and compilations on ``config_class(max_seqlen)``; the configuration must
    depend on the longest sequence through it alone."""
    for d, dv in sm100.SUPPORTED_HEAD_DIMS:
        for m in (0, 1, 127, 128, 129, 700, 4096):
            cls = sm100.config_class(m)
            assert sm100.kernel_config(d, dv, m) == sm100.kernel_config(d, dv, sm100.TILE_M + 1 if cls else 1), (d, m)
