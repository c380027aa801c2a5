"""The pass's names in vLLM's config code, and the per-process report file that outlives a killed process
(fusion_pass/vllm/compile/report_file.py, the counters' listeners in fusion_pass/runtime/counters.py)."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from fusion_pass.runtime import counters
from fusion_pass.runtime.guard import Decision
from fusion_pass.vllm.compile import report_file

# ---------------------------------------------------------------- pass names, through vLLM's own resolution

NAMES_PROBE = textwrap.dedent('''
    import sys
    import fusion_pass
    assert "vllm" not in sys.modules and "fusion_pass.vllm" not in sys.modules, "import fusion_pass imported vLLM"
    assert "PASS" not in vars(fusion_pass)
    from vllm.config import CompilationConfig
    assert "fusion_pass.vllm" not in sys.modules
    KEY = "post_grad_custom_post_pass"
    resolved = {name: CompilationConfig(inductor_passes={KEY: name}).inductor_compile_config[KEY]
                for name in ("fusion_pass.vllm.PASS", "fusion_pass_vllm.PASS")}
    import fusion_pass_vllm
    from fusion_pass.vllm import FusionPassForVllm, PASS
    assert type(PASS) is FusionPassForVllm
    assert resolved["fusion_pass.vllm.PASS"] is PASS is resolved["fusion_pass_vllm.PASS"] is fusion_pass_vllm.PASS
    assert fusion_pass.PASS is PASS
    print("OK")
''')


def test_both_pass_names_resolve_to_the_one_pass_in_vllms_config_code():
    """vLLM resolves ``a.b.PASS`` as ``__import__("a.b").__dict__["PASS"]`` (vllm/config/compilation.py):
    ``fusion_pass.vllm.PASS`` works because importing fusion_pass.vllm sets ``fusion_pass.PASS``; a fresh
    process, so that vLLM's own ``__import__`` is what imports fusion_pass.vllm."""
    proc = subprocess.run([sys.executable, "-c", NAMES_PROBE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert proc.stdout.strip().endswith("OK")


# ---------------------------------------------------------------- counters listeners

def _fused(tokens: int) -> Decision:
    return Decision("fused", None, "reference", None, tokens, tokens, {})


def test_a_counters_listener_that_reads_them_is_called_after_every_change_and_a_raising_one_is_removed(caplog):
    """A listener is called at the first change after the counters were read (tests/runtime/test_counters.py): one
    that reads them, as the report file's writer does, hears of every change."""
    calls = []

    def listener():
        calls.append(counters.counters()["fused"])  # outside the counters' lock: reading them works

    counters.add_listener(listener)
    counters.add_listener(listener)  # once
    try:
        before = counters.counters()["fused"]
        counters.record(_fused(3), "test_report_file.listener")
        counters.record(Decision.fallback("decode_tokens", "test", 0, 2))
        assert calls == [before + 1, before + 1]
    finally:
        counters.remove_listener(listener)
    counters.record(_fused(1))
    assert len(calls) == 2
    with pytest.raises(ValueError, match="remove_listener: listener .* was not added"):
        counters.remove_listener(listener)
    with pytest.raises(ValueError, match="add_listener: listener must be callable, got int"):
        counters.add_listener(3)

    def broken():
        raise OSError("disk full")

    counters.add_listener(broken)
    with caplog.at_level(logging.WARNING, logger="fusion_pass"):
        counters.record(_fused(1))  # the attention call is not broken by it
    assert "counters listener" in caplog.text and "OSError: disk full" in caplog.text and "removed" in caplog.text
    with pytest.raises(ValueError, match="was not added"):
        counters.remove_listener(broken)


# ---------------------------------------------------------------- the report file in this process

def _wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s")


def test_report_file_follows_the_counters_at_most_once_per_interval(tmp_path):
    snapshots = []

    def snapshot():
        snapshots.append(time.monotonic())
        return {"pid": os.getpid(), "fused": counters.counters()["fused"]}

    rf = report_file.ReportFile(tmp_path, snapshot, min_interval_s=0.3).start()
    try:
        assert rf.path == tmp_path / "reports" / f"vllm_report_{os.getpid()}.json"
        rf.write({"pid": os.getpid(), "graphs": 1}, on="graph")
        assert json.loads(rf.path.read_text())["written_on"] == "graph"
        start = counters.counters()["fused"]
        for _ in range(50):  # a burst of calls: one write now, one more after the interval with the last count
            counters.record(_fused(2))
        last = _wait_for(lambda: (r := json.loads(rf.path.read_text())).get("fused") == start + 50 and r)
        assert last["written_on"] == "counters"
        time.sleep(0.4)
        assert 1 <= rf.writes["counters"] <= 2, rf.writes
        assert all(b - a >= 0.29 for a, b in zip(snapshots, snapshots[1:]))
        assert not list(rf.path.parent.glob("*.tmp"))
    finally:
        rf.close()
    counters.record(_fused(1))  # closed: no listener, no thread
    time.sleep(0.1)
    assert json.loads(rf.path.read_text())["fused"] == start + 50
    for bad, match in (({"min_interval_s": 0}, "min_interval_s must be a number > 0"),
                       ({"min_interval_s": True}, "min_interval_s must be a number > 0"),
                       ({"snapshot": None}, "snapshot must be callable"), ({"directory": ""}, "directory must be")):
        kwargs = {"directory": tmp_path, "snapshot": snapshot, **bad}
        with pytest.raises(ValueError, match=f"ReportFile: {match}"):
            report_file.ReportFile(**kwargs)
    with pytest.raises(ValueError, match="ReportFile.write: on must be one of"):
        report_file.ReportFile(tmp_path, snapshot).write({}, on="later")


# ---------------------------------------------------------------- a process stopped the way vLLM stops its own

KILLED_PROBE = textwrap.dedent('''
    import os, sys, time
    import torch
    from fusion_pass.runtime import counters
    from fusion_pass.runtime.guard import Decision
    from fusion_pass.vllm import FusionPassForVllm

    p = FusionPassForVllm()
    g = torch.fx.Graph(); g.output(None)
    p(g)                                     # a graph: the report file is written and kept current from now on
    for _ in range(int(sys.argv[1])):        # attention calls after the compile, as a serving engine makes them
        counters.record(Decision("fused", None, "reference", None, 7, 7, {}), "killed.attn")
        counters.record(Decision("fallback", "decode_tokens", None, None, 0, 0, {"decode_tokens": 3}), "killed.attn")
    print("RECORDED", flush=True)
    if os.fork() == 0:  # a forked child inherits the listener and the atexit entry but never writes this pid's file
        counters.record(Decision("fused", None, "reference", None, 1000, 1000, {}), "child.attn")
        time.sleep(0.5)
        sys.exit(0)
    time.sleep(600)
''')


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_counters_reach_the_report_of_a_process_that_is_killed(tmp_path, sig):
    """vLLM's default stop sends SIGTERM to its engine process and kills it and its workers at once (SIGKILL;
    vllm/v1/utils.py, shutdown): no atexit runs. The counters recorded more than the write interval before the
    signal are in the file."""
    calls = 25
    proc = subprocess.Popen([sys.executable, "-c", KILLED_PROBE, str(calls)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "FUSION_PASS_DUMP": str(tmp_path)})
    try:
        assert proc.stdout.readline().strip() == "RECORDED", proc.stderr.read()[-3000:]
        time.sleep(report_file.MIN_INTERVAL_S + 1.0)
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=30) == -sig
    finally:
        proc.kill()
        proc.wait()
    path = tmp_path / "reports" / f"vllm_report_{proc.pid}.json"
    report = json.loads(path.read_text())
    assert report["pid"] == proc.pid and report["graphs"] == 1 and report["written_on"] == "counters"
    runtime = report["runtime_process"]
    assert runtime["fused"] == calls and runtime["fallback"] == {"decode_tokens": calls}
    assert runtime["tokens"] == {"prefill": 7 * calls, "prefill_fused": 7 * calls, "decode_fused": 0,
                                 "post_quantized": {"decode_tokens": 3 * calls}}
    assert sorted(p.name for p in (tmp_path / "reports").iterdir()) == [path.name]
