// llama-moe.h: the public C API of pyllama_moe's additions to llama.cpp.
//
// This header is the single source of the Python (cffi) bindings: pyllama_moe reads the declarations
// between the BEGIN/END markers below, so keep them plain C (no macros inside declarations other than
// LLAMA_MOE_API, no includes, no inline functions). Knobs that later patches add are new functions here;
// public llama.h structs are never changed, because llama-cpp-python binds them field by field.
#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LLAMA_MOE_API LLAMA_API

// --- BEGIN CFFI ---

// A static, NUL-terminated description of this build:
// "key=<build key>;variant=<master|patched>;pin=<sdist version>@<llama.cpp commit>".
// The key is the content hash pyllama_moe computed over everything that went into the build; its loader
// compares it with the key of the build directory it was asked to load.
LLAMA_MOE_API const char * llama_moe_build_info(void);

// --- host-weight prefetch ---
// The copies of expert (and other host) weights that a GPU split reads are staged in a device arena the scheduler
// owns and, for ubatches of at least min_batch tokens, uploaded on a second stream of the device, the copies of up
// to depth splits staged at once: an upload overlaps the computes of up to depth - 1 splits before its own. The
// arena is a ring of a staging budget over the splits' copies, placed when a graph is allocated: an upload waits
// only for the compute that last read the place it reuses. Results are byte-identical with the prefetch on and off.
//
// Precedence, per field: per-context setter > process default (set below, or by a llama.cpp flag) > environment
// (GGML_SCHED_PREFETCH, GGML_SCHED_PREFETCH_DEPTH, GGML_SCHED_PREFETCH_MIN_BATCH,
// GGML_SCHED_PREFETCH_HEADROOM_MIB, GGML_SCHED_PREFETCH_STAGING_MIB) > built-in (mode 1, depth 4, min_batch 128,
// headroom 512 MiB, staging auto). The getters return the values in use: a depth outside 2..8 is clamped, an
// unknown mode is 1.
// The struct is passed by value and keeps these four fields; knobs added later get functions of their own (the
// staging budget below). Set every field, -1 for the ones to leave as they are.
struct llama_moe_prefetch_params {
    int32_t mode;         // 0 off, 1 on for CUDA-family devices, 2 on for any device with async copies and events
    int32_t depth;        // the most splits whose copies are staged at once, 2..8 (the staging may allow fewer)
    int32_t min_batch;    // smaller ubatches copy only the routed experts, at split time (no staging queue)
    int32_t headroom_mib; // a reservation that would leave less device memory free drops the prefetch there
};

// The defaults a new context starts from. A negative field in the setter leaves that field as it is.
LLAMA_MOE_API struct llama_moe_prefetch_params llama_moe_prefetch_default_params(void);
LLAMA_MOE_API void llama_moe_set_prefetch_default_params(struct llama_moe_prefetch_params params);

// Per context; the scheduler is reserved again at the next decode. A negative field leaves that field as it is.
LLAMA_MOE_API struct llama_moe_prefetch_params llama_moe_get_prefetch_params(const struct llama_context * ctx);
LLAMA_MOE_API void llama_moe_set_prefetch_params(struct llama_context * ctx, struct llama_moe_prefetch_params params);

// The staging budget per device in MiB: 0 auto (the smallest ring that keeps every upload depth splits ahead, at
// most depth x the largest split); a budget that does not reach the depth takes only what the lookahead it reaches
// needs. Never less than the largest split (raised to it); under two splits' copies (lookahead 1) part of each
// upload still runs during the compute before its split, and where that part is under an eighth of some upload the
// prefetch turns off there; halved (not below 2 splits ahead) when it does not fit or leaves less than the headroom,
// then off. Process default, read when a context is created: >= 0 sets it (0: auto, over the environment), -1
// unsets it (then GGML_SCHED_PREFETCH_STAGING_MIB, then auto). Per context: >= 0 sets it, -1 takes the process
// default again. The getters return the value in effect.
LLAMA_MOE_API void    llama_moe_default_set_prefetch_staging_mib(int32_t mib);
LLAMA_MOE_API int32_t llama_moe_default_get_prefetch_staging_mib(void);
LLAMA_MOE_API void    llama_moe_set_prefetch_staging_mib(struct llama_context * ctx, int32_t mib);
LLAMA_MOE_API int32_t llama_moe_get_prefetch_staging_mib(const struct llama_context * ctx);

