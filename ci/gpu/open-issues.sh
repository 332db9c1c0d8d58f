#!/usr/bin/env bash
# One device session over the GPU steps of the open issues, in the order their results are most needed, on one
# pair of CUDA builds with every default target (so the identity cells, the sanitizer and the benchmarks share
# them). STEPS lists SCRIPT:STEP pairs of the scripts beside this one; the default is what is still to run after
# the fourth session (results/gpu-bench-stats.md), most needed first:
#   bench-stats.sh:rows-mmap             issues 9 and 10: the mmap row with intervals, the last prefetch row
#   prefetch.sh:identity                 issue 11: the CUDA identity cells, now with the split GGUF model, the
#                                        partial pin and the 2 MiB staging budget
#   prefetch.sh:sanitizer-pieces         issue 11: memcheck over a prompt whose uploads go in pieces (lookahead 1)
#   prefetch.sh:staging                  issue 11: the staging budget sweep and the 2 GiB-expert model (lookahead 1
#                                        with pieces) against master
#   experts-at-scale.sh:share minbatch pin   issue 11: the ub 4096 share target, the min-batch sweep, a partial pin
# Done in the fourth session (add them to STEPS to rerun): bench-stats.sh:target planted self (issue 9's targets,
# met), the pp4096 rows of bench-stats.sh:rows; in the third: prefetch.sh:sanitizer, bench-stats.sh:rows-short.
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
    for s in ${STEPS:-bench-stats.sh:rows-mmap prefetch.sh:identity prefetch.sh:sanitizer-pieces prefetch.sh:staging experts-at-scale.sh:share \
                     experts-at-scale.sh:minbatch experts-at-scale.sh:pin}; do
        echo "== $s ($((SECONDS - T0)) s)"
        bash "$here/${s%%:*}" "${s#*:}"
    done
    ;;
*)
    echo "unknown step $step: use all|follow"; exit 2
    ;;
esac
