"""Verbs that run models: `run`, `compare`, `bench`, `demo`."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from pyllama_moe.errors import UserError
from pyllama_moe.paths import CI_DIR

DEFAULT_MATRIX = CI_DIR / "matrix.toml"
DEFAULT_BENCH_ARGS = ["-p", "512", "-n", "32", "-ub", "512", "-t", "2"]  # llama-bench fits only with -fitt


def _threads(args) -> int:
    return args.threads or min(4, os.cpu_count() or 1)


def _source(args):
    """The source the runner takes the llama_cpp package from: an archive's when building from archives."""
    from pyllama_moe import packs, source

    if getattr(args, "archive_dir", None):
        return packs.archive_source(args.archive_dir / "llama.cpp-master.tar.gz", "master")
    if getattr(args, "archive", None):
        return packs.archive_source(args.archive, args.variant)
    return source.ensure_source(getattr(args, "sdist", None), getattr(args, "llama_src", None))


def cmd_run(args) -> int:
    from pyllama_moe import runner
    from pyllama_moe.build import resolve

    src = _source(args)
    built = resolve(args.variant, args.backend, sdist=args.sdist, llama_src=args.llama_src, archive=args.archive,
                    make=not args.no_build)
    prompt = Path(args.prompt_file).read_text() if args.prompt_file else args.prompt
    spec = runner.RunSpec(model=args.model, prompt=prompt, n_gpu_layers=args.ngl, cpu_moe=args.cpu_moe,
                          n_cpu_moe=args.n_cpu_moe, load_mode=args.load_mode, repack=not args.no_repack,
                          n_ubatch=args.ubatch, threads=_threads(args), generate=args.generate,
                          )
    result = runner.run(built, src, spec)
    if args.logits_out:
        import numpy as np

        np.save(args.logits_out, result.logits)
    reply = {"build": str(built.path), "variant": built.variant, "positions": int(result.logits.shape[0]),
             "logits_sha256": result.logits_sha256, "generated": result.generated, "text": result.text}
    print(json.dumps(reply, indent=1) if args.json else f"logits sha256 {result.logits_sha256}\n{result.text}")
    return 0


def _select_cells(args):
    from pyllama_moe.matrix import load_matrix

    matrix = load_matrix(args.matrix)
    matrix.defaults = {**matrix.defaults, "baseline": args.baseline, "candidate": args.candidate}
    cells = matrix.cells(args.subset)
    if args.backend:
        cells = [c for c in cells if c.backend in args.backend.split(",")]
    if args.limit:
        cells = cells[: args.limit]
    if not cells:
        raise UserError(f"no cell of {args.matrix} matches the selection", "check --subset and --backend")
    return matrix, cells


def run_compare(args) -> tuple[int, list, dict]:
    from pyllama_moe import compare

    matrix, cells = _select_cells(args)
    src = _source(args)
    builds = compare.resolve_builds(cells, make=not args.no_build, archive_dir=args.archive_dir,
                                    sdist=args.sdist, llama_src=args.llama_src)
    harness = compare.Harness(matrix, src, builds, _threads(args))
    results = compare.run_matrix(harness, cells, on_result=lambda r: print(compare.format_row(r), flush=True))
    rc, counts = compare.summarize(results)
    print(f"{counts['pass']} passed, {counts['fail']} failed, {counts['deferred']} deferred"
          + ("" if counts["pass"] else " (no cell passed: the run fails)"))
    if args.json:
        Path(args.json).write_text(compare.to_json(results, counts))
    return rc, results, counts


def cmd_compare(args) -> int:
    return run_compare(args)[0]


