// llama-moe-paced-bench: load a model once, then time one llama-bench style repetition per stdin command.
//
// An A/B benchmark that starts a llama-bench process per build spends most of its time loading the model;
// with one of these processes per build loaded side by side, the caller can alternate single repetitions of
// the two builds (A B B A ...) without reloading. Built by pyllama_moe.paced against master and patched
// builds alike, so it uses only the public API of llama.h and ggml and links no llama-common or ggml-cpu.
//
// Protocol: `ready` on stdout once loaded, then one JSON line per stdin line:
//   pp [N]  -> {"kind": "pp", "n_tokens": N, "ns": T}   (N defaults to -p)
//   tg [N]  -> {"kind": "tg", "n_tokens": N, "ns": T}   (N defaults to -n)
//   tg-start   -> {"kind": "tg-start", "n_tokens": 0, "ns": 0}: clears the memory for a generation in chunks
//   tg-more K  -> {"kind": "tg-more", "n_tokens": K, "ns": T}: K more tokens of that generation, timed alone.
//                 A caller alternating the chunks of two processes pairs their samples within a second
//                 instead of within a whole repetition. After `pp N` the generation continues the prompt (its
//                 memory kept): `pp 4096` then `tg-more 16` times the first 16 tokens decoded after a prompt.
//   moe-cache-reset -> {"kind": "moe-cache-reset", "n_tokens": 0, "ns": T}: a fresh expert cache of the same budget
//                 (a patched build's llama_moe_set_moe_cache_mib; master has none), so that a repetition's prompt
//                 finds the cache as a new process would, not warmed by the last repetition
//   moe-cache-counters -> {"kind": "moe-cache-counters", "n_tokens": 0, "ns": 0, "hits": H, "misses": M}: the
//                 decode counters of the context's expert cache so far (hits include the ids of steps read in place)
// tg-more's reply also has "token_ns": the time of each of its tokens (after a prompt, the first is the first decode
// graph: a graph rebuilt, and on CUDA run without a CUDA graph; the second is captured into one), and "first_ns", the
// first of them.
//   other   -> {"error": "..."}, and the process keeps serving
//   quit or end of input -> exit 0 (no reply)

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "llama.h"

// the patched build's header (the driver compiles against master too, which has none)
#if __has_include("llama-moe.h")
#include "llama-moe.h"
#define PACED_HAS_MOE_CACHE 1
#endif

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

struct paced_params {
    std::string           model;
    int                   n_prompt     = 512;
    int                   n_gen        = 128;
    int                   n_batch      = 2048;
    int                   n_ubatch     = 512;
    int                   n_gpu_layers = 99;
    int                   n_cpu_moe    = 0;
    int                   n_threads    = 0; // 0: physical cores, as llama-bench
    int                   n_ctx        = 0; // 0: n_prompt + n_gen
    int                   poll         = 50;
    bool                  cpu_strict   = false;
    bool                  verbose      = false;
    std::string           cpu_mask     = "0x0";
    llama_load_mode       load_mode    = LLAMA_LOAD_MODE_AUTO;
    llama_flash_attn_type flash_attn   = LLAMA_FLASH_ATTN_TYPE_AUTO;
};

static void null_log(enum ggml_log_level level, const char * text, void * user_data) {
    (void) level; (void) text; (void) user_data;
}

static bool parse_int(const char * s, int min_value, int & out) {
    char * end = nullptr;
    long v = strtol(s, &end, 10);
    if (end == s || *end != '\0' || v < min_value || v > 1000000000L) {
        return false;
    }
    out = (int) v;
    return true;
}

// the last hex digit holds CPUs 0-3, as llama-bench's -C; all zeros leaves the affinity alone
static bool parse_cpu_mask(const std::string & s, bool (&mask)[GGML_MAX_N_THREADS]) {
    const size_t start    = s.size() >= 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X') ? 2 : 0;
    const size_t n_digits = s.size() - start;
    if (n_digits == 0 || n_digits * 4 > GGML_MAX_N_THREADS) {
        return false;
    }
    for (size_t k = 0; k < n_digits; k++) {
        const char c = s[s.size() - 1 - k];
        int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (v < 0) {
            return false;
        }
        for (int b = 0; b < 4; b++) {
            mask[k*4 + b] = mask[k*4 + b] || (v & (1 << b)) != 0;
        }
    }
    return true;
}

