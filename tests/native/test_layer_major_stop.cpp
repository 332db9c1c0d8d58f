// A decode call stopped by the abort callback, layer-major and in ubatch order (docs/layer-major.md): what the memory
// keeps, and the logits of the same prompt finished afterwards. Usage: test_layer_major_stop MODEL
//
// For each order (lm 1: layer-major, with the groups LLAMA_LAYER_MAJOR_DEBUG_GROUP_LAYERS sets; lm 0: ubatch order)
// it decodes a 40-token prompt in ubatches of 8 once without a stop, counting the abort callback's calls (one per graph
// node on the CPU's first thread, so one thread), then once for each stop point: the callback answers true at its
// k-th call. Each line printed: lm, k (0: no stop), the call count, decode's return value, the memory's last position,
// and the hash of the last token's logits once the prompt's positions after that one were decoded in a second call.
// Optional: N_TOKENS N_UBATCH N_CTX (default 40 8 128); a context whose sliding-window cache is smaller than the prompt
// wraps it within the call, which layer-major order must decline (its stops could not leave the memory as ubatch
// order does).
//
// test_layer_major_stop MODEL sizes: per order, one context decodes prompts of 16, 40 and 24 tokens in turn (the
// memory cleared between them), so a call's boundary rows outgrow the last call's and then fit in them; each line:
// lm, the call, the prompt's size, decode's return value, the calls computed layer-major so far, the logits' hash.
#include "llama.h"
#include "llama-moe.h"

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

struct stop_at {
    uint64_t k     = 0; // 0: never
    uint64_t calls = 0;
};

static bool stop_cb(void * data) {
    auto * s = (stop_at *) data;
    return ++s->calls == s->k;
}

static uint64_t fnv1a(const float * p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    const auto * b = (const unsigned char *) p;
    for (size_t i = 0; i < n*sizeof(float); i++) {
        h = (h ^ b[i]) * 1099511628211ull;
    }
    return h;
}

static int decode_range(llama_context * ctx, const std::vector<llama_token> & tokens, int from) {
    llama_batch batch = llama_batch_init((int) tokens.size(), 0, 1);
    for (int i = from; i < (int) tokens.size(); i++) {
        batch.token[batch.n_tokens]     = tokens[i];
        batch.pos[batch.n_tokens]       = i;
        batch.n_seq_id[batch.n_tokens]  = 1;
        batch.seq_id[batch.n_tokens][0] = 0;
        batch.logits[batch.n_tokens]    = i == (int) tokens.size() - 1;
        batch.n_tokens++;
    }
    const int ret = llama_decode(ctx, batch);
    llama_batch_free(batch);
    return ret;
}

struct shape {
    int n_ubatch = 8;
    int n_ctx    = 128;
};

// a context of one thread whose batch holds the whole prompt, layer-major prompts on (lm 1) or off
static llama_context * make_context(llama_model * model, const shape & sh, uint32_t n_batch, int lm) {
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx           = sh.n_ctx;
    cp.n_batch         = n_batch;
    cp.n_ubatch        = sh.n_ubatch;
    cp.n_threads       = 1;
    cp.n_threads_batch = 1;
    cp.no_perf         = true;
    cp.swa_full        = false; // a sliding-window cache of its own size, as llama.cpp's tools make it
    llama_context * ctx = llama_init_from_model(model, cp);
    llama_moe_set_layer_major_prompt(ctx, lm);
    return ctx;
}

static void run(llama_model * model, const std::vector<llama_token> & tokens, const shape & sh, int lm, uint64_t k,
        uint64_t * calls) {
    llama_context * ctx = make_context(model, sh, (uint32_t) tokens.size(), lm);
    stop_at s;
    s.k = k;
    llama_set_abort_callback(ctx, stop_cb, &s);

    const int ret = decode_range(ctx, tokens, 0);
    const llama_pos last = llama_memory_seq_pos_max(llama_get_memory(ctx), 0);
    const uint64_t n_calls = s.calls;
    if (calls != nullptr) {
        *calls = n_calls;
    }
    s.k = 0;
    uint64_t hash = 0;
    if (last + 1 < (llama_pos) tokens.size() && decode_range(ctx, tokens, last + 1) == 0) {
        hash = fnv1a(llama_get_logits_ith(ctx, -1), llama_vocab_n_tokens(llama_model_get_vocab(model)));
    } else if (ret == 0) {
        hash = fnv1a(llama_get_logits_ith(ctx, -1), llama_vocab_n_tokens(llama_model_get_vocab(model)));
    }
    printf("lm %d k %" PRIu64 " calls %" PRIu64 " ret %d last %d hash %016" PRIx64 "\n", lm, k, n_calls, ret, last, hash);
    fflush(stdout);
    llama_free(ctx);
}

// prompts of several sizes in one context: the rows kept from a call are grown for a larger one and reused after
static void run_sizes(llama_model * model, const std::vector<llama_token> & tokens, int lm) {
    llama_context * ctx = make_context(model, shape{}, (uint32_t) tokens.size(), lm);
    int call = 0;
    for (int n : { 16, 40, 24 }) {
        llama_memory_clear(llama_get_memory(ctx), true);
        const std::vector<llama_token> prompt(tokens.begin(), tokens.begin() + n);
        const int ret = decode_range(ctx, prompt, 0);
        llama_moe_stats st = {};
        llama_moe_get_stats(ctx, &st);
        const uint64_t hash = ret == 0 ? fnv1a(llama_get_logits_ith(ctx, -1), llama_vocab_n_tokens(llama_model_get_vocab(model))) : 0;
        printf("lm %d call %d n %d ret %d lm_calls %" PRIu64 " hash %016" PRIx64 "\n", lm, call++, n, ret,
               st.n_layer_major_calls, hash);
    }
    fflush(stdout);
    llama_free(ctx);
}

int main(int argc, char ** argv) {
    const bool sizes = argc == 3 && std::string(argv[2]) == "sizes";
    if (argc != 2 && argc != 5 && !sizes) {
        fprintf(stderr, "usage: %s MODEL [N_TOKENS N_UBATCH N_CTX | sizes]\n", argv[0]);
        return 2;
    }
    const int n_tokens = argc == 5 ? atoi(argv[2]) : 40;
    shape sh;
    if (argc == 5) {
        sh.n_ubatch = atoi(argv[3]);
        sh.n_ctx    = atoi(argv[4]);
    }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (model == nullptr) {
        return 1;
    }
    std::vector<llama_token> tokens;
    for (int i = 0; i < n_tokens; i++) {
        tokens.push_back((i * 7919) % 4000 + 16);
    }
    for (int lm = 1; lm >= 0 && sizes; lm--) {
        run_sizes(model, tokens, lm);
    }
    for (int lm = 1; lm >= 0 && !sizes; lm--) {
        uint64_t total = 0;
        run(model, tokens, sh, lm, 0, &total);
        // the first node, a third of the way (layer-major: in a group before the last), the last node (the last
        // ubatch of the last group)
        for (uint64_t k : { (uint64_t) 1, total / 3, total }) {
            run(model, tokens, sh, lm, k, nullptr);
        }
    }
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
