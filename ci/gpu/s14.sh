#!/usr/bin/env bash
# The fourteenth session's GPU pipeline: the patched CUDA build alone, then
#   fit      fit.sh bench: --fit with the cache under a 12 GiB planted allocation (ROUNDS_FIT rounds, a hybrid row)
#   profile  profile.sh profile: a saved profile against seeding, first 16 tokens after a 4096-token prompt (the seed
#            now clears the reference bit of the lower-scored half of its set)
# Carry .work/archives and .whl; repeat `FOLLOW_S=560 bash ci/gpu/s14.sh follow` until "pipeline finished".
set -uo pipefail
step=${1:?usage: s14.sh all|follow}
. "$(dirname "$0")/common.sh"
here=$(dirname "$0")
export BUILD_VARIANTS=patched
case $step in
follow)
    follow_pipeline "$0" /tmp/plm-s14 60
    ;;
all)
    build_patched_with_skew_model || exit 1
    for s in ${STEPS:-fit profile}; do
        echo "== $s ($((SECONDS - T0)) s)"
        mkdir -p "$OUT/$s"
        case $s in
        fit) OUT="$OUT/$s" ROUNDS=${ROUNDS_FIT:-4} NCMOE=18 HYBRID_MIB=4096 bash "$here/fit.sh" bench ;;
        profile) OUT="$OUT/$s" ROUNDS=2 bash "$here/profile.sh" profile ;;
        esac
    done
    ;;
esac
