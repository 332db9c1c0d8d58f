// llama-moe-cache-rt.cpp: the expert cache's banks, graph hook and decode plan; see llama-moe-cache-rt.h.
#include "llama-moe-cache-rt.h"

#include "llama-impl.h"
#include "llama-model.h"
#include "llama-moe-cache.h"
#include "llama-moe-cache-profile.h"
#include "llama-moe-impl.h"
#include "llama-moe.h"

#include "ggml-alloc.h"
#include "ggml-copy-regions.h"
#include "ggml-dev-caps.h"
#include "ggml-mmid-batch.h"
#include "ggml-moe-cache-lookup.h"

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>

static const int EXP_N_WEIGHTS = LLAMA_MOE_CACHE_GATE_B;
static const char * const EXP_NAMES[LLAMA_MOE_CACHE_N_TENSORS] = { "gate", "up", "down", "gate_up", "gate_b", "up_b", "down_b", "gate_up_b" };

static int expert_dim(int k) {
    return k < EXP_N_WEIGHTS ? 2 : 1;
}

// what a device keeps free besides the banks: the scheduler's headroom default, so that the compute buffers and the
// staging arena reserved after the cache still fit
static const size_t CACHE_FREE_MARGIN = (size_t) 512 * 1024 * 1024;

struct rt_layer {
    int32_t            il      = -1;
    ggml_backend_dev_t dev     = nullptr;
    ggml_backend_t     backend = nullptr; // the scheduler's backend of dev: uploads go on the stream that computes
    // dev's batched copies (ggml-copy-regions.h), or null: one call per run (also with LLAMA_MOE_CACHE_COPY_BATCH=0)
    ggml_backend_copy_regions_async_t copy_regions = nullptr;
    llama_moe_cache_graph_layer g; // the tensors it copies, their banks and the slot map
    int32_t n_slots = 0;
    int32_t n_used  = 0; // experts per token in this layer
    int32_t n_expert = 0;
    // the most tokens whose mul_mat_id on dev reads a bank with the bytes of the whole weight (ggml-mmid-batch.h): a
    // larger graph takes the staging path here even where its experts fit the slots
    int32_t vec_max = 8;
    // the weight type whose limit set vec_max below LLAMA_MOE_CACHE_DECODE_MAX (GGML_TYPE_COUNT: none did)
    ggml_type vec_type = GGML_TYPE_COUNT;
    // the slot map of the last plan; an asynchronous upload reads it after the callback returns, and the next plan of
    // the layer comes after the scheduler synchronized the device again (a later graph)
    std::vector<int32_t> slot_map_host;
    std::vector<int32_t> cold_map_host; // ... and the cold map of a hot/cold plan
    // the prompt plan of the graph being computed (made at the layer's first fill of that graph), per expert: the
    // slot its staged bytes are read from (-1: uploaded from the host), and the slot they are admitted into (-1: none)
    uint64_t prompt_graph = 0;
    std::vector<int32_t> read_slot;
    std::vector<int32_t> admit_slot;
    // layer-major prompts: the plan was made where the layer's copies were staged ahead of its graphs (its copies are
    // issued; the next graph that finds them in place takes it as its own), and the moves that plan's counters
    // charged (taken back where a graph finds the copy in place and moves none of them)
    bool     staged_plan   = false;
    bool     plan_charged  = false; // the expert counts
    bool     tensor_charged[LLAMA_MOE_CACHE_N_TENSORS] = {}; // each tensor's share of the bytes
    uint64_t charged_reads = 0, charged_uploads = 0;
    // that plan's admits, kept only once every bank of the layer got its bytes (checked when the next graph is bound):
    // a graph may stage some of a layer's tensors alone (a matmul left on the CPU next to an offloaded bias add) or
    // stop before the rest
    std::vector<llama_moe_cache_fill> pending;
    size_t filled[LLAMA_MOE_CACHE_N_TENSORS] = {};
    // where that graph staged each tensor on the layer's device (the scheduler's copy), and the copy queue that wrote
    // it: what the seeding copies from
    ggml_tensor *  staged[LLAMA_MOE_CACHE_N_TENSORS] = {};
    ggml_backend_t staged_queue = nullptr;
    // the seed of the graph seed_graph: its fills (staged copy -> slot), and which tensors' copies are issued. The
    // routing is read in the split before the layer's, where the uploads of its later tensors may not have been issued
    // yet (the prefetch's lookahead): a tensor gets its copies once its staged copy is complete (copy_fill). Like the
    // admits, the seed is kept only where every bank got all of its copies (settle_prompt_admits)
    uint64_t seed_graph = 0;
    std::vector<llama_moe_cache_fill> seed_fills;
    bool seed_issued[LLAMA_MOE_CACHE_N_TENSORS] = {};
    // the graphs bound, per phase and the path the layer took in each (llama_moe_cache_get_path_steps)
    uint64_t path_steps[LLAMA_MOE_CACHE_PHASE_COUNT][LLAMA_MOE_CACHE_PATH_COUNT] = {};
    // a graph read the layer in place since the scheduler last synchronized for it (see bind_graph)
    bool in_place_bound = false;

    // the device lookup (llama-moe-cache-rt.h, "Decode on the device"): whether decode graphs look the layer's slots
    // up on its device, the slot state there, and where kernels there read each host tensor in place
    bool          device_lookup = false;
    // decode graphs may compute the layer hot/cold (llama-moe-cache-rt.h): a device lookup, and masked ids on the
    // layer's device and on the CPU
    bool          hot_cold      = false;
    ggml_tensor * state         = nullptr;
    // this layer's word of its device's status words (rt_status): its lookups count their refusals there
    int32_t       status_dev    = -1;
    int32_t       status_index  = -1;
    // which copy of the slot state is newer: the planner's (uploaded before the next device lookup) or the device's
    // (read back before the planner plans the layer again); the same after a handover
    enum state_side { STATE_SAME, STATE_HOST_AHEAD, STATE_DEVICE_AHEAD } state_ahead = STATE_HOST_AHEAD;
    std::vector<int32_t> state_host; // the upload's source (read by the copy until the next synchronization)
    uint64_t device_counted[GGML_MOE_CACHE_N_COUNTERS] = {}; // the device's counters as last added to the stats
    // a layer with a slot per expert becomes whole on the device, where the planner cannot see it: its state is read
    // back once its lookups may have filled every free slot, then every WHOLE_CHECK_STEPS of its device steps
    int64_t device_steps     = 0;
    int64_t next_whole_check = 0;
};

static const int64_t WHOLE_CHECK_STEPS = 8;

// a copy of a run of bytes into or out of a staged copy: from the host weight (src null) or a bank, to a tensor
struct fill_move {
    const ggml_tensor * src; // null: the host weight
    size_t              src_offset;
    ggml_tensor *       dst;
    size_t              dst_offset;
    size_t              size;
};

// the device lookups' status words of one device, a word per cached layer there (ggml_moe_cache_lookup's status),
// in the banks' buffer, and their host copy: read back once after each graph with device lookups, on the stream that
// computed it, with the step's outputs (llama_moe_cache_graph_ok)
struct rt_status {
    ggml_tensor *         words    = nullptr; // I32 [cached layers of the device]
    ggml_backend_t        backend  = nullptr; // the context's backend of the device
    ggml_backend_buffer_t host_buf = nullptr; // the device's host buffer type (page-locked on CUDA), where it has one
    std::vector<int32_t>  host_fallback;
    int32_t *             host     = nullptr;
    std::vector<int32_t>  layer_of; // word -> the model layer (il): rt.layers is compacted after allocation
};

struct llama_moe_cache_rt {
    std::unique_ptr<llama_moe_cache> plan;
    std::vector<rt_layer> layers;
    std::vector<int32_t>  index;      // [n_layer] into layers, or -1
    int64_t budget_mib = 0;
    int32_t decode_max = 8;
    // the miss policy of decode lookups (llama_moe_default_set_moe_miss_policy), read when made: the most misses a
    // layer step fills (GGML_MOE_CACHE_FILL_ALL: upload every one that finds a slot; 0: none, "cpu"; N: "split:N")
    int32_t max_fills = GGML_MOE_CACHE_FILL_ALL;

    std::vector<ggml_context *> ctxs; // the banks' tensors, one context per device
    std::vector<ggml_backend_buffer_t> bufs;

    // the eval callback of the graph being computed
    const llama_moe_cache_routes * routes = nullptr;
    ggml_backend_sched_eval_callback user_cb = nullptr;
    void * user_data = nullptr;
    const ggml_tensor * user_asked = nullptr; // the node of the last "ask", and the user's answer
    bool user_wants_it = false;

    std::vector<int32_t> ids_host;    // the router's ids read back, reused
    llama_moe_cache_decode_plan dplan;
    llama_moe_cache_prompt_plan pplan;
    std::vector<fill_move> fill_uploads;  // copy_fill's moves and regions, reused
    std::vector<fill_move> fill_device;
    std::vector<ggml_backend_copy_region> fill_regions;
    std::vector<bool> device_in_graph; // bind_graph: the layers the graph looks up on the device
    bool freeing = false;
    // the user's eval callback stopped a graph that looked up on the device: fills after the stop did not run, so the
    // device's state may name experts whose bytes never reached their slots (see llama_moe_cache_settle)
    bool device_graph_stopped = false;
    // LLAMA_MOE_DEBUG_DECODE_TIMES: the last bind's waits and slot state uploads (llama_moe_cache_debug_bind_us)
    int64_t debug_bind_sync_us   = 0;
    int64_t debug_bind_upload_us = 0;
    bool graph_looks_up_on_device = false; // the bound graph has device lookups (alone, or beside host-planned layers)
    uint64_t n_device_graphs = 0;          // graphs bound with device lookups, for LLAMA_MOE_CACHE_DEBUG_REFUSE
    std::vector<int8_t> graph_paths; // bind_graph: the path of each layer in the graph, reused

    // prompts: which layer and tensor each host expert tensor is, for the scheduler's copy callbacks
    std::unordered_map<const ggml_tensor *, std::pair<int32_t, int>> host_tensor;
    uint64_t n_graphs = 0;        // graphs bound, so a layer's prompt plan is made once per graph
    bool staging = false;         // the fills that come are a stage of later graphs' copies (llama_moe_cache_set_staging)
    // which queue touched the banks last: a decode graph reads and fills them on the compute stream, a prompt's fills
    // read and admit on the copy queue; the first graph of the other kind waits for that work (once per switch).
    // The wait goes through the scheduler: it owns its copy queues (a reserve frees them with it) and counts what the
    // cache issues on them (copy_fill, and the seed from the eval callback of the same graph) as its own queued
    // work until it synchronizes them, so the cache keeps no handle of a queue past the graph that gave it
    bool banks_on_compute = false;
    bool banks_on_queue   = false;

    // seeding (llama-moe-cache-rt.h, "Seeding"): whether the cache seeds at all, whether the next graph bound is to
    // seed (llama_moe_cache_seed_ubatch), and whether the bound one does
    bool    seed_on     = true;
    int32_t probe       = LLAMA_MOE_CACHE_PROBE_OFF; // llama_moe_default_set_moe_cache_probe, read when made
    int64_t seed_tokens = 0; // the ubatch size of the graph to seed (0: none)
    bool    seeding     = false;
    bool said_no_seed   = false; // said once: nothing uploads ahead, so prompts do not seed
    bool said_seed_undone = false; // said once: a seed taken back
    std::vector<fill_move> seed_moves;
    // LLAMA_MOE_CACHE_DEBUG_CHECK_SEED: the layers seeded in the last graph (indices into layers), whose resident
    // slots are compared with the host experts at the next settle (after the copy queue that seeded them is done)
    bool check_seed = false;
    std::vector<size_t> seeds_to_check;
    uint64_t n_seeds_checked = 0;
    uint64_t n_seeds_differ  = 0;

    // the expert cache profile (llama-moe-cache-rt.h, "Profiles"): its file (empty: none), the model it is for, and
    // whether the file was refused when the cache was made (then it is never written)
    std::string profile_path;
    llama_moe_cache_profile_id profile_id;
    bool profile_refused = false;

    std::vector<rt_status> statuses;

    ~llama_moe_cache_rt() {
        for (rt_status & s : statuses) {
            ggml_backend_buffer_free(s.host_buf); // null-safe
        }
        for (ggml_backend_buffer_t b : bufs) {
            ggml_backend_buffer_free(b);
        }
        for (ggml_context * c : ctxs) {
            ggml_free(c);
        }
    }
};

static double mib(size_t bytes) {
    return bytes / (1024.0 * 1024.0);
}

// LLAMA_MOE_CACHE_DECODE_MAX: the largest graph (tokens) that plans on the host; read once. The default, 8, keeps
// CUDA on its matrix-vector kernels, whose bytes do not depend on the number of experts of the weight they read (a
// bank has fewer than the layer); above that the tiled kernels split work by expert count.
static int32_t decode_max_tokens() {
    static const int32_t n = [] {
        const int64_t v = llama_moe_env_whole("LLAMA_MOE_CACHE_DECODE_MAX", 1, 8);
        return v > 0 ? (int32_t) v : 8;
    }();
    return n;
}

// the largest graph whose expert matmuls on host weights stay on the CPU (the scheduler offloads an op from
// GGML_OP_OFFLOAD_MIN_BATCH tokens on; ggml-cuda and SIM read the same variable, 32 unset): the largest a hot/cold
// layer computes, its cold experts on the CPU beside the hot ones on the device
static int32_t hot_cold_max_tokens() {
    static const int32_t n = [] {
        // read as ggml-cuda reads it (atoi), so that both agree on which graphs offload
        const char * env = getenv("GGML_OP_OFFLOAD_MIN_BATCH");
        const int64_t min_batch = env != nullptr ? atoi(env) : 32;
        return (int32_t) std::clamp<int64_t>(min_batch - 1, 0, 4096);
    }();
    return n;
}

// the routed ids a layer's lookup tensor has room for: a graph that fits the slots, or a hot/cold graph
static int64_t lookup_max_ids(int32_t n_slots, int32_t n_used) {
    return std::max<int64_t>(n_slots, (int64_t) hot_cold_max_tokens() * n_used);
}

// LLAMA_MOE_CACHE_COPY_BATCH=0: a prompt's staging copies one run per call even where the device batches them (for
// comparisons and to test that path); read once
static bool copy_batch_on() {
    static const bool on = llama_moe_env_whole("LLAMA_MOE_CACHE_COPY_BATCH", 0, 1) != 0;
    return on;
}

