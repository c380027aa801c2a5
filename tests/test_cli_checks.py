"""``fusion-pass``: every path, device and setting a command needs is checked before it starts (issue 29).

A bad one is one line on stderr naming the option or environment variable and what is expected, and a non-zero
exit code (2; ``selftest`` asking for a device that is not here: 3), before any model is built. The commands' work
is replaced by stand-ins that fail when called, so these tests take no compile (but the two that start processes
and the one that dumps twice).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fusion_pass import FusionPass, cli, selftest
from fusion_pass.compile import debug, process_reports
from fusion_pass.demo import workload as demo

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ("FUSION_PASS_BACKEND", "FUSION_PASS_CONTEXT_WORKSPACE_TOKENS", "FUSION_PASS_SELF_CHECK",
            "FUSION_PASS_VLLM_SPLIT_MIXED", "FUSION_PASS_DUMP")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSION_PASS_")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])), **extra)
    return env


@pytest.fixture
def no_work(monkeypatch):
    """The commands' work, replaced: a call is recorded (a check let it start) and answers like the real one."""
    calls = []

    def fake_run_demo(models, **kwargs):
        calls.append(("demo", kwargs, torch.cuda.current_device() if torch.cuda.is_available() else None))
        report = {"graphs": 0, "candidates": 0, "rewritten": 0, "refused": {}, "seconds": 0.0,
                  "runtime": {"fused": 0, "fallback": {},
                              "tokens": {"prefill": 0, "prefill_fused": 0, "decode_fused": 0, "post_quantized": {}}}}
        return demo.DemoRun([], FusionPass(), report)

    def fake_summarize(directory):
        calls.append(("report", directory))
        raise FileNotFoundError("no reports")

    monkeypatch.setattr(demo, "run_demo", fake_run_demo)
    monkeypatch.setattr(process_reports, "summarize", fake_summarize)
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    return calls


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------------------------------ paths


