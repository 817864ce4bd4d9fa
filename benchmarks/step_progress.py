"""What marking step ends costs the writer: two in-place writes of the header's `progress` per step
(only its bytes, where their length is unchanged; docs/capture.md "Shutdowns and killed
processes"), against steps whose ends are not marked. Prints microseconds per step and the difference, for a few runs.

    .venv/bin/python benchmarks/step_progress.py [--steps 3000] [--events 50]
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time

from sanitizer.trace.writer import TraceWriter


def per_step(ends: bool, steps: int, events: int) -> float:
    folder = tempfile.mkdtemp(dir="/dev/shm" if shutil.disk_usage("/dev/shm") else None)
    try:
        w = TraceWriter(folder, flush_seconds=1000)
        w.header_source = lambda: {"hooks": {"installed": [f"hook{i}" for i in range(20)], "failed": {}}}
        w.header_key = lambda: 1
        w.start()
        t0 = time.perf_counter()
        for n in range(steps):
            if ends:
                w.mark_step(n, ended=False)
            w.emit({"ev": "step", "n": n})
            for i in range(events):
                w.emit({"ev": "free", "id": i})
            w.flush()
            if ends:              # what Capture.end_step does: a flush, then the header
                w.flush()
                w.mark_step(n, ended=True)
        dt = time.perf_counter() - t0
        w.close()
        return dt / steps * 1e6
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--events", type=int, default=50, help="events per step")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    for _ in range(a.runs):
        plain, marked = per_step(False, a.steps, a.events), per_step(True, a.steps, a.events)
        print(f"per step ({a.events} events): ends not marked {plain:.1f} us, ends marked {marked:.1f} us, "
              f"+{marked - plain:.1f} us ({marked / plain:.2f}x)")


if __name__ == "__main__":
    main()
