"""Runs one GGUF with one build, inside a process of its own (see runner.py, which starts it).

It is started with LLAMA_CPP_LIB_PATH pointing at the build's bin/ and the sdist's `llama_cpp` package on
sys.path, reads one JSON request on stdin and writes one JSON reply on stdout. Logits go to a .npy file.
Only llama_cpp's low-level ctypes API is used, so the placement knobs (`--cpu-moe`, `-ncmoe`, repack, load
mode) mean exactly what they mean to llama.cpp's own tools.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
from pathlib import Path

# Load the build's libllama (and so its libstdc++) before any other extension module: on the GPU machine an
# import that came first (numpy, in its Python environment) brought a libstdc++ that the CUDA build's C++ code
# then crashed against (segfault while printing model info), where preloading the system one fixed it.
if os.environ.get("LLAMA_CPP_LIB_PATH"):
    ctypes.CDLL(os.path.join(os.environ["LLAMA_CPP_LIB_PATH"], "libllama.so"), mode=ctypes.RTLD_GLOBAL)

import numpy as np  # noqa: E402

from pyllama_moe.buildinfo import embedded_mismatch, parse_build_info  # noqa: E402

# what common/common.h calls LLM_FFN_EXPS_REGEX: the expert tensors --cpu-moe and -ncmoe keep on the CPU
EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
LOAD_MODES = {"none": 0, "mmap": 1}


class _Override(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _cpu_overrides(req: dict, lib_dir: Path):
    """The tensor_buft_overrides array for the request's offload mode (NULL-pattern terminated)."""
    if req.get("cpu_moe"):
        patterns = [EXPS_REGEX]
    else:
        patterns = [rf"blk\.{i}{EXPS_REGEX}" for i in range(int(req.get("n_cpu_moe") or 0))]
    if not patterns:
        return None, []
    ggml_cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"))
    ggml_cpu.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
    buft = ggml_cpu.ggml_backend_cpu_buffer_type()
    keep = [p.encode() for p in patterns]
    arr = (_Override * (len(keep) + 1))()
    for i, pattern in enumerate(keep):
        arr[i].pattern, arr[i].buft = pattern, buft
    arr[len(keep)].pattern, arr[len(keep)].buft = None, None
    return arr, keep


def _detok(L, vocab, tokens: list[int]) -> str:
    out = bytearray()
    buf = ctypes.create_string_buffer(256)
    for tok in tokens:
        n = L.llama_token_to_piece(vocab, tok, buf, len(buf), 0, False)
        out += buf.raw[: max(n, 0)]
    return out.decode("utf-8", errors="replace")


def _tokenize(L, vocab, text: str) -> list[int]:
    data = text.encode()
    cap = len(data) + 16
    arr = (L.llama_token * cap)()
    n = L.llama_tokenize(vocab, data, len(data), arr, cap, True, False)
    if n < 0:
        raise RuntimeError(f"tokenization needs {-n} tokens")
    return list(arr[:n])


def _decode(L, ctx, batch, tokens: list[int], start_pos: int, want_logits: bool, n_batch: int, n_vocab: int):
    """Evaluate tokens from start_pos in chunks of n_batch; return all-position logits (or the last row)."""
    rows = []
    for off in range(0, len(tokens), n_batch):
        chunk = tokens[off: off + n_batch]
        batch.n_tokens = len(chunk)
        for i, tok in enumerate(chunk):
            batch.token[i] = tok
            batch.pos[i] = start_pos + off + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1 if (want_logits or off + i == len(tokens) - 1) else 0
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        n_out = len(chunk) if want_logits else (1 if off + len(chunk) == len(tokens) else 0)
        if n_out:
            ptr = L.llama_get_logits(ctx)
            rows.append(np.ctypeslib.as_array(ptr, shape=(n_out, n_vocab)).copy())
    return np.concatenate(rows, axis=0)


class _MoeApi:
    """llama-moe.h of the loaded libllama through cffi (the same library llama_cpp loaded), for one context."""

    def __init__(self, lib_dir: Path, ctx):
        from pyllama_moe.ffi import _ffi

        self.ffi, _ = _ffi()
        self.lib = self.ffi.dlopen(str(lib_dir / "libllama.so"))
        self.ctx = self.ffi.cast("struct llama_context *", ctypes.cast(ctx, ctypes.c_void_p).value)

    def set_prefetch(self, params: dict) -> None:
        p = self.ffi.new("struct llama_moe_prefetch_params *")
        for key in ("mode", "depth", "min_batch", "headroom_mib"):
            setattr(p, key, int(params.get(key, -1)))
        self.lib.llama_moe_set_prefetch_params(self.ctx, p[0])

    def reset_stats(self) -> None:
        self.lib.llama_moe_reset_stats(self.ctx)

    def stats(self) -> dict:
        st = self.ffi.new("struct llama_moe_stats *")
        self.lib.llama_moe_get_stats(self.ctx, st)
        out = {name: int(getattr(st, name)) for name, _ in self.ffi.typeof("struct llama_moe_stats").fields}
        out["prefetch_devices"] = int(self.lib.llama_moe_prefetch_n_devices(self.ctx))
        out["prefetch_arena_bytes"] = int(self.lib.llama_moe_prefetch_arena_size(self.ctx))
        return out


