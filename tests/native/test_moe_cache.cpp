// test_moe_cache.cpp: the MoE expert cache's host-side bookkeeping (native/src/llama-moe-cache.cpp), on its own:
// no llama.cpp build, just a C++17 compiler.
//
//   c++ -std=c++17 -O2 -I native/src native/src/llama-moe-cache.cpp tests/native/test_moe_cache.cpp -o t
//   t CASE    CASE: one of the names in main(), or "all"
//   t sim     the hit-rate table of results/expert-cache-planner.md
//   t first-tokens  the planner's hit rates of the first tokens after a prompt, seeded or not (results/expert-cache-seeding-and-profiles.md)
//
// Routing is drawn like the synthetic models' (pyllama_moe/synth/tensors.py): per token, router logits N(0, 1)
// plus skew * z_e, z_e fixed per expert from a centred, standardised exponential; the top-k of them. The
// generator is mt19937_64 with its own Box-Muller, so every platform draws the same experts.
//
// Most cases keep a simulated bank (the expert each slot really holds, changed only by the fills and admits a plan
// returns) and check every read against the routing: a plan that maps an expert to a slot it never filled fails.
// Prints "ok CASE: ..." and exits 0, or "FAIL CASE: ..." and exits 1.
#include "llama-moe-cache.h"
#include "ggml-moe-cache-lookup.h"

#include <algorithm>
#include <cmath>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <list>
#include <numeric>
#include <random>
#include <string>
#include <vector>

static const size_t MiB = 1024 * 1024;

struct failure {
    std::string why;
};

