#!/usr/bin/env bash
# The host-weight prefetch on the GPU machine: CUDA builds of master and patched, identity cells with the prefetch
# (on by default for CUDA), its poisoned-slot debug knob, compute-sanitizer, host syncs per decoded token, and
# the A/B benchmark of its prompt rows on a Qwen3-30B-A3B-shaped Q4_0 model. ci/gpu/run.sh names these steps.
#
# Prepare on the CPU machine:
#   pyllama-moe source pack --variant master  -o .work/archives/llama.cpp-master.tar.gz
#   pyllama-moe source pack --variant patched -o .work/archives/llama.cpp-patched.tar.gz
#   cp312 wheels of cffi pycparser gguf diskcache tqdm in .whl/ (../shared/docs/gpu-workflow.md)
# then, carrying .work/archives and .whl, run the steps in order, each as one device call:
#   ci/gpu/prefetch.sh build     builds (detached) + the 30B model; waits for the builds while time allows
#   ci/gpu/prefetch.sh check     identity cells (subsets gpu, gpu-variants, layer-major), syncs per token, then the sanitizer
#                                (also alone: identity, sanitizer)
#   ci/gpu/prefetch.sh bench     pyllama-moe bench: pp4096 ub 2048/4096, pp512, tg128, -lm none and mmap
#   ci/gpu/prefetch.sh staging   the staging budget sweep on the patched build, and a two-layer model with 2 GiB
#                                expert tensors under a budget below 3 GiB
#   ci/gpu/prefetch.sh depth     the lookahead: prefetch off and on at depths 2, 3 and 4 (patched llama-bench alone)
# or run all three as one detached pipeline that keeps the GPU busy between calls, repeating
#   ci/gpu/prefetch.sh follow    starts the pipeline once, then follows it for up to FOLLOW_S seconds (560)
# back to back until it prints "pipeline finished". Results land in $OUT (or ./gpu-out).
set -uo pipefail
step=${1:?usage: prefetch.sh build|check|identity|sanitizer|sanitizer-pieces|bench|staging|depth|follow|all}
. "$(dirname "$0")/common.sh"
PIPE=/tmp/plm-pipeline   # the detached pipeline's own output folder, archived into $OUT by each follow call

case $step in
follow)
    follow_pipeline "$0" $PIPE 40
    ;;
all)
    # one step after the other; builds may take longer than one call here, nothing else competes for the GPU
    for s in build check bench; do
        echo "== step $s ($((SECONDS - T0)) s)"
        BUILD_WAIT_S=1200 bash "$0" $s || exit 1
    done
    ;;
build)
    start_builds
    make_bench_model || exit 1
    wait_builds ${BUILD_WAIT_S:-560}
    ;;
check)
    # identity first, then the sanitizer (both also runnable alone)
    bash "$0" identity && bash "$0" sanitizer
    ;;
identity)
    wait_builds 300 || exit 1
    # IDENTITY_SUBSETS names fewer subsets where device time is short. The step fails where a cell failed, after
    # every subset ran (run.sh then stops, unless KEEP_GOING=1)
    for s in ${IDENTITY_SUBSETS:-gpu-variants gpu layer-major}; do
        identity_subset 400 "$s" "identity-$s"
    done
    # the syncs need the 30B model of `run.sh build`; after build-skew or build-patched there is none
    if [ -f "$MODEL" ]; then
        timeout 300 python3 ci/gpu/syncs_per_token.py --archive-dir $A --model "$MODEL" 2>&1 | tee "$OUT/syncs.txt"
    else
        echo "host syncs per token not counted: no $MODEL (run.sh build writes it)" | tee "$OUT/syncs.txt"
    fi
    identity_verdict || exit 1
    ;;
sanitizer-pieces)
    # the same with a 1 MiB ring (under two of the tiny model's 0.53 MiB largest split): lookahead 1, every upload
    # in two pieces, poisoned
    SANITIZER_CASES=pieces bash "$0" sanitizer
    ;;
sanitizer)
    # stream ordering and memory: memcheck over a prefetched prompt (default mode 1 on CUDA) on the matrix's
    # tiny qwen3moe model, made here when no identity run made it before. SANITIZER_CASES: 0 (no debug poison),
    # 1 (poison), pieces (poison and a 1 MiB staging budget)
    wait_builds 300 || exit 1
    P=$(patched_bin)
    tiny_prompt
    [ -x "$P/llama-completion" ] && [ -f "$SMALL" ] || { echo "sanitizer: no patched llama-completion or tiny model"; exit 1; }
    PEAK_RSS=$([ -x /usr/bin/time ] && echo "/usr/bin/time -v")  # GNU time, where the machine has it
    for poison in ${SANITIZER_CASES:-0 1}; do
        staging=$([ "$poison" = pieces ] && echo 1 || echo 0)
        # in the foreground, with the machine's memory sampled at the start and every second, and the tool's peak RSS: an earlier run
        # of the poisoned one, detached between two device calls, ended with exit 137 and nothing else known
        ( while :; do echo "$(date +%T) $(free -m | awk '/Mem:/ {print "used", $3, "MiB, available", $7, "MiB"}')"; sleep 1; done ) \
            > "$OUT/sanitizer-$poison-memory.txt" 2>&1 &
        sampler=$!
        GGML_SCHED_PREFETCH_DEBUG_POISON=$([ "$poison" = 0 ] && echo 0 || echo 1) GGML_SCHED_PREFETCH_STAGING_MIB=$staging \
            timeout 400 $PEAK_RSS compute-sanitizer --tool memcheck --error-exitcode 3 \
            "$P/llama-completion" -m "$SMALL" -ngl 99 -cmoe -lm none -ub 512 -b 2048 -f /tmp/prompt.txt -n 8 \
            --temp 0 --fit off -no-cnv -v > "$OUT/sanitizer-$poison.txt" 2>&1
        rc=$?
        kill $sampler 2>/dev/null
        echo "compute-sanitizer memcheck (debug poison $poison): exit $rc"
        grep -E "ERROR SUMMARY|host-weight prefetch|Maximum resident|Exit status|signal" "$OUT/sanitizer-$poison.txt" | head -6
        tail -2 "$OUT/sanitizer-$poison-memory.txt"
        dmesg 2>/dev/null | grep -iE "killed process|out of memory" | tail -3
    done
    ;;
