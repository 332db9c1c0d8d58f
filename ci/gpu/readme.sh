#!/usr/bin/env bash
# The README's GPU quick start and its Python example, run as the README writes them. The GPU machine has no
# package registry, so three lines differ and say so: no clone (this tree is one), no pip install (the carried
# wheels and this tree are on PYTHONPATH, `pyllama-moe` is `python3 -m pyllama_moe`), and the build reads the
# patched source pack (--archive) instead of fetching the sdist. Every other line is taken from README.md itself,
# run in a work folder outside $OUT (the synthetic model is 17 GB); each command's output and time go to $OUT.
#   quickstart  the quick start's blocks in order; llama-server in the background until its completion returns
#   python      the "From Python" block, in the quick start's folder (its build and model.gguf)
set -uo pipefail
step=${1:?usage: readme.sh quickstart|python}
. "$(dirname "$0")/common.sh"
ROOT=$PWD
WORK=${README_WORK:-/tmp/plm-readme}
mkdir -p "$WORK"
pyllama-moe() { python3 -m pyllama_moe "$@"; }
export -f pyllama-moe

blocks() { # $1: a README heading; prints its fenced blocks' lines (the language tag lines dropped)
    awk -v h="## $1" '$0 == h { on = 1; next } /^## / { on = 0 } on && /^```/ { code = !code; next } on && code' \
        "$ROOT/README.md"
}

n=0
run_line() { # one README command, logged with its time; a failure stops the step
    n=$((n + 1))
    local start=$SECONDS
    echo "\$ $1"
    bash -c "$1" > >(tee "$OUT/cmd-$n.log") 2>&1 < /dev/null
    local rc=$?
    echo "  (exit $rc, $((SECONDS - start)) s)"
    [ $rc = 0 ] || { echo "exit $rc from: $1"; exit 1; }
}

cd "$WORK" || exit 1
case $step in
quickstart)
    server=
    while IFS= read -r line; do
        case $line in
        ''|'#'*) continue ;;
        'git clone '*|'python3 -m pip install '*) echo "(skipped here: $line)"; continue ;;
        'B=$(pyllama-moe build '*)
            cmd=${line#B=\$(pyllama-moe }
            cmd=${cmd%)/bin}
            echo "\$ $line   # here: with --archive"
            start=$SECONDS
            B=$(python3 -m pyllama_moe $cmd --archive "$ROOT/$A/llama.cpp-patched.tar.gz" 2> "$OUT/build.log")/bin \
                || { echo "the build failed"; tail -30 "$OUT/build.log"; exit 1; }
            echo "  (B=$B, $((SECONDS - start)) s)"
            export B
            continue ;;
        *'/llama-server '*)
            echo "\$ $line   # here: in the background until it answers"
            bash -c "$line" > "$OUT/llama-server.log" 2>&1 < /dev/null &
            server=$!
            for _ in $(seq 180); do curl -sf http://127.0.0.1:8080/health > /dev/null && break; sleep 1; done
            continue ;;
        esac
        run_line "$line"
    done < <(blocks "Quick start on a GPU")
    if [ -n "$server" ]; then
        kill "$server"
        wait "$server" 2> /dev/null
        grep -h "llama_moe:" "$OUT/llama-server.log" | head -8
    fi
    echo "quick start: every command ran"
    ;;
python)
    awk '$0 == "## From Python" { on = 1; next } /^## / { on = 0 }
        on && /^```python/ { code = 1; next } on && /^```/ { code = 0 } on && code' "$ROOT/README.md" > readme-example.py
    cat readme-example.py
    run_line "python3 readme-example.py"
    ;;
*)
    echo "unknown step $step"; exit 2 ;;
esac
