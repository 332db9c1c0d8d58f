#!/usr/bin/env bash
# Expert cache profiles against seeding, and the bytes over PCIe per token, on the GPU machine. Steps (run.sh steps
# profile, profile-sweep; results in $OUT):
#   all       both CUDA builds (detached, as prefetch.sh build) and the skew 0.5 model, then identity, profile, sweep
#   identity  cache.sh identity: the cache's CUDA cells (the lookup now counts each expert's uses) and memcheck
#   profile   a profile written by one process (prompt 2048, then 400 decode tokens: other tokens than the measurement's,
#             whose driver draws the same unseeded random tokens in every process), then first-tokens in fresh
#             processes: the first 16 decode tokens after a 4096-token prompt, seeding alone, the profile alone (seed
#             off), both; each setting its own copy of the profile (a freed cache adds its counts to the file)
#   sweep     the patched llama-bench over cache budgets (-mcm), tg64: hit rate per layer and bytes over PCIe per token
#             (plot --hit-rates reads llama-bench's own JSON)
# Carry .work/archives and .whl; repeat `FOLLOW_S=560 bash ci/gpu/profile.sh follow` until "pipeline finished".
set -uo pipefail
step=${1:?usage: profile.sh all|follow|identity|profile|sweep}
. "$(dirname "$0")/common.sh"
here=$(dirname "$0")
H=${HALF_MIB:-7800}
FIRST_S=${FIRST_S:-300}
case $step in
follow)
    follow_pipeline "$0" /tmp/plm-profile 50
    ;;
all)
    mkdir -p "$PYLLAMA_MOE_HOME"
    skew_model > /dev/null 2> "$OUT/skew-model.log" &
    skew_pid=$!
    start_builds
    wait $skew_pid || { echo "the skew 0.5 model was not written"; cat "$OUT/skew-model.log"; exit 1; }
    for s in ${STEPS:-identity profile sweep}; do
        echo "== $s ($((SECONDS - T0)) s)"
        bash "$0" "$s"
    done
    ;;
identity)
    bash "$here/cache.sh" identity
    ;;
profile)
    wait_builds 900 || exit 1
    M=$(skew_model) || exit 1
    first_tokens profile-write --rounds 1 --reps 1 --prompt 2048 --first 128 --warm 144 \
        --setting write=LLAMA_MOE_CACHE_MIB=$H,LLAMA_MOE_CACHE_PROFILE=$OUT/profile.gguf \
        -- -ngl 99 -ncmoe 48 -ub 512 -b 4096 -lm none
    python3 -m pyllama_moe profile show "$OUT/profile.gguf" --top 8 | tee "$OUT/profile-show.txt" | head -20
    python3 -m pyllama_moe plot --profile "$OUT/profile.gguf" -o "$OUT/profile-heat.png"
    cp "$OUT/profile.gguf" /tmp/profile-a.gguf
    cp "$OUT/profile.gguf" /tmp/profile-b.gguf
    first_tokens profile-first --rounds ${ROUNDS:-2} --reps 2 --prompt 4096 --first 16 --warm 96 \
        --setting seed=LLAMA_MOE_CACHE_MIB=$H,LLAMA_MOE_CACHE_SEED=1 \
        --setting profile=LLAMA_MOE_CACHE_MIB=$H,LLAMA_MOE_CACHE_SEED=0,LLAMA_MOE_CACHE_PROFILE=/tmp/profile-a.gguf \
        --setting profile-seed=LLAMA_MOE_CACHE_MIB=$H,LLAMA_MOE_CACHE_SEED=1,LLAMA_MOE_CACHE_PROFILE=/tmp/profile-b.gguf \
        -- -ngl 99 -ncmoe 48 -ub 512 -b 4096 -lm none
    grep -h "expert cache profile" "$OUT"/profile-first-logs/*.log | sort | uniq -c | head -8
    ;;
sweep)
    wait_builds 900 || exit 1
    M=$(skew_model) || exit 1
    P=$(patched_bin)
    timeout 240 "$P/llama-bench" -m "$M" -p 0 -n 64 -r 3 -ngl 99 -ncmoe 48 -lm none -t 15 -mcm 1950,3900,7800,11700 \
        -o json > "$OUT/sweep-mcm.json" 2> "$OUT/sweep-mcm.log"
    echo "llama-bench -mcm sweep: exit $?"
    python3 -m pyllama_moe plot --hit-rates "$OUT/sweep-mcm.json" -o "$OUT/sweep-mcm-hits.png" \
        --title "tg64, 30B-A3B shape skew 0.5, -ncmoe 48 -lm none: cache budget (MiB per GPU)"
    python3 -c "
import json
for r in json.load(open('$OUT/sweep-mcm.json')):
    up = r.get('samples_moe_cache_upload_bytes') or []
    print(r['moe_cache_mib'], 'MiB:', round(r['avg_ts'], 1), 't/s, hit', r.get('samples_moe_cache_hit_rate'),
          'MiB/token', [round(u / r['n_gen'] / 2**20, 2) for u in up])"
    ;;
*)
    echo "unknown step $step: use all|follow|identity|profile|sweep"; exit 2
    ;;
esac
