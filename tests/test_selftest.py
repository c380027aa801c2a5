"""``fusion-pass selftest``: the command as a user runs it (in-process and as a subprocess), and the CUDA
branch's logic on the CPU with stand-in backends, canaries and timings given to
:func:`fusion_pass.selftest.run_selftest`. The last test runs the real command on a GPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusion_pass import cli, selftest
from fusion_pass.kernels.fa4 import sm90, sm100

ROOT = Path(__file__).resolve().parents[1]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA branch: this machine has CUDA")


def _command(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "fusion_pass.cli", "selftest", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def _pairs(dims) -> str:
    return ", ".join(f"({d}, {dv})" for d, dv in dims)


def _check_plain_plan(out: str) -> None:
    assert "cannot run here: no CUDA device" in out
    assert f"fa4 on SM90 (H100, H200): head dims {_pairs(sm90.SUPPORTED_HEAD_DIMS)}" in out
    assert f"fa4 on SM100/SM110 (B200, GB200): head dims {_pairs(sm100.SUPPORTED_HEAD_DIMS)}" in out
    assert "(96, 96)" in _pairs(sm90.SUPPORTED_HEAD_DIMS) and "(96, 96)" not in _pairs(sm100.SUPPORTED_HEAD_DIMS)
    assert "triton: no canary" in out and "reference: no canary" in out
    assert "bfloat16, float16" in out
    for shape in selftest.SHAPES:
        assert shape.label in out
    assert "MLA H=16/16 D=192/128 4x512" in out and "GQA H=32/8 D=128/128 2x2048" in out
    assert "fused fa4, fused triton, FA4 + quant, cuDNN + quant" in out


def _check_json_plan(report: dict) -> None:
    assert report["cuda"] is False and report["exit_code"] == 0 and report["passed"] is True
    assert report["reason"].startswith("no CUDA device")
    assert report["canaries"] == [] and report["timings"] == [] and report["verdicts"] == {}
    plan = report["would_check"]
    by_generation = {c["generation"]: c for c in plan["canaries"] if c["backend"] == "fa4"}
    assert [tuple(p) for p in by_generation["SM90 (H100, H200)"]["head_dims"]] == list(sm90.SUPPORTED_HEAD_DIMS)
    assert [tuple(p) for p in by_generation["SM100/SM110 (B200, GB200)"]["head_dims"]] == list(
        sm100.SUPPORTED_HEAD_DIMS)
    assert all(c["dtypes"] == ["bfloat16", "float16"] and c["num_heads"] == 16 for c in plan["canaries"])
    assert plan["no_canary"] == ["triton", "reference"]
    assert plan["timing"]["shapes"] == [s.label for s in selftest.SHAPES]
    assert plan["timing"]["repeats"] == 20 and plan["timing"]["dtype"] == "bfloat16"
    names = {b["name"]: b for b in report["backends"]}
    assert names["fa4"]["canary"] is True and names["fa4"]["available"] is False
    assert names["reference"]["available"] is True


@no_cuda
def test_cli_without_cuda_says_what_it_would_check(capsys):
    assert cli.main(["selftest"]) == 0
    _check_plain_plan(capsys.readouterr().out)


@no_cuda
def test_cli_json_without_cuda(capsys):
    assert cli.main(["selftest", "--json"]) == 0
    _check_json_plan(json.loads(capsys.readouterr().out))


@no_cuda
def test_the_command_as_a_subprocess_without_cuda():
    plain = _command()
    assert plain.returncode == 0, plain.stderr
    _check_plain_plan(plain.stdout)
    as_json = _command("--json")
    assert as_json.returncode == 0, as_json.stderr
    _check_json_plan(json.loads(as_json.stdout))


@no_cuda
def test_options_restrict_the_plan(capsys):
    # a device asked for that is not here: exit code 3, never a success (tests/test_cli_checks.py), the plan kept
    assert cli.main(["selftest", "--json", "--dtype", "float16", "--repeats", "7", "--device", "cuda:0"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cuda:0" and report["dtypes"] == ["float16"] and report["passed"] is False
    assert report["reason"] == "--device cuda:0 was asked for but torch sees no CUDA device"
    assert all(c["dtypes"] == ["float16"] for c in report["would_check"]["canaries"])
    assert report["would_check"]["timing"]["repeats"] == 7 and report["would_check"]["timing"]["dtype"] == "float16"
    assert cli.main(["selftest", "--no-timing"]) == 0
    out = capsys.readouterr().out
    assert "timing: off (--no-timing)" in out and selftest.SHAPES[0].label not in out


def test_cuda_requested_with_a_cpu_device_is_explained():
    report = selftest.run_selftest("cpu", cuda=True, backends=[_StandIn("fa4")])
    assert report["cuda"] is False and report["exit_code"] == 0
    assert "CUDA devices only" in report["reason"]


@pytest.mark.parametrize("argv, option", [
    (["--dtype", "int8"], "--dtype"),
    (["--repeats", "0"], "--repeats"),
    (["--repeats", "many"], "--repeats"),
    (["--device", "tpu"], "--device"),
    (["--device", "cuda:x"], "--device"),
])
def test_bad_options_are_argparse_errors_naming_the_option(argv, option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["selftest", *argv])
    assert exit_info.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err


def test_help_says_what_it_checks_costs_and_exits(capsys):
    with pytest.raises(SystemExit):
        cli.main(["selftest", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for needle in ("canaries", "fa4 on SM90 (H100, H200): (64,64) (96,96) (128,128) (192,128)",
                   "fa4 on SM100/SM110 (B200, GB200): (64,64) (128,128) (192,128)", "cuDNN",
                   "compiles the fused kernel and its twin the first time", "well under a second",
                   "0 every canary passed", "1 a canary FAILED", "2 bad arguments",
                   "3 a CUDA device, but no canary could run on it", "--no-timing", "--repeats"):
        assert needle in text, needle
    for shape in selftest.SHAPES:
        assert shape.label in text
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "selftest" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------------------------
# The CUDA branch on the CPU: stand-in backends, canaries and timings
# --------------------------------------------------------------------------------------------------------------


class _StandIn:
    """A backend as the self-test sees one: ``available``, ``supports``, ``run_varlen`` (never called here: the
    timing is given), and with ``canary=True`` the self-check pair, failing at the configurations in ``fail``."""

    handles_context = True

    def __init__(self, name, *, canary=True, fail=(), available=True, unsupported=()):
        self.name, self._available, self._fail, self._unsupported = name, available, set(fail), set(unsupported)
        self.canary_calls = []
        if canary:
            self.self_check_needed = lambda device: (True, "stand-in")
            self.canary = self._canary

    def available(self):
        return (True, f"{self.name} stand-in") if self._available else (False, f"{self.name} is not installed")

    def supports(self, device, dtype, num_heads, qk_head_dim, v_head_dim):
        if (qk_head_dim, v_head_dim) in self._unsupported:
            return False, f"{self.name} has no kernel for ({qk_head_dim}, {v_head_dim})"
        return True, "ok"

    def run_varlen(self, *args, **kwargs):
        raise AssertionError("the stand-in timing never launches a kernel")

    def _canary(self, device, dtype, num_heads, qk_head_dim, v_head_dim, group):
        self.canary_calls.append((torch.device(device), dtype, num_heads, qk_head_dim, v_head_dim, group))
        if (dtype, (qk_head_dim, v_head_dim)) in self._fail:
            return False, "codes differ at 3 byte(s), first at row 37, byte 5"
        return True, "canary bytes equal"


class _Timing:
    """A stand-in for :func:`fusion_pass.selftest.measure_shape`: the same ms per path for every shape (or one
    dict per shape), recording what it was asked to time."""

    def __init__(self, *per_shape: dict):
        self.per_shape, self.calls = per_shape, []

    def __call__(self, shape, device, dtype, fused, repeats):
        self.calls.append((shape, torch.device(device), dtype, [b.name for b in fused], repeats))
        ms = self.per_shape[min(len(self.calls), len(self.per_shape)) - 1]
        return {"ms": dict(ms), "errors": {p: "not measured by the stand-in" for p in selftest.PATHS if p not in ms},
                "notes": []}


DIMS = ((128, 128), (192, 128))


def _run(backends, measure, **kwargs):
    return selftest.run_selftest("cuda:0", cuda=True, backends=backends, measure=measure,
                                 head_dims=lambda backend, device: DIMS, **kwargs)


def test_passing_canaries_give_correct_and_the_timings_give_faster_or_slower(clean_backend_state):
    fa4, triton = _StandIn("fa4"), _StandIn("triton", canary=False)
    timing = _Timing({"fused:fa4": 1.0, "fused:triton": 2.0, "fa4+quant": 1.5, "cudnn+quant": 1.2})
    report = _run([fa4, triton, _StandIn("reference", canary=False)], timing, repeats=5)
    assert report["exit_code"] == 0 and report["passed"] is True and report["cuda"] is True
    # every (dtype, head dims) configuration ran once, with the canary heads, on the device
    assert [(c[1], c[3], c[4]) for c in fa4.canary_calls] == [
        (dtype, d, dv) for dtype in (torch.bfloat16, torch.float16) for d, dv in DIMS]
    assert {c[0] for c in fa4.canary_calls} == {torch.device("cuda:0")} and {c[2] for c in fa4.canary_calls} == {16}
    # the group size of the layer the canary stands for: MLA 1, the standard head dims GQA 4
    assert {(c[3], c[4]): c[5] for c in fa4.canary_calls} == {(128, 128): 4, (192, 128): 1}
    assert [c["status"] for c in report["canaries"]] == ["passed"] * 4
    # timed in the first dtype, every shape, the fused backends that are available
    assert [c[0] for c in timing.calls] == list(selftest.SHAPES)
    assert {c[2] for c in timing.calls} == {torch.bfloat16} and {c[4] for c in timing.calls} == {5}
    assert timing.calls[0][3] == ["fa4", "triton"]
    row = report["timings"][0]
    assert row["best_unfused"] == "cudnn+quant" and row["speedup"] == {"fa4": 1.2, "triton": 0.6}
    v = report["verdicts"]
    assert v["fa4"]["correctness"] == "correct" and v["fa4"]["speed"] == "faster"
    assert math.isclose(v["fa4"]["geomean"], 1.2) and (v["fa4"]["faster_at"], v["fa4"]["shapes"]) == (4, 4)
    assert v["fa4"]["line"].startswith("correct (4 of 4 canary configurations passed); faster than")
    assert v["triton"]["correctness"] == "no canary" and v["triton"]["speed"] == "slower"
    assert v["triton"]["faster_at"] == 0 and math.isclose(v["triton"]["geomean"], 0.6)
    assert v["reference"]["speed"] == "not timed"
    text = selftest.format_report(report)
    assert "exit code 0: every canary passed" in text
    assert "fa4        correct (4 of 4" in text and "triton     no canary" in text
    assert "1.20x" in text and "0.60x" in text and "1.000" in text and "1.200" in text


def test_a_failing_canary_fails_the_run_and_names_the_configuration(clean_backend_state):
    fa4 = _StandIn("fa4", fail={(torch.bfloat16, (192, 128))})
    timing = _Timing({"fused:triton": 2.0, "fa4+quant": 1.5, "cudnn+quant": 1.2})
    with _no_warning():
        report = _run([fa4, _StandIn("triton", canary=False)], timing)
    assert report["exit_code"] == 1 and report["passed"] is False
    statuses = {(c["dtype"], tuple(c["head_dims"])): c["status"] for c in report["canaries"]}
    assert statuses == {("bfloat16", (128, 128)): "passed", ("bfloat16", (192, 128)): "FAILED",
                        ("float16", (128, 128)): "passed", ("float16", (192, 128)): "passed"}
    verdict = report["verdicts"]["fa4"]
    assert verdict["correctness"] == "FAILED"
    assert "bfloat16 head dims (192, 128): codes differ at 3 byte(s), first at row 37, byte 5" in verdict["detail"]
    # a backend whose canary failed is not timed
    assert all(c[3] == ["triton"] for c in timing.calls)
    assert verdict["speed"] == "not timed" and "its canary failed" in verdict["line"]
    text = selftest.format_report(report)
    assert "fa4        FAILED (bfloat16 head dims (192, 128): codes differ" in text
    assert "exit code 1: a canary FAILED" in text
    assert "FAILED" in text.split("canaries")[1].split("timing")[0]


class _no_warning:
    """The self-test reports a failure itself: run_self_check's RuntimeWarning does not reach the caller."""

    def __enter__(self):
        import warnings

        self._catcher = warnings.catch_warnings(record=True)
        self.caught = self._catcher.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._catcher.__exit__(*exc)
        assert [w for w in self.caught if issubclass(w.category, RuntimeWarning)] == []


