"""Builds: cmake + ninja over a prepared tree, in a directory named by the build key.

The key hashes everything that goes into the build, and the stamp is written last, atomically, so a directory
without one (a failed or interrupted build) is never taken for a good one. See docs/builds.md, "Build keys and
stamps".
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pyllama_moe.errors import UserError
from pyllama_moe.paths import cache_dir
from pyllama_moe.progress import Progress, say
from pyllama_moe.source.pin import load_pin
from pyllama_moe.source.trees import Tree

STAMP_NAME = "pyllama-moe-stamp.json"
BACKENDS = ("cpu", "cuda")
# llama-gguf-split: the split-GGUF models of the matrix are cut by llama.cpp's own tool (harness/models.py)
DEFAULT_TARGETS = ("llama", "llama-bench", "llama-perplexity", "llama-completion", "test-backend-ops", "llama-gguf-split")
# the tools the patch series adds (bench --pcie-bound; the CPU round trip of async CPU splits), and a user's
# llama-server and llama-cli, which take its flags
PATCHED_ONLY_TARGETS = ("llama-moe-copy-probe", "llama-moe-roundtrip", "llama-server", "llama-cli")
COMMON_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=OFF", "-DGGML_CCACHE=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_TESTS=ON", "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    # llama-server and llama-cli are configured in every build (one build dir serves the harness and a user's
    # tools; only the targets asked for are compiled), with the web UI built from the tree, never downloaded
    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_USE_PREBUILT_UI=OFF",
)
CUDA_OPTIONS = ("-DGGML_CUDA=ON", "-DGGML_CUDA_FA_QUANTS=f16-f16", "-DGGML_CUDA_NCCL=OFF")


def native_cuda_arch() -> str:
    """The architectures of the GPUs present, as CMAKE_CUDA_ARCHITECTURES (e.g. "86-real;90-real"): what llama.cpp's
    own CMake builds for by default ("native"), spelled out so that the build key says which GPU it was built for."""
    smi = shutil.which("nvidia-smi")
    fix = "pass --cuda-arch for the GPU that will run it (e.g. 86-real for an RTX 3090/A10, 89-real for an RTX 4090, " \
          "90-real for an H100/H200; several: \"86-real;90-real\")"
    if smi is None:
        raise UserError("--backend cuda builds for the GPU present by default, but nvidia-smi is not on PATH", fix)
    out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True, text=True)
    caps = sorted({line.strip() for line in out.stdout.splitlines() if re.fullmatch(r"\d+\.\d+", line.strip())},
                  key=lambda c: tuple(int(x) for x in c.split(".")))
    if out.returncode != 0 or not caps:
        raise UserError("--backend cuda builds for the GPU present by default, but nvidia-smi reports no GPU", fix)
    arch = ";".join(f"{c.replace('.', '')}-real" for c in caps)
    say(f"CUDA architecture: {arch} (the GPU present; --cuda-arch chooses another)")
    return arch


def default_targets(variant: str) -> tuple[str, ...]:
    return DEFAULT_TARGETS + (PATCHED_ONLY_TARGETS if variant == "patched" else ())


@dataclass
class BuildSpec:
    tree: Tree
    backend: str = "cpu"
    cuda_arch: str = "native"  # CMAKE_CUDA_ARCHITECTURES; "native": the GPUs present, resolved for the key
    extra_options: tuple[str, ...] = ()
    targets: tuple[str, ...] | None = None  # None: default_targets(variant)
    jobs: int | None = None

    def __post_init__(self) -> None:
        if self.targets is None:
            self.targets = default_targets(self.tree.variant)
        if self.backend == "cuda" and self.cuda_arch == "native":
            self.cuda_arch = native_cuda_arch()

    def options(self) -> list[str]:
        opts = list(COMMON_OPTIONS)
        if self.backend == "cuda":
            opts += [*CUDA_OPTIONS, f"-DCMAKE_CUDA_ARCHITECTURES={self.cuda_arch}"]
        return opts + list(self.extra_options)


@dataclass
class Build:
    """A finished build directory whose stamp matched."""

    path: Path
    key: str
    variant: str
    backend: str
    targets: list[str] = field(default_factory=list)

    @property
    def bin_dir(self) -> Path:
        return self.path / "bin"

    def tool(self, name: str) -> Path:
        exe = self.bin_dir / name
        if not exe.is_file():
            raise UserError(f"{exe} was not built", f"rebuild with --targets {name} (build dir {self.path})")
        return exe


def tool_path(name: str) -> str:
    """cmake/ninja from PATH, else from the PyPI wheels this package depends on."""
    found = shutil.which(name)
    if found:
        return found
    try:
        module = __import__(name)
        bin_dir = Path(getattr(module, "BIN_DIR", None) or getattr(module, "CMAKE_BIN_DIR", ""))
        candidate = bin_dir / name
        if candidate.is_file():
            return str(candidate)
    except ImportError:
        pass
    raise UserError(f"{name} was not found on PATH", f"install it: `pip install {name}` (or your system package)")


def _first_line(cmd: list[str]) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return ""
    out = (proc.stdout or proc.stderr).strip().splitlines()
    return out[0] if proc.returncode == 0 and out else ""


def compiler_ids(backend: str) -> dict[str, str]:
    cc = os.environ.get("CC", "cc")
    cxx = os.environ.get("CXX", "c++")
    ids = {"cc": _first_line([cc, "--version"]), "cxx": _first_line([cxx, "--version"]),
           "cmake": _first_line([tool_path("cmake"), "--version"])}
    if not ids["cc"] or not ids["cxx"]:
        raise UserError(f"no working C/C++ compiler ({cc}, {cxx})", "install gcc and g++ (e.g. apt-get install build-essential)")
    if backend == "cuda":
        nvcc = os.environ.get("CUDACXX") or shutil.which("nvcc")
        if not nvcc:
            raise UserError("--backend cuda needs nvcc, which is neither on PATH nor named by CUDACXX",
                            "install the CUDA toolkit and add its bin/ to PATH (e.g. /usr/local/cuda/bin)")
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
        ids["nvcc"] = out[-1] if out else "unknown"
    return ids


def build_key(spec: BuildSpec) -> tuple[str, dict]:
    """The key and the record it was computed from (kept in the stamp, so a mismatch can be explained)."""
    record = {
        "variant": spec.tree.variant,
        "backend": spec.backend,
        "source": spec.tree.source_id,
        "options": sorted(spec.options()),
        "compilers": compiler_ids(spec.backend),
    }
    if spec.tree.variant == "patched":
        record["patch_inputs"] = spec.tree.inputs  # master's key leaves the patch inputs out by construction
    key = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:24]
    return key, record


def build_dir_for(variant: str, backend: str, key: str) -> Path:
    return cache_dir("builds") / f"{variant}-{backend}-{key}"


def read_stamp(path: Path) -> dict | None:
    try:
        return json.loads((path / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None


def _write_stamp(path: Path, stamp: dict) -> None:
    tmp = path / (STAMP_NAME + ".tmp")
    tmp.write_text(json.dumps(stamp, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path / STAMP_NAME)


def _run_logged(cmd: list[str], log: Path, label: str, cwd: Path | None = None) -> None:
    """Run a build step with its output in `log`, a progress line from ninja's [n/m] counter."""
    progress = Progress(label)
    with open(log, "ab") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n".encode())
        fh.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        for raw in proc.stdout:
            fh.write(raw)
            match = re.match(rb"\[(\d+)/(\d+)\]", raw)
            if match:
                progress.total = int(match.group(2))
                progress.update(int(match.group(1)))
        rc = proc.wait()
    if rc != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        sys.stderr.write("\n".join(tail) + "\n")
        raise UserError(f"{label} failed (exit {rc}); full log: {log}", "fix the error shown above and run the build again")
    progress.finish("done")


