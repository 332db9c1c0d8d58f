// moe-cache-lookup.cu: the expert cache's decode lookup as one kernel of one block, pyllama_moe.
//
// The lookup is sequential (each miss takes what the misses before it left), so one thread runs it, the one C
// implementation the CPU and the host-side plan run (ggml-moe-cache-lookup.h), but for the state's check over every
// slot, which the block splits; the block also moves the layer's state into shared memory and back, so that the
// thread's many small reads and writes hit shared memory and not global memory. Shared memory holds what depends on the layer alone (state, the tail of fills, the
// scratch), so whether a layer is supported does not change with the batch; the slot ids, one per routed id, go
// straight to global memory. One launch of a fixed shape, no allocation and no host synchronization: capturable in a
// CUDA graph, and the state stays on the device from one token to the next.
#include "moe-cache-lookup.cuh"

#include "ggml-moe-cache-lookup.h"

#define CUDA_MOE_CACHE_LOOKUP_BLOCK_SIZE 256

// in int32 elements: state, then the tail; the scratch follows, 4-byte aligned
static int64_t moe_cache_lookup_shared_ints(int32_t n_expert, int32_t n_slots) {
    return ggml_moe_cache_state_size(n_expert, n_slots) + ggml_moe_cache_tail_layout_of(n_slots).size;
}

// the dynamic shared memory of a launch; the kernel's own three words of the phases' results (16 bytes as laid out) come
// on top
#define CUDA_MOE_CACHE_LOOKUP_STATIC_SHARED 16

static size_t moe_cache_lookup_shared_size(int32_t n_expert, int32_t n_slots) {
    return moe_cache_lookup_shared_ints(n_expert, n_slots) * sizeof(int32_t) + ggml_moe_cache_scratch_size(n_expert, n_slots);
}

// state: the lookup's tensor, [state | tail | slot_ids] (ggml_moe_cache_tensor_layout_of); the state and the tail are
// staged in shared memory, the tail right after the state, as in the tensor
static __global__ void moe_cache_lookup_kernel(const int32_t * __restrict__ ids, int32_t * __restrict__ state,
        int32_t * __restrict__ status, const int32_t n_expert, const int32_t n_slots, const int32_t n_used,
        const int64_t n_tokens, const int64_t stride) {
    extern __shared__ int32_t smem[];

    const ggml_moe_cache_tensor_layout t = ggml_moe_cache_tensor_layout_of(n_expert, n_slots);
    const int64_t n_state = t.tail;
    const int64_t n_tail  = ggml_moe_cache_tail_layout_of(n_slots).size;
    const int64_t n_marks = (int64_t) n_expert + n_slots;

    int32_t * s_state   = smem;
    int32_t * s_tail    = smem + n_state;
    uint8_t * s_scratch = (uint8_t *) (smem + n_state + n_tail);

    for (int64_t i = threadIdx.x; i < n_state; i += blockDim.x) {
        s_state[i] = state[i];
    }
    // the fill entries the lookup does not take stay -1; result and n_distinct it always writes
    for (int64_t i = threadIdx.x; i < n_tail; i += blockDim.x) {
        s_tail[i] = -1;
    }
    for (int64_t i = threadIdx.x; i < n_marks; i += blockDim.x) {
        s_scratch[i] = 0;
    }
    __syncthreads();

    ggml_moe_cache_state st = ggml_moe_cache_state_flat(s_state, n_expert, n_slots);
    st.status = status; // global memory: one word that the lookups of several layers add to, in stream order
    const ggml_moe_cache_scratch     sc = ggml_moe_cache_scratch_at(s_scratch, n_expert, n_slots);
    const ggml_moe_cache_tail_layout d  = ggml_moe_cache_tail_layout_of(n_slots);
    int32_t * slot_ids = state + t.slot_ids;

    // the lookup's three phases (ggml-moe-cache-lookup.h): the one that visits every slot split over the block, the
    // others on one thread, so the state and the tail end as ggml_moe_cache_lookup_to_dst leaves them
    __shared__ int32_t s_res, s_n_distinct, s_n_free;
    if (threadIdx.x == 0) {
        s_res    = ggml_moe_cache_lookup_begin(&st, sc, ids, n_tokens, n_used, stride, slot_ids, &s_n_distinct);
        s_n_free = 0;
    }
    __syncthreads();
    int32_t bad = 0;
    if (s_res == 0) {
        int32_t n_free = 0;
        ggml_moe_cache_check_slots(&st, threadIdx.x, blockDim.x, &n_free, &bad);
        atomicAdd(&s_n_free, n_free);
    }
    bad = __syncthreads_or(bad);
    if (threadIdx.x == 0) {
        int32_t res = s_res;
        if (res == 0) {
            res = ggml_moe_cache_lookup_end(&st, sc, ids, n_tokens, n_used, stride, s_n_distinct, s_n_free, bad, slot_ids,
                    s_tail + d.fill_expert, s_tail + d.fill_slot, s_tail + d.evicted);
        }
        ggml_moe_cache_lookup_record(&st, s_tail, res, ggml_moe_cache_distinct_reported(res, s_n_distinct));
    }
    __syncthreads();

    for (int64_t i = threadIdx.x; i < n_state + n_tail; i += blockDim.x) {
        state[i] = smem[i];
    }
}

