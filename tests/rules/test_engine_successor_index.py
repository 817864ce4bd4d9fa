"""Successor mode's index (issue 14): a communicator whose collectives run on one stream with rising
seq is answered from an address index over a suffix of its waiting collectives; any other is
scanned by the definition itself. Both must give the same findings: random successor-mode traces
run with the index, and again with every communicator forced onto the scan."""
from __future__ import annotations

import json
import random

import pytest

from sanitizer.order.clocks import StreamClocks
from sanitizer.rules.driver import analyze, compiled_available, load_engine

ENGINES = ["interpreted", "compiled"] if compiled_available()[0] else ["interpreted"]
WIN = 1 << 32
WIN_SIZE = 1 << 16


def successor_trace(rng: random.Random, events: int = 400, mixed_comm: bool = False) -> list[dict]:
    """One rank: a window, blocks in it, launches on streams 1 and 2, collectives of `tp` on
    stream 9 (seq rising), of `ep` on stream 8 (or, with `mixed_comm`, sometimes on stream 1),
    completions, event hand-offs and syncs."""
    out = [{"ev": "window", "addr": WIN, "size": WIN_SIZE, "comm": "tp"},
           {"ev": "window", "addr": WIN + WIN_SIZE, "size": WIN_SIZE, "comm": "ep"}]
    live: dict[int, tuple] = {}
    next_id = cid = event = 0
    seq = {"tp": 0, "ep": 0}
    cids: list[int] = []

    def span():
        lo = WIN + rng.randrange(2 * WIN_SIZE - 256)
        return lo, rng.choice((16, 64, 256))

    for _ in range(events):
        kind = rng.choice(["alloc", "free", "launch", "launch", "coll", "coll", "coll_done", "handoff", "sync"])
        if kind == "alloc":
            next_id += 1
            lo, n = span()
            live[next_id] = (lo, n)
            out.append({"ev": "alloc", "id": next_id, "addr": lo, "size": n, "stream": rng.choice((1, 2)),
                        "pool": "symm", "site": f"m.py:{rng.randrange(5)}:f"})
        elif kind == "free" and live:
            bid = rng.choice(sorted(live))
            del live[bid]
            out.append({"ev": "free", "id": bid})
        elif kind == "launch":
            lo, n = span()
            key = rng.choice(("reads", "writes"))
            out.append({"ev": "launch", "stream": rng.choice((1, 2)), "op": "k", key: [[lo, n]]})
        elif kind == "coll":
            comm = rng.choice(("tp", "ep"))
            stream = 9 if comm == "tp" else (1 if mixed_comm and rng.random() < 0.3 else 8)
            cid += 1
            cids.append(cid)
            base = WIN if comm == "tp" else WIN + WIN_SIZE
            lo = base + rng.randrange(WIN_SIZE - 256)
            out.append({"ev": "coll", "cid": cid, "comm": comm, "seq": seq[comm], "op": "all_reduce",
                        "stream": stream, "site": "c.py:1:ar",
                        "bufs": [{"addr": lo, "size": rng.choice((64, 256)), "access": rng.choice(("r", "w", "rw"))}]})
            seq[comm] += 1
        elif kind == "coll_done" and cids:
            out.append({"ev": "coll_done", "cid": cids.pop(rng.randrange(len(cids)))})
        elif kind == "handoff":
            event += 1
            src, dst = rng.sample((1, 2, 8, 9), 2)
            out.append({"ev": "record", "event": event, "stream": src})
            out.append({"ev": "wait", "event": event, "stream": dst})
        elif kind == "sync":
            how = rng.random()
            out.append({"ev": "sync", "stream": rng.choice((1, 2, 8, 9))} if how < 0.8 else {"ev": "sync"})
    return out


def write(tmp_path, events) -> str:
    p = tmp_path / "rank0.jsonl"
    lines = [{"hazsan": 1, "rank": 0, "world_size": 1}, *events]
    p.write_bytes(b"\n".join(json.dumps(x).encode() for x in lines) + b"\n")
    return str(p)


def findings(path, engine):
    a = analyze([path], peer_completion="successor", engine=engine)
    assert not a.errors, a.errors
    return [f.to_dict() for f in a.findings], a.summary["by_rule"]


@pytest.fixture
def scan_only(monkeypatch):
    """Every communicator of the interpreted engine answered by the scan (the definition)."""
    eng = load_engine("interpreted")[0]
    push = eng.SuccessorWait.push

    def push_unordered(self, op):
        push(self, op)
        if self.ordered:
            self._unorder()

    def forced():
        monkeypatch.setattr(eng.SuccessorWait, "push", push_unordered)

    return forced


