"""NCCL Works since PyTorch 2.8 (issue 29, item 10): collective_state.NcclWorkLifetimes, on CPU.

torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, ProcessGroupNCCL::collective:

    // in asyncOp=false [default] mode, we use currentStream as ncclStream
    auto ncclStream = asyncOp ? ncclStreams_.at(key) : at::cuda::getCurrentCUDAStream(...);
    if (asyncOp) { work->stashed_for_allocator_safety_->stash(inputs); ...stash(outputs); }

and its watchdog, for a Work never waited for: "In case user didn't call `work.wait()` with async
collectives, watchdog would unstage the stashed tensors when detecting completion" (the shelf is
handed to the main thread and unstashed at its next enqueue). The c10d ops carry `async_op` in
this torch (checked below on the real schema). No NCCL here: the recorder's bookkeeping is driven
with the arguments the dispatcher hands it, and the resulting trace is judged by the engine; the
real sequence runs in the GPU kit (C2, scenario never-waited).
"""
from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

torch = pytest.importorskip("torch")


def test_the_c10d_ops_carry_async_op():
    schema = torch.ops.c10d.allreduce_.default._schema
    assert "async_op" in [a.name for a in schema.arguments]


def _collectives():
    from sanitizer.capture.collectives import DispatchedCollectives
    from sanitizer.capture.streams import StreamIds

    events = []
    cids = iter(range(1, 100))
    cap = types.SimpleNamespace(emit=events.append, blocks=None, streams=StreamIds(),
                                next_cid=lambda: next(cids),
                                event=lambda ev, with_site=True: events.append(ev),
                                failed=lambda hook, exc: events.append({"ev": "hook_error", "hook": hook,
                                                                        "error": repr(exc)}))
    return DispatchedCollectives(cap), events


def _issue(colls, async_op, addr):
    """What DispatchedCollectives._c10d does for c10d::allreduce_ on an NCCL group."""
    group_stream = "nccl:0"
    stream = colls.nccl_works.stream(group_stream, {"async_op": async_op})
    cid = colls._record("c10d.allreduce_", "0", stream, [{"addr": addr, "size": 4096, "access": "rw"}])
    if stream != group_stream:
        colls.nccl_works.current.add(cid)
    return cid


def test_blocking_collective_runs_on_the_current_stream_and_needs_nothing_more():
    colls, events = _collectives()
    cid = _issue(colls, False, 0x1000)
    colls.done(cid, waited=True)              # Python's all_reduce waits on the Work it got
    assert [e["ev"] for e in events] == ["coll"]
    assert events[0]["stream"] == "cuda:0"    # the current stream (CUDA not initialised: device 0's)


def test_a_never_waited_work_completes_when_its_stash_lets_a_buffer_go():
    colls, events = _collectives()
    cid = _issue(colls, True, 0x1000)
    colls.nccl_works.released(0x9000, 512)    # another block: nothing
    assert [e["ev"] for e in events] == ["record", "wait", "coll"]
    colls.nccl_works.released(0x1000, 4096)   # the stashed buffer dies: the watchdog saw it done
    # the watchdog's look, not the program's wait: observed (done for the free, no edge; issue 54)
    assert events[-1] == {"ev": "coll_done", "cid": cid, "observed": True, "t": events[-1]["t"]}
    assert [e["ev"] for e in events] == ["record", "wait", "coll", "coll_done"]
    colls.nccl_works.released(0x1000, 4096)   # seen once is enough
    assert len(events) == 4
    # a late wait() of the program on the Work is still its synchronisation: the stream edge
    colls.done(cid, waited=True)
    assert [(e["ev"], e.get("event")) for e in events[4:]] == [("record", f"coll{cid}"), ("wait", f"coll{cid}")]
    assert cid not in colls.issued_cids and cid not in colls.observed_cids


