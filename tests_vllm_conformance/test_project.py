"""The manifest says what the project's code says (no wheel needed): the fused ops' signatures, the quant schema the
project mirrors, the GEMM forms, the adapters' backends and builders, the entry-point group, the FlashInfer forward
split; and the releases checked by default are the releases the project supports. A change to one of those project
files that the manifest does not follow fails here, naming the file."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

from . import names, project
from .entries import Calls, Class, Function, OpSchema, PluginGroup, Returns, Statements
from .fetch import DEFAULT_RELEASES
from .schemas import args_of, parse, render

ATTENTION_OP = "fusion_pass/vllm/runtime/attention_op.py"
VOCABULARY = "fusion_pass/vllm/compile/vocabulary.py"
ADAPTERS = "fusion_pass/vllm/adapters"


PROJECT_ARGS = ("output_inv_scale",)
"""The fused ops' own trailing arguments after vLLM's (optional; static FP8 in the native form: docs/formats.md)."""

STANDARD_PROJECT_ARGS = ("quant_group_size", "quant_scale_ue8m0", "quant_col_major", "quant_tma_aligned",
                         *PROJECT_ARGS)
"""The fused standard op's own trailing arguments: vLLM's MLA op's group-FP8 arguments (vLLM's standard op has none),
then :data:`PROJECT_ARGS`."""


def _fused_op(function: str, own_args: tuple[str, ...] = PROJECT_ARGS) -> str:
    """The schema of a fused op function of :data:`ATTENTION_OP`, with the arguments it registers as mutated, less its
    own trailing arguments (``own_args``, checked to be last and optional)."""
    (mutated,) = project.keyword_strings(ATTENTION_OP, "direct_register_custom_op", "mutates_args")
    args = args_of(project.function(ATTENTION_OP, function), mutated)
    own = args[len(args) - len(own_args):]
    assert tuple(a.name for a in own) == own_args and all(a.default == "None" for a in own), \
        f"{function}: its last arguments must be {own_args}, each defaulting to None"
    return render(args[:len(args) - len(own_args)])


def _mla_forms() -> dict[tuple[str, ...], str]:
    """``mla_forms`` of :data:`ATTENTION_OP`: a release's extra arguments -> the fused MLA op function it registers."""
    for node in ast.walk(project.parsed(ATTENTION_OP)):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "mla_forms" for t in node.targets):
            return {ast.literal_eval(k): v.id for k, v in zip(node.value.keys, node.value.values)}
    raise LookupError(f"{ATTENTION_OP} has no mla_forms table (update tests_vllm_conformance)")


def test_standard_op_args_are_the_fused_ops():
    assert render(parse(names.STANDARD_OP_ARGS)) == _fused_op("vllm_attention_nvfp4", STANDARD_PROJECT_ARGS)


@pytest.mark.parametrize("release", project.releases().RELEASES, ids=lambda r: r.line)
def test_mla_op_args_are_the_fused_ops(release):
    forms = _mla_forms()
    assert release.mla_op_extra_args in forms, f"{ATTENTION_OP} registers no fused MLA op for {release.line}.x"
    (entry,) = [e for e in names.for_release(release.line + ".0") if isinstance(e, OpSchema)
                and e.name == "vllm::unified_mla_attention_with_output"]
    assert render(parse(entry.args)) == _fused_op(forms[release.mla_op_extra_args])


def test_every_extra_mla_argument_is_declared():
    extras = {a for r in project.releases().RELEASES for a in r.mla_op_extra_args}
    assert extras <= set(names.MLA_EXTRA_ARGS), "declare them in names.MLA_EXTRA_ARGS as the fused op does"


def test_quant_schema_is_the_projects():
    schema = project.constant("fusion_pass/ops/library.py", "SCHEMAS")["scaled_fp4_quant.out"]
    assert render(parse(names.QUANT_OUT_ARGS)) == render(parse(schema))


@pytest.mark.parametrize("name, args", [("static_scaled_fp8_quant", "STATIC_FP8_ARGS"),
                                        ("per_token_group_fp8_quant", "GROUP_FP8_ARGS")])
def test_fp8_quant_schemas_are_the_projects(name, args):
    schema = project.constant("fusion_pass/ops/library.py", "SCHEMAS")[name]
    assert render(parse(getattr(names, args))) == render(parse(schema))


def _by_name(kind):
    return {e.name: e for e in names.ENTRIES if isinstance(e, kind)}


