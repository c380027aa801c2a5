"""The kinds of entry the manifest (:mod:`names`) is written in, each with the check of one wheel.

An entry names one vLLM dependency of the project and, where the dependency is more than a name, what the project
relies on (the parameters it passes, the arguments of an op, the statements of a function it relies on). It applies
to every supported release, or to the release lines in ``releases`` (``("0.33", "0.34")``) where the name differs
between releases. ``check(wheel)`` returns the problems found, each one line; none means the release conforms.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from .schemas import Arg, find_op, parse, render
from .wheel import Found, Wheel, dotted, normalise


def in_line(version: str, line: str) -> bool:
    """Whether release ``version`` (``"0.34.0"``) belongs to release line ``line`` (``"0.34"``)."""
    return version == line or version.startswith(line + ".")


def not_found(wheel: Wheel, name: str, attribute: bool = False) -> str:
    """``not found``, with where the wheel defines something of that last name, if anywhere (it may have moved)."""
    places = wheel.definitions(name.rpartition(".")[2], attribute)
    return "not found" + (f" (the wheel {'assigns' if attribute else 'defines'} "
                          f"{name.rpartition('.')[2]} at {', '.join(places)})" if places else "")


@dataclass(frozen=True)
class Entry:
    """One dependency: ``name`` (dotted, or ``ns::op``) and the release lines it applies to (empty: all)."""

    name: str
    releases: tuple[str, ...] = field(default=(), kw_only=True)
    user: str = field(default="", kw_only=True)

    @property
    def id(self) -> str:
        return self.name + (f"@{self.user}" if self.user else "")

    def applies(self, version: str) -> bool:
        return not self.releases or any(in_line(version, line) for line in self.releases)

    def check(self, wheel: Wheel) -> list[str]:
        """The problems of ``wheel`` with this entry, one line each (more lines indented); none: it conforms."""
        raise NotImplementedError

    def failures(self, wheel: Wheel) -> list[str]:
        """:meth:`check`'s problems as failure lines: ``vllm <release>: <name>: <problem>``."""
        return [f"vllm {wheel.version}: {self.name}: {problem}" for problem in self.check(wheel)]

    def _find(self, wheel: Wheel, kinds: tuple[str, ...]) -> tuple[Found | None, list[str]]:
        found = wheel.find(self.name)
        if found is None:
            return None, [not_found(wheel, self.name)]
        if found.kind not in kinds:
            return None, [f"is a {found.kind} ({found.where}), not a {' or '.join(kinds)}"]
        return found, []


@dataclass(frozen=True)
class Module(Entry):
    """A module or package the project imports."""

    def check(self, wheel: Wheel) -> list[str]:
        return self._find(wheel, ("module",))[1]


@dataclass(frozen=True)
class Class(Entry):
    """A class the project imports, subclasses or hooks."""

    def check(self, wheel: Wheel) -> list[str]:
        return self._find(wheel, ("class",))[1]


@dataclass(frozen=True)
class Name(Entry):
    """A module-level name of any kind (a constant, a type alias, a function or class re-exported)."""

    def check(self, wheel: Wheel) -> list[str]:
        return self._find(wheel, ("assignment", "function", "class", "module"))[1]


