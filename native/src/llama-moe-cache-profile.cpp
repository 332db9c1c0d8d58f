// llama-moe-cache-profile.cpp: the expert cache profile's file; see llama-moe-cache-profile.h.
#include "llama-moe-cache-profile.h"

#include "llama-model.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "gguf.h"

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <system_error>

#ifdef _WIN32
#include <process.h>
#define MOE_PROFILE_PID() _getpid()
#else
#include <fcntl.h>
#include <random>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

static const char * const KEY_FORMAT   = "pyllama_moe.profile.format";
static const char * const KEY_VERSION  = "pyllama_moe.profile.version";
static const char * const KEY_ARCH     = "pyllama_moe.profile.arch";
static const char * const KEY_N_LAYER  = "pyllama_moe.profile.n_layer";
static const char * const KEY_N_EXPERT = "pyllama_moe.profile.n_expert";
static const char * const KEY_N_USED   = "pyllama_moe.profile.n_expert_used";
static const char * const KEY_HASH     = "pyllama_moe.profile.router_hash";
static const char * const KEY_N_RUNS   = "pyllama_moe.profile.n_runs";
static const char * const FORMAT_NAME  = "pyllama_moe.expert_cache_profile";
static const uint32_t     VERSION      = 1;

// a 64-bit hash of a byte string: 8-byte words through a multiply-rotate mix (a fingerprint, not a cryptographic hash)
static uint64_t mix(uint64_t h, uint64_t w) {
    w *= 0x87c37b91114253d5ull;
    w  = (w << 31) | (w >> 33);
    h ^= w * 0x4cf5ad432745937full;
    h  = (h << 27) | (h >> 37);
    return h * 5 + 0x52dce729;
}

static uint64_t hash_bytes(uint64_t h, const uint8_t * p, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = mix(h, w);
    }
    uint64_t tail = 0;
    memcpy(&tail, p + i, n - i);
    return mix(mix(h, tail), n);
}

llama_moe_cache_profile_id llama_moe_cache_profile_id_of(const llama_model & model) {
    const llama_hparams & hp = model.hparams;
    llama_moe_cache_profile_id id;
    id.arch          = model.arch_name();
    id.n_layer       = hp.n_layer();
    id.n_expert      = hp.n_expert;
    id.n_expert_used = hp.n_expert_used_max();
    uint64_t h = 0x9e3779b97f4a7c15ull;
    std::vector<uint8_t> bytes;
    for (uint32_t il = 0; il < id.n_layer; il++) {
        const ggml_tensor * r = model.layers[il].ffn_gate_inp;
        if (r == nullptr || r->buffer == nullptr) {
            continue;
        }
        h = mix(mix(h, il), (uint64_t) r->type);
        for (int d = 0; d < GGML_MAX_DIMS; d++) {
            h = mix(h, (uint64_t) r->ne[d]);
        }
        // in host memory (a CPU buffer, repacked ones included, whose get_tensor may be missing): read in place, as
        // laid out there; on a device: copied back once, when a cache is made
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(r->buffer));
        if (ggml_backend_buffer_is_host(r->buffer) || (dev != nullptr && ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU)) {
            h = hash_bytes(h, (const uint8_t *) r->data, ggml_nbytes(r));
            continue;
        }
        bytes.resize(ggml_nbytes(r));
        ggml_backend_tensor_get(r, bytes.data(), 0, bytes.size());
        h = hash_bytes(h, bytes.data(), bytes.size());
    }
    id.router_hash = h;
    return id;
}

std::string llama_moe_cache_profile_describe(const llama_moe_cache_profile_id & id) {
    char buf[256];
    snprintf(buf, sizeof(buf), "arch %s, %u layers, %u experts (top-%u), router hash %016" PRIx64, id.arch.c_str(),
            id.n_layer, id.n_expert, id.n_expert_used, id.router_hash);
    return buf;
}

// the value of key, or false where it is missing or of another type (gguf's getters assert on the type)
template <typename T>
static bool get_kv(const gguf_context * g, const char * key, gguf_type type, T (*get)(const gguf_context *, int64_t), T & v) {
    const int64_t k = gguf_find_key(g, key);
    if (k < 0 || gguf_get_kv_type(g, k) != type) {
        return false;
    }
    v = get(g, k);
    return true;
}

static bool get_u32(const gguf_context * g, const char * key, uint32_t & v) {
    return get_kv(g, key, GGUF_TYPE_UINT32, gguf_get_val_u32, v);
}

