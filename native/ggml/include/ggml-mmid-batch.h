// ggml-mmid-batch.h: a registry proc that says up to which batch a device's mul_mat_id computes each expert's rows
// the same however many experts the weight holds (pyllama_moe).
//
// The MoE expert cache computes a cached layer from banks of n_slots experts where the model's weight holds n_expert.
// Its bytes equal those of the weight on the device only while the device's kernel for that mul_mat_id does not
// depend on the expert count: on CUDA that is MMVQ, used up to a batch that depends on the type and the compute
// capability (ggml-cuda/mmvq-mmid.h); above it MMQ's stream-k split depends on it. A registry that knows offers,
// through ggml_backend_reg_get_proc_address:
//
//   "ggml_backend_dev_mul_mat_id_vec_max_batch" (ggml_backend_dev_mul_mat_id_vec_max_batch_t): for a weight of `type`
//                             on `dev`, the most tokens (src1->ne[2]) whose mul_mat_id takes such a kernel, at least 1
//                             (CUDA: MMVQ's limit for quantized types; the rest go through MMF or per-expert GEMMs,
//                             which compute each expert apart, and get MMVQ's maximum, 8. SIM: the rule of the
//                             compute capability in GGML_SIM_CC, else 8).
//
// For a device without the proc the cache assumes LLAMA_MOE_CACHE_DECODE_MAX (it banks only CUDA and SIM devices).
#pragma once

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_backend_device;

#define GGML_BACKEND_DEV_MUL_MAT_ID_VEC_MAX_BATCH_PROC "ggml_backend_dev_mul_mat_id_vec_max_batch"

typedef int (*ggml_backend_dev_mul_mat_id_vec_max_batch_t)(struct ggml_backend_device * dev, enum ggml_type type);

#ifdef __cplusplus
}
#endif
