#!/usr/bin/env bash
# Thread-sanitizer check of the SIM device and the scheduler on a few sim cells (by hand, not in CI).
#
#   pyllama-moe build --variant patched --cmake-arg=-DGGML_SANITIZE_THREAD=ON --cmake-arg=-DLLAMA_SANITIZE_THREAD=ON \
#       --cmake-arg=-DGGML_OPENMP=OFF --targets llama-perplexity,llama-completion
#   ci/tsan-sim.sh <that build dir> <model.gguf> <corpus.txt>
#
# Runs llama-perplexity on SIM (1 and 2 devices, poison and copy latency on) for --cpu-moe, -ncmoe 2 and
# -ngl 2, each with the host-weight prefetch off and on (mode 2), and prints every ThreadSanitizer report's top frames. Suppressions, each with its reason, are in
# ci/tsan.supp; a report that mentions ggml-sim or the scheduler is ours and must not be suppressed.
set -uo pipefail
build=${1:?build dir}; model=${2:?model}; corpus=${3:?corpus}
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/tsan-sim}; mkdir -p "$out"
export TSAN_OPTIONS="halt_on_error=0 second_deadlock_stack=1 suppressions=$here/tsan.supp"
export GGML_SIM_POISON=1 GGML_SIM_COPY_LATENCY_US=50
total=0
for devices in 1 2; do
  for place in "-cmoe" "-ncmoe 2" "-ngl 2"; do
   # GGML_SCHED_PREFETCH=2: SIM is no CUDA-family device, so only mode 2 runs the staging arena and copy queue there
   for prefetch in 0 2; do
    name="sim${devices}${place// /}-pf${prefetch}"
    rm -f "$out/$name.ops.jsonl"
    GGML_SCHED_PREFETCH=$prefetch GGML_SIM_OPLOG="$out/$name.ops.jsonl" GGML_SIM_DEVICES=$devices "$build/bin/llama-perplexity" -m "$model" -f "$corpus" -c 1024 -b 1024 -ub 512 \
        --chunks 1 -t 2 -nr --fit off -ngl 99 $place > "$out/$name.log" 2>&1
    rc=$?
    n=$(grep -c "WARNING: ThreadSanitizer" "$out/$name.log")
    ours=$(grep -A12 "WARNING: ThreadSanitizer" "$out/$name.log" | grep -c "ggml-sim\|ggml-backend.cpp")
    ppl=$(grep -o "Final estimate: PPL = [0-9.]*" "$out/$name.log")
    computes=$(grep -c '"op":"compute"' "$out/$name.ops.jsonl" 2>/dev/null)
    echo "$name: exit $rc, $n reports ($ours with a frame in ggml-sim or ggml-backend.cpp), ${computes:-0} graph computes on SIM, $ppl"
    total=$((total + n))
   done
  done
done
# the expert cache: the prompt's ubatches of 128 tokens upload ahead (mode 2), the cache staging their
# experts on the copy queue from the banks and the host (the scheduler's fill callback, on the thread that queues the
# splits); then decode reads the banks, the eval callback reads the router's ids back and uploads misses and the slot
# map on the SIM stream while its compute thread runs; 64 generated tokens evicting every token. At 16 MiB (a slot
# per expert) the first ubatch makes every expert resident and the graphs after it read the banks in place
head -c 2000 "$corpus" > "$out/prompt.txt"  # ~500 tokens: 3 ubatches staged through the cache and a short rest
for mib in 2 16; do
for devices in 1 2; do
    name="sim${devices}-cmoe-cache${mib}"
    rm -f "$out/$name.ops.jsonl"
    GGML_SCHED_PREFETCH=2 LLAMA_MOE_CACHE_MIB=$mib GGML_SIM_OPLOG="$out/$name.ops.jsonl" GGML_SIM_DEVICES=$devices \
        "$build/bin/llama-completion" -m "$model" -f "$out/prompt.txt" -c 2048 -n 64 -b 512 -ub 128 -t 2 -nr --fit off \
        -ngl 99 -cmoe --temp 0 -no-cnv -v > "$out/$name.log" 2>&1 < /dev/null
    rc=$?
    n=$(grep -c "WARNING: ThreadSanitizer" "$out/$name.log")
    ours=$(grep -A12 "WARNING: ThreadSanitizer" "$out/$name.log" | grep -c "ggml-sim\|ggml-backend.cpp\|llama-moe")
    steps=$(grep -o "expert cache, decode: [0-9]* layer steps" "$out/$name.log")
    prompt=$(grep -o "expert cache, prompts: [0-9]* layer steps, [0-9]* experts read from the banks" "$out/$name.log")
    in_place=$(grep -o "[0-9]* read in place" "$out/$name.log" | tr '\n' ' ')
    echo "$name: exit $rc, $n reports ($ours with a frame in ggml-sim, ggml-backend.cpp or llama-moe), ${steps:-no cache summary}; ${prompt:-no prompt summary}; in place: ${in_place:-none}"
    total=$((total + n))
done
done
echo "total reports: $total"
grep -h -A8 "WARNING: ThreadSanitizer" "$out"/sim*.log | grep -E "^WARNING|#[0-3] " | sort | uniq -c | sort -rn | head -40
# negative control: SIM's synchronize stops waiting, so the host reads memory its stream still writes; TSAN must
# see that, or the zero above proves nothing
GGML_SIM_DEBUG_SKIP_SYNC=1 GGML_SIM_DEVICES=1 "$build/bin/llama-perplexity" -m "$model" -f "$corpus" -c 1024 -b 1024 \
    -ub 512 --chunks 1 -t 2 -nr --fit off -ngl 2 > "$out/negative-skip-sync.log" 2>&1
echo "negative control (GGML_SIM_DEBUG_SKIP_SYNC=1, -ngl 2): $(grep -c "WARNING: ThreadSanitizer" "$out/negative-skip-sync.log") reports (expected: some)"
