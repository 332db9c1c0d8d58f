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

// one bank's fill as the kernel reads it: where the host experts are read (in place, or a device copy), the bank
struct moe_cache_fill_bank {
    const char * host;
    int64_t      host_nb;
    int64_t      n_expert;
    char       * bank;
    int64_t      nbytes;     // one slot of the bank, one expert of the host tensor
    int32_t      skip_first;
};

// the fills of one lookup into up to CUDA_MOE_CACHE_FILL_MAX_BANKS banks (gate, up, down and their biases), passed by
// value so that one launch serves them all: blockIdx.z the bank, blockIdx.y the fill, blockIdx.x a chunk of it
struct moe_cache_fill_banks {
    moe_cache_fill_bank bank[CUDA_MOE_CACHE_FILL_MAX_BANKS];
};

// the blocks that share one fill of a bank: about CUDA_MOE_CACHE_FILL_CHUNK bytes each, 1 to 64
static __host__ __device__ int64_t moe_cache_fill_chunks(int64_t nbytes) {
    const int64_t n = nbytes / CUDA_MOE_CACHE_FILL_CHUNK;
    return n < 1 ? 1 : n > 64 ? 64 : n;
}

static __global__ void moe_cache_fill_kernel(const moe_cache_fill_banks banks, const int32_t * __restrict__ tail,
        const int32_t n_slots) {
    const ggml_moe_cache_tail_layout d = ggml_moe_cache_tail_layout_of(n_slots);
    const moe_cache_fill_bank & b = banks.bank[blockIdx.z];
    const int32_t n_fills = tail[d.result];
    const int32_t i       = blockIdx.y;
    if (i >= n_fills || (i == 0 && b.skip_first)) {
        return; // also an overflow or a bad input (negative): nothing was taken
    }
    // read like indices: an entry out of range (a tail written by anyone but the lookup) is left out
    const int32_t e = tail[d.fill_expert + i];
    const int32_t s = tail[d.fill_slot + i];
    if (e < 0 || e >= b.n_expert || s < 0 || s >= n_slots) {
        return;
    }
    // the bank's own share of the row (the grid has the most chunks of any bank; a bias bank needs one)
    const int64_t chunks = moe_cache_fill_chunks(b.nbytes);
    if ((int64_t) blockIdx.x >= chunks) {
        return;
    }
    ggml_cuda_copy_bytes(b.bank + (int64_t) s * b.nbytes, b.host + (int64_t) e * b.host_nb, (size_t) b.nbytes,
            (size_t) blockIdx.x * blockDim.x + threadIdx.x, (size_t) chunks * blockDim.x);
}

int ggml_cuda_moe_cache_fill_run(const ggml_cgraph * cgraph, int i) {
    const ggml_tensor * first = cgraph->nodes[i];
    const ggml_moe_cache_fill_params p0 = ggml_moe_cache_fill_params_of((const int32_t *) first->op_params);
    int n = 0;
    while (i + n < cgraph->n_nodes && n < CUDA_MOE_CACHE_FILL_MAX_BANKS) {
        const ggml_tensor * node = cgraph->nodes[i + n];
        if (node->op != GGML_OP_MOE_CACHE_FILL || node->src[0] != first->src[0] ||
                (node->flags & GGML_TENSOR_FLAG_COMPUTE) == 0) {
            break;
        }
        // the same fill list: slots, where the lookup left it, the most it may hold
        const ggml_moe_cache_fill_params p = ggml_moe_cache_fill_params_of((const int32_t *) node->op_params);
        if (p.n_slots != p0.n_slots || p.tail != p0.tail || p.max_fills != p0.max_fills) {
            break;
        }
        n++;
    }
    return n;
}

void ggml_cuda_op_moe_cache_fill(ggml_backend_cuda_context & ctx, ggml_tensor * const * fills, int n_fills) {
    GGML_ASSERT(n_fills >= 1 && n_fills <= CUDA_MOE_CACHE_FILL_MAX_BANKS);
    const ggml_tensor * lookup = fills[0]->src[0];
    const ggml_moe_cache_fill_params p0 = ggml_moe_cache_fill_params_of((const int32_t *) fills[0]->op_params);
    GGML_ASSERT(ggml_is_contiguous(lookup));
    GGML_ASSERT(ggml_nelements(lookup) >= p0.tail + ggml_moe_cache_tail_layout_of(p0.n_slots).size);
    // a lookup takes at most a fill per distinct expert: per routed id, and per slot (max_fills); a row of blocks each
    GGML_ASSERT(p0.max_fills >= 1 && p0.max_fills <= 65535);

    moe_cache_fill_banks banks = {};
    int64_t n_chunks = 1;
    for (int k = 0; k < n_fills; k++) {
        const ggml_tensor * dst  = fills[k];
        const ggml_tensor * host = dst->src[1];
        const ggml_moe_cache_fill_params p = ggml_moe_cache_fill_params_of((const int32_t *) dst->op_params);
        GGML_ASSERT(dst->src[0] == lookup && p.n_slots == p0.n_slots && p.tail == p0.tail && p.max_fills == p0.max_fills);
        GGML_ASSERT(ggml_is_contiguous(dst));

        // host memory this device maps, read in place (the scheduler copied it here otherwise), or device memory
        const char * src = (const char *) host->data;
        if (host->buffer != nullptr && ggml_backend_buffer_is_host(host->buffer)) {
            src = (const char *) ggml_cuda_host_read_ptr(ctx.device, host->buffer, host->data, ggml_nbytes(host));
            GGML_ASSERT(src != nullptr && "the fill's host experts are not memory the device maps");
        }
        moe_cache_fill_bank & b = banks.bank[k];
        b.host       = src;
        b.host_nb    = (int64_t) host->nb[p.expert_dim];
        b.n_expert   = host->ne[p.expert_dim];
        b.bank       = (char *) dst->data;
        b.nbytes     = (int64_t) (ggml_nbytes(dst) / p.n_slots);
        b.skip_first = p.skip_first;
        n_chunks = std::max<int64_t>(n_chunks, moe_cache_fill_chunks(b.nbytes));
    }

    const dim3 grid((unsigned) n_chunks, (unsigned) p0.max_fills, (unsigned) n_fills);
    moe_cache_fill_kernel<<<grid, CUDA_MOE_CACHE_FILL_BLOCK_SIZE, 0, ctx.stream()>>>(banks,
            (const int32_t *) lookup->data + p0.tail, p0.n_slots);
    CUDA_CHECK(cudaGetLastError());
}
