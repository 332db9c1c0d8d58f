// ggml-moe-cache-lookup.h (pyllama_moe): the MoE expert cache's decode lookup on a flat slot state, the one
// implementation that the host-side plan (llama-moe-cache.cpp) runs today and that the device lookup op runs on
// the CPU, on SIM and, from shared memory, in the CUDA kernel. Plain C with no library calls and no allocation, so
// that every one of them computes the same slots from the same state and the two can hand over (prompt, then decode)
// by copying the state.
//
// The state of one cached layer (n_expert experts, n_slots slots), all int32:
//   slot_of[n_expert]   the slot of each expert, -1 when not resident
//   expert_of[n_slots]  the expert of each slot, -1 when free
//   ref[n_slots]        CLOCK reference bits (0/1)
//   hand, n_free        the CLOCK hand and the free slots
//   uses[n_expert]      how many lookups routed to each expert (the expert cache profile's counts)
//
// A lookup of a ubatch's routing: the distinct experts in order of first appearance (token by token, each token's
// experts in the router's order, highest score first); each hit sets its reference bit and is pinned; each miss, in
// that order, while the lookup may still fill (fewer fills than its max_fills, the miss policy, and a slot left that
// is not pinned), takes its own slot (slot e for expert e) if that one is free, else the lowest free slot, else the
// first slot under the hand that is not pinned and whose bit is clear (clearing the bits it passes), and is pinned.
// The misses left are cold: computed from the host weights, not from a slot. Slot ids are written for every routed id
// (-1 where cold) and cold ids beside them (the expert where cold, else -1), so that the hot and the cold matmuls each
// read their own ids with the other's masked (ggml_mul_mat_id_masked). A device runs this without the host's checks,
// so bad input changes nothing: an id out of range (-2), a state whose counts disagree with its slots (-3); a hand out
// of range is taken as 0.
//
// Use counts (uses, where not NULL): a lookup that plans (result >= 0) adds 1 to each distinct expert it routes, so a
// layer's uses sum to its hits + misses, the counters' experts; a refused lookup counts nothing. Counted here, in the
// one lookup, so that the host-side plan, the CPU op, SIM and the CUDA kernel count alike and the counts travel with
// the state at every handover. int32 values saturating at INT32_MAX (never negative: GGUF, where a profile keeps them,
// has no unsigned tensor type).
#pragma once

#include <stdint.h>

#if defined(__CUDACC__) || defined(__HIPCC__) || defined(__MUSACC__)
#define GGML_MOE_CACHE_FN static inline __host__ __device__
#else
#define GGML_MOE_CACHE_FN static inline
#endif

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_moe_cache_state {
    int32_t   n_expert;
    int32_t   n_slots;
    int32_t * slot_of;
    int32_t * expert_of;
    int32_t * ref;
    int32_t * hand;
    int32_t * n_free;
    int32_t * counters; // [2 * GGML_MOE_CACHE_N_COUNTERS] or NULL: what ggml_moe_cache_lookup_to_dst counts
    int32_t * uses;     // [n_expert] or NULL: what ggml_moe_cache_lookup_slots counts per expert (saturating)
    int32_t * status;   // NULL, or a word that a refused ggml_moe_cache_lookup_to_dst adds 1 to (saturating), kept
                        // apart from the flat state so that the words of many layers can sit side by side and be
                        // read back in one copy with a step's outputs (a refused step computed from wrong slots)
};

// what the lookups of a device state count, so that the host learns its hit rate without reading every step back:
// 64-bit counts kept as two int32 words each (low word first), added to by ggml_moe_cache_lookup_to_dst
enum ggml_moe_cache_counter {
    GGML_MOE_CACHE_COUNT_LOOKUPS,   // lookups that planned (result >= 0)
    GGML_MOE_CACHE_COUNT_HITS,      // distinct experts found resident
    GGML_MOE_CACHE_COUNT_MISSES,    // ... and filled
    GGML_MOE_CACHE_COUNT_EVICTIONS, // fills into a slot that held another expert
    GGML_MOE_CACHE_COUNT_REFUSED,   // lookups that changed nothing (result < 0: bad id, bad state)
    GGML_MOE_CACHE_COUNT_COLD,      // distinct experts missed and left cold (computed on the CPU)
    GGML_MOE_CACHE_N_COUNTERS,
};