// why layer il's experts cannot be cached, or nullptr; fills the host tensors
static const char * layer_unfit(const llama_model & model, int32_t il, rt_layer & l) {
    const llama_layer & ly = model.layers[il];
    l.g.host[LLAMA_MOE_CACHE_GATE]    = ly.ffn_gate_exps;
    l.g.host[LLAMA_MOE_CACHE_UP]      = ly.ffn_up_exps;
    l.g.host[LLAMA_MOE_CACHE_DOWN]    = ly.ffn_down_exps;
    l.g.host[LLAMA_MOE_CACHE_GATE_UP] = ly.ffn_gate_up_exps;
    l.g.host[LLAMA_MOE_CACHE_GATE_B]    = ly.ffn_gate_exps_b;
    l.g.host[LLAMA_MOE_CACHE_UP_B]      = ly.ffn_up_exps_b;
    l.g.host[LLAMA_MOE_CACHE_DOWN_B]    = ly.ffn_down_exps_b;
    l.g.host[LLAMA_MOE_CACHE_GATE_UP_B] = ly.ffn_gate_up_exps_b;
    if (l.g.host[LLAMA_MOE_CACHE_DOWN] == nullptr || (l.g.host[LLAMA_MOE_CACHE_UP] == nullptr && l.g.host[LLAMA_MOE_CACHE_GATE_UP] == nullptr)) {
        return "dense";
    }
    if (l.g.host[LLAMA_MOE_CACHE_DOWN]->ne[2] != l.n_expert) {
        return "in tensors of another expert count than the model's";
    }
    for (int k = 0; k < EXP_N_WEIGHTS; k++) {
        const ggml_tensor * t = l.g.host[k];
        if (t == nullptr) {
            continue;
        }
        if (t->extra != nullptr) {
            // a CPU repack buffer (not a host buffer to ggml): its bytes are not in the layout a GPU reads
            return "in a CPU repack buffer, whose layout a GPU cannot read (--no-repack)";
        }
        if (t->buffer == nullptr || !ggml_backend_buffer_is_host(t->buffer)) {
            return "on a device"; // not a host layer: nothing to cache
        }
        if (!ggml_is_contiguous(t) || t->ne[2] != l.g.host[LLAMA_MOE_CACHE_DOWN]->ne[2]) {
            return "in a host layout the banks do not copy (not contiguous, or tensors of different expert counts)";
        }
    }
    // every weight is on the host. A per-expert bias gets a bank beside its weight's, so that the matmul and the
    // bias add read the same slots (CUDA fuses them); one the banks cannot hold would be added with the router's ids
    // next to a matmul reading slots, which CUDA refuses to fuse: such a layer is not cached (a bias on a device: an
    // -ot rule that moved only the .weight tensors)
    for (int k = EXP_N_WEIGHTS; k < LLAMA_MOE_CACHE_N_TENSORS; k++) {
        const ggml_tensor * b = l.g.host[k];
        if (b == nullptr) {
            continue;
        }
        if (b->buffer == nullptr || !ggml_backend_buffer_is_host(b->buffer)) {
            return "on the host while their biases are on a device (move the biases with them, e.g. -ot "
                    "'ffn_.*_exps=CPU', not only the .weight tensors)";
        }
        if (b->extra != nullptr || !ggml_is_contiguous(b) || b->ne[1] != l.g.host[LLAMA_MOE_CACHE_DOWN]->ne[2]) {
            return "beside biases in a layout the banks do not copy (repacked, not contiguous, or another expert count)";
        }
    }
    l.dev = model.dev_layer(il);
    if (l.dev == nullptr || ggml_backend_dev_type(l.dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
        return "computed on the CPU (no GPU holds the layer)";
    }
    // the matmuls reading the banks are ordered after the plan by graph order alone (the slot map is written by the
    // host, not by a node): a device that reorders nodes could run them before it (ggml-dev-caps.h: CUDA keeps the
    // order unless GGML_CUDA_GRAPH_OPT=1; Vulkan, Metal, RPC and the meta device of -sm tensor do not say they do)
    if (!ggml_backend_dev_keeps_node_order(l.dev)) {
        return "on a device that may reorder graph nodes (its backend does not report keeping node order; CUDA does "
                "unless GGML_CUDA_GRAPH_OPT=1)";
    }
    return nullptr;
}

// LLAMA_MOE_CACHE_PROBE=1: at most n_expert - 1 slots a layer (no layer whole, so every decode step of every layer
// looks up), the budget's other slots left unused; never below min_slots (a token's experts), which a layer of
// n_used == n_expert keeps whole
static void probe_slots_below(llama_moe_cache_sizing & sz, const std::vector<llama_moe_cache_layer_desc> & dd,
        int32_t min_slots) {
    sz.bytes_used = 0;
    for (size_t j = 0; j < dd.size(); j++) {
        if (sz.n_slots[j] > 0) {
            sz.n_slots[j] = std::max({ 1, min_slots, std::min(sz.n_slots[j], dd[j].n_expert - 1) });
            sz.bytes[j]   = dd[j].overhead_bytes + (size_t) sz.n_slots[j] * dd[j].expert_bytes;
        }
        sz.bytes_used += sz.bytes[j];
    }
}

static size_t layer_expert_bytes(const rt_layer & l) {
    size_t n = 0;
    for (int k = 0; k < LLAMA_MOE_CACHE_N_TENSORS; k++) {
        n += l.g.host[k] ? l.g.host[k]->nb[expert_dim(k)] : 0;
    }
    return n;
}

static int32_t layer_n_tensors(const rt_layer & l) {
    int32_t n = 0;
    for (const ggml_tensor * t : l.g.host) {
        n += t != nullptr;
    }
    return n;
}

// the slot and cold maps and the device lookup's state of one layer: what a cached layer takes besides its slots
static size_t layer_overhead_bytes(const rt_layer & l) {
    return 2 * (size_t) l.n_expert * sizeof(int32_t) +
           (size_t) ggml_moe_cache_tensor_size(l.n_expert, l.n_expert, lookup_max_ids(l.n_expert, l.n_used)) * sizeof(int32_t);
}

llama_moe_cache_need llama_moe_cache_need_of(const llama_model & model, ggml_backend_dev_t dev) {
    const llama_hparams & hp = model.hparams;
    const int32_t min_slots = std::max<int32_t>((int32_t) hp.n_expert_used_max(), 1);
    llama_moe_cache_need need = {};
    need.n_expert = (int32_t) hp.n_expert;
    for (int32_t il = 0; il < (int32_t) hp.n_layer(); il++) {
        rt_layer l;
        l.il       = il;
        l.n_used   = (int32_t) hp.n_expert_used(il);
        l.n_expert = (int32_t) hp.n_expert;
        if (layer_unfit(model, il, l) != nullptr || l.dev != dev) {
            continue;
        }
        const size_t overhead = layer_overhead_bytes(l);
        const size_t eb       = layer_expert_bytes(l);
        need.n_layers++;
        need.n_expert_used = std::max(need.n_expert_used, l.n_used);
        need.min_bytes    += overhead + (size_t) std::min(min_slots, l.n_expert) * eb;
        need.full_bytes   += overhead + (size_t) l.n_expert * eb;
        for (int k = 0; k < EXP_N_WEIGHTS; k++) {
            if (l.g.host[k] != nullptr) {
                need.largest_tensor = std::max(need.largest_tensor, ggml_nbytes(l.g.host[k]));
            }
        }
    }
    return need;
}

// the banks of the layers of one device in one buffer; false (nothing allocated) if it does not fit
static bool alloc_device(llama_moe_cache_rt & rt, std::vector<rt_layer *> & layers, const std::vector<int32_t> & n_slots) {
    // per layer its banks, slot and cold maps and state; the status words
    ggml_init_params ip = { ggml_tensor_overhead() * ((LLAMA_MOE_CACHE_N_TENSORS + 3) * layers.size() + 1) + 1024, nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    if (ctx == nullptr) {
        return false;
    }
    for (size_t i = 0; i < layers.size(); i++) {
        rt_layer & l = *layers[i];
        for (int k = 0; k < LLAMA_MOE_CACHE_N_TENSORS; k++) {
            l.g.bank[k] = nullptr;
            if (l.g.host[k] != nullptr && n_slots[i] > 0) {
                const ggml_tensor * h = l.g.host[k];
                l.g.bank[k] = expert_dim(k) == 2 ? ggml_new_tensor_3d(ctx, h->type, h->ne[0], h->ne[1], n_slots[i])
                                                 : ggml_new_tensor_2d(ctx, h->type, h->ne[0], n_slots[i]);
                if (n_slots[i] == l.n_expert) {
                    // a slot per expert: read in place once whole, as the host tensor (an eval callback such as
                    // llama-imatrix's sees the name it knows, and slot e is expert e)
                    ggml_set_name(l.g.bank[k], h->name);
                } else {
                    ggml_format_name(l.g.bank[k], "moe_cache_%s-%d", EXP_NAMES[k], l.il);
                }
            }
        }
        if (n_slots[i] > 0) {
            l.g.slot_map = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1, l.n_expert);
            ggml_format_name(l.g.slot_map, "moe_cache_slot_map-%d", l.il);
            l.g.cold_map = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1, l.n_expert);
            ggml_format_name(l.g.cold_map, "moe_cache_cold_map-%d", l.il);
            // the slot state, then what a lookup leaves: the fills, the slot and cold ids of a decode graph (one whose
            // routed ids fit the slots, or a hot/cold one)
            l.state = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, ggml_moe_cache_tensor_size(l.n_expert, n_slots[i],
                    lookup_max_ids(n_slots[i], l.n_used)));
            ggml_format_name(l.state, "moe_cache_state-%d", l.il);
        }
        l.n_slots = n_slots[i];
    }
    rt_status status;
    for (size_t i = 0; i < layers.size(); i++) {
        if (n_slots[i] > 0) {
            layers[i]->status_dev   = (int32_t) rt.statuses.size();
            layers[i]->status_index = (int32_t) status.layer_of.size();
            status.layer_of.push_back(layers[i]->il);
        }
    }
    if (!status.layer_of.empty()) {
        status.words = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, (int64_t) status.layer_of.size());
        ggml_format_name(status.words, "moe_cache_status-%s", ggml_backend_dev_name(layers[0]->dev));
    }
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_dev_buffer_type(layers[0]->dev));
    if (buf == nullptr) {
        ggml_free(ctx);
        for (rt_layer * l : layers) {
            std::fill(std::begin(l->g.bank), std::end(l->g.bank), nullptr);
            l->g.slot_map = nullptr;
            l->g.cold_map = nullptr;
            l->state      = nullptr;
            l->n_slots = 0;
            l->status_dev   = -1;
            l->status_index = -1;
        }
        return false;
    }
    if (status.words != nullptr) {
        status.backend = layers[0]->backend;
        ggml_backend_buffer_type_t host_buft = ggml_backend_dev_host_buffer_type(layers[0]->dev);
        status.host_buf = host_buft ? ggml_backend_buft_alloc_buffer(host_buft, ggml_nbytes(status.words)) : nullptr;
        if (status.host_buf == nullptr) {
            status.host_fallback.assign(status.layer_of.size(), 0); // pageable: the read back then waits for the copy
        }
        status.host = status.host_buf ? (int32_t *) ggml_backend_buffer_get_base(status.host_buf) : status.host_fallback.data();
        rt.statuses.push_back(std::move(status));
    }
    // weights to the scheduler: a matmul reading a bank is assigned to its device, as one reading a device weight
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_backend_buffer_clear(buf, 0); // slots in range before the first plan
    rt.ctxs.push_back(ctx);
    rt.bufs.push_back(buf);
    return true;
}

// LLAMA_MOE_CACHE_FILL_WHOLE=0: a layer with a slot per expert fills as its experts are routed, as a smaller cache
// does, instead of whole when the cache is made (for the cold path's measurements and tests); read once
static bool fill_whole_on() {
    static const bool on = llama_moe_env_whole("LLAMA_MOE_CACHE_FILL_WHOLE", 0, 1) != 0;
    return on;
}

static void fill_whole_layers(llama_moe_cache_rt & rt);
static void load_profile(llama_moe_cache_rt & rt, const llama_model & model);
static void planner_takes(rt_layer & l);
static void settle_prompt_admits(llama_moe_cache_rt & rt, rt_layer & l);
static bool layer_in_place(const llama_moe_cache_rt & rt, const rt_layer & l);
static bool staged_whole(const rt_layer & l, int k);
static void issue_seed(llama_moe_cache_rt & rt, rt_layer & l, int k);
static void note_banks_on_queue(llama_moe_cache_rt & rt, bool wrote);

static void choose_device_lookup(llama_moe_cache_rt & rt);

// the largest graph (tokens) whose step of layer l reads its banks: every size for a layer read in place (op offload
// on), else up to decode_max tokens whose experts always fit the slots; larger graphs take the staging path up to
// decode_max tokens and the host path above (llama_moe_cache_graph_layer_for)
static int64_t banks_up_to(const llama_moe_cache_rt & rt, const rt_layer & l) {
    if (layer_in_place(rt, l)) {
        return INT64_MAX;
    }
    return std::min<int64_t>(std::min(rt.decode_max, l.vec_max), l.n_slots / std::max(1, l.n_used));
}

// the layer's limit from its device's rule for the type of each of its weights (the smallest), at most decode_max
static void set_vec_max(rt_layer & l, int32_t decode_max) {
    const auto vec_max_of = (ggml_backend_dev_mul_mat_id_vec_max_batch_t) ggml_backend_reg_get_proc_address(
            ggml_backend_dev_backend_reg(l.dev), GGML_BACKEND_DEV_MUL_MAT_ID_VEC_MAX_BATCH_PROC);
    l.vec_max = decode_max;
    for (int k = 0; k < EXP_N_WEIGHTS && vec_max_of != nullptr; k++) {
        if (l.g.host[k] != nullptr) {
            const int32_t n = std::max(1, vec_max_of(l.dev, l.g.host[k]->type));
            if (n < l.vec_max) {
                l.vec_max  = n;
                l.vec_type = l.g.host[k]->type;
            }
        }
    }
}

// said once when the cache is made: the layers whose device's mul_mat_id changes kernels below decode_max tokens
// (grouped by device, type and limit: the layers of a model share them)
static void explain_vec_limits(const llama_moe_cache_rt & rt) {
    std::vector<bool> said(rt.layers.size(), false);
    for (size_t i = 0; i < rt.layers.size(); i++) {
        const rt_layer & l = rt.layers[i];
        if (said[i] || l.vec_type == GGML_TYPE_COUNT || layer_in_place(rt, l)) {
            continue;
        }
        int32_t n = 0;
        for (size_t j = i; j < rt.layers.size(); j++) {
            const rt_layer & o = rt.layers[j];
            if (!said[j] && o.dev == l.dev && o.vec_type == l.vec_type && o.vec_max == l.vec_max && !layer_in_place(rt, o)) {
                said[j] = true;
                n++;
            }
        }
        LLAMA_LOG_INFO("llama_moe: expert cache: %d cached layer%s (%s weights on %s) read%s the banks in graphs of up to %d "
                "token%s, not %d: above that the device's mul_mat_id for %s takes kernels whose bytes depend on the number "
                "of experts in the weight, so larger decode graphs take the staging path there (docs/cache-paths.md)\n",
                n, n == 1 ? "" : "s", ggml_type_name(l.vec_type), ggml_backend_dev_name(l.dev), n == 1 ? "s" : "",
                l.vec_max, l.vec_max == 1 ? "" : "s", rt.decode_max, ggml_type_name(l.vec_type));
    }
}

