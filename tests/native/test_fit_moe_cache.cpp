// test_fit_moe_cache.cpp: --fit's plan for the MoE expert cache (native/common/fit-moe-cache.cpp), on its own: no
// llama.cpp build, just a C++17 compiler.
//
//   c++ -std=c++17 -I native/common native/common/fit-moe-cache.cpp tests/native/test_fit_moe_cache.cpp -o t
//   t CASE    CASE: one of the names in main(), or "all"
//
// Prints "ok CASE" and exits 0, or "FAIL CASE: ..." and exits 1.
#include "fit-moe-cache.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

static const int64_t MiB = 1024 * 1024;

static std::string g_fail;

#define CHECK(cond, ...) do { if (!(cond)) { char b_[512]; snprintf(b_, sizeof(b_), __VA_ARGS__); g_fail = b_; return false; } } while (0)

// a device of the 30B-A3B shape's numbers, in MiB: 48 host layers, 8 of 128 slots each take ~1000 MiB
static fit_moe_cache_device dev(const char * name, int64_t free, int64_t used, int64_t staging = 432, int32_t n_layers = 48) {
    fit_moe_cache_device d;
    d.name       = name;
    d.free       = free * MiB;
    d.used       = used * MiB;
    d.margin     = 1024 * MiB;
    d.staging    = staging * MiB;
    d.n_layers   = n_layers;
    d.min_bytes  = n_layers > 0 ? 1000 * MiB : 0;
    d.full_bytes = n_layers > 0 ? 16000 * MiB : 0;
    return d;
}

static int64_t room(const fit_moe_cache_device & d) {
    return d.free - d.used - d.staging - d.margin;
}

// the invariant every plan keeps: a cache never takes more than its device's room
static bool within_target(const fit_moe_cache_plan & p, const std::vector<fit_moe_cache_device> & devs) {
    for (size_t i = 0; i < devs.size(); i++) {
        CHECK(p.cap[i] <= std::max<int64_t>(room(devs[i]), 0), "%s: cap %lld MiB over its room %lld MiB", devs[i].name.c_str(),
                (long long) (p.cap[i] / MiB), (long long) (room(devs[i]) / MiB));
    }
    return true;
}

// a budget above the room: every expert on the host, the cache takes the room, the log says so
static bool all_host() {
    std::vector<fit_moe_cache_device> devs = { dev("CUDA0", 12288, 1200) };
    fit_moe_cache_plan p = fit_moe_cache_decide(devs, 200000 * MiB, 8.0 / 128);
    CHECK(p.kind == FIT_MOE_CACHE_ALL_HOST, "kind %d", p.kind);
    CHECK(p.cap[0] == room(devs[0]), "cap %lld", (long long) p.cap[0]);
    CHECK(p.reserve[0] == 0, "no layers placed after it");
    const std::string s = fit_moe_cache_describe(p, devs);
    CHECK(s.find("every MoE layer's experts on the host") != std::string::npos && s.find("CUDA0 9632 MiB of cache") != std::string::npos,
            "log: %s", s.c_str());
    // uniform routing: 8/128 of the experts the room does not hold (16000 - 9632 MiB)
    CHECK(p.bytes_per_token > 397 * MiB && p.bytes_per_token < 399 * MiB, "estimate %.1f MiB", p.bytes_per_token / MiB);
    return within_target(p, devs);
}

// a budget below the room: the cache gets its budget, layers the rest (the target raised by cache and staging)
static bool budget_then_layers() {
    std::vector<fit_moe_cache_device> devs = { dev("CUDA0", 12288, 1200) };
    fit_moe_cache_plan p = fit_moe_cache_decide(devs, 4096 * MiB, 8.0 / 128);
    CHECK(p.kind == FIT_MOE_CACHE_AND_LAYERS, "kind %d", p.kind);
    CHECK(p.cap[0] == 4096 * MiB, "cap %lld", (long long) p.cap[0]);
    CHECK(p.reserve[0] == (4096 + 432) * MiB, "reserve %lld", (long long) (p.reserve[0] / MiB));
    return within_target(p, devs);
}

