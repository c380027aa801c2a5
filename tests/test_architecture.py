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
    ("fusion_pass.kernels", ("fusion_pass.runtime", "fusion_pass.ops", "fusion_pass.compile", "fusion_pass.vllm")),
    ("fusion_pass.runtime", ("fusion_pass.ops", "fusion_pass.compile", "fusion_pass.vllm", "fusion_pass.demo")),
    ("fusion_pass.runtime.backends", ("fusion_pass.runtime.guard", "fusion_pass.runtime.row_plan",
                                      "fusion_pass.runtime.attention_call", "fusion_pass.runtime.counters")),
    ("fusion_pass.runtime.row_plan", ("fusion_pass.runtime.guard", "fusion_pass.runtime.attention_call")),
    ("fusion_pass.compile", ("fusion_pass.runtime", "fusion_pass.kernels", "fusion_pass.vllm", "fusion_pass.demo")),
    ("fusion_pass.patterns", ("fusion_pass.vllm", "fusion_pass.runtime", "fusion_pass.kernels")),
    ("fusion_pass.ops", ("fusion_pass.compile", "fusion_pass.vllm", "fusion_pass.demo")),
    # the vLLM integration, split by when code runs: adapters below the run time, nothing below compile time's
    ("fusion_pass.vllm.adapters", ("fusion_pass.vllm.runtime", "fusion_pass.vllm.compile", "fusion_pass.compile")),
    ("fusion_pass.vllm.runtime", ("fusion_pass.vllm.compile", "fusion_pass.compile")),
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
    assert "fusion_pass.runtime.guard" in GRAPH["fusion_pass.runtime.attention_call"]


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
