"""FlashAttention-4 on Hopper (SM90): bf16/fp16 forward and the fused NVFP4 forward.

Entry points (tensors in, tensors out; no knowledge of backends or batches):

* :func:`fa4_attention_varlen` — the *twin*: FA4's SM90 forward class
  (:class:`~fusion_pass.kernels.fa4.sm90_twin.FlashAttentionForwardSm90Twin`) built with the fused kernel's
  configuration and compile options and run with FA4's own epilogue (optionally with its log-sum-exp), so
  ``nvfp4.quantize(fa4_attention_varlen(...))`` and the fused call give the same bytes by construction;
* :func:`fa4_attention_nvfp4_varlen` — :class:`~fusion_pass.kernels.fa4.sm90_kernel.FlashAttentionForwardSm90Nvfp4`
  (FA4's SM90 kernel with an NVFP4 epilogue) writing into the caller's buffers.

Both take an optional ``cu_seqlens_k``: keys/values in their own packed workspace (cached
context followed by the new tokens), causal aligned bottom-right as FA4 does it. The FP8 entry points (this main
loop with FP8 epilogues, built by :func:`_compile`) are in :mod:`fusion_pass.kernels.fa4.sm90_fp8`.

:func:`fa4_attention_paged` and :func:`fa4_attention_nvfp4_paged` are the same pair reading keys and values from
a paged KV cache (``k_cache [num_pages, page_size, Hkv, D]``, ``seqused_k``, ``page_table``), FA4's own paged
forward: K/V tiles by TMA when the page size equals the configuration's ``tile_n`` (128 for every supported
head-dim pair when causal), by cp.async (FA4's ``paged_kv_non_tma``) for any other page size. Decode rows,
prefills and prefills after cached context run in one launch, with the same contract (``nvfp4.quantize`` of the
twin's output is the fused call's bytes).

Configuration: per (head dims, causal, sequence-length class of the call) from
:mod:`fusion_pass.kernels.fa4.sm90_configs` (FA4's own choice unless its table says otherwise), the same for the
fused kernel and the twin; part of the compile key.

Per call (:mod:`fusion_pass.kernels.fa4.launch`): the first call of a kind checks every argument
(:func:`check_fa4_args`, :func:`check_nvfp4_buffers`), compiles on a miss and keeps a plan; later calls check
sizes, addresses and scalars on the host (no sync), look the plan up and launch.

This module imports without FA4: ``flash_attn.cute`` / ``cutlass`` are imported on the first
call, after the arguments are checked. Needs the ``fa4`` extra
(``pip install 'attn-nvfp4-fusion[fa4]'``), pinned to the release the subclass was written
against (:data:`FA4_VERSION`, :data:`CUTLASS_DSL_VERSION`; ``docs/fa4.md``).

Compilation: the first call per configuration compiles (a few seconds, logged at INFO on the
``fusion_pass`` logger with the configuration and the time it took); the compiled
function is kept in an FA4 ``get_jit_cache`` cache whose key starts with
:data:`KERNEL_VERSION` (:data:`TWIN_VERSION` for the twin; FA4's persistent cache fingerprints only FA4's own
sources, so an edit to our subclass must change that string). Token counts, batch size and head count are
run-time values: one compilation serves every batch of a layer and configuration.
"""

from __future__ import annotations

from torch import Tensor

from fusion_pass.kernels.fa4 import common
from fusion_pass.kernels.fa4.common import FA4_INSTALL_HINT, FA4_VERSION, CUTLASS_DSL_VERSION, fa4_interface
from fusion_pass.kernels.fa4.launch import FusedLauncher, PagedFusedLauncher, PagedTwinLauncher, TwinLauncher
from fusion_pass.kernels.fa4.sm90_configs import Sm90Config, config_for, seqlen_class, why_invalid
from fusion_pass.nvfp4.checks import ArgumentError

