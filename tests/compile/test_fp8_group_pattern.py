"""The FP8 128-column group pattern on real post-grad graphs: attention -> ``per_token_group_fp8_quant`` -> a
block-FP8 GEMM (``fusion_pass::fp8_group_gemm``) becomes one attention call writing the codes and the group scales
(the ``*_fp8_group_quant`` entries), the quant's UE8M0 flag and scale layout carried over; or is refused with its
reason.

Every graph comes out of a real ``torch.compile``; both functionalized forms (v1 is vLLM's); the three scale layouts
vLLM allocates (row-major, column-major, TMA-aligned column-major: a strided view the fused call writes through).
The inspection reads the graph (targets, kwargs), not the matcher. Bytes: a decode row (the unfused path inside the
fused op) equals the unfused graph's codes and scales exactly; fused prefill rows are within the format's bound.
"""

from __future__ import annotations

import operator
import random

import pytest
import torch
from torch._inductor import config as inductor_config

from fusion_pass import fp8, runtime
from fusion_pass.compile.graph_pass import FusionPass
from fusion_pass.runtime import BatchSpec

from test_fp8_static_pattern import FP8Block, built_blocks
from test_graph_pass import Recorder, compile_with, run_compiled, wrapped
from test_graph_pass import _clean_compile_state, form  # noqa: F401  (the same fixtures: autouse state, both forms)

OPS = torch.ops.fusion_pass
ATTENTION_OPS = (OPS.mla_attention_with_output.default, OPS.attention_with_output.default)
GROUP_QUANT = OPS.per_token_group_fp8_quant.default
LAYOUTS = [*fp8.ScaleLayout, "tma_slice"]


