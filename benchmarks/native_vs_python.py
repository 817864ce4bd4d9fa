#!/usr/bin/env python3
"""The two engine backends side by side: same trace, same core, events per second and the ratio.

`analyze()` (what `hazsan check` runs) with the per-rank engine in Python (engine.RankAnalyzer)
and in C (native.RankAnalyzer, sanitizer/rules/_fastengine.c); the reading and orjson parsing are
the same Python code in both. Each run is a fresh interpreter pinned to one core; the figures are
its CPU seconds inside analyze() (best of --repeats; CPU time does not count time spent
descheduled, so it is the steadier figure on a shared machine) and its peak RSS. The runs
alternate between backends so that a change in machine load hits both.

The C engine runs three ways: as `hazsan check` runs it (raw lines, native.RankAnalyzer.read_batches,
read by the C line scanner straight into the engine, orjson only for lines it leaves); raw lines
with the scanner off (orjson.loads on each line inside the C loop, the previous default); and fed
parsed batches (TraceFile.batches: orjson dicts, what any analyzer can be given).

It also prints:
  - the parse floor: the reader alone (lines read, orjson.loads on each, nothing analysed);
    `engine us/event` is a run's time minus that floor (the raw-line runs: minus the GC-off floor,
    since they leave the collector nothing to walk; with the C scanner nothing is parsed by
    orjson, so there it is only a comparison);
  - the same runs with Python's cyclic GC switched off for the duration (`--gc-off` column): the
    parsed events are short-lived containers, and the collector's passes over them are a large
    share of the native run;
  - whether both backends gave identical findings and summaries (a digest of their JSON).

    .venv/bin/python benchmarks/native_vs_python.py                    # 1,000,000 events
    .venv/bin/python benchmarks/native_vs_python.py --events 5000000 --repeats 1
    .venv/bin/python benchmarks/native_vs_python.py --events 300000 --ranks 2 --inject 12

The trace comes from gen_decode_trace.py (kept under --trace-dir and reused, as
check_throughput.py does). Exit status 1 when the backends disagree, else 0.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import gen_decode_trace as gen  # noqa: E402

# One measured run, in its own interpreter. Prints a JSON line; the launcher adds the peak RSS.
_CHILD = r"""
import gc, hashlib, json, os, sys, time
spec = json.loads(sys.argv[1])
os.environ["HAZSAN_ENGINE"] = "native" if spec["engine"].startswith("native") else "python"
import orjson
from sanitizer.rules import engine
if spec["engine"].startswith("native"):
    from sanitizer.rules import native
    if not native.available:
        print(json.dumps({"error": native.reason})); sys.exit(0)
    cls = native.RankAnalyzer   # also what HAZSAN_ENGINE=native selects: raw lines, C line scanner
    if spec["engine"] == "native-parsed":
        # fed parsed events (TraceFile.batches: orjson dicts), as any analyzer can be
        class ParsedAnalyzer(native.RankAnalyzer):
            def read_batches(self, size=4096):
                return self.trace.batches(size)
        cls = ParsedAnalyzer
    elif spec["engine"] == "native-orjson":
        # raw lines, each parsed by orjson.loads inside the C loop (the scanner switched off)
        native._fastengine._scanner(False)
    # analyze() takes its class from native.analyzer_class(), i.e. native.RankAnalyzer
    native.RankAnalyzer = engine.RankAnalyzer = cls
if spec["gc_off"]:
    gc.disable()
out = {}
cpu, wall = time.process_time(), time.perf_counter()
if spec["engine"] == "parse":
    from sanitizer.trace.reader import expand_paths, open_trace
    n = 0
    for p in expand_paths(spec["paths"]):
        for first, items in open_trace(p).batches(4096):
            n += len(items)
    out["events"] = n
else:
    a = engine.analyze(spec["paths"], peer_completion=spec["peer_completion"])
    out["events"] = a.summary["events"]
    out["by_rule"] = a.summary["by_rule"]
    out["errors"] = len(a.errors)
cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
if spec["engine"] != "parse":
    doc = {"findings": [f.to_dict() for f in a.findings], "summary": a.summary}
    out["digest"] = hashlib.sha256(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)).hexdigest()[:16]
out.update(cpu=cpu, wall=wall)
print(json.dumps(out))
"""

# Starts the child from a small interpreter: a child's ru_maxrss includes the high-water mark of
# the process it was forked from, so this (possibly large) process must not be its parent. It
# waits with os.wait4 to get the child's own rusage.
_LAUNCHER = r"""
import json, os, subprocess, sys, tempfile
spec = json.loads(sys.argv[1])
os.sched_setaffinity(0, {spec["core"]})
with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
    proc = subprocess.Popen([sys.executable, "-c", spec["child"], json.dumps(spec)], cwd=spec["cwd"],
                            stdout=out, stderr=err)
    _, status, usage = os.wait4(proc.pid, 0)
    out.seek(0); err.seek(0)
    print(json.dumps({"out": out.read().decode(), "err": err.read().decode()[-3000:],
                      "rc": os.waitstatus_to_exitcode(status), "maxrss_kb": usage.ru_maxrss}))
