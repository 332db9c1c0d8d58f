// llama-moe-cache.cpp: the host-side bookkeeping of the MoE expert cache; see llama-moe-cache.h for the rules.
#include "llama-moe-cache.h"

#include "ggml-moe-cache-lookup.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <utility>

// no GGML_ASSERT: the module must build without ggml, for its standalone test
#define MOE_CACHE_ASSERT(x)                                                                   \
    do {                                                                                      \
        if (!(x)) {                                                                           \
            fprintf(stderr, "%s:%d: llama_moe_cache: assertion failed: %s\n", __FILE__, __LINE__, #x); \
            abort();                                                                          \
        }                                                                                     \
    } while (0)

static double mib(size_t bytes) {
    return bytes / (1024.0 * 1024.0);
}

llama_moe_cache_sizing llama_moe_cache_size_banks(size_t budget, const std::vector<llama_moe_cache_layer_desc> & layers,
        int32_t min_slots) {
    llama_moe_cache_sizing r;
    r.budget = budget;
    r.n_slots.assign(layers.size(), 0);
    r.bytes.assign(layers.size(), 0);

    std::vector<size_t> host;
    size_t need = 0;
    for (size_t i = 0; i < layers.size(); i++) {
        const llama_moe_cache_layer_desc & l = layers[i];
        if (l.n_expert > 0 && l.expert_bytes > 0) {
            host.push_back(i);
            need += l.overhead_bytes + (size_t) std::min(std::max(min_slots, 1), l.n_expert) * l.expert_bytes;
        }
    }
    if (host.empty()) {
        r.reason = "no MoE layer has its experts on the host";
        return r;
    }
    if (need > budget) {
        char buf[256];
        snprintf(buf, sizeof(buf), "a budget of %.2f MiB is below %d slot%s in each of the %zu MoE layers (%.2f MiB)",
                mib(budget), std::max(min_slots, 1), min_slots > 1 ? "s" : "", host.size(), mib(need));
        r.reason = buf;
        return r;
    }

    // water-filling, one slot per layer and pass: the equal share, then the remainder in layer order; a layer
    // whose next slot does not fit is passed over, so smaller experts of later layers may still use the rest
    size_t used = need;
    for (size_t i : host) {
        r.n_slots[i] = std::min(std::max(min_slots, 1), layers[i].n_expert);
    }
    for (bool grew = true; grew; ) {
        grew = false;
        for (size_t i : host) {
            if (r.n_slots[i] < layers[i].n_expert && used + layers[i].expert_bytes <= budget) {
                r.n_slots[i]++;
                used += layers[i].expert_bytes;
                grew = true;
            }
        }
    }
    for (size_t i : host) {
        r.bytes[i] = layers[i].overhead_bytes + (size_t) r.n_slots[i] * layers[i].expert_bytes;
    }
    r.bytes_used = used;
    r.n_layers   = (int32_t) host.size();
    return r;
}

void llama_moe_cache_stats::add(const llama_moe_cache_stats & o) {
    n_ubatches     += o.n_ubatches;
    n_hits         += o.n_hits;
    n_misses       += o.n_misses;
    n_cold         += o.n_cold;
    n_overflow     += o.n_overflow;
    n_fills        += o.n_fills;
    n_evictions    += o.n_evictions;
    bytes_uploaded += o.bytes_uploaded;
    bytes_copied   += o.bytes_copied;
    n_copy_calls   += o.n_copy_calls;
    n_in_place     += o.n_in_place;
    n_routed_in_place += o.n_routed_in_place;
    n_seeded       += o.n_seeded;
}

// copies of the per-copy path: runs of consecutive experts (and, with slots, consecutive slots), per tensor
static uint64_t n_runs(const std::vector<int32_t> & experts) {
    uint64_t n = 0;
    for (size_t i = 0; i < experts.size(); i++) {
        n += i == 0 || experts[i] != experts[i - 1] + 1;
    }
    return n;
}

static uint64_t n_runs(const std::vector<llama_moe_cache_fill> & fills) {
    uint64_t n = 0;
    for (size_t i = 0; i < fills.size(); i++) {
        n += i == 0 || fills[i].expert != fills[i - 1].expert + 1 || fills[i].slot != fills[i - 1].slot + 1;
    }
    return n;
}

llama_moe_cache::llama_moe_cache(const std::vector<llama_moe_cache_layer_desc> & descs, const llama_moe_cache_sizing & sizing) {
    MOE_CACHE_ASSERT(sizing.n_slots.size() == descs.size());
    int32_t max_il = -1;
    for (size_t i = 0; i < descs.size(); i++) {
        if (sizing.n_slots[i] <= 0) {
            continue;
        }
        const llama_moe_cache_layer_desc & d = descs[i];
        MOE_CACHE_ASSERT(d.il >= 0 && sizing.n_slots[i] <= d.n_expert);
        llama_moe_cache_layer l;
        l.il           = d.il;
        l.n_expert     = d.n_expert;
        l.n_slots      = sizing.n_slots[i];
        l.n_tensors    = std::max(d.n_tensors, 1);
        l.expert_bytes = d.expert_bytes;
        l.slot_of.assign(l.n_expert, -1);
        l.expert_of.assign(l.n_slots, -1);
        l.ref.assign(l.n_slots, 0);
        l.n_free = l.n_slots;
        l.marks.assign(l.n_expert + l.n_slots, 0);
        l.distinct.assign(l.n_expert, 0);
        l.fill_expert.assign(l.n_slots, 0);
        l.fill_slot.assign(l.n_slots, 0);
        l.fill_evicted.assign(l.n_slots, 0);
        l.score.assign(l.n_expert, 0);
        l.seen.assign(l.n_expert, 0);
        l.pin.assign(l.n_slots, 0);
        l.cnt.assign(l.n_expert, 0);
        l.uses.assign(l.n_expert, 0);
        l.prompt_uses.assign(l.n_expert, 0);
        layers.push_back(std::move(l));
        max_il = std::max(max_il, d.il);
    }
    layer_index.assign(max_il + 1, -1);
    for (size_t i = 0; i < layers.size(); i++) {
        MOE_CACHE_ASSERT(layer_index[layers[i].il] < 0);
        layer_index[layers[i].il] = (int32_t) i;
    }
}

const llama_moe_cache_layer * llama_moe_cache::layer(int32_t il) const {
    if (il < 0 || il >= (int32_t) layer_index.size() || layer_index[il] < 0) {
        return nullptr;
    }
    return &layers[layer_index[il]];
}

// a new epoch for the per-ubatch marks; on wrap the marks are cleared so that an old mark never reads as current
static void next_epoch(llama_moe_cache_layer & l) {
    if (++l.epoch == 0) {
        std::fill(l.seen.begin(), l.seen.end(), 0);
        std::fill(l.pin.begin(), l.pin.end(), 0);
        l.epoch = 1;
    }
}

// puts expert e into slot s (evicting its expert) and returns whether the fill goes into the plan
static bool assign(llama_moe_cache & c, llama_moe_cache_layer & l, int32_t e, int32_t s, llama_moe_cache_stats & st) {
    const int32_t old = l.expert_of[s];
    if (old >= 0) {
        l.slot_of[old] = -1;
        st.n_evictions++;
    } else {
        l.n_free--;
    }
    l.expert_of[s] = e;
    l.slot_of[e]   = s;
    l.ref[s]       = 1;
    st.n_fills++;
    return ++c.n_fills_planned != c.debug_skip_fill;
}

// the layer's slot state as the lookup of ggml-moe-cache-lookup.h reads and writes it
static ggml_moe_cache_state state_of(llama_moe_cache_layer & l) {
    return { l.n_expert, l.n_slots, l.slot_of.data(), l.expert_of.data(), l.ref.data(), &l.hand, &l.n_free, nullptr,
             l.uses.data() };
}

// expert e's own slot when it is free, else the lowest free slot (ggml_moe_cache_free_slot); only while n_free > 0.
// In a layer with a slot per expert, every expert so placed keeps its own slot (nothing is evicted while a slot is
// free, and the slot of an expert that is not resident is free), so once all are resident the bank is the image of
// the host tensor and the graph may read it in place (whole)
static int32_t free_slot(llama_moe_cache_layer & l, int32_t e) {
    const ggml_moe_cache_state st = state_of(l);
    const int32_t s = ggml_moe_cache_free_slot(&st, e);
    MOE_CACHE_ASSERT(s >= 0);
    return s;
}

static llama_moe_cache_layer & layer_of(llama_moe_cache & c, int32_t il) {
    MOE_CACHE_ASSERT(il >= 0 && il < (int32_t) c.layer_index.size() && c.layer_index[il] >= 0);
    return c.layers[c.layer_index[il]];
}

static int32_t routed(const llama_moe_cache_layer & l, const int32_t * ids, int64_t t, int32_t j, int64_t stride) {
    const int32_t e = ids[t * stride + j];
    MOE_CACHE_ASSERT(e >= 0 && e < l.n_expert);
    return e;
}

// the distinct experts of a ubatch in order of first appearance, marked seen in a new epoch of the layer
static void distinct_experts(llama_moe_cache_layer & l, const int32_t * ids, int64_t n_tokens, int32_t n_used, int64_t stride,
        std::vector<int32_t> & out) {
    next_epoch(l);
    out.clear();
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int32_t j = 0; j < n_used; j++) {
            const int32_t e = routed(l, ids, t, j, stride);
            if (l.seen[e] != l.epoch) {
                l.seen[e] = l.epoch;
                out.push_back(e);
            }
        }
    }
}