@pytest.mark.parametrize("where", ["missing_dir", "a_directory", "under_a_file"])
def test_demo_json_path_is_checked_before_the_run(where, tmp_path, no_work, capsys):
    (tmp_path / "file").write_text("")
    path = {"missing_dir": tmp_path / "nonexistent" / "x.json", "a_directory": tmp_path,
            "under_a_file": tmp_path / "file" / "x.json"}[where]
    assert cli.main(["demo", "--tiny", "--json", str(path)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"fusion-pass demo: --json={str(path)!r}")
    assert "expected a file path in an existing, writable directory" in line
    assert no_work == [], "the demo ran before the path was checked"


def test_demo_json_path_that_is_fine_is_written(tmp_path, no_work, capsys):
    path = tmp_path / "x.json"
    assert cli.main(["demo", "--tiny", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["batches"] == [] and len(no_work) == 1


@pytest.mark.parametrize("where", ["a_file", "under_a_file", "proc"])
def test_dump_out_is_checked_before_the_run(where, tmp_path, no_work, capsys):
    (tmp_path / "file").write_text("")
    out = {"a_file": str(tmp_path / "file"), "under_a_file": str(tmp_path / "file" / "sub"),
           "proc": "/proc/nope"}[where]
    assert cli.main(["dump", "--out", out, "--tiny"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"fusion-pass dump: --out={out!r}")
    assert line.endswith("expected a directory that exists or can be created, and is writable")
    assert no_work == [] and not debug.active()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to a read-only mode directory")
def test_dump_out_not_writable(tmp_path, no_work, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        assert cli.main(["dump", "--out", str(locked), "--tiny"]) == 2
    finally:
        locked.chmod(0o700)
    assert "is not writable" in _one_line(capsys.readouterr().err) and no_work == []


# ------------------------------------------------------------------------------------------ environment


BAD_SETTINGS = [("FUSION_PASS_BACKEND", "bogus", "is not a backend; choose one of auto, fa4, triton, reference"),
                ("FUSION_PASS_CONTEXT_WORKSPACE_TOKENS", "-3", "must be a positive number of tokens"),
                ("FUSION_PASS_SELF_CHECK", "never", "is not a self-check mode; choose one of auto, all, off"),
                ("FUSION_PASS_VLLM_SPLIT_MIXED", "yes", "is not a split mode; choose one of off, on"),
                ("FUSION_PASS_DUMP", "<file>", "is a file, not a directory: expected a directory")]
COMMANDS = [["demo", "--tiny"], ["dump", "--out", "<tmp>/dumps", "--tiny"], ["backends"], ["selftest", "--json"],
            ["report", "<tmp>"]]


@pytest.mark.parametrize("variable, value, says", BAD_SETTINGS, ids=[s[0] for s in BAD_SETTINGS])
@pytest.mark.parametrize("argv", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_a_bad_setting_stops_every_command_before_work(argv, variable, value, says, tmp_path, no_work, monkeypatch,
                                                       capsys):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(variable, str(tmp_path / "file") if value == "<file>" else value)
    monkeypatch.setattr(selftest, "run_selftest", lambda *a, **k: no_work.append("selftest"))
    argv = [a.replace("<tmp>", str(tmp_path)) for a in argv]
    assert cli.main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"fusion-pass {argv[0]}: {variable}=") and says in line, line
    assert no_work == [] and not (tmp_path / "dumps").exists()


def test_bad_dump_variable_is_named_at_import(tmp_path):
    """A library user: ``import fusion_pass`` raises, naming the variable and what it expects."""
    (tmp_path / "file").write_text("")
    proc = subprocess.run([sys.executable, "-c", "import fusion_pass"], cwd=tmp_path, capture_output=True,
                          text=True, env=_env(FUSION_PASS_DUMP=str(tmp_path / "file")), timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "ArgumentError: FUSION_PASS_DUMP=" in last and "expected a directory" in last, proc.stderr[-3000:]


def test_bad_dump_variable_under_the_command_is_one_line(tmp_path):
    """The command imports the package before its main runs: still one line and exit code 2, as the module and
    as the console script."""
    (tmp_path / "file").write_text("")
    env = _env(FUSION_PASS_DUMP=str(tmp_path / "file"))
    script = Path(sys.executable).parent / "fusion-pass"
    commands = [[sys.executable, "-m", "fusion_pass.cli", "backends"]]
    if script.exists():  # the console script of this environment's install
        commands.append([str(script), "backends"])
    for command in commands:
        proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 2, (command, proc.stderr[-3000:])
        assert _one_line(proc.stderr).startswith("fusion-pass backends: FUSION_PASS_DUMP="), proc.stderr
        assert proc.stdout == ""


# ------------------------------------------------------------------------------------------ devices


def test_selftest_asking_for_cuda_without_cuda_exits_3(monkeypatch, no_work, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["selftest", "--device", "cuda", "--no-timing"]) == 3
    captured = capsys.readouterr()
    assert captured.out == ""
    assert _one_line(captured.err) == ("fusion-pass selftest: --device cuda was asked for but torch sees no CUDA "
                                       "device: nothing was checked (exit code 3)")
    assert cli.main(["selftest", "--device", "cuda", "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is False and report["exit_code"] == 3 and report["device_missing"] is True
    assert report["reason"] == "--device cuda was asked for but torch sees no CUDA device"
    # no device asked for, or the CPU: the documented skip, exit code 0 (it says what it would check)
    assert cli.main(["selftest", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"] is True
    assert cli.main(["selftest", "--json", "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"] is True


def test_selftest_asking_for_a_cuda_index_past_the_count_exits_3(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cli.main(["selftest", "--device", "cuda:1", "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is False and report["exit_code"] == 3
    assert report["reason"] == "--device cuda:1 was asked for but this machine has 1 CUDA device(s)"


class _FakeCudaDevice:
    """torch.cuda.device on a machine without CUDA: records the index made current."""

    current: list[int] = [0]

    def __init__(self, index):
        self.index = index

    def __enter__(self):
        self.current.append(self.index)

    def __exit__(self, *exc):
        self.current.pop()


def test_one_device_grammar_and_demo_runs_on_cuda_n(monkeypatch, no_work, capsys):
    """demo, dump and selftest take the same --device (cpu, cuda, cuda:N); the demo runs on cuda:N with that
    device current (the run time's kernels and the timing's CUDA events use the current device)."""
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command").choices
    types = {name: next(a.type for a in sub[name]._actions if a.dest == "device") for name in ("demo", "dump",
                                                                                                 "selftest")}
    assert set(types.values()) == {cli._device}, types
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: _FakeCudaDevice.current[-1])
    monkeypatch.setattr(torch.cuda, "device", _FakeCudaDevice)
    assert cli.main(["demo", "--device", "cuda:1", "--no-time", "--tiny"]) == 0
    (call,) = no_work
    assert call[1]["device"] == "cuda:1" and call[2] == 1, call  # passed through, and the current device
    assert _FakeCudaDevice.current == [0]
    capsys.readouterr()
    assert cli.main(["demo", "--device", "cuda:2", "--tiny"]) == 2
    assert _one_line(capsys.readouterr().err) == ("fusion-pass demo: --device cuda:2 was asked for but this machine "
                                                  "has 2 CUDA device(s) (cuda:0 to cuda:1)")
    for bad in ("tpu", "cuda:", "cuda:x", "cpu:0"):
        for command in (["demo"], ["selftest"], ["dump", "--out", "x"]):
            with pytest.raises(SystemExit) as exit_info:
                cli.main([*command, "--device", bad])
            assert exit_info.value.code == 2
            assert f"argument --device: --device must be cpu, cuda or cuda:N, got {bad!r}" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ dump layout


def test_each_dump_is_a_run_folder_of_its_own(tmp_path):
    graph = torch.fx.Graph()
    graph.output(graph.placeholder("x"))
    runs = []
    for _ in range(2):
        with debug.dump(tmp_path) as run:
            FusionPass()(graph)
        runs.append(run)
    assert [r.name for r in runs] == [f"run_000_pid{os.getpid()}", f"run_001_pid{os.getpid()}"]
    assert all((r / "graph_000_report.json").exists() for r in runs)
    assert not list(tmp_path.glob("graph_*")), "nothing of a run outside its folder"
    with debug.dump(tmp_path) as empty:  # a run that compiled nothing leaves no folder
        pass
    assert empty.name.startswith("run_002_") and not empty.exists()


# Runs in a subprocess under FUSION_PASS_DUMP: one small compile with the pass (Dynamo's counters start afresh in
# each process, so both runs name their depyf files alike).
COMPILE_ONCE = r'''
import torch, fusion_pass
torch._inductor.config.fx_graph_cache = False
fp = fusion_pass.FusionPass()
f = torch.compile(lambda x: (x.sin() + 1).cos(), options={"post_grad_custom_post_pass": fp})
f(torch.randn(8))
assert fp.report()["graphs"] == 1, fp.report()
'''


def test_a_reused_dump_directory_never_mixes_runs(tmp_path):
    """Two processes dumping to one directory (as two `fusion-pass dump --out DIR` runs do): each run has its own
    folder, and each graph report names only files that run wrote, in its folder."""
    out = tmp_path / "dumps"
    started = []
    for _ in range(2):
        started.append(time.time() - 1.0)  # file times are coarse on some file systems
        proc = subprocess.run([sys.executable, "-c", COMPILE_ONCE], cwd=tmp_path, capture_output=True, text=True,
                              env=_env(FUSION_PASS_DUMP=str(out), TORCHINDUCTOR_FX_GRAPH_CACHE="0"), timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
    runs = sorted(out.glob("run_*"))
    assert [r.name.split("_pid")[0] for r in runs] == ["run_000", "run_001"], list(out.iterdir())
    assert not list(out.glob("graph_*")) and not (out / "depyf").exists()
    for run, since in zip(runs, started):
        (report_path,) = run.glob("graph_*_report.json")
        assert report_path.name == "graph_000_report.json"
        report = json.loads(report_path.read_text())
        named = report["depyf"]["files"] + report["depyf"]["transformed_code"]
        assert report["depyf"]["files"], report["depyf"]
        for name in named:
            path = run / name
            assert path.is_file() and path.stat().st_mtime >= since, (run, name)
        fn = report["depyf"]["compiled_fn"]
        assert sorted(report["depyf"]["files"]) == sorted(str(p.relative_to(run))
                                                          for p in (run / "depyf").glob(f"{fn}.*"))
