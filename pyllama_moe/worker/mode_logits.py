"""Worker mode "logits": the logits of every prompt position and greedy text (harness/runner.py starts it).

harness/runner.py builds the request from a RunSpec. Its fields (the model and its placement, context parameters,
several contexts or parallel sequences, callbacks, cache and prefetch settings) and the reply's are listed in
docs/identity.md, "The worker process".
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from pathlib import Path

import numpy as np

from pyllama_moe.worker import ggml_lib
from pyllama_moe.worker.batch import put_token
from pyllama_moe.worker.fault import ScaledExpert
from pyllama_moe.worker.model import loaded_model


def run(L, req: dict, lib_dir: Path) -> dict:
    if int(req.get("contexts") or 1) > 1:
        return _parallel_contexts(L, req, lib_dir)
    with loaded_model(L, req, lib_dir) as model:
        vocab = L.llama_model_get_vocab(model)
        n_vocab = L.llama_vocab_n_tokens(vocab)
        all_tokens = tokens = req.get("tokens") or _tokenize(L, vocab, req["prompt"])
        if req.get("max_prompt_tokens"):
            tokens = tokens[: int(req["max_prompt_tokens"])]
        n_gen = int(req.get("generate", 0))
        ppl_ctx, n_chunks = req.get("ppl_chunks") or (0, 0)
        cp = _context_params(L, req, max(len(tokens) + n_gen, int(ppl_ctx)))
        n_batch = cp.n_batch
        n_par = int(req.get("parallel") or 1)
        seq_lens = [int(n) for n in req.get("prompt_sequences") or []]
        if seq_lens and (sum(seq_lens) != len(tokens) or min(seq_lens) < 1 or len(tokens) > n_batch
                         or n_gen > 1 or n_par > 1 or ppl_ctx or req.get("warm_tokens")):
            raise RuntimeError("\"prompt_sequences\" cuts the prompt into sequences of at least 1 token, as many as "
                               f"it has ({len(tokens)}), decoded in one call of at most n_batch ({n_batch}) tokens; "
                               "it takes no generation past the prompt's argmax, \"parallel\", \"ppl_chunks\" or "
                               "\"warm_tokens\"")
        keep_cb = None
        watch = _LookupWatch(L, lib_dir, req["lookup_callback"]) if req.get("lookup_callback") else None
        if sum(bool(req.get(k)) for k in ("eval_callback", "lookup_callback", "sync_callback", "fault")) > 1:
            raise RuntimeError("a request takes one eval callback: \"eval_callback\", \"lookup_callback\", "
                               "\"sync_callback\" or \"fault\"")
        if n_par > 1 and (watch or req.get("warm_tokens")):
            raise RuntimeError("\"parallel\" decodes every sequence at once: it takes no \"lookup_callback\" or "
                               "\"warm_tokens\"")
        if req.get("eval_callback"):
            keep_cb = cp.cb_eval = _eval_callback(L, int(req["eval_callback"]))
            cp.cb_eval_user_data = None
        elif watch:
            keep_cb = cp.cb_eval = watch.callback
            cp.cb_eval_user_data = None
        fault = ScaledExpert(L, lib_dir, req["fault"]) if req.get("fault") else None
        if fault:
            keep_cb = cp.cb_eval = fault.callback
            cp.cb_eval_user_data = None
        ctx_of_sync: list = []
        if req.get("sync_callback"):
            keep_cb = cp.cb_eval = _sync_callback(L, lib_dir, req["sync_callback"], ctx_of_sync)
            cp.cb_eval_user_data = None
        if req.get("moe_cache_caps"):
            _set_cache_caps(lib_dir, req["moe_cache_caps"])
        if req.get("layer_major_fit_reserve"):
            _set_layer_major_fit_reserve(lib_dir, *req["layer_major_fit_reserve"])
        ctx = L.llama_init_from_model(model, cp)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        if req.get("layer_major_fit_reserve_later"):
            _set_layer_major_fit_reserve(lib_dir, *req["layer_major_fit_reserve_later"])
        ctx_of_sync.append(ctx)
        if req.get("chdir_after_context"):
            os.chdir(req["chdir_after_context"])
        moe = _MoeApi(lib_dir, ctx) if (req.get("stats") or req.get("prefetch") or req.get("moe_cache_mib") is not None
                                        or watch or req.get("prefetch_after_prompt")) else None
        if watch:
            watch.moe = moe
        batch = L.llama_batch_init(n_batch, 0, 1)
        reply: dict = {"n_tokens": len(tokens), "n_vocab": n_vocab}
        try:
            if req.get("prefetch"):
                moe.set_prefetch(req["prefetch"])
            if req.get("moe_cache_mib") is not None:
                moe.lib.llama_moe_set_moe_cache_mib(moe.ctx, int(req["moe_cache_mib"]))
            # tokens decoded one at a time and then forgotten (the KV memory cleared): state outside the KV memory,
            # such as an expert cache, is warm when the prompt comes
            for pos, tok in enumerate(req.get("warm_tokens") or []):
                _decode(L, ctx, batch, [int(tok)], pos, False, n_batch, n_vocab)
            if req.get("warm_tokens"):
                L.llama_memory_clear(L.llama_get_memory(ctx), True)
            if moe and req.get("stats"):
                moe.reset_stats()
            if seq_lens:
                logits = _decode_sequences(L, ctx, batch, tokens, seq_lens, n_vocab, bool(req.get("logits_out")))
            else:
                logits = _decode(L, ctx, batch, tokens, 0, bool(req.get("logits_out")), n_batch, n_vocab)
            if moe and req.get("stats"):
                reply["stats"] = {"prompt": moe.stats()}
                moe.reset_stats()
            if req.get("logits_out"):
                logits = np.ascontiguousarray(logits, dtype=np.float32)
                np.save(req["logits_out"], logits)
                reply["logits_sha256"] = hashlib.sha256(logits.tobytes()).hexdigest()
            if req.get("prefetch_after_prompt"):
                moe.set_prefetch(req["prefetch_after_prompt"])
            n_layer = L.llama_model_n_layer(model)
            before = moe.layer_paths(n_layer) if moe and req.get("stats") else None
            if n_par > 1:
                generated, digest = _parallel_steps(L, ctx, batch, tokens, logits[-1], n_gen, n_par, n_vocab)
            else:
                retry = _Retry(int(req.get("retry_failed_decode") or 0))
                steps: list | None = [] if req.get("decode_logits_out") else None
                generated, digest = _greedy(L, ctx, batch, logits[-1], len(tokens), n_gen, n_batch, n_vocab, watch,
                                            retry, req.get("forced_tokens"), steps)
                if req.get("retry_failed_decode"):
                    reply["decode_retries"] = retry.at
                if steps is not None:
                    np.save(req["decode_logits_out"], np.array(steps, dtype=np.float32).reshape(-1, n_vocab))
            reply["generated"], reply["decode_logits_sha256"] = generated, digest
            if n_chunks:
                np.save(req["ppl_logits_out"], _perplexity_chunks(L, ctx, batch, all_tokens, int(ppl_ctx),
                                                                  int(n_chunks), n_batch, n_vocab))
            if fault:
                if fault.error:
                    raise RuntimeError(f"the planted fault failed: {fault.error}")
                reply["fault_rows_scaled"] = fault.scaled
            if moe and req.get("stats"):
                reply["stats"]["generate"] = moe.stats()
                # the generation's own steps per cached layer: a graph of more tokens than LLAMA_MOE_CACHE_DECODE_MAX
                # counts in the prompt phase, so both phases are read and what the prompt counted is taken off
                after = moe.layer_paths(n_layer)
                reply["stats"]["decode_paths"] = {
                    str(il): {p: n - before[il][p] for p, n in steps.items()}
                    for il, steps in after.items() if sum(steps.values()) > sum(before[il].values())}
            if watch:
                reply["lookup_callback"] = {"lookups": watch.seen, "stopped_at_step": watch.stopped_at_step}
            reply["text"] = _detok(L, vocab, generated)
        finally:
            del keep_cb  # the context held a pointer to it until here
            L.llama_batch_free(batch)
            L.llama_free(ctx)
    return reply


def _parallel_contexts(L, req: dict, lib_dir: Path) -> dict:
    """N contexts on one model, each decoding the prompt and then generating greedily, all at once (one thread each:
    ctypes lets go of the GIL in llama_decode). What they share is the model's (weights, pinned ranges); each has its
    own KV memory and expert cache. Per context: "generated", "decode_logits_sha256", "stats" (the expert cache's
    counters). Only the tokens, the placement knobs, the context parameters (_context_params), "generate" and
