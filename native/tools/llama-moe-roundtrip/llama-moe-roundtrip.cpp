// llama-moe-roundtrip: the budget of one MoE layer's experts computed on the CPU while the rest of decode runs on a
// GPU. Per layer and step it times the four legs of the round trip, as the scheduler runs them:
//   d2h    the tokens' activations and expert ids downloaded from the GPU into page-locked host memory
//   cpu    the experts' up, gate and down matmuls (MUL_MAT_ID, the model's type, host weights in their plain layout,
//          not repacked) and the weighted sum, on the CPU backend's pool
//   h2d    the result uploaded back to the GPU
//   join   the hand-off to the scheduler's CPU worker and back (an empty split posted and joined)
// for each token count, with the GPU idle and with it busy (a second stream running large matmuls), at the thread
// count given. It also measures, at the same time, the CPU's expert throughput (the bytes of the experts the step
// read over the cpu leg) and the link's (a 64 MiB page-locked upload), and the cost of one GPU split: a small graph
// computed and synchronized, which ggml-cuda replays as a CUDA graph.
//
// Output: a table on stderr and one JSON object per line on stdout.

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

// the scheduler's own worker (ggml/src), so the join leg is the hand-off decode pays
#include "ggml-sched-cpu-worker.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

struct params {
    std::vector<int> tokens   = { 1, 4, 8, 16 };
    int              threads  = 0; // 0: the cores less one (the launching thread's)
    int              reps     = 50;
    int64_t          n_embd   = 2048; // Qwen3-30B-A3B
    int64_t          n_ff     = 768;
    int64_t          n_expert = 128;
    int64_t          top_k    = 8;
    ggml_type        type     = GGML_TYPE_Q4_0;
};

static void usage(const char * argv0) {
    fprintf(stderr,
            "usage: %s [options]\n"
            "  --tokens LIST     token counts, comma-separated (default 1,4,8,16)\n"
            "  -t, --threads N   CPU threads of the matmuls, 1..256 (default: cores less one)\n"
            "  --reps N          timed steps per row, 5..100000 (default 50)\n"
            "  --type T          q4_0, q8_0 or f16 (default q4_0)\n"
            "  --shape E,F,X,K   n_embd, n_ff of an expert, experts, experts per token (default 2048,768,128,8)\n",
            argv0);
}

static bool parse_int(const char * s, long lo, long hi, long * out) {
    char * end = nullptr;
    const long v = strtol(s, &end, 10);
    if (end == s || *end != '\0' || v < lo || v > hi) {
        return false;
    }
    *out = v;
    return true;
}

static bool parse_list(const char * s, long lo, long hi, std::vector<long> & out) {
    std::string str(s);
    size_t pos = 0;
    while (pos <= str.size()) {
        const size_t comma = str.find(',', pos);
        const std::string item = str.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
        long v;
        if (!parse_int(item.c_str(), lo, hi, &v)) {
            return false;
        }
        out.push_back(v);
        if (comma == std::string::npos) {
            break;
        }
        pos = comma + 1;
    }
    return !out.empty();
}

