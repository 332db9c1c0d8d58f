"""Parent side of probe_worker.py: check the inputs, run the worker in a child process, return its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pyllama_moe.errors import UserError

WORKER = Path(__file__).with_name("probe_worker.py")
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
              *, timeout: float | None = None, **fields) -> dict:
    _, ggml = find_libs(lib_dir)
    pkg = check_pkg_parent(pkg_parent)
    with tempfile.TemporaryDirectory(prefix="pyllama-moe-probe-") as tmp:
        req = {"mode": mode, "model": str(Path(model).resolve()), "lib_dir": str(Path(lib_dir).resolve()),
               "pkg_parent": str(pkg.resolve()), "ggml_base": str(ggml.resolve()),
               "out": os.path.join(tmp, "result.json"), **fields}
        req_file = os.path.join(tmp, "request.json")
        with open(req_file, "w") as f:
            json.dump(req, f)
        env = dict(os.environ, LLAMA_CPP_LIB_PATH=req["lib_dir"])
        try:
            proc = subprocess.run([sys.executable, str(WORKER), req_file], capture_output=True, text=True,
                                  timeout=timeout, env=env, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise UserError(f"llama.cpp took over {timeout:.0f} s on {model}",
                            "use a smaller model or fewer tokens, or raise the timeout") from None
        if proc.returncode != 0 or not os.path.exists(req["out"]):
            tail = (proc.stderr or "").strip().splitlines()[-12:]
            how = f"exit code {proc.returncode}" if proc.returncode >= 0 else f"signal {-proc.returncode}"
            raise UserError(
                f"llama.cpp failed on {model} ({how}): " + " | ".join(tail),
                "check that --lib and --llama-cpp-pkg are the same llama.cpp version and that the model is for it")
        with open(req["out"]) as f:
            return json.load(f)
