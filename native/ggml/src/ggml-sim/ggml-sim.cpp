// ggml-sim.cpp: SIM, a simulated discrete GPU. A TEST DOUBLE: see ggml-sim.h for what it is for and its knobs.
//
// Model of a device, after CUDA's behaviour as ggml uses it:
// - device memory is host memory allocated by the SIM buffer type, which reports itself as non-host, so the
//   scheduler copies weights that live elsewhere, exactly as for a discrete GPU;
// - every backend instance owns one FIFO worker thread (its stream); async set/get/copy, graph compute, event
//   record and event wait are queued there and run in order; synchronize waits until the queue has drained;
// - buffer-level set/get/memset/copy run at once on the calling thread and are NOT ordered with any stream
//   (CUDA does them on cudaStreamPerThread), so a caller that forgets to wait reads or overwrites memory a
//   stream is still working on, and with latency injected it does so reliably;
// - freeing or clearing a buffer first drains every SIM stream, as cudaFree and ggml-cuda's clear do;
// - unlike hardware, every buffer-level access is checked against the memory ranges queued work still reads
//   or writes, so a missing wait is reported even when the timing happened to hide it (see ggml-sim.h).
//
// Graph compute runs the CPU backend's kernels (a CPU backend instance per SIM instance) on the worker thread.
// The graph is snapshotted when it is queued: llama.cpp frees and rebuilds graphs while earlier work may still
// be queued (a real GPU captured its kernel arguments at launch), so the worker must not read the caller's
// tensor structs later. The snapshot keeps the caller's use counts, so CPU op fusion decides as it would have.
#include "ggml-sim.h"
#include "ggml-host-map.h"
#include "ggml-copy-regions.h"
#include "ggml-mmid-batch.h"
#include "ggml-dev-caps.h"
#include "../ggml-cuda/mmvq-mmid.h"

#include "../ggml-backend-impl.h"
#include "../ggml-impl.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#ifdef _WIN32
#    include <malloc.h>
#    include <process.h>
#    define sim_getpid _getpid
#else
#    include <errno.h>
#    include <sys/mman.h>
#    include <unistd.h>
#    define sim_getpid getpid
#endif

namespace {

//
// configuration, read once
//

struct sim_config {
    int         n_devices          = 0;
    size_t      memory_bytes       = 0; // of device 0; memory_of() for any device
    std::vector<size_t> memory_per_device; // GGML_SIM_MEMORY_MIB="200,120": a value per device, the last repeated
    std::vector<bool> no_cache_ops;       // GGML_SIM_NO_CACHE_OPS=i,j,...: devices that lack the expert cache's ops
    std::vector<bool> no_offload;         // GGML_SIM_NO_OFFLOAD=i,j,...: devices that take no op on host weights (as RPC)
    std::vector<std::vector<bool>> no_types; // GGML_SIM_NO_TYPES=q4_0,1:q8_0,...: [device][type] whose weights' products
                                             // the device does not compute (names as ggml_type_name, any case)
    double      copy_bytes_per_ns  = 0.0; // 0: no bandwidth limit
    int64_t     copy_latency_ns    = 0;
    int64_t     compute_latency_ns = 0;
    bool        poison             = false;
    bool        debug_skip_sync    = false;
    bool        host_map_fail      = false;
    int64_t     host_map_fail_nth  = 0; // 0: none
    bool        host_no_mapped     = false;
    bool        integrated         = false; // GGML_SIM_INTEGRATED: an integrated GPU, which uses its host buffers in place
    bool        no_masked_ids      = false; // GGML_SIM_NO_MASKED_IDS: the device does not report masked expert ids
    int64_t     offload_min_batch  = 32;
    int         cuda_cc            = 0; // GGML_SIM_CC: the compute capability whose mul_mat_id rule SIM reports
    int64_t     row_padding        = 0; // GGML_SIM_ROW_PADDING: quantized rows padded as ggml-cuda pads them (0: none)
    std::string oplog_path;
};

double env_double(const char * name, double def) {
    const char * v = getenv(name);
    return v && *v ? atof(v) : def;
}

// a comma-separated list of numbers (an empty or unset variable: none); "0,2" -> { 0, 2 }
std::vector<double> env_list(const char * name) {
    std::vector<double> out;
    const char * v = getenv(name);
    for (const char * p = v; p && *p;) {
        char * end = nullptr;
        out.push_back(strtod(p, &end));
        if (end == p) {
            GGML_LOG_WARN("ggml_sim: %s=%s: not a comma-separated list of numbers, read up to \"%s\"\n", name, v, p);
            out.pop_back();
            break;
        }
        p = *end == ',' ? end + 1 : end;
    }
    return out;
}

const sim_config & sim_cfg() {
    static const sim_config cfg = [] {
        sim_config c;
        int n = (int) env_double("GGML_SIM_DEVICES", 0);
        if (n > GGML_SIM_MAX_DEVICES) {
            GGML_LOG_WARN("ggml_sim: GGML_SIM_DEVICES=%d: at most %d simulated devices, using %d\n", n, GGML_SIM_MAX_DEVICES, GGML_SIM_MAX_DEVICES);
            n = GGML_SIM_MAX_DEVICES;
        }
        c.n_devices          = n > 0 ? n : 0;
        // one value for every device, or a comma-separated value per device (unequal free memory, as a planted
        // allocation on one GPU), the last repeated
        for (double mib : env_list("GGML_SIM_MEMORY_MIB")) {
            c.memory_per_device.push_back((size_t) (mib * 1024.0 * 1024.0));
        }
        if (c.memory_per_device.empty()) {
            c.memory_per_device.push_back((size_t) 8192 * 1024 * 1024);
        }
        c.memory_bytes       = c.memory_per_device[0];
        // devices without GGML_OP_MOE_CACHE_LOOKUP and GGML_OP_MOE_CACHE_FILL, as a backend that lacks them: the cache
        // keeps the host-side plan for their layers
        c.no_cache_ops.assign(std::max(c.n_devices, 1), false);
        for (double d : env_list("GGML_SIM_NO_CACHE_OPS")) {
            if (d >= 0 && d < c.no_cache_ops.size()) {
                c.no_cache_ops[(size_t) d] = true;
            }
        }
        // devices whose offload_op refuses every op, as an RPC device's: the scheduler offloads the ops on host
        // weights to the next device
        c.no_offload.assign(std::max(c.n_devices, 1), false);
        for (double d : env_list("GGML_SIM_NO_OFFLOAD")) {
            if (d >= 0 && d < c.no_offload.size()) {
                c.no_offload[(size_t) d] = true;
            }
        }
        // weight types a device has no MUL_MAT and MUL_MAT_ID kernels for, as a backend lacking some quantizations: the
        // model keeps such weights off it, and the scheduler leaves the products of host ones to the next device or the
        // CPU. "q4_0": every device; "1:q4_0": device 1 alone
        c.no_types.assign(std::max(c.n_devices, 1), std::vector<bool>(GGML_TYPE_COUNT, false));
        if (const char * v = getenv("GGML_SIM_NO_TYPES")) {
            const auto lower = [](std::string str) {
                std::transform(str.begin(), str.end(), str.begin(), [](unsigned char ch) { return (char) tolower(ch); });
                return str;
            };
            for (const char * p = v; *p;) {
                const char * end = strchr(p, ',');
                std::string name = lower(std::string(p, end ? end : p + strlen(p)));
                int only = -1;
                const size_t colon = name.find(':');
                if (colon != std::string::npos) {
                    char * num_end = nullptr;
                    only = (int) strtol(name.c_str(), &num_end, 10);
                    only = num_end == name.c_str() + colon && only >= 0 && only < (int) c.no_types.size() ? only : -2;
                    name = name.substr(colon + 1);
                }
                bool known = false;
                for (int t = 0; t < GGML_TYPE_COUNT && only != -2; t++) {
                    const char * tn = ggml_type_name((ggml_type) t);
                    if (tn != nullptr && *tn != '\0' && name == lower(tn)) {
                        known = true;
                        for (size_t d = 0; d < c.no_types.size(); d++) {
                            if (only < 0 || (size_t) only == d) {
                                c.no_types[d][t] = true;
                            }
                        }
                    }
                }
                if (!known) {
                    GGML_LOG_WARN("ggml_sim: GGML_SIM_NO_TYPES=%s: \"%s\" is not a ggml type name (as q4_0) or a device "
                                  "index and one (as 1:q4_0), ignored\n", v, std::string(p, end ? end : p + strlen(p)).c_str());
                }
                p = end ? end + 1 : p + strlen(p);
            }
        }
        c.copy_bytes_per_ns  = env_double("GGML_SIM_COPY_GBPS", 0); // 1 GB/s = 1 byte/ns
        c.copy_latency_ns    = (int64_t) (env_double("GGML_SIM_COPY_LATENCY_US", 0) * 1000.0);
        c.compute_latency_ns = (int64_t) (env_double("GGML_SIM_COMPUTE_LATENCY_US", 0) * 1000.0);
        c.poison             = env_double("GGML_SIM_POISON", 0) != 0;
        c.debug_skip_sync    = env_double("GGML_SIM_DEBUG_SKIP_SYNC", 0) != 0;
        c.host_map_fail      = env_double("GGML_SIM_HOST_MAP_FAIL", 0) != 0;
        c.host_map_fail_nth  = (int64_t) env_double("GGML_SIM_HOST_MAP_FAIL_NTH", 0);
        c.host_no_mapped     = env_double("GGML_SIM_HOST_NO_MAPPED", 0) != 0;
        c.integrated         = env_double("GGML_SIM_INTEGRATED", 0) != 0;
        c.no_masked_ids      = env_double("GGML_SIM_NO_MASKED_IDS", 0) != 0;
        c.offload_min_batch  = (int64_t) env_double("GGML_OP_OFFLOAD_MIN_BATCH", 32);
        c.cuda_cc            = (int) env_double("GGML_SIM_CC", 0);
        c.row_padding        = std::max<int64_t>(0, (int64_t) env_double("GGML_SIM_ROW_PADDING", 0));
        const char * log = getenv("GGML_SIM_OPLOG");
        c.oplog_path         = log ? log : "";
        return c;
    }();
    return cfg;
}

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

//
// op log: one JSON object per line, appended and flushed line by line so a reader sees it after the process exits
//

struct sim_op {
    const char * kind   = "";   // set, get, copy, compute, event_record, event_wait, sync, poison, race,
                                // host_map, host_unmap
    bool         async  = true; // false: a buffer-level operation done on the calling thread
    std::string  tensor;        // compute: the first node
    size_t       offset = 0;
    size_t       bytes  = 0;
    int64_t      event  = -1;
    int          n_nodes = 0;   // compute only
    std::string  first_op;      // compute: the first node's op; race: the kind of the queued op it raced with
    std::string  first_src0;    // compute: the first node's src[0] (e.g. a weight copy made by the scheduler);
                                // race: the tensor of the queued op it raced with
    uintptr_t    ptr    = 0;    // host_map/host_unmap: the base address of the range
    int          refs   = 0;    // host_map/host_unmap: references to the range after the operation
    bool         ok     = true; // host_map: false when it failed
};

struct sim_oplog {
    std::mutex mutex;
    FILE *     file = nullptr;
    uint64_t   seq  = 0;
    int        pid  = 0;
};

// never destroyed: worker threads of backends nobody freed may still log while the process exits
sim_oplog * oplog() {
    static sim_oplog * log = [] {
        sim_oplog * l = new sim_oplog;
        const sim_config & cfg = sim_cfg();
        if (cfg.n_devices > 0 && !cfg.oplog_path.empty()) {
            l->file = fopen(cfg.oplog_path.c_str(), "a");
            if (!l->file) {
                GGML_LOG_ERROR("ggml_sim: cannot open GGML_SIM_OPLOG=%s for appending: no op log is written\n", cfg.oplog_path.c_str());
            }
        }
        l->pid = (int) sim_getpid();
        return l;
    }();
    return log;
}

void json_string(std::string & out, const std::string & s) {
    out += '"';
    for (char c : s) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += c;
        } else if ((unsigned char) c < 0x20) {
            char buf[8];
            snprintf(buf, sizeof(buf), "\\u%04x", (unsigned char) c);
            out += buf;
        } else {
            out += c;
        }
    }
    out += '"';
}

