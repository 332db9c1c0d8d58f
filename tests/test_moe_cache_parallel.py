"""Parallel sequences with the expert cache on SIM (docs/cache-paths.md, "Parallel sequences"): each decode step is one
graph of a token per sequence, and every cached layer takes the path its slots name for a graph of that size. SIM
computes every path with the CPU's kernels, so the logits are those of the cache off; what the cache changes is only
the path, which is counted per layer and step and must be the rule's."""
from __future__ import annotations

import re

import pytest

from pyllama_moe.harness import models, runner
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR
from pyllama_moe.synth.gguf_read import read_gguf
from pyllama_moe.worker.mode_logits import forced_token

SIM_ENV = {"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1"}
TOKENS = [(i * 7919) % 4000 + 16 for i in range(40)]  # a prompt of 40: one graph above the decode sizes
N_GEN = 6  # 5 parallel steps after the prompt
K = 4  # the tiny qwen3moe routes each token to 4 of its 16 experts
PARALLEL = (2, 4, 8, 12)


@pytest.fixture(scope="module")
def model():
    return models.ensure_model("qwen3moe", load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"])


def _run(build, src, model, cache_mib, parallel, masked=True):
    # GGML_SIM_NO_MASKED_IDS=1: SIM computes no masked expert ids, so no layer is computed hot/cold
    env = {**SIM_ENV, "LLAMA_MOE_CACHE_MIB": str(cache_mib), **({} if masked else {"GGML_SIM_NO_MASKED_IDS": "1"})}
    return runner.run(build, src, runner.RunSpec(model=model, tokens=TOKENS, cpu_moe=True, load_mode="none",
                                                 repack=False, threads=2, generate=N_GEN, stats=True, env=env,
                                                 parallel=parallel))


@pytest.fixture(scope="module")
def cache_off(patched_build, src, model):
    return {n: _run(patched_build, src, model, 0, n) for n in PARALLEL}


def decode_paths(stats):
    """The generation's steps per cached layer and path (the worker's "decode_paths", its keys the layers)."""
    return {int(il): steps for il, steps in (stats or {}).get("decode_paths", {}).items()}


def _layer_slots(log, model):
    """Each cached layer's slots, by the cache's line ("7-8 of 16 expert slots") and the sizing: an equal share, the
    remainder one slot each to the first layers. The slots in all come from the MiB the banks use over an expert's
    bytes (the slot maps and lookup state add less than an expert)."""
    m = re.search(r"expert cache on SIM0: ([0-9.]+) MiB, (\d+) MoE layers .*?, (\d+)-(\d+) of (\d+) expert slots", log)
    assert m, log[-3000:]
    used, n_layers, smin, smax, n_expert = float(m.group(1)), *map(int, m.groups()[1:])
    assert n_expert == 16
    tensors = read_gguf(model, check_data=False).tensors
    expert_bytes = sum(tensors[f"blk.0.ffn_{t}_exps.weight"].nbytes for t in ("gate", "up", "down")) / n_expert
    n_first = int(used * 2**20 // expert_bytes) - smin * n_layers if smax > smin else 0
    assert smax == smin or 0 < n_first < n_layers, (used, n_first)
    return [smax] * n_first + [smin] * (n_layers - n_first)


def _rule(slots, n_tokens, masked):
    """docs/cache-paths.md's table for a partial layer: the banks (looked up on the device, SIM's default) while the
    graph is at most 8 tokens and its experts fit the slots; a graph of up to 31 tokens whose experts may not fit is
    computed hot/cold (looked up on the device too) where the device computes masked ids, else it takes the staging
    path up to 8 tokens and the host path above."""
    if n_tokens <= 8 and n_tokens * K <= slots:
        return "device"
    if masked:
        return "hot_cold" if n_tokens <= 31 else "host"
    return "staging" if n_tokens <= 8 else "host"


# 2 MiB: 5 slots in every layer, so every step of 2 or more may not fit them; 3 MiB: 8 slots in the first layers and
# 7 in the rest, so a step of 2 fits the first and may not fit the others. Such steps are hot/cold where SIM computes
# masked ids, else they leave the banks
@pytest.mark.parametrize("masked", [True, False], ids=["hot-cold", "no-masked-ids"])
@pytest.mark.parametrize("cache_mib,slot_range", [(2, (5, 5)), (3, (7, 8))])
@pytest.mark.parametrize("parallel", PARALLEL)
def test_each_parallel_step_takes_the_path_its_slots_name_and_computes_the_cache_offs_bytes(
        patched_build, src, model, cache_off, cache_mib, slot_range, parallel, masked):
    got, off = _run(patched_build, src, model, cache_mib, parallel, masked), cache_off[parallel]
    assert got.logits_sha256 == off.logits_sha256
    assert got.decode_logits_sha256 == off.decode_logits_sha256
    # the prompt's argmax, then one per sequence and step
    assert len(got.generated) == 1 + (N_GEN - 1) * parallel
    slots = _layer_slots(got.log, model)
    assert (min(slots), max(slots)) == slot_range
    paths = decode_paths(got.stats)
    assert sorted(paths) == list(range(len(slots)))  # every layer's experts are on the host, every one cached
    taken = []
    for il in range(len(slots)):
        # every step of the generation counted once, all on one path
        used = {p: n for p, n in paths[il].items() if n}
        assert len(used) == 1 and list(used.values()) == [N_GEN - 1], (il, paths[il])
        taken += used
    assert taken == [_rule(s, parallel, masked) for s in slots]
    # the staging steps are also the decode counters' overflows (graphs above 8 tokens count as prompts there)
    staging = sum(p["staging"] for p in paths.values())
    assert got.stats["generate"]["cache_decode"]["n_overflow"] == staging


def test_a_cache_off_run_reports_no_paths_and_one_sequence_keeps_its_request(patched_build, src, model, cache_off,
                                                                            monkeypatch):
    assert decode_paths(cache_off[2].stats) == {}
    seen = {}

    def fake_worker(mode, req, **_kw):
        seen.update(req)
        return {}, ""

    monkeypatch.setattr(runner.spawn, "run_worker", fake_worker)
    runner.run(patched_build, src, runner.RunSpec(model=model, tokens=TOKENS, want_logits=False))
    # parallel 1 (the default) sends the request every other run sends: no key of its own
    assert "parallel" not in seen and "cpu_moe_layers" not in seen
    runner.run(patched_build, src, runner.RunSpec(model=model, tokens=TOKENS, want_logits=False, parallel=4,
                                                  cpu_moe_layers=[2, 3]))
    assert seen["parallel"] == 4 and seen["cpu_moe_layers"] == [2, 3]


def test_the_sequences_are_fed_different_tokens():
    for step in range(64):
        fed = [forced_token(s, step, 151936) for s in range(12)]
        assert len(set(fed)) == 12 and all(0 <= t < 151936 for t in fed)
