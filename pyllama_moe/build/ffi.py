"""cffi bindings of pyllama_moe's C API, and the loader that refuses a library from another build.

The cdef is generated from `native/include/llama-moe.h` alone (the declarations between its CFFI markers).
A function the loaded library does not export (a master build, or a build from before a feature existed)
is simply absent from the `MoeLib` object: `AttributeError`, never a crash.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pyllama_moe.build.builder import Build, read_stamp
from pyllama_moe.build.info import embedded_mismatch, parse_build_info
from pyllama_moe.errors import UserError
from pyllama_moe.paths import NATIVE_DIR

HEADER = NATIVE_DIR / "include" / "llama-moe.h"
_BEGIN, _END = "// --- BEGIN CFFI ---", "// --- END CFFI ---"


def cdef_from_header(header: Path = HEADER) -> str:
    text = header.read_text()
    if _BEGIN not in text or _END not in text:
        raise UserError(f"{header} lacks the `{_BEGIN}` / `{_END}` markers", "restore them around the declarations")
    body = text.split(_BEGIN, 1)[1].split(_END, 1)[0]
    body = re.sub(r"//[^\n]*", "", body)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    body = body.replace("LLAMA_MOE_API", "")
    # opaque handles of llama.h used as pointers only
    prelude = "struct llama_context; struct llama_model; typedef struct llama_context llama_context;\n"
    return prelude + "\n".join(line.rstrip() for line in body.splitlines() if line.strip())


def declared_functions(cdef: str) -> list[str]:
    return re.findall(r"\b([a-z_][a-z0-9_]*)\s*\([^;]*\)\s*;", cdef)


@lru_cache(maxsize=1)
def _ffi():
    try:
        from cffi import FFI
    except ImportError as exc:  # pragma: no cover - cffi is a declared dependency
        raise UserError("the cffi package is missing", "pip install cffi") from exc
    ffi = FFI()
    cdef = cdef_from_header()
    ffi.cdef(cdef)
    return ffi, tuple(declared_functions(cdef))


@dataclass
class MoeLib:
    """The functions of llama-moe.h that this library exports, as attributes; nothing else."""

    path: Path
    build: Build
    _lib: object
    _ffi: object
    _names: tuple[str, ...]

    def __getattr__(self, name: str):
        if name.startswith("_") or name not in self._names:
            raise AttributeError(f"{name} is not available in {self.path} ({self.build.variant} build {self.build.key})")
        return getattr(self._lib, name)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self._names))

    def build_info(self) -> dict[str, str] | None:
        """The embedded build description; None for a master build, which carries no symbol of ours."""
        if "llama_moe_build_info" not in self._names:
            return None
        return parse_build_info(self._ffi.string(self._lib.llama_moe_build_info()).decode())


def library_path(build: Build) -> Path:
    lib = build.bin_dir / "libllama.so"
    if not lib.is_file():
        raise UserError(f"{lib} does not exist", f"rebuild: `pyllama-moe build --variant {build.variant} --backend {build.backend}`")
    return lib


def _rebuild(build: Build) -> str:
    return f"run `pyllama-moe build --variant {build.variant} --backend {build.backend}`"


def check_stamp(build: Build) -> None:
    stamp = read_stamp(build.path)
    if not stamp or stamp.get("key") != build.key:
        raise UserError(f"{build.path} is not a finished build with key {build.key} (stamp: {stamp and stamp.get('key')})",
                        _rebuild(build))


def check_embedded(build: Build, info: dict[str, str] | None, path: Path) -> None:
    """Refuse a library whose embedded build info does not name `build` (master embeds none)."""
    why = embedded_mismatch(build.variant, build.key, info, path)
    if why:
        raise UserError(why, _rebuild(build))


def load(build: Build) -> MoeLib:
    """Open the build's libllama; refuse it unless the stamp and the embedded key match `build.key`."""
    check_stamp(build)
    path = library_path(build)
    ffi, names = _ffi()
    try:
        lib = ffi.dlopen(str(path))
    except OSError as exc:
        raise UserError(f"cannot load {path}: {exc}",
                        "if it names a missing std:: symbol, this process loaded an older libstdc++ first: import "
                        "pyllama_moe.build.ffi before other extension modules, or set LD_PRELOAD to the system libstdc++") from exc
    present = []
    for name in names:
        try:
            getattr(lib, name)
            present.append(name)
        except AttributeError:
            pass
    moe = MoeLib(path, build, lib, ffi, tuple(present))
    check_embedded(build, moe.build_info(), path)
    return moe


def cache_counters(lib, ffi, ctx, phase: int, il: int = -1) -> tuple[int, dict[str, int]]:
    """`llama_moe_cache_get_counters` of a context (a cffi `struct llama_context *`): the number of layers it caches,
    and the counters of layer il (-1: summed over them) in phase 0 (prompt) or 1 (decode), by the field names of this
    header's struct, so fields appended to it come along. Decode's have n_cold where the build has a miss policy
    (`llama_moe_cache_get_cold_misses`: the misses computed on the CPU, beside n_misses, the uploaded ones)."""
    out = ffi.new("struct llama_moe_cache_counters *")
    n_layers = int(lib.llama_moe_cache_get_counters(ctx, il, phase, out))
    counters = {name: int(getattr(out, name)) for name, _ in ffi.typeof("struct llama_moe_cache_counters").fields}
    if phase == 1 and hasattr(lib, "llama_moe_cache_get_cold_misses"):
        # the decode misses computed on the CPU (hot/cold): a function of their own, the struct keeps its layout
        counters["n_cold"] = int(lib.llama_moe_cache_get_cold_misses(ctx, il))
    return n_layers, counters


# llama-moe.h's enum llama_moe_cache_path, in order (docs/cache-paths.md)
CACHE_PATHS = ("in_place", "device", "host_plan", "staging", "host", "hot_cold")


def cache_path_steps(lib, ffi, ctx, phase: int, il: int = -1) -> dict[str, int]:
    """`llama_moe_cache_get_path_steps` of a context: the steps of layer il (-1: all cached layers) in phase 0 (prompt)
    or 1 (decode) per path the layer took, by CACHE_PATHS' names."""
    # sized by the header the library was built with, which writes that many
    steps = ffi.new("uint64_t[]", max(len(CACHE_PATHS), int(lib.LLAMA_MOE_CACHE_PATH_COUNT)))
    lib.llama_moe_cache_get_path_steps(ctx, il, phase, steps)
    return {name: int(steps[i]) for i, name in enumerate(CACHE_PATHS)}


def decode_hit_rate(counters: dict[str, int], since: dict[str, int] | None = None) -> float | None:
    """The hit rate of decode counters (cache_counters' dict), or of what they counted after `since` (the same
    counters read earlier): steps read in place count their routed ids as hits, misses computed on the CPU (n_cold)
    count as misses, so that a policy which uploads less does not read as a better rate; None where nothing was
    looked up."""
    def hits_misses(c):
        return c["n_hits"] + c.get("n_routed_in_place", 0), c["n_misses"] + c.get("n_cold", 0)

    hits, misses = hits_misses(counters)
    if since is not None:
        hits0, misses0 = hits_misses(since)
        hits, misses = hits - hits0, misses - misses0
    return hits / (hits + misses) if hits + misses else None
