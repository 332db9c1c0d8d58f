"""Benchmark statistics on recorded samples: intervals, noise measures, the round loop and its stopping rule.

Nothing here times anything: the llama-bench runs are a script that replays recorded samples.
"""

from __future__ import annotations

import json
import math
import stat
import sys

import pytest

from pyllama_moe.bench import limits as bench_limits, rounds as bench, stats
from pyllama_moe.bench.rounds import BenchPlan, Sample, BenchRow
from pyllama_moe.build.builder import Build
from pyllama_moe.errors import UserError


def test_interval_of_known_log_ratios():
    # log ratios 0.01, 0.02, 0.03: mean 0.02, sd 0.01, t(0.975, 2) = 4.302653 -> half 0.0248414
    pairs = [(100.0, 100.0 * math.exp(d)) for d in (0.01, 0.02, 0.03)]
    iv = stats.paired_ratio_interval(pairs)
    half = 4.302653 * 0.01 / math.sqrt(3)
    assert iv.n == 3
    assert iv.ratio == pytest.approx(math.exp(0.02))
    assert iv.low == pytest.approx(math.exp(0.02 - half), rel=1e-6)
    assert iv.high == pytest.approx(math.exp(0.02 + half), rel=1e-6)
    assert iv.half_width == pytest.approx(math.exp(half) - 1, rel=1e-6)
    assert iv.excludes(1.0) is False  # 0.02 - 0.0248 < 0


def test_interval_excludes_one_for_a_steady_loss():
    # a 5% loss with +/-1% noise per round, ten rounds: the interval lies below 1.0
    noise = [0.01, -0.01, 0.005, -0.005, 0.0, 0.01, -0.01, 0.002, -0.002, 0.0]
    iv = stats.paired_ratio_interval([(40.0, 40.0 * 0.95 * (1 + e)) for e in noise])
    assert iv.high < 1.0 and iv.excludes(1.0)
    assert iv.ratio == pytest.approx(0.95, rel=2e-3)


def test_constant_and_tiny_samples():
    same = stats.paired_ratio_interval([(10.0, 11.0)] * 4)
    assert (same.ratio, same.low, same.high, same.half_width) == pytest.approx((1.1, 1.1, 1.1, 0.0))
    one = stats.paired_ratio_interval([(10.0, 12.0)])
    assert one.ratio == pytest.approx(1.2) and one.low is None and one.half_width is None and not one.excludes()
    two = stats.paired_ratio_interval([(10.0, 10.0), (10.0, 10.0 * math.exp(0.02))])
    # t(0.975, 1) = 12.7062: two rounds give an interval, a wide one
    assert two.half_width == pytest.approx(math.exp(12.7062 * 0.0141421 / math.sqrt(2)) - 1, rel=1e-4)
    assert stats.paired_ratio_interval([]) is None
    with pytest.raises(ValueError):
        stats.paired_ratio_interval([(0.0, 1.0)])


def test_noise_measures():
    assert stats.cv([10.0]) is None
    assert stats.cv([9.0, 11.0]) == pytest.approx(math.sqrt(2) / 10)
    # two processes, each steady inside, 10% apart: nothing within, all between
    assert stats.within_cv([[10.0, 10.0], [11.0, 11.0]]) == 0.0
    assert stats.within_cv([[9.0, 11.0], [19.0, 21.0]]) == pytest.approx(math.sqrt(2) / 15)
    assert stats.within_cv([[5.0]]) is None


def _row(base_blocks, cand_blocks, discarded=()):
    row = BenchRow(("k",), "tg128", {})
    inv = 0
    for rnd, (b, c) in enumerate(zip(base_blocks, cand_blocks)):
        for side, block in (("baseline", b), ("candidate", c)):
            for rep, ts in enumerate(block):
                row.samples.append(Sample(side, rnd, inv, rep, ts, (rnd, side, rep) in discarded))
            inv += 1
    return row


