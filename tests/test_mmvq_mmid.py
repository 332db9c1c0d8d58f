"""CUDA's rule for when mul_mat_id takes MMVQ (whose bytes do not depend on the weight's expert count) moved out of
mmvq.cu into ggml-cuda/mmvq-mmid.h, a header a CPU compiler reads, so that the expert cache can ask for its device's
limit. The moved rule must give upstream's limit for every type and architecture: upstream's own text of the rule is
cut out of the pinned mmvq.cu, renamed and compiled beside the patched header (tests/native/test_mmvq_mmid.cpp), and
the compute-capability macros it reads must be upstream's, moved unchanged into cc.h."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from pyllama_moe.paths import PROJECT_ROOT
from pyllama_moe.source import trees

PROGRAM = PROJECT_ROOT / "tests" / "native" / "test_mmvq_mmid.cpp"
START = "// Per-architecture maximum batch size for which MMVQ should be used for MUL_MAT_ID."
END = "bool ggml_cuda_should_use_mmvq("


def _upstream_rule(master) -> str:
    text = (master / "ggml" / "src" / "ggml-cuda" / "mmvq.cu").read_text()
    assert text.count(START) == 1 and text.count(END) == 1, "the pinned mmvq.cu no longer has the rule where expected"
    block = text[text.index(START):text.index(END)]
    block = block.replace("__host__ __device__ ", "")
    return re.sub(r"\bget_mmvq_mmid_max_batch", "upstream_get_mmvq_mmid_max_batch", block)


def _cc_defines(text: str) -> list[str]:
    return [" ".join(line.split()) for line in text.splitlines() if line.startswith("#define GGML_CUDA_CC_")]


@pytest.fixture(scope="module")
def rule(src, tmp_path_factory):
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    master = trees.prepare(src, "master").path
    patched = trees.prepare(src, "patched").path
    work = tmp_path_factory.mktemp("mmvq-mmid")
    (work / "upstream_mmid.inc").write_text(_upstream_rule(master))
    exe = work / "test_mmvq_mmid"
    subprocess.run([cxx, "-std=c++17", "-Wall", "-I", str(work), "-I", str(patched / "ggml" / "include"),
                    "-I", str(patched / "ggml" / "src" / "ggml-cuda"), str(PROGRAM), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return master, patched, out


def test_the_capability_macros_moved_unchanged(rule):
    master, patched, _ = rule
    before = _cc_defines((master / "ggml" / "src" / "ggml-cuda" / "common.cuh").read_text())
    after = _cc_defines((patched / "ggml" / "src" / "ggml-cuda" / "cc.h").read_text())
    assert len(before) > 30 and after == before
    assert _cc_defines((patched / "ggml" / "src" / "ggml-cuda" / "common.cuh").read_text()) == []


def test_the_moved_rule_gives_upstreams_limit_for_every_type_and_architecture(rule):
    _, patched, out = rule
    rows = [tuple(map(int, line.split())) for line in out.splitlines() if not line.startswith("named")]
    assert len(rows) >= 34 * 40  # every capability listed in the program, every type
    differ = [r for r in rows if r[2] != r[3]]
    assert differ == [], f"(cc, type, patched, upstream): {differ[:10]}"
    assert all(1 <= r[2] <= 8 for r in rows)
    # the rule is one definition: the tables are gone from mmvq.cu
    assert "get_mmvq_mmid_max_batch_turing_plus(ggml_type" not in (patched / "ggml" / "src" / "ggml-cuda" / "mmvq.cu").read_text()


def test_the_limits_the_cache_relies_on(rule):
    # the H200 (Hopper) keeps MMVQ up to 8 tokens for every type; Turing and Ampere drop Q3_K to 5 and IQ3_S to 6;
    # Pascal drops Q4_0 to 6 and Q8_0 to 4
    named = {tuple(line.split()[1:3]): int(line.split()[3]) for line in rule[2].splitlines() if line.startswith("named")}
    assert named == {("q4_0", "900"): 8, ("q3_K", "750"): 5, ("iq3_s", "800"): 6, ("q4_0", "600"): 6, ("q8_0", "610"): 4}
