// llama-moe-cache-rt.h (internal): the MoE expert cache of a context, wired to the graph and the scheduler
// (pyllama_moe).
//
// llama-moe-cache.h decides which experts are resident; this part owns the device banks that hold them and moves
// the bytes. For each MoE layer whose expert tensors stay on the host and whose other weights are on a GPU, the
// context allocates, on that GPU, one bank per expert tensor ([ne0, ne1, n_slots], the tensor's type; per-expert
// biases on the host get banks too) and a slot map and a cold map ([1, n_expert] I32 each).
//
// Decode with a host-side plan: a graph of at most decode_max tokens (LLAMA_MOE_CACHE_DECODE_MAX, 1..8, default 8)
// and at most the layer's vec_max (the most tokens for which its device's mul_mat_id of its types takes kernels whose
// bytes do not depend on the weight's expert count, ggml-mmid-batch.h: 8 on Volta, Ada and later, fewer for some
// types on Turing, Ampere, Pascal and AMD) whose tokens' experts always fit the layer's slots (n_tokens x n_expert_used <= n_slots) reads the
// layer's experts from the banks: ggml_mul_mat_id(bank, cur, get_rows(slot_map, ids)). The router's ids are read
// back through the scheduler's eval callback once the routing weights are computed (the end of what CUDA fuses into
// one kernel), the plan (CLOCK) picks slots, the misses are uploaded from the host tensors into their slots and the
// slot map written, all on the stream that computes the layer, before the rest of the graph runs. Every other graph
// (prompts, and batches whose experts may not fit: the staging path, counted) uses the host weights as before. Only
// devices that report keeping node order get banks (ggml-dev-caps.h: CUDA unless GGML_CUDA_GRAPH_OPT=1, and SIM).
// Per-expert scales and LoRA keep the router's ids.
//
// In place: a layer with a slot per expert holds expert e in slot e (llama-moe-cache.h); once all its experts are
// resident and its last admits settled, its banks are the host tensors' images, and every graph, of any size, reads
// them instead of the host tensors with the router's own ids: no plan, no read back, no staging, the same kernels
// as with the experts on the GPU. It stays so for the cache's life; llama_moe_cache_n_in_place tells the graph reuse
// when a rebuilt graph would read more layers in place.
//
// Decode on the device: where the layer's device has the lookup ops and reads its host experts in place
// (ggml-dev-caps.h; page-locked and mapped memory, which the fill's supports_op checks), a decode graph looks the
// slots up on the device instead: ggml_moe_cache_lookup on the layer's slot state (a device tensor beside the banks;
// the op returns a view of it, with the fills and slot ids it wrote) and one ggml_moe_cache_fill per bank, which
// copies the misses from the host experts, all before the layer's matmuls, which read the filled banks at the
// returned slots. Nothing is read back and no callback splits the graph: a token is one graph
// (one CUDA graph). The planner and the device hand the slot state over when the path changes: a graph that looks a
// layer up on the device first uploads the planner's state where it is newer; a graph that does not (a prompt, the
// host-side plan) first reads the device's back, with the counters of its lookups (one synchronization per switch).
// Elsewhere, or with LLAMA_MOE_CACHE_DEVICE=0, decode keeps the host-side plan; the context says once why.
//
// Seeding: a prompt ubatch that uploads ahead stages every expert of a cached layer on the layer's device
// (see llama_moe_cache_attach). The last such ubatch of a decode call (llama_moe_cache_seed_ubatch) reads each cached
// layer's routing back once it is computed (an eval callback: the scheduler then computes the graph in pieces, a
// synchronization at each routing and at each split's end) and the planner picks the resident set from it
// (llama_moe_cache::seed); the experts that enter it are copied from the staged copy into their slots on the copy
// queue, behind the uploads that staged them and before anything may reuse the staged memory (the scheduler queues
// those only once the split that reads it is released, after this callback). The routing is read in the split before
// the layer's, where the prefetch may not have issued the uploads of the layer's later tensors yet: a tensor's seed
// copies follow its staged copy's last piece. A seed whose graph did not stage every tensor of the layer is taken back
// with the graph's admits. LLAMA_MOE_CACHE_SEED=0 (or llama_moe_default_set_moe_cache_seed(0)) turns it off;
// LLAMA_MOE_CACHE_DEBUG_CHECK_SEED=1 compares the seeded layers' slots with the host experts once the graph is done.
//
// Profiles: each lookup that plans counts its distinct experts per layer (ggml-moe-cache-lookup.h: the
// host-side plan and the device alike; the counts are the tail of the flat state and travel with it at every handover
// and counter read-back), each seeding ubatch its routed tokens (llama_moe_cache::seed). With a profile file
// (llama_moe_default_set_moe_cache_profile, --moe-cache-profile, LLAMA_MOE_CACHE_PROFILE) made for this model, the
// cache starts with each layer's most used experts resident, uploaded once when it is made; when it is freed the
// file's counts plus this context's are written back atomically (llama-moe-cache-profile.h: the file). Layers filled
// whole and read in place count nothing (no routing is read there) and take nothing from a profile (they hold every
// expert already).
//
// Knob: llama_moe_default_set_moe_cache_mib (llama-moe.h, --moe-cache-mib) > LLAMA_MOE_CACHE_MIB > 0 (off). The
// budget is per device; one larger than the device's free memory less 512 MiB is shrunk to it, with a warning.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <utility>
#include <vector>