__all__ = [
    "FA4_VERSION",
    "CUTLASS_DSL_VERSION",
    "KERNEL_VERSION",
    "TWIN_VERSION",
    "SUPPORTED_HEAD_DIMS",
    "FA4_INSTALL_HINT",
    "FUSED",
    "TWIN",
    "fa4_import_status",
    "fa4_sm90_usable",
    "check_fa4_args",
    "check_nvfp4_buffers",
    "fa4_attention_varlen",
    "fa4_attention_nvfp4_varlen",
    "fa4_attention_paged",
    "fa4_attention_nvfp4_paged",
    "check_fa4_paged_args",
    "compile_nvfp4_kernel",
    "compile_twin_kernel",
    "compile_unchanged_kernel",
    "kernel_config",
    "launchers",
    "paged_launchers",
    "PAGED_FUSED",
    "PAGED_TWIN",
]

KERNEL_VERSION = "fusion_pass.fa4_sm90_nvfp4/7"
"""First element of the compile-cache key; bump it whenever ``sm90_kernel.py`` or ``nvfp4_block.py`` changes."""

TWIN_VERSION = "fusion_pass.fa4_sm90_twin/3"
"""First element of the twin's compile-cache key; bump it whenever ``sm90_twin.py`` changes."""

SUPPORTED_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 128))
"""``(D, Dv)`` pairs of the fused kernel: FA4 SM90 head dims whose ``Dv`` fills the kernel's
``tile_hdimv`` exactly and divides into whole 16-element blocks per epilogue thread."""


def fa4_import_status() -> tuple[bool, str]:
    """``(True, "flash-attn-4 <version>")`` when ``flash_attn.cute`` and the SM90 subclass import, else
    ``(False, why)``. Cached."""
    return common.fa4_import_status("sm90_kernel")


def kernel_config(head_dim: int, head_dim_v: int, causal: bool, max_seqlen: int = 0,
                  max_seqlen_k: int | None = None) -> Sm90Config:
    """The configuration a call runs with (:func:`fusion_pass.kernels.fa4.sm90_configs.config_for` of its
    sequence-length class): FA4 4.0.0b36's own SM90 choice unless the table says otherwise."""
    return config_for(head_dim, head_dim_v, causal, seqlen_class(max_seqlen, max_seqlen_k))


def check_fa4_args(
    fn: str, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, cu_seqlens_k=None, max_seqlen_k=None
) -> None:
    """Shapes, dtypes, devices and head dims the FA4 SM90 kernels accept (no FA4 import, no sync).

    With ``cu_seqlens_k``, ``k``/``v`` may have another token count than ``q``; its values
    (and ``cu_seqlens``'s) are not read."""
    common.check_fa4_args(fn, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, cu_seqlens_k, max_seqlen_k,
                          head_dims=SUPPORTED_HEAD_DIMS, kernel="FA4 SM90")


def check_fa4_paged_args(fn: str, q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k,
                         softmax_scale, causal) -> None:
    """The arguments of a paged call the FA4 SM90 kernels accept (:func:`.common.check_fa4_paged_args`; no FA4
    import, no sync). Any page size: ``tile_n``-sized pages take FA4's TMA loads, others its cp.async loads."""
    common.check_fa4_paged_args(fn, q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k,
                                softmax_scale, causal, head_dims=SUPPORTED_HEAD_DIMS, kernel="FA4 SM90")


def check_nvfp4_buffers(fn: str, q, v, output, output_scale, output_block_scale) -> None:
    """The fused kernel's output buffers (no FA4 import, no sync). Whether the epilogue fits a configuration
    (whole blocks per thread) is checked per configuration when it is compiled (:func:`why_invalid`)."""
    common.check_nvfp4_buffers(fn, q, v, output, output_scale, output_block_scale)


def fa4_sm90_usable(device, dtype, num_heads: int, head_dim: int, head_dim_v: int) -> tuple[bool, str]:
    """Whether these FA4 SM90 kernels run a layer of these dims on ``device``: ``(ok, why)``
    (:func:`fusion_pass.kernels.fa4.common.kernel_usable` with SM90 and :data:`SUPPORTED_HEAD_DIMS`)."""
    return common.kernel_usable(device, dtype, num_heads, head_dim, head_dim_v, import_status=fa4_import_status(),
                                families=(9,), label="SM90", gpus="H100/H200", head_dims=SUPPORTED_HEAD_DIMS)


