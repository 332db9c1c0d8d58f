#!/usr/bin/env bash
# Issue 2 on the GPU machine: CUDA builds of master and patched from the pruned archives, three identity
# cells (ci/matrix.toml subset `gpu`) and an A/B llama-bench on a Qwen3-30B-A3B-shaped model.
#
# Prepare on the CPU machine (the GPU machine has no registry and maybe no git):
#   pyllama-moe source pack --variant master  -o .work/archives/llama.cpp-master.tar.gz
#   pyllama-moe source pack --variant patched -o .work/archives/llama.cpp-patched.tar.gz
#   wheels of cffi pycparser gguf diskcache for cp312 in .whl/ (see ../shared/docs/gpu-workflow.md)
# then run `ci/gpu/foundation.sh build` and `ci/gpu/foundation.sh check` there (carry .work/archives and .whl).
# Results land in $OUT (or ./gpu-out).
set -uo pipefail
step=${1:?usage: foundation.sh build|check}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH PYLLAMA_MOE_HOME=/tmp/plm PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
A=.work/archives
MODEL=$PYLLAMA_MOE_HOME/bench-qwen3-30b-a3b-q4_0.gguf

case $step in
build)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    for v in master patched; do
        rm -f /tmp/plm-$v.rc
        setsid bash -c "python3 -m pyllama_moe build --backend cuda --variant $v --archive $A/llama.cpp-$v.tar.gz -j 8 \
            > /tmp/plm-build-$v.log 2>&1; echo \$? > /tmp/plm-$v.rc" > /dev/null 2>&1 < /dev/null &
    done
    # the builds create $PYLLAMA_MOE_HOME in the background; synth refuses an output folder that does not exist yet
    mkdir -p "$PYLLAMA_MOE_HOME"
    if [ ! -f "$MODEL" ]; then
        python3 -m pyllama_moe synth --preset qwen3-30b-a3b --type q4_0 --seed 7 -o "$MODEL.partial" --quiet < /dev/null \
            && mv "$MODEL.partial" "$MODEL" || { echo "synth of $MODEL failed"; exit 1; }
    fi
    ;;
check)
    for v in master patched; do
        while [ ! -f /tmp/plm-$v.rc ]; do sleep 5; done
        cp /tmp/plm-build-$v.log "$OUT/build-$v.log"
        [ "$(cat /tmp/plm-$v.rc)" = 0 ] || { echo "build $v failed"; tail -30 /tmp/plm-build-$v.log; exit 1; }
    done
    grep -h "build .*/cuda: done" "$OUT"/build-*.log
    python3 -m pyllama_moe compare --subset gpu --archive-dir $A --json "$OUT/identity-gpu.json" 2>&1 | tee "$OUT/identity-gpu.txt"
    python3 -m pyllama_moe bench --model "$MODEL" --backend cuda --archive-dir $A --rounds 2 --reps 5 \
        --json "$OUT/bench.json" -- -p 512 -n 128 -ub 512 -ngl 99 -ncmoe 48,0 -lm none -t 16 2>&1 | tee "$OUT/bench.txt"
    ;;
esac
