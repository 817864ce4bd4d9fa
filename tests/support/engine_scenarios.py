"""Random multi-rank trace scenarios, and the check that the engine agrees with the brute-force
reference on one (tests/support/reference_model.py). Shared by the rules tests
(test_engine_property.py, test_engine_streams.py, test_engine_dispatch.py)."""
from __future__ import annotations

import json
import os
import random
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

from reference_model import SEVERITY, Semantics, reference_findings

# How the engine must read docs/ordering-and-rules.md where the text admits two readings (see Semantics). The
# defaults follow the text literally; the lead decided (issue 2) that in successor mode a read
# needs local completion only (a locally complete collective's result is final; peers may still
# read my window, so writes and reuse wait for a later collective).
SEMANTICS = Semantics(strict_reads=False)

PAIR_RULES = ("reuse-in-flight", "free-in-flight", "unordered-access", "graph-buffer-released")

# The address space: [BASE, BASE + 512) in 16-byte units. Per rank, comm c0's window region
# starts at BASE + 256 and c1's at BASE + 384 (each may be shifted by 16 on a rank, so the same
# offsets sit at different addresses); collective buffers lie either wholly inside one window
# region or wholly in [BASE, BASE + 256), so "inside a window" is never a question of straddling.
# Allocations and launches land anywhere and straddle freely.
BASE = 1 << 20
UNIT = 16
WINDOW_REGION = {"c0": 256, "c1": 384}
WINDOW_SIZE = 96
COMMS = ("c0", "c1")
STREAMS = ("s0", "s1", "s2")
SITES = ("model.py:10:forward", "comm.py:20:all_reduce", None)
# Host threads (issue 54, class 2): thread 0 is the main thread (lane "cpu"); the others are
# started (thread_start) or show up unannounced (a `thread` event only), each with lane "cpu@<K>".
THREAD_IDS = (7, 9)
SYNC_KEYS = ("future:1", "queue:2", "event:3")


@dataclass
class Scenario:
    ranks: list  # per rank, the list of event dicts (header excluded)
    peer_completion: str

    def __repr__(self) -> str:  # what hypothesis prints for a falsifying example
        text = [f"Scenario(peer_completion={self.peer_completion!r})"]
        for rank, events in enumerate(self.ranks):
            text.append(f"--- rank {rank}")
            text += [f"{i + 2:3d} {json.dumps(ev)}" for i, ev in enumerate(events)]
        return "\n".join(text)

    def _repr_pretty_(self, printer, cycle) -> None:  # hypothesis's printer: one event a line
        printer.text(repr(self))


