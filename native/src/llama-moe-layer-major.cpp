// llama-moe-layer-major.cpp: which calls are computed layer-major, and in which layer groups (docs/layer-major.md)
#include "llama-moe-layer-major.h"
#include "llama-moe-cache-rt.h"
#include "llama-moe-impl.h"
#include "llama-moe.h"

#include "llama-cparams.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>

static std::atomic<int32_t> g_layer_major{-1};      // process default, -1: unset
static std::atomic<int64_t> g_layer_major_mib{-1};  // process default staging budget in MiB, -1: unset
static std::mutex          g_layer_major_fit_mutex;  // the staging --fit kept free: how much, and where
static int64_t             g_layer_major_fit_mib = -1; // MiB, -1: none
static std::string         g_layer_major_fit_device;

bool llama_moe_layer_major_context_default() {
    const int32_t set = g_layer_major.load();
    if (set >= 0) {
        return set != 0;
    }
    static const int64_t env = llama_moe_env_whole("LLAMA_LAYER_MAJOR_PROMPT", 0, 1);
    return env != 0;
}

// the staging budget of the layer groups in bytes, on the device that stages them; 0: auto
static size_t layer_major_staging_bytes() {
    int64_t mib = g_layer_major_mib.load();
    if (mib < 0) {
        static const int64_t env = llama_moe_env_whole("LLAMA_LAYER_MAJOR_STAGING_MIB", 0, INT32_MAX);
        mib = env;
    }
    return mib > 0 ? (size_t) mib * 1024 * 1024 : 0;
}

// the fewest ubatches a call has for layer-major order (a call of one ubatch uploads each weight once anyway)
static int64_t layer_major_min_ubatches() {
    static const int64_t env = llama_moe_env_whole("LLAMA_LAYER_MAJOR_MIN_UBATCHES", 2, INT32_MAX);
    return env > 0 ? env : 2;
}

// how many groups the host weights are cut into where the budget allows (each group's upload overlaps the
// group before it; the first one's does not); 0 (unset): one group where they all fit the budget, else as many as
// half the budget needs
static int64_t layer_major_target_groups() {
    static const int64_t env = llama_moe_env_whole("LLAMA_LAYER_MAJOR_GROUPS", 1, 4096);
    return env > 0 ? env : 0;
}

// LLAMA_LAYER_MAJOR_DEBUG_STAGE_WHOLE=1: the next group's stage queued whole at the group's start (the first group's
// after its first graph) instead of in parts after its ubatches (what parts gain, measured; and a stage that must wait
// for the computes before it, for the tests)
static bool layer_major_debug_stage_whole() {
    static const bool on = llama_moe_env_whole("LLAMA_LAYER_MAJOR_DEBUG_STAGE_WHOLE", 0, 1) == 1;
    return on;
}

// LLAMA_LAYER_MAJOR_DEBUG_GROUP_LAYERS=N: groups of N layers whatever the host weights, the budget and the prefetch
// (tests: layer-major order on a CPU-only build, and group boundaries anywhere)
static int64_t layer_major_debug_group_layers() {
    static const int64_t env = llama_moe_env_whole("LLAMA_LAYER_MAJOR_DEBUG_GROUP_LAYERS", 1, INT32_MAX);
    return env > 0 ? env : 0;
}

void llama_moe_layer_major_init(llama_moe_layer_major & lm) {
    lm.on = llama_moe_layer_major_context_default();
    std::lock_guard<std::mutex> lock(g_layer_major_fit_mutex);
    lm.fit_reserve_device = g_layer_major_fit_mib > 0 ? g_layer_major_fit_device : std::string();
    lm.fit_reserve_bytes  = g_layer_major_fit_mib > 0 ? (size_t) g_layer_major_fit_mib * 1024 * 1024 : 0;
}

void llama_moe_layer_major_say(llama_moe_layer_major & lm, const std::string & why) {
    if (lm.said.insert(why).second) {
        LLAMA_LOG_INFO("llama_moe: layer-major prompts: %s\n", why.c_str());
    }
}

// the architectures whose graph can be built for a range of layers (llm_graph_context::il_begin)
static bool layer_major_arch_ok(llm_arch arch) {
    switch (arch) {
        case LLM_ARCH_QWEN2MOE:
        case LLM_ARCH_QWEN3MOE:
        case LLM_ARCH_OPENAI_MOE:
            return true;
        default:
            return false;
    }
}

// the weights in host memory that each layer's device reads (uploads), by layer
static std::vector<std::vector<ggml_tensor *>> layer_host_weights(const llama_model & model) {
    const int32_t n_layer = (int32_t) model.hparams.n_layer();
    std::vector<std::vector<ggml_tensor *>> weights(n_layer);
    for (const auto & [name, t] : model.tensors_by_name) {
        int il = -1;
        if (sscanf(name.c_str(), "blk.%d.", &il) != 1 || il < 0 || il >= n_layer) {
            continue;
        }
        // a repacked CPU weight has no layout a device reads: the CPU computes it
        if (t->buffer == nullptr || t->extra != nullptr || !ggml_backend_buffer_is_host(t->buffer)) {
            continue;
        }
        ggml_backend_dev_t dev = model.dev_layer(il);
        if (dev == nullptr || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
            continue;
        }
        weights[il].push_back(t);
    }
    return weights;
}

static std::vector<size_t> layer_bytes(const std::vector<std::vector<ggml_tensor *>> & weights) {
    std::vector<size_t> bytes(weights.size(), 0);
    for (size_t il = 0; il < weights.size(); il++) {
        for (const ggml_tensor * t : weights[il]) {
            bytes[il] += ggml_nbytes(t);
        }
    }
    return bytes;
}

