"""Read a GGUF file's metadata and tensor directory, and check that the file is whole (every problem a UserError).

Our own reader rather than `gguf.GGUFReader`: this runs before every llama.cpp run, and GGUFReader takes seconds on
a real vocabulary (a numpy view per metadata array element) and fails on a cut-short file with a bare numpy error.
The timings: docs/synthetic-models.md, "Reading a GGUF header"; tests/test_synth.py checks both readers agree.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf import (GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, READER_SUPPORTED_VERSIONS,
                  GGMLQuantizationType, GGUFValueType)

from pyllama_moe.errors import UserError

# struct format of each scalar value type; numpy reads the same codes for arrays (GGUF is little-endian). Scalars go
# through struct: numpy's overhead per call made a header with 152k token strings 4x slower to read.
_FORMATS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
            GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
            GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
            GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
_MAX_COUNT = 1 << 31  # far beyond any real file; a bigger length field means corruption


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order (ne0 first)
    qtype: int
    offset: int  # from the start of the data section
    nbytes: int


@dataclass
class GgufInfo:
    path: Path
    version: int
    kv: dict[str, Any]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    data_offset: int = 0
    file_size: int = 0

    @property
    def arch(self) -> str:
        return str(self.kv.get("general.architecture", ""))

    def arch_key(self, key: str, default: Any = None) -> Any:
        return self.kv.get(f"{self.arch}.{key}", default)


class _Corrupt(Exception):
    pass


def read_gguf(path: str | os.PathLike, *, check_data: bool = True) -> GgufInfo:
    """Metadata and tensor directory of `path`; UserError if it is missing, not GGUF, or cut short."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"model file {path} does not exist", "check the path")
    if not path.is_file():
        raise UserError(f"model path {path} is not a file", "give the .gguf file itself")
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            info = _parse(f, path, size)
    except _Corrupt as e:
        raise UserError(f"{path} is not a valid GGUF file ({e})",
                        "re-create or re-download it (a truncated or interrupted write looks like this)") from None
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror})", "check the file's permissions") from None
    if check_data:
        for t in info.tensors.values():
            end = info.data_offset + t.offset + t.nbytes
            if end > size:
                raise UserError(
                    f"{path} is truncated: tensor {t.name} ends at byte {end} but the file has {size}",
                    "re-create or re-download it")
    return info


def _parse(f: BinaryIO, path: Path, size: int) -> GgufInfo:
    def read(n: int) -> bytes:
        b = f.read(n)
        if len(b) != n:
            raise _Corrupt(f"ends at byte {f.tell()} inside the header")
        return b

    def unpack(fmt: str) -> Any:
        return struct.unpack(fmt, read(struct.calcsize(fmt)))[0]

    def numbers(vtype: int, n: int) -> np.ndarray:
        if vtype == GGUFValueType.BOOL:  # a byte each, any nonzero one true
            return np.frombuffer(read(n), dtype=np.uint8).astype(bool)
        dtype = np.dtype(_FORMATS[vtype])
        return np.frombuffer(read(n * dtype.itemsize), dtype=dtype)

    def count(what: str) -> int:
        n = unpack("<Q")
        if n > _MAX_COUNT or n > size:
            raise _Corrupt(f"implausible {what} {n}")
        return n

    def string() -> str:
        raw = read(count("string length"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Corrupt("a string is not UTF-8") from None

    def value(vtype: int) -> Any:
        if vtype in _FORMATS:
            return unpack(_FORMATS[vtype])
        if vtype == GGUFValueType.STRING:
            return string()
        if vtype == GGUFValueType.ARRAY:
            etype, n = unpack("<I"), count("array length")
            if etype in _FORMATS:
                return numbers(etype, n)
            if etype == GGUFValueType.STRING:
                return [string() for _ in range(n)]
            raise _Corrupt(f"unknown array element type {etype}")
        raise _Corrupt(f"unknown value type {vtype}")

    if read(4) != GGUF_MAGIC.to_bytes(4, "little"):
        raise _Corrupt("wrong magic: not a GGUF file")
    version = unpack("<I")
    if version not in READER_SUPPORTED_VERSIONS:
        raise _Corrupt(f"unsupported GGUF version {version}")
    n_tensors, n_kv = count("tensor count"), count("metadata count")
    kv: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        kv[key] = value(unpack("<I"))
    info = GgufInfo(path=path, version=version, kv=kv, file_size=size)
    for _ in range(n_tensors):
        name = string()
        n_dims = unpack("<I")
        if not 1 <= n_dims <= 4:
            raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions")
        shape = tuple(unpack("<Q") for _ in range(n_dims))
        qtype, offset = unpack("<I"), unpack("<Q")
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise _Corrupt(f"tensor {name!r} has unknown type {qtype}") from None
        n_el = int(np.prod(shape, dtype=object))
        if shape[0] % block:
            raise _Corrupt(f"tensor {name!r}: row of {shape[0]} is not a multiple of the block size {block}")
        info.tensors[name] = TensorInfo(name, shape, qtype, offset, n_el // block * type_size)
    align = int(kv.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    if align <= 0 or align & (align - 1):
        raise _Corrupt(f"alignment {align} is not a power of two")
    info.data_offset = -(-f.tell() // align) * align
    return info