void oplog_write(const char * dev, int inst, const sim_op & op, int64_t t_submit, int64_t t0, int64_t t1) {
    sim_oplog * log = oplog();
    if (!log->file) {
        return;
    }
    std::string line;
    line.reserve(256);
    char buf[256];
    line += "{\"dev\":";
    json_string(line, dev);
    snprintf(buf, sizeof(buf), ",\"inst\":%d,\"op\":\"%s\",\"async\":%s,\"tensor\":", inst, op.kind, op.async ? "true" : "false");
    line += buf;
    json_string(line, op.tensor);
    snprintf(buf, sizeof(buf), ",\"offset\":%zu,\"bytes\":%zu,\"event\":%lld", op.offset, op.bytes, (long long) op.event);
    line += buf;
    if (strcmp(op.kind, "compute") == 0) {
        snprintf(buf, sizeof(buf), ",\"n_nodes\":%d,\"first_op\":", op.n_nodes);
        line += buf;
        json_string(line, op.first_op);
        line += ",\"first_src0\":";
        json_string(line, op.first_src0);
    } else if (strcmp(op.kind, "race") == 0) {
        line += ",\"other_op\":";
        json_string(line, op.first_op);
        line += ",\"other_tensor\":";
        json_string(line, op.first_src0);
    } else if (strncmp(op.kind, "host_", 5) == 0) {
        snprintf(buf, sizeof(buf), ",\"ptr\":\"0x%llx\",\"refs\":%d,\"ok\":%s",
                (unsigned long long) op.ptr, op.refs, op.ok ? "true" : "false");
        line += buf;
    }
    snprintf(buf, sizeof(buf), ",\"t_submit_ns\":%lld,\"t0_ns\":%lld,\"t1_ns\":%lld",
            (long long) t_submit, (long long) t0, (long long) t1);
    line += buf;

    std::lock_guard<std::mutex> lock(log->mutex);
    snprintf(buf, sizeof(buf), ",\"pid\":%d,\"seq\":%llu}\n", log->pid, (unsigned long long) log->seq++);
    line += buf;
    fputs(line.c_str(), log->file);
    fflush(log->file);
}

//
// poison: a 16-bit 0x7FC0 pattern by address parity, so every aligned f16/bf16 (0x7FC0) and f32 (0x7FC07FC0)
// is a NaN, every quantized block scale is NaN, and an i32 index (0x7FC07FC0) is far out of range
//

void fill_nan(void * ptr, size_t size) {
    uint8_t * p   = (uint8_t *) ptr;
    uint8_t * end = p + size;
    while (p < end && ((uintptr_t) p & 7) != 0) {
        *p = ((uintptr_t) p & 1) ? 0x7F : 0xC0;
        p++;
    }
    const uint64_t word = 0x7FC07FC07FC07FC0ull;
    for (; p + 8 <= end; p += 8) {
        memcpy(p, &word, 8);
    }
    for (; p < end; p++) {
        *p = ((uintptr_t) p & 1) ? 0x7F : 0xC0;
    }
}

//
// events: each record gets a number; a wait captures the latest number when it is issued (as
// cudaStreamWaitEvent does) and blocks until that record has run on its stream. Never-recorded: no wait.
//

struct sim_event_state {
    int64_t                 id = 0;
    std::mutex              mutex;
    std::condition_variable cv;
    uint64_t                n_recorded = 0;
    std::set<uint64_t>      pending; // issued records that have not run yet

    uint64_t issue() {
        std::lock_guard<std::mutex> lock(mutex);
        pending.insert(++n_recorded);
        return n_recorded;
    }
    uint64_t latest() {
        std::lock_guard<std::mutex> lock(mutex);
        return n_recorded;
    }
    void complete(uint64_t r) {
        std::lock_guard<std::mutex> lock(mutex);
        pending.erase(r);
        cv.notify_all();
    }
    void wait(uint64_t r) {
        std::unique_lock<std::mutex> lock(mutex);
        cv.wait(lock, [&] { return r == 0 || pending.count(r) == 0; });
    }
};

std::atomic<int64_t> g_next_event_id{0};
std::atomic<int>     g_next_instance_id{0};

std::shared_ptr<sim_event_state> new_event_state() {
    auto st = std::make_shared<sim_event_state>();
    st->id = g_next_event_id++;
    return st;
}

// ggml_backend_event::context; queued records and waits hold the state, so freeing an event with work
// pending is safe (as cudaEventDestroy is)
struct sim_event {
    std::shared_ptr<sim_event_state> state;
};

//
// devices and streams
//

struct sim_stream;

struct sim_device {
    int                       index = 0;
    std::string               name;
    std::string               description;
    std::string               device_id;
    std::atomic<size_t>       used{0};
    ggml_backend_buffer_type  buft;
    ggml_backend_device       dev;
    std::once_flag            cpu_once;
    ggml_backend_dev_t        cpu_dev = nullptr;
};

struct sim_reg_state {
    ggml_backend_reg         reg;
    ggml_backend_buffer_type host_buft;
    std::vector<sim_device*> devices;
};

// a byte range [begin, end) of memory that queued work reads or writes, for the race check
struct sim_range {
    uintptr_t begin;
    uintptr_t end;
};

sim_range range_of(const void * p, size_t size) {
    return { (uintptr_t) p, (uintptr_t) p + size };
}

bool overlaps(const sim_range & a, const sim_range & b) {
    return a.begin < b.end && b.begin < a.end;
}

struct sim_task {
    sim_op                 op;
    bool                   logged   = true;
    int64_t                delay_ns = 0;
    int64_t                t_submit = 0;
    std::vector<sim_range> reads;
    std::vector<sim_range> writes;
    std::function<void()>  fn;
};

struct sim_stream {
    int                             id  = 0;
    sim_device *                    dev = nullptr;
    ggml_backend_t                  cpu = nullptr;
    ggml_backend_set_n_threads_t    cpu_set_n_threads = nullptr;

    std::mutex                      mutex;
    std::condition_variable         cv_work;
    std::condition_variable         cv_done;
    std::deque<sim_task>            queue;
    uint64_t                        n_submitted = 0;
    uint64_t                        n_done      = 0;
    bool                            stop        = false;
    std::thread                     worker;

    void submit(sim_task && task) {
        task.t_submit = now_ns();
        std::lock_guard<std::mutex> lock(mutex);
        queue.push_back(std::move(task));
        n_submitted++;
        cv_work.notify_one();
    }

    void drain() {
        std::unique_lock<std::mutex> lock(mutex);
        const uint64_t target = n_submitted;
        cv_done.wait(lock, [&] { return n_done >= target; });
    }

    // the running task stays at the front of the queue until it is done, so the race check sees its ranges
    // (deque::push_back does not invalidate references to the other elements)
    void run() {
        for (;;) {
            sim_task * task;
            {
                std::unique_lock<std::mutex> lock(mutex);
                cv_work.wait(lock, [&] { return stop || !queue.empty(); });
                if (queue.empty()) {
                    return;
                }
                task = &queue.front();
            }
            const int64_t t0 = now_ns();
            if (task->delay_ns > 0) {
                std::this_thread::sleep_for(std::chrono::nanoseconds(task->delay_ns));
            }
            task->fn();
            const int64_t t1 = now_ns();
            if (task->logged) {
                oplog_write(dev->name.c_str(), id, task->op, task->t_submit, t0, t1);
            }
            {
                std::lock_guard<std::mutex> lock(mutex);
                queue.pop_front();
                n_done++;
            }
            cv_done.notify_all();
        }
    }

    // the first queued (or running) task that writes `r` (or, with `or_reads`, also reads it), else nullptr;
    // the caller holds `mutex`
    const sim_task * conflict(const sim_range & r, bool or_reads) const {
        for (const sim_task & t : queue) {
            for (const sim_range & w : t.writes) {
                if (overlaps(r, w)) {
                    return &t;
                }
            }
            if (or_reads) {
                for (const sim_range & rd : t.reads) {
                    if (overlaps(r, rd)) {
                        return &t;
                    }
                }
            }
        }
        return nullptr;
    }
};

