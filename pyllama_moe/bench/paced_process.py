"""Paced benchmark processes: a model loaded once per build, one repetition measured per command.

A llama-bench process spends most of its life loading the model; the driver (tools/paced-bench) loads it once and
then answers one JSON line per repetition asked for on stdin, so an A/B run can alternate builds without
reloading. The protocol and why: docs/benchmarks.md, "Paced mode".
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import select
import shlex
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pyllama_moe.build.builder import Build
from pyllama_moe.errors import UserError
from pyllama_moe.paths import PROJECT_ROOT
from pyllama_moe.progress import say

TOOL_SOURCE = PROJECT_ROOT / "tools" / "paced-bench" / "llama-moe-paced-bench.cpp"
TOOL_NAME = "llama-moe-paced-bench"
LIBRARIES = ("llama", "ggml", "ggml-base", "ggml-cpu")  # ggml-cpu: pausing the threadpool between repetitions


def _source_dir(build: Build) -> Path:
    """The llama.cpp tree the build was configured from (its headers match the build's libraries)."""
    cache = build.path / "CMakeCache.txt"
    try:
        text = cache.read_text(errors="replace")
    except OSError:
        raise UserError(f"{cache} is missing, so the llama.cpp source of {build.path} is unknown",
                        f"rebuild it: `pyllama-moe build --variant {build.variant} --backend {build.backend}`") from None
    match = re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.+)$", text, re.M)
    src = Path(match.group(1).strip()) if match else None
    if src is None or not (src / "include" / "llama.h").is_file():
        raise UserError(f"the llama.cpp source named by {cache} ({src}) has no include/llama.h",
                        f"prepare the source again and rebuild: `pyllama-moe build --variant {build.variant} "
                        f"--backend {build.backend}`")
    return src


def _library_dir(build: Build, name: str) -> Path:
    for folder in (build.bin_dir, build.path / "lib", build.path / "src", build.path / "ggml" / "src"):
        if (folder / f"lib{name}.so").exists():
            return folder
    found = sorted(build.path.rglob(f"lib{name}.so"))
    if not found:
        raise UserError(f"lib{name}.so is not in {build.path}",
                        f"rebuild with shared libraries: `pyllama-moe build --variant {build.variant} "
                        f"--backend {build.backend}`")
    return found[0].parent


def ensure_tool(build: Build) -> Path:
    """The driver compiled against `build`: reused when this build already has it for this source content.

    It is compiled to a temporary name and renamed into place, so a failed or interrupted compile never leaves a
    file under the final name (and two processes compiling at once each rename a whole binary)."""
    source = TOOL_SOURCE
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    out = build.path / "pyllama-moe-tools" / f"{TOOL_NAME}-{digest}"
    if out.is_file():
        return out
    src = _source_dir(build)
    lib_dirs = list(dict.fromkeys(_library_dir(build, name) for name in LIBRARIES))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.partial")
    log = out.with_name(f"{out.name}.log")
    cxx = shlex.split(os.environ.get("CXX") or "c++")
    cmd = [*cxx, "-std=c++17", "-O2", f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}", str(source),
           "-o", str(tmp), *(f"-L{d}" for d in lib_dirs), *(f"-Wl,-rpath,{d}" for d in lib_dirs),
           *(f"-l{name}" for name in LIBRARIES), "-pthread"]
    say(f"compiling {source.name} against {build.path.name} (log: {log})")
    try:
        with open(log, "wb") as fh:
            fh.write(f"$ {shlex.join(cmd)}\n".encode())
            fh.flush()
            try:
                rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
            except OSError as exc:
                fh.write(f"{exc}\n".encode())
                rc = None
        if rc != 0 or not tmp.is_file():
            why = "could not be started" if rc is None else f"failed (exit {rc})"
            raise UserError(f"compiling {source} with `{cxx[0]}` {why}; command and output: {log}",
                            "fix the error shown there, or point CXX at a working C++17 compiler")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


@dataclass
class PacedSpec:
    """The driver's arguments, in llama-bench's spelling; None leaves the driver's default (llama-bench's)."""

    model: Path
    n_prompt: int = 512
    n_gen: int = 128
    n_batch: int = 2048
    n_ubatch: int = 512
    n_gpu_layers: int = 99
    n_cpu_moe: int = 0
    load_mode: str | None = None     # auto, none, mmap, mlock, mmap+mlock, dio; None: auto
    n_threads: int | None = None     # None: physical cores
    cpu_mask: str = "0x0"
    cpu_strict: bool = False
    poll: int = 50
    flash_attn: str | bool | None = None  # on, off, auto (or True/False); None: auto
    n_ctx: int | None = None         # None: n_prompt + n_gen
    verbose: bool = False            # llama.cpp's log into the process's stderr log

    def args(self) -> list[str]:
        args = ["-m", str(self.model), "-p", str(self.n_prompt), "-n", str(self.n_gen), "-b", str(self.n_batch),
                "-ub", str(self.n_ubatch), "-ngl", str(self.n_gpu_layers), "-ncmoe", str(self.n_cpu_moe),
                "-C", self.cpu_mask, "--cpu-strict", "1" if self.cpu_strict else "0", "--poll", str(self.poll)]
        if self.load_mode is not None:
            args += ["-lm", self.load_mode]
        if self.n_threads is not None:
            args += ["-t", str(self.n_threads)]
        if self.flash_attn is not None:
            fa = self.flash_attn
            args += ["-fa", ("on" if fa else "off") if isinstance(fa, bool) else fa]
        if self.n_ctx is not None:
            args += ["-c", str(self.n_ctx)]
        if self.verbose:
            args.append("-v")
        return args


