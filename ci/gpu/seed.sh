#!/usr/bin/env bash
# Issue 14 item 1 on the GPU machine: the expert cache seeded at a prompt's end. Steps (after the builds of
# prefetch.sh build, as open-issues.sh runs them; results in $OUT):
#   check   the cache's CUDA identity cells (every cell but moe-cache-seed-off seeds: its prompt's last ubatch uploads
#           ahead), then the seed debug check (LLAMA_MOE_CACHE_DEBUG_CHECK_SEED=1: every seeded slot against its host
#           expert) on the tiny model with a 2 MiB cache and on the 30B-shaped skew 0.5 model with half the experts
#   first   first-tokens: the first 16 tokens decoded after a 4096-token prompt against 16 steady ones (after 96 more),
#           seeding on and off, a fresh cache before each prompt, cache half (7800 MiB), -ncmoe 48, -lm none
set -uo pipefail
step=${1:?usage: seed.sh check|first}
. "$(dirname "$0")/common.sh"
case $step in
check)
    wait_builds 300 || exit 1
    timeout 300 python3 -m pyllama_moe compare --subset moe-cache --backend cuda --archive-dir $A --json "$OUT/identity-seed.json" \
        2>&1 | tee "$OUT/identity-seed.txt"
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
    ;;
first)
    wait_builds 60 || exit 1
    M=$(skew_model) || exit 1
    timeout ${FIRST_S:-400} python3 -m pyllama_moe first-tokens --model "$M" --variant patched --backend cuda \
        --archive $A/llama.cpp-patched.tar.gz --no-build --pin-threads --rounds ${ROUNDS:-3} --reps 3 --prompt 4096 --first 16 \
        --warm 96 --setting seed-on=LLAMA_MOE_CACHE_MIB=${HALF_MIB:-7800},LLAMA_MOE_CACHE_SEED=1 \
        --setting seed-off=LLAMA_MOE_CACHE_MIB=${HALF_MIB:-7800},LLAMA_MOE_CACHE_SEED=0 --json "$OUT/first-tokens.json" \
        --log-dir "$OUT/first-tokens-logs" -- -ngl 99 -ncmoe 48 -ub 512 -b 4096 -lm none 2>&1 | tee "$OUT/first-tokens.txt"
    ;;
*)
    echo "unknown step $step: use check|first"; exit 2
    ;;
esac
