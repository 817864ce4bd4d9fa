"""Public bug reports, each reproduced as its pattern on real gloo (2 ranks on loopback, spawned),
the bug and its fix one step each, under `hazsan run` at `alloc` and at `full`.

  100/101  Megatron-LM#4047: the pipeline schedule sends a stage's output with isend (through
           batch_isend_irecv) and then calls `deallocate_output_tensor`, which swaps the tensor's
           storage (`out.data = torch.empty((1,))`) while the send is in flight: the storage gloo
           is sending from is freed (free-in-flight at both levels). The fix waits first.
  110/111  vllm#49274: `isend_tensor_dict` drops its send buffers (temporaries) before the sends
           complete. On gloo that is safe by construction: the Work keeps its tensors
           (ProcessGroupGloo's SendWork holds `tensor_` until it is destroyed), so the storage
           cannot die before the Work does: clean at both levels, and the fix too.
  120/121  vllm#54962: with async pipeline-parallel sends, the next forward writes the hidden
           states buffer in place while its isend is still in flight (unordered-access at full).
  130/131  TensorRT-LLM#10488: an in-place update of a slice of a tensor under its async send
           (unordered-access at full).
  140/141  pytorch#116122: FSDP reduce-scatters the output of a TP functional all-reduce nobody
           waited for; gloo's reduce-scatter copies its input inside the call, a read of a buffer
           the all-reduce is still writing (unordered-access at full: capture records that copy
           as a `launch` on `cpu`, docs/capture-details.md).
  150/151  pytorch#118197: pending all-gathers (functional, not waited) cloned before the wait
           (unordered-access at full).

`alloc` records no reads or writes, so only the free is seen there. Every fix step must be clean.
"""
from __future__ import annotations

import textwrap

import pytest

from gloo_programs import by_op_step, run_under_hazsan

pytest.importorskip("torch")

# these tests read the trace lines by hand: capture writes JSON Lines here (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("jsonl_capture")

PROGRAM = textwrap.dedent(r'''
    import json, sys, time
    import torch.multiprocessing as mp

    def deallocate_output_tensor(out):
        """Megatron-LM core/pipeline_parallel/schedules.py: the output's memory goes, its .grad_fn
        stays (only the pseudo-freed tensor is kept for the backward)."""
        out.data = torch.empty((1,), device=out.device, dtype=out.dtype)

    def worker(rank, ws, init, out):
        global torch
        import torch, torch.distributed as dist
        import sanitizer
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ws)
        group = dist.group.WORLD
        res = {}
        peer = 1 - rank

        # 100/101: Megatron-LM#4047
        for step, fixed in ((100, False), (101, True)):
            sanitizer.step(step)
            if rank == 0:
                output = torch.full((4096,), float(step))
                reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, output, peer)])
                if fixed:
                    for r in reqs:
                        r.wait()
                    deallocate_output_tensor(output)
                else:
                    deallocate_output_tensor(output)          # the send is still in flight
                    for r in reqs:
                        r.wait()
            else:
                recv = torch.empty(4096)
                for r in dist.batch_isend_irecv([dist.P2POp(dist.irecv, recv, peer)]):
                    r.wait()
                res[f"recv_{step}"] = float(recv[0])
            dist.barrier()

        # 110/111: vllm#49274, isend_tensor_dict's buffers dropped mid-send
        for step, fixed in ((110, False), (111, True)):
            sanitizer.step(step)
            tensors = {"hidden": torch.full((2048,), 3.0), "residual": torch.full((512,), 4.0)}
            if rank == 0:
                handles, kept = [], []
                for key, value in tensors.items():
                    buf = value.contiguous().clone()          # the send buffer, a temporary
                    handles.append(dist.isend(buf, peer))
                    if fixed:
                        kept.append(buf)
                    del buf                                   # dropped while the send runs
                del tensors
                for h in handles:
                    h.wait()
                del handles, kept
            else:
                got = {k: torch.empty_like(v) for k, v in tensors.items()}
                for v in got.values():
                    dist.recv(v, peer)
                res[f"dict_{step}"] = [float(v[0]) for v in got.values()]
            dist.barrier()

        # 120/121: vllm#54962, the next forward overwrites the buffer of an async PP send
        for step, fixed in ((120, False), (121, True)):
            sanitizer.step(step)
            hidden = torch.full((4096,), 1.0)
            if rank == 0:
                h = dist.isend(hidden, peer)
                if fixed:
                    h.wait()
                hidden.mul_(2.0)                              # the next forward, in place
                if not fixed:
                    h.wait()                              # (a gloo Work is waited once: a second blocks)
            else:
                dist.recv(hidden, peer)
                res[f"pp_{step}"] = float(hidden[0])
            dist.barrier()

        # 130/131: TensorRT-LLM#10488, in-place update under async send
        for step, fixed in ((130, False), (131, True)):
            sanitizer.step(step)
            kv = torch.zeros(64, 64)
            if rank == 0:
                w = dist.isend(kv, peer)
                if fixed:
                    w.wait()
                kv[:8].add_(1.0)                              # a slice updated in place
                if not fixed:
                    w.wait()
            else:
                dist.recv(kv, peer)
                res[f"kv_{step}"] = float(kv.sum())
            dist.barrier()

        # 140/141: pytorch#116122, FSDP reduce-scatters a pending TP functional all-reduce
        for step, fixed in ((140, False), (141, True)):
            sanitizer.step(step)
            grad = torch.full((1024,), float(rank + 1))
            reduced = torch.ops._c10d_functional.all_reduce(grad, "sum", group.group_name)
            if fixed:
                reduced = torch.ops._c10d_functional.wait_tensor(reduced)
            shard = torch.empty(1024 // ws)
            dist.reduce_scatter_tensor(shard, reduced)       # gloo copies `reduced` in the call
            if not fixed:
                torch.ops._c10d_functional.wait_tensor(reduced)
            res[f"shard_{step}"] = float(shard[0])
            del grad, reduced, shard

        # 150/151: pytorch#118197, pending all-gathers cloned before the wait
        for step, fixed in ((150, False), (151, True)):
            sanitizer.step(step)
            params = [torch.full((256,), float(rank + i)) for i in range(2)]
            gathered = [torch.ops._c10d_functional.all_gather_into_tensor(p, ws, group.group_name)
                        for p in params]
            if fixed:
                gathered = [torch.ops._c10d_functional.wait_tensor(g) for g in gathered]
            copies = [g.clone() for g in gathered]
            if not fixed:
                for g in gathered:
                    torch.ops._c10d_functional.wait_tensor(g)
            res[f"gathered_{step}"] = [float(c[0]) for c in copies]
            del params, gathered, copies

        sanitizer.step(190)
        dist.barrier()
        json.dump(res, open(f"{out}/res{rank}.json", "w"))
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(2, sys.argv[1], sys.argv[2]), nprocs=2)
''')

