// moe-cache-lookup.cu: the expert cache's decode lookup as one kernel of one block, pyllama_moe.
//
// The lookup is sequential (each miss takes what the misses before it left), so one thread runs it, the one C
// implementation the CPU and the host-side plan run (ggml-moe-cache-lookup.h), but for the parts that visit every
// slot: the state's check, which the block splits, and each miss's pick of a slot, which a warp makes 32 slots a step;
// the block also moves the layer's state into shared memory and back, so that the many small reads and writes hit
// shared memory and not global memory. Shared memory holds what depends on the layer alone (state, the tail of fills, the
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

// the words the phases hand on through shared memory: static in the kernel, on top of a launch's dynamic shared memory
struct moe_cache_lookup_words {
    int32_t res;
    int32_t n_distinct;
    int32_t n_free;
    int32_t n_fills;
    int32_t n_hits;
    int32_t n_cold;
    int32_t slot; // a miss's slot, where one lane picks it
};

static size_t moe_cache_lookup_shared_size(int32_t n_expert, int32_t n_slots) {
    return moe_cache_lookup_shared_ints(n_expert, n_slots) * sizeof(int32_t) + ggml_moe_cache_scratch_size(n_expert, n_slots);
}

// ggml_moe_cache_take_slot with the 32 lanes of a warp (every lane returns the slot): the lowest free slot, or CLOCK a
// window of 32 slots at a time, each window's marks gathered by a ballot and judged by ggml_moe_cache_clock_window, the
// one judgement the C lookup makes (its windows gathered by a loop), so the slot and the reference bits it clears are
// the same. ROCm and MUSA builds (which run no expert cache: ggml-dev-caps.h) pick it on one lane with the C function
#if !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)
static __device__ int32_t moe_cache_take_slot_warp(const ggml_moe_cache_state & st, const ggml_moe_cache_scratch & sc,
        const int32_t e, moe_cache_lookup_words & w) {
    GGML_UNUSED(w);
    const int32_t   lane   = threadIdx.x % WARP_SIZE;
    const int32_t   n      = st.n_slots;
    const uint8_t * pinned = sc.marks + st.n_expert;
    if (*st.n_free > 0) {
        if (e < n && st.expert_of[e] < 0) {
            return e;
        }
        for (int32_t off = 0; off < n; off += WARP_SIZE) {
            const uint32_t free = __ballot_sync(0xffffffff, off + lane < n && st.expert_of[off + lane] < 0);
            if (free != 0) {
                return off + ggml_moe_cache_ctz(free);
            }
        }
        return -1;
    }
    const int32_t hand = *st.hand;
    int32_t victim = -1;
    for (int32_t turn = 0; turn < 2 && victim < 0; turn++) {
        for (int32_t off = 0; off < n && victim < 0; off += GGML_MOE_CACHE_WINDOW) {
            const int32_t  len = min(n - off, GGML_MOE_CACHE_WINDOW);
            const int32_t  s   = (hand + off + lane) % n;
            const bool     in  = lane < len;
            const uint32_t pin = __ballot_sync(0xffffffff, in && pinned[s] != 0);
            const uint32_t ref = __ballot_sync(0xffffffff, in && st.ref[s] != 0);
            uint32_t clear = 0;
            const int32_t v = ggml_moe_cache_clock_window(pin, ref, len, &clear);
            if (in && (clear >> lane & 1u)) {
                st.ref[s] = 0;
            }
            __syncwarp();
            victim = v >= 0 ? (hand + off + v) % n : -1;
        }
    }
    if (lane == 0) {
        const int32_t last = victim >= 0 ? victim : hand; // where 2 n + 1 steps would have left the hand
        *st.hand = last + 1 == n ? 0 : last + 1;
    }
    __syncwarp();
    return victim;
}
#else
static __device__ int32_t moe_cache_take_slot_warp(const ggml_moe_cache_state & st, const ggml_moe_cache_scratch & sc,
        const int32_t e, moe_cache_lookup_words & w) {
    if (threadIdx.x == 0) {
        w.slot = ggml_moe_cache_take_slot(&st, sc, e);
    }
    ggml_cuda_syncwarp();
    return w.slot;
}
#endif // !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)

