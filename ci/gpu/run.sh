#!/usr/bin/env bash
# The GPU machine's entry point: `ci/gpu/run.sh STEP [STEP...]` sources common.sh once, runs the named steps in
# order (each writes into $OUT/STEP), prints each step's time and stops at the first that fails, with its exit
# status (KEEP_GOING=1: runs the rest, then exits with it). A VAR=VALUE argument sets the environment of the steps
# after it (`run.sh ROUNDS=4 fit-bench`).
#   run.sh --list                      every step with what it does
#   FOLLOW_S=560 run.sh --follow STEP...   starts the steps detached once (they outlive the device call), then
#                                      follows them; repeat it until it prints "pipeline finished" (results in
#                                      $OUT/pipeline.tgz)
# Each step is a function here or SCRIPT STEP of a script beside this one; those stay runnable alone
# (`bash ci/gpu/cache.sh tg-series`). Prepare on the CPU machine as ci/gpu/prefetch.sh says (the pruned archives
# in .work/archives, the wheels in .whl) and carry both into each device call.
set -uo pipefail
here=$(dirname "$0")

steps() { # name, then SCRIPT STEP or :FUNCTION, then the description
    cat <<'EOF'
build               prefetch.sh build         master and patched CUDA builds (default targets, detached) and the 30B bench model
build-skew          :build_skew               master and patched CUDA builds (default targets, detached) and the skew 0.5 model
build-patched       :build_patched            the patched CUDA build alone (-j 16) and the skew 0.5 model; later steps wait for it alone
identity            prefetch.sh identity      identity cells of subsets gpu, gpu-variants and layer-major against master, host syncs per token
sanitizer           prefetch.sh sanitizer     compute-sanitizer memcheck over a prefetched prompt, debug poison off and on
sanitizer-pieces    prefetch.sh sanitizer-pieces  the same with a 1 MiB staging ring: every upload in two pieces
foundation-check    foundation.sh check       identity subset gpu and an A/B pp512/tg128 llama-bench, after build
prefetch-bench      prefetch.sh bench         A/B pp4096 ub 2048/4096, mmap against -lm none, pp512 and tg128
prefetch-staging    prefetch.sh staging       the staging budget sweep, and 2 GiB expert tensors under a 2900 MiB budget
prefetch-depth      prefetch.sh depth         the lookahead: prefetch off and on at depths 2-4 (patched llama-bench alone)
cache-identity      cache.sh identity         the expert cache's CUDA cells, parallel sequences, memcheck, a planted refusal
cache-pp            cache.sh pp               the cache's prompt rows: pp-master, pp-off and pp-32k in turn
cache-pp-master     cache.sh pp-master        pp4096 ub 512, cache at a quarter of the expert bytes, against master
cache-pp-off        cache.sh pp-off           pp512 and pp4096 at ub 512 and 2048 with the cache against the cache off
cache-pp-32k        cache.sh pp-32k           a 32k-token prompt, every expert cached, as a share of all on the GPU
cache-series-build  cache.sh series-build     llama-bench builds of this series and the one before (BEFORE_ARCHIVE)
cache-tg-series     cache.sh tg-series        tg128 at CACHE_MIB, this series against the one before: no row slower
cache-tg            cache.sh tg               tg128, cache at half the expert bytes, against master, paced; the hit rate
cache-tg-whole      cache.sh tg-whole         tg128 with every expert cached as a share of all on the GPU (-lm none)
cache-tg-whole-mmap cache.sh tg-whole-mmap    the same comparison with -lm mmap
cache-cost          cache.sh cost             the cache's own cost: probes and caches against all on the GPU, kernel times (ncu)
async-roundtrip     async-cpu.sh roundtrip    one layer's CPU round trip per token count, the GPU idle and busy (llama-moe-roundtrip)
async-bench         async-cpu.sh bench        tg128 and pp512 with the CPU worker off and on: -ncmoe 24/48, the cache at a quarter and half
async-identity      async-cpu.sh identity     the CPU worker's CUDA identity cells against master
async-overlap       async-cpu.sh overlap      a shared-expert model with experts on the host: tg128 with the worker off and on
async-power         async-cpu.sh power        the divergence contract's power on CUDA: the smallest planted fault it flags
hot-cold-ops        hot-cold.sh ops           the lookup's policy cases, the fills and the masked ids on CUDA0, then under memcheck
hot-cold-policy     hot-cold.sh policy        tg128: each miss policy against upload at a quarter and half cache; -sac 1 against 0 under cpu
hot-cold-master     hot-cold.sh master        tg128: the cache with POLICY (default cpu) against master -cmoe, per budget
hot-cold-targets    hot-cold.sh targets       the miss policies' judged rows in short rounds: pageable and pinned, decode and 8-16 token graphs
hot-cold-parallel   hot-cold.sh parallel      graphs of 4-16 tokens under upload and cpu against master -cmoe, per budget
layer-major-pp32k   layer-major.sh pp32k      pp32768 ub 512 and 2048, experts on the host: layer-major against ubatch order and all on the GPU
layer-major-pp4k    layer-major.sh pp4k       pp4096 ub 512 and 2048: the same
layer-major-pageable layer-major.sh pageable  pp32768 ub 2048 with pageable experts: the same
layer-major-pageable-512 layer-major.sh pageable-512  pp32768 ub 512 with pageable experts: the same
layer-major-staged  layer-major.sh staged     pp4096 and pp32768 ub 512: groups staged ahead against one group
layer-major-cache   layer-major.sh cache      pp32768 ub 2048, pageable, a quarter cache: layer-major against ubatch order
layer-major-times   layer-major.sh times      each group's host times and uploads (LLAMA_LAYER_MAJOR_DEBUG_TIMES=1), by prompt, ubatch and groups
layer-major-queueing layer-major.sh queueing  a small upload on a second queue behind a group's stage (the copy probe's --small)
layer-major-short   layer-major.sh short      pp512 and tg128 (one ubatch, decode): layer-major on against off
lookup-ops          device-lookup.sh ops      test-backend-ops of the lookup and fill ops, under memcheck and racecheck
masked-ids          device-lookup.sh masked-ids  test-backend-ops of MUL_MAT_ID/ADD_ID with ids of -1 on CUDA0 (each kernel, fusions), under memcheck
lookup-syncs        device-lookup.sh syncs    host syncs per token: cache on the device, host-side plan, all on the GPU
lookup-tg           device-lookup.sh tg       tg128 against master, paced, then against master's -ncmoe 24 rows
lookup-tg-static    device-lookup.sh tg-static  tg128 against master's -ncmoe 24 rows alone, both load modes
lookup-tg-skew0     device-lookup.sh tg-skew0   the same on the uniform-routing model
seed-check          seed.sh check             the cache's CUDA cells and the seed debug check (tiny and 30B models)
seed-first          seed.sh first             the first 16 tokens after a 4096-token prompt, seeding on and off
seed-first-times    seed.sh first-times       where the first tokens' time goes: per-token and per-step host times
profile             profile.sh profile        a saved expert cache profile against seeding, first 16 tokens
profile-sweep       profile.sh sweep          cache budgets (-mcm): hit rate per layer and bytes over PCIe per token
fit-identity        fit.sh identity           --fit with the cache under a planted allocation: same log-probs and text
fit-bench           fit.sh bench              --fit rows under a planted allocation against -ncmoe N, least free memory
stats-build         bench-stats.sh build      llama-bench builds (and the copy probe) and the 30B model, detached
stats-study         bench-stats.sh study      where decode noise comes from: master against itself by thread setting
stats-target        bench-stats.sh target     tg128 master vs patched, paced until the interval is within +/-3%
stats-planted       bench-stats.sh planted    a planted 5% slowdown the interval must see
stats-self          bench-stats.sh self       master against master: the interval must contain 1.0
stats-rows          bench-stats.sh rows       pp4096 prefetch rows with intervals, against all on the GPU, then rows-mmap
stats-rows-mmap     bench-stats.sh rows-mmap  pp4096 ub 2048, mmap against -lm none
stats-rows-short    bench-stats.sh rows-short pp512 and tg128 with host experts against all on the GPU
scale-minbatch      experts-at-scale.sh minbatch  where uploading whole experts ahead beats routed copies, by ubatch
scale-share         experts-at-scale.sh share     pp4096 ub 4096 as a share of all on the GPU, 8 rounds
scale-pin           experts-at-scale.sh pin       a pin budget below the experts pins part; the same greedy text
soak-build          server-soak.sh build      the patched llama-server build and the 8-layer soak model
soak                server-soak.sh soak       llama-server under concurrent load with the cache, then probes against all on the GPU
soak-memcheck       server-soak.sh memcheck   the same under compute-sanitizer memcheck, shorter
readme-quickstart   readme.sh quickstart     the README's GPU quick start as written (its build from the patched archive)
readme-python       readme.sh python         the README's Python example, in the quick start's folder
EOF
}

