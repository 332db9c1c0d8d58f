// test_async_cpu.cpp: the scheduler's asynchronous CPU splits (ggml_backend_sched_set_async_cpu) on the SIM test-double
// device (GGML_SIM_DEVICES=1) of a patched build. Each case builds a small graph with a CPU split and SIM splits,
// computes it with the worker off and on, and checks the values (and, where the case says, the wall time).
//
//   test_async_cpu CASE      CASE: overlap | join | download | reader | fail | abort | reuse | integrated
//
//   overlap   a CPU split (a custom op that sleeps CPU_MS) beside an independent SIM split (SIM compute latency):
//             prints both wall times; the caller compares them with the two durations
//   join      the same, then a SIM node that adds both results: the SIM split is cut before it, so the independent
//             part still overlaps, and the sum is right
//   download  a CPU split reads what a SIM split computed: the download is queued on SIM's stream and the worker
//             waits for it (slow SIM copies); GGML_SCHED_ASYNC_CPU_DEBUG_UNSAFE=1 (no wait) must fail it
//   reader    a SIM split reads what a slow CPU split computes (GGML_SCHED_ASYNC_CPU_DEBUG_DELAY_US): the join
//             waits; GGML_SCHED_ASYNC_CPU_DEBUG_UNSAFE=2 (no join before readers) must fail it
//   fail      GGML_SCHED_ASYNC_CPU_DEBUG_FAIL=2: the second compute reports the worker's failure, the third is right
//   abort     the CPU backend's abort callback fires during the worker's split: the compute reports it, the next is right
//   reuse     the scheduler reset and reserved again between computes, the worker on: every compute right
//   integrated  `reader` on an integrated SIM (GGML_SIM_INTEGRATED=1), which reads the CPU's buffers in place: the
//             worker runs nothing there
//
// Inputs change at every repetition, so a value left over from the one before is caught. Prints "ok CASE: ..." and
// exits 0, or "FAIL CASE: ..." and exits 1.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

static const int64_t NE = 4096; // elements of each tensor

static int fail(const std::string & name, const std::string & why) {
    printf("FAIL %s: %s\n", name.c_str(), why.c_str());
    return 1;
}

static int env_int(const char * name, int def) {
    const char * v = getenv(name);
    return v != nullptr && *v != '\0' ? atoi(v) : def;
}

// the CPU's side: dst = 3 a + 1, after sleeping CPU_MS (thread 0 sleeps, so the op takes that long at any thread count)
static void slow_cpu_op(ggml_tensor * dst, const ggml_tensor * a, int ith, int nth, void * userdata) {
    const int ms = *(const int *) userdata;
    if (ith == 0 && ms > 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    }
    const int64_t n = ggml_nelements(dst);
    for (int64_t i = ith; i < n; i += nth) {
        ((float *) dst->data)[i] = 3.0f * ((const float *) a->data)[i] + 1.0f;
    }
}

struct fixture {
    ggml_backend_t       sim = nullptr;
    ggml_backend_t       cpu = nullptr;
    ggml_backend_sched_t sched = nullptr;
    ggml_context *       ctx = nullptr;
    int                  cpu_ms = 0;

    bool init(int graph_size = 256) {
        ggml_backend_dev_t dev = ggml_backend_dev_by_name("SIM0");
        if (dev == nullptr) {
            return false;
        }
        sim = ggml_backend_dev_init(dev, nullptr);
        cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
        ggml_backend_cpu_set_n_threads(cpu, 2);
        ggml_backend_t backends[2] = { sim, cpu };
        // the CPU computes in SIM's page-locked host buffers, as llama.cpp sets it up beside a GPU
        ggml_backend_buffer_type_t bufts[2] = { ggml_backend_get_default_buffer_type(sim), ggml_backend_dev_host_buffer_type(dev) };
        sched = ggml_backend_sched_new(backends, bufts, 2, graph_size, false, true);
        ggml_init_params ip = { 64 * ggml_tensor_overhead() + 2 * ggml_graph_overhead(), nullptr, true };
        ctx = ggml_init(ip);
        cpu_ms = env_int("CPU_MS", 0);
        return true;
    }

    ~fixture() {
        ggml_backend_sched_free(sched);
        ggml_free(ctx);
        ggml_backend_free(sim);
        ggml_backend_free(cpu);
    }

