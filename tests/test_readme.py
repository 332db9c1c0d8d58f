"""The README's commands as written, where a CPU machine can run them. The GPU quick start's llama.cpp lines run on
the patched CPU build with the tiny model standing in for model.gguf; its pyllama-moe lines go through the CLI's
parser (the CUDA build and the 17 GB model are the GPU machine's: ci/gpu/readme.sh runs those there). The two
commands on a fresh machine are what .ci/run runs and the demo's own test."""
from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pyllama_moe.cli.main import build_parser
from pyllama_moe.paths import PROJECT_ROOT

README = PROJECT_ROOT / "README.md"


def readme_lines(heading: str, language: str = "sh") -> list[str]:
    """The lines of the fenced blocks of `language` under `## heading`, comments and blank lines dropped."""
    lines, on, code = [], False, False
    for line in README.read_text().splitlines():
        if line.startswith("## "):
            on = line == f"## {heading}"
        elif on and line.startswith("```"):
            code = not code and line == f"```{language}"
        elif on and code and line.strip() and not line.startswith("#"):
            lines.append(line)
    return lines


QUICK_START = "Quick start on a GPU"


def test_the_quick_start_and_the_python_block_are_there():
    lines = readme_lines(QUICK_START)
    assert any(line.startswith("B=$(pyllama-moe build ") for line in lines)
    assert any("/llama-server " in line for line in lines) and any(line.startswith("curl ") for line in lines)
    assert readme_lines("From Python", "python")
    start = README.read_text().splitlines().index(f"## {QUICK_START}")
    assert start < 60, "the GPU quick start belongs in the README's first 60 lines"


def pyllama_moe_argv(line: str) -> list[str] | None:
    m = re.search(r"\$\(pyllama-moe ([^)]*)\)", line)
    if m:
        return shlex.split(m.group(1))
    return shlex.split(line)[1:] if line.startswith("pyllama-moe ") else None


def test_the_quick_starts_pyllama_moe_lines_parse(tiny_model, tmp_path, monkeypatch):
    argvs = [argv for argv in map(pyllama_moe_argv, readme_lines(QUICK_START)) if argv is not None]
    assert len(argvs) >= 3
    monkeypatch.chdir(tmp_path)  # the quick start's folder: its model.gguf (checked when parsed) is the tiny one
    (tmp_path / "model.gguf").symlink_to(tiny_model)
    parser = build_parser()
    for argv in argvs:
        args = parser.parse_args(argv)  # a flag that is not there exits 2 here
        assert callable(args.func), argv


NOT_MADE = re.compile(r"llama_moe: expert cache of \d+ MiB not made: .*no GPU holds the layer")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_here(line: str, bin_dir: Path, model: Path, port: int) -> list[str]:
    """A quick-start line with this build for $B, the tiny model for model.gguf and a free port for 8080."""
    line = line.replace("$B/", f"{bin_dir}/").replace("model.gguf", str(model))
    return shlex.split(line.replace("8080", str(port)))


@pytest.mark.build
def test_the_quick_starts_llama_cpp_lines_run_on_the_cpu_build(patched_build, tiny_model):
    port, bin_dir = free_port(), Path(patched_build.path) / "bin"
    lines = readme_lines(QUICK_START)
    direct = [line for line in lines if line.startswith("$B/") and "/llama-server " not in line]
    assert {Path(shlex.split(line)[0]).name for line in direct} >= {"llama-cli", "llama-bench"}
    for line in direct:
        proc = subprocess.run(as_here(line, bin_dir, tiny_model, port) + ["-t", "2"], capture_output=True,
                              text=True, timeout=600, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, (line, proc.stderr[-2000:])
        if "llama-bench" in line:  # both cache sizes became rows, each with its own column value
            rows = [r for r in proc.stdout.splitlines() if r.startswith("|") and ("pp512" in r or "tg128" in r)]
            assert len(rows) == 4, proc.stdout

    server_line = next(line for line in lines if "/llama-server " in line)
    curl_line = next(line for line in lines if line.startswith("curl "))
    server = subprocess.Popen(as_here(server_line, bin_dir, tiny_model, port) + ["-t", "2"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None, server.stderr.read()[-2000:]
                time.sleep(0.5)
        proc = subprocess.run(as_here(curl_line, bin_dir, tiny_model, port), capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["content"]
    finally:
        server.terminate()
        _, err = server.communicate(timeout=60)
    assert NOT_MADE.search(err), err[-2000:]


@pytest.mark.build
def test_the_python_block_runs_on_the_cpu_build_and_says_the_cache_needs_a_gpu(patched_build, tiny_model):
    code = "\n".join(readme_lines("From Python", "python"))
    assert 'use_build("patched", "cuda")' in code and '"model.gguf"' in code
    code = code.replace('use_build("patched", "cuda")', 'use_build("patched", "cpu")')
    code = code.replace('"model.gguf"', repr(str(tiny_model)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GGML_SIM_", "LLAMA_MOE_", "LLAMA_CPP_LIB"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=PROJECT_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text, hit_rate = proc.stdout.rstrip("\n").rsplit("\n", 1)
    assert text.strip() and hit_rate == "None"
    assert "the expert cache needs a GPU" in proc.stderr
