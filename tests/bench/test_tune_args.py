"""bench/tune.py's command line: the FA4 sweep's shape filters parse what they list and name what they refuse.
The sweep itself needs an SM90 GPU (it is run on the H200; docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import tune  # noqa: E402


def test_seqlens_and_dims_parse_what_the_sweep_has():
    assert tune._seqlens("128,512") == (128, 512)
    assert tune._dims("192x128") == (192, 128) and tune._dims("128X128") == (128, 128)
    for _, _, _, d, dv in tune.FA4_HEADS:
        assert tune._dims(f"{d}x{dv}") == (d, dv)


@pytest.mark.parametrize("text,parser,message", [
    ("100", tune._seqlens, r"\[100\] not among the sweep's tokens per sequence \[128, 512, 2048, 8192\]"),
    ("128;512", tune._seqlens, "expected comma-separated ints"),
    ("64x64", tune._dims, "64x64 is not a swept head-dim pair; known: 128x128, 192x128"),
    ("192", tune._dims, r"expected DxDv \(e.g. 192x128\)"),
])
def test_bad_filters_are_named(text, parser, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parser(text)


def test_help_lists_the_filters(capsys):
    with pytest.raises(SystemExit) as exit_info:
        tune.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--seqlens" in out and "--dims" in out and "--no-host-times" in out


@pytest.mark.parametrize("argv,message", [
    (["--seqlens", "128"], "--seqlens: options of the FA4 sweep, which needs --fa4"),
    (["--dims", "192x128", "--no-host-times"], "--dims, --no-host-times: options of the FA4 sweep"),
    (["--fa4", "--long"], "--long and --skip-quant are options of the Triton sweep"),
    (["--fa4", "--quick", "--seqlens", "128"], "--quick keeps the 512-token shapes only"),
    (["--fa4", "--budget-s", "nan"], "--budget-s must be a positive number of seconds, got nan"),
    (["--fa4", "--budget-s", "-5"], "--budget-s must be a positive number of seconds, got -5.0"),
])
def test_conflicting_or_meaningless_options_are_refused_before_any_gpu_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tune.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
