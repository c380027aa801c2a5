"""bench/attention.py's FP8 formats on the CPU: --formats, the compiled native quant against the reference
quantizers, the FA4 FP8 loader's fallbacks, issue 28's targets, the byte checks, and whole runs on the reference
kernels (JSON structure, markdown, exit codes)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusion_pass import fp8
from fusion_pass.formats import FORMATS

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "attention.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_attention_fp8", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ba = _load()
formats, fp8_report = sys.modules["_attention_formats"], sys.modules["_attention_fp8_report"]
SHAPE_ARGS = ["--device", "cpu", "--layouts", "gqa64", "--passes", "2", "--replays", "1"]


# --------------------------------------------------------------------------
# --formats
# --------------------------------------------------------------------------


def test_parse_formats():
    assert formats.parse_formats(None) == ("nvfp4",)
    assert formats.parse_formats("all") == ("nvfp4", "fp8_static", "fp8_group128")
    assert formats.parse_formats("fp8_group128, nvfp4") == ("nvfp4", "fp8_group128")
    assert set(formats.ALL_FORMATS) <= {f.name for f in FORMATS}  # the table's names
    with pytest.raises(ValueError, match=r"--formats: unknown format 'fp9'; choose from nvfp4, fp8_static"):
        formats.parse_formats("fp8_static,fp9")
    with pytest.raises(ValueError, match="--formats: no format"):
        formats.parse_formats(" , ")


def test_bad_formats_exit_2(capsys):
    assert ba.main(["bench/attention.py", "--device", "cpu", "--formats", "fp8_dynamic"]) == 2
    err = capsys.readouterr().err
    assert "--formats" in err and "'fp8_dynamic'" in err and "fp8_group128" in err


def test_bad_formats_exit_2_as_a_process():
    proc = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--formats", "mxfp4"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--formats" in proc.stderr and "'mxfp4'" in proc.stderr


def test_timing_defaults_follow_the_formats(monkeypatch):
    captured = {}

    def fake_run(kernels, shapes, *, device, opts, on_shape=None, fp8_kernels=None):
        captured.update(vars(opts))
        raise SystemExit(0)

    monkeypatch.setattr(ba, "run", fake_run)
    with pytest.raises(SystemExit):
        ba.main(["bench/attention.py", "--device", "cpu", "--formats", "fp8_static", "--host-ms", "7"])
    timing = ("replays", "graph_ms", "host_calls", "host_ms")
    assert tuple(captured[k] for k in timing) == (5, 10.0, 50, 7.0)  # the FP8 defaults, --host-ms as given
    with pytest.raises(SystemExit):
        ba.main(["bench/attention.py", "--device", "cpu"])
    assert tuple(captured[k] for k in timing) == (10, 20.0, 100, 300.0)  # NVFP4 alone: as before


# --------------------------------------------------------------------------
# The baseline quant: QuantFP8's native form gives the reference's bytes
# --------------------------------------------------------------------------


def _awkward_rows():
    """bf16 [6, 256]: randn rows at several magnitudes, a zero row (the 1e-10 floor), values beyond 448 * scale."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 256, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1e4, 0.2])[:, None]
    x[3] = 0.0
    x[5, :7] = torch.tensor([1e5, -1e5, 448.0, -0.0, 2.0**-20, 3.0, -7.5])
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_native_static_is_the_reference(compiled):
    x = _awkward_rows()
    scale, inv = formats.static_scale(2.5, "cpu")
    assert inv.dtype == scale.dtype == torch.float32 and scale.item() == pytest.approx(2.5 / 448)
    assert inv.item() == torch.tensor(1 / scale.item(), dtype=torch.float32).item()  # the IEEE float32 reciprocal
    quant = formats.compiled_quant("fp8_static") if compiled else formats.native_static
    got = quant(x, inv)
    want = fp8.quantize_static(x, inv, nan=fp8.NaNRule.NAN)
    assert got.dtype == torch.float8_e4m3fn and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert (got.float().abs() == 448).any()  # the clamp is exercised


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_native_group_is_the_reference(compiled):
    x = _awkward_rows()
    got, got_scales = (formats.compiled_quant("fp8_group128") if compiled else formats.native_group)(x)
    want, want_scales = fp8.quantize_group(x)
    assert got_scales.shape == (6, 2) and got_scales.dtype == torch.float32
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(got_scales, want_scales)
    # the scales are the IEEE float32 quotients amax / 448
    amax = x.float().reshape(6, 2, 128).abs().amax(-1).clamp(min=fp8.SCALE_EPS)
    assert torch.equal(got_scales, amax / torch.full_like(amax, 448.0))


