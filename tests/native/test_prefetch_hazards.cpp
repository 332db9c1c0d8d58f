// test_prefetch_hazards.cpp: plants each hazard the scheduler's host-weight prefetch must avoid and checks that
// the result is still right. Runs on the SIM test-double device (GGML_SIM_DEVICES=1) of a patched build, with
// slow copies so that a copy issued too early or left running is visible, and poison on.
//
//   test_prefetch_hazards CASE      CASE: baseline | input-view | graph-writes-weight | arena-too-large |
//                                         headroom | abort | small-batch | shrink | small-then-large |
//                                         reserve-then-larger | headroom-at-alloc | other-buffer-fails | small-only |
//                                         earlier-buffer-fails | headroom-later | meta-input | mixed-sizes |
//                                         budget-steps | ring-overlap | mixed-budget | one-split |
//                                         headroom-other-device | ring-oplog | ring-oplog-wide |
//                                         chain-dims | poison-then-small | copy-callbacks | copy-at-split |
//                                         copy-regions
//
// Every case also checks the memory accounting: the SIM memory the scheduler took (compute buffer and staging
// arena) is what ggml_backend_sched_get_buffer_size reports.
//
// Prints "ok CASE: ..." and exits 0, or "FAIL CASE: ..." and exits 1. Each case runs in its own process because
// SIM reads its environment once.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml-sim.h"
#include "ggml-copy-regions.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

static const int64_t K = 256; // rows of x, columns of the weights
static const int64_t N = 256; // rows of the weights
static const int64_t M = 64;  // tokens

static int fail(const std::string & name, const std::string & why) {
    printf("FAIL %s: %s\n", name.c_str(), why.c_str());
    return 1;
}

// W[n][k] = small deterministic values; x[m][k] as given
static std::vector<float> weight_values(int seed) {
    std::vector<float> w(K * N);
    for (int64_t i = 0; i < K * N; i++) {
        w[i] = (float) (((i * 2654435761u + seed * 97u) % 1000) / 1000.0 - 0.5) / 16.0f;
    }
    return w;
}

// y[m][n] = sum_k W[n][k] * x[m][k] (ggml_mul_mat(W, x) with W [K, N], x [K, M])
static std::vector<float> matmul(const std::vector<float> & w, const std::vector<float> & x, int64_t rows) {
    std::vector<float> y(rows * M);
    for (int64_t m = 0; m < M; m++) {
        for (int64_t n = 0; n < rows; n++) {
            double acc = 0;
            for (int64_t k = 0; k < K; k++) {
                acc += (double) w[n * K + k] * x[m * K + k];
            }
            y[m * rows + n] = (float) acc;
        }
    }
    return y;
}

static bool close_to(const std::vector<float> & got, const std::vector<float> & want, std::string & why) {
    for (size_t i = 0; i < want.size(); i++) {
        if (!(std::fabs(got[i] - want[i]) <= 1e-3f * (1.0f + std::fabs(want[i])))) {
            char buf[160];
            snprintf(buf, sizeof(buf), "element %zu is %g, expected %g", i, got[i], want[i]);
            why = buf;
            return false;
        }
    }
    return true;
}

struct fixture {
    ggml_backend_t        sim = nullptr;
    ggml_backend_t        cpu = nullptr;
    ggml_backend_sched_t  sched = nullptr;
    ggml_context *        ctx_w = nullptr; // weights (host buffer, usage WEIGHTS)
    ggml_backend_buffer_t buf_w = nullptr;
    ggml_context *        ctx_g = nullptr; // graph
    ggml_tensor *         w1 = nullptr;
    ggml_tensor *         w2 = nullptr;
    ggml_tensor *         xw = nullptr;    // an input that lives in the weights buffer (input-view case)
    size_t                sim_free_at_init = 0;

    bool init(ggml_backend_sched_prefetch_params params) {
        ggml_backend_dev_t dev = ggml_backend_dev_by_name("SIM0");
        if (dev == nullptr) {
            return false;
        }
        sim = ggml_backend_dev_init(dev, nullptr);
        cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
        ggml_backend_t backends[2] = { sim, cpu };
        sched = ggml_backend_sched_new(backends, nullptr, 2, 1024, false, true);
        ggml_backend_sched_set_prefetch(sched, params);
        size_t total;
        ggml_backend_dev_memory(dev, &sim_free_at_init, &total); // the weights live on the host: SIM0 holds only
                                                                    // what the scheduler allocates from here on

        ggml_init_params ip = { 8 * ggml_tensor_overhead(), nullptr, true };
        ctx_w = ggml_init(ip);
        w1 = ggml_new_tensor_2d(ctx_w, GGML_TYPE_F32, K, N);
        w2 = ggml_new_tensor_2d(ctx_w, GGML_TYPE_F32, N, N);
        xw = ggml_new_tensor_2d(ctx_w, GGML_TYPE_F32, K, M);
        ggml_set_name(w1, "w1");
        ggml_set_name(w2, "w2");
        ggml_set_name(xw, "xw");
        buf_w = ggml_backend_alloc_ctx_tensors_from_buft(ctx_w, ggml_backend_cpu_buffer_type());
        ggml_backend_buffer_set_usage(buf_w, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ggml_backend_tensor_set(w1, weight_values(1).data(), 0, ggml_nbytes(w1));
        ggml_backend_tensor_set(w2, weight_values(2).data(), 0, ggml_nbytes(w2));

        ggml_init_params gp = { 64 * ggml_tensor_overhead() + 3 * ggml_graph_overhead(), nullptr, true };
        ctx_g = ggml_init(gp);
        return true;
    }

    ~fixture() { // each of these accepts NULL (a fixture whose init stopped early)
        ggml_backend_sched_free(sched);
        ggml_free(ctx_g);
        ggml_backend_buffer_free(buf_w);
        ggml_free(ctx_w);
        ggml_backend_free(sim);
        ggml_backend_free(cpu);
    }

    // a graph input of the tokens' activations, set by the caller after allocation
    ggml_tensor * input_x() {
        ggml_tensor * x = ggml_new_tensor_2d(ctx_g, GGML_TYPE_F32, K, M);
        ggml_set_input(x);
        return x;
    }

    // the graph that computes `out`, marked as the output
    ggml_cgraph * graph_of(ggml_tensor * out) {
        ggml_set_output(out);
        ggml_cgraph * g = ggml_new_graph(ctx_g);
        ggml_build_forward_expand(g, out);
        return g;
    }

    // the matmul runs on SIM, whatever the batch
    ggml_tensor * mm(ggml_tensor * w, ggml_tensor * x) {
        ggml_tensor * y = ggml_mul_mat(ctx_g, w, x);
        ggml_backend_sched_set_tensor_backend(sched, y, sim);
        return y;
    }

    // allocates the graph; "" when the SIM memory the scheduler took (compute buffer and staging arena) is
    // what it reports, which is what llama's compute-buffer log and memory breakdown show; else why not
    std::string alloc(ggml_cgraph * gf) {
        if (!ggml_backend_sched_alloc_graph(sched, gf)) {
            return "alloc_graph failed";
        }
        size_t free_now, total;
        ggml_backend_dev_memory(ggml_backend_get_device(sim), &free_now, &total);
        const size_t reported = ggml_backend_sched_get_buffer_size(sched, sim);
        if (sim_free_at_init - free_now != reported) {
            return "the scheduler took " + std::to_string(sim_free_at_init - free_now) + " bytes of SIM0 and reports " +
                   std::to_string(reported);
        }
        return "";
    }

    std::vector<float> get(ggml_tensor * t) {
        std::vector<float> v(ggml_nelements(t));
        ggml_backend_tensor_get(t, v.data(), 0, ggml_nbytes(t));
        return v;
    }
};

static ggml_backend_sched_prefetch_params prefetch_on(int min_batch = 32, int depth = 2) {
    ggml_backend_sched_prefetch_params p = ggml_backend_sched_prefetch_default_params();
    p.mode      = GGML_BACKEND_SCHED_PREFETCH_ANY;
    p.depth     = depth;
    p.min_batch = min_batch;
    p.headroom  = 0;
    return p;
}

static std::vector<float> ones_x(float v) {
    std::vector<float> x(K * M);
    for (int64_t i = 0; i < K * M; i++) {
        x[i] = v * (float) ((i % 7) + 1);
    }
    return x;
}

// y2 = w2 (w1 x) on SIM, allocated, x set to ones_x(0.25); `error` says why the allocation failed
struct two_matmuls {
    ggml_cgraph *      gf = nullptr;
    ggml_tensor *      y2 = nullptr;
    std::vector<float> want; // y2's values
    std::string        error;

