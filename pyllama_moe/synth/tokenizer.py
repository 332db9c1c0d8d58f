"""A deterministic SentencePiece-style ("llama") vocabulary of pronounceable pseudo-words.

The word set is prefix-closed, so llama.cpp's SPM merges turn every word after a space into exactly one token and
never merge across words. Why that follows: docs/synthetic-models.md, "The tokenizer".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SPACE = "\u2581"  # "▁", SentencePiece's visible space

# gguf token types (gguf.TokenType), spelled out so this module needs nothing but numpy
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6

SPECIALS = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
# Characters that get their own token (everything else falls back to bytes, e.g. "\n" -> <0x0A>).
CHARS = (
    [SPACE]
    + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    + [str(d) for d in range(10)]
    + list(".,;:!?'\"-()")
)
MIN_VOCAB = len(SPECIALS) + 256 + len(CHARS) + 128  # room for at least a handful of words

# Letter grammar for pronounceable words: consonants and vowels mostly alternate, with a few consonant
# clusters and vowel pairs. It is a left-to-right grammar, so every prefix of a word is itself a valid
# (pronounceable) word -- which is exactly what the prefix-closed vocabulary needs.
_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"
_CLUSTERS = {  # consonant -> consonants that may follow it
    "b": "lr", "c": "hklr", "d": "r", "f": "lr", "g": "lr", "k": "l", "l": "dkmpt", "m": "bp",
    "n": "dgkt", "p": "hlr", "r": "dkmnst", "s": "hklmnpt", "t": "hr", "w": "h",
}
_ONSET_CLUSTERS = {  # the clusters a word may start with
    "b": "lr", "c": "hlr", "d": "r", "f": "lr", "g": "lr", "p": "hlr", "s": "hklmnpt", "t": "hr", "w": "h",
}
_PAIRS = {"a": "iu", "e": "aei", "i": "ae", "o": "aiou", "u": "ei"}  # vowel -> vowels that may follow it


def _word(rng: np.random.Generator) -> str:
    out = [_CONSONANTS[int(rng.integers(18))] if rng.random() < 0.8 else _VOWELS[int(rng.integers(5))]]
    while len(out) < 13 and not (len(out) >= 2 and rng.random() < 0.1 + 0.07 * len(out)):
        prev, vowel = out[-1], out[-1] in _VOWELS
        pair_ok = len(out) < 2 or (out[-2] in _VOWELS) != vowel  # never three of a kind in a row
        follow = (_PAIRS if vowel else _ONSET_CLUSTERS if len(out) == 1 else _CLUSTERS).get(prev, "")
        if follow and pair_ok and rng.random() < 0.15:
            out.append(follow[int(rng.integers(len(follow)))])
        elif vowel:
            out.append(_CONSONANTS[int(rng.integers(18))])
        else:
            out.append(_VOWELS[int(rng.integers(5))])
    return "".join(out)


def _rank_cost(word: str) -> float:
    if not any(c in _VOWELS for c in word):
        return 20.0 + len(word)
    return {1: 1.5, 2: 0.3, 3: 0.0, 4: 0.4}.get(len(word), len(word) - 3.5)


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    n_words: int  # how many `▁word` tokens there are (they come last, most frequent first)

    def __len__(self) -> int:
        return len(self.tokens)


def build_vocab(n_vocab: int = 32000, seed: int = 0) -> Vocab:
    """Exactly `n_vocab` tokens, the same list for the same (n_vocab, seed)."""
    if n_vocab < MIN_VOCAB:
        raise ValueError(f"vocabulary of {n_vocab} tokens is too small, need at least {MIN_VOCAB}")
    fixed = list(SPECIALS) + [f"<0x{b:02X}>" for b in range(256)] + CHARS
    budget = n_vocab - len(fixed)

    rng = np.random.default_rng([seed, 0x70CAB])
    pieces: dict[str, None] = {}  # the words (after the "▁"), prefix-closed, in order of creation
    while len(pieces) < budget:
        w = _word(rng)
        for i in range(1, len(w) + 1):
            if w[:i] not in pieces and len(pieces) < budget:
                pieces[w[:i]] = None

    # Frequency rank, as in natural text: 2-4 letter words first, longer ones later (with noise so lengths
    # mix); vowel-less pieces ("b", "st") are kept for the prefix chains but ranked rarest.
    noise = rng.random(len(pieces)) * 2.5
    ordered = [w for _, w in sorted(zip((_rank_cost(w) + x for w, x in zip(pieces, noise)), pieces))]

    tokens = fixed + [SPACE + p for p in ordered]
    # Scores: Zipf log-frequencies for the word tokens; fixed tokens sit below every word so the bigram
    # queue always prefers building words (single characters are never a merge result anyway).
    floor = -math.log(len(ordered) + 2) - 1.0
    scores = [0.0] * len(SPECIALS) + [0.0] * 256 + [floor - 0.001 * i for i in range(len(CHARS))]
    scores += [-math.log(r + 2.0) for r in range(len(ordered))]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * (len(CHARS) + len(ordered))
    assert len(tokens) == n_vocab == len(scores) == len(types), (len(tokens), n_vocab)
    return Vocab(tokens=tokens, scores=scores, types=types, n_words=len(ordered))
