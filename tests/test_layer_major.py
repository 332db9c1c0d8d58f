"""Layer-major prompts (docs/layer-major.md): a decode call of several ubatches runs layer group by layer group, each
group over every ubatch, with the memory rewound between groups. On the CPU and on SIM (whose device runs the CPU's
kernels) the prompt's logits, the generated tokens and the decode steps' logits are the bytes of master at the same
ubatch, for any grouping; on SIM with the experts on the host each group's experts are uploaded once per call. A
planted fault that skips the memory's restore between groups is caught, and a call stopped by the abort callback
leaves the memory as the contract says."""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from pyllama_moe.harness import models, runner
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR, PROJECT_ROOT

from ggml_program import source_dir
from llama_tools import clean_env, cli_refusal, completion

TOKENS = [(i * 7919) % 4000 + 16 for i in range(40)]  # 5 ubatches of 8
SIM_TOKENS = [(i * 7919) % 4000 + 16 for i in range(160)]  # 5 ubatches of 32: the device computes the host experts
# SIM pads quantized device rows as ggml-cuda does, so the staged copies of the experts carry padding as on CUDA
SIM_ENV = {"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1", "GGML_SCHED_PREFETCH": "2",
           "GGML_SCHED_PREFETCH_MIN_BATCH": "32", "GGML_SIM_ROW_PADDING": "512"}
CALL_LINE = re.compile(r"layer-major prompt: (\d+) tokens in (\d+) ubatches, (\d+) layer groups?: ([\d.]+) MiB of host "
                       r"weights uploaded, ([\d.]+) MiB found kept in place")
STOP = PROJECT_ROOT / "tests" / "native" / "test_layer_major_stop.cpp"


