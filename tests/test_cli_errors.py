"""Bad input to any verb, as a user types it: one line on stderr that names the flag, exit 2, no traceback, and
nothing started or lost. Every case is refused before a fetch or a build: the cache root is an empty folder that
must still not exist afterwards, so this file builds nothing and runs in seconds."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pyllama_moe.paths import PROJECT_ROOT

# (verb, class of mistake, arguments, what the one line must name). {model} is a 4-layer synthetic GGUF, {junk} a
# file that is not GGUF, {tmp} a folder for outputs, {server} an executable stand-in for llama-server.
CASES = [
    ("source", "missing input", ["--sdist", "{tmp}/no.tar.gz"], "--sdist"),
    ("source", "output in a missing folder", ["pack", "-o", "{tmp}/no/x.tar.gz"], "-o/--output"),
    ("source", "cross-option", ["pack", "--sdist", "{junk}", "-o", "{junk}"], "-o/--output"),
    ("patches", "missing input", ["check", "--llama-src", "{tmp}/no"], "--llama-src"),
    ("patches", "cross-option", ["export", "--dir", "{tmp}/no-scratch"], "--dir"),
    ("build", "zero", ["-j", "0"], "-j/--jobs"),
    ("build", "negative count", ["-j", "-2"], "-j/--jobs"),
    ("build", "non-number", ["-j", "four"], "-j/--jobs"),
    ("build", "missing input", ["--archive", "{tmp}/no.tar.gz"], "--archive"),
    ("build", "cross-option", ["--other-series"], "--other-series"),
    ("info", "missing input", ["--archive", "{tmp}/no.tar.gz"], "--archive"),
    ("run", "negative count", ["{model}", "-mcm", "-5"], "-mcm/--moe-cache-mib"),
    ("run", "negative count", ["{model}", "-ncmoe", "-3"], "-ncmoe/--n-cpu-moe"),
    ("run", "negative count", ["{model}", "-ub", "-1"], "-ub/--ubatch"),
    ("run", "negative count", ["{model}", "-n", "-1"], "-n/--generate"),
    ("run", "negative count", ["{model}", "-t", "-1"], "-t/--threads"),
    ("run", "zero", ["{model}", "-ub", "0"], "-ub/--ubatch"),
    ("run", "non-number", ["{model}", "-ngl", "all"], "-ngl/--n-gpu-layers"),
    ("run", "missing input", ["{tmp}/no.gguf"], "model"),
    ("run", "missing input", ["{model}", "--prompt-file", "{tmp}/no.txt"], "--prompt-file"),
    ("run", "missing input", ["{junk}"], "model"),
    ("run", "output in a missing folder", ["{model}", "--logits-out", "{tmp}/no/logits.npy"], "--logits-out"),
    ("run", "cross-option", ["{model}", "-ncmoe", "5"], "-ncmoe/--n-cpu-moe"),
    ("run", "cross-option", ["{model}", "-mcm", "100"], "-mcm/--moe-cache-mib"),
    ("run", "cross-option", ["{model}", "-mcm", "100", "--variant", "master"], "--moe-cache-mib"),
    ("run", "cross-option", ["{model}", "--sched-async-cpu", "on", "--variant", "master"], "--sched-async-cpu"),
    ("run", "cross-option", ["{model}", "--logits-out", "{model}"], "--logits-out"),
    ("run", "cross-option", ["{model}", "--moe-cache-profile", "{junk}"], "--moe-cache-profile"),
    ("compare", "zero", ["--limit", "0"], "--limit"),
    ("compare", "negative count", ["--limit", "-1"], "--limit"),
    ("compare", "non-number", ["--limit", "some"], "--limit"),
    ("compare", "missing input", ["--matrix", "{tmp}/no.toml"], "--matrix"),
    ("compare", "output in a missing folder", ["--json", "{tmp}/no/r.json"], "--json"),
    ("compare", "out-of-range list element", ["--backend", "cpu,rocm"], "--backend"),
    ("compare", "cross-option", ["--matrix", "{junk}", "--json", "{junk}"], "--json"),
    ("bench", "negative count", ["--model", "{model}", "-mcm", "-5"], "-mcm/--moe-cache-mib"),
    ("bench", "negative count", ["--model", "{model}", "--", "-ncmoe", "-3"], "-ncmoe"),
    ("bench", "zero", ["--model", "{model}", "--rounds", "0"], "--rounds"),
    ("bench", "zero", ["--model", "{model}", "--", "-ub", "0"], "-ub"),
    ("bench", "non-number", ["--model", "{model}", "--reps", "x"], "--reps"),
    ("bench", "non-number", ["--model", "{model}", "--target-ci", "tight"], "--target-ci"),
    ("bench", "missing input", ["--model", "{tmp}/no.gguf"], "--model"),
    ("bench", "missing input", ["--model", "{junk}"], "--model"),
    ("bench", "output in a missing folder", ["--model", "{model}", "--json", "{tmp}/no/b.json"], "--json"),
    ("bench", "out-of-range list element", ["--model", "{model}", "--", "-ub", "512,0"], "-ub"),
    ("bench", "out-of-range list element", ["--model", "{model}", "--", "-mcm", "0,-7800"], "-mcm"),
    ("bench", "out-of-range list element", ["--model", "{model}", "--", "-sac", "0,2"], "-sac"),
    ("bench", "cross-option", ["--model", "{model}", "--reps", "2", "--discard", "2"], "--discard"),
    ("bench", "cross-option", ["--model", "{model}", "-mcm", "7800"], "-mcm/--moe-cache-mib"),
    ("bench", "cross-option", ["--model", "{model}", "--", "-ncmoe", "0,9"], "-ncmoe"),
    ("bench", "cross-option", ["--model", "{model}", "-t", "2", "--pin-threads"], "--pin-threads"),
    ("bench", "cross-option", ["--model", "{model}", "--json", "{model}"], "--json"),
    ("bench", "cross-option", ["--model", "{model}", "-ub", "64"], "-ub"),
    ("demo", "negative count", ["-t", "-4"], "-t/--threads"),
    ("demo", "non-number", ["-t", "x"], "-t/--threads"),
    ("demo", "missing input", ["--sdist", "{tmp}/no.tar.gz"], "--sdist"),
    ("first-tokens", "negative count", ["--model", "{model}", "--warm", "-1"], "--warm"),
    ("first-tokens", "zero", ["--model", "{model}", "--rounds", "0"], "--rounds"),
    ("first-tokens", "non-number", ["--model", "{model}", "--prompt", "long"], "--prompt"),
    ("first-tokens", "missing input", ["--model", "{tmp}/no.gguf"], "--model"),
    ("first-tokens", "output in a missing folder", ["--model", "{model}", "--json", "{tmp}/no/f.json"], "--json"),
    ("first-tokens", "out-of-range list element", ["--model", "{model}", "--", "-ub", "0"], "-ub"),
    ("first-tokens", "cross-option", ["--model", "{model}", "--", "-ncmoe", "9"], "-ncmoe"),
    ("first-tokens", "cross-option", ["--model", "{model}", "--json", "{model}"], "--json"),
    ("synth", "negative count", ["-o", "{tmp}/s.gguf", "--seed", "-1"], "--seed"),
    ("synth", "zero", ["-o", "{tmp}/s.gguf", "--layers", "0"], "--layers"),
    ("synth", "non-number", ["-o", "{tmp}/s.gguf", "--skew", "much"], "--skew"),
    ("synth", "output in a missing folder", ["-o", "{tmp}/no/s.gguf"], "-o/--output"),
    ("synth", "cross-option", ["-o", "{tmp}/s.gguf", "--shared-experts", "1"], "--shared-experts"),
    ("corpus", "negative count", ["--model", "{model}", "--seed", "-2"], "--seed"),
    ("corpus", "zero", ["--model", "{model}", "--tokens", "0"], "--tokens"),
    ("corpus", "non-number", ["--model", "{model}", "--tokens", "many"], "--tokens"),
    ("corpus", "missing input", ["--model", "{tmp}/no.gguf"], "--model"),
    ("corpus", "missing input", ["--model", "{junk}"], "--model"),
    ("corpus", "output in a missing folder", ["--model", "{model}", "-o", "{tmp}/no/c.txt"], "-o/--output"),
    ("corpus", "cross-option", ["--model", "{model}", "-o", "{model}"], "-o/--output"),
    ("routes", "negative count", ["{model}", "--gpu-layers", "-2"], "--gpu-layers"),
    ("routes", "zero", ["{model}", "--tokens", "0"], "--tokens"),
    ("routes", "non-number", ["{model}", "--threads", "x"], "--threads"),
    ("routes", "missing input", ["{junk}"], "model"),
    ("routes", "missing input", ["{model}", "--lib", "{tmp}/no"], "--lib"),
    ("plot", "missing input", ["{tmp}/no.json", "-o", "{tmp}/p.svg"], "json"),
    ("plot", "missing input", ["--profile", "{tmp}/no.gguf", "-o", "{tmp}/p.svg"], "--profile"),
    ("plot", "output in a missing folder", ["--profile", "{junk}", "-o", "{tmp}/no/p.svg"], "-o/--output"),
    ("plot", "cross-option", ["{tmp}/in.svg", "-o", "{tmp}/in.svg"], "-o/--output"),
    ("plot", "cross-option", ["{junk}", "{junk}", "--samples", "-o", "{tmp}/p.svg"], "--samples"),
    ("profile", "zero", ["show", "{junk}", "--top", "0"], "--top"),
    ("profile", "negative count", ["show", "{junk}", "--top", "-3"], "--top"),
    ("profile", "non-number", ["show", "{junk}", "--top", "all"], "--top"),
    ("profile", "missing input", ["show", "{tmp}/no.gguf"], "file"),
    ("server-soak", "zero", ["--server", "{server}", "--model", "{model}", "--out", "{tmp}/o", "--slots", "0"], "--slots"),
    ("server-soak", "negative count", ["--server", "{server}", "--model", "{model}", "--out", "{tmp}/o", "--seconds",
                                       "-1"], "--seconds"),
    ("server-soak", "non-number", ["--server", "{server}", "--model", "{model}", "--out", "{tmp}/o", "--clients", "x"],
     "--clients"),
    ("server-soak", "missing input", ["--server", "{server}", "--model", "{tmp}/no.gguf", "--out", "{tmp}/o"], "--model"),
    ("server-soak", "missing input", ["--server", "{tmp}/no", "--model", "{model}", "--out", "{tmp}/o"], "--server"),
    ("server-soak", "output in a missing folder", ["--server", "{server}", "--model", "{model}", "--out",
                                                   "{junk}/o"], "--out"),
    ("server-soak", "cross-option", ["--server", "{server}", "--model", "{model}", "--out", "{tmp}/o", "--max-prompt",
                                     "5000"], "--ctx-per-slot"),
]
VERBS = ("source", "patches", "build", "info", "run", "compare", "bench", "demo", "first-tokens", "synth", "corpus",
         "routes", "plot", "profile", "server-soak")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    from pyllama_moe.synth.shapes import resolve_shape
    from pyllama_moe.synth.writer import write_model

    root = tmp_path_factory.mktemp("cli-errors")
    model = root / "tiny.gguf"
    write_model(model, resolve_shape("tiny"), progress=False)
    junk = root / "junk.gguf"
    junk.write_bytes(b"not a GGUF file at all")
    server = root / "llama-server"
    server.write_text("#!/bin/sh\nexit 1\n")
    server.chmod(0o755)
    (root / "in.svg").write_text("{}")
    return {"model": model, "junk": junk, "server": server, "tmp": root}


def _pyllama_moe(args: list[str], home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYLLAMA_MOE_HOME": str(home), "PYTHONPATH": str(PROJECT_ROOT)}
    env = {k: v for k, v in env.items() if not k.startswith(("GGML_SIM_", "LLAMA_MOE_"))}
    return subprocess.run([sys.executable, "-m", "pyllama_moe", *args], capture_output=True, text=True, env=env,
                          timeout=120, stdin=subprocess.DEVNULL)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_every_verb_has_cases():
    assert {verb for verb, *_ in CASES} == set(VERBS)


@pytest.fixture(scope="module")
def refusals(files, tmp_path_factory) -> dict:
    """Every case run once, a few at a time (each is a fresh interpreter: most of its time is imports), each with a
    cache root of its own that must not come to exist."""
    homes = tmp_path_factory.mktemp("homes")
    before = _snapshot(files["tmp"])

    def refuse(i: int) -> subprocess.CompletedProcess:
        verb, _, argv, _ = CASES[i]
        return _pyllama_moe([verb, *(a.format(**files) for a in argv)], homes / str(i))

    with ThreadPoolExecutor(4) as pool:
        procs = list(pool.map(refuse, range(len(CASES))))
    return {"procs": procs, "homes": homes, "before": before, "after": _snapshot(files["tmp"])}


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_one_line_naming_the_flag_and_exit_2(refusals, i):
    verb, _, _, flag = CASES[i]
    proc = refusals["procs"][i]
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"pyllama-moe {verb}: error: ") and flag in lines[0], lines[0]
    assert not (refusals["homes"] / str(i)).exists(), "work started (the cache root was made) before the refusal"


def test_no_refused_run_wrote_or_changed_a_file(refusals):
    assert refusals["after"] == refusals["before"]


def test_keyboard_interrupt_is_one_line_and_exit_130(monkeypatch, capsys):
    from pyllama_moe.cli import harness as cli_harness, main as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_harness, "cmd_compare", interrupted)
    assert cli.main(["compare"]) == 130
    assert capsys.readouterr().err == "pyllama-moe compare: interrupted\n"


def test_a_path_error_is_one_line_and_a_bug_keeps_its_traceback(monkeypatch, capsys):
    from pyllama_moe.cli import harness as cli_harness, main as cli

    def gone(args):
        raise FileNotFoundError(2, "No such file or directory", "/gone/model.gguf")

    monkeypatch.setattr(cli_harness, "cmd_compare", gone)
    assert cli.main(["compare"]) == 2
    assert capsys.readouterr().err == "pyllama-moe compare: error: /gone/model.gguf: No such file or directory\n"

    def bug(args):
        raise FileNotFoundError("no filename: not the user's path")

    monkeypatch.setattr(cli_harness, "cmd_compare", bug)
    with pytest.raises(FileNotFoundError):
        cli.main(["compare"])


def test_run_shows_the_patched_builds_warnings_and_errors(files, monkeypatch, capsys):
    """A refused profile does not stop the build's run; `run` shows its error line (the worker sends it in the
    reply, runner.RunResult.moe_alerts) above the result."""
    import numpy as np

    from pyllama_moe.build import builder as build
    from pyllama_moe.cli import harness as cli_harness, main as cli
    from pyllama_moe.harness import runner

    refused = "llama_moe: expert cache profile /p.gguf refused: it was made for another model; ..."
    result = runner.RunResult(np.zeros((2, 4), np.float32), "ab" * 32, [1], "x", "log", moe_alerts=[refused])
    monkeypatch.setattr(cli_harness, "_source", lambda args: None)
    monkeypatch.setattr(build, "resolve", lambda *a, **kw: build.Build(Path("/b"), "k", "patched", "cpu"))
    monkeypatch.setattr(runner, "run", lambda built, src, spec: result)
    assert cli.main(["run", str(files["model"])]) == 0
    out = capsys.readouterr()
    assert out.err == refused + "\n" and "logits sha256" in out.out


def test_the_worker_keeps_only_the_patched_builds_warnings_and_errors():
    from pyllama_moe.worker.__main__ import is_moe_alert

    assert is_moe_alert(4, "llama_moe: expert cache profile p refused: ...\n")
    assert is_moe_alert(3, "llama_moe: expert cache on SIM0 shrunk from 8 MiB to 4 MiB\n")
    assert not is_moe_alert(2, "llama_moe: expert cache on SIM0: 4.00 MiB, ...\n")  # info: the log keeps it
    assert not is_moe_alert(3, "llama_model_loader: a warning of llama.cpp's own\n")


def _verb_parsers() -> dict[str, argparse.ArgumentParser]:
    from pyllama_moe.cli.main import build_parser

    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(subs.choices)


@pytest.mark.parametrize("verb", VERBS)
def test_help_lists_a_default_for_every_option(verb):
    parser = _verb_parsers()[verb]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help, f"{verb} {name} has no help"
        if action.option_strings:
            shown = formatter._get_help_string(action)
            assert "default" in shown or "required" in shown, f"{verb} {name}: {shown}"
    assert parser.format_help()


def test_help_shows_run_s_defaults_and_version_names_the_pin_and_series(tmp_path):
    from pyllama_moe.source import patches
    from pyllama_moe.source.pin import load_pin

    helped = _pyllama_moe(["run", "--help"], tmp_path / "home")
    assert helped.returncode == 0 and "(default: 512)" in " ".join(helped.stdout.split())
    version = _pyllama_moe(["--version"], tmp_path / "home")
    pin, series = load_pin(), patches.read_series()
    assert version.returncode == 0
    assert pin.version in version.stdout and pin.commit_full in version.stdout
    assert f"{len(series)} patches" in version.stdout and patches.inputs_digest(series)[:16] in version.stdout
