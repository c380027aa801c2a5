"""The manifest: every vLLM name the project depends on, as data, one entry per dependency, grouped under a comment
naming the project module that uses it (entry kinds: :mod:`entries`). An entry without ``releases`` holds for every
supported release; where a name differs between releases there is one entry per release line.

The per-release facts are not written here but taken from the project's own table,
``fusion_pass/vllm/releases.py`` (:data:`RELEASES`): the module holding each name that moved, the MLA op's extra
arguments, the statements of ``MLAAttention.forward_impl`` the fused MLA path relies on. So the table the integration
runs on and the wheels are checked against each other.

Expected argument lists are what the project's code relies on, never copied from a wheel: the fused ops'
signatures (``fusion_pass/vllm/runtime/attention_op.py``), the quant op's schema the project mirrors
(``fusion_pass/ops/library.py``), the GEMM forms' argument names (``VLLM_GEMM_FORMS``,
``VLLM_FP8_STATIC_GEMM_FORMS``, ``fusion_pass/vllm/compile/vocabulary.py``). ``test_project.py`` checks that this data still says what those
project files say.
"""

from __future__ import annotations

from .entries import (Attribute, Calls, Class, Constant, Function, Module, Name, OpSchema, PluginGroup, Returns,
                     Statements)
from .project import constant, releases

RELEASES = releases().RELEASES
"""The project's supported releases (``fusion_pass.vllm.releases.RELEASES``)."""

ATTENTION = "vllm.model_executor.layers.attention.attention.Attention"
MLA = "vllm.model_executor.layers.attention.mla_attention"
MLA_LAYER = f"{MLA}.MLAAttention"
BACKENDS = "vllm.v1.attention.backends"
CPU_ATTN = f"{BACKENDS}.cpu_attn"
FLASH_ATTN = f"{BACKENDS}.flash_attn"
FLASHINFER = f"{BACKENDS}.flashinfer"
COMMON_METADATA = "vllm.v1.attention.backend.CommonAttentionMetadata"
COMPILATION_CONFIG = "vllm.config.CompilationConfig"
FORWARD_CONTEXT = "vllm.forward_context.ForwardContext"
NVFP4_KERNELS = "vllm.model_executor.kernels.linear.nvfp4"
SCALED_MM_KERNELS = "vllm.model_executor.kernels.linear.scaled_mm"

STANDARD_OP_ARGS = ("Tensor query, Tensor key, Tensor value, Tensor(a!) output, LayerNameType layer_name, "
                    "Tensor? output_scale=None, Tensor(b!)? output_block_scale=None, Tensor? kv_cache_dummy_dep=None")
"""``fusion_pass::vllm_attention_nvfp4``'s arguments, which mirror ``vllm::unified_attention_with_output`` argument for
argument (the pass retargets a call without touching its arguments)."""

MLA_OP_ARGS = ("Tensor q, Tensor kv_c_normed, Tensor k_pe, Tensor(a!) output, LayerNameType layer_name, "
               "Tensor? output_scale=None, Tensor(b!)? output_block_scale=None, Tensor? kv_cache_dummy_dep=None, "
               "int? quant_group_size=None, bool? quant_scale_ue8m0=None, bool? quant_col_major=None, "
               "bool? quant_tma_aligned=None, Tensor? q_dcp_replicated=None")
"""``fusion_pass::vllm_mla_attention_nvfp4``'s arguments up to ``q_dcp_replicated``; a release's extra arguments
(``Release.mla_op_extra_args``) follow, as :data:`MLA_EXTRA_ARGS` declares them."""

MLA_EXTRA_ARGS = {"mqa_q_prepared": "Tensor? mqa_q_prepared=None"}
"""How the fused MLA op declares each extra argument of a release (an extra argument not listed here is compared by
name only)."""

QUANT_OUT_ARGS = ("Tensor input, Tensor input_scale, bool is_sf_swizzled_layout, *, Tensor(a!) output, "
                  "Tensor(b!) output_scale")
