"""The kernels' validated public entry points: attention with half-precision or NVFP4 output, NVFP4
quantization and the NVFP4 attention-state merge. Every argument is checked before anything runs.

* :func:`attention` -> ``[T, H, Dv]`` in the query dtype;
* :func:`attention_nvfp4` -> ``(packed uint8 [T, H*Dv/2], scales float8_e4m3fn
  [round_up(T, 128), round_up(H*Dv/16, 4)])`` in the layout of docs/nvfp4.md;
* :func:`attention_with_lse` -> ``(out float32 [T, H, Dv], lse float32 [T, H])``:
  partial results (e.g. over a chunk of cached context) to merge by their
  log-sum-exps;
* :func:`quantize` -> NVFP4 bytes equal to :func:`fusion_pass.nvfp4.quantize` (the Triton kernel for
  CUDA tensors, the reference elsewhere);
* :func:`quantize_rows_into`: the same quantizer writing ``M`` rows at a row
  offset into the buffers of a ``T``-row matrix, touching no other byte
  (:func:`fusion_pass.nvfp4.zero_scale_padding` clears the padding rows' scales once all rows are written);
* :func:`merge_attention_nvfp4`: two partial attentions merged by log-sum-exp, written as NVFP4 rows;
* FP8 output (:mod:`.api_fp8`): :func:`~fusion_pass.kernels.api_fp8.attention_fp8_static`,
  :func:`~fusion_pass.kernels.api_fp8.attention_fp8_group`.

The run time's backends call the same kernels unvalidated through :mod:`fusion_pass.kernels.launchers`.

Validation (``validate_values=``). Types, shapes, dtypes, strides, devices and host values (``max_seqlen``,
``row_start``, ...) are checked on the host, always. The values held by tensors (``cu_seqlens``,
``cu_seqlens_k``, the global scale) live on the device, and reading them back on CUDA waits for every kernel
queued before the call (up to milliseconds); so by default (``"device"``) they are checked where they are: a
few small kernels compute the condition and :func:`torch._assert_async` asserts it, nothing is read back.
On the CPU a bad value raises :class:`~fusion_pass.nvfp4.ArgumentError` at once; on CUDA it surfaces at the
next synchronization as a device-side assertion, which CUDA makes fatal to the process's CUDA context, and
whose message does not name the value. ``validate_values=True`` reads the values back instead (one
synchronization per call) and raises an ``ArgumentError`` naming them before any kernel runs: for
debugging, or where a bad value must not end the process. ``validate_values=False`` checks no value (a
wrong ``cu_seqlens`` then gives wrong rows or an out-of-bounds access). Where a result needs a value on the
host it is still read: the ``reference`` backend reads ``cu_seqlens`` back to slice the sequences, and with
``validate_values=True`` a ``max_seqlen_k`` left None is computed from ``cu_seqlens_k`` (otherwise the
kernels bound the key lengths by ``Tk``).

Kernels take tensors and return tensors: nothing here knows of batches, guards or the run
time's backends (who picks a kernel for a layer lives above, in :mod:`fusion_pass.runtime`).

Shapes: ``q [T, H, Dqk]``, ``k [Tk, Hkv, Dqk]``, ``v [Tk, Hkv, Dv]`` (token-major,
sequences packed along ``T``), ``cu_seqlens`` int32 ``[B + 1]`` with
``0 = c0 <= c1 <= ... <= cB = T``, ``max_seqlen >= max(c[i+1] - c[i])``.
Keys/values are the queries' own tokens (``Tk = T``) unless ``cu_seqlens_k``
int32 ``[B + 1]`` (``0 = ck0 <= ... <= ckB = Tk``) delimits them in a separate
packed workspace: sequence ``b``'s ``Lq`` queries attend to its ``Lk`` keys, e.g.
cached context followed by the new tokens (chunked prefill). Causal attention is
then aligned to the end of the keys (bottom-right, FlashAttention's convention):
query ``i`` sees keys ``j <= i + (Lk - Lq)``, which needs ``Lk >= Lq``.

Backends of the attention entry points (``backend=``):

``triton``
    :mod:`fusion_pass.kernels.triton.flash_attention`: CUDA tensors, or CPU tensors
    under Triton's interpreter (``TRITON_INTERPRET=1``, tests only).
``fa4``
    FlashAttention-4 on SM90 (H100/H200) and SM100/SM110 (B200, GB200; needs the ``fa4``
    extra): ``attention`` and ``attention_with_lse`` are FA4's varlen forward, ``attention_nvfp4``
    FA4's kernel of that generation with our NVFP4 output stage (bytes equal to :func:`quantize`
    of ``attention``'s bf16/fp16 output; :mod:`fusion_pass.kernels.fa4.forward`). Head dims
    ``(D, Dv)`` in :func:`fusion_pass.kernels.fa4.forward.supported_head_dims`. The SM100 kernels
    were compiled here but never run (docs/blackwell.md).
``reference``
    float32 PyTorch attention per sequence, then (NVFP4) the reference
    quantizer. Any device.
``auto``
    ``fa4`` when available for the tensors (SM90 or SM100/SM110, FA4 importable,
    supported head dims), else ``triton`` for CUDA tensors, else ``reference``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fusion_pass import nvfp4
from fusion_pass.kernels import launchers, reference
from fusion_pass.kernels.checks import (
    assert_varlen_k_on_device,
    assert_varlen_on_device,
    check_causal,
    check_destination,
    check_lses,
    check_outs,
    check_qkv,
    check_scale_value,
    check_softmax_scale,
    check_validate_values,
    check_varlen,
    check_varlen_k,
)
from fusion_pass.kernels.choice import (
    MERGE_BACKENDS,
    QUANT_BACKENDS,
    check_backend_name,
    choose,
    choose_merge,
    triton_or_reference,
)
from fusion_pass.kernels.fa4.forward import fa4_attention_nvfp4_varlen, fa4_attention_varlen
from fusion_pass.nvfp4 import ArgumentError
from fusion_pass.nvfp4.checks import check_global_scale, check_rows_into, check_x, is_concrete

__all__ = [
    "attention",
    "attention_nvfp4",
    "attention_with_lse",
    "merge_attention_nvfp4",
    "quantize",
    "quantize_rows_into",
]


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_k: int | None = None,
    validate_values: bool | str = "device",
) -> Tensor:
    """Varlen (flash) attention with output in the query dtype.

    Args:
        q: float16/bfloat16 ``[T, H, Dqk]``; k: ``[Tk, Hkv, Dqk]``; v: ``[Tk, Hkv, Dv]``
            (same dtype and device, ``H % Hkv == 0``, unit stride along the head dim;
            ``Tk = T`` without ``cu_seqlens_k``).
        cu_seqlens: int32 ``[B + 1]`` on q's device: sequence ``b``'s queries are tokens
            ``[cu_seqlens[b], cu_seqlens[b+1])``.
        max_seqlen: at least the longest query sequence.
        causal: query ``i`` of a sequence of ``Lq`` queries and ``Lk`` keys sees keys
            ``j <= i + (Lk - Lq)`` of that sequence (``j <= i`` without ``cu_seqlens_k``).
        softmax_scale: default ``1 / sqrt(Dqk)``.
        backend: ``auto``, ``triton``, ``fa4`` or ``reference`` (module docstring).
        cu_seqlens_k: int32 ``[B + 1]`` on q's device, contiguous, rising from 0 to
            ``Tk``: sequence ``b``'s keys/values are rows ``[ck[b], ck[b+1])`` of k/v.
            Default: the queries' own tokens. With ``causal``, ``Lk >= Lq`` per sequence.
        max_seqlen_k: at least the longest key sequence (only with ``cu_seqlens_k``;
            default: computed from it with ``validate_values=True``, else ``Tk`` bounds it).
        validate_values: how the values of ``cu_seqlens`` / ``cu_seqlens_k`` are checked
            (their shapes, dtypes and devices always are, on the host): ``"device"`` (default)
            on their device, without reading them back (no synchronization; module docstring);
            ``True`` read back and named in the error (one synchronization on CUDA);
            ``False`` not at all.

    Returns:
        ``[T, H, Dv]`` in q's dtype.
    """
    fn = "attention"
    chosen, scale, max_seqlen_k = check_attention(
        fn, q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, backend, cu_seqlens_k, max_seqlen_k,
        validate_values=validate_values,
    )
    max_seqlen = int(max_seqlen)  # checked: an int, numpy's too
    if chosen == "triton":
        from fusion_pass.kernels.triton.flash_attention import flash_attention

        return flash_attention(q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=scale,
                               cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
    if chosen == "fa4":
        return fa4_attention_varlen(q, k, v, cu_seqlens, max_seqlen, causal=causal, softmax_scale=scale,
                                    cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
    return reference.varlen_attention(q, k, v, cu_seqlens, causal, scale, cu_seqlens_k)[0].to(q.dtype)


def attention_with_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    *,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    validate_values: bool | str = "device",
) -> tuple[Tensor, Tensor]:
    """Varlen attention in float32 with its log-sum-exp: a partial result to merge.

    Arguments and checks as :func:`attention`. Attention over disjoint key sets (context
    chunks, then the new tokens) combines exactly by the log-sum-exps
    (:func:`fusion_pass.kernels.reference.merge_attention`).

    Returns:
        ``(out, lse)``: ``out`` float32 ``[T, H, Dv]``; ``lse`` float32 ``[T, H]``,
        ``ln sum_j exp(scale * q.k_j)`` over the visible keys (``-inf``, with ``out`` 0,
        for a row that sees none). ``triton`` accumulates and writes float32; ``fa4``
        returns its output in q's dtype (converted here) and its LSE as a transposed view
        of its ``[H, T]`` buffer (strides ``(1, T)``: ``lse`` may be non-contiguous);
        ``reference`` is dense float32 attention per sequence.
    """
    fn = "attention_with_lse"
    chosen, scale, max_seqlen_k = check_attention(
        fn, q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, backend, cu_seqlens_k, max_seqlen_k,
        validate_values=validate_values,
    )
    max_seqlen = int(max_seqlen)  # checked: an int, numpy's too
    return launchers.attention_with_lse_varlen(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                     cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k, softmax_scale=scale,
                                     causal=causal, backend=chosen)



def check_attention(fn, q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, backend, cu_seqlens_k,
                    max_seqlen_k, *, global_scale=None, validate_values="device", format_checks=None,
                    chooser=choose) -> tuple[str, float, int | None]:
    """Every check of the attention entry points (``global_scale`` too when given; ``format_checks()``, an
    output format's own arguments, before the backend's availability; ``chooser`` picks the backend); returns
    ``(backend, softmax scale, max_seqlen_k)``. Shapes, dtypes, devices and host values first; then the values
    of the tensors as ``validate_values`` says (read back, or asserted on their device: last, so that any
    host-side mistake is reported before a kernel runs)."""
    check_validate_values(fn, validate_values)
    check_qkv(fn, q, k, v, separate_kv=cu_seqlens_k is not None)
    check_causal(fn, causal)
    lengths = check_varlen(fn, q, cu_seqlens, max_seqlen, validate_values)
    max_seqlen_k = check_varlen_k(fn, q, k, cu_seqlens, cu_seqlens_k, max_seqlen_k, causal, lengths,
                                  validate_values)
    check_softmax_scale(fn, softmax_scale)
    if global_scale is not None:
        check_global_scale(fn, global_scale, q.device, check_value=False)
        check_scale_value(fn, global_scale, validate_values)  # the caller's values before the backend's availability
    if format_checks is not None:
        format_checks()
    chosen = chooser(fn, backend, q, v)
    if global_scale is not None:  # NVFP4 output
        h, dv = q.shape[1], v.shape[2]
        if chosen != "reference" and dv % nvfp4.BLOCK_SIZE != 0:
            raise ArgumentError(f"{fn}: backend {chosen!r} needs v's head dim Dv divisible by 16, got {dv}")
        if (h * dv) % nvfp4.BLOCK_SIZE != 0:
            raise ArgumentError(f"{fn}: H * Dv must be divisible by 16, got {h} * {dv} = {h * dv}")
    if validate_values == "device":
        assert_varlen_on_device(fn, q, cu_seqlens, max_seqlen)
        assert_varlen_k_on_device(fn, k, cu_seqlens, cu_seqlens_k, max_seqlen_k, causal)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    return chosen, scale, max_seqlen_k


def attention_nvfp4(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    global_scale: Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_k: int | None = None,
    validate_values: bool | str = "device",
) -> tuple[Tensor, Tensor]:
    """Varlen attention written directly as NVFP4, quantized from the float32 result.

    Arguments as :func:`attention` (``cu_seqlens_k`` / ``max_seqlen_k`` / ``validate_values``
    included), plus ``global_scale``: float32, one positive finite element, on q's device
    (``448 * 6 / amax`` of the output, calibrated; its value checked as ``validate_values`` says).
    ``H * Dv`` must be divisible by 16 (``Dv`` itself for ``triton``/``fa4``,
    whose epilogues quantize one head at a time).

    Returns:
        ``(packed, scales)``: uint8 ``[T, H*Dv/2]`` (row = token, element
        ``h*Dv + d``; two e2m1 codes per byte, the even element in the low
        nibble) and float8_e4m3fn ``[round_up(T, 128), round_up(H*Dv/16, 4)]``
        in the 128x4 swizzled layout, padding zero.
    """
    fn = "attention_nvfp4"
    chosen, scale, max_seqlen_k = check_attention(
        fn, q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, backend, cu_seqlens_k, max_seqlen_k,
        global_scale=global_scale, validate_values=validate_values,
    )
    max_seqlen = int(max_seqlen)  # checked: an int, numpy's too
    t, h, _ = q.shape
    dv = v.shape[2]
    if chosen == "triton":
        from fusion_pass.kernels.triton.flash_attention import flash_attention_nvfp4

        return flash_attention_nvfp4(q, k, v, cu_seqlens, max_seqlen, global_scale, causal=causal, softmax_scale=scale,
                                     cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
    if chosen == "fa4":
        rows, cols = nvfp4.scale_shape(t, h * dv)
        packed = torch.empty((t, h * dv // 2), dtype=torch.uint8, device=q.device)
        scales = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=q.device)
        fa4_attention_nvfp4_varlen(
            q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, softmax_scale=scale, causal=causal,
            output=packed, output_scale=global_scale, output_block_scale=scales,
            cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k,
        )
        return packed, scales
    out = reference.varlen_attention(q, k, v, cu_seqlens, causal, scale, cu_seqlens_k)[0]
    return nvfp4.quantize(out.reshape(t, h * dv), global_scale, swizzled=True)


def quantize(x: Tensor, global_scale: Tensor, *, swizzled: bool = True,
             backend: str = "auto", validate_values: bool | str = "device") -> tuple[Tensor, Tensor]:
    """NVFP4-quantize ``x [..., K]``: :func:`fusion_pass.nvfp4.quantize`'s contract and bytes.

    Returns ``(packed uint8 [M, K/2], scales float8_e4m3fn)``, scales swizzled
    ``[round_up(M,128), round_up(K/16,4)]`` or linear ``[M, K/16]``.

    ``backend``: ``auto`` (the Triton kernel for concrete CUDA tensors when Triton imports; the
    reference for CPU, meta and fake tensors and while torch.compile traces), ``triton`` (CUDA
    tensors, or CPU tensors under Triton's interpreter), ``reference`` (plain PyTorch, any device).
    ``validate_values``: the global scale's value checked on its device without reading it back
    (``"device"``, the default: no synchronization), read back and named in the error (``True``) or not
    checked (``False``).
    """
    fn = "quantize"
    check_backend_name(fn, backend, QUANT_BACKENDS)
    check_validate_values(fn, validate_values)
    if backend == "auto" and not is_concrete(x):
        backend = "reference"
    check_x(fn, x, global_scale, check_value=False)
    check_scale_value(fn, global_scale, validate_values)  # the caller's values before the backend's availability
    chosen = triton_or_reference(fn, backend, x.device)
    if chosen == "reference":
        return nvfp4.quantize(x, global_scale, swizzled=swizzled)
    from fusion_pass.kernels.triton.quantize import quantize_launch

    return quantize_launch(x.reshape(-1, x.shape[-1]), global_scale, swizzled=swizzled)


def quantize_rows_into(
    x: Tensor,
    global_scale: Tensor,
    packed: Tensor,
    scales: Tensor,
    row_start: int,
    *,
    backend: str = "auto",
    validate_values: bool | str = "device",
) -> None:
    """Quantize ``x [M, K]`` into rows ``[row_start, row_start + M)`` of a ``T``-row NVFP4 buffer pair.

    Arguments, bytes and errors as :func:`fusion_pass.nvfp4.quantize_rows_into`
    (all checked before anything is written): ``packed`` contiguous uint8
    ``[T, K/2]``; ``scales`` the contiguous 128x4 swizzled buffer of ``T`` rows, int32
    ``[round_up(T, 128), round_up(K/16, 4) / 4]`` or uint8 / float8_e4m3fn
    ``[round_up(T, 128), round_up(K/16, 4)]``; ``0 <= row_start <= T - M``. Only the
    packed bytes and scale bytes of those rows are written; the padding rows are
    left to :func:`fusion_pass.nvfp4.zero_scale_padding`.

    ``backend``: ``auto`` (the Triton kernel for CUDA tensors, the reference
    otherwise), ``triton`` (CUDA tensors, or CPU tensors under Triton's interpreter),
    ``reference`` (plain PyTorch, any device). ``validate_values``: the global scale's value as
    :func:`quantize` checks it.
    """
    fn = "quantize_rows_into"
    check_backend_name(fn, backend, QUANT_BACKENDS)
    check_validate_values(fn, validate_values)
    check_rows_into(fn, x, global_scale, packed, scales, row_start, check_value=False)
    check_scale_value(fn, global_scale, validate_values)  # the caller's values before the backend's availability
    chosen = triton_or_reference(fn, backend, x.device)
    launchers.quantize_rows(x, global_scale, packed, scales, int(row_start), backend=chosen)  # numpy's as an int


def merge_attention_nvfp4(
    out_a: Tensor,
    lse_a: Tensor,
    out_b: Tensor,
    lse_b: Tensor,
    global_scale: Tensor,
    packed: Tensor,
    scales: Tensor,
    row_start: int,
    *,
    backend: str = "auto",
    validate_values: bool | str = "device",
) -> None:
    """Merge two partial attention results and write them as NVFP4 into rows
    ``[row_start, row_start + M)`` of a ``T``-row buffer pair.

    Args:
        out_a, out_b: ``[M, H, Dv]`` float32 / bfloat16 / float16 (may differ), unit
            stride along ``Dv``, ``H * Dv % 16 == 0``, one device.
        lse_a, lse_b: float32 ``[M, H]``, any strides, natural-log LSE of each part;
            ``-inf``: the part saw no key and its output is ignored.
        global_scale: float32 tensor with one positive finite element, on that device.
        packed: contiguous uint8 ``[T, H*Dv/2]``.
        scales: contiguous 128x4 swizzled scale buffer of ``T`` rows: int32
            ``[round_up(T, 128), round_up(H*Dv/16, 4) / 4]`` or uint8 / float8_e4m3fn
            ``[round_up(T, 128), round_up(H*Dv/16, 4)]``.
        row_start: an int with ``0 <= row_start`` and ``row_start + M <= T``.
        backend: ``auto``, ``triton`` or ``reference`` (below).
        validate_values: the global scale's value checked on its device without reading it back
            (``"device"``, the default), read back (``True``) or not checked (``False``).

    Writes the packed bytes and scale bytes of those rows only (padding scale
    columns as zero); no other byte, no padding row. Rows where both LSEs are
    ``-inf`` are written as ``+0``.

    Per row and head, in float32 (the formula of :func:`fusion_pass.kernels.reference.merge_attention`)::

        m = max(lse_a, lse_b)                   (0 where both are -inf)
        w_a = exp(lse_a - m),  w_b = exp(lse_b - m)
        merged = (w_a * out_a + w_b * out_b) / (w_a + w_b)

    then NVFP4 quantization of ``merged`` with ``global_scale`` (docs/nvfp4.md). A part
    with ``lse = -inf`` contributes ``+0``, so a row-head where both are ``-inf`` is
    ``+0``: packed bytes ``0x00`` and scale ``0`` when its whole block is such. NaN and
    infinity in the outputs as the quantizer's (docs/nvfp4.md "NaN and infinity"); an
    LSE of NaN or ``+inf`` makes that row-head NaN.

    Backends:
    ``reference``
        float32 PyTorch on any device: :func:`fusion_pass.kernels.reference.merge_attention` (the
        outputs of ``-inf`` parts ignored), then
        :func:`fusion_pass.nvfp4.quantize_rows_into`; the contract's bytes. (torch's
        ``exp`` itself differs in the last bit between CPU and CUDA, so the reference's
        bytes on the two devices can differ in the same rare places as ``triton``'s.)
    ``triton``
        one Triton launch (CUDA tensors, or CPU tensors under Triton's interpreter);
        needs ``Dv % 16 == 0``. It computes ``exp`` with its own implementation and
        multiplies by ``1 / (w_a + w_b)`` computed once per row-head, so ``merged``
        may differ from the reference's by a few ulps when both parts carry weight;
        bytes then differ only where a value lies that close to a rounding threshold
        of the format. A merge where one part is empty or the two LSEs are equal is
        exact (weights 1 and 0, or 1 and 1), and so are its bytes.
    ``auto``
        ``triton`` for CUDA tensors when Triton imports and ``Dv % 16 == 0``, else
        ``reference``.

    Raises (before anything is written):
        ArgumentError (a ValueError and a TypeError): a non-tensor argument, an output
            dtype other than float32 / bfloat16 / float16, a non-float32 LSE or global scale,
            a non-int ``row_start``, an unknown backend, a wrong shape, stride, layout or
            device, ``H * Dv % 16 != 0`` (or ``Dv % 16 != 0`` for ``triton``), a global
            scale that is not one positive finite value, a row range outside ``[0, T)``.
        RuntimeError: ``backend="triton"`` without Triton, or on CPU tensors outside
            Triton's interpreter.
    """
    fn = "merge_attention_nvfp4"
    check_backend_name(fn, backend, MERGE_BACKENDS)
    check_validate_values(fn, validate_values)
    check_outs(fn, out_a, out_b)
    check_lses(fn, lse_a, lse_b, out_a)
    check_global_scale(fn, global_scale, out_a.device, check_value=False)
    check_destination(fn, packed, scales, row_start, out_a)
    check_scale_value(fn, global_scale, validate_values)  # the caller's values before the backend's availability
    chosen = choose_merge(fn, backend, out_a)
    row_start = int(row_start)  # checked: an int, numpy's too
    if chosen == "triton":
        launchers.merge_nvfp4_rows("triton", out_a, lse_a, out_b, lse_b, global_scale, packed, scales, row_start)
    else:
        reference.merge_nvfp4(out_a, lse_a, out_b, lse_b, global_scale, packed, scales, row_start)