// the first backend of the scheduler that is not the CPU's (the scheduler's offload order), or nullptr
static ggml_backend_t first_device_backend(ggml_backend_sched_t sched) {
    for (int b = 0; b < ggml_backend_sched_get_n_backends(sched); b++) {
        ggml_backend_t backend = ggml_backend_sched_get_backend(sched, b);
        ggml_backend_dev_t dev = ggml_backend_get_device(backend);
        if (dev != nullptr && ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
            return backend;
        }
    }
    return nullptr;
}

// whether the graph keeps only the output rows before its last layer's feed-forward, so that a call with few outputs
// computes that layer's experts for those rows alone (below a device's offload batch: on the CPU); gpt-oss does so where
// it extracts masked next-token embeddings, else after its last layer
static bool layer_major_last_ffn_reads_outputs(llm_arch arch, const llama_cparams & cparams) {
    return arch == LLM_ARCH_QWEN2MOE || arch == LLM_ARCH_QWEN3MOE ||
           (arch == LLM_ARCH_OPENAI_MOE && cparams.embeddings_nextn_masked);
}

// whether the planner models where the scheduler computes the products of host weight w: an expert's MUL_MAT_ID and a
// matrix's MUL_MAT. The rest (norms, biases, a 1D gate) are read by ops of other kinds and go with their layer
static bool host_weight_modelled(const ggml_tensor * w) {
    const char * name = ggml_get_name(w);
    const size_t len  = strlen(name);
    return ggml_n_dims(w) == 3 || (ggml_n_dims(w) == 2 && len > 7 && strcmp(name + len - 7, ".weight") == 0);
}

// a node built like the graph's product of n_tokens tokens with a weight of w's type and shape that no buffer holds, in
// ctx: MUL_MAT_ID for an expert tensor, MUL_MAT for a matrix (host_weight_modelled)
static const ggml_tensor * host_weight_product(ggml_context * ctx, const ggml_tensor * w, int64_t n_tokens) {
    if (ggml_n_dims(w) == 2) {
        ggml_tensor * a = ggml_new_tensor_2d(ctx, w->type, w->ne[0], w->ne[1]);
        return ggml_mul_mat(ctx, a, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, w->ne[0], n_tokens));
    }
    ggml_tensor * as  = ggml_new_tensor_3d(ctx, w->type, w->ne[0], w->ne[1], w->ne[2]);
    ggml_tensor * b   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, w->ne[0], 1, n_tokens);
    ggml_tensor * ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1, n_tokens);
    return ggml_mul_mat_id(ctx, as, b, ids);
}

// whether ggml_backend_sched offloads op, which reads a host weight, to dev where no device ahead takes it: dev supports
// the op and takes it (offload_op: each backend's own min batch; an RPC device takes none; a device without kernels for
// the weight's type supports none)
static bool device_offloads(ggml_backend_dev_t dev, const ggml_tensor * op) {
    return ggml_backend_dev_supports_op(dev, op) && ggml_backend_dev_offload_op(dev, op);
}

// whether dev takes a ubatch's product of n_tokens tokens with host weight w (modelled: host_weight_modelled)
static bool device_takes_host_weight(ggml_backend_dev_t dev, const ggml_tensor * w, int64_t n_tokens) {
    const ggml_init_params params = { 4*ggml_tensor_overhead(), nullptr, true };
    ggml_context_ptr ctx { ggml_init(params) };
    if (!ctx || w == nullptr || n_tokens <= 0 || !host_weight_modelled(w)) {
        return false;
    }
    return device_offloads(dev, host_weight_product(ctx.get(), w, n_tokens));
}

// where the scheduler computes a ubatch's product of n_tokens tokens with host weight w: the index of the model's device
// it uploads w to; -1 where nothing is uploaded (the CPU computes it, or a backend reads it in place); -2 where the
// product is not modelled (host_weight_modelled: the weight goes with its layer). The scheduler first picks the first
// backend that can read w's buffer and supports the op (an accelerator such as BLAS, an integrated GPU) and offloads
// only where that is the CPU; an expert tensor not on the host yet (--fit asks before placing them) is asked about as
// one in a CPU buffer
static int32_t device_taking_host_weight(const llama_model & model, const ggml_tensor * w, int64_t n_tokens) {
    if (!host_weight_modelled(w)) {
        return -2;
    }
    const ggml_init_params params = { 4*ggml_tensor_overhead(), nullptr, true };
    ggml_context_ptr ctx { ggml_init(params) };
    if (!ctx || n_tokens <= 0) {
        return -1;
    }
    const ggml_tensor * op = host_weight_product(ctx.get(), w, n_tokens);
    ggml_backend_buffer_type_t buft = w->buffer != nullptr && ggml_backend_buffer_is_host(w->buffer) ?
            ggml_backend_buffer_get_type(w->buffer) : ggml_backend_cpu_buffer_type();
    // the scheduler's backends ahead of the CPU: the model's devices, then the accelerators
    std::vector<ggml_backend_dev_t> ahead;
    for (const auto & d : model.devices) {
        if (ggml_backend_dev_type(d.dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
            ahead.push_back(d.dev);
        }
    }
    for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
        if (ggml_backend_dev_type(ggml_backend_dev_get(i)) == GGML_BACKEND_DEVICE_TYPE_ACCEL) {
            ahead.push_back(ggml_backend_dev_get(i));
        }
    }
    for (ggml_backend_dev_t dev : ahead) {
        if (ggml_backend_dev_supports_buft(dev, buft) && ggml_backend_dev_supports_op(dev, op)) {
            return -1; // read in place, nothing uploaded
        }
    }
    for (int32_t i = 0; i < (int32_t) model.devices.size(); i++) {
        ggml_backend_dev_t dev = model.devices[i].dev;
        if (ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU && device_offloads(dev, op)) {
            return i;
        }
    }
    return -1;
}

