"""The C4 probe: which cause of the history source's crash (torch 2.11, SIGSEGV) holds, in one run.

On an H200 (torch 2.11.0+cu130) C4's history child died of SIGSEGV at a `sanitizer.step()` in four
runs of five: Python's fault handler put the main thread in `_cuda_memoryStats` right after the
previous drain cleared the history, or in the snapshot (reports/gpu-kit/h200-run6-c4-crash.json).
The candidates, most likely first (issue 50, item 10):
  1. a torch 2.11 defect in the per-step pattern itself: clear the history, take the full snapshot,
     read the counters, with a live MemPool;
  2. torch's GPU trace (`_activate_gpu_trace`, which capture turns on): every CUDA malloc and free
     calls into Python from inside the allocator;
  3. garbage collections (their finalizers free CUDA tensors) while the snapshot builds its dicts;
  4. the MemPool's state.

Five variants of one program, eight runs each, every run its own interpreter (a crash ends only
it), and the exit status of each run counted:
  hazsan-history          C4's program under HAZSAN=1 HAZSAN_ALLOC_SOURCE=history (the reference)
  torch-pattern           no hazsan: the same allocations, and at each step what the drain calls
                          (counters, the full `_snapshot()`, `_record_memory_history(clear_history=True)`,
                          counters), with a live MemPool                              -> cause 1
  torch-pattern+gpu-trace torch-pattern with the GPU trace on and a Python callback on every
                          allocation and free, as capture has                         -> cause 2
  torch-pattern+gc        torch-pattern with collections forced while the snapshot runs: garbage
                          cycles holding CUDA tensors, collected by a gc callback      -> cause 3
  hazsan-no-mempool       the reference without its MemPool                            -> cause 4
Plus, in a child of its own: which tuple arities `torch._C._cuda_memorySnapshot` accepts (the
history reads the snapshot of a pool no pool has, a 2-tuple; torch >= 2.12 documents a 3-tuple
whose third item is include_traces) and whether `MemPool.snapshot(include_traces=False)` exists.

The reading (`reading`): torch-pattern crashing names cause 1 (torch alone, no hazsan); else a crash
in +gpu-trace or +gc alone names cause 2 or 3; the reference crashing while hazsan-no-mempool does
not names cause 4 (or 1 with a MemPool); no crash of the reference in eight runs: not reproduced.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

from sanitizer.capture.gpu_selfcheck import ACTIVATE, child_env

RUNS = 8
PARALLEL = 4
STEPS = 10

# The allocations of C4's program (gpu_selfcheck.ALLOC_SOURCES_PROGRAM): the compute stream, a
# side stream and a MemPool, a step boundary every 200 ops. {MEMPOOL} and {STEP} are filled in.
_BODY = '''
import gc, json, sys, time, torch
torch.cuda.set_device(0)
side = torch.cuda.Stream()
pool = torch.cuda.MemPool() if {mempool} else None
x = torch.randn(256, 256, device="cuda")
for n in range({steps}):
    {step}
    for i in range(50):
        y = x * 2 + 1
        with torch.cuda.stream(side):
            z = torch.empty(4096, device="cuda").fill_(1.0)
        if pool is not None:
            with torch.cuda.use_mem_pool(pool):
                w = torch.empty(1 << 20, device="cuda")
        else:
            w = torch.empty(1 << 20, device="cuda")
        del y, z, w
    torch.cuda.synchronize()
{step_last}
print(json.dumps({{"ok": True, "steps": {steps}}}))
'''

# What AllocatorHistory does, without hazsan: record as it records, then at each step boundary the
# drain's torch calls in the drain's order (allocator_history.py: _read_counters, _read_traces
# with the full snapshot, _record(clear=True), _read_counters).
_TORCH_PATTERN = '''
import torch
ENTRIES = 1 << 20
def record(clear):
    torch.cuda.memory._record_memory_history("all", context=None, stacks="python",
                                             max_entries=ENTRIES, clear_history=clear)
def drain():
    torch._C._cuda_memoryStats(0)
    torch.cuda.memory._snapshot()["device_traces"]
    record(True)
    torch._C._cuda_memoryStats(0)
torch.cuda.init()
record(True)
'''

_GPU_TRACE = '''
from torch.cuda import _gpu_trace
calls = [0]
def on_memory(*args):
    calls[0] += 1
_gpu_trace.register_callback_for_memory_allocation(on_memory)
_gpu_trace.register_callback_for_memory_deallocation(on_memory)
torch._C._activate_gpu_trace()
'''

# a collection inside the snapshot: a gc callback is no hook there, so the snapshot is wrapped and
# the garbage made just before it; the collection runs at the first allocation the snapshot makes
# (threshold 1), while torch builds the snapshot's dicts
_GC = '''
class Cycle:
    pass
_snapshot = torch.cuda.memory._snapshot
collections = [0]
def counted(phase, info):
    if phase == "stop":
        collections[0] += 1
gc.callbacks.append(counted)
def snapshot_amid_collections(*a, **k):
    for _ in range(8):
        c = Cycle()
        c.me, c.t = c, torch.empty(4096, device="cuda")
    del c
    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        return _snapshot(*a, **k)
    finally:
        gc.set_threshold(*old)
torch.cuda.memory._snapshot = snapshot_amid_collections
'''


def program(variant: str, steps: int = STEPS) -> str:
    """The child program of one variant."""
    hazsan = variant.startswith("hazsan")
    mempool = variant != "hazsan-no-mempool"
    if hazsan:
        head = ACTIVATE + "import sanitizer\n"
        step, last = "sanitizer.step(n)", f"sanitizer.step({steps})"
    else:
        head = textwrap.dedent(_TORCH_PATTERN)
        if variant.endswith("+gpu-trace"):
            head += textwrap.dedent(_GPU_TRACE)
        step, last = "drain()", "drain()"
    body = _BODY.format(mempool=mempool, steps=steps, step=step, step_last=last)
    source = head + body
    if variant.endswith("+gc"):
        source = source.replace("for n in range(", textwrap.dedent(_GC) + "for n in range(", 1)
    return source


VARIANTS = ("hazsan-history", "torch-pattern", "torch-pattern+gpu-trace", "torch-pattern+gc", "hazsan-no-mempool")

SNAPSHOT_API = textwrap.dedent('''
    import json, torch
    torch.cuda.init()
    x = torch.empty(1 << 20, device="cuda")
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        y = torch.empty(1 << 20, device="cuda")
    nowhere = 2 ** 62 + 7
    out = {"torch": torch.__version__}
    for label, arg in (("2-tuple", (nowhere, nowhere)), ("3-tuple", (nowhere, nowhere, False)),
                       ("3-tuple-default-pool", (0, 0, False)), ("None", None)):
        try:
            s = torch._C._cuda_memorySnapshot(arg)
            out[label] = {"accepted": True, "segments": len(s.get("segments", [])),
                          "device_traces": [len(t) for t in s.get("device_traces", [])]}
        except Exception as exc:
            out[label] = {"accepted": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    try:
        segs = pool.snapshot(include_traces=False)
        out["MemPool.snapshot(include_traces=False)"] = {"accepted": True, "segments": len(segs)}
    except Exception as exc:
        out["MemPool.snapshot(include_traces=False)"] = {"accepted": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    print(json.dumps(out))
''')


def _env(variant: str, work: str, n: int) -> dict:
    if variant.startswith("hazsan"):
        return child_env("alloc", os.path.join(work, f"{variant}-{n}"), HAZSAN_ALLOC_SOURCE="history")
    return child_env(None, "")


def _one(variant: str, work: str, n: int, timeout: float) -> dict:
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-c", program(variant)], env=_env(variant, work, n),
                           capture_output=True, text=True, timeout=timeout)
        rc, tail = p.returncode, p.stderr[-600:]
    except subprocess.TimeoutExpired:
        rc, tail = "timeout", ""
    return {"variant": variant, "rc": rc, "seconds": round(time.monotonic() - t0, 1), "tail": tail}


def tally(results: list) -> dict:
    """{variant: {runs, sigsegv, other_failures, clean}} from the runs' exit statuses."""
    out = {}
    for r in results:
        t = out.setdefault(r["variant"], {"runs": 0, "sigsegv": 0, "other_failures": 0, "clean": 0})
        t["runs"] += 1
        if r["rc"] == -signal.SIGSEGV:
            t["sigsegv"] += 1
        elif r["rc"] == 0:
            t["clean"] += 1
        else:
            t["other_failures"] += 1
    return out