GGML_MOE_CACHE_FN uint64_t ggml_moe_cache_counter_get(const int32_t * counters, int which) {
    return (uint64_t) (uint32_t) counters[2 * which] | ((uint64_t) (uint32_t) counters[2 * which + 1] << 32);
}

GGML_MOE_CACHE_FN void ggml_moe_cache_counter_add(int32_t * counters, int which, uint64_t n) {
    const uint64_t v = ggml_moe_cache_counter_get(counters, which) + n;
    counters[2 * which]     = (int32_t) (uint32_t) v;
    counters[2 * which + 1] = (int32_t) (uint32_t) (v >> 32);
}

// scratch of a lookup: marks[n_expert + n_slots] all zero on entry (left zero on return), distinct[n_expert]
struct ggml_moe_cache_scratch {
    uint8_t * marks;
    int32_t * distinct;
};

// the scratch in one piece of memory aligned to 4 bytes (a work buffer, shared memory): the marks, padded to a multiple
// of 4 bytes, then distinct
GGML_MOE_CACHE_FN int64_t ggml_moe_cache_marks_padded(int32_t n_expert, int32_t n_slots) {
    return ((int64_t) n_expert + n_slots + 3) / 4 * 4;
}

GGML_MOE_CACHE_FN int64_t ggml_moe_cache_scratch_size(int32_t n_expert, int32_t n_slots) {
    return ggml_moe_cache_marks_padded(n_expert, n_slots) + 4 * (int64_t) n_expert;
}

GGML_MOE_CACHE_FN struct ggml_moe_cache_scratch ggml_moe_cache_scratch_at(void * p, int32_t n_expert, int32_t n_slots) {
    struct ggml_moe_cache_scratch sc;
    sc.marks    = (uint8_t *) p;
    sc.distinct = (int32_t *) (sc.marks + ggml_moe_cache_marks_padded(n_expert, n_slots));
    return sc;
}

// The flat state of one layer, the prefix of the tensor that the op GGML_OP_MOE_CACHE_LOOKUP (ggml.h) updates:
// [hand, n_free, slot_of[n_expert], expert_of[n_slots], ref[n_slots], counters[2 * GGML_MOE_CACHE_N_COUNTERS],
// uses[n_expert]]. One piece, so that handing a layer's state between the host-side plan and a device is one copy; what
// the lookups count (counters, uses) is its end, read back alone for the stats.
GGML_MOE_CACHE_FN int64_t ggml_moe_cache_state_size(int32_t n_expert, int32_t n_slots) {
    return 2 + 2 * (int64_t) n_expert + 2 * (int64_t) n_slots + 2 * GGML_MOE_CACHE_N_COUNTERS;
}

// where the counted tail (counters, then uses) starts in the flat state, in elements, and its length
GGML_MOE_CACHE_FN int64_t ggml_moe_cache_state_counted_offset(int32_t n_expert, int32_t n_slots) {
    return 2 + (int64_t) n_expert + 2 * (int64_t) n_slots;
}

GGML_MOE_CACHE_FN int64_t ggml_moe_cache_state_counted_size(int32_t n_expert) {
    return 2 * GGML_MOE_CACHE_N_COUNTERS + (int64_t) n_expert;
}