// one bad argument: one line naming it and what it takes, exit 2
static int bad(const char * what, const char * fix) {
    fprintf(stderr, "error: %s: %s\n", what, fix);
    return 2;
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// a 3-d expert weight of `type` with random values, in plain host memory of the CPU backend (never repacked)
static ggml_tensor * expert_weight(ggml_context * ctx, ggml_type type, int64_t k, int64_t n, int64_t e, const char * name) {
    ggml_tensor * t = ggml_new_tensor_3d(ctx, type, k, n, e);
    ggml_set_name(t, name);
    return t;
}

static void fill_weight(ggml_tensor * t, std::mt19937 & rng) {
    const int64_t k = t->ne[0], rows = t->ne[1] * t->ne[2];
    std::normal_distribution<float> nd(0.0f, 0.02f);
    std::vector<float> row(k);
    const size_t row_bytes = ggml_row_size(t->type, k);
    std::vector<uint8_t> q(row_bytes);
    for (int64_t r = 0; r < rows; r++) {
        for (auto & x : row) {
            x = nd(rng);
        }
        ggml_quantize_chunk(t->type, row.data(), q.data(), 0, 1, k, nullptr);
        ggml_backend_tensor_set(t, q.data(), r * row_bytes, row_bytes);
    }
}

// a second stream that keeps the GPU busy with large f16 matmuls until stop
struct gpu_load {
    std::atomic<bool> stop{false};
    std::thread       thread;

    void start(ggml_backend_dev_t dev) {
        thread = std::thread([this, dev] {
            ggml_backend_t be = ggml_backend_dev_init(dev, nullptr);
            ggml_init_params ip = { 8 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
            ggml_context * ctx = ggml_init(ip);
            ggml_tensor * a = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, 8192, 8192);
            ggml_tensor * b = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, 8192, 512);
            ggml_tensor * c = ggml_mul_mat(ctx, a, b);
            ggml_cgraph * gf = ggml_new_graph(ctx);
            ggml_build_forward_expand(gf, c);
            ggml_gallocr_t galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(be));
            ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, be);
            ggml_gallocr_alloc_graph(galloc, gf);
            while (!stop.load()) {
                ggml_backend_graph_compute(be, gf);
            }
            ggml_gallocr_free(galloc);
            ggml_backend_buffer_free(buf);
            ggml_free(ctx);
            ggml_backend_free(be);
        });
    }

    void finish() {
        if (thread.joinable()) {
            stop = true;
            thread.join();
        }
    }
};

// GB/s of a 64 MiB page-locked upload, the median of 5
static double link_gbps(ggml_backend_t gpu, ggml_backend_dev_t dev) {
    const size_t n = 64u << 20;
    ggml_init_params ip = { ggml_tensor_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * dst = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, (int64_t) n);
    ggml_backend_buffer_t dbuf = ggml_backend_alloc_ctx_tensors(ctx, gpu);
    ggml_backend_buffer_t hbuf = ggml_backend_buft_alloc_buffer(ggml_backend_dev_host_buffer_type(dev), n);
    memset(ggml_backend_buffer_get_base(hbuf), 0x5a, n);
    std::vector<double> g;
    for (int i = 0; i < 6; i++) {
        const int64_t t0 = ggml_time_us();
        ggml_backend_tensor_set_async(gpu, dst, ggml_backend_buffer_get_base(hbuf), 0, n);
        ggml_backend_synchronize(gpu);
        if (i > 0) { // the first pays for lazy driver set-up
            g.push_back((double) n / (double) std::max<int64_t>(ggml_time_us() - t0, 1) * 1e-3);
        }
    }
    ggml_backend_buffer_free(hbuf);
    ggml_backend_buffer_free(dbuf);
    ggml_free(ctx);
    return median(g);
}

// microseconds of one small GPU split (8 element-wise nodes) computed and synchronized: what each extra split of a
// decode step costs the launching thread
static double split_us(ggml_backend_t gpu, int reps) {
    ggml_init_params ip = { 16 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * x = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 2048);
    ggml_tensor * y = x;
    for (int i = 0; i < 8; i++) {
        y = i % 2 ? ggml_add(ctx, y, x) : ggml_scale(ctx, y, 0.5f);
    }
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, gpu);
    std::vector<float> zero(2048, 0.0f);
    ggml_backend_tensor_set(x, zero.data(), 0, ggml_nbytes(x));
    ggml_gallocr_t galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(gpu));
    ggml_gallocr_alloc_graph(galloc, gf);
    std::vector<double> us;
    for (int i = 0; i < reps + 10; i++) {
        const int64_t t0 = ggml_time_us();
        ggml_backend_graph_compute(gpu, gf);
        if (i >= 10) { // capture and warm-up first
            us.push_back((double) (ggml_time_us() - t0));
        }
    }
    ggml_gallocr_free(galloc);
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    return median(us);
}

struct row {
    int    tokens = 0;
    bool   busy   = false;
    double d2h = 0, cpu = 0, h2d = 0, join = 0;
    double expert_bytes = 0; // bytes of the distinct experts one step reads
};

