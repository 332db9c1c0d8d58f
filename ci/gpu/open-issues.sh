#!/usr/bin/env bash
# One device session over the GPU steps of the open issues, in the order their results are most needed, on one
# pair of CUDA builds with every default target (so the identity cells, the sanitizer and the benchmarks share
# them). STEPS lists SCRIPT:STEP pairs of the scripts beside this one; the default is what is still to run after
# the eighth session (results/moe-cache-prompt-gpu.md), most needed first:
#   cache.sh:pp-off                      issue 12: no prompt row slower with the cache on: pp512/pp4096 at ub 512
#                                        and 2048, both load modes, against the cache off (the eighth session
#                                        measured one round: every row 1.28-1.40x, no interval yet)
#   device-lookup.sh:ops                 issue 13: test-backend-ops of the lookup and fill ops on CUDA, memcheck and
#                                        racecheck
#   cache.sh:identity                    issues 12-13: the cache's CUDA cells, now decoding on the device (and the
#                                        moe-cache-host cell with the host-side plan)
#   device-lookup.sh:syncs               issue 13: host synchronizations per token, device lookup against all on GPU
#   device-lookup.sh:tg                  issue 13: tg128 cache half against master, both load modes
#   cache.sh:tg-whole                    issue 13: tg128 with every expert cached against all on the GPU
# Done in the eighth session (add them to STEPS to rerun): cache.sh:identity (8 CUDA cells with the whole ones),
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
    BUILD_WAIT_S=1200 bash "$here/prefetch.sh" build || exit 1
    for s in ${STEPS:-cache.sh:pp-off device-lookup.sh:ops cache.sh:identity device-lookup.sh:syncs device-lookup.sh:tg cache.sh:tg-whole}; do
        echo "== $s ($((SECONDS - T0)) s)"
        bash "$here/${s%%:*}" "${s#*:}"
    done
    ;;
*)
    echo "unknown step $step: use all|follow"; exit 2
    ;;
esac