BUGS = {100: ("Megatron-LM#4047", "free-in-flight"), 120: ("vllm#54962", "unordered-access"),
        130: ("TensorRT-LLM#10488", "unordered-access"), 140: ("pytorch#116122", "unordered-access"),
        150: ("pytorch#118197", "unordered-access")}
CLEAN = (101, 110, 111, 121, 131, 141, 151)
ALLOC_SEES = (100,)      # alloc records no reads or writes: only the free


@pytest.fixture(scope="module", params=["full", "alloc", "alloc-native"])
def run(request, tmp_path_factory):
    return request.param, run_under_hazsan(tmp_path_factory.mktemp(request.param), request.param, PROGRAM)[:4]


def test_the_program_computed_what_it_should(run):
    _, (_, _, res, _) = run
    r0, r1 = res
    assert r1["recv_101"] == 101.0           # (recv_100 may be garbage: the bug frees what is sent)
    assert r1["dict_110"] == r1["dict_111"] == [3.0, 4.0]
    assert r1["pp_121"] == 1.0 and r1["kv_131"] == 0.0
    for r in (r0, r1):                      # the fixed steps' numbers; the bug steps may differ
        assert r["shard_141"] == 6.0              # (1 + 2) all-reduced, then summed again by the reduce-scatter
        assert r["gathered_151"] == [0.0, 1.0]


def test_each_bug_is_flagged_with_its_rule(run):
    level, (rc, report, _, _) = run
    found = by_op_step(report)
    for step, (name, rule) in BUGS.items():
        rules = {f["rule"] for f in found.get(step, [])}
        if level == "full" or step in ALLOC_SEES:
            assert rule in rules, (name, level, rules, report["summary"]["by_rule"])
            assert all(f["rank"] == 0 for f in found[step]) or step >= 140, (name, found[step][:2])
        else:
            assert not rules, (name, level, rules)
    # free-in-flight, the latent cause, is an error too (docs/hazard-model.md): at alloc, where only
    # it is seen, the run fails as at full
    assert rc == 1, (level, rc, report["summary"]["by_rule"])


def test_each_fix_is_clean_and_the_capture_complete(run):
    level, (_, report, _, _) = run
    found = by_op_step(report)
    for step in CLEAN:
        assert not found.get(step), (step, level, found.get(step)[:3])
    s = report["summary"]
    assert s["hook_errors"] == 0 and s["complete"], s


def test_the_flagged_sites_are_the_programs_lines(run):
    """Each finding names the program's own line (prog.py), never hazsan's or torch's."""
    _, (_, report, _, _) = run
    for f in report["findings"]:
        sites = [x for x in (f.get("site"), (f.get("block") or {}).get("site"), (f.get("op") or {}).get("site")) if x]
        assert sites and all(x.startswith("prog.py:") for x in sites), (f["rule"], sites)


def test_gloos_copied_input_is_a_host_read_at_full(run):
    """pytorch#116122's mechanism: the reduce-scatter's copy of its input is a `launch` on `cpu`
    reading the input (level full only), and the input is not among the collective's buffers."""
    level, (_, _, _, events) = run
    step, copies, rs = None, [], []
    for ev in events[0]:
        if ev["ev"] == "step":
            step = ev["n"]
        elif step in (140, 141) and ev["ev"] == "launch" and ev.get("op") == "backend input copy":
            copies.append(ev)
        elif step in (140, 141) and ev["ev"] == "coll" and "reduce_scatter" in ev["op"]:
            rs.append(ev)
    assert len(rs) == 2 and all([b["access"] for b in c["bufs"]] == ["w"] for c in rs), rs
    if level == "full":
        assert len(copies) == 2 and all(c["stream"] == "cpu" and c["reads"][0][1] == 4096 for c in copies)
    else:
        assert copies == []