    explicit two_matmuls(fixture & f) {
        ggml_tensor * x = f.input_x();
        y2 = f.mm(f.w2, f.mm(f.w1, x));
        gf = f.graph_of(y2);
        error = f.alloc(gf);
        if (error.empty()) {
            const std::vector<float> xv = ones_x(0.25f);
            ggml_backend_tensor_set(x, xv.data(), 0, ggml_nbytes(x));
            want = matmul(weight_values(2), matmul(weight_values(1), xv, N), N);
        }
    }
};

// two weight splits on SIM, both uploaded ahead (or copied at split time below min_batch); optional abort
static int two_splits(const std::string & name, int min_batch, bool expect_ahead, int depth = 2) {
    fixture f;
    if (!f.init(prefetch_on(min_batch, depth))) {
        return fail(name, "no SIM0 device: run with GGML_SIM_DEVICES=1");
    }
    if (!expect_ahead) {
        // a graph below min_batch only binds into slots a larger one made: reserve one first, as llama.cpp does
        ggml_tensor * xl = ggml_new_tensor_2d(f.ctx_g, GGML_TYPE_F32, K, min_batch);
        ggml_set_input(xl);
        if (!ggml_backend_sched_reserve(f.sched, f.graph_of(f.mm(f.w2, f.mm(f.w1, xl))))) {
            return fail(name, "reserve of the large graph failed");
        }
    }
    const two_matmuls c(f);
    if (!c.error.empty()) {
        return fail(name, c.error);
    }
    std::string why;
    for (int rep = 0; rep < 3; rep++) { // the same allocation computed again, as llama.cpp reuses graphs
        if (ggml_backend_sched_graph_compute(f.sched, c.gf) != GGML_STATUS_SUCCESS) {
            return fail(name, "compute failed");
        }
        if (!close_to(f.get(c.y2), c.want, why)) {
            return fail(name, "repetition " + std::to_string(rep) + ": " + why);
        }
    }
    ggml_backend_sched_stats st;
    ggml_backend_sched_get_stats(f.sched, &st);
    const size_t staging = ggml_backend_sched_get_prefetch_size(f.sched, f.sim);
    if (staging == 0) {
        return fail(name, "no staging arena: the weight copies were not bound");
    }
    if (expect_ahead != (st.n_prefetch_uploads == 6)) {
        return fail(name, "prefetch uploads: " + std::to_string(st.n_prefetch_uploads) + (expect_ahead ? ", expected 6" : ", expected 0"));
    }
    // two splits in a ring of two: each upload can run `depth` ahead (here: as far as the graph goes), in the
    // staging of the two splits, not `depth` of them
    const int lookahead = ggml_backend_sched_get_prefetch_depth(f.sched, f.sim, nullptr);
    if (expect_ahead && (lookahead != depth || staging != ggml_nbytes(f.w1) + ggml_nbytes(f.w2))) {
        return fail(name, "lookahead " + std::to_string(lookahead) + " in " + std::to_string(staging) + " bytes of staging, expected " +
                          std::to_string(depth) + " in " + std::to_string(ggml_nbytes(f.w1) + ggml_nbytes(f.w2)));
    }
    printf("ok %s: %llu uploads ahead, staging %zu bytes, %llu host syncs in 3 computes\n", name.c_str(),
           (unsigned long long) st.n_prefetch_uploads, staging, (unsigned long long) st.n_host_syncs);
    return 0;
}

// a user input reached through a view: the caller overwrites it as soon as compute_async returns
static int input_view(const std::string & name) {
    fixture f;
    if (!f.init(prefetch_on())) {
        return fail(name, "no SIM0 device: run with GGML_SIM_DEVICES=1");
    }
    ggml_set_input(f.xw); // an input in a host weights buffer: only its flag says it is not a weight
    ggml_tensor * xv = ggml_view_2d(f.ctx_g, f.xw, K, M, f.xw->nb[1], 0);
    ggml_tensor * y = f.mm(f.w1, xv);
    ggml_cgraph * gf = f.graph_of(y);
    const std::string alloc_error = f.alloc(gf);
    if (!alloc_error.empty()) {
        return fail(name, alloc_error);
    }
    const std::vector<float> x0 = ones_x(0.25f), x1 = ones_x(-1000.0f);
    ggml_backend_tensor_set(f.xw, x0.data(), 0, ggml_nbytes(f.xw));
    if (ggml_backend_sched_graph_compute_async(f.sched, gf) != GGML_STATUS_SUCCESS) {
        return fail(name, "compute failed");
    }
    ggml_backend_tensor_set(f.xw, x1.data(), 0, ggml_nbytes(f.xw)); // the next batch's input, right away
    ggml_backend_sched_synchronize(f.sched);
    std::string why;
    if (!close_to(f.get(y), matmul(weight_values(1), x0, N), why)) {
        return fail(name, "the overwritten input reached the result: " + why);
    }
    printf("ok %s\n", name.c_str());
    return 0;
}

// called before each CPU node: makes the CPU split slower than a SIM copy, so an upload issued before the
// split ran reads the weight before it is written
static bool slow_cpu(void *) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    return false;
}

// a host weight the graph writes (ggml_cpy into it on the CPU) before a SIM split reads it
static int graph_writes_weight(const std::string & name) {
    fixture f;
    if (!f.init(prefetch_on())) {
        return fail(name, "no SIM0 device: run with GGML_SIM_DEVICES=1");
    }
    ggml_backend_cpu_set_abort_callback(f.cpu, slow_cpu, nullptr);
    ggml_tensor * src = ggml_new_tensor_2d(f.ctx_g, GGML_TYPE_F32, K, N);
    ggml_set_input(src);
    ggml_tensor * scaled = ggml_scale(f.ctx_g, src, 2.0f);
    ggml_backend_sched_set_tensor_backend(f.sched, scaled, f.cpu);
    ggml_tensor * written = ggml_cpy(f.ctx_g, scaled, f.w1); // w1 = 2 * src, computed on the CPU
    ggml_backend_sched_set_tensor_backend(f.sched, written, f.cpu);
    ggml_tensor * x = f.input_x();
    ggml_tensor * y = f.mm(written, x);
    ggml_cgraph * gf = f.graph_of(y);
    const std::string alloc_error = f.alloc(gf);
    if (!alloc_error.empty()) {
        return fail(name, alloc_error);
    }
    std::vector<float> s = weight_values(7);
    ggml_backend_tensor_set(src, s.data(), 0, ggml_nbytes(src));
    const std::vector<float> xv = ones_x(0.25f);
    ggml_backend_tensor_set(x, xv.data(), 0, ggml_nbytes(x));
    if (ggml_backend_sched_graph_compute(f.sched, gf) != GGML_STATUS_SUCCESS) {
        return fail(name, "compute failed");
    }
    for (float & v : s) {
        v *= 2.0f;
    }
    std::string why;
    if (!close_to(f.get(y), matmul(s, xv, N), why)) {
        return fail(name, "the split read the weight before the graph wrote it: " + why);
    }
    printf("ok %s\n", name.c_str());
    return 0;
}

// the staging arena of two splits does not fit (GGML_SIM_MEMORY_MIB small): half of it, one split, would keep every
// upload only 1 split ahead, overlapping no compute, so the prefetch is dropped; or every budget leaves less than
// the headroom free: dropped too
static int dropped(const std::string & name, bool by_headroom) {
    fixture f;
    ggml_backend_sched_prefetch_params p = prefetch_on();
    if (by_headroom) {
        p.headroom = (size_t) 1 << 40; // more than any device has
    }
    if (!f.init(p)) {
        return fail(name, "no SIM0 device: run with GGML_SIM_DEVICES=1");
    }
    // a graph is split in place: reserve with one, compute another of the same shape (as llama.cpp does)
    ggml_tensor * x = nullptr;
    ggml_tensor * y2 = nullptr;
    auto build = [&]() {
        x = f.input_x();
        y2 = f.mm(f.w2, f.mm(f.w1, x));
        return f.graph_of(y2);
    };
    if (!ggml_backend_sched_reserve(f.sched, build())) {
        return fail(name, "reserve failed");
    }
    ggml_cgraph * gf = build();
    const size_t one_split = ggml_nbytes(f.w1);
    if (by_headroom && ggml_backend_sched_prefetch_enabled(f.sched, f.sim)) {
        return fail(name, "the prefetch is still on: every staging budget was expected to leave less than the headroom");
    }
    const char * why_off = nullptr;
    if (!by_headroom && (ggml_backend_sched_get_prefetch_depth(f.sched, f.sim, &why_off) != 0 || why_off == nullptr ||
                         strstr(why_off, "the compute buffer does not fit next to the staging arena") == nullptr)) {
        return fail(name, "expected the prefetch dropped (one split of " + std::to_string(one_split) + " bytes keeps an upload only 1 "
                          "ahead); got " + std::to_string(ggml_backend_sched_get_prefetch_size(f.sched, f.sim)) + " bytes, lookahead " +
                          std::to_string(ggml_backend_sched_get_prefetch_depth(f.sched, f.sim, nullptr)) +
                          (why_off ? std::string(" (") + why_off + ")" : ""));
    }
    const std::string alloc_error = f.alloc(gf);
    if (!alloc_error.empty()) {
        return fail(name, alloc_error + " (after the prefetch was dropped)");
    }
    const std::vector<float> xv = ones_x(0.25f);
    ggml_backend_tensor_set(x, xv.data(), 0, ggml_nbytes(x));
    if (ggml_backend_sched_graph_compute(f.sched, gf) != GGML_STATUS_SUCCESS) {
        return fail(name, "compute failed");
    }
    std::string why;
    if (!close_to(f.get(y2), matmul(weight_values(2), matmul(weight_values(1), xv, N), N), why)) {
        return fail(name, why);
    }
    if (ggml_backend_sched_get_prefetch_size(f.sched, f.sim) != 0) {
        return fail(name, "a dropped prefetch still holds a staging arena");
    }
    printf("ok %s\n", name.c_str());
    return 0;
}

