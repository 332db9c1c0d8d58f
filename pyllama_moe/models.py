"""Synthetic models and corpora the harness and benchmarks use, made once per definition and cached.

A definition is the dict of `pyllama-moe synth` options (arch, preset, type, seed, skew, overrides); the file
name is a hash of it, and a file is renamed into place only after the writer finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from pyllama_moe.errors import UserError
from pyllama_moe.paths import PROJECT_ROOT, cache_dir

SYNTH_OPTIONS = ("arch", "preset", "type", "seed", "skew", "layers", "hidden", "experts", "experts_used",
                 "expert_ff", "vocab", "ctx")


def _digest(definition: dict) -> str:
    return hashlib.sha256(json.dumps(definition, sort_keys=True).encode()).hexdigest()[:16]


def _run_cli(args: list[str], what: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "pyllama_moe", *args], env=env, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise UserError(f"could not make {what} (`pyllama-moe {' '.join(args)}` exit {proc.returncode})",
                        "see the error above")


def ensure_model(name: str, definition: dict) -> Path:
    unknown = set(definition) - set(SYNTH_OPTIONS)
    if unknown:
        raise UserError(f"model {name!r} has unknown synth option(s) {', '.join(sorted(unknown))}",
                        f"use: {', '.join(SYNTH_OPTIONS)}")
    path = cache_dir("models") / f"{name}-{_digest(definition)}.gguf"
    if path.is_file():
        return path
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")  # concurrent makers never share a file
    args = ["synth", "-o", str(tmp)]
    for key, value in sorted(definition.items()):
        args += [f"--{key.replace('_', '-')}", str(value)]
    _run_cli(args, f"model {name}")
    os.replace(tmp, path)
    return path


def ensure_corpus(model: Path, tokens: int = 4000, seed: int = 0) -> Path:
    path = model.with_name(f"{model.stem}-corpus-{tokens}-{seed}.txt")
    if path.is_file():
        return path
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    _run_cli(["corpus", "--model", str(model), "--tokens", str(tokens), "--seed", str(seed), "-o", str(tmp)], "corpus")
    os.replace(tmp, path)
    return path
