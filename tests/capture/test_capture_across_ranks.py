"""ai-dynamo/dynamo#826's fix, vLLM's NIXL way, on real gloo, 2 ranks on loopback, under `hazsan
run` (issue 54, class 3; docs/ordering-and-rules.md, "Ordering across ranks").

Rank 0 (prefill) writes a KV page of a persistent cache, sends it with `isend` and never waits the
handle (it keeps it); rank 1 (decode) receives it with a blocking `recv`. Rank 0 then reuses the
page (writes it again). Each rank alone never sees the send complete, so every reuse looked like a
race; the fix's order is the decode rank's "done reading" message, which capture records:

  400  the fix: rank 1 sends "done" by `dist.send` on a second group after its recv; rank 0
       `dist.recv`s it, then reuses the page: clean;
  401  no notification, the race won (rank 0 sleeps before the reuse: the data had arrived):
       flagged;
  402  no notification, the race lost (rank 1 sleeps before its recv: rank 0's reuse overwrites
       the page under the send, and rank 1 receives -1): flagged;
  403  the notification is an all_reduce on the second group: clean;
  404  ... a barrier of the second group: clean;
  405  the notification is sent, but rank 0 reuses the page before receiving it, race won (it
       sleeps first): flagged;
  406  ... race lost (rank 1 sleeps before its recv): flagged.

Each step ends with a barrier of the default group (a real order: the findings are in the step
that reuses the page before it). Every finding on a send still in flight carries the note that
the order may come from a channel capture does not record. On both capture paths at `full`.
"""
from __future__ import annotations

import textwrap

import pytest

from gloo_programs import by_op_step, run_under_hazsan

pytest.importorskip("torch")

pytestmark = pytest.mark.usefixtures("jsonl_capture")

PROGRAM = textwrap.dedent(r'''
    import json, sys, time
    import torch.multiprocessing as mp

    N = 1 << 16

    def worker(rank, ws, init, out):
        global torch
        import torch, torch.distributed as dist
        import sanitizer
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ws)
        note_group = dist.new_group([0, 1])
        cache = torch.zeros(8, N)                   # the KV cache: pages live for the whole run
        res, kept = {}, []
        for step, how in ((400, "fixed"), (401, "won"), (402, "lost"), (403, "all_reduce"),
                          (404, "barrier"), (405, "early-won"), (406, "early-lost")):
            sanitizer.step(step)
            page = cache[step % 8]
            if rank == 0:
                page.fill_(float(step))
                kept.append(dist.isend(page, 1))     # the KV page, never waited
                if how in ("won", "early-won"):
                    time.sleep(0.3)                  # the decode rank has long received it
                if how.startswith("early"):
                    page.fill_(-1.0)                 # the reuse
                if how in ("fixed", "early-won", "early-lost"):
                    note = torch.zeros(1)
                    dist.recv(note, 1, group=note_group)
                elif how == "all_reduce":
                    dist.all_reduce(torch.zeros(1), group=note_group)
                elif how == "barrier":
                    dist.barrier(group=note_group)
                if not how.startswith("early"):
                    page.fill_(-1.0)                 # the reuse
            else:
                got = torch.empty(N)
                if how in ("lost", "early-lost"):
                    time.sleep(0.3)
                dist.recv(got, 0)
                res[str(step)] = float(got.min())
                if how in ("fixed", "early-won", "early-lost"):
                    dist.send(torch.ones(1), 0, group=note_group)    # "done reading"
                elif how == "all_reduce":
                    dist.all_reduce(torch.ones(1), group=note_group)
                elif how == "barrier":
                    dist.barrier(group=note_group)
            dist.barrier()
        sanitizer.step(490)
        dist.barrier()
        json.dump(res, open(f"{out}/res{rank}.json", "w"))
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(2, sys.argv[1], sys.argv[2]), nprocs=2)
''')

BUGGY, CLEAN = (401, 402, 405, 406), (400, 403, 404)
REUSE_LINES = {i for i, l in enumerate(PROGRAM.splitlines(), 1) if "# the reuse" in l}


@pytest.fixture(scope="module", params=["full", "full-native"])
def run(request, tmp_path_factory):
    return request.param, run_under_hazsan(tmp_path_factory.mktemp(request.param), request.param, PROGRAM)[:4]


def test_the_decode_rank_received_what_the_program_says(run):
    _, (_, _, res, _) = run
    for step in CLEAN:
        assert res[1][str(step)] == float(step), res[1]
    assert res[1]["402"] == -1.0, res[1]        # the lost race corrupted the page (the bug is real)


def test_the_bug_is_flagged_whether_the_race_was_won_or_lost(run):
    level, (rc, report, _, _) = run
    found = by_op_step(report)
    for step in BUGGY:
        fs = found.get(step, [])
        assert fs, (level, step, report["summary"]["by_rule"])
        for f in fs:
            assert f["rule"] == "unordered-access" and f["rank"] == 0, f
            assert f["op"]["op"] == "c10d.send" and f["op"]["comm"].endswith(":p2p:0-1"), f["op"]
            assert int(f["site"].split(":")[1]) in REUSE_LINES, f["site"]
            assert "ZMQ, NIXL" in f["note"], f
    assert rc == 1


def test_the_fix_and_the_collective_notifications_are_clean(run):
    level, (_, report, _, _) = run
    found = by_op_step(report)
    for step in (*CLEAN, 490):
        assert not found.get(step), (level, step, found.get(step)[:3])
    s = report["summary"]
    assert s["hook_errors"] == 0 and s["complete"], s
    # every finding is on a buggy step's send: nothing else in the program is flagged
    assert set(found) <= set(BUGGY), sorted(found)


def test_the_races_ran_as_named(run):
    """No plain coll_done of any KV send in either rank's trace: the order is the peer's message."""
    _, (_, _, _, events) = run
    sends = {e["cid"] for e in events[0] if e["ev"] == "coll" and e["op"] == "c10d.send" and ":p2p:" in e["comm"]
             and e["comm"].startswith("0:")}
    assert len(sends) == 7, sends
    assert not [e for e in events[0] if e["ev"] == "coll_done" and e["cid"] in sends and not e.get("observed")]