// the scheduler's backend of the model's device id (-1: none, nullptr). The stager, the backend the scheduler offloads a
// ubatch's ops on host experts to and whose prefetch stages their copies, is that of
// llama_moe_layer_major_staging_device's device, as --fit finds it (the scheduler's backends ahead of the CPU are the
// model's devices, in order, and accelerators, which take no offload)
static ggml_backend_t device_backend(const llama_model & model, ggml_backend_sched_t sched, int32_t id) {
    for (int b = 0; id >= 0 && b < ggml_backend_sched_get_n_backends(sched); b++) {
        ggml_backend_t backend = ggml_backend_sched_get_backend(sched, b);
        if (ggml_backend_get_device(backend) == model.devices[id].dev) {
            return backend;
        }
    }
    return nullptr;
}

// the host weights read outside the layers that an offloaded op may copy (the output head, on the host under a partial
// -ngl): staged with the last group
static std::vector<ggml_tensor *> head_host_weights(const llama_model & model) {
    std::vector<ggml_tensor *> out;
    for (const auto & [name, t] : model.tensors_by_name) {
        if (name.rfind("blk.", 0) == 0 || name.rfind("token_embd", 0) == 0 || ggml_n_dims(t) < 2) {
            continue; // the layers' own, or read by get_rows on the CPU
        }
        if (t->buffer != nullptr && t->extra == nullptr && ggml_backend_buffer_is_host(t->buffer)) {
            out.push_back(t);
        }
    }
    return out;
}

// the host weights a group stages on the stager (device index id): those whose products the scheduler offloads there.
// The rest (of a type it has no kernels for) go to the CPU or another device and cross as in ubatch order; their bytes
// and types are added to left_bytes and left_types
static std::vector<ggml_tensor *> weights_staged_on(const llama_model & model, int32_t id, uint32_t n_ubatch,
        const std::vector<ggml_tensor *> & list, size_t & left_bytes, std::set<std::string> & left_types) {
    std::vector<ggml_tensor *> kept;
    for (ggml_tensor * t : list) {
        const int32_t taker = device_taking_host_weight(model, t, n_ubatch);
        if (taker == id || taker == -2) {
            kept.push_back(t);
        } else {
            left_bytes += ggml_nbytes(t);
            left_types.insert(ggml_type_name(t->type));
        }
    }
    return kept;
}

// keeps of each layer's host weights, and of the output head's, those staged on the model's device id; returns what is
// left out, to be said once where the plan has groups ("" for nothing)
static std::string keep_weights_staged_on(const llama_model & model, int32_t id, uint32_t n_ubatch,
        std::vector<std::vector<ggml_tensor *>> & weights, std::vector<ggml_tensor *> & head) {
    size_t left = 0;
    std::set<std::string> types;
    for (auto & layer : weights) {
        layer = weights_staged_on(model, id, n_ubatch, layer, left, types);
    }
    head = weights_staged_on(model, id, n_ubatch, head, left, types);
    if (left == 0) {
        return "";
    }
    std::string names;
    for (const std::string & type : types) {
        names += (names.empty() ? "" : ", ") + type;
    }
    char buf[320];
    snprintf(buf, sizeof(buf), "%.1f MiB of host weights (%s) are not uploaded by %s (the CPU or another device computes "
             "them): they are not staged, and go as in ubatch order", left/1024.0/1024.0, names.c_str(),
             ggml_backend_dev_name(model.devices[id].dev));
    return buf;
}

// each group's host weights by the backend whose copies they become, and each such backend's region: the largest
// group's kept copies there
static void plan_staging(llama_moe_layer_major & lm, const llama_model & model, const llama_cparams & cparams,
        ggml_backend_sched_t sched, ggml_backend_t target, const std::vector<std::vector<ggml_tensor *>> & weights,
        const std::vector<ggml_tensor *> & head) {
    lm.weights.assign(lm.groups.size(), {});
    std::map<ggml_backend_t, size_t> region;
    const int32_t n_layer = (int32_t) weights.size();
    for (size_t g = 0; g < lm.groups.size() && target != nullptr; g++) {
        std::map<ggml_backend_t, llama_moe_layer_major::group_weights> by_backend;
        const auto add = [&](const std::vector<ggml_tensor *> & layer, bool rows_only) {
            if (layer.empty()) {
                return;
            }
            auto & gw = by_backend[target];
            gw.backend = target;
            gw.list.insert(gw.list.end(), layer.begin(), layer.end());
            gw.layer_end.push_back(gw.list.size());
            gw.n_rows_only += rows_only ? layer.size() : 0;
        };
        for (int32_t il = lm.groups[g].first; il < lm.groups[g].second; il++) {
            if (il + 1 == n_layer && layer_major_last_ffn_reads_outputs(model.arch, cparams)) {
                // the last layer's feed-forward weights go last, after the rest of the layer: a call with few outputs
                // leaves them out
                std::vector<ggml_tensor *> rest, ffn;
                for (ggml_tensor * t : weights[il]) {
                    (strstr(ggml_get_name(t), ".ffn_") != nullptr ? ffn : rest).push_back(t);
                }
                add(rest, false);
                add(ffn, true);
            } else {
                add(weights[il], false);
            }
        }
        if (g + 1 == lm.groups.size()) {
            add(head, true); // the output head reads the output rows alone
        }
        for (auto & [backend, gw] : by_backend) {
            const size_t size = ggml_backend_sched_prefetch_keep_size(sched, backend, gw.list.data(), (int) gw.list.size());
            region[backend] = std::max(region[backend], size);
            lm.weights[g].push_back(std::move(gw));
        }
    }
    lm.regions.assign(region.begin(), region.end());
}

