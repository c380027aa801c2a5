"""A test-only NVFP4 linear method for vLLM (never for serving): ``quant_method: "fusion_pass_test_nvfp4"``.

Its o_proj runs ``fusion_pass::scaled_fp4_quant.out`` + ``fusion_pass::nvfp4_gemm`` (standing in for
``_C::scaled_fp4_quant`` / ``cutlass_scaled_fp4_mm``, absent from vLLM's CPU build), so that a real
``vllm.LLM`` on CPU has attention -> NVFP4 quant -> NVFP4 GEMM in its compiled graph. Weights are
created in bf16 (vLLM's dummy loader fills floating-point parameters only) and quantized after loading;
the activation global scale is fixed.

Registered through vLLM's out-of-tree quantization API by the plugin when
``FUSION_PASS_VLLM_IMPORT=nvfp4_test_quant`` (it must be registered in every vLLM process; tests_vllm/ is on
``PYTHONPATH``).
"""

from typing import Any

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.parameter import ModelWeightParameter
from vllm.model_executor.utils import set_weight_attrs

import fusion_pass.ops as fp_ops
from fusion_pass import nvfp4

NAME = "fusion_pass_test_nvfp4"
ACT_GLOBAL_SCALE = 448.0 * 6.0 / 0.05  # dummy weights keep activations small


@register_quantization_config(NAME)
class TestNvfp4Config(QuantizationConfig):
    def __init__(self, targets=("o_proj",)):
        super().__init__()
        self.targets = tuple(targets)

    def get_name(self):
        return NAME

    def get_supported_act_dtypes(self):
        return [torch.bfloat16]

    @classmethod
    def get_min_capability(cls):
        return 0

    @staticmethod
    def get_config_filenames():
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]):
        return cls(config.get("targets", ["o_proj"]))

    def get_quant_method(self, layer, prefix):
        if isinstance(layer, LinearBase):
            if prefix.split(".")[-1] in self.targets:
                return TestNvfp4LinearMethod()
            return UnquantizedLinearMethod()
        return None


class TestNvfp4LinearMethod(LinearMethodBase):
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        weight_loader = extra_weight_attrs.pop("weight_loader")
        w = ModelWeightParameter(data=torch.empty(sum(output_partition_sizes), input_size_per_partition,
                                                  dtype=params_dtype),
                                 input_dim=1, output_dim=0, weight_loader=weight_loader)
        layer.register_parameter("weight", w)
        set_weight_attrs(w, extra_weight_attrs)

    def process_weights_after_loading(self, layer):
        w = layer.weight.data.float()
        gs_w = torch.tensor([448.0 * 6.0 / max(w.abs().max().item(), 1e-12)], dtype=torch.float32)
        packed, scales = nvfp4.quantize(w, gs_w)
        gs_a = torch.tensor([ACT_GLOBAL_SCALE], dtype=torch.float32)
        layer.weight_packed = Parameter(packed, requires_grad=False)
        layer.weight_scale = Parameter(scales, requires_grad=False)
        layer.input_global_scale = Parameter(gs_a, requires_grad=False)
        layer.alpha = Parameter(1.0 / (gs_a * gs_w), requires_grad=False)
        del layer.weight

    def apply(self, layer, x, bias=None):
        a, a_scale = fp_ops.scaled_fp4_quant(x, layer.input_global_scale)
        out = torch.ops.fusion_pass.nvfp4_gemm(a, layer.weight_packed, a_scale, layer.weight_scale,
                                               layer.alpha, x.dtype)
        return out if bias is None else out + bias
