"""FlashAttention-4 on Hopper (SM90): bf16/fp16 forward and the fused NVFP4 forward.

Entry points (tensors in, tensors out; no knowledge of backends or batches):

* :func:`fa4_attention_varlen` — FA4's own varlen forward
  (``flash_attn.cute.flash_attn_varlen_func``) with ``pack_gqa=False`` and
  ``num_splits=1``, the configuration the fused kernel shares;
* :func:`fa4_attention_nvfp4_varlen` — :class:`~fusion_pass.kernels.fa4.sm90_kernel.FlashAttentionForwardSm90Nvfp4`
  (FA4's SM90 kernel with an NVFP4 epilogue) writing into the caller's buffers.

Both take an optional ``cu_seqlens_k``: keys/values in their own packed workspace (cached
context followed by the new tokens), causal aligned bottom-right as FA4 does it.

This module imports without FA4: ``flash_attn.cute`` / ``cutlass`` are imported on the first
call, after the arguments are checked (:func:`check_fa4_args`). Needs the ``fa4`` extra
(``pip install 'attn-nvfp4-fusion[fa4]'``), pinned to the release the subclass was written
against (:data:`FA4_VERSION`, :data:`CUTLASS_DSL_VERSION`; ``docs/fa4.md``).

Compilation: the first call per configuration compiles (a few seconds, logged at INFO on the
``fusion_pass`` logger with the configuration and the time it took); the compiled
function is kept in an FA4 ``get_jit_cache`` cache whose key starts with
:data:`KERNEL_VERSION` (FA4's persistent cache fingerprints only FA4's own sources, so an edit
to our subclass must change that string). Token counts, batch size and head count are
run-time values: one compilation serves every batch of a layer.
"""

from __future__ import annotations

from torch import Tensor

from fusion_pass.kernels.fa4 import common
from fusion_pass.kernels.fa4.common import FA4_INSTALL_HINT, FA4_VERSION, CUTLASS_DSL_VERSION, fa4_interface

__all__ = [
    "FA4_VERSION",
    "CUTLASS_DSL_VERSION",
    "KERNEL_VERSION",
    "SUPPORTED_HEAD_DIMS",
    "FA4_INSTALL_HINT",
    "fa4_import_status",
    "fa4_sm90_usable",
    "check_fa4_args",
    "check_nvfp4_buffers",
    "fa4_attention_varlen",
    "fa4_attention_nvfp4_varlen",
    "compile_nvfp4_kernel",
    "kernel_config",
]

KERNEL_VERSION = "fusion_pass.fa4_sm90_nvfp4/2"
"""First element of the compile-cache key; bump it whenever ``sm90_kernel.py`` or ``nvfp4_block.py`` changes."""

SUPPORTED_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 128))
"""``(D, Dv)`` pairs of the fused kernel: FA4 SM90 head dims whose ``Dv`` fills the kernel's
``tile_hdimv`` exactly and divides into whole 16-element blocks per epilogue thread."""

_BLOCK = 16


def fa4_import_status() -> tuple[bool, str]:
    """``(True, "flash-attn-4 <version>")`` when ``flash_attn.cute`` and the SM90 subclass import, else
    ``(False, why)``. Cached."""
    return common.fa4_import_status("sm90_kernel")


def kernel_config(head_dim: int, head_dim_v: int, causal: bool) -> tuple[int, int, bool, bool]:
    """``(tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap)``: FA4 4.0.0b36's SM90 choice
    (``interface._tile_size_fwd_sm90``), restated here so the checks need no FA4. The
    compile path asks FA4 itself and fails loudly if the two disagree."""
    if head_dim <= 64:
        return 192, 128, True, True
    if head_dim <= 96:
        return 192, 128 if causal else 144, False, True
    if head_dim <= 128:
        return 128, 128, True, True
    if head_dim <= 192:
        return 128, 128 if head_dim_v <= 128 else 112, True, True
    return 128, 80, True, True


