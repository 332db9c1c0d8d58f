"""The patch series: apply it, export it back to files, check that the files are current.

Export flags make a patch file depend only on its change, so `check` can compare byte for byte and name each
patch that no longer applies or would change. The series, its mail format and the three operations:
docs/builds.md, "The patch series".
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pyllama_moe.errors import UserError
from pyllama_moe.paths import NATIVE_DIR, PATCHES_DIR, SERIES_FILE

BASE_TAG = "base"
REASONS = ("upstream-bound", "build-only", "behaviour-only")
_IDENTITY = {
    "GIT_AUTHOR_NAME": "pyllama_moe", "GIT_AUTHOR_EMAIL": "pyllama-moe@invalid",
    "GIT_COMMITTER_NAME": "pyllama_moe", "GIT_COMMITTER_EMAIL": "pyllama-moe@invalid",
}
# format-patch flags that make an export a pure function of the commits' content and messages
EXPORT_FLAGS = ["--zero-commit", "--full-index", "--no-signature", "--no-stat", "--keep-subject",
                "--no-numbered", "--no-thread", "--no-renames", "--no-binary", "--stdout"]


@dataclass(frozen=True)
class Patch:
    name: str
    path: Path

    def read(self) -> bytes:
        return self.path.read_bytes()


def read_series(series: Path = SERIES_FILE, patches_dir: Path = PATCHES_DIR) -> list[Patch]:
    if not series.is_file():
        raise UserError(f"{series} does not exist", "create it (one patch file name per line) or restore it from git")
    out = []
    for lineno, raw in enumerate(series.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        path = patches_dir / line
        if not path.is_file():
            raise UserError(f"{series}:{lineno}: patch {line} does not exist", f"add {path} or drop the line")
        out.append(Patch(line, path))
    return out


def native_files(native_dir: Path = NATIVE_DIR) -> list[Path]:
    """The overlay files, relative to native/ (which mirrors the llama.cpp tree)."""
    return sorted(p.relative_to(native_dir) for p in native_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def inputs_digest(patches: list[Patch] | None = None, native_dir: Path = NATIVE_DIR) -> str:
    """Hash of everything the patched variant adds to the pin: series order, patch bytes, native files."""
    patches = read_series() if patches is None else patches
    digest = hashlib.sha256()
    for patch in patches:
        digest.update(b"patch\0" + patch.name.encode() + b"\0" + hashlib.sha256(patch.read()).digest())
    for rel in native_files(native_dir):
        data = (native_dir / rel).read_bytes()
        digest.update(b"native\0" + rel.as_posix().encode() + b"\0" + hashlib.sha256(data).digest())
    return digest.hexdigest()


def _git(args: list[str], cwd: Path, check: bool = True, input: bytes | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **_IDENTITY, GIT_CEILING_DIRECTORIES=str(Path(cwd).resolve().parent))
    env.pop("GIT_DIR", None)
    env.pop("GIT_WORK_TREE", None)
    if not Path(cwd).is_dir():  # else subprocess reports the missing folder as a missing git
        raise UserError(f"{cwd} does not exist", "run `pyllama-moe patches apply` first (or pass --dir)")
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, input=input)
    except FileNotFoundError as exc:
        raise UserError("git is not installed", "install git, or build from a `source pack` archive") from exc
    if check and proc.returncode != 0:
        raise UserError(f"git {' '.join(args[:2])} failed in {cwd}: {proc.stderr.decode(errors='replace').strip()}")
    return proc


def _failed_file(stderr: str) -> str:
    """The file a failed `git am`/`git apply` names, for a one-line message."""
    for pattern in (r"patch failed: (\S+?):\d+", r"error: (\S+): does not exist in index", r"error: (\S+): No such file",
                    r"error: (\S+): already exists"):
        found = re.search(pattern, stderr)
        if found:
            return found.group(1)
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    return lines[0] if lines else "unknown file"


def _touched_files(patch_bytes: bytes) -> list[str]:
    return sorted({m.decode() for m in re.findall(rb"^diff --git a/(\S+) b/", patch_bytes, re.M)})


def _init_repo(repo: Path, base_tree: Path, files: list[str] | None, label: str) -> None:
    """A git repo at `repo` holding base_tree (or only `files` of it), committed and tagged `base`."""
    repo.mkdir(parents=True, exist_ok=True)
    if files is None:
        shutil.copytree(base_tree, repo, dirs_exist_ok=True, symlinks=True)
    else:
        for rel in files:
            src = base_tree / rel
            if src.is_file():
                (repo / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, repo / rel)
    _git(["init", "-q"], repo)
    _git(["config", "core.autocrlf", "false"], repo)
    _git(["add", "-A", "-f", "."], repo)
    _git(["commit", "-q", "--allow-empty", "-m", f"base: {label}"], repo)
    _git(["tag", BASE_TAG], repo)


def _am(repo: Path, patch: Patch) -> None:
    proc = _git(["am", "-q", "--keep-cr", "-k", "--committer-date-is-author-date", str(patch.path)], repo, check=False)
    if proc.returncode != 0:
        _git(["am", "--abort"], repo, check=False)
        stderr = proc.stderr.decode(errors="replace") + proc.stdout.decode(errors="replace")
        raise UserError(f"patch {patch.name} does not apply: {_failed_file(stderr)}",
                        "run `pyllama-moe patches apply`, fix the commit there, then `pyllama-moe patches export`")


def _overlay_native(tree: Path, native_dir: Path = NATIVE_DIR, exclude_from_git: bool = False) -> None:
    rels = native_files(native_dir)
    for rel in rels:
        dest = tree / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(native_dir / rel, dest)
    if exclude_from_git:
        with open(tree / ".git" / "info" / "exclude", "a") as fh:
            fh.write("# native/ overlay of pyllama_moe: edit it in the project, not here\n")
            fh.writelines(f"/{rel.as_posix()}\n" for rel in rels)


def apply_scratch(base_tree: Path, dest: Path, label: str, force: bool = False) -> Path:
    """`patches apply`: the full tree as a git repo, one commit per patch, native/ copied over."""
    patches = read_series()
    if dest.exists():
        if not force:
            raise UserError(f"{dest} already exists", "pass --force to replace it (unexported commits there are lost)")
        shutil.rmtree(dest)
    _init_repo(dest, base_tree, None, label)
    for patch in patches:
        _am(dest, patch)
    _overlay_native(dest, exclude_from_git=True)
    return dest


def export_mails(repo: Path) -> dict[str, bytes]:
    """Patch file name -> mail bytes for every commit after `base`, in order (insertion order of the dict)."""
    if _git(["rev-parse", "-q", "--verify", f"refs/tags/{BASE_TAG}"], repo, check=False).returncode != 0:
        raise UserError(f"{repo} has no `{BASE_TAG}` tag", "create the scratch repo with `pyllama-moe patches apply`")
    revs = _git(["rev-list", "--reverse", f"{BASE_TAG}..HEAD"], repo).stdout.decode().split()
    out: dict[str, bytes] = {}
    for rev in revs:
        mail = _git(["format-patch", *EXPORT_FLAGS, "-1", rev], repo).stdout
        subject = _git(["log", "-1", "--format=%s", rev], repo).stdout.decode().strip()
        name = _slug(subject) + ".patch"
        if name in out:
            raise UserError(f"two commits share the subject {subject!r}", "reword one of them (git commit --amend / rebase -i)")
        out[name] = mail
    return out


def _slug(subject: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", subject).strip("-").lower()
    return slug[:72].rstrip("-") or "patch"


def audit_mail(name: str, mail: bytes) -> list[str]:
    """Problems with a patch's message: missing or invalid trailers, no body saying why."""
    text = mail.decode(errors="replace")
    header, _, rest = text.partition("\n\n")
    message = rest.split("\n---\n", 1)[0]
    problems = []
    reason = re.search(r"^Reason:\s*(\S+)", message, re.M)
    if not reason or reason.group(1) not in REASONS:
        problems.append(f"{name}: needs a `Reason:` trailer, one of {', '.join(REASONS)}")
    neutral = re.search(r"^Logits-Neutral:\s*(\S+)", message, re.M)
    if not neutral or neutral.group(1) not in ("yes", "no"):
        problems.append(f"{name}: needs a `Logits-Neutral: yes|no` trailer")
    body = [ln for ln in message.splitlines() if ln.strip() and not re.match(r"^(Reason|Logits-Neutral):", ln)]
    if not body:
        problems.append(f"{name}: the message body must say why the patch exists")
    if not re.search(r"^Subject: \S+: ", header, re.M):
        problems.append(f"{name}: the subject must read `area: summary`")
    return problems