#define CHECK(cond, ...)                                   \
    do {                                                   \
        if (!(cond)) {                                     \
            char buf_[512];                                \
            snprintf(buf_, sizeof(buf_), __VA_ARGS__);     \
            throw failure{ std::string(#cond) + ": " + buf_ }; \
        }                                                  \
    } while (0)

//
// routing
//

struct router {
    std::mt19937_64 rng;
    int32_t n_expert;
    int32_t n_used;
    std::vector<double> bias;

    router(int32_t n_expert, int32_t n_used, double skew, uint64_t seed) : rng(seed), n_expert(n_expert), n_used(n_used) {
        // a centred, standardised exponential: a few experts far more popular than the rest
        double mean = 0;
        for (int32_t e = 0; e < n_expert; e++) {
            bias.push_back(-std::log(uniform()));
            mean += bias.back() / n_expert;
        }
        double var = 0;
        for (double b : bias) {
            var += (b - mean) * (b - mean) / n_expert;
        }
        for (double & b : bias) {
            b = var > 0 ? skew * (b - mean) / std::sqrt(var) : 0.0;
        }
    }

    double uniform() {
        return ((rng() >> 11) + 0.5) * (1.0 / 9007199254740992.0);
    }

    double normal() {
        return std::sqrt(-2.0 * std::log(uniform())) * std::cos(2.0 * M_PI * uniform());
    }

    // [n_tokens * n_used], token-major
    std::vector<int32_t> route(int64_t n_tokens) {
        std::vector<int32_t> ids;
        std::vector<std::pair<double, int32_t>> g(n_expert);
        for (int64_t t = 0; t < n_tokens; t++) {
            for (int32_t e = 0; e < n_expert; e++) {
                g[e] = { normal() + bias[e], e };
            }
            std::partial_sort(g.begin(), g.begin() + n_used, g.end(), [](const auto & a, const auto & b) {
                return a.first > b.first;
            });
            for (int32_t j = 0; j < n_used; j++) {
                ids.push_back(g[j].second);
            }
        }
        return ids;
    }
};

static llama_moe_cache one_layer(int32_t n_expert, int32_t n_slots, size_t expert_bytes = MiB, int32_t n_tensors = 3) {
    std::vector<llama_moe_cache_layer_desc> d = { { 0, n_expert, expert_bytes, 0, n_tensors } };
    llama_moe_cache_sizing s = llama_moe_cache_size_banks(n_slots * expert_bytes, d);
    CHECK(s.n_slots[0] == n_slots, "sized %d slots for %d", s.n_slots[0], n_slots);
    return llama_moe_cache(d, s);
}

// what each slot of each layer really holds; -2: never written
struct bank {
    std::vector<std::vector<int32_t>> held;

    explicit bank(const llama_moe_cache & c) {
        for (const llama_moe_cache_layer & l : c.layers) {
            held.push_back(std::vector<int32_t>(l.n_slots, -2));
        }
    }

    std::vector<int32_t> & of(const llama_moe_cache & c, int32_t il) {
        return held[c.layer_index[il]];
    }

    // applies a decode plan and checks every routed read
    void decode(const llama_moe_cache & c, int32_t il, const std::vector<int32_t> & ids, const llama_moe_cache_decode_plan & p) {
        std::vector<int32_t> & h = of(c, il);
        const llama_moe_cache_layer * l = c.layer(il);
        for (const llama_moe_cache_fill & f : p.fills) {
            h[f.slot] = f.expert;
        }
        CHECK(p.slot_ids.size() == ids.size(), "%zu slot ids for %zu ids", p.slot_ids.size(), ids.size());
        for (size_t i = 0; i < ids.size(); i++) {
            CHECK(p.slot_ids[i] >= 0 && p.slot_ids[i] < l->n_slots, "slot id %d of %d slots", p.slot_ids[i], l->n_slots);
            if (!p.overflow) {
                CHECK(h[p.slot_ids[i]] == ids[i], "layer %d read slot %d for expert %d: it holds %d", il, p.slot_ids[i],
                        ids[i], h[p.slot_ids[i]]);
            }
        }
    }

    // applies a prompt plan: reads first (they must find their experts), then admits
    void prompt(const llama_moe_cache & c, int32_t il, const llama_moe_cache_prompt_plan & p) {
        std::vector<int32_t> & h = of(c, il);
        for (const llama_moe_cache_fill & r : p.reads) {
            CHECK(h[r.slot] == r.expert, "layer %d read expert %d from slot %d: it holds %d", il, r.expert, r.slot, h[r.slot]);
        }
        for (const llama_moe_cache_fill & a : p.admits) {
            h[a.slot] = a.expert;
        }
    }
};

static void check_cache(const llama_moe_cache & c) {
    std::string why;
    CHECK(c.check(why), "%s", why.c_str());
}

//
// sizing
//

static std::vector<llama_moe_cache_layer_desc> uniform_layers(int n, int32_t n_expert = 128, size_t eb = MiB) {
    std::vector<llama_moe_cache_layer_desc> d;
    for (int i = 0; i < n; i++) {
        d.push_back({ i, n_expert, eb, 0, 3 });
    }
    return d;
}

// no layer could take one more slot: the budget is used as far as the rule allows
static void check_maximal(const std::vector<llama_moe_cache_layer_desc> & d, const llama_moe_cache_sizing & s) {
    size_t used = 0;
    for (size_t i = 0; i < d.size(); i++) {
        if (s.n_slots[i] > 0) {
            used += d[i].overhead_bytes + s.n_slots[i] * d[i].expert_bytes;
        }
    }
    CHECK(used == s.bytes_used && used <= s.budget, "used %zu reported %zu budget %zu", used, s.bytes_used, s.budget);
    for (size_t i = 0; i < d.size(); i++) {
        if (s.n_slots[i] > 0 && s.n_slots[i] < d[i].n_expert) {
            CHECK(used + d[i].expert_bytes > s.budget, "layer %zu could take another slot", i);
        }
    }
}

static void sizing_uniform() {
    auto d = uniform_layers(4);
    auto s = llama_moe_cache_size_banks(100 * MiB, d);
    for (int i = 0; i < 4; i++) {
        CHECK(s.n_slots[i] == 25, "layer %d: %d slots", i, s.n_slots[i]);
    }
    CHECK(s.bytes_used == 100 * MiB && s.n_layers == 4 && s.reason.empty(), "used %zu, %d layers, %s", s.bytes_used,
            s.n_layers, s.reason.c_str());
    check_maximal(d, s);
}

static void sizing_remainder() {
    auto d = uniform_layers(4);
    // 102 slots and half of one: 26, 26, 25, 25, the half unused
    auto s = llama_moe_cache_size_banks(102 * MiB + MiB / 2, d);
    const int32_t want[4] = { 26, 26, 25, 25 };
    for (int i = 0; i < 4; i++) {
        CHECK(s.n_slots[i] == want[i], "layer %d: %d slots, want %d", i, s.n_slots[i], want[i]);
    }
    CHECK(s.bytes_used == 102 * MiB, "used %zu", s.bytes_used);
    check_maximal(d, s);
}

static void sizing_cap() {
    auto d = uniform_layers(3, 64);
    auto s = llama_moe_cache_size_banks(1000 * MiB, d);
    for (int i = 0; i < 3; i++) {
        CHECK(s.n_slots[i] == 64, "layer %d: %d slots", i, s.n_slots[i]);
    }
    CHECK(s.bytes_used == 192 * MiB, "used %zu", s.bytes_used);
    // a layer with fewer experts is capped and its share goes to the others
    d[1].n_expert = 8;
    s = llama_moe_cache_size_banks(100 * MiB, d);
    CHECK(s.n_slots[0] == 46 && s.n_slots[1] == 8 && s.n_slots[2] == 46, "%d %d %d", s.n_slots[0], s.n_slots[1], s.n_slots[2]);
    check_maximal(d, s);
}

static void sizing_too_small() {
    auto d = uniform_layers(4);
    auto s = llama_moe_cache_size_banks(3 * MiB + MiB / 2, d);
    CHECK(s.n_layers == 0 && s.bytes_used == 0 && !s.reason.empty(), "%d layers, %zu bytes", s.n_layers, s.bytes_used);
    for (int32_t n : s.n_slots) {
        CHECK(n == 0, "%d slots", n);
    }
    CHECK(s.reason.find("below 1 slot in each of the 4 MoE layers") != std::string::npos, "%s", s.reason.c_str());
    // min_slots: fewer than a token's experts is no cache
    s = llama_moe_cache_size_banks(31 * MiB, d, 8);
    CHECK(s.n_layers == 0 && s.reason.find("below 8 slots") != std::string::npos, "%s", s.reason.c_str());
    s = llama_moe_cache_size_banks(32 * MiB, d, 8);
    CHECK(s.n_layers == 4 && s.n_slots[3] == 8, "%d layers, %d slots", s.n_layers, s.n_slots[3]);
    // no MoE layer on the host
    s = llama_moe_cache_size_banks(1000 * MiB, { { 0, 0, 0, 0, 0 }, { 1, 128, 0, 0, 3 } });
    CHECK(s.n_layers == 0 && s.reason == "no MoE layer has its experts on the host", "%s", s.reason.c_str());
}

static void sizing_hetero() {
    // a dense layer first, two layers of 1 MiB experts, one of 2 MiB experts, each with 64 KiB of slot map and state
    std::vector<llama_moe_cache_layer_desc> d = {
        { 0, 0,   0,       0,         0 },
        { 1, 128, MiB,     MiB / 16,  3 },
        { 2, 128, 2 * MiB, MiB / 16,  2 },
        { 3, 128, MiB,     MiB / 16,  3 },
    };
    // overheads 3/16 MiB; 40 MiB per slot each: 40 * 4 = 160 MiB; 2 MiB left: one more slot in layers 1 and 3 (the
    // 2 MiB layer in between does not fit after layer 1's)
    auto s = llama_moe_cache_size_banks(162 * MiB + 3 * MiB / 16, d);
    CHECK(s.n_slots[0] == 0 && s.n_slots[1] == 41 && s.n_slots[2] == 40 && s.n_slots[3] == 41, "%d %d %d %d",
            s.n_slots[0], s.n_slots[1], s.n_slots[2], s.n_slots[3]);
    CHECK(s.n_layers == 3 && s.bytes_used == 162 * MiB + 3 * MiB / 16, "%d layers, %zu", s.n_layers, s.bytes_used);
    CHECK(s.bytes[0] == 0 && s.bytes[1] == 41 * MiB + MiB / 16 && s.bytes[2] == 80 * MiB + MiB / 16 &&
            s.bytes[1] + s.bytes[2] + s.bytes[3] == s.bytes_used, "per-layer bytes %zu %zu %zu", s.bytes[1], s.bytes[2], s.bytes[3]);
    check_maximal(d, s);
    // the overheads count: without them one slot per layer (4 MiB) fits, with them it does not
    s = llama_moe_cache_size_banks(4 * MiB, d);
    CHECK(s.n_layers == 0, "%d layers", s.n_layers);
    // the cache builds only the layers with slots, found by model layer index
    s = llama_moe_cache_size_banks(162 * MiB + 3 * MiB / 16, d);
    llama_moe_cache c(d, s);
    CHECK(c.n_layers() == 3 && c.layer(0) == nullptr && c.layer(2)->n_slots == 40 && c.layer(7) == nullptr, "%d", c.n_layers());
}

//
// decode
//

static void clock_keeps_same_ubatch() {
    llama_moe_cache c = one_layer(16, 4);
    bank b(c);
    llama_moe_cache_decode_plan p;
    std::vector<int32_t> ids = { 0, 1, 2, 3 };
    CHECK(c.plan_decode(0, ids.data(), 1, 4, 4, p) && p.fills.size() == 4, "%zu fills", p.fills.size());
    b.decode(c, 0, ids, p);
    // every bit is set: the hand clears them all, passes over 0, 1, 2 (used by this ubatch) and takes 3
    ids = { 4, 0, 1, 2 };
    CHECK(c.plan_decode(0, ids.data(), 1, 4, 4, p) && p.fills.size() == 1, "%zu fills", p.fills.size());
    CHECK(p.fills[0].expert == 4 && p.fills[0].slot == 3, "expert %d into slot %d", p.fills[0].expert, p.fills[0].slot);
    b.decode(c, 0, ids, p);
    // the hand is at 0 with every bit clear but 3's (filled) and 0-2's (hits): 5 takes 0 after clearing... all set,
    // so a full turn clears them, then the first slot not used by {5, 4, 6, 7} is 0
    ids = { 5, 4, 6, 7 };
    CHECK(c.plan_decode(0, ids.data(), 1, 4, 4, p) && p.fills.size() == 3, "%zu fills", p.fills.size());
    for (const llama_moe_cache_fill & f : p.fills) {
        CHECK(f.slot != 3, "expert %d evicted expert 4, which this ubatch reads", f.expert);
    }
    b.decode(c, 0, ids, p);
    check_cache(c);

    // property: over many skewed ubatches, no fill takes the slot of an expert the same ubatch routes
    router r(64, 8, 0.5, 7);
    llama_moe_cache c2 = one_layer(64, 24);
    bank b2(c2);
    for (int it = 0; it < 3000; it++) {
        const int64_t n_tokens = 1 + it % 3;
        std::vector<int32_t> ids2 = r.route(n_tokens);
        std::vector<int32_t> before = c2.layer(0)->expert_of;
        if (!c2.plan_decode(0, ids2.data(), n_tokens, 8, 8, p)) {
            continue;
        }
        for (const llama_moe_cache_fill & f : p.fills) {
            const int32_t old = before[f.slot];
            CHECK(old < 0 || std::find(ids2.begin(), ids2.end(), old) == ids2.end(),
                    "ubatch %d: expert %d took the slot of expert %d, which it routes", it, f.expert, old);
        }
        b2.decode(c2, 0, ids2, p);
    }
    check_cache(c2);
}

static void overflow() {
    llama_moe_cache c = one_layer(16, 4);
    llama_moe_cache_decode_plan p;
    std::vector<int32_t> ids = { 0, 1, 2, 3 };
    c.plan_decode(0, ids.data(), 1, 4, 4, p);
    const llama_moe_cache_layer before = *c.layer(0);
    // two tokens, five distinct experts for four slots
    ids = { 0, 9, 2, 3, 4, 0, 1, 2 };
    CHECK(!c.plan_decode(0, ids.data(), 2, 4, 4, p) && p.overflow && p.n_distinct == 6, "overflow %d, %d distinct",
            p.overflow, p.n_distinct);
    CHECK(p.fills.empty() && p.slot_ids.size() == 8, "%zu fills", p.fills.size());
    for (int32_t s : p.slot_ids) {
        CHECK(s == 0, "slot id %d on overflow", s);
    }
    const llama_moe_cache_layer & after = *c.layer(0);
    CHECK(after.slot_of == before.slot_of && after.expert_of == before.expert_of && after.ref == before.ref &&
            after.hand == before.hand, "the overflow changed the slot map");
    const llama_moe_cache_stats st = c.get_stats(0, LLAMA_MOE_CACHE_PHASE_DECODE);
    // the staging path uploads the six routed experts: 0-4 in one run, 9 in another, three tensors each
    CHECK(st.n_overflow == 1 && st.n_misses == 4 + 6 && st.bytes_uploaded == 10 * MiB && st.n_copy_calls == 3 + 2 * 3,
            "overflow %llu misses %llu bytes %llu calls %llu", (unsigned long long) st.n_overflow,
            (unsigned long long) st.n_misses, (unsigned long long) st.bytes_uploaded, (unsigned long long) st.n_copy_calls);
}

// a ubatch the caller sends to the staging path unplanned: counted like an overflow, the residents untouched
static void note_staging() {
    llama_moe_cache c = one_layer(16, 4);
    llama_moe_cache_decode_plan p;
    std::vector<int32_t> ids = { 0, 1, 2, 3 };
    c.plan_decode(0, ids.data(), 1, 4, 4, p);
    const llama_moe_cache_layer before = *c.layer(0);
    c.note_staging(0);
    const llama_moe_cache_layer & after = *c.layer(0);
    CHECK(after.slot_of == before.slot_of && after.expert_of == before.expert_of && after.ref == before.ref &&
            after.hand == before.hand, "noting the staging path changed the slot map");
    const llama_moe_cache_stats st = c.get_stats(0, LLAMA_MOE_CACHE_PHASE_DECODE);
    // one step and one overflow more; the uploads are the first plan's (4 experts in one run of three tensors)
    CHECK(st.n_ubatches == 2 && st.n_overflow == 1 && st.n_misses == 4 && st.n_hits == 0 && st.bytes_uploaded == 4 * MiB &&
            st.n_copy_calls == 3, "steps %llu overflow %llu misses %llu bytes %llu calls %llu",
            (unsigned long long) st.n_ubatches, (unsigned long long) st.n_overflow, (unsigned long long) st.n_misses,
            (unsigned long long) st.bytes_uploaded, (unsigned long long) st.n_copy_calls);
}

// a plan and the state it leaves, summarised: equal for equal routing
static uint64_t mix(uint64_t h, int64_t v) {
    return (h ^ (uint64_t) v) * 0x100000001b3ull;
}

static uint64_t run_random(uint64_t seed, double skew, int32_t n_slots, bool with_bank) {
    router r(128, 8, skew, seed);
    llama_moe_cache c = one_layer(128, n_slots);
    bank b(c);
    llama_moe_cache_decode_plan p;
    uint64_t h = 0xcbf29ce484222325ull;
    std::mt19937_64 sizes(seed + 1);
    for (int it = 0; it < 2000; it++) {
        // mostly single tokens, some small batches, a few that cannot fit
        const int64_t n_tokens = it % 50 == 0 ? 32 : 1 + (int64_t) (sizes() % 4);
        std::vector<int32_t> ids = r.route(n_tokens);
        const bool ok = c.plan_decode(0, ids.data(), n_tokens, 8, 8, p);
        if (with_bank) {
            b.decode(c, 0, ids, p);
        }
        h = mix(h, ok);
        for (int32_t s : p.slot_ids) {
            h = mix(h, s);
        }
        for (const llama_moe_cache_fill & f : p.fills) {
            h = mix(mix(h, f.expert), f.slot);
        }
    }
    check_cache(c);
    return h;
}

static void ids_in_range() {
    for (double skew : { 0.0, 0.5, 2.0 }) {
        for (int32_t n_slots : { 8, 20, 64, 127, 128 }) {
            const uint64_t h = run_random(11 + n_slots, skew, n_slots, true);
            // deterministic: the same routing gives the same plans and state
            CHECK(h == run_random(11 + n_slots, skew, n_slots, false), "skew %g, %d slots: two runs differ", skew, n_slots);
        }
    }
    // a strided ids view (a row of argsort over n_expert, of which the first n_used are the top-k)
    llama_moe_cache c = one_layer(16, 8);
    bank b(c);
    const int32_t rows[2][16] = { { 3, 5, 7, 1 }, { 5, 9, 2, 3 } };
    llama_moe_cache_decode_plan p;
    CHECK(c.plan_decode(0, &rows[0][0], 2, 4, 16, p) && p.n_distinct == 6, "%d distinct", p.n_distinct);
    b.decode(c, 0, { 3, 5, 7, 1, 5, 9, 2, 3 }, p);
}

static void uniform_hit_rate() {
    // iid uniform routing: the cache holds n_slots of n_expert experts, each a token's pick with the same chance
    router r(128, 8, 0.0, 3);
    llama_moe_cache c = one_layer(128, 64);
    llama_moe_cache_decode_plan p;
    for (int it = 0; it < 200; it++) {
        std::vector<int32_t> ids = r.route(1);
        c.plan_decode(0, ids.data(), 1, 8, 8, p);
    }
    c.reset_stats();
    for (int it = 0; it < 4000; it++) {
        std::vector<int32_t> ids = r.route(1);
        c.plan_decode(0, ids.data(), 1, 8, 8, p);
    }
    const llama_moe_cache_stats st = c.get_stats(0, LLAMA_MOE_CACHE_PHASE_DECODE);
    const double rate = (double) st.n_hits / (st.n_hits + st.n_misses);
    CHECK(std::fabs(rate - 0.5) < 0.02, "hit rate %.4f, want 0.5", rate);
}

//
// prompts
//

// what a plain LRU prompt planner would upload: every routed expert in id order, each miss admitted over the
// least recently used slot, whatever this ubatch still needs
struct plain_lru {
    int32_t n_slots;
    std::list<int32_t> order; // most recent first
    uint64_t n_uploads = 0;

    uint64_t ubatch(const std::vector<int32_t> & ids, int32_t n_expert) {
        std::vector<bool> routed(n_expert, false);
        for (int32_t e : ids) {
            routed[e] = true;
        }
        uint64_t n = 0;
        for (int32_t e = 0; e < n_expert; e++) {
            if (!routed[e]) {
                continue;
            }
            auto it = std::find(order.begin(), order.end(), e);
            if (it != order.end()) {
                order.erase(it);
            } else {
                n++;
                if ((int32_t) order.size() == n_slots) {
                    order.pop_back();
                }
            }
            order.push_front(e);
        }
        n_uploads += n;
        return n;
    }
};

static void prompt_uploads_once() {
    // a prompt of 16 ubatches of 512 tokens whose experts (96 of 128: the router never picks the others) fit in 96
    // slots: each of them is uploaded once over the whole prompt
    for (bool stage_all : { false, true }) {
        const int32_t n_slots = stage_all ? 128 : 96;
        router r(96, 8, 0.5, 5);
        llama_moe_cache c = one_layer(128, n_slots);
        bank b(c);
        llama_moe_cache_prompt_plan p;
        std::vector<int32_t> uploads(128, 0);
        for (int ub = 0; ub < 16; ub++) {
            std::vector<int32_t> ids = r.route(512);
            c.plan_prompt(0, ids.data(), 512, 8, 8, stage_all, p);
            b.prompt(c, 0, p);
            for (int32_t e : p.uploads) {
                uploads[e]++;
            }
        }
        // stage_all stages all 128, and the 32 the prompt never routes stay uploads (a prefetch ahead of the router
        // cannot skip them) but they are never admitted: they come once per ubatch
        for (int32_t e = 0; e < 96; e++) {
            CHECK(uploads[e] == 1, "stage_all %d: expert %d uploaded %d times", stage_all, e, uploads[e]);
        }
        for (int32_t e = 96; e < 128; e++) {
            CHECK(uploads[e] == (stage_all ? 16 : 0), "stage_all %d: expert %d uploaded %d times", stage_all, e, uploads[e]);
        }
        check_cache(c);
    }
}

static void prompt_unrouted() {
    // uploads issued ahead of the router (the scheduler's fills): the prompt plan stages every expert and admits
    // uploads into free slots in expert order without the routing. With 96 slots of 128, the first ubatch makes
    // experts 0-95 resident, every later one reads those 96 and uploads the other 32, and nothing is replaced
    llama_moe_cache c = one_layer(128, 96);
    bank b(c);
    llama_moe_cache_prompt_plan p;
    for (int ub = 0; ub < 4; ub++) {
        c.prompt_stage(0, nullptr, 0, 8, 8, true, p);
        c.prompt_admit(0, nullptr, 0, 8, 8, p);
        b.prompt(c, 0, p);
        CHECK(p.reads.size() == (ub == 0 ? 0u : 96u), "ubatch %d: %zu reads", ub, p.reads.size());
        CHECK(p.uploads.size() == (ub == 0 ? 128u : 32u), "ubatch %d: %zu uploads", ub, p.uploads.size());
        CHECK(p.admits.size() == (ub == 0 ? 96u : 0u), "ubatch %d: %zu admits", ub, p.admits.size());
        for (size_t i = 0; i < p.admits.size(); i++) {
            CHECK(p.admits[i].expert == (int32_t) i && p.evicted[i] == -1, "admit %zu: expert %d over %d", i,
                    p.admits[i].expert, p.evicted[i]);
        }
        check_cache(c);
    }
    const llama_moe_cache_stats st = c.get_stats(0, LLAMA_MOE_CACHE_PHASE_PROMPT);
    CHECK(st.n_ubatches == 4 && st.n_hits == 3 * 96 && st.n_misses == 128 + 3 * 32 && st.n_fills == 96 && st.n_evictions == 0,
            "stats: %" PRIu64 " ubatches, %" PRIu64 " hits, %" PRIu64 " misses, %" PRIu64 " fills, %" PRIu64 " evictions",
            st.n_ubatches, st.n_hits, st.n_misses, st.n_fills, st.n_evictions);

    // admits whose bytes did not all land are taken back: a fresh cache, one ubatch, its admits undone, and the next
    // ubatch finds nothing resident and admits the same experts into the same slots again
    llama_moe_cache u = one_layer(128, 96);
    u.prompt_stage(0, nullptr, 0, 8, 8, true, p);
    u.prompt_admit(0, nullptr, 0, 8, 8, p);
    const std::vector<llama_moe_cache_fill> first = p.admits;
    u.unadmit(0, first);
    check_cache(u);
    CHECK(u.layer(0)->n_free == 96 && u.get_stats(0, LLAMA_MOE_CACHE_PHASE_PROMPT).n_fills == 0, "%d free, %" PRIu64 " fills",
            u.layer(0)->n_free, u.get_stats(0, LLAMA_MOE_CACHE_PHASE_PROMPT).n_fills);
    u.prompt_stage(0, nullptr, 0, 8, 8, true, p);
    CHECK(p.reads.empty() && p.uploads.size() == 128, "%zu reads, %zu uploads after the undo", p.reads.size(), p.uploads.size());
    u.prompt_admit(0, nullptr, 0, 8, 8, p);
    CHECK(p.admits.size() == first.size(), "%zu admits, %zu before", p.admits.size(), first.size());
    for (size_t i = 0; i < p.admits.size(); i++) {
        CHECK(p.admits[i].expert == first[i].expert && p.admits[i].slot == first[i].slot, "admit %zu differs", i);
    }
    check_cache(u);
}

static void prompt_no_thrash() {
    // 128 experts, all routed by every 512-token ubatch (skew 0), 96 slots: after the first ubatch the 96 residents
    // are read from the bank and only the other 32 are uploaded, where a plain LRU sends all 128 again every time
    router r(128, 8, 0.0, 9);
    llama_moe_cache c = one_layer(128, 96);
    bank b(c);
    plain_lru lru{ 96, {} };
    llama_moe_cache_prompt_plan p;
    uint64_t ours = 0;
    for (int ub = 0; ub < 8; ub++) {
        std::vector<int32_t> ids = r.route(512);
        c.plan_prompt(0, ids.data(), 512, 8, 8, false, p);
        b.prompt(c, 0, p);
        const uint64_t lru_n = lru.ubatch(ids, 128);
        ours += p.uploads.size();
        const size_t routed = p.reads.size() + p.uploads.size();
        if (ub > 0) {
            CHECK(p.reads.size() == 96 && p.uploads.size() == routed - 96, "ubatch %d: %zu reads, %zu uploads of %zu routed",
                    ub, p.reads.size(), p.uploads.size(), routed);
            // the point of the rule: this bound fails for LRU (a scan evicts what the same ubatch reads next)
            CHECK(lru_n > routed - 96, "ubatch %d: LRU uploaded %llu", ub, (unsigned long long) lru_n);
        }
    }
    // every ubatch routes all 128: 128 + 7 x 32 against 8 x 128
    CHECK(ours == 128 + 7 * 32 && lru.n_uploads == 8 * 128, "LRU %llu uploads, ours %llu", (unsigned long long) lru.n_uploads,
            (unsigned long long) ours);
}

static void prompt_hysteresis() {
    // 64 slots, a prompt whose routing moves from experts 0-63 to 64-127: residents the new ubatches do not route
    // lose their scores by halves and are replaced; one ubatch that misses a hot resident does not replace it
    llama_moe_cache c = one_layer(128, 64);
    bank b(c);
    llama_moe_cache_prompt_plan p;
    auto block = [](int32_t first, int64_t n_tokens) {
        std::vector<int32_t> ids;
        for (int64_t t = 0; t < n_tokens; t++) {
            for (int32_t j = 0; j < 8; j++) {
                ids.push_back(first + (int32_t) ((t * 8 + j) % 64));
            }
        }
        return ids;
    };
    for (int ub = 0; ub < 4; ub++) {
        auto ids = block(0, 512);
        c.plan_prompt(0, ids.data(), 512, 8, 8, false, p);
        b.prompt(c, 0, p);
    }
    // experts 0-63 resident, score 64 * (1 + 1/2 + 1/4 + 1/8) = 120; a ubatch of 8 tokens on 64-127 (score 1 each)
    // is a blip: nothing is replaced
    auto blip = block(64, 8);
    c.plan_prompt(0, blip.data(), 8, 8, 8, false, p);
    b.prompt(c, 0, p);
    CHECK(p.admits.empty() && p.uploads.size() == 64, "%zu admits on a blip", p.admits.size());
    // residents 60 after the blip; the new experts routed 16 tokens each per ubatch: 16 <= 2 x 30, 24 <= 2 x 15, then
    // 28 > 2 x 7: the set moves at the third ubatch of the new routing, and the fourth uploads nothing
    int n_ub = 0;
    for (; n_ub < 16; n_ub++) {
        auto ids = block(64, 128);
        c.plan_prompt(0, ids.data(), 128, 8, 8, false, p);
        b.prompt(c, 0, p);
        CHECK(p.admits.size() == (n_ub == 2 ? 64 : 0), "ubatch %d: %zu admits", n_ub, p.admits.size());
        if (p.uploads.empty()) {
            break;
        }
    }
    CHECK(n_ub == 3, "%d ubatches to move the set", n_ub);
    const llama_moe_cache_layer * l = c.layer(0);
    for (int32_t e = 64; e < 128; e++) {
        CHECK(l->slot_of[e] >= 0, "expert %d not resident", e);
    }
    check_cache(c);
}

static void prompt_two_steps() {
    // stage ahead of the router (ids unknown), admit after it: the same plans and state as plan_prompt with the ids
    router r(128, 8, 0.5, 21);
    llama_moe_cache one = one_layer(128, 80);
    llama_moe_cache two = one_layer(128, 80);
    bank b(two);
    llama_moe_cache_prompt_plan p1;
    llama_moe_cache_prompt_plan p2;
    for (int ub = 0; ub < 6; ub++) {
        const int64_t n_tokens = ub == 3 ? 16 : 512; // a short one: some residents unrouted
        std::vector<int32_t> ids = r.route(n_tokens);
        one.plan_prompt(0, ids.data(), n_tokens, 8, 8, true, p1);
        two.prompt_stage(0, nullptr, 0, 8, 8, true, p2);
        // staged ahead: every resident read, every other expert uploaded
        CHECK(p2.reads.size() == (size_t) (80 - two.layer(0)->n_free) && p2.reads.size() + p2.uploads.size() == 128 &&
                p2.admits.empty(), "ubatch %d: %zu reads, %zu uploads", ub, p2.reads.size(), p2.uploads.size());
        two.prompt_admit(0, ids.data(), n_tokens, 8, 8, p2);
        b.prompt(two, 0, p2);
        CHECK(p1.reads.size() == p2.reads.size() && p1.uploads == p2.uploads && p1.evicted == p2.evicted &&
                p1.admits.size() == p2.admits.size(), "ubatch %d: the two forms differ", ub);
        for (size_t i = 0; i < p1.admits.size(); i++) {
            CHECK(p1.admits[i].expert == p2.admits[i].expert && p1.admits[i].slot == p2.admits[i].slot, "ubatch %d admit %zu", ub, i);
        }
        CHECK(one.layer(0)->expert_of == two.layer(0)->expert_of && one.layer(0)->ref == two.layer(0)->ref, "ubatch %d: states differ", ub);
    }
    const llama_moe_cache_stats a = one.get_stats(0, LLAMA_MOE_CACHE_PHASE_PROMPT);
    const llama_moe_cache_stats c = two.get_stats(0, LLAMA_MOE_CACHE_PHASE_PROMPT);
    CHECK(a.n_ubatches == 6 && a.n_ubatches == c.n_ubatches && a.n_hits == c.n_hits && a.bytes_uploaded == c.bytes_uploaded &&
            a.bytes_copied == c.bytes_copied && a.n_copy_calls == c.n_copy_calls && a.n_fills == c.n_fills, "stats differ");
    check_cache(two);
}

//
// stats and the debug knob
//

static void stats_arithmetic() {
    std::vector<llama_moe_cache_layer_desc> d = { { 0, 16, MiB, 0, 3 }, { 1, 16, 2 * MiB, 0, 2 } };
    llama_moe_cache_sizing s = llama_moe_cache_size_banks(12 * MiB, d);
    CHECK(s.n_slots[0] == 4 && s.n_slots[1] == 4, "%d %d", s.n_slots[0], s.n_slots[1]);
    llama_moe_cache c(d, s);
    llama_moe_cache_decode_plan dp;
    llama_moe_cache_prompt_plan pp;

    // decode, layer 0: {4, 5} -> two misses into slots 0, 1 (one run: 3 calls); {5, 9} -> one hit, one miss (3 calls)
    std::vector<int32_t> ids = { 4, 5 };
    c.plan_decode(0, ids.data(), 1, 2, 2, dp);
    ids = { 5, 9 };
    c.plan_decode(0, ids.data(), 1, 2, 2, dp);
    llama_moe_cache_stats st = c.get_stats(0, LLAMA_MOE_CACHE_PHASE_DECODE);
    CHECK(st.n_ubatches == 2 && st.n_hits == 1 && st.n_misses == 3 && st.n_fills == 3 && st.n_evictions == 0 &&
            st.bytes_uploaded == 3 * MiB && st.bytes_copied == 0 && st.n_copy_calls == 6,
            "ub %llu hits %llu misses %llu up %llu calls %llu", (unsigned long long) st.n_ubatches,
            (unsigned long long) st.n_hits, (unsigned long long) st.n_misses, (unsigned long long) st.bytes_uploaded,
            (unsigned long long) st.n_copy_calls);

    // prompt, layer 1: routes 0-5 (6 tokens of top-1): 4 admitted into free slots 0-3, 2 uploads that stay out;
    // then 0-7: 4 reads (one run), 4 uploads (one run), no admit (all residents routed)
    ids = { 0, 1, 2, 3, 4, 5 };
    c.plan_prompt(1, ids.data(), 6, 1, 1, false, pp);
    CHECK(pp.reads.empty() && pp.uploads.size() == 6 && pp.admits.size() == 4, "%zu %zu %zu", pp.reads.size(),
            pp.uploads.size(), pp.admits.size());
    ids = { 0, 1, 2, 3, 4, 5, 6, 7 };
    c.plan_prompt(1, ids.data(), 8, 1, 1, false, pp);
    CHECK(pp.reads.size() == 4 && pp.uploads.size() == 4 && pp.admits.empty(), "%zu %zu %zu", pp.reads.size(),
            pp.uploads.size(), pp.admits.size());
    st = c.get_stats(1, LLAMA_MOE_CACHE_PHASE_PROMPT);
    // uploads 10 x 2 MiB; device copies: 4 admits + 4 reads; calls: (1 + 1 admit run) + (1 + 1), 2 tensors each
    CHECK(st.n_ubatches == 2 && st.n_hits == 4 && st.n_misses == 10 && st.n_fills == 4 && st.bytes_uploaded == 20 * MiB &&
            st.bytes_copied == 16 * MiB && st.n_copy_calls == 8, "hits %llu misses %llu up %llu copied %llu calls %llu",
            (unsigned long long) st.n_hits, (unsigned long long) st.n_misses, (unsigned long long) st.bytes_uploaded,
            (unsigned long long) st.bytes_copied, (unsigned long long) st.n_copy_calls);
    // phases and layers apart; the sum over layers
    CHECK(c.get_stats(1, LLAMA_MOE_CACHE_PHASE_DECODE).n_ubatches == 0 && c.get_stats(0, LLAMA_MOE_CACHE_PHASE_PROMPT).n_ubatches == 0,
            "stats leaked across layer or phase");
    CHECK(c.get_stats(-1, LLAMA_MOE_CACHE_PHASE_PROMPT).bytes_uploaded == 20 * MiB &&
            c.get_stats(-1, LLAMA_MOE_CACHE_PHASE_DECODE).bytes_uploaded == 3 * MiB, "sum over layers");
    c.reset_stats();
    for (int ph = 0; ph < LLAMA_MOE_CACHE_PHASE_COUNT; ph++) {
        st = c.get_stats(-1, (llama_moe_cache_phase) ph);
        CHECK(st.n_ubatches == 0 && st.n_hits == 0 && st.bytes_uploaded == 0 && st.n_copy_calls == 0, "after reset");
    }
    // the residents are not stats: a reset keeps them
    ids = { 4, 5 };
    CHECK(c.plan_decode(0, ids.data(), 1, 2, 2, dp) && dp.fills.empty(), "%zu fills after reset", dp.fills.size());
}

static void skip_fill() {
    // the same routing with and without the planted fault: the third fill is missing from the plan, the slot map is
    // the same, and the simulated bank catches the stale read
    llama_moe_cache good = one_layer(16, 4);
    llama_moe_cache bad  = one_layer(16, 4);
    bad.debug_skip_fill = 3;
    bank bg(good);
    bank bb(bad);
    llama_moe_cache_decode_plan pg;
    llama_moe_cache_decode_plan pb;
    const std::vector<std::vector<int32_t>> steps = { { 0, 1 }, { 2, 3 }, { 4, 5 }, { 2, 4 } };
    bool caught = false;
    for (size_t i = 0; i < steps.size(); i++) {
        good.plan_decode(0, steps[i].data(), 1, 2, 2, pg);
        bad.plan_decode(0, steps[i].data(), 1, 2, 2, pb);
        CHECK(pg.slot_ids == pb.slot_ids, "step %zu: the knob changed the slot ids", i);
        CHECK(good.layer(0)->expert_of == bad.layer(0)->expert_of, "step %zu: the knob changed the slot map", i);
        if (i == 1) {
            CHECK(pg.fills.size() == 2 && pb.fills.size() == 1 && pb.fills[0].expert == pg.fills[1].expert,
                    "step 1: %zu and %zu fills", pg.fills.size(), pb.fills.size());
        } else {
            CHECK(pg.fills.size() == pb.fills.size(), "step %zu: %zu and %zu fills", i, pg.fills.size(), pb.fills.size());
        }
        bg.decode(good, 0, steps[i], pg);
        try {
            bb.decode(bad, 0, steps[i], pb);
        } catch (const failure &) {
            caught = true;
        }
    }
    CHECK(caught, "the stale slot was never read");
    // prompt admits count as fills too
    llama_moe_cache pc = one_layer(16, 4);
    pc.debug_skip_fill = 2;
    llama_moe_cache_prompt_plan pp;
    std::vector<int32_t> ids = { 0, 1, 2, 3 };
    pc.plan_prompt(0, ids.data(), 4, 1, 1, false, pp);
    CHECK(pp.admits.size() == 3 && pc.layer(0)->n_free == 0, "%zu admits", pp.admits.size());
}

//
// the table of results/expert-cache-planner.md
//

static double top10_share(const std::vector<int32_t> & ids, int32_t n_expert) {
    std::vector<int64_t> n(n_expert, 0);
    for (int32_t e : ids) {
        n[e]++;
    }
    std::sort(n.begin(), n.end(), std::greater<int64_t>());
    const int32_t k = (n_expert + 9) / 10;
    int64_t top = 0;
    for (int32_t i = 0; i < k; i++) {
        top += n[i];
    }
    return (double) top / ids.size();
}

static int sim() {
    const int32_t n_expert = 128;
    const int32_t n_used   = 8;
    const int32_t n_tok    = 4000;
    printf("decode: one layer of %d experts, top-%d, one token per ubatch, %d tokens after %d of warm-up (CLOCK)\n",
            n_expert, n_used, n_tok, 500);
    printf("prompt: 8 ubatches of 512 tokens, experts uploaded per ubatch after the first (mean), resident set vs plain LRU\n\n");
    printf("| skew | top-10%% share | slots | slots / experts | decode hit rate, CLOCK | decode hit rate, LRU | prompt uploads/ub, resident set | prompt uploads/ub, plain LRU |\n");
    printf("|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (double skew : { 0.0, 0.5 }) {
        for (int32_t n_slots : { 16, 32, 64, 96, 112, 128 }) {
            router r(n_expert, n_used, skew, 42);
            const double share = top10_share(r.route(512), n_expert);
            llama_moe_cache c = one_layer(n_expert, n_slots);
            llama_moe_cache_decode_plan p;
            // LRU of one token per ubatch: the same as plain_lru, as slots >= top-k
            plain_lru dlru{ n_slots, {} };
            uint64_t lru_misses = 0;
            for (int it = 0; it < 500 + n_tok; it++) {
                if (it == 500) {
                    c.reset_stats();
                }
                std::vector<int32_t> ids = r.route(1);
                c.plan_decode(0, ids.data(), 1, n_used, n_used, p);
                const uint64_t n = dlru.ubatch(ids, n_expert);
                lru_misses += it >= 500 ? n : 0;
            }
            const llama_moe_cache_stats st = c.get_stats(0, LLAMA_MOE_CACHE_PHASE_DECODE);

            router rp(n_expert, n_used, skew, 43);
            llama_moe_cache cp = one_layer(n_expert, n_slots);
            plain_lru lru{ n_slots, {} };
            llama_moe_cache_prompt_plan pp;
            uint64_t ours = 0;
            uint64_t theirs = 0;
            for (int ub = 0; ub < 8; ub++) {
                std::vector<int32_t> ids = rp.route(512);
                cp.plan_prompt(0, ids.data(), 512, n_used, n_used, false, pp);
                const uint64_t n_lru = lru.ubatch(ids, n_expert);
                if (ub > 0) {
                    ours += pp.uploads.size();
                    theirs += n_lru;
                }
            }
            printf("| %.1f | %.3f | %d | %.3f | %.3f | %.3f | %.1f | %.1f |\n", skew, share, n_slots, (double) n_slots / n_expert,
                    (double) st.n_hits / (st.n_hits + st.n_misses), 1.0 - (double) lru_misses / ((uint64_t) n_tok * n_used),
                    ours / 7.0, theirs / 7.0);
        }
    }
    return 0;
}

static void whole_layer() {
    // A layer with a slot per expert keeps each expert in its own slot, whichever path filled it: decode misses in
    // the routing's order, routed prompt admits and unrouted ones. It is whole once every expert is resident, then
    // never plans a fill again; a layer with fewer slots than experts is never whole, even with no slot free.
    router r(16, 4, 0.5, 11);
    llama_moe_cache c = one_layer(16, 16);
    bank b(c);
    llama_moe_cache_decode_plan d;
    int steps = 0;
    while (!c.whole(0)) {
        CHECK(++steps < 1000, "not whole after %d decode steps", steps);
        const std::vector<int32_t> ids = r.route(1);
        CHECK(c.plan_decode(0, ids.data(), 1, 4, 4, d), "overflow");
        b.decode(c, 0, ids, d);
        for (const llama_moe_cache_fill & f : d.fills) {
            CHECK(f.slot == f.expert, "decode put expert %d in slot %d", f.expert, f.slot);
        }
        check_cache(c);
    }
    const llama_moe_cache_stats before = c.get_stats(0, LLAMA_MOE_CACHE_PHASE_DECODE);
    CHECK(before.n_fills == 16 && before.n_evictions == 0, "%" PRIu64 " fills, %" PRIu64 " evictions", before.n_fills, before.n_evictions);
    for (int t = 0; t < 50; t++) {
        const std::vector<int32_t> ids = r.route(2);
        CHECK(c.plan_decode(0, ids.data(), 2, 4, 4, d) && d.fills.empty(), "a whole layer planned %zu fills", d.fills.size());
        b.decode(c, 0, ids, d);
    }
    CHECK(c.whole(0), "a whole layer stopped being whole");

    // prompts: routed admits (plan_prompt) into a half-filled layer, then unrouted ones (the scheduler's fills)
    llama_moe_cache p = one_layer(16, 16);
    llama_moe_cache_prompt_plan pp;
    const std::vector<int32_t> half = { 9, 3, 14, 1, 6, 11, 0, 12 }; // 2 tokens x 4: 8 experts, not in order
    p.plan_prompt(0, half.data(), 2, 4, 4, false, pp);
    CHECK(pp.admits.size() == 8 && !p.whole(0), "%zu admits", pp.admits.size());
    p.prompt_stage(0, nullptr, 0, 4, 4, true, pp);
    p.prompt_admit(0, nullptr, 0, 4, 4, pp);
    CHECK(pp.reads.size() == 8 && pp.admits.size() == 8 && p.whole(0), "%zu reads, %zu admits", pp.reads.size(), pp.admits.size());
    for (int32_t e = 0; e < 16; e++) {
        CHECK(p.layer(0)->slot_of[e] == e, "expert %d in slot %d", e, p.layer(0)->slot_of[e]);
    }
    // taking back the last admits leaves their own slots free, and the next fill puts them back there
    p.unadmit(0, pp.admits);
    CHECK(!p.whole(0) && p.layer(0)->n_free == 8, "%d free", p.layer(0)->n_free);
    p.prompt_stage(0, nullptr, 0, 4, 4, true, pp);
    p.prompt_admit(0, nullptr, 0, 4, 4, pp);
    CHECK(p.whole(0), "not whole after the admits came back");

    // fewer slots than experts: full, never whole
    llama_moe_cache q = one_layer(16, 12);
    q.prompt_stage(0, nullptr, 0, 4, 4, true, pp);
    q.prompt_admit(0, nullptr, 0, 4, 4, pp);
    CHECK(q.layer(0)->n_free == 0 && !q.whole(0), "%d free, whole %d", q.layer(0)->n_free, (int) q.whole(0));

    // steps read in place are counted in their phase, as steps
    c.note_in_place(0, LLAMA_MOE_CACHE_PHASE_PROMPT, 512 * 2);
    c.note_in_place(0, LLAMA_MOE_CACHE_PHASE_DECODE, 2);
    c.note_in_place(0, LLAMA_MOE_CACHE_PHASE_DECODE, 2);
    const llama_moe_cache_stats pr = c.get_stats(-1, LLAMA_MOE_CACHE_PHASE_PROMPT);
    const llama_moe_cache_stats de = c.get_stats(-1, LLAMA_MOE_CACHE_PHASE_DECODE);
    CHECK(pr.n_in_place == 1 && pr.n_ubatches == 1 && de.n_in_place == 2 && de.n_ubatches == before.n_ubatches + 50 + 2 &&
            de.n_fills == 16, "prompt %" PRIu64 "/%" PRIu64 ", decode %" PRIu64 "/%" PRIu64, pr.n_in_place, pr.n_ubatches,
            de.n_in_place, de.n_ubatches);
    // ... with the ids they routed (all hits)
    CHECK(pr.n_routed_in_place == 1024 && de.n_routed_in_place == before.n_routed_in_place + 4, "routed in place %" PRIu64
            " / %" PRIu64, pr.n_routed_in_place, de.n_routed_in_place);
}

static void fill_whole() {
    // A layer with a slot per expert is made whole at once: the experts already resident stay, each other one is an
    // upload into its own slot, and decode then reads every routed expert without a fill. Refused (nothing changed)
    // for a layer with fewer slots than experts, and for one whose slot holds another expert (a state no planner of
    // a whole-size layer makes, given by hand). The planted stale slot (debug_skip_fill) applies here too.
    router r(16, 4, 0.5, 5);
    llama_moe_cache c = one_layer(16, 16);
    bank b(c);
    llama_moe_cache_decode_plan d;
    const std::vector<int32_t> first = r.route(1);
    CHECK(c.plan_decode(0, first.data(), 1, 4, 4, d) && d.fills.size() == 4, "%zu fills", d.fills.size());
    b.decode(c, 0, first, d);
    std::vector<llama_moe_cache_fill> fills;
    CHECK(c.fill_whole(0, fills) && fills.size() == 12 && c.whole(0), "%zu fills, whole %d", fills.size(), (int) c.whole(0));
    for (size_t i = 0; i < fills.size(); i++) {
        CHECK(fills[i].slot == fills[i].expert && c.layer(0)->slot_of[fills[i].expert] == fills[i].expert &&
                (i == 0 || fills[i].expert > fills[i - 1].expert), "fill %zu: expert %d into slot %d", i, fills[i].expert,
                fills[i].slot);
        CHECK(std::find(first.begin(), first.end(), fills[i].expert) == first.end(), "resident expert %d uploaded again",
                fills[i].expert);
        b.of(c, 0)[fills[i].slot] = fills[i].expert;
    }
    check_cache(c);
    // no phase counts it; decode after it only hits
    const llama_moe_cache_stats st = c.get_stats(0, LLAMA_MOE_CACHE_PHASE_DECODE);
    CHECK(st.n_fills == 4 && c.get_stats(0, LLAMA_MOE_CACHE_PHASE_PROMPT).n_fills == 0, "%" PRIu64 " decode fills", st.n_fills);
    for (int t = 0; t < 20; t++) {
        const std::vector<int32_t> ids = r.route(1);
        CHECK(c.plan_decode(0, ids.data(), 1, 4, 4, d) && d.fills.empty(), "a whole layer planned %zu fills", d.fills.size());
        b.decode(c, 0, ids, d);
    }
    CHECK(c.fill_whole(0, fills) && fills.empty(), "a whole layer listed %zu fills", fills.size());
    // a clear that keeps whole layers keeps this one (a stopped graph did not touch it); a plain clear empties it
    c.clear(true);
    CHECK(c.whole(0), "clear(keep_whole) emptied a whole layer");
    c.clear();
    CHECK(!c.whole(0) && c.layer(0)->n_free == 16, "%d free after clear", c.layer(0)->n_free);

    // fewer slots than experts: refused, unchanged
    llama_moe_cache q = one_layer(16, 12);
    CHECK(!q.fill_whole(0, fills) && fills.empty() && q.layer(0)->n_free == 12, "%zu fills, %d free", fills.size(),
            q.layer(0)->n_free);
    // a slot holding another expert: refused, unchanged
    llama_moe_cache m = one_layer(16, 16);
    m.layers[0].slot_of[3] = 5;
    m.layers[0].expert_of[5] = 3;
    m.layers[0].n_free--;
    CHECK(!m.fill_whole(0, fills) && fills.empty() && m.layers[0].n_free == 15, "%zu fills, %d free", fills.size(),
            m.layers[0].n_free);

    // the planted stale slot: the 3rd fill is recorded resident but not listed
    llama_moe_cache k = one_layer(16, 16);
    k.debug_skip_fill = 3;
    CHECK(k.fill_whole(0, fills) && fills.size() == 15 && k.whole(0), "%zu fills", fills.size());
    CHECK(std::none_of(fills.begin(), fills.end(), [](const llama_moe_cache_fill & f) { return f.expert == 2; }),
            "the planted fill was listed");
}

static void lookup_handover() {
    // The decode lookup of ggml-moe-cache-lookup.h is what plan_decode runs; a device keeps the same flat state. Two
    // planners driven by the same skewed routing, one of which hands its state to a flat copy (as to a device) for
    // 200 tokens and takes it back, plan the same slots and fills at every step and end in the same state. The flat
    // copy is the op's (GGML_OP_MOE_CACHE_LOOKUP): its state layout, its scratch in one piece, its dst.
    router r(128, 8, 0.5, 23);
    llama_moe_cache a = one_layer(128, 40), b = one_layer(128, 40);
    llama_moe_cache_layer & lb = b.layers[0];
    std::vector<int32_t> flat(ggml_moe_cache_state_size(128, 40), -9);
    const ggml_moe_cache_state dev = ggml_moe_cache_state_flat(flat.data(), 128, 40);
    std::vector<uint8_t> scratch(ggml_moe_cache_scratch_size(128, 40), 0);
    const ggml_moe_cache_scratch sc = ggml_moe_cache_scratch_at(scratch.data(), 128, 40);
    std::vector<int32_t> dst;
    llama_moe_cache_decode_plan pa, pb;
    uint64_t want_hits = 0, want_misses = 0;
    for (int t = 0; t < 600; t++) {
        const int64_t n_tokens = 1 + t % 4;
        const std::vector<int32_t> ids = r.route(n_tokens);
        CHECK(a.plan_decode(0, ids.data(), n_tokens, 8, 8, pa), "overflow at %d", t);
        const bool on_device = t >= 200 && t < 400;
        if (t == 200) { // hand over: the planner's state to the flat copy (as the cache uploads it)
            b.get_state(0, flat.data());
            CHECK(std::find(flat.begin(), flat.end(), -9) == flat.end(), "the flat state has a hole");
        }
        if (t == 400) { // and back, with the counts of the lookups made on the copy
            CHECK(ggml_moe_cache_counter_get(dev.counters, GGML_MOE_CACHE_COUNT_LOOKUPS) == 200 &&
                    ggml_moe_cache_counter_get(dev.counters, GGML_MOE_CACHE_COUNT_HITS) == want_hits &&
                    ggml_moe_cache_counter_get(dev.counters, GGML_MOE_CACHE_COUNT_MISSES) == want_misses &&
                    ggml_moe_cache_counter_get(dev.counters, GGML_MOE_CACHE_COUNT_REFUSED) == 0,
                    "the device counters differ from the plans");
            // a corrupt copy is refused and changes nothing
            std::vector<int32_t> bad = flat;
            const ggml_moe_cache_state bs = ggml_moe_cache_state_flat(bad.data(), 128, 40);
            *bs.n_free += 1;
            const llama_moe_cache_layer kept = lb;
            std::string why;
            CHECK(!b.set_state(0, bad.data(), why) && lb.slot_of == kept.slot_of && lb.expert_of == kept.expert_of,
                    "a corrupt state was taken back");
            CHECK(b.set_state(0, flat.data(), why), "the state was refused: %s", why.c_str());
        }
        if (on_device) {
            // the slot and cold ids and the tail of a lookup (in the op's tensor the tail comes first, then the ids)
            const ggml_moe_cache_tail_layout d = ggml_moe_cache_tail_layout_of(40);
            dst.assign(2 * 8 * n_tokens + d.size, -1);
            int32_t * tail = dst.data() + 2 * 8 * n_tokens;
            const int32_t n = ggml_moe_cache_lookup_to_dst(&dev, sc, ids.data(), n_tokens, 8, 8, GGML_MOE_CACHE_FILL_ALL,
                    dst.data(), tail);
            CHECK(n == (int32_t) pa.fills.size() && tail[d.result] == n && tail[d.n_distinct] == pa.n_distinct &&
                    tail[d.n_cold] == 0 && std::all_of(dst.begin() + 8 * n_tokens, dst.begin() + 16 * n_tokens,
                    [](int32_t c) { return c == -1; }), "step %d: %d fills, %zu planned", t, n, pa.fills.size());
            want_hits   += pa.n_distinct - n;
            want_misses += n;
            CHECK(std::equal(pa.slot_ids.begin(), pa.slot_ids.end(), dst.begin()) && (int64_t) pa.slot_ids.size() == 8 * n_tokens,
                    "step %d: slot ids differ", t);
            for (int32_t i = 0; i < 40; i++) {
                const bool fill = i < n;
                CHECK(tail[d.fill_expert + i] == (fill ? pa.fills[i].expert : -1) && tail[d.fill_slot + i] == (fill ? pa.fills[i].slot : -1) &&
                        (fill || tail[d.evicted + i] == -1), "step %d fill %d differs", t, i);
            }
            for (int64_t i = 0; i < 128 + 40; i++) {
                CHECK(sc.marks[i] == 0, "step %d: scratch marks left set", t);
            }
        } else {
            CHECK(b.plan_decode(0, ids.data(), n_tokens, 8, 8, pb), "overflow at %d", t);
            CHECK(pb.slot_ids == pa.slot_ids && pb.fills.size() == pa.fills.size(), "step %d differs", t);
        }
    }
    const llama_moe_cache_layer & la = a.layers[0];
    CHECK(la.slot_of == lb.slot_of && la.expert_of == lb.expert_of && la.ref == lb.ref && la.hand == lb.hand &&
            la.n_free == lb.n_free, "the states differ after the handover");
    check_cache(b);
    // the use counts (the expert cache profile) travelled with the state: the same as those of the planner that never
    // handed over, summing to its hits and misses (each distinct expert once per lookup)
    const llama_moe_cache_stats sa = a.get_stats(0, LLAMA_MOE_CACHE_PHASE_DECODE);
    uint64_t sum_uses = 0;
    for (int32_t u : la.uses) {
        sum_uses += (uint64_t) u;
    }
    CHECK(la.uses == lb.uses, "the use counts differ after the handover");
    CHECK(sum_uses == sa.n_hits + sa.n_misses && sum_uses > 0, "uses %" PRIu64 ", hits + misses %" PRIu64, sum_uses,
            sa.n_hits + sa.n_misses);

    // bad input, as a device would get it without the host's checks, changes nothing and leaves the marks clear:
    // an id out of range (-2), a state whose free count or slots disagree (-3); a hand out of range is taken as 0
    llama_moe_cache_layer & l = b.layers[0];
    std::vector<uint8_t> marks(128 + 40, 0);
    std::vector<int32_t> distinct(128), fe(40), fs(40), fo(40), slot_ids, cold_ids;
    auto lookup = [&](const std::vector<int32_t> & ids) {
        const ggml_moe_cache_state st = { 128, 40, l.slot_of.data(), l.expert_of.data(), l.ref.data(), &l.hand, &l.n_free, nullptr };
        slot_ids.assign(ids.size(), -7);
        cold_ids.assign(ids.size(), -7);
        int32_t n_distinct = 0, n_cold = 0;
        const int32_t n = ggml_moe_cache_lookup_slots(&st, { marks.data(), distinct.data() }, ids.data(), 1, (int32_t) ids.size(),
                (int64_t) ids.size(), GGML_MOE_CACHE_FILL_ALL, slot_ids.data(), cold_ids.data(), fe.data(), fs.data(),
                fo.data(), &n_distinct, &n_cold);
        for (uint8_t m : marks) {
            CHECK(m == 0, "marks left set after a lookup that returned %d", n);
        }
        return n;
    };
    const llama_moe_cache_layer before = l;
    for (const std::vector<int32_t> & ids : { std::vector<int32_t>{ 3, 128 }, std::vector<int32_t>{ -1, 3 } }) {
        CHECK(lookup(ids) == -2 && slot_ids == std::vector<int32_t>(2, 0) && cold_ids == std::vector<int32_t>(2, -1),
                "an id out of range");
        CHECK(l.slot_of == before.slot_of && l.ref == before.ref && l.hand == before.hand, "changed by bad ids");
    }
    l.n_free++;
    CHECK(lookup({ 5, 6 }) == -3 && l.slot_of == before.slot_of, "a free count that disagrees");
    l.n_free--;
    const int32_t e = l.expert_of[0];
    l.expert_of[0] = 1000;
    CHECK(lookup({ 5, 6 }) == -3, "a slot holding an expert out of range");
    l.expert_of[0] = e;
    l.hand = -3;
    CHECK(lookup({ 5, 6 }) >= 0 && l.hand >= 0 && l.hand < 40, "hand %d", l.hand);
    check_cache(b);
}

static void profile_counts() {
    // The expert cache profile's counts: the lookup adds 1 per distinct expert of a lookup that plans (repeats within a
    // ubatch once), nothing for an overflow; saturating at INT32_MAX; a seed adds its routed tokens to prompt_uses.
    llama_moe_cache c = one_layer(16, 4);
    llama_moe_cache_decode_plan p;
    const std::vector<int32_t> two = { 3, 5, 3, 7 }; // 2 tokens of 2: experts 3, 5, 7
    CHECK(c.plan_decode(0, two.data(), 2, 2, 2, p), "overflow");
    const llama_moe_cache_layer & l = *c.layer(0);
    CHECK(l.uses[3] == 1 && l.uses[5] == 1 && l.uses[7] == 1 && l.uses[0] == 0, "uses %d %d %d", l.uses[3], l.uses[5], l.uses[7]);
    const std::vector<int32_t> many = { 0, 1, 2, 4, 6 }; // 5 distinct experts > 4 slots: the staging path
    CHECK(!c.plan_decode(0, many.data(), 1, 5, 5, p), "no overflow");
    CHECK(l.uses[0] == 0 && l.uses[1] == 0, "an overflow was counted");
    // saturation, in the flat state a device keeps as in the planner's
    std::vector<int32_t> flat(ggml_moe_cache_state_size(16, 4), 0);
    c.get_state(0, flat.data());
    const ggml_moe_cache_state st = ggml_moe_cache_state_flat(flat.data(), 16, 4);
    CHECK(st.uses[3] == 1 && st.uses + 16 == flat.data() + flat.size(), "the flat uses are not the state's tail");
    CHECK(ggml_moe_cache_state_counted_offset(16, 4) + ggml_moe_cache_state_counted_size(16) == (int64_t) flat.size() &&
            flat.data() + ggml_moe_cache_state_counted_offset(16, 4) == st.counters, "the counted tail's offsets");
    st.uses[5] = INT32_MAX;
    std::vector<uint8_t> scratch(ggml_moe_cache_scratch_size(16, 4), 0);
    std::vector<int32_t> dst(4 + ggml_moe_cache_tail_layout_of(4).size, -1);
    const std::vector<int32_t> one = { 5, 9 };
    CHECK(ggml_moe_cache_lookup_to_dst(&st, ggml_moe_cache_scratch_at(scratch.data(), 16, 4), one.data(), 1, 2, 2,
            GGML_MOE_CACHE_FILL_ALL, dst.data(), dst.data() + 4) >= 0, "refused");
    CHECK(st.uses[5] == INT32_MAX && st.uses[9] == 1, "uses %d %d", st.uses[5], st.uses[9]);
    std::string why;
    CHECK(c.set_state(0, flat.data(), why), "%s", why.c_str());
    CHECK(l.uses[5] == INT32_MAX && l.uses[9] == 1 && l.uses[3] == 1, "the uses were not taken back");
    c.set_uses(0, std::vector<int32_t>(16, 2).data());
    CHECK(l.uses == std::vector<int32_t>(16, 2), "set_uses");
    // a seed counts its routed tokens (repeats too) as prompt routing; decode's counts stay
    std::vector<int32_t> routing;
    for (int t = 0; t < 10; t++) {
        routing.push_back(t % 3);
        routing.push_back(10 + t % 2);
    }
    std::vector<llama_moe_cache_fill> fills;
    c.seed(0, routing.data(), 10, 2, 2, fills);
    CHECK(l.prompt_uses[0] == 4 && l.prompt_uses[1] == 3 && l.prompt_uses[10] == 5 && l.prompt_uses[11] == 5 &&
            l.prompt_uses[5] == 0 && l.uses == std::vector<int32_t>(16, 2), "prompt uses %d %d %d", l.prompt_uses[0],
            l.prompt_uses[10], l.prompt_uses[5]);
    // clear() keeps the counts: they are the context's, not the residents'
    c.clear();
    CHECK(l.uses == std::vector<int32_t>(16, 2) && l.prompt_uses[0] == 4, "clear() dropped the counts");
}

static void profile_preload() {
    // A profile's experts, ranked, fill the free slots (own slot first, as every planner places them), listed by slot;
    // a full layer takes no more, residents are skipped, nothing is counted as a step
    llama_moe_cache c = one_layer(64, 16);
    bank b(c);
    std::vector<int32_t> ranked = { 40, 3, 63, 17, 15, 0 };
    for (int32_t e = 20; e < 34; e++) {
        ranked.push_back(e);
    }
    std::vector<llama_moe_cache_fill> fills;
    CHECK(c.preload(0, ranked, fills) == 16 && fills.size() == 16, "%zu fills", fills.size());
    const llama_moe_cache_layer & l = *c.layer(0);
    for (size_t i = 0; i < ranked.size(); i++) {
        CHECK((l.slot_of[ranked[i]] >= 0) == (i < 16), "rank %zu (expert %d) resident %d", i, ranked[i], l.slot_of[ranked[i]]);
    }
    CHECK(l.slot_of[40] == 0 && l.slot_of[3] == 3 && l.slot_of[15] == 15 && l.slot_of[0] == 4, "own slot where free, else the lowest");
    for (size_t i = 1; i < fills.size(); i++) {
        CHECK(fills[i].slot > fills[i - 1].slot, "fills not sorted by slot");
    }
    CHECK(c.get_stats(0, LLAMA_MOE_CACHE_PHASE_DECODE).n_ubatches == 0 && c.get_stats(0, LLAMA_MOE_CACHE_PHASE_PROMPT).n_fills == 0,
            "a preload counted as a step");
    check_cache(c);
    CHECK(c.preload(0, { 50, 51 }, fills) == 0 && fills.empty(), "a full layer took more");
    // the first decode token of the profile's top experts hits
    llama_moe_cache_decode_plan p;
    const std::vector<int32_t> top = { 40, 3, 63, 17 };
    CHECK(c.plan_decode(0, top.data(), 1, 4, 4, p) && p.fills.empty(), "%zu misses", p.fills.size());
    // the planted stale slot counts a preload's fills too
    llama_moe_cache k = one_layer(64, 16);
    k.debug_skip_fill = 2;
    CHECK(k.preload(0, ranked, fills) == 16 && fills.size() == 15 && k.layer(0)->slot_of[3] >= 0, "%zu fills", fills.size());
    CHECK(std::none_of(fills.begin(), fills.end(), [](const llama_moe_cache_fill & f) { return f.expert == 3; }),
            "the planted fill was listed");
    (void) b;
}

// the hit rate of the next n_tokens tokens decoded one at a time from the router's draws, on the cache as it is
static double decode_hit_rate(llama_moe_cache & c, bank & b, router & r, int n_tokens) {
    llama_moe_cache_decode_plan p;
    const uint64_t h0 = c.get_stats(0, LLAMA_MOE_CACHE_PHASE_DECODE).n_hits;
    const uint64_t m0 = c.get_stats(0, LLAMA_MOE_CACHE_PHASE_DECODE).n_misses;
    for (int t = 0; t < n_tokens; t++) {
        const std::vector<int32_t> ids = r.route(1);
        CHECK(c.plan_decode(0, ids.data(), 1, r.n_used, r.n_used, p), "token %d overflowed", t);
        b.decode(c, 0, ids, p);
    }
    const llama_moe_cache_stats st = c.get_stats(0, LLAMA_MOE_CACHE_PHASE_DECODE);
    return double(st.n_hits - h0) / double(st.n_hits - h0 + st.n_misses - m0);
}

static void seed_ref_bits() {
    // after a seed only the higher-scored half of the new set keeps its CLOCK reference bit, and residents outside the
    // set (a profile's experts the prompt did not route) keep none, so decode's first misses evict those first (the
    // cold read's planted case: 8 experts, 4 slots, a profile's 4 and 5, a prompt routing 0 five times and 1 three
    // times; the next token's misses must evict 4 and 5, not 1)
    llama_moe_cache c = one_layer(8, 4);
    std::vector<llama_moe_cache_fill> fills;
    CHECK(c.preload(0, { 4, 5 }, fills) == 2, "preload");
    llama_moe_cache_prompt_plan p;
    c.prompt_stage(0, nullptr, 0, 1, 1, true, p);
    c.prompt_admit(0, nullptr, 0, 1, 1, p);
    const std::vector<int32_t> ids = { 0, 0, 0, 0, 0, 1, 1, 1 };
    c.seed(0, ids.data(), (int64_t) ids.size(), 1, 1, fills);
    check_cache(c);
    const llama_moe_cache_layer & l = *c.layer(0);
    CHECK(l.slot_of[0] >= 0 && l.slot_of[1] >= 0, "the routed experts are resident");
    CHECK(l.ref[l.slot_of[0]] == 1 && l.ref[l.slot_of[1]] == 0, "the higher-scored half keeps its bit: %d %d",
            l.ref[l.slot_of[0]], l.ref[l.slot_of[1]]);
    for (int32_t e : { 4, 5 }) {
        CHECK(l.slot_of[e] < 0 || l.ref[l.slot_of[e]] == 0, "expert %d outside the set kept its bit", e);
    }
    llama_moe_cache_decode_plan d;
    const std::vector<int32_t> next = { 2, 3 };
    CHECK(c.plan_decode(0, next.data(), 1, 2, 2, d), "plan");
    CHECK(l.slot_of[0] >= 0 && l.slot_of[1] >= 0, "a miss evicted a routed expert before the unrouted 4 and 5");
    // a one-expert set keeps its bit (the higher half rounds up)
    llama_moe_cache one = one_layer(8, 4);
    const std::vector<int32_t> single = { 6, 6 };
    one.seed(0, single.data(), 2, 1, 1, fills);
    CHECK(one.layer(0)->ref[one.layer(0)->slot_of[6]] == 1, "a set of one lost its bit");
}

static void seed_by_routing() {
    // a prompt of 4 ubatches of 512 tokens staged ahead of the router fills 32 of 128 slots with experts 0-31 (the
    // admits without routing); seeding from the last ubatch's routing makes the 32 experts of the highest scores
    // resident instead, keeping the residents among them where they are. The first decode tokens then hit more often
    // than on the unseeded cache, drawn the same way
    const int32_t n_slots = 32;
    llama_moe_cache seeded = one_layer(128, n_slots), plain = one_layer(128, n_slots);
    bank bs(seeded), bp(plain);
    router r(128, 8, 2.0, 11);
    llama_moe_cache_prompt_plan p;
    std::vector<int32_t> last;
    for (int ub = 0; ub < 4; ub++) {
        last = r.route(512);
        for (llama_moe_cache * c : { &seeded, &plain }) {
            c->prompt_stage(0, nullptr, 0, 8, 8, true, p);
            c->prompt_admit(0, nullptr, 0, 8, 8, p);
            (c == &seeded ? bs : bp).prompt(*c, 0, p);
        }
    }
    const std::vector<int32_t> before = seeded.layer(0)->slot_of;
    std::vector<llama_moe_cache_fill> fills;
    seeded.seed(0, last.data(), 512, 8, 8, fills);
    check_cache(seeded);
    const llama_moe_cache_layer & l = *seeded.layer(0);
    // the resident set is the top 32 of the scores (one seeded ubatch: its routed tokens)
    std::vector<int32_t> cnt(128, 0), order(128);
    for (int32_t e : last) {
        cnt[e]++;
    }
    for (int32_t e = 0; e < 128; e++) {
        order[e] = e;
    }
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
        return cnt[a] != cnt[b] ? cnt[a] > cnt[b] : (before[a] >= 0) != (before[b] >= 0) ? before[a] >= 0 : a < b;
    });
    int kept = 0;
    for (int32_t i = 0; i < 128; i++) {
        const int32_t e = order[i];
        CHECK((l.slot_of[e] >= 0) == (i < n_slots), "expert %d (rank %d, %d tokens) resident: %d", e, i, cnt[e], l.slot_of[e]);
        if (i < n_slots && before[e] >= 0) {
            CHECK(l.slot_of[e] == before[e], "resident %d moved from slot %d to %d", e, before[e], l.slot_of[e]);
            kept++;
        }
    }
    CHECK((int) fills.size() == n_slots - kept && fills.size() > 0, "%zu fills, %d kept", fills.size(), kept);
    for (size_t i = 0; i < fills.size(); i++) {
        CHECK(i == 0 || fills[i].slot > fills[i - 1].slot, "fills sorted by slot");
        CHECK(l.slot_of[fills[i].expert] == fills[i].slot, "fill %zu: expert %d into slot %d", i, fills[i].expert, fills[i].slot);
        bs.held[0][fills[i].slot] = fills[i].expert; // the copy staged -> slot
    }
    const llama_moe_cache_stats st = seeded.get_stats(0, LLAMA_MOE_CACHE_PHASE_PROMPT);
    CHECK(st.n_seeded == fills.size() && st.n_evictions == fills.size(), "%" PRIu64 " seeded, %" PRIu64 " evictions",
            st.n_seeded, st.n_evictions);
    // the next 16 tokens, routed alike on both caches
    router r1 = r;
    const double hit_seeded = decode_hit_rate(seeded, bs, r, 16), hit_plain = decode_hit_rate(plain, bp, r1, 16);
    CHECK(hit_seeded > hit_plain + 0.1, "first 16 tokens: %.3f seeded, %.3f not", hit_seeded, hit_plain);

    // a layer with a slot per expert (16 of 16), two experts resident: seeding puts each routed expert into its own
    // slot and evicts nothing
    llama_moe_cache w = one_layer(16, 16);
    const int32_t two[] = { 3, 9 };
    llama_moe_cache_decode_plan dp;
    CHECK(w.plan_decode(0, two, 1, 2, 2, dp), "decode");
    const int32_t ids[] = { 1, 3, 5, 7, 1, 3, 5, 7 };
    w.seed(0, ids, 2, 4, 4, fills);
    check_cache(w);
    CHECK(fills.size() == 3, "%zu fills (1, 5, 7; 3 and 9 are resident)", fills.size());
    for (const llama_moe_cache_fill & f : fills) {
        CHECK(f.slot == f.expert, "expert %d into slot %d", f.expert, f.slot);
    }
    CHECK(w.get_stats(0, LLAMA_MOE_CACHE_PHASE_PROMPT).n_evictions == 0, "evictions in a layer with a slot per expert");

    // a seed whose graph did not stage all of the layer's bytes is taken back with the admits of that graph, some of
    // which the seed replaced (those are skipped): every slot is free again; what stays counted is the admits the seed
    // evicted (made resident, then replaced)
    llama_moe_cache u = one_layer(128, 8);
    u.prompt_stage(0, nullptr, 0, 8, 8, true, p);
    u.prompt_admit(0, nullptr, 0, 8, 8, p);
    const std::vector<llama_moe_cache_fill> admits = p.admits;
    u.seed(0, last.data(), 512, 8, 8, fills);
    CHECK(!fills.empty() && fills.size() < 8, "%zu seed fills over 8 admits", fills.size());
    u.unadmit(0, fills, true);
    u.unadmit(0, admits);
    check_cache(u);
    const llama_moe_cache_stats us = u.get_stats(0, LLAMA_MOE_CACHE_PHASE_PROMPT);
    CHECK(u.layer(0)->n_free == 8 && us.n_fills == us.n_evictions && us.n_evictions == fills.size() && us.n_seeded == 0,
            "%d free, %" PRIu64 " fills, %" PRIu64 " evictions, %" PRIu64 " seeded", u.layer(0)->n_free, us.n_fills,
            us.n_evictions, us.n_seeded);

    // the planted stale slot counts seed fills too: recorded, its copy left out
    llama_moe_cache k = one_layer(128, 8);
    k.debug_skip_fill = 2;
    k.seed(0, last.data(), 4, 8, 8, fills);
    CHECK(fills.size() == 7 && k.get_stats(0, LLAMA_MOE_CACHE_PHASE_PROMPT).n_seeded == 8, "%zu fills of 8 seeded", fills.size());
    check_cache(k);
}

