"""The demo workload and the ``fusion-pass`` command (tiny dimensions: same structure, fast)."""

import json

import pytest
import torch

from fusion_pass import FusionPass, cli, runtime
from fusion_pass.demo import workload as demo


def test_workload_covers_every_batch_kind_in_server_order():
    steps = demo.workload()
    assert [s.kind for s in steps] == ["prefill", "decode", "mixed", "prefill", "chunked"]
    # each step continues the caches of the previous ones: context lengths add up
    seen: dict[str, int] = {}
    for spec in steps:
        for req in spec.requests:
            assert req.context_len == seen.get(req.request_id, 0)
            seen[req.request_id] = req.context_len + req.query_len


def test_demo_fuses_prefill_and_falls_back_byte_exact_elsewhere():
    from fusion_pass.runtime import counters

    counters.reset_counters()  # the report's run-time counters are process-wide
    results, fusion = demo.run_demo(("mla",), tiny=True, layers=1)
    assert [r.kind for r in results] == [s.kind for s in demo.workload()]
    report = fusion.report()
    assert report["candidates"] == report["rewritten"] == 1 and report["refused"] == {}
    steps = demo.workload()
    for r, spec in zip(results, steps, strict=True):
        prefill = spec.num_tokens - spec.num_decode_tokens
        assert r.prefill_tokens == prefill and r.decode_bytes_equal_unfused and r.decode_fused == 0, r  # MLA: split
        if r.kind == "decode":
            assert r.path == "fallback" and r.reason == "decode_tokens" and r.backend is None, r
            assert r.fused_tokens == 0 and r.bytes_equal_unfused and r.max_abs_err == 0.0, r
        else:  # prefill, mixed (decode rows post-quantized) and chunked (cached context): every prefill row fused
            assert r.path == "fused" and r.reason is None and r.backend is not None, r
            assert r.fused_tokens == prefill, r
            assert r.within_bound and r.max_abs_err <= r.err_bound, r
            if r.backend == "reference":  # quantizes float32 attention: not the unfused bf16 bytes
                assert r.max_abs_err > 0 and not r.bytes_equal_unfused, r
    tokens = report["runtime"]["tokens"]
    assert tokens["prefill"] == tokens["prefill_fused"] == sum(r.prefill_tokens for r in results)
    assert report["prefill_fused_fraction"] == 1.0
    # the demo releases its layer names, so it can run again in the same process
    assert "mla.layers.0.self_attn.attn" not in runtime.registered_layers()


def test_time_prefill_times_each_prefill_step_from_its_caches():
    from fusion_pass.runtime import counters
    from fusion_pass.demo.models import release_layers

    model = demo.build_model("gqa", tiny=True, layers=1)
    hidden_size = model.norms[0].normalized_shape[0]
    variants = {
        "unfused": torch.compile(model, options={"fx_graph_cache": False}),
        "fused": torch.compile(model, options={"post_grad_custom_post_pass": FusionPass(),
                                               "fx_graph_cache": False}),
    }
    steps = demo.workload()
    before = counters.counters()
    try:
        timings = demo.time_prefill(variants, steps, hidden_size, "cpu", warmup=1, repeats=2, model="gqa")
    finally:
        release_layers(model)
    prefill = [i for i, s in enumerate(steps) if s.kind == "prefill"]
    assert [t["step"] for t in timings] == prefill == [0, 3]
    for t in timings:
        assert set(t) == {"model", "step", "tokens", "unfused_ms", "fused_ms", "speedup"}
        assert t["model"] == "gqa" and t["tokens"] == steps[t["step"]].num_tokens
        assert t["unfused_ms"] > 0 and t["fused_ms"] > 0
        assert t["speedup"] == t["unfused_ms"] / t["fused_ms"]
    # every fused call took the fused path: per prefill step 1 warm-up + 2 timed calls,
    # plus the call that advances the caches (the last variant, "fused"), which on the
    # mixed and chunked steps fuses their prefill rows too
    after = counters.counters()
    advanced = sum(1 for s in steps if s.kind in ("mixed", "chunked"))
    assert after["fused"] - before["fused"] == len(prefill) * (1 + 2 + 1) + advanced
    with pytest.raises(ValueError, match="missing"):
        demo.time_prefill({"fused": variants["fused"]}, steps, hidden_size, "cpu")


