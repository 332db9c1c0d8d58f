
#include "llama-moe-cache.h"
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>
#include <string>
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


static double rate(llama_moe_cache & c, router & r, int n) {
    llama_moe_cache_decode_plan p;
    auto a = c.get_stats(0, LLAMA_MOE_CACHE_PHASE_DECODE);
    for (int t = 0; t < n; t++) { auto ids = r.route(1); c.plan_decode(0, ids.data(), 1, 8, 8, p); }
    auto b = c.get_stats(0, LLAMA_MOE_CACHE_PHASE_DECODE);
    return double(b.n_hits - a.n_hits) / double(b.n_hits - a.n_hits + b.n_misses - a.n_misses);
}
int main(int argc, char ** argv) {
    const int mode = atoi(argv[1]); // 0 no seed, 1 seed
    double f = 0, s = 0; int N = 40;
    for (int rep = 0; rep < N; rep++) {
        std::vector<llama_moe_cache_layer_desc> d = { { 0, 128, 1 << 20, 0, 3 } };
        auto sz = llama_moe_cache_size_banks((size_t) 64 << 20, d);
        llama_moe_cache c(d, sz);
        router r(128, 8, 0.5, 100 + rep);
        llama_moe_cache_prompt_plan p; std::vector<int32_t> last; std::vector<llama_moe_cache_fill> fills;
        for (int ub = 0; ub < 8; ub++) { last = r.route(512); c.prompt_stage(0, nullptr, 0, 8, 8, true, p); c.prompt_admit(0, nullptr, 0, 8, 8, p); }
        if (mode) c.seed(0, last.data(), 512, 8, 8, fills);
        f += rate(c, r, 16); rate(c, r, 96); s += rate(c, r, 16);
    }
    printf("mode %d: first16 %.3f steady16 %.3f\n", mode, f / N, s / N);
}
