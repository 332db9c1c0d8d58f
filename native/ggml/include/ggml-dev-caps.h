// ggml-dev-caps.h: two capabilities a device reports through its registry, for graphs whose correctness depends on
// them (pyllama_moe: the MoE expert cache's device lookup and fills).
//
// A registry offers, through ggml_backend_reg_get_proc_address, a ggml_backend_dev_cap_t per capability; a registry
// without the proc reports the capability absent on all its devices (RPC, Metal, Vulkan today):
//
//   "ggml_backend_dev_keeps_node_order"     the device computes a graph's nodes in graph order, so that nodes that
//                             share memory without a data dependency (a state a node updates and another reads) run
//                             in the order built (CUDA: unless GGML_CUDA_GRAPH_OPT=1, which runs independent nodes
//                             on several streams; SIM: always).
//   "ggml_backend_dev_reads_host_in_place"  the device's kernels can read page-locked host memory where it is, so the
//                             scheduler leaves a source flagged GGML_TENSOR_FLAG_READ_IN_PLACE in host memory rather
//                             than copying it (CUDA and SIM: mapped host memory, ggml_backend_host_device_ptr).
//                             Which bytes are readable so is the supports_op of the op that reads them to say.
#pragma once

#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GGML_BACKEND_DEV_KEEPS_NODE_ORDER_PROC     "ggml_backend_dev_keeps_node_order"
#define GGML_BACKEND_DEV_READS_HOST_IN_PLACE_PROC  "ggml_backend_dev_reads_host_in_place"

typedef bool (*ggml_backend_dev_cap_t)(ggml_backend_dev_t dev);

// whether dev reports the capability of proc_name (one of the names above)
static inline bool ggml_backend_dev_has_cap(ggml_backend_dev_t dev, const char * proc_name) {
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : NULL;
    ggml_backend_dev_cap_t cap = reg ? (ggml_backend_dev_cap_t) ggml_backend_reg_get_proc_address(reg, proc_name) : NULL;
    return cap != NULL && cap(dev);
}

#ifdef __cplusplus
}
#endif