# --------------------------------------------------------------------------
# FA4's FP8 writers: lazy import, fallback, n/a
# --------------------------------------------------------------------------


def test_fa4_loader_falls_back_and_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(formats, "FA4_FP8_MODULES", {
        "quantize_static": ("fusion_pass.no_such_module", "fusion_pass.fp8"),
        "nothing_here": ("fusion_pass.no_such_module", "fusion_pass.fp8")})
    assert formats._load("quantize_static") is fp8.quantize_static  # the second module, after the first failed
    reason = formats._load("nothing_here")
    assert reason.startswith("n/a: ") and "fusion_pass.no_such_module does not import" in reason
    assert "fusion_pass.fp8 has no nothing_here" in reason


def test_fa4_fp8_kernels_off_sm90_are_not_available():
    kernels = formats.fa4_fp8_kernels(torch.device("cpu"))
    assert all(isinstance(v, str) and v.startswith("n/a: ") and "SM90" in v for v in kernels.fused.values())
    assert all(callable(v) for v in kernels.triton.values())


# --------------------------------------------------------------------------
# Targets and checks
# --------------------------------------------------------------------------


def _record(label, q_len, context, fused, fa4, fa4_quant, cudnn):
    rec = {"label": label, "q_len": q_len, "context": context, "flops": 10**12,
           "ms": {"fused": list(fused), "fa4": list(fa4), "fa4_quant": list(fa4_quant), "cudnn_quant": list(cudnn),
                  "triton_fused": [None, None]}, "host_us": {}, "errors": {}}
    return fp8_report.add_derived(rec, 2)


def test_fp8_targets():
    short = _record("short", 512, 0, (1.0, 1.0), (0.99, 1.0), (1.10, 1.2), (1.06, 1.3))
    long_ = _record("long", 512, 4096, (1.04, 1.0), (1.0, 1.0), (1.01, 1.0), (2.0, 2.0))
    assert short["ms"]["best_unfused"] == [1.06, 1.2] and short["best_unfused_path"] == ["cudnn_quant", "fa4_quant"]
    assert short["ratios"]["fused_over_best_unfused"] == [pytest.approx(1 / 1.06), pytest.approx(1 / 1.2)]
    s1, s2 = fp8_report.targets("fp8_static", [short, long_], "cuda")
    assert s1["status"] == "not met" and "1.040x at long" in s1["measured"]
    assert s2["status"] == "met" and "long" not in s2["measured"]  # 4608-token sequences: not in S2
    (g1,) = fp8_report.targets("fp8_group128", [short, long_], "cuda")
    assert g1["status"] == "met" and "worst 1.040x at long" in g1["measured"]
    s2_only_long = fp8_report.targets("fp8_static", [long_], "cuda")[1]
    assert s2_only_long["status"] == "not measured" and "<= 2048" in s2_only_long["measured"]
    assert [t["status"] for t in fp8_report.targets("fp8_static", [short], "cpu")] == ["not measured"] * 2
    row = fp8_report.rows([short])[0]
    assert row[0] == "short" and row[6] == "1.000-1.010x" and row[7].endswith("(cudnn/fa4)")


