#!/usr/bin/env python3
"""`hazsan check` on traces with very many streams (issue 21): time and peak memory, this checkout
next to an older one.

Cases, each at every --sizes N:

- `launches N`: the issue's hostile trace. N launches, each on a stream of its own, each writing
  16 bytes (all distinct: the trace is clean). Nothing is ever synchronised, so every stream keeps
  its work in flight to the end: an engine that walks the streams in flight per access is
  quadratic (issue 21: 164 s at 2x10^4). Targets: 2x10^4 under 2 s, 10^5 under 10 s, under 300 MB.
- `device-syncs N`: N streams with a launch each, then N rounds of a launch on stream 0 and a
  device-wide `sync`. A sync that takes in every stream's clock costs O(streams) each: quadratic.

Each run is `python -m sanitizer check TRACE --format json` in a fresh interpreter pinned to one
core, timed by a small launcher process (wall and CPU seconds, and the peak RSS of that process
alone, from os.wait4's rusage). `--old REF` adds the same runs on another commit: it is checked
out with `git worktree` into a temporary folder, its engine built in place there (a minute), run
with PYTHONPATH pointing at it, and removed at the end; runs past --old-timeout seconds are
stopped and shown as such. Where both finish, their findings and summaries are compared.

    .venv/bin/python benchmarks/streams_scaling.py                           # 2x10^4 and 10^5, this checkout
    .venv/bin/python benchmarks/streams_scaling.py --old 136293e --old-max 20000   # and the engine before issue 21
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = 1 << 40
TARGET_S = {20_000: 2.0, 100_000: 10.0}
TARGET_MB = 300

# A child's ru_maxrss would include this process's size (Linux keeps the high-water mark across
# exec): a fresh small interpreter starts `hazsan check` and reports its rusage alone.
_LAUNCHER = r"""
import json, os, subprocess, sys, time
spec = json.loads(sys.argv[1])
if spec["core"] >= 0:
    os.sched_setaffinity(0, {spec["core"]})
env = dict(os.environ, PYTHONPATH=spec["tree"])
with open(spec["stdout"], "wb") as out, open(spec["stderr"], "wb") as err:
    start = time.perf_counter()
    proc = subprocess.Popen(spec["cmd"], stdout=out, stderr=err, cwd=spec["tree"], env=env)
    deadline = start + spec["timeout"]
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() > deadline:
            proc.kill()
            _, status, usage = os.wait4(proc.pid, 0)
            print(json.dumps({"timeout": True, "wall": time.perf_counter() - start}))
            sys.exit(0)
        time.sleep(0.01)
    wall = time.perf_counter() - start
print(json.dumps({"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "maxrss_kb": usage.ru_maxrss,
                  "exit": os.waitstatus_to_exitcode(status)}))
