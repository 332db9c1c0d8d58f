"""Parent side of the worker: the one way to run a request in a fresh `python -m pyllama_moe.worker` process.

harness/runner.py (mode "logits") and synth/probe.py ("routes", "roundtrip") both come through run_worker, so the
child's environment, the request and reply files and the report of a failure are the same for every caller.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from pyllama_moe.errors import UserError
from pyllama_moe.paths import PROJECT_ROOT

LOG_TAIL_LINES = 12  # of the child's stderr, shown above the error when it fails


def worker_env(lib_dir: str | os.PathLike, llama_cpp_pkg: str | os.PathLike,
               extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a worker: llama_cpp loads libllama from `lib_dir` (LLAMA_CPP_LIB_PATH),
    `import llama_cpp` finds the package in `llama_cpp_pkg` (the folder that contains llama_cpp/) before any
    installed one, and `import pyllama_moe` finds this checkout; then `extra` on top."""
    env = dict(os.environ)
    env["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(llama_cpp_pkg), str(PROJECT_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra or {})
    return env


def run_worker(mode: str, request: dict, *, lib_dir: str | os.PathLike, llama_cpp_pkg: str | os.PathLike,
               who: str, fix: str = "see the log lines above", env: dict[str, str] | None = None,
               timeout: float | None = None) -> tuple[dict, str]:
    """Run `request` (which names its "model") in worker mode `mode`; return (reply, the child's stderr, i.e.
    llama.cpp's log). A failure raises UserError "`who` failed on MODEL: why" with `fix`, after writing the
    last lines of the log to stderr; `env` is added to the child's environment."""
    model = request["model"]
    with tempfile.TemporaryDirectory(prefix="pyllama-moe-worker-") as tmp:
        request_path, reply_path = Path(tmp) / "request.json", Path(tmp) / "reply.json"
        request_path.write_text(json.dumps({"mode": mode, **request}))
        try:
            proc = subprocess.run([sys.executable, "-m", "pyllama_moe.worker", str(request_path), str(reply_path)],
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace",
                                  timeout=timeout, env=worker_env(lib_dir, llama_cpp_pkg, env))
        except subprocess.TimeoutExpired:
            raise UserError(f"{who} took over {timeout:.0f} s on {model}",
                            "use a smaller model or fewer tokens, or raise the timeout") from None
        reply = json.loads(reply_path.read_text()) if reply_path.exists() else None
    if proc.returncode != 0 or reply is None or "error" in reply:
        tail = proc.stderr.strip().splitlines()[-LOG_TAIL_LINES:]
        sys.stderr.write("".join(line + "\n" for line in tail))
        raise UserError(f"{who} failed on {model}: {_why(proc.returncode, reply)}", fix)
    return reply, proc.stderr


def _why(returncode: int, reply: dict | None) -> str:
    if reply and "error" in reply:
        return reply["error"]
    if returncode < 0:
        try:
            how = f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"killed by signal {-returncode}"
    elif returncode:
        how = f"exit code {returncode}"
    else:
        return "it exited without writing its reply"
    return how if reply is not None else f"{how} before writing its reply"
