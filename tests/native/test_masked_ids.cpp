// test_masked_ids.cpp: expert ids of -1 ("no expert") in ggml_mul_mat_id_masked and ggml_add_id_masked on the CPU
// backend of a patched build. The row of a masked id must be exactly zero (mul_mat_id) or exactly the input row
// (add_id), and every other row must be the bytes the unmasked op computes for the same id. A device that does not
// report masked ids is refused the masked ops (GGML_SIM_NO_MASKED_IDS=1 plays one when GGML_SIM_DEVICES=1).
//
//   test_masked_ids TYPE [DEVICE]      TYPE: f32 | q8_0 | q4_0 (the experts' type); DEVICE: cpu (default) | sim (SIM0,
//                                      which computes with the CPU's kernels but guards the indices it is given)
//
// Prints "ok TYPE: ..." and exits 0, or "FAIL TYPE: ..." and exits 1.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

static const int64_t K = 256, M = 64, N_MATS = 8, N_USED = 4, T = 7;

static int fail(const std::string & name, const std::string & why) {
    printf("FAIL %s: %s\n", name.c_str(), why.c_str());
    return 1;
}

// ids [N_USED, T]: distinct experts per token, then -1 in slot t % N_USED of every token and in every slot of token 3
static std::vector<int32_t> make_ids(bool masked) {
    std::vector<int32_t> ids(N_USED * T);
    for (int64_t t = 0; t < T; t++) {
        for (int64_t s = 0; s < N_USED; s++) {
            ids[t * N_USED + s] = (int32_t) ((t * 3 + s * 5) % N_MATS);
            if (masked && (s == t % N_USED || t == 3)) {
                ids[t * N_USED + s] = -1;
            }
        }
    }
    return ids;
}

struct graph {
    ggml_context *        ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;
    ggml_tensor * as = nullptr, * b = nullptr, * ids = nullptr, * mm = nullptr;
    ggml_tensor * a = nullptr, * bias = nullptr, * ids_b = nullptr, * add = nullptr;

    graph(ggml_type type, bool masked) {
        ggml_init_params ip = { 16 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
        ctx  = ggml_init(ip);
        as   = ggml_new_tensor_3d(ctx, type, K, M, N_MATS);
        b    = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, K, 1, T);
        ids  = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, N_USED, T);
        mm   = masked ? ggml_mul_mat_id_masked(ctx, as, b, ids) : ggml_mul_mat_id(ctx, as, b, ids);
        a    = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, M, N_USED, T);
        bias = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, M, N_MATS);
        add  = masked ? ggml_add_id_masked(ctx, a, bias, ids) : ggml_add_id(ctx, a, bias, ids);
    }

    ~graph() {
        ggml_backend_buffer_free(buf);
        ggml_free(ctx);
    }

    std::string compute(ggml_backend_t cpu, const std::vector<int32_t> & id_values) {
        ggml_cgraph * gf = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf, mm);
        ggml_build_forward_expand(gf, add);
        buf = ggml_backend_alloc_ctx_tensors(ctx, cpu);
        std::mt19937 rng(11);
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        std::vector<float> w(K * M * N_MATS);
        for (auto & x : w) {
            x = u(rng);
        }
        std::vector<uint8_t> q(ggml_nbytes(as));
        ggml_quantize_chunk(as->type, w.data(), q.data(), 0, M * N_MATS, K, nullptr);
        ggml_backend_tensor_set(as, q.data(), 0, q.size());
        for (ggml_tensor * t : { b, a, bias }) {
            std::vector<float> v(ggml_nelements(t));
            for (auto & x : v) {
                x = u(rng);
            }
            ggml_backend_tensor_set(t, v.data(), 0, ggml_nbytes(t));
        }
        ggml_backend_tensor_set(ids, id_values.data(), 0, ggml_nbytes(ids));
        return ggml_backend_graph_compute(cpu, gf) == GGML_STATUS_SUCCESS ? "" : "compute failed";
    }

    std::vector<float> get(ggml_tensor * t) {
        std::vector<float> v(ggml_nelements(t));
        ggml_backend_tensor_get(t, v.data(), 0, ggml_nbytes(t));
        return v;
    }
};

