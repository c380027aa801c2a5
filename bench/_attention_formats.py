"""The FP8 output formats of bench/attention.py: their kernels, the compiled baseline quant, timed paths and checks.

Formats (names of :data:`fusion_pass.formats.FORMATS`): ``fp8_static`` (``float8_e4m3fn [T, N]`` under one
float32 scale, ``N = H * Dv``) and ``fp8_group128`` (``float8_e4m3fn [T, N]`` and row-major float32 scales
``[T, N / 128]``, one per row and 128 columns). Per format and shape the paths, each writing the format's bytes of
the causal attention output, token-major ``[T, N]``:

* ``fused``: FA4's SM90 forward with the FP8 epilogue (``fusion_pass.kernels.fa4.sm90_fp8``
  ``fa4_attention_fp8_static_varlen`` with the inverse scale and NaN -> NaN, as the native form writes it, or
  ``fa4_attention_fp8_group_varlen`` with float scales and ``x * (1 / s)``) into preallocated buffers;
* ``triton_fused``: the Triton kernel's FP8 epilogue (``launchers.flash_attention_fp8_static_varlen`` /
  ``flash_attention_fp8_group_varlen``) into its own buffers;
* ``fa4``: FA4 bf16 alone, shared with NVFP4 (one measurement per shape and pass);
* ``fa4_quant``: FA4 bf16, then the quant a vLLM user runs: vLLM's default ``custom_ops="none"`` has Inductor
  compile ``QuantFP8``'s native torch form, so the baseline is :func:`native_static` / :func:`native_group`
  compiled by ``torch.compile(fullgraph=True, dynamic=False)`` per shape (new output tensors per call, as the
  compiled graph allocates them);
* ``cudnn_quant``: torch SDPA with the cuDNN backend on ``[B, H, L, D]`` views of the token-major tensors (the
  layout that won the NVFP4 runs; its output's token-major view is free), then the same compiled quant.

Checks, on the first call of each path (input set 0): the compiled quant's bytes equal the reference quantizer's
(``fusion_pass.fp8.quantize_static`` / ``quantize_group``) of the same bf16 input, for FA4's and cuDNN's outputs;
``fused`` equals the reference quantizer of FA4's bf16 output byte for byte (the kernels' contract); ``triton_fused``
(its own float32 output quantized) and ``cudnn_quant`` (another attention kernel) within a bound of FA4's output.
"""

from __future__ import annotations

import importlib
from typing import Callable, NamedTuple

import torch

from fusion_pass import fp8
from fusion_pass.formats import by_name

from _attention_paths import Path, ShapeInputs, _rotating, causal_mask, sdpa_backend
from _attention_shapes import Shape

__all__ = ["ALL_FORMATS", "FP8_FORMATS", "FP8_PATHS", "Fp8Kernels", "build_fp8_paths", "check_fp8", "compiled_quant",
           "fa4_fp8_kernels", "fp8_note", "native_group", "native_static", "new_fp8_record", "parse_formats",
           "reference_fp8_kernels", "reset_compiled", "static_scale"]

ALL_FORMATS = ("nvfp4", "fp8_static", "fp8_group128")
FP8_FORMATS = ALL_FORMATS[1:]
FP8_PATHS = ("fused", "triton_fused", "fa4", "fa4_quant", "cudnn_quant")
FA4_FP8_MODULES = {"fa4_attention_fp8_static_varlen": ("fusion_pass.kernels.fa4.sm90_fp8",
                                                     "fusion_pass.kernels.fa4.sm90"),
                   "fa4_attention_fp8_group_varlen": ("fusion_pass.kernels.fa4.sm90_fp8",)}
COMPILE_QUANT = True
"""torch.compile the baseline quant (False: run it eagerly; for tests of other logic)."""
ATTENTION_REL_TOL = 2.0**-7
"""The bound check's allowance for two attention kernels: their outputs may differ by this times (|x| + rms(x))."""


def parse_formats(text: str | None) -> tuple[str, ...]:
    """``--formats``: a comma list of :data:`ALL_FORMATS` or ``all`` (None: ``nvfp4``), in table order; ValueError
    naming the option and the choices otherwise."""
    names = [w.strip() for w in (text or "nvfp4").split(",") if w.strip()]
    if not names:
        raise ValueError(f"--formats: no format given; choose from {', '.join(ALL_FORMATS)}, all")
    if "all" in names:
        return ALL_FORMATS
    for w in names:
        if w not in ALL_FORMATS:
            raise ValueError(f"--formats: unknown format {w!r}; choose from {', '.join(ALL_FORMATS)}, all")
        by_name(w)  # the table's name (an ArgumentError if the package dropped it)
    return tuple(f for f in ALL_FORMATS if f in names)


