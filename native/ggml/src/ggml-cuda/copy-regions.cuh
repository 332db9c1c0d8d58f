// copy-regions.cuh: ggml_backend_copy_regions_async for CUDA (see ggml-copy-regions.h), pyllama_moe
#pragma once

#include "ggml-copy-regions.h"

#include <cstddef>
#include <cstdint>

// the runtime of the build's vendor: common.cuh would bring cuBLAS along, which this file does not need
#if defined(GGML_USE_HIP)
#include "vendors/hip.h"
#elif defined(GGML_USE_MUSA)
#include "vendors/musa.h"
#else
#include <cuda_runtime.h>
#endif

// the bytes [0, size) from src to dst by the threads of a grid, thread `first` of `stride`: bytes up to the first 16-byte
// boundary when both ends reach one together, then 16-byte words, COPY_BYTES_UNROLL of them in flight per thread
// (what keeps enough loads outstanding to reach a link's bandwidth, PCIe included), then the tail
#define COPY_BYTES_UNROLL 4

static __device__ __forceinline__ void ggml_cuda_copy_bytes(char * __restrict__ dst, const char * __restrict__ src,
        const size_t size, const size_t first, const size_t stride) {
    size_t head = size;
    if ((((uintptr_t) src ^ (uintptr_t) dst) & 15) == 0) {
        const size_t to_boundary = (16 - ((uintptr_t) src & 15)) & 15;
        head = to_boundary < size ? to_boundary : size;
    }
    for (size_t i = first; i < head; i += stride) {
        dst[i] = src[i];
    }
    if (head == size) {
        return;
    }
    const int4 * __restrict__ s16 = (const int4 *) (src + head);
    int4 * __restrict__       d16 = (int4 *) (dst + head);
    const size_t n16 = (size - head) / 16;
    for (size_t i = first; i < n16; i += COPY_BYTES_UNROLL * stride) {
        int4 v[COPY_BYTES_UNROLL];
#pragma unroll
        for (int u = 0; u < COPY_BYTES_UNROLL; u++) {
            if (i + u * stride < n16) {
                v[u] = s16[i + u * stride];
            }
        }
#pragma unroll
        for (int u = 0; u < COPY_BYTES_UNROLL; u++) {
            if (i + u * stride < n16) {
                d16[i + u * stride] = v[u];
            }
        }
    }
    for (size_t i = head + n16 * 16 + first; i < size; i += stride) {
        dst[i] = src[i];
    }
}

// queues the regions on `stream`, whose device is current; returns the calls made
int ggml_cuda_copy_regions_async(cudaStream_t stream, const ggml_backend_copy_region * regions, int n_regions, bool host_src);
