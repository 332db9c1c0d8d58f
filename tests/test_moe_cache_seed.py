"""Seeding the expert cache at a prompt's end, on SIM: the last ubatch of a decode call that
uploads its experts ahead reads each cached layer's routing back and copies the experts of the highest scores from
the staged copies into the slots, so that the first decode tokens hit. The logits are those of the cache off in
every case; what changes is what is resident, and it shows in the counters.

The model is the matrix's tiny qwen3moe with a strong routing skew (a few experts take most tokens, as in real
MoE models), so that which experts are resident after a prompt matters. The cache of 2 MiB holds a few of the 16
experts of each layer: the prompt's admits without routing fill the slots in expert order, the seed replaces them."""
from __future__ import annotations


import pytest

from pyllama_moe.build.ffi import decode_hit_rate
from pyllama_moe.harness import models, runner
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR

# GGML_SCHED_PREFETCH=2: SIM devices upload ahead (the default mode is for CUDA-family devices alone)
SIM_ENV = {"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1", "GGML_SIM_COPY_LATENCY_US": "50", "GGML_SCHED_PREFETCH": "2"}
PROMPT = [(i * 7919) % 4000 + 16 for i in range(512)]
UBATCH = 128  # the prefetch's min batch: 4 prompt ubatches, each uploading ahead
N_LAYERS = 4  # the tiny qwen3moe of ci/matrix.toml
CACHE_MIB = 2