"""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def ensure_trace(args) -> Path:
    """The trace check_throughput.py would use for the same options (shared directory naming)."""
    name = f"decode-e{args.events}-r{args.ranks}-i{args.inject}-s{args.seed}" + ("-lean" if args.lean else "")
    out = args.trace_dir / name
    meta = out / "meta.json"
    if meta.exists():
        m = orjson.loads(meta.read_bytes())
        if m.get("generator_version") == gen.GENERATOR_VERSION and all((out / f["file"]).exists() for f in m["files"]):
            return out
    print(f"generating {args.events:,} events x {args.ranks} rank(s) into {out} ...", flush=True)
    gen.generate(out, events=args.events, ranks=args.ranks, seed=args.seed, inject=args.inject,
                 gzip_level=None, lean=args.lean)
    return out


def run_one(engine: str, paths: list[str], core: int, gc_off: bool, peer_completion: str) -> dict:
    spec = {"engine": engine, "paths": paths, "core": core, "gc_off": gc_off,
            "peer_completion": peer_completion, "child": _CHILD, "cwd": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", _LAUNCHER, json.dumps(spec)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"launcher failed:\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout)
    if res["rc"] != 0 or not res["out"].strip():
        raise SystemExit(f"{engine} run failed (exit {res['rc']}):\n{res['err']}")
    out = json.loads(res["out"].strip().splitlines()[-1])
    if "error" in out:
        raise SystemExit(f"native engine unavailable: {out['error']}")
    out["peak_rss_mb"] = res["maxrss_kb"] / 1024
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=1_000_000, help="events per rank (default 1,000,000)")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--inject", type=int, default=0, help="planted hazards (gen_decode_trace.py --inject)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lean", action="store_true", help="trace without the optional fields")
    ap.add_argument("--repeats", type=int, default=3, help="runs per backend; the best CPU time counts")
    ap.add_argument("--peer-completion", default="local", choices=["local", "successor"])
    ap.add_argument("--core", type=int, default=None, help="CPU core to pin to (default: the last one allowed)")
    ap.add_argument("--trace-dir", type=Path, default=Path(tempfile.gettempdir()) / "hazsan-bench")
    ap.add_argument("--skip-gc-off", action="store_true", help="leave out the runs with the cyclic GC off")
    args = ap.parse_args()

    core = args.core if args.core is not None else max(os.sched_getaffinity(0))
    trace = ensure_trace(args)
    from sanitizer.trace.reader import expand_paths

    paths = [str(p) for p in expand_paths([trace])]
    size_mb = sum(Path(p).stat().st_size for p in paths) / 2**20
    head = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h %s"], capture_output=True, text=True).stdout.strip()
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, load average {loadavg()} (before); pinned to core {core}")
    print(f"python {platform.python_version()}, orjson {orjson.__version__}, hazsan {head[:60]}")
    print(f"trace: {trace} ({len(paths)} file(s), {size_mb:,.0f} MiB, {args.events:,} events per rank), "
          f"--peer-completion {args.peer_completion}")

    variants = [("parse", False), ("python", False), ("native", False), ("native-orjson", False),
                ("native-parsed", False)]
    if not args.skip_gc_off:
        variants += [("parse", True), ("python", True), ("native-parsed", True)]
    best: dict = {}
    for rep in range(args.repeats):
        for engine, gc_off in variants:
            r = run_one(engine, paths, core, gc_off, args.peer_completion)
            key = (engine, gc_off)
            if key not in best or r["cpu"] < best[key]["cpu"]:
                best[key] = r
            print(f"  run {rep + 1}/{args.repeats} {engine:14s}{' gc-off' if gc_off else '       '} "
                  f"{r['events'] / r['cpu']:>12,.0f} events/s  {r['peak_rss_mb']:6.0f} MB", flush=True)

    from tabulate import tabulate

    names = {"parse": "reader + orjson only (floor)", "python": "Python engine",
             "native": "C engine, raw lines, C scanner", "native-orjson": "C engine, raw lines, orjson",
             "native-parsed": "C engine, parsed batches"}
    rows = []
    for gc_off in ([False, True] if not args.skip_gc_off else [False]):
        floor = best[("parse", gc_off)]
        py = best[("python", gc_off)]
        for engine in ("parse", "python", "native", "native-orjson", "native-parsed"):
            if (engine, gc_off) not in best:
                continue
            r = best[(engine, gc_off)]
            n = r["events"]
            us = r["cpu"] / n * 1e6
            # the raw-line paths leave no parsed batches for the GC: their floor is the GC-off one
            # (for the scanner path the figure is only a comparison: it does not parse with orjson)
            base = best.get(("parse", True), floor) if engine in ("native", "native-orjson") else floor
            rows.append([
                names[engine] + (" [GC off]" if gc_off else ""),
                f"{n:,}", f"{r['cpu']:.2f}", f"{n / r['cpu']:,.0f}", f"{us:.3f}",
                "" if engine == "parse" else f"{us - base['cpu'] / base['events'] * 1e6:.3f}",
                "" if engine == "parse" else f"{py['cpu'] / r['cpu']:.2f}x",
                f"{r['peak_rss_mb']:.0f}",
            ])
    print()
    print(tabulate(rows, headers=["analyze() with", "events", "CPU s", "events/s", "us/event",
                                  "engine us/event", "vs Python", "peak RSS MB"], disable_numparse=True))
    print(f"\nload average {loadavg()} (after)")
    same = all(best[("python", g)]["digest"] == best[(e, g)]["digest"]
               for (e, g) in best if e != "parse")
    print(f"findings: {best[('python', False)]['by_rule'] or 'none'}; malformed lines: {best[('python', False)]['errors']}")
    print(f"identical findings and summary from both backends: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
