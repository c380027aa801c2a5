"""bench/self_check.py: its command line, and on the CPU the clear refusal (the canary needs CUDA)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "self_check.py"


def test_help_says_what_is_measured():
    result = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    assert "the first canary of the configuration in this process" in result.stdout
    assert "--repeats" in result.stdout and "--json" in result.stdout


def test_bad_repeats_is_an_argument_error():
    result = subprocess.run([sys.executable, str(BENCH), "--repeats", "0"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "--repeats must be a positive integer, got 0" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_without_cuda_it_says_why_and_exits_2():
    result = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "needs a CUDA device" in result.stderr and result.stdout == ""