GGML_MOE_CACHE_FN struct ggml_moe_cache_state ggml_moe_cache_state_flat(int32_t * flat, int32_t n_expert, int32_t n_slots) {
    struct ggml_moe_cache_state st;
    st.n_expert  = n_expert;
    st.n_slots   = n_slots;
    st.hand      = flat;
    st.n_free    = flat + 1;
    st.slot_of   = flat + 2;
    st.expert_of = flat + 2 + n_expert;
    st.ref       = flat + 2 + n_expert + n_slots;
    st.counters  = flat + 2 + n_expert + 2 * n_slots;
    st.uses      = st.counters + 2 * GGML_MOE_CACHE_N_COUNTERS;
    st.status    = 0;
    return st;
}

// The tensor that GGML_OP_MOE_CACHE_LOOKUP (ggml.h) updates and returns a view of, int32: the flat state, then what one
// lookup leaves for the ops after it (the fills, the slot ids and the cold ids), room for up to max_ids routed ids:
//   [state | result | n_distinct | n_cold | fill_expert[n_slots] | fill_slot[n_slots] | evicted[n_slots] | ids]
// result is the lookup's return (the fills, or -2 an id out of range, -3 an inconsistent state); the fill entries past
// the fills are -1. ids: the n_ids = n_used * n_tokens slot ids of this lookup, then its n_ids cold ids (room for
// 2 * max_ids): slot_ids[t * n_used + j] is the slot of routed id j of token t (-1: cold), cold_ids[t * n_used + j] its
// expert where cold (else -1). The tail (result on) sits at a fixed offset, so that a fill finds it whatever the
// ubatch; the state is a prefix, so that handing a layer over between the host-side plan and a device copies only
// ggml_moe_cache_state_size elements. Offsets in elements, so that no caller computes them by hand.
struct ggml_moe_cache_tail_layout { // offsets from the tail's start (result)
    int64_t result;
    int64_t n_distinct;
    int64_t n_cold;
    int64_t fill_expert;
    int64_t fill_slot;
    int64_t evicted;
    int64_t size;
};

GGML_MOE_CACHE_FN struct ggml_moe_cache_tail_layout ggml_moe_cache_tail_layout_of(int32_t n_slots) {
    struct ggml_moe_cache_tail_layout d;
    d.result      = 0;
    d.n_distinct  = 1;
    d.n_cold      = 2;
    d.fill_expert = 3;
    d.fill_slot   = d.fill_expert + n_slots;
    d.evicted     = d.fill_slot + n_slots;
    d.size        = d.evicted + n_slots;
    return d;
}

struct ggml_moe_cache_tensor_layout { // offsets in the lookup's tensor
    int64_t tail;
    int64_t slot_ids; // a lookup's cold ids follow its slot ids: at slot_ids + n_ids
};

GGML_MOE_CACHE_FN struct ggml_moe_cache_tensor_layout ggml_moe_cache_tensor_layout_of(int32_t n_expert, int32_t n_slots) {
    struct ggml_moe_cache_tensor_layout t;
    t.tail     = ggml_moe_cache_state_size(n_expert, n_slots);
    t.slot_ids = t.tail + ggml_moe_cache_tail_layout_of(n_slots).size;
    return t;
}

// the elements of a lookup's tensor with room for max_ids routed ids (n_used * n_tokens of the largest ubatch): a slot
// id and a cold id each
GGML_MOE_CACHE_FN int64_t ggml_moe_cache_tensor_size(int32_t n_expert, int32_t n_slots, int64_t max_ids) {
    return ggml_moe_cache_tensor_layout_of(n_expert, n_slots).slot_ids + 2 * max_ids;
}

// the routed ids a lookup's tensor of n elements has room for (negative: not even the state and the tail fit)
GGML_MOE_CACHE_FN int64_t ggml_moe_cache_tensor_max_ids(int32_t n_expert, int32_t n_slots, int64_t n) {
    const int64_t room = n - ggml_moe_cache_tensor_layout_of(n_expert, n_slots).slot_ids;
    return room < 0 ? room : room / 2;
}