class RankTraceBuilder:
    """Draws one rank's events, keeping the state that makes the next event well-formed."""

    def __init__(self, draw, n_streams: int, n_threads: int = 1):
        self.draw = draw
        self.streams = STREAMS[:n_streams]
        # host threads: up to n_threads - 1 besides thread 0 (ids never reused)
        self.n_threads = n_threads
        self.cur = 0
        self.live_threads: list = [0]      # started or seen, not ended
        self.ended_threads: list = []
        self.fresh_threads = list(THREAD_IDS[:n_threads - 1])
        self.done_cids: list[int] = []     # colls some thread waited (another may wait them too)
        self.events: list[dict] = []
        self.shift = {c: draw(st.sampled_from([0, UNIT])) for c in COMMS}
        self.live_ids: list[int] = []
        self.pending_ids: list[int] = []   # freed after record_stream, free_done not seen yet
        self.record_streamed: set = set()  # blocks with a record_stream to another stream
        self.block_stream: dict = {}
        self.next_id = 0
        self.next_cid = 0
        self.seq = {c: 0 for c in COMMS}
        self.open_cids: list[int] = []     # colls that ran, no coll_done yet
        self.recorded: set = set()
        self.live_windows: set = set()
        self.live_graphs: list[str] = []
        self.next_graph = 0

    # -- value helpers --
    def stream(self):
        return self.draw(st.sampled_from(self.streams))

    def range_anywhere(self):
        k = self.draw(st.integers(0, 31))
        m = self.draw(st.integers(1, 8))
        return BASE + UNIT * k, UNIT * m

    def window_addr(self, comm):
        return BASE + WINDOW_REGION[comm] + self.shift[comm]

    def coll_buf(self, comm):
        region = self.draw(st.sampled_from(["own", "other", "outside"]))
        if region == "outside":
            k = self.draw(st.integers(0, 12))
            addr, size = BASE + UNIT * k, UNIT * self.draw(st.integers(1, 4))
        else:
            target = comm if region == "own" else next(c for c in COMMS if c != comm)
            addr = self.window_addr(target) + UNIT * self.draw(st.integers(0, 3))
            size = UNIT * self.draw(st.integers(1, 2))
        return {"addr": addr, "size": size, "access": self.draw(st.sampled_from(["r", "w", "rw"]))}

    # -- event makers --
    def launch(self, stream):
        reads = [list(self.range_anywhere()) for _ in range(self.draw(st.integers(0, 2)))]
        writes = [list(self.range_anywhere()) for _ in range(self.draw(st.integers(0, 2)))]
        return {"ev": "launch", "stream": stream, "reads": reads, "writes": writes, "op": "aten::mm"}

    def coll(self, stream, *, captured=False):
        comm = self.draw(st.sampled_from(COMMS))
        cid = self.next_cid
        self.next_cid += 1
        seq = self.seq[comm]
        self.seq[comm] += 1
        if not captured:
            self.open_cids.append(cid)
        bufs = [self.coll_buf(comm) for _ in range(self.draw(st.integers(1, 3)))]
        return {"ev": "coll", "cid": cid, "comm": comm, "seq": seq, "op": "all_reduce",
                "stream": stream, "bufs": bufs}

    def lane(self, thread):
        return "cpu" if thread == 0 else f"cpu@{thread}"

    def thread_kinds(self) -> list[str]:
        if self.n_threads == 1:
            return []
        kinds = []
        if self.fresh_threads:
            kinds += ["thread_start"] * 2 + ["thread_unseen"]
        if len(self.live_threads) > 1:
            kinds += ["thread_switch"] * 4
        if self.cur != 0:
            kinds += ["thread_end"] * 2
        if self.ended_threads:
            kinds += ["thread_join"] * 3
        kinds += ["lane_launch"] * 3 + ["release"] * 2 + ["acquire"] * 2 + ["lane_sync", "device_sync"]
        if self.done_cids:
            kinds += ["coll_done_again"]
        return kinds

    def available(self) -> list[str]:
        kinds = ["alloc"] * 4 + ["launch"] * 3 + ["coll"] * 3 + ["handoff"] * 2 + ["record", "sync", "capture", "noise"]
        kinds += self.thread_kinds()
        if self.live_ids:
            kinds += ["free"] * 4 + ["record_stream"] * 2
        if self.pending_ids:
            kinds += ["free_done"] * 2
        if self.recorded:
            kinds += ["wait"] * 2
        if self.open_cids:
            kinds += ["coll_done", "coll_observed"]
        if self.live_graphs:
            kinds += ["replay"] * 2 + ["graph_free"]
        kinds += ["window_free" if self.live_windows else "window"]
        return kinds

    def step(self) -> None:
        kind = self.draw(st.sampled_from(self.available()))
        emit = self.events.append
        if kind == "alloc":
            addr, size = self.range_anywhere()
            # (with host threads, host tensors too: allocated on "cpu", as capture writes them)
            stream = self.stream() if self.n_threads == 1 else self.draw(st.sampled_from([*self.streams, "cpu"]))
            ev = {"ev": "alloc", "id": self.next_id, "addr": addr, "size": size, "stream": stream,
                  "pool": self.draw(st.sampled_from(["default", "symm"]))}
            site = self.draw(st.sampled_from(SITES))
            if site is not None:
                ev["site"] = site
            self.live_ids.append(self.next_id)
            self.block_stream[self.next_id] = ev["stream"]
            self.next_id += 1
            emit(ev)
        elif kind == "free":
            block = self.draw(st.sampled_from(self.live_ids))
            self.live_ids.remove(block)
            if block in self.record_streamed:
                self.pending_ids.append(block)
            emit({"ev": "free", "id": block})
        elif kind == "record_stream":
            block, stream = self.draw(st.sampled_from(self.live_ids)), self.stream()
            if stream != self.block_stream[block]:  # to its own stream: a no-op, no free_done
                self.record_streamed.add(block)
            emit({"ev": "record_stream", "id": block, "stream": stream})
        elif kind == "free_done":
            block = self.draw(st.sampled_from(self.pending_ids))
            self.pending_ids.remove(block)
            emit({"ev": "free_done", "id": block})
        elif kind == "launch":
            emit(self.launch(self.stream()))
        elif kind == "coll":
            emit(self.coll(self.stream()))
        elif kind == "coll_done":
            cid = self.draw(st.sampled_from(self.open_cids))
            self.open_cids.remove(cid)
            self.done_cids.append(cid)
            emit({"ev": "coll_done", "cid": cid})
        elif kind == "coll_done_again":   # another thread waits the same collective
            emit({"ev": "coll_done", "cid": self.draw(st.sampled_from(self.done_cids))})
        elif kind == "thread_start":
            thread = self.fresh_threads.pop(0)
            self.live_threads.append(thread)
            emit({"ev": "thread_start", "thread": thread, "lane": self.lane(thread)})
            if self.draw(st.booleans()):   # the new thread runs at once
                self.cur = thread
                emit({"ev": "thread", "thread": thread})
        elif kind == "thread_unseen":      # a thread started before capture: its first event
            thread = self.fresh_threads.pop(0)
            self.live_threads.append(thread)
            self.cur = thread
            emit({"ev": "thread", "thread": thread, **({"lane": self.lane(thread)} if self.draw(st.booleans()) else {})})
        elif kind == "thread_switch":
            self.cur = self.draw(st.sampled_from([t for t in self.live_threads if t != self.cur]))
            emit({"ev": "thread", "thread": self.cur})
        elif kind == "thread_end":         # the thread's last event; another one runs on
            thread = self.cur
            self.live_threads.remove(thread)
            self.ended_threads.append(thread)
            emit({"ev": "thread_end", "thread": thread})
            self.cur = self.draw(st.sampled_from(self.live_threads))
            emit({"ev": "thread", "thread": self.cur})
        elif kind == "thread_join":
            emit({"ev": "thread_join", "thread": self.draw(st.sampled_from(self.ended_threads))})
        elif kind == "lane_launch":        # CPU work of the current thread, on its own lane
            emit(self.launch(self.lane(self.cur)))
        elif kind == "release":
            emit({"ev": "release", "sync": self.draw(st.sampled_from(SYNC_KEYS))})
        elif kind == "acquire":
            emit({"ev": "acquire", "sync": self.draw(st.sampled_from(SYNC_KEYS))})
        elif kind == "lane_sync":          # its own lane or another thread's (no wait for a thread)
            lanes = [self.lane(t) for t in (*self.live_threads, *self.ended_threads)]
            emit({"ev": "sync", "stream": self.draw(st.sampled_from(lanes))})
        elif kind == "device_sync":
            emit({"ev": "sync"})
        elif kind == "coll_observed":
            # capture saw it finish (issue 54): the cid stays open, as the program may wait it later
            cid = self.draw(st.sampled_from(self.open_cids))
            emit({"ev": "coll_done", "cid": cid, "observed": True})
        elif kind == "record":
            event = self.draw(st.sampled_from(["e0", "e1", "e2"]))
            self.recorded.add(event)
            emit({"ev": "record", "event": event, "stream": self.stream()})
        elif kind == "handoff":  # the usual cross-stream ordering: record on one, wait on another
            event = self.draw(st.sampled_from(["e0", "e1", "e2"]))
            self.recorded.add(event)
            emit({"ev": "record", "event": event, "stream": self.stream()})
            emit({"ev": "wait", "event": event, "stream": self.stream()})
        elif kind == "wait":
            event = self.draw(st.sampled_from(sorted(self.recorded)))
            emit({"ev": "wait", "event": event, "stream": self.stream()})
        elif kind == "sync":
            how = self.draw(st.sampled_from(["device", "stream", "event"] if self.recorded else ["device", "stream"]))
            if how == "device":
                emit({"ev": "sync"})
            elif how == "stream":
                emit({"ev": "sync", "stream": self.stream()})
            else:
                emit({"ev": "sync", "event": self.draw(st.sampled_from(sorted(self.recorded)))})
        elif kind == "capture":
            graph, stream = f"g{self.next_graph}", self.stream()
            self.next_graph += 1
            # one private pool shared by graphs (SGLang's decode graphs), or the graph's own
            pool = self.draw(st.sampled_from(["graph-pool", None]))
            emit({"ev": "graph_begin", "graph": graph, "stream": stream, **({"pool": pool} if pool else {})})
            forked = set()   # side streams that waited on the capture stream (a fork)
            for _ in range(self.draw(st.integers(1, 3))):
                what = self.draw(st.sampled_from(["coll", "launch", "alloc", "free", "side"]))
                if what == "side":
                    # work on another stream inside the capture (DeepSeek's shared-expert stream):
                    # forked by a wait on an event the capture stream records, or not ordered at
                    # all; joined back or left for the replay's end to join (issue 50, item 6)
                    side = self.draw(st.sampled_from([x for x in self.streams if x != stream] or [stream]))
                    if side not in forked and self.draw(st.booleans()):
                        emit({"ev": "record", "event": f"{graph}-fork", "stream": stream})
                        emit({"ev": "wait", "event": f"{graph}-fork", "stream": side})
                        forked.add(side)
                    emit(self.launch(side))
                    if self.draw(st.booleans()):
                        emit({"ev": "record", "event": f"{graph}-join", "stream": side})
                        emit({"ev": "wait", "event": f"{graph}-join", "stream": stream})
                    continue
                if what == "alloc":  # from the graph's pool, or the window pool (SGLang's paused scope)
                    addr, size = self.range_anywhere()
                    emit({"ev": "alloc", "id": self.next_id, "addr": addr, "size": size, "stream": stream,
                          "pool": self.draw(st.sampled_from([pool or f"graph:{graph}", "symm"])),
                          "site": "mhc.py:7:hc_pre"})
                    self.live_ids.append(self.next_id)
                    self.block_stream[self.next_id] = stream
                    self.next_id += 1
                elif what == "free" and self.live_ids:
                    block = self.draw(st.sampled_from(self.live_ids))
                    self.live_ids.remove(block)
                    if block in self.record_streamed:
                        self.pending_ids.append(block)
                    emit({"ev": "free", "id": block})
                else:
                    emit(self.coll(stream, captured=True) if what == "coll" else self.launch(stream))
            emit({"ev": "graph_end", "graph": graph, "stream": stream})
            self.live_graphs.append(graph)
        elif kind == "replay":
            emit({"ev": "graph_replay", "graph": self.draw(st.sampled_from(self.live_graphs)),
                  "stream": self.stream()})
        elif kind == "graph_free":
            graph = self.draw(st.sampled_from(self.live_graphs))
            self.live_graphs.remove(graph)
            emit({"ev": "graph_free", "graph": graph})
        elif kind == "window":
            comm = self.draw(st.sampled_from(COMMS))
            self.live_windows.add(comm)
            emit({"ev": "window", "addr": self.window_addr(comm), "size": WINDOW_SIZE, "comm": comm})
        elif kind == "window_free":
            comm = self.draw(st.sampled_from(sorted(self.live_windows)))
            self.live_windows.discard(comm)
            emit({"ev": "window_free", "addr": self.window_addr(comm), "comm": comm})
        elif kind == "noise":
            emit(self.draw(st.sampled_from([
                {"ev": "step", "n": 1, "phase": "decode", "tokens": 8},
                {"ev": "segment", "addr": BASE, "size": 1 << 20, "pool": "default"},
                {"ev": "scope", "name": "symm", "enter": True, "comm": "c0"},
                {"ev": "scope", "name": "symm", "enter": False},
            ])))


