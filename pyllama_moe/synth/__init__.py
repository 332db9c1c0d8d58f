"""Synthetic Mixture-of-Experts models, so that llama.cpp can be benchmarked and checked without real weights.

What each module does, and why the weights look as they do: docs/synthetic-models.md. The `synth`, `corpus` and
`routes` verbs live in pyllama_moe/cli/synth.py.
"""

from pyllama_moe.synth.corpus import corpus_from_model, generate_corpus, vocab_words
from pyllama_moe.synth.gguf_read import read_gguf
from pyllama_moe.synth.routes import format_table, route_histogram
from pyllama_moe.synth.shapes import ARCHS, PRESETS, ModelShape, resolve_shape
from pyllama_moe.synth.tokenizer import build_vocab
from pyllama_moe.synth.writer import QTYPES, write_model

__all__ = [
    "ARCHS", "PRESETS", "QTYPES", "ModelShape", "build_vocab", "corpus_from_model", "format_table",
    "generate_corpus", "read_gguf", "resolve_shape", "route_histogram", "vocab_words", "write_model",
]
