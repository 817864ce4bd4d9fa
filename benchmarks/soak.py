"""Soak: a long CPU decode loop under capture, memory sampled over time (issue 14).

    .venv/bin/python benchmarks/soak.py                           # >= 200,000 events per rank, 2 ranks
    .venv/bin/python benchmarks/soak.py --events 400000 --max-events 100000

Each rank (gloo, forked) runs decode steps of a small MLP stack (matmuls, activations, an
all-reduce every other layer, a step marker per step) until its writer has taken --events
events, sampling its own RSS every --sample steps. The same loop runs once without capture
(HAZSAN unset) as the baseline. It prints, per rank: events captured, RSS at 10/50/100 % of the
run, the growth from the middle of the run to its end in MB per 100,000 events, and the writer's
own bound (buffer events x bytes per buffered event); then `hazsan check` on the traces (wall,
peak RSS, verdict). With --max-events the writer stops at that many events and counts the rest as
dropped: memory must stay flat past that point too.
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

WORKER = r'''
import json, os, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp
import sanitizer
from sanitizer.capture import runtime

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

def worker(rank, world, init, target, sample, out, captured, steps_marked):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    layers = [torch.randn(256, 256) * 0.05 for _ in range(8)]
    cap = runtime.active()
    samples, step, t0 = [], 0, time.monotonic()
    events_per_step = None
    while True:
        if steps_marked:
            sanitizer.step(step, tokens=16)   # flushes: the buffer holds one step
        x = torch.randn(16, 256)
        for i, w in enumerate(layers):
            h = torch.relu(x @ w)
            if i % 2:
                dist.all_reduce(h)
                h = h / world
            x = h + x
        float(x.sum())
        step += 1
        if cap is not None:
            w_ = cap.writer
            events = w_._written + len(w_._buf) + w_.dropped_total
            done = events >= target
        else:              # the baseline runs the capture run's steps (target < 0: -steps)
            events = step
            done = step >= -target
        if step % sample == 0:
            samples.append((events, rss_mb(), time.monotonic() - t0))
        # every rank stops at the same step (collectives must pair up): rank 0 decides
        flag = torch.tensor([1.0 if done else 0.0])
        dist.broadcast(flag, 0)
        if flag.item():
            break
    samples.append((events, rss_mb(), time.monotonic() - t0))
    res = {"rank": rank, "steps": step, "samples": samples}
    if cap is not None:
        cap.writer.flush()
        res.update(written=cap.writer._written, dropped=cap.writer.dropped_total,
                   buffer_events=cap.writer.buffer_events, live_blocks=len(cap.blocks.live))
    with open(os.path.join(out, f"soak{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    target, sample, out, world = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    steps_marked = sys.argv[5] == "1"
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    mp.start_processes(worker, args=(world, f"tcp://127.0.0.1:{port}", target, sample, out,
                                     runtime.active() is not None, steps_marked),
                       nprocs=world, start_method="fork")
'''


def _run(label, target, sample, ranks, env_extra, workdir, steps_marked=True):
    out = os.path.join(workdir, label)
    os.makedirs(out, exist_ok=True)
    script = os.path.join(workdir, "soak_worker.py")
    with open(script, "w") as f:
        f.write(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN")}
    env.update(env_extra, PYTHONWARNINGS="ignore")
    t0 = time.monotonic()
    subprocess.run([sys.executable, script, str(target), str(sample), out, str(ranks), "1" if steps_marked else "0"],
                   env=env, check=True)
    wall = time.monotonic() - t0
    return wall, [json.load(open(os.path.join(out, f"soak{r}.json"))) for r in range(ranks)]


def _at(samples, frac):
    return samples[min(len(samples) - 1, int(frac * (len(samples) - 1)))]


def _growth_per_100k(samples):
    """RSS growth from the middle of the run to its end, per 100,000 events (least squares)."""
    half = samples[len(samples) // 2:]
    xs = [s[0] for s in half]
    ys = [s[1] for s in half]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 0.0 if var == 0 else 1e5 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


def _check(traces):
    code = ("import os, resource, subprocess, sys\n"
            "p = subprocess.run([sys.executable, '-m', 'sanitizer', 'check', sys.argv[1], '--format', 'json'],"
            " capture_output=True, text=True)\n"
            "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)\n"
            "sys.stderr.write(p.stdout)\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code, traces], capture_output=True, text=True)
    wall = time.monotonic() - t0
    rc, peak = r.stdout.split()
    summary = json.loads(r.stderr)["summary"]
    return wall, int(rc), float(peak), summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=200_000, help="captured events per rank (default 200,000)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sample", type=int, default=50, help="sample RSS every N steps")
    ap.add_argument("--max-events", type=int, default=None, help="HAZSAN_MAX_EVENTS for the capture run")
    ap.add_argument("--buffer-events", type=int, default=None, help="HAZSAN_BUFFER_EVENTS")
    ap.add_argument("--no-steps", action="store_true",
                    help="no step markers: the writer flushes only when its buffer is full or every "
                         "HAZSAN_FLUSH_SECONDS, so its buffer bound shows")
    ap.add_argument("--keep", metavar="DIR", help="keep traces and samples here")
    args = ap.parse_args(argv)

    workdir = args.keep or tempfile.mkdtemp(prefix="hazsan-soak-")
    traces = os.path.join(workdir, "traces")
    env = {"HAZSAN": "1", "HAZSAN_DIR": traces}
    if args.max_events:
        env["HAZSAN_MAX_EVENTS"] = str(args.max_events)
    if args.buffer_events:
        env["HAZSAN_BUFFER_EVENTS"] = str(args.buffer_events)
    print(f"soak: {args.ranks} ranks, >= {args.events:,} events per rank, RSS every {args.sample} steps; {workdir}")
    marked = not args.no_steps
    cap_wall, cap = _run("capture", args.events, args.sample, args.ranks, env, workdir, marked)
    steps = cap[0]["steps"]
    base_wall, base = _run("baseline", -steps, args.sample, args.ranks, {}, workdir, marked)
    print(f"capture run: {cap_wall:.1f} s wall, {steps} steps; baseline (no capture) {base_wall:.1f} s, "
          f"{base[0]['steps']} steps")
    print(f"{'rank':>4} {'events':>9} {'dropped':>8} {'RSS MB at 10%':>14} {'50%':>7} {'100%':>7} "
          f"{'growth 2nd half MB/100k ev':>27} {'baseline RSS MB 100%':>21}")
    for c, b in zip(cap, base):
        s = c["samples"]
        print(f"{c['rank']:>4} {c['written']:>9,} {c['dropped']:>8,} {_at(s, .1)[1]:>14.1f} {_at(s, .5)[1]:>7.1f} "
              f"{_at(s, 1)[1]:>7.1f} {_growth_per_100k(s):>27.2f} {_at(b['samples'], 1)[1]:>21.1f}")
    size = sum(os.path.getsize(os.path.join(traces, f)) for f in os.listdir(traces))
    per_event = size / max(1, sum(c["written"] for c in cap))
    be = cap[0]["buffer_events"]
    print(f"writer bound: buffer {be:,} events x ~{per_event:.0f} bytes on disk per event "
          f"(~3-4x that as Python dicts) ~ {be * per_event * 3.5 / 2**20:.0f} MB; live blocks at the end: "
          f"{[c['live_blocks'] for c in cap]}")
    wall, rc, peak, summary = _check(traces)
    print(f"hazsan check: {summary['events']:,} events in {wall:.1f} s, exit {rc}, peak RSS {peak:.0f} MB, "
          f"complete={summary.get('complete')}, findings={summary['findings']}, dropped={summary['dropped_events']}")
    ok = all(abs(_growth_per_100k(c["samples"])) < 5.0 for c in cap)
    print(f"memory flat over the run (|growth| < 5 MB per 100k events on every rank): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
