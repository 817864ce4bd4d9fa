"""The C engine (sanitizer/rules/_fastengine.c via native.py) against the Python engine.

engine.RankAnalyzer states the algorithm; the native one must give identical findings (to_dict,
in order), summaries, errors and warnings on every trace, valid or not. Checked here by a
differential hypothesis test over random multi-rank traces (both peer-completion modes, windows,
graphs, record_stream, malformed lines of every kind), by hand-picked edge cases, by re-running
the engine's own test files with the native backend selected, and by memory and leak checks.

The extension is built by the install (hatch_build.py); when it is missing or older than its
source, the fixture below builds it in place first, and skips only where no C compiler works.
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sanitizer.rules import engine
from sanitizer.rules.findings import FindingSink
from sanitizer.trace.reader import TraceError, open_trace
from tracebuilder import Trace

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "sanitizer" / "rules" / "_fastengine.c"
PYTHON_ANALYZER = engine.RankAnalyzer


def _load_native():
    """native.py with the extension built from the current source (built here if needed)."""
    sys.path.insert(0, str(ROOT))
    try:
        import hatch_build
    finally:
        sys.path.remove(str(ROOT))
    so = hatch_build.extension_path(ROOT)
    if not so.exists() or so.stat().st_mtime < SOURCE.stat().st_mtime:
        if "sanitizer.rules._fastengine" in sys.modules:
            pytest.fail(f"{so} is stale and already imported: rebuild with `python hatch_build.py` first")
        try:
            hatch_build.build(ROOT)
        except hatch_build.NativeBuildError as exc:
            pytest.skip(f"no C engine accelerator here (cannot build it: {str(exc)[:300]})")
    from sanitizer.rules import native
    if not native.available:
        native = importlib.reload(native)
    assert native.available, native.reason
    return native


@pytest.fixture(scope="module")
def native():
    return _load_native()


@contextlib.contextmanager
def use_engine(name: str, native_mod, native_cls=None):
    """Select one backend for analyze(): through HAZSAN_ENGINE (what analyze() honours once it asks
    native.analyzer_class()) and through engine.RankAnalyzer (what it uses before that)."""
    saved_env = os.environ.get("HAZSAN_ENGINE")
    saved_native = native_mod.RankAnalyzer
    os.environ["HAZSAN_ENGINE"] = name
    if native_cls is not None:
        native_mod.RankAnalyzer = native_cls
    engine.RankAnalyzer = native_mod.RankAnalyzer if name == "native" else PYTHON_ANALYZER
    try:
        yield
    finally:
        engine.RankAnalyzer = PYTHON_ANALYZER
        native_mod.RankAnalyzer = saved_native
        if saved_env is None:
            os.environ.pop("HAZSAN_ENGINE", None)
        else:
            os.environ["HAZSAN_ENGINE"] = saved_env


class _RawLines:
    """A TraceFile whose batches() are the native analyzer's raw line batches (read_batches), so
    that analyze() drives the raw-line path whatever it calls."""

    def __init__(self, trace, analyzer):
        self._trace, self._analyzer = trace, analyzer

    def batches(self, size=4096):
        return self._analyzer.read_batches(size)

    def __getattr__(self, name):
        return getattr(self._trace, name)


class Spy:
    """Counts the analyzers each backend builds, to prove which one ran; `raw` makes them read raw
    lines (read_batches) instead of parsed events."""

    def __init__(self, native_mod, raw: bool):
        self.made = []
        spy = self

        class SpyNative(native_mod.RankAnalyzer):
            def __init__(self, trace, *a, **kw):
                super().__init__(trace, *a, **kw)
                spy.made.append(type(self))
                if raw:
                    # read_batches reads self.trace's stream, so it is given the real TraceFile
                    real = self.trace
                    self.read_batches = real.line_batches
                    self.trace = _RawLines(real, self)

        self.cls = SpyNative


def outcome(analysis) -> dict:
    """Everything `hazsan check` can print, as plain data."""
    return {
        "findings": [f.to_dict() for f in analysis.findings],
        "summary": analysis.summary,
        "errors": [str(e) for e in analysis.errors],
        "warnings": list(analysis.warnings),
        "exit": (analysis.exit_code("error"), analysis.exit_code("warning")),
    }


def _analyze(paths, **kw) -> dict:
    try:
        return outcome(engine.analyze(paths, **kw))
    except Exception as exc:  # the engines must fail alike too (e.g. an unhashable "ev" value)
        return {"raised": type(exc).__name__, "message": str(exc)}


@contextlib.contextmanager
def line_scanner(native_mod, enabled: bool):
    """The C line scanner (raw lines read straight into the engine, orjson only for the lines it
    leaves) switched on or off for the duration."""
    was = native_mod._fastengine._scanner()[0]
    native_mod._fastengine._scanner(enabled)
    try:
        yield
    finally:
        native_mod._fastengine._scanner(was)


def scan_counts(native_mod) -> tuple[int, int]:
    """(lines the C scanner took, lines it left to orjson) so far in this process."""
    return native_mod._fastengine._scanner()[1:]


def both(native_mod, paths, **kw):
    """(Python outcome, native outcome); the native one from parsed events, from raw lines through
    the C line scanner and from raw lines through orjson alone, which must all agree too."""
    with use_engine("python", native_mod):
        want = _analyze(paths, **kw)
    got = []
    for raw, scanner in ((False, False), (True, True), (True, False)):
        spy = Spy(native_mod, raw)
        with use_engine("native", native_mod, spy.cls), line_scanner(native_mod, scanner):
            got.append(_analyze(paths, **kw))
        assert spy.made, "the native backend did not run"
    assert got[0] == got[2], "native: parsed events and raw lines disagree"
    assert got[1] == got[2], "native: raw lines with and without the C line scanner disagree"
    return want, got[0]


def write_ranks(tmp: Path, ranks: list[list], tag: str = "") -> list[Path]:
    """Rank files from lists of events (dicts, or raw bytes for a line written as is)."""
    paths = []
    for r, events in enumerate(ranks):
        lines = [orjson.dumps({"hazsan": 1, "rank": r, "world_size": len(ranks)})]
        lines += [ev if isinstance(ev, bytes) else orjson.dumps(ev) for ev in events]
        p = tmp / f"{tag}rank{r}.jsonl"
        p.write_bytes(b"\n".join(lines) + b"\n")
        paths.append(p)
    return paths


# ------------------------------------------------------------------ random traces

SLOT = 16
BASE = 0x10000
STREAMS = ["s0", "s1", "s2", 0, 1]
COMMS = ["c0", "c1"]
KINDS = [
    "alloc", "alloc", "alloc", "free", "free", "launch", "launch", "launch", "coll", "coll",
    "coll_done", "record", "wait", "wait", "sync", "record_stream", "free_done", "window",
    "window_free", "graph_begin", "graph_end", "graph_replay", "graph_free", "step", "scope",
    "segment", "segment_free", "dropped", "hook_error", "unknown",
]
# Values that break a field in every way a handler checks: missing, mistyped, unhashable, bool.
BAD_VALUES = [None, "x", 1.5, True, [1], {"a": 1}, -3, 2**64 - 1]


def _addr(k: int) -> int:
    return BASE + (k % 16) * SLOT


def _size(k: int) -> int:
    return SLOT * (1 + k % 4) - (8 if k % 5 == 4 else 0)


class RankGen:
    """Turns drawn integer tuples into one rank's events, mostly plausible, sometimes broken."""

    def __init__(self, rank: int):
        self.rank = rank
        self.next_id = 1
        self.live: list[int] = []
        self.freed: list[int] = []
        self.next_cid = 0
        self.cids: list = []
        self.seq = {c: 0 for c in COMMS}
        self.graphs: list[str] = []
        self.windows: list[tuple[int, str]] = []
        self.events: list = []

    def emit(self, kind, a, b, c, d):
        ev = self.make(kind, a, b, c, d)
        if ev is None:
            return
        if isinstance(ev, dict) and d >= 13:
            ev = self.break_event(ev, a, b, d)
        self.events.append(ev)

    def break_event(self, ev, a, b, d):
        ev = dict(ev)
        keys = [k for k in ev if k != "ev"] or ["ev"]
        key = keys[a % len(keys)]
        if d == 13:
            del ev[key]
        elif d == 14:
            if key == "ev":  # an unhashable kind makes the whole analysis raise: keep it rare
                ev[key] = [1] if (a, b) == (0, 5) else BAD_VALUES[b % 4]
            else:
                ev[key] = BAD_VALUES[b % len(BAD_VALUES)]
        else:
            ev["extra_field"] = b  # unknown field
            if b % 3 == 0:
                ev["ev"] = BAD_VALUES[(a + b) % 4]  # null / unknown kinds
        return ev

    def bufs(self, a, b, n):
        return [[_addr(a + 3 * i), _size(b + i)] for i in range(n)]

    def make(self, kind, a, b, c, d):
        stream = STREAMS[b % len(STREAMS)]
        if kind == "alloc":
            if c % 7 == 6 and self.live:
                bid = self.live[a % len(self.live)]  # alloc of a live id: malformed
            else:
                bid = self.next_id
                self.next_id += 1
                self.live.append(bid)
            ev = {"ev": "alloc", "id": bid, "addr": _addr(a), "size": _size(c), "stream": stream,
                  "pool": "symm" if c % 3 == 0 else "default"}
            if c % 2:
                ev["site"] = f"m.py:{a % 3}:f"
            if c % 4 == 1:
                ev["stack"] = [f"m.py:{a % 3}:f", "top.py:1:main"]
            return ev
        if kind == "free":
            if self.live and c % 8 != 7:
                bid = self.live.pop(a % len(self.live))
                self.freed.append(bid)
            else:
                bid = 999 + a  # unknown id: malformed
            return {"ev": "free", "id": bid}
        if kind == "free_done":
            bid = self.freed[a % len(self.freed)] if self.freed else a
            return {"ev": "free_done", "id": bid}
        if kind == "record_stream":
            bid = self.live[a % len(self.live)] if self.live else a
            return {"ev": "record_stream", "id": bid, "stream": stream}
        if kind == "launch":
            reads = self.bufs(a, c, c % 3)
            writes = self.bufs(a + 1, c + 1, (c // 3) % 3)
            ev = {"ev": "launch", "stream": stream}
            if reads or c % 2:
                ev["reads"] = reads
            if writes or c % 5 == 0:
                ev["writes"] = writes
            if d % 4 == 0:
                ev["op"] = "aten::add"
            if d == 12:
                ev["reads"] = [[_addr(a), True]] if c % 2 else [[_addr(a)]]
            return ev
        if kind == "coll":
            comm = COMMS[c % 2]
            if d == 12 and self.cids:
                cid = self.cids[a % len(self.cids)]  # duplicate cid
            elif d == 11:
                cid = f"k{self.next_cid}"  # not an integer: goes to SeenIds' set
                self.next_cid += 1
            else:
                cid = self.next_cid
                self.next_cid += 1 + (a == 7)  # a gap now and then
            self.cids.append(cid)
            seq = self.seq[comm]
            self.seq[comm] += 1
            acc = ["r", "w", "rw"][a % 3]
            bufs = [{"addr": _addr(a + 2 * i), "size": _size(c + i), "access": acc} for i in range(1 + c % 2)]
            if d == 10:
                bufs.append({"addr": _addr(a), "size": 8, "access": "x"})
            return {"ev": "coll", "cid": cid, "comm": comm, "seq": seq, "op": "all_reduce",
                    "stream": stream, "bufs": bufs, "site": f"comm.py:{c % 2}:ar"}
        if kind == "coll_done":
            cid = self.cids[a % len(self.cids)] if self.cids and c % 6 else 500 + a
            return {"ev": "coll_done", "cid": cid}
        if kind == "record":
            return {"ev": "record", "event": f"e{a % 3}", "stream": stream}
        if kind == "wait":
            return {"ev": "wait", "event": f"e{a % 4}", "stream": stream}
        if kind == "sync":
            if c % 3 == 0:
                return {"ev": "sync", "stream": stream}
            if c % 3 == 1:
                return {"ev": "sync", "event": f"e{a % 4}"}
            return {"ev": "sync"}
        if kind == "window":
            # rank-dependent placement now and then, for asymmetric-offset
            addr = _addr(a) - (self.rank * SLOT if c % 4 == 3 else 0)
            comm = COMMS[c % 2]
            self.windows.append((addr, comm))
            return {"ev": "window", "addr": addr, "size": SLOT * (2 + b % 6), "comm": comm}
        if kind == "window_free":
            if self.windows and c % 4:
                addr, comm = self.windows.pop(a % len(self.windows))
            else:
                addr, comm = _addr(a), "c9"
            return {"ev": "window_free", "addr": addr, "comm": comm}
        if kind == "graph_begin":
            gid = f"g{a % 3}"
            self.graphs.append(gid)
            return {"ev": "graph_begin", "graph": gid, "stream": stream}
        if kind in ("graph_end", "graph_replay", "graph_free"):
            gid = self.graphs[-1 - a % len(self.graphs)] if self.graphs and c % 5 else f"g{a % 4}"
            ev = {"ev": kind, "graph": gid}
            if kind != "graph_free":
                ev["stream"] = stream
            return ev
        if kind == "step":
            return {"ev": "step", "n": a * 8 + c}
        if kind == "scope":
            return {"ev": "scope", "name": "symm", "enter": bool(c % 2)}
        if kind == "segment":
            return {"ev": "segment", "addr": _addr(a), "size": 4096, "pool": "default"}
        if kind == "segment_free":
            return {"ev": "segment_free", "addr": _addr(a)}
        if kind == "dropped":
            return {"ev": "dropped", "count": a + c, "reason": "queue full"}
        if kind == "hook_error":
            return {"ev": "hook_error", "hook": "alloc"} if c % 2 else {"ev": "hook_error", "count": a}
        if kind == "unknown":
            if c % 4 == 0:
                return b"this line is not json"
            if c % 4 == 1:
                return [1, 2]  # JSON, not an object
            if c % 4 == 2:
                return {"ev": "mystery", "x": a}
            return {"ev": 7}
        raise AssertionError(kind)


step_tuple = st.tuples(st.integers(0, len(KINDS) - 1), st.integers(0, 7), st.integers(0, 7),
                       st.integers(0, 11), st.integers(0, 15))


@st.composite
def scenarios(draw):
    n_ranks = draw(st.integers(1, 3))
    shared = draw(st.lists(step_tuple, min_size=5, max_size=90))
    ranks = []
    for r in range(n_ranks):
        gen = RankGen(r)
        # ranks run mostly the same program (so collectives match), with their own deviations
        own = draw(st.lists(step_tuple, max_size=10))
        for i, (k, a, b, c, d) in enumerate(shared):
            gen.emit(KINDS[k], a, b, c, d if r == 0 or d < 13 else (d + r) % 16)
            if own and i % 7 == 3:
                k2, a2, b2, c2, d2 = own.pop()
                gen.emit(KINDS[k2], a2, b2, c2, d2)
        ranks.append(gen.events)
    mode = draw(st.sampled_from([engine.LOCAL, engine.SUCCESSOR]))
    lenient = draw(st.booleans())
    return ranks, mode, lenient


def random_ranks(seed: int, n_events: int, n_ranks: int) -> list[list]:
    """Larger traces than hypothesis draws comfortably: the same generator, driven by a seed."""
    import random

    rnd = random.Random(seed)
    shared = [(rnd.randrange(len(KINDS)), rnd.randrange(8), rnd.randrange(8), rnd.randrange(12),
               rnd.randrange(16)) for _ in range(n_events)]
    ranks = []
    for r in range(n_ranks):
        gen = RankGen(r)
        for k, a, b, c, d in shared:
            gen.emit(KINDS[k], a, b, c, d if r == 0 or d < 13 or rnd.random() < 0.7 else 0)
        ranks.append(gen.events)
    return ranks


def _dump(ranks) -> str:
    out = []
    for r, events in enumerate(ranks):
        out.append(f"--- rank {r}")
        out += [f"{i + 2:4d} {ev!r}" for i, ev in enumerate(events)]
    return "\n".join(out)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios())
def test_native_matches_python_on_random_traces(native, tmp_path_factory, case):
    ranks, mode, lenient = case
    tmp = tmp_path_factory.mktemp("diff")
    paths = write_ranks(tmp, ranks)
    want, got = both(native, paths, peer_completion=mode, lenient=lenient, max_per_group=0)
    assert got == want, _dump(ranks)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32), st.integers(1, 3), st.sampled_from([engine.LOCAL, engine.SUCCESSOR]))