// the staging path uploads the routed experts (in runs of consecutive ids): misses all of them
static void count_staging(const llama_moe_cache_layer & l, const std::vector<int32_t> & distinct, llama_moe_cache_stats & st) {
    std::vector<int32_t> sorted = distinct;
    std::sort(sorted.begin(), sorted.end());
    st.n_overflow++;
    st.n_misses       += sorted.size();
    st.bytes_uploaded += sorted.size() * l.expert_bytes;
    st.n_copy_calls   += n_runs(sorted) * l.n_tensors;
}

bool llama_moe_cache::whole(int32_t il) const {
    const llama_moe_cache_layer * l = layer(il);
    if (l == nullptr || l->n_slots != l->n_expert || l->n_free != 0) {
        return false;
    }
    for (int32_t e = 0; e < l->n_expert; e++) {
        MOE_CACHE_ASSERT(l->slot_of[e] == e && "a layer with a slot per expert keeps each expert in its own slot");
    }
    return true;
}

bool llama_moe_cache::fill_whole(int32_t il, std::vector<llama_moe_cache_fill> & fills) {
    fills.clear();
    llama_moe_cache_layer & l = layer_of(*this, il);
    if (l.n_slots != l.n_expert) {
        return false;
    }
    for (int32_t e = 0; e < l.n_expert; e++) {
        if (l.slot_of[e] != e && !(l.slot_of[e] < 0 && l.expert_of[e] < 0)) {
            return false;
        }
    }
    llama_moe_cache_stats uncounted;
    for (int32_t e = 0; e < l.n_expert; e++) {
        // debug: the planted stale slot of the other planners, here too (the slot is recorded, its upload left out)
        if (l.slot_of[e] < 0 && assign(*this, l, e, e, uncounted)) {
            fills.push_back({ e, e });
        }
    }
    return true;
}

