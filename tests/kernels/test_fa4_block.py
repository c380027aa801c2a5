"""The block quantization both FA4 output stages share (:mod:`fusion_pass.kernels.fa4.nvfp4_block`), alone.

A small CuTe DSL kernel gives each thread one 16-element block of a ``[M, K]`` half tensor and calls
``quantize_block`` and ``store_block`` exactly as the SM90 and SM100 output stages do. On an SM90 GPU it runs the
software e2m1 path (the one the SM90 kernel uses) and its bytes must equal ``nvfp4.quantize``'s on generated data
with every special case of docs/nvfp4.md (ties, saturation, subnormal scales, negative zero, NaN and infinity
blocks). On an SM100/SM110 GPU the same test runs SM100's native ``cvt.rn.satfinite.e2m1x2.f32`` path too (never
run by this project: no Blackwell GPU). On the CPU both paths are compiled for their targets (fake tensors).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fusion_pass import nvfp4

needs_fa4 = pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None,
                               reason="flash_attn.cute is not installed (the fa4 extra)")

KERNEL = textwrap.dedent('''
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
    from flash_attn.cute import interface
    from flash_attn.cute.cute_dsl_utils import to_cute_tensor
    from fusion_pass.kernels.fa4.nvfp4_block import BLOCK, quantize_block, store_block

    @cute.kernel
    def quantize_kernel(mX: cute.Tensor, mOq: cute.Tensor, mSF: cute.Tensor, mGS: cute.Tensor,
                        native: cutlass.Constexpr[bool]):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        blocks_per_row = mX.shape[1] // BLOCK
        idx = bidx * 128 + tidx
        if idx < mX.shape[0] * blocks_per_row:
            row = idx // blocks_per_row
            col_block = idx - row * blocks_per_row
            x = cute.make_rmem_tensor((BLOCK,), Float32)
            for j in cutlass.range_constexpr(BLOCK):
                x[j] = mX[row, col_block * BLOCK + j].to(Float32)
            packed, sf_byte = quantize_block(x, mGS[0], native)
            store_block(mOq, mSF, row, col_block, packed, sf_byte)

    @cute.jit
    def quantize_rows(mX: cute.Tensor, mOq: cute.Tensor, mSF: cute.Tensor, mGS: cute.Tensor,
                      native: cutlass.Constexpr[bool], stream=None):
        n = mX.shape[0] * (mX.shape[1] // BLOCK)
        quantize_kernel(mX, mOq, mSF, mGS, native).launch(grid=[(n + 127) // 128, 1, 1], block=[128, 1, 1],
                                                         stream=stream)

    def compile_quantize_rows(x, packed, scales, gs, native):
        return cute.compile(quantize_rows, to_cute_tensor(x), to_cute_tensor(packed),
                            to_cute_tensor(scales, leading_dim=0), to_cute_tensor(gs, assumed_align=4, leading_dim=0),
                            native, cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
                            options=interface._compile_options())
''')


def _load_kernel_module(tmp_path):
    """The kernel above as an importable module (the CuTe DSL reads a jitted function's source file)."""
    path = tmp_path / "fa4_block_kernel.py"
    path.write_text(KERNEL)
    sys.path.insert(0, str(tmp_path))
    try:
        import fa4_block_kernel
    finally:
        sys.path.remove(str(tmp_path))
    return fa4_block_kernel


@needs_fa4
@pytest.mark.parametrize("arch, native", [("sm_90", False), ("sm_100", True), ("sm_100", False)],
                         ids=["sm90-software", "sm100-native", "sm100-software"])
def test_block_quantization_compiles_for_each_target(tmp_path, arch, native):
    """Compile-only (fake tensors): the software path for SM90 and SM100, the native e2m1 path for SM100.
    The native path is named sm100 in its id for ``pytest -k sm100``."""
    (tmp_path / "fa4_block_kernel.py").write_text(KERNEL)
    code = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(tmp_path)!r})
        from torch._subclasses.fake_tensor import FakeTensorMode
        import fa4_block_kernel
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.empty(300, 256, dtype=torch.bfloat16, device="cuda")
            packed = torch.empty(300, 128, dtype=torch.uint8, device="cuda")
            scales = torch.empty(384 * 16, dtype=torch.uint8, device="cuda")
            gs = torch.empty(1, dtype=torch.float32, device="cuda")
            fa4_block_kernel.compile_quantize_rows(x, packed, scales, gs, {native})
        print("compiled")
    """)
    env = dict(os.environ, FLASH_ATTENTION_ARCH=arch, CUTE_DSL_ARCH=f"{arch}a",
               FLASH_ATTENTION_NUM_SMS="148" if arch == "sm_100" else "132")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


def _special_rows(k, generator):
    """Rows that hit every rule of the contract: ties of the e2m1 rounding, saturation, tiny blocks whose scale
    is an e4m3 subnormal or zero, negative zero, one NaN, one infinity, all zeros."""
    rows = []
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, -0.25, -0.75, -2.5, -5.0, 0.0, -0.0, 6.0])
    rows.append(ties.repeat(k // 16))
    for scale in (1e-30, 1e-7, 3e-5, 1e3, 6e4):
        rows.append(torch.randn(k, generator=generator) * scale)
    row = torch.randn(k, generator=generator)
    row[3] = float("nan")
    row[40 % k] = float("inf")
    row[77 % k] = float("-inf")
    rows.append(row)
    rows.append(torch.zeros(k))
    rows.append(-torch.zeros(k))
    rows.append(-torch.rand(k, generator=generator) * 1e-3)
    return torch.stack(rows)


def _tie_rows(k, dtype):
    """Rows whose every 16-element block starts with 6.0 (with ``gs = 1`` the block scale is 1 and the codes are
    the rounding of the values themselves), then the e2m1 ties, the edges of the magnitude ranges a rounding
    step holds for (2, ~2.06, 4, 4.5) and 6, each with its neighbours one ``dtype`` ulp below and above (none
    above 6), and their negatives: every place a rounding of |q| to the e2m1 grid can go wrong, in the input's
    precision."""
    points = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.0, 2.0625, 2.5, 3.5, 4.0, 4.5, 5.0, 6.0], dtype=dtype)
    near = torch.cat([torch.nextafter(points, torch.zeros_like(points)), points,
                      torch.nextafter(points, torch.full_like(points, 8.0))]).float()
    near = near[near <= 6.0]  # above 6 the block's amax, and so its scale, would change (saturation: _special_rows)
    values = torch.cat([near, -near])
    blocks = [torch.cat([torch.tensor([6.0]), values[i:i + 15]]) for i in range(0, len(values), 15)]
    blocks[-1] = torch.cat([blocks[-1], torch.zeros(16 - len(blocks[-1]))])
    row = torch.cat(blocks)
    width = -(-len(row) // k) * k
    return torch.cat([row, torch.zeros(width - len(row))]).view(-1, k)


def _major():
    return torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else None


@pytest.mark.skipif(_major() not in (9, 10, 11), reason="runs on an SM90 or SM100/SM110 GPU")
@needs_fa4
@pytest.mark.parametrize("native", [False, True], ids=["software", "sm100-native"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, k", [(1, 16), (130, 256), (257, 4096), (64, 2048 + 16)])
def test_block_quantization_on_the_gpu_equals_the_reference(tmp_path, dtype, m, k, native):
    """The software path on SM90 and SM100; the native e2m1 conversion on SM100/SM110 only (where it exists):
    NaN, infinity, negative zero, ties and their neighbours included."""
    if native and _major() not in (10, 11):
        pytest.skip("cvt.rn.satfinite.e2m1x2.f32 exists on SM100 and later only")
    module = _load_kernel_module(tmp_path)
    generator = torch.Generator().manual_seed(m * 7919 + k)
    x = torch.randn(m, k, generator=generator) * torch.rand(m, 1, generator=generator) * 40
    special = torch.cat([_special_rows(k, generator), _tie_rows(k, dtype)])
    x[: min(m, len(special))] = special[: min(m, len(special))]
    x = x.to(dtype)
    for gs_value in (448 * 6 / 40.0, 1.0, 3.0e4):
        gs = torch.tensor([gs_value], dtype=torch.float32)
        want_packed, want_scales = nvfp4.quantize(x, gs)
        xc, gsc = x.cuda(), gs.cuda()
        rows, cols = nvfp4.scale_shape(m, k)
        packed = torch.full((m, k // 2), 0xAB, dtype=torch.uint8, device="cuda")
        scales = torch.zeros(rows * cols, dtype=torch.uint8, device="cuda")
        kernel = module.compile_quantize_rows(xc, packed, scales, gsc, native)
        kernel(xc, packed, scales, gsc)
        torch.cuda.synchronize()
        assert torch.equal(packed.cpu(), want_packed), (gs_value, (packed.cpu() != want_packed).nonzero()[:5])
        got_scales = scales.cpu().view(rows, cols)
        assert torch.equal(got_scales, want_scales.view(torch.uint8)), gs_value


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [16, 256, 4096])
def test_tie_rows_hold_every_tie_and_its_neighbours_in_blocks_led_by_six(dtype, k):
    """The GPU test's tie rows (checked here, on any machine): blocks of 16 led by 6.0, every tie and range edge
    with both neighbours exactly representable in ``dtype``, negatives too."""
    rows = _tie_rows(k, dtype)
    assert rows.shape[1] == k and torch.equal(rows.to(dtype).float(), rows)
    blocks = rows.reshape(-1, 16)
    used = blocks[blocks.abs().sum(1) > 0]
    assert (used[:, 0] == 6.0).all() and (used.abs().amax(1) == 6.0).all()
    values = set(used[:, 1:].flatten().tolist())
    for t in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
        below = torch.nextafter(torch.tensor(t, dtype=dtype), torch.tensor(0.0, dtype=dtype)).item()
        above = torch.nextafter(torch.tensor(t, dtype=dtype), torch.tensor(8.0, dtype=dtype)).item()
        assert {t, below, above, -t, -below, -above} <= values, t