def run_bench(args, model: Path) -> str:
    from pyllama_moe import bench
    from pyllama_moe.build import resolve

    kw = dict(sdist=args.sdist, llama_src=args.llama_src, make=not args.no_build)
    archive = lambda v: (args.archive_dir / f"llama.cpp-{v}.tar.gz") if args.archive_dir else None  # noqa: E731
    base = resolve(args.baseline, args.backend, archive=archive(args.baseline), **kw)
    cand = resolve(args.candidate, args.backend, archive=archive(args.candidate), **kw)
    bench_args = args.bench_args or DEFAULT_BENCH_ARGS
    rows = bench.ab_bench(base, cand, model, bench_args, rounds=args.rounds, reps=args.reps,
                          candidate_env=dict(kv.split("=", 1) for kv in (args.candidate_env or [])))
    table = bench.format_table(rows, args.baseline, args.candidate)
    meta = {"model": str(model), "baseline": str(base.path), "candidate": str(cand.path), "args": bench_args,
            "rounds": args.rounds, "reps": args.reps, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.json:
        Path(args.json).write_text(bench.to_json(rows, meta))
    return table


def cmd_bench(args) -> int:
    from pyllama_moe import models
    from pyllama_moe.matrix import load_matrix

    if args.bench_args and args.bench_args[0] == "--":
        args.bench_args = args.bench_args[1:]
    if args.model:
        model = args.model
    else:
        matrix = load_matrix(args.matrix)
        if args.synth not in matrix.models:
            raise UserError(f"no model {args.synth!r} in {args.matrix}", f"use one of: {', '.join(matrix.models)}")
        model = models.ensure_model(args.synth, matrix.models[args.synth])
    print(run_bench(args, Path(model)))
    return 0


def cmd_demo(args) -> int:
    """Build CPU master + patched, make a small synthetic MoE, run the identity subset and a short bench."""
    from pyllama_moe import models
    from pyllama_moe.matrix import load_matrix

    args.matrix, args.subset = DEFAULT_MATRIX, "demo"
    args.baseline, args.candidate = "master", "patched"
    args.backend, args.limit, args.archive_dir, args.json = "cpu", None, None, None
    rc, results, counts = run_compare(args)
    matrix = load_matrix(DEFAULT_MATRIX)
    model = models.ensure_model("qwen3moe", matrix.models["qwen3moe"])
    args.bench_args, args.rounds, args.reps, args.candidate_env = None, 2, 3, None
    print("\nA/B llama-bench on the CPU (ratios only; absolute numbers mean something on the GPU machine):")
    print(run_bench(args, model))
    return rc


def _add_common(p: argparse.ArgumentParser, variant: bool = False) -> None:
    from pyllama_moe.cli import _add_build_args, _add_source_args

    if variant:
        _add_build_args(p)
    else:
        _add_source_args(p)
    p.add_argument("--no-build", action="store_true", help="fail instead of building a missing build")
    p.add_argument("-t", "--threads", type=int, help="CPU threads (default: min(4, cores))")


def register(sub) -> None:
    p = sub.add_parser("run", help="run a GGUF with one build: all-position logits and greedy text")
    p.add_argument("model", type=Path)
    _add_common(p, variant=True)
    p.add_argument("--prompt", default="The quick brown fox")
    p.add_argument("--prompt-file", type=Path)
    p.add_argument("-ngl", "--n-gpu-layers", dest="ngl", type=int, default=99)
    p.add_argument("-cmoe", "--cpu-moe", action="store_true")
    p.add_argument("-ncmoe", "--n-cpu-moe", type=int, default=0)
    p.add_argument("-lm", "--load-mode", choices=("mmap", "none"), default="mmap")
    p.add_argument("-nr", "--no-repack", action="store_true")
    p.add_argument("-ub", "--ubatch", type=int, default=512)
    p.add_argument("-n", "--generate", type=int, default=32)
    p.add_argument("--logits-out", type=Path, help="write the all-position logits (f32) as .npy")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("compare", help="identity matrix: baseline build against candidate build")
    p.add_argument("--baseline", choices=("master", "patched"), default="master")
    p.add_argument("--candidate", choices=("master", "patched"), default="patched")
    p.add_argument("--matrix", type=Path, default=DEFAULT_MATRIX)
    p.add_argument("--subset", help="a [subsets.NAME] of the matrix file, or `full` (default: full)")
    p.add_argument("--backend", help="only cells of these backends (comma-separated)")
    p.add_argument("--limit", type=int, help="only the first N cells")
    p.add_argument("--archive-dir", type=Path, help="build from llama.cpp-<variant>.tar.gz archives in this folder")
    p.add_argument("--json", type=Path, help="also write the results as JSON to this file")
    _add_common(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("bench", help="A/B llama-bench of two builds, alternated; ratio of medians per test")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path)
    src.add_argument("--synth", help="a model defined in the matrix file (made once, cached)")
    p.add_argument("--matrix", type=Path, default=DEFAULT_MATRIX)
    p.add_argument("--baseline", choices=("master", "patched"), default="master")
    p.add_argument("--candidate", choices=("master", "patched"), default="patched")
    p.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--rounds", type=int, default=2, help="alternations of the two builds")
    p.add_argument("--reps", type=int, default=5, help="llama-bench -r per run")
    p.add_argument("--candidate-env", action="append", metavar="NAME=VALUE", help="environment for the candidate only")
    p.add_argument("--archive-dir", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then llama-bench arguments "
                   f"(default: {' '.join(DEFAULT_BENCH_ARGS)})")
    _add_common(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("demo", help="build CPU master + patched, run the identity subset and a short bench")
    _add_common(p)
    p.set_defaults(func=cmd_demo)

