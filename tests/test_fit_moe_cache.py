"""--fit with the expert cache: with a cache asked for and a model that does not fit, --fit gives each
device's room to the cache first (every expert on the host), whole layers the rest, and no device ends below its
target.

The decision (native/common/fit-moe-cache.cpp) has no llama.cpp dependency: tests/native/test_fit_moe_cache.cpp is
compiled here with just a C++ compiler. The rest runs llama.cpp's own tools of the patched CPU build on SIM devices
with little memory (GGML_SIM_MEMORY_MIB, a value per device): the plan and its log line, the cache capped at the
room, the memory breakdown at exit (free memory at least the target), two devices of unequal memory, llama-bench's
tests in one process, and the same bytes as master with every weight on the CPU (perplexity log-probs, greedy text).
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyllama_moe.paths import PROJECT_ROOT

from fit_tools import TARGET_MIB, corpus, fit_args, free_at_exit, generate, model, prompt, run_tool  # noqa: F401 (fixtures)

SOURCES = [PROJECT_ROOT / "native" / "common" / "fit-moe-cache.cpp", PROJECT_ROOT / "tests" / "native" / "test_fit_moe_cache.cpp"]
# SIM0 at 96 MiB: the 91 MB model's dense part and compute (~25 MiB with the experts on the host), its staging (4 x the
# 4.25 MiB expert tensor) and the target leave ~38 MiB of room, above the least cache (4 of 32 slots in 6 layers,
# ~10 MiB) and below the experts (80 MiB)
SIM = {"GGML_SIM_DEVICES": "1", "GGML_SIM_MEMORY_MIB": "96", "GGML_SCHED_PREFETCH": "2",
       "GGML_SCHED_PREFETCH_HEADROOM_MIB": "4"}
PLAN = "common_fit_moe_cache: "


def _cases() -> list[str]:
    return re.findall(r'^\s*\{ "([a-z0-9-]+)",\s+\w+ \},$', SOURCES[1].read_text(), re.M)


CASES = _cases()


@pytest.fixture(scope="module")
def decide(tmp_path_factory):
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("fit") / "test_fit_moe_cache"
    subprocess.run([cxx, "-std=c++17", "-Wall", "-Wextra", "-Werror", "-I", str(SOURCES[0].parent), *map(str, SOURCES),
                    "-o", str(out)], check=True)
    return out


def test_case_list_is_read():
    # the parametrisation reads main()'s table: a pattern that stopped matching would test nothing
    assert len(CASES) >= 9 and "two-devices-one-short" in CASES


@pytest.mark.parametrize("case", CASES)
def test_decision(decide, case):
    got = subprocess.run([str(decide), case], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0 and got.stdout.strip() == f"ok {case}", got.stdout + got.stderr


def test_fit_gives_the_room_to_the_cache_and_keeps_the_target(patched_build, model, prompt):
    text, log = generate(patched_build, model, prompt, SIM, *fit_args("--moe-cache-mib", "1000"))
    plan = next(line for line in log.splitlines() if PLAN in line and "getting" not in line)
    assert "every MoE layer's experts on the host, the expert cache takes the room" in plan, plan
    cap = int(re.search(r"SIM0 (\d+) MiB of cache \((\d+) MiB of staging", plan).group(1))
    assert re.search(rf"expert cache on SIM0: {cap} MiB of the 1000 MiB asked, the room --fit left it", log), log[-3000:]
    assert re.search(r"expert cache on SIM0: [0-9.]+ MiB, 6 MoE layers with their experts on the host", log)
    assert "host-weight prefetch on" in log  # the staging the plan kept room for was allocated
    assert free_at_exit(log)["SIM0"] >= TARGET_MIB, free_at_exit(log)
    hits = re.search(r"expert cache, decode: \d+ layer steps, (\d+) hits", log)
    assert hits and int(hits.group(1)) > 0


def test_a_budget_below_the_room_leaves_the_rest_to_layers(patched_build, model, prompt):
    _, log = generate(patched_build, model, prompt, SIM, *fit_args("--moe-cache-mib", "12"))
    assert "expert cache first, then whole layers: the budget is less than the room; SIM0 12 MiB of cache" in log
    # some layers' experts went to the device: fewer than 6 cached layers
    n_layers = int(re.search(r"expert cache on SIM0: [0-9.]+ MiB, (\d+) MoE layers", log).group(1))
    assert 0 < n_layers < 6
    assert free_at_exit(log)["SIM0"] >= TARGET_MIB


def test_no_room_for_the_least_cache_places_layers_and_no_cache(patched_build, model, prompt):
    _, log = generate(patched_build, model, prompt, {**SIM, "GGML_SIM_MEMORY_MIB": "56"}, *fit_args("--moe-cache-mib", "1000"))
    plan = next(line for line in log.splitlines() if PLAN in line and "getting" not in line)
    assert "expert cache off, layers placed as without it" in plan and "below the" in plan, plan
    assert "no expert cache on SIM0: --fit left it no room" in log


def test_two_devices_of_unequal_memory_each_keep_their_target(patched_build, model, prompt):
    env = {**SIM, "GGML_SIM_DEVICES": "2", "GGML_SIM_MEMORY_MIB": "80,56"}
    _, log = generate(patched_build, model, prompt, env, *fit_args("--moe-cache-mib", "1000"))
    plan = next(line for line in log.splitlines() if PLAN in line and "getting" not in line)
    caps = {d: int(c) for d, c in re.findall(r"(SIM\d) (\d+) MiB of cache", plan)}
    assert set(caps) == {"SIM0", "SIM1"} and caps["SIM0"] != caps["SIM1"], plan
    for dev, cap in caps.items():
        assert re.search(rf"expert cache on {dev}: {cap} MiB of the 1000 MiB asked", log), dev
    free = free_at_exit(log)
    assert free["SIM0"] >= TARGET_MIB and free["SIM1"] >= TARGET_MIB, free


def test_llama_bench_fits_each_test_with_its_own_budget(patched_build, model):
    # -mcm 0 first: its fit must not leave a cap or a budget behind for the second test, whose fit sizes its cache
    # (the prefetch and cache settings are applied before the fit)
    out = run_tool(patched_build, "llama-bench", ["-m", str(model), "-p", "0", "-n", "16", "-r", "1", "-t", "2", "-fitt",
                                               str(TARGET_MIB), "-mcm", "0,1000", "-o", "json"], SIM)
    rows, _ = json.JSONDecoder().raw_decode(out[out.index("["):])
    by_budget = {r["moe_cache_mib"]: r for r in rows}
    assert set(by_budget) == {0, 1000}
    assert not by_budget[0].get("samples_moe_cache_hit_rate")
    assert by_budget[1000].get("samples_moe_cache_hit_rate"), by_budget[1000]


def test_fitted_runs_compute_what_master_computes(patched_build, master_build, src, model, corpus, prompt, tmp_path):
    """The fitted placement (every expert on the host, a cache on SIM) against master with every weight on the CPU:
    llama-perplexity with --fit writes the same log-probs (prompt ubatches read residents from the banks); the decode
    path under the plan's placement and cap (what --fit sets: --cpu-moe and the cap of the log line), through the
    worker, gives the same logits at every step. The tools' generated text is not compared: their logger is
    asynchronous and may drop its last lines under load (harness/compare.py)."""
    from pyllama_moe.harness import runner

    common = ["-m", str(model), "-f", str(corpus), "-c", "256", "-b", "256", "-ub", "256", "--chunks", "3", "-t", "2",
              "--no-warmup"]
    run_tool(master_build, "llama-perplexity", [*common, "--fit", "off", "-ngl", "0", "--kl-divergence-base",
                                             str(tmp_path / "master.kld")], {})
    log = run_tool(patched_build, "llama-perplexity", [*common, *fit_args("--moe-cache-mib", "1000"), "--kl-divergence-base",
                                                    str(tmp_path / "fit.kld")], SIM)
    plan = next(line for line in log.splitlines() if PLAN in line and "getting" not in line)
    assert "every MoE layer's experts on the host" in plan, plan
    assert (tmp_path / "master.kld").read_bytes() == (tmp_path / "fit.kld").read_bytes()
    cap = int(re.search(r"SIM0 (\d+) MiB of cache", plan).group(1))
    tokens = [(i * 7919) % 3900 + 16 for i in range(300)]  # the model has 4000 tokens
    common_spec = dict(model=model, tokens=tokens, repack=False, threads=2, generate=24, n_ubatch=256)
    base = runner.run(master_build, src, runner.RunSpec(n_gpu_layers=0, **common_spec))
    fitted = runner.run(patched_build, src, runner.RunSpec(
        cpu_moe=True, contexts=1, moe_cache_caps={"SIM0": cap}, stats=True,
        env={**SIM, "LLAMA_MOE_CACHE_MIB": "1000"}, **common_spec))
    assert "decode looks up its slots" in fitted.log and fitted.stats["generate"]["cache_decode"]["n_hits"] > 0
    assert fitted.generated == base.generated and fitted.decode_logits_sha256 == base.decode_logits_sha256
    assert fitted.logits_sha256 == base.logits_sha256


# --- the cold read's findings, each a case that failed before its fix (results/fit.md, "The cold read of `--fit` with the cache") ---

def test_a_second_context_keeps_the_cache_margin_under_a_cap(patched_build, src):
    """The room --fit plans is for one cache: the first cache on the device takes its cap with no margin of its own,
    a second context's cache keeps the cache's 512 MiB margin too (before: it took the cap again, down to 0 free)."""
    from pyllama_moe.harness import models, runner
    from pyllama_moe.harness.matrix import load_matrix
    from pyllama_moe.paths import CI_DIR

    tiny = models.ensure_model("qwen3moe", load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"])
    spec = runner.RunSpec(model=tiny, tokens=[(i * 7919) % 4000 + 16 for i in range(40)], cpu_moe=True, load_mode="mmap",
                          repack=False, threads=2, generate=8, stats=True, want_logits=False, contexts=2,
                          moe_cache_caps={"SIM0": 2},
                          env={"GGML_SIM_DEVICES": "1", "GGML_SIM_MEMORY_MIB": "64", "LLAMA_MOE_CACHE_MIB": "1000"})
    got = runner.run(patched_build, src, spec)
    assert got.log.count("expert cache on SIM0: 2 MiB of the 1000 MiB asked, the room --fit left it") == 2
    sizes = sorted(ctx["stats"].get("cache_bytes", 0) for ctx in got.contexts)
    # 64 MiB hold the model and both contexts, but not 512 MiB more: only the first context has a cache
    assert sizes[0] == 0 and sizes[1] > 0, sizes
    assert "less a 512 MiB margin" in got.log


def test_several_devices_that_hold_every_weight_together_plan_no_cache(patched_build, model, prompt):
    """Two devices each short of its default share but together holding every weight: --fit's layers put every expert
    on a device, which no cache beats (before: every expert went to the host for a cache)."""
    env = {**SIM, "GGML_SIM_DEVICES": "2", "GGML_SIM_MEMORY_MIB": "75,75"}
    _, log = generate(patched_build, model, prompt, env, *fit_args("--moe-cache-mib", "1000"))
    assert "expert cache not planned: whole layers fit every expert on the devices together" in log
    assert "MiB of the 1000 MiB asked" not in log


def test_the_plan_keeps_the_prefetch_headroom_free(patched_build, model, prompt):
    """A target below the scheduler's prefetch headroom: the plan keeps the headroom free beside the staging, so the
    staging it planned is allocated whole (before: the arena was halved, then dropped, its room left idle)."""
    _, log = generate(patched_build, model, prompt, {**SIM, "GGML_SCHED_PREFETCH_HEADROOM_MIB": "24"},
                       *fit_args("--moe-cache-mib", "1000"))
    assert "every MoE layer's experts on the host" in log
    assert "host-weight prefetch on SIM0: staging arena 17.00 MiB" in log
    assert "reduced to" not in log and "host-weight prefetch disabled" not in log
    assert free_at_exit(log)["SIM0"] >= 24