def test_a_canary_that_raises_fails_and_unsupported_configurations_are_skipped(clean_backend_state):
    class Raising(_StandIn):
        def _canary(self, device, dtype, num_heads, qk_head_dim, v_head_dim, group):
            raise RuntimeError("cuLaunchKernel failed: no kernel image")

    fa4 = Raising("fa4", unsupported={(128, 128)})
    report = _run([fa4], _Timing({}), dtypes=(torch.float16,), timing=False)
    assert report["exit_code"] == 1 and report["timings"] == [] and report["dtypes"] == ["float16"]
    skipped, failed = report["canaries"]
    assert skipped["status"] == "skipped" and "no kernel for (128, 128)" in skipped["detail"]
    assert failed["status"] == "FAILED" and "RuntimeError: cuLaunchKernel failed" in failed["detail"]
    assert report["verdicts"]["fa4"]["line"].startswith("FAILED (float16 head dims (192, 128): the canary raised")
    assert "not timed (timing off)" in report["verdicts"]["fa4"]["line"]


def test_unavailable_backends_run_no_canary_and_are_not_timed(clean_backend_state):
    fa4 = _StandIn("fa4", available=False)
    timing = _Timing({"fused:triton": 1.0, "cudnn+quant": 1.1})
    report = _run([fa4, _StandIn("triton", canary=False)], timing)
    # a CUDA device but no canary could run: nothing was checked, which is not a pass
    assert fa4.canary_calls == [] and report["canaries"] == [] and report["exit_code"] == 3
    assert report["passed"] is False
    assert "exit code 3: no canary ran: no available backend has one on this GPU" in selftest.format_report(report)
    assert all(c[3] == ["triton"] for c in timing.calls)
    assert report["verdicts"]["fa4"]["correctness"] == "unavailable"
    assert "fa4 is not installed" in report["verdicts"]["fa4"]["line"]
    assert report["timings"][0]["best_unfused"] == "cudnn+quant"
    assert "not run: FA4 + quant" in selftest.format_report(report)
    assert "fa4        not run: unavailable (fa4 is not installed)" in selftest.format_report(report)