"""``fusion_pass::scaled_fp4_quant.out`` (``fusion_pass/ops/library.py``), which mirrors vLLM's quant: the run-time
fallback calls either as ``quant(values, global_scale, True, output=..., output_scale=...)``, and the matcher reads
its ``input``, ``input_scale``, ``is_sf_swizzled_layout``, ``output`` and ``output_scale``."""

STATIC_FP8_ARGS = "Tensor! result, Tensor input, Tensor scale, int[]? group_shape=None"
"""``fusion_pass::static_scaled_fp8_quant`` mirrors vLLM's (docs/formats.md)."""

GROUP_FP8_ARGS = ("Tensor input, Tensor(a!) output_q, Tensor(b!) output_s, int group_size, float eps, float fp8_min, "
                  "float fp8_max, bool scale_ue8m0, bool dummy_is_scale_transposed, bool dummy_is_tma_aligned")
"""``fusion_pass::per_token_group_fp8_quant`` mirrors vLLM's."""

SCHEDULER_KEYWORDS = ("num_reqs", "num_heads", "num_kv_heads", "head_dim", "seq_lens", "dtype", "query_start_loc",
                      "causal", "sliding_window_size", "isa", "enable_kv_split", "kv_cache_dtype")
"""The keywords ``fusion_pass/vllm/adapters/cpu_attn.py`` (and ``tests_vllm/standard_batches.py``) pass to
``cpu_attn_get_scheduler_metadata``."""

MOVED_CALLS = {
    "is_quantized_kv_cache": dict(params=("_",)),  # adapters/layer.py: is_quantized_kv_cache(kv_cache_dtype)
    "cpu_attn_get_scheduler_metadata": dict(keywords=SCHEDULER_KEYWORDS),  # adapters/cpu_attn.py
}
"""How the project calls each function of ``Release.modules``."""

FLASHINFER_FORWARD_SPLIT = constant("fusion_pass/vllm/adapters/flashinfer.py", "FORWARD_DECODE_SPLIT")
"""``FORWARD_DECODE_SPLIT`` of ``fusion_pass/vllm/adapters/flashinfer.py`` (read from the file, not imported): whole
lines of ``FlashInferImpl.forward``."""


def _per_release() -> tuple:
    """The entries of ``fusion_pass/vllm/releases.py``'s facts, one per release line."""
    out = []
    for r in RELEASES:
        line = (r.line,)
        for function, module in r.modules:
            out.append(Function(f"{module}.{function}", releases=line, **MOVED_CALLS.get(function, {})))
        extra = ", ".join(MLA_EXTRA_ARGS.get(a, a) for a in r.mla_op_extra_args)
        out += [
            OpSchema("vllm::unified_mla_attention_with_output", releases=line,
                     args=MLA_OP_ARGS + (", " + extra if extra else "")),
            # adapters/mla.py: forward_impl(q[:D], kv_c_normed[:D], k_pe[:D], kv_cache, md, output=out, **extra)
            Function(f"{MLA_LAYER}.forward_impl", releases=line,
                     params=("q", "k_c_normed", "k_pe", "kv_cache", "attn_metadata"),
                     keywords=("output", *r.mla_op_extra_args)),
            Statements(f"{MLA_LAYER}.forward_impl", releases=line, statements=r.mla_decode_split),
        ]
    return tuple(out)


