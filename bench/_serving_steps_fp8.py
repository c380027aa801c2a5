"""The serving trace's timed steps with a static per-tensor FP8 output (``--format fp8_static``, issue 28).

The steps, KV slab, pages, queries and timers of :mod:`_serving_steps` (NVFP4); per layer the output is
``float8_e4m3fn [T, H*Dv]`` under one float32 scale (``docs/formats.md``, "FP8 static per tensor"), written in the
arithmetic of vLLM's ``QuantFP8`` native form, which vLLM builds by default (``custom_ops="none"`` under Inductor):
``fp8(clamp(float32(x) * inv_scale, -448, 448))``, a NaN kept (``0x7F``). ``inv_scale`` is the IEEE reciprocal of
the checkpoint's scale ``amax / 448`` (:data:`AMAX`, attention outputs of randn values stay below it), handed to
both sides as it is (bench/attention.py's FP8 paths do the same).

Kernels (:class:`Fp8StepKernels`):

* ``fused``: FA4's SM90 forward with the static FP8 epilogue, ``fusion_pass.kernels.fa4.sm90_fp8``
  ``fa4_attention_fp8_static_varlen(..., inv_scale=, nan_to_max=False)`` (the native form's NaN rule), rows
  ``[cu_seqlens[0], cu_seqlens[B])`` of a preallocated buffer; documented (and byte-tested on an H100) to write
  ``fp8.quantize_static`` of FA4's own bf16 output of the same call;
* ``attention`` / ``attention_paged``: FA4's bf16 varlen and paged forwards (``_kernels.fa4_kernels``);
* ``quant``: the unfused quant a vLLM user has: the native form (``_attention_formats.native_static``, the function
  bench/attention.py compiles) compiled by ``torch.compile(fullgraph=True)`` with the token dimension dynamic, as
  vLLM compiles its graph (one graph for every token count; :meth:`Fp8StepRunner.warm_quant` compiles it before
  the first step, so no step pays a compile); it returns a new tensor per call, as the compiled graph allocates it.
  bench/attention.py compiles the same function per shape (``dynamic=False``); here a static compile per step's
  token counts would be a recompile per step. On the CPU (``--cpu-timing``) the reference stand-ins and the native
  form eagerly.

Variants (the NVFP4 trace's names; :attr:`Fp8StepRunner.VARIANTS`):

* ``unfused``: FA4 bf16 over every row in one call (keys packed), then the quant of the whole output;
* ``unfused_split``: decode rows by FA4 bf16 on the decode sub-batch + the quant of those rows, prefill rows by
  FA4 bf16 on the prefill sub-batch (the offsets of ``fused``'s fused call) + the quant of those rows (two quant
  calls, each writing a new tensor of its rows);
* ``fused``: the runtime's split: decode rows as in ``unfused_split``, prefill rows by the fused FP8 kernel;
* ``fused_all``: every row by the fused FP8 kernel in one varlen call (keys packed);
* ``unfused_paged``: FA4 bf16 paged over every row in one call, then the quant: vLLM's FLASH_ATTN + QuantFP8;
* ``pass_on``: what the pass does with a static FP8 call today (:meth:`Fp8StepRunner.pass_on_choice`): a step
  without decode rows is a ``prefill`` call, ``fused_all``'s when the policy fuses it; with decode and prefill rows
  there is no one fused call (the fused paged launch writes NVFP4 only), so the rows are written apart: the split
  (``fused``'s calls) where the pass splits (an MLA layer; a standard layer under
  ``FUSION_PASS_VLLM_SPLIT_MIXED=on``) and the policy fuses that split class, else unfused (``unfused_paged``'s
  calls; the default on SM90: a standard layer is not split, and the policy fuses neither split class there);
  decode-only steps are never fused (``unfused_paged``);
* ``varlen_bf16``: FA4 bf16 over every row in one call alone, no quant (the fused call's floor).

``fused_paged`` is absent (:attr:`Fp8StepRunner.ABSENT`): there is no FP8 paged launch.

Bytes (:attr:`Fp8StepRunner.CHECKED_PAIRS`): ``fused_all == unfused`` (the same one call: the fused kernel's bytes
are ``quantize_static`` of FA4's bf16 output of that call, the compiled native form's are the same function of it)
and ``fused == unfused_split`` (the same sub-batch calls); ``fused == unfused`` and ``unfused_paged == unfused`` are
recorded, not required (as for NVFP4). A variant's bytes per layer are its preallocated buffer with the quant
calls' new tensors laid over their rows (:class:`Fp8Out`), assembled outside the timed region.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from fusion_pass import fp8
from fusion_pass.runtime import policy, settings

import _attention_formats as formats
from _kernels import fa4_kernels, reference_kernels
from _serving_steps import DEFAULT_PAGE_SIZE, AttnDims, StepLayout, StepRunner, _bound

__all__ = ["AMAX", "COMPILE_QUANT", "Fp8Out", "Fp8StepKernels", "Fp8StepRunner", "fa4_fp8_static_kernels",
           "fp8_static_status", "reference_fp8_static_kernels"]

AMAX = 8.0
"""The calibrated amax of the checkpoint's output scale (``scale = AMAX / 448``): attention outputs are convex
combinations of randn values, ``|out| < 8`` (the NVFP4 trace's global scale assumes the same)."""

COMPILE_QUANT = True
"""On CUDA, ``torch.compile`` the native-form quant (False: run it eagerly; for tests of other logic)."""

NO_FP8_PAGED = ("no FP8 paged launch exists: FA4's fused paged kernel (fa4_attention_nvfp4_paged) writes NVFP4 only "
                "(docs/formats.md, 'Not built yet')")


class Fp8StepKernels(NamedTuple):
    """What the FP8 trace times; ``name`` says which implementation. ``fused(q, k, v, *, cu_seqlens, max_seqlen,
    softmax_scale, causal, output, inv_scale, nan_to_max, cu_seqlens_k, max_seqlen_k)``: FA4's static FP8 varlen
    signature; ``attention`` / ``attention_paged``: ``_kernels.Kernels``'; ``quant(x [M, N] bf16, inv_scale) ->
    float8_e4m3fn [M, N]``, a new tensor."""

    name: str
    fused: Callable
    attention: Callable
    attention_paged: Callable
    quant: Callable


def fp8_static_status(device) -> tuple[bool, str]:
    """Whether FA4's SM90 static FP8 epilogue is there for ``device``: ``(ok, why)``."""
    fused = formats.fa4_fp8_kernels(device).fused["fp8_static"]
    return (False, fused.removeprefix("n/a: ")) if isinstance(fused, str) else (True, "")


def fa4_fp8_static_kernels(device) -> Fp8StepKernels:
    """FA4 (bf16 varlen and paged, the SM90 static FP8 epilogue) and the compiled native-form quant (check
    :func:`fp8_static_status` first)."""
    fused = formats.fa4_fp8_kernels(device).fused["fp8_static"]
    if isinstance(fused, str):
        raise RuntimeError(f"FA4's static FP8 epilogue does not run here: {fused}")
    bf16 = fa4_kernels()
    quant = torch.compile(formats.native_static, fullgraph=True) if COMPILE_QUANT else formats.native_static
    return Fp8StepKernels("fa4", fused, bf16.attention, bf16.attention_paged, quant)


def reference_fp8_static_kernels() -> Fp8StepKernels:
    """PyTorch stand-ins on any device (``fused``: ``quantize_static`` of the float32 attention rounded to bf16, the
    FA4 contract), the native form eagerly."""
    ref = reference_kernels()
    return Fp8StepKernels("reference", formats.reference_fp8_kernels().fused["fp8_static"], ref.attention,
                          ref.attention_paged, formats.native_static)


class Fp8Out:
    """One variant's output of one layer: ``buffer`` (float8_e4m3fn ``[T, N]``, zeros, the fused kernel's rows) and
    ``parts`` (first row -> the new tensor a quant call returned for the rows from there)."""

    def __init__(self, t: int, n: int, device) -> None:
        self.buffer = torch.zeros(t, n, dtype=fp8.FP8, device=device)
        self.parts: dict[int, torch.Tensor] = {}

    def bytes(self) -> torch.Tensor:
        """uint8 ``[T, N]``: the buffer with every part laid over its rows."""
        out = self.buffer.view(torch.uint8).clone()
        for row, x in self.parts.items():
            out[row:row + x.shape[0]] = x.view(torch.uint8)
        return out


class Fp8StepRunner(StepRunner):
    """:class:`_serving_steps.StepRunner` with the static FP8 output (module docstring). ``split_free``: the model's
    layer computes decode and prefill rows apart anyway (MLA), so the pass splits a mixed call whatever
    ``FUSION_PASS_VLLM_SPLIT_MIXED`` says."""

    FORMAT = "fp8_static"
    VARIANTS = ("unfused", "unfused_split", "fused", "fused_all", "unfused_paged", "pass_on", "varlen_bf16")
    ABSENT = {"fused_paged": NO_FP8_PAGED}
    CHECKED_PAIRS = (("fused_all", "unfused"), ("fused", "unfused_split"))
    INFO_PAIRS = (("fused", "unfused"), ("unfused_paged", "unfused"))

    def __init__(self, kernels: Fp8StepKernels, dims: AttnDims, layers: int, slab_rows: int, device, *, seed: int = 0,
                 page_size: int = DEFAULT_PAGE_SIZE, split_free: bool = True, amax: float = AMAX):
        super().__init__(kernels, dims, layers, slab_rows, device, seed=seed, page_size=page_size)
        self.split_free = split_free
        self.out_scale, self.inv_scale = formats.static_scale(amax, self.device)

    def warm_quant(self, max_tokens: int) -> None:
        """Compile the quant before the first step: a call of 2 rows, then ``max_tokens`` rows (Dynamo makes the
        token dimension dynamic at its second size; the generated kernel is tuned at that size, as vLLM's at
        ``max_num_batched_tokens``), then 1 row (a size Dynamo specializes)."""
        n = self.dims.heads * self.dims.dv
        for rows in dict.fromkeys((2, max(max_tokens, 2), 1)):
            self.kernels.quant(torch.zeros(rows, n, dtype=torch.bfloat16, device=self.device), self.inv_scale)

    def pass_on_choice(self, layout: StepLayout) -> dict:
        """What the pass does with this step's static FP8 call: ``{"plan", "fused", "variant", "why"}`` (module
        docstring). A mixed step's plan is the split class the pass would ask the policy about:
        ``mixed_split_free`` (MLA) or ``mixed_split`` (a standard layer, split only under
        ``FUSION_PASS_VLLM_SPLIT_MIXED=on``); the one-call class does not arise (no FP8 paged launch)."""
        if layout.decodes and not layout.prefill_tokens:
            return {"plan": "decode", "fused": False, "variant": "unfused_paged",
                    "why": "decode rows only: the pass never fuses them"}
        if not layout.decodes:
            fuse, why = policy.verdict(self.device, "prefill")
            return {"plan": "prefill", "fused": bool(fuse), "variant": "fused_all" if fuse else "unfused_paged",
                    "why": why}
        no_one_call = "no one fused call (no FP8 paged launch)"
        if not self.split_free and settings.split_mixed() == "off":
            return {"plan": "mixed_split", "fused": False, "variant": "unfused_paged",
                    "why": f"{no_one_call}; a standard layer's mixed call is not split "
                           f"({settings.SPLIT_MIXED_ENV}=off, the default): unfused"}
        plan = "mixed_split_free" if self.split_free else "mixed_split"
        fuse, why = policy.verdict(self.device, plan)
        return {"plan": plan, "fused": bool(fuse), "variant": "fused" if fuse else "unfused_paged",
                "why": f"{no_one_call}; the split: {why}"}

    def prepare(self, layout: StepLayout, choice: dict | None = None) -> tuple[dict, Callable[[], None], dict]:
        """As :meth:`StepRunner.prepare`; ``outs[name]`` holds per layer an :class:`Fp8Out`."""
        self.gather(layout)
        qs, fresh = self.new_queries(layout)
        n = self.dims.heads * self.dims.dv
        outs = {name: [Fp8Out(layout.tokens, n, self.device) for _ in range(self.layers)] for name in self.VARIANTS}
        variants = self._variants(layout, qs, outs, self.pass_on_choice(layout) if choice is None else choice)
        return variants, fresh, outs

    def bytes_equal(self, outs: dict) -> dict:
        pairs = self.CHECKED_PAIRS + self.INFO_PAIRS
        full = {name: [o.bytes() for o in outs[name]] for name in dict.fromkeys(v for pair in pairs for v in pair)}
        return {f"{x}=={y}": all(torch.equal(a, b) for a, b in zip(full[x], full[y])) for x, y in pairs}

    def _variants(self, layout: StepLayout, qs: list, outs: dict, choice: dict) -> dict:
        t, d, n = layout.tokens, layout.decodes, self.dims.heads * self.dims.dv
        cu_q, cu_k, qlens, klens, tk, paged = self.call_args(layout)
        k = self.kernels
        attn, attn_paged, fused, quant, inv, sc = (k.attention, k.attention_paged, k.fused, k.quant, self.inv_scale,
                                                   self.scale)
        layers = list(zip(qs, self.k_ws, self.v_ws))

        def unfused(outs_):
            for (q, kk, v), o in zip(layers, outs_):
                out = attn(q, kk[:tk], v[:tk], cu_q, max(qlens), causal=True, softmax_scale=sc, cu_seqlens_k=cu_k,
                           max_seqlen_k=max(klens))
                o.parts[0] = quant(out.view(t, n), inv)

        def varlen_bf16(outs_):  # FA4 bf16 alone: no quant (the fused call's floor); writes nothing
            for q, kk, v in layers:
                attn(q, kk[:tk], v[:tk], cu_q, max(qlens), causal=True, softmax_scale=sc, cu_seqlens_k=cu_k,
                     max_seqlen_k=max(klens))

        def unfused_paged(outs_):  # vLLM's FLASH_ATTN + QuantFP8: one launch over every row, the cache in place
            for q, kp, vp, o in zip(qs, self.k_pages, self.v_pages, outs_):
                o.parts[0] = quant(attn_paged(q, kp, vp, **paged).view(t, n), inv)

        def fused_all(outs_):
            for (q, kk, v), o in zip(layers, outs_):
                fused(q, kk[:tk], v[:tk], cu_seqlens=cu_q, max_seqlen=max(qlens), softmax_scale=sc, causal=True,
                      output=o.buffer, inv_scale=inv, nan_to_max=False, cu_seqlens_k=cu_k, max_seqlen_k=max(klens))

        cu_qd, cu_kd = cu_q[:d + 1], cu_k[:d + 1]
        cu_qp, cu_kp = cu_q[d:], cu_k[d:]
        kd = layout.cu_k[d]
        prefills = d < len(qlens)

        def decode_rows(q, kk, v, o):  # the decode sub-batch, the same calls in `fused` and `unfused_split`
            out = attn(q[:d], kk[:kd], v[:kd], cu_qd, 1, causal=True, softmax_scale=sc, cu_seqlens_k=cu_kd,
                       max_seqlen_k=max(klens[:d]))
            o.parts[0] = quant(out.view(d, n), inv)

        def unfused_split(outs_):
            for (q, kk, v), o in zip(layers, outs_):
                if d:
                    decode_rows(q, kk, v, o)
                if prefills:  # the offsets of `fused`'s fused call: rows [D, T) of FA4's output are written
                    out = attn(q, kk[:tk], v[:tk], cu_qp, max(qlens[d:]), causal=True, softmax_scale=sc,
                               cu_seqlens_k=cu_kp, max_seqlen_k=max(klens[d:]))
                    o.parts[d] = quant(out.view(t, n)[d:], inv)

        def split(outs_):
            for (q, kk, v), o in zip(layers, outs_):
                if d:
                    decode_rows(q, kk, v, o)
                if prefills:
                    fused(q, kk[:tk], v[:tk], cu_seqlens=cu_qp, max_seqlen=max(qlens[d:]), softmax_scale=sc,
                          causal=True, output=o.buffer, inv_scale=inv, nan_to_max=False, cu_seqlens_k=cu_kp,
                          max_seqlen_k=max(klens[d:]))

        bodies = {"unfused": unfused, "unfused_split": unfused_split, "fused": split, "fused_all": fused_all,
                  "unfused_paged": unfused_paged, "varlen_bf16": varlen_bf16}
        bodies["pass_on"] = bodies[choice["variant"]]  # the chosen variant's calls, into pass_on's own outputs
        return {name: _bound(name, bodies[name], outs[name]) for name in self.VARIANTS}
