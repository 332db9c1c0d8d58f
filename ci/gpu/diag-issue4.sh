set -u
export PATH=/usr/local/cuda/bin:$PATH PYLLAMA_MOE_HOME=/tmp/plm PYTHONPATH=/tmp/site:$PWD
P=$(ls -d /tmp/plm/builds/patched-cuda-*/bin | head -1)
GLM=$(ls /tmp/plm/models/glm4moe-*.gguf | head -1)
CORPUS=$(ls /tmp/plm/models/glm4moe-*corpus*.txt | head -1)
head -c 6000 "$CORPUS" > /tmp/p.txt
for pin in 1 0; do
  echo "== glm4moe ngl-2 ub2048 mmap, prefetch 0, async input 0, pin $pin"
  LLAMA_MOE_PIN_EXPERTS=$pin GGML_SCHED_PREFETCH=0 GGML_SCHED_ASYNC_INPUT=0 timeout 120 $P/llama-completion -m $GLM -ngl 2 -ub 2048 -b 2048 -f /tmp/p.txt -n 8 --temp 0 --fit off -no-cnv -t 4 > /tmp/o.txt 2> /tmp/e.txt; echo "exit $?"
  grep -v '^0\.\|^$' /tmp/e.txt | tail -3; grep -iE 'error|assert|abort|llama_moe|fail' /tmp/e.txt | head -12
done
echo "== same with async input 1, prefetch 1"
timeout 120 $P/llama-completion -m $GLM -ngl 2 -ub 2048 -b 2048 -f /tmp/p.txt -n 8 --temp 0 --fit off -no-cnv -t 4 > /tmp/o.txt 2> /tmp/e.txt; echo "exit $?"; grep -iE 'error|assert|abort|fail' /tmp/e.txt | head -5
M=/tmp/plm/bench-qwen3-30b-a3b-q4_0.gguf
echo "== prefetch depth and mode, patched llama-bench"
timeout 200 $P/llama-bench -m $M -p 4096 -n 0 -b 4096 -ub 2048,4096 -ngl 99 -ncmoe 48 -lm none -pf 0,1 -pfd 2,3,4 -r 3 -t 16 -o md 2>&1 | grep '^|'
python3 ci/gpu/syncs_per_token.py --archive-dir .work/archives --model $M 2>&1 | tail -6
