// fit-moe-cache.h (pyllama_moe): how --fit shares device memory between the MoE expert cache and whole layers.
// Plain C++, no llama.cpp or ggml header: common/fit.cpp measures, this module decides, and
// tests/native/test_fit_moe_cache.cpp checks the decision with a C++ compiler alone.
//
// The plan. With a cache asked for (--moe-cache-mib N, N > 0) and a model that does not fit, --fit measures the
// model with every MoE layer's experts on the host (what --cpu-moe places) and, per device, the room that leaves:
// free memory less that measurement (dense weights, KV, compute buffers), less the staging arena the prompt prefetch
// will take (depth x the largest expert tensor of the device's host layers, when the prefetch is on there and the
// ubatch stages), less the target margin. Then, per device:
//   - the cache takes the room first, up to N: at equal memory a cache over every layer leaves no more expert bytes
//     per decoded token off the GPU than placing whole layers does (equal under uniform routing, fewer under any
//     skew: each layer keeps its most used experts), and it computes every expert on the GPU in one graph per token
//     where a host layer computes on the CPU (measured on the H200: results/fit.md);
//   - what N leaves of the room goes to whole layers, placed by --fit as without a cache (its target raised by the
//     cache and the staging);
//   - a device whose room, or the budget, cannot give n_expert_used slots to each of its host layers gets no cache,
//     and then no device does: --fit places layers as without a cache and every cache is capped at 0;
//   - with several devices that together hold every weight (none alone holds its default share), nothing is
//     planned: --fit's layer placement puts every expert on a device.
// Each device's cache is capped at the room planned for it (llama-moe.h: the first cache made on the device takes
// the cap with no margin of its own; caches made later on it keep the cache's own 512 MiB margin too). --fit paths
// that never reach the plan (a model that fits, -ngl/-ot/-cmoe given, --fit off) set no cap: there the cache is
// sized as without --fit (free memory less 512 MiB), not to the --fit target.
// The decision and its reason are one log line (describe()).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

// one device, as --fit measured it with every expert on the host
struct fit_moe_cache_device {
    std::string name;          // the ggml device name (CUDA0, SIM1): the key of its cache cap
    int64_t     free     = 0;  // bytes free before the model
    int64_t     used     = 0;  // bytes of the measurement: dense weights, KV, compute buffers
    int64_t     margin   = 0;  // the target: bytes to leave free
    int64_t     staging  = 0;  // bytes the prompt prefetch's staging arena will take (0: no prefetch there)
    // the cache's need on this device (llama_moe_cache_need_on): its MoE layers with host experts
    int32_t     n_layers = 0;
    int64_t     min_bytes  = 0; // n_expert_used slots in each, with their maps and lookup states
    int64_t     full_bytes = 0; // a slot for every expert of each
};

enum fit_moe_cache_kind {
    FIT_MOE_CACHE_NONE,       // no cache asked for, or nothing to cache: --fit as without one
    FIT_MOE_CACHE_LAYERS,     // the cache cannot be made: layers as without it, every cache capped at 0
    FIT_MOE_CACHE_ALL_HOST,   // every MoE layer's experts on the host, the cache takes each device's room
    FIT_MOE_CACHE_AND_LAYERS, // the cache takes its budget first, whole layers the rest (targets raised by reserve)
};

struct fit_moe_cache_plan {
    fit_moe_cache_kind   kind = FIT_MOE_CACHE_NONE;
    std::vector<int64_t> cap;     // per device: the most bytes its cache may take (-1: no cap)
    std::vector<int64_t> reserve; // per device: bytes to add to the target before --fit places layers
    std::string          reason;  // why, for the log
    // expert bytes per decoded token that do not come from device memory under uniform routing, where this plan
    // keeps experts resident: uploaded cache misses (whole layers in the same room leave about as many to the CPU;
    // any skew lowers the cache's); -1: not estimated
    double bytes_per_token = -1.0;
};

// budget: the cache asked for, bytes per device (<= 0: none). share: n_expert_used / n_expert of the host layers (for
// the uniform estimate; 0 skips it). layers_fit_all: the model with every weight on the devices fits their free
// memory less their targets in total (--fit's layer placement then holds every expert).
fit_moe_cache_plan fit_moe_cache_decide(const std::vector<fit_moe_cache_device> & devs, int64_t budget, double share,
        bool layers_fit_all = false);

// the plan in one line: "every MoE layer's experts on the host; expert cache CUDA0 8123 MiB (...)"
std::string fit_moe_cache_describe(const fit_moe_cache_plan & plan, const std::vector<fit_moe_cache_device> & devs);
