"""What the --fit tests share: a 6-layer model of 91 MB that SIM devices of little memory (GGML_SIM_MEMORY_MIB) cannot
hold whole, its corpus and prompt, and llama.cpp's tools run under a fit with the memory breakdown they print at exit."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

TARGET_MIB = 16  # -fitt of every fit here
# a device's row of the memory breakdown: total = free + (self = model + ...; the description has parentheses
BREAKDOWN = re.compile(r"\|\s+- (SIM\d) \(.*?\)\s*\|\s*(\d+) =\s*(\d+) \+ \(\s*\d+ =\s*(\d+) \+")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("fit-model") / "fit6.gguf"
    subprocess.run([sys.executable, "-m", "pyllama_moe", "synth", "--preset", "small", "--layers", "6", "--vocab", "4000",
                    "--type", "q8_0", "--skew", "0.5", "-o", str(path), "--quiet"], check=True)
    return path


@pytest.fixture(scope="module")
def corpus(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("fit-corpus") / "corpus.txt"
    subprocess.run([sys.executable, "-m", "pyllama_moe", "corpus", "--model", str(model), "--tokens", "1200", "-o", str(path)],
                   check=True, capture_output=True)
    return path


@pytest.fixture(scope="module")
def prompt(corpus):
    """About 400 tokens of the corpus: a prompt that fits the 1024-token context with its generated tokens."""
    path = corpus.with_name("prompt.txt")
    path.write_text(corpus.read_text()[:1500])
    return path


def run_tool(build, name: str, args: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run([str(build.tool(name)), *args], capture_output=True, text=True, errors="replace", timeout=300, env={**base_env(), **env})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name} failed (exit {proc.returncode}):\n" + "\n".join(out.splitlines()[-20:])
    return out


def base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("GGML_", "LLAMA_"))}


def generate(build, model, prompt, env, *args) -> tuple[str, str]:
    """(generated text, log) of 24 greedy tokens of llama-completion."""
    proc = subprocess.run([str(build.tool("llama-completion")), "-m", str(model), "-f", str(prompt), "-n", "24", "--temp", "0",
                           "-no-cnv", "--ignore-eos", "-c", "1024", "-ub", "256", "-t", "2", "-v", *args],
                          capture_output=True, text=True, errors="replace", timeout=300, env={**base_env(), **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, proc.stderr


def fit_args(*extra: str) -> list[str]:
    return ["--fit", "on", "-fitt", str(TARGET_MIB), *extra]


def free_at_exit(log: str) -> dict[str, int]:
    """Free MiB per SIM device in the memory breakdown printed at exit (the last table of the log)."""
    free = {}
    for dev, _total, f, _model in BREAKDOWN.findall(log):
        free[dev] = int(f)  # later tables replace the measurements' ones
    return free


def model_on_device(log: str, dev: str = "SIM0") -> int:
    """MiB of model weights on a SIM device in the memory breakdown printed at exit."""
    return [int(m) for d, _total, _free, m in BREAKDOWN.findall(log) if d == dev][-1]


