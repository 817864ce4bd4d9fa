"""transient-in-window flags a window transient only when a collective could write it (issue 50,
item 4; docs/hazard-model.md, "When a window transient is a hazard").

The case that must be clean is SGLang 0.5.23's `--enable-symm-mem` pre-allocation, as its source
shows it:
  * sglang/srt/arg_groups/memory_hook.py: with `enable_symm_mem` and no
    SGLANG_SYMM_MEM_PREALLOC_GB_SIZE set, the size is set to 4 (GiB);
  * sglang/srt/model_executor/model_runner_components/cuda_graph_setup.py,
    `finalize_cuda_graph_capture`: after the last graph capture it calls
    `prealloc_symmetric_memory_pool(...)`;
  * sglang/srt/distributed/device_communicators/pynccl_allocator.py, `prealloc_symmetric_memory_pool`:
    `with use_symmetric_memory(get_tp_group()): torch.empty((4 GiB,), dtype=torch.uint8)`, the
    tensor dropped at once; `SymmetricMemoryContext.__exit__` registers the pool's new segment as a
    window (capture writes that segment's `window` before the allocation that lands in it:
    sanitizer/capture/sglang_hooks.py);
  * before it, the decode capture: FullCudaGraphBackend.capture_one (runner_backend/
    full_cuda_graph_backend.py) runs two warm-up forwards, each after `synchronize()`, then
    `torch.cuda.graph(...)`, whose `__enter__` calls `torch.cuda.synchronize()` (torch/cuda/graphs.py);
    pynccl's all-reduces have no work handle, so only those synchronisations complete them.
Every case runs in both builds of the engine.
"""
from __future__ import annotations

import pytest

from sanitizer.rules.driver import analyze, compiled_available
from tracebuilder import Trace

ENGINES = ["interpreted", "compiled"] if compiled_available()[0] else ["interpreted"]

GIB = 1 << 30
MB = 1 << 20
FWD = "cuda:0"
CAP = "cuda:0:s1"
COMM = "pynccl:tp"
WIN = 0x7E00_0000_0000           # the pool's first segment, a window since start-up
PREALLOC = 0x7D00_0000_0000      # the 4 GiB segment the pre-allocation makes
HEAP = 0x7F00_0000_0000


def run(tmp_path, traces, engine, **kw):
    paths = [t.write(tmp_path / f"rank{t.header['rank']}-{engine}.jsonl") for t in traces]
    a = analyze(paths, engine=engine, max_per_group=0, **kw)
    assert not a.errors, a.errors
    return a


def warmup_and_capture(t: Trace, seq: int) -> int:
    """capture_one for one shape: two eager warm-ups, each after synchronize(), whose all-reduce
    output is allocated in the window (use_symmetric_memory) and dropped at the forward's end;
    then torch.cuda.graph: synchronize(), the captured forward, capture_end."""
    for w in range(2):
        t.ev("sync")
        t.ev("scope", name="symm", enter=True, pool="symm", comm=COMM)
        t.alloc(f"warm{seq}-{w}", WIN, MB, stream=FWD, pool="symm", site="deepseek_v4.py:3499:hc_pre")
        t.ev("scope", name="symm", enter=False, pool="symm", comm=COMM)
        t.coll(f"warm{seq}-{w}", stream=FWD, comm=COMM, seq=seq + w, bufs=[(WIN, MB, "rw")])
        t.free(f"warm{seq}-{w}")              # the forward's output dropped; nothing waited on it
    t.ev("sync")                                # torch.cuda.graph.__enter__
    gid = f"g{seq}"
    t.ev("graph_begin", graph=gid, stream=CAP, pool="graph-pool:(0, 1)")
    t.ev("scope", name="symm", enter=True, pool="symm", comm=COMM)
    t.alloc(f"{gid}-y", WIN + 2 * MB, MB, stream=CAP, pool="symm", site="deepseek_v4.py:3499:hc_pre")
    t.ev("scope", name="symm", enter=False, pool="symm", comm=COMM)
    t.coll(f"{gid}-ar", stream=CAP, comm=COMM, seq=seq + 2, bufs=[(WIN + 2 * MB, MB, "rw")])
    t.ev("graph_end", graph=gid, stream=CAP)
    return seq + 3


def prealloc(t: Trace) -> int:
    """prealloc_symmetric_memory_pool: the 4 GiB tensor lands in a new pool segment, registered as
    a window of the communicator, and dies inside the scope."""
    t.ev("scope", name="symm", enter=True, pool="symm", comm=COMM)
    t.ev("segment", addr=PREALLOC, size=4 * GIB, pool="symm")
    t.ev("window", addr=PREALLOC, size=4 * GIB, comm=COMM)
    t.alloc("prealloc", PREALLOC, 4 * GIB, stream=FWD, pool="symm",
            site="pynccl_allocator.py:533:prealloc_symmetric_memory_pool")
    line = t.free("prealloc")
    t.ev("scope", name="symm", enter=False, pool="symm", comm=COMM)
    return line