// a small batch (weights copied into the slots on the compute stream, no release events) queued right before a
// large one (uploads ahead on the copy queue), with no synchronization between them, as llama.cpp may run two
// ubatches: the large batch's uploads must wait for the small batch's last reads of the slots. The two graphs
// read the weights in opposite orders, so an upload that lands early puts the other weight under the small
// batch's second matmul. Run with slow computes and fast copies.
static int small_then_large(const std::string & name) {
    fixture f;
    if (!f.init(prefetch_on(M + 1))) {
        return fail(name, "no SIM0 device: run with GGML_SIM_DEVICES=1");
    }
    auto chain = [&](int64_t tokens, ggml_tensor * first, ggml_tensor * second, ggml_tensor ** x, ggml_tensor ** y) {
        *x = ggml_new_tensor_2d(f.ctx_g, GGML_TYPE_F32, K, tokens);
        ggml_set_input(*x);
        *y = f.mm(second, f.mm(first, *x));
        return f.graph_of(*y);
    };
    ggml_tensor * xs, * ys, * xl, * yl;
    // sized for the large graph, so that neither allocation below has to grow (and synchronize); a graph the
    // scheduler has split points at its copies, so each allocation gets a graph of its own, as in llama.cpp
    if (!ggml_backend_sched_reserve(f.sched, chain(2 * M, f.w2, f.w1, &xl, &yl))) {
        return fail(name, "reserve failed");
    }
    ggml_cgraph * small = chain(M, f.w1, f.w2, &xs, &ys);
    std::string alloc_error = f.alloc(small);
    if (!alloc_error.empty()) {
        return fail(name, alloc_error);
    }
    const std::vector<float> xsv = ones_x(0.25f);
    ggml_backend_tensor_set(xs, xsv.data(), 0, ggml_nbytes(xs));
    if (ggml_backend_sched_graph_compute_async(f.sched, small) != GGML_STATUS_SUCCESS) {
        return fail(name, "compute of the small batch failed");
    }
    // read on the compute stream right after the small batch: the large one may reuse its memory
    std::vector<float> got_small(ggml_nelements(ys));
    ggml_backend_tensor_get_async(f.sim, ys, got_small.data(), 0, ggml_nbytes(ys));

    ggml_backend_sched_reset(f.sched);
    ggml_cgraph * large = chain(2 * M, f.w2, f.w1, &xl, &yl);
    alloc_error = f.alloc(large);
    if (!alloc_error.empty()) {
        return fail(name, alloc_error);
    }
    std::vector<float> xlv(2 * K * M);
    for (size_t i = 0; i < xlv.size(); i++) {
        xlv[i] = 0.125f * (float) ((i % 5) + 1);
    }
    ggml_backend_tensor_set(xl, xlv.data(), 0, ggml_nbytes(xl));
    if (ggml_backend_sched_graph_compute_async(f.sched, large) != GGML_STATUS_SUCCESS) {
        return fail(name, "compute of the large batch failed");
    }
    ggml_backend_sched_synchronize(f.sched);

    ggml_backend_sched_stats st;
    ggml_backend_sched_get_stats(f.sched, &st);
    if (st.n_prefetch_uploads != 2) {
        return fail(name, "prefetch uploads: " + std::to_string(st.n_prefetch_uploads) + ", expected 2 (the large batch only)");
    }
    std::string why;
    if (!close_to(got_small, matmul(weight_values(2), matmul(weight_values(1), xsv, N), N), why)) {
        return fail(name, "the small batch read an upload of the large one: " + why);
    }
    std::vector<float> want_large(N * 2 * M);
    {
        // matmul() works on M tokens: the large batch in two halves
        const std::vector<float> lo(xlv.begin(), xlv.begin() + K * M), hi(xlv.begin() + K * M, xlv.end());
        const std::vector<float> a = matmul(weight_values(1), matmul(weight_values(2), lo, N), N);
        const std::vector<float> b = matmul(weight_values(1), matmul(weight_values(2), hi, N), N);
        std::copy(a.begin(), a.end(), want_large.begin());
        std::copy(b.begin(), b.end(), want_large.begin() + N * M);
    }
    if (!close_to(f.get(yl), want_large, why)) {
        return fail(name, "the large batch: " + why);
    }
    printf("ok %s\n", name.c_str());
    return 0;
}

// y = w2 (w1 x) for `tokens` tokens of x, computed on the host in blocks of M tokens (what matmul() takes)
static std::vector<float> want_chain(const std::vector<float> & x, int64_t tokens) {
    std::vector<float> want(N * tokens);
    for (int64_t t0 = 0; t0 < tokens; t0 += M) {
        const std::vector<float> block(x.begin() + K * t0, x.begin() + K * (t0 + M));
        const std::vector<float> y = matmul(weight_values(2), matmul(weight_values(1), block, N), N);
        std::copy(y.begin(), y.end(), want.begin() + N * t0);
    }
    return want;
}

// computes y = w2 (w1 x) for `tokens` tokens through alloc_graph and graph_compute and checks the result and
// the memory accounting; "" or why not
static std::string compute_chain(fixture & f, int64_t tokens) {
    ggml_tensor * x = ggml_new_tensor_2d(f.ctx_g, GGML_TYPE_F32, K, tokens);
    ggml_set_input(x);
    ggml_tensor * y = f.mm(f.w2, f.mm(f.w1, x));
    ggml_cgraph * gf = f.graph_of(y);
    const std::string alloc_error = f.alloc(gf);
    if (!alloc_error.empty()) {
        return alloc_error;
    }
    std::vector<float> xv(K * tokens);
    for (size_t i = 0; i < xv.size(); i++) {
        xv[i] = 0.125f * (float) ((i % 5) + 1);
    }
    ggml_backend_tensor_set(x, xv.data(), 0, ggml_nbytes(x));
    if (ggml_backend_sched_graph_compute(f.sched, gf) != GGML_STATUS_SUCCESS) {
        return "compute failed";
    }
    std::string why;
    return close_to(f.get(y), want_chain(xv, tokens), why) ? "" : why;
}

// a graph reserved at M tokens, then one of 8 M: with GGML_SIM_MEMORY_MIB set so that the larger compute buffer
// fits next to the staging of one split but not of two, the reservation inside alloc_graph fails once and must be retried from a
// clean reservation (a retry that only allocates places tensors into the buffer the failed reservation freed); one
// split would keep an upload only 1 ahead, so the retry drops the prefetch
static int reserve_then_larger(const std::string & name) {
    fixture f;
    if (!f.init(prefetch_on(32, 4))) {
        return fail(name, "no SIM0 device: run with GGML_SIM_DEVICES=1");
    }
    ggml_tensor * x = f.input_x();
    if (!ggml_backend_sched_reserve(f.sched, f.graph_of(f.mm(f.w2, f.mm(f.w1, x))))) {
        return fail(name, "reserve of the small graph failed");
    }
    const std::string err = compute_chain(f, 8 * M);
    if (!err.empty()) {
        return fail(name, err);
    }
    const char * why_off = nullptr;
    const int depth = ggml_backend_sched_get_prefetch_depth(f.sched, f.sim, &why_off);
    if (depth != 0 || ggml_backend_sched_get_prefetch_size(f.sched, f.sim) != 0 || why_off == nullptr ||
        strstr(why_off, "the compute buffer does not fit") == nullptr) {
        return fail(name, "lookahead " + std::to_string(depth) + " after the retry, expected the prefetch dropped for the compute buffer" +
                          (why_off ? std::string(": ") + why_off : ""));
    }
    printf("ok %s: %s\n", name.c_str(), why_off);
    return 0;
}

// the headroom check inside alloc_graph, with no reserve before it (a plain graph_compute): the device has less
// than the headroom free once the arena is made, so the prefetch is dropped after the first reservation, and the
// retry must lay out the whole graph again, not only the copies that left the arena
static int headroom_at_alloc(const std::string & name) {
    fixture f;
    ggml_backend_sched_prefetch_params p = prefetch_on();
    p.headroom = (size_t) 1 << 40; // more than any device has
    if (!f.init(p)) {
        return fail(name, "no SIM0 device: run with GGML_SIM_DEVICES=1");
    }
    for (int rep = 0; rep < 2; rep++) {
        const std::string err = compute_chain(f, 2 * M);
        if (!err.empty()) {
            return fail(name, "computation " + std::to_string(rep) + ": " + err);
        }
        ggml_backend_sched_reset(f.sched);
    }
    const char * why_off = nullptr;
    if (ggml_backend_sched_get_prefetch_depth(f.sched, f.sim, &why_off) != 0 || why_off == nullptr ||
        strstr(why_off, "headroom") == nullptr) {
        return fail(name, std::string("the prefetch was expected to be dropped for the headroom: ") + (why_off ? why_off : "still on"));
    }
    printf("ok %s: %s\n", name.c_str(), why_off);
    return 0;
}

