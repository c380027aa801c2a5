"""FlashAttention-4 on Blackwell with a dynamic 128-column group FP8 output stage:
``sm100_fp8.fa4_attention_fp8_group_varlen`` (compiled, never run: no Blackwell GPU is lent to this project).

CPU: argument checks raising ``ArgumentError`` naming the argument before FA4 is imported or anything compiled
(``Dv % 128``, the output, the scales and their layouts, the flags, the SM100 head dims and q layout); the compile
function reached with the output as bytes, the flags, the configuration class and a scale view with its layout's
strides over the caller's own scales (every layout, one group a row, the first rows of a larger column-major
buffer); ``T = 0`` compiles nothing. With FA4 installed, the kernel compiles (never runs) for ``sm_100a`` under
``FakeTensorMode`` in a subprocess: MLA 192/128 (two Q tiles per CTA) and 128/128 (one Q tile with the S ping-pong,
and two), bf16 and fp16, every (ue8m0, divide) pair with column-major scales and two with row-major ones, keys in
their own workspace, one non-causal call; the PTX holds the e4m3 conversions, the 8-byte stores and the scale
arithmetic. The kernel class refuses ``Dv = 64``.
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

from fusion_pass import fp8
from fusion_pass.fp8 import ScaleLayout
from fusion_pass.kernels.fa4 import sm100 as fa4_sm100, sm100_fp8
from fusion_pass.nvfp4 import ArgumentError

needs_fa4 = pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None,
                               reason="flash_attn.cute is not installed (the fa4 extra)")

SM100_ENV = dict(CUTE_DSL_ARCH="sm_100a", FLASH_ATTENTION_ARCH="sm_100", FLASH_ATTENTION_NUM_SMS="148")
FN = "fa4_attention_fp8_group_varlen"
ROOT = str(pathlib.Path(__file__).resolve().parents[2])  # the checkout, where the package is not installed


def _cpu_args(h=4, hkv=4, d=128, dv=128, t=10, layout=ScaleLayout.ROW_MAJOR):
    return dict(q=torch.zeros(t, h, d, dtype=torch.bfloat16), k=torch.zeros(t, hkv, d, dtype=torch.bfloat16),
                v=torch.zeros(t, hkv, dv, dtype=torch.bfloat16), cu_seqlens=torch.tensor([0, 4, t], dtype=torch.int32),
                max_seqlen=6, softmax_scale=0.1, causal=True, output=torch.empty(t, h * dv, dtype=torch.float8_e4m3fn),
                scales=fp8.group_scale_buffer(t, h * dv, layout))


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {**a, "output": a["output"].view(torch.uint8)}, r"output must be float8_e4m3fn \[T, H\*Dv\] = "
                                                                   r"\[10, 512\]"),
        (lambda a: {**a, "output": torch.empty(10, 1024, dtype=torch.float8_e4m3fn)[:, :512]},
         r"output must be a contiguous 16-byte aligned float8_e4m3fn \[T, H\*Dv\], got strides \(1024, 1\)"),
        (lambda a: {**a, "output": None}, r"output must be a contiguous 16-byte aligned float8_e4m3fn .*, got None"),
        (lambda a: {**a, "scales": None}, r"scales must be a float32 \[T, H\*Dv/128\] tensor .*, got None"),
        (lambda a: {**a, "scales": a["scales"].half()}, r"scales must be float32 \[T, H\*Dv/128\] = \[10, 4\], got "
                                                        r"torch.float16"),
        (lambda a: {**a, "scales": a["scales"][:, :3]}, r"scales must be float32 \[T, H\*Dv/128\] = \[10, 4\]"),
        (lambda a: {**a, "scales": a["scales"].to("meta")}, r"scales must be on q's device"),
        (lambda a: {**a, "scales": torch.empty(10, 8)[:, ::2]},
         r"scales must be in one of the layouts \(strides\) row_major \(4, 1\), column_major \(1, 10\), "
         r"column_major_tma \(1, 12\) .*, got strides \(8, 2\)"),
        (lambda a: {**a, "ue8m0": 1}, r"ue8m0 must be a bool, got 1"),
        (lambda a: {**a, "divide": "no"}, r"divide must be a bool, got 'no'"),
        (lambda a: {**a, "q": torch.zeros(10, 4, 64, dtype=torch.bfloat16),
                    "k": torch.zeros(10, 4, 64, dtype=torch.bfloat16),
                    "v": torch.zeros(10, 4, 64, dtype=torch.bfloat16)},
         r"v's head dim Dv must be divisible by 128 \(a head's tile holds whole 128-column groups\), got v "
         r"\[10, 4, 64\]"),
        (lambda a: {**a, "q": torch.zeros(10, 4, 96, dtype=torch.bfloat16),
                    "k": torch.zeros(10, 4, 96, dtype=torch.bfloat16)}, r"D=96, v Dv=128\) are not supported"),
        (lambda a: {**a, "q": torch.zeros(4, 10, 128, dtype=torch.bfloat16).transpose(0, 1)},
         r"q must be token-major with its heads inside a token's row"),
        (lambda a: {**a, "causal": 1}, r"causal must be a bool"),
        (lambda a: {**a, "max_seqlen_k": 6}, r"max_seqlen_k=6 is given without cu_seqlens_k"),
    ],
)
def test_sm100_group_entry_rejects_bad_arguments_before_importing_fa4(change, match, monkeypatch):
    monkeypatch.setattr(fa4_sm100, "fa4_interface", lambda: pytest.fail("FA4 imported before the checks"))
    monkeypatch.setattr(sm100_fp8, "compile_fp8_group_kernel", lambda *a, **k: pytest.fail("compiled before checks"))
    args = change(_cpu_args())
    with pytest.raises(ArgumentError, match=f"^{FN}: .*{match}"):
        sm100_fp8.fa4_attention_fp8_group_varlen(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def _first_rows_of_a_column_major_buffer(t, g):
    """The first ``t`` rows of a column-major ``[t + 7, g]`` buffer: strides ``(1, t + 7)``, in no layout."""
    return torch.empty(g, t + 7, dtype=torch.float32)[:, :t].t()


def test_sm100_group_entry_reaches_the_compile_function_with_its_arguments(monkeypatch):
    """The output as bytes at the caller's address, the flags, the configuration class, and a scale view with its
    layout's strides reading the caller's own scales (the same storage and values): every layout, one head (one
    group a row: row-major strides whatever buffer holds it), the first rows of a larger column-major buffer
    (strides as given). ``T = 0`` compiles nothing."""
    seen = []

    def fake_compile(q, k, v, o, output_bytes, scales, cu, cu_k, cls, causal, *, ue8m0, divide):
        seen.append((output_bytes, scales, cls, ue8m0, divide, cu_k is cu))
        raise RuntimeError("stop")

    monkeypatch.setattr(sm100_fp8, "compile_fp8_group_kernel", fake_compile)
    flags = [(False, False), (True, False), (False, True), (True, True)]
    n = 0
    for t, max_seqlen, cls in ((1, 1, 0), (3, 3, 0), (10, 128, 0), (130, 129, 1)):
        for h in (1, 4):
            makers = [lambda t=t, h=h, layout=layout: fp8.group_scale_buffer(t, h * 128, layout)
                      for layout in ScaleLayout]
            makers.append(lambda t=t, h=h: _first_rows_of_a_column_major_buffer(t, h))
            for make in makers:
                ue8m0, divide = flags[n % 4]
                n += 1
                args = {**_cpu_args(h=h, hkv=1, t=t), "ue8m0": ue8m0, "divide": divide, "max_seqlen": max_seqlen,
                        "cu_seqlens": torch.tensor([0, t], dtype=torch.int32), "scales": make()}
                given = args["scales"]
                base = given.untyped_storage()
                torch.arange(base.nbytes() // 4, dtype=torch.float32, out=torch.empty(0).set_(base))
                with pytest.raises(RuntimeError, match="stop"):
                    sm100_fp8.fa4_attention_fp8_group_varlen(args.pop("q"), args.pop("k"), args.pop("v"), **args)
                out_bytes, scales, got_cls, got_ue8m0, got_divide, same_cu = seen.pop()
                what = f"T={t}, H={h}, strides {given.stride()}"
                assert out_bytes.dtype == torch.uint8 and out_bytes.data_ptr() == args["output"].data_ptr(), what
                assert (got_cls, got_ue8m0, got_divide, same_cu) == (cls, ue8m0, divide, True), what
                layout = ScaleLayout.of(given)
                want_strides = given.stride() if layout is None else layout.strides(*given.shape)
                assert scales.stride() == want_strides, what
                assert scales.untyped_storage().data_ptr() == base.data_ptr(), what
                assert scales.data_ptr() == given.data_ptr() and torch.equal(scales, given), what
    args = _cpu_args(t=0)
    args["cu_seqlens"] = torch.tensor([0, 0], dtype=torch.int32)
    sm100_fp8.fa4_attention_fp8_group_varlen(args.pop("q"), args.pop("k"), args.pop("v"), **args)
    assert seen == []


@needs_fa4
def test_sm100_fp8_group_kernel_compiles_on_the_cpu(tmp_path):
    """Compile (never run) with fake CUDA tensors for ``sm_100a``: each (head dims, dtype, class, flags, row- or
    column-major scales) is its own cache entry; the last one's PTX loads tensor memory, converts with
    ``cvt.rn.satfinite.e4m3x2.f32``, stores the codes 8 bytes at a time and a 4-byte scale, divides by 448
    and takes ``rcp.rn.f32``."""
    code = textwrap.dedent("""
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from fusion_pass import fp8
        from fusion_pass.kernels.fa4 import common, sm100_fp8
        L = fp8.ScaleLayout
        # (H, Hkv, D, Dv, dtype, Tk (None: the queries' own), max_seqlen, layout, ue8m0, divide, causal)
        cases = ((16, 16, 192, 128, torch.bfloat16, None, 700, L.ROW_MAJOR, False, False, True),      # MLA, q_stage 2
                 (16, 16, 192, 128, torch.float16, None, 700, L.COLUMN_MAJOR, True, False, True),
                 (32, 8, 128, 128, torch.bfloat16, None, 100, L.COLUMN_MAJOR_TMA, False, True, True),  # S ping-pong
                 (32, 8, 128, 128, torch.float16, None, 700, L.ROW_MAJOR, True, True, True),           # q_stage 2
                 (16, 16, 192, 128, torch.bfloat16, 3000, 700, L.COLUMN_MAJOR_TMA, True, True, True),  # own keys
                 (8, 8, 128, 128, torch.bfloat16, None, 100, L.COLUMN_MAJOR, False, False, False))     # not causal
        with FakeTensorMode(allow_non_fake_inputs=True):
            for h, hkv, d, dv, dtype, tk, max_seqlen, layout, ue8m0, divide, causal in cases:
                t = 1001
                q = torch.empty(t, h, d, dtype=dtype, device="cuda")
                k = torch.empty(tk or t, hkv, d, dtype=dtype, device="cuda")
                v = torch.empty(tk or t, hkv, dv, dtype=dtype, device="cuda")
                cu = torch.empty(4, dtype=torch.int32, device="cuda")
                ctx = {} if tk is None else dict(cu_seqlens_k=torch.empty(4, dtype=torch.int32, device="cuda"),
                                                 max_seqlen_k=2000)
                g = h * dv // 128
                scales = torch.empty_strided((t, g), layout.strides(t, g), dtype=torch.float32, device="cuda")
                out = torch.empty(t, h * dv, dtype=torch.float8_e4m3fn, device="cuda")
                sm100_fp8.fa4_attention_fp8_group_varlen(q, k, v, cu_seqlens=cu, max_seqlen=max_seqlen,
                                                         softmax_scale=0.1, causal=causal, output=out, scales=scales,
                                                         ue8m0=ue8m0, divide=divide, **ctx)
        keys = [key for key in common._caches["fusion_pass_fa4_sm100"].cache if key[1][0] == "fp8_group"]
        print("compiled", len(keys), sorted({key[1][2:5] for key in keys}))
    """)
    env = dict(os.environ, **SM100_ENV, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900,
                            cwd=tmp_path)
    # (ue8m0, divide, column-major)
    want = ("compiled 6 [(False, False, False), (False, False, True), (False, True, True), (True, False, True), "
            "(True, True, False), (True, True, True)]")
    assert result.returncode == 0 and want in result.stdout, (result.stdout[-800:], result.stderr[-3000:])
    # the kernels share one dump name: the PTX on disk is the last case's (ue8m0 and divide off)
    ptx = "".join(p.read_text() for p in tmp_path.glob("*Sm100Fp8Group*.ptx"))
    for instruction in ("cvt.rn.satfinite.e4m3x2.f32", "st.global.b64", "st.global.b32", "div.rn.f32",
                        "rcp.rn.f32", "tcgen05.ld"):
        assert instruction in ptx, f"no {instruction} in the group kernel's PTX"


@needs_fa4
def test_sm100_group_kernel_refuses_a_head_dim_without_whole_groups():
    code = textwrap.dedent("""
        from fusion_pass.kernels.fa4.sm100_fp8_group_kernel import FlashAttentionForwardSm100Fp8Group
        try:
            FlashAttentionForwardSm100Fp8Group(64, 64, qhead_per_kvhead=1, is_causal=True, is_local=False,
                                               is_split_kv=False, pack_gqa=False, m_block_size=128,
                                               n_block_size=128, q_stage=1, is_static_persistent=False,
                                               is_varlen_q=True, use_2cta_instrs=False, use_clc_scheduler=False,
                                               use_s_ping_pong=True, ue8m0=True)
        except ValueError as e:
            print("refused:", e)
    """)
    env = dict(os.environ, **SM100_ENV, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH"))
                                                                   if p))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "refused: the group output stage needs Dv % 128 == 0, got head_dim_v_padded=64" in result.stdout, \
        (result.stdout[-500:], result.stderr[-3000:])
