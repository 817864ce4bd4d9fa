#!/usr/bin/env python3
"""`hazsan check --jobs 2` against `--jobs 1` on the same rank files, in one run, and what limits it.

Generates (or reuses, under --trace-dir) --ranks rank files of --events events each with
gen_decode_trace.py (with --inject planted hazards, the same on every rank; --format jsonl or
binary, what capture writes), then for each J in --jobs:

1. runs `python -m sanitizer check DIR --format json --jobs J` in a subprocess on the whole
   machine: wall seconds, events per second, the speed-up against the first J, and CPU seconds
   (the check and its workers: the cost of splitting and joining); every J must print the same
   report (findings, summary);
2. runs the same analysis (`analyze_parallel`, or `analyze` for J = 1) in a fresh interpreter that
   times its parts: the parent's own CPU (start-up, listing the files, unpickling results, the
   join), each worker's wall span and CPU (a worker given less CPU than wall time was waiting for
   a core: other load on the machine), and the critical path (the busiest worker).

Each J runs --repeat times; the best wall time counts (other load on the machine only slows down).
The load average is printed before and after: on a shared machine it says how many cores the run
could have had.
"""
from __future__ import annotations

import argparse
import json
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

# The same analysis in a fresh interpreter, its parts timed. Workers are forked from it, so the
# wrapped analyze_one runs in them: each appends its span and CPU to a file of its own.
_BREAKDOWN = r"""
import json, os, resource, sys, time
t0 = time.perf_counter()
spec = json.loads(sys.argv[1])
from sanitizer.rules import parallel
from sanitizer.rules.driver import analyze
real = parallel.analyze_one

def timed_one(path, *args):
    start, cpu = time.perf_counter(), time.process_time()
    out = real(path, *args)
    with open(os.path.join(spec["spans"], f"{os.getpid()}.jsonl"), "a") as fh:
        fh.write(json.dumps({"pid": os.getpid(), "path": path, "start": start - t0,
                             "end": time.perf_counter() - t0, "cpu": time.process_time() - cpu}) + "\n")
    return out

parallel.analyze_one = timed_one
imported = time.perf_counter() - t0
if spec["jobs"] > 1:
    a = parallel.analyze_parallel(spec["paths"], jobs=spec["jobs"], progress=False)
else:
    a = analyze(spec["paths"])
wall = time.perf_counter() - t0
me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"wall": wall, "imported": imported, "parent_cpu": me.ru_utime + me.ru_stime,
                  "workers_cpu": kids.ru_utime + kids.ru_stime, "events": a.summary["events"]}))
"""


def add_p2p(out: Path, ranks: int, rounds: int) -> None:
    """Append to every rank file (JSON Lines) `rounds` rounds of ai-dynamo/dynamo#826's transfer
    with the rank beside it (docs/ordering-and-rules.md, "Ordering across ranks"): an even rank
    sends a KV page with an isend it never waits, receives the odd rank's "done" on group `kv1`
    and then rewrites the page; the odd rank receives the page, then sends "done". One round in
    ten rewrites the page before receiving "done" (a finding that stays, with its note): every
    even rank has findings on sends, so the check takes the cross-rank step on every rank."""
    for rank in range(ranks):
        peer = rank ^ 1
        if peer >= ranks:
            continue
        lo, hi = sorted((rank, peer))
        kv, note = f"kv0:p2p:{lo}-{hi}", f"kv1:p2p:{lo}-{hi}"
        page, buf = 1 << 50, (1 << 50) + (1 << 20)
        ev = [{"ev": "alloc", "id": "kv-page", "addr": page, "size": 4096, "stream": "cpu", "pool": "kv"},
              {"ev": "alloc", "id": "kv-note", "addr": buf, "size": 4, "stream": "cpu", "pool": "kv"}]
        for k in range(rounds):
            sent, got = f"kv-s{k}", f"kv-n{k}"
            if rank % 2 == 0:
                write = {"ev": "launch", "stream": "cpu", "writes": [[page, 4096]], "site": "kv.py:1:reuse"}
                early = k % 10 == 9
                ev += [{"ev": "sync", "stream": "cpu"},   # as capture writes before a collective
                       {"ev": "coll", "cid": sent, "comm": kv, "seq": k, "op": "c10d.send", "stream": f"gloo:kv0#{k}",
                        "bufs": [{"addr": page, "size": 4096, "access": "r"}]},
                       *([write] if early else []),
                       {"ev": "coll", "cid": got, "comm": note, "seq": k, "op": "c10d.recv_", "stream": "gloo:kv1",
                        "bufs": [{"addr": buf, "size": 4, "access": "w"}]},
                       {"ev": "coll_done", "cid": got}, *([] if early else [write])]
            else:
                ev += [{"ev": "coll", "cid": sent, "comm": kv, "seq": k, "op": "c10d.recv_", "stream": "gloo:kv0",
                        "bufs": [{"addr": page, "size": 4096, "access": "w"}]},
                       {"ev": "coll_done", "cid": sent},
                       {"ev": "sync", "stream": "cpu"},
                       {"ev": "coll", "cid": got, "comm": note, "seq": k, "op": "c10d.send", "stream": "gloo:kv1",
                        "bufs": [{"addr": buf, "size": 4, "access": "r"}]},
                       {"ev": "coll_done", "cid": got}]
        path = out / f"rank{rank}.jsonl"
        lines = path.read_bytes().splitlines(keepends=True)
        tail = [lines.pop()] if lines and b'"ev": "end"' in lines[-1].replace(b'"ev":"end"', b'"ev": "end"') else []
        path.write_bytes(b"".join(lines) + b"".join(orjson.dumps(e) + b"\n" for e in ev) + b"".join(tail))


