// llama-moe-layer-major.h: layer-major prompts (docs/layer-major.md). A decode call of several ubatches whose layers
// read host weights computes layer group by layer group: each group runs every ubatch of the call in order, so the
// group's host weights are uploaded once (kept in the scheduler's staging arena, ggml_backend_sched_set_prefetch_keep)
// instead of once per ubatch. The hidden states of all the call's tokens wait between groups in host memory.
#pragma once

#include "ggml-backend.h"
#include "ggml-cpp.h"

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

struct llama_model;
struct llama_cparams;
struct llama_moe_cache_rt;

using llama_moe_layer_groups = std::vector<std::pair<int32_t, int32_t>>; // [il_begin, il_end) per group, in order

// LLAMA_LAYER_MAJOR_DEBUG_TIMES=1: the host time a layer group's graphs spent in each step of process_ubatch, summed,
// to tell a group whose device work bounds it from one whose host preparation of each graph does
struct llama_moe_layer_major_steps {
    int64_t n_graphs     = 0;
    int64_t n_reused     = 0;
    int64_t us_built     = 0; // graphs built (or found reusable)
    int64_t us_allocated = 0; // ... and allocated by the scheduler
    int64_t us_inputs    = 0; // inputs set on the host
    int64_t us_bound     = 0; // the expert cache's bind
    int64_t us_queued    = 0; // computes queued, the scheduler's waits for the uploads of host inputs included
    int64_t us_rows_wait = 0; // waits for the boundary rows' download by the group before
    std::map<std::string, int64_t> us_by_input; // us_inputs by the input's kind
};

struct llama_moe_layer_major {
    bool on = true; // the context's setting (llama_moe_set_layer_major_prompt)

    // the staging --fit kept free for this context when it was created (llama_moe_layer_major_init), and on which
    // device: a floor of the auto budget there only (a later fit, or another model's context, plans for itself)
    std::string fit_reserve_device;
    size_t      fit_reserve_bytes = 0;

    // the plan of the model's layers into groups, made on the first call that may take it and kept
    bool                   planned = false;
    llama_moe_layer_groups groups;     // empty: every call runs ubatch by ubatch
    std::string            why_plan;   // why the plan is empty (said once; "" when there is nothing to upload)
    std::set<std::string>  said;       // the reasons already logged by this context

    // staging ahead: each group's host weights by the backend that reads them, and each such backend's region (the
    // bytes of the largest group's kept copies there). With more than one group the staging arena holds two regions:
    // while a group's graphs read one, the next group's weights are uploaded into the other
    struct group_weights {
        ggml_backend_t              backend = nullptr;
        std::vector<ggml_tensor *>  list;      // in layer order
        std::vector<size_t>         layer_end; // the index in list after each layer's last weight
        size_t                      n_rows_only = 0; // the last entries of list, read by the output rows alone
    };
    std::vector<std::vector<group_weights>>        weights; // [group]
    std::vector<std::pair<ggml_backend_t, size_t>> regions;
    bool staging = false; // the call in progress stages ahead

    // the next group's stage in progress, queued in parts (llama_moe_layer_major_stage_part), per backend: the weights
    // it uploads (those the expert cache does not read in place), the cuts between its layers, and how far it got
    struct stage_progress {
        ggml_backend_t             backend = nullptr;
        std::vector<ggml_tensor *> list;
        std::vector<size_t>        layer_end;
        std::vector<size_t>        bytes_before; // [i]: the bytes of list[0, i)
        size_t                     next = 0;     // the first weight not queued yet
    };
    std::vector<stage_progress> stage;

    // the call in progress: the layers the next graph builds, and the boundary rows it reads
    int32_t            il_begin = 0;
    int32_t            il_end   = -1;  // -1: to the last layer
    const float *      rows = nullptr; // the current ubatch's rows in `hidden`

    // the boundary rows [n_tokens_call][n_embd]: each token's hidden state after the last group run. In the pinned
    // host memory of the device the groups run on where it has any: a copy to or from pageable memory makes the host
    // wait for the ubatch's compute, so it could not build the next graph meanwhile. Kept for later calls, so that a
    // prompt does not pin memory again; grown and never shrunk
    float *                  hidden     = nullptr;
    size_t                   hidden_cap = 0;       // floats
    ggml_backend_buffer_ptr  hidden_buf;           // the pinned memory, where it was had
    std::unique_ptr<float[]> hidden_pageable;      // ... else this

    // the downloads of the boundary rows, one event per ubatch of the call: a group's ubatch reads its rows (on the
    // host, when its inputs are set) once the group before has downloaded them, without waiting for the rest of that
    // group, so a group's first graph is prepared while the device still computes the group before. Each event belongs
    // to the device whose backend downloaded the rows last (the group's last layer's: with layers split across
    // devices, groups end on different ones). Where a device has no events the call's later groups end in a
    // synchronization instead (rows_ordered false)
    struct rows_download {
        ggml_backend_event_ptr done;              // recorded behind the download
        ggml_backend_dev_t     dev     = nullptr; // the device of `done`
        bool                   pending = false;   // recorded and not waited for yet
    };
    std::vector<rows_download> rows_downloads; // [ubatch]
    bool                       rows_ordered = true;

    // counters since the context was made or its stats were reset
    uint64_t n_calls           = 0;    // calls computed layer-major
    uint64_t upload_bytes      = 0;    // host-weight bytes those calls uploaded
    uint64_t kept_bytes        = 0;    // bytes they found in the staging arena instead of uploading again
    uint64_t last_upload_bytes = 0;    // ... uploaded by the last such call

