"""Masked expert ids (-1: "no expert") in MUL_MAT_ID and ADD_ID, the hot/cold split's merge: on the CPU the row of a
masked id is exactly zero (or exactly the input row, for ADD_ID), every other row the bytes of the plain op, for float
and quantized experts; a device that does not report masked ids (ggml-dev-caps.h) is refused the masked ops, so no
backend indexes with -1; test-backend-ops compares SIM's masked ops with the CPU's."""
from __future__ import annotations

import os
import re
import subprocess

import pytest

from ggml_program import compile_program
from pyllama_moe.paths import PROJECT_ROOT

pytestmark = pytest.mark.build

PROGRAM = PROJECT_ROOT / "tests" / "native" / "test_masked_ids.cpp"


def _env(**extra: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GGML_SIM_", "GGML_SCHED_"))}
    return {**clean, **extra}


@pytest.fixture(scope="module")
def program(patched_build, tmp_path_factory):
    return compile_program(patched_build, PROGRAM, tmp_path_factory.mktemp("masked-ids"))


@pytest.mark.parametrize("device", ["cpu", "sim"])
@pytest.mark.parametrize("type_", ["f32", "q8_0", "q4_0"])
def test_a_masked_row_is_exactly_zero_and_the_others_are_the_plain_ops_bytes(program, type_, device):
    # on SIM too: it computes with the CPU's kernels, but guards the indices it is given (a -1 there must pass)
    proc = subprocess.run([str(program), type_, device], capture_output=True, text=True, timeout=120,
                          env=_env(GGML_SIM_DEVICES="1", GGML_SIM_POISON="1"))
    assert proc.returncode == 0 and proc.stdout.startswith(f"ok {type_}"), proc.stdout + proc.stderr[-3000:]
    assert "ggml_sim: race" not in proc.stderr
    assert "10 of 28 rows masked" in proc.stdout  # slot t % 4 of 7 tokens, and token 3's 4 slots
    assert "SIM0 takes the masked ops: yes, the plain ones: yes" in proc.stdout


def test_a_device_without_masked_ids_is_refused_the_masked_ops_only(program):
    proc = subprocess.run([str(program), "f32"], capture_output=True, text=True, timeout=120,
                          env=_env(GGML_SIM_DEVICES="1", GGML_SIM_NO_MASKED_IDS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "SIM0 takes the masked ops: no, the plain ones: yes" in proc.stdout


@pytest.mark.parametrize("op", ["MUL_MAT_ID_MASKED", "ADD_ID_MASKED"])
def test_sim_computes_the_masked_ops_as_the_cpu_does(patched_build, op):
    proc = subprocess.run([str(patched_build.bin_dir / "test-backend-ops"), "-b", "SIM0", "-o", op],
                          capture_output=True, text=True, timeout=600, env=_env(GGML_SIM_DEVICES="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    passed = re.search(r"(\d+)/(\d+) tests passed", proc.stdout)
    assert passed and passed.group(1) == passed.group(2) and int(passed.group(2)) > 0, proc.stdout[-3000:]
