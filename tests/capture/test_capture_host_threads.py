"""Host threads on real gloo, 2 ranks on loopback, under `hazsan run` (issue 54, class 2; capture
side: sanitizer/capture/threads.py, docs/capture.md "Host threads").

meta-pytorch/torchft#240 (review thread): "calling only work.wait() means that the code in the
future callback may have not run". A handler thread waits the gloo all-reduce's Work and completes
a torch.futures.Future (as torchft's ProcessGroupBaby does); the main thread registers
`fut.then(lambda f: f.value()[0].div_(n))`, then either waits only the Work (buggy) or the Future
`then` returned (fixed), and reads the tensor:

  400  buggy, the race won: the callback ran before the read (the main thread sleeps first);
  401  buggy, the race lost: the read before the callback (the handler sleeps before completing);
  402  fixed, the callback first;   403  fixed, the read would have come first.

Threads and the threading module's edges:

  410  a tensor written by main, read by a started thread, which writes another that main reads
       after join(): clean;
  411  the thread writes, then sets an Event; main waits the Event and reads: clean;
  412  no edge: the thread writes, main reads after a sleep (the write came first): flagged;
  413  no edge: main reads at once, the thread writes after a sleep (the read came first): flagged;
  420  a queue.Queue handoff (the thread writes, puts; main gets, reads): clean;
  421  the same handoff through a plain attribute main busy-waits on: flagged;
  430  a concurrent.futures.ThreadPoolExecutor job waited with result(), then read: clean;
  431  the job's tensor read while it may still run: flagged.

Both capture paths at `full` (the dispatch mode and the native recorder).
"""
from __future__ import annotations

import textwrap

import pytest

from gloo_programs import by_op_step, run_under_hazsan

pytest.importorskip("torch")

pytestmark = pytest.mark.usefixtures("jsonl_capture")

PROGRAM = textwrap.dedent(r'''
    import json, queue, sys, threading, time
    import torch.multiprocessing as mp

    def worker(rank, ws, init, out):
        global torch
        import torch, torch.distributed as dist
        import sanitizer
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ws)
        res = {}
        # torchft#240: (step, fixed, which comes first)
        for step, fixed, first in ((400, False, "callback"), (401, False, "read"),
                                   (402, True, "callback"), (403, True, "read")):
            sanitizer.step(step)
            t = torch.full((1024,), float(rank + 1))
            work = dist.all_reduce(t, async_op=True)
            fut = torch.futures.Future()

            def handler():                   # ProcessGroupBaby's future handler thread
                work.wait()
                if first == "read":
                    time.sleep(0.3)
                fut.set_result([t])
            th = threading.Thread(target=handler)
            th.start()
            child = fut.then(lambda f: f.value()[0].div_(ws))
            if fixed:
                child.wait()
            else:
                work.wait()                  # the bug: the callback may not have run
            if first == "callback":
                time.sleep(0.3)
            res[str(step)] = float(t[0])     # the read
            th.join()
            child.wait()
            dist.barrier()
            del t, work, fut, child

        def run(step, target, after):
            sanitizer.step(step)
            th = threading.Thread(target=target)
            th.start()
            got = after(th)
            th.join()
            res[str(step)] = got
            dist.barrier()

        # 410: start and join
        a, b = torch.zeros(256), torch.zeros(256)
        a.add_(1.0)                          # main writes
        def reader():
            b.copy_(a * 2.0)                 # the thread reads a, writes b
        run(410, reader, lambda th: (th.join(), float(b.sum()))[1])
        # 411: an Event set after the write
        c, ready = torch.zeros(256), threading.Event()
        def setter():
            c.add_(3.0)
            ready.set()
        run(411, setter, lambda th: (ready.wait(), float(c.sum()))[1])
        # 412 / 413: no edge, either order
        d, e = torch.zeros(256), torch.zeros(256)
        def early():
            d.add_(5.0)
        run(412, early, lambda th: (time.sleep(0.3), float(d.sum()))[1])
        def late():
            time.sleep(0.3)
            e.add_(5.0)
        run(413, late, lambda th: float(e.sum()))
        # 420: a queue handoff; 421: the same through a flag main busy-waits on
        f, q = torch.zeros(256), queue.Queue()
        def producer():
            f.add_(7.0)
            q.put("ready")
        run(420, producer, lambda th: (q.get(), float(f.sum()))[1])
        g, flag = torch.zeros(256), {"ready": False}
        def flagger():
            g.add_(7.0)
            flag["ready"] = True
        def spin(th):
            while not flag["ready"]:
                time.sleep(0.001)
            return float(g.sum())
        run(421, flagger, spin)
        # 430: a ThreadPoolExecutor job, its result() waited; 431: read while it may still run
        import concurrent.futures as cf
        h = torch.zeros(256)
        with cf.ThreadPoolExecutor(1) as ex:
            sanitizer.step(430)
            ex.submit(h.add_, 9.0).result()
            res["430"] = float(h.sum())
            dist.barrier()
            sanitizer.step(431)
            job = ex.submit(h.add_, 9.0)
            time.sleep(0.3)
            res["431"] = float(h.sum())
            job.result()
            dist.barrier()
        sanitizer.step(490)
        dist.barrier()
        json.dump(res, open(f"{out}/res{rank}.json", "w"))
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(2, sys.argv[1], sys.argv[2]), nprocs=2)
''')