// a compute buffer that fails on a backend with no staging arena (a second device here; the CPU in general) is
// not the arena's fault: the reservation fails without shrinking or dropping the prefetch of the other device,
// whether the failed device comes after it or before it (on a first reservation every buffer after the failed one
// is still unallocated too). Allocating the same shape again afterwards fails again instead of placing tensors
// into the buffer the failed reservation freed (the stored layout matches, so the allocator's fast path would).
static int other_buffer_fails(const std::string & name, bool arena_first) {
    ggml_backend_dev_t dev1 = ggml_backend_dev_by_name("SIM1");
    fixture f;
    if (dev1 == nullptr || !f.init(prefetch_on(32, 4))) {
        return fail(name, "no SIM0 and SIM1: run with GGML_SIM_DEVICES=2");
    }
    ggml_backend_t sim1 = ggml_backend_dev_init(dev1, nullptr);
    ggml_backend_t reader = arena_first ? f.sim : sim1; // reads the host weights: gets the arena
    ggml_backend_t other  = arena_first ? sim1 : f.sim; // gets a 4 MiB input copy that does not fit
    ggml_backend_t backends[3] = { f.sim, sim1, f.cpu };
    ggml_backend_sched_free(f.sched);
    f.sched = ggml_backend_sched_new(backends, nullptr, 3, 1024, false, true);
    ggml_backend_sched_set_prefetch(f.sched, prefetch_on(32, 4));

    auto build = [&]() {
        ggml_tensor * x  = f.input_x();
        ggml_tensor * y1 = ggml_mul_mat(f.ctx_g, f.w1, x);
        ggml_tensor * y  = ggml_mul_mat(f.ctx_g, f.w2, y1);
        ggml_backend_sched_set_tensor_backend(f.sched, y1, reader);
        ggml_backend_sched_set_tensor_backend(f.sched, y, reader);
        ggml_tensor * big = ggml_new_tensor_2d(f.ctx_g, GGML_TYPE_F32, K, 64 * M);
        ggml_set_input(big);
        ggml_tensor * z = ggml_scale(f.ctx_g, big, 2.0f);
        ggml_backend_sched_set_tensor_backend(f.sched, z, other);
        ggml_cgraph * g = ggml_new_graph(f.ctx_g);
        ggml_set_output(y);
        ggml_set_output(z);
        ggml_build_forward_expand(g, y);
        ggml_build_forward_expand(g, z);
        return g;
    };
    // alloc_graph, as a plain graph_compute does, then the same shape again
    const bool reserved  = ggml_backend_sched_alloc_graph(f.sched, build());
    ggml_backend_sched_reset(f.sched);
    const bool still_on  = ggml_backend_sched_prefetch_enabled(f.sched, reader);
    const int  depth     = ggml_backend_sched_get_prefetch_depth(f.sched, reader, nullptr);
    const bool allocated = ggml_backend_sched_alloc_graph(f.sched, build());
    const std::string rn = ggml_backend_name(reader), on = ggml_backend_name(other);
    ggml_backend_sched_free(f.sched);
    f.sched = nullptr;
    ggml_backend_free(sim1);
    if (reserved || allocated) {
        return fail(name, "the graph was allocated" + std::string(reserved ? "" : " the second time") + ": " + on +
                          "'s buffer was expected not to fit (GGML_SIM_MEMORY_MIB)");
    }
    if (!still_on || depth != 4) {
        return fail(name, on + "'s failure changed " + rn + "'s prefetch: " + (still_on ? "on" : "off") +
                          ", depth " + std::to_string(depth));
    }
    printf("ok %s: both allocations failed, %s kept depth 4\n", name.c_str(), rn.c_str());
    return 0;
}

// the headroom is checked when an arena is made or grown, not at every later reservation: the free memory then
// also lacks what the backends took since (a CUDA pool grows and never gives memory back), which is what the
// headroom is there for. Here 40 MiB taken on SIM0 after the reservation stands for that pool.
static int headroom_later(const std::string & name) {
    fixture f;
    ggml_backend_sched_prefetch_params p = prefetch_on(32, 4);
    p.headroom = 32u << 20;
    if (!f.init(p)) {
        return fail(name, "no SIM0 device: run with GGML_SIM_DEVICES=1 GGML_SIM_MEMORY_MIB=64");
    }
    ggml_tensor * x = f.input_x();
    if (!ggml_backend_sched_reserve(f.sched, f.graph_of(f.mm(f.w2, f.mm(f.w1, x))))) {
        return fail(name, "reserve failed");
    }
    if (ggml_backend_sched_get_prefetch_depth(f.sched, f.sim, nullptr) != 4) {
        return fail(name, "the reservation left less than the headroom already: give SIM0 64 MiB");
    }
    ggml_backend_buffer_t pool = ggml_backend_buft_alloc_buffer(ggml_backend_get_default_buffer_type(f.sim), 40u << 20);
    if (pool == nullptr) {
        return fail(name, "could not take 40 MiB of SIM0");
    }
    // a graph with one more node: the allocation reserves again, with the same splits and arena
    ggml_tensor * x2 = f.input_x();
    ggml_tensor * y2 = ggml_scale(f.ctx_g, f.mm(f.w2, f.mm(f.w1, x2)), 0.5f);
    ggml_backend_sched_set_tensor_backend(f.sched, y2, f.sim);
    const bool allocated = ggml_backend_sched_alloc_graph(f.sched, f.graph_of(y2));
    const char * why = nullptr;
    const int depth = ggml_backend_sched_get_prefetch_depth(f.sched, f.sim, &why);
    ggml_backend_sched_reset(f.sched);
    ggml_backend_buffer_free(pool);
    if (!allocated) {
        return fail(name, "alloc_graph failed");
    }
    if (depth != 4) {
        return fail(name, "a later reservation shrank the arena for memory it did not take: depth " + std::to_string(depth) +
                          (why ? std::string(": ") + why : ""));
    }
    printf("ok %s: depth 4 kept\n", name.c_str());
    return 0;
}

// graphs that are all below min_batch (a context with a small n_ubatch) upload nothing ahead: no arena
static int small_only(const std::string & name) {
    fixture f;
    if (!f.init(prefetch_on(M + 1, 4))) {
        return fail(name, "no SIM0 device: run with GGML_SIM_DEVICES=1");
    }
    const std::string err = compute_chain(f, M);
    if (!err.empty()) {
        return fail(name, err);
    }
    const char * why_off = nullptr;
    if (ggml_backend_sched_get_prefetch_size(f.sched, f.sim) != 0 || ggml_backend_sched_get_prefetch_depth(f.sched, f.sim, &why_off) != 0) {
        return fail(name, "a graph below min_batch made a staging arena of " +
                          std::to_string(ggml_backend_sched_get_prefetch_size(f.sched, f.sim)) + " bytes");
    }
    if (why_off == nullptr || strstr(why_off, "below the min batch") == nullptr) {
        return fail(name, std::string("the reason given is not the batch size: ") + (why_off ? why_off : "(none)"));
    }
    printf("ok %s: %s\n", name.c_str(), why_off);
    return 0;
}

static ggml_backend_meta_split_state all_mirrored(const ggml_tensor *, void *) {
    ggml_backend_meta_split_state st = {};
    st.axis       = GGML_BACKEND_SPLIT_AXIS_MIRRORED;
    st.n_segments = 1;
    st.nr[0]      = 1;
    return st;
}

// --split-mode tensor: a meta backend over SIM0 and SIM1 reads a non-contiguous host input (a transposed view).
// The meta backend's async setter asserts on such a copy where its synchronous one takes it, so the input takes
// the synchronous path; and the prefetch is off there, with the split mode named as the reason. (llama.cpp's own
// -sm tensor does not run on SIM in the pinned version, so the case is a plain ggml graph.)
static int meta_input(const std::string & name) {
    ggml_backend_dev_t devs[2] = { ggml_backend_dev_by_name("SIM0"), ggml_backend_dev_by_name("SIM1") };
    if (devs[0] == nullptr || devs[1] == nullptr) {
        return fail(name, "no SIM0 and SIM1: run with GGML_SIM_DEVICES=2");
    }
    ggml_backend_t meta = ggml_backend_dev_init(ggml_backend_meta_device(devs, 2, all_mirrored, nullptr), nullptr);
    ggml_backend_t cpu  = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    ggml_backend_t backends[2] = { meta, cpu };
    ggml_backend_sched_t sched = ggml_backend_sched_new(backends, nullptr, 2, 1024, false, true);
    ggml_backend_sched_set_prefetch(sched, prefetch_on());

    ggml_init_params gp = { 16 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(gp);
    ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 8, 4);
    ggml_set_input(x);
    ggml_tensor * y = ggml_cont(ctx, ggml_transpose(ctx, x));
    ggml_set_output(y);
    ggml_backend_sched_set_tensor_backend(sched, y, meta);
    ggml_cgraph * g = ggml_new_graph(ctx);
    ggml_build_forward_expand(g, y);

    std::string err;
    std::vector<float> xv(32), yv(32);
    if (!ggml_backend_sched_alloc_graph(sched, g)) {
        err = "alloc_graph failed";
    } else {
        for (int i = 0; i < 32; i++) {
            xv[i] = (float) i;
        }
        ggml_backend_tensor_set(x, xv.data(), 0, sizeof(float) * 32);
        if (ggml_backend_sched_graph_compute(sched, g) != GGML_STATUS_SUCCESS) {
            err = "compute failed";
        } else {
            ggml_backend_tensor_get(y, yv.data(), 0, sizeof(float) * 32);
            for (int r = 0; r < 8 && err.empty(); r++) {
                for (int c = 0; c < 4 && err.empty(); c++) {
                    if (yv[r * 4 + c] != xv[c * 8 + r]) {
                        err = "y[" + std::to_string(r) + "][" + std::to_string(c) + "] is " + std::to_string(yv[r * 4 + c]);
                    }
                }
            }
        }
    }
    const char * why_off = nullptr;
    const int depth = ggml_backend_sched_get_prefetch_depth(sched, meta, &why_off);
    const std::string why = why_off ? why_off : "";
    ggml_backend_sched_free(sched);
    ggml_free(ctx);
    ggml_backend_free(meta);
    ggml_backend_free(cpu);
    if (!err.empty()) {
        return fail(name, err);
    }
    if (depth != 0 || why.find("split mode tensor") == std::string::npos) {
        return fail(name, "the prefetch on the meta backend: depth " + std::to_string(depth) + ", reason '" + why + "'");
    }
    printf("ok %s: %s\n", name.c_str(), why.c_str());
    return 0;
}

