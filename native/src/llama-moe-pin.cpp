// llama-moe-pin.cpp: page-locked expert weights for models loaded with mmap; see llama-moe-pin.h for why.
#include "llama-moe-pin.h"

#include "llama-impl.h"
#include "llama-model.h"
#include "llama-moe.h"
#include "llama-moe-impl.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "ggml-host-map.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <string>

#ifndef _WIN32
#    include <unistd.h>
#endif

//
// knob: setter > LLAMA_MOE_PIN_EXPERTS > on
//

// a process-wide knob: the setter's value when set (>= 0), else the environment variable's, else `unset`
static int64_t setter_else_env(int64_t set, const char * env_name, int64_t unset) {
    if (set >= 0) {
        return set;
    }
    const char * env = getenv(env_name);
    return env && *env ? (int64_t) atoll(env) : unset;
}

static std::atomic<int32_t> g_pin_default{-1};

void llama_moe_default_set_pin_experts(int32_t on) {
    g_pin_default = on < 0 ? -1 : (on != 0);
}

int32_t llama_moe_default_get_pin_experts(void) {
    return setter_else_env(g_pin_default.load(), "LLAMA_MOE_PIN_EXPERTS", 1) != 0;
}

// knob: setter > LLAMA_MOE_PIN_BUDGET_MIB > none (-1)
static std::atomic<int64_t> g_pin_budget_mib{-1};

void llama_moe_default_set_pin_budget_mib(int64_t mib) {
    g_pin_budget_mib = mib < 0 ? -1 : mib;
}

int64_t llama_moe_default_get_pin_budget_mib(void) {
    return std::max<int64_t>(setter_else_env(g_pin_budget_mib.load(), "LLAMA_MOE_PIN_BUDGET_MIB", -1), -1);
}

//
// memory this process can still take: MemAvailable, capped by the free room of every memory cgroup above it
// (a container's limit is usually set on an ancestor of the process's own cgroup)
//

struct pin_mem {
    bool     known = false;
    uint64_t avail = UINT64_MAX;
    uint64_t total = UINT64_MAX;
};

// first field of a one-value file (cgroup limit or usage); "max" (v2: no limit) reads as UINT64_MAX
static bool read_u64(const std::string & path, uint64_t & out) {
    std::ifstream f(path);
    std::string s;
    if (!(f >> s)) {
        return false;
    }
    if (s == "max") {
        out = UINT64_MAX;
        return true;
    }
    char * end = nullptr;
    out = strtoull(s.c_str(), &end, 10);
    return end && *end == '\0';
}

// value of "key value" in a stat-like file (memory.stat, /proc/meminfo with key "MemTotal:"), 0 if absent
static uint64_t read_field(const std::string & path, const std::string & key) {
    std::ifstream f(path);
    std::string k;
    uint64_t v;
    while (f >> k >> v) {
        if (k == key) {
            return v;
        }
        f.ignore(4096, '\n');
    }
    return 0;
}

static void cap_by_cgroup(pin_mem & m, const std::string & root, std::string path,
        const char * f_limit, const char * f_usage, const char * f_inactive) {
    for (;;) {
        const std::string dir = root + (path == "/" ? "" : path);
        uint64_t limit, usage;
        // v1 writes "no limit" as a page-rounded 2^63
        if (read_u64(dir + "/" + f_limit, limit) && read_u64(dir + "/" + f_usage, usage) && limit < (UINT64_C(1) << 62)) {
            // usage counts the page cache, of which the inactive part is reclaimed before the limit bites
            const uint64_t inactive = std::min(read_field(dir + "/memory.stat", f_inactive), usage);
            const uint64_t room     = limit > usage - inactive ? limit - (usage - inactive) : 0;
            m.avail = std::min(m.avail, room);
            m.total = std::min(m.total, limit);
        }
        const size_t pos = path.rfind('/');
        if (path.empty() || path == "/" || pos == std::string::npos) {
            break;
        }
        path = pos == 0 ? "/" : path.substr(0, pos);
    }
}