@st.composite
def rank_events(draw, n_streams: int, n_threads: int = 1) -> list[dict]:
    builder = RankTraceBuilder(draw, n_streams, n_threads)
    for comm in COMMS:  # windows are usually registered up front, as NCCL does at start-up
        if draw(st.integers(0, 3)) > 0:
            builder.live_windows.add(comm)
            builder.events.append({"ev": "window", "addr": builder.window_addr(comm), "size": WINDOW_SIZE,
                                   "comm": comm})
    for _ in range(draw(st.integers(0, 40))):
        builder.step()
    return builder.events


@st.composite
def scenarios(draw, max_ranks: int = 3) -> Scenario:
    n_ranks = draw(st.integers(1, max_ranks))
    n_streams = draw(st.integers(1, 3))
    # host threads in about half the scenarios (1 to 3 per rank); the rest as before
    n_threads = draw(st.sampled_from([1, 1, 2, 3]))
    ranks = [draw(rank_events(n_streams, n_threads)) for _ in range(n_ranks)]
    return Scenario(ranks, draw(st.sampled_from(["local", "successor"])))


# ---------------------------------------------------------------- comparison helpers

def write_traces(directory: Path, scenario: Scenario) -> list[Path]:
    paths = []
    for rank, events in enumerate(scenario.ranks):
        header = {"hazsan": 1, "rank": rank, "world_size": len(scenario.ranks), "device": f"cuda:{rank}"}
        path = directory / f"rank{rank}.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in [header, *events]))
        paths.append(path)
    return paths


