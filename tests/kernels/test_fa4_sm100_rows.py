"""The SM100 output stage's row and head, from the address FA4 hands it, for every q layout the entry accepts.

``FlashAttentionForwardSm100Nvfp4.correction_epilogue`` (fusion_pass/kernels/fa4/sm100_kernel.py) computes::

    offset = (mO_cur.iterator - mO.iterator) // elem_bytes   # = offset_q * mO.stride[0] + head * mO.stride[1]
    first_row = offset // mO.stride[0]
    head = (offset - first_row * mO.stride[0]) // mO.stride[1]

where ``mO`` is ``common.unused_o(q, Dv)`` (q's strides). The kernel cannot run here, so this test evaluates that
integer formula on generated q layouts: every layout the SM100 entry point accepts must give back each
(sequence start, head), and a layout it would not invert (heads outside a token's row, e.g. head-major storage, or
expanded heads) must be refused before anything runs.
"""

import itertools

import pytest
import torch

from fusion_pass.kernels.fa4 import common, sm100


def _kernel_row_head(o: torch.Tensor, offset_q: int, head: int) -> tuple[int, int]:
    offset = offset_q * o.stride(0) + head * o.stride(1)  # FA4's offset_batch_Q, then [.., head]
    first_row = offset // o.stride(0)
    return first_row, (offset - first_row * o.stride(0)) // o.stride(1)


def _layouts(t, h, d):
    """q ``[T, H, D]`` views: contiguous, token rows padded, heads padded, head-major, expanded heads."""
    yield "contiguous", torch.zeros(t, h, d, dtype=torch.bfloat16)
    yield "token padding", torch.zeros(t, h * d + 64, dtype=torch.bfloat16)[:, : h * d].view(t, h, d)
    yield "head padding", torch.zeros(t, h, d + 32, dtype=torch.bfloat16)[..., :d]
    yield "head-major", torch.zeros(h, t, d, dtype=torch.bfloat16).transpose(0, 1)
    yield "expanded heads", torch.zeros(t, 1, d, dtype=torch.bfloat16).expand(t, h, d)


@pytest.mark.parametrize("heads", [1, 3, 16])
@pytest.mark.parametrize("dims", sm100.SUPPORTED_HEAD_DIMS)
def test_every_accepted_layout_gives_back_row_and_head(dims, heads):
    d, dv = dims
    t = 300
    k = torch.zeros(t, 1, d, dtype=torch.bfloat16)
    v = torch.zeros(t, 1, dv, dtype=torch.bfloat16)
    cu = torch.tensor([0, 100, t], dtype=torch.int32)
    accepted = []
    for name, q in _layouts(t, heads, d):
        try:
            sm100.check_fa4_args("fa4_attention_nvfp4_varlen", q, k, v, cu, 200, 0.1, True)
        except ValueError as exc:
            assert heads > 1 and name in ("head-major", "expanded heads"), (name, exc)
            assert "token-major" in str(exc) and "q.contiguous()" in str(exc)
            continue
        accepted.append(name)
        o = common.unused_o(q, dv)
        for offset_q, head in itertools.product((0, 100, 299), range(heads)):
            assert _kernel_row_head(o, offset_q, head) == (offset_q, head), (name, offset_q, head)
    assert {"contiguous", "token padding", "head padding"} <= set(accepted)
