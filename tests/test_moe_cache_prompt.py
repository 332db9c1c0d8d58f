"""The expert cache's prompt path, on SIM: a prompt ubatch that uploads host weights ahead lets
the cache write the staged copies of its layers' experts, copying the residents from the banks and uploading only
the others, and filling free slots with what it uploaded. The computation reads the staged copies, so the logits are
those of the cache off; what moved over which path is in the prompt counters. A cache with a slot per expert holds
each expert in its own slot, and once they are all resident the graphs read the banks in place. These tests fill such
a cache as routed (LLAMA_MOE_CACHE_FILL_WHOLE=0), the path of the prompt's admits; the last one fills it whole when
made, the default."""
from __future__ import annotations

import pytest

from pyllama_moe.harness import models, runner
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR

# GGML_SCHED_PREFETCH=2: SIM devices upload ahead (the default mode is for CUDA-family devices alone). The prompt runs
# in ubatch order, the path these counts describe: layer-major order writes each layer's copies once per call
# (tests/test_layer_major.py)
SIM_ENV = {"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1", "GGML_SIM_COPY_LATENCY_US": "50", "GGML_SCHED_PREFETCH": "2",
           "LLAMA_MOE_CACHE_FILL_WHOLE": "0", "LLAMA_LAYER_MAJOR_PROMPT": "0"}
PROMPT = [(i * 7919) % 4000 + 16 for i in range(512)]
UBATCH = 128  # the prefetch's min batch: 4 prompt ubatches, each uploading ahead
N_UBATCHES = len(PROMPT) // UBATCH
N_LAYERS, N_EXPERT = 4, 16  # the tiny qwen3moe of ci/matrix.toml