def ensure_traces(args) -> Path:
    out = args.trace_dir / (f"jobs-r{args.ranks}-e{args.events}-i{args.inject}-s{args.seed}"
                            + ("-binary" if args.format == "binary" else "")
                            + (f"-p2p{args.p2p}" if args.p2p else ""))
    meta = out / "meta.json"
    if meta.exists():
        m = orjson.loads(meta.read_bytes())
        if m.get("generator_version") == gen.GENERATOR_VERSION and all((out / f["file"]).exists() for f in m["files"]):
            print(f"traces: reusing {out}")
            return out
    t0 = time.perf_counter()
    gen.generate(out, events=args.events, ranks=args.ranks, seed=args.seed, inject=args.inject, fmt=args.format)
    if args.p2p:
        if args.format != "jsonl":
            raise SystemExit("--p2p appends to JSON Lines rank files: --format jsonl")
        add_p2p(out, args.ranks, args.p2p)
    print(f"traces: generated {out} in {time.perf_counter() - t0:.0f} s")
    return out


def run(trace: Path, jobs: int) -> tuple[float, float, dict, float]:
    """(wall s, CPU s, the report, peak RSS in MB of the largest process: the check or a worker)."""
    cmd = [sys.executable, "-m", "sanitizer", "check", str(trace), "--format", "json", "--jobs", str(jobs)]
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)   # the check and the workers it waited for
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    cpu = usage.ru_utime + usage.ru_stime
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}: {stderr.decode()[-2000:]}")
    return wall, cpu, orjson.loads(stdout), usage.ru_maxrss / 1024


def breakdown(trace: Path, jobs: int) -> dict:
    paths = sorted(str(p) for p in trace.iterdir() if p.name.startswith("rank"))
    with tempfile.TemporaryDirectory() as spans:
        done = subprocess.run([sys.executable, "-c", _BREAKDOWN, json.dumps({"paths": paths, "jobs": jobs, "spans": spans})],
                              capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"breakdown run failed: {done.stderr[-2000:]}")
        res = json.loads(done.stdout.strip().splitlines()[-1])
        res["spans"] = [json.loads(line) for f in Path(spans).iterdir() for line in f.read_text().splitlines()]
    return res


def describe_breakdown(b: dict) -> list[str]:
    by_worker: dict = {}
    for s in b["spans"]:
        by_worker.setdefault(s["pid"], []).append(s)
    lines = [f"parent: {b['imported']:.2f} s to import, {b['parent_cpu']:.2f} s CPU in all "
             f"(for J = 1 that is the whole analysis); workers: {b['workers_cpu']:.2f} s CPU"]
    if len(by_worker) > 1 or b["workers_cpu"] > 0.05:
        first = min(s["start"] for s in b["spans"])
        last = max(s["end"] for s in b["spans"])
        for pid, spans in sorted(by_worker.items()):
            busy = sum(s["end"] - s["start"] for s in spans)
            cpu = sum(s["cpu"] for s in spans)
            lines.append(f"  worker {pid}: {len(spans)} file(s), busy {busy:.2f} s wall, {cpu:.2f} s CPU "
                         f"({cpu / busy * 100 if busy else 0:.0f}% of a core while busy)")
        lines.append(f"  files analysed from {first:.2f} s to {last:.2f} s; the join and report after: "
                     f"{b['wall'] - last:.2f} s; total {b['wall']:.2f} s")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--events", type=int, default=1_000_000, help="events per rank file")
    ap.add_argument("--inject", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--format", choices=("jsonl", "binary"), default="jsonl", help="the rank files' format")
    ap.add_argument("--jobs", default="1,2", help="comma-separated job counts; the first is the baseline")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--p2p", type=int, default=0, metavar="N",
                    help="append N rounds of dynamo#826's KV transfer between ranks 2k and 2k+1 to every "
                         "file (JSON Lines): the check then orders sends across ranks on every rank")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the timed in-process runs (2.)")
    ap.add_argument("--trace-dir", type=Path, default=Path(tempfile.gettempdir()) / "hazsan-bench",
                    help="cache of generated traces, reused (default: hazsan-bench in tempfile.gettempdir())")
    args = ap.parse_args(argv)
    trace = ensure_traces(args)
    total = args.ranks * args.events
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}; "
          f"{args.ranks} rank files x {args.events:,} events = {total:,} events ({args.format})")
    reports, rows, parts = {}, [], {}
    for j in [int(x) for x in args.jobs.split(",")]:
        best = None
        for _ in range(args.repeat):
            wall, cpu, report, peak = run(trace, j)
            if best is None or wall < best[0]:
                best = (wall, cpu, peak)
        reports[j] = report
        rows.append((j, *best))
        if not args.no_breakdown:
            parts[j] = min((breakdown(trace, j) for _ in range(args.repeat)), key=lambda b: b["wall"])
    base = rows[0][1]
    print(f"{'jobs':>5} {'wall s':>8} {'events/s':>12} {'speed-up':>9} {'CPU s':>8} {'peak MB':>8}")
    for j, wall, cpu, peak in rows:
        print(f"{j:>5} {wall:>8.2f} {total / wall:>12,.0f} {base / wall:>8.2f}x {cpu:>8.2f} {peak:>8.0f}")
    for j, b in parts.items():
        print(f"--jobs {j}, timed in process:")
        for line in describe_breakdown(b):
            print(f"  {line}")
    first = next(iter(reports.values()))
    same = all(r == first for r in reports.values())
    notes = sum(1 for f in first["findings"] if f.get("note"))
    print(f"findings: {first['summary']['by_rule']} ({notes} listed with the cross-rank note); "
          f"identical reports across job counts: {same}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
