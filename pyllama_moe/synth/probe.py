"""Check a library folder and a llama_cpp package given by the user, then run a worker mode ("routes",
"roundtrip") on them in a child process (pyllama_moe.worker) and return its JSON reply."""

from __future__ import annotations

import os
from pathlib import Path

from pyllama_moe.errors import UserError
from pyllama_moe.worker.spawn import run_worker

_LIB_NAMES = {"llama": ("libllama.so", "libllama.dylib", "llama.dll"),
              "ggml": ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll",
                       "libggml.so", "libggml.dylib", "ggml.dll")}


def find_libs(lib_dir: str | os.PathLike) -> tuple[Path, Path]:
    """(libllama, the ggml library holding ggml_backend_tensor_get) in `lib_dir`, or UserError."""
    d = Path(lib_dir)
    if not d.is_dir():
        raise UserError(f"llama.cpp library directory {d} does not exist", "point --lib at the folder with libllama")
    found = {}
    for key, names in _LIB_NAMES.items():
        found[key] = next((d / n for n in names if (d / n).exists()), None)
    if found["llama"] is None:
        raise UserError(f"no libllama in {d}", "point --lib at a llama.cpp build's bin/ or lib/ folder")
    if found["ggml"] is None:
        raise UserError(f"no libggml-base (or libggml) next to libllama in {d}",
                        "use a shared-library build of llama.cpp (-DBUILD_SHARED_LIBS=ON)")
    return found["llama"], found["ggml"]


def check_pkg_parent(pkg_parent: str | os.PathLike) -> Path:
    p = Path(pkg_parent)
    if not (p / "llama_cpp" / "__init__.py").is_file():
        raise UserError(f"no llama_cpp package in {p}",
                        "give the folder that *contains* llama_cpp/ (llama-cpp-python's source root)")
    return p


def run_probe(mode: str, model: str | os.PathLike, lib_dir: str | os.PathLike, pkg_parent: str | os.PathLike,
              *, timeout: float | None = None, n_gpu_layers: int = 0, **fields) -> dict:
    """The reply of worker mode `mode` on `model` with the llama.cpp in `lib_dir` and the llama_cpp package in
    `pkg_parent`; `fields` are the mode's request fields (see pyllama_moe/worker/mode_*.py)."""
    _, ggml = find_libs(lib_dir)
    pkg = check_pkg_parent(pkg_parent)
    req = {"model": str(Path(model).resolve()), "ggml_base": str(ggml.resolve()), "n_gpu_layers": n_gpu_layers,
           **fields}
    reply, _log = run_worker(
        mode, req, lib_dir=Path(lib_dir).resolve(), llama_cpp_pkg=pkg.resolve(), timeout=timeout,
        who=f"llama.cpp in {lib_dir}",
        fix="check that --lib and --llama-cpp-pkg are the same llama.cpp version and that the model is for it "
            "(the log lines above may say which)")
    return reply
