#!/usr/bin/env bash
# One device session over the GPU steps of the open issues, in the order their results are most needed, on one
# pair of CUDA builds with every default target (so the identity cells, the sanitizer and the benchmarks share
# them). STEPS lists SCRIPT:STEP pairs of the scripts beside this one; the default is what is still to run after
# the fifth session (results/gpu-bench-stats.md), most needed first:
#   experts-at-scale.sh:minbatch         issue 11 item 4: the skew-0.5 half of the min-batch sweep (skew 0 ran in the
#                                        fifth session: MINBATCH_SKEWS=0.5, and its file beside it in the picture)
#   prefetch.sh:identity                 issue 11: the CUDA identity cells, now with a pin budget that pins part
#                                        (cuda/qwen3moe/cpu-moe/ub512/mmap/pin-budget)
#   experts-at-scale.sh:pin              issue 11 item 1: a partial pin of the tiny and the 30B model, greedy text
#                                        equal to the run with pinning off
#   cache.sh:identity                    issue 12: the expert cache's CUDA cells against master all on the GPU, and
#                                        memcheck over a decode that evicts every token
#   cache.sh:tg                          issue 12: tg128 at skew 0.5 with the cache at half the expert bytes against
#                                        master, and the hit rate
# Done in the fifth session (add them to STEPS to rerun): bench-stats.sh:rows-mmap, prefetch.sh:sanitizer-pieces,
# prefetch.sh:staging, experts-at-scale.sh:share; in the fourth: bench-stats.sh:target planted self and the pp4096
# rows of bench-stats.sh:rows; in the third: prefetch.sh:sanitizer, bench-stats.sh:rows-short.
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
    export MINBATCH_SKEWS=${MINBATCH_SKEWS:-0.5} MINBATCH_EARLIER=${MINBATCH_EARLIER:-results/minbatch-s5-skew0.json}
    for s in ${STEPS:-experts-at-scale.sh:minbatch prefetch.sh:identity experts-at-scale.sh:pin cache.sh:identity cache.sh:tg}; do
        echo "== $s ($((SECONDS - T0)) s)"
        bash "$here/${s%%:*}" "${s#*:}"
    done
    ;;
*)
    echo "unknown step $step: use all|follow"; exit 2
    ;;
esac
