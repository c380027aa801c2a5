"""Test session set-up.

Without a CUDA device the Triton kernels run in Triton's CPU interpreter. The
variable must be set before triton is first imported (``triton.jit`` reads it
when a kernel or a ``triton.language`` helper is defined); importing torch does
not import triton, importing fusion_pass does.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