// said once when the cache is made: which graph sizes leave the banks in which layers, and what this context's widest
// decode step (a token of each of its n_seq_max sequences) does (docs/cache-paths.md)
static void explain_batches(const llama_moe_cache_rt & rt, uint32_t n_seq_max, uint32_t n_ubatch) {
    // the scheduler offloads an op from this batch on (ggml-cuda and SIM read the same variable, 32 unset)
    const int64_t offload_env = llama_moe_env_whole("GGML_OP_OFFLOAD_MIN_BATCH", 1, INT32_MAX);
    const int64_t offload_min = offload_env > 0 ? offload_env : 32;
    int64_t all_up_to = INT64_MAX, some_up_to = 0;
    int32_t n_whole = 0;
    for (const rt_layer & l : rt.layers) {
        const int64_t up_to = banks_up_to(rt, l);
        all_up_to = std::min(all_up_to, up_to);
        if (up_to == INT64_MAX) {
            n_whole++;
        } else {
            some_up_to = std::max(some_up_to, up_to);
        }
    }
    const int32_t n_layers = (int32_t) rt.layers.size();
    if (all_up_to == INT64_MAX) {
        LLAMA_LOG_INFO("llama_moe: expert cache: every cached layer holds all its experts: graphs of any size read the "
                "banks (docs/cache-paths.md)\n");
        return;
    }
    char some[64] = "";
    if (some_up_to > all_up_to) {
        snprintf(some, sizeof(some), ", up to %" PRId64 " those of some", some_up_to);
    }
    LLAMA_LOG_INFO("llama_moe: expert cache: graphs of up to %" PRId64 " token%s read the banks of every cached layer%s; "
            "larger ones leave them in the %d layer%s not read in place (fewer slots than tokens x top-k, or more tokens "
            "than the device's mul_mat_id limit: the staging path up to %d tokens, the host path above), which compute "
            "their experts on the CPU below %" PRId64 " tokens (GGML_OP_OFFLOAD_MIN_BATCH) and upload them from there "
            "(docs/cache-paths.md)\n",
            all_up_to, all_up_to == 1 ? "" : "s", some, n_layers - n_whole, n_layers - n_whole == 1 ? "" : "s",
            rt.decode_max, offload_min);
    const int64_t widest = std::min<int64_t>(n_seq_max, n_ubatch);
    if (widest > all_up_to) {
        int32_t n_leave = 0;
        for (const rt_layer & l : rt.layers) {
            // a hot/cold layer keeps such a step's resident experts on the GPU (its own line says so)
            n_leave += widest > banks_up_to(rt, l) && !(l.hot_cold && widest <= hot_cold_max_tokens());
        }
        if (n_leave > 0) {
            LLAMA_LOG_WARN("llama_moe: expert cache: this context decodes up to %u sequences at once (n_seq_max): a step "
                    "of %" PRId64 " tokens leaves the banks in %d of %d cached layers and computes their experts on the %s\n",
                    n_seq_max, widest, n_leave, n_layers, widest < offload_min ? "CPU" : "GPU from uploads of every expert");
        }
    }
}

// said once when the cache is made beside layers it caches: the host layers it leaves out, per reason (their first
// few indices)
static void explain_left_out(const std::vector<std::pair<int32_t, const char *>> & left_out) {
    std::vector<bool> said(left_out.size(), false);
    for (size_t i = 0; i < left_out.size(); i++) {
        if (said[i]) {
            continue;
        }
        int32_t n = 0;
        char ids[96] = "";
        size_t len = 0;
        for (size_t j = i; j < left_out.size(); j++) {
            if (!said[j] && strcmp(left_out[j].second, left_out[i].second) == 0) {
                said[j] = true;
                if (n++ < 8 && len < sizeof(ids)) {
                    len += snprintf(ids + len, sizeof(ids) - len, "%s%d", len ? ", " : "", left_out[j].first);
                }
            }
        }
        LLAMA_LOG_WARN("llama_moe: expert cache: %d MoE layer%s not cached (%s%s): %s experts are %s\n", n,
                n == 1 ? "" : "s", ids, n > 8 ? ", ..." : "", n == 1 ? "its" : "their", left_out[i].second);
    }
}

llama_moe_cache_rt * llama_moe_cache_ctx_init(const llama_model & model, const std::vector<ggml_backend_t> & backends,
        int64_t budget_mib, uint32_t n_seq_max, uint32_t n_ubatch) {
    budget_mib = std::min<int64_t>(budget_mib, (int64_t) 1 << 30); // 1 PiB: no overflow in bytes
    if (budget_mib <= 0) {
        return nullptr;
    }
    const llama_hparams & hp = model.hparams;
    auto rt = std::make_unique<llama_moe_cache_rt>();
    rt->budget_mib = budget_mib;
    rt->decode_max = decode_max_tokens();
    rt->index.assign(hp.n_layer(), -1);

    // the candidate layers, grouped by device
    std::vector<rt_layer> cand;
    std::string why_none;
    std::vector<std::pair<int32_t, const char *>> left_out; // host layers not cached, and why (said once below)
    for (int32_t il = 0; il < (int32_t) hp.n_layer(); il++) {
        rt_layer l;
        l.il     = il;
        l.n_used = (int32_t) hp.n_expert_used(il);
        l.n_expert = (int32_t) hp.n_expert;
        const char * why = layer_unfit(model, il, l);
        if (why == nullptr) {
            if (copy_batch_on()) {
                l.copy_regions = (ggml_backend_copy_regions_async_t) ggml_backend_reg_get_proc_address(
                        ggml_backend_dev_backend_reg(l.dev), GGML_BACKEND_COPY_REGIONS_PROC);
            }
            set_vec_max(l, rt->decode_max);
            cand.push_back(l);
        } else if (strcmp(why, "dense") != 0 && strcmp(why, "on a device") != 0) {
            if (why_none.empty()) {
                why_none = std::string("layer ") + std::to_string(il) + "'s experts are " + why;
            }
            left_out.push_back({ il, why });
        }
    }
    if (cand.empty()) {
        // a warning: the user asked for a cache, and tools such as llama-server print no info lines by default
        LLAMA_LOG_WARN("llama_moe: expert cache of %" PRId64 " MiB not made: %s\n", budget_mib,
                why_none.empty() ? "no MoE layer has its experts on the host (all are on a device already)" : why_none.c_str());
        return nullptr;
    }
    explain_left_out(left_out);

    std::vector<ggml_backend_dev_t> devs;
    for (const rt_layer & l : cand) {
        if (std::find(devs.begin(), devs.end(), l.dev) == devs.end()) {
            devs.push_back(l.dev);
        }
    }
    rt->layers = cand;
    rt->probe  = llama_moe_cache_context_probe();
    rt->max_fills = llama_moe_cache_context_max_fills();
    std::vector<llama_moe_cache_layer_desc> descs(rt->layers.size());
    std::vector<int32_t> n_slots_all(rt->layers.size(), 0);
    for (ggml_backend_dev_t dev : devs) {
        std::vector<size_t> idx;
        std::vector<llama_moe_cache_layer_desc> dd;
        for (size_t i = 0; i < rt->layers.size(); i++) {
            rt_layer & l = rt->layers[i];
            if (l.dev != dev) {
                continue;
            }
            l.backend = nullptr;
            for (ggml_backend_t be : backends) {
                if (ggml_backend_get_device(be) == dev) {
                    l.backend = be;
                }
            }
            GGML_ASSERT(l.backend != nullptr && "the device of a layer has a backend in the context");
            const size_t overhead = layer_overhead_bytes(l);
            descs[i] = { l.il, (int32_t) l.g.host[LLAMA_MOE_CACHE_DOWN]->ne[2], layer_expert_bytes(l), overhead, layer_n_tensors(l) };
            idx.push_back(i);
            dd.push_back(descs[i]);
        }
        size_t budget = (size_t) budget_mib * 1024 * 1024;
        // --fit's share of this device for the cache (fit-moe-cache.h): the memory it measured to be left to it
        bool cap_first = false;
        const int64_t cap_mib = llama_moe_cache_take_device_cap_mib(ggml_backend_dev_name(dev), &cap_first);
        if (cap_mib == 0) {
            LLAMA_LOG_INFO("llama_moe: no expert cache on %s: --fit left it no room\n", ggml_backend_dev_name(dev));
            continue;
        }
        if (cap_mib > 0 && (size_t) cap_mib * 1024 * 1024 < budget) {
            LLAMA_LOG_INFO("llama_moe: expert cache on %s: %" PRId64 " MiB of the %" PRId64 " MiB asked, the room --fit left it\n",
                    ggml_backend_dev_name(dev), cap_mib, budget_mib);
            budget = (size_t) cap_mib * 1024 * 1024;
        }
        size_t free_mem = 0, total_mem = 0;
        ggml_backend_dev_memory(dev, &free_mem, &total_mem);
        // the first cache under a cap from --fit takes the room measured for it, with the compute buffers, the staging
        // and the target left out already; a later cache on the device (another context) keeps the margin as well
        const size_t margin = cap_mib > 0 && cap_first ? 0 : CACHE_FREE_MARGIN;
        if (free_mem > 0 && budget + margin > free_mem) {
            const size_t cap = free_mem > margin ? free_mem - margin : 0;
            LLAMA_LOG_WARN("llama_moe: expert cache on %s shrunk from %.0f MiB to %.2f MiB: %.2f MiB free, less a %.0f MiB margin\n",
                    ggml_backend_dev_name(dev), mib(budget), mib(cap), mib(free_mem), mib(margin));
            budget = cap;
        }
        // a bank that does not fit after all (the free memory is a hint) halves the budget, down to nothing
        for (;;) {
            llama_moe_cache_sizing sz = llama_moe_cache_size_banks(budget, dd, (int32_t) hp.n_expert_used_max());
            if (sz.n_layers == 0) {
                LLAMA_LOG_WARN("llama_moe: no expert cache on %s: %s\n", ggml_backend_dev_name(dev), sz.reason.c_str());
                break;
            }
            if (rt->probe == LLAMA_MOE_CACHE_PROBE_SLOTS_BELOW) {
                probe_slots_below(sz, dd, (int32_t) hp.n_expert_used_max());
            }
            std::vector<rt_layer *> ls;
            for (size_t k : idx) {
                ls.push_back(&rt->layers[k]);
            }
            if (alloc_device(*rt, ls, sz.n_slots)) {
                for (size_t j = 0; j < idx.size(); j++) {
                    n_slots_all[idx[j]] = sz.n_slots[j];
                }
                int32_t smin = INT32_MAX, smax = 0;
                for (int32_t s : sz.n_slots) {
                    smin = std::min(smin, s);
                    smax = std::max(smax, s);
                }
                int32_t n_whole = 0;
                for (size_t j = 0; j < dd.size(); j++) {
                    n_whole += sz.n_slots[j] == dd[j].n_expert;
                }
                // which graphs read the banks: through the plan up to decode_max tokens; layers with a slot per
                // expert at every size once all their experts are resident (llama-moe-cache-rt.h, "In place")
                char whole[128] = "";
                if (n_whole > 0) {
                    snprintf(whole, sizeof(whole), "; %d layer%s with a slot per expert, read in place %s", n_whole,
                            n_whole > 1 ? "s" : "", fill_whole_on() ? "(filled whole now)" : "once resident (LLAMA_MOE_CACHE_FILL_WHOLE=0)");
                }
                for (size_t j = 0; j < dd.size() && rt->probe == LLAMA_MOE_CACHE_PROBE_SLOTS_BELOW; j++) {
                    LLAMA_LOG_INFO("llama_moe: expert cache probe 1 (LLAMA_MOE_CACHE_PROBE): layer %d keeps %d of %d expert "
                            "slots\n", dd[j].il, sz.n_slots[j], dd[j].n_expert);
                }
                if (rt->probe == LLAMA_MOE_CACHE_PROBE_LOOKUP_ALL && n_whole > 0) {
                    LLAMA_LOG_INFO("llama_moe: expert cache probe 2 (LLAMA_MOE_CACHE_PROBE): on %s the %d layer%s with a slot "
                            "per expert %s looked up at every decode step, never read in place\n", ggml_backend_dev_name(dev),
                            n_whole, n_whole > 1 ? "s" : "", n_whole > 1 ? "are" : "is");
                }
                LLAMA_LOG_INFO("llama_moe: expert cache on %s: %.2f MiB, %d MoE layers with their experts on the host, "
                        "%d-%d of %d expert slots each; graphs of up to %d tokens read them (LLAMA_MOE_CACHE_DECODE_MAX)%s\n",
                        ggml_backend_dev_name(dev), mib(sz.bytes_used), sz.n_layers, smin, smax, dd[0].n_expert, rt->decode_max,
                        whole);
                break;
            }
            LLAMA_LOG_WARN("llama_moe: expert cache of %.2f MiB does not fit on %s: trying half\n", mib(budget),
                    ggml_backend_dev_name(dev));
            budget /= 2;
        }
    }

    // keep the layers that got slots
    std::vector<rt_layer> kept;
    std::vector<llama_moe_cache_layer_desc> kept_descs;
    llama_moe_cache_sizing kept_sizing;
    for (size_t i = 0; i < rt->layers.size(); i++) {
        if (n_slots_all[i] > 0) {
            kept.push_back(rt->layers[i]);
            kept_descs.push_back(descs[i]);
            kept_sizing.n_slots.push_back(n_slots_all[i]);
            kept_sizing.bytes.push_back(0);
        }
    }
    if (kept.empty()) {
        return nullptr;
    }
    kept_sizing.n_layers = (int32_t) kept.size();
    rt->layers = std::move(kept);
    for (size_t i = 0; i < rt->layers.size(); i++) {
        rt_layer & l = rt->layers[i];
        rt->index[l.il] = (int32_t) i;
        for (int k = 0; k < LLAMA_MOE_CACHE_N_TENSORS; k++) {
            if (l.g.bank[k] != nullptr) {
                rt->host_tensor[l.g.host[k]] = { (int32_t) i, k };
            }
        }
        l.read_slot.assign(l.n_expert, -1);
        l.admit_slot.assign(l.n_expert, -1);
    }
    rt->plan = std::make_unique<llama_moe_cache>(kept_descs, kept_sizing);
    rt->plan->debug_skip_fill = llama_moe_cache_debug_skip_fill();
    rt->seed_on    = llama_moe_cache_context_seed();
    rt->check_seed = rt->seed_on && llama_moe_cache_debug_check_seed();
    if (!rt->seed_on) {
        LLAMA_LOG_INFO("llama_moe: expert cache: a prompt's end does not seed it (LLAMA_MOE_CACHE_SEED=0)\n");
    }
    choose_device_lookup(*rt);
    fill_whole_layers(*rt);
    load_profile(*rt, model);
    explain_vec_limits(*rt);
    explain_batches(*rt, n_seq_max, n_ubatch);
    return rt.release();
}

// the end of the run of fills (sorted by slot) that starts at i: consecutive experts into consecutive slots, one copy
static size_t run_end(const std::vector<llama_moe_cache_fill> & fills, size_t i) {
    size_t j = i + 1;
    while (j < fills.size() && fills[j].slot == fills[j - 1].slot + 1 && fills[j].expert == fills[j - 1].expert + 1) {
        j++;
    }
    return j;
}

// uploads fills (sorted by slot) from the host tensors into layer l's banks, one copy per run of consecutive experts
// into consecutive slots and per tensor: on queue, or synchronously where queue is null; returns the bytes
static size_t upload_fills(const rt_layer & l, const std::vector<llama_moe_cache_fill> & fills, ggml_backend_t queue) {
    size_t bytes = 0;
    for (size_t i = 0; i < fills.size();) {
        const size_t j = run_end(fills, i);
        for (int k = 0; k < LLAMA_MOE_CACHE_N_TENSORS; k++) {
            if (l.g.bank[k] == nullptr) {
                continue;
            }
            const size_t nb = l.g.host[k]->nb[expert_dim(k)];
            const char * src = (const char *) l.g.host[k]->data + (size_t) fills[i].expert * nb;
            if (queue != nullptr) {
                ggml_backend_tensor_set_async(queue, l.g.bank[k], src, (size_t) fills[i].slot * nb, (j - i) * nb);
            } else {
                ggml_backend_tensor_set(l.g.bank[k], src, (size_t) fills[i].slot * nb, (j - i) * nb);
            }
            bytes += (j - i) * nb;
        }
        i = j;
    }
    return bytes;
}