static bool get_str(const gguf_context * g, const char * key, std::string & v) {
    const char * s = nullptr;
    if (!get_kv(g, key, GGUF_TYPE_STRING, gguf_get_val_str, s)) {
        return false;
    }
    v = s;
    return true;
}

// the counts of tensor name: I32 [n_expert, n_layer], none negative
static bool get_counts(ggml_context * ctx, const char * name, const llama_moe_cache_profile_id & id, std::vector<int32_t> & out,
        std::string & why) {
    const ggml_tensor * t = ggml_get_tensor(ctx, name);
    char buf[160];
    if (t == nullptr || t->type != GGML_TYPE_I32 || t->ne[0] != id.n_expert || t->ne[1] != id.n_layer || t->ne[2] != 1 ||
            t->ne[3] != 1) {
        snprintf(buf, sizeof(buf), "is corrupt: no I32 tensor \"%s\" of [%u experts, %u layers]", name, id.n_expert, id.n_layer);
        why = buf;
        return false;
    }
    const int32_t * v = (const int32_t *) t->data;
    out.assign(v, v + (size_t) id.n_expert * id.n_layer);
    for (int32_t c : out) {
        if (c < 0) {
            snprintf(buf, sizeof(buf), "is corrupt: tensor \"%s\" holds a negative count (%d)", name, c);
            why = buf;
            return false;
        }
    }
    return true;
}

// the most bytes a profile of the model of id can take: its two count tensors, and room for the keys, the tensor infos
// and the alignment. A larger file is refused unread (a model or a disk image passed by mistake would otherwise be read
// into memory twice before its keys show that it is not a profile)
static uint64_t profile_max_bytes(const llama_moe_cache_profile_id & id) {
    return 2 * (uint64_t) id.n_layer * id.n_expert * sizeof(int32_t) + 64 * 1024;
}

static llama_moe_cache_profile_status read_checked(const std::string & path, const llama_moe_cache_profile_id & id,
        llama_moe_cache_profile & out, std::string & why, std::string & fix);

llama_moe_cache_profile_status llama_moe_cache_profile_read(const std::string & path, const llama_moe_cache_profile_id & id,
        llama_moe_cache_profile & out, std::string & why, std::string & fix) {
    out = {};
    out.id = id;
    out.decode.assign((size_t) id.n_layer * id.n_expert, 0);
    out.prompt.assign(out.decode.size(), 0);
    fix = "delete it (a new one is written when the context is freed) or pass another --moe-cache-profile (LLAMA_MOE_CACHE_PROFILE)";
    llama_moe_cache_profile_status status = LLAMA_MOE_CACHE_PROFILE_REFUSED;
    try {
        status = read_checked(path, id, out, why, fix);
    } catch (const std::exception & e) { // e.g. std::bad_alloc: a refusal, not the end of the process
        why = std::string("cannot be read (") + e.what() + ")";
    }
    if (status != LLAMA_MOE_CACHE_PROFILE_LOADED) {
        out.n_runs = 0;
        std::fill(out.decode.begin(), out.decode.end(), 0);
        std::fill(out.prompt.begin(), out.prompt.end(), 0);
    }
    return status;
}

