// llama-moe-cache.h (internal): the host-side bookkeeping of the MoE expert cache (pyllama_moe).
//
// Free device memory holds banks of expert slots for the MoE layers whose experts are on the host. This module
// decides which experts are resident and which bytes must move; it never touches a tensor, a backend or the
// scheduler, so it compiles and is tested on its own (tests/native/test_moe_cache.cpp). The graph reads the banks
// through the remapped ids of a decode plan; the scheduler issues the copies a plan lists (see "Callers" below).
//
// Sizing (llama_moe_cache_size_banks): every cached layer gets the same number of slots, capped at its n_expert;
// what is left after the equal shares goes one slot at a time in layer order. Each MoE layer is read once per
// token and the layers of a model route alike, so their hit-rate curves over slots are the same concave curve: a
// uniform share maximises the worst layer's hit rate and, because a slot and a miss of a layer both cost that
// layer's expert bytes, also the bytes saved overall. Dense layers (no experts) are skipped; a budget that cannot
// give every MoE layer min_slots gives no layer a cache (a partial cover would favour the first layers) and says why.
// Banks are per device: size each device's layers against that device's budget.
//
// Decode (plan_decode, which runs the lookup of ggml-moe-cache-lookup.h on the layer's slot state, the lookup the
// device op will run on the same state): CLOCK over the slots of a layer. A hit sets the slot's reference bit; a miss takes a free
// slot (its own, slot e for expert e, where that one is free), else the first slot under the hand whose bit is
// clear, clearing bits as it passes; slots that the same ubatch uses are never taken. A ubatch with more distinct experts in a layer than the layer has slots changes
// nothing and says so: the caller takes the staging path for that layer.
//
// Prompts (plan_prompt, or prompt_stage then prompt_admit): a large ubatch routes to nearly every expert, so LRU
// or CLOCK would replace the whole set every ubatch and send every expert again. The resident set is kept stable
// instead: residents stay; misses go to staging for this ubatch and fill free slots, highest score first; a
// resident is replaced only when this ubatch does not route it and a miss's score (routed tokens, halved every
// prompt ubatch, with or without its routing) is more than twice its own. A prompt whose experts fit in the slots
// uploads each expert once.
//
// Seeding (seed): the last large ubatch of a prompt staged every expert of each cached layer, so any of them can be
// copied into a slot on the device without crossing PCIe again. Its routed tokens are added to the scores (which
// its prompt_admit halved), and the experts of the highest scores, as many as there are slots,
// become the resident set: residents in it stay, the others are replaced, free slots first; only the higher-scored
// half of the set keeps its reference bit, so decode's first evictions take the rest. The first decode tokens
// then find what the end of the prompt routed to, where the admits without routing kept the experts that happened
// to come first.
//
// Whole layers (whole): free slots are taken own slot first, so a layer with a slot per expert holds expert e in
// slot e and never evicts; once all its experts are resident it needs no plan at all: the graph reads its banks in
// place, as it would the host tensors, at any ubatch size (note_in_place counts those steps).
//
// Callers (the later graph and scheduler hooks): a decode plan's fills are uploads host -> bank slot, to be done
// before the layer's matmuls read slot_ids; a prompt plan's reads (bank -> staging) come before its admits
// (staging -> bank, after the upload of that expert has landed), in queue order.
#pragma once

#include "ggml-moe-cache-lookup.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

// one layer of the model, as the cache sizes it
struct llama_moe_cache_layer_desc {
    int32_t il;             // layer index in the model
    int32_t n_expert;       // 0: a dense layer, or one whose experts are not on the host (skipped)
    size_t  expert_bytes;   // one expert over all of the layer's expert tensors: gate, up, down (or fused gate_up),
                            // and the device copies of its per-expert biases and scales
    size_t  overhead_bytes; // what a cached layer needs besides its slots (device slot map, lookup state)
    int32_t n_tensors;      // expert tensors of the layer: a contiguous run of experts costs one copy per tensor
};