int main(int argc, char ** argv) {
    if (argc != 2 && argc != 3) {
        fprintf(stderr, "usage: %s f32|q8_0|q4_0 [cpu|sim]\n", argv[0]);
        return 2;
    }
    const bool on_sim = argc == 3 && std::string(argv[2]) == "sim";
    const std::string name = argv[1];
    const ggml_type type = name == "f32" ? GGML_TYPE_F32 : name == "q8_0" ? GGML_TYPE_Q8_0 :
                           name == "q4_0" ? GGML_TYPE_Q4_0 : GGML_TYPE_COUNT;
    if (type == GGML_TYPE_COUNT) {
        fprintf(stderr, "unknown type %s\n", name.c_str());
        return 2;
    }
    ggml_backend_load_all();
    ggml_backend_t cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    ggml_backend_cpu_set_n_threads(cpu, 2);
    ggml_backend_dev_t sim_dev = ggml_backend_dev_by_name("SIM0");
    if (on_sim && sim_dev == nullptr) {
        return fail(name, "no SIM0 device: run with GGML_SIM_DEVICES=1");
    }
    ggml_backend_t backend = on_sim ? ggml_backend_dev_init(sim_dev, nullptr) : cpu;

    const std::vector<int32_t> masked_ids = make_ids(true);
    const std::vector<int32_t> plain_ids  = make_ids(false);
    graph masked(type, true), plain(type, false);
    if (!ggml_ids_masked(masked.mm) || !ggml_ids_masked(masked.add) || ggml_ids_masked(plain.mm) || ggml_ids_masked(plain.add)) {
        return fail(name, "ggml_ids_masked does not tell the masked builders' nodes from the plain ones");
    }
    std::string err = masked.compute(backend, masked_ids);
    if (err.empty()) {
        err = plain.compute(backend, plain_ids);
    }
    if (!err.empty()) {
        return fail(name, err);
    }

    // mul_mat_id: [M, N_USED, T]; add_id: [M, N_USED, T]
    const std::vector<float> mm_m = masked.get(masked.mm), mm_p = plain.get(plain.mm);
    const std::vector<float> add_m = masked.get(masked.add), add_p = plain.get(plain.add), a = masked.get(masked.a);
    int n_masked = 0;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t s = 0; s < N_USED; s++) {
            const bool none = masked_ids[t * N_USED + s] == -1;
            n_masked += none;
            const size_t row = (size_t) (t * N_USED + s) * M;
            for (int64_t i = 0; i < M; i++) {
                const float zero = 0.0f;
                const float * want_mm  = none ? &zero : &mm_p[row + i];
                const float * want_add = none ? &a[row + i] : &add_p[row + i];
                if (memcmp(&mm_m[row + i], want_mm, sizeof(float)) != 0) {
                    char buf[200];
                    snprintf(buf, sizeof(buf), "mul_mat_id token %lld slot %lld element %lld is %g, expected %g (%s)",
                             (long long) t, (long long) s, (long long) i, mm_m[row + i], *want_mm, none ? "masked" : "kept");
                    return fail(name, buf);
                }
                if (memcmp(&add_m[row + i], want_add, sizeof(float)) != 0) {
                    char buf[200];
                    snprintf(buf, sizeof(buf), "add_id token %lld slot %lld element %lld is %g, expected %g (%s)",
                             (long long) t, (long long) s, (long long) i, add_m[row + i], *want_add, none ? "masked" : "kept");
                    return fail(name, buf);
                }
            }
        }
    }

    // the refusal: a device without masked ids is not given the masked nodes (the CPU is)
    std::string refused = "no SIM device";
    ggml_backend_dev_t sim = ggml_backend_dev_by_name("SIM0");
    if (sim != nullptr) {
        const bool sim_masked = ggml_backend_dev_supports_op(sim, masked.mm) && ggml_backend_dev_supports_op(sim, masked.add);
        const bool sim_plain  = ggml_backend_dev_supports_op(sim, plain.mm) && ggml_backend_dev_supports_op(sim, plain.add);
        refused = std::string("SIM0 takes the masked ops: ") + (sim_masked ? "yes" : "no") + ", the plain ones: " +
                  (sim_plain ? "yes" : "no");
    }
    if (!ggml_backend_dev_supports_op(ggml_backend_get_device(cpu), masked.mm)) {
        return fail(name, "the CPU refuses a masked mul_mat_id");
    }
    printf("ok %s on %s: %d of %lld rows masked, exact zeros and the plain op's bytes elsewhere; %s\n", name.c_str(),
           on_sim ? "SIM0" : "the CPU", n_masked, (long long) (N_USED * T), refused.c_str());
    if (backend != cpu) {
        ggml_backend_free(backend);
    }
    ggml_backend_free(cpu);
    return 0;
}