// groups of consecutive layers whose host bytes together stay within the budget (every group's copies are staged on the
// one device that offloads host weights, whichever device holds its layers); *why where a layer alone exceeds it (then
// no groups)
static llama_moe_layer_groups plan_groups(const std::vector<size_t> & bytes, size_t budget, ggml_backend_dev_t stager,
        std::string & why) {
    llama_moe_layer_groups groups;
    size_t used = 0;
    int32_t begin = 0;
    for (int32_t il = 0; il < (int32_t) bytes.size(); il++) {
        if (bytes[il] == 0) {
            continue;
        }
        if (bytes[il] > budget) {
            char buf[256];
            snprintf(buf, sizeof(buf), "layer %d alone has %.1f MiB of host weights, more than a layer group may stage "
                     "(%.1f MiB on %s): prompts run ubatch by ubatch (LLAMA_LAYER_MAJOR_STAGING_MIB sets the budget)",
                     il, bytes[il]/1024.0/1024.0, budget/1024.0/1024.0, ggml_backend_dev_name(stager));
            why = buf;
            return {};
        }
        if (used + bytes[il] > budget) {
            groups.emplace_back(begin, il);
            begin = il;
            used = 0;
        }
        used += bytes[il];
    }
    groups.emplace_back(begin, (int32_t) bytes.size());
    return groups;
}

// the plan of a context, made once: the groups, or why there are none
static void plan(llama_moe_layer_major & lm, const llama_model & model, ggml_backend_sched_t sched,
        const llama_cparams & cparams) {
    lm.planned = true;
    const int32_t n_layer = (int32_t) model.hparams.n_layer();
    if (!layer_major_arch_ok(model.arch)) {
        lm.why_plan = std::string("the ") + llm_arch_name(model.arch) + " graph is built for all its layers at once";
        return;
    }
    const bool uploads = cparams.op_offload && cparams.prefetch.mode != GGML_BACKEND_SCHED_PREFETCH_OFF;
    std::vector<std::vector<ggml_tensor *>> weights = uploads ? layer_host_weights(model) :
                                                      std::vector<std::vector<ggml_tensor *>>(n_layer);
    // the scheduler offloads every op that reads a host weight to one backend, whose prefetch stages the copies of
    // every group whichever device holds the group's layers: that device's memory is the budget of all of them
    const int32_t  stager_id = llama_moe_layer_major_staging_device(&model, cparams.n_ubatch);
    ggml_backend_t stager    = device_backend(model, sched, stager_id);
    const bool stages = stager != nullptr && ggml_backend_sched_prefetch_enabled(sched, stager);
    std::vector<ggml_tensor *> head = uploads ? head_host_weights(model) : std::vector<ggml_tensor *>();
    const std::string left_out = stages ? keep_weights_staged_on(model, stager_id, cparams.n_ubatch, weights, head) : "";
    if (const int64_t n = layer_major_debug_group_layers(); n > 0) {
        for (int32_t il = 0; il < n_layer; il += (int32_t) n) {
            lm.groups.emplace_back(il, std::min<int32_t>(n_layer, il + (int32_t) n));
        }
        plan_staging(lm, model, cparams, sched, stages ? stager : nullptr, weights, head);
        if (!left_out.empty()) {
            llama_moe_layer_major_say(lm, left_out);
        }
        LLAMA_LOG_WARN("llama_moe: layer-major prompts: LLAMA_LAYER_MAJOR_DEBUG_GROUP_LAYERS=%" PRId64 ": %zu groups of "
                       "up to %" PRId64 " layers (a test setting)\n", n, lm.groups.size(), n);
        return;
    }
    if (!uploads) {
        return; // the host weights are computed where they are, or uploaded at split time: nothing to keep
    }
    const std::vector<size_t> bytes = layer_bytes(weights);
    size_t total = 0, largest = 0;
    for (const size_t b : bytes) {
        total  += b;
        largest = std::max(largest, b);
    }
    if (total == 0) {
        return; // no device reads host weights
    }
    if (stager == nullptr) {
        lm.why_plan = "no device takes the products of host experts at ubatches of " + std::to_string(cparams.n_ubatch) +
                      " tokens (the CPU computes them): nothing is uploaded to keep";
        return;
    }
    ggml_backend_dev_t stager_dev = ggml_backend_get_device(stager);
    if (!stages) {
        lm.why_plan = std::string("the host-weight prefetch is off on ") + ggml_backend_dev_name(stager_dev) +
                      ", which computes the ops on host weights, so its uploads cannot be kept across ubatches";
        return;
    }
    // the budget: the one set, else half of what the device has free beyond the prefetch's headroom (the other half
    // stays for the rest of the context's life), at least what --fit kept free for it, at most all the host weights
    const size_t set = layer_major_staging_bytes();
    size_t budget = set;
    bool fit_reserved = false; // the budget is what --fit kept free, more than half the free memory
    if (budget == 0) {
        size_t free = 0, all = 0;
        ggml_backend_dev_memory(stager_dev, &free, &all);
        budget = free > cparams.prefetch.headroom ? (free - cparams.prefetch.headroom) / 2 : 0;
        // --fit kept this much free beside its target, where half of its target could not hold two groups. The
        // groups' arena replaces the prefetch's ring, and must leave the headroom free
        const size_t avail = free + ggml_backend_sched_get_prefetch_size(sched, stager);
        const size_t kept = lm.fit_reserve_device == ggml_backend_dev_name(stager_dev) ? lm.fit_reserve_bytes : 0;
        const size_t fit  = std::min(kept, avail > cparams.prefetch.headroom ? avail - cparams.prefetch.headroom : 0);
        fit_reserved = fit > budget;
        budget = std::max(budget, fit);
    }
    // groups of at most half the budget, in two regions: while one group's graphs read one region, the next group's
    // weights upload into the other. Only the first group's upload overlaps nothing, and each group costs a reservation
    // and a few host waits, so a group of about sqrt(host bytes x 256 MiB) balances the two (15.5 GiB of experts: 8
    // groups of 1.9 GiB, where on an H100 the first upload takes 37 ms and each group's own cost a few ms). One group
    // where that is all the host weights, or where the budget's half cannot hold the largest layer but its whole holds
    // every one. LLAMA_LAYER_MAJOR_GROUPS=N asks for about 1/N of the weights a group instead
    const int64_t n_groups = layer_major_target_groups();
    const size_t target = n_groups > 0 ? (total + n_groups - 1) / n_groups :
                                         (size_t) std::sqrt((double) total * (256.0 * 1024 * 1024));
    if ((target >= total || budget / 2 < largest) && total <= budget) {
        budget = total;
    } else {
        // as many groups as the target makes, of even shares: a short last group would cost a group's own work for
        // little upload
        const size_t n = (total + target - 1) / std::max<size_t>(target, 1);
        budget = std::min(budget / 2, std::max(largest, (total + n - 1) / n));
    }
    lm.groups = plan_groups(bytes, budget, stager_dev, lm.why_plan);
    if (lm.groups.empty()) {
        return;
    }
    plan_staging(lm, model, cparams, sched, stager, weights, head);
    if (!left_out.empty()) {
        llama_moe_layer_major_say(lm, left_out);
    }
    LLAMA_LOG_INFO("llama_moe: layer-major prompts: %zu layer group%s of the %d layers%s; a group's budget on %s (of the "
                   "host weights): %.1f of %.1f MiB%s; calls of at least %" PRId64 " ubatches\n", lm.groups.size(),
                   lm.groups.size() == 1 ? "" : "s", n_layer,
                   lm.groups.size() == 1 ? "" : ", each group's weights uploaded while the group before runs",
                   ggml_backend_dev_name(stager_dev), budget/1024.0/1024.0, total/1024.0/1024.0,
                   set > 0 ? " (of the budget set)" : fit_reserved ? " (of the staging --fit kept free)" :
                   " (of half the free memory)", layer_major_min_ubatches());
}

