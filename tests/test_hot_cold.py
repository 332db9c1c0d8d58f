"""Hot/cold layers on SIM (docs/hot-cold.md): a cached layer's decode step computes the experts its lookup leaves cold
(the miss policy's, or past the slots) on the CPU from the host weights, the others from the banks, each branch with
the other's ids masked, merged by one add. SIM runs the CPU's kernels, so every policy, with the worker on or off and
with batches whose experts overflow the slots, computes the bytes of the cache off; what the policy changes is which
misses are uploaded, counted per layer step."""
from __future__ import annotations

import re

import pytest

from pyllama_moe.build.ffi import decode_hit_rate
from pyllama_moe.harness import models, runner
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR

SIM_ENV = {"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1", "GGML_SIM_COPY_LATENCY_US": "50"}
TOKENS = [(i * 7919) % 4000 + 16 for i in range(40)]
N_GEN = 12
N_LAYERS = 4  # the tiny qwen3moe: 4 MoE layers of 16 experts, top-4; 2 MiB of cache gives each 5 slots
SUMMARY = re.compile(r"expert cache, decode: (\d+) layer steps, (\d+) hits, (\d+) misses \([^)]*\), (\d+) misses "
                     r"computed on the CPU, (\d+) on the staging path")
HOT_COLD = "decode graphs of up to 31 tokens compute the misses they do not upload"


