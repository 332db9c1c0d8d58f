"""The verb `server-soak`: llama-server with the expert cache on, under concurrent load, checked for drift.

A fixed greedy probe set, resent between stretches of random concurrent requests that make the cache be planned
again (new adapter scales, device samplers), must return the same bytes every round: the cache's state must never
show in the output. Slots are erased before each probe round so that only the cache's state can differ. The
setup, the checks and `--compare-all-gpu`: docs/cli.md, "`server-soak`".
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pyllama_moe.errors import UserError

# the server's batch and ubatch, passed explicitly: the probes' ubatch sizes decide which cache paths they take
N_BATCH, N_UBATCH = 2048, 512
PROBE_PREDICT, PROBE_PROBS = 16, 4
# (prompt tokens, extra request fields): prompts of one ubatch at and above the offload batch, of three ubatches
# with a small last one, a one-token prompt, one below the offload batch (its experts on the CPU, so not
# all-on-GPU bytes), and two with a per-request adapter scale (one of them the adapter off)
PROBES: tuple[tuple[int, dict], ...] = (
    (100, {}), (600, {}), (1100, {}), (1, {}), (24, {}),
    (300, {"lora": [{"id": 0, "scale": 0.5}]}), (64, {"lora": [{"id": 0, "scale": 0.0}]}),
)
SOAK_LORA_SCALES = (0.0, 0.25, 0.5, 1.5, 2.0)
FIRST_TOKEN = 259  # past the synthetic vocabulary's special and byte tokens (synth/tokenizer.py)


@dataclass
class SoakConfig:
    server: Path  # the llama-server executable
    model: Path
    out: Path
    lora: Path | None = None  # None: a synthetic adapter is written to out/lora.gguf
    slots: int = 4
    clients: int = 6
    seconds: float = 180.0
    max_requests: int = 2000
    pause_every: float = 30.0
    max_prompt: int = 4000
    max_predict: int = 32
    ctx_per_slot: int = 4096
    cache_mib: int | None = None  # None: a quarter of the model's expert bytes
    threads: int = 4
    seed: int = 0
    env: dict[str, str] = field(default_factory=dict)
    wrapper: list[str] = field(default_factory=list)  # e.g. compute-sanitizer; memory is then not checked
    backend_sampling: bool = True
    compare_all_gpu: bool = False
    rss_growth_mib: float = 64.0
    rss_growth_pct: float = 10.0
    vram_growth_mib: float = 64.0
    sample_every: float = 2.0
    startup_timeout: float = 300.0
    request_timeout: float = 600.0
    plant_probe_change: bool = False  # negative control: the adapter's scale is not restored before later rounds


def check_config(c: SoakConfig) -> None:
    def bad(what: str, fix: str) -> None:
        raise UserError(what, fix)

    if not c.server.is_file() or not os.access(c.server, os.X_OK):
        bad(f"--server {c.server} is not an executable file", "give the patched build's bin/llama-server")
    if not c.model.is_file():
        bad(f"--model {c.model} does not exist", "give a GGUF model file")
    if c.lora is not None and not c.lora.is_file():
        bad(f"--lora {c.lora} does not exist", "give a GGUF adapter file, or leave --lora out to make one")
    for name, value, low in (("slots", c.slots, 1), ("clients", c.clients, 1), ("max-requests", c.max_requests, 1),
                             ("max-prompt", c.max_prompt, 1), ("max-predict", c.max_predict, 1),
                             ("threads", c.threads, 1)):
        if value < low:
            bad(f"--{name} {value}", f"use {low} or more")
    for name, value in (("seconds", c.seconds), ("pause-every", c.pause_every), ("sample-every", c.sample_every),
                        ("startup-timeout", c.startup_timeout), ("request-timeout", c.request_timeout)):
        if not value > 0:
            bad(f"--{name} {value}", "use a positive number of seconds")
    if c.cache_mib is not None and c.cache_mib < 1:
        bad(f"--cache-mib {c.cache_mib}", "use 1 or more (the soak is of the cache: it stays on)")
    longest_probe = max(n for n, _ in PROBES)
    need = max(c.max_prompt + c.max_predict, longest_probe + PROBE_PREDICT)
    if need > c.ctx_per_slot:
        bad(f"a slot needs {need} tokens of context (prompt, generated tokens, probes) but has {c.ctx_per_slot}",
            "raise --ctx-per-slot or lower --max-prompt / --max-predict")
    if c.out.exists() and not c.out.is_dir():
        bad(f"output {c.out} is not a folder", "give a folder (made when missing)")


def model_facts(model: Path, ctx_per_slot: int) -> tuple[int, int]:
    """(vocabulary size, bytes of expert weights) of a GGUF model whose training context holds `ctx_per_slot`."""
    from pyllama_moe.synth.gguf_read import read_gguf

    info = read_gguf(model, check_data=False)
    tokens = info.kv.get("tokenizer.ggml.tokens")
    if not tokens or len(tokens) <= FIRST_TOKEN + 16:
        raise UserError(f"{model} has no vocabulary of more than {FIRST_TOKEN + 16} tokens", "give a model GGUF")
    expert_bytes = sum(t.nbytes for t in info.tensors.values() if re.search(r"_exps\.weight$", t.name))
    if not expert_bytes:
        raise UserError(f"{model} has no expert tensors (*_exps.weight)", "give a Mixture-of-Experts model")
    n_ctx_train = info.arch_key("context_length")
    if isinstance(n_ctx_train, int) and ctx_per_slot > n_ctx_train:
        # llama-server cuts a slot's context to the training context: longer requests would fail as errors
        raise UserError(f"--ctx-per-slot {ctx_per_slot} is more than {model.name}'s training context {n_ctx_train}",
                        f"use at most {n_ctx_train} (and prompts to fit)")
    return len(tokens), expert_bytes


# --- the server -------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG: a driver killed by a timeout takes its server with it
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class Server:
    """A llama-server process on 127.0.0.1 (under a wrapper where given), its log in a file."""

    def __init__(self, args: list[str], wrapper: list[str], env: dict[str, str], log_path: Path,
                 startup_timeout: float, request_timeout: float):
        self.port = _free_port()
        self.log_path = log_path
        self.request_timeout = request_timeout
        base = {k: v for k, v in os.environ.items() if not k.startswith(("GGML_SIM_", "LLAMA_MOE_", "LLAMA_ARG_"))}
        self.cmd = [*wrapper, *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**base, **env}, preexec_fn=_die_with_parent)
        self.pid = self.proc.pid if not wrapper else None
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.pid is None:
                self.pid = _descendant_named(self.proc.pid, Path(args[0]).name)
            try:
                if self.get("/health", timeout=2)[0] == 200:
                    break
            except (OSError, RequestError):  # not listening yet, or 503 while the model loads
                pass
            if self.proc.poll() is not None:
                raise UserError(f"llama-server exited with {self.proc.returncode} while starting",
                                f"see {log_path}: {self.log_tail(3)}")
            if time.monotonic() > deadline:
                self.kill()
                raise UserError(f"llama-server did not answer /health within {startup_timeout:g} s", f"see {log_path}")
            time.sleep(0.3)
        if self.pid is None:
            self.pid = _descendant_named(self.proc.pid, Path(args[0]).name)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _call(self, method: str, path: str, body=None, timeout: float | None = None) -> tuple[int, dict | list]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.request_timeout) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            raise RequestError(f"HTTP {e.code} on {path}: {text[:300]}") from None

    def get(self, path: str, timeout: float | None = None):
        return self._call("GET", path, timeout=timeout)

    def post(self, path: str, body, timeout: float | None = None):
        return self._call("POST", path, body, timeout)

    def log_tail(self, n: int) -> str:
        self.log.flush()
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        return " | ".join(lines[-n:])

    def stop(self, timeout: float) -> int | None:
        """SIGINT to the server (a clean shutdown logs the cache's summary); its exit status, None if it hung."""
        if self.alive():
            try:
                os.kill(self.pid or self.proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = None
        self.log.close()
        return rc

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()


class RequestError(Exception):
    pass


def _descendant_named(root: int, name: str) -> int | None:
    """The pid of a process named `name` at or below `root` (the server a wrapper such as compute-sanitizer
    started, or the wrapper itself where it exec'ed the server)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            if Path(os.readlink(f"/proc/{pid}/exe")).name == name:
                return pid
        except OSError:
            pass
        todo += children.get(pid, [])
    return None


def sample_memory(pid: int | None, nvidia_smi: str | None) -> dict:
    """Host memory of `pid` from /proc (MiB) and, with nvidia-smi, its VRAM and the GPU's used memory."""
    s: dict = {"t": time.monotonic()}
    if pid is not None:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile"):
                    s[key] = int(value.split()[0]) / 1024
        except OSError:
            pass
    if nvidia_smi:
        # a process in another pid namespace than the driver's is not listed by its pid: None, and the check falls
        # back to the GPU's used memory
        mine = [float(row[1]) for row in _smi(nvidia_smi, "--query-compute-apps=pid,used_memory") or []
                if len(row) == 2 and row[0] == str(pid)]
        s["vram_mib"] = sum(mine) if mine else None
        used = _smi(nvidia_smi, "--query-gpu=memory.used")
        s["gpu_used_mib"] = sum(float(row[0]) for row in used) if used else None
    return s


def _smi(exe: str, query: str) -> list[list[str]] | None:
    try:
        out = subprocess.run([exe, query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [[c.strip() for c in line.split(",")] for line in out.stdout.strip().splitlines() if line.strip()]


# --- probes ---------------------------------------------------------------------------------------------

def probe_requests(n_vocab: int) -> list[dict]:
    """The fixed probe set: greedy, log-probabilities of the top tokens, no prompt cache, fixed token prompts."""
    out = []
    for i, (n, extra) in enumerate(PROBES):
        rng = random.Random(1000 + i)
        tokens = [rng.randrange(FIRST_TOKEN, n_vocab) for _ in range(n)]
        out.append({"prompt": tokens, "n_predict": PROBE_PREDICT, "temperature": 0.0, "n_probs": PROBE_PROBS,
                    "cache_prompt": False, "seed": 1, **extra})
    return out


def probe_bytes(reply: dict) -> str:
    """What must not change between rounds: the text and the log-probabilities, as the server wrote them."""
    return json.dumps({"content": reply.get("content"), "probs": reply.get("completion_probabilities")},
                      sort_keys=True)


def run_probe_round(server: Server, probes: list[dict], slots: int, lora_scale: float | None) -> list[str]:
    """Every slot erased, the adapter's global scale set (None: left alone), then each probe alone."""
    if lora_scale is not None:
        server.post("/lora-adapters", [{"id": 0, "scale": lora_scale}])
    for i in range(slots):
        server.post(f"/slots/{i}?action=erase", None)
    return [probe_bytes(server.post("/completion", p)[1]) for p in probes]


def round_differences(first: list[str], later: list[str]) -> list[str]:
    """One line per probe whose bytes differ from the first round's, saying where."""
    out = []
    for i, (a, b) in enumerate(zip(first, later, strict=True)):
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append(f"probe {i}: differs from the first round at character {at}: "
                       f"{a[max(0, at - 20):at + 40]!r} against {b[max(0, at - 20):at + 40]!r}")
    return out


# --- which probes must equal all on the GPU (docs/cache-paths.md) ----------------------------------------------

def cache_facts(log_text: str) -> dict:
    """The cache's line(s) from a server log: the largest graph that reads the banks of every cached layer (None
    when not said, a huge number when every layer is whole) and the scheduler's offload batch."""
    facts: dict = {"banks_up_to": None, "offload_min": None, "made": None, "summary": None}
    m = re.search(r"llama_moe: expert cache on \S+: ([0-9.]+) MiB.*", log_text)
    facts["made"] = m.group(0) if m else None
    if "every cached layer holds all its experts" in log_text:
        facts["banks_up_to"] = 1 << 62
    m = re.search(r"graphs of up to (\d+) tokens? read the banks of every cached layer", log_text)
    if m:
        facts["banks_up_to"] = int(m.group(1))
    m = re.search(r"compute their experts on the CPU below (\d+) tokens", log_text)
    if m:
        facts["offload_min"] = int(m.group(1))
    m = re.search(r"llama_moe: expert cache, decode: .*", log_text)
    facts["summary"] = m.group(0) if m else None
    return facts


def ubatch_sizes(n_prompt: int) -> list[int]:
    sizes = []
    while n_prompt > 0:
        sizes.append(min(N_UBATCH, n_prompt))
        n_prompt -= sizes[-1]
    return sizes


def all_gpu_guaranteed(n_prompt: int, banks_up_to: int | None, offload_min: int | None) -> tuple[bool, str]:
    """Whether a probe sent alone computes every graph with all-on-GPU bytes: each prompt ubatch reads the banks
    (at most `banks_up_to` tokens) or is staged on the GPU (at least the offload batch), and so does a decode step
    of one token."""
    if banks_up_to is None or offload_min is None:
        return False, "the server's log does not say which graphs read the banks"
    if banks_up_to < 1:
        return False, "a decode step of one token leaves the banks"
    for t in ubatch_sizes(n_prompt):
        if banks_up_to < t < offload_min:
            return False, f"a prompt ubatch of {t} tokens computes its experts on the CPU (staging or host path)"
    return True, f"prompt ubatches {ubatch_sizes(n_prompt)} and 1-token decode steps stay on the GPU"


# --- the soak -------------------------------------------------------------------------------------------

class Gate:
    """Lets clients start requests until the budget (count, time) is spent; a pause waits for those in flight."""

    def __init__(self, max_requests: int, deadline: float):
        self.cond = threading.Condition()
        self.max_requests, self.deadline = max_requests, deadline
        self.paused = self.stopping = False
        self.active = self.started = 0

    def enter(self) -> bool:
        with self.cond:
            while self.paused and not self.stopping:
                self.cond.wait()
            if self.stopping or self.started >= self.max_requests or time.monotonic() >= self.deadline:
                return False
            self.active += 1
            self.started += 1
            return True

    def leave(self) -> None:
        with self.cond:
            self.active -= 1
            self.cond.notify_all()

    def pause(self) -> None:
        with self.cond:
            self.paused = True
            while self.active:
                self.cond.wait()

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()


@dataclass
class Counters:
    served: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    prompt_tokens_computed: int = 0
    generated_tokens: int = 0
    lora_posts: int = 0
    per_request_lora: int = 0
    backend_sampling: int = 0
    greedy: int = 0
    max_latency_s: float = 0.0
    error_samples: list = field(default_factory=list)


class Soak:
    def __init__(self, config: SoakConfig, server: Server, n_vocab: int, log):
        self.c, self.server, self.n_vocab, self.say = config, server, n_vocab, log
        self.lock = threading.Lock()
        self.n = Counters()
        self.gate = Gate(config.max_requests, math.inf)  # the time budget starts with the clients

    def random_request(self, rng: random.Random, last: list[int] | None) -> dict:
        """A request with random settings; `last`: the client's previous prompt (None before its first)."""
        c = self.c

        def length(most: int) -> int:
            # log-uniform: many short prompts (decode-heavy, small ubatches) and some long ones
            return max(1, min(most, int(math.exp(rng.uniform(0, math.log(most + 1))))))

        def tokens(n: int) -> list[int]:
            return [rng.randrange(FIRST_TOKEN, self.n_vocab) for _ in range(n)]

        if last is None:  # a client's first prompt is the longest: the warm-up has seen the largest graphs
            prompt, cache_prompt = tokens(c.max_prompt), False
        elif len(last) < c.max_prompt and rng.random() < 0.2:
            # the previous prompt continued: a slot that kept it computes only the new tokens, small ubatches
            prompt, cache_prompt = last + tokens(length(c.max_prompt - len(last))), True
        else:
            prompt, cache_prompt = tokens(length(c.max_prompt)), rng.random() < 0.5
        body = {"prompt": prompt, "n_predict": rng.randint(1, c.max_predict), "seed": rng.randrange(1 << 31),
                "cache_prompt": cache_prompt}
        mode = rng.choice(("greedy", "sample", "backend") if c.backend_sampling else ("greedy", "sample"))
        if mode == "greedy":
            body["temperature"] = 0.0
        else:
            body.update(temperature=rng.choice((0.3, 0.8, 1.5)), top_k=rng.choice((0, 1, 5, 40)),
                        top_p=rng.choice((1.0, 0.9)), min_p=rng.choice((0.0, 0.05)))
        if mode == "backend":
            # the sampler chain on the device: set per slot, a new one reserves the context again
            body["backend_sampling"] = True
        elif rng.random() < 0.3:
            body["n_probs"] = 3
        if rng.random() < 0.3:
            body["lora"] = [{"id": 0, "scale": rng.choice(SOAK_LORA_SCALES)}]
        return body

    def client(self, index: int) -> None:
        rng = random.Random(self.c.seed * 1000 + index)
        last = None
        while self.gate.enter():
            try:
                if last is not None and rng.random() < 0.15:
                    self.server.post("/lora-adapters", [{"id": 0, "scale": rng.choice(SOAK_LORA_SCALES)}])
                    with self.lock:
                        self.n.lora_posts += 1
                body = self.random_request(rng, last)
                last = body["prompt"]
                t0 = time.monotonic()
                reply = self.server.post("/completion", body)[1]
                self._served(body, reply, time.monotonic() - t0)
            except Exception as e:  # every failure is counted: the soak's errors must be 0
                self._error(f"client {index}: {type(e).__name__}: {e}")
            finally:
                self.gate.leave()

    def _served(self, body: dict, reply: dict, seconds: float) -> None:
        n_prompt = len(body["prompt"])
        problems = []
        if not isinstance(reply.get("content"), str):
            problems.append("no content")
        if reply.get("tokens_evaluated") != n_prompt:
            problems.append(f"tokens_evaluated {reply.get('tokens_evaluated')} for a prompt of {n_prompt}")
        predicted = reply.get("tokens_predicted", -1)
        if not 0 <= predicted <= body["n_predict"]:
            problems.append(f"tokens_predicted {predicted} with n_predict {body['n_predict']}")
        if problems:
            self._error("reply: " + ", ".join(problems))
            return
        with self.lock:
            n = self.n
            n.served += 1
            n.prompt_tokens += n_prompt
            n.prompt_tokens_computed += int(reply.get("timings", {}).get("prompt_n", 0))
            n.generated_tokens += predicted
            n.per_request_lora += "lora" in body
            n.backend_sampling += bool(body.get("backend_sampling"))
            n.greedy += body.get("temperature") == 0.0
            n.max_latency_s = max(n.max_latency_s, seconds)

    def _error(self, message: str) -> None:
        with self.lock:
            self.n.errors += 1
            if len(self.n.error_samples) < 20:
                self.n.error_samples.append(message)
        self.say(f"error: {message}")


def run(c: SoakConfig) -> dict:
    """The soak; returns the summary (also written to out/summary.json), whose "ok" is the verdict."""
    check_config(c)
    c.out.mkdir(parents=True, exist_ok=True)
    n_vocab, expert_bytes = model_facts(c.model, c.ctx_per_slot)
    cache_mib = c.cache_mib or max(1, round(expert_bytes / 4 / 2**20))
    if c.lora is None:
        from pyllama_moe.synth.lora import write_lora

        c.lora = write_lora(c.out / "lora.gguf", c.model, seed=c.seed).path
    log_file = open(c.out / "soak.log", "w")
    t_start = time.monotonic()

    def say(message: str) -> None:
        line = f"[{time.monotonic() - t_start:7.1f} s] {message}"
        log_file.write(line + "\n")
        log_file.flush()
        print(line, file=sys.stderr, flush=True)

    slot_dir = c.out / "slots"  # erasing a slot needs --slot-save-path; nothing is saved there
    slot_dir.mkdir(exist_ok=True)
    common = [str(c.server), "-m", str(c.model), "-ngl", "99", "-np", str(c.slots), "-c", str(c.slots * c.ctx_per_slot),
              "-b", str(N_BATCH), "-ub", str(N_UBATCH), "-t", str(c.threads), "--fit", "off", "--lora", str(c.lora),
              # the prompt cache in host memory would grow the RSS by design: off, so growth means a leak
              "-cram", "0", "--slot-save-path", str(slot_dir), "--threads-http", str(c.clients + 4), "--no-webui",
              # libllama's info lines (the cache's, the reserves') are the server's trace level
              "-lv", "4"]
    cache_args = ["-cmoe", "--moe-cache-mib", str(cache_mib)]
    smi = shutil.which("nvidia-smi")
    summary: dict = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(c).items()},
                     "cache_mib": cache_mib, "expert_mib": round(expert_bytes / 2**20, 2)}
    probes = probe_requests(n_vocab)
    say(f"model {c.model.name}: {summary['expert_mib']} MiB of experts, cache {cache_mib} MiB; "
        f"{c.slots} slots, {c.clients} clients, {c.seconds:g} s or {c.max_requests} requests")
    server = Server(common + cache_args, c.wrapper, c.env, c.out / "server.log", c.startup_timeout, c.request_timeout)
    summary["server_cmd"] = shlex.join(server.cmd)
    samples: list[dict] = []
    rounds: list[dict] = []
    stop_sampling = threading.Event()
    soak = Soak(c, server, n_vocab, say)
    first: list[str] = []
    stopped_early = None
    try:
        adapters = server.get("/lora-adapters")[1]
        probe_scale = float(adapters[0]["scale"])
        first = run_probe_round(server, probes, c.slots, None)
        say(f"probe round 0: {len(probes)} probes taken at adapter scale {probe_scale:g}")

        def sampler() -> None:
            while not stop_sampling.wait(c.sample_every):
                samples.append({**sample_memory(server.pid, smi), "phase": "soak"})
                if not server.alive():
                    say(f"the server exited with {server.proc.returncode} during the soak")
                    soak.gate.stop()
                    return

        def probe_round(label: str) -> None:
            scale = probe_scale + 0.5 if c.plant_probe_change else probe_scale
            got = run_probe_round(server, probes, c.slots, scale)
            diffs = round_differences(first, got)
            sample = {**sample_memory(server.pid, smi), "phase": label}
            samples.append(sample)
            rounds.append({"label": label, "after_requests": soak.n.served, "identical": not diffs, "differences": diffs,
                           "memory": sample})
            say(f"probe round {len(rounds)} ({label}, {soak.n.served} served, {soak.n.errors} errors): "
                f"{'identical' if not diffs else f'{len(diffs)} differ'}; "
                f"RssAnon {sample.get('RssAnon', 0):.0f} MiB, VmRSS {sample.get('VmRSS', 0):.0f} MiB"
                + (f", VRAM {sample['vram_mib']:.0f} MiB" if sample.get("vram_mib") is not None else ""))
            for d in diffs:
                say("  " + d)

        samples.append({**sample_memory(server.pid, smi), "phase": "start"})
        threading.Thread(target=sampler, daemon=True).start()
        clients = [threading.Thread(target=soak.client, args=(i,), daemon=True) for i in range(c.clients)]
        soak.gate.deadline = time.monotonic() + c.seconds
        for t in clients:
            t.start()
        next_pause = time.monotonic() + c.pause_every
        while any(t.is_alive() for t in clients):
            time.sleep(0.2)
            if time.monotonic() >= next_pause and time.monotonic() < soak.gate.deadline and server.alive():
                soak.gate.pause()
                if server.alive():
                    probe_round("pause")
                soak.gate.resume()
                next_pause = time.monotonic() + c.pause_every
        for t in clients:
            t.join()
        stop_sampling.set()
        if server.alive():
            probe_round("end")
    except (KeyboardInterrupt, RequestError, OSError) as e:
        # a timeout's SIGTERM, a probe the server did not answer: the summary still says what happened until then
        stopped_early = f"{type(e).__name__}: {e}".rstrip(": ")
        say(f"stopped early: {stopped_early}")
        soak.gate.stop()
    finally:
        stop_sampling.set()
        alive_at_end = server.alive()
        rc = server.stop(120.0 if c.wrapper else 60.0)
    for sample in samples:
        sample["t"] = round(sample["t"] - t_start, 1)
    server_log = server.log_path.read_text(errors="replace")
    facts = cache_facts(server_log)
    n = soak.n
    summary["requests"] = {k: v for k, v in asdict(n).items()}
    summary["requests"]["reserves"] = server_log.count("sched_reserve: reserve took")
    summary["probe_rounds"] = rounds
    summary["cache"] = facts
    summary["server"] = {"alive_at_end": alive_at_end, "exit_code": rc,
                         "sanitizer": (re.findall(r"=+ ERROR SUMMARY: .*", server_log) or [None])[-1]}
    summary["memory"] = memory_check(c, samples)
    summary["stopped_early"] = stopped_early
    checks = {
        "completed": stopped_early is None,
        "errors": n.errors == 0,
        "served": n.served > 0,
        "alive_at_end": alive_at_end,
        "clean_exit": rc == 0,
        "probes_identical": bool(rounds) and all(r["identical"] for r in rounds),
        "memory_flat": summary["memory"]["flat"],
    }
    if c.compare_all_gpu and alive_at_end and stopped_early is None:
        summary["all_gpu"] = compare_all_gpu(c, common, probes, first, facts, say)
        checks["all_gpu_where_guaranteed"] = summary["all_gpu"]["ok"]
    summary["checks"] = checks
    summary["ok"] = all(v is not False for v in checks.values())
    (c.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    say(f"served {n.served} requests ({n.prompt_tokens} prompt tokens, {n.prompt_tokens_computed} computed, "
        f"{n.generated_tokens} generated), {n.errors} errors, {n.lora_posts} adapter scale changes, "
        f"{summary['requests']['reserves']} reserves; server {'alive' if alive_at_end else 'DEAD'} at the end, exit {rc}")
    say(f"memory: {summary['memory']['verdict']}")
    if facts["summary"]:
        say(facts["summary"])
    failed = [k for k, v in checks.items() if v is False]
    say("ok" if summary["ok"] else f"FAILED: {', '.join(failed)}")
    log_file.close()
    return summary


def memory_check(c: SoakConfig, samples: list[dict]) -> dict:
    """Growth after the first pause: anonymous RSS within max(rss_growth_mib, rss_growth_pct of the value at the
    pause), per-process VRAM within vram_growth_mib. Not checked under a wrapper (it owns the allocations) or
    when the soak ended before its first pause (flat is None: reported, not failed)."""
    out: dict = {"samples": samples, "flat": None}
    base_i = next((i for i, s in enumerate(samples) if s["phase"] == "pause"), None)
    if c.wrapper:
        out["verdict"] = "not checked under a wrapper"
        return out
    if base_i is None:
        out["verdict"] = "not checked: the soak ended before its first pause"
        return out
    base, later = samples[base_i], samples[base_i:]
    flat = True
    parts = []
    if "RssAnon" in base:
        growth = max(s.get("RssAnon", 0) for s in later) - base["RssAnon"]
        limit = max(c.rss_growth_mib, base["RssAnon"] * c.rss_growth_pct / 100)
        out.update(rss_anon_at_first_pause_mib=base["RssAnon"], rss_anon_growth_mib=growth, rss_limit_mib=limit)
        flat &= growth <= limit
        parts.append(f"RssAnon {base['RssAnon']:.0f} MiB at the first pause, +{growth:.1f} MiB after (limit {limit:.0f})")
    key = "vram_mib" if base.get("vram_mib") is not None else "gpu_used_mib"
    if base.get(key) is not None:
        growth = max(s.get(key) or 0 for s in later) - base[key]
        out.update(vram_measure=key, vram_at_first_pause_mib=base[key], vram_growth_mib=growth,
                   vram_limit_mib=c.vram_growth_mib)
        flat &= growth <= c.vram_growth_mib
        what = "VRAM of the server" if key == "vram_mib" else "GPU memory used"
        parts.append(f"{what} {base[key]:.0f} MiB at the first pause, +{growth:.0f} MiB after "
                     f"(limit {c.vram_growth_mib:g})")
    if not parts:
        out["verdict"] = "not checked: no memory could be read"
        return out
    out["flat"] = flat
    out["verdict"] = ("flat: " if flat else "GREW: ") + "; ".join(parts)
    return out


def compare_all_gpu(c: SoakConfig, common: list[str], probes: list[dict], first: list[str], facts: dict,
                    say) -> dict:
    """The probe set against a server with every weight on the GPU (no -cmoe, no cache): equality required only
    where every graph of the probe takes an all-on-GPU path (all_gpu_guaranteed), reported for the others."""
    try:
        server = Server(common, [], c.env, c.out / "server-all-gpu.log", c.startup_timeout, c.request_timeout)
    except UserError as e:
        say(f"all on the GPU: {e}")
        return {"probes": [], "error": str(e), "ok": False}
    try:
        got = run_probe_round(server, probes, c.slots, None)
    except (RequestError, OSError) as e:
        say(f"all on the GPU: {e}")
        return {"probes": [], "error": str(e), "ok": False}
    finally:
        rc = server.stop(60.0)
    rows = []
    for i, (p, a, b) in enumerate(zip(probes, first, got, strict=True)):
        guaranteed, why = all_gpu_guaranteed(len(p["prompt"]), facts["banks_up_to"], facts["offload_min"])
        rows.append({"probe": i, "prompt_tokens": len(p["prompt"]), "equal": a == b, "guaranteed": guaranteed,
                     "why": why})
        say(f"all on the GPU, probe {i} ({len(p['prompt'])} tokens): {'equal' if a == b else 'differs'}"
            f" ({'guaranteed' if guaranteed else 'not guaranteed'}: {why})")
    ok = all(r["equal"] for r in rows if r["guaranteed"]) and rc == 0
    return {"probes": rows, "exit_code": rc, "ok": ok}


# --- the verb -------------------------------------------------------------------------------------------

def _parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--env {item!r}", "use NAME=VALUE")
        env[key] = value
    return env


def cmd_server_soak(args) -> int:
    server = args.server
    if server.is_dir():
        server = server / "llama-server"
    config = SoakConfig(
        server=server, model=args.model, out=args.out, lora=args.lora, slots=args.slots, clients=args.clients,
        seconds=args.seconds, max_requests=args.max_requests, pause_every=args.pause_every,
        max_prompt=args.max_prompt, max_predict=args.max_predict, ctx_per_slot=args.ctx_per_slot,
        cache_mib=args.cache_mib, threads=args.threads, seed=args.seed, env=_parse_env(args.env),
        wrapper=shlex.split(args.wrapper) if args.wrapper else [], backend_sampling=not args.no_backend_sampling,
        compare_all_gpu=args.compare_all_gpu, rss_growth_mib=args.rss_growth_mib, rss_growth_pct=args.rss_growth_pct,
        vram_growth_mib=args.vram_growth_mib, startup_timeout=args.startup_timeout,
        request_timeout=args.request_timeout, plant_probe_change=args.plant_probe_change)
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        summary = run(config)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0 if summary["ok"] else 1


def _terminated(signum, frame):
    # a timeout's SIGTERM: unwind through run()'s finally, which stops the server
    raise KeyboardInterrupt


def register(sub) -> None:
    from pyllama_moe.arguments import SEED, count, input_file, output_dir, real_number, seconds, whole_number

    p = sub.add_parser("server-soak", help="llama-server with the expert cache under concurrent load: probes must not "
                                           "drift, errors 0, memory flat",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--server", type=Path, required=True, help="llama-server of the patched build, or its bin folder")
    p.add_argument("--model", type=input_file("model"), required=True,
                   help="a MoE GGUF (e.g. from `pyllama-moe synth`)")
    p.add_argument("--out", type=output_dir("output folder"), required=True,
                   help="folder for summary.json, soak.log and the server logs (made when missing)")
    p.add_argument("--lora", type=input_file("LoRA adapter"),
                   help="LoRA adapter GGUF (default: a synthetic one written to OUT/lora.gguf)")
    p.add_argument("--slots", type=count("a slot count"), default=4, help="server slots, -np (default 4)")
    p.add_argument("--clients", type=count("a client count"), default=6, help="client threads (default 6)")
    p.add_argument("--seconds", type=seconds(), default=180, help="soak time, pauses included (default 180)")
    p.add_argument("--max-requests", type=count("a request count"), default=2000,
                   help="at most this many requests (default 2000)")
    p.add_argument("--pause-every", type=seconds(), default=30, help="seconds between probe pauses (default 30)")
    p.add_argument("--max-prompt", type=count("a token count"), default=4000,
                   help="longest random prompt in tokens (default 4000)")
    p.add_argument("--max-predict", type=count("a token count"), default=32,
                   help="most tokens generated per request (default 32)")
    p.add_argument("--ctx-per-slot", type=count("a token count"), default=4096, help="context per slot (default 4096)")
    p.add_argument("--cache-mib", type=whole_number("a MiB count", 1, note="the soak is of the cache: it stays on"),
                   help="expert cache MiB (default: a quarter of the model's expert bytes)")
    p.add_argument("--threads", type=count("a thread count"), default=4, help="server CPU threads, -t (default 4)")
    p.add_argument("--seed", type=SEED, default=0, help="seed of the clients' requests (default 0)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment for the server (repeat); GGML_SIM_*, LLAMA_MOE_* and LLAMA_ARG_* are not inherited")
    p.add_argument("--wrapper", help="command the server runs under, e.g. 'compute-sanitizer --tool memcheck "
                                     "--error-exitcode 9' (memory is then not checked)")
    p.add_argument("--no-backend-sampling", action="store_true", help="no requests with backend_sampling")
    p.add_argument("--compare-all-gpu", action="store_true",
                   help="also send the probes to a server with every weight on the GPU (docs/cache-paths.md decides "
                        "which must be equal)")
    p.add_argument("--rss-growth-mib", type=real_number("a MiB count", 0), default=64,
                   help="anonymous RSS growth allowed after the first pause, at least (default 64)")
    p.add_argument("--rss-growth-pct", type=real_number("a percentage", 0), default=10,
                   help="... or this percentage of the value at the first pause, if larger (default 10)")
    p.add_argument("--vram-growth-mib", type=real_number("a MiB count", 0), default=64,
                   help="VRAM growth allowed after the first pause (default 64)")
    p.add_argument("--startup-timeout", type=seconds(), default=300,
                   help="seconds for the server to come up (default 300)")
    p.add_argument("--request-timeout", type=seconds(), default=600, help="seconds per request (default 600)")
    p.add_argument("--plant-probe-change", action="store_true",
                   help="negative control: later probe rounds run at another adapter scale, so they must differ")
    p.set_defaults(func=cmd_server_soak)
