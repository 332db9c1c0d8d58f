"""The pinned source: fetch the sdist, verify it, unpack llama.cpp and the `llama_cpp` package.

Nothing is unpacked from an archive whose sha256 differs from the pin. Unpacking goes to a temporary
directory that is renamed into place only when complete, so an interrupted run never leaves a tree that
looks good. The unpacked tree carries `manifest.json`: the sha256 of every llama.cpp file as it was in the
verified sdist, which is what `source pack` ships to machines that cannot verify the sdist themselves.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pyllama_moe.errors import UserError
from pyllama_moe.paths import cache_dir
from pyllama_moe.progress import Progress, say
from pyllama_moe.source.pin import Pin, load_pin

MANIFEST_NAME = "manifest.json"
COMPLETE_MARK = ".complete"


@dataclass(frozen=True)
class Source:
    """An unpacked, verified source: the llama.cpp tree and the directory that holds the `llama_cpp` package."""

    llama_dir: Path
    python_dir: Path | None  # parent of the `llama_cpp` package; None for a user's own checkout
    manifest: dict[str, str]  # relative path -> sha256, as in the verified sdist
    origin: str  # "sdist:<sha256>" or "llama-src:<digest>"


def sha256_file(path: Path, progress: Progress | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
            if progress:
                progress.update(step=len(chunk))
    return digest.hexdigest()


def verify_sdist(path: Path, pin: Pin) -> None:
    if not path.is_file():
        raise UserError(f"sdist {path} does not exist", f"pass the path of {pin.filename} or drop --sdist to download it")
    got = sha256_file(path)
    if got != pin.sha256:
        raise UserError(
            f"sdist {path} has sha256 {got}, the pin (patches/pin.toml) expects {pin.sha256}",
            f"use the genuine {pin.filename} ({pin.package}=={pin.version})",
        )


def fetch_sdist(pin: Pin, sdist: Path | None = None) -> Path:
    """Return a verified sdist: the one given, else the cached copy, else a fresh pip download."""
    cached = cache_dir("sdist") / pin.filename
    if sdist is not None:
        verify_sdist(Path(sdist), pin)
        if not cached.is_file():  # later runs find it without --sdist
            shutil.copyfile(sdist, cached.with_name(cached.name + ".partial"))
            os.replace(cached.with_name(cached.name + ".partial"), cached)
        return cached
    if cached.is_file():
        verify_sdist(cached, pin)
        return cached
    with tempfile.TemporaryDirectory(dir=cache_dir("sdist")) as tmp:
        say(f"downloading {pin.package}=={pin.version} sdist with pip (about 75 MB)...")
        # `--no-binary :all:` would also force pip to compile the build backend's own dependencies from source
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", pin.package,
               "-q", "-d", tmp, f"{pin.package}=={pin.version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / pin.filename
        if not got.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise UserError(f"pip could not download {pin.package}=={pin.version}: {' / '.join(tail)}",
                            "check network access to PyPI, or pass --sdist PATH to a downloaded copy")
        verify_sdist(got, pin)
        os.replace(got, cached)
    return cached


def _unpack(sdist: Path, pin: Pin, dest: Path) -> dict[str, str]:
    """Unpack vendor/llama.cpp and the llama_cpp package into dest; return the llama.cpp manifest."""
    prefix = sdist.name.removesuffix(".tar.gz") + "/"
    llama_prefix = prefix + pin.llama_path.rstrip("/") + "/"
    pkg_prefix = prefix + pin.python_package + "/"
    manifest: dict[str, str] = {}
    progress = Progress("unpacking sdist", unit=" files")
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            name = member.name
            if name.startswith(llama_prefix):
                rel = name[len(llama_prefix):]
                out = dest / "llama.cpp" / rel
            elif name.startswith(pkg_prefix):
                rel = None
                out = dest / "python" / pin.python_package / name[len(pkg_prefix):]
            else:
                continue
            # the vendored tree's `.git` is a submodule pointer to a directory the sdist lacks
            if rel == ".git" or not (member.isfile() or member.isdir()):
                continue
            if member.isdir():
                out.mkdir(parents=True, exist_ok=True)
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            data = tar.extractfile(member).read()
            out.write_bytes(data)
            os.chmod(out, 0o755 if member.mode & 0o111 else 0o644)
            if rel is not None:
                manifest[rel] = hashlib.sha256(data).hexdigest()
            progress.update(step=1)
    progress.finish(f"{len(manifest)} llama.cpp files")
    if not manifest:
        raise UserError(f"{sdist} holds no {pin.llama_path}", "the sdist is not the pinned one; re-download it")
    return manifest


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every regular file under root (relative paths), skipping VCS metadata."""
    out: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if rel == ".git" or rel.startswith(".git/") or not path.is_file() or path.is_symlink():
            continue
        out[rel] = sha256_file(path)
    return out


def digest_of_manifest(manifest: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def sdist_cached() -> bool:
    """Whether the pinned sdist is in the cache (else ensure_source downloads it)."""
    return (cache_dir("sdist") / load_pin().filename).is_file()


def ensure_source(sdist: Path | None = None, llama_src: Path | None = None) -> Source:
    """The verified source every other step starts from (downloaded and unpacked once per cache)."""
    pin = load_pin()
    if llama_src is not None:
        return _user_checkout(Path(llama_src), pin)
    sdist_path = fetch_sdist(pin, sdist)
    root = cache_dir("src") / pin.sha256[:16]
    if not (root / COMPLETE_MARK).is_file():
        if root.exists():
            shutil.rmtree(root)
        tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=".unpack-"))
        try:
            manifest = _unpack(sdist_path, pin, tmp)
            (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, sort_keys=True, indent=0))
            (tmp / COMPLETE_MARK).write_text(pin.sha256 + "\n")
            os.replace(tmp, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    manifest = json.loads((root / MANIFEST_NAME).read_text())
    return Source(root / "llama.cpp", root / "python", manifest, f"sdist:{pin.sha256}")


def _user_checkout(path: Path, pin: Pin) -> Source:
    path = path.resolve()
    if not (path / "ggml" / "src" / "ggml-backend.cpp").is_file() or not (path / "include" / "llama.h").is_file():
        raise UserError(f"--llama-src {path} is not a llama.cpp source tree", "point it at the root of a llama.cpp checkout")
    if (path / ".git").exists():
        head = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        if head and not head.startswith(pin.commit):
            raise UserError(f"--llama-src {path} is at commit {head[:12]}, the pin is {pin.commit}",
                            f"check out {pin.commit} there (git -C {path} checkout {pin.commit})")
    manifest = tree_digest(path)
    return Source(path, None, manifest, f"llama-src:{digest_of_manifest(manifest)}")
