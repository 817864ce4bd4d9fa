"""Each rule of docs/ordering-and-rules.md ("The rules"), positive and negative, on hand-written traces."""
from __future__ import annotations

import pytest

from sanitizer.rules.driver import analyze
from tracebuilder import Trace

A, B = 0x10000, 0x20000
KB4 = 4096


def run(tmp_path, *traces, **kw):
    paths = [t.write(tmp_path / f"rank{t.header['rank']}.jsonl") for t in traces]
    return analyze(paths, **kw)


def rules(analysis):
    return sorted((f.rule, f.line) for f in analysis.findings)


def cross_stream_setup(t: Trace):
    """Block on s0 handed to an all-reduce on `comm`, the usual event handshake first."""
    t.alloc(1, A, KB4, stream="s0", site="model.py:10:forward")
    t.launch("s0", writes=[(A, KB4)])
    t.ev("record", event="e0", stream="s0")
    t.ev("wait", event="e0", stream="comm")
    return t.coll(1, stream="comm", bufs=[(A, KB4, "rw")], site="comm.py:5:all_reduce")


def test_cross_stream_reuse_without_record_stream(tmp_path):
    t = Trace()
    coll_line = cross_stream_setup(t)
    free_line = t.free(1)
    alloc_line = t.alloc(2, A + 1024, 1024, stream="s0", site="model.py:20:forward")
    a = run(tmp_path, t)
    assert rules(a) == [("free-in-flight", free_line), ("reuse-in-flight", alloc_line)]
    reuse = next(f for f in a.findings if f.rule == "reuse-in-flight")
    assert reuse.severity == "error"
    assert reuse.op["line"] == coll_line and reuse.op["cid"] == 1 and reuse.op["comm"] == "tp"
    assert reuse.block["site"] == "model.py:20:forward"
    assert reuse.overlap == (A + 1024, A + 2048)
    assert a.exit_code() == 1


def test_record_stream_and_free_done_is_clean(tmp_path):
    t = Trace()
    cross_stream_setup(t)
    t.ev("record_stream", id=1, stream="comm")
    t.free(1)
    t.ev("free_done", id=1)
    t.alloc(2, A, KB4, stream="s0")
    a = run(tmp_path, t)
    assert a.findings == [] and a.exit_code() == 0


def test_record_stream_without_free_done_still_collides_on_reuse(tmp_path):
    """record_stream protects the free; a reuse before the allocator saw the work finish is real."""
    t = Trace()
    cross_stream_setup(t)
    t.ev("record_stream", id=1, stream="comm")
    t.free(1)
    line = t.alloc(2, A, KB4, stream="s0")
    assert rules(run(tmp_path, t)) == [("reuse-in-flight", line)]


def side_stream_collective(t: Trace, side_waits: bool):
    """The GPU kit's C2 `side-stream-record` (sanitizer/capture/gpu_selfcheck.py), as capture wrote
    it on an H200: x on the compute stream, an all-reduce issued from a side stream whose Work.wait()
    makes the side stream wait for the NCCL stream (ProcessGroupNCCL's synchronizeStream), then
    x.record_stream(side) and the drop."""
    t.alloc(1, A, KB4, stream="cuda:0", site="kit.py:15:<module>")
    t.launch("cuda:0", writes=[(A, KB4)])
    t.ev("record", event="e0", stream="cuda:0")
    t.ev("wait", event="e0", stream="cuda:0:s1")
    t.ev("record", event="coll1:in", stream="cuda:0:s1")
    t.ev("wait", event="coll1:in", stream="nccl:0")
    t.coll(1, stream="nccl:0", bufs=[(A, KB4, "rw")], site="kit.py:18:<module>")
    if side_waits:
        t.ev("record", event="coll1", stream="nccl:0")
        t.ev("wait", event="coll1", stream="cuda:0:s1")
    t.ev("record_stream", id=1, stream="cuda:0:s1")
    return t.free(1)


def test_record_stream_on_a_stream_that_waited_for_the_collective_is_clean(tmp_path):
    """The allocator reuses the block only after the event it records on the side stream at the
    free completes (CUDACachingAllocator.cpp: insert_events, then process_events in a later
    malloc); that event follows the side stream's wait for the collective. So the free and the
    reuse are clean though the collective is not done for the block's own stream."""
    t = Trace()
    side_stream_collective(t, side_waits=True)
    t.ev("free_done", id=1)
    t.alloc(2, A, KB4, stream="cuda:0", site="kit.py:22:<module>")
    t.launch("cuda:0", writes=[(A, KB4)])
    for engine in ("compiled", "interpreted"):
        a = run(tmp_path, t, engine=engine) if engine == "interpreted" else run(tmp_path, t)
        assert a.findings == [], engine


