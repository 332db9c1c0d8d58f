#!/usr/bin/env bash
# One device session over the GPU steps of the open issues, in the order their results are most needed, on one
# pair of CUDA builds with every default target (so the identity cells, the sanitizer and the benchmarks share
# them). STEPS lists SCRIPT:STEP pairs of the scripts beside this one; the default is what is still to run after
# the twelfth session (issue 13 is done: its last row, the whole cache with -lm mmap, ran by whole-mmap.sh):
#   seed.sh:check                        issue 14: the cache's CUDA cells (all seed but one), the seed debug check
#   seed.sh:first                        issue 14: the first 16 tokens after a 4096-token prompt, seeding on and off
# Done in the twelfth session: both (10 cells passed, 0 seeded slots differ; first 16 / steady 0.904 [0.893, 0.916]
# seeded, 0.737 unseeded, ROUNDS=8: results/moe-cache-seed.md); rerun seed.sh:first after a change to the first tokens.
# Done in the eleventh session: cache.sh:tg-whole (filled whole: 1.013 [0.990, 1.038] of all on the GPU, -lm none),
# cache.sh:identity (9 passed), device-lookup.sh:tg-skew0 (1.203 [1.090, 1.326] of master's -ncmoe 24, -lm none).
# Done in the tenth session: device-lookup.sh:ops (memcheck of the lookup only, OPS=MOE_CACHE_LOOKUP
# OPS_TOOLS=memcheck: 0 errors), device-lookup.sh:tg-static (hit rates per layer beside the rows).
# The skew 0.5 model is written while the builds run (the steps of both scripts use it).
# Done in the ninth session (add them to STEPS to rerun): cache.sh:pp-off (issue 12's last row), cache.sh:identity
# (9 CUDA cells, decode on the device), device-lookup.sh:syncs, device-lookup.sh:tg (paced 3.548 [3.316, 3.796]);
# in the eighth: cache.sh:identity (8 CUDA cells with the whole ones),
# cache.sh:pp-32k, cache.sh:pp-master, bench-stats.sh:rows-mmap; in the seventh: cache.sh:identity, cache.sh:pp,
# cache.sh:tg; in the sixth: experts-at-scale.sh:minbatch (skew 0.5),
# prefetch.sh:identity, experts-at-scale.sh:pin, cache.sh:identity and cache.sh:tg before the prompt path; in the
# fifth: bench-stats.sh:rows-mmap, prefetch.sh:sanitizer-pieces, prefetch.sh:staging, experts-at-scale.sh:share; in
# the fourth: bench-stats.sh:target planted self and the pp4096 rows of bench-stats.sh:rows; in the third:
# prefetch.sh:sanitizer, bench-stats.sh:rows-short.
# Prepare on the CPU machine as prefetch.sh says, then repeat, as device calls carrying .work/archives and .whl,
#   FOLLOW_S=560 bash ci/gpu/open-issues.sh follow
# until it prints "pipeline finished". Results land in $OUT (or ./gpu-out), archived as pipeline.tgz.
set -uo pipefail
step=${1:?usage: open-issues.sh all|follow}
. "$(dirname "$0")/common.sh"
here=$(dirname "$0")
case $step in
follow)
    follow_pipeline "$0" /tmp/plm-open-issues 60
    ;;
all)
    mkdir -p "$PYLLAMA_MOE_HOME"
    skew_model > /dev/null 2> "$OUT/skew-model.log" &
    skew_pid=$!
    BUILD_WAIT_S=1200 bash "$here/prefetch.sh" build || exit 1
    wait $skew_pid || { echo "the skew 0.5 model was not written"; cat "$OUT/skew-model.log"; exit 1; }
    for s in ${STEPS:-seed.sh:check seed.sh:first}; do
        echo "== $s ($((SECONDS - T0)) s)"
        bash "$here/${s%%:*}" "${s#*:}"
    done
    ;;
*)
    echo "unknown step $step: use all|follow"; exit 2
    ;;
esac
