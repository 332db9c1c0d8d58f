#!/usr/bin/env bash
# The expert cache on the GPU machine (prompts staged through it, decode with a host-side plan) on CUDA. Prepare on the CPU machine as
# prefetch.sh says; the steps run after `prefetch.sh build` (ci/gpu/run.sh names them cache-STEP):
#   identity   compare --subset moe-cache --backend cuda: the cache's CUDA cells (the SIM ones and the stale-slot
#              control run in CI), every check byte for byte against master with every weight on the GPU; then
#              --subset moe-cache-parallel: steps of 2 to 12 sequences, each against the master run its cached layers'
#              paths name (docs/cache-paths.md); then compute-sanitizer memcheck over a decode that evicts every token,
#              and a planted refused lookup that must fail its decode call
#   pp         the prompt path, its three parts in turn:
#   pp-master  pp4096 at ub 512 with the cache at a quarter of the expert bytes (3900 MiB) against master, -lm none
#              and mmap
#   pp-off     pp512 and pp4096 at ub 512 and 2048 against the same build with the cache off
#   pp-32k     a 32k-token prompt at ub 2048 with the cache holding every expert (17000 MiB: filled whole when made,
#              read in place) as a share of the all-on-GPU row of the same run (the patched build
#              against itself, the cache off as the baseline: master would take minutes)
#   tg         tg128 with every expert on the host, the Qwen3-30B-A3B shape with routing skew 0.5, the cache at half
#              the expert bytes (LLAMA_MOE_CACHE_MIB, default 7800 of 16.3 GB) against master, paced, with
#              intervals; then one llama-completion run for the hit rate of the context's summary line
#   series-build  the two CUDA builds tg-series compares, at once and detached: this series and the one before a
#              change (BEFORE_ARCHIVE, default .work/archives/llama.cpp-patched-before.tar.gz, packed at that commit),
#              llama-bench and the copy probe only; the skew 0.5 model is written meanwhile
#   tg-series  tg128 at CACHE_MIB (7800: half the expert bytes; 3900: a quarter) with every expert on the host, the
#              series before as the baseline and this one as the candidate, paced, with intervals: a change to the
#              cache's safety must leave no row slower (the ratio's lower end at least 0.98)
#   tg-whole   tg128 with every expert cached (filled whole when made, read in place) as a share of all on the
#              GPU, the cold first repetition apart; then filled as routed (LLAMA_MOE_CACHE_FILL_WHOLE=0), report only
#   tg-whole-mmap  tg-whole's comparison with -lm mmap (the experts registered in place instead of read into pinned
#              buffers)
#   cost       the cache's own cost, tg128 in one interleaved run of the patched build against itself with -ncmoe 0
#              (all on the GPU) as the limit row: every expert cached as is (read in place), probe 1 (n_expert - 1
#              slots a layer: lookups and a few fills), probe 2 (never read in place: lookups, all hits), and the half
#              and quarter caches; the pinned link rate from llama-moe-copy-probe first, for the misses' bytes; then
#              each cache kernel's own duration under ncu (pyllama_moe/bench/kernel_times.py)
set -uo pipefail
step=${1:?usage: cache.sh identity|pp|pp-master|pp-off|pp-32k|series-build|tg-series|tg|tg-whole|tg-whole-mmap|cost}
. "$(dirname "$0")/common.sh"
CACHE_MIB=${CACHE_MIB:-7800}