def build(spec: BuildSpec) -> Build:
    """Configure and build, or reuse a build whose stamp has the same key and all requested targets."""
    if spec.backend not in BACKENDS:
        raise UserError(f"unknown backend {spec.backend!r}", f"use one of {', '.join(BACKENDS)}")
    key, record = build_key(spec)
    path = build_dir_for(spec.tree.variant, spec.backend, key)
    # two processes asking for the same key (a test run next to a compare) take turns: the second finds the
    # first one's stamp instead of wiping the directory under it
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another process building {path.name}...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_locked(spec, key, record, path)


def _build_locked(spec: BuildSpec, key: str, record: dict, path: Path) -> Build:
    stamp = read_stamp(path)
    if stamp and stamp.get("key") == key and set(spec.targets) <= set(stamp.get("targets", [])):
        return Build(path, key, spec.tree.variant, spec.backend, stamp["targets"])
    have = stamp.get("targets", []) if stamp and stamp.get("key") == key else []
    if not have and path.exists():
        shutil.rmtree(path)  # a failed or interrupted build of this key: start clean
    path.mkdir(parents=True, exist_ok=True)
    log = path / "build.log"
    pin = load_pin()
    options = spec.options()
    if spec.tree.variant == "patched":
        options += [f"-DLLAMA_MOE_BUILD_KEY={key}", "-DLLAMA_MOE_VARIANT=patched",
                    f"-DLLAMA_MOE_PIN={pin.version}@{pin.commit}"]
    cmake, ninja = tool_path("cmake"), tool_path("ninja")
    started = time.monotonic()
    say(f"building {spec.tree.variant}/{spec.backend} in {path} (log: {log})")
    if not (path / "build.ninja").is_file():
        _run_logged([cmake, "-S", str(spec.tree.path), "-B", str(path), "-G", "Ninja",
                     f"-DCMAKE_MAKE_PROGRAM={ninja}", *options], log, f"configure {spec.tree.variant}")
    jobs = ["-j", str(spec.jobs)] if spec.jobs else []
    targets = sorted(set(spec.targets) | set(have))
    _run_logged([ninja, "-C", str(path), *jobs, *targets], log, f"build {spec.tree.variant}/{spec.backend}")
    _write_stamp(path, {"key": key, "record": record, "targets": targets, "variant": spec.tree.variant,
                        "backend": spec.backend, "seconds": round(time.monotonic() - started, 1)})
    return Build(path, key, spec.tree.variant, spec.backend, targets)


