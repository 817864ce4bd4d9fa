"""What makes capture's cost per op lower (issue 30) without changing what it records: call-site
text cached per code location, buffered events the garbage collector lets go of, storages keyed
without a storage object, blocks that are their storage's weak reference."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sanitizer.capture.sites import SiteFinder


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if line.rstrip().endswith(marker) and "_line_of" not in line:
                return i
    raise AssertionError(marker)


def test_site_text_is_right_for_each_line_of_one_code_object_and_cached_per_location():
    finder = SiteFinder("site")

    def two():
        first = finder.where()       # SITE-ONE
        second = finder.where()      # SITE-TWO
        return first, second

    runs = [two() for _ in range(3)]
    one, two_ = _line_of("# SITE-ONE"), _line_of("# SITE-TWO")
    for first, second in runs:
        assert first[0].endswith(f"test_capture_op_cost.py:{one}:two") and first[1] is None
        assert second[0].endswith(f"test_capture_op_cost.py:{two_}:two")
    # one text per code location, made once: the same string object every time
    assert runs[0][0][0] is runs[2][0][0] and runs[0][1][0] is runs[2][1][0]
    (entry,) = [e for e in finder._names.values() if e[0] is two.__code__]
    assert sorted(entry[2].values()) == sorted({runs[0][0][0], runs[0][1][0]})

    full = SiteFinder("full")

    def nested():
        return full.where()          # SITE-FULL

    site, stack = nested()
    assert site.endswith(f":{_line_of('# SITE-FULL')}:nested") and stack[0] == site
    assert stack[1].endswith(":test_site_text_is_right_for_each_line_of_one_code_object_and_cached_per_location")


def test_adding_an_internal_package_forgets_the_cached_texts():
    finder = SiteFinder("site")

    def here():
        return finder.where()[0]

    assert here().endswith(":here")
    finder.add_internal_dir(os.path.dirname(__file__))
    assert not (here() or "").endswith(":here")


PROGRAM = """
import gc, json, sys, torch
from sanitizer.capture import runtime
cap = runtime.active()
a = torch.ones(16)
for _ in range(2000):
    b = a + 1.0
gc.collect()
gc.collect()    # (frees of storages the first one collected are written during it)
hot = [ev for ev in cap.writer._buf if type(ev) is not dict]
kinds = sorted({ev[0] for ev in hot})
# sparse and mkldnn tensors have no storage to key: their ops still run and dense results are recorded
s = torch.ones(4).to_sparse()
d = (s * 2).to_dense()
m = torch.ones(4).to_mkldnn()
md = m.to_dense()
print(json.dumps({"hot": len(hot), "kinds": kinds, "types": sorted({type(ev).__name__ for ev in hot}),
                  "tracked": sum(gc.is_tracked(ev) for ev in hot),
                  "shapes_tracked": sum(gc.is_tracked(ev[14]) for ev in hot if len(ev) > 14),
                  "d": d.tolist(), "md": md.tolist()}))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("opcost")
    prog = tmp / "prog.py"
    prog.write_text(textwrap.dedent(PROGRAM))
    env = {**os.environ, "HAZSAN": "1", "HAZSAN_LEVEL": "alloc", "HAZSAN_DIR": str(tmp / "tr"),
           "HAZSAN_FLUSH_SECONDS": "600", "HAZSAN_TRACE_FORMAT": "jsonl"}
    r = subprocess.run([sys.executable, str(prog)], env=env, capture_output=True, text=True, timeout=300, cwd=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    (trace,) = list((tmp / "tr").iterdir())
    events = [json.loads(x) for x in trace.read_text().splitlines()[1:] if x.strip()]
    return json.loads(r.stdout.strip().splitlines()[-1]), events


def test_buffered_hot_events_are_untracked_by_the_collector(run):
    out, _ = run
    # 2000 allocations and 2000 frees waiting in the buffer, none of them left for the collector to
    # promote (a buffered list would be: each full collection would walk them all)
    assert out["hot"] >= 3990 and out["types"] == ["tuple"] and out["kinds"] == [5, 6]
    assert out["tracked"] == 0 and out["shapes_tracked"] == 0


def test_ops_on_tensors_without_a_storage_run_and_their_dense_results_are_recorded(run):
    out, events = run
    assert out["d"] == [2.0] * 4 and out["md"] == [1.0] * 4
    assert not [ev for ev in events if ev["ev"] == "hook_error"]
    ops = [ev["op"] for ev in events if ev["ev"] == "alloc"]
    assert "aten.to_dense.default" in ops or "aten._to_dense.default" in ops
    assert any(op.startswith("aten._to_dense") or op.startswith("aten.to_mkldnn") or op.startswith("aten.to_dense")
               for op in ops)
    # every free names a block allocated before it, once
    allocated, freed = set(), set()
    for ev in events:
        if ev["ev"] == "alloc":
            allocated.add(ev["id"])
        elif ev["ev"] == "free":
            assert ev["id"] in allocated and ev["id"] not in freed
            freed.add(ev["id"])
    assert len(freed) >= 1999


def test_tuple_events_are_written_as_the_list_events_were():
    """The block table's events are tuples now (their shape and stack too): the same bytes in the
    binary trace, the same JSON Lines, the same interned values, as the lists they replace."""
    import orjson

    from sanitizer.trace import binary as B

    alloc = [B.ORDER["alloc"][0], 1, 4096, 64, "cpu", "default", None, None, None, 5, None, "a.py:1:f",
             ["a.py:1:f", "b.py:2:g"], "aten.empty", [16, 2], "float32"]
    free = [B.ORDER["free"][0], 1, 7]
    launch = [B.ORDER["launch"][0], "cpu", [[4096, 64]], [[8192, 128]], 6, None, "a.py:1:f", None, "aten.add.Tensor"]
    as_tuples = [tuple(tuple(v) if type(v) is list else v for v in ev) for ev in (alloc, free, launch)]
    as_tuples[2] = as_tuples[2][:2] + (((4096, 64),), ((8192, 128),)) + as_tuples[2][4:]
    assert B.encode_frames([alloc, free, launch], B.ValueTable()) == B.encode_frames(as_tuples, B.ValueTable())
    for lst, tup in zip((alloc, free, launch), as_tuples):
        assert orjson.dumps(B.to_dict(tup)) == orjson.dumps(B.to_dict(lst))
    # a value of the wrong type in a tuple still goes as the map it stands for
    bad = list(as_tuples[0])
    bad[B.position("alloc", "site")] = 12345
    assert B.to_item(tuple(bad), B.ValueTable()) == B.to_dict(bad)
    # a shape that is not all ints is not interned
    odd = list(as_tuples[0])
    odd[B.position("alloc", "shape")] = (16, "x")
    assert type(B.to_item(tuple(odd), B.ValueTable())) is dict
