"""`pyllama-moe bench --paced`: the test spec taken from llama-bench arguments, and paced rounds end to end on
the CPU builds (both builds loaded at once, repetitions alternating). No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pyllama_moe.bench_paced import parse_spec, spec_fields
from pyllama_moe.errors import UserError


def test_spec_from_llama_bench_arguments():
    spec = parse_spec(Path("m.gguf"), ["-p", "0", "-n", "128", "-ngl", "99", "-ncmoe", "48", "-lm", "none",
                                       "-t", "15", "-C", "0xffff", "--cpu-strict", "1", "--ubatch-size", "256"])
    assert (spec.n_prompt, spec.n_gen, spec.n_cpu_moe, spec.load_mode, spec.n_threads) == (0, 128, 48, "none", 15)
    assert spec.cpu_mask == "0xffff" and spec.cpu_strict is True and spec.n_ubatch == 256
    assert spec_fields(spec)["n_cpu_moe"] == 48 and spec_fields(parse_spec(Path("m"), ["-n", "4"]))["load_mode"] == "auto"


@pytest.mark.parametrize("args, words", [
    (["-p", "512", "-n", "128"], "either a prompt or a generation test"),
    (["-n", "0"], "either a prompt or a generation test"),
    (["-n", "128", "-ub", "512,2048"], "exactly one value"),
    (["-n", "128", "-ctk", "q8_0"], "does not take the llama-bench argument -ctk"),
    (["-n", "128", "-t"], "exactly one value"),
    (["-n", "many"], "not a valid value"),
])
def test_spec_refuses_what_one_paced_test_cannot_be(args, words):
    with pytest.raises(UserError, match=words):
        parse_spec(Path("m.gguf"), args)


@pytest.mark.build
def test_paced_rounds_end_to_end(master_build, patched_build, tmp_path):
    out = tmp_path / "paced.json"
    proc = subprocess.run([sys.executable, "-m", "pyllama_moe", "bench", "--synth", "qwen3moe", "--paced", "--rounds",
                           "2", "--warmup-rounds", "1", "--reps", "3", "--discard", "1", "--json", str(out), "--",
                           "-p", "0", "-n", "4", "-t", "2"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| tg4 ub512 ngl99 ncmoe0 lm=auto t2 |" in proc.stdout and "stopped: 2 rounds" in proc.stdout
    data = json.loads(out.read_text())
    assert data["meta"]["paced"] is True
    (test,) = data["tests"]
    assert len(test["samples"]) == 3 * 2 * 3  # (warm-up + 2) rounds x builds x reps
    assert {s["round"] for s in test["samples"] if not s["discarded"]} == {1, 2}
    assert sum(not s["discarded"] for s in test["samples"]) == 2 * 2 * 2
    assert test["n_pairs"] == 2 and test["ci_low"] <= test["ratio"] <= test["ci_high"]