def reading(t: dict) -> str:
    """What the tallies say about the ranked causes (see the module's docstring)."""
    def crashed(v):
        return t.get(v, {}).get("sigsegv", 0) > 0
    if crashed("torch-pattern"):
        return "cause 1: torch alone crashes in the per-step pattern (no hazsan): a torch defect"
    alone = [c for v, c in (("torch-pattern+gpu-trace", "cause 2: the GPU trace's Python calls in the allocator"),
                            ("torch-pattern+gc", "cause 3: collections while the snapshot builds its dicts"))
             if crashed(v)]
    if alone:
        return "; ".join(alone)
    if crashed("hazsan-history") and not crashed("hazsan-no-mempool"):
        return "cause 4: the MemPool (the reference crashes, the same without its MemPool does not)"
    if crashed("hazsan-history") or crashed("hazsan-no-mempool"):
        return "hazsan's own drain: the reference crashes, none of torch's patterns alone does"
    return "not reproduced: no variant crashed"


def probe(work: str, runs: int = RUNS, parallel: int = PARALLEL, timeout: float = 60.0) -> dict:
    """Run every variant `runs` times (`parallel` at once) and the snapshot API child."""
    os.makedirs(work, exist_ok=True)
    jobs = [(v, n) for n in range(runs) for v in VARIANTS]
    t0 = time.monotonic()
    with ThreadPoolExecutor(parallel) as ex:
        results = list(ex.map(lambda j: _one(j[0], work, j[1], timeout), jobs))
    api = subprocess.run([sys.executable, "-c", SNAPSHOT_API], env=child_env(None, ""), capture_output=True,
                         text=True, timeout=timeout)
    try:
        snapshot_api = json.loads(api.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        snapshot_api = {"error": f"exit {api.returncode}: {api.stderr[-600:]}"}
    t = tally(results)
    crash_tails = {}
    for r in results:
        if r["rc"] != 0 and r["variant"] not in crash_tails:
            crash_tails[r["variant"]] = r["tail"]
    return {"tally": t, "reading": reading(t), "snapshot_api": snapshot_api,
            "first_failure_stderr": crash_tails, "seconds": round(time.monotonic() - t0, 1)}
