"""Worker mode "roundtrip": a text through llama.cpp's tokenizer and back (synth/probe.py starts it).

It reports whether llama_token_to_piece and llama_detokenize each give the input back, which the synthetic
vocabulary promises; only the vocabulary is loaded. Request and reply: docs/identity.md, "The worker process".
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from pyllama_moe.worker.model import loaded_model


def run(llama_cpp, req: dict, lib_dir: Path) -> dict:
    with open(req["text_file"], "rb") as f:
        raw = f.read()
    text = raw.decode("utf-8")
    with loaded_model(llama_cpp, req, lib_dir, vocab_only=True) as model:
        vocab = llama_cpp.llama_model_get_vocab(model)
        n_max = len(raw) + 16
        toks = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(vocab, raw, len(raw), toks, n_max, False, False)
        if n < 0:
            raise RuntimeError(f"llama_tokenize needs {-n} tokens, buffer had {n_max}")
        ids = list(toks[:n])
        joined = _pieces_text(llama_cpp, vocab, ids, text)
        cap = len(raw) * 2 + 64
        out = ctypes.create_string_buffer(cap)
        m = llama_cpp.llama_detokenize(vocab, toks, n, out, cap, False, False)
        detok = out.raw[:m].decode("utf-8", "replace") if m >= 0 else None
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        byte_tokens = sum(1 for t in ids
                          if llama_cpp.llama_vocab_get_attr(vocab, t) & llama_cpp.LLAMA_TOKEN_ATTR_BYTE)

    first_mismatch = next((i for i, (a, b) in enumerate(zip(text, joined)) if a != b), None)
    return {
        "n_chars": len(text), "n_tokens": n, "n_words": len(text.split()), "n_vocab": n_vocab,
        "byte_tokens": byte_tokens, "distinct_tokens": int(len(np.unique(np.array(ids, dtype=np.int64)))),
        "pieces_equal": joined == text, "detokenize_equal": detok == text,
        "first_mismatch": first_mismatch,
        "context": None if first_mismatch is None else [text[first_mismatch:first_mismatch + 60],
                                                         joined[first_mismatch:first_mismatch + 60]],
    }


def _pieces_text(llama_cpp, vocab, ids: list[int], text: str) -> str:
    """The tokens' pieces (llama_token_to_piece) joined into text."""
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
    return joined
