"""Loading the request's model with its placement knobs, for every worker mode.

Only llama_cpp's low-level ctypes API is used, so the knobs (`-ngl`, `--cpu-moe`, `-ncmoe`, repack, load mode)
mean exactly what they mean to llama.cpp's own tools. A knob the request leaves out keeps llama.cpp's default.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from pathlib import Path

# what common/common.h calls LLM_FFN_EXPS_REGEX: the expert tensors --cpu-moe and -ncmoe keep on the CPU
EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
LOAD_MODES = {"none": 0, "mmap": 1}


class _Override(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def cpu_overrides(req: dict, lib_dir: Path):
    """The tensor_buft_overrides array for the request's offload mode (NULL-pattern terminated), and the
    encoded patterns it points into; (None, []) when every expert may go where -ngl puts its layer."""
    if req.get("cpu_moe"):
        patterns = [EXPS_REGEX]
    else:
        patterns = [rf"blk\.{i}{EXPS_REGEX}" for i in range(int(req.get("n_cpu_moe") or 0))]
        # "cpu_moe_layers": the experts of these layers, as `-ot 'blk\.(3|7)\.ffn_..._exps=CPU'` places them
        patterns += [rf"blk\.{int(i)}{EXPS_REGEX}" for i in req.get("cpu_moe_layers") or []]
    if not patterns:
        return None, []
    ggml_cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"))
    ggml_cpu.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
    buft = ggml_cpu.ggml_backend_cpu_buffer_type()
    keep = [p.encode() for p in patterns]
    arr = (_Override * (len(keep) + 1))()
    for i, pattern in enumerate(keep):
        arr[i].pattern, arr[i].buft = pattern, buft
    arr[len(keep)].pattern, arr[len(keep)].buft = None, None
    return arr, keep


@contextmanager
def loaded_model(llama_cpp, req: dict, lib_dir: Path, *, vocab_only: bool = False):
    """The model at req["model"] with the request's "n_gpu_layers", "load_mode", "repack", "cpu_moe", "n_cpu_moe"
    and "cpu_moe_layers"; freed on leaving. Free every context on it before that."""
    mp = llama_cpp.llama_model_default_params()
    if "n_gpu_layers" in req:
        mp.n_gpu_layers = int(req["n_gpu_layers"])
    if "load_mode" in req:
        if req["load_mode"] not in LOAD_MODES:
            raise RuntimeError(f"unknown load_mode {req['load_mode']!r}: use one of {', '.join(LOAD_MODES)}")
        mp.load_mode = LOAD_MODES[req["load_mode"]]
    if "repack" in req:
        mp.use_extra_bufts = bool(req["repack"])
    mp.vocab_only = vocab_only
    # held in this frame until the model is freed: the model keeps a copy of its params, this pointer included
    overrides, _patterns = cpu_overrides(req, lib_dir)
    if overrides is not None:
        mp.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
    model = llama_cpp.llama_model_load_from_file(req["model"].encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {req['model']} (its log above says why)")
    try:
        yield model
    finally:
        llama_cpp.llama_model_free(model)