static pin_mem pin_mem_available() {
    // LLAMA_MOE_PIN_FS_ROOT: a directory that stands in for / when reading /proc and /sys, so tests can plant
    // cgroup hierarchies and limits this machine does not have
    const char * fs_root = getenv("LLAMA_MOE_PIN_FS_ROOT");
    const std::string root = fs_root ? fs_root : "";
    pin_mem m;
    const uint64_t total_kib = read_field(root + "/proc/meminfo", "MemTotal:");
    const uint64_t avail_kib = read_field(root + "/proc/meminfo", "MemAvailable:");
    if (total_kib == 0 || avail_kib == 0) {
        return m; // not Linux, or too old a kernel: unknown
    }
    m.known = true;
    m.avail = avail_kib * 1024;
    m.total = total_kib * 1024;

    // /proc/self/cgroup: "0::/path" (v2), "N:ctrl1,ctrl2:/path" (v1); a namespaced container sees "/"
    std::ifstream f(root + "/proc/self/cgroup");
    std::string line;
    while (std::getline(f, line)) {
        const size_t a = line.find(':');
        const size_t b = a == std::string::npos ? a : line.find(':', a + 1);
        if (b == std::string::npos) {
            continue;
        }
        const std::string hier  = line.substr(0, a);
        const std::string ctrls = "," + line.substr(a + 1, b - a - 1) + ",";
        const std::string path  = line.substr(b + 1);
        if (hier == "0" && ctrls == ",,") {
            std::ifstream probe(root + "/sys/fs/cgroup/cgroup.controllers");
            const std::string mnt = root + (probe.good() ? "/sys/fs/cgroup" : "/sys/fs/cgroup/unified");
            cap_by_cgroup(m, mnt, path, "memory.max", "memory.current", "inactive_file");
        } else if (ctrls.find(",memory,") != std::string::npos) {
            cap_by_cgroup(m, root + "/sys/fs/cgroup/memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file");
        }
    }
    return m;
}

// what page-locked memory must leave of the available memory: max(2 GiB, 1/16 of the total), or
// LLAMA_MOE_PIN_MARGIN_MIB
static uint64_t pin_margin(const pin_mem & mem) {
    const char * env = getenv("LLAMA_MOE_PIN_MARGIN_MIB");
    if (env && *env) {
        return (uint64_t) std::min(atof(env) * 1024 * 1024, 9e18);
    }
    return std::max<uint64_t>(UINT64_C(2) << 30, mem.known ? mem.total / 16 : 0);
}

//
// per-model state
//

struct pin_range {
    void * ptr;
    size_t size;
    int    ctx_refs; // references taken by the model's live contexts
};

struct pin_model_state {
    ggml_backend_host_map_t   map   = nullptr;
    ggml_backend_host_unmap_t unmap = nullptr;
    std::vector<pin_range>    ranges; // page-locked in place; the model holds one reference to each
    ggml_backend_buffer_ptr   copy;   // or: the pinned buffer the expert tensors were copied into
};

// keyed by model: the hooks in llama_model and llama_context stay one line each and their structs unchanged
static std::mutex & g_mutex = *new std::mutex; // never destroyed: a binding may free a model during exit
static std::map<const llama_model *, pin_model_state> & g_models = *new std::map<const llama_model *, pin_model_state>;

// "15.91 GiB", or MiB below one GiB, so small models do not log "0.00 GiB"
static std::string fmt_size(uint64_t n) {
    char buf[32];
    if (n >= (UINT64_C(1) << 30)) {
        snprintf(buf, sizeof(buf), "%.2f GiB", n / (1024.0 * 1024.0 * 1024.0));
    } else {
        snprintf(buf, sizeof(buf), "%.2f MiB", n / (1024.0 * 1024.0));
    }
    return buf;
}

static size_t page_size() {
#ifdef _WIN32
    return 4096;
#else
    return (size_t) sysconf(_SC_PAGESIZE);
#endif
}

