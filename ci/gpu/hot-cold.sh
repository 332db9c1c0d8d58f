#!/usr/bin/env bash
# Hot/cold layers and miss policies (docs/hot-cold.md) on the GPU machine. Prepare on the CPU machine as prefetch.sh
# says; after `run.sh build` (or build-patched for the steps of the patched build alone), run.sh names them
# hot-cold-STEP. Every tg128 row decodes after a 512-token prompt (-d 512), which fills the cache: under cpu decode never
# uploads, so without it the cache would stay empty. The model is the 30B-A3B shape with routing skew 0.5, every expert
# on the host (-ncmoe 48), pinned,
# -lm none; the cache at a quarter (3900 MiB) and half (7800 MiB) of the expert bytes. Each bench interleaves its two
# configurations, one ratio with its interval:
#   ops       test-backend-ops of the lookup (the policies' cases), the fills and the masked ids on CUDA0 against
#             the CPU, then under compute-sanitizer memcheck
#   policy    tg128: each policy (cpu, split:2, split:4) against upload in the same build, per budget; and with
#             the worker on (-sac 1, GGML_SCHED_ASYNC_CPU) against off under cpu
#   master    tg128: master with every expert on the host (-cmoe) against the patched build with the cache and a
#             policy (POLICY, default cpu), per budget
#   targets   the rows the miss policies are judged by, most telling first, in short rounds (3, no warm-up round) so
#             that one device lease holds them all: pageable experts (LLAMA_MOE_PIN_EXPERTS=0, -lm mmap) cpu against
#             master -cmoe and against upload; pinned cpu against upload and against master; graphs of 8-16 tokens
#             against master -cmoe; split:4 against upload; -sac 1 against 0 under cpu. TARGETS narrows it (names)
#   parallel  pp of 4, 8, 12, 16 tokens per graph (the decode of that many sequences): the cache at a half and a
#             quarter under upload and cpu against master -cmoe (llama-bench -p N -n 0 -ub N: one graph of N tokens)
set -uo pipefail
step=${1:?usage: hot-cold.sh ops|policy|master|targets|parallel}
. "$(dirname "$0")/common.sh"
POLICY=${POLICY:-cpu}

policy_bench() { # $1: seconds, $2: budget MiB, $3: baseline policy, $4: candidate policy, $5: -sac of both (0|1 or
    # "0 1": off against on), $6: a name, then llama-bench args
    local limit=$1 mcm=$2 base=$3 cand=$4 sac=($5) name=$6; shift 6
    BENCH_MODEL=$M bench "$limit" --baseline patched --candidate patched \
        --baseline-env LLAMA_MOE_MISS_POLICY=$base --baseline-env GGML_SCHED_ASYNC_CPU=${sac[0]} \
        --candidate-env LLAMA_MOE_MISS_POLICY=$cand --candidate-env GGML_SCHED_ASYNC_CPU=${sac[1]:-${sac[0]}} \
        -mcm "$mcm" --pin-threads --reps 3 --discard 1 --rounds 4 --max-seconds $((limit - 30)) \
        --json "$OUT/$name.json" -- -ngl 99 -ncmoe 48 -lm none "$@" 2>&1 | tee "$OUT/$name.txt"
}

master_bench() { # $1: budget MiB, $2: policy, $3: a name, then llama-bench args
    local mcm=$1 p=$2 name=$3; shift 3
    BENCH_MODEL=$M bench 200 --baseline master --candidate patched --candidate-env LLAMA_MOE_MISS_POLICY=$p -mcm "$mcm" \
        --pin-threads --reps 3 --discard 1 --rounds 4 --max-seconds 170 --json "$OUT/$name.json" \
        -- -ngl 99 -ncmoe 48 -lm none "$@" 2>&1 | tee "$OUT/$name.txt"
}

case $step in
ops)
    wait_builds 300 || exit 1
    P=$(patched_bin)
    ops=MOE_CACHE_LOOKUP,MOE_CACHE_FILL,MUL_MAT_ID_MASKED,ADD_ID_MASKED
    timeout 300 "$P/test-backend-ops" -o $ops -b CUDA0 2>&1 | tail -5 | tee "$OUT/ops.txt"
    [ "${OPS_MEMCHECK_S:-400}" != 0 ] && command -v compute-sanitizer > /dev/null && timeout ${OPS_MEMCHECK_S:-400} compute-sanitizer --tool memcheck "$P/test-backend-ops" \
        -o $ops -b CUDA0 2>&1 | tail -8 | tee "$OUT/ops-memcheck.txt"
    ;;
