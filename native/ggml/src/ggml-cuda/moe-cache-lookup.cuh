// moe-cache-lookup.cuh: GGML_OP_MOE_CACHE_LOOKUP for CUDA (see ggml.h and ggml-moe-cache-lookup.h), pyllama_moe
#pragma once

#include "common.cuh"

void ggml_cuda_op_moe_cache_lookup(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// whether the layer's state, the dst tail and the scratch fit one block's shared memory on `device`
bool ggml_cuda_moe_cache_lookup_supported(int device, const ggml_tensor * op);
