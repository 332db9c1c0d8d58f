"""llama-server with the expert cache, on one SIM device with every expert on the host and 4
parallel slots: a fixed set of prompts sent one after the other completes as with the cache off, sent at once all
complete, and the cache's summary at exit counts hits. The server is built in a build of its own (llama-server is
not among the harness's default targets)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request

import pytest


pytestmark = pytest.mark.build

PROMPTS = [" ".join(f"w{(i * 37 + k * 11) % 97}" for k in range(24 + 4 * i)) for i in range(4)]
N_PREDICT = 24


class Server:
    def __init__(self, build, model, cache_mib: int, log_path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GGML_SIM_", "LLAMA_MOE_", "LLAMA_ARG_"))}
        env.update(GGML_SIM_DEVICES="1", GGML_SIM_POISON="1")
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [str(build.bin_dir / "llama-server"), "-m", str(model), "-ngl", "99", "-cmoe", "-np", "4", "-c", "2048",
             "-t", "2", "--host", "127.0.0.1", "--port", str(self.port), "--fit", "off", "--moe-cache-mib", str(cache_mib),
             "-v"], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert self.proc.poll() is None, open(log_path, errors="replace").read()[-3000:]
            assert time.monotonic() < deadline, "llama-server did not come up in 120 s"
            time.sleep(0.3)

    def complete(self, prompt: str) -> str:
        body = json.dumps({"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0, "cache_prompt": False,
                           "seed": 1}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["content"]

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGINT)  # a clean shutdown frees the context: the cache's summary is logged
        self.proc.wait(timeout=60)
        self.log.close()
        return open(self.log_path, errors="replace").read()


def test_four_slots_with_the_cache_complete_as_without_it(server_build, tiny_model, tmp_path):
    off = Server(server_build, tiny_model, 0, tmp_path / "off.log")
    try:
        want = [off.complete(p) for p in PROMPTS]
    finally:
        off.stop()
    on = Server(server_build, tiny_model, 2, tmp_path / "on.log")
    try:
        assert [on.complete(p) for p in PROMPTS] == want  # one after the other: each alone in the batch
        got: list = [None] * len(PROMPTS)

        def send(i):
            got[i] = on.complete(PROMPTS[i])

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(isinstance(text, str) for text in got)  # at once: the slots share batches, all complete
    finally:
        log = on.stop()
    assert on.proc.returncode == 0, log[-3000:]
    assert re.search(r"llama_moe: expert cache on SIM0: [0-9.]+ MiB", log)
    summary = re.search(r"llama_moe: expert cache, decode: (\d+) layer steps, (\d+) hits, (\d+) misses", log)
    assert summary and int(summary.group(2)) > 0 and int(summary.group(3)) > 0, log[-3000:]
