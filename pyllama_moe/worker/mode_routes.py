"""Worker mode "routes": which experts each MoE layer chooses for random tokens (synth/routes.py starts it).

It captures each MoE layer's chosen experts, router logits and residual stream through the context's cb_eval
callback. Request and reply: docs/identity.md, "The worker process".
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import numpy as np

from pyllama_moe.worker import ggml_lib
from pyllama_moe.worker.batch import put_token
from pyllama_moe.worker.model import loaded_model


def run(llama_cpp, req: dict, lib_dir: Path) -> dict:
    t0 = time.monotonic()
    with loaded_model(llama_cpp, req, lib_dir) as model:
        vocab = llama_cpp.llama_model_get_vocab(model)
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        n_tokens = int(req["n_tokens"])
        threads = int(req.get("threads") or os.cpu_count() or 1)
        capture = _Capture(ggml_lib.load(req["ggml_base"]))
        cb_eval = llama_cpp.ggml_backend_sched_eval_callback(capture.on_tensor)

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
        try:
            batch.n_tokens = n_tokens
            for i, tok in enumerate(tokens):
                put_token(batch, i, int(tok), i)
            t1 = time.monotonic()
            rc = llama_cpp.llama_decode(ctx, batch)
            t_decode = time.monotonic() - t1
            if capture.errors:
                raise RuntimeError("cb_eval failed: " + "; ".join(capture.errors[:3]))
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            out = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(n_tokens * n_vocab,))
            logit_info = {"finite": bool(np.isfinite(out).all()), "min": float(np.nanmin(out)),
                          "max": float(np.nanmax(out)), "std": float(np.nanstd(out))}
        finally:
            llama_cpp.llama_batch_free(batch)
            llama_cpp.llama_free(ctx)

    layers = {}
    n_expert = int(req.get("n_expert") or 0)
    for il, sel in sorted(capture.topk.items()):
        counts = np.bincount(sel.reshape(-1), minlength=n_expert)
        layers[str(il)] = {"counts": counts.tolist(), "k": int(sel.shape[1]), "tokens": int(sel.shape[0]),
                           **capture.logits_stats.get(il, {}), "stream": capture.stream.get(il)}
    return {"n_vocab": n_vocab, "n_tokens": n_tokens, "threads": threads, "layers": layers,
            "logits": logit_info, "seconds": {"load": t_load, "decode": t_decode}}


class _Capture:
    """What cb_eval saw, per layer: chosen experts, router logit statistics, residual stream statistics."""

    def __init__(self, ggml: ctypes.CDLL):
        self.ggml = ggml
        self.topk: dict[int, np.ndarray] = {}
        self.logits_stats: dict[int, dict] = {}
        self.stream: dict[int, dict] = {}
        self.first_inp: list[np.ndarray] = []
        self.errors: list[str] = []

    def read(self, t, dtype) -> np.ndarray:
        """The tensor's values as an array [ne1, ne0] (following its strides: topk is a view)."""
        head = ggml_lib.GgmlTensor.from_address(t)
        if head.nb[0] != np.dtype(dtype).itemsize or (head.ne[2] * head.ne[3] != 1):
            raise RuntimeError(f"unexpected layout ne={list(head.ne)} nb={list(head.nb)}")
        return ggml_lib.read(self.ggml, t, dtype, 2)

    def on_tensor(self, t, ask, _user_data) -> bool:
        try:
            name = self.ggml.ggml_get_name(t).decode()
            want = name.startswith(("ffn_moe_topk-", "ffn_moe_logits-", "ffn_inp-"))
            if ask or not want:
                return want
            layer = int(name.rsplit("-", 1)[1])
            if name.startswith("ffn_moe_topk-"):
                self.topk[layer] = self.read(t, np.int32)
            elif name.startswith("ffn_inp-"):
                self.stream[layer] = self._stream_stats(self.read(t, np.float32))
            else:
                lg = self.read(t, np.float32)  # [n_tokens, n_expert]
                self.logits_stats[layer] = {
                    # token-dependent spread: std over tokens, averaged over experts
                    "token_spread": float(lg.std(axis=0).mean()),
                    # per-expert offset shared by all tokens: spread of the experts' mean logits
                    "expert_bias_std": float(lg.mean(axis=0).std()),
                }
        except Exception as e:  # never let an exception cross into C: record it and stop the graph
            self.errors.append(f"{type(e).__name__}: {e}")
            return False
        return True

    def _stream_stats(self, x: np.ndarray) -> dict:
        """The residual stream entering the FFN: how big it is, and how much of the first layer's stream (mostly
        the token embedding) is still there."""
        if not self.first_inp:
            self.first_inp.append(x)
        x0 = self.first_inp[0]
        if x.shape == x0.shape:  # over the token-dependent coordinates (1..)
            a, b = x[:, 1:], x0[:, 1:]
            cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-30)
        else:
            cos = np.array([np.nan])
        return {"rms": float(np.sqrt((x.astype(np.float64) ** 2).mean())),
                "rms_rest": float(np.sqrt((x[:, 1:].astype(np.float64) ** 2).mean())),
                "coord0": float(x[:, 0].mean()), "cos_first": float(np.nanmean(cos))}
