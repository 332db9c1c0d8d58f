#pragma once

// pyllama_moe: the thread on which the scheduler computes its CPU splits when asynchronous CPU splits are on
// (ggml_backend_sched_set_async_cpu). The scheduler posts one split at a time and joins it before it posts the
// next, so a job needs no queue: the worker waits on the events of the device-to-host copies that feed the split,
// computes it on the CPU backend and reports the status back to the join.
//
// Waiting on either side spins for a short while and then blocks: in decode a CPU split and the join that follows
// are tens of microseconds apart, where a condition variable's wake-up alone would cost as much again.

#include "ggml-backend.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

struct ggml_sched_cpu_worker {
    static constexpr int MAX_WAITS = 16; // events a job waits on: one per device at most

    // debug knobs (set before the first post): sleep before each job, fail the n-th job (1-based) without computing
    int64_t  debug_delay_us = 0;
    uint64_t debug_fail_nth = 0;

    ggml_sched_cpu_worker() : thread([this] { run(); }) {}

    ~ggml_sched_cpu_worker() {
        join();
        {
            std::lock_guard<std::mutex> lock(mutex);
            stopping = true;
        }
        wake.notify_all();
        thread.join();
    }

    ggml_sched_cpu_worker(const ggml_sched_cpu_worker &) = delete;
    ggml_sched_cpu_worker & operator=(const ggml_sched_cpu_worker &) = delete;

    // true while a posted job has not been joined
    bool pending() const { return posted; }

    // compute `graph` on `backend` once each of `events` (which may hold NULLs) has completed; at most one job is
    // posted at a time, the graph and the events must outlive its join
    void post(ggml_backend_t backend, ggml_cgraph * graph, ggml_backend_event_t * events, int n_events) {
        GGML_ASSERT(!posted && n_events <= MAX_WAITS);
        job_backend = backend;
        job_graph   = graph;
        job_n_waits = n_events;
        job_ordinal = ++n_jobs;
        for (int i = 0; i < n_events; i++) {
            job_waits[i] = events[i];
        }
        posted = true;
        {
            std::lock_guard<std::mutex> lock(mutex);
            state.store(STATE_POSTED, std::memory_order_release);
        }
        wake.notify_one();
    }

    // wait for the posted job, if any; its status (GGML_STATUS_SUCCESS when none was posted)
    enum ggml_status join() {
        if (!posted) {
            return GGML_STATUS_SUCCESS;
        }
        if (state.load(std::memory_order_acquire) != STATE_DONE) {
            n_joins_waited++;
        }
        if (!spin_until(STATE_DONE)) {
            std::unique_lock<std::mutex> lock(mutex);
            done.wait(lock, [this] { return state.load(std::memory_order_acquire) == STATE_DONE; });
        }
        posted = false;
        state.store(STATE_IDLE, std::memory_order_relaxed);
        return job_status;
    }

    // jobs posted, and joins that found their job still running (the caller waited)
    uint64_t n_jobs         = 0;
    uint64_t n_joins_waited = 0;

private:
    enum { STATE_IDLE = 0, STATE_POSTED = 1, STATE_DONE = 2 };
    static constexpr auto SPIN = std::chrono::microseconds(200);

    bool spin_until(int wanted) const {
        const auto until = std::chrono::steady_clock::now() + SPIN;
        do {
            for (int i = 0; i < 64; i++) {
                if (state.load(std::memory_order_acquire) == wanted) {
                    return true;
                }
            }
        } while (std::chrono::steady_clock::now() < until);
        return false;
    }

    void run() {
        for (;;) {
            if (!spin_until(STATE_POSTED)) {
                std::unique_lock<std::mutex> lock(mutex);
                wake.wait(lock, [this] { return stopping || state.load(std::memory_order_acquire) == STATE_POSTED; });
                if (stopping) {
                    return;
                }
            }
            job_status = compute();
            {
                std::lock_guard<std::mutex> lock(mutex);
                state.store(STATE_DONE, std::memory_order_release);
            }
            done.notify_one();
        }
    }

    enum ggml_status compute() {
        for (int i = 0; i < job_n_waits; i++) {
            if (job_waits[i] != NULL) {
                ggml_backend_event_synchronize(job_waits[i]);
            }
        }
        if (debug_delay_us > 0) {
            std::this_thread::sleep_for(std::chrono::microseconds(debug_delay_us));
        }
        if (debug_fail_nth != 0 && job_ordinal == debug_fail_nth) {
            return GGML_STATUS_FAILED;
        }
        return ggml_backend_graph_compute_async(job_backend, job_graph);
    }

    // the job; written by the poster before the release that posts it, read by the worker after the acquire
    ggml_backend_t       job_backend = NULL;
    ggml_cgraph        * job_graph   = NULL;
    ggml_backend_event_t job_waits[MAX_WAITS] = {};
    int                  job_n_waits = 0;
    uint64_t             job_ordinal = 0; // 1-based
    enum ggml_status     job_status  = GGML_STATUS_SUCCESS;

    bool posted   = false; // the poster's own view: a job was posted and not joined
    bool stopping = false; // guarded by mutex

    std::atomic<int>        state{STATE_IDLE};
    std::mutex              mutex;
    std::condition_variable wake;
    std::condition_variable done;
    std::thread             thread; // last: starts once every member above is constructed
};