int32_t llama_moe_cache::preload(int32_t il, const std::vector<int32_t> & experts, std::vector<llama_moe_cache_fill> & fills) {
    fills.clear();
    llama_moe_cache_layer & l = layer_of(*this, il);
    llama_moe_cache_stats uncounted;
    int32_t n = 0;
    for (int32_t e : experts) {
        MOE_CACHE_ASSERT(e >= 0 && e < l.n_expert);
        if (l.n_free == 0) {
            break;
        }
        if (l.slot_of[e] >= 0) {
            continue;
        }
        const int32_t s = free_slot(l, e);
        n++;
        // debug: the planted stale slot of the other planners, here too (the slot is recorded, its upload left out)
        if (assign(*this, l, e, s, uncounted)) {
            fills.push_back({ e, s });
        }
    }
    std::sort(fills.begin(), fills.end(), [](const llama_moe_cache_fill & a, const llama_moe_cache_fill & b) {
        return a.slot < b.slot;
    });
    return n;
}

void llama_moe_cache::note_in_place(int32_t il, llama_moe_cache_phase phase, uint64_t n_routed) {
    MOE_CACHE_ASSERT(phase >= 0 && phase < LLAMA_MOE_CACHE_PHASE_COUNT);
    llama_moe_cache_stats & st = layer_of(*this, il).stats[phase];
    st.n_ubatches++;
    st.n_in_place++;
    st.n_routed_in_place += n_routed;
}

