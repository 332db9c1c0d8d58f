"""The verb `first-tokens`: decode rates of the first tokens after a prompt against the steady rate, per setting
(pyllama_moe.bench.first_tokens)."""

from __future__ import annotations

import argparse

from pyllama_moe.arguments import count, input_file, output_dir, output_file, refuse_overwrite, whole_number
from pyllama_moe.cli.args import check_bench_numbers, check_cpu_moe_layers
from pyllama_moe.errors import UserError


def cmd_first_tokens(args) -> int:
    from pyllama_moe.bench import first_tokens, rounds as bench
    from pyllama_moe.bench.paced_rounds import parse_spec
    from pyllama_moe.build.builder import resolve

    bench_args = list(args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args)
    check_bench_numbers(bench_args, "paced-bench")
    refuse_overwrite({"--json": args.json}, {"--model": args.model})
    if args.pin_threads:
        bench_args += bench.pinned_thread_args()
    spec = parse_spec(args.model, ["-p", str(args.prompt), "-n", "0", *bench_args])
    settings = [first_tokens.parse_setting(s) for s in args.setting] or [first_tokens.Setting("default")]
    if len({s.name for s in settings}) != len(settings):
        raise UserError("two --setting arguments have the same name", "give each setting its own NAME")
    check_cpu_moe_layers("-ncmoe (paced-bench)", spec.n_cpu_moe, args.model)
    built = resolve(args.variant, args.backend, sdist=args.sdist, llama_src=args.llama_src, archive=args.archive,
                    make=not args.no_build)
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    samples = first_tokens.measure(built, spec, settings, rounds=args.rounds, reps=args.reps, first=args.first,
                                   warm=args.warm, reset=not args.no_reset, log_dir=args.log_dir)
    print(first_tokens.report(samples, spec, args.first, args.warm))
    if args.json:
        args.json.write_text(first_tokens.to_json(samples, spec, args.first, args.warm))
    return 0


def register(sub) -> None:
    from pyllama_moe.cli.args import add_build_args

    p = sub.add_parser("first-tokens", help="decode rate of the first tokens after a prompt against the steady rate, "
                                            "per setting (tools/paced-bench)")
    p.add_argument("--model", type=input_file("model"), required=True, help="the GGUF file")
    add_build_args(p)
    p.add_argument("--no-build", action="store_true", help="fail instead of building a missing build")
    p.add_argument("--setting", action="append", default=[], metavar="NAME[=VAR=VALUE,...]",
                   help="a process per setting with this environment, e.g. seed-off=LLAMA_MOE_CACHE_SEED=0 (repeat)")
    p.add_argument("--prompt", type=count("a prompt length"), default=4096, help="prompt tokens (default 4096)")
    p.add_argument("--first", type=count("a token count"), default=16,
                   help="tokens timed right after the prompt, and again steady (default 16)")
    p.add_argument("--warm", type=whole_number("a token count", 0), default=96,
                   help="tokens decoded between the two, not timed (default 96)")
    p.add_argument("--rounds", type=count("a round count"), default=3,
                   help="rounds, a process per setting each (default 3)")
    p.add_argument("--reps", type=count("a repetition count"), default=3, help="repetitions per round (default 3)")
    p.add_argument("--no-reset", action="store_true",
                   help="keep the expert cache between repetitions (default: a fresh one before each prompt)")
    p.add_argument("--pin-threads", action="store_true", help="as bench --pin-threads")
    p.add_argument("--log-dir", type=output_dir("log folder"), help="keep each process's log here (made when missing)")
    p.add_argument("--json", type=output_file("JSON file"), help="also write every sample as JSON")
    p.add_argument("bench_args", nargs=argparse.REMAINDER,
                   help="-- then paced-bench (llama-bench style) arguments: -ngl, -ncmoe, -ub, -lm, ...")
    p.set_defaults(func=cmd_first_tokens)
