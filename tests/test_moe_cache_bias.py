"""A per-expert bias that stays on a device while its weight is on the host (an -ot rule that moves only the .weight
tensors) cannot be banked beside the weight: the matmul would read slots while the bias add reads the router's ids,
which CUDA refuses to fuse. Such a layer is not cached, and the context says why once; the completion is the one
without a cache. On SIM with gpt-oss (biases on every expert tensor), through llama-completion's own -ot."""
from __future__ import annotations

import os
import subprocess

import pytest

from pyllama_moe.harness import models
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR

pytestmark = pytest.mark.build

PROMPT = " ".join(f"w{(k * 53) % 89}" for k in range(30))
WEIGHTS_ONLY = r"\.ffn_(up|down|gate|gate_up)_exps\.weight=CPU"
WITH_BIASES = r"\.ffn_(up|down|gate|gate_up)_exps\.=CPU"
# layers 0 and 1 keep their biases on the device, layers 2 and 3 move them with their weights
MIXED = r"blk\.[01]\.ffn_(up|down|gate|gate_up)_exps\.weight=CPU,blk\.[23]\.ffn_(up|down|gate|gate_up)_exps\.=CPU"


@pytest.fixture(scope="module")
def gpt_oss():
    return models.ensure_model("gpt-oss", load_matrix(CI_DIR / "matrix.toml").models["gpt-oss"])


def _complete(build, model, rule, cache_mib):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GGML_SIM_", "LLAMA_MOE_", "LLAMA_ARG_"))}
    env.update(GGML_SIM_DEVICES="1", GGML_SIM_POISON="1", LLAMA_MOE_CACHE_MIB=str(cache_mib))
    out = subprocess.run([str(build.bin_dir / "llama-completion"), "-m", str(model), "-ngl", "99", "-ot", rule, "-p", PROMPT,
                          "-n", "12", "--temp", "0", "-t", "2", "--fit", "off", "-no-cnv", "--no-warmup", "-v"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_a_layer_whose_biases_stay_on_a_device_is_not_cached_and_says_why(patched_build, gpt_oss):
    off = _complete(patched_build, gpt_oss, MIXED, 0)
    got = _complete(patched_build, gpt_oss, MIXED, 4)
    assert got.stdout == off.stdout
    said = [ln for ln in got.stderr.splitlines() if "not cached" in ln]
    assert len(said) == 1 and "2 MoE layers not cached (0, 1)" in said[0], got.stderr[-3000:]
    assert "their biases are on a device" in said[0]
    assert "expert cache on SIM0" in got.stderr and "2 MoE layers with their experts on the host" in got.stderr
    # with every layer so, no cache is made, and the line says why
    alone = _complete(patched_build, gpt_oss, WEIGHTS_ONLY, 4)
    assert alone.stdout == _complete(patched_build, gpt_oss, WEIGHTS_ONLY, 0).stdout
    assert "expert cache of 4 MiB not made: layer 0's experts are on the host while their biases are on a device" in alone.stderr


def test_biases_that_move_with_their_weights_are_banked(patched_build, gpt_oss):
    off = _complete(patched_build, gpt_oss, WITH_BIASES, 0)
    got = _complete(patched_build, gpt_oss, WITH_BIASES, 4)
    assert got.stdout == off.stdout
    assert "not cached" not in got.stderr
    assert "expert cache on SIM0" in got.stderr and "looked up on the device" in got.stderr
