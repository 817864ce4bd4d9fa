"""Capture of torch.distributed collectives: real gloo process groups on loopback, 2 and 4 ranks.

Checks the events each rank records (coll with buffers, comm, seq, stream; coll_done when the host
observes completion) and that the whole run is valid, clean input for the engine. The program is
started with torch.multiprocessing.spawn, so activation through the .pth in spawned children is
exercised too. (test_capture_release.py has the hazard/clean pair.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

# these tests read the trace lines by hand: capture writes JSON Lines here (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("jsonl_capture")

pytest.importorskip("torch")

FOUR_RANKS = textwrap.dedent(r'''
    import json, os, sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    import sanitizer

    def worker(rank, ws, init, outdir):
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ws)
        ptr = {}
        sanitizer.step(1)
        x = torch.full((64,), float(rank)); ptr["x"] = x.data_ptr()
        dist.all_reduce(x)                                   # blocking
        sanitizer.step(2)
        y = torch.ones(32); ptr["y"] = y.data_ptr()
        w = dist.all_reduce(y, async_op=True)
        sanitizer.step(3)                                    # in flight until wait
        w.wait()
        sanitizer.step(4)
        big = torch.empty(4 * 8); part = torch.full((8,), float(rank))
        ptr["big"], ptr["part"] = big.data_ptr(), part.data_ptr()
        w = dist.all_gather_into_tensor(big, part, async_op=True)
        while not w.is_completed():
            pass
        sanitizer.step(5)
        out = torch.empty(8); dist.reduce_scatter_tensor(out, torch.ones(32))
        b = torch.full((16,), float(rank)); ptr["b"] = b.data_ptr()
        dist.broadcast(b, src=1)
        a2a_in, a2a_out = torch.arange(8.0), torch.empty(8)
        dist.all_to_all_single(a2a_out, a2a_in)
        f = dist.all_reduce(torch.ones(4), async_op=True).get_future()
        sanitizer.step(6)
        f.wait()
        sanitizer.step(7)
        peer = rank ^ 1
        msg = torch.full((5,), float(rank))
        if rank % 2 == 0:
            dist.send(msg, dst=peer)
        else:
            dist.recv(msg, src=peer)
        sub = dist.new_group([0, 1])
        if rank < 2:
            dist.all_reduce(torch.ones(3), group=sub)
        dist.barrier()
        sanitizer.step(8)
        assert x[0].item() == sum(range(ws)) and b[0].item() == 1.0
        with open(os.path.join(outdir, f"ptr{rank}.json"), "w") as fh:
            json.dump(ptr, fh)
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(4, sys.argv[1], sys.argv[2]), nprocs=4)
''')

def _load(path):
    with open(path, "rb") as f:
        lines = [json.loads(line) for line in f]
    return lines[0], lines[1:]


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    d = tmp_path_factory.mktemp("four")
    (d / "prog.py").write_text(FOUR_RANKS)
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=str(d / "traces"))
    out = subprocess.run([sys.executable, "prog.py", f"file://{d}/rdv", str(d)], cwd=d, env=env,
                         capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = {}
    for r in range(4):
        header, events = _load(d / "traces" / f"rank{r}.jsonl")
        ptr = json.loads((d / f"ptr{r}.json").read_text())
        ranks[r] = (header, events, ptr)
    files = sorted(os.listdir(d / "traces"))
    assert [f for f in files if f.startswith("rank")] == [f"rank{r}.jsonl" for r in range(4)]
    for f in files:                 # the launcher imported torch but recorded nothing: its header
        if not f.startswith("rank"):
            header, events = _load(d / "traces" / f)
            assert [e["ev"] for e in events] == ["end"] and "dispatch-mode" in header["hooks"]["installed"]
    return d, ranks


def _colls(events):
    return [e for e in events if e["ev"] == "coll"]


def test_every_rank_named_and_headed(four):
    _, ranks = four
    for r, (header, _, _) in ranks.items():
        assert (header["rank"], header["world_size"], header["device"]) == (r, 4, "cpu")


def test_seq_equal_across_ranks_per_communicator(four):
    _, ranks = four
    per_rank = {r: {(c["comm"], c["seq"]): c["op"] for c in _colls(ev)} for r, (_, ev, _) in ranks.items()}
    world = {r: {k: v for k, v in m.items() if k[0] == "0"} for r, m in per_rank.items()}
    assert world[0] == world[1] == world[2] == world[3]
    assert [world[0][("0", s)] for s in range(len(world[0]))][:7] == [
        "c10d.allreduce_", "c10d.allreduce_", "c10d._allgather_base_", "c10d._reduce_scatter_base_",
        "c10d.broadcast_", "c10d.alltoall_base_", "c10d.allreduce_"]
    assert world[0][("0", len(world[0]) - 1)] == "c10d.barrier"
    # the subgroup: only ranks 0 and 1, with its own name and numbering
    sub = {r: [k for k in m if k[0] not in ("0",) and ":p2p:" not in k[0]] for r, m in per_rank.items()}
    assert sub[0] == sub[1] and len(sub[0]) == 1 and sub[0][0][1] == 0 and not sub[2] and not sub[3]
    # point to point: the pair's own comm, seq 0 at both ends
    assert ("0:p2p:0-1", 0) in per_rank[0] and ("0:p2p:0-1", 0) in per_rank[1]
    assert per_rank[0][("0:p2p:0-1", 0)] == "c10d.send" and per_rank[1][("0:p2p:0-1", 0)] == "c10d.recv_"
    assert ("0:p2p:2-3", 0) in per_rank[2]


def test_buffers_addresses_access_and_stream(four):
    _, ranks = four
    for r, (_, events, ptr) in ranks.items():
        c = _colls(events)
        assert all(e["stream"] == "gloo:0" for e in c if e["comm"] == "0")
        assert c[0]["bufs"] == [{"addr": ptr["x"], "size": 256, "access": "rw"}]
        assert c[1]["bufs"] == [{"addr": ptr["y"], "size": 128, "access": "rw"}]
        assert c[2]["bufs"] == [{"addr": ptr["part"], "size": 32, "access": "r"},
                                {"addr": ptr["big"], "size": 128, "access": "w"}]
        bc = c[4]
        assert bc["op"] == "c10d.broadcast_" and bc["bufs"][0]["addr"] == ptr["b"]
        assert bc["bufs"][0]["access"] == ("r" if r == 1 else "w")
        assert c[0]["site"].startswith("prog.py:") and c[0]["site"].endswith(":worker")


def test_completion_observed_when_the_host_sees_it(four):
    _, ranks = four
    for r, (_, events, _) in ranks.items():
        by_step, step = {}, None
        for e in events:
            if e["ev"] == "step":
                step = e["n"]
            by_step.setdefault(step, []).append(e)
        cid = {c["cid"]: c for c in _colls(events)}
        done_step = {e["cid"]: s for s, evs in by_step.items() for e in evs if e["ev"] == "coll_done"}
        issue_step = {c["cid"]: s for s, evs in by_step.items() for c in evs if c["ev"] == "coll"}
        assert set(done_step) == set(cid)                       # every collective completes
        order = [e.get("cid") for e in events if e["ev"] in ("coll", "coll_done")]
        for c in cid:                                           # coll before its coll_done
            assert order.index(c) < len(order) - 1 - order[::-1].index(c)
        first, second, third = sorted(cid)[:3]
        assert issue_step[first] == done_step[first] == 1       # blocking: done at once
        assert (issue_step[second], done_step[second]) == (2, 3)  # async: done at wait(), not before
        assert (issue_step[third], done_step[third]) == (4, 4)  # is_completed() polled True
        fut = [c for c in cid if issue_step[c] == 5 and cid[c]["op"] == "c10d.allreduce_"]
        assert len(fut) == 1 and done_step[fut[0]] == 6         # Future.wait()


def test_whole_run_is_valid_and_clean(four):
    from sanitizer.rules.driver import analyze
    d, _ = four
    a = analyze([d / "traces"])
    assert not a.errors, a.errors
    launchers = [f for f in os.listdir(d / "traces") if not f.startswith("rank")]  # header only
    # the launchers are judged with the ranks but are none (header rank -PID)
    assert (a.summary["ranks"], a.summary["unranked"]) == (4, len(launchers)), a.summary
    assert not a.findings, [f.rule for f in a.findings]
    assert a.summary["hook_errors"] == 0 and a.summary["dropped_events"] == 0
