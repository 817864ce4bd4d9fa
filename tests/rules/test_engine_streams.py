"""Many streams (issue 21): the engine's answers when more streams have work in flight than it walks.

Past `CROWD` streams with work in flight the engine stops walking every stream per access and
finds the streams an access collides with through one address index of all in-flight buffers
(`RankAnalyzer.wide`); the host clock takes in only the streams that changed since it last did
(`StreamClocks.dirty`). These tests check the answers, never the speed (benchmarks/streams_scaling.py
measures that): against the brute-force reference on many-stream traces, against the walk itself
(the same findings in the same order, with the index forced on from the first stream), and the
clocks against a dense vector-clock model.
"""
from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from engine_scenarios import (BACKENDS, SEMANTICS, Scenario, analyze_scenario, check_against_reference,
                              identity, many_streams, scenarios)
from reference_model import reference_findings
from sanitizer.rules.driver import analyze, load_engine

BASE = 1 << 32


class _Crowd:
    """The engine's CROWD set to `value` in the build `backend` runs (0: the wide index from the
    first stream in flight on, so every access takes that path)."""

    def __init__(self, backend, value):
        self.module = load_engine(backend)[0]
        self.value = value

    def __enter__(self):
        self.saved = self.module.CROWD
        self.module.CROWD = self.value

    def __exit__(self, *exc):
        self.module.CROWD = self.saved


def _findings(scenario: Scenario, backend) -> list:
    """Every finding as its JSON object, in order; the file (a fresh temporary one) left out."""
    return [{k: v for k, v in f.to_dict().items() if k != "file"} for f in analyze_scenario(scenario, backend).findings]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("peer", ["local", "successor"])
