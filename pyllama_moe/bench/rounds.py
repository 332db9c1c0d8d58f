"""`pyllama-moe bench`: A/B llama-bench of two builds on one model, as paired rounds with confidence intervals.

A round runs llama-bench once per build, in ABBA order so that a linear drift favours neither; each run's first
`discard` repetitions are warm-up, the rest one block mean, and the interval comes from the rounds' pairs
(`pyllama_moe.bench.stats`). With `target_ci` rounds go on until every interval is narrow enough or the time is
spent. See docs/benchmarks.md, "`bench`: paired rounds" and "The stopping rule".
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pyllama_moe.bench import stats
from pyllama_moe.build.builder import Build
from pyllama_moe.errors import UserError
from pyllama_moe.progress import say

SIDES = ("baseline", "candidate")
SCHEMA = 2
# llama-bench JSON fields that identify a test (everything that is a setting, not a result or a build id)
TEST_FIELDS = ("n_prompt", "n_gen", "n_depth", "n_batch", "n_ubatch", "n_gpu_layers", "n_cpu_moe", "type_k",
               "type_v", "flash_attn", "load_mode", "no_host", "repack", "tensor_buft_overrides", "n_threads",
               "cpu_mask", "cpu_strict", "poll", "no_op_offload", "split_mode")
# llama-bench dimensions of the patched build alone: not in TEST_FIELDS (master's JSON has no such field, and rows
# pair across the builds by those), so one bench measures one value of each
PATCHED_ONLY_DIMENSIONS = ("-mcm", "--moe-cache-mib", "-pf", "--sched-prefetch", "-pfd", "--sched-prefetch-depth",
                           "-pfs", "--sched-prefetch-staging", "-mmp", "--moe-miss-policy", "-lmp",
                           "--layer-major-prompt", "-lms", "--layer-major-staging")
# rounds before an interval may stop a run: stopping as soon as an interval is narrow favours runs whose spread
# came out small by chance, common with few rounds (docs/benchmarks.md, "The stopping rule")
MIN_ROUNDS_FOR_TARGET = 5


@dataclass(frozen=True)
class Sample:
    side: str
    round: int
    invocation: int  # position in the run's sequence of llama-bench processes
    rep: int
    ts: float  # tokens per second of this repetition
    discarded: bool  # warm-up: not used in any statistic
    # the expert cache's hit rate in this repetition, over its cached layers and per layer ("il=rate,..."), where the
    # build reports one (patched llama-bench with a cache; hits.py)
    hit_rate: float | None = None
    layer_hit_rates: str | None = None
    # ... and the bytes its decode steps uploaded from the host (the misses' experts: what crossed PCIe)
    upload_bytes: int | None = None
    # the host-weight bytes this repetition uploaded to the devices ahead of their splits (the prefetch's copies, staged
    # layer groups included) and those it found kept on a device instead, where the build reports them (host_uploads.py)
    host_upload_bytes: int | None = None
    host_kept_bytes: int | None = None


@dataclass
class BenchRow:
    key: tuple
    label: str
    fields: dict
    samples: list[Sample] = field(default_factory=list)

    def kept(self, side: str) -> list[float]:
        return [ts for block in self.blocks(side).values() for ts in block]

    def block_means(self, side: str) -> dict[int, float]:
        blocks = self.blocks(side)
        return {rnd: statistics.fmean(values) for rnd, values in blocks.items()}

    def blocks(self, side: str) -> dict[int, list[float]]:
        out: dict[int, list[float]] = {}
        for s in self.samples:
            if s.side == side and not s.discarded:
                out.setdefault(s.round, []).append(s.ts)
        return out

    def median(self, side: str) -> float | None:
        values = self.kept(side)
        return statistics.median(values) if values else None

    def interval(self, confidence: float = stats.CONFIDENCE) -> stats.RatioInterval | None:
        base, cand = self.block_means("baseline"), self.block_means("candidate")
        return stats.paired_ratio_interval([(base[r], cand[r]) for r in sorted(base) if r in cand], confidence)

    def noise(self, side: str) -> dict:
        """Per-sample CV, the CV of repetitions inside one process, and the CV between processes' means."""
        return {"samples": len(self.kept(side)), "cv_sample": stats.cv(self.kept(side)),
                "cv_within": stats.within_cv(list(self.blocks(side).values())),
                "cv_between": stats.cv(list(self.block_means(side).values()))}