// Number of devices of the context whose scheduler prefetches now (0: off, unsupported, or dropped because the
// staging arena did not fit), and the bytes of their staging arenas (part of the compute buffer sizes).
LLAMA_MOE_API int32_t llama_moe_prefetch_n_devices(const struct llama_context * ctx);
LLAMA_MOE_API size_t  llama_moe_prefetch_arena_size(const struct llama_context * ctx);

// --- asynchronous CPU splits ---
// When on, the scheduler computes CPU splits on a worker thread while the calling thread goes on launching the later
// splits of GPUs: the CPU's experts and independent GPU work (a shared expert) run at once. The caller joins the
// worker before a split that needs the CPU's result and before a decode returns, so results are the same bytes on
// and off. The worker is the CPU thread pool's first thread (-t counts it); the launching thread runs beside the pool.
// Precedence: per-context setter > process default (set below, or --sched-async-cpu) > GGML_SCHED_ASYNC_CPU > off.
// Process default: 0 off, 1 on, -1 unsets it. Per context: 0 or 1; -1 takes the process default again.
LLAMA_MOE_API void    llama_moe_default_set_sched_async_cpu(int32_t on);
LLAMA_MOE_API int32_t llama_moe_default_get_sched_async_cpu(void);
LLAMA_MOE_API void    llama_moe_set_sched_async_cpu(struct llama_context * ctx, int32_t on);
LLAMA_MOE_API int32_t llama_moe_get_sched_async_cpu(const struct llama_context * ctx);

// --- layer-major prompts ---
// A decode call of at least LLAMA_LAYER_MAJOR_MIN_UBATCHES ubatches (default 2) whose layers read host weights (the
// experts of --cpu-moe, -ncmoe) is computed layer group by layer group: each group runs every ubatch of the call in
// order, and its host weights are uploaded once for the call, not once per ubatch. Logits, the KV cache and what
// later calls see are the same bytes as in ubatch order. Groups hold as many layers as the staging budget allows on
// the device that stages every copy (the set budget, else half that device's free memory beyond the prefetch headroom
// when the context first plans, at least what --fit reserved). Off for calls with an eval callback, embeddings, and
// recurrent or hybrid memory, said once per context. Precedence: per-context setter > process default (set below, or
// --layer-major-prompt) > LLAMA_LAYER_MAJOR_PROMPT > on. Process default: 0 off, 1 on, -1 unsets it. Per context: 0 or
// 1; -1 takes the process default again.
LLAMA_MOE_API void    llama_moe_default_set_layer_major_prompt(int32_t on);
LLAMA_MOE_API int32_t llama_moe_default_get_layer_major_prompt(void);
LLAMA_MOE_API void    llama_moe_set_layer_major_prompt(struct llama_context * ctx, int32_t on);
LLAMA_MOE_API int32_t llama_moe_get_layer_major_prompt(const struct llama_context * ctx);
// The staging budget of layer groups in MiB, on the device that stages their copies (the GPU the scheduler offloads
// host experts to: llama_moe_layer_major_staging_device), read when a context first plans its groups: > 0 sets it, 0
// auto, -1 unsets it (then LLAMA_LAYER_MAJOR_STAGING_MIB, then auto). The getter returns the value in effect.
LLAMA_MOE_API void    llama_moe_default_set_layer_major_staging_mib(int64_t mib);
LLAMA_MOE_API int64_t llama_moe_default_get_layer_major_staging_mib(void);
// The least staging budget that lets this model's prompts run layer-major where its experts stay on the host: twice
// the feed-forward tensors of its largest layer with experts (what --cpu-moe, -ncmoe and --fit keep on the host, and
// all of them where --fit keeps only a layer's attention on a device), one group computing while the next one's
// upload goes into the other region; in bytes, 0 where the model has no experts or its architecture no layer groups.
LLAMA_MOE_API size_t  llama_moe_layer_major_least_staging(const struct llama_model * model);
// The index of the model's device (llama_model_get_device) that computes ubatches of n_ubatch tokens with experts kept
// on the host, and so whose host-weight prefetch (where on) stages their copies: of each expert tensor's type and shape,
// the first device that supports and takes its product (ggml_backend_sched's offload rule), and of those devices the
// one that takes the most expert bytes (a device without kernels for some types leaves them to another or the CPU).
// Every expert tensor counts, as if on the host, wherever it is: --fit asks before it places them. -1 for none (the
// CPU computes them, or a backend reads them where they are) or a model without experts.
LLAMA_MOE_API int32_t llama_moe_layer_major_staging_device(const struct llama_model * model, uint32_t n_ubatch);
// The staging budget --fit kept free for layer groups in MiB, on the named device (the one that stages host weights):
// a context created after it takes it as the floor of its auto budget where it stages on that device, as far as the
// device's free memory and the prefetch's ring leave the headroom free (a set budget is what was set). mib >= 0 sets
// it, -1 unsets it (device ignored); each --fit sets it or unsets it. The getter returns the MiB in effect, 0 for none.
LLAMA_MOE_API void    llama_moe_default_set_layer_major_fit_reserve_mib(const char * device, int64_t mib);
LLAMA_MOE_API int64_t llama_moe_default_get_layer_major_fit_reserve_mib(void);

