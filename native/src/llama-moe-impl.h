// llama-moe-impl.h: what llama.cpp's own sources need from pyllama_moe's additions (not a public header).
#pragma once

#include "ggml-backend.h"

#include <string>

// the host-weight prefetch settings a new context starts from: process default (llama-moe.h setter or a
// llama.cpp flag), else the environment, else ggml's built-in values
ggml_backend_sched_prefetch_params llama_moe_prefetch_context_defaults();

// whether a new context computes CPU splits on a worker thread: process default (llama-moe.h setter or
// --sched-async-cpu), else GGML_SCHED_ASYNC_CPU, else off
bool llama_moe_sched_async_cpu_context_default();

// a whole number in [lo, hi] from the environment variable name, else -1: unset, or not such a number (then said
// through the log; callers read it once)
int64_t llama_moe_env_whole(const char * name, int64_t lo, int64_t hi);

// whether a tensor of this name is an expert weight: what --cpu-moe, -ncmoe and --fit keep in host memory
bool llama_moe_is_expert_tensor(const std::string & name);

// the expert cache budget per device in MiB a new context takes: process default (llama-moe.h setter or
// --moe-cache-mib), else LLAMA_MOE_CACHE_MIB, else 0 (off)
int64_t llama_moe_cache_context_mib();

// the cap --fit set on the expert cache of device dev (ggml name) in MiB, or -1: none (llama-moe.h,
// llama_moe_default_set_moe_cache_device_cap_mib); *first: no cache made on dev took it before (the room --fit planned
// is for one cache), and from now on one has
int64_t llama_moe_cache_take_device_cap_mib(const char * dev, bool * first);

// whether a new cache seeds at a prompt's end: process default (llama-moe.h setter or --moe-cache-seed), else
// LLAMA_MOE_CACHE_SEED, else on
bool llama_moe_cache_context_seed();

// the probe a new cache runs (llama-moe.h, llama_moe_default_set_moe_cache_probe): process default, else
// LLAMA_MOE_CACHE_PROBE, else 0
enum llama_moe_cache_probe {
    LLAMA_MOE_CACHE_PROBE_OFF         = 0,
    LLAMA_MOE_CACHE_PROBE_SLOTS_BELOW = 1, // at most n_expert - 1 slots a layer
    LLAMA_MOE_CACHE_PROBE_LOOKUP_ALL  = 2, // no layer read in place
};
int32_t llama_moe_cache_context_probe();

// the miss policy a new cache follows (llama-moe.h, llama_moe_default_set_moe_miss_policy): process default, else
// LLAMA_MOE_MISS_POLICY, else upload; as the most misses a lookup fills (GGML_MOE_CACHE_FILL_ALL, 0, N)
int32_t llama_moe_cache_context_max_fills();

// the expert cache profile a new cache reads and writes: process default (llama-moe.h setter or --moe-cache-profile),
// else LLAMA_MOE_CACHE_PROFILE, else none (empty)
std::string llama_moe_cache_context_profile();

// LLAMA_MOE_CACHE_DEBUG_CHECK_SEED=1 (read once): every seeded slot is compared with its host expert once its graph
// is done, and the result logged. Unset or 0: off.
bool llama_moe_cache_debug_check_seed();

// LLAMA_MOE_CACHE_DEBUG_SKIP_FILL=N (read once): the N-th fill of the cache is planned but never uploaded, so a slot
// keeps stale bytes; a planted fault the identity cells must catch. Unset or 0: off.
uint64_t llama_moe_cache_debug_skip_fill();

// LLAMA_MOE_CACHE_DEBUG_KEEP_STOPPED=1 (read once): a graph an eval callback stopped after a device lookup keeps the
// lookup's slot state although its fills may not have run (the cache is otherwise emptied): a planted fault the
// stopping-callback test must catch. Unset or 0: off.
bool llama_moe_cache_debug_keep_stopped();

// LLAMA_MOE_DEBUG_SLOWDOWN_PCT=N (read once): at the end of each compute cycle (first decode after a
// synchronization up to the next synchronization), wait N% of the cycle's time. A planted loss for testing
// that benchmark statistics see a small slowdown; never for use. Unset or 0: returns at once.
void llama_moe_debug_slowdown(int64_t cycle_us);

// LLAMA_MOE_DEBUG_DECODE_TIMES=N (read once): for the first N ubatches of at most 8 tokens after each larger one (the
// first decode steps after a prompt), one stderr line per ubatch with the host time of each of its steps, to tell
// where the first tokens after a prompt spend what the steady ones do not. Unset or 0: off (one load of a flag).
bool llama_moe_debug_decode_times_on();
// a ubatch of n_tokens was processed: t_* are ggml_time_us() at its start, after its graph was built (t_graph: where
// it was reused, equal to t_built), after it was allocated (t_built), after its inputs were set, after the expert
// cache bound it, and after the compute was queued; cache_sync_us / cache_upload_us: the parts of the bind spent
// waiting for earlier work and uploading slot states
void llama_moe_debug_decode_times(int64_t n_tokens, bool reused, int64_t t_start, int64_t t_graph, int64_t t_built,
        int64_t t_inputs, int64_t t_bound, int64_t t_queued, int64_t cache_sync_us, int64_t cache_upload_us);
// llama_context::synchronize waited sync_us for the queued work of the ubatches above
void llama_moe_debug_decode_sync(int64_t sync_us);