case $step in
identity)
    wait_builds 300 || exit 1
    # the step fails where a cell failed, after the memcheck and the planted refusal ran
    identity_subset 300 moe-cache identity-moe-cache
    identity_subset 300 moe-cache-parallel identity-moe-cache-parallel
    P=$(patched_bin)
    tiny_prompt
    LLAMA_MOE_CACHE_MIB=2 timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 "$P/llama-completion" -m "$SMALL" \
        -ngl 99 -cmoe -ub 512 -f /tmp/prompt.txt -n 64 --temp 0 --fit off -no-cnv -v > "$OUT/sanitizer-moe-cache.txt" 2>&1
    echo "compute-sanitizer memcheck (expert cache, 2 MiB): exit $?"
    grep -E "ERROR SUMMARY|llama_moe: expert cache" "$OUT/sanitizer-moe-cache.txt" | head -4
    # a planted refusal: the third graph with device lookups finds its first cached layer's slot state corrupt; the
    # decode call that computes it must fail (llama-completion stops with "failed to eval"), not return its logits
    LLAMA_MOE_CACHE_MIB=2 LLAMA_MOE_CACHE_DEBUG_REFUSE=3 timeout 120 "$P/llama-completion" -m "$SMALL" -ngl 99 -cmoe \
        -f /tmp/prompt.txt -n 16 --temp 0 --fit off -no-cnv -v > "$OUT/refusal-moe-cache.txt" 2>&1
    echo "planted refusal (expert cache, 2 MiB): exit $? (a failed decode call exits non-zero)"
    grep -E "DEBUG_REFUSE|was refused|failed to eval" "$OUT/refusal-moe-cache.txt" | head -3
    identity_verdict || exit 1
    ;;
pp-master|pp-off|pp-32k|pp)
    wait_builds 60 || exit 1
    M=$(skew_model) || exit 1
    if [ "$step" = pp-master ] || [ "$step" = pp ]; then
        # master runs ub 512 at ~230 t/s: a round of both load modes is ~90 s of master (2 x 18 s a rep and the 17 GB
        # load), so no warm-up round and no llama-bench warm-up run (the discarded rep is the cold one); 200 s ran
        # out after a warm-up round
        BENCH_MODEL=$M bench 420 --rounds 3 --max-seconds 360 --warmup-rounds 0 --reps 2 --discard 1 --pin-threads \
            --candidate-env LLAMA_MOE_CACHE_MIB=${QUARTER_MIB:-3900} --json "$OUT/cache-pp4096-ub512-master.json" \
            -- -p 4096 -n 0 -b 4096 -ub 512 -ngl 99 -ncmoe 48 -lm none,mmap --no-warmup 2>&1 | tee "$OUT/cache-pp4096-ub512-master.txt"
    fi
    if [ "$step" = pp-off ] || [ "$step" = pp ]; then
        # "no prompt row slower with the cache on": pp512 and pp4096 at ub 512 and 2048, both load modes (8 rows, ~100 s
        # a round of both sides)
        # (a warm-up round and three rounds take ~280 s: more than the budget)
        BENCH_MODEL=$M bench 360 --baseline patched --candidate patched --rounds 3 --max-seconds 300 --reps 2 --discard 1 \
            --pin-threads --candidate-env LLAMA_MOE_CACHE_MIB=${QUARTER_MIB:-3900} --json "$OUT/cache-pp-off.json" \
            -- -p 512,4096 -n 0 -b 4096 -ub 512,2048 -ngl 99 -ncmoe 48 -lm none,mmap 2>&1 | tee "$OUT/cache-pp-off.txt"
    fi
    if [ "$step" = pp-32k ] || [ "$step" = pp ]; then
        # ~86 s a round before the in-place reads: 4 rounds, so that the share's interval can separate from 0.85 (two
        # gave [0.761, 0.977])
        BENCH_MODEL=$M bench 420 --baseline patched --candidate patched --rounds 4 --max-seconds 360 --reps 2 --discard 1 \
            --pin-threads --limit-row n_cpu_moe=0 --candidate-env LLAMA_MOE_CACHE_MIB=${ALL_MIB:-17000} \
            --json "$OUT/cache-pp32k-ub2048.json" -- -p 32768 -n 0 -b 2048 -ub 2048 -ngl 99 -ncmoe 48,0 -lm none \
            2>&1 | tee "$OUT/cache-pp32k-ub2048.txt"
    fi
    ;;
