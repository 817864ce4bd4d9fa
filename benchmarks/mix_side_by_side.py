#!/usr/bin/env python3
"""`hazsan check` on the decode trace and on other event mixes, side by side in one run (issue 30,
part 2: traces the benchmarks did not generate).

Generates (or reuses, under --trace-dir) a binary trace per mix with gen_decode_trace.py (`decode`
is the layer model; anything else a --mix value), then runs `python -m sanitizer check` on each in
a fresh interpreter pinned to one core, the mixes in turn, --rounds rounds, so that load changes
hit them all. Prints each mix's measured shares, the best CPU seconds (interpreter start-up
included), events/s of CPU and the ratio to the first mix; every run's findings must be those of
the first run of its mix (exit 1 otherwise). `--instructions` adds callgrind's instructions per
event of decoding, feed_batch and the whole analyze() for each (feed_instructions.py --stage all):
the load-independent figures.

    .venv/bin/python benchmarks/mix_side_by_side.py                                  # decode, alloc-heavy
    .venv/bin/python benchmarks/mix_side_by_side.py --events 2000000 --rounds 5 \\
        --mix decode --mix alloc-heavy --mix alloc-heavy,ids=capture --instructions
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import gen_decode_trace as gen  # noqa: E402

TARGET = 1_500_000


def spec_of(mix: str) -> str:
    """A mix name with extra parameters (`alloc-heavy,ids=capture`) spelled out in full."""
    name, _, extra = mix.partition(",")
    if name in gen.MIXES:
        return gen.MIXES[name] + ("," + extra if extra else "")
    return mix


def ensure(mix: str, events: int, seed: int, root: Path) -> Path:
    out = root / ("mix-" + "".join(c if c.isalnum() else "_" for c in mix) + f"-e{events}-s{seed}")
    meta = out / "meta.json"
    if meta.exists():
        m = json.loads(meta.read_text())
        if m.get("generator_version") == gen.GENERATOR_VERSION and all((out / f["file"]).exists() for f in m["files"]):
            return out
    gen.generate(out, events=events, seed=seed, fmt="binary", mix=mix if mix == "decode" else spec_of(mix))
    return out


def shares(trace: Path) -> dict:
    """Event kinds in the trace, % of its events (from `hazsan cat`)."""
    out = subprocess.run([sys.executable, "-m", "sanitizer", "cat", str(trace / "rank0.hzs")],
                         capture_output=True, cwd=ROOT, check=True).stdout.splitlines()[1:]
    kinds = Counter(json.loads(line)["ev"] for line in out)
    n = sum(kinds.values())
    return {k: 100 * v / n for k, v in kinds.most_common()}


_LAUNCHER = r"""
import json, os, subprocess, sys
spec = json.loads(sys.argv[1])
os.sched_setaffinity(0, {spec["core"]})
with open(spec["stdout"], "wb") as out:
    proc = subprocess.Popen(spec["cmd"], stdout=out, stderr=subprocess.DEVNULL, cwd=spec["cwd"])
    _, status, usage = os.wait4(proc.pid, 0)
print(json.dumps({"cpu": usage.ru_utime + usage.ru_stime, "exit": os.waitstatus_to_exitcode(status)}))
"""


def check(trace: Path, core: int) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        stdout = os.path.join(tmp, "report.json")
        spec = {"core": core, "stdout": stdout, "cwd": str(ROOT),
                "cmd": [sys.executable, "-m", "sanitizer", "check", str(trace), "--format", "json"]}
        res = json.loads(subprocess.run([sys.executable, "-c", _LAUNCHER, json.dumps(spec)],
                                        capture_output=True, text=True, check=True).stdout)
        report = json.loads(Path(stdout).read_text())
    report["summary"].pop("seconds", None)
    return res["cpu"], report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--events", type=int, default=1_000_000, help="events per trace (default 1,000,000)")
    ap.add_argument("--mix", action="append", help="a mix (repeatable; default: decode, alloc-heavy)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each, alternating (default 3)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--core", type=int, default=None, help="the core to pin to (default: the last one allowed)")
    ap.add_argument("--trace-dir", type=Path, default=Path(tempfile.gettempdir()) / "hazsan-bench")
    ap.add_argument("--instructions", action="store_true",
                    help="also count instructions per event with callgrind (feed_instructions.py --stage all)")
    args = ap.parse_args(argv)
    mixes = args.mix or ["decode", "alloc-heavy"]
    core = sorted(os.sched_getaffinity(0))[-1] if args.core is None else args.core
    print(f"== hazsan check on {len(mixes)} mixes, {args.events:,} events each, binary, core {core}, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    traces = {m: ensure(m, args.events, args.seed, args.trace_dir) for m in mixes}
    for m, t in traces.items():
        s = shares(t)
        print(f"{m}: {t}\n   " + ", ".join(f"{k} {v:.1f}%" for k, v in s.items() if v >= 0.05))
    best: dict = {}
    first: dict = {}
    ok = True
    for r in range(args.rounds):
        for m, t in traces.items():
            cpu, report = check(t, core)
            best[m] = min(best.get(m, cpu), cpu)
            if m not in first:
                first[m] = report
            elif report != first[m]:
                ok = False
                print(f"MISMATCH: {m}, round {r + 1}: the report differs from the first run's")
    base = best[mixes[0]]
    print(f"\n{'mix':<44} {'best CPU s':>10} {'events/s CPU':>13} {'vs ' + mixes[0][:12]:>16} findings")
    for m in mixes:
        n = first[m]["summary"]["events"]
        rate = n / best[m]
        print(f"{m:<44} {best[m]:>10.2f} {rate:>13,.0f} {best[m] / base:>15.2f}x "
              f"{first[m]['summary'].get('findings', 0)}  {'PASS' if rate >= TARGET else 'FAIL'} (>= {TARGET:,})")
    if args.instructions:
        print("\ninstructions per event (callgrind; decode = reading + decoding, feed = feed_batch):")
        for m, t in traces.items():
            run = subprocess.run([sys.executable, str(HERE / "feed_instructions.py"), str(t), "--stage", "all"],
                                 capture_output=True, text=True, cwd=ROOT)
            per = [line.rsplit(" per event", 1)[0].rsplit(" ", 1)[-1] for line in run.stdout.splitlines()]
            print(f"   {m:<44} feed {per[0] if per else '?':>6}  decode {per[1] if len(per) > 1 else '?':>6}  "
                  f"analyze {per[2] if len(per) > 2 else '?':>6}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
