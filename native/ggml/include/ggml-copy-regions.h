// ggml-copy-regions.h: a registry proc that queues a batch of byte copies on a backend's stream in few calls
// (pyllama_moe).
//
// The MoE expert cache stages an expert tensor from runs of experts: some copied on the device from its banks, the
// rest uploaded from the host. One call per run costs a few microseconds of launch each, and a layer of a prompt may
// have dozens of runs. A backend registry that can do better offers, through ggml_backend_reg_get_proc_address:
//
//   "ggml_backend_copy_regions_async" (ggml_backend_copy_regions_async_t): queue the copies on `backend`'s stream,
//                             after the work queued there before, before the work queued after; the copies of one
//                             call may run in any order among themselves, so no region may overlap another of the
//                             same call. host_src: every source is host memory (a device-to-host-free upload),
//                             else every source and destination is memory of the backend's device. Returns the
//                             calls it queued (CUDA: one cudaMemcpyBatchAsync for uploads where the toolkit has it,
//                             one kernel launch per 64 device regions; SIM: one task).
//
// A caller without the proc copies one region per call. A header of its own for the same reason as
// ggml-host-map.h: the scheduler patches of this series change ggml-backend.h.
#pragma once

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_backend;

#define GGML_BACKEND_COPY_REGIONS_PROC "ggml_backend_copy_regions_async"

struct ggml_backend_copy_region {
    const void * src;
    void *       dst;
    size_t       size;
};

typedef int (*ggml_backend_copy_regions_async_t)(struct ggml_backend * backend, const struct ggml_backend_copy_region * regions,
                                                 int n_regions, bool host_src);

#ifdef __cplusplus
}
#endif
