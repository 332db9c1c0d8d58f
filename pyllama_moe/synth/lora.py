"""A synthetic LoRA adapter for a (synthetic) model, in llama.cpp's GGUF adapter format.

Its scale is chosen so that a change of adapter scale changes the greedy tokens while the model stays
token-dependent. The format and the statistics: docs/synthetic-models.md, "LoRA adapters".
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from pyllama_moe.errors import UserError
from pyllama_moe.synth.gguf_read import read_gguf
from pyllama_moe.synth.writer import replace_when_written

DEFAULT_TARGETS = ("attn_q", "attn_v")


@dataclass(frozen=True)
class LoraResult:
    path: Path
    arch: str
    n_pairs: int
    rank: int


def write_lora(path: str | os.PathLike, model: str | os.PathLike, *, rank: int = 8, strength: float = 0.5,
               seed: int = 0, targets: tuple[str, ...] = DEFAULT_TARGETS) -> LoraResult:
    """Write an adapter for every `blk.N.<target>.weight` of `model` to `path` (replaced atomically)."""
    if rank < 1:
        raise UserError(f"LoRA rank {rank}", "use 1 or more")
    if not 0.0 < strength <= 4.0:
        raise UserError(f"LoRA strength {strength}", "use a value in (0, 4], e.g. 0.5")
    path = Path(path)
    if not path.parent.is_dir():
        raise UserError(f"output directory {path.parent} does not exist", "create it first")
    info = read_gguf(model, check_data=False)
    n_layer = info.arch_key("block_count")
    if not info.arch or not isinstance(n_layer, int):
        raise UserError(f"{model} has no architecture or block count", "give a llama.cpp model GGUF")
    pairs = []
    for il in range(n_layer):
        for target in targets:
            t = info.tensors.get(f"blk.{il}.{target}.weight")
            if t is not None and len(t.shape) == 2:
                pairs.append((t.name, t.shape[0], t.shape[1]))
    if not pairs:
        raise UserError(f"{model} has none of the weights {', '.join(targets)} in its blocks",
                        "give a model with attention projections (qwen3moe, glm4moe, gpt-oss)")
    if rank > min(min(n_in, n_out) for _, n_in, n_out in pairs):
        raise UserError(f"LoRA rank {rank} is wider than a weight it adapts", "use a smaller rank")

    tmp = path.with_name(path.name + ".partial")
    w = GGUFWriter(tmp, info.arch)
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(rank))  # alpha / r = 1: the scale alone sets the strength
    w.add_name(f"pyllama-moe synthetic LoRA r{rank} x{strength:g} seed {seed}")
    for name, n_in, n_out in pairs:
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        # numpy shapes are the ggml shapes reversed
        a = rng.standard_normal((rank, n_in)).astype(np.float32) / np.float32(np.sqrt(n_in - 1))
        a[:, 0] = 0.0
        b = (rng.standard_normal((n_out, rank)) * (strength / np.sqrt(rank))).astype(np.float32)
        w.add_tensor(name + ".lora_a", a)
        w.add_tensor(name + ".lora_b", b)
    with replace_when_written(w, tmp, path):
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    return LoraResult(path, info.arch, len(pairs), rank)