static bool abort_now(void * data) {
    return *(bool *) data;
}

// a CPU split between two prefetched SIM splits aborts: the second upload, issued ahead, must not outlive the call
static int abort_mid_graph(const std::string & name) {
    fixture f;
    if (!f.init(prefetch_on())) {
        return fail(name, "no SIM0 device: run with GGML_SIM_DEVICES=1");
    }
    bool abort_flag = true;
    ggml_backend_cpu_set_abort_callback(f.cpu, abort_now, &abort_flag);
    ggml_tensor * x = f.input_x();
    ggml_tensor * y1 = f.mm(f.w1, x);
    ggml_tensor * h = ggml_scale(f.ctx_g, y1, 0.5f);
    ggml_backend_sched_set_tensor_backend(f.sched, h, f.cpu);
    ggml_tensor * y2 = f.mm(f.w2, h);
    ggml_cgraph * gf = f.graph_of(y2);
    const std::string alloc_error = f.alloc(gf);
    if (!alloc_error.empty()) {
        return fail(name, alloc_error);
    }
    const std::vector<float> xv = ones_x(0.25f);
    ggml_backend_tensor_set(x, xv.data(), 0, ggml_nbytes(x));
    const ggml_status st = ggml_backend_sched_graph_compute_async(f.sched, gf);
    const size_t pending = ggml_backend_sim_n_pending();
    if (st != GGML_STATUS_ABORTED) {
        return fail(name, "the computation was not aborted (status " + std::to_string((int) st) + ")");
    }
    if (pending != 0) {
        return fail(name, std::to_string(pending) + " SIM operations still queued after the aborted compute returned");
    }
    // the same graph again, not aborted: the slots hold what they should (the input again too: the CPU split
    // may have reused its memory, as llama.cpp's set_inputs before every computation assumes)
    abort_flag = false;
    ggml_backend_tensor_set(x, xv.data(), 0, ggml_nbytes(x));
    if (ggml_backend_sched_graph_compute(f.sched, gf) != GGML_STATUS_SUCCESS) {
        return fail(name, "compute after the abort failed");
    }
    std::vector<float> want = matmul(weight_values(1), xv, N);
    for (float & v : want) {
        v *= 0.5f;
    }
    std::string why;
    if (!close_to(f.get(y2), matmul(weight_values(2), want, N), why)) {
        return fail(name, "after the abort: " + why);
    }
    printf("ok %s\n", name.c_str());
    return 0;
}


// --- staging in bytes: chains of weights of their own sizes ---

// y = W_{n-1} (... W_0 x) on SIM, each W_i an f32 host weight of [dims[i], dims[i+1]] (a split of its own), values
// scaled so the activations stay near 1 however wide the layer
struct chain {
    fixture                         f;
    ggml_context *                  ctx = nullptr;
    ggml_backend_buffer_t           buf = nullptr;
    std::vector<int64_t>            dims;
    std::vector<ggml_tensor *>      w;
    std::vector<std::vector<float>> wv;

    ~chain() {
        ggml_backend_buffer_free(buf);
        ggml_free(ctx);
    }

    bool init(ggml_backend_sched_prefetch_params p, const std::vector<int64_t> & d) {
        if (!f.init(p)) {
            return false;
        }
        dims = d;
        ggml_init_params ip = { d.size() * ggml_tensor_overhead(), nullptr, true };
        ctx = ggml_init(ip);
        for (size_t i = 0; i + 1 < d.size(); i++) {
            w.push_back(ggml_new_tensor_2d(ctx, GGML_TYPE_F32, d[i], d[i + 1]));
            ggml_set_name(w.back(), ("c" + std::to_string(i)).c_str());
        }
        buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_cpu_buffer_type());
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        for (size_t i = 0; i < w.size(); i++) {
            std::vector<float> v(d[i] * d[i + 1]);
            for (size_t e = 0; e < v.size(); e++) {
                v[e] = (float) ((((e * 2654435761u) ^ (i * 40503u)) % 1000) / 1000.0 - 0.5) * 3.4f / std::sqrt((float) d[i]);
            }
            ggml_backend_tensor_set(w[i], v.data(), 0, ggml_nbytes(w[i]));
            wv.push_back(std::move(v));
        }
        return true;
    }

    ggml_cgraph *       gf = nullptr;
    ggml_tensor *       x  = nullptr;
    ggml_tensor *       y  = nullptr;
    std::vector<float>  xv;

    // the graph of M tokens, allocated, its input set; "" or why not
    std::string build() {
        x = ggml_new_tensor_2d(f.ctx_g, GGML_TYPE_F32, dims[0], M);
        ggml_set_input(x);
        y = x;
        for (ggml_tensor * wi : w) {
            y = f.mm(wi, y);
        }
        gf = f.graph_of(y);
        const std::string alloc_error = f.alloc(gf);
        xv.resize(dims[0] * M);
        for (size_t i = 0; i < xv.size(); i++) {
            xv[i] = 0.125f * (float) ((i % 7) + 1) - 0.4f;
        }
        if (alloc_error.empty()) {
            ggml_backend_tensor_set(x, xv.data(), 0, ggml_nbytes(x));
        }
        return alloc_error;
    }

    std::vector<float> want(const std::vector<float> & x, int64_t tokens) const {
        std::vector<float> cur = x;
        for (size_t i = 0; i < w.size(); i++) {
            const int64_t in = dims[i], out = dims[i + 1];
            std::vector<float> next(out * tokens);
            for (int64_t t = 0; t < tokens; t++) {
                for (int64_t o = 0; o < out; o++) {
                    double acc = 0;
                    for (int64_t c = 0; c < in; c++) {
                        acc += (double) wv[i][o * in + c] * cur[t * in + c];
                    }
                    next[t * out + o] = (float) acc;
                }
            }
            cur = std::move(next);
        }
        return cur;
    }

    // init, build and compute the graph once, checking its result; "" or why not (`wrong` before a wrong result)
    std::string run(ggml_backend_sched_prefetch_params p, const std::vector<int64_t> & d, const std::string & wrong = "") {
        if (!init(p, d)) {
            return "no SIM0 device: run with GGML_SIM_DEVICES=1";
        }
        const std::string alloc_error = build();
        if (!alloc_error.empty()) {
            return alloc_error;
        }
        if (ggml_backend_sched_graph_compute(f.sched, gf) != GGML_STATUS_SUCCESS) {
            return "compute failed";
        }
        std::string why;
        return close_to(f.get(y), want(xv, M), why) ? "" : wrong + why;
    }

    size_t largest() const {
        size_t l = 0;
        for (ggml_tensor * wi : w) {
            l = std::max(l, ggml_nbytes(wi));
        }
        return l;
    }
};

static size_t env_mib(const char * name) {
    const char * v = getenv(name);
    return v && *v ? (size_t) atoi(v) << 20 : 0;
}