// page-aligned ranges covering the tensors, which all lie in one file mapping; a gap of up to 16 MiB between two
// of them (norms, router weights) is locked along, a larger one (a layer's attention weights, which a GPU layer
// already holds in VRAM) is not, so little beyond the experts stays locked in memory. A copy from host memory
// that is only partly page-locked fails (CUDA: invalid argument, seen with -ngl 2 where an offloaded attention
// weight of a CPU layer shared a page with an expert tensor), so no range may cut through a host tensor read
// from the mapping (`mapped`, of the same mapping): each range is widened over the ones it touches, and ranges
// that come to overlap are merged, until none is cut. One mapping at a time because a gap between two mappings
// is no gap of the file: the shards of a split model are mapped one below the other, and llama.cpp unmaps
// each one's head (metadata) and tail (weights of GPU layers), so a range across two of them spans a hole,
// which cudaHostRegister refuses. Inside one mapping everything between the first and the last host tensor
// stays mapped.
static std::vector<pin_range> expert_ranges(std::vector<ggml_tensor *> tensors, const std::vector<std::pair<uintptr_t, uintptr_t>> & mapped) {
    const uintptr_t page    = page_size();
    const uintptr_t max_gap = 16u*1024*1024;
    std::sort(tensors.begin(), tensors.end(), [](const ggml_tensor * a, const ggml_tensor * b) { return a->data < b->data; });
    std::vector<std::pair<uintptr_t, uintptr_t>> spans;
    for (const ggml_tensor * t : tensors) {
        const uintptr_t lo = (uintptr_t) t->data / page * page;
        const uintptr_t hi = ((uintptr_t) t->data + ggml_nbytes(t) + page - 1) / page * page;
        if (!spans.empty() && lo <= spans.back().second + max_gap) {
            spans.back().second = std::max(spans.back().second, hi);
        } else {
            spans.emplace_back(lo, hi);
        }
    }
    for (bool changed = true; changed; ) {
        changed = false;
        for (auto & span : spans) {
            for (const auto & [lo, hi] : mapped) {
                if (lo < span.second && hi > span.first && (lo < span.first || hi > span.second)) {
                    span.first  = std::min(span.first, lo / page * page);
                    span.second = std::max(span.second, (hi + page - 1) / page * page);
                    changed = true;
                }
            }
        }
        std::sort(spans.begin(), spans.end());
        std::vector<std::pair<uintptr_t, uintptr_t>> merged;
        for (const auto & span : spans) {
            if (!merged.empty() && span.first <= merged.back().second) {
                merged.back().second = std::max(merged.back().second, span.second);
            } else {
                merged.push_back(span);
            }
        }
        spans.swap(merged);
    }
    std::vector<pin_range> out;
    for (const auto & [lo, hi] : spans) {
        out.push_back({ (void *) lo, (size_t) (hi - lo), 0 });
    }
    return out;
}

// the range cut at every page boundary that no host tensor read from the mapping straddles (its page-rounded
// span): the pieces a partial pin may take whole, since CUDA refuses a copy from partly page-locked memory
static std::vector<pin_range> range_pieces(const pin_range & r, const std::vector<std::pair<uintptr_t, uintptr_t>> & mapped) {
    const uintptr_t page = page_size();
    const uintptr_t lo = (uintptr_t) r.ptr, hi = lo + r.size;
    std::vector<std::pair<uintptr_t, uintptr_t>> spans; // page-rounded, clipped to the range
    for (const auto & [t_lo, t_hi] : mapped) {
        const uintptr_t a = std::max(lo, t_lo / page * page), b = std::min(hi, (t_hi + page - 1) / page * page);
        if (a < b) {
            spans.emplace_back(a, b);
        }
    }
    std::sort(spans.begin(), spans.end());
    std::vector<pin_range> out;
    uintptr_t start = lo, end = lo;
    for (const auto & [a, b] : spans) {
        if (end == start) {
            start = a; // the first span
        } else if (a >= end) { // the page boundary at `end` cuts no tensor
            out.push_back({ (void *) start, (size_t) (end - start), 0 });
            start = a;
        }
        end = std::max(end, b);
    }
    if (end > start) {
        out.push_back({ (void *) start, (size_t) (end - start), 0 });
    }
    return out;
}