// live streams of all SIM devices; never destroyed (see oplog)
struct sim_streams {
    std::mutex              mutex;
    std::set<sim_stream *>  live;
};

sim_streams * streams() {
    static sim_streams * s = new sim_streams;
    return s;
}

// what a synchronizing allocator call (cudaFree, cudaDeviceSynchronize) does: wait for every SIM stream
void drain_all_streams() {
    sim_streams * s = streams();
    std::lock_guard<std::mutex> lock(s->mutex);
    for (sim_stream * st : s->live) {
        st->drain();
    }
}

//
// race check: an access from the calling thread (buffer-level get/set/memset/copy) to SIM memory that work
// queued on a stream still writes (or, for a write, still reads) is a missing wait in the caller. It is
// counted, logged, and performed as hardware would perform it, except that with GGML_SIM_POISON=1 a racing
// read returns poison instead of whatever the memory holds at that moment, so the outcome is deterministic:
// NaN for float and quantized data, zeros for integer tensors (valid indices: a missing wait must give wrong
// results, not an out-of-bounds read in a CPU kernel that trusts its expert ids).
//

std::atomic<size_t> g_n_races{0};

void fill_poison_typed(void * p, size_t size, ggml_type type) {
    if (type == GGML_TYPE_I8 || type == GGML_TYPE_I16 || type == GGML_TYPE_I32 || type == GGML_TYPE_I64) {
        memset(p, 0, size);
    } else {
        fill_nan(p, size);
    }
}

void report_race(const char * what, const char * dev, const ggml_tensor * tensor, size_t offset, size_t size,
        int inst, const sim_op & other) {
    const size_t n = ++g_n_races;
    if (n <= 8) {
        GGML_LOG_ERROR("ggml_sim: race #%zu: %s of %s '%s' [%zu, +%zu) while %s '%s' queued on %s instance %d has not run: "
                "a missing wait before this access\n", n, what, dev, tensor ? tensor->name : "", offset, size,
                other.kind, other.tensor.c_str(), dev, inst);
    } else if (n == 9) {
        GGML_LOG_ERROR("ggml_sim: more races follow; not logging them (see ggml_backend_sim_n_races)\n");
    }
    sim_op op;
    op.kind = "race"; op.async = false; op.tensor = tensor ? tensor->name : ""; op.offset = offset; op.bytes = size;
    op.first_op = other.kind; op.first_src0 = other.tensor;
    const int64_t t = now_ns();
    oplog_write(dev, inst, op, t, t, t);
}

// true if a host access to [p, p + size) races with queued work; `host_writes`: the access writes
bool check_race(const char * what, const char * dev, const ggml_tensor * tensor, size_t offset, const void * p, size_t size,
        bool host_writes) {
    const sim_range r = range_of(p, size);
    sim_streams * s = streams();
    std::lock_guard<std::mutex> lock(s->mutex);
    for (sim_stream * st : s->live) {
        std::lock_guard<std::mutex> st_lock(st->mutex);
        const sim_task * t = st->conflict(r, host_writes);
        if (t) {
            report_race(what, dev, tensor, offset, size, st->id, t->op);
            return true;
        }
    }
    return false;
}

int64_t copy_delay_ns(size_t bytes) {
    const sim_config & cfg = sim_cfg();
    int64_t d = cfg.copy_latency_ns;
    if (cfg.copy_bytes_per_ns > 0) {
        d += (int64_t) ((double) bytes / cfg.copy_bytes_per_ns);
    }
    return d;
}

ggml_backend_buffer_t tensor_buffer(const ggml_tensor * t) {
    return t->view_src ? t->view_src->buffer : t->buffer;
}

//
// buffers (device and host share the implementation; only the buffer type differs)
//

struct sim_buffer {
    sim_device * dev  = nullptr; // null for the host (pinned-like) buffer type
    void *       data = nullptr;
    size_t       size = 0;
};

// the host memory that kernels may read in place (ggml_backend_host_device_ptr): the live host (pinned-like) buffers
// and the ranges host_map registered, base -> end, as CUDA maps cudaMallocHost memory and mapped registrations
struct sim_device_readable {
    std::mutex                     mutex;
    std::map<uintptr_t, uintptr_t> ranges;
};

sim_device_readable & device_readable() {
    static sim_device_readable * r = new sim_device_readable; // never destroyed: models may be freed during exit
    return *r;
}

void device_readable_add(const void * base, size_t size) {
    std::lock_guard<std::mutex> lock(device_readable().mutex);
    device_readable().ranges[(uintptr_t) base] = (uintptr_t) base + size;
}

void device_readable_remove(const void * base) {
    std::lock_guard<std::mutex> lock(device_readable().mutex);
    device_readable().ranges.erase((uintptr_t) base);
}

void * sim_aligned_alloc(size_t size) {
#ifdef _WIN32
    return _aligned_malloc(size, 4096);
#else
    void * p = nullptr;
    return posix_memalign(&p, 4096, size) == 0 ? p : nullptr;
#endif
}

void sim_aligned_free(void * p) {
#ifdef _WIN32
    _aligned_free(p);
#else
    free(p);
#endif
}

void sim_buffer_free_buffer(ggml_backend_buffer_t buffer) {
    sim_buffer * ctx = (sim_buffer *) buffer->context;
    drain_all_streams();
    if (!ctx->dev) {
        device_readable_remove(ctx->data);
    }
    sim_aligned_free(ctx->data);
    if (ctx->dev) {
        ctx->dev->used -= ctx->size;
    }
    delete ctx;
}

void * sim_buffer_get_base(ggml_backend_buffer_t buffer) {
    return ((sim_buffer *) buffer->context)->data;
}

ggml_status sim_buffer_init_tensor(ggml_backend_buffer_t buffer, ggml_tensor * tensor) {
    // a view shares its source's live data: never poison it
    if (sim_cfg().poison && tensor->view_src == nullptr && tensor->data != nullptr) {
        // a real GPU writes nothing at allocation; the poison must not hit memory that work queued for the
        // previous graph still reads, so drain first. Cost: a missing wait between two graphs is only caught
        // when the graph is reused without re-allocation.
        drain_all_streams();
        fill_nan(tensor->data, ggml_backend_buft_get_alloc_size(buffer->buft, tensor));
    }
    return GGML_STATUS_SUCCESS;
}

const char * sim_buffer_dev_name(ggml_backend_buffer_t buffer) {
    sim_buffer * ctx = (sim_buffer *) buffer->context;
    return ctx->dev ? ctx->dev->name.c_str() : "SIM_Host";
}

void sim_buffer_memset_tensor(ggml_backend_buffer_t buffer, ggml_tensor * tensor, uint8_t value, size_t offset, size_t size) {
    check_race("memset", sim_buffer_dev_name(buffer), tensor, offset, (char *) tensor->data + offset, size, true);
    memset((char *) tensor->data + offset, value, size);
}

void sim_buffer_set_tensor(ggml_backend_buffer_t buffer, ggml_tensor * tensor, const void * data, size_t offset, size_t size) {
    const int64_t t0 = now_ns();
    check_race("set", sim_buffer_dev_name(buffer), tensor, offset, (char *) tensor->data + offset, size, true);
    memcpy((char *) tensor->data + offset, data, size);
    sim_op op;
    op.kind = "set"; op.async = false; op.tensor = tensor->name; op.offset = offset; op.bytes = size;
    oplog_write(sim_buffer_dev_name(buffer), -1, op, t0, t0, now_ns());
}

void sim_buffer_get_tensor(ggml_backend_buffer_t buffer, const ggml_tensor * tensor, void * data, size_t offset, size_t size) {
    const int64_t t0 = now_ns();
    const char * src = (const char *) tensor->data + offset;
    if (check_race("get", sim_buffer_dev_name(buffer), tensor, offset, src, size, false) && sim_cfg().poison) {
        fill_poison_typed(data, size, tensor->type);
    } else {
        memcpy(data, src, size);
    }
    sim_op op;
    op.kind = "get"; op.async = false; op.tensor = tensor->name; op.offset = offset; op.bytes = size;
    oplog_write(sim_buffer_dev_name(buffer), -1, op, t0, t0, now_ns());
}

bool sim_buffer_cpy_tensor(ggml_backend_buffer_t buffer, const ggml_tensor * src, ggml_tensor * dst) {
    ggml_backend_buffer_t src_buf = tensor_buffer(src);
    if (!src_buf || !(ggml_backend_buffer_is_sim(src_buf) || ggml_backend_buffer_is_host(src_buf))) {
        return false;
    }
    const int64_t t0 = now_ns();
    const size_t size = ggml_nbytes(src);
    check_race("copy to", sim_buffer_dev_name(buffer), dst, 0, dst->data, size, true);
    if (ggml_backend_buffer_is_sim(src_buf) &&
        check_race("copy from", sim_buffer_dev_name(src_buf), src, 0, src->data, size, false) && sim_cfg().poison) {
        fill_poison_typed(dst->data, size, src->type);
    } else {
        memcpy(dst->data, src->data, size);
    }
    sim_op op;
    op.kind = "copy"; op.async = false; op.tensor = dst->name; op.bytes = size;
    oplog_write(sim_buffer_dev_name(buffer), -1, op, t0, t0, now_ns());
    return true;
}

void sim_buffer_clear(ggml_backend_buffer_t buffer, uint8_t value) {
    sim_buffer * ctx = (sim_buffer *) buffer->context;
    drain_all_streams();
    memset(ctx->data, value, ctx->size);
}

const ggml_backend_buffer_i sim_buffer_interface = {
    /* .free_buffer     = */ sim_buffer_free_buffer,
    /* .get_base        = */ sim_buffer_get_base,
    /* .init_tensor     = */ sim_buffer_init_tensor,
    /* .memset_tensor   = */ sim_buffer_memset_tensor,
    /* .set_tensor      = */ sim_buffer_set_tensor,
    /* .get_tensor      = */ sim_buffer_get_tensor,
    /* .set_tensor_2d   = */ NULL,
    /* .get_tensor_2d   = */ NULL,
    /* .cpy_tensor      = */ sim_buffer_cpy_tensor,
    /* .clear           = */ sim_buffer_clear,
    /* .reset           = */ NULL,
};