def test_native_matches_python_on_long_random_traces(native, tmp_path_factory, seed, n_ranks, mode):
    ranks = random_ranks(seed, 400, n_ranks)
    paths = write_ranks(tmp_path_factory.mktemp("long"), ranks)
    want, got = both(native, paths, peer_completion=mode, max_per_group=0)
    assert got == want, f"seed={seed}"


def test_random_traces_do_produce_every_rule(native, tmp_path):
    """The generator above is not vacuous: over fixed seeds it yields findings of every rule and
    malformed lines, so the comparison covers them."""
    rules, errors = set(), 0
    for seed in range(40):
        ranks = random_ranks(seed, 120, 2)
        for mode in (engine.LOCAL, engine.SUCCESSOR):
            want, got = both(native, write_ranks(tmp_path, ranks, tag=f"{seed}{mode}"), peer_completion=mode)
            assert got == want, _dump(ranks)
            if "raised" not in want:
                rules |= set(want["summary"]["by_rule"])
                errors += len(want["errors"])
    assert rules == {"reuse-in-flight", "free-in-flight", "transient-in-window", "unordered-access",
                     "graph-buffer-released", "asymmetric-offset"}
    assert errors > 100


# ------------------------------------------------------------------ hand-picked cases


def test_example_traces_and_cli_output_are_identical(native, capsys):
    """`hazsan check` text, json and sarif output on the shipped examples, byte for byte."""
    from sanitizer.cli import main

    traces = sorted((ROOT / "examples" / "traces").glob("*.jsonl")) + sorted(
        p for p in (ROOT / "examples" / "traces").iterdir() if p.is_dir())
    assert traces, "examples/traces is empty"
    for trace in traces:
        for args in (["--format", "text"], ["--format", "json"], ["--format", "sarif"],
                     ["--format", "json", "--peer-completion", "successor", "--fail-on", "warning"]):
            outs = []
            for name in ("python", "native"):
                with use_engine(name, native):
                    code = main(["check", str(trace), *args])
                outs.append((code, capsys.readouterr().out))
            assert outs[0] == outs[1], (trace, args)


