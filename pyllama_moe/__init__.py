"""pyllama_moe: a maintained patch layer that makes llama.cpp fast for MoE models whose experts live in host
memory, plus the tooling that fetches the pinned source, builds it, binds the knobs and proves identity."""

__version__ = "0.1.0"