def test_the_speed_verdict_is_the_geometric_mean_over_the_measured_shapes(clean_backend_state):
    timing = _Timing({"fused:fa4": 1.0, "fa4+quant": 2.0, "cudnn+quant": 3.0},   # 2.0x
                     {"fused:fa4": 2.0, "fa4+quant": 1.6},                        # 0.8x
                     {"fused:fa4": 1.0},                                          # no baseline: not counted
                     {"fa4+quant": 1.0})                                          # no fused time
    report = _run([_StandIn("fa4")], timing)
    speedups = [row["speedup"]["fa4"] for row in report["timings"]]
    assert speedups == [2.0, 0.8, None, None]
    verdict = report["verdicts"]["fa4"]
    assert math.isclose(verdict["geomean"], math.sqrt(1.6), rel_tol=1e-4)
    assert (verdict["speed"], verdict["faster_at"], verdict["shapes"]) == ("faster", 1, 2)
    assert "faster at 1 of 2 shapes" in verdict["line"]
    slower = _run([_StandIn("fa4")], _Timing({"fused:fa4": 1.0, "fa4+quant": 0.5},
                                             {"fused:fa4": 1.0, "fa4+quant": 1.5}, {}, {}))
    assert slower["verdicts"]["fa4"]["speed"] == "slower" and slower["exit_code"] == 0
    assert "slower than the best unfused path: 0.87x" in slower["verdicts"]["fa4"]["line"]


