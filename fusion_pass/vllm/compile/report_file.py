"""The report file of one vLLM process: ``<FUSION_PASS_DUMP>/reports/vllm_report_<pid>.json``, kept current.

A served model's run-time counters change long after its graphs were compiled, and vLLM's default stop does
not let its processes exit through Python: on SIGTERM the API server sends SIGTERM to the engine process and,
with the default ``--shutdown-timeout 0``, at once kills it and its process tree (``shutdown`` in
``vllm/v1/utils.py``, ``kill_process_tree``): the worker that ran the model gets SIGKILL and no signal before it.
A report written only at exit would miss every counter. Hence :class:`ReportFile`:

* written when the pass compiles a graph (the caller's :meth:`ReportFile.write`);
* rewritten by a daemon thread after the run-time counters change (a counters listener,
  :func:`fusion_pass.runtime.counters.add_listener`, only wakes the thread; the counters call it at the first
  change after the thread read them, so an attention call pays one flag test), at most once per
  ``min_interval_s`` (default :data:`MIN_INTERVAL_S`): the file is that much (and one write) behind the
  counters at most, whatever ends the process afterwards (SIGTERM, SIGKILL);
* rewritten at a normal exit (``atexit``);
* always replaced atomically (a temporary file, then ``os.replace``), so a process killed mid-write leaves the
  previous complete file, never a truncated one.

No signal handler is installed: vLLM installs its own in the engine and worker processes, and a handler that
read the counters could wait forever on their lock held by the interrupted thread.

A process forked from one that holds a ``ReportFile`` inherits its listener and ``atexit`` entry but never
writes through them (the file belongs to the pid that created it).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

from fusion_pass.runtime import counters

logger = logging.getLogger("vllm.fusion_pass")

REPORTS_DIR = "reports"
"""The folder under ``FUSION_PASS_DUMP`` that holds the process reports, apart from the graph dumps."""

MIN_INTERVAL_S = 0.25
"""The shortest time between two writes after counter changes, and the file's largest lag behind the counters:
at most four writes a second of a few kilobytes, in a thread of its own, while the counters change."""


def report_path(directory: str | Path, pid: int | None = None) -> Path:
    """``<directory>/reports/vllm_report_<pid>.json`` (``pid``: this process by default)."""
    return Path(directory) / REPORTS_DIR / f"vllm_report_{os.getpid() if pid is None else pid}.json"


class ReportFile:
    """This process's report file under ``directory`` (the ``FUSION_PASS_DUMP`` folder).

    ``snapshot()``: the report to write after a counter change and at exit (called in the writer thread and
    in ``atexit``; it must be safe there). ``min_interval_s``: a number > 0, see :data:`MIN_INTERVAL_S`.
    """

    def __init__(self, directory: str | Path, snapshot: Callable[[], dict], min_interval_s: float = MIN_INTERVAL_S):
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise ValueError(f"ReportFile: directory must be a non-empty path, got {directory!r}")
        if not callable(snapshot):
            raise ValueError(f"ReportFile: snapshot must be callable, got {type(snapshot).__name__} {snapshot!r}")
        if isinstance(min_interval_s, bool) or not isinstance(min_interval_s, (int, float)) or not min_interval_s > 0:
            raise ValueError(f"ReportFile: min_interval_s must be a number > 0, got {min_interval_s!r}")
        self.pid = os.getpid()
        self.path = report_path(directory, self.pid)
        self.snapshot = snapshot
        self.min_interval_s = float(min_interval_s)
        self.writes = {"graph": 0, "counters": 0, "exit": 0}  # files written, by occasion
        self._wake = threading.Event()
        self._write_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._failed = False

    def _mine(self) -> bool:
        return os.getpid() == self.pid and not self._closed

    def start(self) -> "ReportFile":
        """Start keeping the file current: the counters listener, the writer thread, the ``atexit`` write."""
        if self._thread is None and self._mine():
            self._thread = threading.Thread(target=self._run, name=f"fusion_pass-report-{self.pid}", daemon=True)
            self._thread.start()
            counters.add_listener(self.counters_changed)
            atexit.register(self._at_exit)
        return self

    def close(self) -> None:
        """Stop keeping the file current (the file stays); the writer thread ends."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            counters.remove_listener(self.counters_changed)
            atexit.unregister(self._at_exit)
            self._wake.set()
            self._thread.join(timeout=10)

    def counters_changed(self) -> None:
        """The counters listener: wakes the writer thread (called from an attention call, at the first change after
        the thread read the counters: only that)."""
        if not self._wake.is_set() and self._mine():
            self._wake.set()

    def write(self, report: dict | None = None, on: str = "graph") -> Path | None:
        """Replace the file with ``report`` (default: ``snapshot()``), marked ``"written_on": on`` (``"graph"``,
        ``"counters"`` or ``"exit"``) and ``"written_at"`` (Unix time). None in a process that does not own the
        file (forked from its owner) or after :meth:`close`."""
        if on not in self.writes:
            raise ValueError(f"ReportFile.write: on must be one of {sorted(self.writes)}, got {on!r}")
        if not self._mine():
            return None
        report = self.snapshot() if report is None else report
        text = json.dumps({**report, "written_on": on, "written_at": time.time()}, indent=2, default=str)
        with self._write_lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_name(f".{self.path.name}.{threading.get_ident()}.tmp")
            temporary.write_text(text)
            os.replace(temporary, self.path)
            self.writes[on] += 1
        return self.path

    def _run(self) -> None:
        while True:
            self._wake.wait()
            if not self._mine():
                return
            self._wake.clear()
            try:
                self.write(on="counters")
            except Exception as exc:  # a full disk must not stop serving; said once, retried on the next change
                if not self._failed:
                    self._failed = True
                    logger.warning("fusion_pass: could not write the report %s (%s: %s); retrying after the next "
                                   "counter change", self.path, type(exc).__name__, exc)
            time.sleep(self.min_interval_s)

    def _at_exit(self) -> None:
        try:
            self.write(on="exit")
        except Exception as exc:
            logger.warning("fusion_pass: could not write the report %s at exit (%s: %s)", self.path,
                           type(exc).__name__, exc)
