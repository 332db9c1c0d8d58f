// copy-regions.cuh: ggml_backend_copy_regions_async for CUDA (see ggml-copy-regions.h), pyllama_moe
#pragma once

#include "ggml-copy-regions.h"

#include <cuda_runtime.h>

// queues the regions on `stream` (device `device` current); returns the calls made
int ggml_cuda_copy_regions_async(cudaStream_t stream, const ggml_backend_copy_region * regions, int n_regions, bool host_src);
