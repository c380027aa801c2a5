"""FlashAttention-4 on Hopper with a dynamic 128-column group FP8 epilogue: ``sm90_fp8.fa4_attention_fp8_group_varlen``
(FA4 as the ``fa4`` backend of the FP8 entry points: ``test_fa4_fp8_backend.py``).

The fused kernel (``fusion_pass/kernels/fa4/sm90_fp8_group_kernel.py``) writes ``float8_e4m3fn [T, H*Dv]`` and
float32 scales ``[T, H*Dv/128]`` (row-major, column-major or TMA-aligned column-major) equal to
``fp8.quantize_group(twin.reshape(T, H*Dv), ue8m0=..., divide=...)`` where ``twin`` is FA4's own bf16/fp16 output of
the same call (``sm90.fa4_attention_varlen``).

CPU (no GPU): argument checks raising ``ArgumentError`` naming the argument, before FA4 is imported or anything is
compiled; the scale buffer handed to the compile function keeps the caller's addresses in every layout (generated
token counts). With FA4 installed, the kernel compiles (never runs) for ``sm_90a`` under ``FakeTensorMode`` in a
subprocess: MLA (192, 128) and (128, 128), causal and not, UE8M0 on/off, divide on/off, each scale layout, one head
(one group per row), keys in their own workspace.

GPU (an SM90 device with FA4; skipped otherwise): generated varlen batches (seeds from ``random.SystemRandom``, in
the messages) with lengths around the tile edges, bf16 and fp16, every layout and flag pair: bytes and scales equal
the reference on the twin, whatever the poison the buffers held; rows outside the sequences and the TMA layout's
padding rows keep their poison; keys in their own workspace; a NaN / ±Inf in the first value row of a sequence gives
``0xFE`` in that column of every row (and an infinite scale for ±Inf).
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
from fusion_pass.fp8 import ScaleLayout
from fusion_pass.kernels.fa4 import sm90 as fa4_sm90, sm90_fp8 as fa4_fp8
from fusion_pass.nvfp4 import ArgumentError

from sm90_gpu import gpu  # noqa: E402

needs_fa4 = pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None,
                               reason="flash_attn.cute is not installed (the fa4 extra)")

SM90_ENV = dict(CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_ARCH="sm_90", FLASH_ATTENTION_NUM_SMS="132")

FN = "fa4_attention_fp8_group_varlen"
LAYOUTS = list(ScaleLayout)
FLAGS = [(False, False), (True, False), (False, True), (True, True)]  # (ue8m0, divide)


def fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


# ---------------------------------------------------------------------------
# CPU: argument checks, before FA4 is imported
# ---------------------------------------------------------------------------


def _cpu_args(h=4, hkv=4, d=128, dv=128, t=10, layout=ScaleLayout.ROW_MAJOR):
    q = torch.zeros(t, h, d, dtype=torch.bfloat16)
    k = torch.zeros(t, hkv, d, dtype=torch.bfloat16)
    v = torch.zeros(t, hkv, dv, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, t], dtype=torch.int32)
    out = torch.empty(t, h * dv, dtype=torch.float8_e4m3fn)
    scales = fp8.group_scale_buffer(t, h * dv, layout)
    return dict(q=q, k=k, v=v, cu_seqlens=cu, max_seqlen=6, softmax_scale=0.1, causal=True, output=out,
                scales=scales)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {**a, "output": a["output"].view(torch.uint8)}, r"output must be float8_e4m3fn \[T, H\*Dv\] = "
                                                                   r"\[10, 512\]"),
        (lambda a: {**a, "output": a["output"][:9]}, r"output must be float8_e4m3fn \[T, H\*Dv\] = \[10, 512\]"),
        (lambda a: {**a, "output": torch.empty(10, 1024, dtype=torch.float8_e4m3fn)[:, :512]},
         r"output must be a contiguous 16-byte aligned float8_e4m3fn \[T, H\*Dv\], got strides \(1024, 1\)"),
        (lambda a: {**a, "output": torch.empty(10 * 512 + 1, dtype=torch.float8_e4m3fn)[1:].view(10, 512)},
         r"output must be a contiguous 16-byte aligned .*, got strides \(512, 1\), address 0x[0-9a-f]*[1-9a-f]$"),
        (lambda a: {**a, "output": a["output"].to("meta")}, r"output must be on q's device"),
        (lambda a: {**a, "output": None}, r"output must be a contiguous 16-byte aligned float8_e4m3fn .*, got None"),
        (lambda a: {**a, "scales": None}, r"scales must be a float32 \[T, H\*Dv/128\] tensor .*, got None"),
        (lambda a: {**a, "scales": a["scales"].half()}, r"scales must be float32 \[T, H\*Dv/128\] = \[10, 4\], got "
                                                        r"torch.float16"),
        (lambda a: {**a, "scales": a["scales"][:, :3]}, r"scales must be float32 \[T, H\*Dv/128\] = \[10, 4\]"),
        (lambda a: {**a, "scales": a["scales"].to("meta")}, r"scales must be on q's device"),
        (lambda a: {**a, "scales": torch.empty(10, 8)[:, ::2]},
         r"scales must be in one of the layouts \(strides\) row_major \(4, 1\), column_major \(1, 10\), "
         r"column_major_tma \(1, 12\) \(or the first rows of a column-major one\), got strides \(8, 2\)"),
        (lambda a: {**a, "scales": "buffer"}, r"scales must be a tensor \(got str\)"),
        (lambda a: {**a, "ue8m0": 1}, r"ue8m0 must be a bool, got 1"),
        (lambda a: {**a, "divide": "no"}, r"divide must be a bool, got 'no'"),
        (lambda a: {**a, "q": torch.zeros(10, 4, 64, dtype=torch.bfloat16),
                    "k": torch.zeros(10, 4, 64, dtype=torch.bfloat16),
                    "v": torch.zeros(10, 4, 64, dtype=torch.bfloat16)},
         r"v's head dim Dv must be divisible by 128 \(a head's tile holds whole 128-column groups\), got v "
         r"\[10, 4, 64\]"),
        (lambda a: {**a, "q": torch.zeros(10, 4, 256, dtype=torch.bfloat16),
                    "k": torch.zeros(10, 4, 256, dtype=torch.bfloat16)}, r"D=256, v Dv=128\) are not supported"),
        (lambda a: {**a, "cu_seqlens": a["cu_seqlens"].long()}, r"cu_seqlens must be a 1-D int32"),
        (lambda a: {**a, "causal": 1}, r"causal must be a bool"),
        (lambda a: {**a, "softmax_scale": float("nan")}, r"softmax_scale must be a positive finite"),
        (lambda a: {**a, "max_seqlen_k": 6}, r"max_seqlen_k=6 is given without cu_seqlens_k"),
    ],
)
def test_group_entry_rejects_bad_arguments_before_importing_fa4(change, match, monkeypatch):
    monkeypatch.setattr(fa4_sm90, "fa4_interface", lambda: pytest.fail("FA4 imported before the checks"))
    monkeypatch.setattr(fa4_fp8, "compile_fp8_group_kernel", lambda *a, **k: pytest.fail("compiled before the checks"))
    args = change(_cpu_args())
    with pytest.raises(ArgumentError, match=f"^{FN}: .*{match}"):
        fa4_fp8.fa4_attention_fp8_group_varlen(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_group_entry_hands_the_callers_scale_addresses_to_the_kernel(monkeypatch):
    """For generated token counts (1 and non-multiples of 4 among them), head counts (one group per row among them)
    and every layout, the compile function gets the output as bytes, the flags, and a scale view with its layout's
    strides reading exactly the caller's scales (the same storage and addresses); ``T = 0`` compiles nothing."""
    seed = fresh_seed()
    rng = random.Random(seed)
    seen = []

    def fake_compile(q, k, v, o, output_bytes, scales, cu, cu_k, cfg, causal, *, ue8m0, divide):
        seen.append((output_bytes, scales, ue8m0, divide, cu_k is cu))
        raise RuntimeError("stop")

    monkeypatch.setattr(fa4_fp8, "compile_fp8_group_kernel", fake_compile)
    for t in [1, 2, 3, 4, 5] + [rng.randint(6, 300) for _ in range(4)]:
        for h in (1, rng.randint(2, 5)):
            for layout in LAYOUTS:
                ue8m0, divide = rng.choice(FLAGS)
                args = {**_cpu_args(h=h, hkv=1, t=t, layout=layout), "ue8m0": ue8m0, "divide": divide}
                args["cu_seqlens"] = torch.tensor([0, t], dtype=torch.int32)
                given = args["scales"]
                base = given.untyped_storage()
                torch.arange(base.nbytes() // 4, dtype=torch.float32, out=torch.empty(0).set_(base))
                with pytest.raises(RuntimeError, match="stop"):
                    fa4_fp8.fa4_attention_fp8_group_varlen(args.pop("q"), args.pop("k"), args.pop("v"), **args)
                out_bytes, scales, got_ue8m0, got_divide, same_cu = seen.pop()
                what = f"T={t}, H={h}, {layout.value} (seed {seed})"
                assert out_bytes.dtype == torch.uint8 and out_bytes.data_ptr() == args["output"].data_ptr(), what
                assert (got_ue8m0, got_divide, same_cu) == (ue8m0, divide, True), what
                want_layout = ScaleLayout.of(given)
                assert scales.stride() == want_layout.strides(*given.shape), what
                assert scales.untyped_storage().data_ptr() == base.data_ptr(), what
                assert torch.equal(scales, given), what
    args = _cpu_args(t=0)
    args["cu_seqlens"] = torch.tensor([0, 0], dtype=torch.int32)
    fa4_fp8.fa4_attention_fp8_group_varlen(args.pop("q"), args.pop("k"), args.pop("v"), **args)
    assert seen == []


def test_group_entry_module_imports_without_fa4():
    code = "import sys, fusion_pass.kernels.fa4.sm90_fp8 as m; m.fa4_attention_fp8_group_varlen; " \
           "import fusion_pass.kernels.choice; " \
           "print(any(n.startswith(('flash_attn', 'cutlass')) for n in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", "importing sm90_fp8 or choice imported FA4"


# ---------------------------------------------------------------------------
# CPU: compile-only for sm_90a (FA4 installed)
# ---------------------------------------------------------------------------


@needs_fa4
def test_sm90_fp8_group_kernel_compiles_on_the_cpu():
    """Compile (never run) the group kernel with fake CUDA tensors: MLA 192/128 and GQA 128/128, bf16 and fp16,
    every (ue8m0, divide) pair, every scale layout (row- or column-major is part of the key), one head (one group a
    row), keys in their own workspace, and one non-causal configuration. No GPU or driver needed."""
    code = textwrap.dedent("""
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from fusion_pass import fp8
        from fusion_pass.kernels.fa4 import common, sm90_fp8 as fa4_fp8
        L = fp8.ScaleLayout
        # (H, Hkv, D, Dv, dtype, Tk (None: the queries' own), layout, ue8m0, divide, causal)
        cases = ((16, 16, 192, 128, torch.bfloat16, None, L.ROW_MAJOR, False, False, True),       # MLA
                 (16, 16, 192, 128, torch.float16, None, L.COLUMN_MAJOR, True, False, True),
                 (32, 8, 128, 128, torch.bfloat16, None, L.COLUMN_MAJOR_TMA, False, True, True),  # GQA
                 (32, 8, 128, 128, torch.float16, None, L.ROW_MAJOR, True, True, True),
                 (16, 16, 192, 128, torch.bfloat16, 3000, L.COLUMN_MAJOR_TMA, True, False, True),  # own keys
                 (1, 1, 128, 128, torch.bfloat16, None, L.COLUMN_MAJOR_TMA, False, False, True),  # one group
                 (8, 8, 128, 128, torch.bfloat16, None, L.COLUMN_MAJOR, False, True, False))      # not causal
        with FakeTensorMode(allow_non_fake_inputs=True):
            for h, hkv, d, dv, dtype, tk, layout, ue8m0, divide, causal in cases:
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
                fa4_fp8.fa4_attention_fp8_group_varlen(q, k, v, cu_seqlens=cu, max_seqlen=700, softmax_scale=0.1,
                                                       causal=causal, output=out, scales=scales, ue8m0=ue8m0,
                                                       divide=divide, **ctx)
        keys = common._caches["fusion_pass_fa4_sm90_fp8_group"].cache
        print("compiled", len(keys), sorted({key[2:5] for key in keys}))
    """)
    env = dict(os.environ, **SM90_ENV)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    # (ue8m0, divide, column-major); one head's [T, 1] scales are row-major whatever buffer holds them
    want = "compiled 7 [(False, False, False), (False, True, True), (True, False, True), (True, True, False)]"
    assert result.returncode == 0 and want in result.stdout, (result.stdout[-800:], result.stderr[-3000:])


@needs_fa4
def test_group_kernel_refuses_a_head_dim_without_whole_groups():
    code = textwrap.dedent("""
        from fusion_pass.kernels.fa4.sm90_fp8_group_kernel import FlashAttentionForwardSm90Fp8Group
        import cutlass
        try:
            FlashAttentionForwardSm90Fp8Group(cutlass.BFloat16, 64, 64, 1, ue8m0=True)
        except ValueError as e:
            print("refused:", e)
    """)
    env = dict(os.environ, **SM90_ENV)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "refused: the group epilogue needs Dv % 128 == 0, got tile_hdimv=64" in result.stdout, \
        (result.stdout[-500:], result.stderr[-3000:])


# ---------------------------------------------------------------------------
# GPU: bytes and scales against fp8.quantize_group of the twin
# ---------------------------------------------------------------------------

# (name, H, Hkv, D, Dv)
HEADS = [("mla16", 16, 16, 192, 128), ("gqa", 32, 8, 128, 128)]
POISON = 0xA5
SCALE_POISON = -3.25


def _lengths(rng: random.Random, tile_m: int) -> list[int]:
    """1-5 prefill lengths around multiples of the query tile (and 1)."""
    picks = []
    for _ in range(rng.randint(1, 5)):
        base = tile_m * rng.randint(0, 4)
        picks.append(max(1, base + rng.choice((-1, 0, 1, rng.randint(-tile_m // 2, tile_m // 2)))))
    return picks


def _inputs(seed, h, hkv, d, dv, lengths, dtype, pad_before=0, pad_after=0, context=None):
    """Packed q/k/v and offsets; ``context``: cached keys per sequence before its new tokens (keys in their own
    workspace, then also ``cu_seqlens_k``). Value rows scaled per row so that groups' amax spread widely."""
    gen = torch.Generator().manual_seed(seed)
    t = pad_before + sum(lengths) + pad_after
    k_lens = lengths if context is None else [c + n for c, n in zip(context, lengths)]
    tk = t if context is None else sum(k_lens)
    q = torch.randn(t, h, d, generator=gen).to("cuda", dtype)
    k = torch.randn(tk, hkv, d, generator=gen).to("cuda", dtype)
    v = (torch.randn(tk, hkv, dv, generator=gen) * torch.exp(2 * torch.randn(tk, hkv, 1, generator=gen)))
    v = v.to("cuda", dtype)
    cu = torch.tensor([pad_before] + (pad_before + torch.tensor(lengths).cumsum(0)).tolist(), dtype=torch.int32,
                      device="cuda")
    cu_k = None if context is None else torch.tensor([0] + torch.tensor(k_lens).cumsum(0).tolist(),
                                                     dtype=torch.int32, device="cuda")
    return q, k, v, cu, cu_k, (None if context is None else max(k_lens))


def _buffers(t, width, layout, poison, scale_poison):
    """Poisoned output and scales (the scales' whole backing buffer, padding rows of the TMA layout included)."""
    out = torch.full((t, width), poison, dtype=torch.uint8, device="cuda").view(fp8.FP8)
    scales = fp8.group_scale_buffer(t, width, layout, device="cuda")
    torch.empty(0, device="cuda").set_(scales.untyped_storage()).fill_(scale_poison)
    return out, scales


def _check(name, q, k, v, cu, lengths, layout, ue8m0, divide, seed, rows=None, cu_k=None, max_k=None):
    """Fused bytes and scales == quantize_group(twin) on the sequences' rows (two poisons), poison elsewhere (the
    TMA padding rows too). Returns the fused bytes, scales and the twin."""
    scale = q.shape[2] ** -0.5
    twin = fa4_sm90.fa4_attention_varlen(q, k, v, cu, max(lengths), causal=True, softmax_scale=scale,
                                         cu_seqlens_k=cu_k, max_seqlen_k=max_k)
    t, h, dv = twin.shape
    want, want_scales = fp8.quantize_group(twin.reshape(t, h * dv), ue8m0=ue8m0, divide=divide)
    want = want.view(torch.uint8)
    inside = torch.zeros(t, dtype=torch.bool, device="cuda")
    inside[slice(None) if rows is None else rows] = True
    what = (f"{name}: {layout.value}, ue8m0={ue8m0}, divide={divide}, {q.dtype}, lengths {lengths}, seed {seed}")
    for poison, scale_poison in ((POISON, SCALE_POISON), (0x00, float("nan"))):
        out, scales = _buffers(t, h * dv, layout, poison, scale_poison)
        fa4_fp8.fa4_attention_fp8_group_varlen(q, k, v, cu_seqlens=cu, max_seqlen=max(lengths), softmax_scale=scale,
                                               causal=True, output=out, scales=scales, ue8m0=ue8m0, divide=divide,
                                               cu_seqlens_k=cu_k, max_seqlen_k=max_k)
        torch.cuda.synchronize()
        got = out.view(torch.uint8)
        bad = (got[inside] != want[inside]).nonzero()
        assert len(bad) == 0, f"{what}: {len(bad)} bytes differ from quantize_group(twin); first {bad[:8].tolist()}"
        same = (scales[inside] == want_scales[inside]) | (scales[inside].isnan() & want_scales[inside].isnan())
        assert bool(same.all()), (f"{what}: scales differ at {(~same).nonzero()[:8].tolist()}: "
                                  f"{scales[inside][~same][:4].tolist()} != {want_scales[inside][~same][:4].tolist()}")
        assert bool((got[~inside] == poison).all()), f"{what}: bytes of rows outside the sequences written"
        backing = torch.empty(0, device="cuda").set_(scales.untyped_storage())
        untouched = torch.ones_like(backing, dtype=torch.bool)
        written = torch.zeros_like(scales, dtype=torch.bool)
        written[inside] = True
        untouched.view(-1)[_flat_indices(scales)[written]] = False
        stays = backing[untouched]
        kept = stays.isnan().all() if scale_poison != scale_poison else (stays == scale_poison).all()
        assert bool(kept), f"{what}: scale entries outside the sequences' rows (or padding) written"
    return got, scales, twin


def _flat_indices(scales: torch.Tensor) -> torch.Tensor:
    """Each ``[T, G]`` entry's index in its backing storage (float32 elements)."""
    t, g = scales.shape
    rows = torch.arange(t, device=scales.device).unsqueeze(1) * scales.stride(0)
    cols = torch.arange(g, device=scales.device).unsqueeze(0) * scales.stride(1)
    return scales.storage_offset() + rows + cols


@gpu
@pytest.mark.parametrize("flags", FLAGS, ids=[f"ue8m0={u}-divide={d}" for u, d in FLAGS])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout.value for layout in LAYOUTS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", HEADS, ids=[c[0] for c in HEADS])
def test_group_bytes_and_scales_equal_quantize_group_of_fa4_output(heads, dtype, layout, flags):
    name, h, hkv, d, dv = heads
    ue8m0, divide = flags
    seed = fresh_seed()
    rng = random.Random(seed)
    tile_m = fa4_sm90.kernel_config(d, dv, True).tile_m
    for _ in range(3):
        lengths = _lengths(rng, tile_m)
        q, k, v, cu, _, _ = _inputs(rng.randrange(2**31), h, hkv, d, dv, lengths, dtype)
        _check(name, q, k, v, cu, lengths, layout, ue8m0, divide, seed)


@gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout.value for layout in LAYOUTS])
def test_group_rows_outside_the_sequences_are_untouched(layout):
    seed = fresh_seed()
    rng = random.Random(seed)
    lengths = [129, 1, 127]
    before, after = rng.randint(1, 40), rng.randint(1, 40)
    q, k, v, cu, _, _ = _inputs(seed, 16, 16, 192, 128, lengths, torch.bfloat16, before, after)
    rows = torch.zeros(q.shape[0], dtype=torch.bool, device="cuda")
    rows[before:before + sum(lengths)] = True
    _check("offset rows", q, k, v, cu, lengths, layout, *rng.choice(FLAGS), seed, rows=rows)


@gpu
@pytest.mark.parametrize("heads", HEADS, ids=[c[0] for c in HEADS])
def test_group_keys_in_their_own_workspace(heads):
    """Cached context before each sequence's new tokens (``cu_seqlens_k``): bytes and scales as the twin's."""
    name, h, hkv, d, dv = heads
    seed = fresh_seed()
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 4))]
    context = [rng.choice((0, 1, 127, 128, rng.randint(0, 700))) for _ in lengths]
    q, k, v, cu, cu_k, max_k = _inputs(seed, h, hkv, d, dv, lengths, torch.bfloat16, context=context)
    _check(f"{name} context {context}", q, k, v, cu, lengths, rng.choice(LAYOUTS), *rng.choice(FLAGS), seed,
           cu_k=cu_k, max_k=max_k)


@gpu
@pytest.mark.parametrize("special", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_group_nonfinite_value_row_seen_by_all_rows(special, dtype):
    """A NaN / ±Inf in the first value row of a sequence (one KV head and column): every causal row of that
    sequence sees it, so that column of every query head of the KV head is ``0xFE`` (NaN -> -448; ±Inf makes the
    group's scale Inf and the column Inf * 0 = NaN) on every row; with ±Inf the group's scale is +Inf."""
    seed = fresh_seed()
    rng = random.Random(seed)
    h, hkv, d, dv = 32, 8, 128, 128
    lengths = [130, 1, 255]
    q, k, v, cu, _, _ = _inputs(seed, h, hkv, d, dv, lengths, dtype)
    b = rng.randrange(len(lengths))
    start, end = sum(lengths[:b]), sum(lengths[:b + 1])
    kv_head, col = rng.randrange(hkv), rng.randrange(dv)
    v[start, kv_head, col] = special
    for layout in LAYOUTS:
        ue8m0, divide = rng.choice(FLAGS)
        got, scales, _ = _check("nonfinite", q, k, v, cu, lengths, layout, ue8m0, divide, seed)
        for head in range(kv_head * (h // hkv), (kv_head + 1) * (h // hkv)):
            column = got[start:end, head * dv + col]
            assert bool((column == 0xFE).all()), (
                f"{special} in v[{start}, {kv_head}, {col}]: head {head} column bytes {column.unique().tolist()} != "
                f"0xfe ({layout.value}, ue8m0={ue8m0}, divide={divide}, seed {seed})")
            if special != special:
                continue
            group_scales = scales[start:end, head * dv // 128]
            assert bool((group_scales == float("inf")).all()), (
                f"{special}: head {head} scales {group_scales.unique().tolist()} != inf (seed {seed})")