def test_integers_across_the_whole_orjson_range(native, tmp_path):
    """Addresses near 2**64 (orjson's largest) and sums past it, negative addresses, big seq and
    cid values: the native engine holds them as __int128 and must agree exactly."""
    top = 2**64 - 1
    t = Trace()
    t.ev("window", addr=top - 4096, size=8192, comm="tp")
    t.alloc(1, top - 2048, 4096, stream="s0", site="a.py:1:f")
    t.coll(2**63 + 5, stream="comm", seq=2**64 - 2, bufs=[(top - 2048, 4096, "rw")])
    t.free(1)
    t.alloc(2, top - 1024, 1024, stream="s0")
    t.launch("s1", reads=[(-(2**63), 2**64 - 1)], writes=[(top, top)])
    t.alloc(3, -(2**63), 64, stream="s1")
    t.ev("coll_done", cid=2**63 + 5)
    t.ev("coll_done", cid=2**63 + 6)
    t.ev("step", n=2**64 - 1)
    t.ev("dropped", count=2**64 - 1)
    t.ev("dropped", count=-(2**63))
    paths = [t.write(tmp_path / "big.jsonl")]
    for mode in (engine.LOCAL, engine.SUCCESSOR):
        want, got = both(native, paths, peer_completion=mode)
        assert got == want
        assert want["findings"] and want["errors"]


