"""An observed `coll_done` (capture saw the collective finish; the program never waited for it) on
both builds of the engine, against the same trace with the program's own `coll_done`
(docs/ordering-and-rules.md, "Observed completion"; issue 54).

The trace is vllm-ascend#11961's pattern as capture records it: three gloo all-gathers in flight on
lanes of their own, the first two handles dropped, only the third waited, then every output read.
The dropped ones were seen finished (their temporary inputs died after the Work let go of them).
Whether they finished before the read is timing: the read is unordered either way."""
from __future__ import annotations

import pytest

from engine_scenarios import BACKENDS, Scenario, analyze_scenario, check_against_reference

IN, OUT = 0x10000, 0x20000           # inputs and outputs of gather i at IN + i*0x1000, OUT + i*0x1000


def _gathers(done_first_two: str) -> list[dict]:
    """`done_first_two`: "observed" (capture's look), "waited" (the program's wait), or "none"."""
    evs = []
    for i in range(3):
        evs.append({"ev": "alloc", "id": 10 + i, "addr": IN + i * 0x1000, "size": 1024, "stream": "cpu", "pool": "default"})
        evs.append({"ev": "alloc", "id": 20 + i, "addr": OUT + i * 0x1000, "size": 2048, "stream": "cpu", "pool": "default"})
    for i in range(3):
        evs.append({"ev": "coll", "cid": i + 1, "comm": "0", "seq": i, "op": "c10d._allgather_base_",
                    "stream": "gloo:0" + (f"#{i}" if i else ""),
                    "bufs": [{"addr": IN + i * 0x1000, "size": 1024, "access": "r"},
                             {"addr": OUT + i * 0x1000, "size": 2048, "access": "w"}]})
    for i in range(2):
        if done_first_two == "observed":
            # the temporary input dies after its Work: capture writes the completion, then the free
            evs.append({"ev": "coll_done", "cid": i + 1, "observed": True})
        elif done_first_two == "waited":
            evs.append({"ev": "coll_done", "cid": i + 1})
        evs.append({"ev": "free", "id": 10 + i})
    evs.append({"ev": "coll_done", "cid": 3})
    evs.append({"ev": "free", "id": 12})
    evs.append({"ev": "launch", "stream": "cpu", "op": "aten.sum",
                "reads": [[OUT + i * 0x1000, 2048] for i in range(3)]})
    return evs


def _found(events, backend, peer="local"):
    result = analyze_scenario(Scenario([events], peer), backend=backend)
    return sorted((f.rule, f.line, f.op.line if f.op else None) for f in result.findings)


LINES = {"read": 17, "coll1": 8, "coll2": 9}    # (the header is line 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_observed_completion_frees_the_memory_and_orders_no_read(backend):
    events = _gathers("observed")
    assert events[LINES["read"] - 2]["ev"] == "launch" and events[LINES["coll1"] - 2]["cid"] == 1
    # the inputs' frees are no free-in-flight (the collective was done with them); the read of the
    # first two outputs is unordered: the program never synchronised with those gathers
    assert _found(events, backend) == [("unordered-access", 17, 8), ("unordered-access", 17, 9)]
    check_against_reference(Scenario([events], "local"), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_programs_wait_orders_the_read(backend):
    assert _found(_gathers("waited"), backend) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_unobserved_the_frees_are_in_flight_too(backend):
    events = _gathers("none")
    read = len(events) + 1
    found = _found(events, backend)
    assert ("free-in-flight", 11, 8) in found and ("unordered-access", read, 8) in found, found


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_wait_after_the_observation_orders_and_a_second_observation_changes_nothing(backend):
    events = _gathers("observed")
    read = events.pop()
    events += [{"ev": "coll_done", "cid": 1, "observed": True},    # seen again: nothing new
               {"ev": "coll_done", "cid": 1},                       # the program waits it (late)
               {"ev": "coll_done", "cid": 2, "observed": True}, read]
    assert _found(events, backend) == [("unordered-access", 20, 9)]
    check_against_reference(Scenario([events], "local"), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_reallocated_after_an_observed_completion_is_not_the_collectives(backend):
    """The dropped gather's input is freed after the observation and its address taken by a new
    block that the program writes: no conflict with the gather (that memory is no longer its), while
    its output, still held, stays unordered for the read."""
    events = _gathers("observed")
    read = events.pop()
    events += [{"ev": "alloc", "id": 30, "addr": IN, "size": 1024, "stream": "cpu", "pool": "default"},
               {"ev": "launch", "stream": "cpu", "op": "aten.fill_", "writes": [[IN, 1024]]},
               {"ev": "free", "id": 30},
               {"ev": "alloc", "id": 31, "addr": OUT, "size": 2048, "stream": "cpu", "pool": "default"}, read]
    found = _found(events, backend)
    # the new block at OUT overlaps gather 1's output, still allocated (id 20) in the trace: that
    # is a trace a program cannot make, but the engine still says the output is no longer in flight
    # for reuse, and keeps the read unordered
    assert ("unordered-access", 18, 8) not in found and ("reuse-in-flight", 20, 8) not in found, found
    assert ("unordered-access", 21, 8) in found and ("unordered-access", 21, 9) in found, found
    check_against_reference(Scenario([events], "local"), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_observed_completion_is_no_edge_for_another_stream(backend):
    """A device stream reading the output: only the host's wait orders it, never capture's look."""
    events = [{"ev": "alloc", "id": 1, "addr": OUT, "size": 2048, "stream": "s0", "pool": "default"},
              {"ev": "coll", "cid": 1, "comm": "tp", "seq": 0, "op": "all_reduce", "stream": "nccl:tp",
               "bufs": [{"addr": OUT, "size": 2048, "access": "rw"}]},
              {"ev": "coll_done", "cid": 1, "observed": True},
              {"ev": "launch", "stream": "s0", "reads": [[OUT, 2048]]},
              {"ev": "free", "id": 1}]
    assert _found(events, backend) == [("unordered-access", 5, 3)]
    events[2].pop("observed")
    assert _found(events, backend) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_successor_mode_does_not_retire_a_window_collective_on_an_observation(backend):
    """Under --peer-completion successor, a collective's window buffers wait for a later one on
    its communicator (peers may still write them): a local look at it says nothing of peers."""
    events = [{"ev": "window", "addr": OUT, "size": 4096, "comm": "tp"},
              {"ev": "alloc", "id": 1, "addr": OUT, "size": 2048, "stream": "s0", "pool": "default"},
              {"ev": "coll", "cid": 1, "comm": "tp", "seq": 0, "op": "all_reduce", "stream": "nccl:tp",
               "bufs": [{"addr": OUT, "size": 2048, "access": "rw"}]},
              {"ev": "coll_done", "cid": 1, "observed": True},
              {"ev": "free", "id": 1}]
    assert ("free-in-flight", 6, 4) in _found(events, backend, "successor")
    assert ("free-in-flight", 6, 4) not in _found(events, backend, "local")
    for peer in ("local", "successor"):
        check_against_reference(Scenario([events], peer), backend=backend)