@dataclass
class BenchPlan:
    model: Path
    bench_args: list[str]
    reps: int = 3
    discard: int = 1
    rounds: int = 4  # without target_ci: the number of rounds; with it: the least number
    warmup_rounds: int = 0  # rounds run first and left out of every statistic (a machine that sat idle)
    target_ci: float | None = None  # relative half-width every test's interval must reach, e.g. 0.03
    max_seconds: float | None = None  # time budget of the rounds (a round that would not fit is not started)
    env: dict[str, dict] = field(default_factory=dict)  # side -> extra environment of that build's runs

    def check(self) -> None:
        if not Path(self.model).is_file():
            raise UserError(f"model {self.model} does not exist", "pass a GGUF file (make one with `pyllama-moe synth`)")
        if self.reps < 1 or not 0 <= self.discard < self.reps:
            raise UserError(f"--reps {self.reps} with --discard {self.discard} keeps no repetition",
                            "use --reps greater than --discard (e.g. --reps 3 --discard 1)")
        if self.rounds < 1 or self.warmup_rounds < 0:
            raise UserError(f"--rounds {self.rounds} --warmup-rounds {self.warmup_rounds}",
                            "use at least one round and no negative number of warm-up rounds")
        if self.target_ci is not None and not 0 < self.target_ci < 1:
            raise UserError(f"--target-ci {self.target_ci} is not a relative half-width",
                            "give a fraction such as 0.03 (for +/- 3%)")
        for flag in ("-r", "--repetitions", "-o", "--output"):
            if flag in self.bench_args:
                raise UserError(f"llama-bench argument {flag} is set by bench itself", "use --reps, and --json for output")
        for i, flag in enumerate(self.bench_args[:-1]):
            if flag in PATCHED_ONLY_DIMENSIONS and "," in self.bench_args[i + 1]:
                raise UserError(f"llama-bench {flag} {self.bench_args[i + 1]}: bench pairs rows by the test fields master's "
                                "llama-bench reports too, so the values of this patched-only dimension would share a row",
                                f"run one value of {flag} per bench (the candidate's can come from --candidate-env)")


@dataclass
class BenchResult:
    rows: dict[tuple, BenchRow] = field(default_factory=dict)
    rounds: list[dict] = field(default_factory=list)  # per round: order of the sides, seconds per invocation
    stop_reason: str = ""
    seconds: float = 0.0

    def too_few_rounds(self, target: float | None) -> list[str]:
        """Labels of the tests whose interval is within +/- target but rests on fewer rounds than a target needs."""
        out = []
        for row in self.rows.values():
            iv = row.interval()
            if (target and iv and iv.half_width is not None and iv.half_width <= target
                    and iv.n < MIN_ROUNDS_FOR_TARGET):
                out.append(row.label)
        return out

    def converged(self, target: float | None) -> dict[str, bool]:
        """Per test label: whether its interval is at most +/- target (only meaningful with a target)."""
        out = {}
        for row in self.rows.values():
            iv = row.interval()
            out[row.label] = bool(iv and iv.half_width is not None and iv.n >= MIN_ROUNDS_FOR_TARGET
                                  and iv.half_width <= target) if target else False
        return out


THREAD_FLAGS = ("-t", "--threads", "-C", "--cpu-mask", "--cpu-strict")


def pinned_thread_args(cpus: set[int] | None = None) -> list[str]:
    """llama-bench arguments for one compute thread pinned to each usable CPU but the last: on the GPU machine
    a thread on every CPU was 2-4% faster and several times noisier (the main and CUDA threads had to share
    a pinned core), see results/benchmark-statistics.md."""
    cpus = set(os.sched_getaffinity(0)) if cpus is None else cpus
    mask = sum(1 << c for c in cpus)
    return ["-t", str(max(1, len(cpus) - 1)), "-C", hex(mask), "--cpu-strict", "1"]