def test_feed_batch_items_that_are_not_events(native, tmp_path):
    """Reader items: None (blank line), a TraceError (bad JSON), any other value."""
    path = Trace().write(tmp_path / "r.jsonl")
    err = TraceError(path, 5, "not JSON: oops")
    items = [None, err, [1], "s", 3, {"ev": "sync"}, {"ev": None}, {"t": 1}, {"ev": "sync", 1: 2}]
    results = []
    for cls in (PYTHON_ANALYZER, native.RankAnalyzer):
        sink = FindingSink()
        an = cls(open_trace(path), sink, engine.CollectiveMatcher(sink, enabled=False))
        problems = []
        an.feed_batch(2, list(items), problems)
        an.trace.close()
        results.append((problems, an.events, dict(an.unknown_fields), dict(an.unknown_kinds)))
    assert results[0] == results[1]
    assert results[0][0][0] == (3, err)


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("tail", ["cut", "cut-in-batch", "no-newline", "blank-lines", "not-json"])
def test_file_level_problems_match(native, tmp_path, gz, tail):
    """What the reader decides per line (blank, not JSON, a last line cut short, a gzip stream
    ending early, a complete last line without its newline), through both native paths."""
    import gzip as gzip_mod

    events = [orjson.dumps(ev) for ev in random_ranks(3, 300, 1)[0] if not isinstance(ev, bytes)]
    body = b"\n".join([orjson.dumps({"hazsan": 1, "rank": 0}), *events])
    if tail == "cut":
        data = body[:-7]  # the last line loses its end and its newline
    elif tail == "cut-in-batch":
        data = b"\n".join([orjson.dumps({"hazsan": 1, "rank": 0}), *events[:10]]) + b'\n{"ev": "sync", "str'
    elif tail == "no-newline":
        data = body  # complete, parses: an ordinary event
    elif tail == "blank-lines":
        data = body.replace(b"\n", b"\n\n  \t\n", 5) + b"\n\n"
    else:
        lines = body.split(b"\n")
        lines[4] = b"{oops"
        lines[9] = b"[1, 2"
        data = b"\n".join(lines) + b"\n"
    path = tmp_path / ("rank0.jsonl.gz" if gz else "rank0.jsonl")
    if gz:
        packed = gzip_mod.compress(data)
        path.write_bytes(packed[: len(packed) - 9] if tail.startswith("cut") else packed)
    else:
        path.write_bytes(data)
    for lenient in (True, False):
        want, got = both(native, [path], lenient=lenient)
        assert got == want
    if tail.startswith("cut"):
        assert any("truncated" in w for w in want["warnings"])
    if tail == "not-json":
        assert sum("not JSON" in e for e in want["errors"]) == 2


