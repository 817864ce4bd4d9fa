#!/usr/bin/env python3
"""How the engine's time and memory grow on two hostile shapes (issue 14), at several sizes.

- `inflight N`: N collectives that never complete (no coll_done, no sync) on one stream, each on
  its own buffer, then N launches on another stream, each writing one of those buffers: every
  launch is an unordered-access finding. The per-access cost must be O(log n + overlaps), not
  O(ops in flight). Target: N = 10^5 in under 2 s on one core.
- `successor N`: `inflight` under `--peer-completion successor`, the buffers in a window of the
  collectives' communicator, and a sync of the launch stream every 10 launches (each retires):
  the per-access cost must stay O(log n + overlaps) there too (SuccessorWait's index).
- `windows N`: N windows registered (then N blocks allocated, one in each, a collective on each,
  the blocks freed, the windows freed): the window lookups must not cost O(windows) each.
- `streams N`: N distinct streams; on each, an allocation, a launch writing it, an event recorded
  there and waited on by stream 0, then a sync of that stream. Clock memory must grow with the
  streams that actually synchronise, not with N x N. Target: N = 10^5 under 300 MB peak RSS.

Each run is a fresh interpreter (`analyze()` of the driver, the engine chosen by --engines)
pinned to one core; the figures are its CPU seconds in analyze() and its peak RSS. The last
column is time per event relative to the smallest size: near 1 means linear growth.

    .venv/bin/python benchmarks/engine_scaling.py                       # 10^4, 10^5, 10^6, compiled
    .venv/bin/python benchmarks/engine_scaling.py --sizes 10000 100000 --engines compiled interpreted
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, resource, sys, time
spec = json.loads(sys.argv[1])
from sanitizer.limits import Limits
from sanitizer.rules.driver import analyze
# the engine itself is measured here, not `hazsan check`'s limits (100,000 streams by default)
limits = Limits(max_streams=10**9, max_events=10**9, max_comms=10**9)
cpu = time.process_time()
a = analyze([spec["path"]], engine=spec["engine"], peer_completion=spec.get("peer", "local"), limits=limits)
out = {"cpu": time.process_time() - cpu, "events": a.summary["events"],
       "findings": a.summary["findings"], "engine": a.summary["engine"], "errors": len(a.errors),
       "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
print(json.dumps(out))
"""

HEADER = {"hazsan": 1, "rank": 0, "world_size": 1, "device": "cuda:0", "generator": "benchmarks/engine_scaling.py"}
BASE = 1 << 40
SIZE = 4096


def write_inflight(path: Path, n: int, window: bool = False, sync_every: int = 0) -> None:
    """N unfinished collectives, then N launches each writing one of their buffers; `window`:
    the buffers in a window of the collectives' communicator; `sync_every`: a sync of the launch
    stream after every that many launches."""
    dumps = orjson.dumps
    with open(path, "wb") as fh:
        fh.write(dumps(HEADER) + b"\n")
        if window:
            fh.write(dumps({"ev": "window", "addr": BASE, "size": n * SIZE, "comm": "tp"}) + b"\n")
        for i in range(n):
            fh.write(dumps({"ev": "coll", "cid": i + 1, "comm": "tp", "seq": i + 1, "op": "all_reduce",
                            "stream": 2, "bufs": [{"addr": BASE + i * SIZE, "size": SIZE, "access": "rw"}]}) + b"\n")
        for i in range(n):
            fh.write(dumps({"ev": "launch", "stream": 1, "op": "k",
                            "writes": [[BASE + i * SIZE, SIZE]]}) + b"\n")
            if sync_every and i % sync_every == sync_every - 1:
                fh.write(dumps({"ev": "sync", "stream": 1}) + b"\n")


def write_successor(path: Path, n: int) -> None:
    write_inflight(path, n, window=True, sync_every=10)


