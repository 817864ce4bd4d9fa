"""CUDA graphs and their private pools (issue 50, items 1 and 2; docs/ordering-and-rules.md, "Graphs").

The traces model SGLang 0.5.23's decode capture as its source shows it (torch.cuda.graph cannot run
on CPU, so the events are written by hand, in the order capture would write them):

  * sglang/srt/model_executor/runner/decode_cuda_graph_runner.py, `_capture_one_stream`: the batch
    sizes are captured in `reversed(self.capture_bs)`, "so that the smaller shapes can reuse the
    memory pool allocated for the large shapes";
  * sglang/srt/model_executor/runner_backend/full_cuda_graph_backend.py, `capture_session` /
    `capture_one`: every shape is captured with `torch.cuda.graph(cuda_graph=graph,
    pool=self._pool, stream=self._capture_stream)`, `self._pool` being
    `get_or_create_global_graph_memory_pool` (runner_utils/pool.py), one
    `torch.cuda.graph_pool_handle()` for the process; the output is kept in `self._outputs`;
    `cleanup` resets every graph before it drops the outputs;
  * torch/cuda/graphs.py, `graph.__enter__`: `torch.cuda.synchronize()`, then
    `capture_begin(*self.pool)`: capture writes a `sync`, then `graph_begin` with the pool's name
    (sanitizer/capture/cuda_hooks.py, `graph_begin`: "graph-pool:<handle>");
  * sglang/srt/distributed/device_communicators/pynccl_allocator.py, `SymmetricMemoryContext`:
    `__enter__` pauses the graph pool during capture and allocates to the NCCL pool, `__exit__`
    registers new segments as windows; models/deepseek_v4.py `hc_pre` runs the mHC combine (its
    float32 einsums) inside `use_symmetric_memory`.

Every case runs in both builds of the engine, which must agree.
"""
from __future__ import annotations

import pytest

from sanitizer.rules.driver import analyze, compiled_available
from tracebuilder import Trace

ENGINES = ["interpreted", "compiled"] if compiled_available()[0] else ["interpreted"]

POOL = "graph-pool:(0, 1)"        # capture's name for torch.cuda.graph_pool_handle() == (0, 1)
CAP = "cuda:0:s1"                  # get_or_create_global_graph_capture_stream()
FWD = "cuda:0"                     # the forward stream replays run on
HEAP = 0x7F00_0000_0000            # the graph pool's segment
WIN = 0x7E00_0000_0000             # the NCCL window pool's segment
MB = 1 << 20


def run(tmp_path, t, engine, **kw):
    path = t.write(tmp_path / f"rank{t.header['rank']}-{engine}.jsonl")
    a = analyze([path], engine=engine, max_per_group=0, **kw)
    assert not a.errors, a.errors
    assert a.summary["engine"] == engine
    return a


def found(a):
    return sorted((f.rule, f.line) for f in a.findings)


def capture_decode_graph(t: Trace, gid: str, bs: int, pool: str | None, *, keep_output=True) -> dict:
    """One `capture_one` of a decode shape: torch.cuda.graph's synchronize, then the capture of a
    forward whose custom all-reduce reads the hidden states (freed inside the capture: a
    temporary of the captured forward) and writes the output kept in `self._outputs`."""
    t.ev("sync")                                          # graph.__enter__: torch.cuda.synchronize()
    t.ev("graph_begin", graph=gid, stream=CAP, **({"pool": pool} if pool else {}))
    alloc_pool = pool or f"graph:{gid}"                   # capture names the graph's own pool so
    size = bs * MB
    hidden = f"{gid}-hidden"
    out = f"{gid}-out"
    lines = {"hidden": t.alloc(hidden, HEAP, size, stream=CAP, pool=alloc_pool, site="deepseek_v4.py:120:forward")}
    lines["out"] = t.alloc(out, HEAP + 64 * MB, size, stream=CAP, pool=alloc_pool, site="custom_all_reduce.py:300:all_reduce")
    lines["coll"] = t.coll(f"{gid}-ar", stream=CAP, comm="tp", seq=0,
                           bufs=[(HEAP, size, "r"), (HEAP + 64 * MB, size, "w")], site="custom_all_reduce.py:310:all_reduce")
    lines["free_hidden"] = t.free(hidden)                 # the temporary dies inside the capture
    t.ev("graph_end", graph=gid, stream=CAP)
    if not keep_output:
        lines["free_out"] = t.free(out)
    return lines