def test_unhashable_values_give_the_same_messages(native, tmp_path):
    """Each handler hashes ids, streams, events, comms and graphs at its own point: lists and
    dicts there are 'mistyped field (unhashable type: ...)' problems, with the same text."""
    lines = [
        {"ev": "alloc", "id": [1], "addr": 0, "size": 4, "stream": "s", "pool": "p"},
        {"ev": "alloc", "id": 1, "addr": 0, "size": 4, "stream": {"s": 1}, "pool": "p"},
        {"ev": "free", "id": {"a": 1}},
        {"ev": "free_done", "id": [2]},
        {"ev": "record_stream", "id": [3], "stream": "s"},
        {"ev": "record", "event": [1], "stream": "s0"},
        {"ev": "record", "event": [1], "stream": {"x": 1}},
        {"ev": "wait", "event": [1], "stream": {"x": 1}},
        {"ev": "wait", "event": "never", "stream": {"x": 1}},
        {"ev": "sync", "stream": [1]},
        {"ev": "sync", "event": {"e": 1}},
        {"ev": "window", "addr": 0, "size": 4, "comm": [1]},
        {"ev": "coll", "cid": [1], "comm": "c", "seq": 1, "op": "x", "stream": "s", "bufs": []},
        {"ev": "coll", "cid": 7, "comm": [1], "seq": 1, "op": "x", "stream": "s", "bufs": []},
        {"ev": "coll", "cid": 8, "comm": "c", "seq": 1, "op": "x", "stream": ["s"], "bufs": []},
        {"ev": "coll_done", "cid": {"c": 1}},
        {"ev": "graph_begin", "graph": [1], "stream": "s"},
        {"ev": "graph_begin", "graph": "g", "stream": [1]},
        {"ev": "launch", "stream": [1], "writes": [[0, 4]]},  # captured: its stream is never hashed
        {"ev": "graph_end", "graph": "g"},
        {"ev": "graph_replay", "graph": "g", "stream": [2]},
        {"ev": "graph_replay", "graph": {"g": 1}, "stream": "s"},
        {"ev": "graph_free", "graph": [1]},
        {"ev": "launch", "stream": [1]},
        {"ev": "launch", "stream": "s", "reads": "ab"},
        {"ev": "launch", "stream": "s", "reads": {"ab": 1}},
        {"ev": "launch", "stream": "s", "reads": [[1, 2.0]], "writes": 0},
        {"ev": "scope", "name": "symm", "enter": 1},
        {"ev": "step", "n": True},
    ]
    for mode in (engine.LOCAL, engine.SUCCESSOR):
        want, got = both(native, write_ranks(tmp_path, [lines, lines], tag=mode), peer_completion=mode)
        assert got == want
        assert sum("unhashable" in e for e in want["errors"]) >= 10


# ------------------------------------------------------------------ the C line scanner