// `t first-tokens`: results/expert-cache-seeding-and-profiles.md's planner-only estimate for the H200 measurement of the first tokens
// after a prompt: the 30B-A3B shape (128 experts, top-8, skew 0.5) with 64 slots, 8 prompt ubatches of 512 staged
// ahead of the router, then 16 decode tokens, 96 more, and 16 steady ones; the mean hit rates over 40 draws
static int first_tokens_sim() {
    // a profile: the experts ranked by the routings of 2000 tokens of another draw of the same router (the popularity a
    // saved profile holds), preloaded before the prompt as a new cache does
    const struct { bool seeded, profile; const char * name; } settings[] = {
        { false, false, "not seeded" }, { true, false, "seeded" }, { false, true, "profile" }, { true, true, "profile+seeded" } };
    for (const auto & setting : settings) {
        const bool seeded = setting.seeded;
        double first = 0, steady = 0;
        const int n_draws = 40;
        for (int draw = 0; draw < n_draws; draw++) {
            llama_moe_cache c = one_layer(128, 64);
            router r(128, 8, 0.5, 100 + draw);
            if (setting.profile) {
                router other = r; // the same experts' popularity, other tokens
                other.rng.seed(9000 + draw);
                std::vector<int64_t> count(128, 0);
                for (int32_t e : other.route(2000)) {
                    count[e]++;
                }
                std::vector<int32_t> ranked(128);
                for (int32_t e = 0; e < 128; e++) {
                    ranked[e] = e;
                }
                std::stable_sort(ranked.begin(), ranked.end(), [&count](int32_t a, int32_t b) { return count[a] > count[b]; });
                std::vector<llama_moe_cache_fill> pre;
                c.preload(0, ranked, pre);
            }
            llama_moe_cache_prompt_plan p;
            std::vector<int32_t> last;
            for (int ub = 0; ub < 8; ub++) {
                last = r.route(512);
                c.prompt_stage(0, nullptr, 0, 8, 8, true, p);
                c.prompt_admit(0, nullptr, 0, 8, 8, p);
            }
            std::vector<llama_moe_cache_fill> fills;
            if (seeded) {
                c.seed(0, last.data(), 512, 8, 8, fills);
            }
            bank b(c);
            for (const llama_moe_cache_layer & l : c.layers) {
                for (int32_t s = 0; s < l.n_slots; s++) {
                    b.held[0][s] = l.expert_of[s];
                }
            }
            first += decode_hit_rate(c, b, r, 16) / n_draws;
            decode_hit_rate(c, b, r, 96);
            steady += decode_hit_rate(c, b, r, 16) / n_draws;
        }
        printf("%s: first 16 tokens hit %.3f, steady 16 (after 112) %.3f\n", setting.name, first, steady);
    }
    return 0;
}