struct llama_model;
struct llama_moe_cache_rt;

// a cached layer's expert tensors, in the order of llama_moe_cache_graph_layer's arrays: the weights (experts along
// dim 2), then their per-expert biases (experts along dim 1)
enum llama_moe_cache_tensor {
    LLAMA_MOE_CACHE_GATE, LLAMA_MOE_CACHE_UP, LLAMA_MOE_CACHE_DOWN, LLAMA_MOE_CACHE_GATE_UP,
    LLAMA_MOE_CACHE_GATE_B, LLAMA_MOE_CACHE_UP_B, LLAMA_MOE_CACHE_DOWN_B, LLAMA_MOE_CACHE_GATE_UP_B,
    LLAMA_MOE_CACHE_N_TENSORS,
};

// the graph's view of one cached layer: what build_moe_ffn reads instead of the host expert tensors
struct llama_moe_cache_graph_layer {
    // the layer's tensors the banks copy, nullptr where the layer has none (a layer whose biases the banks cannot
    // hold is not cached), and their banks ([ne0, ne1, n_slots] or [ne0, n_slots])
    const ggml_tensor * host[LLAMA_MOE_CACHE_N_TENSORS] = {};
    ggml_tensor *       bank[LLAMA_MOE_CACHE_N_TENSORS] = {};
    // I32 [1, n_expert]: the slot of each expert, written by the plan; the graph takes slot ids =
    // get_rows(slot_map, router ids), so the matmuls depend on the router's output (and keep it alive until the plan
    // has read it). -1 where a hot/cold plan leaves the expert cold
    ggml_tensor * slot_map = nullptr;
    // I32 [1, n_expert], beside the slot map: a hot/cold plan's cold experts (e where cold, else -1), written
    // with it; the cold ids get_rows(cold_map, router ids) reach the CPU as its split's input, after the plan
    ggml_tensor * cold_map = nullptr;
};

// a router output of one graph that the cache reads back once the node `at` (the end of the routing, the last node
// of what CUDA fuses) is computed: the ids, their layer, and whether the layer reads the banks through a plan (else
// the graph could not promise that its experts fit the slots and the layer takes the staging path, counted as such)
// or in place (nothing read back: counted when the graph is bound), or looked up on the device (at: the lookup), or
// a prompt's routing that seeds the cache where the graph is bound to seed (prompt)
struct llama_moe_cache_route {
    ggml_tensor * at;
    ggml_tensor * ids;
    int32_t       il;
    bool          banks;
    bool          in_place;
    bool          device;
    bool          hot_cold; // a device lookup whose misses may be cold (counted as the hot/cold path)
    bool          prompt;
    int64_t       graph_tokens; // the ubatch's tokens (the layer may compute fewer rows): the phase it counts in
};
using llama_moe_cache_routes = std::vector<llama_moe_cache_route>;

// end of the llama_context constructor: the cache of the budget in effect (logged once), or nullptr when off, when
// no MoE layer has its experts on the host next to a GPU, or when nothing fits
// backends: the context's (the scheduler's), one of which computes each cached layer; budget_mib per device, <= 0 off
// --fit (llama_moe_cache_need_on of llama-moe.h): what a cache needs on dev for the model as placed, also a model
// loaded with no_alloc
struct llama_moe_cache_need;
llama_moe_cache_need llama_moe_cache_need_of(const llama_model & model, ggml_backend_dev_t dev);

// n_seq_max, n_ubatch: the context's, for the line that says which of its batches leave the banks
llama_moe_cache_rt * llama_moe_cache_ctx_init(const llama_model & model, const std::vector<ggml_backend_t> & backends,
        int64_t budget_mib, uint32_t n_seq_max, uint32_t n_ubatch);

// the budget the cache was made with (MiB per device), 0 for none
int64_t llama_moe_cache_budget_mib(const llama_moe_cache_rt * rt);