void llama_moe_cache::note_staging(int32_t il) {
    llama_moe_cache_stats & st = layer_of(*this, il).stats[LLAMA_MOE_CACHE_PHASE_DECODE];
    st.n_ubatches++;
    st.n_overflow++;
}

bool llama_moe_cache::plan_decode(int32_t il, const int32_t * ids, int64_t n_tokens, int32_t n_used, int64_t stride,
        llama_moe_cache_decode_plan & out, int32_t max_fills, bool cold) {
    llama_moe_cache_layer & l = layer_of(*this, il);
    llama_moe_cache_stats & st = l.stats[LLAMA_MOE_CACHE_PHASE_DECODE];
    out.overflow = false;
    out.slot_ids.assign((size_t) (n_tokens * n_used), 0);
    out.cold_ids.assign((size_t) (n_tokens * n_used), -1);
    out.fills.clear();
    st.n_ubatches++;

    // without cold misses the graph reads the banks only where every expert fits the slots: more distinct experts
    // than slots take the staging path here (a hot/cold plan computes the rest cold instead). Counted only where the
    // routed ids outnumber the slots, which a graph of the banks alone never does
    if (!cold && n_tokens * n_used > l.n_slots) {
        std::vector<int32_t> & distinct = scratch;
        distinct_experts(l, ids, n_tokens, n_used, stride, distinct);
        if ((int64_t) distinct.size() > l.n_slots) {
            out.overflow   = true;
            out.n_distinct = (int32_t) distinct.size();
            count_staging(l, distinct, st);
            return false;
        }
    }

    // the lookup the device runs (ggml-moe-cache-lookup.h): the plan depends on the routing only, never on addresses
    const ggml_moe_cache_state state = state_of(l);
    int32_t n_distinct = 0;
    int32_t n_cold     = 0;
    const int32_t n_missed = ggml_moe_cache_lookup_slots(&state, { l.marks.data(), l.distinct.data() }, ids, n_tokens, n_used,
            stride, cold ? max_fills : GGML_MOE_CACHE_FILL_ALL, out.slot_ids.data(), out.cold_ids.data(), l.fill_expert.data(),
            l.fill_slot.data(), l.fill_evicted.data(), &n_distinct, &n_cold);
    out.n_distinct = n_distinct;
    // -2: an id out of range (a caller's bug); -3 cannot be, the state is the planner's own
    MOE_CACHE_ASSERT(n_missed >= 0 && (cold || n_cold == 0) && "routed ids in [0, n_expert), a consistent slot state");
    st.n_hits   += n_distinct - n_missed - n_cold;
    st.n_misses += n_missed;
    st.n_cold   += n_cold;
    for (int32_t i = 0; i < n_missed; i++) {
        st.n_evictions += l.fill_evicted[i] >= 0;
        st.n_fills++;
        // debug: the n-th fill is recorded in the slot state but left out of the plan (a planted stale slot)
        if (++n_fills_planned != debug_skip_fill) {
            out.fills.push_back({ l.fill_expert[i], l.fill_slot[i] });
        }
    }

    // one upload per fill: sorted by slot, runs of consecutive experts into consecutive slots are one copy
    std::vector<llama_moe_cache_fill> by_slot = out.fills;
    std::sort(by_slot.begin(), by_slot.end(), [](const llama_moe_cache_fill & a, const llama_moe_cache_fill & b) {
        return a.slot < b.slot;
    });
    st.bytes_uploaded += out.fills.size() * l.expert_bytes;
    st.n_copy_calls   += n_runs(by_slot) * l.n_tensors;
    return true;
}

