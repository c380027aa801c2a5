"""CPU tests of bench/attention.py's pure parts: docs markers, FLOPs, bytes, targets, refusal without CUDA."""

from __future__ import annotations

import importlib.util
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
BEGIN, END = ba.BEGIN_MARKER, ba.END_MARKER


# --------------------------------------------------------------------------
# Docs: the marked section
# --------------------------------------------------------------------------


def test_replace_keeps_text_outside_the_markers():
    before = "# Benchmarks\n\nhand-written intro\n\n"
    after = "\n\nWhy not met: hand-written notes.\n\n## Later\n\nmore\n"
    text = f"{before}{BEGIN}\nold results\n| a | b |\n{END}{after}"
    out = ba.replace_between_markers(text, "new results\n")
    assert out == f"{before}{BEGIN}\nnew results\n{END}{after}"
    assert ba.replace_between_markers(out, "new results") == out  # idempotent


def test_replace_inserts_markers_at_the_end_of_the_gpu_section():
    text = "# B\n\n## Compile time\n\nx\n\n## GPU kernels\n\nNothing on Blackwell.\n\n## Other\n\ny\n"
    out = ba.replace_between_markers(text, "numbers")
    assert out == (
        "# B\n\n## Compile time\n\nx\n\n## GPU kernels\n\nNothing on Blackwell.\n\n"
        f"{BEGIN}\nnumbers\n{END}\n\n## Other\n\ny\n"
    )
    # The next refresh finds the markers and replaces only between them.
    assert ba.replace_between_markers(out, "newer") == out.replace("numbers", "newer")


def test_replace_inserts_a_section_when_there_is_none():
    assert ba.replace_between_markers("# B\n\ntext\n", "n") == f"# B\n\ntext\n\n## GPU kernels\n\n{BEGIN}\nn\n{END}\n"
    assert ba.replace_between_markers("", "n") == f"## GPU kernels\n\n{BEGIN}\nn\n{END}\n"


def test_replace_refuses_unbalanced_markers():
    with pytest.raises(ValueError):
        ba.replace_between_markers(f"a\n{BEGIN}\nb\n", "n")
    with pytest.raises(ValueError):
        ba.replace_between_markers(f"a\n{END}\nb\n", "n")


def test_the_repository_docs_have_the_markers_under_gpu_kernels():
    text = (BENCH.parent.parent / "docs" / "benchmarks.md").read_text()
    gpu = text.index(ba.DOCS_HEADING)
    assert gpu < text.index(BEGIN) < text.index(END)
    assert "Blackwell" in text[gpu:text.index(BEGIN)]


# --------------------------------------------------------------------------
# Arithmetic
# --------------------------------------------------------------------------


def test_attention_flops_by_hand():
    # One sequence of 2 tokens, 1 head, Dqk = Dv = 1: 3 causal (query, key) pairs incl. the diagonal;
    # QK^T: 3 dot products of length 1 = 3 * 2 FLOPs, PV: 3 * 2 FLOPs -> 12.
    assert ba.attention_flops(1, 2, 1, 1, 1) == 12
    # 2 sequences of 3 tokens, 4 heads, 192/128: 6 pairs * 2 * (192 + 128) * 4 heads = 15360 per sequence.
    assert ba.attention_flops(2, 3, 4, 192, 128) == 30720


def test_quant_bytes_and_rates():
    m = k = 16384
    # read bf16 (2 B/elt) + packed (0.5 B/elt) + one fp8 scale per 16 elements (no padding at these sizes)
    assert ba.quant_bytes(m, k) == 2 * m * k + m * k // 2 + m * k // 16 == 687_865_856
    assert ba.quant_bytes(100, 48) == 2 * 4800 + 2400 + 128 * 4  # rows padded to 128, scale cols to 4
    assert ba.tera_per_s(3e9, 1.0) == pytest.approx(3.0)
    assert ba.tera_per_s(1.0, None) is None