def server_start(rank: int, world: int) -> Trace:
    t = Trace(rank=rank, world_size=world)
    t.ev("window", addr=WIN, size=64 * MB, comm=COMM)
    seq = 0
    for _bs in (8, 4):                          # reversed(capture_bs)
        seq = warmup_and_capture(t, seq)
    return t


@pytest.mark.parametrize("engine", ENGINES)
def test_symm_mem_prealloc_after_capture_is_not_a_finding(tmp_path, engine):
    """Identical on both ranks, after the capture's synchronize() and before any collective; then
    the decode steps replay the graphs (their collectives run after the block is gone)."""
    traces = []
    for rank in range(2):
        t = server_start(rank, 2)
        prealloc(t)
        for n, gid in enumerate(("g0", "g3", "g0"), 1):
            t.ev("step", n=n, phase="decode", tokens=8)
            t.ev("graph_replay", graph=gid, stream=FWD)
            t.ev("sync")
        traces.append(t)
    a = run(tmp_path, traces, engine)
    assert a.findings == [] and a.exit_code() == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_the_same_block_with_a_collective_in_flight_at_its_alloc_is_flagged(tmp_path, engine):
    """Had an all-reduce still been running (issued, not synchronised), peers could be writing
    the window: the same 4 GiB block is a transient-in-window."""
    t = server_start(0, 1)
    t.ev("step", n=1, phase="decode", tokens=8)
    t.ev("graph_replay", graph="g0", stream=FWD)  # its all-reduce is in flight: no sync yet
    line = prealloc(t)
    a = run(tmp_path, [t], engine)
    assert [(f.rule, f.line, f.step, f.count) for f in a.findings] == [("transient-in-window", line, 1, 1)]
    assert a.exit_code() == 1


@pytest.mark.parametrize("engine", ENGINES)
def test_a_collective_issued_while_the_block_lives_exposes_it(tmp_path, engine):
    """Nothing in flight at the alloc, but an all-reduce issued before the free: flagged."""
    t = server_start(0, 1)
    t.ev("scope", name="symm", enter=True, pool="symm", comm=COMM)
    t.ev("window", addr=PREALLOC, size=4 * GIB, comm=COMM)
    t.alloc("scratch", PREALLOC, 8 * MB, stream=FWD, pool="symm", site="mhc.py:2743:mhc_combine")
    t.coll("next", stream=FWD, comm=COMM, seq=10, bufs=[(WIN + 4 * MB, MB, "rw")])
    line = t.free("scratch")
    t.ev("scope", name="symm", enter=False, pool="symm", comm=COMM)
    a = run(tmp_path, [t], engine)
    assert [(f.rule, f.line) for f in a.findings] == [("transient-in-window", line)]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_graph_replay_while_the_block_lives_exposes_it(tmp_path, engine):
    """A replayed collective is issued as any other (after a sync, so nothing was in flight)."""
    t = server_start(0, 1)
    t.ev("scope", name="symm", enter=True, pool="symm", comm=COMM)
    t.ev("window", addr=PREALLOC, size=4 * GIB, comm=COMM)
    t.alloc("scratch", PREALLOC, 8 * MB, stream=FWD, pool="symm", site="mhc.py:2743:mhc_combine")
    t.ev("graph_replay", graph="g3", stream=FWD)
    line = t.free("scratch")
    a = run(tmp_path, [t], engine)
    assert [(f.rule, f.line) for f in a.findings] == [("transient-in-window", line)]


@pytest.mark.parametrize("engine", ENGINES)
def test_done_collectives_expose_nothing(tmp_path, engine):
    """Completion by coll_done (a Work's wait, torch.distributed) counts as a sync does."""
    t = Trace()
    t.ev("window", addr=WIN, size=64 * MB, comm="tp")
    t.coll(1, stream="nccl:0", comm="tp", seq=0, bufs=[(WIN, MB, "rw")])
    t.ev("coll_done", cid=1)
    t.alloc(1, WIN + 8 * MB, MB, stream=FWD, pool="symm", site="x.py:1:f")
    t.free(1)
    assert run(tmp_path, [t], engine).findings == []
    t.coll(2, stream="nccl:0", comm="tp", seq=1, bufs=[(WIN, MB, "rw")])   # this one is not done
    t.alloc(2, WIN + 8 * MB, MB, stream=FWD, pool="symm", site="x.py:1:f")
    line = t.free(2)
    assert [(f.rule, f.line) for f in run(tmp_path, [t], engine).findings] == [("transient-in-window", line)]


@pytest.mark.parametrize("engine", ENGINES)
def test_under_successor_completion_the_last_window_collective_keeps_exposing(tmp_path, engine):
    """--peer-completion successor: a collective's window buffers stay exposed until a later one
    on the communicator is done, which the last one before the pre-allocation never is. The mode
    is conservative by design (docs/hazard-model.md): the same pre-allocation is flagged there."""
    t = server_start(0, 1)
    line = prealloc(t)
    assert run(tmp_path, [t], engine).findings == []
    a = run(tmp_path, [t], engine, peer_completion="successor")
    # (the warm-ups' outputs, dropped with no later collective done, are free-in-flight there too)
    assert [(f.rule, f.line) for f in a.findings if f.rule == "transient-in-window"] == [("transient-in-window", line)]
