#!/usr/bin/env bash
# Layer-major prompts (docs/layer-major.md) on the GPU machine. Prepare on the CPU machine as prefetch.sh says; after
# `run.sh build-skew` (or build-patched) run.sh names them layer-major-STEP. The model is the 30B-A3B shape (Q4_0,
# routing skew 0.5), -b equal to the prompt; each bench interleaves the patched build in ubatch order
# (LLAMA_LAYER_MAJOR_PROMPT=0) with itself layer-major (=1), and each row's share of the all-on-the-GPU row
# (-ncmoe 0) of the same build and ubatch:
#   pp32k     pp32768 at ub 512 and 2048, every expert on the host (-ncmoe 48), pinned (-lm none)
#   pp4k      pp4096 at ub 512 and 2048, the same placements
#   pageable  pp32768 at ub 2048 with pageable experts (LLAMA_MOE_PIN_EXPERTS=0, -lm mmap)
#   pageable-512  the same at ub 512 (llama.cpp's default; ubatch order re-sends every expert 64 times)
#   staged    pp4096 and pp32768 at ub 512, groups staged ahead (LLAMA_LAYER_MAJOR_GROUPS=$STAGED_GROUPS, 8) against
#             one group (LLAMA_LAYER_MAJOR_GROUPS=1)
#   cache     pp32768 at ub 2048, pageable, with a quarter of the expert bytes cached (-mcm 3900): both orders
#   queueing  whether a graph's input uploads wait behind a stage queued before them: the copy probe times a 32 MiB
#             pinned upload on a second queue alone and behind a 1944 MiB one (a group's stage at 8 groups)
#   short     pp512 and tg128 (one ubatch, decode): unchanged
#   times     where each group's time goes (LLAMA_LAYER_MAJOR_DEBUG_TIMES=1): one patched llama-bench run per
#             "PROMPT UBATCH GROUPS [VAR=VALUE...]" of TIMES_RUNS (comma-separated), experts on the host, pinned; the
#             rate and the group lines of the timed repetition (each group's times, its graphs' host steps) in
#             times.md
# ROUNDS (2) sets the rounds of each bench (the time limits grow with it); LM_GROUPS=N runs the layer-major side with
# LLAMA_LAYER_MAJOR_GROUPS=N (unset: the build's default grouping).
set -uo pipefail
step=${1:?usage: layer-major.sh pp32k|pp4k|pageable|pageable-512|staged|cache|queueing|short|times}
. "$(dirname "$0")/common.sh"
ROUNDS=${ROUNDS:-2}

order_bench() { # $1: seconds, $2: a name, then more pyllama-moe bench arguments up to --, then llama-bench's
    local limit=$1 name=$2; shift 2
    local groups=()
    [ -n "${LM_GROUPS:-}" ] && groups=(--candidate-env "LLAMA_LAYER_MAJOR_GROUPS=$LM_GROUPS")
    BENCH_MODEL=$M bench "$limit" --baseline patched --candidate patched \
        --baseline-env LLAMA_LAYER_MAJOR_PROMPT=0 --candidate-env LLAMA_LAYER_MAJOR_PROMPT=1 "${groups[@]}" \
        --limit-row n_cpu_moe=0 --pin-threads --rounds "$ROUNDS" --warmup-rounds 0 --max-seconds $((limit - 30)) \
        --json "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.txt"
}

wait_builds 600 || exit 1
M=$(skew_model) || exit 1
case $step in
pp32k)
    order_bench $((80 + 140 * ROUNDS)) layer-major-pp32k --reps 1 --discard 0 \
        -- -p 32768 -n 0 -b 32768 -ub 512,2048 -ngl 99 -ncmoe 0,48 -lm none
    ;;
pp4k)
    order_bench $((140 + 50 * ROUNDS)) layer-major-pp4k --reps 3 --discard 1 \
        -- -p 4096 -n 0 -b 4096 -ub 512,2048 -ngl 99 -ncmoe 0,48 -lm none
    ;;
pageable)
    order_bench $((50 + 130 * ROUNDS)) layer-major-pageable --reps 1 --discard 0 \
        --baseline-env LLAMA_MOE_PIN_EXPERTS=0 --candidate-env LLAMA_MOE_PIN_EXPERTS=0 \
        -- -p 32768 -n 0 -b 32768 -ub 2048 -ngl 99 -ncmoe 0,48 -lm mmap
    ;;
