"""The expert cache in llama.cpp, on SIM: decode reads the banks and computes what the host weights
compute, the counters through cffi agree with the log, and the cases where no cache is made say why."""
from __future__ import annotations

import re

import pytest

from pyllama_moe.harness import models, runner
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR

SIM_ENV = {"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1", "GGML_SIM_COPY_LATENCY_US": "50"}
TOKENS = [(i * 7919) % 4000 + 16 for i in range(40)]
N_GEN = 24
SUMMARY = re.compile(r"expert cache, decode: (\d+) layer steps, (\d+) hits, (\d+) misses .*?, (\d+) on the staging path")


@pytest.fixture(scope="module")
def model():
    return models.ensure_model("qwen3moe", load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"])


def _run(build, src, model, env, cpu_moe=True, stats=True, moe_cache_mib=None):
    spec = runner.RunSpec(model=model, tokens=TOKENS, cpu_moe=cpu_moe, load_mode="none", repack=False, threads=2,
                          generate=N_GEN, stats=stats, env={**SIM_ENV, **env}, moe_cache_mib=moe_cache_mib)
    return runner.run(build, src, spec)


@pytest.fixture(scope="module")
def reference(patched_build, src, model):
    return _run(patched_build, src, model, {"LLAMA_MOE_CACHE_MIB": "0"})


def test_decode_reads_the_banks_and_computes_the_same(patched_build, src, model, reference):
    # the host-side plan (decode on the device: test_moe_cache_device.py)
    got = _run(patched_build, src, model, {"LLAMA_MOE_CACHE_MIB": "2", "LLAMA_MOE_CACHE_DEVICE": "0"})
    assert "expert cache on SIM0: 2.00 MiB, 4 MoE layers" in got.log
    assert got.generated == reference.generated and got.decode_logits_sha256 == reference.decode_logits_sha256
    assert got.logits_sha256 == reference.logits_sha256
    decode = got.stats["generate"]["cache_decode"]
    assert got.stats["generate"]["cache_layers"] == 4 and got.stats["generate"]["cache_bytes"] > 0
    # every generated token after the first is one decode step per layer; the prompt's last layer (one output row)
    # reads the banks too, its other layers (40 tokens) take the staging path
    steps, hits, misses, staging = map(int, SUMMARY.search(got.log).groups())
    assert (decode["n_ubatches"], decode["n_hits"], decode["n_misses"], decode["n_overflow"]) == (steps, hits, misses, staging)
    assert staging == 0 or decode["n_overflow"] == staging
    # 4 routed experts per banked step of one token, and the distinct experts of each staging step on top
    assert decode["n_hits"] + decode["n_misses"] >= 4 * (decode["n_ubatches"] - decode["n_overflow"])
    assert decode["n_misses"] > 0 and decode["n_evictions"] > 0 and decode["n_ubatches"] >= 4 * (N_GEN - 1)
    assert decode["bytes_uploaded"] > 0 and decode["n_copy_calls"] > 0
    assert reference.stats["generate"]["cache_layers"] == 0


def test_a_stale_slot_changes_the_decode(patched_build, src, model, reference):
    got = _run(patched_build, src, model, {"LLAMA_MOE_CACHE_MIB": "2", "LLAMA_MOE_CACHE_DEBUG_SKIP_FILL": "30"})
    assert "LLAMA_MOE_CACHE_DEBUG_SKIP_FILL=30" in got.log
    assert got.logits_sha256 == reference.logits_sha256  # the prompt's 40 rows take the host path
    assert got.decode_logits_sha256 != reference.decode_logits_sha256


@pytest.mark.parametrize("env, cpu_moe, said", [
    ({"LLAMA_MOE_CACHE_MIB": "2"}, False, "expert cache of 2 MiB not made: no MoE layer has its experts on the host"),
    ({"LLAMA_MOE_CACHE_MIB": "1"}, True, "no expert cache on SIM0: a budget of 1.00 MiB is below 4 slots in each of the 4 MoE layers"),
    ({"LLAMA_MOE_CACHE_MIB": "4096", "GGML_SIM_MEMORY_MIB": "520"}, True, "expert cache on SIM0 shrunk from 4096 MiB to"),
])
def test_what_is_not_made_is_said(patched_build, src, model, reference, env, cpu_moe, said):
    got = _run(patched_build, src, model, env, cpu_moe=cpu_moe)
    assert said in got.log
    assert got.generated == reference.generated


def test_the_per_context_budget_beats_the_environment(patched_build, src, model, reference):
    # the environment makes a 1 MiB cache too small for any layer; the context's own 3 MiB replaces it
    got = _run(patched_build, src, model, {"LLAMA_MOE_CACHE_MIB": "1"}, moe_cache_mib=3)
    assert "no expert cache on SIM0: a budget of 1.00 MiB is below" in got.log
    assert "expert cache on SIM0: 2.9" in got.log
    assert got.stats["generate"]["cache_layers"] == 4 and got.stats["generate"]["cache_decode"]["n_ubatches"] > 0
    assert got.generated == reference.generated and got.decode_logits_sha256 == reference.decode_logits_sha256
    # and 0 removes a cache the environment made: the decode takes the host path
    off = _run(patched_build, src, model, {"LLAMA_MOE_CACHE_MIB": "2"}, moe_cache_mib=0)
    assert "expert cache on SIM0: 2.00 MiB" in off.log and off.stats["generate"]["cache_layers"] == 0
    assert off.generated == reference.generated
