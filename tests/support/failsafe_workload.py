"""A two-rank gloo program run under capture (HAZSAN=1) with one fault injected; see
test_capture_failsafe.py. Every rank checks its own numbers each step and writes what it saw to
OUT/result<rank>.json; the capture must never change them nor raise into the program.

    python failsafe_workload.py FAULT OUT

FAULT: none | raise (every capture service the hooks call raises, one set per step, then all at
once) | full (the trace file turns into /dev/full mid-run) | removed (the trace folder is deleted
mid-run) | unwritable (HAZSAN_DIR cannot be created: set by the caller) | kill (rank 1 dies by
SIGKILL with an all-reduce in flight).
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sanitizer
from sanitizer.capture import runtime

STEPS = 24
FAULT_STEP = 6


def _raiser(name):
    def fail(*a, **k):
        raise RuntimeError(f"injected fault: {name}")
    return fail


def _fault_sets(cap):
    """(label, [(object, attribute)]) for every service a hook reaches: patched on the instances,
    so bound methods captured at install time (BlockTable.emit, Collectives.emit) are covered too."""
    blocks, colls = cap.blocks, getattr(cap, "collectives", None)
    sets = [
        ("emit", [(cap, "emit"), (cap, "event"), (cap.writer, "emit"), (blocks, "emit")]
         + ([(colls, "emit")] if colls is not None else [])),
        ("sites", [(cap.sites, "where")]),
        ("streams", [(cap.streams, n) for n in ("of_handle", "of_torch", "current", "known")]),
        ("blocks", [(blocks, n) for n in ("_new", "_output", "_release", "buffer")
                    if hasattr(blocks, n)]),
        ("collectives", [(colls, n) for n in ("_record", "_remember", "_take", "group", "done", "poll",
                                                        "issued_by_method", "observed", "_bufs")
                         if colls is not None and hasattr(colls, n)]),
        ("window", [(cap, "arenas_model")]),
        ("scopes", [(cap, "enter_scope"), (cap, "exit_scope"), (cap, "mark_step")]),
        ("writer", [(cap.writer, "_flush_locked"), (cap.writer, "hook_failed")]),
    ]
    sets.append(("all", [p for _, ps in sets for p in ps]))
    return sets


class Injector:
    def __init__(self, pairs, label):
        self.pairs, self.label = pairs, label

    def __enter__(self):
        self.saved = [(obj, name, vars(obj).get(name, _MISSING)) for obj, name in self.pairs]
        for obj, name in self.pairs:
            setattr(obj, name, _raiser(f"{self.label}.{name}"))

    def __exit__(self, *exc):
        for obj, name, old in reversed(self.saved):
            if old is _MISSING:
                vars(obj).pop(name, None)   # the class attribute shows through again
            else:
                setattr(obj, name, old)     # an instance attribute (a bound method kept at init)
        return False


_MISSING = object()


# FAULT=raise: a tensor each step keeps for the next, so that a free happens under every fault
# set (a block whose alloc a failing hook lost is never registered, so it gets no free either)
_CARRIED: list = []


def _step(rank, i):
    """One decode-like step; returns the numbers every rank must agree on."""
    if _CARRIED:
        _CARRIED[0] = torch.full((8,), float(i))   # the previous step's dies here
    a = torch.full((64,), float(rank + i))
    b = a * 2 + 1
    dist.all_reduce(b)
    c = torch.ones(32) * (i + 1)
    w = dist.all_reduce(c, async_op=True)
    w.wait()
    with sanitizer.symmetric_scope():
        t = torch.zeros(16) + i
        g = torch.empty(16)
    dist.all_gather_into_tensor(g, torch.full((8,), float(rank)))
    assert torch.equal(b, torch.full((64,), 4.0 * i + 4)), (i, b[:3])
    assert torch.equal(c, torch.full((32,), 2.0 * (i + 1))), (i, c[:3])
    assert torch.equal(t, torch.full((16,), float(i)))
    assert torch.equal(g, torch.cat([torch.zeros(8), torch.ones(8)]))
    return float(b.sum() + c.sum() + t.sum() + g.sum())


def worker(rank, world, init, fault, out):
    result = {"rank": rank, "fault": fault, "steps": 0, "error": None}
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=20))
        cap = runtime.active()
        result["capture"] = cap is not None
        sets = _fault_sets(cap) if fault == "raise" else []
        if fault == "raise":
            _CARRIED.append(None)
        total = 0.0
        for i in range(STEPS):
            sanitizer.step(i, tokens=4)
            if fault == "raise":
                label, pairs = sets[i % len(sets)]
                with Injector(pairs, label):
                    total += _step(rank, i)
            else:
                if i == FAULT_STEP and fault == "full":
                    cap.writer.flush()                      # the file exists; now the disk is full
                    full = os.open("/dev/full", os.O_WRONLY)
                    os.dup2(full, cap.writer._fd)
                    os.close(full)
                if i == FAULT_STEP and fault == "removed":
                    dist.barrier()
                    if rank == 0:
                        shutil.rmtree(os.environ["HAZSAN_DIR"])
                    dist.barrier()
                if i == FAULT_STEP and fault == "kill" and rank == 1:
                    dist.all_reduce(torch.ones(1 << 16), async_op=True)  # in flight, never waited
                    cap.writer.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                total += _step(rank, i)
            result["steps"] = i + 1
        result["total"] = total
        dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:   # the program's own failure (a peer that died): recorded, not raised
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = "".join(traceback.format_exception(exc))
        result["from_hazsan"] = "sanitizer/" in result["traceback"].replace("tests/support/failsafe_workload.py", "")
    # written whole or not at all: in `kill` mode the launcher terminates rank 0 once rank 1 died,
    # possibly while it writes (an empty file was seen under load)
    path = os.path.join(out, f"result{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def main():
    fault, out = sys.argv[1], sys.argv[2]
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(worker, args=(2, f"tcp://127.0.0.1:{port}", fault, out), nprocs=2,
                             join=False, start_method="fork")
    while not ctx.join():
        pass


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:   # a child killed on purpose ends the join with an error: expected for kill
        print(f"workload: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(3)
