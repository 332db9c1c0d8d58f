"""`pyllama-moe bench --paced`: rounds in which both builds stay loaded and their repetitions alternate.

Both builds' drivers load at once, so their repetitions are seconds apart instead of a model load apart; a round
still ends with both processes, because a process's placement is part of the noise and the interval pairs rounds
(`pyllama_moe.bench.stats`). See docs/benchmarks.md, "Paced mode".
"""

from __future__ import annotations

import time
from pathlib import Path

from pyllama_moe.bench import paced_process as paced
from pyllama_moe.bench.rounds import SIDES, BenchPlan, RoundRunner, check_planted_slowdown
from pyllama_moe.build.builder import Build
from pyllama_moe.errors import UserError

# llama-bench flags the driver takes, with the PacedSpec field each sets and how to read its value
_FLAGS = {"-p": ("n_prompt", int), "-n": ("n_gen", int), "-b": ("n_batch", int), "-ub": ("n_ubatch", int),
          "-ngl": ("n_gpu_layers", int), "-ncmoe": ("n_cpu_moe", int), "-lm": ("load_mode", str),
          "-t": ("n_threads", int), "-C": ("cpu_mask", str), "--cpu-strict": ("cpu_strict", lambda v: v == "1"),
          "--poll": ("poll", int), "-fa": ("flash_attn", str)}
_LONG = {"--n-prompt": "-p", "--n-gen": "-n", "--batch-size": "-b", "--ubatch-size": "-ub", "--n-gpu-layers": "-ngl",
         "--n-cpu-moe": "-ncmoe", "--load-mode": "-lm", "--threads": "-t", "--cpu-mask": "-C", "--flash-attn": "-fa"}
LOAD_TIMEOUT_S = 600.0  # two 17 GB models copied into pinned memory at once
REP_TIMEOUT_S = 600.0


def parse_spec(model: Path, bench_args: list[str]) -> paced.PacedSpec:
    """The one test a paced run measures, from llama-bench-style arguments (one value per flag)."""
    values: dict = {"model": str(model), "n_prompt": 0, "n_gen": 0}
    it = iter(bench_args)
    for flag in it:
        flag = _LONG.get(flag, flag)
        if flag not in _FLAGS:
            raise UserError(f"bench --paced does not take the llama-bench argument {flag}",
                            "use one value each of: " + " ".join(_FLAGS))
        raw = next(it, None)
        if raw is None or "," in raw:
            raise UserError(f"bench --paced needs exactly one value after {flag} (got {raw!r})",
                            "a paced run measures one test; run the others separately")
        name, convert = _FLAGS[flag]
        try:
            values[name] = convert(raw)
        except ValueError as exc:
            raise UserError(f"bench --paced: {flag} {raw!r} is not a valid value", "see llama-bench --help") from exc
    if bool(values["n_prompt"]) == bool(values["n_gen"]):
        raise UserError("bench --paced measures either a prompt or a generation test",
                        "give -p N -n 0 (prompt) or -p 0 -n N (generation)")
    return paced.PacedSpec(**values)


def spec_fields(spec: paced.PacedSpec) -> dict:
    """The llama-bench JSON fields of the test, so rows are labelled and keyed like llama-bench's."""
    return {"n_prompt": spec.n_prompt, "n_gen": spec.n_gen, "n_batch": spec.n_batch, "n_ubatch": spec.n_ubatch,
            "n_gpu_layers": spec.n_gpu_layers, "n_cpu_moe": spec.n_cpu_moe, "load_mode": spec.load_mode or "auto",
            "n_threads": spec.n_threads, "cpu_mask": spec.cpu_mask, "cpu_strict": spec.cpu_strict, "poll": spec.poll,
            "flash_attn": spec.flash_attn}


DEFAULT_CHUNK = 16  # tokens per tg-more: ~0.4 s at 40 t/s, below the seconds over which decode drifts


def _turns(order: tuple[str, ...], rep: int, chunked: bool) -> tuple[str, ...]:
    """Which build runs first in one step of repetition `rep`: whole repetitions alternate A B, B A, ..., chunks
    alternate strictly A B A B, so that no chunk runs right after one of its own build (with A B B A chunks the
    second build read faster: docs/benchmarks.md, "Paced mode", "The order of the turns")."""
    return order if chunked or rep % 2 == 0 else order[::-1]


def paced_rounds(builds: dict[str, Build], plan: BenchPlan, chunk: int = DEFAULT_CHUNK) -> RoundRunner:
    """Paced rounds of the one test in plan.bench_args. A generation test is measured in chunks of `chunk`
    tokens alternating between the builds (0: whole repetitions alternate), so both builds' samples span the
    same seconds: on the GPU machine decode rates jump by 10-20% from one 3-second repetition to the next
    (results/benchmark-statistics.md), on both builds at once."""
    if chunk < 0:
        raise UserError(f"--paced-chunk {chunk} is negative", "give a token count, or 0 to alternate whole repetitions")
    spec = parse_spec(plan.model, plan.bench_args)
    exes = {side: paced.ensure_tool(builds[side]) for side in SIDES}  # compile before the first round
    kind = "pp" if spec.n_prompt else "tg"
    warmup = "pp" if kind == "pp" else "tg 1"  # llama-bench's warm-up: the whole prompt, or one token
    fields = spec_fields(spec)
    # the commands of one repetition: the whole test, or a generation started and then continued in chunks
    n_tokens = spec.n_prompt if kind == "pp" else spec.n_gen
    chunked = kind == "tg" and 0 < chunk < spec.n_gen
    steps = [f"tg-more {min(chunk, n_tokens - done)}" for done in range(0, n_tokens, chunk)] if chunked else [kind]

    def run(order: tuple[str, ...]) -> dict[str, tuple[list[dict], float]]:
        started = time.monotonic()
        procs = {side: paced.PacedProcess(exes[side], spec, plan.env.get(side)) for side in order}
        samples: dict[str, list[float]] = {side: [] for side in order}
        try:
            for side in order:
                procs[side].start()  # both load at once
            for side in order:
                procs[side].wait_ready(LOAD_TIMEOUT_S)
            for side in order:
                procs[side].run(warmup, REP_TIMEOUT_S)
                check_planted_slowdown(plan.env.get(side), procs[side].log_path.read_text(errors="replace"),
                                       f"the paced driver of the {builds[side].variant} build")
            for rep in range(plan.reps):
                if chunked:
                    for side in order:
                        procs[side].run("tg-start", REP_TIMEOUT_S)
                ns = dict.fromkeys(order, 0)
                for cmd in steps:
                    for side in _turns(order, rep, chunked):
                        ns[side] += procs[side].run(cmd, REP_TIMEOUT_S)["ns"]
                for side in order:
                    samples[side].append(n_tokens / (ns[side] / 1e9))
        finally:
            for proc in procs.values():
                proc.close()
        half = (time.monotonic() - started) / 2  # the sides shared the round's time
        return {side: ([{**fields, "samples_ts": samples[side]}], half) for side in order}

    return run