def test_label(entry: dict) -> str:
    if entry.get("n_prompt") and entry.get("n_gen"):
        name = f"pp{entry['n_prompt']}+tg{entry['n_gen']}"
    elif entry.get("n_prompt"):
        name = f"pp{entry['n_prompt']}"
    else:
        name = f"tg{entry.get('n_gen')}"
    if entry.get("n_depth"):
        name += f"@d{entry['n_depth']}"
    parts = [name, f"ub{entry.get('n_ubatch')}", f"ngl{entry.get('n_gpu_layers')}", f"ncmoe{entry.get('n_cpu_moe')}",
             f"lm={entry.get('load_mode')}"]
    if entry.get("n_threads") is not None:
        parts.append(f"t{entry['n_threads']}")
    if entry.get("cpu_strict"):  # threads pinned one per CPU of the mask
        parts.append(f"pinned{entry.get('cpu_mask')}")
    return " ".join(str(p) for p in parts)


SLOWDOWN_KNOB = "LLAMA_MOE_DEBUG_SLOWDOWN_PCT"


def check_planted_slowdown(env: dict | None, stderr: str, who: str) -> None:
    """A run asked for a planted loss must show that the build applied it (a master build, or a value the
    build refused, would silently measure no loss and pass for a test the statistics failed)."""
    value = (env or {}).get(SLOWDOWN_KNOB, "")
    if value not in ("", "0") and f"{SLOWDOWN_KNOB}={value}: every compute is made" not in stderr:
        raise UserError(f"{who} did not apply {SLOWDOWN_KNOB}={value}",
                        "plant the slowdown in a patched build, with a whole number of percent (0..1000)")


def per_side(result: BenchResult, side_value, key: str) -> dict[str, dict]:
    """Per row label where side_value(row, side) is not None for some side: {key: {side: value}} (the JSON's rows)."""
    out = {}
    for row in result.rows.values():
        sides = {side: v for side in SIDES if (v := side_value(row, side)) is not None}
        if sides:
            out[row.label] = {key: sides}
    return out


