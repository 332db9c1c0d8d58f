"""`pyllama-moe`: one argparse tree with a verb per job. Bad input ends in one line on stderr and exit 2."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pyllama_moe.arguments import count, output_dir, output_file, refuse_overwrite
from pyllama_moe.cli.args import add_build_args, add_source_args, OneLineParser, VersionAction
from pyllama_moe.errors import UserError


def cmd_source(args) -> int:
    from pyllama_moe.source import packs, sdist as source

    out = args.output or Path(f"llama.cpp-{args.variant}.tar.gz")
    if args.action == "pack":
        refuse_overwrite({"-o/--output": out}, {"--sdist": args.sdist})
    src = source.ensure_source(args.sdist, args.llama_src)
    if args.action == "pack":
        packs.pack(args.variant, out, src)
        return 0
    info = {"llama_cpp_dir": str(src.llama_dir), "python_dir": str(src.python_dir) if src.python_dir else None,
            "origin": src.origin, "files": len(src.manifest)}
    print(json.dumps(info, indent=1) if args.json else "\n".join(f"{k}: {v}" for k, v in info.items()))
    return 0


def cmd_patches(args) -> int:
    from pyllama_moe.paths import PROJECT_ROOT
    from pyllama_moe.source import patches, sdist as source
    from pyllama_moe.source.pin import load_pin

    scratch = args.dir or (PROJECT_ROOT / ".work" / "llama.cpp")
    if args.action == "export" and not scratch.is_dir():  # export reads it: say so before fetching the source
        raise UserError(f"--dir {scratch}: no scratch repo there",
                        "run `pyllama-moe patches apply` first (or pass --dir)")
    src = source.ensure_source(args.sdist, args.llama_src)
    label = load_pin().label
    if args.action == "apply":
        patches.apply_scratch(src.llama_dir, scratch, label, force=args.force)
        print(f"scratch repo: {scratch} (base tagged `{patches.BASE_TAG}`, {len(patches.read_series())} patches, native/ overlaid)")
        return 0
    if args.action == "export":
        mails = patches.export_mails(scratch)
        problems = [p for name, mail in mails.items() for p in patches.audit_mail(name, mail)]
        if problems:
            raise UserError("; ".join(problems), "amend the commit messages in the scratch repo, then export again")
        changed = patches.write_export(mails)
        print(f"exported {len(mails)} patches; changed: {', '.join(changed) or 'nothing'}")
        return 0
    problems = patches.check(src.llama_dir, label)
    for problem in problems:
        print(f"FAIL {problem}")
    if problems:
        return 1
    print(f"ok: {len(patches.read_series())} patches apply and export unchanged")
    return 0


def cmd_build(args) -> int:
    from pyllama_moe.build.builder import resolve

    targets = tuple(args.targets.split(",")) if args.targets else None
    extra = tuple(args.cmake_arg or ())
    if args.other_series and args.archive is None:
        raise UserError("--other-series applies to --archive only", "name the archive to build with --archive")
    built = resolve(args.variant, args.backend, sdist=args.sdist, llama_src=args.llama_src, archive=args.archive,
                    other_series=args.other_series, targets=targets, jobs=args.jobs, cuda_arch=args.cuda_arch,
                    extra_options=extra)
    print(built.path)
    return 0


def cmd_info(args) -> int:
    from pyllama_moe.build import ffi
    from pyllama_moe.build.builder import resolve

    built = resolve(args.variant, args.backend, sdist=args.sdist, llama_src=args.llama_src, archive=args.archive, make=False)
    lib = ffi.load(built)
    info = {"build_dir": str(built.path), "key": built.key, "variant": built.variant, "backend": built.backend,
            "library": str(lib.path), "embedded": lib.build_info(), "api": sorted(n for n in dir(lib) if n.startswith("llama_moe"))}
    print(json.dumps(info, indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="pyllama-moe",
        description="Pinned llama.cpp + MoE offload patch series: fetch, patch, build, run, compare, benchmark.")
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = sub.add_parser("source", help="fetch + verify the pinned sdist; `source pack` writes a pruned source archive")
    p.add_argument("action", nargs="?", choices=("show", "pack"), default="show",
                   help="show: where the verified source is; pack: write it as an archive")
    p.add_argument("--variant", choices=("master", "patched"), default="patched", help="tree to pack")
    p.add_argument("-o", "--output", type=output_file("archive"),
                   help="archive path for `pack` (default: ./llama.cpp-<variant>.tar.gz)")
    p.add_argument("--json", action="store_true", help="print JSON")
    add_source_args(p)
    p.set_defaults(func=cmd_source)

    p = sub.add_parser("patches", help="apply the series to a scratch repo, export it back, or check it")
    p.add_argument("action", choices=("apply", "export", "check"),
                   help="apply: make the scratch repo; export: write patches/ from it; check: the series applies and "
                        "exports unchanged")
    p.add_argument("--dir", type=output_dir("scratch repo"),
                   help="scratch repo (default: .work/llama.cpp in the project)")
    p.add_argument("--force", action="store_true", help="apply: replace an existing scratch repo")
    add_source_args(p)
    p.set_defaults(func=cmd_patches)

    p = sub.add_parser("build", help="configure + build a variant (reused when its key is unchanged)")
    add_build_args(p)
    p.add_argument("--targets", help="comma-separated ninja targets (default: libllama and the harness tools)")
    p.add_argument("-j", "--jobs", type=count("a job count"), help="parallel compile jobs (default: ninja's choice)")
    p.add_argument("--cuda-arch", default="native",
                   help="CMAKE_CUDA_ARCHITECTURES for --backend cuda (default: native, the GPUs present, as llama.cpp's "
                        "CMake; e.g. 86-real, 89-real, 90-real to build for another)")
    p.add_argument("--cmake-arg", action="append", metavar="-DNAME=VALUE", help="extra cmake option (part of the key)")
    p.add_argument("--other-series", action="store_true",
                   help="accept an --archive packed from another patch series than this checkout's (before/after "
                        "benchmarks; the build is keyed by the archive's own series)")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("info", help="load a finished build through the checked loader and print what it is")
    add_build_args(p)
    p.set_defaults(func=cmd_info)

    for register in _registries():
        register(sub)
    return parser


def _registries():
    """Verbs that live in their own modules register themselves here."""
    from pyllama_moe.cli import first_tokens as cli_first_tokens, harness as cli_harness, synth as synth_cli
    from pyllama_moe.harness import server_soak
    from pyllama_moe.plot import main as plot, profile

    return (cli_harness.register, cli_first_tokens.register, synth_cli.register, plot.register, profile.register,
            server_soak.register)


# what a user's path can raise after the checks (a file removed or made unreadable meanwhile): theirs to fix
PATH_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    prog = f"pyllama-moe {args.verb}"
    if extra:  # argparse would name the top-level parser, not the verb whose arguments these were
        hint = " (llama-bench style arguments go after --)" if hasattr(args, "bench_args") else ""
        return _refused(prog, f"unrecognized arguments: {' '.join(extra)}{hint}")
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        return _refused(prog, str(exc))
    except PATH_ERRORS as exc:
        if exc.filename is None:  # not about a path the user gave: a bug, with its traceback
            raise
        return _refused(prog, f"{exc.filename}: {exc.strerror}")
    except KeyboardInterrupt:
        sys.stderr.write(f"{prog}: interrupted\n")
        return 130


def _refused(prog: str, message: str) -> int:
    """One line, as argparse writes its own errors, and exit 2."""
    sys.stderr.write(f"{prog}: error: {' '.join(message.split())}\n")
    return 2
