"""libggml-base through ctypes, for the worker's eval callbacks: the functions they call, with their types, and the
leading fields of struct ggml_tensor, to read a tensor back by its strides and find its sources."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

GGML_MAX_DIMS, GGML_MAX_SRC, GGML_MAX_OP_PARAMS, GGML_MAX_NAME = 4, 10, 64, 64


class GgmlTensor(ctypes.Structure):
    """struct ggml_tensor of the pinned ggml.h, up to `name` (read() checks ne and nb against ggml_nbytes)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p),
                ("ne", ctypes.c_int64 * GGML_MAX_DIMS), ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
                ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * GGML_MAX_SRC),
                ("view_src", ctypes.c_void_p), ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p),
                ("name", ctypes.c_char * GGML_MAX_NAME)]


def load(path: str | Path) -> ctypes.CDLL:
    """libggml-base with the argument and result types of the functions the callbacks call."""
    ggml = ctypes.CDLL(str(path))
    for fn in (ggml.ggml_get_name, ggml.ggml_op_desc):
        fn.restype, fn.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    ggml.ggml_nbytes.restype, ggml.ggml_nbytes.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
    for fn in (ggml.ggml_backend_tensor_get, ggml.ggml_backend_tensor_set):
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    return ggml


def read(ggml: ctypes.CDLL, ptr: int, dtype, dims: int) -> np.ndarray:
    """A tensor's first `dims` dimensions, outermost first, by its strides (a view such as the top-k ids is not
    contiguous: ggml_nbytes spans its last element, so the bytes read cover every one)."""
    t = GgmlTensor.from_address(ptr)
    size = ggml.ggml_nbytes(ptr)
    # the struct mirror must agree with ggml's own size computation, else the layout has changed
    if size != np.dtype(dtype).itemsize + sum((t.ne[i] - 1) * t.nb[i] for i in range(GGML_MAX_DIMS)):
        raise RuntimeError(f"struct ggml_tensor layout mismatch (ne={list(t.ne)}, nb={list(t.nb)}, ggml_nbytes={size})")
    raw = np.empty(size, dtype=np.uint8)
    ggml.ggml_backend_tensor_get(ptr, raw.ctypes.data, 0, size)
    shape, strides = tuple(t.ne)[:dims][::-1], tuple(t.nb)[:dims][::-1]
    return np.lib.stride_tricks.as_strided(raw.view(dtype), shape=shape, strides=strides).copy()
