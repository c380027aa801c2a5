"""Graph dumps for debugging the pass.

``with fusion_pass.compile.debug.dump("out/"):`` (or ``FUSION_PASS_DUMP=out/`` in the
environment) writes, for every graph the pass runs on:

* ``graph_NNN_before.py`` / ``graph_NNN_after.py``: the post-grad graph before
  and after the pass, as readable Python;
* ``graph_NNN_report.json``: the match report of that graph (candidates,
  rewritten, refused with reasons, one entry per attention layer) and, under
  ``"depyf"``, the depyf files of the same graph;
* ``depyf/``: depyf's dump of the Dynamo and Inductor artifacts (decompiled
  bytecode, the captured graphs, Inductor's output code).

depyf names its files after Dynamo's compiled function (``__compiled_fn_3.*``),
not after our graph numbers: each graph's report (``"depyf": {"compiled_fn",
"files", "transformed_code"}``) and the header of its before/after files name
the depyf files that belong to it, and ``"compile_id"`` is Dynamo's compile id
(``0/0``, as in ``TORCH_LOGS`` and tlparse). The file list is completed when the
dump ends (Inductor writes the output code after the pass has run).

Several processes may share one directory (vLLM's engine and worker processes
all inherit ``FUSION_PASS_DUMP``): a graph takes the lowest free number, claimed
by creating its report file exclusively, and its report names the process
(``"pid"``).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import itertools
import json
import os
import warnings
from pathlib import Path

import torch

from fusion_pass.nvfp4 import ArgumentError

ENV_VAR = "FUSION_PASS_DUMP"

DEPYF_WARNING = r".*You are trying to debug `torch\.compile`"
"""The warning depyf prints each time its debugging is enabled: filtered around that call (the dump enables it
once per :func:`dump`, and it says nothing about the graphs)."""

_dump_dir: Path | None = None
_counter = itertools.count()
_recorded: list[Path] = []  # report files of this process under the current dump directory


def active() -> bool:
    """Whether graph dumps are being written (by :func:`dump` or the env var)."""
    return _dump_dir is not None


def dump_dir() -> Path | None:
    return _dump_dir


def graph_source(graph: torch.fx.Graph) -> str:
    """The graph as readable Python (node names as in the graph, shapes in comments)."""
    return graph.python_code(root_module="self", verbose=True).src


def compiled_fn_name() -> str | None:
    """The name of the Dynamo-compiled function being compiled now (``"__compiled_fn_3"``; call it inside a
    compile): what depyf names the files of this graph after (it reads the same counter). None on a torch
    without that counter."""
    try:
        from torch._dynamo.bytecode_transformation import _unique_id_counter

        return f"__compiled_fn_{next(copy.copy(_unique_id_counter)) - 1}"
    except Exception:  # a torch without that counter: the report simply names no depyf file
        return None


def compile_id() -> str | None:
    """Dynamo's id of the compile in progress (``"0/0"``), or None outside one."""
    try:
        current = torch._guards.CompileContext.current_compile_id()
    except Exception:
        return None
    return None if current is None else str(current)


def depyf_files(compiled_fn: str | None) -> dict:
    """The depyf files of the graph Dynamo compiled as ``compiled_fn``, relative to the dump directory:
    ``files`` (``depyf/<compiled_fn>.*``: the graphs AOT autograd and Inductor saw, Inductor's kernel) and
    ``transformed_code`` (Dynamo's transformed bytecode, decompiled, that calls it)."""
    entry = {"compiled_fn": compiled_fn, "files": [], "transformed_code": []}
    if _dump_dir is None or compiled_fn is None:
        return entry
    folder = _dump_dir / "depyf"
    if not folder.is_dir():
        return entry
    entry["files"] = sorted(str(p.relative_to(_dump_dir)) for p in folder.glob(f"{compiled_fn}.*"))
    calls = []
    for path in sorted(folder.glob("__transformed_code_*.py")):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        if f"{compiled_fn}(" in text or f"{compiled_fn}_" in text:
            calls.append(str(path.relative_to(_dump_dir)))
    entry["transformed_code"] = calls
    return entry


def record_graph(index: int, before: str, after: str, report: dict) -> Path:
    """Write one graph's before/after source and report under the dump directory, naming the depyf files of
    the same graph (:func:`depyf_files`)."""
    assert _dump_dir is not None
    while True:  # claim a number no other process sharing the directory has taken
        stem = _dump_dir / f"graph_{next(_counter):03d}"
        try:
            fd = os.open(f"{stem}_report.json", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            continue
        break
    cid = compile_id()
    fn = compiled_fn_name() if cid is not None else None  # a graph passed by hand has no Dynamo function
    depyf = depyf_files(fn)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({**report, "pid": os.getpid(), "compile_id": cid, "depyf": depyf}, indent=2,
                           default=str))
    _recorded.append(Path(f"{stem}_report.json"))
    where = f"depyf/{fn}.*" if fn else "unknown"
    header = (f"# fusion_pass graph {index} (process {os.getpid()}, Dynamo compile {cid}): post-grad graph {{}} "
              f"the fusion pass\n# depyf files of this graph: {where} (its report lists them)\n")
    Path(f"{stem}_before.py").write_text(header.format("before") + before)
    Path(f"{stem}_after.py").write_text(header.format("after") + after)
    return stem


def _complete_depyf_lists() -> None:
    """Fill in the depyf files written after each graph's report (Inductor's output code comes later)."""
    for path in _recorded:
        try:
            report = json.loads(path.read_text())
            report["depyf"] = depyf_files(report.get("depyf", {}).get("compiled_fn"))
            path.write_text(json.dumps(report, indent=2, default=str))
        except (OSError, ValueError):
            continue


def dump(directory: str | os.PathLike):
    """Write graph dumps and depyf's artifacts under ``directory`` for the compiles in the block:
    ``with fusion_pass.debug.dump("out/"):``. ``directory`` must be a path (str or os.PathLike); anything
    else is an :class:`~fusion_pass.nvfp4.ArgumentError` (a ValueError) naming it, raised by this call."""
    if isinstance(directory, bytes):
        directory = os.fsdecode(directory)
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise ArgumentError(f"fusion_pass.debug.dump: directory must be a path (a non-empty str or "
                            f"os.PathLike) to write the dumps under, got {type(directory).__name__} {directory!r}")
    return _dump(Path(directory))


@contextlib.contextmanager
def _dump(path: Path):
    import depyf

    global _dump_dir, _counter, _recorded
    previous = _dump_dir, _counter, _recorded
    path.mkdir(parents=True, exist_ok=True)
    _dump_dir, _counter, _recorded = path, itertools.count(), []  # each directory numbers its graphs from 000
    try:
        with contextlib.ExitStack() as stack:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=DEPYF_WARNING)
                stack.enter_context(depyf.prepare_debug(str(path / "depyf")))
            yield path
    finally:
        try:
            _complete_depyf_lists()  # after depyf's exit, which writes files of its own
        finally:
            _dump_dir, _counter, _recorded = previous


def _enable_from_env() -> None:
    """Honour ``FUSION_PASS_DUMP=dir``: dumps for the whole process."""
    directory = os.environ.get(ENV_VAR)
    if not directory or active():
        return
    context = dump(directory)
    context.__enter__()
    atexit.register(context.__exit__, None, None, None)


_enable_from_env()