def test_row_pairs_block_means_and_drops_warmup():
    row = _row([[1.0, 40.0, 42.0], [1.0, 38.0, 38.0]], [[1.0, 41.0, 43.0], [1.0, 39.0, 39.0]],
               discarded={(r, s, 0) for r in (0, 1) for s in ("baseline", "candidate")})
    assert row.block_means("baseline") == {0: 41.0, 1: 38.0}
    iv = row.interval()
    assert iv.n == 2 and iv.ratio == pytest.approx(math.sqrt(42 / 41 * 39 / 38))
    assert row.median("baseline") == pytest.approx(39.0)  # the 1.0 warm-up samples are gone
    noise = row.noise("baseline")
    assert noise["samples"] == 4 and noise["cv_between"] == pytest.approx(stats.cv([41.0, 38.0]))


FAKE_BENCH = """#!{python}
import json, os, sys
# replays recorded samples: invocation k of this build prints the k-th entry of its script
state = os.path.join(os.path.dirname(__file__), "count")
k = int(open(state).read()) if os.path.exists(state) else 0
open(state, "w").write(str(k + 1))
args = sys.argv[1:]
reps = int(args[args.index("-r") + 1])
with open(os.path.join(os.path.dirname(__file__), "script.json")) as fh:
    script = json.load(fh)
rates = script[min(k, len(script) - 1)]
slow = float(os.environ.get("FAKE_SLOWDOWN", "1"))
out = []
for name, (n_prompt, n_gen, ncmoe) in {{"pp": (512, 0, 48), "tg": (0, 128, 48), "tg0": (0, 128, 0)}}.items():
    ts = [rates[name] / slow] * reps
    out.append({{"n_prompt": n_prompt, "n_gen": n_gen, "n_ubatch": 512, "n_batch": 2048, "n_gpu_layers": 99,
                "n_cpu_moe": ncmoe, "load_mode": "none", "samples_ts": ts, "avg_ts": ts[0]}})
print(json.dumps(out))
"""


