"""The house rules of docs/architecture.md, read off the source: which way imports run, no import circle, no
module over 500 lines, no test-only code in the package, no `import_module` detour on the run-time path."""

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"fusion_pass": ROOT / "fusion_pass", "fusion_pass.patterns": ROOT / "patterns"}

# (importing part, parts it must never import): docs/architecture.md, "Directions that must never appear"
FORBIDDEN = [
    ("fusion_pass.nvfp4", ("fusion_pass.kernels", "fusion_pass.runtime", "fusion_pass.ops", "fusion_pass.compile")),
    ("fusion_pass.fp8", ("fusion_pass.kernels", "fusion_pass.runtime", "fusion_pass.ops", "fusion_pass.compile",
                         "fusion_pass.formats")),
    # the format axis describes formats from their byte packages alone: every layer above may read it
    ("fusion_pass.formats", ("fusion_pass.kernels", "fusion_pass.runtime", "fusion_pass.ops", "fusion_pass.compile",
                             "fusion_pass.vllm", "fusion_pass.demo")),
    ("fusion_pass.kernels", ("fusion_pass.runtime", "fusion_pass.ops", "fusion_pass.compile", "fusion_pass.vllm")),
    ("fusion_pass.runtime", ("fusion_pass.ops", "fusion_pass.compile", "fusion_pass.vllm", "fusion_pass.demo")),
    ("fusion_pass.runtime.backends", ("fusion_pass.runtime.guard", "fusion_pass.runtime.row_plan",
                                      "fusion_pass.runtime.engine", "fusion_pass.runtime.counters")),
    ("fusion_pass.runtime.row_plan", ("fusion_pass.runtime.guard", "fusion_pass.runtime.engine")),
    ("fusion_pass.compile", ("fusion_pass.runtime", "fusion_pass.kernels", "fusion_pass.vllm", "fusion_pass.demo")),
    ("fusion_pass.patterns", ("fusion_pass.vllm", "fusion_pass.runtime", "fusion_pass.kernels")),
    ("fusion_pass.ops", ("fusion_pass.compile", "fusion_pass.vllm", "fusion_pass.demo")),
    # the vLLM integration, split by when code runs: adapters below the run time, nothing below compile time's
    ("fusion_pass.vllm.adapters", ("fusion_pass.vllm.runtime", "fusion_pass.vllm.compile", "fusion_pass.compile")),
    ("fusion_pass.vllm.runtime", ("fusion_pass.vllm.compile", "fusion_pass.compile")),
    # vLLM is a host of the run-time core beside the project's stand-in engine, never a user of the engine
    ("fusion_pass.vllm", ("fusion_pass.runtime.engine",)),
    ("fusion_pass.vllm.releases", ("fusion_pass.vllm.runtime", "fusion_pass.vllm.compile", "fusion_pass.vllm.adapters")),
    ("fusion_pass.vllm.notices", ("fusion_pass.vllm.runtime", "fusion_pass.vllm.compile", "fusion_pass.vllm.adapters")),
]


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The project modules ``name`` imports (``from a import b`` counts as ``a.b`` where that is a module)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_the_scan_sees_the_package():
    assert {"fusion_pass.runtime.guard", "fusion_pass.kernels.api", "fusion_pass.nvfp4.reference",
            "fusion_pass.compile.graph_pass", "fusion_pass.patterns.attention_quant"} <= set(MODULES)
    assert "fusion_pass.runtime.guard" in GRAPH["fusion_pass.runtime.engine.attention_call"]


ENGINE = "fusion_pass.runtime.engine"


