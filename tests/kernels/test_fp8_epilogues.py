"""The Triton flash attention's FP8 epilogues (docs/formats.md): static per-tensor and dynamic 128-column groups.

The contract: the FP8 bytes are :mod:`fusion_pass.fp8`'s reference quantizers applied to the kernel's own float32
attention output (the half epilogue's float32 mode, :func:`fa.flash_attention` with a float32 ``out``), exactly,
in every row, for every form (static: the scale or its inverse, both NaN rules; groups: UE8M0 or not, multiply or
divide, the three scale layouts); the ``reference`` backend is the same quantizers over the float32 reference
attention. Batches are generated (a fresh seed per run, named in every failure): MQA-like, GQA, MLA-like and
three-group head dims, a decode row, cached context (``cu_seqlens_k``), queries starting past row 0 with rows after them, causal
and not; NaN / Inf in a value give the NaN rules' bytes in the rows that see it and change no other row; rows
outside the sequences keep their bytes; the entry points refuse bad arguments naming them. On the CPU in
Triton's interpreter (tiny shapes), compiled on CUDA.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest
import torch
import triton
import triton.language as tl

from fusion_pass import fp8, kernels
from fusion_pass.fp8 import NaNRule, ScaleLayout
from fusion_pass.kernels import choice, launchers, reference
from fusion_pass.kernels.triton import flash_attention as fa
from fusion_pass.kernels.triton import paged as pg
from fusion_pass.kernels.triton.epilogues import e4m3_bytes
from fusion_pass.nvfp4 import ArgumentError

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
POISON = 0xAB  # output bytes outside the sequences
SCALE_POISON = -3.0  # group scales outside the sequences (and the TMA-aligned layout's padding rows)

pytestmark = pytest.mark.skipif(
    not CUDA and not kernels.interpreter_enabled(),
    reason="no CUDA device and TRITON_INTERPRET is not set (conftest.py sets it on CPU-only machines)",
)

# (H, Hkv, Dqk, Dv): MQA-like / GQA / MLA-like (192 = 128 + a 64-wide tail dot) / Dv 384 (three groups in a
# 512-column tile, the fourth masked; Dqk 48 = 32 + a 16-wide tail)
HEADS = [(2, 1, 32, 128), (4, 2, 64, 128), (2, 2, 192, 128), (1, 1, 48, 384)]
HEAD_IDS = ["h2kv1-d32", "h4kv2-d64", "h2kv2-d192", "h1kv1-d48v384"]
STATIC_FORMS = [(inverse, rule) for inverse in (False, True) for rule in (NaNRule.POSITIVE_MAX, NaNRule.NAN)]
GROUP_FORMS = [(ue8m0, divide) for ue8m0 in (False, True) for divide in (False, True)]
LAYOUTS = list(ScaleLayout)


@dataclass
class Case:
    """A generated batch: ``q [row0 + sum(Lq) + tail, H, Dqk]``, keys ``k``/``v`` delimited by ``cu_seqlens_k``
    (cached context before each sequence's own tokens), ``cu_seqlens`` from ``row0``."""

    seed: int
    heads: tuple[int, int, int, int]
    causal: bool
    query_lens: list[int]
    key_lens: list[int]
    row0: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_k: torch.Tensor

    def __str__(self) -> str:
        return (f"seed {self.seed}, heads {self.heads}, {'causal' if self.causal else 'full'}, Lq {self.query_lens}, "
                f"Lk {self.key_lens}, row0 {self.row0}, T {self.q.shape[0]}")

    @property
    def rows(self) -> slice:
        return slice(self.row0, self.row0 + sum(self.query_lens))

    @property
    def width(self) -> int:
        return self.heads[0] * self.heads[3]

    def args(self) -> dict:
        return dict(cu_seqlens=self.cu_seqlens, max_seqlen=max(self.query_lens), cu_seqlens_k=self.cu_seqlens_k,
                    max_seqlen_k=max(self.key_lens), causal=self.causal, softmax_scale=self.heads[2] ** -0.5)

    def own_float32(self, v=None) -> torch.Tensor:
        """The kernel's own float32 output ``[T, H*Dv]`` (rows outside the sequences NaN)."""
        t, h, _ = self.q.shape
        out = torch.full((t, h, self.heads[3]), float("nan"), device=DEVICE)
        a = self.args()
        fa.flash_attention(self.q, self.k, self.v if v is None else v, a.pop("cu_seqlens"), a.pop("max_seqlen"),
                           out=out, **a)
        return out.reshape(t, -1)


def int32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def make_case(heads, causal: bool, seed: int, *, row0: int | None = None) -> Case:
    """2-3 sequences, one a decode row (``Lq = 1``) over more than 16 keys, the others after 0-20 cached keys;
    without ``causal`` one more sequence of queries without any key (its output 0: the group scale floor).
    Each value column of each kv head scaled by 10^-3 to 10^2, so that groups and rows differ in magnitude."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    h, hkv, d, dv = heads
    query_lens = [1] + [rng.randint(2, 9) for _ in range(rng.randint(1, 2))]
    key_lens = [lq + rng.randint(0, 20) for lq in query_lens]
    key_lens[0] = max(key_lens[0], 17)
    if not causal:
        query_lens.append(rng.randint(1, 3))
        key_lens.append(0)
    order = list(range(len(query_lens)))
    rng.shuffle(order)
    query_lens, key_lens = [query_lens[i] for i in order], [key_lens[i] for i in order]
    row0 = rng.randint(1, 3) if row0 is None else row0
    t = row0 + sum(query_lens) + rng.randint(1, 3)
    magnitude = 10.0 ** torch.empty(1, hkv, dv).uniform_(-3, 2, generator=gen)
    v = torch.randn(sum(key_lens), hkv, dv, generator=gen) * magnitude
    return Case(seed, heads, causal, query_lens, key_lens, row0,
                q=torch.randn(t, h, d, generator=gen).to(DEVICE, torch.bfloat16),
                k=torch.randn(sum(key_lens), hkv, d, generator=gen).to(DEVICE, torch.bfloat16),
                v=v.to(DEVICE, torch.bfloat16),
                cu_seqlens=int32(list(itertools.accumulate(query_lens, initial=row0))),
                cu_seqlens_k=int32(list(itertools.accumulate(key_lens, initial=0))))


def fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


def static_scale(own: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """A scale putting the largest magnitude between 0.3x and 1.5x of 448: some rows clamp, small values land
    among the subnormals."""
    amax = own.nan_to_num(0.0, 0.0, 0.0).abs().max().item()
    return torch.tensor([amax / 448 * rng.uniform(0.3, 1.5)], dtype=torch.float32, device=DEVICE)


def poisoned_output(case: Case) -> torch.Tensor:
    return torch.full((case.q.shape[0], case.width), POISON, dtype=torch.uint8, device=DEVICE).view(fp8.FP8)


def poisoned_scales(case: Case, layout: ScaleLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``(the [T, N/128] view in layout, its whole buffer)``, every element :data:`SCALE_POISON`."""
    scales = fp8.group_scale_buffer(case.q.shape[0], case.width, layout, device=DEVICE)
    buffer = scales if layout is ScaleLayout.ROW_MAJOR else scales.t()._base
    buffer.fill_(SCALE_POISON)
    return scales, buffer


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.view(torch.uint8).cpu(), want.view(torch.uint8).cpu()
    diff = (got != want).nonzero()
    assert diff.numel() == 0, (f"{what}: {len(diff)} bytes differ, first at {diff[:3].tolist()}: got "
                               f"{[hex(int(got[tuple(i)])) for i in diff[:3]]}, want "
                               f"{[hex(int(want[tuple(i)])) for i in diff[:3]]}")


def assert_rows_kept(output: torch.Tensor, case: Case, what: str, scale_buffer=None, scales=None) -> None:
    """Output bytes outside the sequences' rows are :data:`POISON`; so are the scales outside them and every
    element of the scale buffer outside the ``[T, N/128]`` view (the TMA-aligned layout's padding rows)."""
    a, e = case.rows.start, case.rows.stop
    out = output.view(torch.uint8).cpu()
    assert (out[:a] == POISON).all() and (out[e:] == POISON).all(), f"{what}: rows outside [{a}, {e}) written ({case})"
    if scales is None:
        return
    s = scales.cpu()
    assert (s[:a] == SCALE_POISON).all() and (s[e:] == SCALE_POISON).all(), (
        f"{what}: scales outside rows [{a}, {e}) written ({case})")
    inside = scale_buffer.numel() - (e - a) * scales.shape[1]
    assert int((scale_buffer == SCALE_POISON).sum()) == inside, f"{what}: scale buffer padding written ({case})"


# ---------------------------------------------------------------------------
# the e4m3 rounding the epilogues share
# ---------------------------------------------------------------------------


@triton.jit
def _bytes_kernel(x_ptr, y_ptr, n, NAN_BYTE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
    tl.store(y_ptr + offsets, e4m3_bytes(x, NAN_BYTE), mask=offsets < n)


def test_e4m3_bytes_are_the_reference_conversion():
    """Every finite e4m3 value, every midpoint between neighbours (the ties, to even) and the float32 values
    beside each, the subnormals, ±0, values beyond 448, ±Inf, NaN of both signs and random magnitudes over 40
    binades: the bytes of the reference's clamp-and-convert under each NaN rule."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    values = torch.arange(256, dtype=torch.uint8).view(fp8.FP8).float()
    values = values[~values.isnan()].unique()
    mid = (values[1:] + values[:-1]) / 2
    inf = torch.tensor(float("inf"))
    specials = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 2.0**-10, 3 * 2.0**-10, -5 * 2.0**-10, 2.0**-6 - 2.0**-11,
                             448.0, 449.0, 463.9, 464.0, -500.0, 1e30, float("inf"), -float("inf"), float("nan"),
                             -float("nan")])
    random_values = torch.randn(20000, generator=gen) * torch.exp2(torch.randint(-30, 10, (20000,), generator=gen))
    x = torch.cat([values, mid, mid.nextafter(inf), mid.nextafter(-inf), -mid, specials, random_values]).to(DEVICE)
    for rule, byte in ((NaNRule.POSITIVE_MAX, 0x7E), (NaNRule.NAN, 0x7F), (NaNRule.NEGATIVE_MAX, 0xFE)):
        y = torch.empty(x.numel(), dtype=torch.uint8, device=DEVICE)
        _bytes_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), byte, 1024)
        want = fp8.quantize_static(x, torch.ones(1, device=DEVICE), nan=rule)
        assert_same_bytes(y, want, f"{rule} (seed {seed})")


# ---------------------------------------------------------------------------
# the fused bytes: the reference quantization of the kernel's own float32 output
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_static_bytes_are_the_reference_of_the_own_float32_output(heads, causal):
    """Every static form (the scale inverted in the kernel, or its inverse given: one ulp off ``1 / scale``, so
    that reading it is seen; NaN -> +448 or NaN) into a poisoned buffer: rows of the sequences exactly
    :func:`fp8.quantize_static` of the kernel's float32 output, other rows untouched."""
    case = make_case(heads, causal, fresh_seed())
    rng = random.Random(case.seed)
    own = case.own_float32()
    rows = case.rows
    scale = static_scale(own[rows], rng)
    for inverse, rule in STATIC_FORMS:
        given = fp8.reciprocal(scale).nextafter(torch.zeros(1, device=DEVICE)) if inverse else scale
        output = poisoned_output(case)
        got = fa.flash_attention_fp8_static(case.q, case.k, case.v, scale=given, scale_is_inverse=inverse, nan=rule,
                                            output=output, **case.args())
        assert got.data_ptr() == output.data_ptr() and got.dtype == fp8.FP8
        assert_rows_kept(output, case, f"static inverse={inverse} {rule}")
        want = fp8.quantize_static(own[rows], given if inverse else fp8.reciprocal(scale), nan=rule)
        assert_same_bytes(output[rows], want, f"static inverse={inverse} {rule} ({case})")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_group_bytes_are_the_reference_of_the_own_float32_output(heads, causal):
    """Every group form (UE8M0 or not, multiply or divide), each into a scale buffer of one of the three layouts
    (the layout of a form turns with the parametrization: each meets every layout): output bytes and scales of
    the sequences' rows exactly :func:`fp8.quantize_group` of the kernel's float32 output (a query without keys:
    the 1e-10 floor), other rows, their scales and the layout's padding untouched."""
    case = make_case(heads, causal, fresh_seed())
    own = case.own_float32()
    rows = case.rows
    turn = HEADS.index(heads) * 2 + causal
    for i, (ue8m0, divide) in enumerate(GROUP_FORMS):
        layout = LAYOUTS[(i + turn) % 3]
        what = f"ue8m0={ue8m0} divide={divide} {layout.value}"
        output = poisoned_output(case)
        scales, buffer = poisoned_scales(case, layout)
        got, got_scales = fa.flash_attention_fp8_group(case.q, case.k, case.v, ue8m0=ue8m0, divide=divide,
                                                       output=output, scales=scales, **case.args())
        assert got.data_ptr() == output.data_ptr() and got_scales.data_ptr() == scales.data_ptr()
        assert_rows_kept(output, case, what, buffer, scales)
        want, want_scales = fp8.quantize_group(own[rows], ue8m0=ue8m0, divide=divide)
        assert_same_bytes(output[rows], want, f"{what} ({case})")
        assert torch.equal(scales[rows].cpu(), want_scales.cpu()), f"{what}: scales differ ({case})"
    if not causal:
        b = case.key_lens.index(0)
        keyless = own[int(case.cu_seqlens[b]):int(case.cu_seqlens[b + 1])]
        assert keyless.numel() and not keyless.any(), f"the keyless queries' output is 0 ({case})"


def test_paged_fp8_bytes_are_the_varlen_bytes_over_the_same_keys():
    """The paged launchers (through :mod:`fusion_pass.kernels.launchers`, pages of 5 keys shuffled over a pool
    with NaN in every slot no sequence owns) write the bytes of the varlen launchers over the keys laid out
    contiguously, which are the reference quantization of the paged kernel's own float32 output (itself the
    varlen kernel's); rows outside keep theirs, in both."""
    case = make_case(HEADS[1], True, fresh_seed())
    rng = random.Random(case.seed)
    h, hkv, d, dv = case.heads
    page_size = 5
    pages = [-(-lk // page_size) for lk in case.key_lens]
    pool = list(range(sum(pages) + 3))
    rng.shuffle(pool)
    table = [[pool.pop() for _ in range(n)] + [0] * (max(pages) - n) for n in pages]
    k_cache = torch.full((sum(pages) + 3, page_size, hkv, d), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.full((sum(pages) + 3, page_size, hkv, dv), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    for b, lk in enumerate(case.key_lens):
        for j in range(lk):
            key = int(case.cu_seqlens_k[b]) + j
            k_cache[table[b][j // page_size], j % page_size] = case.k[key]
            v_cache[table[b][j // page_size], j % page_size] = case.v[key]
    a = case.args()
    paged = dict(cu_seqlens=case.cu_seqlens, max_seqlen=a["max_seqlen"], seqused_k=int32(case.key_lens),
                 page_table=int32(table), max_seqlen_k=a["max_seqlen_k"], softmax_scale=a["softmax_scale"],
                 causal=True)
    own = torch.full((case.q.shape[0], h, dv), float("nan"), device=DEVICE)
    pg.flash_attention_paged(case.q, k_cache, v_cache, out=own, **paged)
    own = own.reshape(case.q.shape[0], -1)
    rows = case.rows
    assert torch.equal(own[rows], case.own_float32()[rows]), f"paged float32 output differs ({case})"
    scale = static_scale(own[rows], rng)
    output = poisoned_output(case)
    launchers.flash_attention_fp8_static_paged(case.q, k_cache, v_cache, output=output, scale=scale,
                                               nan=NaNRule.NAN, **paged)
    assert_rows_kept(output, case, "paged static")
    assert_same_bytes(output[rows], fp8.quantize_static(own[rows], fp8.reciprocal(scale), nan=NaNRule.NAN),
                      f"paged static ({case})")
    dense = poisoned_output(case)
    launchers.flash_attention_fp8_static_varlen(case.q, case.k, case.v, output=dense, scale=scale, nan="nan", **a)
    assert_rows_kept(dense, case, "varlen static")
    assert_same_bytes(output[rows], dense[rows], f"paged and varlen static ({case})")

    layout = rng.choice(LAYOUTS)
    output = poisoned_output(case)
    scales, buffer = poisoned_scales(case, layout)
    launchers.flash_attention_fp8_group_paged(case.q, k_cache, v_cache, output=output, output_scales=scales,
                                              ue8m0=True, **paged)
    assert_rows_kept(output, case, f"paged group {layout.value}", buffer, scales)
    want, want_scales = fp8.quantize_group(own[rows], ue8m0=True)
    assert_same_bytes(output[rows], want, f"paged group ({case})")
    assert torch.equal(scales[rows].cpu(), want_scales.cpu()), f"paged group scales ({case})"
    allocated, allocated_scales = pg.flash_attention_fp8_group_paged(
        case.q, k_cache, v_cache, case.cu_seqlens, a["max_seqlen"], int32(case.key_lens), int32(table),
        a["max_seqlen_k"], ue8m0=True, softmax_scale=a["softmax_scale"])
    assert_same_bytes(allocated[rows], want, f"paged group, buffers allocated ({case})")
    assert ScaleLayout.of(allocated_scales) is ScaleLayout.ROW_MAJOR
    assert torch.equal(allocated_scales[rows], scales[rows]), str(case)
    dense = poisoned_output(case)
    dense_scales, dense_buffer = poisoned_scales(case, layout)
    launchers.flash_attention_fp8_group_varlen(case.q, case.k, case.v, output=dense, output_scales=dense_scales,
                                               ue8m0=True, **a)
    assert_rows_kept(dense, case, "varlen group", dense_buffer, dense_scales)
    assert_same_bytes(output[rows], dense[rows], f"paged and varlen group ({case})")
    assert torch.equal(scales[rows], dense_scales[rows]), f"paged and varlen group scales ({case})"


def test_the_forms_are_told_apart():
    """Decode rows over one key each: the kernel's output is exactly the key's value (weight 1), so values can be
    chosen where the forms' bytes differ (``x / s`` against ``x * (1 / s)``, about 5 in 10^4 elements apart; a
    given inverse 0.1% off the IEEE ``1 / scale`` against that one): the kernel writes each form's own bytes."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    b, h, dv = 8, 2, 128
    for _ in range(100):  # until the forms differ somewhere (about one element in 2048 a draw)
        v = (torch.randn(b, h, dv, generator=gen) * torch.rand(b, h, 1, generator=gen) * 5).to(torch.bfloat16)
        x = v.float().reshape(b, -1)
        scale = torch.tensor([x.abs().max().item() / 448 * 1.7], device=DEVICE)
        inverse = fp8.reciprocal(scale) * 1.001  # read, not recomputed: most bytes stay, some move
        forms = {"multiply": fp8.quantize_group(x, divide=False)[0], "divide": fp8.quantize_group(x, divide=True)[0],
                 "ieee": fp8.quantize_static(x, fp8.reciprocal(scale.cpu())),
                 "inverse": fp8.quantize_static(x, inverse.cpu())}
        bits = {name: q.view(torch.uint8) for name, q in forms.items()}
        if not torch.equal(bits["multiply"], bits["divide"]) and not torch.equal(bits["ieee"], bits["inverse"]):
            break
    else:
        pytest.fail(f"no draw told the forms apart (seed {seed})")
    q = torch.randn(b, h, 16, generator=gen).to(DEVICE, torch.bfloat16)
    k = torch.randn(b, h, 16, generator=gen).to(DEVICE, torch.bfloat16)
    v = v.to(DEVICE)
    cu = int32(list(range(b + 1)))
    own = torch.empty(b, h, dv, device=DEVICE)
    fa.flash_attention(q, k, v, cu, 1, out=own)
    assert torch.equal(own.reshape(b, -1).cpu(), x), f"one key: the output is its value (seed {seed})"
    got = {"multiply": fa.flash_attention_fp8_group(q, k, v, cu, 1)[0],
           "divide": fa.flash_attention_fp8_group(q, k, v, cu, 1, divide=True)[0],
           "ieee": fa.flash_attention_fp8_static(q, k, v, cu, 1, scale),
           "inverse": fa.flash_attention_fp8_static(q, k, v, cu, 1, inverse, scale_is_inverse=True)}
    for name, want in forms.items():
        assert_same_bytes(got[name], want, f"{name} (seed {seed})")


# ---------------------------------------------------------------------------
# non-finite values: the NaN rules' bytes in the rows that see them, nothing elsewhere
# ---------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's 0 * Inf
def test_nan_and_inf_in_a_value_give_the_nan_rules_bytes():
    """NaN, +Inf and -Inf in one key's value (a key a sequence's later queries see, its earlier ones do not): in
    the rows that see it the static bytes are 0x7E / 0x7F (NaN, by rule), 0x7E (+Inf), 0xFE (-Inf), and a group
    holding the NaN is quantized without it (its NaN -> 0xFE), a group holding an Inf has scale Inf (its finite
    elements 0x00 / 0x80, the Infs 0xFE); every byte is still the reference quantization of the kernel's own
    float32 output; rows that do not see the key get the bytes of the run without it."""
    case = make_case((2, 2, 32, 256), True, fresh_seed(), row0=0)
    rng = random.Random(case.seed)
    b = max(range(len(case.query_lens)), key=lambda i: case.query_lens[i])
    lq, lk = case.query_lens[b], case.key_lens[b]
    key = rng.randrange(lk - lq + 1, lk)  # seen by the sequence's queries from key - (lk - lq) on
    first = int(case.cu_seqlens[b])
    sees = torch.zeros(case.q.shape[0], dtype=torch.bool)
    sees[first + key - (lk - lq): first + lq] = True
    hidden = ~sees
    hidden[case.rows.stop:] = False  # rows outside the sequences: never written
    rows = case.rows
    row = int(case.cu_seqlens_k[b]) + key
    v = case.v.clone()
    v[row, 1, 3] = float("nan")  # head 1, group 0
    v[row, 0, 200] = float("inf")  # head 0, group 1
    v[row, 0, 5] = -float("inf")  # head 0, group 0
    own, clean = case.own_float32(v), case.own_float32()
    scale = static_scale(clean[case.rows], rng)
    dv = 256
    for rule, nan_byte in ((NaNRule.POSITIVE_MAX, 0x7E), (NaNRule.NAN, 0x7F)):
        got = fa.flash_attention_fp8_static(case.q, case.k, v, scale=scale, nan=rule, **case.args()).view(torch.uint8)
        was = fa.flash_attention_fp8_static(case.q, case.k, case.v, scale=scale, nan=rule, **case.args())
        was = was.view(torch.uint8)
        assert_same_bytes(got[rows], fp8.quantize_static(own[rows], fp8.reciprocal(scale), nan=rule),
                          f"{rule} ({case})")
        assert_same_bytes(got[hidden], was[hidden], f"{rule}: rows that cannot see the key ({case})")
        s = got[sees].cpu()
        assert (s[:, dv + 3] == nan_byte).all() and (s[:, 200] == 0x7E).all() and (s[:, 5] == 0xFE).all(), str(case)
    got, scales = fa.flash_attention_fp8_group(case.q, case.k, v, **case.args())
    was, was_scales = fa.flash_attention_fp8_group(case.q, case.k, case.v, **case.args())
    got, was = got.view(torch.uint8), was.view(torch.uint8)
    want, want_scales = fp8.quantize_group(own[rows])
    assert_same_bytes(got[rows], want, f"groups ({case})")
    assert torch.equal(scales[rows].cpu(), want_scales.cpu()), f"group scales ({case})"
    assert_same_bytes(got[hidden], was[hidden], f"groups: rows that cannot see the key ({case})")
    assert torch.equal(scales[hidden], was_scales[hidden]), str(case)
    g, s = got[sees].cpu(), scales[sees].cpu()
    assert (g[:, dv + 3] == 0xFE).all() and s[:, 2].isfinite().all(), f"the NaN's group ({case})"
    assert s[:, 1].isposinf().all() and (g[:, 200] == 0xFE).all(), f"the +Inf's group ({case})"
    assert ((g[:, 128:256] & 0x7F) == 0).sum() == g.shape[0] * 127, f"the +Inf's group's finite elements ({case})"


# ---------------------------------------------------------------------------
# the entry points: backends and argument checks
# ---------------------------------------------------------------------------


def test_entry_points_triton_is_the_launchers_and_reference_the_quantizers_over_reference_attention():
    """``backend="triton"`` gives the launchers' bytes (into given buffers: a column-major scale view), the
    ``reference`` backend :func:`fp8.quantize_static` / :func:`fp8.quantize_group` of the float32 reference
    attention, into given buffers too; ``auto`` is the reference on CPU tensors."""
    case = make_case(HEADS[0], True, fresh_seed(), row0=0)
    rng = random.Random(case.seed)
    a = case.args()
    cu, max_seqlen = a.pop("cu_seqlens"), a.pop("max_seqlen")
    q, k, v = case.q[: case.rows.stop], case.k, case.v  # rows from 0 to T: the entry points' contract
    t = q.shape[0]
    ref = reference.varlen_attention(q, k, v, cu, True, a["softmax_scale"], case.cu_seqlens_k)[0].reshape(t, -1)
    scale = static_scale(ref, rng)
    inv = fp8.reciprocal(scale)
    for backend in ("triton", "reference"):
        output = torch.empty(t, case.width, dtype=fp8.FP8, device=DEVICE)
        got = kernels.attention_fp8_static(q, k, v, cu, max_seqlen, scale=inv, scale_is_inverse=True, nan="nan",
                                           output=output, backend=backend, **a)
        assert got is output
        want = (fa.flash_attention_fp8_static(q, k, v, cu, max_seqlen, inv, scale_is_inverse=True, nan="nan", **a)
                if backend == "triton" else fp8.quantize_static(ref, inv, nan=NaNRule.NAN))
        assert_same_bytes(got, want, f"static {backend} ({case})")
        scales = fp8.group_scale_buffer(t, case.width, ScaleLayout.COLUMN_MAJOR, device=DEVICE)
        got, got_scales = kernels.attention_fp8_group(q, k, v, cu, max_seqlen, ue8m0=True, scales=scales,
                                                      backend=backend, **a)
        assert got_scales is scales
        want, want_scales = (fa.flash_attention_fp8_group(q, k, v, cu, max_seqlen, ue8m0=True, **a)
                             if backend == "triton" else fp8.quantize_group(ref, ue8m0=True))
        assert_same_bytes(got, want, f"group {backend} ({case})")
        assert torch.equal(got_scales, want_scales), f"group scales {backend} ({case})"
    if not CUDA:  # auto: the reference on CPU tensors
        static_auto = kernels.attention_fp8_static(q, k, v, cu, max_seqlen, scale=scale, **a)
        assert_same_bytes(static_auto, fp8.quantize_static(ref, inv), f"static auto ({case})")
        assert choice.choose_fp8("f", "auto", q, v, group=True) == "reference"


def _api_args():
    t, h, hkv, d, dv = 6, 2, 1, 32, 128
    q = torch.zeros(t, h, d, dtype=torch.bfloat16, device=DEVICE)
    k = torch.zeros(t, hkv, d, dtype=torch.bfloat16, device=DEVICE)
    v = torch.zeros(t, hkv, dv, dtype=torch.bfloat16, device=DEVICE)
    return q, k, v, int32([0, 1, 6]), 5


def _bad_calls():
    """(entry, changes to its keyword arguments, the error's pattern): each names the argument."""
    q, k, v, cu, _ = _api_args()
    t, width = q.shape[0], q.shape[1] * v.shape[2]
    fp8_out = torch.empty(t, width, dtype=fp8.FP8, device=DEVICE)
    scales = torch.empty(t, width // 128, device=DEVICE)
    v64 = torch.zeros(t, 1, 64, dtype=torch.bfloat16, device=DEVICE)
    wrong_stride = torch.empty(t, 2 * (width // 128), device=DEVICE)[:, ::2]  # a column stride of 2
    static, group = "attention_fp8_static", "attention_fp8_group"
    return [
        (group, {"v": v64, "backend": "triton"}, r"backend 'triton' needs v's head dim Dv divisible by 128 \(a head's tile holds whole 128-column groups\), "
                                                    r"got 64"),
        (group, {"v": v64, "q": q[:, :1]}, r"H \* Dv must be divisible by 128 .*got 1 \* 64"),
        (group, {"backend": "cuda"}, r"backend must be one of auto, triton, fa4, reference, got 'cuda'"),
        (static, {"output": fp8_out.view(torch.uint8)}, r"output must be float8_e4m3fn \[T, H\*Dv\] = \[6, 256\]"),
        (group, {"output": fp8_out[:5]}, r"output must be float8_e4m3fn \[T, H\*Dv\] = \[6, 256\], got"),
        (static, {"output": fp8_out.view(torch.uint8).t().contiguous().t().view(fp8.FP8)},
         r"output must have unit stride along its columns"),
        (static, {"output": "buffer"}, r"output must be a tensor \(got str\)"),
        (group, {"scales": scales.half()}, r"scales must be float32 \[T, H\*Dv/128\] = \[6, 2\], got torch.float16"),
        (group, {"scales": scales[:, :1]}, r"scales must be float32 \[T, H\*Dv/128\] = \[6, 2\]"),
        (group, {"scales": wrong_stride}, r"scales must be in one of the layouts \(strides\) row_major \(2, 1\), "
                                          r"column_major \(1, 6\), column_major_tma \(1, 8\) \(or the first rows of a "
                                          r"column-major one\), got strides \(4, 2\)"),
        (static, {"scale": torch.ones(1, dtype=torch.float64, device=DEVICE)},
         r"scale must be a one-element float32 tensor, got torch.float64"),
        (static, {"scale": torch.ones(2, device=DEVICE)}, r"scale must be a one-element float32 tensor, got .*\[2\]"),
        (static, {"scale": 1.0}, r"scale must be a one-element float32 tensor, got float"),
        (static, {"nan": "negative_max"}, r"nan must be \"positive_max\" or \"nan\""),
        (static, {"nan": NaNRule.NEGATIVE_MAX}, r"nan must be \"positive_max\" or \"nan\""),
        (static, {"scale_is_inverse": 1}, r"scale_is_inverse must be a bool, got 1"),
        (group, {"ue8m0": "yes"}, r"ue8m0 must be a bool, got 'yes'"),
        (group, {"divide": None}, r"divide must be a bool, got None"),
        (group, {"q": q.float()}, r"q must be float16 or bfloat16, got torch.float32"),
    ]


@pytest.mark.parametrize("validate_values", [True, "device"])
def test_entry_points_refuse_bad_arguments_naming_them(validate_values):
    """Each mistake raises :class:`ArgumentError` naming the entry point and the argument, before anything is
    written (the given output and scales keep their poison)."""
    q, k, v, cu, max_seqlen = _api_args()
    for entry, change, pattern in _bad_calls():
        call = {"q": q, "k": k, "v": v, "backend": "reference", "validate_values": validate_values}
        if entry == "attention_fp8_static":
            call["scale"] = torch.ones(1, device=DEVICE)
        call.update(change)
        poisoned = torch.full((q.shape[0], q.shape[1] * 128), POISON, dtype=torch.uint8, device=DEVICE)
        if "output" not in change and call["q"].shape[1] * call["v"].shape[2] == poisoned.shape[1]:
            call["output"] = poisoned.view(fp8.FP8)
        q_, k_, v_ = call.pop("q"), call.pop("k"), call.pop("v")
        with pytest.raises(ArgumentError, match=f"^{entry}: {pattern}"):
            getattr(kernels, entry)(q_, k_, v_, cu, max_seqlen, **call)
        assert (poisoned == POISON).all(), f"{entry} {change}: written before the error"


def test_launchers_refuse_head_dims_their_tiles_cannot_hold():
    """The unvalidated launchers check shapes: the group epilogue needs ``Dv % 128 == 0`` (varlen and paged)."""
    q, k, _, cu, max_seqlen = _api_args()
    v = torch.zeros(6, 1, 64, dtype=torch.bfloat16, device=DEVICE)
    out = torch.empty(6, 128, dtype=fp8.FP8, device=DEVICE)
    scales = torch.empty(6, 1, device=DEVICE)
    with pytest.raises(ArgumentError, match=r"flash_attention_fp8_group_varlen: v's head dim must be divisible by "
                                            r"128, got 64"):
        launchers.flash_attention_fp8_group_varlen(q, k, v, cu_seqlens=cu, max_seqlen=max_seqlen, softmax_scale=0.1,
                                                   causal=True, output=out, output_scales=scales)
    pages = dict(cu_seqlens=cu, max_seqlen=max_seqlen, seqused_k=int32([1, 5]), page_table=int32([[0], [1]]),
                 max_seqlen_k=5, softmax_scale=0.1, causal=True, output=out)
    with pytest.raises(ArgumentError, match=r"flash_attention_fp8_group_paged: v_cache's head dim must be divisible "
                                            r"by 128, got 64"):
        launchers.flash_attention_fp8_group_paged(q, k.reshape(2, 3, 1, 32), v.reshape(2, 3, 1, 64),
                                                  output_scales=scales, **pages)
    with pytest.raises(ArgumentError, match=r"flash_attention_fp8_static_paged: cu_seqlens must be contiguous int32"):
        launchers.flash_attention_fp8_static_paged(q, k.reshape(2, 3, 1, 32), v.reshape(2, 3, 1, 64),
                                                   scale=torch.ones(1, device=DEVICE),
                                                   **dict(pages, cu_seqlens=cu.long()))
