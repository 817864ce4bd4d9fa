"""Capture on distributed programs nobody here wrote: torch's own entry points, under torchrun.

One 2-rank gloo program (started by torchrun, as users start theirs) runs, in order: the public
API's identities and `dist.P2POp` with `batch_isend_irecv`; `torch.compile(fullgraph=True)` on
plain code and on a graph with a functional collective; a DDP loop (the C++ reducer issues the
all-reduces); an FSDP2 `fully_shard` loop and a `torch.distributed.checkpoint` save; a
`torch.distributed.pipelining` GPipe step (send/recv through P2POp); a tensor-parallel forward
(DTensor, functional collectives); a raw functional all-reduce read before its `wait_tensor` (the
one planted hazard); a collective op registered through the custom-op table, and an op whose
kernel issues its collective itself (as vLLM's `vllm::all_reduce` does on GPUs). It runs bare, at
`alloc` and at `full`.

What must hold: the program's results are bitwise identical in the three runs; every collective
of each caller is recorded once, with signatures equal on both ranks; the only finding is the
planted read-before-wait, at `full`.
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import textwrap

import pytest

# these tests read the trace lines by hand: capture writes JSON Lines here (tests/conftest.py)
# `long` (make test-long; .ci/run runs it after make test): nine real distributed programs (DDP, FSDP, compiled, pipeline), bare and captured: about 50 s
pytestmark = [pytest.mark.long, pytest.mark.usefixtures("jsonl_capture")]

pytest.importorskip("torch")

PROGRAM = textwrap.dedent(r'''
    import json, os, sys
    import torch, torch.nn as nn, torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    import torch.distributed._functional_collectives as fc
    import sanitizer

    dist.init_process_group("gloo")
    r, ws = dist.get_rank(), dist.get_world_size()
    res = {}

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def batch(step):
        torch.manual_seed(100 + 2 * step + r)
        return torch.randn(8, 16)

    # 1. the public API is the stock one
    res["identity"] = [dist.isend is c10d.isend, dist.irecv is c10d.irecv,
                       dist.all_reduce is c10d.all_reduce,
                       dist.init_process_group is c10d.init_process_group,
                       dist.all_reduce.__module__ == "torch.distributed.distributed_c10d"]
    sanitizer.step(1, phase="p2p")
    send, recv = torch.full((4,), float(r + 1)), torch.empty(4)
    ops = [dist.P2POp(dist.isend, send, 1 - r), dist.P2POp(dist.irecv, recv, 1 - r)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    res["p2p"] = recv.tolist()

    # 2. torch.compile, fullgraph, with a collective in the graph
    sanitizer.step(2, phase="compile")
    @torch.compile(fullgraph=True)
    def affine(x):
        return x * 2 + 1
    @torch.compile(fullgraph=True)
    def reduced(x):
        return fc.all_reduce(x * 2, "sum", dist.group.WORLD) + 1
    res["compile"] = affine(torch.arange(4.0)).tolist()
    res["compile_coll"] = reduced(torch.arange(4.0) + r).tolist()

    # 3. DDP: the reducer's all-reduces come from C++
    sanitizer.step(3, phase="ddp")
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model(), bucket_cap_mb=0.0005)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        loss = ddp(batch(step)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    res["ddp"] = [p.detach().flatten().tolist() for p in ddp.parameters()]

    # 4. FSDP2 and a distributed checkpoint
    sanitizer.step(4, phase="fsdp")
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (ws,))
    fs = model()
    for layer in fs:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(fs, mesh=mesh)
    opt = torch.optim.SGD(fs.parameters(), lr=0.1)
    for step in range(3):
        loss = fs(batch(step)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    res["fsdp"] = [p.full_tensor().flatten().tolist() for p in fs.parameters()]
    import torch.distributed.checkpoint as dcp
    dcp.save({"model": fs.state_dict()}, checkpoint_id=os.path.join(sys.argv[1], "ckpt"))

    # 5. pipelining: send/recv between stages through P2POp
    sanitizer.step(5, phase="pipe")
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    full = model()
    part = full[:2] if r == 0 else full[2:]
    stage = PipelineStage(part, r, ws, torch.device("cpu"))
    sched = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda o, t: (o - t).pow(2).mean())
    torch.manual_seed(5)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    if r == 0:
        sched.step(x)
    else:
        losses = []
        sched.step(target=y, losses=losses)
        res["pipe_loss"] = [l.item() for l in losses]
    res["pipe_grad"] = [p.grad.flatten().tolist() for p in part.parameters()]

    # 6. tensor parallel: DTensor's functional collectives
    sanitizer.step(6, phase="tp")
    from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel
    tp = model()
    parallelize_module(tp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    torch.manual_seed(7)
    with torch.no_grad():
        res["tp"] = tp(torch.randn(4, 16)).flatten().tolist()

    # 7. the planted hazard: a functional all-reduce's result read before wait_tensor
    sanitizer.step(7, phase="hazard")
    group = dist.group.WORLD.group_name
    out = torch.ops._c10d_functional.all_reduce(torch.ones(8), "sum", group)
    early = out.sum()                                  # read before the wait
    torch.ops._c10d_functional.wait_tensor(out)
    res["waited"] = out.tolist()
    ok = torch.ops._c10d_functional.all_reduce(torch.ones(8), "sum", group)
    torch.ops._c10d_functional.wait_tensor(ok)
    res["ok"] = (ok * 2).tolist()

    # 8. a collective op registered through the custom-op table (its kernel all-reduces)
    sanitizer.step(8, phase="custom")
    lib = torch.library.Library("hazsan_test", "DEF")
    lib.define("ring_allreduce(int handle, Tensor(a!) data) -> ()")
    def ring_allreduce(handle, data):
        dist.all_reduce(data)
    lib.impl("ring_allreduce", ring_allreduce, "CPU")
    try:
        from sanitizer.capture import collectives
        collectives.register_collective_op("hazsan_test::ring_allreduce", kind="ring", comm="handle")
    except ImportError:            # capture off: the plain program
        pass
    data = torch.full((6,), float(r + 1))
    torch.ops.hazsan_test.ring_allreduce(0, data)
    res["custom"] = data.tolist()

    # 9. an op whose kernel issues the collective itself (vLLM's vllm::all_reduce on GPUs)
    sanitizer.step(9, phase="wrapping")
    lib.define("wrapped_all_reduce(Tensor t) -> Tensor")
    def wrapped_all_reduce(t):
        out = t.clone()
        dist.all_reduce(out)
        return out
    lib.impl("wrapped_all_reduce", wrapped_all_reduce, "CPU")
    try:
        collectives.register_wrapping_op("hazsan_test::wrapped_all_reduce")
    except NameError:              # capture off
        pass
    res["wrapped"] = torch.ops.hazsan_test.wrapped_all_reduce(torch.full((3,), float(r + 2))).tolist()

    sanitizer.step(10, phase="end")
    with open(os.path.join(sys.argv[1], f"result{r}.json"), "w") as fh:
        json.dump(res, fh)
    dist.destroy_process_group()
''')


def _run(d, mode):
    out_dir = d / mode
    out_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN")}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(d / "inductor")       # shared: later runs compile from cache
    env["OMP_NUM_THREADS"] = "1"
    if mode != "bare":
        # alloc-native: level alloc recorded by the native recorder; the others by the dispatch mode
        env.update(HAZSAN="1", HAZSAN_LEVEL=mode.split("-")[0], HAZSAN_DIR=str(out_dir / "traces"),
                   HAZSAN_TRACE_FORMAT="jsonl", HAZSAN_NATIVE="1" if mode == "alloc-native" else "0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(d / "prog.py"), str(out_dir)]
    p = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-4000:]
    return [json.loads((out_dir / f"result{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("real")
    (d / "prog.py").write_text(PROGRAM)
    from gloo_programs import require_native
    try:
        require_native()
        modes = ("bare", "alloc", "full", "alloc-native")
    except pytest.skip.Exception:          # (said by the native tests' own skips)
        modes = ("bare", "alloc", "full")
    return d, {mode: _run(d, mode) for mode in modes}


def _captured(res):
    return [m for m in ("alloc", "full", "alloc-native") if m in res]


def _events(d, mode, rank):
    with open(d / mode / "traces" / f"rank{rank}.jsonl") as f:
        return [json.loads(line) for line in f][1:]


def _steps(events):
    step, out = None, collections.defaultdict(list)
    for e in events:
        if e["ev"] == "step":
            step = e["n"]
        out[step].append(e)
    return out


def test_results_bitwise_identical_bare_and_captured(runs):
    _, res = runs
    assert res["bare"][0]["identity"] == [True] * 5
    assert res["bare"][0]["p2p"] == [2.0] * 4 and res["bare"][1]["p2p"] == [1.0] * 4
    for mode in _captured(res):
        assert res[mode] == res["bare"], mode


@pytest.mark.parametrize("mode", ["alloc", "full", "alloc-native"])
def test_every_callers_collectives_recorded_once_and_matched(runs, mode):
    d, res = runs
    if mode not in res:
        pytest.skip("the native recorder is not usable here")
    per_rank = []
    for rank in range(2):
        steps = _steps(_events(d, mode, rank))
        per_rank.append({n: [e for e in evs if e["ev"] == "coll"] for n, evs in steps.items()})
    ops = {n: collections.Counter(c["op"] for c in colls) for n, colls in per_rank[0].items()}
    assert ops[1] == {"c10d.send": 1, "c10d.recv_": 1}                     # P2POp, once each
    assert ops[2] == {"_c10d_functional.all_reduce_": 1}                   # in the compiled graph
    assert ops[3]["c10d.allreduce_"] >= 3                                  # DDP's C++ reducer
    assert ops[4]["c10d._allgather_base_"] >= 3 and ops[4]["c10d._reduce_scatter_base_"] >= 3
    assert ops[5]["c10d.send"] + ops[5]["c10d.recv_"] >= 2                 # pipeline stages
    assert sum(v for k, v in ops[6].items() if k.startswith("_c10d_functional.")) >= 1   # DTensor
    assert ops[7] == {"_c10d_functional.all_reduce": 2}
    assert ops[8] == {"hazsan_test.ring_allreduce": 1}                      # once, not twice
    assert ops[9] == {"c10d.allreduce_": 1}                                 # seen inside the wrapping op
    # equal signatures on both ranks: the same (comm, seq) name the same op on each side
    for n in per_rank[0]:
        sig = [{(c["comm"], c["seq"]): c["op"] for c in pr.get(n, []) if ":p2p:" not in c["comm"]}
               for pr in per_rank]
        assert sig[0] == sig[1], n


@pytest.mark.parametrize("mode", ["alloc", "full", "alloc-native"])
def test_completion_seen_for_cpp_and_python_owned_work(runs, mode):
    d, res = runs
    if mode not in res:
        pytest.skip("the native recorder is not usable here")
    for rank in range(2):
        events = _events(d, mode, rank)
        issued = {e["cid"]: e for e in events if e["ev"] == "coll"}
        done = {e["cid"] for e in events if e["ev"] == "coll_done"}
        steps = _steps(events)
        for n in (1, 2, 3, 4, 5, 7, 8, 9):
            cids = [e["cid"] for e in steps[n] if e["ev"] == "coll"]
            assert cids, f"step {n} issued no collective: nothing to see completed"
            assert set(cids) <= done, (n, [issued[c]["op"] for c in set(cids) - done])


def test_compiled_graph_recorded_when_it_runs(runs):
    d, _ = runs
    events = _steps(_events(d, "full", 0))[2]
    allocs = [e for e in events if e["ev"] == "alloc" and e["op"].startswith("inductor.")]
    assert allocs, "Inductor's buffers are recorded as they are allocated, not adopted later"
    coll = [e for e in events if e["ev"] == "coll"][0]
    assert coll["site"].startswith("prog.py:") and coll["bufs"][0]["addr"] in {a["addr"] for a in allocs}


def test_only_the_planted_read_before_wait_is_found(runs):
    from sanitizer.rules.driver import analyze
    d, res = runs
    for mode in _captured(res):
        a = analyze([d / mode / "traces"])
        assert not a.errors, a.errors
        assert a.summary["hook_errors"] == 0 and a.summary["dropped_events"] == 0, a.summary
        found = collections.Counter((f.rule, f.step) for f in a.findings)
        if mode != "full":
            assert not found, (mode, found)
        else:
            # both ranks read the result of step 7's first all-reduce before waiting for it
            assert set(found) == {("unordered-access", 7)} and sum(found.values()) >= 2, found
