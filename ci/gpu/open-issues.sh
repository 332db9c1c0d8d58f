#!/usr/bin/env bash
# One device session over the GPU steps of the open issues, in the order their results are most needed, on one
# pair of CUDA builds with every default target (so the identity cells, the sanitizer and the benchmarks share
# them):
#   build       master and patched (detached) and the 30B-shaped model (prefetch.sh build)
#   sanitizer   issue 10 item 7: memcheck with and without poisoned slots, in the foreground (prefetch.sh)
#   target, planted, self
#               issue 9: tg128 paced and chunked, master vs patched, a planted 5% loss, master vs itself
#   identity    issue 10: the CUDA identity cells and host syncs per token (prefetch.sh)
#   rows-short, rows
#               issues 9 and 10: the prefetch rows with intervals (bench-stats.sh)
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
    for s in prefetch.sh:sanitizer bench-stats.sh:target bench-stats.sh:planted bench-stats.sh:self \
             prefetch.sh:identity bench-stats.sh:rows-short bench-stats.sh:rows; do
        echo "== $s ($((SECONDS - T0)) s)"
        bash "$here/${s%%:*}" "${s#*:}"
    done
    ;;
*)
    echo "unknown step $step: use all|follow"; exit 2
    ;;
esac