series-build)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    skew_model > /dev/null 2> "$OUT/skew-model.log" &
    skew_pid=$!
    for v in patched before; do
        archive=$A/llama.cpp-patched.tar.gz other=
        [ $v = before ] && archive=${BEFORE_ARCHIVE:-$A/llama.cpp-patched-before.tar.gz} other=--other-series
        rm -f /tmp/plm-$v.rc
        setsid bash -c "python3 -m pyllama_moe build --backend cuda --variant patched --archive $archive $other -j 8 \
            --targets llama-bench,llama-moe-copy-probe > /tmp/plm-build-$v.log 2>&1; echo \$? > /tmp/plm-$v.rc" \
            > /dev/null 2>&1 < /dev/null &
    done
    BUILD_VARIANTS="patched before" wait_builds 560
    wait $skew_pid || echo "the skew 0.5 model was not written (tg-series writes it)"
    ;;
tg-series)
    MAX_S=${MAX_S:-400}
    BUILD_VARIANTS="patched before" wait_builds 60 || exit 1
    M=$(skew_model) || exit 1
    BENCH_MODEL=$M bench $((MAX_S + 160)) --baseline patched --candidate patched \
        --baseline-archive "${BEFORE_ARCHIVE:-$A/llama.cpp-patched-before.tar.gz}" --candidate-archive $A/llama.cpp-patched.tar.gz \
        --paced --pin-threads --warmup-rounds 1 --reps 4 --discard 1 --rounds 4 --max-seconds ${MAX_S:-400} \
        --baseline-env LLAMA_MOE_CACHE_MIB=$CACHE_MIB --candidate-env LLAMA_MOE_CACHE_MIB=$CACHE_MIB \
        --json "$OUT/cache-tg128-series-$CACHE_MIB.json" -- -p 0 -n 128 -ngl 99 -ncmoe 48 -lm none \
        2>&1 | tee "$OUT/cache-tg128-series-$CACHE_MIB.txt"
    ;;
tg)
    wait_builds 60 || exit 1
    M=$(skew_model) || exit 1
    BENCH_MODEL=$M bench 420 --paced --pin-threads --warmup-rounds 1 --reps 4 --discard 1 --rounds 4 --max-seconds 300 \
        --candidate-env LLAMA_MOE_CACHE_MIB=$CACHE_MIB --json "$OUT/cache-tg128.json" \
        -- -p 0 -n 128 -ngl 99 -ncmoe 48 -lm none 2>&1 | tee "$OUT/cache-tg128.txt"
    tiny_prompt
    LLAMA_MOE_CACHE_MIB=$CACHE_MIB timeout 200 "$(patched_bin)/llama-completion" -m "$M" -ngl 99 -cmoe -f /tmp/prompt.txt \
        -n 128 --temp 0 --fit off -no-cnv -v > "$OUT/cache-hit-rate.txt" 2>&1
    grep -E "llama_moe: (expert cache|no expert)" "$OUT/cache-hit-rate.txt"
    ;;
tg-whole)
    # every expert cached (17000 MiB), as a share of all on the GPU in the same run (the patched build
    # against itself, the cache off as the baseline; a paced run measures one test, the share needs two rows). The
    # default fills each layer whole when the cache is made (filled as routed, the share was 0.65): the
    # first repetition of each process (128 tokens, discarded) is the cold pass, its speed and hit rate in the JSON,
    # the fill's time in cache-whole-fill.txt. Then the fill as routed (LLAMA_MOE_CACHE_FILL_WHOLE=0), 8 repetitions
    # a process, for the warming curve (report only)
    wait_builds 60 || exit 1
    M=$(skew_model) || exit 1
    P=$(patched_bin)
    LLAMA_MOE_CACHE_MIB=${ALL_MIB:-17000} timeout 120 "$P/llama-bench" -v -m "$M" -p 0 -n 16 -r 1 -ngl 99 -ncmoe 48 -lm none 2>&1 \
        | grep -E "llama_moe|tg16" > "$OUT/cache-whole-fill.txt"; cat "$OUT/cache-whole-fill.txt"
    BENCH_MODEL=$M bench 300 --baseline patched --candidate patched --pin-threads --warmup-rounds 0 --reps 4 --discard 1 \
        --rounds 4 --max-seconds 240 --limit-row n_cpu_moe=0 --candidate-env LLAMA_MOE_CACHE_MIB=${ALL_MIB:-17000} \
        --json "$OUT/cache-tg128-whole.json" -- -p 0 -n 128 -ngl 99 -ncmoe 48,0 -lm none 2>&1 | tee "$OUT/cache-tg128-whole.txt"
    BENCH_MODEL=$M bench 200 --baseline patched --candidate patched --pin-threads --warmup-rounds 0 --reps 8 --discard 1 \
        --rounds 2 --max-seconds 150 --limit-row n_cpu_moe=0 --candidate-env LLAMA_MOE_CACHE_MIB=${ALL_MIB:-17000} \
        --candidate-env LLAMA_MOE_CACHE_FILL_WHOLE=0 --json "$OUT/cache-tg128-whole-routed.json" \
        -- -p 0 -n 128 -ngl 99 -ncmoe 48,0 -lm none 2>&1 | tee "$OUT/cache-tg128-whole-routed.txt"
    ;;