@pytest.mark.parametrize("mixed_comm", [False, True])
def test_index_answers_as_the_scan(tmp_path, scan_only, mixed_comm):
    paths = []
    for seed in range(40):
        d = tmp_path / str(seed)
        d.mkdir()
        paths.append(write(d, successor_trace(random.Random(seed), mixed_comm=mixed_comm)))
    with_index = [{e: findings(p, e) for e in ENGINES} for p in paths]
    scan_only()
    for seed, (path, got) in enumerate(zip(paths, with_index)):
        for e in ENGINES[1:]:
            assert got[e] == got[ENGINES[0]], f"seed {seed}: {e} differs"
        assert findings(path, "interpreted") == got[ENGINES[0]], f"seed {seed}: the scan differs"
    # the traces do collide with waiting collectives: the comparison is not between empty lists
    assert sum(got[ENGINES[0]][1].get("reuse-in-flight", 0) + got[ENGINES[0]][1].get("unordered-access", 0)
               for got in with_index) > 40


@pytest.mark.parametrize("engine", ENGINES)
def test_ordered_communicator_keeps_its_index_and_retires_a_prefix(engine):
    """One stream, rising seq: the index stays in use; a host sync of that stream leaves only the
    last collective waiting (it has no successor yet); a second stream turns the scan on."""
    eng = load_engine(engine)[0]
    sc = eng.SuccessorWait()
    clocks = StreamClocks(100, 100) if engine == "compiled" else eng.StreamClocks(100, 100)
    ops = []
    for i in range(3000):
        op = eng.Op("coll", 9, [], i + 2, None, _Ev())
        op.seq = i
        op.window_bufs = [(WIN + 64 * i, WIN + 64 * i + 64, 3)]
        op.epoch = clocks.enqueue(9)
        sc.push(op)
        ops.append(op)
    assert sc.ordered and len(sc) == 3000
    # stream 1 knows nothing of stream 9: every collective is not done for it
    hits = sc.not_done(clocks, 1, WIN, WIN + 64 * 3000, 2, None, None)
    assert len(hits) == 3000
    clocks.sync_stream(9)
    sc.retire(clocks.host)
    assert len(sc) == 1 and sc.colls[sc.start] is ops[-1]
    # a write now waits only for the last one (no successor yet), a read for none
    assert list(sc.not_done(clocks, 1, WIN, WIN + 64 * 3000, 2, None, None)) == [ops[-1]]
    assert sc.not_done(clocks, 1, WIN, WIN + 64 * 3000, 1, None, None) is None
    other = eng.Op("coll", 8, [], 9999, None, _Ev())
    other.seq = 5000
    other.window_bufs = [(WIN, WIN + 64, 3)]
    other.epoch = clocks.enqueue(8)
    sc.push(other)
    assert not sc.ordered


class _Ev:
    op = "all_reduce"
    site = None
    stack = None


# ------------------------------------------------------------------ many communicators (issue 21)

def many_comms_trace(rng: random.Random, comms: int = 8, events: int = 500) -> list[dict]:
    """One rank, `comms` communicators, each with a window of its own; collectives of each on a
    stream of their own (some on a shared stream, some unordered), launches on streams 1 and 2
    anywhere in the windows, completions, hand-offs, stream and device syncs."""
    out = [{"ev": "window", "addr": WIN + c * WIN_SIZE, "size": WIN_SIZE, "comm": f"c{c}"} for c in range(comms)]
    seq = [0] * comms
    cid = event = 0
    cids: list[int] = []
    streams = [1, 2] + [10 + c for c in range(comms)] + [7]
    for _ in range(events):
        kind = rng.choice(["launch", "launch", "coll", "coll", "coll_done", "handoff", "sync", "sync"])
        if kind == "launch":
            lo = WIN + rng.randrange(comms * WIN_SIZE - 256)
            key = rng.choice(("reads", "writes"))
            out.append({"ev": "launch", "stream": rng.choice((1, 2)), "op": "k", key: [[lo, rng.choice((16, 64, 256))]]})
        elif kind == "coll":
            c = rng.randrange(comms)
            stream = 10 + c if rng.random() < 0.8 else 7          # a shared stream now and then
            cid += 1
            cids.append(cid)
            lo = WIN + c * WIN_SIZE + rng.randrange(WIN_SIZE - 256)
            s = seq[c] if rng.random() < 0.9 else max(0, seq[c] - 2)   # a seq that does not rise: unordered
            out.append({"ev": "coll", "cid": cid, "comm": f"c{c}", "seq": s, "op": "all_reduce", "stream": stream,
                        "site": f"c.py:{c}:ar",
                        "bufs": [{"addr": lo, "size": rng.choice((64, 256)), "access": rng.choice(("r", "w", "rw"))}]})
            seq[c] += 1
        elif kind == "coll_done" and cids:
            out.append({"ev": "coll_done", "cid": cids.pop(rng.randrange(len(cids)))})
        elif kind == "handoff":
            event += 1
            src, dst = rng.sample(streams, 2)
            out.append({"ev": "record", "event": event, "stream": src})
            out.append({"ev": "wait", "event": event, "stream": dst})
        elif kind == "sync":
            out.append({"ev": "sync", "stream": rng.choice(streams)} if rng.random() < 0.85 else {"ev": "sync"})
    return out