def test_the_cuda_report_is_json_ready(clean_backend_state):
    report = _run([_StandIn("fa4"), _StandIn("triton", canary=False)],
                  _Timing({"fused:fa4": 1.0, "fa4+quant": 1.5}))
    again = json.loads(json.dumps(report))
    assert again["canaries"][0]["head_dims"] == [128, 128] and again["timings"][0]["ms"]["cudnn+quant"] is None
    assert set(again) >= {"device", "cuda", "canaries", "timings", "verdicts", "exit_code", "timing_method"}


# --------------------------------------------------------------------------------------------------------------
# On a GPU: the real command
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs the real canaries and timings: needs a CUDA device")
def test_selftest_on_the_gpu():
    done = _command("--json", "--repeats", "5")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["cuda"] is True and report["exit_code"] == 0
    backends = {b["name"]: b for b in report["backends"]}
    for c in report["canaries"]:
        assert c["status"] == "passed", c
    if backends["fa4"]["available"]:
        ran = {(c["dtype"], tuple(c["head_dims"])) for c in report["canaries"] if c["backend"] == "fa4"}
        from fusion_pass.kernels.fa4.forward import supported_head_dims

        assert ran == {(d, p) for d in ("bfloat16", "float16") for p in supported_head_dims("cuda")}
        assert report["verdicts"]["fa4"]["correctness"] == "correct"
    assert len(report["timings"]) == len(selftest.SHAPES)
    for row in report["timings"]:
        baselines = [row["ms"][p] for p in ("fa4+quant", "cudnn+quant") if row["ms"][p] is not None]
        assert baselines and all(ms > 0 for ms in baselines), row
        for name in ("fa4", "triton"):
            if backends[name]["available"]:
                assert row["ms"][f"fused:{name}"] > 0 and row["speedup"][name] > 0, row
    for name, verdict in report["verdicts"].items():
        if name in ("fa4", "triton") and backends[name]["available"]:
            assert verdict["speed"] in ("faster", "slower", "same") and verdict["shapes"] == len(selftest.SHAPES)