    ggml_tensor * input() {
        ggml_tensor * x = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, NE);
        ggml_set_input(x);
        return x;
    }

    // where each node runs; a reset of the scheduler forgets it, so reset() sets it again
    std::vector<std::pair<ggml_tensor *, ggml_backend_t>> placed;

    ggml_tensor * on_cpu(ggml_tensor * t) {
        placed.emplace_back(t, cpu);
        ggml_backend_sched_set_tensor_backend(sched, t, cpu);
        return t;
    }

    ggml_tensor * on_sim(ggml_tensor * t) {
        placed.emplace_back(t, sim);
        ggml_backend_sched_set_tensor_backend(sched, t, sim);
        return t;
    }

    void reset() {
        ggml_backend_sched_reset(sched);
        for (auto & [t, backend] : placed) {
            ggml_backend_sched_set_tensor_backend(sched, t, backend);
        }
    }

    ggml_tensor * slow_cpu(ggml_tensor * a) {
        return on_cpu(ggml_map_custom1(ctx, a, slow_cpu_op, 1, &cpu_ms));
    }

    std::vector<float> get(ggml_tensor * t) {
        std::vector<float> v(ggml_nelements(t));
        ggml_backend_tensor_get(t, v.data(), 0, ggml_nbytes(t));
        return v;
    }

    void set(ggml_tensor * t, float base) {
        std::vector<float> v(ggml_nelements(t));
        for (size_t i = 0; i < v.size(); i++) {
            v[i] = base + (float) (i % 13);
        }
        ggml_backend_tensor_set(t, v.data(), 0, ggml_nbytes(t));
    }
};

// the values each tensor must hold for input base b at element i
static float x_at(float b, int64_t i) { return b + (float) (i % 13); }

static bool check(const std::vector<float> & got, float (*want)(float, int64_t), float b, std::string & why) {
    for (size_t i = 0; i < got.size(); i++) {
        const float w = want(b, (int64_t) i);
        if (!(std::fabs(got[i] - w) <= 1e-4f * (1.0f + std::fabs(w)))) {
            char buf[160];
            snprintf(buf, sizeof(buf), "element %zu is %g, expected %g (input base %g)", i, got[i], w, b);
            why = buf;
            return false;
        }
    }
    return true;
}

static double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

static float cpu_side(float b, int64_t i) { return 3.0f * x_at(b, i) + 1.0f; }
static float sim_side(float b, int64_t i) { return 2.0f * x_at(b, i); }
static float joined(float b, int64_t i) { return cpu_side(b, i) + sim_side(b, i); }
static float after_download(float b, int64_t i) { return 3.0f * sim_side(b, i) + 1.0f; }
static float after_reader(float b, int64_t i) { return 2.0f * cpu_side(b, i); }

using want_fn = float (*)(float, int64_t);

// a graph of one case: its input, and its outputs with the values they must hold
struct built {
    ggml_cgraph *                                gf = nullptr;
    ggml_tensor *                                x  = nullptr;
    std::vector<std::pair<ggml_tensor *, want_fn>> outs;
};
using builder = built (*)(fixture &);

// a new graph in a new context: the scheduler rewrites a graph's sources to its copies when it splits it, so a graph
// is allocated once (llama builds one per ubatch)
static built rebuild(fixture & f, builder make) {
    ggml_backend_sched_reset(f.sched);
    f.placed.clear();
    ggml_free(f.ctx);
    ggml_init_params ip = { 64 * ggml_tensor_overhead() + 2 * ggml_graph_overhead(), nullptr, true };
    f.ctx = ggml_init(ip);
    built g = make(f);
    f.reset();
    return g;
}

static std::string checked(fixture & f, const built & g, float b) {
    std::string why;
    for (auto & [t, want] : g.outs) {
        if (!check(f.get(t), want, b, why)) {
            return why;
        }
    }
    return "";
}

// computes the case's graph 4 times with the worker off, then on; checks the outputs; the mean wall time of each side
static int off_and_on(fixture & f, const std::string & name, builder make, double * ms_off, double * ms_on,
                      int * splits_off = nullptr, int * splits_on = nullptr) {
    const int reps = 4;
    for (int on = 0; on <= 1; on++) {
        ggml_backend_sched_set_async_cpu(f.sched, on != 0);
        const built g = rebuild(f, make);
        if (!ggml_backend_sched_alloc_graph(f.sched, g.gf)) {
            return fail(name, "alloc_graph failed");
        }
        int * splits = on ? splits_on : splits_off;
        if (splits != nullptr) {
            *splits = ggml_backend_sched_get_n_splits(f.sched);
        }
        double total = 0;
        for (int rep = 0; rep < reps; rep++) {
            const float b = 10.0f * (rep + 1) + on;
            f.set(g.x, b);
            const auto t0 = std::chrono::steady_clock::now();
            if (ggml_backend_sched_graph_compute(f.sched, g.gf) != GGML_STATUS_SUCCESS) {
                return fail(name, std::string("compute failed with the worker ") + (on ? "on" : "off"));
            }
            total += ms_since(t0);
            const std::string why = checked(f, g, b);
            if (!why.empty()) {
                return fail(name, std::string("worker ") + (on ? "on" : "off") + ", repetition " + std::to_string(rep) + ": " + why);
            }
        }
        (on ? *ms_on : *ms_off) = total / reps;
    }
    return 0;
}