def test_shape_table():
    full, quick = ba.benchmark_shapes(), ba.benchmark_shapes(quick=True)
    assert len(full) == 9 and len(quick) == 3
    assert {s.tokens for s in full} == {16384}
    assert all(s.batch == 32 and s.seqlen == 512 for s in quick)
    assert {(s.config.kind, s.config.heads, s.config.dqk, s.config.dv) for s in full} == {
        ("MLA", 16, 192, 128), ("MLA", 128, 192, 128), ("MHA", 32, 128, 128)}


# --------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------


def _results(speedup_mla128=1.3, speedup_long=1.1, cudnn_margin=1.2, quant_tbps=3.2, quick=False):
    """Synthetic results: fused 1 ms everywhere; cuDNN refuses the MLA shapes (qk dim != v dim)."""
    records = []
    for shape in ba.benchmark_shapes(quick):
        r = ba.new_record(shape)
        if shape.config.heads == 128 and shape.batch == 32:
            unfused = speedup_mla128
        elif shape.batch == 2:
            unfused = speedup_long
        else:
            unfused = 1.5
        r["ms"].update(fused=1.0, unfused=unfused, flash_attention=0.9)
        if shape.config.kind == "MHA":
            r["ms"].update(cudnn_quant=cudnn_margin, cudnn_attention=0.8)
        else:
            r["errors"]["cudnn_quant"] = r["errors"]["cudnn_attention"] = "RuntimeError: No available kernel."
        records.append(ba.add_derived(r))
    nbytes = ba.quant_bytes(ba.QUANT_M, ba.QUANT_K)
    ms = nbytes / (quant_tbps * 1e12) * 1e3
    quant = {"m": ba.QUANT_M, "k": ba.QUANT_K, "elements": ba.QUANT_M * ba.QUANT_K, "bytes": nbytes, "ms": ms,
             "tbps": ba.tera_per_s(nbytes, ms), "samples_ms": [ms], "error": None}
    copy = {"bytes": 2**30, "bytes_moved": 2**31, "ms": 0.5, "tbps": ba.tera_per_s(2**31, 0.5), "samples_ms": [0.5],
            "error": None}
    return {"shapes": records, "quant": quant, "copy": copy}


def _status(results):
    return [t["status"] for t in ba.evaluate_targets(results)]


def test_targets_all_met():
    targets = ba.evaluate_targets(_results())
    assert [t["status"] for t in targets] == ["met"] * 4
    assert "3.20 TB/s" in targets[0]["measured"]
    assert "1.30x" in targets[1]["measured"]
    assert "MLA H=16 192/128, 32x512" in targets[3]["measured"]  # names the shapes cuDNN could not run


@pytest.mark.parametrize(
    "kwargs, index",
    [
        ({"quant_tbps": 2.9}, 0),
        ({"speedup_mla128": 1.2}, 1),
        ({"speedup_long": 1.04}, 2),
        ({"cudnn_margin": 0.95}, 3),
        ({"cudnn_margin": 1.0}, 3),  # equal is not faster
    ],
)
def test_each_target_not_met(kwargs, index):
    expected = ["met"] * 4
    expected[index] = "not met"
    assert _status(_results(**kwargs)) == expected


def test_targets_at_the_thresholds_are_met():
    assert _status(_results(speedup_mla128=1.25, speedup_long=1.05, quant_tbps=3.0)) == ["met"] * 4


def test_targets_not_measured():
    assert _status(_results(quick=True)) == ["met", "met", "not measured", "met"]
    results = _results()
    for r in results["shapes"]:
        r["ms"]["cudnn_quant"] = None
        ba.add_derived(r)
    assert _status(results)[3] == "not measured"


def test_a_failed_fused_kernel_is_not_met():
    results = _results()
    for r in results["shapes"]:
        r["ms"]["fused"] = None
        r["errors"]["fused"] = "RuntimeError: boom"
        ba.add_derived(r)
    assert _status(results) == ["met", "not met", "not met", "not met"]
    assert ba.table_rows(results)[0][2] == "error"
    assert any("boom" in line for line in ba.our_errors(results))


# --------------------------------------------------------------------------
# Rendering and the command line
# --------------------------------------------------------------------------