def test_record_stream_on_a_stream_that_never_waited_still_flags_the_free(tmp_path):
    t = Trace()
    free_line = side_stream_collective(t, side_waits=False)
    assert rules(run(tmp_path, t)) == [("free-in-flight", free_line)]
    assert rules(run(tmp_path, t, engine="interpreted")) == [("free-in-flight", free_line)]


@pytest.mark.parametrize("ordering", ["event", "sync_device", "sync_stream", "sync_event", "coll_done"])
def test_ordering_edges_make_reuse_clean(tmp_path, ordering):
    t = Trace()
    cross_stream_setup(t)
    if ordering == "event":
        t.ev("record", event="e1", stream="comm")
        t.ev("wait", event="e1", stream="s0")
    elif ordering == "sync_device":
        t.ev("sync")
    elif ordering == "sync_stream":
        t.ev("sync", stream="comm")
    elif ordering == "sync_event":
        t.ev("record", event="e1", stream="comm")
        t.ev("sync", event="e1")
    else:
        t.ev("coll_done", cid=1)
    t.free(1)
    t.alloc(2, A, KB4, stream="s0")
    a = run(tmp_path, t)
    assert a.findings == [], rules(a)


def test_wait_before_the_collective_orders_nothing(tmp_path):
    """An event recorded on comm before the collective says nothing about the collective."""
    t = Trace()
    t.alloc(1, A, KB4, stream="s0")
    t.ev("record", event="early", stream="comm")
    t.coll(1, stream="comm", bufs=[(A, KB4, "rw")])
    t.ev("wait", event="early", stream="s0")
    line = t.free(1)
    assert rules(run(tmp_path, t)) == [("free-in-flight", line)]


def test_partial_overlap_counts_and_adjacent_does_not(tmp_path):
    t = Trace()
    cross_stream_setup(t)
    t.ev("record_stream", id=1, stream="comm")
    t.free(1)
    t.ev("free_done", id=1)  # the free itself is fine...
    t.ev("sync", stream="s0")
    t.alloc(3, A + KB4, 512, stream="s0")  # adjacent: [A+4096, ...) does not touch [A, A+4096)
    t2 = Trace()
    cross_stream_setup(t2)
    t2.free(1)
    line = t2.alloc(3, A + KB4 - 8, 512, stream="s0")  # the last 8 bytes overlap
    a = run(tmp_path, t)
    assert a.findings == []
    b = analyze([t2.write(tmp_path / "partial.jsonl")])
    reuse = [f for f in b.findings if f.rule == "reuse-in-flight"]
    assert [(f.line, f.overlap) for f in reuse] == [(line, (A + KB4 - 8, A + KB4))]


def test_same_stream_reuse_is_ordered(tmp_path):
    t = Trace()
    t.alloc(1, A, KB4, stream="s0")
    t.launch("s0", writes=[(A, KB4)])
    t.free(1)
    t.alloc(2, A, KB4, stream="s0")
    t.launch("s0", reads=[(A, KB4)])
    assert run(tmp_path, t).findings == []


def test_reuse_on_the_collective_stream_is_ordered(tmp_path):
    t = Trace()
    cross_stream_setup(t)
    t.free(1)  # free-in-flight: s0 does not know comm is done
    t.alloc(2, A, KB4, stream="comm")  # but comm itself does: no reuse-in-flight
    a = run(tmp_path, t)
    assert [f.rule for f in a.findings] == ["free-in-flight"]


def test_unordered_access_read_after_async_write(tmp_path):
    t = Trace()
    t.alloc(1, A, KB4, stream="s0")
    t.coll(1, stream="comm", bufs=[(A, KB4, "w")])
    line = t.launch("s0", reads=[(A + 100, 8)], site="model.py:30:mlp")
    t.launch("s0", reads=[(B, 8)])  # unrelated range
    a = run(tmp_path, t)
    assert rules(a) == [("unordered-access", line)]
    f = a.findings[0]
    assert f.overlap == (A + 100, A + 108) and f.site == "model.py:30:mlp"
    assert f.block["id"] == 1 and f.op["cid"] == 1