# Raw lines aimed at the scanner's edges: each is either taken by it (and must then mean exactly what
# orjson + feed_one make of it) or left to orjson (and must then come out as before).
_ALLOC = b'"id":%d,"addr":%d,"size":64,"stream":"s0","pool":"default"'
TAKEN = 25
SCANNER_LINES = [
    # plain forms the scanner takes (the first TAKEN lines)
    b'{"ev":"alloc",' + _ALLOC % (1, 65536) + b'}',
    b'{"ev":"launch","stream":"s1","reads":[[65536,64]],"writes":[],"site":"a.py:1:f","stack":["a.py:1:f","b.py:2:g"]}',
    b'{"stream":"s1","ev":"launch","writes":[[65536,32],[65600,8]],"op":"gemm"}',  # key order
    b'{"ev":"free","id":1,"t":5,"step":null,"shape":[[[1,2],[3]],[]],"dtype":"bf16"}',  # nested arrays, unread fields
    b'{"ev":"coll","cid":1,"comm":"c0","seq":0,"op":"ar","stream":"c","bufs":[{"addr":65536,"size":64,"access":"rw"}]}',
    b'{"ev":"coll","cid":2,"comm":"c0","seq":1,"op":"ar","stream":"c","bufs":[{"access":"r","size":64,"addr":65536}]}',
    b'{"ev":"coll_done","cid":1}',
    b'{"ev":"alloc",' + _ALLOC % (2, -65536) + b'}',  # negative address
    b'{"ev":"alloc",' + _ALLOC % (3, 999999999999999999) + b'}',  # 18 digits
    b'{"ev":"alloc","id":-0,"addr":0,"size":0,"stream":0,"pool":"p"}',  # -0 is the integer 0
    b'{"ev":"scope","name":"symm","enter":true}',
    b'{"ev":"scope","name":"symm","enter":false,"pool":"\x7f"}',  # DEL needs no escape
    b'{"ev":"step","n":7}',
    b'{"ev":"dropped","count":3}',
    b'{"ev":"hook_error","count":2,"site":"x"}',
    b'{"ev":"sync"}',
    b'{"ev":"sync","stream":"s0","site":""}',  # empty string
    b'{"ev":"launch","stream":"s2","reads":[],"writes":[[65536,-64],[-5,0]]}',
    b'{"ev":"launch","stream":"s2","writes":[' + b",".join(b"[%d,8]" % (65536 + 8 * i) for i in range(16)) + b']}',
    b'{"ev":"launch","stream":"s2","reads":[' + b",".join(b"[%d,8]" % (65536 + 8 * i) for i in range(17)) + b']}',
    b'{"ev":"launch","stream":"s1","reads":[[65536,64],[1,"a"]]}',
    b'{"ev":"launch","stream":"s2","reads":[' + b",".join(b"[%d,8]" % (65536 + 8 * i) for i in range(40)) + b']}',
    b'{"ev":"coll","cid":4,"comm":"c0","seq":3,"op":"ar","stream":"c","bufs":[{"addr":65536,"size":64,"access":"w","x":[]}]}',
    b'{"ev":"launch","stream":{"s":1}}',  # objects where none belong: built, then the handler says no
    b'{"ev":"free_done","id":{"a":{"b":[1,{"c":null}]}}}',
    # left to orjson
    b'{"ev":"scope","name":"symm","enter":nul}',  # literal cut short: not JSON
    b'{"ev":"scope","name":"symm","enter":truex}',
    b'{"ev":"alloc",' + _ALLOC % (4, 9223372036854775807) + b'}',  # 19 digits
    b'{"ev":"alloc",' + _ALLOC % (5, -9223372036854775808) + b'}',
    b'{"ev":"alloc",' + _ALLOC % (6, 18446744073709551615) + b'}',
    b'{"ev":"alloc",' + _ALLOC % (7, 18446744073709551616) + b'}',  # orjson: a float
    b'{"ev":"alloc",' + _ALLOC % (8, 10**30) + b'}',
    b'{"ev":"launch","stream":"s2","reads":[' + b",".join(b"[%d,8]" % (65536 + 8 * i) for i in range(30)) + b',[1,2.5]]}',
    b'{"ev":"launch","stream":"s1","reads":[[65536,64]],"writes":"x"}',  # pairs beside other values
    b'{"ev":"launch","stream":"s1","reads":[[65536,64],[1]],"writes":[[65536,64]]}',
    b'{"ev":"launch","stream":"s1","reads":[[65536,64.0]],"writes":[[65536,64]]}',
    b'{"ev":"launch","stream":"s1","writes":[[65536,64]],"reads":[[1,2,3]]}',
    b'{"ev":"free","id":1.0}',
    b'{"ev":"free","id":1e0}',
    b'{"ev":"free","id":1E+2}',
    b'{"ev":"free","id":01}',  # not JSON
    b'{"ev":"free","id":-}',
    b'{"ev":"free","id":1.}',
    b'{"ev":"free","id":+1}',
    b'{"ev":"alloc","id":9,"addr":65536,"size":64,"stream":"s\\u0030","pool":"p"}',  # escape: stream "s0"
    b'{"ev":"alloc","id":10,"addr":65600,"size":64,"stream":"s0","pool":"p\\"q\\\\r\\n\\t\\/"}',
    b'{"ev":"sync","stream":"\xc3\xbc"}',  # UTF-8
    b'{"ev":"sync","stream":"\\u00fc"}',  # the same stream, escaped
    b'{"ev":"sync","site":"\\ud83d\\ude00"}',  # surrogate pair
    b'{"ev":"sync","site":"\\ud800"}',  # lone surrogate
    b'{"ev":"sync","site":"\xff\xfe"}',  # not UTF-8
    b'{"ev":"sync","site":"a\tb"}',  # raw control character
    b'{"\\u0065v":"sync"}',  # escaped key
    b'{"ev":"sync","ev":"sync"}',  # duplicate keys
    b'{"ev":"free","id":11,"id":12}',
    b'{"ev":"coll","cid":3,"comm":"c0","seq":2,"op":"ar","stream":"c","bufs":[{"addr":65536,"addr":1,"size":64,"access":"w"}]}',
    b'{"ev":"sync","extra":1}',  # unknown field: counted
    b'{"ev":"sync","addr":1}',  # a field the kind does not allow: counted
    b'{"ev":"nonsense","id":1}',  # unknown kind: counted
    b'{"ev":"Sync"}',
    b'{"ev":""}',
    b'{"ev":1}',
    b'{"ev":null}',
    b'{"ev":["sync"]}',
    b'{"id":1}',
    b'{}',
    b'{ }',
    b'[]',
    b'null',
    b'"sync"',
    b'{"ev":"sync"}x',  # trailing garbage
    b'{"ev":"sync"}}',
    b'{"ev":"sync"},',
    b'{"ev":"sync"} ',  # whitespace variants
    b' {"ev":"sync"}',
    b'{ "ev":"sync"}',
    b'{"ev" :"sync"}',
    b'{"ev": "sync"}',
    b'{"ev":"sync" }',
    b'{"ev":"sync",\t"stream":"s0"}',
    b'{"ev":"sync"}\r',
    b'{"ev":"launch","stream":"s1","writes":[ [65536,64] ]}',
    b'{"ev":"launch","stream":"s1","writes":[[65536,64],]}',  # not JSON
    b'{"ev":"launch","stream":"s1","writes":[[65536,64]}',
    b'{"ev":"launch","stream":"s1",}',
    b'{"ev":"launch","stream":"s1"',
    b'{"ev":"launch","stream":"s1","shape":' + b"[" * 40 + b"]" * 40 + b'}',  # deeper than the scanner goes
    b'{"ev":"launch","stream":"s1","shape":' + b"[" * 3000 + b"]" * 3000 + b'}',  # deeper than orjson goes
    b'{"ev":"sync"}\x00',
    b'',  # blank
    b'   ',
]


def _scanner_trace(tmp: Path, lines: list[bytes], cut: bool = False) -> Path:
    body = [orjson.dumps({"hazsan": 1, "rank": 0, "world_size": 1}), *lines]
    p = tmp / "rank0.jsonl"
    p.write_bytes(b"\n".join(body) + (b"" if cut else b"\n"))
    return p


def test_scanner_edge_lines_match_python(native, tmp_path):
    """Every line above alone after a few plausible events, and all of them in one trace: findings,
    problems (same text, same line numbers) and counted warnings as the Python engine gives them;
    and the scanner did take the plain lines and leave the others."""
    prefix = SCANNER_LINES[:7]
    for i, line in enumerate(SCANNER_LINES):
        for mode in (engine.LOCAL, engine.SUCCESSOR):
            before = scan_counts(native)
            want, got = both(native, [_scanner_trace(tmp_path, [*prefix, line, *prefix])], peer_completion=mode)
            assert got == want, (i, line)
            counts = tuple(b - a for a, b in zip(before, scan_counts(native)))
            assert counts == ((15, 0) if i < TAKEN else (14, 1)), (i, line, counts)
    want, got = both(native, [_scanner_trace(tmp_path, SCANNER_LINES * 2)])
    assert got == want
    assert want["errors"] and want["warnings"] and want["findings"]


def test_scanner_takes_the_writers_lines(native, tmp_path):
    """What hazsan's writer produces (orjson.dumps of the schema's events) is read by the scanner
    without orjson, apart from the few lines it must leave (odd values in broken events)."""
    events = [ev for ev in random_ranks(11, 400, 1)[0] if isinstance(ev, dict)]
    plain = [ev for ev in events if "extra_field" not in ev and isinstance(ev.get("ev"), str)
             and all(type(v) in (int, str, list, bool) and (type(v) is not int or abs(v) < 10**18)
                     for v in ev.values())]
    path = write_ranks(tmp_path, [plain])[0]
    before = scan_counts(native)
    want, got = both(native, [path])
    assert got == want
    scanned, left = (b - a for a, b in zip(before, scan_counts(native)))
    assert scanned >= len(plain) - 10 and left <= 10, (scanned, left, len(plain))