def test_requantization_bound_holds_for_float32_vs_bf16_quantization():
    from fusion_pass import nvfp4

    g = torch.Generator().manual_seed(3)
    a32 = torch.randn(64, 128, generator=g) * torch.rand(64, 1, generator=g) * 4
    gs = torch.tensor([448.0 * 6 / a32.abs().max().item()])
    deq_f = nvfp4.dequantize(*nvfp4.quantize(a32, gs), gs)
    deq_u = nvfp4.dequantize(*nvfp4.quantize(a32.bfloat16(), gs), gs)
    bound = demo.requantization_bound(deq_u, gs)
    err = (deq_f - deq_u).abs()
    assert (err <= bound).all()
    assert err.max() > 0  # the two really differ somewhere, so the check is not vacuous


def test_cli_demo_writes_json(tmp_path, capsys):
    path = tmp_path / "demo.json"
    assert cli.main(["demo", "--tiny", "--model", "gqa", "--layers", "1", "--json", str(path)]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "decode_tokens" in printed and "1 rewritten" in printed
    assert ("prefill tokens on the fused path, per batch (each token once, whatever the number of layers): "
            "428 of 428 (100.0%)") in printed
    assert ("tokens, summed over every call of those layers (each prefill token once per layer): 428 of 428 "
            "prefill tokens fused (100.0%)") in printed
    assert "speedup" not in printed  # timing is off by default on the CPU
    # fused rows do not claim a byte mismatch: their bytes are compared within the bound
    rows = {line.split()[1]: line for line in printed.splitlines() if line.startswith("gqa ")}
    assert sorted(rows) == ["0", "1", "2", "3", "4"]
    for step, line in rows.items():
        if step == "1":  # the decode batch: the fallback, byte-equal to the unfused graph
            assert " fallback " in line and " True " in line and "n/a" not in line, line
        else:  # the mixed batch's decode rows too: one launch over the paged cache wrote them
            assert " fused " in line and demo.NOT_COMPARED in line and "False" not in line, line
            assert line.count(demo.NOT_COMPARED) == (2 if step == "2" else 1), line
    assert "bytes==unfused: required on fallback batches; n/a (fused)" in printed
    # progress: one line per model and phase, on stderr only
    progress = [line for line in captured.err.splitlines() if line.startswith("demo: ")]
    assert progress[0].startswith("demo: gqa: building the model (1 layer, tiny, cpu)")
    assert progress[1].startswith("demo: gqa: running the 5 batches")
    assert progress[2:7] == [f"demo: gqa: batch {i + 1}/5: {s.kind}, {s.num_tokens} tokens"
                             for i, s in enumerate(demo.workload())]
    assert progress[-1] == "demo: done"
    assert not [line for line in printed.splitlines() if line.startswith("demo: ")]
    data = json.loads(path.read_text())
    assert data["timing"] == []
    assert data["layers"] == 1 and data["rewritten"] == 1 and data["refused"] == {}
    batches = data["batches"]
    assert [b["kind"] for b in batches] == ["prefill", "decode", "mixed", "prefill", "chunked"]
    assert [b["path"] for b in batches] == ["fused", "fallback", "fused", "fused", "fused"]
    assert [b["prefill_tokens"] for b in batches] == [202, 0, 50, 96, 80]
    assert [b["fused_tokens"] for b in batches] == [202, 0, 50, 96, 80]
    # the standard layer's mixed batch is one launch over its paged cache: its 2 decode rows fused, within the bound
    assert [b["decode_fused"] for b in batches] == [0, 0, 2, 0, 0]
    assert all(b["decode_bytes_equal_unfused"] is True for b in batches if not b["decode_fused"])
    assert all(b["within_bound"] for b in batches)
    assert {b["model"] for b in batches} == {"gqa"}
    assert [b["tokens"] for b in batches] == [s.num_tokens for s in demo.workload()]
    for b in batches:
        assert set(b) >= {"kind", "model", "path", "backend", "reason", "bytes_equal_unfused", "max_abs_err", "err_bound"}


def test_cli_demo_time_prints_the_timing_table(tmp_path, capsys):
    from fusion_pass.runtime import counters

    path = tmp_path / "demo.json"
    counters.reset_counters()
    args = ["demo", "--tiny", "--model", "gqa", "--layers", "1", "--repeats", "2", "--warmup", "1"]
    assert cli.main([*args, "--time", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "unfused ms" in printed and "fused ms" in printed and "speedup" in printed
    assert "median of 2 repeats after 1 warm-up calls" in printed and "whole compiled attention stack" in printed
    data = json.loads(path.read_text())
    assert [(t["model"], t["step"]) for t in data["timing"]] == [("gqa", 0), ("gqa", 3)]
    assert all(t["unfused_ms"] > 0 and t["fused_ms"] > 0 for t in data["timing"])
    # the report is the correctness run's: the timed calls are not in its counters
    # (prefill, mixed, prefill, chunked: every prefill row fused; the decode step falls back)
    assert data["runtime"]["fused"] == 4 and "run time: 4 fused calls" in printed
    assert cli.main([*args, "--no-time"]) == 0
    printed = capsys.readouterr().out
    assert "speedup" not in printed and "1 rewritten" in printed


def test_cli_demo_times_by_default_on_cuda_only(monkeypatch, capsys):
    calls = []

    def fake_run_demo(models, **kwargs):
        calls.append(kwargs)
        report = {"graphs": 0, "candidates": 0, "rewritten": 0, "refused": {}, "seconds": 0.0,
                  "runtime": {"fused": 0, "fallback": {},
                              "tokens": {"prefill": 0, "prefill_fused": 0, "decode_fused": 0, "post_quantized": {}}}}
        return demo.DemoRun([], FusionPass(), report)

    monkeypatch.setattr(demo, "run_demo", fake_run_demo)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for argv in (["--device", "cuda"], ["--device", "cuda", "--no-time"], [], ["--time", "--repeats", "5"]):
        assert cli.main(["demo", *argv]) == 0
    assert [c["timing"] for c in calls] == [True, False, False, True]
    assert calls[-1]["repeats"] == 5 and calls[-1]["warmup"] == 3
    assert "CUDA events" in capsys.readouterr().out


def test_cli_dump_and_backends(tmp_path, capsys, clean_backend_state):
    assert cli.main(["dump", "--out", str(tmp_path), "--tiny", "--model", "mla", "--layers", "1"]) == 0
    (run,) = tmp_path.glob("run_*")  # this run's folder (a reused --out never mixes runs: tests/test_cli_checks.py)
    assert f"dumps in {run}" in capsys.readouterr().out
    assert sorted(p.name for p in run.glob("graph_*"))[:3] == [
        "graph_000_after.py", "graph_000_before.py", "graph_000_report.json"]
    assert any((run / "depyf").iterdir())
    assert cli.main(["backends"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[:3]] == ["fa4", "triton", "reference"]
    choice = lines.index("choice: auto (FUSION_PASS_BACKEND); context workspace bound: 65536 tokens "
                         "(FUSION_PASS_CONTEXT_WORKSPACE_TOKENS); self-check: auto (FUSION_PASS_SELF_CHECK; "
                         "fusion-pass selftest runs the checks now); vLLM standard layers split mixed calls: off "
                         "(FUSION_PASS_VLLM_SPLIT_MIXED)")
    # then the policy: its mode, and one line per rule of the table (this machine's generation marked)
    from fusion_pass.runtime import policy

    assert lines[choice + 2].startswith("policy: measured (FUSION_PASS_POLICY;")
    rules = lines[choice + 3:]
    assert len(rules) == len(policy.POLICY_TABLE)
    for line, rule in zip(rules, policy.POLICY_TABLE):
        assert line.split()[-len(rule.evidence.split()):] == rule.evidence.split(), line
        assert line.lstrip(" *").split()[:3] == [rule.generation, rule.rows, "fuse" if rule.fuse else "unfused"]
        assert line.startswith(" *") is (rule.generation == "cpu")


def test_cli_backends_names_a_bad_workspace_setting(capsys, monkeypatch):
    monkeypatch.setenv("FUSION_PASS_CONTEXT_WORKSPACE_TOKENS", "lots")
    assert cli.main(["backends"]) == 2  # checked before the command's work, as for every command
    assert "FUSION_PASS_CONTEXT_WORKSPACE_TOKENS='lots' must be a positive number of tokens" in capsys.readouterr().err
    monkeypatch.delenv("FUSION_PASS_CONTEXT_WORKSPACE_TOKENS")
    monkeypatch.setenv("FUSION_PASS_SELF_CHECK", "never")
    assert cli.main(["backends"]) == 2
    assert "FUSION_PASS_SELF_CHECK='never' is not a self-check mode; choose one of auto, all, off" in capsys.readouterr().err
    monkeypatch.delenv("FUSION_PASS_SELF_CHECK")
    monkeypatch.setenv("FUSION_PASS_VLLM_SPLIT_MIXED", "yes")
    assert cli.main(["backends"]) == 2
    assert "FUSION_PASS_VLLM_SPLIT_MIXED='yes' is not a split mode; choose one of off, on" in capsys.readouterr().err


def test_cli_help_and_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    assert "demo" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["dump"])
    assert "--out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["demo", "--layers", "0"])
    assert "expected a positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["demo", "--device", "tpu"])
    assert "--device must be cpu, cuda or cuda:N, got 'tpu'" in capsys.readouterr().err
    assert cli.main([]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when CUDA is missing")
def test_cli_reports_missing_cuda(capsys):
    assert cli.main(["demo", "--device", "cuda", "--tiny"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_cli_report_adds_up_process_reports(tmp_path, capsys):
    """Per-process reports as the vLLM pass writes them (FusionPass.report() of a real compile, plus pid):
    the command prints one line per process and the sums."""
    import json

    from fusion_pass import cli

    torch._dynamo.reset()  # earlier demo runs in this process compiled the same model code (recompile limit)
    results, fusion = demo.run_demo(("mla",), tiny=True, layers=1)
    real = json.loads(json.dumps(fusion.report(), default=str))
    assert real["rewritten"] == 1 and real["runtime"]["fused"] >= 1
    second = {**real, "refused": {"quant_rows_are_not_tokens": 2}, "candidates": real["candidates"] + 2}
    for pid, report in ((101, real), (202, second)):
        (tmp_path / f"vllm_report_{pid}.json").write_text(
            json.dumps({**report, "pid": pid, "vllm_version": "0.32.0", "disabled_reason": None}))
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"total: 2 processes, {2 * real['graphs']} graphs, {2 * real['candidates'] + 2} attention layers seen, " \
           f"2 rewritten, refused: quant_rows_are_not_tokens=2" in out
    # the per-process sums are of each process's whole run time (runtime_process), not one pass's layers
    assert f"run time: {2 * real['runtime_process']['fused']} fused calls" in out
    assert cli.main(["report", "--json", str(tmp_path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [p["pid"] for p in summary["processes"]] == [101, 202]
    assert summary["fallback"] == {k: 2 * v for k, v in real["runtime_process"]["fallback"].items()}

    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["report", str(empty)]) == 1
    assert "no vllm_report_*.json in" in capsys.readouterr().err


def test_demo_counts_accept_numpy_integers_and_reject_the_rest():
    import numpy as np

    run = demo.run_demo((), layers=np.int64(1), warmup=np.int32(0), repeats=np.uint8(2))  # no model: checks only
    assert run.results == [] and run.report["graphs"] == 0
    for bad in ({"layers": 1.5}, {"layers": np.int64(0)}, {"warmup": -1}, {"repeats": True}, {"repeats": "3"}):
        with pytest.raises(ValueError, match=rf"run_demo: {next(iter(bad))} must be an int >= "):
            demo.run_demo((), **bad)
    model = demo.build_model("gqa", tiny=True, layers=np.int64(1), prefix="test_demo.numpy")
    try:
        assert len(model.layers) == 1
    finally:
        from fusion_pass.demo.models import release_layers

        release_layers(model)


def test_run_demo_reports_progress_through_its_callback():
    lines = []
    run = demo.run_demo(("mla",), tiny=True, layers=1, progress=lines.append)
    assert len(run.results) == 5
    assert lines[0] == "demo: mla: building the model (1 layer, tiny, cpu) and calibrating its NVFP4 inputs"
    assert [line.split(":")[2].strip() for line in lines[2:7]] == [f"batch {i}/5" for i in range(1, 6)]
    assert lines[-1] == "demo: done" and len(lines) == 8


def test_format_report_says_what_each_count_counts():
    report = {"graphs": 2, "graphs_from_cache": 1, "candidates": 2, "rewritten": 2, "refused": {}, "seconds": 0.002,
              "rewritten_layers": ["a", "b"],
              "runtime": {"fused": 6, "fallback": {"decode_tokens": 2},
                          "tokens": {"prefill": 30, "prefill_fused": 30, "decode_fused": 0, "post_quantized": {"decode_tokens": 4}}}}
    text = demo.format_report(report)
    assert "pass: 2 graphs (+1 served by the FX graph cache, the pass not run), 2 attention layers seen" in text
    assert "run time: 6 fused calls, fallback calls: decode_tokens=2 (the calls of the 2 rewritten layers)" in text
    assert ("tokens, summed over every call of those layers (each prefill token once per layer): 30 of 30 "
            "prefill tokens fused (100.0%), post-quantized: decode_tokens=4") in text
