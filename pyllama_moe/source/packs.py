"""Pruned source archives for machines with no package registry and maybe no git (the GPU machine).

The manifest holds every file's sha256, and for the sdist's unchanged files proof that it is the verified sdist's,
so `unpack` can refuse an altered archive, or one of another pin or series, before any build uses it. See
docs/builds.md, "Source archives: `source pack`".
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from pyllama_moe.errors import UserError
from pyllama_moe.paths import cache_dir
from pyllama_moe.progress import Progress
from pyllama_moe.source import patches, sdist as source, trees
from pyllama_moe.source.pin import load_pin

MANIFEST = "pyllama-moe-manifest.json"
KEEP_BACKENDS = {"ggml-cpu", "ggml-cuda", "ggml-sim"}
PRUNE_PREFIXES = ("models/", "docs/", "tools/ui/", "benches/", "examples/llama.android/",
                  "examples/llama.swiftui/", ".github/", ".devops/", "media/")


# kept below a pruned prefix: llama-server's build adds tools/ui (which embeds no assets where it finds none)
KEEP_FILES = {"tools/ui/CMakeLists.txt", "tools/ui/ui.h.in", "tools/ui/ui.cpp.in"}


def is_pruned(rel: str) -> bool:
    if rel in KEEP_FILES:
        return False
    if rel.startswith(PRUNE_PREFIXES):
        return True
    parts = rel.split("/")
    # ggml/src/ggml-<backend>/...: only the backends we build travel
    return len(parts) > 3 and parts[:2] == ["ggml", "src"] and parts[2].startswith("ggml-") and parts[2] not in KEEP_BACKENDS


def pack(variant: str, out: Path, src: source.Source) -> dict:
    pin = load_pin()
    tree = trees.prepare(src, variant)
    files = {}
    for path in sorted(tree.path.rglob("*")):
        rel = path.relative_to(tree.path).as_posix()
        if not path.is_file() or path.is_symlink() or is_pruned(rel) or rel == ".git" or rel.startswith(".git/"):
            continue
        digest = source.sha256_file(path)
        origin = "sdist" if src.manifest.get(rel) == digest else ("patched" if rel in src.manifest else "added")
        files[rel] = {"sha256": digest, "origin": origin}
    # the sdist's llama_cpp package travels too: the harness drives builds through it
    python_files = {}
    if src.python_dir is not None:
        for path in sorted(src.python_dir.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                python_files[path.relative_to(src.python_dir).as_posix()] = {"sha256": source.sha256_file(path), "origin": "sdist"}
    manifest = {"pin": {"sdist_sha256": pin.sha256, "commit": pin.commit_full, "version": pin.version},
                "variant": variant, "source": tree.source_id, "patch_inputs": tree.inputs, "files": files,
                "python_files": python_files}
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    progress = Progress(f"packing {variant}", total=len(files) + len(python_files), unit=" files")
    with tarfile.open(tmp, "w:gz", compresslevel=9) as tar:
        data = json.dumps(manifest, indent=0, sort_keys=True).encode()
        info = tarfile.TarInfo(MANIFEST)
        info.size, info.mtime, info.mode = len(data), 0, 0o644
        tar.addfile(info, io.BytesIO(data))
        entries = [(tree.path / rel, f"llama.cpp/{rel}") for rel in files]
        entries += [(src.python_dir / rel, f"python/{rel}") for rel in python_files]
        for i, (path, arcname) in enumerate(entries, 1):
            info = tar.gettarinfo(str(path), arcname=arcname)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with open(path, "rb") as fh:
                tar.addfile(info, fh)
            progress.update(i)
    os.replace(tmp, out)
    progress.finish(f"{out} ({out.stat().st_size / 1e6:.1f} MB, {len(files)} files)")
    return manifest


def _check_manifest(manifest: dict, root: Path, variant: str, archive: Path, other_series: bool) -> None:
    pin = load_pin()
    fix = f"re-create it with `pyllama-moe source pack --variant {variant}` from this checkout"
    if manifest.get("pin", {}).get("sdist_sha256") != pin.sha256:
        raise UserError(f"archive {archive} was packed from another pin", fix)
    if manifest.get("variant") != variant:
        raise UserError(f"archive {archive} holds the {manifest.get('variant')} tree, not {variant}", fix)
    if variant == "patched" and not other_series and manifest.get("patch_inputs") != patches.inputs_digest():
        raise UserError(f"archive {archive} was packed from other patches or native/ files than this checkout's", fix)
    _check_files(manifest["files"], root / "llama.cpp", archive, fix)
    _check_files(manifest.get("python_files", {}), root / "python", archive, fix)


def _check_files(listed: dict, root: Path, archive: Path, fix: str) -> None:
    seen = set()
    for path in root.rglob("*"):
        if path.is_file():
            rel = path.relative_to(root).as_posix()
            seen.add(rel)
            entry = listed.get(rel)
            if entry is None:
                raise UserError(f"archive {archive}: {rel} is not in its manifest", fix)
            if source.sha256_file(path) != entry["sha256"]:
                raise UserError(f"archive {archive}: {rel} does not match its manifest sha256", fix)
    missing = sorted(set(listed) - seen)
    if missing:
        raise UserError(f"archive {archive}: {len(missing)} files of the manifest are missing (first: {missing[0]})", fix)


def unpack(archive: Path, variant: str, *, other_series: bool = False) -> trees.Tree:
    """The checked tree of `archive`, unpacked once into the cache. A patched archive must hold this checkout's
    patches and native/ files unless `other_series` (one side of a before/after benchmark); its build key then
    carries the archive's own patch inputs, so the two series never share a build."""
    archive = Path(archive).resolve()
    if not archive.is_file():
        raise UserError(f"archive {archive} does not exist", f"create it with `pyllama-moe source pack --variant {variant}`")
    digest = source.sha256_file(archive)
    root = cache_dir("trees") / f"archive-{variant}-{digest[:16]}"
    if not (root / source.COMPLETE_MARK).is_file():
        if root.exists():
            shutil.rmtree(root)
        tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=".unpack-"))
        try:
            try:
                with tarfile.open(archive, "r:gz") as tar:
                    tar.extractall(tmp, filter="data")
                manifest = json.loads((tmp / MANIFEST).read_text())
            except (tarfile.TarError, OSError, ValueError, EOFError) as exc:
                raise UserError(f"archive {archive} is unreadable ({exc})",
                                f"copy it again or re-create it with `pyllama-moe source pack --variant {variant}`") from exc
            _check_manifest(manifest, tmp, variant, archive, other_series)
            (tmp / source.COMPLETE_MARK).write_text(digest + "\n")
            os.replace(tmp, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    manifest = json.loads((root / MANIFEST).read_text())
    if variant == "patched" and not other_series and manifest.get("patch_inputs") != patches.inputs_digest():
        raise UserError(f"archive {archive} was packed from other patches or native/ files than this checkout's",
                        f"re-create it with `pyllama-moe source pack --variant {variant}`")
    return _tree_of(root, variant)


def _tree_of(root: Path, variant: str) -> trees.Tree:
    manifest = json.loads((root / MANIFEST).read_text())
    return trees.Tree(variant, root / "llama.cpp", manifest["source"], manifest["patch_inputs"])


def archive_source(archive: Path, variant: str) -> source.Source:
    """The Source behind an archive: its tree and the sdist's llama_cpp package it carries."""
    return _source_of(unpack(archive, variant).path.parent)


def _source_of(root: Path) -> source.Source:
    manifest = json.loads((root / MANIFEST).read_text())
    python_dir = root / "python"
    files = {rel: entry["sha256"] for rel, entry in manifest["files"].items() if entry["origin"] == "sdist"}
    return source.Source(root / "llama.cpp", python_dir if python_dir.is_dir() else None, files,
                         "sdist:" + manifest["pin"]["sdist_sha256"])


def _unpacked_root(variant: str) -> Path | None:
    """On a machine without the sdist (no package registry), the folder of an archive of `variant` that an earlier
    `build --archive` unpacked and checked: of this pin, and for patched of this checkout's series. None if none
    was, or where the sdist is here. Its tree is what the sdist would prepare (same files, same build key)."""
    if source.sdist_cached():
        return None
    pin_sha, inputs = load_pin().sha256, patches.inputs_digest() if variant == "patched" else None
    for root in sorted(cache_dir("trees").glob(f"archive-{variant}-*")):
        if not (root / source.COMPLETE_MARK).is_file():
            continue
        manifest = json.loads((root / MANIFEST).read_text())
        if manifest["pin"]["sdist_sha256"] == pin_sha and (inputs is None or manifest.get("patch_inputs") == inputs):
            return root
    return None


def unpacked_source(variant: str) -> source.Source | None:
    """The Source of _unpacked_root(variant), or None."""
    root = _unpacked_root(variant)
    return None if root is None else _source_of(root)


def unpacked_tree(variant: str) -> trees.Tree | None:
    """The tree of _unpacked_root(variant), as `unpack` gave it when it was built, or None."""
    root = _unpacked_root(variant)
    return None if root is None else _tree_of(root, variant)


def unpacked_python_source() -> source.Source | None:
    """An unpacked archive's Source for its llama_cpp package alone (the sdist's files in either variant), where the
    sdist is not here."""
    return unpacked_source("master") or unpacked_source("patched")


def python_source(sdist: Path | None = None, llama_src: Path | None = None) -> source.Source:
    """The Source whose llama_cpp package a worker loads: the named or pinned sdist's, or, where none was named and
    the sdist is not here, an unpacked archive's."""
    offline = unpacked_python_source() if sdist is None and llama_src is None else None
    return offline or source.ensure_source(sdist, llama_src)