// routed tokens per expert of this ubatch into l.cnt
static void count_routed(llama_moe_cache_layer & l, const int32_t * ids, int64_t n_tokens, int32_t n_used, int64_t stride) {
    std::fill(l.cnt.begin(), l.cnt.end(), 0);
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int32_t j = 0; j < n_used; j++) {
            l.cnt[routed(l, ids, t, j, stride)]++;
        }
    }
}

void llama_moe_cache::prompt_stage(int32_t il, const int32_t * ids, int64_t n_tokens, int32_t n_used, int64_t stride,
        bool stage_all, llama_moe_cache_prompt_plan & out) {
    llama_moe_cache_layer & l = layer_of(*this, il);
    llama_moe_cache_stats & st = l.stats[LLAMA_MOE_CACHE_PHASE_PROMPT];
    out.reads.clear();
    out.uploads.clear();
    out.admits.clear();
    out.evicted.clear();
    st.n_ubatches++;

    MOE_CACHE_ASSERT(stage_all || ids != nullptr);
    if (!stage_all) {
        count_routed(l, ids, n_tokens, n_used, stride);
    }
    for (int32_t e = 0; e < l.n_expert; e++) {
        if (!stage_all && l.cnt[e] == 0) {
            continue;
        }
        const int32_t s = l.slot_of[e];
        if (s >= 0) {
            out.reads.push_back({ e, s });
        } else {
            out.uploads.push_back(e);
        }
    }
    st.n_hits         += out.reads.size();
    st.n_misses       += out.uploads.size();
    st.bytes_uploaded += out.uploads.size() * l.expert_bytes;
    st.bytes_copied   += out.reads.size() * l.expert_bytes;
    st.n_copy_calls   += (n_runs(out.reads) + n_runs(out.uploads)) * l.n_tensors;
}

// the admits' bytes (staged copy -> bank) and copies: one per run of consecutive experts into consecutive slots
static void count_admits(const llama_moe_cache_layer & l, const llama_moe_cache_prompt_plan & out, llama_moe_cache_stats & st) {
    st.bytes_copied += out.admits.size() * l.expert_bytes;
    std::vector<llama_moe_cache_fill> admits = out.admits;
    std::sort(admits.begin(), admits.end(), [](const llama_moe_cache_fill & a, const llama_moe_cache_fill & b) {
        return a.expert < b.expert;
    });
    st.n_copy_calls += n_runs(admits) * l.n_tensors;
}