//
// buffer types
//

const char * sim_buft_get_name(ggml_backend_buffer_type_t buft) {
    return ((sim_device *) buft->context)->name.c_str();
}

size_t memory_of(const sim_device * dev) {
    const std::vector<size_t> & m = sim_cfg().memory_per_device;
    return m[std::min((size_t) dev->index, m.size() - 1)];
}

ggml_backend_buffer_t sim_buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    sim_device * dev = (sim_device *) buft->context;
    const size_t total = memory_of(dev);
    size_t used = dev->used.load();
    do {
        if (used + size > total) {
            GGML_LOG_ERROR("%s: %s: allocating %.2f MiB failed: %.2f of %.2f MiB in use (GGML_SIM_MEMORY_MIB)\n", __func__,
                    dev->name.c_str(), size / 1024.0 / 1024.0, used / 1024.0 / 1024.0, total / 1024.0 / 1024.0);
            return nullptr;
        }
    } while (!dev->used.compare_exchange_weak(used, used + size));

    void * data = sim_aligned_alloc(size);
    if (!data) {
        dev->used -= size;
        GGML_LOG_ERROR("%s: %s: host allocation of %.2f MiB failed\n", __func__, dev->name.c_str(), size / 1024.0 / 1024.0);
        return nullptr;
    }
    sim_buffer * ctx = new sim_buffer;
    ctx->dev  = dev;
    ctx->data = data;
    ctx->size = size;
    return ggml_backend_buffer_init(buft, sim_buffer_interface, ctx, size);
}

size_t sim_buft_get_alignment(ggml_backend_buffer_type_t buft) {
    GGML_UNUSED(buft);
    return 128; // as ggml-cuda's device buffer type
}

size_t sim_buft_get_max_size(ggml_backend_buffer_type_t buft) {
    return memory_of((const sim_device *) buft->context);
}

// GGML_SIM_ROW_PADDING=N: a quantized tensor whose rows are not a multiple of N elements gets one row of the missing
// elements past its end, as ggml-cuda's device buffers do (MATRIX_ROW_PADDING, 512), so that the paths which place and
// copy padded allocations (staged weights, their padding zeros) run on SIM
size_t sim_buft_get_alloc_size(ggml_backend_buffer_type_t buft, const ggml_tensor * tensor) {
    GGML_UNUSED(buft);
    size_t size = ggml_nbytes(tensor);
    const int64_t pad = sim_cfg().row_padding;
    if (pad > 0 && ggml_is_quantized(tensor->type) && tensor->ne[0] % pad != 0) {
        size += ggml_row_size(tensor->type, pad - tensor->ne[0] % pad);
    }
    return size;
}

const ggml_backend_buffer_type_i sim_buft_interface = {
    /* .get_name       = */ sim_buft_get_name,
    /* .alloc_buffer   = */ sim_buft_alloc_buffer,
    /* .get_alignment  = */ sim_buft_get_alignment,
    /* .get_max_size   = */ sim_buft_get_max_size,
    /* .get_alloc_size = */ sim_buft_get_alloc_size,
    /* .is_host        = */ NULL,
};

const char * sim_host_buft_get_name(ggml_backend_buffer_type_t buft) {
    GGML_UNUSED(buft);
    return GGML_SIM_NAME "_Host";
}

ggml_backend_buffer_t sim_host_buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    void * data = sim_aligned_alloc(size);
    if (!data) {
        GGML_LOG_ERROR("%s: host allocation of %.2f MiB failed\n", __func__, size / 1024.0 / 1024.0);
        return nullptr;
    }
    sim_buffer * ctx = new sim_buffer;
    ctx->data = data;
    ctx->size = size;
    device_readable_add(data, size);
    return ggml_backend_buffer_init(buft, sim_buffer_interface, ctx, size);
}

size_t sim_host_buft_get_alignment(ggml_backend_buffer_type_t buft) {
    GGML_UNUSED(buft);
    return 32; // the CPU buffer type's alignment, as ggml-cuda's pinned host buffer type
}

bool sim_host_buft_is_host(ggml_backend_buffer_type_t buft) {
    GGML_UNUSED(buft);
    return true;
}

const ggml_backend_buffer_type_i sim_host_buft_interface = {
    /* .get_name       = */ sim_host_buft_get_name,
    /* .alloc_buffer   = */ sim_host_buft_alloc_buffer,
    /* .get_alignment  = */ sim_host_buft_get_alignment,
    /* .get_max_size   = */ NULL,
    /* .get_alloc_size = */ NULL,
    /* .is_host        = */ sim_host_buft_is_host,
};

bool buft_is_sim_device(ggml_backend_buffer_type_t buft) {
    return buft && buft->iface.alloc_buffer == sim_buft_alloc_buffer;
}

//
// graph snapshot
//

struct sim_graph {
    std::vector<ggml_tensor>    tensors; // nodes first, in graph order, then their sources
    std::vector<ggml_tensor *>  nodes;
    std::vector<int32_t>        use_counts;
    std::vector<ggml_bitset_t>  used;
    std::vector<ggml_tensor *>  keys;
    ggml_cgraph                 graph;
};

int32_t graph_use_count(const ggml_cgraph * g, const ggml_tensor * t) {
    if (!g->use_counts || g->visited_hash_set.size == 0) {
        return 0;
    }
    const size_t pos = ggml_hash_find(&g->visited_hash_set, t);
    if (pos == GGML_HASHSET_FULL || !ggml_bitset_get(g->visited_hash_set.used, pos)) {
        return 0;
    }
    return g->use_counts[pos];
}

std::shared_ptr<sim_graph> snapshot_graph(const ggml_cgraph * g) {
    auto s = std::make_shared<sim_graph>();
    const int n = g->n_nodes;

    std::unordered_map<const ggml_tensor *, size_t> index;
    std::vector<const ggml_tensor *> order;
    auto add = [&](const ggml_tensor * t) {
        if (t && index.emplace(t, order.size()).second) {
            order.push_back(t);
        }
    };
    for (int i = 0; i < n; i++) {
        add(g->nodes[i]);
    }
    GGML_ASSERT(order.size() == (size_t) n && "a graph node appears twice");
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < GGML_MAX_SRC; j++) {
            add(g->nodes[i]->src[j]);
        }
        add(g->nodes[i]->view_src);
    }

    s->tensors.resize(order.size());
    for (size_t k = 0; k < order.size(); k++) {
        s->tensors[k] = *order[k];
    }
    // sources of sources are not captured: CPU kernels only read a node's direct sources
    auto remap = [&](const ggml_tensor * t) -> ggml_tensor * {
        if (!t) {
            return nullptr;
        }
        auto it = index.find(t);
        return it == index.end() ? nullptr : &s->tensors[it->second];
    };
    for (ggml_tensor & t : s->tensors) {
        for (int j = 0; j < GGML_MAX_SRC; j++) {
            t.src[j] = remap(t.src[j]);
        }
        t.view_src = remap(t.view_src);
    }

    const size_t hsize = 2 * (size_t) n + 1;
    s->nodes.resize(n);
    s->use_counts.assign(hsize, 0);
    s->used.assign(ggml_bitset_size(hsize), 0);
    s->keys.assign(hsize, nullptr);
    ggml_hash_set hs = { hsize, s->used.data(), s->keys.data() };
    for (int i = 0; i < n; i++) {
        s->nodes[i] = &s->tensors[i];
        const size_t pos = ggml_hash_insert(&hs, s->nodes[i]);
        GGML_ASSERT(pos != GGML_HASHSET_ALREADY_EXISTS);
        s->use_counts[pos] = graph_use_count(g, g->nodes[i]);
    }

    s->graph = {
        /* .size             = */ n,
        /* .n_nodes          = */ n,
        /* .n_leafs          = */ 0,
        /* .nodes            = */ s->nodes.data(),
        /* .grads            = */ nullptr,
        /* .grad_accs        = */ nullptr,
        /* .leafs            = */ nullptr,
        /* .use_counts       = */ s->use_counts.data(),
        /* .visited_hash_set = */ hs,
        /* .order            = */ g->order,
        /* .uid              = */ 0,
    };
    return s;
}

//
// backend (one instance = one stream)
//

ggml_guid_t sim_guid() {
    static ggml_guid guid = { 0x73, 0x69, 0x6d, 0x2d, 0x70, 0x79, 0x6c, 0x6c, 0x61, 0x6d, 0x61, 0x2d, 0x6d, 0x6f, 0x65, 0x31 };
    return &guid;
}

sim_stream * stream_of(ggml_backend_t backend) {
    GGML_ASSERT(ggml_backend_is_sim(backend));
    if (backend->context == nullptr) {
        // sim_backend_free keeps the handle: a caller that kept it past the free lands here, not in freed memory
        GGML_ABORT("ggml_sim: a call through a freed SIM backend (%p): its owner freed it, the caller kept the handle",
                (void *) backend);
    }
    return (sim_stream *) backend->context;
}

const char * sim_backend_get_name(ggml_backend_t backend) {
    return stream_of(backend)->dev->name.c_str();
}

void sim_backend_free(ggml_backend_t backend) {
    sim_stream * st = stream_of(backend);
    st->drain();
    {
        std::lock_guard<std::mutex> lock(streams()->mutex);
        streams()->live.erase(st);
    }
    {
        std::lock_guard<std::mutex> lock(st->mutex);
        st->stop = true;
        st->cv_work.notify_one();
    }
    st->worker.join();
    ggml_backend_free(st->cpu);
    delete st;
    // the handle stays allocated as a tombstone (a few hundred bytes, never reused): a call through it aborts in
    // stream_of, where a real GPU backend's freed handle would read freed memory and usually seem to work
    backend->context = nullptr;
}

void check_device_buffer(sim_stream * st, const ggml_tensor * tensor) {
    ggml_backend_buffer_t buf = tensor_buffer(tensor);
    GGML_ASSERT(buf && buf->buft == &st->dev->buft && "unsupported buffer type");
}

