"""Running a spawned 2-rank gloo program under `hazsan run`, and reading what it left: shared by the
capture tests that reproduce backend semantics and public bug patterns."""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import pytest


def run_under_hazsan(tmp, level: str, program: str, ranks: int = 2):
    """Write `program` as tmp/prog.py, run it (argv: rendezvous URL, output folder) under
    `hazsan run --format json` at `level`; return (exit code, report, each rank's res<r>.json,
    each rank's trace events, stderr). `alloc-native`, `full-native`: that level recorded by the
    native recorder (HAZSAN_NATIVE=1; the run fails unless every rank's header says it was used),
    any other level by the dispatch mode (HAZSAN_NATIVE=0)."""
    native = level.endswith("-native")
    if native:
        require_native()
        level = level[:-len("-native")]
    (tmp / "prog.py").write_text(program)
    cmd = [sys.executable, "-m", "sanitizer", "run", "--dir", str(tmp / "traces"), "--format",
           "json", "--", sys.executable, "prog.py", f"file://{tmp}/rdv", str(tmp)]
    out = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HAZSAN_LEVEL": level, "HAZSAN_NATIVE": "1" if native else "0"})
    try:
        report = json.loads(out.stdout)
    except ValueError:
        pytest.fail(f"no report: rc {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    res = [json.loads((tmp / f"res{r}.json").read_text()) for r in range(ranks)]
    events = collections.defaultdict(list)
    for r in range(ranks):
        for f in sorted((tmp / "traces").glob(f"*rank{r}*")):
            lines = f.read_text().splitlines()
            source = json.loads(lines[0])["hooks"].get("alloc", {}).get("source")
            assert source == ("native" if native else "dispatch-mode"), (f, lines[0])
            for line in lines[1:]:
                events[r].append(json.loads(line))
    return out.returncode, report, res, events, out.stderr


def require_native() -> None:
    """Skip when the native recorder cannot be used in this environment (said in the skip reason);
    under CI, fail instead: `make venv` builds it, so CI must run the native tests."""
    import torch

    from sanitizer.capture import native
    st = native.status(torch)
    if not st.get("usable"):
        text = f"native recorder not usable here: {st.get('reason')}"
        if os.environ.get("CI"):
            pytest.fail(text + " (CI builds it: `hazsan native build`)")
        pytest.skip(text)


def by_op_step(report) -> dict:
    """Findings by the step of the op they collide with (the case that enqueued it)."""
    out = collections.defaultdict(list)
    for f in report["findings"]:
        out[(f.get("op") or {}).get("step")].append(f)
    return out