// expert e's own slot when it is free, else the lowest free slot; only while *n_free > 0
GGML_MOE_CACHE_FN int32_t ggml_moe_cache_free_slot(const struct ggml_moe_cache_state * st, int32_t e) {
    if (e < st->n_slots && st->expert_of[e] < 0) {
        return e;
    }
    for (int32_t s = 0; s < st->n_slots; s++) {
        if (st->expert_of[s] < 0) {
            return s;
        }
    }
    return -1;
}

// the lowest set bit of a nonzero word
GGML_MOE_CACHE_FN int32_t ggml_moe_cache_ctz(uint32_t x) {
#if defined(__CUDA_ARCH__) && !defined(__HIPCC__) // ROCm's headers define __CUDA_ARCH__ in host code too
    return __ffs((int) x) - 1;
#elif defined(__GNUC__) || defined(__clang__)
    return __builtin_ctz(x);
#else
    int32_t n = 0;
    while (!(x & 1u)) {
        x >>= 1;
        n++;
    }
    return n;
#endif
}

// the slots CLOCK walks at a time: a word of marks, so that a warp can take a window in one step
#define GGML_MOE_CACHE_WINDOW 32

// CLOCK over one window of its walk: bit k < len stands for the k-th slot the hand comes to in the window, pin and ref
// for their pinned marks and reference bits as the walk finds them. Returns the victim's bit, or -1 where the window
// has none; *clear: the reference bits the walk clears on its way (pinned slots are passed untouched)
GGML_MOE_CACHE_FN int32_t ggml_moe_cache_clock_window(uint32_t pin, uint32_t ref, int32_t len, uint32_t * clear) {
    const uint32_t valid = len >= 32 ? 0xffffffffu : (1u << len) - 1;
    const uint32_t cand  = ~pin & ~ref & valid;
    if (cand == 0) {
        *clear = ~pin & ref & valid;
        return -1;
    }
    const int32_t v = ggml_moe_cache_ctz(cand);
    *clear = ~pin & ref & ((1u << v) - 1);
    return v;
}

// CLOCK: at least one slot is not pinned (the caller checked the distinct experts against the slots), so two turns of
// the hand always find one. The walk a window at a time, never across a turn (a turn clears what the next one reads)
GGML_MOE_CACHE_FN int32_t ggml_moe_cache_clock_victim(const struct ggml_moe_cache_state * st, const uint8_t * pinned) {
    const int32_t n    = st->n_slots;
    const int32_t hand = *st->hand;
    for (int32_t turn = 0; turn < 2; turn++) {
        for (int32_t off = 0; off < n; off += GGML_MOE_CACHE_WINDOW) {
            const int32_t len = n - off < GGML_MOE_CACHE_WINDOW ? n - off : GGML_MOE_CACHE_WINDOW;
            uint32_t pin = 0;
            uint32_t ref = 0;
            for (int32_t k = 0; k < len; k++) {
                const int32_t s = (hand + off + k) % n;
                pin |= (uint32_t) (pinned[s] != 0) << k;
                ref |= (uint32_t) (st->ref[s] != 0) << k;
            }
            uint32_t clear = 0;
            const int32_t v = ggml_moe_cache_clock_window(pin, ref, len, &clear);
            for (int32_t k = 0; k < len; k++) {
                if (clear >> k & 1u) {
                    st->ref[(hand + off + k) % n] = 0;
                }
            }
            if (v >= 0) {
                const int32_t s = (hand + off + v) % n;
                *st->hand = s + 1 == n ? 0 : s + 1;
                return s;
            }
        }
    }
    *st->hand = hand + 1 == n ? 0 : hand + 1; // where 2 n + 1 steps of the hand would have left it
    return -1;
}

// The miss policy of a lookup is the most fills it may take (max_fills): GGML_MOE_CACHE_FILL_ALL (every miss that finds
// a slot: "upload"), 0 (none: every miss is cold, "cpu"), or N ("split:N": the first N misses in the lookup's order)
#define GGML_MOE_CACHE_FILL_ALL 0x7fffffff