// Two 2 MiB layers (256 -> 2048 -> 256) with four 256 KiB splits between them and two after: four splits ahead
// need 4 x 2 MiB in uniform slots, 4.5 MiB in a ring.
//   mixed: run with GGML_SIM_MEMORY_MIB too small for 8 MiB of staging (depth 4 of the largest split) but not for
//          the ring, or with GGML_SCHED_PREFETCH_STAGING_MIB below 8: every upload stays 4 splits ahead, in less
//          than depth x the largest split; a budget below the largest split is raised to it, which keeps the split
//          after it only 1 ahead: dropped
//   steps: a headroom no budget leaves free: the budget is halved down to the ring that keeps every upload 2
//          ahead (4 MiB), then dropped (the log lines say each step once, see test_prefetch.py)
static int mixed_sizes(const std::string & name, bool steps) {
    chain c;
    ggml_backend_sched_prefetch_params p = prefetch_on(32, 4);
    if (steps) {
        p.headroom = (size_t) 1 << 40;
    }
    if (!c.init(p, { K, 2048, K, K, K, K, K, 2048, K, K, K })) {
        return fail(name, "no SIM0 device: run with GGML_SIM_DEVICES=1");
    }
    const std::string alloc_error = c.build();
    if (!alloc_error.empty()) {
        return fail(name, alloc_error);
    }
    const std::vector<float> want = c.want(c.xv, M);
    std::string why;
    for (int rep = 0; rep < 3; rep++) {
        if (ggml_backend_sched_graph_compute(c.f.sched, c.gf) != GGML_STATUS_SUCCESS) {
            return fail(name, "compute failed");
        }
        if (!close_to(c.f.get(c.y), want, why)) {
            return fail(name, "repetition " + std::to_string(rep) + ": " + why);
        }
    }
    ggml_backend_sched_stats st;
    ggml_backend_sched_get_stats(c.f.sched, &st);
    const char * why_reduced = nullptr;
    const int    lookahead   = ggml_backend_sched_get_prefetch_depth(c.f.sched, c.f.sim, &why_reduced);
    const size_t staging     = ggml_backend_sched_get_prefetch_size(c.f.sched, c.f.sim);
    const size_t largest     = c.largest();
    const std::string got    = "lookahead " + std::to_string(lookahead) + ", staging " + std::to_string(staging) + " bytes" +
                               (why_reduced ? std::string(" (") + why_reduced + ")" : "");
    if (steps) {
        if (lookahead != 0 || staging != 0 || why_reduced == nullptr || strstr(why_reduced, "headroom") == nullptr) {
            return fail(name, "expected the prefetch dropped for the headroom: " + got);
        }
        printf("ok %s: %s\n", name.c_str(), why_reduced);
        return 0;
    }
    const size_t budget = env_mib("GGML_SCHED_PREFETCH_STAGING_MIB");
    if (budget > 0 && budget < largest) {
        // raised to the largest split, which keeps the split after it only 1 ahead: dropped
        if (staging != 0 || lookahead != 0 || st.n_prefetch_uploads != 0 || why_reduced == nullptr || strstr(why_reduced, "lookahead 1") == nullptr) {
            return fail(name, "a budget below the largest split: expected the prefetch dropped for lookahead 1; " + got +
                              ", " + std::to_string(st.n_prefetch_uploads) + " uploads");
        }
    } else if (lookahead != 4 || why_reduced != nullptr || staging >= 4 * largest || (budget > 0 && staging > budget) ||
               st.n_prefetch_uploads != 3 * c.w.size()) {
        return fail(name, "expected every upload 4 splits ahead in less than 4 x the largest split (" + std::to_string(4 * largest) +
                          " bytes)" + (budget > 0 ? " and within the budget of " + std::to_string(budget) : std::string()) + ": " + got +
                          ", " + std::to_string(st.n_prefetch_uploads) + " uploads");
    }
    printf("ok %s: %s, %llu uploads ahead\n", name.c_str(), got.c_str(), (unsigned long long) st.n_prefetch_uploads);
    return 0;
}

// Three 1 MiB splits in a staging budget of two (GGML_SCHED_PREFETCH_STAGING_MIB=2) at depth 4: the third placement
// reuses the first, so its upload must wait for the compute that read the place before it. Slow computes and fast
// copies: an upload that does not wait (GGML_SCHED_PREFETCH_DEBUG_UNSAFE) lands under the read of the first split,
// which then multiplies by the third weight.
static int ring_overlap(const std::string & name) {
    chain c;
    const std::string err = c.run(prefetch_on(32, 4), { 512, 512, 512, 512 }, "a place was overwritten before its last reader: ");
    if (!err.empty()) {
        return fail(name, err);
    }
    const size_t staging   = ggml_backend_sched_get_prefetch_size(c.f.sched, c.f.sim);
    const int    lookahead = ggml_backend_sched_get_prefetch_depth(c.f.sched, c.f.sim, nullptr);
    if (staging != 2 * c.largest() || lookahead != 2) {
        return fail(name, "expected the staging of two splits (" + std::to_string(2 * c.largest()) + " bytes), lookahead 2; got " +
                          std::to_string(staging) + " bytes, lookahead " + std::to_string(lookahead));
    }
    printf("ok %s: %zu bytes of staging for three splits, lookahead 2\n", name.c_str(), staging);
    return 0;
}

// --- from a cold read of the staging ring (results/prefetch-safety.md, "A cold read of the ring") ---

// the depth the mixed-sizes cases run at: GGML_SCHED_PREFETCH_DEPTH if set, else 4
static int env_depth(int def) {
    const char * v = getenv("GGML_SCHED_PREFETCH_DEPTH");
    return v && *v ? atoi(v) : def;
}

// The mixed-sizes shape under a budget of GGML_SCHED_PREFETCH_STAGING_MIB that cannot reach the depth
// (GGML_SCHED_PREFETCH_DEPTH, default 4): the result must be right; prints the lookahead, the staging and the reason
// for test_prefetch.py to judge (a budget is trimmed to what the lookahead it reaches needs, or the prefetch is
// dropped where that is one split).
static int mixed_budget(const std::string & name) {
    chain c;
    const std::string err = c.run(prefetch_on(32, env_depth(4)), { K, 2048, K, K, K, K, K, 2048, K, K, K });
    if (!err.empty()) {
        return fail(name, err);
    }
    const char * reason    = nullptr;
    const int    lookahead = ggml_backend_sched_get_prefetch_depth(c.f.sched, c.f.sim, &reason);
    printf("ok %s: lookahead %d, staging %zu bytes, largest split %zu bytes (%s)\n", name.c_str(), lookahead,
           ggml_backend_sched_get_prefetch_size(c.f.sched, c.f.sim), c.largest(), reason ? reason : "no reason");
    return 0;
}

// One 2 MiB weight, a split of its own, under GGML_SCHED_PREFETCH_STAGING_MIB=1: raised to the split, which keeps
// it `depth` ahead (nothing else is staged); the reason says it was raised.
static int one_split(const std::string & name) {
    chain c;
    const std::string err = c.run(prefetch_on(32, 4), { K, 2048 });
    if (!err.empty()) {
        return fail(name, err);
    }
    const char * reason    = nullptr;
    const int    lookahead = ggml_backend_sched_get_prefetch_depth(c.f.sched, c.f.sim, &reason);
    const size_t staging   = ggml_backend_sched_get_prefetch_size(c.f.sched, c.f.sim);
    if (lookahead != 4 || staging != c.largest() || reason == nullptr || strstr(reason, "raised") == nullptr) {
        return fail(name, "expected the budget raised to the split (" + std::to_string(c.largest()) + " bytes), lookahead 4, and a "
                          "reason that says so; got lookahead " + std::to_string(lookahead) + ", staging " + std::to_string(staging) +
                          " bytes (" + (reason ? reason : "no reason") + ")");
    }
    printf("ok %s: %s\n", name.c_str(), reason);
    return 0;
}

// A host-weight split on each of two devices (GGML_SIM_DEVICES=2 GGML_SIM_MEMORY_MIB=64, 32 MiB headroom); 40 MiB
// taken on SIM0 after the reservation stands for its backend's pool; then a graph whose SIM1 split reads two
// weights, so SIM1's arena grows: only SIM1's headroom is checked again, SIM0's staging stays.
static int headroom_other_device(const std::string & name) {
    ggml_backend_dev_t dev1 = ggml_backend_dev_by_name("SIM1");
    fixture f;
    ggml_backend_sched_prefetch_params p = prefetch_on(32, 4);
    p.headroom = 32u << 20;
    if (dev1 == nullptr || !f.init(p)) {
        return fail(name, "no SIM0 and SIM1: run with GGML_SIM_DEVICES=2 GGML_SIM_MEMORY_MIB=64");
    }
    ggml_backend_t sim1 = ggml_backend_dev_init(dev1, nullptr);
    ggml_backend_t backends[3] = { f.sim, sim1, f.cpu };
    ggml_backend_sched_free(f.sched);
    f.sched = ggml_backend_sched_new(backends, nullptr, 3, 1024, false, true);
    ggml_backend_sched_set_prefetch(f.sched, p);
    auto build = [&](bool wide) {
        ggml_tensor * x  = f.input_x();
        ggml_tensor * y1 = ggml_mul_mat(f.ctx_g, f.w1, x);
        ggml_backend_sched_set_tensor_backend(f.sched, y1, f.sim);
        ggml_tensor * y  = ggml_mul_mat(f.ctx_g, f.w2, y1);
        ggml_backend_sched_set_tensor_backend(f.sched, y, sim1);
        if (wide) {
            y = ggml_mul_mat(f.ctx_g, f.w1, y);
            ggml_backend_sched_set_tensor_backend(f.sched, y, sim1);
        }
        return f.graph_of(y);
    };
    const char * why0 = nullptr;
    std::string err;
    ggml_backend_buffer_t pool = nullptr;
    size_t staging0 = 0, staging1 = 0;
    int depth0 = 0;
    if (!ggml_backend_sched_reserve(f.sched, build(false))) {
        err = "reserve failed";
    } else if (ggml_backend_sched_get_prefetch_depth(f.sched, f.sim, nullptr) != 4 ||
               ggml_backend_sched_get_prefetch_depth(f.sched, sim1, nullptr) != 4) {
        err = "the reservation left less than the headroom already: give each SIM device 64 MiB";
    } else {
        staging0 = ggml_backend_sched_get_prefetch_size(f.sched, f.sim);
        staging1 = ggml_backend_sched_get_prefetch_size(f.sched, sim1);
        pool = ggml_backend_buft_alloc_buffer(ggml_backend_get_default_buffer_type(f.sim), 40u << 20);
        if (pool == nullptr) {
            err = "could not take 40 MiB of SIM0";
        } else if (!ggml_backend_sched_alloc_graph(f.sched, build(true))) {
            err = "alloc_graph of the wider graph failed";
        } else if (ggml_backend_sched_get_prefetch_size(f.sched, sim1) <= staging1) {
            err = "SIM1's arena was expected to grow for its wider split";
        } else {
            depth0 = ggml_backend_sched_get_prefetch_depth(f.sched, f.sim, &why0);
            if (depth0 != 4 || ggml_backend_sched_get_prefetch_size(f.sched, f.sim) != staging0) {
                err = "SIM1's arena growth re-checked SIM0's headroom: SIM0 lookahead " + std::to_string(depth0) + ", staging " +
                      std::to_string(ggml_backend_sched_get_prefetch_size(f.sched, f.sim)) + " bytes, was " + std::to_string(staging0) +
                      (why0 ? std::string(" (") + why0 + ")" : "");
            }
        }
    }
    ggml_backend_sched_free(f.sched);
    f.sched = nullptr;
    ggml_backend_buffer_free(pool);
    ggml_backend_free(sim1);
    if (!err.empty()) {
        return fail(name, err);
    }
    printf("ok %s: SIM0 kept lookahead 4 in %zu bytes while SIM1's arena grew\n", name.c_str(), staging0);
    return 0;
}

