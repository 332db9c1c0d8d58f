"""llama-cpp-python's `Llama` on the patched build through `pyllama_moe.llm` (README, "From Python"): experts kept on
the host of a SIM device, the expert cache in the context, the same greedy text as without the cache, and the
cache's counters read back through cffi. Each run is its own process: use_build must come before llama_cpp loads."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


pytestmark = pytest.mark.build

SCRIPT = """
import json, sys
from pyllama_moe import llm

moe = llm.use_build("patched", "cpu")
model = llm.moe_llama(sys.argv[1], n_gpu_layers=99, cpu_moe=True, moe_cache_mib=int(sys.argv[2]), n_ctx=256,
                      n_threads=2, verbose=False)
out = model("the", max_tokens=24, temperature=0.0)
print(json.dumps({"text": out["choices"][0]["text"], "stats": llm.cache_stats(moe, model)}))
"""


def _generate(tiny_model, cache_mib: int, sim: bool = True, stderr: list | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GGML_SIM_", "LLAMA_MOE_", "LLAMA_CPP_LIB"))}
    if sim:
        env.update(GGML_SIM_DEVICES="1", GGML_SIM_POISON="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model), str(cache_mib)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if stderr is not None:
        stderr.append(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_cache_asked_of_a_cpu_build_says_it_needs_a_gpu(patched_build, tiny_model):
    # the README's example on a CPU build: it runs, and says why the hit rate it prints is None
    err: list = []
    got = _generate(tiny_model, 2, sim=False, stderr=err)
    assert got["stats"]["decode"]["hit_rate"] is None and len(got["text"]) > 0
    assert "the expert cache needs a GPU" in err[0] and "--backend cuda" in err[0]


def test_llama_with_the_expert_cache_generates_what_it_does_without(patched_build, tiny_model):
    off, on = _generate(tiny_model, 0), _generate(tiny_model, 2)
    assert on["text"] == off["text"] and len(off["text"]) > 0
    assert off["stats"]["decode"]["n_layers"] == 0 and off["stats"]["decode"]["hit_rate"] is None
    decode = on["stats"]["decode"]
    assert decode["n_layers"] == 4 and decode["n_ubatches"] >= 4 * 20 and decode["n_misses"] > 0
    assert 0 < decode["hit_rate"] < 1 and sorted(decode["layers"]) == ["0", "1", "2", "3"]
    assert sum(layer["n_hits"] for layer in decode["layers"].values()) == decode["n_hits"]


def test_use_build_after_llama_cpp_was_imported_with_another_library_is_refused(patched_build):
    script = ("import os, sys, types; os.environ['LLAMA_CPP_LIB_PATH'] = '/elsewhere'; "
              "sys.modules['llama_cpp'] = types.ModuleType('llama_cpp')\n"
              "from pyllama_moe import llm\nfrom pyllama_moe.errors import UserError\n"
              "try:\n    llm.use_build('patched', 'cpu')\nexcept UserError as e:\n    print('refused:', e)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "refused: llama_cpp was imported before pyllama_moe.llm.use_build" in proc.stdout, proc.stderr[-2000:]


PROFILE_SCRIPT = """
import json, sys
from pyllama_moe import llm

moe = llm.use_build("patched", "cpu")
model = llm.moe_llama(sys.argv[1], n_gpu_layers=99, cpu_moe=True, moe_cache_mib=2, moe_cache_profile=sys.argv[2],
                      n_ctx=256, n_threads=2, verbose=False)
after = llm._default_profile(moe)  # the process default is back to what it was (none) once the context is made
model("the", max_tokens=8, temperature=0.0)
model.close()  # the cache is freed: the profile is written
print(json.dumps({"default_after": after.decode() if after else None}))
"""


def test_moe_llama_takes_a_profile_and_writes_it_when_the_context_is_freed(patched_build, tiny_model, tmp_path):
    from pyllama_moe.plot import profile

    path = tmp_path / "p.gguf"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GGML_SIM_", "LLAMA_MOE_", "LLAMA_CPP_LIB"))}
    env.update(GGML_SIM_DEVICES="1", GGML_SIM_POISON="1")
    proc = subprocess.run([sys.executable, "-c", PROFILE_SCRIPT, str(tiny_model), str(path)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["default_after"] is None
    p = profile.read(path)
    assert p.n_runs == 1 and p.n_layer == 4 and int(p.decode.sum()) > 0


ASYNC_SCRIPT = """
import json, sys
from pyllama_moe import llm

moe = llm.use_build("patched", "cpu")
out = {}
for on in (False, True):
    model = llm.moe_llama(sys.argv[1], n_gpu_layers=99, n_cpu_moe=2, sched_async_cpu=on, n_ctx=256, n_threads=2,
                          verbose=False)
    text = model("the", max_tokens=24, temperature=0.0)["choices"][0]["text"]
    ctx = llm._context_of(moe, model)
    stats = moe._ffi.new("struct llama_moe_stats *")
    moe.llama_moe_get_stats(ctx, stats)
    out[str(on)] = {"text": text, "set": moe.llama_moe_get_sched_async_cpu(ctx), "worker": stats.n_async_cpu_splits}
    model.close()
print(json.dumps(out))
"""


def test_moe_llama_computes_cpu_splits_on_the_worker_when_asked_with_the_same_text(patched_build, tiny_model):
    prefixes = ("GGML_SIM_", "GGML_SCHED_", "LLAMA_MOE_", "LLAMA_CPP_LIB")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.update(GGML_SIM_DEVICES="1", GGML_SIM_POISON="1", GGML_SCHED_ASYNC_CPU_DEBUG_DELAY_US="300")
    proc = subprocess.run([sys.executable, "-c", ASYNC_SCRIPT, str(tiny_model)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["False"]["set"] == 0 and got["False"]["worker"] == 0
    assert got["True"]["set"] == 1 and got["True"]["worker"] > 0  # layers 0-1's experts computed on the worker
    assert got["True"]["text"] == got["False"]["text"] and len(got["True"]["text"]) > 0