def test_read_read_is_not_a_conflict_but_write_after_read_is(tmp_path):
    t = Trace()
    t.alloc(1, A, KB4, stream="s0")
    t.coll(1, stream="comm", bufs=[(A, KB4, "r")])
    t.launch("s0", reads=[(A, KB4)])
    line = t.launch("s0", writes=[(A, 16)])
    assert rules(run(tmp_path, t)) == [("unordered-access", line)]


def test_collective_buffers_count_as_accesses(tmp_path):
    t = Trace()
    t.alloc(1, A, KB4, stream="s0")
    t.launch("s0", writes=[(A, KB4)])
    line = t.coll(1, stream="comm", bufs=[(A, KB4, "r")])  # no wait on s0's write
    assert rules(run(tmp_path, t)) == [("unordered-access", line)]


def window_trace(rank=0, world=1, offset=0):
    t = Trace(rank=rank, world_size=world)
    t.ev("window", addr=B, size=1 << 20, comm="tp")
    return t


def test_transient_in_window_grouped_per_site(tmp_path):
    t = window_trace()
    t.ev("scope", name="symm", enter=True, pool="symm", comm="tp")
    t.alloc(1, B, KB4, pool="symm", site="mhc.py:10:hc_pre")
    t.alloc(2, B + KB4, 2048, pool="symm", site="mhc.py:10:hc_pre")
    t.alloc(3, B + 3 * KB4, KB4, pool="symm", site="mhc.py:12:hc_pre")
    t.ev("scope", name="symm", enter=False)
    t.coll(1, stream="s0", bufs=[(B + 3 * KB4, KB4, "rw")])  # block 3 is a collective buffer
    first = t.free(1)
    t.free(2)
    t.free(3)
    t.alloc(4, A, KB4)  # outside the window
    t.free(4)
    a = run(tmp_path, t)
    tw = [f for f in a.findings if f.rule == "transient-in-window"]
    assert len(tw) == 1
    assert (tw[0].site, tw[0].count, tw[0].bytes, tw[0].line) == ("mhc.py:10:hc_pre", 2, KB4 + 2048, first)
    assert tw[0].block["window_offset"] == 0 and tw[0].severity == "error"
    assert tw[0].by_step == {None: 2}
    assert a.exit_code("error") == 1 and a.exit_code("warning") == 1


def test_transient_counts_per_step_and_steps_seen(tmp_path):
    t = window_trace()
    # an all-reduce in flight (never done for the host) exposes every later window transient
    t.coll(9, stream="s1", bufs=[(A, KB4, "rw")])
    for step in (3, 4, 4):
        t.ev("step", n=step)
        t.alloc(step * 10 + len(t.events), B, 512, site="x.py:1:f")
        t.free(step * 10 + len(t.events) - 1)
    a = run(tmp_path, t)
    assert a.findings[0].by_step == {3: 1, 4: 2}
    assert a.summary["steps_by_rank"] == {0: [3, 4]}


def test_window_registered_after_allocation_still_counts(tmp_path):
    """SGLang registers pool segments as windows on scope exit, after the allocations."""
    t = Trace()
    t.alloc(1, B + 64, 512, pool="symm", site="x.py:1:f")
    t.ev("window", addr=B, size=1 << 20, comm="tp")
    t.coll(1, stream="s0", bufs=[(A, KB4, "rw")])  # issued while block 1 lives: exposed to it
    t.free(1)
    tw = [f for f in run(tmp_path, t).findings if f.rule == "transient-in-window"]
    assert [(f.count, f.block["window_offset"]) for f in tw] == [(1, 64)]


def strict_trace():
    """A window buffer used by all-reduce 1; only 1 is locally complete when it is freed."""
    t = window_trace()
    t.alloc(1, B, KB4, stream="s0", pool="symm")
    t.coll(1, stream="s0", seq=1, bufs=[(B, KB4, "rw")])
    t.launch("s0", reads=[(B, KB4)])
    return t


def test_local_vs_successor_peer_completion(tmp_path):
    t = strict_trace()
    free_line = t.free(1)
    t.alloc(2, B, KB4, stream="s0", pool="symm")
    assert run(tmp_path, t, peer_completion="local").findings == []
    strict = run(tmp_path, t, peer_completion="successor")
    assert ("free-in-flight", free_line) in rules(strict)
    assert "reuse-in-flight" in {f.rule for f in strict.findings}