usable = fa4_sm90_usable
"""The generation-neutral name :mod:`.forward` dispatches to."""


def _valid(cfg: Sm90Config, d: int, dv: int, fused: bool) -> Sm90Config:
    why = why_invalid(cfg, d, dv, fused=fused)
    if why is not None:
        raise RuntimeError(f"fa4: configuration {cfg} cannot run head dims ({d}, {dv}): {why}")
    return cfg


def _constructor(cls, dtype, d: int, dv: int, qhead_per_kvhead: int, causal: bool, cfg: Sm90Config,
                 paged_kv_non_tma: bool = False):
    """The fused kernel and the twin are built by this one call: same class arguments, same configuration.
    ``paged_kv_non_tma``: a paged KV cache whose page size is not ``tile_n`` (FA4's interface:
    ``page_size not in [None, tile_n]``)."""
    return cls(
        dtype,
        d,
        dv,
        qhead_per_kvhead,
        is_causal=causal,
        is_local=False,
        pack_gqa=False,
        tile_m=cfg.tile_m,
        tile_n=cfg.tile_n,
        num_stages=cfg.num_stages,
        num_threads=384,
        Q_in_regs=False,
        intra_wg_overlap=cfg.intra_wg_overlap,
        mma_pv_is_rs=cfg.mma_pv_is_rs,
        paged_kv_non_tma=paged_kv_non_tma,
    )


def _describe(q, d, dv, qhead_per_kvhead, causal, cfg, paged=None) -> str:
    pages = "" if paged is None else f", paged KV ({'TMA' if paged else 'cp.async'} loads)"
    return (f"{str(q.dtype).replace('torch.', '')}, head dims ({d}, {dv}), {qhead_per_kvhead} query heads per KV "
            f"head, causal={causal}, {cfg.describe()}{pages}")


def _compile(cache: str, version: tuple, kernel_class, fused: bool, q, k, v, outputs, cu_seqlens, cu_seqlens_k,
             config: Sm90Config, causal, what: str, seqused_k=None, page_table=None):
    """The compiled kernel of ``kernel_class`` (the fused kernel or the twin) for these tensors' static properties
    and ``config`` (compiling on a miss), with FA4's constructor arguments and compile options.

    ``outputs(to_cute_tensor)``: the kernel's output arguments, which come after ``q, k, v`` and before
    ``softmax_scale``.
    ``cu_seqlens_k`` only shapes the compile arguments: the token counts, ``max_seqlen`` and the two offset
    tensors are run-time values, so one compilation serves every call of a layer and configuration.
    With ``page_table`` (and ``seqused_k``; ``cu_seqlens_k`` None) ``k``/``v`` are the paged caches
    ``[num_pages, page_size, Hkv, D|Dv]``: FA4's paged forward, with TMA loads when ``page_size == tile_n`` (part
    of the key), cp.async loads otherwise (one compilation for every other page size: FA4 reads it at run time).
    Works on real CUDA tensors and, for compile-only checks without a GPU, on fake ``device="cuda"`` tensors
    under ``FakeTensorMode`` with ``CUTE_DSL_ARCH=sm_90a``."""
    interface = fa4_interface()
    import cutlass.cute as cute
    from flash_attn.cute.cute_dsl_utils import to_cute_tensor

    d, dv = q.shape[2], v.shape[-1]
    cfg = _valid(config, d, dv, fused)
    qhead_per_kvhead = q.shape[1] // k.shape[-2]
    dtype = interface.torch2cute_dtype_map[q.dtype]
    paged = None if page_table is None else k.shape[1] == cfg.tile_n  # None: no pages; else TMA loads or not
    tensors = (q, k, v) if page_table is None else (q, k, v, page_table)
    key = version + (dtype, d, dv, qhead_per_kvhead, causal) + tuple(cfg) + (paged,) \
        + common.layout_key(q.device, *tensors)

    def build():
        paged_args = () if page_table is None else (to_cute_tensor(seqused_k, assumed_align=4, leading_dim=0),
                                                    to_cute_tensor(page_table, assumed_align=4, leading_dim=1))
        kernel = _constructor(kernel_class, dtype, d, dv, qhead_per_kvhead, causal, cfg,
                              paged_kv_non_tma=paged is False)
        if fused and kernel.tile_hdimv != dv:  # the epilogue assumes Dv fills the tile (no hdim predication)
            raise RuntimeError(f"fa4: unexpected FA4 tile for Dv={dv}: tile_hdimv={kernel.tile_hdimv}")
        return cute.compile(
            kernel,
            to_cute_tensor(q),
            to_cute_tensor(k),
            to_cute_tensor(v),
            *outputs(to_cute_tensor),
            0.1,  # softmax_scale: a run-time Float32
            to_cute_tensor(cu_seqlens, assumed_align=4, leading_dim=0),
            None if cu_seqlens_k is None else to_cute_tensor(cu_seqlens_k, assumed_align=4, leading_dim=0),
            *paged_args,
            stream=cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options=interface._compile_options(),
        )

    return common.compiled(cache, key, build,
                           f"{what} ({_describe(q, d, dv, qhead_per_kvhead, causal, cfg, paged)})")