def test_gemm_forms_are_the_projects():
    """Every form of ``VLLM_GEMM_FORMS``: its kernel class is checked; its op, where vLLM defines it, has the
    arguments the form names; the argument values the form expects are what the kernel passes (or its callee's
    defaults give)."""
    forms = project.constant(VOCABULARY, "VLLM_GEMM_FORMS")
    schemas, calls, functions = _by_name(OpSchema), _by_name(Calls), _by_name(Function)
    kernels = {**_by_name(Class), **calls}
    for name, (namespace, op, overload, activation, block_scale), expects, refuses, kernel in forms:
        kernel = f"{names.NVFP4_KERNELS}.{kernel}"
        assert kernel in kernels, f"form {name}: kernel {kernel} is not in the manifest"
        if namespace in ("vllm", "_C"):
            qualified = f"{namespace}::{op}" + ("" if overload == "default" else f".{overload}")
            wanted = {activation, block_scale, *(n for n, _ in expects), *(n for n, _, _ in refuses)}
            assert qualified in schemas and wanted <= set(schemas[qualified].has), (name, qualified, wanted)
        passed = dict(calls[kernel].keywords) if kernel in calls else {}
        if kernel in calls:
            callee = calls[kernel].callee.rpartition(".")[2]
            for function in functions.values():
                if function.name.rpartition(".")[2] == callee:
                    passed = {**dict(function.defaults), **passed}
        for argument, value in expects:
            assert passed.get(argument) == value, f"form {name}: the manifest does not check {argument}={value!r}"
    for namespace, op, overload, _ in project.constant(VOCABULARY, "_REFUSED_QUANTS"):
        assert f"{namespace}::{op}" in schemas


@pytest.mark.parametrize("table", ["VLLM_FP8_STATIC_GEMM_FORMS", "VLLM_FP8_GROUP_GEMM_FORMS"])
def test_fp8_gemm_forms_are_the_projects(table):
    """Every form of the FP8 GEMM form tables: its kernel class is checked (it calls the form's op, or vLLM's
    wrapper of it), its op has the activation and scale arguments the form names."""
    forms = project.constant(VOCABULARY, table)
    schemas, calls = _by_name(OpSchema), _by_name(Calls)
    assert forms
    for name, (namespace, op, overload, activation, scale), kernel in forms:
        kernel = f"{names.SCALED_MM_KERNELS}.{kernel}"
        assert kernel in calls, f"form {name}: kernel {kernel} is not in the manifest"
        qualified = f"{namespace}::{op}" + ("" if overload == "default" else f".{overload}")
        assert qualified in schemas and {activation, scale} <= set(schemas[qualified].has), (name, qualified)


def test_adapters_are_the_projects():
    """Every adapter class (``NAME``, ``BUILDER``) of ``fusion_pass/vllm/adapters/``: its builder's ``build`` and its
    backend's name are checked."""
    builds, returned = _by_name(Function), {e.value for e in names.ENTRIES if isinstance(e, Returns)}
    seen = 0
    for path in sorted((project.ROOT / ADAPTERS).glob("*.py")):
        for cls, constants in project.class_constants(str(path.relative_to(project.ROOT))).items():
            if "NAME" not in constants or "BUILDER" not in constants:
                continue
            seen += 1
            if constants["BUILDER"] is not None:
                module, builder = constants["BUILDER"]
                build = builds.get(f"{module}.{builder}.build")
                assert build is not None and build.params[:2] == ("common_prefix_len", "common_attn_metadata"), cls
            if constants["NAME"] != "MLA":
                assert constants["NAME"] in returned, f"{cls}: no Returns entry for backend {constants['NAME']}"
    assert seen, f"no adapter class found in {ADAPTERS}"


def test_entry_point_groups_are_checked():
    groups = {g for g in project.entry_points() if g.startswith("vllm.")}
    assert groups and groups <= set(_by_name(PluginGroup)), groups


def test_flashinfer_split_is_the_adapters():
    """The statements checked in each wheel's ``FlashInferImpl.forward`` are the adapter's own."""
    split = project.constant(f"{ADAPTERS}/flashinfer.py", "FORWARD_DECODE_SPLIT")
    checked = [e for e in names.ENTRIES if isinstance(e, Statements) and e.name.endswith("FlashInferImpl.forward")]
    assert split and [e.statements for e in checked] == [split]


def test_default_releases_are_the_supported_ones():
    table = project.releases()
    lines = [r.line for r in table.RELEASES]
    covered = [table.release_of(v).line if table.release_of(v) else None for v in DEFAULT_RELEASES]
    assert covered == lines, f"fetch.DEFAULT_RELEASES {DEFAULT_RELEASES} against releases.py's lines {lines}"


@pytest.mark.parametrize("line", [r.line for r in project.releases().RELEASES])
def test_entry_ids_are_unique(line):
    counts = Counter(e.id for e in names.for_release(line + ".0"))
    assert [i for i, n in counts.items() if n > 1] == []


def test_moved_functions_are_resolved_per_release():
    """A function that moved between releases (``Release.modules``) is reached through ``releases.resolve`` in the
    package, never imported from or read off one vLLM module, which holds it in some releases only."""
    table = project.releases()
    moved = {name for r in table.RELEASES for name, _ in r.modules}
    found = []
    for path in sorted((project.ROOT / "fusion_pass").rglob("*.py")):
        if path == project.RELEASES_FILE:
            continue
        where = path.relative_to(project.ROOT)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm"):
                found += [f"{where}:{node.lineno}: from {node.module} import {a.name}" for a in node.names
                          if a.name in moved]
            elif isinstance(node, ast.Attribute) and node.attr in moved:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    assert found == [], "read these through fusion_pass.vllm.releases.resolve:\n" + "\n".join(found)


def test_no_module_is_over_500_lines():
    """The project's house rule (docs/architecture.md)."""
    long = {p.name: n for p in Path(__file__).parent.glob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}
