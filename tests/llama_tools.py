"""Running a build's llama.cpp tools in the tests on SIM, in an environment cleared of the knobs that select backends
and features, so that a run sets only what it names."""
from __future__ import annotations

import os
import subprocess

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
