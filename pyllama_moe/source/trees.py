"""Prepared source trees, one per variant: what a build compiles.

- master:  the verified pinned tree as unpacked (never modified).
- patched: a copy of it with the series applied and native/ overlaid, in a directory named by the hash of
           the pin and the patch inputs; made in a temporary directory and renamed into place when complete.
Trees unpacked from a `source pack` archive are used as they are, after their manifest was checked.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pyllama_moe.errors import UserError
from pyllama_moe.paths import cache_dir
from pyllama_moe.source import patches
from pyllama_moe.source.sdist import COMPLETE_MARK, Source

VARIANTS = ("master", "patched")


@dataclass(frozen=True)
class Tree:
    variant: str
    path: Path
    source_id: str  # identifies the pinned source (the pin's sha256, or a user checkout's digest)
    inputs: str  # patch inputs digest; "" for master


def source_id(source: Source) -> str:
    # an sdist or a verified archive are the same source: the pin
    return source.origin.replace("sdist:", "pin:")


def prepare(source: Source, variant: str) -> Tree:
    if variant not in VARIANTS:
        raise UserError(f"unknown variant {variant!r}", f"use one of {', '.join(VARIANTS)}")
    sid = source_id(source)
    if variant == "master":
        return Tree("master", source.llama_dir, sid, "")
    inputs = patches.inputs_digest()
    name = f"patched-{sid.split(':', 1)[1][:12]}-{inputs[:16]}"
    root = cache_dir("trees") / name
    if not (root / COMPLETE_MARK).is_file():
        if root.exists():
            shutil.rmtree(root)
        tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=".prepare-"))
        try:
            tree = tmp / "llama.cpp"
            shutil.copytree(source.llama_dir, tree, symlinks=True, ignore=shutil.ignore_patterns(".git"))
            patches.apply_to_tree(tree)
            (tmp / COMPLETE_MARK).write_text(inputs + "\n")
            os.replace(tmp, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return Tree("patched", root / "llama.cpp", sid, inputs)
