"""`pyllama-moe bench --paced`: the test spec taken from llama-bench arguments, and paced rounds end to end on
the CPU builds (both builds loaded at once, repetitions alternating). No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pyllama_moe.bench import paced_process as paced, paced_rounds as bench_paced
from pyllama_moe.bench.paced_rounds import parse_spec, spec_fields
from pyllama_moe.bench.rounds import BenchPlan
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
                           "2", "--warmup-rounds", "1", "--reps", "3", "--discard", "1", "--paced-chunk", "3", "--json", str(out), "--",
                           "-p", "0", "-n", "4", "-t", "2"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| tg4 ub512 ngl99 ncmoe0 lm=auto t2 |" in proc.stdout and "stopped: 2 rounds" in proc.stdout
    data = json.loads(out.read_text())
    assert data["meta"]["paced"] is True and data["meta"]["paced_chunk"] == 3  # chunks of 3 and 1 tokens
    assert all("steal" in r for r in data["meta"]["rounds_log"])
    (test,) = data["tests"]
    assert len(test["samples"]) == 3 * 2 * 3  # (warm-up + 2) rounds x builds x reps
    assert {s["round"] for s in test["samples"] if not s["discarded"]} == {1, 2}
    assert sum(not s["discarded"] for s in test["samples"]) == 2 * 2 * 2
    assert test["n_pairs"] == 2 and test["ci_low"] <= test["ratio"] <= test["ci_high"]


class _ScriptedProcess:
    """Stands in for a driver process: records every command of both sides in one list, in the order sent."""

    def __init__(self, log: list, exe, spec, env=None):
        self.log, self.name, self.spec = log, str(exe), spec
        self.log_path = Path("/dev/null")

    def start(self):
        return self

    def wait_ready(self, timeout):
        pass

    def run(self, cmd, timeout):
        self.log.append((self.name, cmd))
        n = int(cmd.split()[1]) if cmd.startswith("tg-more") else self.spec.n_gen if cmd == "tg" else 0
        return {"kind": cmd.split()[0], "n_tokens": n, "ns": 10**9 * n // 10 if self.name == "B" else 10**9 * n // 20}

    def close(self):
        pass


def _scripted_round(monkeypatch, chunk, n_gen=10, reps=2):
    log = []
    builds = {"baseline": SimpleNamespace(variant="master"), "candidate": SimpleNamespace(variant="patched")}
    monkeypatch.setattr(paced, "ensure_tool", lambda build: {"master": "A", "patched": "B"}[build.variant])
    monkeypatch.setattr(paced, "PacedProcess", lambda exe, spec, env=None: _ScriptedProcess(log, exe, spec, env))
    plan = BenchPlan(model=Path("m.gguf"), bench_args=["-p", "0", "-n", str(n_gen)], reps=reps)
    run = bench_paced.paced_rounds(builds, plan, chunk)
    return run(("baseline", "candidate")), log


def test_chunks_of_a_generation_alternate_strictly_and_add_up_to_one_sample(monkeypatch):
    measured, log = _scripted_round(monkeypatch, chunk=4)
    timed = [(name, cmd) for name, cmd in log if cmd.startswith("tg-more")]
    # chunks of 4, 4, 2 tokens per repetition, A B A B ...: every chunk runs right after the other build's,
    # also across repetitions (the tg-starts between them do no work)
    assert timed == [("A", "tg-more 4"), ("B", "tg-more 4"), ("A", "tg-more 4"), ("B", "tg-more 4"),
                     ("A", "tg-more 2"), ("B", "tg-more 2")] * 2
    work = [name for name, cmd in log if cmd.startswith("tg-more") or cmd.startswith("tg ")]
    assert all(a != b for a, b in zip(work, work[1:]))
    assert [cmd for name, cmd in log if name == "A"].count("tg-start") == 2  # one generation per repetition
    ((entry,), _), ((other,), _) = measured["baseline"], measured["candidate"]
    # 10 tokens at 20 t/s (A) and 10 t/s (B): the sample is the whole generation's rate, not a chunk's
    assert entry["samples_ts"] == pytest.approx([20.0, 20.0]) and other["samples_ts"] == pytest.approx([10.0, 10.0])


def test_chunk_zero_alternates_whole_repetitions(monkeypatch):
    _, log = _scripted_round(monkeypatch, chunk=0, reps=3)
    assert [name for name, cmd in log if cmd == "tg"] == ["A", "B", "B", "A", "A", "B"]


def test_a_negative_chunk_is_refused(monkeypatch):
    with pytest.raises(UserError, match="--paced-chunk -1"):
        _scripted_round(monkeypatch, chunk=-1)
