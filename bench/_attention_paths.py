"""The timed paths of one shape of bench/attention.py: inputs, output buffers, and one no-argument call per path.

Paths (every one writes the same result: NVFP4 of the causal attention output, token-major ``[T, H*Dv]``):

* ``fused``: ``Kernels.fused`` (FA4's forward with the NVFP4 epilogue) into preallocated buffers;
* ``fa4``: ``Kernels.attention`` (FA4's bf16 forward) alone, no quantization (the epilogue's reference cost);
* ``fa4_quant``: ``Kernels.attention`` then ``Kernels.quantize_into`` the preallocated buffers;
* ``cudnn_quant_bshd``: torch SDPA (cuDNN backend on CUDA) on ``[B, H, L, D]`` views of the token-major
  tensors (cuDNN allocates its output in q's stride order, so the token-major ``[T, H*Dv]`` view is free),
  then the quantizer;
* ``cudnn_quant_bhsd``: the same on contiguous padded ``[B, H, L, D]`` copies of the inputs (made outside the
  timed region), whose output needs ``transpose(1, 2).reshape(T, H*Dv)``, a copy, inside it.

cuDNN runs a batch of equal lengths as a dense batch (these shapes have equal lengths, so nothing is
padded); the better of its two layouts is the ``cudnn_quant`` baseline. torch's ``is_causal`` is aligned
top-left, so chunked shapes (context > 0) give cuDNN an additive bf16 mask ``[1, 1, Lq, Lk]`` (bottom-right
causal: query ``i`` sees keys ``<= context + i``), made outside the timed region.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from fusion_pass import nvfp4

from _attention_shapes import Shape
from _kernels import Kernels

__all__ = ["INPUT_SETS_SMALL", "L2_BYTES", "PATHS", "Path", "ShapeInputs", "build_paths", "check_outputs",
           "input_sets_needed", "make_inputs"]

DTYPE = torch.bfloat16
L2_BYTES = 50 * 2**20
INPUT_SETS_SMALL = 3
PATHS = ("fused", "fa4", "fa4_quant", "cudnn_quant_bshd", "cudnn_quant_bhsd")


@dataclass
class ShapeInputs:
    """One input set: token-major ``q [T, H, Dqk]``, ``k [Tk, Hkv, Dqk]``, ``v [Tk, Hkv, Dv]`` (sequence ``b``'s
    keys: its context then its new tokens), the varlen metadata, and the dense views / copies cuDNN takes."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_k: torch.Tensor | None  # None: no context, the keys are the queries' own tokens
    max_seqlen: int
    max_seqlen_k: int | None
    dense: dict = field(default_factory=dict)  # "bshd" / "bhsd": (q, k, v) as [B, H, L, D]

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (self.q, self.k, self.v))


def make_inputs(shape: Shape, seed: int, device, *, dense: bool = True) -> ShapeInputs:
    """Seeded randn inputs (never zeros) of ``shape`` on ``device``."""
    lay, b = shape.layout, shape.batch
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    lk = b.context + b.q_len
    q = torch.randn(shape.tokens, lay.heads, lay.dqk, generator=gen, device=device, dtype=DTYPE)
    k = torch.randn(shape.keys, lay.kv_heads, lay.dqk, generator=gen, device=device, dtype=DTYPE)
    v = torch.randn(shape.keys, lay.kv_heads, lay.dv, generator=gen, device=device, dtype=DTYPE)
    cu = torch.arange(b.batch + 1, dtype=torch.int32, device=device) * b.q_len
    cu_k = torch.arange(b.batch + 1, dtype=torch.int32, device=device) * lk if b.context else None
    inputs = ShapeInputs(q, k, v, cu, cu_k, b.q_len, lk if b.context else None)
    if dense:
        def bshd(x, length):  # [B*L, H, D] -> [B, H, L, D] view, no copy
            return x.view(b.batch, length, x.shape[1], x.shape[2]).transpose(1, 2)

        views = (bshd(q, b.q_len), bshd(k, lk), bshd(v, lk))
        inputs.dense = {"bshd": views, "bhsd": tuple(x.contiguous() for x in views)}
    return inputs


def input_sets_needed(nbytes: int, l2_bytes: int = L2_BYTES) -> int:
    """Input sets to rotate among: one when a set is at least 3x the L2 cache, else three."""
    return 1 if nbytes >= 3 * l2_bytes else INPUT_SETS_SMALL


def causal_mask(q_len: int, k_len: int, device) -> torch.Tensor:
    """Additive bf16 ``[1, 1, Lq, Lk]``: 0 where query ``i`` sees key ``j <= i + Lk - Lq``, -inf elsewhere."""
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(k_len, device=device)[None, :]
    mask = torch.zeros(q_len, k_len, dtype=DTYPE, device=device)
    return mask.masked_fill_(j > i + (k_len - q_len), float("-inf"))[None, None]