// The lookup's phases with the state's check split over T threads (first t, step T, totals summed) and each miss
// taken apart, as the CUDA kernel runs them, leave what the whole lookup on one thread leaves: state, slot and cold
// ids, tail, counters, status and marks, over random states (consistent, full, a wrong free count, a slot holding an
// expert out of range, a hand out of range; up to 300 slots, so CLOCK walks many windows), routings (hits, misses,
// evictions, more experts than slots, ids out of range) and miss policies (every miss, none, a few). Every lookup that
// plans leaves each routed id hot (its slot holds it) or cold (its expert in the cold ids), fills at most the policy's
// misses, and leaves cold only the misses past the policy or the slots. And CLOCK's window walk against the walk a slot
// at a time.
static void lookup_split_check() {
    std::mt19937 rng(7);
    int n_paths[6] = {};
    for (int it = 0; it < 20000; it++) {
        const int32_t ne = 2 + (int32_t) (rng() % (it % 2 ? 64 : 300)), ns = 1 + (int32_t) (rng() % ne);
        const int32_t nu = 1 + (int32_t) (rng() % std::min(ne, 8)), nt = 1 + (int32_t) (rng() % 4);
        std::vector<int32_t> a(ggml_moe_cache_state_size(ne, ns), 0);
        ggml_moe_cache_state sa = ggml_moe_cache_state_flat(a.data(), ne, ns);
        std::fill(sa.slot_of, sa.slot_of + ne, -1);
        std::fill(sa.expert_of, sa.expert_of + ns, -1);
        int32_t n_free = ns;
        if (it % 3 == 0) { // every slot taken: misses evict
            std::vector<int32_t> perm(ne);
            std::iota(perm.begin(), perm.end(), 0);
            std::shuffle(perm.begin(), perm.end(), rng);
            for (int32_t sl = 0; sl < ns; sl++) {
                sa.slot_of[perm[sl]] = sl;
                sa.expert_of[sl]     = perm[sl];
            }
            n_free = 0;
        }
        for (int32_t k = it % 3 == 0 ? 0 : (int32_t) (rng() % (ns + 1)); k > 0; k--) {
            const int32_t e = (int32_t) (rng() % ne), sl = (int32_t) (rng() % ns);
            if (sa.slot_of[e] < 0 && sa.expert_of[sl] < 0) {
                sa.slot_of[e] = sl;
                sa.expert_of[sl] = e;
                n_free--;
            }
        }
        for (int32_t sl = 0; sl < ns; sl++) {
            sa.ref[sl] = (int32_t) (rng() % 2);
        }
        *sa.hand   = rng() % 5 == 0 ? ns + (int32_t) (rng() % 3) : (int32_t) (rng() % ns);
        *sa.n_free = n_free + (rng() % 10 == 0);
        if (rng() % 20 == 0) {
            sa.expert_of[rng() % ns] = ne;
        }
        std::vector<int32_t> ids(nt * nu);
        for (int32_t & e : ids) {
            e = (int32_t) (rng() % ne);
        }
        if (rng() % 20 == 0) {
            ids[rng() % ids.size()] = rng() % 2 ? ne : -1;
        }
        const int32_t max_fills = it % 4 == 0 ? 0 : it % 4 == 1 ? (int32_t) (rng() % 4) : GGML_MOE_CACHE_FILL_ALL;
        std::vector<int32_t> b = a;
        ggml_moe_cache_state sb = ggml_moe_cache_state_flat(b.data(), ne, ns);
        int32_t status_a = 0, status_b = 0;
        sa.status = &status_a;
        sb.status = &status_b;
        const ggml_moe_cache_tail_layout d = ggml_moe_cache_tail_layout_of(ns);
        std::vector<int32_t> slots_a(2 * ids.size()), slots_b(2 * ids.size()), tail_a(d.size, -1), tail_b(d.size, -1);
        const std::vector<int32_t> resident_before(sa.slot_of, sa.slot_of + ne);
        std::vector<uint8_t> scr_a(ggml_moe_cache_scratch_size(ne, ns), 0), scr_b(scr_a.size(), 0);
        const ggml_moe_cache_scratch sca = ggml_moe_cache_scratch_at(scr_a.data(), ne, ns);
        const ggml_moe_cache_scratch scb = ggml_moe_cache_scratch_at(scr_b.data(), ne, ns);

        const int32_t ra = ggml_moe_cache_lookup_to_dst(&sa, sca, ids.data(), nt, nu, nu, max_fills, slots_a.data(),
                tail_a.data());

        const int32_t n_threads = 1 + (int32_t) (rng() % 40);
        int32_t n_distinct = 0, n_cold = 0;
        int32_t * cold_b = slots_b.data() + ids.size();
        int32_t rb = ggml_moe_cache_lookup_begin(&sb, scb, ids.data(), nt, nu, nu, slots_b.data(), cold_b, &n_distinct);
        if (rb == 0) {
            int32_t total_free = 0, any_bad = 0;
            for (int32_t t = 0; t < n_threads; t++) {
                int32_t nf = 0, bad = 0;
                ggml_moe_cache_check_slots(&sb, t, n_threads, &nf, &bad);
                total_free += nf;
                any_bad = any_bad || bad;
            }
            // phase 3 as the kernel runs it: the hits, each miss's slot (a warp's pick there), the rest
            const int32_t n_hits = ggml_moe_cache_lookup_hits(&sb, scb, n_distinct, total_free, any_bad);
            rb = n_hits < 0 ? -3 : 0;
            if (rb == 0) {
                int32_t n_fills = 0;
                for (int32_t i = 0; i < n_distinct && ggml_moe_cache_may_fill(&sb, n_hits, n_fills, max_fills); i++) {
                    const int32_t e = scb.distinct[i];
                    if (sb.slot_of[e] < 0) {
                        ggml_moe_cache_lookup_take(&sb, scb, e, ggml_moe_cache_take_slot(&sb, scb, e),
                                tail_b.data() + d.fill_expert, tail_b.data() + d.fill_slot, tail_b.data() + d.evicted, &n_fills);
                    }
                }
                n_cold = ggml_moe_cache_lookup_finish(&sb, scb, ids.data(), nt, nu, nu, n_distinct, slots_b.data(), cold_b);
                rb = n_fills;
            }
        }
        ggml_moe_cache_lookup_record(&sb, tail_b.data(), rb, ggml_moe_cache_distinct_reported(rb, n_distinct), n_cold);

        CHECK(ra == rb && a == b && slots_a == slots_b && tail_a == tail_b && status_a == status_b && scr_a == scr_b,
                "case %d (%d experts, %d slots, %d threads): result %d against %d", it, ne, ns, n_threads, ra, rb);
        if (ra >= 0) {
            // each routed id hot (its slot holds it) or cold (its expert in the cold ids), never both
            int32_t n_hits = 0;
            for (int32_t i = 0; i < n_distinct; i++) {
                n_hits += resident_before[scb.distinct[i]] >= 0;
            }
            const int32_t cold = tail_a[d.n_cold];
            for (size_t i = 0; i < ids.size(); i++) {
                const int32_t sl = slots_a[i], c = slots_a[ids.size() + i];
                CHECK((sl >= 0 && sl < ns && sa.expert_of[sl] == ids[i] && c == -1) || (sl == -1 && c == ids[i]),
                        "case %d: routed id %zu (expert %d) slot %d cold %d", it, i, ids[i], sl, c);
            }
            // the policy's fills at most; a miss is cold only past the policy or the slots
            CHECK(ra <= max_fills && n_hits + ra + cold == n_distinct && (cold == 0 || ra == max_fills || n_hits + ra == ns),
                    "case %d: %d hits, %d fills, %d cold of %d (policy %d, %d slots)", it, n_hits, ra, cold, n_distinct,
                    max_fills, ns);
        }
        n_paths[ra < 0 ? -ra : (tail_a[d.n_cold] > 0 ? 1 : ra == 0 ? 4 : 5)]++;
    }
    // every path was taken: cold misses, bad id, bad state, all hits, fills
    CHECK(n_paths[1] > 0 && n_paths[2] > 0 && n_paths[3] > 0 && n_paths[4] > 0 && n_paths[5] > 0,
            "paths %d %d %d %d %d", n_paths[1], n_paths[2], n_paths[3], n_paths[4], n_paths[5]);
    // a state in which two slots hold one expert is refused (-3): taking the unpinned one for a miss would lose the
    // other, and the lookup would read slot -1 for that expert
    {
        std::vector<int32_t> flat(ggml_moe_cache_state_size(8, 2), 0);
        ggml_moe_cache_state st = ggml_moe_cache_state_flat(flat.data(), 8, 2);
        std::fill(st.slot_of, st.slot_of + 8, -1);
        st.slot_of[3] = 0;
        st.expert_of[0] = st.expert_of[1] = 3;
        *st.n_free = 0;
        const std::vector<int32_t> ids = { 3, 5 };
        std::vector<int32_t> slots(4), tail(ggml_moe_cache_tail_layout_of(2).size, -1);
        std::vector<uint8_t> scratch(ggml_moe_cache_scratch_size(8, 2), 0);
        const std::vector<int32_t> before = flat;
        const int32_t r = ggml_moe_cache_lookup_to_dst(&st, ggml_moe_cache_scratch_at(scratch.data(), 8, 2), ids.data(), 1, 2, 2,
                GGML_MOE_CACHE_FILL_ALL, slots.data(), tail.data());
        CHECK(r == -3 && flat[1] == before[1] && std::equal(st.slot_of, st.slot_of + 8, before.begin() + 2),
                "a slot holding an expert held by another was taken: result %d", r);
    }
    // CLOCK a window at a time against CLOCK a slot at a time (the walk as first written): the same victim, hand and
    // reference bits, from random marks over 1..300 slots, some with every slot pinned but one, some with every
    // reference bit set (a second turn)
    for (int it = 0; it < 20000; it++) {
        const int32_t ns = 1 + (int32_t) (rng() % 300);
        std::vector<int32_t> flat(ggml_moe_cache_state_size(ns, ns), 0);
        ggml_moe_cache_state st = ggml_moe_cache_state_flat(flat.data(), ns, ns);
        std::vector<uint8_t> pinned(ns);
        for (int32_t sl = 0; sl < ns; sl++) {
            pinned[sl]  = it % 4 == 1 ? 1 : (uint8_t) (rng() % 3 == 0);
            st.ref[sl]  = it % 4 == 2 ? 1 : (int32_t) (rng() % 2);
        }
        pinned[rng() % ns] = 0; // one slot at least is not pinned
        *st.hand = (int32_t) (rng() % ns);
        std::vector<int32_t> ref_walk(st.ref, st.ref + ns);
        int32_t hand_walk = *st.hand, victim_walk = -1;
        for (int32_t step = 0; step < 2 * ns + 1 && victim_walk < 0; step++) {
            const int32_t sl = hand_walk;
            hand_walk = sl + 1 == ns ? 0 : sl + 1;
            if (!pinned[sl] && ref_walk[sl]) {
                ref_walk[sl] = 0;
            } else if (!pinned[sl]) {
                victim_walk = sl;
            }
        }
        const int32_t victim = ggml_moe_cache_clock_victim(&st, pinned.data());
        CHECK(victim == victim_walk && *st.hand == hand_walk && std::equal(ref_walk.begin(), ref_walk.end(), st.ref),
                "CLOCK case %d (%d slots): victim %d against %d", it, ns, victim, victim_walk);
    }
}

