"""Run a GGUF with a chosen build: logits of every prompt position and greedy text.

Each run is a fresh worker process (pyllama_moe.worker, mode "logits") whose LLAMA_CPP_LIB_PATH points at the
build, so two builds never share a process and a crash in one is reported, not inherited.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pyllama_moe.build import ffi
from pyllama_moe.build.builder import Build
from pyllama_moe.errors import UserError
from pyllama_moe.source.sdist import Source
from pyllama_moe.worker import spawn


@dataclass
class RunSpec:
    model: Path
    tokens: list[int] | None = None
    prompt: str | None = None
    max_prompt_tokens: int | None = None  # truncate the tokenized prompt to this many tokens
    n_gpu_layers: int = 99
    cpu_moe: bool = False
    n_cpu_moe: int = 0
    load_mode: str = "mmap"
    repack: bool = True
    n_ubatch: int = 512
    n_batch: int = 2048
    threads: int | None = None
    generate: int = 0
    want_logits: bool = True
    env: dict[str, str] = field(default_factory=dict)
    eval_callback: int = 0  # observe every Nth node: the scheduler's chunked compute path (0: no callback)
    stats: bool = False     # report llama-moe.h stats of the prompt and of the generation (patched builds)
    prefetch: dict[str, int] | None = None  # per-context llama_moe_set_prefetch_params fields (patched builds)
    moe_cache_mib: int | None = None  # per-context llama_moe_set_moe_cache_mib (patched builds)
    op_offload: bool = True  # llama_context_params.op_offload (--no-op-offload: False)
    warm_tokens: list[int] | None = None  # decoded one at a time before the prompt, then the KV memory cleared
    # an eval callback on the expert cache's device lookups (patched builds): {"stop_at": N} stops the graph right
    # after the N-th lookup of the generation (that token is then decoded again), {"read_counters": True} reads the
    # cache's counters at every lookup; mode_logits.py
    lookup_callback: dict | None = None
    # an eval callback that calls llama_synchronize when the tensor of this name was computed (a debugger's
    # mid-graph synchronization); mode_logits.py
    sync_callback: str | None = None
    contexts: int = 1  # > 1: that many contexts on the model decode at once (RunResult.contexts; mode_logits.py)
    # expert cache caps per device name in MiB, as --fit sets them (llama_moe_default_set_moe_cache_device_cap_mib),
    # set before the context(s) are made (patched builds)
    moe_cache_caps: dict[str, int] | None = None
    # the staging --fit kept free for layer groups, (device name, MiB), as --fit notes it
    # (llama_moe_default_set_layer_major_fit_reserve_mib): set before the context is made, and "later" after it was
    # made and before its first decode, as a later fit (of another model) would (patched builds; -1 MiB unsets)
    layer_major_fit_reserve: tuple[str, int] | None = None
    layer_major_fit_reserve_later: tuple[str, int] | None = None
    # per-context prefetch fields set between the prompt and the generation (patched builds): the next decode
    # reserves a new scheduler, as llama-server's changes between requests (an adapter, a sampler) do
    prefetch_after_prompt: dict[str, int] | None = None
    # the worker's working directory from when its context is made (a relative path given to the cache names its
    # place at cache creation, not where the process is when the context is freed)
    chdir_after_context: str | None = None
    n_seq_max: int | None = None  # llama_context_params.n_seq_max (without `parallel` the runs decode sequence 0 alone)
    kv_unified: bool = False  # one KV buffer for every sequence: prompt_sequences cut into ubatches in the prompt's order
    # > 1: that many sequences decode together, each step one llama_decode of a token per sequence, teacher-forced
    # (RunResult.generated: the argmaxes, step by step in sequence order; mode_logits.py)
    parallel: int = 1
    # layers whose expert tensors stay on the CPU besides cpu_moe / n_cpu_moe's, as an -ot rule would place them (the
    # reference of a parallel step whose cached layers part read the banks and part left them; compare.py)
    cpu_moe_layers: list[int] | None = None
    # how many generation steps may fail with -3 (an expert-cache lookup refused: llama.cpp removed the step's
    # positions) and be decoded again; RunResult.decode_retries lists their positions (a planted refusal's test)
    retry_failed_decode: int = 0
    # the divergence harness (compare.py): decode these tokens instead of the argmax (teacher forcing), keep every
    # decode step's logits, plant a fault ({"layer", "expert", "eps"}: worker/fault.py), and evaluate the first n
    # chunks of n_ctx tokens of the prompt as llama-perplexity does ((n_ctx, n): RunResult.ppl_logits)
    forced_tokens: list[int] | None = None
    want_decode_logits: bool = False
    fault: dict | None = None
    ppl_chunks: tuple[int, int] | None = None
    # the prompt cut into sequences of these lengths, decoded in one call (no generation past the prompt's argmax):
    # llama.cpp then splits the call into ubatches of equal shares per sequence (mode_logits.py); every token an
    # output, or each sequence's last token alone where want_logits is False
    prompt_sequences: list[int] | None = None


@dataclass
class RunResult:
    logits: np.ndarray | None
    logits_sha256: str | None
    generated: list[int]
    text: str
    log: str
    stats: dict | None = None
    decode_logits_sha256: str | None = None  # the logits of every generated step after the first, in order
    lookup_callback: dict | None = None  # what the lookup callback saw: "lookups", "stopped_at_step"
    contexts: list[dict] | None = None  # with RunSpec.contexts > 1: per context "generated", "decode_logits_sha256", "stats"
    decode_retries: list[int] | None = None  # with RunSpec.retry_failed_decode: the positions decoded again
    moe_alerts: list[str] = field(default_factory=list)  # the patched build's `llama_moe:` warning and error lines
    decode_logits: np.ndarray | None = None  # with want_decode_logits: [generate - 1, n_vocab]
    ppl_logits: np.ndarray | None = None  # with ppl_chunks: the rows llama-perplexity scores, chunk after chunk
    fault_rows_scaled: int | None = None  # with fault: the expert rows it scaled over the whole run


def check_model(path: Path) -> Path:
    """A readable, whole GGUF file (header parsed, every tensor inside the file), else a UserError."""
    from pyllama_moe.synth.gguf_read import read_gguf

    read_gguf(path)
    return Path(path).resolve()


def worker_env(build: Build, src: Source, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a worker process on `build` with the sdist's llama_cpp package (spawn.worker_env)."""
    return spawn.worker_env(build.bin_dir, _llama_cpp_pkg(src), extra)


