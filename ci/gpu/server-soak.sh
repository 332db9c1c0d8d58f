#!/usr/bin/env bash
# llama-server with the expert cache under concurrent load on CUDA (pyllama_moe/harness/server_soak.py, the verb server-soak):
# 4 slots, every expert on the host (-cmoe), the cache at a quarter of the expert bytes, a synthetic LoRA adapter, on
# the Qwen3-30B-A3B shape cut to 8 layers (Q4_0, routing skew 0.5, 3 GB; 648 MiB of cache give 31-32 of 128 slots a
# layer: decode steps of up to 3 sequences read every layer's banks, a step of 4 leaves them in one layer, as a SIM
# start of the same command logs). Steps, each its own device call (results in $OUT):
#   build     the patched CUDA build of llama-server alone (-j 16) while the model is written (~6 min)
#   soak      SOAK_S (180) seconds or 3000 requests from 6 clients, prompts of 1 to 4000 tokens, probe rounds every
#             30 s; then the probe set against every weight on the GPU (~4 min)
#   memcheck  the same under compute-sanitizer memcheck, shorter: 4 clients, 150 s or 200 requests, prompts of up to
#             512 tokens; memory growth is not checked there (the sanitizer owns the allocations) (~4 min)
# Carry .work/archives (a patched archive packed after tools/ui's CMake files were kept) and .whl. The soak's exit
# status is the driver's: 0 when every check passed (errors 0, server alive and clean at exit, probe rounds
# byte-identical, memory flat, the all-on-GPU probes equal where docs/cache-paths.md says they must be).
# Arguments after the step go to server-soak last (a repeated option's last value wins), and SERVER_BUILD (a build
# folder) and SOAK_MODEL replace the build and the model: so the steps also run on the CPU machine against a SIM build.
set -uo pipefail
step=${1:?usage: server-soak.sh build|soak|memcheck [server-soak arguments]}
shift
. "$(dirname "$0")/common.sh"
SOAK_MODEL=${SOAK_MODEL:-$PYLLAMA_MOE_HOME/soak-qwen3-30b-a3b-8l-q4_0-skew0.5.gguf}
WORK=/tmp/plm-server-soak

server_build() { # the build folder; builds it first where it is missing (the build step's command, reused)
    [ -n "${SERVER_BUILD:-}" ] && { echo "$SERVER_BUILD"; return 0; }
    # the server is configured in every build: this adds its target to the patched build's folder
    python3 -m pyllama_moe build --backend cuda --variant patched --archive $A/llama.cpp-patched.tar.gz -j 16 \
        --targets llama-server
}

soak_model() { # written once
    mkdir -p "$PYLLAMA_MOE_HOME"
    [ -f "$SOAK_MODEL" ] && return 0
    python3 -m pyllama_moe synth --preset qwen3-30b-a3b --layers 8 --type q4_0 --seed 7 --skew 0.5 \
        -o "$SOAK_MODEL.partial" --quiet < /dev/null && mv "$SOAK_MODEL.partial" "$SOAK_MODEL"
}

soak() { # $1: name (a folder of $WORK), $2: seconds at most, then server-soak arguments; the logs come back as one
    # archive (a device call returns only a few files), the summary and the driver's log as they are
    local name=$1 limit=$2; shift 2
    local bin
    bin=$(server_build 2> "$OUT/build-$name.log" | tail -1)/bin || { echo "no llama-server build"; return 1; }
    soak_model || { echo "the soak model was not written"; return 1; }
    rm -rf "$WORK/$name"
    timeout "$limit" python3 -m pyllama_moe server-soak --server "$bin" --model "$SOAK_MODEL" --out "$WORK/$name" "$@"
    local rc=$?
    echo "server-soak $name: exit $rc"
    cp "$WORK/$name/summary.json" "$OUT/$name-summary.json" 2> /dev/null
    cp "$WORK/$name/soak.log" "$OUT/$name-soak.log" 2> /dev/null
    tar czf "$OUT/$name-logs.tgz" -C "$WORK/$name" --exclude lora.gguf --exclude slots . 2> /dev/null
    return $rc
}

case $step in
build)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    soak_model > "$OUT/model.log" 2>&1 &
    model_pid=$!
    server_build > "$OUT/build.log" 2>&1
    rc=$?
    grep -E "build .*/cuda: done|error" "$OUT/build.log" | tail -5
    wait $model_pid || { echo "the soak model was not written"; tail -5 "$OUT/model.log"; exit 1; }
    ls -l "$SOAK_MODEL"
    [ $rc = 0 ] || { echo "build failed"; tail -30 "$OUT/build.log"; exit 1; }
    ;;
soak)
    soak soak 480 --slots 4 --clients 6 --seconds "${SOAK_S:-180}" --max-requests 3000 --pause-every 30 \
        --max-prompt 4000 --threads 8 --compare-all-gpu "$@"
    rc=$?
    ;;
memcheck)
    soak memcheck 440 --slots 4 --clients 4 --seconds "${MEMCHECK_S:-150}" --max-requests 200 --pause-every 50 \
        --max-prompt 512 --max-predict 16 --threads 8 --startup-timeout 240 --request-timeout 240 \
        --wrapper "compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9" "$@"
    rc=$?
    grep -h "ERROR SUMMARY" "$WORK/memcheck/server.log" 2> /dev/null | tail -1
    ;;
*)
    echo "unknown step $step: use build|soak|memcheck"; exit 2
    ;;
esac
echo "step $step: $((SECONDS - T0)) s"
exit ${rc:-0}