struct llama_moe_cache_sizing {
    std::vector<int32_t> n_slots; // per desc, in the order given; 0: not cached
    std::vector<size_t>  bytes;   // per desc: its slots and overhead, 0 when not cached (for the memory breakdown)
    size_t      budget     = 0;
    size_t      bytes_used = 0;   // slots and overheads of the cached layers, <= budget
    int32_t     n_layers   = 0;   // layers with slots
    std::string reason;           // why no layer has a cache; empty when they all have one
};

// min_slots: the fewest slots worth a layer's overhead (the caller may pass n_expert_used: with fewer slots a
// single token's experts do not fit and every decode step of the layer takes the staging path)
llama_moe_cache_sizing llama_moe_cache_size_banks(size_t budget, const std::vector<llama_moe_cache_layer_desc> & layers,
        int32_t min_slots = 1);

enum llama_moe_cache_phase {
    LLAMA_MOE_CACHE_PHASE_PROMPT = 0,
    LLAMA_MOE_CACHE_PHASE_DECODE = 1,
    LLAMA_MOE_CACHE_PHASE_COUNT,
};

// per layer and phase; experts are counted once per ubatch (distinct), bytes over all of the layer's tensors
struct llama_moe_cache_stats {
    uint64_t n_ubatches     = 0;
    uint64_t n_hits         = 0; // decode: routed experts found resident; prompt: experts read from the bank
    uint64_t n_misses       = 0; // experts uploaded from the host (decode overflow included)
    uint64_t n_cold         = 0; // decode: misses computed on the CPU (hot/cold: the policy's, and past the slots)
    uint64_t n_overflow     = 0; // decode ubatches with more distinct experts than slots (staging path)
    uint64_t n_fills        = 0; // experts made resident (decode fills, prompt admits)
    uint64_t n_evictions    = 0; // ... of them, into a slot that held another expert
    uint64_t bytes_uploaded = 0; // host -> device
    uint64_t bytes_copied   = 0; // device -> device (bank -> staging reads, staging -> bank admits)
    uint64_t n_copy_calls   = 0; // copies of the per-copy path: one per contiguous run and tensor
    uint64_t n_in_place     = 0; // steps of a whole layer, read in place: no plan, no routing read back
    uint64_t n_routed_in_place = 0; // ... the expert ids they routed, all resident (n_tokens x n_used a step)
    uint64_t n_seeded       = 0; // experts made resident by a prompt's seeding (prompt phase; also in n_fills)

    void add(const llama_moe_cache_stats & o);
};

// an expert in a slot
struct llama_moe_cache_fill {
    int32_t expert;
    int32_t slot;
};

struct llama_moe_cache_decode_plan {
    bool    overflow   = false;
    int32_t n_distinct = 0;
    std::vector<int32_t> slot_ids;            // [n_tokens * n_used], token-major; always in [0, n_slots), all 0
                                              // on overflow (the graph may read them before it knows: ggml's
                                              // MUL_MAT_ID has no sentinel id)
    std::vector<int32_t> cold_ids;            // [n_tokens * n_used]: the lookup's cold ids (all -1: a plan fills
                                              // every miss)
    std::vector<llama_moe_cache_fill> fills;  // host -> bank uploads, before the matmuls read slot_ids
};

struct llama_moe_cache_prompt_plan {
    std::vector<llama_moe_cache_fill> reads;  // resident experts: bank slot -> staging
    std::vector<int32_t>              uploads; // the other staged experts: host -> staging
    std::vector<llama_moe_cache_fill> admits; // uploads that become resident: staging -> bank, after the reads
    std::vector<int32_t>              evicted; // per admit, the expert its slot held (-1: the slot was free)
};

// one cached layer
struct llama_moe_cache_layer {
    int32_t il;
    int32_t n_expert;
    int32_t n_slots;
    int32_t n_tensors;
    size_t  expert_bytes;

    // the slot state, as ggml-moe-cache-lookup.h reads it (the device lookup keeps the same state)
    std::vector<int32_t> slot_of;   // [n_expert] slot or -1
    std::vector<int32_t> expert_of; // [n_slots] expert or -1 (free)
    std::vector<int32_t> ref;       // [n_slots] CLOCK reference bits
    int32_t hand   = 0;
    int32_t n_free = 0;