def identity(f) -> tuple:
    """What must match between engine and reference; works for both kinds of finding object."""
    if f.rule in PAIR_RULES:
        op_line = f.op.line if hasattr(getattr(f, "op", None), "line") else f.op_line
        return (f.rule, f.rank, f.line, op_line)
    if f.rule == "transient-in-window":
        return (f.rule, f.rank, f.site, f.count, f.bytes)
    return (f.rule, f.rank, f.line)


def overlaps_by_identity(findings) -> dict:
    out = defaultdict(list)
    for f in findings:
        if f.rule in PAIR_RULES:
            out[identity(f)].append(tuple(f.overlap) if f.overlap is not None else None)
    return out


def _backends() -> list:
    """Both builds of the one engine: the interpreted source and its compiled form. The compiled
    one is required where HAZSAN_REQUIRE_COMPILED is set (CI): there the test fails, not skips."""
    from sanitizer.rules.driver import REQUIRE_ENV, compiled_available

    ok, why = compiled_available()
    if not ok and os.environ.get(REQUIRE_ENV):
        raise RuntimeError(f"{REQUIRE_ENV} is set: {why}")
    return ["interpreted", "compiled"] if ok else ["interpreted"]


BACKENDS = _backends()


def analyze_scenario(scenario: Scenario, backend=None):
    from sanitizer.rules.driver import analyze

    with tempfile.TemporaryDirectory() as tmp:
        paths = write_traces(Path(tmp), scenario)
        # max_per_group=0: list every finding (the default keeps 100 per rule and call site).
        result = analyze([str(p) for p in paths], peer_completion=scenario.peer_completion,
                         max_per_group=0, engine=backend)
    if backend is not None:
        assert result.summary["engine"] == backend
    return result