// ~llama_context, after its queued work is done: logs the summary of the stats, frees the banks
void llama_moe_cache_ctx_free(llama_moe_cache_rt * rt);

// build_moe_ffn: the banks layer il reads in a graph of n_tokens tokens, or nullptr (host weights): only for the
// layer's own expert tensors. *in_place: read them as the expert tensors with the router's ids (any number of
// experts per token; any size with op_offload, the context's, else decode sizes alone: a prompt's expert matmuls
// stay where --no-op-offload put them). Else they are read through the slot map, for a graph of at most decode_max tokens
// routed to the layer's number of experts (llama.cpp's warmup, which routes to all of them, reads the host weights);
// *staging: the layer is cached but the graph is too large for its slots (the staging path), to be counted.
// *device: the banks are read through a lookup on the device (llama_moe_cache_build_device_lookup), not the slot map.
// *hot_cold: ... and the layer is computed hot/cold: a graph of up to hot_cold_max_tokens (the CPU keeps host-weight
// matmuls below GGML_OP_OFFLOAD_MIN_BATCH) whose lookup follows the miss policy and leaves cold what it does not fill,
// under every policy where the graph's experts may not fit the slots (else the staging path). The cold experts are
// computed on the CPU from the host weights with the lookup's cold ids, the others from the banks at its slot ids,
// each with the other's ids masked (-1: an exactly zero row), and the two added; adding an exact zero changes no bit,
// so each routed row is the bytes of the kernel that computed it. can_mask: the layer's call has no per-expert scales
// and no adapters (indexed by the router's ids, which a masked branch does not read).
const llama_moe_cache_graph_layer * llama_moe_cache_graph_layer_for(llama_moe_cache_rt * rt, int32_t il, int64_t n_tokens,
        int64_t n_expert, int64_t n_expert_used, const ggml_tensor * gate_exps, const ggml_tensor * up_exps,
        const ggml_tensor * down_exps, const ggml_tensor * gate_up_exps, bool op_offload, bool can_mask, bool * staging,
        bool * in_place, bool * device, bool * hot_cold);
// build_moe_ffn, for a layer sent to the device, once its routing is expanded: the lookup of ids and the fills of the
// misses, expanded into gf before anything that reads them; banks[k] (LLAMA_MOE_CACHE_N_TENSORS) become the filled
// banks the matmuls and bias adds read. Records the layer's route; returns the slot ids ([n_used, n_tokens]). cold_ids:
// nullptr, or a hot/cold layer (graph_layer_for), which gets the cold ids ([n_used, n_tokens]); the slot ids are then
// -1 where cold, and the caller expands the fills (banks) after its cold branch.
ggml_tensor * llama_moe_cache_build_device_lookup(llama_moe_cache_rt * rt, llama_moe_cache_routes & routes, ggml_context * ctx,
        ggml_cgraph * gf, int32_t il, ggml_tensor * ids, int64_t graph_tokens, ggml_tensor ** banks, ggml_tensor ** cold_ids);
// a layer the cache reads (banks, in_place) or counts (staging) records its routing: the eval callback plans a banks
// route, the bind counts the others
// hot_cold: a banks route whose plan follows the miss policy and writes the cold map (graph_layer_for's *hot_cold)
void llama_moe_cache_graph_route(llama_moe_cache_rt * rt, llama_moe_cache_routes & routes, ggml_tensor * at, ggml_tensor * ids,
        int32_t il, bool banks, bool in_place, bool hot_cold, int64_t graph_tokens);
// build_moe_ffn, for a layer that reads neither banks nor the staging path count (a prompt graph): records the routing
// of a cached layer's own tensors (those it stages), for the seeding; nothing when the layer has no cache, its tensors
// are others (a second call for the same layer), it is read in place, or it computes no rows
void llama_moe_cache_graph_prompt_route(llama_moe_cache_rt * rt, llama_moe_cache_routes & routes, ggml_tensor * at,
        ggml_tensor * ids, int32_t il, int64_t n_expert, const ggml_tensor * gate_exps, const ggml_tensor * up_exps,
        const ggml_tensor * down_exps, const ggml_tensor * gate_up_exps, int64_t graph_tokens);
