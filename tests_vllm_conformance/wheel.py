"""One vLLM wheel, read in place and never imported (its modules need CUDA torch).

:class:`Wheel` opens the wheel's zip, lists its members, and indexes a Python module with ``ast`` when a name in it
is asked for (:class:`ModuleIndex`: classes, module-level functions, assignments and imports; :class:`ClassIndex`:
bases, methods, attributes). :meth:`Wheel.find` resolves a dotted name the way ``import`` and attribute access
would: through packages, modules, re-exports (``from x import y``), classes, and a class's bases within the wheel.
"""

from __future__ import annotations

import ast
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "vllm"
NEWLINE = b"\n"


@dataclass(frozen=True)
class Found:
    """A name found in the wheel: what it is (``module``, ``class``, ``function``, ``attribute`` or ``assignment``),
    where (``vllm/x/y.py:123``, the line of its definition), its ``ast`` node (None for a module or an attribute),
    the module that defines it, and the class that holds it (for methods and attributes)."""

    kind: str
    where: str
    node: ast.AST | None = None
    module: "ModuleIndex | None" = None
    owner: "ClassIndex | None" = None
    value: ast.AST | None = None  # the value assigned, for an assignment or a class-level attribute

    def source(self) -> str:
        """The definition's source text (a function's or class's), or ``""``."""
        if self.node is None or self.module is None:
            return ""
        return ast.get_source_segment(self.module.text, self.node) or ""


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` of a name or attribute chain (a subscript ``A[T]`` counts as ``A``), else None."""
    if isinstance(node, ast.Subscript):
        return dotted(node.value)
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _targets(target: ast.AST):
    """The simple targets of an assignment target (tuples unpacked)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _targets(element)
    else:
        yield target


def _is_type_checking(test: ast.AST) -> bool:
    return dotted(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


class ClassIndex:
    """A class statement: its bases (dotted, as written), methods, nested classes, and attributes: ``self.x = ...``
    (or ``self.x: T = ...``) in any of its methods, and class-level assignments and annotations (dataclass fields,
    enum members, class variables). Each attribute maps to the line of its first assignment."""

    def __init__(self, node: ast.ClassDef, module: "ModuleIndex"):
        self.node, self.module, self.name = node, module, node.name
        self.bases = [b for b in (dotted(base) for base in node.bases) if b]
        self.methods: dict[str, ast.FunctionDef] = {}
        self.classes: dict[str, ClassIndex] = {}
        self.attributes: dict[str, int] = {}
        self.values: dict[str, ast.AST] = {}  # class-level ``name = value`` (a single name target)
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.methods.setdefault(stmt.name, stmt)
            elif isinstance(stmt, ast.ClassDef):
                self.classes[stmt.name] = ClassIndex(stmt, module)
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                self.attributes.setdefault(stmt.target.id, stmt.lineno)
                if stmt.value is not None:
                    self.values.setdefault(stmt.target.id, stmt.value)
            elif isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    for t in _targets(target):
                        if isinstance(t, ast.Name):
                            self.attributes.setdefault(t.id, stmt.lineno)
                            if t is target:
                                self.values.setdefault(t.id, stmt.value)
        for method in self.methods.values():
            self._self_assignments(method)

    def _self_assignments(self, method) -> None:
        args = method.args.posonlyargs + method.args.args
        if not args or any(dotted(d) == "staticmethod" for d in method.decorator_list):
            return
        me = args[0].arg
        for node in ast.walk(method):
            if isinstance(node, ast.Assign):
                targets = [t for target in node.targets for t in _targets(target)]
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            else:
                continue
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == me:
                    self.attributes.setdefault(t.attr, node.lineno)

    def where(self, line: int | None = None) -> str:
        return f"{self.module.member}:{self.node.lineno if line is None else line}"


class ModuleIndex:
    """One Python module of the wheel: its classes, module-level functions, assignments (name -> line) and imports
    (local name -> the dotted name it binds), read from the module body and from the ``if``/``try`` blocks at module
    level (an ``if TYPE_CHECKING:`` body binds nothing at run time and is left out)."""

    def __init__(self, name: str, member: str, text: str):
        self.name, self.member, self.text = name, member, text
        self.tree = ast.parse(text, filename=member)
        self.package = name if member.endswith("__init__.py") else name.rpartition(".")[0]
        self.classes: dict[str, ClassIndex] = {}
        self.functions: dict[str, ast.FunctionDef] = {}
        self.assignments: dict[str, int] = {}
        self.values: dict[str, ast.AST] = {}  # module-level ``name = value`` (a single name target)
        self.imports: dict[str, str] = {}
        self._collect(self.tree.body)
        self.lazy = self._lazy_exports() if "__getattr__" in self.functions else {}

    def _collect(self, body) -> None:
        for stmt in body:
            if isinstance(stmt, ast.ClassDef):
                self.classes.setdefault(stmt.name, ClassIndex(stmt, self))
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(stmt.name, stmt)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                for target in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
                    for t in _targets(target):
                        if isinstance(t, ast.Name):
                            self.assignments.setdefault(t.id, stmt.lineno)
                            if t is target and stmt.value is not None:
                                self.values.setdefault(t.id, stmt.value)
            elif isinstance(stmt, ast.ImportFrom):
                base = self._absolute(stmt.module, stmt.level)
                for alias in stmt.names:
                    if alias.name != "*":
                        self.imports.setdefault(alias.asname or alias.name, f"{base}.{alias.name}")
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    local = alias.asname or alias.name.partition(".")[0]
                    self.imports.setdefault(local, alias.name if alias.asname else local)
            elif isinstance(stmt, ast.If):
                self._collect(stmt.orelse if _is_type_checking(stmt.test) else stmt.body + stmt.orelse)
            elif isinstance(stmt, ast.Try):
                self._collect(stmt.body + [s for h in stmt.handlers for s in h.body] + stmt.orelse + stmt.finalbody)

    def _lazy_exports(self) -> dict[str, str]:
        """Names a module-level ``__getattr__`` hands out from a table ``{"Name": ".module:attribute"}`` (vLLM's
        ``vllm.LLM`` and the like): name -> the dotted name it resolves to."""
        out = {}
        for stmt in self.tree.body:
            if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Dict):
                for key, value in zip(stmt.value.keys, stmt.value.values):
                    if not (isinstance(key, ast.Constant) and isinstance(value, ast.Constant)):
                        continue
                    match = re.fullmatch(r"(\.*)([\w.]*):(\w+)", str(value.value))
                    if isinstance(key.value, str) and match:
                        dots, module, attribute = match.groups()
                        base = self._absolute(module or None, len(dots)) if dots else module
                        out[key.value] = f"{base}.{attribute}"
        return out

    def _absolute(self, module: str | None, level: int) -> str:
        if not level:
            return module or ""
        parts = self.package.split(".")
        base = parts[: len(parts) - level + 1]
        return ".".join(base + ([module] if module else []))

    def line(self, lineno: int) -> str:
        return f"{self.member}:{lineno}"


def version_of(path: Path) -> str:
    """The release of a wheel file named ``vllm-<version>-<tags>.whl``."""
    return path.name.split("-")[1]


class Wheel:
    """A vLLM wheel file: its members, its Python modules (parsed on first use) and :meth:`find`."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.version = version_of(self.path)
        self.zip = zipfile.ZipFile(self.path)
        self.members = {info.filename: info for info in self.zip.infolist()}
        self._modules: dict[str, ModuleIndex | None] = {}
        self._sources: dict[str, bytes] | None = None
        self.derived: dict = {}  # what other modules read off the wheel once (schemas: its extensions)

    def __repr__(self) -> str:
        return f"Wheel({self.path.name})"

    # -- members ------------------------------------------------------------------------------------

    def read(self, member: str) -> bytes:
        return self.zip.read(member)

    def sources(self) -> dict[str, bytes]:
        """Every ``.py`` member's bytes (read once: about 50 MB)."""
        if self._sources is None:
            self._sources = {name: self.zip.read(name) for name in self.members if name.endswith(".py")}
        return self._sources

    def members_containing(self, needle: bytes) -> list[str]:
        """The ``.py`` members whose text contains ``needle``, in name order."""
        return sorted(name for name, data in self.sources().items() if needle in data)

    def definitions(self, name: str, attribute: bool = False, limit: int = 3) -> list[str]:
        """Where the wheel defines a function or class ``name`` (with ``attribute``: assigns ``<object>.name`` or
        declares ``name:`` in a class body), as ``file:line``, at most ``limit``: the hint of a name not found."""
        if attribute:
            pattern = rb"(?:\.%s[ \t]*(?::[^=\n]*)?=[^=]|^[ \t]+%s[ \t]*:)" % ((re.escape(name.encode()),) * 2)
        else:
            pattern = rb"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+%s\b" % re.escape(name.encode())
        regex, needle, out = re.compile(pattern, re.M), name.encode(), []
        for member, data in sorted(self.sources().items()):
            if needle in data:
                out += [f"{member}:{data.count(NEWLINE, 0, m.start()) + 1}" for m in regex.finditer(data)]
            if len(out) >= limit:
                break
        return out[:limit]

    def module_member(self, name: str) -> str | None:
        """``vllm/a/b.py`` or ``vllm/a/b/__init__.py`` of module ``vllm.a.b``, or None."""
        stem = name.replace(".", "/")
        for member in (f"{stem}.py", f"{stem}/__init__.py"):
            if member in self.members:
                return member
        return None

    def is_package(self, name: str) -> bool:
        """A folder of the wheel (with or without ``__init__.py``: a namespace package imports too)."""
        prefix = name.replace(".", "/") + "/"
        return any(member.startswith(prefix) for member in self.members)

    def module(self, name: str) -> ModuleIndex | None:
        """The module ``name`` indexed (cached), or None when the wheel has no such Python module."""
        if name not in self._modules:
            member = self.module_member(name)
            index = None
            if member is not None:
                index = ModuleIndex(name, member, self.read(member).decode("utf-8"))
            self._modules[name] = index
        return self._modules[name]

    # -- names --------------------------------------------------------------------------------------

    def find(self, name: str, _depth: int = 0) -> Found | None:
        """The definition ``name`` (``vllm.a.b.C.attr``) resolves to, or None. A module attribute is a class, a
        function, an assignment, an imported name (followed to its definition) or a submodule; a class attribute is a
        method, a nested class or an attribute (:class:`ClassIndex`), looked up in its bases too."""
        if _depth > 12 or not (name == PACKAGE or name.startswith(PACKAGE + ".")):
            return None
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            module_name = ".".join(parts[:cut])
            module = self.module(module_name)
            if module is not None:
                return self._in_module(module, parts[cut:], _depth)
            if cut == len(parts) and self.is_package(module_name):
                return Found("module", module_name.replace(".", "/") + "/")
        return None

    def _in_module(self, module: ModuleIndex, rest: list[str], depth: int) -> Found | None:
        if not rest:
            return Found("module", module.member, None, module)
        head, tail = rest[0], rest[1:]
        if head in module.classes:
            return self._in_class(module.classes[head], tail, depth)
        if head in module.functions:
            node = module.functions[head]
            return None if tail else Found("function", module.line(node.lineno), node, module)
        submodule = f"{module.name}.{head}" if module.member.endswith("__init__.py") else None
        if head in module.imports:
            target = module.imports[head]
            if target != f"{module.name}.{head}":
                return self.find(".".join([target, *tail]), depth + 1)
        if submodule and (self.module_member(submodule) or self.is_package(submodule)):
            return self.find(".".join([submodule, *tail]), depth + 1)
        if head in module.assignments:
            return None if tail else Found("assignment", module.line(module.assignments[head]), None, module,
                                           value=module.values.get(head))
        if head in module.lazy:
            return self.find(".".join([module.lazy[head], *tail]), depth + 1)
        return None

    def _in_class(self, cls: ClassIndex, rest: list[str], depth: int) -> Found | None:
        if not rest:
            return Found("class", cls.where(), cls.node, cls.module)
        head, tail = rest[0], rest[1:]
        if head in cls.classes:
            return self._in_class(cls.classes[head], tail, depth)
        if not tail and head in cls.methods:
            node = cls.methods[head]
            return Found("function", cls.where(node.lineno), node, cls.module, cls)
        if not tail and head in cls.attributes:
            return Found("attribute", cls.where(cls.attributes[head]), None, cls.module, cls, cls.values.get(head))
        for base in self.bases(cls, depth):
            found = self._in_class(base, rest, depth + 1)
            if found is not None:
                return found
        return None

    def bases(self, cls: ClassIndex, depth: int = 0) -> list[ClassIndex]:
        """The bases of ``cls`` that the wheel defines (bases from other packages, e.g. ``torch.nn.Module``, are
        not followed)."""
        out = []
        for base in cls.bases:
            head, _, tail = base.partition(".")
            module = cls.module
            if head in module.classes and not tail:
                out.append(module.classes[head])
                continue
            target = module.imports.get(head)
            found = self.find(".".join(filter(None, [target, tail])), depth + 1) if target else None
            if found is not None and found.kind == "class":
                out.append(self.class_at(found))
        return [c for c in out if c is not None and c is not cls]

    def class_at(self, found: Found) -> ClassIndex | None:
        """The :class:`ClassIndex` of a found class."""
        return _class_of(found.module, found.node) if found.module else None


def _class_of(module: ModuleIndex, node: ast.AST) -> ClassIndex | None:
    stack = list(module.classes.values())
    while stack:
        cls = stack.pop()
        if cls.node is node:
            return cls
        stack.extend(cls.classes.values())
    return None


def normalise(text: str) -> str:
    """Whitespace runs collapsed to one space (and none inside brackets), for comparing source and schema text."""
    text = re.sub(r"\s+", " ", text).strip()
    return re.sub(r"([(\[]) | ([)\]])", r"\1\2", text)
