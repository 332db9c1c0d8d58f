// moe-cache-fill.cuh: GGML_OP_MOE_CACHE_FILL for CUDA (see ggml.h and ggml-moe-cache-lookup.h), pyllama_moe
#pragma once

#include "common.cuh"

// the most banks one launch fills: a layer's expert tensors and their per-expert biases and scales
#define CUDA_MOE_CACHE_FILL_MAX_BANKS 8

// how many fills from node i on form one launch: consecutive fills of the same lookup (a layer's banks, built one after
// another), at most CUDA_MOE_CACHE_FILL_MAX_BANKS
int ggml_cuda_moe_cache_fill_run(const ggml_cgraph * cgraph, int i);

// fills[0..n_fills): fills of one lookup, in one launch
void ggml_cuda_op_moe_cache_fill(ggml_backend_cuda_context & ctx, ggml_tensor * const * fills, int n_fills);

// where kernels on device read [ptr, ptr + size) of host memory in place (buf: the memory's buffer, or nullptr), or
// nullptr where some of it cannot be read so (ggml-cuda.cu, beside the host maps it consults)
void * ggml_cuda_host_read_ptr(int device, ggml_backend_buffer_t buf, const void * ptr, size_t size);
