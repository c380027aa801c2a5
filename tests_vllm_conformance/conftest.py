"""Session set-up of the conformance suite: the releases to check (``FUSION_PASS_VLLM_RELEASES``) and their wheels,
fetched once per session (:mod:`.fetch`). A wheel that can be neither found nor downloaded fails every test of its
release with the reason; it is never skipped."""

from __future__ import annotations

import zipfile

import pytest

from .fetch import WheelUnavailable, wheel_path
from .wheel import Wheel


class Wheels:
    """The wheel of each release, opened on first use. Only the last one opened is kept (the tests run release by
    release; an indexed wheel holds its sources, about 50 MB), and a release whose wheel is unavailable keeps its
    reason, so it is fetched once."""

    def __init__(self):
        self._current: Wheel | None = None
        self._failed: dict[str, str] = {}

    def __call__(self, version: str) -> Wheel:
        if version in self._failed:
            pytest.fail(f"vllm {version}: no wheel to check (the first failure of this release says why)",
                        pytrace=False)
        if self._current is None or self._current.version != version:
            why = None
            try:
                self._current = Wheel(wheel_path(version))
            except WheelUnavailable as exc:
                why = str(exc)
            except (zipfile.BadZipFile, OSError) as exc:
                why = f"vllm {version}: the cached wheel cannot be read ({type(exc).__name__}: {exc}); delete it"
            if why is not None:
                self._failed[version] = why
                pytest.fail(why, pytrace=False)
        return self._current


@pytest.fixture(scope="session")
def wheels() -> Wheels:
    """``wheels(version)``: the :class:`~.wheel.Wheel` of a release."""
    return Wheels()