    std::vector<uint32_t> score;    // [n_expert] prompt routing, halved every prompt ubatch

    // the expert cache profile: how often this context routed to each expert, saturating at INT32_MAX.
    // uses: decode lookups that planned, each distinct expert once per lookup (the lookup of ggml-moe-cache-lookup.h
    // counts them, here and on a device alike: they travel with the flat state); prompt_uses: the routed tokens of
    // the ubatches that seeded the layer (the only prompt routing read back). Neither counts steps on the staging
    // path or read in place (no routing is read there), and clear() keeps them
    std::vector<int32_t> uses;        // [n_expert]
    std::vector<int32_t> prompt_uses; // [n_expert]

    llama_moe_cache_stats stats[LLAMA_MOE_CACHE_PHASE_COUNT];

    // per-ubatch marks: a value equal to the current epoch means "this ubatch", so nothing is cleared per call
    std::vector<uint32_t> seen; // [n_expert]
    std::vector<uint32_t> pin;  // [n_slots]
    std::vector<uint32_t> cnt;  // [n_expert] routed tokens of the current prompt ubatch
    uint32_t epoch = 0;

    // the decode lookup's scratch (ggml_moe_cache_scratch) and fills, reused
    std::vector<uint8_t> marks;     // [n_expert + n_slots], zero between lookups
    std::vector<int32_t> distinct;  // [n_slots]
    std::vector<int32_t> fill_expert, fill_slot, fill_evicted; // [n_slots]
};

// Not thread-safe: one per context, planned from the thread that computes its graphs.
struct llama_moe_cache {
    llama_moe_cache(const std::vector<llama_moe_cache_layer_desc> & layers, const llama_moe_cache_sizing & sizing);

    // nullptr: layer il has no cache
    const llama_moe_cache_layer * layer(int32_t il) const;
    int32_t n_layers() const { return (int32_t) layers.size(); }

    // ids: routed experts of token t at ids[t * stride + j], j < n_used, each in [0, n_expert).
    // Returns false on overflow (nothing changed but the stats).
    // max_fills: the miss policy (ggml-moe-cache-lookup.h); a hot/cold plan (cold) leaves the misses past it, or past
    // the slots, cold (their slot id -1, in cold_ids) instead of taking the staging path
    bool plan_decode(int32_t il, const int32_t * ids, int64_t n_tokens, int32_t n_used, int64_t stride,
            llama_moe_cache_decode_plan & out, int32_t max_fills = GGML_MOE_CACHE_FILL_ALL, bool cold = false);

    // A prompt ubatch in two steps, because an upload issued ahead of the split (stage_all: the ubatch stages every
    // expert of the layer) cannot wait for the router: prompt_stage lists reads and uploads from the residents
    // alone (ids may be null with stage_all; else only the routed experts are staged); prompt_admit, once the
    // routing is known, updates the scores and picks the admits among out.uploads. Nothing else may plan the layer
    // in between. plan_prompt does both. prompt_admit with ids null (the routing unknown): uploads take free slots in
    // expert order, nothing is replaced.
    void prompt_stage(int32_t il, const int32_t * ids, int64_t n_tokens, int32_t n_used, int64_t stride, bool stage_all,
            llama_moe_cache_prompt_plan & out);
    void prompt_admit(int32_t il, const int32_t * ids, int64_t n_tokens, int32_t n_used, int64_t stride,
            llama_moe_cache_prompt_plan & out);
    void plan_prompt(int32_t il, const int32_t * ids, int64_t n_tokens, int32_t n_used, int64_t stride, bool stage_all,
            llama_moe_cache_prompt_plan & out);

    // the seeding of layer il by a ubatch that staged all of its experts (see "Seeding" above): fills lists the copies
    // staged copy -> slot, sorted by slot, that make the new resident set. Counted in the prompt phase (n_seeded,
    // n_fills, n_evictions; the bytes and calls are the caller's). In a layer with a slot per expert each expert takes its
    // own slot, which is free while it is not resident: such a layer never evicts. Each fill counts for
    // debug_skip_fill as any other.
    void seed(int32_t il, const int32_t * ids, int64_t n_tokens, int32_t n_used, int64_t stride,
            std::vector<llama_moe_cache_fill> & fills);