@dataclass
class Path:
    """One timed path: ``call()`` runs it on the next input set; ``context()`` is entered around every
    measurement (the SDPA backend choice), not per call; ``out`` is where its NVFP4 lands; ``result``: what the
    first call (input set 0) returned, kept for the checks."""

    call: Callable[[], object]
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    out: tuple | None = None  # (packed, scales) buffers, None for the bf16-only path
    result: object = None


def _rotating(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """A no-argument function running the next of ``calls`` each time (one per input set)."""
    if len(calls) == 1:
        return calls[0]
    state = {"i": 0}

    def call():
        i = state["i"]
        state["i"] = (i + 1) % len(calls)
        return calls[i]()

    return call


def _buffers(shape: Shape, device) -> tuple[torch.Tensor, torch.Tensor]:
    n = shape.layout.heads * shape.layout.dv
    rows, cols = nvfp4.scale_shape(shape.tokens, n)
    return (torch.zeros(shape.tokens, n // 2, dtype=torch.uint8, device=device),
            torch.zeros(rows, cols, dtype=torch.float8_e4m3fn, device=device))


def sdpa_backend(device) -> Callable[[], contextlib.AbstractContextManager]:
    """The SDPA backend choice: cuDNN forced on CUDA, the math backend on the CPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.CUDNN_ATTENTION if torch.device(device).type == "cuda" else SDPBackend.MATH
    return lambda: sdpa_kernel(backend)


def build_paths(kernels: Kernels, shape: Shape, sets: list[ShapeInputs], global_scale: torch.Tensor,
                device) -> dict[str, Path]:
    """The paths of ``shape`` over the input ``sets`` (each path its own output buffers)."""
    lay, b = shape.layout, shape.batch
    t, n = shape.tokens, lay.heads * lay.dv
    scale = lay.dqk**-0.5
    gqa = lay.kv_heads != lay.heads
    mask = causal_mask(b.q_len, b.context + b.q_len, device) if b.context else None

    def fused(x: ShapeInputs, packed, scales):
        kernels.fused(x.q, x.k, x.v, cu_seqlens=x.cu_seqlens, max_seqlen=x.max_seqlen, softmax_scale=scale,
                      causal=True, output=packed, output_scale=global_scale, output_block_scale=scales,
                      cu_seqlens_k=x.cu_seqlens_k, max_seqlen_k=x.max_seqlen_k)

    def fa4(x: ShapeInputs):
        return kernels.attention(x.q, x.k, x.v, x.cu_seqlens, x.max_seqlen, causal=True, softmax_scale=scale,
                                 cu_seqlens_k=x.cu_seqlens_k, max_seqlen_k=x.max_seqlen_k)

    def fa4_quant(x: ShapeInputs, packed, scales):
        kernels.quantize_into(fa4(x).view(t, n), global_scale, packed, scales)

    def cudnn_quant(x: ShapeInputs, layout: str, packed, scales):
        q, k, v = x.dense[layout]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa)
        kernels.quantize_into(out.transpose(1, 2).reshape(t, n), global_scale, packed, scales)

    def path(fn, out=None, **kw) -> Path:  # binds this path's buffers (each path has its own)
        args = () if out is None else out
        return Path(_rotating([lambda x=x: fn(x, *args) for x in sets]), out=out, **kw)

    paths = {"fused": path(fused, _buffers(shape, device)), "fa4": path(fa4),
             "fa4_quant": path(fa4_quant, _buffers(shape, device))}
    for layout in ("bshd", "bhsd"):
        paths[f"cudnn_quant_{layout}"] = path(lambda x, p, s, layout=layout: cudnn_quant(x, layout, p, s),
                                              _buffers(shape, device), context=sdpa_backend(device))
    return paths


def check_outputs(paths: dict[str, Path], ran: set[str]) -> dict:
    """Byte agreement of the paths that ran, each after one call on input set 0 (the caller ran them):
    ``fused`` against ``fa4_quant`` (equal by the kernels' contract) and each cuDNN path against ``fa4_quant``
    (different attention kernels: agreement below 1 is rounding), as fractions of equal bytes."""
    check = {}
    if "fa4_quant" not in ran:
        return check
    want = [x.view(torch.uint8) for x in paths["fa4_quant"].out]
    for name in ("fused", "cudnn_quant_bshd", "cudnn_quant_bhsd"):
        if name in ran:
            got = [x.view(torch.uint8) for x in paths[name].out]
            check[name] = {"packed_equal": (got[0] == want[0]).float().mean().item(),
                           "scales_equal": (got[1] == want[1]).float().mean().item()}
    return check
