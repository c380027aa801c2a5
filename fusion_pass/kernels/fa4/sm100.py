"""FlashAttention-4 on Blackwell (SM100/SM110): the fused NVFP4 forward and its bf16/fp16 twin.

Entry points (tensors in, tensors out), the same contract as :mod:`.sm90`'s:

* :func:`fa4_attention_nvfp4_varlen` — :class:`~fusion_pass.kernels.fa4.sm100_kernel.FlashAttentionForwardSm100Nvfp4`
  (FA4's SM100 forward whose correction warps quantize the output in registers) writing into the caller's buffers;
* :func:`fa4_attention_varlen` — the *twin*: FA4's SM100 forward class built with the same configuration and
  run with FA4's own output stage, so ``nvfp4.quantize(fa4_attention_varlen(...))`` and the fused call give
  the same bytes by construction (the two differ only in the output stage). With ``return_lse`` it also
  returns FA4's log-sum-exp;
* :func:`fa4_attention_nvfp4_paged` / :func:`fa4_attention_paged` — the same pair on a paged KV cache
  (``seqused_k``, ``page_table``: FA4's own paged forward; TMA loads for 128-token pages, cp.async loads with
  FA4's ``paged_kv_non_tma`` for any other page size, and then no S ping-pong, as FA4 chooses).

Configuration (:func:`kernel_config`): FA4 4.0.0b36's own choice for a varlen causal call without splits,
restated: 128x128 tiles, one CTA per tile, ``pack_gqa=False``; two Q tiles per CTA (``q_stage=2``) when the
longest sequence exceeds 128 rows; the S ping-pong pipeline for ``q_stage=1`` and ``D == Dv`` in (64, 128).
Choices that only place tiles on SMs are fixed in both kernels, since they do not change a row's arithmetic:
the one-CTA-per-tile varlen scheduler always (FA4 switches to a static persistent one when every sequence
fits one CTA, but that scheduler asks the driver for the SM count while compiling, which the CPU compile
check cannot answer), no CLC scheduler, no batch-lookup aid above 256 sequences.

No Blackwell GPU is lent to this project: these kernels are compiled for ``sm_100a`` in the CPU suite
(``pytest -k sm100``, fake tensors) but were never run. On hardware the run time self-checks them before
their first use (``docs/blackwell.md``).
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from fusion_pass.kernels.fa4 import common
from fusion_pass.kernels.fa4.common import fa4_interface
from fusion_pass.nvfp4 import ArgumentError
from fusion_pass.kernels.fa4.launch import FusedLauncher, PagedFusedLauncher, PagedTwinLauncher, TwinLauncher

__all__ = [
    "KERNEL_VERSION",
    "SUPPORTED_HEAD_DIMS",
    "FUSED",
    "KernelConfig",
    "TWIN",
    "check_fa4_args",
    "config_class",
    "fa4_attention_nvfp4_paged",
    "fa4_attention_nvfp4_varlen",
    "fa4_attention_paged",
    "fa4_attention_varlen",
    "check_fa4_paged_args",
    "PAGED_FUSED",
    "PAGED_TWIN",
    "fa4_import_status",
    "fa4_sm100_usable",
    "kernel_config",
]

KERNEL_VERSION = "fusion_pass.fa4_sm100_nvfp4/4"
"""First element of the compile-cache key; bump it whenever ``sm100_kernel.py``, ``sm100_twin.py`` or ``nvfp4_block.py``
changes."""

SUPPORTED_HEAD_DIMS = ((64, 64), (128, 128), (192, 128))
"""``(D, Dv)`` pairs of the SM100 kernels: standard heads of 64 and 128, DeepSeek MLA's 192/128."""

TILE_M = TILE_N = 128


class KernelConfig(NamedTuple):
    """FA4's SM100 forward configuration of one call (the compile key's variable part)."""

    q_stage: int
    use_s_ping_pong: bool


def fa4_import_status() -> tuple[bool, str]:
    """``(True, "flash-attn-4 <version>")`` when ``flash_attn.cute`` and the SM100 subclass import, else
    ``(False, why)``. Cached."""
    return common.fa4_import_status("sm100_kernel")


