// fit-moe-cache.cpp: the --fit plan for the MoE expert cache; see fit-moe-cache.h.
#include "fit-moe-cache.h"

#include <algorithm>
#include <cstdio>

static const int64_t MiB = 1024 * 1024;

static double mib(int64_t bytes) {
    return bytes / (double) MiB;
}

// whole MiB: a cap is set in MiB, so a room is only worth what its whole MiB hold
static int64_t room_of(const fit_moe_cache_device & d) {
    const int64_t room = d.free - d.used - d.staging - d.margin;
    return room > 0 ? room / MiB * MiB : room;
}

static fit_moe_cache_plan layers_plan(fit_moe_cache_plan plan, const std::string & why) {
    plan.kind   = FIT_MOE_CACHE_LAYERS;
    plan.reason = why;
    std::fill(plan.cap.begin(), plan.cap.end(), 0);
    std::fill(plan.reserve.begin(), plan.reserve.end(), 0);
    return plan;
}

fit_moe_cache_plan fit_moe_cache_decide(const std::vector<fit_moe_cache_device> & devs, int64_t budget, double share,
        bool layers_fit_all) {
    fit_moe_cache_plan plan;
    plan.cap.assign(devs.size(), -1);
    plan.reserve.assign(devs.size(), 0);
    if (budget <= 0) {
        plan.reason = "no expert cache asked for";
        return plan;
    }
    if (layers_fit_all) {
        // several devices, each not fitting alone what the default split gives it: --fit's layer placement puts
        // every expert on a device, which no cache beats
        plan.reason = "whole layers fit every expert on the devices together";
        return plan;
    }
    budget = budget / MiB * MiB;

    int64_t full_total = 0, resident_total = 0;
    int32_t n_layers = 0;
    for (const fit_moe_cache_device & d : devs) {
        n_layers += d.n_layers;
        if (d.n_layers > 0) {
            full_total     += d.full_bytes;
            resident_total += std::min(std::max<int64_t>(room_of(d), 0), d.full_bytes);
        }
    }
    if (n_layers == 0) {
        // a dense model, or one whose MoE layers cannot be cached (the cache's own log says why when it is made)
        plan.reason = "no MoE layer with its experts on the host could be cached";
        return plan;
    }

    // a device whose room (or the budget) cannot hold the least cache of its layers makes the plan fail as a whole:
    // placing layers is then what gives the device's memory to experts at all
    for (size_t i = 0; i < devs.size(); i++) {
        const fit_moe_cache_device & d = devs[i];
        if (d.n_layers == 0) {
            continue;
        }
        char buf[512];
        if (room_of(d) < d.min_bytes) {
            snprintf(buf, sizeof(buf), "with every expert on the host %s has %.0f MiB of room (%.0f free, %.0f measured, "
                    "%.0f of staging, a target of %.0f), below the %.0f MiB that n_expert_used slots in each of its %d MoE "
                    "layers take", d.name.c_str(), mib(room_of(d)), mib(d.free), mib(d.used), mib(d.staging), mib(d.margin),
                    mib(d.min_bytes), d.n_layers);
            return layers_plan(plan, buf);
        }
        if (budget < d.min_bytes) {
            snprintf(buf, sizeof(buf), "the budget of %.0f MiB is below the %.0f MiB that n_expert_used slots in each of the "
                    "%d MoE layers of %s take", mib(budget), mib(d.min_bytes), d.n_layers, d.name.c_str());
            return layers_plan(plan, buf);
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
        // uniform routing: a resident byte saves the same share of a layer's traffic, in a slot or in a placed layer
        plan.bytes_per_token = share * (double) std::max<int64_t>(full_total - resident_total, 0);
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
                snprintf(buf, sizeof(buf), "; %s %lld MiB of cache (%.0f MiB of staging kept for prompts)", devs[i].name.c_str(),
                        (long long) (plan.cap[i] / MiB), mib(devs[i].staging));
                s += buf;
            }
        }
        if (plan.bytes_per_token >= 0.0) {
            snprintf(buf, sizeof(buf), "; under uniform routing %.0f MiB of experts per token would come from host memory "
                    "(uploaded misses; whole layers in the same room would leave about as many to the CPU), less under any skew",
                    plan.bytes_per_token / MiB);
            s += buf;
        }
    }
    return s;
}