class GroupBlock(FP8Block):
    """:class:`FP8Block` (MLA or GQA, 2 heads of ``v``) with a block-FP8 o_proj: weight ``[out, H*Dv]`` in e4m3 with
    one float32 scale per 128x128 block."""

    def __init__(self, kind: str, seed: int, *, v=128, out=24, heads=2):
        super().__init__(kind, seed, heads=heads, v=v, out=out)
        g = torch.Generator().manual_seed(seed + 1)
        width = heads * v
        w = torch.randn(out, width, generator=g) * width ** -0.5
        blocks = w.new_zeros(-(-out // 128), width // 128)
        for i in range(blocks.shape[0]):
            for j in range(blocks.shape[1]):
                blocks[i, j] = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().amax() / 448.0
        expanded = blocks.repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)
        self.w_group = (w / expanded).to(torch.float8_e4m3fn)
        self.w_group_scales = blocks


def padded_scale_buffer(t, groups: int, column_step: int = 1) -> torch.Tensor:
    """Column-major scales with a leading stride of ``T + 2`` (the first rows of a longer buffer, not one of vLLM's
    three layouts), or with ``column_step`` 2 a row-major view skipping every other column (no layout the writers
    take)."""
    if column_step == 1:
        return torch.full((groups, t + 2), 7.0)[:, :t].t()
    return torch.full((t, 2 * groups), 7.0)[:, ::2]


def scale_buffer(t, groups: int, scale_layout: fp8.ScaleLayout, tma_as_slice: bool = False) -> torch.Tensor:
    """The group scales as vLLM's ``per_token_group_quant_fp8`` allocates them (``t`` may be symbolic): row-major
    ``empty``, column-major ``empty([G, T]).permute``, TMA-aligned ``empty_strided([T, G], (1, round_up(T, 4)))``;
    ``tma_as_slice``: the TMA-aligned layout as a transposed slice of a padded buffer instead (a view that is not
    its whole base: functionalization writes it back into the base)."""
    if scale_layout is fp8.ScaleLayout.ROW_MAJOR:
        return torch.empty(t, groups, dtype=torch.float32)
    if scale_layout is fp8.ScaleLayout.COLUMN_MAJOR:
        return torch.empty(groups, t, dtype=torch.float32).permute(1, 0)
    lead = (t + 3) // 4 * 4
    if tma_as_slice:
        return torch.empty(groups, lead, dtype=torch.float32)[:, :t].t()
    return torch.empty_strided((t, groups), (1, lead), dtype=torch.float32)


def group_o_proj(block: GroupBlock, scale_layout=fp8.ScaleLayout.COLUMN_MAJOR, *, ue8m0=False, group=128,
                 eps=1e-10, gemm=True, scales_read=True, tma_as_slice=False, padded_step=None):
    """attention -> per_token_group_fp8_quant -> fp8_group_gemm, as vLLM's block-FP8 linear calls them; returns the
    codes, the scales and the GEMM's output."""

    def f(a, b, c):
        out = block.attn(a, b, c).reshape(a.shape[0], -1)
        t, width = out.shape
        codes = torch.empty(t, width, dtype=torch.float8_e4m3fn)
        scales = (scale_buffer(t, width // 128, scale_layout, tma_as_slice) if padded_step is None
                  else padded_scale_buffer(t, width // 128, padded_step))
        OPS.per_token_group_fp8_quant(out, codes, scales, group, eps, -448.0, 448.0, ue8m0,
                                      scale_layout is not fp8.ScaleLayout.ROW_MAJOR,
                                      scale_layout is fp8.ScaleLayout.COLUMN_MAJOR_TMA)
        if not gemm:
            return codes, scales
        a_scales = scales if scales_read else torch.ones_like(scales)
        y = OPS.fp8_group_gemm(codes, block.w_group, a_scales, block.w_group_scales, torch.bfloat16)
        return codes, scales, y

    return f


@pytest.fixture
def make_block():
    yield from built_blocks(GroupBlock)


def _getitem_source(node):
    """The call whose result ``node`` reads, through views and functionalization's write-backs (``slice_scatter``
    of the written value into the base)."""
    while node.target is not operator.getitem:
        node = node.args[1] if node.target is torch.ops.aten.slice_scatter.default else node.args[0]
    return node.args[0]


def _layout(case):
    """``(ScaleLayout, tma_as_slice)`` of a :data:`LAYOUTS` case."""
    return (fp8.ScaleLayout.COLUMN_MAJOR_TMA, True) if case == "tma_slice" else (case, False)


def _id(case):
    return case if isinstance(case, str) else case.value


@pytest.mark.parametrize("case", LAYOUTS, ids=_id)
@pytest.mark.parametrize("kind", ["mla", "gqa"])
def test_group_quant_becomes_one_fp8_attention_call(make_block, kind, case, form):
    seed = random.SystemRandom().randrange(2**31)
    ue8m0 = bool(seed % 2)
    scale_layout, tma_as_slice = _layout(case)
    block = make_block(kind, seed)
    fp = FusionPass()
    rec = Recorder(fp)
    spec = BatchSpec.from_lens([random.Random(seed).randint(2, 9), 3])
    run_compiled(compile_with(group_o_proj(block, scale_layout, ue8m0=ue8m0, tma_as_slice=tma_as_slice), rec), spec,
                 *block.inputs(spec, seed))
    if form == "v2" and case in (fp8.ScaleLayout.COLUMN_MAJOR, "tma_slice"):  # views of a base
        assert fp.report()["refused"] == {"quant_buffers_are_views": 1}, (seed, fp.report())
        return
    assert fp.report()["rewritten"] == 1, (seed, fp.report())
    after = rec.after[0]
    assert not [n for n in after.nodes if wrapped(n) is GROUP_QUANT], "the quant op is gone"
    (attention,) = [n for n in after.nodes if wrapped(n) in ATTENTION_OPS]
    kwargs = attention.kwargs
    column_major = scale_layout is not fp8.ScaleLayout.ROW_MAJOR
    assert (kwargs["quant_group_size"], kwargs["quant_scale_ue8m0"]) == (128, ue8m0)
    assert (kwargs["quant_col_major"], kwargs["quant_tma_aligned"]) == (
        column_major, scale_layout is fp8.ScaleLayout.COLUMN_MAJOR_TMA)
    assert kwargs["output_scale"] is None and kwargs.get("output_inv_scale") is None
    scales = kwargs["output_block_scale"] if form == "v1" else kwargs["_all_bases"][kwargs["_output_block_scale_base_index"]]
    val = scales.meta["val"]
    assert val.dtype == torch.float32 and val.shape[-1] == block.heads * block.v // 128
    if column_major:
        assert val.stride()[0] == 1, "the quant's column-major view itself is written through"
    (gemm,) = [n for n in after.nodes if n.target is OPS.fp8_group_gemm.default]
    assert _getitem_source(gemm.args[0]) is attention, "the GEMM reads the codes the attention call writes"
    assert _getitem_source(gemm.args[2]) is attention, "... and its scales"
    layer = fp.report()["per_graph"][0]["layers"][0]
    assert layer["pattern"] == f"{'mla_' if kind == 'mla' else ''}attention_fp8_group_quant"
    fmt = "fp8_group128_ue8m0" if ue8m0 else "fp8_group128"
    assert fp.report()["runtime"]["fused_by_backend"] == {f"reference ({fmt})": 1}, fp.report()["runtime"]


@pytest.mark.parametrize("case", LAYOUTS, ids=_id)
def test_decode_rows_are_the_unfused_bytes_and_prefills_within_the_bound(make_block, case):
    """A prefill, then a step with a decode row beside a new prefill: the decode row (the unfused path inside the
    fused op) has the unfused graph's codes and scales byte for byte; the fused prefill rows are within the group
    format's bound of the float attention (plus the unfused path's bf16 rounding); a NaN in the decode row's
    query gives the op's -448 rule."""
    seed = random.SystemRandom().randrange(2**31)
    block = make_block("gqa", seed)
    ue8m0 = bool(seed % 2)
    scale_layout, tma_as_slice = _layout(case)
    fn = group_o_proj(block, scale_layout, ue8m0=ue8m0, tma_as_slice=tma_as_slice)
    with inductor_config.patch(enable_auto_functionalized_v2=False):  # vLLM's form (v2 refuses strided scales)
        _decode_then_prefill(fn, block, seed, ue8m0, scale_layout)


def _decode_then_prefill(fn, block, seed, ue8m0, scale_layout):
    first = BatchSpec.from_lens([6])
    step = BatchSpec.from_lens([1, 5], [6, 0], ["r0", "r1"])
    x0, x1 = block.inputs(first, seed), block.inputs(step, seed + 1)
    eager = []
    with torch.no_grad():
        for spec, x in ((first, x0), (step, x1)):
            with runtime.batch(spec):
                start = runtime.snapshot_kv_caches()
                attn = block.attn(*x).float().reshape(spec.num_tokens, -1)
                runtime.restore_kv_caches(start)
                eager.append((attn, fn(*x)))
    runtime.clear_kv_caches()
    fp = FusionPass()
    compiled = compile_with(fn, Recorder(fp))
    got = [run_compiled(compiled, spec, *x) for spec, x in ((first, x0), (step, x1))]
    assert fp.report()["rewritten"] == 1, (fp.report()["refused"], seed)
    codes, scales, _ = got[1]
    want_codes, want_scales, _ = eager[1][1]
    assert torch.equal(codes[0].view(torch.uint8), want_codes[0].view(torch.uint8)), f"decode row codes (seed {seed})"
    assert torch.equal(scales[0], want_scales[0]), f"decode row scales (seed {seed})"
    assert fp8.ScaleLayout.of(scales) in (scale_layout, fp8.ScaleLayout.ROW_MAJOR)
    for (attn, _), (c, s, _) in zip(eager, got):
        rows = slice(1, None) if c is codes else slice(None)
        x = attn[rows]
        err = (fp8.dequantize_group(c[rows], s[rows]) - x).abs()
        bound = fp8.group_error_bound(x, s[rows]) + 2.0**-8 * x.abs() + 1e-30
        assert bool((err <= bound).all()), f"prefill rows beyond the bound (seed {seed})"
        if ue8m0:
            assert bool((torch.log2(s[rows]) == torch.log2(s[rows]).round()).all()), "UE8M0 scales"


@pytest.mark.parametrize("case, reason", [
    ("group_64", "fp8_group_size_not_128"),
    ("other_eps", "fp8_group_eps_not_1e-10"),
    ("other_gemm_scale", "no_fp8_group128_gemm_consumer"),
    ("no_gemm", "no_fp8_group128_gemm_consumer"),
    ("v_64", "v_head_dim_not_multiple_of_128"),
])
def test_refusals(make_block, form, case, reason):
    block = make_block("mla", v=64 if case == "v_64" else 128, heads=2)
    kwargs = {"group_64": dict(group=64), "other_eps": dict(eps=1e-6), "other_gemm_scale": dict(scales_read=False),
              "no_gemm": dict(gemm=False)}.get(case, {})
    fp = FusionPass()
    rec = Recorder(fp)
    spec = BatchSpec.from_lens([5, 2])
    fn = group_o_proj(block, fp8.ScaleLayout.ROW_MAJOR, **kwargs)
    try:
        run_compiled(compile_with(fn, rec), spec, *block.inputs(spec, 0))
    except Exception as exc:  # a 64-column group does not fit the project's 128-column GEMM: refused at run time
        assert case == "group_64", exc
    assert fp.report()["rewritten"] == 0
    assert fp.report()["refused"] == {reason: 1}
    assert [n for n in rec.after[0].nodes if wrapped(n) is GROUP_QUANT], "the quant stays"


@pytest.mark.parametrize("column_step", [1, 2], ids=["leading_stride_t_plus_2", "every_other_column"])
def test_scales_in_other_strides_are_written_through_them(make_block, column_step):
    """vLLM-form v1 graphs whose scale buffer has strides outside vLLM's three layouts: column-major with a leading
    stride of ``T + 2`` (the first rows of a longer buffer: written in place) and a view skipping every other column
    (written through a temporary): rewritten, and the fused graph's steps give the unfused graph's decode bytes and
    scales, in the caller's buffer."""
    block = make_block("gqa", 5)
    with inductor_config.patch(enable_auto_functionalized_v2=False):
        fn = group_o_proj(block, padded_step=column_step)
        first, step = BatchSpec.from_lens([6]), BatchSpec.from_lens([1, 5], [6, 0], ["r0", "r1"])
        x0, x1 = block.inputs(first, 1), block.inputs(step, 2)
        with torch.no_grad():
            for spec, x in ((first, x0), (step, x1)):
                with runtime.batch(spec):
                    want = fn(*x)  # the eager steps (the cache grows as the compiled steps' will)
        runtime.clear_kv_caches()
        fp = FusionPass()
        compiled = compile_with(fn, Recorder(fp))
        got = [run_compiled(compiled, spec, *x) for spec, x in ((first, x0), (step, x1))][1]
        assert fp.report()["rewritten"] == 1, fp.report()["refused"]
        assert torch.equal(got[0][0].view(torch.uint8), want[0][0].view(torch.uint8))
        assert torch.equal(got[1][0], want[1][0])