bool ggml_cuda_moe_cache_lookup_supported(int device, const ggml_tensor * op) {
    const ggml_tensor * ids    = op->src[0];
    const ggml_tensor * state  = op->src[1];
    const ggml_tensor * status = op->src[2];
    if (ids->type != GGML_TYPE_I32 || state->type != GGML_TYPE_I32 || op->type != GGML_TYPE_I32 ||
            (status != nullptr && status->type != GGML_TYPE_I32)) {
        return false;
    }
    if (!ggml_is_contiguous(state) || !ggml_is_contiguous(op) || ids->nb[0] != sizeof(int32_t)) {
        return false;
    }
    // the default limit, so that the launch needs no opt-in attribute: 48 KiB hold about 1400 experts with a slot each (the state keeps a use count per expert)
    const int32_t n_expert = ggml_get_op_params_i32(op, 0);
    const int32_t n_slots  = ggml_get_op_params_i32(op, 1);
    return moe_cache_lookup_shared_size(n_expert, n_slots) + CUDA_MOE_CACHE_LOOKUP_STATIC_SHARED <=
        ggml_cuda_info().devices[device].smpb;
}

void ggml_cuda_op_moe_cache_lookup(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * ids = dst->src[0];

    const int32_t n_expert = ggml_get_op_params_i32(dst, 0);
    const int32_t n_slots  = ggml_get_op_params_i32(dst, 1);
    const int32_t n_used   = (int32_t) ids->ne[0];
    const int64_t n_tokens = ids->ne[1];

    // dst is a view of the state (ggml_moe_cache_lookup): the slot state, the tail and the slot ids are all in it
    GGML_ASSERT(ggml_moe_cache_tensor_max_ids(n_expert, n_slots, ggml_nelements(dst)) >= n_used * n_tokens);

    const size_t nbytes_shared = moe_cache_lookup_shared_size(n_expert, n_slots);
    GGML_ASSERT(nbytes_shared + CUDA_MOE_CACHE_LOOKUP_STATIC_SHARED <= ggml_cuda_info().devices[ggml_cuda_get_device()].smpb);

    moe_cache_lookup_kernel<<<1, CUDA_MOE_CACHE_LOOKUP_BLOCK_SIZE, nbytes_shared, ctx.stream()>>>(
            (const int32_t *) ids->data, (int32_t *) dst->data,
            dst->src[2] ? (int32_t *) dst->src[2]->data : nullptr, n_expert, n_slots, n_used,
            n_tokens, ids->nb[1] / (int64_t) sizeof(int32_t));
}
