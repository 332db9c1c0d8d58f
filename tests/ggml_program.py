"""Compiling the small ggml programs of tests/native against a CPU build of the tree (the patched one, or one with
other options, such as ThreadSanitizer's)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest


def source_dir(build) -> Path:
    """The llama.cpp tree a build was configured from."""
    cache = (build.path / "CMakeCache.txt").read_text()
    return Path(re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.*)$", cache, re.M).group(1))


def compile_program(build, source: Path, out_dir: Path, *flags: str) -> Path:
    """`source` compiled and linked against the build's ggml libraries (found at run time through an rpath); skips the
    test where there is no C++ compiler."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = out_dir / source.stem
    lib = build.bin_dir
    subprocess.run([cxx, "-std=c++17", "-O1", *flags, str(source), "-I", str(source_dir(build) / "ggml" / "include"),
                    "-L", str(lib), "-lggml", "-lggml-base", "-lggml-cpu", f"-Wl,-rpath,{lib}", "-o", str(exe)],
                   check=True)
    return exe
