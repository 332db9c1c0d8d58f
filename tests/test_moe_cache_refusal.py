"""A refused device lookup (more experts than slots, an id out of range, a corrupt slot state) leaves slot ids of 0,
so its step computes from wrong experts. Refusals depend on the data, so the step itself must fail: each device's
lookup status words are read back with the step's outputs and a refused step fails its llama_decode call. Planted on
SIM with LLAMA_MOE_CACHE_DEBUG_REFUSE=N: the Nth graph with device lookups finds its first such layer's slot state
corrupt. llama-completion stops at the failed call ("failed to eval"); without the plant the same run completes."""
from __future__ import annotations

import dataclasses
import os
import subprocess

import pytest

from pyllama_moe.harness import models, runner
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR

pytestmark = pytest.mark.build

PROMPT = " ".join(f"w{(k * 37) % 97}" for k in range(40))


@pytest.fixture(scope="module")
def model():
    return models.ensure_model("qwen3moe", load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"])


def _complete(build, model, *args, **env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GGML_SIM_", "LLAMA_MOE_", "LLAMA_ARG_"))}
    env.update({"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1", "LLAMA_MOE_CACHE_MIB": "2", **env_extra})
    return subprocess.run([str(build.bin_dir / "llama-completion"), "-m", str(model), "-ngl", "99", "-cmoe", "-p", PROMPT,
                           "-n", "8", "--temp", "0", "-t", "2", "--fit", "off", "-no-cnv", "--no-warmup", "-v", *args],
                          env=env, capture_output=True, text=True, timeout=300)


def test_a_refused_lookup_fails_the_decode_call_that_computed_it(patched_build, model):
    clean = _complete(patched_build, model)
    assert clean.returncode == 0, clean.stderr[-3000:]
    assert "looked up on the device" in clean.stderr and " 0 looked up on the device" not in clean.stderr
    planted = _complete(patched_build, model, LLAMA_MOE_CACHE_DEBUG_REFUSE="3")
    log = planted.stderr
    assert "LLAMA_MOE_CACHE_DEBUG_REFUSE: graph 3 finds layer" in log, log[-3000:]
    assert planted.returncode != 0, log[-3000:]
    refused = [ln for ln in log.splitlines() if "was refused in this step" in ln]
    assert len(refused) == 1 and "the decode call fails" in refused[0]
    assert "failed to eval" in log


def test_a_refusal_names_its_layer_when_an_earlier_device_got_no_cache(patched_build, model):
    # two SIM devices, the first too small for any slot (its layers stay uncached), the second caching layers 2 and 3:
    # the words of the second device must lead to its own layers, not to positions of the layers before the cache
    # dropped the first device's
    planted = _complete(patched_build, model, "-ts", "1,2", GGML_SIM_DEVICES="2", GGML_SIM_MEMORY_MIB="520,8192",
                        LLAMA_MOE_CACHE_DEBUG_REFUSE="2")
    log = planted.stderr
    assert "no expert cache on SIM0" in log and "expert cache on SIM1" in log, log[-3000:]
    assert planted.returncode == 1, log[-3000:]  # the failed decode call, not an abort
    refused = [ln for ln in log.splitlines() if "was refused in this step" in ln]
    assert len(refused) == 1 and "layer 2's lookup on SIM1" in refused[0], log[-3000:]


def test_a_refused_step_decoded_again_gives_the_tokens_and_logits_of_a_clean_run(patched_build, src, model):
    # the failed call removed its positions and emptied the refused layer's slots: the same token at the same position
    # decodes as if nothing had happened (SIM computes every path with the CPU's kernels, so bytes equal the cache off)
    tokens = [(i * 7919) % 4000 + 16 for i in range(40)]
    env = {"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1", "LLAMA_MOE_CACHE_MIB": "2"}
    spec = runner.RunSpec(model=model, tokens=tokens, cpu_moe=True, load_mode="none", repack=False, threads=2,
                          generate=8, stats=True, env=env, retry_failed_decode=1)
    clean = runner.run(patched_build, src, dataclasses.replace(spec, env={**env, "LLAMA_MOE_CACHE_MIB": "0"}))
    planted = runner.run(patched_build, src, dataclasses.replace(spec, env={**env, "LLAMA_MOE_CACHE_DEBUG_REFUSE": "3"}))
    assert planted.decode_retries == [len(tokens) + 2]  # the third generation step's graph, the third device graph
    assert planted.generated == clean.generated
    assert planted.decode_logits_sha256 == clean.decode_logits_sha256
    assert sum("was refused in this step" in ln for ln in planted.log.splitlines()) == 1