BUGGY, CLEAN = (400, 401, 412, 413, 421, 431), (402, 403, 410, 411, 420, 430)


@pytest.fixture(scope="module", params=["full", "full-native"])
def run(request, tmp_path_factory):
    return request.param, run_under_hazsan(tmp_path_factory.mktemp(request.param), request.param, PROGRAM)[:4]


def _steps(events):
    """{step: its events}, each event (index, event, thread), thread 0 for the main one."""
    out, step, thread = {}, None, 0
    for i, ev in enumerate(events):
        if ev["ev"] == "thread":
            thread = ev["thread"]
        elif ev["ev"] == "step":
            step = ev["n"]
        out.setdefault(step, []).append((i, ev, thread))
    return out


def test_the_program_computed_what_it_should(run):
    _, (_, _, res, _) = run
    for r in res:
        assert r["402"] == r["403"] == 1.5, r            # (1 + 2) / 2, the callback before the read
        assert r["400"] == 1.5 and r["401"] == 3.0, r    # the buggy reads, as the timing made them
        assert r["410"] == 512.0 and r["411"] == 768.0 and r["420"] == r["421"] == 1792.0, r
        assert r["430"] == 2304.0 and r["431"] == 4608.0, r


def test_buggy_flagged_in_either_order_and_fixed_clean(run):
    level, (rc, report, _, _) = run
    found = by_op_step(report)
    for step in BUGGY:
        rules = {f["rule"] for f in found.get(step, [])}
        assert rules == {"unordered-access"}, (level, step, report["summary"]["by_rule"])
        assert {f["rank"] for f in found[step]} == {0, 1}, (step, found[step])
    for step in (*CLEAN, 490):
        assert not found.get(step), (level, step, found.get(step)[:3])
    assert rc == 1
    s = report["summary"]
    assert s["hook_errors"] == 0 and s["complete"], s


def test_the_callback_is_on_the_handler_thread_after_the_edges(run):
    """The trace of 400 and 402, rank 0: the handler thread started by main, its coll_done, the
    Future's release, the callback (acquire, the div_ on the handler's lane, release of the
    child's key); in 402 the main thread acquires that key before its read, in 400 it does not."""
    level, (_, _, _, events) = run
    steps = _steps(events[0])
    for step, fixed in ((400, False), (402, True)):
        evs = steps[step]
        starts = [ev["thread"] for _, ev, th in evs if ev["ev"] == "thread_start" and th == 0]
        assert len(starts) == 1, (step, starts)
        h = starts[0]
        kinds = [(ev["ev"], th) for _, ev, th in evs]
        cid = next(ev["cid"] for _, ev, th in evs if ev["ev"] == "coll" and th == 0)
        assert ("coll_done", h) in kinds and any(e["ev"] == "coll_done" and e["cid"] == cid and th == h
                                                 for _, e, th in evs)
        div = [(i, ev) for i, ev, th in evs if ev["ev"] == "launch" and "div_" in ev.get("op", "")]
        assert len(div) == 1 and div[0][1]["stream"] == f"cpu@{h}", (step, div)
        i_div = div[0][0]
        rel = [(i, ev["sync"]) for i, ev, th in evs if ev["ev"] == "release" and th == h]
        acq = [(i, ev["sync"]) for i, ev, th in evs if ev["ev"] == "acquire" and th == h]
        fut_key = rel[0][1]
        assert rel[0][0] < i_div and (fut_key in [k for i, k in acq if i < i_div]), (rel, acq, i_div)
        child_key = next(k for i, k in rel if i > i_div)
        read = next(i for i, ev, th in evs if th == 0 and ev["ev"] == "launch" and "local_scalar" in ev.get("op", ""))
        main_acq = [ev["sync"] for i, ev, th in evs if ev["ev"] == "acquire" and th == 0 and i < read]
        assert (child_key in main_acq) == fixed, (step, child_key, main_acq)
        # every CPU access of the main thread on `cpu`, the handler's on its lane
        for _, ev, th in evs:
            if ev["ev"] == "launch":
                assert ev["stream"] == ("cpu" if th == 0 else f"cpu@{th}"), (step, ev, th)
        end = [i for i, ev, th in evs if ev["ev"] == "thread_end" and ev["thread"] == h and th == h]
        join = [i for i, ev, th in evs if ev["ev"] == "thread_join" and ev["thread"] == h and th == 0]
        assert end and join and end[0] < join[0], (end, join)


def test_thread_start_comes_before_the_thread_s_first_event(run):
    """Each thread main starts (11: the executor's one) has its thread_start, written by main, before any event of its
    own; a thread the program did not start (gloo's) issues no CPU access on a lane."""
    _, (_, _, _, events) = run
    started, n = set(), 0
    thread = 0
    for ev in events[0]:
        if ev["ev"] == "thread":
            thread = ev["thread"]
            continue
        if ev["ev"] == "thread_start":
            assert thread == 0
            started.add(ev["thread"])
            n += 1
        elif ev["ev"] == "thread_end":
            started.discard(ev["thread"])    # (an id used again is a new thread)
        elif thread != 0 and thread not in started:
            assert ev["ev"] in ("free", "coll_done", "alloc") or (ev["ev"] == "launch" and ev["stream"] == "cpu"), ev
    assert n == 11, n
