"""The code a rewrite depends on, hashed once per process: part of the key under which Inductor's FX graph cache
(and vLLM's compile cache) keep a rewritten graph, so that an upgrade that changes how graphs are matched, proved or
rewritten is never served a rewrite the old code made.

:data:`COMPILE_TIME` names what every pass depends on: the compile-time package (the pass, the matcher, the layout
proofs), the pattern table and its vocabularies, the op library whose schemas the rewrite calls, and the NVFP4
layout. An integration adds its own parts (the vLLM adapter: its vocabulary, layer check, release table and run-time
op schemas). Files are read by path, not imported, and the package's version is part of the hash.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path

__all__ = ["COMPILE_TIME", "code_digest", "source_files"]

COMPILE_TIME = ("fusion_pass.compile", "fusion_pass.patterns", "fusion_pass.ops", "fusion_pass.nvfp4",
                "fusion_pass.formats", "fusion_pass.fp8")
"""Packages (every ``.py`` file below them) and modules whose code decides a rewrite, for every pass."""

DISTRIBUTION = "attn-nvfp4-fusion"


def source_files(names) -> list[tuple[str, Path]]:
    """``(dotted name, path)`` of every ``.py`` file of the packages and modules ``names`` (sorted, each once).
    Raises ``ModuleNotFoundError`` naming a name that is neither."""
    found: dict[str, Path] = {}
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None:
            raise ModuleNotFoundError(f"code_hash: no module or package {name!r}")
        if spec.submodule_search_locations:
            for folder in spec.submodule_search_locations:
                for path in sorted(Path(folder).rglob("*.py")):
                    relative = path.relative_to(folder).with_suffix("").parts
                    found[".".join((name, *relative))] = path
        elif spec.origin:
            found[name] = Path(spec.origin)
    return sorted(found.items())


def _version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "not installed"


def _read(path: Path) -> bytes:
    return path.read_bytes()


@functools.lru_cache(maxsize=None)
def code_digest(extra: tuple[str, ...] = ()) -> str:
    """SHA-256 of the package version and the source of :data:`COMPILE_TIME` plus ``extra`` (dotted names of
    packages or modules), each file under its dotted name. Computed once per process and set of names."""
    h = hashlib.sha256(f"{DISTRIBUTION}=={_version()}".encode())
    for name, path in source_files(COMPILE_TIME + tuple(extra)):
        h.update(b"\0" + name.encode() + b"\0")
        h.update(_read(path))
    return h.hexdigest()