def test_scanner_cut_last_line(native, tmp_path):
    """A last line without its newline: taken when complete, a truncation warning when cut in any
    place, whatever the scanner made of the part it saw."""
    full = b'{"ev":"launch","stream":"s1","reads":[[65536,64]],"writes":[[65600,64]],"site":"a.py:3:h"}'
    prefix = SCANNER_LINES[:7]
    for cut in range(1, len(full) + 1):
        path = _scanner_trace(tmp_path, [*prefix, full[:cut]], cut=True)
        want, got = both(native, [path])
        assert got == want, full[:cut]
        assert any("truncated" in w for w in want["warnings"]) == (cut < len(full)), full[:cut]


def _json_text(value, draw) -> bytes:
    """`value` as JSON, written in one of the ways a JSON writer may: spacing, escapes, numbers as
    floats, keys in any order, keys repeated."""
    if isinstance(value, bool) or value is None:
        return orjson.dumps(value)
    if isinstance(value, int):
        form = draw(st.sampled_from(["plain"] * 6 + ["float", "exp", "big"]))
        if form == "float":
            return b"%d.0" % value
        if form == "exp":
            return b"%de0" % value
        if form == "big":
            return b"%d" % (value + draw(st.sampled_from([2**63, 2**64, -(2**64), 10**19])))
        return b"%d" % value
    if isinstance(value, float):
        return orjson.dumps(value)
    if isinstance(value, str):
        form = draw(st.sampled_from(["plain"] * 6 + ["ascii", "escape", "unicode"]))
        if form == "ascii":
            return json.dumps(value, ensure_ascii=True).encode()
        if form == "escape" and value:
            return b'"\\u%04x' % ord(value[0]) + orjson.dumps(value[1:])[1:]
        if form == "unicode":
            return orjson.dumps(value + "\u00e9\u4e2d\U0001f600")
        return orjson.dumps(value)
    sep = draw(st.sampled_from([b","] * 6 + [b", ", b" ,", b",\t"]))
    if isinstance(value, list):
        return b"[" + sep.join(_json_text(v, draw) for v in value) + b"]"
    assert isinstance(value, dict)
    items = list(value.items())
    if draw(st.integers(0, 3)) == 0:
        items = draw(st.permutations(items))
    if items and draw(st.integers(0, 9)) == 0:
        k, v = items[draw(st.integers(0, len(items) - 1))]
        items.append((k, draw(st.sampled_from([v, 0, "s9", None]))))  # a repeated key
    colon = draw(st.sampled_from([b":"] * 6 + [b": ", b" :"]))
    return b"{" + sep.join(orjson.dumps(k) + colon + _json_text(v, draw) for k, v in items) + b"}"


@st.composite
def rewritten_traces(draw):
    seed = draw(st.integers(0, 2**32))
    events = random_ranks(seed, 60, 1)[0]
    lines = []
    for ev in events:
        if isinstance(ev, bytes) or draw(st.integers(0, 2)) == 0:
            lines.append(ev if isinstance(ev, bytes) else orjson.dumps(ev))
            continue
        line = _json_text(ev, draw)
        tail = draw(st.sampled_from([b""] * 8 + [b" ", b"\r", b"x", b"}", b",", b"\t\t"]))
        lines.append(line + tail)
    return lines


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(rewritten_traces(), st.sampled_from([engine.LOCAL, engine.SUCCESSOR]))
def test_scanner_matches_python_on_rewritten_traces(native, tmp_path_factory, lines, mode):
    """Random traces whose lines are written in every JSON variant (spacing, escapes, unicode,
    floats and big integers for integers, permuted and repeated keys, trailing bytes)."""
    path = _scanner_trace(tmp_path_factory.mktemp("rewritten"), lines)
    want, got = both(native, [path], peer_completion=mode)
    assert got == want, b"\n".join(lines).decode("utf-8", "replace")


# ------------------------------------------------------------------ the engine's own tests, native


