"""Which vLLM releases to check, and their CUDA wheels: found in a cache outside the repository, else downloaded
there with ``pip download`` (the wheel only, never installed).

* ``FUSION_PASS_VLLM_RELEASES``: comma-separated releases (``0.34.0``); default :data:`DEFAULT_RELEASES`;
* ``FUSION_PASS_WHEEL_CACHE``: the cache folder; default :data:`DEFAULT_CACHE`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

RELEASES_ENV = "FUSION_PASS_VLLM_RELEASES"
CACHE_ENV = "FUSION_PASS_WHEEL_CACHE"
DEFAULT_RELEASES = ("0.32.0", "0.33.0", "0.34.0")
"""One release per line of ``fusion_pass/vllm/releases.py`` (``test_project.py`` checks they agree)."""
DEFAULT_CACHE = Path.home() / ".cache" / "attn-nvfp4-fusion" / "vllm-wheels"
PLATFORM = "manylinux_2_28_x86_64"
PYTHON = "3.12"


class WheelUnavailable(RuntimeError):
    """A release's wheel is neither cached nor downloadable."""


def releases_to_check() -> tuple[str, ...]:
    """The releases named by ``FUSION_PASS_VLLM_RELEASES``, else :data:`DEFAULT_RELEASES`. Raises ``ValueError`` for a
    name that is not a release number."""
    raw = os.environ.get(RELEASES_ENV, "").strip()
    if not raw:
        return DEFAULT_RELEASES
    versions = tuple(v.strip() for v in raw.split(",") if v.strip())
    bad = [v for v in versions if not re.fullmatch(r"\d+\.\d+\.\d+(\.post\d+)?", v)]
    if bad:
        raise ValueError(f"{RELEASES_ENV}={raw!r}: not vLLM release numbers: {', '.join(bad)} (e.g. 0.34.0)")
    return versions


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def cached(version: str, cache: Path) -> Path | None:
    """The cached CUDA wheel of ``version`` (``vllm-<version>-<tags>-<platform>.whl``), or None."""
    found = sorted(cache.glob(f"vllm-{version}-*-manylinux*_x86_64.whl")) if cache.is_dir() else []
    return found[0] if found else None


def download(version: str, cache: Path) -> Path:
    """``pip download`` the CUDA wheel of ``version`` into ``cache``; raises :class:`WheelUnavailable` saying why."""
    cache.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON,
               "--platform", PLATFORM, "-d", str(cache), f"vllm=={version}"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WheelUnavailable(f"vllm {version}: the wheel is not in {cache} and `{' '.join(command)}` could not "
                               f"run ({type(exc).__name__}: {exc})") from exc
    path = cached(version, cache)
    if done.returncode != 0 or path is None:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        raise WheelUnavailable(f"vllm {version}: the wheel is not in {cache} and its download failed "
                               f"(exit {done.returncode}): `{' '.join(command)}`\n{tail}")
    return path


def wheel_path(version: str) -> Path:
    """The CUDA wheel of ``version``: cached, else downloaded (:func:`download`)."""
    cache = cache_dir()
    return cached(version, cache) or download(version, cache)