pageable-512)
    # no llama-bench warmup: in ubatch order it is a second 115 s prompt per process. A first run's one-time costs
    # add the same seconds to both sides, which can only lower layer-major's ratio to ubatch order (the target)
    order_bench $((40 + 180 * ROUNDS)) layer-major-pageable-512 --reps 1 --discard 0 \
        --baseline-env LLAMA_MOE_PIN_EXPERTS=0 --candidate-env LLAMA_MOE_PIN_EXPERTS=0 \
        -- -p 32768 -n 0 -b 32768 -ub 512 -ngl 99 -ncmoe 0,48 -lm mmap --no-warmup
    ;;
staged)
    # both sides layer-major: one group where the weights fit (baseline) against groups staged ahead (candidate)
    BENCH_MODEL=$M bench 560 --baseline patched --candidate patched --baseline-env LLAMA_LAYER_MAJOR_GROUPS=1 \
        --candidate-env "LLAMA_LAYER_MAJOR_GROUPS=${STAGED_GROUPS:-8}" \
        --limit-row n_cpu_moe=0 --pin-threads --rounds "$ROUNDS" --warmup-rounds 0 --max-seconds 530 \
        --json "$OUT/layer-major-staged-g${STAGED_GROUPS:-8}.json" --reps 1 --discard 0 \
        -- -p 4096,32768 -n 0 -b 32768 -ub 512 -ngl 99 -ncmoe 0,48 -lm none 2>&1 | tee "$OUT/layer-major-staged-g${STAGED_GROUPS:-8}.txt"
    ;;
cache)
    order_bench 540 layer-major-cache --reps 1 --discard 0 \
        --baseline-env LLAMA_MOE_PIN_EXPERTS=0 --candidate-env LLAMA_MOE_PIN_EXPERTS=0 \
        -- -p 32768 -n 0 -b 32768 -ub 2048 -ngl 99 -ncmoe 0,48 -mcm 3900 -lm mmap
    ;;
times)
    bin=$(patched_bin) || exit 1
    IFS=, read -ra runs <<< "${TIMES_RUNS:-32768 512 8,4096 2048 8,4096 512 8,32768 512 8 GGML_SCHED_DEBUG_SKIP_WAIT=1,4096 2048 16,32768 512 2}"
    for run in "${runs[@]}"; do
        read -r p ub g extra <<< "$run"
        log="$OUT/times-pp$p-ub$ub-g$g${extra:+-${extra//[^A-Za-z0-9]/_}}.log"
        env $extra LLAMA_LAYER_MAJOR_GROUPS=$g LLAMA_LAYER_MAJOR_DEBUG_TIMES=1 timeout 120 "$bin/llama-bench" -m "$M" \
            -p "$p" -n 0 -b "$p" -ub "$ub" -ngl 99 -ncmoe 48 -lm none -t 15 -r 1 -v > "$log" 2>&1
        { echo "### pp$p ub $ub, LLAMA_LAYER_MAJOR_GROUPS=$g $extra (exit $?)"; echo
          grep "^| qwen3moe" "$log" | sed 's/^/    /'
          # the timed repetition's lines: the last call's, after the warmup's
          n=$(grep -c "layer-major times: group 0 " "$log")
          awk -v n="$n" '/layer-major times: group 0 /{k++} k==n && /layer-major times|layer-major graph times|layer-major call times|layer-major prompt:/' "$log" | sed 's/^/    /'
          echo; } | tee -a "$OUT/times.md"
    done
    ;;
queueing)
    bin=$(patched_bin) || exit 1
    "$bin/llama-moe-copy-probe" --mib 1944 --small 32 --reps 5 --device CUDA0 | tee "$OUT/queueing.json"
    ;;
short)
    order_bench $((100 + 50 * ROUNDS)) layer-major-short --reps 3 --discard 1 -- -p 512 -n 128 -ngl 99 -ncmoe 48 -lm none
    ;;
*)
    echo "layer-major.sh: unknown step $step"; exit 2 ;;
esac
