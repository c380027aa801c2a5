"""A test-only static per-tensor FP8 linear method for vLLM (never for serving): ``quant_method: "fusion_pass_test_fp8"``.

Its o_proj quantizes its input with the static FP8 quant op the pass's vLLM vocabulary binds (vLLM's
``_C::static_scaled_fp8_quant`` where the build defines it, else ``fusion_pass::static_scaled_fp8_quant``, same schema:
``(result, input, scale)``; vLLM's CPU build has only the latter) into a ``[T, K]`` float8_e4m3fn buffer and multiplies
with ``torch._scaled_mm`` (``scale_a`` the static scale), as vLLM's ``PerTensorTorchFP8ScaledMMLinearKernel`` does, so
that a real ``vllm.LLM`` on CPU has attention -> static FP8 quant -> FP8 GEMM in its compiled graph. With ``"native":
true`` in the quantization config the o_proj quantizes with vLLM's own ``QuantFP8(static=True, GroupShape.PER_TENSOR)``
instead, whose default compile (``custom_ops="none"``; on CPU always) is the native form: aten ops, no quant op. Weights are
created in bf16 (vLLM's dummy loader fills floating-point parameters only) and quantized per tensor after loading;
the activation scale is fixed (:data:`ACT_SCALE`).

With ``"group": {"ue8m0": bool, "layout": "row_major" | "column_major" | "column_major_tma"}`` the o_proj is a
block-FP8 linear instead (DeepSeek-style): the weight quantized per 128x128 block, the activation by the group FP8
quant op the vocabulary binds (vLLM's ``_C::per_token_group_fp8_quant`` where the build defines it, else the project's)
into codes and float32 scales allocated as vLLM's ``per_token_group_quant_fp8`` allocates them for that layout, then
``fusion_pass::fp8_group_gemm`` (vLLM's CPU build has no block-FP8 GEMM).

Registered through vLLM's out-of-tree quantization API when ``FUSION_PASS_VLLM_IMPORT`` names this module (it must be
registered in every vLLM process; tests_vllm/ is on ``PYTHONPATH``).
"""

from typing import Any

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.parameter import ModelWeightParameter
from vllm.model_executor.utils import set_weight_attrs

from fusion_pass.vllm.runtime.fp8_static_rows import static_quant_op

NAME = "fusion_pass_test_fp8"
FP8_MAX = 448.0
ACT_SCALE = 0.05 / FP8_MAX  # the attention output of the tiny models (unit norms, dummy weights) stays near 1e-2


@register_quantization_config(NAME)
class TestFp8Config(QuantizationConfig):
    def __init__(self, targets=("o_proj",), native=False, group=None):
        super().__init__()
        self.targets, self.native, self.group = tuple(targets), bool(native), group

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
        return cls(config.get("targets", ["o_proj"]), config.get("native", False), config.get("group"))

    def get_quant_method(self, layer, prefix):
        if isinstance(layer, LinearBase):
            if prefix.split(".")[-1] in self.targets:
                if self.group is not None:
                    return TestFp8GroupLinearMethod(bool(self.group.get("ue8m0")),
                                                    self.group.get("layout", "column_major"))
                return TestFp8LinearMethod(self.native)
            return UnquantizedLinearMethod()
        return None


