"""Which path each cached layer takes, counted per graph (docs/cache-paths.md), on SIM: a graph of one token looks its
slots up on the device; a graph below the op offload batch whose experts may not fit a layer's slots is computed
hot/cold there (docs/hot-cold.md); where the device computes no masked ids (GGML_SIM_NO_MASKED_IDS=1) a decode-size
such graph takes the staging path and a larger graph of a layer not read in place takes the host path. Every graph bound counts one step per cached layer,
in the phase of its size, and the context says once, when its cache is made, which graph sizes leave the banks. The
logits are those of the cache off on every path (SIM computes with the CPU's kernels)."""
from __future__ import annotations

import dataclasses
import re

import pytest

from pyllama_moe.harness import models, runner
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR

SIM_ENV = {"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1"}
TOKENS = [(i * 7919) % 4000 + 16 for i in range(20)]
N_GEN = 3  # two decode graphs of one token after the prompt's graph


@pytest.fixture(scope="module")
def model():
    return models.ensure_model("qwen3moe", load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"])


def _run(build, src, model, n_prompt, cache_mib, n_seq_max=None, masked=True):
    env = {**SIM_ENV, "LLAMA_MOE_CACHE_MIB": str(cache_mib), **({} if masked else {"GGML_SIM_NO_MASKED_IDS": "1"})}
    return runner.run(build, src, runner.RunSpec(model=model, tokens=TOKENS[:n_prompt], cpu_moe=True, load_mode="none",
                                                 repack=False, threads=2, generate=N_GEN, stats=True, env=env,
                                                 n_seq_max=n_seq_max))


def _slots(log):
    """The fewest slots of a cached layer, its experts, and the cached layers, from the cache's line."""
    m = re.search(r"expert cache on SIM0: [0-9.]+ MiB, (\d+) MoE layers .*?, (\d+)-\d+ of (\d+) expert slots", log)
    assert m, log[-3000:]
    return int(m.group(2)), int(m.group(3)), int(m.group(1))


@pytest.mark.parametrize("n_prompt,path,masked", [(20, "hot_cold", True), (3, "hot_cold", True), (20, "host", False),
                                                 (3, "staging", False)])
def test_every_graph_counts_a_step_per_cached_layer_by_its_path(patched_build, src, model, n_prompt, path, masked):
    off = _run(patched_build, src, model, n_prompt, 0, masked=masked)
    got = _run(patched_build, src, model, n_prompt, 2, masked=masked)
    assert got.logits_sha256 == off.logits_sha256 and got.decode_logits_sha256 == off.decode_logits_sha256
    n_slots, n_expert, n_layers = _slots(got.log)
    assert n_slots < n_expert and n_prompt * 2 > n_slots  # the prompt's graph may not fit: it leaves the banks
    paths = got.stats["generate"]["cache_paths"]
    prompt_phase = "prompt" if n_prompt > 8 else "decode"  # graphs above LLAMA_MOE_CACHE_DECODE_MAX count as prompts
    want_decode = {"in_place": 0, "device": (N_GEN - 1) * n_layers, "host_plan": 0, "staging": 0, "host": 0,
                   "hot_cold": 0}
    want_prompt = {"in_place": 0, "device": 0, "host_plan": 0, "staging": 0, "host": 0, "hot_cold": 0}
    (want_prompt if prompt_phase == "prompt" else want_decode)[path] += n_layers
    assert paths["decode"] == want_decode
    assert paths["prompt"] == want_prompt
    # the decode counters see the same staging steps
    assert got.stats["generate"]["cache_decode"]["n_overflow"] == want_decode["staging"]


def test_the_context_says_once_which_graph_sizes_leave_the_banks(patched_build, src, model):
    # hot/cold layers read the banks up to the op offload batch: 4 sequences stay on them
    hot = _run(patched_build, src, model, 3, 2, n_seq_max=4)
    assert "decode graphs of up to 31 tokens compute the misses they do not upload" in hot.log, hot.log[-3000:]
    assert "sequences at once" not in hot.log
    got = _run(patched_build, src, model, 3, 2, n_seq_max=4, masked=False)
    n_slots, _, n_layers = _slots(got.log)
    lines = [ln for ln in got.log.splitlines() if "read the banks of every cached layer" in ln]
    assert len(lines) == 1, got.log[-3000:]
    assert "docs/cache-paths.md" in lines[0]
    # n_seq_max 4: a step of every sequence is a graph of 4 tokens, more experts than the slots hold
    wide = [ln for ln in got.log.splitlines() if "decodes up to 4 sequences at once" in ln]
    assert len(wide) == 1 and f"leaves the banks in {n_layers} of {n_layers} cached layers" in wide[0]
    assert wide[0].rstrip().endswith("on the CPU")
    one = _run(patched_build, src, model, 3, 2, masked=False)
    assert "sequences at once" not in one.log


# one routed expert a token: a graph of up to 8 tokens fits a layer of at least 8 slots, so only the device's
# mul_mat_id limit can send it to the staging path
TOP1 = {**load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"], "experts_used": 1}


@pytest.mark.parametrize("cc,path,masked", [(None, "device", True), (610, "hot_cold", True), (610, "staging", False)])
def test_a_graph_above_the_devices_mul_mat_id_limit_leaves_the_plain_banks(patched_build, src, cc, path, masked):
    # GGML_SIM_CC=610: SIM reports Pascal's limit of MMVQ for a Q8_0 mul_mat_id, 4 tokens (ggml-cuda/mmvq-mmid.h),
    # under the 5 of the prompt's graph; above it CUDA's tiled kernels split by the bank's expert count, so the graph
    # is hot/cold (the tiled kernel on the banks, a mixed path) or, without masked ids, takes the staging path
    top1 = models.ensure_model("qwen3moe-top1", TOP1)
    env = {**SIM_ENV, "LLAMA_MOE_CACHE_MIB": "4", **({"GGML_SIM_CC": str(cc)} if cc else {}),
           **({} if masked else {"GGML_SIM_NO_MASKED_IDS": "1"})}
    spec = runner.RunSpec(model=top1, tokens=TOKENS[:5], cpu_moe=True, load_mode="none", repack=False, threads=2,
                          generate=N_GEN, stats=True, env=env)
    got = runner.run(patched_build, src, spec)
    off = runner.run(patched_build, src, dataclasses.replace(spec, env={**env, "LLAMA_MOE_CACHE_MIB": "0"}))
    assert got.logits_sha256 == off.logits_sha256 and got.decode_logits_sha256 == off.decode_logits_sha256
    n_slots, n_expert, n_layers = _slots(got.log)
    assert 5 <= n_slots < n_expert  # the 5 tokens' experts always fit: the slots are not what sends them away
    decode = got.stats["generate"]["cache_paths"]["decode"]
    # the prompt's graph of 5 tokens, then N_GEN - 1 graphs of one token on the device (under every limit)
    assert decode["device"] == (N_GEN - 1 + (path == "device")) * n_layers
    assert decode["staging"] == (path == "staging") * n_layers
    assert decode["hot_cold"] == (path == "hot_cold") * n_layers
    said = [ln for ln in got.log.splitlines() if "read the banks in graphs of up to" in ln]
    if cc:
        assert len(said) == 1 and f"{n_layers} cached layers (q8_0 weights on SIM0) read the banks in graphs of up to 4 tokens, not 8" in said[0]
    else:
        assert said == []
