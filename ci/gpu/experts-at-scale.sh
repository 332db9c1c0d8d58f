#!/usr/bin/env bash
# Pinned experts and staging at any model size and file layout, on the GPU machine: the Qwen3-30B-A3B-shaped
# Q4_0 model (17 GB) and the matrix's tiny models (ci/gpu/run.sh names the steps scale-STEP).
#
# Prepare on the CPU machine as prefetch.sh says, then, carrying .work/archives and .whl, one device call a step:
#   build      CUDA builds of master and patched (every default target) and the 30B model (prefetch.sh build)
#   minbatch   where uploading whole experts ahead beats copying the routed ones at split time. The
#              patched build against itself, GGML_SCHED_PREFETCH_MIN_BATCH=1 (every ubatch uploads ahead) as
#              the candidate and 1000000 (no ubatch does: routed copies only) as the baseline, pp512 at ub
#              32..512, routing skew 0 and 0.5 (MINBATCH_SKEWS); a ratio above 1 says "ahead" is faster at that
#              ubatch size
#   share      the pp4096 ub 4096 target: patched share of the all-on-GPU row with its interval, 8 rounds
#   pin        a pin budget smaller than the experts pins part and says so (tiny model and 30B model,
#              mmap), the greedy text equal to the run with pinning off; the identity cells with the budget
#              are in `compare --subset gpu-variants` (prefetch.sh identity)
# or all of them, in that order, as one detached pipeline: FOLLOW_S=560 bash ci/gpu/experts-at-scale.sh follow,
# repeated until it prints "pipeline finished". Results land in $OUT (or ./gpu-out).
set -uo pipefail
step=${1:?usage: experts-at-scale.sh build|minbatch|share|pin|all|follow}
. "$(dirname "$0")/common.sh"
here=$(dirname "$0")
skewed_model() { # $1: routing skew; the 30B shape with that skew, written once
    local path=$PYLLAMA_MOE_HOME/bench-qwen3-30b-a3b-q4_0-skew$1.gguf
    [ "$1" = 0 ] && path=$MODEL
    if [ ! -f "$path" ]; then
        python3 -m pyllama_moe synth --preset qwen3-30b-a3b --type q4_0 --seed 7 --skew "$1" \
            -o "$path.partial" --quiet < /dev/null >&2 && mv "$path.partial" "$path" >&2 || return 1
    fi
    echo "$path"
}

case $step in
follow)
    follow_pipeline "$0" /tmp/plm-experts-at-scale 60
    ;;
all)
    BUILD_WAIT_S=1200 bash "$here/prefetch.sh" build || exit 1
    for s in minbatch share pin; do
        echo "== $s ($((SECONDS - T0)) s)"
        bash "$0" $s
    done
    ;;
build)
    bash "$here/prefetch.sh" build
    ;;
minbatch)
    wait_builds 60 || exit 1
    for skew in ${MINBATCH_SKEWS:-0 0.5}; do
        m=$(skewed_model $skew) || exit 1
        # ~5 s a pp512 at ub 32 (16 ubatches, each sending most experts), ~60-90 s a round of both sides: the time
        # budget keeps what ran (a round that would not fit is not started) inside the timeout
        BENCH_MODEL=$m bench 330 --baseline patched --candidate patched \
            --baseline-env GGML_SCHED_PREFETCH_MIN_BATCH=1000000 --candidate-env GGML_SCHED_PREFETCH_MIN_BATCH=1 \
            --rounds ${ROUNDS:-3} --max-seconds ${MINBATCH_S:-240} --reps 2 --discard 1 --pin-threads \
            --json "$OUT/minbatch-skew$skew.json" \
            -- -p 512 -n 0 -b 512 -ub 32,64,128,256,512 -ngl 99 -ncmoe 48 -lm none 2>&1 | tee "$OUT/minbatch-skew$skew.txt"
    done
    # the skews this run did not measure are read from MINBATCH_EARLIER (the JSON of an earlier minbatch run)
    python3 -m pyllama_moe plot ${MINBATCH_EARLIER:-} $(ls "$OUT"/minbatch-skew*.json) --sweep n_ubatch \
        --title "uploads ahead (min batch 1) / routed copies (min batch 1e6), pp512, experts on the host" \
        -o "$OUT/minbatch.svg"
    ;;
share)
    wait_builds 60 || exit 1
    bench 560 --rounds ${ROUNDS:-8} --max-seconds 480 --reps 3 --discard 1 --pin-threads --limit-row n_cpu_moe=0 \
        --pcie-bound --json "$OUT/share-pp4096-ub4096.json" -- -p 4096 -n 0 -b 4096 -ub 4096 -ngl 99 -ncmoe 48,0 -lm none \
        2>&1 | tee "$OUT/share-pp4096-ub4096.txt"
    ;;
pin)
    wait_builds 60 || exit 1
    P=$(patched_bin)
    tiny_prompt
    # budget in MiB per model: below its expert bytes (tiny: 6.4 MiB, 30B: 16.3 GB), so only part is pinned
    for run in "$SMALL:4" "$MODEL:8192"; do
        m=${run%:*}; budget=${run##*:}
        for pin in off budget; do
            env=$([ $pin = off ] && echo LLAMA_MOE_PIN_EXPERTS=0 || echo LLAMA_MOE_PIN_BUDGET_MIB=$budget)
            out=$OUT/pin-$(basename "$m" .gguf)-$pin  # .txt: the prompt and greedy text (stdout), .log: the log
            env $env timeout 300 "$P/llama-completion" -m "$m" -ngl 99 -cmoe -ub 2048 -b 2048 -f /tmp/prompt.txt -n 16 \
                --temp 0 --fit off -no-cnv -v > "$out.txt" 2> "$out.log"
            echo "$(basename "$m") $env: exit $?"
            grep -E "llama_moe: .*(registered|pageable|copied)" "$out.log" | head -2
        done
        cmp -s "$OUT/pin-$(basename "$m" .gguf)-off.txt" "$OUT/pin-$(basename "$m" .gguf)-budget.txt" \
            && echo "same text with pinning off and within the budget" || echo "TEXT DIFFERS"
    done
    ;;
*)
    echo "unknown step $step: use build|minbatch|share|pin|all|follow"; exit 2
    ;;
esac
echo "step $step: $((SECONDS - T0)) s"