bench)
    wait_builds 60 || exit 1
    # pp4096 at ub 2048 and 4096 with every expert on the host (-lm none: pinned) and with all on the GPU
    bench 400 --rounds 2 --reps 5 \
        --json "$OUT/bench-pp4096.json" -- -p 4096 -n 0 -b 4096 -ub 2048,4096 -ngl 99 -ncmoe 48,0 -lm none -t 16 \
        2>&1 | tee "$OUT/bench-pp4096.txt"
    # default mmap against -lm none at ub 2048 (the patched build's own ratio is the target)
    bench 400 --rounds 2 --reps 5 \
        --json "$OUT/bench-mmap.json" -- -p 4096 -n 0 -b 4096 -ub 2048 -ngl 99 -ncmoe 48 -lm mmap,none -t 16 \
        2>&1 | tee "$OUT/bench-mmap.txt"
    # pp512 and tg128, host experts and all on the GPU
    bench 400 --rounds 2 --reps 5 \
        --json "$OUT/bench-pp512-tg128.json" -- -p 512 -n 128 -ub 512 -ngl 99 -ncmoe 48,0 -lm none -t 16 \
        2>&1 | tee "$OUT/bench-pp512-tg128.txt"
    ;;
staging)
    wait_builds 60 || exit 1
    P=$(patched_bin)
    # the sweep: 1, 2, 3, 4 and 6 of the 108 MiB splits of the 30B shape, depth 4 and 8 as caps, and auto (0);
    # patched only (master has no -pfs), so the repetitions of one process are all there is: read it with that in
    # mind, and rerun the points that matter as A/B rows against the series before this change
    timeout 500 "$P/llama-bench" -m "$MODEL" -p 4096 -n 0 -b 4096 -ub 4096,2048 -ngl 99 -ncmoe 48 -lm none -t 16 \
        -r 3 -pfd 4,8 -pfs 0,108,216,324,432,648 -o json > "$OUT/staging-sweep.json" 2> "$OUT/staging-sweep.log"
    echo "staging sweep: exit $?"
    grep -h "host-weight prefetch" "$OUT/staging-sweep.log" | sort | uniq -c | head -20
    # 256 experts x 7168 x 2048, Q4_0, two layers: each expert tensor is about 2 GiB; auto asks for 8 GiB, a budget
    # of 2900 MiB must keep the prefetch on (lookahead 1, with the ~900 MiB beside the largest split of each upload
    # running during the compute before it)
    BIG=$PYLLAMA_MOE_HOME/staging-2gib-experts-q4_0.gguf
    [ -f "$BIG" ] || python3 -m pyllama_moe synth --preset qwen3-30b-a3b --layers 2 --hidden 7168 --experts 256 \
        --expert-ff 2048 --type q4_0 --seed 11 -o "$BIG" --quiet < /dev/null || { echo "synth of $BIG failed"; exit 1; }
    timeout 300 "$P/llama-completion" -m "$BIG" -ngl 99 -cmoe -lm none -ub 4096 -b 4096 -p "hello" -n 1 --fit off \
        -no-cnv -v --sched-prefetch-staging 2900 > "$OUT/staging-2gib.txt" 2>&1
    echo "2 GiB experts, 2900 MiB budget: exit $?"
    grep -E "host-weight prefetch|compute buffer size" "$OUT/staging-2gib.txt" | head -6
    # the target: not slower than master at ub 2048 with that budget (A/B rows with intervals)
    BENCH_MODEL=$BIG bench 400 --rounds 4 --reps 3 --discard 1 --pin-threads \
        --candidate-env GGML_SCHED_PREFETCH_STAGING_MIB=2900 --json "$OUT/staging-2gib-bench.json" \
        -- -p 4096 -n 0 -b 4096 -ub 2048 -ngl 99 -ncmoe 99 -lm none 2>&1 | tee "$OUT/staging-2gib-bench.txt"
    ;;
depth)
    # pp4096 at ub 2048 and 4096, the prefetch off and on at depths 2, 3 and 4; patched only (master has no -pf),
    # so the repetitions of one process are all there is
    wait_builds 60 || exit 1
    P=$(patched_bin)
    timeout 300 "$P/llama-bench" -m "$MODEL" -p 4096 -n 0 -b 4096 -ub 2048,4096 -ngl 99 -ncmoe 48 -lm none -pf 0,1 \
        -pfd 2,3,4 -r 3 -t 16 -o md 2>&1 | tee "$OUT/prefetch-depth.md" | grep '^|'
    ;;
*)
    echo "unknown step $step: use build|check|identity|sanitizer|sanitizer-pieces|bench|staging|depth|follow|all"; exit 2
    ;;
esac
echo "step $step: $((SECONDS - T0)) s"
