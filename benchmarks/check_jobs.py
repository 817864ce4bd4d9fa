#!/usr/bin/env python3
"""`hazsan check --jobs 2` against `--jobs 1` on the same rank files, in one run.

Generates (or reuses, under --trace-dir) --ranks rank files of --events events each with
gen_decode_trace.py (with --inject planted hazards, the same on every rank), then runs
`python -m sanitizer check DIR --format json --jobs J` for each J in --jobs, one after the other,
in subprocesses on the whole machine, and prints wall seconds, events per second, the speed-up
against the first J, and CPU seconds (the check and its workers: the cost of splitting and joining). It also checks that every run printed the same report (findings, summary).
Each J runs --repeat times; the best wall time counts (other load on the machine only slows down).
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import gen_decode_trace as gen  # noqa: E402


def ensure_traces(args) -> Path:
    out = args.trace_dir / f"jobs-r{args.ranks}-e{args.events}-i{args.inject}-s{args.seed}"
    meta = out / "meta.json"
    if meta.exists():
        m = orjson.loads(meta.read_bytes())
        if m.get("generator_version") == gen.GENERATOR_VERSION and all((out / f["file"]).exists() for f in m["files"]):
            print(f"traces: reusing {out}")
            return out
    t0 = time.perf_counter()
    gen.generate(out, events=args.events, ranks=args.ranks, seed=args.seed, inject=args.inject)
    print(f"traces: generated {out} in {time.perf_counter() - t0:.0f} s")
    return out


def run(trace: Path, jobs: int) -> tuple[float, float, dict]:
    cmd = [sys.executable, "-m", "sanitizer", "check", str(trace), "--format", "json", "--jobs", str(jobs)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)   # the check and its pool workers
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.decode()[-2000:]}")
    return wall, cpu, orjson.loads(done.stdout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--events", type=int, default=1_000_000, help="events per rank file")
    ap.add_argument("--inject", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", default="1,2", help="comma-separated job counts; the first is the baseline")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--trace-dir", type=Path, default=Path(tempfile.gettempdir()) / "hazsan-bench",
                    help="cache of generated traces, reused (default: hazsan-bench in tempfile.gettempdir())")
    args = ap.parse_args(argv)
    trace = ensure_traces(args)
    total = args.ranks * args.events
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}; "
          f"{args.ranks} rank files x {args.events:,} events = {total:,} events")
    reports, rows = {}, []
    for j in [int(x) for x in args.jobs.split(",")]:
        best = None
        for _ in range(args.repeat):
            wall, cpu, report = run(trace, j)
            if best is None or wall < best[0]:
                best = (wall, cpu)
        reports[j] = report
        rows.append((j, *best))
    base = rows[0][1]
    print(f"{'jobs':>5} {'wall s':>8} {'events/s':>12} {'speed-up':>9} {'CPU s':>8}")
    for j, wall, cpu in rows:
        print(f"{j:>5} {wall:>8.2f} {total / wall:>12,.0f} {base / wall:>8.2f}x {cpu:>8.2f}")
    first = next(iter(reports.values()))
    same = all(r == first for r in reports.values())
    print(f"findings: {first['summary']['by_rule']}; identical reports across job counts: {same}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