def _core_imports_of_the_engine(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports of the stand-in engine by the run-time core: every module of ``fusion_pass.runtime`` outside
    ``fusion_pass.runtime.engine`` but the package's ``__init__``, which hands the engine's public names on."""
    return sorted((src, dst) for src, dsts in graph.items()
                  if src.startswith("fusion_pass.runtime.") and not (src == ENGINE or src.startswith(ENGINE + "."))
                  for dst in dsts if dst == ENGINE or dst.startswith(ENGINE + "."))


def test_the_run_time_core_imports_nothing_of_the_stand_in_engine():
    """runtime/ is two hosts on one core: the core (guard, policy, row plan, backends, settings, counters,
    self-check), which vLLM's integration uses too, imports nothing of the project's engine (runtime/engine/)."""
    assert {"fusion_pass.runtime.engine.batch", "fusion_pass.runtime.engine.attention_call"} <= set(MODULES)
    assert _core_imports_of_the_engine(GRAPH) == []


def test_the_core_rule_sees_a_violating_import():
    graph = {name: set(dsts) for name, dsts in GRAPH.items()}
    graph["fusion_pass.runtime.row_plan"].add("fusion_pass.runtime.engine.cache")
    graph["fusion_pass.runtime.backends.selection"].add("fusion_pass.runtime.engine")
    assert _core_imports_of_the_engine(graph) == [
        ("fusion_pass.runtime.backends.selection", "fusion_pass.runtime.engine"),
        ("fusion_pass.runtime.row_plan", "fusion_pass.runtime.engine.cache")]


@pytest.mark.parametrize("part, forbidden", FORBIDDEN, ids=[p for p, _ in FORBIDDEN])
def test_imports_run_one_way(part, forbidden):
    bad = sorted((src, dst) for src, dsts in GRAPH.items() if src == part or src.startswith(part + ".")
                 for dst in dsts if dst.startswith(forbidden))
    assert bad == [], f"{part} imports what it must not: {bad}"


def test_no_import_circle():
    """Among module-level imports of the package (a function-local import is still an edge here)."""
    state: dict[str, int] = defaultdict(int)  # 0 new, 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            if nxt.startswith(node + "."):  # a package importing its own submodules is not a circle
                continue
            if state[nxt] == 1 and not node.startswith(nxt + "."):
                return stack[stack.index(nxt):] + [nxt]
            if state[nxt] == 0:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for name in sorted(GRAPH):
        if state[name] == 0:
            circle = visit(name)
            assert circle is None, " -> ".join(circle)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_small(name):
    lines = MODULES[name].read_text().count("\n")
    assert lines <= 500, f"{name} has {lines} lines"


def test_package_inits_hand_names_on():
    """A package's __init__ imports and lists names; it defines no function or class."""
    for name, path in MODULES.items():
        if path.name == "__init__.py":
            tree = ast.parse(path.read_text())
            defs = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
            assert defs == [], f"{name} defines {defs}"


def test_no_import_module_detour_and_no_test_code_in_the_package():
    for name, path in MODULES.items():
        text = path.read_text()
        if name.startswith(("fusion_pass.runtime", "fusion_pass.kernels", "fusion_pass.ops")):
            assert 'import_module("fusion_pass' not in text, f"{name} reaches the package through import_module"
        assert "quant_method" not in text or name.startswith("fusion_pass.vllm"), name
    assert not (ROOT / "fusion_pass" / "vllm" / "testing.py").exists()


BACKEND_NAMES = {"fa4", "triton", "reference"}
# the run time, its hosts and the kernels' launchers pick a backend's code through the backend object
# (fusion_pass.runtime.backends.registry); the kernels' own entry points (kernels.api / kernels.choice) take a
# user's ``backend=`` name and are not in this list
NO_NAME_DISPATCH = ("fusion_pass.runtime", "fusion_pass.vllm", "fusion_pass.ops", "fusion_pass.selftest",
                    "fusion_pass.kernels.launchers")


def _backend_name_comparisons(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                items = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                if any(isinstance(c, ast.Constant) and c.value in BACKEND_NAMES for c in items):
                    lines.append(node.lineno)
    return lines


def test_no_backend_name_is_dispatched_by_hand():
    """One registry of backends: what differs between them is an attribute or method of the backend object, so no
    module compares a backend's name with a literal to pick code."""
    found = {name: lines for name, path in MODULES.items() if name.startswith(NO_NAME_DISPATCH)
             for lines in [_backend_name_comparisons(path)] if lines}
    assert found == {}, f"backend names compared by hand: {found}"


def test_the_name_dispatch_scan_sees_a_comparison(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('def f(backend):\n    if backend.name == "fa4":\n        return 1\n'
                   '    return backend in ("triton",)\n')
    assert _backend_name_comparisons(bad) == [2, 4]
