// copy-regions.cu: a batch of byte copies in few calls (see ggml-copy-regions.h), pyllama_moe.
//
// Device regions: a region of COPY_REGIONS_MEMCPY_MIN bytes or more is one cudaMemcpyAsync (the copy engines move
// it at full bandwidth, and few regions are that large); the smaller ones, where a launch per region was the cost,
// go in one kernel launch per COPY_REGIONS_PER_LAUNCH regions, the table passed by value as a kernel parameter (no
// upload of its own, nothing to free), one row of blocks per region. Uploads: cudaMemcpyBatchAsync (CUDA 12.8 and
// later) in stream order; one cudaMemcpyAsync per region where the toolkit, the driver or the device lacks it.
#include "copy-regions.cuh"

#include "ggml.h"
#include "ggml-impl.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#define COPY_REGIONS_PER_LAUNCH 64                 // 64 x 24 bytes of table: well inside the 4 KiB of kernel parameters
#define COPY_REGIONS_THREADS    256
#define COPY_REGIONS_MEMCPY_MIN (4u * 1024 * 1024) // bytes from which a device region is a cudaMemcpyAsync of its own

#if !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA) && defined(CUDART_VERSION) && CUDART_VERSION >= 12080
#define COPY_REGIONS_BATCH_UPLOADS 1
#else
#define COPY_REGIONS_BATCH_UPLOADS 0
#endif

struct copy_region_table {
    const char * src[COPY_REGIONS_PER_LAUNCH];
    char *       dst[COPY_REGIONS_PER_LAUNCH];
    size_t       size[COPY_REGIONS_PER_LAUNCH];
};

static __global__ void k_copy_regions(const copy_region_table table) {
    const char * __restrict__ src = table.src[blockIdx.y];
    char * __restrict__       dst = table.dst[blockIdx.y];
    const size_t size   = table.size[blockIdx.y];
    const size_t first  = (size_t) blockIdx.x * blockDim.x + threadIdx.x;
    const size_t stride = (size_t) gridDim.x * blockDim.x;
    ggml_cuda_copy_bytes(dst, src, size, first, stride);
}

static void check(cudaError_t err, const char * what) {
    if (err != cudaSuccess) {
        GGML_ABORT("copy regions: %s failed: %s", what, cudaGetErrorString(err));
    }
}

static int current_device() {
    int device = 0;
    check(cudaGetDevice(&device), "cudaGetDevice");
    return device;
}

#if COPY_REGIONS_BATCH_UPLOADS
// per device: 1 batched uploads work, -1 not here (said once), 0 not known yet
static std::atomic<int> g_batch_uploads[64];

// cudaMemcpyBatchAsync reads host memory through the device's own mapping of it: a device that cannot use the host
// pointer of registered memory (e.g. under WSL2) copies one region at a time, as before
static bool batch_uploads_usable(int device) {
    if (device < 0 || device >= 64) {
        return false;
    }
    int state = g_batch_uploads[device].load();
    if (state == 0) {
        int can = 0;
        check(cudaDeviceGetAttribute(&can, cudaDevAttrCanUseHostPointerForRegisteredMem, device), "cudaDeviceGetAttribute");
        state = can ? 1 : -1;
        if (!can) {
            GGML_LOG_INFO("copy regions: device %d cannot use host pointers of registered memory: one upload per region\n", device);
        }
        g_batch_uploads[device].store(state);
    }
    return state > 0;
}
#endif

static int upload_regions(cudaStream_t stream, const ggml_backend_copy_region * regions, int n) {
#if COPY_REGIONS_BATCH_UPLOADS
    const int device = current_device();
    if (batch_uploads_usable(device)) {
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
        if (err == cudaErrorNotSupported || err == cudaErrorCallRequiresNewerDriver) {
            // a driver older than the toolkit: nothing of the batch was queued; from now on one upload per region
            (void) cudaGetLastError();
            g_batch_uploads[device].store(-1);
            GGML_LOG_INFO("copy regions: cudaMemcpyBatchAsync is not supported here (%s): one upload per region\n",
                          cudaGetErrorString(err));
        } else if (err == cudaErrorInvalidValue) {
            // a batch the driver refuses (e.g. sources it cannot read out of order, such as some pageable memory):
            // nothing was queued; these uploads one by one, later batches tried again
            (void) cudaGetLastError();
            static std::atomic<bool> said{false};
            if (!said.exchange(true)) {
                GGML_LOG_WARN("copy regions: cudaMemcpyBatchAsync refused a batch of %d uploads (%s): uploading them one by one\n",
                              n, cudaGetErrorString(err));
            }
        } else {
            check(err, "cudaMemcpyBatchAsync");
        }
    }
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
    static std::atomic<int> n_sm_cached{0};
    int n_sm = n_sm_cached.load();
    if (n_sm == 0) {
        check(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, current_device()), "cudaDeviceGetAttribute");
        n_sm_cached.store(n_sm);
    }
    int calls = 0;
    copy_region_table table = {};
    int    n_table = 0;
    size_t largest = 0;
    auto launch = [&]() {
        // enough blocks to keep every SM busy over the table's regions, no more than the largest region fills
        const size_t per_block  = (size_t) COPY_REGIONS_THREADS * 16 * COPY_BYTES_UNROLL;
        const size_t for_size   = (largest + per_block - 1) / per_block;
        const size_t for_device = std::max(1, 4 * n_sm / n_table);
        const unsigned blocks   = (unsigned) std::max<size_t>(1, std::min(for_size, for_device));
        k_copy_regions<<<dim3(blocks, (unsigned) n_table), COPY_REGIONS_THREADS, 0, stream>>>(table);
        check(cudaGetLastError(), "k_copy_regions");
        calls++;
        n_table = 0;
        largest = 0;
    };
    for (int i = 0; i < n_regions; i++) {
        const ggml_backend_copy_region & r = regions[i];
        if (r.size >= COPY_REGIONS_MEMCPY_MIN) {
            check(cudaMemcpyAsync(r.dst, r.src, r.size, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
            calls++;
            continue;
        }
        table.src[n_table]  = (const char *) r.src;
        table.dst[n_table]  = (char *) r.dst;
        table.size[n_table] = r.size;
        largest = std::max(largest, r.size);
        if (++n_table == COPY_REGIONS_PER_LAUNCH) {
            launch();
        }
    }
    if (n_table > 0) {
        launch();
    }
    return calls;
}
