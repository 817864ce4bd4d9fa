#!/usr/bin/env bash
# Regenerates reports/scan/ from the SGLang 0.5.23 wheel (SGLang's code is not committed).
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