// A lookup runs in three phases, so that a device can split the middle one, the only one that visits every slot, over
// its threads; ggml_moe_cache_lookup_slots runs them in turn, and a device that splits the middle one computes the same.
//
// Phase 1, ggml_moe_cache_lookup_begin (one thread): the routed ids checked, the slot ids zeroed and the cold ids set
// to -1 (what a refused lookup leaves), the distinct experts in order of first appearance (their marks set), a hand
// out of range taken as 0. Returns 0 to go on, else -2 (an id out of range): the state unchanged but for the hand, no
// mark set.
GGML_MOE_CACHE_FN int32_t ggml_moe_cache_lookup_begin(const struct ggml_moe_cache_state * st, struct ggml_moe_cache_scratch sc,
        const int32_t * ids, int64_t n_tokens, int32_t n_used, int64_t stride, int32_t * slot_ids, int32_t * cold_ids,
        int32_t * n_distinct_out) {
    uint8_t * seen = sc.marks;
    *n_distinct_out = 0;
    int bad_id = 0;
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int32_t j = 0; j < n_used; j++) {
            slot_ids[t * n_used + j] = 0;
            cold_ids[t * n_used + j] = -1;
            bad_id = bad_id || ids[t * stride + j] < 0 || ids[t * stride + j] >= st->n_expert;
        }
    }
    if (bad_id) {
        return -2;
    }
    if (st->n_slots > 0 && (*st->hand < 0 || *st->hand >= st->n_slots)) {
        *st->hand = 0;
    }
    int32_t n_distinct = 0;
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int32_t j = 0; j < n_used; j++) {
            const int32_t e = ids[t * stride + j];
            if (!seen[e]) {
                seen[e] = 1;
                sc.distinct[n_distinct++] = e;
            }
        }
    }
    *n_distinct_out = n_distinct;
    return 0;
}

// Phase 2 (any split of the slots over threads, reads only): the slots first, first + step, ... of the state's check;
// adds their free slots to *n_free and sets *bad where one holds an expert out of range, or an expert whose slot is
// another (two slots holding one expert: evicting one would lose the other)
GGML_MOE_CACHE_FN void ggml_moe_cache_check_slots(const struct ggml_moe_cache_state * st, int32_t first, int32_t step,
        int32_t * n_free, int32_t * bad) {
    int32_t nf = 0;
    int     b  = 0;
    for (int32_t s = first; s < st->n_slots; s += step) {
        const int32_t e = st->expert_of[s];
        nf += e < 0;
        b = b || e < -1 || e >= st->n_expert || (e >= 0 && st->slot_of[e] != s);
    }
    *n_free += nf;
    *bad    = *bad || b;
}

// Phase 3 (one thread but for the choice of each miss's slot): n_free and bad, the totals of phase 2 over every slot.
// ggml_moe_cache_lookup_hits: a state the lookup may trust (the free slots as counted, every slot's expert in range,
// every hit's slot holding it), checked before anything changes, then the hits referenced and pinned; returns the
// hits to go on, or -3 (an inconsistent state: nothing changed, the marks cleared). Then each distinct expert that
// missed, in order, while ggml_moe_cache_may_fill, takes the slot ggml_moe_cache_take_slot picks (its own if free,
// else the lowest free, else by CLOCK; a device may pick the same slot with all the threads of a warp), recorded by
// ggml_moe_cache_lookup_take; the others stay cold. Then ggml_moe_cache_lookup_finish: the slot and cold ids, the use
// counts, the marks cleared.
GGML_MOE_CACHE_FN int32_t ggml_moe_cache_lookup_hits(const struct ggml_moe_cache_state * st, struct ggml_moe_cache_scratch sc,
        int32_t n_distinct, int32_t n_free, int32_t bad) {
    uint8_t * seen   = sc.marks;
    uint8_t * pinned = sc.marks + st->n_expert;
    // every hit's slot holds it (then a miss that may fill always finds a free slot or a victim)
    for (int32_t i = 0; i < n_distinct; i++) {
        const int32_t s = st->slot_of[sc.distinct[i]];
        bad = bad || s < -1 || s >= st->n_slots || (s >= 0 && st->expert_of[s] != sc.distinct[i]);
    }
    if (bad || n_free != *st->n_free) {
        for (int32_t i = 0; i < n_distinct; i++) {
            seen[sc.distinct[i]] = 0;
        }
        return -3;
    }
    // hits first, so that no miss can take the slot of an expert this ubatch reads
    int32_t n_hits = 0;
    for (int32_t i = 0; i < n_distinct; i++) {
        const int32_t s = st->slot_of[sc.distinct[i]];
        if (s >= 0) {
            st->ref[s] = 1;
            pinned[s]  = 1;
            n_hits++;
        }
    }
    return n_hits;
}

