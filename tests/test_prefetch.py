"""Host-weight prefetch and asynchronous input upload of the patched scheduler, on the SIM device.

Each safety rule is proven by planting its hazard in a small ggml program (tests/native/test_prefetch_hazards.cpp,
built against the patched CPU build) with slow SIM copies and poison on, and showing the result is right; a
debug knob that switches the rule off must make the same case fail, so the test can fail. Through llama.cpp:
the prefetch leaves logits and greedy text byte-identical to master, its copies really go ahead, the knobs reach
the scheduler through llama-moe.h, and the async input upload keeps to one host synchronization per split with
host inputs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from ggml_program import compile_program
from pyllama_moe.harness import models, runner
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR, PROJECT_ROOT

HAZARDS = PROJECT_ROOT / "tests" / "native" / "test_prefetch_hazards.cpp"
# every SIM copy waits 20 ms: a copy issued too early, or still running when a call returns, is seen
SIM_SLOW = {"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1", "GGML_SIM_COPY_LATENCY_US": "20000"}


@pytest.fixture(scope="module")
def hazards(patched_build, tmp_path_factory):
    return compile_program(patched_build, HAZARDS, tmp_path_factory.mktemp("hazards"))


def _hazard(exe: Path, case: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(exe), case], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **SIM_SLOW, **env})


# two splits of staging for three (1 MiB each): the third upload reuses the place the first split reads
RING_OVERLAP = {"GGML_SCHED_PREFETCH_STAGING_MIB": "2", "GGML_SIM_COPY_LATENCY_US": "0", "GGML_SIM_COMPUTE_LATENCY_US": "300000"}


# a 64-token graph, its debug poison queued behind 300 ms copies, then a 16-token graph below the min batch
POISON_THEN_SMALL = {"GGML_SCHED_PREFETCH_STAGING_MIB": "2", "GGML_SCHED_PREFETCH_DEBUG_POISON": "1",
                     "GGML_SIM_COPY_LATENCY_US": "300000"}


@pytest.mark.parametrize("case,env", [
    ("baseline", {}),
    ("baseline", {"GGML_SCHED_PREFETCH_DEBUG_POISON": "1"}),
    ("small-batch", {}),
    ("input-view", {}),
    ("graph-writes-weight", {}),
    ("arena-too-large", {"GGML_SIM_MEMORY_MIB": "0.55"}),  # the ring of two splits does not fit; one would keep uploads 1 ahead
    ("shrink", {"GGML_SIM_MEMORY_MIB": "0.9"}),  # 4 slots of the largest split do not fit; the ring of two does
    ("headroom", {}),
    ("abort", {}),
    # slow computes, fast copies: an upload that does not wait for the previous graph lands under its last read
    # (poison off: SIM's poison fill of newly allocated tensors waits for the device, which would hide it)
    ("small-then-large", {"GGML_SIM_COPY_LATENCY_US": "0", "GGML_SIM_COMPUTE_LATENCY_US": "300000", "GGML_SIM_POISON": "0"}),
    # staging shrunk when memory runs short: the retries of one procedure (each aborted, computed wrong or shrank
    # the wrong arena before it)
    ("reserve-then-larger", {"GGML_SIM_MEMORY_MIB": "1.35"}),  # two splits' staging does not fit next to the larger graph: dropped
    ("headroom-at-alloc", {}),
    ("other-buffer-fails", {"GGML_SIM_DEVICES": "2", "GGML_SIM_MEMORY_MIB": "2"}),
    # from a read of the change: the failed device before the one with the arena, and the headroom checked again
    # at a later reservation against memory the arena never took
    ("earlier-buffer-fails", {"GGML_SIM_DEVICES": "2", "GGML_SIM_MEMORY_MIB": "2"}),
    ("headroom-later", {"GGML_SIM_MEMORY_MIB": "64"}),
    ("small-only", {}),
    ("meta-input", {"GGML_SIM_DEVICES": "2"}),  # --split-mode tensor: aborted in the meta backend's async setter
    # staging in bytes, a ring over the splits' copies (each failed on the series before it)
    ("mixed-sizes", {"GGML_SIM_MEMORY_MIB": "6"}),  # 8 MiB of slots do not fit, the 4.5 MiB ring does: not reduced
    ("mixed-sizes", {"GGML_SCHED_PREFETCH_STAGING_MIB": "5"}),  # a budget below depth x largest split, 4 ahead still
    ("mixed-sizes", {"GGML_SCHED_PREFETCH_STAGING_MIB": "1"}),  # below the largest split: raised to it (said once), lookahead 1: dropped
    ("budget-steps", {}),  # halved down to the ring that keeps uploads 2 ahead, then dropped, each step said once
    # a reused place overwritten before its last reader (slow computes, fast copies), see the control below
    ("ring-overlap", RING_OVERLAP),
    ("ring-overlap", {**RING_OVERLAP, "GGML_SCHED_PREFETCH_DEBUG_POISON": "1"}),
    # from the cold read (results/prefetch-safety.md, "A cold read of the ring"): one device's arena growth re-checks only
    # that device's headroom; a budget raised to a lone split says so; a small graph right after a large one with
    # the debug poison still queued (see the control below)
    ("headroom-other-device", {"GGML_SIM_DEVICES": "2", "GGML_SIM_MEMORY_MIB": "64"}),
    ("one-split", {"GGML_SCHED_PREFETCH_STAGING_MIB": "1"}),
    ("poison-then-small", POISON_THEN_SMALL),
    # the copy callbacks (the expert cache writes its experts' staged copies); cleared or replaced after an
    # allocation, the computes of that allocation must not call the old fill (the cold read found a NULL call)
    ("copy-callbacks", {}),
    ("copy-at-split", {}),
    # ... and the batched copies the cache stages them with (ggml-copy-regions.h), on SIM
    ("copy-regions", {}),
])
def test_hazard_handled(hazards, case, env):
    proc = _hazard(hazards, case, **env)
    assert proc.returncode == 0 and proc.stdout.startswith(f"ok {case}"), proc.stdout + proc.stderr[-3000:]
    if case == "headroom":
        assert proc.stderr.count("host-weight prefetch disabled on SIM0") == 1  # said once, with the reason
    if case in ("arena-too-large", "reserve-then-larger"):  # two splits' staging does not fit; one would overlap nothing
        assert "reduced to" not in proc.stderr and proc.stderr.count("host-weight prefetch disabled on SIM0") == 1, proc.stderr[-3000:]
    dropped = case == "mixed-sizes" and env.get("GGML_SCHED_PREFETCH_STAGING_MIB") == "1"
    if case in ("shrink", "other-buffer-fails", "earlier-buffer-fails", "headroom-later", "mixed-sizes", "ring-overlap",
                "headroom-other-device", "one-split", "poison-then-small") and not dropped:
        assert "reduced" not in proc.stderr and "disabled" not in proc.stderr, proc.stderr[-3000:]
    if dropped:
        assert proc.stderr.count("host-weight prefetch disabled on SIM0") == 1 and "lookahead 1" in proc.stderr
    if case == "mixed-sizes":
        raised = "the staging budget of 1.00 MiB cannot hold the largest split (2.00 MiB)"
        assert proc.stderr.count(raised) == (env.get("GGML_SCHED_PREFETCH_STAGING_MIB") == "1")
    if case == "budget-steps":
        step = re.compile(r"host-weight prefetch (on SIM0: staging budget [\d.]+ MiB reduced to [\d.]+ MiB|disabled on SIM0)")
        steps = [m.group(0) for m in map(step.search, proc.stderr.splitlines()) if m]
        assert steps == [
            "host-weight prefetch on SIM0: staging budget 4.50 MiB reduced to 4.00 MiB",
            "host-weight prefetch disabled on SIM0"], steps
        assert "(4.50 MiB of staging freed)" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("case,env", [
    # the safety rules switched off: the planted hazard must reach the result
    ("input-view", {"GGML_SCHED_PREFETCH_DEBUG_UNSAFE": "1"}),
    ("graph-writes-weight", {"GGML_SCHED_PREFETCH_DEBUG_UNSAFE": "1"}),
    # no drain of the copy queue on abort (skip-wait skips it): uploads outlive the call
    ("abort", {"GGML_SCHED_DEBUG_SKIP_WAIT": "1"}),
    # uploads that do not wait for the reader of the place they reuse
    ("ring-overlap", {**RING_OVERLAP, "GGML_SCHED_PREFETCH_DEBUG_UNSAFE": "1"}),
    # the small graph's copies not waiting for the backend (and so for the queued poison): SIM sees the race
    ("poison-then-small", {**POISON_THEN_SMALL, "GGML_SCHED_DEBUG_SKIP_WAIT": "1"}),
])
def test_hazard_control_fails(hazards, case, env):
    proc = _hazard(hazards, case, **env)
    assert proc.returncode == 1 and proc.stdout.startswith(f"FAIL {case}"), proc.stdout + proc.stderr[-3000:]
    if case == "ring-overlap":
        assert "overwritten before its last reader" in proc.stdout, proc.stdout
    if case == "poison-then-small":
        assert "ggml_sim: race" in proc.stderr, proc.stderr[-3000:]


_MIXED = re.compile(r"ok mixed-budget: lookahead (\d+), staging (\d+) bytes, largest split (\d+) bytes \((.*)\)")


def _mixed_budget(hazards, **env):
    proc = _hazard(hazards, "mixed-budget", **env)
    got = _MIXED.search(proc.stdout)
    assert proc.returncode == 0 and got, proc.stdout + proc.stderr[-3000:]
    return int(got.group(1)), int(got.group(2)), got.group(4), proc.stderr


def test_a_budget_short_of_the_depth_takes_only_what_its_lookahead_needs(hazards):
    """Finding 4: a budget that cannot reach the depth was kept whole. Mixed sizes at depth 8 under 6 MiB: lookahead
    6, which 5 MiB of ring gives (two 2 MiB layers and four 256 KiB splits between them). A budget that reaches only
    lookahead 1 is the exception: there each byte beside the largest split is a byte more of each upload that runs
    during the compute before it (pieces, see the ring tests below), so depth 4 under 3 MiB keeps all 3 MiB, on."""
    lookahead, staging, _, _ = _mixed_budget(hazards, GGML_SCHED_PREFETCH_DEPTH="8", GGML_SCHED_PREFETCH_STAGING_MIB="6")
    assert lookahead == 6 and staging <= 5 << 20, (lookahead, staging)
    lookahead, staging, why, _ = _mixed_budget(hazards, GGML_SCHED_PREFETCH_STAGING_MIB="3")
    assert lookahead == 1 and staging == 3 << 20, (lookahead, staging, why)


def _overlaps(oplog: Path) -> tuple[int, int]:
    """(uploads, uploads that ran while a compute ran) in SIM's op log: uploads are the sets on the copy queue (the
    instance of the device that computes nothing)."""
    ops = [json.loads(line) for line in oplog.read_text().splitlines()]
    computes = [op for op in ops if op["op"] == "compute"]
    compute_insts = {op["inst"] for op in computes}
    uploads = [op for op in ops if op["op"] == "set" and op["inst"] >= 0 and op["inst"] not in compute_insts]
    overlapping = [u for u in uploads if any(u["t0_ns"] < c["t1_ns"] and c["t0_ns"] < u["t1_ns"] for c in computes)]
    return len(uploads), len(overlapping)


def test_a_ring_of_one_split_is_dropped_as_it_overlaps_nothing(hazards, tmp_path):
    """Finding 3: three 1 MiB splits in 1 MiB of staging (lookahead 1) were "on", yet every upload waited for the
    compute before it and the compute for the upload: SIM's op log shows no upload overlapping a compute. Such a ring
    is dropped, with the reason; 2 MiB (lookahead 2) overlaps, which shows the op-log check can see it."""
    slow = {"GGML_SIM_COPY_LATENCY_US": "100000", "GGML_SIM_COMPUTE_LATENCY_US": "100000"}
    for mib in ("1", "2"):
        log = tmp_path / f"oplog-{mib}.jsonl"
        proc = _hazard(hazards, "ring-oplog", GGML_SCHED_PREFETCH_STAGING_MIB=mib, GGML_SIM_OPLOG=str(log), **slow)
        got = re.search(r"ok ring-oplog: lookahead (\d+), staging (\d+) bytes \((.*)\)", proc.stdout)
        assert proc.returncode == 0 and got, proc.stdout + proc.stderr[-3000:]
        lookahead, why = int(got.group(1)), got.group(3)
        uploads, overlapping = _overlaps(log)
        if mib == "2":
            assert lookahead == 2 and overlapping > 0, (lookahead, uploads, overlapping)
            continue
        assert lookahead == 0 or overlapping > 0, (
            f"prefetch on at lookahead {lookahead}, yet none of {uploads} uploads overlapped a compute")
        assert lookahead == 0 and uploads == 0 and "lookahead 1" in why, (lookahead, uploads, why)
        assert proc.stderr.count("host-weight prefetch disabled on SIM0") == 1, proc.stderr[-3000:]


_RING_OPLOG = re.compile(r"ok ring-oplog-wide: lookahead (\d+), staging (\d+) bytes \((.*)\), ahead ([\d.]+), (\d+) upload calls")


def test_a_ring_between_one_and_two_splits_overlaps_part_of_each_upload(hazards, tmp_path):
    """Four 2 MiB splits in 3 MiB of staging: no two splits' copies fit apart (lookahead 1), yet each placement
    overlaps only half of the one before it, so that half of its upload may run during the compute before it. The
    whole-placement uploads waited for that compute and the ring was dropped as overlapping nothing; cut into pieces,
    half of each upload overlaps a compute in SIM's op log, with the debug poison on and the result right. 2 MiB
    (one split) is still dropped and 4 MiB is lookahead 2 with every upload whole."""
    slow = {"GGML_SIM_COPY_LATENCY_US": "100000", "GGML_SIM_COMPUTE_LATENCY_US": "100000",
            "GGML_SCHED_PREFETCH_DEBUG_POISON": "1"}
    seen = {}
    for mib in ("2", "3", "4"):
        log = tmp_path / f"oplog-{mib}.jsonl"
        proc = _hazard(hazards, "ring-oplog-wide", GGML_SCHED_PREFETCH_STAGING_MIB=mib, GGML_SIM_OPLOG=str(log), **slow)
        got = _RING_OPLOG.search(proc.stdout)
        assert proc.returncode == 0 and got, proc.stdout + proc.stderr[-3000:]
        seen[mib] = (int(got.group(1)), int(got.group(2)), got.group(3), float(got.group(4)), int(got.group(5)),
                     *_overlaps(log))
        if mib != "2":  # the arena line says how far ahead
            line = {"3": "lookahead 1 of depth 2 (at least 50% of each upload overlaps the compute before its split), 4 splits",
                    "4": "lookahead 2 of depth 2, 4 splits"}[mib]
            assert f"staging arena {mib}.00 MiB (largest split 2.00 MiB), {line}" in proc.stderr, proc.stderr[-3000:]
    lookahead, staging, why, ahead, calls, uploads, overlapping = seen["3"]
    assert lookahead == 1 and staging == 3 << 20 and abs(ahead - 0.5) < 0.01, seen["3"]
    assert overlapping > 0, f"lookahead 1 in 3 MiB, yet none of {uploads} uploads overlapped a compute"
    assert calls == 7, seen["3"]  # the first placement whole, each later one in two pieces
    lookahead, staging, why, ahead, calls, uploads, overlapping = seen["2"]
    assert lookahead == 0 and uploads == 0 and "lookahead 1" in why, seen["2"]
    lookahead, staging, why, ahead, calls, uploads, overlapping = seen["4"]
    assert lookahead == 2 and ahead == 1.0 and calls == 4 and overlapping > 0, seen["4"]


_CHAIN = re.compile(r"ok chain-dims: lookahead (\d+), staging (\d+) bytes \((.*)\), ahead ([\d.]+)")


def _chain(hazards, dims: str, **env):
    proc = _hazard(hazards, "chain-dims", HAZARD_CHAIN_DIMS=dims, **env)
    got = _CHAIN.search(proc.stdout)
    assert proc.returncode == 0 and got, proc.stdout + proc.stderr[-3000:]
    return int(got.group(1)), int(got.group(2)), got.group(3), float(got.group(4))


def test_a_ring_that_leaves_a_sliver_ahead_is_dropped(hazards):
    """Cold read of the pieces, finding 3: two 3.998 MiB splits in a 4 MiB ring leave 2 KiB of each upload (0.05%)
    ahead of the compute before it; the drop rule took any share above 0, so the prefetch stayed on ("at least 0%"),
    holding its arena while every upload waited for that compute. Under an eighth it is dropped, with the share."""
    lookahead, staging, why, ahead = _chain(hazards, "512,2047,512,2047,512", GGML_SCHED_PREFETCH_STAGING_MIB="4")
    assert lookahead == 0 and staging == 0 and "under the 12.5%" in why, (lookahead, staging, why, ahead)


def test_a_budget_at_lookahead_1_takes_a_smaller_ring_that_keeps_uploads_2_ahead(hazards):
    """Cold read of the pieces, finding 1: the lookahead is not monotonic in the budget; on this chain 7 MiB gives
    lookahead 2 in 6.75 MiB, 8 MiB lookahead 1 (kept whole: 8 MiB), 9 MiB lookahead 2. A budget that reaches only
    lookahead 1 now looks for the smallest ring that keeps every upload 2 ahead within it."""
    dims = "1152,256,384,1408,768,896"
    for mib in ("7", "8", "9"):
        lookahead, staging, why, ahead = _chain(hazards, dims, GGML_SCHED_PREFETCH_STAGING_MIB=mib)
        assert lookahead >= 2 and staging <= int(mib) << 20, (mib, lookahead, staging, why)


def test_a_halved_budget_never_lands_at_lookahead_1(hazards):
    """Cold read of the pieces, finding 2: a 21.38 MiB arena that does not fit next to the compute buffer in 16 MiB
    of SIM memory was halved to 10.69 MiB, where this chain keeps some upload only 1 split ahead, though the floor
    of the shrink (10.5 MiB) keeps every upload 2 ahead. A half at lookahead 1 takes the floor."""
    lookahead, staging, why, ahead = _chain(hazards, "768,384,1792,1152,256,1664,1280,384", GGML_SIM_MEMORY_MIB="16")
    assert "reduced" in why and lookahead >= 2, (lookahead, staging, why, ahead)


def test_a_staging_budget_beyond_int_in_the_environment_is_refused(hazards):
    """Finding 7: atoi wrapped GGML_SCHED_PREFETCH_STAGING_MIB=4294967297 to 1 MiB; now it is refused with a message
    and the budget stays auto (every upload 4 ahead in the 4.5 MiB ring)."""
    lookahead, staging, _, err = _mixed_budget(hazards, GGML_SCHED_PREFETCH_STAGING_MIB="4294967297")
    assert "GGML_SCHED_PREFETCH_STAGING_MIB=4294967297" in err and "out of range" in err, err[-3000:]
    assert lookahead == 4 and staging == 4718592, (lookahead, staging)


# --- through llama.cpp ---

SIM_ENV = {"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1", "GGML_SIM_COPY_LATENCY_US": "50"}


@pytest.fixture(scope="module")
def qwen3moe():
    model = models.ensure_model("qwen3moe", load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"])
    return model, [(i * 7919) % 4000 + 16 for i in range(600)]


def _spec(model, tokens, ubatch=512, env=None, **kw):
    return runner.RunSpec(model=model, tokens=tokens, n_ubatch=ubatch, repack=False, threads=2, generate=8,
                          cpu_moe=True, env=env or {}, **kw)


@pytest.fixture(scope="module")
def master_ub512(master_build, src, qwen3moe):
    return runner.run(master_build, src, _spec(*qwen3moe))


def test_prefetch_identical_and_ahead(patched_build, src, qwen3moe, master_ub512):
    res = runner.run(patched_build, src, _spec(*qwen3moe, env={**SIM_ENV, "GGML_SCHED_PREFETCH": "2"}, stats=True))
    assert res.logits_sha256 == master_ub512.logits_sha256
    assert res.generated == master_ub512.generated
    prompt = res.stats["prompt"]
    assert prompt["prefetch_devices"] == 1 and prompt["prefetch_arena_bytes"] > 0
    # the full 512-token ubatch uploads its expert weights ahead; generation (1 token) does not offload them
    assert prompt["n_prefetch_uploads"] > 0, prompt
    assert res.stats["generate"]["n_prefetch_uploads"] == 0
    assert "host-weight prefetch on" in res.log


def test_all_on_device_says_there_is_nothing_to_prefetch(patched_build, src, qwen3moe):
    """Every weight on the (SIM) device: the reservation says there is nothing to prefetch, not "prefetch on ...
    staging 0.00 MiB" (what every all-on-GPU run printed before)."""
    model, tokens = qwen3moe
    spec = runner.RunSpec(model=model, tokens=tokens[:64], n_ubatch=512, repack=False, threads=2, generate=2,
                          env={**SIM_ENV, "GGML_SCHED_PREFETCH": "2"})
    res = runner.run(patched_build, src, spec)
    assert "host-weight prefetch: nothing to prefetch" in res.log
    assert "host-weight prefetch on" not in res.log


