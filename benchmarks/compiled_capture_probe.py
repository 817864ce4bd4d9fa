#!/usr/bin/env python3
"""Issue 30: would compiling capture's per-op path with Cython, as the engine is, pay?

Copies the `sanitizer` package to a scratch folder, compiles there (Cython, pure-Python mode, the
engine's directives) the modules every recorded op runs through: capture/memory.py (the dispatch
mode), capture/block_table.py (the block table), capture/sites.py (the call-site walk) and
trace/writer.py (emit), and runs the tiny-op loop of op_instructions.py against the installed
(interpreted) capture and the compiled copy (PYTHONPATH first), at levels alloc and full:

- CPU time per op, best of --ops ops per round, the variants alternating over --rounds rounds
  (bare, interpreted, compiled for each level), each round a fresh interpreter;
- with --instructions, also instructions per op under callgrind (0 and --instr-ops ops).

One change is made to the copy: the call-site walk starts at `sys._getframe(0)` instead of 1
(a compiled caller has no frame of its own, so depth 1 can be past the top of the stack; frame 0,
interpreted, is the walk itself, which is internal and skipped: same sites).

    .venv/bin/python benchmarks/compiled_capture_probe.py [--rounds 4] [--instructions]

Needs Cython and a C compiler (the test extras and the engine's build have both).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from op_instructions import LOOP, instructions  # noqa: E402

HOT = ("sanitizer/capture/memory.py", "sanitizer/capture/block_table.py", "sanitizer/capture/sites.py",
       "sanitizer/trace/writer.py")
BUILD = """
import sys
from setuptools import Extension, setup
from Cython.Build import cythonize
mods = sys.argv[1:]
sys.argv = [sys.argv[0], "build_ext", "--inplace", "-q"]
setup(ext_modules=cythonize([Extension(m[:-3].replace("/", "."), [m]) for m in mods], language_level=3,
                            quiet=True, compiler_directives={"binding": False, "annotation_typing": False}))
"""
TIMED = """
import json, sys, time, torch
torch.set_num_threads(1)
a = torch.ones(16)
def run(n):
    for _ in range(n):
        b = a + 1.0
run(2000)
n = int(sys.argv[1])
t0 = time.process_time(); run(n); per = (time.process_time() - t0) / n * 1e6
mods = [sys.modules.get(m) for m in ("sanitizer.capture.block_table", "sanitizer.capture.memory")]
print(json.dumps({"us": per, "compiled": [bool(m and m.__file__.endswith(".so")) for m in mods]}))
"""


def build_copy(work: str) -> str:
    """The package copied to work/ with the hot modules compiled there; returns work."""
    shutil.copytree(os.path.join(ROOT, "sanitizer"), os.path.join(work, "sanitizer"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    sites = os.path.join(work, "sanitizer/capture/sites.py")
    text = open(sites).read()
    assert "f = sys._getframe(1)" in text
    open(sites, "w").write(text.replace("f = sys._getframe(1)", "f = sys._getframe(0)"))
    with open(os.path.join(work, "build_hot.py"), "w") as fh:
        fh.write(BUILD)
    subprocess.run([sys.executable, "build_hot.py", *HOT], cwd=work, check=True, capture_output=True, text=True)
    return work


def timed(script: str, n: int, env_extra: dict, trace_dir: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN") and k != "PYTHONPATH"}
    env.update(env_extra, HAZSAN_DIR=trace_dir)
    out = subprocess.run([sys.executable, script, str(n)], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--instructions", action="store_true", help="also callgrind instructions per op")
    p.add_argument("--instr-ops", type=int, default=2000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="hazsan-cycapture-") as work:
        copy = build_copy(os.path.join(work, "pkg"))
        script = os.path.join(work, "timed.py")
        with open(script, "w") as fh:
            fh.write(TIMED)
        variants = {"bare": {}}
        for level in ("alloc", "full"):
            variants[f"{level} interpreted"] = {"HAZSAN": "1", "HAZSAN_LEVEL": level}
            variants[f"{level} compiled"] = {"HAZSAN": "1", "HAZSAN_LEVEL": level, "PYTHONPATH": copy}
        us: dict = {v: [] for v in variants}
        for r in range(args.rounds):
            for v, extra in variants.items():
                res = timed(script, args.ops, extra, os.path.join(work, "traces", f"{r}-{v.replace(' ', '-')}"))
                if extra.get("HAZSAN"):
                    assert all(res["compiled"]) == ("PYTHONPATH" in extra), (v, res)
                us[v].append(res["us"])
        print(f"CPU time per tiny op, {args.rounds} alternating rounds of {args.ops} ops (median, best):")
        bare = statistics.median(us["bare"])
        for v, xs in us.items():
            print(f"  {v:18s} {statistics.median(xs):6.2f} us  {min(xs):6.2f} us  {statistics.median(xs) / bare:5.2f}x bare")
        for level in ("alloc", "full"):
            i, c = statistics.median(us[f"{level} interpreted"]), statistics.median(us[f"{level} compiled"])
            print(f"  {level}: compiled / interpreted {c / i:.3f} (capture's own cost over bare: "
                  f"{(c - bare) / (i - bare):.3f})")
        if args.instructions:
            loop = os.path.join(work, "ops.py")
            with open(loop, "w") as fh:
                fh.write(LOOP)
            for level in ("alloc", "full"):
                for label, extra in (("interpreted", {}), ("compiled", {"PYTHONPATH": copy})):
                    env_extra = {"HAZSAN": "1", "HAZSAN_LEVEL": level, **extra}
                    d = os.path.join(work, "instr", f"{level}-{label}")
                    per = (instructions(loop, args.instr_ops, env_extra, d)
                           - instructions(loop, 0, env_extra, d)) / args.instr_ops
                    print(f"  {level} {label}: {per:,.0f} instructions per op")
    return 0


if __name__ == "__main__":
    sys.exit(main())
