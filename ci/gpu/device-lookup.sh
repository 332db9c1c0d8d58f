#!/usr/bin/env bash
# The expert cache's decode looked up on the device, on the GPU machine (GGML_OP_MOE_CACHE_LOOKUP and
# GGML_OP_MOE_CACHE_FILL: no routing read back, one CUDA graph per token). Prepare on the CPU machine as prefetch.sh
# says; the steps run after `prefetch.sh build` (ci/gpu/run.sh names them lookup-STEP):
#   ops        test-backend-ops of both ops on CUDA0 against the CPU (exact), then the same under compute-sanitizer
#              memcheck and racecheck (memcheck without API error reports: between test cases of other graph shapes
#              ggml-cuda's cudaGraphExecUpdate fails by design and it re-instantiates, 8 such reports a run;
#              memory errors still fail the run)
#   masked-ids MUL_MAT_ID and ADD_ID with ids of -1 (ggml_mul_mat_id_masked, the hot/cold split's merge) on CUDA0
#              against the CPU: the masked cases by kernel (MMVQ, MMQ, MMF, MMVF, the generic path) and their
#              fusions, each masked row exactly +0.0, and the plain ops, whose kernels the masking touched; then the
#              same under compute-sanitizer memcheck (no -1 read or indexed out of bounds). Fails where either fails
#   syncs      host synchronizations per decoded token with the cache on the device, with the host-side plan
#              (LLAMA_MOE_CACHE_DEVICE=0) and with every weight on the GPU (target: device <= all-on-GPU + 1)
#   tg         tg128, skew 0.5, cache at half the expert bytes against master, paced (target: lower end >= 2.5); then
#              both load modes with master's static -ncmoe 24 rows in the same rounds (--limit-from baseline: faster),
#              with the hit rate per layer beside each row (the paced tool reports none)
#   tg-static  that second run alone
#   tg-skew0   the second run on the skew-0 model (uniform routing: reported against -ncmoe 24, no target)
# The cells (cache.sh identity) take the device path by default now; the moe-cache-host cell keeps the host plan.
set -uo pipefail
step=${1:?usage: device-lookup.sh ops|masked-ids|syncs|tg|tg-static|tg-skew0}
. "$(dirname "$0")/common.sh"
CACHE_MIB=${CACHE_MIB:-7800}

case $step in
ops)
    wait_builds 300 || exit 1
    P=$(patched_bin)
    # OPS / OPS_TOOLS narrow a rerun (e.g. OPS=MOE_CACHE_LOOKUP OPS_TOOLS=memcheck: one op, one tool)
    for op in ${OPS:-MOE_CACHE_LOOKUP MOE_CACHE_FILL}; do
        timeout 120 "$P/test-backend-ops" -b CUDA0 -o $op 2>&1 | tee "$OUT/ops-$op.txt" | tail -3
        for tool in ${OPS_TOOLS:-memcheck racecheck}; do
            api=(); [ $tool = memcheck ] && api=(--report-api-errors no)
            timeout 300 compute-sanitizer --tool $tool "${api[@]}" --error-exitcode 9 "$P/test-backend-ops" -b CUDA0 -o $op \
                > "$OUT/ops-$op-$tool.txt" 2>&1
            echo "compute-sanitizer $tool $op: exit $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|tests passed" "$OUT/ops-$op-$tool.txt" | tail -2
        done
    done
    ;;
masked-ids)
    wait_builds 300 || exit 1
    P=$(patched_bin)
    # OPS narrows a rerun (e.g. OPS=MUL_MAT_ID_MASKED); the plain MUL_MAT_ID cases take most of memcheck's time
    ops=${OPS:-MUL_MAT_ID_MASKED,ADD_ID_MASKED,MUL_MAT_VEC_FUSION_MASKED,MUL_MAT_ID,ADD_ID}
    timeout 300 "$P/test-backend-ops" -b CUDA0 -o "$ops" > "$OUT/masked-ids.txt" 2>&1
    rc=$?
    echo "test-backend-ops $ops: exit $rc"; grep -E "tests passed|FAIL" "$OUT/masked-ids.txt" | tail -5
    timeout ${MEMCHECK_S:-540} compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
        "$P/test-backend-ops" -b CUDA0 -o "$ops" > "$OUT/masked-ids-memcheck.txt" 2>&1
    rc_memcheck=$?
    echo "compute-sanitizer memcheck $ops: exit $rc_memcheck"
    grep -E "ERROR SUMMARY|tests passed" "$OUT/masked-ids-memcheck.txt" | tail -2
    [ $rc = 0 ] && [ $rc_memcheck = 0 ] || exit 1
    ;;
