"""The GPU self-check: capture on a real GPU, end to end, in one command (under 5 minutes on one GPU).

    python -m sanitizer.capture.gpu_selfcheck [--json] [--keep DIR]      (or: make gpu-check)

Each scenario is a small program run in its own interpreter with HAZSAN=1 HAZSAN_LEVEL=full (the
real bootstrap, as in production), then `hazsan check` reads its trace. World size 1, NCCL through
torch.distributed (the collective runs on the process group's NCCL stream):

  side-stream-unprotected  all-reduce ordered on a side stream; the buffer, allocated on the
                           compute stream, is dropped without record_stream after the side stream
                           waited, and a same-size buffer is allocated on the compute stream:
                           expected free-in-flight / reuse-in-flight (at least one)
  side-stream-record       the same with x.record_stream(side) before the drop: expected clean
  side-stream-event        the same with the compute stream waiting for an event recorded on the
                           side stream before the drop: expected clean
  record-stream-recycled   record_stream on an idle side stream, free, a same-size allocation: the
                           allocator recycles the block at once (malloc's process_events); the
                           trace has its free_done before that alloc; clean; stream ids of an
                           allocation and an event record on the side stream agree
  never-waited             an async all-reduce whose Work is dropped unwaited (PyTorch >= 2.8
                           stashes its tensors until the watchdog sees it done): clean
  mempool                  allocations inside torch.cuda.use_mem_pool(MemPool()): traced, clean
  graph                    torch.cuda.graph capturing an all-reduce, replayed 3 times: graph_begin,
                           the coll, graph_end, 3 graph_replay, graph_free are traced, allocations
                           during capture are in the graph's pool; clean
  read-before-wait         an async all-reduce's output read by a kernel on the compute stream
                           before Work.wait(): expected unordered-access

Then the placement model against the real caching allocator (sanitizer.place.gpu_check), and the
capture overhead per decode-like step (a small MLP decode loop) bare vs alloc vs full, and the two
allocation sources (HAZSAN_ALLOC_SOURCE=dispatch / history) on the same small program: time per op
side by side, and the allocator history's agreement with the dispatch mode.

Exit 0 when every expectation holds, 1 otherwise. The GPU kit (gpu_kit.py) runs these as its checks
C2-C5 and C9; they ran there on one H200 (torch 2.11, NCCL 2.28.9; reports/gpu-kit/): the
scenarios, the placement model and the overhead as expected, the history source crashing (C4).
The NCCL scenarios rely on collectives recording NCCL waits as stream edges (issue 9's
collectives.py), so the coll is not treated as done for the host at Work.wait().
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

# What every child program of the GPU checks starts with: capture activated as the .pth line does,
# so that a child captures from a plain checkout too (no installed .pth); child_env() puts the
# checkout on PYTHONPATH. gpu_selfcheck_nccl.py and gpu_kit.py use the same two.
ACTIVATE = textwrap.dedent('''
    import os
    if os.environ.get("HAZSAN"):    # as the .pth line does (works without an installed .pth)
        __import__("sanitizer.capture.bootstrap").capture.bootstrap.activate()
''')

PRELUDE = ACTIVATE + textwrap.dedent('''
    import torch, torch.distributed as dist
    import sanitizer
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method="file://" + os.environ["SELFCHECK_STORE"],
                            rank=0, world_size=1)
    N = 1 << 20
    compute = torch.cuda.current_stream()
    side = torch.cuda.Stream()
''')

SCENARIOS = {
    "side-stream-unprotected": ('''
        x = torch.ones(N, device="cuda")
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            work = dist.all_reduce(x, async_op=True)
            work.wait()                  # the side stream waits; the compute stream does not
        del x, work                      # no record_stream(side): the block is free for compute
        y = torch.empty(N, device="cuda")
        y.fill_(2.0)
        torch.cuda.synchronize()
    ''', {"any_of": {"free-in-flight", "reuse-in-flight"}}),
    "side-stream-record": ('''
        x = torch.ones(N, device="cuda")
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            work = dist.all_reduce(x, async_op=True)
            work.wait()
        x.record_stream(side)
        del x, work
        y = torch.empty(N, device="cuda")
        y.fill_(2.0)
        torch.cuda.synchronize()
    ''', {"clean": True, "events": {"record_stream", "free_done"}}),
    "side-stream-event": ('''
        x = torch.ones(N, device="cuda")
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            work = dist.all_reduce(x, async_op=True)
            work.wait()
            done = torch.cuda.Event()
            done.record(side)
        compute.wait_event(done)
        del x, work
        y = torch.empty(N, device="cuda")
        y.fill_(2.0)
        torch.cuda.synchronize()
    ''', {"clean": True, "events": {"record", "wait", "sync"}}),
    # c10/cuda/CUDACachingAllocator.cpp: malloc() first runs process_events(), which queries the
    # events recorded at the free of record_stream'd blocks and returns those already done to the
    # pool. On an idle side stream that is at once: y gets x's block without any synchronize. The
    # trace must then say free_done before y's alloc (capture/block_table.py), and be clean.
    "record-stream-recycled": ('''
        import time
        x = torch.empty(N, device="cuda")
        x.record_stream(side)            # side has no work: the event recorded at the free is done at once
        del x
        time.sleep(0.05)                 # the GPU has processed that event record; the host saw nothing
        y = torch.empty(N, device="cuda")
        y.fill_(2.0)
        with torch.cuda.stream(side):    # stream ids: an allocation and an event record on side
            z = torch.empty(1024, device="cuda")
            z.fill_(1.0)
            mark = torch.cuda.Event()
            mark.record(side)
        compute.wait_event(mark)
        torch.cuda.synchronize()
    ''', {"clean": True, "events": {"record_stream", "free_done"}, "recycled": True, "stream_ids": True}),
    # ProcessGroupNCCL (PyTorch >= 2.8) stashes an async collective's tensors in its Work; one
    # never waited for is released by the watchdog once complete, unstashed at the next enqueue:
    # x dies inside the second all_reduce, after its collective finished. Clean (NcclWorkLifetimes).
    "never-waited": ('''
        import time
        x = torch.ones(N, device="cuda")
        work = dist.all_reduce(x, async_op=True)
        del x, work                      # never waited for, and no synchronize: only the
        time.sleep(2.0)                  # watchdog sees the Work complete
        y = torch.ones(1024, device="cuda")
        dist.all_reduce(y)               # this enqueue unstashes x
        z = torch.empty(N, device="cuda")
        z.fill_(3.0)
        torch.cuda.synchronize()
    ''', {"clean": True, "events": {"coll", "coll_done"}}),
    "mempool": ('''
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            a = torch.ones(N, device="cuda")
            b = a * 2
        dist.all_reduce(b)
        del a, b
        torch.cuda.synchronize()
    ''', {"clean": True, "events": {"alloc", "free", "coll"}}),
    "graph": ('''
        static = torch.ones(N, device="cuda")
        side.wait_stream(compute)
        with torch.cuda.stream(side):          # warm-up outside capture, as torch recommends
            dist.all_reduce(static)
        compute.wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            dist.all_reduce(static)
            out = static * 2
        for _ in range(3):
            static.fill_(1.0)
            g.replay()
        torch.cuda.synchronize()
        del g, out
        torch.cuda.synchronize()
    ''', {"clean": True, "events": {"graph_begin", "graph_end", "graph_replay", "graph_free", "coll"},
          "replays": 3, "graph_pool": True}),
    "read-before-wait": ('''
        x = torch.ones(N, device="cuda")
        work = dist.all_reduce(x, async_op=True)
        total = (x * 2).sum()            # reads x before the compute stream waits for the all-reduce
        work.wait()
        torch.cuda.synchronize()
    ''', {"any_of": {"unordered-access"}}),
}

DECODE_STEP = ACTIVATE + textwrap.dedent('''
    import sys, time, json, torch
    import sanitizer
    torch.cuda.set_device(0)
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden, tokens, layers = 2048, 8, 8
    W = [(torch.randn(hidden, 4 * hidden, device="cuda", generator=g) / 64,
          torch.randn(4 * hidden, hidden, device="cuda", generator=g) / 128) for _ in range(layers)]
    h0 = torch.randn(tokens, hidden, device="cuda", generator=g)
    def step(h):
        for up, down in W:
            x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            h = h + torch.nn.functional.silu(x @ up) @ down
        return h
    times = []
    for n in range(60):
        sanitizer.step(n)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(h0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times = sorted(times[10:])
    print(json.dumps({"median": times[len(times) // 2]}))
''')

# The same small program under each allocation source (HAZSAN_ALLOC_SOURCE): allocating ops on the
# compute stream, a side stream and a MemPool, a step boundary every 200 ops. It prints the time
# per op (step boundaries included: the history is drained there) and the history's agreement.
ALLOC_SOURCES_PROGRAM = ACTIVATE + textwrap.dedent('''
    import json, time, torch
    import sanitizer
    from sanitizer.capture import allocator_history
    torch.cuda.set_device(0)
    side = torch.cuda.Stream()
    pool = torch.cuda.MemPool()
    x = torch.randn(256, 256, device="cuda")
    per_op = []
    for n in range(12):
        sanitizer.step(n)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(50):
            y = x * 2 + 1                      # two allocating ops
            with torch.cuda.stream(side):
                z = torch.empty(4096, device="cuda").fill_(1.0)
            with torch.cuda.use_mem_pool(pool):
                w = torch.empty(1 << 20, device="cuda")
            del y, z, w
        torch.cuda.synchronize()
        per_op.append((time.perf_counter() - t0) / 200)
    sanitizer.step(12)
    per_op = sorted(per_op[2:])
    print(json.dumps({"us_per_op": per_op[len(per_op) // 2] * 1e6,
                      "history": allocator_history.stats()}))
''')


def child_env(level: str | None, directory: str, **extra: str) -> dict:
    """The environment of a child program: no HAZSAN* setting of ours leaks in, the tree holding
    this `sanitizer` package is on PYTHONPATH (a plain checkout works), output unbuffered, Python's
    fault handler on, one GPU;
    capture at `level` into `directory` unless level is None (a bare run)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"     # a child that crashes in native code says where
    if level is not None:
        env.update(HAZSAN="1", HAZSAN_LEVEL=level, HAZSAN_DIR=directory)
    env.update(extra)
    return env


