# Sourced by ci/gpu/run.sh and the ci/gpu/*.sh step scripts: the GPU machine's environment (wheels carried in .whl/,
# cache root /tmp/plm, CUDA on PATH), CUDA builds of master and patched from the pruned archives in .work/archives,
# run detached so that they outlive the device call that started them, and the Qwen3-30B-A3B-shaped bench model.
# The wheels are installed once per process tree: a step script that run.sh starts finds PLM_GPU_ENV set.
export OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH PYLLAMA_MOE_HOME=/tmp/plm PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
if [ -z "${PLM_GPU_ENV:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PLM_GPU_ENV=1
fi
A=.work/archives
MODEL=$PYLLAMA_MOE_HOME/bench-qwen3-30b-a3b-q4_0.gguf
T0=$SECONDS

start_builds() { # both builds at once, -j 8 each, detached; each writes /tmp/plm-<variant>.rc when it ends
    # TARGETS_master / TARGETS_patched: comma-separated ninja targets (default: the build verb's)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    for v in master patched; do
        rm -f /tmp/plm-$v.rc
        : > /tmp/plm-build-$v.log  # before it starts: wait_builds tells a build under way from none
        targets=$(eval echo "\${TARGETS_$v:-}")
        setsid bash -c "python3 -m pyllama_moe build --backend cuda --variant $v --archive $A/llama.cpp-$v.tar.gz -j 8 \
            ${targets:+--targets $targets} > /tmp/plm-build-$v.log 2>&1; echo \$? > /tmp/plm-$v.rc" > /dev/null 2>&1 < /dev/null &
    done
}

build_patched_with_skew_model() { # the patched CUDA build alone (-j 16, in this call) while the skew 0.5 model is
    # written; 0 when both are there (wait_builds with BUILD_VARIANTS=patched then finds the build)
    mkdir -p "$PYLLAMA_MOE_HOME"
    skew_model > /dev/null 2> "$OUT/skew-model.log" &
    local skew_pid=$!
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    rm -f /tmp/plm-patched.rc
    python3 -m pyllama_moe build --backend cuda --variant patched --archive $A/llama.cpp-patched.tar.gz -j 16 \
        > /tmp/plm-build-patched.log 2>&1
    echo $? > /tmp/plm-patched.rc
    cp /tmp/plm-build-patched.log "$OUT/build-patched.log"
    [ "$(cat /tmp/plm-patched.rc)" = 0 ] || { echo "build failed"; tail -30 /tmp/plm-build-patched.log; return 1; }
    echo "== build done ($((SECONDS - T0)) s)"
    wait $skew_pid || { echo "the skew 0.5 model was not written"; cat "$OUT/skew-model.log"; return 1; }
}

make_bench_model() { # the 30B-shaped Q4_0 model (17 GB), unless it is there; non-zero when the writer failed
    # the builds create $PYLLAMA_MOE_HOME in the background; synth refuses an output folder that does not exist yet
    mkdir -p "$PYLLAMA_MOE_HOME"
    [ -f "$MODEL" ] && return 0
    python3 -m pyllama_moe synth --preset qwen3-30b-a3b --type q4_0 --seed 7 -o "$MODEL.partial" --quiet < /dev/null \
        && mv "$MODEL.partial" "$MODEL" || { echo "synth of $MODEL failed"; return 1; }
}

skew_model() { # the Qwen3-30B-A3B shape with routing skew 0.5, written once
    local m=$PYLLAMA_MOE_HOME/bench-qwen3-30b-a3b-q4_0-skew0.5.gguf
    mkdir -p "$PYLLAMA_MOE_HOME"  # synth refuses an output folder that does not exist; the builds may not have made it yet
    if [ ! -f "$m" ]; then
        python3 -m pyllama_moe synth --preset qwen3-30b-a3b --type q4_0 --seed 7 --skew 0.5 -o "$m.partial" --quiet \
            < /dev/null >&2 && mv "$m.partial" "$m" >&2 || return 1
    fi
    echo "$m"
}

FAILED_SUBSETS=""
identity_subset() { # $1: seconds at most, $2: a compare subset, $3: the name of its JSON and text in $OUT; a failed
    # cell is noted in FAILED_SUBSETS, so the step's other checks still run before identity_verdict fails it
    timeout "$1" python3 -m pyllama_moe compare --subset "$2" --backend cuda --archive-dir $A --json "$OUT/$3.json" 2>&1 \
        | tee "$OUT/$3.txt" || FAILED_SUBSETS="$FAILED_SUBSETS $2"
}

identity_verdict() { # 1 where a subset run by identity_subset had a failed cell
    [ -z "$FAILED_SUBSETS" ] || { echo "identity: a cell failed in:$FAILED_SUBSETS"; return 1; }
}

bench() { # $1: seconds at most, then pyllama-moe bench arguments; the model is BENCH_MODEL, else the 30B one
    local limit=$1; shift
    timeout "$limit" python3 -m pyllama_moe bench --model "${BENCH_MODEL:-$MODEL}" --backend cuda --archive-dir $A "$@"
}

first_tokens() { # $1: a name (its JSON, text and log folder in $OUT), then first-tokens arguments; the model is
    # M, the patched build the one start_builds or build_patched_with_skew_model made; FIRST_S: seconds at most (400)
    local name=$1; shift
    timeout ${FIRST_S:-400} python3 -m pyllama_moe first-tokens --model "$M" --variant patched --backend cuda \
        --archive $A/llama.cpp-patched.tar.gz --no-build --pin-threads --json "$OUT/$name.json" \
        --log-dir "$OUT/$name-logs" "$@" 2>&1 | tee "$OUT/$name.txt"
}

patched_bin() { # the bin folder of the patched CUDA build that start_builds made; $1: its targets where they were
    # not the default ones (comma-separated), so that resolving it does not build the others
    python3 -c "import pathlib, sys; from pyllama_moe.build.builder import resolve
targets = {'targets': tuple(sys.argv[1].split(','))} if sys.argv[1] else {}
print(resolve('patched', 'cuda', archive=pathlib.Path('$A/llama.cpp-patched.tar.gz'), **targets).bin_dir)" "${1:-}"
}

tiny_prompt() { # sets SMALL to the matrix's tiny qwen3moe model (made here when no identity run made it) and
    # writes the first 4000 characters of its corpus to /tmp/prompt.txt (~1100 tokens)
    local corpus
    read -r SMALL corpus < <(python3 -c 'import pathlib
from pyllama_moe.harness.matrix import load_matrix
from pyllama_moe.harness.models import ensure_corpus, ensure_model
m = ensure_model("qwen3moe", load_matrix(pathlib.Path("ci/matrix.toml")).models["qwen3moe"])
print(m, ensure_corpus(m))')
    head -c 4000 "$corpus" > /tmp/prompt.txt
}

wait_builds() { # $1: seconds since the script started to wait at most; 0 when both builds finished and succeeded
    # (BUILD_VARIANTS=patched: only that one, where a script builds nothing else)
    for v in ${BUILD_VARIANTS:-master patched}; do
        # a build that was never started (a later call that ran build-patched alone before) would be waited for in vain
        [ -f /tmp/plm-$v.rc ] || [ -f /tmp/plm-build-$v.log ] || {
            echo "no $v build was started on this machine: run its build step first, or set BUILD_VARIANTS=patched"; return 1; }
        while [ ! -f /tmp/plm-$v.rc ]; do
            [ $((SECONDS - T0)) -ge "$1" ] && { echo "build $v still running after $((SECONDS - T0)) s"; return 2; }
            sleep 5
        done
        cp /tmp/plm-build-$v.log "$OUT/build-$v.log"
        [ "$(cat /tmp/plm-$v.rc)" = 0 ] || { echo "build $v failed"; tail -30 /tmp/plm-build-$v.log; return 1; }
    done
    grep -h "build .*/cuda: done" "$OUT"/build-*.log
}

follow_pipeline() { # $1: the step script, $2: the pipeline's own output folder, $3: lines of its log to show, the
    # rest: the script's arguments (default: all); starts the script detached once (it outlives this device call),
    # then follows it for up to FOLLOW_S seconds
    local script=$1 pipe=$2 lines=$3
    shift 3
    local args
    args=$(printf ' %q' "${@:-all}")
    # a pipeline that died without its exit status (its folder removed, the machine's /tmp cleaned) starts again
    if [ -f $pipe.pid ] && [ ! -f $pipe/pipeline.rc ] && ! kill -0 "$(cat $pipe.pid)" 2> /dev/null; then
        echo "the pipeline of $pipe.pid is gone without an exit status: starting it again"
        rm -f $pipe.pid
    fi
    if [ ! -f $pipe.pid ]; then
        mkdir -p $pipe
        setsid env OUT=$pipe bash -c "bash $script$args > $pipe/pipeline.log 2>&1; echo \$? > $pipe/pipeline.rc" \
            > /dev/null 2>&1 < /dev/null &
        echo $! > $pipe.pid
        echo "pipeline started:$args"
    fi
    while [ ! -f $pipe/pipeline.rc ] && [ $((SECONDS - T0)) -lt "${FOLLOW_S:-560}" ]; do sleep 5; done
    # one archive: a device call returns only a few files from $OUT
    tar czf "$OUT/pipeline.tgz" -C $pipe . && cp $pipe/pipeline.log "$OUT/"
    tail -"$lines" $pipe/pipeline.log
    [ -f $pipe/pipeline.rc ] && echo "pipeline finished: exit $(cat $pipe/pipeline.rc)"
}