build_skew() { # both builds while the skew 0.5 model (the hot/cold and cache steps' model) is written
    start_builds
    skew_model > /dev/null || { echo "the skew 0.5 model was not written"; return 1; }
    echo "== skew 0.5 model written ($((SECONDS - T0)) s)"
    wait_builds ${BUILD_WAIT_S:-560}
}

build_patched() { # later steps of this run.sh wait for the patched build alone (another call: BUILD_VARIANTS=patched)
    build_patched_with_skew_model && export BUILD_VARIANTS=patched
}

case ${1:-} in
''|-h|--help)
    echo "usage: run.sh STEP [STEP...] | --follow STEP... | --list"; exit 2 ;;
--list)
    steps | while read -r name script arg desc; do
        [ "${script:0:1}" = : ] && desc="$arg $desc"
        printf '%-20s %s\n' "$name" "$desc"
    done
    exit 0 ;;
esac
follow=
[ "$1" = --follow ] && { follow=1; shift; }
[ $# -gt 0 ] || { echo "usage: run.sh --follow STEP..."; exit 2; }
for s in "$@"; do # every name known before anything runs
    [[ $s == *=* ]] && continue
    steps | awk -v s="$s" '$1 == s { found = 1 } END { exit !found }' || { echo "unknown step $s (run.sh --list)"; exit 2; }
done

. "$here/common.sh"
if [ -n "$follow" ]; then
    # detached, nothing stops the builds at one call's limit: wait for them as long as they take
    follow_pipeline "$0" /tmp/plm-run 60 BUILD_WAIT_S=${BUILD_WAIT_S:-1200} "$@"
    exit "$(cat /tmp/plm-run/pipeline.rc 2> /dev/null || echo 0)"  # the steps' status once they finished
fi
n=0
for s in "$@"; do
    if [[ $s == *=* ]]; then
        export "${s?}"
        continue
    fi
    read -r _ script arg _ < <(steps | awk -v s="$s" '$1 == s')
    start=$SECONDS
    echo "== $s ($((SECONDS - T0)) s)"
    top=$OUT
    export OUT=$top/$s
    mkdir -p "$OUT"
    if [ "${script:0:1}" = : ]; then
        "${script:1}"
    else
        bash "$here/$script" "$arg"
    fi
    rc=$?
    export OUT=$top
    echo "== $s: exit $rc, $((SECONDS - start)) s"
    if [ $rc != 0 ]; then
        # KEEP_GOING=1 (before the steps) runs the later steps anyway, so a failed check costs no benchmark
        [ "${KEEP_GOING:-0}" = 1 ] || exit $rc
        failed="${failed:-} $s"
        first_rc=${first_rc:-$rc}
        continue
    fi
    n=$((n + 1))
done
if [ -n "${failed:-}" ]; then
    echo "== $n steps passed; failed:$failed, $((SECONDS - T0)) s"
    exit "$first_rc"
fi
echo "== all $n steps passed, $((SECONDS - T0)) s"
