"""The decode hit rate of the tokens generated after a prompt, the expert cache's seeding on and off, on SIM with the
CPU patched build (results/expert-cache-seeding-and-profiles.md's table): the tiny qwen3moe of ci/matrix.toml with routing skew 2, a
2 MiB cache (5 of 16 slots a layer), a 512-token prompt at ub 128 in one call. Run from the project root:

    python tools/seed_hit_rates.py
"""
from __future__ import annotations

from pyllama_moe.build.builder import resolve
from pyllama_moe.build.ffi import decode_hit_rate
from pyllama_moe.harness import models, runner
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.paths import CI_DIR
from pyllama_moe.source import sdist as source

ENV = {"GGML_SIM_DEVICES": "1", "GGML_SIM_POISON": "1", "GGML_SIM_COPY_LATENCY_US": "50", "GGML_SCHED_PREFETCH": "2",
       "LLAMA_MOE_CACHE_MIB": "2"}
PROMPT = [(i * 7919) % 4000 + 16 for i in range(512)]


def main() -> None:
    build = resolve("patched", "cpu")
    src = source.ensure_source(None, None)
    model = models.ensure_model("qwen3moe-skew2", {**load_matrix(CI_DIR / "matrix.toml").models["qwen3moe"], "skew": 2.0})
    print("| generated tokens (decode steps) | seeded | not seeded |\n|---|---:|---:|")
    for generate in (2, 4, 16, 64):
        rates = []
        for seed in ("1", "0"):
            spec = runner.RunSpec(model=model, tokens=PROMPT, cpu_moe=True, load_mode="none", repack=False, threads=2,
                                  n_ubatch=128, n_batch=512, generate=generate, stats=True,
                                  env={**ENV, "LLAMA_MOE_CACHE_SEED": seed})
            got = runner.run(build, src, spec)
            rates.append(decode_hit_rate(got.stats["generate"]["cache_decode"], since=got.stats["prompt"]["cache_decode"]))
        print(f"| {generate} ({generate - 1}) | {rates[0]:.3f} | {rates[1]:.3f} |")


if __name__ == "__main__":
    main()