def kernel_config(head_dim: int, head_dim_v: int, max_seqlen_q: int, page_size: int | None = None) -> KernelConfig:
    """FA4 4.0.0b36's SM100 choice for a causal varlen call with ``num_splits=1`` and ``pack_gqa=False``
    (``interface._get_fwd_config`` and ``_flash_attn_fwd``), restated so the checks need no FA4. ``page_size``:
    that of a paged KV cache (None: keys not paged); FA4 runs no S ping-pong unless pages are one key tile."""
    q_stage = 2 if max_seqlen_q > TILE_M and head_dim_v != 256 else 1
    ping_pong = (q_stage == 1 and head_dim in (64, 128, 256) and head_dim_v == head_dim
                 and page_size in (None, TILE_N))
    return KernelConfig(q_stage, ping_pong)


def check_fa4_args(
    fn: str, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, cu_seqlens_k=None, max_seqlen_k=None
) -> None:
    """Shapes, dtypes, devices and head dims the FA4 SM100 kernels accept (no FA4 import, no sync), and q's
    layout: token-major with a token's heads inside its row (``q.stride(0) >= H * q.stride(1) > 0`` when
    ``H > 1``). The output stage finds a tile's row and head from its offset in a view of ``q``
    (``sm100_kernel.py``), which only a layout of that order inverts."""
    common.check_fa4_args(fn, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, cu_seqlens_k, max_seqlen_k,
                          head_dims=SUPPORTED_HEAD_DIMS, kernel="FA4 SM100")
    _check_q_layout(fn, q)


def check_fa4_paged_args(fn: str, q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k,
                         softmax_scale, causal) -> None:
    """The arguments of a paged call the FA4 SM100 kernels accept (:func:`.common.check_fa4_paged_args`, and q's
    layout as :func:`check_fa4_args` says). Any page size: 128-token pages take FA4's TMA loads, others its
    cp.async loads."""
    common.check_fa4_paged_args(fn, q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k,
                                softmax_scale, causal, head_dims=SUPPORTED_HEAD_DIMS, kernel="FA4 SM100")
    _check_q_layout(fn, q)


def _check_q_layout(fn: str, q) -> None:
    t_stride, h_stride = q.stride(0), q.stride(1)
    if q.shape[1] > 1 and not (h_stride > 0 and t_stride >= q.shape[1] * h_stride):
        raise ArgumentError(f"{fn}: q must be token-major with its heads inside a token's row for the SM100 kernel "
                            f"(q.stride(0) >= H * q.stride(1) > 0), got shape {list(q.shape)} and strides "
                            f"{q.stride()}; pass q.contiguous()")


def fa4_sm100_usable(device, dtype, num_heads: int, head_dim: int, head_dim_v: int) -> tuple[bool, str]:
    """Whether these kernels run a layer of these dims on ``device``: ``(ok, why)``
    (:func:`fusion_pass.kernels.fa4.common.kernel_usable` with SM100/SM110 and :data:`SUPPORTED_HEAD_DIMS`)."""
    return common.kernel_usable(device, dtype, num_heads, head_dim, head_dim_v, import_status=fa4_import_status(),
                                families=(10, 11), label="SM100/SM110", gpus="B200, GB200", head_dims=SUPPORTED_HEAD_DIMS)


usable = fa4_sm100_usable
"""The generation-neutral name :mod:`.forward` dispatches to."""


def config_class(max_seqlen: int, max_seqlen_k: int | None = None) -> int:
    """1 when the longest query sequence exceeds one 128-row tile (two Q tiles per CTA where the head dims allow),
    else 0: what FA4's SM100 configuration depends on besides the head dims."""
    return 1 if max_seqlen > TILE_M else 0