def test_small_ubatches_get_no_staging_and_say_why(patched_build, master_build, src, qwen3moe):
    """n_ubatch below the min batch: nothing is ever uploaded ahead, so no staging slots are
    allocated, the reservation says why, and the logits are master's at the same ubatch."""
    env = {**SIM_ENV, "GGML_SCHED_PREFETCH": "2"}
    res = runner.run(patched_build, src, _spec(*qwen3moe, ubatch=64, env=env, stats=True))
    assert res.logits_sha256 == runner.run(master_build, src, _spec(*qwen3moe, ubatch=64)).logits_sha256
    assert res.stats["prompt"]["prefetch_arena_bytes"] == 0 and res.stats["prompt"]["n_prefetch_uploads"] == 0
    assert "nothing to prefetch (batches of 64 tokens are below the min batch of 128" in res.log, res.log[-3000:]


def _reservation_line(log: str) -> str:
    """The last reservation's prefetch line (a per-context setter reserves again at the next decode)."""
    return [ln for ln in log.splitlines() if "sched_reserve" in ln and "host-weight prefetch" in ln][-1]


@pytest.mark.parametrize("headroom_mib, says", [
    # 13.5 MiB of SIM0: the compute buffer fits next to half the auto staging (4 x the 0.53 MiB largest split), not
    # all of it (model 1.9, KV 1.5, compute 8.5 + staging)
    ("0", "host-weight prefetch on: staging 1.06 MiB (1114112 bytes, budget auto; reduced: the compute buffer does not "
          "fit next to the staging arena), lookahead 2 of depth 4"),
    # the default headroom of 512 MiB: dropped, and the reservation line gives that reason, not a guess
    ("512", "host-weight prefetch off: dropped: "),
])
def test_the_reservation_line_tells_the_effective_depth_or_the_reason(patched_build, src, qwen3moe, master_ub512,
                                                                      headroom_mib, says):
    env = {**SIM_ENV, "GGML_SCHED_PREFETCH": "2", "GGML_SIM_MEMORY_MIB": "13.5",
           "GGML_SCHED_PREFETCH_HEADROOM_MIB": headroom_mib}
    res = runner.run(patched_build, src, _spec(*qwen3moe, env=env))
    assert res.logits_sha256 == master_ub512.logits_sha256
    line = _reservation_line(res.log)
    assert says in line, res.log[-3000:]
    if headroom_mib == "512":
        assert "less than the headroom of 512.0 MiB" in line