def _epilogue_threads(tile_m: int) -> int:
    return 128 * (tile_m // 64)  # FA4 SM90: one 128-thread warpgroup per 64 rows of the tile


def check_fa4_args(
    fn: str, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, cu_seqlens_k=None, max_seqlen_k=None
) -> None:
    """Shapes, dtypes, devices and head dims the FA4 SM90 kernels accept (no FA4 import, no sync).

    With ``cu_seqlens_k``, ``k``/``v`` may have another token count than ``q``; its values
    (and ``cu_seqlens``'s) are not read."""
    common.check_fa4_args(fn, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, cu_seqlens_k, max_seqlen_k,
                          head_dims=SUPPORTED_HEAD_DIMS, kernel="FA4 SM90")


def check_nvfp4_buffers(fn: str, q, v, output, output_scale, output_block_scale) -> None:
    """The fused kernel's output buffers (no FA4 import, no sync)."""
    dv = v.shape[2]
    tile_m = kernel_config(q.shape[2], dv, True)[0]
    if _epilogue_threads(tile_m) % (dv // _BLOCK):
        raise ValueError(
            f"{fn}: v's head dim Dv={dv} splits into {dv // _BLOCK} blocks of 16, which does not divide the "
            f"{_epilogue_threads(tile_m)} epilogue threads of a {tile_m}-row tile"
        )
    common.check_nvfp4_buffers(fn, q, v, output, output_scale, output_block_scale)


def fa4_sm90_usable(device, dtype, num_heads: int, head_dim: int, head_dim_v: int) -> tuple[bool, str]:
    """Whether these FA4 SM90 kernels run a layer of these dims on ``device``: ``(ok, why)``
    (:func:`fusion_pass.kernels.fa4.common.kernel_usable` with SM90 and :data:`SUPPORTED_HEAD_DIMS`)."""
    return common.kernel_usable(device, dtype, num_heads, head_dim, head_dim_v, import_status=fa4_import_status(),
                                families=(9,), label="SM90", gpus="H100/H200", head_dims=SUPPORTED_HEAD_DIMS)


def compile_nvfp4_kernel(q, k, v, o, output, output_scale, scale_bytes, cu_seqlens, cu_seqlens_k, max_seqlen, causal):
    """``(compiled fused kernel, ())`` for these tensors' static properties (compiling on a miss); ``()``: no
    run-time arguments after ``cu_seqlens_k`` (:func:`fusion_pass.kernels.fa4.common.run_fused`).

    ``cu_seqlens_k`` only shapes the compile arguments: the token counts, ``max_seqlen`` and the two offset
    tensors are run-time values, so one compilation serves every call of a layer.

    Works on real CUDA tensors and, for compile-only checks without a GPU, on fake
    ``device="cuda"`` tensors under ``FakeTensorMode`` with ``CUTE_DSL_ARCH=sm_90a``.
    """
    interface = fa4_interface()
    import cutlass.cute as cute
    from flash_attn.cute.cute_dsl_utils import to_cute_tensor

    from fusion_pass.kernels.fa4.sm90_kernel import FlashAttentionForwardSm90Nvfp4

    d, dv = q.shape[2], v.shape[2]
    qhead_per_kvhead = q.shape[1] // k.shape[1]
    cfg = interface._tile_size_fwd_sm90(d, dv, causal, False)
    mine = kernel_config(d, dv, causal)
    theirs = (cfg.m_block_size, cfg.n_block_size, cfg.mma_pv_is_rs, cfg.intra_wg_overlap)
    if mine != theirs:
        raise RuntimeError(
            f"fa4: the installed FA4 picks tiles {theirs} for head dims ({d}, {dv}), this kernel expects {mine}; "
            f"it was written against flash-attn-4=={FA4_VERSION} (docs/fa4.md)"
        )
    dtype = interface.torch2cute_dtype_map[q.dtype]
    key = (KERNEL_VERSION, dtype, d, dv, qhead_per_kvhead, causal) + theirs + common.layout_key(q.device, q, k, v)

    def build():
        kernel = FlashAttentionForwardSm90Nvfp4(
            dtype,
            d,
            dv,
            qhead_per_kvhead,
            is_causal=causal,
            is_local=False,
            pack_gqa=False,
            tile_m=cfg.m_block_size,
            tile_n=cfg.n_block_size,
            num_stages=2,
            num_threads=384,
            Q_in_regs=False,
            intra_wg_overlap=cfg.intra_wg_overlap,
            mma_pv_is_rs=cfg.mma_pv_is_rs,
        )
        if kernel.tile_hdimv != dv:  # the epilogue assumes Dv fills the tile (no hdim predication)
            raise RuntimeError(f"fa4: unexpected FA4 tile for Dv={dv}: tile_hdimv={kernel.tile_hdimv}")
        cu = to_cute_tensor(cu_seqlens, assumed_align=4, leading_dim=0)
        cu_k = to_cute_tensor(cu_seqlens_k, assumed_align=4, leading_dim=0)
        return cute.compile(
            kernel,
            to_cute_tensor(q),
            to_cute_tensor(k),
            to_cute_tensor(v),
            to_cute_tensor(o),
            to_cute_tensor(output),
            to_cute_tensor(scale_bytes, leading_dim=0),
            to_cute_tensor(output_scale, assumed_align=4, leading_dim=0),
            0.1,  # softmax_scale: a run-time Float32
            cu,
            cu_k,
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options=interface._compile_options(),
        )

    what = (f"the SM90 NVFP4 attention kernel ({str(q.dtype).replace('torch.', '')}, head dims ({d}, {dv}), "
            f"{qhead_per_kvhead} query heads per KV head, causal={causal}, tile {cfg.m_block_size}x{cfg.n_block_size})")
    return common.compiled("fusion_pass_fa4_sm90_nvfp4", key, build, what), ()


def fa4_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    *,
    causal: bool,
    softmax_scale: float,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_k: int | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """FA4's varlen forward: ``[T, H, Dv]`` in q's dtype (and the log-sum-exp).

    ``q [T, H, D]``, ``k [Tk, Hkv, D]``, ``v [Tk, Hkv, Dv]`` (bf16/fp16, ``(D, Dv)`` in
    :data:`SUPPORTED_HEAD_DIMS`); ``cu_seqlens`` int32 ``[B+1]`` delimits the queries (and
    output rows: sequence ``b`` at rows ``[c[b], c[b+1])``, which may start past row 0),
    ``cu_seqlens_k`` (default ``cu_seqlens``; then ``Tk == T``) the keys/values; their values
    are not checked. ``max_seqlen`` / ``max_seqlen_k`` bound the query / key lengths
    (``max_seqlen_k`` defaults to ``max_seqlen`` without ``cu_seqlens_k``, to FA4's ``Tk``
    with it). Causal masking is bottom-right aligned when ``Lk != Lq``: query ``i`` sees keys
    ``j <= i + (Lk - Lq)`` (FA4 4.0.0b36 ``mask.py`` ``apply_mask``: column limit
    ``row + 1 + seqlen_k - seqlen_q``; ``block_info.get_n_block_min_max`` likewise).
    Runs with ``pack_gqa=False, num_splits=1``: the main loop of the fused kernel, so that
    ``nvfp4.quantize(fa4_attention_varlen(...))`` and :func:`fa4_attention_nvfp4_varlen`
    produce the same bytes.

    Returns:
        ``out``; with ``return_lse``, ``(out, lse)`` where ``lse`` float32 ``[T, H]`` is
        ``ln sum_j exp(softmax_scale * q.k_j)`` over the visible keys: a transposed view of
        FA4's ``[H, T]`` varlen LSE (strides ``(1, T)``, not contiguous; no copy). Rows
        outside ``[cu_seqlens[0], cu_seqlens[B])`` of both are not written.
    """
    fn = "fa4_attention_varlen"
    check_fa4_args(fn, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, cu_seqlens_k, max_seqlen_k)
    if not isinstance(return_lse, bool):
        raise ValueError(f"{fn}: return_lse must be a bool, got {return_lse!r}")
    interface = fa4_interface()
    result = interface.flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens if cu_seqlens_k is None else cu_seqlens_k,
        max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen if cu_seqlens_k is None else max_seqlen_k,
        softmax_scale=float(softmax_scale),
        causal=causal,
        num_splits=1,
        pack_gqa=False,
        return_lse=return_lse,
    )
    out, lse = result if isinstance(result, tuple) else (result, None)
    return (out, lse.t()) if return_lse else out


def fa4_attention_nvfp4_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens: Tensor,
    max_seqlen: int,
    softmax_scale: float,
    causal: bool,
    output: Tensor,
    output_scale: Tensor,
    output_block_scale: Tensor,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_k: int | None = None,
) -> None:
    """Attention written as NVFP4 by FA4's SM90 kernel with our epilogue, into the caller's buffers.

    Args as :func:`fa4_attention_varlen` (``cu_seqlens_k`` / ``max_seqlen_k`` included), plus:
        output: one-byte ``[T, H*Dv/2]`` (contiguous, 16-byte aligned; ``H*Dv/2 % 8 == 0``):
            packed e2m1 codes, token ``t`` in row ``t``.
        output_scale: float32 ``[1]`` on the device: the global scale (never read on the host).
        output_block_scale: contiguous ``round_up(T,128) * round_up(H*Dv/16,4)`` bytes (any
            one-byte or int32 view): the e4m3 block scales, 128x4 swizzled.

    The kernel writes the bytes of ``output`` and the scale entries of the rows of
    ``[cu_seqlens[0], cu_seqlens[B])`` (every row when they span ``0 .. T``; the epilogue
    stores at ``seqlen.offset_q + row``, the query's global row). The scale buffer's padding
    entries (rows ``T .. round_up(T,128)-1`` inside the last 128-row band, and columns
    ``H*Dv/16 .. round_up(H*Dv/16,4)-1`` of every row) are zeroed before the launch with a
    few strided fills; no other byte is touched, so rows outside the sequences keep theirs.
    ``max_seqlen_k`` is accepted for :func:`fa4_attention_varlen`'s signature: the fused
    kernel reads key lengths from ``cu_seqlens_k`` alone.
    """
    common.run_fused("fa4_attention_nvfp4_varlen", q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, output,
                     output_scale, output_block_scale, cu_seqlens_k, max_seqlen_k, check_args=check_fa4_args,
                     check_buffers=check_nvfp4_buffers, compile_kernel=compile_nvfp4_kernel)