def _compile(fused: bool, q, k, v, o, cu_seqlens, cu_seqlens_k, cls: int, causal: bool, *, lse=None,
             output=None, output_scale=None, scale_bytes=None, seqused_k=None, page_table=None, variant=None):
    """The compiled fused kernel (``fused``) or its twin, for these tensors' static properties and the
    configuration of class ``cls`` (:func:`config_class`; compiling on a miss). ``variant``: another output stage
    on the fused kernel's main loop, ``(kind, kernel_class, outputs, what)`` (the FP8 kernels of :mod:`.sm100_fp8`):
    ``kind`` a tuple in the key, ``outputs(to_cute_tensor)`` the arguments after ``o``. With ``page_table`` (and
    ``seqused_k``; ``cu_seqlens_k`` None) ``k``/``v`` are paged caches ``[num_pages, page_size, Hkv, D|Dv]``:
    FA4's paged forward, TMA loads for ``page_size == 128`` (part of the key), cp.async loads otherwise (one
    compilation for every other page size). Works on fake ``device="cuda"`` tensors under ``FakeTensorMode``
    with ``CUTE_DSL_ARCH=sm_100a`` (compile-only)."""
    interface = fa4_interface()
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute.cute_dsl_utils import to_cute_tensor

    from fusion_pass.kernels.fa4.sm100_kernel import FlashAttentionForwardSm100Nvfp4
    from fusion_pass.kernels.fa4.sm100_twin import FlashAttentionForwardSm100Twin

    d, dv = q.shape[2], v.shape[-1]
    qhead_per_kvhead = q.shape[1] // k.shape[-2]
    max_seqlen = TILE_M + 1 if cls else 1  # a length of the class: the kernel takes the real one at run time
    page_size = None if page_table is None else k.shape[1]
    paged = None if page_table is None else page_size == TILE_N  # None: no pages; else TMA loads or not
    cfg = kernel_config(d, dv, max_seqlen, page_size)
    dtype = interface.torch2cute_dtype_map[q.dtype]
    kind = variant[0] if variant else "nvfp4" if fused else ("twin+lse" if lse is not None else "twin")
    tensors = (q, k, v) if page_table is None else (q, k, v, page_table)
    key = (KERNEL_VERSION, kind, dtype, d, dv, qhead_per_kvhead, causal) + tuple(cfg) + (paged,) \
        + common.layout_key(q.device, *tensors)

    def build():
        kernel_class = variant[1] if variant else FlashAttentionForwardSm100Nvfp4 if fused \
            else FlashAttentionForwardSm100Twin
        kernel = kernel_class(
            d,
            dv,
            qhead_per_kvhead=qhead_per_kvhead,
            is_causal=causal,
            is_local=False,
            is_split_kv=False,
            pack_gqa=False,
            m_block_size=TILE_M,
            n_block_size=TILE_N,
            q_stage=cfg.q_stage,
            is_static_persistent=False,
            is_varlen_q=True,
            use_2cta_instrs=False,
            use_clc_scheduler=False,
            use_s_ping_pong=cfg.use_s_ping_pong,
            paged_kv_non_tma=paged is False,
        )
        cu = to_cute_tensor(cu_seqlens, assumed_align=4, leading_dim=0)
        cu_k = None if cu_seqlens_k is None else to_cute_tensor(cu_seqlens_k, assumed_align=4, leading_dim=0)
        paged_args = () if page_table is None else (to_cute_tensor(seqused_k, assumed_align=4, leading_dim=0),
                                                    to_cute_tensor(page_table, assumed_align=4, leading_dim=1))
        head = [to_cute_tensor(q), to_cute_tensor(k), to_cute_tensor(v), to_cute_tensor(o)]
        if variant:
            head += list(variant[2](to_cute_tensor))
        elif fused:
            head += [to_cute_tensor(output), to_cute_tensor(scale_bytes, leading_dim=0),
                     to_cute_tensor(output_scale, assumed_align=4, leading_dim=0)]
        else:
            head += [None if lse is None else to_cute_tensor(lse, assumed_align=4)]
        return cute.compile(
            kernel,
            *head,
            0.1,  # softmax_scale: a run-time Float32
            cu,
            cu_k,
            cutlass.Int32(max_seqlen),
            *paged_args,
            stream=cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options=interface._compile_options(getattr(kernel, "ptxas_options", "")),
        )

    pages = "" if paged is None else f", paged KV ({'TMA' if paged else 'cp.async'} loads)"
    label = variant[3] if variant else 'NVFP4' if fused else 'twin (FA4 output stage)'
    what = (f"the SM100 {label} attention kernel ({str(q.dtype).replace('torch.', '')}, "
            f"head dims ({d}, {dv}), {qhead_per_kvhead} query heads per KV head, causal={causal}, {cfg}{pages})")
    return common.compiled("fusion_pass_fa4_sm100", key, build, what)


def _compile_fused(q, k, v, o, packed, output_scale, scale_bytes, cu_seqlens, cu_seqlens_k, cls, causal):
    return _compile(True, q, k, v, o, cu_seqlens, cu_seqlens_k, cls, causal, output=packed,
                    output_scale=output_scale, scale_bytes=scale_bytes)


