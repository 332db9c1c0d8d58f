#!/usr/bin/env bash
# Compile CUDA files of the patched tree for one architecture on a machine without a GPU or a CUDA build: a check that
# the series' CUDA code compiles before device time is spent on it (nothing is linked or run). Needs nvcc; the cuBLAS
# headers that ggml-cuda includes come from PyPI's nvidia-cublas wheel (downloaded once into the cache).
#   tools/cuda-compile-check.sh [FILE.cu ...]   (default: ggml-cuda.cu and the series' own .cu files under ggml-cuda/)
# ARCH (default 90) picks the architecture; the tree is `pyllama-moe patches apply`'s scratch repo with native/ copied
# over it (.work/llama.cpp).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${PYLLAMA_MOE_HOME:-$HOME/.cache/pyllama-moe}/cublas-headers
command -v nvcc > /dev/null || { echo "cuda-compile-check: nvcc not found: install the CUDA toolkit or put nvcc on PATH" >&2; exit 2; }
if ! ls "$cache"/nvidia/*/include/cublas_v2.h > /dev/null 2>&1; then
    mkdir -p "$cache"
    python3 -m pip download -q --no-deps -d "$cache" nvidia-cublas
    python3 -c 'import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/nvidia_cublas-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    z.extractall(sys.argv[1], [n for n in z.namelist() if "/include/" in n])' "$cache"
    rm -f "$cache"/nvidia_cublas-*.whl
fi
inc=$(dirname "$(ls "$cache"/nvidia/*/include/cublas_v2.h | head -1)")
tree=$root/.work/llama.cpp
[ -d "$tree/.git" ] || (cd "$root" && python3 -m pyllama_moe patches apply > /dev/null)
cp -r "$root/native/." "$tree/"
cd "$tree"
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(ggml/src/ggml-cuda/ggml-cuda.cu $(cd "$root/native" && ls ggml/src/ggml-cuda/*.cu))
rc=0
for f in "${files[@]}"; do
    start=$SECONDS
    if nvcc -std=c++17 -arch=sm_${ARCH:-90} -DGGML_USE_CUDA -DGGML_CUDA_USE_GRAPHS -I ggml/include -I ggml/src \
            -I ggml/src/ggml-cuda -I "$inc" -c "$f" -o /dev/null; then
        echo "compiled $f ($((SECONDS - start)) s)"
    else
        echo "FAILED $f"; rc=1
    fi
done
exit $rc