ENTRIES = (
    # fusion_pass/vllm/releases.py: per-release facts (moved functions, the MLA op, MLAAttention.forward_impl)
    *_per_release(),

    # fusion_pass/vllm/releases.py, compile/inductor_pass.py: the release gate and the pass's uuid / report
    Name("vllm.__version__"),

    # fusion_pass/vllm/compile/inductor_pass.py: the pass
    Class("vllm.compilation.passes.inductor_pass.InductorPass"),
    Function("vllm.compilation.passes.inductor_pass.InductorPass.uuid"),  # overridden
    Module("vllm.model_executor.layers.attention"),  # imported to register vllm::*attention* ops
    Function("vllm.config.get_current_vllm_config"),
    Attribute("vllm.config.VllmConfig", "compilation_config"),

    # fusion_pass_vllm.py, fusion_pass/vllm/compile/registration.py: how vLLM resolves "fusion_pass_vllm.PASS"
    Attribute(COMPILATION_CONFIG, "inductor_passes"),
    Statements(f"{COMPILATION_CONFIG}.__post_init__", statements=("func = __import__(module).__dict__[func_name]",)),

    # fusion_pass/vllm/notices.py: why the pass cannot act (config checks)
    Attribute(COMPILATION_CONFIG, "mode"),
    Constant("vllm.config.CompilationMode.NONE", value=0),  # `int(mode) == 0`: not compiled
    Attribute(COMPILATION_CONFIG, "splitting_ops"),
    Attribute(COMPILATION_CONFIG, "use_inductor_graph_partition"),
    Attribute(COMPILATION_CONFIG, "inductor_compile_config"),  # ["post_grad_custom_post_pass"]
    Attribute("vllm.compilation.passes.pass_manager.PostGradPassManager", "passes"),
    Attribute(COMPILATION_CONFIG, "use_breakable_cudagraph", releases=("0.34",)),  # 0.32 / 0.33: the environment
    Attribute("vllm.config.VllmConfig", "model_config"),
    Attribute("vllm.config.ModelConfig", "enforce_eager"),

    # fusion_pass/vllm/plugin.py (pyproject.toml's entry point): registration in every vLLM process
    PluginGroup("vllm.general_plugins", loader="vllm.plugins.load_general_plugins"),
    Function("vllm.v1.attention.backend.AttentionMetadataBuilder.__init__"),  # wrapped: the config check
    Attribute("vllm.v1.attention.backend.AttentionMetadataBuilder", "vllm_config"),

    # fusion_pass/vllm/compile/layer_check.py: the layer while a graph is compiled
    Function("vllm.config.get_current_vllm_config_or_none"),
    Attribute(COMPILATION_CONFIG, "static_forward_context"),
    Function("vllm.forward_context.is_forward_context_available"),

    # fusion_pass/vllm/runtime/attention_op.py: the fused ops and the forward context
    Name("vllm.utils.torch_utils.LayerNameType"),
    Function("vllm.utils.torch_utils.direct_register_custom_op", params=("op_name", "op_func"),
             keywords=("mutates_args", "fake_impl", "target_lib", "dispatch_key")),
    OpSchema("vllm::unified_attention_with_output", args=STANDARD_OP_ARGS),
    Module("vllm.forward_context"),
    Function("vllm.forward_context.get_forward_context"),
    # _context() reads the forward context as vLLM's own get_attention_context does
    Statements("vllm.model_executor.layers.attention.attention.get_attention_context", statements=(
        "attn_metadata = attn_metadata_raw[layer_name]", "attn_metadata = attn_metadata_raw[0][layer_name]",
        "forward_context.no_compile_layers[layer_name]", "kv_cache = attn_layer.kv_cache")),
    Attribute(FORWARD_CONTEXT, "attn_metadata"),
    Attribute(FORWARD_CONTEXT, "no_compile_layers"),
    Attribute(ATTENTION, "kv_cache"),
    Attribute(MLA_LAYER, "kv_cache"),
    Module("vllm.model_executor.layers.attention.kv_transfer_utils"),
    Function("vllm.model_executor.layers.attention.kv_transfer_utils.maybe_transfer_kv_layer", params=("func",)),
    Function("vllm.model_executor.layers.attention.kv_transfer_utils.has_kv_transfer_group"),

    # fusion_pass/vllm/runtime/guard.py: DCP, the layer name
    Function("vllm.distributed.parallel_state.get_dcp_group"),
    Attribute("vllm.distributed.parallel_state.GroupCoordinator", "world_size"),
    Attribute("vllm.utils.torch_utils.LayerName", "value"),

    # fusion_pass/vllm/runtime/nvfp4_rows.py, compile/vocabulary.py: the quant the unfused graph calls
    OpSchema("_C::scaled_fp4_quant.out", args=QUANT_OUT_ARGS),
    # fusion_pass/ops/library.py, formats/fp8.py, vllm/compile/vocabulary.py: the FP8 quants (docs/formats.md)
    OpSchema("_C::static_scaled_fp8_quant", args=STATIC_FP8_ARGS),
    OpSchema("_C::per_token_group_fp8_quant", args=GROUP_FP8_ARGS),

    # fusion_pass/vllm/adapters/layer.py: what a layer computes, its dims
    Attribute(ATTENTION, "num_heads"),
    Attribute(ATTENTION, "head_size"),
    Attribute(ATTENTION, "num_kv_heads"),
    Attribute(ATTENTION, "kv_cache_dtype"),
    Attribute(ATTENTION, "sliding_window"),
    Attribute(ATTENTION, "attn_type"),
    Attribute(ATTENTION, "kv_sharing_target_layer_name"),
    Attribute(ATTENTION, "layer_name"),
    Attribute(ATTENTION, "impl"),
    Attribute(MLA_LAYER, "kv_b_proj"),
    Attribute(MLA_LAYER, "qk_nope_head_dim"),
    Attribute(MLA_LAYER, "qk_rope_head_dim"),
    Attribute(MLA_LAYER, "v_head_dim"),
    Attribute(MLA_LAYER, "num_heads"),
    Attribute(MLA_LAYER, "kv_cache_dtype"),
    Attribute(MLA_LAYER, "layer_name"),
    Attribute(MLA_LAYER, "impl"),
    Attribute(MLA_LAYER, "hisparse_cache"),
    Attribute(MLA_LAYER, "use_pcp"),
    Attribute(MLA_LAYER, "is_amx_bmm_enabled"),
    Attribute("vllm.v1.attention.backend.MLAAttentionImpl", "is_sparse"),

    # fusion_pass/vllm/adapters/registry.py: a layer's backend by name, the host-rows hooks
    Attribute(ATTENTION, "attn_backend"),
    Returns(f"{CPU_ATTN}.CPUAttentionBackend.get_name", value="CPU_ATTN"),
    Returns(f"{FLASH_ATTN}.FlashAttentionBackend.get_name", value="FLASH_ATTN"),
    Returns(f"{FLASHINFER}.FlashInferBackend.get_name", value="FLASHINFER"),

    # fusion_pass/vllm/adapters/host_rows.py: the build hook and the host rows
    Function(f"{CPU_ATTN}.CPUAttentionMetadataBuilder.build", params=("common_prefix_len", "common_attn_metadata")),
    Function(f"{FLASH_ATTN}.FlashAttentionMetadataBuilder.build", params=("common_prefix_len", "common_attn_metadata")),
    Function(f"{FLASHINFER}.FlashInferMetadataBuilder.build", params=("common_prefix_len", "common_attn_metadata")),
    Attribute(COMMON_METADATA, "query_start_loc_cpu"),
    Attribute(COMMON_METADATA, "seq_lens_cpu_upper_bound"),
    Attribute(COMMON_METADATA, "num_reqs"),
    Attribute(COMMON_METADATA, "block_table_tensor"),
    Attribute(COMMON_METADATA, "seq_lens"),  # adapters/paged.py: one paged launch reads every request's keys
    Attribute(f"{MLA}.MLACommonMetadata", "num_actual_tokens"),
    Attribute(f"{MLA}.MLACommonMetadata", "num_decode_tokens"),
    Attribute(f"{MLA}.MLACommonMetadata", "num_prefills"),
    Attribute(f"{MLA}.MLACommonMetadata", "prefill"),
    Attribute(f"{MLA}.MLACommonPrefillMetadata", "query_lens_cpu"),
    Attribute(f"{MLA}.MLACommonPrefillMetadata", "chunked_context"),
    Attribute(f"{MLA}.MLACommonPrefillMetadata.ChunkedContextMetadata", "context_lens_list"),

    # fusion_pass/vllm/runtime/fused_rows.py, adapters/mla.py: MLA prefill rows and their cached latents
    Class(MLA_LAYER),  # adapters/mla.py: a layer's forward_impl must be MLAAttention.forward_impl
    Attribute(MLA_LAYER, "kv_lora_rank"),
    Attribute(MLA_LAYER, "scale"),
    Attribute(f"{MLA}.MLACommonPrefillMetadata", "block_table"),

    # fusion_pass/vllm/adapters/cpu_attn.py: CPU_ATTN's metadata, cache write and decode sub-batch
    Attribute(f"{CPU_ATTN}.CPUAttentionMetadata", "num_actual_tokens"),
    Attribute(f"{CPU_ATTN}.CPUAttentionMetadata", "num_decode_tokens"),
    Attribute(f"{CPU_ATTN}.CPUAttentionMetadata", "max_query_len"),
    Attribute(f"{CPU_ATTN}.CPUAttentionMetadata", "query_start_loc"),
    Attribute(f"{CPU_ATTN}.CPUAttentionMetadata", "seq_lens"),
    Attribute(f"{CPU_ATTN}.CPUAttentionMetadata", "block_table"),
    Attribute(f"{CPU_ATTN}.CPUAttentionMetadata", "max_seq_len"),
    Attribute(f"{CPU_ATTN}.CPUAttentionMetadata", "scheduler_metadata"),
    Attribute(f"{CPU_ATTN}.CPUAttentionMetadata", "causal"),
    Attribute(f"{CPU_ATTN}.CPUAttentionMetadata", "dynamic_causal"),
    Statements(f"{CPU_ATTN}.CPUAttentionMetadataBuilder", statements=("layer.isa = self.isa",)),  # layer.isa
    Function(f"{CPU_ATTN}.CPUAttentionBackendImpl.forward",
             params=("layer", "query", "key", "value", "kv_cache", "attn_metadata"), keywords=("output",)),
    Function(f"{CPU_ATTN}.CPUAttentionBackendImpl.do_kv_cache_update",
             params=("layer", "key", "value", "kv_cache", "slot_mapping")),
    Attribute(f"{CPU_ATTN}.CPUAttentionBackendImpl", "head_size"),
    Attribute(f"{CPU_ATTN}.CPUAttentionBackendImpl", "num_heads"),
    Attribute(f"{CPU_ATTN}.CPUAttentionBackendImpl", "num_kv_heads"),
    Attribute(f"{CPU_ATTN}.CPUAttentionBackendImpl", "kv_cache_dtype"),
    Attribute(f"{CPU_ATTN}.CPUAttentionBackendImpl", "scale"),
    Attribute(f"{CPU_ATTN}.CPUAttentionBackendImpl", "sliding_window"),
    Attribute(f"{CPU_ATTN}.CPUAttentionBackendImpl", "alibi_slopes"),
    Attribute(f"{CPU_ATTN}.CPUAttentionBackendImpl", "sinks"),
    Attribute(f"{CPU_ATTN}.CPUAttentionBackendImpl", "logits_soft_cap"),

    # fusion_pass/vllm/adapters/flash_attn.py: FLASH_ATTN's metadata and decode sub-batch
    Attribute(f"{FLASH_ATTN}.FlashAttentionMetadata", "num_actual_tokens"),
    Attribute(f"{FLASH_ATTN}.FlashAttentionMetadata", "max_query_len"),
    Attribute(f"{FLASH_ATTN}.FlashAttentionMetadata", "query_start_loc"),
    Attribute(f"{FLASH_ATTN}.FlashAttentionMetadata", "max_seq_len"),
    Attribute(f"{FLASH_ATTN}.FlashAttentionMetadata", "seq_lens"),
    Attribute(f"{FLASH_ATTN}.FlashAttentionMetadata", "block_table"),
    Attribute(f"{FLASH_ATTN}.FlashAttentionMetadata", "slot_mapping"),
    Attribute(f"{FLASH_ATTN}.FlashAttentionMetadata", "scheduler_metadata"),
    Attribute(f"{FLASH_ATTN}.FlashAttentionMetadata", "max_num_splits"),
    Attribute(f"{FLASH_ATTN}.FlashAttentionMetadata", "causal"),
    Attribute(f"{FLASH_ATTN}.FlashAttentionMetadata", "mm_prefix_query_range_tensor"),
    Attribute(f"{FLASH_ATTN}.FlashAttentionMetadata", "rswa_prefix_lens"),
    Attribute(f"{FLASH_ATTN}.FlashAttentionMetadata", "dcp_context_kv_lens"),
    Function(f"{FLASH_ATTN}.FlashAttentionImpl.forward",
             params=("layer", "query", "key", "value", "kv_cache", "attn_metadata"), keywords=("output",)),
    Attribute(f"{FLASH_ATTN}.FlashAttentionImpl", "head_size"),
    Attribute(f"{FLASH_ATTN}.FlashAttentionImpl", "sliding_window"),
    Attribute(f"{FLASH_ATTN}.FlashAttentionImpl", "alibi_slopes"),
    Attribute(f"{FLASH_ATTN}.FlashAttentionImpl", "sinks"),
    Attribute(f"{FLASH_ATTN}.FlashAttentionImpl", "logits_soft_cap"),
    Attribute(f"{FLASH_ATTN}.FlashAttentionImpl", "scale"),

    # fusion_pass/vllm/adapters/flashinfer.py: FLASHINFER's metadata, decode part and forward
    Attribute(f"{FLASHINFER}.FlashInferMetadata", "num_actual_tokens"),
    Attribute(f"{FLASHINFER}.FlashInferMetadata", "num_decodes"),
    Attribute(f"{FLASHINFER}.FlashInferMetadata", "num_decode_tokens"),
    Attribute(f"{FLASHINFER}.FlashInferMetadata", "num_prefills"),
    Attribute(f"{FLASHINFER}.FlashInferMetadata", "num_prefill_tokens"),
    Attribute(f"{FLASHINFER}.FlashInferMetadata", "q_data_type_prefill"),
    Attribute(f"{FLASHINFER}.FlashInferMetadata", "q_data_type_decode"),
    Attribute(f"{FLASHINFER}.FlashInferMetadata", "prefill"),
    Attribute(f"{FLASHINFER}.FlashInferMetadata", "decode"),
    Attribute(f"{FLASHINFER}.FlashInferMetadata", "causal"),  # one_call_refusal
    Class(f"{FLASHINFER}.FIDecode"),  # DECODE_KINDS: by class name
    Class(f"{FLASHINFER}.FlashInferTrtllmAPIDecode"),
    Attribute(f"{FLASHINFER}.FlashInferTrtllmAPIDecode", "kernel"),
    Attribute(f"{FLASHINFER}.FlashInferTrtllmAPIDecode", "dcp_query_start_loc"),
    Constant(f"{FLASHINFER}.FlashInferDecodeKernel.TRTLLM_GEN", value="trtllm-gen"),
    Constant(f"{FLASHINFER}.FlashInferDecodeKernel.XQA", value="xqa"),
    Function(f"{FLASHINFER}.FlashInferImpl.forward",
             params=("layer", "query", "key", "value", "kv_cache", "attn_metadata"), keywords=("output",)),
    Statements(f"{FLASHINFER}.FlashInferImpl.forward", statements=FLASHINFER_FORWARD_SPLIT, whole_lines=True),
    Attribute(f"{FLASHINFER}.FlashInferImpl", "head_size"),  # also the paged views: transpose(1, 2).split(...)
    Attribute(f"{FLASHINFER}.FlashInferImpl", "scale"),  # runtime/fused_standard.py: the softmax scale
    Attribute(f"{FLASHINFER}.FlashInferImpl", "sinks"),

    # fusion_pass/vllm/compile/vocabulary.py: the other quants and the NVFP4 GEMM forms (VLLM_GEMM_FORMS)
    # (_C::static_scaled_fp8_quant and per_token_group_fp8_quant: with their schemas above; other formats)
    # the FP8 forms refused under their names (fusion_pass/formats/fp8.py REFUSED)
    OpSchema("_C::dynamic_per_token_scaled_fp8_quant"),
    OpSchema("_C::dynamic_scaled_fp8_quant"),
    OpSchema("_C::per_token_group_fp8_quant_packed"),
    OpSchema("vllm::flashinfer_nvfp4_quantize"),  # 8x4 scales: refused
    OpSchema("vllm::flashinfer_mm_fp4", has=("A", "A_scale", "backend", "use_nvfp4", "block_size", "use_8x4_sf_layout")),
    OpSchema("_C::cutlass_scaled_fp4_mm", has=("a", "block_scale_a")),
    # the FlashInfer kernels pass backend=...; use_nvfp4 and block_size come from the wrapper's defaults
    Function("vllm.utils.flashinfer.flashinfer_scaled_fp4_mm", defaults=(("block_size", 16), ("use_nvfp4", True))),
    Calls(f"{NVFP4_KERNELS}.flashinfer.FlashInferCuteDslNvFp4LinearKernel", callee="flashinfer_scaled_fp4_mm",
          keywords=(("backend", "cute-dsl"),)),
    Calls(f"{NVFP4_KERNELS}.flashinfer.FlashInferCutlassNvFp4LinearKernel", callee="flashinfer_scaled_fp4_mm",
          keywords=(("backend", "cutlass"),)),
    Calls(f"{NVFP4_KERNELS}.flashinfer.FlashInferB12xNvFp4LinearKernel", callee="flashinfer_scaled_fp4_mm",
          keywords=(("backend", "b12x"),)),
    Calls(f"{NVFP4_KERNELS}.cutlass.CutlassNvFp4LinearKernel", callee="cutlass_scaled_fp4_mm"),
    Calls(f"{NVFP4_KERNELS}.flashinfer.FlashInferTrtllmNvFp4LinearKernel", callee="flashinfer_scaled_fp4_mm",
          keywords=(("backend", "trtllm"),)),
    Calls(f"{NVFP4_KERNELS}.flashinfer.FlashInferCudnnNvFp4LinearKernel", callee="flashinfer_scaled_fp4_mm",
          keywords=(("backend", "cudnn"),)),
    Calls(f"{NVFP4_KERNELS}.fbgemm.FbgemmNvFp4LinearKernel", callee="torch.ops.fbgemm.f4f4bf16",
          keywords=(("use_mx", False),)),  # fbgemm::f4f4bf16 is fbgemm_gpu's: its schema is not in the wheel
    Class(f"{NVFP4_KERNELS}.b12x.B12xNvFp4LinearKernel"),  # b12x::blockscaled_nvfp4 is the b12x package's
    Calls(f"{NVFP4_KERNELS}.pytorch.TorchNvFp4LinearKernel", callee="torch._scaled_mm"),

    # fusion_pass/vllm/compile/vocabulary.py: the static FP8 GEMM forms (VLLM_FP8_STATIC_GEMM_FORMS) and
    # torch._scaled_mm (the project's form); the quant, _C::static_scaled_fp8_quant, with its schema above
    OpSchema("_C::cutlass_scaled_mm", has=("a", "a_scales")),
    OpSchema("vllm::bmm_fp8", has=("A", "A_scale")),
    Calls(f"{SCALED_MM_KERNELS}.cutlass.CutlassFP8ScaledMMLinearKernel", callee="ops.cutlass_scaled_mm"),
    # vLLM's wrapper passes the activation and its scale as the op's a / a_scales
    Statements("vllm._custom_ops.cutlass_scaled_mm",
               statements=("torch.ops._C.cutlass_scaled_mm(out, a, b, scale_a, scale_b, bias)",)),
    Calls(f"{SCALED_MM_KERNELS}.flashinfer.FlashInferFP8ScaledMMLinearKernel", callee="flashinfer_scaled_fp8_mm"),
    Function("vllm.utils.flashinfer.flashinfer_scaled_fp8_mm", params=("a", "b", "scale_a", "scale_b")),
    Statements("vllm.utils.flashinfer.flashinfer_scaled_fp8_mm", statements=("a.unsqueeze(0)",)),  # A: a view
    Calls(f"{SCALED_MM_KERNELS}.pytorch.PerTensorTorchFP8ScaledMMLinearKernel", callee="torch._scaled_mm"),

    # fusion_pass/vllm/compile/vocabulary.py: the group FP8 GEMM forms (VLLM_FP8_GROUP_GEMM_FORMS); the quant,
    # _C::per_token_group_fp8_quant, with its schema above, called with the scales in the layout the kernel asks for
    OpSchema("vllm::fp8_gemm_nt_op", has=("q_input", "input_scale")),
    Calls(f"{SCALED_MM_KERNELS}.deep_gemm.DeepGemmFp8BlockScaledMMKernel", callee="torch.ops.vllm.fp8_gemm_nt_op"),
    Calls(f"{SCALED_MM_KERNELS}.cutlass.CutlassFp8BlockScaledMMKernel", callee="ops.cutlass_scaled_mm"),
    # a checkpoint with blocked weights gets +quant_fp8: the quant is the op, not QuantFP8's native form
    Statements("vllm.config.vllm.VllmConfig", statements=('custom_ops.append("+quant_fp8")',)),
    Statements("vllm.model_executor.layers.quantization.utils.fp8_utils.per_token_group_quant_fp8",
               statements=("torch.ops._C.per_token_group_fp8_quant(x, x_q, x_s, group_size, eps, fp8_min, fp8_max, "
                           "use_ue8m0, column_major_scales, tma_aligned_scales,)",)),

    # tests_vllm/ (the engine suite, run on vLLM's CPU build): what it imports and calls
    Function("vllm.config.set_current_vllm_config"),
    Constant("vllm.config.CompilationMode.VLLM_COMPILE", value=3),
    Class("vllm.compilation.backends.VllmBackend"),
    Function("vllm.platforms.cpu.CpuPlatform.check_and_update_config"),
    Class("vllm.LLM"),
    Class("vllm.SamplingParams"),
    Module("vllm.entrypoints.openai.api_server"),
    Attribute(COMPILATION_CONFIG, "backend"),
    Class("vllm.model_executor.model_loader.dummy_loader.DummyModelLoader"),
    Class("vllm.model_executor.layers.linear.LinearBase"),
    Class("vllm.model_executor.layers.linear.LinearMethodBase"),
    Class("vllm.model_executor.layers.linear.UnquantizedLinearMethod"),
    Function("vllm.model_executor.layers.quantization.register_quantization_config"),
    Class("vllm.model_executor.layers.quantization.base_config.QuantizationConfig"),
    Class("vllm.model_executor.parameter.ModelWeightParameter"),
    Function("vllm.model_executor.utils.set_weight_attrs"),
    Function(f"{CPU_ATTN}._get_attn_isa"),
    Function("vllm.model_executor.layers.attention.attention._encode_layer_name"),
    Module("vllm.utils.flashinfer"),
    Function(f"{BACKENDS}.utils.split_decodes_and_prefills"),  # test_vllm_flashinfer.py
)
"""Every entry; :func:`for_release` gives those of one release."""


def for_release(version: str) -> list:
    """The entries that apply to release ``version`` (``"0.34.0"``)."""
    return [e for e in ENTRIES if e.applies(version)]
