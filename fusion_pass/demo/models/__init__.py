"""Demo models: a DeepSeek-V3-style MLA attention stack and a GQA stack, both with an NVFP4 o_proj."""

from fusion_pass.demo.models.common import AttentionStack, calibrate_nvfp4_inputs, release_layers
from fusion_pass.demo.models.deepseek import MLAConfig, build_mla_model
from fusion_pass.demo.models.gqa import GQAConfig, build_gqa_model

__all__ = ["AttentionStack", "GQAConfig", "MLAConfig", "build_gqa_model", "build_mla_model", "calibrate_nvfp4_inputs",
           "release_layers"]