// queues n_copies rows of `size` bytes from src to dst (strides apart) on the stream; the four tensor
// set/get entry points differ only in direction, so they all come through here
void submit_strided_copy(sim_stream * st, const char * kind, const ggml_tensor * tensor, size_t offset,
        char * dst, size_t stride_dst, const char * src, size_t stride_src, size_t size, size_t n_copies) {
    sim_task task;
    task.op.kind = kind; task.op.tensor = tensor->name; task.op.offset = offset; task.op.bytes = size * n_copies;
    task.delay_ns = copy_delay_ns(size * n_copies);
    if (n_copies > 0) {
        task.reads  = { range_of(src, (n_copies - 1) * stride_src + size) };
        task.writes = { range_of(dst, (n_copies - 1) * stride_dst + size) };
    }
    task.fn = [=] {
        for (size_t i = 0; i < n_copies; i++) {
            memcpy(dst + i * stride_dst, src + i * stride_src, size);
        }
    };
    st->submit(std::move(task));
}

void sim_backend_set_tensor_async(ggml_backend_t backend, ggml_tensor * tensor, const void * data, size_t offset, size_t size) {
    sim_stream * st = stream_of(backend);
    check_device_buffer(st, tensor);
    submit_strided_copy(st, "set", tensor, offset, (char *) tensor->data + offset, 0, (const char *) data, 0, size, 1);
}

void sim_backend_get_tensor_async(ggml_backend_t backend, const ggml_tensor * tensor, void * data, size_t offset, size_t size) {
    sim_stream * st = stream_of(backend);
    check_device_buffer(st, tensor);
    submit_strided_copy(st, "get", tensor, offset, (char *) data, 0, (const char *) tensor->data + offset, 0, size, 1);
}

void sim_backend_set_tensor_2d_async(ggml_backend_t backend, ggml_tensor * tensor, const void * data, size_t offset, size_t size,
        size_t n_copies, size_t stride_tensor, size_t stride_data) {
    sim_stream * st = stream_of(backend);
    check_device_buffer(st, tensor);
    submit_strided_copy(st, "set", tensor, offset, (char *) tensor->data + offset, stride_tensor,
            (const char *) data, stride_data, size, n_copies);
}

void sim_backend_get_tensor_2d_async(ggml_backend_t backend, const ggml_tensor * tensor, void * data, size_t offset, size_t size,
        size_t n_copies, size_t stride_tensor, size_t stride_data) {
    sim_stream * st = stream_of(backend);
    check_device_buffer(st, tensor);
    submit_strided_copy(st, "get", tensor, offset, (char *) data, stride_data,
            (const char *) tensor->data + offset, stride_tensor, size, n_copies);
}

// device to device only, as ggml-cuda: other pairs fall back to the scheduler's synchronous copy
bool sim_backend_cpy_tensor_async(ggml_backend_t backend_src, ggml_backend_t backend_dst, const ggml_tensor * src, ggml_tensor * dst) {
    if (!ggml_backend_is_sim(backend_src) || !ggml_backend_is_sim(backend_dst)) {
        return false;
    }
    sim_stream * st_src = stream_of(backend_src);
    sim_stream * st_dst = stream_of(backend_dst);
    ggml_backend_buffer_t buf_src = tensor_buffer(src);
    ggml_backend_buffer_t buf_dst = tensor_buffer(dst);
    if (!buf_src || !buf_dst || buf_src->buft != &st_src->dev->buft || buf_dst->buft != &st_dst->dev->buft) {
        return false;
    }

    const size_t size = ggml_nbytes(dst);
    const void * from = src->data;
    void * to = dst->data;
    sim_task task;
    task.op.kind = "copy"; task.op.tensor = dst->name; task.op.bytes = size;
    task.delay_ns = copy_delay_ns(size);
    task.reads  = { range_of(from, size) };
    task.writes = { range_of(to, size) };
    task.fn = [from, to, size] { memcpy(to, from, size); };
    st_src->submit(std::move(task));

    if (st_src != st_dst) {
        // as ggml-cuda: copy on the source stream, then the destination stream waits for it
        std::shared_ptr<sim_event_state> ev = new_event_state();
        const uint64_t r = ev->issue();
        sim_task rec;
        rec.op.kind = "event_record"; rec.op.event = ev->id;
        rec.fn = [ev, r] { ev->complete(r); };
        st_src->submit(std::move(rec));
        sim_task wait;
        wait.op.kind = "event_wait"; wait.op.event = ev->id;
        wait.fn = [ev, r] { ev->wait(r); };
        st_dst->submit(std::move(wait));
    }
    return true;
}

// ggml_backend_copy_regions_async (ggml-copy-regions.h): every region in one task of the stream, as one CUDA call.
// The contract lets a backend copy a call's regions in any order (CUDA's batch and kernel do): a region that writes
// bytes another region of the call reads or writes aborts, and the task copies them last to first, so a caller
// that relies on their order computes wrong here too
int sim_copy_regions_async(ggml_backend_t backend, const ggml_backend_copy_region * regions, int n_regions, bool host_src) {
    GGML_UNUSED(host_src); // SIM memory is host memory: both kinds copy alike
    if (n_regions <= 0) {
        return 0;
    }
    sim_stream * st = stream_of(backend);
    std::vector<ggml_backend_copy_region> rs(regions, regions + n_regions);
    for (size_t i = 0; i < rs.size(); i++) {
        for (size_t j = 0; j < rs.size(); j++) {
            const sim_range w = range_of(rs[i].dst, rs[i].size);
            if (i != j && (overlaps(w, range_of(rs[j].src, rs[j].size)) || (j > i && overlaps(w, range_of(rs[j].dst, rs[j].size))))) {
                GGML_ABORT("ggml_sim: copy regions %zu and %zu of one call overlap (their order is undefined)", i, j);
            }
        }
    }
    std::reverse(rs.begin(), rs.end());
    sim_task task;
    task.op.kind = "copy"; task.op.tensor = "regions";
    for (const ggml_backend_copy_region & r : rs) {
        task.reads.push_back(range_of(r.src, r.size));
        task.writes.push_back(range_of(r.dst, r.size));
        task.op.bytes += r.size;
    }
    task.delay_ns = copy_delay_ns(task.op.bytes);
    task.fn = [rs] {
        for (const ggml_backend_copy_region & r : rs) {
            memcpy(r.dst, r.src, r.size);
        }
    };
    st->submit(std::move(task));
    return 1;
}

void sim_backend_synchronize(ggml_backend_t backend) {
    sim_stream * st = stream_of(backend);
    const int64_t t0 = now_ns();
    if (!sim_cfg().debug_skip_sync) {
        st->drain();
    }
    sim_op op;
    op.kind = "sync"; op.async = false;
    oplog_write(st->dev->name.c_str(), st->id, op, t0, t0, now_ns());
}

bool is_noop(const ggml_tensor * t) {
    return t->op == GGML_OP_NONE || t->op == GGML_OP_VIEW || t->op == GGML_OP_RESHAPE || t->op == GGML_OP_PERMUTE ||
        t->op == GGML_OP_TRANSPOSE;
}

// The index a node reads and the bound it must respect, for the ops whose CPU kernels index memory with
// values computed on the device. nullptr: not such a node.
const ggml_tensor * index_src(const ggml_tensor * node, int64_t * bound) {
    switch (node->op) {
        case GGML_OP_MUL_MAT_ID: *bound = node->src[0]->ne[2]; return node->src[2];
        case GGML_OP_GET_ROWS:   *bound = node->src[0]->ne[1]; return node->src[1];
        case GGML_OP_SET_ROWS:   *bound = node->ne[1];         return node->src[1];
        case GGML_OP_ADD_ID:     *bound = node->src[1]->ne[1]; return node->src[2];
        default:                 return nullptr;
    }
}

// A correct program never gets here with an index out of range (the scheduler asserts expert ids in range);
// a missing wait can (ids copied or computed from memory that was not written yet). Like a GPU, SIM then
// computes garbage rather than crashing the process: the index is counted as a race, reported, and replaced
// with 0 before the kernel reads it.
void guard_indices(const ggml_tensor * node, const char * dev, int inst) {
    int64_t bound = 0;
    const ggml_tensor * ids = index_src(node, &bound);
    if (!ids || !ids->data || (ids->type != GGML_TYPE_I32 && ids->type != GGML_TYPE_I64)) {
        return;
    }
    size_t n_bad = 0;
    for (int64_t i3 = 0; i3 < ids->ne[3]; i3++) {
        for (int64_t i2 = 0; i2 < ids->ne[2]; i2++) {
            for (int64_t i1 = 0; i1 < ids->ne[1]; i1++) {
                char * row = (char *) ids->data + i1*ids->nb[1] + i2*ids->nb[2] + i3*ids->nb[3];
                for (int64_t i0 = 0; i0 < ids->ne[0]; i0++) {
                    char * p = row + i0*ids->nb[0];
                    const int64_t v = ids->type == GGML_TYPE_I32 ? (int64_t) *(int32_t *) p : *(int64_t *) p;
                    if (v == -1 && ggml_ids_masked(node)) {
                        continue; // "no expert": the kernel takes it
                    }
                    if (v < 0 || v >= bound) {
                        n_bad++;
                        if (ids->type == GGML_TYPE_I32) {
                            *(int32_t *) p = 0;
                        } else {
                            *(int64_t *) p = 0;
                        }
                    }
                }
            }
        }
    }
    if (n_bad > 0) {
        sim_op other;
        other.kind = ggml_op_desc(node);
        other.tensor = node->name;
        report_race("out-of-range indices read by", dev, ids, 0, n_bad, inst, other);
    }
}