def test_check_fp8_finds_wrong_bytes_and_out_of_bound_outputs():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 256, generator=gen).to(torch.bfloat16)
    scale, inv = formats.static_scale(x.abs().amax().item(), "cpu")
    good = formats.native_static(x, inv)
    bad = good.clone()
    bad.view(torch.uint8)[3, 5] ^= 1
    far = formats.native_static(x * 1.5, inv)
    results = {"fused": (bad, None, None), "fa4_quant": (good, None, x), "triton_fused": (far, None, None),
               "cudnn_quant": (good, None, x)}
    check, failures = formats.check_fp8("fp8_static", results, x, scale, inv)
    assert check["fa4_quant_vs_reference"]["output_equal"] == 1.0
    assert check["fused"]["output_equal"] == pytest.approx(1 - 1 / x.numel())
    assert failures == [f"fp8_static fused: {1 - 1 / x.numel():.6f} of the output bytes equal quantize(FA4 bf16)"]
    assert check["cudnn_quant"]["within_bound"] == 1.0 and check["triton_fused"]["within_bound"] < 0.9
    group = {"fused": formats.native_group(x)[:2] + (None,)}
    check, failures = formats.check_fp8("fp8_group128", group, x, scale, inv)
    assert check["fused"] == {"output_equal": 1.0, "scales_equal": 1.0} and failures == []


# --------------------------------------------------------------------------
# Whole CPU runs
# --------------------------------------------------------------------------


def test_cpu_run_every_format(tmp_path):
    out, md = tmp_path / "a.json", tmp_path / "a.md"
    argv = ["bench/attention.py", *SHAPE_ARGS, "--formats", "all", "--shapes", "4x128,8x512+4096",
            "--out", str(out), "--markdown", str(md)]
    assert ba.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["partial"] is False and doc["formats"] == ["nvfp4", "fp8_static", "fp8_group128"]
    assert len(doc["shapes"]) == 2 and [t["id"] for t in doc["targets"]] == ["T1", "T2", "T3"]
    assert set(doc["fp8"]) == {"fp8_static", "fp8_group128"} and "compiled by Inductor" in doc["fp8_note"]
    for name, block in doc["fp8"].items():
        assert block["format"].startswith(f"{name}: torch.float8_e4m3fn")
        assert [t["status"] for t in block["targets"]] == ["not measured"] * len(fp8_report.FP8_TARGETS[name])
        assert [r["label"] for r in block["shapes"]] == [r["label"] for r in doc["shapes"]]
        for r, nv in zip(block["shapes"], doc["shapes"]):
            assert r["errors"] == {} and r["check_failures"] == [] and r["format"] == name
            for path in formats.FP8_PATHS:
                assert len(r["ms"][path]) == 2 and all(x is not None and x > 0 for x in r["ms"][path]), path
            assert r["ms"]["fa4"] == nv["ms"]["fa4"]  # FA4 bf16 alone is measured once for every format
            # the compiled native quant gives the reference quantizer's bytes, on FA4's and cuDNN's outputs
            for key in ("fa4_quant_vs_reference", "cudnn_quant_vs_reference", "fused"):
                assert r["check"][key]["output_equal"] == 1.0, key
                assert r["check"][key]["scales_equal"] == (None if name == "fp8_static" else 1.0), key
            for key in ("triton_fused", "cudnn_quant"):  # other attention: within the bound
                assert r["check"][key]["within_bound"] == 1.0 and r["check"][key]["output_equal"] > 0.9, key
            assert (r["scale"] is None) == (name == "fp8_group128")
            assert set(r["ratios"]) == set(fp8_report.RATIOS) and r["seconds"] > 0
    static = doc["fp8"]["fp8_static"]["shapes"][0]
    assert static["scale"] == pytest.approx(doc["shapes"][0]["global_scale"] ** -1 * 6)  # amax / 448
    text = md.read_text()
    assert "### NVFP4" in text and "### FP8 static per tensor" in text and "### FP8 dynamic" in text
    assert "| shape | fused ms | Triton fused ms |" in text and "(S2) FP8 static fused >= 1.05x" in text
    assert "(G1) 128-group FP8 fused <= 1.05x" in text and "Checks (first call" in text


