// llama-moe-copy-probe: host-to-device copy bandwidth of every GPU device ggml has registered, measured the way
// llama.cpp uploads host weights (ggml_backend_tensor_set_async from the device's host buffer type, then
// synchronize), and from plain pageable memory for comparison. With experts kept in host memory this bandwidth
// bounds how fast expert weights can be streamed to the GPU, so it is worth knowing per machine.
//
// Output: one JSON object per device and line on stdout. Only the ggml public API is used, so the tool works with
// any backend that is built in or loadable.

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

struct probe_params {
    size_t       mib       = 256;
    int          reps      = 10;
    const char * device    = nullptr;
    size_t       small_mib = 0; // --small: the queueing test, off
};

// --small: how long a small pinned upload on a second queue of the device takes alone, queued right behind a --mib
// upload on the first queue, and behind the same upload queued as 32 pieces. Behind the whole upload as long as the
// upload itself: uploads of different queues wait in one line, so a graph's inputs wait for a stage queued before
// them; about as long as alone: they share the copy engines
struct queue_stats {
    double small_alone_ms   = 0.0;
    double small_behind_ms  = 0.0;
    double large_ms         = 0.0;
    double small_pieces_ms  = 0.0; // behind the 32 pieces
    double large_pieces_ms  = 0.0;
};

struct probe_stats {
    double median_gbps = 0.0;
    double min_gbps    = 0.0;
    double max_gbps    = 0.0;
};

static void print_usage(const char * argv0) {
    printf("usage: %s [options]\n"
           "\n"
           "measures the host-to-device copy bandwidth of each GPU device registered in ggml, from the device's\n"
           "host (pinned) buffer type and from pageable malloc memory; prints one JSON object per device and line\n"
           "\n"
           "options:\n"
           "  --mib N         copy size in MiB (default 256)\n"
           "  --reps N        timed copies per measurement (default 10); the median is reported\n"
           "  --device NAME   probe only this device (e.g. CUDA0)\n"
           "  --small N       also time an N MiB pinned upload on a second queue, alone and right behind a --mib\n"
           "                  upload on the first: whether uploads of two queues wait in one line (default off)\n"
           "  -h, --help      show this help\n", argv0);
}

// a positive integer, or false: atoi would take "abc" as 0 and "12x" as 12 without complaint
static bool parse_positive(const char * s, long long * out) {
    char * end = nullptr;
    const long long v = strtoll(s, &end, 10);
    if (end == s || *end != '\0' || v <= 0) {
        return false;
    }
    *out = v;
    return true;
}

// device descriptions come from drivers and may hold quotes or control characters
static std::string json_str(const char * s) {
    std::string r = "\"";
    for (const char * p = s; *p; p++) {
        const unsigned char c = (unsigned char) *p;
        if (c == '"' || c == '\\') {
            r += '\\';
            r += (char) c;
        } else if (c < 0x20) {
            char buf[8];
            snprintf(buf, sizeof(buf), "\\u%04x", c);
            r += buf;
        } else {
            r += (char) c;
        }
    }
    return r + "\"";
}