def compile_nvfp4_kernel(q, k, v, o, output, output_scale, scale_bytes, cu_seqlens, cu_seqlens_k, config: Sm90Config,
                         causal, *, seqused_k=None, page_table=None):
    """The compiled fused kernel for these tensors' static properties and ``config`` (:func:`_compile`; with
    ``seqused_k`` / ``page_table`` on a paged KV cache, ``cu_seqlens_k`` None)."""
    from fusion_pass.kernels.fa4.sm90_kernel import FlashAttentionForwardSm90Nvfp4

    def outputs(to_cute_tensor):
        return (to_cute_tensor(o), to_cute_tensor(output), to_cute_tensor(scale_bytes, leading_dim=0),
                to_cute_tensor(output_scale, assumed_align=4, leading_dim=0))

    return _compile("fusion_pass_fa4_sm90_nvfp4", (KERNEL_VERSION,), FlashAttentionForwardSm90Nvfp4, True, q, k, v,
                    outputs, cu_seqlens, cu_seqlens_k, config, causal, "the SM90 NVFP4 attention kernel",
                    seqused_k, page_table)


def compile_twin_kernel(q, k, v, out, lse, cu_seqlens, cu_seqlens_k, config: Sm90Config, causal, *, seqused_k=None,
                        page_table=None):
    """The compiled twin (FA4's SM90 class with the put-back of masked values, FA4's epilogue) for these tensors'
    static properties and ``config``;
    ``lse``: None or float32 ``[H, T]`` (compiled separately). Same constructor arguments and compile options as
    :func:`compile_nvfp4_kernel` (:func:`_compile`)."""
    from fusion_pass.kernels.fa4.sm90_twin import FlashAttentionForwardSm90Twin

    def outputs(to_cute_tensor):
        return to_cute_tensor(out), None if lse is None else to_cute_tensor(lse, assumed_align=4)

    kind = "twin" if lse is None else "twin+lse"
    what = f"the SM90 twin (FA4 epilogue{', LSE' if lse is not None else ''}) attention kernel"
    return _compile("fusion_pass_fa4_sm90_twin", (TWIN_VERSION, kind), FlashAttentionForwardSm90Twin, False, q, k, v,
                    outputs, cu_seqlens, cu_seqlens_k, config, causal, what, seqused_k, page_table)


def compile_unchanged_kernel(q, k, v, out, cu_seqlens, cu_seqlens_k, config: Sm90Config, causal):
    """FA4's SM90 class as FA4 ships it (no put-back of masked values: ``sm90_exact``), compiled as the twin is
    (:func:`compile_twin_kernel`, no LSE): the benchmarks' baseline for the put-back's cost; called as
    ``kernel(q, k, v, out, None, softmax_scale, cu_seqlens, cu_seqlens_k)``. No entry point runs it."""
    from fusion_pass.kernels.fa4.sm90_twin import FlashAttentionForwardSm90Unchanged

    def outputs(to_cute_tensor):
        return to_cute_tensor(out), None

    return _compile("fusion_pass_fa4_sm90_unchanged", (TWIN_VERSION, "unchanged"), FlashAttentionForwardSm90Unchanged,
                    False, q, k, v, outputs, cu_seqlens, cu_seqlens_k, config, causal,
                    "FA4's SM90 forward unchanged (the put-back's baseline)")


