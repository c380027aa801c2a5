"""The ``torch.ops.fusion_pass`` op library: schemas, fakes and argument contracts (:mod:`.library`); the quant ops
(:mod:`.quant`), the NVFP4 GEMM (:mod:`.gemm`) and the attention ops (:mod:`.attention`). Importing the package
registers every op. The ops are where compile time and run time meet: the pass matches and rewrites them, the
run time implements them."""

from fusion_pass.ops import attention, gemm, quant  # noqa: F401  (registers the implementations)
from fusion_pass.ops.attention import runtime_counters
from fusion_pass.ops.gemm import tap_gemm_inputs
from fusion_pass.ops.library import NAMESPACE, SCHEMAS
from fusion_pass.ops.quant import scaled_fp4_quant

__all__ = ["NAMESPACE", "SCHEMAS", "runtime_counters", "scaled_fp4_quant", "tap_gemm_inputs"]
