// ggml-sim.h: "SIM", a simulated discrete GPU for ggml. THIS IS A TEST DOUBLE, NOT AN ACCELERATOR.
//
// pyllama_moe adds it so that the scheduler and llama.cpp paths that only run with a GPU present (weight
// copies, op offload of MUL_MAT_ID with the routed-only expert copy, events, several backend instances of one
// device) run and are checked on CPU-only machines. A SIM device reports itself as a GPU with its own non-host
// buffer type, but its memory is ordinary host memory and its "kernels" are the CPU backend's, run on one
// worker thread per backend instance (its "stream"), so results are the CPU backend's bytes, computed
// asynchronously. Timing numbers from it mean nothing; they come from CUDA on a real GPU.
//
// It is compiled into libggml of every patched build and registered (ahead of the CPU backend) only when
// GGML_SIM_DEVICES is set to a positive number, so a patched build without that variable has exactly the
// devices of master.
//
// Environment, read once when the registry is first used:
//   GGML_SIM_DEVICES=N             number of devices SIM0..SIM{N-1} (0 or unset: not registered; at most 4)
//   GGML_SIM_MEMORY_MIB=M          memory of each device (default 8192); allocations beyond it fail
//   GGML_SIM_COPY_GBPS=G           bandwidth of stream copies (set/get/cpy_tensor_async), GB/s (0/unset: no limit)
//   GGML_SIM_COPY_LATENCY_US=U     fixed delay before each stream copy
//   GGML_SIM_COMPUTE_LATENCY_US=U  fixed delay before each graph compute on a stream
//   GGML_SIM_POISON=1              fill every newly allocated (non-view) tensor with NaN at init_tensor, in device
//                                  and host (pinned-like) buffers; a racing read (below) returns poison;
//                                  enables ggml_backend_sim_poison*
//   GGML_SIM_OPLOG=PATH            append one JSON line per operation to PATH (flushed per line)
//   GGML_SIM_DEBUG_SKIP_SYNC=1     fault injection: backend synchronize returns without waiting (negative control)
//   GGML_SIM_HOST_MAP_FAIL=1       fault injection: the registry's "ggml_backend_host_map" proc (ggml-host-map.h)
//                                  fails, as cudaHostRegister can, so callers take their fallback
//   GGML_SIM_HOST_MAP_FAIL_NTH=N   fault injection: only the Nth registration of a new range in the process fails
//                                  (1-based), so a caller with several ranges sees one of them refused
//   GGML_SIM_HOST_NO_MAPPED=1      fault injection: "ggml_backend_host_device_ptr" returns NULL, as for a device
//                                  that cannot read page-locked host memory in place
//   GGML_OP_OFFLOAD_MIN_BATCH=B    the batch size from which ops are offloaded (default 32, as for CUDA)
//   GGML_SIM_CC=C                  "ggml_backend_dev_mul_mat_id_vec_max_batch" (ggml-mmid-batch.h) reports CUDA's
//                                  limit for compute capability C (e.g. 610, Pascal), as if SIM were that GPU; unset:
//                                  8 for every type. Only the reported limit changes, not SIM's kernels
//
// Freed backends: ggml_backend_free of a SIM backend keeps its handle as a tombstone, so a call through a handle
// kept past its owner's free (a scheduler's copy queue after the scheduler was replaced) aborts naming the mistake
// instead of reading freed memory.
//
// Host map: the registry offers "ggml_backend_host_map" and "ggml_backend_host_unmap" (ggml-host-map.h) as CUDA's
// does. SIM memory needs no page-locking, so they only count references per base pointer (and fail on request,
// above), and refuse a range of which a page is not mapped, as cudaHostRegister does; each call writes a host_map / host_unmap line to the op log with the range's "ptr", its "refs" after the
// call (a register is refs 0 -> 1, an unregister 1 -> 0) and "ok". "ggml_backend_host_device_ptr" returns ptr itself
// inside a registered range or a live SIM host buffer (what CUDA maps), else NULL.
//
// Race check: a buffer-level access from the calling thread (ggml_backend_tensor_set/get/memset/copy on SIM
// memory) that overlaps memory a queued stream operation still writes (or, for a write, still reads) is a
// missing wait in the caller. Such races are counted (ggml_backend_sim_n_races), logged, and written to the op
// log; the access is done as hardware would do it, except that with GGML_SIM_POISON=1 a racing read returns
// NaN (zeros for integer tensors). Queued kernels that would index memory with out-of-range ids (MUL_MAT_ID,
// GET_ROWS, SET_ROWS, ADD_ID), which only a missing wait can cause, count as races too and read index 0
// instead, so a missing wait gives wrong results and a report, not a crash. Races between two streams are not
// checked (poison and latency make them visible as wrong results).
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GGML_SIM_NAME        "SIM"
#define GGML_SIM_MAX_DEVICES 4

// The registry entry. Always valid; its device count is GGML_SIM_DEVICES (0 when unset).
GGML_API ggml_backend_reg_t ggml_backend_sim_reg(void);

GGML_API bool ggml_backend_is_sim(ggml_backend_t backend);

// true for buffers of a SIM device buffer type and of the SIM host (pinned-like) buffer type
GGML_API bool ggml_backend_buffer_is_sim(ggml_backend_buffer_t buffer);

// Poison points for code that releases staging memory (e.g. a scheduler's prefetch slots): fill bytes
// [offset, offset + size) of a SIM buffer with a NaN pattern (every aligned f32, f16 and bf16 is NaN, an i32 is
// far out of any index range). They do nothing and return false unless GGML_SIM_POISON=1 and the buffer is a SIM
// buffer. ggml_backend_sim_poison writes from the calling thread at once: call it only when no queued work still
// uses the range. ggml_backend_sim_poison_async queues the fill on a SIM backend's stream, ordered after the work
// (and event waits) already queued there.
// Reachable without linking libggml through ggml_backend_reg_get_proc_address(reg, "ggml_backend_sim_poison")
// and "ggml_backend_sim_poison_async" on the SIM registry.
GGML_API bool ggml_backend_sim_poison      (ggml_backend_buffer_t buffer, size_t offset, size_t size);
GGML_API bool ggml_backend_sim_poison_async(ggml_backend_t backend, ggml_backend_buffer_t buffer, size_t offset, size_t size);

// number of races detected in this process so far (see above); "ggml_backend_sim_n_races" through get_proc_address
GGML_API size_t ggml_backend_sim_n_races(void);

// number of operations queued on all SIM streams (of every instance) that have not finished yet: lets a test
// check that a call returned with nothing left running, e.g. a scheduler that drains its copy queue on abort
GGML_API size_t ggml_backend_sim_n_pending(void);

typedef bool   (*ggml_backend_sim_poison_t)      (ggml_backend_buffer_t buffer, size_t offset, size_t size);
typedef bool   (*ggml_backend_sim_poison_async_t)(ggml_backend_t backend, ggml_backend_buffer_t buffer, size_t offset, size_t size);
typedef size_t (*ggml_backend_sim_n_races_t)     (void);

#ifdef __cplusplus
}
#endif