static llama_moe_cache_profile_status read_checked(const std::string & path, const llama_moe_cache_profile_id & id,
        llama_moe_cache_profile & out, std::string & why, std::string & fix) {
    // what the path is, before opening it: opening a FIFO would block, a device or a model file would be read whole
    std::error_code ec;
    const std::filesystem::file_status st = std::filesystem::status(path, ec);
    if (st.type() == std::filesystem::file_type::not_found) {
        return LLAMA_MOE_CACHE_PROFILE_MISSING;
    }
    if (!ec && st.type() != std::filesystem::file_type::regular) {
        why = "is not a regular file";
        fix = "pass the path of a profile file (or of one to be written) to --moe-cache-profile (LLAMA_MOE_CACHE_PROFILE)";
        return LLAMA_MOE_CACHE_PROFILE_REFUSED;
    }
    const uint64_t max_bytes = profile_max_bytes(id);
    const uintmax_t size = std::filesystem::file_size(path, ec);
    char buf[512];
    if (!ec && size > max_bytes) {
        snprintf(buf, sizeof(buf), "is %ju bytes, more than a profile of this model can be (%" PRIu64 " bytes): not a profile",
                size, max_bytes);
        why = buf;
        return LLAMA_MOE_CACHE_PROFILE_REFUSED;
    }
    FILE * f = fopen(path.c_str(), "rb");
    if (f == nullptr) {
        if (errno == ENOENT) {
            return LLAMA_MOE_CACHE_PROFILE_MISSING;
        }
        why = std::string("cannot be read (") + strerror(errno) + ")";
        fix = "make it readable or pass another --moe-cache-profile (LLAMA_MOE_CACHE_PROFILE)";
        return LLAMA_MOE_CACHE_PROFILE_REFUSED;
    }
    // at most max_bytes + 1, whatever the size said: the file may grow between the two
    std::vector<uint8_t> data;
    uint8_t chunk[65536];
    for (size_t n; data.size() <= max_bytes && (n = fread(chunk, 1, sizeof(chunk), f)) > 0;) {
        data.insert(data.end(), chunk, chunk + n);
    }
    const bool read_error = ferror(f) != 0;
    fclose(f);
    if (read_error) {
        why = "cannot be read (an I/O error)";
        return LLAMA_MOE_CACHE_PROFILE_REFUSED;
    }
    if (data.size() > max_bytes) {
        snprintf(buf, sizeof(buf), "is more than %" PRIu64 " bytes, more than a profile of this model can be: not a profile", max_bytes);
        why = buf;
        return LLAMA_MOE_CACHE_PROFILE_REFUSED;
    }
    if (data.size() < 4 || memcmp(data.data(), "GGUF", 4) != 0) {
        why = "is not a GGUF file";
        return LLAMA_MOE_CACHE_PROFILE_REFUSED;
    }
    ggml_context * ctx = nullptr;
    gguf_context * g = gguf_init_from_buffer(data.data(), data.size(), { false, &ctx });
    if (g == nullptr) {
        why = "is truncated or corrupt (GGUF does not parse)";
        return LLAMA_MOE_CACHE_PROFILE_REFUSED;
    }
    llama_moe_cache_profile_status status = LLAMA_MOE_CACHE_PROFILE_REFUSED;
    std::string format;
    uint32_t version = 0;
    llama_moe_cache_profile_id got;
    if (!get_str(g, KEY_FORMAT, format) || format != FORMAT_NAME) {
        why = "is a GGUF file but not an expert cache profile (no " + std::string(KEY_FORMAT) + " \"" + FORMAT_NAME + "\")";
    } else if (!get_u32(g, KEY_VERSION, version) || version != VERSION) {
        snprintf(buf, sizeof(buf), "has format version %u, this build reads version %u", version, VERSION);
        why = buf;
    } else if (!get_str(g, KEY_ARCH, got.arch) || !get_u32(g, KEY_N_LAYER, got.n_layer) || !get_u32(g, KEY_N_EXPERT, got.n_expert) ||
            !get_u32(g, KEY_N_USED, got.n_expert_used) || !get_kv(g, KEY_HASH, GGUF_TYPE_UINT64, gguf_get_val_u64, got.router_hash) || !get_u32(g, KEY_N_RUNS, out.n_runs)) {
        why = "is corrupt: a key of the model's identity is missing or of another type";
    } else if (got.arch != id.arch || got.n_layer != id.n_layer || got.n_expert != id.n_expert ||
            got.n_expert_used != id.n_expert_used || got.router_hash != id.router_hash) {
        why = "was made for another model (" + llama_moe_cache_profile_describe(got) + "; this model: " +
              llama_moe_cache_profile_describe(id) + ")";
    } else if (get_counts(ctx, "decode", id, out.decode, why) && get_counts(ctx, "prompt", id, out.prompt, why)) {
        status = LLAMA_MOE_CACHE_PROFILE_LOADED;
    }
    gguf_free(g);
    ggml_free(ctx);
    return status;
}

#ifndef _WIN32
// the temporary file that replaces path, with the mode the profile is to have: the old file's (a profile shared
// between users stays shared; the umask does not narrow it), else 0644 less the umask, as a file the user creates.
// mkstemp would make it 0600 and the rename would turn a shared profile private. Returns the descriptor, or -1
static int create_beside(const std::string & path, std::string & tmp) {
    struct stat old_st;
    const bool replaces = stat(path.c_str(), &old_st) == 0;
    std::random_device rd;
    for (int attempt = 0; attempt < 64; attempt++) {
        char suffix[32];
        snprintf(suffix, sizeof(suffix), ".tmp.%08x%08x", (unsigned) rd(), (unsigned) rd());
        tmp = path + suffix;
        const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if (fd < 0 && errno == EEXIST) {
            continue;
        }
        if (fd >= 0 && replaces && fchmod(fd, old_st.st_mode & 07777) != 0) {
            const int err = errno;
            close(fd);
            remove(tmp.c_str());
            errno = err;
            return -1;
        }
        return fd;
    }
    errno = EEXIST;
    return -1;
}
#endif

