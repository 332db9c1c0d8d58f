"""llama-cpp-python's `Llama` on a pyllama_moe build: experts kept on the host (`--cpu-moe`, `-ncmoe`) and the
expert cache in its context, in a few lines (`use_build` first, then `moe_llama`, then `cache_stats`).

`Llama` has no argument for llama.cpp's tensor buffer overrides, which is how `--cpu-moe` keeps experts on the
host, so `moe_llama` hands them to the model's parameters itself. The example and each argument: docs/python.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from pathlib import Path

from pyllama_moe.arguments import MISS_POLICY_RULE, parse_miss_policy
from pyllama_moe.build import ffi
from pyllama_moe.errors import UserError

_in_use: ffi.MoeLib | None = None  # the build use_build pointed llama_cpp at
# moe_llama swaps a llama_cpp function and the process default budget while a model loads (seconds, the GIL let go):
# one load at a time through it; a plain Llama built meanwhile in another thread would see them too
_loading = threading.Lock()


def use_build(variant: str = "patched", backend: str = "cpu", *, archive: Path | None = None) -> ffi.MoeLib:
    """Make `import llama_cpp` load this build's libllama (LLAMA_CPP_LIB_PATH), with the pinned sdist's llama_cpp
    package where none is installed; returns the build's llama-moe.h functions. Call it before llama_cpp is imported:
    a library already loaded cannot be swapped."""
    from pyllama_moe.build.builder import resolve
    from pyllama_moe.source import packs

    build = resolve(variant, backend, archive=archive, make=False)
    loaded = sys.modules.get("llama_cpp")
    if loaded is not None and os.environ.get("LLAMA_CPP_LIB_PATH") != str(build.bin_dir):
        raise UserError("llama_cpp was imported before pyllama_moe.llm.use_build, with another library",
                        "call use_build first, in a fresh process")
    global _in_use
    moe = ffi.load(build)  # the checked loader: the stamp and the embedded key must name this build
    os.environ["LLAMA_CPP_LIB_PATH"] = str(build.bin_dir)
    _in_use = moe
    try:
        import llama_cpp  # noqa: F401  (installed: its own package, our library)
    except ImportError:
        src = packs.python_source()
        if src.python_dir is None:
            raise UserError("llama_cpp is not installed and the pinned sdist has no Python package",
                            "pip install llama-cpp-python==0.3.36 (its library is replaced by the build's)") from None
        sys.path.insert(0, str(src.python_dir))
    return moe


@contextlib.contextmanager
def _model_params_with(overrides):
    """llama_cpp's default model parameters with `overrides` as the tensor buffer overrides, while the block runs."""
    import llama_cpp.llama_cpp as lc

    default = lc.llama_model_default_params

    def with_overrides():
        mp = default()
        mp.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
        return mp

    lc.llama_model_default_params = with_overrides
    try:
        yield
    finally:
        lc.llama_model_default_params = default


