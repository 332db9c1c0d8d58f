#!/usr/bin/env bash
# Benchmark statistics on the GPU machine: intervals that can see a 3% difference on decode, on the
# Qwen3-30B-A3B-shaped Q4_0 model with every expert in host memory (ci/gpu/run.sh names the steps stats-STEP).
#
# Prepare on the CPU machine (as for prefetch.sh):
#   pyllama-moe source pack --variant master  -o .work/archives/llama.cpp-master.tar.gz
#   pyllama-moe source pack --variant patched -o .work/archives/llama.cpp-patched.tar.gz
#   cp312 wheels of cffi pycparser gguf diskcache tqdm in .whl/ (../shared/docs/gpu-workflow.md)
# then, carrying .work/archives and .whl, one device call per step:
#   build     CUDA builds (llama-bench; patched also llama-moe-copy-probe) and the 30B model, detached
#   study     where decode noise comes from: master against itself, tg128 x pinned threads (STUDY_T)
#   target    tg128 master vs patched, paced rounds until the 95% interval is within +/-3%, 300 s at most
#   planted   patched vs patched with LLAMA_MOE_DEBUG_SLOWDOWN_PCT=5 in the candidate: the interval must
#             exclude 1.0
#   self      master vs master, paced, the same budget: the interval must contain 1.0
#   rows      the host-weight prefetch's prompt rows with intervals: pp4096 ub 2048/4096 with host experts against all
#             on the GPU (--limit-row) and the PCIe bound, mmap against -lm none
#   rows-mmap   pp4096 ub 2048, mmap against -lm none (also the end of rows)
#   rows-short  pp512 and tg128 with host experts against all on the GPU
# or all of them as one detached pipeline that keeps the GPU busy between device calls, repeating
#   follow    starts the pipeline once, then follows it for up to FOLLOW_S seconds (560)
# back to back until it prints "pipeline finished" (a machine is given back 30 s after a call).
# Threads: --pin-threads (one compute thread pinned per CPU but one: results/benchmark-statistics.md says why).
# REPS: repetitions per build and paced round (default 4: the process effect, not the repetition, dominates). Results land in $OUT (or ./gpu-out).
set -uo pipefail
step=${1:?usage: bench-stats.sh build|study|target|planted|self|rows|rows-mmap|rows-short|all|follow}
. "$(dirname "$0")/common.sh"
PIPE=/tmp/plm-bench-pipeline
export TARGETS_master=llama-bench TARGETS_patched=llama-bench,llama-moe-copy-probe
HOST="-ngl 99 -ncmoe 48 -lm none"
ALL_CPUS=$(printf '0x%x' $(( (1 << $(nproc)) - 1 )))
PACED="--paced --pin-threads --warmup-rounds 1 --reps ${REPS:-4} --discard 1 --target-ci 0.03 --rounds 5"

case $step in
follow)
    follow_pipeline "$0" $PIPE 60
    ;;
all)
    # most important first: a call that runs out of device time leaves the later steps undone, not half-read
    BUILD_WAIT_S=1200 bash "$0" build || exit 1
    for s in target planted self rows rows-short; do
        echo "== step $s ($((SECONDS - T0)) s)"
        bash "$0" $s
    done
    ;;
build)
    start_builds
    make_bench_model || exit 1
    wait_builds ${BUILD_WAIT_S:-560}
    ;;
study)
    wait_builds 60 || exit 1
    { uname -r; nproc; lscpu | grep -E 'Model name|Thread|Core|Socket|NUMA|Hypervisor|MHz'
      echo "siblings: $(cat /sys/devices/system/cpu/cpu*/topology/thread_siblings_list 2>/dev/null | sort -un | tr '\n' ' ')"
      free -g | head -2; cat /proc/loadavg
      nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,pstate --format=csv
    } 2>&1 | tee "$OUT/machine.txt"
    # one llama-bench process runs the thread settings on one loaded model; rounds of master against itself
    # give two processes per setting and round: the noise inside a process and between processes
    bench 560 --baseline master --candidate master --warmup-rounds 1 --rounds 2 --reps 3 --discard 1 \
        --json "$OUT/study.json" -- -p 0 -n 128 $HOST -t ${STUDY_T:-12,15,16} -C $ALL_CPUS --cpu-strict 1 \
        2>&1 | tee "$OUT/study.txt"
    ;;
target)
    wait_builds 60 || exit 1
    bench 420 $PACED --max-seconds 300 --json "$OUT/target-tg128.json" -- -p 0 -n 128 $HOST \
        2>&1 | tee "$OUT/target-tg128.txt"
    ;;
planted)
    wait_builds 60 || exit 1
    bench 420 --baseline patched --candidate patched --candidate-env LLAMA_MOE_DEBUG_SLOWDOWN_PCT=5 $PACED \
        --max-seconds 240 --json "$OUT/planted-tg128.json" -- -p 0 -n 128 $HOST 2>&1 | tee "$OUT/planted-tg128.txt"
    ;;
self)
    wait_builds 60 || exit 1
    bench 420 --baseline master --candidate master $PACED --max-seconds 240 --json "$OUT/self-tg128.json" \
        -- -p 0 -n 128 $HOST 2>&1 | tee "$OUT/self-tg128.txt"
    ;;
rows)
    wait_builds 60 || exit 1
    bench 400 --rounds ${ROUNDS:-4} --reps 3 --discard 1 --pin-threads --limit-row n_cpu_moe=0 --pcie-bound \
        --json "$OUT/rows-pp4096.json" -- -p 4096 -n 0 -b 4096 -ub 2048,4096 -ngl 99 -ncmoe 48,0 -lm none \
        2>&1 | tee "$OUT/rows-pp4096.txt"
    bash "$0" rows-mmap
    ;;
rows-mmap)
    # --max-seconds: a round that would not fit is not started, so what ran is kept when the budget is short
    wait_builds 60 || exit 1
    bench 260 --rounds ${ROUNDS:-4} --reps 3 --discard 1 --pin-threads --limit-row load_mode=none --pcie-bound \
        --max-seconds 220 --json "$OUT/rows-mmap.json" -- -p 4096 -n 0 -b 4096 -ub 2048 -ngl 99 -ncmoe 48 -lm mmap,none \
        2>&1 | tee "$OUT/rows-mmap.txt"
    ;;
rows-short)
    wait_builds 60 || exit 1
    bench 400 --rounds ${ROUNDS:-4} --reps 3 --discard 1 --pin-threads --limit-row n_cpu_moe=0 \
        --json "$OUT/rows-pp512-tg128.json" -- -p 512 -n 128 -ub 512 -ngl 99 -ncmoe 48,0 -lm none \
        2>&1 | tee "$OUT/rows-pp512-tg128.txt"
    ;;
*)
    echo "unknown step $step: use build|study|target|planted|self|rows|rows-mmap|rows-short|all|follow"; exit 2
    ;;
esac
echo "step $step: $((SECONDS - T0)) s"
