"""Several contexts on one model (docs/expert-cache.md, "Contexts"): two contexts decode at once, one thread each, on
one SIM device with every expert on the host. They share the model's weights and its pinned ranges (registered once,
a reference per context); each has its own expert cache (banks, slot state, counters) and KV memory, so each
computes what a context alone computes, and their caches count alike."""
from __future__ import annotations

import re

import pytest

from pyllama_moe.harness import models, runner
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR

SIM_ENV = {"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1", "GGML_SIM_COPY_LATENCY_US": "50"}
TOKENS = [(i * 7919) % 4000 + 16 for i in range(40)]
N_GEN = 32


@pytest.fixture(scope="module")
def model():
    return models.ensure_model("qwen3moe", load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"])


def _run(build, src, model, env, contexts=1):
    spec = runner.RunSpec(model=model, tokens=TOKENS, cpu_moe=True, load_mode="mmap", repack=False, threads=2,
                          generate=N_GEN, stats=True, want_logits=False, env={**SIM_ENV, **env}, contexts=contexts)
    return runner.run(build, src, spec)


def test_two_contexts_decode_at_once_each_with_its_own_cache(patched_build, src, model):
    alone = _run(patched_build, src, model, {"LLAMA_MOE_CACHE_MIB": "0"})
    both = _run(patched_build, src, model, {"LLAMA_MOE_CACHE_MIB": "2"}, contexts=2)
    assert len(both.contexts) == 2
    for ctx in both.contexts:
        assert ctx["generated"] == alone.generated and ctx["decode_logits_sha256"] == alone.decode_logits_sha256
    first, second = (ctx["stats"]["cache_decode"] for ctx in both.contexts)
    assert first["n_misses"] > 0 and first["n_evictions"] > 0
    for key in ("n_ubatches", "n_hits", "n_misses", "n_fills", "n_evictions"):
        assert first[key] == second[key], key  # the same tokens through caches of their own
    # a cache per context, looked up on the device in each; the experts pinned once, by the model
    assert len(re.findall(r"llama_moe: expert cache on SIM0: [0-9.]+ MiB", both.log)) == 2
    assert both.log.count("decode looks up its slots and fills its misses on the device") == 2
    assert len(re.findall(r"llama_moe: [0-9.]+ MiB of expert weights registered with SIM0", both.log)) == 1