def write_export(mails: dict[str, bytes], patches_dir: Path = PATCHES_DIR, series: Path = SERIES_FILE) -> list[str]:
    """Write the mails and the series; remove patch files no longer in it. Returns the names that changed."""
    changed = []
    for name, mail in mails.items():
        path = patches_dir / name
        if not path.is_file() or path.read_bytes() != mail:
            path.write_bytes(mail)
            changed.append(name)
    for stale in patches_dir.glob("*.patch"):
        if stale.name not in mails:
            stale.unlink()
            changed.append(stale.name)
    comments = [ln for ln in series.read_text().splitlines() if ln.startswith("#")] if series.is_file() else []
    text = "\n".join(comments + list(mails)) + "\n"
    if not series.is_file() or series.read_text() != text:
        series.write_text(text)
        changed.append(series.name)
    return changed


def check(base_tree: Path, label: str, patches_dir: Path = PATCHES_DIR, series: Path = SERIES_FILE) -> list[str]:
    """Problems found; empty when every patch applies and export would change no file."""
    patches = read_series(series, patches_dir)
    problems = []
    listed = {p.name for p in patches}
    for path in sorted(patches_dir.glob("*.patch")):
        if path.name not in listed:
            problems.append(f"{path.name}: not listed in {series.name} (add it or delete the file)")
    touched = sorted({f for p in patches for f in _touched_files(p.read())})
    with tempfile.TemporaryDirectory(prefix="pyllama-moe-check-") as tmp:
        repo = Path(tmp) / "repo"
        _init_repo(repo, base_tree, touched, label)
        for patch in patches:
            try:
                _am(repo, patch)
            except UserError as exc:
                problems.append(str(exc))
                return problems
        mails = export_mails(repo)
    for patch, (name, mail) in zip(patches, mails.items()):
        if patch.name != name:
            problems.append(f"{patch.name}: export would name it {name} (run `pyllama-moe patches export`)")
        elif patch.read() != mail:
            problems.append(f"{patch.name}: export would change the file (run `pyllama-moe patches export`)")
        problems.extend(audit_mail(patch.name, patch.read()))
    return problems


def apply_to_tree(tree: Path, patches: list[Patch] | None = None) -> None:
    """Apply the series to a plain (non-git) copy of the pinned tree and overlay native/: the build's source."""
    patches = read_series() if patches is None else patches
    for patch in patches:
        proc = _git(["apply", "--whitespace=nowarn", str(patch.path)], tree, check=False)
        if proc.returncode != 0:
            raise UserError(f"patch {patch.name} does not apply: {_failed_file(proc.stderr.decode(errors='replace'))}",
                            "run `pyllama-moe patches check` for details, fix the series, then rebuild")
    _overlay_native(tree)
