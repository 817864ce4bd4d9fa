"""A symmetric-scope buffer released around an async all_reduce, through `hazsan run` on a real
2-rank gloo program: dropped with its handle (gloo frees it only after the collective ran: clean,
the completion recorded before the free), or waited first (clean). Ranks are started with multiprocessing's spawn
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
            if rank == 1:
                time.sleep(0.3)           # rank 0's all_reduce cannot run before this one is issued
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


def test_buffer_only_the_work_holds_is_freed_after_the_collective(tmp_path):
    """The program drops its buffer and the handle while the all_reduce may still run. On gloo
    that is safe: the Work holds the tensor until gloo's thread has run it (ProcessGroupGloo.cpp:
    the Work keeps `inputs`/`outputs`; runLoop lets the Work go after execute()), so the storage
    dies after the collective, and the next scope allocation that takes its offset is not a reuse
    in flight. (This test expected reuse-in-flight until capture learnt that: issue 32's
    WorkHeldTensors. A storage freed while a live tensor still feeds the collective, the real early
    release, is flagged in test_capture_public_patterns.py: Megatron-LM#4047.)"""
    rc, report, err = _hazsan_run(tmp_path, "nowait")
    # Both ranks: rank 0's buffer dies on gloo's thread (rank 1 issues its part 0.3 s later, and
    # rank 0 has dropped it long before); rank 1's collective may run at once (rank 0 is waiting),
    # and its buffer then dies on the program's thread at `del buf`, after the Work let go of it.
    # Either way the Work had run: collective_state.WorkHeldTensors writes coll_done first.
    assert report["findings"] == [], (report["summary"], err[-2000:])
    assert rc == 0, (report["summary"], err[-2000:])
    assert report["summary"]["complete"] and report["summary"]["ranks"] == 2
    for rank in (0, 1):
        r = subprocess.run([sys.executable, "-m", "sanitizer", "cat", str(tmp_path / "traces" / f"rank{rank}.hzs"),
                            "--no-header"], capture_output=True, text=True, timeout=120, check=True)
        events = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
        first = next(ev for ev in events if ev["ev"] == "coll")
        buf = next(ev for ev in events if ev["ev"] == "alloc" and ev["addr"] == first["bufs"][0]["addr"])
        order = [(ev["ev"], ev.get("cid", ev.get("id"))) for ev in events if ev["ev"] in ("coll_done", "free")]
        # the collective's completion is recorded before the death of the buffer it held
        assert order.index(("coll_done", first["cid"])) < order.index(("free", buf["id"])), order
        # and the next scope allocation really takes the freed offset (the case the test is about)
        again = [ev for ev in events if ev["ev"] == "alloc" and ev["addr"] == buf["addr"] and ev["id"] != buf["id"]]
        assert again and again[0]["pool"] == buf["pool"]


def test_same_program_waiting_first_is_clean(tmp_path):
    rc, report, err = _hazsan_run(tmp_path, "wait")
    assert rc == 0, (report, err[-2000:])
    assert report["findings"] == [] and report["summary"]["ranks"] == 2
