"""Every entry of the manifest (:mod:`.names`) against the wheel of every release checked: one test per release and
entry, named ``<release>-<entry>``. A failure names the release, the name and what is wrong, e.g.
``vllm 0.34.0: vllm.v1.attention.backends.flash_attn.FlashAttentionMetadataBuilder.build: not found``."""

from __future__ import annotations

import pytest

from . import names
from .fetch import releases_to_check


def pytest_generate_tests(metafunc):
    if {"version", "entry"} <= set(metafunc.fixturenames):
        cases = [(version, entry) for version in releases_to_check() for entry in names.for_release(version)]
        metafunc.parametrize(("version", "entry"), cases, ids=[f"{v}-{e.id}" for v, e in cases])


def test_name(wheels, version, entry):
    failures = entry.failures(wheels(version))
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)