// llama-bench defaults -t to the physical core count: on Linux the number of distinct thread-sibling sets
// (it also drops efficiency cores on hybrid x86, which server CPUs do not have)
static int default_threads() {
    std::vector<std::string> seen;
    for (int cpu = 0; cpu < GGML_MAX_N_THREADS; cpu++) {
        char path[128];
        snprintf(path, sizeof(path), "/sys/devices/system/cpu/cpu%d/topology/thread_siblings", cpu);
        FILE * f = fopen(path, "r");
        if (!f) {
            break;
        }
        char buf[512] = {0};
        if (fgets(buf, sizeof(buf), f) && std::find(seen.begin(), seen.end(), buf) == seen.end()) {
            seen.emplace_back(buf);
        }
        fclose(f);
    }
    const int n = seen.empty() ? (int) std::thread::hardware_concurrency() : (int) seen.size();
    return n > 0 ? n : 4;
}

static const char * usage =
    "-m MODEL [-p N] [-n N] [-b N] [-ub N] [-ngl N] [-ncmoe N] [-lm auto|none|mmap|mlock|mmap+mlock|dio] [-t N] "
    "[-C HEXMASK] [--cpu-strict 0|1] [--poll 0-100] [-fa on|off|auto] [-c N] [-v]";

static bool parse_args(int argc, char ** argv, paced_params & p) {
    static const char * const with_value[] = {
        "-m", "-p", "-n", "-b", "-ub", "-ngl", "-ncmoe", "-lm", "-t", "-C", "--cpu-strict", "--poll", "-fa", "-c",
    };
    for (int i = 1; i < argc; i++) {
        const std::string arg = argv[i];
        if (arg == "-v") {
            p.verbose = true;
            continue;
        }
        if (std::find(std::begin(with_value), std::end(with_value), arg) == std::end(with_value)) {
            fprintf(stderr, "error: unknown argument '%s': usage: %s\n", arg.c_str(), usage);
            return false;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "error: %s needs a value: usage: %s\n", arg.c_str(), usage);
            return false;
        }
        const char * v = argv[++i];
        bool ok = true;
        if      (arg == "-m")            { p.model = v; }
        else if (arg == "-p")            { ok = parse_int(v, 0, p.n_prompt); } // 0, llama-bench's "no such test":
        else if (arg == "-n")            { ok = parse_int(v, 0, p.n_gen); }    // the command then needs its N
        else if (arg == "-b")            { ok = parse_int(v, 1, p.n_batch); }
        else if (arg == "-ub")           { ok = parse_int(v, 1, p.n_ubatch); }
        else if (arg == "-ngl")          { ok = parse_int(v, -1, p.n_gpu_layers); }
        else if (arg == "-ncmoe")        { ok = parse_int(v, 0, p.n_cpu_moe); }
        else if (arg == "-t")            { ok = parse_int(v, 1, p.n_threads); }
        else if (arg == "-c")            { ok = parse_int(v, 1, p.n_ctx); }
        else if (arg == "--poll")        { ok = parse_int(v, 0, p.poll) && p.poll <= 100; }
        else if (arg == "--cpu-strict")  { ok = !strcmp(v, "0") || !strcmp(v, "1"); p.cpu_strict = !strcmp(v, "1"); }
        else if (arg == "-C")            { bool m[GGML_MAX_N_THREADS] = {false}; ok = parse_cpu_mask(v, m); p.cpu_mask = v; }
        else if (arg == "-fa") {
            if      (!strcmp(v, "on")   || !strcmp(v, "1")) { p.flash_attn = LLAMA_FLASH_ATTN_TYPE_ENABLED; }
            else if (!strcmp(v, "off")  || !strcmp(v, "0")) { p.flash_attn = LLAMA_FLASH_ATTN_TYPE_DISABLED; }
            else if (!strcmp(v, "auto"))                     { p.flash_attn = LLAMA_FLASH_ATTN_TYPE_AUTO; }
            else { ok = false; }
        } else { // -lm: llama_load_mode_from_str throws on an unknown name, so match the names here
            ok = false;
            for (int m = LLAMA_LOAD_MODE_AUTO; m <= LLAMA_LOAD_MODE_DIRECT_IO; m++) {
                if (!strcmp(v, llama_load_mode_name((llama_load_mode) m))) {
                    p.load_mode = (llama_load_mode) m;
                    ok = true;
                }
            }
        }
        if (!ok) {
            fprintf(stderr, "error: bad value '%s' for %s: usage: %s\n", v, arg.c_str(), usage);
            return false;
        }
    }
    if (p.model.empty()) {
        fprintf(stderr, "error: no model given: pass -m MODEL.gguf\n");
        return false;
    }
    if (p.n_ctx == 0 && p.n_prompt + p.n_gen == 0) { // n_ctx 0 would be the model's training context
        fprintf(stderr, "error: -p 0 -n 0 leaves no context size: give -p, -n or -c a positive value\n");
        return false;
    }
    return true;
}

