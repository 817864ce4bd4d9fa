"""`hazsan export --perfetto`: the file follows the Trace Event Format's documented structure
(phases, timestamps, ids, nesting) and holds what the traces hold."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from sanitizer.cli import main
from sanitizer.rules.driver import analyze

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "examples" / "traces"
PHASES = {"X", "B", "E", "i", "I", "C", "M", "s", "t", "f", "b", "e", "n"}
METADATA = {"process_name", "process_sort_index", "thread_name", "thread_sort_index"}


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    d = tmp_path_factory.mktemp("perfetto")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gen_decode_trace.py"), "--events", "15000",
                    "--ranks", "2", "--inject", "4", "--out", str(d / "traces")], check=True, capture_output=True)
    for extra in ("meta.json", "expected.json"):
        (d / "traces" / extra).unlink()
    out = d / "trace.json"
    assert main(["export", "--perfetto", str(d / "traces"), "-o", str(out)]) == 0
    return d / "traces", json.loads(out.read_bytes())


def check_structure(doc):
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    assert doc.get("displayTimeUnit") in ("ms", "ns")
    events = doc["traceEvents"]
    named_pids, named_threads = set(), set()
    for ev in events:
        assert ev["ph"] in PHASES, ev
        assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int) and isinstance(ev["name"], str), ev
        if ev["ph"] == "M":
            assert ev["name"] in METADATA and isinstance(ev["args"], dict), ev
            if ev["name"] == "process_name":
                named_pids.add(ev["pid"])
            if ev["name"] == "thread_name":
                named_threads.add((ev["pid"], ev["tid"]))
            continue
        assert isinstance(ev["ts"], (int, float)) and ev["ts"] >= 0, ev
        if ev["ph"] == "X":
            assert isinstance(ev["dur"], (int, float)) and ev["dur"] >= 0, ev
        if ev["ph"] == "i":
            assert ev["s"] in ("g", "p", "t"), ev
        if ev["ph"] == "C":
            assert ev["args"] and all(isinstance(v, (int, float)) for v in ev["args"].values()), ev
        if ev["ph"] in ("s", "t", "f"):
            assert isinstance(ev["id"], int) and ev["cat"], ev
    # every process and thread that has events is named
    for ev in events:
        if ev["ph"] != "M":
            assert ev["pid"] in named_pids, ev
            if ev["ph"] == "X":
                assert (ev["pid"], ev["tid"]) in named_threads, ev
    # nesting: complete slices on one thread never partly overlap (here: they follow each other)
    slices = defaultdict(list)
    for ev in events:
        if ev["ph"] == "X":
            slices[(ev["pid"], ev["tid"])].append(ev)
    for track in slices.values():
        track.sort(key=lambda e: e["ts"])
        for a, b in zip(track, track[1:]):
            assert b["ts"] >= a["ts"] + a["dur"] - 1e-6, (a, b)
    # flows: one start and one finish per id, each bound inside a slice of its own thread
    flows = defaultdict(list)
    for ev in events:
        if ev["ph"] in ("s", "t", "f"):
            flows[ev["id"]].append(ev)
    for fid, evs in flows.items():
        phases = Counter(e["ph"] for e in evs)
        assert phases["s"] == 1 and phases["f"] == 1, evs
        assert len({e["cat"] for e in evs}) == 1
        for e in evs:
            assert any(x["ts"] <= e["ts"] <= x["ts"] + x["dur"] for x in slices[(e["pid"], e["tid"])]), e
    return events


def test_export_structure_and_content(decode):
    traces, doc = decode
    events = check_structure(doc)
    analysis = analyze([str(traces)], max_per_group=0)
    instants = [e for e in events if e["ph"] == "i"]
    assert Counter(e["name"] for e in instants) == Counter(f.rule for f in analysis.findings)
    colls = [e for e in events if e["ph"] == "X" and e["cat"] == "coll"]
    launches = [e for e in events if e["ph"] == "X" and e["cat"] == "launch"]
    steps = [e for e in events if e["ph"] == "X" and e["cat"] == "step"]
    raw = [json.loads(line) for p in sorted(traces.glob("rank*.jsonl")) for line in p.read_text().splitlines()[1:]]
    assert len(colls) == sum(1 for e in raw if e["ev"] == "coll")
    assert len(launches) == sum(1 for e in raw if e["ev"] == "launch")
    assert len(steps) == sum(1 for e in raw if e["ev"] == "step")
    # the same collective on both ranks is one flow
    n_flows = len({e["id"] for e in events if e["ph"] == "s"})
    assert n_flows == len(colls) // 2
    # the memory counter ends at the bytes still allocated, per pool
    for pid, path in enumerate(sorted(traces.glob("rank*.jsonl"))):
        live = {}
        for line in path.read_text().splitlines()[1:]:
            e = json.loads(line)
            if e["ev"] == "alloc":
                live[e["id"]] = (e["pool"], e["size"])
            elif e["ev"] == "free":
                live.pop(e["id"], None)
        want = Counter()
        for pool, size in live.values():
            want[pool] += size
        last = [e for e in events if e["ph"] == "C" and e["pid"] == pid][-1]["args"]
        assert {k: v for k, v in last.items() if v} == dict(want)
    # one track per stream and rank
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    for pid in (0, 1):
        assert {(pid, "host"), (pid, "stream 1"), (pid, "stream 2")} <= names


def test_export_of_the_examples(tmp_path):
    out = tmp_path / "t.json"
    assert main(["export", "--perfetto", str(TRACES), "-o", str(out)]) == 0
    events = check_structure(json.loads(out.read_bytes()))
    assert {"reuse-in-flight", "graph-buffer-released", "unordered-access"} <= {e["name"] for e in events if e["ph"] == "i"}
    assert main(["export", "--perfetto", str(TRACES / "asymmetric-offset"), "-o", str(out)]) == 0
    events = check_structure(json.loads(out.read_bytes()))
    assert [e["name"] for e in events if e["ph"] == "i"] == ["asymmetric-offset"]


def test_export_refuses_malformed_input(tmp_path, capsys):
    (tmp_path / "rank0.jsonl").write_text('{"hazsan": 1, "rank": 0}\n{"ev": "free", "id": 9}\n')
    assert main(["export", "--perfetto", str(tmp_path), "-o", str(tmp_path / "t.json")]) == 2
    assert "rank0.jsonl:2" in capsys.readouterr().err


@pytest.mark.skipif(not os.environ.get("PERFETTO_TP_BIN"),
                    reason="PERFETTO_TP_BIN not set (the perfetto package fetches trace_processor from the network)")
def test_trace_processor_loads_it(decode, tmp_path):
    tp_mod = pytest.importorskip("perfetto.trace_processor")
    _, doc = decode
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    tp = tp_mod.TraceProcessor(trace=str(path), config=tp_mod.TraceProcessorConfig(bin_path=os.environ["PERFETTO_TP_BIN"]))
    try:
        n = next(iter(tp.query("select count(*) as n from slice"))).n
    finally:
        tp.close()
    assert n == sum(1 for e in doc["traceEvents"] if e["ph"] == "X")