def test_successor_done_once_a_later_collective_completes(tmp_path):
    t = strict_trace()
    t.alloc(9, A, KB4, stream="s0")
    t.coll(2, stream="s0", seq=2, bufs=[(A, KB4, "rw")])  # later collective, same comm
    t.free(1)
    t.alloc(2, B, KB4, stream="s0", pool="symm")
    assert run(tmp_path, t, peer_completion="successor").findings == []


def test_successor_mode_flags_writes_not_reads_of_the_result(tmp_path):
    t = strict_trace()  # reads the all-reduce result on its own stream: ordered in both modes
    line = t.launch("s0", writes=[(B, 64)])  # overwrites while peers may still read my window
    assert run(tmp_path, t, peer_completion="local").findings == []
    assert rules(run(tmp_path, t, peer_completion="successor")) == [("unordered-access", line)]


def test_successor_mode_ignores_buffers_outside_windows(tmp_path):
    t = Trace()
    t.alloc(1, A, KB4, stream="s0")
    t.coll(1, stream="s0", bufs=[(A, KB4, "rw")])
    t.free(1)
    assert run(tmp_path, t, peer_completion="successor").findings == []


def graph_trace():
    t = Trace()
    t.alloc(1, A, KB4, stream="s0", pool="graph0")
    t.ev("graph_begin", graph="g", stream="s0")
    cap = t.launch("s0", writes=[(A, KB4)], op="mm")
    t.coll(1, stream="s0", bufs=[(A, KB4, "rw")])
    t.ev("graph_end", graph="g", stream="s0")
    return t, cap


def test_graph_buffers_kept_alive_are_clean(tmp_path):
    t, _ = graph_trace()
    for _ in range(3):
        t.launch("s0", writes=[(A, KB4)])  # copy new inputs in, on the replay stream
        t.ev("graph_replay", graph="g", stream="s0")
    t.ev("sync")
    t.ev("graph_free", graph="g")
    t.free(1)
    a = run(tmp_path, t)
    assert a.findings == [], rules(a)


def test_graph_buffer_released_while_graph_lives(tmp_path):
    t, cap = graph_trace()
    t.ev("graph_replay", graph="g", stream="s1")
    free_line = t.free(1)
    alloc_line = t.alloc(2, A + 512, 512, stream="s0")
    a = run(tmp_path, t)
    got = rules(a)
    # One finding per event and captured op; no free-in-flight / reuse-in-flight on top of it.
    assert got == sorted([("graph-buffer-released", free_line), ("graph-buffer-released", free_line),
                          ("graph-buffer-released", alloc_line), ("graph-buffer-released", alloc_line)])
    assert {f.op["line"] for f in a.findings} == {cap, cap + 1}


def test_graph_replay_runs_captured_work(tmp_path):
    """The replayed writes are in flight on the replay stream: a read from s0 is unordered."""
    t, _ = graph_trace()
    replay = t.ev("graph_replay", graph="g", stream="s1")
    line = t.launch("s0", reads=[(A, 64)])
    a = run(tmp_path, t)
    ua = [f for f in a.findings if f.rule == "unordered-access"]
    assert {f.line for f in ua} == {line}
    assert {f.op["line"] for f in ua} == {replay}


def test_captured_work_does_not_run_at_capture(tmp_path):
    t, _ = graph_trace()
    t.ev("graph_free", graph="g")
    t.free(1)
    t.alloc(2, A, KB4, stream="s1")
    assert run(tmp_path, t).findings == []


def two_ranks(offsets, sizes=(KB4, KB4)):
    ranks = []
    for r, (off, size) in enumerate(zip(offsets, sizes)):
        t = window_trace(rank=r, world=2)
        t.alloc(1, B + off, size, pool="symm")
        t.coll(7, stream="s0", seq=3, bufs=[(B + off, size, "rw")])
        t.ev("sync")
        t.free(1)
        ranks.append(t)
    return ranks