// a chain of `dims` under GGML_SCHED_PREFETCH_STAGING_MIB: computes it once, checks the result and prints the
// lookahead and the least share of an upload ahead of the compute before it; test_prefetch.py reads SIM's op log
// to see whether any upload overlapped a compute.
static int ring_oplog(const std::string & name, const std::vector<int64_t> & dims, int depth = 2) {
    chain c;
    const std::string err = c.run(prefetch_on(32, depth), dims);
    if (!err.empty()) {
        return fail(name, err);
    }
    const char * reason    = nullptr;
    const int    lookahead = ggml_backend_sched_get_prefetch_depth(c.f.sched, c.f.sim, &reason);
    ggml_backend_sched_stats st;
    ggml_backend_sched_get_stats(c.f.sched, &st);
    printf("ok %s: lookahead %d, staging %zu bytes (%s), ahead %.3f, %zu upload calls\n", name.c_str(), lookahead,
           ggml_backend_sched_get_prefetch_size(c.f.sched, c.f.sim), reason ? reason : "no reason",
           ggml_backend_sched_get_prefetch_ahead(c.f.sched, c.f.sim), (size_t) st.n_prefetch_uploads);
    return 0;
}

// the chain of HAZARD_CHAIN_DIMS (comma-separated widths) at depth GGML_SCHED_PREFETCH_DEPTH (4 when unset), as
// ring-oplog: for shapes whose lookahead is not monotonic in the budget, or whose ring leaves a sliver ahead
static int chain_dims(const std::string & name) {
    const char * dims_env = getenv("HAZARD_CHAIN_DIMS");
    std::vector<int64_t> dims;
    for (const char * p = dims_env ? dims_env : ""; *p != '\0';) {
        char * end = nullptr;
        dims.push_back(strtoll(p, &end, 10));
        p = *end == ',' ? end + 1 : end;
        if (end == p && *p != '\0') {
            break;
        }
    }
    if (dims.size() < 2) {
        return fail(name, "set HAZARD_CHAIN_DIMS to two or more comma-separated widths");
    }
    const char * depth_env = getenv("GGML_SCHED_PREFETCH_DEPTH");
    return ring_oplog(name, dims, depth_env ? atoi(depth_env) : 4);
}

// {512 x 4}, a 64-token graph (uploaded ahead, with the debug poison of each placement queued on the copy queue
// after its reader) then a 16-token graph below the min batch (its copies go straight into the same placements),
// with no synchronization between them; slow copies: the small graph must not race the poison still queued.
static int poison_then_small(const std::string & name) {
    chain c;
    if (!c.init(prefetch_on(32, 2), { 512, 512, 512, 512 })) {
        return fail(name, "no SIM0 device: run with GGML_SIM_DEVICES=1");
    }
    auto build = [&](int64_t tokens, ggml_tensor ** x, ggml_tensor ** y) {
        *x = ggml_new_tensor_2d(c.f.ctx_g, GGML_TYPE_F32, 512, tokens);
        ggml_set_input(*x);
        *y = *x;
        for (ggml_tensor * wi : c.w) {
            *y = c.f.mm(wi, *y);
        }
        return c.f.graph_of(*y);
    };
    auto input = [](int64_t tokens) {
        std::vector<float> v(512 * tokens);
        for (size_t i = 0; i < v.size(); i++) {
            v[i] = 0.125f * (float) ((i % 7) + 1) - 0.4f;
        }
        return v;
    };
    ggml_tensor * xl, * yl, * xs, * ys;
    ggml_cgraph * large = build(M, &xl, &yl);
    std::string err = c.f.alloc(large);
    if (!err.empty()) {
        return fail(name, err);
    }
    const std::vector<float> xlv = input(M), xsv = input(16);
    ggml_backend_tensor_set(xl, xlv.data(), 0, ggml_nbytes(xl));
    if (ggml_backend_sched_graph_compute_async(c.f.sched, large) != GGML_STATUS_SUCCESS) {
        return fail(name, "compute of the large graph failed");
    }
    std::vector<float> got_large(ggml_nelements(yl));
    ggml_backend_tensor_get_async(c.f.sim, yl, got_large.data(), 0, ggml_nbytes(yl));
    ggml_backend_sched_reset(c.f.sched);
    ggml_cgraph * small = build(16, &xs, &ys);
    err = c.f.alloc(small);
    if (!err.empty()) {
        return fail(name, err);
    }
    ggml_backend_tensor_set(xs, xsv.data(), 0, ggml_nbytes(xs));
    if (ggml_backend_sched_graph_compute_async(c.f.sched, small) != GGML_STATUS_SUCCESS) {
        return fail(name, "compute of the small graph failed");
    }
    ggml_backend_sched_synchronize(c.f.sched);
    std::string why;
    if (!close_to(got_large, c.want(xlv, M), why)) {
        return fail(name, "the large graph: " + why);
    }
    // want() takes any token count
    if (!close_to(c.f.get(ys), c.want(xsv, 16), why)) {
        return fail(name, "the small graph read a placement the poison overwrote: " + why);
    }
    const size_t n_races = ggml_backend_sim_n_races();
    if (n_races != 0) {
        return fail(name, std::to_string(n_races) + " SIM race(s): a host access raced queued work");
    }
    printf("ok %s: lookahead %d\n", name.c_str(), ggml_backend_sched_get_prefetch_depth(c.f.sched, c.f.sim, nullptr));
    return 0;
}

// an owner of w1 that writes its staged copy from bytes of its own (the expert cache's role); counts what it wrote
struct copy_owner {
    const ggml_tensor * weight = nullptr;
    std::vector<float> bytes;      // w1's values, held apart from w1
    size_t             written = 0;
    int                calls   = 0;
};

static ggml_backend_sched_copy_mode owner_mode(const ggml_tensor * weight, void * user_data) {
    const copy_owner & o = *(const copy_owner *) user_data;
    return weight == o.weight ? GGML_BACKEND_SCHED_COPY_NONE : GGML_BACKEND_SCHED_COPY_AHEAD;
}

static void owner_fill(const ggml_tensor * weight, ggml_tensor * copy, size_t offset, size_t size, ggml_backend_t queue,
                       void * user_data) {
    copy_owner & o = *(copy_owner *) user_data;
    if (weight != o.weight) {
        fprintf(stderr, "owner_fill: asked to fill %s, which its mode left to the scheduler\n", weight->name);
        abort();
    }
    ggml_backend_tensor_set_async(queue, copy, (const char *) o.bytes.data() + offset, offset, size);
    o.written += size;
    o.calls++;
}

// the copy callbacks: the owner writes w1's staged copy, the scheduler uploads w2; callbacks cleared (or replaced)
// after the allocation apply to the computes of that same allocation too, never calling a fill that is gone
static int copy_callbacks(const std::string & name) {
    fixture f;
    if (!f.init(prefetch_on())) {
        return fail(name, "no SIM0 device: run with GGML_SIM_DEVICES=1");
    }
    copy_owner owner;
    owner.weight = f.w1;
    owner.bytes  = weight_values(1);
    ggml_backend_sched_set_copy_callbacks(f.sched, owner_mode, owner_fill, &owner);
    const two_matmuls c(f);
    if (!c.error.empty()) {
        return fail(name, c.error);
    }
    std::string why;
    // 0, 1: the owner fills w1; 2: callbacks cleared; 3: another owner, of no weight of this graph
    copy_owner other;
    for (int rep = 0; rep < 4; rep++) {
        if (rep == 2) {
            ggml_backend_sched_set_copy_callbacks(f.sched, nullptr, nullptr, nullptr);
        } else if (rep == 3) {
            ggml_backend_sched_set_copy_callbacks(f.sched, owner_mode, owner_fill, &other);
        }
        ggml_backend_sched_reset_stats(f.sched);
        if (ggml_backend_sched_graph_compute(f.sched, c.gf) != GGML_STATUS_SUCCESS) {
            return fail(name, "compute " + std::to_string(rep) + " failed");
        }
        if (!close_to(f.get(c.y2), c.want, why)) {
            return fail(name, "compute " + std::to_string(rep) + ": " + why);
        }
        ggml_backend_sched_stats st;
        ggml_backend_sched_get_stats(f.sched, &st);
        const uint64_t want_uploads = rep < 2 ? 1 : 2; // w2 alone while the owner fills w1
        if (st.n_prefetch_uploads != want_uploads) {
            return fail(name, "compute " + std::to_string(rep) + ": " + std::to_string(st.n_prefetch_uploads) +
                              " uploads by the scheduler, expected " + std::to_string(want_uploads));
        }
    }
    if (owner.written != 2 * ggml_nbytes(f.w1) || other.calls != 0) {
        return fail(name, "the owner wrote " + std::to_string(owner.written) + " bytes in " + std::to_string(owner.calls) +
                          " calls, expected twice w1's " + std::to_string(ggml_nbytes(f.w1)) + "; the other owner was called " +
                          std::to_string(other.calls) + " times");
    }
    printf("ok %s: the owner wrote w1 twice (%d calls), then the scheduler uploaded it\n", name.c_str(), owner.calls);
    return 0;
}