def moe_llama(model_path: str | Path, *, cpu_moe: bool = False, n_cpu_moe: int = 0, moe_cache_mib: int | None = None,
              moe_cache_seed: bool | None = None, moe_cache_profile: str | Path | None = None,
              sched_async_cpu: bool | None = None, moe_miss_policy: str | None = None,
              layer_major_prompt: bool | None = None, **llama_kwargs):
    """A `llama_cpp.Llama` whose expert tensors stay on the host (every layer's with cpu_moe, the first n_cpu_moe
    layers' otherwise) and whose context has an expert cache of moe_cache_mib MiB per GPU (None: the process
    default, LLAMA_MOE_CACHE_MIB), seeded at a prompt's end unless moe_cache_seed is False (None: the process
    default, LLAMA_MOE_CACHE_SEED, on), started from the expert cache profile moe_cache_profile where that file exists
    and counted into it when the context is freed (None: the process default, LLAMA_MOE_CACHE_PROFILE, none; see
    `pyllama_moe.plot.profile`), computing its CPU splits on a worker thread beside the GPU's when sched_async_cpu is
    True (None: the process default, GGML_SCHED_ASYNC_CPU, off; docs/async-cpu.md), and whose cache's decode steps
    follow the miss policy moe_miss_policy ("upload" every miss; "cpu": no uploads, the misses computed on the CPU
    beside the GPU's hits; "split:N": at most N uploads a layer step, the rest on the CPU; None: the process default,
    LLAMA_MOE_MISS_POLICY, upload; docs/hot-cold.md), and that computes a prompt of several ubatches layer group by
    layer group unless layer_major_prompt is False (None: the process default, LLAMA_LAYER_MAJOR_PROMPT, on;
    docs/layer-major.md). Other keywords go to `Llama`. Needs `use_build` first; a miss policy that is none of these is
    a ValueError."""
    policy = None if moe_miss_policy is None else parse_miss_policy(moe_miss_policy)
    if moe_miss_policy is not None and policy is None:  # before anything is imported or loaded
        raise ValueError(f"moe_miss_policy={moe_miss_policy!r} is not a miss policy: give {MISS_POLICY_RULE}")

    from llama_cpp import Llama

    from pyllama_moe.worker.model import cpu_overrides

    moe = _in_use
    if moe is None:
        raise UserError("no pyllama_moe build is in use", "call pyllama_moe.llm.use_build(...) before moe_llama")
    if moe_cache_mib is not None and "llama_moe_default_set_moe_cache_mib" not in dir(moe):
        raise UserError(f"the {moe.build.variant} build has no expert cache", "use_build('patched', ...)")
    if moe_cache_seed is not None and "llama_moe_default_set_moe_cache_seed" not in dir(moe):
        raise UserError(f"the {moe.build.variant} build has no expert cache seeding", "use_build('patched', ...)")
    if moe_cache_profile is not None and "llama_moe_default_set_moe_cache_profile" not in dir(moe):
        raise UserError(f"the {moe.build.variant} build has no expert cache profiles", "use_build('patched', ...)")
    if sched_async_cpu is not None and "llama_moe_set_sched_async_cpu" not in dir(moe):
        raise UserError(f"the {moe.build.variant} build has no asynchronous CPU splits", "use_build('patched', ...)")
    if layer_major_prompt is not None and "llama_moe_set_layer_major_prompt" not in dir(moe):
        raise UserError(f"the {moe.build.variant} build has no layer-major prompts", "use_build('patched', ...)")
    if policy is not None and "llama_moe_default_set_moe_miss_policy" not in dir(moe):
        raise UserError(f"the {moe.build.variant} build has no miss policy", "use_build('patched', ...)")
    if moe_cache_mib and moe.build.backend == "cpu" and not os.environ.get("GGML_SIM_DEVICES"):
        # the library says so in its log too, but Llama hides that unless verbose
        sys.stderr.write(f"pyllama_moe: the expert cache needs a GPU: this {moe.build.backend} build runs without it "
                         "(cache_stats reports no lookups); build with --backend cuda and use_build(..., 'cuda')\n")
    overrides, patterns = cpu_overrides({"cpu_moe": cpu_moe, "n_cpu_moe": n_cpu_moe}, moe.build.bin_dir)
    with _loading, _model_params_with(overrides) if overrides is not None else contextlib.nullcontext():
        previous = moe.llama_moe_default_get_moe_cache_mib() if moe_cache_mib is not None else None
        previous_seed = moe.llama_moe_default_get_moe_cache_seed() if moe_cache_seed is not None else None
        previous_profile = _default_profile(moe) if moe_cache_profile is not None else None
        previous_policy = _default_miss_policy(moe) if policy is not None else None
        try:
            if moe_cache_profile is not None:
                # the cache reads the path when the context makes it (inside Llama), and keeps it till it is freed
                moe.llama_moe_default_set_moe_cache_profile(str(Path(moe_cache_profile).resolve()).encode())
            if moe_cache_mib is not None:
                moe.llama_moe_default_set_moe_cache_mib(int(moe_cache_mib))
            if moe_cache_seed is not None:
                moe.llama_moe_default_set_moe_cache_seed(1 if moe_cache_seed else 0)
            if policy is not None:
                moe.llama_moe_default_set_moe_miss_policy(*policy)  # read when the context makes its cache
            model = Llama(model_path=str(model_path), **llama_kwargs)
        finally:
            if previous is not None:
                moe.llama_moe_default_set_moe_cache_mib(previous)
            if previous_seed is not None:
                moe.llama_moe_default_set_moe_cache_seed(previous_seed)
            if previous_policy is not None:
                moe.llama_moe_default_set_moe_miss_policy(*previous_policy)
            if moe_cache_profile is not None:
                # back to what was in effect (a path set before, or the environment's, which is then read again)
                moe.llama_moe_default_set_moe_cache_profile(previous_profile or moe._ffi.NULL)
    if sched_async_cpu is not None:
        # per context: its scheduler is reserved again at the next decode
        moe.llama_moe_set_sched_async_cpu(_context_of(moe, model), 1 if sched_async_cpu else 0)
    if layer_major_prompt is not None:
        moe.llama_moe_set_layer_major_prompt(_context_of(moe, model), 1 if layer_major_prompt else 0)
    model._pyllama_moe_overrides = (overrides, patterns)  # the model holds a pointer to them
    if overrides is not None and model.model_params.tensor_buft_overrides != ctypes.addressof(overrides):
        raise UserError("llama_cpp.Llama did not take the expert overrides (another llama-cpp-python version?)",
                        "use llama-cpp-python 0.3.36, the pinned one")
    return model


def _context_of(moe, model):
    """The `llama_context *` of a `Llama`, as the build's cffi type."""
    return moe._ffi.cast("struct llama_context *", ctypes.cast(model.ctx, ctypes.c_void_p).value)


def _default_miss_policy(moe) -> tuple[int, int]:
    """The miss policy in effect for new caches (llama_moe_default_get_moe_miss_policy), as (kind, n)."""
    n = moe._ffi.new("int32_t *")
    kind = int(moe.llama_moe_default_get_moe_miss_policy(n))
    return kind, int(n[0])


def _default_profile(moe) -> bytes | None:
    """The profile path in effect for new caches (llama_moe_default_get_moe_cache_profile), or None."""
    p = moe.llama_moe_default_get_moe_cache_profile()
    return None if p == moe._ffi.NULL else moe._ffi.string(p)


def cache_stats(moe: ffi.MoeLib, model) -> dict:
    """The expert cache's counters of a `Llama`'s context per phase ("prompt", "decode"), summed over its layers and
    per cached layer, with the decode hit rate (None where nothing was looked up; a prompt has none: it stages every
    expert of a layer, so its hits say how full the cache is). Steps read in place count their routed ids as hits;
    decode's n_cold, the misses computed on the CPU under the miss policy, count as misses."""
    import llama_cpp.llama_cpp as lc

    ctx = _context_of(moe, model)
    n_layer = int(lc.llama_model_n_layer(model.model))
    out = {}
    for phase, name in ((0, "prompt"), (1, "decode")):
        n_layers, total = ffi.cache_counters(moe, moe._ffi, ctx, phase)
        layers = {}
        for il in range(n_layer):
            _, c = ffi.cache_counters(moe, moe._ffi, ctx, phase, il)
            if c["n_ubatches"]:
                layers[il] = c
        out[name] = {**total, "n_layers": n_layers, "layers": layers,
                     "hit_rate": ffi.decode_hit_rate(total) if name == "decode" else None}
    return out