void llama_moe_cache::prompt_admit(int32_t il, const int32_t * ids, int64_t n_tokens, int32_t n_used, int64_t stride,
        llama_moe_cache_prompt_plan & out) {
    llama_moe_cache_layer & l = layer_of(*this, il);
    llama_moe_cache_stats & st = l.stats[LLAMA_MOE_CACHE_PHASE_PROMPT];
    out.admits.clear();
    out.evicted.clear();

    if (ids == nullptr) {
        // the routing is not known (the uploads ran ahead of the router): uploads take the free slots in expert
        // order and no resident is replaced. The scores age as in any prompt ubatch, so that an earlier prompt's
        // counts lose their weight against the ubatches of this one (a seed adds this ubatch's)
        for (int32_t e = 0; e < l.n_expert; e++) {
            l.score[e] /= 2;
        }
        for (int32_t e : out.uploads) {
            if (l.n_free == 0) {
                break;
            }
            const int32_t s = free_slot(l, e);
            if (assign(*this, l, e, s, st)) {
                out.admits.push_back({ e, s });
                out.evicted.push_back(-1);
            }
        }
        count_admits(l, out, st);
        return;
    }
    count_routed(l, ids, n_tokens, n_used, stride);
    // halving keeps the score a recent count, so an expert that a prompt stops routing loses its place in a few
    // ubatches, while one ubatch's noise does not move the set
    for (int32_t e = 0; e < l.n_expert; e++) {
        l.score[e] = l.score[e] / 2 + l.cnt[e];
    }
    for (int32_t s = 0; s < l.n_slots; s++) {
        if (l.expert_of[s] >= 0 && l.cnt[l.expert_of[s]] > 0) {
            l.ref[s] = 1;
        }
    }

    // admits: routed uploads, highest score first (ties: lower id), into free slots, else over the resident this
    // ubatch does not route with the lowest score (ties: lower slot) if the newcomer's score is more than twice it.
    // A resident this ubatch routes is never replaced, which is what keeps the set stable under a large ubatch.
    std::vector<int32_t> & cand = scratch;
    cand.clear();
    for (int32_t e : out.uploads) {
        if (l.cnt[e] > 0 && l.slot_of[e] < 0) {
            cand.push_back(e);
        }
    }
    std::sort(cand.begin(), cand.end(), [&l](int32_t a, int32_t b) {
        return l.score[a] != l.score[b] ? l.score[a] > l.score[b] : a < b;
    });
    next_epoch(l);
    for (int32_t e : cand) {
        int32_t s = -1;
        if (l.n_free > 0) {
            s = free_slot(l, e);
        } else {
            for (int32_t i = 0; i < l.n_slots; i++) {
                const int32_t v = l.expert_of[i];
                if (l.pin[i] != l.epoch && l.cnt[v] == 0 && (s < 0 || l.score[v] < l.score[l.expert_of[s]])) {
                    s = i;
                }
            }
            // candidates come in falling score: once one cannot replace the weakest resident, none after it can
            if (s < 0 || l.score[e] <= 2 * (uint64_t) l.score[l.expert_of[s]]) {
                break;
            }
        }
        const int32_t old = l.expert_of[s];
        if (assign(*this, l, e, s, st)) {
            out.admits.push_back({ e, s });
            out.evicted.push_back(old);
        }
        l.pin[s] = l.epoch;
    }

    count_admits(l, out, st);
}

void llama_moe_cache::plan_prompt(int32_t il, const int32_t * ids, int64_t n_tokens, int32_t n_used, int64_t stride,
        bool stage_all, llama_moe_cache_prompt_plan & out) {
    prompt_stage(il, ids, n_tokens, n_used, stride, stage_all, out);
    prompt_admit(il, ids, n_tokens, n_used, stride, out);
}

void llama_moe_cache::seed(int32_t il, const int32_t * ids, int64_t n_tokens, int32_t n_used, int64_t stride,
        std::vector<llama_moe_cache_fill> & fills) {
    llama_moe_cache_layer & l = layer_of(*this, il);
    llama_moe_cache_stats & st = l.stats[LLAMA_MOE_CACHE_PHASE_PROMPT];
    fills.clear();
    // the scores were aged by this ubatch's prompt_admit; its routed tokens are added now
    count_routed(l, ids, n_tokens, n_used, stride);
    for (int32_t e = 0; e < l.n_expert; e++) {
        l.score[e] += l.cnt[e];
        l.prompt_uses[e] = (int32_t) std::min<uint64_t>((uint64_t) l.prompt_uses[e] + l.cnt[e], INT32_MAX);
    }
    // the new resident set: the highest scores (ties: residents first, then lower id), at most n_slots, none unscored
    std::vector<int32_t> & want = scratch;
    want.clear();
    for (int32_t e = 0; e < l.n_expert; e++) {
        if (l.score[e] > 0) {
            want.push_back(e);
        }
    }
    std::sort(want.begin(), want.end(), [&l](int32_t a, int32_t b) {
        if (l.score[a] != l.score[b]) {
            return l.score[a] > l.score[b];
        }
        return (l.slot_of[a] >= 0) != (l.slot_of[b] >= 0) ? l.slot_of[a] >= 0 : a < b;
    });
    want.resize(std::min<size_t>(want.size(), (size_t) l.n_slots));
    // the residents that stay are pinned; the rest of the set takes free slots, else the unpinned resident of the
    // lowest score (ties: lower slot)
    next_epoch(l);
    for (int32_t e : want) {
        if (l.slot_of[e] >= 0) {
            l.pin[l.slot_of[e]] = l.epoch;
            l.ref[l.slot_of[e]] = 1;
        }
    }
    for (int32_t e : want) {
        if (l.slot_of[e] >= 0) {
            continue;
        }
        int32_t s = -1;
        if (l.n_free > 0) {
            s = free_slot(l, e);
        } else {
            for (int32_t i = 0; i < l.n_slots; i++) {
                if (l.pin[i] != l.epoch && (s < 0 || l.score[l.expert_of[i]] < l.score[l.expert_of[s]])) {
                    s = i;
                }
            }
        }
        MOE_CACHE_ASSERT(s >= 0 && "the set is no larger than the slots, and only its residents are pinned");
        l.pin[s] = l.epoch;
        st.n_seeded++;
        if (assign(*this, l, e, s, st)) {
            fills.push_back({ e, s });
        }
    }
    // decode's first evictions should take what the prompt's end used least, not whichever slots the hand meets
    // first: only the higher-scored half of the set keeps its reference bit; the lower half and any resident outside
    // the set (a set smaller than the slots: a profile's or an earlier prompt's experts this one did not route) lose
    // it. Measured with the planner (`t first-tokens`): the first 16 tokens hit 0.813 instead of 0.799, and 0.811
    // instead of 0.766 where a profile filled the slots before the prompt
    std::fill(l.ref.begin(), l.ref.end(), 0);
    for (size_t i = 0; i < (want.size() + 1) / 2; i++) {
        l.ref[l.slot_of[want[i]]] = 1;
    }
    std::sort(fills.begin(), fills.end(), [](const llama_moe_cache_fill & a, const llama_moe_cache_fill & b) {
        return a.slot < b.slot;
    });
}