def _pytest_outcomes(files: list[str], engine_name: str) -> dict[str, str]:
    """{test id: PASSED/FAILED/...} of a pytest run over `files` with one backend selected."""
    code = (
        "import sys, pytest\n"
        "import sanitizer.rules.engine as e, sanitizer.rules.native as n\n"
        "if sys.argv[1] == 'native':\n"
        "    assert n.available, n.reason\n"
        "    e.RankAnalyzer = n.RankAnalyzer\n"
        "sys.exit(pytest.main(sys.argv[2:]))\n"
    )
    env = dict(os.environ, HAZSAN_ENGINE=engine_name)
    r = subprocess.run(
        [sys.executable, "-c", code, engine_name, "-q", "-rA", "--tb=no", "-p", "no:cacheprovider",
         "--hypothesis-seed=0", *files,
         "--deselect", "tests/test_check_cli.py::test_memory_stays_bounded_by_in_flight_work"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    outcomes = {}
    for line in r.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS") and "::" in rest:
            outcomes[rest.split(" - ")[0].strip()] = word
    assert outcomes, r.stdout[-3000:] + r.stderr[-2000:]
    return outcomes


def test_engine_test_files_give_the_same_outcomes_with_the_native_backend(native):
    """tests/test_engine_rules.py, test_check_cli.py, test_example_traces.py and the engine property
    test, run once per backend: every test must come out the same (the property test pins cases
    where the engine itself still disagrees with the reference: those fail on both). The one CLI
    test that reads the Python engine's internals (an.inflight, an.cids) is left out; its native
    twin is test_memory_stays_bounded_by_in_flight_work below."""
    files = ["tests/test_engine_rules.py", "tests/test_check_cli.py", "tests/test_example_traces.py"]
    files += [f for f in ("tests/test_engine_property.py",) if (ROOT / f).exists()]
    python, native_ = _pytest_outcomes(files, "python"), _pytest_outcomes(files, "native")
    differ = {t: (python.get(t), native_.get(t)) for t in python.keys() | native_.keys()
              if python.get(t) != native_.get(t)}
    assert not differ, differ
    assert sum(v == "PASSED" for v in python.values()) >= 50


# ------------------------------------------------------------------ memory, leaks, selection


def test_memory_stays_bounded_by_in_flight_work(native, tmp_path):
    """Native twin of test_check_cli's: nothing grows with the number of steps."""
    t = Trace()
    for step in range(500):
        t.ev("step", n=step)
        for layer in range(10):
            bid = step * 100 + layer
            addr = 0x100000 + layer * 8192
            t.alloc(bid, addr, 4096, stream="s0")
            t.launch("s0", writes=[(addr, 4096)])
            t.ev("record", event="e", stream="s0")
            t.ev("wait", event="e", stream="comm")
            t.coll(step * 10 + layer, stream="comm", bufs=[(addr, 4096, "rw")])
            t.ev("record", event="f", stream="comm")
            t.ev("wait", event="f", stream="s0")
            t.free(bid)
        t.ev("sync")
    trace = open_trace(t.write(tmp_path / "long.jsonl"))
    sink = FindingSink()
    an = native.RankAnalyzer(trace, sink, engine.CollectiveMatcher(sink, enabled=False))
    peak = 0
    for first, items in trace.batches(512):
        an.feed_batch(first, items, [])
        s = an._stats()
        assert s["inflight"] <= 20
        peak = max(peak, s["inflight_stored"])
    s = an._stats()
    assert sink.findings == [] and s["live"] == 0 and s["colls_in_flight"] == 0 and s["cids_other"] == 0
    assert peak <= 2 * (128 + 20)  # two streams, compacted
    assert an.events == 500 * 82


def test_no_reference_leaks(native, tmp_path):
    """Run a trace with findings, errors and graphs many times, and one of the scanner's edge lines
    (each given up on at its own point): allocated blocks must not grow."""
    paths = write_ranks(tmp_path, random_ranks(7, 400, 2))
    (tmp_path / "edges").mkdir()
    edges = _scanner_trace(tmp_path / "edges", SCANNER_LINES * 3)

    def run():
        with use_engine("native", native):
            for mode in (engine.LOCAL, engine.SUCCESSOR):
                a = engine.analyze(paths, peer_completion=mode, lenient=True)
                assert a.findings
            assert any("malformed" in w for w in engine.analyze([edges], lenient=True).warnings)

    for _ in range(3):
        run()
    gc.collect()
    before = sys.getallocatedblocks()
    for _ in range(30):
        run()
    gc.collect()
    assert sys.getallocatedblocks() - before < 300


def test_engine_selection(native, monkeypatch):
    monkeypatch.setenv("HAZSAN_ENGINE", "python")
    assert native.analyzer_class() is PYTHON_ANALYZER
    monkeypatch.setenv("HAZSAN_ENGINE", "native")
    assert native.analyzer_class() is native.RankAnalyzer
    monkeypatch.delenv("HAZSAN_ENGINE")
    assert native.engine_name() == "native"  # auto: native when built
    monkeypatch.setenv("HAZSAN_ENGINE", "fast")
    with pytest.raises(ValueError, match="HAZSAN_ENGINE must be one of"):
        native.analyzer_class()


def test_without_the_extension_native_py_falls_back(tmp_path):
    """With the extension absent, native.py loads, says why, and selects the Python engine."""
    code = (
        "import sys; sys.modules['sanitizer.rules._fastengine'] = None\n"
        "from sanitizer.rules import native, engine\n"
        "assert not native.available and 'not built' in native.reason, native.reason\n"
        "assert native.analyzer_class() is engine.RankAnalyzer\n"
        "try:\n    native.analyzer_class('native')\nexcept RuntimeError as e:\n    print('refused:', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HAZSAN_ENGINE"}  # auto
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "refused: HAZSAN_ENGINE=native, but C engine accelerator not built" in r.stdout


def test_a_stale_build_is_refused():
    """An extension built from another _fastengine.c (an old build left in a checkout) is not
    used: native.py compares the source digest compiled into it."""
    code = (
        "import sys, types\n"
        "sys.modules['sanitizer.rules._fastengine'] = types.SimpleNamespace(SOURCE_DIGEST='0' * 16)\n"
        "from sanitizer.rules import native, engine\n"
        "assert not native.available and 'older _fastengine.c' in native.reason, native.reason\n"
        "assert native.analyzer_class() is engine.RankAnalyzer\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HAZSAN_ENGINE"}  # auto
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr


def test_build_hook_failure_is_a_warning_not_an_error(tmp_path, capsys):
    """hatch_build.build raises NativeBuildError on a compile error; the hook turns any failure
    into a warning and leaves build_data alone (the install goes on with the Python engine)."""
    sys.path.insert(0, str(ROOT))
    try:
        import hatch_build
    finally:
        sys.path.remove(str(ROOT))
    src = tmp_path / "sanitizer" / "rules" / "_fastengine.c"
    src.parent.mkdir(parents=True)
    src.write_text("#include <Python.h>\nthis is not C;\n")
    with pytest.raises(hatch_build.NativeBuildError, match="not C|error"):
        hatch_build.build(tmp_path, out=tmp_path / "x.so")

    class FakeHook(hatch_build.NativeEngineBuildHook):
        def __init__(self):
            pass

        root = str(tmp_path)
        target_name = "wheel"

    build_data = {"force_include": {}, "pure_python": True}
    FakeHook().initialize("standard", build_data)
    assert build_data == {"force_include": {}, "pure_python": True}
    assert "could not build its C engine accelerator" in capsys.readouterr().err