// Makes the layers with a slot per expert whole before a graph reads them. Such a layer never evicts, so each expert
// its tokens route is uploaded once anyway; filled as routed, a rarely routed expert keeps the layer from being read
// in place for thousands of tokens, and every decode step of it pays the lookup and its fills meanwhile (measured
// on the H200, every expert cached: 0.65 of the all-on-GPU rate over the first 512 tokens, 0.78 in the last
// 128 of them). One upload per run of missing experts and tensor, on the calling thread, when the cache is made
// (nothing computes on its banks yet); a stop that empties the cache keeps these layers (llama_moe_cache_settle).
static void fill_whole_layers(llama_moe_cache_rt & rt) {
    if (!fill_whole_on()) {
        return;
    }
    const int64_t t_start = ggml_time_us();
    size_t  bytes    = 0;
    int32_t n_layers = 0;
    std::vector<llama_moe_cache_fill> fills;
    for (rt_layer & l : rt.layers) {
        if (l.n_slots != l.n_expert || !rt.plan->fill_whole(l.il, fills) || fills.empty()) {
            continue;
        }
        planner_takes(l);
        bytes += upload_fills(l, fills, nullptr); // in expert order, slot e for expert e: sorted by slot
        n_layers++;
    }
    if (n_layers > 0) {
        const double s = (ggml_time_us() - t_start) / 1e6;
        LLAMA_LOG_INFO("llama_moe: expert cache: %d layer%s with a slot per expert filled whole, %.2f MiB in %.2f s (%.1f GB/s); "
                "LLAMA_MOE_CACHE_FILL_WHOLE=0 fills them as decode routes to them\n", n_layers, n_layers > 1 ? "s" : "",
                mib(bytes), s, s > 0 ? bytes / s / 1e9 : 0.0);
    }
}

// The expert cache profile (llama-moe-cache-rt.h, "Profiles"): each cached layer that is not whole yet takes the
// experts of the highest decode counts (ties: prompt counts, then lower id; never an expert counted 0) into its free
// slots, uploaded once per run of consecutive experts and tensor on the calling thread, as fill_whole_layers does,
// when the cache is made (nothing computes on its banks yet). A refused file: one error line, nothing filled, and
// the file is not written when the cache is freed.
static void load_profile(llama_moe_cache_rt & rt, const llama_model & model) {
    rt.profile_path = llama_moe_cache_context_profile();
    if (rt.profile_path.empty()) {
        return;
    }
    // a relative path names a place once, here: the file written when the cache is freed goes where it was read
    // from, whatever the working directory is by then
    std::error_code ec;
    const std::filesystem::path absolute = std::filesystem::absolute(rt.profile_path, ec);
    if (!ec) {
        rt.profile_path = absolute.lexically_normal().string();
    }
    const int64_t t_start = ggml_time_us();
    rt.profile_id = llama_moe_cache_profile_id_of(model);
    llama_moe_cache_profile p;
    std::string why, fix;
    const llama_moe_cache_profile_status status = llama_moe_cache_profile_read(rt.profile_path, rt.profile_id, p, why, fix);
    if (status == LLAMA_MOE_CACHE_PROFILE_REFUSED) {
        rt.profile_refused = true;
        LLAMA_LOG_ERROR("llama_moe: expert cache profile %s refused: it %s; %s. The cache starts without it, and the file "
                "is left as it is\n", rt.profile_path.c_str(), why.c_str(), fix.c_str());
        return;
    }
    if (status == LLAMA_MOE_CACHE_PROFILE_MISSING) {
        LLAMA_LOG_INFO("llama_moe: expert cache profile %s: not there yet, written when the context is freed\n",
                rt.profile_path.c_str());
        return;
    }
    const uint32_t n_expert = p.id.n_expert;
    size_t  bytes = 0;
    int32_t n_layers = 0, n_experts = 0;
    std::vector<int32_t> ranked;
    std::vector<llama_moe_cache_fill> fills;
    for (rt_layer & l : rt.layers) {
        if ((uint32_t) l.n_expert != n_expert || rt.plan->whole(l.il)) {
            continue;
        }
        const int32_t * dec = p.decode.data() + (size_t) l.il * n_expert;
        const int32_t * pro = p.prompt.data() + (size_t) l.il * n_expert;
        ranked.clear();
        for (int32_t e = 0; e < l.n_expert; e++) {
            if (dec[e] > 0 || pro[e] > 0) {
                ranked.push_back(e);
            }
        }
        std::sort(ranked.begin(), ranked.end(), [&](int32_t a, int32_t b) {
            return dec[a] != dec[b] ? dec[a] > dec[b] : pro[a] != pro[b] ? pro[a] > pro[b] : a < b;
        });
        planner_takes(l);
        const int32_t n = rt.plan->preload(l.il, ranked, fills);
        if (n == 0) {
            continue;
        }
        bytes += upload_fills(l, fills, nullptr); // sorted by slot
        n_layers++;
        n_experts += n;
    }
    const double s = (ggml_time_us() - t_start) / 1e6;
    LLAMA_LOG_INFO("llama_moe: expert cache profile %s: %d layer%s filled, %d experts (%.2f MiB) in %.2f s (the counts of %u "
            "run%s)\n", rt.profile_path.c_str(), n_layers, n_layers == 1 ? "" : "s", n_experts, mib(bytes), s, p.n_runs,
            p.n_runs == 1 ? "" : "s");
}

// When the cache is freed (its counts final: the device's read back), the file's counts plus this context's, written
// back atomically; the file is read again first, so that contexts that were freed since this one was made keep theirs.
// Nothing is written where this context counted nothing (a context that decoded nothing), or where the file was
// refused, or is now. One lock over the read and the write, for the contexts of one process and, on the file's
// directory, for the processes that share the file.
static void write_profile_locked(llama_moe_cache_rt & rt, uint64_t n_decode, uint64_t n_prompt);

// LLAMA_MOE_CACHE_DEBUG_PROFILE_WRITE_DELAY_MS=N (read once): wait N ms between reading the profile and writing it
// back, inside the lock: a window in which another process's write would be lost without the lock (tests only)
static int64_t debug_profile_write_delay_ms() {
    static const int64_t ms = std::max<int64_t>(0, llama_moe_env_whole("LLAMA_MOE_CACHE_DEBUG_PROFILE_WRITE_DELAY_MS", 0, 600000));
    return ms;
}

static void write_profile(llama_moe_cache_rt & rt) {
    if (rt.profile_path.empty() || rt.profile_refused) {
        return;
    }
    uint64_t n_decode = 0, n_prompt = 0;
    for (const llama_moe_cache_layer & pl : rt.plan->layers) {
        for (int32_t e = 0; e < pl.n_expert; e++) {
            n_decode += (uint64_t) pl.uses[e];
            n_prompt += (uint64_t) pl.prompt_uses[e];
        }
    }
    if (n_decode + n_prompt == 0) {
        return;
    }
    try { // from ~llama_context: a failure is said, never the end of the process
        write_profile_locked(rt, n_decode, n_prompt);
    } catch (const std::exception & e) {
        LLAMA_LOG_ERROR("llama_moe: expert cache profile %s not written: %s; the old file is left as it is\n",
                rt.profile_path.c_str(), e.what());
    }
}

static void write_profile_locked(llama_moe_cache_rt & rt, uint64_t n_decode, uint64_t n_prompt) {
    static std::mutex write_mutex;
    std::lock_guard<std::mutex> lock(write_mutex);
    const llama_moe_cache_profile_lock file_lock(rt.profile_path);
    llama_moe_cache_profile p;
    std::string why, fix;
    if (llama_moe_cache_profile_read(rt.profile_path, rt.profile_id, p, why, fix) == LLAMA_MOE_CACHE_PROFILE_REFUSED) {
        LLAMA_LOG_ERROR("llama_moe: expert cache profile %s not written: it %s since the cache was made; %s\n",
                rt.profile_path.c_str(), why.c_str(), fix.c_str());
        return;
    }
    const size_t n_expert = p.id.n_expert;
    for (const llama_moe_cache_layer & pl : rt.plan->layers) {
        if ((size_t) pl.n_expert != n_expert || pl.il < 0 || (uint32_t) pl.il >= p.id.n_layer) {
            continue;
        }
        for (int32_t e = 0; e < pl.n_expert; e++) {
            int32_t & d = p.decode[(size_t) pl.il * n_expert + e];
            int32_t & q = p.prompt[(size_t) pl.il * n_expert + e];
            d = (int32_t) std::min<int64_t>((int64_t) d + pl.uses[e], INT32_MAX);
            q = (int32_t) std::min<int64_t>((int64_t) q + pl.prompt_uses[e], INT32_MAX);
        }
    }
    p.n_runs++;
    if (debug_profile_write_delay_ms() > 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(debug_profile_write_delay_ms()));
    }
    if (!llama_moe_cache_profile_write(rt.profile_path, p, why)) {
        LLAMA_LOG_ERROR("llama_moe: expert cache profile %s not written: %s; the old file is left as it is\n",
                rt.profile_path.c_str(), why.c_str());
        return;
    }
    LLAMA_LOG_INFO("llama_moe: expert cache profile %s written: %" PRIu64 " decode and %" PRIu64 " prompt routings of this "
            "context added (%u runs)\n", rt.profile_path.c_str(), n_decode, n_prompt, p.n_runs);
}

// why decode graphs cannot compute layer l hot/cold (its cold experts on the CPU beside the hot ones on its device),
// or nullptr; asked once the path of its decode lookups is chosen
static const char * hot_cold_unfit(const rt_layer & l) {
    if (hot_cold_max_tokens() < 1) {
        return "GGML_OP_OFFLOAD_MIN_BATCH offloads the host weights' ops of every graph";
    }
    if (!ggml_backend_dev_masked_ids(l.dev)) {
        return "its device does not compute expert ids of -1 (masked ids)";
    }
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (cpu == nullptr || !ggml_backend_dev_masked_ids(cpu)) {
        return "the CPU backend does not compute expert ids of -1 (masked ids)";
    }
    return nullptr;
}

// the miss policy as its flag spells it
static std::string miss_policy_name(int32_t max_fills) {
    return max_fills == GGML_MOE_CACHE_FILL_ALL ? "upload" : max_fills == 0 ? "cpu" : "split:" + std::to_string(max_fills);
}

// said once per device when the cache is made: which layers compute their cold experts on the CPU, and where a policy
// other than upload cannot be followed, why
static void explain_hot_cold(const llama_moe_cache_rt & rt, ggml_backend_dev_t dev) {
    int32_t n_on = 0, n_all = 0;
    const char * why_not = nullptr;
    for (const rt_layer & l : rt.layers) {
        if (l.dev == dev) {
            n_on += l.hot_cold;
            n_all++;
            why_not = why_not ? why_not : hot_cold_unfit(l);
        }
    }
    const std::string policy = miss_policy_name(rt.max_fills);
    if (n_on == n_all) {
        LLAMA_LOG_INFO("llama_moe: expert cache on %s: miss policy %s; decode graphs of up to %d tokens compute the misses "
                "they do not upload, and the experts past the slots, on the CPU beside the banks (hot/cold)\n",
                ggml_backend_dev_name(dev), policy.c_str(), hot_cold_max_tokens());
    } else if (rt.max_fills != GGML_MOE_CACHE_FILL_ALL) {
        LLAMA_LOG_WARN("llama_moe: expert cache on %s: miss policy %s not followed in %d of %d layers, which upload every "
                "miss (and take the staging path where the experts may not fit): %s\n", ggml_backend_dev_name(dev),
                policy.c_str(), n_all - n_on, n_all, why_not);
    } else {
        LLAMA_LOG_INFO("llama_moe: expert cache on %s: %d of %d layers take the staging path where a decode graph's experts "
                "may not fit the slots, not hot/cold: %s\n", ggml_backend_dev_name(dev), n_all - n_on, n_all, why_not);
    }
}

// LLAMA_MOE_CACHE_DEVICE=0: decode plans on the host even where the device could look its slots up; read once
static bool device_lookup_on() {
    static const bool on = llama_moe_env_whole("LLAMA_MOE_CACHE_DEVICE", 0, 1) != 0;
    return on;
}

// why the decode graphs of layer l cannot look its slots up on its device, or nullptr
static const char * layer_device_unfit(rt_layer & l) {
    if (!device_lookup_on()) {
        return "LLAMA_MOE_CACHE_DEVICE=0";
    }
    if (!ggml_backend_dev_reads_host_in_place(l.dev, nullptr, nullptr, 0)) {
        return "its device does not read host memory in place";
    }
    // the bytes the fills read (one mapping may end inside a tensor: a range registered per layer)
    for (int k = 0; k < LLAMA_MOE_CACHE_N_TENSORS; k++) {
        const ggml_tensor * h = l.g.host[k];
        if (l.g.bank[k] != nullptr && !ggml_backend_dev_reads_host_in_place(l.dev, h->buffer, h->data, ggml_nbytes(h))) {
            return "its host experts are not page-locked where the device can read them (--pin-experts, or --load-mode none)";
        }
    }
    // the ops on the layer's own tensors, as the graph will build them (one token)
    ggml_init_params ip = { ggml_tensor_overhead() * (3 + 2 * LLAMA_MOE_CACHE_N_TENSORS), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * ids    = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, l.n_used, 1);
    ggml_tensor * status = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 1); // the shape of a layer's word (not allocated)
    ggml_tensor * lookup = ggml_moe_cache_lookup(ctx, ids, l.state, status, l.n_expert, l.n_slots, GGML_MOE_CACHE_FILL_ALL);
    const char * why = nullptr;
    if (!ggml_backend_dev_supports_op(l.dev, lookup)) {
        why = "its backend lacks the lookup ops (GGML_OP_MOE_CACHE_LOOKUP, GGML_OP_MOE_CACHE_FILL) for this layer";
    }
    for (int k = 0; k < LLAMA_MOE_CACHE_N_TENSORS && why == nullptr; k++) {
        if (l.g.bank[k] != nullptr &&
                !ggml_backend_dev_supports_op(l.dev, ggml_moe_cache_fill(ctx, l.g.bank[k], lookup, const_cast<ggml_tensor *>(l.g.host[k]), l.n_slots))) {
            why = "its backend lacks the lookup ops (GGML_OP_MOE_CACHE_LOOKUP, GGML_OP_MOE_CACHE_FILL) for this layer";
        }
    }
    ggml_free(ctx);
    return why;
}

