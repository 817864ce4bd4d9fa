"""Host threads on both builds of the engine (docs/ordering-and-rules.md, "Host threads"; issue 54,
class 2): each thread's CPU work on a lane of its own, judged with that thread's knowledge, ordered
only by the edges the program makes (start, join, release/acquire); the memory rules with what all
threads know together.

The traces are meta-pytorch/torchft#240's pattern as capture records it: a gloo all-reduce whose
Future completes on a handler thread, which runs a `then` callback there (`tensor /= n`); the main
thread waits only the Work (buggy) or the Future `then` returned (fixed), then reads the tensor."""
from __future__ import annotations

import pytest

from engine_scenarios import BACKENDS, Scenario, analyze_scenario, check_against_reference

T = 0x10000          # the all-reduced tensor
U = 0x20000          # a tensor a thread writes
H = 7                # the handler thread's id
LANE = f"cpu@{H}"


def _found(events, backend):
    # every scenario here is also checked against the brute-force reference (dense clocks)
    check_against_reference(Scenario([events], "local"), backend=backend)
    result = analyze_scenario(Scenario([events], "local"), backend=backend)
    return sorted((f.rule, f.line, f.op.line if f.op else None, f.op.stream if f.op else None)
                  for f in result.findings)


def _torchft(fixed: bool, callback_first: bool) -> list[dict]:
    """Lines from 2 (the header is line 1)."""
    evs = [
        {"ev": "alloc", "id": 1, "addr": T, "size": 1024, "stream": "cpu", "pool": "default"},
        {"ev": "thread_start", "thread": H, "lane": LANE},
        {"ev": "coll", "cid": 1, "comm": "0", "seq": 0, "op": "c10d.allreduce_", "stream": "gloo:0",
         "bufs": [{"addr": T, "size": 1024, "access": "rw"}]},
    ]
    handler = [
        {"ev": "thread", "thread": H},
        {"ev": "coll_done", "cid": 1},                 # the handler's own work.wait()
        {"ev": "release", "sync": "future:1"},         # set_result
        {"ev": "acquire", "sync": "future:1"},         # the callback starts
        {"ev": "launch", "stream": LANE, "op": "aten.div_", "reads": [[T, 1024]], "writes": [[T, 1024]]},
        {"ev": "release", "sync": "then:2"},           # the callback returned: its Future completes
    ]
    main = [{"ev": "thread", "thread": 0}, {"ev": "coll_done", "cid": 1}]   # main's work.wait()
    if fixed:
        main.append({"ev": "acquire", "sync": "then:2"})                   # the chained Future's wait
    main.append({"ev": "launch", "stream": "cpu", "op": "aten.sum", "reads": [[T, 1024]]})
    if callback_first:
        return evs + handler + main
    if fixed:
        raise ValueError("the fixed program reads only after the callback")
    return evs + main + handler


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_callback_on_another_thread_races_the_main_threads_read_whatever_ran_first(backend):
    # callback first: the read (line 13) is unordered after the callback's write (line 9)
    assert _found(_torchft(False, True), backend) == [("unordered-access", 13, 9, LANE)]
    # read first: the callback's write (line 12) is unordered after the main thread's read (line 7)
    assert _found(_torchft(False, False), backend) == [("unordered-access", 12, 7, "cpu")]


@pytest.mark.parametrize("backend", BACKENDS)
def test_waiting_the_future_then_returned_orders_the_callback_before_the_read(backend):
    assert _found(_torchft(True, True), backend) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_thread_does_not_learn_what_another_waited(backend):
    """The handler waited the all-reduce; the main thread did not: its read of the result is
    unordered (with one host clock, the handler's wait ordered it)."""
    evs = _torchft(False, True)
    main_wait = evs.index({"ev": "coll_done", "cid": 1}, 5)
    del evs[main_wait]
    found = _found(evs, backend)
    assert ("unordered-access", 12, 4, "gloo:0") in found


