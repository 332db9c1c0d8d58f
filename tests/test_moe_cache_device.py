"""The expert cache's decode on the device, on SIM: the lookup and the fills of the misses run as graph ops
(GGML_OP_MOE_CACHE_LOOKUP, GGML_OP_MOE_CACHE_FILL), with no routing read back, and compute what the host-side plan
and the host weights compute; the slot state goes back and forth between the planner and the device; where the
device cannot read the host experts in place decode keeps the host-side plan and the context says why."""
from __future__ import annotations

import json
import re

import pytest

from pyllama_moe.harness import models, runner
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR

SIM_ENV = {"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1", "GGML_SIM_COPY_LATENCY_US": "50"}
TOKENS = [(i * 7919) % 4000 + 16 for i in range(40)]
N_GEN = 48
ON_DEVICE = "expert cache on SIM0: decode looks up its slots and fills its misses on the device"
SUMMARY = re.compile(r"expert cache, decode: (\d+) layer steps, (\d+) hits, (\d+) misses")


@pytest.fixture(scope="module")
def model():
    return models.ensure_model("qwen3moe", load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"])


def _run(build, src, model, env, cpu_moe=True, load_mode="none", tokens=TOKENS, generate=N_GEN, lookup_callback=None):
    spec = runner.RunSpec(model=model, tokens=tokens, cpu_moe=cpu_moe, load_mode=load_mode, repack=False, threads=2,
                          generate=generate, stats=True, env={**SIM_ENV, **env}, lookup_callback=lookup_callback)
    return runner.run(build, src, spec)


@pytest.fixture(scope="module")
def reference(patched_build, src, model):
    return _run(patched_build, src, model, {"LLAMA_MOE_CACHE_MIB": "0"})


@pytest.fixture(scope="module")
def host_plan(patched_build, src, model):
    return _run(patched_build, src, model, {"LLAMA_MOE_CACHE_MIB": "2", "LLAMA_MOE_CACHE_DEVICE": "0"})


@pytest.mark.parametrize("load_mode", ["none", "mmap"])
def test_decode_on_the_device_computes_what_the_host_plan_does(patched_build, src, model, reference, host_plan, load_mode):
    got = _run(patched_build, src, model, {"LLAMA_MOE_CACHE_MIB": "2"}, load_mode=load_mode)
    assert ON_DEVICE in got.log
    assert got.generated == reference.generated and got.decode_logits_sha256 == reference.decode_logits_sha256
    assert got.logits_sha256 == reference.logits_sha256
    dev, host = got.stats["generate"]["cache_decode"], host_plan.stats["generate"]["cache_decode"]
    # the same lookup on the same routing: the device's counters, read back at the end, are the host plan's; the
    # device moves its fills in the graph, so it makes no copy calls
    for key in ("n_ubatches", "n_hits", "n_misses", "n_fills", "n_evictions", "bytes_uploaded"):
        assert dev[key] == host[key], key
    assert dev["n_misses"] > 0 and dev["n_evictions"] > 0 and dev["n_ubatches"] >= 4 * (N_GEN - 1)
    assert dev["n_copy_calls"] == 0 and host["n_copy_calls"] > 0
    steps, hits, misses = map(int, SUMMARY.search(got.log).groups())
    assert (steps, hits, misses) == (dev["n_ubatches"], dev["n_hits"], dev["n_misses"])
    # every decode step after the prompt looked up on the device, and the summary says how many
    assert f"{4 * (N_GEN - 1)} looked up on the device" in got.log
    assert re.search(r", 0 looked up on the device,", host_plan.log)


def test_the_fills_read_the_host_experts_where_they_are(patched_build, src, model, reference, tmp_path):
    # the fill's host experts are a source flagged GGML_TENSOR_FLAG_READ_IN_PLACE: the scheduler leaves them in host
    # memory for a device that reads host memory in place. Copied like any other source, every decode graph would move
    # each cached layer's whole expert tensors into the device (the SIM op log names such copies after the source)
    log = tmp_path / "ops.jsonl"
    got = _run(patched_build, src, model, {"LLAMA_MOE_CACHE_MIB": "2", "GGML_SIM_OPLOG": str(log)})
    assert ON_DEVICE in got.log and got.decode_logits_sha256 == reference.decode_logits_sha256
    assert got.stats["generate"]["cache_decode"]["n_misses"] > 0
    ops = [json.loads(line) for line in log.read_text().splitlines()]
    copied = sorted({op["tensor"] for op in ops if "(read in place)" in op.get("tensor", "")})
    assert copied == [], copied[:4]
    # the op log does name the cache's decode graphs' work, so the check above looked where the copies would be
    assert any(op["op"] == "compute" for op in ops) and any("_exps" in op.get("tensor", "") for op in ops)


def test_no_host_round_trip_per_layer(patched_build, src, model, reference, host_plan):
    # host synchronizations per decoded token: the host plan waits in every cached layer (4); the device lookup no
    # more than all on the device plus one
    on_device = _run(patched_build, src, model, {"LLAMA_MOE_CACHE_MIB": "2"})
    all_on_device = _run(patched_build, src, model, {"LLAMA_MOE_CACHE_MIB": "0"}, cpu_moe=False)

    def per_token(res):
        gen = res.stats["generate"]
        return gen["n_host_syncs"] / max(gen["n_graph_computes"], 1)

    assert per_token(on_device) <= per_token(all_on_device) + 1
    assert per_token(host_plan) >= per_token(all_on_device) + 4
    assert on_device.generated == all_on_device.generated


def test_the_state_goes_back_and_forth_between_prompts_and_decode(patched_build, src, model):
    # prompt, decode, a second prompt on the same context (the memory cleared), decode again: the second prompt's
    # staging reads the state the device left (read back first), the second decode uploads what the prompt made of it
    env = {"LLAMA_MOE_CACHE_MIB": "2", "GGML_SCHED_PREFETCH": "2"}
    tokens = [(i * 131) % 4000 + 16 for i in range(300)]
    spec = dict(model=model, tokens=tokens, cpu_moe=True, load_mode="none", repack=False, threads=2, generate=16,
                stats=True, n_ubatch=128, warm_tokens=[(i * 37) % 4000 + 16 for i in range(24)])
    got = runner.run(patched_build, src, runner.RunSpec(**spec, env={**SIM_ENV, **env}))
    want = runner.run(patched_build, src, runner.RunSpec(**spec, env={**SIM_ENV, "LLAMA_MOE_CACHE_MIB": "0",
                                                                         "GGML_SCHED_PREFETCH": "2"}))
    assert ON_DEVICE in got.log and "ggml_sim: race" not in got.log
    assert got.generated == want.generated and got.decode_logits_sha256 == want.decode_logits_sha256
    assert got.logits_sha256 == want.logits_sha256
    prompts = got.stats["generate"]["cache_prompt"]
    assert prompts["n_hits"] > 0  # the prompt read experts the warm-up decode made resident on the device


@pytest.mark.parametrize("env, why", [
    ({"LLAMA_MOE_CACHE_DEVICE": "0"}, "LLAMA_MOE_CACHE_DEVICE=0"),
    ({"GGML_SIM_HOST_NO_MAPPED": "1"}, "its host experts are not page-locked where the device can read them"),
])
def test_where_the_device_cannot_look_up_decode_plans_on_the_host_and_says_why(patched_build, src, model, reference,
                                                                                 env, why):
    got = _run(patched_build, src, model, {"LLAMA_MOE_CACHE_MIB": "2", **env})
    assert ON_DEVICE not in got.log
    assert f"decode plans 4 of 4 layers on the host (a synchronization per layer): {why}" in got.log
    assert got.generated == reference.generated and got.decode_logits_sha256 == reference.decode_logits_sha256
    assert got.stats["generate"]["cache_decode"]["n_copy_calls"] > 0


def test_a_stale_slot_on_the_device_changes_the_decode(patched_build, src, model, reference):
    got = _run(patched_build, src, model, {"LLAMA_MOE_CACHE_MIB": "2", "LLAMA_MOE_CACHE_DEBUG_SKIP_FILL": "1"})
    assert ON_DEVICE in got.log
    assert got.logits_sha256 == reference.logits_sha256  # the prompt's 40 rows take the host path
    assert got.decode_logits_sha256 != reference.decode_logits_sha256


def test_a_batch_of_several_tokens_looks_up_on_the_device_too(patched_build, src, model):
    # a 3-token prompt is a decode-size graph (<= LLAMA_MOE_CACHE_DECODE_MAX): at 5 MiB (12-13 of 16 slots) its 12
    # routed ids fit every layer's slots, so all its layers look up on the device, 3 tokens at a time (what parallel
    # sequences and drafts send), and its logits are the reference's
    tokens = [100, 200, 300]
    ref = _run(patched_build, src, model, {"LLAMA_MOE_CACHE_MIB": "0"}, tokens=tokens, generate=8)
    got = _run(patched_build, src, model, {"LLAMA_MOE_CACHE_MIB": "5"}, tokens=tokens, generate=8)
    assert ON_DEVICE in got.log and "12-13 of 16 expert slots" in got.log
    assert got.logits_sha256 == ref.logits_sha256
    assert got.generated == ref.generated and got.decode_logits_sha256 == ref.decode_logits_sha256
    decode = got.stats["generate"]["cache_decode"]
    assert decode["n_overflow"] == 0 and decode["n_copy_calls"] == 0 and decode["n_misses"] > 0
    # the prompt's step (up to 12 distinct experts a layer) and the 7 single-token steps after it
    assert decode["n_ubatches"] == 4 * 8 and decode["n_hits"] + decode["n_misses"] > 4 * 4 * 8


# 4 cached layers, one lookup each per decoded token; the 40-token prompt is above the decode threshold (no lookup):
# the 22nd lookup is the second cached layer's (layer 1) of the 6th decode step (step 5)
STOP_AT = 4 * 5 + 2
STOPPED = "an eval callback stopped a graph whose expert cache lookups run on the device: the cache starts empty again"


@pytest.mark.parametrize("keep_stopped", [False, True], ids=["fixed", "planted-keep-stopped"])
def test_a_callback_that_stops_a_graph_after_a_lookup_leaves_no_stale_slot(patched_build, src, model, reference,
                                                                           keep_stopped):
    # the callback stops the graph right after a lookup, before its layer's fills: the state says the misses are
    # resident, their slots hold other bytes. The worker decodes that token again (its KV entries forgotten); the
    # cache must start empty for it, so the decode computes the reference's logits. The planted knob keeps the
    # stopped lookup's state: the redo hits the unfilled slots, and the decode differs (the test can fail).
    env = {"LLAMA_MOE_CACHE_MIB": "2", **({"LLAMA_MOE_CACHE_DEBUG_KEEP_STOPPED": "1"} if keep_stopped else {})}
    got = _run(patched_build, src, model, env, lookup_callback={"stop_at": STOP_AT})
    assert ON_DEVICE in got.log
    assert got.lookup_callback["stopped_at_step"] == 5 and got.lookup_callback["lookups"] > 4 * (N_GEN - 1)
    if keep_stopped:
        assert "LLAMA_MOE_CACHE_DEBUG_KEEP_STOPPED=1" in got.log and STOPPED not in got.log
        assert got.decode_logits_sha256 != reference.decode_logits_sha256
    else:
        assert got.log.count(STOPPED) == 1
        assert got.generated == reference.generated and got.decode_logits_sha256 == reference.decode_logits_sha256


def test_reading_the_counters_from_a_callback_while_a_graph_runs_changes_nothing(patched_build, src, model, reference,
                                                                                 host_plan):
    # a metrics reader in the middle of a graph (here: the eval callback at every lookup) reads the counters the
    # device lookups left so far; it must not hand the slot state over (the graph's later lookups would then be
    # overwritten by an older state at the next graph)
    got = _run(patched_build, src, model, {"LLAMA_MOE_CACHE_MIB": "2"}, lookup_callback={"read_counters": True})
    assert ON_DEVICE in got.log and got.lookup_callback["lookups"] == 4 * (N_GEN - 1)
    assert got.generated == reference.generated and got.decode_logits_sha256 == reference.decode_logits_sha256
    dev, host = got.stats["generate"]["cache_decode"], host_plan.stats["generate"]["cache_decode"]
    for key in ("n_ubatches", "n_hits", "n_misses", "n_fills", "n_evictions"):
        assert dev[key] == host[key], key


def test_a_stop_in_a_graph_that_mixes_device_lookups_and_host_plans_leaves_no_stale_slot(patched_build, src, model,
                                                                                         reference):
    # mmap'ed experts pinned for part of the model only (a pin budget): the layers whose experts are page-locked look
    # up on the device, the others plan on the host, in one decode graph. The scheduler then calls the cache's own
    # eval callback, which must notice the user's stop after a device lookup as the device-only graph's does
    env = {"LLAMA_MOE_CACHE_MIB": "2", "LLAMA_MOE_PIN_BUDGET_MIB": "3"}
    got = _run(patched_build, src, model, env, load_mode="mmap", lookup_callback={"stop_at": 2 * 5 + 1})
    mixed = re.search(r"decode plans (\d) of 4 layers on the host", got.log)
    assert mixed and 0 < int(mixed.group(1)) < 4, got.log[-3000:]
    assert got.lookup_callback["stopped_at_step"] is not None
    assert got.log.count(STOPPED) == 1
    assert got.generated == reference.generated and got.decode_logits_sha256 == reference.decode_logits_sha256


# Where filling whole meets the device lookup: a cache whose first layers have a slot per expert and whose
# last ones one slot fewer (the sizing hands the remainder out in layer order). The tiny qwen3moe with 12 layers:
# 19 MiB gives 190 of its 192 expert slots, so layers 0-9 are filled whole and layers 10-11 look up on the device
DEEP_LAYERS, DEEP_MIB = 12, 19
FILLED_WHOLE = re.compile(r"expert cache: (\d+) layers? with a slot per expert filled whole")


@pytest.fixture(scope="module")
def deep_model():
    return models.ensure_model("qwen3moe-12", {**load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"],
                                               "layers": DEEP_LAYERS})


def test_a_stop_after_a_lookup_keeps_the_layers_filled_whole(patched_build, src, deep_model):
    # the stop empties the layers that look up on the device (their fills may not have run); the layers filled whole
    # ran no lookup and no fill, so they stay as they are: not uploaded again (before the fix: all 10 again, a second
    # "filled whole" line), and the decode still computes the reference's logits
    reference = _run(patched_build, src, deep_model, {"LLAMA_MOE_CACHE_MIB": "0"})
    got = _run(patched_build, src, deep_model, {"LLAMA_MOE_CACHE_MIB": str(DEEP_MIB)}, lookup_callback={"stop_at": 2 * 5 + 1})
    assert "10-16 of 16 expert slots" not in got.log and re.search(r"15-16 of 16 expert slots", got.log), got.log[-3000:]
    assert [int(n) for n in FILLED_WHOLE.findall(got.log)] == [10]
    assert got.lookup_callback["stopped_at_step"] == 5
    assert got.log.count(STOPPED + " (but for the layers filled whole)") == 1
    assert got.generated == reference.generated and got.decode_logits_sha256 == reference.decode_logits_sha256
    d = got.stats["generate"]["cache_decode"]
    # the whole layers' steps, all read in place; the other two layers' steps looked up
    assert d["n_in_place"] > 0 and d["n_misses"] > 0



def test_a_device_without_the_lookup_ops_keeps_the_host_plan_for_its_group_alone(patched_build, src, model):
    # two SIM devices (llama.cpp places 3 of the 4 layers on SIM0, 1 and the output on SIM1), the
    # experts on the host, the cache on both at 2 MiB: SIM0's layers 6-7 slots each, SIM1's one layer 16, filled as
    # routed (else it would be read in place and never looked up). SIM0 lacks the lookup ops (GGML_SIM_NO_CACHE_OPS=0,
    # as a backend without them). Each device has its own group: SIM0's layers keep the host-side plan, SIM1's looks
    # up on the device, each logged once with the reason, and the decode computes what the cache off does on the same
    # two devices
    two = {"GGML_SIM_DEVICES": "2"}
    reference = _run(patched_build, src, model, {**two, "LLAMA_MOE_CACHE_MIB": "0"})
    got = _run(patched_build, src, model, {**two, "LLAMA_MOE_CACHE_MIB": "2", "GGML_SIM_NO_CACHE_OPS": "0",
                                           "LLAMA_MOE_CACHE_FILL_WHOLE": "0"})
    assert "GGML_SIM_NO_CACHE_OPS: SIM0 lacks the expert cache's lookup ops" in got.log
    assert "expert cache on SIM1: decode looks up its slots and fills its misses on the device" in got.log
    assert "expert cache on SIM0: decode looks up" not in got.log
    host = re.findall(r"expert cache on SIM0: decode plans (\d) of (\d) layers on the host \(a synchronization per layer\): "
                      r"its backend lacks the lookup ops", got.log)
    assert host == [("3", "3")], got.log[-3000:]
    assert re.search(r"expert cache on SIM0: [0-9.]+ MiB, 3 MoE layers .*, 6-7 of 16 expert slots", got.log)
    assert re.search(r"expert cache on SIM1: [0-9.]+ MiB, 1 MoE layers .*, 16-16 of 16 expert slots", got.log)
    assert got.generated == reference.generated and got.decode_logits_sha256 == reference.decode_logits_sha256
    assert got.logits_sha256 == reference.logits_sha256
    # every decode step of SIM0's layers planned on the host, SIM1's looked up on the device until its layer was whole
    d = got.stats["generate"]["cache_decode"]
    assert d["n_ubatches"] == 4 * (N_GEN - 1) and d["n_misses"] > 0
    looked_up = int(re.search(r", (\d+) looked up on the device,", got.log).group(1))
    assert 0 < looked_up <= N_GEN - 1 and d["n_copy_calls"] > 0  # the host plan uploads with copies
