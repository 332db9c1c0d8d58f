#!/usr/bin/env bash
# issue 13's whole-cache row in the other load mode (-lm mmap; cache.sh tg-whole measured -lm none) on what is left
# of a device session: the patched CUDA build with the bench's targets only (-j 16), the skew 0.5 model written
# meanwhile, then cache.sh tg-whole's comparison (the cache off as the baseline, every expert cached as the
# candidate, -ncmoe 0 as the limit row) for as many rounds as DEADLINE_S (seconds after the start) leaves room for.
# Carry .work/archives and .whl.
set -uo pipefail
. "$(dirname "$0")/common.sh"
mkdir -p "$PYLLAMA_MOE_HOME"
skew_model > "$OUT/skew-model.txt" 2>&1 &
python3 -m pyllama_moe build --backend cuda --variant patched --archive $A/llama.cpp-patched.tar.gz -j 16 \
    --targets llama-bench,llama-moe-copy-probe > "$OUT/build-patched.log" 2>&1 || { tail -20 "$OUT/build-patched.log"; exit 1; }
tail -1 "$OUT/build-patched.log"
wait
M=$(skew_model) || exit 1
left=$(( ${DEADLINE_S:-400} - SECONDS + T0 ))
echo "build and model: $((SECONDS - T0)) s, $left s left"
BENCH_MODEL=$M bench $((left - 5)) --baseline patched --candidate patched --pin-threads --warmup-rounds 0 --reps 3 --discard 1 \
    --rounds 4 --max-seconds $((left - 45)) --limit-row n_cpu_moe=0 --candidate-env LLAMA_MOE_CACHE_MIB=${ALL_MIB:-17000} \
    --json "$OUT/cache-tg128-whole-mmap.json" -- -p 0 -n 128 -ngl 99 -ncmoe 48,0 -lm mmap 2>&1 | tee "$OUT/cache-tg128-whole-mmap.txt"
