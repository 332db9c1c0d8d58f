"""Runs inside a child process: loads a model with the real llama.cpp (through llama-cpp-python's ctypes
bindings) and reports what it saw as JSON. Run as a script, never imported by the parent, so a crash, a hang or
a different libllama can never take the caller down with it.

    python probe_worker.py REQUEST.json      (the request names the file to write the JSON result to)

Modes:
  routes     decode one sequence of random tokens with logits for every position; capture each MoE layer's
             `ffn_moe_topk-<il>` (chosen experts) and `ffn_moe_logits-<il>` (router logits) tensors through
             the context's cb_eval callback; report per-layer expert counts, router logit statistics and
             whether the output logits are finite.
  roundtrip  tokenize a text file (no BOS), turn the tokens back into text with llama_token_to_piece and with
             llama_detokenize, and report both texts' equality with the input plus token statistics.

Only the standard library, numpy and llama_cpp are used here.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import sys
import time

LOG_TAIL: collections.deque[str] = collections.deque(maxlen=200)


class GgmlTensorHead(ctypes.Structure):
    """The leading fields of `struct ggml_tensor` (ggml.h); checked against ggml_nbytes on every read."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
    ]


def main() -> int:
    with open(sys.argv[1]) as f:
        req = json.load(f)
    sys.path.insert(0, req["pkg_parent"])
    os.environ["LLAMA_CPP_LIB_PATH"] = req["lib_dir"]
    import llama_cpp  # noqa: E402  (must come after the path/env set-up)

    @llama_cpp.llama_log_callback
    def log_cb(level, text, user_data):  # keep llama.cpp's chatter for the error report only
        LOG_TAIL.append(text.decode("utf-8", "replace"))

    llama_cpp.llama_log_set(log_cb, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    try:
        result = MODES[req["mode"]](llama_cpp, req)
    except Exception:
        sys.stderr.write("".join(LOG_TAIL)[-8000:])
        raise
    with open(req["out"], "w") as f:
        json.dump(result, f)
    return 0


def _load(llama_cpp, req, *, vocab_only: bool):
    mp = llama_cpp.llama_model_default_params()
    mp.n_gpu_layers = int(req.get("n_gpu_layers", 0))
    mp.vocab_only = vocab_only
    model = llama_cpp.llama_model_load_from_file(req["model"].encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {req['model']}")
    return model


def roundtrip(llama_cpp, req) -> dict:
    import numpy as np

    model = _load(llama_cpp, req, vocab_only=True)
    vocab = llama_cpp.llama_model_get_vocab(model)
    with open(req["text_file"], "rb") as f:
        raw = f.read()
    text = raw.decode("utf-8")
    n_max = len(raw) + 16
    toks = (llama_cpp.llama_token * n_max)()
    n = llama_cpp.llama_tokenize(vocab, raw, len(raw), toks, n_max, False, False)
    if n < 0:
        raise RuntimeError(f"llama_tokenize needs {-n} tokens, buffer had {n_max}")
    ids = list(toks[:n])

    buf = ctypes.create_string_buffer(256)
    pieces = []
    for t in ids:
        m = llama_cpp.llama_token_to_piece(vocab, t, buf, len(buf), 0, False)
        if m < 0:  # piece longer than the buffer: -m is the size it needs
            buf = ctypes.create_string_buffer(-m)
            m = llama_cpp.llama_token_to_piece(vocab, t, buf, len(buf), 0, False)
        pieces.append(buf.raw[:m])
    joined = b"".join(pieces).decode("utf-8", "replace")
    # SPM prepends a space to the text before tokenizing (add_space_prefix); drop it again, as llama.cpp's
    # own detokenizer does
    if joined.startswith(" ") and not text.startswith(" "):
        joined = joined[1:]
    cap = len(raw) * 2 + 64
    out = ctypes.create_string_buffer(cap)
    m = llama_cpp.llama_detokenize(vocab, toks, n, out, cap, False, False)
    detok = out.raw[:m].decode("utf-8", "replace") if m >= 0 else None

    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    arr = np.array(ids, dtype=np.int64)
    byte_tokens = sum(1 for t in ids if llama_cpp.llama_vocab_get_attr(vocab, t) & llama_cpp.LLAMA_TOKEN_ATTR_BYTE)
    first_mismatch = next((i for i, (a, b) in enumerate(zip(text, joined)) if a != b), None)
    llama_cpp.llama_model_free(model)
    return {
        "n_chars": len(text), "n_tokens": n, "n_words": len(text.split()), "n_vocab": n_vocab,
        "byte_tokens": byte_tokens, "distinct_tokens": int(len(np.unique(arr))),
        "pieces_equal": joined == text, "detokenize_equal": detok == text,
        "first_mismatch": first_mismatch,
        "context": None if first_mismatch is None else [text[first_mismatch:first_mismatch + 60],
                                                         joined[first_mismatch:first_mismatch + 60]],
    }


def routes(llama_cpp, req) -> dict:
    import numpy as np

    t0 = time.monotonic()
    model = _load(llama_cpp, req, vocab_only=False)
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    n_tokens = int(req["n_tokens"])
    threads = int(req.get("threads") or os.cpu_count() or 1)

    ggml = ctypes.CDLL(req["ggml_base"])
    ggml.ggml_get_name.restype = ctypes.c_char_p
    ggml.ggml_get_name.argtypes = [ctypes.c_void_p]
    ggml.ggml_nbytes.restype = ctypes.c_size_t
    ggml.ggml_nbytes.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_tensor_get.restype = None
    ggml.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]

    topk: dict[int, np.ndarray] = {}
    logits_stats: dict[int, dict] = {}
    stream: dict[int, dict] = {}
    first_inp: list[np.ndarray] = []
    errors: list[str] = []

    def read(t, dtype):
        """The tensor's values as an array [ne1, ne0] (following its strides: topk is a view)."""
        head = GgmlTensorHead.from_address(t)
        ne0, ne1 = head.ne[0], head.ne[1] * head.ne[2] * head.ne[3]
        size = ggml.ggml_nbytes(t)
        raw = (ctypes.c_uint8 * size)()
        ggml.ggml_backend_tensor_get(t, raw, 0, size)
        item = np.dtype(dtype).itemsize
        # the struct mirror must agree with ggml's own size computation, else the layout has changed
        if size != item + sum((head.ne[i] - 1) * head.nb[i] for i in range(4)):
            raise RuntimeError(f"struct ggml_tensor layout mismatch (ne={list(head.ne)}, nb={list(head.nb)}, "
                               f"ggml_nbytes={size})")
        if head.nb[0] != item or (head.ne[2] * head.ne[3] != 1):
            raise RuntimeError(f"unexpected layout ne={list(head.ne)} nb={list(head.nb)}")
        return np.lib.stride_tricks.as_strided(np.frombuffer(raw, dtype=dtype), shape=(ne1, ne0),
                                               strides=(head.nb[1], head.nb[0])).copy()

    @llama_cpp.ggml_backend_sched_eval_callback
    def cb_eval(t, ask, user_data):
        try:
            name = ggml.ggml_get_name(t).decode()
            want = name.startswith(("ffn_moe_topk-", "ffn_moe_logits-", "ffn_inp-"))
            if ask or not want:
                return want
            layer = int(name.rsplit("-", 1)[1])
            if name.startswith("ffn_moe_topk-"):
                topk[layer] = read(t, np.int32)
            elif name.startswith("ffn_inp-"):
                # the residual stream entering the FFN: how big it is, and how much of the first layer's
                # stream (mostly the token embedding) is still there
                x = read(t, np.float32)
                if not first_inp:
                    first_inp.append(x)
                x0 = first_inp[0]
                if x.shape == x0.shape:  # over the token-dependent coordinates (1..)
                    a, b = x[:, 1:], x0[:, 1:]
                    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-30)
                else:
                    cos = np.array([np.nan])
                stream[layer] = {"rms": float(np.sqrt((x.astype(np.float64) ** 2).mean())),
                                 "rms_rest": float(np.sqrt((x[:, 1:].astype(np.float64) ** 2).mean())),
                                 "coord0": float(x[:, 0].mean()), "cos_first": float(np.nanmean(cos))}
            else:
                lg = read(t, np.float32)  # [n_tokens, n_expert]
                logits_stats[layer] = {
                    # token-dependent spread: std over tokens, averaged over experts
                    "token_spread": float(lg.std(axis=0).mean()),
                    # per-expert offset shared by all tokens: spread of the experts' mean logits
                    "expert_bias_std": float(lg.mean(axis=0).std()),
                }
        except Exception as e:  # never let an exception cross into C: record it and stop the graph
            errors.append(f"{type(e).__name__}: {e}")
            return False
        return True

    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = max(n_tokens, 256)
    cp.n_batch = n_tokens
    cp.n_ubatch = n_tokens
    cp.n_seq_max = 1
    cp.n_threads = threads
    cp.n_threads_batch = threads
    cp.cb_eval = cb_eval
    cp.cb_eval_user_data = None
    ctx = llama_cpp.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError("llama_init_from_model failed")
    t_load = time.monotonic() - t0

    rng = np.random.default_rng(int(req.get("seed", 0)))
    # random ordinary tokens: skip the leading control/unknown ids (3 in SPM vocabs)
    lo = 3 if n_vocab > 3 else 0
    tokens = rng.integers(lo, n_vocab, size=n_tokens)
    batch = llama_cpp.llama_batch_init(n_tokens, 0, 1)
    batch.n_tokens = n_tokens
    for i, tok in enumerate(tokens):
        batch.token[i] = int(tok)
        batch.pos[i] = i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = 1
    t1 = time.monotonic()
    rc = llama_cpp.llama_decode(ctx, batch)
    t_decode = time.monotonic() - t1
    if errors:
        raise RuntimeError("cb_eval failed: " + "; ".join(errors[:3]))
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc}")
    out = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(n_tokens * n_vocab,))
    finite = bool(np.isfinite(out).all())
    logit_info = {"finite": finite, "min": float(np.nanmin(out)), "max": float(np.nanmax(out)),
                  "std": float(np.nanstd(out))}
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)

    layers = {}
    n_expert = int(req.get("n_expert") or 0)
    for il, sel in sorted(topk.items()):
        counts = np.bincount(sel.reshape(-1), minlength=n_expert)
        layers[str(il)] = {"counts": counts.tolist(), "k": int(sel.shape[1]), "tokens": int(sel.shape[0]),
                           **logits_stats.get(il, {}), "stream": stream.get(il)}
    return {"n_vocab": n_vocab, "n_tokens": n_tokens, "threads": threads, "layers": layers,
            "logits": logit_info, "seconds": {"load": t_load, "decode": t_decode}}


MODES = {"routes": routes, "roundtrip": roundtrip}

if __name__ == "__main__":
    sys.exit(main())