@pytest.mark.parametrize("backend", BACKENDS)
def test_start_and_join_order_the_threads_work(backend):
    evs = [
        {"ev": "alloc", "id": 1, "addr": T, "size": 1024, "stream": "cpu", "pool": "default"},
        {"ev": "alloc", "id": 2, "addr": U, "size": 1024, "stream": "cpu", "pool": "default"},
        {"ev": "launch", "stream": "cpu", "writes": [[T, 1024]]},
        {"ev": "thread_start", "thread": H, "lane": LANE},
        {"ev": "thread", "thread": H},
        {"ev": "launch", "stream": LANE, "reads": [[T, 1024]], "writes": [[U, 1024]]},
        {"ev": "thread_end", "thread": H},
        {"ev": "thread", "thread": 0},
        {"ev": "thread_join", "thread": H},
        {"ev": "launch", "stream": "cpu", "reads": [[U, 1024]]},
    ]
    assert _found(evs, backend) == []
    no_join = [e for e in evs if e["ev"] != "thread_join"]
    assert _found(no_join, backend) == [("unordered-access", 10, 7, LANE)]
    # a thread the trace never saw starting knows what all threads knew at its first event
    unseen = [e for e in evs if e["ev"] != "thread_start"]
    assert _found(unseen, backend) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_release_and_acquire_order_two_threads(backend):
    evs = [
        {"ev": "alloc", "id": 2, "addr": U, "size": 1024, "stream": "cpu", "pool": "default"},
        {"ev": "thread_start", "thread": H, "lane": LANE},
        {"ev": "thread", "thread": H},
        {"ev": "launch", "stream": LANE, "writes": [[U, 1024]]},
        {"ev": "release", "sync": "event:1"},
        {"ev": "thread", "thread": 0},
        {"ev": "acquire", "sync": "event:1"},
        {"ev": "launch", "stream": "cpu", "reads": [[U, 1024]]},
    ]
    assert _found(evs, backend) == []
    # acquiring another object orders nothing
    other = [dict(e, sync="queue:9") if e["ev"] == "acquire" else e for e in evs]
    assert _found(other, backend) == [("unordered-access", 9, 5, LANE)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_memory_rules_use_what_all_threads_know(backend):
    """A thread's CPU work is done before it lets go of the block; a collective one thread waited
    is done for the free by another. And the next block at those addresses is new memory: the old
    block's accesses do not conflict with it."""
    evs = [
        {"ev": "alloc", "id": 1, "addr": T, "size": 1024, "stream": "cpu", "pool": "default"},
        {"ev": "thread_start", "thread": H, "lane": LANE},
        {"ev": "coll", "cid": 1, "comm": "0", "seq": 0, "op": "c10d.allreduce_", "stream": "gloo:0",
         "bufs": [{"addr": T, "size": 1024, "access": "rw"}]},
        {"ev": "coll_done", "cid": 1},
        {"ev": "thread", "thread": H},
        {"ev": "launch", "stream": LANE, "writes": [[T + 1024, 64]]},
        {"ev": "free", "id": 1},                                 # the last reference dropped here
        {"ev": "thread", "thread": 0},
        {"ev": "alloc", "id": 3, "addr": T, "size": 2048, "stream": "cpu", "pool": "default"},
        {"ev": "launch", "stream": "cpu", "writes": [[T, 2048]]},
    ]
    evs[0]["size"] = 2048
    assert _found(evs, backend) == []
    # the same free with the collective waited by nobody is in flight
    unwaited = [e for e in evs if e["ev"] != "coll_done"]
    assert ("free-in-flight", 7, 4, "gloo:0") in _found(unwaited, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_device_synchronize_waits_for_no_thread(backend):
    evs = [
        {"ev": "alloc", "id": 2, "addr": U, "size": 1024, "stream": "cpu", "pool": "default"},
        {"ev": "thread_start", "thread": H, "lane": LANE},
        {"ev": "thread", "thread": H},
        {"ev": "launch", "stream": LANE, "writes": [[U, 1024]]},
        {"ev": "thread", "thread": 0},
        {"ev": "sync"},
        {"ev": "sync", "stream": LANE},
        {"ev": "launch", "stream": "cpu", "reads": [[U, 1024]]},
    ]
    assert _found(evs, backend) == [("unordered-access", 9, 5, LANE)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_work_another_thread_enqueued_on_a_stream_carries_what_it_knew(backend):
    """A thread waits a collective, then enqueues a kernel reading its output on stream s; the
    main thread enqueues a kernel on s after it: stream order makes the second follow the first,
    which followed the wait."""
    evs = [
        {"ev": "alloc", "id": 1, "addr": T, "size": 1024, "stream": "s", "pool": "default"},
        {"ev": "thread_start", "thread": H, "lane": LANE},
        {"ev": "coll", "cid": 1, "comm": "0", "seq": 0, "op": "c10d.allreduce_", "stream": "nccl:0",
         "bufs": [{"addr": T, "size": 1024, "access": "rw"}]},
        {"ev": "thread", "thread": H},
        {"ev": "coll_done", "cid": 1},
        {"ev": "launch", "stream": "s", "reads": [[T, 512]]},
        {"ev": "thread", "thread": 0},
        {"ev": "launch", "stream": "s", "writes": [[T, 1024]]},
    ]
    assert _found(evs, backend) == []


def test_a_trace_of_one_thread_is_judged_as_before():
    """`thread 0` and edges among one thread change nothing (and make no thread state)."""
    from sanitizer.rules import select
    eng = select.load_engine("interpreted")
    evs = _torchft(False, True)
    one = [e for e in evs if e["ev"] not in ("thread", "thread_start")]
    one = [dict(e, stream="cpu") if e.get("stream") == LANE else e for e in one]
    assert _found(one, "interpreted") == []
    assert eng is not None
