"""Argument groups that several verbs share (kept apart from main.py, which imports every verb module)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_source_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("source (default: download the pinned sdist into the cache)")
    g.add_argument("--sdist", type=Path, help="use this llama-cpp-python sdist (verified against the pin) instead of downloading")
    g.add_argument("--llama-src", type=Path, help="use your own llama.cpp checkout of the pinned commit")


def add_build_args(p: argparse.ArgumentParser, variant_default: str | None = "patched") -> None:
    from pyllama_moe.build.builder import BACKENDS
    from pyllama_moe.source.trees import VARIANTS

    p.add_argument("--variant", choices=VARIANTS, default=variant_default, required=variant_default is None)
    p.add_argument("--backend", choices=BACKENDS, default="cpu")
    p.add_argument("--archive", type=Path, help="build from a `source pack` archive (its manifest is checked)")
    add_source_args(p)
