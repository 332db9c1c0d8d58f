"""Synthetic text for perplexity runs: Zipf-distributed words from a model's own vocabulary, so that with the
synthetic tokenizer every word is one token and the requested size is met closely. See docs/synthetic-models.md,
"The corpus".
"""

from __future__ import annotations

import os

import numpy as np

from pyllama_moe.errors import UserError
from pyllama_moe.synth.gguf_read import GgufInfo, read_gguf

_MARKERS = {"llama": "\u2581", "gpt2": "\u0120"}  # tokenizer.ggml.model -> the token prefix meaning "space"
NORMAL = 1
MIN_WORDS = 50


def vocab_words(info: GgufInfo) -> list[str]:
    """The model's whole-word tokens (without the space marker), most frequent first."""
    model = info.kv.get("tokenizer.ggml.model")
    tokens = info.kv.get("tokenizer.ggml.tokens")
    if model not in _MARKERS or not isinstance(tokens, list):
        raise UserError(f"{info.path} has no SPM ('llama') or GPT-2 BPE vocabulary (tokenizer is {model!r})",
                        "give a model with a llama or gpt2 tokenizer")
    marker = _MARKERS[model]
    types = info.kv.get("tokenizer.ggml.token_type")
    scores = info.kv.get("tokenizer.ggml.scores")
    picked = []
    for i, tok in enumerate(tokens):
        if types is not None and int(types[i]) != NORMAL:
            continue
        word = tok[len(marker):]
        if tok.startswith(marker) and word.isalpha() and word.islower() and word.isascii():
            picked.append(i)
    if len(picked) < MIN_WORDS:
        raise UserError(f"{info.path} has only {len(picked)} whole-word tokens",
                        f"a corpus needs at least {MIN_WORDS}; use a model with a larger vocabulary")
    if model == "llama" and scores is not None:
        picked.sort(key=lambda i: -float(scores[i]))  # stable: ties keep id order
    return [tokens[i][len(marker):] for i in picked]


def generate_corpus(words: list[str], n_tokens: int = 20000, seed: int = 0) -> str:
    """About `n_tokens` tokens of text (counting each word, punctuation mark and newline as one token, and a
    line's first word, which has no leading space, as one token per letter)."""
    if n_tokens < 1:
        raise UserError(f"{n_tokens} tokens", "ask for at least 1")
    rng = np.random.default_rng([seed, 0xC0_4B05])
    ranks = np.arange(len(words), dtype=np.float64)
    p = 1.0 / (ranks + 2.7) ** 1.1
    cdf = np.cumsum(p / p.sum())
    cdf[-1] = 1.0

    paragraphs: list[str] = []
    count = 0
    while count < n_tokens:
        sentences = []
        for _ in range(int(rng.integers(2, 8))):
            n = int(rng.integers(4, 19))
            idx = np.searchsorted(cdf, rng.random(n), side="right")
            ws = [words[i] for i in idx]
            commas = rng.random(n - 1) < 0.08
            for j in np.nonzero(commas)[0]:
                ws[j] += ","
            end = rng.choice([".", "?", "!"], p=[0.9, 0.06, 0.04])
            sentences.append(" ".join(ws) + str(end))
            count += n + int(commas.sum()) + 1
            if count >= n_tokens:
                break
        first = sentences[0].split(" ", 1)[0]
        count += 1 + (len(first.rstrip(",.?!")) - 1 if paragraphs else 0)  # newline; letters of line start
        paragraphs.append(" ".join(sentences))
    return "\n".join(paragraphs) + "\n"


def corpus_from_model(model_path: str | os.PathLike, n_tokens: int = 20000, seed: int = 0) -> str:
    return generate_corpus(vocab_words(read_gguf(model_path, check_data=False)), n_tokens, seed)
