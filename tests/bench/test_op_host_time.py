"""bench/op_host_time.py in its tiny configuration on the CPU: the table and the JSON it writes, and that both
paths ran (the fused one through the guard's fused decision, the unfused one unguarded). Not its timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "op_host_time.py"


def test_tiny_run_writes_both_paths(tmp_path):
    out = tmp_path / "op_host_time.json"
    result = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--tiny", "--repeats", "3", "--warmup",
                             "1", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"date", "device", "torch", "command", "warmup", "repeats", "rows"} <= set(report)
    assert report["repeats"] == 3 and report["warmup"] == 1
    rows = report["rows"]
    batches = {r["batch"] for r in rows}
    assert len(batches) == 2 and len(rows) == 2 * len(batches)
    for batch in batches:
        paths = {r["path"]: r for r in rows if r["batch"] == batch}
        assert set(paths) == {"fused", "unfused"}
        for r in paths.values():
            assert r["backend"] == "reference" and r["layer"] == "mla" and r["tokens"] > 0
            assert r["median_us"] > 0 and r["p10_us"] <= r["median_us"] <= r["p90_us"] and r["calls"] > 0
        # every fused call (warm-up and timed) was fused by the guard; the unfused op is not guarded
        assert paths["fused"]["decisions"] == {"fused": 4}, paths["fused"]["decisions"]
        assert paths["unfused"]["decisions"] == {"fused": 0}, paths["unfused"]["decisions"]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("host time per attention call")
    assert sum(line.startswith("reference ") for line in lines) == len(rows)
    assert lines[-1].startswith("fused / unfused host time: ")


def test_bad_repeats_is_an_argument_error():
    result = subprocess.run([sys.executable, str(BENCH), "--repeats", "0"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "--repeats must be >= 1" in result.stderr
