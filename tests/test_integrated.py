"""A device that reads the host inputs where they are (an integrated GPU that takes the host buffer type: SIM with
GGML_SIM_INTEGRATED) gets no copy of them that the scheduler waits on before the next ubatch overwrites them, and its
graph computes after graph_compute returned. Each ubatch's inputs wait for the graph before them, so a prompt of
several ubatches computes what a discrete device computes: the same CPU kernels, the same bytes."""
from __future__ import annotations

import re

import pytest

from pyllama_moe.harness import models, runner
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR

pytestmark = pytest.mark.build

TOKENS = [(i * 7919) % 4000 + 16 for i in range(160)]  # 5 ubatches of 32
# a slow device: the host runs ahead to the next ubatch's inputs while the last graph still waits to compute
SIM_ENV = {"GGML_SIM_DEVICES": "1", "GGML_SIM_COMPUTE_LATENCY_US": "3000", "GGML_SCHED_PREFETCH": "2",
           "GGML_SCHED_PREFETCH_MIN_BATCH": "32"}


@pytest.fixture(scope="module")
def model():
    return models.ensure_model("qwen3moe", load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"])


def _run(build, src, model, env):
    spec = runner.RunSpec(model=model, tokens=TOKENS, n_ubatch=32, n_batch=256, threads=2, generate=4, cpu_moe=True,
                          load_mode="none", repack=False, env={**SIM_ENV, **env})
    return runner.run(build, src, spec)


# reused: the graph of each ubatch is the last one's (SIM poison finds the racing reads of the token and position
# inputs); rebuilt: each ubatch builds its graph anew, without poison (which waits for the streams when it fills a new
# tensor, and so would hide the race)
@pytest.mark.parametrize("env", [{"GGML_SIM_POISON": "1"}, {"LLAMA_GRAPH_REUSE_DISABLE": "1"}], ids=["reused", "rebuilt"])
def test_each_ubatch_waits_for_the_last_before_writing_inputs_read_in_place(patched_build, src, model, env):
    discrete = _run(patched_build, src, model, env)
    integrated = _run(patched_build, src, model, {**env, "GGML_SIM_INTEGRATED": "1"})
    assert "ggml_sim: race" not in discrete.log + integrated.log, integrated.log[-3000:]
    # the mask, the cache's row indices and the output ids are written through pointers, where SIM sees no race:
    # the bytes are the check
    assert integrated.logits_sha256 == discrete.logits_sha256
    assert integrated.decode_logits_sha256 == discrete.decode_logits_sha256
    # said once where a device reads them in place, and a discrete device does not wait
    said = re.compile(r"SIM0 reads the graph inputs in SIM_Host where they are: each ubatch's inputs wait")
    assert len(said.findall(integrated.log)) == 1 and not said.search(discrete.log)