@pytest.fixture
def ask_every_communicator(monkeypatch):
    """The interpreted engine's successor mode by its definition: every communicator asked on
    every access, in order, and every one retired at every sync (no SuccessorWaits.index, no
    SuccessorWaits.on)."""
    eng = load_engine("interpreted")[0]

    def not_done(self, clocks, stream, lo, hi, access, protected, hits):
        for sc in self.by_comm.values():
            hits = sc.not_done(clocks, stream, lo, hi, access, protected, hits)
        return hits

    def retire(self, host, learned, completions):
        for sc in self.by_comm.values():
            sc.retire(host)

    def forced():
        monkeypatch.setattr(eng.SuccessorWaits, "not_done", not_done)
        monkeypatch.setattr(eng.SuccessorWaits, "retire", retire)

    return forced


def test_many_communicators_ask_only_the_overlapping_ones(tmp_path, ask_every_communicator):
    """Findings, their order included, are those of asking every communicator every time."""
    paths = []
    for seed in range(30):
        d = tmp_path / str(seed)
        d.mkdir()
        paths.append(write(d, many_comms_trace(random.Random(seed), comms=2 + seed % 9)))
    got = [{e: findings(p, e) for e in ENGINES} for p in paths]
    ask_every_communicator()
    for seed, (path, g) in enumerate(zip(paths, got)):
        for e in ENGINES[1:]:
            assert g[e] == g[ENGINES[0]], f"seed {seed}: {e} differs"
        assert findings(path, "interpreted") == g[ENGINES[0]], f"seed {seed}: asking every communicator differs"
    assert sum(g[ENGINES[0]][1].get("reuse-in-flight", 0) + g[ENGINES[0]][1].get("unordered-access", 0)
               for g in got) > 30


@pytest.mark.parametrize("engine", ENGINES)
def test_a_communicator_leaves_the_sync_lists_when_nothing_of_it_waits(engine):
    """State, not speed: each waiting collective's window buffers are in SuccessorWaits.index and its
    communicator is listed under its stream; a sync of that stream retires it from both once a
    later collective is done, and a communicator with nothing waiting is listed nowhere."""
    from sanitizer.rules.findings import FindingSink
    from sanitizer.trace.events import Buf, Coll, CollDone, Sync, Window

    eng = load_engine(engine)[0]
    sink = FindingSink()
    an = eng.RankAnalyzer("r.jsonl", 0, sink, eng.CollectiveMatcher(sink, enabled=False), "successor")
    n = 300
    line = 1
    for c in range(n):
        line += 1
        an.feed(line, Window(addr=WIN + 128 * c, size=128, comm=f"c{c}"))
    for k in range(2):           # two collectives per communicator, each on a stream of its own
        for c in range(n):
            line += 1
            an.feed(line, Coll(cid=k * n + c, comm=f"c{c}", seq=k, op="all_reduce", stream=100 + c,
                               bufs=[Buf(addr=WIN + 128 * c + 64 * k, size=64, access="rw")]))
    waits = an.successor_waits
    assert len(waits.by_comm) == n and waits.index.count == 2 * n
    assert sorted(waits.on) == [100 + c for c in range(n)]
    for c in range(n):           # both complete: the first one has a successor and leaves
        line += 1
        an.feed(line, CollDone(cid=c))
        line += 1
        an.feed(line, CollDone(cid=n + c))
        line += 1
        an.feed(line, Sync(stream=100 + c))
        assert len(waits.by_comm[f"c{c}"]) == 1      # the last one waits for a successor
    assert waits.index.count == n and len(waits.on) == n
    assert not sink.findings