// --- statistics ---
// Counters of the context's scheduler since it was last reserved or the stats were reset.
struct llama_moe_stats {
    uint64_t n_graph_computes;      // graph computations (one per ubatch)
    uint64_t n_splits;              // graph splits computed
    uint64_t n_splits_host_input;   // splits that copied an input from host memory to a device at split time
    uint64_t n_host_syncs;          // times the scheduler blocked the calling thread on a device
    uint64_t n_host_syncs_upload;   // ... of them, to copy inputs from host memory to a device
    uint64_t n_prefetch_uploads;    // weight copies uploaded ahead on a staging queue
    uint64_t prefetch_upload_bytes; // bytes of those uploads
    uint64_t n_async_cpu_splits;    // CPU splits computed on the worker thread (asynchronous CPU splits)
    uint64_t n_async_cpu_joins_waited; // ... joins that found the worker still computing, so the caller waited
    uint64_t prefetch_kept_bytes;   // weight-copy bytes found in the staging arena and not uploaded again
    uint64_t prefetch_staged_bytes; // ... of the uploads, bytes staged ahead of their graph (the next layer group's)
    uint64_t n_layer_major_calls;   // decode calls computed layer-major (since the context was made)
    uint64_t layer_major_upload_bytes;      // host-weight bytes those calls uploaded
    uint64_t layer_major_last_upload_bytes; // ... the last of them
    uint64_t n_graph_reallocs;      // graph allocations that reserved the compute buffers again (each waits for every
                                    // device queue): a graph that did not fit the reservation, or a changed placement
    uint64_t n_reserves_in_place;   // reservations that did not wait for the queued work (a layer group's graph reserved
                                    // while the group before computes, where the compute buffers hold it)
    uint64_t n_empty_inputs;        // graph-split inputs of no bytes in splits whose every node is empty, neither
                                    // copied nor waited for (e.g. the last layer's rows of a ubatch without outputs,
                                    // whose host experts the CPU computes for no token)
};

LLAMA_MOE_API void llama_moe_get_stats  (const struct llama_context * ctx, struct llama_moe_stats * stats);
LLAMA_MOE_API void llama_moe_reset_stats(struct llama_context * ctx);

// --- pinned host experts ---
// Pinned host experts. Expert weights that stay on the host and are mmap'ed from the model file are pageable,
// and a GPU uploads pageable memory several times slower than page-locked memory, without overlap. When on,
// loading a model with a GPU whose backend can page-lock host memory registers the mapped expert range with it
// (each context of the model holds a reference too); if that fails, the experts are copied once into the GPU's
// pinned host memory when they fit in the memory available (MemAvailable and cgroup limits, minus a margin of
// max(2 GiB, 1/16 of the total), env LLAMA_MOE_PIN_MARGIN_MIB overrides it; env LLAMA_MOE_PIN_FS_ROOT, for tests, reads
// /proc and /sys under another directory), else they stay pageable. The path
// taken is logged once per model ("llama_moe: ..."). Computes the same bytes either way.
// Process-wide default, read when a model is loaded: 1 on, 0 off, -1 unset (then the environment variable
// LLAMA_MOE_PIN_EXPERTS, then on). The getter returns the value in effect (0 or 1).
LLAMA_MOE_API void    llama_moe_default_set_pin_experts(int32_t on);
LLAMA_MOE_API int32_t llama_moe_default_get_pin_experts(void);
// The most expert memory a model page-locks in place, in MiB. Page-locked pages cannot be reclaimed, so a model
// whose experts exceed the memory available (MemAvailable and cgroup limits, less the margin above) pins only
// what fits, whole ranges in file order that no host tensor straddles, and leaves the rest pageable; the log
// line says how much and why not more. Process-wide default, read when a model is loaded: >= 0 caps the budget
// (it never exceeds what is available), -1 unset (then the environment variable LLAMA_MOE_PIN_BUDGET_MIB, then
// only the memory available). GGML_CUDA_NO_PINNED (ggml-cuda's switch for pinned host memory) turns pinning
// off as well. The getter returns the value in effect (-1: none).
LLAMA_MOE_API void    llama_moe_default_set_pin_budget_mib(int64_t mib);
LLAMA_MOE_API int64_t llama_moe_default_get_pin_budget_mib(void);