def _config_picker(config: Sm90Config | None):
    """``(config_class, pick)`` of the launchers: the table's configuration per class, or ``config`` for all."""
    if config is None:
        def pick(q, v, cls, causal):
            return config_for(q.shape[2], v.shape[-1], causal, cls)

        return seqlen_class, pick

    def config_class(max_seqlen, max_seqlen_k):
        return 0

    def fixed(q, v, cls, causal):
        return config

    return config_class, fixed


def launchers(config: Sm90Config | None = None) -> tuple[FusedLauncher, TwinLauncher]:
    """The fused and the twin launcher (:mod:`fusion_pass.kernels.fa4.launch`). ``config`` None: each call's
    configuration from the table (:func:`kernel_config`); else that one for every call (``bench/tune.py``)."""
    config_class, pick = _config_picker(config)

    def fused(q, k, v, o, packed, output_scale, scale_bytes, cu, cu_k, cls, causal):
        return compile_nvfp4_kernel(q, k, v, o, packed, output_scale, scale_bytes, cu, cu_k, pick(q, v, cls, causal),
                                    causal)

    def twin(q, k, v, out, lse, cu, cu_k, cls, causal):
        return compile_twin_kernel(q, k, v, out, lse, cu, cu_k, pick(q, v, cls, causal), causal)

    return (FusedLauncher("fa4_attention_nvfp4_varlen", check_args=check_fa4_args, check_buffers=check_nvfp4_buffers,
                          config_class=config_class, compile_kernel=fused, max_seqlen_arg=False),
            TwinLauncher("fa4_attention_varlen", check_args=check_fa4_args, config_class=config_class,
                         compile_kernel=twin, max_seqlen_arg=False))


def paged_launchers(config: Sm90Config | None = None) -> tuple[PagedFusedLauncher, PagedTwinLauncher]:
    """The fused and the twin launcher on a paged KV cache (:class:`.launch.PagedFusedLauncher`): as
    :func:`launchers`, the configuration of a call from the table (the longer of ``max_seqlen`` and
    ``max_seqlen_k`` picks its class) unless ``config`` fixes one."""
    config_class, pick = _config_picker(config)

    def fused(q, k, v, o, packed, output_scale, scale_bytes, cu, seqused_k, page_table, cls, causal):
        return compile_nvfp4_kernel(q, k, v, o, packed, output_scale, scale_bytes, cu, None, pick(q, v, cls, causal),
                                    causal, seqused_k=seqused_k, page_table=page_table)

    def twin(q, k, v, out, lse, cu, seqused_k, page_table, cls, causal):
        return compile_twin_kernel(q, k, v, out, lse, cu, None, pick(q, v, cls, causal), causal, seqused_k=seqused_k,
                                   page_table=page_table)

    return (PagedFusedLauncher("fa4_attention_nvfp4_paged", check_args=check_fa4_paged_args,
                               check_buffers=check_nvfp4_buffers, config_class=config_class, compile_kernel=fused,
                               max_seqlen_arg=False),
            PagedTwinLauncher("fa4_attention_paged", check_args=check_fa4_paged_args, config_class=config_class,
                              compile_kernel=twin, max_seqlen_arg=False))


