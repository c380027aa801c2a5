"""Graph dumps for debugging the pass.

``with fusion_pass.compile.debug.dump("out/"):`` (or ``FUSION_PASS_DUMP=out/`` in the
environment) writes, in a folder of its own for that run, ``out/run_NNN_pid<PID>/``
(:func:`run_folder`), for every graph the pass runs on:

* ``graph_NNN_before.py`` / ``graph_NNN_after.py``: the post-grad graph before
  and after the pass, as readable Python;
* ``graph_NNN_report.json``: the match report of that graph (candidates,
  rewritten, refused with reasons, one entry per attention layer) and, under
  ``"depyf"``, the depyf files of the same graph;
* ``depyf/``: depyf's dump of the Dynamo and Inductor artifacts (decompiled
  bytecode, the captured graphs, Inductor's output code).

One run is one :func:`dump` block, or one process under ``FUSION_PASS_DUMP``
(vLLM's engine and worker processes all inherit it: each gets its own folder).
A run folder is never reused: depyf does not rewrite a file that exists (it
keeps it, or writes its own under the next free name), so two runs in one folder
would mix their files and a graph's report would name the other run's. ``NNN``
counts up over the runs in the directory (processes that start at the same moment
may get the same ``NNN``; the pid tells them apart); graphs are numbered from
``000`` in each run. A run that wrote nothing leaves no folder.

depyf names its files after Dynamo's compiled function (``__compiled_fn_3.*``),
not after our graph numbers: each graph's report (``"depyf": {"compiled_fn",
"files", "transformed_code"}``) and the header of its before/after files name
the depyf files that belong to it, and ``"compile_id"`` is Dynamo's compile id
(``0/0``, as in ``TORCH_LOGS`` and tlparse). The file list is completed when the
dump ends (Inductor writes the output code after the pass has run).

vLLM's per-process reports go to ``out/reports/`` (:mod:`fusion_pass.compile.process_reports`), beside the
run folders.

A directory that is a file, cannot be created or is not writable is an
:class:`~fusion_pass.nvfp4.ArgumentError` (a ValueError) naming where it came from
(``FUSION_PASS_DUMP`` or ``dump(directory)``) before anything is written
(:func:`check_directory`, :func:`check_environment`).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import itertools
import json
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

import torch

from fusion_pass.nvfp4 import ArgumentError

ENV_VAR = "FUSION_PASS_DUMP"

DEPYF_WARNING = r".*You are trying to debug `torch\.compile`"
"""The warning depyf prints each time its debugging is enabled: filtered around that call (the dump enables it
once per :func:`dump`, and it says nothing about the graphs)."""

RUN_PREFIX = "run_"
RUN_NAME = re.compile(r"run_(\d+)_pid\d+$")

_dump_dir: Path | None = None  # the run folder of the dump in progress
_counter = itertools.count()
_recorded: list[Path] = []  # report files of this process under the current dump directory


def active() -> bool:
    """Whether graph dumps are being written (by :func:`dump` or the env var)."""
    return _dump_dir is not None


def dump_dir() -> Path | None:
    """The run folder the graph dumps go to now (``DIR/run_NNN_pid<PID>``), or None."""
    return _dump_dir


def check_directory(directory, source: str) -> Path:
    """``directory`` as a Path to a writable directory, created if missing; else ArgumentError naming ``source``
    (``--out``, ``FUSION_PASS_DUMP``, ...) and what is expected."""
    if isinstance(directory, bytes):
        directory = os.fsdecode(directory)
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise ArgumentError(f"{source} must be a path (a non-empty str or os.PathLike) to write the dumps under, "
                            f"got {type(directory).__name__} {directory!r}")
    path = Path(directory)
    expected = "expected a directory that exists or can be created, and is writable"
    if path.exists() and not path.is_dir():
        raise ArgumentError(f"{source}={os.fspath(directory)!r} is a file, not a directory: {expected}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ArgumentError(f"{source}={os.fspath(directory)!r}: cannot create it ({exc.strerror or exc}): "
                            f"{expected}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ArgumentError(f"{source}={os.fspath(directory)!r} is not writable: {expected}")
    return path


def check_environment() -> Path | None:
    """Check ``FUSION_PASS_DUMP`` (:func:`check_directory`): its directory, None when unset, ArgumentError naming
    the variable when it cannot hold the dumps. ``fusion-pass`` calls it before any work."""
    directory = os.environ.get(ENV_VAR)
    return check_directory(directory, ENV_VAR) if directory else None


def run_folder(directory: Path, pid: int | None = None) -> Path:
    """Create this run's folder under ``directory``: ``run_NNN_pid<PID>``, ``NNN`` one more than the highest run
    number there (never an existing folder)."""
    pid = os.getpid() if pid is None else pid
    numbers = [int(m.group(1)) for p in directory.iterdir() if (m := RUN_NAME.match(p.name))]
    number = max(numbers, default=-1) + 1
    while True:
        folder = directory / f"{RUN_PREFIX}{number:03d}_pid{pid}"
        try:
            folder.mkdir()
        except FileExistsError:
            number += 1
            continue
        return folder


def _remove_if_empty(folder: Path) -> None:
    """Remove a run folder that holds no file (only empty folders): a run that compiled nothing."""
    try:
        if not any(p.is_file() or p.is_symlink() for p in folder.rglob("*")):
            shutil.rmtree(folder)
    except OSError:
        pass


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
    """Write graph dumps and depyf's artifacts for the compiles in the block, in a new run folder under
    ``directory`` (module docstring): ``with fusion_pass.debug.dump("out/") as run:`` (``run`` is that folder).
    ``directory`` must be a path (str or os.PathLike) to a writable directory (created if missing); anything else
    is an :class:`~fusion_pass.nvfp4.ArgumentError` (a ValueError) naming it, raised by this call."""
    return _dump(check_directory(directory, "fusion_pass.debug.dump: directory"))


@contextlib.contextmanager
def _dump(path: Path):
    import depyf

    global _dump_dir, _counter, _recorded
    previous = _dump_dir, _counter, _recorded
    try:
        run = run_folder(path)
    except OSError as exc:
        raise ArgumentError(f"cannot create a run folder in {path} ({exc.strerror or exc}): expected a writable "
                            f"directory") from None
    _dump_dir, _counter, _recorded = run, itertools.count(), []  # each run numbers its graphs from 000
    try:
        with contextlib.ExitStack() as stack:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=DEPYF_WARNING)
                stack.enter_context(depyf.prepare_debug(str(run / "depyf")))
            yield run
    finally:
        try:
            _complete_depyf_lists()  # after depyf's exit, which writes files of its own
        finally:
            _dump_dir, _counter, _recorded = previous
            _remove_if_empty(run)


def _running_the_command() -> bool:
    """Whether this process is the ``fusion-pass`` command (the console script or ``python -m fusion_pass.cli``),
    which checks the environment itself and says what is wrong in one line."""
    if sys.argv and os.path.basename(sys.argv[0]) == "fusion-pass":
        return True
    argv = list(getattr(sys, "orig_argv", ()))
    return any(a == "-mfusion_pass.cli" or (a == "-m" and argv[i + 1:i + 2] == ["fusion_pass.cli"])
               for i, a in enumerate(argv))


def _enable_from_env() -> None:
    """Honour ``FUSION_PASS_DUMP=dir``: dumps for the whole process, in a run folder of its own. A value that
    cannot hold them raises ArgumentError naming the variable (at ``import fusion_pass``), except in the
    ``fusion-pass`` command, whose first step reports it (:func:`check_environment`)."""
    directory = os.environ.get(ENV_VAR)
    if not directory or active():
        return
    try:
        context = _dump(check_directory(directory, ENV_VAR))
        context.__enter__()
    except ArgumentError:
        if _running_the_command():
            return
        raise
    atexit.register(context.__exit__, None, None, None)


_enable_from_env()
