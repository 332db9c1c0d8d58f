// MMVQ's mul_mat_id batch limits as the patched series compiles them (ggml-cuda/mmvq-mmid.h, which needs no CUDA)
// against upstream's own text of the rule (tests/test_mmvq_mmid.py extracts it from the pinned mmvq.cu into
// upstream_mmid.inc, renamed), for every type and for a compute capability of every architecture the rule names.
// Prints "cc type patched upstream" per pair, then "named <type> <cc> <limit>" for the cases the test spells out.
#include "mmvq-mmid.h"

#include "upstream_mmid.inc"

#include <cstdio>

int main() {
    const int ccs[] = {
        500, 520, GGML_CUDA_CC_PASCAL, GGML_CUDA_CC_DP4A, GGML_CUDA_CC_VOLTA, 720, GGML_CUDA_CC_TURING,
        GGML_CUDA_CC_AMPERE, 860, GGML_CUDA_CC_ORIN, GGML_CUDA_CC_ADA_LOVELACE, GGML_CUDA_CC_HOPPER, 1000, 1100,
        GGML_CUDA_CC_BLACKWELL, GGML_CUDA_CC_DGX_SPARK, GGML_CUDA_CC_RUBIN,
        GGML_CUDA_CC_GCN4, GGML_CUDA_CC_VEGA, GGML_CUDA_CC_VEGA20, GGML_CUDA_CC_GFX909, GGML_CUDA_CC_GFX90C,
        GGML_CUDA_CC_CDNA1, GGML_CUDA_CC_CDNA2, GGML_CUDA_CC_CDNA3, GGML_CUDA_CC_CDNA4, GGML_CUDA_CC_RDNA1,
        GGML_CUDA_CC_RDNA2, GGML_CUDA_CC_RDNA3, GGML_CUDA_CC_RDNA3_5, GGML_CUDA_CC_RDNA4,
        GGML_CUDA_CC_QY1, GGML_CUDA_CC_QY2, GGML_CUDA_CC_PH1,
    };
    for (int cc : ccs) {
        for (int t = 0; t < GGML_TYPE_COUNT; t++) {
            printf("%d %d %d %d\n", cc, t, get_mmvq_mmid_max_batch((ggml_type) t, cc),
                    upstream_get_mmvq_mmid_max_batch((ggml_type) t, cc));
        }
    }
    printf("named q4_0 %d %d\n", GGML_CUDA_CC_HOPPER, get_mmvq_mmid_max_batch(GGML_TYPE_Q4_0, GGML_CUDA_CC_HOPPER));
    printf("named q3_K %d %d\n", GGML_CUDA_CC_TURING, get_mmvq_mmid_max_batch(GGML_TYPE_Q3_K, GGML_CUDA_CC_TURING));
    printf("named iq3_s %d %d\n", GGML_CUDA_CC_AMPERE, get_mmvq_mmid_max_batch(GGML_TYPE_IQ3_S, GGML_CUDA_CC_AMPERE));
    printf("named q4_0 %d %d\n", GGML_CUDA_CC_PASCAL, get_mmvq_mmid_max_batch(GGML_TYPE_Q4_0, GGML_CUDA_CC_PASCAL));
    printf("named q8_0 %d %d\n", GGML_CUDA_CC_DP4A, get_mmvq_mmid_max_batch(GGML_TYPE_Q8_0, GGML_CUDA_CC_DP4A));
    return 0;
}