def find_build(variant: str, backend: str, key: str) -> Build:
    """A finished build of exactly this key, or a UserError that says how to make it."""
    path = build_dir_for(variant, backend, key)
    stamp = read_stamp(path)
    if not stamp:
        raise UserError(f"no finished {variant}/{backend} build with key {key} ({path})",
                        f"run `pyllama-moe build --variant {variant} --backend {backend}`")
    if stamp.get("key") != key:
        raise UserError(f"{path} is stamped with key {stamp.get('key')}, expected {key}",
                        f"run `pyllama-moe build --variant {variant} --backend {backend}` to rebuild it")
    return Build(path, key, variant, backend, stamp.get("targets", []))


def resolve(variant: str, backend: str = "cpu", *, sdist: Path | None = None, llama_src: Path | None = None,
            archive: Path | None = None, other_series: bool = False, make: bool = True, **spec_kwargs) -> Build:
    """The build of `variant` for the current pin and patch inputs: reused when its key is stamped, else built
    (or, with make=False, a UserError that says how to build it)."""
    from pyllama_moe.source import packs, sdist as source, trees  # late: packs imports this module

    # no sdist here, but this pin's archive was unpacked: its tree, as it was built
    offline = packs.unpacked_tree(variant) if archive is None and sdist is None and llama_src is None else None
    if archive is not None:
        tree = packs.unpack(Path(archive), variant, other_series=other_series)
    elif offline is not None:
        tree = offline
    else:
        tree = trees.prepare(source.ensure_source(sdist, llama_src), variant)
    spec = BuildSpec(tree, backend, **spec_kwargs)
    if make:
        return build(spec)
    key, _ = build_key(spec)
    return find_build(variant, backend, key)
