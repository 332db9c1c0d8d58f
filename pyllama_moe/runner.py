"""Run a GGUF with a chosen build: logits of every prompt position and greedy text.

Each run is a fresh process (pyllama_moe.worker) whose LLAMA_CPP_LIB_PATH points at the build, so two
builds never share a process and a crash in one is reported, not inherited.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pyllama_moe import ffi
from pyllama_moe.build import Build
from pyllama_moe.errors import UserError
from pyllama_moe.paths import PROJECT_ROOT
from pyllama_moe.source import Source


@dataclass
class RunSpec:
    model: Path
    tokens: list[int] | None = None
    prompt: str | None = None
    max_prompt_tokens: int | None = None  # truncate the tokenized prompt to this many tokens
    n_gpu_layers: int = 99
    cpu_moe: bool = False
    n_cpu_moe: int = 0
    load_mode: str = "mmap"
    repack: bool = True
    n_ubatch: int = 512
    n_batch: int = 2048
    threads: int | None = None
    generate: int = 0
    want_logits: bool = True
    env: dict[str, str] = field(default_factory=dict)
    eval_callback: int = 0  # observe every Nth node: the scheduler's chunked compute path (0: no callback)
    stats: bool = False     # report llama-moe.h stats of the prompt and of the generation (patched builds)
    prefetch: dict[str, int] | None = None  # per-context llama_moe_set_prefetch_params fields (patched builds)


@dataclass
class RunResult:
    logits: np.ndarray | None
    logits_sha256: str | None
    generated: list[int]
    text: str
    log: str
    stats: dict | None = None


def check_model(path: Path) -> Path:
    """A readable, whole GGUF file (header parsed, every tensor inside the file), else a UserError."""
    from pyllama_moe.synth.gguf_read import read_gguf

    read_gguf(path)
    return Path(path).resolve()


def worker_env(build: Build, src: Source, extra: dict[str, str] | None = None) -> dict[str, str]:
    if src.python_dir is None:
        raise UserError("the llama_cpp Python package comes from the sdist, but --llama-src was given",
                        "drop --llama-src or also pass --sdist")
    env = dict(os.environ)
    env["LLAMA_CPP_LIB_PATH"] = str(build.bin_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(src.python_dir), str(PROJECT_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra or {})
    return env


def run(build: Build, src: Source, spec: RunSpec) -> RunResult:
    ffi.check_stamp(build)  # the worker checks the embedded key after loading the library
    model = check_model(spec.model)
    with tempfile.TemporaryDirectory(prefix="pyllama-moe-run-") as tmp:
        logits_path = Path(tmp) / "logits.npy"
        req = {"expect_build": {"key": build.key, "variant": build.variant}, "model": str(model), "tokens": spec.tokens, "prompt": spec.prompt,
               "max_prompt_tokens": spec.max_prompt_tokens, "n_gpu_layers": spec.n_gpu_layers,
               "cpu_moe": spec.cpu_moe, "n_cpu_moe": spec.n_cpu_moe, "load_mode": spec.load_mode,
               "repack": spec.repack, "n_ubatch": spec.n_ubatch, "n_batch": spec.n_batch, "threads": spec.threads,
               "generate": spec.generate, "logits_out": str(logits_path) if spec.want_logits else None,
               "eval_callback": spec.eval_callback, "stats": spec.stats, "prefetch": spec.prefetch}
        proc = subprocess.run([sys.executable, "-m", "pyllama_moe.worker"], input=json.dumps(req), text=True,
                              capture_output=True, env=worker_env(build, src, spec.env))
        reply = _parse_reply(proc.stdout)
        if proc.returncode != 0 or "error" in reply:
            tail = "\n".join(proc.stderr.strip().splitlines()[-12:])
            sys.stderr.write(tail + "\n")
            raise UserError(f"{build.variant} build {build.key} failed on {model.name}: "
                            f"{reply.get('error') or f'exit {proc.returncode}'}", "see the log lines above")
        logits = np.load(logits_path) if spec.want_logits else None
    return RunResult(logits, reply.get("logits_sha256"), reply.get("generated", []), reply.get("text", ""), proc.stderr,
                     reply.get("stats"))


def _parse_reply(stdout: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return {}
