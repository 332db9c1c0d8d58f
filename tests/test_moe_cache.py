"""The MoE expert cache's host-side bookkeeping, on its own.

native/src/llama-moe-cache.{h,cpp} has no llama.cpp or ggml dependency, so its test program
(tests/native/test_moe_cache.cpp) is compiled here with just a C++ compiler, no build: bank sizing, the decode
planner's CLOCK (never the same ubatch's slots, overflow, remapped ids in range and right under a randomised
skewed routing, checked against a simulated bank; the same lookup on a flat state, as the device will keep it,
handed over and back), the prompt planner's resident set (each expert uploaded once
when they fit; a plain LRU that the case shows thrashing), stats arithmetic and the planted stale slot. The same
program prints the table of results/expert-cache-planner.md, which must match it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pyllama_moe.paths import PROJECT_ROOT

SOURCES = [PROJECT_ROOT / "native" / "src" / "llama-moe-cache.cpp", PROJECT_ROOT / "tests" / "native" / "test_moe_cache.cpp"]
RESULTS = PROJECT_ROOT / "results" / "expert-cache-planner.md"


def _compile(out: Path, *flags: str) -> Path:
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    # native/src and the one ggml header of ours it shares with the device lookup: it must not need llama.cpp's or
    # ggml's own headers
    subprocess.run([cxx, "-std=c++17", "-Wall", "-Wextra", *flags, "-I", str(PROJECT_ROOT / "native" / "src"),
                    "-I", str(PROJECT_ROOT / "native" / "ggml" / "include"), *map(str, SOURCES), "-o", str(out)], check=True)
    return out


@pytest.fixture(scope="module")
def exe(tmp_path_factory):
    return _compile(tmp_path_factory.mktemp("moe-cache") / "test_moe_cache", "-O2")


def _cases() -> list[str]:
    text = SOURCES[1].read_text()
    return re.findall(r'^\s*\{ "([a-z0-9-]+)",\s+\w+ \},$', text, re.M)


CASES = _cases()


def test_case_list_is_read():
    # the parametrisation below reads main()'s table: a pattern that stopped matching would test nothing
    assert len(CASES) >= 14 and "prompt-no-thrash" in CASES and "skip-fill" in CASES


@pytest.mark.parametrize("case", CASES)
def test_case(exe, case):
    got = subprocess.run([str(exe), case], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and got.stdout.strip() == f"ok {case}", got.stdout + got.stderr


def test_program_lists_the_same_cases(exe):
    got = subprocess.run([str(exe), "list"], capture_output=True, text=True, check=True)
    assert got.stdout.split() == CASES


def test_sanitizers(tmp_path):
    # the property cases index slot maps with routed ids: out-of-range reads would only show under ASan/UBSan
    try:
        san = _compile(tmp_path / "test_moe_cache_san", "-O1", "-g", "-fsanitize=address,undefined",
                       "-fno-sanitize-recover=all")
    except subprocess.CalledProcessError:
        pytest.skip("the compiler cannot build with -fsanitize=address,undefined")
    got = subprocess.run([str(san), "all"], capture_output=True, text=True, timeout=600)
    assert got.returncode == 0 and "FAIL" not in got.stdout and "runtime error" not in got.stderr, got.stdout + got.stderr


def test_results_table_is_what_the_program_prints(exe):
    got = subprocess.run([str(exe), "sim"], capture_output=True, text=True, check=True)
    table = [line for line in got.stdout.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 12
    text = RESULTS.read_text()
    for line in table:
        assert line in text, f"{RESULTS.name} is stale: rerun the command it gives ({line})"
