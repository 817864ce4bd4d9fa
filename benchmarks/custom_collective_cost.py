#!/usr/bin/env python3
"""What capture adds to a serving engine's own collective op, per call (issue 30).

vLLM's CPU workers run their tensor-parallel all-reduces through `_C.shm_allreduce`, an op the
engine registers with the dispatcher (collective_ops.CUSTOM); SGLang's and vLLM's GPU custom
all-reduce are the same kind of op. Each step of a tiny model makes a handful, and each costs
capture a `coll` and a `coll_done`. This script times, in one process per variant, steps of
`--layers` x (a fresh 1 KiB tensor, a fill, one call of a do-nothing collective op registered as
vLLM's is: `hzbench::shm_allreduce(Tensor(a!) data, int handle) -> ()`, recorded through
`register_collective_op`), with `--colls 0` as the same step without the calls, so that

    per collective = ((variant, colls) - (bare, colls) - ((variant, 0) - (bare, 0))) / layers

is capture's cost of the collective alone. Variants: bare, alloc-native and full-native
(HAZSAN=1, the native recorder), alloc-native-pycolls (the same with HAZSAN_NATIVE_COLLECTIVES=0:
Python records the collectives); `--python` adds the dispatch mode's alloc. Each variant runs
`--rounds` times interleaved, each run in its own interpreter (HAZSAN=1 goes through the .pth
bootstrap), `--steps` steps after `--warmup`, the collector off, thread CPU per step; medians.
Every step is `with sanitizer.step(n)`, so a step end's flush falls inside the timing as in a
server.

    .venv/bin/python benchmarks/custom_collective_cost.py [--rounds 3] [--profile VARIANT]

`--profile alloc-native` prints a cProfile of one captured run instead (where the time goes).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("bare", "alloc-native", "full-native", "alloc-native-pycolls")
# alloc-native-pycolls: the native recorder with the collectives recorded by Python
# (HAZSAN_NATIVE_COLLECTIVES=0), as before the recorder wrote them


def child(args) -> None:
    import torch
    import sanitizer
    lib = torch.library.Library("hzbench", "DEF")
    lib.define("shm_allreduce(Tensor(a!) data, int handle) -> ()")
    lib.impl("shm_allreduce", lambda data, handle: None, "CPU")
    if args.variant != "bare":
        if not sanitizer.enabled():
            raise SystemExit("HAZSAN=1 did not start capture: is hooks/hazsan_capture.pth installed?")
        from sanitizer.capture import collectives
        collectives.register_collective_op("hzbench::shm_allreduce", kind="vllm_shm", comm="handle")
    op = torch.ops.hzbench.shm_allreduce
    torch.set_num_threads(1)

    def one_step(n):
        with sanitizer.step(n):
            for _ in range(args.layers):
                x = torch.empty(256)
                x.fill_(1.0)
                if args.colls:
                    op(x, 0)

    gc.disable()
    out = {}
    for colls in (0, 1):
        args.colls = colls
        for n in range(args.warmup):
            one_step(n)
        if args.profile:
            if not colls:
                continue
            import cProfile
            import pstats
            prof = cProfile.Profile()
            prof.enable()
            for n in range(args.steps):
                one_step(args.warmup + n)
            prof.disable()
            pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
            return
        cpu = []
        for n in range(args.steps):
            c0 = time.thread_time_ns()
            one_step(args.warmup + n)
            cpu.append(time.thread_time_ns() - c0)
        out[colls] = statistics.median(cpu) / 1e3
    print(json.dumps(out))


def run(variant, args, trace_dir, profile=False) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN")}
    if variant != "bare":
        env.update(HAZSAN="1", HAZSAN_LEVEL=variant.split("-")[0], HAZSAN_NATIVE="1",
                   HAZSAN_DIR=os.path.join(trace_dir, variant, f"run{time.monotonic_ns()}"))
        if variant.endswith("-python"):
            env["HAZSAN_NATIVE"] = "0"
        if variant.endswith("-pycolls"):
            env["HAZSAN_NATIVE_COLLECTIVES"] = "0"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, f"--layers={args.layers}",
           f"--steps={args.steps}", f"--warmup={args.warmup}"] + (["--profile", variant] if profile else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{out.stderr[-3000:]}")
    if profile:
        print(out.stderr)
        return {}
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child")
    p.add_argument("--profile")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--python", action="store_true", help="also the dispatch mode's alloc (HAZSAN_NATIVE=0)")
    p.add_argument("--colls", type=int, default=1)
    p.add_argument("--variant")
    args = p.parse_args()
    if args.child:
        args.variant = args.child
        child(args)
        return
    variants = VARIANTS + (("alloc-python",) if args.python else ())
    with tempfile.TemporaryDirectory(prefix="hazsan-coll-") as d:
        if args.profile:
            run(args.profile, args, d, profile=True)
            return
        per = {v: {0: [], 1: []} for v in variants}
        for _ in range(args.rounds):
            for v in variants:
                r = run(v, args, d)
                for k in (0, 1):
                    per[v][k].append(r[k])
    med = {v: {k: statistics.median(xs) for k, xs in per[v].items()} for v in variants}
    print(f"{args.layers} collectives a step, {args.steps} steps, {args.rounds} round(s); thread CPU "
          f"per step, medians")
    print(f"  {'variant':<22}{'no calls us':>12}{'with calls us':>15}{'capture per collective us':>28}")
    for v in variants:
        extra = ((med[v][1] - med["bare"][1]) - (med[v][0] - med["bare"][0])) / args.layers
        print(f"  {v:<22}{med[v][0]:>12.1f}{med[v][1]:>15.1f}{extra:>28.1f}")
    bare_per = (med["bare"][1] - med["bare"][0]) / args.layers
    print(f"  (a bare call of the op: {bare_per:.1f} us)")


if __name__ == "__main__":
    main()
