"""Operator schemas as a vLLM wheel defines them, and as the manifest writes them.

A schema is its argument list (:class:`Arg`: name, type, default, whether the op writes it, keyword-only), written
in torch's schema syntax (``Tensor q, Tensor(a!) output, Tensor? output_scale=None``) and parsed by :func:`parse`.

In the wheel an op is defined one of two ways:

* in Python (:func:`python_op`): ``direct_register_custom_op(op_name=..., op_func=f, mutates_args=[...])`` in the
  namespace of its ``target_lib`` (by default the ``Library`` the helper's own module creates), or a function
  decorated ``@torch.library.custom_op("ns::name", mutates_args=...)``. The schema is derived from ``f``'s parameters
  in order (annotation -> schema type: :func:`schema_type`);
* in a compiled extension (:func:`native_op`): a schema string such as ``scaled_fp4_quant.out(Tensor input, ...)``
  in a ``.so`` member that defines a torch library fragment for the op's namespace (its
  ``TORCH_LIBRARY*_init_<ns>_<n>`` symbol), found by scanning the member's bytes in chunks.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from .wheel import Wheel, dotted

REGISTER_HELPER = "vllm.utils.torch_utils.direct_register_custom_op"
"""vLLM's op registration helper: its module's ``Library(<ns>, ...)`` is the default namespace of the ops it defines."""


@dataclass(frozen=True)
class Arg:
    """One schema argument. ``type`` is the schema type without alias annotation (``Tensor``, ``Tensor?``, ``int[]?``)
    or None when the manifest names the argument only; ``default`` the default's text or None."""

    name: str
    type: str | None
    default: str | None = None
    mutated: bool = False
    keyword_only: bool = False

    def __str__(self) -> str:
        if self.type is None:
            return self.name
        kind = self.type
        if self.mutated:
            kind = kind.replace("Tensor", "Tensor(!)", 1)
        return f"{kind} {self.name}" + (f"={self.default}" if self.default is not None else "")


@dataclass(frozen=True)
class Schema:
    """An op's arguments as found in the wheel, and where (``file:line``, or the ``.so`` member)."""

    op: str
    args: tuple[Arg, ...]
    where: str

    def text(self) -> str:
        return render(self.args)


def render(args) -> str:
    """``Tensor q, Tensor(!) output, *, ...`` (``*`` before the first keyword-only argument)."""
    parts, star = [], False
    for arg in args:
        if arg.keyword_only and not star:
            parts.append("*")
            star = True
        parts.append(str(arg))
    return ", ".join(parts)


def _split_top(text: str) -> list[str]:
    """``text`` split at commas outside brackets."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch in "([<":
            depth += 1
        elif ch in ")]>":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if "".join(current).strip():
        parts.append("".join(current))
    return [p.strip() for p in parts]


def _inside_parentheses(text: str) -> str:
    """What lies between the first ``(`` of ``text`` and its matching ``)``."""
    start = text.index("(") + 1
    depth = 1
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return text[start:]


def parse(text: str) -> tuple[Arg, ...]:
    """The arguments of a schema's argument list (``Tensor input, *, Tensor(a!) output``; a leading ``name(`` and a
    trailing ``) -> ...`` are dropped). A bare name (no type) is an argument named only."""
    text = " ".join(text.split())
    if re.match(r"^[\w.]+\(", text):
        text = _inside_parentheses(text)
    args, keyword_only = [], False
    for part in _split_top(text):
        if part == "*":
            keyword_only = True
            continue
        decl, _, default = part.partition("=")
        decl = decl.strip()
        kind, _, name = decl.rpartition(" ")
        mutated = "!" in kind
        kind = re.sub(r"\([a-z]*!?\)|!", "", kind) or None
        args.append(Arg(name, kind, default.strip() or None, mutated, keyword_only))
    return tuple(args)


_SIMPLE = {"torch.Tensor": "Tensor", "Tensor": "Tensor", "int": "int", "bool": "bool", "float": "float",
           "str": "str", "torch.dtype": "ScalarType", "torch.SymInt": "SymInt"}


def schema_type(annotation: ast.AST | None) -> str:
    """The schema type of a Python annotation (``torch.Tensor | None`` -> ``Tensor?``, ``list[int]`` -> ``int[]``);
    a name the table does not know (``LayerNameType``) stays as written."""
    if annotation is None:
        return "<no annotation>"
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return schema_type(ast.parse(annotation.value, mode="eval").body)
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        left, right = annotation.left, annotation.right
        if isinstance(right, ast.Constant) and right.value is None:
            return schema_type(left) + "?"
        if isinstance(left, ast.Constant) and left.value is None:
            return schema_type(right) + "?"
    if isinstance(annotation, ast.Subscript):
        outer = dotted(annotation.value)
        inner = annotation.slice
        if outer in ("Optional", "typing.Optional"):
            return schema_type(inner) + "?"
        if outer in ("list", "List", "typing.List", "Sequence"):
            return schema_type(inner) + "[]"
    text = ast.unparse(annotation)
    return _SIMPLE.get(text, text)


def args_of(function: ast.FunctionDef, mutated=()) -> tuple[Arg, ...]:
    """The schema arguments of a Python op function (``mutated``: the names it writes)."""
    a = function.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = [Arg(p.arg, schema_type(p.annotation), None if d is None else ast.unparse(d), p.arg in mutated)
           for p, d in zip(positional, defaults)]
    out += [Arg(p.arg, schema_type(p.annotation), None if d is None else ast.unparse(d), p.arg in mutated, True)
            for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    return tuple(out)


def _string(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _strings(node) -> tuple[str, ...]:
    if isinstance(node, (ast.List, ast.Tuple)):
        return tuple(s for s in map(_string, node.elts) if s is not None)
    return ()


def _argument(call: ast.Call, position: int, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return call.args[position] if len(call.args) > position else None


def default_namespace(wheel: Wheel) -> str | None:
    """The namespace of the ``Library(<ns>, ...)`` that :data:`REGISTER_HELPER`'s module creates at module level."""
    module = wheel.module(REGISTER_HELPER.rpartition(".")[0])
    if module is None:
        return None
    for stmt in module.tree.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call) and \
                (dotted(stmt.value.func) or "").endswith("Library") and stmt.value.args:
            return _string(stmt.value.args[0])
    return None