@pytest.mark.parametrize("depth, effective", [("1", 2), ("12", 8)])
def test_the_reservation_line_and_getter_give_the_clamped_depth(patched_build, src, qwen3moe, depth, effective):
    """Finding 1: GGML_SCHED_PREFETCH_DEPTH outside 2..8 is clamped by the scheduler, but the reservation line said
    "lookahead 2 of depth 1" / "lookahead 8 of depth 12" and llama_moe_get_prefetch_params returned 1 / 12. Both must
    give the depth in use; so must the per-context setter's value."""
    env = {**SIM_ENV, "GGML_SCHED_PREFETCH": "2", "GGML_SCHED_PREFETCH_DEPTH": depth}
    res = runner.run(patched_build, src, _spec(*qwen3moe, env=env, stats=True))
    line = _reservation_line(res.log)
    got = re.search(r"lookahead (\d+) of depth (\d+)", line)
    assert got and int(got.group(2)) == effective and int(got.group(1)) <= effective, line
    assert res.stats["prompt"]["prefetch_depth"] == effective, res.stats["prompt"]
    res = runner.run(patched_build, src, _spec(*qwen3moe, env={**SIM_ENV, "GGML_SCHED_PREFETCH": "2"}, stats=True,
                                               prefetch={"depth": int(depth)}))
    got = re.search(r"lookahead (\d+) of depth (\d+)", _reservation_line(res.log))
    assert got and int(got.group(2)) == effective, _reservation_line(res.log)
    assert res.stats["prompt"]["prefetch_depth"] == effective, res.stats["prompt"]