def check_against_reference(scenario: Scenario, semantics: Semantics = SEMANTICS, backend=None,
                            expected=None) -> None:
    """The engine (build `backend`) against the reference model; `expected`, the reference's
    findings computed once, where one scenario is checked against several builds."""
    result = analyze_scenario(scenario, backend)
    if expected is None:
        expected = reference_findings(scenario.ranks, peer_completion=scenario.peer_completion,
                                      semantics=semantics)

    got_ids, want_ids = {identity(f) for f in result.findings}, {identity(f) for f in expected}
    assert got_ids == want_ids, (
        f"engine only: {sorted(got_ids - want_ids, key=str)}\nreference only: {sorted(want_ids - got_ids, key=str)}"
    )
    for f in result.findings:
        assert f.severity == SEVERITY[f.rule], (f.rule, f.severity)
    # The overlapping range, wherever one identity names a single finding on both sides.
    got_ov, want_ov = overlaps_by_identity(result.findings), overlaps_by_identity(expected)
    for key, want in want_ov.items():
        if len(want) == 1 and len(got_ov[key]) == 1:
            assert got_ov[key][0] == want[0], (key, got_ov[key][0], want[0])
    summary = result.summary
    assert not result.errors and not summary.get("errors") and not summary.get("malformed"), result.errors
    assert summary["ranks"] == len(scenario.ranks), summary
    assert summary["events"] == sum(len(events) for events in scenario.ranks), summary
    assert dict(summary["by_rule"]) == dict(Counter(f.rule for f in result.findings)), summary


