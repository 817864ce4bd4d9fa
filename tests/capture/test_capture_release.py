"""The issue's acceptance pair, through `hazsan run` on a real 2-rank gloo program.

A buffer allocated in a symmetric scope, its all_reduce started asynchronously, and the buffer
released back to the scope's pool while the collective still runs must be flagged; the same program
waiting for the collective first must be clean. Ranks are started with multiprocessing's spawn
context from a parent that never imports torch (activation reaches them through the .pth).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

# The case: a buffer allocated in the symmetric scope, its all_reduce started
# asynchronously, and the buffer released back to the scope's pool while the collective runs (the
# handle is dropped and never waited on); the next allocation in the scope takes its place.
# With "wait" the program waits for the collective before releasing the buffer.
RELEASE = textwrap.dedent(r'''
    import multiprocessing as mp
    import sys, threading, time, weakref

    def worker(rank, ws, init, mode):
        import torch, torch.distributed as dist      # only the ranks import torch
        import sanitizer
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ws)
        pg = dist.group.WORLD
        sanitizer.step(0)
        with sanitizer.symmetric_scope(pg):
            buf = torch.full((4096,), float(rank))
        if mode == "nowait":
            released = threading.Event()
            weakref.finalize(buf.untyped_storage(), released.set)
            dist.all_reduce(buf, async_op=True)
            del buf
            released.wait(30)             # the program's own way of knowing: not an ordering edge
            time.sleep(0.05)
        else:
            work = dist.all_reduce(buf, async_op=True)
            work.wait()
            del work, buf
        with sanitizer.symmetric_scope(pg):
            nxt = torch.zeros(4096)
        dist.all_reduce(nxt)
        sanitizer.step(1)
        dist.destroy_process_group()

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker, args=(r, 2, sys.argv[1], sys.argv[2])) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        sys.exit(max(p.exitcode for p in procs))
''')



def _hazsan_run(d, mode):
    (d / "prog.py").write_text(RELEASE)
    cmd = [sys.executable, "-m", "sanitizer", "run", "--dir", str(d / "traces"), "--format", "json",
           "--", sys.executable, "prog.py", f"file://{d}/rdv", mode]
    out = subprocess.run(cmd, cwd=d, capture_output=True, text=True, timeout=150)
    return out.returncode, json.loads(out.stdout), out.stderr


def test_release_while_collective_in_flight_is_flagged(tmp_path):
    rc, report, err = _hazsan_run(tmp_path, "nowait")
    assert rc == 1, err[-2000:]
    rules = {(f["rule"], f["rank"]) for f in report["findings"]}
    # the realised collision on every rank, and its latent cause
    assert {("reuse-in-flight", 0), ("reuse-in-flight", 1)} <= rules
    assert {("free-in-flight", 0), ("free-in-flight", 1)} <= rules
    reuse = [f for f in report["findings"] if f["rule"] == "reuse-in-flight"][0]
    assert reuse["op"]["comm"] == "0" and reuse["op"]["seq"] == 0


def test_same_program_waiting_first_is_clean(tmp_path):
    rc, report, err = _hazsan_run(tmp_path, "wait")
    assert rc == 0, (report, err[-2000:])
    assert report["findings"] == [] and report["summary"]["ranks"] == 2
