"""Attention -> (chain of view/copy ops) -> NVFP4 quant -> NVFP4 GEMM cases, and their layout oracle.

Used by ``tests/test_matcher_generative.py``. A :class:`Case` is one registered
attention layer (MLA or standard/GQA) writing its query-dtype output into a
buffer (:data:`BUFFERS`: a plain allocation, or a view of a bigger or permuted
base), a chain of tensor ops (:class:`Op`) from that output (or from its base)
to the quant's input, and its own NVFP4 o_proj weights whose K is the chain
result's last dim. Chains are functions of the run-time tensor and of ``T``
(the token count, ``q.shape[0]``), so the same chain is traced symbolically by
torch.compile and applied concretely by the oracle.

The oracle (:func:`layout`) is independent of the matcher: it applies the
buffer set-up and the chain eagerly to a probe (the attention's elements
numbered ``0 .. T*W-1`` in row-major ``[T, H*Dv]`` order, every other element
of the base negative) and says whether the quant input is exactly those
elements in that order, as ``T`` rows of ``W = H*Dv``, for every token count
the test uses. Only then is fusing attention and quant correct.

:func:`generate` draws random chains (view, reshape, flatten, unflatten,
transpose, permute, ``.t()``, squeeze/unsqueeze, slice/narrow, as_strided,
clone, contiguous, detours such as transpose+transpose or a permute and its
inverse) from a seed; chains whose quant input has no fixed last dim that is a
multiple of 16, or that raise at one of the token counts, are discarded.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from fusion_pass.demo import layers
from fusion_pass.ops import scaled_fp4_quant

OPS = torch.ops.fusion_pass

# ---------------------------------------------------------------- symbolic dims
#
# A dim is (c, e): its size is c * T for e == 1, c * (T - 1) for e == 2, c for e == 0.
# At most one dim of a shape depends on T.

Dim = tuple[int, int]


def size_of(d: Dim, T):
    c, e = d
    return c * T if e == 1 else c * (T - 1) if e == 2 else c


def dim_text(d: Dim) -> str:
    c, e = d
    if e == 0:
        return str(c)
    t = "T" if e == 1 else "(T-1)"
    return t if c == 1 else f"{c}*{t}"


def numel_of(dims) -> Dim | None:
    kinds = [e for _, e in dims if e]
    if len(kinds) > 1:
        return None
    return math.prod(c for c, _ in dims), (kinds[0] if kinds else 0)


def _factors(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Op:
    """One step of a chain: ``fn(x, T)``; ``text`` is how it reads (``T`` = the token count)."""

    text: str
    fn: Callable


def _shape_fn(dims, minus=None):
    dims = list(dims)

    def at(T):
        return tuple(-1 if i == minus else size_of(d, T) for i, d in enumerate(dims))

    text = ", ".join("-1" if i == minus else dim_text(d) for i, d in enumerate(dims))
    return at, text


def op_view(dims, minus=None, method="view") -> Op:
    at, text = _shape_fn(dims, minus)
    if method == "view":
        return Op(f"view({text})", lambda x, T: x.view(at(T)))
    return Op(f"reshape({text})", lambda x, T: x.reshape(at(T)))


def op_as_strided(sizes, strides, offset=None) -> Op:
    """``x.as_strided(sizes, strides[, offset])``; sizes/strides/offset are Dims; the offset is absolute
    (into x's storage), without one as_strided starts at x's own storage offset."""
    s_at, s_text = _shape_fn(sizes)
    t_at, t_text = _shape_fn(strides)
    if offset is None:
        return Op(f"as_strided(({s_text}), ({t_text}))", lambda x, T: x.as_strided(s_at(T), t_at(T)))
    return Op(f"as_strided(({s_text}), ({t_text}), {dim_text(offset)})",
              lambda x, T: x.as_strided(s_at(T), t_at(T), size_of(offset, T)))


def op_named(text: str, fn: Callable) -> Op:
    return Op(text, fn)


CLONE = Op("clone()", lambda x, T: x.clone())
CONTIGUOUS = Op("contiguous()", lambda x, T: x.contiguous())
VIEW_FP16 = Op("view(torch.float16)", lambda x, T: x.view(torch.float16))
TO_FLOAT = Op("float()", lambda x, T: x.float())


def apply_chain(chain, x: Tensor, T) -> Tensor:
    for op in chain:
        x = op.fn(x, T)
    return x


# ---------------------------------------------------------------- output buffers
#
# name -> (base dims, how the attention's output is taken from the base). The base
# dims are written with H, Dv, W = H*Dv. ``out_from_base(base, T, H, Dv, W, rank)``
# returns the view the attention op writes; rank 2 means [T, W], rank 3 [T, H, Dv].


@dataclass(frozen=True)
class Buffer:
    name: str
    base_dims: Callable  # (H, Dv, W) -> list[Dim]
    out_view: Callable  # (base, T, H, Dv, W) -> [T, W]-like or [T, H, Dv]-like view
    out_rank: int | None  # None: 2 for MLA, 3 for standard attention (the modules' shapes)
    note: str


def _rank_view(out, T, H, Dv, rank):
    return out if rank == 2 else out.view(-1, H, Dv)


INPUT_ROWS = 16  # rows of the "input" buffer: more than any token count used

BUFFERS = {
    b.name: b for b in (
        Buffer("plain", lambda H, Dv, W: [(1, 1), (W, 0)], lambda b, T, H, Dv, W: b, None,
               "empty [T, W] (the standard module views it [T, H, Dv])"),
        Buffer("plain3d", lambda H, Dv, W: [(1, 1), (H, 0), (Dv, 0)], lambda b, T, H, Dv, W: b, 3,
               "empty [T, H, Dv]"),
        Buffer("rows_head", lambda H, Dv, W: [(2, 1), (W, 0)], lambda b, T, H, Dv, W: b[:T], None,
               "base [2T, W], attention writes base[:T]"),
        Buffer("rows_tail", lambda H, Dv, W: [(2, 1), (W, 0)], lambda b, T, H, Dv, W: b[T:], None,
               "base [2T, W], attention writes base[T:]"),
        Buffer("cols", lambda H, Dv, W: [(1, 1), (2 * W, 0)], lambda b, T, H, Dv, W: b[:, :W], None,
               "base [T, 2W], attention writes base[:, :W]"),
        Buffer("cols_tail", lambda H, Dv, W: [(1, 1), (W + 16, 0)], lambda b, T, H, Dv, W: b[:, 16:], None,
               "base [T, W+16], attention writes base[:, 16:]"),
        Buffer("permuted", lambda H, Dv, W: [(1, 1), (Dv, 0), (H, 0)],
               lambda b, T, H, Dv, W: b.transpose(1, 2), 3, "base [T, Dv, H], attention writes base.transpose(1, 2)"),
        Buffer("head_major", lambda H, Dv, W: [(H, 0), (1, 1), (Dv, 0)],
               lambda b, T, H, Dv, W: b.transpose(0, 1), 3, "base [H, T, Dv], attention writes base.transpose(0, 1)"),
        Buffer("flat", lambda H, Dv, W: [(W, 1)], lambda b, T, H, Dv, W: b.view(T, W), None,
               "base [T*W], attention writes base.view(T, W)"),
        Buffer("input", lambda H, Dv, W: [(INPUT_ROWS, 0), (W, 0)], lambda b, T, H, Dv, W: b[:T], None,
               f"a graph input [{INPUT_ROWS}, W] (a persistent buffer), attention writes input[:T]; "
               f"its contents after the call are compared too"),
    )
}


# ---------------------------------------------------------------- a case


@dataclass
class Case:
    """One attention layer -> chain -> quant -> GEMM, with everything needed to build and judge it."""

    id: str
    kind: str  # "mla" | "gqa"
    heads: int
    v_head_dim: int
    buffer: str
    read_base: bool  # the chain starts from the buffer's base instead of the attention's output view
    chain: tuple[Op, ...]
    k: int  # the quant input's last dim = the o_proj's in_features
    n: int  # o_proj out_features
    seed: int
    zero_init: bool = False  # the quant reads elements the attention does not write: allocate zeros
    via_module: bool = False  # o_proj as NVFP4Linear.forward (reshape(-1, K) -> quant -> GEMM -> view)
    kv_heads: int = 1
    head_dim: int = 16  # qk head dim of standard attention
    category: str = "generated"  # "generated" | "repro" | "anchor"
    forms: tuple[str, ...] = ("v1", "v2")
    note: str = ""
    # filled by the oracle
    preserving: bool | None = None
    oracle_detail: str = ""
    # built lazily
    _built: dict = field(default_factory=dict, repr=False)

    # -- dims
    NOPE, ROPE, LORA = 16, 8, 32

    @property
    def width(self) -> int:
        return self.heads * self.v_head_dim

    @property
    def layer_name(self) -> str:
        return f"test_matcher_generative.{self.id}"

    @property
    def out_rank(self) -> int:
        rank = BUFFERS[self.buffer].out_rank
        return rank if rank is not None else (2 if self.kind == "mla" else 3)

    def source_dims(self) -> list[Dim]:
        h, dv, w = self.heads, self.v_head_dim, self.width
        if self.read_base:
            return BUFFERS[self.buffer].base_dims(h, dv, w)
        return [(1, 1), (w, 0)] if self.out_rank == 2 else [(1, 1), (h, 0), (dv, 0)]

    def describe(self) -> str:
        src = "base" if self.read_base else "out"
        chain = "".join(op.text if op.text.startswith("[") else "." + op.text for op in self.chain)
        if self.kind == "mla":
            dims = f"MLA H={self.heads} Dv={self.v_head_dim}"
        else:
            dims = f"GQA H={self.heads} Hkv={self.kv_heads} D={self.head_dim} Dv={self.v_head_dim}"
        o_proj = "NVFP4Linear" if self.via_module else "quant+gemm"
        return (f"{self.id} [{self.category}] {dims} W={self.width}; buffer {self.buffer} "
                f"({BUFFERS[self.buffer].note}{', zeros' if self.zero_init else ''}); quant input = {src}{chain}; "
                f"K={self.k} N={self.n} ({o_proj}); oracle: "
                f"{'layout-preserving' if self.preserving else 'NOT layout-preserving'} ({self.oracle_detail})"
                + (f"; {self.note}" if self.note else ""))

    # -- buffers
    def alloc(self, T, dtype, *, zeros=None, base=None):
        """(base, out): the base allocation (or ``base``, the graph input) and the view the attention writes."""
        buf = BUFFERS[self.buffer]
        h, dv, w = self.heads, self.v_head_dim, self.width
        shape = tuple(size_of(d, T) for d in buf.base_dims(h, dv, w))
        zeros = self.zero_init if zeros is None else zeros
        if base is None:
            base = torch.zeros(shape, dtype=dtype) if zeros else torch.empty(shape, dtype=dtype)
        out = buf.out_view(base, T, h, dv, w)
        if buf.out_rank is None and self.out_rank == 3:
            out = out.view(-1, h, dv)
        return base, out

    def quant_input(self, base, out, T):
        return apply_chain(self.chain, base if self.read_base else out, T)

    # -- layer and weights (built once, on first use)
    def build(self) -> dict:
        if self._built:
            return self._built
        g = torch.Generator().manual_seed(10_000 + self.seed)
        h, dv = self.heads, self.v_head_dim
        if self.kind == "mla":
            nope, rope, lora = self.NOPE, self.ROPE, self.LORA
            kv_b_proj = nn.Linear(lora, h * (nope + dv), bias=False)
            with torch.no_grad():
                kv_b_proj.weight.copy_(torch.randn(h * (nope + dv), lora, generator=g) * lora**-0.5)
            module = layers.MLAAttention(num_heads=h, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=dv,
                                         kv_lora_rank=lora, kv_b_proj=kv_b_proj, layer_name=self.layer_name)
        else:
            module = layers.Attention(num_heads=h, num_kv_heads=self.kv_heads, head_dim=self.head_dim,
                                      v_head_dim=dv, layer_name=self.layer_name)
        o_proj = layers.NVFP4Linear(torch.randn(self.n, self.k, generator=g) * self.k**-0.5, input_amax=2.0)
        self._built = {"module": module, "impl": module.impl, "o_proj": o_proj}
        return self._built

    @property
    def impl(self):
        return self.build()["impl"]

    @property
    def o_proj(self) -> layers.NVFP4Linear:
        return self.build()["o_proj"]

    @property
    def signature(self) -> tuple:
        """Cases with one signature take the same attention inputs (each layer has its own weights and cache)."""
        if self.kind == "mla":
            return ("mla", self.heads, self.v_head_dim)
        return ("gqa", self.heads, self.kv_heads, self.head_dim, self.v_head_dim)

    def inputs(self, step: int, T: int) -> tuple[Tensor, ...]:
        """The attention inputs of ``step``: a function of the signature and the step only, so a case
        sees the same inputs whatever group it is compiled in."""
        g = torch.Generator().manual_seed(zlib.crc32(repr((self.signature, step)).encode()))
        h, dv = self.heads, self.v_head_dim
        if self.kind == "mla":
            shapes = [(T, h, self.NOPE + self.ROPE), (T, self.LORA), (T, 1, self.ROPE)]
        else:
            shapes = [(T, h, self.head_dim), (T, self.kv_heads, self.head_dim), (T, self.kv_heads, dv)]
        return tuple(torch.randn(shape, generator=g).to(torch.bfloat16) for shape in shapes)

    def input_buffer(self) -> Tensor | None:
        """A fresh persistent buffer for one call (the "input" buffer kind), else None."""
        if self.buffer != "input":
            return None
        return torch.zeros(INPUT_ROWS, self.width, dtype=torch.bfloat16)

    def forward(self, inputs, T, buffer=None):
        """Attention into the case's buffer, the chain, quant and GEMM: the GEMM's output."""
        built = self.build()
        base, out = self.alloc(T, torch.bfloat16, base=buffer)
        op = OPS.mla_attention_with_output if self.kind == "mla" else OPS.attention_with_output
        op(*inputs, out, self.layer_name)
        x = self.quant_input(base, out, T)
        p = built["o_proj"]
        if self.via_module:
            return p(x)
        x_fp4, x_sf = scaled_fp4_quant(x, p.input_global_scale)
        return OPS.nvfp4_gemm(x_fp4, p.weight, x_sf, p.weight_scale, p.alpha, torch.bfloat16)

    def gemm(self, a: Tensor, sf: Tensor, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
        """The case's GEMM on given operands (NVFP4Linear's output has its input's dtype)."""
        p = self.o_proj
        return OPS.nvfp4_gemm(a, p.weight, sf, p.weight_scale, p.alpha, out_dtype)

    def attention32(self, inputs, spec) -> Tensor:
        """float32 attention ``[T, W]`` of a batch of new requests (the layer's cache is cleared around it)."""
        impl = self.impl
        impl.clear_cache()
        try:
            out = impl.forward(*inputs, spec)
        finally:
            impl.clear_cache()
        return out.reshape(spec.num_tokens, -1)


# ---------------------------------------------------------------- the oracle

PROBE_DTYPE = torch.int16


def layout(case: Case, tokens) -> tuple[bool, int | None, bool, str]:
    """Apply the case's buffer set-up and chain to a probe at each token count.

    Returns ``(preserving, K, reads_unwritten, detail)``. Raises (ValueError or
    whatever the chain raises) when the chain is not usable: it fails at some
    token count, or its last dim is not one fixed multiple of 16.
    """
    preserving, ks, unwritten, details = True, set(), False, []
    h, dv, w = case.heads, case.v_head_dim, case.width
    for T in tokens:
        # int16: the element size of the query dtype (a dtype view reinterprets as it would), and exact
        base, out = case.alloc(T, PROBE_DTYPE, zeros=False)
        base.copy_(-1 - torch.arange(base.numel(), dtype=PROBE_DTYPE).view(base.shape))
        out.view(T, h, dv).copy_(torch.arange(T * w, dtype=PROBE_DTYPE).view(T, h, dv))  # as the op writes
        x = case.quant_input(base, out, T)
        if x.dim() < 1 or x.numel() == 0:
            raise ValueError(f"quant input of shape {list(x.shape)}")
        ks.add(int(x.shape[-1]))
        raw = x.contiguous().view(PROBE_DTYPE) if x.element_size() == 2 else x
        unwritten |= bool((raw < 0).any())
        if x.shape[-1] != w:
            ok, why = False, f"K={x.shape[-1]} != W={w}"
        elif x.numel() != T * w:
            ok, why = False, f"{x.numel() // w} rows != T={T}"
        elif not torch.equal(x.reshape(T, w).double(), torch.arange(T * w, dtype=torch.float64).view(T, w)):
            ok, why = False, f"not the attention's elements in row-major [T, W] order at T={T}"
        else:
            ok, why = True, ""
        if not ok and why not in details:
            details.append(why)
        preserving &= ok
    if len(ks) != 1:
        raise ValueError(f"last dim varies with T: {sorted(ks)}")
    (k,) = ks
    if k % 16:
        raise ValueError(f"last dim {k} is not a multiple of 16")
    detail = "; ".join(details[:2]) if details else f"[T, {w}] row-major at T={list(tokens)}"
    return preserving, k, unwritten, detail


def specializes_tokens(case: Case, hint: int) -> str | None:
    """Why tracing the buffer set-up and chain with a symbolic T (hint ``hint``, as Dynamo's first compile
    with the token dim marked dynamic) pins T to a constant, or None: such a chain cannot be compiled."""
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    T = mode.from_tensor(torch.empty(hint, 1), symbolic_context=context).shape[0]
    with mode:
        base, out = case.alloc(T, torch.bfloat16)
        case.quant_input(base, out, T)
    symbol = T.node.expr
    replaced = env.replacements.get(symbol)
    value_range = env.var_to_range.get(symbol)
    if replaced is not None and replaced.is_number:
        return f"T specialized to {replaced}"
    if value_range is not None and value_range.lower == value_range.upper:
        return f"T specialized to {value_range.lower}"
    return None


def finalize(case: Case, tokens, hint: int) -> Case:
    """Run the oracle at ``tokens``, fix K (and zero-init when unwritten elements are read).

    Raises when the chain is unusable (see :func:`layout`) or pins the token count when traced with
    the symbolic T of a compile at ``hint`` tokens.
    """
    preserving, k, unwritten, detail = layout(case, tokens)
    pinned = specializes_tokens(case, hint)
    if pinned:
        raise ValueError(pinned)
    case.preserving, case.k, case.oracle_detail = preserving, k, detail
    case.zero_init = case.zero_init or unwritten
    return case


# ---------------------------------------------------------------- generation


class _ChainBuilder:
    def __init__(self, rng: random.Random, dims, heads: int, v_head_dim: int):
        self.rng, self.dims = rng, list(dims)
        self.h, self.dv, self.w = heads, v_head_dim, heads * v_head_dim
        self.ops: list[Op] = []

    # a random shape with numel (C, E)
    def _random_shape(self, numel: Dim) -> list[Dim]:
        c, e = numel
        rng, w, h, dv = self.rng, self.w, self.h, self.dv
        canonical = [[(1, 1), (w, 0)], [(1, 1), (h, 0), (dv, 0)], [(h, 1), (dv, 0)], [(2, 1), (w // 2, 0)],
                     [(1, 0), (1, 1), (w, 0)], [(1, 1), (1, 0), (w, 0)], [(w, 1)], [(1, 1), (dv, 0), (h, 0)],
                     [(1, 1), (w // 16, 0), (16, 0)], [(w // 16, 1), (16, 0)], [(1, 1), (2, 0), (w // 2, 0)]]
        fitting = [s for s in canonical if numel_of(s) == (c, e) and all(d[0] >= 1 for d in s)]
        if fitting and rng.random() < 0.5:
            return list(rng.choice(fitting))
        n = rng.choice([1, 2, 2, 3, 3, 4])
        bins = [1] * n
        for p in _factors(c):
            bins[rng.randrange(n)] *= p
        t = rng.randrange(n) if e else None
        return [(b, e if i == t else 0) for i, b in enumerate(bins)]

    def add(self, op: Op, dims) -> None:
        self.ops.append(op)
        self.dims = list(dims)

    # -- ops (each returns False when it does not apply)
    def reshape(self, method=None) -> bool:
        numel = numel_of(self.dims)
        if numel is None or numel[1] == 2:
            return False
        target = self._random_shape(numel)
        method = method or self.rng.choice(["view", "reshape"])
        minus = self.rng.randrange(len(target)) if self.rng.random() < 0.4 else None
        self.add(op_view(target, minus, method), target)
        return True

    def flatten(self) -> bool:
        n = len(self.dims)
        if n < 2:
            return False
        s = self.rng.randrange(n - 1)
        e = self.rng.randrange(s + 1, n)
        merged = numel_of(self.dims[s:e + 1])
        if merged is None:
            return False
        e_arg = e - n if self.rng.random() < 0.3 else e
        self.add(op_named(f"flatten({s}, {e_arg})", lambda x, T: x.flatten(s, e_arg)),
                 self.dims[:s] + [merged] + self.dims[e + 1:])
        return True

    def unflatten(self) -> bool:
        cands = [i for i, (c, e) in enumerate(self.dims) if c >= 2 or e == 1]
        if not cands:
            return False
        d = self.rng.choice(cands)
        c, e = self.dims[d]
        a = self.rng.choice(_divisors(c))
        if e == 0:
            parts = [(a, 0), (c // a, 0)]
            minus = self.rng.choice([None, 0, 1])
        elif self.rng.random() < 0.5:
            parts, minus = [(a, 0), (c // a, e)], 1
        else:
            parts, minus = [(c // a, e), (a, 0)], 0
        at, text = _shape_fn(parts, minus)
        d_arg = d - len(self.dims) if self.rng.random() < 0.3 else d
        self.add(op_named(f"unflatten({d_arg}, ({text}))", lambda x, T: x.unflatten(d_arg, at(T))),
                 self.dims[:d] + parts + self.dims[d + 1:])
        return True

    def transpose(self) -> bool:
        n = len(self.dims)
        if n < 2:
            return False
        if n == 2 and self.rng.random() < 0.3:
            self.add(op_named("t()", lambda x, T: x.t()), self.dims[::-1])
            return True
        d0, d1 = self.rng.sample(range(n), 2)
        a0 = d0 - n if self.rng.random() < 0.3 else d0
        dims = list(self.dims)
        dims[d0], dims[d1] = dims[d1], dims[d0]
        self.add(op_named(f"transpose({a0}, {d1})", lambda x, T: x.transpose(a0, d1)), dims)
        return True

    def permute(self) -> bool:
        n = len(self.dims)
        if n < 2:
            return False
        p = list(range(n))
        while p == list(range(n)):
            self.rng.shuffle(p)
        self.add(op_named(f"permute({tuple(p)})", lambda x, T: x.permute(p)), [self.dims[i] for i in p])
        return True

    def detour(self) -> bool:
        """An excursion that comes back: transpose pair, .t().t(), or a permute and its inverse."""
        n = len(self.dims)
        if n < 2:
            return False
        kind = self.rng.choice(["transpose", "permute", "t"] if n == 2 else ["transpose", "permute"])
        middle = self.rng.choice([None, None, CLONE, CONTIGUOUS])
        if kind == "t":
            first = second = op_named("t()", lambda x, T: x.t())
        elif kind == "transpose":
            d0, d1 = self.rng.sample(range(n), 2)
            first = op_named(f"transpose({d0}, {d1})", lambda x, T: x.transpose(d0, d1))
            second = op_named(f"transpose({d1}, {d0})", lambda x, T: x.transpose(d1, d0))
        else:
            p = list(range(n))
            while p == list(range(n)):
                self.rng.shuffle(p)
            inv = [p.index(i) for i in range(n)]
            first = op_named(f"permute({tuple(p)})", lambda x, T: x.permute(p))
            second = op_named(f"permute({tuple(inv)})", lambda x, T: x.permute(inv))
        dims = list(self.dims)
        self.ops.append(first)
        if middle is not None:
            self.ops.append(middle)
        self.ops.append(second)
        self.dims = dims
        return True

    def unsqueeze(self) -> bool:
        n = len(self.dims)
        pos = self.rng.randint(-(n + 1), n)
        at = pos if pos >= 0 else pos + n + 1
        self.add(op_named(f"unsqueeze({pos})", lambda x, T: x.unsqueeze(pos)),
                 self.dims[:at] + [(1, 0)] + self.dims[at:])
        return True

    def squeeze(self) -> bool:
        ones = [i for i, d in enumerate(self.dims) if d == (1, 0)]
        if not ones or len(self.dims) < 2:
            return False
        d = self.rng.choice(ones)
        self.add(op_named(f"squeeze({d})", lambda x, T: x.squeeze(d)), self.dims[:d] + self.dims[d + 1:])
        return True

    def slice(self) -> bool:
        n = len(self.dims)
        d = self.rng.randrange(n)
        c, e = self.dims[d]
        pre = (slice(None),) * d
        lead = "[" + ":, " * d
        dims = list(self.dims)
        if e == 0:
            if c < 2:
                return False
            start, stop, step = self.rng.choice([(0, c // 2, 1), (c // 2, c, 1), (0, c, 2), (0, c, 1), (0, 4 * c, 1)])
            idx = pre + (slice(start, stop, step),)
            dims[d] = (len(range(start, min(stop, c), step)), 0)
            self.add(op_named(f"{lead}{start}:{stop}" + (f":{step}" if step != 1 else "") + "]",
                              lambda x, T: x[idx]), dims)
            return True
        if e == 1 and c >= 2:
            k = self.rng.randint(1, c)
            j = self.rng.randint(0, c - k)
            dims[d] = (k, 1)
            self.add(op_named(f"narrow({d}, {j}*T, {k}*T)", lambda x, T: x.narrow(d, j * T, k * T)), dims)
            return True
        if e == 1:  # the token dim itself: all of it, or all but one token
            if self.rng.random() < 0.5:
                self.add(op_named(f"{lead}:T]", lambda x, T: x[pre + (slice(0, T),)]), dims)
            else:
                first = self.rng.random() < 0.5
                dims[d] = (1, 2)
                self.add(op_named(f"narrow({d}, {1 if first else 0}, T-1)",
                                  lambda x, T: x.narrow(d, 1 if first else 0, T - 1)), dims)
            return True
        return False

    def as_strided(self) -> bool:
        numel = numel_of(self.dims)
        if numel is None or numel[1] == 2:
            return False
        c, e = numel
        kind = self.rng.choice(["row_major", "row_major", "column_major", "permuted", "broadcast", "half_rows"])
        if kind in ("row_major", "permuted"):
            sizes = self._random_shape(numel)
            order = list(range(len(sizes)))
            if kind == "permuted":
                self.rng.shuffle(order)
            strides: list = [None] * len(sizes)
            acc: Dim = (1, 0)
            for i in reversed(order):
                strides[i] = acc
                acc = numel_of([acc, sizes[i]])
            self.add(op_as_strided(sizes, strides), sizes)
            return True
        if kind == "column_major":  # e.g. as_strided((T, W), (1, T))
            sizes = self._random_shape(numel)
            if len(sizes) != 2:
                sizes = [(1, e), (c, 0)] if e else [(c, 0)]
                if len(sizes) != 2:
                    return False
            self.add(op_as_strided(sizes, [(1, 0), sizes[0]]), sizes)
            return True
        if kind == "broadcast":  # every row reads the first row: as_strided((T, W), (0, 1))
            if not e:
                return False
            self.add(op_as_strided([(1, 1), (c, 0)], [(0, 0), (1, 0)]), [(1, 1), (c, 0)])
            return True
        if not e or c % 2:  # half of each row, maybe the second half
            return False
        off = self.rng.choice([(0, 0), (c // 2, 0)])
        self.add(op_as_strided([(1, 1), (c // 2, 0)], [(c, 0), (1, 0)], off), [(1, 1), (c // 2, 0)])
        return True

    def clone(self) -> bool:
        self.ops.append(self.rng.choice([CLONE, CONTIGUOUS]))
        return True

    def dtype(self) -> bool:
        """A reinterpreting dtype view (the bits of bf16 read as fp16) or a value-keeping upcast."""
        self.ops.append(self.rng.choice([VIEW_FP16, TO_FLOAT]))
        return True

    # -- the last step: make the quant input 2-D (or leave it)
    def finish(self, prefer_tokens: bool) -> None:
        numel = numel_of(self.dims)
        if numel is None:
            return
        c, e = numel
        r = self.rng.random()
        if prefer_tokens and e == 1 and r < 0.6:
            self.add(op_view([(1, 1), (c, 0)], self.rng.choice([None, 1]), self.rng.choice(["view", "reshape"])),
                     [(1, 1), (c, 0)])
            return
        r = self.rng.random()
        if r < 0.35:
            return
        if r < 0.65:
            ks = [k for k in range(16, c + 1, 16) if c % k == 0]
            if ks:
                k = self.w if self.w in ks and self.rng.random() < 0.5 else self.rng.choice(ks)
                self.add(op_view([(c // k, e), (k, 0)], 0, "reshape"), [(c // k, e), (k, 0)])
            return
        if r < 0.9 and e == 1:
            self.add(op_view([(1, 1), (c, 0)], 1, self.rng.choice(["view", "reshape"])), [(1, 1), (c, 0)])
            return
        if len(self.dims) >= 3:
            merged = numel_of(self.dims[:-1])
            self.add(op_named("flatten(0, -2)", lambda x, T: x.flatten(0, -2)), [merged, self.dims[-1]])


VIEW_STEPS = ("reshape", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "as_strided_row_major", "slice_whole")
ALL_STEPS = ("reshape", "reshape", "flatten", "unflatten", "transpose", "permute", "detour", "unsqueeze", "squeeze",
             "slice", "as_strided", "as_strided", "clone", "reshape", "flatten", "unflatten", "transpose", "permute",
             "detour", "unsqueeze", "squeeze", "slice", "as_strided", "as_strided", "clone", "dtype")


def _step(b: _ChainBuilder, name: str) -> bool:
    if name == "as_strided_row_major":
        numel = numel_of(b.dims)
        if numel is None or numel[1] == 2:
            return False
        sizes = b._random_shape(numel)
        strides, acc = [None] * len(sizes), (1, 0)
        for i in reversed(range(len(sizes))):
            strides[i] = acc
            acc = numel_of([acc, sizes[i]])
        b.add(op_as_strided(sizes, strides), sizes)
        return True
    if name == "slice_whole":
        d = b.rng.randrange(len(b.dims))
        c, e = b.dims[d]
        if e == 2:
            return False
        pre = (slice(None),) * d
        stop_text = dim_text((c, e))
        b.add(op_named(f"[{':, ' * d}:{stop_text}]", lambda x, T: x[pre + (slice(0, size_of((c, e), T)),)]), b.dims)
        return True
    return getattr(b, name)()


def random_chain(rng: random.Random, dims, heads: int, v_head_dim: int) -> tuple[tuple[Op, ...], str]:
    """A random chain from a source of ``dims``; returns (ops, mode)."""
    b = _ChainBuilder(rng, dims, heads, v_head_dim)
    mode = rng.choices(["views", "detour", "random"], weights=[2, 2, 6])[0]
    if mode == "views":
        for _ in range(rng.randint(1, 4)):
            _step(b, rng.choice(VIEW_STEPS))
        if rng.random() < 0.3:
            b.clone()
    elif mode == "detour":
        for _ in range(rng.randint(0, 2)):
            _step(b, rng.choice(VIEW_STEPS))
        b.detour()
        for _ in range(rng.randint(0, 1)):
            _step(b, rng.choice(VIEW_STEPS))
    else:
        for _ in range(rng.randint(1, 5)):
            _step(b, rng.choice(ALL_STEPS))
    b.finish(prefer_tokens=mode != "random")
    return tuple(b.ops), mode


def random_case(index: int, base_seed: int, tokens, hint: int) -> Case:
    """Case ``index`` of the generated set: redrawn from its own RNG until the chain is usable."""
    rng = random.Random(f"{base_seed}:{index}")
    for attempt in range(200):
        kind = rng.choice(["mla", "gqa"])
        heads = rng.choice([1, 2, 2, 3, 4])
        dv = rng.choice([16, 16, 32]) if rng.random() > 0.04 or heads == 1 else 8
        if (heads * dv) % 16:
            continue
        buffer = rng.choices(list(BUFFERS), weights=[8, 3, 2, 2, 2, 2, 2, 2, 2, 2])[0]
        read_base = buffer not in ("plain", "plain3d") and rng.random() < 0.4
        kv_heads = rng.choice([d for d in _divisors(heads)]) if kind == "gqa" else 1
        case = Case(id=f"gen{index:03d}", kind=kind, heads=heads, v_head_dim=dv, buffer=buffer, read_base=read_base,
                    chain=(), k=0, n=rng.choice([16, 32]), seed=100_000 * (base_seed + 1) + 1000 * index + attempt,
                    kv_heads=kv_heads, head_dim=rng.choice([16, 32]), via_module=rng.random() < 0.15)
        case.chain, mode = random_chain(rng, case.source_dims(), heads, dv)
        case.note = f"mode {mode}"
        try:
            return finalize(case, tokens, hint)
        except Exception:  # unusable chain: raises at some token count, or no fixed K that is a multiple of 16
            continue
    raise RuntimeError(f"no usable chain for generated case {index}")