// the median of a measurement's samples (sorts them)
static double median(std::vector<double> & v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// the warm-up copy is left out of the timing: it pays for first-touch page faults, lazy stream and staging
// buffer creation in the driver, none of which recur when weights are uploaded
static probe_stats time_copies(ggml_backend_t backend, ggml_tensor * dst, const void * src, size_t n, size_t reps) {
    ggml_backend_tensor_set_async(backend, dst, src, 0, n);
    ggml_backend_synchronize(backend);

    std::vector<double> gbps(reps);
    for (size_t i = 0; i < reps; i++) {
        const int64_t t0 = ggml_time_us();
        ggml_backend_tensor_set_async(backend, dst, src, 0, n);
        ggml_backend_synchronize(backend);
        const int64_t t1 = ggml_time_us();
        // a copy faster than the clock's resolution still counts as 1 us rather than dividing by zero
        gbps[i] = (double) n / (double) std::max<int64_t>(t1 - t0, 1) * 1e-3;
    }
    probe_stats st;
    st.median_gbps = median(gbps);
    st.min_gbps    = gbps.front();
    st.max_gbps    = gbps.back();
    return st;
}

// the queueing test of --small (see queue_stats): large on `backend`, small on `second`, both from src
static queue_stats time_queueing(ggml_backend_t backend, ggml_backend_t second, ggml_tensor * large, ggml_tensor * small,
        const uint8_t * src, size_t reps) {
    const size_t n_large = ggml_nbytes(large);
    const size_t n_small = ggml_nbytes(small);
    const int    n_pieces = 32;
    std::vector<double> alone(reps), behind(reps), whole(reps), behind_pieces(reps), whole_pieces(reps);
    ggml_backend_tensor_set_async(second, small, src, 0, n_small); // warm-up, as time_copies
    ggml_backend_synchronize(second);
    for (size_t i = 0; i < reps; i++) {
        int64_t t0 = ggml_time_us();
        ggml_backend_tensor_set_async(second, small, src, 0, n_small);
        ggml_backend_synchronize(second);
        alone[i] = (ggml_time_us() - t0) / 1e3;

        t0 = ggml_time_us();
        ggml_backend_tensor_set_async(backend, large, src, 0, n_large);
        ggml_backend_tensor_set_async(second, small, src, 0, n_small);
        ggml_backend_synchronize(second);
        behind[i] = (ggml_time_us() - t0) / 1e3;
        ggml_backend_synchronize(backend);
        whole[i] = (ggml_time_us() - t0) / 1e3;

        t0 = ggml_time_us();
        for (int p = 0; p < n_pieces; p++) {
            const size_t off = n_large / n_pieces * p;
            const size_t end = p + 1 == n_pieces ? n_large : n_large / n_pieces * (p + 1);
            ggml_backend_tensor_set_async(backend, large, src + off, off, end - off);
        }
        ggml_backend_tensor_set_async(second, small, src, 0, n_small);
        ggml_backend_synchronize(second);
        behind_pieces[i] = (ggml_time_us() - t0) / 1e3;
        ggml_backend_synchronize(backend);
        whole_pieces[i] = (ggml_time_us() - t0) / 1e3;
    }
    queue_stats st;
    st.small_alone_ms  = median(alone);
    st.small_behind_ms = median(behind);
    st.large_ms        = median(whole);
    st.small_pieces_ms = median(behind_pieces);
    st.large_pieces_ms = median(whole_pieces);
    return st;
}

static void alloc_error(size_t n, const char * what, ggml_backend_dev_t dev) {
    fprintf(stderr, "error: failed to allocate %zu MiB of %s for device %s; try a smaller --mib\n",
            n / (1024 * 1024), what, ggml_backend_dev_name(dev));
}

// --small on one device: a second queue (backend) and the small upload's destination, made and freed here
static bool probe_queueing(ggml_backend_dev_t dev, ggml_backend_t backend, ggml_tensor * large,
        ggml_backend_buffer_t host_buf, const probe_params & params, queue_stats * out) {
    ggml_backend_t second = ggml_backend_dev_init(dev, nullptr);
    if (!second) {
        fprintf(stderr, "error: could not create a second backend for device %s\n", ggml_backend_dev_name(dev));
        return false;
    }
    ggml_init_params ip = {
        /* .mem_size   = */ ggml_tensor_overhead(),
        /* .mem_buffer = */ nullptr,
        /* .no_alloc   = */ true,
    };
    ggml_context * ctx = ggml_init(ip);
    GGML_ASSERT(ctx != nullptr);
    ggml_tensor * small = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, (int64_t) (params.small_mib * 1024 * 1024));
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_dev_buffer_type(dev));
    bool ok = buf != nullptr;
    if (ok) {
        *out = time_queueing(backend, second, large, small, (const uint8_t *) ggml_backend_buffer_get_base(host_buf),
                (size_t) params.reps);
    } else {
        alloc_error(params.small_mib * 1024 * 1024, "device memory (--small)", dev);
    }
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    ggml_backend_free(second);
    return ok;
}