def _fake_build(tmp_path, name, script):
    path = tmp_path / name
    (path / "bin").mkdir(parents=True)
    exe = path / "bin" / "llama-bench"
    exe.write_text(FAKE_BENCH.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    (path / "bin" / "script.json").write_text(json.dumps(script))
    return Build(path, "k", name, "cpu")


def _plan(tmp_path, **kw):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    return BenchPlan(model=model, bench_args=[], **kw)


def _drifting(n, jitter):
    # the machine drifts by 20% over the run; both builds see it, one round apart at most
    return [{"pp": 1000.0 * (1 + 0.2 * i / n), "tg": 40.0 * (1 + 0.2 * i / n) * (1 + jitter[i % len(jitter)]),
             "tg0": 340.0} for i in range(n)]


def test_rounds_alternate_and_stop_at_the_target(tmp_path):
    base = _fake_build(tmp_path, "a", _drifting(40, [0.0, 0.02, -0.02]))
    cand = _fake_build(tmp_path, "b", _drifting(40, [0.01, -0.01, 0.0]))
    plan = _plan(tmp_path, rounds=3, reps=2, discard=1, target_ci=0.03, max_seconds=600)
    seen = []
    result = bench.ab_bench({"baseline": base, "candidate": cand}, plan, on_round=lambda r: seen.append(len(r.rounds)))
    assert [r["order"] for r in result.rounds[:2]] == [["baseline", "candidate"], ["candidate", "baseline"]]
    assert seen == list(range(1, len(result.rounds) + 1))
    assert len(result.rounds) >= 3 and "every interval within" in result.stop_reason
    assert all(result.converged(0.03).values())
    tg = next(r for r in result.rows.values() if r.label.startswith("tg128") and "ncmoe48" in r.label)
    assert sum(s.discarded for s in tg.samples) == 2 * len(result.rounds)  # one warm-up per invocation
    assert tg.interval().low < 1.0 < tg.interval().high  # same machine, same rates: no difference


def test_a_target_stops_a_run_only_after_an_even_number_of_rounds(tmp_path):
    # no spread at all: every interval is within the target from the least number of rounds (5) on, but a run
    # stopped there would have led with the baseline three times and the candidate twice
    base = _fake_build(tmp_path, "a", [{"pp": 1000.0, "tg": 40.0, "tg0": 340.0}] * 20)
    cand = _fake_build(tmp_path, "b", [{"pp": 1000.0, "tg": 40.0, "tg0": 340.0}] * 20)
    plan = _plan(tmp_path, rounds=3, reps=2, discard=1, target_ci=0.03, max_seconds=600)
    result = bench.ab_bench({"baseline": base, "candidate": cand}, plan)
    assert result.stop_reason == "every interval within +/-3.0% after 6 rounds"
    assert [r["order"][0] for r in result.rounds].count("baseline") == 3


def test_planted_slowdown_is_seen_and_a_budget_stops_the_rounds(tmp_path):
    jitter = [0.0, 0.015, -0.015, 0.01]
    base = _fake_build(tmp_path, "a", _drifting(40, jitter))
    cand = _fake_build(tmp_path, "b", _drifting(40, jitter[::-1]))
    plan = _plan(tmp_path, rounds=6, reps=2, env={"candidate": {"FAKE_SLOWDOWN": "1.05"}})
    result = bench.ab_bench({"baseline": base, "candidate": cand}, plan)
    assert result.stop_reason == "6 rounds"
    for row in result.rows.values():
        iv = row.interval()
        assert iv.excludes(1.0) and iv.ratio == pytest.approx(1 / 1.05, rel=0.02), row.label
    # a spent budget stops the rounds before the next one, also before the least number of rounds
    cand2 = _fake_build(tmp_path, "c", _drifting(40, jitter))
    plan = _plan(tmp_path, rounds=3, reps=2, target_ci=0.0001, max_seconds=0.0)
    result = bench.ab_bench({"baseline": base, "candidate": cand2}, plan)
    assert "time budget" in result.stop_reason and len(result.rounds) == 1
    assert not any(result.converged(0.0001).values())


def test_json_keeps_every_sample_and_the_table_shows_intervals(tmp_path):
    base = _fake_build(tmp_path, "a", _drifting(10, [0.0, 0.02]))
    cand = _fake_build(tmp_path, "b", _drifting(10, [0.01, -0.01]))
    result = bench.ab_bench({"baseline": base, "candidate": cand}, _plan(tmp_path, rounds=4, reps=3))
    data = json.loads(bench.to_json(result, {"baseline_name": "master"}, target=0.03))
    assert data["meta"]["schema"] == 2 and data["meta"]["method"] == stats.METHOD
    test = data["tests"][0]
    assert len(test["samples"]) == 4 * 2 * 3
    assert {s["round"] for s in test["samples"]} == {0, 1, 2, 3}
    assert test["ci_low"] <= test["ratio"] <= test["ci_high"] and test["n_pairs"] == 4
    assert isinstance(test["converged"], bool)
    table = bench.format_table(result, {"baseline": "master", "candidate": "patched"}, target=0.001)
    assert "ratio [95% CI]" in table and "(not converged)" in table
    assert "CV between processes" in bench.format_noise(result, {"baseline": "master", "candidate": "patched"})


def test_a_narrow_interval_on_too_few_rounds_says_so_instead_of_not_converged(tmp_path):
    """Four rounds within the target: the table names the rounds a target counts, not "(not converged)" (4-round
    planted and self runs on the GPU machine read "not converged" at +/-0.8% and +/-1.1%)."""
    base = _fake_build(tmp_path, "a", _drifting(10, [0.0, 0.001]))
    cand = _fake_build(tmp_path, "b", _drifting(10, [0.001, -0.001]))
    result = bench.ab_bench({"baseline": base, "candidate": cand}, _plan(tmp_path, rounds=4, reps=3))
    names = {"baseline": "master", "candidate": "patched"}
    assert result.too_few_rounds(0.5) and not any(result.converged(0.5).values())
    table = bench.format_table(result, names, target=0.5)
    assert "but a target needs 5 rounds" in table and "(not converged)" not in table
    # the jittered decode row is wider than 1e-6 (the steady rows are exact, so narrow at any target)
    assert "(not converged)" in bench.format_table(result, names, target=1e-6)
    assert len(result.too_few_rounds(1e-6)) < len(result.rows)


def test_limit_row_shares(tmp_path):
    base = _fake_build(tmp_path, "a", [{"pp": 1000.0, "tg": 40.0, "tg0": 320.0}, {"pp": 1000.0, "tg": 44.0, "tg0": 352.0}])
    cand = _fake_build(tmp_path, "b", [{"pp": 1000.0, "tg": 80.0, "tg0": 320.0}, {"pp": 1000.0, "tg": 88.0, "tg0": 352.0}])
    result = bench.ab_bench({"baseline": base, "candidate": cand}, _plan(tmp_path, rounds=2, reps=2))
    field, value = bench_limits.parse_limit_row("ncmoe=0")
    shares = bench_limits.limit_shares(result, field, value)
    tg = next(label for label in shares if label.startswith("tg128"))
    lim = shares[tg]["limit"]
    assert lim["row"].startswith("tg128") and "ncmoe0" in lim["row"]
    assert lim["share_candidate"] == pytest.approx(0.25) and lim["share_baseline"] == pytest.approx(0.125)
    assert not any(label.startswith("pp") for label in shares)  # no pp row with ncmoe 0 in this run
    with pytest.raises(UserError):
        bench_limits.limit_shares(result, field, value, limit_from="theirs")
    with pytest.raises(UserError):
        bench_limits.parse_limit_row("nonsense=1")


def test_limit_row_of_the_baseline(tmp_path):
    # the candidate's limit row is slower than the baseline's (e.g. its -ncmoe 24 row has the cache too): against its
    # own row the candidate's tg row is at 0.5, against the baseline's at 0.25, round by round
    base = _fake_build(tmp_path, "a", [{"pp": 1000.0, "tg": 40.0, "tg0": 320.0}, {"pp": 1000.0, "tg": 44.0, "tg0": 352.0}])
    cand = _fake_build(tmp_path, "b", [{"pp": 1000.0, "tg": 80.0, "tg0": 160.0}, {"pp": 1000.0, "tg": 88.0, "tg0": 176.0}])
    result = bench.ab_bench({"baseline": base, "candidate": cand}, _plan(tmp_path, rounds=2, reps=2))
    field, value = bench_limits.parse_limit_row("ncmoe=0")
    tg = next(row.label for row in result.rows.values() if row.label.startswith("tg128") and "ncmoe0" not in row.label)
    own = bench_limits.limit_shares(result, field, value)[tg]["limit"]
    cross = bench_limits.limit_shares(result, field, value, limit_from="baseline")[tg]["limit"]
    assert own["share_candidate"] == pytest.approx(0.5) and cross["share_candidate"] == pytest.approx(0.25)
    assert cross["limit_from"] == "baseline" and cross["share_baseline"] == own["share_baseline"] == pytest.approx(0.125)
    assert cross["share_low"] <= 0.25 <= cross["share_high"]


def test_pcie_bound_arithmetic():
    fields = {"n_prompt": 4096, "n_gen": 0, "n_ubatch": 2048, "n_batch": 4096}
    # two ubatches, each uploading 10 GB at 50 GB/s: 0.4 s for 4096 tokens
    assert bench_limits.pcie_bound(fields, 10 * 10**9, 50.0) == pytest.approx(4096 / 0.4)
    # a last ubatch under the offload threshold uploads nothing; batches not a multiple of the ubatch split again
    assert bench_limits.uploading_ubatches(520, 2048, 512) == 1
    assert bench_limits.uploading_ubatches(1536, 768, 512) == 4
    assert bench_limits.pcie_bound({**fields, "no_op_offload": True}, 10**9, 50.0) is None
    assert bench_limits.pcie_bound({**fields, "n_gen": 128, "n_prompt": 0}, 10**9, 50.0) is None  # decode
    assert bench_limits.pcie_bound({**fields, "n_ubatch": 16}, 10**9, 50.0) is None  # not offloaded
    assert bench_limits.pcie_bound(fields, 0, 50.0) is None  # all on the GPU


def test_plan_refuses_bad_settings(tmp_path):
    for kw, words in (({"reps": 1, "discard": 1}, "keeps no repetition"), ({"target_ci": 3.0}, "relative half-width"),
                      ({"bench_args": ["-r", "5"]}, "set by bench itself"),
                      ({"bench_args": ["-n", "128", "-mcm", "0,7800"]}, "patched-only dimension would share a row")):
        plan = _plan(tmp_path)
        for name, value in kw.items():
            setattr(plan, name, value)
        with pytest.raises(UserError, match=words):
            plan.check()
    plan = _plan(tmp_path)
    plan.bench_args = ["-mcm", "7800", "-ncmoe", "48,24"]
    plan.check()  # one value of the patched-only dimension: fine


def test_warmup_rounds_are_left_out(tmp_path):
    # the first round of the machine is 10% slow for the build that runs first: a warm-up round absorbs it
    script = [{"pp": 900.0, "tg": 36.0, "tg0": 300.0}] + [{"pp": 1000.0, "tg": 40.0, "tg0": 340.0}] * 20
    base = _fake_build(tmp_path, "a", script)
    cand = _fake_build(tmp_path, "b", [{"pp": 1000.0, "tg": 40.0, "tg0": 340.0}] * 20)
    result = bench.ab_bench({"baseline": base, "candidate": cand}, _plan(tmp_path, rounds=3, reps=2, warmup_rounds=1))
    assert [r["warmup"] for r in result.rounds] == [True, False, False, False]
    for row in result.rows.values():
        iv = row.interval()
        assert iv.n == 3 and iv.ratio == pytest.approx(1.0) and iv.half_width == pytest.approx(0.0)
        assert all(s.discarded for s in row.samples if s.round == 0)


def test_pinned_threads_leave_one_cpu_free():
    assert bench.pinned_thread_args({0, 1, 2, 3}) == ["-t", "3", "-C", "0xf", "--cpu-strict", "1"]
    assert bench.pinned_thread_args({4, 5}) == ["-t", "1", "-C", "0x30", "--cpu-strict", "1"]
    assert bench.pinned_thread_args({0}) == ["-t", "1", "-C", "0x1", "--cpu-strict", "1"]


def test_rows_differing_outside_the_label_get_their_own_label_and_verdict(tmp_path):
    result = bench.BenchResult()
    for fa, noise in ((0, [0.0, 0.0005]), (1, [0.0, 0.3])):
        entry = {"n_prompt": 0, "n_gen": 128, "n_ubatch": 512, "flash_attn": fa}
        for rnd in range(6):
            for side in bench.SIDES:
                ts = 40.0 * (1 + (noise[rnd % 2] if side == "candidate" else 0))
                bench._add_invocation(result, [{**entry, "samples_ts": [ts]}], side, rnd, 0, 0)
    labels = [row.label for row in result.rows.values()]
    assert len(set(labels)) == 2 and all("flash_attn=" in label for label in labels)
    verdict = result.converged(0.03)
    assert sorted(verdict.values()) == [False, True]  # the noisy row is not hidden behind the steady one


def test_measured_rounds_start_abba_after_warmup_and_a_missing_plant_is_refused(tmp_path):
    base = _fake_build(tmp_path, "a", _drifting(10, [0.0]))
    cand = _fake_build(tmp_path, "b", _drifting(10, [0.0]))
    result = bench.ab_bench({"baseline": base, "candidate": cand}, _plan(tmp_path, rounds=2, reps=2, warmup_rounds=1))
    assert [r["order"][0] for r in result.rounds if not r["warmup"]] == ["baseline", "candidate"]
    plan = _plan(tmp_path, rounds=2, reps=2, env={"candidate": {bench.SLOWDOWN_KNOB: "5"}})
    with pytest.raises(UserError, match="did not apply LLAMA_MOE_DEBUG_SLOWDOWN_PCT=5"):
        bench.ab_bench({"baseline": base, "candidate": cand}, plan)  # the stand-in never says it slowed down


def test_limit_row_values_match_booleans():
    assert bench_limits._same_value(True, "1") and bench_limits._same_value(False, "false")
    assert not bench_limits._same_value(False, "1") and bench_limits._same_value(0, "0")


def test_steal_share_of_a_round():
    # /proc/stat's cpu line: user nice system idle iowait irq softirq steal [guest guest_nice]
    before = [100, 0, 50, 800, 0, 0, 0, 50, 0, 0]
    after = [400, 0, 100, 1150, 0, 0, 0, 150, 0, 0]
    assert bench._steal_share(before, after) == pytest.approx(100 / 800)
    assert bench._steal_share(None, after) is None and bench._steal_share(before, before) is None
    assert bench._steal_share([1, 2, 3], [4, 5, 6]) is None  # a kernel too old to count steal