def decode_steps(t: Trace, graphs, first_step=1):
    """Replays, one shape per step (SGLang replays one graph at a time, on the forward stream)."""
    for n, gid in enumerate(graphs, first_step):
        t.ev("step", n=n, phase="decode", tokens=8)
        t.ev("graph_replay", graph=gid, stream=FWD)
        t.ev("sync")


# ------------------------------------------------------------------ item 1: one shared pool

@pytest.mark.parametrize("engine", ENGINES)
def test_graphs_sharing_one_pool_reuse_each_others_released_bytes_cleanly(tmp_path, engine):
    """Largest shape first (bs 8, then 4): bs 4's capture takes the hidden states' bytes bs 8's
    capture released, in the one shared pool. The contract, not a finding."""
    t = Trace()
    capture_decode_graph(t, "g-bs8", 8, POOL)
    capture_decode_graph(t, "g-bs4", 4, POOL)
    decode_steps(t, ["g-bs4", "g-bs8", "g-bs4"])
    # FullCudaGraphBackend.cleanup: graph.reset() for every graph, then the outputs are dropped
    t.ev("graph_free", graph="g-bs8")
    t.ev("graph_free", graph="g-bs4")
    t.free("g-bs8-out")
    t.free("g-bs4-out")
    a = run(tmp_path, t, engine)
    assert found(a) == [] and a.exit_code() == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_the_same_captures_into_separate_pools_are_graph_buffer_released(tmp_path, engine):
    """Without the shared pool (pool absent: each graph's own), bs 4's allocations over bs 8's
    captured buffers come from another pool: still the hazard, at its allocation."""
    t = Trace()
    capture_decode_graph(t, "g-bs8", 8, None)
    lines = capture_decode_graph(t, "g-bs4", 4, None)
    a = run(tmp_path, t, engine)
    # bs 4's hidden states land on bs 8's (read by bs 8's all-reduce), and are freed there
    assert found(a) == [("graph-buffer-released", lines["hidden"]), ("graph-buffer-released", lines["out"]),
                        ("graph-buffer-released", lines["free_hidden"])]
    assert {f.op["cid"] for f in a.findings} == {"g-bs8-ar"}


@pytest.mark.parametrize("engine", ENGINES)
def test_an_eager_allocation_over_a_shared_pool_graph_is_still_flagged_in_its_step(tmp_path, engine):
    """Eager work (a prefill between decode steps) allocating over a live graph's buffer, from
    the default pool: graph-buffer-released, attributed to that step."""
    t = Trace()
    capture_decode_graph(t, "g-bs8", 8, POOL)
    capture_decode_graph(t, "g-bs4", 4, POOL)
    decode_steps(t, ["g-bs8"], first_step=1)
    t.ev("step", n=2, phase="extend", tokens=64)
    line = t.alloc("prefill", HEAP + 64 * MB, MB, stream=FWD, pool="default", site="model_runner.py:900:forward_extend")
    a = run(tmp_path, t, engine)
    hits = [f for f in a.findings if f.line == line]
    # both graphs' all-reduces write the output bytes there
    assert sorted((f.rule, f.step, f.op["cid"]) for f in hits) == [
        ("graph-buffer-released", 2, "g-bs4-ar"), ("graph-buffer-released", 2, "g-bs8-ar")]
    assert a.exit_code() == 1