syncs)
    wait_builds 300 || exit 1
    timeout 400 python3 - "$MODEL" <<'PY' 2>&1 | tee "$OUT/device-syncs.txt"
import pathlib, sys
from pyllama_moe.build.builder import resolve
from pyllama_moe.harness import runner
from pyllama_moe.source import packs
archive = pathlib.Path(".work/archives/llama.cpp-patched.tar.gz")
build, src = resolve("patched", "cuda", archive=archive), packs.archive_source(archive, "patched")
tokens = [(i * 7919) % 4000 + 16 for i in range(600)]
print("| run | tokens | host syncs / token | splits / token |")
print("|---|---:|---:|---:|")
texts = {}
for name, cpu_moe, env in (("cache on the device", True, {"LLAMA_MOE_CACHE_MIB": "7800"}),
                           ("cache, host-side plan", True, {"LLAMA_MOE_CACHE_MIB": "7800", "LLAMA_MOE_CACHE_DEVICE": "0"}),
                           ("all on the GPU", False, {})):
    spec = runner.RunSpec(model=pathlib.Path(sys.argv[1]), tokens=tokens, n_ubatch=512, cpu_moe=cpu_moe, generate=64,
                          want_logits=False, stats=True, env=env)
    res = runner.run(build, src, spec)
    gen = res.stats["generate"]
    n = max(gen["n_graph_computes"], 1)
    texts[name] = res.generated
    print(f"| {name} | {gen['n_graph_computes']} | {gen['n_host_syncs'] / n:.2f} | {gen['n_splits'] / n:.2f} |")
print("greedy tokens identical:", len(set(map(tuple, texts.values()))) == 1)
PY
    ;;
tg|tg-static|tg-skew0)
    wait_builds 60 || exit 1
    if [ "$step" = tg-skew0 ]; then
        M=$MODEL
    else
        M=$(skew_model) || exit 1
    fi
    if [ "$step" = tg ]; then
        # against master, paced (both builds loaded, repetitions alternating: decode rows drift between processes)
        BENCH_MODEL=$M bench 360 --paced --pin-threads --warmup-rounds 1 --reps 4 --discard 1 --rounds 4 --max-seconds 300 \
            --candidate-env LLAMA_MOE_CACHE_MIB=$CACHE_MIB --json "$OUT/device-$step.json" \
            -- -p 0 -n 128 -ngl 99 -ncmoe 48 -lm none 2>&1 | tee "$OUT/device-$step.txt"
    fi
    # both load modes, and the cache's -ncmoe 48 rows against master's static -ncmoe 24 (the same bytes on the GPU
    # placed by layer) in the same rounds (--limit-from baseline; a paced run measures one test only). A round is
    # ~100 s: 6 would run past the step's limit. No warm-up round: the model was just written (in the page cache)
    # and a warm-up round ran as fast as the measured ones
    BENCH_MODEL=$M bench 480 --pin-threads --warmup-rounds 0 --reps 3 --discard 1 --rounds 4 --max-seconds 380 \
        --candidate-env LLAMA_MOE_CACHE_MIB=$CACHE_MIB --limit-row n_cpu_moe=24 --limit-from baseline \
        --json "$OUT/device-${step%-static}-static.json" -- -p 0 -n 128 -ngl 99 -ncmoe 48,24 -lm none,mmap 2>&1 \
        | tee "$OUT/device-${step%-static}-static.txt"
    ;;
*)
    echo "unknown step $step: use ops|masked-ids|syncs|tg|tg-static|tg-skew0"; exit 2
    ;;
esac
echo "step $step: $((SECONDS - T0)) s"