llama_moe_layer_groups llama_moe_layer_major_groups(llama_moe_layer_major & lm, const llama_model & model,
        ggml_backend_sched_t sched, const llama_cparams & cparams, uint32_t n_tokens, bool can_rewind) {
    if (!lm.on || (int64_t) n_tokens <= (int64_t) cparams.n_ubatch * (layer_major_min_ubatches() - 1)) {
        return {};
    }
    if (layer_major_debug_group_layers() == 0 && (int64_t) cparams.n_ubatch < (int64_t) cparams.prefetch.min_batch) {
        return {}; // ubatches this small copy their routed experts at split time: nothing is uploaded ahead to keep
    }
    if (!lm.planned) {
        plan(lm, model, sched, cparams);
    }
    if (lm.groups.empty()) {
        if (!lm.why_plan.empty()) {
            llama_moe_layer_major_say(lm, lm.why_plan);
        }
        return {};
    }
    const char * why = nullptr;
    if (cparams.cb_eval != nullptr) {
        why = "an eval callback is set (it sees each ubatch's layers in order): such calls run ubatch by ubatch";
    } else if (cparams.embeddings) {
        why = "embeddings calls run ubatch by ubatch";
    } else if (std::find(cparams.embeddings_layer_inp.begin(), cparams.embeddings_layer_inp.end(), true) !=
               cparams.embeddings_layer_inp.end()) {
        why = "a layer's inputs are extracted (llama_set_embeddings_layer_inp): such calls run ubatch by ubatch";
    } else if (!can_rewind) {
        why = "the memory cannot run a call's ubatches again for each layer group (recurrent or hybrid memory, or a "
              "sliding-window cache smaller than the call: --swa-full keeps it whole): such calls run ubatch by ubatch";
    }
    if (why != nullptr) {
        llama_moe_layer_major_say(lm, why);
        return {};
    }
    return lm.groups;
}

void llama_moe_layer_major_begin(llama_moe_layer_major & lm, ggml_backend_sched_t sched) {
    lm.rows_ordered = true;
    for (auto & d : lm.rows_downloads) {
        d.pending = false;
    }
    lm.staging = lm.groups.size() > 1 && !lm.regions.empty();
    for (const auto & [backend, region] : lm.regions) {
        // every backend asked, so that none keeps two regions for a call that stages on none
        const bool made = lm.staging && ggml_backend_sched_set_prefetch_keep_layout(sched, backend, 0, 2*region);
        lm.staging = lm.staging && made;
    }
    if (lm.groups.size() > 1 && !lm.regions.empty() && !lm.staging) {
        llama_moe_layer_major_say(lm, "the staging arena could not be made to hold two layer groups' host weights: each "
                "group uploads its own in its first ubatch, overlapping none of the group before");
    }
}