@pytest.fixture(scope="module")
def model():
    definition = {**load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"], "skew": 2.0}
    return models.ensure_model("qwen3moe-skew2", definition)


def _run(build, src, model, cache_mib: int = CACHE_MIB, env=None, **spec):
    """The prompt at ub 128 in one decode call, then 4 generated tokens (3 decode steps: after 16 the unseeded cache
    has caught up, at ~0.78 hits on this model); spec: other RunSpec fields."""
    fields = dict(model=model, tokens=PROMPT, cpu_moe=True, load_mode="none", repack=False, threads=2, n_ubatch=UBATCH,
                  n_batch=512, generate=4, stats=True,
                  env={**SIM_ENV, "LLAMA_MOE_CACHE_MIB": str(cache_mib), **(env or {})})
    return runner.run(build, src, runner.RunSpec(**{**fields, **spec}))


def _same(a, b):
    assert a.logits_sha256 == b.logits_sha256
    assert a.generated == b.generated and a.decode_logits_sha256 == b.decode_logits_sha256


def _prompt(result):
    return result.stats["prompt"]["cache_prompt"]


def _decode_rate(result):
    """The hit rate of the generated tokens' decode steps (the prompt's own steps left out)."""
    return decode_hit_rate(result.stats["generate"]["cache_decode"], since=result.stats["prompt"]["cache_decode"])


@pytest.fixture(scope="module")
def reference(patched_build, src, model):
    return _run(patched_build, src, model, 0)


@pytest.fixture(scope="module")
def seeded(patched_build, src, model):
    return _run(patched_build, src, model)


@pytest.fixture(scope="module")
def checked(patched_build, src, model):
    # the seed check synchronizes the copy queue after the seeding graph, which would also order the seed's copies
    # before the decode that reads them: identity is shown on runs without it (`seeded`)
    return _run(patched_build, src, model, env={"LLAMA_MOE_CACHE_DEBUG_CHECK_SEED": "1"})


def _check_line(n_layers=N_LAYERS, n_differ=0):
    """The seed check's line: every slot of the seeded layers full after the prompt (5 a layer at 2 MiB)."""
    return f"seed check: {n_layers * 5} resident experts of {n_layers} seeded layers, {n_differ} differ from the host"


@pytest.fixture(scope="module")
def unseeded(patched_build, src, model):
    return _run(patched_build, src, model, env={"LLAMA_MOE_CACHE_SEED": "0"})


def test_seeding_makes_the_first_decode_tokens_hit_and_computes_the_same(seeded, unseeded, reference):
    assert "of 16 expert slots each" in seeded.log and "with a slot per expert" not in seeded.log  # a partial cache
    _same(seeded, reference)
    _same(unseeded, reference)
    # the last ubatch seeded every layer; with the seeding off nothing was, and the log says so once
    assert _prompt(seeded)["n_seeded"] > 0 and _prompt(unseeded)["n_seeded"] == 0
    assert "a prompt's end does not seed it (LLAMA_MOE_CACHE_SEED=0)" in unseeded.log
    assert f"made resident ({_prompt(seeded)['n_seeded']} by seeding)" in seeded.log
    # and the tokens after the prompt hit more often than after the admits in expert order
    assert _decode_rate(seeded) > _decode_rate(unseeded) + 0.1, (_decode_rate(seeded), _decode_rate(unseeded))


def test_the_seed_check_compares_every_seeded_slot_with_the_host(checked, seeded):
    # LLAMA_MOE_CACHE_DEBUG_CHECK_SEED=1: once the seeding graph is done, each resident slot of the seeded layers
    # against the host expert the planner says it holds
    assert _check_line() in checked.log
    assert f"seed check: {N_LAYERS * 5} resident experts of seeded layers compared with the host, 0 differ" in checked.log
    _same(checked, seeded)


def test_the_seed_check_catches_a_seeded_slot_left_stale(patched_build, src, model, seeded):
    # the planted stale slot (LLAMA_MOE_CACHE_DEBUG_SKIP_FILL counts every fill, the seed's too): the first seed fill
    # comes after the prompt's admits, and its copy is left out
    first_seed = _prompt(seeded)["n_fills"] - _prompt(seeded)["n_seeded"] + 1
    planted = _run(patched_build, src, model, env={"LLAMA_MOE_CACHE_DEBUG_CHECK_SEED": "1",
                                                  "LLAMA_MOE_CACHE_DEBUG_SKIP_FILL": str(first_seed)})
    assert _check_line(n_differ=1) in planted.log, planted.log[-3000:]
    assert "holds other bytes than expert" in planted.log


@pytest.mark.parametrize("depth", [2, 3])  # 1 is raised to 2
def test_a_short_prefetch_lookahead_still_seeds_every_layer(patched_build, src, model, reference, depth):
    # From the cold read: a layer's routing is computed in the split before its first expert matmul, where the
    # prefetch has issued the uploads of only `depth` splits ahead (gate, up and down are a split each); with a
    # lookahead below 4 the layer's later tensors are staged after the routing. Their seed copies follow their last
    # staged piece: every layer is seeded, its slots hold the experts the planner says, the bytes are the reference's
    env = {"GGML_SCHED_PREFETCH_DEPTH": str(depth), "LLAMA_MOE_CACHE_DEBUG_CHECK_SEED": "1"}
    got = _run(patched_build, src, model, env=env)
    plain = _run(patched_build, src, model, env={"GGML_SCHED_PREFETCH_DEPTH": str(depth)})
    _same(plain, reference)
    assert f"lookahead {depth} of depth {depth}" in got.log
    assert _prompt(got)["n_seeded"] > 0 and _check_line() in got.log, got.log[-3000:]


def test_calls_of_one_ubatch_each_seed_each_time(patched_build, src, model, reference):
    # n_batch == n_ubatch (llama-bench -b 512 -ub 512, a server with -b equal to -ub): every call's one ubatch uploads
    # ahead and is its call's last, so each seeds; the last seed is what decode finds
    got = _run(patched_build, src, model, n_batch=UBATCH, env={"LLAMA_MOE_CACHE_DEBUG_CHECK_SEED": "1"})
    plain = _run(patched_build, src, model, n_batch=UBATCH)
    _same(plain, reference)
    assert got.log.count(_check_line()) == len(PROMPT) // UBATCH


def test_a_prompt_tail_decoded_as_its_own_batch_keeps_the_seed(patched_build, src, model, seeded):
    # n_batch 492: the prompt comes in two decode calls, 492 tokens (ubatches 128, 128, 128, 108) and a tail of 20,
    # as llama-server sends a prompt's last tokens. The third ubatch is the last that uploads ahead and leaves less
    # than a ubatch of its call after it: it seeds; the 108 and the tail upload nothing ahead and keep the seed
    split = _run(patched_build, src, model, n_batch=492)
    ref = _run(patched_build, src, model, 0, n_batch=492)
    _same(split, ref)
    assert _prompt(split)["n_seeded"] > 0
    assert _decode_rate(split) >= _decode_rate(seeded) - 0.05, (_decode_rate(split), _decode_rate(seeded))


def test_a_seeding_ubatch_whose_last_layer_computes_no_rows(patched_build, src, model):
    # From the cold read of the first seeding: 463 tokens without logits but the last one (ubatches 128, 128, 128,
    # 79); the third seeds, and its last layer computes no rows (none of its tokens is an output): that layer has
    # no routing to read, the others are seeded
    spec = dict(tokens=PROMPT[:463], want_logits=False)
    got = _run(patched_build, src, model, **spec)
    ref = _run(patched_build, src, model, 0, **spec)
    assert got.generated == ref.generated and got.decode_logits_sha256 == ref.decode_logits_sha256
    assert _prompt(got)["n_seeded"] > 0


def test_without_uploads_ahead_nothing_seeds_and_nothing_is_spent_on_it(patched_build, src, model, reference):
    # From the cold read: GGML_SCHED_PREFETCH=0 stages nothing, so there is nothing to seed from; the graph must not
    # get the seeding's callback and its synchronizations either: the same syncs as with the seeding off
    off = {"GGML_SCHED_PREFETCH": "0"}
    got = _run(patched_build, src, model, env=off)
    base = _run(patched_build, src, model, env={**off, "LLAMA_MOE_CACHE_SEED": "0"})
    _same(got, reference)
    assert _prompt(got)["n_seeded"] == 0
    assert got.stats["prompt"]["n_host_syncs"] == base.stats["prompt"]["n_host_syncs"]
    assert "prompts do not seed it: no prompt uploads its experts ahead" in got.log


def test_seeding_costs_the_same_synchronizations_however_long_the_prompt(patched_build, src, model):
    # the seeding reads a routing back per cached layer in one ubatch of the call: its synchronizations do not grow
    # with the prompt's ubatches (4 or 8 here)
    def extra_syncs(tokens):
        on = _run(patched_build, src, model, tokens=tokens, n_batch=len(tokens))
        off = _run(patched_build, src, model, tokens=tokens, n_batch=len(tokens), env={"LLAMA_MOE_CACHE_SEED": "0"})
        assert _prompt(on)["n_seeded"] > 0
        return on.stats["prompt"]["n_host_syncs"] - off.stats["prompt"]["n_host_syncs"]

    short, long = extra_syncs(PROMPT), extra_syncs(PROMPT + PROMPT)
    assert 0 < short == long, (short, long)


@pytest.mark.build
def test_first_tokens_times_the_tokens_after_a_prompt_per_setting(patched_build, model):
    # the tool of the GPU target (first 16 tokens after a 4096-token prompt against the steady rate), small: a
    # 512-token prompt at ub 128, 4 tokens timed after it and 4 again after 8 more, a fresh cache before each prompt
    from pyllama_moe.bench import first_tokens, paced_process as paced

    spec = paced.PacedSpec(model=model, n_prompt=512, n_gen=0, n_batch=512, n_ubatch=UBATCH, n_cpu_moe=N_LAYERS,
                           n_threads=2, load_mode="none")
    env = {**SIM_ENV, "LLAMA_MOE_CACHE_MIB": str(CACHE_MIB)}
    settings = [first_tokens.parse_setting("on=LLAMA_MOE_CACHE_SEED=1"), first_tokens.parse_setting("off=LLAMA_MOE_CACHE_SEED=0")]
    for s in settings:
        s.env = {**env, **s.env}
    got = first_tokens.measure(patched_build, spec, settings, rounds=1, reps=2, first=4, warm=8)
    for s in got.values():
        assert len(s.prompt) == len(s.first) == len(s.steady) == 2 and len(s.rounds) == 1
        assert min(s.prompt + s.first + s.steady + s.first_token_ms + s.steady_token_ms) > 0
        # each token's time: four per chunk, the first of them the chunk's first token
        assert [len(c) for c in s.first_tokens_ms + s.steady_tokens_ms] == [4] * 4
        assert [c[0] for c in s.first_tokens_ms] == s.first_token_ms
        assert len(s.first_hits) == len(s.steady_hits) == 2  # the patched build's cache counters, per chunk
    # the same tokens (the driver's unseeded rand) on both: the seeded cache hits more in the chunk after the prompt
    assert sum(got["on"].first_hits) > sum(got["off"].first_hits), (got["on"].first_hits, got["off"].first_hits)
    table = first_tokens.report(got, spec, 4, 8)
    assert "| on |" in table and "| off |" in table and "(one round: no interval)" in table
    with pytest.raises(first_tokens.UserError, match="is not VAR=VALUE"):
        first_tokens.parse_setting("on=LLAMA_MOE_CACHE_SEED")


def test_a_user_callback_that_synchronizes_mid_graph_leaves_the_seed_waited_for(patched_build, src, model, reference):
    # From the cold read of the scheduler: a user's eval callback that calls llama_synchronize inside the seeding
    # graph drained the copy queues and marked them idle; the seed copies queued after it (the last layer's, issued
    # once its last staged piece is in, after the scheduler queued its last upload) were then not waited for by the
    # scheduler's later synchronizations, the seed check's among them. With 20 ms copies, a build without the fix
    # reports 4 of the 20 seeded slots differing from the host here; the fix keeps the queues counted as busy while
    # the graph computes
    env = {"GGML_SIM_COPY_LATENCY_US": "20000"}
    cb = f"ffn_moe_topk-{N_LAYERS - 1}"
    got = _run(patched_build, src, model, env={**env, "LLAMA_MOE_CACHE_DEBUG_CHECK_SEED": "1"}, sync_callback=cb)
    assert _prompt(got)["n_seeded"] > 0
    assert _check_line() in got.log, [line for line in got.log.splitlines() if "seed check" in line]
    plain = _run(patched_build, src, model, env=env, sync_callback=cb)
    _same(plain, reference)