"moe_cache_mib" apply."""
    import threading

    n_ctx_wanted = int(req["contexts"])
    with loaded_model(L, req, lib_dir) as model:
        tokens = req["tokens"]
        n_gen = int(req.get("generate", 0))
        cp = _context_params(L, req, len(tokens) + n_gen)
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        if req.get("moe_cache_caps"):
            _set_cache_caps(lib_dir, req["moe_cache_caps"])
        ctxs = [L.llama_init_from_model(model, cp) for _ in range(n_ctx_wanted)]
        try:
            if not all(ctxs):
                raise RuntimeError("llama.cpp could not create every context")
            apis = [_MoeApi(lib_dir, ctx) for ctx in ctxs]
            if req.get("moe_cache_mib") is not None:
                for api in apis:
                    api.lib.llama_moe_set_moe_cache_mib(api.ctx, int(req["moe_cache_mib"]))
            replies: list[dict | None] = [None] * n_ctx_wanted
            errors: list[BaseException] = []
            start = threading.Barrier(n_ctx_wanted, timeout=120)  # a thread that never came does not hang the rest

            def generate(i: int) -> None:
                batch = None
                try:
                    batch = L.llama_batch_init(cp.n_batch, 0, 1)
                    start.wait()  # every context starts its prompt at once
                    last = _decode(L, ctxs[i], batch, tokens, 0, False, cp.n_batch, n_vocab)[-1]
                    generated, digest = _greedy(L, ctxs[i], batch, last, len(tokens), n_gen, cp.n_batch, n_vocab)
                    replies[i] = {"generated": generated, "decode_logits_sha256": digest, "stats": apis[i].stats()}
                except BaseException as exc:  # noqa: BLE001  (re-raised in the main thread)
                    errors.append(exc)
                    start.abort()
                finally:
                    if batch is not None:
                        L.llama_batch_free(batch)

            threads = [threading.Thread(target=generate, args=(i,)) for i in range(n_ctx_wanted)]
            try:
                for t in threads:
                    t.start()
            except BaseException:
                start.abort()  # the started ones give up at the barrier
                raise
            finally:
                # every thread that runs is joined before its context is freed, whatever happens here
                for t in threads:
                    while t.is_alive():
                        t.join(timeout=1)
            if errors:
                raise errors[0]
        finally:
            for ctx in ctxs:
                if ctx:
                    L.llama_free(ctx)
    return {"n_tokens": len(tokens), "n_vocab": n_vocab, "contexts": replies}


def _context_params(L, req: dict, n_tokens: int):
    """The request's context parameters, for n_tokens of prompt and generation: "n_ctx" (default n_tokens + 16 for
    each sequence), "n_batch", "n_ubatch", "threads", "op_offload", "n_seq_max" (the sequences the context may hold;
    without "parallel" the requests decode sequence 0 alone), "parallel" (at least that many sequences, in one unified
    KV buffer: see _parallel_steps), "kv_unified" (one KV buffer for every sequence, so a call of several sequences
    is cut into ubatches in the prompt's order)."""
    cp = L.llama_context_default_params()
    n_par = int(req.get("parallel") or 1)
    n_seq_max = max(int(req.get("n_seq_max") or 1), n_par, len(req.get("prompt_sequences") or []))
    cp.n_seq_max = n_seq_max
    if n_par > 1 or req.get("kv_unified"):
        cp.kv_unified = True
    cp.n_ctx = int(req.get("n_ctx") or (n_tokens + 16) * n_seq_max)
    cp.n_batch = int(req.get("n_batch", 2048))
    cp.n_ubatch = int(req.get("n_ubatch", 512))
    cp.n_threads = cp.n_threads_batch = int(req.get("threads") or min(4, os.cpu_count() or 1))
    cp.no_perf = True
    cp.op_offload = bool(req.get("op_offload", True))
    return cp


class DecodeError(RuntimeError):
    def __init__(self, rc: int, what: str):
        super().__init__(f"{what} returned {rc}")
        self.rc = rc


class _Retry:
    """Generation steps that may fail with -3 and be decoded again: llama.cpp removed the failed step's positions
    (a refused expert-cache lookup fails its call so), so the same token at the same position is a new try."""

    def __init__(self, budget: int):
        self.left = budget
        self.at: list[int] = []

    def take(self, err: DecodeError, pos: int) -> bool:
        if err.rc != -3 or self.left <= 0:
            return False
        self.left -= 1
        self.at.append(pos)
        return True


def _greedy(L, ctx, batch, last, start_pos: int, n_gen: int, n_batch: int, n_vocab: int,
            watch=None, retry: _Retry | None = None, forced: list[int] | None = None,
            keep: list | None = None) -> tuple[list[int], str]:
    """n_gen tokens by argmax from the logits row `last`, the first at start_pos; returns them and the sha256 of the
    logits of every decode step, in order (the text alone misses a change that flips no argmax). With a
    _LookupWatch that stopped a step's graph, that token is forgotten and decoded again; a step that failed with -3
    is decoded again while `retry` allows. `forced`: the tokens to decode instead of the argmax (another run's
    generation, so that both see the same tokens); `keep`: a list that receives every step's logits row."""
    if forced is not None and len(forced) < n_gen:
        raise RuntimeError(f"\"forced_tokens\" holds {len(forced)} tokens, the generation {n_gen}")
    generated = []
    digest = hashlib.sha256()
    for step in range(n_gen):
        tok = int(forced[step]) if forced is not None else int(np.argmax(last))
        generated.append(tok)
        if step + 1 < n_gen:
            pos = start_pos + step
            while True:
                try:
                    last = _decode(L, ctx, batch, [tok], pos, False, n_batch, n_vocab)[-1]
                    break
                except DecodeError as err:
                    if retry is None or not retry.take(err, pos):
                        raise
            if watch and watch.take_stop(step):
                # the stopped graph's logits and KV entries are unfinished: forget the token, decode it again
                if not L.llama_memory_seq_rm(L.llama_get_memory(ctx), 0, pos, -1):
                    raise RuntimeError(f"the context's memory cannot forget position {pos} to decode it again")
                last = _decode(L, ctx, batch, [tok], pos, False, n_batch, n_vocab)[-1]
            digest.update(np.ascontiguousarray(last, dtype=np.float32).tobytes())
            if keep is not None:
                keep.append(np.array(last, dtype=np.float32))
    return generated, digest.hexdigest()


def _perplexity_chunks(L, ctx, batch, tokens: list[int], n_ctx: int, n_chunks: int, n_batch: int,
                       n_vocab: int) -> np.ndarray:
    """The logits llama-perplexity scores, evaluated here so that a run's eval callback (a planted fault) applies to
    them too: the first n_chunks chunks of n_ctx tokens, each from an empty memory, and of each the rows of its second
    half but the last (those whose next token is in the chunk). [n_chunks * (n_ctx / 2 - 1), n_vocab]."""
    if len(tokens) < n_ctx * n_chunks:
        raise RuntimeError(f"the prompt has {len(tokens)} tokens, {n_chunks} chunks of {n_ctx} need more")
    mem = L.llama_get_memory(ctx)
    rows = []
    for i in range(n_chunks):
        L.llama_memory_clear(mem, True)
        logits = _decode(L, ctx, batch, tokens[i * n_ctx: (i + 1) * n_ctx], 0, True, n_batch, n_vocab)
        rows.append(logits[n_ctx // 2: n_ctx - 1])
    return np.ascontiguousarray(np.concatenate(rows), dtype=np.float32)


def forced_token(s: int, step: int, n_vocab: int) -> int:
    """The token sequence s decodes at a parallel step: a fixed list per sequence, not the argmax, so that both builds
    decode the same tokens whatever their logits. Two of the first 12 sequences feed the same token at a step only in
    a vocabulary of at most 11 tokens or of a multiple of 7919 (a prime)."""
    return (1 + s * 7919 + step * 104729) % n_vocab


def _parallel_steps(L, ctx, batch, tokens: list[int], last, n_gen: int, n_par: int,
                    n_vocab: int) -> tuple[list[int], str]:
    """n_gen - 1 steps (as many as _greedy's) of n_par sequences, each step one llama_decode of n_par tokens, one per
    sequence, every one an output: a graph of n_par tokens, the batch llama-parallel decodes. The prompt was evaluated
    once for sequence 0; the other sequences are given its KV cells (llama_memory_seq_cp: in the unified KV buffer
    that tags the cells, copying nothing), so every sequence attends to the very bytes that one evaluation wrote and
    the prompt's graphs are those of a single sequence. Returns the argmax of the prompt's last row and then of every
    row, step by step in sequence order, and the sha256 of every step's logits in that order."""
    mem = L.llama_get_memory(ctx)
    for s in range(1, n_par):
        L.llama_memory_seq_cp(mem, 0, s, -1, -1)
    generated = [int(np.argmax(last))]
    digest = hashlib.sha256()
    for step in range(max(n_gen - 1, 0)):
        batch.n_tokens = n_par
        for s in range(n_par):
            put_token(batch, s, forced_token(s, step, n_vocab), len(tokens) + step, seq=s)
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise DecodeError(rc, f"llama_decode of {n_par} sequences")
        rows = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(n_par, n_vocab))
        digest.update(np.ascontiguousarray(rows, dtype=np.float32).tobytes())
        generated.extend(int(t) for t in rows.argmax(axis=1))
    return generated, digest.hexdigest()


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
            put_token(batch, i, tok, start_pos + off + i, output=want_logits or off + i == len(tokens) - 1)
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise DecodeError(rc, "llama_decode")
        n_out = len(chunk) if want_logits else (1 if off + len(chunk) == len(tokens) else 0)
        if n_out:
            ptr = L.llama_get_logits(ctx)
            rows.append(np.ctypeslib.as_array(ptr, shape=(n_out, n_vocab)).copy())
    return np.concatenate(rows, axis=0)


def _decode_sequences(L, ctx, batch, tokens: list[int], lengths: list[int], n_vocab: int, every_output: bool = True):
    """The prompt cut into consecutive sequences of these lengths (sequence i from position 0), all in one llama_decode,
    every token an output (else each sequence's last token alone, as a server's prompts are); the logits in the
    prompt's order. Without a unified KV buffer each sequence is a stream of its own, so llama.cpp splits the call
    into equal shares of every sequence left: a short sequence makes the first ubatch small and the later ones full."""
    batch.n_tokens = len(tokens)
    i = 0
    for seq, n in enumerate(lengths):
        for pos in range(n):
            put_token(batch, i, tokens[i], pos, seq=seq, output=every_output or pos == n - 1)
            i += 1
    rc = L.llama_decode(ctx, batch)
    if rc != 0:
        raise DecodeError(rc, "llama_decode")
    n_out = len(tokens) if every_output else len(lengths)
    return np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(n_out, n_vocab)).copy()


def _moe_lib(lib_dir: Path):
    """llama-moe.h of the build's libllama through cffi, for its process defaults."""
    from pyllama_moe.build.ffi import _ffi

    ffi, _ = _ffi()
    return ffi.dlopen(str(lib_dir / "libllama.so"))


def _set_cache_caps(lib_dir: Path, caps: dict) -> None:
    """Caps on the expert cache per device name, as --fit sets them before a context is made."""
    lib = _moe_lib(lib_dir)
    for device, mib in caps.items():
        lib.llama_moe_default_set_moe_cache_device_cap_mib(device.encode(), int(mib))


def _set_layer_major_fit_reserve(lib_dir: Path, device: str, mib: int) -> None:
    """The staging --fit kept free for layer groups on a device, as --fit notes it."""
    _moe_lib(lib_dir).llama_moe_default_set_layer_major_fit_reserve_mib(device.encode(), int(mib))


class _MoeApi:
    """llama-moe.h of the loaded libllama through cffi (the same library llama_cpp loaded), for one context."""

    def __init__(self, lib_dir: Path, ctx):
        from pyllama_moe.build.ffi import _ffi

        self.ffi, _ = _ffi()
        self.lib = self.ffi.dlopen(str(lib_dir / "libllama.so"))
        self.ctx = self.ffi.cast("struct llama_context *", ctypes.cast(ctx, ctypes.c_void_p).value)

    def set_prefetch(self, params: dict) -> None:
        p = self.ffi.new("struct llama_moe_prefetch_params *")
        # every field, -1 where not given
        fields = [key for key, _ in self.ffi.typeof("struct llama_moe_prefetch_params").fields]
        for key in fields:
            setattr(p, key, int(params.get(key, -1)))
        self.lib.llama_moe_set_prefetch_params(self.ctx, p[0])
        # the staging budget has a setter of its own (the by-value struct keeps its four fields)
        if "staging_mib" in params and "staging_mib" not in fields:
            self.lib.llama_moe_set_prefetch_staging_mib(self.ctx, int(params["staging_mib"]))

    def layer_paths(self, n_layer: int) -> dict[int, dict[str, int]]:
        """The steps of each cached layer by path since the cache was made, both phases summed (layers without a cache
        count none)."""
        from pyllama_moe.build.ffi import cache_path_steps

        if not hasattr(self.lib, "llama_moe_cache_get_path_steps"):
            return {}
        out = {}
        for il in range(n_layer):
            per_phase = [cache_path_steps(self.lib, self.ffi, self.ctx, phase, il) for phase in (0, 1)]
            out[il] = {p: per_phase[0][p] + per_phase[1][p] for p in per_phase[0]}
        return out

    def reset_stats(self) -> None:
        self.lib.llama_moe_reset_stats(self.ctx)

    def stats(self) -> dict:
        st = self.ffi.new("struct llama_moe_stats *")
        self.lib.llama_moe_get_stats(self.ctx, st)
        out = {name: int(getattr(st, name)) for name, _ in self.ffi.typeof("struct llama_moe_stats").fields}
        out["prefetch_devices"] = int(self.lib.llama_moe_prefetch_n_devices(self.ctx))
        out["prefetch_arena_bytes"] = int(self.lib.llama_moe_prefetch_arena_size(self.ctx))
        out["prefetch_depth"] = int(self.lib.llama_moe_get_prefetch_params(self.ctx).depth)  # the depth in use
        if hasattr(self.lib, "llama_moe_get_prefetch_staging_mib"):
            out["prefetch_staging_mib"] = int(self.lib.llama_moe_get_prefetch_staging_mib(self.ctx))
        if hasattr(self.lib, "llama_moe_cache_get_counters"):
            from pyllama_moe.build.ffi import cache_counters

            # the expert cache's counters since the context was created, summed over its layers, per phase
            for phase, name in ((0, "cache_prompt"), (1, "cache_decode")):
                out["cache_layers"], out[name] = cache_counters(self.lib, self.ffi, self.ctx, phase)
            out["cache_bytes"] = int(self.lib.llama_moe_cache_size(self.ctx))
        if hasattr(self.lib, "llama_moe_cache_get_path_steps"):
            from pyllama_moe.build.ffi import cache_path_steps

            # the steps of every cached layer in every graph, by the path each took
            out["cache_paths"] = {name: cache_path_steps(self.lib, self.ffi, self.ctx, phase)
                                  for phase, name in ((0, "prompt"), (1, "decode"))}
        return out


class _LookupWatch:
    """An eval callback on the expert cache's device lookups (GGML_OP_MOE_CACHE_LOOKUP nodes): with "stop_at": N it
    stops the graph right after the N-th lookup, before that layer's fills (the state a user's stopping callback
    leaves); with "read_counters" it reads the cache's counters at every lookup (a metrics reader while a graph runs).
    Either way what follows must compute what it would have without the callback."""

    def __init__(self, L, lib_dir: Path, spec: dict):
        self._op = ggml_lib.load(lib_dir / "libggml-base.so").ggml_op_desc
        self.stop_at = int(spec.get("stop_at") or 0)
        self.read_counters = bool(spec.get("read_counters"))
        self.moe = None  # the context's _MoeApi, set once the context exists
        self.seen = 0
        self.stopped = False
        self.stopped_at_step = None
        self.callback = L.ggml_backend_sched_eval_callback(self._on_tensor)

    def _on_tensor(self, t, ask, _user):
        is_lookup = self._op(t) == b"MOE_CACHE_LOOKUP"
        if ask or not is_lookup:
            return is_lookup if ask else True
        self.seen += 1
        if self.read_counters and self.moe is not None:
            self.moe.stats()
        if self.seen == self.stop_at:
            self.stopped = True
            return False
        return True

    def take_stop(self, step: int) -> bool:
        """Whether the last decode was stopped (once: the redo runs to the end)."""
        if not self.stopped:
            return False
        self.stopped, self.stopped_at_step = False, step
        return True


def _sync_callback(L, lib_dir: Path, name: str, ctx_holder: list):
    """An eval callback that calls llama_synchronize on the context when the tensor `name` was computed, as a
    debugger or a tensor dump does mid-graph: whatever the graph queues after that point must still be waited for by
    the context's later synchronizations. ctx_holder: the context, once it exists."""
    ggml = ggml_lib.load(lib_dir / "libggml-base.so")
    target = name.encode()

    def cb(tensor, ask, _user):
        if ggml.ggml_get_name(tensor) != target:
            return not ask  # nothing asked for; observed nodes go on
        if not ask and ctx_holder:
            L.llama_synchronize(ctx_holder[0])
        return True

    return L.ggml_backend_sched_eval_callback(cb)


def _eval_callback(L, every: int):
    """An eval callback that observes every `every`-th node: the scheduler then computes splits in chunks."""
    seen = [0]

    def cb(_tensor, ask, _user):
        if not ask:
            return True  # observed; go on
        seen[0] += 1
        return seen[0] % every == 0

    return L.ggml_backend_sched_eval_callback(cb)