    // takes back the admits of an unrouted prompt_admit, or the fills of a seed, whose bytes did not all reach their
    // slots (only part of the layer's tensors was staged, or the computation stopped): each slot that still holds its
    // fill's expert is free again (a seed may have replaced an admit of the same graph: that one is the seed's to take
    // back); seeded: the fills are a seed's (n_seeded counts them no more)
    void unadmit(int32_t il, const std::vector<llama_moe_cache_fill> & fills, bool seeded = false);

    // every expert of layer il is resident, each in its own slot (a layer with a slot per expert places them so):
    // its banks are the images of its host tensors, and a graph of any size may read them as the expert tensors
    bool whole(int32_t il) const;
    // makes a layer with a slot per expert whole at once: every expert that is not resident takes its own slot (free:
    // such a layer never places an expert elsewhere). fills lists the uploads (host -> slot e, expert order) the
    // caller must make before a graph reads the layer; false, nothing changed, where the layer has fewer slots than
    // experts or a slot holds another expert. Counted in no phase's stats: it is not a step of a graph.
    bool fill_whole(int32_t il, std::vector<llama_moe_cache_fill> & fills);
    // the expert cache profile: makes `experts` (in order, distinct, at most the free slots are taken) resident in
    // layer il's free slots, own slot first; fills lists the uploads (host -> slot, sorted by slot) the caller must make
    // before a graph reads the layer. Counted in no phase's stats (not a step of a graph); each fill counts for
    // debug_skip_fill as any other. Returns the experts made resident.
    int32_t preload(int32_t il, const std::vector<int32_t> & experts, std::vector<llama_moe_cache_fill> & fills);
    // a step of a whole layer read in place: counted as a step of the phase, nothing planned
    void note_in_place(int32_t il, llama_moe_cache_phase phase, uint64_t n_routed);

    // a decode ubatch the caller sent to the staging path without planning it (its graph could not promise that the
    // experts fit the slots): counted as a step and an overflow; its routing is not read (that would cost a device
    // synchronization per layer), and its uploads are the scheduler's, not counted here
    void note_staging(int32_t il);

    // the device lookup's handover (llama-moe-cache-rt.h): layer il's slot state in the flat layout of
    // ggml-moe-cache-lookup.h, its counters zero, its use counts the planner's; and back, once a device looked the
    // layer up (false, nothing changed, where the state is inconsistent; why names the first violation). set_uses
    // takes a device's use counts alone (the counted tail read back without a handover: the device keeps counting
    // from them, so they are totals, not increments)
    void get_state(int32_t il, int32_t * flat) const;
    bool set_state(int32_t il, const int32_t * flat, std::string & why);
    void set_uses(int32_t il, const int32_t * uses);

    // il < 0: the sum over layers
    llama_moe_cache_stats get_stats(int32_t il, llama_moe_cache_phase phase) const;
    void reset_stats();

    // forget every resident (e.g. after the host weights changed), or those of the layers that are not whole
    // (keep_whole); stats are kept
    void clear(bool keep_whole = false);
    // layer il's slots all free, its CLOCK hand at 0 (its scores, use counts and stats are kept): a layer whose
    // device state can no longer be trusted starts afresh
    void empty(int32_t il);

    // slot_of and expert_of agree, counts are consistent; why names the first violation
    bool check(std::string & why) const;

    // debug: the n-th fill since creation (counted from 1 over both planners; 0 off) is recorded in the slot map but
    // left out of the plan, so the slot keeps its old bytes and a hit reads a stale expert. A planted fault: the
    // identity cells must catch it.
    uint64_t debug_skip_fill = 0;
    uint64_t n_fills_planned = 0;

    std::vector<llama_moe_cache_layer> layers;
    std::vector<int32_t> layer_index; // [max il + 1] index into layers, or -1

    std::vector<int32_t> scratch; // reused by the planners across calls
};
