// ggml-dev-caps.h: capabilities a device reports through its registry, for graphs whose correctness depends on
// them (pyllama_moe: the MoE expert cache's device lookup and fills, and the hot/cold split's masked expert ids).
//
// A registry offers them through ggml_backend_reg_get_proc_address; a registry without a proc reports that
// capability absent on all its devices (RPC, Metal, Vulkan today):
//
//   "ggml_backend_dev_keeps_node_order" (ggml_backend_dev_keeps_node_order_t): the device computes a graph's nodes in
//                             graph order, so that nodes that share memory without a data dependency (a state a node
//                             updates and another reads) run in the order built (CUDA: unless GGML_CUDA_GRAPH_OPT=1,
//                             which runs independent nodes on several streams; SIM: always).
//   "ggml_backend_dev_reads_host_in_place" (ggml_backend_dev_reads_host_in_place_t): whether the device's kernels read
//                             [ptr, ptr + size) of host memory (in buffer buf, or NULL where unknown) where it is;
//                             ptr NULL asks whether they ever can. The scheduler leaves a source flagged
//                             GGML_TENSOR_FLAG_READ_IN_PLACE in host memory for a device that reads its bytes so, and
//                             copies it otherwise (CUDA and SIM: page-locked, mapped host memory, as
//                             ggml_backend_host_device_ptr says; it is asked for every graph, so it must be cheap).
//   "ggml_backend_dev_masked_ids" (ggml_backend_dev_masked_ids_t): the device computes MUL_MAT_ID and ADD_ID nodes
//                             whose ids may be -1 ("no expert", ggml_mul_mat_id_masked): a zero row, nothing added.
//                             ggml_backend_dev_supports_op refuses such a node to a device that does not report it,
//                             so no backend indexes with -1 (CPU, CUDA and SIM: yes; not claimed for ROCm and MUSA).
#pragma once

#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GGML_BACKEND_DEV_KEEPS_NODE_ORDER_PROC     "ggml_backend_dev_keeps_node_order"
#define GGML_BACKEND_DEV_READS_HOST_IN_PLACE_PROC  "ggml_backend_dev_reads_host_in_place"
#define GGML_BACKEND_DEV_MASKED_IDS_PROC           "ggml_backend_dev_masked_ids"

typedef bool (*ggml_backend_dev_keeps_node_order_t)(ggml_backend_dev_t dev);
typedef bool (*ggml_backend_dev_reads_host_in_place_t)(ggml_backend_dev_t dev, ggml_backend_buffer_t buf, const void * ptr,
        size_t size);
typedef bool (*ggml_backend_dev_masked_ids_t)(ggml_backend_dev_t dev);

static inline void * ggml_backend_dev_cap_proc(ggml_backend_dev_t dev, const char * proc_name) {
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : NULL;
    return reg ? ggml_backend_reg_get_proc_address(reg, proc_name) : NULL;
}

static inline bool ggml_backend_dev_keeps_node_order(ggml_backend_dev_t dev) {
    ggml_backend_dev_keeps_node_order_t f =
        (ggml_backend_dev_keeps_node_order_t) ggml_backend_dev_cap_proc(dev, GGML_BACKEND_DEV_KEEPS_NODE_ORDER_PROC);
    return f != NULL && f(dev);
}

static inline bool ggml_backend_dev_reads_host_in_place(ggml_backend_dev_t dev, ggml_backend_buffer_t buf, const void * ptr,
        size_t size) {
    ggml_backend_dev_reads_host_in_place_t f =
        (ggml_backend_dev_reads_host_in_place_t) ggml_backend_dev_cap_proc(dev, GGML_BACKEND_DEV_READS_HOST_IN_PLACE_PROC);
    return f != NULL && f(dev, buf, ptr, size);
}

static inline bool ggml_backend_dev_masked_ids(ggml_backend_dev_t dev) {
    ggml_backend_dev_masked_ids_t f = (ggml_backend_dev_masked_ids_t) ggml_backend_dev_cap_proc(dev, GGML_BACKEND_DEV_MASKED_IDS_PROC);
    return f != NULL && f(dev);
}

#ifdef __cplusplus
}
#endif