// the decode lookup of each layer on its device where it can be, logged once per device with the reason where not
static void choose_device_lookup(llama_moe_cache_rt & rt) {
    std::vector<ggml_backend_dev_t> devs;
    for (const rt_layer & l : rt.layers) {
        if (std::find(devs.begin(), devs.end(), l.dev) == devs.end()) {
            devs.push_back(l.dev);
        }
    }
    for (ggml_backend_dev_t dev : devs) {
        int32_t n_on = 0, n_all = 0;
        const char * why_not = nullptr;
        for (rt_layer & l : rt.layers) {
            if (l.dev != dev) {
                continue;
            }
            const char * why = layer_device_unfit(l);
            l.device_lookup = why == nullptr;
            l.hot_cold      = hot_cold_unfit(l) == nullptr;
            n_on += l.device_lookup;
            n_all++;
            why_not = why_not ? why_not : why;
        }
        if (n_on == n_all) {
            LLAMA_LOG_INFO("llama_moe: expert cache on %s: decode looks up its slots and fills its misses on the device\n",
                    ggml_backend_dev_name(dev));
        } else {
            LLAMA_LOG_INFO("llama_moe: expert cache on %s: decode plans %d of %d layers on the host (a synchronization per "
                    "layer): %s\n", ggml_backend_dev_name(dev), n_all - n_on, n_all, why_not);
        }
        explain_hot_cold(rt, dev);
    }
}

// the planner is about to change layer l's slot state: it must hold the newest copy (read back before), and the device's
// is stale from now on
static void planner_takes(rt_layer & l) {
    GGML_ASSERT(l.state_ahead != rt_layer::STATE_DEVICE_AHEAD && "the device's slot state was read back first");
    l.state_ahead = rt_layer::STATE_HOST_AHEAD;
}

// waits for the work queued on the cache's devices: the scheduler's, or each backend of a layer once
static void synchronize_backends(const llama_moe_cache_rt & rt, ggml_backend_sched_t sched) {
    if (sched != nullptr) {
        ggml_backend_sched_synchronize(sched);
        return;
    }
    std::vector<ggml_backend_t> done;
    for (const rt_layer & l : rt.layers) {
        if (std::find(done.begin(), done.end(), l.backend) == done.end()) {
            ggml_backend_synchronize(l.backend);
            done.push_back(l.backend);
        }
    }
}

// the lookups of layer i counted on its device since the last read, into the planner's decode stats; each fill
// uploaded one expert of every tensor
static void add_device_counters(llama_moe_cache_rt & rt, size_t i, const int32_t * counters) {
    rt_layer & l = rt.layers[i];
    uint64_t n[GGML_MOE_CACHE_N_COUNTERS];
    for (int c = 0; c < GGML_MOE_CACHE_N_COUNTERS; c++) {
        const uint64_t now = ggml_moe_cache_counter_get(counters, c);
        n[c] = now - l.device_counted[c];
        l.device_counted[c] = now;
    }
    if (n[GGML_MOE_CACHE_COUNT_REFUSED] > 0 && rt.freeing) {
        LLAMA_LOG_ERROR("llama_moe: %" PRIu64 " device lookups of layer %d changed nothing: those steps read slot 0\n",
                n[GGML_MOE_CACHE_COUNT_REFUSED], l.il);
    } else if (n[GGML_MOE_CACHE_COUNT_REFUSED] > 0) {
        // router ids are in range and the state is the cache's own: a refusal read slot 0 for every expert of that
        // step, as the host-side plan would have asserted
        GGML_ABORT("llama_moe: %" PRIu64 " device lookups of layer %d changed nothing (an id out of range, or an "
                "inconsistent state)", n[GGML_MOE_CACHE_COUNT_REFUSED], l.il);
    }
    llama_moe_cache_stats & st = rt.plan->layers[i].stats[LLAMA_MOE_CACHE_PHASE_DECODE];
    st.n_ubatches     += n[GGML_MOE_CACHE_COUNT_LOOKUPS];
    st.n_hits         += n[GGML_MOE_CACHE_COUNT_HITS];
    st.n_misses       += n[GGML_MOE_CACHE_COUNT_MISSES];
    st.n_fills        += n[GGML_MOE_CACHE_COUNT_MISSES];
    st.n_evictions    += n[GGML_MOE_CACHE_COUNT_EVICTIONS];
    st.n_cold         += n[GGML_MOE_CACHE_COUNT_COLD];
    st.bytes_uploaded += n[GGML_MOE_CACHE_COUNT_MISSES] * layer_expert_bytes(l);
}

// the device's slot state of the layers that looked up on it since their last handover, into the planner (with the
// counters of their lookups); waits for the scheduler's work first, once, where there is any.
// keep_on_device: layers to leave there (empty: none); whole_check: only the layers with a slot per expert that are
// not whole yet as far as the planner knows and whose next check is due (see llama_moe_cache_settle)
static void read_back_states(llama_moe_cache_rt & rt, ggml_backend_sched_t sched, const std::vector<bool> & keep_on_device,
        bool whole_check = false) {
    bool synced = false;
    for (size_t i = 0; i < rt.layers.size(); i++) {
        rt_layer & l = rt.layers[i];
        if (l.state_ahead != rt_layer::STATE_DEVICE_AHEAD || (!keep_on_device.empty() && keep_on_device[i])) {
            continue;
        }
        if (whole_check && (l.n_slots != l.n_expert || rt.plan->whole(l.il) || l.device_steps < l.next_whole_check)) {
            continue;
        }
        if (!synced) {
            synchronize_backends(rt, sched);
            synced = true;
        }
        l.state_host.resize(ggml_moe_cache_state_size(l.n_expert, l.n_slots)); // the slot state, not what a lookup left
        ggml_backend_tensor_get(l.state, l.state_host.data(), 0, l.state_host.size() * sizeof(int32_t));
        std::string why;
        const bool consistent = rt.plan->set_state(l.il, l.state_host.data(), why);
        if (!consistent && rt.freeing) {
            // in a destructor: say so and keep the planner's state (nothing reads the banks any more)
            LLAMA_LOG_ERROR("llama_moe: the expert cache's slot state of layer %d on %s is inconsistent: %s\n", l.il,
                    ggml_backend_dev_name(l.dev), why.c_str());
        } else if (!consistent) {
            GGML_ABORT("llama_moe: the expert cache's slot state of layer %d on %s is inconsistent: %s", l.il,
                    ggml_backend_dev_name(l.dev), why.c_str());
        }
        add_device_counters(rt, i, ggml_moe_cache_state_flat(l.state_host.data(), l.n_expert, l.n_slots).counters);
        l.state_ahead = rt_layer::STATE_SAME;
        l.next_whole_check = l.device_steps + WHOLE_CHECK_STEPS;
    }
}

// the device lookups' counters alone, for the stats: the slot state stays where it is (a caller may ask while a graph
// is queued, or from its eval callback), so nothing is handed over; waits for the devices once, where there is any
static void read_back_counters(llama_moe_cache_rt & rt) {
    std::vector<int32_t> counted;
    bool synced = false;
    for (size_t i = 0; i < rt.layers.size(); i++) {
        rt_layer & l = rt.layers[i];
        if (l.state_ahead != rt_layer::STATE_DEVICE_AHEAD) {
            continue;
        }
        if (!synced) {
            synchronize_backends(rt, nullptr);
            synced = true;
        }
        // the counted tail: the counters, then the use counts (totals: the device counts on from what it was given)
        counted.resize(ggml_moe_cache_state_counted_size(l.n_expert));
        const size_t offset = (size_t) ggml_moe_cache_state_counted_offset(l.n_expert, l.n_slots) * sizeof(int32_t);
        ggml_backend_tensor_get(l.state, counted.data(), offset, counted.size() * sizeof(int32_t));
        add_device_counters(rt, i, counted.data());
        rt.plan->set_uses(l.il, counted.data() + 2 * GGML_MOE_CACHE_N_COUNTERS);
    }
}

// LLAMA_MOE_CACHE_DEBUG_CHECK_SEED: every resident slot of the layers the last graph seeded, once the seed's copies
// are done, against the host expert the planner says it holds, byte for byte (what decode will read); a slot that
// differs is an error in the log (the first few by name). Runs after the seeds that did not complete were taken
// back (settle_prompt_admits), before anything plans those layers again. sched: the context's scheduler, whose copy
// queues ran the seeds (nullptr: the caller synchronized it, or the one that ran them before replacing it)
static void check_seeds(llama_moe_cache_rt & rt, ggml_backend_sched_t sched) {
    if (rt.seeds_to_check.empty()) {
        return;
    }
    if (sched != nullptr) {
        ggml_backend_sched_synchronize(sched);
    }
    uint64_t n_checked = 0, n_differ = 0;
    std::vector<uint8_t> bytes;
    for (size_t i : rt.seeds_to_check) {
        const rt_layer & l = rt.layers[i];
        const llama_moe_cache_layer & pl = *rt.plan->layer(l.il);
        for (int32_t slot = 0; slot < l.n_slots; slot++) {
            const int32_t e = pl.expert_of[slot];
            if (e < 0) {
                continue;
            }
            n_checked++;
            for (int k = 0; k < LLAMA_MOE_CACHE_N_TENSORS; k++) {
                if (l.g.bank[k] == nullptr) {
                    continue;
                }
                const size_t nb = l.g.host[k]->nb[expert_dim(k)];
                bytes.resize(nb);
                ggml_backend_tensor_get(l.g.bank[k], bytes.data(), (size_t) slot * nb, nb);
                if (memcmp(bytes.data(), (const char *) l.g.host[k]->data + (size_t) e * nb, nb) != 0) {
                    if (rt.n_seeds_differ + n_differ < 8) {
                        LLAMA_LOG_ERROR("llama_moe: seed check: layer %d, slot %d holds other bytes than expert %d's %s\n",
                                l.il, slot, e, EXP_NAMES[k]);
                    }
                    n_differ++;
                    break;
                }
            }
        }
    }
    rt.n_seeds_checked += n_checked;
    rt.n_seeds_differ  += n_differ;
    LLAMA_LOG_INFO("llama_moe: seed check: %" PRIu64 " resident experts of %zu seeded layers, %" PRIu64 " differ from the host\n",
            n_checked, rt.seeds_to_check.size(), n_differ);
    rt.seeds_to_check.clear();
}

static void log_summary(const llama_moe_cache_rt & rt) {
    // the hit rate is that of the planned steps: a step read in place plans nothing (every expert resident)
    const llama_moe_cache_stats d = rt.plan->get_stats(-1, LLAMA_MOE_CACHE_PHASE_DECODE);
    // the misses uploaded (n_misses) and those computed on the CPU (n_cold, hot/cold) both missed the banks
    const uint64_t routed = d.n_hits + d.n_misses + d.n_cold;
    char rate[32] = "hit rate n/a";
    if (routed > 0) {
        snprintf(rate, sizeof(rate), "hit rate %.1f%%", 100.0 * d.n_hits / routed);
    }
    // steps looked up on the device fill their misses with kernels, not copies: they are counted apart
    int64_t device_steps = 0;
    for (const rt_layer & l : rt.layers) {
        device_steps += l.device_steps;
    }
    LLAMA_LOG_INFO("llama_moe: expert cache, decode: %" PRIu64 " layer steps, %" PRIu64 " hits, %" PRIu64 " misses (%s), "
            "%" PRIu64 " misses computed on the CPU, %" PRIu64 " on the staging path, %" PRId64 " looked up on the device, "
            "%.2f MiB uploaded in %" PRIu64 " copies, %" PRIu64 " read in place\n",
            d.n_ubatches, d.n_hits, d.n_misses, rate, d.n_cold, d.n_overflow, device_steps, mib(d.bytes_uploaded),
            d.n_copy_calls, d.n_in_place);
    const llama_moe_cache_stats p = rt.plan->get_stats(-1, LLAMA_MOE_CACHE_PHASE_PROMPT);
    if (p.n_ubatches > 0) {
        LLAMA_LOG_INFO("llama_moe: expert cache, prompts: %" PRIu64 " layer steps, %" PRIu64 " experts read from the banks, %" PRIu64 " uploaded "
                "(%.2f MiB), %" PRIu64 " made resident (%" PRIu64 " by seeding), %.2f MiB copied on the device, %" PRIu64 " copies, "
                "%" PRIu64 " read in place\n",
                p.n_ubatches, p.n_hits, p.n_misses, mib(p.bytes_uploaded), p.n_fills, p.n_seeded, mib(p.bytes_copied),
                p.n_copy_calls, p.n_in_place);
    }
    if (rt.check_seed) {
        LLAMA_LOG_INFO("llama_moe: expert cache, seed check: %" PRIu64 " resident experts of seeded layers compared with the host, "
                "%" PRIu64 " differ\n", rt.n_seeds_checked, rt.n_seeds_differ);
    }
}

void llama_moe_cache_ctx_free(llama_moe_cache_rt * rt) {
    if (rt == nullptr) {
        return;
    }
    rt->freeing = true; // a bad state is reported, not fatal, in a destructor
    read_back_states(*rt, nullptr, {}); // the counters of the device lookups since the last handover
    for (rt_layer & l : rt->layers) {
        settle_prompt_admits(*rt, l);
    }
    check_seeds(*rt, nullptr); // llama_context synchronizes its scheduler before it frees or replaces the cache
    log_summary(*rt);
    write_profile(*rt);
    delete rt;
}

// a layer whose prompt admits of the last graph are kept only where every bank of it got all its bytes; the graph's
// copies were all issued once it returned, so this may run at the next graph's build or bind, whichever is first
static void settle_prompt_admits(llama_moe_cache_rt & rt, rt_layer & l) {
    if (l.pending.empty() && l.seed_fills.empty()) {
        return;
    }
    bool whole = true;
    for (int k = 0; k < LLAMA_MOE_CACHE_N_TENSORS; k++) {
        whole = whole && (l.g.bank[k] == nullptr || (staged_whole(l, k) && (l.seed_fills.empty() || l.seed_issued[k])));
    }
    if (!whole) {
        planner_takes(l);
        // the seed first: it may have replaced some of the admits, which are then no longer there to take back
        rt.plan->unadmit(l.il, l.seed_fills, true);
        rt.plan->unadmit(l.il, l.pending);
        if (!l.seed_fills.empty() && !rt.said_seed_undone) {
            LLAMA_LOG_INFO("llama_moe: expert cache: the seed of layer %d was taken back: its graph did not stage all of "
                    "the layer's experts on its device\n", l.il);
            rt.said_seed_undone = true;
        }
    }
    l.pending.clear();
    l.seed_fills.clear();
}

// every expert resident in its own slot, nothing pending: the banks are the host tensors' images. A layer stays so
// for the cache's life (it never evicts, see llama-moe-cache.h), which is what lets graphs that read it in place be
// reused while llama_moe_cache_n_in_place is unchanged
static bool layer_in_place(const llama_moe_cache_rt & rt, const rt_layer & l) {
    return rt.probe != LLAMA_MOE_CACHE_PROBE_LOOKUP_ALL && l.pending.empty() && rt.plan->whole(l.il);
}

void llama_moe_cache_settle(llama_moe_cache_rt * rt, ggml_backend_sched_t sched) {
    if (rt != nullptr && rt->device_graph_stopped && llama_moe_cache_debug_keep_stopped()) {
        rt->device_graph_stopped = false; // the planted fault: the state keeps slots whose fills may not have run
    }
    if (rt != nullptr && rt->device_graph_stopped) {
        // which fills ran is not known: forget every resident, and upload that empty state before the next lookup. A
        // layer filled whole when the cache was made ran no lookup and no fill (read in place): it stays
        LLAMA_LOG_WARN("llama_moe: an eval callback stopped a graph whose expert cache lookups run on the device: the cache "
                "starts empty again%s\n", fill_whole_on() ? " (but for the layers filled whole)" : "");
        synchronize_backends(*rt, nullptr);
        read_back_counters(*rt);
        rt->plan->clear(fill_whole_on());
        for (rt_layer & l : rt->layers) {
            if (layer_in_place(*rt, l)) {
                continue;
            }
            l.pending.clear();
            l.seed_fills.clear();
            l.state_ahead = rt_layer::STATE_HOST_AHEAD;
        }
        rt->device_graph_stopped = false;
    }
    if (rt != nullptr) {
        for (rt_layer & l : rt->layers) {
            settle_prompt_admits(*rt, l);
        }
        check_seeds(*rt, sched);
        // before the next graph is built or reused: a layer the device made whole is read in place from then on
        read_back_states(*rt, nullptr, {}, true);
    }
}

