"""Random tensors generated directly in their on-disk GGUF encoding, a slice of rows at a time: quantizing float
weights would cost far more than writing them.

Block scales get a random sign (the codes are lopsided), and each chunk is seeded from (seed, tensor name, chunk)
alone so that the bytes do not depend on threads or order. See docs/synthetic-models.md, "Quantized tensors".
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as QT

BLOCK = 32
BLOCK_BYTES = {QT.Q4_0: 18, QT.Q8_0: 34}
ELEM_BYTES = {QT.F32: 4, QT.F16: 2}
# RMS of the stored code (uniform over its range): weight std = |d| * CODE_RMS * sqrt(E[jitter^2])
CODE_RMS = {QT.Q4_0: math.sqrt(344 / 16), QT.Q8_0: math.sqrt(5461.5)}
JITTER_RMS = math.sqrt(1 + 0.25**2 / 3)  # jitter uniform in [0.75, 1.25)
CHUNK_BYTES = 8 << 20

F16_MIN_NORMAL = 2.0**-14


def row_bytes(qtype: QT, row_len: int) -> int:
    if qtype in BLOCK_BYTES:
        if row_len % BLOCK:
            raise ValueError(f"row of {row_len} values is not a whole number of {BLOCK}-value blocks")
        return row_len // BLOCK * BLOCK_BYTES[qtype]
    return row_len * ELEM_BYTES[qtype]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the model and how to fill it.

    `shape` is numpy order (outermost first, the contiguous row last), i.e. llama.cpp's ne reversed.
    """

    name: str
    shape: tuple[int, ...]
    qtype: QT
    std: float = 0.0  # random weights with this standard deviation...
    # ...or exactly these values, made when written (small float tensors: norms, routers, biases)
    values: Callable[[], np.ndarray] | None = None
    in0: float | None = None  # force element 0 of every row to this value (None: leave it random)
    zero_out0: bool = False  # make row 0 of every matrix all zeros

    @property
    def row_len(self) -> int:
        return self.shape[-1]

    @property
    def n_rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def rows_per_matrix(self) -> int:
        return self.shape[-2] if len(self.shape) >= 2 else 1

    @property
    def nbytes(self) -> int:
        return self.n_rows * row_bytes(self.qtype, self.row_len)

    @property
    def rows_per_chunk(self) -> int:
        if self.values is not None:
            return self.n_rows  # explicit values are made in one piece
        return max(1, CHUNK_BYTES // row_bytes(self.qtype, self.row_len))

    @property
    def n_chunks(self) -> int:
        return -(-self.n_rows // self.rows_per_chunk)


def chunk(spec: TensorSpec, seed: int, index: int) -> np.ndarray:
    """Bytes of rows [index*rows_per_chunk, ...) of the tensor, as a flat uint8 array."""
    if not 0 <= index < spec.n_chunks:
        raise IndexError(f"{spec.name} has {spec.n_chunks} chunks, not {index + 1}")
    r0 = index * spec.rows_per_chunk
    n = min(spec.rows_per_chunk, spec.n_rows - r0)
    if spec.values is not None:
        vals = np.ascontiguousarray(spec.values(), dtype=np.float32 if spec.qtype == QT.F32 else np.float16)
        if vals.size != spec.n_rows * spec.row_len:
            raise ValueError(f"{spec.name}: {vals.size} values for shape {spec.shape}")
        return vals.reshape(-1).view(np.uint8)
    bits = np.random.SFC64(np.random.SeedSequence([seed, zlib.crc32(spec.name.encode()), index]))
    if spec.qtype in BLOCK_BYTES:
        out = _random_blocks(bits, spec.qtype, n * spec.row_len // BLOCK, spec.std)
        bpr = spec.row_len // BLOCK
        if spec.in0 is not None:
            if spec.in0 != 0.0:
                raise ValueError("quantized tensors can only pin element 0 to zero")
            first = out[::bpr, 2]  # byte 0 of block 0 of each row: element 0 is its low nibble / the int8
            out[::bpr, 2] = (first & 0xF0) | 0x08 if spec.qtype == QT.Q4_0 else 0
        if spec.zero_out0:
            rows = out.reshape(n, bpr, -1)
            rows[(np.arange(r0, r0 + n) % spec.rows_per_matrix) == 0, :, :2] = 0  # scale 0: the row is 0
        return out.reshape(-1)
    gen = np.random.Generator(bits)
    vals = gen.standard_normal((n, spec.row_len), dtype=np.float32) * np.float32(spec.std)
    if spec.in0 is not None:
        vals[:, 0] = spec.in0
    if spec.zero_out0:
        vals[(np.arange(r0, r0 + n) % spec.rows_per_matrix) == 0] = 0
    return vals.astype(np.float32 if spec.qtype == QT.F32 else np.float16).reshape(-1).view(np.uint8)


def _random_blocks(bits: np.random.BitGenerator, qtype: QT, n_blocks: int, std: float) -> np.ndarray:
    # Draw every byte of every block at random, then turn the 16 random bits where each block's scale goes
    # into the scale itself through a 65536-entry table (sign bit + 15 bits of jitter). No copies.
    bb = BLOCK_BYTES[qtype]
    out = bits.random_raw(-(-n_blocks * bb // 8)).view(np.uint8)[:n_blocks * bb].reshape(n_blocks, bb)
    scale_bits = out.view(np.uint16)[:, 0]
    scale_bits[:] = _scale_table(qtype, std)[scale_bits]
    return out


def _scale_table(qtype: QT, std: float) -> np.ndarray:
    base = std / (CODE_RMS[qtype] * JITTER_RMS)
    if not (base * 0.75 >= 2.0**-24 and base * 1.25 < 65504):
        raise ValueError(f"weight std {std} gives f16 block scales that underflow or overflow")
    r = np.arange(65536, dtype=np.uint32)
    d = (0.75 + (r & 0x7FFF) * (0.5 / 32768)) * base
    return np.where(r & 0x8000, -d, d).astype(np.float16).view(np.uint16)

