"""Kernels: tensors in, tensors out; no knowledge of batches, guards or the run time's backends.

* :mod:`.api`: the validated public entry points (:func:`attention`, :func:`attention_nvfp4`,
  :func:`attention_with_lse`, :func:`quantize`, :func:`quantize_rows_into`, :func:`merge_attention_nvfp4`);
  :mod:`.api_fp8` those with FP8 output (:func:`attention_fp8_static`, :func:`attention_fp8_group`);
* :mod:`.launchers`: the same kernels unvalidated, for the run time's backends (no host synchronization);
* :mod:`.host_copy`: host integers to a device tensor without blocking the host;
* :mod:`.choice`: which implementation serves a call (``backend=``: ``auto``, ``fa4``, ``triton``, ``reference``);
* :mod:`.reference`: the PyTorch oracle (float32 attention with its log-sum-exp, the LSE merge);
* :mod:`.triton`: Triton kernels (flash attention with bf16 / NVFP4 / FP8 epilogues, the quantizer, the merge);
* :mod:`.fa4`: FlashAttention-4's forward with an NVFP4 epilogue, one module per GPU generation.
"""

from fusion_pass.kernels.api import (
    attention,
    attention_nvfp4,
    attention_with_lse,
    merge_attention_nvfp4,
    quantize,
    quantize_rows_into,
)
from fusion_pass.kernels.api_fp8 import attention_fp8_group, attention_fp8_static
from fusion_pass.kernels.choice import ATTENTION_BACKENDS, MERGE_BACKENDS, QUANT_BACKENDS, interpreter_enabled

__all__ = [
    "ATTENTION_BACKENDS",
    "MERGE_BACKENDS",
    "QUANT_BACKENDS",
    "attention",
    "attention_fp8_group",
    "attention_fp8_static",
    "attention_nvfp4",
    "attention_with_lse",
    "interpreter_enabled",
    "merge_attention_nvfp4",
    "quantize",
    "quantize_rows_into",
]