class Fp8Kernels(NamedTuple):
    """The FP8 writers a run times, per format name: ``fused[fmt]`` (FA4's signature, see the module docstring) or
    a string ``"n/a: <reason>"`` where this tree or device has none; ``triton[fmt]`` (the launchers' signature)."""

    name: str
    fused: dict
    triton: dict


def _load(name: str) -> Callable | str:
    """``name`` from the first of its modules that has it, or ``"n/a: <why>"``."""
    reasons = []
    for module in FA4_FP8_MODULES[name]:
        try:
            fn = getattr(importlib.import_module(module), name, None)
        except Exception as exc:  # noqa: BLE001 - a tree without the module or FA4's DSL: a reason
            reasons.append(f"{module} does not import ({type(exc).__name__}: {' '.join(str(exc).split())})")
            continue
        if fn is not None:
            return fn
        reasons.append(f"{module} has no {name}")
    return "n/a: " + "; ".join(reasons)


def fa4_fp8_kernels(device) -> Fp8Kernels:
    """FA4's SM90 FP8 epilogues (imported here, ``sm90_fp8`` first, the static one from ``sm90`` while the move has
    not landed) and the Triton FP8 launchers; a fused entry is ``"n/a: ..."`` off SM90 or when missing."""
    from fusion_pass.kernels import launchers
    from fusion_pass.kernels.fa4 import forward

    generation = forward.fa4_generation(torch.device(device))
    fused = {"fp8_static": _load("fa4_attention_fp8_static_varlen"),
             "fp8_group128": _load("fa4_attention_fp8_group_varlen")}
    if generation != "sm90":
        fused = {f: f"n/a: FA4's FP8 epilogues are SM90 kernels; this GPU runs {generation or 'no FA4 kernel'}"
                 for f in fused}
    triton = {"fp8_static": launchers.flash_attention_fp8_static_varlen,
              "fp8_group128": launchers.flash_attention_fp8_group_varlen}
    return Fp8Kernels("fa4", fused, triton)


def _ref_rows(q, k, v, cu_seqlens, softmax_scale, causal, cu_seqlens_k):
    """FA4's contract on any device: float32 attention rounded to bf16, ``[T, H*Dv]``, and the rows it covers."""
    from fusion_pass.kernels import reference

    out = reference.varlen_attention(q, k, v, cu_seqlens, causal, softmax_scale, cu_seqlens_k)[0].to(q.dtype)
    return out.reshape(q.shape[0], -1), int(cu_seqlens[0]), int(cu_seqlens[-1])


def _ref_fused_static(q, k, v, *, cu_seqlens, max_seqlen, softmax_scale, causal, output, inv_scale, nan_to_max=True,
                      cu_seqlens_k=None, max_seqlen_k=None):
    x, a, b = _ref_rows(q, k, v, cu_seqlens, softmax_scale, causal, cu_seqlens_k)
    rule = fp8.NaNRule.POSITIVE_MAX if nan_to_max else fp8.NaNRule.NAN
    output[a:b].view(torch.uint8).copy_(fp8.quantize_static(x[a:b], inv_scale, nan=rule).view(torch.uint8))


def _ref_fused_group(q, k, v, *, cu_seqlens, max_seqlen, softmax_scale, causal, output, scales, ue8m0=False,
                     divide=False, cu_seqlens_k=None, max_seqlen_k=None):
    x, a, b = _ref_rows(q, k, v, cu_seqlens, softmax_scale, causal, cu_seqlens_k)
    got, got_scales = fp8.quantize_group(x[a:b], ue8m0=ue8m0, divide=divide)
    output[a:b].view(torch.uint8).copy_(got.view(torch.uint8))
    scales[a:b].copy_(got_scales)


def _ref_triton_static(q, k, v, *, cu_seqlens, max_seqlen, softmax_scale, causal, output, scale, scale_is_inverse=False,
                       nan=fp8.NaNRule.POSITIVE_MAX, cu_seqlens_k=None, max_seqlen_k=None):
    from fusion_pass.kernels.api_fp8 import attention_fp8_static

    attention_fp8_static(q, k, v, cu_seqlens, max_seqlen, scale=scale, scale_is_inverse=scale_is_inverse, nan=nan,
                         causal=causal, softmax_scale=softmax_scale, cu_seqlens_k=cu_seqlens_k,
                         max_seqlen_k=max_seqlen_k, output=output, backend="reference")