// whether the next miss may take a slot: the policy allows another fill, and a slot is left that this lookup has not
// pinned (every hit and fill pins one), so that CLOCK always finds a victim
GGML_MOE_CACHE_FN int ggml_moe_cache_may_fill(const struct ggml_moe_cache_state * st, int32_t n_hits, int32_t n_fills,
        int32_t max_fills) {
    return n_fills < max_fills && n_hits + n_fills < st->n_slots;
}

GGML_MOE_CACHE_FN int32_t ggml_moe_cache_take_slot(const struct ggml_moe_cache_state * st, struct ggml_moe_cache_scratch sc,
        int32_t e) {
    return *st->n_free > 0 ? ggml_moe_cache_free_slot(st, e) : ggml_moe_cache_clock_victim(st, sc.marks + st->n_expert);
}

// expert e takes slot s: the fill recorded as the (*n_fills)-th
GGML_MOE_CACHE_FN void ggml_moe_cache_lookup_take(const struct ggml_moe_cache_state * st, struct ggml_moe_cache_scratch sc,
        int32_t e, int32_t s, int32_t * fill_expert, int32_t * fill_slot, int32_t * evicted, int32_t * n_fills) {
    const int32_t old = st->expert_of[s];
    if (old >= 0) {
        st->slot_of[old] = -1;
    } else {
        (*st->n_free)--;
    }
    st->expert_of[s] = e;
    st->slot_of[e]   = s;
    st->ref[s]       = 1;
    sc.marks[st->n_expert + s] = 1; // pinned
    fill_expert[*n_fills] = e;
    fill_slot[*n_fills]   = s;
    evicted[*n_fills]     = old;
    (*n_fills)++;
}

// the slot and cold ids of every routed id, the use counts (cold experts too: the profile counts routing, not hits);
// returns the distinct experts left cold
GGML_MOE_CACHE_FN int32_t ggml_moe_cache_lookup_finish(const struct ggml_moe_cache_state * st, struct ggml_moe_cache_scratch sc,
        const int32_t * ids, int64_t n_tokens, int32_t n_used, int64_t stride, int32_t n_distinct, int32_t * slot_ids,
        int32_t * cold_ids) {
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int32_t j = 0; j < n_used; j++) {
            const int32_t e = ids[t * stride + j];
            const int32_t s = st->slot_of[e];
            slot_ids[t * n_used + j] = s;
            cold_ids[t * n_used + j] = s < 0 ? e : -1;
        }
    }
    if (st->uses) {
        for (int32_t i = 0; i < n_distinct; i++) {
            int32_t * u = &st->uses[sc.distinct[i]];
            *u = *u < 0 ? 0 : *u + (*u < 0x7fffffff);
        }
    }
    int32_t n_cold = 0;
    for (int32_t i = 0; i < n_distinct; i++) {
        const int32_t s = st->slot_of[sc.distinct[i]];
        sc.marks[sc.distinct[i]] = 0; // seen
        if (s >= 0) {
            sc.marks[st->n_expert + s] = 0; // pinned
        } else {
            n_cold++;
        }
    }
    return n_cold;
}