def _eval_callback(L, every: int):
    """An eval callback that observes every `every`-th node: the scheduler then computes splits in chunks."""
    seen = [0]

    def cb(_tensor, ask, _user):
        if not ask:
            return True  # observed; go on
        seen[0] += 1
        return seen[0] % every == 0

    return L.ggml_backend_sched_eval_callback(cb)


def _check_build(lib_dir: Path, expect: dict) -> None:
    """Refuse a library that is not the build the parent asked for (its embedded key; master has none)."""
    lib = ctypes.CDLL(str(lib_dir / "libllama.so"))
    fn = getattr(lib, "llama_moe_build_info", None)
    if fn is not None:
        fn.restype = ctypes.c_char_p
    info = parse_build_info(fn().decode()) if fn is not None else None
    why = embedded_mismatch(expect.get("variant"), expect.get("key"), info, lib_dir / "libllama.so")
    if why:
        raise RuntimeError(f"{why}; rebuild it")


def run(req: dict) -> dict:
    import llama_cpp as L

    lib_dir = Path(os.environ["LLAMA_CPP_LIB_PATH"])
    if req.get("expect_build"):
        _check_build(lib_dir, req["expect_build"])
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = int(req.get("n_gpu_layers", 99))
    mp.load_mode = LOAD_MODES[req.get("load_mode", "mmap")]
    mp.use_extra_bufts = bool(req.get("repack", True))
    overrides, _keep = _cpu_overrides(req, lib_dir)
    if overrides is not None:
        mp.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
    model = L.llama_model_load_from_file(req["model"].encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {req['model']}")
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    tokens = req.get("tokens") or _tokenize(L, vocab, req["prompt"])
    if req.get("max_prompt_tokens"):
        tokens = tokens[: int(req["max_prompt_tokens"])]
    n_gen = int(req.get("generate", 0))
    n_batch = int(req.get("n_batch", 2048))
    cp = L.llama_context_default_params()
    cp.n_ctx = int(req.get("n_ctx") or (len(tokens) + n_gen + 16))
    cp.n_batch = n_batch
    cp.n_ubatch = int(req.get("n_ubatch", 512))
    threads = int(req.get("threads") or min(4, os.cpu_count() or 1))
    cp.n_threads = cp.n_threads_batch = threads
    cp.no_perf = True
    keep_cb = None
    if req.get("eval_callback"):
        keep_cb = cp.cb_eval = _eval_callback(L, int(req["eval_callback"]))
        cp.cb_eval_user_data = None
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    moe = _MoeApi(lib_dir, ctx) if (req.get("stats") or req.get("prefetch")) else None
    if req.get("prefetch"):
        moe.set_prefetch(req["prefetch"])
    batch = L.llama_batch_init(n_batch, 0, 1)
    reply: dict = {"n_tokens": len(tokens), "n_vocab": n_vocab}
    try:
        if moe and req.get("stats"):
            moe.reset_stats()
        logits = _decode(L, ctx, batch, tokens, 0, bool(req.get("logits_out")), n_batch, n_vocab)
        if moe and req.get("stats"):
            reply["stats"] = {"prompt": moe.stats()}
            moe.reset_stats()
        if req.get("logits_out"):
            logits = np.ascontiguousarray(logits, dtype=np.float32)
            np.save(req["logits_out"], logits)
            reply["logits_sha256"] = hashlib.sha256(logits.tobytes()).hexdigest()
        generated = []
        last = logits[-1]
        for step in range(n_gen):
            tok = int(np.argmax(last))
            generated.append(tok)
            if step + 1 < n_gen:
                last = _decode(L, ctx, batch, [tok], len(tokens) + step, False, n_batch, n_vocab)[-1]
        reply["generated"] = generated
        if moe and req.get("stats"):
            reply["stats"]["generate"] = moe.stats()
        reply["text"] = _detok(L, vocab, generated)
    finally:
        del keep_cb  # the context held a pointer to it until here
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
    return reply


def main() -> int:
    req = json.loads(sys.stdin.read())
    try:
        reply = run(req)
    except Exception as exc:  # reported to the parent, which names the build and the model
        reply = {"error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
    return 0 if "error" not in reply else 1


if __name__ == "__main__":
    raise SystemExit(main())