// --- MoE expert cache ---
// Device banks of expert slots for the MoE layers whose experts stay on the host (--cpu-moe, -ncmoe): a graph of
// at most LLAMA_MOE_CACHE_DECODE_MAX tokens (default 8) whose experts fit a layer's slots reads that layer's experts
// from its banks; the router's ids are read back, a CLOCK plan (never evicting a slot the same ubatch uses) picks the
// slots, and the misses are uploaded from the host before the matmuls. Larger graphs use the host weights as before.
// Slots are shared out equally across the layers of a device (at least n_expert_used each, or no cache). The banks are
// counted with the context's memory in the memory breakdown; a budget above the device's free memory less 512 MiB is
// shrunk to it with a warning; a model with no host experts gets no cache, said once. Computes the same bytes as the
// weights read on the device. Budget per device in MiB, process-wide default read when a context is created: >= 0
// sets it (0 off), -1 unsets it (then LLAMA_MOE_CACHE_MIB, then 0). The getter returns the value in effect.
LLAMA_MOE_API void    llama_moe_default_set_moe_cache_mib(int64_t mib);
LLAMA_MOE_API int64_t llama_moe_default_get_moe_cache_mib(void);
// Per context: replaces the context's cache by one of this budget (>= 0; 0 removes it; -1: the process default);
// its residents and counters start over, and the graphs are rebuilt at the next decode. The getter returns the
// budget the context's cache was made with, 0 when it has none (off, or nothing to cache: the log says why).
LLAMA_MOE_API void    llama_moe_set_moe_cache_mib(struct llama_context * ctx, int64_t mib);
LLAMA_MOE_API int64_t llama_moe_get_moe_cache_mib(const struct llama_context * ctx);

// Seeding: the last ubatch of a decode call that uploads its experts ahead (a prompt's last large ubatch) reads its
// routing back once per cached layer and copies the experts of the highest scores from the staged copies into the
// slots on the device, so that the first decode tokens hit. A prompt's tail decoded as its own small batch (uploaded
// nothing ahead) keeps the seeded set. That ubatch is computed in pieces (a synchronization at each cached layer's
// routing and at each split's end); with -b equal to -ub every call seeds. Process-wide default read when a cache is made: 1 on, 0 off, -1
// unsets it (then LLAMA_MOE_CACHE_SEED, then on). LLAMA_MOE_CACHE_DEBUG_CHECK_SEED=1 compares every resident slot of
// the seeded layers with its host expert byte for byte once the graph is done and logs the result (a synchronization
// and a read of those slots per seeded graph).
LLAMA_MOE_API void    llama_moe_default_set_moe_cache_seed(int32_t on);
LLAMA_MOE_API int32_t llama_moe_default_get_moe_cache_seed(void);

// Probes of the cache's own cost (debug; the results' benchmarks use them as rows). 1: every cached layer keeps at most
// n_expert - 1 slots, so decode looks up and fills a few misses wherever it would have read a whole layer in place
// (each layer's slots are logged); 2: a layer with a slot per expert is never read in place, so once its experts are
// resident every decode step looks it up (all hits, no fills: the lookup's pure overhead). 0: off. Process-wide
// default read when a cache is made; -1 unsets it (then LLAMA_MOE_CACHE_PROBE, then 0).
LLAMA_MOE_API void    llama_moe_default_set_moe_cache_probe(int32_t probe);
LLAMA_MOE_API int32_t llama_moe_default_get_moe_cache_probe(void);

