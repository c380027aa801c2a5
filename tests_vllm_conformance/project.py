"""What the project's own files say, read without importing the project (which needs torch): its table of supported
vLLM releases (``fusion_pass/vllm/releases.py``, standard library only, loaded from its file), its entry points
(``pyproject.toml``), and facts read from its sources with ``ast`` (an op function's parameters, a module-level
constant)."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip's vendored copy
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
RELEASES_FILE = ROOT / "fusion_pass" / "vllm" / "releases.py"


def releases():
    """The module ``fusion_pass/vllm/releases.py``, loaded from its file alone (not through ``fusion_pass``, whose
    ``__init__`` imports torch). Raises ``FileNotFoundError`` naming the file when it is missing."""
    name = "_conformance_fusion_pass_vllm_releases"
    if name in sys.modules:
        return sys.modules[name]
    if not RELEASES_FILE.is_file():
        raise FileNotFoundError(f"{RELEASES_FILE}: the project's table of supported vLLM releases, from which "
                                f"tests_vllm_conformance/names.py takes the per-release facts, is missing")
    spec = importlib.util.spec_from_file_location(name, RELEASES_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolves the module of its classes through sys.modules
    spec.loader.exec_module(module)
    return module


def entry_points() -> dict[str, dict[str, str]]:
    """``pyproject.toml``'s ``[project.entry-points]``: group -> {name: object reference}."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f).get("project", {}).get("entry-points", {})


def parsed(relative: str) -> ast.Module:
    """The project file ``relative`` (to the repository root), parsed."""
    path = ROOT / relative
    if not path.is_file():
        raise FileNotFoundError(f"{relative} not found in the project (moved? update tests_vllm_conformance)")
    return ast.parse(path.read_text(), filename=str(path))


def function(relative: str, name: str) -> ast.FunctionDef:
    """The function ``name`` defined anywhere in the project file ``relative`` (nested definitions included)."""
    for node in ast.walk(parsed(relative)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise LookupError(f"{relative} defines no function {name} (renamed? update tests_vllm_conformance)")


def keyword_strings(relative: str, callee: str, keyword: str) -> set[tuple[str, ...]]:
    """The string lists passed as ``keyword`` to calls of ``callee`` in the project file ``relative``
    (``mutates_args=["output", ...]`` of ``direct_register_custom_op``)."""
    out = set()
    for node in ast.walk(parsed(relative)):
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == callee:
            for kw in node.keywords:
                if kw.arg == keyword and isinstance(kw.value, (ast.List, ast.Tuple)):
                    out.add(tuple(e.value for e in kw.value.elts if isinstance(e, ast.Constant)))
    return out


def constant(relative: str, name: str):
    """The value of the module-level constant ``name`` of the project file ``relative``: literals, tuples, lists,
    dicts, earlier module-level constants by name, and ``*starred`` tuples of them."""
    tree = parsed(relative)
    values: dict[str, object] = {}

    def value(node):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return values[node.id]
        if isinstance(node, (ast.Tuple, ast.List)):
            items = []
            for element in node.elts:
                items.extend(value(element.value) if isinstance(element, ast.Starred) else [value(element)])
            return tuple(items) if isinstance(node, ast.Tuple) else items
        if isinstance(node, ast.Dict):
            return {value(k): value(v) for k, v in zip(node.keys, node.values)}
        raise ValueError(ast.unparse(node))

    for stmt in tree.body:
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else \
            stmt.target if isinstance(stmt, ast.AnnAssign) and stmt.value is not None else None
        if isinstance(target, ast.Name):
            try:
                values[target.id] = value(stmt.value)
            except (KeyError, ValueError):
                continue
    if name not in values:
        raise LookupError(f"{relative} has no module-level constant {name} (update tests_vllm_conformance)")
    return values[name]


def class_constants(relative: str) -> dict[str, dict[str, object]]:
    """Class name -> its class-level constants (literals and tuples of literals) in the project file ``relative``."""
    out = {}
    for node in parsed(relative).body:
        if isinstance(node, ast.ClassDef):
            found = {}
            for stmt in node.body:
                if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                    target = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target
                    if isinstance(target, ast.Name):
                        try:
                            found[target.id] = ast.literal_eval(stmt.value)
                        except ValueError:
                            pass
            out[node.name] = found
    return out
