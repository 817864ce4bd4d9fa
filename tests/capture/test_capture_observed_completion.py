"""vllm-ascend#11961 (review thread) on real gloo, 2 ranks on loopback, under `hazsan run`: three
`all_gather_into_tensor(..., async_op=True)`, the first two handles dropped, only the third waited,
then all three outputs read (issue 54, class 1).

Capture sees a dropped gather finish by itself: its temporary input dies once gloo's worker lets go
of the Work (collective_state.WorkHeldTensors). That look is not the program's synchronisation: it
is written as an observed `coll_done`, which frees the memory for the analysis but orders no read.
So the bug is flagged whatever the timing:

  300  the race won: the dropped gathers finished long before the read (a sleep first), capture
       saw them finish before it (their observed `coll_done` precede the read in the trace);
  301  the race lost: the first gather is large, the waited third small, and the outputs are read
       at once, while the first one still runs (no completion of it before the read);
  302  the fix, every handle waited: clean;
  303  the program polls `is_completed()` on every handle until all say so, then reads: that is the
       program's own synchronisation (docs/ordering-and-rules.md, "Observed completion"): clean.

On both capture paths at `full` (the dispatch mode, HAZSAN_NATIVE=0, and the native recorder), and at
`alloc` (no reads recorded there: the frees of the dropped gathers' inputs are no free-in-flight).
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

    def worker(rank, ws, init, out):
        global torch
        import torch, torch.distributed as dist
        import sanitizer
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ws)
        res = {}
        # (step, handles waited, the race: won / lost / the program polls, first gather's elements)
        for step, fixed, timing, big in ((300, False, "won", 1024), (301, False, "lost", 1 << 23),
                                         (302, True, "won", 1024), (303, True, "polled", 1024)):
            sanitizer.step(step)
            sizes = (big, 1024, 1024)
            outs = [torch.empty(n * ws) for n in sizes]
            handles = []
            for i, n in enumerate(sizes):
                # the input is a temporary (vllm-ascend: x.contiguous()): only the Work keeps it
                h = dist.all_gather_into_tensor(outs[i], torch.full((n,), float(rank + i)) * 1.0,
                                                async_op=True)
                if fixed or i == 2:
                    handles.append(h)
            if timing == "polled":
                while not all(h.is_completed() for h in handles):
                    time.sleep(0.001)
            else:
                for h in handles:
                    h.wait()
            if timing == "won":
                time.sleep(0.3)                      # the dropped gathers are long done
            firsts = [float(o[0]) for o in outs]     # the read
            res[str(step)] = firsts
            for h in handles[:-1] if timing == "lost" else ():
                h.wait()
            dist.barrier()                           # (the lost gather is done before the next step)
            del outs, handles
        sanitizer.step(390)
        dist.barrier()
        json.dump(res, open(f"{out}/res{rank}.json", "w"))
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(2, sys.argv[1], sys.argv[2]), nprocs=2)
''')

BUGGY, CLEAN = (300, 301), (302, 303)
# the site of the program's read of the outputs
READ_SITE = f"prog.py:{next(i for i, l in enumerate(PROGRAM.splitlines(), 1) if '# the read' in l)}:"


@pytest.fixture(scope="module", params=["full", "full-native", "alloc"])
def run(request, tmp_path_factory):
    return request.param, run_under_hazsan(tmp_path_factory.mktemp(request.param), request.param, PROGRAM)[:4]


def _read_and_gathers(events, step):
    """(index of the read of the first output in rank 0's events, {cid: index of each coll_done
    and whether observed}, cids of the step's gathers in order)."""
    at, read, done, cids = None, None, {}, []
    for i, ev in enumerate(events):
        if ev["ev"] == "step":
            at = ev["n"]
        elif at != step:
            continue
        elif ev["ev"] == "coll" and "allgather" in ev["op"]:
            cids.append(ev["cid"])
        elif ev["ev"] == "coll_done" and ev["cid"] in cids:
            done.setdefault(ev["cid"], []).append((i, bool(ev.get("observed"))))
        elif ev["ev"] == "launch" and read is None and cids and ev.get("site", "").startswith(READ_SITE):
            read = i
    return read, done, cids


def test_the_program_gathered_what_it_should(run):
    _, (_, _, res, _) = run
    for r in res:
        assert r["302"] == r["303"] == [0.0, 1.0, 2.0], r      # rank 0's part first in each output


def test_the_bug_is_flagged_whether_the_race_was_won_or_lost(run):
    level, (rc, report, _, _) = run
    found = by_op_step(report)
    if level == "alloc":
        # no reads at alloc; the dropped gathers' inputs die after the Work: no free-in-flight
        assert not report["findings"] and rc == 0, report["summary"]["by_rule"]
        return
    for step in BUGGY:
        rules = {f["rule"] for f in found.get(step, [])}
        assert rules == {"unordered-access"}, (level, step, report["summary"]["by_rule"])
        # each rank's read of the first two outputs, one finding per dropped gather
        ops = {(f["rank"], f["op"]["line"]) for f in found[step]}
        assert len(ops) == 4 and all(f["site"].startswith(READ_SITE) for f in found[step]), found[step]
    assert rc == 1


def test_the_fix_and_the_programs_own_poll_are_clean(run):
    level, (_, report, _, _) = run
    found = by_op_step(report)
    for step in (*CLEAN, 390):
        assert not found.get(step), (level, step, found.get(step)[:3])
    s = report["summary"]
    assert s["hook_errors"] == 0 and s["complete"], s


def test_the_races_ran_as_named_and_only_capture_s_looks_are_observed(run):
    """300: capture saw both dropped gathers finish before the read (observed coll_done first);
    301: the large first gather had no completion before the read. The waited and polled ones are
    the program's coll_done, never observed."""
    level, (_, _, _, events) = run
    if level == "alloc":
        return
    ev0 = events[0]
    read, done, cids = _read_and_gathers(ev0, 300)
    assert read is not None and len(cids) == 3, (read, cids)
    for cid in cids[:2]:
        assert done[cid][0][1] and done[cid][0][0] < read, (cid, done, read)
    assert done[cids[2]][0] < (read, False) and not done[cids[2]][0][1]
    read, done, cids = _read_and_gathers(ev0, 301)
    assert all(i > read for i, _ in done.get(cids[0], [])), (done, read)
    for step in CLEAN:
        _, done, cids = _read_and_gathers(ev0, step)
        assert [[o for _, o in done[c]] for c in cids] == [[False]] * 3, (step, done)