int32_t llama_moe_cache_n_in_place(const llama_moe_cache_rt * rt) {
    int32_t n = 0;
    if (rt != nullptr) {
        for (const rt_layer & l : rt->layers) {
            n += layer_in_place(*rt, l);
        }
    }
    return n;
}

const llama_moe_cache_graph_layer * llama_moe_cache_graph_layer_for(llama_moe_cache_rt * rt, int32_t il, int64_t n_tokens,
        int64_t n_expert, int64_t n_expert_used, const ggml_tensor * gate_exps, const ggml_tensor * up_exps,
        const ggml_tensor * down_exps, const ggml_tensor * gate_up_exps, bool op_offload, bool can_mask, bool * staging,
        bool * in_place, bool * device, bool * hot_cold) {
    *staging  = false;
    *in_place = false;
    *device   = false;
    *hot_cold = false;
    // n_tokens 0: the last layer of a ubatch none of whose tokens is an output (llama.cpp drops the rows nobody reads)
    if (rt == nullptr || il < 0 || il >= (int32_t) rt->index.size() || rt->index[il] < 0 || n_tokens < 1) {
        return nullptr;
    }
    rt_layer & l = rt->layers[rt->index[il]];
    // a call over another expert count, or with other tensors, takes the host path
    if (n_expert != l.n_expert || gate_exps != l.g.host[LLAMA_MOE_CACHE_GATE] || up_exps != l.g.host[LLAMA_MOE_CACHE_UP] ||
            down_exps != l.g.host[LLAMA_MOE_CACHE_DOWN] || gate_up_exps != l.g.host[LLAMA_MOE_CACHE_GATE_UP]) {
        return nullptr;
    }
    settle_prompt_admits(*rt, l);
    // the same tensor shapes and bytes as the host tensors: the same kernels as with the experts on the GPU. Only
    // where the layer's matmuls run on the device anyway (a decode-size graph, or op offload on): with
    // --no-op-offload a prompt keeps its expert matmuls on the CPU, as the user asked and the reservation planned
    if (layer_in_place(*rt, l) && (n_tokens <= rt->decode_max || op_offload)) {
        *in_place = true;
        return &l.g;
    }
    // routed to the layer's number of experts (llama.cpp's warmup routes to all of them and takes the host path)
    if (n_expert_used != l.n_used) {
        return nullptr;
    }
    // a graph whose experts always fit the slots, and whose mul_mat_id on the device takes a kernel that does not
    // split its work by the bank's expert count (vec_max), with every miss uploaded: the banks alone, looked up on the
    // device or planned on the host
    const bool fits = n_tokens <= rt->decode_max && n_tokens * l.n_used <= l.n_slots && n_tokens <= l.vec_max;
    if (fits && rt->max_fills == GGML_MOE_CACHE_FILL_ALL) {
        *device = l.device_lookup;
        return &l.g;
    }
    // hot/cold: any graph whose expert matmuls on the host weights stay on the CPU, under every policy; what the
    // lookup does not fill (the policy, or the experts past the slots) is computed there beside the banks
    if (l.hot_cold && can_mask && n_tokens <= hot_cold_max_tokens()) {
        *device   = l.device_lookup;
        *hot_cold = true;
        return &l.g;
    }
    // else the host weights: the staging path for decode sizes (counted), the host path above
    if (n_tokens > rt->decode_max) {
        return nullptr;
    }
    if (!fits) {
        *staging = true;
        return nullptr;
    }
    *device = l.device_lookup;
    return &l.g;
}

ggml_tensor * llama_moe_cache_build_device_lookup(llama_moe_cache_rt * rt, llama_moe_cache_routes & routes, ggml_context * ctx,
        ggml_cgraph * gf, int32_t il, ggml_tensor * ids, int64_t graph_tokens, ggml_tensor ** banks, ggml_tensor ** cold_ids) {
    GGML_ASSERT(rt != nullptr && il >= 0 && il < (int32_t) rt->index.size() && rt->index[il] >= 0);
    rt_layer & l = rt->layers[rt->index[il]];
    const int64_t n_ids = ids->ne[0] * ids->ne[1];
    GGML_ASSERT(l.device_lookup && ids->type == GGML_TYPE_I32 && ids->ne[0] == l.n_used);
    GGML_ASSERT(cold_ids != nullptr ? l.hot_cold && n_ids <= lookup_max_ids(l.n_slots, l.n_used) : n_ids <= l.n_slots);
    ggml_tensor * words  = rt->statuses[l.status_dev].words;
    ggml_tensor * status = ggml_view_1d(ctx, words, 1, (size_t) l.status_index * ggml_element_size(words));
    // only a hot/cold graph may leave misses cold: elsewhere every miss is filled, as the banks alone need
    ggml_tensor * lookup = ggml_moe_cache_lookup(ctx, ids, l.state, status, l.n_expert, l.n_slots,
            cold_ids != nullptr ? rt->max_fills : GGML_MOE_CACHE_FILL_ALL);
    ggml_format_name(lookup, "moe_cache_lookup-%d", il);
    ggml_build_forward_expand(gf, lookup);
    // every fill before the first matmul: the backend fuses the matmuls that follow one another (gate, up, glu). A
    // hot/cold layer's caller expands them after its cold branch, so that the CPU's inputs leave the GPU behind the
    // lookup, not behind the fills' uploads
    const bool skip_plant = rt->plan->debug_skip_fill > 0 && rt->index[il] == 0;
    for (int k = 0; k < LLAMA_MOE_CACHE_N_TENSORS; k++) {
        if (l.g.bank[k] == nullptr) {
            continue;
        }
        ggml_tensor * fill = ggml_moe_cache_fill(ctx, l.g.bank[k], lookup, const_cast<ggml_tensor *>(l.g.host[k]), l.n_slots);
        if (skip_plant) {
            // LLAMA_MOE_CACHE_DEBUG_SKIP_FILL on the device: the first fill of every lookup of the first cached layer
            // keeps its slot's old bytes (a planted stale slot, for the identity cells to catch)
            ggml_moe_cache_fill_params p = ggml_moe_cache_fill_params_of((const int32_t *) fill->op_params);
            p.skip_first = 1;
            ggml_moe_cache_fill_params_set((int32_t *) fill->op_params, p);
        }
        ggml_format_name(fill, "moe_cache_fill_%s-%d", EXP_NAMES[k], il);
        if (cold_ids == nullptr) {
            ggml_build_forward_expand(gf, fill);
        }
        banks[k] = fill;
    }
    routes.push_back({ lookup, ids, il, false, false, true, cold_ids != nullptr, false, graph_tokens });
    // the slot ids inside the lookup's result (a view of the state): the matmuls read them after the lookup by data;
    // the cold ids follow them
    const size_t slot_ids = (size_t) ggml_moe_cache_tensor_layout_of(l.n_expert, l.n_slots).slot_ids * sizeof(int32_t);
    if (cold_ids != nullptr) {
        *cold_ids = ggml_view_2d(ctx, lookup, ids->ne[0], ids->ne[1], ids->ne[0] * sizeof(int32_t),
                slot_ids + (size_t) n_ids * sizeof(int32_t));
        ggml_format_name(*cold_ids, "moe_cache_cold_ids-%d", il);
    }
    return ggml_view_2d(ctx, lookup, ids->ne[0], ids->ne[1], ids->ne[0] * sizeof(int32_t), slot_ids);
}

void llama_moe_cache_graph_route(llama_moe_cache_rt * rt, llama_moe_cache_routes & routes, ggml_tensor * at, ggml_tensor * ids,
        int32_t il, bool banks, bool in_place, bool hot_cold, int64_t graph_tokens) {
    GGML_ASSERT(rt != nullptr && il >= 0 && il < (int32_t) rt->index.size() && rt->index[il] >= 0);
    GGML_ASSERT(ids->type == GGML_TYPE_I32 && ids->nb[0] == sizeof(int32_t));
    GGML_ASSERT((in_place || ids->ne[0] == rt->layers[rt->index[il]].n_used) && !(in_place && banks));
    GGML_ASSERT(!hot_cold || banks);
    routes.push_back({ at, ids, il, banks, in_place, false, hot_cold, false, graph_tokens });
}

void llama_moe_cache_graph_prompt_route(llama_moe_cache_rt * rt, llama_moe_cache_routes & routes, ggml_tensor * at,
        ggml_tensor * ids, int32_t il, int64_t n_expert, const ggml_tensor * gate_exps, const ggml_tensor * up_exps,
        const ggml_tensor * down_exps, const ggml_tensor * gate_up_exps, int64_t graph_tokens) {
    if (rt == nullptr || il < 0 || il >= (int32_t) rt->index.size() || rt->index[il] < 0) {
        return;
    }
    const rt_layer & l = rt->layers[rt->index[il]];
    // the layer's own tensors (what its prompt graphs stage), routed to its number of experts (llama.cpp's warm-up
    // routes to all of them), rows to read (a last layer none of whose tokens is an output computes none)
    if (n_expert != l.n_expert || gate_exps != l.g.host[LLAMA_MOE_CACHE_GATE] || up_exps != l.g.host[LLAMA_MOE_CACHE_UP] ||
            down_exps != l.g.host[LLAMA_MOE_CACHE_DOWN] || gate_up_exps != l.g.host[LLAMA_MOE_CACHE_GATE_UP] ||
            ids->type != GGML_TYPE_I32 || ids->nb[0] != sizeof(int32_t) || ids->ne[0] != l.n_used || ids->ne[1] < 1 ||
            layer_in_place(*rt, l)) {
        return;
    }
    routes.push_back({ at, ids, il, false, false, false, false, true, graph_tokens });
}

void llama_moe_cache_seed_ubatch(llama_moe_cache_rt * rt, int64_t n_tokens, int64_t n_after, int64_t min_batch_ahead) {
    if (rt == nullptr) {
        return;
    }
    // no later ubatch of the call uploads ahead where fewer tokens than the min batch follow
    const bool seeds = rt->seed_on && min_batch_ahead > 0 && n_tokens >= min_batch_ahead && n_after < min_batch_ahead;
    rt->seed_tokens = seeds ? n_tokens : 0;
    if (rt->seed_on && min_batch_ahead <= 0 && n_tokens > rt->decode_max && !rt->said_no_seed) {
        LLAMA_LOG_INFO("llama_moe: expert cache: prompts do not seed it: no prompt uploads its experts ahead (the "
                "host-weight prefetch is off, or op offload is off)\n");
        rt->said_no_seed = true;
    }
}

// the router's ids of a route (computed, its device synchronized) into rt.ids_host: token t's experts at
// [t * stride, t * stride + ne[0]). The rows of a view of the argsort: the span they cover is read
static int64_t read_ids(llama_moe_cache_rt & rt, const ggml_tensor * t) {
    GGML_ASSERT(t->ne[1] >= 1);
    const size_t span = (size_t) ((t->ne[1] - 1) * t->nb[1] + t->ne[0] * sizeof(int32_t));
    rt.ids_host.resize(span / sizeof(int32_t) + 1);
    ggml_backend_tensor_get(t, rt.ids_host.data(), 0, span);
    return (int64_t) (t->nb[1] / sizeof(int32_t));
}

// reads a routing (computed, its device synchronized) and plans its layer: uploads the misses and the slot map
static void plan_route(llama_moe_cache_rt & rt, const llama_moe_cache_route & r) {
    rt_layer & l = rt.layers[rt.index[r.il]];
    const int64_t n_tokens = r.ids->ne[1];
    GGML_ASSERT(n_tokens >= 1 && n_tokens <= (r.hot_cold ? hot_cold_max_tokens() : rt.decode_max));
    const int64_t stride = read_ids(rt, r.ids);

    planner_takes(l);
    const bool ok = rt.plan->plan_decode(r.il, rt.ids_host.data(), n_tokens, l.n_used, stride, rt.dplan, rt.max_fills,
            r.hot_cold);
    GGML_ASSERT(ok && "a graph whose experts may not fit the slots reads the banks"); // see graph_layer_for

    // the fills, in runs of consecutive experts into consecutive slots (as the stats count the copies)
    std::vector<llama_moe_cache_fill> & fills = rt.dplan.fills;
    std::sort(fills.begin(), fills.end(), [](const llama_moe_cache_fill & a, const llama_moe_cache_fill & b) {
        return a.slot < b.slot;
    });
    upload_fills(l, fills, l.backend);
    // the slot of every expert (the graph reads it at every routed id); experts not resident map to slot 0, never
    // read: every routed expert is resident. A hot/cold plan maps its cold experts to -1 (masked in the banks'
    // matmuls) and writes the cold map, e where e is cold, which the CPU's cold branch reads after this callback
    const llama_moe_cache_layer & pl = *rt.plan->layer(r.il);
    l.slot_map_host.resize(l.n_expert);
    for (int32_t e = 0; e < l.n_expert; e++) {
        l.slot_map_host[e] = r.hot_cold ? pl.slot_of[e] : std::max(pl.slot_of[e], 0);
    }
    ggml_backend_tensor_set_async(l.backend, l.g.slot_map, l.slot_map_host.data(), 0, l.slot_map_host.size() * sizeof(int32_t));
    if (r.hot_cold) {
        l.cold_map_host.resize(l.n_expert);
        for (int32_t e = 0; e < l.n_expert; e++) {
            l.cold_map_host[e] = pl.slot_of[e] < 0 ? e : -1;
        }
        ggml_backend_tensor_set_async(l.backend, l.g.cold_map, l.cold_map_host.data(), 0,
                l.cold_map_host.size() * sizeof(int32_t));
    }
}

//
// prompts: a graph that uploads host weights ahead lets the cache write the staged copies of its layers' expert
// tensors (the scheduler's copy mode NONE): resident experts are copied from the banks on the device, the others
// uploaded from the host, and uploads that take a free slot are then copied from the staged copy into it. All of it
// runs on the copy queue in the order the scheduler issues the pieces, so a bank read comes after the admit that
// filled its slot, and the compute that reads the staged copy waits for all of it as for an upload.
//

static ggml_backend_sched_copy_mode copy_mode(const ggml_tensor * weight, void * user_data) {
    const llama_moe_cache_rt & rt = *(const llama_moe_cache_rt *) user_data;
    return rt.host_tensor.count(weight) ? GGML_BACKEND_SCHED_COPY_NONE : GGML_BACKEND_SCHED_COPY_AHEAD;
}

// bytes [offset, offset + size) of a tensor in device memory as a flat tensor, for a device-to-device copy of part
// of it (ggml_backend_tensor_copy_async copies whole tensors of one layout)
static ggml_tensor byte_range(const ggml_tensor * t, size_t offset, size_t size) {
    ggml_tensor v = {};
    v.type   = GGML_TYPE_I8;
    v.ne[0]  = (int64_t) size;
    v.ne[1]  = v.ne[2] = v.ne[3] = 1;
    v.nb[0]  = 1;
    v.nb[1]  = v.nb[2] = v.nb[3] = size;
    v.buffer = t->view_src ? t->view_src->buffer : t->buffer;
    v.data   = (char *) t->data + offset;
    return v;
}

