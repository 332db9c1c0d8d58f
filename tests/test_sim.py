"""The SIM device (a simulated GPU, native/ggml/src/ggml-sim) on the CPU builds.

With SIM registered, poison on and copy latency injected, the patched build must still compute master's bytes
on CPU (repack off on both sides), and must stop doing so when the scheduler skips its waits: that pair is
what lets later scheduler tests on SIM claim anything. The op log must show the routed-only expert copies
landing on a SIM instance before the MUL_MAT_ID that reads them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from pyllama_moe.harness import models, runner
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR
from pyllama_moe.synth.gguf_read import read_gguf

SIM_ENV = {"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1", "GGML_SIM_COPY_LATENCY_US": "50"}
PLACEMENTS = {"cpu-moe": dict(cpu_moe=True), "ncmoe-2": dict(n_cpu_moe=2), "ngl-2": dict(n_gpu_layers=2)}


@pytest.fixture(scope="module")
def qwen3moe():
    model = models.ensure_model("qwen3moe", load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"])
    # 600 fixed token ids (> 512, so ub 512 splits the prompt into a full and a partial ubatch)
    return model, [(i * 7919) % 4000 + 16 for i in range(600)]


def _run(build, src, model, tokens, env=None, **placement):
    spec = runner.RunSpec(model=model, tokens=tokens, n_ubatch=512, repack=False, threads=2, generate=8,
                          env=env or {}, **placement)
    return runner.run(build, src, spec)


@pytest.fixture(scope="module")
def master_logits(master_build, src, qwen3moe):
    model, tokens = qwen3moe
    return _run(master_build, src, model, tokens, cpu_moe=True)


@pytest.mark.parametrize("devices", ["1", "2"])
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_sim_with_poison_and_latency_computes_master_bytes(patched_build, src, qwen3moe, master_logits, placement,
                                                           devices):
    model, tokens = qwen3moe
    got = _run(patched_build, src, model, tokens, env={**SIM_ENV, "GGML_SIM_DEVICES": devices}, **PLACEMENTS[placement])
    assert "SIM0" in got.log, "SIM was not registered: " + got.log[-2000:]
    assert got.logits.shape[0] == 600
    assert got.logits_sha256 == master_logits.logits_sha256
    assert got.generated == master_logits.generated


STAGING_BYTES = re.compile(r"SIM0 host-weight prefetch on: staging [\d.]+ MiB \((\d+) bytes")


def test_row_padding_pads_device_allocations_and_keeps_masters_bytes(patched_build, src, qwen3moe, master_logits):
    # the experts' staged copies (Q8_0, rows shorter than 512) grow by a padded row each, as on CUDA; the bytes do
    # not, uploaded ahead or copied at split time
    model, tokens = qwen3moe
    ahead = {**SIM_ENV, "GGML_SCHED_PREFETCH": "2"}
    plain = _run(patched_build, src, model, tokens, env=ahead, cpu_moe=True)
    padded = _run(patched_build, src, model, tokens, env={**ahead, "GGML_SIM_ROW_PADDING": "512"}, cpu_moe=True)
    at_split = _run(patched_build, src, model, tokens, env={**SIM_ENV, "GGML_SIM_ROW_PADDING": "512"}, cpu_moe=True)
    sizes = [int(STAGING_BYTES.search(r.log).group(1)) for r in (plain, padded)]
    assert sizes[1] > sizes[0], sizes
    for got in (padded, at_split):
        assert got.logits_sha256 == master_logits.logits_sha256 and got.generated == master_logits.generated


def test_skipping_the_scheduler_waits_is_caught(patched_build, src, qwen3moe, master_logits):
    model, tokens = qwen3moe
    got = _run(patched_build, src, model, tokens, env={**SIM_ENV, "GGML_SCHED_DEBUG_SKIP_WAIT": "1"}, cpu_moe=True)
    assert "ggml_sim: race" in got.log
    assert got.logits_sha256 != master_logits.logits_sha256 or got.generated != master_logits.generated


def test_op_log_shows_expert_copies_before_their_compute(patched_build, src, qwen3moe, tmp_path):
    model, tokens = qwen3moe
    log = tmp_path / "ops.jsonl"
    _run(patched_build, src, model, tokens, env={**SIM_ENV, "GGML_SIM_OPLOG": str(log)}, cpu_moe=True)
    ops = [json.loads(line) for line in log.read_text().splitlines()]
    sizes = {name: t.nbytes for name, t in read_gguf(model).tensors.items()}
    assert not [op for op in ops if op["op"] == "race"]
    stream = sorted((op for op in ops if op["inst"] >= 0), key=lambda op: op["seq"])
    checked = 0
    pending: dict[str, list[dict]] = {}
    for op in stream:
        if op["op"] == "set" and "_exps" in op["tensor"]:
            pending.setdefault(op["tensor"], []).append(op)
        elif op["op"] == "compute":
            if op["first_op"] == "MUL_MAT_ID" and "_exps" in op["first_src0"]:
                copies = pending.get(op["first_src0"], [])
                # this model routes every token to 4 of 16 experts, so every ubatch uses all of them and the
                # routed-only copy moves the whole expert tensor: exactly its size in the GGUF
                weight = op["first_src0"].split("#")[1]
                assert copies and sum(c["bytes"] for c in copies) == sizes[weight], op
                assert all(c["t1_ns"] <= op["t0_ns"] and c["inst"] == op["inst"] for c in copies)
                checked += 1
            pending.clear()
    # 600 tokens at ub 512: two ubatches, three expert matmuls in each of 4 layers, all offloaded (batch >= 32)
    assert checked == 2 * 3 * 4


def test_backend_ops_pass_on_sim_and_fail_when_sync_does_not_wait(patched_build):
    tool = patched_build.tool("test-backend-ops")
    # MOE_CACHE_LOOKUP, MOE_CACHE_FILL: the expert cache's device lookup ops (patches `ggml: GGML_OP_MOE_CACHE_*`),
    # compared exactly
    ops = "ADD,MUL,RMS_NORM,SOFT_MAX,GET_ROWS,ARGSORT,SWIGLU,CPY,MOE_CACHE_LOOKUP,MOE_CACHE_FILL"

    def run(extra):
        return subprocess.run([str(tool), "-b", "SIM0", "-o", ops], env={**os.environ, **SIM_ENV, **extra},
                              capture_output=True, text=True, timeout=1200)

    ok = run({})
    assert ok.returncode == 0, ok.stdout[-3000:]
    assert "Backend SIM0" in ok.stdout and "ggml_sim: race" not in ok.stdout + ok.stderr
    # an op SIM did not support would be skipped, not failed: the lookup's cases must have run (results are coloured)
    lines = re.sub(r"\x1b\[[0-9;]*m", "", ok.stdout).splitlines()
    lookups = [line for line in lines if line.strip().startswith("MOE_CACHE_LOOKUP(")]
    assert len(lookups) >= 20 and all(line.rstrip().endswith(": OK") for line in lookups), "\n".join(lookups[:5])
    fills = [line for line in lines if line.strip().startswith("MOE_CACHE_FILL(")]
    assert len(fills) >= 9 and all(line.rstrip().endswith(": OK") for line in fills), "\n".join(fills[:5])
    bad = run({"GGML_SIM_DEBUG_SKIP_SYNC": "1"})
    assert bad.returncode != 0 and "ggml_sim: race" in bad.stdout + bad.stderr


def test_sim_registers_nothing_without_its_variable(patched_build):
    tool = patched_build.tool("test-backend-ops")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGML_SIM_")}
    out = subprocess.run([str(tool), "-b", "SIM0", "-o", "ADD"], env=env, capture_output=True, text=True).stdout
    assert "SIM0" not in out and "1/1 backends passed" in out