float * llama_moe_layer_major_rows(llama_moe_layer_major & lm, ggml_backend_sched_t sched, size_t n_floats) {
    if (lm.hidden != nullptr && lm.hidden_cap >= n_floats) {
        return lm.hidden;
    }
    lm.hidden     = nullptr;
    lm.hidden_cap = 0;
    lm.hidden_buf.reset();
    lm.hidden_pageable.reset();
    // the host memory of the first device the scheduler computes on (the groups' graphs run there)
    ggml_backend_t device = first_device_backend(sched);
    ggml_backend_buffer_type_t pinned = device != nullptr ?
            ggml_backend_dev_host_buffer_type(ggml_backend_get_device(device)) : nullptr;
    if (pinned != nullptr) {
        lm.hidden_buf.reset(ggml_backend_buft_alloc_buffer(pinned, n_floats*sizeof(float)));
        lm.hidden = lm.hidden_buf ? (float *) ggml_backend_buffer_get_base(lm.hidden_buf.get()) : nullptr;
    }
    if (lm.hidden == nullptr) {
        lm.hidden_pageable.reset(new (std::nothrow) float[n_floats]);
        lm.hidden = lm.hidden_pageable.get();
    }
    // a device's host buffer type may hand out pageable memory itself where pinning fails (CUDA does)
    if (lm.hidden != nullptr && pinned != nullptr && (!lm.hidden_buf || ggml_backend_buffer_get_type(lm.hidden_buf.get()) != pinned)) {
        llama_moe_layer_major_say(lm, "the boundary rows did not fit in pinned host memory: they are pageable, and "
                "each ubatch's copy of its rows makes the host wait for its compute");
    }
    lm.hidden_cap = lm.hidden != nullptr ? n_floats : 0;
    return lm.hidden;
}

void llama_moe_layer_major_rows_queued(llama_moe_layer_major & lm, ggml_backend_t backend, uint32_t u) {
    if (!lm.rows_ordered) {
        return;
    }
    if (lm.rows_downloads.size() <= u) {
        lm.rows_downloads.resize(u + 1);
    }
    auto & d = lm.rows_downloads[u];
    // an event is recorded on a stream of its own device only: a group that ends on another device gets a new one
    // (the old one was waited for before this group's ubatch read the rows)
    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    if (d.done && d.dev != dev) {
        GGML_ASSERT(!d.pending);
        d.done.reset();
    }
    if (!d.done && dev != nullptr) {
        d.done.reset(ggml_backend_event_new(dev));
        d.dev = dev;
    }
    if (!d.done) {
        lm.rows_ordered = false; // no events here (the CPU backend's download is done when it returns anyway)
        return;
    }
    ggml_backend_event_record(d.done.get(), backend);
    d.pending = true;
}

void llama_moe_layer_major_rows_wait(llama_moe_layer_major & lm, uint32_t u) {
    if (u < lm.rows_downloads.size() && lm.rows_downloads[u].pending) {
        const int64_t t_wait = llama_moe_layer_major_debug_times_on() ? ggml_time_us() : 0;
        ggml_backend_event_synchronize(lm.rows_downloads[u].done.get());
        lm.rows_downloads[u].pending = false;
        if (t_wait != 0) {
            lm.steps.us_rows_wait += ggml_time_us() - t_wait;
        }
    }
}

void llama_moe_layer_major_enter(llama_moe_layer_major & lm, ggml_backend_sched_t sched, int32_t g) {
    if (!lm.staging) {
        return;
    }
    for (const auto & [backend, region] : lm.regions) {
        ggml_backend_sched_set_prefetch_keep_layout(sched, backend, (size_t) (g % 2) * region, 0);
    }
}

void llama_moe_layer_major_stage_begin(llama_moe_layer_major & lm, ggml_backend_sched_t sched, int32_t g,
        llama_moe_cache_rt * cache, uint32_t n_outputs) {
    lm.stage.clear();
    if (!lm.staging || g + 1 >= (int32_t) lm.groups.size()) {
        return;
    }
    const int64_t t_stage = llama_moe_layer_major_debug_times_on() ? ggml_time_us() : 0;
    for (const auto & gw : lm.weights[g + 1]) {
        size_t region = 0;
        for (const auto & [b, r] : lm.regions) {
            region = b == gw.backend ? r : region;
        }
        // the weights only output rows read stay on the host where the device takes no product of so few rows: the
        // CPU computes them (a prompt that outputs its last token alone). Asked of the first of them whose product is
        // modelled (the offload rule counts a product's tokens alike for every type and shape)
        const ggml_tensor * rows_probe = nullptr;
        for (size_t i = gw.list.size() - gw.n_rows_only; i < gw.list.size() && rows_probe == nullptr; i++) {
            rows_probe = host_weight_modelled(gw.list[i]) ? gw.list[i] : nullptr;
        }
        const bool rows_on_cpu = rows_probe != nullptr &&
                !device_takes_host_weight(ggml_backend_get_device(gw.backend), rows_probe, n_outputs);
        const size_t n_staged = gw.list.size() - (rows_on_cpu ? gw.n_rows_only : 0);
        // a layer the expert cache reads in place is not staged at all
        llama_moe_layer_major::stage_progress sp;
        sp.backend = gw.backend;
        size_t i = 0, bytes = 0;
        for (size_t end : gw.layer_end) {
            if (end > n_staged) {
                break; // the rows-only weights are whole entries of layer_end, at its end
            }
            for (; i < end; i++) {
                if (!llama_moe_cache_reads_in_place(cache, gw.list[i])) {
                    sp.bytes_before.push_back(bytes);
                    sp.list.push_back(gw.list[i]);
                    bytes += ggml_nbytes(gw.list[i]);
                }
            }
            if (sp.layer_end.empty() || sp.layer_end.back() != sp.list.size()) {
                sp.layer_end.push_back(sp.list.size());
            }
        }
        sp.bytes_before.push_back(bytes);
        // nothing yet: the wait for the computes that read the region, so that the parts need not wait again
        ggml_backend_sched_prefetch_stage(sched, gw.backend, (size_t) ((g + 1) % 2) * region, nullptr, 0);
        lm.stage.push_back(std::move(sp));
    }
    if (layer_major_debug_stage_whole() && g > 0) {
        llama_moe_layer_major_stage_part(lm, sched, cache, 1.0); // the first group's goes with its first part
    }
    if (t_stage != 0) {
        lm.t_stage  = t_stage;
        lm.us_stage = ggml_time_us() - t_stage;
    }
}

