#!/usr/bin/env python3
"""The one engine compiled and interpreted, side by side on one trace, one core, one run.

Each measurement is a fresh interpreter pinned to one core; the figure is its CPU seconds inside
analyze() (best of --repeats; CPU time leaves out time spent descheduled, so it is the steadier
figure on a shared machine) and its peak RSS. The runs alternate so that load changes hit all.
Also: the decode floor (reading the lines and msgspec decoding them into typed events, no engine),
and whether both engines gave identical findings and summaries.

`--old DIR[:ENGINE,...]` adds runs of another hazsan checkout with HAZSAN_ENGINE set to each ENGINE
(default native,python): `--old /path/to/main:compiled,interpreted` for a checkout of today's
engine (its extension built in place), or the last commit with the C engine (`git archive 97d8d8c |
tar -x -C DIR` plus its built extension), as the figures of issue 12 were taken. Whether each of
its runs gave the same findings and summary as this checkout's compiled engine is printed too.

    .venv/bin/python benchmarks/engines_side_by_side.py                       # 1,000,000 events
    .venv/bin/python benchmarks/engines_side_by_side.py --old ../old-hazsan --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

_CHILD = r"""
import gc, hashlib, json, os, resource, sys, time
spec = json.loads(sys.argv[1])
if spec.get("tree"):
    sys.path.insert(0, spec["tree"])
    os.environ["HAZSAN_ENGINE"] = spec["engine"]
out = {}
cpu = time.process_time()
if spec["engine"] == "decode":
    from sanitizer.trace.events import EventDecoder
    decode = EventDecoder._decoder.decode
    n = 0
    gc.disable()
    for p in spec["paths"]:
        with open(p, "rb", buffering=1 << 20) as fh:
            fh.readline()
            for line in fh:
                decode(line); n += 1
    out["events"] = n
else:
    if spec.get("tree"):
        try:
            from sanitizer.rules.driver import analyze
        except ImportError:  # a checkout from before the driver (the C engine's)
            from sanitizer.rules.engine import analyze
            a = analyze(spec["paths"])
        else:
            a = analyze(spec["paths"], engine=spec["engine"])
    else:
        from sanitizer.rules.driver import analyze
        a = analyze(spec["paths"], engine=spec["engine"])
    s = dict(a.summary); s.pop("engine", None)
    out["events"] = s["events"]
    out["digest"] = hashlib.sha256(json.dumps([[f.to_dict() for f in a.findings], s], sort_keys=True, default=str).encode()).hexdigest()[:12]
    out["engine"] = a.summary.get("engine", spec["engine"])
out["cpu"] = time.process_time() - cpu
out["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


def run(spec: dict, core: int) -> dict:
    r = subprocess.run(["taskset", "-c", str(core), sys.executable, "-c", _CHILD, json.dumps(spec)],
                       capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"{spec}: {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--trace-dir", default=str(Path(tempfile.gettempdir()) / "hazsan-bench"),
                    help="cache of generated traces, reused (default: hazsan-bench in tempfile.gettempdir())")
    ap.add_argument("--core", type=int, default=None)
    ap.add_argument("--old", action="append", default=[], metavar="DIR[:ENGINE,...]")
    args = ap.parse_args(argv)
    out = Path(args.trace_dir) / f"decode-{args.events}-r{args.ranks}"
    if not any(out.glob("rank*.jsonl")):
        subprocess.run([sys.executable, str(HERE / "gen_decode_trace.py"), "--events", str(args.events),
                        "--ranks", str(args.ranks), "--out", str(out)], check=True)
    paths = [str(p) for p in sorted(out.glob("rank*.jsonl"))]
    core = args.core if args.core is not None else sorted(os.sched_getaffinity(0))[-1]
    variants = [("compiled", None), ("interpreted", None), ("decode", None)]
    for item in args.old:
        tree, _, engines = item.partition(":")
        variants += [(e, str(Path(tree).resolve())) for e in (engines or "native,python").split(",")]
    best: dict = {}
    for _ in range(args.repeats):
        for engine, tree in variants:
            r = run({"engine": engine, "tree": tree, "paths": paths}, core)
            key = (engine, tree)
            if key not in best or r["cpu"] < best[key]["cpu"]:
                best[key] = r
    print(f"trace: {out} ({sum(r['events'] for (e, t), r in best.items() if (e, t) == ('compiled', None)):,} events), "
          f"core {core}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, best of {args.repeats} by CPU")
    print(f"{'engine':<34} {'CPU s':>7} {'events/s':>12} {'peak RSS MB':>12}  findings digest")
    for (engine, tree), r in best.items():
        name = engine if tree is None else f"{engine} @ {tree}"
        if engine == "decode":
            name = "decode only (msgspec, no engine)"
        print(f"{name:<34} {r['cpu']:>7.2f} {r['events'] / r['cpu']:>12,.0f} {r['rss_mb']:>12.1f}  {r.get('digest', '')}")
    for (engine, tree), r in best.items():
        if tree is not None:
            print(f"{engine} @ {tree} vs compiled: {r['cpu'] / best[('compiled', None)]['cpu']:.2f}x the CPU time, findings and summary "
                  f"{'identical' if r.get('digest') == best[('compiled', None)].get('digest') else 'DIFFERENT'}")
    same = best[("compiled", None)].get("digest") == best[("interpreted", None)].get("digest")
    print(f"compiled vs interpreted: {best[('interpreted', None)]['cpu'] / best[('compiled', None)]['cpu']:.2f}x, "
          f"findings and summary {'identical' if same else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
