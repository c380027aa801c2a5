"""One call of the project's attention ops that writes static per-tensor FP8 (:data:`fusion_pass.formats.FP8_STATIC`):
the guard's decision for that format, then its row plan (:mod:`fusion_pass.runtime.fp8_rows`) or the exact unfused
computation; counted once it has completed.

:func:`fusion_pass.runtime.engine.attention_call.run` hands such a call here (the format is read once per call from
the buffers: :func:`fusion_pass.formats.call_format`). The op (:mod:`fusion_pass.ops.attention`) has checked every
argument: ``output`` float8_e4m3fn, ``T * H*Dv`` elements, contiguous; ``output_scale`` float32 ``[1]`` (the
checkpoint's scale); no ``output_block_scale``.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from fusion_pass.formats import FP8_STATIC, OutputFormat
from fusion_pass.runtime import backends, counters, fp8_rows, guard

__all__ = ["run"]


def run(impl, inputs: tuple, spec, output: Tensor, output_scale: Tensor, output_format: OutputFormat, *,
        layer: guard.LayerShape, attention: Callable[..., Tensor], layer_name: str | None = None) -> None:
    """One static-FP8 attention call of ``impl`` (an MLA or standard runtime) on ``inputs`` for the batch ``spec``.

    :func:`fusion_pass.runtime.guard.decide` for ``output_format`` (the layer's ``layer`` shape) picks the rows,
    with the reasons of an NVFP4 call (a backend without a kernel of the format is refused, its reason naming the
    format; prefills with cached context beyond the workspace bound are not fused: ``chunked_prefill``). The fused
    rows run the backend's FP8 kernel through :func:`fusion_pass.runtime.fp8_rows.run_on_prefill_fp8_static`
    (attention quantized from float32); the others, or every row of a refused call, exactly the unfused
    computation: ``attention(impl, inputs, spec, q)`` (the unfused path's attention,
    :func:`fusion_pass.runtime.engine.attention_call._attention`), rounded to the query dtype, then
    :func:`fusion_pass.fp8.quantize_static` under ``1 / output_scale`` (vLLM's NaN rule: +448). Counted under
    ``layer_name`` with the decision's ``format``; the layer's cache is rolled back should the call fail part-way.
    """
    if output_format is not FP8_STATIC:
        raise ValueError(f"fp8_call.run: output_format must be {FP8_STATIC.name}, got {output_format.name}")
    q = inputs[0]
    decision = guard.decide(guard.BatchRows.from_spec(spec), layer, output_format=output_format)
    with impl.cache.transaction():
        if decision.fused:
            fp8_rows.run_on_prefill_fp8_static(backends.get_backend(decision.backend), impl, inputs, spec, output,
                                               output_scale)
        else:
            fp8_rows.write_fp8_static(attention(impl, inputs, spec, q), q.dtype, output, output_scale)
    counters.record(decision, layer_name)