// phase 3 on one thread: returns the fills, or -3
GGML_MOE_CACHE_FN int32_t ggml_moe_cache_lookup_end(const struct ggml_moe_cache_state * st, struct ggml_moe_cache_scratch sc,
        const int32_t * ids, int64_t n_tokens, int32_t n_used, int64_t stride, int32_t max_fills, int32_t n_distinct,
        int32_t n_free, int32_t bad, int32_t * slot_ids, int32_t * cold_ids, int32_t * fill_expert, int32_t * fill_slot,
        int32_t * evicted, int32_t * n_cold) {
    const int32_t n_hits = ggml_moe_cache_lookup_hits(st, sc, n_distinct, n_free, bad);
    if (n_hits < 0) {
        return -3;
    }
    int32_t n_fills = 0;
    for (int32_t i = 0; i < n_distinct && ggml_moe_cache_may_fill(st, n_hits, n_fills, max_fills); i++) {
        const int32_t e = sc.distinct[i];
        if (st->slot_of[e] < 0) {
            ggml_moe_cache_lookup_take(st, sc, e, ggml_moe_cache_take_slot(st, sc, e), fill_expert, fill_slot, evicted,
                    &n_fills);
        }
    }
    *n_cold = ggml_moe_cache_lookup_finish(st, sc, ids, n_tokens, n_used, stride, n_distinct, slot_ids, cold_ids);
    return n_fills;
}

// the distinct experts a lookup reports: none for bad input
GGML_MOE_CACHE_FN int32_t ggml_moe_cache_distinct_reported(int32_t res, int32_t n_distinct) {
    return res >= 0 ? n_distinct : 0;
}

// ids: routed expert of token t at ids[t * stride + j], j < n_used, each in [0, n_expert). Writes slot_ids and cold_ids
// [t * n_used + j] and, per fill in the order taken, fill_expert / fill_slot / evicted (the expert the slot held, -1:
// free), at most n_slots of them. Returns the fills, or -2 / -3 (see above): the state is unchanged, the slot ids all
// 0 and the cold ids -1. *n_cold: the distinct experts left cold. The three phases on one thread.
GGML_MOE_CACHE_FN int32_t ggml_moe_cache_lookup_slots(const struct ggml_moe_cache_state * st,
        struct ggml_moe_cache_scratch sc, const int32_t * ids, int64_t n_tokens, int32_t n_used, int64_t stride,
        int32_t max_fills, int32_t * slot_ids, int32_t * cold_ids, int32_t * fill_expert, int32_t * fill_slot,
        int32_t * evicted, int32_t * n_distinct_out, int32_t * n_cold) {
    int32_t n_distinct = 0;
    *n_cold = 0;
    int32_t res = ggml_moe_cache_lookup_begin(st, sc, ids, n_tokens, n_used, stride, slot_ids, cold_ids, &n_distinct);
    if (res == 0) {
        int32_t n_free = 0;
        int32_t bad    = 0;
        ggml_moe_cache_check_slots(st, 0, 1, &n_free, &bad);
        res = ggml_moe_cache_lookup_end(st, sc, ids, n_tokens, n_used, stride, max_fills, n_distinct, n_free, bad,
                slot_ids, cold_ids, fill_expert, fill_slot, evicted, n_cold);
    }
    *n_distinct_out = ggml_moe_cache_distinct_reported(res, n_distinct);
    return res;
}