def test_prefetch_knobs_through_llama_moe(patched_build, src, qwen3moe, master_ub512):
    """The per-context setter of llama-moe.h beats the environment: mode 0 there leaves nothing prefetched."""
    env = {**SIM_ENV, "GGML_SCHED_PREFETCH": "2"}
    res = runner.run(patched_build, src, _spec(*qwen3moe, env=env, stats=True, prefetch={"mode": 0}))
    assert res.logits_sha256 == master_ub512.logits_sha256
    assert res.stats["prompt"]["prefetch_devices"] == 0 and res.stats["prompt"]["n_prefetch_uploads"] == 0
    # and mode 2 with depth 3 through the setter, with the environment saying off
    res = runner.run(patched_build, src, _spec(*qwen3moe, env={**SIM_ENV, "GGML_SCHED_PREFETCH": "0"}, stats=True,
                                               prefetch={"mode": 2, "depth": 3}))
    assert res.logits_sha256 == master_ub512.logits_sha256
    assert res.stats["prompt"]["prefetch_devices"] == 1 and res.stats["prompt"]["n_prefetch_uploads"] > 0


def test_async_input_one_sync_per_split(patched_build, src, qwen3moe, master_ub512):
    """Decode with experts on the host: every split that copies host inputs to the device synchronizes at most
    once for them with the async upload, and more often with the per-input copies (GGML_SCHED_ASYNC_INPUT=0);
    the total per token drops too (device-to-host reads still synchronize)."""
    per_token = {}
    for async_input in ("1", "0"):
        env = {**SIM_ENV, "GGML_SCHED_ASYNC_INPUT": async_input}
        res = runner.run(patched_build, src, _spec(*qwen3moe, env=env, stats=True))
        assert res.generated == master_ub512.generated
        gen = res.stats["generate"]
        assert gen["n_splits_host_input"] > 0, gen
        per_token[async_input] = gen["n_host_syncs"] / gen["n_graph_computes"]
        if async_input == "1":
            assert gen["n_host_syncs_upload"] <= gen["n_splits_host_input"], gen
    assert per_token["1"] < per_token["0"], per_token


