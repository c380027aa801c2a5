"""``fusion-pass report``: the per-process reports vLLM's processes write under FUSION_PASS_DUMP, added up
(fusion_pass/compile/process_reports.py). The reports here have the shape FusionPassForVllm writes; the
vLLM suite (tests_vllm/test_vllm_report_file.py, test_vllm_server.py) writes them for real."""

import json

import pytest

from fusion_pass import cli
from fusion_pass.compile import process_reports


def _runtime(fused: int, fallback: dict, prefill: int, prefill_fused: int, post: dict) -> dict:
    return {"fused": fused, "fused_by_backend": {"reference": fused} if fused else {}, "fallback": fallback,
            "tokens": {"prefill": prefill, "prefill_fused": prefill_fused, "decode_fused": 0, "post_quantized": post}}


def _report(pid: int, runtime: dict, **extra) -> dict:
    return {"graphs": 1, "candidates": 2, "rewritten": 2, "refused": {}, "pid": pid, "vllm_version": "0.32.0",
            "disabled_reason": None, "runtime": _runtime(0, {}, 0, 0, {}), "runtime_process": runtime, **extra}


@pytest.fixture
def dump(tmp_path):
    """A FUSION_PASS_DUMP folder with a graph dump, two reports in reports/ and one where older releases put them."""
    (tmp_path / "graph_000_report.json").write_text(json.dumps({"graph": 0, "candidates": 2}))  # not a process
    (tmp_path / "reports").mkdir()
    a = _runtime(6, {"decode_tokens": 4, "no_attention_metadata": 2}, 40, 40, {"decode_tokens": 8})
    b = _runtime(2, {"decode_tokens": 1, "chunked_prefill": 3}, 30, 10, {"decode_tokens": 2, "chunked_prefill": 20})
    old = {k: v for k, v in _report(303, _runtime(1, {}, 5, 5, {})).items() if k != "runtime_process"}
    old["runtime"] = _runtime(1, {}, 5, 5, {})  # an older report: "runtime" only, no "written_on"
    (tmp_path / "reports" / "vllm_report_101.json").write_text(json.dumps(_report(101, a, written_on="counters")))
    (tmp_path / "reports" / "vllm_report_202.json").write_text(json.dumps(_report(202, b, written_on="exit")))
    (tmp_path / "vllm_report_303.json").write_text(json.dumps(old))
    return tmp_path


def test_summary_reads_both_places_and_counts_tokens_per_process_and_in_total(dump):
    summary = process_reports.summarize(dump)
    procs = {p["pid"]: p for p in summary["processes"]}
    assert [p["file"] for p in summary["processes"]] == [
        "reports/vllm_report_101.json", "reports/vllm_report_202.json", "vllm_report_303.json"]
    assert procs[101]["tokens"] == {"prefill": 40, "prefill_fused": 40, "decode_fused": 0, "post_quantized": {"decode_tokens": 8}}
    assert procs[202]["tokens"] == {"prefill": 30, "prefill_fused": 10, "decode_fused": 0,
                                    "post_quantized": {"decode_tokens": 2, "chunked_prefill": 20}}
    assert procs[303]["tokens"] == {"prefill": 5, "prefill_fused": 5, "decode_fused": 0, "post_quantized": {}}
    assert [procs[p]["written_on"] for p in (101, 202, 303)] == ["counters", "exit", None]
    assert procs[202]["fallback"] == {"decode_tokens": 1, "chunked_prefill": 3} and procs[202]["fused"] == 2
    assert summary["tokens"] == {"prefill": 75, "prefill_fused": 55, "decode_fused": 0,
                                 "post_quantized": {"decode_tokens": 10, "chunked_prefill": 20}}
    assert summary["fused"] == 9 and summary["rewritten"] == 6 and len(summary["processes"]) == 3
    assert summary["fallback"] == {"decode_tokens": 5, "no_attention_metadata": 2, "chunked_prefill": 3}
    # given the reports folder itself, its files are read
    assert [p["pid"] for p in process_reports.summarize(dump / "reports")["processes"]] == [101, 202]


def test_cli_report_prints_tokens_and_json(dump, capsys):
    assert cli.main(["report", str(dump)]) == 0
    out = capsys.readouterr().out
    assert "tokens: 55 of 75 prefill tokens fused, post-quantized: chunked_prefill=20, decode_tokens=10" in out
    row_202 = next(line for line in out.splitlines() if line.split()[:1] == ["202"])
    assert row_202.split()[:6] == ["202", "1", "2", "2", "2", "10/30"]
    assert cli.main(["report", "--json", str(dump)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tokens"]["prefill_fused"] == 55
    assert [p["tokens"]["prefill"] for p in summary["processes"]] == [40, 30, 5]


def test_unreadable_or_missing_reports_are_named(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match=r"is not a directory"):
        process_reports.summarize(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match=r"no vllm_report_\*\.json in .*reports or "):
        process_reports.summarize(tmp_path)
    (tmp_path / "reports").mkdir()
    bad = tmp_path / "reports" / "vllm_report_7.json"
    bad.write_text('{"graphs": 1, "cand')  # what a non-atomic write cut by a kill would leave
    with pytest.raises(ValueError, match=r"cannot read .*vllm_report_7\.json"):
        process_reports.summarize(tmp_path)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"vllm_report_7\.json holds a list, not a report object"):
        process_reports.summarize(tmp_path)
    assert cli.main(["report", str(tmp_path)]) == 1
    assert "vllm_report_7.json holds a list" in capsys.readouterr().err
