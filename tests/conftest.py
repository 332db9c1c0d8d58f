"""Shared fixtures. Builds are made (or reused by key) once per session; they dominate the first run."""

from __future__ import annotations

import pytest

from pyllama_moe import source
from pyllama_moe.build import resolve


@pytest.fixture(scope="session")
def src():
    return source.ensure_source()


@pytest.fixture(scope="session")
def master_build(src):
    return resolve("master", "cpu")


@pytest.fixture(scope="session")
def patched_build(src):
    return resolve("patched", "cpu")