// returns false after printing the error line; frees whatever it allocated on every path
static bool probe_device(ggml_backend_dev_t dev, const probe_params & params) {
    const size_t n = params.mib * 1024 * 1024;
    const char * name = ggml_backend_dev_name(dev);

    ggml_backend_t backend = ggml_backend_dev_init(dev, nullptr);
    if (!backend) {
        fprintf(stderr, "error: could not create a backend for device %s\n", name);
        return false;
    }

    // the destination is a real tensor in the device's own buffer type, so the backend takes the same
    // set_tensor_async path as a weight upload
    ggml_init_params ip = {
        /* .mem_size   = */ ggml_tensor_overhead(),
        /* .mem_buffer = */ nullptr,
        /* .no_alloc   = */ true,
    };
    ggml_context * ctx = ggml_init(ip);
    GGML_ASSERT(ctx != nullptr);
    ggml_tensor * dst = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, (int64_t) n);
    ggml_set_name(dst, "copy_probe_dst");

    ggml_backend_buffer_t dev_buf  = nullptr;
    ggml_backend_buffer_t host_buf = nullptr;
    void *                pageable = nullptr;
    bool                  ok       = false;
    const char *          note     = nullptr; // why no pinned bandwidth was measured

    ggml_backend_buffer_type_t host_buft = ggml_backend_dev_host_buffer_type(dev);
    probe_stats pinned      = {};
    probe_stats pageable_st = {};
    queue_stats queueing    = {};

    dev_buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_dev_buffer_type(dev));
    if (!dev_buf) {
        alloc_error(n, "device memory", dev);
        goto done;
    }

    if (host_buft) {
        // the source pointer is dereferenced by the host, so a non-host "host" buffer type would be a backend bug
        GGML_ASSERT(ggml_backend_buft_is_host(host_buft));
        host_buf = ggml_backend_buft_alloc_buffer(host_buft, n);
        if (!host_buf) {
            alloc_error(n, "host (pinned) memory", dev);
            goto done;
        }
        // CUDA's host buffer type hands out an ordinary CPU buffer when page-locking fails or is turned off
        // (GGML_CUDA_NO_PINNED); timing that would report pageable bandwidth under the pinned name
        if (ggml_backend_buffer_get_type(host_buf) != host_buft) {
            note = "the host buffer type fell back to ordinary memory (page-locking failed or is turned off, e.g. "
                   "GGML_CUDA_NO_PINNED): there is no pinned source to copy from";
        } else {
            // non-zero bytes, so that no layer can take a shortcut on zero pages
            memset(ggml_backend_buffer_get_base(host_buf), 0x5a, n);
            pinned = time_copies(backend, dst, ggml_backend_buffer_get_base(host_buf), n, (size_t) params.reps);
            if (params.small_mib > 0 && !probe_queueing(dev, backend, dst, host_buf, params, &queueing)) {
                goto done;
            }
        }
    } else {
        note = "the device has no host buffer type (ggml_backend_dev_host_buffer_type returned NULL): "
               "there is no pinned source to copy from";
    }

    pageable = malloc(n);
    if (!pageable) {
        alloc_error(n, "pageable host memory", dev);
        goto done;
    }
    memset(pageable, 0x5a, n);
    pageable_st = time_copies(backend, dst, pageable, n, (size_t) params.reps);

    printf("{\"device\": %s, \"description\": %s, \"bytes\": %zu, \"reps\": %d, ",
            json_str(name).c_str(), json_str(ggml_backend_dev_description(dev)).c_str(), n, params.reps);
    printf("\"host_buffer_type\": %s, ", host_buft ? json_str(ggml_backend_buft_name(host_buft)).c_str() : "null");
    if (note == nullptr) {
        printf("\"pinned_gbps\": %.3f, \"pinned_min_gbps\": %.3f, \"pinned_max_gbps\": %.3f, ",
                pinned.median_gbps, pinned.min_gbps, pinned.max_gbps);
    } else {
        printf("\"pinned_gbps\": null, \"pinned_min_gbps\": null, \"pinned_max_gbps\": null, \"note\": %s, ",
                json_str(note).c_str());
    }
    if (params.small_mib > 0 && note == nullptr) {
        printf("\"small_bytes\": %zu, \"small_alone_ms\": %.3f, \"small_behind_ms\": %.3f, \"large_ms\": %.3f, "
               "\"small_behind_pieces_ms\": %.3f, \"large_pieces_ms\": %.3f, ", params.small_mib * 1024 * 1024,
                queueing.small_alone_ms, queueing.small_behind_ms, queueing.large_ms, queueing.small_pieces_ms,
                queueing.large_pieces_ms);
    }
    printf("\"pageable_gbps\": %.3f, \"pageable_min_gbps\": %.3f, \"pageable_max_gbps\": %.3f}\n",
            pageable_st.median_gbps, pageable_st.min_gbps, pageable_st.max_gbps);
    fflush(stdout);
    ok = true;