ggml_status sim_backend_graph_compute(ggml_backend_t backend, ggml_cgraph * cgraph) {
    sim_stream * st = stream_of(backend);
    if (cgraph->n_nodes == 0) {
        return GGML_STATUS_SUCCESS;
    }
    std::shared_ptr<sim_graph> snap = snapshot_graph(cgraph);
    const ggml_tensor * first = cgraph->nodes[0];

    sim_task task;
    task.op.kind       = "compute";
    task.op.tensor     = first->name;
    task.op.n_nodes    = cgraph->n_nodes;
    task.op.first_op   = ggml_op_desc(first);
    task.op.first_src0 = first->src[0] ? first->src[0]->name : "";
    task.delay_ns      = sim_cfg().compute_latency_ns;
    for (const ggml_tensor * node : snap->nodes) {
        if (is_noop(node) || !node->data) {
            continue;
        }
        task.writes.push_back(range_of(node->data, ggml_nbytes(node)));
        // the expert cache's lookup updates its status word, a source, in place (its state is the node's own view): a
        // host read of it before the compute is waited for races with it like a read of the node's own output
        if (node->op == GGML_OP_MOE_CACHE_LOOKUP && node->src[2] && node->src[2]->data) {
            task.writes.push_back(range_of(node->src[2]->data, ggml_nbytes(node->src[2])));
        }
        for (int j = 0; j < GGML_MAX_SRC; j++) {
            if (node->src[j] && node->src[j]->data) {
                task.reads.push_back(range_of(node->src[j]->data, ggml_nbytes(node->src[j])));
            }
        }
    }

    ggml_backend_t cpu = st->cpu;
    const char * dev = st->dev->name.c_str();
    const int inst = st->id;
    task.fn = [snap, cpu, dev, inst] {
        // computed in segments that end before each index-reading node, so its indices can be checked after
        // their producers ran; the use counts stay those of the whole graph (fusion decides as upstream)
        auto run = [&](int i0, int i1) {
            if (i1 <= i0) {
                return;
            }
            ggml_cgraph view = snap->graph;
            view.size    = 0;
            view.n_nodes = i1 - i0;
            view.nodes   = snap->graph.nodes + i0;
            const ggml_status status = ggml_backend_graph_compute(cpu, &view);
            if (status != GGML_STATUS_SUCCESS) {
                GGML_ABORT("SIM: CPU kernels failed on a queued graph (status %d)", (int) status);
            }
        };
        const int n = snap->graph.n_nodes;
        int start = 0;
        for (int i = 0; i < n; i++) {
            int64_t bound;
            if (index_src(snap->graph.nodes[i], &bound)) {
                run(start, i);
                guard_indices(snap->graph.nodes[i], dev, inst);
                start = i;
            }
        }
        run(start, n);
    };
    st->submit(std::move(task));
    return GGML_STATUS_SUCCESS;
}

ggml_backend_event_t sim_dev_event_new(ggml_backend_dev_t dev);

std::shared_ptr<sim_event_state> event_state(ggml_backend_event_t event) {
    GGML_ASSERT(event && event->device && event->device->iface.event_new == sim_dev_event_new && "not a SIM event");
    return ((sim_event *) event->context)->state;
}

void sim_backend_event_record(ggml_backend_t backend, ggml_backend_event_t event) {
    // CUDA fails a cudaEventRecord whose event and stream belong to different devices (ggml-cuda aborts)
    GGML_ASSERT(event->device == backend->device && "an event recorded on a stream of another device");
    sim_stream * st = stream_of(backend);
    std::shared_ptr<sim_event_state> ev = event_state(event);
    const uint64_t r = ev->issue();
    sim_task task;
    task.op.kind = "event_record"; task.op.event = ev->id;
    task.fn = [ev, r] { ev->complete(r); };
    st->submit(std::move(task));
}

void sim_backend_event_wait(ggml_backend_t backend, ggml_backend_event_t event) {
    sim_stream * st = stream_of(backend);
    std::shared_ptr<sim_event_state> ev = event_state(event);
    const uint64_t r = ev->latest();
    sim_task task;
    task.op.kind = "event_wait"; task.op.event = ev->id;
    task.fn = [ev, r] { ev->wait(r); };
    st->submit(std::move(task));
}

const ggml_backend_i sim_backend_interface = {
    /* .get_name                = */ sim_backend_get_name,
    /* .free                    = */ sim_backend_free,
    /* .set_tensor_async        = */ sim_backend_set_tensor_async,
    /* .get_tensor_async        = */ sim_backend_get_tensor_async,
    /* .set_tensor_2d_async     = */ sim_backend_set_tensor_2d_async,
    /* .get_tensor_2d_async     = */ sim_backend_get_tensor_2d_async,
    /* .cpy_tensor_async        = */ sim_backend_cpy_tensor_async,
    /* .synchronize             = */ sim_backend_synchronize,
    /* .graph_plan_create       = */ NULL,
    /* .graph_plan_free         = */ NULL,
    /* .graph_plan_update       = */ NULL,
    /* .graph_plan_compute      = */ NULL,
    /* .graph_compute           = */ sim_backend_graph_compute,
    /* .event_record            = */ sim_backend_event_record,
    /* .event_wait              = */ sim_backend_event_wait,
    /* .graph_optimize          = */ NULL,
};

// llama.cpp finds this through get_proc_address("ggml_backend_set_n_threads") and calls it from the host
// thread: queue it, so it never changes the thread count of a graph the worker is computing
void sim_backend_set_n_threads(ggml_backend_t backend, int n_threads) {
    sim_stream * st = stream_of(backend);
    if (!st->cpu_set_n_threads) {
        return;
    }
    sim_task task;
    task.logged = false;
    ggml_backend_set_n_threads_t fn = st->cpu_set_n_threads;
    ggml_backend_t cpu = st->cpu;
    task.fn = [fn, cpu, n_threads] { fn(cpu, n_threads); };
    st->submit(std::move(task));
}

//
// device
//

sim_device * device_of(ggml_backend_dev_t dev) {
    return (sim_device *) dev->context;
}

// resolved on first use, not at registration: the registry is still being built then
ggml_backend_dev_t cpu_device(sim_device * d) {
    std::call_once(d->cpu_once, [d] { d->cpu_dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU); });
    return d->cpu_dev;
}

const char * sim_dev_get_name(ggml_backend_dev_t dev) {
    return device_of(dev)->name.c_str();
}

const char * sim_dev_get_description(ggml_backend_dev_t dev) {
    return device_of(dev)->description.c_str();
}

void sim_dev_get_memory(ggml_backend_dev_t dev, size_t * free, size_t * total) {
    const size_t t = memory_of(device_of(dev));
    const size_t used = device_of(dev)->used.load();
    *total = t;
    *free  = used < t ? t - used : 0;
}

enum ggml_backend_dev_type sim_dev_get_type(ggml_backend_dev_t dev) {
    GGML_UNUSED(dev);
    return sim_cfg().integrated ? GGML_BACKEND_DEVICE_TYPE_IGPU : GGML_BACKEND_DEVICE_TYPE_GPU;
}

void sim_dev_get_props(ggml_backend_dev_t dev, ggml_backend_dev_props * props) {
    props->name        = sim_dev_get_name(dev);
    props->description = sim_dev_get_description(dev);
    props->type        = sim_dev_get_type(dev);
    props->device_id   = device_of(dev)->device_id.c_str();
    sim_dev_get_memory(dev, &props->memory_free, &props->memory_total);
    props->caps = {
        /* .async                 = */ true,
        /* .host_buffer           = */ true,
        /* .buffer_from_host_ptr  = */ false,
        /* .events                = */ true,
        /* .mmap_support          = */ true,
    };
}

ggml_backend_t sim_dev_init_backend(ggml_backend_dev_t dev, const char * params) {
    GGML_UNUSED(params);
    sim_device * d = device_of(dev);
    ggml_backend_dev_t cpu_dev = cpu_device(d);
    if (!cpu_dev) {
        GGML_LOG_ERROR("%s: %s needs the CPU backend to compute and none is registered\n", __func__, d->name.c_str());
        return nullptr;
    }
    ggml_backend_t cpu = ggml_backend_dev_init(cpu_dev, nullptr);
    if (!cpu) {
        GGML_LOG_ERROR("%s: %s: could not create its CPU backend instance\n", __func__, d->name.c_str());
        return nullptr;
    }

    sim_stream * st = new sim_stream;
    st->id  = g_next_instance_id++;
    st->dev = d;
    st->cpu = cpu;
    st->cpu_set_n_threads = (ggml_backend_set_n_threads_t)
        ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(cpu_dev), "ggml_backend_set_n_threads");
    st->worker = std::thread([st] { st->run(); });
    {
        std::lock_guard<std::mutex> lock(streams()->mutex);
        streams()->live.insert(st);
    }
    return new ggml_backend {
        /* .guid    = */ sim_guid(),
        /* .iface   = */ sim_backend_interface,
        /* .device  = */ dev,
        /* .context = */ st,
    };
}

ggml_backend_buffer_type_t sim_dev_get_buffer_type(ggml_backend_dev_t dev) {
    return &device_of(dev)->buft;
}

sim_reg_state * reg_state() {
    return (sim_reg_state *) ggml_backend_sim_reg()->context;
}

ggml_backend_buffer_type_t sim_dev_get_host_buffer_type(ggml_backend_dev_t dev) {
    GGML_UNUSED(dev);
    return &reg_state()->host_buft;
}

bool sim_dev_supports_op(ggml_backend_dev_t dev, const ggml_tensor * op) {
    ggml_backend_dev_t cpu_dev = cpu_device(device_of(dev));
    if (!cpu_dev) {
        return false;
    }
    if ((op->op == GGML_OP_MOE_CACHE_LOOKUP || op->op == GGML_OP_MOE_CACHE_FILL) && sim_cfg().no_cache_ops[device_of(dev)->index]) {
        return false;
    }
    // a weight's product (a leaf: the loader asks of a fresh tensor in a dummy buffer), not one of activations (KQ reads
    // a view of an F16 cache)
    const ggml_tensor * w = op->src[0];
    const bool product = op->op == GGML_OP_MUL_MAT || op->op == GGML_OP_MUL_MAT_ID;
    if (product && sim_cfg().no_types[device_of(dev)->index][w->type] && w->op == GGML_OP_NONE && w->view_src == nullptr) {
        return false;
    }
    // a GPU cannot read weights the CPU backend repacked into its own (non-host) layout
    for (int i = 0; i < GGML_MAX_SRC; i++) {
        const ggml_tensor * src = op->src[i];
        ggml_backend_buffer_t buf = src ? tensor_buffer(src) : nullptr;
        if (buf && !ggml_backend_buffer_is_host(buf) && !buft_is_sim_device(buf->buft)) {
            return false;
        }
    }
    return ggml_backend_dev_supports_op(cpu_dev, op);
}