@pytest.mark.parametrize("engine", ENGINES)
def test_a_pool_shared_through_another_graphs_pool_handle(tmp_path, engine):
    """torch's other way to share a pool: `g2.capture_begin(pool=g1.pool())`. Capture names g1's
    pool "graph:g1" (no handle given) and g2's by the handle g1.pool() returns, which it mapped to
    that name at g1's capture_end (tests/capture/test_capture_graph_pools.py): the same pool."""
    t = Trace()
    capture_decode_graph(t, "g1", 8, None)
    capture_decode_graph(t, "g2", 4, "graph:g1")
    decode_steps(t, ["g2", "g1"])
    assert found(run(tmp_path, t, engine)) == []


# ------------------------------------------------------------------ item 2: the window pool in a capture

def mhc_capture(t: Trace, gid: str, pool: str, *, launches: bool, y_at: int = 8 * MB) -> dict:
    """hc_pre under capture (models/deepseek_v4.py, kernels/ops/layernorm/mhc.py `mhc_combine`): the
    stock SM120 fallback runs its float32 einsum inside use_symmetric_memory, whose __enter__ pauses
    the graph pool: the einsum's transient comes from the NCCL pool (a window), and is freed at
    once; y, the combine's output, stays for the all-reduce. `launches`: HAZSAN_LEVEL=full, where
    the captured einsum's kernel is in the trace too."""
    lines = {}
    t.ev("sync")
    t.ev("graph_begin", graph=gid, stream=CAP, pool=pool)
    t.ev("scope", name="symm", enter=True, pool="symm", comm="pynccl:tp")
    lines["transient"] = t.alloc(f"{gid}-einsum", WIN, 4 * MB, stream=CAP, pool="symm", site="mhc.py:2743:mhc_combine")
    lines["y"] = t.alloc(f"{gid}-y", WIN + y_at, MB, stream=CAP, pool="symm", site="mhc.py:2745:mhc_combine")
    if launches:
        lines["einsum"] = t.launch(CAP, reads=[(HEAP, MB)], writes=[(WIN, 4 * MB)], op="aten::einsum")
        lines["reduce"] = t.launch(CAP, reads=[(WIN, 4 * MB)], writes=[(WIN + y_at, MB)], op="aten::sum")
    lines["free_transient"] = t.free(f"{gid}-einsum")
    t.ev("scope", name="symm", enter=False, pool="symm", comm="pynccl:tp")
    lines["coll"] = t.coll(f"{gid}-ar", stream=CAP, comm="pynccl:tp", seq=0, bufs=[(WIN + y_at, MB, "rw")])
    t.ev("graph_end", graph=gid, stream=CAP)
    return lines


def window_trace() -> Trace:
    t = Trace()
    # the NCCL pool's segment, registered as a window of the tp communicator (sglang_hooks)
    t.ev("window", addr=WIN, size=64 * MB, comm="pynccl:tp")
    return t


@pytest.mark.parametrize("launches", [False, True], ids=["alloc-level", "full-level"])
@pytest.mark.parametrize("engine", ENGINES)
def test_window_transient_of_a_captured_graph_is_flagged_at_the_eager_reuse(tmp_path, engine, launches):
    """After capture, decode steps replay the graph, which rewrites the einsum's bytes each time.
    A prefill in step 4 allocates in the window pool over them: graph-buffer-released there, in
    step 4, at every capture level; the transient's own report at capture stays, on its own."""
    t = window_trace()
    cap = mhc_capture(t, "g-bs8", POOL, launches=launches)
    decode_steps(t, ["g-bs8", "g-bs8", "g-bs8"])
    t.ev("step", n=4, phase="extend", tokens=64)
    t.ev("scope", name="symm", enter=True, pool="symm", comm="pynccl:tp")
    reuse = t.alloc("prefill-y", WIN + MB, MB, stream=FWD, pool="symm", site="deepseek_v4.py:3499:hc_pre")
    t.ev("scope", name="symm", enter=False, pool="symm", comm="pynccl:tp")
    a = run(tmp_path, t, engine)
    released = [f for f in a.findings if f.rule == "graph-buffer-released"]
    assert {(f.line, f.step, f.overlap) for f in released} == {(reuse, 4, (WIN + MB, WIN + 2 * MB))}
    if launches:   # the captured kernels themselves, one finding each (no stand-in on top)
        assert sorted(f.op["line"] for f in released) == [cap["einsum"], cap["reduce"]]
    else:          # the writes the trace cannot show, named by the transient's alloc
        (f,) = released
        assert f.op["line"] == cap["transient"] and f.op["site"] == "mhc.py:2743:mhc_combine"
        assert "'symm'" in f.detail and "every replay" in f.detail
    transient = [g for g in a.findings if g.rule == "transient-in-window"]
    assert [(g.line, g.step, g.site) for g in transient] == [(cap["free_transient"], None, "mhc.py:2743:mhc_combine")]
    assert "g-bs8" in transient[0].detail
    assert a.exit_code() == 1


