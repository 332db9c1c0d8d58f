// llama-moe.h: the public C API of pyllama_moe's additions to llama.cpp.
//
// This header is the single source of the Python (cffi) bindings: pyllama_moe reads the declarations
// between the BEGIN/END markers below, so keep them plain C (no macros inside declarations other than
// LLAMA_MOE_API, no includes, no inline functions). Knobs that later patches add are new functions here;
// public llama.h structs are never changed, because llama-cpp-python binds them field by field.
#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LLAMA_MOE_API LLAMA_API

// --- BEGIN CFFI ---

// A static, NUL-terminated description of this build:
// "key=<build key>;variant=<master|patched>;pin=<sdist version>@<llama.cpp commit>".
// The key is the content hash pyllama_moe computed over everything that went into the build; its loader
// compares it with the key of the build directory it was asked to load.
LLAMA_MOE_API const char * llama_moe_build_info(void);

// Pinned host experts. Expert weights that stay on the host and are mmap'ed from the model file are pageable,
// and a GPU uploads pageable memory several times slower than page-locked memory, without overlap. When on,
// loading a model with a GPU whose backend can page-lock host memory registers the mapped expert range with it
// (each context of the model holds a reference too); if that fails, the experts are copied once into the GPU's
// pinned host memory when they fit in the memory available (MemAvailable and cgroup limits, minus a margin of
// max(2 GiB, 1/16 of the total), env LLAMA_MOE_PIN_MARGIN_MIB overrides it; env LLAMA_MOE_PIN_FS_ROOT, for tests, reads
// /proc and /sys under another directory), else they stay pageable. The path
// taken is logged once per model ("llama_moe: ..."). Computes the same bytes either way.
// Process-wide default, read when a model is loaded: 1 on, 0 off, -1 unset (then the environment variable
// LLAMA_MOE_PIN_EXPERTS, then on). The getter returns the value in effect (0 or 1).
LLAMA_MOE_API void    llama_moe_default_set_pin_experts(int32_t on);
LLAMA_MOE_API int32_t llama_moe_default_get_pin_experts(void);

// --- END CFFI ---

#ifdef __cplusplus
}
#endif