@pytest.fixture(scope="module")
def model():
    return models.ensure_model("qwen3moe", load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"])


def _run(build, src, model, env, parallel=1):
    spec = runner.RunSpec(model=model, tokens=TOKENS, cpu_moe=True, load_mode="none", repack=False, threads=2,
                          generate=N_GEN, stats=True, env={**SIM_ENV, **env}, parallel=parallel)
    return runner.run(build, src, spec)


@pytest.fixture(scope="module")
def cache_off(patched_build, src, model):
    return {n: _run(patched_build, src, model, {"LLAMA_MOE_CACHE_MIB": "0"}, n) for n in (1, 4, 12)}


def _summary(log):
    """The cache's decode summary: layer steps, hits, uploaded misses, misses on the CPU, staging steps."""
    m = SUMMARY.search(log)
    assert m, log[-2000:]
    return tuple(map(int, m.groups()))


def _same_bytes(got, off):
    assert got.logits_sha256 == off.logits_sha256
    assert got.decode_logits_sha256 == off.decode_logits_sha256
    assert got.generated == off.generated


@pytest.mark.parametrize("lookup", ["device", "host-plan"])
@pytest.mark.parametrize("parallel", [1, 4, 12])
@pytest.mark.parametrize("policy", ["upload", "cpu", "split:1"])
def test_every_policy_computes_the_cache_offs_bytes_and_uploads_what_it_says(patched_build, src, model, cache_off,
                                                                             policy, parallel, lookup):
    # the lookup on the device, or planned on the host from the router's ids read back (LLAMA_MOE_CACHE_DEVICE=0, as
    # where the experts are pageable): both follow the policy
    env = {"LLAMA_MOE_CACHE_MIB": "2", "LLAMA_MOE_MISS_POLICY": policy,
           **({"LLAMA_MOE_CACHE_DEVICE": "0"} if lookup == "host-plan" else {})}
    got = _run(patched_build, src, model, env, parallel)
    _same_bytes(got, cache_off[parallel])
    assert f"miss policy {policy}; {HOT_COLD}" in got.log
    looked_up = int(re.search(r", (\d+) looked up on the device,", got.log).group(1))
    assert (looked_up > 0) == (lookup == "device")
    steps, hits, uploaded, cold, staging = _summary(got.log)
    # a step of one sequence per token: every step after the prompt, in every layer
    assert steps == N_LAYERS * (N_GEN - 1) and staging == 0
    # the counters the Python side reads say the same, and its hit rate counts the cold misses as misses
    dec = got.stats["generate"]["cache_decode"]
    assert (dec["n_hits"], dec["n_misses"], dec["n_cold"]) == (hits, uploaded, cold)
    assert decode_hit_rate(dec) == pytest.approx(hits / (hits + uploaded + cold))
    if policy == "cpu":
        # no decode uploads: the misses are all computed on the CPU (nothing resident after a short prompt)
        assert uploaded == 0 and cold > 0
    elif policy == "split:1":
        # at most one upload per layer step, the rest on the CPU
        assert 0 < uploaded <= steps and cold > 0
    elif parallel == 1:
        # one token's 4 experts always fit 5 slots: every miss uploaded
        assert uploaded > 0 and cold == 0
    else:
        # 4 or 12 tokens route to more experts than the 5 slots: what does not fit is cold, no step leaves the banks
        assert uploaded > 0 and cold > 0


def test_the_worker_computes_the_cold_experts_beside_the_banks_with_the_same_bytes(patched_build, src, model, cache_off):
    env = {"LLAMA_MOE_CACHE_MIB": "2", "LLAMA_MOE_MISS_POLICY": "cpu", "GGML_SCHED_ASYNC_CPU": "1"}
    got = _run(patched_build, src, model, env, 4)
    _same_bytes(got, cache_off[4])
    assert "asynchronous CPU splits on" in got.log and _summary(got.log)[3] > 0


def test_two_runs_of_a_policy_give_the_same_bytes_and_counts(patched_build, src, model):
    env = {"LLAMA_MOE_CACHE_MIB": "2", "LLAMA_MOE_MISS_POLICY": "split:2"}
    a, b = (_run(patched_build, src, model, env, 4) for _ in range(2))
    assert a.decode_logits_sha256 == b.decode_logits_sha256 and _summary(a.log) == _summary(b.log)


def test_without_masked_ids_the_policy_is_not_followed_and_the_context_says_why(patched_build, src, model, cache_off):
    env = {"LLAMA_MOE_CACHE_MIB": "2", "LLAMA_MOE_MISS_POLICY": "cpu", "GGML_SIM_NO_MASKED_IDS": "1"}
    got = _run(patched_build, src, model, env, 4)
    _same_bytes(got, cache_off[4])
    assert ("miss policy cpu not followed in 4 of 4 layers, which upload every miss (and take the staging path where "
            "the experts may not fit): its device does not compute expert ids of -1 (masked ids)") in got.log
    steps, _, _, cold, staging = _summary(got.log)
    assert cold == 0 and staging == steps


def test_a_stale_slot_read_as_hot_changes_the_decode(patched_build, src, model, cache_off):
    # the planted fault of the identity cells, under a policy that uploads: the first fill of each lookup of the first
    # cached layer is left out, so its slot keeps old bytes; the hot branch reads them and the logits must differ
    env = {"LLAMA_MOE_CACHE_MIB": "2", "LLAMA_MOE_MISS_POLICY": "split:1", "LLAMA_MOE_CACHE_DEBUG_SKIP_FILL": "1"}
    got = _run(patched_build, src, model, env, 4)
    assert got.decode_logits_sha256 != cache_off[4].decode_logits_sha256


@pytest.fixture(scope="module")
def gpt_oss():
    return models.ensure_model("gpt-oss", load_matrix(CI_DIR / "matrix.toml").models["gpt-oss"])


@pytest.mark.parametrize("extra", [{}, {"GGML_OP_OFFLOAD_MIN_BATCH": "0"}], ids=["default", "offload-all"])
def test_biased_experts_stay_on_the_cpu_in_the_cold_branch_with_the_prefetch_on(patched_build, src, gpt_oss, extra):
    # gpt-oss adds a bias per expert: the cold branch's masked bias adds have k x T rows, which the scheduler would
    # offload from 32 rows on (8 tokens of top-4) and, with the prefetch on, stage the cache's own host bias on the
    # GPU behind the lookup's back. A masked op stays with its host weights; with every op offloaded no layer is hot/cold
    env = {"GGML_SCHED_PREFETCH": "2", "LLAMA_MOE_MISS_POLICY": "cpu", **extra}
    off = _run(patched_build, src, gpt_oss, {**env, "LLAMA_MOE_CACHE_MIB": "0"}, 8)
    got = _run(patched_build, src, gpt_oss, {**env, "LLAMA_MOE_CACHE_MIB": "4"}, 8)
    _same_bytes(got, off)
    if extra:
        assert "GGML_OP_OFFLOAD_MIN_BATCH offloads the host weights' ops of every graph" in got.log
    else:
        assert f"miss policy cpu; {HOT_COLD}" in got.log and _summary(got.log)[3] > 0