tg-whole-mmap)
    # the cache off as the baseline, every expert cached as the candidate, -ncmoe 0 as the limit row, all -lm mmap
    wait_builds 60 || exit 1
    M=$(skew_model) || exit 1
    BENCH_MODEL=$M bench 300 --baseline patched --candidate patched --pin-threads --warmup-rounds 0 --reps 3 --discard 1 \
        --rounds 4 --max-seconds 240 --limit-row n_cpu_moe=0 --candidate-env LLAMA_MOE_CACHE_MIB=${ALL_MIB:-17000} \
        --json "$OUT/cache-tg128-whole-mmap.json" -- -p 0 -n 128 -ngl 99 -ncmoe 48,0 -lm mmap 2>&1 | tee "$OUT/cache-tg128-whole-mmap.txt"
    ;;
cost)
    wait_builds 60 || exit 1
    M=$(skew_model) || exit 1
    P=$(patched_bin)
    timeout 60 "$P/llama-moe-copy-probe" 2>&1 | tee "$OUT/cache-cost-copy-probe.txt"
    BENCH_MODEL=$M bench 480 --baseline patched --candidate patched --pin-threads --warmup-rounds 0 --reps 4 --discard 1 \
        --rounds 3 --max-seconds 420 --limit-row n_cpu_moe=0 --pcie-bound --json "$OUT/cache-cost-tg128.json" \
        -- -p 0 -n 128 -ngl 99 -ncmoe 48,0 -lm none -mcm ${ALL_MIB:-17000},7800,3900 -mcp 0,1,2 \
        2>&1 | tee "$OUT/cache-cost-tg128.txt"
    # each cache kernel's own time (ncu serializes kernels: durations, not a step's wall time), half the cache and
    # probe 2: a lookup per cached layer and token, a fill per bank
    for run in "7800 0" "${ALL_MIB:-17000} 2"; do
        set -- $run
        LLAMA_MOE_CACHE_MIB=$1 LLAMA_MOE_CACHE_PROBE=$2 timeout 240 ncu --clock-control none --csv \
            --metrics gpu__time_duration.sum --kernel-name regex:moe_cache "$P/llama-bench" -m "$M" -p 0 -n 8 -r 1 \
            -ngl 99 -ncmoe 48 -lm none > "$OUT/cache-cost-ncu-$1-$2.csv" 2> "$OUT/cache-cost-ncu-$1-$2.log"
        python3 -c 'import sys; from pyllama_moe.bench.kernel_times import parse, table
print(table(parse(open(sys.argv[1]).read())))' "$OUT/cache-cost-ncu-$1-$2.csv" | tee "$OUT/cache-cost-ncu-$1-$2.md"
    done
    ;;
*)
    echo "unknown step $step: use identity|pp|pp-master|pp-off|pp-32k|series-build|tg-series|tg|tg-whole|tg-whole-mmap|cost"; exit 2
    ;;
esac
echo "step $step: $((SECONDS - T0)) s"
