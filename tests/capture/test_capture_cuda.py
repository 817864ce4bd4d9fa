"""CUDA ordering capture (sanitizer/capture/cuda_hooks.py) and launches (HAZSAN_LEVEL=full), on CPU.

A real HAZSAN=1 interpreter runs one program through torch's own entry points:
  * events, waits and synchronisations: torch.cuda._gpu_trace's registries fired with the handles
    c10 would pass (a CPU build has no CUDA runtime to fire them);
  * record_stream: the real Tensor.record_stream, with a torch.Stream that carries a recorded
    cudaStream_t, and a CPU kernel registered for aten::record_stream through torch.library
    (CUDA is the only backend that has one);
  * graphs: the real torch.cuda.CUDAGraph methods, on a subclass whose base stands in for the C++
    binding torch._C._CUDAGraph (absent from a CPU build) and does nothing.
The traces are then checked by the engine (`hazsan check`).
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

PROGRAM = textwrap.dedent(r'''
    import gc, json
    import torch
    import sanitizer
    from torch.cuda import _gpu_trace as gt

    S1, S2, E1, E2 = 0x7F0001, 0x7F0002, 0xE0001, 0xE0002

    class RecordedStream(torch.Stream):
        """A torch.Stream carrying a recorded cudaStream_t (what torch.cuda.Stream exposes)."""
        cuda_stream = S1

    class GraphBinding:
        """Stands in for torch._C._CUDAGraph (C++; absent on a CPU build)."""
        def capture_begin(self, pool=None, capture_error_mode="global"):
            pass
        def capture_end(self):
            pass
        def replay(self):
            pass
        def reset(self):
            pass

    class Graph(torch.cuda.CUDAGraph, GraphBinding):
        def __new__(cls, keep_graph=False):   # CUDAGraph.__new__ without its C++ base
            g = object.__new__(cls)
            g._tracker = None
            return g
        def __init__(self, *a, **k):
            pass

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("record_stream", lambda self, s: None, "CPU")

    sanitizer.step(1)                       # event record / wait, the three synchronisations
    gt.EventRecordCallbacks.fire_callbacks(E1, S1)
    gt.EventWaitCallbacks.fire_callbacks(E1, S2)
    gt.StreamSynchronizationCallbacks.fire_callbacks(S2)
    gt.EventSynchronizationCallbacks.fire_callbacks(E1)
    gt.DeviceSynchronizationCallbacks.fire_callbacks()
    gt.EventWaitCallbacks.fire_callbacks(E2, 0)   # the default stream
    sanitizer.step(2)                       # record_stream, then the free, then the stream is synced
    x = torch.ones(100)
    x.record_stream(RecordedStream(stream_id=35, device_index=0, device_type=1))
    del x
    gt.StreamSynchronizationCallbacks.fire_callbacks(S2)     # another stream: not yet
    sanitizer.step(3)
    gt.StreamSynchronizationCallbacks.fire_callbacks(S1)     # now
    sanitizer.step(4)                       # an event recorded before the free does not cover it
    y = torch.ones(50)
    y.record_stream(RecordedStream(stream_id=35, device_index=0, device_type=1))
    gt.EventRecordCallbacks.fire_callbacks(E2, S1)
    del y
    gt.EventSynchronizationCallbacks.fire_callbacks(E2)
    sanitizer.step(5)
    gt.EventRecordCallbacks.fire_callbacks(E2, S1)
    gt.EventSynchronizationCallbacks.fire_callbacks(E2)      # recorded after the free: covers it
    sanitizer.step(6)                       # a graph: capture, replay, reset
    g = Graph()
    g.capture_begin()
    g.capture_end()
    g.replay()
    g.replay()
    g.reset()
    sanitizer.step(7)                       # a graph object dropped without reset
    h = Graph()
    h.capture_begin(pool=(0, 7))
    h.capture_end()
    del h
    gc.collect()
    sanitizer.step(8)                       # ops: launches at level full only
    a = torch.ones(16)
    b = a + 1
    a.add_(b)
    v = a[2:6]
    c = torch.empty(4)
    torch.mul(v, 2.0, out=c)
    sanitizer.step(9)
    print(json.dumps({"a": a.data_ptr(), "b": b.data_ptr(), "c": c.data_ptr(), "v": v.data_ptr()}))
''')


def _run(tmp_path, level):
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=str(tmp_path / "traces"), HAZSAN_LEVEL=level)
    for k in ("RANK", "LOCAL_RANK"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, str(prog)], env=env, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    ptr = json.loads(out.stdout.strip().splitlines()[-1])
    (path,) = list((tmp_path / "traces").iterdir())
    events = [json.loads(line) for line in path.read_bytes().splitlines()[1:]]
    steps, cur = {}, None
    for ev in events:
        if ev["ev"] == "step":
            cur = ev["n"]
            steps[cur] = []
        elif cur is not None and ev["ev"] not in ("dropped",):
            steps[cur].append(ev)
    return path, events, steps, ptr


def _bare(evs, *kinds):
    drop = ("t", "site", "stack")
    return [{k: v for k, v in e.items() if k not in drop} for e in evs if e["ev"] in kinds]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("full"), "full")


@pytest.fixture(scope="module")
def alloc(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("alloc"), "alloc")


def test_no_hook_failed(full, alloc):
    for _, events, _, _ in (full, alloc):
        assert [e for e in events if e["ev"] == "hook_error"] == []


def test_events_waits_and_syncs_from_gpu_trace(full):
    _, _, steps, _ = full
    assert _bare(steps[1], "record", "wait", "sync") == [
        {"ev": "record", "event": "ee0001", "stream": "cuda:0:s1"},
        {"ev": "wait", "event": "ee0001", "stream": "cuda:0:s2"},
        {"ev": "sync", "stream": "cuda:0:s2"},
        {"ev": "sync", "event": "ee0001"},
        {"ev": "sync"},
        {"ev": "wait", "event": "ee0002", "stream": "cuda:0"},
    ]


def test_record_stream_defers_free_done_until_that_stream_is_seen_done(full):
    _, _, steps, _ = full
    rs = _bare(steps[2], "alloc", "record_stream", "free", "free_done", "sync")
    bid = rs[0]["id"]
    assert [e["ev"] for e in rs] == ["alloc", "record_stream", "free", "sync"]
    assert rs[1] == {"ev": "record_stream", "id": bid, "stream": "cuda:0:s1"}
    assert _bare(steps[3], "sync", "free_done") == [{"ev": "sync", "stream": "cuda:0:s1"},
                                                   {"ev": "free_done", "id": bid}]


def test_event_recorded_before_the_free_does_not_release_it(full):
    _, _, steps, _ = full
    assert "free_done" not in [e["ev"] for e in steps[4]]
    done = _bare(steps[5], "free_done")
    assert len(done) == 1 and done[0]["id"] == _bare(steps[4], "alloc")[0]["id"]


def test_graph_capture_replay_reset_and_death(full):
    _, _, steps, _ = full
    assert _bare(steps[6], "graph_begin", "graph_end", "graph_replay", "graph_free") == [
        {"ev": "graph_begin", "graph": "g1", "stream": "cuda:0", "pool": "graph:g1"},
        {"ev": "graph_end", "graph": "g1", "stream": "cuda:0"},
        {"ev": "graph_replay", "graph": "g1", "stream": "cuda:0"},
        {"ev": "graph_replay", "graph": "g1", "stream": "cuda:0"},
        {"ev": "graph_free", "graph": "g1"},
    ]
    assert _bare(steps[7], "graph_begin", "graph_end", "graph_free") == [
        {"ev": "graph_begin", "graph": "g2", "stream": "cuda:0", "pool": "graph-pool:(0, 7)"},
        {"ev": "graph_end", "graph": "g2", "stream": "cuda:0"},
        {"ev": "graph_free", "graph": "g2"},
    ]


def test_launches_follow_the_schema(full):
    _, _, steps, ptr = full
    launches = _bare(steps[8], "launch")
    a, b, c, v = ptr["a"], ptr["b"], ptr["c"], ptr["v"]
    assert launches == [
        {"ev": "launch", "stream": "cpu", "op": "aten.ones.default", "writes": [[a, 64]]},
        {"ev": "launch", "stream": "cpu", "op": "aten.add.Tensor", "reads": [[a, 64]], "writes": [[b, 64]]},
        {"ev": "launch", "stream": "cpu", "op": "aten.add_.Tensor", "reads": [[b, 64]], "writes": [[a, 64]]},
        # the slice is a view (no launch), empty allocates without a kernel (no launch)
        {"ev": "launch", "stream": "cpu", "op": "aten.mul.out", "reads": [[v, 16]], "writes": [[c, 16]]},
    ]
    assert v == a + 8


def test_alloc_level_records_no_launch_but_everything_else(full, alloc):
    _, events, _, _ = alloc
    assert not [e for e in events if e["ev"] == "launch"]
    # full adds launches, and a sync of the cpu stream before device work that follows CPU ops
    extra = lambda e: e["ev"] == "launch" or e == {**e, "ev": "sync", "stream": "cpu"}   # noqa: E731
    kinds = lambda evs: [e["ev"] for e in evs if not extra(e)]   # noqa: E731
    assert kinds(events) == kinds(full[1])
    assert any(e["ev"] == "sync" and e.get("stream") == "cpu" for e in full[1])


@pytest.mark.parametrize("which", ["full", "alloc"])
def test_engine_accepts_the_trace(which, full, alloc):
    path = (full if which == "full" else alloc)[0]
    out = subprocess.run([sys.executable, "-m", "sanitizer", "check", str(path), "--format", "json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout)["summary"]
    assert summary["by_rule"] == {} or not any(summary["by_rule"].values())


def test_level_setting():
    from sanitizer.capture.config import Settings
    # full by default: the level that sees an access racing an asynchronous collective
    assert Settings.from_env({}) == (Settings(level="full"), [])
    assert Settings.from_env({"HAZSAN_LEVEL": " ALLOC "})[0].level == "alloc"
    settings, problems = Settings.from_env({"HAZSAN_LEVEL": "kernels"})
    assert settings.level == "full" and problems == ["HAZSAN_LEVEL='kernels' is not one of alloc|full; using 'full'"]


def test_an_allocation_over_a_held_block_writes_its_free_done_first():
    """c10/cuda/CUDACachingAllocator.cpp: DeviceCachingAllocator::malloc runs process_events()
    before its search; that returns to the pool the record_stream'd blocks whose free events are
    done, and a block still waiting is never handed out. So an allocation overlapping a held
    block proves that block's free_done, with no host synchronize in the program (an idle side
    stream). Driven on cuda_hooks' own record_stream bookkeeping; the dispatch mode's call for a
    real CUDA allocation runs in the GPU kit (C2, record-stream-recycled)."""
    import types

    from sanitizer.capture.cuda_hooks import CudaOrdering
    from sanitizer.capture.streams import StreamIds

    events = []
    cap = types.SimpleNamespace(streams=StreamIds(), event=lambda ev, with_site=True: events.append(ev),
                                failed=lambda hook, exc: events.append({"ev": "hook_error", "hook": hook}))
    hooks = CudaOrdering(cap)
    held = types.SimpleNamespace(id=7, recorded={"cuda:0:s1"}, real=0x10000, nbytes=4096)
    other = types.SimpleNamespace(id=8, recorded={"cuda:0:s1"}, real=0x40000, nbytes=4096)
    hooks.on_free(held)
    hooks.on_free(other)
    hooks.reused(0x20000, 512)                   # elsewhere: nothing proven
    assert events == []
    hooks.reused(0x10000 + 1024, 8192)           # over block 7's bytes
    assert events == [{"ev": "free_done", "id": 7}]
    hooks.on_stream_sync(0x7F01)                 # some stream synced: 7 is not written twice
    hooks.on_device_sync()
    assert [e for e in events if e["ev"] == "free_done"] == [{"ev": "free_done", "id": 7},
                                                            {"ev": "free_done", "id": 8}]


def test_device_sync_covers_the_current_device_only():
    """c10/cuda/CUDAFunctions.cpp device_synchronize(): the trace callback carries no device, then
    cudaDeviceSynchronize() waits for the *current* device (torch.cuda.synchronize(d) makes d
    current first). With streams on two devices, a sync names the current device's streams."""
    import types

    from sanitizer.capture.cuda_hooks import CudaOrdering
    from sanitizer.capture.streams import StreamIds

    events = []
    cap = types.SimpleNamespace(streams=StreamIds(), event=lambda ev, with_site=True: events.append(ev),
                                failed=lambda hook, exc: events.append({"ev": "hook_error", "error": repr(exc)}))
    hooks = CudaOrdering(cap)
    side0 = cap.streams.of_handle(0x7F10, 0)
    hooks.on_device_sync()                       # one device so far: a bare sync
    assert events == [{"ev": "sync"}]
    side1 = cap.streams.of_handle(0x7F20, 1)
    assert (side0, side1) == ("cuda:0:s1", "cuda:1:s1")
    for bid, stream in ((1, side0), (2, side1)):
        hooks.on_free(types.SimpleNamespace(id=bid, recorded={stream}, real=bid << 20, nbytes=64))
    events.clear()
    hooks.on_device_sync()                       # CUDA not initialised here: device 0 is current
    assert events == [{"ev": "sync", "stream": "cuda:0"}, {"ev": "sync", "stream": "cuda:0:s1"},
                      {"ev": "free_done", "id": 1}]