// a room below n_expert_used slots per layer: layers as without a cache, every cache capped at 0
static bool too_small() {
    std::vector<fit_moe_cache_device> devs = { dev("CUDA0", 3000, 1200) }; // room 344 MiB < 1000
    fit_moe_cache_plan p = fit_moe_cache_decide(devs, 200000 * MiB, 8.0 / 128);
    CHECK(p.kind == FIT_MOE_CACHE_LAYERS, "kind %d", p.kind);
    CHECK(p.cap[0] == 0 && p.reserve[0] == 0, "cap %lld reserve %lld", (long long) p.cap[0], (long long) p.reserve[0]);
    const std::string s = fit_moe_cache_describe(p, devs);
    CHECK(s.find("CUDA0 has 344 MiB of room") != std::string::npos && s.find("below the 1000 MiB") != std::string::npos,
            "log: %s", s.c_str());
    return true;
}

// a room that holds the least cache in bytes but not in whole MiB: a cap is set in MiB, and a cap floored below the
// least cache would make no cache at all with every expert on the host (the cold read's planted case)
static bool room_within_a_mib_of_the_least() {
    fit_moe_cache_device d = dev("CUDA0", 12288, 1200);
    d.min_bytes = room(d) - MiB / 2; // the room's bytes hold it
    d.free += MiB / 2;               // ... with half a MiB to spare, so its whole MiB do not
    std::vector<fit_moe_cache_device> devs = { d };
    fit_moe_cache_plan p = fit_moe_cache_decide(devs, 200000 * MiB, 8.0 / 128);
    CHECK(p.kind == FIT_MOE_CACHE_LAYERS || p.cap[0] >= d.min_bytes, "kind %d: a cap of %lld bytes under the least %lld",
            p.kind, (long long) p.cap[0], (long long) d.min_bytes);
    CHECK(p.cap[0] % MiB == 0, "a cap in whole MiB");
    return true;
}

// a budget below the least cache of the host layers: no cache can be made, so no memory is kept for one (the cold
// read's planted case: a 3 MiB budget reserved its room and the runtime then made no cache)
static bool budget_below_the_least() {
    std::vector<fit_moe_cache_device> devs = { dev("CUDA0", 12288, 1200) };
    fit_moe_cache_plan p = fit_moe_cache_decide(devs, 300 * MiB, 8.0 / 128);
    CHECK(p.kind == FIT_MOE_CACHE_LAYERS && p.cap[0] == 0 && p.reserve[0] == 0, "kind %d cap %lld reserve %lld", p.kind,
            (long long) p.cap[0], (long long) p.reserve[0]);
    CHECK(p.reason.find("budget of 300 MiB is below") != std::string::npos, "reason: %s", p.reason.c_str());
    return true;
}

// several devices that hold every weight together: nothing planned, no cap (--fit's layers hold every expert)
static bool layers_fit_all() {
    std::vector<fit_moe_cache_device> devs = { dev("CUDA0", 12288, 1200, 432, 24), dev("CUDA1", 12288, 1200, 432, 24) };
    fit_moe_cache_plan p = fit_moe_cache_decide(devs, 200000 * MiB, 8.0 / 128, true);
    CHECK(p.kind == FIT_MOE_CACHE_NONE && p.cap[0] == -1 && p.cap[1] == -1, "kind %d", p.kind);
    return true;
}

// the dense part alone over the target: a negative room is not a cache of negative size
static bool dense_over_target() {
    std::vector<fit_moe_cache_device> devs = { dev("CUDA0", 2000, 1900) };
    fit_moe_cache_plan p = fit_moe_cache_decide(devs, 200000 * MiB, 8.0 / 128);
    CHECK(p.kind == FIT_MOE_CACHE_LAYERS && p.cap[0] == 0, "kind %d cap %lld", p.kind, (long long) p.cap[0]);
    return true;
}

// no budget: nothing planned, no cap (upstream --fit, byte for byte)
static bool no_budget() {
    std::vector<fit_moe_cache_device> devs = { dev("CUDA0", 12288, 1200) };
    fit_moe_cache_plan p = fit_moe_cache_decide(devs, 0, 8.0 / 128);
    CHECK(p.kind == FIT_MOE_CACHE_NONE && p.cap[0] == -1 && p.reserve[0] == 0, "kind %d", p.kind);
    return true;
}

// no host MoE layer anywhere (a dense model): nothing planned
static bool dense_model() {
    std::vector<fit_moe_cache_device> devs = { dev("CUDA0", 12288, 1200, 0, 0) };
    fit_moe_cache_plan p = fit_moe_cache_decide(devs, 4096 * MiB, 0.0);
    CHECK(p.kind == FIT_MOE_CACHE_NONE && p.cap[0] == -1, "kind %d", p.kind);
    return true;
}