def _env(level: str | None, directory: str, store: str) -> dict:
    return child_env(level, directory, SELFCHECK_STORE=store)


def _run(code: str, env: dict, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _check(directory: str) -> tuple[int, dict]:
    out = subprocess.run([sys.executable, "-m", "sanitizer", "check", directory, "--format", "json",
                          "--fail-on", "warning"], capture_output=True, text=True, timeout=120)
    try:
        return out.returncode, json.loads(out.stdout)
    except ValueError:
        return out.returncode, {"error": (out.stdout + out.stderr)[-2000:]}


def _events(directory: str) -> list[dict]:
    from sanitizer.trace.reader import open_trace
    from sanitizer.trace.schema import is_trace_name

    evs = []
    for name in sorted(os.listdir(directory)):
        if is_trace_name(name):
            tf = open_trace(os.path.join(directory, name))
            evs += [ev for _, ev in tf.events() if isinstance(ev, dict)]
    return evs


def scenario(name: str, work: str) -> dict:
    body, expect = SCENARIOS[name]
    directory = os.path.join(work, name)
    store = os.path.join(work, f"{name}.store")
    t0 = time.monotonic()
    run = _run(PRELUDE + textwrap.dedent(body), _env("full", directory, store))
    result = {"scenario": name, "seconds": round(time.monotonic() - t0, 1)}
    if run.returncode != 0:
        return {**result, "ok": False, "why": "program failed: " + run.stderr[-1500:]}
    code, report = _check(directory)
    if "error" in report:
        return {**result, "ok": False, "why": "hazsan check failed: " + report["error"]}
    rules = {f["rule"] for f in report.get("findings", [])}
    evs = _events(directory)
    kinds = {e["ev"] for e in evs}
    errors = [e for e in evs if e["ev"] == "hook_error"]
    problems = []
    if errors:
        problems.append(f"hook errors: {errors}")
    if expect.get("clean") and rules:
        problems.append(f"expected clean, got {sorted(rules)}")
    if "any_of" in expect and not (rules & expect["any_of"]):
        problems.append(f"expected one of {sorted(expect['any_of'])}, got {sorted(rules) or 'nothing'}")
    missing = set(expect.get("events", ())) - kinds
    if missing:
        problems.append(f"events missing from the trace: {sorted(missing)}")
    if "replays" in expect:
        n = sum(1 for e in evs if e["ev"] == "graph_replay")
        if n != expect["replays"]:
            problems.append(f"{n} graph_replay events, expected {expect['replays']}")
    if expect.get("recycled"):
        problems += _recycled(evs)
    if expect.get("stream_ids"):
        side = {e["stream"] for e in evs if e["ev"] == "alloc" and ":s" in e["stream"]}
        marks = {e["stream"] for e in evs if e["ev"] == "record"}
        if not side or not side & marks:
            problems.append(f"stream ids differ: side-stream allocations on {sorted(side)}, "
                            f"event records on {sorted(marks)}")
    if expect.get("graph_pool"):
        inside, pools = False, set()
        for e in evs:
            if e["ev"] in ("graph_begin", "graph_end"):
                inside = e["ev"] == "graph_begin"
            elif inside and e["ev"] == "alloc":
                pools.add(e["pool"])
        if not pools or not all(p.startswith("graph") for p in pools):
            problems.append(f"allocations during capture in pools {sorted(pools)}, not the graph's")
    return {**result, "ok": not problems, "rules": sorted(rules), "events": len(evs),
            "why": "; ".join(problems)}


def _recycled(evs: list) -> list[str]:
    """The record_stream'd block's free_done comes before the allocation that reuses its bytes."""
    allocs = {e["id"]: e for e in evs if e["ev"] == "alloc"}
    marked = [e["id"] for e in evs if e["ev"] == "record_stream"]
    if not marked:
        return ["no record_stream in the trace"]
    x = allocs[marked[0]]
    done = False
    for e in evs:
        if e["ev"] == "free_done" and e["id"] == x["id"]:
            done = True
        elif e["ev"] == "alloc" and e["id"] != x["id"] and e["addr"] < x["addr"] + x["size"] \
                and x["addr"] < e["addr"] + e["size"]:
            return [] if done else [f"alloc {e['id']} reuses block {x['id']} before its free_done"]
    return [f"no allocation reused block {x['id']} (the allocator held it: was the side stream idle?)"]


def placement() -> dict:
    out = subprocess.run([sys.executable, "-m", "sanitizer.place.gpu_check", "--json"],
                         capture_output=True, text=True, timeout=120)
    try:
        r = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"ok": False, "why": (out.stdout + out.stderr)[-1500:]}
    return {"ok": r.get("agreement") == 1.0, **r}


