#!/usr/bin/env bash
# --fit with the expert cache on a device with limited free memory, on the GPU machine. A planted
# allocation (hold_memory.py) leaves LEAVE_MIB (default 12288) free; steps (results in $OUT):
#   all       the patched CUDA build (alone, -j 16, detached) and the skew 0.5 30B-shaped model, then identity, bench
#   identity  llama-perplexity's log-probs (4 chunks of 512, ub 512) and 64 greedy tokens of llama-completion: every
#             weight on the GPU (no planted allocation) against --fit on with the cache under the planted allocation;
#             the same bytes are the claim (patched all-on-GPU equals master all-on-GPU: the gpu subset's cells)
#   bench     llama-bench rows under the planted allocation, each its own process, ROUNDS rounds in turn:
#             fit+cache (-fitt 1024 -mcm 200000), fit without the cache (-fitt 1024 -mcm 0), fit with a cache budget
#             below the room for each MiB in HYBRID_MIB (none by default) and -ncmoe N for N in NCMOE;
#             pp2048 and tg128, -r 3; nvidia-smi sampled every 250 ms during each row: the least free memory
#             a row left, to tell which rows kept the 1024 MiB target
# Carry .work/archives and .whl; repeat `FOLLOW_S=560 bash ci/gpu/fit.sh follow` until "pipeline finished"
# (run.sh steps fit-identity, fit-bench).
set -uo pipefail
step=${1:?usage: fit.sh all|follow|identity|bench}
. "$(dirname "$0")/common.sh"
here=$(dirname "$0")
LEAVE=${LEAVE_MIB:-12288}

plant() { # holds all but LEAVE MiB of the GPU until unplant
    rm -f /tmp/hold.ready /tmp/hold.stop
    python3 "$here/hold_memory.py" "$LEAVE" /tmp/hold.ready /tmp/hold.stop &
    HOLD_PID=$!
    while [ ! -f /tmp/hold.ready ]; do kill -0 $HOLD_PID 2> /dev/null || { echo "hold_memory failed"; return 1; }; sleep 0.5; done
    echo "planted: $(cat /tmp/hold.ready) (free, total MiB)" | tee -a "$OUT/planted.txt"
}
unplant() { touch /tmp/hold.stop; wait $HOLD_PID 2> /dev/null; }

sampled() { # $1: name; the rest: a command run while nvidia-smi samples the used memory; prints the least free MiB
    local name=$1; shift
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader,nounits -lms 250 > "$OUT/mem-$name.csv" &
    local smi=$!
    "$@"
    local rc=$?
    kill $smi 2> /dev/null; wait $smi 2> /dev/null
    python3 -c "
import sys
rows = [tuple(int(v) for v in l.split(',')) for l in open(sys.argv[1]) if l.strip()]
print('least free MiB during $name:', min(t - u for u, t in rows) if rows else 'no samples')" "$OUT/mem-$name.csv" \
        >> "$OUT/least-free.txt"
    return $rc
}

case $step in
follow)
    follow_pipeline "$0" /tmp/plm-fit 60
    ;;
all)
    build_patched_with_skew_model || exit 1
    for s in ${STEPS:-identity bench}; do
        echo "== $s ($((SECONDS - T0)) s)"
        bash "$0" "$s"
    done
    ;;
identity)
    M=$(skew_model) || exit 1
    P=$(patched_bin)
    python3 -m pyllama_moe corpus --model "$M" --tokens 3000 -o /tmp/fit-corpus.txt > /dev/null
    head -c 1500 /tmp/fit-corpus.txt > /tmp/fit-prompt.txt
    ppl() { "$P/llama-perplexity" -m "$M" -f /tmp/fit-corpus.txt -c 512 -b 512 -ub 512 --chunks 4 -t 15 --no-warmup "$@"; }
    gen() { "$P/llama-completion" -m "$M" -f /tmp/fit-prompt.txt -n 64 --temp 0 -no-cnv -ub 512 -t 15 "$@"; }
    ppl -ngl 99 --fit off --kl-divergence-base /tmp/all.kld > "$OUT/ppl-all.log" 2>&1; echo "ppl all on the GPU: exit $?"
    gen -ngl 99 --fit off > "$OUT/gen-all.txt" 2> "$OUT/gen-all.log"; echo "gen all on the GPU: exit $?"
    plant || exit 1
    sampled ppl-fit ppl --fit on -fitt 1024 --moe-cache-mib 200000 --kl-divergence-base /tmp/fit.kld > "$OUT/ppl-fit.log" 2>&1
    echo "ppl fit+cache: exit $?"
    sampled gen-fit gen --fit on -fitt 1024 --moe-cache-mib 200000 > "$OUT/gen-fit.txt" 2> "$OUT/gen-fit.log"
    echo "gen fit+cache: exit $?"
    unplant
    sha256sum /tmp/all.kld /tmp/fit.kld | tee "$OUT/kld-sha256.txt"
    cmp -s /tmp/all.kld /tmp/fit.kld && echo "perplexity log-probs: identical" || echo "perplexity log-probs: DIFFER"
    cmp -s "$OUT/gen-all.txt" "$OUT/gen-fit.txt" && echo "greedy text: identical" || echo "greedy text: DIFFER"
    grep -h "common_fit_moe_cache: [ea]\|llama_moe: .*expert cache on\|llama_moe: no expert cache\|host-weight prefetch o" \
        "$OUT/ppl-fit.log" "$OUT/gen-fit.log" | sort | uniq | cut -c1-400
    grep -h "Final estimate" "$OUT"/ppl-*.log
    ;;
bench)
    M=$(skew_model) || exit 1
    P=$(patched_bin)
    plant || exit 1
    row() { # $1: name, $2: round, then llama-bench arguments
        local name=$1 r=$2; shift 2
        sampled "$name-r$r" timeout 240 "$P/llama-bench" -m "$M" -p 2048 -n 128 -r 3 -t 15 -o json "$@" \
            > "$OUT/bench-$name-r$r.json" 2> "$OUT/bench-$name-r$r.log"
        echo "$name round $r: exit $? ($((SECONDS - T0)) s)"
    }
    for r in $(seq 1 ${ROUNDS:-2}); do
        row fit-cache $r -fitt 1024 -mcm 200000 -v
        row fit-nocache $r -fitt 1024 -mcm 0 -v
        for b in ${HYBRID_MIB:-}; do # a budget below the room: the cache first, whole layers the rest
            row fit-cache$b $r -fitt 1024 -mcm $b -v
        done
        for n in ${NCMOE-18 20 22 24 28}; do
            row ncmoe$n $r -ngl 99 -ncmoe $n
        done
    done
    unplant
    cat "$OUT/least-free.txt"
    python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("bench-*.json")):
    try:
        rows, _ = json.JSONDecoder().raw_decode(f.read_text())  # llama-bench may print more after its JSON
        for r in rows:
            kind = "pp%d" % r["n_prompt"] if r["n_prompt"] else "tg%d" % r["n_gen"]
            print(f.stem, kind, round(r["avg_ts"], 1), "+-", round(r["stddev_ts"], 1), "t/s",
                  "hits", r.get("samples_moe_cache_hit_rate"))
    except Exception as e:  # a row that failed (out of memory, say) wrote no JSON
        print(f.stem, "no result:", e)
PY
    grep -h "common_fit_moe_cache: [ea]\|llama_moe: .*expert cache on\|llama_moe: no expert cache\|prefetch o" "$OUT"/bench-fit-*-r1.log | sort | uniq | cut -c1-400
    ;;
*)
    echo "unknown step $step: use all|follow|identity|bench"; exit 2
    ;;
esac
