"""Argument groups that several verbs share (kept apart from main.py, which imports every verb module), the parser
class that reports a bad argument in one line, and the checks across options and against the model that run before
any work (the argparse types that check one number or path are pyllama_moe.arguments)."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from pyllama_moe.arguments import (count, input_dir, input_file, MISS_POLICY_RULE, outside_range, parse_miss_policy,
                                   range_text)
from pyllama_moe.errors import UserError


class OneLineParser(argparse.ArgumentParser):
    """Bad input: argparse's own line `PROG: error: MESSAGE` and exit 2, without the usage block above it (the
    error names the flag; `--help` has the rest). Help lists every option's default (DefaultsHelpFormatter)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it or the option is required."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if text is argparse.SUPPRESS or "default" in text or action.default is argparse.SUPPRESS:
            return text
        if not action.option_strings and action.nargs != "?":  # a positional the user must give
            return text
        if action.required:
            return f"{text} (required)"
        return f"{text} (default: {shown_default(action.default).replace('%', '%%')})"


def shown_default(value) -> str:
    """A default as a user reads it: a switch is off, an unset value is none."""
    if value is None or value == []:
        return "none"
    if value is False:
        return "off"
    if value is True:
        return "on"
    return str(value)


class VersionAction(argparse.Action):
    """`--version`: the package, the pin and the patch series, read only when asked (the digest reads every patch)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="print the version, the pinned llama.cpp and the patch series, and exit"):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit(0)


def version_line() -> str:
    from pyllama_moe import __version__
    from pyllama_moe.source import patches
    from pyllama_moe.source.pin import load_pin

    pin = load_pin()
    series = patches.read_series()
    return (f"pyllama-moe {__version__}: {pin.package} {pin.version}, llama.cpp {pin.commit_full}; patch series of "
            f"{len(series)} patches and native/, digest {patches.inputs_digest(series)[:16]}")


# ---- models and llama-bench arguments ---------------------------------------------------------------------------

def model_header(model: Path, flag: str = "--model"):
    """A GGUF's header, read before any build: a foreign or cut-short file is a UserError that names the flag."""
    from pyllama_moe.synth.gguf_read import read_gguf

    try:
        return read_gguf(model)
    except UserError as exc:
        raise UserError(f"argument {flag}: {exc.what}", exc.fix) from None


def check_cpu_moe_layers(flag: str, n_cpu_moe: int, model: Path, model_flag: str = "--model"):
    """The model's header read (so a bad model stops here), and its layers against an -ncmoe count (the largest,
    where several are given); returns the header for the checks after it."""
    info = model_header(model, model_flag)
    n_layer = int(info.arch_key("block_count", 0))
    if n_layer and n_cpu_moe > n_layer:
        raise UserError(f"argument {flag}: {n_cpu_moe} is more than the {n_layer} layers of {model}",
                        f"give 0 to {n_layer}")
    return info


def check_cache_has_a_device(flag: str, backend: str, env: dict[str, str] | None = None) -> None:
    """The expert cache holds host experts on a GPU: a CPU build has none, and the build would run without a cache
    and say so only in an info line. GGML_SIM_DEVICES (the test double that simulates devices) gives it one."""
    if backend == "cpu" and not {**os.environ, **(env or {})}.get("GGML_SIM_DEVICES"):
        raise UserError(f"{flag} asks for an expert cache, which lives on a GPU, and a CPU build has none",
                        f"use --backend cuda, drop {flag} (or give 0), or simulate a device with GGML_SIM_DEVICES=1")


