"""The command a benchmark ran as, for the provenance line of its results."""

from __future__ import annotations

import shlex
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def command_line(argv: list[str], default_script: str) -> str:
    """``python`` + the script path (relative to the repository when inside it) + the arguments of ``argv``
    (``sys.argv``-like; ``default_script`` when empty)."""
    script = Path(argv[0]) if argv else Path(default_script)
    if script.is_absolute():
        try:
            script = script.relative_to(REPO_ROOT)
        except ValueError:
            pass
    return shlex.join(["python", str(script), *argv[1:]])
