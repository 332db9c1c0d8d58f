"""`pyllama-moe first-tokens`: how fast the first tokens after a prompt decode against the steady rate, per setting.

One paced driver (tools/paced-bench) per setting; each repetition resets the cache, decodes the prompt, then the
first and (after a warm-up stretch) the steady tokens, so the ratio first / steady pairs two chunks seconds apart in
one process, and the interval is over rounds as bench's is. See docs/benchmarks.md, "`first-tokens`".
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from pyllama_moe.bench import paced_process as paced
from pyllama_moe.bench.stats import paired_ratio_interval
from pyllama_moe.build.builder import Build
from pyllama_moe.errors import UserError
from pyllama_moe.progress import say

LOAD_TIMEOUT_S = 600.0
STEP_TIMEOUT_S = 600.0


@dataclass
class Setting:
    name: str
    env: dict[str, str] = field(default_factory=dict)


def parse_setting(text: str) -> Setting:
    """NAME or NAME=VAR=VALUE[,VAR=VALUE...]: a setting's label and the environment its process runs with."""
    name, _, rest = text.partition("=")
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise UserError(f"--setting {text!r} has no valid name", "write NAME=VAR=VALUE,..., e.g. seed-off=LLAMA_MOE_CACHE_SEED=0")
    env = {}
    for pair in filter(None, rest.split(",")):
        var, sep, value = pair.partition("=")
        if not sep or not var:
            raise UserError(f"--setting {text!r}: {pair!r} is not VAR=VALUE", "e.g. seed-off=LLAMA_MOE_CACHE_SEED=0")
        env[var] = value
    return Setting(name, env)


@dataclass
class Samples:
    prompt: list[float] = field(default_factory=list)  # t/s of each repetition's prompt
    first: list[float] = field(default_factory=list)   # t/s of its first F tokens
    steady: list[float] = field(default_factory=list)  # t/s of its F tokens after the W more
    rounds: list[tuple[float, float]] = field(default_factory=list)  # per round: mean steady, mean first
    # every token's ms of each repetition's first and steady F (on CUDA the first after a prompt runs without a CUDA
    # graph and the second captures one)
    first_tokens_ms: list[list[float]] = field(default_factory=list)
    steady_tokens_ms: list[list[float]] = field(default_factory=list)
    # the expert cache's decode hit rate over the first and the steady F tokens (empty without a cache)
    first_hits: list[float] = field(default_factory=list)
    steady_hits: list[float] = field(default_factory=list)

    @property
    def first_token_ms(self) -> list[float]:
        """The first token of each repetition's first F (after a prompt: the first decode graph)."""
        return [chunk[0] for chunk in self.first_tokens_ms]

    @property
    def steady_token_ms(self) -> list[float]:
        """The first token of each repetition's steady F."""
        return [chunk[0] for chunk in self.steady_tokens_ms]


def _hit_rate(before: dict, after: dict) -> float | None:
    looked_up = after["hits"] - before["hits"] + after["misses"] - before["misses"]
    return (after["hits"] - before["hits"]) / looked_up if looked_up else None


def _timed_chunk(proc: paced.PacedProcess, n: int, counters: bool) -> tuple[float, list[float], float | None]:
    """`tg-more n`: its t/s, each token's ms, and the cache's decode hit rate over it (None without counters)."""
    before = proc.run("moe-cache-counters", STEP_TIMEOUT_S) if counters else None
    reply = proc.run(f"tg-more {n}", STEP_TIMEOUT_S)
    after = proc.run("moe-cache-counters", STEP_TIMEOUT_S) if counters else None
    rate = _hit_rate(before, after) if counters else None
    return n / (reply["ns"] / 1e9), [ns / 1e6 for ns in reply["token_ns"]], rate


def _record(rates: list[float], tokens_ms: list[list[float]], hits: list[float],
            chunk: tuple[float, list[float], float | None]):
    rates.append(chunk[0])
    tokens_ms.append(chunk[1])
    if chunk[2] is not None:
        hits.append(chunk[2])


def _has_counters(proc: paced.PacedProcess) -> bool:
    try:
        proc.run("moe-cache-counters", STEP_TIMEOUT_S)
        return True
    except UserError:
        return False  # a build without the cache (master): rates only