int main(int argc, char ** argv) {
    params p;
    for (int i = 1; i < argc; i++) {
        const std::string a = argv[i];
        auto value = [&](const char * what) -> const char * {
            if (i + 1 >= argc) {
                exit(bad(what, "needs a value"));
            }
            return argv[++i];
        };
        long v;
        if (a == "-h" || a == "--help") {
            usage(argv[0]);
            return 0;
        } else if (a == "--tokens") {
            std::vector<long> l;
            if (!parse_list(value("--tokens"), 1, 512, l)) {
                return bad("--tokens", "use token counts 1..512, comma-separated");
            }
            p.tokens.assign(l.begin(), l.end());
        } else if (a == "-t" || a == "--threads") {
            if (!parse_int(value("--threads"), 1, 256, &v)) {
                return bad("--threads", "use a thread count 1..256");
            }
            p.threads = (int) v;
        } else if (a == "--reps") {
            if (!parse_int(value("--reps"), 5, 100000, &v)) {
                return bad("--reps", "use 5..100000 steps");
            }
            p.reps = (int) v;
        } else if (a == "--type") {
            const std::string t = value("--type");
            if (t == "q4_0") p.type = GGML_TYPE_Q4_0;
            else if (t == "q8_0") p.type = GGML_TYPE_Q8_0;
            else if (t == "f16") p.type = GGML_TYPE_F16;
            else return bad("--type", "use q4_0, q8_0 or f16");
        } else if (a == "--shape") {
            std::vector<long> l;
            if (!parse_list(value("--shape"), 1, 1 << 20, l) || l.size() != 4 || l[3] > l[2] || l[0] % 32 || l[1] % 32) {
                return bad("--shape", "use n_embd,n_ff,n_expert,top_k with n_embd and n_ff multiples of 32, top_k <= n_expert");
            }
            p.n_embd = l[0]; p.n_ff = l[1]; p.n_expert = l[2]; p.top_k = l[3];
        } else {
            return bad(a.c_str(), "unknown option (see --help)");
        }
    }
    if (p.threads == 0) {
        p.threads = std::max(1, (int) std::thread::hardware_concurrency() - 1);
    }

    ggml_backend_load_all();
    ggml_backend_dev_t gpu_dev = nullptr;
    for (size_t i = 0; i < ggml_backend_dev_count() && !gpu_dev; i++) {
        if (ggml_backend_dev_type(ggml_backend_dev_get(i)) == GGML_BACKEND_DEVICE_TYPE_GPU) {
            gpu_dev = ggml_backend_dev_get(i);
        }
    }
    if (gpu_dev == nullptr || ggml_backend_dev_host_buffer_type(gpu_dev) == nullptr) {
        return bad("no GPU", "this tool needs a GPU device with a page-locked host buffer type (a CUDA build on a GPU)");
    }
    ggml_backend_t gpu = ggml_backend_dev_init(gpu_dev, nullptr);
    ggml_backend_t cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    ggml_backend_cpu_set_n_threads(cpu, p.threads);
    ggml_backend_buffer_type_t host_buft = ggml_backend_dev_host_buffer_type(gpu_dev);

    // host expert weights, one layer
    ggml_init_params wp = { 4 * ggml_tensor_overhead(), nullptr, true };
    ggml_context * ctx_w = ggml_init(wp);
    ggml_tensor * up   = expert_weight(ctx_w, p.type, p.n_embd, p.n_ff, p.n_expert, "up");
    ggml_tensor * gate = expert_weight(ctx_w, p.type, p.n_embd, p.n_ff, p.n_expert, "gate");
    ggml_tensor * down = expert_weight(ctx_w, p.type, p.n_ff, p.n_embd, p.n_expert, "down");
    ggml_backend_buffer_t wbuf = ggml_backend_alloc_ctx_tensors_from_buft(ctx_w, ggml_backend_cpu_buffer_type());
    ggml_backend_buffer_set_usage(wbuf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    std::mt19937 rng(7);
    fprintf(stderr, "llama-moe-roundtrip: quantizing one layer's experts (%.0f MiB of %s)...\n",
            3.0 * ggml_nbytes(up) / 1048576.0, ggml_type_name(p.type));
    fill_weight(up, rng);
    fill_weight(gate, rng);
    fill_weight(down, rng);
    const double expert_size = (double) (ggml_nbytes(up) + ggml_nbytes(gate) + ggml_nbytes(down)) / (double) p.n_expert;

    const double link_idle = link_gbps(gpu, gpu_dev);
    const double split_idle = split_us(gpu, 200);
    ggml_sched_cpu_worker worker;

    std::vector<row> rows;
    for (int busy = 0; busy <= 1; busy++) {
        gpu_load load;
        if (busy) {
            load.start(gpu_dev);
            std::this_thread::sleep_for(std::chrono::milliseconds(200));
        }
        for (int T : p.tokens) {
            // the GPU side: activations and ids as the router leaves them
            ggml_init_params gp = { 8 * ggml_tensor_overhead(), nullptr, true };
            ggml_context * ctx_g = ggml_init(gp);
            ggml_tensor * act_d = ggml_new_tensor_2d(ctx_g, GGML_TYPE_F32, p.n_embd, T);
            ggml_tensor * ids_d = ggml_new_tensor_2d(ctx_g, GGML_TYPE_I32, p.top_k, T);
            ggml_tensor * out_d = ggml_new_tensor_2d(ctx_g, GGML_TYPE_F32, p.n_embd, T);
            ggml_backend_buffer_t gbuf = ggml_backend_alloc_ctx_tensors(ctx_g, gpu);

            // the host side: page-locked inputs, and the CPU graph computing into the page-locked compute buffer
            ggml_init_params hp = { 64 * ggml_tensor_overhead() + 2 * ggml_graph_overhead(), nullptr, true };
            ggml_context * ctx_h = ggml_init(hp);
            ggml_tensor * act_h = ggml_new_tensor_3d(ctx_h, GGML_TYPE_F32, p.n_embd, 1, T);
            ggml_tensor * ids_h = ggml_new_tensor_2d(ctx_h, GGML_TYPE_I32, p.top_k, T);
            ggml_tensor * wts_h = ggml_new_tensor_3d(ctx_h, GGML_TYPE_F32, 1, p.top_k, T);
            ggml_backend_buffer_t hbuf = ggml_backend_alloc_ctx_tensors_from_buft(ctx_h, host_buft);

            ggml_tensor * u = ggml_mul_mat_id(ctx_h, up, act_h, ids_h);
            ggml_tensor * g = ggml_mul_mat_id(ctx_h, gate, act_h, ids_h);
            ggml_tensor * h = ggml_swiglu_split(ctx_h, g, u);
            ggml_tensor * e = ggml_mul(ctx_h, ggml_mul_mat_id(ctx_h, down, h, ids_h), wts_h);
            ggml_tensor * y = ggml_view_2d(ctx_h, e, p.n_embd, T, e->nb[2], 0);
            for (int64_t k = 1; k < p.top_k; k++) {
                y = ggml_add(ctx_h, y, ggml_view_2d(ctx_h, e, p.n_embd, T, e->nb[2], k * e->nb[1]));
            }
            ggml_cgraph * gf = ggml_new_graph(ctx_h);
            ggml_build_forward_expand(gf, y);
            ggml_gallocr_t galloc = ggml_gallocr_new(host_buft);
            ggml_gallocr_alloc_graph(galloc, gf);

            // inputs: random activations, distinct experts per token, equal weights
            std::vector<float> act(p.n_embd * T);
            std::normal_distribution<float> nd(0.0f, 1.0f);
            for (auto & x : act) {
                x = nd(rng);
            }
            ggml_backend_tensor_set(act_d, act.data(), 0, ggml_nbytes(act_d));
            std::vector<int32_t> ids(p.top_k * T);
            std::set<int32_t> distinct;
            for (int t = 0; t < T; t++) {
                std::vector<int32_t> perm(p.n_expert);
                for (int64_t i = 0; i < p.n_expert; i++) {
                    perm[i] = (int32_t) i;
                }
                std::shuffle(perm.begin(), perm.end(), rng);
                for (int64_t k = 0; k < p.top_k; k++) {
                    ids[t * p.top_k + k] = perm[k];
                    distinct.insert(perm[k]);
                }
            }
            ggml_backend_tensor_set(ids_d, ids.data(), 0, ggml_nbytes(ids_d));
            std::vector<float> wts(p.top_k * T, 1.0f / p.top_k);
            ggml_backend_tensor_set(wts_h, wts.data(), 0, ggml_nbytes(wts_h));
            ggml_cgraph * empty = ggml_new_graph(ctx_h); // the join leg posts a split with no nodes

            row r;
            r.tokens = T;
            r.busy = busy;
            r.expert_bytes = expert_size * distinct.size();
            std::vector<double> d2h, cpu_us, h2d, join;
            for (int rep = 0; rep < p.reps + 3; rep++) {
                const int64_t t0 = ggml_time_us();
                ggml_backend_tensor_get_async(gpu, act_d, act_h->data, 0, ggml_nbytes(act_d));
                ggml_backend_tensor_get_async(gpu, ids_d, ids_h->data, 0, ggml_nbytes(ids_d));
                ggml_backend_synchronize(gpu);
                const int64_t t1 = ggml_time_us();
                ggml_backend_graph_compute(cpu, gf);
                const int64_t t2 = ggml_time_us();
                ggml_backend_tensor_set_async(gpu, out_d, y->data, 0, ggml_nbytes(out_d));
                ggml_backend_synchronize(gpu);
                const int64_t t3 = ggml_time_us();
                worker.post(cpu, empty, nullptr, 0);
                worker.join();
                const int64_t t4 = ggml_time_us();
                if (rep >= 3) { // warm-up: first touches, lazy set-up
                    d2h.push_back((double) (t1 - t0));
                    cpu_us.push_back((double) (t2 - t1));
                    h2d.push_back((double) (t3 - t2));
                    join.push_back((double) (t4 - t3));
                }
            }
            r.d2h = median(d2h);
            r.cpu = median(cpu_us);
            r.h2d = median(h2d);
            r.join = median(join);
            rows.push_back(r);

            ggml_gallocr_free(galloc);
            ggml_backend_buffer_free(hbuf);
            ggml_free(ctx_h);
            ggml_backend_buffer_free(gbuf);
            ggml_free(ctx_g);
        }
        if (busy) {
            const double link_busy = link_gbps(gpu, gpu_dev);
            const double split_busy = split_us(gpu, 50);
            load.finish();
            fprintf(stderr, "link %.1f GB/s idle, %.1f GB/s busy; one small GPU split %.1f us idle, %.1f us busy\n",
                    link_idle, link_busy, split_idle, split_busy);
            printf("{\"what\": \"link\", \"link_gbps_idle\": %.2f, \"link_gbps_busy\": %.2f, \"split_us_idle\": %.1f, "
                   "\"split_us_busy\": %.1f}\n", link_idle, link_busy, split_idle, split_busy);
        }
    }

    fprintf(stderr, "\n| tokens | GPU | d2h us | cpu us | h2d us | join us | total us | experts read | CPU GB/s |\n"
                    "|---:|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for (const row & r : rows) {
        const double total = r.d2h + r.cpu + r.h2d + r.join;
        const double gbps = r.expert_bytes / (r.cpu * 1e-6) * 1e-9;
        fprintf(stderr, "| %d | %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f MiB | %.1f |\n", r.tokens, r.busy ? "busy" : "idle",
                r.d2h, r.cpu, r.h2d, r.join, total, r.expert_bytes / 1048576.0, gbps);
        printf("{\"what\": \"roundtrip\", \"tokens\": %d, \"gpu_busy\": %s, \"threads\": %d, \"type\": \"%s\", "
               "\"d2h_us\": %.1f, \"cpu_us\": %.1f, \"h2d_us\": %.1f, \"join_us\": %.1f, \"total_us\": %.1f, "
               "\"expert_bytes\": %.0f, \"cpu_gbps\": %.2f}\n", r.tokens, r.busy ? "true" : "false", p.threads,
               ggml_type_name(p.type), r.d2h, r.cpu, r.h2d, r.join, total, r.expert_bytes, gbps);
    }

    ggml_backend_buffer_free(wbuf);
    ggml_free(ctx_w);
    ggml_backend_free(cpu);
    ggml_backend_free(gpu);
    return 0;
}