def _parameters(node: ast.FunctionDef, method: bool):
    a = node.args
    positional = [p.arg for p in a.posonlyargs + a.args]
    static = any(dotted(d) == "staticmethod" for d in node.decorator_list)
    if method and not static and positional:
        positional = positional[1:]  # self / cls
    defaults = dict(zip([p.arg for p in (a.posonlyargs + a.args)][-len(a.defaults):] if a.defaults else [],
                        a.defaults))
    defaults.update({p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
    keywords = {p.arg for p in a.args + a.kwonlyargs}
    return positional, keywords, a.kwarg is not None, defaults


@dataclass(frozen=True)
class Function(Entry):
    """A function or method the project calls (or wraps). ``params``: the leading positional parameters the project
    passes, by name (``"_"``: any name), after ``self``; ``keywords``: the parameters it passes by keyword (accepted
    by name or by ``**kwargs``); ``defaults``: parameters whose default the project relies on, with that default."""

    params: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    defaults: tuple[tuple[str, object], ...] = ()

    def check(self, wheel: Wheel) -> list[str]:
        found, problems = self._find(wheel, ("function",))
        if found is None:
            return problems
        positional, keywords, var_keyword, defaults = _parameters(found.node, found.owner is not None)
        head = positional[: len(self.params)]
        if len(head) < len(self.params) or any(w not in ("_", h) for w, h in zip(self.params, head)):
            problems.append(f"positional parameters ({', '.join(positional)}) at {found.where} do not start with "
                            f"({', '.join(self.params)})")
        missing = [k for k in self.keywords if k not in keywords and not var_keyword]
        if missing:
            problems.append(f"takes no keyword {', '.join(missing)} ({found.where})")
        for param, value in self.defaults:
            node = defaults.get(param)
            got = None if node is None else ast.unparse(node)
            if got != repr(value):
                problems.append(f"default of {param} is {got or 'none'}, the project relies on {value!r} "
                                f"({found.where})")
        return problems


@dataclass(frozen=True)
class Attribute(Entry):
    """An attribute the project reads of (or writes on) an instance of class ``owner``: set as ``self.<attr> = ...`` in
    one of its methods, a class-level assignment or annotation (a dataclass field), a property or method, or a nested
    class; in the class or one of its bases within the wheel. ``name`` is ``<owner>.<attr>``."""

    def __init__(self, owner: str, attribute: str, *, releases: tuple[str, ...] = (), user: str = ""):
        object.__setattr__(self, "name", f"{owner}.{attribute}")
        object.__setattr__(self, "releases", releases)
        object.__setattr__(self, "user", user)

    def check(self, wheel: Wheel) -> list[str]:
        owner, _, attribute = self.name.rpartition(".")
        found_owner = wheel.find(owner)
        if found_owner is None or found_owner.kind != "class":
            return [f"class {owner} not found"]
        return [] if wheel.find(self.name) is not None else [not_found(wheel, self.name, attribute=True)]


@dataclass(frozen=True)
class Returns(Entry):
    """A function whose ``return <constant>`` the project relies on (a backend's ``get_name()``)."""

    value: object = None

    def check(self, wheel: Wheel) -> list[str]:
        found, problems = self._find(wheel, ("function",))
        if found is None:
            return problems
        returned = [n.value.value for n in ast.walk(found.node)
                    if isinstance(n, ast.Return) and isinstance(n.value, ast.Constant)]
        if self.value not in returned:
            return [f"returns {', '.join(map(repr, returned)) or 'no constant'}, not {self.value!r} ({found.where})"]
        return []


@dataclass(frozen=True)
class Constant(Entry):
    """A module-level or class-level name (an enum member, a constant) whose value the project relies on."""

    value: object = None

    def check(self, wheel: Wheel) -> list[str]:
        found, problems = self._find(wheel, ("assignment", "attribute"))
        if found is None:
            return problems
        try:
            got = ast.literal_eval(found.value) if found.value is not None else "<no value>"
        except ValueError:
            got = ast.unparse(found.value)
        return [] if got == self.value else [f"is {got!r}, not {self.value!r} ({found.where})"]


@dataclass(frozen=True)
class Statements(Entry):
    """Statements of a function (or of any method of a class) that the project relies on, whitespace-normalised:
    each found in the normalised source, or with ``whole_lines`` equal to one of its lines (as the project's own
    run-time check reads them)."""

    statements: tuple[str, ...] = ()
    whole_lines: bool = False

    @property
    def id(self) -> str:
        return f"{self.name}:source" + (f"@{self.user}" if self.user else "")

    def check(self, wheel: Wheel) -> list[str]:
        found, problems = self._find(wheel, ("function", "class"))
        if found is None:
            return problems
        text = found.source()
        if self.whole_lines:
            lines = {normalise(line) for line in text.splitlines()}
            missing = [s for s in self.statements if normalise(s) not in lines]
        else:
            source = normalise(text)
            missing = [s for s in self.statements if normalise(s) not in source]
        return [f"has no statement {s!r} ({found.where})" for s in missing]


@dataclass(frozen=True)
class Calls(Entry):
    """A class (``name``) whose methods call ``callee`` (a dotted name as written, matched at its end) with the
    keyword arguments ``keywords`` set to these constants: how a vLLM kernel reaches the op the project matches."""

    callee: str = ""
    keywords: tuple[tuple[str, object], ...] = ()

    @property
    def id(self) -> str:
        return f"{self.name}->{self.callee}" + (f"@{self.user}" if self.user else "")

    def check(self, wheel: Wheel) -> list[str]:
        found, problems = self._find(wheel, ("class",))
        if found is None:
            return problems
        calls = [n for n in ast.walk(found.node) if isinstance(n, ast.Call)
                 and (dotted(n.func) or "").split(".")[-len(self.callee.split(".")):] == self.callee.split(".")]
        if not calls:
            return [f"calls no {self.callee} ({found.where})"]
        wanted = dict(self.keywords)

        def constants(call):
            out = {}
            for kw in call.keywords:
                try:
                    out[kw.arg] = ast.literal_eval(kw.value)
                except ValueError:
                    out[kw.arg] = ast.unparse(kw.value)
            return out

        seen = [constants(c) for c in calls]
        if not any(all(k in got and got[k] == v for k, v in wanted.items()) for got in seen):
            shown = "; ".join(", ".join(f"{k}={got.get(k)!r}" for k in wanted) for got in seen)
            return [f"calls {self.callee} with {shown}, not {', '.join(f'{k}={v!r}' for k, v in wanted.items())} "
                    f"({found.where})"]
        return []


def _difference(expected: tuple[Arg, ...], actual: tuple[Arg, ...]) -> str | None:
    """The first argument where ``actual`` differs from ``expected`` (an expected argument named only is compared by
    name), or None."""
    for i in range(max(len(expected), len(actual))):
        e = expected[i] if i < len(expected) else None
        a = actual[i] if i < len(actual) else None
        if e is None:
            return f"argument {i + 1} ({a}) is not in the project's list"
        if a is None:
            return f"argument {i + 1} ({e}) is missing"
        same = e.name == a.name if e.type is None else e == a
        if not same:
            return f"argument {i + 1}: the project has `{e}`, the wheel `{a}`"
    return None


@dataclass(frozen=True)
class OpSchema(Entry):
    """An op the project matches, calls or mirrors: ``ns::name`` or ``ns::name.overload``. ``args``: the argument list
    the project's code relies on argument for argument (its fused ops mirror it; torch schema syntax, an argument
    written by name only is compared by name); ``has``: argument names the project reads (any other arguments
    allowed); neither: the op must exist."""

    args: str | None = None
    has: tuple[str, ...] = ()

    def check(self, wheel: Wheel) -> list[str]:
        schemas = find_op(wheel, self.name)
        if not schemas:
            return ["not defined (no Python registration, no schema in the compiled extensions)"]
        problems = []
        expected = parse(self.args) if self.args is not None else None
        for schema in schemas:
            if expected is not None:
                why = _difference(expected, schema.args)
                if why:
                    problems.append(f"arguments differ at {schema.where}: {why}\n    project: {render(expected)}\n"
                                    f"    wheel:   {schema.text()}")
            names = {a.name for a in schema.args}
            missing = [n for n in self.has if n not in names]
            if missing:
                problems.append(f"has no argument {', '.join(missing)} at {schema.where} ({schema.text()})")
        return problems


@dataclass(frozen=True)
class PluginGroup(Entry):
    """An entry-point group the project registers in (``name``), loaded by vLLM's ``loader`` (a function): the loader
    passes the group (as a constant or a module-level name bound to it) to a function of its module that calls
    ``entry_points(group=...)``, calls each loaded plugin without arguments, and is itself called elsewhere in the
    wheel."""

    loader: str = ""

    @property
    def id(self) -> str:
        return f"entry-points:{self.name}"

    def check(self, wheel: Wheel) -> list[str]:
        found = wheel.find(self.loader)
        if found is None or found.kind != "function":
            return [f"the loader {self.loader} not found"]
        module, node = found.module, found.node
        group_names = {name for name in module.assignments
                       if _constant_assigned(module.tree, name) == self.name}
        calls = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
        passing = [c for c in calls if any(_is_group(v, group_names, self.name) for v in _arguments(c))]
        if not passing:
            return [f"{self.loader} ({found.where}) passes group {self.name!r} to no function"]
        problems = []
        for call in passing[:1]:
            helper = module.functions.get(dotted(call.func) or "")
            if helper is None or not any((dotted(c.func) or "").endswith("entry_points") and
                                         any(k.arg == "group" for k in c.keywords)
                                         for c in ast.walk(helper) if isinstance(c, ast.Call)):
                problems.append(f"{dotted(call.func)} (called by {self.loader}) does not read entry_points(group=...)")
        loops = [n for n in ast.walk(node) if isinstance(n, ast.For) and isinstance(n.target, ast.Name)]
        if not any(isinstance(c, ast.Call) and dotted(c.func) == loop.target.id and not c.args and not c.keywords
                   for loop in loops for c in ast.walk(loop)):
            problems.append(f"{self.loader} ({found.where}) does not call each loaded plugin without arguments")
        function = self.loader.rpartition(".")[2]
        callers = [m for m in wheel.members_containing(f"{function}(".encode()) if m != module.member]
        if not callers:
            problems.append(f"{self.loader} is called nowhere else in the wheel")
        return problems


def _constant_assigned(tree: ast.Module, name: str):
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
            return stmt.value.value if isinstance(stmt.value, ast.Constant) else None
    return None


def _arguments(call: ast.Call):
    return list(call.args) + [k.value for k in call.keywords]


def _is_group(node, names, group) -> bool:
    return (isinstance(node, ast.Constant) and node.value == group) or (isinstance(node, ast.Name) and node.id in names)
