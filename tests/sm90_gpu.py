"""The marker of tests that run FA4's SM90 kernels on a GPU: skipped, with the reason, without an SM90 device or
without FA4 (the CPU suite checks those kernels compile-only)."""

import pytest
import torch

from fusion_pass.kernels.fa4 import sm90


def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device (FA4's SM90 kernel)"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"needs an SM90 GPU (H100/H200), found sm_{major}{minor}"
    ok, why = sm90.fa4_import_status()
    return None if ok else why


GPU_REASON = _gpu_reason()
gpu = pytest.mark.skipif(GPU_REASON is not None, reason=str(GPU_REASON))