int main(int argc, char ** argv) {
    struct test_case {
        const char * name;
        void (*run)();
    };
    static const test_case cases[] = {
        { "sizing-uniform",          sizing_uniform },
        { "sizing-remainder",        sizing_remainder },
        { "sizing-cap",              sizing_cap },
        { "sizing-too-small",        sizing_too_small },
        { "sizing-hetero",           sizing_hetero },
        { "clock-keeps-same-ubatch", clock_keeps_same_ubatch },
        { "overflow",                overflow },
        { "note-staging",            note_staging },
        { "ids-in-range",            ids_in_range },
        { "uniform-hit-rate",        uniform_hit_rate },
        { "prompt-uploads-once",     prompt_uploads_once },
        { "prompt-no-thrash",        prompt_no_thrash },
        { "prompt-hysteresis",       prompt_hysteresis },
        { "prompt-two-steps",        prompt_two_steps },
        { "prompt-unrouted",         prompt_unrouted },
        { "stats-arithmetic",        stats_arithmetic },
        { "skip-fill",               skip_fill },
        { "whole-layer",             whole_layer },
        { "fill-whole",              fill_whole },
        { "lookup-handover",         lookup_handover },
        { "seed-by-routing",         seed_by_routing },
        { "seed-ref-bits",           seed_ref_bits },
        { "profile-counts",          profile_counts },
        { "profile-preload",         profile_preload },
        { "lookup-split-check",      lookup_split_check },
    };
    if (argc != 2) {
        fprintf(stderr, "usage: %s CASE|all|sim|first-tokens|list\n", argv[0]);
        return 2;
    }
    const std::string want = argv[1];
    if (want == "sim") {
        return sim();
    }
    if (want == "first-tokens") {
        return first_tokens_sim();
    }
    if (want == "list") {
        for (const test_case & c : cases) {
            printf("%s\n", c.name);
        }
        return 0;
    }
    int n_run = 0;
    int n_fail = 0;
    for (const test_case & c : cases) {
        if (want != "all" && want != c.name) {
            continue;
        }
        n_run++;
        try {
            c.run();
            printf("ok %s\n", c.name);
        } catch (const failure & f) {
            printf("FAIL %s: %s\n", c.name, f.why.c_str());
            n_fail++;
        }
    }
    if (n_run == 0) {
        fprintf(stderr, "unknown case %s\n", want.c_str());
        return 2;
    }
    return n_fail ? 1 : 0;
}
