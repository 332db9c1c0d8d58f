// llama-moe-cache-profile.h (internal): the expert cache profile (pyllama_moe): how often each cached
// layer routed to each of its experts, kept in a small GGUF file across processes, so that a new cache starts with
// the experts a model uses most (llama-moe-cache-rt.h, "Profiles").
//
// The file (version 1), written with ggml's gguf API and read by Python's `gguf` package (pyllama_moe/profile.py):
//   pyllama_moe.profile.format         string "pyllama_moe.expert_cache_profile"
//   pyllama_moe.profile.version        u32 1
//   pyllama_moe.profile.arch           string, the model's architecture (llama.cpp's name)
//   pyllama_moe.profile.n_layer        u32
//   pyllama_moe.profile.n_expert       u32
//   pyllama_moe.profile.n_expert_used  u32 (the most of any layer)
//   pyllama_moe.profile.router_hash    u64, the fingerprint of the routers (llama_moe_cache_profile_id_of)
//   pyllama_moe.profile.n_runs         u32, the contexts whose counts it holds
//   tensor "decode"  I32 [n_expert, n_layer] (numpy shape (n_layer, n_expert)): per layer and expert, the decode
//                    lookups that routed to it (each distinct expert once per lookup); 0 where a layer had no cache
//   tensor "prompt"  I32 [n_expert, n_layer]: the routed tokens of the prompt ubatches that seeded a layer
// Counts saturate at INT32_MAX; a negative count is a corrupt file.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

struct llama_model;

// what a profile must have been made for
struct llama_moe_cache_profile_id {
    std::string arch;
    uint32_t    n_layer       = 0;
    uint32_t    n_expert      = 0;
    uint32_t    n_expert_used = 0;
    uint64_t    router_hash   = 0;
};

struct llama_moe_cache_profile {
    llama_moe_cache_profile_id id;
    uint32_t n_runs = 0;
    std::vector<int32_t> decode; // [n_layer * n_expert], layer-major
    std::vector<int32_t> prompt;
};

// the model's identity: shape, and a 64-bit hash over each MoE layer's router (ffn_gate_inp: its type, shape and
// bytes, read from wherever it lives), which decide the routing
llama_moe_cache_profile_id llama_moe_cache_profile_id_of(const llama_model & model);

// "arch qwen3moe, 4 layers, 16 experts (top-4), router hash 0123456789abcdef"
std::string llama_moe_cache_profile_describe(const llama_moe_cache_profile_id & id);

enum llama_moe_cache_profile_status {
    LLAMA_MOE_CACHE_PROFILE_LOADED,
    LLAMA_MOE_CACHE_PROFILE_MISSING, // no file at path: a first run
    LLAMA_MOE_CACHE_PROFILE_REFUSED, // why says what is wrong (after "it ...") and fix what to do
};

// reads the profile at path for the model of id into out (zeros of id's shape unless LOADED). What is not a regular
// file, or is larger than a profile of the model can be, is refused unread; nothing it reads ends the process
llama_moe_cache_profile_status llama_moe_cache_profile_read(const std::string & path, const llama_moe_cache_profile_id & id,
        llama_moe_cache_profile & out, std::string & why, std::string & fix);

// writes p to path atomically: a temporary file of its own in the same directory (path.tmp.XXXXXX), synced to the disk,
// then renamed over path; false (why: what failed, the temporary file removed, path untouched) on any error
bool llama_moe_cache_profile_write(const std::string & path, const llama_moe_cache_profile & p, std::string & why);

// held over a read, merge and write of the profile at path, so that processes sharing the file add their counts
// instead of the last one's rename dropping the others' (an exclusive flock on the file's directory; where it cannot
// be taken, or on Windows, nothing is locked beyond the caller's own mutex)
struct llama_moe_cache_profile_lock {
    explicit llama_moe_cache_profile_lock(const std::string & path);
    ~llama_moe_cache_profile_lock();
    llama_moe_cache_profile_lock(const llama_moe_cache_profile_lock &) = delete;
    llama_moe_cache_profile_lock & operator=(const llama_moe_cache_profile_lock &) = delete;
private:
    int fd = -1;
};
