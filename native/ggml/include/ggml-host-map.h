// ggml-host-map.h: registry procs that page-lock an existing host range for a device, and say where kernels read it
// (pyllama_moe).
//
// Copies from pageable host memory to a discrete GPU go through a driver bounce buffer: they are several
// times slower than copies from page-locked memory and do not overlap compute. Weights that llama.cpp
// mmaps from the model file are pageable. A backend registry that can page-lock such a range in place
// (CUDA: cudaHostRegister) offers these procs through ggml_backend_reg_get_proc_address:
//
//   "ggml_backend_host_map"   (ggml_backend_host_map_t)   page-lock [ptr, ptr + size); true on success.
//                             Read-only first (a PROT_READ file mapping cannot be locked for writing),
//                             read-write as a fallback. A range that is already page-locked elsewhere is
//                             counted, not registered again. Fails when a page of the range is not mapped
//                             (CUDA and SIM alike), so a caller must not let a range span two mappings.
//   "ggml_backend_host_unmap" (ggml_backend_host_unmap_t) drop one reference to the range mapped at ptr;
//                             the last one unregisters it. Nothing may still copy from the range.
//   "ggml_backend_host_device_ptr" (ggml_backend_host_device_ptr_t) the address at which kernels on device
//                             (the registry's index) read the page-locked host byte at ptr in place, or NULL
//                             when ptr is pageable or the device cannot read it (CUDA: registered with the
//                             mapped flag, or from cudaMallocHost). Any address inside a range or buffer.
//
// References are counted per base pointer, process-wide, so several users (models, contexts) can map
// the same range and it stays page-locked until the last of them unmaps it. All are thread-safe.
// A header of their own, not ggml-backend.h where upstream keeps its proc typedefs: the scheduler patches
// of this series change ggml-backend.h, and the SIM test double implements the same contract without CUDA.
#pragma once

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GGML_BACKEND_HOST_MAP_PROC        "ggml_backend_host_map"
#define GGML_BACKEND_HOST_UNMAP_PROC      "ggml_backend_host_unmap"
#define GGML_BACKEND_HOST_DEVICE_PTR_PROC "ggml_backend_host_device_ptr"

typedef bool   (*ggml_backend_host_map_t)       (void * ptr, size_t size);
typedef void   (*ggml_backend_host_unmap_t)     (void * ptr);
typedef void * (*ggml_backend_host_device_ptr_t)(int device, const void * ptr);

#ifdef __cplusplus
}
#endif