// llama_context::decode, before each ubatch: whether its graph seeds. n_after: the call's tokens after it;
// min_batch_ahead: the fewest tokens of a graph that uploads ahead (the prefetch's min batch),
// <= 0 when none does (the prefetch off, or op offload off: the prompt's experts stay on the CPU). Seeds when the
// ubatch uploads ahead and no later ubatch of the call can (fewer than min_batch_ahead tokens follow), so the last
// large ubatch of a prompt seeds however the batch is split, and a small tail batch after it does not. A call of a
// single ubatch (n_batch == n_ubatch) seeds each time.
void llama_moe_cache_seed_ubatch(llama_moe_cache_rt * rt, int64_t n_tokens, int64_t n_after, int64_t min_batch_ahead);
// llama_context::process_ubatch, before the graph reuse check: keeps or takes back the last graph's prompt admits
// (which needs every copy of that graph issued: only between graphs). Graph builds and binds settle too. sched: the
// context's scheduler, waited for where a check needs the copies it ran done
void llama_moe_cache_settle(llama_moe_cache_rt * rt, ggml_backend_sched_t sched);
// the layers read in place now (0 without a cache): a graph built when it was lower would read fewer of them, so it
// is not reused (the number only grows)
int32_t llama_moe_cache_n_in_place(const llama_moe_cache_rt * rt);

// the context's scheduler writes the staged copies of the cached layers' expert tensors through the cache when a graph
// uploads ahead (prompts: residents copied from the banks, the rest uploaded, free slots filled); rt nullptr detaches
// (before the cache is freed or replaced). The previous scheduler the cache was attached to, if any, was synchronized
// (llama_context::sched_reserve): the cache settles the last graph with it and keeps nothing of it
void llama_moe_cache_attach(llama_moe_cache_rt * rt, ggml_backend_sched_t sched);

// layer-major prompts (llama-moe-layer-major.h): while on, the copies the scheduler asks the cache to fill are a stage
// of later graphs' (ggml_backend_sched_prefetch_stage): each layer's plan is made there, and the first graph that finds
// the layer's copies in place takes it as its own, so a layer is planned once per graph as in ubatch order
void llama_moe_cache_set_staging(llama_moe_cache_rt * rt, bool staging);
// whether graphs read this host weight's layer from its banks in place (nothing of it is staged)
bool llama_moe_cache_reads_in_place(const llama_moe_cache_rt * rt, const ggml_tensor * weight);
// the bytes the cache uploaded from the host for prompts (its fills of staged copies) since it was made
uint64_t llama_moe_cache_prompt_upload_bytes(const llama_moe_cache_rt * rt);

// llama_context::process_ubatch, before the graph computes: the scheduler's eval callback for this graph, the cache's
// (which calls the user's after it) where the graph has routes, else the user's alone
// (n_tokens: the graph's ubatch, whose size decides the phase its path steps count in)
void llama_moe_cache_bind_graph(llama_moe_cache_rt * rt, ggml_backend_sched_t sched, const llama_moe_cache_routes & routes,
        int64_t n_tokens, ggml_backend_sched_eval_callback user_cb, void * user_data);

// llama_context::decode, after a ubatch's graph computed and its outputs' copies were queued: false where a device
// lookup of that graph was refused (its slot ids were wrong, so its outputs are), said in an error line per layer;
// the refused layers' slots start empty again. Reads each device's status words back behind the graph and waits for
// the scheduler (the synchronization a read of the outputs makes), only after graphs with device lookups
bool llama_moe_cache_graph_ok(llama_moe_cache_rt * rt, ggml_backend_sched_t sched);

// LLAMA_MOE_DEBUG_DECODE_TIMES: what the last bind spent waiting for earlier work (the handover's read back and the
// switch between copy queues and compute streams) and uploading slot states, in microseconds (0 without a cache)
void llama_moe_cache_debug_bind_us(const llama_moe_cache_rt * rt, int64_t * sync_us, int64_t * upload_us);

// llama_moe_cache_get_counters: the stats of layer il (< 0: all) and phase; returns the cached layers. Reads the device
// lookups' counters back first (a synchronization, where a layer looked up on its device since the last handover)
int32_t llama_moe_cache_counters_of(llama_moe_cache_rt * rt, int32_t il, int32_t phase, struct llama_moe_cache_counters * out);
// llama_moe_cache_get_cold_misses: the decode misses of layer il (< 0: all) computed on the CPU (reads the counters back)
uint64_t llama_moe_cache_cold_of(llama_moe_cache_rt * rt, int32_t il);
// the miss policy of the cache, as the most misses a lookup fills (GGML_MOE_CACHE_FILL_ALL without a cache)
int32_t llama_moe_cache_max_fills(const llama_moe_cache_rt * rt);
// llama_moe_cache_get_path_steps: adds the path steps of layer il (< 0: all) and phase to steps; returns the cached layers
int32_t llama_moe_cache_path_steps_of(const llama_moe_cache_rt * rt, int32_t il, int32_t phase, uint64_t * steps);

// llama_context::memory_breakdown: the banks' buffers, counted with the context's memory (they live as long as it)
std::vector<std::pair<ggml_backend_buffer_type_t, size_t>> llama_moe_cache_memory(const llama_moe_cache_rt * rt);