static ggml_cgraph * graph_of(fixture & f, std::initializer_list<ggml_tensor *> outs) {
    ggml_cgraph * gf = ggml_new_graph(f.ctx);
    for (ggml_tensor * t : outs) {
        ggml_set_output(t);
        ggml_build_forward_expand(gf, t);
    }
    return gf;
}

// a slow CPU op and an independent SIM op on the same input, both outputs
static built make_overlap(fixture & f) {
    built g;
    g.x = f.input();
    ggml_tensor * a = f.slow_cpu(g.x);
    ggml_tensor * b = f.on_sim(ggml_scale(f.ctx, g.x, 2.0f));
    g.gf   = graph_of(f, {a, b});
    g.outs = {{a, cpu_side}, {b, sim_side}};
    return g;
}

// the same, merged on SIM
static built make_join(fixture & f) {
    built g;
    g.x = f.input();
    ggml_tensor * a = f.slow_cpu(g.x);
    ggml_tensor * b = f.on_sim(ggml_scale(f.ctx, g.x, 2.0f));
    ggml_tensor * c = f.on_sim(ggml_add(f.ctx, a, b));
    g.gf   = graph_of(f, {c});
    g.outs = {{c, joined}};
    return g;
}

// a CPU op on what SIM computed
static built make_download(fixture & f) {
    built g;
    g.x = f.input();
    ggml_tensor * y = f.on_sim(ggml_scale(f.ctx, g.x, 2.0f));
    ggml_tensor * z = f.slow_cpu(y);
    g.gf   = graph_of(f, {z});
    g.outs = {{z, after_download}};
    return g;
}

// a SIM op on what the CPU computed
static built make_reader(fixture & f) {
    built g;
    g.x = f.input();
    ggml_tensor * a = f.slow_cpu(g.x);
    ggml_tensor * c = f.on_sim(ggml_scale(f.ctx, a, 2.0f));
    g.gf   = graph_of(f, {c});
    g.outs = {{c, after_reader}};
    return g;
}

static int timed_case(const std::string & name, builder make, bool count_splits) {
    fixture f;
    if (!f.init()) {
        return fail(name, "no SIM0 device: run with GGML_SIM_DEVICES=1");
    }
    double off = 0, on = 0;
    int splits_off = 0, splits_on = 0;
    if (int rc = off_and_on(f, name, make, &off, &on, &splits_off, &splits_on)) {
        return rc;
    }
    ggml_backend_sched_stats st;
    ggml_backend_sched_get_stats(f.sched, &st);
    if (st.n_async_cpu_splits == 0) {
        return fail(name, "no CPU split ran on the worker");
    }
    // join: off, CPU [a] and SIM [b, c]; on, SIM's split ends before c, the first node that reads the CPU's result
    if (count_splits && splits_on != splits_off + 1) {
        return fail(name, "splits: " + std::to_string(splits_off) + " off, " + std::to_string(splits_on) + " on, expected one more on");
    }
    printf("ok %s: off %.1f ms, on %.1f ms (cpu split %d ms; splits %d off, %d on; %llu on the worker, %llu joins waited)\n",
           name.c_str(), off, on, f.cpu_ms, splits_off, splits_on, (unsigned long long) st.n_async_cpu_splits,
           (unsigned long long) st.n_async_cpu_joins_waited);
    return 0;
}

// the reader's graph computed once per entry of expect with the worker on; expect[i]: the status of compute i
static int statuses(fixture & f, const std::string & name, const std::vector<ggml_status> & expect) {
    ggml_backend_sched_set_async_cpu(f.sched, true);
    for (size_t i = 0; i < expect.size(); i++) {
        const built g = rebuild(f, make_reader);
        if (!ggml_backend_sched_alloc_graph(f.sched, g.gf)) {
            return fail(name, "alloc_graph failed");
        }
        const float b = 5.0f * (i + 1);
        f.set(g.x, b);
        const ggml_status st = ggml_backend_sched_graph_compute(f.sched, g.gf);
        if (st != expect[i]) {
            return fail(name, "compute " + std::to_string(i + 1) + ": status " + ggml_status_to_string(st) + ", expected " +
                              ggml_status_to_string(expect[i]));
        }
        const std::string why = st == GGML_STATUS_SUCCESS ? checked(f, g, b) : "";
        if (!why.empty()) {
            return fail(name, "compute " + std::to_string(i + 1) + ": " + why);
        }
    }
    return 0;
}