def write_windows(path: Path, n: int) -> None:
    dumps = orjson.dumps
    with open(path, "wb") as fh:
        fh.write(dumps(HEADER) + b"\n")
        for i in range(n):
            fh.write(dumps({"ev": "window", "addr": BASE + i * SIZE, "size": SIZE, "comm": "tp"}) + b"\n")
        for i in range(n):
            fh.write(dumps({"ev": "alloc", "id": i, "addr": BASE + i * SIZE, "size": SIZE // 2, "stream": 1,
                            "pool": "symm"}) + b"\n")
            fh.write(dumps({"ev": "coll", "cid": i + 1, "comm": "tp", "seq": i + 1, "op": "all_reduce",
                            "stream": 1, "bufs": [{"addr": BASE + i * SIZE, "size": SIZE // 2, "access": "rw"}]}) + b"\n")
        for i in range(n):
            fh.write(dumps({"ev": "free", "id": i}) + b"\n")
        for i in range(n):
            fh.write(dumps({"ev": "window_free", "addr": BASE + i * SIZE, "comm": "tp"}) + b"\n")


def write_streams(path: Path, n: int) -> None:
    dumps = orjson.dumps
    with open(path, "wb") as fh:
        fh.write(dumps(HEADER) + b"\n")
        for i in range(1, n + 1):
            addr = BASE + i * SIZE
            fh.write(dumps({"ev": "alloc", "id": i, "addr": addr, "size": SIZE, "stream": i,
                             "pool": "default"}) + b"\n")
            fh.write(dumps({"ev": "launch", "stream": i, "op": "k", "writes": [[addr, SIZE]]}) + b"\n")
            fh.write(dumps({"ev": "record", "event": i, "stream": i}) + b"\n")
            fh.write(dumps({"ev": "wait", "event": i, "stream": 0}) + b"\n")
            fh.write(dumps({"ev": "sync", "stream": i}) + b"\n")


def write_comms(path: Path, n: int) -> None:
    """Successor mode over N communicators, each with a window of its own and a collective
    waiting in it (none ever has a successor), then N launches, each writing outside every
    window, each followed by a sync of its stream: before issue 21 every access and every sync
    asked every communicator."""
    dumps = orjson.dumps
    with open(path, "wb") as fh:
        fh.write(dumps(HEADER) + b"\n")
        for i in range(n):
            fh.write(dumps({"ev": "window", "addr": BASE + i * SIZE, "size": SIZE, "comm": f"c{i}"}) + b"\n")
            fh.write(dumps({"ev": "coll", "cid": i + 1, "comm": f"c{i}", "seq": 0, "op": "all_reduce",
                            "stream": 2, "bufs": [{"addr": BASE + i * SIZE, "size": SIZE, "access": "rw"}]}) + b"\n")
        for i in range(n):
            fh.write(dumps({"ev": "launch", "stream": 1, "op": "k", "writes": [[i * SIZE, SIZE]]}) + b"\n")
            fh.write(dumps({"ev": "sync", "stream": 1}) + b"\n")


def write_graphs(path: Path, n: int) -> None:
    """N CUDA graphs captured (one launch each) and left live, then N allocations freed outside
    every graph's buffers: before issue 21 every free asked every live graph."""
    dumps = orjson.dumps
    with open(path, "wb") as fh:
        fh.write(dumps(HEADER) + b"\n")
        for g in range(n):
            fh.write(dumps({"ev": "graph_begin", "graph": g, "stream": 1}) + b"\n")
            fh.write(dumps({"ev": "launch", "stream": 1, "op": "k", "writes": [[BASE + g * SIZE, SIZE]]}) + b"\n")
            fh.write(dumps({"ev": "graph_end", "graph": g, "stream": 1}) + b"\n")
        for i in range(n):
            fh.write(dumps({"ev": "alloc", "id": i, "addr": i * SIZE, "size": SIZE, "stream": 1,
                            "pool": "default"}) + b"\n")
            fh.write(dumps({"ev": "free", "id": i}) + b"\n")


def write_clocks(path: Path, n: int) -> None:
    """N streams each record an event that stream 0 waits on (stream 0's clock learns N entries),
    then N rounds of a launch and a record on stream 0, over 1,000 event ids: before issue 21
    every record copied stream 0's whole clock (N x N entries copied, and kept)."""
    dumps = orjson.dumps
    with open(path, "wb") as fh:
        fh.write(dumps(HEADER) + b"\n")
        for s in range(1, n + 1):
            fh.write(dumps({"ev": "launch", "stream": s, "op": "k", "writes": [[BASE + s * SIZE, 64]]}) + b"\n")
            fh.write(dumps({"ev": "record", "event": s, "stream": s}) + b"\n")
            fh.write(dumps({"ev": "wait", "event": s, "stream": 0}) + b"\n")
        for i in range(n):
            fh.write(dumps({"ev": "launch", "stream": 0, "op": "k", "writes": [[i * 64, 64]]}) + b"\n")
            fh.write(dumps({"ev": "record", "event": n + 1 + i % 1000, "stream": 0}) + b"\n")


CASES = {"inflight": write_inflight, "successor": write_successor, "windows": write_windows,
         "streams": write_streams, "comms": write_comms, "graphs": write_graphs, "clocks": write_clocks}
PEER = {"successor": "successor", "comms": "successor"}


def run(path: Path, engine: str, core: int, tree: Path = ROOT, peer: str = "local") -> dict:
    cmd = [sys.executable, "-c", _CHILD, json.dumps({"path": str(path), "engine": engine, "peer": peer})]
    if core >= 0 and hasattr(os, "sched_setaffinity"):
        cmd = ["taskset", "-c", str(core), *cmd]
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--engines", nargs="+", default=["compiled"], choices=["compiled", "interpreted"])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--core", type=int, default=0, help="pin runs to this core (-1: no pinning)")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "hazsan-scaling",
                    help="where the generated traces go (default: hazsan-scaling in tempfile.gettempdir())")
    ap.add_argument("--old", type=Path, metavar="TREE",
                    help="also run another hazsan checkout with its engine built in place "
                         "(e.g. `git archive f82bfab | tar -x -C TREE; python setup.py build_ext --inplace`)")
    ap.add_argument("--old-max", type=int, default=100_000, help="largest N given to --old")
    args = ap.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"{'case':9} {'engine':11} {'N':>9} {'events':>9} {'CPU s':>8} {'us/event':>9} {'peak MB':>8} "
          f"{'findings':>9} {'vs smallest':>11}")
    trees = [("", ROOT)] + ([("old ", args.old)] if args.old else [])
    for case in args.cases:
        for label, tree in trees:
            for engine in args.engines:
                first = None
                for n in args.sizes:
                    if label and n > args.old_max:
                        continue
                    path = args.dir / f"{case}-{n}.jsonl"
                    if not path.exists():
                        CASES[case](path, n)
                    r = run(path, engine, args.core, tree, PEER.get(case, "local"))
                    if "error" in r:
                        print(f"{case:9} {label + engine:11} {n:>9,} failed: {r['error']}")
                        continue
                    if r["errors"]:
                        print(f"{case:9} {label + engine:11} {n:>9,} the trace has malformed lines")
                    per = r["cpu"] / max(r["events"], 1) * 1e6
                    first = first or per
                    print(f"{case:9} {label + r['engine']:11} {n:>9,} {r['events']:>9,} {r['cpu']:>8.2f} {per:>9.2f} "
                          f"{r['rss_mb']:>8.0f} {r['findings']:>9,} {per / first:>10.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