void llama_moe_cache::unadmit(int32_t il, const std::vector<llama_moe_cache_fill> & fills, bool seeded) {
    llama_moe_cache_layer & l = layer_of(*this, il);
    llama_moe_cache_stats & st = l.stats[LLAMA_MOE_CACHE_PHASE_PROMPT];
    for (const llama_moe_cache_fill & f : fills) {
        MOE_CACHE_ASSERT(f.expert >= 0 && f.expert < l.n_expert && f.slot >= 0 && f.slot < l.n_slots);
        if (l.slot_of[f.expert] != f.slot) {
            continue; // replaced since
        }
        MOE_CACHE_ASSERT(l.expert_of[f.slot] == f.expert);
        l.slot_of[f.expert] = -1;
        l.expert_of[f.slot] = -1;
        l.ref[f.slot]       = 0;
        l.n_free++;
        st.n_fills--; // the bytes copied into the slots stay counted
        st.n_seeded -= seeded;
    }
}

llama_moe_cache_stats llama_moe_cache::get_stats(int32_t il, llama_moe_cache_phase phase) const {
    MOE_CACHE_ASSERT(phase >= 0 && phase < LLAMA_MOE_CACHE_PHASE_COUNT);
    llama_moe_cache_stats r;
    for (const llama_moe_cache_layer & l : layers) {
        if (il < 0 || l.il == il) {
            r.add(l.stats[phase]);
        }
    }
    return r;
}

void llama_moe_cache::reset_stats() {
    for (llama_moe_cache_layer & l : layers) {
        for (llama_moe_cache_stats & st : l.stats) {
            st = llama_moe_cache_stats();
        }
    }
}

void llama_moe_cache::clear(bool keep_whole) {
    for (llama_moe_cache_layer & l : layers) {
        if (keep_whole && whole(l.il)) {
            continue;
        }
        empty(l.il);
        std::fill(l.score.begin(), l.score.end(), 0);
    }
}

void llama_moe_cache::empty(int32_t il) {
    MOE_CACHE_ASSERT(il >= 0 && il < (int32_t) layer_index.size() && layer_index[il] >= 0);
    llama_moe_cache_layer & l = layers[layer_index[il]];
    std::fill(l.slot_of.begin(), l.slot_of.end(), -1);
    std::fill(l.expert_of.begin(), l.expert_of.end(), -1);
    std::fill(l.ref.begin(), l.ref.end(), 0);
    l.hand   = 0;
    l.n_free = l.n_slots;
}

