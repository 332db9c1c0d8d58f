#!/usr/bin/env bash
# The basic CUDA check on the GPU machine: CUDA builds of master and patched from the pruned
# archives, the identity cells of ci/matrix.toml subset `gpu` and an A/B llama-bench on a Qwen3-30B-A3B-shaped
# model (prefetch.sh identity and bench run the same and more; run.sh step foundation-check).
#
# Prepare on the CPU machine (the GPU machine has no registry and maybe no git):
#   pyllama-moe source pack --variant master  -o .work/archives/llama.cpp-master.tar.gz
#   pyllama-moe source pack --variant patched -o .work/archives/llama.cpp-patched.tar.gz
#   wheels of cffi pycparser gguf diskcache tqdm for cp312 in .whl/ (see ../shared/docs/gpu-workflow.md)
# then run `ci/gpu/foundation.sh build` and `ci/gpu/foundation.sh check` there (carry .work/archives and .whl).
# Results land in $OUT (or ./gpu-out).
set -uo pipefail
step=${1:?usage: foundation.sh build|check}
. "$(dirname "$0")/common.sh"

case $step in
build)
    start_builds
    make_bench_model || exit 1
    ;;
check)
    wait_builds 100000 || exit 1
    python3 -m pyllama_moe compare --subset gpu --archive-dir $A --json "$OUT/identity-gpu.json" 2>&1 | tee "$OUT/identity-gpu.txt"
    python3 -m pyllama_moe bench --model "$MODEL" --backend cuda --archive-dir $A --rounds 2 --reps 5 \
        --json "$OUT/bench.json" -- -p 512 -n 128 -ub 512 -ngl 99 -ncmoe 48,0 -lm none -t 16 2>&1 | tee "$OUT/bench.txt"
    ;;
esac