bool llama_moe_cache_profile_write(const std::string & path, const llama_moe_cache_profile & p, std::string & why) {
    const llama_moe_cache_profile_id & id = p.id;
    const size_t n = (size_t) id.n_layer * id.n_expert;
    if (p.decode.size() != n || p.prompt.size() != n) {
        why = "the counts do not have the model's shape";
        return false;
    }
    ggml_init_params ip = { 2 * ggml_tensor_overhead() + 2 * n * sizeof(int32_t) + 1024, nullptr, false };
    ggml_context * ctx = ggml_init(ip);
    if (ctx == nullptr) {
        why = "out of memory";
        return false;
    }
    gguf_context * g = gguf_init_empty();
    gguf_set_val_str(g, KEY_FORMAT, FORMAT_NAME);
    gguf_set_val_u32(g, KEY_VERSION, VERSION);
    gguf_set_val_str(g, KEY_ARCH, id.arch.c_str());
    gguf_set_val_u32(g, KEY_N_LAYER, id.n_layer);
    gguf_set_val_u32(g, KEY_N_EXPERT, id.n_expert);
    gguf_set_val_u32(g, KEY_N_USED, id.n_expert_used);
    gguf_set_val_u64(g, KEY_HASH, id.router_hash);
    gguf_set_val_u32(g, KEY_N_RUNS, p.n_runs);
    const std::vector<int32_t> * counts[2] = { &p.decode, &p.prompt };
    const char * names[2] = { "decode", "prompt" };
    for (int i = 0; i < 2; i++) {
        ggml_tensor * t = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, id.n_expert, id.n_layer);
        ggml_set_name(t, names[i]);
        if (n > 0) {
            memcpy(t->data, counts[i]->data(), n * sizeof(int32_t));
        }
        gguf_add_tensor(g, t);
    }
    // a name of its own (random, created exclusively: unique across processes, also where two PID namespaces share a
    // directory), its bytes on the disk before the rename (else a crash could leave an empty file under the name,
    // which later runs refuse), and a rename that replaces the old file on Windows too
#ifdef _WIN32
    std::string tmp = path + ".tmp." + std::to_string((long long) MOE_PROFILE_PID());
    FILE * f = fopen(tmp.c_str(), "wb");
#else
    std::string tmp;
    const int fd = create_beside(path, tmp);
    FILE * f = fd >= 0 ? fdopen(fd, "wb") : nullptr;
    if (fd >= 0 && f == nullptr) {
        close(fd);
    }
#endif
    bool ok = false;
    if (f == nullptr) {
        why = "cannot create " + tmp + " (" + strerror(errno) + ")";
    } else {
        bool wrote = gguf_write_to_file_ptr(g, f, false) && fflush(f) == 0;
#ifndef _WIN32
        wrote = wrote && fsync(fileno(f)) == 0;
#endif
        const bool closed = fclose(f) == 0;
        std::error_code ec;
        if (!wrote || !closed) {
            why = "cannot write " + tmp + " (the disk may be full)";
        } else if (std::filesystem::rename(tmp, path, ec), ec) {
            why = "cannot rename " + tmp + " over it (" + ec.message() + ")";
        } else {
            ok = true;
        }
        if (!ok) {
            remove(tmp.c_str());
        }
    }
    gguf_free(g);
    ggml_free(ctx);
    return ok;
}

llama_moe_cache_profile_lock::llama_moe_cache_profile_lock(const std::string & path) {
#ifndef _WIN32
    // the directory, not a file beside the profile: nothing is left behind, and the profile itself is replaced by rename
    const std::filesystem::path dir = std::filesystem::path(path).parent_path();
    fd = open(dir.empty() ? "." : dir.c_str(), O_RDONLY);
    if (fd >= 0 && flock(fd, LOCK_EX) != 0) {
        close(fd);
        fd = -1;
    }
#else
    (void) path;
#endif
}

llama_moe_cache_profile_lock::~llama_moe_cache_profile_lock() {
#ifndef _WIN32
    if (fd >= 0) {
        flock(fd, LOCK_UN);
        close(fd);
    }
#endif
}