# many_streams' address space: apart from the scenarios' (BASE), as where it was written
MANY_STREAMS_BASE = 1 << 32


def many_streams(seed: int, n_streams: int, n_events: int) -> list:
    """One rank's events over `n_streams` streams in a small address space: launches and
    collectives that overlap across streams, allocations and frees over them, record/wait edges,
    syncs of each kind, coll_done and record_stream/free_done, so that streams enter and leave
    the table of streams in flight many times."""
    rng = random.Random(seed)
    streams = [f"s{i}" for i in range(n_streams)]
    events = [{"ev": "window", "addr": MANY_STREAMS_BASE + 4096, "size": 2048, "comm": "tp"}]
    live, pending, open_cids, recorded = {}, [], [], []
    next_id = cid = seq = 0

    def rng_range():
        return [MANY_STREAMS_BASE + 16 * rng.randrange(512), 16 * rng.randrange(1, 9)]

    for _ in range(n_events):
        r = rng.random()
        s = rng.choice(streams)
        if r < 0.2:
            addr, size = rng_range()
            events.append({"ev": "alloc", "id": next_id, "addr": addr, "size": size, "stream": s, "pool": "p",
                           "site": f"m.py:{rng.randrange(4)}:f"})
            live[next_id] = s
            next_id += 1
        elif r < 0.3 and live:
            bid = rng.choice(sorted(live))
            stream = live.pop(bid)
            if rng.random() < 0.3:
                other = rng.choice(streams)
                events.append({"ev": "record_stream", "id": bid, "stream": other})
                if other != stream:
                    pending.append(bid)
            events.append({"ev": "free", "id": bid})
        elif r < 0.33 and pending:
            events.append({"ev": "free_done", "id": pending.pop(rng.randrange(len(pending)))})
        elif r < 0.6:
            events.append({"ev": "launch", "stream": s, "reads": [rng_range() for _ in range(rng.randrange(3))],
                           "writes": [rng_range() for _ in range(rng.randrange(2))]})
        elif r < 0.68:
            events.append({"ev": "coll", "cid": cid, "comm": "tp", "seq": seq, "op": "all_reduce", "stream": s,
                           "bufs": [{"addr": a, "size": n, "access": rng.choice("r w rw".split())}
                                    for a, n in (rng_range() for _ in range(rng.randrange(1, 3)))]})
            open_cids.append(cid)
            cid += 1
            seq += 1
        elif r < 0.8:
            event = f"e{rng.randrange(20)}"
            events.append({"ev": "record", "event": event, "stream": s})
            recorded.append(event)
            events.append({"ev": "wait", "event": rng.choice(recorded), "stream": rng.choice(streams)})
        elif r < 0.86:
            events.append({"ev": "sync", "stream": s})
        elif r < 0.89 and recorded:
            events.append({"ev": "sync", "event": rng.choice(recorded)})
        elif r < 0.9:
            events.append({"ev": "sync"})
        elif r < 0.93 and open_cids:
            events.append({"ev": "coll_done", "cid": open_cids.pop(rng.randrange(len(open_cids)))})
        elif r < 0.95 and open_cids:   # capture saw one finish; the program may still wait it
            events.append({"ev": "coll_done", "cid": open_cids[rng.randrange(len(open_cids))], "observed": True})
    return events