META = {"date": "2026-01-01", "device": "NVIDIA H200", "torch": "2.13.0", "triton": "3.6.0", "cuda": "12.9",
        "cudnn": 91000, "command": "python bench/attention.py --quick", "timing": {"warmup_ms": 50, "rep_ms": 200}}


def test_docs_section_lists_results_and_targets():
    section = ba.render_docs_section(_results(speedup_mla128=1.1), META)
    assert BEGIN not in section and END not in section
    for needle in ("2026-01-01", "NVIDIA H200", "torch 2.13.0", "triton 3.6.0", "`python bench/attention.py --quick`",
                   "| MLA H=128 192/128 | 32x512 |", "n/a", "cuDNN could not run at"):
        assert needle in section, needle
    assert section.count("Why not met: see the notes below.") == 1
    assert "**Not met.** (2)" in section and "1.10x" in section
    assert section.count("**Met.**") == 3


def test_write_docs_keeps_the_rest_of_the_file(tmp_path):
    docs = tmp_path / "benchmarks.md"
    original = (BENCH.parent.parent / "docs" / "benchmarks.md").read_text() + "\nNotes by hand.\n"
    docs.write_text(original)
    ba.write_docs(docs, _results(), META)
    text = docs.read_text()
    assert text[:text.index(BEGIN)] == original[:original.index(BEGIN)]
    assert text[text.index(END):] == original[original.index(END):]
    assert "NVIDIA H200" in text


def test_command_line_is_reconstructed():
    script = str(BENCH)
    assert ba.command_line([script, "--out", "my dir", "--quick"]) == "python bench/attention.py --out 'my dir' --quick"


def test_help_and_refusal_without_cuda(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        ba.parse_args(["--help"])
    assert exc.value.code == 0
    assert "--quick" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ba.main(["bench/attention.py", "--quick", "--no-docs"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_check_warnings_flag_disagreement_and_memory():
    results = _results()
    first, second = results["shapes"][:2]
    first["check"] = {"packed_equal": 0.5, "scales_equal": 0.9}
    first["peak_mib"] = {"fused": 144.0, "unfused": 656.0}
    second["peak_mib"] = {"fused": 700.0, "unfused": 656.0}
    lines = ba.check_warnings(results)
    assert len(lines) == 2
    assert "50.0%" in lines[0] and first["label"] in lines[0]
    assert "not below" in lines[1] and second["label"] in lines[1]


def _with_rows(results, tbps, rows_equal=True, untouched=True):
    m, k = ba.QUANT_M - ba.ROWS_START, ba.QUANT_K
    nbytes = ba.quant_bytes(m, k)
    ms = nbytes / (tbps * 1e12) * 1e3
    results["quant"]["rows"] = {"row_start": ba.ROWS_START, "rows": m, "bytes": nbytes, "ms": ms,
                                "tbps": ba.tera_per_s(nbytes, ms), "samples_ms": [ms], "error": None,
                                "check": {"rows_equal": rows_equal, "other_rows_untouched": untouched}}
    return results


@pytest.mark.parametrize("whole, rows, equal, untouched, status", [
    (3.5, 3.6, True, True, "met"),
    (3.5, 3.3, True, True, "not met"),  # the row-range quantizer below the line
    (3.3, 3.6, True, True, "not met"),  # the whole-buffer one below it
    (3.5, 3.6, False, True, "not met"),  # fast but wrong bytes
    (3.5, 3.6, True, False, "not met"),  # fast but wrote other rows
])
def test_row_range_quantizer_target(whole, rows, equal, untouched, status):
    results = _with_rows(_results(quant_tbps=whole), rows, equal, untouched)
    (t,) = ba.evaluate_row_targets(results)
    assert (t["id"], t["status"]) == ("Q1", status)
    assert f"row-range {rows:.2f} TB/s" in t["measured"] and f"whole-buffer {whole:.2f} TB/s" in t["measured"]
    assert ba.bandwidth_rows(results)[1][0].startswith(f"NVFP4 quantize_rows_into, rows [{ba.ROWS_START}, ")


def test_row_range_quantizer_target_not_measured_without_it():
    (t,) = ba.evaluate_row_targets(_results())
    assert t["status"] == "not measured"
