// moe-cache-fill.cuh: GGML_OP_MOE_CACHE_FILL for CUDA (see ggml.h and ggml-moe-cache-lookup.h), pyllama_moe
#pragma once

#include "common.cuh"

void ggml_cuda_op_moe_cache_fill(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