@pytest.mark.parametrize("seed,n_streams", [(1, 80), (2, 300), (3, 40)])
def test_many_streams_match_the_brute_force_reference(backend, peer, seed, n_streams):
    """More streams in flight than CROWD (so the wide index answers), findings as the reference's."""
    check_against_reference(Scenario([many_streams(seed, n_streams, 1500)], peer), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("peer", ["local", "successor"])
@pytest.mark.parametrize("seed,n_streams", [(4, 80), (5, 6)])
def test_wide_index_gives_the_walks_findings_in_its_order(backend, peer, seed, n_streams):
    """The same trace with the wide index from the first stream on (CROWD 0) and never (CROWD
    above the streams): every finding, in order, identical (the order decides which are listed
    when a group overflows)."""
    scenario = Scenario([many_streams(seed, n_streams, 3000)], peer)
    with _Crowd(backend, 10 ** 9):
        walk = _findings(scenario, backend)
    with _Crowd(backend, 0):
        wide = _findings(scenario, backend)
    assert len(walk) > 100
    assert wide == walk


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_launch_per_stream_all_on_the_same_bytes(backend):
    """The issue's hostile shape, with collisions: every launch on a stream of its own, writing
    the same 16 bytes: each collides with every earlier one, named once each, in stream order."""
    n = 150
    events = [{"ev": "launch", "stream": f"s{i}", "writes": [[BASE, 16]], "op": f"k{i}"} for i in range(n)]
    result = analyze_scenario(Scenario([events], "local"), backend)
    got = [(f.line, f.op.line) for f in result.findings]
    assert got == [(i + 2, j + 2) for i in range(n) for j in range(i)]
    assert {identity(f) for f in result.findings} == \
        {identity(f) for f in reference_findings([events], peer_completion="local", semantics=SEMANTICS)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("crowd", [0, 1])
@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_traces_with_the_wide_index_match_the_reference(backend, crowd, scenario):
    """The property test's random traces (graphs, windows, successor mode, record_stream) with the
    wide index in use from the first or second stream in flight."""
    with _Crowd(backend, crowd):
        check_against_reference(scenario, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_wide_index_holds_exactly_the_work_in_flight(backend):
    """State, not speed: past CROWD streams the index holds every in-flight buffer of every
    stream; syncs retire work from it; with few streams left it is dropped."""
    eng = load_engine(backend)[0]
    from sanitizer.rules.findings import FindingSink
    from sanitizer.trace.events import Launch, Sync

    sink = FindingSink()
    an = eng.RankAnalyzer("r.jsonl", 0, sink, eng.CollectiveMatcher(sink, enabled=False))
    n = eng.CROWD * 3
    line = 1
    for i in range(n):
        line += 1
        an.feed(line, Launch(stream=i, writes=[[BASE + 64 * i, 16], [BASE + 64 * i + 32, 16]]))
    assert an.inflight.wide is not None and len(an.inflight.wide) == 2 * n and len(an.inflight.streams) == n
    for i in range(n - eng.CROWD // 4 + 1):
        line += 1
        an.feed(line, Sync(stream=i))
        if an.inflight.wide is not None:
            assert len(an.inflight.wide) == 2 * len(an.inflight.streams)
    assert an.inflight.wide is None and len(an.inflight.streams) == eng.CROWD // 4 - 1
    assert all(op.wide_serial == 0 for fl in an.inflight.streams.values() for op in fl.ops)
    assert sink.findings == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed,n_streams,n_events", [(1, 40, 10), (2, 40, 10), (3, 40, 10), (4, 4, 3), (5, 3, 2)])
def test_host_clock_matches_a_dense_model(backend, seed, n_streams, n_events):
    """StreamClocks takes into the host only the streams that changed since it last did; a dense
    model merges every stream at a device sync and every entry at each sync. Same host clock,
    and each call names exactly the streams whose host entry grew. With few streams and events the
    same stored base (shared by the records between two waits of a stream) is merged again and
    again, and bases are replaced often."""
    if backend == "compiled":
        import sanitizer.order.clocks as clocks_mod  # the compiled engine cimports it

        clocks = clocks_mod.StreamClocks()
    else:
        clocks = load_engine(backend)[0].StreamClocks()  # the interpreted clocks it imported
    rng = random.Random(seed)
    streams = list(range(n_streams))
    dense = {s: {} for s in streams}
    dense_events: dict = {}
    host: dict = {}

    def merge(target, other):
        grew = set()
        for k, v in other.items():
            if v > target.get(k, 0):
                target[k] = v
                grew.add(k)
        return grew

    for _ in range(4000):
        r = rng.random()
        s = rng.choice(streams)
        if r < 0.4:
            epoch = clocks.enqueue(s)
            dense[s][s] = dense[s].get(s, 0) + 1
            assert epoch == dense[s][s]
        elif r < 0.55:
            e = rng.randrange(n_events)
            clocks.record(e, s)
            dense_events[e] = dict(dense[s])
        elif r < 0.7:
            e = rng.randrange(n_events)
            assert clocks.wait(s, e) == (e in dense_events)
            if e in dense_events:
                merge(dense[s], dense_events[e])
        elif r < 0.85:
            grew = clocks.sync_stream(s)
            assert set(grew or ()) == merge(host, dense[s])
        elif r < 0.9:
            grew = clocks.sync_device()
            want = set()
            for clock in dense.values():
                want |= merge(host, clock)
            assert set(grew or ()) == want
        else:
            e = rng.randrange(n_events)
            if e in dense_events:
                grew = clocks.host_learns(clocks.events[e])
                assert set(grew or ()) == merge(host, dense_events[e])
        assert clocks.host == host
        for x in streams:
            for y in streams:
                want = max(dense[x].get(y, 0), host.get(y, 0))
                assert clocks.knows(x, y) == want


def test_hostile_trace_through_the_cli_shape(tmp_path):
    """The issue's trace (a launch per stream, 16 bytes each, all distinct) checks clean, every
    event counted, with the wide index in use (more than CROWD streams)."""
    n = 2000
    path = tmp_path / "rank0.jsonl"
    with open(path, "w") as fh:
        fh.write(json.dumps({"hazsan": 1, "rank": 0}) + "\n")
        for i in range(n):
            fh.write(json.dumps({"ev": "launch", "stream": f"s{i}", "writes": [[BASE + 16 * i, 16]]}) + "\n")
    result = analyze([str(path)])
    assert not result.errors and result.summary["events"] == n and result.findings == []
