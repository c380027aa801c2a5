"""kernels.host_copy.to_device: values, dtype and device of the copy; on CUDA through pinned memory without a
synchronization (run where a CUDA device is present)."""

import pytest
import torch

from fusion_pass.kernels.host_copy import to_device


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("values", [[0, 5, 17, 2**31 - 1], [[0, 3], [7, 9]],
                                    torch.tensor([4, 1, 8], dtype=torch.int16)])
def test_values_and_dtype_on_the_cpu(values, dtype):
    got = to_device(values, dtype, "cpu")
    want = torch.as_tensor(values).to(dtype)
    assert got.dtype == dtype and got.device.type == "cpu" and torch.equal(got, want)


def test_a_meta_device_gets_a_meta_tensor():
    got = to_device([1, 2, 3], torch.int32, torch.device("meta"))
    assert got.device.type == "meta" and got.shape == (3,) and got.dtype == torch.int32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the pinned, non-blocking path)")
@pytest.mark.parametrize("values", [[0, 5, 17, 2**31 - 1], torch.tensor([4, 1, 8])])
def test_cuda_copy_without_synchronization(values):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = to_device(values, torch.int32, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert got.device.type == "cuda" and got.dtype == torch.int32
    assert torch.equal(got.cpu(), torch.as_tensor(values).to(torch.int32))