// what a lookup leaves besides the ids and fills: its result, distinct and cold experts in the tail, what it counts,
// and a refusal in the status word; n_distinct as ggml_moe_cache_lookup_slots reports it
GGML_MOE_CACHE_FN void ggml_moe_cache_lookup_record(const struct ggml_moe_cache_state * st, int32_t * tail, int32_t res,
        int32_t n_distinct, int32_t n_cold) {
    const struct ggml_moe_cache_tail_layout d = ggml_moe_cache_tail_layout_of(st->n_slots);
    tail[d.result]     = res;
    tail[d.n_distinct] = n_distinct;
    tail[d.n_cold]     = res >= 0 ? n_cold : 0;
    if (st->counters) {
        if (res >= 0) {
            int32_t n_evicted = 0;
            for (int32_t i = 0; i < res; i++) {
                n_evicted += tail[d.evicted + i] >= 0;
            }
            ggml_moe_cache_counter_add(st->counters, GGML_MOE_CACHE_COUNT_LOOKUPS, 1);
            ggml_moe_cache_counter_add(st->counters, GGML_MOE_CACHE_COUNT_HITS, (uint64_t) (n_distinct - res - n_cold));
            ggml_moe_cache_counter_add(st->counters, GGML_MOE_CACHE_COUNT_MISSES, (uint64_t) res);
            ggml_moe_cache_counter_add(st->counters, GGML_MOE_CACHE_COUNT_EVICTIONS, (uint64_t) n_evicted);
            ggml_moe_cache_counter_add(st->counters, GGML_MOE_CACHE_COUNT_COLD, (uint64_t) n_cold);
        } else {
            ggml_moe_cache_counter_add(st->counters, GGML_MOE_CACHE_COUNT_REFUSED, 1);
        }
    }
    if (st->status && res < 0) {
        *st->status += *st->status < 0x7fffffff;
    }
}

// the lookup into the op's tensor: the ids (slot ids, then cold ids) and the tail as above; the tail's fill entries
// must be -1 on entry (the lookup writes only the fills it takes), so that a device can set them with all its threads
GGML_MOE_CACHE_FN int32_t ggml_moe_cache_lookup_to_dst(const struct ggml_moe_cache_state * st,
        struct ggml_moe_cache_scratch sc, const int32_t * ids, int64_t n_tokens, int32_t n_used, int64_t stride,
        int32_t max_fills, int32_t * out_ids, int32_t * tail) {
    const struct ggml_moe_cache_tail_layout d = ggml_moe_cache_tail_layout_of(st->n_slots);
    int32_t n_distinct = 0;
    int32_t n_cold     = 0;
    const int32_t res = ggml_moe_cache_lookup_slots(st, sc, ids, n_tokens, n_used, stride, max_fills, out_ids,
            out_ids + n_tokens * n_used, tail + d.fill_expert, tail + d.fill_slot, tail + d.evicted, &n_distinct, &n_cold);
    ggml_moe_cache_lookup_record(st, tail, res, n_distinct, n_cold);
    return res;
}

// GGML_OP_MOE_CACHE_FILL (ggml.h) copies the fills a lookup took from the host experts (its src[1], read where they
// are) into their slots of one bank. Its op params: the bank's slots, the dimension that counts the experts (the last
// of the bank: 2 for a weight, 1 for a bias), a debug plant (skip_first: the first fill of every lookup is left out,
// so its slot keeps stale bytes, which the identity cells must catch), and where the lookup's tail sits in its tensor
// and the most fills it may take (min(routed ids, slots)), so that the fill reads nothing of its source's op params.
struct ggml_moe_cache_fill_params {
    int32_t n_slots;
    int32_t expert_dim;
    int32_t skip_first;
    int32_t tail;
    int32_t max_fills;
};

GGML_MOE_CACHE_FN void ggml_moe_cache_fill_params_set(int32_t * op_params, struct ggml_moe_cache_fill_params p) {
    op_params[0] = p.n_slots;
    op_params[1] = p.expert_dim;
    op_params[2] = p.skip_first;
    op_params[3] = p.tail;
    op_params[4] = p.max_fills;
}

GGML_MOE_CACHE_FN struct ggml_moe_cache_fill_params ggml_moe_cache_fill_params_of(const int32_t * op_params) {
    struct ggml_moe_cache_fill_params p;
    p.n_slots    = op_params[0];
    p.expert_dim = op_params[1];
    p.skip_first = op_params[2];
    p.tail       = op_params[3];
    p.max_fills  = op_params[4];
    return p;
}

#ifdef __cplusplus
}
#endif