def measure(build: Build, spec: paced.PacedSpec, settings: list[Setting], *, rounds: int, reps: int, first: int,
            warm: int, reset: bool = True, log_dir: Path | None = None) -> dict[str, Samples]:
    """The samples of each setting; spec.n_prompt is the prompt's length."""
    if rounds < 1 or reps < 1 or first < 1 or warm < 0:
        raise UserError("first-tokens needs --rounds, --reps and --first of at least 1, --warm of at least 0",
                        "e.g. --rounds 3 --reps 3 --first 16 --warm 96")
    need = spec.n_prompt + 2 * first + warm
    spec.n_ctx = max(spec.n_ctx or 0, need)
    exe = paced.ensure_tool(build)
    out = {s.name: Samples() for s in settings}
    for rnd in range(rounds):
        started = time.monotonic()
        procs = {s.name: paced.PacedProcess(exe, spec, s.env, label=s.name,
                                            log_path=log_dir / f"first-tokens-r{rnd}-{s.name}.log" if log_dir else None)
                 for s in settings}
        per_round = {s.name: ([], []) for s in settings}
        try:
            for proc in procs.values():
                proc.start()
            for proc in procs.values():
                proc.wait_ready(LOAD_TIMEOUT_S)
            for proc in procs.values():
                proc.run("tg 1", STEP_TIMEOUT_S)  # llama-bench's warm-up of a generation
            counters = {name: _has_counters(proc) for name, proc in procs.items()}
            for rep in range(reps):
                order = settings if rep % 2 == 0 else settings[::-1]
                for s in order:
                    proc, got = procs[s.name], out[s.name]
                    if reset:
                        proc.run("moe-cache-reset", STEP_TIMEOUT_S)
                    got.prompt.append(spec.n_prompt / (proc.run(f"pp {spec.n_prompt}", STEP_TIMEOUT_S)["ns"] / 1e9))
                    _record(got.first, got.first_tokens_ms, got.first_hits, _timed_chunk(proc, first, counters[s.name]))
                    if warm:
                        proc.run(f"tg-more {warm}", STEP_TIMEOUT_S)
                    _record(got.steady, got.steady_tokens_ms, got.steady_hits, _timed_chunk(proc, first, counters[s.name]))
                    per_round[s.name][0].append(got.steady[-1])
                    per_round[s.name][1].append(got.first[-1])
        finally:
            for proc in procs.values():
                proc.close()
        for name, (steady, first_rates) in per_round.items():
            out[name].rounds.append((statistics.fmean(steady), statistics.fmean(first_rates)))
        say(f"round {rnd + 1}: " + "; ".join(f"{n}: first {out[n].rounds[-1][1]:.2f} t/s, steady {out[n].rounds[-1][0]:.2f}"
                                           for n in out) + f" ({time.monotonic() - started:.0f} s)")
    return out


def report(samples: dict[str, Samples], spec: paced.PacedSpec, first: int, warm: int) -> str:
    """The table: per setting the medians and the ratio first / steady with its interval over rounds."""
    lines = [f"| setting | pp{spec.n_prompt} t/s | first {first} t/s | steady {first} t/s (after {first + warm}) | "
             f"first / steady [95% CI] | tokens 1, 2, 3 ms: first / steady | hit rate, first / steady | rounds x reps |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]

    def pct(values):
        return f"{statistics.fmean(values):.1%}" if values else "n/a"

    def leading_ms(chunks):  # the median over repetitions of each of a chunk's first three tokens
        return ", ".join(f"{statistics.median(c[i] for c in chunks):.1f}" for i in range(min(3, min(map(len, chunks)))))

    for name, s in samples.items():
        iv = paired_ratio_interval(s.rounds)
        ci = f"{iv.ratio:.3f}" + (f" [{iv.low:.3f}, {iv.high:.3f}]" if iv.low is not None else " (one round: no interval)")
        lines.append(f"| {name} | {statistics.median(s.prompt):.1f} | {statistics.median(s.first):.2f} | "
                     f"{statistics.median(s.steady):.2f} | {ci} | {leading_ms(s.first_tokens_ms)} / "
                     f"{leading_ms(s.steady_tokens_ms)} | {pct(s.first_hits)} / {pct(s.steady_hits)} | "
                     f"{len(s.rounds)} x {len(s.first) // len(s.rounds)} |")
    return "\n".join(lines)


def to_json(samples: dict[str, Samples], spec: paced.PacedSpec, first: int, warm: int) -> str:
    rows = {}
    for name, s in samples.items():
        iv = paired_ratio_interval(s.rounds)
        rows[name] = {"prompt_ts": s.prompt, "first_ts": s.first, "steady_ts": s.steady, "rounds": s.rounds,
                      "ratio": iv.ratio, "low": iv.low, "high": iv.high, "first_token_ms": s.first_token_ms,
                      "steady_token_ms": s.steady_token_ms, "first_tokens_ms": s.first_tokens_ms,
                      "steady_tokens_ms": s.steady_tokens_ms, "first_hit_rate": s.first_hits,
                      "steady_hit_rate": s.steady_hits}
    return json.dumps({"n_prompt": spec.n_prompt, "n_ubatch": spec.n_ubatch, "first": first, "warm": warm,
                       "settings": rows}, indent=1)
