"""The checker can fail: on the real wheel of the first release checked, an entry of every kind, made wrong in one
detail (a name that does not exist, one argument of a schema changed, a wrong constant, ...), is reported with
the release, the name and what differs; and the same entry unchanged passes."""

from __future__ import annotations

import re

import pytest

from . import names
from .entries import (Attribute, Calls, Class, Constant, Function, Module, Name, OpSchema, PluginGroup, Returns,
                      Statements)
from .fetch import releases_to_check

BUILDER = f"{names.FLASH_ATTN}.FlashAttentionMetadataBuilder"
KERNEL = f"{names.NVFP4_KERNELS}.flashinfer.FlashInferCutlassNvFp4LinearKernel"
ENUM = f"{names.FLASHINFER}.FlashInferDecodeKernel"
CHANGED_ARGS = names.STANDARD_OP_ARGS.replace("Tensor? kv_cache_dummy_dep=None", "Tensor? kv_cache_dep=None")

# (an entry that holds, the same entry made wrong, what the failure must say)
CASES = {
    "missing_method": (Function(f"{BUILDER}.build"), Function(f"{BUILDER}.build_all"),
                       rf"^vllm \S+: {re.escape(BUILDER)}\.build_all: not found$"),
    "missing_module": (Module("vllm.forward_context"), Module("vllm.forward_contexts"), r": not found$"),
    "missing_class": (Class(f"{names.FLASHINFER}.FIDecode"), Class(f"{names.FLASHINFER}.FIDecoder"), r": not found$"),
    "missing_name": (Name("vllm.utils.torch_utils.LayerNameType"), Name("vllm.utils.torch_utils.LayerNameTypes"),
                     r": not found$"),
    "missing_attribute": (Attribute(names.MLA_LAYER, "kv_b_proj"), Attribute(names.MLA_LAYER, "kv_c_proj"),
                          r"MLAAttention\.kv_c_proj: not found$"),
    "attribute_of_missing_class": (Attribute(names.COMMON_METADATA, "num_reqs"),
                                   Attribute(names.COMMON_METADATA + "s", "num_reqs"), r": class \S+ not found$"),
    "schema_argument_renamed": (OpSchema("vllm::unified_attention_with_output", args=names.STANDARD_OP_ARGS),
                                OpSchema("vllm::unified_attention_with_output", args=CHANGED_ARGS),
                                r"arguments differ at \S+attention\.py:\d+: argument 8: the project has "
                                r"`Tensor\? kv_cache_dep=None`, the wheel `Tensor\? kv_cache_dummy_dep=None`"),
    "native_schema_argument_renamed": (OpSchema("_C::scaled_fp4_quant.out", args=names.QUANT_OUT_ARGS),
                                       OpSchema("_C::scaled_fp4_quant.out",
                                                args=names.QUANT_OUT_ARGS.replace("input_scale", "global_scale")),
                                       r"arguments differ at vllm/_C\S*\.so: argument 2"),
    "schema_argument_missing": (OpSchema("_C::cutlass_scaled_fp4_mm", has=("a", "block_scale_a")),
                                OpSchema("_C::cutlass_scaled_fp4_mm", has=("a", "a_scale")),
                                r"has no argument a_scale"),
    "missing_op": (OpSchema("vllm::flashinfer_nvfp4_quantize"), OpSchema("vllm::flashinfer_nvfp5_quantize"),
                   r": not defined"),
    "parameter_renamed": (Function(f"{BUILDER}.build", params=("common_prefix_len", "common_attn_metadata")),
                          Function(f"{BUILDER}.build", params=("common_prefix_len", "common_metadata")),
                          r"positional parameters \(common_prefix_len, common_attn_metadata, fast_build\)"),
    "keyword_not_taken": (Function("vllm.utils.torch_utils.direct_register_custom_op", keywords=("fake_impl",)),
                          Function("vllm.utils.torch_utils.direct_register_custom_op", keywords=("fake_fn",)),
                          r"takes no keyword fake_fn"),
    "default_changed": (Function("vllm.utils.flashinfer.flashinfer_scaled_fp4_mm", defaults=(("block_size", 16),)),
                        Function("vllm.utils.flashinfer.flashinfer_scaled_fp4_mm", defaults=(("block_size", 32),)),
                        r"default of block_size is 16, the project relies on 32"),
    "returns_other": (Returns(f"{names.CPU_ATTN}.CPUAttentionBackend.get_name", value="CPU_ATTN"),
                      Returns(f"{names.CPU_ATTN}.CPUAttentionBackend.get_name", value="CPU_ATTENTION"),
                      r"returns 'CPU_ATTN', not 'CPU_ATTENTION'"),
    "constant_other": (Constant(f"{ENUM}.XQA", value="xqa"), Constant(f"{ENUM}.XQA", value="xqa-gen"),
                       r"is 'xqa', not 'xqa-gen'"),
    "statement_missing": (Statements(f"{names.COMPILATION_CONFIG}.__post_init__",
                                     statements=("func = __import__(module).__dict__[func_name]",)),
                          Statements(f"{names.COMPILATION_CONFIG}.__post_init__",
                                     statements=("func = importlib.import_module(module)",)),
                          r"has no statement 'func = importlib.import_module\(module\)'"),
    "call_with_other_keyword": (Calls(KERNEL, callee="flashinfer_scaled_fp4_mm", keywords=(("backend", "cutlass"),)),
                                Calls(KERNEL, callee="flashinfer_scaled_fp4_mm", keywords=(("backend", "cudnn"),)),
                                r"calls flashinfer_scaled_fp4_mm with backend='cutlass', not backend='cudnn'"),
    "plugin_group_other": (PluginGroup("vllm.general_plugins", loader="vllm.plugins.load_general_plugins"),
                           PluginGroup("vllm.generic_plugins", loader="vllm.plugins.load_general_plugins"),
                           r"passes group 'vllm.generic_plugins' to no function"),
}


@pytest.fixture(scope="module")
def wheel(wheels):
    return wheels(releases_to_check()[0])


@pytest.mark.parametrize("case", list(CASES))
def test_a_wrong_entry_is_reported(wheel, case):
    right, wrong, said = CASES[case]
    assert right.failures(wheel) == [], "the unchanged entry must hold for the test to mean anything"
    failures = wrong.failures(wheel)
    assert failures, f"{case}: the checker did not report {wrong}"
    assert all(f.startswith(f"vllm {wheel.version}: {wrong.name}: ") for f in failures)
    assert any(re.search(said, f, re.S | re.M) for f in failures), failures