def _ref_triton_group(q, k, v, *, cu_seqlens, max_seqlen, softmax_scale, causal, output, output_scales, ue8m0=False,
                      divide=False, cu_seqlens_k=None, max_seqlen_k=None):
    from fusion_pass.kernels.api_fp8 import attention_fp8_group

    attention_fp8_group(q, k, v, cu_seqlens, max_seqlen, ue8m0=ue8m0, divide=divide, causal=causal,
                        softmax_scale=softmax_scale, cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k,
                        output=output, scales=output_scales, backend="reference")


def reference_fp8_kernels() -> Fp8Kernels:
    """PyTorch stand-ins with the same contracts: ``fused`` quantizes the bf16-rounded float32 attention,
    ``triton`` the float32 one (``kernels.attention_fp8_*`` with ``backend="reference"``)."""
    return Fp8Kernels("reference", {"fp8_static": _ref_fused_static, "fp8_group128": _ref_fused_group},
                      {"fp8_static": _ref_triton_static, "fp8_group128": _ref_triton_group})


# ---------------------------------------------------------------------------
# the baseline quant: vLLM QuantFP8's native form, compiled
# ---------------------------------------------------------------------------


def native_static(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """``float8_e4m3fn [T, N]`` of bf16 ``x [T, N]`` and a float32 one-element ``inv_scale``: QuantFP8's native
    static form, ``(x.float() * inv).clamp(-448, 448).to(float8_e4m3fn)`` (a NaN stays NaN, ``0x7F``)."""
    return (x.float() * inv_scale).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(fp8.FP8)


def native_group(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8_e4m3fn [T, N], float32 scales [T, N / 128])`` of bf16 ``x [T, N]``: per row and 128 columns the
    float32 amax, ``s = max(1e-10, amax) / 448``, ``q = fp8(clamp(x * (1 / s), -448, 448))`` (vLLM 0.33 / 0.34).

    ``s`` and ``1 / s`` are computed in float64 and rounded to float32, which gives the IEEE float32 quotients the
    reference and vLLM's CUDA op use whatever Inductor does with a division: in float32 it would multiply by the
    rounded reciprocal of the constant 448 and compile ``/`` to Triton's approximate ``div.full``; in float64 both
    forms (``* (1 / 448)`` and a correctly rounded quotient) round to the IEEE float32 quotient for every float32
    ``amax`` (checked over a whole binade) and ``s``. Per group, not per element: the per-element work is the
    native form's."""
    t, n = x.shape
    g = x.float().reshape(t, n // fp8.GROUP_SIZE, fp8.GROUP_SIZE)
    amax = g.abs().amax(dim=-1, keepdim=True).clamp(min=fp8.SCALE_EPS)
    s = (amax.double() / fp8.E4M3_MAX).float()
    r = (1.0 / s.double()).float()
    q = (g * r).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(fp8.FP8)
    return q.reshape(t, n), s.reshape(t, n // fp8.GROUP_SIZE)


def compiled_quant(fmt: str) -> Callable:
    """A fresh ``torch.compile(fullgraph=True, dynamic=False)`` of the format's native quant (one per shape: the
    caller resets Dynamo per shape, so no recompile limit is reached), or the eager function without
    :data:`COMPILE_QUANT`."""
    fn = native_static if fmt == "fp8_static" else native_group
    return torch.compile(fn, fullgraph=True, dynamic=False) if COMPILE_QUANT else fn


# ---------------------------------------------------------------------------
# paths and checks
# ---------------------------------------------------------------------------


def static_scale(amax: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, inv_scale)``, float32 ``[1]``: a calibrated checkpoint's ``amax / 448`` and its IEEE reciprocal."""
    scale = torch.full((1,), amax / fp8.E4M3_MAX, dtype=torch.float32, device=device)
    return scale, fp8.reciprocal(scale)


def build_fp8_paths(kernels: Fp8Kernels, attention: Callable, fmt: str, shape: Shape, sets: list[ShapeInputs],
                    inv_scale: torch.Tensor, device) -> dict[str, Path | str]:
    """The paths of ``fmt`` at ``shape`` over the input ``sets`` (``fa4`` excluded: the caller's shared one; FA4
    bf16 is ``attention``, ``Kernels.attention``'s signature), by name; a fused writer missing here gives its
    ``"n/a: ..."`` string instead of a path. Each call returns ``(output, scales or None, the bf16 attention output
    [T, N] or None)``. Call :func:`reset_compiled` once per shape before."""
    lay, b = shape.layout, shape.batch
    t, n = shape.tokens, lay.heads * lay.dv
    sm = lay.dqk**-0.5
    group = fmt != "fp8_static"
    mask = causal_mask(b.q_len, b.context + b.q_len, device) if b.context else None
    quant = compiled_quant(fmt)
    run_quant = (lambda x: quant(x)) if group else (lambda x: quant(x, inv_scale))
    fused, triton = kernels.fused[fmt], kernels.triton[fmt]

    def buffers():
        out = torch.empty(t, n, dtype=fp8.FP8, device=device)
        return out, (fp8.group_scale_buffer(t, n, device=device) if group else None)

    def varlen(x: ShapeInputs):
        return dict(cu_seqlens=x.cu_seqlens, max_seqlen=x.max_seqlen, softmax_scale=sm, causal=True,
                    cu_seqlens_k=x.cu_seqlens_k, max_seqlen_k=x.max_seqlen_k)

    def fused_call(x: ShapeInputs, out, scales):
        if group:
            fused(x.q, x.k, x.v, output=out, scales=scales, ue8m0=False, divide=False, **varlen(x))
        else:
            fused(x.q, x.k, x.v, output=out, inv_scale=inv_scale, nan_to_max=False, **varlen(x))
        return out, scales, None

    def triton_call(x: ShapeInputs, out, scales):
        if group:
            triton(x.q, x.k, x.v, output=out, output_scales=scales, ue8m0=False, divide=False, **varlen(x))
        else:
            triton(x.q, x.k, x.v, output=out, scale=inv_scale, scale_is_inverse=True, nan=fp8.NaNRule.NAN,
                   **varlen(x))
        return out, scales, None

    def with_quant(x16: torch.Tensor):
        got = run_quant(x16)
        return (*got, x16) if group else (got, None, x16)

    def fa4_quant(x: ShapeInputs):
        return with_quant(attention(x.q, x.k, x.v, x.cu_seqlens, x.max_seqlen, causal=True, softmax_scale=sm,
                                    cu_seqlens_k=x.cu_seqlens_k, max_seqlen_k=x.max_seqlen_k).view(t, n))

    def cudnn_quant(x: ShapeInputs):
        q, k, v = x.dense["bshd"]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                               scale=sm, enable_gqa=lay.kv_heads != lay.heads)
        return with_quant(out.transpose(1, 2).reshape(t, n))

    def path(fn, *args, **kw) -> Path:
        return Path(_rotating([lambda x=x: fn(x, *args) for x in sets]), **kw)

    paths: dict[str, Path | str] = {}
    paths["fused"] = fused if isinstance(fused, str) else path(fused_call, *buffers())
    paths["triton_fused"] = path(triton_call, *buffers())
    paths["fa4_quant"] = path(fa4_quant)
    paths["cudnn_quant"] = path(cudnn_quant, context=sdpa_backend(device))
    return paths


def _equal(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    """Fraction of equal bytes (None when either is missing)."""
    if a is None or b is None:
        return None
    a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return (a == b).float().mean().item()


def _reference(fmt: str, x16: torch.Tensor, inv_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference quantizer's ``(output, scales or None)`` of bf16 ``x16 [T, N]`` (NaN -> NaN for the static
    form, as the native form and the fused call are asked to write it)."""
    if fmt == "fp8_static":
        return fp8.quantize_static(x16, inv_scale, nan=fp8.NaNRule.NAN), None
    return fp8.quantize_group(x16)


def _bound(fmt: str, got: tuple, x_ref: torch.Tensor, scale: torch.Tensor) -> dict:
    """``{"within_bound", "worst_over_bound"}``: the dequantized output against FA4's bf16 output ``x_ref``: the
    format's error bound plus :data:`ATTENTION_REL_TOL` (|x| + rms(x)) twice (two kernels' attention)."""
    x = x_ref.float()
    if fmt == "fp8_static":
        deq, bound = fp8.dequantize_static(got[0], scale), fp8.static_error_bound(x, scale)
    else:
        deq, bound = fp8.dequantize_group(got[0], got[1]), fp8.group_error_bound(x, got[1])
    bound = bound + 2 * ATTENTION_REL_TOL * (x.abs() + x.square().mean().sqrt())
    over = (deq - x).abs() / bound
    return {"within_bound": (over <= 1).float().mean().item(), "worst_over_bound": over.max().item()}


def check_fp8(fmt: str, results: dict[str, tuple], x_ref: torch.Tensor | None, scale: torch.Tensor,
              inv_scale: torch.Tensor) -> tuple[dict, list[str]]:
    """``(check, failures)`` of one format at one shape from the first call's ``results`` (path -> what its call
    returned, for the paths that ran) and FA4's bf16 output ``x_ref [T, N]`` of input set 0 (None: FA4 did not
    run): fractions of equal bytes (``output_equal``, ``scales_equal``) and the bound check; a failure is a byte
    check below 1 where bytes must be equal."""
    check, failures = {}, []
    for name in ("fa4_quant", "cudnn_quant"):  # the compiled quant against the reference on the same input
        if name in results:
            got = results[name]
            want = _reference(fmt, got[2], inv_scale)
            check[f"{name}_vs_reference"] = {"output_equal": _equal(got[0], want[0]),
                                             "scales_equal": _equal(got[1], want[1])}
    if x_ref is not None:
        want = _reference(fmt, x_ref, inv_scale)
        if "fused" in results:  # equal bytes by contract
            check["fused"] = {"output_equal": _equal(results["fused"][0], want[0]),
                              "scales_equal": _equal(results["fused"][1], want[1])}
        for name in ("triton_fused", "cudnn_quant"):  # other attention kernels: equal bytes are rounding; a bound
            if name in results:
                got = results[name]
                check[name] = {"output_equal": _equal(got[0], want[0]), "scales_equal": _equal(got[1], want[1]),
                               **_bound(fmt, got, x_ref, scale)}
    for name in ("fa4_quant_vs_reference", "cudnn_quant_vs_reference", "fused"):
        for key, value in check.get(name, {}).items():
            if value is not None and value < 1.0:
                what = "quantize(FA4 bf16)" if name == "fused" else "the reference quantizer's"
                failures.append(f"{fmt} {name.replace('_vs_reference', '')}: {value:.6f} of the {key.split('_')[0]} "
                                f"bytes equal {what}")
    return check, failures


def reset_compiled() -> None:
    """Dynamo's caches cleared before a shape's quants are compiled (each shape compiles its own; the per-code
    recompile limit is never reached)."""
    if COMPILE_QUANT:
        torch._dynamo.reset()


SHAPE_KEYS = ("label", "layout", "kind", "heads", "kv_heads", "dqk", "dv", "batch", "q_len", "context", "tokens",
              "keys", "flops", "causal", "dtype", "input_sets")


def new_fp8_record(shape_record: dict, fmt: str, passes: int) -> dict:
    """The JSON record of one format at one shape before measurement (the shape's fields from the NVFP4 record)."""
    return {**{k: shape_record[k] for k in SHAPE_KEYS}, "format": fmt, "scale": None, "errors": {}, "check": {},
            "check_failures": [], "first_call_s": {}, "timing_notes": {}, "calls_per_graph": {},
            "ms": {p: [None] * passes for p in FP8_PATHS}, "host_us": {p: [None] * passes for p in FP8_PATHS},
            "samples_ms": {p: [] for p in FP8_PATHS}}


def fp8_note(cuda: bool) -> str:
    """How the FP8 paths are run and checked (the JSON's ``fp8_note``, the markdown's "FP8 paths" line)."""
    if not cuda:
        return ("CPU: the reference stand-ins (fused: the reference quantizer of float32 attention rounded to bf16; "
                "triton_fused: kernels.attention_fp8_* with backend='reference', the float32 attention quantized); "
                "cuDNN replaced by SDPA's math backend; the baseline quant " + ("compiled by Inductor for the CPU"
                if COMPILE_QUANT else "eager") + "; bytes checked as on the GPU")
    return ("fused: FA4's SM90 FP8 epilogue (fusion_pass.kernels.fa4.sm90_fp8) into preallocated buffers (static: "
            "the IEEE inverse of scale = amax / 448 of the bf16 output, NaN -> NaN as the native form; groups: float32 "
            "row-major scales, x * (1 / s)); triton_fused: the Triton FP8 epilogue into preallocated buffers; "
            "fa4 / cudnn: FA4 bf16 / cuDNN SDPA then vLLM QuantFP8's native form (custom_ops='none') compiled by "
            "torch.compile(fullgraph=True, dynamic=False) per shape, new output tensors per call; its host time "
            "includes the compiled function's guard check; the group form computes the per-group scale and its "
            "reciprocal in float64 rounded to float32 (the IEEE float32 quotients of the reference); cuDNN on "
            "[B, H, L, D] views only (the layout that won the NVFP4 runs). Checked on the first call: the compiled "
            "quant's bytes == the reference quantizer's (FA4 and cuDNN outputs), fused == the reference quantizer of "
            "FA4's bf16 output, byte for byte; triton_fused and cuDNN within the format's error bound + "
            f"2 * {ATTENTION_REL_TOL:g} * (|x| + rms(x)) of FA4's output")
