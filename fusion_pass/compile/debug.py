"""Graph dumps for debugging the pass.

``with fusion_pass.compile.debug.dump("out/"):`` (or ``FUSION_PASS_DUMP=out/`` in the
environment) writes, for every graph the pass runs on:

* ``graph_NNN_before.py`` / ``graph_NNN_after.py``: the post-grad graph before
  and after the pass, as readable Python;
* ``graph_NNN_report.json``: the match report of that graph (candidates,
  rewritten, refused with reasons, one entry per attention layer);
* ``depyf/``: depyf's dump of the Dynamo and Inductor artifacts (decompiled
  bytecode, the captured graphs, Inductor's output code).

Several processes may share one directory (vLLM's engine and worker processes
all inherit ``FUSION_PASS_DUMP``): a graph takes the lowest free number, claimed
by creating its report file exclusively, and its report names the process
(``"pid"``).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
from pathlib import Path

import torch

ENV_VAR = "FUSION_PASS_DUMP"

_dump_dir: Path | None = None
_counter = itertools.count()


def active() -> bool:
    """Whether graph dumps are being written (by :func:`dump` or the env var)."""
    return _dump_dir is not None


def dump_dir() -> Path | None:
    return _dump_dir


def graph_source(graph: torch.fx.Graph) -> str:
    """The graph as readable Python (node names as in the graph, shapes in comments)."""
    return graph.python_code(root_module="self", verbose=True).src


def record_graph(index: int, before: str, after: str, report: dict) -> Path:
    """Write one graph's before/after source and report under the dump directory."""
    assert _dump_dir is not None
    while True:  # claim a number no other process sharing the directory has taken
        stem = _dump_dir / f"graph_{next(_counter):03d}"
        try:
            fd = os.open(f"{stem}_report.json", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            continue
        break
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({**report, "pid": os.getpid()}, indent=2, default=str))
    header = f"# fusion_pass graph {index} (process {os.getpid()}): post-grad graph {{}} the fusion pass\n"
    Path(f"{stem}_before.py").write_text(header.format("before") + before)
    Path(f"{stem}_after.py").write_text(header.format("after") + after)
    return stem


@contextlib.contextmanager
def dump(directory: str | os.PathLike):
    """Write graph dumps and depyf's artifacts under ``directory`` for the compiles in the block."""
    import depyf

    global _dump_dir, _counter
    previous = _dump_dir, _counter
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    _dump_dir, _counter = path, itertools.count()  # each directory numbers its graphs from 000
    try:
        with depyf.prepare_debug(str(path / "depyf")):
            yield path
    finally:
        _dump_dir, _counter = previous


def _enable_from_env() -> None:
    """Honour ``FUSION_PASS_DUMP=dir``: dumps for the whole process."""
    directory = os.environ.get(ENV_VAR)
    if not directory or active():
        return
    context = dump(directory)
    context.__enter__()
    atexit.register(context.__exit__, None, None, None)


_enable_from_env()
