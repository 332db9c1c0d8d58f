"""Shared fixtures. Builds are made (or reused by key) once per session; they dominate the first run."""

from __future__ import annotations

import pytest

from pyllama_moe.build.builder import resolve
from pyllama_moe.harness import models
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR
from pyllama_moe.source import sdist as source


@pytest.fixture(scope="session")
def src():
    return source.ensure_source()


@pytest.fixture(scope="session")
def master_build(src):
    return resolve("master", "cpu")


@pytest.fixture(scope="session")
def patched_build(src):
    return resolve("patched", "cpu")


@pytest.fixture(scope="session")
def server_build(src):
    """The patched CPU build with llama-server (not among the default targets: compiled into the same build dir)."""
    return resolve("patched", "cpu", targets=("llama-server",))


@pytest.fixture(scope="session")
def tiny_model():
    """The matrix's tiny qwen3moe model (Q8_0, 4 layers of 16 experts, top-4)."""
    return models.ensure_model("qwen3moe", load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"])
