// copy-regions.cu: a batch of byte copies in few calls (see ggml-copy-regions.h), pyllama_moe.
//
// Device regions: one kernel launch per COPY_REGIONS_PER_LAUNCH regions, the table passed by value as a kernel
// parameter (no upload of its own, nothing to free), one row of blocks per region. Uploads: cudaMemcpyBatchAsync
// (CUDA 12.8 and later) in stream order; where the toolkit or the driver lacks it, one cudaMemcpyAsync per region.
#include "copy-regions.cuh"

#include "ggml.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#define COPY_REGIONS_PER_LAUNCH 64 // 64 x 24 bytes of table: well inside the 4 KiB of kernel parameters
#define COPY_REGIONS_THREADS    256
#define COPY_REGIONS_MAX_BLOCKS 128 // per region: 128 x 256 threads x 16 bytes = 512 KiB per pass

struct copy_region_table {
    const char * src[COPY_REGIONS_PER_LAUNCH];
    char *       dst[COPY_REGIONS_PER_LAUNCH];
    size_t       size[COPY_REGIONS_PER_LAUNCH];
};

static __global__ void k_copy_regions(const copy_region_table table) {
    const char * src  = table.src[blockIdx.y];
    char *       dst  = table.dst[blockIdx.y];
    const size_t size = table.size[blockIdx.y];
    const size_t first  = (size_t) blockIdx.x * blockDim.x + threadIdx.x;
    const size_t stride = (size_t) gridDim.x * blockDim.x;
    size_t done = 0;
    if ((((uintptr_t) src | (uintptr_t) dst) & 15) == 0) {
        // 16-byte words where both ends are aligned (expert rows of ggml's quantized types usually are)
        const size_t n16 = size / 16;
        for (size_t i = first; i < n16; i += stride) {
            ((int4 *) dst)[i] = ((const int4 *) src)[i];
        }
        done = n16 * 16;
    }
    for (size_t i = done + first; i < size; i += stride) {
        dst[i] = src[i];
    }
}

static void check(cudaError_t err, const char * what) {
    if (err != cudaSuccess) {
        GGML_ABORT("copy regions: %s failed: %s", what, cudaGetErrorString(err));
    }
}

static int upload_regions(cudaStream_t stream, const ggml_backend_copy_region * regions, int n) {
#if CUDART_VERSION >= 12080
    std::vector<void *>       dsts(n);
    std::vector<const void *> srcs(n);
    std::vector<size_t>       sizes(n);
    for (int i = 0; i < n; i++) {
        dsts[i]  = regions[i].dst;
        srcs[i]  = regions[i].src;
        sizes[i] = regions[i].size;
    }
    cudaMemcpyAttributes attr = {};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream; // the host memory outlives the call: read in stream order
    attr.flags          = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t attr_index   = 0;
#if CUDART_VERSION >= 13000
    const cudaError_t err = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), (size_t) n, &attr, &attr_index, 1, stream);
#else
    size_t failed_at = 0;
    const cudaError_t err = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), (size_t) n, &attr, &attr_index, 1,
                                                 &failed_at, stream);
#endif
    if (err == cudaSuccess) {
        return 1;
    }
    // a driver older than the toolkit: the copies one by one (nothing of the batch was queued)
    (void) cudaGetLastError();
#endif
    for (int i = 0; i < n; i++) {
        check(cudaMemcpyAsync(regions[i].dst, regions[i].src, regions[i].size, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
    }
    return n;
}

int ggml_cuda_copy_regions_async(cudaStream_t stream, const ggml_backend_copy_region * regions, int n_regions, bool host_src) {
    if (n_regions <= 0) {
        return 0;
    }
    if (host_src) {
        return upload_regions(stream, regions, n_regions);
    }
    int calls = 0;
    for (int first = 0; first < n_regions; first += COPY_REGIONS_PER_LAUNCH) {
        const int n = std::min(n_regions - first, COPY_REGIONS_PER_LAUNCH);
        copy_region_table table = {};
        size_t largest = 0;
        for (int i = 0; i < n; i++) {
            table.src[i]  = (const char *) regions[first + i].src;
            table.dst[i]  = (char *) regions[first + i].dst;
            table.size[i] = regions[first + i].size;
            largest = std::max(largest, regions[first + i].size);
        }
        const size_t per_block = (size_t) COPY_REGIONS_THREADS * 16;
        const unsigned blocks = (unsigned) std::min<size_t>((largest + per_block - 1) / per_block, COPY_REGIONS_MAX_BLOCKS);
        k_copy_regions<<<dim3(std::max(blocks, 1u), (unsigned) n), COPY_REGIONS_THREADS, 0, stream>>>(table);
        check(cudaGetLastError(), "k_copy_regions");
        calls++;
    }
    return calls;
}