static ggml_backend_sched_copy_mode w1_at_split(const ggml_tensor * weight, void * user_data) {
    return weight == (const ggml_tensor *) user_data ? GGML_BACKEND_SCHED_COPY_AT_SPLIT : GGML_BACKEND_SCHED_COPY_AHEAD;
}

static void no_fill(const ggml_tensor *, ggml_tensor *, size_t, size_t, ggml_backend_t, void *) {
    fprintf(stderr, "no_fill: called, but no weight has the mode NONE\n");
    abort();
}

// the copy mode AT_SPLIT: w1 is not staged (the arena holds w2 alone) and is copied when its split runs, w2 is
// uploaded ahead; the result is the same
static int copy_at_split(const std::string & name) {
    fixture f;
    if (!f.init(prefetch_on())) {
        return fail(name, "no SIM0 device: run with GGML_SIM_DEVICES=1");
    }
    ggml_backend_sched_set_copy_callbacks(f.sched, w1_at_split, no_fill, f.w1);
    const two_matmuls c(f);
    if (!c.error.empty()) {
        return fail(name, c.error);
    }
    std::string why;
    for (int rep = 0; rep < 2; rep++) {
        if (ggml_backend_sched_graph_compute(f.sched, c.gf) != GGML_STATUS_SUCCESS || !close_to(f.get(c.y2), c.want, why)) {
            return fail(name, "compute " + std::to_string(rep) + ": " + why);
        }
    }
    ggml_backend_sched_stats st;
    ggml_backend_sched_get_stats(f.sched, &st);
    const size_t staging = ggml_backend_sched_get_prefetch_size(f.sched, f.sim);
    if (st.n_prefetch_uploads != 2 || staging != ggml_nbytes(f.w2)) {
        return fail(name, std::to_string(st.n_prefetch_uploads) + " uploads ahead into " + std::to_string(staging) +
                          " bytes of staging, expected 2 into w2's " + std::to_string(ggml_nbytes(f.w2)));
    }
    printf("ok %s: w1 copied at split time, w2 staged (%zu bytes)\n", name.c_str(), staging);
    return 0;
}

// the registry proc ggml_backend_copy_regions_async on SIM: 100 device regions (odd sizes and offsets, reversed
// order) in one call, then 100 uploads from the host in one call, every byte where it belongs after a synchronize
static int copy_regions(const std::string & name) {
    fixture f;
    if (!f.init(prefetch_on())) {
        return fail(name, "no SIM0 device: run with GGML_SIM_DEVICES=1");
    }
    auto copy = (ggml_backend_copy_regions_async_t) ggml_backend_reg_get_proc_address(
            ggml_backend_dev_backend_reg(ggml_backend_get_device(f.sim)), GGML_BACKEND_COPY_REGIONS_PROC);
    if (copy == nullptr) {
        return fail(name, "SIM offers no " GGML_BACKEND_COPY_REGIONS_PROC);
    }
    const int n = 100, stride = 1000;
    ggml_init_params ip = { 4 * ggml_tensor_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * from = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, n * stride);
    ggml_tensor * to   = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, n * stride);
    ggml_tensor * up   = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, n * stride);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, f.sim);
    std::vector<char> host(n * stride), zeros(n * stride, 0);
    for (int i = 0; i < n * stride; i++) {
        host[i] = (char) (i * 31 + 7);
    }
    ggml_backend_tensor_set(from, host.data(), 0, host.size());
    ggml_backend_tensor_set(to, zeros.data(), 0, zeros.size());
    ggml_backend_tensor_set(up, zeros.data(), 0, zeros.size());
    std::vector<ggml_backend_copy_region> dev_regions, host_regions;
    for (int i = 0; i < n; i++) {
        const size_t skip = i % 7, size = stride - skip;
        dev_regions.push_back({ (char *) from->data + i * stride + skip, (char *) to->data + (n - 1 - i) * stride, size });
        host_regions.push_back({ host.data() + i * stride, (char *) up->data + (n - 1 - i) * stride + skip, size });
    }
    const int dev_calls  = copy(f.sim, dev_regions.data(), n, false);
    const int host_calls = copy(f.sim, host_regions.data(), n, true);
    ggml_backend_synchronize(f.sim);
    std::vector<char> got_to(n * stride), got_up(n * stride);
    ggml_backend_tensor_get(to, got_to.data(), 0, got_to.size());
    ggml_backend_tensor_get(up, got_up.data(), 0, got_up.size());
    std::string why;
    for (int i = 0; i < n && why.empty(); i++) {
        const size_t skip = i % 7;
        for (size_t b = 0; b < (size_t) stride && why.empty(); b++) {
            const char want_to = b < stride - skip ? host[i * stride + skip + b] : 0;
            const char want_up = b >= skip ? host[i * stride + b - skip] : 0;
            if (got_to[(n - 1 - i) * stride + b] != want_to || got_up[(n - 1 - i) * stride + b] != want_up) {
                why = "region " + std::to_string(i) + ", byte " + std::to_string(b) + " differs";
            }
        }
    }
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    if (!why.empty()) {
        return fail(name, why);
    }
    if (dev_calls != 1 || host_calls != 1) {
        return fail(name, std::to_string(dev_calls) + " and " + std::to_string(host_calls) + " calls, expected 1 and 1");
    }
    printf("ok %s: 100 device regions and 100 uploads, one call each\n", name.c_str());
    return 0;
}

int main(int argc, char ** argv) {
    struct test_case {
        const char * name;
        int (*run)(const std::string & name);
    };
    static const test_case cases[] = {
        { "baseline",             [](const std::string & n) { return two_splits(n, 32, true); } },
        // run with a device too small for 4 slots of the largest split: the two splits in a ring of two keep every
        // upload 4 ahead (as far as the graph goes)
        { "shrink",               [](const std::string & n) { return two_splits(n, 32, true, 4); } },
        // below min_batch: routed-only path into the placements, nothing ahead
        { "small-batch",          [](const std::string & n) { return two_splits(n, M + 1, false); } },
        { "input-view",           input_view },
        { "graph-writes-weight",  graph_writes_weight },
        { "arena-too-large",      [](const std::string & n) { return dropped(n, false); } },
        { "headroom",             [](const std::string & n) { return dropped(n, true); } },
        { "abort",                abort_mid_graph },
        { "small-then-large",     small_then_large },
        { "reserve-then-larger",  reserve_then_larger },
        { "headroom-at-alloc",    headroom_at_alloc },
        { "other-buffer-fails",   [](const std::string & n) { return other_buffer_fails(n, true); } },
        { "earlier-buffer-fails", [](const std::string & n) { return other_buffer_fails(n, false); } },
        { "headroom-later",       headroom_later },
        { "small-only",           small_only },
        { "meta-input",           meta_input },
        { "mixed-sizes",          [](const std::string & n) { return mixed_sizes(n, false); } },
        { "budget-steps",         [](const std::string & n) { return mixed_sizes(n, true); } },
        { "ring-overlap",         ring_overlap },
        { "mixed-budget",         mixed_budget },
        { "one-split",            one_split },
        { "headroom-other-device", headroom_other_device },
        // three 1 MiB splits
        { "ring-oplog",           [](const std::string & n) { return ring_oplog(n, { 512, 512, 512, 512 }); } },
        // four 2 MiB splits: a 3 MiB ring holds one and half of the next
        { "ring-oplog-wide",      [](const std::string & n) { return ring_oplog(n, { 512, 1024, 512, 1024, 512 }); } },
        { "chain-dims",           chain_dims },
        { "poison-then-small",    poison_then_small },
        { "copy-callbacks",       copy_callbacks },
        { "copy-at-split",        copy_at_split },
        { "copy-regions",         copy_regions },
    };
    if (argc == 2) {
        for (const test_case & c : cases) {
            if (argv[1] == std::string(c.name)) {
                return c.run(c.name);
            }
        }
    }
    fprintf(stderr, "usage: %s CASE, CASE one of:", argv[0]);
    for (const test_case & c : cases) {
        fprintf(stderr, " %s", c.name);
    }
    fprintf(stderr, "\n");
    return 2;
}