@pytest.fixture(scope="module")
def model():
    return models.ensure_model("qwen3moe", load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"])


def _cpu_spec(model, env):
    return runner.RunSpec(model=model, tokens=TOKENS, n_ubatch=8, n_batch=64, threads=2, generate=6, load_mode="none",
                          repack=False, stats=bool(env.get("_stats")), env={k: v for k, v in env.items() if k[0] != "_"})


@pytest.fixture(scope="module")
def master_cpu(master_build, src, model):
    return runner.run(master_build, src, _cpu_spec(model, {}))


def _same_bytes(got, ref):
    assert got.logits_sha256 == ref.logits_sha256
    assert got.decode_logits_sha256 == ref.decode_logits_sha256
    assert got.generated == ref.generated


@pytest.mark.parametrize("group_layers, n_groups", [(1, 4), (2, 2), (3, 2), (4, 1)])
def test_every_grouping_computes_masters_bytes_on_the_cpu(patched_build, src, model, master_cpu, group_layers, n_groups):
    got = runner.run(patched_build, src, _cpu_spec(model, {"LLAMA_LAYER_MAJOR_DEBUG_GROUP_LAYERS": str(group_layers),
                                                           "_stats": "1"}))
    _same_bytes(got, master_cpu)
    # the prompt was one call of 5 ubatches in n_groups groups; the generation's calls of one token were not
    assert got.stats["prompt"]["n_layer_major_calls"] == 1
    assert got.stats["generate"]["n_layer_major_calls"] == 1
    assert [m.groups()[:3] for m in CALL_LINE.finditer(got.log)] == [("40", "5", str(n_groups))]


def test_off_computes_in_ubatch_order(patched_build, src, model, master_cpu):
    got = runner.run(patched_build, src, _cpu_spec(model, {"LLAMA_LAYER_MAJOR_PROMPT": "0",
                                                           "LLAMA_LAYER_MAJOR_DEBUG_GROUP_LAYERS": "2", "_stats": "1"}))
    _same_bytes(got, master_cpu)
    assert got.stats["generate"]["n_layer_major_calls"] == 0
    assert not CALL_LINE.search(got.log)


def test_a_group_computed_from_a_later_memory_state_is_caught(patched_build, src, model, master_cpu):
    # the planted fault: each group after the first applies its ubatches over the cells the group before left, so a
    # ubatch attends from a state ubatch order never had
    got = runner.run(patched_build, src, _cpu_spec(model, {"LLAMA_LAYER_MAJOR_DEBUG_GROUP_LAYERS": "2",
                                                           "LLAMA_LAYER_MAJOR_DEBUG_NO_RESTORE": "1"}))
    assert got.logits_sha256 != master_cpu.logits_sha256


def test_a_ubatch_computed_before_the_ubatches_ahead_of_it_is_caught(patched_build, src, model, master_cpu):
    # the planted ordering fault: each ubatch of a group attends as if the group ran it before the ubatches ahead of
    # it wrote their K and V. It plants nothing in ubatch order, whose calls mark no memory state
    env = {"LLAMA_LAYER_MAJOR_DEBUG_GROUP_LAYERS": "2", "LLAMA_LAYER_MAJOR_DEBUG_EARLY_UBATCH": "1"}
    assert runner.run(patched_build, src, _cpu_spec(model, env)).logits_sha256 != master_cpu.logits_sha256
    _same_bytes(runner.run(patched_build, src, _cpu_spec(model, {**env, "LLAMA_LAYER_MAJOR_PROMPT": "0"})), master_cpu)


def _sim_run(build, src, model, env, *, tokens=SIM_TOKENS, n_ubatch=32, base_env=SIM_ENV, generate=4,
             want_logits=True, prompt_sequences=None, kv_unified=False):
    """The prompt as one decode call on SIM with every expert on the host, then `generate` tokens. want_logits False:
    the prompt outputs its last token alone, as llama-bench's and a chat's prompts do. prompt_sequences: the prompt
    cut into sequences of these lengths (runner.RunSpec)."""
    spec = runner.RunSpec(model=model, tokens=tokens, n_ubatch=n_ubatch, n_batch=max(256, len(tokens)), threads=2,
                          generate=generate, cpu_moe=True, load_mode="none", repack=False, stats=True,
                          want_logits=want_logits, env={**base_env, **env}, prompt_sequences=prompt_sequences,
                          kv_unified=kv_unified)
    return runner.run(build, src, spec)


@pytest.fixture(scope="module")
def sim_ubatch_order(patched_build, src, model):
    return _sim_run(patched_build, src, model, {"LLAMA_LAYER_MAJOR_PROMPT": "0"})


@pytest.mark.parametrize("env, n_groups", [({}, 1), ({"LLAMA_LAYER_MAJOR_GROUPS": "8"}, 4),
                                           ({"LLAMA_LAYER_MAJOR_GROUPS": "2"}, 2),
                                           ({"LLAMA_LAYER_MAJOR_STAGING_MIB": "4"}, 4),
                                           ({"LLAMA_LAYER_MAJOR_DEBUG_GROUP_LAYERS": "3"}, 2)],
                         ids=["auto-fits", "eight-groups", "two-groups", "staging-4mib", "groups-of-3"])
def test_host_experts_cross_once_per_group_on_sim(patched_build, src, model, master_cpu, sim_ubatch_order, env,
                                                  n_groups):
    got = _sim_run(patched_build, src, model, env)
    ref = sim_ubatch_order
    assert got.logits_sha256 == ref.logits_sha256
    assert got.decode_logits_sha256 == ref.decode_logits_sha256
    assert got.generated == ref.generated
    prompt, base = got.stats["prompt"], ref.stats["prompt"]
    # ubatch order uploads every host expert once per ubatch of the prompt (5); layer-major once per call, and finds
    # the copies of the 4 later ubatches in place
    assert base["prefetch_upload_bytes"] > 0 and base["prefetch_kept_bytes"] == 0
    assert prompt["layer_major_upload_bytes"] == prompt["prefetch_upload_bytes"]
    assert prompt["prefetch_upload_bytes"] * 4 < base["prefetch_upload_bytes"]
    assert prompt["prefetch_kept_bytes"] >= 3 * prompt["prefetch_upload_bytes"]
    # with more than one group, every group after the first was uploaded ahead of its graphs, while the one before ran
    assert (prompt["prefetch_staged_bytes"] > 0) == (n_groups > 1)
    calls = [m.groups() for m in CALL_LINE.finditer(got.log)]
    assert [c[:3] for c in calls] == [("160", "5", str(n_groups))]
    # the arena grown for the groups' copies goes back to the ring's size once the call is done
    assert prompt["prefetch_arena_bytes"] < prompt["prefetch_upload_bytes"]


def _stream_queues(oplog):
    """Each SIM queue's operations in the order they were queued (host synchronizations under the queue -1), without
    their times. The lines of different queues interleave as the host and the streams happen to run; each queue's own
    order is the program's."""
    queues = {}
    for line in oplog.read_text().splitlines():
        op = json.loads(line)
        queues.setdefault((op["dev"], op["inst"]), []).append((op["op"], op["tensor"], op["offset"], op["bytes"]))
    return queues


@pytest.mark.parametrize("n_tokens, same", [(32, True), (64, False)], ids=["one-ubatch", "two-ubatches"])
def test_a_one_ubatch_prompt_and_decode_queue_the_same_operations_with_the_knob_on(patched_build, src, model, tmp_path,
                                                                                   n_tokens, same):
    # The one-ubatch prompt and decode rows are to be unchanged by the knob: a call of n_ubatch tokens or fewer leaves
    # the planner before it plans, so each SIM queue gets the same uploads, copies, computes and waits in the same
    # order, and the host synchronizes as often. A prompt of two ubatches runs layer-major with the knob on (its
    # second ubatch finds the experts the first uploaded): the same comparison must see that
    def run(order):
        log = tmp_path / f"oplog-{n_tokens}-{order}.jsonl"
        got = _sim_run(patched_build, src, model, {"LLAMA_LAYER_MAJOR_PROMPT": order, "GGML_SIM_OPLOG": str(log)},
                       tokens=SIM_TOKENS[:n_tokens])
        return got, _stream_queues(log)

    (off, off_queues), (on, on_queues) = run("0"), run("1")
    assert on.logits_sha256 == off.logits_sha256
    assert on.decode_logits_sha256 == off.decode_logits_sha256 and on.generated == off.generated
    assert on.stats["prompt"]["n_layer_major_calls"] == (0 if same else 1)
    assert (on_queues == off_queues) == same


TIMES_LINE = re.compile(r"layer-major times: group (\d+) \(layers (\d+)-(\d+)\), (\d+) ubatches: .* uploaded ([\d.]+) MiB "
                        r"\(([\d.]+) staged\), ([\d.]+) MiB kept, (\d+) reallocations, (\d+) host "
                        r"synchronizations \((\d+) for uploads\) in (\d+) graphs")


def test_the_debug_times_say_each_group_before_the_last_once(patched_build, src, model, sim_ubatch_order):
    # four groups of one layer: groups 0-2 end in the loop that stages the next group's weights and are timed, the
    # last runs as ubatch order's loop. Each timed group stages the next (its uploads are all staged but the first
    # group's own), finds its copies kept in its later ubatches and reallocates nothing; the bytes stay ubatch order's
    got = _sim_run(patched_build, src, model, {"LLAMA_LAYER_MAJOR_GROUPS": "8", "LLAMA_LAYER_MAJOR_DEBUG_TIMES": "1"})
    assert got.logits_sha256 == sim_ubatch_order.logits_sha256
    lines = [m.groups() for m in TIMES_LINE.finditer(got.log)]
    assert [(g, a, b, n) for g, a, b, n, *_ in lines] == [("0", "0", "0", "5"), ("1", "1", "1", "5"), ("2", "2", "2", "5")]
    # and one line for the call: its set-up, its groups before the last, its last group
    assert len(re.findall(r"layer-major call times: from its plan, groups set up by \+[\d.]+ ms", got.log)) == 1
    for g, _, _, n, uploaded, staged, kept, reallocs, _, _, graphs in lines:
        assert float(staged) > 0 and float(kept) > 0 and reallocs == "0" and graphs == n
        assert (float(uploaded) > float(staged)) == (g == "0")


# The expert cache in the group loop: the skewed tiny qwen3moe (a few experts take most tokens, so which ones are
# resident after a prompt shows in the decode hit counts) with a 2 MiB cache, a few of each layer's 16 experts, and a
# 512-token prompt at ub 128, the prefetch's min batch: 4 ubatches, each uploading ahead
CACHE_PROMPT = [(i * 7919) % 4000 + 16 for i in range(512)]
CACHE_ENV = {"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1", "GGML_SCHED_PREFETCH": "2", "LLAMA_MOE_CACHE_MIB": "2",
             "GGML_SIM_ROW_PADDING": "512"}
PLANNER_COUNTS = ("n_ubatches", "n_fills", "n_evictions", "n_seeded")


@pytest.fixture(scope="module")
def skew_model():
    return models.ensure_model("qwen3moe-skew2", {**load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"], "skew": 2.0})


def _cache_run(build, src, model, env):
    return _sim_run(build, src, model, env, tokens=CACHE_PROMPT, n_ubatch=128, base_env=CACHE_ENV)


@pytest.fixture(scope="module")
def cache_ubatch_order(patched_build, src, skew_model):
    return _cache_run(patched_build, src, skew_model, {"LLAMA_LAYER_MAJOR_PROMPT": "0"})


@pytest.mark.parametrize("env, n_groups", [({}, 1), ({"LLAMA_LAYER_MAJOR_GROUPS": "8"}, 4),
                                           ({"LLAMA_LAYER_MAJOR_DEBUG_GROUP_LAYERS": "3"}, 2)],
                         ids=["auto-fits", "eight-groups-staged", "groups-of-3"])
def test_the_expert_cache_ends_a_layer_major_call_as_ubatch_order_does(patched_build, src, skew_model,
                                                                       cache_ubatch_order, env, n_groups):
    got, ref = _cache_run(patched_build, src, skew_model, env), cache_ubatch_order
    assert "of 16 expert slots each" in ref.log  # a partial cache: residents, admits and a seed all matter
    assert got.logits_sha256 == ref.logits_sha256
    assert got.decode_logits_sha256 == ref.decode_logits_sha256
    assert got.generated == ref.generated
    prompt, base = got.stats["prompt"], ref.stats["prompt"]
    assert [m.groups()[:3] for m in CALL_LINE.finditer(got.log)] == [("512", "4", str(n_groups))]
    # every layer was planned once per ubatch, admitted and seeded as in ubatch order, so the residents after the
    # prompt are the same: the decode steps hit and miss alike
    assert base["cache_prompt"]["n_seeded"] > 0
    assert {k: prompt["cache_prompt"][k] for k in PLANNER_COUNTS} == {k: base["cache_prompt"][k] for k in PLANNER_COUNTS}
    decode, decode_base = got.stats["generate"]["cache_decode"], ref.stats["generate"]["cache_decode"]
    assert (decode["n_hits"], decode["n_misses"]) == (decode_base["n_hits"], decode_base["n_misses"])
    # the cache wrote each layer's copies once, in the group's first ubatch (or the stage before it), when the cache
    # was still empty: every expert uploaded. Ubatch order wrote them in all 4 ubatches, the later ones reading the
    # residents the first admitted from the banks and uploading the rest
    cp, cp_base = prompt["cache_prompt"], base["cache_prompt"]
    assert cp["n_hits"] == 0 and cp["n_misses"] * 4 == cp_base["n_hits"] + cp_base["n_misses"]
    assert cp_base["bytes_uploaded"] > 3 * cp["bytes_uploaded"] > 0
    assert prompt["layer_major_upload_bytes"] == prompt["prefetch_upload_bytes"] + cp["bytes_uploaded"]


def test_a_small_tail_ubatch_keeps_the_stages_and_the_plans(patched_build, src, skew_model):
    # 552 tokens: 4 ubatches of 128 and a tail of 24, below the min batch. Its graph reads the group's kept copies (it
    # used to copy its routed experts at split time over the arena, losing the next group's stage, whose first graph
    # then wrote the copies again and planned its layers a second time); the cache plans nothing for it, as in ubatch
    # order, so the residents and counts stay ubatch order's
    tokens = CACHE_PROMPT + CACHE_PROMPT[:40]

    def run(env):
        return _sim_run(patched_build, src, skew_model, env, tokens=tokens, n_ubatch=128, base_env=CACHE_ENV)

    got, ref = run({"LLAMA_LAYER_MAJOR_GROUPS": "8"}), run({"LLAMA_LAYER_MAJOR_PROMPT": "0"})
    assert got.logits_sha256 == ref.logits_sha256 and got.generated == ref.generated
    assert [m.groups()[:3] for m in CALL_LINE.finditer(got.log)] == [("552", "5", "4")]
    prompt, base = got.stats["prompt"]["cache_prompt"], ref.stats["prompt"]["cache_prompt"]
    assert {k: prompt[k] for k in PLANNER_COUNTS} == {k: base[k] for k in PLANNER_COUNTS}
    decode, decode_base = got.stats["generate"]["cache_decode"], ref.stats["generate"]["cache_decode"]
    assert (decode["n_hits"], decode["n_misses"]) == (decode_base["n_hits"], decode_base["n_misses"])
    # every expert of the 4 layers uploaded once, by the first group and the stages: none written again
    assert (prompt["n_hits"], prompt["n_misses"]) == (0, 4 * 16)
    assert got.stats["prompt"]["prefetch_upload_bytes"] == 0


def test_a_first_ubatch_below_the_min_batch_keeps_the_staged_groups(patched_build, src, model):
    # two sequences of 8 and 40 tokens in one call, each a stream of its own: llama.cpp cuts it into a first ubatch of
    # 16 tokens (8 of each), below the min batch of 32, then the long one's other 32. Two groups of two layers: after
    # the first ubatch the next group's stage holds its first layer, and with the parts' usual order the second would
    # be left to the next group's first graph. That graph is the small one, which uploads nothing ahead and copies the
    # routed experts of a weight not in place at split time, so the rest of the stage goes at the group's end: the
    # call stages and keeps what the stage queued whole does, and computes ubatch order's logits
    def run(env):
        return _sim_run(patched_build, src, model, {"LLAMA_LAYER_MAJOR_GROUPS": "2", **env}, tokens=SIM_TOKENS[:48],
                        generate=1, prompt_sequences=[8, 40])

    base, got = run({"LLAMA_LAYER_MAJOR_PROMPT": "0"}), run({})
    whole = run({"LLAMA_LAYER_MAJOR_DEBUG_STAGE_WHOLE": "1"})
    assert got.logits_sha256 == base.logits_sha256 == whole.logits_sha256
    assert [m.groups()[:3] for m in CALL_LINE.finditer(got.log)] == [("48", "2", "2")]
    # ubatch order uploads every host expert ahead once, in its one ubatch of 32 (the one of 16 copies at split time)
    host = base.stats["prompt"]["prefetch_upload_bytes"]
    prompt, ref = got.stats["prompt"], whole.stats["prompt"]
    assert prompt["prefetch_upload_bytes"] == ref["prefetch_upload_bytes"] == host
    # the second group whole: staged during the first, found in place by its graphs
    assert prompt["prefetch_staged_bytes"] == ref["prefetch_staged_bytes"] == host // 2
    assert prompt["prefetch_kept_bytes"] == ref["prefetch_kept_bytes"] == host // 2


@pytest.mark.parametrize("n_gpu_layers, env, tail_only", [
    (99, {}, True),
    (4, {"GGML_OP_OFFLOAD_MIN_BATCH": "128"}, False),
], ids=["tail-below-32", "experts-on-the-cpu-at-64"])
def test_the_ops_after_experts_computed_on_the_cpu_run_where_ubatch_order_runs_them(patched_build, src, model, tmp_path,
                                                                                    n_gpu_layers, env, tail_only):
    # A graph's host experts are computed on the CPU where its ubatch is below the offload batch (ggml-cuda's rule,
    # which SIM follows: 32 tokens, or GGML_OP_OFFLOAD_MIN_BATCH). In the whole graph the next layer's first ops on its
    # device (its norm, pinned there for batches under 32 or a full offload; else its attn_norm's multiply, whose
    # weight is there) pull the ops after the experts (their weighting and sum, the residual) onto the device. A
    # group's graph ends before them, so its output is pinned to the next layer's device instead. Left on the CPU those
    # ops computed other bytes on CUDA; SIM computes both places with the CPU's kernels, so its op log shows where
    # they ran: the device splits that start at a layer's weighting, the same in both orders. 600 tokens at ub 64, a
    # group per layer: with every layer on the device only the tail ubatch of 24 tokens computes its experts on the
    # CPU; with -ngl 4 (layer 0 on the CPU, no full offload) and an offload batch of 128 every ubatch does
    tokens = [(i * 7919) % 4000 + 16 for i in range(600)]

    def device_splits_after_experts(order_env):
        log = tmp_path / f"oplog-{len(list(tmp_path.iterdir()))}.jsonl"
        spec = runner.RunSpec(model=model, tokens=tokens, n_ubatch=64, n_batch=1024, threads=2, generate=1,
                              cpu_moe=True, n_gpu_layers=n_gpu_layers, load_mode="none", repack=False,
                              env={"GGML_SIM_DEVICES": "1", "GGML_SCHED_PREFETCH": "2", "GGML_SIM_OPLOG": str(log),
                                   "LLAMA_LAYER_MAJOR_DEBUG_GROUP_LAYERS": "1", **env, **order_env})
        got = runner.run(patched_build, src, spec)
        ops = [json.loads(line) for line in log.read_text().splitlines()]
        return got, sorted(op["tensor"] for op in ops if op["op"] == "compute"
                           and op["tensor"].startswith("ffn_moe_weighted-"))

    base, base_splits = device_splits_after_experts({"LLAMA_LAYER_MAJOR_PROMPT": "0"})
    got, splits = device_splits_after_experts({})
    assert [m.groups()[:3] for m in CALL_LINE.finditer(got.log)] == [("600", "10", "4")]
    ubatches = 1 if tail_only else 10
    assert base_splits == sorted(f"ffn_moe_weighted-{il}" for il in range(4) for _ in range(ubatches))
    assert splits == base_splits
    assert got.logits_sha256 == base.logits_sha256


def test_a_seed_from_copies_kept_or_staged_ahead_holds_the_host_experts(patched_build, src, skew_model, cache_ubatch_order):
    # LLAMA_MOE_CACHE_DEBUG_CHECK_SEED: each seeded layer's resident slots, once its graph is done, against the host
    # experts the planner says they hold; with staged groups each group's seed reads copies written by a stage
    got = _cache_run(patched_build, src, skew_model, {"LLAMA_LAYER_MAJOR_GROUPS": "8",
                                                      "LLAMA_MOE_CACHE_DEBUG_CHECK_SEED": "1"})
    assert got.logits_sha256 == cache_ubatch_order.logits_sha256
    seeded = cache_ubatch_order.stats["prompt"]["cache_prompt"]["n_seeded"]
    assert re.search(rf"seed check: \d+ resident experts of seeded layers compared with the host, 0 differ", got.log)
    assert got.stats["prompt"]["cache_prompt"]["n_seeded"] == seeded


def test_a_group_reserves_its_graph_once_not_as_its_kv_view_grows(patched_build, src, model):
    # 1024 tokens at ub 128: the KV view grows every other ubatch. A group's graph is reserved at its largest when the
    # group starts, so its ubatches fit it; without that (the planted LLAMA_LAYER_MAJOR_DEBUG_NO_RESERVE) each group
    # reserves at its first graph and again wherever the view grew, each time waiting for every queue
    def run(env):
        return _sim_run(patched_build, src, model, {"LLAMA_LAYER_MAJOR_GROUPS": "8", **env}, n_ubatch=128, generate=2,
                        tokens=[(i * 7919) % 4000 + 16 for i in range(1024)])

    base, got = run({"LLAMA_LAYER_MAJOR_PROMPT": "0"}), run({})
    planted = run({"LLAMA_LAYER_MAJOR_DEBUG_NO_RESERVE": "1"})
    assert got.logits_sha256 == base.logits_sha256 == planted.logits_sha256
    assert [m.groups()[:3] for m in CALL_LINE.finditer(got.log)] == [("1024", "8", "4")]
    reallocs = {name: r.stats["prompt"]["n_graph_reallocs"] for name, r in
                (("ubatch order", base), ("layer-major", got), ("planted", planted))}
    # none in layer-major order: a group's graphs fit what it reserved, so a stage queued at the group's start is not
    # drained by its first graph (the explicit reservations are not counted)
    assert reallocs["layer-major"] == 0, reallocs
    assert reallocs["planted"] >= reallocs["layer-major"] + 4 * 3, reallocs  # 4 groups, 3 reservations each


def test_the_last_group_reserves_its_graph_once_when_the_prompt_outputs_its_last_token_alone(patched_build, src, model):
    # the same prompt with the last token's logits alone: every ubatch but the last drops all its rows before the last
    # layer, so the last group's graphs have other nodes than a reservation for every token's output. Reserved with
    # the outputs of the call's first ubatch (none) they fit; reserved for every output (as the context's own
    # reservation), the last group's first graph reserved again, and so did each later one whose KV view grew. The
    # last ubatch, with the prompt's last token, is reserved for at its start without waiting (on CUDA a last layer of
    # one row has other nodes than one of none: its fusions differ)
    def run(env):
        return _sim_run(patched_build, src, model, {"LLAMA_LAYER_MAJOR_GROUPS": "8", **env}, n_ubatch=128, generate=2,
                        tokens=[(i * 7919) % 4000 + 16 for i in range(1024)], want_logits=False)

    base, got = run({"LLAMA_LAYER_MAJOR_PROMPT": "0"}), run({})
    assert got.generated == base.generated
    assert got.decode_logits_sha256 == base.decode_logits_sha256
    assert [m.groups()[:3] for m in CALL_LINE.finditer(got.log)] == [("1024", "8", "4")]
    assert got.stats["prompt"]["n_graph_reallocs"] == 0, got.stats["prompt"]
    # groups 1 and 2 at their starts, the last group at its start and again for its last ubatch
    assert got.stats["prompt"]["n_reserves_in_place"] == 4, got.stats["prompt"]
    # ubatch order pays what the last group did: its graphs reserve again as the view grows (4 of 8 ubatches here)
    assert base.stats["prompt"]["n_graph_reallocs"] >= 4, base.stats["prompt"]


def test_a_group_is_reserved_and_staged_while_the_group_before_still_computes(patched_build, src, model):
    # the device is slow here (SIM waits 3 ms before each compute), so the host reaches a group's start while the group
    # before still computes. The group's graph and the last group's graph (its layers and the output head) are reserved
    # without waiting (the compute buffers hold them), and the stage of the group after next, which overwrites the
    # region the group before reads, begins with a wait on the copy queue for its computes. Its parts follow the
    # group's ubatches, whose input uploads have made the host wait for the group before already; queued whole at the
    # group's start (LLAMA_LAYER_MAJOR_DEBUG_STAGE_WHOLE), only that wait keeps it off the weights still to be read:
    # the planted GGML_SCHED_PREFETCH_DEBUG_STAGE_NO_WAIT drops it and changes the logits
    env = {"LLAMA_LAYER_MAJOR_GROUPS": "8", "GGML_SIM_COMPUTE_LATENCY_US": "3000"}
    base = _sim_run(patched_build, src, model, {**env, "LLAMA_LAYER_MAJOR_PROMPT": "0"})
    whole = {**env, "LLAMA_LAYER_MAJOR_DEBUG_STAGE_WHOLE": "1"}
    for got in (_sim_run(patched_build, src, model, env), _sim_run(patched_build, src, model, whole)):
        assert got.logits_sha256 == base.logits_sha256
        assert got.decode_logits_sha256 == base.decode_logits_sha256
        assert [m.groups()[:3] for m in CALL_LINE.finditer(got.log)] == [("160", "5", "4")]
        # groups 1 and 2 (group 0 follows the context's own reservation), and the last group's graph
        assert got.stats["prompt"]["n_reserves_in_place"] == 3, got.stats["prompt"]
    assert base.stats["prompt"]["n_reserves_in_place"] == 0
    planted = _sim_run(patched_build, src, model, {**whole, "GGML_SCHED_PREFETCH_DEBUG_STAGE_NO_WAIT": "1"})
    assert planted.logits_sha256 != base.logits_sha256


def test_a_stage_part_waits_for_a_group_whose_places_run_past_its_region(patched_build, src):
    # 12 layers, the first on the CPU (-ngl 11): the scheduler still uploads that layer's experts for its large batches
    # (op offload), past the weights the plan counts, so the first group's places run into the region where the second
    # group's stage goes. A part of that stage, queued after one of the group's ubatches without a wait, overwrote
    # places the ubatch still read (the prompt's logits changed, the text became [0, 0]); the scheduler now notes the
    # places of every graph computed since the stage waited and waits again before a part writes one
    model12 = models.ensure_model("qwen3moe-12", {**load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"], "layers": 12})

    def run(env):
        spec = runner.RunSpec(model=model12, tokens=SIM_TOKENS, n_ubatch=32, n_batch=256, threads=2, generate=2,
                              cpu_moe=True, n_gpu_layers=11, load_mode="none", repack=False, stats=True,
                              env={**SIM_ENV, "LLAMA_LAYER_MAJOR_GROUPS": "2", "GGML_SIM_COMPUTE_LATENCY_US": "3000",
                                   **env})
        return runner.run(patched_build, src, spec)

    base, got = run({"LLAMA_LAYER_MAJOR_PROMPT": "0"}), run({})
    assert [m.groups()[:3] for m in CALL_LINE.finditer(got.log)] == [("160", "5", "2")]
    assert got.stats["prompt"]["prefetch_staged_bytes"] > 0
    assert got.logits_sha256 == base.logits_sha256
    assert got.generated == base.generated


def test_groups_that_end_on_different_devices_download_their_rows_in_order(patched_build, src, model):
    # two SIM devices, the second with three times the memory, so the layers split 2/2 (and the output to SIM1); one
    # layer's experts on the host. The groups of layers 0 and 1 end on SIM0, the group of layer 2 on SIM1, so the
    # event behind a ubatch's boundary rows is made again on the device of the group that downloads them (SIM aborts
    # on an event recorded on another device's stream, as CUDA does)
    env = {"GGML_SIM_DEVICES": "2", "GGML_SIM_MEMORY_MIB": "1000,3000", "LLAMA_LAYER_MAJOR_DEBUG_GROUP_LAYERS": "1"}
    spec = dict(tokens=SIM_TOKENS, n_ubatch=32, n_batch=256, threads=2, generate=2, n_cpu_moe=1, load_mode="none",
                repack=False, stats=True)
    base, got = (runner.run(patched_build, src, runner.RunSpec(model=model, env={**SIM_ENV, **env, **extra}, **spec))
                 for extra in ({"LLAMA_LAYER_MAJOR_PROMPT": "0"}, {}))
    assert re.search(r"SIM0 model buffer size", got.log) and re.search(r"SIM1 model buffer size", got.log), \
        "the layers were not split across the devices"
    assert [m.groups()[:3] for m in CALL_LINE.finditer(got.log)] == [("160", "5", "4")]
    assert got.logits_sha256 == base.logits_sha256
    assert got.decode_logits_sha256 == base.decode_logits_sha256


@pytest.mark.parametrize("arch, extra, n_groups", [("qwen3moe", {}, "1"), ("gpt-oss", {"LLAMA_LAYER_MAJOR_GROUPS": "8"}, "4")])
def test_the_groups_are_staged_on_the_device_that_takes_the_ops_on_host_weights(patched_build, src, model, gpt_oss,
                                                                                 arch, extra, n_groups):
    # two SIM devices, the first taking no op on host weights (as an RPC device ahead of the GPUs), every expert on the
    # host: the scheduler offloads their products to SIM1, so its prefetch stages the groups there. Before, the plan
    # took the first device, kept two regions there that no upload used, and SIM1 uploaded every expert once per ubatch.
    # gpt-oss's host weights include its experts' biases, read by ADD_ID: they go with their layer to SIM1 too (a plan
    # that asked of them only whether the first device takes them uploaded them at graph time, over staged copies)
    env = {**SIM_ENV, "GGML_SIM_DEVICES": "2", "GGML_SIM_MEMORY_MIB": "1000", "GGML_SIM_NO_OFFLOAD": "0", **extra}
    spec = dict(tokens=SIM_TOKENS, n_ubatch=32, n_batch=256, threads=2, generate=2, cpu_moe=True, load_mode="none",
                repack=False, stats=True)
    chosen = model if arch == "qwen3moe" else gpt_oss
    base, got = (runner.run(patched_build, src, runner.RunSpec(model=chosen, env={**env, **on}, **spec))
                 for on in ({"LLAMA_LAYER_MAJOR_PROMPT": "0"}, {}))
    assert re.search(rf"layer-major prompts: {n_groups} layer groups? of the 4 layers.*; a group's budget on SIM1 ",
                     got.log), got.log[-3000:]
    assert [m.groups()[:3] for m in CALL_LINE.finditer(got.log)] == [("160", "5", n_groups)]
    assert "are not staged" not in got.log
    # every host weight crosses once, not once per ubatch, and is found in place by the other four
    prompt = got.stats["prompt"]
    assert prompt["prefetch_upload_bytes"] * 5 == base.stats["prompt"]["prefetch_upload_bytes"]
    assert prompt["prefetch_kept_bytes"] >= 4 * prompt["prefetch_upload_bytes"]
    assert got.logits_sha256 == base.logits_sha256
    assert got.decode_logits_sha256 == base.decode_logits_sha256


@pytest.mark.parametrize("order", ["0", "1"], ids=["ubatch-order", "layer-major"])
def test_a_ubatch_without_outputs_skips_its_last_layers_empty_inputs(patched_build, src, model, order):
    # only the prompt's last token is an output, so the other ubatches drop every row at the last layer, whose host
    # experts then run in a CPU split for no token. Its empty inputs are neither copied nor waited for (a wait there
    # stops the host until the device is idle); the generation is what every position's logits give
    env = {"LLAMA_LAYER_MAJOR_PROMPT": order, "LLAMA_LAYER_MAJOR_GROUPS": "8"}
    last_only = _sim_run(patched_build, src, model, env, want_logits=False)
    every = _sim_run(patched_build, src, model, env)
    assert last_only.generated == every.generated
    assert last_only.decode_logits_sha256 == every.decode_logits_sha256
    # 4 of the 5 ubatches have no output; each skips at least the CPU split's inputs and its output's copy back
    assert last_only.stats["prompt"]["n_empty_inputs"] >= 4 * 2, last_only.stats["prompt"]
    assert every.stats["prompt"]["n_empty_inputs"] == 0


def test_a_prompt_that_outputs_its_last_token_alone_leaves_the_last_layers_experts_to_the_cpu(patched_build, src,
                                                                                               model):
    # four one-layer groups. The graph keeps the output rows alone before the last layer's feed-forward: with one output
    # that layer's experts run on one row, which SIM (as CUDA) does not take, so the CPU computes them and the last
    # group leaves them out of its stage. Before, they were staged and no graph read them
    env = {"LLAMA_LAYER_MAJOR_GROUPS": "8"}
    every = _sim_run(patched_build, src, model, env)
    last_only = _sim_run(patched_build, src, model, env, want_logits=False)
    for got in (every, last_only):
        assert [m.groups()[:3] for m in CALL_LINE.finditer(got.log)] == [("160", "5", "4")]
    # groups 2 to 4 are staged ahead: layers 1 to 3 of the same size, and layer 3 only where every token is an output
    staged_every, staged_last = (r.stats["prompt"]["prefetch_staged_bytes"] for r in (every, last_only))
    assert staged_last > 0 and staged_last * 3 == staged_every * 2, (staged_last, staged_every)
    # ... and no graph uploaded it either: the call's uploads are three of the four layers
    up_every, up_last = (r.stats["prompt"]["layer_major_upload_bytes"] for r in (every, last_only))
    assert up_last * 4 == up_every * 3, (up_last, up_every)
    assert last_only.generated == every.generated
    assert last_only.decode_logits_sha256 == every.decode_logits_sha256


def test_outputs_spread_over_the_ubatches_leave_the_last_layers_experts_to_the_cpu(patched_build, src, model):
    # 40 sequences of 4 tokens, each outputting its last token: 40 outputs in the call, 8 in each ubatch of 32 (a
    # unified KV buffer keeps the prompt's order), so every ubatch computes the last layer's experts on the CPU. Before,
    # the call's outputs capped by the ubatch (32) decided, and the last layer was staged for no graph
    env = {"LLAMA_LAYER_MAJOR_GROUPS": "8"}
    every = _sim_run(patched_build, src, model, env, generate=1)
    spread = _sim_run(patched_build, src, model, env, generate=1, want_logits=False, prompt_sequences=[4] * 40,
                      kv_unified=True)
    assert [m.groups()[:3] for m in CALL_LINE.finditer(spread.log)] == [("160", "5", "4")], spread.log[-3000:]
    staged_every, staged_spread = (r.stats["prompt"]["prefetch_staged_bytes"] for r in (every, spread))
    assert staged_spread > 0 and staged_spread * 3 == staged_every * 2, (staged_spread, staged_every)


def test_a_layer_larger_than_the_budget_keeps_ubatch_order_and_says_why(patched_build, src, model, sim_ubatch_order):
    got = _sim_run(patched_build, src, model, {"LLAMA_LAYER_MAJOR_STAGING_MIB": "2"})  # a group may stage half
    assert got.logits_sha256 == sim_ubatch_order.logits_sha256
    assert got.stats["prompt"]["n_layer_major_calls"] == 0
    assert len(re.findall(r"layer 0 alone has [\d.]+ MiB of host weights, more than a layer group may stage "
                          r"\(1.0 MiB on SIM0\)", got.log)) == 1


@pytest.mark.parametrize("reserve, later, kept", [
    (("SIM0", 4), None, True),
    (("SIM1", 4), None, False),
    (("SIM0", 4), ("SIM0", -1), True),
    (None, ("SIM0", 4), False),
], ids=["on-the-staging-device", "on-another-device", "unset-by-a-later-fit", "set-after-the-context-was-made"])
def test_the_staging_fit_kept_free_is_the_floor_where_it_was_kept_for_the_context_made_after_it(
        patched_build, src, model, reserve, later, kept):
    # a 12 MiB SIM device: half its free memory beyond the 4 MiB headroom cannot hold a layer's 1.6 MiB of experts;
    # the 4 MiB --fit kept free can. The note applies on the device it names (before: on any device), and a context
    # keeps the note it was made with (before: read when its first long prompt planned, after a later fit changed it)
    env = {**SIM_ENV, "GGML_SIM_MEMORY_MIB": "12", "GGML_SCHED_PREFETCH_HEADROOM_MIB": "4"}
    spec = runner.RunSpec(model=model, tokens=SIM_TOKENS, n_ubatch=32, n_batch=256, threads=2, generate=2, cpu_moe=True,
                          load_mode="none", repack=False, stats=True, env=env, layer_major_fit_reserve=reserve,
                          layer_major_fit_reserve_later=later)
    got = runner.run(patched_build, src, spec)
    plans = re.findall(r"layer-major prompts: (\d+) layer groups?.*\((of [^)]*)\); calls", got.log)
    if kept:
        assert len(plans) == 1 and plans[0][1] == "of the staging --fit kept free", got.log[-3000:]
        assert got.stats["prompt"]["n_layer_major_calls"] == 1
    else:
        assert not plans and re.search(r"layer 0 alone has [\d.]+ MiB of host weights, more than a layer group may stage "
                                       r"\([\d.]+ MiB on SIM0\)", got.log), got.log[-3000:]
        assert got.stats["prompt"]["n_layer_major_calls"] == 0


def test_ubatches_no_device_takes_keep_ubatch_order_and_say_why(patched_build, src, model, sim_ubatch_order):
    # SIM offloads from 64 tokens: at ub 32 the CPU computes the host experts, so nothing is uploaded to keep, whatever
    # the prefetch's own min batch (32) allows
    got = _sim_run(patched_build, src, model, {"GGML_OP_OFFLOAD_MIN_BATCH": "64"})
    assert got.stats["prompt"]["n_layer_major_calls"] == 0
    assert got.logits_sha256 == sim_ubatch_order.logits_sha256
    assert len(re.findall(r"no device takes the products of host experts at ubatches of 32 tokens \(the CPU computes "
                          r"them\)", got.log)) == 1, got.log[-3000:]


@pytest.fixture(scope="module")
def mixed_model():
    # two types in one layer's experts, as llama-quantize's mixes keep the down matrices wider: Q8_0 gate and up
    # (and attention and output head), Q4_0 down
    return models.ensure_model("qwen3moe-down-q4_0", {"arch": "qwen3moe", "preset": "tiny", "type": "q8_0",
                                                      "down_type": "q4_0", "seed": 1})


@pytest.mark.parametrize("refused, n_devices, left_mib, stager", [
    ("q4_0", 1, "1.1", "SIM0"), ("q8_0", 1, "6.1", "SIM0"), ("0:q4_0", 2, "1.1", "SIM0"), ("0:q8_0", 2, "1.1", "SIM1"),
], ids=["the-down-experts", "the-first-expert-tensor", "down-to-the-second-device", "most-bytes-to-the-second-device"])
def test_weights_of_a_type_the_device_lacks_are_not_staged(patched_build, src, mixed_model, refused, n_devices, left_mib,
                                                           stager):
    # SIM without kernels for one of the two types: the scheduler computes those host weights on the CPU, or offloads
    # them to a second device that has them, and uploads the rest each ubatch; layer-major order uploads everything
    # once (the second device keeps its own copies across a group's ubatches). The staging device is the one taking
    # the most expert bytes: SIM1 where SIM0 lacks the gate and up experts' type. Before, the plan staged every host
    # weight of a layer (those of the refused type too, which no graph read), and the device was chosen by the type of
    # the model's first expert tensor alone: where the device lacked that type, there was none and the call kept
    # ubatch order
    env = {"GGML_SIM_NO_TYPES": refused, "LLAMA_LAYER_MAJOR_GROUPS": "8", "GGML_SIM_DEVICES": str(n_devices),
           "GGML_SIM_MEMORY_MIB": "1000"}
    base, got = (_sim_run(patched_build, src, mixed_model, {**env, "LLAMA_LAYER_MAJOR_PROMPT": on}) for on in "01")
    assert got.logits_sha256 == base.logits_sha256
    assert got.decode_logits_sha256 == base.decode_logits_sha256
    assert [m.groups()[:3] for m in CALL_LINE.finditer(got.log)] == [("160", "5", "4")], got.log[-3000:]
    assert re.search(rf"4 layer groups of the 4 layers.*; a group's budget on {stager} ", got.log), got.log[-3000:]
    prompt, base_prompt = got.stats["prompt"], base.stats["prompt"]
    # what ubatch order uploads in each of its 5 ubatches crosses once, and nothing else does
    assert prompt["layer_major_upload_bytes"] * 5 == base_prompt["prefetch_upload_bytes"] > 0, (prompt, base_prompt)
    assert len(re.findall(rf"{left_mib} MiB of host weights \((q4_0|q8_0)\) are not uploaded by {stager} \(the CPU or "
                          r"another device computes them\): they are not staged", got.log)) == 1, got.log[-3000:]


def test_an_eval_callback_keeps_ubatch_order_and_says_why(patched_build, src, model, master_cpu):
    spec = _cpu_spec(model, {"LLAMA_LAYER_MAJOR_DEBUG_GROUP_LAYERS": "2"})
    spec.eval_callback = 7
    got = runner.run(patched_build, src, spec)
    _same_bytes(got, master_cpu)
    assert not CALL_LINE.search(got.log)
    assert got.log.count("an eval callback is set") == 1


@pytest.fixture(scope="module")
def stop_program(patched_build, tmp_path_factory):
    import shutil

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    tree, lib = source_dir(patched_build), patched_build.bin_dir
    exe = tmp_path_factory.mktemp("layer-major-stop") / "test_layer_major_stop"
    subprocess.run([cxx, "-std=c++17", "-O1", str(STOP), "-I", str(tree / "include"), "-I", str(tree / "ggml" / "include"),
                    "-L", str(lib), "-lllama", "-lggml", "-lggml-base", "-lggml-cpu", f"-Wl,-rpath,{lib}", "-o", str(exe)],
                   check=True)
    return exe


def _stops(exe, *args: str, group_layers: str):
    """The program's rows, by (order, case): case 0 the clean run, then stops at the first node, a third of the way and
    the last node."""
    out = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=600,
                         env=clean_env(LLAMA_LAYER_MAJOR_DEBUG_GROUP_LAYERS=group_layers))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [dict(zip(("lm", "k", "calls", "ret", "last", "hash"), line.split()[1::2])) for line in out.stdout.splitlines()]
    assert len(rows) == 8
    return {(r["lm"], i % 4): r for i, r in enumerate(rows)}, out.stderr


def test_a_stopped_call_leaves_the_memory_as_the_contract_says(stop_program, model):
    by, _ = _stops(stop_program, str(model), group_layers="2")
    clean = by[("1", 0)]
    assert clean["ret"] == "0" and clean["last"] == "39" and by[("0", 0)]["hash"] == clean["hash"]
    for lm in ("1", "0"):
        first, third, last = by[(lm, 1)], by[(lm, 2)], by[(lm, 3)]
        assert {first["ret"], third["ret"], last["ret"]} == {"2"}
        # a stop in the first ubatch, or at the last node (the last ubatch, in the last group): what ubatch order keeps
        assert first["last"] == "-1" and last["last"] == "31"
        # whatever was kept, finishing the prompt gives the clean run's logits
        assert {first["hash"], third["hash"], last["hash"]} == {clean["hash"]}
    # a third of the way is in a group before the last: no ubatch went through every layer, so none is kept, where
    # ubatch order keeps the ubatches it finished
    assert by[("1", 2)]["last"] == "-1"
    assert int(by[("0", 2)]["last"]) >= 7


@pytest.mark.parametrize("env", [{}, {"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1"}], ids=["cpu", "sim-host-buffer"])
def test_later_calls_reuse_the_boundary_rows_grown_for_a_larger_one(stop_program, model, env):
    # prompts of 16, 40 and 24 tokens in one context: the second outgrows the rows the first left, the third fits
    # in them. Each is layer-major, and its logits are ubatch order's. On SIM the rows are in the device's host buffer
    # type (pinned memory on CUDA), on the CPU in pageable memory
    out = subprocess.run([str(stop_program), str(model), "sizes"], capture_output=True, text=True, timeout=600,
                         env=clean_env(LLAMA_LAYER_MAJOR_DEBUG_GROUP_LAYERS="2", **env))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [dict(zip(("lm", "call", "n", "ret", "lm_calls", "hash"), line.split()[1::2]))
            for line in out.stdout.splitlines()]
    by = {(r["lm"], r["call"]): r for r in rows}
    assert len(by) == 6
    for call in ("0", "1", "2"):
        assert by[("1", call)]["ret"] == "0" and by[("1", call)]["hash"] == by[("0", call)]["hash"]
        assert by[("1", call)]["lm_calls"] == str(int(call) + 1) and by[("0", call)]["lm_calls"] == "0"
    assert len({by[("1", c)]["hash"] for c in ("0", "1", "2")}) == 3  # three prompts, three different logits


@pytest.fixture(scope="module")
def gpt_oss():
    return models.ensure_model("gpt-oss", load_matrix(CI_DIR / "matrix.toml").models["gpt-oss"])


def test_a_call_that_wraps_a_sliding_window_cache_keeps_ubatch_order(stop_program, gpt_oss):
    # gpt-oss: a window of 128 on every other layer, whose cache (a window and a ubatch, in cells of 256) the 400-token
    # call wraps. Layer-major order would have its earlier groups write later ubatches' K and V over cells a stop must
    # leave alone, so it declines such a call, and every stop keeps what ubatch order keeps
    by, log = _stops(stop_program, str(gpt_oss), "400", "64", "512", group_layers="1")
    for case in range(4):
        assert {k: v for k, v in by[("1", case)].items() if k != "lm"} == {k: v for k, v in by[("0", case)].items()
                                                                             if k != "lm"}
    assert by[("0", 2)]["last"] != "-1"  # the stop a third of the way in keeps the ubatches ubatch order finished
    assert "sliding-window cache smaller than the call" in log


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    from pyllama_moe.synth.shapes import resolve_shape
    from pyllama_moe.synth.writer import write_model

    path = tmp_path_factory.mktemp("layer-major") / "tiny.gguf"
    write_model(path, resolve_shape("tiny"), progress=False)
    return path


@pytest.mark.parametrize("argv, says", [
    (["bench", "--model", "{model}", "--", "-lmp", "2"], "argument -lmp (llama-bench)"),
    (["bench", "--model", "{model}", "--", "--layer-major-prompt", "0,1"], "bench pairs rows"),
    (["bench", "--model", "{model}", "--", "-lms", "-5"], "argument -lms (llama-bench)"),
    (["run", "{model}", "--layer-major-prompt", "on", "--variant", "master"], "--layer-major-prompt needs the patched build"),
])
def test_the_cli_refuses_a_bad_switch_in_one_line_before_any_work(tiny_file, tmp_path, argv, says):
    stderr = cli_refusal(argv, tiny_file, tmp_path / "home")
    assert says in stderr, stderr


@pytest.mark.parametrize("flag, values, bad, says", [
    ("-lmp", "0,1", "2", "error: --layer-major-prompt 2: expected 0"),
    ("-lms", "0,4", "-1", "invalid parameter for argument: -lms"),
], ids=["order", "staging"])
def test_llama_bench_runs_each_value_as_a_row_and_refuses_a_bad_one(patched_build, model, flag, values, bad, says):
    def bench(*args):
        return subprocess.run([str(patched_build.tool("llama-bench")), "-m", str(model), "-p", "160", "-n", "0",
                               "-b", "160", "-ub", "32", "-r", "1", "-t", "2", "-ngl", "99", "-ncmoe", "4", *args],
                              capture_output=True, text=True, timeout=300, env=clean_env(**SIM_ENV))

    md = bench(flag, values, "-o", "md")
    assert md.returncode == 0, md.stderr[-2000:]
    rows = [[c.strip() for c in ln.split("|")] for ln in md.stdout.splitlines() if ln.startswith("|")]
    col = rows[0].index(flag[1:])  # the column is the short flag's name
    assert [row[col] for row in rows[2:]] == values.split(",")
    refused = bench(flag, bad)
    assert refused.returncode != 0 and says in refused.stderr and "pp160" not in refused.stdout


PLAN_LINE = re.compile(r"layer-major prompts: (\d+) layer groups? of the 4 layers.*a group's budget on SIM0 \(of the host "
                       r"weights\): ([\d.]+) of [\d.]+ MiB \((of the budget set|of half the free memory)\)")


def test_the_staging_flag_and_its_environment_variable_set_the_budget_and_bad_ones_are_refused(patched_build, model):
    # a prompt of several ubatches on SIM with every expert on the host: the auto budget holds the tiny model's
    # 6.4 MiB of host experts in one group; a budget of 4 MiB gives groups of at most half of it
    prompt = "the quick brown fox jumps over the lazy dog " * 30

    def complete(*args, **env):
        return completion(patched_build, model, prompt, "-ncmoe", "4", "-ub", "32", "-b", "512", "-n", "2", *args,
                          env={**SIM_ENV, **env})

    plans = {}
    for name, proc in (("auto", complete()), ("flag", complete("--layer-major-staging", "4")),
                       ("env", complete(LLAMA_ARG_LAYER_MAJOR_STAGING="4"))):
        assert proc.returncode == 0, proc.stderr[-3000:]
        plans[name] = PLAN_LINE.search(proc.stderr).groups()
    assert plans["auto"][0] == "1" and plans["auto"][2] == "of half the free memory"
    assert plans["flag"] == plans["env"] and plans["flag"][1:] == ("2.0", "of the budget set")
    assert int(plans["flag"][0]) > 1
    for bad in (complete("--layer-major-staging", "-3"), complete(LLAMA_ARG_LAYER_MAJOR_STAGING="-3")):
        assert bad.returncode != 0 and "expected MiB >= 0 (0: auto)" in bad.stderr and bad.stdout == ""
