"""What each backend guarantees, on real gloo process groups (2 ranks on loopback, spawned).

One program runs, a decode step per case, under `hazsan run` at `alloc` and at `full`:

  10/11  DeepSpeed#8539's pattern: ZeRO-3's coalesced all-gathers, only `launch_handles[-1]`
         waited, the outputs then read (10); the fix waits every handle (11)
  20/21  vllm-ascend#11961's: three `all_gather` handles, two discarded, only the third waited,
         the gathered lists read (20); the fix waits all three (21)
  30/31  gloo completes a group's Works out of order, here deterministically: an `irecv` whose
         sender sends only after this rank's later all-gather completed; the receive buffer read
         after waiting the all-gather alone (30), after its own wait (31)
  40     a reduce-scatter's padded input freed right after enqueue: gloo cloned it in the call
  50     an all-gather's padded input dies inside `wait_tensor` (the Work held the last reference)
  60     `torch.futures.wait_all` on the Works' futures, then the outputs read
  65     all-reduces whose handles are dropped, then a barrier (gloo's waits for them), then read
  70     `all_to_all_single` on a transposed input raises "Tensors must be contiguous": never ran
  80/81  a Backend built directly (`ProcessGroupGloo(store, rank, size, opts)`, as PyTorch's own
         tests do): an all-reduce's tensor read before its wait (80), after it (81)
  82     that Backend's other collectives, each waited
  83     that Backend's gathers on temporary inputs, only their Futures kept (PyTorch's
         test_gather_stress): each input dies on gloo's worker once its Work ran, before the wait;
         an all-reduce whose Work and input are dropped at once (test_set_gloo_pg_timeout)

Every "bug" step must be flagged at `full`, where reads are seen, every other step clean: no
finding against an op it enqueued. At `alloc`, which sees no reads, the whole program is clean:
it frees nothing in flight, since a gloo Work holds its tensors until its worker ran it, so the
outputs of the handles 10 and 20 discard die after their collectives, each `coll_done` first.
Rank 0 also measures what the model rests on: how often a later small all-gather completes before
an earlier large one (gloo's thread pool), printed, and the deterministic case 30 asserted.
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import textwrap

import pytest

from gloo_programs import by_op_step, run_under_hazsan

pytest.importorskip("torch")

# these tests read the trace lines by hand: capture writes JSON Lines here (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("jsonl_capture")

PROGRAM = textwrap.dedent(r'''
    import gc, json, sys, threading, time, weakref
    import torch.multiprocessing as mp

    def died(t):
        """An Event set when t's storage dies (the program's own way of knowing, not an edge)."""
        ev = threading.Event()
        weakref.finalize(t.untyped_storage(), ev.set)
        return ev

    def worker(rank, ws, init, out):
        import torch, torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d
        import torch.distributed._functional_collectives as fc
        import sanitizer
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ws)
        store = c10d._get_default_store()
        group = dist.group.WORLD
        res = {}

        # --- the reordering itself, measured (no capture question here)
        late_first = 0
        for trial in range(10):
            big_in, big_out = torch.ones(1 << 20), torch.empty(ws << 20)
            small_in, small_out = torch.ones(4), torch.empty(4 * ws)
            a = dist.all_gather_into_tensor(big_out, big_in, async_op=True)
            b = dist.all_gather_into_tensor(small_out, small_in, async_op=True)
            b.wait()
            late_first += not a.is_completed()
            a.wait()
        res["later_small_first"] = late_first

        # 10/11: DeepSpeed#8539, ZeRO-3 coalesced all-gather
        for step, fixed in ((10, False), (11, True)):
            sanitizer.step(step)
            parts = [torch.full((256 * (i + 1),), float(rank + i)) for i in range(3)]
            outs = [torch.empty(ws * p.numel()) for p in parts]
            launch_handles = [dist.all_gather_into_tensor(o, p, async_op=True)
                              for o, p in zip(outs, parts)]
            if fixed:
                for h in launch_handles:
                    h.wait()
                del h
            else:
                launch_handles[-1].wait()
            total = sum(float(o.sum()) for o in outs)       # the outputs read
            gone = [died(o) for o in outs]
            del launch_handles, outs, parts
            gc.collect()
            for g in gone:
                g.wait(10)
            time.sleep(0.05)

        # 20/21: vllm-ascend#11961, three all_gather handles, two discarded
        for step, fixed in ((20, False), (21, True)):
            sanitizer.step(step)
            lists = [[torch.empty(64) for _ in range(ws)] for _ in range(3)]
            ins = [torch.full((64,), float(rank * 10 + i)) for i in range(3)]
            if fixed:
                hs = [dist.all_gather(lists[i], ins[i], async_op=True) for i in range(3)]
                for h in hs:
                    h.wait()
                del hs, h
            else:
                dist.all_gather(lists[0], ins[0], async_op=True)
                dist.all_gather(lists[1], ins[1], async_op=True)
                h = dist.all_gather(lists[2], ins[2], async_op=True)
                h.wait()
                del h
            total = sum(float(t.sum()) for l in lists for t in l)
            gone = [died(t) for l in lists for t in l]
            del lists, ins
            gc.collect()
            for g in gone:
                g.wait(10)
            time.sleep(0.05)

        # 30/31: a later Work of the group completes while an earlier one is still pending
        for step, fixed in ((30, False), (31, True)):
            sanitizer.step(step)
            buf = torch.zeros(32)
            gin, gout = torch.full((8,), float(rank)), torch.empty(8 * ws)
            if rank == 0:
                r = dist.irecv(buf, src=1)
                g = dist.all_gather_into_tensor(gout, gin, async_op=True)
                g.wait()
                res[f"recv_pending_{step}"] = not r.is_completed()
                store.set(f"send{step}", "1")
                if fixed:
                    r.wait()
                res[f"recv_{step}"] = float(buf.sum())     # read: before its wait in 30
                if not fixed:
                    r.wait()                      # (a gloo receive is waited once: a second blocks)
            else:
                g = dist.all_gather_into_tensor(gout, gin, async_op=True)
                g.wait()
                store.get(f"send{step}")
                dist.send(torch.ones(32), dst=0)
            del buf, gin, gout, g

        # 40: gloo's reduce-scatter clones its input inside the call (functional, as DTensor)
        sanitizer.step(40)
        padded = torch.nn.functional.pad(torch.ones(6), (0, 2))
        rs = fc.reduce_scatter_tensor(padded, "sum", 0, group)
        del padded                                        # freed after enqueue, before the wait
        res["rs"] = rs.wait().tolist() if hasattr(rs, "wait") else torch.ops._c10d_functional.wait_tensor(rs).tolist()
        del rs

        # 50: the padded input of an all-gather dies inside wait_tensor
        sanitizer.step(50)
        padded = torch.nn.functional.pad(torch.full((3,), float(rank)), (0, 1))
        ag = torch.ops._c10d_functional.all_gather_into_tensor(padded, ws, group.group_name)
        del padded                                        # the Work holds the last reference
        res["ag"] = torch.ops._c10d_functional.wait_tensor(ag).tolist()
        del ag

        # 60: torch.futures.wait_all on new wrappers of the same futures
        sanitizer.step(60)
        ts = [torch.full((16,), float(rank + i)) for i in range(3)]
        futs = [dist.all_reduce(t, async_op=True).get_future() for t in ts]
        torch.futures.wait_all(futs)
        res["wait_all"] = [float(t.sum()) for t in ts]
        del ts, futs

        # 65: gloo's barrier waits for every collective of its group enqueued before it
        # (PyTorch's test_barrier_implies_wait: the all-reduces' handles leaked)
        sanitizer.step(65)
        ts = [torch.full((100,), float(i)) for i in range(4)]
        for t in ts:
            dist.all_reduce(t, async_op=True)
        dist.barrier()
        res["barrier"] = [float(t[0]) for t in ts]
        del ts, t

        # 70: a collective whose kernel raises never ran
        sanitizer.step(70)
        src = torch.arange(16.0).reshape(4, 4)
        try:
            dist.all_to_all_single(torch.empty(4, 4), src.t())
            res["a2a_raised"] = False
        except (RuntimeError, ValueError) as exc:
            res["a2a_raised"] = "contiguous" in str(exc)
        del src

        # 80-82: a Backend built directly
        opts = c10d.ProcessGroupGloo._Options()
        opts._timeout = 30.0
        opts._devices = [c10d.ProcessGroupGloo.create_device(interface="lo")]
        opts._threads = 2
        pg = c10d.ProcessGroupGloo(dist.PrefixStore("direct", store), rank, ws, opts)
        res["is_backend"] = isinstance(pg, torch._C._distributed_c10d.Backend)
        dist.barrier(group=pg)
        for step, fixed in ((80, False), (81, True)):
            sanitizer.step(step)
            t = torch.full((64,), float(rank))
            w = pg.allreduce([t])
            if fixed:
                w.wait()
            res[f"backend_{step}"] = float(t.sum())
            w.wait()
            del t, w
        sanitizer.step(82)
        bo = c10d.BroadcastOptions(); bo.rootRank = 1; bo.rootTensor = 0
        x = torch.full((8,), float(rank)); pg.broadcast([x], bo).wait()
        y = torch.full((8,), float(rank)); pg.broadcast(y, root=0).wait()
        go = [[torch.empty(8) for _ in range(ws)]]; pg.allgather(go, [torch.full((8,), float(rank))]).wait()
        base = torch.empty(8 * ws); pg._allgather_base(base, torch.full((8,), float(rank))).wait()
        rso = torch.empty(4); pg._reduce_scatter_base(rso, torch.ones(4 * ws)).wait()
        if rank == 0:
            pg.send([torch.ones(8)], 1, 7).wait()
        else:
            rv = torch.empty(8); pg.recv([rv], 0, 7).wait()
        pg.barrier().wait()
        try:
            pg.alltoall_base(torch.empty(4, 4), torch.arange(16.0).reshape(4, 4).t(), [], []).wait()
            res["backend_a2a_raised"] = False
        except (RuntimeError, ValueError):
            res["backend_a2a_raised"] = True
        res["backend"] = [x.tolist(), y.tolist(), base.tolist(), rso.tolist()]
        del x, y, go, base, rso

        # 83: gathers whose inputs are temporaries, only their Futures kept (PyTorch's
        # test_gather_stress): the Work holds each input until it ran, and lets go of it on
        # gloo's worker, before the host waits; the freed memory is then reused and written
        sanitizer.step(83)
        futs, gone = [], []
        outs = [torch.full((64,), -1.0) for _ in range(ws)]
        for root in range(ws):
            go = c10d.GatherOptions(); go.rootRank = root
            tmp = torch.full((64,), float(rank))
            gone.append(died(tmp))
            futs.append(pg.gather([outs] if root == rank else [], [tmp], go).get_future())
            del tmp
        res["gather_inputs_died"] = all(g.wait(10) for g in gone)
        reused = [torch.full((64,), 7.0) for _ in range(8)]
        for f in futs:
            f.wait()
        res["gather"] = [float(o[0]) for o in outs]
        del futs, outs, reused, go, f
        # and an all-reduce whose Work and input rank 0 drops at once (test_set_gloo_pg_timeout):
        # the input dies when gloo's worker releases the Work, after it ran (rank 1 joins 0.3 s
        # later, so it cannot have run before rank 0 dropped it; rank 1 waits for its own)
        if rank == 0:
            pg.allreduce([torch.rand(64)])
            time.sleep(1.0)
        else:
            time.sleep(0.3)
            pg.allreduce([torch.rand(64)]).wait()
        sanitizer.step(90)
        dist.barrier()
        json.dump(res, open(f"{out}/res{rank}.json", "w"))
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(2, sys.argv[1], sys.argv[2]), nprocs=2)
''')

BUGS = {10: "DeepSpeed#8539", 20: "vllm-ascend#11961", 30: "gloo out-of-order", 80: "Backend read before wait"}
CLEAN = (11, 21, 31, 40, 50, 60, 65, 70, 81, 82, 83)


@pytest.fixture(scope="module", params=["full", "alloc", "alloc-native"])
def run(request, tmp_path_factory):
    return request.param, run_under_hazsan(tmp_path_factory.mktemp(request.param), request.param, PROGRAM)


def test_program_ran_as_upstream_torch_runs_it(run):
    level, (rc, report, res, events, err) = run
    r0, r1 = res
    assert r0["recv_pending_30"] and r0["recv_pending_31"], "gloo completed the later Work first"
    assert r0["recv_31"] == 32.0          # (recv_30 read the buffer before it arrived)
    assert r0["a2a_raised"] and r0["backend_a2a_raised"] and r0["is_backend"]
    assert r0["rs"] == [2.0] * 4 and r1["rs"] == [2.0, 2.0, 0.0, 0.0]     # 6 ones padded to 8
    assert r0["ag"] == r1["ag"] == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    assert r0["backend"][0] == [1.0] * 8 and r0["backend"][1] == [0.0] * 8
    assert r0["barrier"] == [0.0, 2.0, 4.0, 6.0]
    assert r0["gather_inputs_died"] and r1["gather_inputs_died"], "the Works kept their inputs"
    assert r0["gather"] == r1["gather"] == [0.0, 1.0]
    print(f"\n[{level}] later small all-gather completed first in {r0['later_small_first']}/10 "
          f"and {r1['later_small_first']}/10 trials (ranks 0, 1)")


def test_each_bug_pattern_is_flagged(run):
    level, (rc, report, res, events, err) = run
    found = by_op_step(report)
    if level.startswith("alloc"):
        # the bugs are reads (unseen at alloc); nothing is freed in flight
        assert report["findings"] == [], report["summary"]
        assert rc == 0
        return
    for step in BUGS:
        rules = {f["rule"] for f in found.get(step, [])}
        assert "unordered-access" in rules, (BUGS[step], level, rules, report["summary"])
    assert rc == 1


def test_discarded_handles_outputs_die_after_their_collectives(run):
    """DeepSpeed#8539 and vllm-ascend#11961 drop handles never waited, then the outputs: each
    output's storage dies once its Work let go of it, after the collective ran, on gloo's worker
    or on the program's thread; the collective's coll_done comes before the free either way."""
    level, (rc, report, res, events, err) = run
    for r in range(2):
        step, colls, allocs, done, order = None, {}, {}, set(), []
        for ev in events[r]:
            if ev["ev"] == "step":
                step = ev["n"]
            elif ev["ev"] == "alloc" and step in (10, 20):
                allocs[ev["id"]] = (ev["addr"], ev["size"])
            elif ev["ev"] == "coll" and step in (10, 20):
                colls[ev["cid"]] = [(b["addr"], b["size"]) for b in ev["bufs"] if b["access"] == "w"]
            elif ev["ev"] == "coll_done":
                done.add(ev["cid"])
            elif ev["ev"] == "free" and ev["id"] in allocs:
                a, n = allocs[ev["id"]]
                for cid, outs in colls.items():
                    if any(a <= o < a + n for o, _ in outs):
                        order.append((cid, cid in done))
        assert len(colls) == 6 and len(order) >= 9, (r, colls, order)
        assert all(was_done for _, was_done in order), (r, order)


def test_each_fix_and_clean_case_has_no_finding(run):
    level, (rc, report, res, events, err) = run
    found = by_op_step(report)
    for step in CLEAN:
        assert not found.get(step), (step, level, found.get(step)[:3])
    assert report["summary"]["hook_errors"] == 0, report["summary"]


def test_gloo_works_complete_on_streams_of_their_own(run):
    level, (rc, report, res, events, err) = run
    for r in range(2):
        step, colls, streams_by_step = None, {}, collections.defaultdict(set)
        for ev in events[r]:
            if ev["ev"] == "step":
                step = ev["n"]
            elif ev["ev"] == "coll":
                colls[ev["cid"]] = ev
                streams_by_step[step].add(ev["stream"])
        # three Works in flight at once: three lanes of the group; sequential calls: one
        assert len(streams_by_step[10]) == 3 and len(streams_by_step[11]) == 3, streams_by_step
        assert all(s.startswith("gloo:") for s in streams_by_step[10])
        # the raising all_to_all_single was never recorded
        assert not any(c["op"].endswith("alltoall_base_") for c in colls.values())


def test_copied_input_and_death_inside_the_wait(run):
    level, (rc, report, res, events, err) = run
    for r in range(2):
        step, done_at, free_at, colls, allocs = None, {}, {}, {}, {}
        for i, ev in enumerate(events[r]):
            if ev["ev"] == "step":
                step = ev["n"]
            elif ev["ev"] == "coll" and step in (40, 50):
                colls[step] = ev
            elif ev["ev"] == "coll_done" and step == 50 and ev["cid"] == colls.get(50, {}).get("cid"):
                done_at[50] = i
            elif ev["ev"] == "alloc" and step in (40, 50):
                allocs[ev["id"]] = (step, ev["addr"], ev["size"])
            elif ev["ev"] == "free" and ev["id"] in allocs:
                free_at.setdefault(ev["id"], i)
        # 40: the reduce-scatter's bufs hold its result only (gloo cloned the input in the call)
        rs = colls[40]
        assert rs["op"] == "_c10d_functional.reduce_scatter_tensor"
        assert [b["access"] for b in rs["bufs"]] == ["w"], rs
        # 50: the padded input, read by the all-gather, is freed after the all-gather's coll_done
        ag = colls[50]
        inp = [b for b in ag["bufs"] if b["access"] == "r"][0]
        ids = [i for i, (s, a, n) in allocs.items() if s == 50 and a <= inp["addr"] < a + n]
        assert ids and ids[0] in free_at and free_at[ids[0]] > done_at[50], (ids, free_at, done_at)


def test_backend_collectives_recorded_alike_on_both_ranks(run):
    level, (rc, report, res, events, err) = run
    sigs = []
    for r in range(2):
        sig = [(ev["op"], ev["comm"], ev["seq"], sorted(b["size"] for b in ev["bufs"]))
               for ev in events[r] if ev["ev"] == "coll" and ev["op"].startswith("Backend.")]
        sigs.append(sig)
    ops = {s[0] for s in sigs[0]}
    assert {"Backend.allreduce", "Backend.broadcast", "Backend.allgather", "Backend._allgather_base",
            "Backend._reduce_scatter_base", "Backend.barrier"} <= ops, ops
    assert "Backend.alltoall_base" not in ops          # raised: never ran
    p2p = [s for s in sigs[0] if s[0] in ("Backend.send", "Backend.recv")]
    assert p2p and p2p[0][1].endswith(":p2p:0-1")
    # send on one rank, recv on the other: the same comm and seq, the rest identical
    # (a gather's outputs are on its root only)
    strip = lambda sig: [(c, q, n if o != "Backend.gather" else None) for o, c, q, n in sig]
    assert strip(sigs[0]) == strip(sigs[1])


COVERAGE = textwrap.dedent(r'''
    import os, sys
    import torch, torch.distributed as dist
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", sys.argv[1]
    dist.init_process_group("gloo", rank=0, world_size=1)
    # a collective op in c10d's namespace that no table of capture describes (a newer torch's)
    lib = torch.library.Library("c10d", "FRAGMENT")
    lib.define("hazsan_probe_(Tensor[] tensors) -> Tensor[]")
    lib.impl("hazsan_probe_", lambda ts: [t.add_(1) for t in ts], "CPU")
    x = torch.zeros(4)
    torch.ops.c10d.hazsan_probe_([x])
    torch.ops.c10d.hazsan_probe_([x])
    dist.all_reduce(x)
    dist.destroy_process_group()
''')


def test_what_capture_cannot_see_is_said(tmp_path):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL (ProcessGroupWrapper's own check collectives, from C++) and
    a collective op no table describes: both in the header's `coverage`, both warned by check."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "prog.py").write_text(COVERAGE)
    env = {**os.environ, "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    out = subprocess.run([sys.executable, "-m", "sanitizer", "run", "--dir", str(tmp_path / "t"),
                          "--format", "json", "--", sys.executable, "prog.py", str(port)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    report = json.loads(out.stdout)
    header = json.loads(next((tmp_path / "t").glob("*rank0*")).read_text().splitlines()[0])
    cov = header["coverage"]
    assert cov["unrecorded"] == {"c10d.hazsan_probe_": 2}, cov
    assert any("TORCH_DISTRIBUTED_DEBUG=DETAIL" in g for g in cov["unseen"]), cov
    warnings = "\n".join(report["summary"]["warnings"])
    assert "2 collective call(s) capture could not record (c10d.hazsan_probe_ x2)" in warnings
    assert "ProcessGroupWrapper" in warnings
    assert report["summary"]["hook_errors"] == 0