@pytest.fixture(scope="module")
def model():
    return models.ensure_model("qwen3moe", load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"])


def _run(build, src, model, cache_mib: int, env=None, want_logits=True, **spec):
    """The prompt at ub 128 with 8 generated tokens, the cache at cache_mib; spec: other RunSpec fields."""
    fields = dict(model=model, tokens=PROMPT, cpu_moe=True, load_mode="none", repack=False, threads=2, n_ubatch=UBATCH,
                  n_batch=512, generate=8, stats=True, want_logits=want_logits,
                  env={**SIM_ENV, "LLAMA_MOE_CACHE_MIB": str(cache_mib), **(env or {})})
    return runner.run(build, src, runner.RunSpec(**{**fields, **spec}))


@pytest.fixture(scope="module")
def reference(patched_build, src, model):
    # the cache off, in ubatch order (SIM_ENV): every prompt ubatch uploads every expert
    return _run(patched_build, src, model, 0)


def _same(a, b):
    assert a.logits_sha256 == b.logits_sha256
    assert a.generated == b.generated and a.decode_logits_sha256 == b.decode_logits_sha256


def test_a_prompt_whose_experts_fit_uploads_each_expert_once(patched_build, src, model, reference):
    got = _run(patched_build, src, model, 8)
    assert f"4 MoE layers with their experts on the host, {N_EXPERT}-{N_EXPERT} of {N_EXPERT} expert slots" in got.log
    assert "; 4 layers with a slot per expert, read in place once resident" in got.log
    _same(got, reference)
    p = got.stats["prompt"]["cache_prompt"]
    assert p["n_ubatches"] == N_LAYERS * N_UBATCHES
    # the first ubatch uploads every expert and makes it resident, each in its own slot; with a slot per expert the
    # banks are then the experts' image, and the three ubatches after it read them in place: no plan, no copy
    assert p["n_misses"] == N_LAYERS * N_EXPERT and p["n_fills"] == N_LAYERS * N_EXPERT and p["n_evictions"] == 0
    assert p["n_hits"] == 0 and p["n_in_place"] == (N_UBATCHES - 1) * N_LAYERS
    # bytes: the uploads once, and on the device the admits alone
    assert p["bytes_uploaded"] > 0 and p["bytes_copied"] == p["bytes_uploaded"]
    # the scheduler uploaded none of the expert tensors itself, where without the cache it sent them every ubatch
    assert got.stats["prompt"]["prefetch_upload_bytes"] == 0
    assert reference.stats["prompt"]["prefetch_upload_bytes"] == N_UBATCHES * p["bytes_uploaded"]
    # and the decode after it reads every layer in place: nothing planned, nothing read back
    d = got.stats["generate"]["cache_decode"]
    assert d["n_in_place"] > 0 and d["n_in_place"] == d["n_ubatches"] and d["n_hits"] == d["n_misses"] == 0
    assert "expert cache, prompts: 16 layer steps, 0 experts read from the banks, 64 uploaded" in got.log
    assert ", 12 read in place" in got.log


def test_a_whole_cache_filled_by_decode_is_read_in_place_from_then_on(patched_build, src, model):
    # no prompt uploads ahead (ub 512 under GGML_SCHED_PREFETCH=0): the decode plan fills the slots as tokens route to
    # experts, each into its own slot, and each layer is read in place once all of its experts have come
    spec = dict(env={"GGML_SCHED_PREFETCH": "0"}, want_logits=False, tokens=PROMPT[:64], n_ubatch=512, generate=64)
    got = _run(patched_build, src, model, 8, **spec)
    ref = _run(patched_build, src, model, 0, **spec)
    assert got.generated == ref.generated and got.decode_logits_sha256 == ref.decode_logits_sha256
    d = got.stats["generate"]["cache_decode"]
    assert d["n_misses"] > 0 and d["n_evictions"] == 0 and d["n_in_place"] > 0, d
    assert d["n_fills"] <= N_LAYERS * N_EXPERT


def test_a_layer_whose_rows_nobody_reads_is_not_made_whole_by_the_prompt(patched_build, src, model):
    # only the last token an output: llama.cpp drops the last layer's rows of the first three ubatches, so only
    # layers 0-2 are staged (and made whole) by the first ubatch and read in place by the next three; the last
    # layer computes its one row of the last ubatch through the decode plan, and decode then fills it
    got = _run(patched_build, src, model, 8, want_logits=False)
    assert got.stats["prompt"]["cache_prompt"]["n_in_place"] == (N_UBATCHES - 1) * (N_LAYERS - 1)
    assert got.stats["prompt"]["cache_decode"]["n_ubatches"] == 1
    assert got.stats["generate"]["cache_decode"]["n_in_place"] > 0


def test_no_op_offload_keeps_a_prompt_on_the_cpu(patched_build, src, model):
    # From the cold read: with op offload off, prompt ubatches compute host experts on the CPU (and the reservation
    # planned so); a layer made whole earlier (here by 96 tokens decoded one at a time, then forgotten) must not move
    # them to the device. Decode-size graphs read it in place
    warm = PROMPT[:96]
    got = _run(patched_build, src, model, 8, op_offload=False, warm_tokens=warm)
    ref = _run(patched_build, src, model, 0, op_offload=False, warm_tokens=warm)
    _same(got, ref)
    assert got.stats["prompt"]["cache_prompt"]["n_in_place"] == 0
    assert got.stats["generate"]["cache_decode"]["n_in_place"] > 0
    # and with op offload on, the same warm cache is read in place by every prompt ubatch
    on = _run(patched_build, src, model, 8, warm_tokens=warm)
    assert on.stats["prompt"]["cache_prompt"]["n_in_place"] == N_UBATCHES * N_LAYERS


def test_batched_and_single_copies_compute_the_same(patched_build, src, model, reference):
    # SIM offers ggml_backend_copy_regions_async (as CUDA does, tested on its own in the hazard case copy-regions):
    # each staged piece takes at most one call for its uploads and one for its device copies; with
    # LLAMA_MOE_CACHE_COPY_BATCH=0 one call per run. A fresh cache's residents are one run per tensor (admits go to
    # free slots in expert order), so here the counts agree; the bytes and the plan must agree too. Without the seeding
    # at the prompt's end (LLAMA_MOE_CACHE_SEED=0; its copies are counted in tests/test_moe_cache_seed.py)
    batched = _run(patched_build, src, model, 2, {"LLAMA_MOE_CACHE_SEED": "0"})
    single = _run(patched_build, src, model, 2, {"LLAMA_MOE_CACHE_COPY_BATCH": "0", "LLAMA_MOE_CACHE_SEED": "0"})
    _same(batched, reference)
    _same(single, reference)
    b, s = batched.stats["prompt"]["cache_prompt"], single.stats["prompt"]["cache_prompt"]
    assert b == s
    # per layer: the first ubatch one upload run and one admit run, each later one a read run and an upload run, for
    # each of the 3 expert tensors
    assert b["n_copy_calls"] == N_LAYERS * N_UBATCHES * 3 * 2


def test_a_small_cache_keeps_its_first_residents_through_the_prompt(patched_build, src, model, reference):
    # 2 MiB: 5 of 16 slots per layer. The first ubatch fills them, no later one replaces them (a prompt ubatch routes
    # to nearly every expert: LRU would send all of them again each time). The seeding off: at the prompt's end it
    # replaces them by what the last ubatch routed (tests/test_moe_cache_seed.py)
    got = _run(patched_build, src, model, 2, {"LLAMA_MOE_CACHE_SEED": "0"})
    assert "5-5 of 16 expert slots" in got.log and "read in place once resident" not in got.log
    _same(got, reference)
    p = got.stats["prompt"]["cache_prompt"]
    assert p["n_fills"] == N_LAYERS * 5 and p["n_evictions"] == 0
    assert p["n_hits"] == (N_UBATCHES - 1) * N_LAYERS * 5
    assert p["n_misses"] == N_LAYERS * (N_EXPERT + (N_UBATCHES - 1) * (N_EXPERT - 5))
    expert_bytes = reference.stats["prompt"]["prefetch_upload_bytes"] // (N_UBATCHES * N_LAYERS * N_EXPERT)
    assert p["bytes_uploaded"] == p["n_misses"] * expert_bytes


def test_a_prompt_graph_whose_last_layer_reads_the_banks(patched_build, src, model):
    # only the last token is an output: the prompt's last ubatch computes its last layer for one row, which reads the
    # banks through the decode plan on the compute stream, while the copy queue stages the other layers' experts
    # from the same banks; the decode after it switches queues again
    ref = _run(patched_build, src, model, 0, want_logits=False)
    got = _run(patched_build, src, model, 2, want_logits=False)
    assert got.generated == ref.generated and got.decode_logits_sha256 == ref.decode_logits_sha256
    assert got.stats["prompt"]["cache_decode"]["n_ubatches"] == 1  # the last layer of the last prompt ubatch
    assert got.stats["prompt"]["cache_prompt"]["n_hits"] > 0


def test_a_stale_admit_changes_the_prompt(patched_build, src, model, reference):
    # the 3rd fill (layer 0's expert 2, admitted in the first ubatch) is never copied into its slot: the second
    # ubatch reads the slot's zeros for that expert, and the prompt's logits must change
    got = _run(patched_build, src, model, 8, {"LLAMA_MOE_CACHE_DEBUG_SKIP_FILL": "3"})
    assert got.stats["prompt"]["cache_prompt"]["n_in_place"] > 0  # the later ubatches read the banks in place
    assert got.logits_sha256 != reference.logits_sha256


@pytest.fixture(scope="module")
def gpt_oss():
    return models.ensure_model("gpt-oss", load_matrix(CI_DIR / "matrix.toml").models["gpt-oss"])


def test_a_layer_staged_in_part_keeps_no_admit(patched_build, src, gpt_oss):
    # From the cold read: a plan admits experts for every tensor of a layer, but only the staged tensors get bytes.
    # With ops offloaded from 200 rows, gpt-oss's expert matmuls of a 128-token ubatch stay on the CPU while the
    # bias adds (4 x 128 rows) go to SIM: only the biases are staged through the cache. Their admits must be taken
    # back, else decode reads weight slots that were never written.
    # Without masked ids on SIM: with them, a graph below the offload batch is computed hot/cold instead of staged
    env = {"GGML_OP_OFFLOAD_MIN_BATCH": "200", "GGML_SIM_NO_MASKED_IDS": "1"}
    ref = _run(patched_build, src, gpt_oss, 0, env)
    got = _run(patched_build, src, gpt_oss, 8, env)
    assert "expert cache on SIM0" in got.log
    assert got.stats["prompt"]["cache_prompt"]["n_ubatches"] > 0  # the biases were staged through the cache
    _same(got, ref)


def test_a_cache_with_a_slot_per_expert_filled_whole_when_made_is_read_in_place_throughout(patched_build, src, model,
                                                                                            reference):
    # the default: each layer's 16 experts copied into their slots when the cache is made, so the prompt's ubatches and
    # the decode read every layer in place from the first graph: the cache plans, stages and uploads nothing, and the
    # scheduler uploads no expert either
    whole = {"LLAMA_MOE_CACHE_FILL_WHOLE": "1"}
    got = _run(patched_build, src, model, 8, whole)
    assert "; 4 layers with a slot per expert, read in place (filled whole now)" in got.log
    assert "expert cache: 4 layers with a slot per expert filled whole, 6.38 MiB in " in got.log
    _same(got, reference)
    p, d = got.stats["prompt"]["cache_prompt"], got.stats["generate"]["cache_decode"]
    assert p["n_in_place"] == p["n_ubatches"] == N_UBATCHES * N_LAYERS
    assert p["n_misses"] == p["n_fills"] == p["bytes_uploaded"] == 0
    assert d["n_in_place"] == d["n_ubatches"] > 0 and d["n_hits"] == d["n_misses"] == 0
    assert got.stats["prompt"]["prefetch_upload_bytes"] == 0
    # the planted stale slot applies to these fills too: the 3rd (layer 0's expert 2) is left out, and the prompt's
    # logits change
    stale = _run(patched_build, src, model, 8, {**whole, "LLAMA_MOE_CACHE_DEBUG_SKIP_FILL": "3"})
    assert stale.stats["prompt"]["cache_prompt"]["n_in_place"] == N_UBATCHES * N_LAYERS
    assert stale.logits_sha256 != reference.logits_sha256
