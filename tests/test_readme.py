"""The README's Python examples run as written.

Every ```python block of README.md is executed, in order, each in a fresh namespace, in one subprocess on the
CPU (the layer registry is global to a process, so the blocks must also coexist in one session, as a reader
pasting them would run them). Inductor's FX graph cache is off there, so the pass runs on every compile and
its report is not empty.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)

# Runs in the subprocess: argv[1] README, argv[2] where to write one JSON entry per block.
DRIVER = r'''
import contextlib, io, json, re, sys, traceback

import torch
import fusion_pass
from fusion_pass import ops

blocks = re.findall(r"^```python\n(.*?)^```", open(sys.argv[1]).read(), re.MULTILINE | re.DOTALL)
results = []
for i, source in enumerate(blocks):
    before = ops.runtime_counters()
    namespace = {"__name__": "__readme__"}
    out = io.StringIO()
    entry = {"block": i, "ok": True, "error": None}
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(source, f"README.md python block {i}", "exec"), namespace)
    except BaseException:
        entry.update(ok=False, error=traceback.format_exc())
    after = ops.runtime_counters()
    entry["stdout"] = out.getvalue()
    entry["reports"] = [{k: v.report()[k] for k in ("graphs", "candidates", "rewritten", "refused")}
                        for v in namespace.values() if isinstance(v, fusion_pass.FusionPass)]
    entry["fused_calls"] = after["fused"] - before["fused"]
    entry["prefill_fused"] = after["tokens"]["prefill_fused"] - before["tokens"]["prefill_fused"]
    tensors = [v for v in namespace.values() if isinstance(v, torch.Tensor)]
    entry["tensors"] = len(tensors)
    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    entry["finite"] = all(bool(torch.isfinite(t).all()) for t in tensors if t.dtype in floats)
    results.append(entry)
json.dump(results, open(sys.argv[2], "w"))
'''


def readme_blocks() -> list[str]:
    return BLOCK.findall(README.read_text())


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> list[dict]:
    work = tmp_path_factory.mktemp("readme")
    out = work / "results.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSION_PASS_")}  # the defaults, as a reader has
    env.update(
        CUDA_VISIBLE_DEVICES="",  # the examples are CPU examples
        TORCHINDUCTOR_FX_GRAPH_CACHE="0",  # a cache hit would skip the pass and leave its report empty
        TORCHINDUCTOR_AUTOGRAD_CACHE="0",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
    )
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(README), str(out)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and out.exists(), f"driver failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())


def test_readme_has_python_examples():
    assert len(readme_blocks()) >= 2


@pytest.mark.parametrize("index", range(len(readme_blocks())))
def test_readme_example_runs(ran, index):
    entry = ran[index]
    assert entry["ok"], f"README python block {index} failed:\n{entry['error']}"
    assert entry["tensors"] > 0 and entry["finite"], entry


def test_first_example_rewrites_and_runs_fused(ran):
    """The first example compiles a demo model with the pass: both layers rewritten, the fused backend run
    on every prefill row, and the readable summary printed."""
    first = ran[0]
    assert first["ok"], first["error"]
    assert len(first["reports"]) == 1, first
    report = first["reports"][0]
    assert report["graphs"] >= 1 and report["rewritten"] > 0 and report["refused"] == {}, report
    assert first["fused_calls"] > 0 and first["prefill_fused"] > 0, first
    lines = first["stdout"].splitlines()
    assert lines[0].startswith(f"pass: {report['graphs']} graphs, ") and f"{report['rewritten']} rewritten" in lines[0]
    assert lines[1].startswith(f"run time: {first['fused_calls']} fused calls"), first["stdout"]
    assert f"{first['prefill_fused']} of " in lines[2] and "prefill tokens fused" in lines[2], first["stdout"]