def test_asymmetric_offset_two_ranks(tmp_path):
    assert run(tmp_path, *two_ranks((0, 0))).findings == []
    a = run(tmp_path, *two_ranks((0, 512)))
    assert [(f.rule, f.rank, f.line) for f in a.findings] == [("asymmetric-offset", 1, 4)]
    assert a.findings[0].op["rank"] == 0
    b = run(tmp_path, *two_ranks((0, 0), sizes=(KB4, 2 * KB4)))
    assert [f.rule for f in b.findings] == ["asymmetric-offset"]


def test_asymmetric_offset_needs_window_buffers(tmp_path):
    """Different raw addresses outside windows are normal (each rank has its own allocator)."""
    ts = []
    for r, addr in enumerate((A, A + 512)):
        t = Trace(rank=r, world_size=2)
        t.alloc(1, addr, KB4)
        t.coll(1, stream="s0", bufs=[(addr, KB4, "rw")])
        ts.append(t)
    assert run(tmp_path, *ts).findings == []


def test_many_steps_across_ranks_match_by_comm_and_seq(tmp_path):
    """Thousands of collectives: read round-robin, matched and dropped as they meet."""
    ts = []
    for r in range(3):
        t = window_trace(rank=r, world=3)
        for i in range(3000):
            off = 512 if (r == 2 and i == 2500) else 0
            t.alloc(i, B + off, KB4, pool="symm")
            t.coll(i, stream="s0", seq=i, bufs=[(B + off, KB4, "rw")])
            t.ev("sync")
            t.free(i)
        ts.append(t)
    a = run(tmp_path, *ts)
    assert [(f.rule, f.rank, f.block["seq"]) for f in a.findings] == [("asymmetric-offset", 2, 2500)]


# ---------------------------------------------------------------- settled by the implementation


def test_wait_on_a_never_recorded_event_is_a_no_op(tmp_path):
    """cudaStreamWaitEvent on a never-recorded event does nothing: no error, no ordering."""
    t = Trace()
    t.alloc(1, A, KB4, stream="s0")
    t.coll(1, stream="comm", bufs=[(A, KB4, "w")])
    t.ev("wait", event="never", stream="s0")          # orders nothing
    read = t.launch("s0", reads=[(A, KB4)])
    a = run(tmp_path, t)
    assert a.errors == [] and rules(a) == [("unordered-access", read)]
    assert any("1 wait/sync on an event never recorded (no-op)" in w for w in a.warnings)


def test_record_stream_on_its_own_stream_then_free_done_is_accepted(tmp_path):
    t = Trace()
    t.alloc(1, A, KB4, stream="s0")
    t.launch("s0", writes=[(A, KB4)])
    t.ev("record_stream", id=1, stream="s0")            # its own stream: ignored
    t.free(1)
    t.ev("free_done", id=1)                             # follows that free: a no-op, not malformed
    t.alloc(2, A, KB4, stream="s0")
    a = run(tmp_path, t)
    assert a.errors == [] and a.findings == [] and a.exit_code() == 0
    t.ev("free_done", id=1)                             # a second one has no free to follow
    a = run(tmp_path, t)
    assert [e.line for e in a.errors] == [len(t.events) + 1]
    assert "free_done with no pending free for id 1" in a.errors[0].message


@pytest.mark.parametrize("body,field", [
    ('{"ev": "launch", "stream": "s0", "reads": [[4096, -1]]}', "reads[0][1]"),
    ('{"ev": "launch", "stream": "s0", "writes": [[4096, 16], [8192, -16]]}', "writes[1][1]"),
    ('{"ev": "coll", "cid": 5, "comm": "tp", "seq": 5, "op": "x", "stream": "c", "bufs": [{"addr": 1, "size": -8, "access": "r"}]}', "bufs[0].size"),
    ('{"ev": "alloc", "id": 9, "addr": 4096, "size": -1, "stream": "s0", "pool": 0}', "size"),
    ('{"ev": "window", "addr": 4096, "size": -1, "comm": "tp"}', "size"),
])
def test_negative_sizes_are_malformed(tmp_path, body, field):
    t = Trace()
    t.alloc(1, A, KB4, stream="s0")
    p = t.write(tmp_path / "neg.jsonl")
    p.write_text(p.read_text() + body + "\n")
    a = analyze([p])
    assert a.exit_code() == 2 and [e.line for e in a.errors] == [3]
    assert field in a.errors[0].message and ">= 0" in a.errors[0].message, a.errors[0].message
    assert str(a.errors[0]).startswith(f"{p}:3: ") and "\n" not in str(a.errors[0])