struct paced_state {
    llama_context *    ctx;
    llama_batch_ext *  batch;
    int                n_batch;
    int                n_ctx;
    int32_t            n_vocab;
    bool               add_bos;
    llama_token        bos;
    std::vector<llama_token> tokens;
    ggml_threadpool *  threadpool;
    int                gen_pos = -1; // next position of a chunked generation; -1: no tg-start since the last test
};

// one batch of sequence 0 at positions pos0.., logits for the last token only, as llama-bench's batches
static int decode(paced_state & st, int n, llama_pos pos0) {
    llama_batch_ext_clear(st.batch);
    for (int i = 0; i < n; i++) {
        const llama_pos pos[GGML_MROPE_SECTIONS] = { pos0 + i }; // text tokens read pos[0] only
        const int32_t idx = llama_batch_ext_add_token(st.batch, 0, st.tokens[i]);
        if (idx < 0 || !llama_batch_ext_set_pos(st.batch, idx, pos)) {
            return -100; // not a llama_process code: the batch refused the token
        }
    }
    llama_batch_ext_set_output_logits(st.batch, n - 1, true);
    return llama_process(st.ctx, LLAMA_PROCESS_TYPE_DECODE, st.batch);
}

// the timed span is what llama-bench times around test_prompt / test_gen; the memory clear is outside it.
// After a repetition ggml's workers keep polling for a while; the other build's process measures next on the
// same pinned cores, so they are put to sleep right after it (llama-bench never has a second process to disturb).
template <typename Body>
static int timed(paced_state & st, uint64_t & ns, Body body) {
    ggml_threadpool_resume(st.threadpool);
    const auto t0 = std::chrono::steady_clock::now();
    const int res = body();
    ns = (uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    ggml_threadpool_pause(st.threadpool);
    return res;
}

// an empty memory and position 0: tg-start, and `tg N`, which is one chunk of N tokens
static void start_generation(paced_state & st) {
    llama_memory_clear(llama_get_memory(st.ctx), false);
    st.gen_pos = 0;
}

// the next n_tokens of the current generation, one token per decode; the memory keeps the earlier chunks, so
// the chunks of one generation decode exactly what `tg N` decodes. Tokens are random ids from the unseeded
// std::rand, so two processes given the same commands decode the same tokens.
// token_ns (when not null): the time of each token of the chunk
static int run_gen_chunk(paced_state & st, int n_tokens, uint64_t & ns, std::vector<uint64_t> * token_ns = nullptr) {
    return timed(st, ns, [&]() {
        int res = 0;
        for (int i = 0; i < n_tokens && res == 0; i++) {
            const auto t0 = std::chrono::steady_clock::now();
            if (st.gen_pos == 0) {
                st.tokens[0] = st.add_bos ? st.bos : std::rand() % st.n_vocab;
            }
            res = decode(st, 1, st.gen_pos);
            llama_synchronize(st.ctx);
            st.tokens[0] = std::rand() % st.n_vocab;
            st.gen_pos++;
            if (token_ns != nullptr) {
                token_ns->push_back((uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
            }
        }
        return res;
    });
}

// pp N and tg N: a whole test from an empty memory; a chunked generation continues after pp N (at position N),
// not after tg N
static int run_test(paced_state & st, bool prompt, int n_tokens, uint64_t & ns) {
    if (!prompt) {
        start_generation(st);
        const int res = run_gen_chunk(st, n_tokens, ns);
        st.gen_pos = -1;
        return res;
    }
    llama_memory_clear(llama_get_memory(st.ctx), false);
    st.gen_pos = -1;
    return timed(st, ns, [&]() {
        int res = 0;
        for (int done = 0; done < n_tokens && res == 0; ) {
            const int n = std::min(n_tokens - done, st.n_batch);
            st.tokens[0] = done == 0 && st.add_bos ? st.bos : std::rand() % st.n_vocab;
            for (int i = 1; i < n; i++) {
                st.tokens[i] = std::rand() % st.n_vocab;
            }
            res = decode(st, n, done);
            done += n;
        }
        llama_synchronize(st.ctx);
        st.gen_pos = res == 0 ? n_tokens : -1;
        return res;
    });
}

// replaces the context's expert cache by a new one of the same budget; false where the build has no cache
static bool reset_moe_cache(paced_state & st, uint64_t & ns) {
#ifdef PACED_HAS_MOE_CACHE
    const auto t0 = std::chrono::steady_clock::now();
    llama_synchronize(st.ctx);
    llama_moe_set_moe_cache_mib(st.ctx, llama_moe_get_moe_cache_mib(st.ctx));
    ns = (uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    return true;
#else
    (void) st; (void) ns;
    return false;
#endif
}

// the decode hits (steps read in place count their ids) and misses of the context's cache; false without a cache
static bool moe_cache_decode_counters(paced_state & st, uint64_t & hits, uint64_t & misses) {
#ifdef PACED_HAS_MOE_CACHE
    llama_moe_cache_counters c = {};
    llama_moe_cache_get_counters(st.ctx, -1, 1, &c);
    hits   = c.n_hits + c.n_routed_in_place;
    misses = c.n_misses;
    return true;
#else
    (void) st; (void) hits; (void) misses;
    return false;
#endif
}

static void reply_error(const std::string & msg) {
    std::string out; // a JSON string: the message may quote the command
    for (char c : msg) {
        out += c == '"' || c == '\\' ? std::string("\\") + c : std::string(1, (unsigned char) c < 0x20 ? '?' : c);
    }
    printf("{\"error\": \"%s\"}\n", out.c_str());
    fflush(stdout);
}

static void serve(paced_state & st, const paced_params & p) {
    std::string line;
    for (int c = 0; c != EOF; ) {
        line.clear();
        while ((c = getchar()) != EOF && c != '\n') {
            line += (char) c;
        }
        while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) {
            line.pop_back();
        }
        const std::string kind = line.substr(0, line.find(' '));
        if ((line.empty() && c == EOF) || kind == "quit") {
            return;
        }
        if (kind == "tg-start") {
            start_generation(st);
            printf("{\"kind\": \"tg-start\", \"n_tokens\": 0, \"ns\": 0}\n");
            fflush(stdout);
            continue;
        }
        if (kind == "moe-cache-reset") {
            uint64_t ns = 0;
            if (reset_moe_cache(st, ns)) {
                printf("{\"kind\": \"moe-cache-reset\", \"n_tokens\": 0, \"ns\": %" PRIu64 "}\n", ns);
                fflush(stdout);
            } else {
                reply_error("moe-cache-reset: this build has no expert cache (llama-moe.h): use a patched build");
            }
            continue;
        }
        if (kind == "moe-cache-counters") {
            uint64_t hits = 0, misses = 0;
            if (moe_cache_decode_counters(st, hits, misses)) {
                printf("{\"kind\": \"moe-cache-counters\", \"n_tokens\": 0, \"ns\": 0, \"hits\": %" PRIu64 ", \"misses\": %" PRIu64 "}\n",
                        hits, misses);
                fflush(stdout);
            } else {
                reply_error("moe-cache-counters: this build has no expert cache (llama-moe.h): use a patched build");
            }
            continue;
        }
        if (kind == "tg-more") {
            int k = 0;
            if (st.gen_pos < 0) {
                reply_error("'" + line + "' continues no generation: send tg-start first");
            } else if (!parse_int(line.c_str() + kind.size(), 1, k) || k > st.n_ctx - st.gen_pos) {
                reply_error("bad token count in '" + line + "': a positive integer of at most " +
                            std::to_string(st.n_ctx - st.gen_pos) + " (the context left), e.g. tg-more 16");
            } else {
                uint64_t ns = 0;
                std::vector<uint64_t> token_ns;
                token_ns.reserve(k);
                if (const int res = run_gen_chunk(st, k, ns, &token_ns)) {
                    st.gen_pos = -1;
                    reply_error("decode failed in '" + line + "' (llama_process returned " + std::to_string(res) + "): rerun with -v for llama.cpp's log");
                } else {
                    std::string per_token;
                    for (const uint64_t t : token_ns) {
                        per_token += (per_token.empty() ? "" : ", ") + std::to_string(t);
                    }
                    printf("{\"kind\": \"tg-more\", \"n_tokens\": %d, \"ns\": %" PRIu64 ", \"first_ns\": %" PRIu64 ", \"token_ns\": [%s]}\n",
                           k, ns, token_ns.front(), per_token.c_str());
                    fflush(stdout);
                }
            }
            continue;
        }
        const bool prompt = kind == "pp";
        int n = prompt ? p.n_prompt : p.n_gen;
        if (!prompt && kind != "tg") {
            reply_error("unknown command '" + line + "': use pp [N], tg [N], tg-start, tg-more K, moe-cache-reset, moe-cache-counters or quit");
            continue;
        }
        if (line.size() > 2 ? !parse_int(line.c_str() + 3, 1, n) : n == 0) {
            reply_error("bad or missing token count in '" + line + "': use a positive integer, e.g. tg 1 (-p/-n 0 give no default)");
            continue;
        }
        if (n > st.n_ctx) {
            reply_error(line + " needs " + std::to_string(n) + " cells, the context has " + std::to_string(st.n_ctx) + ": start with a larger -c");
            continue;
        }
        uint64_t ns = 0;
        if (const int res = run_test(st, prompt, n, ns)) {
            reply_error("decode failed in '" + line + "' (llama_process returned " + std::to_string(res) + "): rerun with -v for llama.cpp's log");
            continue;
        }
        printf("{\"kind\": \"%s\", \"n_tokens\": %d, \"ns\": %" PRIu64 "}\n", kind.c_str(), n, ns);
        fflush(stdout);
    }
}

int main(int argc, char ** argv) {
    paced_params p;
    if (!parse_args(argc, argv, p)) {
        return 1;
    }
    if (FILE * f = fopen(p.model.c_str(), "rb")) {
        fclose(f);
    } else {
        fprintf(stderr, "error: model file '%s' cannot be opened: pass an existing GGUF file with -m\n", p.model.c_str());
        return 1;
    }
    if (!p.verbose) {
        llama_log_set(null_log, nullptr);
    }
    ggml_backend_load_all();
    llama_backend_init();


    // -ncmoe N: the expert tensors of blocks 0..N-1 stay in host memory, the patterns llama-bench builds
    std::vector<std::string> patterns(p.n_cpu_moe); // sized first: the overrides point into these strings
    std::vector<llama_model_tensor_buft_override> overrides;
    for (int i = 0; i < p.n_cpu_moe; i++) {
        patterns[i] = "blk\\." + std::to_string(i) + "\\.ffn_(up|down|gate|gate_up)_(ch|)exps";
        overrides.push_back({ patterns[i].c_str(), ggml_backend_cpu_buffer_type() });
    }
    overrides.push_back({ nullptr, nullptr });

    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers          = p.n_gpu_layers;
    mparams.load_mode             = p.load_mode;
    mparams.tensor_buft_overrides = patterns.empty() ? nullptr : overrides.data();

    llama_model * model = llama_model_load_from_file(p.model.c_str(), mparams);
    if (!model) {
        fprintf(stderr, "error: failed to load model '%s': check that it is a GGUF this build supports (rerun with -v for llama.cpp's log)\n", p.model.c_str());
        return 1;
    }

    const int n_threads = p.n_threads > 0 ? p.n_threads : default_threads();
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx           = p.n_ctx > 0 ? p.n_ctx : p.n_prompt + p.n_gen;
    cparams.n_batch         = p.n_batch;
    cparams.n_ubatch        = p.n_ubatch;
    cparams.flash_attn_type = p.flash_attn;
    cparams.n_threads       = n_threads;
    cparams.n_threads_batch = n_threads;
    cparams.swa_full        = false; // as llama-bench

    llama_context * ctx = llama_init_from_model(model, cparams);
    if (!ctx) {
        fprintf(stderr, "error: failed to create a context (n_ctx %u, n_batch %d, n_ubatch %d) for '%s': lower -c/-b/-ub or -ngl (rerun with -v for llama.cpp's log)\n",
                cparams.n_ctx, p.n_batch, p.n_ubatch, p.model.c_str());
        llama_model_free(model);
        return 1;
    }

    ggml_threadpool_params tpp = ggml_threadpool_params_default(n_threads);
    parse_cpu_mask(p.cpu_mask, tpp.cpumask); // validated in parse_args
    tpp.strict_cpu = p.cpu_strict;
    tpp.poll       = (uint32_t) p.poll;
    ggml_threadpool * threadpool = ggml_threadpool_new(&tpp);
    if (!threadpool) {
        fprintf(stderr, "error: failed to create a threadpool of %d threads (mask %s): lower -t or fix -C\n", n_threads, p.cpu_mask.c_str());
        llama_free(ctx);
        llama_model_free(model);
        return 1;
    }
    llama_attach_threadpool(ctx, threadpool, nullptr);
    llama_set_n_threads(ctx, n_threads, n_threads);

    const llama_vocab * vocab = llama_model_get_vocab(model);
    paced_state st = {
        ctx, llama_batch_ext_init(ctx), std::min(p.n_batch, (int) llama_n_batch(ctx)), (int) llama_n_ctx(ctx),
        llama_vocab_n_tokens(vocab), llama_vocab_get_add_bos(vocab), llama_vocab_bos(vocab), {}, threadpool,
    };
    st.tokens.resize(st.n_batch);

    printf("ready\n");
    fflush(stdout);
    serve(st, p);

    llama_batch_ext_free(st.batch);
    llama_free(ctx);
    ggml_threadpool_free(threadpool);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
