"""bench/attention.py and its helper modules on the CPU: shapes, FLOPs, the cuDNN mask, statistics, ratios,
targets, the command line, and a whole run on the reference kernels whose paths must write the same bytes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "attention.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_attention", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


ba = _load()
shapes_mod, paths_mod, report, timing, quant = (sys.modules[n] for n in (
    "_attention_shapes", "_attention_paths", "_attention_report", "_timing", "_quant_bandwidth"))


# --------------------------------------------------------------------------
# Shapes as data
# --------------------------------------------------------------------------


def test_the_shape_table():
    shapes = shapes_mod.select_shapes()
    assert len(shapes) == 24
    assert {s.layout.name for s in shapes} == {"mla16", "mla128", "mha32", "gqa64"}
    assert [b.name for b in shapes_mod.BATCHES] == ["4x128", "32x512", "8x2048", "2x8192", "8x512+4096",
                                                    "1x2048+30000"]
    gqa = next(s for s in shapes if s.layout.name == "gqa64" and s.batch.name == "1x2048+30000")
    assert (gqa.layout.heads, gqa.layout.kv_heads, gqa.tokens, gqa.keys) == (64, 8, 2048, 32048)
    assert {(s.layout.dqk, s.layout.dv) for s in shapes if s.layout.kind == "MLA"} == {(192, 128)}


def test_shape_filters_and_unknown_names():
    picked = shapes_mod.select_shapes("32x512,8x512+4096", "mla128")
    assert [s.label for s in picked] == ["MLA 128h (192,128) 32x512", "MLA 128h (192,128) 8x512+4096"]
    with pytest.raises(ValueError, match="unknown shape '3x512'.*32x512"):
        shapes_mod.select_shapes("3x512")
    with pytest.raises(ValueError, match="unknown layout 'mla'"):
        shapes_mod.select_shapes(layouts="mla")


def test_scaled_shapes_keep_their_structure():
    small = shapes_mod.select_shapes("1x2048+30000", "gqa64", scale=32)[0]
    assert (small.layout.heads, small.layout.kv_heads) == (8, 1)
    assert (small.batch.batch, small.batch.q_len, small.batch.context) == (1, 64, 937)


def test_flops_by_hand():
    lay = shapes_mod.Layout("x", "MHA", 1, 1, 1, 1)
    # 2 tokens, no context: 3 (query, key) pairs incl. the diagonal; QK^T + PV: 2 * 3 * 2 FLOPs
    assert shapes_mod.Shape(lay, shapes_mod.Batch(1, 2)).flops == 12
    # 2 queries after 3 cached keys: query 0 sees 4 keys, query 1 sees 5: 9 pairs, 2 sequences, 4 heads, 192+128
    lay = shapes_mod.Layout("x", "MLA", 4, 4, 192, 128)
    assert shapes_mod.Shape(lay, shapes_mod.Batch(2, 2, 3)).flops == 2 * 2 * 4 * 9 * 320


def test_causal_mask_is_bottom_right():
    mask = paths_mod.causal_mask(2, 5, "cpu")[0, 0]
    visible = (mask == 0).tolist()
    assert visible == [[True, True, True, True, False], [True, True, True, True, True]]
    assert mask.dtype == torch.bfloat16 and torch.isneginf(mask[0, 4])


def test_inputs_are_random_and_token_major():
    shape = shapes_mod.select_shapes("8x512+4096", "gqa64", scale=64)[0]
    x = paths_mod.make_inputs(shape, 0, "cpu")
    assert x.q.shape == (shape.tokens, shape.layout.heads, 128)
    assert x.k.shape[0] == shape.keys and (x.q != 0).float().mean() > 0.99
    assert x.cu_seqlens_k.tolist() == [i * (shape.batch.context + shape.batch.q_len) for i in range(9)]
    q_bshd, _, _ = x.dense["bshd"]
    assert torch.equal(q_bshd[1, :, 0], x.q[shape.batch.q_len])  # sequence 1, token 0
    assert torch.equal(x.dense["bhsd"][0], q_bshd) and x.dense["bhsd"][0].is_contiguous()
    assert paths_mod.input_sets_needed(10) == 3 and paths_mod.input_sets_needed(200 * 2**20) == 1


# --------------------------------------------------------------------------
# Statistics, ratios, targets
# --------------------------------------------------------------------------


def test_percentiles_by_hand():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert timing.percentile(xs, 0) == 1.0 and timing.percentile(xs, 100) == 5.0
    assert timing.percentile(xs, 50) == 3.0 and timing.percentile(xs, 10) == pytest.approx(1.4)
    assert timing.distribution(xs) == {"n": 5, "min": 1.0, "p10": pytest.approx(1.4), "median": 3.0,
                                       "p90": pytest.approx(4.6), "max": 5.0}
    assert timing.distribution([])["median"] is None
    assert timing.calls_for(2.0, 20.0) == 10 and timing.calls_for(50.0, 20.0) == 1 and timing.calls_for(0.0, 1) == 200


def _record(fused, fa4, fa4_quant, bshd, bhsd, host_fused=(30.0, 35.0), label="S"):
    rec = {"label": label, "flops": 10**12, "ms": {"fused": list(fused), "fa4": list(fa4), "fa4_quant": list(fa4_quant),
                                                   "cudnn_quant_bshd": list(bshd), "cudnn_quant_bhsd": list(bhsd)},
           "host_us": {"fused": list(host_fused)}, "errors": {}}
    return report.add_derived(rec, 2)


def test_derived_paths_and_ratios():
    r = _record((1.0, 2.0), (0.9, 2.0), (1.2, 2.0), (1.5, None), (1.4, 3.0))
    assert r["ms"]["cudnn_quant"] == [1.4, 3.0] and r["cudnn_layout"] == ["bhsd", "bhsd"]
    assert r["ms"]["best_unfused"] == [1.2, 2.0]
    assert r["ratios"]["cudnn_quant_over_fused"] == [pytest.approx(1.4), pytest.approx(1.5)]
    assert r["ratios"]["fused_over_fa4"] == [pytest.approx(1 / 0.9), 1.0]
    assert r["tflops_fused"] == [pytest.approx(1000.0), pytest.approx(500.0)]
    assert report.fmt_range([1.1, 1.14]) == "1.10-1.14x" and report.fmt_range([None]) == "n/a"
    assert report.fmt_pct_range([1.27, 1.31]) == "+27..31%" and report.fmt_pct_range([1.0, 1.0]) == "+0%"
    row = report.rows({"shapes": [r]})[0]
    assert row[0] == "S" and row[4] == "2.200 (bhsd)" and row[5] == "1.40-1.50x"


def test_targets():
    good = _record((1.0, 1.0), (0.99, 1.0), (1.06, 1.1), (1.2, 1.2), (1.3, 1.3), label="good")
    bad = _record((1.0, 1.0), (0.95, 0.97), (1.04, 1.1), (1.2, 1.2), (None, None), host_fused=(41.0, 39.0),
                  label="bad")
    results = {"device_type": "cuda", "shapes": [good]}
    assert [t["status"] for t in report.shape_targets(results)] == ["met", "met", "met"]
    results["shapes"].append(bad)
    t1, t2, t3 = report.shape_targets(results)
    assert t1["status"] == t2["status"] == t3["status"] == "not met"
    assert "bad" in t1["measured"] and "good" not in t1["measured"].split("missed at")[1]
    assert "1.040x at bad" in t2["measured"] and "41.0 us at bad" in t3["measured"]
    assert all(t["status"] == "not measured" for t in report.shape_targets({"device_type": "cpu", "shapes": [good]}))


def test_quant_targets():
    rows = [{"mib": mib, "tbps": tbps} for mib, tbps in ((16, 2.6), (64, 3.5), (512, 3.3))]
    q1, q2 = quant.quant_targets({"quant": rows})
    assert (q1["status"], q2["status"]) == ("not met", "met")
    assert "512 MiB: 3.30 TB/s" in q1["measured"]
    assert [t["status"] for t in quant.quant_targets(None)] == ["not measured"] * 2
    assert quant.quant_bytes(100, 48) == 2 * 4800 + 2400 + 128 * 4


# --------------------------------------------------------------------------
# The command line and a CPU run
# --------------------------------------------------------------------------


def test_help(capsys):
    with pytest.raises(SystemExit) as exc:
        ba.parse_args(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for needle in ("--shapes", "--layouts", "--passes", "--out", "--markdown", "--device", "CUDA-graph replay",
                   "host time per call", "cuDNN", "cu_seqlens_k", "L2"):
        assert needle in out, needle


def test_refusals(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ba.main(["bench/attention.py", "--shapes", "32x512"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert ba.main(["bench/attention.py", "--device", "cpu", "--shapes", "32x51"]) == 2
    assert "unknown shape '32x51'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ba.parse_args(["--passes", "0"])


def test_cpu_run_every_path_writes_the_same_bytes(tmp_path):
    out, md = tmp_path / "a.json", tmp_path / "a.md"
    argv = ["bench/attention.py", "--device", "cpu", "--shapes", "4x128,8x512+4096", "--layouts", "gqa64,mla128",
            "--passes", "2", "--replays", "1", "--out", str(out), "--markdown", str(md)]
    assert ba.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["device_type"] == "cpu" and doc["meta"]["command"].startswith("python bench/attention.py --device cpu")
    assert len(doc["shapes"]) == 4
    for r in doc["shapes"]:
        assert r["errors"] == {}
        for path in ("fused", "fa4", "fa4_quant", "cudnn_quant_bshd", "cudnn_quant_bhsd"):
            assert len(r["ms"][path]) == 2 and all(x is not None and x > 0 for x in r["ms"][path]), path
        # the fused path's contract: the bytes of quantize(bf16 attention), exactly
        assert r["check"]["fused"] == {"packed_equal": 1.0, "scales_equal": 1.0}
        # SDPA on [B, H, L, D] (views and copies, the bottom-right mask for chunks) agrees with the varlen paths
        for layout in ("bshd", "bhsd"):
            assert r["check"][f"cudnn_quant_{layout}"]["packed_equal"] > 0.99
        assert len(r["ratios"]["fused_over_fa4"]) == 2
    text = md.read_text()
    assert "| shape | fused ms |" in text and "GQA 64/8h" not in text  # scaled down on the CPU
    assert "Command: `python bench/attention.py --device cpu" in text and "L2:" in text


def test_paths_have_their_own_buffers():
    shape = shapes_mod.select_shapes("4x128", "mha32", scale=32)[0]
    x = paths_mod.make_inputs(shape, 0, "cpu")
    kernels = sys.modules["_kernels"].reference_kernels()
    paths = paths_mod.build_paths(kernels, shape, [x], torch.ones(1), "cpu")
    buffers = [p.out[0].data_ptr() for p in paths.values() if p.out is not None]
    assert len(buffers) == 4 == len(set(buffers))