// Miss policy: what a cached layer's decode step does with a routed expert that is not resident (docs/hot-cold.md).
// UPLOAD: every miss is uploaded into a slot and read from the banks (a batch whose experts may not fit the slots
// computes them hot/cold, as below, where the device can). CPU: no decode uploads; the residents come from prompts,
// seeding and profiles, and the misses are computed on the CPU from the host weights while the GPU computes the hits
// (hot/cold). SPLIT: at most n uploads per layer step (1..4096), the first n misses in routing order (token by token,
// each token's experts highest score first); the rest on the CPU. Needs a device that looks the slots up and computes
// masked expert ids (ggml-dev-caps.h); elsewhere the layer uploads every miss, said once. Process-wide default read
// when a cache is made: kind >= 0 sets it, -1 unsets it (then LLAMA_MOE_MISS_POLICY, then UPLOAD); a kind or n out of
// range is refused with an error line and leaves it as it was. The getters return the kind, and n through *n.
enum llama_moe_miss_policy {
    LLAMA_MOE_MISS_UPLOAD = 0,
    LLAMA_MOE_MISS_CPU    = 1,
    LLAMA_MOE_MISS_SPLIT  = 2,
};
LLAMA_MOE_API void    llama_moe_default_set_moe_miss_policy(int32_t kind, int32_t n);
LLAMA_MOE_API int32_t llama_moe_default_get_moe_miss_policy(int32_t * n);
// The policy of a context's cache (UPLOAD where it has none).
LLAMA_MOE_API int32_t llama_moe_get_moe_miss_policy(const struct llama_context * ctx, int32_t * n);
// Parses "upload", "cpu" or "split:N" (the flag's and the environment variable's spelling): 0 and *kind, *n set, or
// -1 (text not one of them, or N out of 1..4096)
LLAMA_MOE_API int32_t llama_moe_parse_miss_policy(const char * text, int32_t * kind, int32_t * n);

// Profile: a GGUF file of per-layer expert use counts (pyllama_moe.expert_cache_profile, version 1). When a cache is
// made and the file is there and was made for this model (architecture, shape and a hash of the routers), each cached
// layer that is not filled whole starts with the experts of the highest counts in its slots, uploaded once on the
// calling thread (logged: "expert cache profile FILE: N layers filled, K experts (X MiB) in T s"); a prompt's seeding
// still replaces them at its end. Counted: each decode lookup that planned adds 1 to each distinct expert it routed
// (host-side plan and device lookup alike), each seeding ubatch its routed tokens; steps read in place or on the staging
// path are not counted. When the context's cache is freed, the file's counts plus this context's are written back
// atomically (a temporary file beside it, renamed over FILE, with the old file's mode; a new file gets 0644 less the
// umask), where it counted anything; a failed write logs one error and leaves the old file. A relative path names its
// place when the cache is made, not when it is written. A file made for another model, of another version, or not a profile (corrupt, truncated, not GGUF) is
// refused with one error line naming it, what is wrong and the fix: the cache is made as without a profile and the
// file is never overwritten. A missing file is a first run. Residency alone changes: the bytes computed are the same.
// Process-wide default read when a cache is made: a path sets it, NULL or "" unsets it (then LLAMA_MOE_CACHE_PROFILE,
// then none). The getter returns the path in effect or NULL, valid until the next call of the getter on this thread.
LLAMA_MOE_API void         llama_moe_default_set_moe_cache_profile(const char * path);
LLAMA_MOE_API const char * llama_moe_default_get_moe_cache_profile(void);

// --fit with the expert cache (common/fit-moe-cache.h): with a budget asked for and a model that does not fit, --fit
// measures the model with every expert on the host and gives each device's room (free memory less the measurement,
// the prefetch staging and the target) to the cache first, up to the budget, and what is left to whole layers; where a
// device's room cannot hold n_expert_used slots in each of its host layers it places layers as without a cache. It
// caps each device's cache at the room it planned, by the device's ggml name ("CUDA0", "SIM1"): a cache made later
// takes min(budget, cap) there, none at a cap of 0; the first cache made on the device takes the cap with no margin
// of its own (--fit measured the compute buffers, the staging and the target), later ones (other contexts) also keep
// the cache's 512 MiB margin. >= 0 sets a cap, -1 removes it (device NULL and -1: every cap); setting the process
// budget (llama_moe_default_set_moe_cache_mib) removes every cap. The getter returns the cap in effect, -1 for none.
LLAMA_MOE_API void    llama_moe_default_set_moe_cache_device_cap_mib(const char * device, int64_t mib);
LLAMA_MOE_API int64_t llama_moe_default_get_moe_cache_device_cap_mib(const char * device);