done:
    free(pageable);
    ggml_backend_buffer_free(host_buf);
    ggml_backend_buffer_free(dev_buf);
    ggml_free(ctx);
    ggml_backend_free(backend);
    return ok;
}

// integrated GPUs count too: llama.cpp offloads to them the same way, through their own buffer type
static bool is_gpu(ggml_backend_dev_t dev) {
    const enum ggml_backend_dev_type t = ggml_backend_dev_type(dev);
    return t == GGML_BACKEND_DEVICE_TYPE_GPU || t == GGML_BACKEND_DEVICE_TYPE_IGPU;
}

int main(int argc, char ** argv) {
    probe_params params;
    for (int i = 1; i < argc; i++) {
        const char * arg = argv[i];
        long long v = 0;
        if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
            print_usage(argv[0]);
            return 0;
        }
        if ((strcmp(arg, "--mib") == 0 || strcmp(arg, "--reps") == 0 || strcmp(arg, "--device") == 0 ||
             strcmp(arg, "--small") == 0) && i + 1 >= argc) {
            fprintf(stderr, "error: %s needs a value (see --help)\n", arg);
            return 2;
        }
        if (strcmp(arg, "--mib") == 0) {
            // the upper bound keeps n = mib * 2^20 far from size_t overflow
            if (!parse_positive(argv[++i], &v) || v > (1LL << 24)) {
                fprintf(stderr, "error: --mib needs a positive integer, got '%s'\n", argv[i]);
                return 2;
            }
            params.mib = (size_t) v;
        } else if (strcmp(arg, "--reps") == 0) {
            if (!parse_positive(argv[++i], &v) || v > 1000000) {
                fprintf(stderr, "error: --reps needs a positive integer, got '%s'\n", argv[i]);
                return 2;
            }
            params.reps = (int) v;
        } else if (strcmp(arg, "--small") == 0) {
            if (!parse_positive(argv[++i], &v) || v > (1LL << 24)) {
                fprintf(stderr, "error: --small needs a positive integer, got '%s'\n", argv[i]);
                return 2;
            }
            params.small_mib = (size_t) v;
        } else if (strcmp(arg, "--device") == 0) {
            params.device = argv[++i];
        } else {
            fprintf(stderr, "error: unknown argument '%s' (see --help)\n", arg);
            return 2;
        }
    }

    if (params.small_mib > params.mib) {
        fprintf(stderr, "error: --small %zu is larger than --mib %zu: the small upload reads the large one's source\n",
                params.small_mib, params.mib);
        return 2;
    }

    ggml_time_init();
    ggml_backend_load_all();

    std::vector<ggml_backend_dev_t> devs;
    for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        if (is_gpu(dev)) {
            devs.push_back(dev);
        }
    }
    if (devs.empty()) {
        fprintf(stderr, "error: no GPU device registered: nothing to probe "
                        "(set GGML_SIM_DEVICES=1 to probe the simulated device)\n");
        return 1;
    }

    if (params.device) {
        std::string avail;
        ggml_backend_dev_t found = nullptr;
        for (ggml_backend_dev_t dev : devs) {
            if (strcmp(ggml_backend_dev_name(dev), params.device) == 0) {
                found = dev;
            }
            avail += avail.empty() ? "" : ", ";
            avail += ggml_backend_dev_name(dev);
        }
        if (!found) {
            fprintf(stderr, "error: no GPU device named '%s'; available: %s\n", params.device, avail.c_str());
            return 1;
        }
        devs = { found };
    }

    for (ggml_backend_dev_t dev : devs) {
        if (!probe_device(dev, params)) {
            return 1;
        }
    }
    return 0;
}
