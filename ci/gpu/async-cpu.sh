#!/usr/bin/env bash
# Asynchronous CPU splits (--sched-async-cpu, docs/async-cpu.md) on the GPU machine. Prepare on the CPU machine as
# prefetch.sh says; after `run.sh build` (or build-patched for the steps of the patched build alone), run.sh names
# them async-STEP:
#   roundtrip  llama-moe-roundtrip: one layer's CPU round trip (download, CPU experts on plain Q4_0 host weights,
#              upload, the worker's hand-off) for 1, 4, 8 and 16 tokens, the GPU idle and busy, at -t cores-1, with
#              the link's and the CPU's throughput and one small GPU split's cost
#   bench      the patched build against itself, the worker off (baseline) and on (candidate), in one interleaved
#              run: tg128 and pp512 at -ncmoe 24 and 48, then tg128 and pp512 with the cache at a quarter and half of
#              the expert bytes (-ncmoe 48); target: every ratio's interval reaches 1.0 or lies above it
#   identity   compare --subset async-cpu --backend cuda: the worker's CUDA cells against master, byte for byte (the
#              shared-expert model's split cut included), the cache's at 1, 4 and 12 sequences by path
#   overlap    a shared-expert model (glm4moe, the 30B-A3B expert shape, 16 layers, experts on the host): tg128 with the worker off and on; its
#              shared expert runs on the GPU beside the routed experts on the CPU
#   power      the divergence contract's power on CUDA: the stand-in (-ncmoe 2, qwen3moe) with a fault planted in
#              layer 2's expert 3 at eps 0.005 .. 0.05, each a cell that passes when the contract flags it; the
#              smallest flagged eps beside the yardstick's own divergence (the unperturbed stand-in first)
set -uo pipefail
step=${1:?usage: async-cpu.sh roundtrip|bench|identity|overlap|power}
. "$(dirname "$0")/common.sh"
THREADS=$(( $(nproc) - 1 ))

case $step in
roundtrip)
    wait_builds 600 || exit 1
    P=$(patched_bin)
    timeout 300 "$P/llama-moe-roundtrip" -t $THREADS --reps 50 > "$OUT/roundtrip.jsonl" 2> "$OUT/roundtrip.txt"
    echo "llama-moe-roundtrip: exit $?"
    cat "$OUT/roundtrip.txt"
    ;;
bench)
    wait_builds 600 || exit 1
    M=$(skew_model) || exit 1
    BENCH_MODEL=$M bench 270 --baseline patched --candidate patched --baseline-env GGML_SCHED_ASYNC_CPU=0 \
        --candidate-env GGML_SCHED_ASYNC_CPU=1 --pin-threads --reps 3 --discard 1 --rounds 4 --max-seconds 240 \
        --json "$OUT/async-ncmoe.json" -- -p 512 -n 128 -ngl 99 -ncmoe 24,48 -lm none 2>&1 | tee "$OUT/async-ncmoe.txt"
    # one bench per cache budget: the bench pairs rows by the fields master reports, which -mcm is not
    for mcm in 3900 7800; do
        BENCH_MODEL=$M bench 150 --baseline patched --candidate patched --baseline-env GGML_SCHED_ASYNC_CPU=0 \
            --candidate-env GGML_SCHED_ASYNC_CPU=1 --pin-threads --reps 3 --discard 1 --rounds 4 --max-seconds 120 \
            --json "$OUT/async-cache-$mcm.json" -- -p 512 -n 128 -ngl 99 -ncmoe 48 -mcm $mcm -lm none \
            2>&1 | tee "$OUT/async-cache-$mcm.txt"
    done
    ;;
identity)
    wait_builds 600 || exit 1
    timeout 420 python3 -m pyllama_moe compare --subset async-cpu --backend cuda --archive-dir $A \
        --json "$OUT/identity-async-cpu.json" 2>&1 | tee "$OUT/identity-async-cpu.txt"
    ;;
overlap)
    wait_builds 600 || exit 1
    G=$PYLLAMA_MOE_HOME/bench-glm-shape-q4_0.gguf
    # the Qwen3-30B-A3B expert shape as glm4moe with a shared expert and a dense first layer, 16 layers (5.6 GB)
    [ -f "$G" ] || python3 -m pyllama_moe synth --preset qwen3-30b-a3b --arch glm4moe --shared-experts 1 --dense-layers 1 \
        --layers 16 --type q4_0 --seed 5 -o "$G" --quiet < /dev/null || { echo "synth of $G failed"; exit 1; }
    BENCH_MODEL=$G bench 180 --baseline patched --candidate patched --baseline-env GGML_SCHED_ASYNC_CPU=0 \
        --candidate-env GGML_SCHED_ASYNC_CPU=1 --pin-threads --reps 3 --discard 1 --rounds 4 --max-seconds 150 \
        --json "$OUT/async-overlap.json" -- -p 0 -n 128 -ngl 99 -ncmoe 48 -lm none 2>&1 | tee "$OUT/async-overlap.txt"
    ;;
power)
    wait_builds 600 || exit 1
    # the matrix with the sweep's cells added: each the CUDA stand-in with one fault, expecting the contract to flag it
    python3 - > /tmp/power-matrix.toml <<'PY'
import pathlib
text = pathlib.Path("ci/matrix.toml").read_text()
for eps in ("0.005", "0.01", "0.02", "0.05"):
    text += f'''
[[controls]]
name = "power/cuda-eps-{eps}"
model = "qwen3moe"
offload = "ncmoe-2"
baseline_offload = "all"
yardstick = "cpu-moe"
backend = "cuda"
expect = "divergence-flagged"
fault = "layer:2,expert:3,eps:{eps}"
'''
print(text)
PY
    timeout 420 python3 -m pyllama_moe compare --matrix /tmp/power-matrix.toml --subset divergence --backend cuda \
        --archive-dir $A --json "$OUT/power.json" 2>&1 | tee "$OUT/power.txt"
    ;;
*)
    echo "unknown step $step: use roundtrip|bench|identity|overlap|power"; exit 2
    ;;
esac
echo "step $step: $((SECONDS - T0)) s"
