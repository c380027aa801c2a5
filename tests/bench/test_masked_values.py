"""bench/masked_values.py on a machine without CUDA: its arguments are checked first, then it says it needs a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "masked_values.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, needle", [(["--layouts", "mla7"], "--layouts: unknown ['mla7']"),
                                          (["--shapes", "32by512"], "--shapes: '32by512' is not BxL"),
                                          (["--passes", "0"], "--passes must be a positive integer")])
def test_bad_arguments_exit_2_naming_the_option(args, needle):
    result = _run(*args)
    assert result.returncode == 2 and needle in result.stderr, result.stderr


def test_help_names_the_three_paths():
    result = _run("--help")
    assert result.returncode == 0
    for path in ("unchanged", "twin", "fused"):
        assert path in result.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the no-GPU message: a machine without CUDA")
def test_without_cuda_it_exits_2_and_says_why():
    result = _run("--shapes", "4x128")
    assert result.returncode == 2 and "needs a CUDA device" in result.stderr, result.stderr
