#!/usr/bin/env bash
# The expert cache seeded at a prompt's end, on the GPU machine. Steps (after prefetch.sh build, or with first and
# first-times after run.sh build-patched; ci/gpu/run.sh names them seed-STEP; results in $OUT):
#   check   the cache's CUDA identity cells (every cell but moe-cache-seed-off seeds: its prompt's last ubatch uploads
#           ahead), then the seed debug check (LLAMA_MOE_CACHE_DEBUG_CHECK_SEED=1: every seeded slot against its host
#           expert) on the tiny model with a 2 MiB cache and on the 30B-shaped skew 0.5 model with half the experts
#   first   first-tokens: the first 16 tokens decoded after a 4096-token prompt against 16 steady ones (after 96 more),
#           seeding on and off, a fresh cache before each prompt, cache half (7800 MiB), -ncmoe 48, -lm none
#   first-times  where the first tokens' time goes: first-tokens with each token's time (the first decode graph
#           after a prompt runs without a CUDA graph, the second captures one) and LLAMA_MOE_DEBUG_DECODE_TIMES's
#           steps of the first three, seeding on and off, and the same prompt with every weight on the GPU (-ncmoe 0)
#           as what llama.cpp's first tokens cost without host experts
set -uo pipefail
step=${1:?usage: seed.sh check|first|first-times}
. "$(dirname "$0")/common.sh"
case $step in
check)
    wait_builds 300 || exit 1
    # the step fails where a cell failed, after the seed checks ran
    identity_subset 300 moe-cache identity-seed
    P=$(patched_bin)
    tiny_prompt
    LLAMA_MOE_CACHE_MIB=2 LLAMA_MOE_CACHE_DEBUG_CHECK_SEED=1 timeout 120 "$P/llama-completion" -m "$SMALL" -ngl 99 -cmoe \
        -ub 128 -f /tmp/prompt.txt -n 16 --temp 0 --fit off -no-cnv -v > "$OUT/seed-check-tiny.txt" 2>&1
    echo "seed check, tiny model, 2 MiB, ub 128: exit $?"
    grep -E "seed check|expert cache, prompts" "$OUT/seed-check-tiny.txt" | head -6
    M=$(skew_model) || exit 1
    # the same text (about a thousand tokens: two ubatches of 512 upload ahead, the second seeds)
    LLAMA_MOE_CACHE_MIB=${HALF_MIB:-7800} LLAMA_MOE_CACHE_DEBUG_CHECK_SEED=1 timeout 240 "$P/llama-completion" -m "$M" -ngl 99 \
        -ncmoe 48 -ub 512 -b 4096 -c 4200 -lm none -f /tmp/prompt.txt -n 16 --temp 0 --fit off -no-cnv -v > "$OUT/seed-check-30b.txt" 2>&1
    echo "seed check, 30B shape skew 0.5, 7800 MiB, ub 512: exit $?"
    grep -E "seed check|expert cache, prompts|expert cache, decode" "$OUT/seed-check-30b.txt" | head -6
    identity_verdict || exit 1
    ;;
first)
    wait_builds 60 || exit 1
    M=$(skew_model) || exit 1
    first_tokens first-tokens --rounds ${ROUNDS:-3} --reps 3 --prompt 4096 --first 16 --warm 96 \
        --setting seed-on=LLAMA_MOE_CACHE_MIB=${HALF_MIB:-7800},LLAMA_MOE_CACHE_SEED=1 \
        --setting seed-off=LLAMA_MOE_CACHE_MIB=${HALF_MIB:-7800},LLAMA_MOE_CACHE_SEED=0 \
        -- -ngl 99 -ncmoe 48 -ub 512 -b 4096 -lm none
    ;;
first-times)
    wait_builds 60 || exit 1
    M=$(skew_model) || exit 1
    H=${HALF_MIB:-7800}
    # LLAMA_MOE_DEBUG_DECODE_TIMES=3: the host time of each step of the first three decode steps after each prompt, in
    # the processes' logs (summarized below)
    D=LLAMA_MOE_DEBUG_DECODE_TIMES=3
    first_tokens first-times --rounds ${ROUNDS:-1} --reps 2 --prompt 4096 --first 16 --warm 96 \
        --setting seed-on=LLAMA_MOE_CACHE_MIB=$H,LLAMA_MOE_CACHE_SEED=1,$D \
        --setting seed-off=LLAMA_MOE_CACHE_MIB=$H,LLAMA_MOE_CACHE_SEED=0,$D -- -ngl 99 -ncmoe 48 -ub 512 -b 4096 -lm none
    echo "== all on the GPU ($((SECONDS - T0)) s)"
    first_tokens first-times-allgpu --rounds 1 --reps 2 --prompt 4096 --first 16 --warm 96 --setting all-gpu=$D \
        -- -ngl 99 -ncmoe 0 -ub 512 -b 4096 -lm none
    grep -h "decode step" "$OUT"/first-times-logs/*seed-on*.log | tail -12
    grep -h "decode step" "$OUT"/first-times-allgpu-logs/*.log | tail -12
    ;;
*)
    echo "unknown step $step: use check|first|first-times"; exit 2
    ;;
esac
