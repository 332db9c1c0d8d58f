"""Running a build's llama.cpp tools in the tests on SIM, in an environment cleared of the knobs that select backends
and features, so that a run sets only what it names."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

KNOB_PREFIXES = ("GGML_SIM_", "GGML_SCHED_", "LLAMA_ARG_", "LLAMA_MOE_", "LLAMA_CPP_LIB")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without the knobs, plus extra."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(KNOB_PREFIXES)}, **extra}


def completion(build, model, prompt: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """llama-completion of the build on the model: greedy, every layer on the device, 2 threads, verbose, with args
    (the placement, the tokens to generate, the knobs under test) and env over the cleared environment."""
    return subprocess.run([str(build.bin_dir / "llama-completion"), "-m", str(model), "-ngl", "99", "-p", prompt,
                           "--temp", "0", "-t", "2", "--fit", "off", "-no-cnv", "--no-warmup", "-v", *args],
                          capture_output=True, text=True, timeout=300, env=clean_env(**env))


def cli_refusal(argv: list[str], model: Path, home: Path) -> str:
    """`pyllama-moe ARGV` ("{model}" in it replaced) with a cache root that does not exist yet: the stderr of a refusal,
    checked to be exit 2, one line, no traceback, and made before any work (the cache root still absent)."""
    from pyllama_moe.paths import PROJECT_ROOT

    env = {**clean_env(), "PYLLAMA_MOE_HOME": str(home), "PYTHONPATH": str(PROJECT_ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pyllama_moe", *(a.format(model=model) for a in argv)],
                          capture_output=True, text=True, env=env, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert not home.exists(), "work started (the cache root was made) before the refusal"
    return proc.stderr
