"""The engine's address index of in-flight buffers and its sparse clocks (issue 14), both builds."""
from __future__ import annotations

import random

import pytest

from sanitizer.rules.driver import compiled_available, load_engine
from sanitizer.rules.findings import FindingSink

ENGINES = ["interpreted", "compiled"] if compiled_available()[0] else ["interpreted"]


class _Op:
    def __init__(self, bufs):
        self.bufs = bufs
        self.index_keys = None


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("seed,n,spread", [(1, 300, 1 << 16), (2, 6000, 1 << 30), (3, 6000, 1 << 12)])
def test_overlap_queries_match_brute_force(engine, seed, n, spread):
    """Random ranges of mixed lengths (empty ones too), 6,000 of them so that length classes pass
    the size where they become SortedLists, half removed again: every query returns exactly the
    buffers a linear scan finds."""
    eng = load_engine(engine)[0]
    rng = random.Random(seed)
    index = eng.BufferIndex()
    live = []
    for _ in range(n):
        lo = rng.randrange(spread)
        length = rng.choice((0, 1, 64, 4096, rng.randrange(1 << 20), 1 << 28))
        op = _Op([(lo, lo + length, 1)] + ([(lo + 7, lo + 7 + rng.randrange(100), 2)] if rng.random() < 0.3 else []))
        index.add(op)
        live.append(op)
    rng.shuffle(live)
    for op in live[: n // 2]:
        index.remove(op)
        assert op.index_keys is None
    live = live[n // 2:]
    assert len(index) == sum(len(op.bufs) for op in live)
    for _ in range(300):
        qlo = rng.randrange(spread)
        qhi = qlo + rng.choice((1, 16, 4096, 1 << 20))
        got = sorted((k[0], k[2], k[3], id(k[4])) for k in index.overlapping(qlo, qhi))
        want = sorted((lo, hi, acc, id(op)) for op in live for lo, hi, acc in op.bufs if lo < qhi and qlo < hi)
        assert got == want


@pytest.mark.parametrize("engine", ENGINES)
def test_clocks_stay_sparse_when_the_host_knows_every_stream(engine):
    """2,000 streams, a device-wide sync, then work on each again: a dense implementation would
    copy the host's 2,000 entries into every stream clock (4,000,000 entries)."""
    eng = load_engine(engine)[0]
    if engine == "compiled":
        import sanitizer.order.clocks as clocks_mod

        assert clocks_mod.__file__.endswith(".so")
        clocks = clocks_mod.StreamClocks()
    else:
        clocks = eng.StreamClocks()  # the interpreted clocks the interpreted engine imported
        assert type(clocks).__module__ != "sanitizer.order.clocks" or not hasattr(type(clocks), "__pyx_vtable__")
    for s in range(2000):
        clocks.enqueue(s)
    clocks.sync_device()
    for s in range(2000):
        clocks.enqueue(s)
        clocks.record(("e", s), s)
    assert len(clocks.host) == 2000
    assert sum(len(c) for c in clocks.streams.values()) == 2000
    # each event's stored clock: its stream's own count, over a base shared until that stream waits
    bases = {id(base): base for base, _, _ in clocks.events.values()}
    assert len(bases) == 2000 and sum(len(b) for b in bases.values()) == 2000
    # what the host knows still counts for every stream
    assert clocks.knows(5, 7) == 1 and clocks.knows(7, 7) == 2


@pytest.mark.parametrize("engine", ENGINES)
def test_stored_clocks_share_a_base_until_the_stream_learns(engine):
    """Events recorded on a stream between two of its waits share one copy of its clock, each with
    its own count on top; a wait that teaches the stream something starts a new copy and leaves the
    old ones as they were; what a stored clock stands for reaches the streams that wait on it."""
    eng = load_engine(engine)[0]
    if engine == "compiled":
        import sanitizer.order.clocks as clocks_mod

        clocks = clocks_mod.StreamClocks()
    else:
        clocks = eng.StreamClocks()
    clocks.enqueue(1)
    clocks.record("a", 1)
    clocks.enqueue(0)
    clocks.wait(0, "a")                      # stream 0 learns 1:1
    clocks.record("e1", 0)
    clocks.enqueue(0)
    clocks.record("e2", 0)
    (b1, s1, c1), (b2, s2, c2) = clocks.events["e1"], clocks.events["e2"]
    assert b1 is b2 and (s1, c1, s2, c2) == (0, 1, 0, 2)
    clocks.enqueue(1)
    clocks.record("b", 1)
    clocks.wait(0, "b")                      # stream 0 learns 1:2: a new base from now on
    clocks.record("e3", 0)
    b3 = clocks.events["e3"][0]
    assert b3 is not b1 and b3[1] == 2 and b1[1] == 1
    clocks.wait(5, "e1")
    assert clocks.knows(5, 0) == 1 and clocks.knows(5, 1) == 1
    clocks.wait(6, "e2")
    assert clocks.knows(6, 0) == 2 and clocks.knows(6, 1) == 1
    clocks.wait(7, "e3")
    assert clocks.knows(7, 0) == 2 and clocks.knows(7, 1) == 2
    assert clocks.host_learns(clocks.events["e2"]) == [0, 1] and clocks.knows(9, 0) == 2


@pytest.mark.parametrize("engine", ENGINES)
def test_range_index_matches_brute_force(engine):
    """Live blocks of every size, one of them huge, 6,000 in all, half freed again."""
    eng = load_engine(engine)[0]
    rng = random.Random(7)
    # the engine's own (sanitizer.rules.intervals, compiled or interpreted with it)
    sink = FindingSink()
    index = type(eng.RankAnalyzer("r", 0, sink, eng.CollectiveMatcher(sink, enabled=False)).live_ranges)()
    live = []
    for i in range(6000):
        lo = rng.randrange(1 << 32)
        hi = lo + (1 << 31 if i == 0 else rng.choice((0, 512, 4096, rng.randrange(1 << 22))))
        item = object()
        index.add(lo, hi, item)
        live.append((lo, hi, item))
    rng.shuffle(live)
    for lo, hi, item in live[:3000]:
        index.remove(lo, hi, item)
    live = live[3000:]
    index.remove(1, 2, object())  # unknown: nothing happens
    assert len(index) == 3000
    for _ in range(300):
        qlo = rng.randrange(1 << 32)
        qhi = qlo + rng.choice((1, 4096, 1 << 20))
        got = sorted((lo, hi, id(x)) for lo, hi, x in index.overlapping(qlo, qhi))
        want = sorted((lo, hi, id(x)) for lo, hi, x in live if lo < qhi and qlo < hi)
        assert got == want


class _Ev:
    op = site = stack = None


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_lazy_in_flight_index_answers_as_an_eager_one(engine, seed):
    """InFlight indexes its ops only when a query needs them: every query, after any mix of
    enqueues and retirements (past a compaction), lists the same entries
    in the same order as an index that took every op at enqueue and dropped it at retirement (the
    order of overlaps is the order of findings)."""
    eng = load_engine(engine)[0]
    rng = random.Random(seed)
    fl = eng.InFlight()
    eager = eng.BufferIndex()
    in_flight = []
    epoch = 0
    for step in range(3000):
        if rng.random() < 0.5:
            epoch += 1
            bufs = [(lo, lo + rng.choice((0, 1, 512, 4096, 1 << 20, rng.randrange(1 << 16))), rng.choice((1, 2, 3)))
                    for lo in (rng.randrange(1 << 22) for _ in range(rng.randrange(0, 4)))]
            op = eng.Op("launch", 1, bufs, step, None, _Ev())
            op.epoch = epoch
            fl.push(op)
            eager.add(op)
            eager_keys = op.index_keys
            op.index_keys = None  # the lazy one keeps its own entries
            in_flight.append((op, eager_keys))
        elif rng.random() < 0.3 and in_flight:
            known = rng.randrange(in_flight[0][0].epoch, epoch + 1)
            gone = fl.retire_upto(known)
            assert [op for op, _ in in_flight if op.epoch <= known] == gone
            for op, keys in in_flight[:len(gone)]:
                lazy_keys, op.index_keys = op.index_keys, keys
                eager.remove(op)
                op.index_keys = lazy_keys
            in_flight = in_flight[len(gone):]
        elif rng.random() < 0.2:
            lo = rng.randrange(1 << 22)
            hi = lo + rng.choice((1, 4096, 1 << 20))
            got = [(k[0], k[2], k[3], id(k[4])) for k in fl.by_address().overlapping(lo, hi)]
            want = [(k[0], k[2], k[3], id(k[4])) for k in eager.overlapping(lo, hi)]
            assert got == want
            assert len(fl.by_address()) == len(eager)
    assert fl.base > 0  # the list of ops was compacted on the way


# ------------------------------------------------------------------ live graphs (issue 21)

def _graphs_trace(rng: random.Random, events: int = 600) -> list[dict]:
    """CUDA graphs captured, replayed and freed in any order (several live at once, buffers of one
    graph overlapping another's), allocations freed inside and outside their buffers."""
    out: list[dict] = []
    base = 1 << 30
    graphs: list[int] = []
    live: dict[int, int] = {}
    gid = bid = 0
    for _ in range(events):
        kind = rng.choice(["capture", "capture", "replay", "graph_free", "alloc", "alloc", "free", "free"])
        if kind == "capture":
            gid += 1
            # graphs sharing one pool (SGLang's decode graphs) or each its own (pool absent)
            pool = rng.choice(("graph-pool:(0, 1)", None))
            out.append({"ev": "graph_begin", "graph": gid, "stream": 1, **({"pool": pool} if pool else {})})
            for _ in range(rng.randrange(1, 5)):
                lo = base + rng.randrange(1 << 16)
                if rng.random() < 0.3:  # allocated during the capture, from the graph's pool or another
                    bid += 1
                    live[bid] = lo
                    out.append({"ev": "alloc", "id": bid, "addr": lo, "size": rng.choice((64, 1024)), "stream": 1,
                                "pool": rng.choice((pool or f"graph:{gid}", "symm")), "site": f"c.py:{bid % 3}:f"})
                    continue
                out.append({"ev": "launch", "stream": 1, "op": "k", rng.choice(("reads", "writes")):
                            [[lo, rng.choice((64, 512, 4096))]]})
            out.append({"ev": "graph_end", "graph": gid, "stream": 1})
            graphs.append(gid)
        elif kind == "replay" and graphs:
            out.append({"ev": "graph_replay", "graph": rng.choice(graphs), "stream": 1})
        elif kind == "graph_free" and graphs:
            out.append({"ev": "graph_free", "graph": graphs.pop(rng.randrange(len(graphs)))})
        elif kind == "alloc":
            bid += 1
            lo = base + rng.randrange(1 << 16)
            live[bid] = lo
            out.append({"ev": "alloc", "id": bid, "addr": lo, "size": rng.choice((64, 1024)), "stream": 1,
                        "pool": "default", "site": f"m.py:{bid % 4}:f"})
        elif kind == "free" and live:
            k = rng.choice(sorted(live))
            del live[k]
            out.append({"ev": "free", "id": k})
    return out


def test_graph_frees_ask_only_the_graphs_they_overlap(tmp_path, monkeypatch):
    """graph-buffer-released findings, in order, are those of asking every live graph on every
    free (the interpreted engine with _graph_hits as its definition)."""
    import json

    from sanitizer.rules.driver import analyze

    paths = []
    for seed in range(25):
        p = tmp_path / f"{seed}.jsonl"
        lines = [{"hazsan": 1, "rank": 0, "world_size": 1}, *_graphs_trace(random.Random(seed))]
        p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
        paths.append(p)

    def run(path, engine):
        a = analyze([path], engine=engine)
        assert not a.errors, a.errors[:3]
        return [f.to_dict() for f in a.findings], a.summary["by_rule"]

    got = [{e: run(p, e) for e in ENGINES} for p in paths]
    eng = load_engine("interpreted")[0]

    def every_graph(self, lo, hi, pool, block):
        released = shared = None
        for g in self.live_graphs:
            hits = None
            for blo, bhi, op in g.reserved.overlapping(lo, hi):
                if hits is None:
                    hits = {}
                eng.widen(hits, op, max(lo, blo), min(hi, bhi))
            if hits is None and g.foreign_reserved is not None:
                for blo, bhi, op in g.foreign_reserved.overlapping(lo, hi):
                    if hits is None:
                        hits = {}
                    eng.widen(hits, op, max(lo, blo), min(hi, bhi))
            if hits is None:
                continue
            if self._shares_pool(g, pool, block):
                shared = {**(shared or {}), **hits}
            else:
                released = {**(released or {}), **hits}
        return released, shared

    monkeypatch.setattr(eng.RankAnalyzer, "_graph_hits", every_graph)
    for seed, (p, g) in enumerate(zip(paths, got)):
        for e in ENGINES[1:]:
            assert g[e] == g[ENGINES[0]], f"seed {seed}: {e} differs"
        assert run(p, "interpreted") == g[ENGINES[0]], f"seed {seed}: asking every live graph differs"
    assert sum(g[ENGINES[0]][1].get("graph-buffer-released", 0) for g in got) > 25