policy)
    wait_builds 600 || exit 1
    M=$(skew_model) || exit 1
    for mcm in 3900 7800; do
        for p in cpu split:2 split:4; do
            policy_bench 150 $mcm upload $p 0 "policy-$p-$mcm" -p 0 -n 128 -d 512
        done
    done
    policy_bench 150 3900 cpu cpu "0 1" "async-cpu-3900" -p 0 -n 128 -d 512
    ;;
master)
    wait_builds 600 || exit 1
    M=$(skew_model) || exit 1
    for mcm in 3900 7800; do
        master_bench $mcm $POLICY "master-$POLICY-$mcm" -p 0 -n 128 -d 512
    done
    ;;
targets)
    wait_builds 600 || exit 1
    M=$(skew_model) || exit 1
    row() { # $1: a name, $2: seconds, $3: baseline (master or a policy), $4: candidate policy, $5: budget MiB,
        # $6: pageable|pinned, then llama-bench args
        local name=$1 limit=$2 base=$3 cand=$4 mcm=$5 pin=$6; shift 6
        case " ${TARGETS:-$name} " in *" $name "*) ;; *) return 0 ;; esac
        local args=(--candidate patched --candidate-env LLAMA_MOE_MISS_POLICY=$cand) lm=none
        if [ $base = master ]; then args+=(--baseline master)
        else args+=(--baseline patched --baseline-env LLAMA_MOE_MISS_POLICY=$base); fi
        if [ $pin = pageable ]; then
            lm=mmap; args+=(--baseline-env LLAMA_MOE_PIN_EXPERTS=0 --candidate-env LLAMA_MOE_PIN_EXPERTS=0)
        fi
        echo "== $name: $base against $cand, -mcm $mcm, $pin experts (-lm $lm)"
        BENCH_MODEL=$M bench "$limit" "${args[@]}" -mcm "$mcm" --pin-threads --reps 3 --discard 1 --rounds 3 \
            --warmup-rounds 0 --max-seconds $((limit - 20)) --json "$OUT/$name.json" \
            -- -ngl 99 -ncmoe 48 -lm $lm "$@" 2>&1 | tee "$OUT/$name.txt" | grep -E '^\|' | tail -4
    }
    row page-master-cpu-3900 170 master cpu 3900 pageable -p 0 -n 128 -d 512
    row page-upload-cpu-3900 200 upload cpu 3900 pageable -p 0 -n 128 -d 512
    row pin-upload-cpu-3900 120 upload cpu 3900 pinned -p 0 -n 128 -d 512
    row pin-master-cpu-7800 150 master cpu 7800 pinned -p 0 -n 128 -d 512
    row par-master-cpu-7800 150 master cpu 7800 pinned -p 12,16 -n 0 -ub 16
    row page-master-cpu-7800 170 master cpu 7800 pageable -p 0 -n 128 -d 512
    row page-upload-cpu-7800 200 upload cpu 7800 pageable -p 0 -n 128 -d 512
    row pin-upload-split4-3900 120 upload split:4 3900 pinned -p 0 -n 128 -d 512
    row par-master-cpu-3900 150 master cpu 3900 pinned -p 8 -n 0 -ub 8
    case " ${TARGETS:-async-cpu-3900} " in *" async-cpu-3900 "*)
        policy_bench 120 3900 cpu cpu "0 1" async-cpu-3900 -p 0 -n 128 -d 512 | grep -E '^\|' | tail -4 ;; esac
    ;;
parallel)
    wait_builds 600 || exit 1
    M=$(skew_model) || exit 1
    for mcm in 7800 3900; do
        for p in upload cpu; do
            master_bench $mcm $p "parallel-$p-$mcm" -p 4,8,12,16 -n 0 -ub 16
        done
    done
    ;;
*)
    echo "hot-cold.sh: unknown step $step"; exit 2 ;;
esac
