"""Capture's cost per tiny op in instructions (callgrind): load-independent, for side-by-side
comparisons on a shared machine where CPU-time figures move by 20-50%.

Each variant runs the same loop of tiny ops (a 16-element add, a new storage each) in its own
interpreter under `valgrind --tool=callgrind`, once with 0 ops and once with --ops; the
difference divided by --ops is the cost of one op, interpreter start-up and torch's import
cancelled out (what capture writes at exit is counted: the trace is flushed then). Variants: bare,
a no-op TorchDispatchMode, HAZSAN=1 at alloc (the native recorder: `hazsan native build` first),
at alloc with the dispatch mode (HAZSAN_NATIVE=0), at full (native: launches from its RecordFunction
observer) and at full with the dispatch mode.
Issue 30's per-op goal: alloc within 2x the no-op mode.

    .venv/bin/python benchmarks/op_instructions.py                # about 10 minutes on 2 cores
    .venv/bin/python benchmarks/op_instructions.py --variants noop alloc --ops 2000
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

LOOP = """
import os, sys, torch
if os.environ.get("HAZSAN_BENCH_NOOP"):
    from torch.utils._python_dispatch import TorchDispatchMode
    class NoOp(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            return func(*a, **(kw or {}))
    NoOp().__enter__()
a = torch.ones(16)
for _ in range(int(sys.argv[1])):
    b = a + 1.0
"""
VARIANTS = {"bare": {}, "noop": {"HAZSAN_BENCH_NOOP": "1"},
            # alloc: the native recorder (`hazsan native build` first); alloc-dispatch: the dispatch mode
            "alloc": {"HAZSAN": "1", "HAZSAN_LEVEL": "alloc", "HAZSAN_NATIVE": "1"},
            "alloc-dispatch": {"HAZSAN": "1", "HAZSAN_LEVEL": "alloc", "HAZSAN_NATIVE": "0"},
            # full: launches from the recorder's RecordFunction observer; full-dispatch: the dispatch mode
            "full": {"HAZSAN": "1", "HAZSAN_LEVEL": "full", "HAZSAN_NATIVE": "1"},
            "full-dispatch": {"HAZSAN": "1", "HAZSAN_LEVEL": "full", "HAZSAN_NATIVE": "0"}}


def instructions(script: str, n: int, extra: dict, trace_dir: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN")}
    env.update(extra, PYTHONHASHSEED="0", HAZSAN_DIR=os.path.join(trace_dir, f"n{n}"))
    out = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, script, str(n)],
                         env=env, capture_output=True, text=True, check=True)
    m = re.search(r"Collected : (\d+)", out.stderr)
    if m is None:
        raise SystemExit(f"no callgrind total in:\n{out.stderr[-2000:]}")
    return int(m.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=4000)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = p.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed")
    tmp = tempfile.mkdtemp(prefix="hazsan-opinstr-")
    script = os.path.join(tmp, "ops.py")
    with open(script, "w") as f:
        f.write(LOOP)
    per = {}
    for v in args.variants:
        d = os.path.join(tmp, v)
        per[v] = (instructions(script, args.ops, VARIANTS[v], d) - instructions(script, 0, VARIANTS[v], d)) / args.ops
        print(f"{v:>14}: {per[v]:10,.0f} instructions per op", flush=True)
    if "noop" in per:
        for v in ("alloc", "alloc-dispatch", "full", "full-dispatch"):
            if v in per:
                print(f"{v} / no-op mode: {per[v] / per['noop']:.2f}x (goal for alloc: 2x)")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