# llama-bench's numeric flags (tools/llama-bench and this series' tools patches): what a value is, and its range.
# A value is a comma-separated list whose elements may be ranges first-last[+step|*step]; each element is checked.
_BENCH_NUMBERS = {
    ("-p", "--n-prompt"): ("a prompt length", 0, None), ("-n", "--n-gen"): ("a generation length", 0, None),
    ("-d", "--n-depth"): ("a depth", 0, None), ("-b", "--batch-size"): ("a batch size", 1, None),
    ("-ub", "--ubatch-size"): ("a ubatch size", 1, None), ("-t", "--threads"): ("a thread count", 1, None),
    ("--poll",): ("a poll percentage", 0, 100), ("-ngl", "--n-gpu-layers"): ("a GPU layer count", -1, None),
    ("-ncmoe", "--n-cpu-moe"): ("a count of MoE layers", 0, None), ("-mg", "--main-gpu"): ("a GPU index", 0, None),
    ("-mcm", "--moe-cache-mib"): ("a MiB count", 0, None), ("-mcs", "--moe-cache-seed"): ("a switch", 0, 1),
    ("-mcp", "--moe-cache-probe"): ("a cache probe", 0, 2), ("-sac", "--sched-async-cpu"): ("a switch", 0, 1),
    ("-pf", "--sched-prefetch"): ("a prefetch mode", 0, 2), ("-pfd", "--sched-prefetch-depth"): ("a depth", 2, 8),
    ("-pfs", "--sched-prefetch-staging"): ("a MiB count", 0, None), ("-lmp", "--layer-major-prompt"): ("a switch", 0, 1),
    ("-lms", "--layer-major-staging"): ("a MiB count", 0, None),
}
BENCH_NUMBERS = {flag: rule for flags, rule in _BENCH_NUMBERS.items() for flag in flags}
# llama-bench's flags whose elements are words, each checked as the build would parse it: what a value is, the rule
BENCH_WORDS = {flag: ("a miss policy", parse_miss_policy, MISS_POLICY_RULE) for flag in ("-mmp", "--moe-miss-policy")}
_BENCH_ELEMENT = re.compile(r"^(-?\d+)(?:-(\d+)(?:[+*](\d+))?)?$")


def _bench_elements(bench_args: list[str]):
    """Each element of each comma-separated value in llama-bench arguments: (flag, value, element, its numbers: the
    number or a range's two ends; None where the element is neither)."""
    for flag, value in zip(bench_args, bench_args[1:]):
        for element in value.split(","):
            match = _BENCH_ELEMENT.match(element)
            yield flag, value, element, None if match is None else [int(n) for n in match.group(1, 2) if n is not None]


def check_bench_numbers(bench_args: list[str], tool: str = "llama-bench") -> None:
    """Each element of a numeric llama-bench flag's value within its range, and each of -mmp's a policy the build
    takes, before any build: llama-bench itself takes -ub 0 and fails only at its run, or, for some, runs on with a
    value that means nothing."""
    for flag, value, element, numbers in _bench_elements(bench_args):
        where = f" in {value}" if element != value else ""
        if flag in BENCH_WORDS:
            noun, parse, rule_text = BENCH_WORDS[flag]
            if parse(element) is None:
                raise UserError(f"argument {flag} ({tool}): {element!r}{where} is not {noun} ({rule_text})")
            continue
        rule = BENCH_NUMBERS.get(flag)
        if rule is None:
            continue
        noun, low, high = rule
        if numbers is None:
            raise UserError(f"argument {flag} ({tool}): {element!r}{where} is not {noun} (a whole number, or a "
                            f"range first-last[+step|*step], {range_text(low, high)})")
        for number in numbers:
            if outside_range(number, low, high):
                raise UserError(f"argument {flag} ({tool}): {number}{where} is not {noun} ({range_text(low, high)})")


def bench_flag_values(bench_args: list[str], flags: tuple[str, ...]) -> list[int]:
    """Every number given to any of `flags` (the elements of lists and the ends of ranges), for checks against the
    model."""
    return [n for flag, _, _, numbers in _bench_elements(bench_args) if flag in flags for n in numbers or []]


# ---- argument groups -----------------------------------------------------------------------------------------

def add_source_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("source (default: download the pinned sdist into the cache)")
    g.add_argument("--sdist", type=input_file("sdist"),
                   help="use this llama-cpp-python sdist (verified against the pin) instead of downloading (default: "
                        "download it once into the cache)")
    g.add_argument("--llama-src", type=input_dir("llama.cpp checkout"),
                   help="use your own llama.cpp checkout of the pinned commit (default: the sdist's)")


def add_build_args(p: argparse.ArgumentParser, variant_default: str | None = "patched") -> None:
    from pyllama_moe.build.builder import BACKENDS
    from pyllama_moe.source.trees import VARIANTS

    p.add_argument("--variant", choices=VARIANTS, default=variant_default, required=variant_default is None,
                   help="master (the pin as it is) or patched (the pin with this patch series)")
    p.add_argument("--backend", choices=BACKENDS, default="cpu", help="the ggml backend the build is made for")
    p.add_argument("--archive", type=input_file("archive"),
                   help="build from a `source pack` archive (its manifest is checked)")
    add_source_args(p)
