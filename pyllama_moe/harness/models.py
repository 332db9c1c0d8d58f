"""Synthetic models and corpora the harness and benchmarks use, made once per definition and cached.

The file name is a hash of the definition, and a file (or a split model's folder of shards, cut by llama.cpp's
own llama-gguf-split) is renamed into place only once whole. See docs/synthetic-models.md, "Models the harness and
benchmarks make".
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from pyllama_moe.build.builder import Build
from pyllama_moe.errors import UserError
from pyllama_moe.paths import PROJECT_ROOT, cache_dir
from pyllama_moe.synth.gguf_read import read_gguf

SYNTH_OPTIONS = ("arch", "preset", "type", "down_type", "seed", "skew", "layers", "hidden", "experts", "experts_used",
                 "expert_ff", "vocab", "ctx")
MODEL_OPTIONS = (*SYNTH_OPTIONS, "split")


def _digest(definition: dict) -> str:
    return hashlib.sha256(json.dumps(definition, sort_keys=True).encode()).hexdigest()[:16]


def _run_cli(args: list[str], what: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "pyllama_moe", *args], env=env, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise UserError(f"could not make {what} (`pyllama-moe {' '.join(args)}` exit {proc.returncode})",
                        "see the error above")


def ensure_model(name: str, definition: dict, build: Build | None = None) -> Path:
    """The cached model of `definition`, made first if needed; a split one needs `build` (its llama-gguf-split)."""
    unknown = set(definition) - set(MODEL_OPTIONS)
    if unknown:
        raise UserError(f"model {name!r} has unknown synth option(s) {', '.join(sorted(unknown))}",
                        f"use: {', '.join(MODEL_OPTIONS)}")
    if "split" in definition:
        return _ensure_split(name, definition, build)
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


def shard_name(prefix: str, i: int, n: int) -> str:
    """llama.cpp's name of shard i (1-based) of n (llama_split_path)."""
    return f"{prefix}-{i:05d}-of-{n:05d}.gguf"


def _ensure_split(name: str, definition: dict, build: Build | None) -> Path:
    n = definition["split"]
    if not isinstance(n, int) or isinstance(n, bool) or not 2 <= n <= 99:
        raise UserError(f"model {name!r}: split = {n!r}", "give the number of shards, 2 to 99")
    final = cache_dir("models") / f"{name}-{_digest(definition)}"
    first = final / shard_name(name, 1, n)
    if first.is_file():
        return first
    if build is None:
        raise UserError(f"model {name!r} is split into {n} shards by llama-gguf-split, and no build was given to run it",
                        "pass a build (e.g. master's) to ensure_model")
    tool = build.tool("llama-gguf-split")
    whole = definition.copy()
    del whole["split"]
    single = ensure_model(f"{name}-single", whole)
    n_tensors = len(read_gguf(single, check_data=False).tensors)
    per_shard = -(-n_tensors // n)
    if -(-n_tensors // per_shard) != n:
        raise UserError(f"model {name!r}: {n_tensors} tensors cannot be cut into {n} shards of equal count",
                        "choose another split")
    tmp = final.with_name(f"{final.name}.{os.getpid()}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cmd = [str(tool), "--split", "--split-max-tensors", str(per_shard), str(single), str(tmp / name)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    made = sorted(p.name for p in tmp.iterdir())
    if proc.returncode != 0 or made != [shard_name(name, i, n) for i in range(1, n + 1)]:
        shutil.rmtree(tmp, ignore_errors=True)
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise UserError(f"`{' '.join(cmd)}` exit {proc.returncode}, made {made or 'nothing'}:\n{tail}",
                        "run the command by hand to see why")
    try:
        os.replace(tmp, final)
    except OSError:  # a concurrent maker renamed its directory first: the same shards, keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return first


def ensure_corpus(model: Path, tokens: int = 4000, seed: int = 0) -> Path:
    path = model.with_name(f"{model.stem}-corpus-{tokens}-{seed}.txt")
    if path.is_file():
        return path
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    _run_cli(["corpus", "--model", str(model), "--tokens", str(tokens), "--seed", str(seed), "-o", str(tmp)], "corpus")
    os.replace(tmp, path)
    return path