def overhead(work: str) -> dict:
    med = {}
    for level in (None, "alloc", "full"):
        label = level or "bare"
        run = _run(DECODE_STEP, _env(level, os.path.join(work, f"overhead-{label}"), ""), timeout=300)
        if run.returncode != 0:
            return {"ok": False, "why": f"{label}: exit {run.returncode}: " + run.stderr[-1500:]}
        med[label] = json.loads(run.stdout.strip().splitlines()[-1])["median"]
    return {"ok": True, "ms_per_step": {k: round(v * 1e3, 3) for k, v in med.items()},
            "vs_bare": {k: round(v / med["bare"], 3) for k, v in med.items()}}


def alloc_sources(work: str) -> dict:
    """The same program bare, with HAZSAN_ALLOC_SOURCE=dispatch and =history: time per op side by
    side, and the history's agreement with the dispatch mode (allocator allocs matched by address,
    stream mismatches, allocations the dispatch mode never saw, segments, losses)."""
    out = {}
    for label in ("bare", "dispatch", "history"):
        directory = os.path.join(work, f"alloc-source-{label}")
        env = _env(None if label == "bare" else "alloc", directory, "")
        if label != "bare":
            env["HAZSAN_ALLOC_SOURCE"] = label
        run = _run(ALLOC_SOURCES_PROGRAM, env, timeout=300)
        if run.returncode != 0:
            return {"ok": False, "why": f"{label}: exit {run.returncode}: " + run.stderr[-1500:]}
        r = json.loads(run.stdout.strip().splitlines()[-1])
        out[label] = r
        if label != "bare":
            evs = _events(directory)
            r["segments"] = sum(1 for e in evs if e["ev"] == "segment")
            r["hook_errors"] = [e for e in evs if e["ev"] == "hook_error"]
            r["dropped"] = sum(e.get("count", 0) for e in evs if e["ev"] == "dropped")
    h = out["history"].get("history") or {}
    problems = []
    for label in ("dispatch", "history"):
        if out[label]["hook_errors"]:
            problems.append(f"{label}: hook errors {out[label]['hook_errors']}")
    if not h.get("drains"):
        problems.append("the allocator history was never drained (not enabled?)")
    if not out["history"]["segments"]:
        problems.append("no segment from the allocator history")
    if not h.get("matched") or h.get("stream_mismatch"):
        problems.append(f"agreement: {h}")
    bare = out["bare"]["us_per_op"]
    return {"ok": not problems, "why": "; ".join(problems),
            "us_per_op": {k: round(v["us_per_op"], 2) for k, v in out.items()},
            "vs_bare": {k: round(v["us_per_op"] / bare, 3) for k, v in out.items()},
            "history": h, "segments": {k: out[k]["segments"] for k in ("dispatch", "history")},
            "dropped": {k: out[k]["dropped"] for k in ("dispatch", "history")}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--keep", help="keep the traces in this directory")
    p.add_argument("--only", help="comma-separated scenario names (default: all)")
    args = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("gpu_selfcheck: no CUDA device", file=sys.stderr)
        return 2
    work = args.keep or tempfile.mkdtemp(prefix="hazsan-gpucheck-")
    os.makedirs(work, exist_ok=True)
    names = args.only.split(",") if args.only else list(SCENARIOS)
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "scenarios": [scenario(n, work) for n in names],
               "placement": placement(), "overhead": overhead(work),
               "alloc_sources": alloc_sources(work), "traces": work}
    ok = all(s["ok"] for s in results["scenarios"]) and results["placement"]["ok"] and \
        results["overhead"]["ok"] and results["alloc_sources"]["ok"]
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(f"hazsan GPU self-check on {results['device']} (torch {results['torch']}), traces in {work}")
        for s in results["scenarios"]:
            print(f"  {'ok  ' if s['ok'] else 'FAIL'} {s['scenario']:<26} rules {s.get('rules')} "
                  f"({s['seconds']} s){'  -- ' + s['why'] if s.get('why') else ''}")
        pl = results["placement"]
        print(f"  {'ok  ' if pl['ok'] else 'FAIL'} placement model vs caching allocator: "
              f"{pl.get('agreement')} agreement {pl.get('disagreements') or pl.get('why') or ''}")
        ov = results["overhead"]
        if ov["ok"]:
            print("  capture overhead per decode-like step (ms): "
                  + ", ".join(f"{k} {v} ({ov['vs_bare'][k]}x)" for k, v in ov["ms_per_step"].items()))
        else:
            print(f"  FAIL overhead: {ov['why']}")
        src = results["alloc_sources"]
        if "us_per_op" in src:
            print(f"  {'ok  ' if src['ok'] else 'FAIL'} allocation sources, us per op: "
                  + ", ".join(f"{k} {v} ({src['vs_bare'][k]}x)" for k, v in src["us_per_op"].items())
                  + f"; segments {src['segments']}, dropped {src['dropped']}")
            print(f"       history vs dispatch: {src['history']}{'  -- ' + src['why'] if src['why'] else ''}")
        else:
            print(f"  FAIL allocation sources: {src['why']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
