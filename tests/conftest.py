"""Test session set-up. The tests mirror the package's folders (compile/, runtime/, kernels/, nvfp4/, ops/,
demo/; bench/ for the benchmarks' scripts); the case modules they share sit here.

Without a CUDA device the Triton kernels run in Triton's CPU interpreter. The
variable must be set before triton is first imported (``triton.jit`` reads it
when a kernel or a ``triton.language`` helper is defined); importing torch does
not import triton, importing fusion_pass does.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

# the shared case modules (graph_cases, context_cases, row_buffers) beside this file, for tests in subfolders
sys.path.insert(0, str(Path(__file__).resolve().parent))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Inductor's CPU kernels: the vector ISA taken from the CPU's flags without the probe, no precompiled headers. Under two
# test workers on a cold cache a kernel now and then came out vectorized but was built without its ISA flags
# ("'at::vec' has not been declared"), failing a test at random: Inductor decides the ISA per process by compiling and
# running a probe program, which a process under load can fail. Precompiled headers are shared by every process of
# the machine. Both are read when torch._inductor.config is first imported (not by torch).
os.environ.setdefault("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0")
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")


@pytest.fixture
def clean_backend_state(monkeypatch):
    """No backend pinned (environment or set_backend), the default context workspace bound, self-check mode and
    split mode, no self-check results, zeroed guard counters; restored after."""
    from fusion_pass.runtime import counters, self_check, settings

    for variable in settings.environment_variables():
        monkeypatch.delenv(variable, raising=False)
    previous = settings.set_backend(None)
    previous_workspace = settings.set_context_workspace_tokens(None)
    previous_self_check = settings.set_self_check(None)
    previous_split = settings.set_split_mixed(None)
    counters.reset_counters()
    self_check.forget_self_checks()
    yield
    settings.set_backend(previous)
    settings.set_context_workspace_tokens(previous_workspace)
    settings.set_self_check(previous_self_check)
    settings.set_split_mixed(previous_split)
    counters.reset_counters()
    self_check.forget_self_checks()