def _function_named(tree: ast.AST, name: str, near: ast.AST | None) -> ast.FunctionDef | None:
    """The function ``name`` defined in ``tree``: the one in the same enclosing function as ``near`` if any, else
    the first at any depth."""
    found = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
    if near is not None:
        for candidate in found:
            for parent in ast.walk(tree):
                body = getattr(parent, "body", None)
                if isinstance(body, list) and candidate in body and near in ast.walk(parent):
                    return candidate
    return found[0] if found else None


def python_op(wheel: Wheel, op: str) -> list[Schema]:
    """Every Python definition of ``ns::name`` in the wheel (usually one)."""
    namespace, _, name = op.partition("::")
    default_ns = default_namespace(wheel)
    found = []
    members = {m for quote in (b'"', b"'") for needle in (quote + name.encode() + quote, b"::" + name.encode() + quote)
               for m in wheel.members_containing(needle)}
    for member in sorted(members):
        module_name = member.removesuffix("/__init__.py").removesuffix(".py").replace("/", ".")
        module = wheel.module(module_name)
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Call) and (dotted(node.func) or "").split(".")[-1] == "direct_register_custom_op":
                if _string(_argument(node, 0, "op_name")) != name:
                    continue
                lib = _argument(node, 4, "target_lib")
                if (default_ns if lib is None else None) != namespace:
                    continue
                func = _argument(node, 1, "op_func")
                fn = _function_named(module.tree, func.id, node) if isinstance(func, ast.Name) else None
                if fn is None:
                    continue
                mutated = _strings(_argument(node, 2, "mutates_args"))
                found.append(Schema(op, args_of(fn, mutated), module.line(fn.lineno)))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for deco in node.decorator_list:
                    if isinstance(deco, ast.Call) and (dotted(deco.func) or "").endswith("library.custom_op") \
                            and _string(_argument(deco, 0, "name")) == op:
                        mutated = _strings(_argument(deco, 1, "mutates_args"))
                        found.append(Schema(op, args_of(node, mutated), module.line(node.lineno)))
    return found


CHUNK = 16 << 20
OVERLAP = 8192
_LIBRARY = re.compile(rb"TORCH_LIBRARY(?:_FRAGMENT)?_(?:static_)?init_(\w+?)_\d+")
_HEAD = re.compile(rb"[A-Za-z_]\w*(?:\.\w+)?\(")


@dataclass
class Extension:
    """What one compiled extension defines: the namespaces of its torch library fragments, and its schema strings
    by ``name[.overload]``."""

    member: str
    namespaces: set[str]
    schemas: dict[str, set[str]]


def _read_extension(wheel: Wheel, member: str) -> Extension:
    """Scan ``member`` in chunks of :data:`CHUNK` (overlapping by :data:`OVERLAP`, longer than any schema string), so
    a large extension is never held whole: its fragment symbols, and every NUL-delimited string that reads
    ``name(...) -> ...``."""
    namespaces: set[str] = set()
    schemas: dict[str, set[str]] = {}
    tail = b""
    with wheel.zip.open(member) as stream:
        while True:
            block = stream.read(CHUNK)
            data = tail + block
            namespaces.update(m.group(1).decode() for m in _LIBRARY.finditer(data))
            at = data.find(b") -> ")
            while at >= 0:
                start, end = data.rfind(b"\x00", 0, at) + 1, data.find(b"\x00", at)
                if end < 0:
                    break  # cut by the chunk's end: read whole with the next chunk
                text = data[start:end]
                if _HEAD.match(text) and (start > 0 or not tail):
                    schemas.setdefault(text[: text.index(b"(")].decode(), set()).add(" ".join(text.decode().split()))
                at = data.find(b") -> ", end)
            if not block:
                return Extension(member, namespaces, schemas)
            tail = data[-OVERLAP:]


def extensions(wheel: Wheel) -> list[Extension]:
    """The wheel's top-level compiled extensions (``vllm/*.so``), each read once per wheel."""
    if "extensions" not in wheel.derived:
        members = sorted(m for m in wheel.members if re.fullmatch(r"vllm/[^/]+\.so", m))
        wheel.derived["extensions"] = [_read_extension(wheel, m) for m in members]
    return wheel.derived["extensions"]


def native_op(wheel: Wheel, op: str) -> list[Schema]:
    """The schema strings of ``ns::name[.overload]`` in the extensions that define a library fragment for ``ns``."""
    namespace, _, name = op.partition("::")
    return [Schema(op, parse(text), ext.member) for ext in extensions(wheel) if namespace in ext.namespaces
            for text in sorted(ext.schemas.get(name, ()))]


def find_op(wheel: Wheel, op: str) -> list[Schema]:
    """The definitions of ``ns::name[.overload]``: Python registrations for an op without an overload, else (and
    when Python defines none) schema strings in the compiled extensions."""
    found = python_op(wheel, op) if "." not in op.partition("::")[2] else []
    return found or native_op(wheel, op)
