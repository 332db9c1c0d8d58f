"""Write a synthetic model as GGUF, streaming: at most a few chunks of one tensor are in memory at a time.

The gguf package writes the header and directory; the tensor bytes follow, padded as GGUFWriter laid out their
offsets, generated on a thread pool and written in order. See docs/synthetic-models.md, "Writing".
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import ExpertGatingFuncType, GGUFWriter, LlamaFileType

from pyllama_moe.errors import UserError
from pyllama_moe.progress import Progress
from pyllama_moe.synth import tensors
from pyllama_moe.synth.quant import chunk
from pyllama_moe.synth.shapes import ModelShape
from pyllama_moe.synth.tokenizer import BOS_ID, EOS_ID, UNK_ID, build_vocab

QTYPES = {"q4_0": QT.Q4_0, "q8_0": QT.Q8_0}
FILE_TYPES = {QT.Q4_0: LlamaFileType.MOSTLY_Q4_0, QT.Q8_0: LlamaFileType.MOSTLY_Q8_0}


@dataclass(frozen=True)
class WriteResult:
    path: Path
    n_bytes: int
    n_tensors: int
    n_params: int
    seconds: float


def write_model(path: str | os.PathLike, shape: ModelShape, qtype: str = "q4_0", *, down_qtype: str | None = None,
                skew: float = 0.0, seed: int = 0, residual_scale: float = 0.1, threads: int | None = None,
                progress: bool = True, name: str | None = None) -> WriteResult:
    """Write a random-weight `shape` model to `path` (replaced atomically: a partial file never has the name)."""
    for what, name in (("weight type", qtype), ("down experts' type", down_qtype)):
        if name is not None and name not in QTYPES:
            raise UserError(f"unknown {what} {name!r}", f"use one of: {', '.join(QTYPES)}")
    if not (0.0 <= skew <= 10.0):
        raise UserError(f"skew {skew}", "use a value from 0 (uniform) to about 2 (very skewed)")
    if not (0.0 < residual_scale <= 1.0):
        raise UserError(f"residual scale {residual_scale}", "use a value in (0, 1], e.g. 0.1")
    path = Path(path)
    if path.is_dir():
        raise UserError(f"output {path} is a directory", "give a file name such as model.gguf")
    if not path.parent.exists():
        raise UserError(f"output directory {path.parent} does not exist", "create it first")
    qt = QTYPES[qtype]
    specs = tensors.plan(shape, qt, skew, seed, residual_scale, QTYPES[down_qtype] if down_qtype else None)
    vocab = build_vocab(shape.n_vocab, seed)

    tmp = path.with_name(path.name + ".partial")
    w = GGUFWriter(tmp, shape.arch)
    _metadata(w, shape, qt, skew, seed, residual_scale, name)
    w.add_tokenizer_model("llama")
    w.add_token_list(vocab.tokens)
    w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    for spec in specs:
        # dtype float32 only says "these are elements, not raw bytes": raw_dtype is the real type
        w.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32), spec.nbytes, raw_dtype=spec.qtype)

    total = sum(s.nbytes for s in specs)
    bar = Progress(f"synth {path.name}", total, "B", enabled=progress)
    with replace_when_written(w, tmp, path):
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        fout = w.fout[0]
        align = w.data_alignment
        _pad(fout, align)
        n_threads = threads or min(8, os.cpu_count() or 1)
        with ThreadPoolExecutor(n_threads) as pool:
            for spec in specs:
                start = fout.tell()
                for data in _ordered(pool, spec, seed, window=2 * n_threads):
                    fout.write(memoryview(data))
                    bar.update(step=data.nbytes)
                if fout.tell() - start != spec.nbytes:
                    raise AssertionError(f"{spec.name}: wrote {fout.tell() - start} bytes, expected {spec.nbytes}")
                _pad(fout, align)
    seconds = bar.finish()
    return WriteResult(path, path.stat().st_size, len(specs), shape.n_params(), seconds)


@contextmanager
def replace_when_written(w: GGUFWriter, tmp: Path, path: Path):
    """Closes `w` (writing to `tmp`) and renames `tmp` to `path` when the block ends; on any error the partial
    file goes instead, so `path` never names a half-written file."""
    try:
        yield
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise


def _ordered(pool: ThreadPoolExecutor, spec, seed: int, window: int):
    """The tensor's chunks in order, computed up to `window` ahead on the pool."""
    pending = []
    nxt = 0
    while nxt < spec.n_chunks or pending:
        while nxt < spec.n_chunks and len(pending) < window:
            pending.append(pool.submit(chunk, spec, seed, nxt))
            nxt += 1
        yield pending.pop(0).result()


def _pad(fout, align: int) -> None:
    pad = -fout.tell() % align
    if pad:
        fout.write(b"\0" * pad)


def _metadata(w: GGUFWriter, s: ModelShape, qt: QT, skew: float, seed: int, residual_scale: float,
              name: str | None) -> None:
    w.add_name(name or f"pyllama-moe synthetic {s.arch} {s.n_layer}L {s.n_expert}x{s.n_expert_used}")
    w.add_file_type(FILE_TYPES[qt])
    w.add_quantization_version(2)
    w.add_context_length(s.n_ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_rope_freq_base(s.rope_base)
    # GLM-4.5 rotates half of each head (partial_rotary_factor 0.5); Qwen3 rotates all of it
    w.add_rope_dimension_count(s.head_dim // 2 if s.arch == "glm4moe" else s.head_dim)
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_expert_used)
    w.add_expert_feed_forward_length(s.expert_ff)
    if s.arch == "gpt-oss":
        # every other layer from layer 0 slides (llama.cpp's default pattern for gpt-oss, so none is written);
        # the expert gating (softmax over the chosen experts' logits) and the activation are fixed by the arch
        w.add_sliding_window(s.n_swa)
    if s.arch == "glm4moe":
        w.add_expert_shared_count(s.n_shared)
        w.add_leading_dense_block_count(s.n_dense_lead)
        w.add_expert_weights_scale(1.0)
        w.add_expert_weights_norm(True)
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    # provenance, ignored by llama.cpp
    w.add_uint32("pyllama_moe.synth.seed", seed & 0xFFFFFFFF)
    w.add_float32("pyllama_moe.synth.skew", skew)
    w.add_float32("pyllama_moe.synth.residual_scale", residual_scale)