"""


def write_launches(path: Path, n: int) -> None:
    with open(path, "w") as fh:
        fh.write(json.dumps({"hazsan": 1, "rank": 0, "generator": "benchmarks/streams_scaling.py"}) + "\n")
        for i in range(n):
            fh.write(f'{{"ev":"launch","stream":"s{i}","writes":[[{BASE + 16 * i},16]]}}\n')


def write_device_syncs(path: Path, n: int) -> None:
    with open(path, "w") as fh:
        fh.write(json.dumps({"hazsan": 1, "rank": 0, "generator": "benchmarks/streams_scaling.py"}) + "\n")
        for i in range(n):
            fh.write(f'{{"ev":"launch","stream":"s{i}","writes":[[{BASE + 16 * i},16]]}}\n')
        for i in range(n):
            fh.write(f'{{"ev":"launch","stream":"s0","writes":[[{BASE + 16 * i},16]]}}\n{{"ev":"sync"}}\n')


CASES = {"launches": write_launches, "device-syncs": write_device_syncs}


def run_check(tree: Path, trace: Path, core: int, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "sanitizer", "check", str(trace), "--format", "json"]
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"cmd": cmd, "core": core, "tree": str(tree), "timeout": timeout,
                "stdout": str(Path(tmp) / "out.json"), "stderr": str(Path(tmp) / "err.txt")}
        launched = subprocess.run([sys.executable, "-c", _LAUNCHER, json.dumps(spec)], capture_output=True, text=True)
        if launched.returncode != 0:
            return {"error": launched.stderr.strip().splitlines()[-1:]}
        res = json.loads(launched.stdout)
        if res.get("timeout"):
            return res
        if res["exit"] not in (0, 1):
            return {"error": Path(spec["stderr"]).read_text()[-500:]}
        report = json.loads(Path(spec["stdout"]).read_text())
    summary = report["summary"]
    return {**res, "rss_mb": res["maxrss_kb"] / 1024, "events": summary["events"], "engine": summary.get("engine"),
            "findings": report["findings"], "by_rule": summary["by_rule"],
            "warnings": summary.get("warnings", [])}


def build_old(ref: str, where: Path) -> Path:
    """`ref` checked out into `where`/tree with its engine compiled in place."""
    tree = where / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref], check=True,
                   capture_output=True)
    print(f"building the engine of {ref} in a temporary worktree ...", flush=True)
    built = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree,
                           capture_output=True, text=True, env=dict(os.environ, HAZSAN_REQUIRE_COMPILED="1"))
    if built.returncode != 0:
        raise SystemExit(f"the engine of {ref} did not build:\n{built.stderr[-2000:]}")
    return tree


def remove_old(tree: Path) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)


def describe(r: dict | None, target_s: float | None = None) -> str:
    if r is None:
        return "not run"
    if "error" in r:
        return f"failed: {r['error']}"
    if r.get("timeout"):
        return f"> {r['wall']:.0f} s (stopped)"
    text = f"{r['wall']:.2f} s wall, {r['cpu']:.2f} s CPU, {r['rss_mb']:.0f} MB"
    if target_s is not None:
        ok = r["wall"] < target_s and r["rss_mb"] < TARGET_MB
        text += f" [{'PASS' if ok else 'FAIL'}: < {target_s:g} s, < {TARGET_MB} MB]"
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[20_000, 100_000])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--old", metavar="REF", help="also run this commit (checked out and built in a temporary worktree)")
    ap.add_argument("--old-max", type=int, default=20_000, help="largest N given to --old (default 20,000)")
    ap.add_argument("--old-timeout", type=float, default=300, help="stop an --old run after this many seconds")
    ap.add_argument("--core", type=int, default=None, help="core to pin runs to (default: the last allowed; -1: none)")
    args = ap.parse_args(argv)
    core = sorted(os.sched_getaffinity(0))[-1] if args.core is None else args.core

    head = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h %s"], capture_output=True,
                          text=True).stdout.strip()[:70]
    print(f"hazsan check on many-stream traces; this checkout: {head}; pinned to core {core}; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory(prefix="hazsan-streams-") as tmp:
        tmp = Path(tmp)
        old_tree = build_old(args.old, tmp) if args.old else None
        try:
            for case in args.cases:
                for n in args.sizes:
                    trace = tmp / f"{case}-{n}.jsonl"
                    CASES[case](trace, n)
                    new = run_check(ROOT, trace, core, timeout=600)
                    old = run_check(old_tree, trace, core, args.old_timeout) \
                        if old_tree is not None and n <= args.old_max else None
                    events = new.get("events", "?")
                    print(f"\n{case} N={n:,} ({events:,} events)" if isinstance(events, int) else f"\n{case} N={n:,}")
                    print(f"  this checkout: {describe(new, TARGET_S.get(n) if case == 'launches' else None)}")
                    if old_tree is not None:
                        print(f"  {args.old}: {describe(old)}")
                        if old and "findings" in old and "findings" in new:
                            same = old["findings"] == new["findings"] and old["by_rule"] == new["by_rule"]
                            print(f"  findings: {'identical' if same else 'DIFFERENT'} ({len(new['findings'])} listed)")
                            if "wall" in old and new.get("wall"):
                                print(f"  speed-up: {old['wall'] / new['wall']:.1f}x wall")
                    time.sleep(0.5)
        finally:
            if old_tree is not None:
                remove_old(old_tree)
    return 0


if __name__ == "__main__":
    sys.exit(main())