static void copy_on_device(ggml_backend_t queue, const ggml_tensor * src, size_t src_offset, ggml_tensor * dst,
        size_t dst_offset, size_t size) {
    ggml_tensor from = byte_range(src, src_offset, size);
    ggml_tensor to   = byte_range(dst, dst_offset, size);
    ggml_backend_tensor_copy_async(queue, queue, &from, &to);
}

// the planner's prompt counters of a cached layer (the copy calls are counted here, where they are made)
static llama_moe_cache_stats & prompt_stats(llama_moe_cache_rt & rt, const rt_layer & l) {
    return rt.plan->layers[rt.index[l.il]].stats[LLAMA_MOE_CACHE_PHASE_PROMPT];
}

// the layer's plan for this graph: every expert is staged (the upload runs ahead of the router), the residents read
// from their slots, and uploads take free slots without replacing a resident (prompt_admit without the routing).
// in_place: the scheduler found the layer's copy in place (kept): a plan made when it was staged ahead is this graph's
static void plan_prompt_layer(llama_moe_cache_rt & rt, rt_layer & l, bool in_place) {
    if (l.prompt_graph == rt.n_graphs && l.staged_plan == rt.staging) {
        return; // made for this graph (or this stage) already
    }
    if (l.staged_plan && !rt.staging) {
        // the stage planned this ubatch of the layer and issued its copies; its admits were settled with them. Where
        // the copies are in place this graph's notices say where; where the scheduler lost them (an arena made again
        // between, or a graph it could not hold) it writes them again: the residents from the banks, the rest
        // uploaded, and nothing admitted (the stage's plan did), counted as moved
        settle_prompt_admits(rt, l); // (while the plan is the stage's: see staged_whole)
        l.staged_plan  = false;
        l.prompt_graph = rt.n_graphs;
        planner_takes(l);
        const llama_moe_cache_layer & pl = *rt.plan->layer(l.il);
        std::fill(l.admit_slot.begin(), l.admit_slot.end(), -1);
        uint64_t n_reads = 0;
        for (int32_t e = 0; e < l.n_expert; e++) {
            l.read_slot[e] = pl.slot_of[e];
            n_reads += pl.slot_of[e] >= 0;
        }
        std::fill(std::begin(l.filled), std::end(l.filled), 0);
        std::fill(std::begin(l.staged), std::end(l.staged), nullptr);
        l.pending.clear();
        l.plan_charged = false;
        std::fill(std::begin(l.tensor_charged), std::end(l.tensor_charged), false);
        if (!in_place) {
            llama_moe_cache_stats & st = prompt_stats(rt, l);
            const size_t eb = layer_expert_bytes(l);
            st.n_hits         += n_reads;
            st.n_misses       += l.n_expert - n_reads;
            st.bytes_copied   += n_reads * eb;
            st.bytes_uploaded += (l.n_expert - n_reads) * eb;
        }
        return;
    }
    l.prompt_graph = rt.n_graphs;
    l.staged_plan  = rt.staging;
    planner_takes(l);
    // the planner counts one call per run and tensor; copy_fill counts the calls it makes instead (batched, or one per
    // run and piece)
    llama_moe_cache_stats & st = prompt_stats(rt, l);
    const uint64_t n_calls = st.n_copy_calls;
    rt.plan->prompt_stage(l.il, nullptr, 0, l.n_used, l.n_used, true, rt.pplan);
    rt.plan->prompt_admit(l.il, nullptr, 0, l.n_used, l.n_used, rt.pplan);
    st.n_copy_calls = n_calls;
    l.plan_charged    = true;
    std::fill(std::begin(l.tensor_charged), std::end(l.tensor_charged), true);
    l.charged_reads   = rt.pplan.reads.size();
    l.charged_uploads = rt.pplan.uploads.size();
    std::fill(l.read_slot.begin(), l.read_slot.end(), -1);
    std::fill(l.admit_slot.begin(), l.admit_slot.end(), -1);
    for (const llama_moe_cache_fill & f : rt.pplan.reads) {
        l.read_slot[f.expert] = f.slot;
    }
    for (const llama_moe_cache_fill & f : rt.pplan.admits) {
        l.admit_slot[f.expert] = f.slot;
    }
    l.pending = rt.pplan.admits;
    std::fill(std::begin(l.filled), std::end(l.filled), 0);
    std::fill(std::begin(l.staged), std::end(l.staged), nullptr);
    l.staged_queue = nullptr;
}

// a copy of tensor k found in place moves none of the reads and uploads its graph's plan counted: its share of the
// bytes is taken back, and the expert counts with the layer's first such copy (its admits, from the copy in place,
// still run)
static void uncharge_moves(llama_moe_cache_rt & rt, rt_layer & l, int k) {
    llama_moe_cache_stats & st = prompt_stats(rt, l);
    if (l.plan_charged) {
        st.n_hits   -= l.charged_reads;
        st.n_misses -= l.charged_uploads;
        l.plan_charged = false;
    }
    if (l.tensor_charged[k]) {
        const size_t nb = l.g.host[k]->nb[expert_dim(k)];
        st.bytes_copied   -= l.charged_reads * nb;
        st.bytes_uploaded -= l.charged_uploads * nb;
        l.tensor_charged[k] = false;
    }
}

// every byte of tensor k of layer l was staged on its device in the layer's current prompt plan (copy_fill)
// (a stage's copies are complete as bytes alone: the place it names lives only through the stage, and the graph that
// adopts its plan says where the copy is)
static bool staged_whole(const rt_layer & l, int k) {
    return (l.staged[k] != nullptr || l.staged_plan) && l.filled[k] == ggml_nbytes(l.g.host[k]);
}

// the moves of one kind in one call where the device's registry offers ggml_backend_copy_regions_async, else one
// call each; returns the calls
static int issue_moves(const rt_layer & l, ggml_backend_t queue, const ggml_tensor * weight, const std::vector<fill_move> & moves,
        bool from_host, std::vector<ggml_backend_copy_region> & regions) {
    if (moves.empty()) {
        return 0;
    }
    if (l.copy_regions != nullptr) {
        regions.clear();
        for (const fill_move & m : moves) {
            const ggml_tensor * src = from_host ? weight : m.src;
            regions.push_back({ (const char *) src->data + m.src_offset, (char *) m.dst->data + m.dst_offset, m.size });
        }
        return l.copy_regions(queue, regions.data(), (int) regions.size(), from_host);
    }
    for (const fill_move & m : moves) {
        if (from_host) {
            ggml_backend_tensor_set_async(queue, m.dst, (const char *) weight->data + m.src_offset, m.dst_offset, m.size);
        } else {
            copy_on_device(queue, m.src, m.src_offset, m.dst, m.dst_offset, m.size);
        }
    }
    return (int) moves.size();
}

// size 0: the scheduler found the copy in place (kept copies, ggml_backend_sched_set_prefetch_keep): nothing is
// written, but the plan's admits are copied from it, and a seed may read it
static void copy_fill(const ggml_tensor * weight, ggml_tensor * copy, size_t offset, size_t size, ggml_backend_t queue,
        void * user_data) {
    llama_moe_cache_rt & rt = *(llama_moe_cache_rt *) user_data;
    const auto it = rt.host_tensor.find(weight);
    GGML_ASSERT(it != rt.host_tensor.end() && "the scheduler fills only the tensors the cache asked for");
    rt_layer & l = rt.layers[it->second.first];
    const int k = it->second.second;
    const bool in_place = size == 0;
    if (in_place) {
        GGML_ASSERT(offset == 0);
        size = ggml_nbytes(weight);
    }
    if (ggml_backend_get_device(queue) != l.dev) {
        // staged on another device than the layer's banks (the scheduler put the matmul elsewhere, e.g. the first GPU
        // of several with op offload): a device-to-device copy between them would wait for both, so from the host
        if (!in_place) {
            ggml_backend_tensor_set_async(queue, copy, (const char *) weight->data + offset, offset, size);
            prompt_stats(rt, l).n_copy_calls++;
            prompt_stats(rt, l).bytes_uploaded += size; // no plan counts it: nothing of the layer's banks is read
        }
        return;
    }
    plan_prompt_layer(rt, l, in_place);
    if (in_place) {
        uncharge_moves(rt, l, k);
    }
    l.filled[k] += size;
    l.staged[k]     = rt.staging ? nullptr : copy; // see staged_whole
    l.staged_queue  = rt.staging ? nullptr : queue;

    const size_t nb  = l.g.host[k]->nb[expert_dim(k)];
    const size_t end = offset + size;
    GGML_ASSERT(end <= (size_t) l.n_expert * nb);
    // runs of experts that move alike: uploads of consecutive experts, reads of consecutive experts from consecutive
    // slots; the admits of an upload run after it, in runs of consecutive slots. Uploads are queued first, then the
    // device copies (reads and admits touch disjoint bytes, and every admit follows its upload)
    std::vector<fill_move> & ups  = rt.fill_uploads;
    std::vector<fill_move> & devs = rt.fill_device;
    ups.clear();
    devs.clear();
    for (size_t lo = offset; lo < end; ) {
        const int32_t e0   = (int32_t) (lo / nb);
        const int32_t slot = l.read_slot[e0];
        int32_t e1 = e0 + 1;
        while ((size_t) e1 * nb < end && (slot < 0 ? l.read_slot[e1] < 0 : l.read_slot[e1] == slot + (e1 - e0))) {
            e1++;
        }
        const size_t hi = std::min(end, (size_t) e1 * nb);
        if (slot >= 0) {
            if (!in_place) {
                devs.push_back({ l.g.bank[k], (size_t) slot * nb + (lo - (size_t) e0 * nb), copy, lo, hi - lo });
            }
        } else {
            if (!in_place) {
                ups.push_back({ nullptr, lo, copy, lo, hi - lo });
            }
            for (size_t a = lo; a < hi; ) {
                const int32_t ea = (int32_t) (a / nb);
                int32_t eb = ea + 1;
                while ((size_t) eb * nb < hi && l.admit_slot[ea] >= 0 && l.admit_slot[eb] == l.admit_slot[ea] + (eb - ea)) {
                    eb++;
                }
                const size_t b = std::min(hi, (size_t) eb * nb);
                if (l.admit_slot[ea] >= 0) {
                    devs.push_back({ copy, a, l.g.bank[k], (size_t) l.admit_slot[ea] * nb + (a - (size_t) ea * nb), b - a });
                }
                a = b;
            }
        }
        lo = hi;
    }
    const int calls = issue_moves(l, queue, weight, ups, true, rt.fill_regions) +
                      issue_moves(l, queue, weight, devs, false, rt.fill_regions);
    prompt_stats(rt, l).n_copy_calls += calls;
    note_banks_on_queue(rt, !devs.empty());
    // a seed planned before this tensor's staged copy was complete: its copies follow the last piece. A stage's copy
    // (a place the scheduler names for this call alone) seeds nothing: its layer is in no graph bound now
    if (!rt.staging && l.seed_graph == rt.n_graphs && !l.seed_issued[k] && staged_whole(l, k)) {
        issue_seed(rt, l, k);
    }
}

void llama_moe_cache_set_staging(llama_moe_cache_rt * rt, bool staging) {
    if (rt != nullptr) {
        rt->staging = staging;
    }
}

bool llama_moe_cache_reads_in_place(const llama_moe_cache_rt * rt, const ggml_tensor * weight) {
    if (rt == nullptr) {
        return false;
    }
    const auto it = rt->host_tensor.find(weight);
    return it != rt->host_tensor.end() && layer_in_place(*rt, rt->layers[it->second.first]);
}

uint64_t llama_moe_cache_prompt_upload_bytes(const llama_moe_cache_rt * rt) {
    return rt == nullptr ? 0 : rt->plan->get_stats(-1, LLAMA_MOE_CACHE_PHASE_PROMPT).bytes_uploaded;
}

void llama_moe_cache_attach(llama_moe_cache_rt * rt, ggml_backend_sched_t sched) {
    if (rt != nullptr) {
        // a new scheduler (llama_context::sched_reserve synchronized the old one first, so every copy it ran is
        // done): the last graph's admits are settled with the old one's staged copies, and nothing of it is kept
        llama_moe_cache_settle(rt, nullptr);
        for (rt_layer & l : rt->layers) {
            std::fill(std::begin(l.staged), std::end(l.staged), nullptr);
            l.staged_queue = nullptr;
        }
        ggml_backend_sched_set_copy_callbacks(sched, copy_mode, copy_fill, rt);
    } else {
        ggml_backend_sched_set_copy_callbacks(sched, nullptr, nullptr, nullptr);
    }
}

static const llama_moe_cache_route * route_at(const llama_moe_cache_rt & rt, const ggml_tensor * t) {
    for (const llama_moe_cache_route & r : *rt.routes) {
        if ((r.banks || (r.prompt && rt.seeding)) && r.at == t) {
            return &r;
        }
    }
    return nullptr;
}

// a copy queue wrote the banks (wrote: any copy was issued): the next graph that reads them on a compute stream waits
static void note_banks_on_queue(llama_moe_cache_rt & rt, bool wrote) {
    rt.banks_on_queue = rt.banks_on_queue || wrote;
}

// the copies of layer l's seed for tensor k, from this graph's complete staged copy into the slots, on the copy
// queue that staged it: behind the uploads and bank reads of that copy, and before any upload that reuses its place
// (the scheduler queues those only once the split that reads it was released)
static void issue_seed(llama_moe_cache_rt & rt, rt_layer & l, int k) {
    const std::vector<llama_moe_cache_fill> & fills = l.seed_fills;
    const size_t nb = l.g.host[k]->nb[expert_dim(k)];
    rt.seed_moves.clear();
    for (size_t a = 0; a < fills.size();) {
        const size_t b = run_end(fills, a); // fills are sorted by slot
        rt.seed_moves.push_back({ l.staged[k], (size_t) fills[a].expert * nb, l.g.bank[k], (size_t) fills[a].slot * nb, (b - a) * nb });
        a = b;
    }
    prompt_stats(rt, l).n_copy_calls += issue_moves(l, l.staged_queue, l.g.host[k], rt.seed_moves, false, rt.fill_regions);
    l.seed_issued[k] = true;
    note_banks_on_queue(rt, !fills.empty());
}

// a prompt route of a seeding graph, its routing computed: the planner picks the layer's resident set from it, and
// the experts that enter it are copied from the staged copies into their slots (llama-moe-cache-rt.h, "Seeding")
static void seed_route(llama_moe_cache_rt & rt, const llama_moe_cache_route & r) {
    const size_t i = (size_t) rt.index[r.il];
    rt_layer & l = rt.layers[i];
    if (l.seed_graph == rt.n_graphs) {
        return; // a second routing of the layer in one graph
    }
    const int64_t stride = read_ids(rt, r.ids);
    // the graph's plan of the layer (its bank reads and admits name the slots as they are now) before the seed changes
    // what is resident: the copies of that plan precede the seed's on the queue
    plan_prompt_layer(rt, l, false);
    planner_takes(l);
    rt.plan->seed(r.il, rt.ids_host.data(), r.ids->ne[1], l.n_used, stride, l.seed_fills);
    l.seed_graph = rt.n_graphs;
    std::fill(std::begin(l.seed_issued), std::end(l.seed_issued), false);
    prompt_stats(rt, l).bytes_copied += l.seed_fills.size() * layer_expert_bytes(l);
    for (int k = 0; k < LLAMA_MOE_CACHE_N_TENSORS; k++) {
        if (l.g.bank[k] != nullptr && staged_whole(l, k)) {
            issue_seed(rt, l, k);
        }
    }
    if (rt.check_seed) {
        rt.seeds_to_check.push_back(i);
    }
}