def _fit_log(build, model: Path, env: dict[str, str]) -> str:
    proc = subprocess.run([str(build.tool("llama-completion")), "-m", str(model), "-p", "hello world", "-n", "4",
                           "--temp", "0", "-ub", "512", "--no-repack", "-t", "2", "-no-cnv", "-v"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def test_fit_places_the_same_layers_with_the_prefetch_on(patched_build, qwen3moe):
    """--fit (on by default in llama.cpp's tools) measures with the prefetch off: on a 24 MiB SIM device it makes
    the same placement decisions with the prefetch forced on as off; the real reservation then drops the
    prefetch, which would leave less than the 512 MiB headroom free, and says so once."""
    env = {"GGML_SIM_DEVICES": "1", "GGML_SIM_MEMORY_MIB": "24"}
    logs = {pf: _fit_log(patched_build, qwen3moe[0], {**env, "GGML_SCHED_PREFETCH": pf}) for pf in ("0", "2")}
    fit = {pf: [re.sub(r"^[\d.]+ \S ", "", ln) for ln in log.splitlines() if "common_params_fit_impl" in ln]
           for pf, log in logs.items()}
    assert fit["0"] and fit["0"] == fit["2"]
    assert any("SIM0" in ln and "layers" in ln for ln in fit["2"])
    assert logs["2"].count("host-weight prefetch disabled on SIM0") == 1
    assert "less than the headroom" in logs["2"] and "host-weight prefetch disabled" not in logs["0"]


def test_staging_budget_through_llama_moe(patched_build, src, qwen3moe, master_ub512):
    """The staging budget reaches the scheduler through the per-context setter, which beats the
    environment; the reservation line gives the staging in bytes, its budget and the lookahead it allows; a budget
    under what depth 4 takes holds less staging and still uploads ahead, with master's logits (2 MiB: 1 MiB would keep
    uploads only 1 split ahead of the 0.53 MiB splits, which drops the prefetch). In ubatch order: a layer-major
    prompt stages its layer groups in an arena of its own budget (docs/layer-major.md)."""
    env = {**SIM_ENV, "GGML_SCHED_PREFETCH": "2", "LLAMA_LAYER_MAJOR_PROMPT": "0"}
    auto = runner.run(patched_build, src, _spec(*qwen3moe, env=env, stats=True))
    small = runner.run(patched_build, src, _spec(*qwen3moe, env={**env, "GGML_SCHED_PREFETCH_STAGING_MIB": "64"},
                                                 stats=True, prefetch={"staging_mib": 2}))
    assert small.logits_sha256 == auto.logits_sha256 == master_ub512.logits_sha256
    staging = {name: res.stats["prompt"]["prefetch_arena_bytes"] for name, res in (("auto", auto), ("2", small))}
    assert 0 < staging["2"] < staging["auto"], staging
    assert small.stats["prompt"]["n_prefetch_uploads"] == auto.stats["prompt"]["n_prefetch_uploads"] > 0
    line = {name: _reservation_line(res.log) for name, res in (("auto", auto), ("2", small))}
    assert f"staging {staging['auto'] / 2**20:.2f} MiB ({staging['auto']} bytes, budget auto), lookahead 4 of depth 4" in line["auto"]
    got = re.search(r"staging [\d.]+ MiB \((\d+) bytes, budget 2\.00 MiB\), lookahead (\d) of depth 4", line["2"])
    assert got and int(got.group(1)) == staging["2"] and 2 <= int(got.group(2)) < 4, line["2"]


def test_staging_flag_and_bench_dimension(patched_build, qwen3moe):
    """--sched-prefetch-staging sets the process default (the reservation line shows its budget), and llama-bench
    takes -pfs as a dimension: one instance per value, each recorded in the output."""
    env = {**os.environ, "GGML_SIM_DEVICES": "1"}
    proc = subprocess.run([str(patched_build.tool("llama-completion")), "-m", str(qwen3moe[0]), "-p", "hello", "-n", "1",
                           "-ub", "512", "-cmoe", "--fit", "off", "--no-repack", "-t", "2", "-no-cnv",
                           "--sched-prefetch", "2", "--sched-prefetch-staging", "2", "-v"],
                          capture_output=True, text=True, errors="replace", timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "budget 2.00 MiB)" in _reservation_line(proc.stderr), proc.stderr[-3000:]
    bench = subprocess.run([str(patched_build.tool("llama-bench")), "-m", str(qwen3moe[0]), "-p", "256", "-n", "0",
                            "-r", "1", "-ub", "256", "-ncmoe", "99", "-t", "2", "-pf", "2", "-pfs", "0,1", "-o", "json"],
                           capture_output=True, text=True, timeout=300, env=env)
    assert bench.returncode == 0, bench.stderr[-3000:]
    rows = json.loads(bench.stdout)
    assert [(r["sched_prefetch"], r["sched_prefetch_staging"]) for r in rows] == [(2, 0), (2, 1)]
    md = subprocess.run([str(patched_build.tool("llama-bench")), "-m", str(qwen3moe[0]), "-p", "256", "-n", "0",
                         "-r", "1", "-ub", "256", "-ncmoe", "99", "-t", "2", "-pf", "2", "-pfs", "1"],
                        capture_output=True, text=True, timeout=300, env=env)
    assert md.returncode == 0 and re.search(r"\|\s+pfs\s+\|", md.stdout), md.stdout


def test_the_staging_budget_has_setters_of_its_own(patched_build):
    """Finding 5: staging_mib was appended to the by-value llama_moe_prefetch_params, so a caller's four-value
    initializer zero-filled it and 0 (auto) counted as set, overriding GGML_SCHED_PREFETCH_STAGING_MIB; and the struct
    grew from 16 to 20 bytes, which changes how it is passed on x86-64. The struct keeps its four fields (16 bytes);
    the budget has its own setters and getters: the environment gives the process default, -1 unsets (back to the
    environment), 0 is auto only when set, and the per-context value starts from the process default."""
    script = f"""
from pyllama_moe.build import ffi
from pyllama_moe.build.builder import find_build
cffi_ffi, _ = ffi._ffi()
lib = ffi.load(find_build("patched", "cpu", "{patched_build.key}"))
get = getattr(lib, "llama_moe_default_get_prefetch_staging_mib", None) or (lambda: lib.llama_moe_prefetch_default_params().staging_mib)
print(get())
lib.llama_moe_set_prefetch_default_params(cffi_ffi.new("struct llama_moe_prefetch_params *", [-1, 3, -1, -1])[0])
print(get(), lib.llama_moe_prefetch_default_params().depth)
print([name for name, _ in cffi_ffi.typeof("struct llama_moe_prefetch_params").fields],
      cffi_ffi.sizeof("struct llama_moe_prefetch_params"))
for mib in (3, 0, -1):
    lib.llama_moe_default_set_prefetch_staging_mib(mib)
    print(mib, get())
"""
    proc = subprocess.run(["python3", "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "GGML_SCHED_PREFETCH_STAGING_MIB": "7"})
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 or len(lines) >= 2, proc.stderr[-3000:]
    assert lines[:2] == ["7", "7 3"], (lines, "a four-value initializer must leave the budget of the environment")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert lines[2:] == ["['mode', 'depth', 'min_batch', 'headroom_mib'] 16", "3 3", "0 0", "-1 7"], lines


def test_the_staging_budget_per_context_beats_the_environment(patched_build, src, qwen3moe, master_ub512):
    """Per context, llama_moe_set_prefetch_staging_mib(ctx, 0) is auto over GGML_SCHED_PREFETCH_STAGING_MIB=1, and the
    getter says 0 (finding 5: 0 means auto only when set)."""
    env = {**SIM_ENV, "GGML_SCHED_PREFETCH": "2", "GGML_SCHED_PREFETCH_STAGING_MIB": "1"}
    res = runner.run(patched_build, src, _spec(*qwen3moe, env=env, stats=True, prefetch={"staging_mib": 0}))
    assert res.logits_sha256 == master_ub512.logits_sha256
    assert "budget auto), lookahead 4 of depth 4" in _reservation_line(res.log), _reservation_line(res.log)
    assert res.stats["prompt"]["prefetch_staging_mib"] == 0, res.stats["prompt"]
