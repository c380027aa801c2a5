"""bench/mla_prefill_forms.py: the two MLA prefill forms compute one attention, the expanded path's fused bytes,
the absorbed form's floor, the command line."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "mla_prefill_forms.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_mla_prefill_forms", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


forms = _load()


@pytest.mark.parametrize("trial", range(6))
def test_absorbed_and_expanded_forms_agree_on_generated_shapes(trial):
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    shape = forms.Shape(rng.choice((1, 2, 4)), rng.randint(1, 3), rng.randint(1, 9), rng.choice((0, 1, 7, 16, 33)))
    case = forms.Case(shape, rng.choice((1, 4, 16)), "cpu", torch.float32, seed)
    absorbed, expanded = forms.absorbed_attention_reference(case), forms.expanded_attention_reference(case)
    assert absorbed.shape == expanded.shape == (shape.batch * shape.new, shape.heads, forms.VDIM)
    assert (absorbed - expanded).abs().max().item() < 1e-4, f"seed {seed}, {shape}"


def test_the_check_sees_a_wrong_up_projection():
    case = forms.Case(forms.Shape(2, 2, 3, 9), 4, "cpu", torch.float32, 1)
    expanded = forms.expanded_attention_reference(case)
    case.w_uv = case.w_uv.roll(1, dims=0)  # another head's W_UV: a different attention output
    assert (forms.absorbed_attention_reference(case) - expanded).abs().max().item() > 1e-2


def test_gather_reads_every_key_through_the_page_table():
    shape = forms.Shape(2, 3, 4, 21)
    case = forms.Case(shape, 8, "cpu", torch.float32, 3)
    rows = case.gather().view(shape.batch, shape.context + shape.new, -1)
    for b in range(shape.batch):
        for j in range(shape.context + shape.new):
            page = int(case.page_table[b, j // 8])
            assert torch.equal(rows[b, j], case.cache[page, j % 8]), (b, j)


def test_absorbed_floor_is_the_larger_of_flops_and_bytes():
    shape = forms.Shape(16, 2, 100, 1000)
    pairs = 2 * (100 * 1000 + 100 * 101 // 2)
    assert shape.pairs == pairs
    flops = 2 * 16 * (512 + 64 + 512) * pairs
    by_flops = forms.absorbed_attention_floor_ms(shape, {"gemm_tflops": 1.0, "copy_tbps": 1e9})
    assert by_flops == pytest.approx(flops / 1e9)
    by_bytes = forms.absorbed_attention_floor_ms(shape, {"gemm_tflops": 1e9, "copy_tbps": 1e-3})
    assert by_bytes == pytest.approx(2 * 1100 * 576 * 2 / 1e6)
    assert forms.verdict({"expanded": 1.0, "absorbed_floor": 2.0}) == "expanded"
    assert forms.verdict({"expanded": 2.0, "absorbed_floor": 1.0}) == "absorbed may win"


def test_cpu_run_checks_bytes_and_forms(tmp_path):
    out = tmp_path / "forms.json"
    assert forms.main(["--device", "cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(forms.CPU_SHAPES)
    for row in rows:
        assert row["fused_bytes_equal"] is True
        assert row["forms_max_abs_diff"] < 1e-4


def test_bad_page_size_is_refused_naming_the_option(capsys):
    with pytest.raises(SystemExit) as exc:
        forms.main(["--device", "cpu", "--page-size", "0"])
    assert exc.value.code == 2
    assert "--page-size" in capsys.readouterr().err