void llama_moe_layer_major_stage_part(llama_moe_layer_major & lm, ggml_backend_sched_t sched, llama_moe_cache_rt * cache,
        double share) {
    share = layer_major_debug_stage_whole() ? 1.0 : share; // the first call queues all of it (the order before parts)
    const int64_t t_part = llama_moe_layer_major_debug_times_on() ? ggml_time_us() : 0;
    // the expert cache writes the copies of its layers' experts (residents from the banks) and plans them as the
    // first graph that reads them would
    llama_moe_cache_set_staging(cache, true);
    for (auto & sp : lm.stage) {
        const size_t want = share >= 1.0 ? sp.bytes_before.back() : (size_t) (share * (double) sp.bytes_before.back());
        size_t end = sp.next;
        for (size_t cut : sp.layer_end) {
            if (cut > sp.next && sp.bytes_before[end] < want) {
                end = cut; // whole layers, up to the first that reaches the share
            }
        }
        if (end > sp.next) {
            // a weight left out (the arena could not hold it) is uploaded by its own graph; the rest stay where staged
            ggml_backend_sched_prefetch_stage_more(sched, sp.backend, sp.list.data() + sp.next, (int) (end - sp.next));
            sp.next = end;
        }
    }
    llama_moe_cache_set_staging(cache, false);
    if (t_part != 0) {
        lm.us_stage += ggml_time_us() - t_part;
    }
}

bool llama_moe_layer_major_debug_times_on() {
    static const bool on = llama_moe_env_whole("LLAMA_LAYER_MAJOR_DEBUG_TIMES", 0, 1) == 1;
    return on;
}

void llama_moe_layer_major_group_begin(llama_moe_layer_major & lm, ggml_backend_sched_t sched) {
    if (!llama_moe_layer_major_debug_times_on()) {
        return;
    }
    lm.t_group    = ggml_time_us();
    lm.t_reserved = 0;
    lm.t_stage    = 0;
    lm.us_stage   = 0;
    lm.steps      = {};
    ggml_backend_sched_get_stats(sched, &lm.stats_group);
}

void llama_moe_layer_major_group_reserved(llama_moe_layer_major & lm) {
    if (llama_moe_layer_major_debug_times_on()) {
        lm.t_reserved = ggml_time_us();
    }
}

void llama_moe_layer_major_graph_timed(llama_moe_layer_major & lm, bool reused, int64_t t_start, int64_t t_graph,
        int64_t t_built, int64_t t_inputs, int64_t t_bound, int64_t t_queued) {
    llama_moe_layer_major_steps & st = lm.steps;
    st.n_graphs++;
    st.n_reused     += reused;
    st.us_built     += (reused ? t_built : t_graph) - t_start;
    st.us_allocated += reused ? 0 : t_built - t_graph;
    st.us_inputs    += t_inputs - t_built;
    st.us_bound     += t_bound - t_inputs;
    st.us_queued    += t_queued - t_bound;
}

void llama_moe_layer_major_log_steps(llama_moe_layer_major & lm, const char * what) {
    const llama_moe_layer_major_steps & st = lm.steps;
    const double per = st.n_graphs > 0 ? 1000.0 * st.n_graphs : 1000.0; // us in all -> ms per graph
    // the inputs that took longest, by kind (a type name without its length prefix)
    std::vector<std::pair<int64_t, std::string>> inputs;
    for (const auto & [name, us] : st.us_by_input) {
        inputs.emplace_back(us, name.substr(name.find_first_not_of("0123456789")));
    }
    std::sort(inputs.rbegin(), inputs.rend());
    std::string by_input;
    for (size_t i = 0; i < inputs.size() && i < 4; i++) {
        char part[128];
        snprintf(part, sizeof(part), "%s%s %.2f", i > 0 ? ", " : "", inputs[i].second.c_str(), inputs[i].first / per);
        by_input += part;
    }
    LLAMA_LOG_INFO("llama_moe: layer-major graph times: %s, %" PRId64 " graphs (%" PRId64 " reused), per graph: built "
                   "%.2f ms, allocated %.2f ms, inputs %.2f ms (%s), expert cache bind %.2f ms, computes queued %.2f ms "
                   "(the scheduler's waits for uploads included); boundary rows waited for %.2f ms in all\n",
                   what, st.n_graphs, st.n_reused, st.us_built / per, st.us_allocated / per, st.us_inputs / per,
                   by_input.c_str(), st.us_bound / per, st.us_queued / per, st.us_rows_wait / 1000.0);
    lm.steps = {};
}

