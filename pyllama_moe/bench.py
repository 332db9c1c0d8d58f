"""`pyllama-moe bench`: llama-bench of two builds on one model, builds alternated, ratio of medians per test.

Each round runs llama-bench once per build (baseline first in even rounds, candidate first in odd ones, so
neither build always runs on a warmer machine), `-r REPS` repetitions each, JSON output. Samples of all
rounds are pooled per test and build; the table shows both medians, the candidate/baseline ratio of medians,
and the spread (max-min over median) of each side. Absolute numbers only mean something on the GPU machine.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pyllama_moe.build import Build
from pyllama_moe.errors import UserError
from pyllama_moe.progress import say

# llama-bench JSON fields that identify a test (everything that is a setting, not a result or a build id)
TEST_FIELDS = ("n_prompt", "n_gen", "n_depth", "n_batch", "n_ubatch", "n_gpu_layers", "n_cpu_moe", "type_k",
               "type_v", "flash_attn", "load_mode", "no_host", "repack", "tensor_buft_overrides", "n_threads",
               "no_op_offload", "split_mode")


@dataclass
class TestRow:
    key: tuple
    label: str
    samples: dict[str, list[float]] = field(default_factory=dict)  # side -> tokens/s samples

    def median(self, side: str) -> float | None:
        values = self.samples.get(side)
        return statistics.median(values) if values else None

    def spread(self, side: str) -> float | None:
        values = self.samples.get(side)
        if not values:
            return None
        med = statistics.median(values)
        return (max(values) - min(values)) / med if med else None

    def ratio(self) -> float | None:
        base, cand = self.median("baseline"), self.median("candidate")
        return cand / base if base and cand is not None else None


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
    return " ".join(str(p) for p in parts)


def run_llama_bench(build: Build, args: list[str], env: dict | None = None) -> list[dict]:
    exe = build.tool("llama-bench")
    cmd = [str(exe), *args, "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-10:])
        sys.stderr.write(tail + "\n")
        raise UserError(f"llama-bench of the {build.variant} build failed (exit {proc.returncode}): {' '.join(cmd)}",
                        "see the log lines above; check the llama-bench arguments")
    try:
        return json.loads(proc.stdout)
    except ValueError as exc:
        raise UserError(f"llama-bench of the {build.variant} build printed no JSON", "run it by hand to see why") from exc


def ab_bench(baseline: Build, candidate: Build, model: Path, bench_args: list[str], rounds: int = 2, reps: int = 5,
             baseline_env: dict | None = None, candidate_env: dict | None = None) -> list[TestRow]:
    if not Path(model).is_file():
        raise UserError(f"model {model} does not exist", "pass a GGUF file (make one with `pyllama-moe synth`)")
    args = ["-m", str(model), "-r", str(reps), *bench_args]
    rows: dict[tuple, TestRow] = {}
    sides = [("baseline", baseline, baseline_env), ("candidate", candidate, candidate_env)]
    for rnd in range(rounds):
        order = sides if rnd % 2 == 0 else sides[::-1]
        for side, build, env in order:
            say(f"round {rnd + 1}/{rounds}: llama-bench {build.variant} ({side})")
            for entry in run_llama_bench(build, args, env):
                key = tuple(entry.get(f) for f in TEST_FIELDS)
                row = rows.setdefault(key, TestRow(key, test_label(entry)))
                row.samples.setdefault(side, []).extend(entry.get("samples_ts") or [entry["avg_ts"]])
    return list(rows.values())


def format_table(rows: list[TestRow], base_name: str, cand_name: str) -> str:
    head = f"| test | {base_name} t/s (median) | spread | {cand_name} t/s (median) | spread | ratio |"
    lines = [head, "|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        b, c, r = row.median("baseline"), row.median("candidate"), row.ratio()
        bs, cs = row.spread("baseline"), row.spread("candidate")
        lines.append(f"| {row.label} | {b:.2f} | {bs:.1%} | {c:.2f} | {cs:.1%} | {r:.3f} |" if None not in (b, c, r, bs, cs)
                     else f"| {row.label} | {b} | | {c} | | n/a |")
    return "\n".join(lines)


def to_json(rows: list[TestRow], meta: dict) -> str:
    return json.dumps({"meta": meta, "tests": [
        {"test": r.label, "median_baseline": r.median("baseline"), "median_candidate": r.median("candidate"),
         "ratio": r.ratio(), "spread_baseline": r.spread("baseline"), "spread_candidate": r.spread("candidate"),
         "samples": r.samples} for r in rows]}, indent=1)
