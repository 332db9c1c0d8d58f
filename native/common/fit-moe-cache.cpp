// fit-moe-cache.cpp: the --fit plan for the MoE expert cache; see fit-moe-cache.h.
#include "fit-moe-cache.h"

#include <algorithm>
#include <cstdio>

static double mib(int64_t bytes) {
    return bytes / (1024.0 * 1024.0);
}

static int64_t room_of(const fit_moe_cache_device & d) {
    return d.free - d.used - d.staging - d.margin;
}

fit_moe_cache_plan fit_moe_cache_decide(const std::vector<fit_moe_cache_device> & devs, int64_t budget, double share) {
    fit_moe_cache_plan plan;
    plan.cap.assign(devs.size(), -1);
    plan.reserve.assign(devs.size(), 0);
    if (budget <= 0) {
        plan.reason = "no expert cache asked for";
        return plan;
    }

    int64_t full_total = 0, room_total = 0, staging_total = 0;
    int32_t n_layers = 0;
    for (const fit_moe_cache_device & d : devs) {
        n_layers += d.n_layers;
        if (d.n_layers > 0) {
            full_total    += d.full_bytes;
            room_total    += std::max<int64_t>(room_of(d), 0);
            staging_total += d.staging;
        }
    }
    if (n_layers == 0) {
        // a dense model, or one whose MoE layers cannot be cached (the cache's own log says why when it is made)
        plan.reason = "no MoE layer with its experts on the host could be cached";
        return plan;
    }

    // a device whose room cannot hold the least cache of its layers makes the plan fail as a whole: placing layers
    // is then what gives the device's memory to experts at all
    for (size_t i = 0; i < devs.size(); i++) {
        const fit_moe_cache_device & d = devs[i];
        if (d.n_layers > 0 && room_of(d) < d.min_bytes) {
            char buf[512];
            snprintf(buf, sizeof(buf), "with every expert on the host %s has %.0f MiB of room (%.0f free, %.0f measured, "
                    "%.0f of staging, a target of %.0f), below the %.0f MiB that n_expert_used slots in each of its %d MoE "
                    "layers take", d.name.c_str(), mib(room_of(d)), mib(d.free), mib(d.used), mib(d.staging), mib(d.margin),
                    mib(d.min_bytes), d.n_layers);
            plan.kind = FIT_MOE_CACHE_LAYERS;
            plan.reason = buf;
            std::fill(plan.cap.begin(), plan.cap.end(), 0);
            return plan;
        }
    }

    bool budget_short = false; // the budget leaves room on some device: whole layers take the rest
    for (size_t i = 0; i < devs.size(); i++) {
        const fit_moe_cache_device & d = devs[i];
        if (d.n_layers == 0) {
            plan.cap[i] = 0; // nothing of its own to cache
            continue;
        }
        plan.cap[i] = std::min(budget, room_of(d));
        budget_short = budget_short || budget < room_of(d);
    }
    if (budget_short) {
        plan.kind = FIT_MOE_CACHE_AND_LAYERS;
        for (size_t i = 0; i < devs.size(); i++) {
            if (devs[i].n_layers > 0) {
                plan.reserve[i] = plan.cap[i] + devs[i].staging;
            }
        }
        plan.reason = "the budget is less than the room";
    } else {
        plan.kind = FIT_MOE_CACHE_ALL_HOST;
        plan.reason = "the budget covers the room";
    }
    if (share > 0.0) {
        // uniform routing: a resident byte saves the same share of a layer's traffic wherever it sits
        plan.bytes_per_token_cache  = share * (double) std::max<int64_t>(full_total - room_total, 0);
        plan.bytes_per_token_layers = share * (double) std::max<int64_t>(full_total - room_total - staging_total, 0);
    }
    return plan;
}

std::string fit_moe_cache_describe(const fit_moe_cache_plan & plan, const std::vector<fit_moe_cache_device> & devs) {
    std::string s;
    switch (plan.kind) {
        case FIT_MOE_CACHE_NONE:       s = "expert cache not planned: "; break;
        case FIT_MOE_CACHE_LAYERS:     s = "expert cache off, layers placed as without it: "; break;
        case FIT_MOE_CACHE_ALL_HOST:   s = "every MoE layer's experts on the host, the expert cache takes the room: "; break;
        case FIT_MOE_CACHE_AND_LAYERS: s = "expert cache first, then whole layers: "; break;
    }
    s += plan.reason;
    if (plan.kind == FIT_MOE_CACHE_ALL_HOST || plan.kind == FIT_MOE_CACHE_AND_LAYERS) {
        char buf[256];
        for (size_t i = 0; i < devs.size(); i++) {
            if (plan.cap[i] > 0) {
                snprintf(buf, sizeof(buf), "; %s %.0f MiB of cache (%.0f MiB of staging kept for prompts)", devs[i].name.c_str(),
                        mib(plan.cap[i]), mib(devs[i].staging));
                s += buf;
            }
        }
        if (plan.bytes_per_token_cache >= 0.0) {
            snprintf(buf, sizeof(buf), "; uniform routing would upload %.0f MiB of experts per token (less under any skew) "
                    "against %.0f MiB computed on the CPU with whole layers in the same room", mib((int64_t) plan.bytes_per_token_cache),
                    mib((int64_t) plan.bytes_per_token_layers));
            s += buf;
        }
    }
    return s;
}
