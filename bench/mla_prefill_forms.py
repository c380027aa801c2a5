"""MLA prefill with cached context: the expanded form (what the fused call runs) against the absorbed form
(attention read straight from the paged latent cache), issue 27 item 3.

A DeepSeek-style MLA layer (``H`` local heads, latent rank ``L = 512``, rope ``R = 64``, ``qk_nope = 128``,
``v = 128``) caches one latent row ``[L + R]`` per token in pages of ``--page-size`` rows (64: vLLM's MLA
block size on Hopper), pages shuffled. A prefill chunk of ``B`` requests, each ``n`` new tokens after ``c``
cached ones, can be computed two ways:

  expanded   what the fused prefill call does (vLLM's MLA prefill too): gather the latents of context and new
             tokens from the pages into a workspace (``gather``), up-project them through ``kv_b_proj``
             (``[Tk, L] @ [L, H (128 + 128)]``) into per-head keys (nope part + the shared rope part) and
             values (``expand``), then one fused FA4 call (head dims 192 / 128, ``cu_seqlens_k``) writing
             NVFP4 (``attention``); ``expanded`` is the three together.
  absorbed   no workspace: queries through ``W_UK`` into latent space (``[N, H, L + R]``), an MQA attention
             over the latent pages (keys ``L + R = 576`` wide, values ``L = 512``), the output through ``W_UV``,
             then the NVFP4 quantizer (the quant cannot be fused into this attention: ``W_UV`` comes after
             it). No attention kernel for head dims 576 / 512 is available here (FA4 SM90 takes head dims up
             to 256), so its attention is bounded from below: its FLOPs at the bf16 GEMM rate measured on this
             device, or its latent bytes at the measured copy bandwidth, whichever is larger. ``absorbed_floor``
             = the measured projections and quantizer + that bound.

Verdict per shape: ``expanded`` when it is faster than even ``absorbed_floor`` (reading the latent cache paged
cannot win there), else ``absorbed may win`` (the floor alone does not decide it).

GPU times: the parts of one shape captured in CUDA graphs and replayed interleaved (``_timing``), medians; L2
not flushed; inputs seeded randn, never zeros. ``--device cpu``: tiny shapes, float32 reference kernels, and a
check that both forms compute the same attention (what the CPU test runs; times meaningless).

    python bench/mla_prefill_forms.py --json "$OUT/mla_forms.json" --markdown "$OUT/mla_forms.md"
    python bench/mla_prefill_forms.py --device cpu --json /tmp/mla_forms.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
if importlib.util.find_spec("fusion_pass") is None:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(BENCH_DIR.parent))
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

import _timing  # noqa: E402
from _kernels import fa4_kernels, fa4_status, reference_kernels  # noqa: E402

LATENT, ROPE, NOPE, VDIM = 512, 64, 128, 128

GPU_SHAPES = (  # heads, B, n, c
    (16, 16, 16, 8192), (16, 8, 128, 8192), (16, 4, 512, 8192), (16, 2, 2048, 8192), (16, 1, 4096, 30000),
    (128, 8, 16, 8192), (128, 4, 128, 8192), (128, 2, 512, 8192), (128, 1, 2048, 8192),
)
CPU_SHAPES = ((2, 2, 3, 9), (4, 3, 5, 17), (2, 1, 8, 0))


@dataclass(frozen=True)
class Shape:
    heads: int
    batch: int
    new: int
    context: int

    @property
    def label(self) -> str:
        return f"H{self.heads} {self.batch}x{self.new}+{self.context}"

    @property
    def pairs(self) -> int:
        """Query-key pairs the causal attention computes (new token ``i`` sees ``context + i + 1`` keys)."""
        return self.batch * (self.new * self.context + self.new * (self.new + 1) // 2)


class Case:
    """One shape's inputs: the paged latent cache holding context and new tokens, the page table, the queries,
    ``kv_b_proj``'s weight, the NVFP4 output buffers, and the index of every key's cache row in workspace order."""

    def __init__(self, shape: Shape, page_size: int, device, dtype, seed: int):
        from fusion_pass import nvfp4

        g = torch.Generator(device="cpu").manual_seed(seed)
        b, n, c, h = shape.batch, shape.new, shape.context, shape.heads
        pages_per = math.ceil((c + n) / page_size)
        order = torch.randperm(b * pages_per + 3, generator=g)[: b * pages_per].view(b, pages_per)

        def randn(*size, scale=1.0):
            return (torch.randn(*size, generator=g) * scale).to(device=device, dtype=dtype)

        self.shape, self.page_size = shape, page_size
        self.cache = randn(b * pages_per + 3, page_size, LATENT + ROPE, scale=0.5)
        self.page_table = order.to(device=device, dtype=torch.int32)
        pos = torch.arange(c + n)
        slots = order[:, pos // page_size] * page_size + pos % page_size  # [B, c + n]: context, then new
        self.slots = slots.reshape(-1).to(device)
        self.q = randn(b * n, h, NOPE + ROPE)
        self.w_kv = randn(LATENT, h * (NOPE + VDIM), scale=LATENT ** -0.5)
        self.w_uk = self.w_kv.view(LATENT, h, NOPE + VDIM)[..., :NOPE].permute(1, 2, 0)  # [H, NOPE, L]
        self.w_uv = self.w_kv.view(LATENT, h, NOPE + VDIM)[..., NOPE:].permute(1, 0, 2)  # [H, L, V]
        self.softmax_scale = (NOPE + ROPE) ** -0.5
        self.cu_q = torch.arange(0, b * n + 1, n, dtype=torch.int32, device=device)
        self.cu_k = torch.arange(0, b * (c + n) + 1, c + n, dtype=torch.int32, device=device)
        t, width = b * n, h * VDIM
        self.global_scale = torch.tensor([448.0 * 6.0 / 4.0], device=device)
        self.packed = torch.empty(t, width // 2, dtype=torch.uint8, device=device)
        self.scales = torch.empty(*nvfp4.scale_shape(t, width), dtype=torch.uint8, device=device)
        self.o_latent = randn(h, t, LATENT)  # the absorbed attention's output stand-in (its kernel is bounded)

    def gather(self) -> torch.Tensor:
        """``[B (c + n), L + R]``: every key's latent row, requests one after the other, context first."""
        return self.cache.view(-1, LATENT + ROPE).index_select(0, self.slots)

    def expand(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[Tk, H, 192]`` and values ``[Tk, H, 128]`` (a view) of the gathered latents."""
        h = self.shape.heads
        kv = (latents[:, :LATENT] @ self.w_kv).view(-1, h, NOPE + VDIM)
        k = torch.empty(kv.shape[0], h, NOPE + ROPE, dtype=kv.dtype, device=kv.device)
        k[..., :NOPE] = kv[..., :NOPE]
        k[..., NOPE:] = latents[:, None, LATENT:]
        return k, kv[..., NOPE:]

    def attention(self, kernels, k: torch.Tensor, v: torch.Tensor) -> None:
        s = self.shape
        kernels.fused(self.q, k, v, cu_seqlens=self.cu_q, max_seqlen=s.new, softmax_scale=self.softmax_scale,
                      causal=True, output=self.packed, output_scale=self.global_scale,
                      output_block_scale=self.scales, cu_seqlens_k=self.cu_k, max_seqlen_k=s.context + s.new)

    def absorbed_projections(self, kernels) -> None:
        """Everything of the absorbed form but its attention: ``q_nope @ W_UK``, the output through ``W_UV``,
        the quantizer."""
        q_latent = torch.bmm(self.q[..., :NOPE].transpose(0, 1), self.w_uk)  # [H, N, L]
        torch.cat((q_latent, self.q[..., NOPE:].transpose(0, 1)), dim=-1)
        out = torch.bmm(self.o_latent, self.w_uv).transpose(0, 1).reshape(self.q.shape[0], -1)  # [N, H*V]
        kernels.quantize_into(out, self.global_scale, self.packed, self.scales)


def absorbed_attention_reference(case: Case) -> torch.Tensor:
    """The absorbed form's attention in float32 over the gathered latents, through ``W_UV``: ``[N, H, V]``."""
    s = case.shape
    lat = case.gather().float().view(s.batch, s.context + s.new, LATENT + ROPE)
    q = case.q.float().view(s.batch, s.new, s.heads, NOPE + ROPE)
    q_latent = torch.einsum("bnhp,hpl->bnhl", q[..., :NOPE], case.w_uk.float())
    q_full = torch.cat((q_latent, q[..., NOPE:]), dim=-1)
    scores = torch.einsum("bnhd,bkd->bhnk", q_full, lat) * case.softmax_scale
    keys = torch.arange(s.context + s.new)
    mask = keys[None, :] > (s.context + torch.arange(s.new))[:, None]
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    o_latent = torch.einsum("bhnk,bkl->bnhl", probs, lat[..., :LATENT])
    return torch.einsum("bnhl,hlv->bnhv", o_latent, case.w_uv.float()).reshape(-1, s.heads, VDIM)


def expanded_attention_reference(case: Case) -> torch.Tensor:
    """The expanded form's attention in float32 (keys and values up-projected in float32): ``[N, H, V]``."""
    from fusion_pass.kernels import reference

    lat = case.gather().float()
    kv = (lat[:, :LATENT] @ case.w_kv.float()).view(-1, case.shape.heads, NOPE + VDIM)
    k = torch.cat((kv[..., :NOPE], lat[:, None, LATENT:].expand(-1, case.shape.heads, -1)), dim=-1)
    return reference.varlen_attention(case.q.float(), k, kv[..., NOPE:].contiguous(), case.cu_q, True,
                                      case.softmax_scale, case.cu_k)[0]


def device_rates(device) -> dict:
    """The bf16 GEMM rate (TFLOP/s, an 8192^3 product) and copy bandwidth (TB/s, 1 GiB) measured here."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    gemm = _timing.median(_timing.graph_replay_ms(lambda: a @ a, calls=5, replays=10))
    src = torch.randn(1 << 29, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy = _timing.median(_timing.graph_replay_ms(lambda: dst.copy_(src), calls=5, replays=10))
    return {"gemm_tflops": 2 * 8192 ** 3 / gemm / 1e9, "copy_tbps": 2 * src.numel() * 2 / copy / 1e9}


def absorbed_attention_floor_ms(shape: Shape, rates: dict) -> float:
    """The absorbed attention's time at the device's GEMM rate (``2 H (576 + 512)`` FLOPs per query-key pair) or
    at its copy bandwidth (the latent rows read once), whichever is longer."""
    flops = 2 * shape.heads * (LATENT + ROPE + LATENT) * shape.pairs
    bytes_read = shape.batch * (shape.context + shape.new) * (LATENT + ROPE) * 2
    return max(flops / (rates["gemm_tflops"] * 1e9), bytes_read / (rates["copy_tbps"] * 1e9))


def measure_gpu(shape: Shape, page_size: int, rates: dict, seed: int, replays: int) -> dict:
    ok, why = fa4_status("cuda", torch.bfloat16, shape.heads, NOPE + ROPE, VDIM)
    if not ok:
        return {"shape": asdict(shape), "label": shape.label, "error": f"FA4 unavailable: {why}"}
    kernels, case = fa4_kernels(), Case(shape, page_size, "cuda", torch.bfloat16, seed)
    lat = case.gather()
    k, v = case.expand(lat)

    def expanded():
        kk, vv = case.expand(case.gather())
        case.attention(kernels, kk, vv)

    fns = {"gather": case.gather, "expand": lambda: case.expand(lat), "attention": lambda: case.attention(kernels, k, v),
           "expanded": expanded, "absorbed_projections": lambda: case.absorbed_projections(kernels)}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    samples = _timing.graph_replay_interleaved_ms(fns, replays=replays)
    ms = {name: _timing.median(xs) for name, xs in samples.items()}
    ms["absorbed_attention_floor"] = absorbed_attention_floor_ms(shape, rates)
    ms["absorbed_floor"] = ms["absorbed_projections"] + ms["absorbed_attention_floor"]
    del case, lat, k, v
    torch.cuda.empty_cache()
    return {"shape": asdict(shape), "label": shape.label, "ms": ms, "verdict": verdict(ms),
            "expansion_share": (ms["gather"] + ms["expand"]) / ms["expanded"]}


def verdict(ms: dict) -> str:
    return "expanded" if ms["expanded"] < ms["absorbed_floor"] else "absorbed may win"


def measure_cpu(shape: Shape, page_size: int, seed: int) -> dict:
    """Tiny shapes on the CPU: both forms of the attention in float32 agree, the expanded path's fused bytes are
    the quantizer's on the reference attention; wall times (meaningless)."""
    from fusion_pass import nvfp4

    case = Case(shape, page_size, "cpu", torch.float32, seed)
    diff = (absorbed_attention_reference(case) - expanded_attention_reference(case)).abs().max().item()
    kernels = reference_kernels()
    k, v = case.expand(case.gather())
    q16, k16, v16 = (x.to(torch.bfloat16) for x in (case.q, k, v))
    kernels.fused(q16, k16, v16, cu_seqlens=case.cu_q, max_seqlen=shape.new, softmax_scale=case.softmax_scale,
                  causal=True, output=case.packed, output_scale=case.global_scale, output_block_scale=case.scales,
                  cu_seqlens_k=case.cu_k, max_seqlen_k=shape.context + shape.new)
    want = kernels.attention(q16, k16, v16, case.cu_q, shape.new, causal=True, softmax_scale=case.softmax_scale,
                             cu_seqlens_k=case.cu_k)
    ref_packed, ref_scales = nvfp4.quantize(want.reshape(want.shape[0], -1), case.global_scale, swizzled=True)
    bytes_equal = bool(torch.equal(case.packed, ref_packed) and torch.equal(case.scales, ref_scales.view(torch.uint8)))
    ms = {"expanded": _timing.median(_timing.cpu_ms(lambda: case.expand(case.gather()), repeats=3))}
    return {"shape": asdict(shape), "label": shape.label, "ms": ms, "forms_max_abs_diff": diff,
            "fused_bytes_equal": bytes_equal}


def markdown(result: dict) -> str:
    lines = [f"MLA prefill forms, {result['date']}, {result['device']}; page size {result['page_size']}; "
             f"{_timing.L2_POLICY}.", ""]
    if "rates" in result:
        r = result["rates"]
        lines += [f"Measured here: bf16 GEMM {r['gemm_tflops']:.0f} TFLOP/s, copy {r['copy_tbps']:.2f} TB/s.", ""]
    lines += ["| shape (H, B x new + context) | gather | expand | attention | expanded | absorbed projections + "
              "quant | absorbed attention floor | absorbed floor | expansion share | verdict |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row['label']} | n/a: {row['error']} |" + " |" * 8)
            continue
        ms = row["ms"]
        cells = [f"{ms[k]:.3f}" for k in ("gather", "expand", "attention", "expanded", "absorbed_projections",
                                          "absorbed_attention_floor", "absorbed_floor")]
        lines.append(f"| {row['label']} | " + " | ".join(cells) + f" | {row['expansion_share']:.0%} | "
                     f"{row['verdict']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--page-size", type=int, default=64, help="latent cache rows per page (default 64)")
    parser.add_argument("--replays", type=int, default=30, help="graph replays per part (default 30)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    args = parser.parse_args(argv)
    if args.page_size < 1:
        parser.error(f"--page-size must be a positive int, got {args.page_size}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("mla_prefill_forms: --device cuda needs a CUDA device; --device cpu runs the CPU check", file=sys.stderr)
        return 2
    result = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "page_size": args.page_size,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    if args.device == "cuda":
        result["rates"] = device_rates("cuda")
        rows = [measure_gpu(Shape(*s), args.page_size, result["rates"], args.seed + i, args.replays)
                for i, s in enumerate(GPU_SHAPES)]
    else:
        rows = [measure_cpu(Shape(*s), args.page_size, args.seed + i) for i, s in enumerate(CPU_SHAPES)]
    result["rows"] = rows
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    text = markdown(result) if args.device == "cuda" else json.dumps(rows, indent=1)
    if args.markdown:
        args.markdown.write_text(text)
    print(text)
    bad = [r["label"] for r in rows if "error" in r or r.get("fused_bytes_equal") is False
           or r.get("forms_max_abs_diff", 0) > 1e-4]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