bool sim_dev_supports_buft(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft) {
    // integrated: the device computes on its host buffers where they are, as ggml-cuda does on an integrated GPU
    return buft == &device_of(dev)->buft || (sim_cfg().integrated && buft == &reg_state()->host_buft);
}

// ggml-cuda's rule (get_op_batch_size): MUL_MAT by ne[1], MUL_MAT_ID and ROPE by ne[2] (tokens), never GET_ROWS
bool sim_dev_offload_op(ggml_backend_dev_t dev, const ggml_tensor * op) {
    if (sim_cfg().no_offload[device_of(dev)->index]) {
        return false;
    }
    int64_t batch;
    switch (op->op) {
        case GGML_OP_GET_ROWS:
            batch = 0;
            break;
        case GGML_OP_MUL_MAT:
            batch = op->ne[1];
            break;
        case GGML_OP_MUL_MAT_ID:
        case GGML_OP_ROPE:
        case GGML_OP_ROPE_BACK:
            batch = op->ne[2];
            break;
        default:
            batch = ggml_nrows(op);
            break;
    }
    return batch >= sim_cfg().offload_min_batch;
}

ggml_backend_event_t sim_dev_event_new(ggml_backend_dev_t dev) {
    return new ggml_backend_event {
        /* .device  = */ dev,
        /* .context = */ new sim_event { new_event_state() },
    };
}

void sim_dev_event_free(ggml_backend_dev_t dev, ggml_backend_event_t event) {
    GGML_UNUSED(dev);
    delete (sim_event *) event->context;
    delete event;
}

void sim_dev_event_synchronize(ggml_backend_dev_t dev, ggml_backend_event_t event) {
    std::shared_ptr<sim_event_state> ev = ((sim_event *) event->context)->state;
    const int64_t t0 = now_ns();
    if (!sim_cfg().debug_skip_sync) {
        ev->wait(ev->latest());
    }
    sim_op op;
    op.kind = "sync"; op.async = false; op.event = ev->id;
    oplog_write(device_of(dev)->name.c_str(), -1, op, t0, t0, now_ns());
}

const ggml_backend_device_i sim_device_interface = {
    /* .get_name             = */ sim_dev_get_name,
    /* .get_description      = */ sim_dev_get_description,
    /* .get_memory           = */ sim_dev_get_memory,
    /* .get_type             = */ sim_dev_get_type,
    /* .get_props            = */ sim_dev_get_props,
    /* .init_backend         = */ sim_dev_init_backend,
    /* .get_buffer_type      = */ sim_dev_get_buffer_type,
    /* .get_host_buffer_type = */ sim_dev_get_host_buffer_type,
    /* .buffer_from_host_ptr = */ NULL,
    /* .supports_op          = */ sim_dev_supports_op,
    /* .supports_buft        = */ sim_dev_supports_buft,
    /* .offload_op           = */ sim_dev_offload_op,
    /* .event_new            = */ sim_dev_event_new,
    /* .event_free           = */ sim_dev_event_free,
    /* .event_synchronize    = */ sim_dev_event_synchronize,
};

//
// registry
//

const char * sim_reg_get_name(ggml_backend_reg_t reg) {
    GGML_UNUSED(reg);
    return GGML_SIM_NAME;
}

size_t sim_reg_get_device_count(ggml_backend_reg_t reg) {
    return ((sim_reg_state *) reg->context)->devices.size();
}

ggml_backend_dev_t sim_reg_get_device(ggml_backend_reg_t reg, size_t index) {
    sim_reg_state * rs = (sim_reg_state *) reg->context;
    GGML_ASSERT(index < rs->devices.size());
    return &rs->devices[index]->dev;
}

//
// host map (ggml-host-map.h): SIM memory is host memory, so there is nothing to page-lock; what is modelled is
// the contract callers rely on (references counted per base pointer, the last unmap releases the range), its
// refusal of a range that is not wholly mapped, and its failure (GGML_SIM_HOST_MAP_FAIL=1), each logged so
// tests can see what a CUDA device would have done
//

// cudaHostRegister pins every page of the range and fails when one of them is not mapped (a hole left by
// munmap, e.g. between two adjacent file mappings whose heads and tails llama.cpp unmapped). The probe is
// mincore rather than a parse of /proc/self/maps: it asks the kernel about the range itself in one call per
// chunk, needs no /proc (absent in some sandboxes), does not depend on a text format or on merging the
// adjacent lines of one range, and neither faults pages in nor changes their residency. It fails with ENOMEM
// exactly when part of the range is unmapped. What it does not prove: that the pages are readable (a
// PROT_NONE mapping passes), which CUDA would also refuse; no caller of ours maps such memory.
// On success returns true; else false with the address of the first unmapped page in *hole.
#ifndef _WIN32
static bool sim_pages_mapped(uintptr_t lo, uintptr_t hi, unsigned char * vec) {
    // another error (EAGAIN: the kernel ran short of memory) says nothing about holes
    return mincore((void *) lo, hi - lo, vec) == 0 || errno != ENOMEM;
}
#endif

bool sim_range_is_mapped(void * ptr, size_t size, uintptr_t * hole) {
#ifdef _WIN32
    GGML_UNUSED(ptr); GGML_UNUSED(size); GGML_UNUSED(hole);
    return true; // not modelled on Windows
#else
    const uintptr_t page  = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t lo    = (uintptr_t) ptr / page * page;
    const uintptr_t hi    = ((uintptr_t) ptr + size + page - 1) / page * page;
    const uintptr_t chunk = 4096 * page; // bounds the residency vector for ranges of many GiB
    std::vector<unsigned char> vec(chunk / page);
    for (uintptr_t a = lo; a < hi; a += chunk) {
        const uintptr_t b = std::min(hi, a + chunk);
        if (!sim_pages_mapped(a, b, vec.data())) {
            // page by page inside the chunk, so the log names the hole itself
            for (*hole = a; *hole < b && sim_pages_mapped(*hole, *hole + page, vec.data()); *hole += page) {
            }
            return false;
        }
    }
    return true;
#endif
}

struct sim_host_maps {
    std::mutex                              mutex;
    std::unordered_map<uintptr_t, int>      refs;      // base pointer -> references
    int64_t                                 n_new = 0; // registrations of a new range attempted
};

sim_host_maps & host_maps() {
    static sim_host_maps * m = new sim_host_maps; // never destroyed: models may be freed during exit
    return *m;
}

bool sim_host_map(void * ptr, size_t size) {
    sim_host_maps & m = host_maps();
    const int64_t t0 = now_ns();
    sim_op op;
    op.kind = "host_map"; op.async = false; op.ptr = (uintptr_t) ptr; op.bytes = size;
    {
        std::lock_guard<std::mutex> lock(m.mutex);
        uintptr_t hole = 0;
        auto it = m.refs.find(op.ptr);
        // a range mapped already is only counted, as CUDA does, so the probe runs on first registration only
        const bool mapped = it != m.refs.end() || (ptr != nullptr && sim_range_is_mapped(ptr, size, &hole));
        if (!mapped) {
            GGML_LOG_WARN("ggml_sim: host_map refuses %.2f MiB at %p: the page at %p (+%.2f MiB) is not mapped, which "
                    "cudaHostRegister refuses too\n", size / 1024.0 / 1024.0, ptr, (void *) hole,
                    ((double) hole - (double) (uintptr_t) ptr) / 1024.0 / 1024.0);
        }
        const bool fail_nth = it == m.refs.end() && ++m.n_new == sim_cfg().host_map_fail_nth;
        if (sim_cfg().host_map_fail || fail_nth || ptr == nullptr || !mapped) {
            op.refs  = it == m.refs.end() ? 0 : it->second;
            op.ok    = false;
        } else {
            op.refs = ++m.refs[op.ptr];
            if (op.refs == 1) {
                device_readable_add(ptr, size);
            }
        }
    }
    oplog_write(GGML_SIM_NAME, -1, op, t0, t0, now_ns());
    return op.ok;
}

void sim_host_unmap(void * ptr) {
    sim_host_maps & m = host_maps();
    const int64_t t0 = now_ns();
    sim_op op;
    op.kind = "host_unmap"; op.async = false; op.ptr = (uintptr_t) ptr;
    {
        std::lock_guard<std::mutex> lock(m.mutex);
        auto it = m.refs.find(op.ptr);
        if (it == m.refs.end()) {
            // an unmap without a map is a caller bug a real device would turn into an error code: report it
            GGML_LOG_ERROR("ggml_sim: host_unmap of %p, which is not mapped\n", ptr);
            op.ok = false;
        } else {
            op.refs = --it->second;
            if (op.refs == 0) {
                m.refs.erase(it);
                device_readable_remove(ptr);
            }
        }
    }
    oplog_write(GGML_SIM_NAME, -1, op, t0, t0, now_ns());
}

// the end of the mapped range that holds ptr, or 0 where none does (or GGML_SIM_HOST_NO_MAPPED=1: a device that
// cannot read host memory in place, so callers take their fallback)
uintptr_t sim_readable_end(const void * ptr) {
    if (sim_cfg().host_no_mapped) {
        return 0;
    }
    sim_device_readable & r = device_readable();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.ranges.upper_bound((uintptr_t) ptr);
    if (it == r.ranges.begin()) {
        return 0;
    }
    --it;
    return (uintptr_t) ptr < it->second ? it->second : 0;
}

// SIM memory is host memory, so a kernel reads host memory at its own address; what is modelled is that only
// page-locked memory may be read so (cudaMallocHost buffers, mapped registrations)
void * sim_host_device_ptr(int device, const void * ptr) {
    if (device < 0 || device >= sim_cfg().n_devices) {
        return nullptr;
    }
    return sim_readable_end(ptr) != 0 ? (void *) ptr : nullptr;
}

