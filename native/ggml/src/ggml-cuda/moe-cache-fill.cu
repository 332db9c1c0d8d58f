// moe-cache-fill.cu: the expert cache's fills of a decode step, read from page-locked host memory in place, pyllama_moe.
//
// The lookup before it (moe-cache-lookup.cu) left the misses in its dst on the device; the host never learns how
// many there are, so one launch of a fixed shape covers the most a lookup can take (one row of blocks per possible
// fill) and the rows past the lookup's count return at once. A CUDA graph captures it like any kernel. The bytes
// cross PCIe as the loads of many threads (ggml_cuda_copy_bytes of copy-regions.cuh, as the batched device copies
// move theirs); an expert is ~1 MiB, so the rows of one fill share it out in chunks.
#include "moe-cache-fill.cuh"

#include "copy-regions.cuh"
#include "ggml-moe-cache-lookup.h"

#define CUDA_MOE_CACHE_FILL_BLOCK_SIZE 256
#define CUDA_MOE_CACHE_FILL_CHUNK      (64 * 1024) // bytes of an expert per block, about

static __global__ void moe_cache_fill_kernel(const char * __restrict__ host, const int64_t host_nb, const int64_t n_expert,
        char * __restrict__ bank, const int64_t slot_nb, const int64_t nbytes, const int32_t * __restrict__ tail,
        const int32_t n_slots, const int32_t skip_first) {
    const ggml_moe_cache_tail_layout d = ggml_moe_cache_tail_layout_of(n_slots);
    const int32_t n_fills = tail[d.result];
    const int32_t i       = blockIdx.y;
    if (i >= n_fills || (i == 0 && skip_first)) {
        return; // also an overflow or a bad input (negative): nothing was taken
    }
    // read like indices: an entry out of range (a tail written by anyone but the lookup) is left out
    const int32_t e = tail[d.fill_expert + i];
    const int32_t s = tail[d.fill_slot + i];
    if (e < 0 || e >= n_expert || s < 0 || s >= n_slots) {
        return;
    }
    const char * __restrict__ src = host + (int64_t) e * host_nb;
    char * __restrict__       out = bank + (int64_t) s * slot_nb;

    ggml_cuda_copy_bytes(out, src, (size_t) nbytes, (size_t) blockIdx.x * blockDim.x + threadIdx.x,
            (size_t) gridDim.x * blockDim.x);
}

void ggml_cuda_op_moe_cache_fill(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * lookup = dst->src[0];
    const ggml_tensor * host   = dst->src[1];
    const ggml_moe_cache_fill_params p = ggml_moe_cache_fill_params_of((const int32_t *) dst->op_params);

    const int64_t nbytes = (int64_t) (ggml_nbytes(dst) / p.n_slots); // one slot of the bank
    GGML_ASSERT(ggml_is_contiguous(dst) && ggml_is_contiguous(lookup));
    GGML_ASSERT(ggml_nelements(lookup) >= p.tail + ggml_moe_cache_tail_layout_of(p.n_slots).size);

    // host memory this device maps, read in place (the scheduler copied it here otherwise), or the device's own memory
    const char * src = (const char *) host->data;
    if (host->buffer != nullptr && ggml_backend_buffer_is_host(host->buffer)) {
        src = (const char *) ggml_cuda_host_read_ptr(ctx.device, host->buffer, host->data, ggml_nbytes(host));
        GGML_ASSERT(src != nullptr && "the fill's host experts are not memory the device maps");
    }

    // a lookup takes at most a fill per distinct expert: per routed id, and per slot (max_fills); a row of blocks each
    const int64_t n_chunks = std::max<int64_t>(1, std::min<int64_t>(64, nbytes / CUDA_MOE_CACHE_FILL_CHUNK));
    GGML_ASSERT(p.max_fills >= 1 && p.max_fills <= 65535);

    const dim3 grid((unsigned) n_chunks, (unsigned) p.max_fills, 1);
    moe_cache_fill_kernel<<<grid, CUDA_MOE_CACHE_FILL_BLOCK_SIZE, 0, ctx.stream()>>>(src, (int64_t) host->nb[p.expert_dim],
            host->ne[p.expert_dim], (char *) dst->data, nbytes, nbytes, (const int32_t *) lookup->data + p.tail, p.n_slots,
            p.skip_first);
    CUDA_CHECK(cudaGetLastError());
}
