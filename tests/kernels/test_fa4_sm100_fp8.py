"""FlashAttention-4 on Blackwell with a static per-tensor FP8 output stage:
``sm100_fp8.fa4_attention_fp8_static_varlen`` (compiled, never run: no Blackwell GPU is lent to this project).

CPU: argument checks raising ``ArgumentError`` naming the argument before FA4 is imported or anything compiled;
the compile function reached with the output as bytes, ``inv_scale`` as ``[1]``, the NaN rule and the configuration
class; ``T = 0`` compiles nothing; the module imports without FA4. With FA4 installed, the kernel compiles (never
runs) for ``sm_100a`` under ``FakeTensorMode`` in a subprocess: MLA 192/128 (two Q tiles per CTA), GQA 128/128
(one Q tile), 64/64 with keys in their own workspace, both NaN rules; the PTX holds the e4m3 conversions.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from fusion_pass.kernels.fa4 import sm100 as fa4_sm100, sm100_fp8
from fusion_pass.nvfp4 import ArgumentError

needs_fa4 = pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None,
                               reason="flash_attn.cute is not installed (the fa4 extra)")

SM100_ENV = dict(CUTE_DSL_ARCH="sm_100a", FLASH_ATTENTION_ARCH="sm_100", FLASH_ATTENTION_NUM_SMS="148")
FN = "fa4_attention_fp8_static_varlen"


def _cpu_args(h=4, d=128, dv=128, t=10):
    return dict(q=torch.zeros(t, h, d, dtype=torch.bfloat16), k=torch.zeros(t, h, d, dtype=torch.bfloat16),
                v=torch.zeros(t, h, dv, dtype=torch.bfloat16), cu_seqlens=torch.tensor([0, 4, t], dtype=torch.int32),
                max_seqlen=6, softmax_scale=0.1, causal=True, output=torch.empty(t, h * dv, dtype=torch.float8_e4m3fn),
                inv_scale=torch.ones(1))


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {**a, "output": a["output"].view(torch.uint8)}, r"output must be float8_e4m3fn \[T, H\*Dv\] = "
                                                                   r"\[10, 512\]"),
        (lambda a: {**a, "output": torch.empty(10, 1024, dtype=torch.float8_e4m3fn)[:, :512]},
         r"output must be a contiguous 16-byte aligned float8_e4m3fn \[T, H\*Dv\], got strides \(1024, 1\)"),
        (lambda a: {**a, "output": None}, r"output must be a contiguous 16-byte aligned float8_e4m3fn .*, got None"),
        (lambda a: {**a, "inv_scale": torch.ones(2)}, r"inv_scale must be a one-element float32 tensor"),
        (lambda a: {**a, "nan_to_max": "yes"}, r"nan_to_max must be a bool"),
        (lambda a: {**a, "q": torch.zeros(4, 10, 128, dtype=torch.bfloat16).transpose(0, 1)},
         r"q must be token-major with its heads inside a token's row"),
        (lambda a: {**a, "q": torch.zeros(10, 4, 96, dtype=torch.bfloat16),
                    "k": torch.zeros(10, 4, 96, dtype=torch.bfloat16),
                    "v": torch.zeros(10, 4, 96, dtype=torch.bfloat16),
                    "output": torch.empty(10, 384, dtype=torch.float8_e4m3fn)}, r"D=96, v Dv=96\) are not supported"),
        (lambda a: {**a, "max_seqlen_k": 6}, r"max_seqlen_k=6 is given without cu_seqlens_k"),
    ],
)
def test_sm100_fp8_entry_rejects_bad_arguments_before_importing_fa4(change, match, monkeypatch):
    monkeypatch.setattr(fa4_sm100, "fa4_interface", lambda: pytest.fail("FA4 imported before the checks"))
    monkeypatch.setattr(sm100_fp8, "compile_fp8_static_kernel", lambda *a, **k: pytest.fail("compiled before checks"))
    args = change(_cpu_args())
    with pytest.raises(ArgumentError, match=f"^{FN}: .*{match}"):
        sm100_fp8.fa4_attention_fp8_static_varlen(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_sm100_fp8_entry_reaches_the_compile_function_with_its_arguments(monkeypatch):
    seen = []

    def fake_compile(q, k, v, o, output_bytes, inv, cu, cu_k, cls, causal, *, nan_to_max):
        seen.append((output_bytes.dtype, tuple(output_bytes.shape), tuple(inv.shape), cls, nan_to_max, cu_k is cu))
        raise RuntimeError("stop")

    monkeypatch.setattr(sm100_fp8, "compile_fp8_static_kernel", fake_compile)
    for max_seqlen, cls in ((6, 0), (128, 0), (129, 1)):
        for nan_to_max in (True, False):
            args = {**_cpu_args(), "max_seqlen": max_seqlen, "nan_to_max": nan_to_max, "inv_scale": torch.ones(1, 1)}
            with pytest.raises(RuntimeError, match="stop"):
                sm100_fp8.fa4_attention_fp8_static_varlen(args.pop("q"), args.pop("k"), args.pop("v"), **args)
            assert seen.pop() == (torch.uint8, (10, 512), (1,), cls, nan_to_max, True)
    args = _cpu_args(t=0)
    args["cu_seqlens"] = torch.tensor([0, 0], dtype=torch.int32)
    sm100_fp8.fa4_attention_fp8_static_varlen(args.pop("q"), args.pop("k"), args.pop("v"), **args)
    assert seen == []


def test_sm100_fp8_module_imports_without_fa4():
    code = "import sys, fusion_pass.kernels.fa4.sm100_fp8 as m; m.fa4_attention_fp8_static_varlen; " \
           "print(any(n.startswith(('flash_attn', 'cutlass')) for n in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", "importing sm100_fp8 imported FA4"


@needs_fa4
def test_sm100_fp8_static_kernel_compiles_on_the_cpu(tmp_path):
    """Compile (never run) with fake CUDA tensors for ``sm_100a``; each (NaN rule, head dims, dtype, class) is its
    own cache entry; the PTX converts with ``cvt.rn.satfinite.e4m3x2.f32`` and stores 8 bytes at a time."""
    code = textwrap.dedent("""
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from fusion_pass.kernels.fa4 import common, sm100_fp8
        cases = ((16, 16, 192, 128, torch.bfloat16, None, True, 700),   # MLA, two Q tiles per CTA
                 (32, 8, 128, 128, torch.float16, None, False, 100),    # GQA, one Q tile
                 (8, 2, 64, 64, torch.bfloat16, 3000, True, 700))       # keys in their own workspace
        with FakeTensorMode(allow_non_fake_inputs=True):
            for h, hkv, d, dv, dtype, tk, nan_to_max, max_seqlen in cases:
                t = 1000
                q = torch.empty(t, h, d, dtype=dtype, device="cuda")
                k = torch.empty(tk or t, hkv, d, dtype=dtype, device="cuda")
                v = torch.empty(tk or t, hkv, dv, dtype=dtype, device="cuda")
                cu = torch.empty(4, dtype=torch.int32, device="cuda")
                ctx = {} if tk is None else dict(cu_seqlens_k=torch.empty(4, dtype=torch.int32, device="cuda"),
                                                 max_seqlen_k=2000)
                inv = torch.empty(1, dtype=torch.float32, device="cuda")
                out = torch.empty(t, h * dv, dtype=torch.float8_e4m3fn, device="cuda")
                sm100_fp8.fa4_attention_fp8_static_varlen(q, k, v, cu_seqlens=cu, max_seqlen=max_seqlen,
                                                          softmax_scale=0.1, causal=True, output=out, inv_scale=inv,
                                                          nan_to_max=nan_to_max, **ctx)
        keys = common._caches["fusion_pass_fa4_sm100"].cache
        print("compiled", len(keys), sorted({key[1][2] for key in keys}))
    """)
    root = str(pathlib.Path(__file__).resolve().parents[2])  # the checkout, where the package is not installed
    env = dict(os.environ, **SM100_ENV, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900,
                            cwd=tmp_path)
    assert result.returncode == 0 and "compiled 3 [126, 127]" in result.stdout, \
        (result.stdout[-500:], result.stderr[-3000:])
    ptx = "".join(p.read_text() for p in tmp_path.glob("*Sm100Fp8Static*.ptx"))
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "st.global.b64" in ptx, "no FP8 conversion or 8-byte store"
