"""The engine's per-event dispatch (issue 21): every kind by number, the fields of the frequent
kinds read from their slots in the compiled build, the binary format's records as the JSON Lines
ones. Each path must give the findings of the plain one (fields by name, handlers by table)."""
from __future__ import annotations

import json

import pytest

from sanitizer.rules.driver import analyze, load_engine
from sanitizer.trace import binary
from sanitizer.trace import events as E
from engine_scenarios import BACKENDS, many_streams


def _write(tmp_path, events, fmt, name="rank0"):
    header = {"hazsan": 1, "rank": 0, "world_size": 1}
    if fmt == "binary":
        path = tmp_path / f"{name}.hzs"
        path.write_bytes(binary.jsonl_to_binary(header, events))
    else:
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in [header, *events]))
    return path


def _trace() -> list:
    """Every kind of event, on a few streams, with collisions of every pair rule and a transient."""
    events = many_streams(7, 6, 1200)
    events += [
        {"ev": "step", "n": 3, "phase": "decode", "tokens": 8},
        {"ev": "scope", "name": "symm", "enter": True, "pool": "symm", "comm": "tp"},
        {"ev": "alloc", "id": "t", "addr": (1 << 32) + 4096, "size": 64, "stream": "s0", "pool": "symm"},
        {"ev": "free", "id": "t"},
        {"ev": "scope", "name": "symm", "enter": False},
        {"ev": "segment", "addr": 1 << 33, "size": 4096, "pool": "default"},
        {"ev": "graph_begin", "graph": "g", "stream": "s1"},
        {"ev": "launch", "stream": "s1", "writes": [[(1 << 32) + 16, 16]]},
        {"ev": "graph_end", "graph": "g", "stream": "s1"},
        {"ev": "graph_replay", "graph": "g", "stream": "s2"},
        {"ev": "graph_free", "graph": "g"},
        {"ev": "segment_free", "addr": 1 << 33},
        {"ev": "window_free", "addr": (1 << 32) + 4096, "comm": "tp"},
        {"ev": "dropped", "count": 2},
        {"ev": "sync"},
    ]
    return events


def _findings(path, backend, peer):
    a = analyze([str(path)], peer_completion=peer, max_per_group=0, engine=backend)
    assert not a.errors, a.errors
    out = [{k: v for k, v in f.to_dict().items() if k != "file"} for f in a.findings]
    return out, {k: v for k, v in a.summary.items() if k not in ("engine", "warnings")}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("peer", ["local", "successor"])
def test_binary_records_give_the_json_lines_findings(tmp_path, backend, peer):
    events = _trace()
    jsonl = _findings(_write(tmp_path, events, "jsonl"), backend, peer)
    assert len(jsonl[0]) > 50
    assert jsonl == _findings(_write(tmp_path, events, "binary"), backend, peer)


@pytest.mark.skipif("compiled" not in BACKENDS, reason="the compiled engine is not built")
@pytest.mark.parametrize("fmt", ["jsonl", "binary"])
def test_fields_from_slots_give_the_findings_by_name(tmp_path, monkeypatch, fmt):
    """The compiled engine reads the frequent kinds' fields from their slots (where msgspec keeps
    them); with that turned off (every entry without slots: fields by name) the findings are the
    same, in the same order."""
    eng = load_engine("compiled")[0]
    path = _write(tmp_path, _trace(), fmt)
    fast = _findings(path, "compiled", "local")
    assert any(entry[1] for entry in eng.KIND_CODES.values())
    for kind, entry in list(eng.KIND_CODES.items()):
        monkeypatch.setitem(eng.KIND_CODES, kind, (entry[0], None, entry[2]))
    assert _findings(path, "compiled", "local") == fast


@pytest.mark.skipif("compiled" not in BACKENDS, reason="the compiled engine is not built")
def test_compiled_engine_reads_the_frequent_kinds_from_slots():
    """Guards the fast path against a silent fallback (a msgspec whose fields are not plain
    slots would give None): the JSON Lines classes and the binary records both have slots."""
    eng = load_engine("compiled")[0]
    for kind in ("launch", "alloc", "free", "record", "wait", "coll", "free_done", "record_stream"):
        number, slots, json_cls = eng.KIND_CODES[E.BY_KIND[kind]]
        assert number > 0 and slots and all(type(o) is int and o > 0 for o in slots), kind
        number_b, slots_b, json_b = eng.kind_entry(binary.BY_KIND[kind])
        assert (number_b, json_b) == (number, json_cls) and slots_b and len(slots_b) == len(slots), kind
    assert eng.KIND_CODES[E.Window][0] == -1 and eng.KIND_CODES[E.Sync][1] is None