def _llama_cpp_pkg(src: Source) -> Path:
    if src.python_dir is None:
        raise UserError("the llama_cpp Python package comes from the sdist, but --llama-src was given",
                        "drop --llama-src or also pass --sdist")
    return src.python_dir


def run(build: Build, src: Source, spec: RunSpec) -> RunResult:
    ffi.check_stamp(build)  # the worker checks the embedded key after loading the library
    model = check_model(spec.model)
    with tempfile.TemporaryDirectory(prefix="pyllama-moe-run-") as tmp:
        logits_path = Path(tmp) / "logits.npy"
        req = {"expect_build": {"key": build.key, "variant": build.variant}, "model": str(model), "tokens": spec.tokens, "prompt": spec.prompt,
               "max_prompt_tokens": spec.max_prompt_tokens, "n_gpu_layers": spec.n_gpu_layers,
               "cpu_moe": spec.cpu_moe, "n_cpu_moe": spec.n_cpu_moe, "load_mode": spec.load_mode,
               "repack": spec.repack, "n_ubatch": spec.n_ubatch, "n_batch": spec.n_batch, "threads": spec.threads,
               "generate": spec.generate, "logits_out": str(logits_path) if spec.want_logits else None,
               "eval_callback": spec.eval_callback, "stats": spec.stats, "prefetch": spec.prefetch,
               "moe_cache_mib": spec.moe_cache_mib, "op_offload": spec.op_offload,
               "warm_tokens": spec.warm_tokens, "lookup_callback": spec.lookup_callback, "contexts": spec.contexts,
               "moe_cache_caps": spec.moe_cache_caps, "prefetch_after_prompt": spec.prefetch_after_prompt,
               "chdir_after_context": spec.chdir_after_context, "n_seq_max": spec.n_seq_max}
        # only where asked for, so that the requests of every other run stay as they were
        if spec.parallel > 1:
            req["parallel"] = spec.parallel
        if spec.cpu_moe_layers:
            req["cpu_moe_layers"] = list(spec.cpu_moe_layers)
        if spec.retry_failed_decode:
            req["retry_failed_decode"] = spec.retry_failed_decode
        if spec.sync_callback:
            req["sync_callback"] = spec.sync_callback
        if spec.prompt_sequences:
            req["prompt_sequences"] = list(spec.prompt_sequences)
        if spec.kv_unified:
            req["kv_unified"] = True
        for key in ("layer_major_fit_reserve", "layer_major_fit_reserve_later"):
            if getattr(spec, key) is not None:
                req[key] = list(getattr(spec, key))
        extra = _divergence_fields(spec, Path(tmp))
        req.update(extra)
        reply, log = spawn.run_worker("logits", req, lib_dir=build.bin_dir, llama_cpp_pkg=_llama_cpp_pkg(src),
                                      env=spec.env, who=f"{build.variant} build {build.key}")
        logits = np.load(logits_path) if spec.want_logits and spec.contexts <= 1 else None
        decode_logits = np.load(extra["decode_logits_out"]) if "decode_logits_out" in extra else None
        ppl_logits = np.load(extra["ppl_logits_out"]) if "ppl_logits_out" in extra else None
    return RunResult(logits, reply.get("logits_sha256"), reply.get("generated", []), reply.get("text", ""), log,
                     reply.get("stats"), reply.get("decode_logits_sha256"), reply.get("lookup_callback"),
                     reply.get("contexts"), reply.get("decode_retries"), reply.get("llama_moe_alerts", []),
                     decode_logits, ppl_logits, reply.get("fault_rows_scaled"))


def _divergence_fields(spec: RunSpec, tmp: Path) -> dict:
    """The request fields of the divergence harness, only where asked for (every other request stays as it was)."""
    req: dict = {}
    if spec.forced_tokens is not None:
        req["forced_tokens"] = [int(t) for t in spec.forced_tokens]
    if spec.want_decode_logits:
        req["decode_logits_out"] = str(tmp / "decode_logits.npy")
    if spec.fault:
        req["fault"] = dict(spec.fault)
    if spec.ppl_chunks:
        req["ppl_chunks"] = list(spec.ppl_chunks)
        req["ppl_logits_out"] = str(tmp / "ppl_logits.npy")
    return req