void llama_moe_layer_major_group_end(llama_moe_layer_major & lm, ggml_backend_sched_t sched, int32_t g, uint32_t n_ubatch) {
    if (!llama_moe_layer_major_debug_times_on()) {
        if (!lm.rows_ordered) {
            ggml_backend_sched_synchronize(sched);
        }
        return;
    }
    const int64_t t_launched = ggml_time_us();
    // the computes first (every device backend's queue), then the copy queues, which hold the next group's stage
    for (int b = 0; b < ggml_backend_sched_get_n_backends(sched); b++) {
        ggml_backend_synchronize(ggml_backend_sched_get_backend(sched, b));
    }
    const int64_t t_computed = ggml_time_us();
    ggml_backend_sched_synchronize(sched);
    const int64_t t_drained = ggml_time_us();
    ggml_backend_sched_stats now = {};
    ggml_backend_sched_get_stats(sched, &now);
    const auto ms = [](int64_t us) { return us / 1000.0; };
    LLAMA_LOG_INFO("llama_moe: layer-major times: group %d (layers %d-%d), %u ubatches: reserve %.2f ms, next stage begun at "
                   "+%.2f ms (its parts queued in %.2f ms), ubatches queued by +%.2f ms, computes done +%.2f ms, copy queues done +%.2f ms "
                   "(group %.2f ms); uploaded %.1f MiB (%.1f staged), %.1f MiB kept, %" PRIu64 " reallocations, %" PRIu64 " host "
                   "synchronizations (%" PRIu64 " for uploads) in %" PRIu64 " graphs\n",
                   g, lm.il_begin, lm.il_end - 1, n_ubatch, ms(lm.t_reserved - lm.t_group),
                   lm.t_stage != 0 ? ms(lm.t_stage - lm.t_group) : 0.0, ms(lm.us_stage), ms(t_launched - lm.t_group),
                   ms(t_computed - t_launched), ms(t_drained - t_computed), ms(t_drained - lm.t_group),
                   (now.prefetch_upload_bytes - lm.stats_group.prefetch_upload_bytes)/1024.0/1024.0,
                   (now.prefetch_staged_bytes - lm.stats_group.prefetch_staged_bytes)/1024.0/1024.0,
                   (now.prefetch_kept_bytes - lm.stats_group.prefetch_kept_bytes)/1024.0/1024.0,
                   now.n_graph_reallocs - lm.stats_group.n_graph_reallocs, now.n_host_syncs - lm.stats_group.n_host_syncs,
                   now.n_host_syncs_upload - lm.stats_group.n_host_syncs_upload,
                   now.n_graph_computes - lm.stats_group.n_graph_computes);
    llama_moe_layer_major_log_steps(lm, ("group " + std::to_string(g)).c_str());
}

void llama_moe_default_set_layer_major_prompt(int32_t on) {
    if (on > 1 || on < -1) {
        LLAMA_LOG_ERROR("llama_moe: layer-major prompts %d is not one of 0, 1 (-1 unsets); left as it was\n", on);
        return;
    }
    g_layer_major.store(on);
}

int32_t llama_moe_default_get_layer_major_prompt(void) {
    return llama_moe_layer_major_context_default() ? 1 : 0;
}

void llama_moe_default_set_layer_major_staging_mib(int64_t mib) {
    if (mib < -1 || mib > INT32_MAX) {
        LLAMA_LOG_ERROR("llama_moe: layer-major staging %" PRId64 " MiB is out of range (0: auto, -1 unsets); left as it was\n", mib);
        return;
    }
    g_layer_major_mib.store(mib);
}

int64_t llama_moe_default_get_layer_major_staging_mib(void) {
    int64_t mib = g_layer_major_mib.load();
    if (mib < 0) {
        mib = (int64_t) (layer_major_staging_bytes() / 1024 / 1024);
    }
    return mib;
}

size_t llama_moe_layer_major_least_staging(const llama_model * model) {
    if (!layer_major_arch_ok(model->arch)) {
        return 0;
    }
    // a layer with experts counts all its feed-forward tensors: where --fit keeps only a layer's attention on the
    // device, its router and shared experts are host weights too
    std::vector<size_t> bytes(model->hparams.n_layer(), 0);
    std::vector<bool>   experts(bytes.size(), false);
    for (const auto & [name, t] : model->tensors_by_name) {
        int il = -1, n = 0;
        if (sscanf(name.c_str(), "blk.%d.%n", &il, &n) == 1 && n > 0 && il >= 0 && il < (int) bytes.size() &&
            name.compare(n, 4, "ffn_") == 0) {
            bytes[il] += ggml_nbytes(t);
            experts[il] = experts[il] || llama_moe_is_expert_tensor(name);
        }
    }
    size_t largest = 0;
    for (size_t il = 0; il < bytes.size(); il++) {
        largest = experts[il] ? std::max(largest, bytes[il]) : largest;
    }
    return 2 * largest;
}

void llama_moe_default_set_layer_major_fit_reserve_mib(const char * device, int64_t mib) {
    if (mib < -1 || mib > INT32_MAX || (mib >= 0 && (device == nullptr || *device == '\0'))) {
        LLAMA_LOG_ERROR("llama_moe: layer-major --fit reserve %" PRId64 " MiB on %s is out of range (a device and >= 0, "
                        "or -1 to unset); left as it was\n", mib, device != nullptr ? device : "(no device)");
        return;
    }
    std::lock_guard<std::mutex> lock(g_layer_major_fit_mutex);
    g_layer_major_fit_mib    = mib;
    g_layer_major_fit_device = mib >= 0 ? device : "";
}

int64_t llama_moe_default_get_layer_major_fit_reserve_mib(void) {
    std::lock_guard<std::mutex> lock(g_layer_major_fit_mutex);
    return std::max<int64_t>(0, g_layer_major_fit_mib);
}

int32_t llama_moe_layer_major_staging_device(const llama_model * model, uint32_t n_ubatch) {
    // the device taking the most expert bytes: where the types differ (a Q4_K_M model's Q6_K down experts), a device
    // without kernels for some of them leaves those to the next device or the CPU
    std::map<int32_t, size_t> bytes;
    for (const auto & [name, t] : model->tensors_by_name) {
        if (ggml_n_dims(t) == 3 && llama_moe_is_expert_tensor(name)) {
            const int32_t id = device_taking_host_weight(*model, t, n_ubatch);
            if (id >= 0) {
                bytes[id] += ggml_nbytes(t);
            }
        }
    }
    int32_t best = -1;
    size_t  most = 0;
    for (const auto & [id, b] : bytes) {
        if (b > most) {
            best = id;
            most = b;
        }
    }
    return best;
}