// state: the lookup's tensor, [state | tail | slot_ids | cold_ids] (ggml_moe_cache_tensor_layout_of); the state and
// the tail are staged in shared memory, the tail right after the state, as in the tensor
static __global__ void moe_cache_lookup_kernel(const int32_t * __restrict__ ids, int32_t * __restrict__ state,
        int32_t * __restrict__ status, const int32_t n_expert, const int32_t n_slots, const int32_t n_used,
        const int64_t n_tokens, const int64_t stride, const int32_t max_fills) {
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
    int32_t * cold_ids = slot_ids + n_tokens * n_used;

    // the lookup's phases (ggml-moe-cache-lookup.h): the state's check over every slot split over the block, each
    // miss's slot picked by the first warp, the rest on one thread, so the state and the tail end as
    // ggml_moe_cache_lookup_to_dst leaves them
    __shared__ moe_cache_lookup_words w;
    if (threadIdx.x == 0) {
        w.res    = ggml_moe_cache_lookup_begin(&st, sc, ids, n_tokens, n_used, stride, slot_ids, cold_ids, &w.n_distinct);
        w.n_free = 0;
    }
    __syncthreads();
    int32_t bad = 0;
    if (w.res == 0) {
        int32_t n_free = 0;
        ggml_moe_cache_check_slots(&st, threadIdx.x, blockDim.x, &n_free, &bad);
        atomicAdd(&w.n_free, n_free);
    }
    bad = __syncthreads_or(bad);
    if (threadIdx.x == 0) {
        w.n_hits  = w.res == 0 ? ggml_moe_cache_lookup_hits(&st, sc, w.n_distinct, w.n_free, bad) : 0;
        w.res     = w.n_hits < 0 ? -3 : w.res;
        w.n_fills = 0;
        w.n_cold  = 0;
    }
    __syncthreads();
    if (w.res == 0 && threadIdx.x < WARP_SIZE) {
        // n_fills is shared memory written by lane 0 before a warp sync: every lane stops at the same miss
        for (int32_t i = 0; i < w.n_distinct && ggml_moe_cache_may_fill(&st, w.n_hits, w.n_fills, max_fills); i++) {
            const int32_t e = sc.distinct[i];
            if (st.slot_of[e] >= 0) {
                continue; // a hit, or taken: the same answer in every lane (shared memory, written before a warp sync)
            }
            const int32_t s = moe_cache_take_slot_warp(st, sc, e, w);
            ggml_cuda_syncwarp(); // every lane has read the state the take below writes
            if (threadIdx.x == 0) {
                ggml_moe_cache_lookup_take(&st, sc, e, s, s_tail + d.fill_expert, s_tail + d.fill_slot, s_tail + d.evicted,
                        &w.n_fills);
            }
            ggml_cuda_syncwarp();
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const int32_t res = w.res == 0 ? w.n_fills : w.res;
        if (w.res == 0) {
            w.n_cold = ggml_moe_cache_lookup_finish(&st, sc, ids, n_tokens, n_used, stride, w.n_distinct, slot_ids,
                    cold_ids);
        }
        ggml_moe_cache_lookup_record(&st, s_tail, res, ggml_moe_cache_distinct_reported(res, w.n_distinct), w.n_cold);
    }
    __syncthreads();

    for (int64_t i = threadIdx.x; i < n_state + n_tail; i += blockDim.x) {
        state[i] = smem[i];
    }
}

// the kernel's static shared memory as compiled (the words, padded as the compiler lays them out), read once
static size_t moe_cache_lookup_static_shared() {
    static const size_t n = [] {
        cudaFuncAttributes attr;
        CUDA_CHECK(cudaFuncGetAttributes(&attr, moe_cache_lookup_kernel));
        return attr.sharedSizeBytes;
    }();
    return n;
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
    return moe_cache_lookup_shared_size(n_expert, n_slots) + moe_cache_lookup_static_shared() <=
        ggml_cuda_info().devices[device].smpb;
}

void ggml_cuda_op_moe_cache_lookup(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * ids = dst->src[0];

    const int32_t n_expert = ggml_get_op_params_i32(dst, 0);
    const int32_t n_slots   = ggml_get_op_params_i32(dst, 1);
    const int32_t max_fills = ggml_get_op_params_i32(dst, 2);
    const int32_t n_used    = (int32_t) ids->ne[0];
    const int64_t n_tokens  = ids->ne[1];

    // dst is a view of the state (ggml_moe_cache_lookup): the slot state, the tail, the slot and cold ids are all in it
    GGML_ASSERT(ggml_moe_cache_tensor_max_ids(n_expert, n_slots, ggml_nelements(dst)) >= n_used * n_tokens);

    const size_t nbytes_shared = moe_cache_lookup_shared_size(n_expert, n_slots);
    GGML_ASSERT(nbytes_shared + moe_cache_lookup_static_shared() <= ggml_cuda_info().devices[ggml_cuda_get_device()].smpb);

    moe_cache_lookup_kernel<<<1, CUDA_MOE_CACHE_LOOKUP_BLOCK_SIZE, nbytes_shared, ctx.stream()>>>(
            (const int32_t *) ids->data, (int32_t *) dst->data,
            dst->src[2] ? (int32_t *) dst->src[2]->data : nullptr, n_expert, n_slots, n_used,
            n_tokens, ids->nb[1] / (int64_t) sizeof(int32_t), max_fills);
}
