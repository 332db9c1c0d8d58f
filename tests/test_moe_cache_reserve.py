"""A new scheduler between a prompt and the decode steps, on SIM. A prompt ubatch that uploads ahead writes the
expert cache's banks on the scheduler's copy queues; a per-context prefetch setting (as an adapter, a control vector
or a sampler change between llama-server requests) makes the next decode reserve a new scheduler, which frees the old
one's queues. The decode steps that follow wait for the prompt's bank writes before they read the banks: that wait
must go through the live scheduler, never through a queue the old one owned. SIM keeps a freed backend's handle as
a tombstone, so a call through it aborts instead of reading freed memory and seeming to work."""
from __future__ import annotations

import pytest

from pyllama_moe.harness import models, runner
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR

# GGML_SCHED_PREFETCH=2: SIM devices upload ahead (the default mode is for CUDA-family devices alone)
SIM_ENV = {"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1", "GGML_SIM_COPY_LATENCY_US": "50", "GGML_SCHED_PREFETCH": "2",
           "LLAMA_MOE_CACHE_MIB": "2"}
PROMPT = [(i * 7919) % 4000 + 16 for i in range(512)]
UBATCH = 128  # the prefetch's min batch: every prompt ubatch uploads ahead and writes the banks on the copy queue


@pytest.fixture(scope="module")
def model():
    return models.ensure_model("qwen3moe", load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"])


def _run(build, src, model, env=None, **spec):
    fields = dict(model=model, tokens=PROMPT, cpu_moe=True, load_mode="none", repack=False, threads=2, n_ubatch=UBATCH,
                  n_batch=512, generate=6, stats=True, want_logits=False, env={**SIM_ENV, **(env or {})})
    return runner.run(build, src, runner.RunSpec(**{**fields, **spec}))


@pytest.mark.parametrize("env", [{}, {"LLAMA_MOE_CACHE_DEBUG_CHECK_SEED": "1"}], ids=["decode", "seed-check"])
def test_decode_after_a_reserve_waits_for_the_prompts_bank_writes_through_the_new_scheduler(patched_build, src, model, env):
    plain = _run(patched_build, src, model, env)
    reserved = _run(patched_build, src, model, env, prefetch_after_prompt={"depth": 3})
    # the path is reached: the prompt admitted experts into the banks from its staged copies (the copy queue wrote
    # them), and the decode after it ran on a scheduler reserved once more than the plain run's
    prompt = reserved.stats["prompt"]["cache_prompt"]
    assert prompt["n_fills"] > 0 and prompt["n_hits"] + prompt["n_misses"] > 0
    assert reserved.log.count("reserving ...") == plain.log.count("reserving ...") + 1
    assert "freed SIM backend" not in reserved.log
    # a new scheduler computes the same bytes
    assert reserved.generated == plain.generated
    assert reserved.decode_logits_sha256 == plain.decode_logits_sha256
    if env:
        assert "seed check:" in reserved.log and ", 0 differ" in reserved.log
