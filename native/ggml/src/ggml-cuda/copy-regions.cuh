// copy-regions.cuh: ggml_backend_copy_regions_async for CUDA (see ggml-copy-regions.h), pyllama_moe
#pragma once

#include "ggml-copy-regions.h"

// the runtime of the build's vendor: common.cuh would bring cuBLAS along, which this file does not need
#if defined(GGML_USE_HIP)
#include "vendors/hip.h"
#elif defined(GGML_USE_MUSA)
#include "vendors/musa.h"
#else
#include <cuda_runtime.h>
#endif

// queues the regions on `stream`, whose device is current; returns the calls made
int ggml_cuda_copy_regions_async(cudaStream_t stream, const ggml_backend_copy_region * regions, int n_regions, bool host_src);
