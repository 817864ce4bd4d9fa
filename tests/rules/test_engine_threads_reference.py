"""Host threads: where the engine (ffed723) and the reference model, read from the docs' text
(docs/ordering-and-rules.md, "Vector clocks" and "Host threads"), disagreed on random traces.

Each case is the minimal trace shrunk from a property-test disagreement (test_engine_property.py).
The reference's answer, the docs' one, is pinned first; the engine is then asked for the same.
The engine of ffed723 was wrong in all six (ENGINE_WRONG says how); ccbe060 fixed them, and the
xfail marks these tests had then are gone.
"""
from __future__ import annotations

import pytest

from engine_scenarios import BACKENDS, Scenario, analyze_scenario
from reference_model import reference_findings

T = 0x100000   # a tensor two threads touch
U = 0x101000   # another
H = 7
LANE = f"cpu@{H}"


def _launch(stream, writes=(), reads=()):
    return {"ev": "launch", "stream": stream, "reads": [[a, 16] for a in reads], "writes": [[a, 16] for a in writes]}


# (a) thread_start hands thread 0's CPU work ("cpu", lane count 1) to thread 7: the threads together
# know it done, so an alloc over it on s0 (a memory rule: what all threads know together) is clean.
# The engine's union takes in what threads learn later, not what a thread is given at its start
# (nor, for a thread not seen starting, the live threads' lane counts): reuse-in-flight at line 4.
UNION_HOLDS_WHAT_A_STARTED_THREAD_KNOWS = [
    _launch("cpu", writes=[T]),
    {"ev": "thread_start", "thread": H, "lane": LANE},
    {"ev": "alloc", "id": 0, "addr": T, "size": 16, "stream": "s0", "pool": "default"},
]

# (b) thread 7 writes T on its lane (done at once for it), then enqueues a launch without buffers on
# s0; thread 0 then writes T on s0, after 7's launch in stream order ("work on one stream runs in
# order, whoever enqueued it"): clean. The engine does not count a launch without buffers as the
# stream's issuer (RankAnalyzer.on_launch skips _issued_by): unordered-access at line 7.
BUFFERLESS_LAUNCH_IS_AN_ENQUEUE = [
    {"ev": "thread_start", "thread": H, "lane": LANE},
    {"ev": "thread", "thread": H},
    _launch(LANE, writes=[T]),
    _launch("s0"),
    {"ev": "thread", "thread": 0},
    _launch("s0", writes=[T]),
]

# (c) thread 7 starts before thread 0 learns s0's write done (line 4); 7 then writes T on its own
# lane, which nobody enqueued on before: 7 never learned the s0 write done, unordered-access at
# line 6. The engine takes a stream with no issuer as thread 0's (HostThreads.issuer defaults to
# 0) and folds thread 0's clock, as it is now, into it: no finding.
FRESH_STREAM_HAS_NO_PREVIOUS_ISSUER = [
    _launch("s0", writes=[T]),
    {"ev": "thread_start", "thread": H, "lane": LANE},
    {"ev": "sync"},
    {"ev": "thread", "thread": H},
    _launch(LANE, writes=[T]),
]

# (d) thread 0 enqueues on s1 knowing nothing of s0's write, *then* learns it (line 5); thread 7
# writes T on s1: its work follows thread 0's line-4 launch, which followed only what thread 0
# knew at line 4 (the table: VC_S = max(VC_S, VC_H) at the enqueue). Thread 0's later sync is no
# edge to thread 7 (trace order is timing): unordered-access at line 7. The engine folds thread
# 0's clock as it is at line 7 into s1: no finding.
STREAM_CARRIES_WHAT_ITS_ISSUER_KNEW_AT_THE_ENQUEUE = [
    _launch("s0", writes=[T]),
    {"ev": "thread_start", "thread": H, "lane": LANE},
    _launch("s1", writes=[U]),
    {"ev": "sync", "stream": "s0"},
    {"ev": "thread", "thread": H},
    _launch("s1", writes=[T]),
]

# (e) thread 7 writes T on its lane, then enqueues on s1; thread 0 synchronizes s1, which waits for
# 7's launch there, enqueued after 7's CPU write: thread 0 learns it (sync: VC_H = max(VC_H, VC_s1),
# VC_s1 holding what 7 knew at its enqueue), clean. The engine's stream clocks keep no thread's
# part unless another thread enqueues there next: unordered-access at line 8.
SYNC_LEARNS_WHAT_THE_STREAMS_ISSUER_KNEW = [
    {"ev": "thread_start", "thread": H, "lane": LANE},
    {"ev": "thread", "thread": H},
    _launch(LANE, writes=[T]),
    _launch("s1", writes=[U]),
    {"ev": "thread", "thread": 0},
    {"ev": "sync", "stream": "s1"},
    _launch("cpu", writes=[T]),
]

# (f) thread 0 waits the collective (line 5) before allocating a window block (line 6) and frees it
# with no collective issued in between: the collective is finished (thread 0 knows it: so do the
# union and the allocating thread), the block was exposed to nothing. The engine asks whether the
# collective is done for every live thread (thread 7 never learned it): transient-in-window.
WINDOW_EXPOSURE_ASKS_WHAT_SOME_THREAD_KNOWS = [
    {"ev": "window", "addr": T + 256, "size": 96, "comm": "c0"},
    {"ev": "thread_start", "thread": H, "lane": LANE},
    {"ev": "coll", "cid": 0, "comm": "c0", "seq": 0, "op": "all_reduce", "stream": "s0",
     "bufs": [{"addr": T, "size": 16, "access": "rw"}]},
    {"ev": "coll_done", "cid": 0},
    {"ev": "alloc", "id": 0, "addr": T + 256, "size": 16, "stream": "s0", "pool": "symm", "site": "a.py:1:f"},
    {"ev": "free", "id": 0},
]

# name -> (events, the docs' findings as (rule, line, op line))
CASES = {
    "union-holds-what-a-started-thread-knows": (UNION_HOLDS_WHAT_A_STARTED_THREAD_KNOWS, set()),
    "bufferless-launch-is-an-enqueue": (BUFFERLESS_LAUNCH_IS_AN_ENQUEUE, set()),
    "fresh-stream-has-no-previous-issuer": (FRESH_STREAM_HAS_NO_PREVIOUS_ISSUER, {("unordered-access", 6, 2)}),
    "stream-carries-what-its-issuer-knew-at-the-enqueue": (STREAM_CARRIES_WHAT_ITS_ISSUER_KNEW_AT_THE_ENQUEUE,
                                                           {("unordered-access", 7, 2)}),
    "sync-learns-what-the-streams-issuer-knew": (SYNC_LEARNS_WHAT_THE_STREAMS_ISSUER_KNEW, set()),
    "window-exposure-asks-what-some-thread-knows": (WINDOW_EXPOSURE_ASKS_WHAT_SOME_THREAD_KNOWS, set()),
}

# Where the engine (ffed723) answered otherwise; fixed since: none left.
ENGINE_WRONG: dict[str, str] = {}


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_answers_as_the_docs(name):
    events, want = CASES[name]
    got = {(f.rule, f.line, f.op_line) for f in reference_findings([events])}
    assert got == want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=ENGINE_WRONG[n]))
                                  if n in ENGINE_WRONG else n for n in sorted(CASES)])
def test_engine_answers_as_the_docs(name, backend):
    events, want = CASES[name]
    result = analyze_scenario(Scenario([events], "local"), backend)
    assert {(f.rule, f.line, f.op.line if f.op else None) for f in result.findings} == want
