#!/usr/bin/env bash
# Issue 4, last GPU check after two fixes (pinned ranges widened over the host tensors they touch; prefetch
# depth 4 by default): the patched CUDA build alone, the cell that crashed before (glm4moe, -ngl 2, ub 2048,
# mmap) with pinning on and off, and one patched llama-bench run with the all-on-GPU rows, prefetch off/on,
# -lm none and mmap. Carry .work/archives and .whl.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH PYLLAMA_MOE_HOME=/tmp/plm PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
MODEL=$PYLLAMA_MOE_HOME/bench-qwen3-30b-a3b-q4_0.gguf
T0=$SECONDS
# everything also goes to $OUT/verify.log as it happens: a call that runs past its limit still returns it
exec > >(tee -a "$OUT/verify.log") 2>&1
python3 -m pyllama_moe synth --preset qwen3-30b-a3b --type q4_0 --seed 7 -o "$MODEL" > /tmp/synth.log 2>&1 < /dev/null &
SYNTH=$!
timeout 420 python3 -m pyllama_moe build --backend cuda --variant patched --archive .work/archives/llama.cpp-patched.tar.gz -j 16 \
    > "$OUT/build-patched.log" 2>&1 || { tail -20 "$OUT/build-patched.log"; exit 1; }
tail -1 "$OUT/build-patched.log"; echo "build: $((SECONDS - T0)) s"
P=$(ls -d /tmp/plm/builds/patched-cuda-*/bin | head -1)
GLM=$(python3 -c "
from pyllama_moe import models; from pyllama_moe.matrix import load_matrix; from pyllama_moe.paths import CI_DIR
m = models.ensure_model('glm4moe', load_matrix(CI_DIR / 'matrix.toml').models['glm4moe']); print(m)
c = models.ensure_corpus(m, tokens=4000); open('/tmp/p.txt', 'w').write(c.read_text()[:6000])" | tail -1)
for env in "LLAMA_MOE_PIN_EXPERTS=1" "LLAMA_MOE_PIN_EXPERTS=0" "LLAMA_MOE_PIN_EXPERTS=1 GGML_SCHED_PREFETCH=0 GGML_SCHED_ASYNC_INPUT=0"; do
    env $env timeout 60 $P/llama-completion -m $GLM -ngl 2 -ub 2048 -b 2048 -f /tmp/p.txt -n 16 --temp 0 --fit off -no-cnv -t 8 -v \
        < /dev/null > /tmp/o.txt 2> /tmp/e.txt
    echo "glm4moe -ngl 2 ub2048 mmap [$env]: exit $? output $(md5sum < /tmp/o.txt | cut -c1-12) ($((SECONDS - T0)) s)"
    grep -E "llama_moe:|host-weight prefetch on|CUDA error" /tmp/e.txt | sed 's/^[0-9.]* . //' | head -3
done
wait $SYNTH || { echo "synth failed"; tail -5 /tmp/synth.log; exit 1; }
echo "== patched llama-bench, one run ($((SECONDS - T0)) s)"
timeout 240 $P/llama-bench -m $MODEL -p 4096 -n 0 -b 4096 -ub 2048,4096 -ngl 99 -ncmoe 48,0 -lm none,mmap -pf 0,1 -r 5 -t 16 \
    -o md 2> "$OUT/bench-verify.err" | tee "$OUT/bench-verify.md"
echo "total: $((SECONDS - T0)) s"
