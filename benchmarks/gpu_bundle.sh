#!/usr/bin/env bash
# Wheels for running tests/gpu and the GPU benchmarks on a machine that reaches no package
# registry (a GPU machine lent for an hour, say): this project, built here, and everything it
# needs for CPython 3.12 on x86-64 Linux, less what that machine has already.
#
#   benchmarks/gpu_bundle.sh DIR [HAVE]
#
# DIR   where the wheels go (emptied first; keep it out of git).
# HAVE  a file naming the packages that machine already has (its `pip list`, or any text with
#       the names separated by spaces, commas or new lines): those are not carried, so the
#       machine's own builds (numpy, torch) stay the ones imported.
# JupyterHub (15 MB, the gateway's) is never carried: no GPU test or benchmark imports it.
#
# There, from the repository root:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site DIR/*.whl
#   python3 -m compileall -q -j 8 /tmp/site kernelmgr   # that machine sets PYTHONDONTWRITEBYTECODE=1:
#                                                       # without this every import compiles from source
#   export PYTHONPATH=/tmp/site
#   python3 -m pytest tests/gpu -s -p no:cacheprovider -o addopts=""
#   python3 benchmarks/bench_gpu_resume.py --sizes 1,4 --repeat 2
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 || ( $# -eq 2 && ! -r "$2" ) ]]; then
    echo "usage: benchmarks/gpu_bundle.sh DIR [HAVE]  (HAVE: a readable file naming the packages to leave out)" >&2
    exit 2
fi
dir=$1
have=${2:-}
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}

rm -rf "$dir"
mkdir -p "$dir"
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT

"$python" -m pip wheel -q --no-deps -w "$build" "$root"
# Resolved for the target interpreter, not this one: binary wheels only, so nothing is built here.
"$python" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 \
    -d "$dir" "$build"/*.whl websocket-client

normalize() { tr '[:upper:]' '[:lower:]' | tr '_.' '--'; }
skip=$(printf 'jupyterhub\n'; if [[ -n "$have" ]]; then tr ' ,\t' '\n\n\n' < "$have" | normalize; fi)
carried=0
for wheel in "$dir"/*.whl; do
    name=$(basename "$wheel" | cut -d- -f1 | normalize)
    if [[ "$name" != jupyter-elastic-kernels ]] && grep -qx -- "$name" <<< "$skip"; then
        rm "$wheel"
    else
        carried=$((carried + 1))
    fi
done
echo "$carried wheels, $(du -sh "$dir" | cut -f1), in $dir"