def run_llama_bench(build: Build, args: list[str], env: dict | None = None) -> list[dict]:
    exe = build.tool("llama-bench")
    cmd = [str(exe), *args, "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-10:])
        sys.stderr.write(tail + "\n")
        raise UserError(f"llama-bench of the {build.variant} build failed (exit {proc.returncode}): {' '.join(cmd)}",
                        "see the log lines above; check the llama-bench arguments")
    check_planted_slowdown(env, proc.stderr, f"llama-bench of the {build.variant} build")
    try:
        return json.loads(proc.stdout)
    except ValueError as exc:
        raise UserError(f"llama-bench of the {build.variant} build printed no JSON", "run it by hand to see why") from exc


def _add_invocation(result: BenchResult, entries: list[dict], side: str, rnd: int, invocation: int,
                    discard: int) -> None:
    for entry in entries:
        key = tuple(entry.get(f) for f in TEST_FIELDS)
        row = result.rows.setdefault(key, BenchRow(key, test_label(entry), {f: entry.get(f) for f in TEST_FIELDS}))
        hits = entry.get("samples_moe_cache_hit_rate") or []
        layer_hits = entry.get("samples_moe_cache_layer_hit_rates") or []
        uploads = entry.get("samples_moe_cache_upload_bytes") or []
        host_up = entry.get("samples_host_upload_bytes") or []
        host_kept = entry.get("samples_host_kept_bytes") or []
        for rep, ts in enumerate(entry.get("samples_ts") or [entry["avg_ts"]]):
            hit = float(hits[rep]) if rep < len(hits) and hits[rep] >= 0 else None
            layers = layer_hits[rep] if rep < len(layer_hits) and hit is not None else None
            uploaded = int(uploads[rep]) if rep < len(uploads) and hit is not None else None
            row.samples.append(Sample(side, rnd, invocation, rep, float(ts), rep < discard, hit, layers, uploaded,
                                      int(host_up[rep]) if rep < len(host_up) else None,
                                      int(host_kept[rep]) if rep < len(host_kept) else None))
    _unique_labels(list(result.rows.values()))


def _unique_labels(rows: list[BenchRow]) -> None:
    """Tests that differ only in a setting the short label leaves out (-fa 0,1; -b 2048,4096) get that setting
    appended: verdicts, limit rows and tables are looked up by label."""
    groups: dict[str, list[BenchRow]] = {}
    for row in rows:
        groups.setdefault(test_label(row.fields), []).append(row)
    for base, group in groups.items():
        differing = [f for f in TEST_FIELDS if len({repr(r.fields.get(f)) for r in group}) > 1]
        for row in group:
            row.label = " ".join([base, *(f"{f}={row.fields.get(f)}" for f in differing)])


# A round runner measures one round: given the order of the sides, it returns per side the llama-bench-shaped
# JSON entries of that round (one per test, with "samples_ts") and the seconds the side took.
RoundRunner = Callable[[tuple[str, ...]], dict[str, tuple[list[dict], float]]]


def llama_bench_rounds(builds: dict[str, Build], plan: BenchPlan) -> RoundRunner:
    """One llama-bench process per build and round, one after the other in the round's order."""
    args = ["-m", str(plan.model), "-r", str(plan.reps), *plan.bench_args]

    def run(order: tuple[str, ...]) -> dict[str, tuple[list[dict], float]]:
        out = {}
        for side in order:
            t0 = time.monotonic()
            entries = run_llama_bench(builds[side], args, plan.env.get(side))
            out[side] = (entries, time.monotonic() - t0)
        return out

    return run


def _cpu_times() -> list[int] | None:
    """The machine's CPU time counters (the `cpu` line of /proc/stat), None where there is no such file."""
    try:
        with open("/proc/stat") as fh:
            return [int(v) for v in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def _steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """Share of CPU time the hypervisor gave to others between two readings (field 8 of /proc/stat's cpu line):
    on a virtual machine, the first suspect when a round is slow on both sides."""
    if not before or not after or len(before) < 8 or len(after) < 8:
        return None
    total = sum(after[:8]) - sum(before[:8])
    return (after[7] - before[7]) / total if total > 0 else None


def ab_bench(builds: dict[str, Build], plan: BenchPlan, on_round: Callable[[BenchResult], None] | None = None,
             runner: RoundRunner | None = None) -> BenchResult:
    """Rounds until the plan says stop (default runner: one llama-bench process per build and round);
    `on_round` sees the result after each measured round."""
    plan.check()
    run_round = runner or llama_bench_rounds(builds, plan)
    result = BenchResult()
    started = time.monotonic()
    rnd = 0
    while True:
        warmup = rnd < plan.warmup_rounds
        # ABBA counted from the first measured round, so any even number of measured rounds is balanced
        order = SIDES if (rnd - plan.warmup_rounds) % 2 == 0 else SIDES[::-1]
        cpu_before = _cpu_times()
        measured = run_round(order)
        steal = _steal_share(cpu_before, _cpu_times())
        for side in order:
            entries, _ = measured[side]
            _add_invocation(result, entries, side, rnd, 2 * rnd + order.index(side), plan.reps if warmup else plan.discard)
        result.rounds.append({"round": rnd, "order": list(order), "warmup": warmup,
                              "seconds": {side: round(measured[side][1], 2) for side in order},
                              "steal": None if steal is None else round(steal, 4)})
        rnd += 1
        if warmup:
            say(f"warm-up round {rnd}/{plan.warmup_rounds} done (left out of the statistics)")
            started = time.monotonic()  # the time budget is for measured rounds
            continue
        result.seconds = time.monotonic() - started
        done = rnd - plan.warmup_rounds
        stolen = f" (CPU steal {steal:.1%})" if steal else ""
        say(f"round {done}: " + "; ".join(_round_note(row) for row in result.rows.values()) + stolen)
        if on_round:
            on_round(result)
        reason = _stop_reason(result, plan, done)
        if reason:
            result.stop_reason = reason
            return result


def _round_note(row: BenchRow) -> str:
    iv = row.interval()
    if iv is None:
        return f"{row.label}: no pair"
    spread = f" +/-{iv.half_width:.1%}" if iv.half_width is not None else ""
    return f"{row.label}: {iv.ratio:.3f}{spread}"


def _stop_reason(result: BenchResult, plan: BenchPlan, done: int) -> str:
    if done >= plan.rounds:
        if plan.target_ci is None:
            return f"{done} rounds"
        # only after an even number of rounds: each build then led as often as the other, so an advantage of
        # running first or second cancels in the ratio instead of tilting it by half a round's share
        if done % 2 == 0 and all(result.converged(plan.target_ci).values()):
            return f"every interval within +/-{plan.target_ci:.1%} after {done} rounds"
    if plan.max_seconds is not None and result.seconds + _last_round_seconds(result) > plan.max_seconds:
        return f"time budget: {result.seconds:.0f} s of {plan.max_seconds:.0f} s spent after {done} rounds"
    return ""


def _last_round_seconds(result: BenchResult) -> float:
    measured = [r for r in result.rounds if not r.get("warmup")]
    return sum(measured[-1]["seconds"].values()) if measured else 0.0


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:.1%}"


def _interval_text(iv: stats.RatioInterval | None) -> tuple[str, str]:
    if iv is None:
        return "n/a", ""
    if iv.low is None:
        return f"{iv.ratio:.3f}", "(1 round)"
    return f"{iv.ratio:.3f} [{iv.low:.3f}, {iv.high:.3f}]", f"+/-{iv.half_width:.1%}"


def format_table(result: BenchResult, names: dict[str, str], target: float | None = None,
                 extra: dict[str, dict[str, str]] | None = None) -> str:
    """One row per test: medians, ratio with interval, rounds; `extra` adds columns (label -> column -> text)."""
    extra = extra or {}
    extra_cols = sorted({c for cols in extra.values() for c in cols})
    converged = result.converged(target) if target else {}
    few = set(result.too_few_rounds(target))
    head = (f"| test | {names['baseline']} t/s | {names['candidate']} t/s | ratio [95% CI] | +/- | rounds |"
            + "".join(f" {c} |" for c in extra_cols))
    lines = [head, "|---|---:|---:|---:|---:|---:|" + "---:|" * len(extra_cols)]
    for row in result.rows.values():
        b, c = row.median("baseline"), row.median("candidate")
        iv = row.interval()
        ratio, half = _interval_text(iv)
        mark = ""
        if target and not converged.get(row.label):
            mark = (f" (within +/-{target:.1%}, but a target needs {MIN_ROUNDS_FOR_TARGET} rounds)"
                    if row.label in few else " (not converged)")
        cells = [row.label + mark, f"{b:.2f}" if b else "n/a", f"{c:.2f}" if c else "n/a", ratio, half,
                 str(iv.n if iv else 0), *(extra.get(row.label, {}).get(col, "") for col in extra_cols)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_noise(result: BenchResult, names: dict[str, str]) -> str:
    """The noise of each side: what the intervals are made of, and what a study of the machine compares."""
    lines = ["| test | build | samples | CV per sample | CV within a process | CV between processes |",
             "|---|---|---:|---:|---:|---:|"]
    for row in result.rows.values():
        for side in SIDES:
            n = row.noise(side)
            lines.append(f"| {row.label} | {names[side]} | {n['samples']} | {_pct(n['cv_sample'])} | "
                         f"{_pct(n['cv_within'])} | {_pct(n['cv_between'])} |")
    return "\n".join(lines)


def row_json(row: BenchRow, target: float | None, converged: dict[str, bool]) -> dict:
    iv = row.interval()
    return {"test": row.label, "key": row.fields,
            "median_baseline": row.median("baseline"), "median_candidate": row.median("candidate"),
            "ratio": iv.ratio if iv else None, "ci_low": iv.low if iv else None, "ci_high": iv.high if iv else None,
            "half_width": iv.half_width if iv else None, "n_pairs": iv.n if iv else 0,
            "converged": converged.get(row.label) if target else None,
            "noise": {side: row.noise(side) for side in SIDES},
            "samples": [vars(s) for s in row.samples]}


def to_json(result: BenchResult, meta: dict, target: float | None = None,
            extra_rows: dict[str, dict] | None = None) -> str:
    """Schema 2: every sample with its round, invocation and repetition; per test the interval and noise."""
    converged = result.converged(target) if target else {}
    tests = []
    for row in result.rows.values():
        entry = row_json(row, target, converged)
        entry.update((extra_rows or {}).get(row.label, {}))
        tests.append(entry)
    full_meta = {"schema": SCHEMA, "method": stats.METHOD, "confidence": stats.CONFIDENCE,
                 "stop_reason": result.stop_reason, "seconds": round(result.seconds, 1), "rounds_log": result.rounds,
                 **meta}
    return json.dumps({"meta": full_meta, "tests": tests}, indent=1)


def write_atomically(path: Path, text: str) -> None:
    """A results file is either the previous complete one or the new complete one, never half of each."""
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text)
    os.replace(tmp, path)