    // LLAMA_LAYER_MAJOR_DEBUG_TIMES=1: the host times of the group in progress (ggml_time_us), reported at its end
    int64_t t_group    = 0; // the group began
    int64_t t_reserved = 0; // its reservation returned
    int64_t t_stage    = 0; // the stage of the next group's weights began (0: none)
    int64_t us_stage   = 0; // ... and took this long to queue
    ggml_backend_sched_stats stats_group = {}; // the scheduler's counters when the group began
    llama_moe_layer_major_steps steps;         // the group's graphs' host steps
};

// whether a new context computes long prompts layer-major: process default (llama-moe.h setter or
// --layer-major-prompt), else LLAMA_LAYER_MAJOR_PROMPT, else on
bool llama_moe_layer_major_context_default();

// a new context's settings: whether it computes long prompts layer-major, and the staging the last --fit kept free
void llama_moe_layer_major_init(llama_moe_layer_major & lm);

// the layer groups a decode call of n_tokens runs in, or none (the call runs ubatch by ubatch). Says once per context
// and reason why a call that could have been computed layer-major is not. can_rewind: the memory can run the call's
// ubatches again (llama_memory_context_i::can_rewind)
llama_moe_layer_groups llama_moe_layer_major_groups(llama_moe_layer_major & lm, const llama_model & model,
        ggml_backend_sched_t sched, const llama_cparams & cparams, uint32_t n_tokens, bool can_rewind);

// the start of a call of several groups: each backend's staging arena made to hold two regions; lm.staging says
// whether the call stages ahead
void llama_moe_layer_major_begin(llama_moe_layer_major & lm, ggml_backend_sched_t sched);

// the boundary rows of a call, n_floats values (lm.hidden, grown where it is smaller); nullptr where host memory lacks
// room. No copy into the old rows may be queued (a call synchronizes before it ends)
float * llama_moe_layer_major_rows(llama_moe_layer_major & lm, ggml_backend_sched_t sched, size_t n_floats);

// the download of ubatch u's boundary rows was queued on backend: recorded, so that the next group waits for it alone
void llama_moe_layer_major_rows_queued(llama_moe_layer_major & lm, ggml_backend_t backend, uint32_t u);

// before ubatch u's boundary rows are read: waits for their download by the group before
void llama_moe_layer_major_rows_wait(llama_moe_layer_major & lm, uint32_t u);

// group g's kept copies go to its region (the group's parity) in the graphs built next
void llama_moe_layer_major_enter(llama_moe_layer_major & lm, ggml_backend_sched_t sched, int32_t g);

// group g + 1's stage begins: on each copy queue after the computes queued so far (the group before g's read the region
// it overwrites), with nothing uploaded yet. Its weights follow in parts one ubatch behind (one after each of group g's
// ubatches, llama_moe_layer_major_stage_part), since uploads of all queues may wait in one line: a graph's input
// uploads wait behind whatever was queued before them. The last share is left to group g + 1's first graph, which
// uploads it after its own inputs (unless that graph is below the prefetch's min batch). cache: the context's expert
// cache (nullptr: none), which writes its layers' copies. n_outputs: the most output rows any ubatch of the call has;
// where the device takes no product of so few rows, the last group leaves out the weights read by them alone
void llama_moe_layer_major_stage_begin(llama_moe_layer_major & lm, ggml_backend_sched_t sched, int32_t g,
        llama_moe_cache_rt * cache, uint32_t n_outputs);

// the part of the stage in progress that brings it to at least `share` (0 to 1) of its bytes, rounded up to whole layers
// (the expert cache plans a layer's copies together); share 1: the rest. LLAMA_LAYER_MAJOR_DEBUG_STAGE_WHOLE: always 1
void llama_moe_layer_major_stage_part(llama_moe_layer_major & lm, ggml_backend_sched_t sched, llama_moe_cache_rt * cache,
        double share);

// LLAMA_LAYER_MAJOR_DEBUG_TIMES=1 (a measuring aid): whether each group's host times are logged
bool llama_moe_layer_major_debug_times_on();

// group g begins (its reservation is next): the debug clock starts
void llama_moe_layer_major_group_begin(llama_moe_layer_major & lm, ggml_backend_sched_t sched);

// group g's reservation returned
void llama_moe_layer_major_group_reserved(llama_moe_layer_major & lm);

// a graph of the group in progress was computed (queued): its host steps' times (ggml_time_us; t_graph 0: reused)
void llama_moe_layer_major_graph_timed(llama_moe_layer_major & lm, bool reused, int64_t t_start, int64_t t_graph,
        int64_t t_built, int64_t t_inputs, int64_t t_bound, int64_t t_queued);

// log the host steps of the graphs timed since the last call (what: the group they belong to), and start again
void llama_moe_layer_major_log_steps(llama_moe_layer_major & lm, const char * what);

// group g's ubatches are all queued. The next group goes on without waiting where every download of the boundary rows
// was recorded (each of its ubatches waits for its own rows); else this waits for the group's computes and the next
// group's stage. With LLAMA_LAYER_MAJOR_DEBUG_TIMES=1 it waits for the computes first, then for the copy queues, and
// logs where the group's time went: the wait for the computes shows a group that the device's compute bounds, the
// wait after it one whose next stage was still uploading (so the debug times time each group apart)
void llama_moe_layer_major_group_end(llama_moe_layer_major & lm, ggml_backend_sched_t sched, int32_t g, uint32_t n_ubatch);

// say once per context (at warning level) why a call that took layer-major order gave it up
void llama_moe_layer_major_say(llama_moe_layer_major & lm, const std::string & why);
