"""Entry of the worker process: `python -m pyllama_moe.worker REQUEST.json REPLY.json` (started by spawn.py).

Sets the process up the same way for every mode, then runs the mode the request names and writes its reply.
Only the standard library is imported at the top: the order of the set-up steps in `main` matters.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import traceback
from pathlib import Path

MODES = ("logits", "routes", "roundtrip")
USAGE = "usage: python -m pyllama_moe.worker REQUEST.json REPLY.json (start it through pyllama_moe.worker.spawn)"

_log_callback = None  # llama.cpp keeps only the C pointer: the Python object must outlive every log line
_ALERT_LEVELS = (3, 4)  # GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
_moe_alerts: list[str] = []  # the patched build's own warnings and errors, in the reply for the parent to show


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write(USAGE + "\n")
        return 2
    request_path, reply_path = argv
    try:
        reply = serve(json.loads(Path(request_path).read_text()))
    except Exception as exc:  # reported to the parent, which names the build and the model
        if not isinstance(exc, RuntimeError):  # a RuntimeError is a failure named here; anything else is a bug
            traceback.print_exc()
        reply = {"error": f"{type(exc).__name__}: {exc}"}
    if _moe_alerts:
        reply["llama_moe_alerts"] = list(_moe_alerts)
    Path(reply_path).write_text(json.dumps(reply))
    return 1 if "error" in reply else 0


def serve(request: dict) -> dict:
    mode = request.get("mode")
    if mode not in MODES:
        raise RuntimeError(f"unknown worker mode {mode!r}: the request's \"mode\" must be one of {', '.join(MODES)}")
    lib_dir = _lib_dir()
    libllama = _preload_libllama(lib_dir)
    if request.get("expect_build"):
        _check_build(libllama, lib_dir, request["expect_build"])
    llama_cpp = _import_llama_cpp()
    _capture_log(llama_cpp)
    llama_cpp.llama_backend_init()
    return _mode_runner(mode)(llama_cpp, request, lib_dir)


def _lib_dir() -> Path:
    value = os.environ.get("LLAMA_CPP_LIB_PATH")
    if not value:
        raise RuntimeError("LLAMA_CPP_LIB_PATH is not set: start the worker through "
                           "pyllama_moe.worker.spawn.run_worker, which points it at the build's library folder")
    return Path(value)


def _preload_libllama(lib_dir: Path) -> ctypes.CDLL:
    # Load the build's libllama (and so its libstdc++) before any other extension module: on the GPU machine an
    # import that came first (numpy, in its Python environment) brought a libstdc++ that the CUDA build's C++
    # code then crashed against (segfault while printing model info), where preloading the system one fixed it.
    path = lib_dir / "libllama.so"
    try:
        return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        raise RuntimeError(f"cannot load {path} ({exc}): LLAMA_CPP_LIB_PATH must be the library folder of a "
                           "shared-library llama.cpp build") from None


def _check_build(libllama: ctypes.CDLL, lib_dir: Path, expect: dict) -> None:
    """Refuse a library that is not the build the parent asked for (its embedded key; master has none)."""
    from pyllama_moe.build.info import embedded_mismatch, parse_build_info  # pure Python: safe before numpy

    fn = getattr(libllama, "llama_moe_build_info", None)
    if fn is not None:
        fn.restype = ctypes.c_char_p
    info = parse_build_info(fn().decode()) if fn is not None else None
    why = embedded_mismatch(expect.get("variant"), expect.get("key"), info, lib_dir / "libllama.so")
    if why:
        raise RuntimeError(f"{why}; rebuild it")


def _import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as exc:
        raise RuntimeError(f"cannot import llama_cpp ({exc}): PYTHONPATH must hold the folder that contains the "
                           "sdist's llama_cpp package, as spawn.run_worker sets it") from None
    return llama_cpp


def _capture_log(llama_cpp) -> None:
    """llama.cpp's (and ggml's) log lines go to stderr as they come: the parent keeps stderr as the run's log,
    which tests read, and shows its last lines when the run fails. Installed by us rather than left to
    llama_cpp's own logger so that the log does not depend on that package's version or logging level."""
    global _log_callback

    @llama_cpp.llama_log_callback
    def write(level, text, _user_data):
        line = text.decode("utf-8", "replace")
        sys.stderr.write(line)
        sys.stderr.flush()
        if is_moe_alert(level, line):
            _moe_alerts.append(line.rstrip("\n"))

    _log_callback = write
    llama_cpp.llama_log_set(write, ctypes.c_void_p(0))


def is_moe_alert(level: int, line: str) -> bool:
    """A warning or error of the patched build (`llama_moe: ...`): the user must see it even when the run goes on
    (a refused expert cache profile, a cache that did not fit), where the rest of the log stays in the reply."""
    return level in _ALERT_LEVELS and line.startswith("llama_moe:")


def _mode_runner(mode: str):
    """The mode's run(llama_cpp, request, lib_dir) -> reply; imported here, after the preload (they use numpy)."""
    from pyllama_moe.worker import mode_logits, mode_roundtrip, mode_routes

    return {"logits": mode_logits.run, "routes": mode_routes.run, "roundtrip": mode_roundtrip.run}[mode]


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
