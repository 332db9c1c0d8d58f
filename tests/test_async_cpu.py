"""Asynchronous CPU splits of the patched scheduler (GGML_SCHED_ASYNC_CPU, --sched-async-cpu), on the SIM device.

A small ggml program (tests/native/test_async_cpu.cpp, built against the patched CPU build) plants each hazard: a CPU
split reading what a slow SIM copy brings down, a SIM split reading what a slow worker computes, a failure and an
abort on the worker, graphs freed and reserved between computes. Each must give the right values; a debug knob that
drops the wait it tests must make the same case fail, so the test can fail. The overlap itself: a CPU split and an
independent SIM split of known durations take about the longer of the two with the worker, their sum without it.
Through llama.cpp: the knob reaches the scheduler from the flag, the environment and llama-moe.h, the bytes are the
same on and off (the identity cells `async-cpu*` of ci/matrix.toml, in `ci`), and llama-bench has the column.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from ggml_program import compile_program
from llama_tools import completion
from pyllama_moe.paths import PROJECT_ROOT

pytestmark = pytest.mark.build

PROGRAM = PROJECT_ROOT / "tests" / "native" / "test_async_cpu.cpp"
SIM = {"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1"}


@pytest.fixture(scope="module")
def program(patched_build, tmp_path_factory):
    return compile_program(patched_build, PROGRAM, tmp_path_factory.mktemp("async-cpu"))


def _run(exe: Path, case: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GGML_SIM_", "GGML_SCHED_"))}
    return subprocess.run([str(exe), case], capture_output=True, text=True, timeout=300, env={**clean, **SIM, **env})


# slow SIM copies: a download the worker does not wait for is read before it lands
SLOW_COPIES = {"GGML_SIM_COPY_LATENCY_US": "30000", "CPU_MS": "0"}
# a slow worker: a SIM split that does not wait for it uploads the CPU's result before it is written
SLOW_WORKER = {"GGML_SCHED_ASYNC_CPU_DEBUG_DELAY_US": "100000", "CPU_MS": "0"}


@pytest.mark.parametrize("case,env", [
    ("download", SLOW_COPIES),
    ("reader", SLOW_WORKER),
    ("join", {"CPU_MS": "20", "GGML_SIM_COMPUTE_LATENCY_US": "20000", "GGML_SCHED_ASYNC_CPU_DEBUG_DELAY_US": "30000"}),
    ("fail", {"GGML_SCHED_ASYNC_CPU_DEBUG_FAIL": "2"}),
    ("abort", {}),
    ("reuse", {"CPU_MS": "5", "GGML_SIM_COPY_LATENCY_US": "2000"}),
    # a device that reads the CPU's result in place (no input copy to wait on) runs nothing beside the worker
    ("integrated", {**SLOW_WORKER, "GGML_SIM_INTEGRATED": "1"}),
])
def test_case_is_right(program, case, env):
    proc = _run(program, case, **env)
    assert proc.returncode == 0 and proc.stdout.startswith(f"ok {case}"), proc.stdout + proc.stderr[-3000:]
    if env.get("GGML_SCHED_ASYNC_CPU_DEBUG_DELAY_US") or env.get("GGML_SCHED_ASYNC_CPU_DEBUG_FAIL"):
        assert "a test plant" in proc.stderr  # the plant says itself once per scheduler


@pytest.mark.parametrize("case,env", [
    ("download", {**SLOW_COPIES, "GGML_SCHED_ASYNC_CPU_DEBUG_UNSAFE": "1"}),  # the worker waits for no download
    ("reader", {**SLOW_WORKER, "GGML_SCHED_ASYNC_CPU_DEBUG_UNSAFE": "2"}),    # no join before a reader
])
def test_control_without_the_wait_fails(program, case, env):
    proc = _run(program, case, **env)
    assert proc.returncode == 1 and proc.stdout.startswith(f"FAIL {case}") and "worker on" in proc.stdout, \
        proc.stdout + proc.stderr[-3000:]


# The overlap: a CPU split of CPU_MS beside a SIM split of the same compute latency. Without the worker the two run one
# after the other; with it, side by side. On this 2-core machine scheduling adds a few milliseconds, so the bound is
# the longer duration plus a quarter of the shorter one (a sum would be 100 ms over it). (SIM's latency is per compute
# call, so the `join` case, whose cut adds a SIM split, is checked for its values and splits, not timed.)
OVERLAP_MS = 100


def test_the_cpu_and_device_splits_overlap(program):
    proc = _run(program, "overlap", CPU_MS=str(OVERLAP_MS), GGML_SIM_COMPUTE_LATENCY_US=str(OVERLAP_MS * 1000))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    off, on = map(float, re.search(r"off ([\d.]+) ms, on ([\d.]+) ms", proc.stdout).groups())
    assert off >= 2 * OVERLAP_MS, proc.stdout  # sequential without the worker
    assert on <= OVERLAP_MS * 1.25, proc.stdout  # about the longer of the two with it
    print(f"overlap: off {off:.1f} ms, on {on:.1f} ms; each side {OVERLAP_MS} ms")


def test_the_round_trip_tool_times_each_leg_on_sim(patched_build):
    """llama-moe-roundtrip (the GPU machine's round-trip budget) on SIM with a small shape: every leg timed for each
    token count, idle and busy, and the throughputs there. SIM's numbers mean nothing; the tool's shape does."""
    exe = patched_build.bin_dir / "llama-moe-roundtrip"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GGML_SIM_", "GGML_SCHED_"))}
    proc = subprocess.run([str(exe), "--shape", "256,128,16,4", "--tokens", "1,4", "--reps", "5", "-t", "2"],
                          capture_output=True, text=True, timeout=300, env={**clean, "GGML_SIM_DEVICES": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    trips = [r for r in records if r["what"] == "roundtrip"]
    assert [(r["tokens"], r["gpu_busy"]) for r in trips] == [(1, False), (4, False), (1, True), (4, True)]
    for r in trips:
        assert all(r[k] >= 0 for k in ("d2h_us", "cpu_us", "h2d_us", "join_us")) and r["cpu_us"] > 0
        assert r["total_us"] == pytest.approx(r["d2h_us"] + r["cpu_us"] + r["h2d_us"] + r["join_us"], abs=0.2)
        # 4 distinct experts a token of 16: 1 token reads 4 experts, 4 tokens at least 4
        assert r["expert_bytes"] >= 4 * 3 * 128 * 256 * 18 / 32
    link = [r for r in records if r["what"] == "link"]
    assert len(link) == 1 and link[0]["split_us_idle"] > 0
    assert "| tokens | GPU | d2h us |" in proc.stderr


@pytest.mark.parametrize("args,named", [
    (["--tokens", "0"], "--tokens"), (["--threads", "x"], "--threads"), (["--shape", "100,128,16,4"], "--shape"),
    (["--type", "q5_k"], "--type"), (["--bogus"], "--bogus"),
])
def test_the_round_trip_tool_refuses_bad_arguments_in_one_line(patched_build, args, named):
    proc = subprocess.run([str(patched_build.bin_dir / "llama-moe-roundtrip"), *args], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: {named}"), proc.stderr


# ThreadSanitizer: the scheduler, SIM and the CPU backend built with -fsanitize=thread (ggml's own option, OpenMP off
# so that every thread is one TSan sees), and the cases above run again with the worker on
TSAN_OPTIONS = ("-DGGML_SANITIZE_THREAD=ON", "-DGGML_OPENMP=OFF")


@pytest.fixture(scope="module")
def tsan_program(src, tmp_path_factory):
    from pyllama_moe.build.builder import resolve

    build = resolve("patched", "cpu", extra_options=TSAN_OPTIONS, targets=("ggml", "ggml-cpu"))
    return compile_program(build, PROGRAM, tmp_path_factory.mktemp("async-cpu-tsan"), "-g", "-fsanitize=thread")


@pytest.mark.parametrize("case,env", [
    ("overlap", {"CPU_MS": "20", "GGML_SIM_COMPUTE_LATENCY_US": "20000"}),
    ("join", {"CPU_MS": "5", "GGML_SCHED_ASYNC_CPU_DEBUG_DELAY_US": "5000"}),
    ("download", {**SLOW_COPIES, "GGML_SIM_COPY_LATENCY_US": "5000"}),
    ("reader", {**SLOW_WORKER, "GGML_SCHED_ASYNC_CPU_DEBUG_DELAY_US": "5000"}),
    ("fail", {"GGML_SCHED_ASYNC_CPU_DEBUG_FAIL": "2"}),
    ("abort", {}),
    ("reuse", {"CPU_MS": "1"}),
])
def test_the_worker_is_clean_under_thread_sanitizer(tsan_program, case, env):
    proc = _run(tsan_program, case, TSAN_OPTIONS="halt_on_error=1 exitcode=66", **env)
    assert "ThreadSanitizer" not in proc.stderr, proc.stderr[-6000:]
    assert proc.returncode == 0 and proc.stdout.startswith(f"ok {case}"), proc.stdout + proc.stderr[-3000:]


def test_thread_sanitizer_sees_the_race_a_missing_wait_makes(tsan_program):
    # the control: the worker does not wait for SIM's download of its input, so SIM's stream writes what the worker
    # reads at the same time; TSan must say so (it has the power to see the races the test above finds none of). (A
    # late worker without the join before a reader is no control here: TSan takes the plant's sleep for a
    # synchronization.)
    proc = _run(tsan_program, "download", TSAN_OPTIONS="halt_on_error=1 exitcode=66",
                **{**SLOW_COPIES, "GGML_SIM_COPY_LATENCY_US": "5000", "GGML_SCHED_ASYNC_CPU_DEBUG_UNSAFE": "1"})
    assert proc.returncode == 66, proc.stdout + proc.stderr[-3000:]
    assert "WARNING: ThreadSanitizer: data race" in proc.stderr, proc.stderr[-3000:]
    assert "ggml_sched_cpu_worker" in proc.stderr  # one side of the race is the worker


PROMPT = " ".join(f"w{(k * 37) % 97}" for k in range(40))


def _complete(build, model, *args: str, **env: str) -> subprocess.CompletedProcess:
    return completion(build, model, PROMPT, "-ncmoe", "2", "-n", "12", *args, env={"GGML_SIM_DEVICES": "1", **env})


def test_the_flag_and_its_environment_variable_turn_the_worker_on_with_the_same_text(patched_build, tiny_model):
    off = _complete(patched_build, tiny_model)
    flag = _complete(patched_build, tiny_model, "--sched-async-cpu", "1")
    env = _complete(patched_build, tiny_model, LLAMA_ARG_SCHED_ASYNC_CPU="1")
    for proc in (off, flag, env):
        assert proc.returncode == 0, proc.stderr[-3000:]
    # said once per reservation where the worker is used, never without it
    assert "asynchronous CPU splits on" not in off.stderr
    assert "asynchronous CPU splits on" in flag.stderr and "asynchronous CPU splits on" in env.stderr
    assert flag.stdout == off.stdout == env.stdout and len(off.stdout) > len(PROMPT)
    bad = _complete(patched_build, tiny_model, "--sched-async-cpu", "2")
    assert bad.returncode != 0 and "expected 0 (off) or 1 (on)" in bad.stderr
