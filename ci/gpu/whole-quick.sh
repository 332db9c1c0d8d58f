#!/usr/bin/env bash
# A first look at tg128 with every expert cached, filled whole when the cache is made, on what is left of a device
# session: the patched CUDA build alone (llama-bench only, -j 16), the skew 0.5 model written meanwhile, then one
# llama-bench process per row set (no intervals: cache.sh tg-whole is the measurement). Carry .work/archives and .whl.
set -uo pipefail
. "$(dirname "$0")/common.sh"
mkdir -p "$PYLLAMA_MOE_HOME"
skew_model > "$OUT/skew-model.txt" 2>&1 &
python3 -m pyllama_moe build --backend cuda --variant patched --archive $A/llama.cpp-patched.tar.gz -j 16 \
    --targets llama-bench > "$OUT/build-patched.log" 2>&1 || { tail -20 "$OUT/build-patched.log"; exit 1; }
tail -1 "$OUT/build-patched.log"
wait
M=$(skew_model) || exit 1
P=$(patched_bin llama-bench) || exit 1
echo "build and model: $((SECONDS - T0)) s"
LLAMA_MOE_CACHE_MIB=17000 timeout 60 "$P/llama-bench" -v -m "$M" -p 0 -n 16 -r 1 -ngl 99 -ncmoe 48 -lm none 2>&1 \
    | grep -E "llama_moe: expert cache" | tee "$OUT/fill.txt"
for env in "LLAMA_MOE_CACHE_MIB=17000" "LLAMA_MOE_CACHE_MIB=17000 LLAMA_MOE_CACHE_FILL_WHOLE=0"; do
    echo "== $env ($((SECONDS - T0)) s)"
    env $env timeout 120 "$P/llama-bench" -m "$M" -p 0 -n 128 -r 4 -ngl 99 -ncmoe 48,0 -lm none -t 15 -o md 2>&1 \
        | tee -a "$OUT/tg128.md"
done