def test_a_waited_work_is_a_stream_wait_and_its_later_free_adds_nothing():
    colls, events = _collectives()
    cid = _issue(colls, True, 0x1000)
    colls.done(cid, waited=True)
    colls.nccl_works.released(0x1000, 4096)
    assert [e["ev"] for e in events] == ["record", "wait", "coll", "record", "wait"]
    assert not colls.nccl_works.ranges


@pytest.mark.parametrize("released", [True, False])
def test_engine_verdict_on_the_never_waited_trace(tmp_path, released):
    """The trace capture writes for an async all-reduce never waited for, whose buffer the
    program dropped: clean with the watchdog's completion, free-in-flight without it."""
    colls, events = _collectives()
    alloc = {"ev": "alloc", "id": 1, "addr": 0x1000, "size": 4096, "stream": "cuda:0", "pool": "default"}
    cid = _issue(colls, True, 0x1000)
    if released:
        colls.nccl_works.released(0x1000, 4096)
    lines = [{"hazsan": 1, "rank": 0}, alloc] + events + [{"ev": "free", "id": 1}, {"ev": "end"}]
    for ev in lines:
        ev.pop("t", None)
    (tmp_path / "rank0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    out = subprocess.run([sys.executable, "-m", "sanitizer", "check", str(tmp_path), "--format", "json"],
                         capture_output=True, text=True, timeout=60)
    rules = {f["rule"] for f in json.loads(out.stdout)["findings"]}
    assert rules == (set() if released else {"free-in-flight"}), (cid, out.stdout[-2000:])


def test_async_op_left_out_at_its_default_is_bound_from_the_schema():
    """A dispatch mode is handed c10d::allreduce_ without its trailing arguments equal to their
    defaults: async_op=True (the default) arrives as 4 arguments, async_op=False as 5. The H200 run
    of the GPU kit (C2 never-waited) showed the consequence: no Work was taken for async and its
    stash was never tracked. Driven here through torch's real dispatcher on a 1-rank gloo group."""
    import os
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode
    from sanitizer.capture.collective_ops import bind

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.c10d.allreduce_.default:
                seen.append((func, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        x = torch.ones(4)
        with Record():
            dist.all_reduce(x, async_op=True).wait()
            dist.all_reduce(x)
    finally:
        dist.destroy_process_group()
    (f1, a1, k1), (f2, a2, k2) = seen
    assert len(a1) < len(a2)                      # the default was left out
    assert bind(f1, a1, k1)["async_op"] is True
    assert bind(f2, a2, k2)["async_op"] is False
    assert bind(f1, a1, k1)["timeout"] == -1


class _Handle:
    """Stands for the Future of a Work (weak-referenceable, known by identity as capture knows it)."""


def test_an_nccl_future_done_at_enqueue_is_no_completion():
    """ProcessGroupNCCL.cpp, collective(): `work->future_->markCompleted(at::IValue(*work->outputs_))`
    right after the enqueue: done() is True at once for a CUDA Future whose completion is events on
    the NCCL stream. It must not become a coll_done; its wait() is the usual stream edge."""
    colls, events = _collectives()
    cid = _issue(colls, True, 0x1000)
    fut = _Handle()
    colls._remember(fut, cid)
    colls.observed(fut, waited=False, future_done=True)
    assert not [e for e in events if e["ev"] == "coll_done"]
    colls.observed(fut)                                   # Future.wait()
    assert [e["ev"] for e in events[-2:]] == ["record", "wait"]
    assert events[-2]["event"] == f"coll{cid}" and events[-2]["stream"] == "nccl:0"
    assert not [e for e in events if e["ev"] == "coll_done"]


def test_a_host_backend_future_done_is_a_completion():
    colls, events = _collectives()
    cid = colls._record("c10d.allreduce_", "0", "gloo:0", [{"addr": 0x1000, "size": 64, "access": "rw"}])
    fut = _Handle()
    colls._remember(fut, cid)
    colls.observed(fut, waited=False, future_done=True)
    assert [e["cid"] for e in events if e["ev"] == "coll_done"] == [cid]