static bool check_layer(const llama_moe_cache_layer & l, std::string & why);

void llama_moe_cache::get_state(int32_t il, int32_t * flat) const {
    const llama_moe_cache_layer & l = layers[layer_index[il]];
    const ggml_moe_cache_state st = ggml_moe_cache_state_flat(flat, l.n_expert, l.n_slots);
    *st.hand   = l.hand;
    *st.n_free = l.n_free;
    std::copy(l.slot_of.begin(), l.slot_of.end(), st.slot_of);
    std::copy(l.expert_of.begin(), l.expert_of.end(), st.expert_of);
    std::copy(l.ref.begin(), l.ref.end(), st.ref);
    std::fill(st.counters, st.counters + 2 * GGML_MOE_CACHE_N_COUNTERS, 0);
    std::copy(l.uses.begin(), l.uses.end(), st.uses);
}

void llama_moe_cache::set_uses(int32_t il, const int32_t * uses) {
    llama_moe_cache_layer & l = layer_of(*this, il);
    for (int32_t e = 0; e < l.n_expert; e++) {
        l.uses[e] = std::max(uses[e], 0);
    }
}

bool llama_moe_cache::set_state(int32_t il, const int32_t * flat, std::string & why) {
    MOE_CACHE_ASSERT(il >= 0 && il < (int32_t) layer_index.size() && layer_index[il] >= 0);
    llama_moe_cache_layer & l = layers[layer_index[il]];
    const ggml_moe_cache_state st = ggml_moe_cache_state_flat(const_cast<int32_t *>(flat), l.n_expert, l.n_slots);
    // checked on a layer of the state alone, so that a bad state changes nothing
    llama_moe_cache_layer c = {};
    c.il       = l.il;
    c.n_expert = l.n_expert;
    c.n_slots  = l.n_slots;
    c.hand     = *st.hand;
    c.n_free   = *st.n_free;
    c.slot_of.assign(st.slot_of, st.slot_of + l.n_expert);
    c.expert_of.assign(st.expert_of, st.expert_of + l.n_slots);
    c.ref.assign(st.ref, st.ref + l.n_slots);
    if (!check_layer(c, why)) {
        return false;
    }
    if (c.hand < 0 || c.hand >= l.n_slots) {
        why = "the CLOCK hand is out of range";
        return false;
    }
    l.hand      = c.hand;
    l.n_free    = c.n_free;
    l.slot_of   = std::move(c.slot_of);
    l.expert_of = std::move(c.expert_of);
    l.ref       = std::move(c.ref);
    set_uses(il, st.uses);
    return true;
}

// slot_of and expert_of agree, the counts are consistent
static bool check_layer(const llama_moe_cache_layer & l, std::string & why) {
    char buf[160];
    int32_t n_free = 0;
    for (int32_t s = 0; s < l.n_slots; s++) {
        const int32_t e = l.expert_of[s];
        if (e < -1 || e >= l.n_expert || (e >= 0 && l.slot_of[e] != s)) {
            snprintf(buf, sizeof(buf), "layer %d: slot %d holds expert %d, whose slot is %d", l.il, s, e,
                    e >= 0 && e < l.n_expert ? l.slot_of[e] : -2);
            why = buf;
            return false;
        }
        n_free += e < 0;
    }
    for (int32_t e = 0; e < l.n_expert; e++) {
        const int32_t s = l.slot_of[e];
        if (s < -1 || s >= l.n_slots || (s >= 0 && l.expert_of[s] != e)) {
            snprintf(buf, sizeof(buf), "layer %d: expert %d maps to slot %d, which does not hold it", l.il, e, s);
            why = buf;
            return false;
        }
    }
    if (n_free != l.n_free) {
        snprintf(buf, sizeof(buf), "layer %d: %d free slots counted as %d", l.il, n_free, l.n_free);
        why = buf;
        return false;
    }
    return true;
}

bool llama_moe_cache::check(std::string & why) const {
    for (const llama_moe_cache_layer & l : layers) {
        if (!check_layer(l, why)) {
            return false;
        }
    }
    return true;
}