// an integrated GPU (GGML_SIM_INTEGRATED=1) uses the CPU's buffers in place: the SIM split reads the CPU's result
// with no input copy, so nothing may run beside the worker there
static int case_integrated(const std::string & name) {
    fixture f;
    if (!f.init()) {
        return fail(name, "no SIM0 device: run with GGML_SIM_DEVICES=1");
    }
    double off = 0, on = 0;
    if (int rc = off_and_on(f, name, make_reader, &off, &on)) {
        return rc;
    }
    ggml_backend_sched_stats st;
    ggml_backend_sched_get_stats(f.sched, &st);
    if (ggml_backend_sched_get_async_cpu(f.sched) || st.n_async_cpu_splits != 0) {
        return fail(name, "CPU splits ran on the worker beside a device that reads them in place");
    }
    printf("ok %s: right with the worker set, which ran nothing (off %.1f ms, on %.1f ms)\n", name.c_str(), off, on);
    return 0;
}

static int case_fail(const std::string & name) {
    fixture f;
    if (!f.init()) {
        return fail(name, "no SIM0 device: run with GGML_SIM_DEVICES=1");
    }
    if (int rc = statuses(f, name, {GGML_STATUS_SUCCESS, GGML_STATUS_FAILED, GGML_STATUS_SUCCESS})) {
        return rc;
    }
    printf("ok %s: the worker's failure was the second compute's status\n", name.c_str());
    return 0;
}

static std::atomic<int> g_abort_calls{0};
static std::atomic<int> g_abort_at{0};

// fires once, on the call numbered g_abort_at
static bool abort_once(void *) {
    const int n = ++g_abort_calls;
    return n == g_abort_at.load();
}

static int case_abort(const std::string & name) {
    fixture f;
    if (!f.init()) {
        return fail(name, "no SIM0 device: run with GGML_SIM_DEVICES=1");
    }
    ggml_backend_cpu_set_abort_callback(f.cpu, abort_once, nullptr);
    // the first compute counts the callback's calls; the second aborts at the first of them, the third is right
    if (int rc = statuses(f, name, {GGML_STATUS_SUCCESS})) {
        return rc;
    }
    const int per_compute = g_abort_calls.load();
    if (per_compute == 0) {
        return fail(name, "the CPU backend never asked the abort callback");
    }
    g_abort_calls = 0;
    g_abort_at    = 1;
    if (int rc = statuses(f, name, {GGML_STATUS_ABORTED, GGML_STATUS_SUCCESS})) {
        return rc;
    }
    printf("ok %s: aborted on the worker, then right (%d abort checks a compute)\n", name.c_str(), per_compute);
    return 0;
}

static int case_reuse(const std::string & name) {
    fixture f;
    if (!f.init()) {
        return fail(name, "no SIM0 device: run with GGML_SIM_DEVICES=1");
    }
    ggml_backend_sched_set_async_cpu(f.sched, true);
    for (int round = 0; round < 4; round++) {
        // reserved with one graph, then a new graph of the same shape allocated and computed, as llama does per ubatch
        const built reserved = rebuild(f, make_join);
        if (!ggml_backend_sched_reserve(f.sched, reserved.gf)) {
            return fail(name, "reserve failed");
        }
        for (int rep = 0; rep < 2; rep++) {
            const built g = rebuild(f, make_join);
            if (!ggml_backend_sched_alloc_graph(f.sched, g.gf)) {
                return fail(name, "alloc_graph failed");
            }
            const float b = 7.0f * (round * 2 + rep + 1);
            f.set(g.x, b);
            if (ggml_backend_sched_graph_compute_async(f.sched, g.gf) != GGML_STATUS_SUCCESS) {
                return fail(name, "compute failed");
            }
            ggml_backend_sched_synchronize(f.sched);
            const std::string why = checked(f, g, b);
            if (!why.empty()) {
                return fail(name, "round " + std::to_string(round) + ", repetition " + std::to_string(rep) + ": " + why);
            }
        }
    }
    printf("ok %s: 4 reservations, each followed by 2 graphs computed with the worker on\n", name.c_str());
    return 0;
}

int main(int argc, char ** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s overlap|join|download|reader|fail|abort|reuse|integrated\n", argv[0]);
        return 2;
    }
    ggml_backend_load_all();
    const std::string name = argv[1];
    if (name == "overlap")  return timed_case(name, make_overlap, false);
    if (name == "join")     return timed_case(name, make_join, true);
    if (name == "download") return timed_case(name, make_download, false);
    if (name == "reader")   return timed_case(name, make_reader, false);
    if (name == "fail")     return case_fail(name);
    if (name == "integrated") return case_integrated(name);
    if (name == "abort")    return case_abort(name);
    if (name == "reuse")    return case_reuse(name);
    fprintf(stderr, "unknown case %s\n", name.c_str());
    return 2;
}
