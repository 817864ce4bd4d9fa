"""A collective whose wait() raises, on real gloo (2 ranks on loopback, spawned), under capture.

* step 1, timed out: rank 0 waits an all-reduce with a 300 ms timeout while rank 1 joins only 3 s
  later. The wait raises but the Work still runs (its buffer is in use): rank 0 then writes the
  buffer, which `full` must flag as `unordered-access`; it waits again, properly, and writes it
  once more, which is clean.
* step 2, failed: rank 1 exits before it joins the next all-reduce; rank 0's blocking
  `dist.all_reduce(x)` raises (the connection closed). gloo's AsyncWork ended with that error and
  nothing of it runs any more: rank 0 writes x and frees it, and neither may be flagged (before
  capture recorded the failed Work's completion, the free was a `free-in-flight`; seen in the
  failsafe suite's killed-rank run).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

PROGRAM = textwrap.dedent(r'''
    import datetime, json, os, sys, time
    import torch.multiprocessing as mp

    def worker(rank, ws, init, out):
        import torch, torch.distributed as dist
        import sanitizer
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ws,
                                timeout=datetime.timedelta(seconds=30))
        res = {}
        sanitizer.step(1)
        y = torch.ones(1 << 14)
        if rank == 1:
            time.sleep(3.0)
        w = dist.all_reduce(y, async_op=True)
        if rank == 0:
            try:
                w.wait(timeout=datetime.timedelta(milliseconds=300))
                res["timed_out"] = False
            except RuntimeError as exc:
                res["timed_out"] = True
                res["timeout_error"] = str(exc)[:200]
                y.add_(1)                      # the bug: the all-reduce still runs
        w.wait()
        y.add_(1)                              # clean: after the wait that returned
        res["y"] = float(y[0])
        sanitizer.step(2)
        x = torch.full((1 << 14,), 2.0)
        if rank == 1:
            dist.barrier()
            sys.stdout.flush()
            os._exit(0)                        # gone before the all-reduce below
        dist.barrier()
        try:
            dist.all_reduce(x)
            res["failed"] = False
        except Exception as exc:
            res["failed"] = True
            res["failure"] = type(exc).__name__ + ": " + str(exc)[:200]
        x.mul_(3)                              # the failed Work no longer touches x
        del x
        sanitizer.step(3)
        with open(out, "w") as f:
            json.dump(res, f)
        os._exit(0)                            # the group is broken: no orderly destroy

    if __name__ == "__main__":
        init, out = sys.argv[1], sys.argv[2]
        ctx = mp.spawn(worker, args=(2, init, out), nprocs=2, join=False)
        while not ctx.join():                  # rank 1 ends first, on purpose
            pass
''')


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("failed_works")
    (d / "prog.py").write_text(PROGRAM)
    traces = d / "traces"
    env = {**os.environ, "HAZSAN": "1", "HAZSAN_LEVEL": "full", "HAZSAN_DIR": str(traces),
           "HAZSAN_FLUSH_SECONDS": "0.2"}
    p = subprocess.run([sys.executable, str(d / "prog.py"), f"file://{d / 'store'}", str(d / "out.json")],
                       cwd=d, env=env, capture_output=True, text=True, timeout=180)
    assert (d / "out.json").exists(), p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads((d / "out.json").read_text())
    check = subprocess.run([sys.executable, "-m", "sanitizer", "check", str(traces), "--format", "json"],
                           capture_output=True, text=True, timeout=120)
    return res, json.loads(check.stdout)


def test_the_program_saw_both_failures(run):
    res, _ = run
    assert res["timed_out"], res
    assert res["failed"], res
    assert res["y"] == 4.0, "1 + 1 reduced over 2 ranks, +1 twice on rank 0"


def test_a_timed_out_wait_leaves_the_work_in_flight(run):
    _, doc = run
    step1 = [f for f in doc["findings"] if f["step"] == 1]
    assert {f["rule"] for f in step1} == {"unordered-access"}, step1
    assert len(step1) == 1, "the write after the proper wait is clean"


def test_a_failed_work_is_done(run):
    _, doc = run
    assert [f for f in doc["findings"] if f["step"] >= 2] == []