// What a cache needs on one device of a model as placed (also a model loaded with no_alloc, as --fit loads it): the
// MoE layers computed on the device whose experts are on the host and could be cached. Fields may be appended.
struct llama_moe_cache_need {
    int32_t n_layers;       // such layers
    int32_t n_expert;       // experts per layer
    int32_t n_expert_used;  // the most experts a token of one of them routes to
    size_t  min_bytes;      // the least budget: n_expert_used slots in each, with its slot map and lookup state
    size_t  full_bytes;     // a slot for every expert of each
    size_t  largest_tensor; // the largest expert tensor among them (a prompt's prefetch stages one per split)
};
// Returns the number of such layers (0: *out is zeroed but n_expert); device by its ggml name, NULL: no layers.
LLAMA_MOE_API int32_t llama_moe_cache_need_on(const struct llama_model * model, const char * device,
        struct llama_moe_cache_need * out);

// Counters of a context's cache since it was created: per layer (il >= 0) or summed over layers (il < 0), and phase
// (0 prompt, 1 decode). Experts are counted once per ubatch and layer; bytes over all of a layer's expert tensors.
// Fields may be appended: callers compile against this header (cffi reads it).
struct llama_moe_cache_counters {
    uint64_t n_ubatches;     // layer steps: planned, on the staging path, or read in place
    uint64_t n_hits;         // routed experts found resident
    uint64_t n_misses;       // routed experts uploaded from the host
    uint64_t n_overflow;     // steps on the staging path (experts that may not fit the slots, or more tokens than
                             // the device computes from a bank with the whole weight's bytes: docs/cache-paths.md)
    uint64_t n_fills;        // experts made resident
    uint64_t n_evictions;    // ... of them into a slot that held another expert
    uint64_t bytes_uploaded; // host -> device
    uint64_t bytes_copied;   // device -> device
    uint64_t n_copy_calls;   // copies issued: one per run of consecutive experts into consecutive slots and tensor
    uint64_t n_in_place;     // steps of a layer with every expert resident, read in place (no plan, no read back)
    uint64_t n_routed_in_place; // ... the expert ids those steps routed, all of them hits (n_tokens x top-k a step,
                                // repeats included: a hit rate over routed ids, exact for steps of one token)
    uint64_t n_seeded;       // prompt: experts made resident by seeding (also in n_fills)
};

// Returns the number of layers the context caches (0: no cache; *out is zeroed). An il without a cache gives zeros.
LLAMA_MOE_API int32_t llama_moe_cache_get_counters(const struct llama_context * ctx, int32_t il, int32_t phase,
        struct llama_moe_cache_counters * out);
// Decode misses of layer il (< 0: all cached layers) computed on the CPU instead of uploaded (hot/cold: those the miss
// policy does not upload, and the experts past the slots), counted once per distinct expert and layer step, as
// n_misses counts the uploaded ones. Reads the device lookups' counters back first, as llama_moe_cache_get_counters.
LLAMA_MOE_API uint64_t llama_moe_cache_get_cold_misses(const struct llama_context * ctx, int32_t il);

// The path a cached layer took in a graph computed (docs/cache-paths.md: which batches take which, where they compute
// and whose bytes they equal). Every graph bound counts one step per cached layer, in the phase of its size.
enum llama_moe_cache_path {
    LLAMA_MOE_CACHE_PATH_IN_PLACE  = 0, // every expert resident: the banks read with the router's ids
    LLAMA_MOE_CACHE_PATH_DEVICE    = 1, // the slots looked up and the misses filled on the device
    LLAMA_MOE_CACHE_PATH_HOST_PLAN = 2, // the slots planned on the host (the router's ids read back), misses uploaded
    LLAMA_MOE_CACHE_PATH_STAGING   = 3, // a decode-size graph whose experts may not fit the slots: the host weights
    LLAMA_MOE_CACHE_PATH_HOST      = 4, // a larger graph, the layer not read in place: the host weights
    LLAMA_MOE_CACHE_PATH_HOT_COLD  = 5, // looked up on the device, the cold experts on the CPU beside the hot ones
    LLAMA_MOE_CACHE_PATH_COUNT     = 6,
};
// Steps per path (steps[LLAMA_MOE_CACHE_PATH_COUNT]) of layer il (< 0: all) and phase (0 prompt, 1 decode) since the
// cache was made; returns the number of layers the context caches (0: steps zeroed).
LLAMA_MOE_API int32_t llama_moe_cache_get_path_steps(const struct llama_context * ctx, int32_t il, int32_t phase,
        uint64_t * steps);
// Bytes of the context's banks, over its devices.
LLAMA_MOE_API size_t  llama_moe_cache_size(const struct llama_context * ctx);

// --- END CFFI ---

#ifdef __cplusplus
}
#endif
