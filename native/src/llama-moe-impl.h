// llama-moe-impl.h: what llama.cpp's own sources need from pyllama_moe's additions (not a public header).
#pragma once

#include "ggml-backend.h"

// the host-weight prefetch settings a new context starts from: process default (llama-moe.h setter or a
// llama.cpp flag), else the environment, else ggml's built-in values
ggml_backend_sched_prefetch_params llama_moe_prefetch_context_defaults();
