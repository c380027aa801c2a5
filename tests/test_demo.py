"""The demo workload and the ``fusion-pass`` command (tiny dimensions: same structure, fast)."""

import json

import pytest
import torch

from fusion_pass import cli, demo, runtime


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
    results, fusion = demo.run_demo(("mla",), tiny=True, layers=1)
    assert [r.kind for r in results] == [s.kind for s in demo.workload()]
    report = fusion.report()
    assert report["candidates"] == report["rewritten"] == 1 and report["refused"] == {}
    expected_reason = {"decode": "decode_tokens", "mixed": "decode_tokens", "chunked": "chunked_prefill"}
    for r in results:
        if r.kind == "prefill":
            assert r.path == "fused" and r.reason is None, r
            assert r.within_bound and 0 < r.max_abs_err <= r.err_bound, r
        else:
            assert r.path == "fallback" and r.reason == expected_reason[r.kind], r
            assert r.bytes_equal_unfused and r.max_abs_err == 0.0, r
    # the demo releases its layer names, so it can run again in the same process
    assert "mla.layers.0.self_attn.attn" not in runtime.registered_layers()


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
    printed = capsys.readouterr().out
    assert "chunked_prefill" in printed and "1 rewritten" in printed
    data = json.loads(path.read_text())
    assert data["layers"] == 1 and data["rewritten"] == 1 and data["refused"] == {}
    batches = data["batches"]
    assert [b["kind"] for b in batches] == ["prefill", "decode", "mixed", "prefill", "chunked"]
    assert [b["path"] for b in batches] == ["fused", "fallback", "fallback", "fused", "fallback"]
    assert {b["model"] for b in batches} == {"gqa"}
    assert [b["tokens"] for b in batches] == [s.num_tokens for s in demo.workload()]
    for b in batches:
        assert set(b) >= {"kind", "model", "path", "reason", "bytes_equal_unfused", "max_abs_err", "err_bound"}


def test_cli_dump_and_backends(tmp_path, capsys):
    assert cli.main(["dump", "--out", str(tmp_path), "--tiny", "--model", "mla", "--layers", "1"]) == 0
    assert sorted(p.name for p in tmp_path.glob("graph_*"))[:3] == [
        "graph_000_after.py", "graph_000_before.py", "graph_000_report.json"]
    assert any((tmp_path / "depyf").iterdir())
    capsys.readouterr()
    assert cli.main(["backends"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["fa4", "triton", "reference"]


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
    assert "--device must be 'cpu' or 'cuda'" in capsys.readouterr().err
    assert cli.main([]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when CUDA is missing")
def test_cli_reports_missing_cuda(capsys):
    assert cli.main(["demo", "--device", "cuda", "--tiny"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