def test_fp8_only_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(formats, "COMPILE_QUANT", False)
    out = tmp_path / "a.json"
    assert ba.main(["bench/attention.py", *SHAPE_ARGS, "--formats", "fp8_group128", "--shapes", "4x128",
                    "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["shapes"] == [] and doc["targets"] == [] and doc["bandwidth"] is None
    assert list(doc["fp8"]) == ["fp8_group128"] and "eager" in doc["fp8_note"]
    assert doc["fp8"]["fp8_group128"]["shapes"][0]["ms"]["fa4"][0] > 0
    assert "attention -> fp8_group128 on CPU" in capsys.readouterr().out


def _with_fused(monkeypatch, fmt, fn):
    real = formats.reference_fp8_kernels()
    monkeypatch.setattr(formats, "reference_fp8_kernels",
                        lambda: real._replace(fused={**real.fused, fmt: fn}))


def test_a_missing_group_kernel_is_not_available_not_a_failure(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(formats, "COMPILE_QUANT", False)
    reason = "n/a: fusion_pass.kernels.fa4.sm90_fp8 has no fa4_attention_fp8_group_varlen"
    _with_fused(monkeypatch, "fp8_group128", reason)
    out, md = tmp_path / "a.json", tmp_path / "a.md"
    assert ba.main(["bench/attention.py", *SHAPE_ARGS, "--formats", "fp8_static,fp8_group128", "--shapes", "4x128",
                    "--out", str(out), "--markdown", str(md)]) == 0
    doc = json.loads(out.read_text())
    group = doc["fp8"]["fp8_group128"]["shapes"][0]
    assert group["errors"] == {"fused": reason}
    assert group["ms"]["fused"] == [None, None] and group["ms"]["triton_fused"][0] > 0 and "fused" not in group["check"]
    assert doc["fp8"]["fp8_static"]["shapes"][0]["errors"] == {}
    assert "Paths that did not run" in md.read_text() and "FAILED" not in capsys.readouterr().err


def test_wrong_fused_bytes_exit_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(formats, "COMPILE_QUANT", False)
    right = formats.reference_fp8_kernels().fused["fp8_static"]

    def off_by_one(q, k, v, **kw):
        right(q, k, v, **kw)
        kw["output"].view(torch.uint8)[0, 0] ^= 1

    _with_fused(monkeypatch, "fp8_static", off_by_one)
    out = tmp_path / "a.json"
    assert ba.main(["bench/attention.py", *SHAPE_ARGS, "--formats", "fp8_static", "--shapes", "4x128",
                    "--out", str(out)]) == 1
    r = json.loads(out.read_text())["fp8"]["fp8_static"]["shapes"][0]
    assert r["check"]["fused"]["output_equal"] < 1.0
    assert "output bytes equal quantize(FA4 bf16)" in r["check_failures"][0]
    assert "FAILED: " in capsys.readouterr().err


def test_a_failing_fused_kernel_exit_1(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "COMPILE_QUANT", False)

    def broken(*args, **kwargs):
        raise RuntimeError("the kernel refused")

    _with_fused(monkeypatch, "fp8_static", broken)
    out = tmp_path / "a.json"
    assert ba.main(["bench/attention.py", *SHAPE_ARGS, "--formats", "fp8_static", "--shapes", "4x128",
                    "--out", str(out)]) == 1
    r = json.loads(out.read_text())["fp8"]["fp8_static"]["shapes"][0]
    assert r["errors"]["fused"].startswith("RuntimeError: the kernel refused")
    assert r["ms"]["fused"] == [None, None] and r["ms"]["fa4_quant"][0] > 0
