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

// --- END CFFI ---

#ifdef __cplusplus
}
#endif