// ggml-dev-caps.h: SIM computes a graph's nodes in order on its stream, and its kernels read mapped host memory in
// place as CUDA's do: [ptr, ptr + size) inside one mapped range (ptr NULL: whether they ever can: yes)
bool sim_dev_keeps_node_order(ggml_backend_dev_t dev) {
    GGML_UNUSED(dev);
    return true;
}

bool sim_dev_reads_host_in_place(ggml_backend_dev_t dev, ggml_backend_buffer_t buf, const void * ptr, size_t size) {
    GGML_UNUSED(dev);
    GGML_UNUSED(buf);
    return ptr == nullptr || (size > 0 && (uintptr_t) ptr + size <= sim_readable_end(ptr));
}

// ggml_backend_dev_mul_mat_id_vec_max_batch (ggml-mmid-batch.h): SIM computes with the CPU's kernels, which do not
// depend on the expert count, so only GGML_SIM_CC makes it report a CUDA architecture's limit (for the cache's
// path tests)
int sim_dev_mul_mat_id_vec_max_batch(ggml_backend_dev_t dev, ggml_type type) {
    GGML_UNUSED(dev);
    const int cc = sim_cfg().cuda_cc;
    return cc > 0 && ggml_is_quantized(type) ? get_mmvq_mmid_max_batch(type, cc) : MMVQ_MAX_BATCH_SIZE;
}

// SIM computes with the CPU's kernels, which take masked ids; GGML_SIM_NO_MASKED_IDS=1 plays a device that does not
bool sim_dev_masked_ids(ggml_backend_dev_t dev) {
    GGML_UNUSED(dev);
    return !sim_cfg().no_masked_ids;
}

void * sim_reg_get_proc_address(ggml_backend_reg_t reg, const char * name) {
    GGML_UNUSED(reg);
    if (strcmp(name, "ggml_backend_set_n_threads") == 0) {
        return (void *) sim_backend_set_n_threads;
    }
    if (strcmp(name, "ggml_backend_sim_poison") == 0) {
        return (void *) ggml_backend_sim_poison;
    }
    if (strcmp(name, "ggml_backend_sim_poison_async") == 0) {
        return (void *) ggml_backend_sim_poison_async;
    }
    if (strcmp(name, "ggml_backend_sim_n_races") == 0) {
        return (void *) ggml_backend_sim_n_races;
    }
    if (strcmp(name, GGML_BACKEND_HOST_MAP_PROC) == 0) {
        return (void *) (ggml_backend_host_map_t) sim_host_map;
    }
    if (strcmp(name, GGML_BACKEND_HOST_UNMAP_PROC) == 0) {
        return (void *) (ggml_backend_host_unmap_t) sim_host_unmap;
    }
    if (strcmp(name, GGML_BACKEND_HOST_DEVICE_PTR_PROC) == 0) {
        return (void *) (ggml_backend_host_device_ptr_t) sim_host_device_ptr;
    }
    if (strcmp(name, GGML_BACKEND_COPY_REGIONS_PROC) == 0) {
        return (void *) (ggml_backend_copy_regions_async_t) sim_copy_regions_async;
    }
    if (strcmp(name, GGML_BACKEND_DEV_KEEPS_NODE_ORDER_PROC) == 0) {
        return (void *) (ggml_backend_dev_keeps_node_order_t) sim_dev_keeps_node_order;
    }
    if (strcmp(name, GGML_BACKEND_DEV_READS_HOST_IN_PLACE_PROC) == 0) {
        return (void *) (ggml_backend_dev_reads_host_in_place_t) sim_dev_reads_host_in_place;
    }
    if (strcmp(name, GGML_BACKEND_DEV_MASKED_IDS_PROC) == 0) {
        return (void *) (ggml_backend_dev_masked_ids_t) sim_dev_masked_ids;
    }
    if (strcmp(name, GGML_BACKEND_DEV_MUL_MAT_ID_VEC_MAX_BATCH_PROC) == 0) {
        return (void *) (ggml_backend_dev_mul_mat_id_vec_max_batch_t) sim_dev_mul_mat_id_vec_max_batch;
    }
    return nullptr;
}

const ggml_backend_reg_i sim_reg_interface = {
    /* .get_name         = */ sim_reg_get_name,
    /* .get_device_count = */ sim_reg_get_device_count,
    /* .get_device       = */ sim_reg_get_device,
    /* .get_proc_address = */ sim_reg_get_proc_address,
};

} // namespace

ggml_backend_reg_t ggml_backend_sim_reg(void) {
    // never destroyed, like every ggml registry entry
    static sim_reg_state * rs = [] {
        const sim_config & cfg = sim_cfg();
        sim_reg_state * s = new sim_reg_state;
        s->reg = { /* .api_version = */ GGML_BACKEND_API_VERSION, /* .iface = */ sim_reg_interface, /* .context = */ s };
        for (int i = 0; i < cfg.n_devices; i++) {
            sim_device * d  = new sim_device;
            d->index        = i;
            d->name         = GGML_SIM_NAME + std::to_string(i);
            d->description  = "simulated GPU (test double on CPU kernels)";
            d->device_id    = "sim:" + std::to_string(i);
            d->buft         = { /* .iface = */ sim_buft_interface, /* .device = */ &d->dev, /* .context = */ d };
            d->dev          = { /* .iface = */ sim_device_interface, /* .reg = */ &s->reg, /* .context = */ d };
            s->devices.push_back(d);
        }
        s->host_buft = {
            /* .iface   = */ sim_host_buft_interface,
            /* .device  = */ s->devices.empty() ? nullptr : &s->devices[0]->dev,
            /* .context = */ nullptr,
        };
        if (cfg.n_devices > 0) {
            GGML_LOG_INFO("ggml_sim: %d simulated GPU device(s) (a test double: CPU kernels on worker threads), %zu MiB (the first), "
                    "copy latency %.1f us, copy bandwidth %s GB/s, poison %s, op log %s\n",
                    cfg.n_devices, cfg.memory_bytes / 1024 / 1024, cfg.copy_latency_ns / 1000.0,
                    cfg.copy_bytes_per_ns > 0 ? std::to_string(cfg.copy_bytes_per_ns).c_str() : "unlimited",
                    cfg.poison ? "on" : "off", cfg.oplog_path.empty() ? "off" : cfg.oplog_path.c_str());
            if (cfg.host_map_fail) {
                GGML_LOG_WARN("ggml_sim: GGML_SIM_HOST_MAP_FAIL=1: ggml_backend_host_map fails (fault injection)\n");
            }
            if (cfg.host_map_fail_nth > 0) {
                GGML_LOG_WARN("ggml_sim: GGML_SIM_HOST_MAP_FAIL_NTH=%lld: registration %lld of a new range fails (fault injection)\n",
                        (long long) cfg.host_map_fail_nth, (long long) cfg.host_map_fail_nth);
            }
            for (int i = 0; i < cfg.n_devices; i++) {
                if (cfg.no_cache_ops[i]) {
                    GGML_LOG_WARN("ggml_sim: GGML_SIM_NO_CACHE_OPS: %s lacks the expert cache's lookup ops (fault injection)\n",
                            s->devices[i]->name.c_str());
                }
                if (cfg.no_offload[i]) {
                    GGML_LOG_WARN("ggml_sim: GGML_SIM_NO_OFFLOAD: %s takes no op on host weights (fault injection)\n",
                            s->devices[i]->name.c_str());
                }
            }
            if (cfg.host_no_mapped) {
                GGML_LOG_WARN("ggml_sim: GGML_SIM_HOST_NO_MAPPED=1: kernels cannot read host memory in place (fault injection)\n");
            }
            if (cfg.debug_skip_sync) {
                GGML_LOG_WARN("ggml_sim: GGML_SIM_DEBUG_SKIP_SYNC=1: synchronize does not wait; results will be wrong (negative control)\n");
            }
        }
        return s;
    }();
    return &rs->reg;
}

size_t ggml_backend_sim_n_races(void) {
    return g_n_races.load();
}

bool ggml_backend_is_sim(ggml_backend_t backend) {
    return backend != NULL && ggml_guid_matches(backend->guid, sim_guid());
}

bool ggml_backend_buffer_is_sim(ggml_backend_buffer_t buffer) {
    return buffer != NULL && buffer->buft != NULL &&
        (buffer->buft->iface.alloc_buffer == sim_buft_alloc_buffer || buffer->buft->iface.alloc_buffer == sim_host_buft_alloc_buffer);
}

bool ggml_backend_sim_poison(ggml_backend_buffer_t buffer, size_t offset, size_t size) {
    if (!sim_cfg().poison || !ggml_backend_buffer_is_sim(buffer)) {
        return false;
    }
    sim_buffer * ctx = (sim_buffer *) buffer->context;
    GGML_ASSERT(offset + size <= ctx->size);
    const int64_t t0 = now_ns();
    fill_nan((char *) ctx->data + offset, size);
    sim_op op;
    op.kind = "poison"; op.async = false; op.offset = offset; op.bytes = size;
    oplog_write(sim_buffer_dev_name(buffer), -1, op, t0, t0, now_ns());
    return true;
}

bool ggml_backend_sim_poison_async(ggml_backend_t backend, ggml_backend_buffer_t buffer, size_t offset, size_t size) {
    if (!sim_cfg().poison || !ggml_backend_is_sim(backend) || !ggml_backend_buffer_is_sim(buffer)) {
        return false;
    }
    sim_buffer * ctx = (sim_buffer *) buffer->context;
    GGML_ASSERT(offset + size <= ctx->size);
    char * p = (char *) ctx->data + offset;
    sim_task task;
    task.op.kind = "poison"; task.op.offset = offset; task.op.bytes = size;
    task.writes = { range_of(p, size) };
    task.fn = [p, size] { fill_nan(p, size); };
    stream_of(backend)->submit(std::move(task));
    return true;
}

size_t ggml_backend_sim_n_pending(void) {
    sim_streams * s = streams();
    std::lock_guard<std::mutex> lock(s->mutex);
    size_t n = 0;
    for (sim_stream * st : s->live) {
        std::lock_guard<std::mutex> stream_lock(st->mutex);
        n += (size_t) (st->n_submitted - st->n_done);
    }
    return n;
}