FUSED, TWIN = launchers()
PAGED_FUSED, PAGED_TWIN = paged_launchers()
"""The launchers of the entry points below (:mod:`.forward` calls them directly)."""


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
    """FA4's varlen forward (the twin): ``[T, H, Dv]`` in q's dtype (and the log-sum-exp).

    ``q [T, H, D]``, ``k [Tk, Hkv, D]``, ``v [Tk, Hkv, Dv]`` (bf16/fp16, ``(D, Dv)`` in
    :data:`SUPPORTED_HEAD_DIMS`); ``cu_seqlens`` int32 ``[B+1]`` delimits the queries (and
    output rows: sequence ``b`` at rows ``[c[b], c[b+1])``, which may start past row 0),
    ``cu_seqlens_k`` (default ``cu_seqlens``; then ``Tk == T``) the keys/values; their values
    are not checked. ``max_seqlen`` / ``max_seqlen_k`` bound the query / key lengths and pick the
    configuration's sequence-length class (the kernel reads lengths from the offsets). Causal masking is
    bottom-right aligned when ``Lk != Lq``: query ``i`` sees keys ``j <= i + (Lk - Lq)`` (FA4 4.0.0b36
    ``mask.py`` ``apply_mask``: column limit ``row + 1 + seqlen_k - seqlen_q``; ``block_info.get_n_block_min_max``
    likewise). FA4's SM90 class, with the put-back of masked values (``sm90_exact``: a NaN or Inf in a value a row
    does not see reaches none of its elements), the configuration of :func:`fa4_attention_nvfp4_varlen`,
    ``pack_gqa=False`` and one CTA per tile: ``nvfp4.quantize(fa4_attention_varlen(...))`` and the fused call
    produce the same bytes.

    Returns:
        ``out``; with ``return_lse``, ``(out, lse)`` where ``lse`` float32 ``[T, H]`` is
        ``ln sum_j exp(softmax_scale * q.k_j)`` over the visible keys: a transposed view of
        FA4's ``[H, T]`` varlen LSE (strides ``(1, T)``, not contiguous; no copy). Rows
        outside ``[cu_seqlens[0], cu_seqlens[B])`` of both are not written.
    """
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
    ``H*Dv/16 .. round_up(H*Dv/16,4)-1`` of every row) are zeroed by the launcher (one
    ``index_fill_`` when there are padding rows); no other byte is touched, so rows outside the
    sequences keep theirs.
    """
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
    """FA4's paged forward (the twin of :func:`fa4_attention_nvfp4_paged`): ``[T, H, Dv]`` in q's dtype (and the
    log-sum-exp).

    ``q [T, H, D]`` (bf16/fp16, ``(D, Dv)`` in :data:`SUPPORTED_HEAD_DIMS`); ``k_cache [num_pages, page_size,
    Hkv, D]``, ``v_cache [num_pages, page_size, Hkv, Dv]`` (unit stride along the head dim, 16-byte aligned
    strides; views such as keys and values split from one ``[..., 2*D]`` cache are fine); ``cu_seqlens`` int32
    ``[B+1]``: the query (and output) rows of sequence ``b`` are ``[cu[b], cu[b+1])``; ``seqused_k`` int32 ``[B]``:
    its key count ``Lk``; ``page_table`` int32 ``[B, max_pages_per_seq]``: key ``j`` of sequence ``b`` is
    ``k_cache[page_table[b, j // page_size], j % page_size]``. Causal masking is bottom-right aligned: query ``i``
    of a sequence of ``Lq`` queries sees keys ``j <= i + Lk - Lq``, so decode rows (``Lq = 1``), prefills
    (``Lk = Lq``) and prefills after cached context (``Lk > Lq``) mix in one call. ``max_seqlen`` /
    ``max_seqlen_k`` bound the query / key lengths (``max_seqlen_k <= max_pages_per_seq * page_size``) and pick the
    configuration's class; no value of a device tensor is read on the host. FA4's SM90 class built as for
    :func:`fa4_attention_nvfp4_paged` (``pack_gqa=False``, ``paged_kv_non_tma`` unless ``page_size == tile_n``):
    ``nvfp4.quantize(fa4_attention_paged(...))`` and the fused call produce the same bytes.

    Returns ``out`` or ``(out, lse)`` as :func:`fa4_attention_varlen`."""
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
    """Attention over a paged KV cache written as NVFP4 by FA4's SM90 kernel with our epilogue, into the caller's
    buffers. Arguments as :func:`fa4_attention_paged`; ``output``, ``output_scale``, ``output_block_scale`` and
    what is written as :func:`fa4_attention_nvfp4_varlen`."""
    PAGED_FUSED(q, k_cache, v_cache, cu_seqlens, max_seqlen, seqused_k, page_table, max_seqlen_k, softmax_scale,
                causal, output, output_scale, output_block_scale)