class _NoLine(Exception):
    """No line came: `eof` says whether the process closed its stdout (else the time ran out)."""

    def __init__(self, eof: bool):
        super().__init__("eof" if eof else "timeout")
        self.eof = eof


class PacedProcess:
    """One driver process. `start()` returns at once, so several can load in parallel before `wait_ready`.

    Its stderr goes to a file (`log_path`; a temporary one unless given, removed after a clean exit), so a
    chatty process can never block on a full pipe; errors quote its last lines."""

    def __init__(self, exe: Path, spec: PacedSpec, env: dict[str, str] | None = None, *,
                 log_path: Path | None = None, label: str | None = None):
        self.exe = Path(exe)
        self.spec = spec
        self.env = env
        self.log_path = Path(log_path) if log_path is not None else None
        self.label = label or f"{self.exe.name} of {self.exe.parent.parent.name}"  # names the build dir
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self._own_log = log_path is None
        self._buf = b""
        self._closed = False

    def __enter__(self) -> PacedProcess:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> PacedProcess:
        if self.proc is not None:
            raise RuntimeError(f"{self.label} was already started")
        if self._own_log:
            fd, name = tempfile.mkstemp(prefix=f"{self.exe.name}-", suffix=".log")
            self.log_path = Path(name)
            log = os.fdopen(fd, "wb")
        else:
            log = open(self.log_path, "wb")
        with log:  # the child holds its own descriptor
            try:
                self.proc = subprocess.Popen([str(self.exe), *self.spec.args()], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, stderr=log, bufsize=0,
                                             env={**os.environ, **(self.env or {})})
            except OSError as exc:
                if self._own_log:
                    self.log_path.unlink(missing_ok=True)
                raise UserError(f"cannot start {self.exe}: {exc}",
                                "compile it with pyllama_moe.bench.paced_process.ensure_tool(build)") from None
        return self

    def log_tail(self, n: int = 5) -> str:
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except (OSError, AttributeError):
            return "(no log)"
        return " | ".join(lines[-n:]) or "(empty log)"

    def _dead(self, what: str) -> UserError:
        try:
            rc = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            rc = "unknown"
        return UserError(f"{self.label} exited (status {rc}) {what}; its log {self.log_path} ends: {self.log_tail()}",
                         "fix what the log names and start it again")

    def _timed_out(self, what: str, timeout: float) -> UserError:
        # a late answer would pair with the next command, so a process that missed its deadline is stopped
        self.proc.kill()
        self.proc.wait()
        return UserError(f"{self.label} did not answer within {timeout:g} s {what}, so it was stopped; "
                         f"its log {self.log_path} ends: {self.log_tail()}",
                         "give it a longer timeout, or fewer tokens per command")

    def _read_line(self, deadline: float) -> str:
        if self.proc is None:
            raise RuntimeError(f"{self.label} was not started")
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _NoLine(eof=False)
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise _NoLine(eof=True)
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode(errors="replace").strip()

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Block until the model is loaded and the context made (the `ready` line)."""
        deadline = time.monotonic() + timeout
        what = "while loading the model"
        try:
            while self._read_line(deadline) != "ready":
                pass  # nothing else is printed before ready; a stray line is no reason to give up
        except _NoLine as no:
            raise self._dead(what) if no.eof else self._timed_out(what, timeout) from None

    def run(self, cmd: str, timeout: float = 600.0) -> dict:
        """Send one command (`pp`, `tg`, `pp N`, `tg N`) and return its reply, e.g.
        `{"kind": "tg", "n_tokens": 128, "ns": 61234567}`; an `error` reply raises UserError, and the process
        keeps serving."""
        if self.proc is None:
            raise RuntimeError(f"{self.label} was not started")
        what = f"to {cmd!r}"
        try:
            self.proc.stdin.write(cmd.strip().encode() + b"\n")
        except (BrokenPipeError, OSError):
            raise self._dead(f"before {cmd!r} could be sent") from None
        try:
            line = self._read_line(time.monotonic() + timeout)
        except _NoLine as no:
            raise self._dead(f"while answering {cmd!r}") if no.eof else self._timed_out(what, timeout) from None
        try:
            reply = json.loads(line)
        except ValueError:
            raise UserError(f"{self.label} answered {cmd!r} with {line!r}, which is not JSON",
                            f"check that {self.exe} was compiled from {TOOL_SOURCE}") from None
        if "error" in reply:
            raise UserError(f"{self.label} refused {cmd!r}: {reply['error']}")
        return reply

    def close(self, timeout: float = 30.0) -> None:
        """Ask the process to quit; kill it if it has not exited within `timeout`. Safe to call twice."""
        if self._closed or self.proc is None:
            return
        self._closed = True
        proc = self.proc
        try:
            if proc.poll() is None:
                proc.stdin.write(b"quit\n")
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        self.returncode = proc.returncode
        if self._own_log and self.returncode == 0 and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