// the user's callback observes node t; in a graph with device lookups, a stop may leave fills undone
static bool user_observes(llama_moe_cache_rt & rt, ggml_tensor * t) {
    const bool go_on = rt.user_cb(t, false, rt.user_data);
    if (!go_on && rt.graph_looks_up_on_device) {
        rt.device_graph_stopped = true;
    }
    return go_on;
}

// the user's callback for a graph whose layers look up on the device and none plans on the host
static bool device_user_callback(ggml_tensor * t, bool ask, void * user_data) {
    llama_moe_cache_rt & rt = *(llama_moe_cache_rt *) user_data;
    return ask ? rt.user_cb(t, true, rt.user_data) : user_observes(rt, t);
}

static bool eval_callback(ggml_tensor * t, bool ask, void * user_data) {
    llama_moe_cache_rt & rt = *(llama_moe_cache_rt *) user_data;
    const llama_moe_cache_route * r = route_at(rt, t);
    if (ask) {
        // the user's answer for the node the scheduler asks about last decides whether the user sees it computed
        rt.user_asked    = t;
        rt.user_wants_it = rt.user_cb != nullptr && rt.user_cb(t, true, rt.user_data);
        return r != nullptr || rt.user_wants_it;
    }
    if (r != nullptr && r->prompt) {
        seed_route(rt, *r);
    } else if (r != nullptr) {
        plan_route(rt, *r);
    }
    return rt.user_asked == t && rt.user_wants_it ? user_observes(rt, t) : true;
}

// one step per cached layer of a graph bound, by the path its routes say the layer takes (none: the host path)
static void count_paths(llama_moe_cache_rt & rt, const llama_moe_cache_routes & routes, int64_t n_tokens) {
    rt.graph_paths.assign(rt.layers.size(), LLAMA_MOE_CACHE_PATH_HOST);
    for (const llama_moe_cache_route & r : routes) {
        if (r.prompt) {
            continue; // a routing read for seeding: the layer computes on the host weights
        }
        rt.graph_paths[rt.index[r.il]] = r.hot_cold ? LLAMA_MOE_CACHE_PATH_HOT_COLD :
                r.device ? LLAMA_MOE_CACHE_PATH_DEVICE : r.in_place ? LLAMA_MOE_CACHE_PATH_IN_PLACE :
                r.banks ? LLAMA_MOE_CACHE_PATH_HOST_PLAN : LLAMA_MOE_CACHE_PATH_STAGING;
    }
    const int phase = n_tokens <= rt.decode_max ? LLAMA_MOE_CACHE_PHASE_DECODE : LLAMA_MOE_CACHE_PHASE_PROMPT;
    for (size_t i = 0; i < rt.layers.size(); i++) {
        rt.layers[i].path_steps[phase][rt.graph_paths[i]]++;
    }
}

// LLAMA_MOE_CACHE_DEBUG_REFUSE=N (read once; 0 off): the Nth graph bound with device lookups finds the state of
// the first layer it looks up on the device corrupt, so that lookup is refused (a planted refusal: that decode call
// must fail, llama_moe_cache_graph_ok)
static uint64_t debug_refuse_graph() {
    static const uint64_t n = (uint64_t) std::max<int64_t>(0, llama_moe_env_whole("LLAMA_MOE_CACHE_DEBUG_REFUSE", 0, INT32_MAX));
    return n;
}

static void plant_refusal(llama_moe_cache_rt & rt) {
    static const int32_t bad_n_free = -1; // a count no state can hold: the lookup's check refuses it (-3)
    for (size_t i = 0; i < rt.layers.size(); i++) {
        if (rt.device_in_graph[i]) {
            rt_layer & l = rt.layers[i];
            // after the state's upload on the same stream (bind_graph), before the graph's lookup
            ggml_backend_tensor_set_async(l.backend, l.state, &bad_n_free, sizeof(int32_t), sizeof(int32_t));
            LLAMA_LOG_WARN("llama_moe: LLAMA_MOE_CACHE_DEBUG_REFUSE: graph %" PRIu64 " finds layer %d's slot state on %s "
                    "corrupt (a planted refusal)\n", rt.n_device_graphs, l.il, ggml_backend_dev_name(l.dev));
            return;
        }
    }
}

void llama_moe_cache_bind_graph(llama_moe_cache_rt * rt, ggml_backend_sched_t sched, const llama_moe_cache_routes & routes,
        int64_t n_tokens, ggml_backend_sched_eval_callback user_cb, void * user_data) {
    if (rt == nullptr) {
        ggml_backend_sched_set_eval_callback(sched, user_cb, user_data);
        return;
    }
    const int64_t t_waits = ggml_time_us(); // LLAMA_MOE_DEBUG_DECODE_TIMES: the settle's synchronizations are waits too
    llama_moe_cache_settle(rt, sched);
    rt->n_graphs++;
    count_paths(*rt, routes, n_tokens);
    bool banks = false;     // the graph reads or fills banks on the compute streams
    bool host_plan = false; // ... and plans some layer on the host (the eval callback)
    bool first_in_place = false;
    // the device lookup's handover: a layer whose newest slot state is on its device is read back before anything
    // plans it on the host (a prompt's copy callbacks, a host-side plan, the next build's in-place check), unless this
    // graph looks it up on the device again
    rt->device_in_graph.assign(rt->layers.size(), false);
    bool device = false; // some layer looks up on the device
    for (const llama_moe_cache_route & r : routes) {
        if (r.device) {
            rt->device_in_graph[rt->index[r.il]] = true;
            device = true;
        }
    }
    read_back_states(*rt, sched, rt->device_in_graph);
    rt->debug_bind_sync_us   = ggml_time_us() - t_waits;
    rt->debug_bind_upload_us = 0;
    for (const llama_moe_cache_route & r : routes) {
        rt_layer & l = rt->layers[rt->index[r.il]];
        if (r.prompt) {
            continue; // a routing for the seeding alone: the layer reads its host weights, counted by their own route
        }
        if (r.device) {
            // the planner's state where it is newer, ahead of the graph on the stream that computes the lookup; the
            // host copy stays untouched until the state is read back (after a synchronization)
            if (l.state_ahead == rt_layer::STATE_HOST_AHEAD) {
                const int64_t t_upload = ggml_time_us();
                l.state_host.resize(ggml_moe_cache_state_size(l.n_expert, l.n_slots));
                rt->plan->get_state(r.il, l.state_host.data());
                ggml_backend_tensor_set_async(l.backend, l.state, l.state_host.data(), 0,
                        l.state_host.size() * sizeof(int32_t));
                std::fill(std::begin(l.device_counted), std::end(l.device_counted), 0); // the counters start at 0 there
                const llama_moe_cache_layer & pl = *rt->plan->layer(r.il);
                l.next_whole_check = l.device_steps + std::max<int64_t>(1, pl.n_free / std::max(1, l.n_used));
                rt->debug_bind_upload_us += ggml_time_us() - t_upload;
            }
            l.state_ahead    = rt_layer::STATE_DEVICE_AHEAD;
            l.in_place_bound = false;
            l.device_steps++;
            banks = true;
            continue;
        }
        if (r.in_place) {
            // the phase of the graph (a prompt's last layer may compute a single output row)
            // with the ids the layer routes: its rows (a prompt's last layer may compute only the output rows) x top-k
            // a graph built under llama_set_warmup(true) routes every token to every expert: not a step of the model's
            // routing, so not counted (it would add n_expert hits a token to the decode counters of a cache filled whole)
            if (r.ids->ne[0] == l.n_used) {
                rt->plan->note_in_place(r.il, r.graph_tokens <= rt->decode_max ? LLAMA_MOE_CACHE_PHASE_DECODE : LLAMA_MOE_CACHE_PHASE_PROMPT,
                        (uint64_t) ggml_nelements(r.ids));
            }
            first_in_place = first_in_place || !l.in_place_bound;
            l.in_place_bound = true;
        } else {
            l.in_place_bound = false; // not read in place now: the next read in place waits again
            if (!r.banks) {
                rt->plan->note_staging(r.il); // one step of the layer on the host weights, counted without its routing
            }
        }
        banks     = banks || r.banks;
        host_plan = host_plan || r.banks;
    }
    // a decode graph reads and fills the banks on the compute streams, a prompt's fills read and admit (and its seed
    // copies) on the copy queues: the first graph of the other kind waits for all of that work (once per switch). So
    // does a layer's first read in place, which may follow the admits that completed it: the computes of the graph
    // that issued them waited for them, but that graph may have stopped early (once per layer)
    if ((first_in_place && rt->banks_on_queue) || (banks ? rt->banks_on_queue : rt->banks_on_compute)) {
        const int64_t t_switch = ggml_time_us();
        ggml_backend_sched_synchronize(sched); // its compute streams and its copy queues
        rt->banks_on_queue   = false;
        rt->banks_on_compute = false;
        rt->debug_bind_sync_us += ggml_time_us() - t_switch;
    }
    rt->banks_on_compute = rt->banks_on_compute || banks;
    if (device && ++rt->n_device_graphs == debug_refuse_graph()) {
        plant_refusal(*rt);
    }
    rt->user_cb   = user_cb;
    rt->user_data = user_data;
    rt->graph_looks_up_on_device = device;
    // seeding (llama_moe_cache_seed_ubatch), where a cached layer of the graph stages on its device; else no callback
    // and no synchronization is spent on it
    rt->seeding = false;
    for (const llama_moe_cache_route & r : routes) {
        rt->seeding = rt->seeding || (r.prompt && r.graph_tokens == rt->seed_tokens &&
                ggml_backend_sched_get_prefetch_depth(sched, rt->layers[rt->index[r.il]].backend, nullptr) > 0);
    }
    rt->seed_tokens = 0;
    if (host_plan || rt->seeding) {
        rt->routes = &routes;
        ggml_backend_sched_set_eval_callback(sched, eval_callback, rt);
    } else if (device && user_cb != nullptr) {
        // a graph whose lookups run on the device needs no callback of its own (one graph per token, CUDA graphs
        // included); the user's is watched for a stop
        ggml_backend_sched_set_eval_callback(sched, device_user_callback, rt);
    } else {
        ggml_backend_sched_set_eval_callback(sched, user_cb, user_data);
    }
}

bool llama_moe_cache_graph_ok(llama_moe_cache_rt * rt, ggml_backend_sched_t sched) {
    if (rt == nullptr || !rt->graph_looks_up_on_device) {
        return true;
    }
    // behind the graph and the outputs' copies on each device's stream: the one synchronization the caller's read of
    // the outputs would wait for anyway
    for (rt_status & s : rt->statuses) {
        ggml_backend_tensor_get_async(s.backend, s.words, s.host, 0, ggml_nbytes(s.words));
    }
    ggml_backend_sched_synchronize(sched);
    bool ok = true;
    for (rt_status & s : rt->statuses) {
        bool refused = false;
        for (size_t j = 0; j < s.layer_of.size(); j++) {
            if (s.host[j] == 0) {
                continue;
            }
            rt_layer & l = rt->layers[rt->index[s.layer_of[j]]];
            LLAMA_LOG_ERROR("llama_moe: expert cache: layer %d's lookup on %s was refused in this step (more experts than "
                    "slots, an id out of range, or an inconsistent slot state), so the step read wrong slots: the decode "
                    "call fails; the layer's slots start empty again\n", l.il, ggml_backend_dev_name(l.dev));
            // the device's state cannot be trusted: the planner's layer starts empty and is uploaded before the next
            // lookup; the device's counters since the last handover are dropped with it
            rt->plan->empty(l.il);
            l.state_ahead = rt_layer::STATE_HOST_AHEAD;
            refused = true;
        }
        if (refused) {
            std::fill(s.host, s.host + s.layer_of.size(), 0);
            ggml_backend_tensor_set(s.words, s.host, 0, ggml_nbytes(s.words));
            ok = false;
        }
    }
    return ok;
}

void llama_moe_cache_debug_bind_us(const llama_moe_cache_rt * rt, int64_t * sync_us, int64_t * upload_us) {
    *sync_us   = rt ? rt->debug_bind_sync_us : 0;
    *upload_us = rt ? rt->debug_bind_upload_us : 0;
}

int64_t llama_moe_cache_budget_mib(const llama_moe_cache_rt * rt) {
    return rt ? rt->budget_mib : 0;
}

std::vector<std::pair<ggml_backend_buffer_type_t, size_t>> llama_moe_cache_memory(const llama_moe_cache_rt * rt) {
    std::vector<std::pair<ggml_backend_buffer_type_t, size_t>> out;
    if (rt != nullptr) {
        for (ggml_backend_buffer_t b : rt->bufs) {
            out.emplace_back(ggml_backend_buffer_get_type(b), ggml_backend_buffer_get_size(b));
        }
    }
    return out;
}

int32_t llama_moe_cache_path_steps_of(const llama_moe_cache_rt * rt, int32_t il, int32_t phase, uint64_t * steps) {
    if (rt == nullptr || phase < 0 || phase >= LLAMA_MOE_CACHE_PHASE_COUNT) {
        return rt ? (int32_t) rt->layers.size() : 0;
    }
    for (const rt_layer & l : rt->layers) {
        if (il < 0 || l.il == il) {
            for (int p = 0; p < LLAMA_MOE_CACHE_PATH_COUNT; p++) {
                steps[p] += l.path_steps[phase][p];
            }
        }
    }
    return (int32_t) rt->layers.size();
}

uint64_t llama_moe_cache_cold_of(llama_moe_cache_rt * rt, int32_t il) {
    if (rt == nullptr) {
        return 0;
    }
    read_back_counters(*rt);
    if (il >= 0 && (il >= (int32_t) rt->index.size() || rt->index[il] < 0)) {
        return 0;
    }
    return rt->plan->get_stats(il, LLAMA_MOE_CACHE_PHASE_DECODE).n_cold;
}

int32_t llama_moe_cache_max_fills(const llama_moe_cache_rt * rt) {
    return rt ? rt->max_fills : GGML_MOE_CACHE_FILL_ALL;
}

int32_t llama_moe_cache_counters_of(llama_moe_cache_rt * rt, int32_t il, int32_t phase, llama_moe_cache_counters * out) {
    if (rt == nullptr || phase < 0 || phase >= LLAMA_MOE_CACHE_PHASE_COUNT) {
        return rt ? (int32_t) rt->layers.size() : 0;
    }
    read_back_counters(*rt);
    if (il < 0 || (il < (int32_t) rt->index.size() && rt->index[il] >= 0)) {
        const llama_moe_cache_stats s = rt->plan->get_stats(il, (llama_moe_cache_phase) phase);
        *out = { s.n_ubatches, s.n_hits, s.n_misses, s.n_overflow, s.n_fills, s.n_evictions, s.bytes_uploaded,
                 s.bytes_copied, s.n_copy_calls, s.n_in_place, s.n_routed_in_place, s.n_seeded };
    }
    return (int32_t) rt->layers.size();
}
