"""Host synchronizations per decoded token of the patched build, with the asynchronous input upload off
(GGML_SCHED_ASYNC_INPUT=0: a synchronization plus a blocking copy per host input, as master does) and on.

    python3 ci/gpu/syncs_per_token.py --archive-dir .work/archives --model MODEL.gguf [--backend cuda]

Every expert on the host (--cpu-moe), a 600-token prompt at ub 512, then 32 greedy tokens; the counters are
llama-moe.h's (llama_moe_get_stats), read by the worker for the generation phase alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pyllama_moe.build.builder import resolve
from pyllama_moe.harness import runner
from pyllama_moe.source import packs, sdist as source


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--archive-dir", type=Path)
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--generate", type=int, default=32)
    args = ap.parse_args()
    archive = args.archive_dir / "llama.cpp-patched.tar.gz" if args.archive_dir else None
    build = resolve("patched", args.backend, archive=archive)
    # the llama_cpp package the worker imports: the archive's where there is no registry to fetch the sdist from
    src = packs.archive_source(archive, "patched") if archive else source.ensure_source()
    tokens = [(i * 7919) % 4000 + 16 for i in range(600)]
    env_extra = {"GGML_SIM_DEVICES": "1"} if args.backend == "cpu" else {}
    print("| async input | tokens | host syncs / token | upload syncs / token | splits with host inputs / token |")
    print("|---|---:|---:|---:|---:|")
    texts = {}
    for async_input in ("0", "1"):
        spec = runner.RunSpec(model=args.model, tokens=tokens, n_ubatch=512, cpu_moe=True, generate=args.generate,
                              want_logits=False, stats=True, env={**env_extra, "GGML_SCHED_ASYNC_INPUT": async_input})
        res = runner.run(build, src, spec)
        gen = res.stats["generate"]
        n = max(gen["n_graph_computes"], 1)
        texts[async_input] = res.generated
        print(f"| {'on' if async_input == '1' else 'off (master path)'} | {gen['n_graph_computes']} | "
              f"{gen['n_host_syncs'] / n:.1f} | {gen['n_host_syncs_upload'] / n:.1f} | {gen['n_splits_host_input'] / n:.1f} |")
    print(f"greedy tokens identical with the upload off and on: {texts['0'] == texts['1']}")
    return 0 if texts["0"] == texts["1"] else 1


if __name__ == "__main__":
    sys.exit(main())