class TestFp8LinearMethod(LinearMethodBase):
    """``y = _scaled_mm(fp8(x / ACT_SCALE), W_fp8^T, ACT_SCALE, w_scale)``: weight ``[N, K]`` quantized per tensor
    (``w_scale = max |W| / 448``), stored as its ``[K, N]`` column-major transpose (what ``_scaled_mm`` takes).
    ``native``: ``fp8(x / ACT_SCALE)`` by vLLM's ``QuantFP8`` (module docstring) rather than the quant op."""

    def __init__(self, native=False):
        super().__init__()
        self.native = native
        self.quant_fp8 = None

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        weight_loader = extra_weight_attrs.pop("weight_loader")
        w = ModelWeightParameter(data=torch.empty(sum(output_partition_sizes), input_size_per_partition,
                                                  dtype=params_dtype),
                                 input_dim=1, output_dim=0, weight_loader=weight_loader)
        layer.register_parameter("weight", w)
        set_weight_attrs(w, extra_weight_attrs)
        if self.native:
            from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
            from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

            self.quant_fp8 = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR)

    def process_weights_after_loading(self, layer):
        w = layer.weight.data.float()
        w_scale = torch.tensor([max(w.abs().max().item(), 1e-12) / FP8_MAX], dtype=torch.float32)
        codes = (w / w_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        layer.weight_fp8 = Parameter(codes.t(), requires_grad=False)  # [K, N], column-major
        layer.weight_scale = Parameter(w_scale, requires_grad=False)
        layer.input_scale = Parameter(torch.tensor([ACT_SCALE], dtype=torch.float32), requires_grad=False)
        del layer.weight
        self.quant = static_quant_op()  # looked up once, vLLM's _C ops registered (not while Dynamo traces)

    def apply(self, layer, x, bias=None):
        x2 = x.reshape(-1, x.shape[-1])
        if self.quant_fp8 is not None:
            a, _ = self.quant_fp8(x2, layer.input_scale)
        else:
            a = torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x.device)
            self.quant(a, x2, layer.input_scale)
        out = torch._scaled_mm(a, layer.weight_fp8, scale_a=layer.input_scale, scale_b=layer.weight_scale,
                               out_dtype=x.dtype)
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias


GROUP = 128


def group_scale_buffer(m: int, k: int, layout: str, device) -> torch.Tensor:
    """Float32 group scales ``[m, k/128]`` as vLLM's ``per_token_group_quant_fp8`` allocates them for ``layout``."""
    groups = k // GROUP
    if layout == "row_major":
        return torch.empty(m, groups, dtype=torch.float32, device=device)
    if layout == "column_major":
        return torch.empty(groups, m, dtype=torch.float32, device=device).permute(1, 0)
    aligned = (m + 3) // 4 * 4
    return torch.empty_strided((m, groups), (1, aligned), dtype=torch.float32, device=device)


class TestFp8GroupLinearMethod(TestFp8LinearMethod):
    """``y = fp8_group_gemm(q, W_fp8, s, W_scales)``: ``(q, s)`` the group FP8 quant of ``x`` (``ue8m0`` scales in
    ``layout``), the weight ``[N, K]`` quantized per 128x128 block (module docstring)."""

    def __init__(self, ue8m0: bool, layout: str):
        super().__init__(False)
        self.ue8m0, self.layout = ue8m0, layout

    def process_weights_after_loading(self, layer):
        from fusion_pass.vllm.runtime.fp8_group_rows import group_quant_op

        w = layer.weight.data.float()
        n, k = w.shape
        blocks = torch.zeros(-(-n // GROUP), k // GROUP, dtype=torch.float32)
        for i in range(blocks.shape[0]):
            for j in range(blocks.shape[1]):
                blocks[i, j] = max(w[i * GROUP:(i + 1) * GROUP, j * GROUP:(j + 1) * GROUP].abs().max().item(), 1e-12)
        blocks /= FP8_MAX
        expanded = blocks.repeat_interleave(GROUP, 0)[:n].repeat_interleave(GROUP, 1)
        layer.weight_fp8 = Parameter((w / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn),
                                     requires_grad=False)
        layer.weight_scale = Parameter(blocks, requires_grad=False)
        del layer.weight
        self.quant = group_quant_op()

    def apply(self, layer, x, bias=None):
        x2 = x.reshape(-1, x.shape[-1])
        codes = torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x.device)
        scales = group_scale_buffer(x2.shape[0], x2.shape[1], self.layout, x.device)
        self.quant(x2, codes, scales, GROUP, 1e-10, -FP8_MAX, FP8_MAX, self.ue8m0, self.layout != "row_major",
                   self.layout == "column_major_tma")
        out = torch.ops.fusion_pass.fp8_group_gemm(codes, layer.weight_fp8, scales, layer.weight_scale, x.dtype)
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias
