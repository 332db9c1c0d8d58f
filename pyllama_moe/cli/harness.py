"""Verbs that run models: `run`, `compare`, `bench`, `demo`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from pyllama_moe.arguments import (choice_list, count, input_dir, input_file, LLAMA_THREADS, MIB, miss_policy,
                                   output_file, real_number, refuse_overwrite, seconds, threads_or_all, whole_number)
from pyllama_moe.cli.args import check_bench_numbers, check_cache_has_a_device, check_cpu_moe_layers
from pyllama_moe.errors import UserError
from pyllama_moe.paths import CI_DIR

DEFAULT_MATRIX = CI_DIR / "matrix.toml"
DEFAULT_BENCH_ARGS = ["-p", "512", "-n", "32", "-ub", "512", "-t", "2"]  # llama-bench fits only with -fitt
DEFAULT_TARGET_SECONDS = 900.0  # bench --target-ci without --max-seconds
DEFAULT_PROMPT = "The quick brown fox"


def _threads(args) -> int:
    return threads_or_all(args.threads, min(4, os.cpu_count() or 1))


def _source(args):
    """The source the runner takes the llama_cpp package from: an archive's when building from archives."""
    from pyllama_moe.source import packs

    if getattr(args, "archive_dir", None):
        return packs.archive_source(args.archive_dir / "llama.cpp-master.tar.gz", "master")
    if getattr(args, "archive", None):
        return packs.archive_source(args.archive, args.variant)
    return packs.python_source(getattr(args, "sdist", None), getattr(args, "llama_src", None))


def _seed_env(seed: str | None) -> dict[str, str]:
    """The environment of --moe-cache-seed on|off (None: the process's own, LLAMA_MOE_CACHE_SEED or on)."""
    return {} if seed is None else {"LLAMA_MOE_CACHE_SEED": "1" if seed == "on" else "0"}


def _async_cpu_env(switch: str | None) -> dict[str, str]:
    """The environment of --sched-async-cpu on|off (None: the process's own, GGML_SCHED_ASYNC_CPU or off)."""
    return {} if switch is None else {"GGML_SCHED_ASYNC_CPU": "1" if switch == "on" else "0"}


def _miss_policy_env(policy: str | None) -> dict[str, str]:
    """The environment of --moe-miss-policy upload|cpu|split:N (None: the process's own, LLAMA_MOE_MISS_POLICY or
    upload)."""
    return {} if policy is None else {"LLAMA_MOE_MISS_POLICY": policy}


def _layer_major_env(switch: str | None) -> dict[str, str]:
    """The environment of --layer-major-prompt on|off (None: the process's own, LLAMA_LAYER_MAJOR_PROMPT or on)."""
    return {} if switch is None else {"LLAMA_LAYER_MAJOR_PROMPT": "1" if switch == "on" else "0"}


def _profile_env(path: Path | None) -> dict[str, str]:
    """The environment of --moe-cache-profile FILE (an absolute path: the worker runs elsewhere)."""
    return {} if path is None else {"LLAMA_MOE_CACHE_PROFILE": str(Path(path).resolve())}


def _check_run(args) -> None:
    """Everything `run` can refuse, before it fetches or builds anything."""
    for flag, value in (("--moe-cache-mib", args.moe_cache_mib), ("--moe-cache-seed", args.moe_cache_seed),
                        ("--moe-cache-profile", args.moe_cache_profile), ("--moe-miss-policy", args.moe_miss_policy)):
        if value is not None and args.variant != "patched":
            raise UserError(f"{flag} needs the patched build (master has no expert cache)",
                            "drop it or use --variant patched")
    if args.sched_async_cpu is not None and args.variant != "patched":
        raise UserError("--sched-async-cpu needs the patched build (master computes CPU splits on the calling thread)",
                        "drop it or use --variant patched")
    if args.layer_major_prompt is not None and args.variant != "patched":
        raise UserError("--layer-major-prompt needs the patched build (master computes prompts ubatch by ubatch)",
                        "drop it or use --variant patched")
    if args.moe_cache_mib:  # 0 is no cache, on any build
        check_cache_has_a_device("-mcm/--moe-cache-mib", args.backend)
    if args.prompt_file is not None and args.prompt is not None:
        raise UserError("--prompt and --prompt-file both give the prompt", "give one of them")
    refuse_overwrite({"--logits-out": args.logits_out}, {"model": args.model, "--prompt-file": args.prompt_file,
                                                         "--moe-cache-profile": args.moe_cache_profile})
    info = check_cpu_moe_layers("-ncmoe/--n-cpu-moe", args.n_cpu_moe, args.model, "model")
    if args.moe_cache_profile is not None and args.moe_cache_profile.exists():
        _check_profile_fits(args.moe_cache_profile, args.model, info)


def _check_profile_fits(path: Path, model: Path, info) -> None:
    """A profile that is no profile, or one of another model, is refused before the run: the build would only log
    the refusal and run on with an empty cache. (The router weights' hash only the build can check.)"""
    from pyllama_moe.plot import profile

    try:
        p = profile.read(path)
    except UserError as exc:
        raise UserError(f"argument --moe-cache-profile: {exc.what}", exc.fix) from None
    ours = (p.arch, p.n_layer, p.n_expert, p.n_expert_used)
    theirs = (info.arch, int(info.arch_key("block_count", 0)), int(info.arch_key("expert_count", 0)),
              int(info.arch_key("expert_used_count", 0)))
    if ours != theirs:
        raise UserError(f"argument --moe-cache-profile: {path} is of another model ({p.arch}, {p.n_layer} layers, "
                        f"{p.n_expert} experts, top-{p.n_expert_used}; {model}: {theirs[0]}, {theirs[1]} layers, "
                        f"{theirs[2]} experts, top-{theirs[3]})", "give this model's profile, or a new file to start one")


def _show_moe_alerts(lines: list[str]) -> None:
    """The patched build's warnings and errors (a refused profile, a cache that did not fit), which change what
    the run measured: shown on stderr, above the result."""
    for line in lines:
        print(line, file=sys.stderr)


def cmd_run(args) -> int:
    from pyllama_moe.build.builder import resolve
    from pyllama_moe.harness import runner

    _check_run(args)
    prompt = args.prompt_file.read_text() if args.prompt_file else (args.prompt or DEFAULT_PROMPT)
    src = _source(args)
    built = resolve(args.variant, args.backend, sdist=args.sdist, llama_src=args.llama_src, archive=args.archive,
                    make=not args.no_build)
    spec = runner.RunSpec(model=args.model, prompt=prompt, n_gpu_layers=args.ngl, cpu_moe=args.cpu_moe,
                          n_cpu_moe=args.n_cpu_moe, load_mode=args.load_mode, repack=not args.no_repack,
                          n_ubatch=args.ubatch, threads=_threads(args), generate=args.generate,
                          moe_cache_mib=args.moe_cache_mib, stats=args.moe_cache_mib is not None,
                          env={**_seed_env(args.moe_cache_seed), **_profile_env(args.moe_cache_profile),
                               **_async_cpu_env(args.sched_async_cpu), **_miss_policy_env(args.moe_miss_policy),
                               **_layer_major_env(args.layer_major_prompt)})
    result = runner.run(built, src, spec)
    _show_moe_alerts(result.moe_alerts)
    if args.logits_out:
        import numpy as np

        np.save(args.logits_out, result.logits)
    reply = {"build": str(built.path), "variant": built.variant, "positions": int(result.logits.shape[0]),
             "logits_sha256": result.logits_sha256, "generated": result.generated, "text": result.text}
    cache_line = ""
    if result.stats:
        from pyllama_moe.build.ffi import decode_hit_rate

        decode = result.stats["generate"]["cache_decode"]
        reply["cache_decode"] = decode
        rate = decode_hit_rate(decode)
        rate_text = "n/a" if rate is None else f"{rate:.1%}"
        cache_line = f"\nexpert cache, decode: {decode['n_ubatches']} layer steps, hit rate {rate_text}"
        if "n_cold" in decode:  # a build with a miss policy: the misses it did not upload
            cache_line += f", {decode['n_misses']} misses uploaded, {decode['n_cold']} computed on the CPU"
    print(json.dumps(reply, indent=1) if args.json else f"logits sha256 {result.logits_sha256}\n{result.text}{cache_line}")
    return 0


def _select_cells(args):
    from pyllama_moe.harness.matrix import load_matrix

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
    from pyllama_moe.harness import compare

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
    refuse_overwrite({"--json": args.json}, {"--matrix": args.matrix})
    return run_compare(args)[0]


def _env_pairs(values: list[str] | None, flag: str) -> dict:
    env = {}
    for kv in values or []:
        name, sep, value = kv.partition("=")
        if not sep or not name:
            raise UserError(f"{flag} {kv!r} is not NAME=VALUE", f"e.g. {flag} LLAMA_MOE_DEBUG_SLOWDOWN_PCT=5")
        env[name] = value
    return env


def run_bench(args, model: Path) -> str:
    from pyllama_moe.bench import hits as bench_hits, host_uploads as bench_host, limits as bench_limits, rounds as bench
    from pyllama_moe.build.builder import resolve

    def build(variant: str, archive: Path | None):  # only the tools bench runs, so a bench-only build dir is enough
        # an archive named for one side may hold another patch series than this checkout's (before/after a change)
        other_series = archive is not None
        if archive is None and args.archive_dir:
            archive = args.archive_dir / f"llama.cpp-{variant}.tar.gz"
        return resolve(variant, args.backend, sdist=args.sdist, llama_src=args.llama_src, make=not args.no_build,
                       archive=archive, other_series=other_series, targets=bench_limits.BENCH_TARGETS[variant])

    archives = {"baseline": args.baseline_archive, "candidate": args.candidate_archive}
    names = {"baseline": args.baseline, "candidate": args.candidate}
    if args.baseline == args.candidate:
        # the same variant twice: told apart by the archive each side was built from, where one was given
        names = {side: f"{getattr(args, side)} ({archives[side].name if archives[side] else ab})"
                 for side, ab in (("baseline", "A"), ("candidate", "B"))}
    bench_args = _thread_args(args, list(args.bench_args or DEFAULT_BENCH_ARGS))
    limit = bench_limits.parse_limit_row(args.limit_row) if args.limit_row else None
    plan = bench.BenchPlan(model=model, bench_args=bench_args, reps=args.reps, discard=args.discard,
                           rounds=args.rounds, warmup_rounds=args.warmup_rounds, target_ci=args.target_ci,
                           max_seconds=args.max_seconds,
                           env={"baseline": _env_pairs(args.baseline_env, "--baseline-env"),
                                "candidate": _env_pairs(args.candidate_env, "--candidate-env")})
    if args.moe_cache_mib is not None:
        if args.candidate != "patched":
            raise UserError("--moe-cache-mib sets the candidate's expert cache, and the candidate is master",
                            "use --candidate patched")
        plan.env["candidate"]["LLAMA_MOE_CACHE_MIB"] = str(args.moe_cache_mib)
    if args.moe_cache_seed is not None:
        if args.candidate != "patched":
            raise UserError("--moe-cache-seed sets the candidate's expert cache, and the candidate is master",
                            "use --candidate patched")
        plan.env["candidate"].update(_seed_env(args.moe_cache_seed))
    plan.check()
    _check_bench_model(args, model, bench_args, plan.env["candidate"])
    builds = {side: build(getattr(args, side), archives[side]) for side in ("baseline", "candidate")}
    probes = []
    if args.pcie_bound:
        probes = [p for p in [bench_limits.run_copy_probe(builds)] if p]
    meta = {"model": str(model), "baseline": str(builds["baseline"].path), "candidate": str(builds["candidate"].path),
            "baseline_name": names["baseline"], "candidate_name": names["candidate"], "args": bench_args,
            "reps": args.reps, "discard": args.discard, "rounds_min": args.rounds, "warmup_rounds": args.warmup_rounds,
            "target_ci": args.target_ci,
            "max_seconds": args.max_seconds, "env": plan.env, "limit_row": args.limit_row,
            "limit_from": args.limit_from if args.limit_row else None, "paced": args.paced,
            "paced_chunk": args.paced_chunk if args.paced else None,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}

    def extras(result) -> tuple[dict, dict]:
        limits = bench_limits.limit_shares(result, *limit, limit_from=args.limit_from) if limit else {}
        pcie = bench_limits.pcie_columns(result, model, probes) if probes else {}
        hits = bench_hits.hit_rates(result)
        host = bench_host.host_uploads(result)
        bound = bench_limits.cache_bound(result, limits, hits, probes)
        rows = {label: {**limits.get(label, {}), **pcie.get(label, {}), **hits.get(label, {}), **bound.get(label, {}),
                        **host.get(label, {})}
                for label in {*limits, *pcie, *hits, *bound, *host}}
        columns = bench_limits.limit_columns(limits, pcie, names, bound)
        for label, cols in [*bench_hits.hit_columns(hits, names).items(),
                            *bench_host.host_upload_columns(host, names).items()]:
            columns.setdefault(label, {}).update(cols)
        return rows, columns

    def save(result) -> None:  # after every round, so a run cut short keeps what it measured
        if args.json:
            bench.write_atomically(Path(args.json), bench.to_json(result, {**meta, "probes": probes},
                                                                  args.target_ci, extras(result)[0]))

    runner = None
    if args.paced:
        from pyllama_moe.bench import paced_rounds as bench_paced

        runner = bench_paced.paced_rounds(builds, plan, args.paced_chunk)
    result = bench.ab_bench(builds, plan, on_round=save, runner=runner)
    if args.pcie_bound and probes:
        probes += [p for p in [bench_limits.run_copy_probe(builds)] if p]  # before and after: drift shows
    save(result)  # again: the stop reason and the second probe came after the last round's save
    table = bench.format_table(result, names, args.target_ci, extras(result)[1])
    lines = [table, "", bench.format_noise(result, names), "", f"stopped: {result.stop_reason} ({result.seconds:.0f} s)"]
    layer_hits = bench_hits.format_layer_hits(bench_hits.hit_rates(result), names)
    if layer_hits:
        lines[1:1] = ["", layer_hits]
    if probes:
        lines.append("pinned host-to-device bandwidth: " + ", ".join(f"{p['pinned_gbps']:.1f} GB/s" for p in probes)
                     + f" ({probes[0].get('device')})")
    if args.target_ci:
        few = result.too_few_rounds(args.target_ci)
        missed = [label for label, ok in result.converged(args.target_ci).items() if not ok and label not in few]
        if few:
            lines.append(f"within +/-{args.target_ci:.1%} but on fewer than {bench.MIN_ROUNDS_FOR_TARGET} rounds, "
                         "the fewest a target counts: " + ", ".join(few))
        if missed:
            lines.append(f"not converged to +/-{args.target_ci:.1%}: " + ", ".join(missed))
        elif not few:
            lines.append(f"every interval within +/-{args.target_ci:.1%}")
    return "\n".join(lines)


def _thread_args(args, bench_args: list[str]) -> list[str]:
    """llama-bench's threads from one place: the user's own llama-bench arguments, --pin-threads, or bench -t N
    (0: all cores, as llama.cpp's -t 0), each in place of the default arguments' -t."""
    from pyllama_moe.bench import rounds as bench

    own = [a for a in (args.bench_args or []) if a in bench.THREAD_FLAGS]
    ways = [way for way, given in (("-t/--threads", args.threads is not None), ("--pin-threads", args.pin_threads),
                                   (f"the llama-bench argument {own[0]}" if own else "", bool(own))) if given]
    if len(ways) > 1:
        raise UserError(f"{ways[0]} and {ways[1]} both set llama-bench's threads", "give one of them")
    if args.threads is None and not args.pin_threads:
        return bench_args
    without_t = [a for i, a in enumerate(bench_args) if "-t" not in (a, bench_args[i - 1] if i else None)]
    if args.pin_threads:
        return without_t + bench.pinned_thread_args()
    return without_t + ["-t", str(threads_or_all(args.threads, 1))]


def _check_bench_model(args, model: Path, bench_args: list[str], candidate_env: dict[str, str]) -> None:
    """The checks that need the model or the whole plan, before either build."""
    from pyllama_moe.cli.args import bench_flag_values

    refuse_overwrite({"--json": args.json}, {"--model": model})
    if args.moe_cache_mib or any(bench_flag_values(bench_args, ("-mcm", "--moe-cache-mib"))):
        check_cache_has_a_device("-mcm/--moe-cache-mib", args.backend, candidate_env)
    # one header read for every -ncmoe value (none given: still read, so a bad model stops here)
    check_cpu_moe_layers("-ncmoe (llama-bench)", max(bench_flag_values(bench_args, ("-ncmoe", "--n-cpu-moe")) or [0]),
                         model)
    if args.archive_dir is not None and not args.archive_dir.is_dir() and None in (args.baseline_archive,
                                                                                      args.candidate_archive):
        raise UserError(f"--archive-dir {args.archive_dir} is not a folder",
                        "give the folder of `source pack` archives")


def cmd_bench(args) -> int:
    from pyllama_moe.harness import models
    from pyllama_moe.harness.matrix import load_matrix

    if args.bench_args and args.bench_args[0] == "--":
        args.bench_args = args.bench_args[1:]
    if args.target_ci and args.max_seconds is None:
        args.max_seconds = DEFAULT_TARGET_SECONDS
    check_bench_numbers(args.bench_args or [])  # before a --synth model is made
    if args.model:
        model = args.model
    else:
        matrix = load_matrix(args.matrix)
        if args.synth not in matrix.models:
            raise UserError(f"no model {args.synth!r} in {args.matrix}", f"use one of: {', '.join(matrix.models)}")
        model = models.ensure_model(args.synth, matrix.models[args.synth])
    print(run_bench(args, Path(model)))
    return 0


DEMO_LEGEND = ("rows: pp512 = a 512-token prompt, tg32 = 32 generated tokens; ub = ubatch size; ngl = layers on "
               "the GPU (none on a CPU build); ncmoe = MoE layers whose experts stay on the CPU; lm = load mode "
               "(mmap or none); t = CPU threads")


def cmd_demo(args) -> int:
    """Build CPU master + patched, make a small synthetic MoE, run the identity subset and a short bench."""
    from pyllama_moe.harness import models
    from pyllama_moe.harness.matrix import load_matrix

    args.matrix, args.subset = DEFAULT_MATRIX, "demo"
    args.baseline, args.candidate = "master", "patched"
    args.backend, args.limit, args.archive_dir, args.json = "cpu", None, None, None
    print("1. Identity: the patched build against master on the CPU. Each cell compares all-position logits, "
          "perplexity log-probs and greedy tokens byte for byte; the control cell (CPU repack on against off) "
          "must differ, which shows the comparison can see a difference.", flush=True)
    rc, results, counts = run_compare(args)
    controls = [r for r in results if r.cell.expect != "identical"]
    cells = [r for r in results if r.cell.expect == "identical"]
    matrix = load_matrix(DEFAULT_MATRIX)
    model = models.ensure_model("qwen3moe", matrix.models["qwen3moe"])
    args.bench_args, args.rounds, args.reps, args.discard, args.warmup_rounds = None, 2, 3, 1, 0
    args.candidate_env = args.baseline_env = args.limit_row = args.target_ci = args.max_seconds = args.moe_cache_mib = None
    args.moe_cache_seed = args.baseline_archive = args.candidate_archive = None
    args.limit_from = "own"
    args.pcie_bound = args.paced = args.pin_threads = False
    args.paced_chunk = 0
    print("\n2. Benchmark tooling, a smoke run: A/B llama-bench in 2 paired rounds on the CPU. Its intervals are "
          "wide and its ratios mean nothing here (the series speeds up GPUs); the figures are measured on a GPU "
          "machine (README, results/).\n" + DEMO_LEGEND, flush=True)
    print(run_bench(args, model))
    same = sum(r.status == "pass" for r in cells)
    caught = sum(r.status == "pass" for r in controls)
    verdict = "PASSED" if rc == 0 else "FAILED"
    print(f"\ndemo {verdict}: {same} of {len(cells)} cells byte-identical to master, {caught} of {len(controls)} "
          f"controls caught their planted difference, {counts['deferred']} deferred; the benchmark tooling ran.")
    return rc


def _add_common(p: argparse.ArgumentParser, variant: bool = False,
                threads_help: str = "CPU threads (default: min(4, cores); 0: all cores, as llama.cpp's -t 0)") -> None:
    from pyllama_moe.cli.args import add_build_args, add_source_args

    if variant:
        add_build_args(p)
    else:
        add_source_args(p)
    p.add_argument("--no-build", action="store_true", help="fail instead of building a missing build")
    p.add_argument("-t", "--threads", type=LLAMA_THREADS, help=threads_help)


def register(sub) -> None:
    p = sub.add_parser("run", help="run a GGUF with one build: all-position logits and greedy text")
    p.add_argument("model", type=input_file("model"), help="the GGUF file")
    _add_common(p, variant=True)
    p.add_argument("--prompt", help=f"the prompt text (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--prompt-file", type=input_file("prompt file"), help="read the prompt from this file instead")
    p.add_argument("-ngl", "--n-gpu-layers", dest="ngl", type=whole_number("a GPU layer count", -1, note="-1: all"),
                   default=99, help="layers on the GPU, as llama.cpp's -ngl (none on a CPU build)")
    p.add_argument("-cmoe", "--cpu-moe", action="store_true", help="keep the experts of every layer on the CPU")
    p.add_argument("-ncmoe", "--n-cpu-moe", type=whole_number("a count of MoE layers", 0), default=0,
                   help="keep the experts of the first N layers on the CPU (at most the model's layers)")
    p.add_argument("-lm", "--load-mode", choices=("mmap", "none"), default="mmap",
                   help="how the weights are loaded: mapped from the file, or read")
    p.add_argument("-nr", "--no-repack", action="store_true", help="no CPU repacking of the weights")
    p.add_argument("-ub", "--ubatch", type=count("a ubatch size"), default=512,
                   help="tokens per physical batch (llama.cpp's -ub)")
    p.add_argument("-n", "--generate", type=whole_number(
        "a token count", 0, note="llama.cpp's -1, until the end, is not offered: a run generates a fixed count, "
                                 "so that two builds' text compares"),
                   default=32, help="greedy tokens generated after the prompt")
    p.add_argument("-mcm", "--moe-cache-mib", type=MIB, metavar="MIB",
                   help="the context's expert cache per GPU in MiB (patched builds; default: LLAMA_MOE_CACHE_MIB)")
    p.add_argument("--moe-cache-seed", choices=("on", "off"),
                   help="seed the expert cache at the prompt's end (patched builds; default: LLAMA_MOE_CACHE_SEED, on)")
    p.add_argument("--moe-cache-profile", type=output_file("profile"), metavar="FILE",
                   help="start the expert cache from this profile where it exists, add the run's expert use counts to it "
                        "at exit (patched builds; default: LLAMA_MOE_CACHE_PROFILE, none); `pyllama-moe profile show FILE`")
    p.add_argument("--sched-async-cpu", choices=("on", "off"),
                   help="compute CPU splits on a worker thread beside the GPU's (patched builds; default: "
                        "GGML_SCHED_ASYNC_CPU, off; docs/async-cpu.md)")
    p.add_argument("--moe-miss-policy", type=miss_policy, metavar="upload|cpu|split:N",
                   help="what decode does with an expert the cache does not hold: upload it, compute it on the CPU, or "
                        "upload at most N a layer step and compute the rest on the CPU (patched builds; default: "
                        "LLAMA_MOE_MISS_POLICY, upload; docs/hot-cold.md)")
    p.add_argument("--layer-major-prompt", choices=("on", "off"),
                   help="compute a prompt of several ubatches layer group by layer group, so that its host weights cross "
                        "to the GPU once per group (patched builds; default: LLAMA_LAYER_MAJOR_PROMPT, on; "
                        "docs/layer-major.md)")
    p.add_argument("--logits-out", type=output_file("logits file"), help="write the all-position logits (f32) as .npy")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("compare", help="identity matrix: baseline build against candidate build")
    p.add_argument("--baseline", choices=("master", "patched"), default="master", help="the build compared against")
    p.add_argument("--candidate", choices=("master", "patched"), default="patched", help="the build checked")
    p.add_argument("--matrix", type=input_file("matrix file"), default=DEFAULT_MATRIX,
                   help="the cells, models and knobs")
    p.add_argument("--subset", help="a [subsets.NAME] of the matrix file, or `full` (default: full)")
    p.add_argument("--backend", type=choice_list("a backend", ("cpu", "cuda")),
                   help="only cells of these backends (comma-separated; default: all)")
    p.add_argument("--limit", type=count("a cell count"), help="only the first N cells (default: all)")
    p.add_argument("--archive-dir", type=input_dir("archive folder"),
                   help="build from llama.cpp-<variant>.tar.gz archives in this folder")
    p.add_argument("--json", type=output_file("JSON file"), help="also write the results as JSON to this file")
    _add_common(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("bench", help="A/B llama-bench of two builds in paired rounds; ratio per test with a 95%% interval")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=input_file("model"), help="the GGUF file (this or --synth is required)")
    src.add_argument("--synth", help="a model defined in the matrix file (made once, cached; this or --model is "
                                     "required, default: none)")
    p.add_argument("--matrix", type=input_file("matrix file"), default=DEFAULT_MATRIX,
                   help="where --synth models are defined")
    p.add_argument("--baseline", choices=("master", "patched"), default="master", help="build A")
    p.add_argument("--candidate", choices=("master", "patched"), default="patched", help="build B")
    p.add_argument("--backend", choices=("cpu", "cuda"), default="cpu", help="the backend both builds are made for")
    p.add_argument("--rounds", type=count("a round count"), default=4,
                   help="rounds of one llama-bench run per build (default 4; with --target-ci: the least number)")
    p.add_argument("--reps", type=count("a repetition count"), default=3, help="llama-bench -r per run (default 3)")
    p.add_argument("--warmup-rounds", type=whole_number("a round count", 0), default=1,
                   help="rounds run first and left out (default 1: on the GPU machine the first process of a run "
                        "after idle time is 3-10%% slow)")
    p.add_argument("--discard", type=whole_number("a repetition count", 0), default=1,
                   help="first repetitions of every run dropped as warm-up (default 1)")
    p.add_argument("--target-ci", type=real_number("a relative half-width", 0, 1, low_open=True, high_open=True),
                   metavar="F",
                   help="go on until every test's 95%% interval is within +/-F (e.g. 0.03) or --max-seconds is spent "
                        "(default: none, --rounds rounds)")
    p.add_argument("--max-seconds", type=seconds(), metavar="S",
                   help="time budget of the rounds (default with --target-ci: 900)")
    p.add_argument("--pin-threads", action="store_true",
                   help="llama-bench threads: one pinned to each usable CPU but one (-t N-1 -C MASK --cpu-strict 1)")
    p.add_argument("--paced", action="store_true",
                   help="both builds loaded at once per round, repetitions alternating (one test; tools/paced-bench "
                        "instead of llama-bench; needs memory for two copies of the model)")
    p.add_argument("--paced-chunk", type=whole_number("a token count", 0), default=16, metavar="N",
                   help="with --paced, a generation test alternates the builds every N tokens of each repetition "
                        "(default 16; 0: whole repetitions alternate)")
    p.add_argument("--limit-row", metavar="FIELD=VALUE",
                   help="show each row's share of the row that differs only in FIELD (e.g. n_cpu_moe=0: all on the GPU)")
    # bench_limits.LIMIT_FROM (not imported here: the CLI starts without the benchmark modules)
    p.add_argument("--limit-from", choices=("own", "baseline"), default="own",
                   help="with --limit-row, whose limit row the candidate's rows are measured against: its own (default) "
                        "or the baseline's (e.g. the patched cache at -ncmoe 48 against master's static -ncmoe 24)")
    p.add_argument("--pcie-bound", action="store_true",
                   help="show prompt rows' share of the PCIe bound (host bytes per ubatch / pinned bandwidth, probed); "
                        "with --limit-row, decode rows with an expert cache get their share of the limit row plus "
                        "their misses' bytes at that bandwidth")
    p.add_argument("--baseline-env", action="append", metavar="NAME=VALUE",
                   help="environment for the baseline only (repeat)")
    p.add_argument("--candidate-env", action="append", metavar="NAME=VALUE",
                   help="environment for the candidate only (repeat)")
    p.add_argument("-mcm", "--moe-cache-mib", type=MIB, metavar="MIB",
                   help="the candidate's expert cache per GPU in MiB (as --candidate-env LLAMA_MOE_CACHE_MIB=MIB; "
                        "default: the environment's LLAMA_MOE_CACHE_MIB, else none)")
    p.add_argument("--moe-cache-seed", choices=("on", "off"),
                   help="the candidate's seeding of its expert cache at a prompt's end (as --candidate-env "
                        "LLAMA_MOE_CACHE_SEED=1|0; default: the environment's LLAMA_MOE_CACHE_SEED, else on)")
    p.add_argument("--archive-dir", type=Path,
                   help="build from llama.cpp-<variant>.tar.gz archives in this folder (default: none, from the source)")
    p.add_argument("--baseline-archive", type=input_file("archive"), metavar="F",
                   help="build the baseline from this `source pack` archive instead of --archive-dir's (e.g. the series "
                        "before a change, packed at that commit)")
    p.add_argument("--candidate-archive", type=input_file("archive"), metavar="F", help="the same for the candidate")
    p.add_argument("--json", type=output_file("JSON file"),
                   help="write every sample, interval and setting as JSON (rewritten each round)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then llama-bench arguments "
                   f"(default: {' '.join(DEFAULT_BENCH_ARGS)})")
    _add_common(p, threads_help="llama-bench's -t, in place of the default arguments' (0: all cores; default: as the "
                                "llama-bench arguments say)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("demo", help="build CPU master + patched, run the identity subset and a short bench")
    _add_common(p)
    p.set_defaults(func=cmd_demo)