def _compile_twin(q, k, v, out, lse, cu_seqlens, cu_seqlens_k, cls, causal):
    return _compile(False, q, k, v, out, cu_seqlens, cu_seqlens_k, cls, causal, lse=lse)


FUSED = FusedLauncher("fa4_attention_nvfp4_varlen", check_args=check_fa4_args, check_buffers=common.check_nvfp4_buffers,
                      config_class=config_class, compile_kernel=_compile_fused, max_seqlen_arg=True)
TWIN = TwinLauncher("fa4_attention_varlen", check_args=check_fa4_args, config_class=config_class,
                    compile_kernel=_compile_twin, max_seqlen_arg=True)


def _compile_paged_fused(q, k_cache, v_cache, o, packed, output_scale, scale_bytes, cu_seqlens, seqused_k, page_table,
                         cls, causal):
    return _compile(True, q, k_cache, v_cache, o, cu_seqlens, None, cls, causal, output=packed,
                    output_scale=output_scale, scale_bytes=scale_bytes, seqused_k=seqused_k, page_table=page_table)


def _compile_paged_twin(q, k_cache, v_cache, out, lse, cu_seqlens, seqused_k, page_table, cls, causal):
    return _compile(False, q, k_cache, v_cache, out, cu_seqlens, None, cls, causal, lse=lse, seqused_k=seqused_k,
                    page_table=page_table)


PAGED_FUSED = PagedFusedLauncher("fa4_attention_nvfp4_paged", check_args=check_fa4_paged_args,
                                 check_buffers=common.check_nvfp4_buffers, config_class=config_class,
                                 compile_kernel=_compile_paged_fused, max_seqlen_arg=True)
PAGED_TWIN = PagedTwinLauncher("fa4_attention_paged", check_args=check_fa4_paged_args, config_class=config_class,
                               compile_kernel=_compile_paged_twin, max_seqlen_arg=True)
"""The launchers of the entry points below (:mod:`fusion_pass.kernels.fa4.launch`; :mod:`.forward` calls them)."""


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
    """The twin: FA4's SM100 forward with the fused kernel's configuration and FA4's own output stage.

    Arguments and results as :func:`fusion_pass.kernels.fa4.sm90.fa4_attention_varlen` (``[T, H, Dv]`` in q's
    dtype; with ``return_lse`` also float32 ``lse [T, H]``, a transposed view of FA4's ``[H, T]``). Rows
    outside ``[cu_seqlens[0], cu_seqlens[B])`` are not written."""
    return TWIN(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, cu_seqlens_k, max_seqlen_k, return_lse)


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
    """Attention written as NVFP4 by FA4's SM100 forward with our output stage, into the caller's buffers.

    Arguments and what is written as :func:`fusion_pass.kernels.fa4.sm90.fa4_attention_nvfp4_varlen`:
    ``output`` one-byte ``[T, H*Dv/2]``, ``output_scale`` float32 ``[1]`` (read on the device),
    ``output_block_scale`` the swizzled e4m3 scales (padding zeroed by the launcher)."""
    FUSED(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, output, output_scale, output_block_scale,
          cu_seqlens_k, max_seqlen_k)


def fa4_attention_paged(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    cu_seqlens: Tensor,
    max_seqlen: int,
    seqused_k: Tensor,
    page_table: Tensor,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """The twin on a paged KV cache: FA4's SM100 paged forward with the fused kernel's configuration and FA4's own
    output stage. Arguments and results as :func:`fusion_pass.kernels.fa4.sm90.fa4_attention_paged`."""
    return PAGED_TWIN(q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k, softmax_scale,
                      causal, return_lse)


def fa4_attention_nvfp4_paged(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    cu_seqlens: Tensor,
    max_seqlen: int,
    seqused_k: Tensor,
    page_table: Tensor,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    output: Tensor,
    output_scale: Tensor,
    output_block_scale: Tensor,
) -> None:
    """Attention over a paged KV cache written as NVFP4 by FA4's SM100 forward with our output stage. Arguments
    and what is written as :func:`fusion_pass.kernels.fa4.sm90.fa4_attention_nvfp4_paged`."""
    PAGED_FUSED(q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k, softmax_scale,
                causal, output, output_scale, output_block_scale)