// one pinned buffer of the device's host buffer type for all the tensors, which are repointed into it
static ggml_backend_buffer_ptr copy_to_pinned(ggml_backend_buffer_type_t buft, const std::vector<ggml_tensor *> & tensors, size_t size) {
    ggml_backend_buffer_ptr buf(ggml_backend_buft_alloc_buffer(buft, size));
    // ggml-cuda falls back to a plain CPU buffer when cudaMallocHost fails: that would be a copy for nothing
    if (!buf || ggml_backend_buffer_get_type(buf.get()) != buft) {
        return nullptr;
    }
    // the scheduler prefers the backend of a weight's buffer for the ops that use it, as for any weight buffer
    ggml_backend_buffer_set_usage(buf.get(), GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_tallocr alloc = ggml_tallocr_new(buf.get());
    for (ggml_tensor * t : tensors) {
        const void * src = t->data;
        t->buffer = nullptr;
        t->data   = nullptr;
        GGML_ASSERT(ggml_tallocr_alloc(&alloc, t) == GGML_STATUS_SUCCESS);
        ggml_backend_tensor_set(t, src, 0, ggml_nbytes(t)); // after the alloc: init_tensor may fill the tensor
    }
    return buf;
}

static bool is_inside(const ggml_tensor * t, const std::vector<pin_range> & ranges) {
    const char * lo = (const char *) t->data, * hi = lo + ggml_nbytes(t);
    return std::any_of(ranges.begin(), ranges.end(), [lo, hi](const pin_range & r) {
        return lo >= (const char *) r.ptr && hi <= (const char *) r.ptr + r.size;
    });
}

void llama_moe_pin_experts_load(llama_model & model, const std::vector<std::pair<void *, size_t>> & maps) {
    // the expert tensors (what --cpu-moe and -ncmoe match) that are read from a mapped file, per mapping (one per
    // file of a split model)
    std::vector<std::vector<ggml_tensor *>> map_tensors(maps.size());
    std::vector<std::vector<std::pair<uintptr_t, uintptr_t>>> map_spans(maps.size()); // every host tensor read from it
    std::vector<ggml_tensor *> tensors;
    std::vector<std::pair<uintptr_t, uintptr_t>> mapped_spans;
    uint64_t n_bytes = 0;
    for (const auto & [name, t] : model.tensors_by_name) {
        if (!t->buffer || !t->data || t->view_src || !ggml_backend_buffer_is_host(t->buffer)) {
            continue;
        }
        const auto m = std::find_if(maps.begin(), maps.end(), [t](const std::pair<void *, size_t> & m) {
            return (char *) t->data >= (char *) m.first && (char *) t->data + ggml_nbytes(t) <= (char *) m.first + m.second;
        });
        if (m == maps.end()) {
            continue;
        }
        const size_t idx = m - maps.begin();
        map_spans[idx].emplace_back((uintptr_t) t->data, (uintptr_t) t->data + ggml_nbytes(t));
        mapped_spans.push_back(map_spans[idx].back());
        if (llama_moe_is_expert_tensor(name)) {
            map_tensors[idx].push_back(t);
            tensors.push_back(t);
            n_bytes += ggml_nbytes(t);
        }
    }
    if (tensors.empty()) {
        return;
    }

    // the first GPU whose registry can page-lock host memory (registration is portable: one serves all devices)
    ggml_backend_dev_t        dev   = nullptr;
    ggml_backend_host_map_t   map   = nullptr;
    ggml_backend_host_unmap_t unmap = nullptr;
    for (const auto & d : model.devices) {
        if (ggml_backend_dev_type(d.dev) != GGML_BACKEND_DEVICE_TYPE_GPU) {
            continue;
        }
        ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(d.dev);
        map   = (ggml_backend_host_map_t)   ggml_backend_reg_get_proc_address(reg, GGML_BACKEND_HOST_MAP_PROC);
        unmap = (ggml_backend_host_unmap_t) ggml_backend_reg_get_proc_address(reg, GGML_BACKEND_HOST_UNMAP_PROC);
        if (map && unmap) {
            dev = d.dev;
            break;
        }
    }
    if (!dev) {
        return; // nothing uploads these experts, or nothing that benefits from page-locked memory
    }
    const char * dev_name = ggml_backend_dev_name(dev);

    if (!llama_moe_default_get_pin_experts()) {
        LLAMA_LOG_INFO("llama_moe: %s of expert weights left pageable: pinning is off (--no-pin-experts or LLAMA_MOE_PIN_EXPERTS=0)\n",
                fmt_size(n_bytes).c_str());
        return;
    }
    if (getenv("GGML_CUDA_NO_PINNED") != nullptr) { // ggml-cuda's own switch: no pinned host memory at all
        LLAMA_LOG_INFO("llama_moe: %s of expert weights left pageable: pinning is off (GGML_CUDA_NO_PINNED is set)\n",
                fmt_size(n_bytes).c_str());
        return;
    }

    pin_model_state st;
    st.map   = map;
    st.unmap = unmap;

    // the budget of page-locked memory: locked pages cannot be reclaimed, so a model whose experts exceed the
    // memory available (the reason many use --cpu-moe) must not lock them all, or the system swaps or kills
    const pin_mem  mem         = pin_mem_available();
    const uint64_t margin      = pin_margin(mem);
    const int64_t  budget_mib  = llama_moe_default_get_pin_budget_mib();
    const uint64_t avail_budget = !mem.known ? UINT64_MAX : mem.avail > margin ? mem.avail - margin : 0;
    const uint64_t budget      = budget_mib >= 0 ? std::min(avail_budget, (uint64_t) budget_mib << 20) : avail_budget;
    char why_budget[256];
    snprintf(why_budget, sizeof(why_budget), "%s%s available less a %s margin%s",
             budget_mib >= 0 ? "the budget of LLAMA_MOE_PIN_BUDGET_MIB / --pin-budget, at most " : "",
             mem.known ? fmt_size(mem.avail).c_str() : "an unknown amount", fmt_size(margin).c_str(),
             budget_mib >= 0 ? "" : " (LLAMA_MOE_PIN_BUDGET_MIB / --pin-budget set it lower)");

    // 1. page-lock the mapped ranges in place: no copy, no extra memory; whole ranges while they fit the budget,
    //    then the pieces of the next one that fit; in file order (the shards of a split model in their order)
    std::vector<pin_range> ranges;
    for (size_t i = 0; i < maps.size(); i++) {
        if (!map_tensors[i].empty()) {
            const std::vector<pin_range> r = expert_ranges(map_tensors[i], map_spans[i]);
            ranges.insert(ranges.end(), r.begin(), r.end());
        }
    }
    uint64_t n_range_bytes = 0;
    for (const pin_range & r : ranges) {
        n_range_bytes += r.size;
    }
    std::vector<pin_range> chosen;
    uint64_t n_chosen = 0;
    for (const pin_range & r : ranges) {
        if (n_chosen + r.size <= budget) {
            chosen.push_back(r);
            n_chosen += r.size;
            continue;
        }
        for (const pin_range & piece : range_pieces(r, mapped_spans)) {
            if (n_chosen + piece.size > budget) {
                break;
            }
            chosen.push_back(piece);
            n_chosen += piece.size;
        }
        break; // file order: the rest stays pageable
    }
    if (chosen.empty()) {
        LLAMA_LOG_WARN("llama_moe: %s of expert weights left pageable: not one range of them fits the %s of page-locked "
                "memory allowed, %s\n", fmt_size(n_bytes).c_str(), fmt_size(budget).c_str(), why_budget);
        return; // a pinned copy would need more still
    }
    // each range on its own: one that fails (a hole, a driver limit) costs only its own experts, and the ranges
    // that registered stay registered
    uint64_t n_registered = 0;
    size_t   n_failed     = 0;
    for (const pin_range & r : chosen) {
        if (map(r.ptr, r.size)) {
            st.ranges.push_back(r);
            n_registered += r.size;
        } else {
            n_failed++;
        }
    }
    if (n_failed == 0) {
        if (n_chosen < n_range_bytes) {
            LLAMA_LOG_WARN("llama_moe: %s of %s of expert ranges registered with %s (page-locked in place: %zu range(s)); "
                    "the rest stays pageable: %s of page-locked memory fit, %s\n",
                    fmt_size(n_chosen).c_str(), fmt_size(n_range_bytes).c_str(), dev_name, st.ranges.size(),
                    fmt_size(budget).c_str(), why_budget);
        } else {
            LLAMA_LOG_INFO("llama_moe: %s of expert weights registered with %s (page-locked in place: %zu range(s), %s)\n",
                    fmt_size(n_bytes).c_str(), dev_name, st.ranges.size(), fmt_size(n_chosen).c_str());
        }
        std::lock_guard<std::mutex> lock(g_mutex);
        g_models[&model] = std::move(st);
        return;
    }

    // 2. the experts not page-locked in place (those of the ranges that failed, and any the budget left out) as a
    //    pinned copy, if it leaves a margin of the memory actually available: the mapped pages stay in the page
    //    cache (reclaimable) and the copy is locked, so an over-commit here would push the system to swap or the
    //    OOM killer rather than fail cleanly; the ranges registered already are locked too, so they count
    std::vector<ggml_tensor *> rest;
    uint64_t n_in_place = 0; // expert bytes page-locked in place
    for (ggml_tensor * t : tensors) {
        if (is_inside(t, st.ranges)) {
            n_in_place += ggml_nbytes(t);
        } else {
            rest.push_back(t);
        }
    }
    const uint64_t copy_avail = mem.avail > n_registered ? mem.avail - n_registered : 0;
    const uint64_t copy_budget = budget > n_registered ? budget - n_registered : 0;
    ggml_backend_buffer_type_t buft = ggml_backend_dev_host_buffer_type(dev);
    char why_not[512] = "";
    size_t need = 0;
    if (!buft) {
        snprintf(why_not, sizeof(why_not), "it has no pinned host buffer type");
    } else {
        const size_t align = ggml_backend_buft_get_alignment(buft);
        need = align;
        for (const ggml_tensor * t : rest) {
            need += GGML_PAD(ggml_backend_buft_get_alloc_size(buft, t), align);
        }
        if (!mem.known || need + margin > copy_avail || need > copy_budget) {
            snprintf(why_not, sizeof(why_not), "a pinned copy needs %s + a %s margin, %s available%s%s%s",
                    fmt_size(need).c_str(), fmt_size(margin).c_str(),
                    mem.known ? fmt_size(copy_avail).c_str() : "an unknown amount (taken as none)",
                    n_registered > 0 ? " besides the registered ranges" : "",
                    budget_mib >= 0 ? ", and a budget of " : "", budget_mib >= 0 ? fmt_size((uint64_t) budget_mib << 20).c_str() : "");
        } else {
            st.copy = copy_to_pinned(buft, rest, need);
            if (!st.copy) {
                snprintf(why_not, sizeof(why_not), "%s of %s could not be allocated", fmt_size(need).c_str(), ggml_backend_buft_name(buft));
            }
        }
    }
    const uint64_t n_copied = st.copy ? n_bytes - n_in_place : 0;
    if (st.ranges.empty() && !st.copy) {
        LLAMA_LOG_WARN("llama_moe: %s of expert weights left pageable: registration with %s failed and %s\n",
                fmt_size(n_bytes).c_str(), dev_name, why_not);
        return;
    }
    if (st.ranges.empty()) {
        LLAMA_LOG_INFO("llama_moe: %s of expert weights copied into pinned memory (%s): registration with %s failed; %s were available\n",
                fmt_size(n_bytes).c_str(), ggml_backend_buft_name(buft), dev_name, fmt_size(mem.avail).c_str());
    } else if (st.copy) {
        LLAMA_LOG_INFO("llama_moe: %s of expert weights pinned: %s registered with %s (page-locked in place: %zu range(s), %s), "
                "%s copied into pinned memory (%s) since %zu range(s) failed to register\n",
                fmt_size(n_bytes).c_str(), fmt_size(n_in_place).c_str(), dev_name, st.ranges.size(),
                fmt_size(n_registered).c_str(), fmt_size(n_copied).c_str(), ggml_backend_buft_name(buft), n_failed);
    } else {
        LLAMA_LOG_WARN("llama_moe: %s of %s of expert weights registered with %s (page-locked in place: %zu range(s), %s); "
                "the rest stays pageable: %zu range(s) failed to register and %s\n",
                fmt_size(n_in_place).c_str(), fmt_size(n_bytes).c_str(), dev_name, st.ranges.size(),
                fmt_size(n_registered).c_str(), n_failed, why_not);
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    g_models[&model] = std::move(st);
}

void llama_moe_pin_experts_free(const llama_model & model) {
    pin_model_state st;
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        auto it = g_models.find(&model);
        if (it == g_models.end()) {
            return;
        }
        st = std::move(it->second);
        g_models.erase(it);
    }
    for (const pin_range & r : st.ranges) {
        if (r.ctx_refs > 0) {
            LLAMA_LOG_WARN("llama_moe: model freed with %d live context(s) on its pinned experts\n", r.ctx_refs);
        }
        for (int i = 0; i < r.ctx_refs; i++) {
            st.unmap(r.ptr);
        }
        st.unmap(r.ptr);
    }
    // st.copy is freed here, before the model's own buffers
}

void llama_moe_pin_experts_ctx_acquire(const llama_model & model) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_models.find(&model);
    if (it == g_models.end()) {
        return;
    }
    for (pin_range & r : it->second.ranges) {
        // the range is mapped already (the model's reference), so this only counts
        if (it->second.map(r.ptr, r.size)) {
            r.ctx_refs++;
        }
    }
}

void llama_moe_pin_experts_ctx_release(const llama_model & model) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_models.find(&model);
    if (it == g_models.end()) {
        return;
    }
    for (pin_range & r : it->second.ranges) {
        if (r.ctx_refs > 0) {
            r.ctx_refs--;
            it->second.unmap(r.ptr);
        }
    }
}
