#!/usr/bin/env bash
# Issue 14's first-16 target, where its time goes: the patched CUDA build alone (-j 16) and the skew 0.5 model
# written meanwhile, then first-tokens with each token's time (the first decode graph after a prompt runs without a
# CUDA graph, the second captures one) and LLAMA_MOE_DEBUG_DECODE_TIMES's steps of the first three, for seeding on
# and off, and the same prompt with every weight on the GPU (-ncmoe 0) as the reference of what llama.cpp's first
# tokens cost without host experts. (The thirteenth session's first run, before the debug knob, had a setting with
# GGML_CUDA_DISABLE_GRAPHS=1 beside them: results/moe-cache-seed.md.) Carry .work/archives and .whl; repeat
#   FOLLOW_S=560 bash ci/gpu/first-diag.sh follow
# until it prints "pipeline finished". Results in $OUT.
set -uo pipefail
step=${1:?usage: first-diag.sh all|follow}
. "$(dirname "$0")/common.sh"
case $step in
follow)
    follow_pipeline "$0" /tmp/plm-first-diag 40
    ;;
all)
    mkdir -p "$PYLLAMA_MOE_HOME"
    skew_model > "$OUT/skew-model.txt" 2>&1 &
    python3 -m pyllama_moe build --backend cuda --variant patched --archive $A/llama.cpp-patched.tar.gz -j 16 \
        > "$OUT/build-patched.log" 2>&1 || { tail -20 "$OUT/build-patched.log"; exit 1; }
    tail -1 "$OUT/build-patched.log"
    wait
    M=$(skew_model) || exit 1
    echo "build and model: $((SECONDS - T0)) s"
    first() { # $1: json name, then first-tokens arguments
        local name=$1; shift
        timeout ${FIRST_S:-400} python3 -m pyllama_moe first-tokens --model "$M" --variant patched --backend cuda \
            --archive $A/llama.cpp-patched.tar.gz --no-build --pin-threads --prompt 4096 --first 16 --warm 96 \
            --json "$OUT/$name.json" --log-dir "$OUT/$name-logs" "$@" 2>&1 | tee "$OUT/$name.txt"
    }
    H=${HALF_MIB:-7800}
    # LLAMA_MOE_DEBUG_DECODE_TIMES=3: the host time of each step of the first three decode steps after each prompt, in
    # the processes' logs (summarized below)
    D=LLAMA_MOE_DEBUG_DECODE_TIMES=3
    first first-diag --rounds ${ROUNDS:-1} --reps 2 --setting seed-on=LLAMA_MOE_CACHE_MIB=$H,LLAMA_MOE_CACHE_SEED=1,$D \
        --setting seed-off=LLAMA_MOE_CACHE_MIB=$H,LLAMA_MOE_CACHE_SEED=0,$D -- -ngl 99 -ncmoe 48 -ub 512 -b 4096 -lm none
    echo "== all on the GPU ($((SECONDS - T0)) s)"
    first first-diag-allgpu --rounds 1 --reps 2 --setting all-gpu=$D -- -ngl 99 -ncmoe 0 -ub 512 -b 4096 -lm none
    grep -h "decode step" "$OUT"/first-diag-logs/*seed-on*.log | tail -12
    grep -h "decode step" "$OUT"/first-diag-allgpu-logs/*.log | tail -12
    ;;
*)
    echo "unknown step $step: use all|follow"; exit 2
    ;;
esac