// two devices of unequal free memory: each gets its own room, no more
static bool two_devices_unequal() {
    std::vector<fit_moe_cache_device> devs = { dev("CUDA0", 24000, 800, 432, 24), dev("CUDA1", 6000, 900, 432, 24) };
    fit_moe_cache_plan p = fit_moe_cache_decide(devs, 200000 * MiB, 8.0 / 128);
    CHECK(p.kind == FIT_MOE_CACHE_ALL_HOST, "kind %d", p.kind);
    CHECK(p.cap[0] == room(devs[0]) && p.cap[1] == room(devs[1]) && p.cap[0] > p.cap[1], "caps %lld %lld",
            (long long) (p.cap[0] / MiB), (long long) (p.cap[1] / MiB));
    // a budget between the two rooms: the small device all cache, the large one its budget and layers
    p = fit_moe_cache_decide(devs, 8000 * MiB, 8.0 / 128);
    CHECK(p.kind == FIT_MOE_CACHE_AND_LAYERS, "kind %d", p.kind);
    CHECK(p.cap[0] == 8000 * MiB && p.cap[1] == room(devs[1]), "caps %lld %lld", (long long) (p.cap[0] / MiB),
            (long long) (p.cap[1] / MiB));
    return within_target(p, devs);
}

// one device short of the least cache: the plan fails as a whole, every device capped at 0, even the one with room
static bool two_devices_one_short() {
    std::vector<fit_moe_cache_device> devs = { dev("CUDA0", 24000, 800, 432, 24), dev("CUDA1", 2800, 900, 432, 24) };
    fit_moe_cache_plan p = fit_moe_cache_decide(devs, 200000 * MiB, 8.0 / 128);
    CHECK(p.kind == FIT_MOE_CACHE_LAYERS && p.cap[0] == 0 && p.cap[1] == 0, "kind %d caps %lld %lld", p.kind,
            (long long) p.cap[0], (long long) p.cap[1]);
    CHECK(p.reason.find("CUDA1") != std::string::npos, "the reason names the short device: %s", p.reason.c_str());
    return true;
}

// a device that holds no host MoE layer (the output layer's device, say) gets a cap of 0, never a share of the budget
static bool device_without_layers() {
    std::vector<fit_moe_cache_device> devs = { dev("CUDA0", 12288, 1200), dev("CUDA1", 8000, 700, 0, 0) };
    fit_moe_cache_plan p = fit_moe_cache_decide(devs, 200000 * MiB, 8.0 / 128);
    CHECK(p.kind == FIT_MOE_CACHE_ALL_HOST && p.cap[0] == room(devs[0]) && p.cap[1] == 0, "kind %d caps %lld %lld",
            p.kind, (long long) p.cap[0], (long long) p.cap[1]);
    return within_target(p, devs);
}

int main(int argc, char ** argv) {
    struct { const char * name; bool (*fn)(); } cases[] = {
        { "all-host",              all_host },
        { "budget-then-layers",    budget_then_layers },
        { "too-small",             too_small },
        { "dense-over-target",     dense_over_target },
        { "no-budget",             no_budget },
        { "dense-model",           dense_model },
        { "two-devices-unequal",   two_devices_unequal },
        { "two-devices-one-short", two_devices_one_short },
        { "device-without-layers", device_without_layers },
        { "room-within-a-mib",     room_within_a_mib_of_the_least },
        { "budget-below-least",    budget_below_the_least },
        { "layers-fit-all",        layers_fit_all },
    };
    const char * want = argc > 1 ? argv[1] : "all";
    int n_run = 0, n_fail = 0;
    for (const auto & c : cases) {
        if (strcmp(want, "all") != 0 && strcmp(want, c.name) != 0) {
            continue;
        }
        n_run++;
        g_fail.clear();
        if (c.fn()) {
            printf("ok %s\n", c.name);
        } else {
            printf("FAIL %s: %s\n", c.name, g_fail.c_str());
            n_fail++;
        }
    }
    if (n_run == 0) {
        printf("FAIL %s: no such case\n", want);
        return 1;
    }
    return n_fail == 0 ? 0 : 1;
}
