"""Synthetic Mixture-of-Experts models for benchmarking llama.cpp without real weights.

    shapes     presets (tiny, small, qwen3-30b-a3b, glm-4.5-air, gpt-oss-tiny, gpt-oss-20b) and overrides
               -> ModelShape (qwen3moe, glm4moe, gpt-oss: per-expert biases, attention sinks, sliding window)
    tokenizer  a deterministic SPM ("llama") vocabulary of pronounceable, prefix-closed pseudo-words
    quant      random Q4_0/Q8_0/F16/F32 tensors generated directly in their on-disk encoding
    tensors    the tensor list per architecture and the weight statistics that keep routing realistic
    writer     streams a model to GGUF (gguf package for header/metadata, raw chunks for the data)
    corpus     Zipf-distributed text in a model's vocabulary
    routes     per-layer expert-routing histogram measured with the real llama.cpp (child process:
               probe.py runs pyllama_moe.worker's "routes" mode)

The `synth`, `corpus` and `routes` verbs live in pyllama_moe/cli/synth.py.
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
