"""FlashAttention-4 on Hopper with a static per-tensor FP8 epilogue: ``fa4_attention_fp8_static_varlen``.

The fused kernel (``fusion_pass/kernels/fa4/sm90_fp8_kernel.py``) writes ``float8_e4m3fn [T, H*Dv]`` equal to
``fp8.quantize_static(twin, inv_scale, nan=...)`` where ``twin`` is FA4's own bf16/fp16 output of the same call
(``sm90.fa4_attention_varlen``).

CPU (no GPU): argument checks raising ``ArgumentError`` naming the argument, before FA4 is imported; with FA4
installed, the kernel compiles (never runs) for ``sm_90a`` under ``FakeTensorMode`` in a subprocess for every
supported head-dim pair (MLA 192/128 and GQA 128 among them), causal, both NaN rules, and keys in their own
workspace.

GPU (an SM90 device with FA4; skipped otherwise, not yet run): generated varlen prefill batches (seeds from
``random.SystemRandom``, in the messages) with lengths around the tile edges, bf16 and fp16, both NaN rules: the
fused bytes equal ``fp8.quantize_static`` of the twin's output, whatever the poison the buffer held; rows outside the
sequences (``cu_seqlens`` starting past row 0 and ending before ``T``) keep their poison; a NaN / ±Inf in the first
value row of a sequence (seen by every causal row) gives the rule's bytes in that column of every row.
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from fusion_pass import fp8
from fusion_pass.kernels.fa4 import sm90 as fa4_sm90, sm90_fp8 as fa4_fp8
from fusion_pass.nvfp4 import ArgumentError

from sm90_gpu import gpu  # noqa: E402

needs_fa4 = pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None,
                               reason="flash_attn.cute is not installed (the fa4 extra)")

SM90_ENV = dict(CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_ARCH="sm_90", FLASH_ATTENTION_NUM_SMS="132")

FN = "fa4_attention_fp8_static_varlen"


def fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


# ---------------------------------------------------------------------------
# CPU: argument checks, before FA4 is imported
# ---------------------------------------------------------------------------


def _cpu_args(h=4, hkv=4, d=128, dv=128, t=10):
    q = torch.zeros(t, h, d, dtype=torch.bfloat16)
    k = torch.zeros(t, hkv, d, dtype=torch.bfloat16)
    v = torch.zeros(t, hkv, dv, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, t], dtype=torch.int32)
    out = torch.empty(t, h * dv, dtype=torch.float8_e4m3fn)
    inv = torch.ones(1, dtype=torch.float32)
    return dict(q=q, k=k, v=v, cu_seqlens=cu, max_seqlen=6, softmax_scale=0.1, causal=True, output=out,
                inv_scale=inv)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {**a, "output": a["output"].view(torch.uint8)}, r"output must be float8_e4m3fn \[T, H\*Dv\] = "
                                                                   r"\[10, 512\]"),
        (lambda a: {**a, "output": a["output"].to(torch.bfloat16)}, r"output must be float8_e4m3fn"),
        (lambda a: {**a, "output": a["output"][:9]}, r"output must be float8_e4m3fn \[T, H\*Dv\] = \[10, 512\]"),
        (lambda a: {**a, "output": a["output"].view(10, 4, 128)}, r"output must be float8_e4m3fn \[T, H\*Dv\]"),
        (lambda a: {**a, "output": torch.empty(10, 1024, dtype=torch.float8_e4m3fn)[:, :512]},
         r"output must be a contiguous 16-byte aligned float8_e4m3fn \[T, H\*Dv\], got strides \(1024, 1\)"),
        (lambda a: {**a, "output": torch.empty(512, 10, dtype=torch.float8_e4m3fn).t()},
         r"output must have unit stride along its columns"),
        (lambda a: {**a, "output": torch.empty(10 * 512 + 1, dtype=torch.float8_e4m3fn)[1:].view(10, 512)},
         r"output must be a contiguous 16-byte aligned .*, got strides \(512, 1\), address 0x[0-9a-f]*[1-9a-f]$"),
        (lambda a: {**a, "output": a["output"].to("meta")}, r"output must be on q's device"),
        (lambda a: {**a, "output": None}, r"output must be a contiguous 16-byte aligned float8_e4m3fn .*, got None"),
        (lambda a: {**a, "inv_scale": torch.ones(2)}, r"inv_scale must be a one-element float32 tensor"),
        (lambda a: {**a, "inv_scale": torch.ones(1, dtype=torch.float64)}, r"inv_scale must be a one-element float32"),
        (lambda a: {**a, "inv_scale": torch.ones(1, dtype=torch.bfloat16)}, r"inv_scale must be a one-element"),
        (lambda a: {**a, "inv_scale": torch.ones(0)}, r"inv_scale must be a one-element float32 tensor"),
        (lambda a: {**a, "inv_scale": 1.0}, r"inv_scale must be a one-element float32 tensor"),
        (lambda a: {**a, "inv_scale": torch.ones(1, device="meta")}, r"inv_scale must be on the data's device cpu"),
        (lambda a: {**a, "nan_to_max": 1}, r"nan_to_max must be a bool"),
        (lambda a: {**a, "q": torch.zeros(10, 4, 256, dtype=torch.bfloat16),
                    "k": torch.zeros(10, 4, 256, dtype=torch.bfloat16)}, r"D=256, v Dv=128\) are not supported"),
        (lambda a: {**a, "cu_seqlens": a["cu_seqlens"].long()}, r"cu_seqlens must be a 1-D int32"),
        (lambda a: {**a, "causal": 1}, r"causal must be a bool"),
        (lambda a: {**a, "softmax_scale": float("inf")}, r"softmax_scale must be a positive finite"),
        (lambda a: {**a, "max_seqlen_k": 6}, r"max_seqlen_k=6 is given without cu_seqlens_k"),
    ],
)
def test_fp8_entry_rejects_bad_arguments_before_importing_fa4(change, match, monkeypatch):
    monkeypatch.setattr(fa4_sm90, "fa4_interface", lambda: pytest.fail("FA4 imported before the checks"))
    monkeypatch.setattr(fa4_fp8, "compile_fp8_static_kernel",
                        lambda *a, **k: pytest.fail("compiled before the checks"))
    args = change(_cpu_args())
    with pytest.raises(ArgumentError, match=f"^{FN}: .*{match}"):
        fa4_fp8.fa4_attention_fp8_static_varlen(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_fp8_entry_accepts_its_arguments_and_zero_tokens_does_nothing(monkeypatch):
    """Good arguments pass the checks (any one-element inv_scale shape; nan_to_max either way); ``T = 0`` returns
    before compiling; otherwise the compile function is reached with ``inv_scale`` as ``[1]``, the output as its
    bytes and the NaN rule."""
    seen = []

    def fake_compile(q, k, v, o, output_bytes, inv, cu, cu_k, cfg, causal, *, nan_to_max):
        seen.append((output_bytes.dtype, tuple(output_bytes.shape), tuple(inv.shape), inv.stride(), nan_to_max,
                     cu_k is cu))
        raise RuntimeError("stop")

    monkeypatch.setattr(fa4_fp8, "compile_fp8_static_kernel", fake_compile)
    for inv in (torch.ones(1), torch.ones(()), torch.ones(1, 1), torch.ones(2)[::2]):
        for nan_to_max in (True, False):
            args = {**_cpu_args(), "inv_scale": inv, "nan_to_max": nan_to_max}
            with pytest.raises(RuntimeError, match="stop"):
                fa4_fp8.fa4_attention_fp8_static_varlen(args.pop("q"), args.pop("k"), args.pop("v"), **args)
    assert seen == [(torch.uint8, (10, 512), (1,), (1,), rule, True) for _ in range(4) for rule in (True, False)]
    args = _cpu_args(t=0)
    args["cu_seqlens"] = torch.tensor([0, 0], dtype=torch.int32)
    fa4_fp8.fa4_attention_fp8_static_varlen(args.pop("q"), args.pop("k"), args.pop("v"), **args)
    assert len(seen) == 8


def test_fp8_entry_module_imports_without_fa4():
    code = "import sys, fusion_pass.kernels.fa4.sm90_fp8 as m; m.fa4_attention_fp8_static_varlen; " \
           "print(any(n.startswith(('flash_attn', 'cutlass')) for n in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", "importing sm90_fp8 imported FA4"


# ---------------------------------------------------------------------------
# CPU: compile-only for sm_90a (FA4 installed)
# ---------------------------------------------------------------------------


@needs_fa4
def test_sm90_fp8_kernel_compiles_on_the_cpu():
    """Compile (never run) the FP8 kernel with fake CUDA tensors for MLA 192/128, GQA 128/128 (both NaN rules),
    64/64 and 96/96, causal, and MLA with keys in their own workspace; each (rule, head dims, dtype, ...) is its own
    cache entry. No GPU or driver needed."""
    code = textwrap.dedent("""
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from fusion_pass.kernels.fa4 import common, sm90_fp8 as fa4_fp8
        cases = ((16, 16, 192, 128, torch.bfloat16, None, True),   # MLA
                 (32, 8, 128, 128, torch.float16, None, True),     # GQA
                 (32, 8, 128, 128, torch.float16, None, False),    # GQA, NaN -> 0x7F
                 (16, 16, 192, 128, torch.float16, 3000, False),   # keys in their own workspace
                 (8, 2, 64, 64, torch.bfloat16, None, True),
                 (8, 8, 96, 96, torch.bfloat16, None, False))
        with FakeTensorMode(allow_non_fake_inputs=True):
            for h, hkv, d, dv, dtype, tk, nan_to_max in cases:
                t = 1000
                q = torch.empty(t, h, d, dtype=dtype, device="cuda")
                k = torch.empty(tk or t, hkv, d, dtype=dtype, device="cuda")
                v = torch.empty(tk or t, hkv, dv, dtype=dtype, device="cuda")
                cu = torch.empty(4, dtype=torch.int32, device="cuda")
                ctx = {} if tk is None else dict(cu_seqlens_k=torch.empty(4, dtype=torch.int32, device="cuda"),
                                                 max_seqlen_k=2000)
                inv = torch.empty(1, dtype=torch.float32, device="cuda")
                out = torch.empty(t, h * dv, dtype=torch.float8_e4m3fn, device="cuda")
                fa4_fp8.fa4_attention_fp8_static_varlen(q, k, v, cu_seqlens=cu, max_seqlen=700, softmax_scale=0.1,
                                                         causal=True, output=out, inv_scale=inv,
                                                         nan_to_max=nan_to_max, **ctx)
        keys = common._caches["fusion_pass_fa4_sm90_fp8_static"].cache
        print("compiled", len(keys), sorted({key[2] for key in keys}))
    """)
    env = dict(os.environ, **SM90_ENV)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0 and "compiled 6 [126, 127]" in result.stdout, \
        (result.stdout[-500:], result.stderr[-3000:])


@needs_fa4
def test_fp8_kernel_rejects_an_unknown_nan_byte():
    code = textwrap.dedent("""
        import os
        from fusion_pass.kernels.fa4.sm90_fp8_kernel import FlashAttentionForwardSm90Fp8Static
        try:
            FlashAttentionForwardSm90Fp8Static(None, 128, 128, 1, nan_byte=0xFE)
        except ValueError as e:
            print("refused:", e)
    """)
    env = dict(os.environ, **SM90_ENV)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "refused: nan_byte must be one of ['0x7e', '0x7f'], got 254" in result.stdout, result.stderr[-3000:]


# ---------------------------------------------------------------------------
# GPU: bytes against fp8.quantize_static of the twin
# ---------------------------------------------------------------------------

# (name, H, Hkv, D, Dv, tile_m of the causal configuration)
HEADS = [
    ("mla16", 16, 16, 192, 128),
    ("gqa", 32, 8, 128, 128),
    ("mha_d64", 8, 2, 64, 64),
    ("d96", 8, 8, 96, 96),
]
RULES = {True: fp8.NaNRule.POSITIVE_MAX, False: fp8.NaNRule.NAN}


def _lengths(rng: random.Random, tile_m: int) -> list[int]:
    """1-5 prefill lengths around multiples of the query tile (and 1)."""
    picks = []
    for _ in range(rng.randint(1, 5)):
        base = tile_m * rng.randint(0, 4)
        picks.append(max(1, base + rng.choice((-1, 0, 1, rng.randint(-tile_m // 2, tile_m // 2)))))
    return picks


def _inputs(seed, h, hkv, d, dv, lengths, dtype, pad_before=0, pad_after=0):
    gen = torch.Generator().manual_seed(seed)
    t = pad_before + sum(lengths) + pad_after
    q = torch.randn(t, h, d, generator=gen).to("cuda", dtype)
    k = torch.randn(t, hkv, d, generator=gen).to("cuda", dtype)
    v = (torch.randn(t, hkv, dv, generator=gen) * torch.exp(torch.randn(t, hkv, 1, generator=gen))).to("cuda", dtype)
    cu = torch.tensor([pad_before] + (pad_before + torch.tensor(lengths).cumsum(0)).tolist(), dtype=torch.int32,
                      device="cuda")
    return q, k, v, cu


def _inv_scale(ref: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """``fp8.reciprocal(scale)`` with ``scale`` near ``amax / 448``: some products saturate when the factor < 1."""
    finite = ref.float()[ref.float().isfinite()]
    amax = max(finite.abs().max().item(), 1e-6) if finite.numel() else 1.0
    scale = torch.tensor([amax / 448 * rng.uniform(0.5, 2.0)], dtype=torch.float32, device="cuda")
    return fp8.reciprocal(scale)


def _fused(q, k, v, cu, max_seqlen, inv, nan_to_max, poison):
    t, h, dv = q.shape[0], q.shape[1], v.shape[2]
    out = torch.full((t, h * dv), poison, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    fa4_fp8.fa4_attention_fp8_static_varlen(q, k, v, cu_seqlens=cu, max_seqlen=max_seqlen,
                                             softmax_scale=q.shape[2] ** -0.5, causal=True, output=out,
                                             inv_scale=inv, nan_to_max=nan_to_max)
    torch.cuda.synchronize()
    return out.view(torch.uint8)


def _check(name, q, k, v, cu, lengths, nan_to_max, seed, rng, rows=None):
    """Fused bytes == quantize_static(twin) on the sequences' rows (two poisons), poison elsewhere. Returns the
    fused bytes and the twin."""
    twin = fa4_sm90.fa4_attention_varlen(q, k, v, cu, max(lengths), causal=True, softmax_scale=q.shape[2] ** -0.5)
    t, h, dv = twin.shape
    inv = _inv_scale(twin[rows] if rows is not None else twin, rng)
    want = fp8.quantize_static(twin.reshape(t, h * dv), inv, nan=RULES[nan_to_max]).view(torch.uint8)
    rows = slice(None) if rows is None else rows
    for poison in (0xA5, 0x00):
        got = _fused(q, k, v, cu, max(lengths), inv, nan_to_max, poison)
        bad = (got[rows] != want[rows]).nonzero()
        assert len(bad) == 0, (f"{name}: {len(bad)} bytes differ from quantize_static(twin) (poison {poison:#x}, "
                               f"nan_to_max={nan_to_max}, lengths {lengths}, seed {seed}); first (row, col): "
                               f"{bad[:8].tolist()}")
        outside = torch.ones(t, dtype=torch.bool, device="cuda")
        outside[rows] = False
        assert bool((got[outside] == poison).all()), f"{name}: rows outside the sequences written (seed {seed})"
    return got, twin


@gpu
@pytest.mark.parametrize("nan_to_max", [True, False], ids=["nan_to_max", "nan_to_nan"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", HEADS, ids=[c[0] for c in HEADS])
def test_fp8_bytes_equal_quantize_static_of_fa4_output(heads, dtype, nan_to_max):
    name, h, hkv, d, dv = heads
    seed = fresh_seed()
    rng = random.Random(seed)
    tile_m = fa4_sm90.kernel_config(d, dv, True).tile_m
    for _ in range(3):
        lengths = _lengths(rng, tile_m)
        q, k, v, cu = _inputs(rng.randrange(2**31), h, hkv, d, dv, lengths, dtype)
        _check(name, q, k, v, cu, lengths, nan_to_max, seed, rng)


@gpu
@pytest.mark.parametrize("nan_to_max", [True, False], ids=["nan_to_max", "nan_to_nan"])
def test_fp8_rows_outside_the_sequences_are_untouched(nan_to_max):
    seed = fresh_seed()
    rng = random.Random(seed)
    lengths = [129, 1, 127]
    before, after = rng.randint(1, 40), rng.randint(1, 40)
    q, k, v, cu = _inputs(seed, 16, 16, 192, 128, lengths, torch.bfloat16, before, after)
    rows = torch.zeros(q.shape[0], dtype=torch.bool, device="cuda")
    rows[before:before + sum(lengths)] = True
    _check("offset rows", q, k, v, cu, lengths, nan_to_max, seed, rng, rows=rows)


@gpu
@pytest.mark.parametrize("special, byte_max, byte_nan", [
    (float("nan"), 0x7E, 0x7F), (float("inf"), 0x7E, 0x7E), (float("-inf"), 0xFE, 0xFE)],
    ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp8_nonfinite_value_row_seen_by_all_rows(special, byte_max, byte_nan, dtype):
    """A NaN / ±Inf in the first value row of a sequence, one KV head and column: every causal row of that sequence
    sees it, so that column of every query head of the KV head is the rule's byte on every row."""
    seed = fresh_seed()
    rng = random.Random(seed)
    h, hkv, d, dv = 32, 8, 128, 128
    lengths = [130, 1, 255]
    q, k, v, cu = _inputs(seed, h, hkv, d, dv, lengths, dtype)
    b = rng.randrange(len(lengths))
    start, end = sum(lengths[:b]), sum(lengths[:b + 1])
    kv_head, col = rng.randrange(hkv), rng.randrange(dv)
    v[start, kv_head, col] = special
    for nan_to_max in (True, False):
        got, twin = _check("nonfinite", q, k, v, cu, lengths, nan_to_max, seed, rng)
        want = byte_max if nan_to_max else byte_nan
        for head in range(kv_head * (h // hkv), (kv_head + 1) * (h // hkv)):
            column = got[start:end, head * dv + col]
            assert bool((column == want).all()), (
                f"{special} in v[{start}, {kv_head}, {col}]: head {head} column bytes "
                f"{column.unique().tolist()} != {want:#x} (nan_to_max={nan_to_max}, seed {seed})")
