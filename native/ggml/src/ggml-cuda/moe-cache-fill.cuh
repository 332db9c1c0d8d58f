// moe-cache-fill.cuh: GGML_OP_MOE_CACHE_FILL for CUDA (see ggml.h and ggml-moe-cache-lookup.h), pyllama_moe
#pragma once

#include "common.cuh"

void ggml_cuda_op_moe_cache_fill(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// where kernels on device read [ptr, ptr + size) of host memory in place (buf: the memory's buffer, or nullptr), or
// nullptr where some of it cannot be read so (ggml-cuda.cu, beside the host maps it consults)
void * ggml_cuda_host_read_ptr(int device, ggml_backend_buffer_t buf, const void * ptr, size_t size);