@pytest.mark.parametrize("engine", ENGINES)
def test_the_captured_transient_stays_its_own_finding_beside_the_same_sites_eager_ones(tmp_path, engine):
    """The same combine runs eagerly in prefill (an all-reduce in flight): its transients make
    one finding, the captured one another, so the replay hazard is not counted into the eager."""
    t = window_trace()
    cap = mhc_capture(t, "g-bs8", POOL, launches=False)
    t.ev("step", n=1, phase="extend", tokens=64)
    t.coll("prev-layer", stream=FWD, comm="pynccl:tp", seq=1, bufs=[(WIN + 16 * MB, MB, "rw")])
    for i in range(3):
        t.alloc(f"eager-{i}", WIN + 32 * MB, 4 * MB, stream=FWD, pool="symm", site="mhc.py:2743:mhc_combine")
        t.free(f"eager-{i}")
    a = run(tmp_path, t, engine)
    transient = sorted((f.count, f.step, f.line) for f in a.findings if f.rule == "transient-in-window")
    assert transient == [(1, None, cap["free_transient"]), (3, 1, transient[1][2])]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_later_capture_into_the_pool_may_take_the_window_bytes(tmp_path, engine):
    """bs 4's capture (same graph pool) runs the same combine and gets the same window bytes:
    graphs of one pool replay one at a time, so that is no finding; only the transients' own
    reports are."""
    t = window_trace()
    first = mhc_capture(t, "g-bs8", POOL, launches=False)
    mhc_capture(t, "g-bs4", POOL, launches=False, y_at=12 * MB)
    decode_steps(t, ["g-bs4", "g-bs8"])
    a = run(tmp_path, t, engine)
    assert [(f.rule, f.count, f.line) for f in a.findings] == [("transient-in-window", 2, first["free_transient"])]
    # the same capture into another pool may not: its einsum takes bytes g-bs8 rewrites
    t = window_trace()
    mhc_capture(t, "g-bs8", POOL, launches=False)
    other = mhc_capture(t, "g-other", "graph-pool:(0, 2)", launches=False, y_at=12 * MB)
    a = run(tmp_path, t, engine)
    assert [(f.line, f.op["line"]) for f in a.findings if f.rule == "graph-buffer-released"] == [
        (other["transient"], first["transient"]), (other["free_transient"], first["transient"])]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_host_tensor_made_during_capture_is_not_the_graphs(tmp_path, engine):
    """Only the capture stream's allocations are the graph's: a CPU tensor the captured forward
    builds meanwhile (stream "cpu", pool "default": sanitizer/capture/block_table.py) is not
    written by a replay, and the CPU allocator handing its bytes out again is no finding."""
    t = Trace()
    t.ev("graph_begin", graph="g", stream=CAP, pool=POOL)
    t.alloc("meta", 0x5000_0000, 4096, stream="cpu", pool="default", site="forward_batch.py:80:init_new")
    t.free("meta")
    t.ev("graph_end", graph="g", stream=CAP)
    t.alloc("later", 0x5000_0000, 4096, stream="cpu", pool="default", site="scheduler.py:10:f")
    assert found(run(tmp_path, t, engine)) == []
