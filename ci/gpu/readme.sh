#!/usr/bin/env bash
# The README's GPU quick start and its Python example, run as the README writes them. The GPU machine has no
# package registry, so three lines differ and say so: no clone (this tree is one), no pip install (the carried
# wheels and this tree are on PYTHONPATH, `pyllama-moe` is `python3 -m pyllama_moe`), and the build reads the
# patched source pack (--archive) instead of fetching the sdist. Every other line is taken from README.md itself.
#   quickstart  the quick start's blocks in order; llama-server in the background until its completion returns
#   python      the "From Python" block, on the quick start's build and model
set -uo pipefail
step=${1:?usage: readme.sh quickstart|python}
. "$(dirname "$0")/common.sh"
pyllama-moe() { python3 -m pyllama_moe "$@"; }
export -f pyllama-moe

blocks() { # $1: a README heading; prints its fenced blocks' lines (the language tag lines dropped)
    awk -v h="## $1" '$0 == h { on = 1; next } /^## / { on = 0 } on && /^```/ { code = !code; next } on && code' README.md
}

run_line() { # one README command, logged; a failure stops the step
    echo "\$ $1"
    bash -c "$1" || { echo "exit $? from: $1"; exit 1; }
}

case $step in
quickstart)
    cd "$OUT" || exit 1
    ln -sf "$OLDPWD/README.md" README.md
    B=
    server=
    while IFS= read -r line; do
        case $line in
        ''|'#'*) continue ;;
        'git clone '*|'python3 -m pip install '*) echo "(skipped here: $line)"; continue ;;
        'B=$(pyllama-moe build '*)
            cmd=${line#B=\$(}
            cmd=${cmd%)/bin}
            echo "\$ $line   # here: with --archive"
            B=$(cd "$OLDPWD" && python3 -m pyllama_moe ${cmd#pyllama-moe } --archive "$OLDPWD/$A/llama.cpp-patched.tar.gz")/bin \
                || { echo "the build failed"; exit 1; }
            export B
            continue ;;
        *'/llama-server '*)
            echo "\$ $line   # here: in the background until it answers"
            bash -c "$line" > llama-server.log 2>&1 &
            server=$!
            for _ in $(seq 120); do curl -sf http://127.0.0.1:8080/health > /dev/null && break; sleep 1; done
            continue ;;
        esac
        run_line "$line"
    done < <(cd "$OLDPWD" && blocks "Quick start on a GPU")
    [ -n "$server" ] && kill "$server" && wait "$server" 2> /dev/null
    grep -h "llama_moe:" llama-server.log | head -5
    echo "quick start: every command ran"
    ;;
python)
    cd "$OUT" || exit 1
    blocks_py=$(cd "$OLDPWD" && awk '$0 == "## From Python" { on = 1; next } /^## / { on = 0 }
        on && /^```python/ { code = 1; next } on && /^```/ { code = 0 } on && code' README.md)
    echo "$blocks_py"
    python3 -c "$blocks_py" || { echo "the Python example failed"; exit 1; }
    ;;
*)
    echo "unknown step $step"; exit 2 ;;
esac
